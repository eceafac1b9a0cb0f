"""The server-sent event stream of a request, for any n: its choices' chunks, then [DONE]."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.types import Receive, Scope, Send

from neuronpy.engine.remote import ServingEngine
from neuronpy.engine.types import GenerationEvent
from neuronpy.jsontext import one_line
from neuronpy.server.copies import Copy, Events, stream, usage_of
from neuronpy.server.errors import ApiError, failure

HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies must not buffer the stream
]


class EventStreamResponse:
    """Streams a request's copies as `data:` lines: each copy's events, as they come, rendered
    as its choice's chunks; then, when the request asked for it and every choice finished, one
    usage chunk for them all; then `data: [DONE]`.

    Nothing is sent before the first event of any copy (or its end): a request whose first event
    ends it without any text (it timed out in the queue, the server is shutting down, the model
    failed) gets a real HTTP error instead of a 200 and an error event, and every copy is
    cancelled. A client that leaves cancels every copy (its slot is freed within a decode
    step), whether it is running or still queued."""

    def __init__(self, copies: Sequence[Copy], engine: ServingEngine) -> None:
        self.copies = copies
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await stream(receive, self.copies, lambda events: self._write(events, scope, receive, send))

    async def _write(self, events: Events, scope: Scope, receive: Receive, send: Send) -> None:
        copy, first = await anext(events)
        error = self._refusal(first)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        if self.copies[0].reply.kind == "chat":  # the opening chunks: each choice's role
            for opening in self.copies:
                await _send_event(send, opening.reply.opening_chunk())
        await self._render(send, copy, first)
        async for copy, event in events:
            await self._render(send, copy, event)
        for chunk in self._closing():
            await _send_event(send, chunk)
        await _send_event(send, "[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _refusal(self, first: GenerationEvent | None) -> ApiError | None:
        """The HTTP error to answer instead of a 200, when the first event already ends its
        copy without any text (it never ran, or failed at once)."""
        if first is not None and (first.text or not first.finished):
            return None
        return failure(first, self.engine)

    async def _render(self, send: Send, copy: Copy, event: GenerationEvent | None) -> None:
        if event is None:  # the copy has ended
            return
        error = failure(event, self.engine) if event.finished else None
        for chunk in copy.reply.stream_chunks(event, error):
            await _send_event(send, chunk)

    def _closing(self) -> list[dict[str, Any]]:
        """The usage chunk, counting the prompt once and every choice's tokens; none when the
        request did not ask for it or a choice did not finish (its error was the last word)."""
        first = self.copies[0]
        if not first.reply.include_usage:
            return []
        if any(c.last is None or failure(c.last, self.engine) is not None for c in self.copies):
            return []
        return [first.reply.usage_chunk(usage_of(self.copies))]


async def _send_event(send: Send, obj: dict[str, Any] | str) -> None:
    """One `data:` event of an open stream."""
    data = obj if isinstance(obj, str) else one_line(obj)
    body = f"data: {data}\n\n".encode()
    await send({"type": "http.response.body", "body": body, "more_body": True})
