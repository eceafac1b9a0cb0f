"""A request's n copies: entered together, their events merged, cancelled with their client."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from starlette.types import Message, Receive, Scope, Send

from neuronpy.engine.remote import ServingEngine
from neuronpy.engine.stream import RequestStream
from neuronpy.engine.types import GenerationEvent
from neuronpy.server.errors import failure
from neuronpy.server.responses import Reply, usage


@dataclass
class Copy:
    """One of a request's n completions (n == 1: the only one): its engine stream, the reply
    that renders its choice, and what counts its events in the metrics."""

    stream: RequestStream
    reply: Reply
    observe: Callable[[GenerationEvent], None]
    last: GenerationEvent | None = None  # the latest of its events taken so far
    counts_prompt: bool = True  # the first copy of its prompt: the usage counts the prompt


def prompt_totals(copies: Sequence[Copy]) -> tuple[int, int]:
    """The usage's prompt tokens and cached tokens: each prompt once, however many copies."""
    firsts = [c.stream for c in copies if c.counts_prompt]
    return sum(s.prompt_tokens for s in firsts), sum(s.cached_tokens for s in firsts)


def usage_of(copies: Sequence[Copy]) -> dict[str, Any]:
    """OpenAI's usage of ended copies: each prompt once, every copy's tokens and drafts."""
    prompt, cached = prompt_totals(copies)
    completion = sum(c.last.completion_tokens for c in copies if c.last is not None)
    drafts = [c.stream.drafts for c in copies]
    totals = (sum(d for d, _ in drafts), sum(a for _, a in drafts))
    return usage(prompt, completion, cached, totals)


class Events:
    """The copies' events in the order they come, as (copy, event), and (copy, None) once a copy
    has ended; it stops when every copy has. Each event is counted when it is taken, so an
    event that is never answered (its client left) is not."""

    def __init__(
        self,
        copies: Sequence[Copy],
        inbox: ObjectReceiveStream[tuple[int, GenerationEvent | None]],
    ) -> None:
        self.copies = copies
        self._inbox = inbox
        self._ended = 0

    def __aiter__(self) -> Events:
        return self

    async def __anext__(self) -> tuple[Copy, GenerationEvent | None]:
        if self._ended == len(self.copies):
            raise StopAsyncIteration
        index, event = await self._inbox.receive()
        copy = self.copies[index]
        if event is None:
            self._ended += 1
        else:
            copy.observe(event)
            copy.last = event
        return copy, event


@contextlib.asynccontextmanager
async def merged(copies: Sequence[Copy]) -> AsyncIterator[Events]:
    """The copies' events, merged. Leaving cancels every copy that has not finished."""
    outbox, inbox = anyio.create_memory_object_stream[tuple[int, GenerationEvent | None]](
        math.inf  # the engine's streams are unbounded already: this holds no more than they do
    )
    async with contextlib.AsyncExitStack() as stack, anyio.create_task_group() as tg:
        for index, copy in enumerate(copies):
            await stack.enter_async_context(copy.stream)  # its exit cancels the request
            tg.start_soon(_forward, index, copy.stream, outbox)
        try:
            yield Events(copies, inbox)
        finally:
            tg.cancel_scope.cancel()


async def _forward(
    index: int,
    stream: RequestStream,
    outbox: ObjectSendStream[tuple[int, GenerationEvent | None]],
) -> None:
    async for event in stream:
        outbox.send_nowait((index, event))
    outbox.send_nowait((index, None))  # this copy has ended


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


async def gather(receive: Receive, copies: Sequence[Copy]) -> list[list[GenerationEvent]] | None:
    """Every copy's events, by its place in `copies`, once all have ended; None when the
    client disconnected first (every copy is then cancelled). The request body must have been
    read already (see cancel_on_disconnect)."""
    events: list[list[GenerationEvent]] = [[] for _ in copies]
    place = {id(copy): i for i, copy in enumerate(copies)}

    async def collect() -> None:
        async with merged(copies) as merged_events:
            async for copy, event in merged_events:
                if event is not None:
                    events[place[id(copy)]].append(event)

    return events if await cancel_on_disconnect(receive, collect) else None


async def stream(
    receive: Receive, copies: Sequence[Copy], write: Callable[[Events], Awaitable[None]]
) -> None:
    """`write` the copies' merged events to a streamed response until they end or the client
    disconnects (which cancels every copy), a client gone mid-write included."""

    async def pump() -> None:
        async with merged(copies) as events:
            try:
                await write(events)
            except OSError:  # the client went away while we wrote (ASGI spec 2.4)
                return

    await cancel_on_disconnect(receive, pump)


# ---- one copy, answered in another API's shape (Responses, Anthropic, Ollama) -------------------


async def gather_one(
    receive: Receive, copy: Copy, engine: ServingEngine
) -> list[GenerationEvent] | None:
    """One copy's events, once it has ended: None when the client left first; the ApiError of
    its failure raised when it did not finish (stop or length)."""
    gathered = await gather(receive, [copy])
    if gathered is None:
        return None
    (events,) = gathered
    error = failure(events[-1] if events else None, engine)
    if error is not None:
        raise error
    return events


async def refused_before_output(
    first: GenerationEvent | None, engine: ServingEngine, scope: Scope, receive: Receive, send: Send
) -> bool:
    """Whether a stream's request ended before any output (it never ran: a full queue, a
    shutdown); its HTTP error is then answered, in the shape of the route's API, instead of
    a stream."""
    if first is None or (first.finished and not first.text and not first.tool_calls):
        error = failure(first, engine)
        if error is not None:
            await error.response(scope["path"])(scope, receive, send)
            return True
    return False


async def until_finished(
    events: Events, first: GenerationEvent | None
) -> AsyncIterator[GenerationEvent]:
    """`first`, then the copy's next events, up to the one that finishes it."""
    event = first
    while True:
        if event is not None:
            yield event
            if event.finished:
                return
        try:
            _, event = await anext(events)
        except StopAsyncIteration:
            return
