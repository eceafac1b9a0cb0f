"""OpenAI request parsing and validation into SamplingParams, and the response bodies; no I/O."""

from __future__ import annotations

import dataclasses
import math
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from neuronpy.engine.types import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_LOGPROBS,
    FinishReason,
    GenerationEvent,
    OutputFormat,
    SamplingParams,
    TokenLogprob,
)
from neuronpy.errors import (
    EngineUnhealthyError,
    InvalidRequestError,
    NeuronError,
    QueueFullError,
    ShuttingDownError,
)
from neuronpy.server.chat import ChatTools, parse_messages, parse_tools
from neuronpy.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs

Kind = Literal["chat", "text"]

DEFAULT_COMPLETION_MAX_TOKENS = 16  # /v1/completions, as OpenAI; chat defaults to the context
# Fields with a meaning neuronpy does not implement, and the values that ask for nothing.
UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),  # the deprecated form of tools
    "function_call": (None, "none", "auto"),
}
_TOKEN_ID = re.compile(r"^[0-9]{1,10}$")  # a logit_bias key


class ApiError(Exception):
    """An HTTP error with an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def unavailable(message: str, retry_after: float | None = None) -> ApiError:
    """503 with OpenAI's error body; `retry_after` seconds become an integer Retry-After header
    (rounded up, at least 1), as HTTP requires."""
    headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after else None
    return ApiError(503, message, type="service_unavailable", headers=headers)


def api_error(exc: NeuronError, kind: Kind = "text") -> ApiError:
    """The HTTP face of an engine error. In chat requests the engine's 'prompt' is 'messages'."""
    if isinstance(exc, InvalidRequestError):
        param = "messages" if kind == "chat" and exc.param == "prompt" else exc.param
        return ApiError(400, exc.message, param=param)
    if isinstance(exc, QueueFullError):
        return unavailable(str(exc), exc.retry_after)
    if isinstance(exc, (EngineUnhealthyError, ShuttingDownError)):
        return unavailable(str(exc))
    return ApiError(500, str(exc), type="server_error")


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request: what to tokenize and how to sample, before the prompt's length is
    known (max_tokens is settled by `sampling_params`)."""

    kind: Kind
    params: SamplingParams  # max_tokens here is a placeholder until sampling_params()
    max_tokens: int | None  # as the request gave it
    max_tokens_param: str  # the field it came from: max_tokens or max_completion_tokens
    stream: bool
    include_usage: bool
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat
    # chat: the tools the template sees, and whether tool-call markup becomes tool calls
    tools: ChatTools = field(default_factory=ChatTools)
    prompt: str | list[int] = ""  # completions
    n: int = 1  # completions of the prompt to return (choices)
    session: str | None = None  # continue from this session, if saved (neuronpy's extension)
    session_save: bool = True  # and save the conversation into it at the end

    def sampling_params(
        self, prompt_len: int, context_len: int, reasoning: str | None = None
    ) -> SamplingParams:
        """The request's max_tokens, or its default: 16 for completions (as OpenAI), the rest of
        the context for chat. At least 1, so a too-long prompt is reported as such. A chat
        reply is split by the model's reasoning parser `reasoning` and, with tools, into tool
        calls; a completion is plain text."""
        if self.max_tokens is not None:
            max_tokens = self.max_tokens
        elif self.kind == "chat":
            max_tokens = max(1, context_len - prompt_len)
        else:
            max_tokens = max(1, min(DEFAULT_COMPLETION_MAX_TOKENS, context_len - prompt_len))
        output = OutputFormat()
        if self.kind == "chat":
            output = OutputFormat(reasoning, self.tools.parse, self.tools.parallel)
        return dataclasses.replace(self.params, max_tokens=max_tokens, output=output)


def requested_model(body: object) -> str | None:
    """The model a request names, None if it names none; 400 if the body is not a JSON object
    or its model not a string."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_json_type(body)}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    return model


def parse_request(kind: Kind, body: object) -> ParsedRequest:
    """Validates an OpenAI chat (kind 'chat') or completions ('text') body, except its model
    (the server routes on that first); raises ApiError (400 naming the parameter). Unknown
    fields are ignored."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_json_type(body)}")
    for name, allowed in UNSUPPORTED.items():
        if name in body and not any(_same(body[name], a) for a in allowed):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name)
    _response_format(body.get("response_format"))
    n = body.get("n", 1)
    n = 1 if n is None else n
    if not _is_int(n) or n < 1:  # the engine checks its own cap (max_n) before admitting
        raise ApiError(400, f"'n' must be an integer >= 1, got {n!r}", param="n")
    stream = _optional(body, "stream", bool, False)
    include_usage = _stream_options(body, stream)
    newer = body.get("max_completion_tokens") is not None
    max_param = "max_completion_tokens" if newer else "max_tokens"
    max_tokens = body.get(max_param)
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise ApiError(400, f"'{max_param}' must be an integer >= 1", param=max_param)
    try:
        params = SamplingParams(
            max_tokens=max_tokens or 1,
            temperature=_value(body, "temperature", 1.0),
            top_p=_value(body, "top_p", 1.0),
            top_k=_value(body, "top_k", -1),
            min_p=_value(body, "min_p", 0.0),
            repetition_penalty=_value(body, "repetition_penalty", 1.0),
            presence_penalty=_value(body, "presence_penalty", 0.0),
            frequency_penalty=_value(body, "frequency_penalty", 0.0),
            seed=body.get("seed"),
            stop=_stop(body.get("stop")),
            stop_token_ids=_int_tuple(body, "stop_token_ids"),
            ignore_eos=_optional(body, "ignore_eos", bool, False),
            logprobs=_logprobs(kind, body),
            logit_bias=_logit_bias(body.get("logit_bias")),
        )
        if kind == "chat":
            messages, tools = parse_messages(body.get("messages")), parse_tools(body)
        elif body.get("tools"):
            raise InvalidRequestError("'tools' needs /v1/chat/completions", "tools")
    except InvalidRequestError as exc:
        raise ApiError(400, exc.message, param=exc.param) from None
    session, session_save = _session(body.get("session"))
    common = dict(
        kind=kind,
        session=session,
        session_save=session_save,
        params=params,
        max_tokens=max_tokens,
        max_tokens_param=max_param,
        stream=stream,
        include_usage=include_usage,
        n=n,
    )
    if kind == "chat":
        return ParsedRequest(**common, messages=messages, tools=tools)
    return ParsedRequest(**common, prompt=_prompt(body.get("prompt")))


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of `messages` (and `tools`, for a template that writes them) through the
    model's own chat template, which transformers renders in a sandboxed Jinja environment.
    Control tokens inside messages and tools are encoded as plain text, so a user cannot forge
    a turn. A template never comes from the request."""
    if not tokenizer.chat_template:
        raise ApiError(
            400, "this model has no chat template; use /v1/completions", param="messages"
        )
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            sanitize_control_tokens=True,
        )
    except TemplateError as exc:  # the template rejected the conversation (raise_exception)
        raise ApiError(
            400, f"the chat template rejected the messages: {exc}", param="messages"
        ) from None
    except ValueError as exc:  # a control token in a message that cannot be written as text
        raise ApiError(400, f"the messages cannot be encoded: {exc}", param="messages") from None
    return list(ids)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | list[int]) -> list[int]:
    """A completions prompt as token ids: a string through the tokenizer, ids as given."""
    return list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)


# ---- responses --------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens`: prompt tokens restored from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True)
class Reply:
    """Builds one request's response objects, streamed (chunks) or whole (body)."""

    kind: Kind
    model: str
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    index: int = 0  # the choice this reply's chunks and body are (n > 1: one Reply per choice)
    texts: TokenTexts | None = None  # given when the request asked for log-probabilities
    # what the stream has sent so far: tool calls, and the characters of the tokens' texts
    _sent: dict[str, int] = field(
        default_factory=lambda: {"tool_calls": 0, "chars": 0},
        init=False,
        compare=False,
        repr=False,
    )

    def __post_init__(self) -> None:
        if not self.id:
            prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
            object.__setattr__(self, "id", f"{prefix}-{uuid.uuid4().hex}")

    def _envelope(self, choices: list[dict[str, Any]], streaming: bool) -> dict[str, Any]:
        obj = {"chat": "chat.completion", "text": "text_completion"}[self.kind]
        return {
            "id": self.id,
            "object": f"{obj}.chunk" if streaming and self.kind == "chat" else obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def chunk(self, text: str | None, finish_reason: str | None = None) -> dict[str, Any]:
        """A streamed chunk. Chat: text None is the opening chunk (the role); the finishing chunk
        has an empty delta."""
        if self.kind == "chat":
            if text is None and finish_reason is None:
                delta: dict[str, Any] = {"role": "assistant", "content": ""}
            else:
                delta = {"content": text} if text else {}
            choice = {"index": self.index, "delta": delta}
        else:
            choice = {"index": self.index, "text": text or ""}
        choice.update(logprobs=None, finish_reason=finish_reason)
        out = self._envelope([choice], streaming=True)
        if self.include_usage:
            out["usage"] = None
        return out

    def event_chunks(self, event: GenerationEvent) -> list[dict[str, Any]]:
        """The streamed chunks of an event's new output, none if it has none: the reasoning,
        the content, then each tool call as OpenAI streams one (its id and name first, then
        its arguments piece by piece). The event's log-probabilities ride on the first."""
        logprobs = self._logprobs(event.logprobs) if event.logprobs else None
        if self.kind == "text":
            if not event.text and logprobs is None:
                return []
            return [self._chunk({"text": event.text}, logprobs)]
        deltas: list[dict[str, Any]] = []
        if event.reasoning:
            deltas.append({"reasoning_content": event.reasoning})
        if event.text:
            deltas.append({"content": event.text})
        for call in event.tool_calls:
            self._sent["tool_calls"] += 1
            function = {"name": call.name, "arguments": ""}
            head = {"index": call.index, "id": call.id, "type": "function", "function": function}
            deltas.append({"tool_calls": [head]})
            deltas.extend(
                {"tool_calls": [{"index": call.index, "function": {"arguments": piece}}]}
                for piece in call.pieces
            )
        if not deltas and logprobs is not None:
            deltas.append({})
        return [self._chunk({"delta": d}, None if k else logprobs) for k, d in enumerate(deltas)]

    def finish_reason(self, reason: FinishReason) -> str:
        """OpenAI's finish_reason: "tool_calls" for a streamed reply that stopped after
        making tool calls."""
        if reason is FinishReason.STOP and self._sent["tool_calls"]:
            return "tool_calls"
        return reason.value

    def _chunk(self, fields: dict[str, Any], logprobs: dict[str, Any] | None) -> dict[str, Any]:
        choice = {"index": self.index, **fields, "logprobs": logprobs, "finish_reason": None}
        out = self._envelope([choice], streaming=True)
        if self.include_usage:
            out["usage"] = None
        return out

    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens (None unless the request asked)."""
        if self.texts is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(self.texts, logprobs)
        out = completion_logprobs(self.texts, logprobs, self._sent["chars"])
        self._sent["chars"] += sum(len(token) for token in out["tokens"])
        return out

    def usage_chunk(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        out = self._envelope([], streaming=True)
        out["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return out

    def body(
        self,
        text: str,
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        *,
        events: Sequence[GenerationEvent] = (),
    ) -> dict[str, Any]:
        """The whole (non-streamed) response; `events` (all of the request's) give its
        reasoning, tool calls and log-probabilities."""
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            reasoning = "".join(e.reasoning for e in events)
            if reasoning:
                message["reasoning_content"] = reasoning
            calls = [call for e in events for call in e.tool_calls]
            if calls:
                message["content"] = text or None
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in calls
                ]
                if finish_reason == FinishReason.STOP.value:
                    finish_reason = "tool_calls"
            choice: dict[str, Any] = {"index": self.index, "message": message}
        else:
            choice = {"index": self.index, "text": text}
        self._sent["chars"] = 0
        logprobs = self._logprobs([lp for e in events for lp in e.logprobs])
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        out = self._envelope([choice], streaming=False)
        out["usage"] = usage(prompt_tokens, completion_tokens)
        return out


def finish_error(
    reason: FinishReason, error: str | None, healthy: bool, retry_after: float | None = None
) -> ApiError:
    """What an ERROR or ABORT ending means to the client. An abort (the request timed out in
    the queue, or the server is shutting down) is a 503 saying why, with `retry_after`."""
    if reason is FinishReason.ABORT:
        message = f"the request was aborted: {error or 'the server is shutting down'}"
        return unavailable(message, retry_after)
    if not healthy:
        return unavailable(error or "the model is unavailable")
    return ApiError(500, error or "generation failed", type="server_error")


# ---- field helpers ----------------------------------------------------------------------------


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    return {str: "a string", list: "an array", bool: "a boolean"}.get(type(value), "a number")


def _same(value: object, allowed: object) -> bool:
    """Equality that keeps True apart from 1 and False apart from 0."""
    return type(value) is type(allowed) and value == allowed


def _value(body: dict[str, Any], name: str, default: Any) -> Any:
    value = body.get(name)
    return default if value is None else value


def _optional(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise ApiError(400, f"'{name}' must be a {kind.__name__}", param=name)
    return value


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise ApiError(
            400, "'stream_options' is only allowed with stream=true", param="stream_options"
        )
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    return _optional(options, "include_usage", bool, False)


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")


def _int_tuple(body: dict[str, Any], name: str) -> tuple[int, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise ApiError(400, f"'{name}' must be a list of integers", param=name)
    return tuple(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _session(value: object) -> tuple[str | None, bool]:
    """`"session": "NAME"` (continue from it and save into it) or `{"name": "NAME", "save":
    false}` (continue from it, leave it as it is); the name is checked against the store."""
    if value is None:
        return None, True
    if isinstance(value, str):
        return value, True
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        unknown = sorted(set(value) - {"name", "save"})
        save = value.get("save", True)
        if not unknown and isinstance(save, bool):
            return value["name"], save
    raise ApiError(
        400,
        '\'session\' must be a session name or {"name": NAME, "save": true|false}, got '
        f"{_json_type(value)}",
        param="session",
    )


def _response_format(value: object) -> None:
    """Only text: a JSON mode needs constrained decoding, which this server does not have."""
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return
    if kind in ("json_object", "json_schema"):
        message = (
            f"response_format {kind!r} is not supported: this server has no constrained "
            'decoding; use {"type": "text"} (the default) and validate the reply yourself'
        )
    else:
        message = "'response_format' must be an object whose type is 'text'"
    raise ApiError(400, message, param="response_format")


def _logprobs(kind: Kind, body: dict[str, Any]) -> int | None:
    """How many top alternatives to report per token (0: the chosen token's only), or None.
    Chat: `logprobs: true` and `top_logprobs: N`; completions: `logprobs: N`."""
    cap = f"an integer from 0 to {MAX_LOGPROBS}"
    if kind == "text":
        value = body.get("logprobs")
        if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
            raise InvalidRequestError(f"'logprobs' must be null or {cap}", "logprobs")
        return value
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise InvalidRequestError("'logprobs' must be a boolean", "logprobs")
    top = body.get("top_logprobs")
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_LOGPROBS):
        raise InvalidRequestError(f"'top_logprobs' must be {cap}", "top_logprobs")
    if top and not wanted:
        raise InvalidRequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """{"token id": bias}: ids written as integers, biases in [-100, 100]; a 400 lists the
    entries that are not (ids outside the vocabulary are the engine's to refuse)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidRequestError(
            "'logit_bias' must be an object mapping token ids to biases", "logit_bias"
        )
    if len(value) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(
            f"'logit_bias' takes at most {MAX_LOGIT_BIAS} entries, got {len(value)}",
            "logit_bias",
        )
    bad_keys = [k for k in value if not _TOKEN_ID.match(k)]
    bad_values = [
        k
        for k, v in value.items()
        if isinstance(v, bool)
        or not isinstance(v, (int, float))
        or not -MAX_LOGIT_BIAS_VALUE <= v <= MAX_LOGIT_BIAS_VALUE
    ]
    if bad_keys or bad_values:
        raise InvalidRequestError(
            "'logit_bias' maps token ids (integers, as strings) to biases in [-100, 100]; "
            f"bad keys: {[k[:20] for k in bad_keys[:20]]}, bad biases for: "
            f"{[k[:20] for k in bad_values[:20]]}",
            "logit_bias",
        )
    bias = {int(k): float(v) for k, v in value.items()}
    if len(bias) != len(value):
        raise InvalidRequestError("'logit_bias' names a token id twice", "logit_bias")
    return tuple(bias.items())


def _prompt(value: object) -> str | list[int]:
    """A string or a list of token ids; a list holding one of those is that one."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise ApiError(400, "'prompt' is empty", param="prompt")
        return value
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        return value
    if (
        isinstance(value, list)
        and len(value) > 1
        and all(isinstance(p, (str, list)) for p in value)
    ):
        raise ApiError(
            400,
            f"'prompt' holds {len(value)} prompts; this server takes one prompt per request",
            param="prompt",
        )
    raise ApiError(
        400, "'prompt' must be a non-empty string or a non-empty list of token ids", param="prompt"
    )
