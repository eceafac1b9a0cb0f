"""POST /v1/score (vLLM's shape) and POST /v1/rerank (Jina's and Cohere's, as vLLM serves it):
each (query, document) pair's relevance. On an embedding model it is the cosine similarity of
their embeddings (a bi-encoder's); on a reranker (task "rerank", Qwen3-Reranker's format) it is
the probability of "yes" against "no" after a prompt holding both (a cross-encoder's). Either
way the texts go through the embedding batches."""

from __future__ import annotations

import time
import uuid
from typing import Any

import torch
import torch.nn.functional as F
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from neuronpy.engine.remote import ServingEngine
from neuronpy.errors import InvalidRequestError
from neuronpy.server.embeddings import MAX_INPUTS, pooled, pooling_route, tokenized
from neuronpy.server.front_door import Arrival
from neuronpy.server.models import ServedModel, ServerState
from neuronpy.server.schema import is_int, json_type


def _texts(value: object, name: str, *, single: bool = True) -> list[str]:
    """A field of one string or (unless not `single`) a non-empty array of strings."""
    if isinstance(value, str) and single:
        value = [value]
    kinds = "a string or an array of strings" if single else "an array of strings"
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(f"'{name}' must be {kinds}, got {json_type(value)}", name)
    if len(value) > MAX_INPUTS:
        raise InvalidRequestError(f"'{name}' takes at most {MAX_INPUTS} texts", name)
    out = []
    for i, text in enumerate(value):
        if isinstance(text, dict) and not single:  # Cohere's {"text": ...} documents
            text = text.get("text")
        if not isinstance(text, str) or not text:
            raise InvalidRequestError(f"{name}[{i}] must be a non-empty string", f"{name}[{i}]")
        out.append(text)
    return out


# Qwen3-Reranker's prompt (its model card's): the judgement asked in the system message, the
# instruction, query and document in the user message, an empty thinking block, then the answer
RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def rerank_prompt(query: str, document: str, instruction: str = RERANK_INSTRUCTION) -> str:
    """The prompt a reranker judges (query, document) by."""
    body = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    return f"{RERANK_PREFIX}{body}{RERANK_SUFFIX}"


def _scorer(model: ServedModel, engine: ServingEngine) -> None:
    """A 400 unless the model scores: an embedding model or a reranker (a generating model's
    hidden states were not trained to be compared)."""
    if engine.task not in ("embed", "rerank"):
        raise InvalidRequestError(
            f"model '{model.name}' generates (its task is '{engine.task}'); scores and "
            "reranking need an embedding model (task 'embed') or a reranker (task 'rerank')",
            "model",
        )


def _instruction(body: dict[str, Any]) -> str:
    value = body.get("instruction", RERANK_INSTRUCTION)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError("'instruction' must be a non-empty string", "instruction")
    return value


async def _similarities(
    request: Request,
    state: ServerState,
    engine: ServingEngine,
    left: list[str],
    right: list[str],
    instruction: str = RERANK_INSTRUCTION,
) -> tuple[list[float], int] | None:
    """Each pair left[i], right[i]'s score (a lone left text pairs with every right one),
    and the tokens pooled; None when the client left. An embedding model's is the cosine of
    the two embeddings; a reranker's the probability of "yes" after their prompt."""
    if engine.task == "rerank":
        queries = left * len(right) if len(left) == 1 else left
        prompts = [rerank_prompt(q, d, instruction) for q, d in zip(queries, right, strict=True)]
        ids = await tokenized(state, engine, prompts, special=False)
        logits = await pooled(request, engine, ids)
        if logits is None:
            return None
        yes = torch.softmax(torch.stack(logits), dim=-1)[:, 1]  # (RERANK_TOKENS: no, yes)
        return yes.tolist(), sum(len(x) for x in ids)
    ids = await tokenized(state, engine, [*left, *right])
    vectors = await pooled(request, engine, ids)
    if vectors is None:
        return None
    a = torch.stack(vectors[: len(left)])
    b = torch.stack(vectors[len(left) :])
    if len(left) == 1:
        a = a.expand(len(right), -1)
    scores = F.cosine_similarity(a, b, dim=-1)
    return scores.tolist(), sum(len(x) for x in ids)


async def score(request: Request) -> Response:
    """{"model", "text_1", "text_2"}: one text against each of a list, or two lists of one
    length pair by pair -> {"object": "list", "data": [{"index", "object": "score", "score"}],
    "model", "usage"}."""

    async def handle(arrival: Arrival) -> Response:
        body, model, engine = arrival.body, arrival.model, arrival.engine
        state = arrival.context.state
        _scorer(model, engine)
        left, right = _texts(body.get("text_1"), "text_1"), _texts(body.get("text_2"), "text_2")
        if len(left) > 1 and len(left) != len(right):
            raise InvalidRequestError(
                f"'text_2' must be as long as 'text_1' ({len(left)} texts) or 'text_1' one "
                f"text; it has {len(right)}",
                "text_2",
            )
        found = await _similarities(request, state, engine, left, right, _instruction(body))
        if found is None:
            return Response(status_code=499)
        scores, tokens = found
        out = {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": model.name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return JSONResponse(out)

    return await pooling_route(request, "score", handle)


async def rerank(request: Request) -> Response:
    """{"model", "query", "documents", "top_n", "return_documents"} -> {"id", "model",
    "usage", "results": [{"index", "relevance_score", "document": {"text"}}]}, the most
    relevant first (the `top_n` of them), each document's `index` its place in `documents`."""

    async def handle(arrival: Arrival) -> Response:
        body, model, engine = arrival.body, arrival.model, arrival.engine
        state = arrival.context.state
        _scorer(model, engine)
        query = body.get("query")
        if not isinstance(query, str) or not query:
            raise InvalidRequestError(
                f"'query' must be a non-empty string, got {json_type(query)}", "query"
            )
        documents = _texts(body.get("documents"), "documents", single=False)
        top_n = body.get("top_n")
        if top_n is not None and (not is_int(top_n) or top_n < 1):
            raise InvalidRequestError("'top_n' must be an integer >= 1", "top_n")
        keep = body.get("return_documents", True)
        if not isinstance(keep, bool):
            raise InvalidRequestError("'return_documents' must be a boolean", "return_documents")
        found = await _similarities(request, state, engine, [query], documents, _instruction(body))
        if found is None:
            return Response(status_code=499)
        scores, tokens = found
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[: top_n or len(documents)]
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if keep:
                result["document"] = {"text": documents[i]}
            results.append(result)
        out = {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": model.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results,
        }
        return JSONResponse(out)

    return await pooling_route(request, "rerank", handle)
