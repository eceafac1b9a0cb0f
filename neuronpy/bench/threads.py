"""The benchmark's threads: torch work in threads that end with it, and an event loop in a
thread for the systems driven through async code.

Threads and fairness. PyTorch's CPU kernels run on OpenMP (libgomp), and libgomp gives every OS
thread that runs a parallel region a team of its own. Once the process holds more OpenMP threads
than CPUs, libgomp stops spin-waiting between parallel regions and sleeps instead, which made
`generate()` 1.3-2x slower on a 2-core machine while an idle engine merely existed in the same
process. So each system lives only for its own run (started, warmed up, run, closed), and any
torch work outside the measured threads (loading, building an engine) runs in a short-lived
thread (`in_fresh_thread`) whose OpenMP team goes away with it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

import anyio.from_thread

from neuronpy.threads import start_in_own_thread

T = TypeVar("T")


def in_fresh_thread(fn: Callable[[], T], name: str = "neuronpy-bench") -> T:
    """Runs `fn` in a new thread and returns its result (or raises its error). The thread ends
    with it, and so does the OpenMP team its torch work created (see the module docstring)."""
    fut, thread = start_in_own_thread(fn, name)
    thread.join()  # gone, with its OpenMP team, before the next measurement starts
    return fut.result()


class EventLoopThread:
    """An asyncio event loop in a background thread (anyio's blocking portal), from a system's
    start to its close: an engine, or an HTTP client, lives in it between calls."""

    def __init__(self) -> None:
        self._cm = anyio.from_thread.start_blocking_portal(backend="asyncio")
        self._portal = self._cm.__enter__()

    def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Runs `fn()` in the loop and waits for its result."""
        return self._portal.call(fn)

    def enter(self, cm: AbstractAsyncContextManager[object]) -> Callable[[], None]:
        """Enters the async context manager `cm` in the loop; returns what exits it."""
        wrapped = self._portal.wrap_async_context_manager(cm)
        wrapped.__enter__()

        def leave() -> None:
            wrapped.__exit__(None, None, None)

        return leave

    def close(self) -> None:
        self._cm.__exit__(None, None, None)
