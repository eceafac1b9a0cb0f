"""A prompt as token ids: chat messages and tools (chat_input.py's view of them) through the
model's chat template, or text encoded. Errors are InvalidRequestError naming the field (the
HTTP layer makes them 400s)."""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from neuronpy.errors import InvalidRequestError


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of `messages` (and `tools`, for a template that writes them) through the
    model's own chat template, which transformers renders in a sandboxed Jinja environment.
    Control tokens inside messages and tools are encoded as plain text, so a user cannot forge
    a turn. A template never comes from the request."""
    if not tokenizer.chat_template:
        raise InvalidRequestError(
            "this model has no chat template; use /v1/completions", "messages"
        )
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            sanitize_control_tokens=True,
        )
    except TemplateError as exc:  # the template rejected the conversation (raise_exception)
        raise InvalidRequestError(
            f"the chat template rejected the messages: {exc}", "messages"
        ) from None
    except ValueError as exc:  # a control token in a message that cannot be written as text
        raise InvalidRequestError(f"the messages cannot be encoded: {exc}", "messages") from None
    return list(ids)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | list[int]) -> list[int]:
    """A completions prompt as token ids: a string through the tokenizer, ids as given."""
    return list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)


PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe",
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {}},
    },
}


def template_renders_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the model's chat template writes the tools it is given into the prompt (some
    drop them silently: SmolLM2's). Blocking: run it in a thread."""
    messages = [{"role": "user", "content": "Hi"}]
    try:
        return render_chat(tokenizer, messages) != render_chat(tokenizer, messages, [PROBE_TOOL])
    except InvalidRequestError:
        return False
