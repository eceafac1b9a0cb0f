"""Tools for a model whose chat template does not show them (SmolLM2's drops them): the
generic format. The tools are written into the system message as JSON, with how to call one;
the reply is either text, or calls in one fixed shape,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

which the grammar holds once the model starts one (tool_choice "auto": the model chooses; a
call it begins is finished well-formed, naming a tool and with arguments valid against its
schema), or which it must write ("required", a named function). Earlier turns are written in
the same shape: an assistant's calls as those blocks, each tool result as a user turn inside
<tool_response> tags (consecutive results in one turn), so that templates that know no
`tool` role, or insist that user and assistant alternate, render the conversation too.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
RESULT_START, RESULT_END = "<tool_response>", "</tool_response>"


def instructions(tools: Sequence[dict[str, Any]], choice: str) -> str:
    """The system text that shows the model its tools (`tools` as templates take them:
    `{"type": "function", "function": {...}}`) and how to call them; `choice` is the request's
    tool_choice (auto, required, function)."""
    listed = "\n".join(json.dumps(_described(t["function"]), ensure_ascii=False) for t in tools)
    shape = f'{CALL_START}\n{{"name": <tool name>, "arguments": <arguments object>}}\n{CALL_END}'
    if choice == "auto":
        when = "To call a tool, reply with only:"
        after = "\nOtherwise answer in plain text."
    else:
        when, after = "Answer by calling a tool:", ""
    return (
        f"You have these tools:\n<tools>\n{listed}\n</tools>\n{when}\n{shape}{after}\n"
        f"Results come back in {RESULT_START}{RESULT_END}."
    )


def _described(function: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"name": function["name"]}
    if function.get("description"):
        out["description"] = function["description"]
    out["parameters"] = function.get("parameters") or {"type": "object"}
    return out


def call_text(call: dict[str, Any]) -> str:
    """An earlier call (as templates take it) in the generic shape."""
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments)
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_START}\n{body}\n{CALL_END}"


def messages_with_tools(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]],
    choice: str,
    system: bool = True,
) -> list[dict[str, Any]]:
    """`messages` (as templates take them) with the tools' instructions in the system message
    (the first one, or a new one first; `system` False: at the start of the first user
    message instead, for a template that refuses a system role), earlier calls and tool
    results written in the generic shape."""
    text = instructions(tools, choice)
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(call_text(c) for c in message["tool_calls"])
            content = message.get("content") or ""
            item = {k: v for k, v in message.items() if k != "tool_calls"}
            item["content"] = f"{content}\n{calls}" if content else calls
            out.append(item)
        elif role == "tool":
            result = f"{RESULT_START}\n{message.get('content') or ''}\n{RESULT_END}"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_results": True})
        else:
            out.append(dict(message))
    for item in out:
        item.pop("_results", None)
    if system:
        if out and out[0]["role"] == "system":
            first = out[0].get("content") or ""
            out[0] = {**out[0], "content": f"{first}\n\n{text}" if first else text}
        else:
            out.insert(0, {"role": "system", "content": text})
        return out
    for i, item in enumerate(out):
        if item["role"] == "user":
            out[i] = {**item, "content": f"{text}\n\n{item.get('content') or ''}"}
            return out
    return [{"role": "user", "content": text}, *out]


def system_messages_first(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with every system message after the first turn gathered into one system
    message first (their texts in order), for templates that take a system message only
    there (Qwen's), where a client sends them anywhere (Anthropic's mid-conversation system
    messages, OpenAI's developer messages)."""
    later = [m for m in messages[1:] if m["role"] == "system"]
    if not later:
        return list(messages)
    lead = [messages[0]] if messages[0]["role"] == "system" else []
    texts = [m.get("content") or "" for m in (*lead, *later)]
    rest = [m for m in messages[len(lead) :] if m["role"] != "system"]
    return [{"role": "system", "content": "\n\n".join(t for t in texts if t)}, *rest]
