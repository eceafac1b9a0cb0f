"""What one client's constraint may cost the others: a compile is bounded in time and memory
and stopped when nobody waits for it; a matcher whose work grows with every token ends its
own row; what is recognizably such a grammar is refused before admission; /tokenize cannot
take the threads the requests' prompts are tokenized on."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import threading
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from neuronpy.engine.compile_child import CAN_FORK
from neuronpy.engine.grammar import GrammarError, Grammars, Matcher
from neuronpy.engine.types import Constraint, FinishReason, SamplingParams
from neuronpy.errors import InvalidRequestError
from tests.factories import make_engine, tokenizer
from tests.servers import fixture_model, run_server

needs_fork = pytest.mark.skipif(not CAN_FORK, reason="compiles are bounded in a forked child")


# n optional characters in a row: small text, compile cost far beyond it (on the tiny
# fixture's 360-token vocabulary 400 take 0.5 s in-process, 1500 pass 1 GiB within 15 s)
def optional_run(n: int) -> Constraint:
    return Constraint("grammar", "root ::= " + " ".join(["[a-z]?"] * n), param="guided_grammar")


def grammars(**bounds: Any) -> Grammars:
    tok = tokenizer()
    return Grammars(tok, len(tok), [tok.eos_token_id], **bounds)


def children() -> set[int]:
    """This process's live child processes (Linux)."""
    mine, found = str(os.getpid()), set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == mine and fields[0] != "Z":
                found.add(int(entry.name))
    return found


# ---- refused before admission -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("regex", "why"),
    [
        ("(a*)*b", "may be empty"),
        ("(a?b*)+c", "may be empty"),
        ("((x|y)*)*", "may be empty"),
        ("(a|)*", "may be empty"),
        ("(a+)+b", "itself an unbounded repetition"),
        ("x((?:[0-9]+))*", "itself an unbounded repetition"),
    ],
)
def test_unbounded_repetition_of_what_may_be_empty_is_refused(regex: str, why: str) -> None:
    """The classic nested quantifiers: the same language as the inner repetition alone, and a
    matcher whose work per token grows with every token (on the default model's vocabulary
    (a*)* takes 500 ms a token by the hundredth). Refused by name, as a regex and as a JSON
    Schema's pattern; nothing is compiled."""
    g = grammars()
    with pytest.raises(InvalidRequestError, match=why) as refused:
        g.compile(Constraint("regex", regex, param="guided_regex"))
    assert refused.value.param == "guided_regex"
    schema = f'{{"type": "string", "pattern": "{regex}"}}'
    with pytest.raises(InvalidRequestError, match=why):
        g.compile(Constraint("json_schema", schema, param="response_format.json_schema.schema"))
    assert g.compiled == 0


@pytest.mark.parametrize("regex", [r"(\d+,)*\d+", "(ab)*", r"^(\d{3}-)?\d{4}$", "(a|b+)*c"])
def test_repetition_that_is_not_redundant_compiles(regex: str) -> None:
    grammars().compile(Constraint("regex", regex))


def test_choices_are_held_to_the_text_limit_together() -> None:
    """Each choice may be 1 KiB, but all of them together no more than a schema's text."""
    Constraint("choice", choices=tuple("x" * 1024 for _ in range(64)))
    with pytest.raises(InvalidRequestError, match="characters of choices together"):
        Constraint("choice", choices=tuple("x" * 1024 for _ in range(65)), param="guided_choice")


# ---- the compile's bounds -----------------------------------------------------------------------


@needs_fork
def test_a_compile_past_its_time_bound_is_a_400_naming_it_and_leaves_no_process() -> None:
    before = children()
    with pytest.raises(InvalidRequestError, match=r"longer than 0\.5 s") as refused:
        grammars(compile_seconds=0.5).compile(optional_run(1500))
    assert "max_compile_seconds = 0.5" in str(refused.value)
    assert refused.value.param == "guided_grammar"
    assert children() == before


@needs_fork
def test_a_compile_past_its_memory_bound_is_a_400_naming_it() -> None:
    before = children()
    with pytest.raises(InvalidRequestError, match="more than 64 MiB of memory") as refused:
        grammars(compile_seconds=120, compile_bytes=64 << 20).compile(optional_run(4000))
    assert f"max_compile_bytes = {64 << 20}" in str(refused.value)
    assert children() == before


@needs_fork
def test_the_memory_bound_counts_the_free_heap_the_compile_reuses() -> None:
    """A server's heap, fragmented by its requests, holds memory malloc has freed but not
    handed back: 400 MB here. The child may not reuse it unseen; its bound is what it adds."""
    kept, freed = [], []
    for _ in range(4000):
        freed.append(bytearray(100_000))  # (malloc's heap, not mmap: below its threshold)
        kept.append(bytearray(1000))  # (one kept between each two: the heap cannot shrink)
    del freed
    with pytest.raises(InvalidRequestError, match="more than 64 MiB of memory"):
        grammars(compile_seconds=120, compile_bytes=64 << 20).compile(optional_run(4000))
    ordinary = Constraint("regex", "[0-9]{2}-[a-z]+")
    grammars(compile_seconds=120, compile_bytes=64 << 20).compile(ordinary)
    del kept


def test_a_grammar_compiled_in_its_child_matches_as_one_compiled_here() -> None:
    """What comes back from the child process is the grammar (no bounds: compiled here)."""
    constraint = Constraint("regex", "[0-9]{2}-[a-z]+")
    tok = tokenizer()
    ids = tok.encode("12-ab", add_special_tokens=False)
    for g in (grammars(), grammars(compile_seconds=0)):
        matcher = g.matcher(constraint)
        for token in ids:
            assert matcher.allows(token)
            matcher.accept(token)
        assert not matcher.allows(tok.encode("7", add_special_tokens=False)[-1])


@needs_fork
@pytest.mark.anyio
async def test_a_compile_nobody_waits_for_any_more_is_stopped() -> None:
    """Two requests wait for one compile; when the first gives up the compile goes on for the
    other; when the second does too, its child process is killed (within its 600 s and 8 GiB
    bounds it would run for minutes)."""
    ids = tokenizer().encode("Hello")
    params = SamplingParams(max_tokens=2, constraint=optional_run(1500))
    before = children()
    async with make_engine(max_compile_seconds=600, max_compile_bytes="8GiB") as engine:
        async with anyio.create_task_group() as tg:
            first, second = anyio.CancelScope(), anyio.CancelScope()

            async def wait(scope: anyio.CancelScope) -> None:
                with scope:
                    await engine.prepare(ids, params)

            tg.start_soon(wait, first)
            tg.start_soon(wait, second)
            with anyio.fail_after(60):  # guards against a hang, not a measure of speed
                while len(children() - before) != 1:
                    await anyio.sleep(0.02)
                first.cancel()
                await anyio.sleep(0.2)
                assert len(children() - before) == 1 and len(engine.compiles.pending) == 1
                second.cancel()
                while engine.compiles.pending or children() - before:
                    await anyio.sleep(0.02)
        assert not engine.grammars.cached(params.constraint)
        assert engine.healthy


# ---- the matcher's bound at run time ------------------------------------------------------------


def test_a_matcher_over_its_token_bound_twice_in_a_row_stops() -> None:
    """Its next mask is a GrammarError naming the bound; under no bound it never stops."""
    tok = tokenizer()
    compiled = grammars().compile(Constraint("regex", "[a-z]*"))
    a = tok.encode("a", add_special_tokens=False)[-1]
    logits = __import__("torch").zeros(len(tok))
    unbounded, bounded = Matcher(compiled, len(tok)), Matcher(compiled, len(tok), 0.0)
    for _ in range(5):
        unbounded.mask(logits.clone())
        unbounded.accept(a)
    bounded.mask(logits.clone())
    bounded.accept(a)
    bounded.mask(logits.clone())  # one token over the bound: it goes on
    bounded.accept(a)
    assert not bounded.allows(a)
    with pytest.raises(GrammarError, match="max_mask_ms"):
        bounded.mask(logits.clone())


@pytest.mark.anyio
async def test_a_row_whose_constraint_grows_with_every_token_ends_alone() -> None:
    """A grammar whose matcher's work grows with each token (nested unbounded repetition,
    here through a rule no regex check sees) ends its own request with finish_reason error
    once past max_mask_ms; the request beside it runs to its end, and the engine goes on."""
    tok = tokenizer()
    a = tok.encode("a", add_special_tokens=False)[-1]
    growing = Constraint("grammar", 'root ::= x "b"\nx ::= ("a" | x x)*', param="guided_grammar")
    slow = SamplingParams(
        max_tokens=400, temperature=0.0, constraint=growing, logit_bias=((a, 100.0),)
    )
    plain = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ids = tok.encode("Hello")
    async with make_engine(max_in_flight=4, max_mask_ms=0.1) as engine:
        await engine.prepare(ids, slow)
        events: dict[str, list[Any]] = {"slow": [], "plain": []}

        async def run(name: str, params: SamplingParams) -> None:
            async for event in engine.generate(ids, params):
                events[name].append(event)

        with anyio.fail_after(300):  # guards against a hang, not a measure of speed
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "slow", slow)
                tg.start_soon(run, "plain", plain)
        last = events["slow"][-1]
        assert last.finish_reason is FinishReason.ERROR
        assert "max_mask_ms" in (last.error or "")
        assert sum(len(e.token_ids) for e in events["slow"]) < 400
        assert events["plain"][-1].finish_reason is FinishReason.LENGTH
        assert sum(len(e.token_ids) for e in events["plain"]) == 30
        # (no constrained request beside: at 0.1 ms a busy machine could stop an ordinary one)
        out = await engine.complete(ids, dataclasses.replace(plain, max_tokens=5))
        assert len(out.token_ids) == 5 and engine.healthy


# ---- over HTTP ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Any:
    with run_server(fixture_model(max_in_flight=4, max_mask_ms=0.1)) as running:
        yield running


def test_a_redundant_nested_repetition_is_a_400_over_http(server: Any) -> None:
    body = {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 4, "guided_regex": "(a*)*b"}
    reply = httpx.post(f"{server.v1}/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "guided_regex" and "may be empty" in error["message"]


def test_tokenize_calls_cannot_take_the_threads_prompts_are_tokenized_on(server: Any) -> None:
    """More blocked /tokenize calls than anyio has worker threads: at most TOKENIZE_THREADS
    run, the rest wait for them, and a completion (whose prompt is tokenized on that pool)
    is answered meanwhile."""
    from neuronpy.server.models import TOKENIZE_THREADS

    engine = server.state.models["tiny-llama"].engine
    release = threading.Event()
    real = engine.tokenizer.encode

    def encode(text: str, *args: Any, **kwargs: Any) -> Any:
        if "HOLD" in text:
            release.wait(120)
        return real(text, *args, **kwargs)

    engine.tokenizer.encode = encode
    body = {"model": "tiny-llama", "prompt": "HOLD"}
    try:
        with concurrent.futures.ThreadPoolExecutor(48) as pool:
            held = [
                pool.submit(httpx.post, f"{server.url}/tokenize", json=body, timeout=180)
                for _ in range(45)
            ]
            for _ in range(3000):  # (a guard against a hang: at most 5 minutes)
                limiter = server.state._tokenize_threads  # (made by the first call)
                if limiter is not None and limiter.statistics().tasks_waiting == 45 - 4:
                    break
                release.wait(0.1)
            assert limiter is not None and limiter.borrowed_tokens == TOKENIZE_THREADS == 4
            body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 3}
            reply = httpx.post(f"{server.v1}/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            release.set()
            assert all(f.result().status_code == 200 for f in held)
    finally:
        release.set()
        del engine.tokenizer.encode


def test_a_row_its_constraint_stops_is_a_400_naming_the_constraint(server: Any) -> None:
    """Stopped by max_mask_ms (the request's own constraint, as a compile past its bounds
    is): whole, a 400 naming the field; streamed, that error as the stream's last chunk."""
    a = tokenizer().encode("a", add_special_tokens=False)[-1]
    body = {
        "model": "tiny-llama",
        "prompt": "Hi",
        "max_tokens": 400,
        "temperature": 0,
        "logit_bias": {str(a): 100},
        "guided_grammar": 'root ::= x "b"\nx ::= ("a" | x x)*',
    }
    reply = httpx.post(f"{server.v1}/completions", json=body, timeout=300)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "guided_grammar" and "max_mask_ms" in error["message"]
    assert error["type"] == "invalid_request_error"
    chunks = []
    with httpx.stream(
        "POST", f"{server.v1}/completions", json={**body, "stream": True}, timeout=300
    ) as streamed:
        assert streamed.status_code == 200
        for line in streamed.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    assert "error" in chunks[-1], chunks[-1]  # the stream's last word: no stop, no length
    assert chunks[-1]["error"]["param"] == "guided_grammar"
    assert chunks[-1]["error"]["type"] == "invalid_request_error"
    assert not any(c["choices"][0]["finish_reason"] for c in chunks if c.get("choices"))
