"""Every error the server answers: ApiError and its OpenAI body, and the mapping onto it."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from neuronpy.engine.types import FinishReason, GenerationEvent
from neuronpy.errors import (
    EngineUnhealthyError,
    InvalidRequestError,
    NeuronError,
    QueueFullError,
    ShuttingDownError,
)

if TYPE_CHECKING:
    from neuronpy.engine.remote import ServingEngine

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An HTTP error with an OpenAI error body. Its message is the server's own words (or a
    bounded quote of the request's): never a traceback, a path or another request's text."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self, path: str | None = None) -> dict[str, Any]:
        """The error's JSON body in the shape of the API that `path` belongs to: Anthropic's
        under /v1/messages, Ollama's under /api/, OpenAI's everywhere else."""
        if path is not None and path.startswith(ANTHROPIC_PREFIX):
            return self.anthropic_body()
        if path is not None and path.startswith(OLLAMA_PREFIX):
            return {"error": self.named_message()}
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def named_message(self) -> str:
        """The message, with the field it is about where it does not name it already (the
        APIs whose errors have no `param`)."""
        if self.param is None or self.param in self.message:
            return self.message
        return f"{self.param}: {self.message}"

    def anthropic_body(self) -> dict[str, Any]:
        kind = ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else None)
        return {
            "type": "error",
            "error": {"type": kind or "invalid_request_error", "message": self.named_message()},
        }

    def response(self, path: str | None = None) -> JSONResponse:
        """The error as a response, in the shape of `path`'s API (see `body`)."""
        return JSONResponse(self.body(path), status_code=self.status, headers=self.headers)


# The APIs whose errors have a shape of their own, by their routes' prefix.
ANTHROPIC_PREFIX = "/v1/messages"
OLLAMA_PREFIX = "/api/"
# Anthropic's error types by HTTP status (its 529 "overloaded" is our 503)
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def unavailable(message: str, retry_after: float | None = None) -> ApiError:
    """503 with OpenAI's error body; `retry_after` seconds become an integer Retry-After header
    (rounded up, at least 1), as HTTP requires."""
    headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after else None
    return ApiError(503, message, type="service_unavailable", headers=headers)


_NAMED_IN_MESSAGES = ("max_tokens",)  # the engine's parameters its messages name as fields


def api_error(exc: NeuronError, names: Mapping[str, str] | None = None) -> ApiError:
    """The HTTP face of an engine error. `names`: what the request calls the parameters the
    engine names (a chat's 'prompt' is its 'messages'), in the param and where the message
    names the parameter (`max_tokens` in a request that gave max_completion_tokens)."""
    if isinstance(exc, InvalidRequestError):
        if names is None or exc.param is None or exc.param not in names:
            return ApiError(400, exc.message, param=exc.param)
        param, message = names[exc.param], exc.message
        if exc.param in _NAMED_IN_MESSAGES:  # ("the prompt" is the prompt, whatever its field)
            message = re.sub(rf"\b{exc.param}\b", param, message)
        return ApiError(400, message, param=param)
    if isinstance(exc, QueueFullError):
        return unavailable(str(exc), exc.retry_after)
    if isinstance(exc, (EngineUnhealthyError, ShuttingDownError)):
        return unavailable(str(exc))
    return ApiError(500, str(exc), type="server_error")


def failure(last: GenerationEvent | None, engine: ServingEngine) -> ApiError | None:
    """What a request's ending means to its client when it did not finish (None when it did:
    stop or length). `last` is its last event (None: it ended without one). An error about the
    request's own field (`error_param`: its session file, say) is a 400 naming it; an abort (it
    timed out in the queue, or the server is shutting down) is a 503 saying why, with a
    Retry-After; a failure of the model is a 503, any other a 500."""
    reason = last.finish_reason if last is not None else None
    if reason in (FinishReason.STOP, FinishReason.LENGTH):
        return None
    error = last.error if last is not None else None
    if last is not None and last.error_param is not None:  # the request's own doing: a 400
        return ApiError(400, error or "invalid request", param=last.error_param)
    if reason is FinishReason.ABORT:
        message = f"the request was aborted: {error or 'the server is shutting down'}"
        return unavailable(message, engine.retry_after())
    if not engine.healthy:
        return unavailable(error or "the model is unavailable")
    return ApiError(500, error or "generation failed", type="server_error")


# ---- starlette's exception handlers ----------------------------------------------------------


async def _api_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response(request.url.path)


async def _http_error_response(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (an unknown route, a method not allowed) in OpenAI's body."""
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    error = ApiError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers)
    return error.response(request.url.path)


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The client hung up while sending its body: nobody reads an answer, and it is not the
    server's fault, so one debug line rather than a traceback (cheap to provoke, in a loop)."""
    log.debug(
        "%s %s: the client disconnected before its body arrived", request.method, request.url.path
    )
    return Response(status_code=499)


async def _internal_error_response(request: Request, exc: Exception) -> Response:
    # starlette re-raises after this response, so the server logs the traceback; the client
    # sees none of it
    return ApiError(500, "internal server error", type="server_error").response(request.url.path)


EXCEPTION_HANDLERS: dict[Any, Any] = {
    ApiError: _api_error_response,
    HTTPException: _http_error_response,
    ClientDisconnect: _client_gone,
    Exception: _internal_error_response,
}
