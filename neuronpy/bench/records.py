"""What a run measured, as frozen records: each request as its client saw it (`RequestRecord`),
and what a system's run returns (`RunOutput`); metrics.py computes the figures from them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any


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
class RunOutput:
    """What a system's run returns: its requests' records, the run's duration, and its
    engine's figures where it has an engine to ask."""

    records: tuple[RequestRecord, ...]
    duration: float
    engine: dict[str, Any] | None = None
