"""neuronpy's Engine in this process, driven through its Python API by the load driver."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from neuronpy.bench.driver import OnChunk, Reply, Send, drive, precompile
from neuronpy.bench.metrics import engine_delta
from neuronpy.bench.records import ProfiledSteps, RunOutput
from neuronpy.bench.threads import EventLoopThread, in_fresh_thread
from neuronpy.bench.workloads import WORKLOADS, BenchRequest, Workload
from neuronpy.config import EngineConfig

if TYPE_CHECKING:
    from neuronpy.engine.counters import StepProfile
    from neuronpy.engine.engine import Engine

PROFILE_SECONDS = 3.0  # the window Engine.profile records in a profiled run


def engine_snapshot(engine: Engine) -> dict[str, Any]:
    """The engine's counters and its cumulative time split (seconds, under "timing")."""
    snap = dataclasses.asdict(engine.stats())
    snap["timing"] = {k: float(v) for k, v in snap["timing"].items()}
    return snap


def engine_label(config: EngineConfig) -> str:
    """max_in_flight, and the weight mode where it is not the default."""
    label = f"max_in_flight={config.max_in_flight}"
    return label if config.quantize == "none" else f"{label}, quantize={config.quantize}"


def engine_send(engine: Engine) -> Send:
    """Each request submitted greedy with EOS ignored (a W5 request under its schema); the
    reply's token ids are kept for parity."""
    from neuronpy.engine.types import Constraint, FinishReason, SamplingParams

    async def send(req: BenchRequest, on_chunk: OnChunk) -> Reply:
        constraint = None if req.schema is None else Constraint("json_schema", req.schema)
        params = SamplingParams(
            max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True, constraint=constraint
        )
        await engine.prepare(req.prompt_ids, params)  # (a schema's compile counts in TTFT)
        ids: list[int] = []
        text: list[str] = []
        tokens, error = 0, None
        async with engine.submit(req.prompt_ids, params) as stream:
            async for event in stream:
                if event.token_ids:
                    on_chunk(len(event.token_ids))
                    ids.extend(event.token_ids)
                text.append(event.text)
                reason = event.finish_reason
                if reason is not None:  # the last event
                    tokens = event.completion_tokens
                    if reason not in (FinishReason.LENGTH, FinishReason.STOP):
                        error = f"finished with {reason.value}: {event.error}"
        return Reply(output_tokens=tokens, token_ids=tuple(ids), text="".join(text), error=error)

    return send


class NeuronpyEngine:
    """neuronpy's Engine in this process, driven through its Python API."""

    def __init__(
        self,
        name: str,
        config: EngineConfig,
        build: Callable[[], Engine],
        *,
        notes: Sequence[str] = (),
        workloads: frozenset[str] = frozenset(WORKLOADS),
    ):
        """`build`: makes the engine with `config` (blocking; run on a thread that ends).
        `notes`: said after the description, each in parentheses."""
        self.name = name
        self.config = config
        self.description = " ".join(
            [f"neuronpy engine in-process ({engine_label(config)})", *(f"({n})" for n in notes)]
        )
        self.workloads = workloads
        self._build = build
        self._loop: EventLoopThread | None = None
        self._exit_engine: Callable[[], None] | None = None
        self.engine: Engine | None = None

    def start(self, warmup: Workload) -> None:
        self.engine = in_fresh_thread(self._build)
        self._loop = EventLoopThread()
        self._exit_engine = self._loop.enter(self.engine)
        self.run(warmup)

    def _started(self) -> tuple[EventLoopThread, Engine]:
        assert self._loop is not None and self.engine is not None, "start it first"
        return self._loop, self.engine

    def run(self, workload: Workload) -> RunOutput:
        loop, engine = self._started()
        send = engine_send(engine)
        loop.call(lambda: precompile(workload.requests, send))
        before = engine_snapshot(engine)
        records, duration = loop.call(lambda: drive(workload.requests, send))
        after = engine_snapshot(engine)
        return RunOutput(records, duration, engine_delta(before, after, duration))

    def profile(self, workload: Workload) -> ProfiledSteps | None:
        """The workload again, with Engine.profile recording a window of its steady state:
        from when the batch is as full as the workload makes it, for up to PROFILE_SECONDS."""
        loop, engine = self._started()
        full = min(engine.max_running, len(workload.requests))

        async def profiled() -> StepProfile | None:
            found: list[StepProfile] = []
            done = anyio.Event()
            async with anyio.create_task_group() as tg:

                async def window() -> None:
                    while engine.stats().live_batch_size < full:
                        if done.is_set():
                            return  # the batch never filled: no window
                        await anyio.sleep(0.02)
                    found.append(await engine.profile(PROFILE_SECONDS, until=done))

                tg.start_soon(window)
                await drive(workload.requests, engine_send(engine))
                done.set()  # a window still recording ends with the run
            return found[0] if found else None

        result = loop.call(profiled)
        if result is None or not result.decode_steps:
            return None
        return ProfiledSteps(
            per_step_ms=result.per_step_ms(),
            seconds=result.seconds,
            decode_steps=result.decode_steps,
            mean_batch_size=result.decoded_rows / result.decode_steps,
            op_calls_per_step=result.op_calls / result.decode_steps,
        )

    def close(self) -> None:
        if self._exit_engine is not None:
            self._exit_engine()
            self._exit_engine = None
        if self._loop is not None:
            self._loop.close()
            self._loop = None
        self.engine = None

    def info(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "drive": "in-process",
            "engine_config": dataclasses.asdict(self.config),
        }
