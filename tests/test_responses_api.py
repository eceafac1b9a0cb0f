"""The Responses API (POST /v1/responses, stored responses, previous_response_id) through the
real openai client, on a real server on loopback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pydantic
import pytest

from tests.scripted import Scripts
from tests.servers import FIXTURES, RunningServer, engine_loader, fixture_model, run_server

MODEL = "tiny-llama"
TOOLS_MODEL = "tools-plain"  # tiny-qwen3-tools without its reasoning parser
REASONING_MODEL = "tiny-qwen3-tools"  # its template writes <think>: the parser is on
CHOICE = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no", "maybe"]}},
    "required": ["answer"],
}
JSON_FORMAT = {"format": {"type": "json_schema", "name": "choice", "schema": CHOICE}}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    models = {
        **fixture_model(MODEL),
        **fixture_model(REASONING_MODEL),
        TOOLS_MODEL: engine_loader(FIXTURES / "tiny-qwen3-tools", reasoning_parser="none"),
    }
    with run_server(models) as running:
        yield running


@pytest.fixture
def api(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)


def test_a_response_is_what_chat_writes_for_the_same_conversation(api: openai.OpenAI) -> None:
    out = api.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input="Hello there",
        max_output_tokens=12,
        temperature=0.0,
    )
    chat = api.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there"},
        ],
        max_tokens=12,
        temperature=0.0,
    )
    assert out.id.startswith("resp_") and out.object == "response"
    assert out.output_text == chat.choices[0].message.content
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.usage.output_tokens == 12 and out.usage.total_tokens == out.usage.input_tokens + 12
    (message,) = out.output
    assert message.type == "message" and message.role == "assistant"


def test_streamed_events_add_up_to_the_response(api: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, input="Hi", max_output_tokens=60, temperature=0.0)
    whole = api.responses.create(text=JSON_FORMAT, **kwargs)
    events = list(api.responses.create(stream=True, text=JSON_FORMAT, **kwargs))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text
    assert json.loads(deltas)["answer"] in ("yes", "no", "maybe")
    assert final.status == "completed" and final.id == events[0].response.id
    # the SDK's stream helper accumulates the same events into the same response
    with api.responses.stream(text=JSON_FORMAT, **kwargs) as stream:
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == whole.output_text


class Answer(pydantic.BaseModel):
    answer: str = pydantic.Field(max_length=6)


def test_responses_parse_with_a_pydantic_model(api: openai.OpenAI) -> None:
    out = api.responses.parse(
        model=MODEL, input="Yes or no?", text_format=Answer, max_output_tokens=60, temperature=0.0
    )
    assert isinstance(out.output_parsed, Answer)


def test_previous_response_id_continues_from_its_kv_as_a_replay_would(api: openai.OpenAI) -> None:
    first = api.responses.create(
        model=MODEL, input="Tell me a story", max_output_tokens=16, temperature=0.0
    )
    follow = api.responses.create(
        model=MODEL,
        input="And then?",
        previous_response_id=first.id,
        max_output_tokens=16,
        temperature=0.0,
    )
    # the stateless replay: the whole conversation sent again, nothing stored
    replay = api.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Tell me a story"},
            *[item.model_dump(exclude_none=True) for item in first.output],
            {"role": "user", "content": "And then?"},
        ],
        max_output_tokens=16,
        temperature=0.0,
        store=False,
    )
    assert follow.output_text == replay.output_text
    assert follow.usage.input_tokens == replay.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens > 0
    assert follow.previous_response_id == first.id


def test_stored_responses_are_retrieved_and_deleted(
    api: openai.OpenAI, server: RunningServer
) -> None:
    out = api.responses.create(model=MODEL, input="Hi", max_output_tokens=3, temperature=0.0)
    got = api.responses.retrieve(out.id)
    assert got.id == out.id and got.output_text == out.output_text
    api.responses.delete(out.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(out.id)
    with pytest.raises(openai.NotFoundError) as info:
        api.responses.create(model=MODEL, input="x", previous_response_id=out.id)
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
    unstored = api.responses.create(
        model=MODEL, input="Hi", max_output_tokens=2, store=False, temperature=0.0
    )
    assert httpx.get(f"{server.v1}/responses/{unstored.id}").status_code == 404
    assert httpx.delete(f"{server.v1}/responses/nope").status_code == 404


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
    },
}


@pytest.mark.parametrize("stream", [False, True])
def test_function_tools_and_a_function_call_output_round_trip(
    api: openai.OpenAI, stream: bool
) -> None:
    kwargs: dict[str, Any] = dict(
        model=TOOLS_MODEL,
        input="Weather in Rome?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=0.0,
    )
    if stream:
        events = list(api.responses.create(stream=True, **kwargs))
        types = [e.type for e in events]
        assert "response.function_call_arguments.delta" in types
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        out = events[-1].response
        assert done.arguments == out.output[-1].arguments
    else:
        out = api.responses.create(**kwargs)
    assert out.status == "completed"
    call = out.output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"}
    follow = api.responses.create(
        model=TOOLS_MODEL,
        previous_response_id=out.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}],
        tools=[WEATHER],
        max_output_tokens=8,
        temperature=0.0,
    )
    assert follow.usage.input_tokens_details.cached_tokens > 0
    assert follow.output  # the model's answer to the tool's result


BAD: list[tuple[dict[str, Any], int, str]] = [
    ({}, 400, "input"),
    ({"input": 5}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [{"type": "reasoning"}]}, 400, "input"),  # (skipped: no message is left)
    ({"input": [{"type": "image", "url": "x"}]}, 400, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input[0].content"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "instructions": 5}, 400, "instructions"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format"),
    ({"input": "x", "stream": "yes"}, 400, "stream"),
    ({"input": "x", "previous_response_id": 5}, 400, "previous_response_id"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": "x", "temperature": 9}, 400, "temperature"),
    (
        {
            "input": "x",
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objec"}}},
        },
        400,
        "text.format.schema",
    ),
    ({"input": "x", "max_output_tokens": -1}, 400, "max_output_tokens"),
    # (the engine's words for the chat request's max_tokens)
    ({"input": "x", "max_output_tokens": 10**6}, 400, "max_output_tokens"),
    ({"input": "x", "text": "json"}, 400, "text"),
    # a Responses tool is flat: no 'function' under it, as chat's has
    ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, 400, "tools[0].name"),
    (
        {"input": "x", "tools": [{"type": "function", "name": "f", "description": 5}]},
        400,
        "tools[0].description",
    ),
    (
        {"input": "x", "tools": [{"type": "function", "name": "f"}] * 2},
        400,
        "tools[1].name",
    ),
    # an item's own field, whatever message the item becomes (instructions come before)
    (
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "x"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"},
            ],
        },
        400,
        "input[1].arguments",
    ),
    (
        {
            "input": [
                {"role": "user", "content": "x"},
                {"type": "function_call_output", "call_id": "", "output": "12"},
            ]
        },
        400,
        "input[1].call_id",
    ),
    (
        {
            "input": "x",
            "tools": [{"type": "function", "name": "f"}],
            "tool_choice": "required",
            "text": {"format": {"type": "json_schema", "name": "x", "schema": CHOICE}},
        },
        400,
        "tool_choice",
    ),
    ({"input": "x", "background": True}, 400, "background"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, 400, "include"),
]
# the chat request a Responses request becomes: none of its names may reach the client
CHAT_NAMES = (
    "max_tokens",
    "response_format",
    "messages",
    "json_schema.schema",
    ".function.",
    "tool_call",
)


@pytest.mark.parametrize(("extra", "status", "param"), BAD, ids=[p for _, _, p in BAD])
def test_bad_responses_requests_are_4xx(
    server: RunningServer, extra: dict[str, Any], status: int, param: str
) -> None:
    response = httpx.post(f"{server.v1}/responses", json={"model": MODEL, **extra}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert not any(name in error["message"] for name in CHAT_NAMES), error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_reasoning_block_is_a_reasoning_item(
    api: openai.OpenAI, server: RunningServer, stream: bool
) -> None:
    engine = server.state.models[REASONING_MODEL].engine
    assert engine is not None
    tok = engine.tokenizer
    scripts = Scripts()
    scripts.attach(engine)
    reply = "<think>\nThe user greets.\n</think>\n\nHello!"
    scripts.add(f"[think {stream}]", [*tok.encode(reply), tok.eos_token_id])
    kwargs: dict[str, Any] = dict(
        model=REASONING_MODEL, input=f"Hi [think {stream}]", max_output_tokens=60, temperature=0.0
    )
    if stream:
        events = list(api.responses.create(stream=True, **kwargs))
        thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert thought == "The user greets."
        out = events[-1].response
    else:
        out = api.responses.create(**kwargs)
    reasoning, message = out.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "The user greets."
    assert message.type == "message" and out.output_text == "Hello!"
    assert out.status == "completed"


def test_with_sessions_a_stored_response_and_its_kv_outlive_a_restart(tmp_path: Any) -> None:
    """--sessions-dir: each stored response is a file, its KV a session named by its id; after
    a restart (an empty prefix cache) a follow-up restores the KV from that session and writes
    what a replay writes."""
    kwargs: dict[str, Any] = dict(model=MODEL, max_output_tokens=12, temperature=0.0)
    with run_server(fixture_model(MODEL), sessions_dir=tmp_path) as server:
        api = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)
        first = api.responses.create(input="Tell me a story", **kwargs)
        # its KV is a session named by its id: shown to whoever names it, never listed
        assert httpx.get(f"{server.v1}/sessions/{first.id}").json()["tokens"] > 0
        assert httpx.get(f"{server.v1}/sessions").json()["data"] == []
    with run_server(fixture_model(MODEL), sessions_dir=tmp_path) as restarted:
        api = openai.OpenAI(base_url=restarted.v1, api_key="unused", max_retries=0, timeout=60)
        assert api.responses.retrieve(first.id).output_text == first.output_text
        follow = api.responses.create(
            input="And then?", previous_response_id=first.id, store=False, **kwargs
        )
        assert follow.usage.input_tokens_details.cached_tokens > 0  # from the session file
        replay = api.responses.create(
            input=[
                {"role": "user", "content": "Tell me a story"},
                *[item.model_dump(exclude_none=True) for item in first.output],
                {"role": "user", "content": "And then?"},
            ],
            store=False,
            **kwargs,
        )
        assert follow.output_text == replay.output_text
        api.responses.delete(first.id)
        assert httpx.get(f"{restarted.v1}/sessions/{first.id}").status_code == 404
        with pytest.raises(openai.NotFoundError):
            api.responses.retrieve(first.id)


def test_a_client_leaving_a_stream_cancels_its_response(server: RunningServer) -> None:
    body = {"model": MODEL, "input": "Go on and on", "max_output_tokens": 400, "stream": True}
    before = server.stats(MODEL)["cancelled"]
    with httpx.stream("POST", f"{server.v1}/responses", json=body, timeout=30) as stream:
        lines = stream.iter_lines()
        assert next(lines) == "event: response.created"
    server.wait_for(lambda s: s["running"] == 0 and s["queued"] == 0, model=MODEL)
    assert server.stats(MODEL)["cancelled"] == before + 1


def test_input_items_list_what_the_response_was_given(api: openai.OpenAI) -> None:
    first = api.responses.create(model=MODEL, input="Hi", max_output_tokens=3, temperature=0.0)
    second = api.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "And then?"}],
        previous_response_id=first.id,
        max_output_tokens=3,
        temperature=0.0,
    )
    listed = api.responses.input_items.list(second.id, order="asc")
    texts = [(item.role, item.content[0].text) for item in listed.data]  # type: ignore[union-attr]
    assert texts == [("user", "Hi"), ("assistant", first.output_text), ("user", "And then?")]
    newest = api.responses.input_items.list(second.id)  # desc, as OpenAI's default
    assert [i.id for i in newest.data] == [i.id for i in reversed(listed.data)]
    page = api.responses.input_items.list(second.id, order="asc", limit=1)
    assert len(page.data) == 1 and page.has_more and page.first_id == listed.data[0].id
    rest = api.responses.input_items.list(second.id, order="asc", after=listed.data[0].id)
    assert [i.id for i in rest.data] == [i.id for i in listed.data[1:]] and not rest.has_more
    with pytest.raises(openai.NotFoundError):
        api.responses.input_items.list("resp_nope")


def test_a_request_shaped_as_codex_cli_sends_it(server: RunningServer) -> None:
    """What Codex CLI (0.171, with web search and its multi-agent tools off) sends: developer
    messages, strict function tools and no tool_choice on a template that cannot show them,
    store false with `include: ["reasoning.encrypted_content"]`, a reasoning summary,
    prompt_cache_key and client_metadata; streamed."""
    tool = {
        "type": "function",
        "name": "exec_command",
        "description": "Runs a command",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string", "maxLength": 8}},
            "required": ["cmd"],
        },
    }
    body = {
        "model": MODEL,
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Be brief."}],
            },
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        ],
        "tools": [tool],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "session-1",
        "client_metadata": {"x": "y"},
        "max_output_tokens": 8,
    }
    with httpx.stream("POST", f"{server.v1}/responses", json=body, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        events = [line for line in reply.iter_lines() if line.startswith("event:")]
    assert events[0] == "event: response.created"
    assert events[-1] in ("event: response.completed", "event: response.incomplete")  # (8 tokens)
