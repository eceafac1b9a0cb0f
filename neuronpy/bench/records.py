"""What a run measured, as frozen records: each request as its client saw it (`RequestRecord`),
and the run's figures (`RunSummary`, `EngineFigures`, `Memory`, ...) that metrics.py computes
from them. Each figure's `to_json` is its part of the results file, under the keys it always
had (results.py puts them together)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class RequestRecord:
    """What a client saw of one request. Times are seconds since the workload started."""

    sent: float  # when the request was sent (for a queued serial peer: when it arrived)
    chunk_times: tuple[float, ...] = ()  # one per chunk carrying tokens
    output_tokens: int = 0
    prompt_tokens: int = 0
    token_ids: tuple[int, ...] | None = None  # where the system reports them (parity)
    text: str | None = None  # where the system reports it (parity over HTTP)
    tag: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1] - self.sent

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]

    @property
    def end(self) -> float:
        return self.chunk_times[-1] if self.chunk_times else self.sent


@dataclass
class Trace:
    """One request's record while it runs, written by the client that sends it (the load
    driver, or a peer's own loop); `record()` is what it saw, frozen."""

    prompt_tokens: int
    tag: str = ""
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    token_ids: list[int] | None = None
    text: str | None = None
    error: str | None = None

    def record(self) -> RequestRecord:
        return RequestRecord(
            sent=self.sent,
            chunk_times=tuple(self.chunk_times),
            output_tokens=self.output_tokens,
            prompt_tokens=self.prompt_tokens,
            token_ids=None if self.token_ids is None else tuple(self.token_ids),
            text=self.text,
            tag=self.tag,
            error=self.error,
        )


def span(records: tuple[RequestRecord, ...]) -> float:
    """First send to last chunk received (0 for no records)."""
    start = min((r.sent for r in records), default=0.0)
    return max((r.end for r in records), default=start) - start


@dataclass(frozen=True)
class Distribution:
    """mean / p50 / p90 / p99 / max of a latency in ms, over `n` values (None for none)."""

    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None
    n: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RunSummary:
    """One run's serving metrics (metrics.summarize defines each)."""

    requests: int
    completed: int
    failed: int
    errors: tuple[str, ...]  # the first few distinct ones
    duration_s: float
    input_tokens: int
    output_tokens: int
    output_tok_s: float | None
    request_s: float | None
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["errors"] = list(self.errors)
        return out


@dataclass(frozen=True)
class EngineFigures:
    """An engine's own figures over one run, from its counters before and after (metrics.
    engine_delta). `time_s` is None where the engine does not expose its time split; then
    the file has no `time_share` or `ms_per_step` either."""

    counters: Mapping[str, float]  # every counter's difference over the run
    decode_steps: float
    decode_steps_per_s: float | None
    mean_batch_size: float | None
    max_batch_size_so_far: Any
    time_s: Mapping[str, float] | None = None  # forward, prefill, ..., other: seconds
    time_share: Mapping[str, float] | None = None  # the same over the run's duration
    ms_per_step: Mapping[str, float] | None = None  # forward and sampling, per decode step
    padding_waste: float | None = None  # padded KV columns over real ones

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "counters": dict(self.counters),
            "decode_steps": self.decode_steps,
            "decode_steps_per_s": self.decode_steps_per_s,
            "mean_batch_size": self.mean_batch_size,
            "max_batch_size_so_far": self.max_batch_size_so_far,
            "time_s": _plain(self.time_s),
        }
        if self.time_s is not None:
            out["time_share"] = _plain(self.time_share)
            if self.ms_per_step is not None:
                out["ms_per_step"] = dict(self.ms_per_step)
        out["padding_waste"] = self.padding_waste
        return out


@dataclass(frozen=True)
class ProfiledSteps:
    """Where neuronpy's decode steps spent a profiled window of a run (Engine.profile)."""

    per_step_ms: Mapping[str, float]  # StepProfile.per_step_ms: linear, attention, ...
    seconds: float
    decode_steps: int
    mean_batch_size: float
    op_calls_per_step: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"per_step_ms": dict(self.per_step_ms)}


@dataclass(frozen=True)
class Memory:
    """The process's memory over one run."""

    rss_start_mb: float | None
    rss_peak_mb: float
    scope: str  # "this run", or "process lifetime" where the peak cannot be reset
    cuda_peak_allocated_mb: float | None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Divergence:
    request: int
    position: int  # the first differing token (or character, when only text is known)


@dataclass(frozen=True)
class Parity:
    """Greedy outputs of the same requests on two systems (metrics.parity)."""

    compared: str  # "token_ids" or "text"
    identical: int
    total: int
    identical_share: float
    first_divergence: tuple[Divergence, ...]

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["first_divergence"] = [dataclasses.asdict(d) for d in self.first_divergence]
        return out


@dataclass(frozen=True)
class JoinStall:
    """W4: the decoders' inter-token gaps while the long prompt joins (metrics.join_stall)."""

    join_sent_s: float
    join_window_s: float
    join_ttft_ms: float
    decoder_itl_p50_ms: float
    decoder_itl_max_during_join_ms: float | None
    stall_ratio: float | None
    gaps_during_join: int
    decoders_outlived_join: bool  # every decoder streamed past the window: fully observed

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RunOutput:
    """What a system's run returns: its requests' records, the run's duration, and its
    engine's figures where it has an engine to ask."""

    records: tuple[RequestRecord, ...]
    duration: float
    engine: EngineFigures | None = None


@dataclass(frozen=True)
class Run:
    """One measured run of one system on one point."""

    summary: RunSummary
    engine: EngineFigures | None
    memory: Memory
    records: tuple[RequestRecord, ...]  # not written out: parity compares them
    info: Mapping[str, Any]  # the system's description, as it stood after the run
    join: JoinStall | None = None  # W4
    step_profile: ProfiledSteps | None = None  # the profiled repeat's

    @property
    def output_tok_s(self) -> float | None:
        return self.summary.output_tok_s

    def to_json(self) -> dict[str, Any]:
        out = self.summary.to_json()
        out["engine"] = None if self.engine is None else self.engine.to_json()
        out["memory"] = self.memory.to_json()
        if self.join is not None:
            out["join"] = self.join.to_json()
        return out


@dataclass(frozen=True)
class RunFailure:
    """A run that raised: one system failing does not end the benchmark."""

    error: str
    wall_s: float

    # what a Run has and a failure lacks
    output_tok_s: ClassVar[None] = None
    info: ClassVar[None] = None
    step_profile: ClassVar[None] = None

    def to_json(self) -> dict[str, Any]:
        return {"error": self.error, "wall_s": self.wall_s}


def _plain(value: Mapping[str, float] | None) -> dict[str, float] | None:
    return None if value is None else dict(value)
