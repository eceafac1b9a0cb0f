"""Runs the benchmark: loads the model once, starts neuronpy and its peers on the same weights
(lineup.py), runs every workload point on every system (repeats interleaved, so drift hits all
of them alike), and gathers the results into one JSON-ready dict."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from neuronpy.bench import memory, metrics
from neuronpy.bench.config import BenchConfig, Progress
from neuronpy.bench.lineup import Weights, build_systems, load_weights, vocabulary
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


def _measure(
    system: System, workload: Workload, warmup: Workload, profile: bool = False
) -> dict[str, Any]:
    """One run of one system, in a fresh thread: start it (one warm-up), reset the peak RSS,
    run the workload, close it. The metrics, its engine's figures and the peak RSS; with
    `profile`, then the workload once more, unmeasured, recording where its steps go."""

    def session() -> dict[str, Any]:
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
        summary = metrics.summarize(out.records, out.duration)
        summary["engine"] = out.engine
        if step_profile is not None:
            summary["step_profile"] = step_profile
        summary["memory"] = {
            "rss_start_mb": rss_start,
            "rss_peak_mb": peak,
            "scope": "this run" if reset else "process lifetime",
            "cuda_peak_allocated_mb": device_peak,
        }
        if workload.name == "W4":
            summary["join"] = metrics.join_stall(out.records)
        summary["_records"] = out.records  # dropped before writing; parity reads them
        summary["_info"] = system.info()
        return summary

    started = time.perf_counter()
    try:
        return in_fresh_thread(session, name=f"neuronpy-bench-{system.name}")
    except Exception as exc:  # one system failing does not end the benchmark
        log.exception("%s failed on %s %s", system.name, workload.name, workload.point)
        error = f"{type(exc).__name__}: {exc}"[:500]
        return {"error": error, "wall_s": time.perf_counter() - started}


def _median_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The run whose output tokens/s is the median (the lower middle for an even count)."""
    good = [r for r in runs if r.get("output_tok_s") is not None]
    if not good:
        return None
    ordered = sorted(good, key=lambda r: r["output_tok_s"])
    return ordered[(len(ordered) - 1) // 2]


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


def run_bench(
    config: BenchConfig,
    *,
    weights: Weights | None = None,
    progress: Progress | None = None,
    argv: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Runs the benchmark and returns its results (see report.write_json for the file)."""
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
    results: dict[str, Any] = {
        "meta": _meta(config, weights, argv),
        "config": _jsonable(dataclasses.asdict(config))
        | {"max_in_flight": config.resolved_max_in_flight()},
        "systems": {},
        "workloads": {},
    }
    warmup = _warmup(source, config)
    for system in systems:
        results["systems"][system.name] = system.info()
        progress.write(f"{system.name}: {system.description}")
    peak_cache: dict[str, float] = {}

    def peak_tok_s() -> float:
        """W1's peak neuronpy tokens/s, from this run or a quick calibration."""
        if "peak" not in peak_cache:
            w1_points = results["workloads"].get("W1", {}).get("points", [])
            found = [
                p["results"][NEURONPY]["output_tok_s"]
                for p in w1_points
                if p["results"].get(NEURONPY, {}).get("output_tok_s")
            ]
            if found:
                peak_cache["peak"] = max(found)
            else:
                k = config.resolved_max_in_flight()
                progress.write(f"W2: calibrating W1's peak with neuronpy at K={k}")
                calib_point = w1(source, k, config.prompt_len, config.output_len)
                calib = _measure(systems[0], calib_point, warmup)
                peak_cache["peak"] = calib.get("output_tok_s") or 1.0
        return peak_cache["peak"]

    def grounded() -> list[tuple[int, ...]]:
        room = None if context_len is None else context_len - config.output_len
        return grounded_prompts(weights.tokenizer, max(config.ks), config.seed, room)

    for wname in config.workloads:
        points = _points(wname, config, source, peak_tok_s, grounded)
        entry: dict[str, Any] = {"description": DESCRIPTIONS[wname], "points": []}
        if wname == "W2":
            entry["w1_peak_tok_s"] = peak_tok_s()
        results["workloads"][wname] = entry
        for workload in points:
            _check_context(workload, context_len)
            point = _run_point(workload, systems, config.repeats, warmup, progress)
            entry["points"].append(point)
            for system_name, result in point["results"].items():
                info = result.pop("_info", None)
                if info:
                    results["systems"][system_name] = info
        if wname == "W1":
            entry["scaling_efficiency"] = _efficiency(entry["points"])
    _structured_overhead(results["workloads"])
    _speculation_gain(results["workloads"])
    return results


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


def _speculation_gain(workloads: dict[str, Any]) -> None:
    """Each point neuronpy-spec ran beside neuronpy: its tokens/s over neuronpy's
    ("spec/off") and its drafts' figures (acceptance rate, tokens a row emits per step)."""
    for entry in workloads.values():
        for point in entry.get("points", []):
            spec = point["results"].get(NEURONPY_SPEC, {})
            plain = point["results"].get(NEURONPY, {}).get("output_tok_s")
            if spec.get("output_tok_s") and plain:
                point["ratios"]["spec/off"] = spec["output_tok_s"] / plain
            counters = (spec.get("engine") or {}).get("counters") or {}
            drafted = counters.get("spec_draft_tokens", 0)
            rows = counters.get("spec_verify_rows", 0)
            if drafted and rows:
                point["speculation"] = {
                    "draft_tokens": drafted,
                    "acceptance_rate": counters.get("spec_accepted_tokens", 0) / drafted,
                    "tokens_per_row_step": counters.get("spec_emitted_tokens", 0) / rows,
                }


def _structured_overhead(workloads: dict[str, Any]) -> None:
    """W5 beside W1 at each K (the same prompts, unconstrained): neuronpy's W5/W1 tokens/s."""
    plain = {
        p["point"]: p["results"].get(NEURONPY, {}).get("output_tok_s")
        for p in workloads.get("W1", {}).get("points", [])
    }
    for point in workloads.get("W5", {}).get("points", []):
        ours = point["results"].get(NEURONPY, {}).get("output_tok_s")
        if ours and plain.get(point["point"]):
            point["ratios"]["W5/W1"] = ours / plain[point["point"]]


def _run_point(
    workload: Workload,
    systems: Sequence[System],
    repeats: int,
    warmup: Workload,
    progress: Progress,
) -> dict[str, Any]:
    active = [s for s in systems if workload.name in s.workloads]
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in active}
    for rep in range(repeats):
        # each repeat starts with the next system, so none always runs first
        shift = rep % len(active) if active else 0
        for system in active[shift:] + active[:shift]:
            # the last repeat of a closed-loop point also says where neuronpy's steps go
            profile = system.name == NEURONPY and workload.name == "W1" and rep == repeats - 1
            run = _measure(system, workload, warmup, profile)
            runs[system.name].append(run)
            rate = run.get("output_tok_s")
            shown = f"{rate:.1f} tok/s" if rate is not None else run.get("error", "no result")
            progress.write(
                f"{workload.name} {workload.point} [{rep + 1}/{repeats}] {system.name}: {shown}"
            )
    point: dict[str, Any] = {
        "point": workload.point,
        "params": workload.params,
        "results": {},
        "ratios": {},
    }
    for name, system_runs in runs.items():
        chosen = _median_run(system_runs) or system_runs[-1]
        rates = [r.get("output_tok_s") for r in system_runs]
        profiled = next((r["step_profile"] for r in system_runs if "step_profile" in r), None)
        point["results"][name] = _strip(chosen) | {
            "step_profile": profiled,
            "repeats_output_tok_s": rates,
            "repeats_median_output_tok_s": statistics.median([r for r in rates if r is not None])
            if any(r is not None for r in rates)
            else None,
            "_info": chosen.get("_info"),  # the system's description; run_bench takes it out
        }
    ours = point["results"].get(NEURONPY, {}).get("output_tok_s")
    for name, result in point["results"].items():
        theirs = result.get("output_tok_s")
        if name != NEURONPY and ours and theirs:
            point["ratios"][f"{NEURONPY}/{name}"] = ours / theirs
    if NEURONPY in runs and NEURONPY_SERIAL in runs:
        batched = runs[NEURONPY][-1].get("_records")
        alone = runs[NEURONPY_SERIAL][-1].get("_records")
        if batched and alone:
            point["parity"] = metrics.parity(batched, alone)
    if NEURONPY in runs and NEURONPY_SPEC in runs:
        plain = runs[NEURONPY][-1].get("_records")
        spec = runs[NEURONPY_SPEC][-1].get("_records")
        if plain and spec:
            point["spec_parity"] = metrics.parity(spec, plain)
    return point


def _strip(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if not k.startswith("_")}


def _efficiency(points: Sequence[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """E(K) per system, against that system's own K=1."""
    out: dict[str, dict[str, float | None]] = {}
    by_k = {int(p["params"]["k"]): p for p in points}
    if 1 not in by_k:
        return out
    for name, result in by_k[1]["results"].items():
        base = result.get("output_tok_s")
        out[name] = {
            str(k): metrics.scaling_efficiency(
                p["results"].get(name, {}).get("output_tok_s") or 0.0, k, base
            )
            if base
            else None
            for k, p in sorted(by_k.items())
        }
    return out


def _meta(config: BenchConfig, weights: Weights, argv: Sequence[str] | None) -> dict[str, Any]:
    import torch
    import transformers

    import neuronpy

    model = weights.hf_model
    params = sum(p.numel() for p in model.parameters())
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "neuronpy bench " + " ".join(argv) if argv is not None else None,
        "model": weights.name,
        "model_source": weights.source,
        "parameters": params,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "device": str(next(model.parameters()).device),
        "neuronpy": getattr(neuronpy, "__version__", None),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
