"""Prometheus metrics: the server's request outcomes and latencies (ServerMetrics), and each
engine's batching figures, read from `Engine.stats()` when scraped (metrics_collector.py).
Every metric has a `model` label."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import choose_encoder

from neuronpy.engine.stream import RequestStream
from neuronpy.engine.types import FinishReason, GenerationEvent
from neuronpy.errors import QueueFullError, ShuttingDownError
from neuronpy.server.errors import ApiError
from neuronpy.server.metrics_collector import REJECT_REASONS, Collector, WithVllmNames
from neuronpy.server.models import ServedModel, ServerState

NO_MODEL = ""  # the model label of requests refused before a served model was chosen
FINISH_REASONS = tuple(reason.value for reason in FinishReason)
# Seconds; from a few milliseconds (a tiny model on a GPU) to minutes (a long CPU generation).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 131072)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 240, 480, 960)


def rejection_reason(error: ApiError, model: ServedModel | None) -> str:
    """Which of REJECT_REASONS an error answered before admission stands for. `model` is the
    served model the request named, None if it named none the server serves."""
    cause = error.__context__  # the engine's error an ApiError was made from, if any
    if isinstance(cause, QueueFullError):
        return "queue_full"
    if isinstance(cause, ShuttingDownError) or (model is not None and model.status == "stopping"):
        return "shutting_down"
    if error.status < 500:
        return "invalid_request"
    if model is not None and model.status == "loading":
        return "loading"
    return "unhealthy" if error.status == 503 else "error"


class ServerMetrics:
    """One app's metrics, in a registry of its own (never the process-wide default one, so
    several apps in one process keep theirs apart)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.registry = CollectorRegistry(auto_describe=False)
        names = list(state.models)
        # queue_timeout is the engine's count; concurrency_limit refuses a request before its body
        # (and so its model) is read: it counts under NO_MODEL
        per_model = [r for r in REJECT_REASONS if r not in ("queue_timeout", "concurrency_limit")]
        self.rejected = {(name, reason): 0 for name in names for reason in per_model}
        self.rejected[NO_MODEL, "concurrency_limit"] = 0
        self.admitted = dict.fromkeys(names, 0)
        self.finished = {(name, reason): 0 for name in names for reason in FINISH_REASONS}
        self.ttft = Histogram(
            "neuronpy_time_to_first_token_seconds",
            "From the request's arrival to its first generated token.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=None,
        )
        self.itl = Histogram(
            "neuronpy_inter_token_latency_seconds",
            "Between two successive output events of a request (a token held back, as half a "
            "UTF-8 character or a possible stop string, arrives with the next).",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=None,
        )
        self.e2e = Histogram(
            "neuronpy_request_latency_seconds",
            "From the request's arrival to its last event (requests that ran to an end).",
            ["model"],
            buckets=E2E_BUCKETS,
            registry=None,
        )

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model"], buckets=buckets, registry=None)

        self.tpot = histogram(
            "neuronpy_request_time_per_output_token_seconds",
            "A request's mean time per output token after its first (its decode time over its "
            "tokens but one), for requests that ran to an end with two tokens or more.",
            ITL_BUCKETS,
        )
        self.queue_time = histogram(
            "neuronpy_request_queue_time_seconds",
            "From the request's admission to when it got a row (left the queue).",
            TTFT_BUCKETS,
        )
        self.prefill_time = histogram(
            "neuronpy_request_prefill_time_seconds",
            "From when the request got a row to its first token (its prompt's prefill).",
            TTFT_BUCKETS,
        )
        self.decode_time = histogram(
            "neuronpy_request_decode_time_seconds",
            "From the request's first token to its last event.",
            E2E_BUCKETS,
        )
        self.prompt_tokens = histogram(
            "neuronpy_request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS
        )
        self.generation_tokens = histogram(
            "neuronpy_request_generation_tokens",
            "Generated tokens per finished request.",
            TOKEN_BUCKETS,
        )
        self._histograms = (
            self.ttft,
            self.itl,
            self.e2e,
            self.tpot,
            self.queue_time,
            self.prefill_time,
            self.decode_time,
            self.prompt_tokens,
            self.generation_tokens,
        )
        for name in names:  # every series exists from the start, at zero
            for each in self._histograms:
                each.labels(name)
        collector = Collector(self)
        # every family collected once per scrape, under its name and, where vLLM has one, vLLM's
        self.registry.register(WithVllmNames([collector, *self._histograms]))

    def reject(self, model: ServedModel | None, error: ApiError) -> None:
        """Counts a request refused before admission with `error`."""
        key = (model.name if model is not None else NO_MODEL, rejection_reason(error, model))
        self.rejected[key] = self.rejected.get(key, 0) + 1

    def refuse_unread(self) -> None:
        """Counts a request refused by the concurrency limit, before it was read."""
        self.rejected[NO_MODEL, "concurrency_limit"] += 1

    def admit(
        self, model: str, started: float, stream: RequestStream | None = None
    ) -> Callable[[GenerationEvent], None]:
        """What to call with each event of an admitted request that arrived at `started`
        (time.perf_counter()): it times the first token, the gaps, and the whole request, and
        counts how it ended; with its `stream`, also its time in the queue, and from there the
        prefill's."""
        self.admitted[model] = self.admitted.get(model, 0) + 1
        ttft, itl, e2e = (h.labels(model) for h in (self.ttft, self.itl, self.e2e))
        first: float | None = None
        last: float | None = None

        def observe(event: GenerationEvent) -> None:
            nonlocal first, last
            now = time.perf_counter()
            if event.token_ids:
                if last is None:
                    first = now
                    ttft.observe(now - started)
                else:
                    itl.observe(now - last)
                last = now
            if event.finish_reason is not None:
                e2e.observe(now - started)
                key = (model, event.finish_reason.value)
                self.finished[key] = self.finished.get(key, 0) + 1
                self._finished(model, event, started, first, now, stream)

        return observe

    def _finished(
        self,
        model: str,
        event: GenerationEvent,
        started: float,
        first: float | None,
        now: float,
        stream: RequestStream | None,
    ) -> None:
        """A request's per-request figures, once it has ended."""
        self.prompt_tokens.labels(model).observe(event.prompt_tokens)
        self.generation_tokens.labels(model).observe(event.completion_tokens)
        queued = stream.queue_seconds if stream is not None else None
        if queued is not None:
            self.queue_time.labels(model).observe(queued)
        if first is None:
            return
        if queued is not None:
            self.prefill_time.labels(model).observe(max(0.0, first - started - queued))
        self.decode_time.labels(model).observe(now - first)
        if event.completion_tokens > 1:
            self.tpot.labels(model).observe((now - first) / (event.completion_tokens - 1))

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The metrics in the text format the scraper's Accept header asks for, and its
        content type."""
        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type
