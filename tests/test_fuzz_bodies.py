"""Fuzzing the constraint, Responses, Anthropic Messages and Ollama bodies through a real server on
loopback: structured but hostile requests (random JSON Schemas, regexes, grammars, tools,
Responses items, metadata, previous_response_id, content blocks, options, wrong types
everywhere) must never get a 500 (a 503 only as the documented overload answer, with
Retry-After), must answer valid JSON (or a valid stream that ends properly), 4xx errors in the
API's own shape (OpenAI's, Anthropic's, Ollama's) with no path or traceback in them; the store
stays within its bounds, and the server still serves afterwards.

Each example is one short request (mostly up to 8 tokens, now and then enough for a whole JSON
object or tool call) on the tiny fixtures; the runs are derandomized, so CI sees the same
bodies every time."""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import neuronpy
import neuronpy.server.app
from neuronpy.server.responses_api.store import RESPONSE_SUFFIX, ResponseStore, StoreLimits
from tests.servers import FIXTURES, RunningServer, engine_loader, fixture_model, run_server

PLAIN = "tiny-llama"  # its chat template does not show the model its tools
TOOLS = "tiny-qwen3-tools"  # renders tools; a reasoning parser (<think>) is on
CALLS = "tools-plain"  # the same without the reasoning parser: its tool calls are whole
MODELS = (PLAIN, TOOLS, CALLS)
# small, so that the fuzz run goes past them: the oldest entries are dropped, files removed
LIMITS = StoreLimits(memory_bytes=16 << 10, disk_files=24)
FUZZ = settings(
    deadline=None,  # a slow CI machine: each example is a real request
    derandomize=True,  # the same bodies on every run
    database=None,  # nothing written to the tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# What no error may show: where the code and the environment live, and the server's own files
# (the sessions directory is added once the server runs).
PRIVATE = [str(Path(neuronpy.__file__).resolve().parents[1]), "site-packages"]
PRIVATE += [sys.prefix] if len(sys.prefix) > 4 else []  # (not "/usr": text may hold that)
TRACEBACK = re.compile(r"Traceback \(most recent call last\)|File \"[^\"]*\", line \d+")


STORES: list[ResponseStore] = []  # the one the app builds, so that its bounds can be read
RAN: set[str] = set()  # the fuzz runs that ran (the last test checks what they left)


class _RecordedStore(ResponseStore):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        STORES.append(self)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    sessions = tmp_path_factory.mktemp("sessions")
    PRIVATE.append(str(sessions))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(neuronpy.server.app, "ResponseStore", _RecordedStore)
        # Eager: what is fuzzed is the server's, and compiling the layers at start-up takes
        # longer than the whole run. (A row its constraint's max_mask_ms stops, which a loaded
        # machine may do, is a 400 naming the constraint: an answer the checks accept.)
        config = {"compile": "off"}
        models = {
            **fixture_model(PLAIN, **config),
            **fixture_model(TOOLS, **config),
            CALLS: engine_loader(FIXTURES / TOOLS, reasoning_parser="none", **config),
        }
        with run_server(models, sessions_dir=sessions, stored_responses=LIMITS) as running:
            yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.v1, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def ollama(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{server.url}/api", timeout=120) as client:
        yield client


# ---- values -------------------------------------------------------------------------------------


def mostly(
    usual: st.SearchStrategy[Any], odd: st.SearchStrategy[Any], one_in: int = 12
) -> st.SearchStrategy[Any]:
    """`usual`, and `odd` about once in `one_in`: a body wrong in a place or two gets past the
    first checks, to the code behind them. (The roll that picks `odd` is in the middle of its
    range: Hypothesis draws the ends more often; shrinking goes to 0, the usual.)"""
    return st.integers(0, one_in - 1).flatmap(lambda roll: odd if roll == one_in // 2 else usual)


plain_texts = st.text(st.characters(categories=["Lu", "Ll", "Nd", "P", "Zs", "So"]), max_size=10)
# and as a client may also send it: control characters, lone surrogates (as \u escapes)
TEXT_CHARS = st.characters(categories=["Cc", "Cs", "Ll", "P", "So"])
texts = mostly(plain_texts, st.text(TEXT_CHARS, max_size=6), one_in=30)
names = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True)
# Numbers written as JSON text that Python reads as non-finite or huge, put into the body's
# text in place of these markers (json.dumps cannot write them).
RAW_NUMBERS = {"@1e999@": "1e999", "@-1e999@": "-1e999", "@big@": "1" + "0" * 400}
finite = st.one_of(
    st.integers(-3, 12),
    st.sampled_from([2**31, 2**63, -(2**63), 10**20, 0.5, -0.0, 1e-300, 1.7e308]),
    st.floats(allow_nan=False, allow_infinity=False),
)
non_finite = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf]),  # json.dumps writes NaN, Infinity
    st.sampled_from(sorted(RAW_NUMBERS)),
)
# and strings where a number belongs
number_texts = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "0x10", "1_000", ""])
numbers = mostly(finite, non_finite | number_texts)
schema_numbers = mostly(finite, non_finite | number_texts, one_in=40)  # (many to a schema)
plain_leaves = st.one_of(st.none(), st.booleans(), finite, plain_texts)
leaves = mostly(plain_leaves, non_finite | number_texts | texts)


def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(inner, max_size=3) | st.dictionaries(names | texts, inner, max_size=3)


plain_json = st.recursive(plain_leaves, _containers, max_leaves=6)
any_json = st.recursive(leaves, _containers, max_leaves=8)
counts = mostly(
    st.integers(0, 6),
    st.sampled_from([-1, 10**4, 2**31, 10**20, 1.5, True]) | non_finite,
    one_in=24,
)

# ---- regexes and grammars -----------------------------------------------------------------------

REGEX_ATOMS = [
    "a", "b", "0", " ", ".", "\\d", "\\w", "\\s", "\\D", "[a-c]", "[^x]", "\\b", "^", "$", "é",
    "日", "\\u0041", "\\x41", "\\n", "(?:a)", "\\.", '"', "[\\d-z]", "\\p{L}",
]  # fmt: skip
BROKEN_ATOMS = [
    "[]", "[z-a]", "\\", "\\1", "(?=a)", "(?!a)", "(?<=a)", "(?i)", "(?P<n>a)", "|", "(", ")",
    "{", "}", "[", "]", "*", "\\Q", "\\k<n>",
]  # fmt: skip
QUANTIFIERS = ["", "*", "+", "?", "{2}", "{1,3}", "{0,}"]
ODD_QUANTIFIERS = ["{3,1}", "{,2}", "*?", "**", "{99999999999}", "{2,}?", "++"]
regex_atoms = st.builds(
    lambda atom, quantifier: atom + quantifier,
    mostly(st.sampled_from(REGEX_ATOMS), st.sampled_from(BROKEN_ATOMS)),
    st.sampled_from(QUANTIFIERS) | mostly(st.just(""), st.sampled_from(ODD_QUANTIFIERS)),
)
HOSTILE_REGEXES = [
    "", ".*", "(a*)*b", "(a+)+$", "((a|b)*)*c", "(\\w+\\s*)*", "a{0,50}", "(", "[", "\\",
    "a{2,1}", "(?<!a)b", "(a)\\1", "^$", "$^", "\\p{Lu}+", "[^\\x00-\\x7f]", "(|)", "()*",
]  # fmt: skip
regexes = mostly(
    st.recursive(
        regex_atoms,
        lambda inner: st.one_of(
            st.lists(inner, min_size=2, max_size=3).map("".join),
            st.lists(inner, min_size=2, max_size=3).map("|".join),
            st.builds(lambda r, q: f"({r}){q}", inner, st.sampled_from(QUANTIFIERS)),
        ),
        max_leaves=5,
    ),
    st.sampled_from(HOSTILE_REGEXES),
)

RULE_NAMES = ["root", "root", "r1", "r2"]
EBNF_ATOMS = ['"a"', '"b"', '"\\n"', '"\\""', '"é"', "[a-z]", '[^"]', "r1", "r2", "root"]
BROKEN_EBNF = ['""', "[]", "[z-a]", "undefined_rule", "(", ")", "|", '"', "[", "::=", "/a/"]
ebnf_exprs = st.recursive(
    st.builds(
        lambda atom, quantifier: atom + quantifier,
        mostly(st.sampled_from(EBNF_ATOMS), st.sampled_from(BROKEN_EBNF)),
        st.sampled_from(["", "", "*", "+", "?", "{2,3}"]) | st.sampled_from(["{0,}", "{3,1}"]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=3).map(" ".join),
        st.lists(inner, min_size=2, max_size=3).map(" | ".join),
        st.builds(lambda e, q: f"({e}){q}", inner, st.sampled_from(["", "*", "+", "?"])),
    ),
    max_leaves=5,
)
HOSTILE_GRAMMARS = [
    "",
    "root ::=",
    'root ::= root "a"',  # left-recursive
    'root ::= r1\nr1 ::= root "a"',
    "root ::= r1",  # an undefined rule
    'root ::= ("a"*)*',
    'root ::= "a" | ""',
    "::=",
    'start: "a"',  # Lark, not EBNF
    "root ::= [",
    'root ::= "a"\nroot ::= "b"',
    'r1 ::= "a"',  # no root
    'root ::= "a" root | "b"',
]
grammars = st.one_of(
    st.sampled_from(HOSTILE_GRAMMARS),
    st.lists(st.tuples(st.sampled_from(RULE_NAMES), ebnf_exprs), min_size=1, max_size=3).map(
        lambda rules: "\n".join(f"{name} ::= {expr}" for name, expr in rules)
    ),
)

# ---- JSON Schemas -------------------------------------------------------------------------------

TYPES = ["string", "integer", "number", "boolean", "null", "object", "array"]
WEIRD_TYPES = [["string", "null"], ["integer", "boolean"], [], "str", "any", 5, None, ["object"]]
REFS = [
    "#", "#/$defs/a", "#/$defs/b", "#/$defs/missing", "#/definitions/a", "#/properties/x", "",
    "#/$defs/a/properties/x", "other.json#/a", "http://127.0.0.1:9/schema.json", "#/$defs/%61",
]  # fmt: skip
FORMATS = ["date-time", "date", "time", "email", "uuid", "ipv4", "uri", "hostname", "nope", ""]
KEYWORDS = {
    "minLength": counts,
    "maxLength": counts,
    "pattern": regexes,
    "format": st.sampled_from(FORMATS),
    "minimum": schema_numbers,
    "maximum": schema_numbers,
    "exclusiveMinimum": schema_numbers,
    "exclusiveMaximum": schema_numbers,
    "multipleOf": schema_numbers,
    "description": texts,
    "default": mostly(plain_json, any_json, one_in=24),
    "title": texts,
}


@st.composite
def typed(draw: st.DrawFn) -> dict[str, Any]:
    """A typed schema with a keyword or two (whatever its type takes)."""
    schema = {"type": draw(mostly(st.sampled_from(TYPES), st.sampled_from(WEIRD_TYPES)))}
    for keyword in draw(st.lists(st.sampled_from(sorted(KEYWORDS)), max_size=2, unique=True)):
        schema[keyword] = draw(KEYWORDS[keyword])
    return schema


leaf_schemas = mostly(
    st.one_of(
        typed(),
        typed(),
        typed(),
        st.fixed_dictionaries({"enum": st.lists(plain_leaves, max_size=4)}),
        st.fixed_dictionaries({"const": plain_json}),
        st.fixed_dictionaries({"$ref": st.sampled_from(REFS)}),
        st.just({}),
    ),
    st.booleans() | any_json,  # true and false are schemas; and what is not a schema at all
)


def _schemas(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    objects = st.fixed_dictionaries(
        {"type": st.just("object"), "properties": st.dictionaries(names, inner, max_size=4)},
        optional={
            "required": mostly(st.lists(names, max_size=3), any_json),
            "additionalProperties": st.booleans() | inner,
            "minProperties": counts,
            "maxProperties": counts,
            "patternProperties": st.dictionaries(regexes, inner, max_size=2),
            "propertyNames": inner,
        },
    )
    arrays = st.fixed_dictionaries(
        {"type": st.just("array")},
        optional={
            "items": inner,
            "prefixItems": st.lists(inner, max_size=3),
            "minItems": counts,
            "maxItems": counts,
            "uniqueItems": st.booleans(),
            "contains": inner,
        },
    )
    combined = st.builds(
        lambda word, parts: {word: parts},
        st.sampled_from(["anyOf", "oneOf", "allOf"]),
        mostly(st.lists(inner, max_size=3), any_json),
    )
    conditional = st.fixed_dictionaries(
        {}, optional={"not": inner, "if": inner, "then": inner, "else": inner}
    )
    with_defs = st.builds(
        lambda schema, defs, word: {**schema, word: defs} if isinstance(schema, dict) else schema,
        inner,
        st.dictionaries(st.sampled_from(["a", "b"]), inner, max_size=2),
        st.sampled_from(["$defs", "$defs", "definitions"]),
    )
    return st.one_of(objects, objects, objects, arrays, arrays, combined, conditional, with_defs)


schemas = st.recursive(leaf_schemas, _schemas, max_leaves=6)
# what a field that takes a schema object gets: mostly objects with a few properties
object_schemas = st.one_of(
    st.builds(
        lambda props, required: {"type": "object", "properties": props, "required": required},
        st.dictionaries(names, schemas, min_size=1, max_size=3),
        st.lists(names, max_size=2),
    ),
    schemas,
)

# ---- chat and completions: the constraint fields ------------------------------------------------

response_formats = mostly(
    st.one_of(
        st.just({"type": "json_object"}),
        st.just({"type": "text"}),
        st.fixed_dictionaries(
            {
                "type": st.just("json_schema"),
                "json_schema": mostly(
                    st.fixed_dictionaries(
                        {"schema": object_schemas},
                        optional={"name": names, "strict": st.booleans()},
                    ),
                    any_json,
                ),
            }
        ),
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["json", "regex", "grammar"]) | texts})
    | any_json,
)
STRUCTURED_KEYS = ["json", "regex", "choice", "grammar", "json_object"]
choices = mostly(st.lists(texts, max_size=5), st.lists(leaves, min_size=1, max_size=3) | any_json)
structured_values = {
    "json": mostly(object_schemas | object_schemas.map(json.dumps), texts | leaves),
    "regex": mostly(regexes, leaves),
    "choice": choices,
    "grammar": mostly(grammars, leaves),
    "json_object": mostly(st.just(True), leaves),
}
structured_outputs = mostly(
    st.sampled_from(STRUCTURED_KEYS).flatmap(
        lambda key: st.fixed_dictionaries({key: structured_values[key]})
    ),
    st.one_of(
        st.fixed_dictionaries(
            {}, optional={**structured_values, "backend": texts, "disable_fallback": leaves}
        ),
        st.dictionaries(names, any_json, max_size=2),  # unknown keys
        any_json,
    ),
)
CONSTRAINTS: dict[str, st.SearchStrategy[Any]] = {
    "response_format": response_formats,
    "structured_outputs": structured_outputs,
    "guided_json": structured_values["json"],
    "guided_regex": structured_values["regex"],
    "guided_choice": choices,
    "guided_grammar": structured_values["grammar"],
}
functions = st.fixed_dictionaries(
    {"name": mostly(names, texts | leaves)},
    optional={
        "description": texts,
        "parameters": mostly(object_schemas, any_json),
        "strict": st.booleans(),
    },
)
chat_tools = st.lists(
    mostly(st.fixed_dictionaries({"type": st.just("function"), "function": functions}), any_json),
    min_size=1,
    max_size=3,
)


def _tool_choices(tools: list[Any]) -> st.SearchStrategy[Any]:
    known = [
        t["function"]["name"]
        for t in tools
        if isinstance(t, dict) and isinstance(t.get("function"), dict)
    ]
    named = st.sampled_from(known) if known else names
    return mostly(
        st.one_of(
            st.sampled_from(["required", "required", "auto", "none"]),
            st.builds(lambda n: {"type": "function", "function": {"name": n}}, named),
        ),
        st.one_of(
            st.builds(lambda n: {"type": "function", "function": {"name": n}}, names),
            st.builds(lambda n: {"type": "function", "name": n}, named),  # the Responses shape
            st.just("any"),
            any_json,
        ),
    )


tools_fields = chat_tools.flatmap(
    lambda tools: st.fixed_dictionaries(
        {"tools": st.just(tools), "tool_choice": _tool_choices(tools)},
        optional={"parallel_tool_calls": mostly(st.booleans(), leaves)},
    )
)


@st.composite
def constraint_fields(draw: st.DrawFn, chat: bool) -> dict[str, Any]:
    """Mostly one constraint, now and then two (which the server refuses)."""
    kinds = [*CONSTRAINTS, *(["tools", "tools"] if chat else [])]
    picked = draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=2, unique=True))
    if len(picked) == 2 and draw(st.integers(0, 5)):
        picked = picked[:1]
    out: dict[str, Any] = {}
    for kind in picked:
        out |= draw(tools_fields) if kind == "tools" else {kind: draw(CONSTRAINTS[kind])}
    return out


# Where "wrong types everywhere" go: any field, replaced by any JSON.
CHAT_FIELDS = [
    "model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options",
    "n", "temperature", "seed", "stop", "logprobs", "top_logprobs", "tools", "tool_choice",
    "response_format", "structured_outputs", "guided_json", "guided_choice", "extra_unknown",
]  # fmt: skip
messages = st.one_of(
    st.builds(lambda text: [{"role": "user", "content": text}], texts),
    st.builds(
        lambda system, text: [
            {"role": "system", "content": system},
            {"role": "user", "content": text},
        ],
        texts,
        texts,
    ),
)
sampling = {
    "stream": st.booleans(),
    "stop": st.lists(plain_texts, max_size=2),
    "temperature": st.sampled_from([0, 0.7, 1.0]),
    "seed": st.integers(0, 2**32),
    "n": st.integers(1, 2),
}


def wrong_types(fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """A field or two (or an unknown one) of any JSON value, now and then: else none."""
    return mostly(
        st.just({}), st.dictionaries(st.sampled_from(fields) | names, any_json, max_size=2)
    )


# Tokens to a request: a few, now and then enough for a JSON object to end.
lengths = mostly(st.integers(1, 8), st.just(24), one_in=8)


def short(body: dict[str, Any], field: str) -> dict[str, Any]:
    """`body` with a length: without one a request runs to the end of the context (seconds)."""
    if body.get(field) is None and body.get("max_completion_tokens") is None:
        body[field] = 8
    return body


# Tool calls the model makes whole (a random tool's arguments rarely end in a few tokens): a
# simple tool, required, with tokens enough for the call's markup.
SIMPLE_PARAMETERS = [
    {"type": "object", "properties": {}},
    {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]},
]
simple_tools = st.builds(
    lambda name, parameters: {"type": "function", "name": name, "parameters": parameters},
    names,
    st.sampled_from(SIMPLE_PARAMETERS),
)
CALL_TOKENS = 48  # (a call takes 30 to 45 on the fixture)


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    if draw(st.integers(0, 15)) == 7:  # a whole tool call (see simple_tools)
        tool = draw(simple_tools)
        function = {k: tool[k] for k in ("name", "parameters")}
        body = {"model": CALLS, "messages": draw(messages), "max_tokens": CALL_TOKENS}
        body |= {"tools": [{"type": "function", "function": function}], "tool_choice": "required"}
        return body | draw(st.fixed_dictionaries({}, optional=sampling))
    body = {"model": draw(st.sampled_from(MODELS)), "messages": draw(messages)}
    body["max_tokens"] = draw(lengths)
    body |= draw(st.fixed_dictionaries({}, optional=sampling))
    if draw(st.integers(0, 5)) == 3:
        body |= {"logprobs": True, "top_logprobs": draw(st.integers(0, 3))}
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    body |= draw(constraint_fields(chat=True))
    body |= draw(wrong_types(CHAT_FIELDS))
    return short(body, "max_tokens")


@st.composite
def completion_bodies(draw: st.DrawFn) -> dict[str, Any]:
    prompt = draw(mostly(plain_texts, texts | st.lists(st.integers(0, 400), max_size=4)))
    body = {"model": draw(st.sampled_from(MODELS)), "prompt": prompt}
    body["max_tokens"] = draw(lengths)
    body |= draw(st.fixed_dictionaries({}, optional={**sampling, "logprobs": st.integers(0, 3)}))
    body |= draw(constraint_fields(chat=False))
    body |= draw(wrong_types([f for f in CHAT_FIELDS if f != "messages"] + ["prompt"]))
    return short(body, "max_tokens")


# ---- the Responses API --------------------------------------------------------------------------

# Stored responses seen so far: what `previous_response_id` may name for real.
STORED: list[str] = []


class Earlier:
    """A marker for `previous_response_id`: the id of one of the responses stored lately in
    the run (the `index`-th from the newest, modulo as many as are kept), resolved when the
    request is sent."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"Earlier({self.index})"


ROLES = ["user", "system", "developer", "assistant"]
ODD_ROLES = ["tool", "function", "", "User", "root"]
ITEM_TYPES = ["message", "function_call", "function_call_output", "reasoning"]
ODD_ITEM_TYPES = ["input_text", "file_search_call", "", "item_reference"]
PART_TYPES = ["input_text", "output_text", "text"]
ODD_PART_TYPES = ["input_image", "input_file", "refusal", "summary_text", ""]
parts = st.fixed_dictionaries(
    {
        "type": mostly(st.sampled_from(PART_TYPES), st.sampled_from(ODD_PART_TYPES) | texts),
        "text": mostly(texts, leaves),
    },
    optional={"annotations": mostly(st.just([]), any_json)},
)
contents = mostly(texts | st.lists(parts, max_size=3), leaves | any_json)
call_ids = mostly(st.from_regex(r"call_[a-z0-9]{1,8}", fullmatch=True), texts | leaves)
usual_items = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(ROLES), "content": contents},
        optional={"type": st.just("message"), "id": texts, "status": texts},
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": call_ids,
            "name": mostly(names, leaves),
            "arguments": mostly(plain_json.map(json.dumps), texts | leaves),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": call_ids, "output": contents}
    ),
    st.fixed_dictionaries(
        {"type": st.just("reasoning")},
        optional={
            "summary": mostly(st.just([]), any_json),
            "content": mostly(st.just([]), any_json),
        },
    ),
)
odd_items = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(ODD_ROLES) | leaves, "content": contents},
        optional={"type": st.sampled_from(ITEM_TYPES + ODD_ITEM_TYPES) | leaves},
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(ITEM_TYPES + ODD_ITEM_TYPES) | texts},
        optional={"id": texts, "call_id": leaves, "output": any_json, "content": contents},
    ),
    any_json,
)
inputs = mostly(
    texts | st.lists(mostly(usual_items, odd_items), min_size=1, max_size=4),
    st.just([]) | leaves | any_json,
)
# extra keys beside the known ones (tools', text.format's): echoed back, stored
extra = mostly(
    st.dictionaries(st.sampled_from(["extra", "x_vendor", "name"]), plain_json, max_size=2),
    st.dictionaries(st.sampled_from(["extra", "strict", "schema"]) | texts, any_json, max_size=2),
)
text_formats = mostly(
    st.one_of(
        st.just({"type": "text"}),
        st.just({"type": "json_object"}),
        st.builds(
            lambda schema, name, more: {
                "type": "json_schema",
                "name": name,
                "schema": schema,
                **more,
            },
            object_schemas,
            names,
            extra,
        ),
    ),
    st.builds(lambda more: {"type": "json_schema", **more}, extra) | any_json,
)
texts_field = mostly(
    st.builds(lambda fmt, more: {"format": fmt, **more}, text_formats, extra),
    st.fixed_dictionaries({"verbosity": texts | leaves}) | any_json,
)
response_tools = mostly(
    st.lists(
        mostly(
            st.builds(
                lambda name, f, more: {"type": "function", "name": name, **f, **more},
                names,
                st.fixed_dictionaries(
                    {},
                    optional={
                        "description": mostly(texts, leaves),
                        "parameters": object_schemas,
                        "strict": mostly(st.booleans(), leaves),
                    },
                ),
                extra,
            ),
            st.fixed_dictionaries({"type": st.sampled_from(["web_search", "file_search", "mcp"])})
            | any_json,
        ),
        max_size=3,
    ),
    any_json,
)
metadata = mostly(
    st.dictionaries(names, plain_texts, max_size=4),
    st.one_of(
        st.dictionaries(
            st.text(st.characters(categories=["Ll", "Nd"]), max_size=70)
            | st.sampled_from(["a" * 64, "a" * 65]),
            st.sampled_from(["v" * 512, "v" * 513]) | leaves,
            max_size=18,
        ),
        st.builds(lambda n: {f"k{i}": "v" for i in range(n)}, st.integers(15, 40)),
        any_json,
    ),
)
previous_ids = mostly(
    st.builds(Earlier, st.integers(0, 10**6)),
    st.one_of(
        st.from_regex(r"resp_[0-9a-f]{32}", fullmatch=True),  # looks right, is no response
        st.sampled_from(["resp_", "resp_../../etc/passwd", "../x", "resp_" + "0" * 32 + ".json"]),
        texts,
        leaves,
    ),
)
RESPONSE_OPTIONAL = {
    "instructions": mostly(texts, leaves),
    "text": texts_field,
    "tools": response_tools,
    "tool_choice": mostly(
        st.sampled_from(["auto", "none", "required"]),
        st.builds(lambda n: {"type": "function", "name": n}, names) | any_json,
    ),
    "metadata": metadata,
    "previous_response_id": previous_ids,
    "stream": mostly(st.booleans(), leaves),
    "store": mostly(st.booleans(), leaves),
    "temperature": mostly(st.sampled_from([0, 1.0]), numbers),
    "parallel_tool_calls": mostly(st.booleans(), leaves),
    "truncation": mostly(st.sampled_from(["disabled", "auto"]), leaves),
    "reasoning": mostly(
        st.fixed_dictionaries({"effort": st.sampled_from(["low", "high"])}), any_json
    ),
    "user": texts,
}
CALL_OPTIONAL = {
    k: v for k, v in RESPONSE_OPTIONAL.items() if k not in ("text", "tools", "tool_choice", "store")
}
RESPONSE_FIELDS = [*RESPONSE_OPTIONAL, "model", "input", "max_output_tokens", "unknown_key"]


@st.composite
def response_bodies(draw: st.DrawFn) -> dict[str, Any]:
    if draw(st.integers(0, 7)) == 3:
        tool = draw(simple_tools)
        choice = draw(st.sampled_from(["required", {"type": "function", "name": tool["name"]}]))
        body = {"model": CALLS, "input": draw(inputs), "max_output_tokens": CALL_TOKENS}
        body |= {"tools": [tool], "tool_choice": choice, "store": True}
        return body | draw(st.fixed_dictionaries({}, optional=CALL_OPTIONAL))
    body = {"model": draw(st.sampled_from(MODELS)), "input": draw(inputs)}
    body["max_output_tokens"] = draw(
        mostly(lengths, st.sampled_from([0, -1, "4", 1.5, True, 10**6, 10**20]))
    )
    body |= draw(st.fixed_dictionaries({}, optional=RESPONSE_OPTIONAL))
    body |= draw(wrong_types(RESPONSE_FIELDS))
    return short(body, "max_output_tokens")


# ---- Anthropic's and Ollama's bodies ------------------------------------------------------------

# tool names chat's rule refuses (the Messages and Ollama requests reach it translated)
ODD_TOOL_NAMES = ["", "a b", "x" * 65, "é", "a.b", "a/b"]
# (often: a refused name must reach the translation, past every other field's checks)
tool_names = mostly(names, st.sampled_from(ODD_TOOL_NAMES), one_in=3)
anthropic_tools = mostly(
    st.lists(
        st.fixed_dictionaries(
            {"name": tool_names, "input_schema": mostly(object_schemas, any_json)},
            optional={
                "description": mostly(texts, leaves),
                "type": mostly(st.just("custom"), texts),
            },
        ),
        min_size=1,
        max_size=3,
    ),
    any_json,
)
anthropic_blocks = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": mostly(texts, leaves)}),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": mostly(call_ids, leaves),
            "name": tool_names,
            "input": mostly(st.dictionaries(names, plain_json, max_size=2), any_json),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": mostly(call_ids, st.just("") | leaves)},
        optional={"content": contents, "is_error": mostly(st.booleans(), leaves)},
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["thinking", "redacted_thinking"])},
        optional={"thinking": mostly(texts, leaves), "signature": texts, "data": texts},
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["image", "document", "nope", ""]) | leaves},
        optional={"source": any_json},
    ),
)
anthropic_messages = mostly(
    st.lists(
        st.fixed_dictionaries(
            {
                "role": mostly(st.sampled_from(["user", "assistant"]), st.sampled_from(ODD_ROLES)),
                "content": mostly(texts, st.lists(anthropic_blocks, max_size=3), one_in=3),
            }
        ),
        min_size=1,
        max_size=3,
    ),
    st.just([]) | any_json,
)
ANTHROPIC_OPTIONAL = {
    "system": mostly(texts, st.lists(anthropic_blocks, max_size=2) | leaves),
    "temperature": mostly(st.sampled_from([0, 0.5, 1]), numbers),
    "top_p": mostly(st.sampled_from([0.5, 1]), numbers),
    "top_k": mostly(st.integers(-1, 5), numbers),
    "stop_sequences": mostly(st.lists(plain_texts, max_size=3), any_json),
    "stream": mostly(st.booleans(), leaves),
    "tools": anthropic_tools,
    "tool_choice": mostly(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["auto", "any", "none", "tool"])},
            optional={"name": tool_names, "disable_parallel_tool_use": st.booleans()},
        ),
        any_json,
    ),
    "thinking": mostly(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["enabled", "disabled", "adaptive"])},
            optional={"budget_tokens": counts | st.sampled_from([1024, 4096])},
        ),
        any_json,
    ),
    "metadata": mostly(
        st.fixed_dictionaries({}, optional={"user_id": plain_texts}),
        st.fixed_dictionaries({"user_id": st.just("u" * 257) | leaves}) | metadata,
    ),
    "output_config": mostly(
        st.fixed_dictionaries(
            {
                "format": st.builds(
                    lambda schema: {"type": "json_schema", "schema": schema}, object_schemas
                )
            }
        ),
        any_json,
    ),
}
ANTHROPIC_FIELDS = [*ANTHROPIC_OPTIONAL, "model", "messages", "max_tokens", "container"]


@st.composite
def anthropic_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body = {"model": draw(st.sampled_from(MODELS)), "messages": draw(anthropic_messages)}
    body["max_tokens"] = draw(
        mostly(lengths, st.sampled_from([0, -1, "4", 1.5, True, 10**6, 10**20]))
    )
    body |= draw(st.fixed_dictionaries({}, optional=ANTHROPIC_OPTIONAL))
    if draw(st.integers(0, 3)) == 1:  # tools and nothing odd elsewhere: they reach the translation
        return {**body, "tools": draw(anthropic_tools), "max_tokens": 4}
    body |= draw(wrong_types(ANTHROPIC_FIELDS))
    return body


OLLAMA_OPTIONS = {
    "temperature": numbers,
    "top_p": numbers,
    "top_k": mostly(st.integers(-3, 5), numbers),
    "min_p": numbers,
    "seed": numbers,
    "stop": mostly(st.lists(plain_texts, max_size=2), any_json),
    "repeat_penalty": numbers,
    "presence_penalty": numbers,
    "mirostat": mostly(st.just(0), numbers),
    "num_ctx": numbers,
    "not_an_option": leaves,
}
ollama_options = mostly(
    st.builds(
        lambda predict, more: {"num_predict": predict, **more},
        mostly(lengths, st.sampled_from([0, -1, -2, -3, 1.5, "4", True])),
        st.fixed_dictionaries({}, optional=OLLAMA_OPTIONS),
    ),
    any_json,
)
ollama_calls = st.lists(
    st.fixed_dictionaries(
        {
            "function": mostly(
                st.fixed_dictionaries(
                    {"name": tool_names},
                    optional={
                        "arguments": mostly(
                            st.dictionaries(names, plain_json, max_size=2), any_json
                        )
                    },
                ),
                any_json,
            )
        }
    ),
    max_size=2,
)
ollama_messages = mostly(
    st.lists(
        st.fixed_dictionaries(
            {
                "role": mostly(
                    st.sampled_from(["system", "user", "assistant", "tool"]),
                    st.sampled_from(ODD_ROLES),
                )
            },
            optional={
                "content": mostly(texts, leaves),
                "thinking": mostly(texts, leaves),
                "tool_calls": mostly(ollama_calls, any_json),
                "tool_name": mostly(tool_names, leaves),
                "images": mostly(st.just([]), any_json),
            },
        ),
        min_size=1,
        max_size=3,
    ),
    st.just([]) | any_json,
)
OLLAMA_OPTIONAL = {
    "format": mostly(st.just("json") | object_schemas, any_json),
    "stream": mostly(st.booleans(), leaves),
    "think": mostly(st.sampled_from([True, False, "low", "high"]), st.just("ultra") | leaves),
    "keep_alive": leaves,
    "logprobs": mostly(st.booleans(), leaves),
    "top_logprobs": counts,
}
OLLAMA_FIELDS = [*OLLAMA_OPTIONAL, "model", "messages", "options", "tools", "prompt", "raw"]


@st.composite
def ollama_chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body = {"model": draw(st.sampled_from([*MODELS, PLAIN + ":latest"]))}
    body |= {"messages": draw(ollama_messages), "options": draw(ollama_options)}
    if draw(st.integers(0, 3)) == 0:
        body["tools"] = draw(mostly(chat_tools, any_json))
    body |= draw(st.fixed_dictionaries({}, optional=OLLAMA_OPTIONAL))
    return body | draw(wrong_types(OLLAMA_FIELDS))


@st.composite
def ollama_generate_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body = {"model": draw(st.sampled_from(MODELS)), "prompt": draw(mostly(texts, leaves))}
    body["options"] = draw(ollama_options)
    body |= draw(
        st.fixed_dictionaries(
            {},
            optional={
                **OLLAMA_OPTIONAL,
                "system": mostly(texts, leaves),
                "raw": mostly(st.booleans(), leaves),
                "suffix": mostly(st.just(""), texts),
                "context": mostly(st.just([]), any_json),
                "images": mostly(st.just([]), any_json),
            },
        )
    )
    return body | draw(wrong_types(OLLAMA_FIELDS))


embed_bodies = st.fixed_dictionaries(
    {
        "model": st.sampled_from([PLAIN, PLAIN + ":latest"]) | leaves,
        "input": mostly(texts | st.lists(plain_texts, min_size=1, max_size=3), any_json),
    },
    optional={
        "truncate": mostly(st.booleans(), leaves),
        "dimensions": mostly(st.integers(1, 16), counts | leaves),
        "keep_alive": leaves,
        "options": any_json,
    },
)


# ---- sending, and what every answer must be -----------------------------------------------------


def encoded(body: Any) -> bytes:
    """A body as a client writes it (non-ASCII as \\u escapes), the raw number markers as the
    numbers they stand for."""
    text = json.dumps(body)
    for marker, number in RAW_NUMBERS.items():
        text = text.replace(json.dumps(marker), number)
    return text.encode()


def resolved(body: dict[str, Any]) -> dict[str, Any]:
    """`body` with its Earlier marker replaced by the id it stands for (None before any)."""
    if isinstance(body.get("previous_response_id"), Earlier):
        kept = STORED[-LIMITS.disk_files :]
        index = body["previous_response_id"].index
        body = {**body, "previous_response_id": kept[-1 - index % len(kept)] if kept else None}
    return body


def post(client: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return client.post(path, content=encoded(body), headers=headers)


def strict_json(text: str) -> Any:
    """JSON as RFC 8259 has it: no NaN or Infinity (which Python's decoder would take)."""

    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} is not JSON: {text[:300]}")

    return json.loads(text, parse_constant=refuse)


def check_private(text: str) -> None:
    assert not TRACEBACK.search(text), text[:2000]
    for place in PRIVATE:
        assert place not in text, f"{place!r} in {text[:2000]}"


def check_error(error: object, text: str) -> None:
    """OpenAI's error object."""
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, text
    assert isinstance(error["message"], str) and error["message"], text
    assert isinstance(error["type"], str), text
    assert error["param"] is None or isinstance(error["param"], str), text
    assert error["code"] is None or isinstance(error["code"], str), text


# What a Responses error must not name: the chat request's fields that the Responses request
# has under other names (or not at all).
CHAT_NAMES = re.compile(
    r"\bmessages\[|'messages'|(?<!_)\bmax_tokens\b|response_format|json_schema\.schema"
    r"|\.function\b|\btool_calls\b|\btool_call_id\b"
)


def check_responses_error(error: dict[str, Any], body: dict[str, Any]) -> None:
    """A Responses error names the Responses request's fields: one it sent (or input, which it
    must), never the chat request's it was translated into."""
    param, message = error["param"], error["message"]
    assert not CHAT_NAMES.search(message), error
    if param is not None:
        assert not CHAT_NAMES.search(param), error
        head = re.split(r"[.\[]", param, maxsplit=1)[0]
        assert head in body or head == "input", error


def events_of(text: str) -> list[tuple[str | None, str]]:
    """An event stream's events, as (event name, data), each whole."""
    assert text.endswith("\n\n"), f"the stream ends mid-event: {text[-300:]!r}"
    out = []
    for block in text[:-2].split("\n\n"):
        name, data = None, None
        for line in block.split("\n"):
            field, sep, value = line.partition(": ")
            assert sep and field in ("event", "data"), block
            if field == "event":
                name = value
            else:
                data = value
        assert data is not None, block
        out.append((name, data))
    return out


def check_answer(response: httpx.Response, path: str, body: dict[str, Any]) -> Any:
    """What every answer must be; the 200's body (an event stream's as its parsed events)."""
    status, text = response.status_code, response.text
    check_private(text)
    if status >= 500:  # the one documented 5xx: overload, with when to come back
        assert status == 503 and "retry-after" in response.headers, f"{status}: {text[:2000]}"
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert status == 200
        return check_stream(text, path)
    answer = strict_json(text)
    if status != 200:
        assert isinstance(answer, dict) and set(answer) == {"error"}, text
        check_error(answer["error"], text)
        if path == "/responses" and status != 503:
            check_responses_error(answer["error"], body)
    return answer


def check_stream(text: str, path: str) -> list[Any]:
    events = events_of(text)
    if path == "/responses":
        parsed = []
        for i, (name, data) in enumerate(events):
            event = strict_json(data)
            assert event["type"] == name and event["sequence_number"] == i, data
            parsed.append(event)
        assert parsed[0]["type"] == "response.created", text[:500]
        last = parsed[-1]["type"]
        assert last in ("response.completed", "response.incomplete", "response.failed"), last
        return parsed
    assert all(name is None for name, _ in events) and events[-1][1] == "[DONE]", text[-500:]
    chunks = [strict_json(data) for _, data in events[:-1]]
    for chunk in chunks:
        if "error" in chunk:
            check_error(chunk["error"], text)
    return chunks


def check_foreign(response: httpx.Response, api: str) -> None:
    """An Anthropic (`api` "anthropic") or Ollama ("ollama") answer: a 200 (whole, or a stream
    that ends properly) or a 4xx in that API's error shape; never a 500, nothing private."""
    status, text = response.status_code, response.text
    check_private(text)
    if status >= 500:
        assert status == 503 and "retry-after" in response.headers, f"{status}: {text[:2000]}"
    kind = response.headers.get("content-type", "")
    if status == 200 and kind.startswith("text/event-stream"):
        events = events_of(text)
        assert events[0][0] == "message_start", text[:500]
        assert events[-1][0] in ("message_stop", "error"), text[-500:]
        for name, data in events:
            assert strict_json(data)["type"] == name, data
        return
    if status == 200 and kind.startswith("application/x-ndjson"):
        lines = [strict_json(line) for line in text.splitlines()]
        assert lines and (lines[-1].get("done") is True or set(lines[-1]) == {"error"}), text
        return
    answer = strict_json(text)
    if status == 200:
        assert isinstance(answer, dict) and "error" not in answer, text
        return
    if api == "anthropic":
        assert set(answer) == {"type", "error"} and answer["type"] == "error", text
        assert set(answer["error"]) == {"type", "message"}, text
        assert isinstance(answer["error"]["message"], str) and answer["error"]["message"], text
    else:
        assert set(answer) == {"error"} and isinstance(answer["error"], str), text
        assert answer["error"], text


def send(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    """One request, and every check its answer must pass; a stored response is read back as it
    was answered (and now and then deleted)."""
    body = resolved(body)
    answer = check_answer(post(client, path, body), path, body)
    if path != "/responses" or (isinstance(answer, dict) and set(answer) == {"error"}):
        return
    if isinstance(answer, list):  # streamed: the whole response is in its last event
        answer = answer[-1]["response"]
    assert answer["object"] == "response" and answer["id"].startswith("resp_"), answer
    if not answer["store"] or answer["status"] not in ("completed", "incomplete"):
        return
    rid = answer["id"]
    got = client.get(f"/responses/{rid}")
    assert got.status_code == 200, got.text[:2000]
    assert strict_json(got.text) == answer
    if int(rid[-2:], 16) % 7 == 0:  # (a seventh of them, as the random id falls)
        assert client.delete(f"/responses/{rid}").status_code == 200
        assert client.get(f"/responses/{rid}").status_code == 404
    else:
        STORED.append(rid)


# ---- the fuzz runs ------------------------------------------------------------------------------


@settings(FUZZ, max_examples=120)
@given(body=chat_bodies())
def test_fuzz_chat_constraints(client: httpx.Client, body: dict[str, Any]) -> None:
    send(client, "/chat/completions", body)


@settings(FUZZ, max_examples=60)
@given(body=completion_bodies())
def test_fuzz_completion_constraints(client: httpx.Client, body: dict[str, Any]) -> None:
    send(client, "/completions", body)


@settings(FUZZ, max_examples=160)
@given(body=response_bodies())
def test_fuzz_responses(client: httpx.Client, body: dict[str, Any]) -> None:
    RAN.add("responses")
    send(client, "/responses", body)


@settings(FUZZ, max_examples=60)
@given(body=anthropic_bodies())
def test_fuzz_anthropic_messages(client: httpx.Client, body: dict[str, Any]) -> None:
    check_foreign(post(client, "/messages", body), "anthropic")


@settings(FUZZ, max_examples=40)
@given(body=ollama_chat_bodies())
def test_fuzz_ollama_chat(ollama: httpx.Client, body: dict[str, Any]) -> None:
    check_foreign(post(ollama, "/chat", body), "ollama")


@settings(FUZZ, max_examples=30)
@given(body=ollama_generate_bodies())
def test_fuzz_ollama_generate(ollama: httpx.Client, body: dict[str, Any]) -> None:
    check_foreign(post(ollama, "/generate", body), "ollama")


@settings(FUZZ, max_examples=20)
@given(body=embed_bodies)
def test_fuzz_ollama_embed(ollama: httpx.Client, body: dict[str, Any]) -> None:
    check_foreign(post(ollama, "/embed", body), "ollama")


requests = st.one_of(
    st.tuples(st.just("/chat/completions"), chat_bodies()),
    st.tuples(st.just("/completions"), completion_bodies()),
    st.tuples(st.just("/responses"), response_bodies()),
)


def abandon(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    """A request whose client hangs up after the first bytes of its answer (or before any, when
    its constraint compiles): the server cancels it, as the final test's idle engines show.
    (Not stored: what the store keeps is what `send` saw answered.)"""
    body = resolved(body) | ({"store": False} if path == "/responses" else {})
    headers = {"content-type": "application/json"}
    with client.stream("POST", path, content=encoded(body), headers=headers) as response:
        if response.status_code >= 500:
            assert response.status_code == 503 and "retry-after" in response.headers
        next(response.iter_raw(), None)


# a few requests at once: each its own, or one body sent by all (a constraint compiled once for
# them all, its error shared); now and then one of them hangs up
batches = st.one_of(
    st.lists(requests, min_size=2, max_size=4),
    st.builds(lambda request, n: [request] * n, requests, st.integers(2, 4)),
)


@settings(FUZZ, max_examples=30)
@given(batch=batches, leaves=st.lists(st.integers(0, 11), min_size=4, max_size=4))
def test_fuzz_together(
    client: httpx.Client, batch: list[tuple[str, dict[str, Any]]], leaves: list[int]
) -> None:
    """Requests at once, in one batch: one's constraint (its compile, its failure, its client
    leaving) is not another's."""
    with ThreadPoolExecutor(len(batch)) as pool:
        running = [
            pool.submit(abandon if leaves[i] == 5 else send, client, path, body)
            for i, (path, body) in enumerate(batch)
        ]
        for done in running:
            done.result()


RESPONSE_IDS = [
    "resp_", "resp_../../etc/passwd", "..", "resp_" + "0" * 32, "resp_" + "0" * 32 + ".json",
    "RESP_" + "a" * 32, "resp_" + "a" * 31 + "/", "%2e%2e", "resp_\u00e9", "a" * 300,
]  # fmt: skip


@settings(FUZZ, max_examples=20)
@given(rid=st.sampled_from(RESPONSE_IDS) | st.text(TEXT_CHARS, min_size=1, max_size=40))
def test_fuzz_response_ids(client: httpx.Client, rid: str) -> None:
    """GET and DELETE of a response by any id (its bytes percent-encoded, a lone surrogate's
    too): a 404 (or another 4xx) in OpenAI's shape; a trailing slash, a redirect."""
    path = quote(rid.encode("utf-8", "surrogatepass"), safe="")
    for method in ("GET", "DELETE"):
        response = client.request(method, f"/responses/{path}")
        if response.status_code in (307, 308):
            assert rid.endswith("/")
            continue
        assert 400 <= response.status_code < 500, response.text
        check_private(response.text)
        check_error(strict_json(response.text)["error"], response.text)


# ---- after them ---------------------------------------------------------------------------------


def test_the_server_still_serves_and_the_store_kept_its_bounds(
    server: RunningServer, client: httpx.Client
) -> None:
    """After the fuzz runs: the store within its bounds, every file it wrote one it reads back
    after a restart; each model idle, its caches within theirs, and serving plain requests."""
    (store,) = STORES
    assert store.memory_bytes <= LIMITS.memory_bytes
    assert store.directory is not None
    files = list(store.directory.glob(f"*{RESPONSE_SUFFIX}"))
    assert len(files) <= LIMITS.disk_files
    assert math.fsum(f.stat().st_size for f in files) <= LIMITS.disk_bytes
    if "responses" in RAN:  # (else nothing was stored)
        assert len(STORED) > LIMITS.disk_files  # the run went past the bounds
        # the newest read back, from disk most of them (memory holds a few); 4: sent
        # together, they were stored in any order
        for rid in STORED[-(LIMITS.disk_files - 4) :]:
            assert client.get(f"/responses/{rid}").status_code == 200, rid
    restarted = ResponseStore(store.directory, LIMITS)
    for file in files:
        rid = file.name.removesuffix(RESPONSE_SUFFIX)
        assert anyio.run(restarted.get, rid) is not None, file.read_text()[:2000]
    user = [{"role": "user", "content": "Hello"}]
    for model in MODELS:
        stats = server.wait_for(lambda s: s["running"] == 0 and s["queued"] == 0, model=model)
        config = server.state.models[model].ready_engine().config
        assert stats["grammar_cache_bytes"] <= config.grammar_cache_bytes
        assert stats["prefix_cache_bytes"] <= config.prefix_cache_bytes
        body = {"model": model, "messages": user, "max_tokens": 4}
        chat = client.post("/chat/completions", json=body)
        assert chat.status_code == 200, chat.text
        text = client.post("/completions", json={"model": model, "prompt": "Hi", "max_tokens": 4})
        assert text.status_code == 200, text.text
        body = {"model": model, "input": "Hi", "max_output_tokens": 4, "stream": True}
        reply = client.post("/responses", json=body)
        assert reply.status_code == 200 and check_stream(reply.text, "/responses")
    assert server.health().status_code == 200
