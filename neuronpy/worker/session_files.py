"""Session files on disk: a snapshot's KV and token ids in one safetensors file, written whole.

A session is one safetensors file: per layer `layers.N.keys` and `layers.N.values`
([1, kv_heads, tokens, head_dim]); for a model whose other layers keep fixed-size states
(arch/mixer.py), per such layer its tensors `states.N.I` ([1, ...], each its own shape and
dtype: the states after the last token); and, as metadata, the format, the model's name and
fingerprint, the KV dtype and the token ids the KV holds. A session continues only on the model
that saved it: the same weights (the fingerprint), the same dtype.

A session file is untrusted input: anyone who can write to the directory can put anything
there (a FIFO, a link, a crafted header). Every read goes through `_open_regular` (no blocking
open, no link followed, the file checked to be the one that was looked at) and `_parse_header`
(every field checked, bounded JSON), and everything one file does wrong is a SessionFileError
(or SessionFileMissing) whose message says why, never where: no path.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from neuronpy.files import NotRegularFile, open_regular, replace_atomically
from neuronpy.jsontext import json_depth

FORMAT = "neuronpy-session/1"
SAMPLE = 256  # values of each weight tensor the fingerprint hashes

# bounds on what a header may hold: a header of 32 MiB holds some 2.7M token ids, and more
# layers than any model has; beyond them a file is refused before its header is parsed
MAX_HEADER_BYTES = 32 << 20
MAX_LAYERS = 1024
MAX_TOKEN_ID = 2**31  # token ids are in [0, 2**31), as the tokenizers' are
MAX_DIM = 2**31
MAX_MODEL_NAME = 256
MAX_CREATED = 64
HEADER_DEPTH = 3  # {tensor: {"shape": [...]}}: the deepest a safetensors header nests
# the KV dtypes a session may hold: safetensors' names and the metadata's (torch's) names
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}
DTYPE_CODES = {str(dtype).removeprefix("torch."): code for code, dtype in DTYPES.items()}
FINGERPRINT = re.compile(r"[0-9a-f]{32}")  # model_fingerprint's
# a flat JSON list of integers, nothing else: no nesting, floats, NaN, strings; each a token
# id, or an image's token (a media id: negative, of up to 90 digits; neuronpy/media.py)
_ID = r"(?:0|[1-9][0-9]{0,9}|-[1-9][0-9]{6,89})"
TOKEN_IDS = re.compile(rf"\[\s*(?:{_ID}\s*(?:,\s*{_ID}\s*)*)?\]")
# a fixed-size-state tensor's name: states.<layer>.<index>, and the bounds on them
STATE_NAME = re.compile(r"states\.(0|[1-9][0-9]{0,3})\.(0|[1-9])")
MAX_STATE_DIMS = 4  # a state tensor's dims after its leading 1
MAX_STATE_VALUES = 2**31
_TENSOR_FIELDS = {"dtype", "shape", "data_offsets"}


class SessionFileError(ValueError):
    """A session file that cannot be used. The message says why, never where (no path): it
    ends up in the response of the request that named the session."""


class SessionFileMissing(FileNotFoundError):
    """There is no session file (never saved, or deleted meanwhile)."""


# what reading a session file raises (nothing else: see _one_file)
SESSION_ERRORS = (SessionFileError, SessionFileMissing)


@dataclass(frozen=True)
class SessionHeader:
    """A session file's header, checked: its metadata and the layout of its KV tensors."""

    model: str
    fingerprint: str
    dtype: str  # torch's name: float32
    token_ids: tuple[int, ...]
    layers: int
    kv_heads: int
    head_dim: int
    size: int  # bytes
    modified: float  # seconds since the epoch
    # (name, absolute offset of its data, its bytes), in file order
    tensors: tuple[tuple[str, int, int], ...]
    value_dim: int  # the values' width: head_dim, or 0 (latent attention keeps none apart)
    # per fixed-size-state layer, its tensors' (shape, safetensors dtype code), in index order
    states: tuple[tuple[tuple[tuple[int, ...], str], ...], ...] = ()


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
    states: Sequence[Sequence[torch.Tensor]] = (),
) -> None:
    """Writes a session file whole or not at all (a temporary file, then a rename: whatever
    was at `path`, a link or a FIFO included, is replaced, never written through)."""
    tensors = {}
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        tensors[f"layers.{layer}.keys"] = k.contiguous()
        tensors[f"layers.{layer}.values"] = v.contiguous()
    for layer, st in enumerate(states):
        for i, t in enumerate(st):
            tensors[f"states.{layer}.{i}"] = t.contiguous()
    meta = {**metadata, "token_ids": json.dumps(list(token_ids)), "tokens": str(len(token_ids))}
    replace_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def read_header(path: Path) -> SessionHeader:
    """The session file's header, every field checked (its tensors' data is not read). Raises
    SessionFileMissing when there is no such file, SessionFileError when it is not a session
    file neuronpy can read, and nothing else."""
    with _one_file(), _open_regular(path) as (fd, st):
        return _parse_header(fd, st)


def read_session(
    path: Path,
    device: torch.device,
    *,
    fingerprint: str,
    dtype: torch.dtype,
    layers: int,
    kv_heads: int,
    head_dim: int,
    states: Sequence[Sequence[tuple[tuple[int, ...], torch.dtype]]] = (),
    value_dim: int | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int], list[tuple[torch.Tensor, ...]]]:
    """A session's KV on `device`, its token ids and its fixed-size states (per such layer,
    each tensor's shape without the leading 1, and dtype: `states`, the model's), checked
    against the model that will use it (the file may have changed since its header was
    read). Raises SESSION_ERRORS only."""
    with _one_file(), _open_regular(path) as (fd, st):
        header = _parse_header(fd, st)  # one open file: the header, then the tensors
        if header.fingerprint != fingerprint:
            raise SessionFileError("it was saved from another model")
        expected = (layers, kv_heads, head_dim, str(dtype).removeprefix("torch."))
        got = (header.layers, header.kv_heads, header.head_dim, header.dtype)
        if got != expected or header.value_dim != (head_dim if value_dim is None else value_dim):
            raise SessionFileError(
                f"it holds {got[0]} layers x {got[1]} KV heads x {got[2]} dims in {got[3]}, "
                f"the model {expected[0]} x {expected[1]} x {expected[2]} in {expected[3]}"
            )
        want = tuple(
            tuple(((1, *shape), DTYPE_CODES[str(dt).removeprefix("torch.")]) for shape, dt in st)
            for st in states
        )
        if header.states != want:
            raise SessionFileError(
                f"its fixed-size states {_short(header.states)} are not the model's {_short(want)}"
            )
        shapes = {
            f"states.{layer}.{i}": (shape, DTYPES[code])
            for layer, st in enumerate(want)
            for i, (shape, code) in enumerate(st)
        }
        shape = (1, kv_heads, len(header.token_ids), head_dim)
        value_shape = (*shape[:3], header.value_dim)
        tensors = {}
        for name, offset, nbytes in header.tensors:
            kv_shape = value_shape if name.endswith(".values") else shape
            shaped, typed = shapes.get(name, (kv_shape, dtype))
            tensors[name] = _read_into(fd, offset, nbytes).view(typed).reshape(shaped).to(device)
        after = os.fstat(fd)
        if (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
            raise SessionFileError("it changed while it was read")
    keys = [tensors[f"layers.{i}.keys"] for i in range(layers)]
    values = [tensors[f"layers.{i}.values"] for i in range(layers)]
    kept = [
        tuple(tensors[f"states.{layer}.{i}"] for i in range(len(st)))
        for layer, st in enumerate(want)
    ]
    return keys, values, list(header.token_ids), kept


# ---- the guarded reader ----------------------------------------------------------------------


@contextlib.contextmanager
def _one_file() -> Iterator[None]:
    """Whatever one file does wrong is that file's SessionFileError, never another exception
    (a RecursionError or an OverflowError from a crafted header would otherwise reach the
    device worker's loop, or the server as a 500), and never a message naming its path."""
    try:
        yield
    except SESSION_ERRORS:
        raise
    except FileNotFoundError:
        raise SessionFileMissing("there is no such session file") from None
    except OSError as exc:  # (its str names the path)
        raise SessionFileError(exc.strerror or type(exc).__name__) from None
    except (ValueError, TypeError, KeyError, OverflowError, RecursionError, MemoryError) as exc:
        raise SessionFileError(f"it is malformed ({type(exc).__name__})") from None
    except RuntimeError as exc:  # torch's: no memory for the KV it holds, on the CPU or device
        raise SessionFileError(f"its KV cannot be loaded ({type(exc).__name__})") from None


@contextlib.contextmanager
def _open_regular(path: Path) -> Iterator[tuple[int, os.stat_result]]:
    """The file at `path`, open for reading, and its stat, as files.open_regular opens it (a
    regular file: no link followed, no blocking open); what is not one is a SessionFileError."""
    try:
        with open_regular(path) as opened:
            yield opened
    except NotRegularFile as exc:
        raise SessionFileError(str(exc)) from None


def _read_exact(fd: int, offset: int, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = os.pread(fd, n - len(data), offset + len(data))
        if not chunk:
            raise SessionFileError("it is truncated")
        data += chunk
    return bytes(data)


def _read_into(fd: int, offset: int, nbytes: int) -> torch.Tensor:
    """`nbytes` of the file from `offset`, read straight into a new tensor's storage."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview(out.numpy())
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise SessionFileError("it is truncated")
        done += n
    return out


def _parse_header(fd: int, st: os.stat_result) -> SessionHeader:
    """The header of the open file, every field checked: the metadata, and tensors that are
    exactly the layers' keys and values, of one shape and dtype, filling the file."""
    size = st.st_size
    if size < 8:
        raise SessionFileError("it is truncated")
    (length,) = struct.unpack("<Q", _read_exact(fd, 0, 8))
    if length > MAX_HEADER_BYTES:
        raise SessionFileError(f"its header claims {length} bytes, over {MAX_HEADER_BYTES}")
    if 8 + length > size:
        raise SessionFileError("it is truncated")
    header = _bounded_json(_read_exact(fd, 8, length).decode("utf-8"), HEADER_DEPTH)
    if not isinstance(header, dict):
        raise SessionFileError("its header is not a safetensors header")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise SessionFileError("its metadata is missing or not a map of strings")
    if meta.get("format") != FORMAT:
        raise SessionFileError(f"it is not a {FORMAT} file (format {_short(meta.get('format'))})")
    model = meta.get("model")
    if not (isinstance(model, str) and 0 < len(model) <= MAX_MODEL_NAME and model.isprintable()):
        raise SessionFileError(f"its model name {_short(model)} is not a name")
    fingerprint = meta.get("fingerprint")
    if not isinstance(fingerprint, str) or not FINGERPRINT.fullmatch(fingerprint):
        raise SessionFileError(f"its fingerprint {_short(fingerprint)} is not 32 hex digits")
    dtype = meta.get("dtype")
    if dtype not in DTYPE_CODES:
        raise SessionFileError(f"its dtype {_short(dtype)} is not one of {sorted(DTYPE_CODES)}")
    token_ids = _token_ids(meta.get("token_ids"))
    if "tokens" in meta and meta["tokens"] != str(len(token_ids)):
        raise SessionFileError(f"it says {_short(meta['tokens'])} tokens, holds {len(token_ids)}")
    if len(meta.get("created", "")) > MAX_CREATED:
        raise SessionFileError("its creation time is not a time")
    states, state_tensors = _state_layout(header)
    layers, kv_heads, head_dim, value_dim, tensors = _layout(
        header, DTYPE_CODES[dtype], len(token_ids)
    )
    tensors = sorted(tensors + state_tensors, key=lambda t: t[1])
    data_start = 8 + length
    end = data_start
    for _name, offset, nbytes in tensors:
        if data_start + offset != end:
            raise SessionFileError("its tensors do not follow each other")
        end += nbytes
    if end != size:
        raise SessionFileError(f"it is {size} bytes, its header says {end}: truncated or padded")
    return SessionHeader(
        model=model,
        fingerprint=fingerprint,
        dtype=dtype,
        token_ids=token_ids,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        size=size,
        modified=st.st_mtime,
        tensors=tuple((name, data_start + offset, nbytes) for name, offset, nbytes in tensors),
        value_dim=value_dim,
        states=states,
    )


def _state_layout(
    header: dict[str, Any],
) -> tuple[tuple[tuple[tuple[tuple[int, ...], str], ...], ...], list[tuple[str, int, int]]]:
    """Takes the fixed-size-state tensors out of `header`: per layer its tensors' (shape,
    dtype code), index by index, and the tensors (name, offset in the data, bytes). Their
    names must be states.N.I for layers 0..n-1, each with indices 0..k-1."""
    found: dict[int, dict[int, tuple[tuple[int, ...], str]]] = {}
    tensors = []
    for name in [n for n in header if n.startswith("states.")]:
        match = STATE_NAME.fullmatch(name)
        entry = header.pop(name)
        if match is None or int(match[1]) >= MAX_LAYERS:
            raise SessionFileError(f"its tensor {_short(name)} is not a state's name")
        if not isinstance(entry, dict) or set(entry) != _TENSOR_FIELDS:
            raise SessionFileError(f"its tensor {name} is not described as safetensors does")
        code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        dims = len(shape) if isinstance(shape, list) else 0
        if code not in DTYPES or not (
            2 <= dims <= 1 + MAX_STATE_DIMS
            and _ints(shape, dims, MAX_DIM)
            and shape[0] == 1
            and math.prod(shape) < MAX_STATE_VALUES
        ):
            raise SessionFileError(
                f"its tensor {name} is {_short(code)} {_short(shape)}, not a state's"
            )
        nbytes = math.prod(shape) * DTYPES[code].itemsize
        if not _ints(offsets, 2, 2**63) or offsets[1] - offsets[0] != nbytes:
            raise SessionFileError(f"its tensor {name} has offsets {_short(offsets)}")
        found.setdefault(int(match[1]), {})[int(match[2])] = (tuple(shape), code)
        tensors.append((name, offsets[0], nbytes))
    if set(found) != set(range(len(found))) or any(
        set(st) != set(range(len(st))) for st in found.values()
    ):
        raise SessionFileError("its states are not numbered layer by layer from 0")
    layout = tuple(tuple(found[i][j] for j in range(len(found[i]))) for i in range(len(found)))
    return layout, tensors


def _layout(
    header: dict[str, Any], code: str, tokens: int
) -> tuple[int, int, int, int, list[tuple[str, int, int]]]:
    """(layers, kv heads, head dim, the values' dim, the tensors sorted by offset: name,
    offset in the data, bytes) of a header whose entries are exactly layers.N.keys and
    layers.N.values for N in 0..layers-1, each `code`, the keys of shape [1, kv_heads, tokens,
    head_dim] and the values the same or of width 0 (latent attention's)."""
    layers = len(header) // 2
    names = {f"layers.{i}.{kind}" for i in range(layers) for kind in ("keys", "values")}
    if not 0 < layers <= MAX_LAYERS or set(header) != names:
        raise SessionFileError(
            f"its {len(header)} tensors are not the keys and values of 1-{MAX_LAYERS} layers"
        )
    first = header["layers.0.keys"]
    shape = first.get("shape") if isinstance(first, dict) else None
    if not (_ints(shape, 4, MAX_DIM) and shape[0] == 1 and shape[2] == tokens):
        raise SessionFileError(
            f"its KV shape {_short(shape)} is not [1, kv_heads, {tokens} tokens, head_dim]"
        )
    values = header["layers.0.values"]
    value_shape = values.get("shape") if isinstance(values, dict) else None
    if value_shape != shape and value_shape != [*shape[:3], 0]:
        raise SessionFileError(f"its values' shape {_short(value_shape)} is not its keys'")
    tensors = []
    for name in sorted(names):
        entry = header[name]
        if not isinstance(entry, dict) or set(entry) != _TENSOR_FIELDS:
            raise SessionFileError(f"its tensor {name} is not described as safetensors does")
        want = value_shape if name.endswith(".values") else shape
        nbytes = math.prod(want) * DTYPES[code].itemsize
        if entry["dtype"] != code or entry["shape"] != want:
            raise SessionFileError(
                f"its tensor {name} is {_short(entry['dtype'])} {_short(entry['shape'])}, "
                f"the others {code} {shape}"
            )
        offsets = entry["data_offsets"]
        if not _ints(offsets, 2, 2**63) or offsets[1] - offsets[0] != nbytes:
            raise SessionFileError(f"its tensor {name} has offsets {_short(offsets)}")
        tensors.append((name, offsets[0], nbytes))
    tensors.sort(key=lambda t: t[1])
    return layers, shape[1], shape[3], value_shape[3], tensors


def _ints(value: object, n: int, bound: int) -> bool:
    """Whether `value` is a list of `n` ints (not bools) in [0, bound)."""
    return (
        isinstance(value, list)
        and len(value) == n
        and all(type(x) is int and 0 <= x < bound for x in value)
    )


def _token_ids(text: object) -> tuple[int, ...]:
    """A flat JSON list of token ids in [0, MAX_TOKEN_ID), checked by one pattern before it is
    split: nothing nested, no floats, NaN, strings or negatives gets as far as a parser."""
    if not isinstance(text, str) or not TOKEN_IDS.fullmatch(text):
        raise SessionFileError("its token ids are not a list of token ids")
    inner = text.strip()[1:-1].strip()
    ids = tuple(int(t) for t in inner.split(",")) if inner else ()
    if any(t >= MAX_TOKEN_ID for t in ids):
        raise SessionFileError(f"its token ids are not all below {MAX_TOKEN_ID}")
    return ids


def _bounded_json(text: str, max_depth: int) -> Any:
    """JSON nested at most `max_depth` deep (json's recursion would raise RecursionError on a
    deeply nested one), without NaN or Infinity, without repeated keys."""
    if json_depth(text) > max_depth:
        raise SessionFileError(f"its header nests deeper than {max_depth}")
    return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys)


def _no_constant(name: str) -> Any:
    raise SessionFileError(f"its header holds {name}")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise SessionFileError("its header repeats a key")
    return out


def _short(value: object, limit: int = 40) -> str:
    """A value of the file, quoted and cut short, for a message."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."
