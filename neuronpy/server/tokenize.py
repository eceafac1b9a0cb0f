"""/tokenize and /detokenize, in vLLM's shapes: a prompt (or chat messages, through the
model's template) as token ids, and token ids as text."""

from __future__ import annotations

from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse

from neuronpy.errors import InvalidRequestError
from neuronpy.media import media_of, text_ids
from neuronpy.server.chat_input import ChatInput
from neuronpy.server.context import route_context
from neuronpy.server.errors import ApiError, api_error
from neuronpy.server.front_door import read_body_and_model
from neuronpy.server.image_urls import fetch_remote_images
from neuronpy.server.prompts import render_chat
from neuronpy.server.schema import WireModel, is_int, validate

MAX_DETOKENIZE = 1 << 20  # token ids one request may send


class TokenizeText(WireModel):
    prompt: str
    add_special_tokens: bool = True


async def tokenize(request: Request) -> JSONResponse:
    """{"model", "prompt", "add_special_tokens"} or {"model", "messages", "tools"} ->
    {"tokens", "count", "max_model_len"} (chat messages: exactly the prompt a chat request
    with them would prefill)."""
    context = route_context(request)
    state = context.state
    body, model = await read_body_and_model(request, context)
    engine = model.ready_engine()
    tokenizer = engine.tokenizer
    try:
        if body.get("messages") is not None:
            chat = validate(ChatInput, body)
            processor = getattr(engine, "processor", None)
            chat.check_images(processor)
            if model.image_urls and chat.has_images:
                await fetch_remote_images(chat)

            def render() -> list[int]:
                messages = chat.template_messages(processor is not None)
                pictures = chat.pictures() if chat.has_images else []
                tools = chat.chat_tools.tools
                ids = render_chat(tokenizer, messages, tools, None, False, pictures, processor)
                # (an image's tokens as its placeholder token, as the model's processor writes)
                prompt = chat.with_images(ids, tokenizer, processor)
                media = media_of(prompt)
                return text_ids(prompt, media[0].placeholder if media else 0)

            ids = await anyio.to_thread.run_sync(render, limiter=state.tokenize_threads)
        else:
            if not isinstance(body.get("prompt"), str):
                raise InvalidRequestError(
                    "'prompt' must be a string (or give 'messages')", "prompt"
                )
            text = validate(TokenizeText, body)
            ids = await anyio.to_thread.run_sync(
                lambda: tokenizer.encode(text.prompt, add_special_tokens=text.add_special_tokens),
                limiter=state.tokenize_threads,
            )
    except InvalidRequestError as exc:
        raise api_error(exc) from None
    out = {"tokens": list(ids), "count": len(ids), "max_model_len": engine.context_len}
    return JSONResponse(out)


async def detokenize(request: Request) -> JSONResponse:
    """{"model", "tokens": [ids]} -> {"prompt": text}; ids outside the vocabulary are a 400."""
    context = route_context(request)
    state = context.state
    body, model = await read_body_and_model(request, context)
    engine = model.ready_engine()
    tokens: Any = body.get("tokens")
    if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
        raise ApiError(400, "'tokens' must be a list of token ids", param="tokens")
    if len(tokens) > MAX_DETOKENIZE:
        raise ApiError(400, f"'tokens' takes at most {MAX_DETOKENIZE} ids", param="tokens")
    bad = [t for t in tokens if not 0 <= t < engine.vocab_size]
    if bad:
        raise ApiError(
            400,
            f"'tokens' holds ids outside the vocabulary (0 to {engine.vocab_size - 1}): {bad[:10]}",
            param="tokens",
        )
    text = await anyio.to_thread.run_sync(
        lambda: engine.tokenizer.decode(tokens), limiter=state.tokenize_threads
    )
    return JSONResponse({"prompt": text})
