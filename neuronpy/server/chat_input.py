"""A chat request's conversation and tools as typed models, and what the chat template is given
of them: each message's role, text, tool calls, tool call id and name, and each tool's name,
description and parameters; nothing else of the request reaches the template."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import PrivateAttr, field_validator, model_validator

from neuronpy.errors import InvalidRequestError
from neuronpy.server.schema import FieldError, WireModel, either
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


class TextPart(WireModel):
    type: str  # only "text": the message's check says so
    text: str | None = None


class CalledFunction(WireModel):
    name: str
    arguments: str | None = None  # a string of JSON (ChatInput decodes it)


class ToolCall(WireModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction
    _arguments: object = PrivateAttr(default=None)  # decoded, once checked

    def for_template(self) -> dict[str, Any]:
        """As templates take it: the arguments an object (Qwen2.5, Hermes, Llama 3.1 write a
        mapping with `tojson`), or the text as sent when it is JSON of another kind."""
        arguments = self.function.arguments or "{}"
        item: dict[str, Any] = {
            "type": "function",
            "function": {
                "name": self.function.name,
                "arguments": self._arguments if isinstance(self._arguments, dict) else arguments,
            },
        }
        if self.id is not None:
            item["id"] = self.id
        return item


class Message(WireModel):
    role: Literal[tuple(ROLES)]  # type: ignore[valid-type]
    content: either(("a string", str), ("an array", list[TextPart])) | None = None  # type: ignore[valid-type]
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # either name, as replies give both

    @model_validator(mode="after")
    def _rules(self) -> Message:
        content = self.content
        if isinstance(content, list):
            if not content:
                raise FieldError(
                    "{at}.content must be a string or a list of text parts", "{at}.content"
                )
            for part in content:
                if part.type != "text":
                    raise FieldError("only text content parts are supported", "{at}.content")
                if part.text is None:
                    raise FieldError("a text part needs a 'text' string", "{at}.content")
        elif content is None and self.role != "assistant":
            raise FieldError(
                "{at}.content must be a string or a list of text parts", "{at}.content"
            )
        if self.role == "tool" and not self.tool_call_id:
            raise FieldError("{at}.tool_call_id must be a non-empty string", "{at}.tool_call_id")
        return self

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text or "" for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        item: dict[str, Any] = {"role": ROLES[self.role], "content": self.text}
        if self.role == "assistant":
            if self.tool_calls:
                item["tool_calls"] = [call.for_template() for call in self.tool_calls]
            reasoning = self.reasoning if self.reasoning_content is None else self.reasoning_content
            if reasoning is not None:
                item["reasoning_content"] = reasoning
        if self.role == "tool":
            item["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            item["name"] = self.name
        return item


class Function(WireModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema, as the template writes it
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _named(cls, name: str) -> str:
        if not TOOL_NAME.match(name):
            raise FieldError(f"{{at}} must be 1-64 letters, digits, _ or -, got {name[:80]!r}")
        return name


class Tool(WireModel):
    type: Literal["function"]
    function: Function

    def for_template(self) -> dict[str, Any]:
        spec = self.function.model_dump(exclude_none=True)
        return {"type": "function", "function": spec}


class NamedFunction(WireModel):
    name: str


class NamedToolChoice(WireModel):
    type: Literal["function"]
    function: NamedFunction


@dataclass(frozen=True)
class ChatTools:
    """What a request's tools mean: the tools the template is given (None: none), and whether
    the reply's tool-call markup becomes tool calls."""

    tools: list[dict[str, Any]] | None = None
    choice: str = "none"  # none, auto, required, or "function" (a named one)
    parse: bool = False
    parallel: bool = True


class ChatInput(WireModel):
    """What a chat template renders: the messages, and the tools the model is shown.
    `tool_choice` "none" hides the tools; a named function shows the template that tool
    alone. "required" and a named function are enforced on the output (constraints.py)."""

    messages: list[Message]
    tools: list[Tool] | None = None
    tool_choice: either(("a string", str), ("an object", NamedToolChoice)) | None = None  # type: ignore[valid-type]
    parallel_tool_calls: bool | None = None

    @field_validator("messages")
    @classmethod
    def _conversation(cls, messages: list[Message]) -> list[Message]:
        if not messages:
            raise InvalidRequestError("'messages' must be a non-empty list of messages", "messages")
        for i, message in enumerate(messages):
            for j, call in enumerate(message.tool_calls or ()):
                # the same checks as the body's: the template writes the arguments with `tojson`
                where = ("messages", i, "tool_calls", j, "function", "arguments")
                try:
                    call._arguments = decode_json(call.function.arguments or "{}", where)
                except InvalidRequestError as exc:
                    raise InvalidRequestError(exc.message, f"messages[{i}].tool_calls") from None
        return messages

    @field_validator("tools")
    @classmethod
    def _toolbox(cls, tools: list[Tool] | None) -> list[Tool] | None:
        if tools is not None:
            check_toolbox([t.function.name for t in tools], "tools[{i}].function.name")
        return tools

    @model_validator(mode="after")
    def _choice(self) -> ChatInput:
        self.chat_tools  # noqa: B018 (its checks)
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the template sees them."""
        return [message.for_template() for message in self.messages]

    @functools.cached_property
    def chat_tools(self) -> ChatTools:
        """`tools`, `tool_choice` and `parallel_tool_calls`, as what they mean (worked out once:
        the validators, the constraint, the output format and the template all ask)."""
        names = [tool.function.name for tool in self.tools or ()]
        choice, named = _tool_choice(self.tool_choice, names)
        if not names or choice == "none":
            return ChatTools(choice=choice)
        tools = [t for t in self.tools or () if named is None or t.function.name == named]
        return ChatTools(
            [t.for_template() for t in tools],
            choice,
            parse=True,
            parallel=self.parallel_tool_calls is not False,
        )


def check_toolbox(names: list[str], name_param: str) -> None:
    """At most MAX_TOOLS tools, no two of one name; `name_param`: where tool `{i}`'s name is
    in the request (chat's tools nest it under `function`, the Responses API's do not)."""
    if len(names) > MAX_TOOLS:
        raise InvalidRequestError(
            f"'tools' takes at most {MAX_TOOLS} tools, got {len(names)}", "tools"
        )
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            raise InvalidRequestError(
                f"two tools are named {name!r}; tool names must be unique",
                name_param.replace("{i}", str(i)),
            )
        seen.add(name)


def _tool_choice(value: str | NamedToolChoice | None, names: list[str]) -> tuple[str, str | None]:
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
    name = value.function.name
    if name not in names:
        raise InvalidRequestError(
            f"'tool_choice' names the function {name[:80]!r}, which is not among the tools",
            "tool_choice",
        )
    return "function", name
