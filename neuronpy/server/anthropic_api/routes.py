"""Anthropic's Messages API: POST /v1/messages (answered whole, or streamed with its events:
message_start, content_block_start / _delta / _stop, message_delta, message_stop, ping) and
POST /v1/messages/count_tokens. A translation over the chat path: the request becomes the
chat request it means, admitted by `admit()` as every API's is; its events become content
blocks (thinking, text, tool_use). Errors are in Anthropic's shape (errors.py)."""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from neuronpy.engine.remote import ServingEngine
from neuronpy.engine.types import FinishReason, GenerationEvent
from neuronpy.errors import InvalidRequestError
from neuronpy.jsontext import one_line
from neuronpy.server.anthropic_api.protocol import (
    MessagesRequest,
    parse_count_tokens,
    parse_messages,
)
from neuronpy.server.context import route_context
from neuronpy.server.copies import (
    Copy,
    Events,
    gather_one,
    refused_before_output,
    stream,
    until_finished,
)
from neuronpy.server.errors import ApiError, api_error, failure
from neuronpy.server.flow import admit
from neuronpy.server.front_door import front_door, read_body_and_model
from neuronpy.server.requests import requested_model
from neuronpy.server.responses import Reply
from neuronpy.server.stream import HEADERS

log = logging.getLogger(__name__)


def _named(body: object) -> dict[str, Any]:
    """The body, which must name a model: Anthropic's API requires one."""
    if requested_model(body) is None:
        raise ApiError(400, "'model' is required: the served model's name", param="model")
    assert isinstance(body, dict)  # (requested_model refuses any other body)
    return body


def _parsed(call: Any, body: dict[str, Any]) -> MessagesRequest:
    try:
        return call(body)
    except InvalidRequestError as exc:
        raise api_error(exc) from None


# where the chat request's names for a Messages request's fields differ from its own
_RENAMED = (("response_format.json_schema.schema", "output_config.format.schema"),)


def _renamed(error: ApiError) -> ApiError:
    for chat_name, name in _RENAMED:
        if chat_name in error.message or (error.param or "").startswith("response_format"):
            error.message = error.message.replace(chat_name, name)
            error.param = "output_config.format"
    return error


def stop_reason(last: GenerationEvent | None, tool_use: bool) -> str | None:
    """Anthropic's stop_reason for a request that ended with `last`."""
    if last is None or last.finish_reason is None:
        return None
    if last.finish_reason is FinishReason.LENGTH:
        return "max_tokens"
    if tool_use:
        return "tool_use"
    return "stop_sequence" if last.stop_sequence is not None else "end_turn"


def usage(prompt: int, cached: int, output: int) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are those not read from a cache (the prefix cache's
    or a session's are cache reads)."""
    return {
        "input_tokens": prompt - cached,
        "output_tokens": output,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "service_tier": "standard",
    }


@dataclass
class Blocks:
    """A reply's content blocks as its events build them, and, streamed, each event of
    Anthropic's stream for them in order."""

    thinking: bool  # whether reasoning is answered (as thinking blocks) or left out
    content: list[dict[str, Any]] = field(default_factory=list)
    _open: str | None = None  # the type of the block being written, if any

    def feed(self, event: GenerationEvent) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        if event.reasoning and self.thinking:
            out += self._grow("thinking", event.reasoning)
        if event.text:
            out += self._grow("text", event.text)
        for call in event.tool_calls:
            out += self._close()
            try:
                arguments = json.loads(call.arguments or "{}")
            except ValueError:
                arguments = {}
            block = {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments}
            self.content.append(block)
            index = len(self.content) - 1
            opening = {**block, "input": {}}
            out.append(("content_block_start", {"index": index, "content_block": opening}))
            for piece in call.pieces or (call.arguments,):
                delta = {"type": "input_json_delta", "partial_json": piece}
                out.append(("content_block_delta", {"index": index, "delta": delta}))
            out.append(("content_block_stop", {"index": index}))
        return out

    def _grow(self, kind: str, text: str) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        if self._open != kind:
            out += self._close()
            block: dict[str, Any] = {"type": kind, kind: ""}
            if kind == "thinking":
                block["signature"] = ""
            self.content.append(block)
            self._open = kind
            start = {"index": len(self.content) - 1, "content_block": dict(block)}
            out.append(("content_block_start", start))
        self.content[-1][kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        out.append(("content_block_delta", {"index": len(self.content) - 1, "delta": delta}))
        return out

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if self._open is None:
            return []
        self._open = None
        return [("content_block_stop", {"index": len(self.content) - 1})]

    def finish(self) -> list[tuple[str, dict[str, Any]]]:
        return self._close()

    @property
    def tool_use(self) -> bool:
        return any(block["type"] == "tool_use" for block in self.content)


async def create_message(request: Request) -> Response:
    """POST /v1/messages: validated as Anthropic does, admitted as chat is, answered whole or
    streamed with Anthropic's events."""
    mid = f"msg_{uuid.uuid4().hex}"
    async with front_door(request, mid, named=_named, logger=log) as arrival:
        req = _parsed(parse_messages, arrival.body)
        try:
            chat = req.chat()
        except InvalidRequestError as exc:
            raise api_error(exc) from None
        try:
            admitted = await admit(request.receive, arrival.model, chat, label=arrival.label)
        except ApiError as exc:  # (a schema that cannot compile is named as this API names it)
            raise _renamed(exc) from None
        if admitted is None:
            return Response(status_code=499)  # it left while its constraint compiled
        ((stream_,),) = admitted.groups
        (prompt_ids,) = admitted.prompts
    model, engine, metrics = arrival.model, arrival.engine, arrival.context.metrics
    count = len(prompt_ids)
    log.info("request %s: model %s, %d prompt tokens (messages)", arrival.label, model.name, count)
    observe = metrics.admit(model.name, arrival.started, stream_)
    copy = Copy(stream_, Reply("chat", model.name), observe)
    message = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model.name,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
    }
    blocks = Blocks(req.shows_thinking)
    if req.stream:
        return _Streamed(copy, blocks, engine, message)  # type: ignore[return-value]
    events = await gather_one(request.receive, copy, engine)
    if events is None:
        return Response(status_code=499)  # nobody is listening
    last = events[-1] if events else None
    for event in events:
        blocks.feed(event)
    blocks.finish()
    prompt = last.prompt_tokens if last is not None else len(prompt_ids)
    output = last.completion_tokens if last is not None else 0
    message |= {
        "content": blocks.content,
        "stop_reason": stop_reason(last, blocks.tool_use),
        "stop_sequence": last.stop_sequence if last is not None else None,
        "usage": usage(prompt, stream_.cached_tokens, output),
    }
    return JSONResponse(message)


class _Streamed:
    """The Messages stream. A request that ends before any output (it never ran) gets a real
    HTTP error instead; a failure after the stream started is an `error` event; a client that
    leaves cancels it."""

    def __init__(
        self, copy: Copy, blocks: Blocks, engine: ServingEngine, message: dict[str, Any]
    ) -> None:
        self.copy, self.blocks, self.engine, self.message = copy, blocks, engine, message

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await stream(receive, [self.copy], lambda events: self._write(events, scope, receive, send))

    async def _write(self, events: Events, scope: Scope, receive: Receive, send: Send) -> None:
        _, first = await anext(events)
        if await refused_before_output(first, self.engine, scope, receive, send):
            return
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        s = self.copy.stream
        opening = {**self.message, "usage": usage(s.prompt_tokens, s.cached_tokens, 0)}
        await _send(send, "message_start", {"message": opening})
        await _send(send, "ping", {})
        last = None
        async for event in until_finished(events, first):
            last = event
            for kind, data in self.blocks.feed(event):
                await _send(send, kind, data)
        for kind, data in self.blocks.finish():
            await _send(send, kind, data)
        error = failure(last, self.engine)
        if error is not None:
            await _send(send, "error", error.anthropic_body())
        else:
            output = last.completion_tokens if last is not None else 0
            delta = {
                "stop_reason": stop_reason(last, self.blocks.tool_use),
                "stop_sequence": last.stop_sequence if last is not None else None,
            }
            await _send(send, "message_delta", {"delta": delta, "usage": {"output_tokens": output}})
            await _send(send, "message_stop", {})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send(send: Send, kind: str, data: dict[str, Any]) -> None:
    body = f"event: {kind}\ndata: {one_line({'type': kind, **data})}\n\n".encode()
    await send({"type": "http.response.body", "body": body, "more_body": True})


async def count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens: the prompt tokens the Messages request would have,
    rendered as it would be (the template, the tools), nothing admitted."""
    context = route_context(request)
    body, model = await read_body_and_model(request, context, _named)
    engine = model.ready_engine()
    req = _parsed(parse_count_tokens, body)
    try:
        chat = req.chat()
        ids = await anyio.to_thread.run_sync(
            chat.prompt_ids, engine.tokenizer, limiter=context.state.tokenize_threads
        )
    except InvalidRequestError as exc:
        raise api_error(exc) from None
    return JSONResponse({"input_tokens": len(ids)})
