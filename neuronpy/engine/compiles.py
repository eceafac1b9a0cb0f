"""The constraints compiling for one model's requests: one compile per distinct constraint
however many requests wait for it, a bounded number at once and a bounded queue, and none
that nobody waits for any more."""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading

import anyio
from anyio.abc import TaskGroup

from neuronpy.engine.compile_child import CompileCancelled
from neuronpy.engine.grammar import Grammars, Reasoning
from neuronpy.engine.types import Constraint
from neuronpy.errors import NeuronError, QueueFullError

log = logging.getLogger(__name__)

Key = tuple[Constraint, Reasoning | None]


@dataclasses.dataclass
class _Compile:
    """One constraint's compile, shared by the requests waiting for it."""

    done: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    waiters: int = 0
    error: Exception | None = None  # why it failed, for every waiter


class Compiles:
    """Compiles constraints into `grammars` (its cache) on threads, for the requests of model
    `name`. A request waiting for a constraint another is compiling waits for that compile and
    shares its result, or its error; at most `slots` compile at once, and past those `queue`
    wait for a slot (then QueueFullError, with a retry hint). A compile every waiter has given
    up on (cancelled: its client went away) is not started, or is stopped (see Grammars)."""

    def __init__(self, grammars: Grammars, name: str, slots: int, queue: int) -> None:
        self.grammars = grammars
        self._name, self._slots, self._queue = name, slots, queue
        self._free = anyio.Semaphore(slots)
        self.pending: dict[Key, _Compile] = {}  # compiling or waiting for a slot
        self._tg: TaskGroup | None = None

    def start(self, tg: TaskGroup) -> None:
        """The task group compiles run in (the engine's: they end with it)."""
        self._tg = tg

    async def compile(self, constraint: Constraint, reasoning: Reasoning | None) -> None:
        """Returns once the constraint's grammar is in the cache; its compile's error
        (InvalidRequestError naming its field) otherwise."""
        key = (constraint, reasoning)
        while not self.grammars.cached(*key):
            pending = self.pending.get(key)
            if pending is None:
                waiting = len(self.pending) - self._slots
                if waiting >= self._queue:
                    raise QueueFullError(
                        f"model {self._name!r} is compiling {self._slots} constraints and "
                        f"{max(waiting, 0)} more wait (max_compiles = {self._slots}, "
                        f"max_queue = {self._queue}); retry shortly",
                        retry_after=1.0,
                    )
                pending = self.pending[key] = _Compile()
                assert self._tg is not None, "Compiles.start was not called"
                self._tg.start_soon(self._run, key, pending, name="neuronpy-compile")
            pending.waiters += 1
            try:
                await pending.done.wait()
            finally:
                pending.waiters -= 1
                if pending.waiters == 0 and not pending.done.is_set():
                    pending.cancelled.set()  # nobody waits for it any more
            if pending.error is not None:
                raise copy.copy(pending.error)

    async def _run(self, key: Key, pending: _Compile) -> None:
        """Compiles `key` for those waiting on `pending`, when a slot is free and somebody
        still waits."""
        try:
            async with self._free:
                if not pending.cancelled.is_set():
                    await anyio.to_thread.run_sync(
                        lambda: self.grammars.compile(*key, cancelled=pending.cancelled)
                    )
        except CompileCancelled:
            log.info("a constraint's compile was stopped: no request waits for it any more")
        except Exception as exc:  # (a NeuronError: the request's 4xx; else its 500 alone)
            if not isinstance(exc, NeuronError):
                log.exception("compiling a constraint failed")
            pending.error = exc
        finally:
            del self.pending[key]
            pending.done.set()
