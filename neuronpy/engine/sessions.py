"""Sessions: a conversation's KV snapshot saved under a name, to continue it later (after a
restart too) without prefilling it again.

A session is one safetensors file in the configured directory: per layer `layers.N.keys` and
`layers.N.values` ([1, kv_heads, tokens, head_dim]) and, as metadata, the format, the model's
name and fingerprint, the KV dtype and shape, and the token ids the KV holds. A session
continues only on the model that saved it: the same weights (the fingerprint), the same dtype.
Names are plain file names; none can reach outside the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from neuronpy.errors import InvalidRequestError

FORMAT = "neuronpy-session/1"
SUFFIX = ".safetensors"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
SAMPLE = 256  # values of each weight tensor the fingerprint hashes
# what reading a session file that is not what it should be raises
SESSION_ERRORS = (OSError, ValueError, KeyError, SafetensorError)


def model_fingerprint(weights: Mapping[str, torch.Tensor], extra: Sequence[object] = ()) -> str:
    """A short hash of a model's weights (names, shapes, dtypes and a strided sample of each
    tensor's values) and of `extra` (what else changes the KV: the quantization mode). Two
    fine-tunes of one architecture differ in it; computing it reads a few values per tensor."""
    digest = hashlib.sha256(repr(tuple(extra)).encode())
    for name in sorted(weights):
        t = weights[name].detach()
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        flat = t.reshape(-1)
        if flat.numel():
            sample = flat[:: max(1, flat.numel() // SAMPLE)][:SAMPLE]
            digest.update(sample.to("cpu", torch.float64).numpy().tobytes())
    return digest.hexdigest()[:32]


@dataclass(frozen=True)
class SessionRequest:
    """What a request asks of a session: continue from it if it exists (`token_ids` is then
    what it holds), and save the conversation into it at the end (`save`)."""

    name: str
    path: Path
    save: bool = True
    token_ids: tuple[int, ...] | None = None  # None: no such session yet


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


def session_metadata(model: str, fingerprint: str, dtype: torch.dtype) -> dict[str, str]:
    """The metadata a saved session carries, but its token ids (the worker adds those)."""
    return {
        "format": FORMAT,
        "model": model,
        "fingerprint": fingerprint,
        "dtype": dtype_name(dtype),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_session(
    path: Path,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    token_ids: Sequence[int],
    metadata: Mapping[str, str],
) -> None:
    """Writes a session file whole or not at all (a temporary file, then a rename)."""
    tensors = {}
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        tensors[f"layers.{layer}.keys"] = k.contiguous()
        tensors[f"layers.{layer}.values"] = v.contiguous()
    meta = {**metadata, "token_ids": json.dumps(list(token_ids)), "tokens": str(len(token_ids))}
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_session(
    path: Path,
    device: torch.device,
    *,
    fingerprint: str,
    dtype: torch.dtype,
    layers: int,
    kv_heads: int,
    head_dim: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """A session's KV on `device` and its token ids, checked against the model that will use
    it (the file may have changed since its header was read). Raises SESSION_ERRORS."""
    with safe_open(str(path), framework="pt") as f:  # one read: header, then tensors
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT or meta.get("fingerprint") != fingerprint:
            raise ValueError("it was saved from another model")
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
    token_ids = [int(t) for t in json.loads(meta["token_ids"])]
    shape = (1, kv_heads, len(token_ids), head_dim)
    keys, values = [], []
    for layer in range(layers):
        k = tensors.get(f"layers.{layer}.keys")
        v = tensors.get(f"layers.{layer}.values")
        for t in (k, v):
            if t is None or tuple(t.shape) != shape or t.dtype != dtype:
                got = None if t is None else (tuple(t.shape), t.dtype)
                raise ValueError(f"layer {layer} holds {got}, expected {shape} {dtype}")
        keys.append(k.to(device))  # type: ignore[union-attr]
        values.append(v.to(device))  # type: ignore[union-attr]
    if len(tensors) != 2 * layers:
        raise ValueError(f"it holds {len(tensors)} tensors, expected {2 * layers}")
    return keys, values, token_ids
