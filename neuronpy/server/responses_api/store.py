"""Stored responses (the Responses API's `store`): held in memory as their compact JSON, and
with sessions on also one file each in the sessions directory, bounded there too; a file read
back is untrusted input, checked against the exact shape the server writes.

Memory: an entry is held as the bytes of its JSON, not as parsed objects, so that what the
budget counts is what it costs (parsed, JSON such as a long list of `{}` takes some 20 times
its text). GET answers those bytes as they are; a follow-up parses its conversation.

Disk: each stored response is `resp_<hex>.response.json`, and its KV a session file named by
its id (written by the engine, see `open_session`). Both are removed, oldest first, past
`StoreLimits.disk_files` stored responses or `disk_bytes` of their files and KV together.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from neuronpy.engine.sessions import SUFFIX as SESSION_SUFFIX
from neuronpy.errors import InvalidRequestError
from neuronpy.files import NotRegularFile, open_regular, replace_atomically
from neuronpy.server.response_ids import RESPONSE_ID
from neuronpy.server.responses_api.shape import valid_conversation, valid_response
from neuronpy.server.structure import decode_json

log = logging.getLogger(__name__)

MAX_STORED_BYTES = 64 << 20  # stored responses held in memory, together; the oldest go first
# One stored response's JSON. The server never writes more (its echo of a 4 MiB body, and a
# conversation that fits a context), and it bounds what reading a hostile file can cost.
MAX_ENTRY_BYTES = 16 << 20
# On disk, with sessions on: the KV beside each response dominates (~46 KB per token of the
# conversation on the default model), so its bytes are bounded; the count bounds the index of
# them the server holds (and scans at startup). The oldest go first past either.
MAX_FILES = 10_000
MAX_DISK_BYTES = 16 << 30
# What holding one entry costs beside its JSON's bytes: its id, the record, the bytes objects'
# headers, the index's slot (some 350 bytes, measured; rounded up)
ENTRY_OVERHEAD = 512
RESPONSE_SUFFIX = ".response.json"  # beside the sessions (not named like one)


# ---- entries ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreLimits:
    """The store's bounds (see the module's constants for why each)."""

    memory_bytes: int = MAX_STORED_BYTES
    entry_bytes: int = MAX_ENTRY_BYTES
    disk_files: int = MAX_FILES
    disk_bytes: int = MAX_DISK_BYTES


@dataclass(frozen=True, slots=True)
class Stored:
    """A stored response as held: compact JSON in UTF-8, the response (what GET answers) and its
    conversation (chat messages: its input without instructions, then its reply)."""

    response: bytes
    conversation: bytes

    @classmethod
    def of(cls, response: dict[str, Any], conversation: list[dict[str, Any]]) -> Stored:
        """Raises ValueError for what is not JSON (a non-finite number, a lone surrogate)."""
        return cls(_compact(response), _compact(conversation))

    @property
    def size(self) -> int:
        """What holding it costs in memory."""
        return len(self.response) + len(self.conversation) + ENTRY_OVERHEAD

    def messages(self) -> list[dict[str, Any]]:
        """Its conversation, parsed (a new list each time)."""
        messages: list[dict[str, Any]] = json.loads(self.conversation)
        return messages

    def file_bytes(self) -> bytes:
        return b'{"response":' + self.response + b',"conversation":' + self.conversation + b"}"


def _compact(value: object) -> bytes:
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.encode("utf-8")


# ---- the store ----------------------------------------------------------------------------------


class ResponseStore:
    """Stored responses: in memory within `limits.memory_bytes` (the oldest dropped first);
    and with a `directory` (the sessions directory) also on disk, one file each, within
    `limits.disk_files` and `limits.disk_bytes` (the oldest removed first, with their KV's
    session files), so that they outlive a restart. A file read back is untrusted: one that is
    not exactly what the server writes is as good as absent."""

    def __init__(self, directory: Path | None = None, limits: StoreLimits | None = None) -> None:
        self.directory = directory
        self.limits = limits or StoreLimits()
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # the memory's; taken briefly, on the event loop too
        # what is on disk: id -> bytes of its file and KV, oldest first; only threads take
        # this lock (a write can take a while), and may take the memory's inside it
        self._disk: OrderedDict[str, int] = OrderedDict()
        self._disk_bytes = 0
        self._disk_lock = threading.Lock()
        if directory is not None:
            self._scan()

    @property
    def memory_bytes(self) -> int:
        """What the entries held in memory cost, together."""
        return self._bytes

    # (memory)

    def _remember(self, rid: str, stored: Stored) -> None:
        with self._lock:
            old = self._items.pop(rid, None)
            if old is not None:
                self._bytes -= old.size
            self._items[rid] = stored
            self._bytes += stored.size
            while self._bytes > self.limits.memory_bytes and len(self._items) > 1:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= dropped.size

    def _forget(self, rid: str) -> bool:
        with self._lock:
            stored = self._items.pop(rid, None)
            if stored is not None:
                self._bytes -= stored.size
        return stored is not None

    # (disk)

    def _file(self, rid: str) -> Path | None:
        if self.directory is None or not RESPONSE_ID.fullmatch(rid):
            return None
        return self.directory / f"{rid}{RESPONSE_SUFFIX}"

    def _kv_file(self, rid: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{rid}{SESSION_SUFFIX}"

    def _on_disk_bytes(self, rid: str, file_size: int) -> int:
        """Its file's size and its KV's (when it has a session file)."""
        try:
            info = os.lstat(self._kv_file(rid))
        except OSError:
            return file_size
        return file_size + (info.st_size if stat.S_ISREG(info.st_mode) else 0)

    def _scan(self) -> None:
        """The stored responses already on disk (a restart), oldest first; past the limits,
        the oldest removed."""
        assert self.directory is not None
        found = []
        try:
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    rid = entry.name.removesuffix(RESPONSE_SUFFIX)
                    if rid == entry.name or not RESPONSE_ID.fullmatch(rid):
                        continue
                    with contextlib.suppress(OSError):
                        info = entry.stat(follow_symlinks=False)
                        found.append((info.st_mtime_ns, rid, info.st_size))
        except OSError as exc:
            log.warning("stored responses on disk not scanned: %s", exc.strerror)
        with self._disk_lock:
            for _, rid, size in sorted(found):
                self._index(rid, self._on_disk_bytes(rid, size))
            self._trim()

    def _index(self, rid: str, size: int) -> None:
        self._disk_bytes += size - self._disk.pop(rid, 0)
        self._disk[rid] = size

    def _trim(self) -> None:
        """The oldest on disk removed (from memory too) while past a limit; the newest stays."""
        lim = self.limits
        while len(self._disk) > 1 and (
            len(self._disk) > lim.disk_files or self._disk_bytes > lim.disk_bytes
        ):
            rid, size = self._disk.popitem(last=False)
            self._disk_bytes -= size
            self._forget(rid)
            self._unlink(rid)

    def _unlink(self, rid: str) -> bool:
        """Removes its file and its KV's session file (a link itself, never its target)."""
        path = self._file(rid)
        assert path is not None
        removed = False
        for file in (path, self._kv_file(rid)):
            try:
                file.unlink()
                removed = removed or file == path
            except FileNotFoundError:
                pass
            except OSError as exc:  # (a directory named so; its str names the path)
                log.warning("stored response %s: a file not removed: %s", rid, exc.strerror)
        return removed

    def _save(self, rid: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        try:
            stored = Stored.of(response, conversation)
        except ValueError as exc:  # (the request's checks keep such values out)
            log.warning("response %s not stored: it is not JSON (%s)", rid, exc)
            return
        if stored.size > self.limits.entry_bytes:
            log.warning(
                "response %s not stored: %d bytes, past the %d a stored response may take",
                rid,
                stored.size,
                self.limits.entry_bytes,
            )
            return
        path = self._file(rid)
        with self._disk_lock:
            self._remember(rid, stored)
            if path is None:
                return
            data = stored.file_bytes()
            try:
                replace_atomically(path, lambda tmp: tmp.write_bytes(data))
            except OSError as exc:
                log.warning("stored response %s not written to disk: %s", rid, exc.strerror)
                return
            self._index(rid, self._on_disk_bytes(rid, len(data)))
            self._trim()

    def _load(self, rid: str) -> Stored | None:
        path = self._file(rid)
        if path is None:
            return None
        with self._disk_lock:
            read = _read_stored(path, rid, self.limits.entry_bytes)
            if read is None:
                return None
            stored, file_size = read
            if rid not in self._disk:  # (placed there since the server started)
                self._index(rid, self._on_disk_bytes(rid, file_size))
            self._remember(rid, stored)
            return stored

    def _delete(self, rid: str) -> bool:
        with self._disk_lock:
            held = self._forget(rid)
            if self._file(rid) is None:
                return held
            self._disk_bytes -= self._disk.pop(rid, 0)
            return self._unlink(rid) or held

    # (the API)

    async def put(
        self, rid: str, response: dict[str, Any], conversation: list[dict[str, Any]]
    ) -> None:
        """Stores the response (unless it is past `limits.entry_bytes`: then it is only
        logged); with a directory also on disk, the oldest removed past the disk's limits."""
        await anyio.to_thread.run_sync(self._save, rid, response, conversation)

    async def get(self, rid: str) -> Stored | None:
        with self._lock:
            found = self._items.get(rid)
        if found is not None or self._file(rid) is None:
            return found
        return await anyio.to_thread.run_sync(self._load, rid)

    async def delete(self, rid: str) -> bool:
        """Removes it from memory and its file from disk; False if there was neither. (Its
        KV's session file too, when it is on disk.)"""
        return await anyio.to_thread.run_sync(self._delete, rid)


# ---- files read back ----------------------------------------------------------------------------


def _read_stored(path: Path, rid: str, max_bytes: int) -> tuple[Stored, int] | None:
    """Stored response `rid`'s file and its size, or None when there is none or it is not one:
    a regular file (never a link, never a blocking open) of at most `max_bytes`, JSON as a
    request must be (finite numbers, bounded nesting, valid Unicode) holding exactly what the
    server writes (see `valid_response`, `valid_conversation`)."""
    try:
        raw = _read_regular(path, max_bytes)
        if raw is None:
            return None
        data = decode_json(raw)
    except (OSError, InvalidRequestError, RecursionError):
        return None
    if not isinstance(data, dict) or set(data) != {"response", "conversation"}:
        return None
    response, conversation = data["response"], data["conversation"]
    if not valid_response(response, rid) or not valid_conversation(conversation):
        return None
    try:
        return Stored.of(response, conversation), len(raw)
    except ValueError:
        return None


def _read_regular(path: Path, max_bytes: int) -> bytes | None:
    """The file's bytes if it is a regular file (files.open_regular: no link followed, no
    blocking open) of at most `max_bytes`, else None."""
    try:
        with open_regular(path) as (fd, opened):
            if opened.st_size > max_bytes:
                return None
            with os.fdopen(os.dup(fd), "rb") as file:
                raw = file.read(max_bytes + 1)
    except (FileNotFoundError, NotRegularFile):
        return None
    return raw if len(raw) <= max_bytes else None
