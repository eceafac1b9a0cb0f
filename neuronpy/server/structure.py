"""JSON decoded with the structural checks every request passes before any field is read."""

# What these rule out reaches code that cannot take it: JSON nested deep enough to overflow the
# recursion of a chat template (`tojson`, recursive macros) or of a parser, and text that is not
# valid Unicode (a lone surrogate, which JSON can write as "\ud800"), which the tokenizer, the
# templates and every UTF-8 encoder (an error quoting the text included) fail on, and numbers
# that are not finite (NaN, Infinity and -Infinity, which Python's decoder takes although JSON
# has none, and 1e999, which overflows to inf): echoed back (metadata, a tool's extra keys) they
# make JSON no client can parse. Other numbers need no check here: the schema (schema.py)
# types every field the server reads.

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from neuronpy.errors import InvalidRequestError
from neuronpy.jsontext import json_depth

# Containers within containers: the body object is level 1. A tool's JSON Schema nests two
# levels per object level (properties, then the property) from level 5 (body, tools, the tool,
# function, parameters), so 64 leaves it some 29 object levels; recursive template macros
# fail only past about 150.
MAX_JSON_DEPTH = 64
# The nesting is measured on the text, before it is decoded (neuronpy.jsontext).
# A \u escape of a UTF-16 surrogate (D800-DFFF): the only way a lone one gets into JSON decoded
# from bytes, as strict UTF-8 decoding rejects encoded ones. A valid pair also matches (then
# the decoded strings are checked).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_MAYBE_NON_FINITE = re.compile(r"NaN|Infinity|[eE][+-]?\d{3}")
_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_MAX_PARAM = 200  # characters of a path an error names
_MAX_PLACE_SEARCH = 1 << 16  # characters of a too-deep body still decoded to say where
_CONTAINERS = (dict, list)

JsonPath = Sequence[str | int]  # keys and indices, from the body down


def decode_json(raw: bytes | str, where: JsonPath = (), max_depth: int = MAX_JSON_DEPTH) -> object:
    """`raw` (UTF-8, or text) as JSON, checked: at most `max_depth` levels of nesting, every
    string and key valid Unicode; else InvalidRequestError naming the place. `where` is the
    path of `raw` itself in the request (a tool call's arguments). CPU-bound (up to some 0.2 s
    for 4 MiB): the server runs it in a thread."""
    label = f"{format_path(where)} is" if where else "the request body is"
    try:
        text = raw if isinstance(raw, str) else raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(
            f"{label} not valid UTF-8 (at byte {exc.start})", _param(where)
        ) from None
    if json_depth(text) > max_depth:
        raise _refuse_deep(text, label, where, max_depth)
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise _invalid(exc, label, where) from None
    # (only text that could have produced one is walked: a NaN or Infinity literal, or an
    # exponent of three digits or more)
    if _MAYBE_NON_FINITE.search(text):
        bad = _first([value], _non_finite)
        if bad is not None:
            path = [*where, *bad[1:]]
            place = f"'{format_path(path)}'" if path else "the request body"
            raise InvalidRequestError(
                f"{place} is not a finite number (NaN, Infinity and numbers beyond about 1.8e308 "
                "are not JSON numbers)",
                _param(path),
            )
    # (a string given as such may hold a lone surrogate as itself, not only as an escape)
    if (isinstance(raw, str) or _SURROGATE_ESCAPE.search(text)) and not _encodes(value):
        bad = _first(value, _bad_text) or []  # ([]: the value itself)
        place = f"'{format_path([*where, *bad])}'" if bad or where else "the request body"
        raise InvalidRequestError(
            f"{place} holds text that is not valid Unicode (a lone UTF-16 surrogate such as "
            "\\ud800); send UTF-8 text",
            _param([*where, *bad]),
        )
    return value


def format_path(path: JsonPath) -> str:
    """A place in the request as its errors name it: `messages[0].content`. Keys that are not
    plain names are quoted, ASCII-escaped (a key may be what is wrong) and cut short."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _PLAIN_KEY.match(part):
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part[:40])}]"
    return out


def _refuse_deep(text: str, label: str, where: JsonPath, max_depth: int) -> InvalidRequestError:
    """The error for text nested past `max_depth`. Short text is decoded after all, to tell
    text that is not JSON and to find the place; longer text is not (a body of many deep
    containers would take seconds to decode and search)."""
    inner: list[str | int] = []  # (not known)
    if len(text) <= _MAX_PLACE_SEARCH:
        try:
            value = json.loads(text)
        except ValueError as exc:
            return _invalid(exc, label, where)
        except RecursionError:  # past json's own limit (about 1,000 levels)
            pass
        else:

            def too_deep(key: str | int, child: object, level: int) -> bool:
                return level > max_depth and _is_container(child)

            inner = _first(value, too_deep) or []
    path = [*where, *inner]
    place = f" (at {format_path(path)[:_MAX_PARAM]})" if path else ""
    what = f"{format_path(where)} nests" if where else "the request's JSON nests"
    # the param: `where`, or the body's field the deep value came in (what a client can act on)
    return InvalidRequestError(
        f"{what} deeper than {max_depth} levels{place}", _param(where or path[:1])
    )


def _invalid(exc: ValueError, label: str, where: JsonPath) -> InvalidRequestError:
    return InvalidRequestError(f"{label} not valid JSON ({str(exc)[:200]})", _param(where))


def _param(path: JsonPath) -> str | None:
    return format_path(path)[:_MAX_PARAM] or None


def _is_container(value: object) -> bool:
    return type(value) in _CONTAINERS


def _non_finite(key: str | int, child: object, level: int) -> bool:
    return isinstance(child, float) and not math.isfinite(child)


def _bad_text(key: str | int, child: object, level: int) -> bool:
    return (isinstance(key, str) and not _encodes(key)) or (
        isinstance(child, str) and not _encodes(child)
    )


def _encodes(value: object) -> bool:
    """Whether every string and key of `value` encodes as UTF-8 (json's C encoder walks it)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _children(value: object) -> Iterator[tuple[str | int, Any]]:
    if isinstance(value, dict):
        yield from value.items()
    elif isinstance(value, list):
        yield from enumerate(value)


def _first(value: object, hit: Callable[[str | int, Any, int], bool]) -> list[str | int] | None:
    """Depth first, the path to the first child for which `hit(key, child, its level)` holds
    (the value itself is level 1); None if none does. A stack of iterators, one per level: no
    recursion (the input may be what would overflow it), memory in the depth alone."""
    frames = [_children(value)]
    path: list[str | int] = []  # the keys of the containers that frames[1:] walk
    while frames:
        step = next(frames[-1], None)
        if step is None:
            frames.pop()
            if path:
                path.pop()
            continue
        key, child = step
        if hit(key, child, len(frames) + 1):
            return [*path, key]
        if _is_container(child):
            frames.append(_children(child))
            path.append(key)
    return None
