"""A Responses request as a typed model (`ResponsesRequest`), and the chat request it means
(`ResponsesChat`): its input items as chat messages, its function tools as chat tools, its
`text.format` as the constraint. Every field is checked here under the name the Responses
client sent (`input[1].call_id`, `tools[0].name`, `text.format.schema`), so the chat request
it becomes is built from checked values and its errors never need renaming: what the chat
request checks again is named alike in both APIs (`tool_choice`, `temperature`), and the
engine's errors are named by `ResponsesChat.param_names`."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator

from neuronpy.engine.types import Constraint
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
    url_part,
)
from neuronpy.server.constraints import tool_constraint
from neuronpy.server.protocol import REASONING_EFFORTS, ChatCompletionRequest
from neuronpy.server.schema import (
    FieldError,
    WireModel,
    build,
    by_type,
    either,
    json_type,
    validate,
)
from neuronpy.server.structure import decode_json

MAX_METADATA_KEYS = 16  # OpenAI's limits on a response's metadata
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


def check_metadata(value: object) -> dict[str, str]:
    """A request's `metadata` as OpenAI takes it: at most 16 pairs, keys strings of at most
    64 characters, values strings of at most 512; None is {}. InvalidRequestError naming the
    field (`metadata`, or `metadata.KEY` for a bad value) otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError("'metadata' must be an object of string values", "metadata")
    if len(value) > MAX_METADATA_KEYS:
        raise InvalidRequestError(
            f"'metadata' holds {len(value)} keys; at most {MAX_METADATA_KEYS} are allowed",
            "metadata",
        )
    for key, item in value.items():
        if not isinstance(key, str) or len(key) > MAX_METADATA_KEY:
            got = f"{len(key)} ({key[:20]!r}...)" if isinstance(key, str) else repr(key)[:20]
            raise InvalidRequestError(
                f"'metadata' keys must be strings of at most {MAX_METADATA_KEY} characters, "
                f"got one of {got}",
                "metadata",
            )
        if not isinstance(item, str) or len(item) > MAX_METADATA_VALUE:
            what = f"{len(item)} characters" if isinstance(item, str) else type(item).__name__
            raise InvalidRequestError(
                f"'metadata.{key}' must be a string of at most {MAX_METADATA_VALUE} characters, "
                f"got {what}",
                f"metadata.{key}",
            )
    return value


TEXT_PARTS = ("input_text", "output_text", "text")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class ContentPart(WireModel):
    type: str  # a text part's: TEXT_PARTS, or "input_image" (the item's check says so)
    text: str | None = None
    image_url: str | None = None  # an input_image's: a data: URI
    file_id: str | None = None  # (an input_image's file: refused, no file is stored here)
    detail: str | None = None


Content = either(("a string", str), ("an array", list[ContentPart]))


def _text(content: str | list[ContentPart]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.text or "" for part in content)


def _content(content: str | list[ContentPart], at: tuple[str | int, ...]) -> str | list[TextPart]:
    """A message's content as the chat's: its text, or (with images) its text and image
    parts in order."""
    if isinstance(content, str) or not any(p.type == "input_image" for p in content):
        return _text(content)
    where = ".".join(str(a) if isinstance(a, str) else f"[{a}]" for a in at).replace(".[", "[")
    return [
        url_part(p.image_url or "", f"{where}.content[{j}].image_url")
        if p.type == "input_image"
        else TextPart(type="text", text=p.text or "")
        for j, p in enumerate(content)
    ]


def _only_text(content: str | list[ContentPart], images: bool = False) -> None:
    """Text parts only (`images`: input_image parts too, each with an image_url)."""
    if not isinstance(content, list):
        return
    for j, part in enumerate(content):
        if images and part.type == "input_image":
            if part.file_id is not None and part.image_url is None:
                raise FieldError(
                    f"'{{at}}.content[{j}]': no file is stored here; send the image as a "
                    "data: URI in image_url",
                    "{at}.content",
                )
            if not part.image_url:
                raise FieldError(f"'{{at}}.content[{j}]' needs an image_url", "{at}.content")
        elif part.type not in TEXT_PARTS or part.text is None:
            allowed = "input_text, output_text" + (", input_image" if images else "")
            raise FieldError(f"'{{at}}.content' takes only parts of {allowed}", "{at}.content")


class InputMessage(WireModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _parts(self) -> InputMessage:
        _only_text(self.content, images=self.role == "user")
        return self


class FunctionCallItem(WireModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON (ResponsesRequest checks it, naming the item)


class FunctionCallOutput(WireModel):
    type: Literal["function_call_output"]
    call_id: str
    output: Content  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _rules(self) -> FunctionCallOutput:
        if not self.call_id:
            raise FieldError("'{at}.call_id' must be a non-empty string", "{at}.call_id")
        _only_text(self.output)
        return self


class ReasoningInput(WireModel):
    type: Literal["reasoning"]  # (the template is given no earlier reasoning)


Item = by_type(
    "message",
    message=InputMessage,
    function_call=FunctionCallItem,
    function_call_output=FunctionCallOutput,
    reasoning=ReasoningInput,
)


class FunctionTool(Function):
    """A Responses function tool: chat's function, flat (no `function` under it)."""

    type: str

    @model_validator(mode="before")
    @classmethod
    def _function_only(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") != "function":
            raise FieldError(
                "'{at}' must be a function tool; this server has no built-in tools", "{at}.type"
            )
        return value

    def as_chat(self, index: int) -> Tool:
        """This tool (`tools[index]`) as chat's."""
        function = build(
            Function,
            ("tools", index),
            name=self.name,
            description=self.description,
            parameters=self.parameters,
            strict=self.strict,
        )
        return Tool(type="function", function=function)


class FunctionChoice(WireModel):
    type: Literal["function"]
    name: str


class TextFormat(WireModel):
    type: str
    name: str | None = None
    json_schema: Any = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(WireModel):
    format: TextFormat | None = None


class ResponsesRequest(WireModel):
    """POST /v1/responses."""

    model: str | None = None
    input: either(("a string", str), ("an array", list[Item]))  # type: ignore[valid-type]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: either(("a string", str), ("an array", list[str])) | None = None  # type: ignore[valid-type]
    speculative: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: either(("a string", str), ("an object", FunctionChoice)) | None = None  # type: ignore[valid-type]
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: Any = None  # echoed and stored: check_metadata's limits
    # {"effort": ...}: the chat template's reasoning_effort (gpt-oss's writes it into its system
    # message); what else it holds, or an effort that is not OpenAI's, is ignored
    reasoning: Any = None
    # asked for but not served: refused by name rather than ignored
    background: bool | None = None
    include: list[str] | None = None
    _format: Constraint | None = PrivateAttr(default=None)

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise InvalidRequestError(
                "'input' must be a string or a non-empty list of items", "input"
            )
        for i, item in enumerate(value):
            where = f"input[{i}]"
            if not isinstance(item, dict):
                raise InvalidRequestError(f"'{where}' must be an object", where)
            kind = item.get("type", "message")
            if kind not in ITEM_TYPES:
                raise InvalidRequestError(
                    f"'{where}.type' {str(kind)[:40]!r} is not supported; this server takes "
                    "message, function_call, function_call_output and reasoning items",
                    f"{where}.type",
                )
        return value

    @field_validator("input")
    @classmethod
    def _arguments(cls, value: Any) -> Any:
        # JSON, as chat's checks take it (the template writes it parsed): checked here, so
        # that the error names this item rather than the chat message it becomes
        for i, item in enumerate(value if isinstance(value, list) else ()):
            if isinstance(item, FunctionCallItem):
                decode_json(item.arguments, ("input", i, "arguments"))
        return value

    @field_validator("max_output_tokens")
    @classmethod
    def _max_output_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise InvalidRequestError(
                "'max_output_tokens' must be an integer >= 1", "max_output_tokens"
            )
        return value

    @field_validator("tools")
    @classmethod
    def _toolbox(cls, tools: list[FunctionTool] | None) -> list[FunctionTool] | None:
        if tools is not None:
            check_toolbox([tool.name for tool in tools], "tools[{i}].name")
        return tools

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: Any) -> Any:
        check_metadata(value)
        return value

    @model_validator(mode="after")
    def _whole(self) -> ResponsesRequest:
        if self.background:
            raise InvalidRequestError(
                "'background' responses are not supported: ask without it (streamed, if the "
                "client should not wait for the whole response)",
                "background",
            )
        for item in self.include or ():
            if item == "reasoning.encrypted_content":
                # (Codex asks it with store false: the reply's reasoning is in its content in
                # the clear, and earlier reasoning is not given to the template either way)
                continue
            raise InvalidRequestError(
                f"'include' {item[:60]!r} is not supported by this server (nothing extra can "
                "be included in a response: ask /v1/chat/completions for log-probabilities)",
                "include",
            )
        self._format = self._format_constraint()
        return self

    @property
    def streamed(self) -> bool:
        return bool(self.stream)

    @property
    def stored(self) -> bool:
        return self.store is not False

    def _format_constraint(self) -> Constraint | None:
        """`text.format`: free text, any JSON object, or JSON of the schema it gives."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return Constraint("json_object", param="text.format")
        if fmt.type == "json_schema":
            if not isinstance(fmt.json_schema, dict):
                raise InvalidRequestError(
                    "'text.format.schema' must be a JSON Schema object, got "
                    f"{json_type(fmt.json_schema)}",
                    "text.format.schema",
                )
            return Constraint(
                "json_schema", json.dumps(fmt.json_schema), param="text.format.schema"
            )
        raise InvalidRequestError(
            "'text.format' must be an object whose type is 'text', 'json_object' or 'json_schema'",
            "text.format",
        )

    def messages(self) -> list[Message]:
        """`input` as chat messages: a function call joins the assistant message before it
        (or makes one); a call's output is a tool message; reasoning items are skipped."""
        if isinstance(self.input, str):
            return [build(Message, ("input",), role="user", content=self.input)]
        out: list[Message] = []
        for i, item in enumerate(self.input):
            at = ("input", i)
            if isinstance(item, InputMessage):
                content = _content(item.content, at)
                out.append(build(Message, at, role=item.role, content=content))
            elif isinstance(item, FunctionCallItem):
                function = build(CalledFunction, at, name=item.name, arguments=item.arguments)
                call = build(ToolCall, at, id=item.call_id, type="function", function=function)
                if out and out[-1].role == "assistant":
                    out[-1].tool_calls = [*(out[-1].tool_calls or ()), call]
                else:
                    out.append(build(Message, at, role="assistant", content="", tool_calls=[call]))
            elif isinstance(item, FunctionCallOutput):
                out.append(
                    build(
                        Message,
                        at,
                        role="tool",
                        tool_call_id=item.call_id,
                        content=_text(item.output),
                    )
                )
        return out

    def conversation(self) -> list[dict[str, Any]]:
        """`input` as the chat messages a stored response keeps (no instructions: a follow-up
        does not inherit them)."""
        return [message.model_dump(exclude_none=True) for message in self.messages()]

    def chat(self, history: list[Message]) -> ResponsesChat:
        """The chat request this one means after `history` (a stored response's conversation,
        when it continues one); InvalidRequestError where the chat request's own checks
        refuse it (named alike in both APIs)."""
        messages = [*history, *self.messages()]
        if not messages:
            raise InvalidRequestError(
                "'input' holds no message to answer (reasoning items alone are skipped)", "input"
            )
        if self.instructions is not None:  # (the conversation stored does not keep them)
            messages.insert(
                0, build(Message, ("instructions",), role="system", content=self.instructions)
            )
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = build(
                NamedToolChoice,
                ("tool_choice",),
                type="function",
                function=NamedFunction(name=choice.name),
            )
        values: dict[str, Any] = {
            "messages": messages,
            "tools": [tool.as_chat(i) for i, tool in enumerate(self.tools)] if self.tools else None,
            "tool_choice": choice,
            "max_tokens": self.max_output_tokens,
            "text_format": self._format,
        }
        for name in ("temperature", "top_p", "top_k", "seed", "stop", "speculative"):
            values[name] = getattr(self, name)
        values["parallel_tool_calls"] = self.parallel_tool_calls
        effort = self.reasoning.get("effort") if isinstance(self.reasoning, dict) else None
        if effort in REASONING_EFFORTS:
            values["reasoning_effort"] = effort
        return validate(ResponsesChat, values)


class ResponsesChat(ChatCompletionRequest):
    """The chat request a Responses request means: its constraint the one `text.format`
    asked for (named so), and the engine's errors named as the Responses request names its
    fields."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    text_format: Constraint | None = None

    def _own_constraint(self) -> Constraint | None:
        return tool_constraint(self.chat_tools, self.text_format, self._generic_tools)

    @property
    def param_names(self) -> dict[str, str]:
        return {"max_tokens": "max_output_tokens", "prompt": "input"}


def stored_messages(messages: list[dict[str, Any]]) -> list[Message]:
    """A stored response's conversation (chat messages, as the store keeps them) as models."""
    return [Message.model_validate(message) for message in messages]


def format_echo(text: object) -> dict[str, Any]:
    """`text.format` as a response echoes it: as the request gave it (a JSON Schema format's
    name, schema and strict only), or text."""
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict):
        return {"type": "text"}
    if fmt.get("type") == "json_schema":
        return {
            "type": "json_schema",
            **{k: fmt[k] for k in ("name", "schema", "strict") if k in fmt},
        }
    return fmt


def parse_responses(body: dict[str, Any]) -> ResponsesRequest:
    """A Responses body as its model; InvalidRequestError naming the first wrong field."""
    return validate(ResponsesRequest, body)
