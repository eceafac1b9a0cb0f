"""A Responses request as the chat request it means: its input items as chat messages, its
function tools as chat tools, `text.format` as a response_format; and the chat request's
errors renamed to the fields the Responses client sent."""

from __future__ import annotations

import re
from typing import Any

from neuronpy.errors import InvalidRequestError
from neuronpy.server.errors import ApiError
from neuronpy.server.structure import decode_json

# the chat request's parameter names -> the Responses request's, for errors
PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "tools": "tools",
}
ROLES = ("user", "system", "developer", "assistant")
_TOOL_FUNCTION = re.compile(r"(tools\[\d+\])\.function(?=\.|$)")  # chat's tools[i].function
_MAX_TOKENS = re.compile(r"\bmax_tokens\b")


def input_messages(value: object) -> list[dict[str, Any]]:
    """`input` (a string, or a list of items: messages, function_call, function_call_output;
    reasoning items are skipped) as chat messages in the wire format of /v1/chat/completions."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("'input' must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"'{where}' must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise InvalidRequestError(
                    f"'{where}.role' must be one of {', '.join(ROLES)}", f"{where}.role"
                )
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            arguments = _string(item, "arguments", where)
            # JSON, as chat's checks take it (the template writes it parsed): checked here, so
            # that the error names this item rather than the chat message it becomes
            decode_json(arguments, ("input", i, "arguments"))
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, where)
            call_id = _string(item, "call_id", where)
            if not call_id:
                raise InvalidRequestError(
                    f"'{where}.call_id' must be a non-empty string", f"{where}.call_id"
                )
            out.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "reasoning":
            continue  # the template is given no earlier reasoning
        else:
            raise InvalidRequestError(
                f"'{where}.type' {str(kind)[:40]!r} is not supported; this server takes "
                "message, function_call, function_call_output and reasoning items",
                f"{where}.type",
            )
    return out


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"'{where}.{key}' must be a string", f"{where}.{key}")
    return value


def _text(content: object, where: str) -> str:
    """A message's content: a string, or text parts (input_text, output_text, text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text") or not isinstance(
                part.get("text"), str
            ):
                raise InvalidRequestError(
                    f"'{where}.content' takes only text parts (input_text, output_text)",
                    f"{where}.content",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(
        f"'{where}.content' must be a string or a list of text parts", f"{where}.content"
    )


def chat_tools(value: object) -> list[dict[str, Any]] | None:
    """Function tools ({"type": "function", "name", "description", "parameters"}) in chat's
    shape; any other kind of tool is a 400."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidRequestError("'tools' must be a list of tools", "tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequestError(
                f"'tools[{i}]' must be a function tool; this server has no built-in tools",
                f"tools[{i}].type",
            )
        spec = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": spec})
    return out


def chat_tool_choice(value: object) -> object:
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    return value


def chat_format(text: object) -> dict[str, Any] | None:
    """`text.format` as a response_format: text, json_object, or json_schema (its name,
    schema and strict at the top level, not under json_schema as chat has them)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise InvalidRequestError("'text' must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequestError("'text.format' must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    return fmt


def chat_body(
    body: dict[str, Any], history: list[dict[str, Any]]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The /v1/chat/completions body a Responses request means, after `history` (a stored
    response's conversation, when it continues one); and the conversation without its
    instructions (which a follow-up does not inherit)."""
    conversation = [*history, *input_messages(body.get("input"))]
    messages = list(conversation)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequestError("'instructions' must be a string", "instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    out: dict[str, Any] = {"messages": messages}
    for name in (
        "temperature",
        "top_p",
        "parallel_tool_calls",
        "seed",
        "top_k",
        "stop",
        "speculative",
    ):
        if body.get(name) is not None:
            out[name] = body[name]
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    tools = chat_tools(body.get("tools"))
    if tools:
        out["tools"] = tools
    if body.get("tool_choice") is not None:
        out["tool_choice"] = chat_tool_choice(body["tool_choice"])
    fmt = chat_format(body.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    return out, conversation


def _responses_param(param: str) -> str:
    """A chat request's parameter as the Responses request names it: `messages[2]` is
    `input[2]`, `response_format.json_schema.schema` is `text.format.schema` and
    `tools[0].function.name` is `tools[0].name` (the Responses format and tools are flat),
    `max_tokens` is `max_output_tokens`."""
    for chat, responses in (
        ("response_format.json_schema", "text.format"),
        ("response_format", "text.format"),
    ):
        if param == chat or param.startswith((chat + ".", chat + "[")):
            return responses + param[len(chat) :]
    tool = _TOOL_FUNCTION.match(param)
    if tool is not None:
        return tool[1] + param[tool.end() :]
    head, dot, rest = param.partition(".")
    base, bracket, index = head.partition("[")
    if base in PARAMS:
        return PARAMS[base] + bracket + index + dot + rest
    return param


def renamed(exc: ApiError) -> ApiError:
    """A chat request's error, naming the Responses request's parameter, in its `param` and
    wherever its message names it (quoted, or a path such as tools[0].function.name as it is);
    and the chat parameters a message names beside it (another constraint's field, the
    engine's "max_tokens")."""
    if exc.param is not None:
        renamed = _responses_param(exc.param)
        exc.message = exc.message.replace(f"'{exc.param}'", f"'{renamed}'")
        if renamed != exc.param and ("." in exc.param or "[" in exc.param):
            where = re.compile(rf"(?<![\w.\]]){re.escape(exc.param)}(?!\w)")
            exc.message = where.sub(renamed, exc.message)
        exc.param = renamed
    for chat in ("response_format.json_schema", "response_format"):
        exc.message = exc.message.replace(f"'{chat}", f"'{_responses_param(chat)}")
    exc.message = _MAX_TOKENS.sub("max_output_tokens", exc.message)
    return exc
