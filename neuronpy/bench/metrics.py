"""Serving metrics as vLLM's `vllm bench serve` defines them, from per-request timings.

- TTFT: first received chunk minus the time the request was sent.
- TPOT: per request, (end-to-end latency - TTFT) / (output tokens - 1), for requests with
  more than one output token; the statistics are over requests.
- ITL: every gap between two consecutive chunks of a request, pooled over all requests.
- E2EL: last chunk minus the time the request was sent.
- Output tokens/s and requests/s: totals over the run's duration (first send to last chunk).
Percentiles interpolate linearly between order statistics (numpy's default method).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from neuronpy.bench.records import (
    Distribution,
    Divergence,
    EngineFigures,
    JoinStall,
    Parity,
    RequestRecord,
    RunSummary,
    span,
)


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100), linear interpolation (numpy.percentile's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def distribution(values: Sequence[float], scale: float = 1000.0) -> Distribution:
    """mean / p50 / p90 / p99 / max of `values` times `scale` (seconds to ms by default)."""
    if not values:
        return Distribution(mean=None, p50=None, p90=None, p99=None, max=None, n=0)
    return Distribution(
        mean=statistics.fmean(values) * scale,
        p50=percentile(values, 50) * scale,
        p90=percentile(values, 90) * scale,
        p99=percentile(values, 99) * scale,
        max=max(values) * scale,
        n=len(values),
    )


def summarize(records: Sequence[RequestRecord], duration: float | None = None) -> RunSummary:
    """The run's metrics. `duration` defaults to the first send to the last chunk received."""
    done = [r for r in records if r.ok]
    if duration is None:
        duration = span(tuple(records))
    output_tokens = sum(r.output_tokens for r in done)
    tpots = [t for r in done if (t := r.tpot) is not None]
    return RunSummary(
        requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        errors=tuple(sorted({r.error for r in records if r.error})[:5]),
        duration_s=duration,
        input_tokens=sum(r.prompt_tokens for r in done),
        output_tokens=output_tokens,
        output_tok_s=output_tokens / duration if duration > 0 else None,
        request_s=len(done) / duration if duration > 0 else None,
        ttft_ms=distribution([r.ttft for r in done]),
        tpot_ms=distribution(tpots),
        itl_ms=distribution([g for r in done for g in r.itls]),
        e2el_ms=distribution([r.e2el for r in done]),
    )


def scaling_efficiency(tok_s_at_k: float, k: int, tok_s_at_1: float) -> float | None:
    """E(K) = tokens/s at K streams / (K * tokens/s at one stream)."""
    if not tok_s_at_1 or k < 1:
        return None
    return tok_s_at_k / (k * tok_s_at_1)


def parity(batched: Sequence[RequestRecord], alone: Sequence[RequestRecord]) -> Parity | None:
    """Greedy parity of the same requests run batched and run one at a time: the share of
    identical completions, and where the others first diverge (token index, or character
    index when only text is known). None when neither ids nor text were recorded."""
    if len(batched) != len(alone) or not batched:
        return None
    use_ids = all(
        a.token_ids is not None and b.token_ids is not None
        for a, b in zip(batched, alone, strict=True)
    )
    use_text = all(
        a.text is not None and b.text is not None for a, b in zip(batched, alone, strict=True)
    )
    if not use_ids and not use_text:
        return None
    same, divergences = 0, []
    for i, (a, b) in enumerate(zip(batched, alone, strict=True)):
        x = a.token_ids if use_ids else a.text
        y = b.token_ids if use_ids else b.text
        assert x is not None and y is not None
        if list(x) == list(y):
            same += 1
            continue
        at = next(
            (j for j, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y))
        )
        divergences.append(Divergence(request=i, position=at))
    return Parity(
        compared="token_ids" if use_ids else "text",
        identical=same,
        total=len(batched),
        identical_share=same / len(batched),
        first_divergence=tuple(divergences),
    )


def join_stall(records: Sequence[RequestRecord]) -> JoinStall | None:
    """W4: the decoding streams' inter-token gaps while the long prompt joins, against their
    median gap. The join window runs from the long request's send to its second token (its
    prefill, the rebatch that adds it, and the first step it shares); a decoder's gap counts
    when it overlaps that window."""
    joins = [r for r in records if r.tag == "join"]
    decoders = [r for r in records if r.tag == "decode" and r.ok]
    if len(joins) != 1 or not joins[0].ok or not decoders:
        return None
    join = joins[0]
    start = join.sent
    end = join.chunk_times[1] if len(join.chunk_times) > 1 else join.chunk_times[0]
    gaps = []
    during = []
    for r in decoders:
        t = r.chunk_times
        for a, b in itertools.pairwise(t):
            gaps.append(b - a)
            if b > start and a < end:
                during.append(b - a)
    if not gaps:
        return None
    median = percentile(gaps, 50)
    worst = max(during) if during else None
    return JoinStall(
        join_sent_s=start,
        join_window_s=end - start,
        join_ttft_ms=join.ttft * 1000,
        decoder_itl_p50_ms=median * 1000,
        decoder_itl_max_during_join_ms=worst * 1000 if worst is not None else None,
        stall_ratio=worst / median if worst is not None and median > 0 else None,
        gaps_during_join=len(during),
        decoders_outlived_join=all(r.end >= end for r in decoders),
    )


# ---- engine counters ---------------------------------------------------------------------------

# counters that are levels or maxima, not totals: their difference means nothing
_NOT_COUNTERS = {"running", "queued", "live_batch_size", "max_batch_size", "healthy", "max_running"}


def engine_delta(
    before: Mapping[str, Any] | None, after: Mapping[str, Any] | None, duration: float
) -> EngineFigures | None:
    """The engine's own figures over one run, from two snapshots of its counters (see
    `systems.neuronpy_engine.engine_snapshot`): decode steps/s, mean batch size, the time
    split, padding."""
    if before is None or after is None:
        return None
    delta = {
        k: after[k] - before.get(k, 0)
        for k, v in after.items()
        if k not in _NOT_COUNTERS
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
        and isinstance(before.get(k, 0), (int, float))
    }
    steps = delta.get("decode_steps", 0)
    rows = delta.get("decoded_rows", 0)
    padded = delta.get("padded_kv_columns")
    real = delta.get("kv_columns")
    figures = EngineFigures(
        counters=delta,
        decode_steps=steps,
        decode_steps_per_s=steps / duration if duration > 0 else None,
        mean_batch_size=rows / steps if steps else None,
        max_batch_size_so_far=after.get("max_batch_size"),
        padding_waste=padded / real if padded is not None and real else None,
    )
    t0, t1 = before.get("timing") or {}, after.get("timing") or {}
    if not t1:
        return figures  # no time split exposed (HTTP without /stats)
    split = {k: float(t1[k]) - float(t0.get(k, 0.0)) for k in t1}
    busy = sum(split.values())
    split["other"] = max(0.0, duration - busy)  # scheduling, routers, waiting for work
    return dataclasses.replace(
        figures,
        time_s=split,
        time_share={k: v / duration for k, v in split.items()} if duration > 0 else None,
        ms_per_step={k: split[k] / steps * 1000 for k in ("forward", "sampling") if k in split}
        if steps
        else None,
    )
