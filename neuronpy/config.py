"""Server configuration: a TOML file, command-line overrides and defaults, validated once."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from neuronpy.arch.linear import QUANTIZE_MODES
from neuronpy.engine.engine import DEFAULT_MAX_N, DEFAULT_PREFIX_CACHE_BYTES
from neuronpy.engine.reasoning import REASONING_PARSERS
from neuronpy.envflags import env_flag

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DTYPES = ("auto", "float32", "bfloat16", "float16")
# 8 running sequences: on a CPU the decode step's cost is dominated by reading the weights up to
# about this batch size, so 8 streams cost little more than one (see README, "max_in_flight").
DEFAULT_MAX_IN_FLIGHT = 8
DEFAULT_MAX_QUEUE = 64
DEFAULT_QUEUE_TIMEOUT = 60.0  # seconds a request may wait for a row; 0: no deadline
DEFAULT_DRAIN_TIMEOUT = 30.0  # seconds in-flight requests get to finish on SIGTERM
# What a model may be called: it travels in URLs (/v1/models/NAME), request bodies and logs.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
API_KEY = re.compile(r"^[\x21-\x7e]+$")  # fits an HTTP header as it is
ORIGIN = re.compile(r"^(\*|[A-Za-z][A-Za-z0-9+.-]*://[^/?#\s]+)$")
API_KEY_ENV = "NEURONPY_API_KEY"  # the key when neither the flag nor the file gives one


def _check_int(section: str, name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"[{section}] {name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ValueError(f"[{section}] {name} must be {bound}, got {value}")


def _check_seconds(section: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"[{section}] {name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"[{section}] {name} must be a finite number >= 0, got {value}")


def check_cors(origins: object, credentials: object) -> tuple[str, ...]:
    """The CORS origins as a tuple, checked: each `*` or `scheme://host[:port]` (what a browser
    sends as Origin: no path, no trailing slash), and never `*` with credentials (any site could
    then make requests with the user's credentials)."""
    if isinstance(origins, str) or not isinstance(origins, (list, tuple)):
        raise ValueError(f"[server] cors_allow_origins must be a list of origins, got {origins!r}")
    for origin in origins:
        if not isinstance(origin, str) or not ORIGIN.match(origin):
            raise ValueError(
                f"[server] cors_allow_origins: {origin!r} is not an origin; write "
                f"scheme://host[:port] (no path, no trailing slash) or *"
            )
    if not isinstance(credentials, bool):
        raise ValueError(
            f"[server] cors_allow_credentials must be true or false, got {credentials!r}"
        )
    if credentials and "*" in origins:
        raise ValueError(
            '[server] cors_allow_origins = ["*"] cannot be combined with '
            "cors_allow_credentials = true: list the origins allowed to send credentials"
        )
    return tuple(origins)


SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(where: str, value: object) -> int:
    """Bytes from an integer or a size: "512MiB", "2GiB", "1.5GB", "800M" (KiB, MiB, GiB
    and TiB are powers of 1024; K, M, G and T, with or without B, powers of 1000)."""
    if isinstance(value, bool):
        raise ValueError(f"{where} must be a number of bytes or a size like 2GiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{where} must be >= 0, got {value}")
        return value
    match = SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"{where} must be a number of bytes or a size like 2GiB, got {value!r}")
    unit = (match.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    return int(float(match.group(1)) * base ** "BKMGT".index(unit[0]))


def _label(name: object) -> str:
    """How errors name a model."""
    return f"model '{name}'" if name else "[model]"


@dataclass(frozen=True)
class ServerConfig:
    """Where the HTTP server listens. Loopback by default: exposing it is a choice."""

    host: str = "127.0.0.1"
    port: int = 8000
    # on SIGTERM or Ctrl-C: seconds in-flight requests get to finish before they are aborted
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    # every route but /health needs it (Authorization: Bearer KEY); never printed
    api_key: str | None = field(default=None, repr=False)
    cors_allow_origins: tuple[str, ...] = ()  # empty: CORS off
    cors_allow_credentials: bool = False
    # where sessions (conversations' KV saved by name) live; None: sessions are off
    sessions_dir: str | None = None

    def __post_init__(self) -> None:
        if self.sessions_dir is not None and (
            not isinstance(self.sessions_dir, str) or not self.sessions_dir
        ):
            raise ValueError(
                f"[server] sessions_dir must be a directory path, got {self.sessions_dir!r}"
            )
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"[server] host must be a non-empty string, got {self.host!r}")
        _check_int("server", "port", self.port, 0, 65535)
        _check_seconds("server", "drain_timeout", self.drain_timeout)
        if self.api_key is not None and (
            not isinstance(self.api_key, str) or not API_KEY.match(self.api_key)
        ):
            # the value itself is never shown: it may be (nearly) the secret
            raise ValueError(
                "[server] api_key must be a non-empty string of printable ASCII characters "
                "without spaces"
            )
        origins = check_cors(self.cors_allow_origins, self.cors_allow_credentials)
        object.__setattr__(self, "cors_allow_origins", origins)


@dataclass(frozen=True)
class AdmissionConfig:
    """How many requests run together and how many may wait."""

    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT  # sequences decoded together in one batch
    max_queue: int = DEFAULT_MAX_QUEUE  # requests waiting beyond those; more get 503
    # seconds a queued request may wait for a row before it gets 503; 0: no deadline
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT
    max_n: int = DEFAULT_MAX_N  # completions one request may ask for; each counts as a request

    def __post_init__(self) -> None:
        _check_int("admission", "max_in_flight", self.max_in_flight, 1, 4096)
        _check_int("admission", "max_queue", self.max_queue, 0, 1_000_000)
        _check_int("admission", "max_n", self.max_n, 1, 128)
        _check_seconds("admission", "queue_timeout", self.queue_timeout)


@dataclass(frozen=True)
class EngineKnobs:
    """Engine settings that are not admission."""

    batching: bool = True  # False: one sequence at a time (NEURON_BATCHING=0 forces it)
    prefill_chunk: int = 512  # prompt tokens per prefill forward
    chunk_steps: float = 0.5  # decode steps' time a joiner's chunk may add to a step

    def __post_init__(self) -> None:
        if not isinstance(self.batching, bool):
            raise ValueError(f"[engine] batching must be true or false, got {self.batching!r}")
        _check_int("engine", "prefill_chunk", self.prefill_chunk, 1)
        steps = self.chunk_steps
        if (
            isinstance(steps, bool)
            or not isinstance(steps, (int, float))
            or not 0.1 <= steps <= 100
        ):
            raise ValueError(f"[engine] chunk_steps must be a number in [0.1, 100], got {steps!r}")


@dataclass(frozen=True)
class ModelSpec:
    """One model to serve; the defaults serve the bundled SmolLM2-135M-Instruct. `admission` is
    the server-wide [admission] with the model's own values on top (load_config merges them)."""

    name: str | None = None  # the id requests send as `model`; None: derived from the path
    path: str | None = None  # a local HF directory, a .gguf file or a hub id; None: the default
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 (or float16) on CUDA, float16 on MPS
    device: str = "auto"  # auto: cuda if available, else mps, else cpu
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    quantize: str = "none"  # "int8": int8 weights and per-row int8 activations (CPU)
    prefix_cache: bool = True  # reuse the KV of prompts (and replies) seen before
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES  # the prefix cache's budget; 0: off
    # chat replies' thinking blocks go to reasoning_content: "auto" (when the chat template
    # writes <think>), "think", or "none"
    reasoning_parser: str = "auto"
    # bytes of KV the model's running requests may hold together (a number or a size such as
    # "2GiB"); past it the newest are preempted and resume later. 0: no budget
    kv_budget: int | str = 0
    # ranks the model is split over (tensor parallelism; see worker/tp.py); 1: not split
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        where = _label(self.name)
        _check_int("model", "tensor_parallel", self.tensor_parallel, 1, 64)
        object.__setattr__(self, "kv_budget", parse_size(f"{where} kv_budget", self.kv_budget))
        if not isinstance(self.prefix_cache, bool):
            raise ValueError(
                f"{where} prefix_cache must be true or false, got {self.prefix_cache!r}"
            )
        _check_int("model", "prefix_cache_bytes", self.prefix_cache_bytes, 0)
        if self.name is not None and (not isinstance(self.name, str) or not NAME.match(self.name)):
            raise ValueError(
                f"a model name must be 1-128 letters, digits and . _ - : / (starting with a "
                f"letter or digit), got {self.name!r}"
            )
        if self.path is not None and (not isinstance(self.path, str) or not self.path):
            raise ValueError(f"{where} path must be a non-empty string, got {self.path!r}")
        if self.dtype not in DTYPES:
            raise ValueError(
                f"{where} dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"
            )
        if self.quantize not in QUANTIZE_MODES:
            raise ValueError(
                f"{where} quantize must be one of {', '.join(QUANTIZE_MODES)}, "
                f"got {self.quantize!r}"
            )
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"{where} reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                f"got {self.reasoning_parser!r}"
            )
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"{where} device must be a non-empty string, got {self.device!r}")
        if self.device != "auto":
            try:
                torch.device(self.device)
            except (RuntimeError, ValueError):
                raise ValueError(
                    f"{where} device must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}"
                ) from None


@dataclass(frozen=True)
class Config:
    """Everything `neuronpy serve` needs: one section per TOML table, and the models."""

    server: ServerConfig = field(default_factory=ServerConfig)
    models: tuple[ModelSpec, ...] = (ModelSpec(),)
    engine: EngineKnobs = field(default_factory=EngineKnobs)

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("no model to serve")
        if len(self.models) > 1 and any(m.name is None for m in self.models):
            raise ValueError("several models are served: give each one a name (NAME=PATH)")
        names = [m.name for m in self.models]
        duplicates = sorted({n for n in names if n is not None and names.count(n) > 1})
        if duplicates:
            raise ValueError(f"model names must be unique; repeated: {', '.join(duplicates)}")


_SECTIONS: dict[str, type] = {
    "server": ServerConfig,
    "admission": AdmissionConfig,
    "engine": EngineKnobs,
}


def load_config(
    path: Path | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    models: Sequence[Mapping[str, Any]] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Defaults, then the TOML file at `path`, then the command line, then the environment.

    The command line is `overrides` ({section: {key: value}}; None values are skipped; the
    "admission" and "model" (dtype, device, quantize) keys apply to every model) and `models`
    (tables of name and path, from --model), which replace the file's models.
    NEURON_BATCHING=0, false, off or no turns batching off. The API key is the flag's, else
    the file's, else $NEURONPY_API_KEY's (an empty one is unset). Raises ValueError naming the
    bad key or value."""
    data = _read_toml(path) if path is not None else {}
    where = f" in {path}" if path is not None else ""
    values: dict[str, dict[str, Any]] = {name: dict(data.get(name, {})) for name in _SECTIONS}
    flags = {s: {k: v for k, v in t.items() if v is not None} for s, t in (overrides or {}).items()}
    for section, table in flags.items():
        if section not in (*_SECTIONS, "model"):
            raise ValueError(f"unknown config section [{section}]")
        if section in values:
            values[section].update(table)
    if not env_flag("NEURON_BATCHING", environ):
        values["engine"]["batching"] = False
    env_key = (os.environ if environ is None else environ).get(API_KEY_ENV)
    if values["server"].get("api_key") is None and env_key:
        values["server"]["api_key"] = env_key
    sections = {
        name: _table(cls, values[name], f"[{name}]", where) for name, cls in _SECTIONS.items()
    }
    tables = list(models) if models else _model_tables(data, where) or [{}]
    specs = tuple(_model(table, values["admission"], flags, where) for table in tables)
    return Config(server=sections["server"], models=specs, engine=sections["engine"])


def _model(
    table: Mapping[str, Any],
    admission: Mapping[str, Any],
    flags: Mapping[str, Mapping[str, Any]],
    where: str,
) -> ModelSpec:
    """One model: its table, then the flags. Its admission: the server-wide `admission`, then
    the model's own table, then the flags."""
    values = {**table, **flags.get("model", {})}
    own = values.pop("admission", {})
    label = _label(values.get("name"))
    if not isinstance(own, dict):
        raise ValueError(f"{label} admission must be a table{where}")
    try:
        merged = {**admission, **own, **flags.get("admission", {})}
        values["admission"] = _table(AdmissionConfig, merged, "admission", where)
    except ValueError as exc:
        raise ValueError(f"{label}: {exc}") from None
    return _table(ModelSpec, values, label, where)


def _table(cls: type, values: Mapping[str, Any], label: str, where: str) -> Any:
    """`cls(**values)`, or an error naming any key it does not know."""
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(
            f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} in "
            f"{label}{where}; known keys: {', '.join(sorted(known))}"
        )
    return cls(**values)


def _model_tables(data: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """The file's models: [[models]] tables, or one [model] table."""
    if "model" in data and "models" in data:
        raise ValueError(f"use [model] (one model) or [[models]] (several), not both{where}")
    if "model" in data:
        return [data["model"]]
    tables = data.get("models", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ValueError(f"'models'{where} must be an array of tables ([[models]])")
    return tables


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with Path(path).open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path} is not valid TOML: {exc}") from None
    known = (*_SECTIONS, "model", "models")
    for section, table in data.items():
        if section not in known:
            raise ValueError(
                f"unknown section [{section}] in {path}; known sections: "
                f"{', '.join(f'[{s}]' for s in known[:-1])}, [[models]]"
            )
        if section != "models" and not isinstance(table, dict):
            raise ValueError(f"'{section}' in {path} must be a table ([{section}])")
    return data
