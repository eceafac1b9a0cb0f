"""A generation request's flow, for any n: validate, admit its copies, then stream or gather."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from neuronpy.engine.engine import Engine
from neuronpy.engine.reasoning import resolve_reasoning_parser
from neuronpy.engine.sessions import SessionStore
from neuronpy.engine.types import GenerationEvent
from neuronpy.errors import NeuronError
from neuronpy.server.copies import Copy, cancel_on_disconnect, merged
from neuronpy.server.errors import ApiError, api_error, failure
from neuronpy.server.logprobs import token_texts
from neuronpy.server.metrics import ServerMetrics
from neuronpy.server.models import ServedModel, ServerState
from neuronpy.server.requests import (
    BodyLimits,
    Kind,
    parse_request,
    read_json,
    requested_model,
)
from neuronpy.server.responses import SESSION_ERROR_HEADER, Reply, header_text, usage
from neuronpy.server.sessions import session_request
from neuronpy.server.stream import EventStreamResponse


async def generate(
    request: Request,
    state: ServerState,
    kind: Kind,
    limits: BodyLimits,
    metrics: ServerMetrics,
    store: SessionStore | None = None,
) -> Response | EventStreamResponse:
    """Validate, tokenize and admit the request's n copies (any failure is an error response
    and admits nothing), then stream or gather them; a client that disconnects cancels them."""
    started = time.perf_counter()
    model: ServedModel | None = None
    try:
        body = await read_json(request, limits)
        model = state.find(requested_model(body))
        engine = model.ready_engine()
        req = parse_request(kind, body)
        prompt_ids = await anyio.to_thread.run_sync(req.prompt_ids, engine.tokenizer)
        reasoning = resolve_reasoning_parser(engine.config.reasoning_parser, engine.tokenizer)
        params = req.sampling_params(len(prompt_ids), engine.context_len, reasoning)
        session = await session_request(store, engine, req)
        try:
            await engine.prepare(prompt_ids, params)  # a constraint's grammar, on a thread
            streams = engine.submit_many(prompt_ids, params, req.n, session)
        except NeuronError as exc:
            raise api_error(exc, req.param_names) from None
    except ApiError as exc:
        metrics.reject(model, exc)
        raise
    texts = token_texts(engine.tokenizer) if params.logprobs is not None else None
    reply = Reply(kind, model.name, include_usage=req.include_usage, texts=texts)
    copies = [  # copy i renders choice i; each copy counts as an admitted request
        Copy(stream, dataclasses.replace(reply, index=i), metrics.admit(model.name, started))
        for i, stream in enumerate(streams)
    ]
    if req.stream:
        return EventStreamResponse(copies, engine)
    return await _gather(request, copies, engine)


async def _gather(request: Request, copies: Sequence[Copy], engine: Engine) -> Response:
    """A non-streamed request: every copy gathered, one choice each; the usage counts the
    prompt once and every copy's tokens. A disconnect cancels every copy."""
    events: list[list[GenerationEvent]] = [[] for _ in copies]

    async def collect() -> None:
        async with merged(copies) as merged_events:
            async for copy, event in merged_events:
                if event is not None:
                    events[copy.reply.index].append(event)

    if not await cancel_on_disconnect(request.receive, collect):
        return Response(status_code=499)  # nobody is listening
    for copy in copies:  # the first copy that did not finish answers for the request
        error = failure(copy.last, engine)
        if error is not None:
            raise error
    choices = [copy.reply.choice(evs) for copy, evs in zip(copies, events, strict=True)]
    completion = sum(copy.last.completion_tokens for copy in copies if copy.last is not None)
    first = copies[0].stream
    totals = usage(first.prompt_tokens, completion, first.cached_tokens)
    # a session that could not be saved does not discard the reply: it is said beside it
    lost = [c.last.session_error for c in copies if c.last is not None and c.last.session_error]
    session_error = lost[0] if lost else None
    headers = {SESSION_ERROR_HEADER: header_text(session_error)} if session_error else None
    return JSONResponse(copies[0].reply.body(choices, totals, session_error), headers=headers)
