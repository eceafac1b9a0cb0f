"""Ollama's API: /api/chat and /api/generate (streamed as NDJSON by default, or whole with
`stream: false`), /api/embed (and the older /api/embeddings), /api/tags, /api/show, /api/ps,
/api/version. A translation over the chat and completions path: each request becomes the
request it means, admitted by `admit()` as every API's is, and its events become Ollama's
chunks, with the counts and durations (nanoseconds) Ollama reports. Errors are
`{"error": "..."}` (errors.py)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from neuronpy.engine.reasoning import resolve_reasoning_parser
from neuronpy.engine.remote import ServingEngine
from neuronpy.engine.types import FinishReason, GenerationEvent
from neuronpy.errors import InvalidRequestError
from neuronpy.jsontext import one_line
from neuronpy.server.context import route_context
from neuronpy.server.copies import (
    Copy,
    Events,
    gather_one,
    refused_before_output,
    stream,
    until_finished,
)
from neuronpy.server.embeddings import (
    parse_dimensions,
    parse_inputs,
    pooled,
    pooling_route,
    refuse_reranker,
    tokenized,
    truncated,
)
from neuronpy.server.errors import ApiError, api_error, failure
from neuronpy.server.flow import admit
from neuronpy.server.front_door import Arrival, front_door, read_body_and_model
from neuronpy.server.logprobs import TokenTexts, token_texts
from neuronpy.server.models import ServedModel, ServerState
from neuronpy.server.ollama_api.protocol import (
    OllamaBase,
    OllamaChatRequest,
    OllamaGenerateRequest,
    model_name,
    parse,
    tagged,
)
from neuronpy.server.requests import requested_model
from neuronpy.server.responses import Reply
from neuronpy.server.schema import json_type

log = logging.getLogger(__name__)

# The Ollama API version whose shapes these routes follow (what /api/version says: clients
# check it before using a feature)
OLLAMA_VERSION = "0.12.0"
NDJSON = [(b"content-type", b"application/x-ndjson"), (b"cache-control", b"no-cache")]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _named(body: object) -> dict[str, Any]:
    """The body with its `model` as the served model's name (`NAME:latest` is NAME)."""
    model = requested_model(body)
    if not model:
        raise ApiError(400, "'model' is required: the served model's name", param="model")
    assert isinstance(body, dict)
    return {**body, "model": model_name(model)}


@dataclass
class Timing:
    """When a request arrived, got its first token and ended: Ollama's durations."""

    started: float = field(default_factory=time.perf_counter)
    first: float | None = None

    def token(self) -> None:
        """A token came (the first one ends the prompt's evaluation)."""
        if self.first is None:
            self.first = time.perf_counter()

    def stats(self, last: GenerationEvent | None) -> dict[str, Any]:
        end = time.perf_counter()
        first = self.first if self.first is not None else end
        ns = 1_000_000_000
        reason = None
        if last is not None and last.finish_reason is not None:
            reason = "length" if last.finish_reason is FinishReason.LENGTH else "stop"
        return {
            "done_reason": reason,
            "total_duration": int((end - self.started) * ns),
            "load_duration": 0,  # (the model stays loaded)
            "prompt_eval_count": last.prompt_tokens if last is not None else 0,
            "prompt_eval_duration": int((first - self.started) * ns),
            "eval_count": last.completion_tokens if last is not None else 0,
            "eval_duration": int((end - first) * ns),
        }


@dataclass
class Shape:
    """Where a chunk puts its text: /api/chat's `message`, /api/generate's `response`."""

    chat: bool
    thinking: bool  # whether reasoning is answered (`think`)

    def chunk(self, model: str, text: str, reasoning: str, calls: list[dict[str, Any]]) -> dict:
        out: dict[str, Any] = {"model": model, "created_at": _now()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning and self.thinking:
                message["thinking"] = reasoning
            if calls:
                message["tool_calls"] = calls
            out["message"] = message
        else:
            out["response"] = text
            if reasoning and self.thinking:
                out["thinking"] = reasoning
        out["done"] = False
        return out


def _logprobs(events: list[GenerationEvent], texts: TokenTexts | None) -> dict[str, Any]:
    """The events' tokens' log-probabilities as Ollama gives them (asked with `logprobs`)."""
    if texts is None:
        return {}
    out = []
    for event in events:
        for lp in event.logprobs:
            top = [{"token": texts(i)[0], "logprob": v} for i, v in lp.top]
            out.append({"token": texts(lp.token_id)[0], "logprob": lp.logprob, "top_logprobs": top})
    return {"logprobs": out} if out else {}


def _calls(event: GenerationEvent) -> list[dict[str, Any]]:
    calls = []
    for call in event.tool_calls:
        try:
            arguments = json.loads(call.arguments or "{}")
        except ValueError:
            arguments = {}
        calls.append({"function": {"name": call.name, "arguments": arguments, "index": call.index}})
    return calls


async def _generate(request: Request, chat: bool) -> Response:
    """/api/chat (`chat`) or /api/generate: the request translated into the chat or
    completions request it means, admitted, then streamed as NDJSON or answered whole."""
    async with front_door(
        request, f"ollama-{uuid.uuid4().hex}", named=_named, logger=log
    ) as arrival:
        body, model = arrival.body, arrival.model
        kind = OllamaChatRequest if chat else OllamaGenerateRequest
        try:
            req: OllamaBase = parse(kind, body)
            if not chat and not req.prompt:  # type: ignore[attr-defined]
                # Ollama's way to load a model: an empty prompt is answered at once
                done = {"model": body["model"], "created_at": _now(), "response": ""}
                return JSONResponse({**done, "done": True, "done_reason": "load"})
            translated = req.chat() if chat else req.request()  # type: ignore[attr-defined]
        except InvalidRequestError as exc:
            raise api_error(exc) from None
        admitted = await admit(request.receive, model, translated, label=arrival.label)
        if admitted is None:
            return Response(status_code=499)
        ((stream_,),) = admitted.groups
    engine, metrics = arrival.engine, arrival.context.metrics
    timing = Timing(arrival.started)
    log.info(
        "request %s: model %s, %d prompt tokens (ollama %s)",
        arrival.label,
        model.name,
        len(admitted.prompts[0]),
        "chat" if chat else "generate",
    )
    reply = Reply("chat" if chat or not getattr(req, "raw", False) else "text", model.name)
    counted = metrics.admit(model.name, timing.started, stream_)

    def observe(event: GenerationEvent) -> None:
        counted(event)
        if event.token_ids:
            timing.token()

    copy = Copy(stream_, reply, observe)
    shape = Shape(chat, req.shows_thinking)
    name = body["model"]
    texts = token_texts(engine.tokenizer) if req.logprobs else None
    if req.stream:
        return _Streamed(copy, shape, engine, name, timing, texts)  # type: ignore[return-value]
    events = await gather_one(request.receive, copy, engine)
    if events is None:
        return Response(status_code=499)  # nobody is listening
    last = events[-1] if events else None
    text = "".join(e.text for e in events)
    reasoning = "".join(e.reasoning for e in events)
    calls = [c for e in events for c in _calls(e)]
    whole = shape.chunk(name, text, reasoning, calls)
    return JSONResponse({**whole, **_logprobs(events, texts), "done": True, **timing.stats(last)})


class _Streamed:
    """NDJSON: a chunk per event with text (or tool calls), then the last chunk with `done`
    and the counts. A request that never ran gets a real HTTP error; a failure after the
    stream started is a last `{"error": ...}` line (the ollama client raises it)."""

    def __init__(
        self,
        copy: Copy,
        shape: Shape,
        engine: ServingEngine,
        model: str,
        timing: Timing,
        texts: TokenTexts | None,
    ) -> None:
        self.copy, self.shape, self.engine = copy, shape, engine
        self.model, self.timing, self.texts = model, timing, texts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await stream(receive, [self.copy], lambda events: self._write(events, scope, receive, send))

    async def _write(self, events: Events, scope: Scope, receive: Receive, send: Send) -> None:
        _, first = await anext(events)
        if await refused_before_output(first, self.engine, scope, receive, send):
            return
        await send({"type": "http.response.start", "status": 200, "headers": NDJSON})
        last = None
        async for event in until_finished(events, first):
            last = event
            calls = _calls(event)
            shown = event.reasoning and self.shape.thinking
            if event.text or calls or shown or (self.texts and event.logprobs):
                chunk = self.shape.chunk(self.model, event.text, event.reasoning, calls)
                await _line(send, {**chunk, **_logprobs([event], self.texts)})
        error = failure(last, self.engine)
        if error is not None:
            await _line(send, {"error": error.named_message()})
        else:
            done = self.shape.chunk(self.model, "", "", [])
            await _line(send, {**done, "done": True, **self.timing.stats(last)})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _line(send: Send, value: dict[str, Any]) -> None:
    body = (one_line(value) + "\n").encode()
    await send({"type": "http.response.body", "body": body, "more_body": True})


async def chat(request: Request) -> Response:
    """POST /api/chat."""
    return await _generate(request, chat=True)


async def generate(request: Request) -> Response:
    """POST /api/generate."""
    return await _generate(request, chat=False)


# ---- embeddings ---------------------------------------------------------------------------------


async def embed(request: Request) -> Response:
    """/api/embed: {"model", "input": text or texts, "dimensions", "truncate"} -> {"model",
    "embeddings": [[...]], "prompt_eval_count", durations}."""
    return await _pooling(request, legacy=False)


async def embeddings(request: Request) -> Response:
    """/api/embeddings (Ollama's older route): {"model", "prompt"} -> {"embedding": [...]}."""
    return await _pooling(request, legacy=True)


async def _pooling(request: Request, legacy: bool) -> Response:
    async def handle(arrival: Arrival) -> Response:
        body, engine = arrival.body, arrival.engine
        refuse_reranker(arrival.model, engine)
        truncate = body.get("truncate")
        if truncate is not None and not isinstance(truncate, bool):
            # (either way an input longer than the context is refused, never cut short)
            raise InvalidRequestError(
                f"'truncate' must be true or false, got {json_type(truncate)}", "truncate"
            )
        texts, ids = parse_inputs(body.get("prompt" if legacy else "input"), engine.vocab_size)
        dimensions = parse_dimensions(body.get("dimensions"), engine.facts.hidden_size)
        if texts is not None:
            ids = await tokenized(arrival.context.state, engine, texts)
        vectors = await pooled(request, engine, ids)
        if vectors is None:
            return Response(status_code=499)
        normalize = engine.pooling.normalize
        out = [truncated(vector, dimensions, normalize).tolist() for vector in vectors]
        if legacy:
            return JSONResponse({"embedding": out[0]})
        ns = int((time.perf_counter() - arrival.started) * 1_000_000_000)
        return JSONResponse(
            {
                "model": body["model"],
                "embeddings": out,
                "total_duration": ns,
                "load_duration": 0,
                "prompt_eval_count": sum(len(x) for x in ids),
            }
        )

    return await pooling_route(request, "ollama-embd", handle, named=_named)


# ---- models -------------------------------------------------------------------------------------


def _details(engine: ServingEngine) -> dict[str, Any]:
    """Ollama's `details`: the family, and the checkpoint's size and storage as its file
    says (a GGUF file's general.file_type, "Q4_1"; a safetensors model's dtype, "BF16")."""
    facts = engine.facts
    details: dict[str, Any] = {
        "parent_model": "",
        "family": facts.model_type,
        "families": [facts.model_type],
        "parameter_size": parameter_size(facts.parameters) if facts.parameters else "",
        "quantization_level": facts.file_type or engine.config.quantize,
    }
    return details


def parameter_size(count: int) -> str:
    """A parameter count as Ollama writes it: "134.52M", "1.2B"."""
    if count >= 1_000_000_000:
        return f"{count / 1e9:.1f}B"
    if count >= 1_000_000:
        return f"{count / 1e6:.2f}M"
    return f"{count / 1e3:.2f}K"


def _listed(
    state: ServerState, each: Callable[[ServedModel, ServingEngine], dict[str, Any]]
) -> list:
    out = []
    for model in state.models.values():
        if model.state == "ready" and model.engine is not None:
            out.append(each(model, model.engine))
    return out


async def tags(request: Request) -> Response:
    """/api/tags: the models ready to serve, as Ollama lists its local models."""
    state = route_context(request).state
    modified = datetime.fromtimestamp(state.started, timezone.utc).isoformat()

    def each(model: ServedModel, engine: ServingEngine) -> dict[str, Any]:
        name = tagged(model.name)
        return {
            "name": name,
            "model": name,
            "modified_at": modified,
            "size": engine.facts.weight_bytes,
            "digest": engine.fingerprint,
            "details": _details(engine),
        }

    return JSONResponse({"models": _listed(state, each)})


async def ps(request: Request) -> Response:
    """/api/ps: the models in memory (all those served, as long as the server runs)."""
    state = route_context(request).state

    def each(model: ServedModel, engine: ServingEngine) -> dict[str, Any]:
        name = tagged(model.name)
        size = engine.facts.weight_bytes
        return {
            "name": name,
            "model": name,
            "size": size,
            "digest": engine.fingerprint,
            "details": _details(engine),
            "expires_at": "9999-12-31T23:59:59Z",  # (kept while the server runs)
            "size_vram": size if engine.facts.device != "cpu" else 0,
            "context_length": engine.context_len,
        }

    return JSONResponse({"models": _listed(state, each)})


async def show(request: Request) -> Response:
    """/api/show: one model's details, template, context length and capabilities."""
    context = route_context(request)
    state = context.state
    _, model = await read_body_and_model(request, context, _named)
    engine = model.ready_engine()
    capabilities = ["embedding"] if engine.task == "embed" else ["completion"]
    if engine.task == "generate":
        capabilities.append("tools")  # (shown in the generic format where the template cannot)
        if resolve_reasoning_parser(engine.config.reasoning_parser, engine.tokenizer):
            capabilities.append("thinking")
        if getattr(engine, "processor", None) is not None:
            capabilities.append("vision")
    family = engine.facts.model_type
    template = getattr(engine.tokenizer, "chat_template", None) or ""
    return JSONResponse(
        {
            "modelfile": f"# served by neuronpy\nFROM {model.name}\n",
            "parameters": "",
            "template": template if isinstance(template, str) else "",
            "details": _details(engine),
            "model_info": {
                "general.architecture": family,
                f"{family}.context_length": engine.context_len,
                f"{family}.embedding_length": engine.facts.hidden_size,
                "general.parameter_count": engine.facts.parameters or None,
                "general.file_type": engine.facts.file_type or None,
            },
            "capabilities": capabilities,
            "modified_at": datetime.fromtimestamp(state.started, timezone.utc).isoformat(),
        }
    )


async def version(request: Request) -> Response:
    return JSONResponse({"version": OLLAMA_VERSION})


# Ollama's routes, as the app mounts them
ROUTES = [
    Route("/api/chat", chat, methods=["POST"]),
    Route("/api/generate", generate, methods=["POST"]),
    Route("/api/embed", embed, methods=["POST"]),
    Route("/api/embeddings", embeddings, methods=["POST"]),
    Route("/api/show", show, methods=["POST"]),
    Route("/api/tags", tags, methods=["GET"]),
    Route("/api/ps", ps, methods=["GET"]),
    Route("/api/version", version, methods=["GET"]),
]
