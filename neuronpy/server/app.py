"""The starlette app: OpenAI-compatible completions, chat, models, health and stats."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from neuronpy.engine.engine import Engine, RequestStream
from neuronpy.engine.types import FinishReason, GenerationEvent, SamplingParams
from neuronpy.errors import ModelLoadError, NeuronError
from neuronpy.server.protocol import (
    ApiError,
    Kind,
    ParsedRequest,
    Reply,
    api_error,
    encode_prompt,
    finish_error,
    parse_request,
    render_chat,
    unavailable,
)
from neuronpy.server.sse import EventStreamResponse, cancel_on_disconnect

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20


@dataclass
class ServerState:
    """Where the model stands; the routes read it, the lifespan task writes it."""

    status: str = "loading"  # loading -> ready -> stopping; or failed
    engine: Engine | None = None
    error: str | None = None
    started: int = field(default_factory=lambda: int(time.time()))

    def ready_engine(self) -> Engine:
        """The engine, or 503 while loading, stopping, failed or unhealthy."""
        if self.status == "loading":
            raise unavailable("the model is loading; retry shortly", retry_after=5)
        if self.status != "ready" or self.engine is None:
            raise unavailable("the server is not serving requests")
        if not self.engine.healthy:
            raise unavailable("the model is unavailable after an internal error")
        return self.engine


def create_app(
    load_engine: Callable[[], Engine],
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    on_fatal: Callable[[BaseException], None] | None = None,
    stats_log_seconds: float = 10.0,
) -> Starlette:
    """The HTTP app. `load_engine` (blocking, run in a thread once the server is up) loads the
    model and builds the engine; /health answers 503 until it has loaded and warmed up.
    If loading fails, `on_fatal` is called with the error (the CLI stops the server)."""
    state = ServerState()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        stop, loading = anyio.Event(), anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_run_engine, state, load_engine, on_fatal, stop, loading)
            tg.start_soon(_log_stats, state, stop, stats_log_seconds)
            try:
                yield
            finally:
                if state.status != "failed":
                    state.status = "stopping"
                loading.cancel()  # stopping while the weights load: stop waiting for them
                stop.set()

    async def health(request: Request) -> Response:
        engine = state.engine
        if state.status == "ready" and engine is not None and engine.healthy:
            return JSONResponse({"status": "ok", "model": engine.name})
        status = "unhealthy" if state.status == "ready" else state.status
        return JSONResponse({"status": status}, status_code=503)

    async def models(request: Request) -> Response:
        engine = state.ready_engine()
        card = _model_card(engine, state.started)
        wanted = request.path_params.get("model")
        if wanted is None:
            return JSONResponse({"object": "list", "data": [card]})
        if wanted != engine.name:
            raise ApiError(404, f"the model '{wanted}' does not exist", code="model_not_found")
        return JSONResponse(card)

    async def stats(request: Request) -> Response:
        engine = state.engine  # also after a failure: the counters say what happened
        if engine is None:
            raise unavailable("the model is not loaded")
        return JSONResponse(
            {"model": engine.name, "max_running": engine.max_running}
            | dataclasses.asdict(engine.stats())
        )

    async def chat_completions(request: Request) -> Response | EventStreamResponse:
        return await _generate(request, state, "chat", max_body_bytes)

    async def completions(request: Request) -> Response | EventStreamResponse:
        return await _generate(request, state, "text", max_body_bytes)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/stats", stats, methods=["GET"]),
    ]
    handlers: dict[Any, Any] = {
        ApiError: _api_error_response,
        HTTPException: _http_error_response,
        Exception: _internal_error_response,
    }
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
    app.state.neuron = state
    return app


# ---- generation -----------------------------------------------------------------------------


async def _generate(
    request: Request, state: ServerState, kind: Kind, limit: int
) -> Response | EventStreamResponse:
    """Validate, tokenize and admit (any failure is an error response and admits nothing), then
    stream or gather the result; a client that disconnects cancels its request."""
    engine = state.ready_engine()
    body = await _read_json(request, limit)
    req = parse_request(kind, body, engine.name)
    prompt_ids = await anyio.to_thread.run_sync(_tokenize, engine, req)
    params = req.sampling_params(len(prompt_ids), engine.context_len)
    stream = _submit(engine, prompt_ids, params, req)
    reply = Reply(kind, engine.name, include_usage=req.include_usage)
    if req.stream:
        opening = [reply.chunk(None)] if kind == "chat" else []
        return EventStreamResponse(stream, opening, _renderer(reply, stream, engine))
    return await _gather(request, stream, reply, engine)


def _tokenize(engine: Engine, req: ParsedRequest) -> list[int]:
    if req.kind == "chat":
        return render_chat(engine.tokenizer, req.messages)
    return encode_prompt(engine.tokenizer, req.prompt)


def _submit(
    engine: Engine, prompt_ids: list[int], params: SamplingParams, req: ParsedRequest
) -> RequestStream:
    try:
        return engine.submit(prompt_ids, params)
    except NeuronError as exc:
        error = api_error(exc, req.kind)
        if error.param == "max_tokens":
            error.param = req.max_tokens_param
        raise error from None


def _renderer(
    reply: Reply, stream: RequestStream, engine: Engine
) -> Callable[[GenerationEvent], list[dict[str, Any]]]:
    def render(event: GenerationEvent) -> list[dict[str, Any]]:
        chunks = [reply.chunk(event.text)] if event.text else []
        reason = event.finish_reason
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            chunks.append(reply.chunk("", finish_reason=reason.value))
            if reply.include_usage:
                chunks.append(reply.usage_chunk(stream.prompt_tokens, event.completion_tokens))
        elif reason is not None:
            chunks.append(finish_error(reason, event.error, engine.healthy).body())
        return chunks

    return render


async def _gather(
    request: Request, stream: RequestStream, reply: Reply, engine: Engine
) -> Response:
    """A non-streamed request, cancelled if its client disconnects before it ends."""
    events: list[GenerationEvent] = []

    async def collect() -> None:
        async with stream:
            async for event in stream:
                events.append(event)

    if not await cancel_on_disconnect(request.receive, collect):
        return Response(status_code=499)  # nobody is listening
    last = events[-1] if events else None
    if last is None or last.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
        reason = last.finish_reason if last and last.finish_reason else FinishReason.ERROR
        raise finish_error(reason, last.error if last else None, engine.healthy)
    text = "".join(e.text for e in events)
    body = reply.body(text, last.finish_reason.value, stream.prompt_tokens, last.completion_tokens)
    return JSONResponse(body)


async def _read_json(request: Request, limit: int) -> object:
    """The body as JSON: 415 unless it says it is JSON, 413 past `limit` bytes (before reading
    them when Content-Length says so), 400 if it does not parse."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(415, "the request body must be JSON (Content-Type: application/json)")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({str(exc)[:200]})") from None


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body exceeds {limit} bytes", code="request_too_large")


def _model_card(engine: Engine, created: int) -> dict[str, Any]:
    return {
        "id": engine.name,
        "object": "model",
        "created": created,
        "owned_by": "neuronpy",
        "max_model_len": engine.context_len,
    }


# ---- lifecycle ------------------------------------------------------------------------------


async def _run_engine(
    state: ServerState,
    load_engine: Callable[[], Engine],
    on_fatal: Callable[[BaseException], None] | None,
    stop: anyio.Event,
    loading: anyio.CancelScope,
) -> None:
    """Load, start and warm up the engine, serve until `stop`, then stop the engine."""
    try:
        started = time.perf_counter()
        with loading:
            engine = await anyio.to_thread.run_sync(load_engine, abandon_on_cancel=True)
        if loading.cancelled_caught:
            return
        async with engine:
            await _warm_up(engine)
            state.engine, state.status = engine, "ready"
            log.info(
                "ready: serving %s (context %d tokens, %d in flight) after %.1f s",
                engine.name,
                engine.context_len,
                engine.max_running,
                time.perf_counter() - started,
            )
            await stop.wait()
    except Exception as exc:
        state.status, state.error = "failed", str(exc)
        if isinstance(exc, (ModelLoadError, NeuronError)):
            log.error("could not start the model: %s", exc)
        else:
            log.exception("could not start the model")
        if on_fatal is not None:
            on_fatal(exc)


async def _warm_up(engine: Engine) -> None:
    """One tiny greedy generation, so the first client does not pay for first-call costs."""
    prompt = engine.tokenizer.encode("Hello") or [0]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    done = await engine.complete(prompt[: engine.context_len - 2], params)
    if done.finish_reason is not FinishReason.LENGTH:
        raise RuntimeError(f"warm-up generation ended with {done.finish_reason}")


async def _log_stats(state: ServerState, stop: anyio.Event, seconds: float) -> None:
    """Log the batch every `seconds` while the engine is busy (visible batching)."""
    last_steps = -1
    while not stop.is_set():
        with anyio.move_on_after(seconds):
            await stop.wait()
        engine = state.engine
        if engine is None or stop.is_set():
            continue
        s = engine.stats()
        if s.decode_steps != last_steps:
            last_steps = s.decode_steps
            mean = s.decoded_rows / s.decode_steps if s.decode_steps else 0.0
            log.info(
                "batch: running=%d queued=%d live_batch=%d max_batch=%d mean_batch=%.2f "
                "decode_steps=%d finished=%d cancelled=%d",
                s.running,
                s.queued,
                s.live_batch_size,
                s.max_batch_size,
                mean,
                s.decode_steps,
                s.finished,
                s.cancelled,
            )


# ---- errors -----------------------------------------------------------------------------------


async def _api_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    error = ApiError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers)
    return await _api_error_response(request, error)


async def _internal_error_response(request: Request, exc: Exception) -> Response:
    # starlette re-raises after this response, so the server logs the traceback; the client
    # sees none of it
    error = ApiError(500, "internal server error", type="server_error")
    return await _api_error_response(request, error)
