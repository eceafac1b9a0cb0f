"""Random-weight checkpoints built by transformers, of shapes and seeds no other test uses,
served as a user serves a model directory: the `openai` client's replies, alone and four at
once, are transformers' greedy replies to the chat template's prompt."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from neuronpy.engine import harmony
from tests.factories import fixture_builder, tokenizer
from tests.servers import engine_loader, run_server
from tests.test_engine_parity import TEXTS

MAX_TOKENS = 16


def deepseek_v3(vocab: int, eos: int, pad: int) -> PretrainedConfig:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=6,
        q_lora_rank=40,
        kv_lora_rank=48,
        qk_nope_head_dim=8,
        qk_rope_head_dim=16,
        v_head_dim=24,
        n_routed_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=24,
        n_shared_experts=2,
        first_k_dense_replace=1,
        n_group=3,
        topk_group=2,
        routed_scaling_factor=1.5,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )


def glm4_moe(vocab: int, eos: int, pad: int) -> PretrainedConfig:
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        vocab_size=vocab,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        hidden_size=80,
        intermediate_size=144,
        num_hidden_layers=3,
        num_attention_heads=5,
        num_key_value_heads=1,
        head_dim=24,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 50000.0,
            "partial_rotary_factor": 0.5,
        },
        use_qk_norm=True,
        attention_bias=True,
        n_routed_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=40,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.8,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )


def gpt_oss(vocab: int, eos: int, pad: int) -> PretrainedConfig:
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=vocab,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        hidden_size=96,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        num_local_experts=6,
        num_experts_per_tok=2,
        swiglu_limit=5.0,
        attention_bias=True,
        tie_word_embeddings=False,
    )


# model_type -> (its config builder, the seed its weights are drawn with, its tokenizer's
# fixture: gpt-oss's speaks harmony, whose template and stop tokens a user's checkpoint has)
BUILDERS: dict[str, tuple[Callable[[int, int, int], PretrainedConfig], int, str]] = {
    "deepseek_v3": (deepseek_v3, 4242, "tiny-llama"),
    "glm4_moe": (glm4_moe, 4343, "tiny-llama"),
    "gpt_oss": (gpt_oss, 4444, "tiny-harmony-tokenizer"),
}


def build(model_type: str, out: Path) -> Path:
    builder = fixture_builder()
    make, seed, tokenizer_dir = BUILDERS[model_type]
    tok = tokenizer(tokenizer_dir)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    model = AutoModelForCausalLM.from_config(make(len(tok), eos, pad)).to(torch.float32).eval()
    builder.init_weights(model, seed)
    model.generation_config.eos_token_id = eos
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def expected_text(tok: Any, ids: list[int]) -> str:
    """What a reply of `ids` reads as: its text without special tokens; under harmony, whose
    framing tokens the server keeps where a reply does not follow the framing (a random model's
    does not), with those, up to the stop token (docs/api.md: gpt-oss)."""
    if tok.chat_template is None or "<|channel|>" not in tok.chat_template:
        return tok.decode(ids, skip_special_tokens=True)
    kept = {tok.convert_tokens_to_ids(t) for t in harmony.TOKENS} - set(harmony_stops(tok))
    ids = list(itertools.takewhile(lambda t: t not in harmony_stops(tok), ids))
    pieces, run = [], []
    for t in ids:
        if t in kept:
            pieces += [tok.decode(run, skip_special_tokens=True), tok.convert_ids_to_tokens(t)]
            run = []
        else:
            run.append(t)
    return "".join([*pieces, tok.decode(run, skip_special_tokens=True)])


def harmony_stops(tok: Any) -> list[int]:
    return [tok.convert_tokens_to_ids(t) for t in (harmony.RETURN, harmony.CALL)]


async def alone_and_four_at_once(
    url: str, model: str, messages: list[list[dict[str, str]]], max_tokens: int
) -> tuple[list[str], list[str]]:
    """The `openai` client's greedy replies to four conversations, one after another, then
    the four at once."""

    async def ask(api: openai.AsyncOpenAI, m: list[dict[str, str]]) -> str:
        out = await api.chat.completions.create(
            model=model,
            messages=m,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=0,
        )
        return out.choices[0].message.content or ""

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x") as api:
        alone = [await ask(api, m) for m in messages]
        together: list[str] = [""] * len(messages)

        async def one(i: int) -> None:
            together[i] = await ask(api, messages[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(messages)):
                tg.start_soon(one, i)
    return alone, together


def transformers_reply(path: Path, prompt: list[int]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("model_type", list(BUILDERS))
def test_served_as_a_user_would_alone_and_four_at_once(model_type: str, tmp_path: Path) -> None:
    path = build(model_type, tmp_path / model_type)
    tok = tokenizer(BUILDERS[model_type][2])
    messages = [[{"role": "user", "content": t}] for t in TEXTS[:4]]

    with run_server({model_type: engine_loader(path)}) as server:
        alone, together = anyio.run(
            alone_and_four_at_once, server.url, model_type, messages, MAX_TOKENS
        )
    assert together == alone
    for m, reply in zip(messages, alone, strict=True):
        prompt = tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
        ids = tok.encode(prompt, add_special_tokens=False)
        assert reply == expected_text(tok, transformers_reply(path, ids))
