"""The response object and its parts as typed models: field for field and in order, the JSON a
response is sent and stored as (what shape.py checks a stored file against)."""

# The JSON is model_dump() written by the server's JSON writers (one_line, starlette's, the
# store's), so that its bytes are what they were when these objects were dicts. Strict: the
# server builds these from values it has checked, and a value of another type is its own bug,
# never coerced (an echoed temperature of 0 stays 0, not 0.0).

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ItemStatus = Literal["in_progress", "completed"]
Status = Literal["in_progress", "completed", "incomplete", "failed"]


class Model(BaseModel):
    """The models' common configuration: strict, and no field beyond those declared."""

    model_config = ConfigDict(strict=True, extra="forbid")


def _new_id(prefix: str) -> Any:
    return Field(default_factory=lambda: f"{prefix}_{uuid.uuid4().hex}")


# ---- output items -------------------------------------------------------------------------------


class OutputText(Model):
    """A message's text part."""

    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)  # always [] (no citations)


class ReasoningText(Model):
    """A reasoning item's text part."""

    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class MessageItem(Model):
    """The reply's text: one output_text part."""

    type: Literal["message"] = "message"
    id: str = _new_id("msg")
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=lambda: [OutputText()])
    status: ItemStatus = "in_progress"

    def opening(self) -> MessageItem:
        """The item as response.output_item.added shows it: its part not yet added."""
        return self.model_copy(update={"content": [], "status": "in_progress"})


class ReasoningItem(Model):
    """The reply's reasoning block: one reasoning_text part, no summary."""

    type: Literal["reasoning"] = "reasoning"
    id: str = _new_id("rs")
    summary: list[Any] = Field(default_factory=list)  # always []
    content: list[ReasoningText] = Field(default_factory=lambda: [ReasoningText()])
    status: ItemStatus = "in_progress"

    def opening(self) -> ReasoningItem:
        """The item as response.output_item.added shows it: no text yet."""
        return self.model_copy(update={"content": [], "status": "in_progress"})


class FunctionCallItem(Model):
    """A tool call the model wrote (its arguments a JSON object's text)."""

    type: Literal["function_call"] = "function_call"
    id: str = _new_id("fc")
    call_id: str
    name: str
    arguments: str
    status: ItemStatus = "in_progress"

    def opening(self) -> FunctionCallItem:
        """The item as response.output_item.added shows it: its arguments still to come."""
        return self.model_copy(update={"arguments": "", "status": "in_progress"})


TextItem = MessageItem | ReasoningItem
OutputItem = MessageItem | ReasoningItem | FunctionCallItem


# ---- the response -------------------------------------------------------------------------------


class InputTokensDetails(Model):
    cached_tokens: int  # of the prompt, found in the prefix cache or restored from a session


class OutputTokensDetails(Model):
    reasoning_tokens: int = 0  # not counted apart from output_tokens


class Usage(Model):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, generated: int, cached: int) -> Usage:
        return cls(
            input_tokens=prompt,
            input_tokens_details=InputTokensDetails(cached_tokens=cached),
            output_tokens=generated,
            total_tokens=prompt + generated,
        )


class ResponseError(Model):
    """Why a response failed (the server's side: a request's own fault is an HTTP error)."""

    code: Literal["server_error"] = "server_error"
    message: str


class IncompleteDetails(Model):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class TextConfig(Model):
    format: dict[str, Any]  # text, json_object, or json_schema with its name, schema, strict


class ReasoningConfig(Model):
    effort: None = None  # the server takes no reasoning options
    summary: None = None


class ResponseObject(Model):
    """A response: its output items and usage, and the request's options it echoes (as the
    request gave them, its defaults where it gave none)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    parallel_tool_calls: bool | None
    previous_response_id: str | None
    temperature: int | float | None
    top_p: int | float | None
    tool_choice: str | dict[str, Any] | None
    tools: list[dict[str, Any]]
    text: TextConfig
    truncation: Literal["disabled"] = "disabled"
    store: bool
    metadata: dict[str, str]
    reasoning: ReasoningConfig = Field(default_factory=ReasoningConfig)
    usage: Usage | None = None
