"""A request's JSON body, read within its size limit and its time, and validated into its typed
request (protocol.py)."""

from __future__ import annotations

from dataclasses import dataclass

import anyio
from starlette.requests import Request

from neuronpy.defaults import DEFAULT_BODY_TIMEOUT
from neuronpy.errors import InvalidRequestError
from neuronpy.server.errors import ApiError, api_error
from neuronpy.server.protocol import Kind, SamplingRequest, parse
from neuronpy.server.schema import json_type
from neuronpy.server.structure import decode_json

__all__ = ["BodyLimits", "Kind", "parse_request", "read_json", "requested_model"]

MAX_BODY_BYTES = 4 << 20
INLINE_DECODE_BYTES = 16 << 10  # decoded on the event loop (a fifth of a millisecond)


@dataclass(frozen=True)
class BodyLimits:
    """What a request body may take: bytes, and seconds for all of them to arrive (0: no
    deadline), so that a client sending it byte by byte cannot hold its request forever."""

    max_bytes: int = MAX_BODY_BYTES
    timeout: float = DEFAULT_BODY_TIMEOUT


async def read_json(request: Request, limits: BodyLimits) -> object:
    """The body as JSON, structurally sound (structure.py: nesting depth, valid Unicode),
    whatever its Content-Type says (none, text/plain, or the form type `curl -d` sends: as
    Ollama's and llama.cpp's servers read it), except from a browser: a request with an Origin
    header must say application/json, so that no page elsewhere can send one without CORS's
    preflight (a 415). 413 past `limits.max_bytes` (before reading them when Content-Length
    says so), 408 unless it all arrives within `limits.timeout` seconds, 400 if it is not JSON
    or does not check. A client that hangs up meanwhile raises starlette's ClientDisconnect
    (errors.py answers it quietly)."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json" and "origin" in request.headers:
        raise ApiError(
            415, "a browser's request body must be JSON (Content-Type: application/json)"
        )
    limit = limits.max_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    with anyio.move_on_after(limits.timeout or None) as deadline:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    if deadline.cancelled_caught:
        raise ApiError(
            408,
            f"the request body did not arrive within {limits.timeout:g} seconds",
            code="request_timeout",
            headers={"Connection": "close"},  # the rest of it may still be on its way
        )
    raw = b"".join(chunks)
    try:  # a large body off the event loop: 4 MiB take up to a fifth of a second to check
        if len(raw) > INLINE_DECODE_BYTES:
            return await anyio.to_thread.run_sync(decode_json, raw)
        return decode_json(raw)
    except InvalidRequestError as exc:
        raise api_error(exc) from None


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body exceeds {limit} bytes", code="request_too_large")


def requested_model(body: object) -> str | None:
    """The model a request names, None if it names none; 400 if the body is not a JSON object
    or its model not a string."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {json_type(body)}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    return model


def parse_request(kind: Kind, body: object) -> SamplingRequest:
    """An OpenAI chat (kind 'chat') or completions ('text') body as its typed request
    (protocol.py), its model aside (the server routes on that first); ApiError (a 400 naming
    the parameter) when it is not valid. Unknown fields are ignored."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {json_type(body)}")
    try:
        return parse(kind, body)
    except InvalidRequestError as exc:
        raise api_error(exc) from None
