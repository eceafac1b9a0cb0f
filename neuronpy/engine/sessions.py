"""Sessions: a conversation's KV snapshot saved under a name, to continue it later (after a
restart too) without prefilling it again.

A session is one file in the configured directory (its format, and the one guarded way to read
it: worker/session_files.py); this module names, lists and checks them. Names are plain file
names; none can reach outside the directory.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuronpy.errors import InvalidRequestError
from neuronpy.worker.session_files import SessionFileError, SessionFileMissing, read_header

SUFFIX = ".safetensors"
# matched whole (fullmatch): with re.match and `$`, "name\n" would pass, `$` matching before a
# final newline
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def valid_name(name: object) -> bool:
    """Whether `name` is a session name: 1-128 ASCII letters, digits and . _ -, starting with a
    letter or digit, without '..'."""
    return isinstance(name, str) and NAME.fullmatch(name) is not None and ".." not in name


@dataclass(frozen=True)
class SessionInfo:
    name: str
    model: str
    fingerprint: str
    dtype: str
    tokens: int
    bytes: int
    modified: float  # seconds since the epoch
    token_ids: tuple[int, ...]
    layers: int
    kv_heads: int
    head_dim: int

    def public(self) -> dict[str, Any]:
        """What the HTTP API shows of it."""
        return {
            "id": self.name,
            "object": "session",
            "model": self.model,
            "dtype": self.dtype,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "modified": int(self.modified),
        }


class SessionStore:
    """The sessions directory: names to paths (checked), and the files' headers. Every file is
    untrusted: read_header refuses what is not a regular file and checks every field, and any
    failure of one file is an InvalidRequestError naming the session, never its path."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory).expanduser().resolve()
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, name: object) -> Path:
        """The file of session `name`; InvalidRequestError for a name that is not a plain file
        name of letters, digits and . _ - (so none reaches outside the directory). A link placed
        in the directory under that name is refused when it is read, never followed."""
        if not valid_name(name):
            raise InvalidRequestError(
                "a session name must be 1-128 letters, digits and . _ - (starting with a letter "
                f"or digit, no '..'), got {name!r}",
                "session",
            )
        return self.directory / f"{name}{SUFFIX}"

    def info(self, name: str) -> SessionInfo | None:
        """The session's header, or None if there is no such session. Raises
        InvalidRequestError when the file is not a session neuronpy can read."""
        path = self.path(name)
        try:
            header = read_header(path)
        except SessionFileMissing:
            return None
        except SessionFileError as exc:
            raise InvalidRequestError(
                f"session {name!r} cannot be read ({exc}); delete it and save it again", "session"
            ) from None
        return SessionInfo(
            name=name,
            model=header.model,
            fingerprint=header.fingerprint,
            dtype=header.dtype,
            tokens=len(header.token_ids),
            bytes=header.size,
            modified=header.modified,
            token_ids=header.token_ids,
            layers=header.layers,
            kv_heads=header.kv_heads,
            head_dim=header.head_dim,
        )

    def names(self) -> list[str]:
        """The sessions' names: every entry named like a session, whatever it is (a directory
        or a FIFO named so is listed too, and info() says why it cannot be read). Nothing is
        opened here."""
        try:
            with os.scandir(self.directory) as entries:
                stems = [e.name[: -len(SUFFIX)] for e in entries if e.name.endswith(SUFFIX)]
        except OSError as exc:
            raise InvalidRequestError(
                f"the sessions directory cannot be read ({exc.strerror})", "session"
            ) from None
        return sorted(s for s in stems if valid_name(s))

    def delete(self, name: str) -> bool:
        """Removes the session's entry (a link itself, never what it points to); False if
        there is none."""
        path = self.path(name)
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                raise InvalidRequestError(
                    f"session {name!r} is a directory, not a session file: it is not deleted",
                    "session",
                )
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:  # (its str names the path)
            raise InvalidRequestError(
                f"session {name!r} cannot be deleted ({exc.strerror})", "session"
            ) from None
        return True


def check_compatible(
    info: SessionInfo,
    model: str,
    fingerprint: str,
    dtype: str,
    *,
    layout: tuple[int, int, int] | None = None,
    context_len: int | None = None,
) -> None:
    """Refuses a session saved from other weights or in another dtype: its KV would be
    meaningless to this model. With `layout` (layers, KV heads, head dim) and `context_len`,
    also one whose KV has another shape or more tokens than the context holds (a file crafted
    with this model's fingerprint), so that such a file is refused here, before admission."""
    if info.dtype != dtype:
        raise InvalidRequestError(
            f"session {info.name!r} holds {info.dtype} KV; model {model!r} runs in {dtype}",
            "session",
        )
    if info.fingerprint != fingerprint:
        raise InvalidRequestError(
            f"session {info.name!r} was saved from model {info.model!r} (fingerprint "
            f"{info.fingerprint}); model {model!r} has other weights (fingerprint "
            f"{fingerprint}): a session continues only on the model that saved it",
            "session",
        )
    held = (info.layers, info.kv_heads, info.head_dim)
    if layout is not None and held != layout:
        raise InvalidRequestError(
            f"session {info.name!r} holds KV of {held[0]} layers x {held[1]} KV heads x "
            f"{held[2]} dims; model {model!r} has {layout[0]} x {layout[1]} x {layout[2]}",
            "session",
        )
    if context_len is not None and info.tokens > context_len:
        raise InvalidRequestError(
            f"session {info.name!r} holds {info.tokens} tokens, more than model {model!r}'s "
            f"context of {context_len}",
            "session",
        )


def dtype_name(dtype: object) -> str:
    """How a session names a torch dtype (float32)."""
    return str(dtype).removeprefix("torch.")
