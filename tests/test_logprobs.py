"""Log-probabilities, logit_bias and response_format's shape: the sampler, and the server
through the real openai client, checked against transformers' forward on the fixture."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import anyio
import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from neuronpy.engine import sampling
from neuronpy.engine.sampling import Sampler, sample_rows
from neuronpy.engine.types import Constraint, SamplingParams
from neuronpy.errors import InvalidRequestError
from neuronpy.server.logprobs import TokenTexts
from neuronpy.server.prompts import render_chat
from tests.factories import hf_model
from tests.servers import TINY_LLAMA, RunningServer, fixture_model, run_server

MODEL = "tiny-llama"
TOL = 2e-3  # our forward against transformers' (float32 rounding, ~1e-4 on these logits)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server(fixture_model(MODEL, max_in_flight=8, max_queue=64)) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(TINY_LLAMA)


@pytest.fixture(scope="module")
def id_of(tokenizer: Any) -> dict[bytes, int]:
    """Token ids from the bytes the server reports (each token's bytes are its own)."""
    texts = TokenTexts(tokenizer)
    table = {bytes(texts(i)[1]): i for i in range(len(tokenizer))}
    assert len(table) == len(tokenizer)
    return table


def api(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


def reference(prompt: Sequence[int], generated: Sequence[int]) -> torch.Tensor:
    """[len(generated), vocab]: transformers' log-softmax of the logits each token was drawn
    from (one forward over the prompt and the reply)."""
    ids = torch.tensor([[*prompt, *generated]])
    with torch.no_grad():
        logits = hf_model(MODEL)(ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


def check_against(ref: torch.Tensor, ids: Sequence[int], entries: Sequence[Any], n: int) -> None:
    """Each reported logprob and top list against the reference rows."""
    assert len(ids) == len(entries) == ref.shape[0]
    for row, token, (logprob, top) in zip(ref, ids, entries, strict=True):
        assert logprob == pytest.approx(float(row[token]), abs=TOL)
        values, best = torch.topk(row, n)
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=TOL)
        # ids may only differ where the reference has a near tie
        for (tid, _), bid, v in zip(top, best.tolist(), values.tolist(), strict=True):
            assert tid == bid or abs(float(row[tid]) - v) < TOL


# ---- the sampler --------------------------------------------------------------------------------


def test_sampler_reports_raw_logprobs_only_for_rows_that_asked() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 4
    asked = Sampler(SamplingParams(temperature=0.0, logprobs=4), [1], 50)
    sampled = Sampler(SamplingParams(temperature=2.0, seed=1, logprobs=0), [1], 50)
    silent = Sampler(SamplingParams(temperature=0.0), [1], 50)
    tokens = sample_rows([asked, sampled, silent], logits)
    raw = torch.log_softmax(logits, dim=-1)
    first = asked.take_logprob()
    assert first is not None and first.token_id == tokens[0] == int(raw[0].argmax())
    assert first.logprob == pytest.approx(float(raw[0].max()))
    assert [i for i, _ in first.top] == torch.topk(raw[0], 4).indices.tolist()
    assert asked.take_logprob() is None  # taken once
    second = sampled.take_logprob()
    assert second is not None and second.top == ()
    # raw: the temperature does not change the reported logprob
    assert second.logprob == pytest.approx(float(raw[1, tokens[1]]))
    assert silent.take_logprob() is None


def test_no_logprob_work_when_no_row_asks(monkeypatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("log_softmax ran for nobody")

    monkeypatch.setattr(sampling.torch, "log_softmax", forbidden)
    rows = [Sampler(SamplingParams(temperature=t, seed=3), [1], 20) for t in (0.0, 1.0)]
    sample_rows(rows, torch.randn(2, 20))


def test_logit_bias_comes_before_the_penalties() -> None:
    logits = torch.tensor([5.0, 4.0, 1.0, 0.0])
    # token 1 is seen (repetition penalty 2 halves its logit: 4 -> 2), biased by +2.5 first:
    # (4 + 2.5) / 2 = 3.25 < 5, so token 0 wins; biased after the penalty it would be 4.5
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias=((1, 2.5),))
    sampler = Sampler(params, [1], 4)
    assert not sampler.plain_greedy
    assert sampler.penalize(logits).tolist() == [5.0, 3.25, 1.0, 0.0]
    banned = Sampler(SamplingParams(temperature=0.0, logit_bias=((0, -100.0),)), [3], 4)
    assert sample_rows([banned], logits[None]) == [1]
    forced = Sampler(SamplingParams(temperature=0.7, seed=5, logit_bias=((3, 100.0),)), [3], 4)
    assert {forced.sample(logits) for _ in range(20)} == {3}


def test_allowed_token_ids_are_all_a_row_may_sample() -> None:
    logits = torch.tensor([5.0, 4.0, 1.0, 0.0, 3.0])
    greedy = Sampler(SamplingParams(temperature=0.0, allowed_token_ids=(2, 4)), [0], 5)
    assert not greedy.plain_greedy  # (the row's raw argmax is not its token)
    assert sample_rows([greedy], logits[None]) == [4]
    # in a batch, the other row's argmax is its own; a logit_bias cannot lift a banned id
    plain = Sampler(SamplingParams(temperature=0.0), [0], 5)
    biased = SamplingParams(temperature=0.0, allowed_token_ids=(2, 3), logit_bias=((0, 100.0),))
    rows = [plain, Sampler(biased, [0], 5)]
    assert sample_rows(rows, torch.stack([logits, logits])) == [0, 2]
    drawn = {
        Sampler(
            SamplingParams(temperature=2.0, seed=seed, allowed_token_ids=(1, 3)), [0], 5
        ).sample(logits)
        for seed in range(60)
    }
    assert drawn == {1, 3}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"allowed_token_ids": ()},
        {"allowed_token_ids": (-1,)},
        {"allowed_token_ids": (True,)},
        {"allowed_token_ids": (1,), "constraint": Constraint("json_object")},
    ],
)
def test_allowed_token_ids_are_checked(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**kwargs)
    assert caught.value.param == "allowed_token_ids"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"logprobs": 21},
        {"logprobs": -1},
        {"logprobs": True},
        {"logit_bias": ((1, 100.5),)},
        {"logit_bias": ((1, float("nan")),)},
        {"logit_bias": ((-1, 1.0),)},
        {"logit_bias": ((1, 1.0), (1, 2.0))},
        {"logit_bias": tuple((i, 1.0) for i in range(1025))},
    ],
)
def test_sampling_params_validate_logprobs_and_logit_bias(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**kwargs)
    assert caught.value.param == next(iter(kwargs))


# ---- the server ---------------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "The quick brown fox"}]


@pytest.mark.anyio
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
async def test_chat_logprobs_match_the_reference_forward(server, tokenizer, id_of, sampled) -> None:
    """The chosen tokens' logprobs and the top 5 equal a log-softmax of transformers' logits,
    also when sampling at a high temperature (the logprobs are the model's raw ones)."""
    how = {"temperature": 2.0, "seed": 11} if sampled else {"temperature": 0.0}
    async with api(server) as client:
        out = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=12,
            logprobs=True,
            top_logprobs=5,
            extra_body={"ignore_eos": True},
            **how,
        )
    choice = out.choices[0]
    content = choice.logprobs.content
    ids = [id_of[bytes(e.bytes)] for e in content]
    assert len(ids) == out.usage.completion_tokens == 12
    assert tokenizer.decode(ids, skip_special_tokens=True) == choice.message.content
    if not sampled:
        assert all(e.token == e.top_logprobs[0].token for e in content)  # greedy: the top one
    for e in content:
        assert e.token == bytes(e.bytes).decode("utf-8", "replace")
        assert len(e.top_logprobs) == 5
    entries = [
        (e.logprob, [(id_of[bytes(t.bytes)], t.logprob) for t in e.top_logprobs]) for e in content
    ]
    ref = reference(render_chat(tokenizer, MESSAGES), ids)
    check_against(ref, ids, entries, 5)


@pytest.mark.anyio
async def test_completion_logprobs_shape(server: RunningServer) -> None:
    async with api(server) as client:
        out = await client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=10,
            temperature=0.0,
            logprobs=3,
            extra_body={"ignore_eos": True},
        )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == value == max(top.values())  # greedy: the chosen one is the top
        assert 1 <= len(top) <= 3


async def collect_stream(client: openai.AsyncOpenAI, **kwargs: Any) -> tuple[list[Any], str]:
    chunks = [c async for c in await client.chat.completions.create(stream=True, **kwargs)]
    logprobs = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert {len(lp.content) for lp in logprobs} == {1}  # one token per chunk
    entries = [e for lp in logprobs for e in lp.content]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return entries, text


@pytest.mark.anyio
async def test_streamed_logprobs_come_per_token_and_equal_the_whole(server) -> None:
    common: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 9,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 2,
        "extra_body": {"ignore_eos": True},
    }
    async with api(server) as client:
        whole = await client.chat.completions.create(**common)
        entries, text = await collect_stream(client, **common)
        plain = await client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=6, temperature=0.0, logprobs=2, stream=True
        )
        pieces = [c.choices[0] async for c in plain]
    assert text == whole.choices[0].message.content
    expected = whole.choices[0].logprobs.content
    assert [e.token for e in entries] == [e.token for e in expected]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in expected], abs=1e-4)
    with_logprobs = [p for p in pieces if p.logprobs]
    assert sum(len(p.logprobs.tokens) for p in with_logprobs) >= 1
    offsets = [o for p in with_logprobs for o in p.logprobs.text_offset]
    tokens = [t for p in with_logprobs for t in p.logprobs.tokens]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


@pytest.mark.anyio
async def test_logit_bias_bans_and_forces_tokens(server, tokenizer, id_of) -> None:
    prompt = tokenizer.encode("The dog sleeps")
    common: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0.0}
    async with api(server) as client:
        free = await client.completions.create(**common)
        first = tokenizer.encode(free.choices[0].text)[0]
        banned = await client.completions.create(logit_bias={str(first): -100}, **common)
        forced_id = tokenizer.encode(" sun")[0]
        forced = await client.completions.create(
            logit_bias={str(forced_id): 100}, logprobs=0, extra_body={"ignore_eos": True}, **common
        )
    assert not banned.choices[0].text.startswith(tokenizer.decode([first]))
    assert forced.choices[0].text == tokenizer.decode([forced_id] * 5)
    # the reported logprobs are the model's own (before the bias), not ~0
    ref = reference(prompt, [forced_id] * 5)
    values = forced.choices[0].logprobs.token_logprobs
    assert values == pytest.approx([float(r[forced_id]) for r in ref], abs=TOL)
    assert min(values) < -0.01


@pytest.mark.anyio
async def test_allowed_token_ids_hold_a_reply_to_those_tokens(server, tokenizer) -> None:
    """vLLM's allowed_token_ids through the real client: greedy among two ids, every token
    one of them; ids outside the vocabulary, or with a constraint, a 400 naming the field."""
    prompt = tokenizer.encode("The dog sleeps")
    allowed = [tokenizer.encode(" sun")[0], tokenizer.encode(" moon")[0]]
    async with api(server) as client:
        out = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=6,
            temperature=0.0,
            extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
        )
        assert out.choices[0].text == tokenizer.decode(allowed_greedy(prompt, allowed, 6))
        for extra in (
            {"allowed_token_ids": [len(tokenizer)]},
            {"allowed_token_ids": []},
            {"allowed_token_ids": allowed, "response_format": {"type": "json_object"}},
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=2, extra_body=extra
                )
            assert refused.value.body["param"] == "allowed_token_ids"  # type: ignore[index]


def allowed_greedy(prompt: list[int], allowed: list[int], steps: int) -> list[int]:
    """Greedy decoding by transformers' logits, each step's token the allowed one ranked first."""
    out: list[int] = []
    for _ in range(steps):
        logits = reference(prompt, [*out, allowed[0]])[-1]
        out.append(max(allowed, key=lambda t: float(logits[t])))
    return out


@pytest.mark.anyio
async def test_parity_logprobs_batched_and_solo(server: RunningServer) -> None:
    prompts = ["The quick brown fox", "Once upon a time", "In 1984 the station", "café 日本語"]
    common: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 16,
        "logprobs": 5,
        "extra_body": {"ignore_eos": True},
    }

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, list[Any]]:
        sampled = {"temperature": 1.5, "seed": 3} if i == 3 else {"temperature": 0.0}
        out = await client.completions.create(prompt=prompts[i], **common, **sampled)
        lp = out.choices[0].logprobs
        return out.choices[0].text, list(
            zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)
        )

    async with api(server) as client:
        solo = [await one(client, i) for i in range(len(prompts))]
        before = server.stats()
        together: list[Any] = [None] * len(prompts)
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):

                async def run(i: int = i) -> None:
                    together[i] = await one(client, i)

                tg.start_soon(run)
    assert server.stats()["multi_row_steps"] > before["multi_row_steps"]
    for (text_a, lps_a), (text_b, lps_b) in zip(solo, together, strict=True):
        assert text_a == text_b
        for (tok_a, v_a, top_a), (tok_b, v_b, top_b) in zip(lps_a, lps_b, strict=True):
            assert tok_a == tok_b and v_a == pytest.approx(v_b, abs=1e-4)
            assert sorted(top_a.values()) == pytest.approx(sorted(top_b.values()), abs=1e-4)


# ---- validation: 400 naming the field -----------------------------------------------------------

CHAT, TEXT = "/chat/completions", "/completions"
MSG: dict[str, Any] = {"messages": MESSAGES}
PROMPT: dict[str, Any] = {"prompt": "Hello"}
BAD: list[tuple[str, str, dict[str, Any], str]] = [
    ("chat-logprobs-not-bool", CHAT, {**MSG, "logprobs": 3}, "logprobs"),
    ("top-logprobs-over-cap", CHAT, {**MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("top-logprobs-negative", CHAT, {**MSG, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("top-logprobs-float", CHAT, {**MSG, "logprobs": True, "top_logprobs": 2.5}, "top_logprobs"),
    ("top-logprobs-without-logprobs", CHAT, {**MSG, "top_logprobs": 3}, "top_logprobs"),
    ("completion-logprobs-over-cap", TEXT, {**PROMPT, "logprobs": 21}, "logprobs"),
    ("completion-logprobs-bool", TEXT, {**PROMPT, "logprobs": True}, "logprobs"),
    ("completion-logprobs-string", TEXT, {**PROMPT, "logprobs": "3"}, "logprobs"),
    ("bias-not-object", CHAT, {**MSG, "logit_bias": [1, 2]}, "logit_bias"),
    ("bias-key-not-integer", CHAT, {**MSG, "logit_bias": {"abc": 1}}, "logit_bias"),
    ("bias-key-negative", TEXT, {**PROMPT, "logit_bias": {"-1": 1}}, "logit_bias"),
    ("bias-value-over", CHAT, {**MSG, "logit_bias": {"5": 101}}, "logit_bias"),
    ("bias-value-string", TEXT, {**PROMPT, "logit_bias": {"5": "up"}}, "logit_bias"),
    (
        "bias-out-of-vocab",
        TEXT,
        {**PROMPT, "logit_bias": {"5": 1, "360": 1, "9999": -1}},
        "logit_bias",
    ),
    ("bias-too-many", CHAT, {**MSG, "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    (
        "json-schema-without-schema",
        CHAT,
        {**MSG, "response_format": {"type": "json_schema", "json_schema": {}}},
        "response_format.json_schema.schema",
    ),
    ("format-unknown", TEXT, {**PROMPT, "response_format": {"type": "xml"}}, "response_format"),
    ("format-string", CHAT, {**MSG, "response_format": "text"}, "response_format"),
]


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_logprobs_bias_and_format_are_rejected(server, path, body, param) -> None:
    before = server.stats()["admitted"]
    response = httpx.post(f"{server.v1}{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert server.stats()["admitted"] == before


def test_rejections_list_the_bad_entries(server: RunningServer) -> None:
    body = {**MSG, "logit_bias": {"abc": 1, "7": 500, "5": 1}}
    message = httpx.post(f"{server.v1}{CHAT}", json=body, timeout=30).json()["error"]["message"]
    assert "'abc'" in message and "'7'" in message and "'5'" not in message
    body = {**PROMPT, "logit_bias": {"5": 1, "360": 1, "9999": -1}}
    message = httpx.post(f"{server.v1}{TEXT}", json=body, timeout=30).json()["error"]["message"]
    assert "[360, 9999]" in message
    body = {**MSG, "response_format": {"type": "xml"}}
    message = httpx.post(f"{server.v1}{CHAT}", json=body, timeout=30).json()["error"]["message"]
    assert "'json_object' or 'json_schema'" in message


def test_text_response_format_and_zero_logprobs_are_accepted(server: RunningServer) -> None:
    body = {**MSG, "max_tokens": 2, "response_format": {"type": "text"}, "logprobs": False}
    assert httpx.post(f"{server.v1}{CHAT}", json=body, timeout=30).status_code == 200
    body = {**PROMPT, "max_tokens": 2, "logprobs": 0}
    out = httpx.post(f"{server.v1}{TEXT}", json=body, timeout=30)
    assert out.status_code == 200
    lp = out.json()["choices"][0]["logprobs"]
    pairs = zip(lp["tokens"], lp["token_logprobs"], strict=True)
    assert lp["top_logprobs"] == [{t: v} for t, v in pairs]
