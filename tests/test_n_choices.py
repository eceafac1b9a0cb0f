"""n > 1: one prefill cloned into n copies, each sampled with seed + index, returned as n
choices (streamed or not); validation, admission and cancellation."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import httpx
import openai
import pytest

from neuronpy.engine.engine import Engine
from neuronpy.engine.stream import RequestStream
from neuronpy.engine.types import FinishReason, SamplingParams
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


# ---- several n > 1 requests at once -------------------------------------------------------------

# three requests of two copies each, sampled (copy i with seed + i), none ending before 32 tokens
STORIES = [f"Tell me story number {i} about a fox" for i in range(3)]
COPIES = [
    SamplingParams(max_tokens=32, temperature=0.9, seed=10 * i, ignore_eos=True) for i in range(3)
]
# decodes while the copies join (their prompts then ride its decode steps), until cancelled
BUSY = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


async def gather_all(
    streams: Sequence[RequestStream],
) -> list[tuple[tuple[int, ...], FinishReason]]:
    """Each stream's tokens and finish reason, read together (as the server's gather does)."""
    out: dict[int, tuple[tuple[int, ...], FinishReason]] = {}

    async def read(i: int, stream: RequestStream) -> None:
        tokens: list[int] = []
        finish = None
        async for event in stream:
            tokens.extend(event.token_ids)
            finish = event.finish_reason or finish
        assert finish is not None
        out[i] = (tuple(tokens), finish)

    async with anyio.create_task_group() as tg:
        for i, stream in enumerate(streams):
            tg.start_soon(read, i, stream)
    return [out[i] for i in range(len(streams))]


async def until_idle(engine: Engine) -> None:
    with anyio.fail_after(30):
        while not engine.idle:
            await anyio.sleep(0.01)


async def copies_at_once(engine: Engine, *, beside_a_decoding_row: bool) -> list[Any]:
    """The three requests' copies admitted together (alone, or while a row decodes: their
    prompts then ride its steps), each copy's tokens and finish reason."""
    prompts = [tokenizer().encode(text) for text in STORIES]
    busy = None
    if beside_a_decoding_row:
        busy = engine.submit(prompts[0], BUSY)
        await busy.__anext__()  # it has its first token: the copies join while it decodes
    streams = [s for p, q in zip(prompts, COPIES, strict=True) for s in engine.submit_many(p, q, 2)]
    with anyio.fail_after(60):
        outs = await gather_all(streams)
    if busy is not None:
        busy.cancel()
    return outs


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("speculative", "prefix_cache"), [("off", True), ("ngram", True), ("off", False)]
)
@pytest.mark.parametrize("beside_a_decoding_row", [False, True])
async def test_concurrent_n_requests_each_copy_finishes_as_it_would_alone(
    speculative: str, prefix_cache: bool, beside_a_decoding_row: bool
) -> None:
    """Several n > 1 requests at once, with or without other traffic: every copy of every
    request ends with its 32 tokens, the tokens its seed gives it alone; then the engine is
    idle, holding no snapshot."""
    prompts = [tokenizer().encode(text) for text in STORIES]
    config = {"speculative": speculative, "prefix_cache": prefix_cache}
    async with make_engine(max_in_flight=8, max_queue=8, **config) as engine:
        alone = []
        for p, q in zip(prompts, COPIES, strict=True):
            for i in range(2):
                done = await engine.complete(p, dataclasses.replace(q, seed=q.seed + i))
                alone.append((tuple(done.token_ids), FinishReason.LENGTH))
        for _ in range(4):
            outs = await copies_at_once(engine, beside_a_decoding_row=beside_a_decoding_row)
            assert outs == alone
        await until_idle(engine)
        stats, stored = engine.stats(), await engine.worker_stats()
    assert stats.running == 0 and stats.queued == 0 and stats.failed == 0
    assert stored.snapshots == 0 and stored.live_batch_size == 0


@pytest.mark.anyio
async def test_an_engine_with_nothing_to_run_takes_no_turn_and_no_cpu() -> None:
    """Once every copy has ended, the engine's loop sleeps: not one turn, and next to no CPU
    time on the event loop's thread (where the loop runs), however long nothing comes."""
    async with make_engine(max_in_flight=8, max_queue=8) as engine:
        await copies_at_once(engine, beside_a_decoding_row=True)
        await until_idle(engine)
        turns, cpu = engine.loop_turns, time.thread_time()
        await anyio.sleep(0.5)
        assert engine.loop_turns == turns
        assert time.thread_time() - cpu < 0.1
        # and it wakes for the next request
        out = await engine.complete(tokenizer().encode("Once upon a time"), COPIES[0])
        assert out.finish_reason is FinishReason.LENGTH and engine.loop_turns > turns


def ask_copies(server: RunningServer, i: int, stream: bool) -> list[str | None]:
    """Request i of the three, n = 2, through the openai client: each choice's finish reason."""
    q = COPIES[i]
    kwargs: dict[str, Any] = {"max_tokens": q.max_tokens, "temperature": q.temperature}
    kwargs |= {"seed": q.seed, "n": 2, "extra_body": {"ignore_eos": True}}
    messages = [{"role": "user", "content": STORIES[i]}]
    ask = client(server).with_options(timeout=30).chat.completions.create
    if not stream:
        out = ask(model="tiny-llama", messages=messages, **kwargs)  # type: ignore[call-overload]
        return [c.finish_reason for c in sorted(out.choices, key=lambda c: c.index)]
    finishes: list[str | None] = [None, None]
    for chunk in ask(model="tiny-llama", messages=messages, stream=True, **kwargs):
        for choice in chunk.choices:
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    return finishes


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("beside_a_decoding_row", [False, True])
def test_concurrent_n_requests_through_the_server_every_choice_finishes(
    server: RunningServer, stream: bool, beside_a_decoding_row: bool
) -> None:
    """Three chat requests with n = 2 at once, four rounds, through the openai client: every
    choice of every request comes back with its finish reason; then nothing is left running."""
    for _ in range(4):
        with contextlib.ExitStack() as stack:
            if beside_a_decoding_row:  # a long reply decodes while the three join
                body = {"messages": MESSAGES, "stream": True, "max_tokens": 480}
                body |= {"temperature": 0, "ignore_eos": True}
                busy = stack.enter_context(
                    httpx.stream("POST", f"{server.v1}/chat/completions", json=body, timeout=30)
                )
                next(line for line in busy.iter_lines() if '"content":"' in line)
            with ThreadPoolExecutor(3) as pool:
                finishes = list(pool.map(lambda i: ask_copies(server, i, stream), range(3)))
        assert finishes == [["length", "length"]] * 3
    server.wait_for(lambda s: s["running"] == 0 and s["queued"] == 0)
