"""The request validator: structure (depth, Unicode), the schema's JSON types, and fuzzing that no
body gets a 500, in process and through a real server on loopback."""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuronpy.errors import InvalidRequestError
from neuronpy.server.chat_input import ROLES
from neuronpy.server.errors import ApiError
from neuronpy.server.protocol import UNSUPPORTED, ChatCompletionRequest, CompletionRequest
from neuronpy.server.requests import parse_request, requested_model
from neuronpy.server.structure import MAX_JSON_DEPTH, decode_json
from tests.factories import tokenizer
from tests.servers import RunningServer, fixture_model, run_server

# Its chat template writes tools and tool-call arguments with `tojson`: what deep JSON overflows.
MODEL = "tiny-qwen3-tools"
CHAT, TEXT = "/chat/completions", "/completions"
USER = [{"role": "user", "content": "Hello"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,  # nothing written to the tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def nested(depth: int, leaf: Any = 1, key: str | None = "a") -> Any:
    """`depth` containers, one in the other (objects under `key`, or lists when None)."""
    value = leaf
    for _ in range(depth):
        value = [value] if key is None else {key: value}
    return value


def raw(body: Any) -> bytes:
    """A body as a client writes it: non-ASCII (lone surrogates included) as \\u escapes."""
    return json.dumps(body).encode()


def parse(kind: str, body: bytes) -> None:
    """What the server does with a body before the engine: decode and check it, route on its
    model, validate its fields, render or encode its prompt."""
    value = decode_json(body)
    requested_model(value)
    req = parse_request(kind, value)  # type: ignore[arg-type]
    ids = req.prompt_ids(tokenizer(MODEL))
    req.sampling_params(len(ids), 512)


def error_of(kind: str, body: bytes) -> tuple[str, str | None]:
    """The 400 a body gets before the engine: its message and param."""
    with pytest.raises((ApiError, InvalidRequestError)) as info:
        parse(kind, body)
    error = info.value
    if isinstance(error, ApiError):
        assert error.status == 400, error.message
    return error.message, error.param


# ---- structure: depth and Unicode ---------------------------------------------------------------


def test_nesting_up_to_the_limit_is_taken_past_it_refused_naming_the_limit() -> None:
    # the body is level 1; its field holds the rest
    decode_json(raw({"extra": nested(MAX_JSON_DEPTH - 1)}))
    decode_json(raw({"extra": nested(MAX_JSON_DEPTH - 1, key=None)}))
    for key in ("a", None):
        with pytest.raises(InvalidRequestError) as info:
            decode_json(raw({"extra": nested(MAX_JSON_DEPTH, key=key)}))
        assert f"deeper than {MAX_JSON_DEPTH} levels" in info.value.message
        assert info.value.param == "extra"
    # past json's own recursion: refused the same way, the place unknown
    with pytest.raises(InvalidRequestError, match="deeper than 64") as info:
        decode_json(b"[" * 100_000 + b"]" * 100_000)
    assert info.value.param is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a\ud800b"}, "prompt"),
        ({"messages": [{"role": "user", "content": "\udfff"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]}, None),
        ({"model": "m\udc00"}, "model"),
        ({"stop": ["ok", "\ud800"]}, "stop[1]"),
        ({"tools": [{"function": {"name": "f", "description": "\ud800"}}]}, None),
        ({"extra": {"\ud800": 1}}, None),
    ],
)
def test_lone_surrogates_anywhere_are_refused_naming_the_place(body: Any, param: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        decode_json(raw(body))
    message = info.value.message
    assert "not valid Unicode" in message
    message.encode("utf-8")  # the error itself can be sent
    if param is not None:
        assert info.value.param == param
    assert info.value.param is not None and info.value.param.encode("utf-8")


def test_valid_surrogate_pairs_bom_and_unicode_are_text() -> None:
    assert decode_json(raw({"prompt": "\U0001f600 caf\u00e9"})) == {"prompt": "\U0001f600 café"}
    assert decode_json(b"\xef\xbb\xbf" + raw({"a": 1})) == {"a": 1}  # a UTF-8 BOM
    with pytest.raises(InvalidRequestError, match="not valid UTF-8"):
        decode_json(b'{"prompt": "\xff"}')
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        decode_json(b'{"prompt": ')


# ---- the schema: every field's JSON type, before its own rules ----------------------------------

WRONG_TYPES: list[tuple[str, str, dict[str, Any], str]] = [
    ("role-list", CHAT, {"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ("role-object", CHAT, {"messages": [{"role": {"a": 1}, "content": "x"}]}, "messages[0].role"),
    ("role-number", CHAT, {"messages": [{"role": 1, "content": "x"}]}, "messages[0].role"),
    ("role-missing", CHAT, {"messages": [{"content": "x"}]}, "messages[0].role"),
    ("content-number", CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (
        "content-part-text",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "messages[0].content",
    ),
    ("name-list", CHAT, {"messages": [{"role": "user", "content": "x", "name": []}]}, None),
    (
        "tool-call-not-object",
        CHAT,
        {"messages": [*USER, {"role": "assistant", "tool_calls": [5]}]},
        "messages[1].tool_calls[0]",
    ),
    (
        "arguments-object",
        CHAT,
        {
            "messages": [
                *USER,
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
    ("tool-name-number", CHAT, {"tools": [{"type": "function", "function": {"name": 3}}]}, None),
    (
        "tool-description-list",
        CHAT,
        {"tools": [{"type": "function", "function": {"name": "f", "description": ["x"]}}]},
        "tools[0].function.description",
    ),
    ("tool-choice-list", CHAT, {"tools": [TOOL], "tool_choice": ["auto"]}, "tool_choice"),
    ("stream-options-list", CHAT, {"stream": True, "stream_options": []}, "stream_options"),
    ("temperature-huge", TEXT, {"temperature": 10**400}, "temperature"),
    ("top-p-huge", CHAT, {"top_p": -(10**400)}, "top_p"),
    ("penalty-bool", CHAT, {"presence_penalty": True}, "presence_penalty"),
    ("seed-float", TEXT, {"seed": 1.5}, "seed"),
    ("stop-object", TEXT, {"stop": {"a": "b"}}, "stop"),
    ("stop-token-ids-strings", TEXT, {"stop_token_ids": ["1"]}, "stop_token_ids[0]"),
    ("prompt-object", TEXT, {"prompt": {"text": "x"}}, "prompt"),
    ("logprobs-string", TEXT, {"logprobs": "2"}, "logprobs"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), [c[1:] for c in WRONG_TYPES], ids=[c[0] for c in WRONG_TYPES]
)
def test_a_field_of_the_wrong_json_type_is_a_400_naming_it(path, body, param) -> None:
    kind = "chat" if path == CHAT else "text"
    defaults = {"messages": USER} if kind == "chat" else {"prompt": "Hello"}
    message, got = error_of(kind, raw({**defaults, **body}))
    if param is not None:
        assert got == param, message
    assert got is not None, message


def test_wrong_type_messages_say_what_was_expected_and_what_came() -> None:
    message, _ = error_of("chat", raw({"messages": [{"role": ["user"], "content": "x"}]}))
    assert "'messages[0].role' must be one of" in message and "'user'" in message
    message, _ = error_of("chat", raw({"messages": USER, "n": "2"}))
    assert message == "'n' must be an integer, got '2'"
    message, _ = error_of("text", raw({"prompt": "x", "stop": 5}))
    assert message == "'stop' must be a string or an array, got a number"
    message, param = error_of("text", raw({"prompt": "x", "stop": ["a", 1]}))
    assert message == "'stop[1]' must be a string, got a number" and param == "stop"


# ---- fuzz: no body is anything but a 400 (in process) -------------------------------------------

# Text as a client may send it: lone surrogates (category Cs) and control characters included.
TEXT_CHARS = st.characters(categories=["Lu", "Ll", "Nd", "P", "Zs", "Cc", "Cs", "So"])
texts = st.text(TEXT_CHARS, max_size=12)
short_texts = st.text(st.characters(categories=["Lu", "Ll", "Nd", "Zs"]), min_size=1, max_size=8)
# every field the server reads
FIELDS = sorted(
    {*ChatCompletionRequest.model_fields, *CompletionRequest.model_fields, *UNSUPPORTED}
)
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")
keys = st.sampled_from([*FIELDS, *MESSAGE_KEYS, "type", "function", "text", "arguments"]) | texts
numbers = (
    st.integers()
    | st.sampled_from([0, 1, -1, 2**63, 2**64, -(2**63) - 1, 10**400, -(10**400)])
    | st.floats(allow_nan=True, allow_infinity=True)
)
leaves = st.none() | st.booleans() | numbers | texts | st.sampled_from([*ROLES, "function"])
any_json = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=16,
)
# (json.dumps writes up to some 900 levels; deeper bodies are written by hand, below)
deep_json = st.builds(nested, st.integers(MAX_JSON_DEPTH - 8, 600), leaves, st.none() | keys)
# with a lone surrogate for sure (texts have one now and then)
broken_texts = st.builds(lambda a, b: f"{a}\ud800{b}", short_texts, short_texts)
values = st.one_of(broken_texts, texts, numbers, any_json, deep_json, deep_json.map(json.dumps))

# Valid requests (short: max_tokens 1 or 2), the base that mutations start from: a body that is
# wrong in one or two places reaches the code past the first check, where 500s hide.
arguments = st.dictionaries(short_texts, short_texts | st.integers(), max_size=2).map(json.dumps)
assistant = st.builds(
    lambda args: {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": args}}
        ],
    },
    arguments,
)
tool_result = st.just({"role": "tool", "tool_call_id": "call_1", "content": "12"})
chat_base = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "messages": st.builds(
            lambda user, rest: [{"role": "user", "content": user}, *rest],
            short_texts,
            st.lists(st.one_of(assistant, tool_result), max_size=2),
        ),
        "max_tokens": st.integers(1, 2),
    },
    optional={
        "tools": st.just([TOOL]),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.1, 1),
        "stop": short_texts | st.lists(short_texts, max_size=2),
        "seed": st.integers(0, 2**32),
        "n": st.integers(1, 2),
        "stream": st.booleans(),
        "logprobs": st.booleans(),
    },
)
text_base = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "prompt": short_texts | st.lists(st.integers(0, 300), min_size=1, max_size=4),
        "max_tokens": st.integers(1, 2),
    },
    optional={"temperature": st.floats(0, 2), "stop": short_texts, "stream": st.booleans()},
)
# Where a mutation goes: any field the server reads, an unknown one, and (three times as often:
# each is deep in the code) the nested places.
NESTED: list[tuple[str | int, ...]] = [
    ("messages", 0),
    ("messages", 0, "role"),
    ("messages", 0, "content"),
    ("messages", 0, "content", 0),
    ("messages", 0, "name"),
    ("messages", 1, "tool_calls", 0, "function", "arguments"),
    ("messages", 1, "tool_calls", 0, "function", "name"),
    ("messages", 1, "tool_calls", 0, "type"),
    ("tools", 0),
    ("tools", 0, "function", "name"),
    ("tools", 0, "function", "description"),
    ("tools", 0, "function", "parameters"),
    ("tools", 0, "function", "parameters", "properties"),
    ("stop", 0),
    ("prompt", 0),
    ("stream_options", "include_usage"),
    ("logit_bias", "5"),
    ("session", "name"),
]
PLACES = [*((name,) for name in FIELDS), ("x",), *NESTED * 3]
mutations = st.lists(st.tuples(st.sampled_from(PLACES), values), min_size=1, max_size=2)


def mutated(body: dict[str, Any], changes: list[tuple[tuple[str | int, ...], Any]]) -> Any:
    """`body` with each change's value put at its place (what is in the way replaced)."""
    body = copy.deepcopy(body)  # (st.just values are shared)
    for place, value in changes:
        node: Any = body
        for step, below in itertools.pairwise(place):
            child = node[step] if _has(node, step) else None
            if not isinstance(child, (dict, list)):
                child = [] if isinstance(below, int) else {}
                _put(node, step, child)
            node = child
        _put(node, place[-1], value)
    return body


def _has(node: Any, step: str | int) -> bool:
    if isinstance(node, dict):
        return step in node
    return isinstance(step, int) and step < len(node)


def _put(node: Any, step: str | int, value: Any) -> None:
    if isinstance(node, dict) or (isinstance(step, int) and step < len(node)):
        node[step] = value
    else:
        node.append(value)


chat_bodies = st.builds(mutated, chat_base, mutations).map(raw)
text_bodies = st.builds(mutated, text_base, mutations).map(raw)


def too_deep(field: str, depth: int) -> bytes:
    """Deeper than json.dumps writes (or json parses): by hand."""
    return f'{{"prompt": "x", "{field}": '.encode() + b"[" * depth + b"]" * depth + b"}"


too_deep_to_dump = st.builds(
    too_deep, st.sampled_from(["messages", "tools", "x"]), st.integers(900, 20_000)
)


anything = st.one_of(any_json.map(raw), too_deep_to_dump, st.binary(max_size=64))
# (kind, body): mostly requests for their own endpoint with a mistake or two, then any JSON,
# very deep JSON and any bytes, for either
requests = st.sampled_from("cccctttxx").flatmap(
    lambda pick: (
        st.tuples(st.just("chat"), chat_bodies)
        if pick == "c"
        else st.tuples(st.just("text"), text_bodies)
        if pick == "t"
        else st.tuples(st.sampled_from(["chat", "text"]), anything)
    )
)


@settings(FUZZ, max_examples=2000)
@given(request=requests)
def test_fuzz_no_body_escapes_the_validator_but_as_a_400(request: tuple[str, bytes]) -> None:
    kind, body = request
    try:
        parse(kind, body)
    except ApiError as error:
        assert error.status in (400, 404), error.message
        json.dumps(error.body(), ensure_ascii=False).encode("utf-8")
    except InvalidRequestError as error:  # (sampling_params: the engine's own checks)
        error.message.encode("utf-8")


# ---- through a real server on loopback ----------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server(fixture_model(MODEL)) as running:
        yield running


def post(server: RunningServer, path: str, body: bytes) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(server.v1 + path, content=body, headers=headers, timeout=60)


def normal(server: RunningServer, path: str) -> str:
    """A greedy request's output (the same before and after a bad request, or something broke)."""
    if path == CHAT:
        body = {"model": MODEL, "messages": USER, "tools": [TOOL], "max_tokens": 6}
    else:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 6}
    response = post(server, path, raw({**body, "temperature": 0}))
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    return choice["message"]["content"] if path == CHAT else choice["text"]


def check_error(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in response.text and ".py" not in response.text
    return error


# Where a body holds deep JSON: objects this deep, written by hand (json.dumps stops at some 900
# levels). Deep enough that the template's `tojson` overflows its recursion (the body itself
# still parses): what used to be a 500.
DEEP, DEEP_TEXT, DEPTH = "@deep@", "@deep-text@", 950
DEEPER = "@deeper@"  # past json's own recursion: it cannot parse it


def deep_text(depth: int = DEPTH) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


HUGE = "@1e999@"  # a number literal that overflows a float


def payload(path: str, body: dict[str, Any]) -> bytes:
    """The body (over a valid request's fields) as bytes, its DEEP and HUGE markers replaced."""
    defaults = {"model": MODEL, "messages": USER} if path == CHAT else {"model": MODEL}
    text = json.dumps({**defaults, **body})
    text = text.replace(json.dumps(DEEP), deep_text())
    text = text.replace(json.dumps(DEEPER), "[" * 5000 + "]" * 5000)
    text = text.replace(json.dumps(HUGE), "1e999")
    return text.replace(DEEP_TEXT, json.dumps(deep_text())[1:-1]).encode()


def tool_call(arguments: str) -> dict[str, Any]:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}]}


# Each class of input that used to get a 500 (a traceback): (name, path, body, param)
CLASSES: list[tuple[str, str, dict[str, Any], str | None]] = [
    ("surrogate-prompt", TEXT, {"prompt": "Hi \ud800"}, "prompt"),
    (
        "surrogate-message",
        CHAT,
        {"messages": [{"role": "user", "content": "\ud800"}]},
        "messages[0].content",
    ),
    ("surrogate-model", CHAT, {"model": "\ud800"}, "model"),
    ("surrogate-stop", TEXT, {"prompt": "Hi", "stop": "\udfff"}, "stop"),
    (
        "surrogate-tool-description",
        CHAT,
        {"tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]},
        "tools[0].function.description",
    ),
    (
        "surrogate-tool-name",
        CHAT,
        {"tools": [{"type": "function", "function": {"name": "f\ud800"}}]},
        "tools[0].function.name",
    ),
    ("surrogate-tool-call-arguments", CHAT, tool_call('{"a": "\\ud800"}'), None),
    ("surrogate-unknown-key", TEXT, {"prompt": "Hi", "x": {"\ud800": 1}}, None),
    ("role-list", CHAT, {"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ("role-object", CHAT, {"messages": [{"role": {}, "content": "x"}]}, "messages[0].role"),
    ("role-number", CHAT, {"messages": [{"role": 7, "content": "x"}]}, "messages[0].role"),
    ("temperature-huge", TEXT, {"prompt": "Hi", "temperature": 10**400}, "temperature"),
    ("top-p-huge", CHAT, {"top_p": 10**400}, "top_p"),
    (
        "deep-tool-parameters",
        CHAT,
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]},
        "tools",
    ),
    ("deep-tool-call-arguments", CHAT, tool_call(DEEP_TEXT), "messages[1].tool_calls"),
    ("deep-unknown-field", TEXT, {"prompt": "Hi", "x": DEEP}, "x"),
    ("deeper-than-json-parses", TEXT, {"prompt": "Hi", "x": DEEPER}, None),
    # numbers that are not finite: Python's decoder takes NaN, Infinity and 1e999 (inf)
    ("nan-temperature", TEXT, {"prompt": "Hi", "temperature": float("nan")}, "temperature"),
    ("infinity-unknown-field", CHAT, {"x": {"y": [1, float("inf")]}}, "x.y[1]"),
    (
        "minus-infinity-tool-extra-key",
        CHAT,
        {"tools": [{"type": "function", "function": {"name": "f", "extra": float("-inf")}}]},
        "tools[0].function.extra",
    ),
    ("overflowing-exponent", TEXT, {"prompt": "Hi", "max_tokens": HUGE}, "max_tokens"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), [c[1:] for c in CLASSES], ids=[c[0] for c in CLASSES]
)
def test_every_class_is_a_400_and_the_server_serves_on_unchanged(
    server: RunningServer, path: str, body: dict[str, Any], param: str | None
) -> None:
    before = normal(server, path)
    error = check_error(post(server, path, payload(path, body)))
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    assert server.health().status_code == 200
    assert normal(server, path) == before


def test_a_non_finite_number_the_responses_api_would_echo_is_a_400(
    server: RunningServer,
) -> None:
    """metadata is echoed back in the response object and its events: a NaN there would be
    invalid JSON after the generation ran (and stored, a 500 on every GET). It is refused at the
    door, naming the place, and nothing is stored."""
    body = json.dumps(
        {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "metadata": {"k": float("nan")}}
    )
    error = check_error(post(server, "/responses", body.encode()))
    assert error["param"] == "metadata.k"
    assert "not a finite number" in error["message"]
    fine = json.dumps(
        {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "metadata": {"k": "NaN"}}
    )
    response = post(server, "/responses", fine.encode())
    assert response.status_code == 200, response.text
    assert response.json()["metadata"] == {"k": "NaN"}


def test_a_body_that_is_not_utf8_is_a_400(server: RunningServer) -> None:
    error = check_error(post(server, TEXT, b'{"prompt": "caf\xe9"}'))  # Latin-1
    assert "UTF-8" in error["message"]


def _capped(body: bytes) -> bytes:
    """A fuzzed body whose generation stays short: max_tokens 2 unless it is absent (then 2),
    or invalid (kept: it is refused)."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return body
    if not isinstance(value, dict):
        return body
    for name in ("max_tokens", "max_completion_tokens"):
        found = value.get(name)
        if isinstance(found, int) and not isinstance(found, bool) and 2 < found < 10**6:
            value[name] = 2
    value.setdefault("max_tokens", 2)
    return raw(value)


@settings(FUZZ)
@given(request=requests)
def test_fuzz_no_request_gets_a_500(server: RunningServer, request: tuple[str, bytes]) -> None:
    kind, body = request
    response = post(server, CHAT if kind == "chat" else TEXT, _capped(body))
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        check_error(response, response.status_code)


def test_after_the_fuzz_the_server_is_healthy_and_unchanged(server: RunningServer) -> None:
    assert server.health().status_code == 200
    assert normal(server, TEXT) == normal(server, TEXT)
    stats = server.stats()
    assert stats["running"] == 0 and stats["queued"] == 0 and stats["failed"] == 0
