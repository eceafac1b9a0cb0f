"""Server configuration: a TOML file, command-line overrides and defaults, validated once."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuronpy.defaults import (
    COMPILE_MODES,
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_CHUNK_STEPS,
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_GRAMMAR_CACHE_BYTES,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_LIMIT_CONCURRENCY,
    DEFAULT_MAX_BUFFERED_EVENTS,
    DEFAULT_MAX_COMPILE_BYTES,
    DEFAULT_MAX_COMPILE_SECONDS,
    DEFAULT_MAX_COMPILES,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_MAX_MASK_MS,
    DEFAULT_MAX_N,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_PREFIX_CACHE_BYTES,
    DEFAULT_QUEUE_TIMEOUT,
    DEFAULT_SESSION_HEADER,
    DTYPES,
    POOLINGS,
    QUANTIZE_MODES,
    REASONING_PARSERS,
    SPECULATIVE_METHODS,
    TASKS,
    TOOL_CALL_PARSERS,
    FieldError,
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_seconds,
    parse_size,
)
from neuronpy.envflags import env_flag

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# What a model may be called: it travels in URLs (/v1/models/NAME), request bodies and logs.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
# What torch.device takes, checked without importing torch: a device type, maybe an index.
DEVICE = re.compile(r"^(auto|(cpu|cuda|mps|xpu|hpu|npu|meta)(:\d+)?)$")
API_KEY = re.compile(r"^[\x21-\x7e]+$")  # fits an HTTP header as it is
# an HTTP header name (RFC 9110's token), or "" for none
HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]*$")
ORIGIN = re.compile(r"^(\*|[A-Za-z][A-Za-z0-9+.-]*://[^/?#\s]+)$")
API_KEY_ENV = "NEURONPY_API_KEY"  # the key when neither the flag nor the file gives one


@dataclass(frozen=True)
class EngineConfig:
    """How one model's engine admits, batches, caches and parses: its every setting."""

    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT  # rows of the lockstep batch
    max_queue: int = DEFAULT_MAX_QUEUE  # requests waiting beyond those; more are refused (503)
    # seconds a queued request may wait for a row before it is refused (503); 0: no deadline
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT
    max_n: int = DEFAULT_MAX_N  # completions one request may ask for; each counts as a request
    # events a request's client may leave unread; past that the request ends (stalled reader)
    max_buffered_events: int = DEFAULT_MAX_BUFFERED_EVENTS
    batching: bool = True  # False: one sequence at a time, through the same code
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens per prefill forward
    # how much a joiner's prompt chunk may lengthen a decode step, in decode steps: smaller
    # keeps the decoding rows' inter-token gaps smoother, larger lets prompts join sooner
    chunk_steps: float = DEFAULT_CHUNK_STEPS
    # what the weights become (defaults.QUANTIZE_MODES): "auto" keeps a quantized GGUF file's
    # 4- and 8-bit weights as they are and a float checkpoint's as they are
    quantize: str = "auto"
    # the layers as one graph compiled at start-up (PyTorch's inductor, its cache on disk):
    # "auto" (on the CPU), "on" or "off" (eager); a model that cannot be compiled runs eagerly
    compile: str = "auto"
    prefix_cache: bool = True  # keep prompts' (and replies') KV to reuse as prefixes
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES  # the prefix cache's budget; 0: off
    # bytes of KV the running requests may hold together, given as a number or a size such as
    # "2GiB" and an int of bytes once built; past it the newest are preempted and resume later
    # where they stopped. 0: no budget
    kv_budget: int | str = 0
    # how chat replies' thinking blocks go to reasoning_content: "auto" (when the chat template
    # writes <think>), "none", or a parser's name ("think")
    reasoning_parser: str = "auto"
    # the markup a chat reply's tool calls are written in: "auto" (detected from the chat
    # template; Hermes/Qwen's <tool_call> when it names none) or a format's name (README)
    tool_call_parser: str = "auto"
    # what the model serves: "auto", "generate" (chat, completions, and embeddings of its
    # hidden states) or "embed" (embeddings only); see defaults.TASKS
    task: str = "auto"
    # embeddings: the pooling ("auto": the checkpoint's sentence-transformers config, else
    # "last"; "mean", "cls") and whether vectors are L2-normalized (None: as the checkpoint
    # says, else yes)
    pooling: str = "auto"
    normalize: bool | None = None
    # bytes of compiled grammars (structured outputs) kept for reuse; a constraint whose
    # grammar alone is larger is refused (400)
    grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES
    # distinct constraints compiled at once (each a thread and a core); others wait, up to
    # max_queue of them (then 503 with Retry-After); a request whose constraint is compiling
    # already waits for that compile
    max_compiles: int = DEFAULT_MAX_COMPILES
    # one constraint's compile: seconds and bytes of memory (a child process that is stopped
    # there; the request is a 400 naming the bound); 0 seconds: no bounds, on a thread
    max_compile_seconds: float = DEFAULT_MAX_COMPILE_SECONDS
    max_compile_bytes: int | str = DEFAULT_MAX_COMPILE_BYTES
    # milliseconds one row's constraint may take for a token (mask and advance); a row over it
    # for two tokens in a row ends alone, a 400 naming its constraint (the batch waits for
    # every row's mask)
    max_mask_ms: float = DEFAULT_MAX_MASK_MS
    # speculative decoding: "off", "ngram" (prompt lookup: drafts copied from the context) or
    # "draft" (`draft_model`, a smaller model of the same tokenizer, drafts); a request may
    # ask for another ("speculative" in its body)
    speculative: str = "off"
    # the most drafts a row verifies per step; 0: by method (prompt lookup 8, a draft model 4)
    num_speculative_tokens: int = 0
    # the most drafts one step verifies over its greedy rows together (shared out: the
    # longest are cut first); sampled rows keep theirs
    max_drafts_per_step: int = 32
    prompt_lookup_min: int = 2  # the n-gram sizes prompt lookup matches, longest first
    prompt_lookup_max: int = 4
    draft_model: str = ""  # a path or hub id: the draft model ("draft"; loaded beside the model)

    def __post_init__(self) -> None:
        check_int("max_in_flight", self.max_in_flight, 1, 4096)
        check_int("max_queue", self.max_queue, 0, 1_000_000)
        check_seconds("queue_timeout", self.queue_timeout)
        check_int("max_n", self.max_n, 1, 128)
        check_int("max_buffered_events", self.max_buffered_events, 2, 1_000_000)
        check_bool("batching", self.batching)
        check_int("prefill_chunk", self.prefill_chunk, 1)
        check_number("chunk_steps", self.chunk_steps, 0.1, 100)
        check_choice("quantize", self.quantize, QUANTIZE_MODES)
        check_choice("compile", self.compile, COMPILE_MODES)
        check_bool("prefix_cache", self.prefix_cache)
        check_int("prefix_cache_bytes", self.prefix_cache_bytes, 0)
        check_choice("reasoning_parser", self.reasoning_parser, REASONING_PARSERS)
        check_choice("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        check_choice("task", self.task, TASKS)
        check_choice("pooling", self.pooling, POOLINGS)
        if self.normalize is not None:
            check_bool("normalize", self.normalize)
        check_int("grammar_cache_bytes", self.grammar_cache_bytes, 1 << 16)
        check_int("max_compiles", self.max_compiles, 1, 256)
        check_seconds("max_compile_seconds", self.max_compile_seconds)
        check_number("max_mask_ms", self.max_mask_ms, 0.1, 1e6)
        check_choice("speculative", self.speculative, SPECULATIVE_METHODS)
        check_int("num_speculative_tokens", self.num_speculative_tokens, 0, 32)
        check_int("max_drafts_per_step", self.max_drafts_per_step, 1, 4096)
        check_int("prompt_lookup_min", self.prompt_lookup_min, 1, 16)
        check_int("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min, 16)
        if not isinstance(self.draft_model, str):
            raise ValueError(f"draft_model must be a path or a model id, got {self.draft_model!r}")
        if self.speculative == "draft" and not self.draft_model:
            raise ValueError('speculative = "draft" needs a draft_model')
        object.__setattr__(self, "kv_budget", parse_size("kv_budget", self.kv_budget))
        compile_bytes = parse_size("max_compile_bytes", self.max_compile_bytes)
        check_int("max_compile_bytes", compile_bytes, 16 << 20)
        object.__setattr__(self, "max_compile_bytes", compile_bytes)
        object.__setattr__(self, "max_compile_seconds", float(self.max_compile_seconds))
        object.__setattr__(self, "max_mask_ms", float(self.max_mask_ms))
        object.__setattr__(self, "queue_timeout", float(self.queue_timeout))
        object.__setattr__(self, "chunk_steps", float(self.chunk_steps))


# The config file's table for each EngineConfig field (each in exactly one): the server-wide
# [admission] (a model's own `admission` table on top of it) and [engine], and the model's own.
ADMISSION_KEYS = ("max_in_flight", "max_queue", "queue_timeout", "max_n", "max_buffered_events")
ENGINE_KEYS = ("batching", "prefill_chunk", "chunk_steps")
MODEL_KEYS = (
    "quantize",
    "compile",
    "prefix_cache",
    "prefix_cache_bytes",
    "kv_budget",
    "reasoning_parser",
    "tool_call_parser",
    "task",
    "pooling",
    "normalize",
    "grammar_cache_bytes",
    "max_compiles",
    "max_compile_seconds",
    "max_compile_bytes",
    "max_mask_ms",
    "speculative",
    "num_speculative_tokens",
    "max_drafts_per_step",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "draft_model",
)


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
    # ...after this many seconds of unreadiness (/health 503) still admitting requests, while a
    # load balancer or a router notices and stops sending here; 0: stop admitting at once
    drain_grace: float = 0.0
    # every route but /health needs it (Authorization: Bearer KEY); never printed
    api_key: str | None = field(default=None, repr=False)
    cors_allow_origins: tuple[str, ...] = ()  # empty: CORS off
    cors_allow_credentials: bool = False
    # where sessions (conversations' KV saved by name) live; None: sessions are off
    sessions_dir: str | None = None
    # with sessions on: the header naming a request's session when its body names none (a
    # router's affinity key); "" turns it off
    session_header: str = DEFAULT_SESSION_HEADER
    # what one client can hold (see connections.py); 0 turns each off: seconds a connection's
    # request head may take to arrive (after it opened, or its previous response ended)...
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT  # ...and a request's body (else 408)
    # requests handled at once, /health and /metrics aside; more get 503 at once
    limit_concurrency: int = DEFAULT_LIMIT_CONCURRENCY
    web: bool = True  # the chat page at / and the batch view at /batch
    # fetch the http(s) image URLs of requests (public addresses only: server/image_urls.py)
    image_urls: bool = False
    # the largest request body, in bytes or as a size ("32MiB"): images come inline, base64
    max_body: int | str = 4 << 20
    # each model's engine (scheduler, runner, device worker) in a process of its own, the
    # HTTP server, tokenizing and detokenizing in this one; False: all in this process
    engine_process: bool = True

    def __post_init__(self) -> None:
        try:
            if self.sessions_dir is not None and (
                not isinstance(self.sessions_dir, str) or not self.sessions_dir
            ):
                raise FieldError(
                    "sessions_dir", f"must be a directory path, got {self.sessions_dir!r}"
                )
            if not isinstance(self.session_header, str) or not HEADER_NAME.match(
                self.session_header
            ):
                raise FieldError(
                    "session_header",
                    f'must be an HTTP header name or "" (off), got {self.session_header!r}',
                )
            object.__setattr__(self, "session_header", self.session_header.lower())
            if not isinstance(self.host, str) or not self.host:
                raise FieldError("host", f"must be a non-empty string, got {self.host!r}")
            check_int("port", self.port, 0, 65535)
            check_seconds("drain_timeout", self.drain_timeout)
            check_seconds("drain_grace", self.drain_grace)
            check_seconds("header_timeout", self.header_timeout)
            check_seconds("body_timeout", self.body_timeout)
            check_int("limit_concurrency", self.limit_concurrency, 0, 1_000_000)
            check_bool("web", self.web)
            check_bool("image_urls", self.image_urls)
            object.__setattr__(self, "max_body", parse_size("max_body", self.max_body))
            check_int("max_body", self.max_body, 1024, 1 << 31)
            check_bool("engine_process", self.engine_process)
        except FieldError as exc:
            raise ValueError(f"[server] {exc}") from None
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
class ModelSpec:
    """One model to serve and its engine's settings; the defaults serve the bundled
    SmolLM2-135M-Instruct."""

    name: str | None = None  # the id requests send as `model`; None: derived from the path
    path: str | None = None  # a local HF directory, a .gguf file or a hub id; None: the default
    # auto: bfloat16 on a CPU with avx512_bf16 or AMX (else float32; float32 with weights kept
    # quantized), bfloat16 (or float16) on CUDA, float16 on MPS
    dtype: str = "auto"
    device: str = "auto"  # auto: cuda if available, else mps, else cpu
    # ranks the model is split over (tensor parallelism; see worker/tp.py); 1: not split
    tensor_parallel: int = 1
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if self.name is not None and (not isinstance(self.name, str) or not NAME.match(self.name)):
            raise ValueError(
                f"a model name must be 1-128 letters, digits and . _ - : / (starting with a "
                f"letter or digit), got {self.name!r}"
            )
        try:
            if self.path is not None and (not isinstance(self.path, str) or not self.path):
                raise FieldError("path", f"must be a non-empty string, got {self.path!r}")
            check_choice("dtype", self.dtype, DTYPES)
            if not isinstance(self.device, str) or not DEVICE.match(self.device):
                raise FieldError(
                    "device", f"must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}"
                )
            check_int("tensor_parallel", self.tensor_parallel, 1, 64)
            if not isinstance(self.engine, EngineConfig):
                raise FieldError("engine", f"must be an EngineConfig, got {self.engine!r}")
        except FieldError as exc:
            raise ValueError(f"{_label(self.name)} {exc}") from None


@dataclass(frozen=True)
class Config:
    """Everything `neuronpy serve` needs: the server, and the models with their engines."""

    server: ServerConfig = field(default_factory=ServerConfig)
    models: tuple[ModelSpec, ...] = (ModelSpec(),)

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("no model to serve")
        if len(self.models) > 1 and any(m.name is None for m in self.models):
            raise ValueError("several models are served: give each one a name (NAME=PATH)")
        names = [m.name for m in self.models]
        duplicates = sorted({n for n in names if n is not None and names.count(n) > 1})
        if duplicates:
            raise ValueError(f"model names must be unique; repeated: {', '.join(duplicates)}")


_SERVER_KEYS = tuple(f.name for f in dataclasses.fields(ServerConfig))
_SPEC_KEYS = tuple(f.name for f in dataclasses.fields(ModelSpec) if f.name != "engine")
_MODEL_TABLE_KEYS = (*_SPEC_KEYS, *MODEL_KEYS, "admission")  # what a model's table may hold
_SECTIONS = {"server": _SERVER_KEYS, "admission": ADMISSION_KEYS, "engine": ENGINE_KEYS}


def load_config(
    path: Path | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    models: Sequence[Mapping[str, Any]] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Defaults, then the TOML file at `path`, then the command line, then the environment.

    The command line is `overrides` ({section: {key: value}}; None values are skipped; the
    "admission", "engine" and "model" (dtype, device, quantize...) keys apply to every model)
    and `models` (tables of name and path, from --model), which replace the file's models.
    A model's engine settings: [engine] and [admission], its own table and `admission` table
    on top, then the flags. NEURON_BATCHING=0, false, off or no turns batching off. The API
    key is the flag's, else the file's, else $NEURONPY_API_KEY's (an empty one is unset).
    Raises ValueError naming the bad key or value and where it was written."""
    data = _read_toml(path) if path is not None else {}
    where = f" in {path}" if path is not None else ""
    flags = {s: {k: v for k, v in t.items() if v is not None} for s, t in (overrides or {}).items()}
    for section in flags:
        if section not in (*_SECTIONS, "model"):
            raise ValueError(f"unknown config section [{section}]")
    tables: dict[str, dict[str, Any]] = {}
    for name, keys in _SECTIONS.items():
        tables[name] = {**data.get(name, {}), **flags.get(name, {})}
        _check_keys(tables[name], keys, f"[{name}]", where)
    env_key = (os.environ if environ is None else environ).get(API_KEY_ENV)
    if tables["server"].get("api_key") is None and env_key:
        tables["server"]["api_key"] = env_key
    server = ServerConfig(**tables["server"])
    # the model's own admission table goes between the server-wide one and the flags
    shared = {**data.get("admission", {}), **tables["engine"]}
    on_top = dict(flags.get("admission", {}))
    if not env_flag("NEURON_BATCHING", environ):
        on_top["batching"] = False  # the one place NEURON_BATCHING is read
    model_tables = list(models) if models else _model_tables(data, where) or [{}]
    specs = tuple(
        _model({**table, **flags.get("model", {})}, shared, on_top, where) for table in model_tables
    )
    return Config(server=server, models=specs)


def _model(
    values: Mapping[str, Any], shared: Mapping[str, Any], on_top: Mapping[str, Any], where: str
) -> ModelSpec:
    """One model from its table: its own keys, and its EngineConfig from the `shared` tables,
    then the model's own keys and `admission` table, then `on_top`."""
    label = _label(values.get("name"))
    _check_keys(values, _MODEL_TABLE_KEYS, label, where)
    own = values.get("admission", {})
    if not isinstance(own, dict):
        raise ValueError(f"{label} admission must be a table{where}")
    try:
        _check_keys(own, ADMISSION_KEYS, "admission", where)
    except ValueError as exc:
        raise ValueError(f"{label}: {exc}") from None
    settings = {k: v for k, v in values.items() if k in MODEL_KEYS}
    try:
        engine = EngineConfig(**{**shared, **settings, **own, **on_top})
    except FieldError as exc:
        if exc.field in MODEL_KEYS:
            raise ValueError(f"{label} {exc}") from None
        section = "admission" if exc.field in ADMISSION_KEYS else "engine"
        written = f"{label}: " if exc.field in own and exc.field not in on_top else ""
        raise ValueError(f"{written}[{section}] {exc}") from None
    spec = {k: v for k, v in values.items() if k in _SPEC_KEYS}
    return ModelSpec(**spec, engine=engine)


def _check_keys(values: Mapping[str, Any], known: Sequence[str], label: str, where: str) -> None:
    """An error naming any key of `values` not in `known`."""
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(
            f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} in "
            f"{label}{where}; known keys: {', '.join(sorted(known))}"
        )


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
