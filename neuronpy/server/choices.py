"""Server-sent events for a request with n > 1 completions: the copies' events interleaved in
one stream, each rendered with its choice's index."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import anyio
from anyio.abc import ObjectReceiveStream
from starlette.types import Receive, Scope, Send

from neuronpy.engine.engine import RequestStream
from neuronpy.engine.types import GenerationEvent
from neuronpy.server.protocol import ApiError
from neuronpy.server.sse import cancel_on_disconnect, open_stream, send_event

Render = Callable[[GenerationEvent], list[dict[str, Any]]]
Refuse = Callable[[GenerationEvent | None], ApiError | None]


class ChoicesStreamResponse:
    """Like EventStreamResponse, for several streams of one request. Nothing is sent before
    the first event of any copy: if that event ends its copy without text (it never ran, or
    failed at once), the answer is `refuse[i](event)`'s HTTP error and every copy is cancelled.
    Otherwise the 200 goes out with `opening`, each event goes through its copy's `render`, and
    once every copy has ended, `closing()`'s chunks and `[DONE]`. A client that leaves cancels
    every copy."""

    def __init__(
        self,
        streams: Sequence[RequestStream],
        opening: list[dict[str, Any]],
        render: Sequence[Render],
        refuse: Sequence[Refuse],
        closing: Callable[[], list[dict[str, Any]]],
    ) -> None:
        self.streams = list(streams)
        self.opening = opening
        self.render = list(render)
        self.refuse = list(refuse)
        self.closing = closing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            outbox, inbox = anyio.create_memory_object_stream[tuple[int, GenerationEvent | None]](
                math.inf
            )
            async with contextlib.AsyncExitStack() as stack, anyio.create_task_group() as tg:
                for i, stream in enumerate(self.streams):
                    # leaving cancels every copy that has not finished
                    await stack.enter_async_context(stream)

                    async def forward(i: int = i, stream: RequestStream = stream) -> None:
                        async for event in stream:
                            outbox.send_nowait((i, event))
                        outbox.send_nowait((i, None))  # this copy has ended

                    tg.start_soon(forward)
                try:
                    await self._write(inbox, scope, receive, send)
                finally:
                    tg.cancel_scope.cancel()

        await cancel_on_disconnect(receive, pump)

    async def _write(
        self,
        inbox: ObjectReceiveStream[tuple[int, GenerationEvent | None]],
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        index, first = await inbox.receive()
        error = self.refuse[index](first)
        try:
            if not await open_stream(scope, receive, send, error, self.opening):
                return
            ended = 0
            event = first
            while True:
                if event is None:
                    ended += 1
                    if ended == len(self.streams):
                        break
                else:
                    for obj in self.render[index](event):
                        await send_event(send, obj)
                index, event = await inbox.receive()
            for obj in self.closing():
                await send_event(send, obj)
            await send_event(send, "[DONE]")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while we wrote
            return
