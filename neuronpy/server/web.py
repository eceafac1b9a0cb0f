"""The web page: a chat (GET /) and a live view of the batch (GET /batch), static files shipped
in the package (neuronpy/server/web/), its icon (GET /favicon.ico), and /v1/batch, the JSON the
batch view polls. (The chat's replies are rendered as markdown by POST /render: markdown.py.)"""

from __future__ import annotations

import functools
import math
import struct
import zlib
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
    "favicon.svg": "image/svg+xml",
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


async def favicon(request: Request) -> Response:
    """/favicon.ico, which browsers and bookmarks ask for whatever the page links: web/favicon.svg
    drawn at 32 px, a PNG in an ICO."""
    return Response(favicon_ico(), headers={**HEADERS, "Content-Type": "image/x-icon"})


# web/favicon.svg, as shapes in its 32 x 32 square: three rows of different lengths (the batch's
# requests), each with the token the step writes for all of them (the dots, in a column)
ICON_BLUE = (0x2F, 0x6F, 0xDF)
ICON_BARS = ((8.0, 20.0, 10.0), (8.0, 15.0, 16.0), (8.0, 18.0, 22.0))  # x from, x to, y
ICON_DOTS = ((24.5, 10.0), (24.5, 16.0), (24.5, 22.0))


def _icon_cover(x: float, y: float) -> tuple[bool, bool]:
    """Whether (x, y) is on the icon's square (corners of radius 7), and on its white marks."""
    r = 7.0
    cx, cy = min(max(x, r), 32 - r), min(max(y, r), 32 - r)
    square = 0 <= x <= 32 and 0 <= y <= 32 and math.hypot(x - cx, y - cy) <= r
    mark = any(math.hypot(x - min(max(x, a), b), y - yy) <= 1.6 for a, b, yy in ICON_BARS)
    mark = mark or any(math.hypot(x - dx, y - dy) <= 1.9 for dx, dy in ICON_DOTS)
    return square, square and mark


@functools.cache
def favicon_png(size: int = 32, samples: int = 4) -> bytes:
    """The icon as a `size`-pixel RGBA PNG, each pixel the mean of samples x samples points."""
    rows = []
    for py in range(size):
        row = bytearray([0])  # (each row's filter: none)
        for px in range(size):
            covered = white = 0
            for sy in range(samples):
                for sx in range(samples):
                    x = (px + (sx + 0.5) / samples) * 32 / size
                    y = (py + (sy + 0.5) / samples) * 32 / size
                    on, mark = _icon_cover(x, y)
                    covered += on
                    white += mark
            if not covered:
                row += bytes(4)
                continue
            share = white / covered
            rgb = (round(c + (255 - c) * share) for c in ICON_BLUE)
            row += bytes([*rgb, round(255 * covered / samples**2)])
        rows.append(bytes(row))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", size, size, 8, 6, 0, 0, 0)  # 8-bit RGBA
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"".join(rows), 9))
        + chunk(b"IEND", b"")
    )


@functools.cache
def favicon_ico() -> bytes:
    """An ICO holding the 32-pixel PNG (an ICO may hold PNGs; every browser reads them)."""
    png = favicon_png()
    entry = struct.pack("<BBBBHHII", 32, 32, 0, 0, 1, 32, len(png), 6 + 16)
    return struct.pack("<HHH", 0, 1, 1) + entry + png


async def batch_state(state: ServerState) -> dict[str, Any]:
    """Each model's live batch: its figures and its admitted requests, row by row."""
    models: dict[str, Any] = {}
    for model in state.models.values():
        engine = model.engine
        entry: dict[str, Any] = {"status": model.state}
        if engine is not None:
            # the rows first: from an engine in its own process they come with its newest
            # counters (it sends its status before it answers), so both are of one moment
            rows = await _rows(engine)
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
                "requests": rows,
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
