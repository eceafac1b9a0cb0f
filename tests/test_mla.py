"""Multi-head latent attention (DeepSeek-V2 / V3, Kimi K2): the snapshot caches each token's
latent and shared RoPE key, not per-head keys and values. The parity contract at the engine
level and as served, and every engine feature over a cache of that shape (the prefix cache,
preemption, n > 1, speculative decoding, sessions, the compiled layers, quantization)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest
from safetensors import safe_open

from neuronpy.arch.kv import assemble_batch
from neuronpy.arch.llama import LlamaModel
from neuronpy.arch.weights import TensorParallelError, take_weights
from neuronpy.engine.engine import RequestStream, kv_bytes_per_token
from tests.factories import fixture_builder, hf_model, make_engine, tokenizer
from tests.servers import fixture_model, run_server
from tests.test_engine_parity import (
    MAX_TOKENS,
    TEXTS,
    concurrently,
    greedy,
    one_at_a_time,
    summary,
)
from tests.test_hybrid import check_concurrent_equals_sequential_equals_transformers

pytestmark = pytest.mark.anyio

MLA: tuple[str, ...] = fixture_builder().MLA_FIXTURES


@pytest.mark.parametrize("family", MLA)
def test_the_cache_holds_one_latent_and_one_rope_key_per_token(family: str) -> None:
    """Per layer and token: kv_lora_rank + rope values, no values apart, whatever the batch;
    per-head keys (16 + 8 rotated dims) and values (16) would take four times as many."""
    model = LlamaModel.from_hf(hf_model(family))
    c, m = model.config, model.config.mla
    assert m is not None and (c.num_kv_heads, c.head_dim, m.key_dim) == (1, 40, 40)
    snapshot, _ = model.prefill([5, 17, 42, 99, 3])
    assert [tuple(k.shape) for k in snapshot.keys] == [(1, 1, 5, 40)] * 2
    assert [tuple(v.shape) for v in snapshot.values] == [(1, 1, 5, 0)] * 2
    batch = assemble_batch([snapshot, model.prefill([7, 8])[0]])
    assert batch.groups[0].values[0].shape[-1] == 0
    assert kv_bytes_per_token(model) == 2 * 40 * 4
    expanded = 2 * c.num_heads * ((m.nope_dim + m.rope_dim) + m.v_dim) * 4
    assert expanded == 4 * kv_bytes_per_token(model)


@pytest.mark.parametrize("family", MLA)
async def test_concurrent_equals_sequential_equals_transformers(family: str) -> None:
    await check_concurrent_equals_sequential_equals_transformers(family)


async def test_compiled_and_int8_keep_the_contract() -> None:
    """The compiled layers (attention an opaque operator returning each head's latent) give
    the eager replies batched; the int8 mode gives each request's alone reply in a batch."""
    family = "tiny-deepseek-v3"
    tok = tokenizer(family)
    jobs = [(tok.encode(t), greedy(m)) for t, m in zip(TEXTS, MAX_TOKENS, strict=True)]
    async with make_engine(family, max_in_flight=1, compile="off") as serial:
        expected = await one_at_a_time(serial, jobs)
    async with make_engine(family, max_in_flight=8, compile="on") as engine:
        assert engine.model.compiled
        got = await concurrently(engine, jobs)
    assert [summary(c) for c in got] == [summary(c) for c in expected]
    async with make_engine(family, max_in_flight=1, compile="off", quantize="int8") as serial:
        alone = await one_at_a_time(serial, jobs)
    async with make_engine(family, max_in_flight=8, compile="off", quantize="int8") as engine:
        together = await concurrently(engine, jobs)
    assert [summary(c) for c in together] == [summary(c) for c in alone]


# (gpt-oss's sliding layers and sinks, and GLM-4.5's grouped routing, over the same features)
@pytest.mark.parametrize("family", ["tiny-deepseek-v2", "tiny-gpt-oss", "tiny-glm4-moe"])
async def test_prefix_cache_n_copies_and_preemption(family: str) -> None:
    """A prompt that starts with a cached one reuses its latents and answers as without the
    cache; n = 3 greedy copies give the single reply; a KV budget that preempts rows (their
    latents set aside and brought back) changes nobody's output."""
    tok = tokenizer(family)
    first = tok.encode(TEXTS[0] * 3)
    longer = first + tok.encode(TEXTS[1])
    async with make_engine(family, prefix_cache=False, compile="off") as plain:
        fresh = [await plain.complete(p, greedy(16)) for p in (first, longer)]
    async with make_engine(family, compile="off") as engine:
        got = [await engine.complete(p, greedy(16)) for p in (first, longer)]
        stats = engine.stats()
        alone = await engine.complete(first, greedy(20))
        copies: list[list[int]] = [[], [], []]

        async def read(i: int, stream: RequestStream) -> None:
            async for event in stream:
                copies[i].extend(event.token_ids)

        async with anyio.create_task_group() as tg:
            for i, stream in enumerate(engine.submit_many(first, greedy(20), 3)):
                tg.start_soon(read, i, stream)
    assert [summary(c) for c in got] == [summary(c) for c in fresh]
    assert stats.prefix_cache_hits >= 1 and stats.prefix_cache_reused_tokens >= len(first)
    assert copies == [alone.token_ids] * 3
    jobs = [(tok.encode(t), greedy(40)) for t in TEXTS]
    async with make_engine(family, max_in_flight=1, compile="off") as serial:
        expected = await one_at_a_time(serial, jobs)
    budget = 120 * kv_bytes_per_token(LlamaModel.from_hf(hf_model(family)))  # 120 tokens' KV
    async with make_engine(family, max_in_flight=6, kv_budget=budget, compile="off") as engine:
        together = await concurrently(engine, jobs, stagger=False)
        preempted = engine.stats().preemptions
    assert [summary(c) for c in together] == [summary(c) for c in expected]
    assert preempted >= 1


async def test_speculative_decoding_gives_the_replies_without_it() -> None:
    """A verify step writes each draft's latent; a rejected draft's columns are given back:
    greedy replies are byte-identical with and without speculation."""
    family = "tiny-deepseek-v3"
    tok = tokenizer(family)
    jobs = [(tok.encode(t), greedy(m)) for t, m in zip(TEXTS, MAX_TOKENS, strict=True)]
    async with make_engine(family, max_in_flight=1, compile="off") as plain:
        expected = await one_at_a_time(plain, jobs)
    for draft in (family, "tiny-deepseek-v2"):
        config = dict(speculative="draft", num_speculative_tokens=3, compile="off")
        async with make_engine(family, draft=draft, max_in_flight=8, **config) as engine:
            got = await concurrently(engine, jobs)
            stats = engine.stats()
        assert [summary(c) for c in got] == [summary(c) for c in expected]
        assert stats.spec_draft_tokens > 0
        if draft == family:
            assert stats.spec_accepted_tokens == stats.spec_draft_tokens


def test_tensor_parallelism_is_refused_by_name() -> None:
    with pytest.raises(TensorParallelError, match="latent attention"):
        take_weights(hf_model("tiny-deepseek-v3"), rank=0, world_size=2)


def test_a_session_saves_the_latents_and_continues_after_a_restart(tmp_path: Path) -> None:
    """A session file holds each layer's latents (values of width 0); a next turn on a new
    server restores them and answers as a server without sessions does."""
    family = "tiny-deepseek-v3"
    prompt = tokenizer(family).encode(TEXTS[2])

    def complete(url: str, ids: list[int], **extra: object) -> Any:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        return api.completions.create(
            model=family, prompt=ids, max_tokens=12, temperature=0.0, extra_body=extra
        )

    with run_server(fixture_model(family), sessions_dir=tmp_path) as server:
        complete(server.url, prompt, session="talk")
    with safe_open(str(tmp_path / "talk.safetensors"), framework="pt") as f:
        assert f.get_slice("layers.0.keys").get_shape()[1:] == [1, len(prompt) + 11, 40]
        assert f.get_slice("layers.0.values").get_shape()[-1] == 0
        saved = json.loads(f.metadata()["token_ids"])
    turn = [*saved, 5, 6, 7]
    with run_server(fixture_model(family, prefix_cache=False)) as plain:
        want = complete(plain.url, turn).choices[0].text
    with run_server(fixture_model(family), sessions_dir=tmp_path) as restarted:
        before = restarted.stats()
        got = complete(restarted.url, turn, session={"name": "talk", "save": False})
        after = restarted.stats()
    assert got.choices[0].text == want
    assert after["sessions_restored"] - before["sessions_restored"] == 1
    assert after["prefill_tokens"] - before["prefill_tokens"] == 3


def test_a_deepseek2_gguf_file_is_refused_with_what_to_serve_instead(tmp_path: Path) -> None:
    """Neither neuronpy nor transformers reads llama.cpp's deepseek2 files: the refusal says
    so rather than pointing at a transformers path that would fail too."""
    import gguf

    from neuronpy.errors import ModelLoadError
    from neuronpy.loading import load_gguf_checkpoint

    path = tmp_path / "DeepSeek-V2-Lite-Q4_K_M.gguf"
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"deepseek2.*nor does transformers"):
        load_gguf_checkpoint(str(path))
