"""Request-facing value types: sampling parameters, finish reasons and stream events."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from neuronpy.errors import InvalidRequestError

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256


class FinishReason(str, enum.Enum):
    """Why a sequence stopped, spelled as the OpenAI API spells it."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # cancelled by the client or by shutdown
    ERROR = "error"  # the engine or this request failed


def _check_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"'{name}' must be a number, got {type(value).__name__}", name)
    if not math.isfinite(value):
        raise InvalidRequestError(f"'{name}' must be finite", name)
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops. Validated on construction (InvalidRequestError).

    temperature == 0 is greedy. `seed` makes sampled output reproducible whatever else is in the
    batch; None draws a fresh seed per request.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k cut
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        mt = self.max_tokens
        if isinstance(mt, bool) or not isinstance(mt, int):
            raise InvalidRequestError("'max_tokens' must be an integer", "max_tokens")
        if mt < 1:
            raise InvalidRequestError(f"'max_tokens' must be at least 1, got {mt}", "max_tokens")
        if _check_number("temperature", self.temperature) < 0:
            raise InvalidRequestError("'temperature' must be >= 0", "temperature")
        top_p = _check_number("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise InvalidRequestError("'top_p' must be in (0, 1]", "top_p")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequestError("'top_k' must be an integer >= -1", "top_k")
        if not 0.0 <= _check_number("min_p", self.min_p) <= 1.0:
            raise InvalidRequestError("'min_p' must be in [0, 1]", "min_p")
        if not 0.0 < _check_number("repetition_penalty", self.repetition_penalty) <= 10.0:
            raise InvalidRequestError(
                "'repetition_penalty' must be in (0, 10]", "repetition_penalty"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= _check_number(name, getattr(self, name)) <= 2.0:
                raise InvalidRequestError(f"'{name}' must be in [-2, 2]", name)
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise InvalidRequestError("'seed' must be an integer", "seed")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("'stop' must be a string or a list of strings", "stop")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"'stop' takes at most {MAX_STOP_STRINGS} strings", "stop")
        if any(not s or len(s) > MAX_STOP_LENGTH for s in self.stop):
            raise InvalidRequestError(
                f"each 'stop' string must have 1 to {MAX_STOP_LENGTH} characters", "stop"
            )
        if not isinstance(self.stop_token_ids, tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise InvalidRequestError(
                "'stop_token_ids' must be a list of non-negative integers", "stop_token_ids"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerationEvent:
    """One step of a request's stream, as its router emits it.

    `text` is the new text since the previous event (never half a UTF-8 character, never part
    of a stop string). The last event of a stream has `finish_reason` set; `error` is set when
    finish_reason is ERROR.
    """

    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Completion:
    """A whole request's result, gathered from its events."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
