"""OpenAI's response objects: streamed chunks, whole bodies and usage, for one choice or n."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from neuronpy.engine.types import FinishReason, GenerationEvent, TokenLogprob
from neuronpy.server.errors import ApiError
from neuronpy.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from neuronpy.server.requests import Kind

# The header a reply whose session could not be saved carries (its body says so too).
SESSION_ERROR_HEADER = "x-neuronpy-session-error"
_NOT_HEADER_TEXT = re.compile(r"[^\x20-\x7e]+")  # what an HTTP header value cannot hold
_MAX_HEADER_TEXT = 256


def header_text(text: str) -> str:
    """`text` as a header value: printable ASCII (anything else, line breaks included, one
    '?'), at most 256 characters."""
    return _NOT_HEADER_TEXT.sub("?", text)[:_MAX_HEADER_TEXT]


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    drafts: tuple[int, int] = (0, 0),
) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens`: prompt tokens restored from the prefix cache; `drafts`:
    (drafted, accepted) tokens of speculative decoding, said as OpenAI's accepted and rejected
    prediction tokens when there were any."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    drafted, accepted = drafts
    if drafted:
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        }
    return out


@dataclass(frozen=True)
class Reply:
    """Builds one choice's response objects, streamed (chunks) or whole (a choice of the body).
    The n choices of a request are n Replies sharing an id and differing in `index`."""

    kind: Kind
    model: str
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    index: int = 0  # the choice this reply's chunks and body are
    texts: TokenTexts | None = None  # given when the request asked for log-probabilities
    # what the stream has sent so far: tool calls, and the characters of the tokens' texts
    _sent: dict[str, int] = field(
        default_factory=lambda: {"tool_calls": 0, "chars": 0},
        init=False,
        compare=False,
        repr=False,
    )

    def __post_init__(self) -> None:
        if not self.id:
            prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
            object.__setattr__(self, "id", f"{prefix}-{uuid.uuid4().hex}")

    def _envelope(self, choices: list[dict[str, Any]], streaming: bool) -> dict[str, Any]:
        obj = {"chat": "chat.completion", "text": "text_completion"}[self.kind]
        return {
            "id": self.id,
            "object": f"{obj}.chunk" if streaming and self.kind == "chat" else obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def _chunk(
        self,
        output: dict[str, Any],
        logprobs: dict[str, Any] | None = None,
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        """A streamed chunk of this choice: `output` is its delta (chat) or text (completions)."""
        choice = {
            "index": self.index,
            **output,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        out = self._envelope([choice], streaming=True)
        if self.include_usage:
            out["usage"] = None  # (only the usage chunk has one)
        return out

    def opening_chunk(self) -> dict[str, Any]:
        """Chat's first chunk: the role."""
        return self._chunk({"delta": {"role": "assistant", "content": ""}})

    def finishing_chunk(self, finish_reason: str) -> dict[str, Any]:
        """The chunk that ends the choice: an empty delta or text, and why it ended."""
        output = {"delta": {}} if self.kind == "chat" else {"text": ""}
        return self._chunk(output, finish_reason=finish_reason)

    def stream_chunks(self, event: GenerationEvent, error: ApiError | None) -> list[dict[str, Any]]:
        """An event's chunks: its new output, then, when it ends the choice, the finishing
        chunk, or (`error`: it did not finish) an abort's finishing chunk and the error."""
        chunks = self._output_chunks(event)
        reason = event.finish_reason
        if error is not None:
            if reason is FinishReason.ABORT:  # cut short (shutdown): say so, then why
                chunks.append(self.finishing_chunk(reason.value))
            chunks.append(error.body())
        elif reason is not None:
            chunks.append(self.finishing_chunk(self.finish_reason(reason)))
            if event.session_error is not None:  # the reply stands; its session was not saved
                chunks[-1]["session_error"] = event.session_error
        return chunks

    def _output_chunks(self, event: GenerationEvent) -> list[dict[str, Any]]:
        """The streamed chunks of an event's new output, none if it has none: the reasoning,
        the content, then each tool call as OpenAI streams one (its id and name first, then
        its arguments piece by piece). The event's log-probabilities ride on the first."""
        logprobs = self._logprobs(event.logprobs) if event.logprobs else None
        if self.kind == "text":
            if not event.text and logprobs is None:
                return []
            return [self._chunk({"text": event.text}, logprobs)]
        deltas: list[dict[str, Any]] = []
        if event.reasoning:
            # both names: vLLM's current `reasoning`, llama.cpp's and DeepSeek's
            deltas.append({"reasoning": event.reasoning, "reasoning_content": event.reasoning})
        if event.text:
            deltas.append({"content": event.text})
        for call in event.tool_calls:
            self._sent["tool_calls"] += 1
            function = {"name": call.name, "arguments": ""}
            head = {"index": call.index, "id": call.id, "type": "function", "function": function}
            deltas.append({"tool_calls": [head]})
            deltas.extend(
                {"tool_calls": [{"index": call.index, "function": {"arguments": piece}}]}
                for piece in call.pieces
            )
        if not deltas and logprobs is not None:
            deltas.append({})
        return [self._chunk({"delta": d}, None if k else logprobs) for k, d in enumerate(deltas)]

    def finish_reason(self, reason: FinishReason) -> str:
        """OpenAI's finish_reason: "tool_calls" for a streamed reply that stopped after
        making tool calls."""
        if reason is FinishReason.STOP and self._sent["tool_calls"]:
            return "tool_calls"
        return reason.value

    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens (None unless the request asked)."""
        if self.texts is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(self.texts, logprobs)
        out = completion_logprobs(self.texts, logprobs, self._sent["chars"])
        self._sent["chars"] += sum(len(token) for token in out["tokens"])
        return out

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        out = self._envelope([], streaming=True)
        out["usage"] = usage
        return out

    def choice(self, events: Sequence[GenerationEvent]) -> dict[str, Any]:
        """This choice of the whole (non-streamed) response, from all of its events, the last
        of which finished it: its text, reasoning, tool calls and log-probabilities."""
        text = "".join(e.text for e in events)
        reason = events[-1].finish_reason
        assert reason is not None
        finish_reason = reason.value
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            reasoning = "".join(e.reasoning for e in events)
            if reasoning:
                message["reasoning"] = message["reasoning_content"] = reasoning
            calls = [call for e in events for call in e.tool_calls]
            if calls:
                message["content"] = text or None
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in calls
                ]
                if reason is FinishReason.STOP:
                    finish_reason = "tool_calls"
            choice: dict[str, Any] = {"index": self.index, "message": message}
        else:
            choice = {"index": self.index, "text": text}
        logprobs = self._logprobs([lp for e in events for lp in e.logprobs])
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        return choice

    def body(
        self,
        choices: list[dict[str, Any]],
        usage: dict[str, Any],
        session_error: str | None = None,
    ) -> dict[str, Any]:
        """The whole (non-streamed) response: every choice, and the usage of them all; and,
        when the request's session could not be saved, why (the reply stands)."""
        out = self._envelope(choices, streaming=False)
        out["usage"] = usage
        if session_error is not None:
            out["session_error"] = session_error
        return out
