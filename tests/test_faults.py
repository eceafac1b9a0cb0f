"""One request's fault stays that request's: bad sampling values, a sampler that raises, an `n`
that can never fit, copies behind their siblings, a reader that stops, a session not saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

from neuronpy.engine.sampling import Sampler
from neuronpy.engine.types import FinishReason, GenerationEvent, SamplingParams, SessionRequest
from tests.factories import make_engine, tokenizer
from tests.servers import RunningServer, fixture_model, run_server

pytestmark = pytest.mark.anyio

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


class RaisingSampler(Sampler):
    """A sampler whose draws fail, as one with parameters the tensor ops refuse would."""

    def sample(self, logits: Any) -> int:
        raise RuntimeError("value cannot be converted to type float without overflow")

    @property
    def plain_greedy(self) -> bool:
        return False


@pytest.fixture(scope="module")
def server() -> Any:
    with run_server(fixture_model(max_in_flight=2, max_queue=2)) as running:
        yield running


def greedy_text(server: RunningServer) -> str:
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
    out = client.completions.create(
        model="tiny-llama", prompt="The dog", max_tokens=16, temperature=0.0
    )
    return out.choices[0].text


# ---- validation: what the sampler could not use is a 400 naming it -------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 2**64),
        ("temperature", 2.5),
        ("top_p", 0),
        ("top_k", 2**70),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("frequency_penalty", 1e30),
        ("presence_penalty", -2.5),
        ("logit_bias", {"5": 1e30}),
        ("logit_bias", {str(2**40): 1}),
        ("stop_token_ids", [2**70]),
    ],
)
def test_values_the_tensor_ops_cannot_take_are_a_400(
    server: RunningServer, field: str, value: object
) -> None:
    before = greedy_text(server)
    body = {"model": "tiny-llama", "prompt": "The dog", "max_tokens": 4, field: value}
    response = httpx.post(f"{server.v1}/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    assert server.health().status_code == 200
    assert greedy_text(server) == before


def test_n_that_can_never_fit_is_a_400_on_n(server: RunningServer) -> None:
    body = {"model": "tiny-llama", "prompt": "The dog", "max_tokens": 4, "n": 5}  # > 2 + 2
    response = httpx.post(f"{server.v1}/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "n"
    assert "Retry-After" not in response.headers


# ---- a fault of one row fails that request alone -------------------------------------------------


async def test_a_sampler_that_raises_fails_its_request_alone() -> None:
    tok = tokenizer()
    texts = ["Once upon a time", "The quick brown fox", "Numbers: 1, 2, 3"]
    async with make_engine(max_in_flight=4) as engine:
        alone = [await engine.complete(tok.encode(t), GREEDY) for t in texts]
        streams = [engine.submit(tok.encode(t), GREEDY) for t in texts]
        broken = streams[1]
        engine._runner.samplers[broken.id] = RaisingSampler(GREEDY, (1,), engine.vocab_size)
        got: list[list[Any]] = [[], [], []]

        async def read(i: int) -> None:
            async for event in streams[i]:
                got[i].append(event)

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(read, i)
        last = got[1][-1]
        assert last.finish_reason is FinishReason.ERROR and "sampling failed" in last.error
        for i in (0, 2):
            assert [t for e in got[i] for t in e.token_ids] == alone[i].token_ids
            assert got[i][-1].finish_reason is FinishReason.LENGTH
        assert engine.healthy and engine.stats().failed == 1
        again = await engine.complete(tok.encode(texts[1]), GREEDY)
        assert again.token_ids == alone[1].token_ids
        assert (await engine.worker_stats()).snapshots == 0


# ---- n > 1 copies wait behind their siblings, not for a deadline ---------------------------------


async def test_copies_behind_their_own_siblings_never_time_out() -> None:
    tok = tokenizer()
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    async with make_engine(max_in_flight=1, max_queue=4, queue_timeout=0.2) as engine:
        streams = engine.submit_many(tok.encode("The dog"), params, 3)
        ends = []
        for stream in streams:
            events = [event async for event in stream]
            ends.append(events[-1].finish_reason)
        # each copy ran alone for longer than the deadline while the others waited for its row
        assert ends == [FinishReason.LENGTH] * 3
        assert engine.stats().timed_out == 0


# ---- a reader that stops is ended at the bound ---------------------------------------------------


async def test_a_reader_that_stops_reading_is_ended_at_the_bound() -> None:
    tok = tokenizer()
    per_token = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, logprobs=0)
    async with make_engine(max_buffered_events=8) as engine:
        stalled = engine.submit(tok.encode("The dog"), per_token)  # never read, for now
        reader = await engine.complete(tok.encode("Once upon a time"), GREEDY)
        assert reader.finish_reason is FinishReason.LENGTH
        with anyio.fail_after(30):
            while engine.stats().running:
                await anyio.sleep(0.01)
        events = [event async for event in stalled]
        assert len(events) == 8  # the bound: 7 tokens, then the final error
        assert events[-1].finish_reason is FinishReason.ERROR
        assert "unread" in (events[-1].error or "")
        assert engine.stats().generated_tokens < 200 + GREEDY.max_tokens
        assert (await engine.worker_stats()).snapshots == 0


# ---- a session that cannot be saved keeps its reply ----------------------------------------------


async def test_a_session_that_cannot_be_saved_returns_the_reply(tmp_path: Path) -> None:
    tok = tokenizer()
    unwritable = tmp_path / "gone" / "chat.safetensors"  # its directory does not exist
    session = SessionRequest("chat", unwritable)
    async with make_engine() as engine:
        want = await engine.complete(tok.encode("The dog"), GREEDY)
        (stream,) = engine.submit_many(tok.encode("The dog"), GREEDY, 1, session=session)
        events = [event async for event in stream]
        last = events[-1]
        assert last.finish_reason is FinishReason.LENGTH and last.error is None
        assert [t for e in events for t in e.token_ids] == want.token_ids
        assert last.session_error is not None and "chat" in last.session_error
        assert str(tmp_path) not in last.session_error
        stats = engine.stats()
        assert stats.session_save_failures == 1 and stats.failed == 0


def test_an_ending_about_the_request_s_own_field_is_a_400() -> None:
    from neuronpy.server.errors import failure

    bad_file = GenerationEvent(
        "", finish_reason=FinishReason.ERROR, error="session 'x': bad", error_param="session"
    )
    error = failure(bad_file, engine=None)  # type: ignore[arg-type]  (decided without it)
    assert error is not None and error.status == 400
    assert error.body()["error"]["param"] == "session"
