"""A generation request's flow, for any n: validate, admit its copies, then stream or gather."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive
from transformers import PreTrainedTokenizerBase

from neuronpy.engine.reasoning import resolve_reasoning_parser
from neuronpy.engine.remote import ServingEngine
from neuronpy.engine.sessions import valid_name
from neuronpy.engine.stream import RequestStream
from neuronpy.engine.tools import HERMES, resolve_tool_format
from neuronpy.engine.types import SamplingParams, SessionRequest
from neuronpy.errors import InvalidRequestError, NeuronError
from neuronpy.server.chat_input import ChatInput
from neuronpy.server.copies import Copy, cancel_on_disconnect, gather, usage_of
from neuronpy.server.errors import ApiError, api_error, failure
from neuronpy.server.front_door import front_door
from neuronpy.server.image_urls import fetch_remote_images
from neuronpy.server.logprobs import token_texts
from neuronpy.server.models import ServedModel
from neuronpy.server.protocol import ChatCompletionRequest, SamplingRequest
from neuronpy.server.requests import Kind, parse_request
from neuronpy.server.responses import SESSION_ERROR_HEADER, Reply, header_text
from neuronpy.server.sessions import session_request
from neuronpy.server.stream import EventStreamResponse

log = logging.getLogger(__name__)


async def chat_completions(request: Request) -> Response | EventStreamResponse:
    """POST /v1/chat/completions."""
    return await generate(request, "chat")


async def completions(request: Request) -> Response | EventStreamResponse:
    """POST /v1/completions."""
    return await generate(request, "text")


async def generate(request: Request, kind: Kind) -> Response | EventStreamResponse:
    """Validate, tokenize and admit the request's n copies (any failure is an error response
    and admits nothing), then stream or gather them; a client that disconnects cancels them.
    With sessions on, the context's `session_header` names the session of a request whose
    body names none."""
    completion_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    async with front_door(request, completion_id, logger=log) as arrival:
        context = arrival.context
        store, header = context.sessions, context.session_header
        req = parse_request(kind, arrival.body)
        if store is not None and header:
            req = session_from_header(req, request.headers.get(header), header)
        admitted = await admit(
            request.receive,
            arrival.model,
            req,
            lambda engine: session_request(store, engine, req),
            label=arrival.label,
        )
        if admitted is None:
            return Response(status_code=499)  # it left while its constraint compiled
    model, engine, metrics = arrival.model, arrival.engine, context.metrics
    n = req.copies
    log.info(
        "request %s: model %s, %s prompt tokens, n=%d%s",
        arrival.label,
        model.name,
        "+".join(str(len(ids)) for ids in admitted.prompts),
        n,
        ", streamed" if req.streamed else "",
    )
    texts = token_texts(engine.tokenizer) if admitted.params.logprobs is not None else None
    reply = Reply(kind, model.name, include_usage=req.include_usage, id=completion_id, texts=texts)
    # choice prompt * n + copy; each copy counts as an admitted request, its prompt once
    copies = [
        Copy(
            stream,
            dataclasses.replace(reply, index=p * n + i),
            metrics.admit(model.name, arrival.started, stream),
            counts_prompt=i == 0,
        )
        for p, streams in enumerate(admitted.groups)
        for i, stream in enumerate(streams)
    ]
    if req.streamed:
        return EventStreamResponse(copies, engine)
    return await _gather(request, copies, engine)


def session_from_header(req: SamplingRequest, value: str | None, header: str) -> SamplingRequest:
    """`req` with the session its `header` names (continued, then saved), where the body names
    none and the request can have one (one prompt, n = 1); else `req` as it is (the header
    was then only a router's affinity key). A value that is not a session name is a 400
    naming the header."""
    if value is None or req.session is not None or req.copies != 1 or req.prompt_count != 1:
        return req
    if not valid_name(value):
        raise ApiError(
            400,
            f"the {header} header names the request's session (sessions are on): it must be "
            "1-128 letters, digits and . _ - starting with a letter or digit, without '..'",
            param=header,
        )
    return req.model_copy(update={"session": (value, True)})


@dataclass(frozen=True)
class Admitted:
    """A request in the engine: each prompt's token ids and its n streams, prompt by prompt;
    `params`, the first prompt's sampling (the others' differ only in max_tokens' default)."""

    prompts: list[list[int]]
    params: SamplingParams
    groups: list[list[RequestStream]]


async def admit(
    receive: Receive,
    model: ServedModel,
    req: SamplingRequest,
    session: Callable[[ServingEngine], Awaitable[SessionRequest | None]] | None = None,
    label: str | None = None,
) -> Admitted | None:
    """The one way a generation request enters the engine, whatever API it came by: its
    tools checked against the template, its prompts rendered (on threads), its sampling
    settled for each, its session opened (`session`, given the engine), then every prompt's
    n copies admitted, or none of them, each labelled `label` (the request id its client and
    the log see; `label#k` for the k-th of several) for the batch view. Errors are ApiErrors
    naming the request's own fields (its `param_names`); None: the client left while its
    constraints compiled."""
    engine = model.ready_engine()
    if engine.task != "generate":
        use = "/v1/embeddings" if engine.task == "embed" else "/v1/rerank or /v1/score"
        raise ApiError(
            400,
            f"model '{model.name}' does not generate (its task is '{engine.task}'): use "
            f'{use}, or serve it with task = "generate"',
            param="model",
        )
    reasoning = resolve_reasoning_parser(engine.config.reasoning_parser, engine.tokenizer)
    tools = resolve_tool_format(engine.config.tool_call_parser, engine.tokenizer).name
    if isinstance(req, ChatCompletionRequest) and req.chat_tools.tools and not model.renders_tools:
        req.show_tools_generically()  # (its calls in the generic format: Hermes' markup)
        tools = HERMES.name
    if model.image_urls and isinstance(req, ChatInput) and req.has_images:
        try:
            await fetch_remote_images(req)
        except InvalidRequestError as exc:
            raise api_error(exc) from None
    prompts = [
        await anyio.to_thread.run_sync(
            prompt_ids, req, engine.tokenizer, i, getattr(engine, "processor", None)
        )
        for i in range(req.prompt_count)
    ]
    n = req.copies
    # (one prompt: the engine's own check names n)
    if len(prompts) > 1 and len(prompts) * n > engine.max_running + engine.config.max_queue:
        raise ApiError(
            400,
            f"{len(prompts)} prompts x n = {n} completions can never be admitted "
            f"together: model '{model.name}' runs {engine.max_running} and queues "
            f"{engine.config.max_queue}",
            param="prompt",
        )
    plans = [
        (ids, req.sampling_params(len(ids), engine.context_len, reasoning, tools))
        for ids in prompts
    ]
    opened = None if session is None else await session(engine)
    groups = await _admit(receive, engine, plans, n, opened, req.param_names, label)
    if groups is None:
        return None
    return Admitted(prompts, plans[0][1], groups)


def prompt_ids(
    req: SamplingRequest, tokenizer: PreTrainedTokenizerBase, index: int, processor: Any = None
) -> list[int]:
    """The request's prompt `index` as token ids (blocking: run it in a thread); a 400 when
    it cannot be encoded. `processor`: a vision-language model's (its images' media)."""
    try:
        return req.prompt_ids(tokenizer, index, processor)
    except InvalidRequestError as exc:
        raise api_error(exc) from None


async def _admit(
    receive: Receive,
    engine: ServingEngine,
    plans: Sequence[tuple[list[int], SamplingParams]],
    n: int,
    session: SessionRequest | None,
    names: dict[str, str],
    label: str | None = None,
) -> list[list[RequestStream]] | None:
    """Each prompt's n copies admitted, or none of them: every prompt is checked first, and a
    refusal at admission (a full queue) cancels those admitted before it. None: the client
    left while the constraints compiled. Each copy is labelled `label` when it is the only
    one, else `label#k` for the k-th of all prompts' copies."""
    total = len(plans) * n
    labels = [label if label is None or total == 1 else f"{label}#{k}" for k in range(total)]
    groups: list[list[RequestStream]] = []
    try:
        for ids, params in plans:
            engine.validate(ids, params)
        if not await prepare_while_connected(receive, engine, plans):
            return None
        for i, (ids, params) in enumerate(plans):
            copies = labels[i * n : (i + 1) * n]
            groups.append(engine.submit_many(ids, params, n, session, labels=copies))
    except NeuronError as exc:
        for stream in (s for group in groups for s in group):
            stream.cancel()
        raise api_error(exc, names) from None
    return groups


async def prepare_while_connected(
    receive: Receive, engine: ServingEngine, plans: Sequence[tuple[Sequence[int], SamplingParams]]
) -> bool:
    """Compiles the plans' constraints (the engine's prepare, on threads) while the client is there:
    False when it disconnects first, which stops a compile no other request waits for. Its
    errors (NeuronError) are raised. The request's body must have been read."""
    failed: list[NeuronError] = []

    async def prepare() -> None:
        try:
            for ids, params in plans:
                await engine.prepare(ids, params)
        except NeuronError as exc:
            failed.append(exc)

    connected = await cancel_on_disconnect(receive, prepare)
    if failed:
        raise failed[0]
    return connected


async def _gather(request: Request, copies: Sequence[Copy], engine: ServingEngine) -> Response:
    """A non-streamed request: every copy gathered, one choice each; the usage counts each
    prompt once and every copy's tokens. A disconnect cancels every copy."""
    events = await gather(request.receive, copies)
    if events is None:
        return Response(status_code=499)  # nobody is listening
    for copy in copies:  # the first copy that did not finish answers for the request
        error = failure(copy.last, engine)
        if error is not None:
            raise error
    choices = [copy.reply.choice(evs) for copy, evs in zip(copies, events, strict=True)]
    totals = usage_of(copies)
    # a session that could not be saved does not discard the reply: it is said beside it
    lost = [c.last.session_error for c in copies if c.last is not None and c.last.session_error]
    session_error = lost[0] if lost else None
    headers = {SESSION_ERROR_HEADER: header_text(session_error)} if session_error else None
    return JSONResponse(copies[0].reply.body(choices, totals, session_error), headers=headers)
