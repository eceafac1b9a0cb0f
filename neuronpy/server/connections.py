"""What clients can hold: a deadline for each request's head, and the requests handled at once."""

# A slowloris client opens connections and sends their request heads byte by byte (or never),
# or sends a body that way. uvicorn bounds neither: its keep-alive timer runs only between
# requests and stops at the first byte of the next, and it has no deadline for a head. So the
# head's deadline is here, in uvicorn's h11 protocol; the body's is read_json's (a 408); and
# the requests being handled (reading a body, waiting, streaming) are counted by an ASGI
# middleware that leaves /health and /metrics open, so that an operator's probes still get
# through while clients are refused with 503s. (uvicorn's own limit_concurrency counts idle
# connections too, and answers /health with a plain-text 503.)

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from neuronpy.defaults import DEFAULT_HEADER_TIMEOUT
from neuronpy.server.errors import unavailable

log = logging.getLogger(__name__)

# Answered whatever the load: cheap, and what tells an operator (or a load balancer) how the
# server is doing.
UNLIMITED_PATHS = frozenset({"/health", "/live", "/get_load", "/metrics"})


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request head has not arrived
    `header_timeout` seconds after it opened, or after its previous response ended (a slow
    client's unread body after that response included). 0: no deadline. A subclass per
    timeout (`with_header_timeout`), as uvicorn builds the protocol itself."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None

    @classmethod
    def with_header_timeout(cls, seconds: float) -> type[HeadTimeoutProtocol]:
        return type(cls.__name__, (cls,), {"header_timeout": float(seconds)})

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._wait_for_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # (may start a pipelined request already)
        if not self.transport.is_closing():
            self._wait_for_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def _wait_for_head(self) -> None:
        self._cancel_deadline()
        if self.header_timeout > 0:
            self._head_deadline = self.loop.call_later(self.header_timeout, self._head_late)

    def _cancel_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_late(self) -> None:
        self._head_deadline = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # its head arrived: the request is being served (its body has its own limit)
        if not self.transport.is_closing():
            log.debug("closing a connection: no request head within %gs", self.header_timeout)
            self.transport.close()


class ConcurrencyLimit:
    """ASGI middleware: at most `limit` HTTP requests handled at once (from their head to the
    end of their response, a stream's included), those for `unlimited` paths aside; any more
    get 503 with OpenAI's error body and Retry-After at once (and `on_refused` is called)."""

    def __init__(
        self,
        app: ASGIApp,
        limit: int,
        unlimited: Collection[str] = UNLIMITED_PATHS,
        on_refused: Callable[[], None] | None = None,
    ) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.app = app
        self.limit = limit
        self.unlimited = frozenset(unlimited)
        self.on_refused = on_refused
        self.active = 0  # (one event loop: no lock)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.unlimited:
            await self.app(scope, receive, send)
            return
        if self.active >= self.limit:
            message = (
                f"the server is handling {self.limit} requests, its limit (limit_concurrency); "
                "retry shortly"
            )
            if self.on_refused is not None:
                self.on_refused()
            refusal = unavailable(message, retry_after=1)
            await refusal.response(scope["path"])(scope, receive, send)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1
