"""The web page: a chat (GET /) and a live view of the batch (GET /batch), static files shipped
in the package (neuronpy/server/web/), and /v1/batch, the JSON the batch view polls. (The
chat's replies are rendered as markdown by POST /render: markdown.py.)"""

from __future__ import annotations

from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from neuronpy.engine.remote import ServingEngine
from neuronpy.errors import EngineUnhealthyError
from neuronpy.server.errors import ApiError
from neuronpy.server.markdown import highlight_css
from neuronpy.server.models import ServerState

# name -> content type: nothing else is served
FILES = {
    "index.html": "text/html; charset=utf-8",
    "batch.html": "text/html; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "common.js": "text/javascript; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "history.js": "text/javascript; charset=utf-8",
    "batch.js": "text/javascript; charset=utf-8",
}
# The pages run no inline script and fetch nothing from elsewhere; this says so to the browser
# (an operator's own CSP, set by a proxy, may be stricter).
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _file(name: str) -> Response:
    if name == "highlight.css":  # the code highlighter's colours, made by it
        return Response(highlight_css(), headers={**HEADERS, "Content-Type": FILES["style.css"]})
    if name not in FILES:
        raise ApiError(404, "no such file", code="not_found")
    body = resources.files("neuronpy.server").joinpath("web", name).read_bytes()
    return Response(body, headers={**HEADERS, "Content-Type": FILES[name]})


async def page(request: Request) -> Response:
    """/ (the chat) and /batch."""
    return _file("batch.html" if request.url.path == "/batch" else "index.html")


async def static(request: Request) -> Response:
    return _file(request.path_params["name"])


async def batch_state(state: ServerState) -> dict[str, Any]:
    """Each model's live batch: its figures and its admitted requests, row by row."""
    models: dict[str, Any] = {}
    for model in state.models.values():
        engine = model.engine
        entry: dict[str, Any] = {"status": model.state}
        if engine is not None:
            s = engine.stats()
            entry |= {
                "live_batch_size": s.live_batch_size,
                "max_in_flight": engine.max_running,
                "running": s.running,
                "queued": s.queued,
                "decode_steps": s.decode_steps,
                "kv_tokens": s.kv_tokens,
                "kv_capacity": engine.kv_capacity_tokens,
                "prefix_cache_hits": s.prefix_cache_hits,
                "prefix_cache_misses": s.prefix_cache_misses,
                "requests": await _rows(engine),
            }
        models[model.name] = entry
    return {"models": models}


async def _rows(engine: ServingEngine) -> list[dict[str, object]]:
    """The engine's admitted requests; none where it has failed (its process gone)."""
    try:
        return await engine.batch_rows()
    except EngineUnhealthyError:
        return []


async def batch(state: ServerState) -> JSONResponse:
    return JSONResponse(await batch_state(state))
