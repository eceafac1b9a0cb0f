"""A grammar's compile tried first in a child process, so that its time and its memory are
bounded and a compile nobody waits for any more is stopped.

xgrammar's compile is one C++ call that nothing interrupts, and its cost is not its input's
size: a grammar of 600 characters (200 optional characters in a row) compiles for 25 s on two
cores, a 60 KiB JSON Schema of 2000 optional properties for 13 s and +150 MB. On a thread
such a compile could only be waited out. So the server forks itself, and the child (which
shares the parent's memory, copy-on-write, tokenizer index included) compiles with a cap on
the memory it may add, says whether it could, and exits; the parent kills it past the time
bound or once nobody waits. Only a grammar its child compiled within the bounds is then
compiled in the server, at the same cost. (The compiled grammar does not come back from the
child: xgrammar writes it out only as JSON, 224 MB and 14 s for a schema of 800 properties
that compiles in 0.3 s.) A fork costs a few milliseconds; ordinary constraints compile in
milliseconds, so twice is cheap, and it happens once per distinct constraint (the cache).
The child runs at a lower priority (nice 10), so that on a machine short of cores the
engine's steps go first.

Where there is no fork (Windows) or it is unsafe (macOS, whose system frameworks forbid a
forked child to use them), compiles run on the calling thread without these bounds.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable

# The fork warning of Python 3.12+ is about children that go on running the parent's code;
# this child runs one C++ call and os._exit, touching no lock another thread may hold.
warnings.filterwarnings(
    "ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning
)

CAN_FORK = sys.platform.startswith("linux") and hasattr(os, "fork")
_POLL_SECONDS = 0.05  # how often a waiting parent looks at its cancel flag
_OK, _FAILED = b"o", b"e"  # what the child writes: it compiled; or an error's message follows
_OUT_OF_MEMORY = 3  # the child's exit status when its memory cap stopped it


class CompileLimitError(Exception):
    """The compile went past its time or memory bound (the message says which), or stopped."""


class CompileCancelled(Exception):
    """Nobody waited for the compile any more: its child was stopped."""


def try_in_child(
    compile: Callable[[], object],
    seconds: float,
    memory: int,
    cancelled: threading.Event | None = None,
) -> None:
    """Runs `compile()` in a forked child and returns once it has returned there: raises
    CompileLimitError past `seconds` of wall time or `memory` bytes of memory more than the
    server holds, CompileCancelled once `cancelled` is set, and a RuntimeError with the
    message of an error `compile` raised (RuntimeError, ValueError, TypeError, KeyError)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compile, say how it went, exit (never back into the server's code)
        os.close(read_end)
        _child(compile, write_end, memory)
    os.close(write_end)
    status = None
    try:
        data = _read(read_end, seconds, cancelled)
        if data[:1] not in (_OK, _FAILED):  # it died before it said: how?
            _, status = os.waitpid(pid, 0)
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == _OUT_OF_MEMORY:
                raise CompileLimitError(f"compiling it took more than {memory >> 20} MiB of memory")
            raise CompileLimitError(f"its compile stopped ({_how(status)})")
    finally:
        os.close(read_end)
        if status is None:  # (not reaped yet: a pid reaped may already be another process's)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    if data[:1] == _FAILED:
        raise RuntimeError(data[1:].decode("utf-8", "replace"))


def _child(compile: Callable[[], object], out: int, memory: int) -> None:
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when it ends
        os.nice(10)  # the engine's steps before a compile, when the cores are short
        held = _data_bytes()  # (RLIMIT_DATA bounds this: private writable memory, the heap's)
        resource.setrlimit(resource.RLIMIT_DATA, (held + memory, held + memory))
        try:
            compile()
            data = _OK
        except (RuntimeError, ValueError, TypeError, KeyError) as exc:
            if "bad_alloc" in str(exc):  # (C++'s out-of-memory, as xgrammar raises it)
                raise MemoryError from None
            data = _FAILED + str(exc).encode("utf-8", "replace")
        view = memoryview(data)
        while view:
            view = view[os.write(out, view) :]
        code = 0
    except MemoryError:
        code = _OUT_OF_MEMORY
    except BaseException:  # the parent hears nothing, and says how the child ended
        pass
    finally:
        os._exit(code)


def _data_bytes() -> int:
    """This process's private writable memory (VmData), what RLIMIT_DATA counts."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmData in /proc/self/status")


def _read(fd: int, seconds: float, cancelled: threading.Event | None) -> bytes:
    """The child's whole output, read as it comes, within the deadline."""
    deadline = time.monotonic() + seconds
    chunks: list[bytes] = []
    while True:
        if cancelled is not None and cancelled.is_set():
            raise CompileCancelled()
        left = deadline - time.monotonic()
        if left <= 0:
            raise CompileLimitError(f"it took longer than {seconds:g} s to compile")
        ready, _, _ = select.select([fd], [], [], min(left, _POLL_SECONDS))
        if ready:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def _how(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit status {os.WEXITSTATUS(status)}"
