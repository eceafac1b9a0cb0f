"""Tool-call markup: how each model family writes a call, read back as (name, arguments).

A format is the marker that opens a call and how the call's text after it ends:

- "tagged" formats close each call with an end marker, one call per block: Hermes/Qwen's
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5/3, SmolLM3, Hermes) and
  FunctionGemma's `<start_function_call>call:NAME{key:<escape>text<escape>,n:1}<end_function_call>`,
  Qwen3-Coder / Qwen3.5's XML `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n
  </parameter>\n</function>\n</tool_call>`, GLM-4.5's `<tool_call>NAME\n<arg_key>KEY
  </arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>`; LFM2's block holds a Python list
  of calls: `<|tool_call_start|>[get_weather(city="Paris"), get_time()]<|tool_call_end|>`;
- "sectioned" blocks hold one or more calls, each between markers of its own: DeepSeek-V3 /
  R1's `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}
  \n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>` (DeepSeek-V3.1's `...<｜tool▁call▁begin｜>NAME
  <｜tool▁sep｜>{...}<｜tool▁call▁end｜>...`), Kimi K2's `<|tool_calls_section_begin|>
  <|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>`;
- gpt-oss's "harmony" writes a call as a message of its own (see engine/harmony.py):
  `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`;
- "list" formats write one JSON array of `{"name", "arguments"}` objects after the marker:
  Granite 3's `<|tool_call|>[...]`, Phi-4-mini's `functools[...]`, Mistral's `[TOOL_CALLS][...]`.

The model's format is named in its config (`tool_call_parser`) or detected from its chat
template (`resolve_tool_format`): the marker the template writes or tells the model to write.
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
import warnings
from dataclasses import dataclass
from typing import Any, Literal

from neuronpy.defaults import TOOL_CALL_PARSERS
from neuronpy.engine import harmony

_DECODER = json.JSONDecoder()
_ARGUMENT_KEYS = ("arguments", "parameters")  # some Hermes fine-tunes write "parameters"
_WS = " \t\r\n"


@dataclass(frozen=True)
class ParsedCall:
    """A well-formed call: the function's name and its arguments' JSON text. `span` is where
    that text lies in the call's own text when the model wrote it there verbatim (a JSON
    object), None when it was rewritten (arguments given as a JSON string, missing: "{}", or
    in a format that is not JSON)."""

    name: str
    arguments: str
    span: tuple[int, int] | None


@dataclass(frozen=True)
class Settled:
    """What the text after a format's start marker settled into: `consumed` characters of it
    (the end marker included), and the calls they hold, or None when they are not well-formed
    calls (they are text, then)."""

    consumed: int
    calls: tuple[ParsedCall, ...] | None


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call markup (see the module's docstring)."""

    name: str
    start: str  # the marker that opens a call (a block, or a list of calls)
    kind: Literal["tagged", "list"]
    end: str = ""  # a tagged call's closing marker
    # a constrained reply's calls (tool_choice required or named), as xgrammar's structural tag
    # writes them: each call is `call_begin` + name + `name_end` + arguments + `call_end`
    call_begin: str = '{"name": '
    name_end: str = ', "arguments": '
    call_end: str = "}"
    separator: str = ", "  # between a list's calls (tagged blocks: between blocks)
    quote_name: bool = True  # the name as a JSON string (FunctionGemma's and the XML's are bare)
    # how the arguments are written: JSON, or FunctionGemma's, Qwen3-Coder's, GLM-4.5's or
    # LFM2's (Python literals) own notation
    # (DeepSeek's and Kimi K2's: JSON arguments, each call between markers in a section)
    notation: Literal["json", "gemma", "xml", "glm", "python", "deepseek", "kimi"] = "json"
    inner: tuple[str, ...] = ()  # the markup inside a call (GLM-4.5's argument tags)

    @property
    def markers(self) -> tuple[str, ...]:
        """The markers this format's replies hold (kept in the text even when they are
        special tokens)."""
        return ((self.start, self.end) if self.end else (self.start,)) + self.inner

    def settle(self, text: str, final: bool, types: ParamTypes | None = None) -> Settled | None:
        """What `text`, everything after a start marker so far, settles into; None while more
        text may still change it (`final`: the reply has ended, so it cannot). `types`: the
        request's tools' parameter types, for a notation whose values are untyped text."""
        if self.kind == "tagged":
            i = text.find(self.end)
            if i < 0:
                return Settled(len(text), None) if final else None
            return Settled(i + len(self.end), self.parse_block(text[:i], types))
        return self._settle_list(text, final)

    def parse_block(
        self, body: str, types: ParamTypes | None = None
    ) -> tuple[ParsedCall, ...] | None:
        """The calls in a tagged block's text (between its markers), or None: one call, or
        LFM2's list of them."""
        if self.notation == "python":
            return parse_pythonic_calls(body)
        if self.notation in SECTIONS:
            return parse_section(body, self.notation)
        call = self.parse_call(body, types)
        return None if call is None else (call,)

    @property
    def bracketed(self) -> bool:
        """Whether a constrained reply writes its calls as one list `[...]` after the start
        marker (and before the end marker, when the format has one)."""
        return self.kind == "list" or self.notation == "python"

    def parse_call(self, body: str, types: ParamTypes | None = None) -> ParsedCall | None:
        """The call in a tagged block's text (between its markers), or None."""
        if self.notation == "gemma":
            return parse_function_gemma(body)
        if self.notation == "xml":
            return parse_qwen3_coder(body, types)
        if self.notation == "glm":
            return parse_glm(body, types)
        return parse_tool_call(body)

    def _settle_list(self, text: str, final: bool) -> Settled | None:
        items = _json_items(text)
        if items is None:  # not a list: the marker was text, and what follows is read on
            return Settled(0, None)
        if items == "open":
            return None if not final else Settled(len(text), None)
        end, spans = items
        calls: list[ParsedCall] = []
        for a, b in spans:
            call = parse_tool_call(text[a:b])
            if call is None:
                return Settled(end, None)
            span = None if call.span is None else (a + call.span[0], a + call.span[1])
            calls.append(ParsedCall(call.name, call.arguments, span))
        return Settled(end, tuple(calls) if calls else None)


# DeepSeek's and Kimi K2's sections of calls (see parse_section): the section's markers, and
# per notation a call's opening marker, the marker between its head and its arguments, its end
DEEPSEEK_SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
KIMI_SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
SECTIONS = {
    "deepseek": ("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"),
    "kimi": ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
}


def _sectioned(
    name: str,
    notation: Literal["deepseek", "kimi"],
    section: tuple[str, str],
    *,
    head: str = "",
    name_end: str,
    tail: str = "",
) -> ToolFormat:
    """A format whose calls sit in a section: a forced call writes the section's opening
    marker, the call's and `head`, the name, `name_end`, the JSON arguments, `tail`, then the
    call's end marker and the section's."""
    begin, end = section
    call_begin, _, call_end = SECTIONS[notation]
    return ToolFormat(
        name,
        begin,
        "tagged",
        end=end,
        call_begin=f"{begin}{call_begin}{head}",
        name_end=name_end,
        call_end=f"{tail}{call_end}{end}",
        separator="",
        quote_name=False,
        notation=notation,
        inner=SECTIONS[notation],
    )


TOOL_FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat(
        "hermes",
        "<tool_call>",
        "tagged",
        end="</tool_call>",
        call_begin='<tool_call>\n{"name": ',
        call_end="}\n</tool_call>",
        separator="\n",
    ),
    "granite": ToolFormat("granite", "<|tool_call|>", "list"),
    "phi4_mini": ToolFormat("phi4_mini", "functools", "list"),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", "list"),
    "functiongemma": ToolFormat(
        "functiongemma",
        "<start_function_call>",
        "tagged",
        end="<end_function_call>",
        call_begin="<start_function_call>call:",
        name_end="{",
        call_end="}<end_function_call>",
        separator="",
        quote_name=False,
        notation="gemma",
    ),
    "qwen3_coder": ToolFormat(
        "qwen3_coder",
        "<tool_call>",
        "tagged",
        end="</tool_call>",
        call_begin="<tool_call>\n<function=",
        name_end=">\n",
        call_end="</function>\n</tool_call>",
        separator="\n",
        quote_name=False,
        notation="xml",
    ),
    "glm45": ToolFormat(
        "glm45",
        "<tool_call>",
        "tagged",
        end="</tool_call>",
        call_begin="<tool_call>",
        name_end="\n",
        call_end="</tool_call>",
        separator="\n",
        quote_name=False,
        notation="glm",
        inner=("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    ),
    # DeepSeek-V3 / R1: the call's type, its name, then its arguments in a fenced JSON block
    "deepseek_v3": _sectioned(
        "deepseek_v3",
        "deepseek",
        DEEPSEEK_SECTION,
        head=f"function{SECTIONS['deepseek'][1]}",
        name_end="\n```json\n",
        tail="\n```",
    ),
    # DeepSeek-V3.1 and later: the name, then the arguments as they are
    "deepseek_v31": _sectioned(
        "deepseek_v31", "deepseek", DEEPSEEK_SECTION, name_end=SECTIONS["deepseek"][1]
    ),
    "kimi_k2": _sectioned(
        "kimi_k2",
        "kimi",
        KIMI_SECTION,
        head="functions.",
        name_end=f":0{SECTIONS['kimi'][1]}",
    ),
    "lfm2": ToolFormat(
        "lfm2",
        "<|tool_call_start|>",
        "tagged",
        end="<|tool_call_end|>",
        call_begin="",
        name_end="(",
        call_end=")",
        quote_name=False,
        notation="python",
    ),
}
# gpt-oss's harmony: a call is a message to `functions.NAME` on the commentary channel, its
# arguments JSON, `<|call|>` its end. Its replies are read by engine/output.py's HarmonyParser
# (the framing of the messages around a call is more than a start marker); the fields here say
# what a forced call writes: its framing in full, and no end of its own, since <|call|> is a
# stop token, which the grammar allows once the call is whole.
TOOL_FORMATS[harmony.NAME] = ToolFormat(
    harmony.NAME,
    f" to={harmony.FUNCTIONS}",
    "tagged",
    end=harmony.CALL,
    call_begin=f"{harmony.START}assistant{harmony.CHANNEL}commentary to={harmony.FUNCTIONS}",
    name_end=f" {harmony.CONSTRAIN}json{harmony.MESSAGE}",
    call_end="",
    separator="",
    quote_name=False,
)
assert set(TOOL_FORMATS) == set(TOOL_CALL_PARSERS) - {"auto"}
HERMES = TOOL_FORMATS["hermes"]
TOOL_CALL_START, TOOL_CALL_END = HERMES.start, HERMES.end

# What a chat template writes (or tells the model to write) that shows its format, most
# specific first; a template that shows none gets Hermes markup (what a forced tool_choice
# writes, so that it is read back).
_TEMPLATE_SIGNS = (
    ("<start_function_call>", "functiongemma"),
    # DeepSeek's section (V3 / R1 fence each call's arguments as JSON: see resolve_tool_format)
    (DEEPSEEK_SECTION[0], "deepseek_v31"),
    (KIMI_SECTION[0], "kimi_k2"),
    # Qwen3-Coder / Qwen3.5's XML calls and GLM-4.5's argument tags, inside the Hermes-like
    # <tool_call> (so before it)
    ("<parameter=", "qwen3_coder"),
    ("<arg_key>", "glm45"),
    # LFM2's template lists the tools between <|tool_list_start|> tags; LFM2.5's writes the
    # calls of the history between <|tool_call_start|> tags
    ("<|tool_call_start|>", "lfm2"),
    ("<|tool_list_start|>", "lfm2"),
    ("<|tool_call|>", "granite"),
    ("[TOOL_CALLS]", "mistral"),
    ("functools", "phi4_mini"),
    ("<|tool|>", "phi4_mini"),  # Phi-4-mini's template shows the tools between <|tool|> tags
    ("<tool_call>", "hermes"),
)


def resolve_tool_format(setting: str, tokenizer: object) -> ToolFormat:
    """The tool-call format a model's `setting` means: for "auto", the one its chat template
    shows (Hermes when it shows none). `tokenizer`: a transformers tokenizer (its
    `chat_template` is read)."""
    if setting not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {setting!r}"
        )
    if setting != "auto":
        return TOOL_FORMATS[setting]
    template = getattr(tokenizer, "chat_template", None)
    if harmony.is_harmony_template(template):
        return TOOL_FORMATS[harmony.NAME]
    if isinstance(template, str):
        for sign, name in _TEMPLATE_SIGNS:
            if sign in template:
                if name == "deepseek_v31" and "```json" in template:
                    name = "deepseek_v3"  # V3 / R1: each call's arguments fenced as JSON
                return TOOL_FORMATS[name]
    return HERMES


def parse_tool_call(body: str) -> ParsedCall | None:
    """The call in a JSON call's text (a Hermes block's body, one item of a list format), or
    None if it is not one JSON object with a non-empty string "name" and an object (or a
    string holding one) as "arguments". Other keys are ignored."""
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict):
        return None
    name = call.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    key = next((k for k in _ARGUMENT_KEYS if k in call), None)
    if key is None:
        return ParsedCall(name, "{}", None)
    arguments = call[key]
    if isinstance(arguments, str):  # arguments written as a JSON string holding the object
        try:
            inner = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
        return ParsedCall(name, arguments, None) if isinstance(inner, dict) else None
    if not isinstance(arguments, dict):
        return None
    span = _value_span(body, key, arguments)
    if span is None:
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False), None)
    return ParsedCall(name, body[span[0] : span[1]], span)


def _value_span(body: str, key: str, value: object) -> tuple[int, int] | None:
    """Where `"key": value` has its value in `body`, as the model wrote it."""
    for match in re.finditer(rf'"{key}"\s*:\s*', body):
        try:
            found, end = _DECODER.raw_decode(body, match.end())
        except (ValueError, RecursionError):
            continue
        if found == value:
            return match.end(), end
    return None


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _json_items(text: str) -> tuple[int, list[tuple[int, int]]] | Literal["open"] | None:
    """A list format's calls at the start of `text` (after whitespace): where the array ends
    and where each of its items lies; "open" while it may still be completed; None when it
    cannot be one (not an array, nor a lone object, which some fine-tunes write)."""
    i = _skip(text, 0)
    if i == len(text):
        return "open"
    if text[i] == "{":
        try:
            _, end = _DECODER.raw_decode(text, i)
        except (ValueError, RecursionError):
            return "open"
        return end, [(i, end)]
    if text[i] != "[":
        return None
    spans: list[tuple[int, int]] = []
    i = _skip(text, i + 1)
    if text[i : i + 1] == "]":
        return i + 1, spans
    while True:
        try:
            _, end = _DECODER.raw_decode(text, i)
        except (ValueError, RecursionError):
            return "open"
        spans.append((i, end))
        i = _skip(text, end)
        if i == len(text):
            return "open"
        if text[i] == "]":
            return i + 1, spans
        if text[i] != ",":
            return None
        i = _skip(text, i + 1)


# ---- FunctionGemma's notation: {key:value,...}, strings between <escape> markers ------------

_ESCAPE = "<escape>"
_BARE = re.compile(r"[^,}\]]*")
_KEY = re.compile(r"\s*([^\s:{}\[\],<]+)\s*:")
_NAME = re.compile(r"call:([^\s{}]+)\{")


class _NotationError(ValueError):
    pass


def parse_function_gemma(body: str) -> ParsedCall | None:
    """The call in a FunctionGemma block (`call:NAME{key:value,...}`), its arguments as JSON,
    or None when the block is not one."""
    m = _NAME.match(body.strip())
    if m is None:
        return None
    text = body.strip()
    try:
        arguments, end = _gemma_object(text, m.end())
    except (_NotationError, RecursionError):
        return None
    if text[end:].strip():
        return None
    return ParsedCall(m.group(1), json.dumps(arguments, ensure_ascii=False), None)


def _gemma_object(text: str, i: int) -> tuple[dict[str, Any], int]:
    """The object whose `{` came right before `i`: its entries and where it ends."""
    out: dict[str, Any] = {}
    i = _skip(text, i)
    if text[i : i + 1] == "}":
        return out, i + 1
    while True:
        key = _KEY.match(text, i)
        if key is None:
            raise _NotationError(f"a key at {i}")
        out[key.group(1)], i = _gemma_value(text, _skip(text, key.end()))
        i = _skip(text, i)
        if text[i : i + 1] == "}":
            return out, i + 1
        if text[i : i + 1] != ",":
            raise _NotationError(f"',' or '}}' at {i}")
        i += 1


def _gemma_value(text: str, i: int) -> tuple[Any, int]:
    if text.startswith(_ESCAPE, i):
        end = text.find(_ESCAPE, i + len(_ESCAPE))
        if end < 0:
            raise _NotationError("an unclosed string")
        return text[i + len(_ESCAPE) : end], end + len(_ESCAPE)
    if text[i : i + 1] == "{":
        return _gemma_object(text, i + 1)
    if text[i : i + 1] == "[":
        items: list[Any] = []
        i = _skip(text, i + 1)
        if text[i : i + 1] == "]":
            return items, i + 1
        while True:
            value, i = _gemma_value(text, i)
            items.append(value)
            i = _skip(text, i)
            if text[i : i + 1] == "]":
                return items, i + 1
            if text[i : i + 1] != ",":
                raise _NotationError(f"',' or ']' at {i}")
            i = _skip(text, i + 1)
    bare = _BARE.match(text, i)
    assert bare is not None
    word = bare.group().strip()
    if not word:
        raise _NotationError(f"a value at {i}")
    try:
        value = json.loads(word)  # numbers, true, false, null
    except ValueError:
        value = word  # an unquoted word: a string
    if isinstance(value, (dict, list)) or (isinstance(value, float) and not math.isfinite(value)):
        value = word  # (NaN, Infinity and quoted JSON are words too)
    return value, bare.end()


# ---- Qwen3-Coder / Qwen3.5's XML notation: <function=NAME> <parameter=KEY>VALUE</parameter> -----

# (tool name, parameter name, the type its JSON Schema gives it: "string", "boolean", ...), for
# every parameter of the request's tools whose schema names one type
ParamTypes = tuple[tuple[str, str, str], ...]
_FUNCTION = re.compile(r"<function=([^<>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^<>\n]+)>")
_PARAMETER_END = "</parameter>"
_FUNCTION_END = "</function>"


def parameter_types(tools: list[dict[str, Any]]) -> ParamTypes:
    """The parameter types of `tools` ({"name", "parameters"}: OpenAI's function objects) that
    the XML notation needs to read a value back: each property's "type" when it is one name
    ("string" also for a property that only lists string choices in "enum")."""
    found: list[tuple[str, str, str]] = []
    for tool in tools:
        params = tool.get("parameters")
        properties = params.get("properties") if isinstance(params, dict) else None
        if not isinstance(properties, dict):
            continue
        for key, prop in properties.items():
            if not isinstance(prop, dict):
                continue
            kind = prop.get("type")
            enum = prop.get("enum")
            if kind is None and isinstance(enum, list) and enum:
                kind = "string" if all(isinstance(e, str) for e in enum) else None
            if isinstance(kind, str):
                found.append((str(tool.get("name")), str(key), kind))
    return tuple(found)


def parse_qwen3_coder(body: str, types: ParamTypes | None = None) -> ParsedCall | None:
    """The call in a Qwen3-Coder / Qwen3.5 block (`<function=NAME>`, then `<parameter=KEY>`
    VALUE `</parameter>` for each argument, then `</function>`, whitespace between them), its
    arguments as JSON; None when the block is not one.

    A value is the text between its tags, less one newline at each end (the template writes
    them). Values are untyped text (the template writes strings raw, other values as JSON), so
    a value is kept as that text when `types` (parameter_types of the request's tools) says
    its parameter is a "string"; "True"/"False" of a "boolean" are read as JSON's booleans
    (the template renders Python's with `| string`); any other value is read as JSON when it
    is JSON (a number, true, an object...), and kept as text when it is not. Without `types`
    (or for a parameter they do not name), then, a string that is JSON text ("42") comes back
    as that JSON value."""
    text = body.strip()
    m = _FUNCTION.match(text)
    if m is None or not m.group(1).strip():
        return None
    name = m.group(1).strip()
    known = {key: kind for tool, key, kind in types or () if tool == name}
    arguments: dict[str, Any] = {}
    i = _skip(text, m.end())
    while not text.startswith(_FUNCTION_END, i):
        p = _PARAMETER.match(text, i)
        if p is None:
            return None
        end = text.find(_PARAMETER_END, p.end())
        if end < 0:
            return None
        value = text[p.end() : end]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        key = p.group(1).strip()
        arguments[key] = _xml_value(value, known.get(key))
        i = _skip(text, end + len(_PARAMETER_END))
    if text[i + len(_FUNCTION_END) :].strip():
        return None
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False), None)


def _xml_value(text: str, kind: str | None) -> Any:
    """A parameter's value text as its schema's `kind` reads it (see parse_qwen3_coder)."""
    if kind == "string":
        return text
    if kind == "boolean" and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    if isinstance(value, float) and not math.isfinite(value):
        return text  # (NaN and Infinity are not JSON)
    return value


# ---- GLM-4.5's notation: NAME, then <arg_key>KEY</arg_key> <arg_value>VALUE</arg_value> ----

_ARG_KEY, _ARG_KEY_END = "<arg_key>", "</arg_key>"
_ARG_VALUE, _ARG_VALUE_END = "<arg_value>", "</arg_value>"
# a function's name: a word (dots, dashes, slashes and colons allowed), so that a block that
# holds something else (JSON, other markup, a sentence) is text
_GLM_NAME = re.compile(r"[\w.:/-]+")


def parse_glm(body: str, types: ParamTypes | None = None) -> ParsedCall | None:
    """The call in a GLM-4.5 block (the function's name, then `<arg_key>KEY</arg_key>` and
    `<arg_value>VALUE</arg_value>` for each argument, whitespace between them; GLM-4.5's
    template writes a newline after the name and after each tag pair, GLM-4.7's none), its
    arguments as JSON; None when the block is not one (a name that is not one word included).

    A value is the text between its tags as written (the template writes a string raw, any
    other value as JSON, with nothing around it); it is typed as the Qwen3-Coder notation's
    are (see parse_qwen3_coder): kept as text for a parameter `types` says is a "string",
    read as JSON otherwise where it is JSON."""
    text = body.strip()
    at = text.find(_ARG_KEY)
    name = (text if at < 0 else text[:at]).strip()
    if _GLM_NAME.fullmatch(name) is None:
        return None
    known = {key: kind for tool, key, kind in types or () if tool == name}
    arguments: dict[str, Any] = {}
    i = len(text) if at < 0 else at
    while i < len(text):
        if not text.startswith(_ARG_KEY, i):
            return None
        end = text.find(_ARG_KEY_END, i)
        if end < 0:
            return None
        key = text[i + len(_ARG_KEY) : end].strip()
        i = _skip(text, end + len(_ARG_KEY_END))
        if not key or not text.startswith(_ARG_VALUE, i):
            return None
        end = text.find(_ARG_VALUE_END, i)
        if end < 0:
            return None
        arguments[key] = _xml_value(text[i + len(_ARG_VALUE) : end], known.get(key))
        i = _skip(text, end + len(_ARG_VALUE_END))
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False), None)


# ---- DeepSeek's and Kimi K2's sections: calls between markers, JSON arguments -------------

_FENCE = re.compile(r"\A```(?:json)?\s*\n(.*)\n\s*```\Z", re.S)
_KIMI_ID = re.compile(r"\A(?:functions\.)?([\w.:/-]+?)(?::\d+)?\Z")


def parse_section(body: str, notation: str) -> tuple[ParsedCall, ...] | None:
    """The calls of a DeepSeek or Kimi K2 section (the text between its markers): each call
    between its own markers, whitespace between calls; None when it is not that.

    DeepSeek-V3 / R1 write a call's head as its type ("function"), then after the separator
    the name on a line and the arguments fenced as JSON; V3.1 writes the name as the head and
    the arguments bare after the separator. Kimi K2's head is `functions.NAME:INDEX`."""
    begin, sep, end = SECTIONS[notation]
    calls, i = [], _skip(body, 0)
    while i < len(body):
        if not body.startswith(begin, i):
            return None
        close = body.find(end, i)
        if close < 0:
            return None
        head, found, rest = body[i + len(begin) : close].partition(sep)
        call = _section_call(head.strip(), rest.strip(), notation) if found else None
        if call is None:
            return None
        calls.append(call)
        i = _skip(body, close + len(end))
    return tuple(calls) or None


def _section_call(head: str, rest: str, notation: str) -> ParsedCall | None:
    if notation == "kimi":
        match = _KIMI_ID.match(head)
        name, arguments = (match[1] if match else ""), rest
    elif head == "function":  # DeepSeek-V3 / R1: NAME, then the fenced arguments
        name, _, fenced = rest.partition("\n")
        match = _FENCE.match(fenced.strip())
        name, arguments = name.strip(), (match[1] if match else "")
    else:
        name, arguments = head, rest
    if not name or _GLM_NAME.fullmatch(name) is None:
        return None
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    return ParsedCall(name, arguments.strip() or "{}", None)


# ---- LFM2's notation: a Python list of calls, [NAME(key=literal, ...), ...] ---------------------

# Bounds on a block read with Python's parser (a hostile reply could make ast's work and memory
# grow with it): its length, its length without its string literals (about the number of nodes:
# 32k take ~0.05 s), and how deep its literals nest. Past them the block is text.
MAX_PYTHONIC_CHARS = 1 << 20
MAX_PYTHONIC_CODE = 1 << 15
MAX_PYTHONIC_DEPTH = 64
_PY_STRING = re.compile(r""""(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'""")
# JSON's spellings, which LFM2.5's own template writes inside dicts (it renders them as JSON)
_JSON_NAMES = {"true": True, "false": False, "null": None}


class _NotLiteral(ValueError):
    pass


def parse_pythonic_calls(body: str) -> tuple[ParsedCall, ...] | None:
    """The calls in an LFM2 block: a Python list of calls of bare names with keyword arguments
    whose values are literals (strings, numbers, True/False/None, lists, tuples, dicts with
    string keys), their arguments as JSON; or a JSON list of `{"name", "arguments"}` objects,
    which LFM2 writes when its system prompt asks for JSON. None when the block is neither (a
    lone call without the list is taken too), or past the bounds above. Nothing is evaluated:
    the text is parsed, and each value read from its syntax tree."""
    text = body.strip()
    if not text or len(text) > MAX_PYTHONIC_CHARS:
        return None
    head = len(body) - len(body.lstrip())
    items = _json_items(text)
    if isinstance(items, tuple) and items[0] == len(text) and items[1]:
        found: list[ParsedCall] = []
        for a, b in items[1]:
            call = parse_tool_call(text[a:b])
            if call is None:
                break
            at = None if call.span is None else (head + a + call.span[0], head + a + call.span[1])
            found.append(ParsedCall(call.name, call.arguments, at))
        else:
            return tuple(found)
    if len(_PY_STRING.sub("", text)) > MAX_PYTHONIC_CODE:
        return None
    try:
        with warnings.catch_warnings():  # ("\d" and other invalid escapes: kept as written)
            warnings.simplefilter("ignore")
            tree = ast.parse(text, mode="eval").body
        nodes = tree.elts if isinstance(tree, ast.List) else [tree]
        calls = tuple(_pythonic_call(node) for node in nodes)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return None
    return calls or None


def _pythonic_call(node: ast.expr) -> ParsedCall:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        raise _NotLiteral("not a call of a name with keyword arguments")
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **mapping
            raise _NotLiteral("**")
        arguments[keyword.arg] = _pythonic_value(keyword.value, 1)
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate ("\ud800"): escaped, as JSON allows
        text = json.dumps(arguments, allow_nan=False)
    return ParsedCall(node.func.id, text, None)


def _pythonic_value(node: ast.expr, depth: int) -> Any:
    """The JSON value of a literal's syntax tree; _NotLiteral for anything else."""
    if depth > MAX_PYTHONIC_DEPTH:
        raise _NotLiteral("too deep")
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, (str, bool, int)):
            return value
        if isinstance(value, float) and math.isfinite(value):
            return value
        raise _NotLiteral(f"{type(value).__name__} constant")  # bytes, complex, ..., inf
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = node.operand
        if isinstance(operand, ast.Constant) and type(operand.value) in (int, float):
            value = operand.value if isinstance(node.op, ast.UAdd) else -operand.value
            return _pythonic_value(ast.Constant(value), depth)
        raise _NotLiteral("a sign on what is not a number")
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_pythonic_value(item, depth + 1) for item in node.elts]
    if isinstance(node, ast.Dict):
        out: dict[str, Any] = {}
        for key, value in zip(node.keys, node.values, strict=True):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                raise _NotLiteral("a key that is not a string")
            out[key.value] = _pythonic_value(value, depth + 1)
        return out
    raise _NotLiteral(type(node).__name__)


def new_call_id() -> str:
    """An id for a tool call, in OpenAI's style (`call_` and 24 random characters)."""
    return f"call_{secrets.token_hex(12)}"
