"""Request ids: every response carries `x-request-id`, the client's own when it sent a usable
one, else the id the server gave the request (a completion's id, `chatcmpl-...`), so that a
client's report and the server's log line for that request can be matched. The same id goes
out as `request-id` too, the header Anthropic's SDKs read (`response._request_id`)."""

from __future__ import annotations

import re
import uuid
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
ANTHROPIC_HEADER = "request-id"
_USABLE = re.compile(r"^[\x21-\x7e]{1,128}$")  # printable ASCII, no spaces, at most 128


class RequestIdMiddleware:
    """Reads the request's `x-request-id` into `request.state.request_id` (None when absent or
    unusable: a route may then name the request itself, see `name_request`), and writes the id
    on the response, a fresh `req-...` one if nobody named it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        sent = dict(scope.get("headers") or []).get(HEADER.encode(), b"").decode("latin-1")
        state["request_id"] = sent if _USABLE.match(sent) else None

        async def with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                rid = state.get("request_id") or f"req-{uuid.uuid4().hex}"
                state["request_id"] = rid
                ours = (HEADER.encode(), ANTHROPIC_HEADER.encode())
                headers = [(k, v) for k, v in message.get("headers", []) if k not in ours]
                headers += [(name, rid.encode()) for name in ours]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_id)


def name_request(request: Request, own_id: str) -> str:
    """The request's id: the client's, or else `own_id`, which the response then carries."""
    state: dict[str, Any] = request.scope.setdefault("state", {})
    if not state.get("request_id"):
        state["request_id"] = own_id
    return state["request_id"]
