"""Engine parity: concurrent requests with staggered joins and leaves give byte-identical text,
token counts and finish reasons to the same requests run one at a time."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from neuronpy.engine.engine import Engine
from neuronpy.engine.types import Completion, FinishReason, SamplingParams
from tests.factories import make_engine, tokenizer

pytestmark = pytest.mark.anyio

TEXTS = [
    "The quick brown fox",
    "café au lait, s'il vous plaît",
    "Once upon a time there was a very long prompt that keeps going and going on",
    "日本語",
    "Numbers: 1, 2, 3",
    "Hello",
]
MAX_TOKENS = [12, 30, 7, 25, 18, 40]


def prompts() -> list[list[int]]:
    tok = tokenizer()
    return [tok.encode(t) for t in TEXTS]


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


async def one_at_a_time(engine: Engine, jobs: list[tuple[list[int], SamplingParams]]):
    return [await engine.complete(p, sp) for p, sp in jobs]


async def concurrently(
    engine: Engine, jobs: list[tuple[list[int], SamplingParams]], stagger: bool = True
) -> list[Completion]:
    """The jobs run together. `stagger`: each arrives once the one before has its first token
    (it holds a row and decodes), and the engine decodes no step until it has: so each joins
    while those before it run, however fast or loaded the machine is (the gate waits for the
    arrival; it times nothing). Else all arrive at once."""
    results: list[Completion | None] = [None] * len(jobs)
    started = [anyio.Event() for _ in jobs]
    submitted = 0

    async def run(i: int) -> None:
        nonlocal submitted
        if stagger and i:
            await started[i - 1].wait()
        out = Completion()
        submitted += 1  # (the generator submits at its first step, below, before it waits)
        async for event in engine.generate(*jobs[i]):
            started[i].set()
            out.text += event.text
            out.token_ids.extend(event.token_ids)
            out.prompt_tokens, out.completion_tokens = event.prompt_tokens, event.completion_tokens
            out.finish_reason = event.finish_reason
        started[i].set()
        results[i] = out

    decode = engine._runner.decode

    async def gated(plan: Any, *drafts: Any) -> Any:
        """A decode step waits until the job after the last that started has arrived."""
        firsts = sum(event.is_set() for event in started)
        while submitted < min(len(jobs), firsts + 1):
            await anyio.sleep(0.001)
        return await decode(plan, *drafts)

    if stagger:
        engine._runner.decode = gated  # type: ignore[method-assign]
    try:
        async with anyio.create_task_group() as tg:
            for i in range(len(jobs)):
                tg.start_soon(run, i)
    finally:
        engine._runner.decode = decode  # type: ignore[method-assign]
    return results  # type: ignore[return-value]


def summary(c: Completion) -> tuple:
    return (c.text, c.token_ids, c.completion_tokens, c.prompt_tokens, c.finish_reason)


@pytest.mark.parametrize("compile", ["on", "off"])
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen3"])
async def test_parity_concurrent_equals_sequential(family: str, compile: str) -> None:
    tok = tokenizer(family)
    jobs = [(tok.encode(t), greedy(m)) for t, m in zip(TEXTS, MAX_TOKENS, strict=True)]
    async with make_engine(family, max_in_flight=1, compile=compile) as serial:
        expected = await one_at_a_time(serial, jobs)
        assert serial.stats().max_batch_size == 1
    async with make_engine(family, max_in_flight=8, compile=compile) as engine:
        assert engine.model.compiled is (compile == "on")
        got = await concurrently(engine, jobs)
        stats = engine.stats()
    assert [summary(c) for c in got] == [summary(c) for c in expected]
    assert stats.max_batch_size >= 3, "the requests never shared a batch"
    assert stats.rebatches >= 4, "rows should have joined and left mid-flight"
    # ragged prompts pad within a KV group (none at all when every joiner got a group of its
    # own: how they were grouped depends on arrival timing)
    assert 0 <= stats.padded_kv_columns < stats.kv_columns
    assert stats.timing["forward"] > 0 and stats.timing["rebatch"] > 0
    for c, m in zip(got, MAX_TOKENS, strict=True):
        assert c.completion_tokens == len(c.token_ids) <= m
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "family",
    [
        "tiny-gemma2",
        "tiny-gemma3",
        "tiny-phi3",
        "tiny-smollm3",
        "tiny-granite",
        "tiny-glm4-moe",
        "tiny-gpt-oss",
    ],
)
async def test_parity_every_family_concurrent_equals_sequential(family: str) -> None:
    """Each family's features (sliding windows past their width, soft-caps, partial rotary
    embeddings, layers without RoPE, scalar multipliers, GLM-4.5's grouped routing, attention
    sinks) keep batched == alone."""
    tok = tokenizer(family)
    jobs = [(tok.encode(t), greedy(m)) for t, m in zip(TEXTS, MAX_TOKENS, strict=True)]
    async with make_engine(family, max_in_flight=1, compile="off") as serial:
        expected = await one_at_a_time(serial, jobs)
    async with make_engine(family, max_in_flight=8, compile="off") as engine:
        got = await concurrently(engine, jobs)
        stats = engine.stats()
    assert [summary(c) for c in got] == [summary(c) for c in expected]
    assert stats.max_batch_size >= 3 and stats.rebatches >= 4


async def test_parity_stop_strings_and_queueing() -> None:
    """Stop strings and a queue behind max_in_flight=2 do not change anyone's output."""
    ps = prompts()
    async with make_engine(max_in_flight=1) as serial:
        free = await serial.complete(ps[0], greedy(30))
    # stop on a piece of the free-running text, so the stop really triggers mid-stream
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    assert stop.strip(), free.text
    jobs = [(p, greedy(m)) for p, m in zip(ps, MAX_TOKENS, strict=True)]
    jobs[0] = (ps[0], greedy(30, stop=(stop,)))
    async with make_engine(max_in_flight=1) as serial:
        expected = await one_at_a_time(serial, jobs)
    async with make_engine(max_in_flight=2) as engine:
        got = await concurrently(engine, jobs, stagger=False)
        assert engine.stats().max_batch_size == 2
    assert [summary(c) for c in got] == [summary(c) for c in expected]
    assert got[0].finish_reason is FinishReason.STOP
    assert stop not in got[0].text and free.text.startswith(got[0].text)
    assert len(got[0].text) < len(free.text)


async def test_parity_seeded_sampling_alone_and_in_a_batch() -> None:
    ps = prompts()
    sampled = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    async with make_engine(max_in_flight=1) as serial:
        alone = await serial.complete(ps[1], sampled)
        again = await serial.complete(ps[1], sampled)
        other = await serial.complete(
            ps[1], SamplingParams(max_tokens=24, temperature=0.9, seed=99)
        )
    assert summary(alone) == summary(again)
    assert alone.token_ids != other.token_ids
    jobs = [(p, greedy(20)) for p in ps]
    jobs[1] = (ps[1], sampled)
    async with make_engine(max_in_flight=8) as engine:
        got = await concurrently(engine, jobs)
    assert summary(got[1]) == summary(alone)


async def test_finish_reasons_and_token_counts() -> None:
    ps = prompts()
    async with make_engine() as engine:
        one = await engine.complete(ps[0], greedy(1))
        assert one.finish_reason is FinishReason.LENGTH and one.completion_tokens == 1
        eos = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
        # a stop token id ends the stream with "stop" and never shows up as text
        first = one.token_ids[0]
        stopped = await engine.complete(ps[0], greedy(10, stop_token_ids=(first,)))
        assert stopped.finish_reason is FinishReason.STOP
        assert stopped.token_ids == [first] and stopped.text == ""
        assert eos in engine.eos_token_ids
        assert (await engine.worker_stats()).snapshots == 0


async def test_parity_long_prompt_joins_in_chunks_between_decode_steps() -> None:
    """A long prompt joining while others decode is prefilled chunk by chunk, most chunks
    riding the decode steps themselves; nobody's output changes."""
    tok = tokenizer()
    long_prompt = tok.encode(" ".join(TEXTS * 6))[:400]
    jobs = [
        (tok.encode(TEXTS[0]), greedy(60)),
        (tok.encode(TEXTS[4]), greedy(60)),
        (long_prompt, greedy(20)),
    ]
    async with make_engine(max_in_flight=1) as serial:
        expected = await one_at_a_time(serial, jobs)
    async with make_engine(max_in_flight=4, prefill_chunk=32) as engine:
        got = await concurrently(engine, jobs)
        stats = engine.stats()
    assert [summary(c) for c in got] == [summary(c) for c in expected]
    assert stats.prefills == 3
    assert stats.prefill_chunks >= 3 + len(long_prompt) // 32 - 1, stats
    # every chunk of the long prompt rode a decode step, its first (which reserves the whole
    # prompt) and its last (which sampled the first token) included
    assert stats.riding_chunks >= -(-len(long_prompt) // 32), stats


async def test_parity_a_burst_of_joiners_rides_the_same_steps() -> None:
    """Prompts arriving together while a row decodes ride the same decode steps, each with a
    chunk of its own (a long one over several steps): nobody's output changes."""
    tok = tokenizer()
    first = (tok.encode(TEXTS[5]), greedy(80))
    burst = [(tok.encode(t), greedy(m)) for t, m in zip(TEXTS[:5], MAX_TOKENS, strict=False)]
    burst.append((tok.encode(" ".join(TEXTS * 3))[:120], greedy(15)))
    async with make_engine(max_in_flight=1) as serial:
        expected = await one_at_a_time(serial, [first, *burst])
    async with make_engine(max_in_flight=8, prefill_chunk=64) as engine:
        riders: list[int] = []
        forward_step = engine.model.forward_step

        def recorded(batch, tokens, chunks=(), counts=None):  # type: ignore[no-untyped-def]
            riders.append(len(chunks))
            return forward_step(batch, tokens, chunks, counts)

        engine.model.forward_step = recorded  # type: ignore[method-assign]
        async with engine.submit(*first) as stream:
            got_first = [await anext(stream)]  # it decodes: the burst arrives now
            streams = [engine.submit(p, sp) for p, sp in burst]
            got_first += [e async for e in stream]
        got = []
        for s in streams:
            async with s:
                got.append([e async for e in s])
        stats = engine.stats()
    texts = ["".join(e.text for e in events) for events in [got_first, *got]]
    assert texts == [c.text for c in expected]
    for events, want in zip([got_first, *got], expected, strict=True):
        assert events[-1].finish_reason is want.finish_reason
        assert events[-1].completion_tokens == want.completion_tokens
    assert max(riders) >= 2, riders  # one step carried several joiners' chunks
    assert stats.riding_chunks >= len(burst) + 1, stats  # the long prompt took two or more


async def test_parity_int8_concurrent_equals_sequential() -> None:
    tok = tokenizer()
    jobs = [(tok.encode(t), greedy(m)) for t, m in zip(TEXTS, MAX_TOKENS, strict=True)]
    async with make_engine(max_in_flight=1, quantize="int8") as serial:
        expected = await one_at_a_time(serial, jobs)
    async with make_engine(max_in_flight=8, quantize="int8") as engine:
        got = await concurrently(engine, jobs)
        assert engine.stats().max_batch_size >= 3
    assert [summary(c) for c in got] == [summary(c) for c in expected]
