"""Preemption without recompute: under a KV budget the newest rows leave the live batch as
snapshots and resume exactly where they stopped, so every output is what it would have been
without memory pressure."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import anyio
import openai
import pytest

from neuronpy.compose import engine_from_hf
from neuronpy.config import EngineConfig
from neuronpy.engine.engine import Engine
from neuronpy.engine.types import SamplingParams
from neuronpy.errors import InvalidRequestError
from tests.factories import hf_model, make_engine, tokenizer
from tests.servers import fixture_model, run_server
from tests.test_engine_parity import TEXTS, concurrently, greedy, summary
from tests.test_metrics import scrape, value

MAX_TOKENS = [40, 30, 36, 25, 40, 32]


def jobs() -> list[tuple[list[int], SamplingParams]]:
    tok = tokenizer()
    out = [(tok.encode(t), greedy(m)) for t, m in zip(TEXTS, MAX_TOKENS, strict=True)]
    # a sampled row too: its sampler's state must survive the trip out of the batch
    out[3] = (out[3][0], SamplingParams(max_tokens=25, temperature=0.8, top_p=0.9, seed=7))
    return out


def budget_bytes(engine: Engine, tokens: int) -> int:
    return tokens * engine.kv_bytes_per_token


@pytest.mark.anyio
async def test_parity_preempted_rows_resume_exactly() -> None:
    work = jobs()
    async with make_engine(max_in_flight=8, prefix_cache=False) as free:
        expected = await concurrently(free, work)
        assert free.stats().preemptions == 0
        unbounded_peak = free.stats().max_kv_tokens
    per_token = make_engine().kv_bytes_per_token
    budget = 100  # tokens: about two of these rows at their longest
    assert unbounded_peak > budget, "the workload must need more KV than the budget"
    async with make_engine(
        max_in_flight=8, kv_budget=budget * per_token, prefix_cache=False
    ) as tight:
        got = await concurrently(tight, work)
        stats = tight.stats()
        worker = await tight.worker_stats()
    assert [summary(c) for c in got] == [summary(c) for c in expected]
    assert stats.preemptions >= 2, stats
    # resumed, not recomputed: every prompt token was prefilled once
    assert stats.prefill_tokens == sum(len(p) for p, _ in work)
    assert stats.max_kv_tokens <= budget, stats  # never more KV than the budget holds
    assert stats.max_batch_size >= 2  # rows still share the batch when they fit
    assert stats.kv_budget_tokens == budget
    assert stats.preempted == 0 and stats.running == 0 and stats.queued == 0
    assert worker.snapshots == 0 and worker.live_batch_size == 0  # no snapshot left behind


@pytest.mark.anyio
async def test_parity_preemption_with_chunked_joins() -> None:
    """Long prompts joining chunk by chunk under a budget: joiners may be preempted mid-prefill
    and resume from their partial snapshot."""
    tok = tokenizer()
    long_prompt = tok.encode(" ".join(TEXTS * 3))[:150]
    work = [
        (tok.encode(TEXTS[0]), greedy(50)),
        (long_prompt, greedy(20)),
        (tok.encode(TEXTS[4]), greedy(50)),
        (long_prompt[:120], greedy(30)),
    ]
    async with make_engine(max_in_flight=4, prefill_chunk=32) as free:
        expected = await concurrently(free, work)
    per_token = make_engine().kv_bytes_per_token
    async with make_engine(
        max_in_flight=4, prefill_chunk=32, kv_budget=220 * per_token, prefix_cache=False
    ) as tight:
        got = await concurrently(tight, work)
        stats = tight.stats()
        assert (await tight.worker_stats()).snapshots == 0
    assert [summary(c) for c in got] == [summary(c) for c in expected]
    assert stats.preemptions >= 1, stats
    assert stats.max_kv_tokens <= 220, stats


@pytest.mark.anyio
async def test_cancelling_a_preempted_request_frees_its_snapshot() -> None:
    work = jobs()
    per_token = make_engine().kv_bytes_per_token
    async with make_engine(max_in_flight=8, kv_budget=70 * per_token) as engine:
        streams = [engine.submit(p, sp) for p, sp in work[:3]]

        async def drain(i: int) -> None:
            async for _ in streams[i]:
                pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(drain, 0)
            # wait until a row has been preempted, then cancel the preempted ones
            with anyio.fail_after(30):
                while engine.stats().preempted == 0:
                    await anyio.sleep(0.005)
            assert engine.stats().preempted == 1
            streams[1].cancel()
            streams[2].cancel()  # one of these two is the preempted one
        with anyio.fail_after(10):
            while engine.stats().running or engine.stats().queued:
                await anyio.sleep(0.01)
        stats = engine.stats()
        assert stats.cancelled >= 1 and stats.cancelled + stats.finished == 3, stats
        assert stats.preempted == 0
        assert (await engine.worker_stats()).snapshots == 0


@pytest.mark.anyio
async def test_a_prompt_larger_than_the_budget_is_refused() -> None:
    tok = tokenizer()
    config = EngineConfig(kv_budget=1)
    with pytest.raises(ValueError, match="holds no token"):
        engine_from_hf(hf_model(), tok, name="m", config=config)
    per_token = make_engine().kv_bytes_per_token
    async with make_engine(kv_budget=8 * per_token) as engine:
        with pytest.raises(InvalidRequestError, match="at most 8 tokens of KV"):
            engine.submit(tok.encode(TEXTS[2]), greedy(4))
        # a short one still runs: one row alone may outgrow the budget rather than stall
        out = await engine.complete(tok.encode("Hi"), greedy(12))
        assert out.completion_tokens == 12
    with pytest.raises(ValueError, match="kv_budget"):
        EngineConfig(kv_budget=-1)


def test_preemptions_show_in_metrics_over_http() -> None:
    """Through the server: outputs under a tight budget equal a free server's, and /metrics
    counts the preemptions."""
    prompts = ["The quick brown fox", "Numbers: 1, 2, 3", "Hello", "Once upon a time"]

    def run_all(url: str) -> list[str]:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

        def one(prompt: str) -> str:
            out = api.completions.create(
                model="tiny-llama",
                prompt=prompt,
                max_tokens=30,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            return out.choices[0].text

        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(one, prompts))

    with run_server(fixture_model()) as free:
        expected = run_all(free.url)
    budget = 60 * make_engine().kv_bytes_per_token
    with run_server(fixture_model(kv_budget=budget)) as tight:
        got = run_all(tight.url)
        samples = scrape(tight)
    assert got == expected
    assert value(samples, "neuronpy_preemptions_total") >= 1
    assert value(samples, "neuronpy_kv_budget_tokens") == 60
    assert value(samples, "neuronpy_requests_preempted") == 0
