"""A prompt as token ids: chat messages and tools (chat_input.py's view of them) through the
model's chat template, or text encoded. Errors are InvalidRequestError naming the field (the
HTTP layer makes them 400s)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from neuronpy.errors import InvalidRequestError


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    continue_final: bool = False,
    images: Sequence[Any] = (),
    processor: Any = None,
) -> list[int]:
    """Token ids of `messages` (and `tools`, for a template that writes them) through the
    model's own chat template, which transformers renders in a sandboxed Jinja environment.
    Control tokens inside messages and tools are encoded as plain text, so a user cannot forge
    a turn. A template never comes from the request; `template_kwargs` (checked by
    check_template_kwargs) are variables it may read, such as Qwen3's `enable_thinking`.
    `continue_final`: the last message (the assistant's) is left open for the model to go on
    with, instead of a new assistant turn after it. `images` (PIL images, one per image part,
    in order) with a vision-language model's `processor`: the model's processor renders and
    tokenizes the whole conversation, its images' placeholders written as it writes them,
    where it can encode control tokens as text (else the template's tokens, each image part
    its marker: server/images.py expands those)."""
    if images and processor is not None:
        expanded = _processor_rendered(
            processor, messages, images, tools, template_kwargs, continue_final
        )
        if expanded is not None:
            return expanded
    if not tokenizer.chat_template:
        raise InvalidRequestError(
            "this model has no chat template; use /v1/completions", "messages"
        )
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            **_template_options(tools, template_kwargs, continue_final),
            return_dict=False,
        )
    except TemplateError as exc:  # the template rejected the conversation (raise_exception)
        raise InvalidRequestError(
            f"the chat template rejected the messages: {exc}", "messages"
        ) from None
    except ValueError as exc:  # a control token in a message that cannot be written as text
        raise InvalidRequestError(f"the messages cannot be encoded: {exc}", "messages") from None
    return list(ids)


def _template_options(
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None,
    continue_final: bool,
) -> dict[str, Any]:
    """What apply_chat_template is given (a tokenizer's or a processor's): the template's
    variables, the tools, the turn left open or a new one, tokenized with control tokens in
    the conversation encoded as text."""
    return {
        **(template_kwargs or {}),
        "tools": tools or None,
        "add_generation_prompt": not continue_final,
        "continue_final_message": continue_final,
        "tokenize": True,
        "sanitize_control_tokens": True,
    }


class Expanded(list[int]):
    """Token ids a processor rendered, its images' placeholders already written out."""


def _processor_rendered(
    processor: Any,
    messages: list[dict[str, Any]],
    images: Sequence[Any],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None,
    continue_final: bool,
) -> list[int] | None:
    """The conversation through a processor's chat template and processor, images expanded
    (None where the processor cannot encode control tokens as text: Idefics3's)."""
    pictures = iter(images)
    conversation = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [
                {"type": "image", "image": next(pictures)} if part.get("type") == "image" else part
                for part in content
            ]
            message = {**message, "content": content}
        conversation.append(message)
    try:
        out = processor.apply_chat_template(
            conversation,
            **_template_options(tools, template_kwargs, continue_final),
            return_dict=True,
            return_tensors="np",
        )
    except TemplateError as exc:
        raise InvalidRequestError(
            f"the chat template rejected the messages: {exc}", "messages"
        ) from None
    except (ValueError, TypeError, StopIteration):
        return None
    return Expanded(int(t) for t in out["input_ids"].reshape(-1))


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


MAX_TEMPLATE_KWARGS = 16
MAX_TEMPLATE_STRING = 1024
# what apply_chat_template itself takes, and the template's own variables: never from a request
RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
        "bos_token",
        "eos_token",
        "pad_token",
        "unk_token",
        "raise_exception",
        "strftime_now",
    }
)
_TEMPLATE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def check_template_kwargs(value: object) -> dict[str, Any] | None:
    """`chat_template_kwargs` (vLLM's): up to 16 variables for the chat template, named as
    identifiers (never one apply_chat_template or the template itself defines), each a
    boolean, a number, a string of at most 1024 characters, or null. InvalidRequestError
    naming the field otherwise."""
    field = "chat_template_kwargs"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"'{field}' must be an object", field)
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise InvalidRequestError(f"'{field}' takes at most {MAX_TEMPLATE_KWARGS} names", field)
    for name, item in value.items():
        where = f"{field}.{str(name)[:64]}"
        if not _TEMPLATE_NAME.match(str(name)) or name in RESERVED_TEMPLATE_NAMES:
            raise InvalidRequestError(
                f"'{where}': a template variable must be an identifier that is not one of "
                "the template's own (messages, tools, add_generation_prompt, ...)",
                field,
            )
        if isinstance(item, str) and len(item) > MAX_TEMPLATE_STRING:
            raise InvalidRequestError(
                f"'{where}' is longer than {MAX_TEMPLATE_STRING} characters", field
            )
        if item is not None and not isinstance(item, bool | int | float | str):
            raise InvalidRequestError(
                f"'{where}' must be a boolean, a number, a string or null", field
            )
    return dict(value)
