"""A Responses response as it is built from a request's generation events: the response
object (output items, usage, status) and, streamed, each typed event in its order."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from neuronpy.engine.types import FinishReason, GenerationEvent, ToolCall
from neuronpy.server.errors import ApiError
from neuronpy.server.responses_api.protocol import chat_format


@dataclass
class Builder:
    """A response's output items, built from its events; `feed` also answers the stream's
    events for them, in the order the Responses API sends them."""

    rid: str
    model: str
    body: dict[str, Any]
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[dict[str, Any]] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    text: str = ""
    _open: dict[str, Any] | None = None
    _seq: int = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def snapshot(self, status: str, **extra: Any) -> dict[str, Any]:
        b = self.body
        fmt = chat_format(b.get("text")) or {"type": "text"}
        if fmt.get("type") == "json_schema":
            fmt = {"type": "json_schema", **fmt["json_schema"]}
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": [dict(item) for item in self.output] if status != "in_progress" else [],
            "error": None,
            "incomplete_details": None,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"),
            "temperature": b.get("temperature", 1.0),
            "top_p": b.get("top_p", 1.0),
            "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools") or [],
            "text": {"format": fmt},
            "truncation": "disabled",
            "store": b.get("store", True) is not False,
            "metadata": b.get("metadata") or {},
            "reasoning": {"effort": None, "summary": None},
            "usage": None,
            **extra,
        }

    def _close(self) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.output.index(item)
        events = []
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            events.append(
                self.event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            events.append(
                self.event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=dict(part),
                )
            )
        elif item["type"] == "reasoning":
            events.append(
                self.event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=item["content"][0]["text"],
                )
            )
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.output.append(item)
        self._open = item
        shown = {**item, "status": "in_progress"}
        if item["type"] == "message":
            shown["content"] = []
        if item["type"] == "reasoning":
            shown["content"] = []
        events.append(
            self.event("response.output_item.added", output_index=len(self.output) - 1, item=shown)
        )
        if item["type"] == "message":
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=len(self.output) - 1,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []},
                )
            )
        return events

    def feed(self, event: GenerationEvent) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if event.reasoning:
            if self._open is None or self._open["type"] != "reasoning":
                item = {
                    "type": "reasoning",
                    "id": f"rs_{uuid.uuid4().hex}",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}],
                }
                events += self._start(item)
            assert self._open is not None
            self._open["content"][0]["text"] += event.reasoning
            events.append(
                self.event(
                    "response.reasoning_text.delta",
                    item_id=self._open["id"],
                    output_index=len(self.output) - 1,
                    content_index=0,
                    delta=event.reasoning,
                )
            )
        if event.text:
            if self._open is None or self._open["type"] != "message":
                item = {
                    "type": "message",
                    "id": f"msg_{uuid.uuid4().hex}",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "", "annotations": []}],
                }
                events += self._start(item)
            assert self._open is not None
            self._open["content"][0]["text"] += event.text
            self.text += event.text
            events.append(
                self.event(
                    "response.output_text.delta",
                    item_id=self._open["id"],
                    output_index=len(self.output) - 1,
                    content_index=0,
                    delta=event.text,
                    logprobs=[],
                )
            )
        for call in event.tool_calls:
            self.calls.append(call)
            item = {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": call.id,
                "name": call.name,
                "arguments": call.arguments,
            }
            events += self._start({**item, "arguments": ""})
            self._open = item
            self.output[-1] = item
            index = len(self.output) - 1
            for piece in call.pieces or (call.arguments,):
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=index,
                        delta=piece,
                    )
                )
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=call.name,
                    arguments=call.arguments,
                )
            )
            events += self._close()
        return events

    def finish(
        self, last: GenerationEvent | None, cached_tokens: int, error: ApiError | None
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The whole response, and the stream's closing events."""
        events = self._close()
        prompt = last.prompt_tokens if last is not None else 0
        generated = last.completion_tokens if last is not None else 0
        usage = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": generated,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + generated,
        }
        if error is not None:
            failed = {"code": "server_error", "message": error.message}
            response = self.snapshot("failed", usage=usage, error=failed)
            events.append(self.event("response.failed", response=response))
        elif last is not None and last.finish_reason is FinishReason.LENGTH:
            details = {"reason": "max_output_tokens"}
            response = self.snapshot("incomplete", usage=usage, incomplete_details=details)
            events.append(self.event("response.incomplete", response=response))
        else:
            response = self.snapshot("completed", usage=usage)
            events.append(self.event("response.completed", response=response))
        return response, events

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
