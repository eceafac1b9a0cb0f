"""What a router in front of several replicas asks of one: is the process alive (`/live`,
beside `/health`'s readiness), how loaded is it (`/get_load`, which vllm-router's
power-of-two and cache-aware policies poll), and drain it (`POST /drain`, as SIGTERM does)."""

from __future__ import annotations

import ipaddress

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from neuronpy.server.errors import ApiError
from neuronpy.server.models import ServerState


async def live(request: Request) -> Response:
    """200 while the process answers HTTP, loading and draining included: a liveness probe
    restarts a replica that stopped answering, never one that is busy getting ready or
    finishing its requests (that is /health's business: readiness)."""
    return JSONResponse({"status": "alive"})


def load(state: ServerState) -> dict[str, object]:
    """Requests running and waiting, per model and in all: `load` is what vllm-router reads
    (the requests this replica holds; the router sends the next one to the least loaded)."""
    models: dict[str, dict[str, int]] = {}
    for model in state.models.values():
        running = waiting = 0
        if model.engine is not None:
            stats = model.engine.stats()
            running, waiting = stats.running, stats.queued
        models[model.name] = {"running": running, "waiting": waiting}
    total = sum(m["running"] + m["waiting"] for m in models.values())
    return {"load": total, "status": state.status, "models": models}


async def get_load(state: ServerState) -> Response:
    return JSONResponse(load(state))


def _loopback(request: Request) -> bool:
    host = request.client.host if request.client is not None else None
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def drain(request: Request, state: ServerState, api_key: str | None) -> Response:
    """Begin a graceful drain, as SIGTERM does: /health turns 503 at once (the router stops
    sending here), new requests get 503 (a router retries them on another replica), those
    admitted get `drain_timeout` seconds to finish, then the server stops (a supervisor starts
    it again). Needs the API key where the server has one (the middleware checks it), and
    without one is taken only from loopback. Calling it again changes nothing: a drain that
    is under way is not cut short over HTTP."""
    if not api_key and not _loopback(request):
        raise ApiError(
            403,
            "POST /drain is taken only from loopback when the server has no API key "
            "(start it with --api-key to drain it from elsewhere)",
            code="forbidden",
        )
    if not state.begin_drain():
        raise ApiError(503, "the server is not running: there is nothing to drain")
    return JSONResponse({**load(state), "status": "draining"}, status_code=202)
