"""A benchmark's results, typed: each system at each point (`SystemResult`), each point with its
ratios and parity checks (`Point`), each workload (`WorkloadResult`), and the whole run
(`BenchResults`). `BenchResults.to_json` is the results file; its keys are the ones
docs/benchmarks.md's readers know, and the records behind the figures stay out of it."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from neuronpy.bench.config import BenchConfig
from neuronpy.bench.records import Parity, ProfiledSteps, Run, RunFailure


@dataclass(frozen=True)
class SystemResult:
    """One system at one point: its median run by output tokens/s (or, where every repeat
    failed, its last failure), with every repeat's tokens/s."""

    run: Run | RunFailure
    repeats_output_tok_s: tuple[float | None, ...]
    step_profile: ProfiledSteps | None = None  # from the repeat that was profiled, if any

    @property
    def output_tok_s(self) -> float | None:
        return self.run.output_tok_s

    @property
    def repeats_median_output_tok_s(self) -> float | None:
        rates = [r for r in self.repeats_output_tok_s if r is not None]
        return statistics.median(rates) if rates else None

    def to_json(self) -> dict[str, Any]:
        return self.run.to_json() | {
            "step_profile": None if self.step_profile is None else self.step_profile.to_json(),
            "repeats_output_tok_s": list(self.repeats_output_tok_s),
            "repeats_median_output_tok_s": self.repeats_median_output_tok_s,
        }


@dataclass(frozen=True)
class Speculation:
    """neuronpy-spec's drafts over one point's run."""

    draft_tokens: float
    acceptance_rate: float
    tokens_per_row_step: float  # tokens a row emits per verify step


@dataclass(frozen=True)
class Point:
    """One workload point (W1 at one K, W2 at one load, ...) on every system that runs it.
    `ratios`: neuronpy's tokens/s over each other system's ("neuronpy/NAME"), W5's over W1's
    at the same K ("W5/W1"), neuronpy-spec's over neuronpy's ("spec/off")."""

    point: str
    params: Mapping[str, object]
    results: Mapping[str, SystemResult]  # by system, in the table's order
    ratios: Mapping[str, float]
    parity: Parity | None = None  # neuronpy batched against neuronpy-serial
    spec_parity: Parity | None = None  # neuronpy-spec against neuronpy
    speculation: Speculation | None = None

    def rate(self, system: str) -> float | None:
        """`system`'s output tokens/s here, None where it did not run or failed."""
        result = self.results.get(system)
        return None if result is None else result.output_tok_s

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "point": self.point,
            "params": dict(self.params),
            "results": {name: r.to_json() for name, r in self.results.items()},
            "ratios": dict(self.ratios),
        }
        if self.parity is not None:
            out["parity"] = self.parity.to_json()
        if self.spec_parity is not None:
            out["spec_parity"] = self.spec_parity.to_json()
        if self.speculation is not None:
            out["speculation"] = dataclasses.asdict(self.speculation)
        return out


@dataclass(frozen=True)
class WorkloadResult:
    """One workload's points. W1 adds each system's scaling efficiency E(K) against its own
    K=1 ({system: {K: E}}), W2 the W1 peak its arrival rates are shares of."""

    description: str
    points: tuple[Point, ...]
    w1_peak_tok_s: float | None = None  # W2
    scaling_efficiency: Mapping[str, Mapping[str, float | None]] | None = None  # W1

    @property
    def systems(self) -> list[str]:
        """Every system that ran a point, in the order they first appear."""
        names: list[str] = []
        for p in self.points:
            names += [name for name in p.results if name not in names]
        return names

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "description": self.description,
            "points": [p.to_json() for p in self.points],
        }
        if self.w1_peak_tok_s is not None:
            out["w1_peak_tok_s"] = self.w1_peak_tok_s
        if self.scaling_efficiency is not None:
            out["scaling_efficiency"] = {k: dict(v) for k, v in self.scaling_efficiency.items()}
        return out


@dataclass(frozen=True)
class Meta:
    """Where and how the run ran."""

    date: str
    command: str | None  # `neuronpy bench` and its flags, where run from the command line
    model: str
    model_source: str
    parameters: int
    dtype: str
    device: str
    neuronpy: str | None
    torch: str
    transformers: str
    python: str
    platform: str
    cpu_count: int | None
    torch_threads: int


@dataclass(frozen=True)
class BenchResults:
    """Everything a run measured. `systems`: each system's description and settings (as it
    stood after its runs), by name, neuronpy first."""

    meta: Meta
    config: BenchConfig
    systems: Mapping[str, Mapping[str, Any]]
    workloads: Mapping[str, WorkloadResult]  # in the order they ran

    def to_json(self) -> dict[str, Any]:
        """The results file's content (JSON-ready)."""
        config = _jsonable(dataclasses.asdict(self.config))
        return {
            "meta": dataclasses.asdict(self.meta),
            "config": config | {"max_in_flight": self.config.resolved_max_in_flight()},
            "systems": {name: dict(info) for name, info in self.systems.items()},
            "workloads": {name: w.to_json() for name, w in self.workloads.items()},
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
