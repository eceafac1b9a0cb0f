"""Prometheus metrics: the server's request outcomes and latencies, and each engine's batching
figures, read from `Engine.stats()` when scraped. Every metric has a `model` label."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from neuronpy.engine.engine import EngineStats
from neuronpy.engine.stream import RequestStream
from neuronpy.engine.types import FinishReason, GenerationEvent
from neuronpy.errors import QueueFullError, ShuttingDownError
from neuronpy.server.errors import ApiError
from neuronpy.server.models import ServedModel, ServerState

NO_MODEL = ""  # the model label of requests refused before a served model was chosen
FINISH_REASONS = tuple(reason.value for reason in FinishReason)
# Seconds; from a few milliseconds (a tiny model on a GPU) to minutes (a long CPU generation).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 131072)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 240, 480, 960)

# EngineStats fields exposed as they are: (field, metric name, help)
ENGINE_GAUGES = (
    ("running", "neuronpy_requests_running", "Requests in (or joining) the live batch."),
    ("queued", "neuronpy_requests_queued", "Admitted requests waiting for a row."),
    ("live_batch_size", "neuronpy_live_batch_size", "Rows of the live batch now."),
    ("max_batch_size", "neuronpy_max_batch_size", "The largest batch a decode step has run."),
    (
        "prefix_cache_entries",
        "neuronpy_prefix_cache_entries",
        "KV snapshots the prefix cache holds.",
    ),
    ("prefix_cache_bytes", "neuronpy_prefix_cache_bytes", "Bytes of KV the prefix cache holds."),
    ("preempted", "neuronpy_requests_preempted", "Preempted requests waiting to resume."),
    ("kv_tokens", "neuronpy_kv_tokens", "Tokens of KV the running requests hold."),
    (
        "kv_budget_tokens",
        "neuronpy_kv_budget_tokens",
        "Tokens of KV the running requests may hold (kv_budget_bytes); 0: no budget.",
    ),
    (
        "grammar_cache_bytes",
        "neuronpy_grammar_cache_bytes",
        "Bytes of compiled grammars (structured outputs) kept for reuse.",
    ),
    (
        "spec_acceptance_rate",
        "neuronpy_spec_decode_acceptance_rate",
        "Drafted tokens that stood, of those verified, since the start (0 before any).",
    ),
    (
        "spec_tokens_per_row_step",
        "neuronpy_spec_decode_tokens_per_row_step",
        "Tokens a row emits per verify step, on average since the start (1: no gain).",
    ),
)
ENGINE_COUNTERS = (
    ("cancelled", "neuronpy_requests_cancelled", "Requests ended early by their client."),
    ("failed", "neuronpy_requests_failed", "Requests the engine ended with an error."),
    ("prompt_tokens", "neuronpy_prompt_tokens", "Prompt tokens of admitted requests."),
    ("generated_tokens", "neuronpy_generation_tokens", "Tokens sampled, over every request."),
    ("decode_steps", "neuronpy_decode_steps", "Lockstep decode steps."),
    (
        "grammars_compiled",
        "neuronpy_grammars_compiled",
        "Constraints compiled into grammars (structured outputs; the cache's misses).",
    ),
    (
        "grammar_compile_seconds",
        "neuronpy_grammar_compile_seconds",
        "Seconds spent compiling grammars, off the engine's loop.",
    ),
    ("decoded_rows", "neuronpy_decoded_rows", "Rows decoded: the batch size summed over steps."),
    ("multi_row_steps", "neuronpy_multi_row_steps", "Decode steps with more than one row."),
    ("rebatches", "neuronpy_rebatches", "Rebatches: rows joined or left the live batch."),
    ("prefills", "neuronpy_prefills", "Prompts prefilled."),
    (
        "prefill_chunks",
        "neuronpy_prefill_chunks",
        "Prefill forwards (a long prompt takes several).",
    ),
    (
        "padded_kv_columns",
        "neuronpy_kv_padding_columns",
        "Padding KV columns in decode steps' batches, summed over steps (batching's waste).",
    ),
    ("kv_columns", "neuronpy_kv_columns", "Real KV columns attended, summed over decode steps."),
    (
        "prefill_tokens",
        "neuronpy_prefill_tokens",
        "Prompt tokens prefilled (those restored from the prefix cache are not).",
    ),
    ("prefix_cache_hits", "neuronpy_prefix_cache_hits", "Prompts that restored a cached prefix."),
    (
        "prefix_cache_misses",
        "neuronpy_prefix_cache_misses",
        "Prompts prefilled from scratch while the prefix cache was on.",
    ),
    (
        "prefix_cache_reused_tokens",
        "neuronpy_prefix_cache_reused_tokens",
        "Prompt tokens restored from the prefix cache rather than prefilled.",
    ),
    (
        "preemptions",
        "neuronpy_preemptions",
        "Rows moved out of the live batch to keep within the KV budget (resumed, not recomputed).",
    ),
    ("sessions_saved", "neuronpy_sessions_saved", "Conversations saved to session files."),
    (
        "session_save_failures",
        "neuronpy_session_save_failures",
        "Finished requests whose session could not be saved (their replies were returned).",
    ),
    (
        "sessions_restored",
        "neuronpy_sessions_restored",
        "Prompts that continued from a session file.",
    ),
    (
        "spec_verify_rows",
        "neuronpy_spec_decode_verify_rows",
        "Rows of decode steps that verified drafted tokens (speculative decoding).",
    ),
    (
        "spec_draft_tokens",
        "neuronpy_spec_decode_draft_tokens",
        "Drafted tokens verified (speculative decoding).",
    ),
    (
        "spec_accepted_tokens",
        "neuronpy_spec_decode_accepted_tokens",
        "Drafted tokens that stood: the target model would have chosen them (or, sampled, "
        "the rejection rule kept them).",
    ),
    (
        "spec_emitted_tokens",
        "neuronpy_spec_decode_emitted_tokens",
        "Tokens the verifying rows emitted: drafts that stood and one of the model's own each.",
    ),
)


# Why a request was refused (a metric label); queue_timeout is the engine's count, the others
# the server's (see rejection_reason).
REJECT_REASONS = (
    "invalid_request",  # 4xx: bad body, bad parameter, unknown model, prompt too long
    "queue_full",  # max_in_flight running and max_queue waiting
    "queue_timeout",  # admitted, then waited past queue_timeout without a row
    "loading",  # the model is not ready yet
    "shutting_down",  # the server stopped admitting
    "unhealthy",  # the model failed (its worker, or its start)
    "error",  # any other 5xx before admission
    "concurrency_limit",  # limit_concurrency requests were being handled (before any was read)
)


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
            registry=self.registry,
        )
        self.itl = Histogram(
            "neuronpy_inter_token_latency_seconds",
            "Between two successive output events of a request (a token held back, as half a "
            "UTF-8 character or a possible stop string, arrives with the next).",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "neuronpy_request_latency_seconds",
            "From the request's arrival to its last event (requests that ran to an end).",
            ["model"],
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model"], buckets=buckets, registry=self.registry)

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
        self.registry.register(_Collector(self))

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


class _Collector:
    """The server's outcome counters and, for each model with an engine, its figures at this
    moment (a prometheus_client Collector)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        models = list(self.metrics.state.models.values())
        engines = {m.name: m.engine for m in models if m.engine is not None}
        stats = {name: engine.stats() for name, engine in engines.items()}
        healthy = GaugeMetricFamily(
            "neuronpy_model_healthy",
            "1 when the model is ready to serve, else 0.",
            labels=["model"],
        )
        for model in models:
            healthy.add_metric([model.name], 1.0 if model.state == "ready" else 0.0)
        yield healthy
        yield from self._requests(stats)
        for field, name, doc in ENGINE_GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=["model"])
            for model, s in stats.items():
                gauge.add_metric([model], float(getattr(s, field)))
            yield gauge
        max_in_flight = GaugeMetricFamily(
            "neuronpy_max_in_flight",
            "Rows a decode step may hold (max_in_flight).",
            labels=["model"],
        )
        max_queue = GaugeMetricFamily(
            "neuronpy_max_queue", "Requests that may wait for a row (max_queue).", labels=["model"]
        )
        kv_usage = GaugeMetricFamily(
            "neuronpy_kv_cache_usage_ratio",
            "KV the running requests hold, as a share of what they may hold: the KV budget, "
            "or without one, max_in_flight rows of the whole context (0 to 1).",
            labels=["model"],
        )
        for model, engine in engines.items():
            capacity = engine.kv_capacity_tokens
            held = stats[model].kv_tokens
            kv_usage.add_metric([model], min(1.0, held / capacity) if capacity else 0.0)
        yield kv_usage
        for model, engine in engines.items():
            max_in_flight.add_metric([model], float(engine.max_running))
            max_queue.add_metric([model], float(engine.config.max_queue))
        yield max_in_flight
        yield max_queue
        for field, name, doc in ENGINE_COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=["model"])
            for model, s in stats.items():
                counter.add_metric([model], float(getattr(s, field)))
            yield counter
        caps = {name: engine.max_running for name, engine in engines.items()}
        yield from self._batching(stats, caps)

    def _requests(self, stats: dict[str, EngineStats]) -> Iterator[Metric]:
        admitted = CounterMetricFamily(
            "neuronpy_requests_admitted",
            "Requests admitted to run (the server's; the start-up warm-up is not one).",
            labels=["model"],
        )
        for model, count in self.metrics.admitted.items():
            admitted.add_metric([model], float(count))
        yield admitted
        rejected = CounterMetricFamily(
            "neuronpy_requests_rejected",
            "Requests refused, by reason: " + ", ".join(REJECT_REASONS) + ".",
            labels=["model", "reason"],
        )
        for (model, reason), count in self.metrics.rejected.items():
            rejected.add_metric([model, reason], float(count))
        for model, s in stats.items():
            rejected.add_metric([model, "queue_timeout"], float(s.timed_out))
        yield rejected
        finished = CounterMetricFamily(
            "neuronpy_requests_finished",
            "Requests that ran to an end, by the finish reason their client got "
            "(abort: shutdown or queue timeout; error: a failure).",
            labels=["model", "finish_reason"],
        )
        for (model, reason), count in self.metrics.finished.items():
            finished.add_metric([model, reason], float(count))
        yield finished

    def _batching(self, stats: dict[str, EngineStats], caps: dict[str, int]) -> Iterator[Metric]:
        seconds = CounterMetricFamily(
            "neuronpy_engine_seconds",
            "Engine time by phase: forward (decode steps), prefill, rebatch, sampling.",
            labels=["model", "phase"],
        )
        alone = CounterMetricFamily(
            "neuronpy_alone_steps",
            "Decode steps that ran with one row, by why: no_peer (nothing else to run), "
            "peer_prefilling (another was being prefilled), peer_queued (another waited).",
            labels=["model", "reason"],
        )
        sizes = HistogramMetricFamily(
            "neuronpy_decode_batch_size", "Rows per decode step.", labels=["model"]
        )
        for model, s in stats.items():
            for phase, value in sorted(s.timing.items()):
                seconds.add_metric([model, phase], value)
            for reason, count in sorted(s.alone_steps.items()):
                alone.add_metric([model, reason], float(count))
            steps = s.batch_size_steps
            cap = max([caps[model], *steps])
            sizes.add_metric(
                [model],
                _cumulative(steps, _size_bounds(cap)),
                sum_value=float(sum(size * count for size, count in steps.items())),
            )
        yield seconds
        yield alone
        yield sizes


def _size_bounds(cap: int) -> list[int]:
    """Batch-size bucket bounds: every size up to 16, then powers of two, and `cap` itself."""
    bounds = set(range(1, min(cap, 16) + 1))
    bounds |= {1 << k for k in range(cap.bit_length()) if 1 << k <= cap}
    return sorted(bounds | {cap})


def _cumulative(counts: dict[int, int], bounds: list[int]) -> list[tuple[str, float]]:
    """Prometheus buckets (cumulative counts per upper bound, then +Inf) from per-size counts."""
    buckets = [
        (floatToGoString(b), float(sum(c for size, c in counts.items() if size <= b)))
        for b in bounds
    ]
    buckets.append(("+Inf", float(sum(counts.values()))))
    return buckets
