"""Compiling a grammar in a child process, so that its time and its memory are bounded and a
compile nobody waits for any more is stopped.

xgrammar's compile is one C++ call that nothing interrupts, and its cost is not its input's
size: a grammar of 600 characters (200 optional characters in a row) compiles for 25 s on two
cores, a 60 KiB JSON Schema of 2000 optional properties for 13 s and +150 MB. On a thread
such a compile could only be waited out. Here the server forks itself; the child (which
shares the parent's memory, copy-on-write, tokenizer index included) compiles with a cap on
the memory it may add, writes the compiled grammar to a pipe as JSON and exits; the parent
reads it back within the time bound, or kills the child. A fork costs a few milliseconds and
runs only on a cache miss; a grammar comes back in about a tenth of its compile time.

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

import xgrammar as xgr

# The fork warning of Python 3.12+ is about children that go on running the parent's code;
# this child runs one C++ call and os._exit, touching no lock another thread may hold.
warnings.filterwarnings(
    "ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning
)

CAN_FORK = sys.platform.startswith("linux") and hasattr(os, "fork")
_POLL_SECONDS = 0.05  # how often a waiting parent looks at its cancel flag
_OK, _FAILED = b"o", b"e"  # the first byte the child writes: a grammar follows, or an error
_OUT_OF_MEMORY = 3  # the child's exit status when its memory cap stopped it


class CompileLimitError(Exception):
    """The compile went past its time or memory bound (the message says which), or stopped."""


class CompileCancelled(Exception):
    """Nobody waited for the compile any more: its child was stopped."""


def compile_in_child(
    compile: Callable[[], xgr.CompiledGrammar],
    info: xgr.TokenizerInfo,
    seconds: float,
    memory: int,
    cancelled: threading.Event | None = None,
) -> xgr.CompiledGrammar:
    """`compile()` run in a forked child: its result, or CompileLimitError past `seconds` of
    wall time or `memory` bytes more than the server has mapped, CompileCancelled once
    `cancelled` is set; an error `compile` raises (RuntimeError, ValueError) is raised here
    with its message. `info`: the tokenizer the grammar is compiled for (to read it back)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compile, write, exit (never return into the parent's code)
        os.close(read_end)
        _child(compile, write_end, memory)
    os.close(write_end)
    status = None
    try:
        data = _read(read_end, seconds, cancelled)
        if data[:1] not in (_OK, _FAILED):  # it died before it wrote: how?
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
    return xgr.CompiledGrammar.deserialize_json(data[1:].decode("utf-8"), info)


def _child(compile: Callable[[], xgr.CompiledGrammar], out: int, memory: int) -> None:
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when it ends
        with open("/proc/self/statm", encoding="ascii") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (mapped + memory, mapped + memory))
        try:
            data = _OK + compile().serialize_json().encode("utf-8")
        except MemoryError:
            raise
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
    except BaseException:  # the parent reads no grammar, and says how the child ended
        pass
    finally:
        os._exit(code)


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
