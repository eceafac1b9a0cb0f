"""The starlette app: OpenAI-compatible completions, chat, models, health and stats."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from neuronpy.engine.engine import Engine, RequestStream
from neuronpy.engine.reasoning import resolve_reasoning_parser
from neuronpy.engine.sessions import (
    SessionRequest,
    SessionStore,
    check_compatible,
    dtype_name,
)
from neuronpy.engine.types import FinishReason, GenerationEvent, SamplingParams
from neuronpy.errors import InvalidRequestError, NeuronError
from neuronpy.server.auth import security_middleware
from neuronpy.server.choices import ChoicesStreamResponse
from neuronpy.server.logprobs import token_texts
from neuronpy.server.metrics import ServerMetrics
from neuronpy.server.models import (
    ServedModel,
    ServerState,
    drain_on_request,
    log_batches,
    serve_model,
)
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
    requested_model,
    unavailable,
    usage,
)
from neuronpy.server.sse import EventStreamResponse, cancel_on_disconnect

MAX_BODY_BYTES = 4 << 20


def create_app(
    models: Mapping[str, Callable[[], Engine]],
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    on_fatal: Callable[[BaseException], None] | None = None,
    stats_log_seconds: float = 10.0,
    drain_timeout: float = 30.0,
    on_drained: Callable[[], None] | None = None,
    api_key: str | None = None,
    cors_allow_origins: Sequence[str] = (),
    cors_allow_credentials: bool = False,
    sessions_dir: str | Path | None = None,
) -> Starlette:
    """The HTTP app serving `models`: {name: a blocking function that loads the model and builds
    its engine}. Once the server is up, each model loads in a thread of its own and serves as
    soon as it has loaded and warmed up; a model that fails leaves the others serving.
    `on_fatal` is called with the error when no model could be started (the CLI stops).
    `app.state.neuron.request_shutdown()` (the CLI calls it on SIGTERM) stops admitting, gives
    in-flight requests `drain_timeout` seconds, aborts the rest, then calls `on_drained`.
    With `api_key`, every route but /health needs it; `cors_allow_origins` turns CORS on.
    `sessions_dir` turns sessions on: conversations' KV saved there by name (see
    engine/sessions.py), listed and deleted under /v1/sessions."""
    if not models:
        raise ValueError("create_app needs at least one model")
    state = ServerState({name: ServedModel(name, load) for name, load in models.items()})
    store = SessionStore(sessions_dir) if sessions_dir is not None else None
    metrics = ServerMetrics(state)
    middleware = security_middleware(api_key, cors_allow_origins, cors_allow_credentials)

    def failed(exc: BaseException) -> None:
        if on_fatal is not None and all(m.status == "failed" for m in state.models.values()):
            on_fatal(exc)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        stop = anyio.Event()
        loading = {name: anyio.CancelScope() for name in state.models}
        async with anyio.create_task_group() as tg:
            for model in state.models.values():
                tg.start_soon(serve_model, model, stop, loading[model.name], failed)
            tg.start_soon(log_batches, state.models.values(), stop, stats_log_seconds)
            draining = anyio.CancelScope()

            async def drain() -> None:
                with draining:
                    await drain_on_request(state, drain_timeout, on_drained)

            tg.start_soon(drain)
            try:
                yield
            finally:
                draining.cancel()
                for model in state.models.values():
                    if model.status != "failed":
                        model.status = "stopping"
                for scope in loading.values():
                    scope.cancel()  # stopping while weights load: stop waiting for them
                stop.set()

    async def health(request: Request) -> Response:
        """200 when every model is ready, else 503; `?model=NAME` asks about one model."""
        wanted = request.query_params.get("model")
        if wanted is not None:
            model = state.find(wanted)
            code = 200 if model.state == "ready" else 503
            return JSONResponse({"status": model.state, "model": model.name}, status_code=code)
        body = {
            "status": state.status,
            "models": {model.name: model.state for model in state.models.values()},
        }
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    async def models_route(request: Request) -> Response:
        wanted = request.path_params.get("model")
        if wanted is not None:
            model = state.find(wanted)
            return JSONResponse(_model_card(model.name, model.ready_engine(), state.started))
        cards = [
            _model_card(m.name, m.engine, state.started)
            for m in state.models.values()
            if m.state == "ready" and m.engine is not None
        ]
        if not cards:
            raise unavailable("no model is ready to serve requests")
        return JSONResponse({"object": "list", "data": cards})

    async def stats(request: Request) -> Response:
        """Each model's engine counters; `?model=NAME` gives one model's."""
        wanted = request.query_params.get("model")
        if wanted is not None:
            return JSONResponse(_stats(state.find(wanted)))
        return JSONResponse({"models": {m.name: _stats(m) for m in state.models.values()}})

    async def metrics_route(request: Request) -> Response:
        """Prometheus metrics, in the text format the scraper asks for."""
        content, content_type = metrics.exposition(request.headers.get("accept"))
        return Response(content, headers={"Content-Type": content_type})

    async def chat_completions(request: Request) -> Response | EventStreamResponse:
        return await _generate(request, state, "chat", max_body_bytes, metrics, store)

    async def completions(request: Request) -> Response | EventStreamResponse:
        return await _generate(request, state, "text", max_body_bytes, metrics, store)

    async def sessions_route(request: Request) -> Response:
        if store is None:
            raise ApiError(404, SESSIONS_OFF, param="session")
        name = request.path_params.get("name")
        try:
            if name is None:
                return JSONResponse({"object": "list", "data": await _list_sessions(store)})
            if request.method == "DELETE":
                if not await anyio.to_thread.run_sync(store.delete, name):
                    raise ApiError(404, f"no session {name!r}", param="session")
                return JSONResponse({"id": name, "object": "session.deleted", "deleted": True})
            info = await anyio.to_thread.run_sync(store.info, name)
        except InvalidRequestError as exc:
            raise api_error(exc) from None
        if info is None:
            raise ApiError(404, f"no session {name!r}", param="session")
        return JSONResponse(info.public())

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models_route, methods=["GET"]),
        Route("/v1/models/{model:path}", models_route, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/sessions", sessions_route, methods=["GET"]),
        Route("/v1/sessions/{name}", sessions_route, methods=["GET", "DELETE"]),
        Route("/stats", stats, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
    ]
    handlers: dict[Any, Any] = {
        ApiError: _api_error_response,
        HTTPException: _http_error_response,
        Exception: _internal_error_response,
    }
    app = Starlette(
        routes=routes, lifespan=lifespan, exception_handlers=handlers, middleware=middleware
    )
    app.state.neuron = state
    return app


def _stats(model: ServedModel) -> dict[str, Any]:
    """A model's state and, once it has an engine (also after a failure: the counters say what
    happened), the engine's counters."""
    out: dict[str, Any] = {"model": model.name, "status": model.state}
    if model.engine is not None:
        out["max_running"] = model.engine.max_running
        out |= dataclasses.asdict(model.engine.stats())
    return out


# ---- generation -----------------------------------------------------------------------------


async def _generate(
    request: Request,
    state: ServerState,
    kind: Kind,
    limit: int,
    metrics: ServerMetrics,
    store: SessionStore | None = None,
) -> Response | EventStreamResponse:
    """Validate, tokenize and admit (any failure is an error response and admits nothing), then
    stream or gather the result; a client that disconnects cancels its request."""
    started = time.perf_counter()
    model: ServedModel | None = None
    try:
        body = await _read_json(request, limit)
        model = state.find(requested_model(body))
        engine = model.ready_engine()
        req = parse_request(kind, body)
        prompt_ids = await anyio.to_thread.run_sync(_tokenize, engine, req)
        reasoning = resolve_reasoning_parser(engine.config.reasoning_parser, engine.tokenizer)
        params = req.sampling_params(len(prompt_ids), engine.context_len, reasoning)
        session = await _session_request(store, engine, req)
        streams = _submit(engine, prompt_ids, params, req, session)
    except ApiError as exc:
        metrics.reject(model, exc)
        raise
    texts = token_texts(engine.tokenizer) if params.logprobs is not None else None
    reply = Reply(kind, model.name, include_usage=req.include_usage, texts=texts)
    if len(streams) > 1:  # n > 1: each copy counts as an admitted request
        observers = [metrics.admit(model.name, started) for _ in streams]
        if req.stream:
            return _stream_choices(streams, reply, engine, observers)
        return await _gather_choices(request, streams, reply, engine, observers)
    (stream,) = streams
    observe = metrics.admit(model.name, started)
    if req.stream:
        opening = [reply.chunk(None)] if kind == "chat" else []
        render = _renderer(reply, stream, engine, observe)
        return EventStreamResponse(stream, opening, render, _refusal(engine, observe))
    return await _gather(request, stream, reply, engine, observe)


def _tokenize(engine: Engine, req: ParsedRequest) -> list[int]:
    if req.kind == "chat":
        return render_chat(engine.tokenizer, req.messages, req.tools.tools)
    return encode_prompt(engine.tokenizer, req.prompt)


def _submit(
    engine: Engine,
    prompt_ids: list[int],
    params: SamplingParams,
    req: ParsedRequest,
    session: SessionRequest | None = None,
) -> list[RequestStream]:
    try:
        return engine.submit_many(prompt_ids, params, req.n, session)
    except NeuronError as exc:
        error = api_error(exc, req.kind)
        if error.param == "max_tokens":
            error.param = req.max_tokens_param
        raise error from None


SESSIONS_OFF = (
    "sessions are off on this server; start it with --sessions-dir DIR ([server] sessions_dir)"
)


async def _session_request(
    store: SessionStore | None, engine: Engine, req: ParsedRequest
) -> SessionRequest | None:
    """What the request asks of its session, its file's header checked against the model:
    400 when sessions are off, for a bad name, and for a session of another model or dtype."""
    if req.session is None:
        return None
    if store is None:
        raise ApiError(400, SESSIONS_OFF, param="session")
    try:
        info = await anyio.to_thread.run_sync(store.info, req.session)
        if info is not None:
            dtype = dtype_name(engine.model.dtype)
            check_compatible(info, engine.name, engine.fingerprint, dtype)
        path = store.path(req.session)
    except InvalidRequestError as exc:
        raise api_error(exc) from None
    tokens = info.token_ids if info is not None else None
    return SessionRequest(req.session, path, req.session_save, tokens)


async def _list_sessions(store: SessionStore) -> list[dict[str, Any]]:
    """Every session in the directory; one that cannot be read is listed with why (so that it
    can be found and deleted), not a failure of the whole list."""
    data = []
    for name in await anyio.to_thread.run_sync(store.names):
        try:
            info = await anyio.to_thread.run_sync(store.info, name)
        except InvalidRequestError as exc:
            data.append({"id": name, "object": "session", "error": exc.message})
            continue
        if info is not None:  # (deleted meanwhile)
            data.append(info.public())
    return data


def _renderer(
    reply: Reply, stream: RequestStream, engine: Engine, observe: Callable[[GenerationEvent], None]
) -> Callable[[GenerationEvent], list[dict[str, Any]]]:
    def render(event: GenerationEvent) -> list[dict[str, Any]]:
        observe(event)
        chunks = reply.event_chunks(event)  # content, reasoning, tool calls, logprobs
        reason = event.finish_reason
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            chunks.append(reply.chunk("", finish_reason=reply.finish_reason(reason)))
            if reply.include_usage:
                chunks.append(
                    reply.usage_chunk(
                        stream.prompt_tokens, event.completion_tokens, stream.cached_tokens
                    )
                )
        elif reason is not None:
            if reason is FinishReason.ABORT:  # cut short (shutdown): say so, then why
                chunks.append(reply.chunk("", finish_reason=reason.value))
            chunks.append(finish_error(reason, event.error, engine.healthy).body())
        return chunks

    return render


def _failure(last: GenerationEvent | None, engine: Engine) -> ApiError | None:
    """The HTTP error for a request that ended without finishing (None if it finished):
    503 when aborted (timed out in the queue, shutting down) or the model failed, else 500."""
    if last is not None and last.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
        return None
    reason = last.finish_reason if last and last.finish_reason else FinishReason.ERROR
    wait = engine.retry_after() if reason is FinishReason.ABORT else None
    return finish_error(reason, last.error if last else None, engine.healthy, wait)


def _refusal(
    engine: Engine, observe: Callable[[GenerationEvent], None]
) -> Callable[[GenerationEvent | None], ApiError | None]:
    """For a stream: the HTTP error to answer instead of a 200, when the request's first event
    already ends it without any text (it never ran, or failed at once)."""

    def refuse(first: GenerationEvent | None) -> ApiError | None:
        if first is not None and (first.text or not first.finished):
            return None
        error = _failure(first, engine)
        if error is not None and first is not None:
            observe(first)  # it is not rendered
        return error

    return refuse


async def _gather(
    request: Request,
    stream: RequestStream,
    reply: Reply,
    engine: Engine,
    observe: Callable[[GenerationEvent], None],
) -> Response:
    """A non-streamed request, cancelled if its client disconnects before it ends."""
    events: list[GenerationEvent] = []

    async def collect() -> None:
        async with stream:
            async for event in stream:
                events.append(event)
                observe(event)

    if not await cancel_on_disconnect(request.receive, collect):
        return Response(status_code=499)  # nobody is listening
    return JSONResponse(_body(events, stream, reply, engine))


def _body(
    events: list[GenerationEvent], stream: RequestStream, reply: Reply, engine: Engine
) -> dict[str, Any]:
    """A whole request's response body from its events; the ApiError when it did not finish."""
    last = events[-1] if events else None
    error = _failure(last, engine)
    if error is not None or last is None or last.finish_reason is None:
        raise error or ApiError(500, "generation failed", type="server_error")
    text = "".join(e.text for e in events)
    body = reply.body(
        text, last.finish_reason.value, stream.prompt_tokens, last.completion_tokens, events=events
    )
    body["usage"] = usage(stream.prompt_tokens, last.completion_tokens, stream.cached_tokens)
    return body


async def _gather_choices(
    request: Request,
    streams: list[RequestStream],
    reply: Reply,
    engine: Engine,
    observers: list[Callable[[GenerationEvent], None]],
) -> Response:
    """n > 1, not streamed: every copy gathered, one choice each (index i: copy i); the usage
    counts the prompt once and every copy's tokens. A disconnect cancels every copy."""
    events: list[list[GenerationEvent]] = [[] for _ in streams]

    async def collect() -> None:
        async with contextlib.AsyncExitStack() as stack, anyio.create_task_group() as tg:
            for i, stream in enumerate(streams):
                await stack.enter_async_context(stream)  # leaving cancels what did not finish

                async def one(i: int = i, stream: RequestStream = stream) -> None:
                    async for event in stream:
                        events[i].append(event)
                        observers[i](event)

                tg.start_soon(one)

    if not await cancel_on_disconnect(request.receive, collect):
        return Response(status_code=499)
    bodies = [
        _body(evs, stream, dataclasses.replace(reply, index=i), engine)
        for i, (evs, stream) in enumerate(zip(events, streams, strict=True))
    ]
    out = bodies[0]
    out["choices"] = [b["choices"][0] for b in bodies]
    completion = sum(b["usage"]["completion_tokens"] for b in bodies)
    out["usage"] = usage(streams[0].prompt_tokens, completion, streams[0].cached_tokens)
    return JSONResponse(out)


def _stream_choices(
    streams: list[RequestStream],
    reply: Reply,
    engine: Engine,
    observers: list[Callable[[GenerationEvent], None]],
) -> ChoicesStreamResponse:
    """n > 1, streamed: the copies' chunks interleaved as they come, each with its choice's
    index; one usage chunk (when asked for) after every copy has finished."""
    completions = [0] * len(streams)
    replies = [dataclasses.replace(reply, index=i) for i in range(len(streams))]

    def renderer(i: int) -> Callable[[GenerationEvent], list[dict[str, Any]]]:
        render = _renderer(replies[i], streams[i], engine, observers[i])

        def render_choice(event: GenerationEvent) -> list[dict[str, Any]]:
            if event.finished:
                completions[i] = event.completion_tokens
            # the usage chunk goes once, for every choice, at the end
            return [c for c in render(event) if not (c.get("choices") == [] and c.get("usage"))]

        return render_choice

    def closing() -> list[dict[str, Any]]:
        if not reply.include_usage:
            return []
        first = streams[0]
        return [reply.usage_chunk(first.prompt_tokens, sum(completions), first.cached_tokens)]

    opening = [r.chunk(None) for r in replies] if reply.kind == "chat" else []
    return ChoicesStreamResponse(
        streams,
        opening,
        [renderer(i) for i in range(len(streams))],
        [_refusal(engine, observe) for observe in observers],
        closing,
    )


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


def _model_card(name: str, engine: Engine, created: int) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "neuronpy",
        "max_model_len": engine.context_len,
    }


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
