"""Speculative decoding: prompt lookup and the draft length (pure), and the engine's parity:
greedy output with speculation on is what it is with speculation off, alone and in a batch
with mid-flight joins; sampled output follows the target's distribution and is reproducible."""

from __future__ import annotations

import dataclasses
import math
import random

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neuronpy.engine.drafting.ngram import NgramDrafter
from neuronpy.engine.sampling import Sampler, verify_rows
from neuronpy.engine.speculative import DraftLength
from neuronpy.engine.types import Completion, FinishReason, SamplingParams
from tests.factories import hf_model, make_engine, tokenizer

# prompts whose greedy replies on the tiny fixtures repeat themselves (prompt lookup drafts
# and some drafts stand) and others that do not (every draft rejected)
PROMPTS = (
    "the cat sat on the mat and the cat sat on the mat",
    "one two three four one two three four one two",
    "hello",
    "a b c a b c a b c",
    "zebra quartz",
)


def encode(text: str, name: str = "tiny-llama") -> list[int]:
    return tokenizer(name).encode(text)


def greedy(max_tokens: int = 48, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


# ---- prompt lookup ---------------------------------------------------------------------------


def brute_force(tokens: list[int], k: int, sizes: range) -> tuple[int, ...]:
    for n in sizes:
        if n > len(tokens):
            continue
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start : start + n] == suffix:
                return tuple(tokens[start + n : start + n + k])
    return ()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=0, max_size=40),
    st.lists(st.integers(0, 5), min_size=0, max_size=20),
    st.integers(1, 6),
)
def test_prompt_lookup_proposes_the_latest_match_of_the_longest_suffix(
    prompt: list[int], output: list[int], k: int
) -> None:
    drafter = NgramDrafter(prompt, 1, 3)
    for token in output:  # token by token, as a reply grows
        drafter.extend([token])
    tokens = prompt + output
    assert drafter.propose(k) == brute_force(tokens, k, range(3, 0, -1))


def test_prompt_lookup_examples() -> None:
    drafter = NgramDrafter([1, 2, 3, 4, 9, 1, 2], 2, 3)
    assert drafter.propose(3) == (3, 4, 9)  # "1 2" was followed by 3 4 9
    drafter.extend([7])
    assert drafter.propose(3) == ()  # "2 7" and "7" never came before (n >= 2)
    assert NgramDrafter([5, 5, 5], 2, 2).propose(4) == (5,)


def test_draft_length_follows_the_acceptance_rate() -> None:
    length = DraftLength(6)
    assert length.next(room=10) == 6  # nothing measured: the most
    assert length.next(room=2) == 2  # never past max_tokens
    for _ in range(20):
        length.observe(drafted=4, accepted=0)
    lengths = [length.next(room=10) for _ in range(16)]
    assert lengths.count(0) == 14 and lengths.count(1) == 2  # probes now and then
    for _ in range(20):
        length.observe(drafted=4, accepted=4)
    assert length.next(room=10) == 6


# ---- the rejection rule -----------------------------------------------------------------------


def chi_square_p(counts: list[int], probs: list[float]) -> float:
    """The p-value of a chi-square goodness-of-fit test (Wilson-Hilferty approximation)."""
    total = sum(counts)
    stat = sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))
    dof = len(counts) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def fixture_logits() -> torch.Tensor:
    """The tiny fixture's next-token logits after a short prompt, sharpened to a handful of
    likely tokens (so that a few thousand draws test every one of them)."""
    with torch.no_grad():
        logits = hf_model("tiny-llama")(torch.tensor([encode("the cat sat")])).logits[0, -1]
    return logits * 40.0


@pytest.mark.parametrize("draft_rank", [0, 1, 5])
def test_verified_tokens_follow_the_target_distribution(draft_rank: int) -> None:
    """Whatever token prompt lookup drafts (the likeliest, the second, an unlikely one), the
    token a verify step emits there is distributed as the target's sampler draws it."""
    logits = fixture_logits()
    params = SamplingParams(temperature=0.8, top_k=6, max_tokens=8, seed=1)
    probs = Sampler(params, [1], logits.shape[0]).probs(logits)
    assert logits.shape[0] == 360
    draft = int(torch.argsort(probs, descending=True)[draft_rank])
    support = [int(t) for t in torch.nonzero(probs).squeeze(1)]
    counts = dict.fromkeys(support, 0)
    for seed in range(4000):
        sampler = Sampler(SamplingParams(temperature=0.8, top_k=6, seed=seed), [1], 360)
        (emitted,) = verify_rows([sampler], torch.stack([logits, logits]), [(draft,)])
        assert emitted is not None and 1 <= len(emitted) <= 2
        counts[emitted[0]] += 1
    p_value = chi_square_p([counts[t] for t in support], [float(probs[t]) for t in support])
    assert p_value > 1e-3, (counts, probs[support])


def test_greedy_verification_takes_the_longest_agreeing_prefix() -> None:
    logits = torch.full((4, 32), -5.0)
    for row, best in enumerate((7, 8, 9, 10)):
        logits[row, best] = 5.0
    sampler = Sampler(greedy(), [1], 32)
    assert verify_rows([sampler], logits, [(7, 8, 3)]) == [(7, 8, 9)]
    sampler = Sampler(greedy(), [1], 32)
    assert verify_rows([sampler], logits, [(7, 8, 9)]) == [(7, 8, 9, 10)]
    sampler = Sampler(greedy(), [1], 32)
    assert verify_rows([sampler], logits[:2], [(1,)]) == [(7,)]
    assert sampler.output_ids == [7]  # what it emitted, nothing it rejected


def test_a_row_failing_in_verification_leaves_the_others_logprobs_whole() -> None:
    """Rows asking for log-probabilities beside a row whose sampler raises mid-verification
    (it asked too): the failed row gets none, the others one per emitted token, each from
    its own logits row."""
    logits = torch.full((7, 32), -5.0)
    for row, best in enumerate((7, 8, 9, 1, 1, 1, 2)):
        logits[row, best] = 5.0
    good, after = Sampler(greedy(logprobs=1), [1], 32), Sampler(greedy(logprobs=1), [1], 32)
    # not plain greedy (a penalty): its drafts go through Sampler.verify, the second raises
    bad = Sampler(greedy(logprobs=1, repetition_penalty=1.5), [1], 32)
    real, calls = bad.verify, []

    def broken(row: torch.Tensor, draft: int) -> int:
        calls.append(draft)
        if len(calls) == 2:
            raise RuntimeError("a bad row")
        return real(row, draft)

    bad.verify = broken  # type: ignore[method-assign]
    errors: dict[int, Exception] = {}
    out = verify_rows([good, bad, after], logits, [(7, 8), (1, 1), ()], errors)
    assert out == [(7, 8, 9), None, (2,)] and set(errors) == {1} and len(calls) == 2
    assert [lp.token_id for lp in good.take_logprobs()] == [7, 8, 9]
    assert bad.take_logprobs() == []
    (last,) = after.take_logprobs()
    expected = torch.log_softmax(logits[6], dim=-1)[2]
    assert last.token_id == 2 and last.logprob == pytest.approx(float(expected))


# ---- the engine -------------------------------------------------------------------------------


async def run(
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    name: str = "tiny-llama",
    together: bool = True,
    **config: object,
) -> tuple[list[Completion], object]:
    """The prompts' completions, submitted one after another a few steps apart (mid-flight
    joins) or one at a time; and the engine's stats."""
    async with make_engine(name, max_in_flight=4, **config) as engine:
        out: list[Completion | None] = [None] * len(prompts)
        if together:
            async with anyio.create_task_group() as tg:
                for i, ids in enumerate(prompts):

                    async def one(i: int = i, ids: list[int] = ids) -> None:
                        out[i] = await engine.complete(ids, params)

                    tg.start_soon(one)
                    await anyio.sleep(0.02)
        else:
            for i, ids in enumerate(prompts):
                out[i] = await engine.complete(ids, params)
        return out, engine.stats()  # type: ignore[return-value]


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-gpt-oss"])
async def test_parity_greedy_ngram_equals_no_speculation(name: str) -> None:
    prompts = [encode(p, name) for p in PROMPTS]
    want, _ = await run(prompts, greedy(), name=name, together=False)
    for together in (False, True):
        got, stats = await run(
            prompts,
            greedy(),
            name=name,
            together=together,
            speculative="ngram",
            prompt_lookup_min=1,
        )
        for a, b in zip(got, want, strict=True):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            assert a.completion_tokens == b.completion_tokens
        assert stats.spec_accepted_tokens > 0  # drafts stood
        assert stats.spec_draft_tokens > stats.spec_accepted_tokens  # and drafts were rejected
        assert stats.decode_steps < sum(len(c.token_ids) for c in want)
        if together:  # rows joined while others verified (their prompts riding the steps)
            assert stats.max_batch_size >= 3 and stats.riding_chunks >= 1, stats


@pytest.mark.anyio
async def test_drafts_never_run_past_max_tokens_or_a_stop_token() -> None:
    prompts = [encode(p) for p in PROMPTS]
    for max_tokens in (1, 2, 3, 7):
        want, _ = await run(prompts, greedy(max_tokens))
        got, _ = await run(prompts, greedy(max_tokens), speculative="ngram", prompt_lookup_min=1)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        assert all(len(c.token_ids) <= max_tokens for c in got)
    # a stop token the replies write: a draft of it ends the drafts, and the reply there
    free, _ = await run(prompts, greedy(40))
    stop = free[0].token_ids[6]
    want, _ = await run(prompts, greedy(40, stop_token_ids=(stop,)))
    got, _ = await run(
        prompts, greedy(40, stop_token_ids=(stop,)), speculative="ngram", prompt_lookup_min=1
    )
    assert [(c.token_ids, c.finish_reason) for c in got] == [
        (c.token_ids, c.finish_reason) for c in want
    ]
    assert got[0].finish_reason is FinishReason.STOP


@pytest.mark.anyio
async def test_stop_strings_logprobs_and_n_with_speculation() -> None:
    prompts = [encode(p) for p in PROMPTS[:3]]
    free, _ = await run(prompts, greedy(30))
    stop = free[1].text[len(free[1].text) // 2 :][:3]
    params = greedy(30, stop=(stop,), logprobs=2)
    want, _ = await run(prompts, params)
    got, stats = await run(prompts, params, speculative="ngram", prompt_lookup_min=1)
    assert stats.spec_draft_tokens > 0
    for a, b in zip(got, want, strict=True):
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
        assert [lp.token_id for lp in a.logprobs] == a.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
    async with make_engine(speculative="ngram", prompt_lookup_min=1) as engine:
        streams = engine.submit_many(prompts[0], greedy(30), 3)
        texts = []
        for stream in streams:
            texts.append("".join([e.text async for e in stream]))
        assert texts == [free[0].text] * 3


@pytest.mark.anyio
async def test_sampled_output_is_reproducible_with_a_seed() -> None:
    prompts = [encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=11)
    first, stats = await run(prompts, params, speculative="ngram", prompt_lookup_min=1)
    again, _ = await run(prompts, params, together=False, speculative="ngram", prompt_lookup_min=1)
    assert stats.spec_draft_tokens > 0
    assert [c.token_ids for c in first] == [c.token_ids for c in again]


@pytest.mark.anyio
async def test_a_request_may_turn_speculation_on_or_off() -> None:
    prompts = [encode(p) for p in PROMPTS[:2]]
    _, on = await run(prompts, greedy(30, speculative="ngram"), prompt_lookup_min=1)
    _, off = await run(
        prompts, greedy(30, speculative="off"), speculative="ngram", prompt_lookup_min=1
    )
    assert on.spec_draft_tokens > 0 and off.spec_draft_tokens == 0


def joint_probs(prompt: list[int], params: SamplingParams) -> dict[tuple[int, int], float]:
    """The target's p(t0) p(t1 | t0) for every pair its sampler can draw after `prompt`
    (transformers' forward, this project's sampler's truncation)."""
    model = hf_model("tiny-llama")

    def next_probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        return Sampler(params, ids, logits.shape[0]).probs(logits)

    first = next_probs(prompt)
    cells = {}
    for t0 in torch.nonzero(first).squeeze(1).tolist():
        second = next_probs([*prompt, t0])
        for t1 in torch.nonzero(second).squeeze(1).tolist():
            cells[(t0, t1)] = float(first[t0] * second[t1])
    return cells


def seeded_draws(
    prompt: list[int], params: SamplingParams, n: int, **config: object
) -> tuple[list[tuple[int, ...]], object]:
    """n completions of `prompt` seeded 0..n-1, eight at a time, on a speculating engine;
    and its stats."""

    async def draws() -> tuple[list[tuple[int, ...]], object]:
        async with make_engine(max_in_flight=8, **config) as engine:  # type: ignore[arg-type]
            out = []
            for seed in range(0, n, 8):
                batch = [
                    engine.submit(prompt, SamplingParams(**{**vars(params), "seed": s}))
                    for s in range(seed, seed + 8)
                ]
                for stream in batch:
                    ids: list[int] = []
                    async for event in stream:
                        ids.extend(event.token_ids)
                    out.append(tuple(ids))
            return out, engine.stats()

    return anyio.run(draws)


def test_sampled_engine_tokens_follow_the_target_distribution() -> None:
    """End to end: seeded sampled requests whose second token is verified against drafts
    (the prompt holds every token id once, so prompt lookup always finds the first) get
    their two tokens with the target's joint distribution p(t0) p(t1 | t0), the model's own."""
    prompt = list(range(3, 360))
    random.Random(5).shuffle(prompt)
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    cells = joint_probs(prompt, params)
    results, stats = seeded_draws(prompt, params, 720, speculative="ngram", prompt_lookup_min=1)
    # (prompt lookup's drafts here are the prompt's next ids: the rejection path; a draft
    # model drafting its own distribution takes the other, below)
    assert stats.spec_draft_tokens > 100  # type: ignore[attr-defined]
    counts = [sum(r[:2] == cell for r in results) for cell in cells]
    assert sum(counts) == len(results)  # no pair outside the support
    assert chi_square_p(counts, list(cells.values())) > 1e-3, (counts, cells)


# ---- a draft model ----------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("draft", ["tiny-llama", "tiny-mistral"])
async def test_parity_greedy_draft_model_equals_no_speculation(draft: str) -> None:
    """A draft model drafting for the target: itself (every draft stands) or another tiny
    model of the same tokenizer (most are rejected): greedy output is unchanged, alone and in
    a batch with mid-flight joins."""
    prompts = [encode(p) for p in PROMPTS]
    want, _ = await run(prompts, greedy(), together=False)
    for together in (False, True):
        got, stats = await run(
            prompts, greedy(), together=together, draft=draft, speculative="draft"
        )
        for a, b in zip(got, want, strict=True):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert stats.spec_draft_tokens > 0 and stats.timing["draft"] > 0
        if draft == "tiny-llama":
            assert stats.spec_accepted_tokens == stats.spec_draft_tokens  # its own drafts
            assert stats.decode_steps * 3 < sum(len(c.token_ids) for c in want)
        else:
            assert stats.spec_accepted_tokens < stats.spec_draft_tokens


def test_sampled_draft_model_tokens_follow_the_target_distribution() -> None:
    """A draft model sampling its own distribution (here the target's: every draft stands,
    min(1, p/q) = 1) leaves the output distributed as the target's: p(t0) p(t1 | t0) p(t2 |
    t0, t1), checked on (t0, t1) and reproducible with a seed."""
    prompt = encode("the cat sat")
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=3, ignore_eos=True)
    cells = joint_probs(prompt, params)
    config = {"draft": "tiny-llama", "speculative": "draft"}
    results, stats = seeded_draws(prompt, params, 720, **config)
    assert stats.spec_draft_tokens > 500  # type: ignore[attr-defined]
    assert stats.spec_accepted_tokens > 0.9 * stats.spec_draft_tokens  # type: ignore[attr-defined]
    counts = [sum(r[:2] == cell for r in results) for cell in cells]
    assert sum(counts) == len(results)
    assert chi_square_p(counts, list(cells.values())) > 1e-3, (counts, cells)
    again, _ = seeded_draws(prompt, params, 40, **config)
    assert again == results[:40]  # the same seeds, the same tokens


@pytest.mark.anyio
async def test_every_job_a_drafting_engine_sends_its_worker_is_plain_data() -> None:
    """The worker runs no code of the engine: every job, sampled draft-model drafts and the
    prompts' first tokens included, is plain data (it pickles, as a tensor-parallel group
    sends it to its other ranks), and the engine samples from the logits the jobs answer."""
    import pickle

    from neuronpy.worker.jobs import DraftTokens

    prompts = [encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    async with make_engine(max_in_flight=4, draft="tiny-llama", speculative="draft") as engine:
        worker = engine._runner.worker
        submit, jobs = worker.submit, []

        def recorded(job: object) -> object:
            jobs.append(job)
            return submit(job)

        worker.submit = recorded  # type: ignore[method-assign]
        streams = [s for ids in prompts for s in engine.submit_many(ids, params, 2)]
        for stream in streams:  # (n = 2: one prefill, its snapshot cloned, two first tokens)
            events = [event async for event in stream]
            assert events[-1].finish_reason is FinishReason.LENGTH
        stats = engine.stats()
    for job in jobs:
        pickle.loads(pickle.dumps(job))
    drafted = [job for job in jobs if isinstance(job, DraftTokens)]
    assert any(sampling is not None for job in drafted for sampling in job.sampling)
    assert stats.spec_draft_tokens > 0  # type: ignore[attr-defined]


# ---- everything else keeps working --------------------------------------------------------


@pytest.mark.anyio
async def test_preemption_and_the_prefix_cache_with_speculation() -> None:
    """Rows preempted to keep within a small KV budget (their KV extracted after verify
    steps, resumed later) and prompts restored from the prefix cache: unchanged output."""
    prompts = [encode(p) for p in PROMPTS] + [encode(PROMPTS[0])] * 2
    config = {"kv_budget": 80 * make_engine().kv_bytes_per_token, "prefix_cache": True}
    want, _ = await run(prompts, greedy(40), together=False)
    got, stats = await run(prompts, greedy(40), speculative="ngram", prompt_lookup_min=1, **config)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0 and stats.spec_accepted_tokens > 0


@pytest.mark.anyio
async def test_structured_output_with_speculation_is_unchanged() -> None:
    """A constrained greedy reply: drafts the grammar refuses are cut before verification;
    the reply is what it is without speculation, and valid."""
    from neuronpy.engine.types import Constraint

    constraint = Constraint("regex", r"(ab|cd){2,6}[0-9]{3}")
    prompts = [encode(p) for p in PROMPTS[:3]]
    params = greedy(30, constraint=constraint)
    async with make_engine() as engine:
        await engine.prepare(prompts[0], params)
    want, _ = await run(prompts, params, together=False)
    got, stats = await run(prompts, params, speculative="ngram", prompt_lookup_min=1)
    assert [c.text for c in got] == [c.text for c in want]
    assert stats.spec_draft_tokens > 0
    import re

    assert all(re.fullmatch(r"(ab|cd){2,6}[0-9]{3}", c.text) for c in got)


def ask_all(ask: object, url: str, streamed: int) -> list[str]:
    """Every prompt of PROMPTS at once, from four threads: `ask(url, text, stream)`, every
    other one streamed (those of index parity `streamed`)."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        jobs = [
            pool.submit(ask, url, t, i % 2 == streamed)  # type: ignore[arg-type]
            for i, t in enumerate(PROMPTS)
        ]
        return [j.result() for j in jobs]


def test_server_speculation_parity_metrics_and_bad_values() -> None:
    """A real server, the openai client: replies with prompt lookup on are those of a server
    without it, streamed or not; /metrics and /stats count drafts; a request may turn it off;
    a bad value is a 400 naming the field, and the server serves on."""
    import httpx
    import openai

    from tests.servers import fixture_model, run_server

    def ask(url: str, text: str, stream: bool, **extra: object) -> str:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        kwargs = dict(model="tiny-llama", prompt=text, max_tokens=30, temperature=0.0)
        if not stream:
            return api.completions.create(**kwargs, extra_body=extra).choices[0].text
        chunks = api.completions.create(**kwargs, stream=True, extra_body=extra)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    def all_of(url: str) -> list[str]:
        return ask_all(ask, url, streamed=1)

    with run_server(fixture_model()) as plain:
        want = all_of(plain.url)
    with run_server(fixture_model(speculative="ngram", prompt_lookup_min=1)) as server:
        assert all_of(server.url) == want
        stats = server.stats()
        assert stats["speculative"] == "ngram" and stats["spec_draft_tokens"] > 0
        assert 0 < stats["spec_acceptance_rate"] < 1 and stats["spec_tokens_per_row_step"] > 1
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'neuronpy_spec_decode_draft_tokens_total{model="tiny-llama"}' in metrics
        assert "neuronpy_spec_decode_acceptance_rate" in metrics
        assert "neuronpy_spec_decode_tokens_per_row_step" in metrics
        drafted = stats["spec_draft_tokens"]
        assert ask(server.url, PROMPTS[0], False, speculative="off") == want[0]
        assert server.stats()["spec_draft_tokens"] == drafted  # that request drafted nothing
        for bad in ("turbo", "draft"):  # unknown; a model without a draft model
            with pytest.raises(openai.BadRequestError) as err:
                ask(server.url, "hi", False, speculative=bad)
            assert err.value.body["param"] == "speculative"  # type: ignore[index]
        assert ask(server.url, PROMPTS[1], True) == want[1]
        # each reply's usage says what its own drafts did, as OpenAI's prediction tokens: the
        # server's counters move by exactly that; a reply that drafted nothing says nothing
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        kwargs = dict(model="tiny-llama", prompt=PROMPTS[0], max_tokens=30, temperature=0.0)
        for stream in (False, True):
            before = server.stats()
            if stream:
                chunks = list(
                    api.completions.create(
                        **kwargs, stream=True, stream_options={"include_usage": True}
                    )
                )
                used = chunks[-1].usage
            else:
                used = api.completions.create(**kwargs).usage
            after = server.stats()
            assert used is not None and used.completion_tokens_details is not None
            details = used.completion_tokens_details
            accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
            assert drafted > 0 and details.accepted_prediction_tokens == accepted
            assert details.rejected_prediction_tokens == drafted - accepted
        off = api.completions.create(**kwargs, extra_body={"speculative": "off"}).usage
        assert off is not None and off.completion_tokens_details is None
        # the Responses API takes it too
        body = {"model": "tiny-llama", "input": "hi", "max_output_tokens": 4}
        bad = httpx.post(f"{server.url}/v1/responses", json={**body, "speculative": "turbo"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative"
        good = httpx.post(f"{server.url}/v1/responses", json={**body, "speculative": "off"})
        assert good.status_code == 200, good.text


def test_a_session_saved_and_restored_with_speculation(tmp_path) -> None:
    """A session saved after verify steps holds the KV of exactly the tokens fed (rejected
    drafts' columns are not in it); restored after a restart, the second turn is what it is
    without speculation or sessions."""
    import httpx

    from neuronpy.server.prompts import render_chat
    from tests.servers import fixture_model, run_server
    from tests.test_sessions import FIRST, chat, second_turn

    with run_server(fixture_model(prefix_cache=False)) as plain:
        reply = chat(plain.url, FIRST).choices[0].message.content
        expected = chat(plain.url, second_turn(reply)).choices[0].message.content
    spec = {"speculative": "ngram", "prompt_lookup_min": 1}
    with run_server(fixture_model(**spec), sessions_dir=tmp_path) as server:
        saved = chat(server.url, FIRST, session="talk")
        info = server.stats()
        assert info["spec_draft_tokens"] > 0 and info["sessions_saved"] == 1
    assert saved.choices[0].message.content == reply
    prompt = render_chat(tokenizer(), FIRST)
    with run_server(fixture_model(**spec), sessions_dir=tmp_path) as restarted:
        stored = httpx.get(f"{restarted.url}/v1/sessions/talk", timeout=10).json()
        assert stored["tokens"] == len(prompt) + saved.usage.completion_tokens - 1
        got = chat(restarted.url, second_turn(reply), session="talk")
        assert restarted.stats()["sessions_restored"] == 1
    assert got.choices[0].message.content == expected


@pytest.mark.anyio
async def test_the_draft_models_kv_goes_when_nothing_runs() -> None:
    async with make_engine(draft="tiny-llama", speculative="draft") as engine:
        drafts = engine._worker.drafts
        assert drafts is not None
        first = await engine.complete(encode(PROMPTS[0]), greedy(20))
        with anyio.fail_after(10):
            while drafts.rows:
                await anyio.sleep(0.01)
        assert drafts.batch is None
        # and it drafts again for the next request
        again = await engine.complete(encode(PROMPTS[0]), greedy(20))
        assert again.token_ids == first.token_ids and engine.stats().spec_accepted_tokens > 0


def test_a_draft_engine_without_its_draft_model_is_refused() -> None:
    with pytest.raises(ValueError, match="draft model"):
        make_engine(speculative="draft", draft_model="elsewhere")


def test_server_with_a_draft_model_from_its_config(tmp_path) -> None:
    """A config file naming a draft model: the server loads it beside the model, greedy
    replies through the openai client are those of a server without it, streamed or not;
    a draft model of another vocabulary is refused at load, by name."""
    import openai

    from neuronpy.compose import load_engine
    from neuronpy.config import load_config
    from tests.factories import fixture_dir
    from tests.servers import fixture_model, run_server

    def ask(url: str, text: str, stream: bool) -> str:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": text}]
        kwargs = dict(model="tiny-llama", messages=messages, max_tokens=30, temperature=0.0)
        if not stream:
            return api.chat.completions.create(**kwargs).choices[0].message.content or ""
        chunks = api.chat.completions.create(**kwargs, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    def all_of(url: str) -> list[str]:
        return ask_all(ask, url, streamed=0)

    with run_server(fixture_model()) as plain:
        want = all_of(plain.url)
    config = tmp_path / "neuronpy.toml"
    config.write_text(
        f'[[models]]\nname = "tiny-llama"\npath = "{fixture_dir("tiny-llama")}"\n'
        f'speculative = "draft"\ndraft_model = "{fixture_dir("tiny-mistral")}"\n'
        'dtype = "float32"\n'  # as fixture_model's
    )
    (spec,) = load_config(config).models
    with run_server({"tiny-llama": lambda: load_engine("tiny-llama", spec)}) as server:
        assert all_of(server.url) == want
        stats = server.stats()
        assert stats["speculative"] == "draft" and stats["spec_draft_tokens"] > 0
    other = tmp_path / "other"
    other.mkdir()
    for f in fixture_dir("tiny-qwen3-tools").iterdir():  # another tokenizer
        (other / f.name).write_bytes(f.read_bytes())
    bad = load_config(config).models[0]
    bad = dataclasses.replace(bad, engine=dataclasses.replace(bad.engine, draft_model=str(other)))
    with pytest.raises(ValueError, match="draft model's tokenizer"):
        load_engine("tiny-llama", bad)


def test_a_steps_drafts_are_shared_out_within_its_budget() -> None:
    from neuronpy.engine.speculative import share_budget

    # greedy rows give up drafts, the longest first; a sampled row keeps its own
    assert share_budget([8, 8, 8, 8, 8, 2], [True] * 5 + [False], 20) == [3, 3, 4, 4, 4, 2]
    assert share_budget([8, 1], [True, True], 32) == [8, 1]  # within the budget: as they are
    assert share_budget([8, 8], [False, False], 4) == [8, 8]  # nothing greedy to cut
    assert sum(share_budget([5] * 10, [True] * 10, 32)) == 32


@pytest.mark.anyio
async def test_a_sampler_failing_in_a_verify_step_fails_its_request_alone() -> None:
    prompts = [encode(p) for p in PROMPTS[:3]]
    params = greedy(40, ignore_eos=True)
    alone, _ = await run(prompts, params, together=False)
    sampled = SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True)
    async with make_engine(max_in_flight=4, speculative="ngram", prompt_lookup_min=1) as engine:
        # the broken row samples (its drafts go through Sampler.verify); the others are greedy
        streams = [engine.submit(prompts[0], sampled)]
        streams += [engine.submit(p, params) for p in prompts[1:]]
        sampler = engine._runner.samplers[streams[0].id]
        real = sampler.verify
        calls = 0

        def flaky(logits: torch.Tensor, draft: int) -> int:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise RuntimeError("a bad row")
            return real(logits, draft)

        sampler.verify = flaky  # type: ignore[method-assign]
        got = []
        for stream in streams:
            got.append([e async for e in stream])
        assert calls >= 2
        assert got[0][-1].finish_reason is FinishReason.ERROR
        assert "sampling failed" in (got[0][-1].error or "")
        for i in (1, 2):
            assert [t for e in got[i] for t in e.token_ids] == alone[i].token_ids
        assert engine.healthy and engine.stats().spec_draft_tokens > 0
