"""Configuration defaults, allowed values and the checks that enforce them (a leaf: no torch)."""

from __future__ import annotations

import math
import re

DTYPES = ("auto", "float32", "bfloat16", "float16")
# What a model's weights become (arch/linear.py's make_linear): "auto" keeps a quantized
# checkpoint's quantization (a GGUF file's 4- and 8-bit tensors) and a float one as it is;
# "none" computes in floating point (dequantizing); the weight-only modes quantize the weights
# alone; "int8" weights and activations.
WEIGHT_ONLY_MODES = ("int4", "int4-g64", "int4-g128", "int8-weight")
QUANTIZE_MODES = ("auto", "none", *WEIGHT_ONLY_MODES, "int8")
# whether the layers run as one compiled graph (PyTorch's inductor): "auto" (on the CPU, where
# it is measured to pay; off elsewhere until it is), "on" or "off"
COMPILE_MODES = ("auto", "on", "off")
# What a model's `reasoning_parser` may be: "auto" (detected from the chat template), "none",
# or a parser of neuronpy.engine.reasoning (the names of its REASONING_MARKERS): "think"
# (<think>...</think>), "harmony" (gpt-oss's analysis channel).
REASONING_PARSERS = ("auto", "none", "think", "harmony")
# What a model's `tool_call_parser` may be: "auto" (detected from the chat template) or the
# markup of one family (neuronpy.engine.tools' TOOL_FORMATS: Hermes/Qwen's <tool_call>,
# Granite's <|tool_call|>, Phi-4-mini's functools[...], Mistral's [TOOL_CALLS], FunctionGemma's
# <start_function_call>, Qwen3-Coder / Qwen3.5's <tool_call><function=...> XML, LFM2's
# <|tool_call_start|>[NAME(key=value)]<|tool_call_end|>; gpt-oss's harmony messages to
# functions.NAME on the commentary channel).
# What a model serves: "generate" (chat and completions; embeddings too, pooling its hidden
# states), "embed" (embeddings, scores and reranking by their cosine: an embedding
# checkpoint), "rerank" (scores and reranking by the model's "yes" against "no" after a
# query-and-document prompt: a Qwen3-Reranker-style checkpoint), or "auto" (embed when the
# checkpoint is a sentence-transformers embedding model, else generate).
TASKS = ("auto", "generate", "embed", "rerank")
# How an embedding pools the hidden states: "auto" (the checkpoint's sentence-transformers
# pooling config, else the last token's, as decoder embedding models pool) or one of these.
POOLINGS = ("auto", "last", "mean", "cls")
TOOL_CALL_PARSERS = (
    "auto",
    "harmony",
    "hermes",
    "granite",
    "phi4_mini",
    "mistral",
    "functiongemma",
    "qwen3_coder",
    "lfm2",
)

DEFAULT_PREFILL_CHUNK = 512  # prompt tokens per prefill forward
DEFAULT_CHUNK_STEPS = 0.5  # decode steps' time a joiner's prompt chunk may add to a step
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30  # the prefix cache's KV budget per model
DEFAULT_GRAMMAR_CACHE_BYTES = 64 << 20  # compiled grammars kept per model (constraints)
# distinct constraints one model compiles at once (each takes a thread and a core); more wait,
# up to max_queue of them (then 503 with Retry-After); one already compiling is waited for
DEFAULT_MAX_COMPILES = 2
# One compile's bounds (its cost is not its text's size: 200 optional characters in a row take
# 25 s; see engine/compile_child.py): wall time, and heap beyond the server's. The largest
# constraints the text limits allow that are not built to be slow (64 KiB of choices, a schema
# of 800 properties) take under 1 s here, tried in the child and then compiled.
DEFAULT_MAX_COMPILE_SECONDS = 10.0
DEFAULT_MAX_COMPILE_BYTES = 1 << 30
# Milliseconds one row's constraint may take for one token (its mask and its advance) before
# the batch stops waiting for it: a row over it twice in a row ends, a 400 naming its constraint.
# Ordinary grammars take under 0.3 ms a token on a 49k vocabulary; nested unbounded repetition
# ((\w+\s*)*) grows with every token, past 10 ms by the hundredth.
DEFAULT_MAX_MASK_MS = 20.0
DEFAULT_MAX_N = 8  # completions one request may ask for
# 8 running sequences: on a CPU the decode step's cost is dominated by reading the weights up to
# about this batch size, so 8 streams cost little more than one (see docs/serving.md, "What
# max_in_flight does").
DEFAULT_MAX_IN_FLIGHT = 8
DEFAULT_MAX_QUEUE = 64
# events a request's consumer may leave unread before the request is ended (a stalled reader)
DEFAULT_MAX_BUFFERED_EVENTS = 1024
DEFAULT_QUEUE_TIMEOUT = 60.0  # seconds a request may wait for a row; 0: no deadline
DEFAULT_DRAIN_TIMEOUT = 30.0  # seconds in-flight requests get to finish on SIGTERM
# What one client can hold (see docs/serving.md, "Limits, overload and shutdown"): a connection's
# request head must arrive within HEADER_TIMEOUT seconds of its opening (or of the previous
# response), a request's body within BODY_TIMEOUT seconds (4 MiB at about 1 Mbit/s); at most
# LIMIT_CONCURRENCY requests are handled at once, /health and /metrics aside. 0: no limit.
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 30.0
# Above what the engines admit at the defaults (8 running + 64 queued per model) for a few
# models, with room for the requests being read, refused or answered from memory.
DEFAULT_LIMIT_CONCURRENCY = 256
# The request header a router's session affinity hashes on (vllm-router's consistent_hash);
# with sessions on, a request carrying it continues and saves the session of that name.
DEFAULT_SESSION_HEADER = "x-session-id"


class FieldError(ValueError):
    """A configuration value that breaks its rule. `field` names it, so that the config file's
    loader can say which section and model it was written in."""

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field} {rule}")
        self.field = field


def check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    """An integer (not a bool) in [low, high]; no upper bound when `high` is None."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(name, f"must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise FieldError(name, f"must be {bound}, got {value}")


def check_seconds(name: str, value: object) -> None:
    """A finite number of seconds >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(name, f"must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise FieldError(name, f"must be a finite number >= 0, got {value}")


def check_number(name: str, value: object, low: float, high: float) -> None:
    """A number (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise FieldError(name, f"must be a number in [{low:g}, {high:g}], got {value!r}")


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise FieldError(name, f"must be true or false, got {value!r}")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise FieldError(name, f"must be one of {', '.join(choices)}, got {value!r}")


SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(name: str, value: object) -> int:
    """Bytes from an integer or a size: "512MiB", "2GiB", "1.5GB", "800M" (KiB, MiB, GiB
    and TiB are powers of 1024; K, M, G and T, with or without B, powers of 1000)."""
    if isinstance(value, bool):
        raise FieldError(name, f"must be a number of bytes or a size like 2GiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise FieldError(name, f"must be >= 0, got {value}")
        return value
    match = SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise FieldError(name, f"must be a number of bytes or a size like 2GiB, got {value!r}")
    unit = (match.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    return int(float(match.group(1)) * base ** "BKMGT".index(unit[0]))


# how a model speculates (speculative decoding): off, prompt lookup, or a draft model
SPECULATIVE_METHODS = ("off", "ngram", "draft")
