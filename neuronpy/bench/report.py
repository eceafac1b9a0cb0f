"""The benchmark's outputs from its typed results: a text table, the JSON file, and a PNG of
tokens/s against K."""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from neuronpy.bench.records import (
    Distribution,
    EngineFigures,
    JoinStall,
    Memory,
    ProfiledSteps,
    Run,
)
from neuronpy.bench.results import BenchResults, SystemResult, WorkloadResult
from neuronpy.bench.systems import NEURONPY, NEURONPY_SERIAL, NEURONPY_SPEC


def _num(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}"


def _dist(d: Distribution, keys: Sequence[str], digits: int = 0) -> str:
    return "/".join(_num(getattr(d, k), digits) for k in keys)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """Fixed-width columns; the first `left` columns left-aligned, the rest right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        out = [
            str(c).ljust(w) if i < left else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    return [line(header), *(line(r) for r in rows)]


def format_report(results: BenchResults) -> str:
    meta, config = results.meta, results.config
    params = meta.parameters
    size = f" ({params / 1e6:.1f}M parameters)" if params else ""
    lines = [
        f"neuronpy bench: {meta.model}{size}, {meta.dtype} on {meta.device}; "
        f"torch {meta.torch}, transformers {meta.transformers}, {meta.cpu_count} CPUs "
        f"({meta.torch_threads} torch threads)",
    ]
    neuronpy = results.systems.get(NEURONPY, {})
    lines.append(
        f"{NEURONPY}: {neuronpy.get('description', '?')}; repeats {config.repeats} "
        f"(the median run's figures); seed {config.seed}"
    )
    for name, info in results.systems.items():
        if name != NEURONPY:
            lines.append(f"  peer {name}: {info.get('description', '')}")
    for wname, entry in results.workloads.items():
        lines.append("")
        lines.extend(_workload_section(wname, entry, results))
    return "\n".join(lines) + "\n"


def _workload_section(wname: str, entry: WorkloadResult, results: BenchResults) -> list[str]:
    config = results.config
    points = entry.points
    names = entry.systems
    peers = [n for n in names if n != NEURONPY]
    title = f"{wname} {entry.description}"
    if wname == "W1":
        title += f" (prompt {config.prompt_len}, output {config.output_len} tokens, EOS ignored)"
    if wname == "W2":
        title += f" (W1 peak {_num(entry.w1_peak_tok_s)} tok/s)"
    lines = [title, "output tokens/s, and neuronpy's ratio to each peer:"]
    header = ["point", *names, *(f"/{p}" for p in peers)]
    efficiency = entry.scaling_efficiency or {}
    if wname == "W1" and efficiency.get(NEURONPY):
        header.append("E(K)")
    rows = []
    for p in points:
        row = [p.point, *(_rate(p.results.get(n)) for n in names)]
        row += [_ratio(p.ratios.get(f"{NEURONPY}/{peer}")) for peer in peers]
        if len(header) > len(row):
            k = str(p.params.get("k"))
            row.append(_num(efficiency[NEURONPY].get(k), 2))
        rows.append(row)
    lines += _table(header, rows)
    for p in points:
        if "W5/W1" in p.ratios:
            lines.append(
                f"{p.point}: {NEURONPY} constrained / unconstrained (W5 / W1) "
                f"{_ratio(p.ratios['W5/W1'])}"
            )
        if "spec/off" in p.ratios:
            spec = p.speculation
            drafts = (
                f"; drafts accepted {spec.acceptance_rate:.0%}, "
                f"{spec.tokens_per_row_step:.2f} tokens per row and verify step"
                if spec
                else "; no drafts"
            )
            same = p.spec_parity
            parity = f"; greedy outputs identical {same.identical}/{same.total}" if same else ""
            lines.append(
                f"{p.point}: speculative / not ({NEURONPY_SPEC} / {NEURONPY}) "
                f"{_ratio(p.ratios['spec/off'])}{drafts}{parity}"
            )
    lines.append("")
    lines.append("latency (ms): TTFT, TPOT, ITL and E2EL as p50/p99; ITL also max")
    detail_header = [
        "point",
        "system",
        "tok/s",
        "req/s",
        "TTFT",
        "TPOT",
        "ITL p50/p99/max",
        "E2EL",
        "RSS peak (+run) MB",
    ]
    detail = []
    notes = []
    for p in points:
        for name in names:
            result = p.results.get(name)
            if result is None:
                continue
            r = result.run
            if not isinstance(r, Run):
                detail.append([p.point, name, "error", "", "", "", "", "", ""])
                notes.append(f"{p.point} {name}: {r.error}")
                continue
            s = r.summary
            detail.append(
                [
                    p.point,
                    name,
                    _num(s.output_tok_s),
                    _num(s.request_s, 2),
                    _dist(s.ttft_ms, ("p50", "p99")),
                    _dist(s.tpot_ms, ("p50", "p99"), 1),
                    _dist(s.itl_ms, ("p50", "p99", "max"), 1),
                    _dist(s.e2el_ms, ("p50", "p99")),
                    _memory(r.memory),
                ]
            )
            if s.failed:
                notes.append(f"{p.point} {name}: {s.failed} failed: {list(s.errors)}")
    lines += _table(detail_header, detail, left=2)
    engine_lines = []
    for p in points:
        for name in names:
            result = p.results.get(name)
            run = None if result is None else result.run
            if isinstance(run, Run) and run.engine is not None:
                engine_lines.append(f"  {p.point} {name}: {_engine_line(run.engine)}")
            prof = None if result is None else result.step_profile
            if prof:
                engine_lines.append(f"  {p.point} {name} profiled: {_profile_line(prof)}")
    if engine_lines:
        lines.append("engine (its own counters over the run):")
        lines += engine_lines
    for p in points:
        par = p.parity
        if par:
            lines.append(
                f"parity {p.point} ({NEURONPY} batched vs {NEURONPY_SERIAL}, greedy, "
                f"{par.compared}): {par.identical}/{par.total} identical"
                + (
                    f"; first divergence at {[d.position for d in par.first_divergence]}"
                    if par.first_divergence
                    else ""
                )
            )
        for name in names:
            join = _join(p.results.get(name))
            if join:
                lines.append(
                    f"join {p.point} {name}: decoders' ITL p50 "
                    f"{_num(join.decoder_itl_p50_ms)} ms, max during the join "
                    f"{_num(join.decoder_itl_max_during_join_ms)} ms "
                    f"({_num(join.stall_ratio, 2)}x the median); the long prompt's TTFT "
                    f"{_num(join.join_ttft_ms, 0)} ms"
                    + ("" if join.decoders_outlived_join else " (decoders ended inside the join)")
                )
    lines += [f"note: {n}" for n in notes]
    return lines


def _join(result: SystemResult | None) -> JoinStall | None:
    run = None if result is None else result.run
    return run.join if isinstance(run, Run) else None


def _memory(mem: Memory) -> str:
    """The process's peak RSS over the run, and how far it rose above the run's start."""
    peak, start = mem.rss_peak_mb, mem.rss_start_mb
    grown = f" (+{max(0.0, peak - start):.0f})" if start is not None else ""
    return f"{peak:.0f}{grown}"


def _rate(result: SystemResult | None) -> str:
    if result is None:
        return "n/a"
    if result.output_tok_s is None:
        return "error"
    return _num(result.output_tok_s)


def _ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value else "-"


def _profile_line(prof: ProfiledSteps) -> str:
    """Where a decode step's time went, in ms per step, over a profiled window."""
    ms = prof.per_step_ms
    worker = ["linear", "attention", "other ops", "worker python", "worker idle"]
    within = ["prefill", "rebatch", "sampling"]
    return (
        f"step {ms['step']:.1f} ms at mean batch {prof.mean_batch_size:.1f} = "
        + " + ".join(f"{k} {ms[k]:.1f}" for k in worker)
        + "; of which riding prefill / rebatch / sampling "
        + " / ".join(f"{ms[k]:.1f}" for k in within)
        + f"; event loop CPU {ms['event loop cpu']:.1f} ms (scheduling, routers, detokenizing,"
        f" streams: beside the worker); {prof.op_calls_per_step:.0f} recorded ops per step"
    )


def _engine_line(eng: EngineFigures) -> str:
    parts = [
        f"{_num(eng.decode_steps_per_s)} decode steps/s",
        f"mean batch {_num(eng.mean_batch_size, 2)}",
    ]
    share = eng.time_share
    if share:
        order = ["forward", "prefill", "rebatch", "sampling"]
        keys = order + [k for k in share if k not in order and k != "other"] + ["other"]
        parts.append(" ".join(f"{k} {share[k] * 100:.0f}%" for k in keys if k in share))
    elif eng.time_s is None:
        parts.append("(no time split exposed)")
    if eng.padding_waste is not None:
        parts.append(f"padding {eng.padding_waste * 100:.1f}%")
    return ", ".join(parts)


# ---- files --------------------------------------------------------------------------------------


def output_stem(out_dir: Path, when: datetime.datetime | None = None) -> Path:
    when = when or datetime.datetime.now()
    return Path(out_dir) / f"bench-{when:%Y%m%d-%H%M%S}"


def write_json(results: BenchResults, path: Path) -> Path:
    """The results file (written whole, then renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results.to_json(), indent=2, default=str) + "\n")
    tmp.replace(path)
    return path


def plot_throughput(results: BenchResults, path: Path) -> tuple[Path | None, str]:
    """tokens/s against K (W1) for neuronpy and each peer. Returns (path or None, a message):
    without matplotlib, or without W1, no file and the reason."""
    w1 = results.workloads.get("W1")
    if not w1 or not w1.points:
        return None, "no plot: the tokens/s-against-K plot needs W1"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, (
            "no plot: matplotlib is not installed (pip install 'neuronpy[bench]' or "
            "pip install matplotlib); the table and the JSON have every figure"
        )
    points = w1.points
    ks = [_k(p.params) for p in points]
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    for name in w1.systems:
        xs, ys = [], []
        for k, p in zip(ks, points, strict=True):
            rate = p.rate(name)
            if rate:
                xs.append(k)
                ys.append(rate)
        if xs:
            ours = name == NEURONPY
            style: dict[str, Any] = {"linewidth": 2.5, "zorder": 3} if ours else {"linewidth": 1.5}
            ax.plot(xs, ys, marker="o", label=name, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("K concurrent streams")
    ax.set_ylabel("output tokens/s")
    meta, config = results.meta, results.config
    ax.set_title(
        f"W1: {meta.model}, {meta.dtype} on {meta.device} "
        f"(prompt {config.prompt_len}, output {config.output_len})",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path, f"plot: {path}"


def _k(params: Mapping[str, object]) -> int:
    k = params["k"]
    assert isinstance(k, int)
    return k
