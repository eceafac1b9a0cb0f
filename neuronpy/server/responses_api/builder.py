"""A Responses response as it is built from a request's generation events: the response
object (output items, usage, status) and, streamed, each typed event in its order."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from neuronpy.engine.types import FinishReason, GenerationEvent, ToolCall
from neuronpy.server.errors import ApiError
from neuronpy.server.responses_api.events import (
    ContentPartAdded,
    ContentPartDone,
    Event,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    OutputItemAdded,
    OutputItemDone,
    OutputTextDelta,
    OutputTextDone,
    ReasoningTextDelta,
    ReasoningTextDone,
    ResponseCompleted,
    ResponseCreated,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInProgress,
)
from neuronpy.server.responses_api.objects import (
    FunctionCallItem,
    IncompleteDetails,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ResponseError,
    ResponseObject,
    Status,
    TextConfig,
    TextItem,
    Usage,
)
from neuronpy.server.responses_api.protocol import format_echo


@dataclass(frozen=True)
class _TextKind:
    """What differs between the two items whose text streams as deltas: the message's and the
    reasoning block's (whose part, besides, is not announced with content_part events)."""

    item: type[MessageItem] | type[ReasoningItem]
    delta: type[OutputTextDelta] | type[ReasoningTextDelta]
    done: type[OutputTextDone] | type[ReasoningTextDone]


MESSAGE = _TextKind(MessageItem, OutputTextDelta, OutputTextDone)
REASONING = _TextKind(ReasoningItem, ReasoningTextDelta, ReasoningTextDone)


def _started(rid: str, model: str, created_at: int, body: dict[str, Any]) -> ResponseObject:
    """The response as it starts: in progress, and what it echoes of request `body` (its
    defaults where it gave none), which every later state of it keeps."""
    fmt = format_echo(body.get("text"))
    return ResponseObject(
        id=rid,
        created_at=created_at,
        status="in_progress",
        model=model,
        instructions=body.get("instructions"),
        max_output_tokens=body.get("max_output_tokens"),
        parallel_tool_calls=body.get("parallel_tool_calls", True),
        previous_response_id=body.get("previous_response_id"),
        temperature=body.get("temperature", 1.0),
        top_p=body.get("top_p", 1.0),
        tool_choice=body.get("tool_choice", "auto"),
        tools=body.get("tools") or [],
        text=TextConfig(format=fmt),
        store=body.get("store", True) is not False,
        metadata=body.get("metadata") or {},
    )


@dataclass
class Builder:
    """A response's output items, built from its events; `opened`, `feed` and `finish` also
    answer the stream's events for them, in the order the Responses API sends them."""

    rid: str
    model: str
    body: dict[str, Any]
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[OutputItem] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    text: str = ""
    _open: OutputItem | None = None
    _numbers: Iterator[int] = field(default_factory=itertools.count)
    _opening: ResponseObject = field(init=False)

    def __post_init__(self) -> None:
        self._opening = _started(self.rid, self.model, self.created_at, self.body)

    def _next(self) -> int:
        """The next event's sequence_number."""
        return next(self._numbers)

    def opened(self) -> list[Event]:
        """The stream's first events: response.created and .in_progress."""
        return [
            ResponseCreated(sequence_number=self._next(), response=self._opening),
            ResponseInProgress(sequence_number=self._next(), response=self._opening),
        ]

    def feed(self, event: GenerationEvent) -> list[Event]:
        """The stream's events for one generation event: its reasoning, its text, its calls."""
        events: list[Event] = []
        if event.reasoning:
            events += self._grow(REASONING, event.reasoning)
        if event.text:
            events += self._grow(MESSAGE, event.text)
            self.text += event.text
        for call in event.tool_calls:
            self.calls.append(call)
            item = FunctionCallItem(call_id=call.id, name=call.name, arguments=call.arguments)
            events += self._start(item)
            index = len(self.output) - 1
            for piece in call.pieces or (call.arguments,):
                events.append(
                    FunctionCallArgumentsDelta(
                        sequence_number=self._next(),
                        item_id=item.id,
                        output_index=index,
                        delta=piece,
                    )
                )
            events.append(
                FunctionCallArgumentsDone(
                    sequence_number=self._next(),
                    item_id=item.id,
                    output_index=index,
                    name=call.name,
                    arguments=call.arguments,
                )
            )
            events += self._close()
        return events

    def _grow(self, kind: _TextKind, delta: str) -> list[Event]:
        """`delta` added to the text of the open item of `kind` (opened first unless it is the
        one open), and its delta event."""
        events = [] if isinstance(self._open, kind.item) else self._start(kind.item())
        item = self._open
        assert isinstance(item, MessageItem | ReasoningItem)
        item.content[0].text += delta
        events.append(
            kind.delta(
                sequence_number=self._next(),
                item_id=item.id,
                output_index=len(self.output) - 1,
                content_index=0,
                delta=delta,
            )
        )
        return events

    def _start(self, item: OutputItem) -> list[Event]:
        """The open item closed, and `item` added as the open one."""
        events = self._close()
        self.output.append(item)
        self._open = item
        index = len(self.output) - 1
        events.append(
            OutputItemAdded(sequence_number=self._next(), output_index=index, item=item.opening())
        )
        if isinstance(item, MessageItem):  # (a reasoning item's part is not announced)
            events.append(
                ContentPartAdded(
                    sequence_number=self._next(),
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    part=item.content[0].model_copy(),
                )
            )
        return events

    def _close(self) -> list[Event]:
        """The open item completed: its text's closing events, then its own."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.output) - 1  # the open item is the last one
        item.status = "completed"
        events: list[Event] = []
        if isinstance(item, MessageItem | ReasoningItem):
            events += self._text_done(item, index)
        events.append(OutputItemDone(sequence_number=self._next(), output_index=index, item=item))
        return events

    def _text_done(self, item: TextItem, index: int) -> list[Event]:
        """A text item's closing events for its part: its whole text, then (a message's) the
        part done."""
        kind = MESSAGE if isinstance(item, MessageItem) else REASONING
        part = item.content[0]
        events: list[Event] = [
            kind.done(
                sequence_number=self._next(),
                item_id=item.id,
                output_index=index,
                content_index=0,
                text=part.text,
            )
        ]
        if isinstance(part, OutputText):
            events.append(
                ContentPartDone(
                    sequence_number=self._next(),
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    part=part.model_copy(),
                )
            )
        return events

    def finish(
        self, last: GenerationEvent | None, cached_tokens: int, error: ApiError | None
    ) -> tuple[ResponseObject, list[Event]]:
        """The whole response, and the stream's closing events."""
        events = self._close()
        prompt = last.prompt_tokens if last is not None else 0
        generated = last.completion_tokens if last is not None else 0
        usage = Usage.of(prompt, generated, cached_tokens)
        if error is not None:
            response = self._ended("failed", usage, error=ResponseError(message=error.message))
            events.append(ResponseFailed(sequence_number=self._next(), response=response))
        elif last is not None and last.finish_reason is FinishReason.LENGTH:
            response = self._ended("incomplete", usage, incomplete_details=IncompleteDetails())
            events.append(ResponseIncomplete(sequence_number=self._next(), response=response))
        else:
            response = self._ended("completed", usage)
            events.append(ResponseCompleted(sequence_number=self._next(), response=response))
        return response, events

    def _ended(self, status: Status, usage: Usage, **why: Any) -> ResponseObject:
        """The response ended: its output, its usage, and why it failed or stopped short."""
        update = {"status": status, "output": list(self.output), "usage": usage, **why}
        return self._opening.model_copy(update=update)

    def reply_message(self) -> dict[str, Any]:
        """The reply as a chat message, for the conversation a follow-up continues."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in self.calls
            ]
        return message
