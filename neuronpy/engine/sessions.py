"""Sessions: a conversation's KV snapshot saved under a name, to continue it later (after a
restart too) without prefilling it again.

A session is one file in the configured directory (its format: worker/session_files.py); this
module names, lists and checks them. Names are plain file names; none can reach outside the
directory.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from neuronpy.errors import InvalidRequestError
from neuronpy.worker.session_files import FORMAT, SESSION_ERRORS

SUFFIX = ".safetensors"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


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
    """The sessions directory: names to paths (checked), and the files' headers."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory).expanduser().resolve()
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, name: object) -> Path:
        """The file of session `name`; InvalidRequestError for a name that is not a plain file
        name of letters, digits and . _ - (so none reaches outside the directory)."""
        if not isinstance(name, str) or not NAME.match(name) or ".." in name:
            raise InvalidRequestError(
                "a session name must be 1-128 letters, digits and . _ - (starting with a letter "
                f"or digit, no '..'), got {name!r}",
                "session",
            )
        path = self.directory / f"{name}{SUFFIX}"
        if path.resolve().parent != self.directory:  # a symlink placed in the directory
            raise InvalidRequestError(
                f"session {name!r} is outside the sessions directory", "session"
            )
        return path

    def info(self, name: str) -> SessionInfo | None:
        """The session's header, or None if there is no such session. Raises
        InvalidRequestError when the file is not a session neuronpy can read."""
        path = self.path(name)
        try:
            stat = path.stat()
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
        except FileNotFoundError:
            return None
        except SESSION_ERRORS as exc:
            raise InvalidRequestError(
                f"session {name!r} cannot be read ({exc}); delete it and save it again", "session"
            ) from None
        if meta.get("format") != FORMAT:
            raise InvalidRequestError(
                f"session {name!r} is not a {FORMAT} file (format {meta.get('format')!r})",
                "session",
            )
        try:
            token_ids = tuple(int(t) for t in json.loads(meta["token_ids"]))
        except (KeyError, ValueError, TypeError):
            raise InvalidRequestError(
                f"session {name!r} has no readable token ids; delete it and save it again",
                "session",
            ) from None
        return SessionInfo(
            name=name,
            model=meta.get("model", ""),
            fingerprint=meta.get("fingerprint", ""),
            dtype=meta.get("dtype", ""),
            tokens=len(token_ids),
            bytes=stat.st_size,
            modified=stat.st_mtime,
            token_ids=token_ids,
        )

    def names(self) -> list[str]:
        return sorted(
            p.name[: -len(SUFFIX)]
            for p in self.directory.glob(f"*{SUFFIX}")
            if NAME.match(p.name[: -len(SUFFIX)])
        )

    def delete(self, name: str) -> bool:
        try:
            self.path(name).unlink()
        except FileNotFoundError:
            return False
        return True


def check_compatible(info: SessionInfo, model: str, fingerprint: str, dtype: str) -> None:
    """Refuses a session saved from other weights or in another dtype: its KV would be
    meaningless to this model."""
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


def dtype_name(dtype: object) -> str:
    """How a session names a torch dtype (float32)."""
    return str(dtype).removeprefix("torch.")
