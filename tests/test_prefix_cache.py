"""The prefix cache: its index, parity (the cache never changes a greedy output), the byte
budget, and a two-turn chat over HTTP with the real openai client."""

from __future__ import annotations

import anyio
import openai
import pytest

from neuronpy.engine.engine import Engine
from neuronpy.engine.prefix_cache import PrefixIndex
from neuronpy.engine.types import Completion, SamplingParams
from neuronpy.server.prompts import render_chat
from tests.factories import make_engine, tokenizer
from tests.servers import fixture_model, run_server

TEXTS = [
    "Once upon a time there was a very long prompt that keeps going and going on",
    "The quick brown fox jumps over the lazy dog, and then the dog wakes up",
    "Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12",
]


def greedy(max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def summary(c: Completion) -> tuple:
    return (c.text, c.token_ids, c.completion_tokens, c.prompt_tokens, c.finish_reason)


# ---- the index ----------------------------------------------------------------------------------


def test_index_finds_the_longest_stored_prefix_within_the_limit() -> None:
    index = PrefixIndex(budget_bytes=1000, block=4)
    assert index.insert(1, range(10), 10) == []
    assert index.insert(2, [*range(6), 50, 51, 52], 10) == []
    assert index.lookup([*range(9), 99]) == (1, 9)
    assert index.lookup([*range(6), 50, 51, 60]) == (2, 8)
    assert index.lookup(range(10), limit=9) == (1, 9)
    assert index.lookup([0, 1, 2, 9, 9]) is None  # shares less than a block
    assert index.lookup([7, 7, 7, 7, 7]) is None


def test_index_drops_prefixes_of_a_new_entry_and_skips_covered_ones() -> None:
    index = PrefixIndex(budget_bytes=1000, block=4)
    assert index.insert(1, range(6), 6) == []
    assert index.insert(2, [*range(4), 7, 7, 7, 7], 8) == []  # a branch: both stay
    assert index.insert(3, range(9), 9) == [1]  # 1 is a prefix of the new one
    assert index.insert(6, range(20), 20) == [3]
    assert index.insert(4, range(12), 12) == [4]  # covered: storing it adds nothing
    assert index.insert(5, range(3), 3) == [5]  # shorter than a block
    assert len(index) == 2 and index.bytes == 28


def test_index_evicts_least_recently_used_past_the_budget() -> None:
    index = PrefixIndex(budget_bytes=30, block=4)
    for i in range(3):
        assert index.insert(i, [i] * 8, 10) == []
    index.lookup([0] * 8)  # 0 is now the most recently used
    assert index.insert(3, [3] * 8, 10) == [1]
    assert index.insert(4, [4] * 8, 20) == [2, 0]
    assert index.bytes == 30 and index.insert(5, [5] * 8, 31) == [5]  # larger than the budget


# ---- the engine ---------------------------------------------------------------------------------


async def _turns(engine: Engine, family: str) -> list[Completion]:
    """Three conversations of two turns each, then the first prompts again."""
    tok = tokenizer(family)
    out = []
    for text in TEXTS:
        first = tok.encode(text)
        reply = await engine.complete(first, greedy())
        out.append(reply)
        follow_up = [*first, *reply.token_ids, *tok.encode(" Then")]
        out.append(await engine.complete(follow_up, greedy()))
    for text in TEXTS:
        out.append(await engine.complete(tok.encode(text), greedy()))
    return out


@pytest.mark.anyio
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen3"])
async def test_parity_cache_on_equals_cache_off(family: str) -> None:
    async with make_engine(family, prefix_cache=False) as plain:
        expected = await _turns(plain, family)
        off = plain.stats()
    async with make_engine(family) as cached:
        got = await _turns(cached, family)
        on = cached.stats()
        stored = await cached.worker_stats()
    assert [summary(c) for c in got] == [summary(c) for c in expected]
    assert off.prefix_cache_hits == 0 and off.prefill_tokens == off.prompt_tokens
    assert on.prefix_cache_hits == 6 and on.prefix_cache_misses == 3  # second turns, repeats
    assert on.prefill_tokens == on.prompt_tokens - on.prefix_cache_reused_tokens
    assert on.prefill_tokens < off.prefill_tokens / 2
    assert stored.snapshots == 0 and stored.cached_snapshots == on.prefix_cache_entries > 0
    assert stored.cached_bytes == on.prefix_cache_bytes


@pytest.mark.anyio
async def test_parity_with_concurrent_joins() -> None:
    """Requests sharing a prefix, run together (rows restoring a prefix join mid-flight)."""
    tok = tokenizer()
    base = tok.encode(TEXTS[0])
    jobs = [
        ([*base, *tok.encode(f" and {word}")], greedy(8 + i))
        for i, word in enumerate(["then", "so", "yet", "but", "or"])
    ]

    async def run_all(engine: Engine) -> list[Completion]:
        await engine.complete(base, greedy(4))  # warms the cache (and the plain engine alike)
        results: list[Completion | None] = [None] * len(jobs)

        async def one(i: int) -> None:
            await anyio.sleep(i * 0.02)
            results[i] = await engine.complete(*jobs[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(jobs)):
                tg.start_soon(one, i)
        return results  # type: ignore[return-value]

    async with make_engine(prefix_cache=False) as plain:
        expected = await run_all(plain)
    async with make_engine() as cached:
        got = await run_all(cached)
        assert cached.stats().prefix_cache_hits == len(jobs)
        assert (await cached.worker_stats()).snapshots == 0
    assert [summary(c) for c in got] == [summary(c) for c in expected]


@pytest.mark.anyio
async def test_eviction_keeps_the_store_within_its_budget() -> None:
    tok = tokenizer()
    budget = 220_000  # about four of these prompts' snapshots (their prompts' KV, ~54 KB each)
    async with make_engine(prefix_cache_bytes=budget) as engine:
        for i in range(24):
            prompt = tok.encode(f"{i} distinct prompt number {i * 7919} goes on for a while {i}")
            await engine.complete(prompt, greedy(4))
            stored = await engine.worker_stats()
            assert stored.cached_bytes <= budget
            assert stored.cached_bytes == engine.stats().prefix_cache_bytes
        assert 1 < stored.cached_snapshots < 24  # some kept, most evicted
        assert engine.stats().prefix_cache_hits == 0


@pytest.mark.anyio
async def test_cache_off_by_config() -> None:
    tok = tokenizer()
    for config in ({"prefix_cache": False}, {"prefix_cache_bytes": 0}):
        async with make_engine(**config) as engine:
            for _ in range(2):
                await engine.complete(tok.encode(TEXTS[1]), greedy(4))
            stats, stored = engine.stats(), await engine.worker_stats()
        assert stats.prefix_cache_hits == stats.prefix_cache_misses == 0
        assert stored.cached_snapshots == 0


# ---- over HTTP ----------------------------------------------------------------------------------


def _two_turns(url: str) -> tuple[list[str], list[int]]:
    """A two-turn chat, the first turn whole, the second streamed with its usage: the texts and
    each turn's cached_tokens."""
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog"}]
    texts, cached = [], []
    for turn in range(2):
        if turn == 1:
            chunks = list(
                client.chat.completions.create(
                    model="tiny-llama",
                    messages=messages,
                    max_tokens=12,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            out = client.chat.completions.create(
                model="tiny-llama", messages=messages, max_tokens=12, temperature=0
            )
            text, usage = out.choices[0].message.content or "", out.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        texts.append(text)
        cached.append(usage.prompt_tokens_details.cached_tokens)
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"And after that, part {turn + 2}?"},
        ]
    return texts, cached


def test_two_turn_chat_reuses_the_first_turn() -> None:
    tok = tokenizer()
    results = {}
    for on in (False, True):
        with run_server(fixture_model(prefix_cache=on)) as server:
            before = server.stats()
            texts, cached = _two_turns(server.v1)
            after = server.stats()
        results[on] = texts
        prefilled = after["prefill_tokens"] - before["prefill_tokens"]
        prompts = after["prompt_tokens"] - before["prompt_tokens"]
        reused = after["prefix_cache_reused_tokens"] - before["prefix_cache_reused_tokens"]
        assert prefilled == prompts - reused and reused == sum(cached)
        if not on:
            assert cached == [0, 0]
            continue
        assert cached[0] == 0 and cached[1] > 0
        # the second turn prefilled only what follows the first turn's prompt and reply
        messages = [
            {"role": "user", "content": "The quick brown fox jumps over the lazy dog"},
            {"role": "assistant", "content": texts[0]},
            {"role": "user", "content": "And after that, part 2?"},
        ]
        first = render_chat(tok, messages[:1])
        second = render_chat(tok, messages)
        assert cached[1] >= len(first)
        assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 1
        assert prefilled == len(first) + len(second) - cached[1]
    assert results[True] == results[False]
