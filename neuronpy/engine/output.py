"""Splits a reply's text stream into reasoning, content and tool calls, whatever the deltas."""

from __future__ import annotations

import enum
import itertools
import json
import re
from dataclasses import dataclass, field

from neuronpy.engine import harmony
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


class _DeltaParser:
    """What both reply parsers share: deltas are added to a buffer until a step of the
    parser's state machine settles them (`_step`); where each delta began is kept while a
    tool call is held (`_holding_call`), so that its arguments stream in the pieces the model
    wrote them in."""

    _buf: str
    _pos: int
    _cuts: list[int]
    _out: Parsed

    def push(self, text: str) -> Parsed:
        """Add a delta; return what it settled."""
        if text:
            if not self._holding_call():
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

    def _holding_call(self) -> bool:
        raise NotImplementedError

    def _step(self, final: bool) -> bool:
        raise NotImplementedError


class OutputParser(_DeltaParser):
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

    def _holding_call(self) -> bool:
        return self._state is _State.TOOL_CALL

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


# ---- gpt-oss's harmony: a reply of framed messages (engine/harmony.py) -------------------------

# What may close a message's body: its end, the reply's end, a call's end, or (a model that
# left out <|end|>) the next message's start, which is not consumed with the body.
_TERMINATORS = (harmony.END, harmony.RETURN, harmony.CALL, harmony.START)
# A header longer than this without its <|message|> is not one: the reply is text from there.
MAX_HARMONY_HEADER = 256
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"\s*([A-Za-z_]+)")


class _Harmony(enum.Enum):
    START = "start"  # the reply's beginning: its first header, or text
    HEADER = "header"  # after <|start|>: the message's role, channel and recipient
    BODY = "body"  # after <|message|>
    BETWEEN = "between"  # after a message's end: the next <|start|>
    TEXT = "text"  # framing that is not harmony's: the rest is content as written


def _header(text: str) -> tuple[str, str | None] | None:
    """A message header's channel and recipient (None: no recipient), from its text between
    <|start|> (or the reply's beginning) and <|message|>, such as `assistant<|channel|>final`,
    `<|channel|>commentary to=functions.f <|constrain|>json` or `assistant to=functions.f
    <|channel|>commentary json`; None when it is not one."""
    i = text.find(harmony.CHANNEL)
    if i < 0:
        return None
    role, rest = text[:i], text[i + len(harmony.CHANNEL) :]
    name = _CHANNEL_NAME.match(rest)
    if name is None:
        return None
    recipient = None
    for part in (role, rest[name.end() :]):
        found = _RECIPIENT.search(part)
        if found is not None:
            recipient = found.group(1)
    if _RECIPIENT.sub("", role).strip() not in ("", "assistant"):
        return None
    return name.group(1), recipient


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Where the suffix of `text` that may still begin one of `markers` starts (len(text)
    when none may)."""
    longest = max(len(m) for m in markers)
    for i in range(max(0, len(text) - longest + 1), len(text)):
        if any(m.startswith(text[i:]) for m in markers):
            return i
    return len(text)


class HarmonyParser(_DeltaParser):
    """OutputParser's counterpart for gpt-oss's harmony replies (same push / finish): the
    analysis channel's messages are reasoning, final and commentary messages without a
    recipient are content, and a commentary message to `functions.NAME` whose body is a JSON
    object is a tool call. The framing (<|start|>assistant<|channel|>final<|message|>, <|end|>,
    ...) is dropped. Bodies stream as they come, less a suffix that may begin a terminator;
    a call is held until it ends (<|call|>, or the reply's end, as <|call|> usually stops the
    reply without becoming text).

    What does not fit: a reply that does not begin with a header (at `<|channel|>` or
    `<|start|>`), or a header that is not one, makes the rest of the reply content as written,
    framing included; a message to another recipient (a built-in tool, or any when the request
    has no tools), a call whose body is not a JSON object, and an analysis message when the
    reasoning parser is off come back as content as written, framing included."""

    def __init__(self, output: OutputFormat, *, opened: bool = False) -> None:
        self._reasons = output.reasoning == harmony.NAME
        self._tools = output.tool_calls
        self._parallel = output.parallel_tool_calls
        self._buf = ""  # text not yet settled
        self._pos = 0  # where _buf starts in the whole text
        self._cuts: list[int] = []  # where deltas began, while a call is held
        self._calls = 0
        self._out = Parsed()
        self._raw = ""  # the current message's text so far (its framing), for a fallback
        self._said = {"reasoning": False, "content": False}  # a message of the kind ended
        self._fresh = True  # the current body has emitted nothing yet
        self._kind = "content"  # where the current body goes: reasoning, content, call, text
        self._name = ""  # the current call's function
        self._frame = ""  # the current call's framing, shown with it if it is not a call
        self._state = _Harmony.START
        if opened:  # the prompt ended with <|channel|>analysis<|message|>
            self._open_body("reasoning" if self._reasons else "content")

    def _holding_call(self) -> bool:
        return self._state is _Harmony.BODY and self._kind == "call"

    def _consume(self, n: int) -> str:
        taken, self._buf = self._buf[:n], self._buf[n:]
        self._pos += n
        return taken

    def _step(self, final: bool) -> bool:
        if self._state is _Harmony.START:
            return self._start(final)
        if self._state is _Harmony.HEADER:
            return self._header(final)
        if self._state is _Harmony.BODY:
            return self._body(final)
        if self._state is _Harmony.BETWEEN:
            return self._between(final)
        self._out.content += self._consume(len(self._buf))
        return False

    def _start(self, final: bool) -> bool:
        text = self._buf.lstrip()
        for opener in (harmony.START, harmony.CHANNEL):
            if text.startswith(opener):
                self._consume(len(self._buf) - len(text))
                if opener == harmony.START:
                    self._raw = self._consume(len(opener))
                self._state = _Harmony.HEADER
                return True
        if not final and any(o.startswith(text) for o in (harmony.START, harmony.CHANNEL)):
            return False  # whitespace, or an opener's beginning: wait
        self._state = _Harmony.TEXT
        return True

    def _header(self, final: bool) -> bool:
        buf = self._buf
        i = buf.find(harmony.MESSAGE)
        if i < 0:
            cut = any(t in buf for t in _TERMINATORS) or len(buf) > MAX_HARMONY_HEADER
            if not (final or cut):
                return False
            return self._as_text()
        found = _header(buf[:i])
        if found is None or i > MAX_HARMONY_HEADER:
            return self._as_text()
        channel, recipient = found
        self._raw += self._consume(i + len(harmony.MESSAGE))
        if recipient is not None:
            name = recipient.removeprefix(harmony.FUNCTIONS)
            is_call = self._tools and recipient.startswith(harmony.FUNCTIONS) and name
            self._name = name
            self._open_body("call" if is_call else "text")
        elif channel == harmony.REASONING_CHANNEL:
            self._open_body("reasoning" if self._reasons else "text")
        else:
            self._open_body("content")
        return True

    def _as_text(self) -> bool:
        """Framing that is not harmony's: the message so far and the rest are content."""
        self._out.content += self._raw
        self._raw = ""
        self._state = _Harmony.TEXT
        return True

    def _open_body(self, kind: str) -> None:
        self._state = _Harmony.BODY
        self._kind = kind
        self._fresh = True
        if kind == "text":  # its framing is shown with it
            self._out.content += self._raw
        self._frame = self._raw if kind == "call" else ""
        self._raw = ""

    def _emit(self, text: str) -> None:
        """Body text to where the body goes (two messages of one kind: a blank line apart)."""
        if not text:
            return
        kind = "content" if self._kind == "text" else self._kind
        if self._fresh and self._kind != "text" and self._said.get(kind):
            text = "\n\n" + text
        self._fresh = False
        if kind == "reasoning":
            self._out.reasoning += text
        else:
            self._out.content += text

    def _body(self, final: bool) -> bool:
        buf = self._buf
        ends = [(buf.find(t), t) for t in _TERMINATORS if t in buf]
        if not ends:
            if self._kind == "call":
                if final:
                    self._call(self._consume(len(buf)), "")
                    self._state = _Harmony.BETWEEN
                return False
            keep = len(buf) if final else _held(buf, _TERMINATORS)
            self._emit(self._consume(keep))
            return False
        i, end = min(ends)
        body = self._consume(i)
        closing = "" if end == harmony.START else self._consume(len(end))
        if self._kind == "call":
            self._call(body, closing)
        else:
            self._emit(body)
            if self._kind == "text":
                self._out.content += closing
            else:
                self._said[self._kind] = self._said[self._kind] or not self._fresh
        self._state = _Harmony.BETWEEN
        return True

    def _call(self, body: str, closing: str) -> None:
        """A call's body, settled: a ToolCall when it is a JSON object, else text."""
        start = self._pos - len(body) - len(closing)
        arguments = body.strip()
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError):
            value = None
        if not isinstance(value, dict):
            self._out.content += self._frame + body + closing
            return
        if self._parallel or not self._calls:
            at = start + len(body) - len(body.lstrip())
            pieces = _cut(arguments, at, self._cuts)
            call = ToolCall(self._calls, new_call_id(), self._name, arguments, pieces)
            self._out.tool_calls.append(call)
            self._calls += 1

    def _between(self, final: bool) -> bool:
        text = self._buf.lstrip()
        if text.startswith(harmony.START):
            self._consume(len(self._buf) - len(text))
            self._raw = self._consume(len(harmony.START))
            self._state = _Harmony.HEADER
            return True
        if not text:
            if final:
                self._consume(len(self._buf))
            return False
        if not final and harmony.START.startswith(text):
            return False
        self._state = _Harmony.TEXT  # text after a message's end: kept as written
        return True


def output_parser(output: OutputFormat, *, opened: bool = False) -> OutputParser | HarmonyParser:
    """The parser of a reply in `output`'s format: harmony's when its reasoning or its tool
    calls are harmony's, else OutputParser. `opened`: the prompt opened the reasoning block."""
    if uses_harmony(output):
        return HarmonyParser(output, opened=opened)
    return OutputParser(output, opened=opened)


def uses_harmony(output: OutputFormat) -> bool:
    """Whether a reply in `output`'s format is read as harmony messages."""
    tools = output.tool_calls and output.tool_format == harmony.NAME
    return output.reasoning == harmony.NAME or tools
