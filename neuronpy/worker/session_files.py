"""Session files on disk: a snapshot's KV and token ids in one safetensors file, written whole.

A session is one safetensors file: per layer `layers.N.keys` and `layers.N.values`
([1, kv_heads, tokens, head_dim]) and, as metadata, the format, the model's name and
fingerprint, the KV dtype and shape, and the token ids the KV holds. A session continues only
on the model that saved it: the same weights (the fingerprint), the same dtype.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

FORMAT = "neuronpy-session/1"
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


def session_metadata(model: str, fingerprint: str, dtype: torch.dtype) -> dict[str, str]:
    """The metadata a saved session carries, but its token ids (the worker adds those)."""
    return {
        "format": FORMAT,
        "model": model,
        "fingerprint": fingerprint,
        "dtype": str(dtype).removeprefix("torch."),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


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
