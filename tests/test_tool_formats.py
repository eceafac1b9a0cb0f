"""Each family's tool-call markup (engine/tools.py): read back from a reply however it is cut,
detected from the chat template, written by the grammar of a forced tool_choice, and served
through the openai client, with markers that are special tokens kept in the text."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import anyio
import openai
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from neuronpy.config import EngineConfig, load_config
from neuronpy.engine.constraint_grammar import grammar_of
from neuronpy.engine.tools import (
    MAX_PYTHONIC_CHARS,
    TOOL_FORMATS,
    parameter_types,
    parse_function_gemma,
    parse_glm,
    parse_pythonic_calls,
    parse_qwen3_coder,
    parse_section,
    resolve_tool_format,
)
from neuronpy.engine.types import Constraint, OutputFormat, SamplingParams
from neuronpy.errors import InvalidRequestError
from tests.scripted import Scripts
from tests.servers import FIXTURES, RunningServer, engine_loader, run_server
from tests.test_fixtures import bf
from tests.test_reasoning_tools import (
    TOOLS,
    Reply,
    ToolServer,
    ask,
    parse,
    reply_of,
    run_router,
    splits,
    summary,
)

MODEL = bf.TOOLS_FIXTURE
FORMATS = sorted(TOOL_FORMATS)

# One reply per format: some text, then two calls (a list format writes one array of them).
REPLIES = {
    "hermes": (
        "Let me check.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    ),
    "granite": (
        "Let me check.<|tool_call|>"
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"tz": "CET"}}]'
    ),
    "phi4_mini": (
        "Let me check. functools["
        '{"name": "get_weather", "arguments": {"city": "Paris"}},'
        '{"name": "get_time", "arguments": {"tz": "CET"}}]'
    ),
    "mistral": (
        "Let me check. [TOOL_CALLS]["
        '{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"tz": "CET"}}]'
    ),
    "functiongemma": (
        "Let me check.\n<start_function_call>call:get_weather{city:<escape>Paris<escape>}"
        "<end_function_call><start_function_call>call:get_time{tz:<escape>CET<escape>}"
        "<end_function_call>"
    ),
    "qwen3_coder": (
        "Let me check.\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n"
        "</function>\n</tool_call>"
    ),
    "glm45": (
        "Let me check.\n"
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "</tool_call>\n"
        "<tool_call>get_time\n<arg_key>tz</arg_key>\n<arg_value>CET</arg_value>\n</tool_call>"
    ),
    "deepseek_v3": (
        "Let me check.<｜tool▁calls▁begin｜>"
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n'
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n"
        '```json\n{"tz": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    ),
    "deepseek_v31": (
        "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>'
        '{"tz": "CET"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    ),
    "kimi_k2": (
        "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>"
        '{"tz": "CET"}<|tool_call_end|><|tool_calls_section_end|>'
    ),
    "lfm2": (
        "Let me check.\n<|tool_call_start|>"
        '[get_weather(city="Paris"), get_time(tz="CET")]<|tool_call_end|>'
    ),
    # gpt-oss's: a commentary preamble, then a message to functions.NAME per call
    "harmony": (
        "<|channel|>commentary<|message|>Let me check.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>'
        "<|start|>assistant to=functions.get_time<|channel|>commentary json"
        '<|message|>{"tz": "CET"}<|call|>'
    ),
}
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
# Lookalikes that stay text: a marker that opens no call, a call never closed.
TEXT = {
    "hermes": 'I use <tool_call> tags: <tool_call>{"name": "f"',
    "granite": 'The <|tool_call|> token. <|tool_call|>[{"name": "f"',
    "phi4_mini": 'import functools as ft; functools[{"name": "f"}',
    "mistral": 'See [TOOL_CALLS] docs. [TOOL_CALLS][{"name": "f", "arguments": {}}',
    "functiongemma": "<start_function_call>call:f{x:<escape>1",
    "qwen3_coder": "I use <tool_call> tags: <tool_call>\n<function=f>\n<parameter=x>\n1",
    "glm45": "I use <tool_call> tags: <tool_call>f\n<arg_key>x</arg_key>\n<arg_value>1",
    "deepseek_v3": "<｜tool▁calls▁begin｜> opens; <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f",
    "deepseek_v31": "Its <｜tool▁calls▁begin｜> marker, then <｜tool▁calls▁begin｜>f{",
    "kimi_k2": "A <|tool_calls_section_begin|> marker. <|tool_calls_section_begin|><|tool_call",
    "lfm2": "The <|tool_call_start|> token. <|tool_call_start|>[f(x=1)",
    "harmony": "A <|channel|> token. <|channel|>commentary to=functions.f<|message|>{",
}


def output(fmt: str, parallel: bool = True, types: Any = ()) -> OutputFormat:
    return OutputFormat(
        tool_calls=True, tool_format=fmt, parallel_tool_calls=parallel, tool_types=types
    )


def calls_of(out: Any) -> list[tuple[str, Any]]:
    return [(name, json.loads(arguments)) for name, arguments in summary(out)[2]]


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_reads_the_same_wherever_the_deltas_are_cut(fmt: str) -> None:
    for text in (REPLIES[fmt], TEXT[fmt]):
        whole = summary(parse([text], output(fmt)))
        for head, tail in splits(text):
            assert summary(parse([head, tail], output(fmt))) == whole, (head, tail)
        assert summary(parse(list(text), output(fmt))) == whole


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_gives_its_calls_and_leaves_lookalikes_as_text(fmt: str) -> None:
    out = parse([REPLIES[fmt]], output(fmt))
    assert out.content == "Let me check."
    assert calls_of(out) == CALLS
    assert calls_of(parse([REPLIES[fmt]], output(fmt, parallel=False))) == CALLS[:1]
    # another format's markup is text to this one
    for other in FORMATS:
        if other != fmt and TOOL_FORMATS[other].start not in REPLIES[fmt]:
            assert parse([REPLIES[other]], output(fmt)).tool_calls == [], other
    text = parse([TEXT[fmt]], output(fmt))
    assert (text.content, text.tool_calls) == (TEXT[fmt], [])


def test_list_formats_stream_each_calls_arguments_as_written() -> None:
    text = REPLIES["granite"]
    cut = text.index("Par") + 1
    first, second = parse([text[:cut], text[cut:]], output("granite")).tool_calls
    assert first.pieces == ('{"city": "P', 'aris"}')
    assert second.pieces == ('{"tz": "CET"}',)
    # a lone object, as some fine-tunes write it, is one call
    (call,) = parse(
        ['<|tool_call|>{"name": "f", "arguments": {"a": 1}}'], output("granite")
    ).tool_calls
    assert (call.name, call.arguments) == ("f", '{"a": 1}')


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("call:f{}", ("f", {})),
        (
            "call:f{a:<escape>x, y{}<escape>,n:-2.5,ok:true,none:null}",
            ("f", {"a": "x, y{}", "n": -2.5, "ok": True, "none": None}),
        ),
        (
            "call:f{p:{q:<escape>1<escape>},xs:[1,<escape>b<escape>,[]]}",
            ("f", {"p": {"q": "1"}, "xs": [1, "b", []]}),
        ),
        (" call:f{word:Paris} ", ("f", {"word": "Paris"})),
        ("call:f{a:<escape>x}", None),  # an unclosed string
        ("call:f{a:1", None),
        ("call:f{a:1} more", None),
        ("call:{a:1}", None),
        ("f{a:1}", None),
        ("call:f{:1}", None),
    ],
)
def test_function_gemma_notation(body: str, expected: tuple[str, Any] | None) -> None:
    call = parse_function_gemma(body)
    assert (call and (call.name, json.loads(call.arguments))) == expected


XML_TYPES = (("f", "s", "string"), ("f", "ok", "boolean"), ("f", "n", "integer"))


@pytest.mark.parametrize(
    ("body", "types", "expected"),
    [
        ("<function=f>\n</function>", None, ("f", {})),
        (
            # a string with newlines and markup in it; JSON values: numbers, booleans, objects
            "\n<function=f>\n<parameter=s>\nline 1\n<b>x</b> a < b\n\n</parameter>\n"
            "<parameter=n>\n-2.5\n</parameter>\n<parameter=ok>\ntrue\n</parameter>\n"
            '<parameter=o>\n{"a": [1, null]}\n</parameter>\n<parameter=w>\nParis\n</parameter>\n'
            "</function>\n",
            None,
            (
                "f",
                {
                    "s": "line 1\n<b>x</b> a < b\n",
                    "n": -2.5,
                    "ok": True,
                    "o": {"a": [1, None]},
                    "w": "Paris",
                },
            ),
        ),
        # the tools' types: a string stays text, Python's True is a boolean
        (
            "<function=f><parameter=s>42</parameter><parameter=ok>True</parameter>"
            "<parameter=n>7</parameter></function>",
            XML_TYPES,
            ("f", {"s": "42", "ok": True, "n": 7}),
        ),
        ("<function=f><parameter=s>42</parameter></function>", None, ("f", {"s": 42})),
        ("<function=g><parameter=s>42</parameter></function>", XML_TYPES, ("g", {"s": 42})),
        ("<function=f><parameter=x>NaN</parameter></function>", None, ("f", {"x": "NaN"})),
        ("<function=f>\n<parameter=x>\n1\n</function>", None, None),  # a value never closed
        ("<function=f>\n<parameter=x>\n1\n</parameter>\n", None, None),  # no </function>
        ("<function=f></function> more", None, None),
        ("<function=f>text<parameter=x>1</parameter></function>", None, None),
        ('{"name": "f", "arguments": {}}', None, None),  # Hermes' JSON
        ("<function=>\n</function>", None, None),
    ],
)
def test_qwen3_coder_notation(body: str, types: Any, expected: tuple[str, Any] | None) -> None:
    call = parse_qwen3_coder(body, types)
    assert (call and (call.name, json.loads(call.arguments))) == expected


def test_qwen3_coder_values_are_typed_by_the_tools_schemas() -> None:
    tools = [
        {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {
                    "s": {"type": "string"},
                    "ok": {"type": "boolean"},
                    "n": {"type": "integer"},
                    "e": {"enum": ["1", "2"]},
                    "u": {"type": ["string", "null"]},
                },
            },
        },
        {"name": "g", "parameters": None},
    ]
    types = parameter_types(tools)
    assert types == (*XML_TYPES, ("f", "e", "string"))
    text = (
        "<tool_call>\n<function=f>\n<parameter=s>\n1\n</parameter>\n<parameter=e>\n2\n"
        "</parameter>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    assert calls_of(parse([text], output("qwen3_coder", types=types))) == [
        ("f", {"s": "1", "e": "2", "n": 3})
    ]
    assert calls_of(parse([text], output("qwen3_coder"))) == [("f", {"s": 1, "e": 2, "n": 3})]


# ---- GLM-4.5: <tool_call>NAME, then <arg_key>KEY</arg_key><arg_value>VALUE</arg_value> -----


@pytest.mark.parametrize(
    ("body", "types", "expected"),
    [
        ("get_time\n", None, ("get_time", {})),
        ("get_time", None, ("get_time", {})),
        (
            # a string with newlines and markup in it; JSON values: numbers, booleans, objects
            "f\n<arg_key>s</arg_key>\n<arg_value>line 1\n<b>x</b> a < b\n</arg_value>\n"
            "<arg_key>n</arg_key>\n<arg_value>-2.5</arg_value>\n"
            "<arg_key>ok</arg_key>\n<arg_value>true</arg_value>\n"
            '<arg_key>o</arg_key>\n<arg_value>{"a": [1, null]}</arg_value>\n'
            "<arg_key>w</arg_key>\n<arg_value>Paris</arg_value>\n",
            None,
            (
                "f",
                {
                    "s": "line 1\n<b>x</b> a < b\n",
                    "n": -2.5,
                    "ok": True,
                    "o": {"a": [1, None]},
                    "w": "Paris",
                },
            ),
        ),
        # GLM-4.7's, no newlines; the tools' types: a string stays text, True is a boolean
        (
            "f<arg_key>s</arg_key><arg_value>42</arg_value><arg_key>ok</arg_key>"
            "<arg_value>True</arg_value><arg_key>n</arg_key><arg_value>7</arg_value>",
            XML_TYPES,
            ("f", {"s": "42", "ok": True, "n": 7}),
        ),
        ("f<arg_key>s</arg_key><arg_value>42</arg_value>", None, ("f", {"s": 42})),
        ("f<arg_key>x</arg_key><arg_value>NaN</arg_value>", None, ("f", {"x": "NaN"})),
        ("f\n<arg_key>x</arg_key>\n<arg_value>1", None, None),  # a value never closed
        ("f\n<arg_key>x</arg_key>\n", None, None),  # a key without its value
        ("f\n<arg_key>x\n<arg_value>1</arg_value>", None, None),  # a key never closed
        ("f\n<arg_value>1</arg_value>", None, None),  # a value without its key
        ("f\n<arg_key></arg_key><arg_value>1</arg_value>", None, None),  # an empty key
        ("f\n<arg_key>x</arg_key><arg_value>1</arg_value> more", None, None),
        ("get weather\nnow\n<arg_key>x</arg_key><arg_value>1</arg_value>", None, None),
        ('{"name": "f", "arguments": {}}', None, None),  # Hermes' JSON
        ("<function=f>\n</function>", None, None),  # Qwen3-Coder's
        ("\n<arg_key>x</arg_key><arg_value>1</arg_value>", None, None),  # no name
    ],
)
def test_glm_notation(body: str, types: Any, expected: tuple[str, Any] | None) -> None:
    call = parse_glm(body, types)
    assert (call and (call.name, json.loads(call.arguments))) == expected


def test_glm_values_are_typed_by_the_tools_schemas_and_streamed_in_pieces() -> None:
    types = (("f", "s", "string"), ("f", "n", "integer"))
    text = (
        "Sure.<tool_call>f\n<arg_key>s</arg_key>\n<arg_value>1</arg_value>\n"
        "<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    )
    want = [("f", {"s": "1", "n": 3})]
    assert calls_of(parse([text], output("glm45", types=types))) == want
    assert calls_of(parse(list(text), output("glm45", types=types))) == want
    assert calls_of(parse([text], output("glm45"))) == [("f", {"s": 1, "n": 3})]
    # a malformed block is text, the calls around it read on
    bad = "<tool_call>f\n<arg_value>1</arg_value>\n</tool_call>"
    out = parse([bad + text], output("glm45", types=types))
    assert (out.content, calls_of(out)) == (bad + "Sure.", want)


# ---- LFM2: a Python list of calls between <|tool_call_start|> and <|tool_call_end|> ---------

DEEP = "[f(a=" + "[" * 150 + "]" * 150 + ")]"


@pytest.mark.parametrize(
    ("body", "notation", "expected"),
    [
        # whitespace between calls, an empty argument object, a name with dots
        (
            "<｜tool▁call▁begin｜>a.b<｜tool▁sep｜>{}<｜tool▁call▁end｜>\n",
            "deepseek",
            [("a.b", {})],
        ),
        # V3's fence without its language, and arguments that are not an object: text
        (
            '<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```\n{"x": 1}\n```<｜tool▁call▁end｜>',
            "deepseek",
            [("f", {"x": 1})],
        ),
        ("<｜tool▁call▁begin｜>f<｜tool▁sep｜>[1]<｜tool▁call▁end｜>", "deepseek", None),
        ("<｜tool▁call▁begin｜>f{}<｜tool▁call▁end｜>", "deepseek", None),  # no separator
        ("text <｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜>", "deepseek", None),
        ("<｜tool▁call▁begin｜>two words<｜tool▁sep｜>{}<｜tool▁call▁end｜>", "deepseek", None),
        (
            '<|tool_call_begin|>functions.f:3<|tool_call_argument_begin|>{"x": [1]}'
            "<|tool_call_end|>",
            "kimi",
            [("f", {"x": [1]})],
        ),
        ("<|tool_call_begin|>functions.f:3<|tool_call_argument_begin|>{", "kimi", None),
    ],
)
def test_deepseek_and_kimi_sections(
    body: str, notation: str, expected: list[tuple[str, Any]] | None
) -> None:
    calls = parse_section(body, notation)
    got = None if calls is None else [(c.name, json.loads(c.arguments)) for c in calls]
    assert got == expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('[get_weather(city="Paris", days=3)]', [("get_weather", {"city": "Paris", "days": 3})]),
        ("[f(), g(x='y')]", [("f", {}), ("g", {"x": "y"})]),
        # strings holding quotes, commas, brackets and the end of a call
        (
            r"""[f(a="say \"hi\", (1)]", b='it\'s', c="x)]<|tool_call_end|")]""",
            [("f", {"a": 'say "hi", (1)]', "b": "it's", "c": "x)]<|tool_call_end|"})],
        ),
        (
            '[f(ok=True, no=False, none=None, n=-2.5, xs=[1, "b", [], (2,)], d={"k": {"j": 1}})]',
            [
                (
                    "f",
                    {
                        "ok": True,
                        "no": False,
                        "none": None,
                        "n": -2.5,
                        "xs": [1, "b", [], [2]],
                        "d": {"k": {"j": 1}},
                    },
                )
            ],
        ),
        ('[f(d={"on": true, "off": null})]', [("f", {"d": {"on": True, "off": None}})]),
        ('[f(s="é\\n")]', [("f", {"s": "é\n"})]),
        ("  f(a=1)\n", [("f", {"a": 1})]),  # a lone call, without the list
        # JSON calls, as LFM2 writes them when asked to
        ('[{"name": "f", "arguments": {"a": 1}}, {"name": "g"}]', [("f", {"a": 1}), ("g", {})]),
        # not calls of names with literal keyword arguments: text
        ("[]", None),
        ("[f(1)]", None),
        ("[f(a=b)]", None),
        ("[f(a=1 + 1)]", None),
        ("[f(a=open('x'))]", None),
        ("[os.system(a='x')]", None),
        ("[f(**kw)]", None),
        ("[f(a={1: 2})]", None),
        ("[f(a=b'x')]", None),
        ("[f(a=1e999)]", None),
        ("[f(a=1j)]", None),
        ("[f(a=1), 2]", None),
        ('[f(a="x")', None),
        ("[f(a=1)] [g()]", None),
        ("get weather", None),
        # hostile: nesting past the parser's bounds and past ours, a huge list, a huge block
        ("[f(a=" + "[" * 5000 + ")]", None),
        ("[f(a=" + "-" * 100_000 + "1)]", None),
        ("[f(a=" + "1+" * 100_000 + "1)]", None),
        (DEEP, None),
        ("[f(a=[" + "0, " * 20_000 + "0])]", None),
        ('[f(a="' + "x" * MAX_PYTHONIC_CHARS + '")]', None),
        ("[f(a=1" + "0" * 5000 + ")]", None),
    ],
)
def test_lfm2_calls(body: str, expected: list[tuple[str, Any]] | None) -> None:
    calls = parse_pythonic_calls(body)
    got = calls and [(call.name, json.loads(call.arguments)) for call in calls]
    assert got == expected


def test_lfm2_replies_read_the_same_wherever_the_deltas_are_cut() -> None:
    """Text before the calls; strings that hold the markup; a malformed list (text, markers
    included), and a hostile one refused as text without an exception."""
    calls = (
        'Sure.\n<|tool_call_start|>[f(q="a, b)]", n=None), g(xs=[1, {"k": True}])]'
        "<|tool_call_end|>\nDone."
    )
    malformed = "Hm <|tool_call_start|>[f(a=b)]<|tool_call_end|> then"
    hostile = f"<|tool_call_start|>{DEEP}<|tool_call_end|>"
    for text, content, expected in (
        (calls, "Sure.Done.", [("f", {"q": "a, b)]", "n": None}), ("g", {"xs": [1, {"k": True}]})]),
        (malformed, malformed, []),
        (hostile, hostile, []),
    ):
        whole = summary(parse([text], output("lfm2")))
        assert (whole[1], calls_of(parse([text], output("lfm2")))) == (content, expected)
        for head, tail in splits(text):
            assert summary(parse([head, tail], output("lfm2"))) == whole, (head, tail)


def test_lfm2_forced_grammar_accepts_its_calls_and_nothing_else() -> None:
    from xgrammar.testing import _is_grammar_accept_string

    params = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "days": {"type": "integer"},
            "units": {"enum": ["c", "f"]},
            "opts": {"type": "object", "properties": {"a": {"type": ["boolean", "null"]}}},
            "xs": {"type": "array", "items": {"type": "number"}},
        },
        "required": ["city", "days"],
    }
    tools = [{"name": "get_weather", "parameters": params}, {"name": "get_time"}]
    spec = {"tools": tools, "parallel": True, "format": "lfm2"}
    grammar = grammar_of(Constraint("tools", json.dumps(spec)))
    start, end = "<|tool_call_start|>[", "]<|tool_call_end|>"
    for calls in (
        'get_weather(city="Paris", days=3)',
        r'get_weather(city="P\"aris", days=-3, units="f", opts={"a": None}, xs=[1.5, 2]), '
        "get_time()",
        'get_time(), get_weather(city="", days=0, opts={})',
    ):
        assert _is_grammar_accept_string(grammar, start + calls + end), calls
        assert parse_pythonic_calls(f"[{calls}]")
    for calls in (
        'get_weather(days=3, city="Paris")',  # not in the schema's order
        'get_weather(city="Paris")',  # a required parameter left out
        'get_weather(city="Paris", days=03)',  # not a Python literal
        'get_weather(city="Paris", days="3")',  # not of its type
        'get_weather(city="Paris Nord", days=3)',  # past maxLength
        "get_weather(city='Paris', days=3)",  # single quotes
        'get_weather(city="Paris", days=3, units="k")',
        'get_weather(city="Paris", days=3, opts={"a": true})',
        "get_time(x=1)",
        "set_time()",
        "",
    ):
        assert not _is_grammar_accept_string(grammar, start + calls + end), calls
    assert not _is_grammar_accept_string(grammar, start + "get_time()]")  # no end marker
    one = grammar_of(Constraint("tools", json.dumps({**spec, "parallel": False})))
    assert not _is_grammar_accept_string(one, start + "get_time(), get_time()" + end)
    # what a Python call cannot write is refused up front
    for bad in (
        [{"name": "get-weather"}],
        [{"name": "f", "parameters": {"properties": {"a-b": {}}, "required": ["a-b"]}}],
    ):
        with pytest.raises(InvalidRequestError, match="LFM2"):
            grammar_of(Constraint("tools", json.dumps({**spec, "tools": bad}), param="p"))


def test_the_format_is_detected_from_the_chat_template() -> None:
    def template(text: str | None) -> SimpleNamespace:
        return SimpleNamespace(chat_template=text)

    tools = "{% for t in tools %}{{ t | tojson }}{% endfor %}"
    cases = {
        "{{ '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' }}": "granite",
        "{{ '[AVAILABLE_TOOLS]' }}" + tools + "{{ '[TOOL_CALLS][' }}": "mistral",
        "{{ '<|system|>' + m.content + '<|tool|>' }}" + tools + "{{ '<|/tool|>' }}": "phi4_mini",
        "{{ '<start_function_declaration>' }}{{ '<start_function_call>' }}": "functiongemma",
        # Qwen3-Coder / Qwen3.5: the XML calls it shows, inside Hermes' <tool_call>
        (
            "{{ '<tools>' }}{% for t in tools %}{{ '<function>\\n<name>' ~ t.name ~ '</name>' }}"
            "{% endfor %}{{ '</tools>\\n\\nIf you choose to call a function ONLY reply in the "
            "following format:\\n<tool_call>\\n<function=example_function_name>\\n"
            "<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n"
            "</tool_call>' }}"
        ): "qwen3_coder",
        # GLM-4.5's: its argument tags, inside Hermes' <tool_call>
        (
            "{{ 'For each function call, output the function name and arguments within the "
            "following XML format:\\n<tool_call>{function-name}\\n<arg_key>{arg-key-1}"
            "</arg_key>\\n<arg_value>{arg-value-1}</arg_value>\\n...\\n</tool_call>' }}"
        ): "glm45",
        # Qwen3's: JSON in <tool_call>
        (
            "{{- '<tools>' }}" + tools + "{{- '</tools>\\n\\nFor each function call, return a "
            "json object with function name and arguments within <tool_call></tool_call> XML "
            'tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
            "<args-json-object>}\\n</tool_call>' }}"
        ): "hermes",
        # LFM2's: the tools listed between its tags; LFM2.5's: the history's calls written
        "{{ 'List of tools: <|tool_list_start|>[' }}"
        + tools
        + "{{ ']<|tool_list_end|>' }}": "lfm2",
        "{{ 'List of tools: ' + (tools | tojson) }}{{ '<|tool_call_start|>[' }}": "lfm2",
        # DeepSeek-V3 / R1: the history's calls with fenced arguments; V3.1: bare; Kimi K2
        (
            "{{ '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
            "tool['function']['name'] + '\\n' + '```json' + '\\n' + "
            "tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>' }}"
        ): "deepseek_v3",
        (
            "{{ '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + "
            "'<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>' }}"
        ): "deepseek_v31",
        "{{ '<|tool_calls_section_begin|>' }}" + tools: "kimi_k2",
        "{{ '<tool_call>' }}" + tools: "hermes",
        tools: "hermes",  # a template that shows no format: the forced tool_choice's
    }
    for text, name in cases.items():
        assert resolve_tool_format("auto", template(text)).name == name, text
    assert resolve_tool_format("auto", template(None)).name == "hermes"
    assert resolve_tool_format("granite", template("<tool_call>")).name == "granite"
    with pytest.raises(ValueError, match="tool_call_parser"):
        EngineConfig(tool_call_parser="xml")
    with pytest.raises(ValueError, match="tool_call_parser"):
        load_config(models=[{"tool_call_parser": "pythonic"}], environ={})
    (spec,) = load_config(models=[{"tool_call_parser": "granite"}], environ={}).models
    assert spec.engine.tool_call_parser == "granite"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(FIXTURES / MODEL)


@pytest.fixture(scope="module")
def vocabulary(tokenizer: Any) -> tuple[Any, Any, torch.Tensor]:
    """The fixture's tokenizer as xgrammar sees it, a grammar compiler over it, and which
    tokens' text holds a character that closes a string or an object (CLOSERS)."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    texts = [tokenizer.decode([t]) for t in range(info.vocab_size)]
    closing = torch.tensor([any(c in text for c in CLOSERS) for text in texts])
    return info, xgr.GrammarCompiler(info), closing


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A matcher's filled bitmask (one row of int32 words, token t at bit t % 32 of word
    t // 32) as one bool per token."""
    bits = (bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].bool()


SCHEMA_TOOLS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
    {"name": "get_time", "parameters": None},
]


CLOSERS = ('"', "<", "}", "]")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_forced_tool_choice_writes_calls_the_format_reads_back(
    fmt: str, tokenizer: Any, vocabulary: tuple[Any, Any, torch.Tensor]
) -> None:
    """Seeded random walks through the grammar of tool_choice "required" (and of one call):
    whatever the model picks among the tokens it allows, the text is read back as calls of
    the given tools, their JSON arguments valid (FunctionGemma's: its notation's keys)."""
    info, compiler, closing = vocabulary
    eos = tokenizer.eos_token_id
    for parallel in (True, False):
        spec = {"tools": SCHEMA_TOOLS, "parallel": parallel, "format": fmt}
        grammar = compiler.compile_grammar(grammar_of(Constraint("tools", json.dumps(spec))))
        types = parameter_types(SCHEMA_TOOLS)
        for seed in range(6):
            matcher, rng = xgr.GrammarMatcher(grammar), random.Random(seed)
            mask = xgr.allocate_token_bitmask(1, info.vocab_size)
            ids: list[int] = []
            while not matcher.is_terminated():
                assert len(ids) < 600, tokenizer.decode(ids)
                matcher.fill_next_token_bitmask(mask)
                allowed = allowed_tokens(mask, info.vocab_size)
                choices = torch.nonzero(allowed).flatten().tolist()
                # end where it may, and close strings and objects often: the walk stays short
                closers = torch.nonzero(allowed & closing).flatten().tolist()
                if allowed[eos]:
                    token = eos
                else:
                    token = rng.choice(closers if closers and rng.random() < 0.5 else choices)
                assert matcher.accept_token(token)
                ids.append(token)
            text = tokenizer.decode([t for t in ids if t != eos])
            out = parse([text], output(fmt, parallel, types))
            assert out.content == "" and out.tool_calls, text
            assert parallel or len(out.tool_calls) == 1
            for call in out.tool_calls:
                arguments = json.loads(call.arguments)
                assert call.name in ("get_weather", "get_time"), text
                if call.name == "get_weather" and fmt != "functiongemma":
                    assert set(arguments) == {"city", "days"}, text
                    assert isinstance(arguments["days"], int) and len(arguments["city"]) <= 8
                if call.name == "get_weather" and fmt == "functiongemma":
                    assert set(arguments) <= {"city", "days"}, text
                    assert len(arguments.get("city", "")) <= 8
                    assert isinstance(arguments.get("days", 0), int)


def test_tool_choice_auto_in_the_generic_format_is_free_until_a_call_begins(
    tokenizer: Any,
) -> None:
    """The grammar of tool_choice "auto" where the tools are shown in the generic format:
    any text, and any end, until the model writes <tool_call>; from there only a well-formed
    call of a given tool, its arguments valid against its schema, and text after it again."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    compiler = xgr.GrammarCompiler(info)
    spec = {"tools": SCHEMA_TOOLS, "parallel": True, "auto": True}
    grammar = compiler.compile_grammar(grammar_of(Constraint("tools", json.dumps(spec))))

    def accepts(text: str, end: bool = False) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        ids = tokenizer.encode(text, add_special_tokens=False)
        ids += [tokenizer.eos_token_id] if end else []
        return all(matcher.accept_token(t) for t in ids)

    assert accepts("It is sunny in Paris, no tool needed.", end=True)
    assert accepts("Let me look. <tool_", end=False)  # free until the trigger is whole
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
    assert accepts(call + "</tool_call>", end=True)
    assert accepts("Checking. " + call + "</tool_call>\nDone.", end=True)
    assert not accepts('<tool_call>\n{"name": "get_news"')  # not a given tool
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"town"')
    assert not accepts(call[:-1] + "Sunny", end=True)  # the call must close before text
    assert not accepts('<tool_call>\n{"name": "get_time"', end=True)  # begun: no end yet
    # keywords the grammar cannot hold: a call the model may choose is held to the rest of its
    # schema (a forced one is refused, naming the field)
    tags = {
        "name": "tag",
        "parameters": {
            "type": "object",
            "properties": {
                "not": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
            },
            "required": ["not"],
        },
    }
    loose = {"tools": [tags], "parallel": True, "auto": True}
    held = compiler.compile_grammar(grammar_of(Constraint("tools", json.dumps(loose))))
    matcher = xgr.GrammarMatcher(held)
    text = '<tool_call>\n{"name": "tag", "arguments": {"not": ["a", "a"]}}\n</tool_call>'
    assert all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
    forced = Constraint("tools", json.dumps({"tools": [tags]}), param="tool_choice")
    with pytest.raises(InvalidRequestError, match="uniqueItems"):
        grammar_of(forced)
    one = {**spec, "parallel": False}
    single = compiler.compile_grammar(grammar_of(Constraint("tools", json.dumps(one))))
    matcher = xgr.GrammarMatcher(single)
    ids = tokenizer.encode(call + "</tool_call>", add_special_tokens=False)
    assert all(matcher.accept_token(t) for t in ids)
    assert matcher.is_terminated() or matcher.accept_token(tokenizer.eos_token_id)


def test_a_forced_qwen3_coder_call_is_held_to_the_xml_notation() -> None:
    """The grammar of a forced call in the XML notation: the schema's parameters in its
    order (the required ones present), a string's text without the markup that ends it, other
    values JSON of their schema."""
    tools = [
        {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "unit": {"enum": ["c", "f"]},
                },
                "required": ["city"],
            },
        },
        {"name": "get_time", "parameters": None},
    ]
    spec = {"tools": tools, "format": "qwen3_coder"}
    grammar = grammar_of(Constraint("tools", json.dumps(spec)))
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(grammar)

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    def weather(city: str, rest: str = "") -> str:
        return (
            f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n"
            f"{rest}</function>\n</tool_call>"
        )

    days = "<parameter=days>\n3\n</parameter>\n"
    good = [
        weather("Paris"),
        weather("a <b>x</b>\nline 2 </tool", days + "<parameter=unit>\nc\n</parameter>\n"),
        weather("P") + "\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
    ]
    for text in good:
        assert accepts(text), text
        out = parse([text], output("qwen3_coder", types=parameter_types(tools)))
        assert out.content == "" and out.tool_calls, text
    bad = [
        weather("P</parameter>"),  # a string holding what ends it
        weather("P</tool_call>"),
        weather("P", "<parameter=days>\nthree\n</parameter>\n"),  # not an integer
        weather("P", "<parameter=unit>\nk\n</parameter>\n"),  # not in the enum
        weather("P", "<parameter=zone>\n1\n</parameter>\n"),  # not in the schema
        weather("P", "<parameter=unit>\nc\n</parameter>\n" + days),  # out of order
        "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",  # city is required
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # Hermes' JSON
        "<tool_call>\n<function=get_date>\n</function>\n</tool_call>",  # no such tool
    ]
    for text in bad:
        assert not accepts(text), text


def test_a_forced_glm_call_is_held_to_its_notation() -> None:
    """The grammar of a forced call in GLM-4.5's notation: as the XML notation's (the schema's
    parameters in its order, the required ones present, a string's text without the markup
    that ends it, other values JSON of their schema), in GLM's tags."""
    tools = [
        {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "unit": {"enum": ["c", "f"]},
                },
                "required": ["city"],
            },
        },
        {"name": "get_time", "parameters": None},
        {"name": "note", "parameters": {"type": "object"}},  # any keys
    ]
    spec = {"tools": tools, "format": "glm45"}
    grammar = grammar_of(Constraint("tools", json.dumps(spec)))
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(grammar)

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    def arg(key: str, value: str) -> str:
        return f"<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n"

    def weather(city: str, rest: str = "") -> str:
        return f"<tool_call>get_weather\n{arg('city', city)}{rest}</tool_call>"

    good = [
        weather("Paris"),
        weather("a <b>x</b>\nline 2 </tool", arg("days", "3") + arg("unit", "c")),
        weather("P") + "\n<tool_call>get_time\n</tool_call>",
        "<tool_call>note\n" + arg("any", "text") + arg("b", "2") + "</tool_call>",
    ]
    for text in good:
        assert accepts(text), text
        out = parse([text], output("glm45", types=parameter_types(tools)))
        assert out.content == "" and out.tool_calls, text
    bad = [
        weather("P</arg_value>"),  # a string holding what ends it
        weather("P</tool_call>"),
        weather("P", arg("days", "three")),  # not an integer
        weather("P", arg("unit", "k")),  # not in the enum
        weather("P", arg("zone", "1")),  # not in the schema
        weather("P", arg("unit", "c") + arg("days", "3")),  # out of order
        "<tool_call>get_weather\n</tool_call>",  # city is required
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",  # Qwen3-Coder's
        "<tool_call>get_date\n</tool_call>",  # no such tool
        "<tool_call>get_time\n" + arg("any", "1") + "</tool_call>",  # it takes none
    ]
    for text in bad:
        assert not accepts(text), text


@pytest.mark.anyio
async def test_markers_that_are_special_tokens_stay_in_the_text(tokenizer: Any) -> None:
    """Granite's <|tool_call|>, FunctionGemma's, LFM2's and GLM-4.5's markers are special
    tokens of those models, which decoding skips: with tools on, the router keeps them (and
    skips the rest)."""
    special = AutoTokenizer.from_pretrained(FIXTURES / MODEL)
    markers = ["<|tool_call|>", "<start_function_call>", "<end_function_call>"]
    markers += ["<|tool_call_start|>", "<|tool_call_end|>"]
    # GLM-4.5's (its <tool_call> the fixture's Hermes token, made special here too)
    markers += ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>"]
    markers += ["</arg_value>"]
    special.add_special_tokens({"additional_special_tokens": markers})
    eos = special.eos_token_id
    im_end = special.convert_tokens_to_ids("<|im_end|>")
    for fmt in ("granite", "functiongemma", "lfm2", "glm45"):
        text = REPLIES[fmt]
        ids = [*special.encode(text), im_end, eos]
        assert all(special.convert_tokens_to_ids(m) in ids for m in TOOL_FORMATS[fmt].markers)
        events = await run_router(special, ids, SamplingParams(output=output(fmt)))
        assert reply_of(events) == Reply("", "Let me check.", tuple(CALLS)), fmt
        # without tools the markers are skipped, as every special token is
        plain = reply_of(await run_router(special, ids, SamplingParams()))
        assert TOOL_FORMATS[fmt].start not in plain.content and "<|im_end|>" not in plain.content


# ---- the server: each format through the openai client -------------------------------------

SERVED = {f"tools-{fmt}": fmt for fmt in FORMATS}
# one call, then the grammar ends the reply (a random-weight model would call on and on), of
# tools whose strings are short (it would write on and on)
SHORT = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {key: {"type": "string", "maxLength": 6}},
            },
        },
    }
    for name, key in (("get_weather", "city"), ("get_time", "tz"))
]
FORCED = {"tools": SHORT, "tool_choice": "required", "parallel_tool_calls": False}


@pytest.fixture(scope="module")
def format_servers(tokenizer: Any) -> Iterator[dict[str, ToolServer]]:
    # a model per format, all served at once: eager (the formats are text; compiling each
    # copy of the one fixture would cost seconds of tracing apiece)
    models = {
        name: engine_loader(
            FIXTURES / MODEL, tool_call_parser=fmt, reasoning_parser="none", compile="off"
        )
        for name, fmt in SERVED.items()
    }
    with run_server(models) as server:
        served = {}
        for name in SERVED:
            engine = server.state.models[name].engine
            assert engine is not None
            scripts = Scripts()  # one per engine: its slots' ids are its own
            scripts.attach(engine)
            served[name] = ToolServer(server, scripts, tokenizer)
        yield served


@pytest.mark.anyio
async def test_each_format_through_the_server_streamed_and_not(
    format_servers: dict[str, ToolServer],
) -> None:
    """A scripted reply in each model's format comes back as its calls; tool_choice
    "required" on the (random-weight) model comes back as calls of the given tools, the
    grammar having written them in that model's format."""
    jobs: list[tuple[str, bool, dict[str, Any]]] = []
    for name, fmt in SERVED.items():
        ts = format_servers[name]
        for stream in (False, True):
            messages = ts.script(f"[{fmt}-{stream}]", REPLIES[fmt])
            jobs.append((name, stream, {"messages": messages, "tools": TOOLS}))
            forced = [{"role": "user", "content": f"Weather? ({fmt} {stream})"}]
            jobs.append((name, stream, {"messages": forced, **FORCED}))
    results: list[Reply | None] = [None] * len(jobs)
    server: RunningServer = next(iter(format_servers.values())).server
    async with (
        openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300) as api,
        anyio.create_task_group() as tg,
    ):
        for k, (name, stream, kwargs) in enumerate(jobs):

            async def one(k: int = k, name: str = name, stream: bool = stream, kw: Any = kwargs):
                results[k] = await ask(api, stream, model=name, **{"max_tokens": 200, **kw})

            tg.start_soon(one)
    for (name, stream, kwargs), got in zip(jobs, results, strict=True):
        assert got is not None and got.finish == "tool_calls", (name, stream, got)
        if "tool_choice" in kwargs:
            assert len(got.calls) == 1 and got.calls[0][0] in ("get_weather", "get_time")
            assert all(isinstance(arguments, dict) for _, arguments in got.calls)
        else:
            assert got == Reply("", "Let me check.", tuple(CALLS), "tool_calls"), (name, stream)
