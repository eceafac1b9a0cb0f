"""Request-facing value types: sampling parameters, finish reasons and stream events."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from pathlib import Path

from neuronpy.engine.reasoning import REASONING_MARKERS
from neuronpy.engine.speculative import SPECULATIVE_METHODS
from neuronpy.engine.tools import TOOL_FORMATS
from neuronpy.errors import InvalidRequestError

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_LOGIT_BIAS_VALUE = 100.0
MAX_ALLOWED_TOKENS = 1 << 17  # allowed_token_ids entries (past any vocabulary's size)
# OpenAI's range; past it a distribution is all but flat anyway
MAX_TEMPERATURE = 2.0
MAX_TOP_K = 2**31 - 1  # what the tensor ops take as a count
MAX_TOKEN_ID = 2**31  # ids past any vocabulary (stop_token_ids, logit_bias, allowed_token_ids)
# Temperatures below this are greedy, as in vLLM: dividing by one near zero overflows float32
# and the softmax turns to NaN.
MIN_TEMPERATURE = 1e-5


class FinishReason(str, enum.Enum):
    """Why a sequence stopped, spelled as the OpenAI API spells it."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # cancelled by the client or by shutdown
    ERROR = "error"  # the engine or this request failed


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_TOKEN_ID


def _check_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"'{name}' must be a number, got {type(value).__name__}", name)
    if not math.isfinite(value):
        raise InvalidRequestError(f"'{name}' must be finite", name)
    return float(value)


@dataclass(frozen=True)
class OutputFormat:
    """How the router splits a reply's text (chat): a leading reasoning block and tool calls.
    The default splits nothing: every character is content."""

    reasoning: str | None = None  # a reasoning parser ("think"); None: no reasoning block
    tool_calls: bool = False  # tool-call markup (in `tool_format`) -> ToolCalls
    parallel_tool_calls: bool = True  # False: only the first tool call is returned
    tool_format: str = "hermes"  # the markup's format, a name of engine/tools.py's TOOL_FORMATS
    # the request's tools' parameter types (engine/tools.py's parameter_types), for a format whose
    # argument values are untyped text (qwen3_coder, glm45): a "string" parameter's value stays text
    tool_types: tuple[tuple[str, str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.reasoning is not None and self.reasoning not in REASONING_MARKERS:
            raise InvalidRequestError(f"unknown reasoning parser {self.reasoning!r}")
        if self.tool_format not in TOOL_FORMATS:
            raise InvalidRequestError(f"unknown tool-call format {self.tool_format!r}")


# What a constrained request may ask (engine/grammar.py compiles it; docs/structured-outputs.md)
CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "tools")
MAX_CONSTRAINT_CHARS = 64 << 10  # a schema's, regex's or grammar's text
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match, for constrained decoding: a JSON Schema
    ("json_schema", `spec` its JSON text), any JSON object ("json_object"), a regex, one of
    `choices` ("choice"), an EBNF grammar ("grammar"), or well-formed calls of the tools in
    `spec` ("tools": {"tools": [{"name", "parameters"}], "parallel": bool, "format": a tool
    format of engine/tools.py, Hermes when absent}, as JSON).

    `param` is the request field it came from, named by its errors; it is not part of the
    constraint's identity (two requests with the same schema share one compiled grammar)."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()
    param: str = field(default="response_format", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidRequestError(
                f"unknown constraint {self.kind!r}; one of {', '.join(CONSTRAINT_KINDS)}",
                self.param,
            )
        if not isinstance(self.spec, str) or len(self.spec) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequestError(
                f"'{self.param}' takes at most {MAX_CONSTRAINT_CHARS} characters", self.param
            )
        if self.kind == "choice":
            if not 1 <= len(self.choices) <= MAX_CHOICES or not all(
                isinstance(c, str) and 0 < len(c) <= MAX_CHOICE_CHARS for c in self.choices
            ):
                raise InvalidRequestError(
                    f"'{self.param}' must be 1 to {MAX_CHOICES} non-empty strings of at most "
                    f"{MAX_CHOICE_CHARS} characters",
                    self.param,
                )
            total = sum(len(c) for c in self.choices)
            if total > MAX_CONSTRAINT_CHARS:  # (as a schema's or a grammar's text is)
                raise InvalidRequestError(
                    f"'{self.param}' takes at most {MAX_CONSTRAINT_CHARS} characters of choices "
                    f"together, got {total}",
                    self.param,
                )
        elif self.kind not in ("json_object",) and not self.spec:
            raise InvalidRequestError(f"'{self.param}' is empty", self.param)


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
    # top alternatives to report with each token's log-probability (0: the chosen token's
    # only); None: no log-probabilities
    logprobs: int | None = None
    # (token id, bias) pairs added to the raw logits before anything else; ids are unique
    logit_bias: tuple[tuple[int, float], ...] = ()
    # the only ids it may sample (EOS included only if listed); None: any
    allowed_token_ids: tuple[int, ...] | None = None
    output: OutputFormat = OutputFormat()
    # what the output must match (constrained decoding); None: anything
    constraint: Constraint | None = None
    # speculative decoding for this request: "off", "ngram" (prompt lookup) or "draft" (the
    # model's draft model); None: as the model is configured
    speculative: str | None = None

    def __post_init__(self) -> None:
        mt = self.max_tokens
        if isinstance(mt, bool) or not isinstance(mt, int):
            raise InvalidRequestError("'max_tokens' must be an integer", "max_tokens")
        if mt < 1:
            raise InvalidRequestError(f"'max_tokens' must be at least 1, got {mt}", "max_tokens")
        if not 0.0 <= _check_number("temperature", self.temperature) <= MAX_TEMPERATURE:
            raise InvalidRequestError(
                f"'temperature' must be in [0, {MAX_TEMPERATURE:g}]", "temperature"
            )
        top_p = _check_number("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise InvalidRequestError("'top_p' must be in (0, 1]", "top_p")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or not -1 <= k <= MAX_TOP_K:
            raise InvalidRequestError(f"'top_k' must be an integer from -1 to {MAX_TOP_K}", "top_k")
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
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64
        ):
            raise InvalidRequestError("'seed' must be an integer within 64 bits", "seed")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("'stop' must be a string or a list of strings", "stop")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"'stop' takes at most {MAX_STOP_STRINGS} strings", "stop")
        if any(not s or len(s) > MAX_STOP_LENGTH for s in self.stop):
            raise InvalidRequestError(
                f"each 'stop' string must have 1 to {MAX_STOP_LENGTH} characters", "stop"
            )
        if not isinstance(self.stop_token_ids, tuple) or not all(
            _is_token_id(t) for t in self.stop_token_ids
        ):
            raise InvalidRequestError(
                "'stop_token_ids' must be a list of non-negative integers", "stop_token_ids"
            )
        n = self.logprobs
        if n is not None and (
            isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS
        ):
            raise InvalidRequestError(
                f"'logprobs' must be an integer from 0 to {MAX_LOGPROBS}", "logprobs"
            )
        _check_logit_bias(self.logit_bias)
        _check_allowed(self.allowed_token_ids, self.constraint)
        if not isinstance(self.output, OutputFormat):
            raise InvalidRequestError("'output' must be an OutputFormat")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise InvalidRequestError("'constraint' must be a Constraint")
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise InvalidRequestError(
                f"'speculative' must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.speculative!r}",
                "speculative",
            )

    @property
    def greedy(self) -> bool:
        """Whether it samples the argmax (temperatures below MIN_TEMPERATURE are greedy)."""
        return self.temperature < MIN_TEMPERATURE


def _check_logit_bias(bias: object) -> None:
    if not isinstance(bias, tuple) or not all(
        isinstance(pair, tuple) and len(pair) == 2 for pair in bias
    ):
        raise InvalidRequestError("'logit_bias' must be (token id, bias) pairs", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(
            f"'logit_bias' takes at most {MAX_LOGIT_BIAS} entries, got {len(bias)}", "logit_bias"
        )
    bad_ids = [t for t, _ in bias if not _is_token_id(t)]
    bad_values = [
        b
        for _, b in bias
        if isinstance(b, bool)
        or not isinstance(b, (int, float))
        or not -MAX_LOGIT_BIAS_VALUE <= b <= MAX_LOGIT_BIAS_VALUE
    ]
    if bad_ids or bad_values:
        raise InvalidRequestError(
            f"'logit_bias' needs token ids >= 0 and biases in [-100, 100]; bad ids: "
            f"{bad_ids[:20]}, bad biases: {bad_values[:20]}",
            "logit_bias",
        )
    if len({t for t, _ in bias}) != len(bias):
        raise InvalidRequestError("'logit_bias' names a token id twice", "logit_bias")


def _check_allowed(allowed: object, constraint: object) -> None:
    if allowed is None:
        return
    if (
        not isinstance(allowed, tuple)
        or not 1 <= len(allowed) <= MAX_ALLOWED_TOKENS
        or not all(_is_token_id(t) for t in allowed)
    ):
        raise InvalidRequestError(
            f"'allowed_token_ids' must be 1 to {MAX_ALLOWED_TOKENS} non-negative token ids",
            "allowed_token_ids",
        )
    if constraint is not None:  # (both at once may leave no token at all)
        raise InvalidRequestError(
            "'allowed_token_ids' cannot be combined with a constraint on the output "
            "(response_format, structured outputs or tool_choice)",
            "allowed_token_ids",
        )


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model's raw logits (a log-softmax of the
    logits row it was sampled from, before logit_bias, penalties and temperature), with the
    most likely ids of that row, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), as many as asked


@dataclass(frozen=True)
class ToolCall:
    """A complete, well-formed tool call the model wrote, as OpenAI returns it."""

    index: int  # its place among the reply's tool calls
    id: str
    name: str
    arguments: str  # a JSON object's text, as the model wrote it
    # `arguments` cut where the generated text was cut into deltas (joined, they are it)
    pieces: tuple[str, ...] = ()


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
    reasoning: str = ""  # new text of the reasoning block (with an OutputFormat.reasoning)
    tool_calls: tuple[ToolCall, ...] = ()  # tool calls completed since the previous event
    logprobs: tuple[TokenLogprob, ...] = ()  # of token_ids, when the request asked for them
    # on the last event: why the request's session could not be saved (its reply is whole)
    session_error: str | None = None
    # with `error`: the request's own field it is about (a 400: its session file was bad);
    # None: the server's side failed
    error_param: str | None = None
    # on the last event, when a stop string ended the request: which one (never in `text`)
    stop_sequence: str | None = None

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
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class SessionRequest:
    """What a request asks of a session: continue from it if it exists (`token_ids` is then
    what it holds), and save the conversation into it at the end (`save`), or into another
    session's file (`save_path`: a stored response continues its previous one's, and saves its
    own)."""

    name: str
    path: Path
    save: bool = True
    token_ids: tuple[int, ...] | None = None  # None: no such session yet
    save_path: Path | None = None  # where the save goes; None: `path`
