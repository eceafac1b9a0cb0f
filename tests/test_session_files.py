"""Session files are untrusted input: the guarded reader refuses FIFOs, links, directories and
crafted headers promptly, with an error that never names a path; through a real server each
such file fails its own request with a 400 while the model stays healthy."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from neuronpy.engine.sessions import SessionStore, check_compatible, valid_name
from neuronpy.errors import InvalidRequestError
from neuronpy.worker import session_files
from neuronpy.worker.session_files import (
    SessionFileError,
    SessionFileMissing,
    read_header,
    read_session,
    session_metadata,
    write_session,
)
from tests.servers import fixture_model, run_server

FP = "0123456789abcdef" * 2
LAYERS, HEADS, TOKENS, DIM = 2, 2, 5, 4
CPU = torch.device("cpu")
PROMPT = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog"}]
MODEL = "tiny-llama"
# what a blocked open must be released after, at the latest: far more than a guarded read takes
PROMPTLY = 5.0


def good_session(path: Path, dtype: torch.dtype = torch.float32) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(1, HEADS, TOKENS, DIM, generator=gen).to(dtype) for _ in range(LAYERS)]
    values = [torch.randn(1, HEADS, TOKENS, DIM, generator=gen).to(dtype) for _ in range(LAYERS)]
    write_session(path, keys, values, [3, 1, 4, 1, 5], session_metadata("m", FP, dtype))
    return keys, values


def split(path: Path) -> tuple[dict[str, Any], bytes]:
    """A safetensors file's header, parsed, and its data."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_raw(path: Path, header: dict[str, Any] | str | bytes, data: bytes) -> None:
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def read(path: Path) -> tuple[list, list, list[int], list]:
    return read_session(
        path, CPU, fingerprint=FP, dtype=torch.float32, layers=LAYERS, kv_heads=HEADS, head_dim=DIM
    )


def refused(path: Path, match: str) -> SessionFileError:
    """Both readers refuse the file with a SessionFileError matching `match`, without its
    path in the message."""
    for reader in (read_header, read):
        with pytest.raises(SessionFileError, match=match) as caught:
            reader(path)
        assert str(path.parent) not in str(caught.value)
    return caught.value


@contextlib.contextmanager
def released_after(fifo: Path, seconds: float = 3 * PROMPTLY) -> Iterator[None]:
    """A writer opens `fifo` after `seconds`: a reader blocked in open() on it (a regression:
    safetensors' own open blocks holding the GIL, so nothing in this process could time it
    out) is released then, and the test fails on its time instead of hanging the suite."""
    writer = subprocess.Popen(["sh", "-c", f'sleep {seconds}; : > "$0"', str(fifo)])
    try:
        yield
    finally:
        writer.kill()  # (it blocks in its own open for good once nothing reads the FIFO)
        writer.wait()


def timed(call: Callable[[], Any]) -> tuple[BaseException | None, float]:
    began = time.monotonic()
    try:
        call()
    except BaseException as exc:
        return exc, time.monotonic() - began
    return None, time.monotonic() - began


# ---- the guarded reader ----------------------------------------------------------------------


STATE_LAYOUT = [[((3, 2), torch.bfloat16), ((2, 4, 4), torch.float32)]]  # one layer's two


def session_with_states(path: Path) -> list[tuple[torch.Tensor, ...]]:
    """A good session of a hybrid model: KV, and one layer's fixed-size states (a conv window
    in bf16 and a recurrent state in float32)."""
    gen = torch.Generator().manual_seed(1)
    keys = [torch.randn(1, HEADS, TOKENS, DIM, generator=gen) for _ in range(LAYERS)]
    states = [tuple(torch.randn(1, *shape, generator=gen).to(dt) for shape, dt in STATE_LAYOUT[0])]
    meta = session_metadata("m", FP, torch.float32)
    values = [k.clone() for k in keys]
    write_session(path, keys, values, [3, 1, 4, 1, 5], meta, states)
    return states


def read_hybrid(path: Path, layout: Any = STATE_LAYOUT) -> Any:
    return read_session(
        path,
        CPU,
        fingerprint=FP,
        dtype=torch.float32,
        layers=LAYERS,
        kv_heads=HEADS,
        head_dim=DIM,
        states=layout,
    )


def test_fixed_size_states_read_back_exactly_and_must_be_the_models(tmp_path: Path) -> None:
    path = tmp_path / "s.safetensors"
    states = session_with_states(path)
    assert read_header(path).states == ((((1, 3, 2), "BF16"), ((1, 2, 4, 4), "F32")),)
    *_, got = read_hybrid(path)
    assert len(got) == 1
    assert all(torch.equal(a, b) for a, b in zip(got[0], states[0], strict=True))
    assert got[0][0].dtype == torch.bfloat16 and got[0][1].dtype == torch.float32
    for other in ([[((3, 2), torch.float32), STATE_LAYOUT[0][1]]], [], [STATE_LAYOUT[0][:1]]):
        with pytest.raises(SessionFileError, match="fixed-size states"):
            read_hybrid(path, other)
    with pytest.raises(SessionFileError, match="fixed-size states"):
        read(path)  # a model without them


@pytest.mark.parametrize(
    ("name", "shape", "match"),
    [
        ("states.0.x", [1, 3, 2], "not a state's name"),
        ("states.01.1", [1, 3, 2], "not a state's name"),
        ("states.0.2", [1, 3, 2], "numbered layer by layer"),
        ("states.0.1", [2, 3, 2], "not a state's"),
        ("states.0.1", [1], "not a state's"),
        ("states.0.1", [1, 2, 2, 2, 2, 2], "not a state's"),
    ],
)
def test_crafted_state_tensors_are_refused(
    tmp_path: Path, name: str, shape: list[int], match: str
) -> None:
    path = tmp_path / "s.safetensors"
    session_with_states(path)
    header, data = split(path)
    entry = header.pop("states.0.1")
    nbytes = 4
    for n in shape:
        nbytes *= n
    lo = entry["data_offsets"][0]
    header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [lo, lo + nbytes]}
    write_raw(path, header, data)
    refused(path, match)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_good_session_reads_back_exactly(tmp_path: Path, dtype: torch.dtype) -> None:
    path = tmp_path / "s.safetensors"
    keys, values = good_session(path, dtype)
    header = read_header(path)
    assert (header.layers, header.kv_heads, header.head_dim) == (LAYERS, HEADS, DIM)
    assert header.token_ids == (3, 1, 4, 1, 5) and header.size == path.stat().st_size
    got_keys, got_values, ids, _ = read_session(
        path, CPU, fingerprint=FP, dtype=dtype, layers=LAYERS, kv_heads=HEADS, head_dim=DIM
    )
    assert ids == [3, 1, 4, 1, 5]
    assert all(torch.equal(a, b) for a, b in zip(got_keys, keys, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got_values, values, strict=True))


def test_a_fifo_is_refused_at_once_not_opened_for_good(tmp_path: Path) -> None:
    fifo = tmp_path / "f.safetensors"
    os.mkfifo(fifo)
    link = tmp_path / "l.safetensors"
    link.symlink_to(fifo)
    with released_after(fifo):
        for path, kind in [(fifo, "a FIFO"), (link, "a symbolic link")]:
            for reader in (read_header, read):
                error, seconds = timed(lambda r=reader, p=path: r(p))
                assert seconds < PROMPTLY, f"{reader.__name__}({path.name}) blocked {seconds}s"
                assert isinstance(error, SessionFileError) and kind in str(error), error


def test_a_fifo_swapped_in_after_the_check_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between lstat and open the entry becomes a FIFO: the open does not block (O_NONBLOCK)
    and fstat sees what was opened. A regular file swapped in is caught by its inode."""
    decoy = tmp_path / "decoy.safetensors"
    good_session(decoy)
    fifo = tmp_path / "f.safetensors"
    os.mkfifo(fifo)
    other = tmp_path / "other.safetensors"
    good_session(other)
    real_lstat = os.lstat
    swapped = {str(fifo), str(other)}
    monkeypatch.setattr(
        session_files.os, "lstat", lambda p: real_lstat(decoy if str(p) in swapped else p)
    )
    with released_after(fifo):
        error, seconds = timed(lambda: read_header(fifo))
    assert seconds < PROMPTLY and isinstance(error, SessionFileError), (error, seconds)
    assert "a FIFO" in str(error)
    with pytest.raises(SessionFileError, match="replaced while it was opened"):
        read_header(other)


def test_links_directories_and_missing_files(tmp_path: Path) -> None:
    good = tmp_path / "good.safetensors"
    good_session(good)
    link = tmp_path / "link.safetensors"
    link.symlink_to(good)
    refused(link, "a symbolic link")
    (tmp_path / "dir.safetensors").mkdir()
    refused(tmp_path / "dir.safetensors", "a directory")
    for reader in (read_header, read):
        with pytest.raises(SessionFileMissing):
            reader(tmp_path / "none.safetensors")
    dangling = tmp_path / "dangling.safetensors"
    dangling.symlink_to(tmp_path / "none")
    refused(dangling, "a symbolic link")


@pytest.mark.parametrize(
    "data",
    [b"", b"\x00" * 7, b"not a session", os.urandom(4096), b"\xff" * 64],
    ids=["empty", "short", "text", "random", "huge-length"],
)
def test_garbage_is_refused(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "g.safetensors"
    path.write_bytes(data)
    refused(path, r"\w")


def _edit_meta(**fields: Any) -> Callable[[dict[str, Any]], None]:
    def edit(header: dict[str, Any]) -> None:
        header["__metadata__"].update(fields)

    return edit


def _edit_tensor(name: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    def edit(header: dict[str, Any]) -> None:
        header[name].update(fields)

    return edit


DEEP = 100_000  # far past json's recursion limit: a RecursionError unless bounded first
BAD_HEADERS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "format": (_edit_meta(format="other/1"), "not a neuronpy-session/1 file"),
    "no-format": (lambda h: h["__metadata__"].pop("format"), "not a neuronpy-session/1"),
    "model-long": (_edit_meta(model="m" * 1000), "is not a name"),
    "model-empty": (_edit_meta(model=""), "is not a name"),
    "model-control": (_edit_meta(model="a\nb"), "is not a name"),
    "fingerprint": (_edit_meta(fingerprint="xyz"), "not 32 hex digits"),
    "dtype": (_edit_meta(dtype="int8"), "its dtype 'int8'"),
    "meta-not-strings": (_edit_meta(model=5), "not a map of strings"),
    "meta-nested": (_edit_meta(model={"a": 1}), "not a map of strings"),
    "no-meta": (lambda h: h.pop("__metadata__"), "metadata is missing"),
    "ids-nan": (_edit_meta(token_ids="[NaN]"), "token ids"),
    "ids-infinity": (_edit_meta(token_ids="[1, Infinity]"), "token ids"),
    "ids-float": (_edit_meta(token_ids="[1.5, 2]"), "token ids"),
    "ids-exponent": (_edit_meta(token_ids="[1e400]"), "token ids"),
    "ids-negative": (_edit_meta(token_ids="[-1, 2]"), "token ids"),
    "ids-huge": (_edit_meta(token_ids="[2147483648]"), "below 2147483648"),
    "ids-many-digits": (_edit_meta(token_ids="[" + "9" * 5000 + "]"), "token ids"),
    "ids-strings": (_edit_meta(token_ids='["1"]'), "token ids"),
    "ids-bool": (_edit_meta(token_ids="[true]"), "token ids"),
    "ids-nested": (_edit_meta(token_ids="[[1], [2]]"), "token ids"),
    "ids-deep": (_edit_meta(token_ids="[" * DEEP + "]" * DEEP), "token ids"),
    "ids-object": (_edit_meta(token_ids='{"a": 1}'), "token ids"),
    "ids-missing": (lambda h: h["__metadata__"].pop("token_ids"), "token ids"),
    "ids-count": (_edit_meta(token_ids="[1, 2, 3]", tokens="3"), r"KV shape .* 3 tokens"),
    "tokens-lie": (_edit_meta(tokens="7"), "says '7' tokens, holds 5"),
    "created-long": (_edit_meta(created="x" * 1000), "creation time"),
    "tensor-dtype": (_edit_tensor("layers.1.values", dtype="F16"), "layers.1.values is 'F16'"),
    "meta-dtype": (_edit_meta(dtype="bfloat16"), "layers.0.keys is 'F32'"),
    "tensor-shape": (_edit_tensor("layers.1.keys", shape=[1, 4, 5, 2]), "layers.1.keys"),
    "shape-huge": (
        _edit_tensor("layers.0.keys", shape=[1, 10**30, 5, 10**30]),
        "KV shape",
    ),
    "shape-float": (_edit_tensor("layers.0.keys", shape=[1, 2.0, 5, 4]), "KV shape"),
    "shape-bool": (_edit_tensor("layers.0.keys", shape=[True, 2, 5, 4]), "KV shape"),
    "shape-rank": (_edit_tensor("layers.0.keys", shape=[2, 5, 4]), "KV shape"),
    "offsets": (_edit_tensor("layers.0.keys", data_offsets=[0, 8]), "offsets"),
    "offsets-negative": (_edit_tensor("layers.0.keys", data_offsets=[-160, 0]), "offsets"),
    "offsets-overlap": (
        lambda h: h["layers.1.values"].update(data_offsets=h["layers.0.keys"]["data_offsets"]),
        "do not follow each other",
    ),
    "tensor-extra-field": (_edit_tensor("layers.0.keys", extra=1), "not described"),
    "tensor-not-object": (lambda h: h.update({"layers.0.keys": [1]}), "not described|KV shape"),
    "missing-layer": (lambda h: h.pop("layers.1.values"), "not the keys and values"),
    "extra-tensor": (
        lambda h: h.update({"layers.2.keys": dict(h["layers.0.keys"])}),
        "not the keys and values",
    ),
    "renamed-tensor": (
        lambda h: h.update({"other": h.pop("layers.0.keys")}),
        "not the keys and values",
    ),
    "no-tensors": (
        lambda h: [h.pop(k) for k in list(h) if k != "__metadata__"],
        "not the keys and values",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_a_crafted_header_is_refused(tmp_path: Path, case: str) -> None:
    path = tmp_path / "s.safetensors"
    good_session(path)
    header, data = split(path)
    edit, match = BAD_HEADERS[case]
    edit(header)
    write_raw(path, header, data)
    refused(path, match)


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ("[" * DEEP + "]" * DEEP, "nests deeper"),
        ('{"a": ' * DEEP + "1" + "}" * DEEP, "nests deeper"),
        ('{"__metadata__": {"a": NaN}}', "holds NaN"),
        ('{"__metadata__": {}, "layers.0.keys": {"shape": [Infinity]}}', "holds Infinity"),
        ('{"__metadata__": {}, "__metadata__": {}}', "repeats a key"),
        ("[1, 2]", "not a safetensors header"),
        ("{not json", "malformed"),
        (b"\xff\xfe{}", "malformed"),
    ],
    ids=["deep-list", "deep-object", "nan", "infinity", "repeated", "list", "bad-json", "utf8"],
)
def test_a_header_that_is_not_bounded_json_is_refused(
    tmp_path: Path, raw: str | bytes, match: str
) -> None:
    path = tmp_path / "s.safetensors"
    write_raw(path, raw, b"")
    refused(path, match)


def test_sizes_are_checked_against_the_header(tmp_path: Path) -> None:
    path = tmp_path / "s.safetensors"
    good_session(path)
    whole = path.read_bytes()
    path.write_bytes(whole[:-1])
    refused(path, "truncated or padded")
    path.write_bytes(whole[:100])
    refused(path, "truncated")
    path.write_bytes(whole + b"\x00" * 16)
    refused(path, "truncated or padded")
    # a header length past the bound is refused before anything of it is read
    path.write_bytes(struct.pack("<Q", session_files.MAX_HEADER_BYTES + 1) + b"{}")
    refused(path, "header claims")
    path.write_bytes(struct.pack("<Q", 2**64 - 1) + b"{}")
    refused(path, "header claims")


def test_read_session_checks_the_file_against_the_model(tmp_path: Path) -> None:
    path = tmp_path / "s.safetensors"
    good_session(path)
    kwargs: dict[str, Any] = dict(dtype=torch.float32, layers=LAYERS, kv_heads=HEADS, head_dim=DIM)
    with pytest.raises(SessionFileError, match="another model"):
        read_session(path, CPU, fingerprint="f" * 32, **kwargs)
    for change in [{"layers": 3}, {"kv_heads": 1}, {"head_dim": 8}, {"dtype": torch.bfloat16}]:
        with pytest.raises(SessionFileError, match="it holds 2 layers x 2 KV heads x 4 dims"):
            read_session(path, CPU, fingerprint=FP, **{**kwargs, **change})


def test_a_file_changed_while_it_is_read_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.safetensors"
    good_session(path)
    real = session_files._read_into

    def read_then_touch(fd: int, offset: int, nbytes: int) -> torch.Tensor:
        os.utime(path, ns=(0, 10**9))  # someone writes the file in place meanwhile
        return real(fd, offset, nbytes)

    monkeypatch.setattr(session_files, "_read_into", read_then_touch)
    with pytest.raises(SessionFileError, match="changed while it was read"):
        read(path)


def test_unexpected_errors_of_one_file_stay_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever a file makes the reader raise (here: no memory for its KV, a read error) is a
    SessionFileError without the path, not an exception that would reach the worker's loop."""
    path = tmp_path / "s.safetensors"
    good_session(path)

    def no_memory(*args: object) -> torch.Tensor:
        raise RuntimeError(f"can't allocate memory for {path}")

    monkeypatch.setattr(session_files, "_read_into", no_memory)
    with pytest.raises(SessionFileError, match="cannot be loaded") as caught:
        read(path)
    assert str(tmp_path) not in str(caught.value)
    monkeypatch.undo()

    def io_error(*args: object) -> bytes:
        raise OSError(5, "Input/output error", str(path))

    monkeypatch.setattr(session_files, "_read_exact", io_error)
    with pytest.raises(SessionFileError, match="Input/output error") as caught:
        read_header(path)
    assert str(tmp_path) not in str(caught.value)


def test_writing_replaces_links_and_fifos_never_writes_through(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    good_session(link)
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    with released_after(fifo):
        error, seconds = timed(lambda: good_session(fifo))
    assert error is None and seconds < PROMPTLY
    assert target.read_bytes() == b"keep"
    assert read_header(link).token_ids == read_header(fifo).token_ids == (3, 1, 4, 1, 5)
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(IsADirectoryError):  # (the runner reports its strerror, not its path)
        good_session(tmp_path / "dir.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "dir.safetensors",
        "fifo.safetensors",
        "link.safetensors",
        "target",
    ]  # (no temporary file left behind)


# ---- the store -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "a\n",
        "a\r",
        "\na",
        "a\x00",
        "a/b",
        "..",
        "a..b",
        "../a",
        ".a",
        "",
        " a",
        "a b",
        "é",
        "١",
        "a" * 129,
        "a\\b",
        "a:b",
    ],
)
def test_only_plain_names_are_session_names(tmp_path: Path, name: str) -> None:
    assert not valid_name(name)
    store = SessionStore(tmp_path)
    with pytest.raises(InvalidRequestError, match="session name"):
        store.path(name)


def test_valid_names() -> None:
    for name in ["a", "A-b_c.d", "0", "x" * 128, "v1.2"]:
        assert valid_name(name), name


def test_the_store_lists_every_entry_and_opens_none(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    good_session(tmp_path / "good.safetensors")
    os.mkfifo(tmp_path / "fifo.safetensors")
    (tmp_path / "dir.safetensors").mkdir()
    (tmp_path / "link.safetensors").symlink_to(tmp_path / "good.safetensors")
    for skipped in [".hidden.safetensors", "bad name.safetensors", "x.safetensors.tmp", "y"]:
        (tmp_path / skipped).write_bytes(b"")
    with released_after(tmp_path / "fifo.safetensors"):
        names, seconds = store.names(), 0.0
        errors = {}
        for name in names:
            began = time.monotonic()
            try:
                assert store.info(name) is not None
            except InvalidRequestError as exc:
                errors[name] = exc.message
            seconds = max(seconds, time.monotonic() - began)
    assert seconds < PROMPTLY
    assert names == ["dir", "fifo", "good", "link"]
    assert set(errors) == {"dir", "fifo", "link"}
    assert "a FIFO" in errors["fifo"] and "symbolic link" in errors["link"]
    assert all(str(tmp_path) not in e and e.startswith(f"session {n!r}") for n, e in errors.items())
    assert store.info("none") is None


def test_deleting_a_link_removes_the_link_alone(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "s")
    target = tmp_path / "target.safetensors"
    good_session(target)
    (store.directory / "link.safetensors").symlink_to(target)
    assert store.delete("link") and target.exists()
    os.mkfifo(store.directory / "fifo.safetensors")
    assert store.delete("fifo")
    (store.directory / "dir.safetensors").mkdir()
    with pytest.raises(InvalidRequestError, match="is a directory") as caught:
        store.delete("dir")
    assert str(tmp_path) not in caught.value.message
    assert not store.delete("none")


def test_a_session_must_fit_the_model_it_is_sent_to(tmp_path: Path) -> None:
    good_session(tmp_path / "s.safetensors")
    info = SessionStore(tmp_path).info("s")
    assert info is not None
    fits = {"layout": (LAYERS, HEADS, DIM), "context_len": TOKENS}
    check_compatible(info, "m", FP, "float32", **fits)
    with pytest.raises(InvalidRequestError, match="holds KV of 2 layers x 2 KV heads x 4 dims"):
        check_compatible(info, "m", FP, "float32", **{**fits, "layout": (LAYERS, 1, DIM)})
    with pytest.raises(InvalidRequestError, match="holds 5 tokens, more than model 'm'"):
        check_compatible(info, "m", FP, "float32", **{**fits, "context_len": TOKENS - 1})


# ---- through a real server -------------------------------------------------------------------


def _greedy(url: str) -> str:
    response = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": MODEL, "messages": PROMPT, "max_tokens": 12, "temperature": 0},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


READABLE = {"layout"}  # a well-formed session file, refused by the model it is sent to


def _bad_files(directory: Path, outside: Path) -> dict[str, str]:
    """Bad entries beside the saved session 'good' (which has this model's fingerprint), and
    what each one's 400 says."""
    good = directory / "good.safetensors"
    header, data = split(good)
    meta = header["__metadata__"]

    def crafted(name: str, edit: Callable[[dict[str, Any]], None]) -> None:
        h = json.loads(json.dumps(header))
        edit(h)
        write_raw(directory / f"{name}.safetensors", h, data)

    os.mkfifo(directory / "fifo.safetensors")
    os.mkfifo(outside / "elsewhere")
    (directory / "fifolink.safetensors").symlink_to(outside / "elsewhere")
    (directory / "link.safetensors").symlink_to(good)
    (directory / "dir.safetensors").mkdir()
    (directory / "junk.safetensors").write_bytes(b"not a session")
    (directory / "truncated.safetensors").write_bytes(good.read_bytes()[:-4])
    crafted("nan", _edit_meta(token_ids="[NaN]"))
    crafted("deep", _edit_meta(token_ids="[" * DEEP + "]" * DEEP))
    crafted("huge-id", _edit_meta(token_ids=meta["token_ids"].replace("[", "[4294967296, ", 1)))
    crafted("shape", lambda h: h["layers.0.keys"].update(shape=[1, 10**30, 5, 10**30]))
    # well formed, this model's fingerprint, another layout: refused before admission too
    tokens = json.loads(meta["token_ids"])
    layers = len(header) // 2 - 1  # (one layer fewer)
    shape = header["layers.0.keys"]["shape"]
    write_session(
        directory / "layout.safetensors",
        [torch.zeros(shape) for _ in range(layers)],
        [torch.zeros(shape) for _ in range(layers)],
        tokens,
        {k: v for k, v in meta.items() if k not in ("token_ids", "tokens")},
    )
    return {
        "fifo": "a FIFO",
        "fifolink": "a symbolic link",
        "link": "a symbolic link",
        "dir": "a directory",
        "junk": "cannot be read",
        "truncated": "truncated",
        "nan": "token ids",
        "deep": "token ids",
        "huge-id": "below 2147483648",
        "shape": "KV shape",
        "layout": f"holds KV of {layers} layers",
    }


def test_bad_session_files_fail_their_own_request_with_a_400(tmp_path: Path) -> None:
    directory, outside = tmp_path / "sessions", tmp_path / "outside"
    outside.mkdir()
    with run_server(fixture_model(), sessions_dir=directory) as server:
        before = _greedy(server.url)
        saved = httpx.post(
            f"{server.v1}/chat/completions",
            json={"model": MODEL, "messages": PROMPT, "max_tokens": 4, "session": "good"},
            timeout=60,
        )
        assert saved.status_code == 200, saved.text
        bad = _bad_files(directory, outside)
        with released_after(directory / "fifo.safetensors"), released_after(outside / "elsewhere"):
            admitted = server.stats()["admitted"]
            for name, message in bad.items():
                for stream in (False, True):
                    began = time.monotonic()
                    response = httpx.post(
                        f"{server.v1}/chat/completions",
                        json={
                            "model": MODEL,
                            "messages": PROMPT,
                            "max_tokens": 4,
                            "session": name,
                            "stream": stream,
                        },
                        timeout=60,
                    )
                    assert time.monotonic() - began < PROMPTLY, name
                    assert response.status_code == 400, (name, response.text)
                    error = response.json()["error"]
                    assert error["param"] == "session" and message in error["message"], error
                    assert f"session {name!r}" in error["message"]
                    assert str(tmp_path) not in response.text
                shown = httpx.get(f"{server.v1}/sessions/{name}", timeout=10)
                if name in READABLE:  # (a session file, of no use to this model)
                    assert shown.status_code == 200 and "error" not in shown.json()
                else:
                    assert shown.status_code == 400 and message in shown.text, shown.text
                assert str(tmp_path) not in shown.text
                assert server.health().status_code == 200
            assert server.stats()["admitted"] == admitted  # refused before admission
            began = time.monotonic()
            listed = httpx.get(f"{server.v1}/sessions", timeout=60)
            assert time.monotonic() - began < PROMPTLY
        assert listed.status_code == 200 and str(tmp_path) not in listed.text
        entries = {e["id"]: e for e in listed.json()["data"]}
        assert set(entries) == {"good", *bad}
        assert "error" not in entries["good"] and entries["good"]["tokens"] > 0
        for name, message in bad.items():
            if name in READABLE:
                assert "error" not in entries[name] and entries[name]["tokens"] > 0
            else:
                assert message in entries[name]["error"], entries[name]
        # every bad entry can be deleted (a link, not what it points to)
        for name in bad:
            if name != "dir":
                assert httpx.delete(f"{server.v1}/sessions/{name}", timeout=10).status_code == 200
        assert (outside / "elsewhere").exists() and (directory / "good.safetensors").exists()
        assert server.health().status_code == 200
        assert _greedy(server.url) == before
