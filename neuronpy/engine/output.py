"""Splits a reply's text stream into reasoning, content and tool calls, whatever the deltas."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from neuronpy.engine.reasoning import REASONING_MARKERS
from neuronpy.engine.tools import TOOL_FORMATS, new_call_id
from neuronpy.engine.types import OutputFormat, ToolCall


@dataclass
class Parsed:
    """What a stretch of text turned out to be."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)
        return self


class _State(enum.Enum):
    START = "start"  # nothing but whitespace yet: a reasoning block may still open
    REASONING = "reasoning"
    CONTENT = "content"
    TOOL_CALL = "tool_call"  # after a call's start marker: held until the call settles


class OutputParser:
    """The reasoning / tool-call state machine of one reply.

    A reasoning block is recognised at the very start of the reply (only whitespace before its
    start marker), or from the first character when the prompt left it open (`opened`). Tool
    calls, in the markup of the reply's tool format (engine/tools.py), are recognised in the
    content. Text that may still be the beginning of a marker, and
    whitespace that may come right before one, are held back until the next delta settles
    them, so the result never depends on where the deltas were cut; `finish` settles the rest.

    Whitespace around the markup is dropped: at both ends of the reasoning, at the start of the
    content after it, around tool calls, and at the end of a reply that made tool calls. A tool
    call is held until it settles (its closing tag, or the end of a list format's array): a
    well-formed one becomes a ToolCall; anything else (not JSON, no name, not closed by the
    end) comes back as content, markup included.
    """

    def __init__(self, output: OutputFormat, *, opened: bool = False) -> None:
        self._markers = REASONING_MARKERS[output.reasoning] if output.reasoning else None
        self._tools = output.tool_calls
        self._format = TOOL_FORMATS[output.tool_format]
        self._types = output.tool_types
        self._parallel = output.parallel_tool_calls
        if self._markers is None:
            self._state = _State.CONTENT
        else:
            self._state = _State.REASONING if opened else _State.START
        self._strip = self._state is _State.REASONING  # drop leading whitespace
        self._buf = ""  # text not yet settled
        self._pos = 0  # where _buf starts in the whole text
        self._cuts: list[int] = []  # where deltas began, while a tool call is held
        self._gap = ""  # whitespace before a held tool call: returned with it if malformed
        self._calls = 0  # well-formed tool calls so far
        self._out = Parsed()

    def push(self, text: str) -> Parsed:
        """Add a delta; return what it settled."""
        if text:
            if self._state is not _State.TOOL_CALL:
                self._cuts.clear()
            self._cuts.append(self._pos + len(self._buf))
            self._buf += text
            while self._step(final=False):
                pass
        return self._take()

    def finish(self) -> Parsed:
        """The end of the reply: settle everything still held."""
        while self._step(final=True):
            pass
        return self._take()

    def _take(self) -> Parsed:
        out, self._out = self._out, Parsed()
        return out

    def _consume(self, n: int) -> None:
        self._buf = self._buf[n:]
        self._pos += n

    def _step(self, final: bool) -> bool:
        """Settle what can be settled in the current state; True when the state changed."""
        if self._strip:
            self._consume(len(self._buf) - len(self._buf.lstrip()))
            if not self._buf:
                return False
            self._strip = False
        if self._state is _State.START:
            return self._start(final)
        if self._state is _State.REASONING:
            return self._reasoning(final)
        if self._state is _State.CONTENT:
            return self._content(final)
        return self._tool_call(final)

    def _start(self, final: bool) -> bool:
        assert self._markers is not None
        start = self._markers[0]
        text = self._buf.lstrip()
        if text.startswith(start):
            self._consume(len(self._buf) - len(text) + len(start))
            self._enter(_State.REASONING, strip=True)
            return True
        if not final and start.startswith(text):
            return False  # whitespace, or the start marker's beginning: wait
        self._enter(_State.CONTENT)
        return True

    def _reasoning(self, final: bool) -> bool:
        assert self._markers is not None
        buf, end = self._buf, self._markers[1]
        i = buf.find(end)
        if i >= 0:
            self._out.reasoning += buf[:i].rstrip()
            self._consume(i + len(end))
            self._enter(_State.CONTENT, strip=True)
            return True
        keep = len(buf.rstrip()) if final else _settled(buf, end)
        self._out.reasoning += buf[:keep]
        self._consume(len(buf) if final else keep)
        return False

    def _content(self, final: bool) -> bool:
        buf, start = self._buf, self._format.start
        if not self._tools:
            self._out.content += buf
            self._consume(len(buf))
            return False
        i = buf.find(start)
        if i >= 0:
            text = buf[:i].rstrip()
            self._out.content += text
            self._consume(i + len(start))
            self._enter(_State.TOOL_CALL)
            self._gap = buf[len(text) : i]
            return True
        if final:
            self._out.content += buf.rstrip() if self._calls else buf
            self._consume(len(buf))
            return False
        keep = _settled(buf, start)
        self._out.content += buf[:keep]
        self._consume(keep)
        return False

    def _tool_call(self, final: bool) -> bool:
        buf = self._buf
        settled = self._format.settle(buf, final, self._types)
        if settled is None:
            return False
        n = settled.consumed
        if settled.calls is None:  # not a call: it is text, markup included
            self._out.content += self._gap + self._format.start + buf[:n]
            self._consume(n)
            self._enter(_State.CONTENT)
            return True
        for call in settled.calls:
            if not (self._parallel or not self._calls):
                break
            if call.span is None:
                pieces: tuple[str, ...] = (call.arguments,)
            else:
                pieces = _cut(call.arguments, self._pos + call.span[0], self._cuts)
            self._out.tool_calls.append(
                ToolCall(self._calls, new_call_id(), call.name, call.arguments, pieces)
            )
            self._calls += 1
        self._consume(n)
        self._enter(_State.CONTENT, strip=True)
        return True

    def _enter(self, state: _State, *, strip: bool = False) -> None:
        self._state = state
        self._strip = strip
        self._gap = ""


def _settled(text: str, marker: str) -> int:
    """How much of `text` (which holds no whole `marker`) is settled: all of it but a suffix
    that may begin `marker` and the whitespace right before it (which goes if a marker
    follows)."""
    held = len(text)
    # Only the last len(marker) - 1 characters can begin an unfinished marker.
    i = text.find(marker[0], max(0, len(text) - len(marker) + 1))
    while i >= 0:
        if marker.startswith(text[i:]):
            held = i
            break
        i = text.find(marker[0], i + 1)
    return len(text[:held].rstrip())


def _cut(text: str, start: int, cuts: list[int]) -> tuple[str, ...]:
    """`text`, which begins at offset `start` of the whole stream, cut at the offsets `cuts`."""
    bounds = [c - start for c in cuts if start < c < start + len(text)]
    edges = [0, *bounds, len(text)]
    return tuple(text[a:b] for a, b in itertools.pairwise(edges) if b > a)
