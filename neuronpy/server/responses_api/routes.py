"""The Responses API's routes: POST /v1/responses, validated and admitted as chat is, then
streamed with its typed events or answered whole; GET and DELETE of stored responses."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from neuronpy.engine.remote import ServingEngine
from neuronpy.engine.sessions import SessionStore
from neuronpy.engine.types import SessionRequest
from neuronpy.errors import InvalidRequestError
from neuronpy.jsontext import one_line
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
from neuronpy.server.front_door import front_door
from neuronpy.server.response_ids import new_response_id
from neuronpy.server.responses import Reply
from neuronpy.server.responses_api.builder import Builder
from neuronpy.server.responses_api.events import Event
from neuronpy.server.responses_api.objects import ResponseObject
from neuronpy.server.responses_api.protocol import parse_responses, stored_messages
from neuronpy.server.responses_api.store import ResponseStore
from neuronpy.server.sessions import open_session
from neuronpy.server.stream import HEADERS

log = logging.getLogger(__name__)

# ---- the stored responses' routes --------------------------------------------------------------


def _not_found(rid: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"no response with id {rid[:100]!r}", param=param, code="not_found")


def response_store(request: Request) -> ResponseStore:
    """The stored responses of the app that `request` came to (`app.state.responses`)."""
    store = request.app.state.responses
    assert isinstance(store, ResponseStore)
    return store


async def stored_response(request: Request) -> Response:
    """GET /v1/responses/{id}: the stored response; DELETE: it is deleted."""
    store, rid = response_store(request), request.path_params["rid"]
    if request.method == "DELETE":
        return await delete_response(store, rid)
    return await get_response(store, rid)


async def get_response(store: ResponseStore, rid: str) -> Response:
    """The stored response's JSON as it is held."""
    stored = await store.get(rid)
    if stored is None:
        raise _not_found(rid)
    return Response(stored.response, media_type="application/json")


def _input_item(rid: str, index: int, message: dict[str, Any]) -> list[dict[str, Any]]:
    """A stored chat message as the Responses input items it was given as."""
    role, text = message.get("role"), message.get("content") or ""
    item_id = f"msg_{rid.removeprefix('resp_')}_{index}"
    if role == "tool":
        call = message.get("tool_call_id", "")
        return [{"id": item_id, "type": "function_call_output", "call_id": call, "output": text}]
    kind = "output_text" if role == "assistant" else "input_text"
    items: list[dict[str, Any]] = []
    if text or role != "assistant":
        content = [{"type": kind, "text": text}]
        items.append(
            {
                "id": item_id,
                "type": "message",
                "role": role,
                "content": content,
                "status": "completed",
            }
        )
    for j, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function", {})
        items.append(
            {
                "id": f"fc_{rid.removeprefix('resp_')}_{index}_{j}",
                "type": "function_call",
                "call_id": call.get("id", ""),
                "name": function.get("name", ""),
                "arguments": function.get("arguments", ""),
                "status": "completed",
            }
        )
    return items


async def input_items(request: Request) -> JSONResponse:
    """GET /v1/responses/{id}/input_items: what the model was given for that response (its
    conversation, earlier messages included, without its reply and instructions), as OpenAI
    lists them: `order` desc (the default) or asc, `limit` 1-100 (default 20), `after` an id."""
    rid, query = request.path_params["rid"], request.query_params
    stored = await response_store(request).get(rid)
    if stored is None:
        raise _not_found(rid)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "'order' must be 'asc' or 'desc'", param="order")
    limit_text = query.get("limit", "20")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
        raise ApiError(400, "'limit' must be an integer from 1 to 100", param="limit")
    messages = stored.messages()[:-1]  # (the last is the response's own reply)
    items = [item for i, m in enumerate(messages) for item in _input_item(rid, i, m)]
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError(400, f"'after' names no input item of {rid[:100]!r}", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[: int(limit_text)]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page),
        }
    )


async def delete_response(store: ResponseStore, rid: str) -> JSONResponse:
    """Deletes a stored response and, with sessions on, its file and its KV's session file."""
    if not await store.delete(rid):
        raise _not_found(rid)
    return JSONResponse({"id": rid, "object": "response", "deleted": True})


# ---- the route ----------------------------------------------------------------------------------


async def create_response(request: Request) -> Response:
    """POST /v1/responses: validate and admit as chat would, then stream the Responses events
    or answer the whole response; store it unless `store` is false. With sessions on, a
    stored response's KV is saved in the sessions directory as a session named by its id,
    and a follow-up continues from its previous response's."""
    rid = new_response_id()
    store = response_store(request)
    # (logged under the response's id, which the stored response and its KV's session carry)
    async with front_door(request, rid, label=rid, logger=log) as arrival:
        sessions = arrival.context.sessions
        try:
            req = parse_responses(arrival.body)
        except InvalidRequestError as exc:
            raise api_error(exc) from None
        history = await _history(store, req.previous_response_id)
        try:
            chat = req.chat(stored_messages(history))
        except InvalidRequestError as exc:
            raise api_error(exc) from None
        keep, previous = req.stored, req.previous_response_id
        admitted = await admit(
            request.receive,
            arrival.model,
            chat,
            lambda engine: _session(sessions, engine, rid, previous, keep),
            label=rid,
        )
        if admitted is None:
            return Response(status_code=499)  # it left while its constraint compiled
        ((stream_,),) = admitted.groups
        (prompt_ids,) = admitted.prompts
    model, engine, metrics = arrival.model, arrival.engine, arrival.context.metrics
    log.info("request %s: model %s, %d prompt tokens (responses)", rid, model.name, len(prompt_ids))
    observe = metrics.admit(model.name, arrival.started, stream_)
    copy = Copy(stream_, Reply("chat", model.name), observe)
    builder = Builder(rid, model.name, arrival.body)

    async def stored(response: ResponseObject) -> None:
        if keep and response.status != "failed":
            conversation = [*history, *req.conversation(), builder.reply_message()]
            await store.put(rid, response.model_dump(), conversation)

    if req.streamed:
        return _Streamed(copy, builder, engine, stored)  # type: ignore[return-value]
    events = await gather_one(request.receive, copy, engine)
    if events is None:
        return Response(status_code=499)  # nobody is listening
    last = events[-1] if events else None
    for event in events:
        builder.feed(event)
    response, _ = builder.finish(last, stream_.cached_tokens, None)
    await stored(response)
    return JSONResponse(response.model_dump())


async def _session(
    sessions: SessionStore | None, engine: ServingEngine, rid: str, previous: str | None, keep: bool
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


async def _history(store: ResponseStore, previous: str | None) -> list[dict[str, Any]]:
    """The stored conversation a request continues (none: []); 404 for an unknown id."""
    if previous is None:
        return []
    found = await store.get(previous)
    if found is None:
        raise _not_found(previous, "previous_response_id")
    return found.messages()


class _Streamed:
    """The Responses stream: `event: TYPE` / `data: JSON` pairs, from response.created to
    response.completed (or .incomplete, .failed). A request that ends before any output (it
    never ran) gets a real HTTP error instead; a client that leaves cancels it."""

    def __init__(
        self,
        copy: Copy,
        builder: Builder,
        engine: ServingEngine,
        stored: Callable[[ResponseObject], Awaitable[None]],
    ) -> None:
        self.copy, self.builder, self.engine, self.stored = copy, builder, engine, stored

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await stream(receive, [self.copy], lambda events: self._write(events, scope, receive, send))

    async def _write(self, events: Events, scope: Scope, receive: Receive, send: Send) -> None:
        b = self.builder
        _, first = await anext(events)
        if await refused_before_output(first, self.engine, scope, receive, send):
            return
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        for out in b.opened():
            await _send(send, out)
        last = None
        async for event in until_finished(events, first):
            last = event
            for out in b.feed(event):
                await _send(send, out)
        error = failure(last, self.engine)
        response, closing = b.finish(last, self.copy.stream.cached_tokens, error)
        for out in closing:
            await _send(send, out)
        await self.stored(response)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send(send: Send, event: Event) -> None:
    body = f"event: {event.type}\ndata: {one_line(event.model_dump())}\n\n".encode()
    await send({"type": "http.response.body", "body": body, "more_body": True})
