"""The API surface clients expect beyond chat and completions: request ids, several prompts
in one completions request, /tokenize and /detokenize, tools on a template that cannot show
them. A real server on loopback, the real openai client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.servers import RunningServer, fixture_model, run_server

MODEL = "tiny-llama"
TOOLS_MODEL = "tiny-qwen3-tools"


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server({**fixture_model(MODEL), **fixture_model(TOOLS_MODEL)}) as running:
        yield running


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)


# ---- x-request-id -------------------------------------------------------------------------------


def test_every_response_carries_a_request_id(server: RunningServer) -> None:
    api = client(server)
    raw = api.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    completion = raw.parse()
    assert raw.headers["x-request-id"] == completion.id  # the completion's own id
    assert completion._request_id == completion.id  # what the SDK shows
    # the client's own id comes back, on a success, a stream and an error alike
    mine = {"x-request-id": "my-trace-42"}
    ok = httpx.post(
        f"{server.v1}/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=mine
    )
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "my-trace-42"
    body = {"prompt": "Hi", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{server.v1}/completions", json=body, headers=mine) as streamed:
        assert streamed.headers["x-request-id"] == "my-trace-42"
        assert streamed.read().endswith(b"data: [DONE]\n\n")
    bad = httpx.post(f"{server.v1}/completions", json={"prompt": "Hi", "top_p": 7}, headers=mine)
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "my-trace-42"
    # without one, every route names its response: a 404, /health
    for response in (httpx.get(f"{server.url}/nowhere"), server.health()):
        assert response.headers["x-request-id"].startswith("req-")
    # an unusable one (spaces, too long) is replaced
    odd = httpx.get(f"{server.url}/health", headers={"x-request-id": "a b"})
    assert odd.headers["x-request-id"].startswith("req-")
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=MODEL, prompt="Hi", max_tokens=0)
    assert info.value.request_id and info.value.request_id.startswith("cmpl-")


# ---- several prompts ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_list_of_prompts_gives_one_choice_per_prompt_and_copy(
    server: RunningServer, stream: bool
) -> None:
    api = client(server)
    prompts = ["Once upon a time", "The quick brown fox", "Numbers: 1, 2"]
    kwargs = dict(model=MODEL, max_tokens=6, temperature=0.0, n=2)
    alone = [api.completions.create(prompt=p, **kwargs) for p in prompts]
    if stream:
        chunks = list(
            api.completions.create(
                prompt=prompts, stream=True, stream_options={"include_usage": True}, **kwargs
            )
        )
        texts: dict[int, str] = {}
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
        got = [texts[i] for i in range(6)]
        usage = chunks[-1].usage
    else:
        out = api.completions.create(prompt=prompts, **kwargs)
        assert [c.index for c in out.choices] == list(range(6))
        got = [c.text for c in out.choices]
        usage = out.usage
    # index = prompt * n + copy; greedy, so each prompt's copies match that prompt alone
    assert got == [c.text for one in alone for c in one.choices]
    assert usage.prompt_tokens == sum(one.usage.prompt_tokens for one in alone)
    assert usage.completion_tokens == sum(one.usage.completion_tokens for one in alone)


def test_a_bad_prompt_in_the_list_admits_none(server: RunningServer) -> None:
    before = server.stats(MODEL)["admitted"]
    for prompt, where in (
        (["fine", ""], "prompt[1]"),
        (["fine", [1, "x"]], "prompt[1]"),
        (["x"] * 300, "at most 256"),
    ):
        response = httpx.post(f"{server.v1}/completions", json={"prompt": prompt, "max_tokens": 2})
        assert response.status_code == 400, prompt
        error = response.json()["error"]
        assert error["param"] == "prompt" and where in error["message"]
    long = ["Hi", "word " * 600]  # the second is past the context: nothing is admitted
    response = httpx.post(f"{server.v1}/completions", json={"prompt": long, "max_tokens": 2})
    assert response.status_code == 400
    assert server.stats(MODEL)["admitted"] == before
    assert server.wait_for(lambda s: s["running"] == 0 and s["queued"] == 0, model=MODEL)


# ---- /tokenize and /detokenize ------------------------------------------------------------------


def test_tokenize_and_detokenize_round_trip(server: RunningServer) -> None:
    text = "café au lait, 日本語 🦊"
    out = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert out["count"] == len(out["tokens"]) > 0 and out["max_model_len"] == 512
    back = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": out["tokens"]})
    assert back.json() == {"prompt": text}
    # chat messages: exactly the prompt a chat request prefills
    messages = [{"role": "user", "content": "Hi there"}]
    chat = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages})
    completion = client(server).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1
    )
    assert chat.json()["count"] == completion.usage.prompt_tokens


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": MODEL}, 400, "prompt"),
        ("/tokenize", {"model": MODEL, "prompt": 5}, 400, "prompt"),
        ("/tokenize", {"model": MODEL, "prompt": "x", "add_special_tokens": "yes"}, 400, None),
        ("/tokenize", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"model": MODEL, "tokens": [1, 999999]}, 400, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": [1.5]}, 400, "tokens"),
        ("/detokenize", [1, 2], 400, None),
    ],
)
def test_bad_tokenizer_requests_are_4xx(
    server: RunningServer, path: str, body: Any, status: int, param: str | None
) -> None:
    response = httpx.post(f"{server.url}{path}", json=body)
    assert response.status_code == status, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param


# ---- tools on a template that cannot show them --------------------------------------------------

TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "maxLength": 6}},
            "required": ["tz"],
        },
    },
}


def test_tools_on_a_template_without_them_are_shown_in_the_generic_format(
    server: RunningServer,
) -> None:
    """tiny-llama's template drops tools: they are written into the system message instead
    (the prompt grows by them), "auto" lets the model choose, and a call it writes is parsed."""
    api = client(server)
    messages = [{"role": "user", "content": "Time?"}]
    bare = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    auto = api.chat.completions.create(model=MODEL, messages=messages, tools=[TOOL], max_tokens=4)
    assert auto.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert auto.usage.prompt_tokens > bare.usage.prompt_tokens + 20  # the tools, shown
    calls = auto.choices[0].message.tool_calls or []
    assert all(c.function.name == "get_time" for c in calls)
    # "required": the grammar holds the reply to a call
    out = api.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[TOOL],
        tool_choice="required",
        parallel_tool_calls=False,  # one call, then the grammar ends the reply
        max_tokens=150,
    )
    assert out.choices[0].finish_reason == "tool_calls"
    assert out.choices[0].message.tool_calls[0].function.name == "get_time"
    # a template that renders tools takes them with "auto"
    free = api.chat.completions.create(
        model=TOOLS_MODEL, messages=messages, tools=[TOOL], max_tokens=4
    )
    assert free.choices[0].finish_reason in ("length", "stop", "tool_calls")
    # tool_choice "none" hides them
    hidden = api.chat.completions.create(
        model=MODEL, messages=messages, tools=[TOOL], tool_choice="none", max_tokens=2
    )
    assert hidden.usage.prompt_tokens == bare.usage.prompt_tokens


# ---- the edges a new user hits ------------------------------------------------------------------


def test_an_empty_model_is_the_only_model_served() -> None:
    with run_server(fixture_model(MODEL)) as alone:
        reply = client(alone).chat.completions.create(
            model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert reply.model == MODEL


def test_an_empty_model_is_unknown_where_several_are_served(server: RunningServer) -> None:
    with pytest.raises(openai.NotFoundError):
        client(server).chat.completions.create(
            model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )


def test_chat_template_kwargs_reach_the_template(server: RunningServer) -> None:
    api = client(server)
    messages = [{"role": "user", "content": "Hi"}]
    plain = api.chat.completions.create(model=TOOLS_MODEL, messages=messages, max_tokens=1)
    off = api.chat.completions.create(
        model=TOOLS_MODEL,
        messages=messages,
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    # Qwen3's template writes an empty think block into the prompt when thinking is off
    assert off.usage.prompt_tokens > plain.usage.prompt_tokens
    for bad in ({"tools": []}, {"x": [1]}, {"not an identifier": 1}, "on"):
        response = httpx.post(
            f"{server.v1}/chat/completions",
            json={"model": TOOLS_MODEL, "messages": messages, "chat_template_kwargs": bad},
        )
        assert response.status_code == 400, bad
        assert response.json()["error"]["param"] == "chat_template_kwargs"


def test_version_flag() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "neuronpy", "--version"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip().startswith("neuronpy ")


def test_continue_final_message_goes_on_from_the_assistants_text(server: RunningServer) -> None:
    api = client(server)
    question = {"role": "user", "content": "Count to ten."}
    whole = api.chat.completions.create(
        model=MODEL, messages=[question], max_tokens=12, temperature=0
    )
    text = whole.choices[0].message.content or ""
    tokenizer = server.state.models[MODEL].engine.tokenizer  # type: ignore[union-attr]
    start = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:4])
    more = api.chat.completions.create(
        model=MODEL,
        messages=[question, {"role": "assistant", "content": start}],
        max_tokens=8,
        temperature=0,
        extra_body={"continue_final_message": True},
    )
    # the prompt ends inside the assistant's turn: no end of turn, no new turn after it
    prompt = tokenizer.apply_chat_template(
        [question, {"role": "assistant", "content": start}],
        continue_final_message=True,
        add_generation_prompt=False,
        tokenize=True,
        return_dict=False,
    )
    assert more.usage.prompt_tokens == len(prompt)
    assert (start + (more.choices[0].message.content or "")).startswith(text[: len(start)])
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(
            model=MODEL,
            messages=[question],
            max_tokens=2,
            extra_body={"continue_final_message": True},
        )
    assert refused.value.body["param"] == "continue_final_message"  # type: ignore[index]
