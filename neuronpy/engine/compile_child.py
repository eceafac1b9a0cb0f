"""A grammar's compile tried first in a child process, so that its time and its memory are
bounded and a compile nobody waits for any more is stopped.

xgrammar's compile is one C++ call that nothing interrupts, and its cost is not its input's
size: a grammar of 600 characters (200 optional characters in a row) compiles for 25 s on two
cores, a 60 KiB JSON Schema of 2000 optional properties for 13 s and +150 MB. On a thread
such a compile could only be waited out. So the server forks itself, and the child (which
shares the parent's memory, copy-on-write, tokenizer index included) compiles with a cap on
the memory it may add, says whether it could, and exits; the parent kills it past the time
bound, past the memory bound or once nobody waits. Only a grammar its child compiled within
the bounds is then compiled in the server, at the same cost. (The compiled grammar does not
come back from the child: xgrammar writes it out only as JSON, 224 MB and 14 s for a schema
of 800 properties that compiles in 0.3 s.) A fork costs a few milliseconds; ordinary
constraints compile in milliseconds, so twice is cheap, and it happens once per distinct
constraint (the cache). The child runs at a lower priority (nice 10), so that on a machine
short of cores the engine's steps go first.

The child's memory is what it adds to the pages it shares with the parent: its resident
anonymous memory (RssAnon, which neither the parent's writes nor its frees change) beyond what
it held once it had handed back the pages malloc held free. Free heap would otherwise be
reused unseen: a server's heap, fragmented by its requests, may hold hundreds of MB free,
which no cap on mapped memory counts. The parent reads it from /proc as it waits (every 50 ms);
RLIMIT_DATA, a cap on what the child maps, stops what grows faster than that.

Where there is no fork (Windows) or it is unsafe (macOS, whose system frameworks forbid a
forked child to use them), compiles run on the calling thread without these bounds.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import resource
import select
import signal
import struct
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
_POLL_SECONDS = 0.05  # how often a waiting parent looks at its cancel flag and child's memory
_OK, _FAILED = b"o", b"e"  # what the child writes: it compiled; or an error's message follows
_HELD = struct.Struct("<Q")  # what the child writes first: the bytes it holds as it begins
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
        reply = _read(read_end, seconds, cancelled, pid, memory)[_HELD.size :]
        if reply[:1] not in (_OK, _FAILED):  # it died before it said: how?
            _, status = os.waitpid(pid, 0)
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == _OUT_OF_MEMORY:
                raise CompileLimitError(_too_much(memory))
            raise CompileLimitError(f"its compile stopped ({_how(status)})")
    finally:
        os.close(read_end)
        if status is None:  # (not reaped yet: a pid reaped may already be another process's)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    if reply[:1] == _FAILED:
        raise RuntimeError(reply[1:].decode("utf-8", "replace"))


def _too_much(memory: int) -> str:
    return f"compiling it took more than {memory >> 20} MiB of memory"


def _child(compile: Callable[[], object], out: int, memory: int) -> None:
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when it ends
        os.nice(10)  # the engine's steps before a compile, when the cores are short
        _trim_heap()  # (what malloc holds free goes back, so that reusing it is counted too)
        _write(out, _HELD.pack(_anonymous_bytes(os.getpid())))
        mapped = _data_bytes()  # (RLIMIT_DATA bounds this: private writable memory, the heap's)
        resource.setrlimit(resource.RLIMIT_DATA, (mapped + memory, mapped + memory))
        try:
            compile()
            data = _OK
        except (RuntimeError, ValueError, TypeError, KeyError) as exc:
            if "bad_alloc" in str(exc):  # (C++'s out-of-memory, as xgrammar raises it)
                raise MemoryError from None
            data = _FAILED + str(exc).encode("utf-8", "replace")
        _write(out, data)
        code = 0
    except MemoryError:
        code = _OUT_OF_MEMORY
    except BaseException:  # the parent hears nothing, and says how the child ended
        pass
    finally:
        os._exit(code)


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _trim_heap() -> None:
    """Hands the heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing):
    the child then maps them again only as it uses them, and that is counted."""
    with contextlib.suppress(OSError, AttributeError):  # (no glibc)
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)


def _data_bytes() -> int:
    """This process's private writable memory (VmData), what RLIMIT_DATA counts."""
    return _status_bytes("self", "VmData:")


def _anonymous_bytes(pid: int) -> int:
    """The resident anonymous memory of process `pid` (RssAnon: what it shares with the
    parent, copy-on-write, and what it added). Neither the parent's writes nor its frees
    change it; the child's new pages do."""
    try:
        return _status_bytes(str(pid), "RssAnon:")
    except OSError:  # (gone, or no such line: then RLIMIT_DATA alone bounds it)
        return 0


def _status_bytes(pid: str, field: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/{pid}/status")


def _read(
    fd: int, seconds: float, cancelled: threading.Event | None, pid: int, memory: int
) -> bytes:
    """The child's whole output, read as it comes, within the deadline and while the child
    `pid` holds no more than `memory` bytes beyond what it said it held as it began."""
    deadline = time.monotonic() + seconds
    data = b""
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
                return data
            data += chunk
        elif len(data) == _HELD.size:  # (compiling: it said what it held, not yet how it went)
            (held,) = _HELD.unpack(data)
            if _anonymous_bytes(pid) - held > memory:
                raise CompileLimitError(_too_much(memory))


def _how(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit status {os.WEXITSTATUS(status)}"
