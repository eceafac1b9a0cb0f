"""Anthropic's Messages API through the real `anthropic` client on loopback: greedy text equals
the same conversation through /v1/chat/completions, streamed and not; stop sequences, tools
(a tool_use round trip, streamed arguments), thinking, count_tokens, the API key as
x-api-key, and errors in Anthropic's shape naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.scripted import Scripts
from tests.servers import FIXTURES, RunningServer, engine_loader, run_server
from tests.test_fixtures import bf

MODEL = "tiny-llama"
TOOLS_MODEL = bf.TOOLS_FIXTURE
KEY = "anthropic-test-key"
# the SDK has no sampling parameters any more; the API (and this server) still takes them
GREEDY = {"temperature": 0}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server({MODEL: engine_loader(max_in_flight=4)}, api_key=KEY) as running:
        yield running


@pytest.fixture(scope="module")
def tools() -> Iterator[tuple[RunningServer, Scripts, Any]]:
    loaders = {TOOLS_MODEL: engine_loader(FIXTURES / TOOLS_MODEL, max_in_flight=4)}
    with run_server(loaders) as running:
        engine = running.state.models[TOOLS_MODEL].engine
        assert engine is not None
        scripts = Scripts()
        scripts.attach(engine)
        yield running, scripts, AutoTokenizer.from_pretrained(FIXTURES / TOOLS_MODEL)


def client(server: RunningServer, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=120)


def chat_reply(server: RunningServer, messages: list[dict[str, Any]], **extra: Any) -> Any:
    api = openai.OpenAI(base_url=server.v1, api_key=KEY, max_retries=0)
    return api.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=24, **extra
    )


CONVERSATION = [
    {"role": "user", "content": "Name three rivers of Europe."},
    {"role": "assistant", "content": "The Rhine, the Danube and the Seine."},
    {"role": "user", "content": "Which is the longest?"},
]


def test_messages_create_equals_chat_completions_greedy(server: RunningServer) -> None:
    reply = client(server).messages.create(
        model=MODEL,
        system="You are terse.",
        messages=CONVERSATION,  # type: ignore[arg-type]
        max_tokens=24,
        extra_body=GREEDY,
    )
    chat = chat_reply(server, [{"role": "system", "content": "You are terse."}, *CONVERSATION])
    assert reply.type == "message" and reply.role == "assistant" and reply.model == MODEL
    assert reply.id.startswith("msg_")
    (block,) = reply.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert reply.stop_reason == (
        "max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn"
    )
    u = reply.usage
    assert u.input_tokens + (u.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
    assert u.output_tokens == chat.usage.completion_tokens
    # the system prompt as blocks means the same
    again = client(server).messages.create(
        model=MODEL,
        system=[{"type": "text", "text": "You are terse."}],
        messages=CONVERSATION,  # type: ignore[arg-type]
        max_tokens=24,
        extra_body=GREEDY,
    )
    assert again.content[0].text == block.text  # type: ignore[union-attr]


def test_messages_stream_gives_the_same_text_with_anthropics_events(server: RunningServer) -> None:
    api = client(server)
    whole = api.messages.create(
        model=MODEL,
        messages=CONVERSATION,
        max_tokens=24,
        extra_body=GREEDY,
    )
    with api.messages.stream(
        model=MODEL,
        messages=CONVERSATION,
        max_tokens=24,
        extra_body=GREEDY,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences_cut_the_text_and_say_which_matched(server: RunningServer) -> None:
    api = client(server)
    base = api.messages.create(
        model=MODEL,
        messages=CONVERSATION,
        max_tokens=24,
        extra_body=GREEDY,
    )
    text = base.content[0].text  # type: ignore[union-attr]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    cut = api.messages.create(
        model=MODEL,
        messages=CONVERSATION,  # type: ignore[arg-type]
        max_tokens=24,
        extra_body=GREEDY,
        stop_sequences=["zzzz-never", stop],
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]
    with api.messages.stream(
        model=MODEL,
        messages=CONVERSATION,  # type: ignore[arg-type]
        max_tokens=24,
        extra_body=GREEDY,
        stop_sequences=[stop],
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_count_tokens_is_the_prompt_the_request_would_have(server: RunningServer) -> None:
    counted = client(server).messages.count_tokens(
        model=MODEL,
        system="You are terse.",
        messages=CONVERSATION,  # type: ignore[arg-type]
    )
    chat = chat_reply(server, [{"role": "system", "content": "You are terse."}, *CONVERSATION])
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_errors_are_in_anthropics_shape_and_name_the_field(server: RunningServer) -> None:
    api = client(server)
    with pytest.raises(anthropic.AuthenticationError) as no_key:
        client(server, key="wrong").messages.create(
            model=MODEL,
            messages=CONVERSATION,
            max_tokens=4,  # type: ignore[arg-type]
        )
    assert no_key.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as hot:
        api.messages.create(
            model=MODEL,
            messages=CONVERSATION,
            max_tokens=4,
            extra_body={"temperature": 1.5},
        )
    assert hot.value.body == {  # type: ignore[comparison-overlap]
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "'temperature' must be from 0 to 1"},
    }
    with pytest.raises(anthropic.NotFoundError) as unknown:
        api.messages.create(model="nope", messages=CONVERSATION, max_tokens=4)  # type: ignore[arg-type]
    assert unknown.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    refused = [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": [image]}]},
            "messages[0].content[0]",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "container": "c"},
            "container",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "tool_choice": {"type": "any"},
            },
            "tool_choice",
        ),
    ]
    for body, field in refused:
        response = httpx.post(
            f"{server.url}/v1/messages",
            json={"model": MODEL, **body},
            headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
        )
        assert response.status_code == 400, (body, response.text)
        error = response.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert field in error["error"]["message"], (field, error)


def _post(server: RunningServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/messages",
        json={"model": MODEL, "max_tokens": 4, **body},
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
    )


def _refused(response: httpx.Response, said: str) -> None:
    assert response.status_code == 400, response.text
    assert response.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": response.json()["error"]["message"]},
    }
    assert said in response.json()["error"]["message"], response.text


def test_what_the_chat_request_refuses_is_a_400_naming_the_field(server: RunningServer) -> None:
    """A value the chat request's own rules refuse (a tool's name, a tool result's id) is
    Anthropic's 400 naming the Messages field it came from, never a 500."""
    hi = [{"role": "user", "content": "hi"}]
    for name in ("", "a b", "x" * 65, "é", "a.b", "a/b"):
        tools = [{"name": "fine"}, {"name": name, "input_schema": {"type": "object"}}]
        tools[0]["input_schema"] = {"type": "object"}
        _refused(_post(server, {"messages": hi, "tools": tools}), "tools[1].name")
    twice = [{"name": "same", "input_schema": {}}, {"name": "same", "input_schema": {}}]
    _refused(_post(server, {"messages": hi, "tools": twice}), "tools[1].name")
    result = {"type": "tool_result", "tool_use_id": "", "content": "12C"}
    _refused(
        _post(server, {"messages": [{"role": "user", "content": [result]}]}),
        "messages[0].content[0]",
    )


def test_thinking_budget_and_metadata_are_held_to_anthropics_bounds(
    server: RunningServer,
) -> None:
    hi = [{"role": "user", "content": "hi"}]
    for budget in (-1, 0, 1023):
        thinking = {"type": "enabled", "budget_tokens": budget}
        _refused(_post(server, {"messages": hi, "thinking": thinking}), "thinking.budget_tokens")
    big = "x" * 1_900_000
    _refused(_post(server, {"messages": hi, "metadata": {"user_id": big}}), "metadata.user_id")
    _refused(_post(server, {"messages": hi, "metadata": {"notes": big}}), "metadata")
    _refused(_post(server, {"messages": hi, "metadata": {"user_id": 7}}), "metadata.user_id")
    fine = {
        "metadata": {"user_id": "u" * 256},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    assert _post(server, {"messages": hi, **fine}).status_code == 200


# ---- tools and thinking, on the fixture whose template renders tools ---------------------------


def _scripted(
    tools: tuple[RunningServer, Scripts, Any], key: str, text: str
) -> list[dict[str, Any]]:
    _, scripts, tokenizer = tools
    scripts.add(key, [*tokenizer.encode(text), tokenizer.eos_token_id])
    return [{"role": "user", "content": f"Go {key}"}]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_a_tool_use_round_trip(tools: tuple[RunningServer, Scripts, Any]) -> None:
    server = tools[0]
    api = client(server, key="unused")
    messages = _scripted(tools, "[weather]", f"Let me look.\n{CALL}")
    reply = api.messages.create(
        model=TOOLS_MODEL,
        messages=messages,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        max_tokens=200,
        extra_body=GREEDY,
    )
    assert reply.stop_reason == "tool_use"
    text, use = reply.content
    assert text.type == "text" and text.text.strip() == "Let me look."  # type: ignore[union-attr]
    assert use.type == "tool_use" and use.name == "get_weather"  # type: ignore[union-attr]
    assert use.input == {"city": "Paris"}  # type: ignore[union-attr]
    # the result goes back as a tool_result block; the reply after it is plain text
    follow = [
        *messages,
        {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"},  # type: ignore[union-attr]
            ],
        },
    ]
    after = api.messages.create(
        model=TOOLS_MODEL,
        messages=follow,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        max_tokens=8,
        extra_body=GREEDY,
    )  # (the script answers it with the call again: the prompt still holds its key)
    counted = api.messages.count_tokens(
        model=TOOLS_MODEL,
        messages=follow,
        tools=[WEATHER],  # type: ignore[arg-type,list-item]
    )
    first = api.messages.count_tokens(
        model=TOOLS_MODEL,
        messages=messages,
        tools=[WEATHER],  # type: ignore[arg-type,list-item]
    )
    used = after.usage.input_tokens + (after.usage.cache_read_input_tokens or 0)
    assert used == counted.input_tokens > first.input_tokens
    # the call and its result reached the template: its tool-response markup is in the prompt
    assert (after.usage.cache_read_input_tokens or 0) > 0  # (the first turn, from the cache)


def test_streamed_tool_arguments_arrive_as_input_json_deltas(
    tools: tuple[RunningServer, Scripts, Any],
) -> None:
    api = client(tools[0], key="unused")
    messages = _scripted(tools, "[streamed-call]", CALL)
    with api.messages.stream(
        model=TOOLS_MODEL,
        messages=messages,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=200,
        extra_body=GREEDY,
    ) as stream:
        pieces = [
            event.delta.partial_json
            for event in stream
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta"
        ]
        final = stream.get_final_message()
    assert json.loads("".join(pieces)) == {"city": "Paris"}
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.input == {"city": "Paris"} and final.stop_reason == "tool_use"


def test_thinking_is_answered_as_thinking_blocks_only_when_asked(
    tools: tuple[RunningServer, Scripts, Any],
) -> None:
    api = client(tools[0], key="unused")
    for stream in (False, True):
        messages = _scripted(tools, f"[think-{stream}]", "<think>\nhm, Paris.\n</think>\n\nParis!")
        kwargs: dict[str, Any] = {
            "model": TOOLS_MODEL,
            "messages": messages,
            "max_tokens": 200,
            "extra_body": GREEDY,
        }
        thinking = {"type": "enabled", "budget_tokens": 1024}
        if stream:
            with api.messages.stream(**kwargs, thinking=thinking) as s:
                shown = s.get_final_message()
        else:
            shown = api.messages.create(**kwargs, thinking=thinking)
        assert [b.type for b in shown.content] == ["thinking", "text"]
        assert shown.content[0].thinking.strip() == "hm, Paris."  # type: ignore[union-attr]
        assert shown.content[1].text.strip() == "Paris!"  # type: ignore[union-attr]
        hidden = api.messages.create(**kwargs)
        assert [b.type for b in hidden.content] == ["text"]


def test_output_config_format_holds_the_reply_to_a_json_schema(server: RunningServer) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    reply = client(server).messages.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Where is the Louvre?"}],
        max_tokens=60,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    assert reply.stop_reason == "end_turn"
    value = json.loads(reply.content[0].text)  # type: ignore[union-attr]
    assert set(value) == {"city"} and isinstance(value["city"], str)
    bad = httpx.post(
        f"{server.url}/v1/messages",
        headers={"x-api-key": KEY},
        json={
            "model": MODEL,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
            "output_config": {"format": {"type": "json_schema", "schema": {"type": 7}}},
        },
    )
    assert bad.status_code == 400 and "output_config.format" in bad.json()["error"]["message"]
