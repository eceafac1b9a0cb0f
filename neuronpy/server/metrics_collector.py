"""Each engine's batching figures as Prometheus metrics, read from `Engine.stats()` when
scraped, beside the server's outcome counters (ServerMetrics holds them, this reads them
through the `Outcomes` protocol, so that this module does not import metrics.py, which
imports it)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from neuronpy.engine.engine import EngineStats
from neuronpy.server.models import ServerState

# why a request was refused before admission (ServerMetrics counts them; rejection_reason)
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
    (
        "jump_forward_tokens",
        "neuronpy_jump_forward_tokens",
        "Tokens a request's grammar forced (a tool call's markup, a schema's keys) that a "
        "decode step fed at once, beside the row's own token.",
    ),
)


class Outcomes(Protocol):
    """The server's own counts that the collector reads (ServerMetrics holds them): the served
    models, and the requests admitted, refused and finished, by their labels."""

    state: ServerState
    admitted: dict[str, int]  # model -> count
    rejected: dict[tuple[str, str], int]  # (model, reason) -> count
    finished: dict[tuple[str, str], int]  # (model, finish reason) -> count


class Collector:
    """The server's outcome counters and, for each model with an engine, its figures at this
    moment (a prometheus_client Collector)."""

    def __init__(self, metrics: Outcomes) -> None:
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


# The figures routers and dashboards built for vLLM read, under vLLM's names (their `model`
# label as vLLM's `model_name`): llm-d's endpoint picker reads the queue and KV use, vLLM's
# Grafana board the rest. {neuronpy family: vLLM family} (a counter's `_total` is its samples').
VLLM_NAMES = {
    "neuronpy_requests_running": "vllm:num_requests_running",
    "neuronpy_requests_queued": "vllm:num_requests_waiting",
    "neuronpy_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
    "neuronpy_prompt_tokens": "vllm:prompt_tokens",
    "neuronpy_generation_tokens": "vllm:generation_tokens",
    "neuronpy_requests_finished": "vllm:request_success",
    "neuronpy_preemptions": "vllm:num_preemptions",
    "neuronpy_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "neuronpy_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "neuronpy_request_time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds",
    "neuronpy_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "neuronpy_request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "neuronpy_request_prefill_time_seconds": "vllm:request_prefill_time_seconds",
    "neuronpy_request_decode_time_seconds": "vllm:request_decode_time_seconds",
    "neuronpy_request_prompt_tokens": "vllm:request_prompt_tokens",
    "neuronpy_request_generation_tokens": "vllm:request_generation_tokens",
}
# vLLM's older name for the inter-token latency, still read by many dashboards
VLLM_ALSO = {"vllm:inter_token_latency_seconds": ("vllm:time_per_output_token_seconds",)}
VLLM_LABELS = {"model": "model_name", "finish_reason": "finished_reason"}


class WithVllmNames:
    """Every family of `sources` (the collectors of one registry), and those of VLLM_NAMES
    again under vLLM's names: each source collected once per scrape, so the two names never
    disagree and nothing is read twice."""

    def __init__(self, sources: Iterable[Any]) -> None:
        self.sources = list(sources)

    def collect(self) -> Iterator[Metric]:
        for source in self.sources:
            for family in source.collect():
                yield family
                alias = VLLM_NAMES.get(family.name)
                if alias is None:
                    continue
                for name in (alias, *VLLM_ALSO.get(alias, ())):
                    yield _renamed(family, name)


def _renamed(family: Metric, name: str) -> Metric:
    renamed = Metric(name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        labels = {VLLM_LABELS.get(k, k): v for k, v in sample.labels.items()}
        renamed.samples.append(
            sample._replace(name=name + sample.name[len(family.name) :], labels=labels)
        )
    return renamed
