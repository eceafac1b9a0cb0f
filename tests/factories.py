"""Factories shared by the tests: fixture paths, loaded tiny models, engines."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM, AutoTokenizer

from neuronpy.compose import engine_from_hf
from neuronpy.config import EngineConfig
from neuronpy.engine.engine import Engine

FIXTURES = Path(__file__).parent / "fixtures"
MOE_FAMILIES = ("tiny-qwen3-moe", "tiny-mixtral", "tiny-olmoe")
# one fixture per family and feature set (tests/fixtures/build_fixtures.py says which)
FAMILIES = (
    "tiny-llama",
    "tiny-llama3",
    "tiny-mistral",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-gemma2",
    "tiny-gemma3",
    "tiny-phi3",
    "tiny-smollm3",
    "tiny-granite",
    *MOE_FAMILIES,
)


def fixture_dir(name: str = "tiny-llama") -> Path:
    return FIXTURES / name


@functools.cache
def hf_model(name: str = "tiny-llama") -> Any:
    """A transformers model of a tiny fixture, in eval mode (cached: treat it as read-only)."""
    return AutoModelForCausalLM.from_pretrained(fixture_dir(name), dtype="float32").eval()


@functools.cache
def tokenizer(name: str = "tiny-llama") -> Any:
    return AutoTokenizer.from_pretrained(fixture_dir(name))


def make_engine(name: str = "tiny-llama", draft: str | None = None, **config: Any) -> Engine:
    """An engine over a tiny fixture (enter it with `async with`); `draft`: another fixture
    drafting for it (speculative decoding)."""
    drafting = (hf_model(draft), tokenizer(draft)) if draft is not None else None
    if draft is not None:
        config.setdefault("draft_model", draft)
    return engine_from_hf(
        hf_model(name), tokenizer(name), name=name, config=EngineConfig(**config), draft=drafting
    )
