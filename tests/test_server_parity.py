"""Through HTTP, greedy requests batched together return exactly what each returns alone."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import openai
import pytest

from tests.servers import RunningServer, engine_loader, process_loader, run_server


@dataclass(frozen=True)
class Case:
    kind: str  # "chat" or "text"
    prompt: str
    max_tokens: int
    stream: bool
    ignore_eos: bool = True


CASES = [
    Case("chat", "The quick brown fox", 40, stream=True),
    Case("text", "Once upon a time, there was", 12, stream=False),
    Case("chat", "What changed? Mostly the roads", 55, stream=False),
    Case("text", "She ordered a café au lait", 30, stream=True),
    Case("chat", "A language model reads a sequence", 8, stream=True),
    Case("text", "In 1984 the station recorded", 60, stream=False),
    Case("chat", "The dog sleeps in the sun", 25, stream=False, ignore_eos=False),
    Case("text", "Servers that handle many requests", 45, stream=True, ignore_eos=False),
]


@dataclass(frozen=True)
class Outcome:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


async def run_case(api: openai.AsyncOpenAI, case: Case, model: str = "tiny-llama") -> Outcome:
    common: dict[str, Any] = {
        "model": model,
        "max_tokens": case.max_tokens,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": case.ignore_eos},
    }
    if case.stream:
        common["stream"] = True
        common["stream_options"] = {"include_usage": True}
    if case.kind == "chat":
        messages = [{"role": "user", "content": case.prompt}]
        out = await api.chat.completions.create(messages=messages, **common)
    else:
        out = await api.completions.create(prompt=case.prompt, **common)
    if not case.stream:
        choice = out.choices[0]
        text = choice.message.content if case.kind == "chat" else choice.text
        return Outcome(text, choice.finish_reason, *_usage(out.usage))
    pieces, finish, usage = [], None, None
    async for chunk in out:
        for choice in chunk.choices:
            pieces.append((choice.delta.content if case.kind == "chat" else choice.text) or "")
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    return Outcome("".join(pieces), finish, *_usage(usage))


def _usage(usage: Any) -> tuple[int, int]:
    return usage.prompt_tokens, usage.completion_tokens


@pytest.fixture(scope="module", params=["in-process", "engine-process"])
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    """The server with its engine in its own process (as `neuronpy serve` runs it) and in the
    server's: the same replies either way."""
    loader = engine_loader if request.param == "in-process" else process_loader
    with run_server({"tiny-llama": loader(max_in_flight=8, max_queue=64)}) as running:
        yield running


@pytest.mark.anyio
async def test_parity_concurrent_staggered_requests_match_solo_runs(server: RunningServer) -> None:
    api = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)
    async with api:
        solo = [await run_case(api, case) for case in CASES]
        before = server.stats()
        together: list[Outcome | None] = [None] * len(CASES)

        async def staggered(i: int) -> None:
            await anyio.sleep(0.015 * i)  # joins land while the others decode
            together[i] = await run_case(api, CASES[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(CASES)):
                tg.start_soon(staggered, i)
    after = server.stats()
    for case, alone, batched in zip(CASES, solo, together, strict=True):
        assert batched == alone, f"{case} differs when batched"
    assert any(o.finish_reason == "length" for o in solo)
    # they really ran together
    assert after["multi_row_steps"] > before["multi_row_steps"]
    assert after["max_batch_size"] >= 3
    assert after["running"] == 0 and after["queued"] == 0


@pytest.mark.anyio
async def test_parity_with_a_cancelled_neighbour(server: RunningServer) -> None:
    """A request cancelled mid-batch leaves the others' greedy output unchanged."""
    api = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)
    async with api:
        kept = CASES[:3]
        solo = [await run_case(api, case) for case in kept]
        before = server.stats()
        results: list[Outcome | None] = [None] * len(kept)

        async def run(i: int) -> None:
            results[i] = await run_case(api, kept[i])

        async def cancelled_midway() -> None:
            stream = await api.completions.create(
                model="tiny-llama",
                prompt="The farmer wakes up",
                max_tokens=300,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 5:
                    break
            await stream.close()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancelled_midway)
            for i in range(len(kept)):
                tg.start_soon(run, i)
    assert results == solo
    after = server.wait_for(lambda s: s["running"] == 0 and s["queued"] == 0)
    assert after["cancelled"] == before["cancelled"] + 1
