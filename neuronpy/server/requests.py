"""A request's JSON body, read within its size limit and validated into a ParsedRequest."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
from starlette.requests import Request
from transformers import PreTrainedTokenizerBase

from neuronpy.defaults import DEFAULT_BODY_TIMEOUT
from neuronpy.engine.types import OutputFormat, SamplingParams
from neuronpy.errors import InvalidRequestError
from neuronpy.server import fields
from neuronpy.server.constraints import parse_constraint, tool_constraint
from neuronpy.server.errors import ApiError, api_error
from neuronpy.server.prompts import (
    ChatTools,
    encode_prompt,
    parse_messages,
    parse_tools,
    render_chat,
)
from neuronpy.server.schema import check_types
from neuronpy.server.structure import decode_json

Kind = Literal["chat", "text"]

MAX_BODY_BYTES = 4 << 20
INLINE_DECODE_BYTES = 16 << 10  # decoded on the event loop (a fifth of a millisecond)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # /v1/completions, as OpenAI; chat defaults to the context


@dataclass(frozen=True)
class BodyLimits:
    """What a request body may take: bytes, and seconds for all of them to arrive (0: no
    deadline), so that a client sending it byte by byte cannot hold its request forever."""

    max_bytes: int = MAX_BODY_BYTES
    timeout: float = DEFAULT_BODY_TIMEOUT


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
    # completions: the prompts (a list of several: one choice per prompt and copy)
    prompts: tuple[str | list[int], ...] = ("",)
    n: int = 1  # completions of the prompt to return (choices)
    session: str | None = None  # continue from this session, if saved (neuronpy's extension)
    session_save: bool = True  # and save the conversation into it at the end

    @property
    def param_names(self) -> dict[str, str]:
        """What this request calls the parameters the engine names, for its errors."""
        names = {"max_tokens": self.max_tokens_param}
        if self.kind == "chat":
            names["prompt"] = "messages"
        return names

    def prompt_ids(self, tokenizer: PreTrainedTokenizerBase, index: int = 0) -> list[int]:
        """Prompt `index`'s token ids (blocking: run it in a thread); 400 if it cannot be
        encoded."""
        try:
            if self.kind == "chat":
                return render_chat(tokenizer, self.messages, self.tools.tools)
            return encode_prompt(tokenizer, self.prompts[index])
        except InvalidRequestError as exc:
            raise api_error(exc) from None

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


async def read_json(request: Request, limits: BodyLimits) -> object:
    """The body as JSON, structurally sound (structure.py: nesting depth, valid Unicode): 415
    unless it says it is JSON, 413 past `limits.max_bytes` (before reading them when
    Content-Length says so), 408 unless it all arrives within `limits.timeout` seconds, 400 if
    it does not parse or check. A client that hangs up meanwhile raises starlette's
    ClientDisconnect (errors.py answers it quietly)."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(415, "the request body must be JSON (Content-Type: application/json)")
    limit = limits.max_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    with anyio.move_on_after(limits.timeout or None) as deadline:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    if deadline.cancelled_caught:
        raise ApiError(
            408,
            f"the request body did not arrive within {limits.timeout:g} seconds",
            code="request_timeout",
            headers={"Connection": "close"},  # the rest of it may still be on its way
        )
    raw = b"".join(chunks)
    try:  # a large body off the event loop: 4 MiB take up to a fifth of a second to check
        if len(raw) > INLINE_DECODE_BYTES:
            return await anyio.to_thread.run_sync(decode_json, raw)
        return decode_json(raw)
    except InvalidRequestError as exc:
        raise api_error(exc) from None


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body exceeds {limit} bytes", code="request_too_large")


def requested_model(body: object) -> str | None:
    """The model a request names, None if it names none; 400 if the body is not a JSON object
    or its model not a string."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {fields.json_type(body)}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    return model


def parse_request(kind: Kind, body: object) -> ParsedRequest:
    """Validates an OpenAI chat (kind 'chat') or completions ('text') body, except its model
    (the server routes on that first); raises ApiError (400 naming the parameter). Unknown
    fields are ignored."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {fields.json_type(body)}")
    try:
        return _parse(kind, body)
    except InvalidRequestError as exc:
        raise api_error(exc) from None


def _parse(kind: Kind, body: dict[str, Any]) -> ParsedRequest:
    check_types(kind == "chat", body)  # every field's JSON type, before any field's rules
    fields.unsupported(body)
    constraint = parse_constraint(body)
    n = body.get("n", 1)
    n = 1 if n is None else n
    if not fields.is_int(n) or n < 1:  # the engine checks its own cap (max_n) before admitting
        raise InvalidRequestError(f"'n' must be an integer >= 1, got {n!r}", "n")
    stream = fields.optional(body, "stream", bool, False)
    include_usage = fields.stream_options(body, stream)
    newer = body.get("max_completion_tokens") is not None
    max_param = "max_completion_tokens" if newer else "max_tokens"
    max_tokens = body.get(max_param)
    if max_tokens is not None and (not fields.is_int(max_tokens) or max_tokens < 1):
        raise InvalidRequestError(f"'{max_param}' must be an integer >= 1", max_param)
    params = SamplingParams(
        max_tokens=max_tokens or 1,
        temperature=fields.value(body, "temperature", 1.0),
        top_p=fields.value(body, "top_p", 1.0),
        top_k=fields.value(body, "top_k", -1),
        min_p=fields.value(body, "min_p", 0.0),
        repetition_penalty=fields.value(body, "repetition_penalty", 1.0),
        presence_penalty=fields.value(body, "presence_penalty", 0.0),
        frequency_penalty=fields.value(body, "frequency_penalty", 0.0),
        seed=body.get("seed"),
        stop=fields.stop(body.get("stop")),
        stop_token_ids=fields.int_tuple(body, "stop_token_ids"),
        ignore_eos=fields.optional(body, "ignore_eos", bool, False),
        logprobs=fields.logprobs(kind == "chat", body),
        logit_bias=fields.logit_bias(body.get("logit_bias")),
        constraint=constraint,
        speculative=fields.optional(body, "speculative", str, None),
    )
    if kind == "chat":
        messages, tools = parse_messages(body.get("messages")), parse_tools(body)
        params = dataclasses.replace(params, constraint=tool_constraint(tools, constraint))
    elif body.get("tools"):
        raise InvalidRequestError("'tools' needs /v1/chat/completions", "tools")
    session, session_save = fields.session(body.get("session"))
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
    prompts = fields.prompts(body.get("prompt"))
    if session is not None and len(prompts) > 1:
        raise InvalidRequestError("a request with a 'session' takes one prompt", "prompt")
    return ParsedRequest(**common, prompts=prompts)
