"""The Responses stream's events and the response object against the openai package's own
types: every event the server streams (a text reply, a reasoning reply, a tool call; cut short,
failed) parses as the SDK's type for it, with no field the SDK does not know and every value
read back unchanged; and the JSON is byte for byte what the server has sent all along."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import httpx
import pydantic
import pytest
from openai.types.responses import (
    Response,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseStreamEvent,
)
from openai.types.responses.response_usage import InputTokensDetails

from neuronpy.engine.types import FinishReason, GenerationEvent, ToolCall
from neuronpy.jsontext import one_line
from neuronpy.server.errors import ApiError
from neuronpy.server.responses_api.builder import Builder
from neuronpy.server.responses_api.events import Event
from tests.scripted import Scripts
from tests.servers import FIXTURES, RunningServer, engine_loader, fixture_model, run_server

MODEL = "tiny-llama"
TOOLS_MODEL = "tools-plain"  # tiny-qwen3-tools without its reasoning parser
REASONING_MODEL = "tiny-qwen3-tools"  # its template writes <think>: the parser is on
# One reply's stream (reasoning, text, a tool call) as the server sent it when its events were
# dicts built by hand, item ids written as <kind>_ID
PINNED = Path(__file__).parent / "data" / "responses_events.jsonl"
ITEM_ID = re.compile(r"(msg|rs|fc)_[0-9a-f]{32}")

# What the server sends beyond the SDK's types, by the type that holds it: a response's `store`
# and a finished call's `name` (the SDK's models keep them as extra fields)
BEYOND_THE_SDK: dict[type[pydantic.BaseModel], set[str]] = {
    Response: {"store"},
    ResponseFunctionCallArgumentsDoneEvent: {"name"},
}
# What the SDK's types require and the server does not send, filled in before they parse:
# prompt tokens written to a cache (newer than the usage the server writes)
SDK_ONLY_USAGE = {"cache_write_tokens": 0}
# the SDK's event types by their `type` (its union's members)
SDK_EVENTS: dict[str, type[pydantic.BaseModel]] = {
    get_args(member.model_fields["type"].annotation)[0]: member
    for member in get_args(get_args(ResponseStreamEvent)[0])
}


def unknown_fields(value: object, where: str = "") -> list[str]:
    """The fields of a parsed SDK object (and of the objects it holds) that its type does not
    declare, beyond BEYOND_THE_SDK: the SDK's models keep unknown fields rather than refuse them."""
    if isinstance(value, pydantic.BaseModel):
        known = BEYOND_THE_SDK.get(type(value), set())
        found = [f"{where}.{name}" for name in value.model_extra or {} if name not in known]
        for name in type(value).model_fields:
            found += unknown_fields(getattr(value, name), f"{where}.{name}")
        return found
    if isinstance(value, list):
        return [f for i, item in enumerate(value) for f in unknown_fields(item, f"{where}[{i}]")]
    return []


def sdk_view(data: dict[str, Any]) -> dict[str, Any]:
    """A response's or an event's JSON with SDK_ONLY_USAGE in its usage (where the SDK's usage
    declares those fields)."""
    data = copy.deepcopy(data)
    usage = data.get("response", data).get("usage")
    declared = InputTokensDetails.model_fields
    if usage is not None:
        details = usage["input_tokens_details"]
        details.update({k: v for k, v in SDK_ONLY_USAGE.items() if k in declared})
    return data


def sdk_parsed(sdk_type: type[pydantic.BaseModel], data: dict[str, Any]) -> Any:
    """`data` as the SDK's type parses it, checked to hold no field the type does not declare
    and to read back as it was sent (nothing coerced, nothing dropped)."""
    data = sdk_view(data)
    parsed = sdk_type.model_validate(data)
    assert unknown_fields(parsed) == [], data
    assert parsed.model_dump(mode="json", by_alias=True, exclude_unset=True) == data
    return parsed


def check_stream(datas: list[dict[str, Any]]) -> list[Any]:
    assert {data["type"] for data in datas} <= set(SDK_EVENTS)
    parsed = [sdk_parsed(SDK_EVENTS[data["type"]], data) for data in datas]
    assert [e.type for e in parsed] == [data["type"] for data in datas]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    return parsed


# ---- the builder's events, without a server -----------------------------------------------------

CALL = ToolCall(0, "call_1", "f", '{"a": 1}', ('{"a": ', "1}"))
BODY: dict[str, Any] = {
    "input": "x",
    "temperature": 0,
    "metadata": {"k": "v"},
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
}


def built(
    events: list[GenerationEvent], error: ApiError | None = None, **body: Any
) -> tuple[dict[str, Any], list[str]]:
    """The whole response's JSON, and the stream's `data:` lines, for a generation's events."""
    builder = Builder("resp_" + "0" * 32, "tiny", {**BODY, **body}, created_at=1700000000)
    out: list[Event] = builder.opened()
    for event in events:
        out += builder.feed(event)
    response, closing = builder.finish(events[-1] if events else None, 2, error)
    lines = [one_line(event.model_dump()) for event in [*out, *closing]]
    return response.model_dump(), lines


def finished(reason: FinishReason, **fields: Any) -> GenerationEvent:
    return GenerationEvent("", finish_reason=reason, prompt_tokens=5, completion_tokens=4, **fields)


def test_the_events_json_is_what_the_server_has_always_sent() -> None:
    events = [
        GenerationEvent("", reasoning="Hm."),
        GenerationEvent("Hi", reasoning=" ok"),
        GenerationEvent(" \u00e9\u2028"),
        finished(FinishReason.STOP, tool_calls=(CALL,)),
    ]
    _, lines = built(events)
    assert [ITEM_ID.sub(r"\1_ID", line) for line in lines] == PINNED.read_text().splitlines()


SCENARIOS: dict[str, tuple[list[GenerationEvent], ApiError | None]] = {
    "text": ([GenerationEvent("Hel"), GenerationEvent("lo"), finished(FinishReason.STOP)], None),
    "reasoning": (
        [GenerationEvent("", reasoning="Th"), GenerationEvent("Hi"), finished(FinishReason.STOP)],
        None,
    ),
    "tool call": (
        [GenerationEvent("", reasoning="x"), finished(FinishReason.STOP, tool_calls=(CALL,))],
        None,
    ),
    "incomplete": ([GenerationEvent("Hi"), finished(FinishReason.LENGTH)], None),
    "failed": ([GenerationEvent("Hi"), finished(FinishReason.ERROR)], ApiError(500, "it failed")),
    "nothing": ([], None),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_built_event_is_the_sdks_type_for_it(name: str) -> None:
    events, error = SCENARIOS[name]
    body = {"text": {"format": {"type": "json_schema", "name": "c", "schema": {}, "strict": True}}}
    response, lines = built(events, error, **body)
    parsed = check_stream([json.loads(line) for line in lines])
    final = parsed[-1].response
    assert final.status == {"failed": "failed", "incomplete": "incomplete"}.get(name, "completed")
    assert sdk_parsed(Response, response) == final


# ---- what a real server streams ---------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    models = {
        **fixture_model(MODEL),
        **fixture_model(REASONING_MODEL),
        TOOLS_MODEL: engine_loader(FIXTURES / "tiny-qwen3-tools", reasoning_parser="none"),
    }
    with run_server(models) as running:
        yield running


def streamed(server: RunningServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The `data:` of each event of a streamed response, checked against its `event:` line."""
    body = {**body, "stream": True, "temperature": 0.0}
    with httpx.stream("POST", f"{server.v1}/responses", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert len(lines) % 2 == 0
    datas = []
    for kind, data in zip(lines[::2], lines[1::2], strict=True):
        assert kind.startswith("event: ") and data.startswith("data: ")
        datas.append(json.loads(data.removeprefix("data: ")))
        assert datas[-1]["type"] == kind.removeprefix("event: ")
    return datas


def test_a_streamed_text_reply_is_the_sdks_events(server: RunningServer) -> None:
    format_ = {"type": "json_schema", "name": "c", "schema": {"type": "object"}, "strict": True}
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 12, "text": {"format": format_}}
    events = check_stream(streamed(server, body))
    assert "response.output_text.delta" in {e.type for e in events}
    stored = httpx.get(f"{server.v1}/responses/{events[-1].response.id}").json()
    assert sdk_parsed(Response, stored) == events[-1].response


def test_a_streamed_reasoning_reply_is_the_sdks_events(server: RunningServer) -> None:
    engine = server.state.models[REASONING_MODEL].engine
    assert engine is not None
    tok = engine.tokenizer
    scripts = Scripts()
    scripts.attach(engine)
    reply = "<think>\nThe user greets.\n</think>\n\nHello!"
    scripts.add("[events think]", [*tok.encode(reply), tok.eos_token_id])
    body = {"model": REASONING_MODEL, "input": "Hi [events think]", "max_output_tokens": 60}
    events = check_stream(streamed(server, body))
    types = {e.type for e in events}
    assert {"response.reasoning_text.delta", "response.output_text.delta"} <= types
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]


def test_a_streamed_tool_call_is_the_sdks_events(server: RunningServer) -> None:
    weather = {
        "type": "function",
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
        },
    }
    body = {
        "model": TOOLS_MODEL,
        "input": "Weather in Rome?",
        "tools": [weather],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 200,
    }
    events = check_stream(streamed(server, body))
    assert "response.function_call_arguments.done" in {e.type for e in events}
    assert events[-1].response.output[-1].type == "function_call"
