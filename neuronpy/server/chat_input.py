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
from neuronpy.server.images import (
    ImageInput,
    check_image_count,
    decode_image,
    image_from_base64,
    image_from_url,
    image_marker,
    render_with_images,
)
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


class ImageUrl(WireModel):
    url: str
    detail: str | None = None  # (OpenAI's "low", "high", "auto": the model's processor decides)


class TextPart(WireModel):
    """A content part: "text" (its `text`) or "image_url" (its `image_url`)."""

    type: str  # "text" or "image_url": the message's check says so
    text: str | None = None
    image_url: ImageUrl | None = None
    # an image another API sent (Anthropic's, Ollama's): its base64 text and where that API
    # says it is, decoded with the rest (ChatInput.images) rather than read from image_url
    _base64: tuple[str, str] | None = PrivateAttr(default=None)
    _where: str | None = PrivateAttr(default=None)  # where another API has its image_url
    _fetched: bytes | None = PrivateAttr(default=None)  # its http(s) URL's image (image_urls.py)


def url_part(url: str, where: str) -> TextPart:
    """An image part for an image url another API sent at `where` (an error names that)."""
    part = TextPart(type="image_url", image_url=ImageUrl(url=url))
    part._where = where
    return part


def image_part(data: str, where: str) -> TextPart:
    """An image part for an image another API sent as base64 text at `where` (its own path
    for it: an error names that)."""
    part = TextPart(type="image_url", image_url=ImageUrl(url="data:,"))
    part._base64 = (data, where)
    return part


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
            for j, part in enumerate(content):
                if part.type == "image_url":
                    if part.image_url is None:
                        at = f"{{at}}.content[{j}]"
                        raise FieldError(f"{at} needs an 'image_url' object", at)
                    if self.role not in ("user", "system", "developer"):
                        raise FieldError("only a user's message may hold images", "{at}.content")
                    continue
                if part.type != "text":
                    raise FieldError(
                        f"a content part is 'text' or 'image_url', got {str(part.type)[:40]!r}",
                        "{at}.content",
                    )
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
            return "\n".join(part.text or "" for part in self.content if part.type == "text")
        return self.content or ""

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(p.type == "image_url" for p in self.content)

    def parts(self) -> list[dict[str, Any]]:
        """The content as a vision-language template takes it: text and image parts, in
        order (an image part carries nothing: its pixels go to the processor)."""
        if not isinstance(self.content, list):
            return [{"type": "text", "text": self.content or ""}]
        return [
            {"type": "image"} if p.type == "image_url" else {"type": "text", "text": p.text or ""}
            for p in self.content
        ]

    def for_template(self, parts: bool = False) -> dict[str, Any]:
        """As the chat template sees it; `parts`: the content as a list of parts (a
        vision-language model's template), else its text."""
        content: Any = self.parts() if parts else self.text
        item: dict[str, Any] = {"role": ROLES[self.role], "content": content}
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

    def template_messages(self, parts: bool = False) -> list[dict[str, Any]]:
        """The messages as the template sees them (`parts`: as Message.for_template)."""
        return [message.for_template(parts) for message in self.messages]

    @property
    def has_images(self) -> bool:
        return any(message.has_images for message in self.messages)

    def check_images(self, processor: Any) -> None:
        """InvalidRequestError naming the first image part when the model reads no images
        (`processor` None)."""
        if processor is None and self.has_images:
            where = self.image_parts()[0][1]
            raise InvalidRequestError(f"'{where}': this model reads no images", where)

    def with_images(self, ids: list[int], tokenizer: Any, processor: Any) -> list[int]:
        """The chat template's `ids` (of `template_messages(parts=True)`, rendered by
        render_chat with `pictures()`) with the images expanded by the model's processor: a
        Prompt holding them; `ids` as they are without images (blocking: run it in a
        thread)."""
        if not self.has_images:
            return ids
        self.check_images(processor)
        return render_with_images(processor, image_marker(tokenizer), ids, self.images)

    def pictures(self) -> list[Any]:
        """The images, decoded (PIL images), in order: for render_chat."""
        return [found.image for found in self.images]

    def image_parts(self) -> list[tuple[TextPart, str]]:
        """The image parts, in order, each with where the request has it."""
        found = []
        for i, message in enumerate(self.messages):
            if not isinstance(message.content, list):
                continue
            for j, part in enumerate(message.content):
                if part.type == "image_url" and part.image_url is not None:
                    where = part._where or f"messages[{i}].content[{j}].image_url"
                    found.append((part, part._base64[1] if part._base64 else where))
        return found

    @functools.cached_property
    def images(self) -> list[ImageInput]:
        """The image parts' images, decoded and checked, in the order they are written in
        (InvalidRequestError naming the part that is not one)."""
        found = []
        for part, where in self.image_parts():
            check_image_count(len(found) + 1, where)
            if part._base64 is not None:
                found.append(image_from_base64(part._base64[0], where))
            elif part._fetched is not None:
                found.append(decode_image(part._fetched, where))
            else:
                assert part.image_url is not None
                found.append(image_from_url(part.image_url.url, where))
        return found

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
