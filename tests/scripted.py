"""Scripted replies: an engine whose model writes given token ids for chosen requests.

A tiny random model never writes tool-call markup by itself. `Scripts` wraps the engine's
sampling (the runner's, on the engine's event loop, over the logits a job answered) so that a
request whose prompt holds a registered key gets its script's next token: that id's logit is
raised above the row's maximum before the real sampler (and its log-probabilities) sees the row.
Everything else, the forward, the batch, the router and the HTTP layer, runs as it does in
production.

`hold_plans` makes the engine wait, before each plan that samples tokens, until a test lets it
go on: the engine's loop awaits (a thread waits on the test's event), so the server goes on
answering meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import torch

from neuronpy.engine.engine import Engine
from neuronpy.engine.plans import RowRef, StepPlan

FORCE = 30.0  # how far above the row's maximum a scripted token's logit is set

Wait = Callable[[Sequence[RowRef]], Awaitable[None]]


def sampled_rows(plan: StepPlan) -> tuple[RowRef, ...]:
    """The rows a plan samples tokens for: its decode step's, and those of prompts whose last
    chunk it prefills (alone or in the step's forward)."""
    chunks = [] if plan.prefill is None else [plan.prefill]
    rows: list[RowRef] = []
    if plan.decode is not None:
        chunks += plan.decode.rides
        rows += plan.decode.rows
    return (*rows, *(r for chunk in chunks if chunk.last for r in chunk.sampled))


def hold_plans(engine: Engine, wait: Wait) -> Callable[[], None]:
    """Makes the engine await `wait(rows)` before it runs each plan that samples tokens for
    `rows`; answers what undoes it."""
    runner = engine._runner
    inner = runner.run

    async def run(plan: StepPlan) -> Any:
        rows = sampled_rows(plan)
        if rows:
            await wait(rows)
        return await inner(plan)

    runner.run = run  # type: ignore[method-assign]

    def undo() -> None:
        runner.run = inner  # type: ignore[method-assign]

    return undo


async def wait_for(event: threading.Event, timeout: float) -> bool:
    """`event.wait(timeout)` on a thread, the event loop free meanwhile."""
    return await anyio.to_thread.run_sync(event.wait, timeout)


def live_requests(engine: Engine) -> dict[int, Any]:
    """The engine's admitted requests by id, recorded as they are admitted from the first
    call on (a plan names its rows by frozen references; the scripts read what the engine's
    requests hold when the step is sampled, as the engine's own sampling does)."""
    known: dict[int, Any] | None = getattr(engine, "_scripted_requests", None)
    if known is None:
        known = {}
        admit = engine.admit

        def recording(*args: Any, **kwargs: Any) -> Any:
            requests = admit(*args, **kwargs)
            known.update((r.id, r) for r in requests)
            return requests

        engine._scripted_requests = known  # type: ignore[attr-defined]
        engine.admit = recording  # type: ignore[method-assign]
    return known


class Scripts:
    """Registered scripts by key; `attach` makes an engine follow them."""

    def __init__(self) -> None:
        self._scripts: dict[str, tuple[int, ...]] = {}
        self._by_slot: dict[int, tuple[int, ...] | None] = {}
        self._holds: dict[tuple[int, ...], tuple[int, threading.Event]] = {}

    def add(self, key: str, token_ids: Sequence[int], *, hold_after: int | None = None) -> str:
        """A request whose prompt contains `key` writes `token_ids` (then whatever the model
        writes, if it is still running). Keys must not contain one another. With
        `hold_after`, the batch stops before that script's token `hold_after` (the sampling
        job waits) until `release(key)`, so a test acts on a request known to be running."""
        self._scripts[key] = tuple(token_ids)
        if hold_after is not None:
            self._holds[self._scripts[key]] = (hold_after, threading.Event())
        return key

    def release(self, key: str) -> None:
        """The batch held by `key`'s script goes on."""
        self._holds[self._scripts[key]][1].set()

    def attach(self, engine: Engine) -> None:
        tokenizer = engine.tokenizer
        runner = engine._runner
        sample, verify = runner.sample, runner.verify
        requests = live_requests(engine)

        def script_of(slot: Any) -> tuple[int, ...] | None:
            if slot.id not in self._by_slot:
                prompt_ids = requests[slot.id].prompt_ids
                prompt = tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
                found = [s for key, s in self._scripts.items() if key in prompt]
                self._by_slot[slot.id] = found[0] if found else None
            return self._by_slot[slot.id]

        def forced(slots: Sequence[Any], logits: torch.Tensor, counts: Sequence[int]) -> Any:
            """`logits` with each scripted slot's tokens raised above their rows' maximum: slot
            b's counts[b] rows in turn (a verify step's: its token, then each draft) get the
            script's next tokens, or None when no slot has a script."""
            scripts = [script_of(slot) for slot in slots]
            if not any(scripts):
                return None
            logits = logits.clone()
            at = 0
            for slot, script, count in zip(slots, scripts, counts, strict=True):
                for j in range(count):
                    # (the engine appends the tokens after sampling)
                    step = len(requests[slot.id].output_ids) + j
                    if script is not None and step < len(script):
                        logits[at + j, script[step]] = logits[at + j].max() + FORCE
                at += count
            return logits

        def scripted(slots: Sequence[Any], logits: torch.Tensor, argmax: Any = None) -> Any:
            scripted_logits = forced(slots, logits, [1] * len(slots))
            if scripted_logits is None:
                return sample(slots, logits, argmax)
            # (the argmax the worker answered is not the script's)
            return sample(slots, scripted_logits)

        def scripted_verify(
            slots: Sequence[Any],
            logits: torch.Tensor,
            drafts: Sequence[tuple[int, ...]],
            argmax: Any = None,
        ) -> Any:
            """A verify step (drafts, or the tokens a grammar forces) holds row b's 1 +
            len(drafts[b]) logits rows in turn: each gets its place's scripted token."""
            scripted_logits = forced(slots, logits, [1 + len(d) for d in drafts])
            if scripted_logits is None:
                return verify(slots, logits, drafts, argmax)
            return verify(slots, scripted_logits, drafts)

        async def held(slots: Sequence[RowRef]) -> None:
            for slot in slots:
                script = script_of(slot)
                hold = self._holds.get(script) if script is not None else None
                if hold is not None and len(requests[slot.id].output_ids) == hold[0]:
                    assert await wait_for(hold[1], 120), "a held script was never released"

        runner.sample = scripted  # type: ignore[method-assign]
        runner.verify = scripted_verify  # type: ignore[method-assign]
        hold_plans(engine, held)


class Paced:
    """Holds one engine's steps to the page's polls: while the request labelled `label` (its
    x-request-id) runs, each step the engine takes for it waits until the server has answered
    /v1/batch again (the only caller of `Engine.rows`). So the request stays in the batch as
    long as the test needs, and takes a step between one poll and the next, however fast or slow
    this machine is; leaving the `with` block lets the engine run freely again."""

    def __init__(self, engine: Any, label: str) -> None:
        self._engine = engine
        self._label = label
        self._polled = threading.Event()
        self._free = threading.Event()
        self._undo: Callable[[], None] | None = None

    def __enter__(self) -> Paced:
        polled, free, label = self._polled, self._free, self._label
        rows = self._engine.rows
        live = live_requests(self._engine)

        def answered() -> Any:
            polled.set()
            return rows()

        def held(requests: Sequence[RowRef]) -> bool:
            return not free.is_set() and any(
                live[r.id].label == label and not live[r.id].done for r in requests
            )

        async def paced(requests: Sequence[RowRef]) -> None:
            while held(requests):
                if await wait_for(polled, 0.05):
                    polled.clear()
                    break

        self._engine.rows = answered
        self._undo = hold_plans(self._engine, paced)
        return self

    def __exit__(self, *exc: object) -> None:
        self._free.set()
        if self._undo is not None:
            self._undo()
        del self._engine.rows
