"""Engine behaviour around the happy path: admission, cancellation, faults, validation."""

from __future__ import annotations

import dataclasses

import anyio
import pytest

from neuronpy.config import load_config
from neuronpy.engine import router as router_module
from neuronpy.engine.detokenize import IncrementalDetokenizer
from neuronpy.engine.types import FinishReason, SamplingParams
from neuronpy.errors import (
    EngineUnhealthyError,
    InvalidRequestError,
    QueueFullError,
    ShuttingDownError,
)
from tests.factories import make_engine, tokenizer

pytestmark = pytest.mark.anyio


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def prompt(text: str) -> list[int]:
    return tokenizer().encode(text)


async def test_worker_failure_fails_every_request_and_marks_unhealthy() -> None:
    async with make_engine(max_in_flight=4) as engine:
        real = engine.model.forward_batch_decode
        calls = 0

        def flaky(*args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == 3:
                raise RuntimeError("device fell over")
            return real(*args, **kwargs)

        engine.model.forward_batch_decode = flaky  # type: ignore[method-assign]
        streams = [engine.submit(prompt(t), greedy(40)) for t in ("one", "two", "three")]
        finals = []
        with anyio.fail_after(30):
            for stream in streams:
                events = [e async for e in stream]
                finals.append(events[-1])
        assert all(e.finish_reason is FinishReason.ERROR and e.error for e in finals)
        assert "device fell over" not in finals[0].error  # no internals leak to clients
        assert not engine.healthy and not engine.stats().healthy
        with pytest.raises(EngineUnhealthyError):
            engine.submit(prompt("later"), greedy(5))
        assert engine.stats().failed == 3


async def test_cancel_running_row_leaves_others_unchanged() -> None:
    texts = ["alpha beta", "gamma", "delta epsilon zeta"]
    async with make_engine(max_in_flight=1) as serial:
        expected = [await serial.complete(prompt(t), greedy(30)) for t in texts]
    async with make_engine(max_in_flight=4) as engine:
        streams = [engine.submit(prompt(t), greedy(30)) for t in texts]
        got: dict[int, str] = {}

        async def drain(i: int) -> None:
            text = ""
            async for event in streams[i]:
                text += event.text
                if i == 1 and len(event.token_ids) and engine.stats().decode_steps >= 3:
                    streams[i].cancel()  # the client goes away mid-stream
                    break
            got[i] = text

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(drain, i)
        assert got[0] == expected[0].text and got[2] == expected[2].text
        assert engine.stats().cancelled == 1
        # the cancelled row's snapshot and slot are freed
        with anyio.fail_after(10):
            while engine.stats().running:
                await anyio.sleep(0.01)
        ws = await engine.worker_stats()
        assert (ws.snapshots, ws.live_batch_size) == (0, 0)


async def test_cancel_while_queued_is_never_prefilled() -> None:
    async with make_engine(max_in_flight=1, max_queue=4) as engine:
        first = engine.submit(prompt("first"), greedy(20))
        queued = engine.submit(prompt("second"), greedy(20))
        queued.cancel()
        events = [e async for e in first]
        assert events[-1].finish_reason is FinishReason.LENGTH
        assert [e async for e in queued] == []
        with anyio.fail_after(10):
            while engine.stats().queued:
                await anyio.sleep(0.01)
        assert engine.stats().prefills == 1


async def test_admission_bounds_running_and_queued() -> None:
    async with make_engine(max_in_flight=2, max_queue=1) as engine:
        streams = [engine.submit(prompt(t), greedy(5)) for t in ("a", "b", "c")]
        with pytest.raises(QueueFullError) as info:
            engine.submit(prompt("d"), greedy(5))
        assert info.value.retry_after >= 1
        for s in streams:
            assert [e async for e in s][-1].finish_reason is FinishReason.LENGTH
        assert engine.stats().rejected == 1
        # once drained, serial requests are served again
        assert (await engine.complete(prompt("e"), greedy(3))).completion_tokens == 3


async def test_fault_in_one_router_fails_only_that_request(monkeypatch) -> None:
    bad_prompt = prompt("poison")

    class Fragile(IncrementalDetokenizer):
        def add(self, token_id: int) -> str:
            if tuple(self._poison) == tuple(bad_prompt):
                raise ValueError("cannot detokenize")
            return super().add(token_id)

        def __init__(self, tok, prompt_ids=(), **kw):
            super().__init__(tok, prompt_ids, **kw)
            self._poison = tuple(prompt_ids)

    monkeypatch.setattr(router_module, "IncrementalDetokenizer", Fragile)
    async with make_engine(max_in_flight=4) as engine:
        good = engine.submit(prompt("healthy"), greedy(15))
        bad = engine.submit(bad_prompt, greedy(15))
        bad_events = [e async for e in bad]
        good_events = [e async for e in good]
        assert bad_events[-1].finish_reason is FinishReason.ERROR
        assert good_events[-1].finish_reason is FinishReason.LENGTH
        assert good_events[-1].completion_tokens == 15
        assert engine.healthy


async def test_invalid_requests_are_refused_before_admission() -> None:
    async with make_engine() as engine:
        cases = [
            ([], greedy(5), "prompt"),
            ([engine.vocab_size], greedy(5), "prompt"),
            ([-1], greedy(5), "prompt"),
            ([1] * engine.context_len, greedy(1), "prompt"),
            ([1, 2], greedy(engine.context_len), "max_tokens"),
        ]
        for ids, params, param in cases:
            with pytest.raises(InvalidRequestError) as info:
                engine.submit(ids, params)
            assert info.value.param == param
        with pytest.raises(InvalidRequestError, match=str(engine.context_len)):
            engine.submit([1] * (engine.context_len + 5), greedy(1))
        assert engine.stats().admitted == 0


def test_sampling_params_validation() -> None:
    bad = [
        {"max_tokens": 0},
        {"max_tokens": 1.5},
        {"temperature": -1},
        {"temperature": float("nan")},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"presence_penalty": 3},
        {"stop": ("",)},
        {"stop": tuple("x" * 20)},
    ]
    for kw in bad:
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**kw)  # type: ignore[arg-type]
        assert info.value.param == next(iter(kw))
    assert SamplingParams(top_p=1.0, top_k=-1).top_p == 1.0


async def test_neuron_batching_zero_forces_one_at_a_time(monkeypatch) -> None:
    monkeypatch.setenv("NEURON_BATCHING", "0")
    config = load_config().models[0].engine  # the one place that reads the environment
    assert config.max_in_flight == 8
    async with make_engine(**dataclasses.asdict(config)) as engine:
        assert engine.max_running == 1
        async with anyio.create_task_group() as tg:
            for t in ("x", "y", "z"):
                tg.start_soon(engine.complete, prompt(t), greedy(5))
        assert engine.stats().max_batch_size == 1


async def test_queue_timeout_ends_a_waiting_request_that_never_runs() -> None:
    async with make_engine(max_in_flight=1, queue_timeout=0.2) as engine:
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        runner = engine.submit(prompt("a long one"), long)
        waiter = engine.submit(prompt("a queued one"), greedy(5))
        with anyio.fail_after(30):
            waited = [e async for e in waiter]
            ran = [e async for e in runner]
        assert waited[-1].finish_reason is FinishReason.ABORT
        assert "queue_timeout" in waited[-1].error and not any(e.token_ids for e in waited)
        assert ran[-1].finish_reason is FinishReason.LENGTH and ran[-1].completion_tokens == 400
        stats = engine.stats()
        assert (stats.timed_out, stats.prefills, stats.finished) == (1, 1, 1)  # never prefilled


async def test_stop_admitting_then_drain_finishes_what_fits_and_aborts_the_rest() -> None:
    async with make_engine(max_in_flight=2) as engine:
        short = engine.submit(prompt("short"), SamplingParams(max_tokens=3, ignore_eos=True))
        long = engine.submit(prompt("long"), SamplingParams(max_tokens=500, ignore_eos=True))
        engine.stop_admitting("going away")
        with pytest.raises(ShuttingDownError, match="going away"):
            engine.submit(prompt("late"), greedy(3))
        with anyio.fail_after(30):
            short_events = [e async for e in short]
            aborted = await engine.drain(0.05)
            long_events = [e async for e in long]
        assert short_events[-1].finish_reason is FinishReason.LENGTH
        assert aborted == 1
        assert long_events[-1].finish_reason is FinishReason.ABORT and long_events[-1].error
        assert 0 < long_events[-1].completion_tokens < 500
        with anyio.fail_after(10):
            while engine.stats().running:
                await anyio.sleep(0.01)
        assert (await engine.worker_stats()).snapshots == 0
        assert await engine.drain(1.0) == 0  # nothing left: returns at once


async def test_counters_split_cancelled_from_finished_and_count_tokens() -> None:
    async with make_engine(max_in_flight=4) as engine:
        ids = [prompt(t) for t in ("one two", "three", "four five six")]
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        async with anyio.create_task_group() as tg:
            for p in ids:
                tg.start_soon(engine.complete, p, params)
        cancelled = engine.submit(ids[0], SamplingParams(max_tokens=500, ignore_eos=True))
        async for event in cancelled:
            if event.completion_tokens >= 2:
                cancelled.cancel()
        with anyio.fail_after(10):
            while engine.stats().running:
                await anyio.sleep(0.01)
        s = engine.stats()
        assert (s.admitted, s.finished, s.cancelled) == (4, 3, 1)
        assert s.prompt_tokens == sum(map(len, ids)) + len(ids[0])
        assert 18 + 2 <= s.generated_tokens < 18 + 500
        assert sum(s.batch_size_steps.values()) == s.decode_steps
        assert sum(size * n for size, n in s.batch_size_steps.items()) == s.decoded_rows
        assert sum(s.alone_steps.values()) == s.batch_size_steps.get(1, 0)
        assert s.alone_steps["no_peer"] > 0  # the cancelled request decoded alone


async def test_profile_says_where_the_steps_time_went() -> None:
    """Engine.profile over a window of live decoding: tensor operations by class on the worker,
    the rest of the worker's time, and the event loop's CPU time, per decode step."""
    async with make_engine(max_in_flight=4) as engine:
        streams = [engine.submit(prompt(t), greedy(60)) for t in ("one", "two", "three")]
        async with anyio.create_task_group() as tg:
            for stream in streams:

                async def drain(stream=stream) -> None:
                    async for _ in stream:
                        pass

                tg.start_soon(drain)
            while engine.stats().live_batch_size < 3:
                await anyio.sleep(0.01)
            profile = await engine.profile(0.3)
        assert profile.decode_steps > 0 and profile.decoded_rows >= profile.decode_steps
        assert set(profile.op_seconds) == {"linear", "attention", "other ops"}
        assert all(v > 0 for v in profile.op_seconds.values()) and profile.op_calls > 0
        assert 0 < profile.worker_busy <= profile.seconds + 0.05
        ms = profile.per_step_ms()
        parts = ms["linear"] + ms["attention"] + ms["other ops"] + ms["worker python"]
        assert parts + ms["worker idle"] == pytest.approx(ms["step"], rel=0.05)
        # recording stopped: a second window can start
        assert (await engine.profile(0.05)).seconds > 0


async def test_a_request_nothing_moves_on_fails_alone_and_the_loop_then_sleeps() -> None:
    """A bug that strands a joiner (here its prefill plans are made to come back empty) must
    neither hang its client nor spin the loop: the turn that moves nothing on fails what it
    stranded, with an error, and the engine sleeps, then serves the next request."""
    stuck = tuple(prompt("a prompt nothing prefills"))
    async with make_engine(max_in_flight=4) as engine:
        prefills = engine._scheduler.prefills
        plan = prefills.plan

        def broken(request, *args, **kwargs):  # type: ignore[no-untyped-def]
            return None if request.prompt_ids == stuck else plan(request, *args, **kwargs)

        prefills.plan = broken  # type: ignore[method-assign]
        with anyio.fail_after(30):
            events = [e async for e in engine.generate(stuck, greedy(5))]
            while not engine.idle:
                await anyio.sleep(0.01)
        assert events[-1].finish_reason is FinishReason.ERROR
        assert "could not make progress" in (events[-1].error or "")
        turns = engine.loop_turns
        await anyio.sleep(0.2)
        assert engine.loop_turns == turns
        out = await engine.complete(
            prompt("the next one"), dataclasses.replace(greedy(5), ignore_eos=True)
        )
        assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 5
        assert engine.healthy and engine.stats().failed == 1


@pytest.mark.anyio
async def test_a_stream_runs_on_while_client_work_holds_every_worker_thread() -> None:
    """Client work (constraint compiles, large /tokenize calls) runs on anyio's worker threads;
    the engine's waits for its device jobs must not need one. A stream that has started goes
    on to its end while every one of those threads is held."""
    import threading

    tok = tokenizer()
    release = threading.Event()
    limiter = anyio.to_thread.current_default_thread_limiter()
    async with make_engine(max_in_flight=2) as engine, anyio.create_task_group() as tg:
        tokens: list[int] = []
        stream = engine.generate(tok.encode("Hello"), SamplingParams(max_tokens=12, temperature=0))
        first = await stream.__anext__()
        tokens.extend(first.token_ids)
        for _ in range(int(limiter.total_tokens)):
            tg.start_soon(anyio.to_thread.run_sync, release.wait)
        while limiter.borrowed_tokens < limiter.total_tokens:
            await anyio.sleep(0.01)
        try:
            with anyio.fail_after(300):  # a guard against a hang, not a measure of speed
                async for event in stream:
                    tokens.extend(event.token_ids)
        finally:
            release.set()
        assert len(tokens) == 12
