"""Threads that end with their work: how blocking torch work outside the device worker runs."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import anyio

T = TypeVar("T")


def start_in_own_thread(fn: Callable[[], T], name: str) -> tuple[Future[T], threading.Thread]:
    """Starts `fn` on a new thread that ends with it: the future holds its result or error.
    Blocking torch work outside the device worker runs this way (see run_in_own_thread)."""
    fut: Future[T] = Future()

    def run() -> None:
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return fut, thread


async def run_in_own_thread(fn: Callable[[], T], name: str) -> T:
    """Runs blocking `fn` (loading weights, building a model) on a new thread that ends with it.

    Under OpenMP every thread that runs a parallel tensor operation keeps a team of threads for
    as long as it lives. Once there are more of them than cores, every team stops spinning
    between operations and sleeps, and each operation pays for waking its team: the device
    worker's steps ran up to 1.5x slower next to the idle pool thread that had loaded the
    model. A thread that exits takes its team with it.
    """
    fut, _ = start_in_own_thread(fn, name)
    return await anyio.to_thread.run_sync(fut.result, abandon_on_cancel=True)
