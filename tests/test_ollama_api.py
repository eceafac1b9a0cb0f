"""Ollama's API through the real `ollama` client on loopback: chat and generate, streamed
(NDJSON) and not, equal to the same request through /v1/chat/completions when greedy;
`format` as a JSON Schema, `options`, tools, `think`, the model list, show, ps, version,
embeddings, and errors as Ollama's `{"error": ...}` naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import openai
import pytest
from transformers import AutoTokenizer

from tests.scripted import Scripts
from tests.servers import FIXTURES, RunningServer, engine_loader, run_server
from tests.test_fixtures import bf

MODEL = "tiny-llama"
TOOLS_MODEL = bf.TOOLS_FIXTURE
GREEDY = {"temperature": 0, "num_predict": 24}
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three rivers of Europe."},
]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server({MODEL: engine_loader(max_in_flight=4)}) as running:
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


def client(server: RunningServer) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=120)


def chat_completion(server: RunningServer, messages: list[dict[str, Any]]) -> Any:
    api = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    return api.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)


def test_chat_equals_chat_completions_streamed_and_not(server: RunningServer) -> None:
    expected = chat_completion(server, MESSAGES)
    text = expected.choices[0].message.content
    reply = client(server).chat(model=MODEL, messages=MESSAGES, options=GREEDY)
    assert reply.message.role == "assistant" and reply.message.content == text
    assert reply.done and reply.done_reason == (
        "length" if expected.choices[0].finish_reason == "length" else "stop"
    )
    assert reply.prompt_eval_count == expected.usage.prompt_tokens
    assert reply.eval_count == expected.usage.completion_tokens
    assert reply.total_duration >= reply.eval_duration > 0  # type: ignore[operator]
    chunks = list(
        client(server).chat(model=f"{MODEL}:latest", messages=MESSAGES, options=GREEDY, stream=True)
    )
    assert "".join(c.message.content or "" for c in chunks) == text
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].eval_count == expected.usage.completion_tokens


def test_generate_templated_and_raw(server: RunningServer) -> None:
    api = client(server)
    templated = api.generate(
        model=MODEL, prompt="Name three rivers of Europe.", system="You are terse.", options=GREEDY
    )
    assert templated.response == chat_completion(server, MESSAGES).choices[0].message.content
    raw = api.generate(model=MODEL, prompt="The capital of France is", raw=True, options=GREEDY)
    completion = openai.OpenAI(base_url=server.v1, api_key="unused").completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=24
    )
    assert raw.response == completion.choices[0].text
    streamed = "".join(
        part.response or ""
        for part in api.generate(
            model=MODEL, prompt="The capital of France is", raw=True, options=GREEDY, stream=True
        )
    )
    assert streamed == raw.response
    loaded = api.generate(model=MODEL, prompt="")  # Ollama's way to load a model
    assert loaded.done and loaded.done_reason == "load"


def test_format_holds_the_reply_to_a_json_schema(server: RunningServer) -> None:
    schema = {
        "type": "object",
        "properties": {"river": {"type": "string", "maxLength": 10}},
        "required": ["river"],
        "additionalProperties": False,
    }
    reply = client(server).chat(
        model=MODEL, messages=MESSAGES, format=schema, options={"temperature": 0, "num_predict": 60}
    )
    value = json.loads(reply.message.content or "")
    assert set(value) == {"river"} and isinstance(value["river"], str)
    any_json = client(server).chat(
        model=MODEL, messages=MESSAGES, format="json", options={"temperature": 0, "num_predict": 60}
    )
    if any_json.done_reason == "stop":
        assert isinstance(json.loads(any_json.message.content or ""), dict)


def test_models_show_ps_and_version(server: RunningServer) -> None:
    api = client(server)
    (listed,) = api.list().models
    assert listed.model == f"{MODEL}:latest" and listed.details.family == "llama"  # type: ignore[union-attr]
    assert listed.size and listed.size > 0
    shown = api.show(MODEL)
    assert "completion" in (shown.capabilities or [])
    assert shown.modelinfo["llama.context_length"] == 512  # type: ignore[index]
    (running,) = api.ps().models
    assert running.model == f"{MODEL}:latest" and running.context_length == 512
    assert httpx.get(f"{server.url}/api/version").json()["version"]


def test_embed_and_the_older_embeddings_route(server: RunningServer) -> None:
    api = client(server)
    out = api.embed(model=MODEL, input=["a cat", "a dog"])
    assert len(out.embeddings) == 2 and out.prompt_eval_count and out.prompt_eval_count > 0
    vectors = openai.OpenAI(base_url=server.v1, api_key="unused").embeddings.create(
        model=MODEL, input=["a cat", "a dog"]
    )
    for ours, theirs in zip(out.embeddings, vectors.data, strict=True):
        assert ours == pytest.approx(theirs.embedding, abs=1e-6)
    legacy = api.embeddings(model=MODEL, prompt="a cat")
    assert legacy.embedding == pytest.approx(out.embeddings[0], abs=1e-6)
    short = api.embed(model=MODEL, input="a cat", dimensions=8)
    assert len(short.embeddings[0]) == 8


def test_errors_name_the_field_in_ollamas_shape(server: RunningServer) -> None:
    api = client(server)
    with pytest.raises(ollama.ResponseError) as unknown:
        api.chat(model="nope", messages=MESSAGES)
    assert unknown.value.status_code == 404 and "nope" in unknown.value.error
    cases = [
        ({"options": {"mirostat": 2}}, "options.mirostat"),
        ({"options": {"num_predict": 0}}, "options.num_predict"),
        ({"options": {"not_an_option": 1}}, "options.not_an_option"),
        ({"format": 7}, "format"),
        ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "images"),
    ]
    for extra, field in cases:
        body = {"model": MODEL, "messages": MESSAGES, "stream": False, **extra}
        response = httpx.post(f"{server.url}/api/chat", json=body)
        assert response.status_code == 400, (extra, response.text)
        assert set(response.json()) == {"error"} and field in response.json()["error"], (
            response.text
        )
    for extra, field in (({"suffix": "x"}, "suffix"), ({"context": [1, 2]}, "context")):
        body = {"model": MODEL, "prompt": "hi", "stream": False, **extra}
        response = httpx.post(f"{server.url}/api/generate", json=body)
        assert response.status_code == 400 and field in response.json()["error"]
    # load-time options are the server's: accepted
    fine = api.chat(model=MODEL, messages=MESSAGES, options={"num_ctx": 4096, "num_predict": 2})
    assert fine.done


def test_bounds_are_checked_and_named_as_ollama_names_them(server: RunningServer) -> None:
    """Options the chat request refuses are named as Ollama names them (`options.top_k`);
    `think` names itself and what it takes; /api/embed's `truncate` must be a boolean; a
    chat message the chat request refuses is a 400, never a 500."""
    odd = [
        ({"options": {"top_k": -2}}, "options.top_k"),
        ({"options": {"repeat_penalty": 0}}, "options.repeat_penalty"),
        ({"options": {"top_p": 0}}, "options.top_p"),
        ({"think": "ultra"}, '\'think\' must be true, false, "low", "medium" or "high"'),
        ({"think": 2}, "'think' must be true, false"),
    ]
    for extra, said in odd:
        body = {"model": MODEL, "messages": MESSAGES, "stream": False, **extra}
        response = httpx.post(f"{server.url}/api/chat", json=body)
        assert response.status_code == 400, (extra, response.text)
        error = response.json()["error"]
        assert said in error and "think.bool" not in error and "'top_k'" not in error, error
    # -1 and 0 are no top-k cut, as in chat completions (and Ollama: top_k <= 0 is off)
    for top_k in (-1, 0):
        reply = client(server).chat(
            model=MODEL, messages=MESSAGES, options={"top_k": top_k, "num_predict": 2}
        )
        assert reply.done
    for truncate in ("x", 1, None, {}):
        body = {"model": MODEL, "input": "a cat", "truncate": truncate}
        response = httpx.post(f"{server.url}/api/embed", json=body)
        if truncate is None:  # (absent: Ollama's default)
            assert response.status_code == 200, response.text
            continue
        assert response.status_code == 400, (truncate, response.text)
        assert "'truncate' must be true or false" in response.json()["error"]
    for truncate in (True, False):
        body = {"model": MODEL, "input": "a cat", "truncate": truncate}
        assert httpx.post(f"{server.url}/api/embed", json=body).status_code == 200


# ---- tools and thinking -------------------------------------------------------------------------


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _scripted(tools: tuple[RunningServer, Scripts, Any], key: str, text: str) -> list[dict]:
    _, scripts, tokenizer = tools
    scripts.add(key, [*tokenizer.encode(text), tokenizer.eos_token_id])
    return [{"role": "user", "content": f"Go {key}"}]


def test_tool_calls_come_back_with_their_arguments_as_objects(
    tools: tuple[RunningServer, Scripts, Any],
) -> None:
    api = client(tools[0])
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for stream in (False, True):
        messages = _scripted(tools, f"[call-{stream}]", call)
        if stream:
            parts = list(
                api.chat(model=TOOLS_MODEL, messages=messages, tools=[WEATHER], stream=True)
            )
            calls = [c for p in parts for c in p.message.tool_calls or ()]
        else:
            reply = api.chat(model=TOOLS_MODEL, messages=messages, tools=[WEATHER])
            calls = list(reply.message.tool_calls or ())
        (only,) = calls
        assert only.function.name == "get_weather" and only.function.arguments == {"city": "Paris"}
    # the call and its result go back in the conversation
    follow = [
        *messages,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "Sunny", "tool_name": "get_weather"},
    ]
    again = api.chat(
        model=TOOLS_MODEL, messages=follow, tools=[WEATHER], options={"num_predict": 4}
    )
    assert again.done and again.prompt_eval_count > len(tools[2].encode("Go [call-True]"))  # type: ignore[operator]


def test_think_answers_the_reasoning_apart(tools: tuple[RunningServer, Scripts, Any]) -> None:
    api = client(tools[0])
    messages = _scripted(tools, "[think]", "<think>\nhm, Paris.\n</think>\n\nParis!")
    shown = api.chat(model=TOOLS_MODEL, messages=messages, think=True)
    assert (shown.message.thinking or "").strip() == "hm, Paris."
    assert (shown.message.content or "").strip() == "Paris!"
    hidden = api.chat(model=TOOLS_MODEL, messages=messages, think=False)
    assert not hidden.message.thinking and (hidden.message.content or "").strip() == "Paris!"
    streamed = list(api.chat(model=TOOLS_MODEL, messages=messages, think=True, stream=True))
    assert "".join(p.message.thinking or "" for p in streamed).strip() == "hm, Paris."
    shown_model = api.show(TOOLS_MODEL)
    assert {"tools", "thinking"} <= set(shown_model.capabilities or [])


def test_logprobs_come_with_each_token(server: RunningServer) -> None:
    api = client(server)
    options = {"temperature": 0, "num_predict": 6}
    whole = api.chat(model=MODEL, messages=MESSAGES, options=options, logprobs=True, top_logprobs=2)
    assert whole.logprobs is not None and len(whole.logprobs) == whole.eval_count
    assert all(len(lp.top_logprobs or ()) == 2 and lp.logprob <= 0 for lp in whole.logprobs)
    assert "".join(lp.token for lp in whole.logprobs) == whole.message.content
    parts = list(
        api.chat(model=MODEL, messages=MESSAGES, options=options, logprobs=True, stream=True)
    )
    streamed = [lp.logprob for p in parts for lp in p.logprobs or ()]
    assert streamed == pytest.approx([lp.logprob for lp in whole.logprobs])
