"""A prompt as token ids: chat messages and tools validated and templated, or text encoded."""

# Only the keys listed here reach the template: each message's role, text, tool calls, tool call
# id and name, and each tool's name, description and parameters. Errors are InvalidRequestError
# naming the field (the HTTP layer makes them 400s).

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from neuronpy.errors import InvalidRequestError
from neuronpy.server.structure import decode_json

# Message roles the chat template may see: the template concatenates them into control tokens.
ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ChatTools:
    """What a request's tools mean: the tools the template is given (None: none), and whether
    the reply's tool-call markup becomes tool calls."""

    tools: list[dict[str, Any]] | None = None
    choice: str = "none"  # none, auto, required, or "function" (a named one)
    parse: bool = False
    parallel: bool = True


def parse_tools(body: dict[str, Any]) -> ChatTools:
    """`tools`, `tool_choice` and `parallel_tool_calls`. tool_choice "none" hides the tools
    from the template; a named function shows the template that tool alone. "required" and a
    named function are enforced on the output (server/constraints.py: tool_constraint)."""
    tools = _tools(body.get("tools"))
    names = [t["function"]["name"] for t in tools]
    choice, named = _tool_choice(body.get("tool_choice"), names)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if not tools or choice == "none":
        return ChatTools(choice=choice)
    if named is not None:
        tools = [t for t in tools if t["function"]["name"] == named]
    return ChatTools(tools, choice, parse=True, parallel=parallel is not False)


def _tools(value: object) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequestError("'tools' must be a list of tools", "tools")
    if len(value) > MAX_TOOLS:
        raise InvalidRequestError(
            f"'tools' takes at most {MAX_TOOLS} tools, got {len(value)}", "tools"
        )
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequestError(
                f"{where} must be an object with type 'function'", f"{where}.type"
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequestError(f"{where}.function must be an object", f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise InvalidRequestError(
                f"{where}.function.name must be 1-64 letters, digits, _ or -, got "
                f"{str(name)[:80]!r}",
                f"{where}.function.name",
            )
        if name in seen:
            raise InvalidRequestError(
                f"two tools are named {name!r}; tool names must be unique",
                f"{where}.function.name",
            )
        seen.add(name)
        spec: dict[str, Any] = {"name": name}
        for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
            field = function.get(key)
            if field is None:
                continue
            if not isinstance(field, kind):
                noun = {str: "a string", dict: "a JSON Schema object", bool: "a boolean"}[kind]
                raise InvalidRequestError(
                    f"{where}.function.{key} must be {noun}", f"{where}.function.{key}"
                )
            spec[key] = field
        out.append({"type": "function", "function": spec})
    return out


def _tool_choice(value: object, names: list[str]) -> tuple[str, str | None]:
    """(none | auto | required | function, the named function's name)."""
    if value is None:
        return ("auto" if names else "none"), None
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise InvalidRequestError(
                f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or a named function, "
                f"got {value[:80]!r}",
                "tool_choice",
            )
        if value == "required" and not names:
            raise InvalidRequestError(
                "'tool_choice' is 'required' but no tools were given", "tool_choice"
            )
        return value, None
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequestError(
            '\'tool_choice\' must be a string or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in names:
        raise InvalidRequestError(
            f"'tool_choice' names the function {name[:80]!r}, which is not among the tools",
            "tool_choice",
        )
    return "function", name


def parse_messages(value: object) -> list[dict[str, Any]]:
    """The messages as the template sees them. Assistant tool calls keep their id and name,
    with their arguments parsed into an object (templates write them with `tojson`)."""
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{where} must be an object", where)
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:  # (schema.py typed it already)
            raise InvalidRequestError(
                f"{where}.role must be one of {', '.join(ROLES)}, got {str(role)[:80]!r}",
                f"{where}.role",
            )
        item: dict[str, Any] = {"role": ROLES[role], "content": _content(message, where)}
        if role == "assistant":
            calls = _tool_calls(message.get("tool_calls"), i)
            if calls:
                item["tool_calls"] = calls
            for key in ("reasoning_content", "reasoning"):  # either name, as replies give both
                reasoning = message.get(key)
                if reasoning is None:
                    continue
                if not isinstance(reasoning, str):
                    raise InvalidRequestError(f"{where}.{key} must be a string", f"{where}.{key}")
                item["reasoning_content"] = reasoning
                break
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequestError(
                    f"{where}.tool_call_id must be a non-empty string", f"{where}.tool_call_id"
                )
            item["tool_call_id"] = call_id
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise InvalidRequestError(f"{where}.name must be a string", f"{where}.name")
            item["name"] = name
        out.append(item)
    return out


def _content(message: dict[str, Any], where: str) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidRequestError(
                    "only text content parts are supported", f"{where}.content"
                )
            if not isinstance(part.get("text"), str):
                raise InvalidRequestError("a text part needs a 'text' string", f"{where}.content")
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequestError(
        f"{where}.content must be a string or a list of text parts", f"{where}.content"
    )


def _tool_calls(value: object, message: int) -> list[dict[str, Any]]:
    """An assistant message's tool calls (of messages[`message`]), as OpenAI sends them back,
    for the template."""
    if value is None:
        return []
    param = f"messages[{message}].tool_calls"
    if not isinstance(value, list):
        raise InvalidRequestError(f"{param} must be a list", param)
    out = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise InvalidRequestError(f"{param}[{j}] must be a function call", param)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f"{param}[{j}].function needs a 'name' string", param)
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise InvalidRequestError(
                f"{param}[{j}].function.arguments must be a string of JSON", param
            )
        try:  # the same checks as the body's: the template writes the arguments with `tojson`
            where = ("messages", message, "tool_calls", j, "function", "arguments")
            parsed = decode_json(arguments, where)
        except InvalidRequestError as exc:
            raise InvalidRequestError(exc.message, param) from None
        item: dict[str, Any] = {
            "type": "function",
            "function": {
                "name": function["name"],
                # templates (Qwen2.5, Hermes, Llama 3.1) write a mapping with `tojson`
                "arguments": parsed if isinstance(parsed, dict) else arguments,
            },
        }
        call_id = call.get("id")
        if call_id is not None:
            if not isinstance(call_id, str):
                raise InvalidRequestError(f"{param}[{j}].id must be a string", param)
            item["id"] = call_id
        out.append(item)
    return out


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
