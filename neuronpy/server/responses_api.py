"""OpenAI's Responses API: POST /v1/responses (streamed with its typed events, or whole), and
stored responses (GET and DELETE /v1/responses/{id}, `previous_response_id`).

A request is translated into the chat request it means (its input items as messages, its
function tools as chat tools, `text.format` as a response_format) and validated and run by the
same code as /v1/chat/completions; its events become Responses output items. A stored response
keeps its conversation (input and reply, as chat messages); a follow-up naming it continues
that conversation, and since the prefix cache holds the KV of its prompt and reply, only the
new turn is prefilled (`usage.input_tokens_details.cached_tokens`).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from neuronpy.engine.engine import Engine
from neuronpy.engine.reasoning import resolve_reasoning_parser
from neuronpy.engine.sessions import SessionStore
from neuronpy.engine.types import FinishReason, GenerationEvent, SessionRequest, ToolCall
from neuronpy.errors import InvalidRequestError, NeuronError
from neuronpy.jsontext import one_line
from neuronpy.server.copies import Copy, Events, gather, stream
from neuronpy.server.errors import ApiError, api_error, failure
from neuronpy.server.flow import prepare_while_connected, refuse_unshown_tools
from neuronpy.server.metrics import ServerMetrics
from neuronpy.server.models import ServedModel, ServerState
from neuronpy.server.request_id import name_request
from neuronpy.server.requests import BodyLimits, parse_request, read_json, requested_model
from neuronpy.server.response_store import ResponseStore, check_metadata
from neuronpy.server.responses import Reply
from neuronpy.server.sessions import open_session
from neuronpy.server.structure import decode_json

log = logging.getLogger(__name__)

HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
# the chat request's parameter names -> the Responses request's, for errors
PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "tools": "tools",
}
ROLES = ("user", "system", "developer", "assistant")
_TOOL_FUNCTION = re.compile(r"(tools\[\d+\])\.function(?=\.|$)")  # chat's tools[i].function
_MAX_TOKENS = re.compile(r"\bmax_tokens\b")


# ---- the stored responses' routes --------------------------------------------------------------


def _not_found(rid: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"no response with id {rid[:100]!r}", param=param, code="not_found")


async def get_response(store: ResponseStore, rid: str) -> Response:
    """GET /v1/responses/{id}: the stored response's JSON as it is held."""
    stored = await store.get(rid)
    if stored is None:
        raise _not_found(rid)
    return Response(stored.response, media_type="application/json")


async def delete_response(store: ResponseStore, rid: str) -> JSONResponse:
    """Deletes a stored response and, with sessions on, its file and its KV's session file."""
    if not await store.delete(rid):
        raise _not_found(rid)
    return JSONResponse({"id": rid, "object": "response", "deleted": True})


# ---- the request, as the chat request it means --------------------------------------------------


def input_messages(value: object) -> list[dict[str, Any]]:
    """`input` (a string, or a list of items: messages, function_call, function_call_output;
    reasoning items are skipped) as chat messages in the wire format of /v1/chat/completions."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("'input' must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"'{where}' must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise InvalidRequestError(
                    f"'{where}.role' must be one of {', '.join(ROLES)}", f"{where}.role"
                )
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            arguments = _string(item, "arguments", where)
            # JSON, as chat's checks take it (the template writes it parsed): checked here, so
            # that the error names this item rather than the chat message it becomes
            decode_json(arguments, ("input", i, "arguments"))
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, where)
            call_id = _string(item, "call_id", where)
            if not call_id:
                raise InvalidRequestError(
                    f"'{where}.call_id' must be a non-empty string", f"{where}.call_id"
                )
            out.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "reasoning":
            continue  # the template is given no earlier reasoning
        else:
            raise InvalidRequestError(
                f"'{where}.type' {str(kind)[:40]!r} is not supported; this server takes "
                "message, function_call, function_call_output and reasoning items",
                f"{where}.type",
            )
    return out


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"'{where}.{key}' must be a string", f"{where}.{key}")
    return value


def _text(content: object, where: str) -> str:
    """A message's content: a string, or text parts (input_text, output_text, text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text") or not isinstance(
                part.get("text"), str
            ):
                raise InvalidRequestError(
                    f"'{where}.content' takes only text parts (input_text, output_text)",
                    f"{where}.content",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(
        f"'{where}.content' must be a string or a list of text parts", f"{where}.content"
    )


def chat_tools(value: object) -> list[dict[str, Any]] | None:
    """Function tools ({"type": "function", "name", "description", "parameters"}) in chat's
    shape; any other kind of tool is a 400."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidRequestError("'tools' must be a list of tools", "tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequestError(
                f"'tools[{i}]' must be a function tool; this server has no built-in tools",
                f"tools[{i}].type",
            )
        spec = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": spec})
    return out


def chat_tool_choice(value: object) -> object:
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    return value


def chat_format(text: object) -> dict[str, Any] | None:
    """`text.format` as a response_format: text, json_object, or json_schema (its name,
    schema and strict at the top level, not under json_schema as chat has them)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise InvalidRequestError("'text' must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequestError("'text.format' must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    return fmt


def chat_body(
    body: dict[str, Any], history: list[dict[str, Any]]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The /v1/chat/completions body a Responses request means, after `history` (a stored
    response's conversation, when it continues one); and the conversation without its
    instructions (which a follow-up does not inherit)."""
    conversation = [*history, *input_messages(body.get("input"))]
    messages = list(conversation)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequestError("'instructions' must be a string", "instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    out: dict[str, Any] = {"messages": messages}
    for name in (
        "temperature",
        "top_p",
        "parallel_tool_calls",
        "seed",
        "top_k",
        "stop",
        "speculative",
    ):
        if body.get(name) is not None:
            out[name] = body[name]
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    tools = chat_tools(body.get("tools"))
    if tools:
        out["tools"] = tools
    if body.get("tool_choice") is not None:
        out["tool_choice"] = chat_tool_choice(body["tool_choice"])
    fmt = chat_format(body.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    return out, conversation


def _responses_param(param: str) -> str:
    """A chat request's parameter as the Responses request names it: `messages[2]` is
    `input[2]`, `response_format.json_schema.schema` is `text.format.schema` and
    `tools[0].function.name` is `tools[0].name` (the Responses format and tools are flat),
    `max_tokens` is `max_output_tokens`."""
    for chat, responses in (
        ("response_format.json_schema", "text.format"),
        ("response_format", "text.format"),
    ):
        if param == chat or param.startswith((chat + ".", chat + "[")):
            return responses + param[len(chat) :]
    tool = _TOOL_FUNCTION.match(param)
    if tool is not None:
        return tool[1] + param[tool.end() :]
    head, dot, rest = param.partition(".")
    base, bracket, index = head.partition("[")
    if base in PARAMS:
        return PARAMS[base] + bracket + index + dot + rest
    return param


def _renamed(exc: ApiError) -> ApiError:
    """A chat request's error, naming the Responses request's parameter, in its `param` and
    wherever its message names it (quoted, or a path such as tools[0].function.name as it is);
    and the chat parameters a message names beside it (another constraint's field, the
    engine's "max_tokens")."""
    if exc.param is not None:
        renamed = _responses_param(exc.param)
        exc.message = exc.message.replace(f"'{exc.param}'", f"'{renamed}'")
        if renamed != exc.param and ("." in exc.param or "[" in exc.param):
            where = re.compile(rf"(?<![\w.\]]){re.escape(exc.param)}(?!\w)")
            exc.message = where.sub(renamed, exc.message)
        exc.param = renamed
    for chat in ("response_format.json_schema", "response_format"):
        exc.message = exc.message.replace(f"'{chat}", f"'{_responses_param(chat)}")
    exc.message = _MAX_TOKENS.sub("max_output_tokens", exc.message)
    return exc


# ---- the response -------------------------------------------------------------------------------


@dataclass
class Builder:
    """A response's output items, built from its events; `feed` also answers the stream's
    events for them, in the order the Responses API sends them."""

    rid: str
    model: str
    body: dict[str, Any]
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[dict[str, Any]] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    text: str = ""
    _open: dict[str, Any] | None = None
    _seq: int = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def snapshot(self, status: str, **extra: Any) -> dict[str, Any]:
        b = self.body
        fmt = chat_format(b.get("text")) or {"type": "text"}
        if fmt.get("type") == "json_schema":
            fmt = {"type": "json_schema", **fmt["json_schema"]}
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": [dict(item) for item in self.output] if status != "in_progress" else [],
            "error": None,
            "incomplete_details": None,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"),
            "temperature": b.get("temperature", 1.0),
            "top_p": b.get("top_p", 1.0),
            "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools") or [],
            "text": {"format": fmt},
            "truncation": "disabled",
            "store": b.get("store", True) is not False,
            "metadata": b.get("metadata") or {},
            "reasoning": {"effort": None, "summary": None},
            "usage": None,
            **extra,
        }

    def _close(self) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.output.index(item)
        events = []
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            events.append(
                self.event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            events.append(
                self.event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=dict(part),
                )
            )
        elif item["type"] == "reasoning":
            events.append(
                self.event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=item["content"][0]["text"],
                )
            )
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.output.append(item)
        self._open = item
        shown = {**item, "status": "in_progress"}
        if item["type"] == "message":
            shown["content"] = []
        if item["type"] == "reasoning":
            shown["content"] = []
        events.append(
            self.event("response.output_item.added", output_index=len(self.output) - 1, item=shown)
        )
        if item["type"] == "message":
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=len(self.output) - 1,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []},
                )
            )
        return events

    def feed(self, event: GenerationEvent) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if event.reasoning:
            if self._open is None or self._open["type"] != "reasoning":
                item = {
                    "type": "reasoning",
                    "id": f"rs_{uuid.uuid4().hex}",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}],
                }
                events += self._start(item)
            assert self._open is not None
            self._open["content"][0]["text"] += event.reasoning
            events.append(
                self.event(
                    "response.reasoning_text.delta",
                    item_id=self._open["id"],
                    output_index=len(self.output) - 1,
                    content_index=0,
                    delta=event.reasoning,
                )
            )
        if event.text:
            if self._open is None or self._open["type"] != "message":
                item = {
                    "type": "message",
                    "id": f"msg_{uuid.uuid4().hex}",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "", "annotations": []}],
                }
                events += self._start(item)
            assert self._open is not None
            self._open["content"][0]["text"] += event.text
            self.text += event.text
            events.append(
                self.event(
                    "response.output_text.delta",
                    item_id=self._open["id"],
                    output_index=len(self.output) - 1,
                    content_index=0,
                    delta=event.text,
                    logprobs=[],
                )
            )
        for call in event.tool_calls:
            self.calls.append(call)
            item = {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": call.id,
                "name": call.name,
                "arguments": call.arguments,
            }
            events += self._start({**item, "arguments": ""})
            self._open = item
            self.output[-1] = item
            index = len(self.output) - 1
            for piece in call.pieces or (call.arguments,):
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=index,
                        delta=piece,
                    )
                )
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=call.name,
                    arguments=call.arguments,
                )
            )
            events += self._close()
        return events

    def finish(
        self, last: GenerationEvent | None, cached_tokens: int, error: ApiError | None
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The whole response, and the stream's closing events."""
        events = self._close()
        prompt = last.prompt_tokens if last is not None else 0
        generated = last.completion_tokens if last is not None else 0
        usage = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": generated,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + generated,
        }
        if error is not None:
            failed = {"code": "server_error", "message": error.message}
            response = self.snapshot("failed", usage=usage, error=failed)
            events.append(self.event("response.failed", response=response))
        elif last is not None and last.finish_reason is FinishReason.LENGTH:
            details = {"reason": "max_output_tokens"}
            response = self.snapshot("incomplete", usage=usage, incomplete_details=details)
            events.append(self.event("response.incomplete", response=response))
        else:
            response = self.snapshot("completed", usage=usage)
            events.append(self.event("response.completed", response=response))
        return response, events

    def reply_message(self) -> dict[str, Any]:
        """The reply as a chat message, for the conversation a follow-up continues."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in self.calls
            ]
        return message


# ---- the route ----------------------------------------------------------------------------------


async def create_response(
    request: Request,
    state: ServerState,
    limits: BodyLimits,
    metrics: ServerMetrics,
    store: ResponseStore,
    sessions: SessionStore | None = None,
) -> Response:
    """POST /v1/responses: validate and admit as chat would, then stream the Responses events
    or answer the whole response; store it unless `store` is false. With `sessions` (the
    sessions directory), a stored response's KV is saved there as a session named by its id,
    and a follow-up continues from its previous response's."""
    started = time.perf_counter()
    rid = f"resp_{uuid.uuid4().hex}"
    name_request(request, rid)
    model: ServedModel | None = None
    try:
        body = await read_json(request, limits)
        model = state.find(requested_model(body))
        engine = model.ready_engine()
        assert isinstance(body, dict)
        history, stream, keep = await _options(body, store)
        try:
            chat, conversation = chat_body(body, history)
        except InvalidRequestError as exc:
            raise api_error(exc) from None
        try:
            req = parse_request("chat", chat)
        except ApiError as exc:
            raise _renamed(exc) from None
        refuse_unshown_tools(model, req)
        prompt_ids = await anyio.to_thread.run_sync(req.prompt_ids, engine.tokenizer)
        reasoning = resolve_reasoning_parser(engine.config.reasoning_parser, engine.tokenizer)
        params = req.sampling_params(len(prompt_ids), engine.context_len, reasoning)
        session = await _session(sessions, engine, rid, body.get("previous_response_id"), keep)
        try:
            if not await prepare_while_connected(request.receive, engine, [(prompt_ids, params)]):
                return Response(status_code=499)  # it left while its constraint compiled
            (stream_,) = engine.submit_many(prompt_ids, params, 1, session)
        except NeuronError as exc:
            raise _renamed(api_error(exc, req.param_names)) from None
    except ApiError as exc:
        metrics.reject(model, exc)
        log.info("request %s refused: %d %s", rid, exc.status, exc.message[:200])
        raise
    log.info("request %s: model %s, %d prompt tokens (responses)", rid, model.name, len(prompt_ids))
    copy = Copy(stream_, Reply("chat", model.name), metrics.admit(model.name, started, stream_))
    builder = Builder(rid, model.name, body)

    async def stored(response: dict[str, Any]) -> None:
        if keep and response["status"] != "failed":
            await store.put(rid, response, [*conversation, builder.reply_message()])

    if stream:
        return _Streamed(copy, builder, engine, stored)  # type: ignore[return-value]
    gathered = await gather(request.receive, [copy])
    if gathered is None:
        return Response(status_code=499)  # nobody is listening
    (events,) = gathered
    last = events[-1] if events else None
    error = failure(last, engine)
    if error is not None:
        raise error
    for event in events:
        builder.feed(event)
    response, _ = builder.finish(last, stream_.cached_tokens, None)
    await stored(response)
    return JSONResponse(response)


async def _session(
    sessions: SessionStore | None, engine: Engine, rid: str, previous: str | None, keep: bool
) -> SessionRequest | None:
    """The response's session, with sessions on: continue from the previous response's KV
    (when it has a session file this model can restore), save its own under its id (when
    stored). The KV only spares a prefill: the conversation is the stored response's, so one
    that another model saved (or that cannot be read) is skipped and the conversation is
    prefilled, as it is without sessions."""
    if sessions is None or not engine.supports_sessions or not (keep or previous):
        return None
    if previous is not None:
        try:
            return await open_session(
                sessions, engine, previous, save=keep, save_as=rid if keep else None
            )
        except ApiError as exc:  # (another model's, or not a session this server reads)
            log.info("request %s: previous response's KV not restored: %s", rid, exc.message)
    return await open_session(sessions, engine, rid, save=True) if keep else None


async def _options(
    body: dict[str, Any], store: ResponseStore
) -> tuple[list[dict[str, Any]], bool, bool]:
    """The stored conversation it continues, whether it streams, whether it is stored; and
    `metadata` checked (it is echoed and stored)."""
    try:
        check_metadata(body.get("metadata"))
    except InvalidRequestError as exc:
        raise api_error(exc) from None
    stream = body.get("stream", False)
    keep = body.get("store", True)
    for name, value in (("stream", stream), ("store", keep)):
        if value is not None and not isinstance(value, bool):
            raise ApiError(400, f"'{name}' must be a boolean", param=name)
    previous = body.get("previous_response_id")
    history: list[dict[str, Any]] = []
    if previous is not None:
        if not isinstance(previous, str):
            raise ApiError(
                400, "'previous_response_id' must be a string", param="previous_response_id"
            )
        found = await store.get(previous)
        if found is None:
            raise _not_found(previous, "previous_response_id")
        history = found.messages()
    if body.get("input") is None:
        raise ApiError(400, "'input' is required", param="input")
    return history, bool(stream), keep is not False


class _Streamed:
    """The Responses stream: `event: TYPE` / `data: JSON` pairs, from response.created to
    response.completed (or .incomplete, .failed). A request that ends before any output (it
    never ran) gets a real HTTP error instead; a client that leaves cancels it."""

    def __init__(self, copy: Copy, builder: Builder, engine: Engine, stored: Any) -> None:
        self.copy, self.builder, self.engine, self.stored = copy, builder, engine, stored

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await stream(receive, [self.copy], lambda events: self._write(events, scope, receive, send))

    async def _write(self, events: Events, scope: Scope, receive: Receive, send: Send) -> None:
        b = self.builder
        _, first = await anext(events)
        if first is None or (first.finished and not first.text and not first.tool_calls):
            error = failure(first, self.engine)
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        opening = b.snapshot("in_progress")
        await _send(send, b.event("response.created", response=opening))
        await _send(send, b.event("response.in_progress", response=opening))
        last, event = None, first
        while True:
            if event is not None:
                last = event
                for out in b.feed(event):
                    await _send(send, out)
                if event.finished:
                    break
            try:
                _, event = await anext(events)
            except StopAsyncIteration:
                break
        error = failure(last, self.engine)
        response, closing = b.finish(last, self.copy.stream.cached_tokens, error)
        for out in closing:
            await _send(send, out)
        await self.stored(response)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send(send: Send, event: dict[str, Any]) -> None:
    body = f"event: {event['type']}\ndata: {one_line(event)}\n\n".encode()
    await send({"type": "http.response.body", "body": body, "more_body": True})
