"""A Responses stream's events as typed models, one per event type the server sends: each
serializes to the `data:` of its server-sent event, `type` and `sequence_number` first."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from neuronpy.server.responses_api.objects import Model, OutputItem, OutputText, ResponseObject


class Event(Model):
    """What every event has: its type and its place in the stream, from 0."""

    type: str
    sequence_number: int


# ---- the response's status ---------------------------------------------------------------------


class ResponseCreated(Event):
    type: Literal["response.created"] = "response.created"
    response: ResponseObject


class ResponseInProgress(Event):
    type: Literal["response.in_progress"] = "response.in_progress"
    response: ResponseObject


class ResponseCompleted(Event):
    type: Literal["response.completed"] = "response.completed"
    response: ResponseObject


class ResponseIncomplete(Event):
    type: Literal["response.incomplete"] = "response.incomplete"
    response: ResponseObject


class ResponseFailed(Event):
    type: Literal["response.failed"] = "response.failed"
    response: ResponseObject


# ---- output items --------------------------------------------------------------------------------


class OutputItemAdded(Event):
    type: Literal["response.output_item.added"] = "response.output_item.added"
    output_index: int
    item: OutputItem


class OutputItemDone(Event):
    type: Literal["response.output_item.done"] = "response.output_item.done"
    output_index: int
    item: OutputItem


# ---- an item's text part (a message's output_text, a reasoning item's reasoning_text) -----------


class PartEvent(Event):
    """An event about one text part of an output item."""

    item_id: str
    output_index: int
    content_index: int


class ContentPartAdded(PartEvent):
    type: Literal["response.content_part.added"] = "response.content_part.added"
    part: OutputText


class ContentPartDone(PartEvent):
    type: Literal["response.content_part.done"] = "response.content_part.done"
    part: OutputText


class OutputTextDelta(PartEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str
    logprobs: list[Any] = Field(default_factory=list)  # always []: not asked for here


class OutputTextDone(PartEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningTextDelta(PartEvent):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    delta: str


class ReasoningTextDone(PartEvent):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    text: str


# ---- a function call's arguments ---------------------------------------------------------------


class FunctionCallArgumentsDelta(Event):
    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta"
    )
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(Event):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str
