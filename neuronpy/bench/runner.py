"""Runs the benchmark: loads the model once, starts neuronpy and its peers on the same weights
(lineup.py), runs every workload point on every system (repeats interleaved, so drift hits all
of them alike), and gathers what they measured into typed results (results.py)."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from neuronpy.bench import memory, metrics
from neuronpy.bench.config import BenchConfig, Progress
from neuronpy.bench.lineup import Weights, build_systems, load_weights, vocabulary
from neuronpy.bench.records import Memory, Parity, Run, RunFailure
from neuronpy.bench.results import (
    BenchResults,
    Meta,
    Point,
    Speculation,
    SystemResult,
    WorkloadResult,
)
from neuronpy.bench.systems import NEURONPY, NEURONPY_SERIAL, NEURONPY_SPEC, WARMUP_TOKENS, System
from neuronpy.bench.threads import in_fresh_thread
from neuronpy.bench.workloads import (
    DESCRIPTIONS,
    WORKLOADS,
    BenchRequest,
    PromptSource,
    Workload,
    poisson_rate,
    w1,
    w2,
    w3,
    w4,
    w5,
    w6,
)

log = logging.getLogger(__name__)

W4_DECODERS = 7


def run_bench(
    config: BenchConfig,
    *,
    weights: Weights | None = None,
    progress: Progress | None = None,
    argv: Sequence[str] | None = None,
) -> BenchResults:
    """Runs the benchmark and returns its results (report.write_json writes them out)."""
    progress = progress or Progress()
    for name in config.workloads:
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if config.repeats < 1:
        raise ValueError("--repeats must be at least 1")
    if any(k < 1 for k in config.ks) or not config.ks:
        raise ValueError("every K must be at least 1")
    weights = weights or load_weights(config, progress)
    vocab, special = vocabulary(weights)
    source = PromptSource(vocab, special, seed=config.seed)
    context_len = getattr(weights.hf_model.config, "max_position_embeddings", None)
    systems = build_systems(config, weights)
    meta = _meta(weights, argv)
    infos: dict[str, Mapping[str, Any]] = {system.name: system.info() for system in systems}
    for system in systems:
        progress.write(f"{system.name}: {system.description}")
    warmup = _warmup(source, config)
    done: dict[str, WorkloadResult] = {}
    peak: list[float] = []

    def peak_tok_s() -> float:
        """W1's peak neuronpy tokens/s, from this run or a quick calibration."""
        if not peak:
            ran = done.get("W1")
            found = [rate for p in ran.points if (rate := p.rate(NEURONPY))] if ran else []
            if found:
                peak.append(max(found))
            else:
                k = config.resolved_max_in_flight()
                progress.write(f"W2: calibrating W1's peak with neuronpy at K={k}")
                calib_point = w1(source, k, config.prompt_len, config.output_len)
                calib = measure(systems[0], calib_point, warmup)
                peak.append(calib.output_tok_s or 1.0)
        return peak[0]

    def grounded() -> list[tuple[int, ...]]:
        room = None if context_len is None else context_len - config.output_len
        return grounded_prompts(weights.tokenizer, max(config.ks), config.seed, room)

    for wname in config.workloads:
        workloads = _points(wname, config, source, peak_tok_s, grounded)
        w1_peak = peak_tok_s() if wname == "W2" else None
        points: list[Point] = []
        for workload in workloads:
            _check_context(workload, context_len)
            point = _run_point(workload, systems, config.repeats, warmup, progress)
            points.append(point)
            for system_name, result in point.results.items():
                if result.run.info:  # as it stood after the run (a server's model, its url)
                    infos[system_name] = result.run.info
        efficiency = _efficiency(points) if wname == "W1" else None
        done[wname] = WorkloadResult(DESCRIPTIONS[wname], tuple(points), w1_peak, efficiency)
    return BenchResults(meta, config, infos, _across_points(done))


def _warmup(source: PromptSource, config: BenchConfig) -> Workload:
    prompts = [source.prompt(f"warmup:{i}", min(config.prompt_len, 64)) for i in range(2)]
    return Workload("warmup", "warmup", tuple(BenchRequest(p, WARMUP_TOKENS) for p in prompts))


def _check_context(workload: Workload, context_len: int | None) -> None:
    if context_len is None:
        return
    longest = max(len(r.prompt_ids) + r.max_tokens for r in workload.requests)
    if longest > context_len:
        raise ValueError(
            f"{workload.name} {workload.point} needs {longest} tokens of context; the model has "
            f"{context_len} (lower --prompt-len / --output-len / the workload sizes)"
        )


def measure(
    system: System, workload: Workload, warmup: Workload, profile: bool = False
) -> Run | RunFailure:
    """One run of one system, in a fresh thread: start it (one warm-up), reset the peak RSS,
    run the workload, close it. The metrics, its engine's figures and the peak RSS; with
    `profile`, then the workload once more, unmeasured, recording where its steps go. A
    system that raises is a RunFailure: one system failing does not end the benchmark."""

    def session() -> Run:
        try:
            system.start(warmup)
            reset = memory.reset_peak_rss()
            memory.reset_device_peak()
            rss_start = memory.rss_mb()
            out = system.run(workload)
            peak = memory.peak_rss_mb()
            device_peak = memory.device_peak_mb()
            step_profile = system.profile(workload) if profile else None
        finally:
            system.close()
        scope = "this run" if reset else "process lifetime"
        return Run(
            summary=metrics.summarize(out.records, out.duration),
            engine=out.engine,
            memory=Memory(rss_start, peak, scope, device_peak),
            records=out.records,
            info=system.info(),
            join=metrics.join_stall(out.records) if workload.name == "W4" else None,
            step_profile=step_profile,
        )

    started = time.perf_counter()
    try:
        return in_fresh_thread(session, name=f"neuronpy-bench-{system.name}")
    except Exception as exc:
        log.exception("%s failed on %s %s", system.name, workload.name, workload.point)
        error = f"{type(exc).__name__}: {exc}"[:500]
        return RunFailure(error, time.perf_counter() - started)


def _run_point(
    workload: Workload,
    systems: Sequence[System],
    repeats: int,
    warmup: Workload,
    progress: Progress,
) -> Point:
    """Every system that runs `workload`, `repeats` times each, interleaved."""
    active = [s for s in systems if workload.name in s.workloads]
    runs: dict[str, list[Run | RunFailure]] = {s.name: [] for s in active}
    for rep in range(repeats):
        # each repeat starts with the next system, so none always runs first
        shift = rep % len(active) if active else 0
        for system in active[shift:] + active[:shift]:
            # the last repeat of a closed-loop point also says where neuronpy's steps go
            profile = system.name == NEURONPY and workload.name == "W1" and rep == repeats - 1
            run = measure(system, workload, warmup, profile)
            runs[system.name].append(run)
            rate = run.output_tok_s
            failed = run.error if isinstance(run, RunFailure) else "no result"
            shown = f"{rate:.1f} tok/s" if rate is not None else failed
            progress.write(
                f"{workload.name} {workload.point} [{rep + 1}/{repeats}] {system.name}: {shown}"
            )
    results = {name: _system_result(system_runs) for name, system_runs in runs.items()}
    ours = results[NEURONPY].output_tok_s if NEURONPY in results else None
    ratios = {
        f"{NEURONPY}/{name}": ours / theirs
        for name, result in results.items()
        if name != NEURONPY and ours and (theirs := result.output_tok_s)
    }
    return Point(
        workload.point,
        workload.params,
        results,
        ratios,
        parity=_parity(runs, NEURONPY, NEURONPY_SERIAL),
        spec_parity=_parity(runs, NEURONPY_SPEC, NEURONPY),
    )


def _system_result(runs: Sequence[Run | RunFailure]) -> SystemResult:
    """The run whose output tokens/s is the median (the lower middle for an even count), or
    the last one where none has a rate."""
    good = sorted((r for r in runs if r.output_tok_s is not None), key=_rate)
    chosen = good[(len(good) - 1) // 2] if good else runs[-1]
    profiled = next((r.step_profile for r in runs if r.step_profile is not None), None)
    return SystemResult(chosen, tuple(r.output_tok_s for r in runs), profiled)


def _rate(run: Run | RunFailure) -> float:
    return run.output_tok_s or 0.0


def _parity(runs: dict[str, list[Run | RunFailure]], first: str, second: str) -> Parity | None:
    """Greedy parity of `first`'s last run against `second`'s, where both ran and succeeded."""
    if first not in runs or second not in runs:
        return None
    a, b = runs[first][-1], runs[second][-1]
    if not isinstance(a, Run) or not isinstance(b, Run) or not a.records or not b.records:
        return None
    return metrics.parity(a.records, b.records)


def _across_points(workloads: dict[str, WorkloadResult]) -> dict[str, WorkloadResult]:
    """The ratios that need more than one point's systems: W5 beside W1 at each K (the same
    prompts, unconstrained: neuronpy's W5/W1 tokens/s), and neuronpy-spec beside neuronpy
    ("spec/off", and its drafts' figures)."""
    plain = {p.point: p.rate(NEURONPY) for p in workloads["W1"].points} if "W1" in workloads else {}
    out: dict[str, WorkloadResult] = {}
    for name, entry in workloads.items():
        points = []
        for p in entry.points:
            ratios = dict(p.ratios)
            ours, base = p.rate(NEURONPY), plain.get(p.point)
            if name == "W5" and ours and base:
                ratios["W5/W1"] = ours / base
            spec = p.rate(NEURONPY_SPEC)
            if spec and ours:
                ratios["spec/off"] = spec / ours
            points.append(dataclasses.replace(p, ratios=ratios, speculation=_speculation(p)))
        out[name] = dataclasses.replace(entry, points=tuple(points))
    return out


def _speculation(point: Point) -> Speculation | None:
    """neuronpy-spec's drafts at `point`: acceptance rate, tokens a row emits per step."""
    result = point.results.get(NEURONPY_SPEC)
    run = None if result is None else result.run
    if not isinstance(run, Run) or run.engine is None:
        return None
    counters = run.engine.counters
    drafted = counters.get("spec_draft_tokens", 0)
    rows = counters.get("spec_verify_rows", 0)
    if not (drafted and rows):
        return None
    return Speculation(
        draft_tokens=drafted,
        acceptance_rate=counters.get("spec_accepted_tokens", 0) / drafted,
        tokens_per_row_step=counters.get("spec_emitted_tokens", 0) / rows,
    )


def _efficiency(points: Sequence[Point]) -> dict[str, dict[str, float | None]]:
    """E(K) per system, against that system's own K=1."""
    out: dict[str, dict[str, float | None]] = {}
    by_k = {cast(int, p.params["k"]): p for p in points}
    if 1 not in by_k:
        return out
    for name, result in by_k[1].results.items():
        base = result.output_tok_s
        out[name] = {
            str(k): metrics.scaling_efficiency(p.rate(name) or 0.0, k, base) if base else None
            for k, p in sorted(by_k.items())
        }
    return out


def _points(
    name: str,
    config: BenchConfig,
    source: PromptSource,
    peak_tok_s: Callable[[], float],
    grounded: Callable[[], list[tuple[int, ...]]] = list,
) -> list[Workload]:
    if name == "W1":
        return [w1(source, k, config.prompt_len, config.output_len) for k in config.ks]
    if name == "W5":
        return [w5(source, k, config.prompt_len, config.output_len) for k in config.ks]
    if name == "W6":
        prompts = grounded()
        return [w6(prompts, k, config.output_len) for k in config.ks]
    if name == "W2":
        peak = peak_tok_s()
        return [
            w2(
                source,
                config.requests,
                poisson_rate(peak, load, config.output_range),
                load,
                config.prompt_range,
                config.output_range,
            )
            for load in config.w2_loads
        ]
    if name == "W3":
        return [w3(source, config.requests, config.prompt_range, config.output_range)]
    if name == "W4":
        return [
            w4(
                source,
                W4_DECODERS,
                config.prompt_len,
                max(config.w4_decode_len, 16),
                config.long_prompt,
            )
        ]
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def grounded_prompts(
    tokenizer: Any, n: int, seed: int = 0, max_len: int | None = None
) -> list[tuple[int, ...]]:
    """W6's n prompts: bench/grounded.py's chat requests in the model's chat template, in
    order, those longer than `max_len` tokens left out (a small model's context)."""
    from neuronpy.bench.grounded import grounded_messages

    out: list[tuple[int, ...]] = []
    for i in range(100 * n):
        if len(out) == n:
            break
        text = tokenizer.apply_chat_template(
            grounded_messages(i, seed), add_generation_prompt=True, tokenize=False
        )
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        if max_len is None or len(ids) <= max_len:
            out.append(ids)
    if len(out) < n:
        raise ValueError(f"W6: fewer than {n} grounded prompts fit in {max_len} tokens")
    return out


def _meta(weights: Weights, argv: Sequence[str] | None) -> Meta:
    import torch
    import transformers

    import neuronpy

    model = weights.hf_model
    first = next(model.parameters())
    return Meta(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command="neuronpy bench " + " ".join(argv) if argv is not None else None,
        model=weights.name,
        model_source=weights.source,
        parameters=sum(p.numel() for p in model.parameters()),
        dtype=str(first.dtype).removeprefix("torch."),
        device=str(first.device),
        neuronpy=getattr(neuronpy, "__version__", None),
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        platform=platform.platform(),
        cpu_count=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
    )
