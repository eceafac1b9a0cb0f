"""Anthropic's Messages API request (POST /v1/messages), validated, and the chat request it
means: the system prompt and the content blocks become chat messages, `tools` and
`tool_choice` the chat's, `thinking` whether reasoning is shown, `stop_sequences` the stops.
Fields the API allows that neuronpy cannot honour are refused by name."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from neuronpy.errors import InvalidRequestError
from neuronpy.server.chat_input import (
    CalledFunction,
    Function,
    Message,
    NamedFunction,
    NamedToolChoice,
    TextPart,
    Tool,
    ToolCall,
    check_toolbox,
    image_part,
)
from neuronpy.server.images import MIME_TYPES
from neuronpy.server.protocol import ChatCompletionRequest
from neuronpy.server.schema import FieldError, WireModel, build, by_type, either, validate

MAX_STOP_SEQUENCES = 16
MIN_THINKING_BUDGET = 1024  # Anthropic's least budget_tokens
MAX_USER_ID = 256  # Anthropic's bound on metadata.user_id, its one metadata field


class TextBlock(WireModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # (a prompt-caching hint: our cache is automatic)
    citations: Any = None


class ToolUseBlock(WireModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(WireModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: either(("a string", str), ("an array", list[TextBlock])) | None = None  # type: ignore[valid-type]
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(block.text for block in self.content)
        text = self.content or ""
        return f"Error: {text}" if self.is_error and text else text


class ThinkingBlock(WireModel):
    """A reasoning block of an earlier reply, sent back as Anthropic's clients do."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class ImageSource(WireModel):
    type: str  # "base64" (a "url" one is refused: no remote image is fetched)
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(WireModel):
    """An image, for a vision-language model: base64 data of a type `media_type` names."""

    type: Literal["image"]
    source: ImageSource
    cache_control: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _inline(self) -> ImageBlock:
        if self.source.type != "base64":
            raise FieldError(
                "{at}.source: this server fetches no remote images; send the image as "
                '{"type": "base64", "media_type": ..., "data": ...}',
                "{at}.source",
            )
        if not isinstance(self.source.data, str) or not self.source.data:
            raise FieldError("{at}.source.data must be the image's base64 text", "{at}.source")
        media = self.source.media_type
        if media is not None and media.lower() not in MIME_TYPES:
            raise FieldError(
                f"{{at}}.source.media_type {media[:40]!r} is not one of "
                f"{', '.join(sorted(MIME_TYPES))}",
                "{at}.source",
            )
        return self


class UnsupportedBlock(WireModel):
    """Documents, searches: blocks a text model cannot take."""

    type: str

    @model_validator(mode="after")
    def _refused(self) -> UnsupportedBlock:
        raise FieldError(
            f"{{at}}: '{self.type[:40]}' content blocks are not supported (text, tool_use, "
            "tool_result and thinking are)",
            "{at}",
        )


Block = by_type(
    "text",
    text=TextBlock,
    tool_use=ToolUseBlock,
    tool_result=ToolResultBlock,
    thinking=ThinkingBlock,
    redacted_thinking=ThinkingBlock,
    image=ImageBlock,
    document=UnsupportedBlock,
    search_result=UnsupportedBlock,
    server_tool_use=UnsupportedBlock,
    web_search_tool_result=UnsupportedBlock,
    container_upload=UnsupportedBlock,
)


class InputMessage(WireModel):
    # "system" anywhere in the conversation: Anthropic's mid-conversation system messages
    # (Claude Code sends them), text only
    role: Literal["user", "assistant", "system"]
    content: either(("a string", str), ("an array", list[Block]))  # type: ignore[valid-type]


class ToolSpec(WireModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" or absent; server tools are refused
    cache_control: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _custom(self) -> ToolSpec:
        if self.type not in (None, "custom"):
            raise FieldError(
                f"{{at}}: server tools ({self.type[:40]!r}) are not supported; give custom "
                "tools (name, description, input_schema)",
                "{at}",
            )
        return self


class ToolChoice(WireModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(WireModel):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None  # not held apart: max_tokens bounds reasoning and answer
    display: Literal["summarized", "omitted"] | None = None

    @field_validator("budget_tokens")
    @classmethod
    def _budget(cls, value: int | None) -> int | None:
        # held to Anthropic's rule though unused, so that a request this server takes is one
        # Anthropic's API takes too
        if value is not None and value < MIN_THINKING_BUDGET:
            raise InvalidRequestError(
                f"'thinking.budget_tokens' must be at least {MIN_THINKING_BUDGET}, got {value}",
                "thinking.budget_tokens",
            )
        return value


class OutputFormat(WireModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(WireModel):
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # a hint: no effect


class Metadata(WireModel):
    """Anthropic's metadata: a user's id and nothing else (it is not echoed or stored here, but
    an unbounded object would be read and held for nothing)."""

    user_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _only_user_id(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for key in value:
                if key != "user_id":
                    raise InvalidRequestError(
                        f"'metadata' takes only 'user_id', got {str(key)[:40]!r}", "metadata"
                    )
        return value

    @field_validator("user_id")
    @classmethod
    def _user_id(cls, value: str | None) -> str | None:
        if value is not None and len(value) > MAX_USER_ID:
            raise InvalidRequestError(
                f"'metadata.user_id' holds at most {MAX_USER_ID} characters, got {len(value)}",
                "metadata.user_id",
            )
        return value


class MessagesRequest(WireModel):
    """POST /v1/messages, as Anthropic documents it."""

    model: str
    max_tokens: int
    messages: list[InputMessage]
    system: either(("a string", str), ("an array", list[TextBlock])) | None = None  # type: ignore[valid-type]
    temperature: float | int | None = None
    top_p: float | int | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    # hints for Anthropic's own service, without effect here: accepted
    service_tier: str | None = None  # (one tier: answered as "standard")
    cache_control: dict[str, Any] | None = None  # (the prefix cache is automatic)
    speed: str | None = None
    inference_geo: str | None = None
    # what neuronpy cannot honour: refused by name, never silently ignored
    container: Any = None
    mcp_servers: Any = None

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value: int) -> int:
        if value < 1:
            raise InvalidRequestError("'max_tokens' must be at least 1", "max_tokens")
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float | None) -> float | None:
        if value is not None and not 0 <= value <= 1:
            raise InvalidRequestError("'temperature' must be from 0 to 1", "temperature")
        return value

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, stops: list[str] | None) -> list[str] | None:
        if stops is not None and (len(stops) > MAX_STOP_SEQUENCES or not all(stops)):
            raise InvalidRequestError(
                f"'stop_sequences' takes up to {MAX_STOP_SEQUENCES} non-empty strings",
                "stop_sequences",
            )
        return stops

    @field_validator("tools")
    @classmethod
    def _toolbox(cls, tools: list[ToolSpec] | None) -> list[ToolSpec] | None:
        if tools is not None:
            check_toolbox([tool.name for tool in tools], "tools[{i}].name")
        return tools

    @model_validator(mode="after")
    def _whole(self) -> MessagesRequest:
        for name in ("container", "mcp_servers"):
            if getattr(self, name) is not None:
                raise InvalidRequestError(f"'{name}' is not supported by this server", name)
        if not self.messages:
            raise InvalidRequestError("'messages' must hold at least one message", "messages")
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and not choice.name:
            raise InvalidRequestError(
                "'tool_choice' of type 'tool' needs the tool's 'name'", "tool_choice"
            )
        if choice is not None and choice.type in ("any", "tool") and not self.tools:
            raise InvalidRequestError(
                f"'tool_choice' of type '{choice.type}' needs 'tools'", "tool_choice"
            )
        return self

    @property
    def shows_thinking(self) -> bool:
        """Whether reasoning is answered as thinking blocks (else it is left out)."""
        thinking = self.thinking
        return (
            thinking is not None and thinking.type != "disabled" and thinking.display != "omitted"
        )

    def system_text(self) -> str | None:
        if isinstance(self.system, list):
            return "\n".join(block.text for block in self.system)
        return self.system

    def chat_messages(self) -> list[Message]:
        """The conversation as chat messages: a user turn's tool results become tool
        messages (before its text), an assistant turn's tool_use blocks its tool calls. Each
        is built from the field it comes from (`build`): a value the chat's rules refuse is a
        400 naming that field."""
        out: list[Message] = []
        system = self.system_text()
        if system:
            out.append(build(Message, ("system",), role="system", content=system))
        for i, message in enumerate(self.messages):
            at = ("messages", i)
            blocks = message.content
            if isinstance(blocks, str):
                out.append(build(Message, at, role=message.role, content=blocks))
                continue
            texts = [b.text for b in blocks if isinstance(b, TextBlock)]
            if message.role == "system":
                if len(texts) != len(blocks):
                    raise InvalidRequestError(
                        f"messages[{i}]: a system message holds text blocks only",
                        f"messages[{i}].content",
                    )
                out.append(build(Message, at, role="system", content="\n".join(texts)))
                continue
            if message.role == "user":
                for j, block in enumerate(blocks):
                    if isinstance(block, ToolUseBlock):
                        raise InvalidRequestError(
                            f"messages[{i}]: a user message cannot hold tool_use blocks",
                            f"messages[{i}].content",
                        )
                    if isinstance(block, ToolResultBlock):
                        out.append(
                            build(
                                Message,
                                (*at, "content", j),
                                role="tool",
                                content=block.text,
                                tool_call_id=block.tool_use_id,
                            )
                        )
                pictures = [(j, b) for j, b in enumerate(blocks) if isinstance(b, ImageBlock)]
                if pictures:  # text and images, in their order
                    parts: list[TextPart] = [
                        image_part(b.source.data or "", f"messages[{i}].content[{j}].source")
                        if isinstance(b, ImageBlock)
                        else TextPart(type="text", text=b.text)
                        for j, b in enumerate(blocks)
                        if isinstance(b, ImageBlock | TextBlock)
                    ]
                    out.append(build(Message, at, role="user", content=parts))
                elif texts or not any(isinstance(b, ToolResultBlock) for b in blocks):
                    out.append(build(Message, at, role="user", content="\n".join(texts)))
                continue
            if any(isinstance(b, ToolResultBlock | ImageBlock) for b in blocks):
                raise InvalidRequestError(
                    f"messages[{i}]: an assistant message cannot hold tool_result or image blocks",
                    f"messages[{i}].content",
                )
            calls = [
                build(
                    ToolCall,
                    (*at, "content", j),
                    id=b.id,
                    function=build(
                        CalledFunction,
                        (*at, "content", j),
                        name=b.name,
                        arguments=json.dumps(b.input),
                    ),
                )
                for j, b in enumerate(blocks)
                if isinstance(b, ToolUseBlock)
            ]
            reasoning = "".join(b.thinking or "" for b in blocks if isinstance(b, ThinkingBlock))
            out.append(
                build(
                    Message,
                    at,
                    role="assistant",
                    content="\n".join(texts),
                    tool_calls=calls or None,
                    reasoning_content=reasoning or None,
                )
            )
        return out

    def chat(self) -> MessagesChat:
        """The chat request this one means; InvalidRequestError where the chat request's own
        checks refuse it (named as this API names its fields)."""
        values: dict[str, Any] = {
            "messages": self.chat_messages(),
            "max_tokens": self.max_tokens,
            "temperature": 1.0 if self.temperature is None else float(self.temperature),
            "top_p": None if self.top_p is None else float(self.top_p),
            "top_k": self.top_k,
            "stop": self.stop_sequences,
            "stream": self.stream,
        }
        if self.tools:
            values["tools"] = [
                Tool(
                    type="function",
                    function=build(
                        Function,
                        ("tools", i),
                        name=t.name,
                        description=t.description,
                        parameters=t.input_schema,
                    ),
                )
                for i, t in enumerate(self.tools)
            ]
        choice = self.tool_choice
        if choice is not None:
            values["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
                choice.type
            ) or build(
                NamedToolChoice,
                ("tool_choice",),
                type="function",
                function=NamedFunction(name=choice.name or ""),
            )
            if choice.disable_parallel_tool_use:
                values["parallel_tool_calls"] = False
        output = self.output_config
        if output is not None and output.format is not None:
            values["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": output.format.schema_},
            }
        try:
            return validate(MessagesChat, values)
        except InvalidRequestError as exc:  # named as this API names the field
            param = exc.param or ""
            if param.startswith("response_format"):
                message = exc.message.replace("response_format", "output_config.format")
                raise InvalidRequestError(message, "output_config.format") from None
            raise


class MessagesChat(ChatCompletionRequest):
    """The chat request a Messages request means, the engine's errors named as Messages
    names its fields."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    caps_max_tokens: ClassVar[bool] = True  # (as Anthropic's API does: the reply ends "max_tokens")

    @property
    def param_names(self) -> dict[str, str]:
        return {"max_tokens": "max_tokens", "prompt": "messages"}


def parse_messages(body: dict[str, Any]) -> MessagesRequest:
    return validate(MessagesRequest, body)


def parse_count_tokens(body: dict[str, Any]) -> MessagesRequest:
    """POST /v1/messages/count_tokens's body (a Messages request without max_tokens), as the
    Messages request whose prompt it counts."""
    return validate(MessagesRequest, {**body, "max_tokens": 1})
