"""Factories shared by the tests: fixture paths, loaded tiny models, engines."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from neuronpy.compose import engine_from_hf
from neuronpy.config import EngineConfig
from neuronpy.engine.engine import Engine

FIXTURES = Path(__file__).parent / "fixtures"


@functools.cache
def fixture_builder() -> ModuleType:
    """tests/fixtures/build_fixtures.py, loaded from its path (the folder is no package)."""
    spec = importlib.util.spec_from_file_location("build_fixtures", FIXTURES / "build_fixtures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("build_fixtures", module)
    spec.loader.exec_module(module)
    return module


MOE_FAMILIES: tuple[str, ...] = fixture_builder().MOE_FIXTURES
# one fixture per family and feature set (the builder says which)
FAMILIES: tuple[str, ...] = fixture_builder().FIXTURE_NAMES


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


def skip_unless_built_with_this_transformers(fixture: Path) -> None:
    """Skip a byte-for-byte rebuild test where `fixture` was written by another transformers
    version: its files name the version, and its serialization may differ (rebuild them with
    tests/fixtures/build_fixtures.py to update)."""
    built_with = json.loads((fixture / "config.json").read_text()).get("transformers_version")
    if built_with != transformers.__version__:
        pytest.skip(
            f"fixtures were built with transformers {built_with}, this is "
            f"{transformers.__version__}: serialization may differ (rebuild to update)"
        )
