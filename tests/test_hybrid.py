"""Hybrid families, whose layers keep fixed-size states besides KV (arch/mixer.py): Qwen3-Next
and Qwen3.5 (Gated DeltaNet), Granite 4 (Mamba2), LFM2 (short convolutions). The parity
contract at the engine level and as served, the prefix cache's boundary rule, prompts
prefilled in chunks that ride decode steps, and what these models refuse by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest
import torch
from safetensors import safe_open

from neuronpy.arch.kv import KvSnapshot
from neuronpy.arch.llama import LlamaModel
from neuronpy.arch.mixer import STATE_BLOCK
from neuronpy.arch.weights import TensorParallelError, take_weights
from neuronpy.engine.engine import RequestStream
from neuronpy.engine.types import FinishReason
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
from tests.test_served_families import alone_and_four_at_once

pytestmark = pytest.mark.anyio

HYBRIDS: tuple[str, ...] = fixture_builder().HYBRID_FIXTURES
LAYERS = {
    "tiny-qwen3-next": ("gdn", "attention", "gdn"),
    "tiny-qwen3.5": ("gdn", "attention", "gdn"),
    "tiny-granite-hybrid": ("mamba2", "attention", "mamba2"),
    "tiny-lfm2": ("conv", "attention", "conv"),
}


def transformers_greedy(family: str, ids: list[int], max_tokens: int) -> list[int]:
    model = hf_model(family)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


def long_prompt(family: str, tokens: int) -> list[int]:
    return tokenizer(family).encode(" ".join(TEXTS * 8))[:tokens]


def test_the_fixtures_have_the_layers_they_are_for() -> None:
    assert set(HYBRIDS) == set(LAYERS)
    for family, kinds in LAYERS.items():
        model = LlamaModel.from_hf(hf_model(family))
        assert model.config.layer_types == kinds
        assert model.num_kv_layers == 1 and model.num_state_layers == 2
        assert model.has_states and model.state_bytes() > 0


@pytest.mark.parametrize("family", HYBRIDS)
async def test_concurrent_equals_sequential_equals_transformers(family: str) -> None:
    await check_concurrent_equals_sequential_equals_transformers(family)


async def check_concurrent_equals_sequential_equals_transformers(family: str) -> None:
    """Six requests joining and leaving mid-flight give, byte for byte, what each gives alone,
    and transformers' own greedy tokens."""
    tok = tokenizer(family)
    jobs = [(tok.encode(t), greedy(m)) for t, m in zip(TEXTS, MAX_TOKENS, strict=True)]
    async with make_engine(family, max_in_flight=1, compile="off") as serial:
        expected = await one_at_a_time(serial, jobs)
    async with make_engine(family, max_in_flight=8, compile="off") as engine:
        got = await concurrently(engine, jobs)
        stats = engine.stats()
    assert [summary(c) for c in got] == [summary(c) for c in expected]
    assert stats.max_batch_size >= 3 and stats.rebatches >= 4
    for (ids, params), c in zip(jobs, got, strict=True):
        reference = transformers_greedy(family, ids, params.max_tokens)
        assert c.token_ids == reference[: len(c.token_ids)]
        if c.finish_reason is FinishReason.LENGTH:
            assert len(c.token_ids) == params.max_tokens


async def test_compiled_equals_eager_batched() -> None:
    """The compiled layers (the mixers an opaque operator of the graph) keep the contract."""
    family = "tiny-qwen3-next"
    tok = tokenizer(family)
    jobs = [(tok.encode(t), greedy(m)) for t, m in zip(TEXTS, MAX_TOKENS, strict=True)]
    async with make_engine(family, max_in_flight=1, compile="off") as serial:
        expected = await one_at_a_time(serial, jobs)
    async with make_engine(family, max_in_flight=8, compile="on") as engine:
        assert engine.model.compiled
        got = await concurrently(engine, jobs)
    assert [summary(c) for c in got] == [summary(c) for c in expected]


@pytest.mark.parametrize("family", ["tiny-qwen3.5", "tiny-granite-hybrid"])
async def test_a_long_prompt_rides_decode_steps_in_block_chunks(family: str) -> None:
    """A prompt of 300 tokens joining two decoding rows is prefilled in chunks that ride their
    steps; its chunks end at STATE_BLOCK multiples (a mixer's own cuts), so it gives the bits
    of a prompt prefilled whole, and no row's output changes."""
    tok = tokenizer(family)
    prompt = long_prompt(family, 300)
    jobs = [(tok.encode(TEXTS[0]), greedy(40)), (tok.encode(TEXTS[4]), greedy(40))]
    jobs.append((prompt, greedy(12)))
    async with make_engine(family, max_in_flight=1, compile="off") as serial:
        expected = await one_at_a_time(serial, jobs)
    async with make_engine(family, max_in_flight=4, prefill_chunk=32, compile="off") as engine:
        chunks: list[tuple[int, int]] = []
        forward_step = engine.model.forward_step

        def recorded(batch, tokens, riding=(), counts=None):  # type: ignore[no-untyped-def]
            for chunk in riding:
                start = chunk.past.length if chunk.past is not None else 0
                chunks.append((start, start + len(chunk.token_ids)))
            return forward_step(batch, tokens, riding, counts)

        engine.model.forward_step = recorded  # type: ignore[method-assign]
        got = await concurrently(engine, jobs)
    assert [summary(c) for c in got] == [summary(c) for c in expected]
    assert chunks, "no chunk rode a decode step"
    assert max(end for _, end in chunks) == len(prompt)
    ends = {len(ids) for ids, _ in jobs}  # a prompt's last chunk ends where it does
    for start, end in chunks:
        assert start % STATE_BLOCK == 0 and (end % STATE_BLOCK == 0 or end in ends)


@pytest.mark.parametrize("family", ["tiny-qwen3-next", "tiny-lfm2"])
async def test_the_prefix_cache_reuses_a_prompt_at_its_last_block_boundary(family: str) -> None:
    """A prompt's states hold after its last token only: the cache keeps the prompt up to its
    last STATE_BLOCK boundary (the states kept there during its prefill) and a later prompt
    that starts with all of those tokens restores them; the reply is what it is without the
    cache."""
    first = long_prompt(family, 150)
    longer = first + long_prompt(family, 230)[150:]
    async with make_engine(family, prefix_cache=False, compile="off") as plain:
        fresh = [await plain.complete(p, greedy(16)) for p in (first, longer)]
    async with make_engine(family, compile="off") as engine:
        cold = await engine.complete(first, greedy(16))
        again = await engine.complete(first, greedy(16))
        extended = await engine.complete(longer, greedy(16))
        stats = engine.stats()
        worker = await engine.worker_stats()
    assert [summary(c) for c in (cold, extended)] == [summary(c) for c in fresh]
    assert summary(again) == summary(fresh[0])
    boundary = len(first) // STATE_BLOCK * STATE_BLOCK  # 128
    assert stats.prefix_cache_hits == 2
    assert stats.prefix_cache_reused_tokens == 2 * boundary
    assert worker.cached_snapshots >= 1


async def test_a_prefix_that_is_not_a_whole_entry_is_not_reused() -> None:
    """A prompt that shares only part of a cached entry's tokens cannot use its states."""
    family = "tiny-lfm2"
    first = long_prompt(family, 140)
    other = first[:100] + tokenizer(family).encode(" something else entirely, and more") * 2
    async with make_engine(family, compile="off") as engine:
        await engine.complete(first, greedy(4))
        await engine.complete(other, greedy(4))
        assert engine.stats().prefix_cache_hits == 0


async def test_n_copies_and_preemption_keep_each_rows_states() -> None:
    """n = 3 greedy copies from one prefill each give the single request's text; a KV budget
    that preempts rows (their snapshots, states included, set aside and brought back) changes
    nobody's output."""
    family = "tiny-qwen3.5"
    tok = tokenizer(family)
    ids = tok.encode(TEXTS[2])
    async with make_engine(family, compile="off") as engine:
        alone = await engine.complete(ids, greedy(20))
        copies: list[list[int]] = [[], [], []]

        async def read(i: int, stream: RequestStream) -> None:
            async for event in stream:
                copies[i].extend(event.token_ids)

        async with anyio.create_task_group() as tg:
            for i, stream in enumerate(engine.submit_many(ids, greedy(20), 3)):
                tg.start_soon(read, i, stream)
    assert copies == [alone.token_ids] * 3
    jobs = [(tok.encode(t), greedy(40)) for t in TEXTS]
    async with make_engine(family, max_in_flight=1, compile="off") as serial:
        expected = await one_at_a_time(serial, jobs)
    # (KV for 120 tokens: one attention layer, 2 heads of 16 dims, float32 K and V)
    budget = 120 * 2 * 2 * 16 * 4
    async with make_engine(family, max_in_flight=6, kv_budget=budget, compile="off") as engine:
        got = await concurrently(engine, jobs, stagger=False)
        preempted = engine.stats().preemptions
    assert [summary(c) for c in got] == [summary(c) for c in expected]
    assert preempted >= 1


def test_tensor_parallelism_is_refused_by_name() -> None:
    with pytest.raises(TensorParallelError, match="tensor parallelism"):
        take_weights(hf_model("tiny-granite-hybrid"), rank=0, world_size=2)


def test_a_session_saves_the_states_and_continues_after_a_restart(tmp_path: Path) -> None:
    """A session file holds the states beside the KV (after the conversation's last token):
    a next turn that starts with all of its tokens, on a new server, restores them and
    answers as a server without sessions does; one that starts with part of them is
    prefilled whole (a state cannot be cut shorter)."""
    family = "tiny-granite-hybrid"
    prompt = tokenizer(family).encode(TEXTS[2])

    def complete(url: str, ids: list[int], **extra: object) -> Any:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        return api.completions.create(
            model=family, prompt=ids, max_tokens=12, temperature=0.0, extra_body=extra
        )

    with run_server(fixture_model(family), sessions_dir=tmp_path) as server:
        complete(server.url, prompt, session="talk")
    with safe_open(str(tmp_path / "talk.safetensors"), framework="pt") as f:
        assert {"states.0.0", "states.0.1", "states.1.0", "states.1.1"} <= set(f.keys())
        assert f.get_tensor("states.0.1").dtype == torch.float32  # the SSM state
        saved = json.loads(f.metadata()["token_ids"])
    assert saved[: len(prompt)] == prompt and len(saved) == len(prompt) + 11
    turns = ([*saved, 5, 6, 7], [*saved[:-2], 5, 6, 7])  # all of it, and part of it
    with run_server(fixture_model(family, prefix_cache=False)) as plain:
        expected = [complete(plain.url, ids).choices[0].text for ids in turns]
    for ids, want, restores in zip(turns, expected, (1, 0), strict=True):
        with run_server(fixture_model(family), sessions_dir=tmp_path) as restarted:
            before = restarted.stats()
            got = complete(restarted.url, ids, session={"name": "talk", "save": False})
            after = restarted.stats()
        assert got.choices[0].text == want
        assert after["sessions_restored"] - before["sessions_restored"] == restores
        prefilled = after["prefill_tokens"] - before["prefill_tokens"]
        assert prefilled == len(ids) - (len(saved) if restores else 0)


def test_a_snapshot_prefix_shorter_than_its_states_is_refused() -> None:
    """A state cannot be cut to a shorter prefix, as KV can: the worker refuses to."""
    from neuronpy.errors import WorkerError
    from neuronpy.worker.worker import _prefix_of

    model = LlamaModel.from_hf(hf_model("tiny-lfm2"))
    snapshot, _ = model.prefill([5, 6, 7, 8, 9])
    assert isinstance(snapshot, KvSnapshot) and len(snapshot.states) == 2
    with pytest.raises(WorkerError, match="fixed-size"):
        _prefix_of(snapshot, 3)


def test_served_as_a_user_would_four_at_once() -> None:
    """`neuronpy serve --model DIR` of a hybrid checkpoint: the openai client's four requests at
    once get what each gets alone, transformers' greedy reply to the chat template's prompt."""
    family = "tiny-qwen3-next"
    tok = tokenizer(family)
    messages = [[{"role": "user", "content": t}] for t in TEXTS[:4]]

    with run_server(fixture_model(family)) as server:
        alone, together = anyio.run(alone_and_four_at_once, server.url, family, messages, 16)
    assert together == alone
    for m, reply in zip(messages, alone, strict=True):
        prompt = tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
        ids = tok.encode(prompt, add_special_tokens=False)
        reference = transformers_greedy(family, ids, 16)
        assert reply == tok.decode(reference, skip_special_tokens=True)


def test_a_qwen3_5_checkpoint_with_its_vision_tower_serves_its_language_model(
    tmp_path: Path,
) -> None:
    """Qwen3.5's checkpoints are image-text models (`qwen3_5`, the text model under
    `model.language_model`): loaded as a user's directory would be, the language model is
    what runs, with transformers' logits."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from neuronpy.loading import load_pretrained

    text = hf_model("tiny-qwen3.5").config.to_dict()
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64)
    torch.manual_seed(0)
    full = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision))
    full.eval().save_pretrained(tmp_path)
    tokenizer("tiny-qwen3.5").save_pretrained(tmp_path)
    loaded = load_pretrained(str(tmp_path), dtype="float32")
    model = LlamaModel.from_hf(loaded.hf_model)
    assert model.config.model_type == "qwen3_5_text" and model.has_states
    ids = [5, 17, 42, 99, 3, 250, 71]
    with torch.no_grad():
        reference = full(torch.tensor([ids])).logits[0]
    _, hidden = model.prefill(ids)
    torch.testing.assert_close(model.logits(hidden), reference, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("draft", ["tiny-qwen3-next", "tiny-granite-hybrid"])
async def test_speculative_decoding_gives_the_replies_without_it(draft: str) -> None:
    """A verify step advances the fixed-size states through every draft, and the rows'
    states return to their last accepted token's: greedy replies are byte-identical with and
    without speculation. The target drafting for itself has every draft stand; another model
    drafting has most rejected (the draft model's own states are trimmed the same way)."""
    family = "tiny-qwen3-next"
    tok = tokenizer(family)
    jobs = [(tok.encode(t), greedy(m)) for t, m in zip(TEXTS, MAX_TOKENS, strict=True)]
    async with make_engine(family, max_in_flight=1, compile="off") as plain:
        expected = await one_at_a_time(plain, jobs)
    config = dict(speculative="draft", num_speculative_tokens=3, compile="off")
    async with make_engine(family, draft=draft, max_in_flight=8, **config) as engine:
        got = await concurrently(engine, jobs)
        stats = engine.stats()
    assert [summary(c) for c in got] == [summary(c) for c in expected]
    assert stats.spec_draft_tokens > 0
    if draft == family:
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens
    else:
        assert 0 <= stats.spec_accepted_tokens < stats.spec_draft_tokens
