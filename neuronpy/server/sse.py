"""Server-sent events for one request, and cancelling work when its client disconnects."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import JSONResponse
from starlette.types import Message, Receive, Scope, Send

from neuronpy.engine.engine import RequestStream
from neuronpy.engine.types import GenerationEvent
from neuronpy.server.protocol import ApiError

HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies must not buffer the stream
]


async def cancel_on_disconnect(receive: Receive, work: Callable[[], Awaitable[None]]) -> bool:
    """Run `work` until it returns (True) or the client disconnects (False: it is cancelled).

    The request body must have been read already: what `receive` yields next is the disconnect.
    """
    finished = False
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            message: Message = await receive()
            while message["type"] != "http.disconnect":
                message = await receive()
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        await work()
        finished = True
        tg.cancel_scope.cancel()
    return finished


def sse_event(obj: dict[str, Any] | str) -> bytes:
    data = (
        obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {data}\n\n".encode()


class EventStreamResponse:
    """Streams a request's events as `data:` lines, then `data: [DONE]`.

    Nothing is sent before the request's first event (or its end): a request that ends before
    producing anything (it timed out in the queue, the server is shutting down, the model
    failed) gets a real HTTP error, `refuse(first)`, instead of a 200 and an error event.
    Otherwise the 200 goes out with the opening chunks, and `render` turns each event into
    chunks. A client that leaves cancels the request (its slot is freed within a decode step),
    whether it is running or still queued."""

    def __init__(
        self,
        stream: RequestStream,
        opening: list[dict[str, Any]],
        render: Callable[[GenerationEvent], list[dict[str, Any]]],
        refuse: Callable[[GenerationEvent | None], ApiError | None] = lambda first: None,
    ) -> None:
        self.stream = stream
        self.opening = opening
        self.render = render
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            async with self.stream:  # leaving it cancels the request unless it finished
                first = await anext(self.stream, None)
                error = self.refuse(first)
                try:
                    if not await open_stream(scope, receive, send, error, self.opening):
                        return
                    if first is not None:
                        for obj in self.render(first):
                            await send_event(send, obj)
                    async for event in self.stream:
                        for obj in self.render(event):
                            await send_event(send, obj)
                    await send_event(send, "[DONE]")
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:  # the client went away while we wrote (ASGI spec 2.4)
                    return

        await cancel_on_disconnect(receive, pump)


async def open_stream(
    scope: Scope,
    receive: Receive,
    send: Send,
    error: ApiError | None,
    opening: list[dict[str, Any]],
) -> bool:
    """Answers `error` as a plain HTTP error (False), or starts the event stream: the 200, then
    the opening chunks (True)."""
    if error is not None:
        reply = JSONResponse(error.body(), error.status, headers=error.headers)
        await reply(scope, receive, send)
        return False
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    for obj in opening:
        await send_event(send, obj)
    return True


async def send_event(send: Send, obj: dict[str, Any] | str) -> None:
    """One `data:` event of an open stream."""
    await send({"type": "http.response.body", "body": sse_event(obj), "more_body": True})
