"""What crosses between the server's process and an engine process (engine/remote.py and
engine/host.py): plain frozen data, pickled over the channel (engine/channel.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neuronpy.config import EngineConfig
from neuronpy.engine.admission import Admission
from neuronpy.engine.counters import EngineStats
from neuronpy.engine.embeddings import Pooling
from neuronpy.engine.request import RouterMessage
from neuronpy.engine.types import SamplingParams, SessionRequest


@dataclass(frozen=True)
class ModelFacts:
    """What the server says of a model (the API's model cards, session checks): no tensor."""

    model_type: str
    hidden_size: int
    dtype: str  # as sessions name it: "float32"
    num_kv_layers: int
    num_kv_heads: int
    head_dim: int
    weight_bytes: int
    device: str  # "cpu", "cuda", "mps"
    parameters: int = 0  # the checkpoint's parameter count (0: not known)
    # how the checkpoint stores its weights, as Ollama names it: "Q4_K_M", "BF16" ("": not known)
    file_type: str = ""


@dataclass(frozen=True)
class EngineInfo:
    """An engine's fixed facts, sent once when its process is ready."""

    name: str
    config: EngineConfig
    admission: Admission
    facts: ModelFacts
    task: str
    pooling: Pooling
    fingerprint: str
    kv_capacity_tokens: int


# ---- server -> engine ------------------------------------------------------------------------


@dataclass(frozen=True)
class Submit:
    """Admit a prompt's n completions under the client's ids for them (`ids`, one a copy)."""

    ids: tuple[int, ...]
    prompt: tuple[int, ...]
    params: SamplingParams
    session: SessionRequest | None
    labels: tuple[str | None, ...] = ()  # what each copy is called (none: empty)


@dataclass(frozen=True)
class Cancel:
    """Its client has gone: the request ends (a queued one never runs)."""

    id: int


@dataclass(frozen=True)
class Leave:
    """Its router has ended the stream (a stop string): the row leaves at the next step."""

    id: int


@dataclass(frozen=True)
class Call:
    """A question with an answer (`Reply` with the same `call`): `method` of EngineHost's
    CALLS, with `args`."""

    call: int
    method: str
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Close:
    """Stop: every request still admitted is aborted, the engine shuts down, the process ends."""


# ---- engine -> server ------------------------------------------------------------------------


@dataclass(frozen=True)
class Facts:
    """What a request's stream says of it beside its events (see RequestStream)."""

    cached_tokens: int
    drafts: tuple[int, int]
    queue_seconds: float | None


@dataclass(frozen=True)
class Status:
    """The engine as a client reads it without asking: its stats, health and retry hint."""

    stats: EngineStats
    healthy: bool
    failure: str | None  # why it is unhealthy
    retry_after: float


@dataclass(frozen=True)
class Frame:
    """What one turn of the engine's loop (or a call) had for the client: each request's
    router messages in order, the facts that changed, and the status after them."""

    messages: tuple[tuple[int, RouterMessage], ...]
    facts: tuple[tuple[int, Facts], ...]
    status: Status


@dataclass(frozen=True)
class Reply:
    """The answer to `Call` number `call`: its value, or the error it raised."""

    call: int
    value: Any = None
    error: BaseException | None = None


@dataclass(frozen=True)
class Ready:
    """The engine process has loaded and started its engine."""

    info: EngineInfo
    tokenizer: Any  # the engine's own tokenizer, pickled: the client tokenizes and detokenizes
    status: Status
    processor: Any = None  # a vision-language model's processor: the client prepares images


@dataclass(frozen=True)
class Failed:
    """The engine process could not start its engine: what the load raised."""

    error: BaseException
