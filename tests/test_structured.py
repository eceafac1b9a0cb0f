"""Structured outputs: constrained decoding inside the lockstep batch (engine/grammar.py), on
the tiny fixtures in-process and over HTTP with the real openai client.

A tiny random model writes noise; under a constraint its noise must still parse and validate,
which is the point: the grammar, not the model, makes the output well-formed."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import jsonschema
import openai
import pydantic
import pytest

from neuronpy.engine.engine import Engine
from neuronpy.engine.grammar import GrammarError, Matcher
from neuronpy.engine.types import Completion, Constraint, FinishReason, SamplingParams
from tests.factories import make_engine, tokenizer
from tests.scripted import Scripts
from tests.servers import FIXTURES, RunningServer, engine_loader, fixture_model, run_server

S = {"type": "string", "maxLength": 8}  # strings the random model cannot make endless
INT = {"type": "integer", "minimum": -50, "maximum": 50}


def obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
    }


SCHEMAS: list[dict[str, Any]] = [
    obj({"name": S}),
    obj({"age": INT}),
    obj({"ok": {"type": "boolean"}}),
    obj({"nothing": {"type": "null"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"kind": {"const": "fixed"}}),
    obj({"n": {"type": "integer", "minimum": 0, "maximum": 9}, "s": S}),
    obj({"tags": {"type": "array", "items": S, "maxItems": 3}}),
    obj({"ids": {"type": "array", "items": INT, "minItems": 1, "maxItems": 4}}),
    obj({"pair": {"type": "array", "prefixItems": [S, INT], "items": False}}),
    obj({"inner": obj({"x": INT, "y": INT})}),
    obj({"a": obj({"b": obj({"c": {"enum": [1, 2, 3]}})})}),
    obj({"people": {"type": "array", "items": obj({"name": S, "age": INT}), "maxItems": 2}}),
    obj({"req": S, "opt": INT}, required=["req"]),
    obj({"opt1": S, "opt2": {"type": "boolean"}}, required=[]),
    obj({"v": {"anyOf": [INT, {"type": "boolean"}]}}),
    obj({"v": {"oneOf": [{"const": "a"}, {"const": "b"}]}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    obj({"short": {"type": "string", "minLength": 2, "maxLength": 4}}),
    obj(
        {
            "grid": {
                "type": "array",
                "items": {"type": "array", "items": INT, "maxItems": 2},
                "maxItems": 2,
            }
        }
    ),
    {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 5},
    {
        "$defs": {"pt": obj({"x": INT})},
        **obj({"p": {"$ref": "#/$defs/pt"}, "q": {"$ref": "#/$defs/pt"}}),
    },
    obj({"mixed": {"type": ["integer", "null"], "minimum": 0, "maximum": 5}}),
    obj({"e": {"enum": ["é", "日本", 'a"b', "line\nbreak"]}}),
]


def json_constraint(schema: dict[str, Any]) -> Constraint:
    return Constraint("json_schema", json.dumps(schema))


def prompt(i: int = 0) -> list[int]:
    return tokenizer().encode(f"Write request {i} as JSON:")


async def run_all(engine: Engine, jobs: list[tuple[list[int], SamplingParams]]) -> list[Completion]:
    """The jobs at once: they share the lockstep batch."""
    results: list[Completion | None] = [None] * len(jobs)

    async def one(i: int) -> None:
        results[i] = await engine.complete(*jobs[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(jobs)):
            tg.start_soon(one, i)
    return results  # type: ignore[return-value]


def summary(c: Completion) -> tuple[Any, ...]:
    return c.text, c.token_ids, c.finish_reason


# ---- the engine ---------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_every_constrained_output_validates_against_its_schema(temperature: float) -> None:
    jobs = [
        (
            prompt(i),
            SamplingParams(
                max_tokens=200, temperature=temperature, seed=i, constraint=json_constraint(s)
            ),
        )
        for i, s in enumerate(SCHEMAS)
    ]
    async with make_engine(max_in_flight=32) as engine:
        for job in jobs:  # their grammars compiled first: then they are admitted at once
            await engine.prepare(*job)  # (however long each compile took on a busy machine)
        results = await run_all(engine, jobs)
        assert engine.stats().max_batch_size > 1  # they ran batched, each with its grammar
    for schema, result in zip(SCHEMAS, results, strict=True):
        assert result.finish_reason == FinishReason.STOP, (schema, result.text)
        jsonschema.validate(json.loads(result.text), schema)


@pytest.mark.anyio
async def test_json_object_regex_choice_and_grammar() -> None:
    kinds = [
        Constraint("json_object"),
        Constraint("regex", r"[0-9]{3}-[a-z]{2,4}"),
        Constraint("choice", choices=("yes", "no", "maybe so")),
        Constraint("grammar", 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "zz"'),
    ]
    async with make_engine() as engine:
        results = await run_all(
            engine,
            [
                (prompt(i), SamplingParams(max_tokens=100, temperature=1.0, seed=i, constraint=c))
                for i, c in enumerate(kinds)
            ],
        )
    obj_, reg, choice, gram = (r.text for r in results)
    assert all(r.finish_reason == FinishReason.STOP for r in results)
    assert isinstance(json.loads(obj_), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", reg)
    assert choice in ("yes", "no", "maybe so")
    assert re.fullmatch(r"\((?:[a-c]|zz)(?:,(?:[a-c]|zz))*\)", gram)


@pytest.mark.anyio
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen3.5"])  # (and a hybrid)
async def test_parity_constrained_alone_equals_in_a_mixed_batch(family: str) -> None:
    """Greedy: a constrained request writes the same alone as beside unconstrained and
    differently constrained rows; the unconstrained rows write what they write without it."""
    free = SamplingParams(max_tokens=40, temperature=0.0)
    jobs = [
        (
            prompt(0),
            SamplingParams(
                max_tokens=120, temperature=0.0, constraint=json_constraint(SCHEMAS[12])
            ),
        ),
        (prompt(1), free),
        (
            prompt(2),
            SamplingParams(max_tokens=120, temperature=0.0, constraint=json_constraint(SCHEMAS[4])),
        ),
        (
            prompt(3),
            SamplingParams(
                max_tokens=40, temperature=0.0, constraint=Constraint("regex", "[a-z]{5,30}")
            ),
        ),
        (prompt(4), dataclasses.replace(free, max_tokens=25)),
    ]
    async with make_engine(family) as engine:
        alone = [await engine.complete(*job) for job in jobs]
        together = await run_all(engine, jobs)
    assert [summary(c) for c in together] == [summary(c) for c in alone]
    async with make_engine(family) as engine:  # a fresh engine: no constraint has been seen
        plain = [await engine.complete(*jobs[i]) for i in (1, 4)]
    assert [summary(c) for c in plain] == [summary(together[1]), summary(together[4])]


WEATHER_TOOL = {
    "name": "get_weather",
    "parameters": obj({"city": S, "days": {"type": "integer", "minimum": 1, "maximum": 9}}),
}


@pytest.mark.anyio
@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_jump_forward_feeds_what_the_grammar_forces_in_one_step(temperature: float) -> None:
    """A forced call's fixed text (the markup, the tool's name, its keys) is not spelled by
    the model a step a token: it comes as the tokenizer writes it, fed in one step beside the
    row's token (as drafts that stand), and batched == alone still holds."""
    spec = {"tools": [WEATHER_TOOL], "parallel": False}
    params = SamplingParams(
        max_tokens=150,
        temperature=temperature,
        seed=3,
        constraint=Constraint("tools", json.dumps(spec)),
    )
    jobs = [(prompt(i), params) for i in range(3)]
    async with make_engine("tiny-llama") as engine:
        alone = [await engine.complete(*job) for job in jobs]
        before = engine.stats()
        together = await run_all(engine, jobs)
        after = engine.stats()
    assert [summary(c) for c in together] == [summary(c) for c in alone]
    markup = tokenizer().encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "')
    for c in together:
        assert c.finish_reason is FinishReason.STOP
        call = json.loads(c.text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
        assert call["name"] == "get_weather" and set(call["arguments"]) == {"city", "days"}
        # the markup as the tokenizer writes it, its last token left to the model
        assert list(c.token_ids[: len(markup) - 1]) == markup[:-1]
    written = sum(len(c.token_ids) for c in together)
    steps = after.decode_steps - before.decode_steps
    forced = after.jump_forward_tokens - before.jump_forward_tokens
    assert forced > written // 2 and steps < written - forced + len(jobs)


@pytest.mark.anyio
async def test_n_copies_each_follow_their_own_matcher() -> None:
    params = SamplingParams(
        max_tokens=150, temperature=1.0, seed=7, constraint=json_constraint(SCHEMAS[12])
    )
    async with make_engine() as engine:
        await engine.prepare(prompt(), params)
        streams = engine.submit_many(prompt(), params, 3)
        texts = []
        for stream in streams:
            async with stream:
                texts.append("".join([e.text async for e in stream]))
    assert len(set(texts)) > 1  # seeds differ: so do the copies
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS[12])


@pytest.mark.anyio
async def test_a_dead_end_ends_that_request_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A matcher that cannot go on fails its request with a clear error; its neighbours' output
    is whole and unchanged."""
    doomed = Constraint("regex", "[x-z]{40}")
    real = Matcher.mask
    calls = {"n": 0}

    def mask(self: Matcher, logits: Any) -> None:
        real(self, logits)
        if self._matcher is not None and getattr(self, "_doomed", False):
            calls["n"] += 1
            if calls["n"] == 5:
                raise GrammarError("the reply's grammar allows no token the model can write next")

    monkeypatch.setattr(Matcher, "mask", mask)
    free = SamplingParams(max_tokens=30, temperature=0.0)
    async with make_engine() as engine:
        expected = await engine.complete(prompt(1), free)
        original = engine.grammars.matcher

        def tagged(constraint: Constraint, reasoning: Any = None) -> Matcher:
            m = original(constraint, reasoning)
            m._doomed = constraint == doomed  # type: ignore[attr-defined]
            return m

        monkeypatch.setattr(engine.grammars, "matcher", tagged)
        bad, good = await run_all(
            engine,
            [
                (prompt(0), SamplingParams(max_tokens=60, temperature=0.0, constraint=doomed)),
                (prompt(1), free),
            ],
        )
        assert engine.healthy
    assert bad.finish_reason == FinishReason.ERROR and len(bad.token_ids) == 4
    assert summary(good) == summary(expected)


def test_bad_constraints_are_refused_naming_their_field() -> None:
    from neuronpy.engine.grammar import Grammars

    grammars = Grammars(tokenizer(), 360, [2])
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    cases = [
        (Constraint("json_schema", '{"type": "strin"}', param="guided_json"), "Unsupported type"),
        (Constraint("json_schema", "{not json", param="guided_json"), "not valid JSON"),
        (Constraint("json_schema", json.dumps(deep), param="guided_json"), "deeper than 32"),
        (Constraint("regex", "(ab", param="guided_regex"), "parenthesis"),
        (Constraint("grammar", "root ::= b", param="guided_grammar"), "not defined"),
        # nested counted repetition: 75 s of compiling, refused at once
        (Constraint("regex", "([a-z]{1,50}){1,50}", param="guided_regex"), "multiply past"),
        (
            json_constraint(obj({"s": {"type": "string", "pattern": "^([a-z]{1,50}){1,50}$"}})),
            "multiply past",
        ),
        (Constraint("grammar", 'root ::= ("a"{1,50}){1,50}', param="guided_grammar"), "past"),
    ]
    for constraint, why in cases:
        with pytest.raises(ValueError, match=why) as info:
            grammars.compile(constraint)
        assert info.value.param == constraint.param  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="at most"):
        Constraint("regex", "a" * 70_000, param="guided_regex")
    with pytest.raises(ValueError, match="non-empty strings"):
        Constraint("choice", choices=(), param="guided_choice")
    tiny = Grammars(tokenizer(), 360, [2], cache_bytes=1 << 10)
    with pytest.raises(ValueError, match="grammar cache"):
        tiny.compile(json_constraint(SCHEMAS[12]))


# ---- over HTTP ----------------------------------------------------------------------------------

MODEL = "tiny-llama"
REASONING_MODEL = "tiny-qwen3-tools"  # its template writes <think>: a reasoning parser is on
# The same model without one: the random model, once it opens a reasoning block, rarely ends
# it, and a constraint starts after the block.
TOOLS_MODEL = "tools-plain"


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    models = {
        **fixture_model(MODEL, max_in_flight=16),
        **fixture_model(REASONING_MODEL, max_in_flight=16),
        TOOLS_MODEL: engine_loader(FIXTURES / REASONING_MODEL, reasoning_parser="none"),
    }
    with run_server(models) as running:
        yield running


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    population: int = pydantic.Field(ge=0, le=10_000)
    coastal: bool


def test_openai_parse_returns_a_parsed_object(server: RunningServer) -> None:
    out = client(server).chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "A city, please."}],
        response_format=City,
        max_tokens=200,
        temperature=0.0,
    )
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, City)
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_and_vllm_fields_over_http(server: RunningServer, stream: bool) -> None:
    api = client(server)
    bodies = [
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
        ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        ({"guided_regex": "[0-9]{4}"}, lambda t: re.fullmatch("[0-9]{4}", t)),
        (
            {"guided_json": SCHEMAS[6]},
            lambda t: jsonschema.validate(json.loads(t), SCHEMAS[6]) is None,
        ),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"guided_grammar": 'root ::= "a"+ "b"'}, lambda t: re.fullmatch("a+b", t)),
    ]
    for extra, valid in bodies:
        # json_object's strings are unbounded: greedy, the random model closes them
        temperature = 0.0 if "response_format" in extra else 1.0
        kwargs = dict(
            model=MODEL, max_tokens=200, temperature=temperature, seed=3, extra_body=extra
        )
        if stream:
            chunks = api.chat.completions.create(
                messages=[{"role": "user", "content": "Hi"}], stream=True, **kwargs
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            out = api.completions.create(prompt="Hi", **kwargs)
            text = out.choices[0].text
        assert valid(text), (extra, text)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": obj({"city": S, "unit": {"enum": ["C", "F"]}}),
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": obj({"tz": S})}},
    {"type": "function", "function": {"name": "ping"}},
]
SCHEMA_OF = {
    t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS
}


def check_calls(calls: list[Any]) -> list[str]:
    names = []
    for call in calls:
        names.append(call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
    return names


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named_always_yield_valid_calls(
    server: RunningServer, stream: bool
) -> None:
    api = client(server)
    choices: list[Any] = [
        ("required", None),
        ({"type": "function", "function": {"name": "get_time"}}, "get_time"),
        ({"type": "function", "function": {"name": "ping"}}, "ping"),
    ]
    for seed in range(3):
        for choice, named in choices:
            kwargs = dict(
                model=TOOLS_MODEL,
                messages=[{"role": "user", "content": f"Do something {seed}"}],
                tools=TOOLS,
                tool_choice=choice,
                max_tokens=300,
                temperature=1.0,
                seed=seed,
            )
            if stream:
                calls = streamed_calls(api.chat.completions.create(stream=True, **kwargs))
                finish = calls.pop()
            else:
                out = api.chat.completions.create(**kwargs)
                calls, finish = (
                    out.choices[0].message.tool_calls or [],
                    out.choices[0].finish_reason,
                )
            names = check_calls(calls)  # every call the reply holds is valid
            assert names and (named is None or names == [named])
            # one call ends the grammar; parallel calls go on while the model adds calls
            assert finish == "tool_calls" if named else finish in ("tool_calls", "length")


def test_parallel_tool_calls_false_gives_one_call(server: RunningServer) -> None:
    api = client(server)
    for seed in range(4):
        out = api.chat.completions.create(
            model=TOOLS_MODEL,
            messages=[{"role": "user", "content": "Go"}],
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=300,
            temperature=1.0,
            seed=seed,
        )
        assert len(check_calls(out.choices[0].message.tool_calls)) == 1


def streamed_calls(chunks: Any) -> list[Any]:
    """The tool calls a stream's deltas add up to, then its finish reason (last)."""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    fn = openai.types.chat.chat_completion_message_tool_call.Function
    out: list[Any] = [
        type("Call", (), {"function": fn(name=c["name"], arguments=c["arguments"])})()
        for _, c in sorted(calls.items())
    ]
    return [*out, finish]


def test_constraint_starts_after_the_reasoning_block(server: RunningServer) -> None:
    """The tools fixture reasons: its reply may open with <think>...</think>, then the JSON."""
    engine = server.state.models[REASONING_MODEL].engine
    assert engine is not None
    tok = engine.tokenizer
    scripts = Scripts()
    scripts.attach(engine)
    reply = '<think>\nplan it {not json}\n</think>\n\n{"n": 3, "s": "ok"}'
    scripts.add("[reason]", [*tok.encode(reply), tok.eos_token_id])
    out = client(server).chat.completions.create(
        model=REASONING_MODEL,
        messages=[{"role": "user", "content": "Go [reason]"}],
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[6]}},
        max_tokens=100,
        temperature=0.0,
    )
    message = out.choices[0].message
    assert json.loads(message.content) == {"n": 3, "s": "ok"}
    assert "plan it" in message.reasoning_content  # type: ignore[attr-defined]


BAD: list[tuple[dict[str, Any], str]] = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strin"}},
            }
        },
        "response_format.json_schema.schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
    ),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"guided_grammar": "root ::= b"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{oops"}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
]


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_constraints_are_400s_and_change_nothing(
    server: RunningServer, extra: dict[str, Any], param: str
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        **extra,
    }
    before = server.stats(MODEL)
    response = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    after = server.stats(MODEL)
    assert after["admitted"] == before["admitted"] and server.health().status_code == 200
    ok = httpx.post(
        f"{server.v1}/chat/completions", json={**body, **{k: None for k in extra}}, timeout=30
    )
    assert ok.status_code == 200


def test_grammar_cache_serves_the_same_schema_twice_and_metrics_show_it(
    server: RunningServer,
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def metrics() -> dict[str, float]:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        return {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.labels.get("model") == MODEL and "grammar" in sample.name
        }

    schema = obj({"unique_to_this_test": INT})
    body = {
        "model": MODEL,
        "prompt": "Hi",
        "max_tokens": 30,
        "temperature": 0.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
    }
    before = metrics()
    first = httpx.post(f"{server.v1}/completions", json=body, timeout=30).json()
    middle = metrics()
    second = httpx.post(f"{server.v1}/completions", json=body, timeout=30).json()
    after = metrics()
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    jsonschema.validate(json.loads(first["choices"][0]["text"]), schema)
    compiled = "neuronpy_grammars_compiled_total"
    assert middle[compiled] == before[compiled] + 1 and after[compiled] == middle[compiled]
    assert after["neuronpy_grammar_compile_seconds_total"] > 0
    assert after["neuronpy_grammar_cache_bytes"] > 0


@pytest.mark.anyio
async def test_one_compile_per_constraint_and_at_most_max_compiles_at_once() -> None:
    """Requests arriving together with one constraint share its single compile; distinct
    constraints compile `max_compiles` at a time, the next `max_queue` wait for a slot, and
    one past those is refused (503: QueueFullError, with a retry hint)."""
    import threading

    from neuronpy.errors import QueueFullError

    ids = tokenizer().encode("Hello")
    shared = Constraint("regex", r"[0-9]{3}")
    queued = Constraint("regex", r"[a-z]{3}")
    refused_one = Constraint("regex", r"[a-z]{4}")
    async with make_engine(max_compiles=1, max_queue=1) as engine:
        real, gate, started = engine.grammars.compile, threading.Event(), threading.Event()
        calls: list[Constraint] = []

        def held(constraint: Constraint, reasoning: Any = None, cancelled: Any = None) -> Any:
            calls.append(constraint)
            started.set()
            gate.wait()
            return real(constraint, reasoning, cancelled)

        engine.grammars.compile = held  # type: ignore[method-assign]
        params = SamplingParams(max_tokens=3, temperature=0.0, constraint=shared)
        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(engine.prepare, ids, params)
            await anyio.to_thread.run_sync(started.wait)
            tg.start_soon(engine.prepare, ids, dataclasses.replace(params, constraint=queued))
            while len(engine.compiles.pending) < 2:
                await anyio.sleep(0.01)
            assert calls == [shared]  # the second waits for the one slot
            with pytest.raises(QueueFullError, match="max_compiles = 1") as refused:
                await engine.prepare(ids, dataclasses.replace(params, constraint=refused_one))
            assert refused.value.retry_after > 0
            gate.set()
        assert calls == [shared, queued]  # five requests, one compile; then the queued one
        out = await engine.complete(ids, params)
        assert re.fullmatch(r"[0-9]{3}", out.text)


# keyword -> (a property's schema using it, a value that breaks it)
IGNORED_BY_XGRAMMAR: dict[str, tuple[dict[str, Any], Any]] = {
    "not": ({"type": "string", "not": {"const": "x"}}, "x"),
    "if": ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 10}}, 20),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1]),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, [1]),
    "dependentRequired": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        {"a": 1},
    ),
}


def _one_property(schema: dict[str, Any]) -> str:
    return json.dumps({"type": "object", "properties": {"v": schema}, "required": ["v"]})


@pytest.mark.parametrize("keyword", list(IGNORED_BY_XGRAMMAR))
def test_keywords_the_grammar_ignores_are_refused_naming_them(keyword: str) -> None:
    """Why they are refused: xgrammar's grammar for each accepts a value the keyword forbids
    (if a later xgrammar enforces one, this fails: then allow it). A request using one is a
    400 naming the keyword and where it is; a property merely named like one is fine."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from neuronpy.errors import InvalidRequestError

    schema, breaking = IGNORED_BY_XGRAMMAR[keyword]
    grammar = xgr.Grammar.from_json_schema(_one_property(schema), any_whitespace=False)
    assert _is_grammar_accept_string(grammar, json.dumps({"v": breaking}))
    grammars = make_grammars()
    with pytest.raises(InvalidRequestError, match=f"uses '{keyword}' \\(at properties.v\\)"):
        grammars.compile(Constraint("json_schema", _one_property(schema), param="p"))
    named = json.dumps({"type": "object", "properties": {keyword: {"type": "string"}}})
    grammars.compile(Constraint("json_schema", named, param="p"))


def test_an_all_of_of_several_schemas_is_refused() -> None:
    """xgrammar turns an allOf of several schemas into any JSON value at all."""
    from neuronpy.errors import InvalidRequestError

    schema = {"type": "integer", "allOf": [{"minimum": 1}, {"maximum": 9}]}
    with pytest.raises(InvalidRequestError, match="uses 'allOf'"):
        make_grammars().compile(Constraint("json_schema", _one_property(schema), param="p"))
    single = {"allOf": [{"type": "integer"}]}
    make_grammars().compile(Constraint("json_schema", _one_property(single), param="p"))


def make_grammars() -> Any:
    from neuronpy.engine.grammar import Grammars

    tok = tokenizer()
    return Grammars(tok, len(tok), [tok.eos_token_id or 0], 1 << 26)


@pytest.mark.parametrize("grammar", ['root ::= root "a"', "root ::= x\nx ::= x"])
def test_a_grammar_that_cannot_start_is_a_400_before_admission(grammar: str) -> None:
    """A grammar no token can start (left recursion, a rule that is only itself) used to fail
    its request at the first step, after admission, as a 500; it is refused when compiled."""
    from neuronpy.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="'guided_grammar' allows no text at all"):
        make_grammars().compile(Constraint("grammar", grammar, param="guided_grammar"))


def test_a_grammar_of_the_empty_text_is_taken() -> None:
    make_grammars().compile(Constraint("grammar", 'root ::= ""', param="guided_grammar"))


def test_jump_forward_leaves_a_token_that_could_reach_past_the_forced_text() -> None:
    """Qwen3's vocabulary has `<tool_call>` as one token: where a reasoning block may come
    first, the text both allow is `<t`, and forcing `<` would make the reply spell the call's
    markup in pieces; nothing is forced there. Without the block the markup is forced, as the
    tokenizer writes it, up to the city's first character."""
    from neuronpy.engine.grammar import Grammars

    tok = tokenizer("tiny-qwen3-tools")
    grammars = Grammars(tok, len(tok), [tok.eos_token_id])
    spec = {"tools": [WEATHER_TOOL], "parallel": False}
    constraint = Constraint("tools", json.dumps(spec))
    assert grammars.matcher(constraint, ("think", False)).jump_forward() == ()
    forced = grammars.matcher(constraint).jump_forward()
    text = tok.decode(list(forced))
    assert text == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'
    assert list(forced) == tok.encode(text)
