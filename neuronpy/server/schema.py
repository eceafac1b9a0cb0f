"""The JSON type of every request field the server reads, as pydantic models: checked before any
field's own rules (fields.py, prompts.py), so that those never meet a value of the wrong type."""

# The models only type: ranges, lengths and combinations are the field validators' (which word
# the errors clients rely on), and a field whose validator already explains every wrong value
# better (session, prompt's items, logit_bias's values) is typed as far as that validator needs.
# Strict: no coercion ("5" is not 5, 1.0 is not 1, true is not 1). Unknown fields are ignored,
# as OpenAI's own clients send fields this server does not know.

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Tag, ValidationError
from pydantic_core import ErrorDetails

from neuronpy.errors import InvalidRequestError
from neuronpy.server.fields import JSON_NOUNS, json_type
from neuronpy.server.prompts import ROLES
from neuronpy.server.structure import format_path


def _either(*members: tuple[str, Any]) -> Any:
    """A union decided by the value's JSON kind, each member tagged with its kind's noun: an
    error names the member the value's kind chose (or, for another kind, the kinds allowed),
    never every member's complaint at once."""
    tagged = tuple(Annotated[kind, Tag(noun)] for noun, kind in members)
    return Annotated[Union[tagged], Discriminator(json_type)]  # noqa: UP007 (a runtime tuple)


Role = Literal[tuple(ROLES)]  # type: ignore[valid-type]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _TextPart(_Model):
    type: str  # prompts refuses parts other than text, saying so
    text: str | None = None


class _CalledFunction(_Model):
    name: str
    arguments: str | None = None  # a string of JSON (prompts decodes it)


class _ToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: _CalledFunction


Content = _either(("a string", str), ("an array", list[_TextPart]))


class _Message(_Model):
    role: Role
    content: Content | None = None
    name: str | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _Function(_Model):
    name: str  # prompts checks OpenAI's rule for names
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema, as the template writes it
    strict: bool | None = None


class _Tool(_Model):
    type: Literal["function"]
    function: _Function


class _NamedFunction(_Model):
    name: str


class _ToolChoice(_Model):
    type: Literal["function"]
    function: _NamedFunction


ToolChoice = _either(("a string", str), ("an object", _ToolChoice))
Stop = _either(("a string", str), ("an array", list[str]))
# a string, or token ids, or a list of those: fields.prompts words each case
Prompt = _either(("a string", str), ("an array", list[Any]))


class _StreamOptions(_Model):
    include_usage: bool | None = None


class _Common(_Model):
    """What both endpoints read."""

    model: str | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: Stop | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, Any] | None = None  # fields.logit_bias lists the bad entries
    response_format: dict[str, Any] | None = None
    speculative: str | None = None  # "off", "ngram" or "draft": this request's speculation
    # session: fields.session explains every wrong shape; the unsupported fields take any value
    # that asks for nothing (fields.UNSUPPORTED)


class ChatBody(_Common):
    messages: list[_Message]
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[_Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None


class CompletionBody(_Common):
    prompt: Prompt
    logprobs: int | None = None  # completions' logprobs is a count


def check_types(chat: bool, body: dict[str, Any]) -> None:
    """InvalidRequestError naming the first field of `body` whose JSON type is wrong (and its
    path: `messages[2].role`); the body is structurally sound already (structure.py)."""
    model = ChatBody if chat else CompletionBody
    try:
        model.model_validate(body)
    except ValidationError as exc:
        raise _first_error(exc.errors(include_url=False)) from None


def _first_error(errors: list[ErrorDetails]) -> InvalidRequestError:
    error = errors[0]
    # The union tags are nouns ("an array"), never field names. The param stops at the first:
    # the field as a whole (what the field validators name too); the message gives the place.
    loc = [part for part in error["loc"] if not _is_tag(part)]
    cut = next((i for i, part in enumerate(error["loc"]) if _is_tag(part)), len(error["loc"]))
    place, param = format_path(loc), format_path(error["loc"][:cut]) or None
    kind, ctx = error["type"], error.get("ctx", {})
    if kind == "missing":
        return InvalidRequestError(f"'{place}' is required", param)
    if kind == "union_tag_invalid":  # ctx: "'a string', 'an array'"
        expected = " or ".join(ctx.get("expected_tags", "").replace("'", "").split(", "))
    elif kind == "literal_error":
        expected = f"one of {ctx.get('expected', '')}"
    else:
        expected = _EXPECTED.get(kind, "")
    if not expected:  # (a type no field above has)
        return InvalidRequestError(f"'{place}': {error['msg']}", param)
    return InvalidRequestError(f"'{place}' must be {expected}, got {_sent(error)}", param)


_EXPECTED = {
    "string_type": "a string",
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}


def _is_tag(part: str | int) -> bool:
    return isinstance(part, str) and part in JSON_NOUNS.values()


def _sent(error: ErrorDetails) -> str:
    """What was sent instead: its kind; a short string or a boolean as itself."""
    value = error["input"]
    if isinstance(value, str):
        return f"{value[:40]!r}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if error["type"] == "float_type" and isinstance(value, int):
        return "an integer too large for a number"  # (any other integer is a number)
    return json_type(value)
