"""Server configuration: a TOML file, command-line overrides and defaults, validated once."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DTYPES = ("auto", "float32", "bfloat16", "float16")
# 8 running sequences: on a CPU the decode step's cost is dominated by reading the weights up to
# about this batch size, so 8 streams cost little more than one (see README, "max_in_flight").
DEFAULT_MAX_IN_FLIGHT = 8
DEFAULT_MAX_QUEUE = 64


def _check_int(section: str, name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"[{section}] {name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ValueError(f"[{section}] {name} must be {bound}, got {value}")


@dataclass(frozen=True)
class ServerConfig:
    """Where the HTTP server listens. Loopback by default: exposing it is a choice."""

    host: str = "127.0.0.1"
    port: int = 8000

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"[server] host must be a non-empty string, got {self.host!r}")
        _check_int("server", "port", self.port, 0, 65535)


@dataclass(frozen=True)
class ModelSpec:
    """Which model to serve: None is the bundled default (SmolLM2-135M-Instruct)."""

    path: str | None = None  # a local HF directory, a .gguf file or a hub id
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 (or float16) on CUDA, float16 on MPS
    device: str = "auto"  # auto: cuda if available, else mps, else cpu

    def __post_init__(self) -> None:
        if self.path is not None and (not isinstance(self.path, str) or not self.path):
            raise ValueError(f"[model] path must be a non-empty string, got {self.path!r}")
        if self.dtype not in DTYPES:
            raise ValueError(
                f"[model] dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"
            )
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"[model] device must be a non-empty string, got {self.device!r}")
        if self.device != "auto":
            try:
                torch.device(self.device)
            except (RuntimeError, ValueError):
                raise ValueError(
                    f"[model] device must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}"
                ) from None


@dataclass(frozen=True)
class AdmissionConfig:
    """How many requests run together and how many may wait."""

    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT  # sequences decoded together in one batch
    max_queue: int = DEFAULT_MAX_QUEUE  # requests waiting beyond those; more get 503

    def __post_init__(self) -> None:
        _check_int("admission", "max_in_flight", self.max_in_flight, 1, 4096)
        _check_int("admission", "max_queue", self.max_queue, 0, 1_000_000)


@dataclass(frozen=True)
class EngineKnobs:
    """Engine settings that are not admission."""

    batching: bool = True  # False: one sequence at a time (NEURON_BATCHING=0 forces it)
    prefill_chunk: int = 512  # prompt tokens per prefill forward

    def __post_init__(self) -> None:
        if not isinstance(self.batching, bool):
            raise ValueError(f"[engine] batching must be true or false, got {self.batching!r}")
        _check_int("engine", "prefill_chunk", self.prefill_chunk, 1)


@dataclass(frozen=True)
class Config:
    """Everything `neuronpy serve` needs, one section per TOML table."""

    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelSpec = field(default_factory=ModelSpec)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    engine: EngineKnobs = field(default_factory=EngineKnobs)


_SECTIONS: dict[str, type] = {
    "server": ServerConfig,
    "model": ModelSpec,
    "admission": AdmissionConfig,
    "engine": EngineKnobs,
}


def load_config(
    path: Path | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Defaults, then the TOML file at `path`, then `overrides` (command-line flags, given as
    {section: {key: value}}; None values are skipped), then the environment
    (NEURON_BATCHING=0, false, off or no turns batching off).
    Raises ValueError naming the bad key or value."""
    values: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    if path is not None:
        for section, table in _read_toml(path).items():
            values[section].update(table)
    for section, table in (overrides or {}).items():
        if section not in values:
            raise ValueError(f"unknown config section [{section}]")
        values[section].update({k: v for k, v in table.items() if v is not None})
    env = os.environ if environ is None else environ
    if env.get("NEURON_BATCHING", "").strip().lower() in ("0", "false", "off", "no"):
        values["engine"]["batching"] = False
    where = f" in {path}" if path is not None else ""
    sections = {}
    for name, cls in _SECTIONS.items():
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values[name]) - known)
        if unknown:
            raise ValueError(
                f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} in "
                f"[{name}]{where}; known keys: {', '.join(sorted(known))}"
            )
        sections[name] = cls(**values[name])
    return Config(**sections)


def _read_toml(path: Path) -> dict[str, dict[str, Any]]:
    try:
        with Path(path).open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path} is not valid TOML: {exc}") from None
    for section, table in data.items():
        if section not in _SECTIONS:
            raise ValueError(
                f"unknown section [{section}] in {path}; known sections: "
                f"{', '.join(f'[{s}]' for s in _SECTIONS)}"
            )
        if not isinstance(table, dict):
            raise ValueError(f"'{section}' in {path} must be a table ([{section}])")
    return data
