"""Files in a directory others may write to (the sessions directory): read only when regular,
written whole or not at all. A leaf: no torch, nothing of neuronpy's."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path


class NotRegularFile(ValueError):
    """The path is not a regular file (the message says what it is), or it was replaced while
    it was opened. The message names no path."""


@contextlib.contextmanager
def open_regular(path: Path) -> Iterator[tuple[int, os.stat_result]]:
    """The file at `path`, open for reading, and its stat: a regular file, never a link, and
    never a blocking open. open() of a FIFO waits for a writer (safetensors' own open waits
    holding the GIL: every thread of the server stops). So: lstat first (no link followed),
    then open with O_NONBLOCK (a FIFO swapped in meanwhile opens at once) and O_NOFOLLOW (nor
    a link), then fstat the open file and compare it with what lstat saw. FileNotFoundError
    when there is none; NotRegularFile."""
    before = os.lstat(path)
    _check_regular(before)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFile("it is a symbolic link, not a regular file") from None
        raise
    try:
        opened = os.fstat(fd)
        _check_regular(opened)
        if (opened.st_dev, opened.st_ino) != (before.st_dev, before.st_ino):
            raise NotRegularFile("it was replaced while it was opened")
        yield fd, opened
    finally:
        os.close(fd)


def _check_regular(st: os.stat_result) -> None:
    if stat.S_ISREG(st.st_mode):
        return
    kinds = {
        stat.S_ISLNK: "a symbolic link",
        stat.S_ISDIR: "a directory",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISSOCK: "a socket",
        stat.S_ISCHR: "a device",
        stat.S_ISBLK: "a device",
    }
    kind = next((k for test, k in kinds.items() if test(st.st_mode)), "of another kind")
    raise NotRegularFile(f"it is {kind}, not a regular file")


def replace_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """`write` a temporary file beside `path`, then rename it there: `path` is written whole
    or not at all, and whatever was there (a link or a FIFO included) is replaced, never
    written through."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
