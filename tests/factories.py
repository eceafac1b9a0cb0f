"""Factories shared by the tests: fixture paths, loaded tiny models, engines."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import sys
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from neuronpy.arch.llama import LlamaModel
from neuronpy.compose import check_draft_tokenizer, engine_over, native_draft, native_model
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


class ModelPool:
    """Built models (neuronpy's, their layers compiled) lent to one engine at a time, so that
    the suite compiles each fixture model once per key rather than once per engine: compiling
    a tiny model's layers costs ~2.5 s of dynamo tracing even with inductor's cache warm.

    A key names everything the built model depends on (the source and its dtype, quantize,
    compile). A model is lent to one engine at a time: its forwards keep the running step's
    attention on the model, so two engines must not run on one. An engine given one by
    `lend` gives it back once it has stopped (after `async with`, its worker thread ended),
    or when it is collected unstarted; the model's attributes are then put back as they were
    lent (a test may replace a method on its engine's model). While every model of a key is
    out, `lend` builds another."""

    def __init__(self) -> None:
        self._idle: dict[Hashable, list[LlamaModel]] = {}
        self._lock = threading.Lock()

    def take(self, key: Hashable, build: Callable[[], LlamaModel]) -> LlamaModel:
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                return idle.pop()
        return build()  # (outside the lock: servers build their models on threads at once)

    def put(self, key: Hashable, model: LlamaModel, attributes: dict[str, Any]) -> None:
        vars(model).clear()
        vars(model).update(attributes)
        with self._lock:
            self._idle.setdefault(key, []).append(model)

    @contextlib.contextmanager
    def borrow(self, key: Hashable, build: Callable[[], LlamaModel]) -> Iterator[LlamaModel]:
        """A model of `key` for the block alone, to run forwards on here (no engine's)."""
        model = self.take(key, build)
        attributes = dict(vars(model))
        try:
            yield model
        finally:
            self.put(key, model, attributes)

    def lend(
        self, models: list[tuple[Hashable, LlamaModel]], build: Callable[[], Engine]
    ) -> Engine:
        """The engine `build` makes over `models` (taken from this pool), made to give them
        back once it has stopped; they go back at once where `build` raises."""
        lent = [(key, model, dict(vars(model))) for key, model in models]
        try:
            engine = build()
        except BaseException:
            self._give_back(lent, None)
            raise
        engine.__class__ = LentEngine
        once = weakref.finalize(engine, self._give_back, lent, engine._worker)
        engine._give_back = once  # type: ignore[attr-defined]
        return engine

    def _give_back(
        self, lent: list[tuple[Hashable, LlamaModel, dict[str, Any]]], worker: Any
    ) -> None:
        # a worker thread still running (its shutdown timed out) may still use the model
        if worker is not None and worker._thread.is_alive():
            return
        for key, model, attributes in lent:
            self.put(key, model, attributes)


class LentEngine(Engine):
    """An engine over models lent by a ModelPool: gives them back once it has stopped."""

    async def __aexit__(self, *exc_info: Any) -> None:
        try:
            await super().__aexit__(*exc_info)
        finally:
            self._give_back()  # type: ignore[attr-defined]


MODELS = ModelPool()


def compiled_model(name: str = "tiny-llama") -> contextlib.AbstractContextManager[LlamaModel]:
    """neuronpy's model of a fixture in float32, its layers compiled, for a block of forwards:
    the one make_engine's engines run on (built and compiled once, MODELS)."""
    config = EngineConfig()
    return MODELS.borrow(
        ((name, "float32"), config.quantize, config.compile),
        lambda: native_model(hf_model(name), tokenizer(name), name=name, config=config),
    )


def pooled_engine(
    source: Any,
    tokenizer: Any,
    *,
    key: Hashable,
    name: str,
    config: EngineConfig,
    draft: tuple[Hashable, tuple[Any, Any]] | None = None,
) -> Engine:
    """What `engine_from_hf(source, tokenizer, name=name, config=config, draft=...)` builds,
    over models from MODELS: `key` names `source` (a fixture and its dtype); `draft`: a draft
    model's key and (transformers model, tokenizer)."""
    built = (config.quantize, config.compile)
    wanted: list[tuple[Hashable, Callable[[], LlamaModel]]] = [
        ((key, *built), lambda: native_model(source, tokenizer, name=name, config=config))
    ]
    if draft is not None:
        draft_key, drafting = draft
        check_draft_tokenizer(tokenizer, drafting[1])
        wanted.append(
            (
                ("draft", draft_key, *built),
                lambda: native_draft(drafting, tokenizer, name=name, config=config),
            )
        )
    models = [(model_key, MODELS.take(model_key, build)) for model_key, build in wanted]
    return MODELS.lend(
        models,
        lambda: engine_over(
            models[0][1],
            source,
            tokenizer,
            name=name,
            config=config,
            draft=models[1][1] if len(models) > 1 else None,
        ),
    )


def make_engine(name: str = "tiny-llama", draft: str | None = None, **config: Any) -> Engine:
    """An engine over a tiny fixture (enter it with `async with`); `draft`: another fixture
    drafting for it (speculative decoding). Its models come from MODELS: built and compiled
    once for every engine of the same fixture and settings."""
    if draft is not None:
        config.setdefault("draft_model", draft)
    settings = EngineConfig(**config)
    drafting = ((draft, "float32"), (hf_model(draft), tokenizer(draft))) if draft else None
    return pooled_engine(
        hf_model(name),
        tokenizer(name),
        key=(name, "float32"),
        name=name,
        config=settings,
        draft=drafting,
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
