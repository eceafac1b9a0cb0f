"""Scripted replies: an engine whose model writes given token ids for chosen requests.

A tiny random model never writes tool-call markup by itself. `Scripts` wraps the engine's
sampling step (which runs on the device worker thread) so that a request whose prompt holds a
registered key gets its script's next token: that id's logit is raised above the row's maximum
before the real sampler (and its log-probabilities) sees the row. Everything else, the forward,
the batch, the router and the HTTP layer, runs as it does in production.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from neuronpy.engine.engine import Engine

FORCE = 30.0  # how far above the row's maximum a scripted token's logit is set


class Scripts:
    """Registered scripts by key; `attach` makes an engine follow them."""

    def __init__(self) -> None:
        self._scripts: dict[str, tuple[int, ...]] = {}
        self._by_slot: dict[int, tuple[int, ...] | None] = {}

    def add(self, key: str, token_ids: Sequence[int]) -> str:
        """A request whose prompt contains `key` writes `token_ids` (then whatever the model
        writes, if it is still running). Keys must not contain one another."""
        self._scripts[key] = tuple(token_ids)
        return key

    def attach(self, engine: Engine) -> None:
        tokenizer = engine.tokenizer
        sampling = engine._runner.sampling

        def script_of(slot: Any) -> tuple[int, ...] | None:
            if slot.id not in self._by_slot:
                prompt = tokenizer.decode(list(slot.prompt_ids), skip_special_tokens=False)
                found = [s for key, s in self._scripts.items() if key in prompt]
                self._by_slot[slot.id] = found[0] if found else None
            return self._by_slot[slot.id]

        def scripted(slots: Sequence[Any]) -> Any:
            inner = sampling(slots)
            scripts = [script_of(slot) for slot in slots]
            if not any(scripts):
                return inner

            def sample(logits: torch.Tensor) -> Any:
                logits = logits.clone()
                for row, (slot, script) in enumerate(zip(slots, scripts, strict=True)):
                    step = len(slot.output_ids)  # the engine appends after the job returns
                    if script is not None and step < len(script):
                        logits[row, script[step]] = logits[row].max() + FORCE
                return inner(logits)

            return sample

        engine._runner.sampling = scripted  # type: ignore[method-assign]
