"""Sessions on disk: a conversation's KV saved under a name, continued after a restart exactly
as without it; bad names and other models' sessions refused. Real servers on loopback, the
real openai client."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from safetensors import safe_open

from neuronpy.server.prompts import render_chat
from tests.factories import tokenizer
from tests.servers import fixture_model, run_server

MODEL = "tiny-llama"
FIRST = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog"}]


def chat(url: str, messages: list[dict[str, str]], **extra: Any) -> Any:
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    return api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0.0, extra_body=extra
    )


def second_turn(reply: str) -> list[dict[str, str]]:
    return [
        *FIRST,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And after that?"},
    ]


def cached(response: Any) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def test_a_session_continues_after_a_restart_as_without_it(tmp_path: Path) -> None:
    # the reference: both turns on a server without sessions (nor prefix cache)
    with run_server(fixture_model(prefix_cache=False)) as plain:
        first = chat(plain.url, FIRST)
        reply = first.choices[0].message.content
        expected = chat(plain.url, second_turn(reply))
    with run_server(fixture_model(), sessions_dir=tmp_path) as server:
        saved = chat(server.url, FIRST, session="talk")
        info = httpx.get(f"{server.url}/v1/sessions/talk", timeout=10).json()
        assert server.stats()["sessions_saved"] == 1
    assert saved.choices[0].message.content == reply
    prompt = render_chat(tokenizer(), FIRST)
    # the KV of the prompt and the reply (but its last token, never fed to the model)
    assert info["tokens"] == len(prompt) + saved.usage.completion_tokens - 1
    assert info["model"] == MODEL and info["object"] == "session"
    assert (tmp_path / "talk.safetensors").is_file()
    with safe_open(str(tmp_path / "talk.safetensors"), framework="pt") as f:
        meta = f.metadata()
        assert json.loads(meta["token_ids"])[: len(prompt)] == prompt
        assert meta["dtype"] == "float32" and meta["fingerprint"]
        assert f.get_tensor("layers.0.keys").shape[2] == info["tokens"]
    # a new server process, empty caches: the second turn restores the first from the file
    with run_server(fixture_model(), sessions_dir=tmp_path) as restarted:
        before = restarted.stats()
        got = chat(restarted.url, second_turn(reply), session="talk")
        after = restarted.stats()
    assert got.choices[0].message.content == expected.choices[0].message.content
    assert got.usage == expected.usage.model_copy(
        update={"prompt_tokens_details": got.usage.prompt_tokens_details}
    )
    assert cached(got) >= len(prompt)  # at least the first turn's prompt came from the file
    assert after["sessions_restored"] - before["sessions_restored"] == 1
    prefilled = after["prefill_tokens"] - before["prefill_tokens"]
    assert prefilled == got.usage.prompt_tokens - cached(got)
    assert after["prefix_cache_hits"] == 0  # the restore came from the file, not the cache


def test_save_false_restores_but_leaves_the_session_as_it_is(tmp_path: Path) -> None:
    with run_server(fixture_model(), sessions_dir=tmp_path) as server:
        reply = chat(server.url, FIRST, session="doc").choices[0].message.content
        before = (tmp_path / "doc.safetensors").read_bytes()
        again = chat(server.url, second_turn(reply), session={"name": "doc", "save": False})
        assert (tmp_path / "doc.safetensors").read_bytes() == before
        assert server.stats()["sessions_saved"] == 1
        assert cached(again) > 0
        listed = httpx.get(f"{server.url}/v1/sessions", timeout=10).json()
        assert [s["id"] for s in listed["data"]] == ["doc"]
        gone = httpx.delete(f"{server.url}/v1/sessions/doc", timeout=10)
        assert gone.json() == {"id": "doc", "object": "session.deleted", "deleted": True}
        assert httpx.get(f"{server.url}/v1/sessions/doc", timeout=10).status_code == 404
        assert httpx.delete(f"{server.url}/v1/sessions/doc", timeout=10).status_code == 404
        assert not (tmp_path / "doc.safetensors").exists()


@pytest.mark.parametrize(
    "name",
    [
        *("../escape", "a/b", "..", ".hidden", "", "x" * 200, "dir\\name", "a..b", "nul\x00"),
        # a trailing newline (`$` matches before one: names are matched whole), non-ASCII
        *("talk\n", "\ntalk", "caf\u00e9", "\u0661"),
    ],
)
def test_names_cannot_leave_the_directory(tmp_path: Path, name: str) -> None:
    sessions = tmp_path / "sessions"
    with run_server(fixture_model(), sessions_dir=sessions) as server:
        admitted = server.stats()["admitted"]  # (the start-up's warm-up)
        response = httpx.post(
            f"{server.v1}/chat/completions",
            json={"model": MODEL, "messages": FIRST, "max_tokens": 2, "session": name},
            timeout=30,
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "session" and "session name" in error["message"]
        assert server.stats()["admitted"] == admitted
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sessions"]
    assert list(sessions.iterdir()) == []


def test_other_models_and_bad_requests_are_refused(tmp_path: Path) -> None:
    with run_server(fixture_model(), sessions_dir=tmp_path) as server:
        chat(server.url, FIRST, session="llama-talk")
        bad = [
            ({"session": {"name": "x", "extra": 1}}, "'session' must be"),
            ({"session": 5}, "'session' must be"),
            ({"session": "llama-talk", "n": 2}, "one choice"),
        ]
        for extra, message in bad:
            response = httpx.post(
                f"{server.v1}/chat/completions",
                json={"model": MODEL, "messages": FIRST, "max_tokens": 2, **extra},
                timeout=30,
            )
            assert response.status_code == 400 and message in response.text, response.text
        (tmp_path / "junk.safetensors").write_bytes(b"not a session")
        response = httpx.post(
            f"{server.v1}/chat/completions",
            json={"model": MODEL, "messages": FIRST, "max_tokens": 2, "session": "junk"},
            timeout=30,
        )
        assert response.status_code == 400 and "cannot be read" in response.text
        # the list still answers, naming the unreadable file beside the good one
        listed = httpx.get(f"{server.url}/v1/sessions", timeout=10)
        assert listed.status_code == 200
        junk, talk = listed.json()["data"]
        assert junk["id"] == "junk" and "cannot be read" in junk["error"]
        assert talk["id"] == "llama-talk" and talk["tokens"] > 0
    # another model with the same architecture and tokenizer, other weights
    other_model = {MODEL: fixture_model("tiny-qwen2")["tiny-qwen2"]}
    with run_server(other_model, sessions_dir=tmp_path) as other:
        admitted = other.stats()["admitted"]
        with pytest.raises(openai.BadRequestError, match="continues only on the model"):
            chat(other.url, second_turn("hi"), session="llama-talk")
        assert other.stats()["admitted"] == admitted
    # the same weights in another dtype
    with (
        run_server({MODEL: _bf16_loader()}, sessions_dir=tmp_path) as half,
        pytest.raises(openai.BadRequestError, match="holds float32 KV"),
    ):
        chat(half.url, second_turn("hi"), session="llama-talk")
    # sessions are off unless the server has a directory for them
    with run_server(fixture_model()) as off:
        with pytest.raises(openai.BadRequestError, match="sessions are off"):
            chat(off.url, FIRST, session="llama-talk")
        assert httpx.get(f"{off.url}/v1/sessions", timeout=10).status_code == 404


def _bf16_loader() -> Any:
    from neuronpy.compose import engine_from_hf
    from neuronpy.config import EngineConfig
    from neuronpy.engine.engine import Engine
    from neuronpy.loading import load_pretrained
    from tests.servers import TINY_LLAMA

    def load() -> Engine:
        weights = load_pretrained(str(TINY_LLAMA), dtype="bfloat16")
        return engine_from_hf(
            weights.hf_model, weights.tokenizer, name=MODEL, config=EngineConfig()
        )

    return load


@pytest.mark.anyio
async def test_a_session_that_cannot_be_read_fails_its_request_alone(tmp_path: Path) -> None:
    """The file changed between the request's check of its header and the restore: that
    request ends with an error; the one beside it, and the engine, carry on."""
    from neuronpy.engine.types import FinishReason, SamplingParams, SessionRequest
    from tests.factories import make_engine

    tok = tokenizer()
    prompt = tok.encode("The quick brown fox jumps over the lazy dog")
    junk = tmp_path / "gone.safetensors"
    junk.write_bytes(b"\x00" * 64)
    session = SessionRequest("gone", junk, save=True, token_ids=tuple(prompt[:-2]))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    async with make_engine(prefix_cache=False) as engine:
        expected = await engine.complete(prompt, params)
        failing = engine.submit_many(prompt, params, 1, session)[0]
        fine = engine.submit(prompt, params)
        events = [event async for event in failing]
        other = [event async for event in fine]
        assert events[-1].finish_reason is FinishReason.ERROR
        assert "gone" in (events[-1].error or "")
        assert str(tmp_path) not in (events[-1].error or "")  # its name, never its path
        assert events[-1].error_param == "session"  # the request's own doing: the server's 400
        assert [t for e in other for t in e.token_ids] == expected.token_ids
        assert engine.healthy and (await engine.worker_stats()).cached_snapshots == 0
    assert not (tmp_path / "gone.safetensors").read_bytes().strip(b"\x00")  # never overwritten


@pytest.mark.anyio
async def test_a_session_deleted_before_its_restore_is_served_as_a_new_one(tmp_path: Path) -> None:
    """The file was there when the request was admitted (its token ids were read) and is gone
    by its restore: the request prefills its whole prompt, as for a new session, gets the same
    output, and saves the session anew."""
    from neuronpy.engine.types import FinishReason, SamplingParams, SessionRequest
    from neuronpy.worker.session_files import read_header
    from tests.factories import make_engine

    prompt = tokenizer().encode("The quick brown fox jumps over the lazy dog")
    path = tmp_path / "gone.safetensors"
    session = SessionRequest("gone", path, save=True, token_ids=tuple(prompt[:-2]))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    async with make_engine(prefix_cache=False) as engine:
        expected = await engine.complete(prompt, params)
        before = engine.stats()
        stream = engine.submit_many(prompt, params, 1, session)[0]
        events = [event async for event in stream]
        after = engine.stats()
        assert events[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert events[-1].error is None
        assert [t for e in events for t in e.token_ids] == expected.token_ids
        assert stream.cached_tokens == 0
        assert after.prefill_tokens - before.prefill_tokens == len(prompt)
        assert after.sessions_restored == before.sessions_restored
        assert after.sessions_saved == before.sessions_saved + 1
        assert engine.healthy and (await engine.worker_stats()).cached_snapshots == 0
    assert read_header(path).token_ids[: len(prompt)] == tuple(prompt)
