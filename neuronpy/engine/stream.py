"""One request's event stream, as the engine hands it to its caller."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

import anyio
from anyio.abc import ObjectReceiveStream

from neuronpy.engine.request import Request
from neuronpy.engine.types import Completion, GenerationEvent, SamplingParams


class RequestStream:
    """One request's events: an async iterator and an async context manager (exit cancels)."""

    def __init__(
        self,
        request: Request,
        events: ObjectReceiveStream[GenerationEvent],
        cancel: Callable[[Request], None],
    ) -> None:
        self._request = request
        self._on_cancel = cancel
        self._events = events
        self._done = False
        self.prompt_tokens = len(request.prompt_ids)

    @property
    def id(self) -> int:
        return self._request.id

    @property
    def label(self) -> str | None:
        """What its client and the server's log call it: its request id (given at submit)."""
        return self._request.label

    @property
    def index(self) -> int:
        """Which of its request's n completions this is (0 when n is 1)."""
        return self._request.index

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens restored from the prefix cache rather than prefilled (known once the
        first event has arrived; for n > 1, the prefill all the copies share)."""
        return self._request.cached_tokens

    @property
    def drafts(self) -> tuple[int, int]:
        """Of the drafted tokens its verify steps fed (speculative decoding), how many there
        were and how many stood: (0, 0) when it did not speculate. Final once it has ended."""
        return self._request.drafts

    @property
    def queue_seconds(self) -> float | None:
        """How long it waited in the queue for a row (None: it has not left the queue)."""
        return self._request.queue_seconds

    def cancel(self) -> None:
        """Idempotent. A running row leaves within one decode step; a queued one never runs."""
        if not self._done:
            self._done = True
            self._on_cancel(self._request)
            self._events.close()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> GenerationEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            event = await self._events.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._done = True
            raise StopAsyncIteration from None
        if event.finished:
            self._done = True
            self._events.close()
        return event

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.cancel()


class Generates:
    """`generate` and `complete` over an engine's `prepare` and `submit` (the Engine, or its
    client in another process)."""

    async def prepare(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        raise NotImplementedError

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> RequestStream:
        raise NotImplementedError

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[GenerationEvent]:
        """Submits and yields the request's events; leaving the loop early cancels it."""
        await self.prepare(prompt_ids, params)
        async with self.submit(prompt_ids, params) as stream:
            async for event in stream:
                yield event

    async def complete(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        """Runs a request to the end and gathers its text, tokens and finish reason."""
        out = Completion()
        async for event in self.generate(prompt_ids, params):
            out.text += event.text
            out.token_ids.extend(event.token_ids)
            out.prompt_tokens = event.prompt_tokens
            out.completion_tokens = event.completion_tokens
            out.finish_reason = event.finish_reason
            out.reasoning += event.reasoning
            out.tool_calls.extend(event.tool_calls)
            out.logprobs.extend(event.logprobs)
        return out
