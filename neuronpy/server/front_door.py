"""The front door of every route that serves a model: chat and completions, the Responses,
Anthropic and Ollama APIs, embeddings, scores and reranking. In one place, for all of them:
the request is named (its id), its JSON body read within the server's limits, the model it
names found and checked ready; and a refusal before the request is admitted (an ApiError,
from here or from the route's own checks within the `async with`) is counted in the metrics
by model and reason, logged, and raised on, for errors.py to answer in the shape of the
route's API (OpenAI's, Anthropic's or Ollama's, chosen by the path).

What differs between the APIs is given as parameters: how a body names its model (`named`),
the id the route gives a request (`own_id`), the name its log lines use (`label`), and the
logger they go to (each API's own module)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from neuronpy.engine.remote import ServingEngine
from neuronpy.server.context import RouteContext, route_context
from neuronpy.server.errors import ApiError
from neuronpy.server.models import ServedModel
from neuronpy.server.request_id import name_request
from neuronpy.server.requests import read_json, requested_model

log = logging.getLogger(__name__)

# An API's own check of the model a body names: it returns the body with its `model` as the
# server names the model (Ollama's `NAME:latest` is NAME), or raises an ApiError (a 400 where
# the API requires a model and the body names none).
Named = Callable[[object], dict[str, Any]]


@dataclass(frozen=True)
class Arrival:
    """A request past the front door: its body, the served model it names and its engine
    (ready when the request arrived)."""

    label: str  # the request's name in the log and the batch view
    started: float  # when it arrived (time.perf_counter()): its latencies count from here
    body: dict[str, Any]
    model: ServedModel
    engine: ServingEngine
    context: RouteContext  # the app's shared state (context.py)


async def read_body_and_model(
    request: Request, context: RouteContext, named: Named | None = None
) -> tuple[dict[str, Any], ServedModel]:
    """The request's JSON body (read_json: 408, 413, 415, 400), given to `named` when the API
    has its own check of the model, and the served model the body names (a body that names
    none: the first model served; an unknown name: 404). The model may not be ready yet:
    `ServedModel.ready_engine()` says so (503)."""
    body = await read_json(request, context.limits)
    if named is not None:
        body = named(body)
    model = context.state.find(requested_model(body))
    assert isinstance(body, dict)  # (requested_model refuses any other body)
    return body, model


@asynccontextmanager
async def front_door(
    request: Request,
    own_id: str,
    *,
    named: Named | None = None,
    label: str | None = None,
    logger: logging.Logger = log,
) -> AsyncIterator[Arrival]:
    """Enter a model route: the request named (the client's `x-request-id`, else `own_id`:
    name_request), its body read and its model found (read_body_and_model, with the API's
    `named`), the model's engine ready; then the block of the `async with` runs, which
    validates and admits the request. An ApiError raised anywhere before the block ends is
    counted in the metrics (as refused, with the model when it was found) and logged as
    "request LABEL refused: STATUS MESSAGE" to `logger`, then raised on. `label`: the
    request's name in the log and the batch view (default: its request id)."""
    context = route_context(request)
    started = time.perf_counter()
    rid = name_request(request, own_id)
    label = rid if label is None else label
    model: ServedModel | None = None
    try:
        body, model = await read_body_and_model(request, context, named)
        engine = model.ready_engine()
        yield Arrival(label, started, body, model, engine, context)
    except ApiError as exc:
        context.metrics.reject(model, exc)
        logger.info("request %s refused: %d %s", label, exc.status, exc.message[:200])
        raise
