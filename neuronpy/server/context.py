"""What the routes share: the served models, the metrics, the body limits, the sessions and the
API key, built once by `create_app` and kept on the app (`app.state.context`), so that every
route is a plain module-level function that reads what it needs from its request."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from neuronpy.engine.sessions import SessionStore
from neuronpy.server.metrics import ServerMetrics
from neuronpy.server.models import ServerState
from neuronpy.server.requests import BodyLimits


@dataclass(frozen=True)
class RouteContext:
    """The app's shared state, as the routes read it."""

    state: ServerState  # the served models
    metrics: ServerMetrics  # request outcomes and latencies (/metrics)
    limits: BodyLimits  # what a request body may take: bytes and seconds
    sessions: SessionStore | None = None  # the sessions directory; None: sessions are off
    # with sessions on, the header that names a chat or completions request's session
    session_header: str | None = None
    api_key: str | None = None  # the key every route but /health needs; None: no key


def route_context(request: Request) -> RouteContext:
    """The context of the app that `request` came to."""
    context = request.app.state.context
    assert isinstance(context, RouteContext)
    return context
