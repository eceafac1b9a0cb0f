"""n > 1: one prefill cloned into n copies, each sampled with seed + index, returned as n
choices (streamed or not); validation, admission and cancellation."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from neuronpy.engine.types import SamplingParams
from neuronpy.errors import InvalidRequestError, QueueFullError
from tests.factories import make_engine, tokenizer
from tests.servers import RunningServer, fixture_model, run_server

MESSAGES = [{"role": "user", "content": "Tell me a story about a fox"}]
SAMPLED: dict[str, Any] = {"temperature": 1.5, "max_tokens": 12, "seed": 11}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server(fixture_model(max_in_flight=8, max_queue=8, max_n=4)) as running:
        yield running


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)


def alone(server: RunningServer, seed: int) -> tuple[str, int]:
    """The same request with n=1 and this seed: its text and completion tokens."""
    out = client(server).chat.completions.create(
        model="tiny-llama", messages=MESSAGES, **{**SAMPLED, "seed": seed}
    )
    assert out.usage is not None
    return out.choices[0].message.content or "", out.usage.completion_tokens


def test_n_choices_equal_single_requests_seeded_by_index(server: RunningServer) -> None:
    out = client(server).chat.completions.create(
        model="tiny-llama", messages=MESSAGES, n=3, **SAMPLED
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.message.content for c in out.choices]
    singles = [alone(server, SAMPLED["seed"] + i) for i in range(3)]
    assert texts == [text for text, _ in singles]
    assert len(set(texts)) > 1, "the copies sampled alike: the seeds did not differ"
    assert out.usage is not None
    assert out.usage.completion_tokens == sum(tokens for _, tokens in singles)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_n_choices_streamed(server: RunningServer) -> None:
    chunks = list(
        client(server).chat.completions.create(
            model="tiny-llama",
            messages=MESSAGES,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
            **SAMPLED,
        )
    )
    texts = ["", "", ""]
    finished = set()
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2}
    singles = [alone(server, SAMPLED["seed"] + i) for i in range(3)]
    assert texts == [text for text, _ in singles]
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert all(c.usage is None for c in chunks[:-1])  # one usage chunk, for every choice
    assert usage.completion_tokens == sum(tokens for _, tokens in singles)


def test_n_completions_endpoint_greedy_copies_agree(server: RunningServer) -> None:
    out = client(server).completions.create(
        model="tiny-llama", prompt="Once upon a time", n=2, max_tokens=8, temperature=0
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == out.choices[1].text
    one = client(server).completions.create(
        model="tiny-llama", prompt="Once upon a time", max_tokens=8, temperature=0
    )
    assert out.choices[0].text == one.choices[0].text


@pytest.mark.parametrize("n", [0, 5, 2.0, "3", False])
def test_bad_n_is_a_400_naming_n(server: RunningServer, n: object) -> None:
    before = server.stats()["admitted"]
    response = httpx.post(
        f"{server.v1}/chat/completions", json={"messages": MESSAGES, "n": n}, timeout=30
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "n"
    assert server.stats()["admitted"] == before  # refused before any copy was admitted


def test_closing_a_streamed_n_request_cancels_every_copy(server: RunningServer) -> None:
    before = server.stats()
    body = {
        "messages": MESSAGES,
        "n": 3,
        "stream": True,
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.v1}/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # the first text: the copies are running
    after = server.wait_for(lambda s: s["running"] == 0 and s["queued"] == 0)
    assert after["cancelled"] - before["cancelled"] == 3
    assert after["admitted"] - before["admitted"] == 3


@pytest.mark.anyio
async def test_engine_counts_each_copy_against_admission() -> None:
    tok = tokenizer()
    prompt = tok.encode("The quick brown fox")
    params = SamplingParams(max_tokens=6, temperature=0.0)
    async with make_engine(max_in_flight=2, max_queue=1, max_n=8) as engine:
        with pytest.raises(InvalidRequestError) as info:
            engine.submit_many(prompt, params, 4)  # 4 copies > 2 running + 1 queued: never fit
        assert info.value.param == "n"
        with pytest.raises(InvalidRequestError):
            engine.submit_many(prompt, params, 9)
        streams = engine.submit_many(prompt, params, 3)
        assert engine.stats().admitted == 3
        with pytest.raises(QueueFullError):
            engine.submit_many(prompt, params, 1)  # it fits, but not now: retry later
        outs = []
        for stream in streams:
            outs.append([t async for event in stream for t in event.token_ids])
        single = await engine.complete(prompt, params)
        stats = engine.stats()
        stored = await engine.worker_stats()
    assert outs == [single.token_ids] * 3
    assert stats.prefills == 2  # the three copies shared one prefill; then the single request
    assert stored.snapshots == 0
