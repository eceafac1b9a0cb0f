"""Hermes/Qwen tool-call markup: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

_DECODER = json.JSONDecoder()
_ARGUMENT_KEYS = ("arguments", "parameters")  # some Hermes fine-tunes write "parameters"


@dataclass(frozen=True)
class ParsedCall:
    """A well-formed call body: the function's name and its arguments' JSON text. `span` is
    where that text lies in the body when the model wrote it there verbatim (an object), None
    when it was rewritten (arguments given as a JSON string, or missing: "{}")."""

    name: str
    arguments: str
    span: tuple[int, int] | None


def parse_tool_call(body: str) -> ParsedCall | None:
    """The call in the text between `<tool_call>` and `</tool_call>`, or None if it is not one
    JSON object with a non-empty string "name" and an object (or a string holding one) as
    "arguments". Other keys are ignored."""
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict):
        return None
    name = call.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    key = next((k for k in _ARGUMENT_KEYS if k in call), None)
    if key is None:
        return ParsedCall(name, "{}", None)
    arguments = call[key]
    if isinstance(arguments, str):  # arguments written as a JSON string holding the object
        try:
            inner = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
        return ParsedCall(name, arguments, None) if isinstance(inner, dict) else None
    if not isinstance(arguments, dict):
        return None
    span = _value_span(body, key, arguments)
    if span is None:
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False), None)
    return ParsedCall(name, body[span[0] : span[1]], span)


def _value_span(body: str, key: str, value: object) -> tuple[int, int] | None:
    """Where `"key": value` has its value in `body`, as the model wrote it."""
    for match in re.finditer(rf'"{key}"\s*:\s*', body):
        try:
            found, end = _DECODER.raw_decode(body, match.end())
        except (ValueError, RecursionError):
            continue
        if found == value:
            return match.end(), end
    return None


def new_call_id() -> str:
    """An id for a tool call, in OpenAI's style (`call_` and 24 random characters)."""
    return f"call_{secrets.token_hex(12)}"
