"""A soak: hundreds of mixed requests (n > 1, constraints, Responses follow-ups, cancellations,
speculation on, a KV budget that preempts rows) at a concurrency above max_in_flight, through
the real openai client. Every request ends as it should, and the engine ends idle, holding
nothing. Nothing here is timed."""

from __future__ import annotations

import json
import random
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import openai
import pytest

from neuronpy.engine.engine import Engine
from tests.servers import RunningServer, fixture_model, run_server

pytestmark = [pytest.mark.anyio, pytest.mark.soak]

MODEL = "tiny-llama"
RUNNING, QUEUE, CONCURRENCY, REQUESTS = 4, 128, 12, 300
ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no", "maybe"]}},
    "required": ["answer"],
}
TOPICS = ("a fox", "the sea", "servers", "a café au lait", "1984", "the roads")

Call = Callable[[openai.AsyncOpenAI], Awaitable[None]]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    config = {"max_in_flight": RUNNING, "max_queue": QUEUE, "max_n": 3, "speculative": "ngram"}
    # 160 tokens of the fixture's KV (512 bytes a token): rows are preempted, and resume
    config["kv_budget"] = 160 * 512
    with run_server(fixture_model(MODEL, **config)) as running:
        yield running


def sampling(rng: random.Random) -> dict[str, Any]:
    """Greedy or seeded sampling, a short reply."""
    out: dict[str, Any] = {"max_tokens": rng.randint(4, 20)}
    if rng.random() < 0.5:
        return {**out, "temperature": 0.0}
    return {**out, "temperature": 0.9, "seed": rng.randrange(1000)}


def messages(rng: random.Random) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me about {rng.choice(TOPICS)}"}]


def chat(rng: random.Random) -> Call:
    """n copies, streamed or not: every choice ends with its finish reason."""
    n, stream, params, msgs = rng.randint(1, 3), rng.random() < 0.5, sampling(rng), messages(rng)

    async def call(api: openai.AsyncOpenAI) -> None:
        create = api.chat.completions.create
        if not stream:
            out = await create(model=MODEL, messages=msgs, n=n, **params)  # type: ignore[call-overload]
            assert sorted(c.index for c in out.choices) == list(range(n))
            assert all(c.finish_reason in ("stop", "length") for c in out.choices), out
            return
        finishes: dict[int, str] = {}
        async for chunk in await create(model=MODEL, messages=msgs, n=n, stream=True, **params):  # type: ignore[call-overload]
            for choice in chunk.choices:
                if choice.finish_reason:
                    finishes[choice.index] = choice.finish_reason
        assert sorted(finishes) == list(range(n)) and set(finishes.values()) <= {"stop", "length"}

    return call


def constrained(rng: random.Random) -> Call:
    """A JSON Schema reply, n of 1 or 2: what ends on its own is valid."""
    n, msgs = rng.randint(1, 2), messages(rng)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}

    async def call(api: openai.AsyncOpenAI) -> None:
        out = await api.chat.completions.create(
            model=MODEL,
            messages=msgs,
            n=n,
            max_tokens=48,
            temperature=0.9,
            response_format=fmt,  # type: ignore[arg-type]
        )
        assert len(out.choices) == n
        for choice in out.choices:
            assert choice.finish_reason in ("stop", "length")
            if choice.finish_reason == "stop":
                assert json.loads(choice.message.content or "")["answer"] in ("yes", "no", "maybe")

    return call


def completions(rng: random.Random) -> Call:
    """Two prompts in one /v1/completions request, n of 1 or 2: prompts × n choices."""
    n, params = rng.randint(1, 2), sampling(rng)
    prompts = [f"Once upon a time {rng.choice(TOPICS)}", f"The story of {rng.choice(TOPICS)}"]

    async def call(api: openai.AsyncOpenAI) -> None:
        out = await api.completions.create(model=MODEL, prompt=prompts, n=n, **params)
        assert sorted(c.index for c in out.choices) == list(range(2 * n))
        assert all(c.finish_reason in ("stop", "length") for c in out.choices)

    return call


def conversation(rng: random.Random) -> Call:
    """A stored response, then a follow-up to it (previous_response_id)."""
    first, second = f"Hello about {rng.choice(TOPICS)}", "And then?"

    async def call(api: openai.AsyncOpenAI) -> None:
        kwargs: dict[str, Any] = {"model": MODEL, "max_output_tokens": 10, "temperature": 0.0}
        out = await api.responses.create(input=first, **kwargs)
        assert out.status in ("completed", "incomplete")
        follow = await api.responses.create(input=second, previous_response_id=out.id, **kwargs)
        assert follow.status in ("completed", "incomplete")
        assert follow.previous_response_id == out.id

    return call


def hang_up(rng: random.Random) -> Call:
    """A long streamed reply the client leaves after its first chunk (its copies are
    cancelled)."""
    n, msgs = rng.randint(1, 2), messages(rng)

    async def call(api: openai.AsyncOpenAI) -> None:
        stream = await api.chat.completions.create(
            model=MODEL, messages=msgs, n=n, max_tokens=300, stream=True,
            temperature=0.0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for _ in stream:
            break
        await stream.close()

    return call


KINDS = (
    (chat, 0.4),
    (constrained, 0.15),
    (completions, 0.15),
    (conversation, 0.15),
    (hang_up, 0.15),
)


def workload(seed: int = 0) -> list[Call]:
    rng = random.Random(seed)
    kinds, weights = zip(*KINDS, strict=True)
    return [rng.choices(kinds, weights)[0](rng) for _ in range(REQUESTS)]


def engine_of(server: RunningServer) -> Engine:
    engine = server.state.models[MODEL].engine
    assert engine is not None
    return engine


async def test_a_soak_of_mixed_requests_ends_every_one_and_leaves_the_engine_idle(
    server: RunningServer,
) -> None:
    engine = engine_of(server)
    calls = workload()
    failures: list[str] = []
    todo = iter(enumerate(calls))
    api = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)

    async def client() -> None:
        for i, call in todo:
            try:
                await call(api)
            except Exception as exc:  # every kind of failure is reported, with its request
                failures.append(f"request {i} ({call.__qualname__}): {exc!r}")

    async with api:
        with anyio.fail_after(600):
            async with anyio.create_task_group() as tg:
                for _ in range(CONCURRENCY):
                    tg.start_soon(client)
    assert failures == []
    stats = server.wait_for(lambda s: s["running"] == 0 and s["queued"] == 0)
    assert stats["healthy"] and stats["failed"] == 0 and stats["rejected"] == 0
    # every copy admitted has ended: served, or cancelled with its client
    assert stats["admitted"] == stats["finished"] + stats["cancelled"]
    assert stats["cancelled"] > 0 and 1 < stats["max_batch_size"] <= RUNNING
    assert stats["preemptions"] > 0 and stats["spec_draft_tokens"] > 0  # both were at work
    with anyio.fail_after(30):
        while not engine.idle:
            await anyio.sleep(0.01)
    stored = await engine.worker_stats()
    assert stored.snapshots == 0 and stored.live_batch_size == 0
    turns = engine.loop_turns
    await anyio.sleep(0.2)
    assert engine.loop_turns == turns  # idle: the loop sleeps
