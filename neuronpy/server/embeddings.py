"""POST /v1/embeddings, in OpenAI's shape: one vector per input (a string or token ids), the
model's hidden states pooled (engine/embeddings.py), batched with concurrent requests' inputs."""

from __future__ import annotations

import base64
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import torch
import torch.nn.functional as F
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from neuronpy.engine.remote import ServingEngine
from neuronpy.errors import InvalidRequestError, NeuronError
from neuronpy.server.copies import cancel_on_disconnect
from neuronpy.server.errors import api_error
from neuronpy.server.front_door import Arrival, Named, front_door
from neuronpy.server.models import ServedModel, ServerState
from neuronpy.server.schema import is_int, json_type

log = logging.getLogger(__name__)

MAX_INPUTS = 2048  # inputs one request may send (OpenAI's limit)
ENCODINGS = ("float", "base64")
_INPUT_SHAPES = (
    "'input' must be a string, an array of strings, an array of token ids or an array of "
    "arrays of token ids"
)


def parse_inputs(value: object, vocab_size: int) -> tuple[list[str] | None, list[list[int]]]:
    """`input` as (texts, None-or-ids): the strings to tokenize, or the token ids given.
    InvalidRequestError naming `input` (or `input[i]`) for anything else."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise InvalidRequestError(f"{_INPUT_SHAPES}, got {json_type(value)}", "input")
    if not value:
        raise InvalidRequestError("'input' must not be empty", "input")
    if all(is_int(t) for t in value):  # one input of token ids
        value = [value]
    if len(value) > MAX_INPUTS:
        raise InvalidRequestError(f"'input' takes at most {MAX_INPUTS} inputs", "input")
    if isinstance(value[0], str):  # strings, all of them
        for i, text in enumerate(value):
            if not isinstance(text, str):
                raise InvalidRequestError(
                    f"{_INPUT_SHAPES}; input[{i}] is {json_type(text)} among strings",
                    f"input[{i}]",
                )
            if not text:
                raise InvalidRequestError(f"input[{i}] is an empty string", f"input[{i}]")
        return list(value), []
    ids: list[list[int]] = []
    for i, item in enumerate(value):
        if not isinstance(item, list) or not all(is_int(t) for t in item):
            raise InvalidRequestError(
                f"{_INPUT_SHAPES}; input[{i}] is {json_type(item)}", f"input[{i}]"
            )
        if not item:
            raise InvalidRequestError(f"input[{i}] has no token ids", f"input[{i}]")
        bad = [t for t in item if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"input[{i}] holds ids outside the vocabulary (0 to {vocab_size - 1}): {bad[:10]}",
                f"input[{i}]",
            )
        ids.append(list(item))
    return None, ids


def parse_options(body: dict[str, Any], hidden: int) -> tuple[str, int | None]:
    """`encoding_format` and `dimensions`, checked."""
    encoding = body.get("encoding_format")
    encoding = "float" if encoding is None else encoding
    if encoding not in ENCODINGS:
        raise InvalidRequestError(
            f"'encoding_format' must be 'float' or 'base64', got {encoding!r}", "encoding_format"
        )
    return encoding, parse_dimensions(body.get("dimensions"), hidden)


def parse_dimensions(dimensions: object, hidden: int) -> int | None:
    """`dimensions` checked: None, or from 1 to the model's embedding size."""
    if dimensions is not None and (not is_int(dimensions) or not 1 <= dimensions <= hidden):
        raise InvalidRequestError(
            f"'dimensions' must be an integer from 1 to {hidden} (the model's embedding size)",
            "dimensions",
        )
    return dimensions  # type: ignore[return-value]  (is_int checked it)


def truncated(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """`vector`'s leading `dimensions` components (Matryoshka truncation), normalized again
    when the model's vectors are; the whole vector without `dimensions`."""
    if dimensions is None or dimensions >= vector.shape[0]:
        return vector
    vector = vector[:dimensions]
    return F.normalize(vector, p=2.0, dim=0) if normalize else vector


def refuse_reranker(model: ServedModel, engine: ServingEngine) -> None:
    """A reranker's hidden states are not embeddings: 400 naming `model`."""
    if engine.task == "rerank":
        raise InvalidRequestError(
            f"model '{model.name}' is a reranker (its task is 'rerank'): use /v1/rerank "
            "or /v1/score",
            "model",
        )


def encoded(vector: torch.Tensor, encoding: str) -> list[float] | str:
    """One vector as OpenAI sends it: a list of floats, or base64 of its little-endian float32
    bytes (what the openai client asks for and decodes itself)."""
    if encoding == "base64":
        data = vector.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
        return base64.b64encode(data).decode("ascii")
    return vector.tolist()


async def tokenized(
    state: ServerState, engine: ServingEngine, texts: list[str], special: bool = True
) -> list[list[int]]:
    """`texts` as the model's tokenizer encodes them, with its special tokens added unless
    not `special` (on a thread)."""
    tokenizer = engine.tokenizer
    return await anyio.to_thread.run_sync(
        lambda: [list(x) for x in tokenizer(texts, add_special_tokens=special)["input_ids"]],
        limiter=state.tokenize_threads,
    )


async def pooled(
    request: Request, engine: ServingEngine, ids: list[list[int]]
) -> list[torch.Tensor] | None:
    """Each input's vector (the engine's embed), or None when the client left first (the inputs
    not yet pooled are dropped). Raises the engine's NeuronError."""
    vectors: list[torch.Tensor] = []
    failed: list[NeuronError] = []

    async def work() -> None:
        try:
            vectors.extend(await engine.embed(ids))
        except NeuronError as exc:  # (raised here, not out of the task group)
            failed.append(exc)

    if not await cancel_on_disconnect(request.receive, work):
        return None
    if failed:
        raise failed[0]
    return vectors


Handler = Callable[[Arrival], Awaitable[Response]]


async def pooling_route(
    request: Request, prefix: str, handle: Handler, named: Named | None = None
) -> Response:
    """A pooling endpoint's frame: the front door (its body read, given to the API's `named`,
    its model found and ready), then `handle`, whose NeuronError (a bad input, a full queue,
    a failed model) is answered as its ApiError; a refusal is counted and logged by the front
    door, an answer logged here with the route and the time it took."""
    own_id = f"{prefix}-{uuid.uuid4().hex}"
    async with front_door(request, own_id, named=named, logger=log) as arrival:
        try:
            response = await handle(arrival)
        except NeuronError as exc:
            raise api_error(exc) from None
    log.info(
        "request %s: %s, model %s, %.3f s",
        arrival.label,
        request.url.path,
        arrival.model.name,
        time.perf_counter() - arrival.started,
    )
    return response


async def embeddings(request: Request) -> Response:
    """{"model", "input", "encoding_format", "dimensions"} -> {"object": "list", "data":
    [{"object": "embedding", "index", "embedding"}], "model", "usage"}. `dimensions` keeps
    the leading components (Matryoshka truncation), normalized again when the model's vectors
    are."""

    async def handle(arrival: Arrival) -> Response:
        body, model, engine = arrival.body, arrival.model, arrival.engine
        refuse_reranker(model, engine)
        texts, ids = parse_inputs(body.get("input"), engine.vocab_size)
        encoding, dimensions = parse_options(body, engine.facts.hidden_size)
        if texts is not None:
            ids = await tokenized(arrival.context.state, engine, texts)
        vectors = await pooled(request, engine, ids)
        if vectors is None:
            return Response(status_code=499)
        normalize = engine.pooling.normalize
        data = []
        for i, vector in enumerate(vectors):
            vector = truncated(vector, dimensions, normalize)
            data.append({"object": "embedding", "index": i, "embedding": encoded(vector, encoding)})
        tokens = sum(len(x) for x in ids)
        out = {
            "object": "list",
            "data": data,
            "model": model.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return JSONResponse(out)

    return await pooling_route(request, "embd", handle)
