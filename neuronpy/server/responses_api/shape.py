"""The shape of a stored response's file: exactly what the server writes (a response object
and its conversation as chat messages), so that a file read back after a restart is trusted
only when it is one."""

from __future__ import annotations

import re

from neuronpy.errors import InvalidRequestError
from neuronpy.server.response_ids import RESPONSE_ID
from neuronpy.server.responses_api.protocol import check_metadata

RESPONSE_KEYS = frozenset(
    {
        "id", "object", "created_at", "status", "model", "output", "error",
        "incomplete_details", "instructions", "max_output_tokens", "parallel_tool_calls",
        "previous_response_id", "temperature", "top_p", "tool_choice", "tools", "text",
        "truncation", "store", "metadata", "reasoning", "usage",
    }
)  # fmt: skip
ITEM_ID = {
    "message": re.compile(r"msg_[0-9a-f]{32}"),
    "reasoning": re.compile(r"rs_[0-9a-f]{32}"),
    "function_call": re.compile(r"fc_[0-9a-f]{32}"),
}
ITEM_KEYS = {
    "message": {"type", "id", "role", "content", "status"},
    "reasoning": {"type", "id", "summary", "content", "status"},
    "function_call": {"type", "id", "call_id", "name", "arguments", "status"},
}
ROLES = ("user", "system", "developer", "assistant")


def _count(value: object) -> bool:
    return type(value) is int and value >= 0


def _maybe(value: object, *kinds: type) -> bool:
    """None (a request's null, echoed), or of one of `kinds` exactly (a bool is no int; a
    float is finite, decode_json refused the others)."""
    return value is None or type(value) in kinds


def _text_part(value: object, kind: str, extra: dict[str, object]) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"type", "text", *extra}
        and value["type"] == kind
        and isinstance(value["text"], str)
        and all(value[k] == v for k, v in extra.items())
    )


def _output_item(item: object) -> bool:
    """An output item as the server writes one: a message, reasoning or a function call, done."""
    if not isinstance(item, dict):
        return False
    kind = item.get("type")
    if not isinstance(kind, str) or kind not in ITEM_KEYS or set(item) != ITEM_KEYS[kind]:
        return False
    if item["status"] != "completed" or not isinstance(item["id"], str):
        return False
    if not ITEM_ID[kind].fullmatch(item["id"]):
        return False
    content = item.get("content")
    if kind == "message":
        return (
            item["role"] == "assistant"
            and isinstance(content, list)
            and len(content) == 1
            and _text_part(content[0], "output_text", {"annotations": []})
        )
    if kind == "reasoning":
        return (
            item["summary"] == []
            and isinstance(content, list)
            and len(content) == 1
            and _text_part(content[0], "reasoning_text", {})
        )
    return all(isinstance(item[k], str) for k in ("call_id", "name", "arguments"))


def _usage(value: object) -> bool:
    if not isinstance(value, dict) or set(value) != {
        "input_tokens",
        "input_tokens_details",
        "output_tokens",
        "output_tokens_details",
        "total_tokens",
    }:
        return False
    prompt, generated = value["input_tokens"], value["output_tokens"]
    cached, reasoning = value["input_tokens_details"], value["output_tokens_details"]
    return (
        _count(prompt)
        and _count(generated)
        and type(value["total_tokens"]) is int
        and value["total_tokens"] == prompt + generated  # type: ignore[operator]
        and isinstance(cached, dict)
        and set(cached) == {"cached_tokens"}
        and _count(cached["cached_tokens"])
        and isinstance(reasoning, dict)
        and set(reasoning) == {"reasoning_tokens"}
        and _count(reasoning["reasoning_tokens"])
    )


def _metadata(value: object) -> bool:
    try:
        check_metadata(value)
    except InvalidRequestError:
        return False
    return isinstance(value, dict)


def valid_response(value: object, rid: str) -> bool:
    """Whether `value` is exactly what the server stores as response `rid` (the fields it
    writes, their types; what it echoes of the request, such as tools, as JSON of its kind)."""
    if not isinstance(value, dict) or set(value) != RESPONSE_KEYS:
        return False
    v = value
    status = v["status"]
    details = None if status == "completed" else {"reason": "max_output_tokens"}
    previous = v["previous_response_id"]
    previous_ok = previous is None or (
        isinstance(previous, str) and RESPONSE_ID.fullmatch(previous) is not None
    )
    text = v["text"]
    return (
        v["id"] == rid
        and v["object"] == "response"
        and _count(v["created_at"])
        and status in ("completed", "incomplete")
        and v["incomplete_details"] == details
        and v["error"] is None
        and isinstance(v["model"], str)
        and isinstance(v["output"], list)
        and all(_output_item(item) for item in v["output"])
        and _maybe(v["instructions"], str)
        and (v["max_output_tokens"] is None or _count(v["max_output_tokens"]))
        and _maybe(v["parallel_tool_calls"], bool)
        and previous_ok
        and _maybe(v["temperature"], int, float)
        and _maybe(v["top_p"], int, float)
        and _maybe(v["tool_choice"], str, dict)
        and isinstance(v["tools"], list)
        and all(isinstance(tool, dict) for tool in v["tools"])
        and isinstance(text, dict)
        and set(text) == {"format"}
        and isinstance(text["format"], dict)
        and isinstance(text["format"].get("type"), str)
        and v["truncation"] == "disabled"
        and v["store"] is True
        and _metadata(v["metadata"])
        and v["reasoning"] == {"effort": None, "summary": None}
        and _usage(v["usage"])
    )


def _tool_call(value: object) -> bool:
    if not isinstance(value, dict) or set(value) != {"id", "type", "function"}:
        return False
    function = value["function"]
    return (
        isinstance(value["id"], str)
        and value["type"] == "function"
        and isinstance(function, dict)
        and set(function) == {"name", "arguments"}
        and isinstance(function["name"], str)
        and isinstance(function["arguments"], str)
    )


def _message(value: object) -> bool:
    """A chat message as a conversation holds one: a role's text; an assistant's text and
    tool calls; a tool's result."""
    if not isinstance(value, dict) or not isinstance(value.get("content"), str):
        return False
    keys, role = set(value), value.get("role")
    if keys == {"role", "content"}:
        return role in ROLES
    if keys == {"role", "content", "tool_calls"}:
        calls = value["tool_calls"]
        return role == "assistant" and isinstance(calls, list) and all(map(_tool_call, calls))
    if keys == {"role", "tool_call_id", "content"}:
        return role == "tool" and isinstance(value["tool_call_id"], str)
    return False


def valid_conversation(value: object) -> bool:
    """Whether `value` is a conversation as the server stores one: chat messages, the last
    the assistant's reply."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(map(_message, value))
        and value[-1]["role"] == "assistant"
    )
