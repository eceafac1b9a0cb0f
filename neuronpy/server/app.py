"""The starlette app: `create_app` builds the state every route shares (the served models,
the metrics, the stored responses, the middleware) and mounts the routes of the table below.
Each endpoint is a module-level function that reads what it needs from its request
(context.py's `route_context`); the model routes enter by the front door (front_door.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from neuronpy.defaults import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_LIMIT_CONCURRENCY,
    DEFAULT_SESSION_HEADER,
)
from neuronpy.engine.remote import ServingEngine
from neuronpy.engine.sessions import SessionStore
from neuronpy.server import replica
from neuronpy.server.anthropic_api.routes import count_tokens, create_message
from neuronpy.server.auth import security_middleware
from neuronpy.server.connections import ConcurrencyLimit
from neuronpy.server.context import RouteContext, route_context
from neuronpy.server.embeddings import embeddings
from neuronpy.server.errors import EXCEPTION_HANDLERS, ApiError, unavailable
from neuronpy.server.flow import chat_completions, completions
from neuronpy.server.markdown import render
from neuronpy.server.metrics import ServerMetrics
from neuronpy.server.models import (
    ServedModel,
    ServerState,
    drain_on_request,
    log_batches,
    serve_model,
)
from neuronpy.server.ollama_api import routes as ollama
from neuronpy.server.request_id import RequestIdMiddleware
from neuronpy.server.requests import MAX_BODY_BYTES, BodyLimits
from neuronpy.server.responses_api.routes import create_response, input_items, stored_response
from neuronpy.server.responses_api.store import ResponseStore, StoreLimits
from neuronpy.server.scoring import rerank, score
from neuronpy.server.sessions import SESSIONS_OFF, delete_session, list_sessions, show_session
from neuronpy.server.tokenize import detokenize, tokenize
from neuronpy.server.web import batch as live_batch
from neuronpy.server.web import favicon, page, static

# ---- the server's own endpoints: health, models, counters, sessions, replicas ------------------


async def health(request: Request) -> Response:
    """200 when every model is ready, else 503; `?model=NAME` asks about one model."""
    state = route_context(request).state
    wanted = request.query_params.get("model")
    if wanted is not None:
        model = state.find(wanted)
        shown = state.health_of(model)
        code = 200 if shown == "ready" else 503
        return JSONResponse({"status": shown, "model": model.name}, status_code=code)
    body = {
        "status": state.status,
        "models": {model.name: state.health_of(model) for model in state.models.values()},
    }
    return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)


async def model_cards(request: Request) -> Response:
    """/v1/models: the cards of the models ready to serve; /v1/models/NAME: that model's."""
    state = route_context(request).state
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
        loading = any(m.status == "loading" for m in state.models.values())
        if loading:  # as the inference routes answer while a model loads
            raise unavailable("no model is ready yet: loading; retry shortly", retry_after=5)
        raise unavailable("no model is ready to serve requests")
    return JSONResponse({"object": "list", "data": cards})


async def engine_stats(request: Request) -> Response:
    """Each model's engine counters; `?model=NAME` gives one model's."""
    state = route_context(request).state
    wanted = request.query_params.get("model")
    if wanted is not None:
        return JSONResponse(_stats(state.find(wanted)))
    return JSONResponse({"models": {m.name: _stats(m) for m in state.models.values()}})


async def prometheus(request: Request) -> Response:
    """Prometheus metrics, in the text format the scraper asks for."""
    content, content_type = route_context(request).metrics.exposition(request.headers.get("accept"))
    return Response(content, headers={"Content-Type": content_type})


async def sessions(request: Request) -> Response:
    """/v1/sessions lists them; /v1/sessions/NAME shows (GET) or deletes (DELETE) one."""
    store = route_context(request).sessions
    if store is None:
        raise ApiError(404, SESSIONS_OFF, param="session")
    name = request.path_params.get("name")
    if name is None:
        return JSONResponse(await list_sessions(store))
    if request.method == "DELETE":
        return JSONResponse(await delete_session(store, name))
    return JSONResponse(await show_session(store, name))


async def load(request: Request) -> Response:
    """/get_load: requests running and waiting (replica.py)."""
    return await replica.get_load(route_context(request).state)


async def drain(request: Request) -> Response:
    """POST /drain: a graceful drain, as SIGTERM begins one (replica.py)."""
    context = route_context(request)
    return await replica.drain(request, context.state, context.api_key)


async def batch(request: Request) -> Response:
    """/v1/batch: the live batch, as the batch view shows it (web.py)."""
    return await live_batch(route_context(request).state)


async def render_replies(request: Request) -> Response:
    """POST /render: the chat page's replies as HTML (markdown.py)."""
    return await render(request, route_context(request).limits)


# ---- the route table ----------------------------------------------------------------------------

# Every route the server answers: path, endpoint, methods (a GET answers HEAD too)
ROUTES = [
    Route("/health", health, methods=["GET"]),
    Route("/live", replica.live, methods=["GET"]),
    Route("/get_load", load, methods=["GET"]),
    Route("/drain", drain, methods=["POST"]),
    Route("/v1/batch", batch, methods=["GET"]),
    Route("/v1/models", model_cards, methods=["GET"]),
    Route("/v1/models/{model:path}", model_cards, methods=["GET"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{rid}", stored_response, methods=["GET", "DELETE"]),
    Route("/v1/responses/{rid}/input_items", input_items, methods=["GET"]),
    Route("/v1/messages", create_message, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    Route("/v1/embeddings", embeddings, methods=["POST"]),
    *ollama.ROUTES,
    Route("/v1/score", score, methods=["POST"]),
    Route("/v1/rerank", rerank, methods=["POST"]),
    Route("/rerank", rerank, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/v1/sessions", sessions, methods=["GET"]),
    Route("/v1/sessions/{name}", sessions, methods=["GET", "DELETE"]),
    Route("/stats", engine_stats, methods=["GET"]),
    Route("/metrics", prometheus, methods=["GET"]),
]
# The web page's routes, mounted with `web` (their static files need no key; what they fetch does)
WEB_ROUTES = [
    Route("/", page, methods=["GET"]),
    Route("/batch", page, methods=["GET"]),
    Route("/static/{name}", static, methods=["GET"]),
    Route("/favicon.ico", favicon, methods=["GET"]),
    Route("/render", render_replies, methods=["POST"]),
]


def create_app(
    models: Mapping[str, Callable[[], ServingEngine]],
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    limit_concurrency: int = DEFAULT_LIMIT_CONCURRENCY,
    on_fatal: Callable[[BaseException], None] | None = None,
    stats_log_seconds: float = 10.0,
    drain_timeout: float = 30.0,
    drain_grace: float = 0.0,
    on_drained: Callable[[], None] | None = None,
    api_key: str | None = None,
    cors_allow_origins: Sequence[str] = (),
    cors_allow_credentials: bool = False,
    sessions_dir: str | Path | None = None,
    session_header: str | None = DEFAULT_SESSION_HEADER,
    stored_responses: StoreLimits | None = None,
    web: bool = True,
    image_urls: bool = False,
) -> Starlette:
    """The HTTP app serving `models`: {name: a blocking function that loads the model and builds
    its engine}. Once the server is up, each model loads in a thread of its own and serves as
    soon as it has loaded and warmed up; a model that fails leaves the others serving.
    `on_fatal` is called with the error when no model could be started (the CLI stops).
    `app.state.neuron.request_shutdown()` (the CLI calls it on SIGTERM) stops admitting, gives
    in-flight requests `drain_timeout` seconds, aborts the rest, then calls `on_drained`;
    with `drain_grace`, /health turns 503 at once but requests are admitted that many seconds
    more (while a load balancer notices).
    With `api_key`, every route but /health needs it; `cors_allow_origins` turns CORS on.
    A body must arrive within `body_timeout` seconds (else 408); at most `limit_concurrency`
    requests are handled at once, /health and /metrics aside (else 503); 0 turns either off.
    `sessions_dir` turns sessions on: conversations' KV saved there by name (see
    engine/sessions.py), listed and deleted under /v1/sessions; with them on, a chat or
    completions request that carries `session_header` (a router's affinity key, X-Session-ID)
    and no `session` continues and saves the session of that name. `stored_responses`: the
    Responses API's store's bounds, in memory and on disk (responses_api/store.py). `web`: the
    chat page at / and the batch view at /batch (their static files need no key; what they
    fetch does)."""
    if not models:
        raise ValueError("create_app needs at least one model")
    state = ServerState(
        {name: ServedModel(name, load, image_urls=image_urls) for name, load in models.items()}
    )
    store = SessionStore(sessions_dir) if sessions_dir is not None else None
    metrics = ServerMetrics(state)
    # stored responses (the Responses API): in memory, and beside the sessions when they are on
    responses = ResponseStore(store.directory if store is not None else None, stored_responses)
    limits = BodyLimits(max_body_bytes, body_timeout)
    # outermost: every response carries its x-request-id, a 401 or a CORS refusal too
    middleware = [Middleware(RequestIdMiddleware)]
    middleware += security_middleware(api_key, cors_allow_origins, cors_allow_credentials, web=web)
    if limit_concurrency:  # inside the key check: a client without the key holds nothing
        middleware.append(
            Middleware(ConcurrencyLimit, limit=limit_concurrency, on_refused=metrics.refuse_unread)
        )

    def failed(exc: BaseException) -> None:
        if on_fatal is not None and all(m.status == "failed" for m in state.models.values()):
            on_fatal(exc)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            for model in state.models.values():
                tg.start_soon(serve_model, model, stop, failed)
            tg.start_soon(log_batches, state.models.values(), stop, stats_log_seconds)
            draining = anyio.CancelScope()

            async def drain_when_asked() -> None:
                with draining:
                    await drain_on_request(state, drain_timeout, on_drained, drain_grace)

            tg.start_soon(drain_when_asked)
            try:
                yield
            finally:
                draining.cancel()
                for model in state.models.values():
                    if model.status != "failed":
                        model.status = "stopping"
                stop.set()  # (stopping while weights load: stop waiting for them)

    app = Starlette(
        routes=ROUTES + WEB_ROUTES if web else ROUTES,
        lifespan=lifespan,
        exception_handlers=EXCEPTION_HANDLERS,
        middleware=middleware,
    )
    app.state.neuron = state  # (the CLI's handle: request_shutdown on SIGTERM)
    app.state.context = RouteContext(
        state, metrics, limits, sessions=store, session_header=session_header, api_key=api_key
    )
    app.state.responses = responses  # (the Responses API's routes read it: response_store)
    return app


def _stats(model: ServedModel) -> dict[str, Any]:
    """A model's state and, once it has an engine (also after a failure: the counters say what
    happened), the engine's counters."""
    out: dict[str, Any] = {"model": model.name, "status": model.state}
    if model.engine is not None:
        out["max_running"] = model.engine.max_running
        out["speculative"] = model.engine.config.speculative
        stats = model.engine.stats()
        out |= dataclasses.asdict(stats)
        out["spec_acceptance_rate"] = stats.spec_acceptance_rate
        out["spec_tokens_per_row_step"] = stats.spec_tokens_per_row_step
    return out


def _reads_images(engine: ServingEngine) -> bool:
    return getattr(engine, "processor", None) is not None


def _model_card(name: str, engine: ServingEngine, created: int) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "neuronpy",
        "max_model_len": engine.context_len,
        # what its prompts may hold: images too, for a vision-language model
        "input_modalities": ["text", "image"] if _reads_images(engine) else ["text"],
        # what it serves, and how /v1/embeddings pools its hidden states
        "task": engine.task,
        "pooling": {
            "mode": engine.pooling.mode,
            "normalize": engine.pooling.normalize,
            "dimensions": engine.facts.hidden_size,
        },
    }
