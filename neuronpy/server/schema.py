"""The base of the request models (protocol.py, chat_input.py): strict pydantic models whose
first error becomes the 400 a client gets, worded as the server words it and naming the field.

A model types each field (strict: no coercion, "5" is not 5, 1.0 is not 1, true is not 1;
unknown fields are ignored, as OpenAI's own clients send fields this server does not know) and
its validators hold the field's rules. A validator raises InvalidRequestError (its message and
param as they are) or, where the field's place in the body is what the message names
(`messages[2].content`), FieldError, whose `{at}` is that place.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Tag, ValidationError
from pydantic_core import ErrorDetails

from neuronpy.errors import InvalidRequestError
from neuronpy.server.structure import JsonPath, format_path

# What a JSON value is called in errors (and the tags of the unions below).
JSON_NOUNS = {str: "a string", list: "an array", dict: "an object", bool: "a boolean"}
JSON_NOUNS |= {int: "a number", float: "a number", type(None): "null"}


def json_type(value: object) -> str:
    """A JSON value's kind, as errors name it: a string, an array, an object, ..."""
    return JSON_NOUNS.get(type(value), "a value")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class FieldError(ValueError):
    """A field's rule broken, said of its place in the body: `{at}` in the message and in the
    param is that place (`messages[2]`); the param defaults to it."""

    def __init__(self, message: str, param: str = "{at}") -> None:
        super().__init__(message)
        self.message, self.param = message, param


class WireModel(BaseModel):
    """A request's JSON object: strict types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


def either(*members: tuple[str, Any]) -> Any:
    """A union decided by the value's JSON kind, each member tagged with its kind's noun: an
    error names the member the value's kind chose (or, for another kind, the kinds allowed),
    never every member's complaint at once."""
    tagged = tuple(Annotated[kind, Tag(noun)] for noun, kind in members)
    return Annotated[Union[tagged], Discriminator(_json_kind)]  # noqa: UP007 (a runtime tuple)


def by_type(default: str, **members: type[WireModel]) -> Any:
    """A union of objects decided by their "type" field (`default` where they have none):
    an error names the fields of the member the type chose."""
    tagged = tuple(Annotated[m, Tag(_KIND + name)] for name, m in members.items())

    def kind(value: Any) -> str | None:
        if isinstance(value, dict):
            return f"{_KIND}{value.get('type', default)}"
        return f"{_KIND}{getattr(value, 'type', default)}" if isinstance(value, WireModel) else None

    return Annotated[Union[tagged], Discriminator(kind)]  # noqa: UP007 (a runtime tuple)


_KIND = "type:"  # (the tags of by_type's unions: never a field's name, as they hold a colon)


def _json_kind(value: object) -> str:
    """What `either` decides by: the JSON kind; a model (built in Python) is an object."""
    return "an object" if isinstance(value, BaseModel) else json_type(value)


M = TypeVar("M", bound=WireModel)


def validate(model: type[M], body: dict[str, Any], **context: Any) -> M:
    """`body` as a `model`; InvalidRequestError naming the first field that breaks a rule (its
    path: `messages[2].role`). `context` reaches the validators (pydantic's context)."""
    try:
        return model.model_validate(body, context=context or None)
    except ValidationError as exc:
        raise first_error(exc.errors(include_url=False)) from None


def build(model: type[M], at: JsonPath, **values: Any) -> M:
    """A `model` built in Python from the request field at `at` (where one API's request becomes
    the chat request it means). The chat's models hold rules of their own that the other API's
    models need not repeat (a tool's name), so a value that breaks one is the request's 400
    naming the field it came from, as `validate`'s errors are, never a ValidationError that
    escapes as a 500."""
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        error = errors[0]
        error["loc"] = (*at, *error["loc"])
        raise first_error([error]) from None


def first_error(errors: list[ErrorDetails]) -> InvalidRequestError:
    error = errors[0]
    # The union tags are nouns ("an array") or types ("type:message"), never field names. The
    # param stops at the first noun: the field as a whole (what the field validators name too),
    # the message gives the place; but an item chosen by its type is named itself (`input[2]
    # .role`), as an object of fields of its own.
    loc = [part for part in error["loc"] if not _is_tag(part)]
    cut = next((i for i, part in enumerate(error["loc"]) if _is_tag(part)), len(error["loc"]))
    if any(isinstance(part, str) and part.startswith(_KIND) for part in error["loc"]):
        cut = len(error["loc"])
    place = format_path(loc)
    param = format_path([part for part in error["loc"][:cut] if not _is_tag(part)]) or None
    kind, ctx = error["type"], error.get("ctx", {})
    cause = ctx.get("error")
    if isinstance(cause, InvalidRequestError):
        return cause
    if isinstance(cause, FieldError):
        return InvalidRequestError(
            cause.message.replace("{at}", place), cause.param.replace("{at}", place)
        )
    if kind == "missing":
        return InvalidRequestError(f"'{place}' is required", param)
    if kind == "union_tag_invalid":  # ctx: "'a string', 'an array'"
        expected = " or ".join(ctx.get("expected_tags", "").replace("'", "").split(", "))
    elif kind == "literal_error":
        expected = f"one of {ctx.get('expected', '')}"
    else:
        expected = _EXPECTED.get(kind, "")
    if not expected:  # (a type no field has)
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
    return isinstance(part, str) and (part in JSON_NOUNS.values() or part.startswith(_KIND))


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
