"""The Responses API's store on real servers on loopback: what it holds costs in memory what it
counts; `metadata` is held to OpenAI's limits; a stored response's file read back is untrusted
input (anything but what the server writes is absent: a clean 404); the files on disk are
bounded, the oldest removed; the sessions listing does not hand out response ids; and a
follow-up sent to another model than its previous response's replays the conversation there."""

from __future__ import annotations

import gc
import json
import os
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from neuronpy.server.responses_api.store import MAX_ENTRY_BYTES, StoreLimits
from tests.scripted import Scripts
from tests.servers import RunningServer, fixture_model, run_server

MODEL = "tiny-llama"
OTHER = "tiny-qwen3"  # other weights: a session of MODEL's is not for it
REASONING = "tiny-qwen3-tools"  # its reasoning parser is on: reasoning items


@pytest.fixture(scope="module")
def sessions_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sessions")


@pytest.fixture(scope="module")
def server(sessions_dir: Path) -> Iterator[RunningServer]:
    models = {**fixture_model(MODEL), **fixture_model(OTHER), **fixture_model(REASONING)}
    with run_server(models, sessions_dir=sessions_dir) as running:
        engine = running.state.models[REASONING].engine
        assert engine is not None
        tok = engine.tokenizer
        scripts = Scripts()
        scripts.attach(engine)
        reply = "<think>\nThe user greets.\n</think>\n\nHello!"
        scripts.add("[think]", [*tok.encode(reply), tok.eos_token_id])
        yield running


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


def post(server: RunningServer, body: dict[str, Any]) -> httpx.Response:
    raw = json.dumps(body, separators=(",", ":")).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.v1}/responses", content=raw, headers=headers, timeout=120)


# ---- memory: what is stored costs what it counts ------------------------------------------------


def test_a_stored_response_costs_in_memory_about_its_stored_text(server: RunningServer) -> None:
    """A body the Responses API echoes (here extra keys of `text.format`) of many tiny objects:
    its JSON text is what the store's budget counts, so what the store holds must cost about
    that, not the ~24x that parsed `[{}, {}, ...]` costs. Measured with tracemalloc (every
    thread's allocations), the server serving in this process."""
    junk = [{}] * 300_000  # 0.9 MB of text; parsed, some 22 MB
    text_format = {"type": "text", "junk": junk}
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "text": {"format": text_format}}
    ids = []
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(2):
            response = post(server, body)
            assert response.status_code == 200, response.text[:300]
            ids.append(response.headers["x-request-id"])  # (its id; the body is not parsed)
            del response
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    stored = [httpx.get(f"{server.v1}/responses/{rid}", timeout=60) for rid in ids]
    assert all(r.status_code == 200 for r in stored)
    text = sum(len(r.content) for r in stored)
    assert text > 1_800_000
    assert grown < 2 * text, f"stored {text} bytes of JSON; memory grew by {grown}"


METADATA_AT_LIMITS = {f"k{i:02d}" + "x" * 61: "v" * 512 for i in range(16)}
BAD_METADATA: list[tuple[object, str]] = [
    ([], "metadata"),
    ("tag", "metadata"),
    ({f"k{i}": "v" for i in range(17)}, "metadata"),
    ({"k" * 65: "v"}, "metadata"),
    ({"k": "v" * 513}, "metadata.k"),
    ({"k": 5}, "metadata.k"),
    ({"k": {"nested": "x"}}, "metadata.k"),
    ({"k": ["x"]}, "metadata.k"),
    ({"k": None}, "metadata.k"),
]


@pytest.mark.parametrize(("metadata", "param"), BAD_METADATA)
def test_metadata_past_openais_limits_is_a_400_before_anything_runs(
    server: RunningServer, metadata: object, param: str
) -> None:
    before = server.stats(MODEL)["admitted"]
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "metadata": metadata}
    response = post(server, body)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert server.stats(MODEL)["admitted"] == before


def test_metadata_at_openais_limits_is_echoed_and_stored(server: RunningServer) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "metadata": METADATA_AT_LIMITS}
    response = post(server, body)
    assert response.status_code == 200, response.text[:300]
    assert response.json()["metadata"] == METADATA_AT_LIMITS
    got = httpx.get(f"{server.v1}/responses/{response.json()['id']}", timeout=30)
    assert got.json() == response.json()


# ---- files read back: untrusted -----------------------------------------------------------------


@pytest.fixture(scope="module")
def genuine(server: RunningServer, sessions_dir: Path) -> dict[str, Any]:
    """A stored response's file as the server wrote it (a reply with a tool call's turn before
    it, so that the conversation has every kind of message)."""
    api = client(server)
    out = api.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": "call_1", "name": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
        ],
        instructions="Be brief.",
        metadata={"run": "1"},
        max_output_tokens=4,
        temperature=0.0,
    )
    data: dict[str, Any] = json.loads((sessions_dir / f"{out.id}.response.json").read_text())
    return data


def _new_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _as(data: dict[str, Any], rid: str) -> dict[str, Any]:
    """The file's data, a deep copy, as response `rid`'s."""
    copy: dict[str, Any] = json.loads(json.dumps(data))
    copy["response"]["id"] = rid
    return copy


Edit = Callable[[dict[str, Any]], None]


def _set(path: str, value: object) -> Edit:
    """An edit of the file's data: the value at `path` (keys and indexes, dot-separated)."""

    def edit(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return edit


def _drop(path: str) -> Edit:
    def edit(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        del node[int(last) if isinstance(node, list) else last]

    return edit


DEEP: object = "x"
for _ in range(100):
    DEEP = [DEEP]
# valid JSON, but not what the server writes
EDITS: dict[str, Edit] = {
    "an extra top-level key": _set("extra", 1),
    "no conversation": _drop("conversation"),
    "response a list": _set("response", []),
    "response with an extra key": _set("response.extra", 1),
    "response without usage": _drop("response.usage"),
    "status failed": _set("response.status", "failed"),
    "incomplete details not the server's": _set("response.incomplete_details", {"reason": "x"}),
    "created_at a string": _set("response.created_at", "yesterday"),
    "created_at a bool": _set("response.created_at", True),
    "output a dict": _set("response.output", {}),
    "output text a number": _set("response.output.0.content.0.text", 5),
    "output item of an unknown type": _set("response.output.0.type", "image"),
    "output item id not the server's": _set("response.output.0.id", "../../etc"),
    "two content parts": _set("response.output.0.content", [{"type": "output_text"}] * 2),
    "usage a string": _set("response.usage", "many"),
    "usage total wrong": _set("response.usage.total_tokens", 10**6),
    "usage negative": _set("response.usage.input_tokens", -1),
    "metadata a list": _set("response.metadata", ["x"]),
    "metadata value an object": _set("response.metadata.run", {"a": 1}),
    "metadata of 17 keys": _set("response.metadata", {f"k{i}": "v" for i in range(17)}),
    "tools a dict": _set("response.tools", {}),
    "tool a string": _set("response.tools", ["t"]),
    "text format without a type": _set("response.text", {"format": {}}),
    "store false": _set("response.store", False),
    "error set": _set("response.error", {"code": "x"}),
    "previous id not an id": _set("response.previous_response_id", "/tmp/x"),
    "temperature a string": _set("response.temperature", "hot"),
    "deep nesting": _set("response.tools", [{"x": DEEP}]),
    "conversation a dict": _set("conversation", {}),
    "conversation empty": _set("conversation", []),
    "content an object": _set("conversation.0.content", {"text": "x"}),
    "content parts": _set("conversation.0.content", [{"type": "text", "text": "x"}]),
    "message without a role": _drop("conversation.0.role"),
    "role unknown": _set("conversation.0.role", "robot"),
    "message with an extra key": _set("conversation.0.name", "x"),
    "tool calls a string": _set("conversation.1.tool_calls", "x"),
    "tool call without a function": _drop("conversation.1.tool_calls.0.function"),
    "tool call arguments an object": _set("conversation.1.tool_calls.0.function.arguments", {}),
    "tool result without its id": _drop("conversation.2.tool_call_id"),
    "not ending on the reply": _drop("conversation.3"),
}


def _text(data: dict[str, Any]) -> bytes:
    return json.dumps(data).encode()


def _edited(edit: Edit) -> Callable[[dict[str, Any]], bytes]:
    def raw(data: dict[str, Any]) -> bytes:
        edit(data)
        return _text(data)

    return raw


def _replace(old: str, new: str) -> Callable[[dict[str, Any]], bytes]:
    def raw(data: dict[str, Any]) -> bytes:
        text = json.dumps(data)
        assert old in text
        return text.replace(old, new, 1).encode()

    return raw


# what the file holds, from the genuine file's data (already as the new response's)
RAW: dict[str, Callable[[dict[str, Any]], bytes]] = {
    "not JSON": lambda data: b'{"response": ',
    "not UTF-8": lambda data: _text(data).replace(b'"Be brief."', b'"Be \xff."'),
    "a JSON list": lambda data: b"[]",
    "NaN": _replace('"temperature": 0.0', '"temperature": NaN'),
    "Infinity": _replace('"top_p": 1.0', '"top_p": -Infinity'),
    "1e999": _replace('"temperature": 0.0', '"temperature": 1e999'),
    "an int of 5000 digits": _replace('"created_at": ', '"created_at": ' + "9" * 5000),
    "a lone surrogate": _replace('"Be brief."', '"Be \\ud800."'),
    "past the size limit": lambda data: _text(data) + b" " * MAX_ENTRY_BYTES,
    **{name: _edited(edit) for name, edit in EDITS.items()},
}


def _check_absent(server: RunningServer, rid: str, sessions_dir: Path) -> None:
    got = httpx.get(f"{server.v1}/responses/{rid}", timeout=30)
    assert got.status_code == 404, got.text[:300]
    assert str(sessions_dir) not in got.text and ".json" not in got.text
    body = {"model": MODEL, "input": "x", "previous_response_id": rid, "max_output_tokens": 2}
    follow = post(server, body)
    assert follow.status_code == 404, follow.text[:300]
    assert follow.json()["error"]["param"] == "previous_response_id"
    assert str(sessions_dir) not in follow.text


@pytest.mark.parametrize("case", list(RAW))
def test_a_stored_response_file_not_as_the_server_writes_it_is_absent(
    server: RunningServer, sessions_dir: Path, genuine: dict[str, Any], case: str
) -> None:
    """Placed in the sessions directory (after a restart, the store reads it on first use):
    each is a clean 404 for GET and for a follow-up, naming no path; the server serves on."""
    rid = _new_id()
    (sessions_dir / f"{rid}.response.json").write_bytes(RAW[case](_as(genuine, rid)))
    _check_absent(server, rid, sessions_dir)
    assert server.health().status_code == 200


def test_the_genuine_file_under_its_own_id_is_served(
    server: RunningServer, sessions_dir: Path, genuine: dict[str, Any]
) -> None:
    """(What the cases above edit is accepted as it is: each is refused for its edit.) And one
    response's file under another's name is not served as that other response."""
    rid = _new_id()
    (sessions_dir / f"{rid}.response.json").write_text(json.dumps(_as(genuine, rid), indent=2))
    got = httpx.get(f"{server.v1}/responses/{rid}", timeout=30)
    assert got.status_code == 200, got.text[:300]
    assert got.json() == _as(genuine, rid)["response"]
    body = {"model": MODEL, "input": "Thanks", "previous_response_id": rid, "max_output_tokens": 2}
    assert post(server, body).status_code == 200
    copied = _new_id()
    (sessions_dir / f"{copied}.response.json").write_text(json.dumps(_as(genuine, rid)))
    _check_absent(server, copied, sessions_dir)


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}},
}
SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
STORED_KINDS: dict[str, dict[str, Any]] = {
    "plain": {"input": "Hi"},
    "nulls": {
        "input": [{"role": "developer", "content": [{"type": "input_text", "text": "Hi"}]}],
        **dict.fromkeys(
            ("instructions", "temperature", "top_p", "parallel_tool_calls", "tool_choice"), None
        ),
        **dict.fromkeys(("tools", "text", "metadata", "store", "stream"), None),
    },
    "a json schema": {
        "input": "Yes?",
        "max_output_tokens": 40,
        "text": {"format": {"type": "json_schema", "name": "s", "schema": SCHEMA, "strict": True}},
    },
    "json_object": {"input": "Yes?", "text": {"format": {"type": "json_object"}}},
    "a tool call": {
        "input": "Weather?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False,
        "max_output_tokens": 120,  # (a character a token)
    },
    "reasoning": {"model": REASONING, "input": "Hi [think]", "max_output_tokens": 60},
    "streamed": {"input": "Hi", "stream": True, "metadata": {"k": "v"}, "top_p": 0.5},
}


@pytest.mark.parametrize("kind", list(STORED_KINDS))
def test_every_kind_of_stored_response_reads_back_from_its_file(
    server: RunningServer, sessions_dir: Path, kind: str
) -> None:
    """What the server writes passes the check of what it reads: each kind of response, its
    file copied under a new id (so that it is read from disk), is served as it was stored and
    continued by a follow-up."""
    body = {"model": MODEL, "max_output_tokens": 4, "temperature": 0.0, **STORED_KINDS[kind]}
    response = post(server, body)
    assert response.status_code == 200, response.text[:300]
    rid = response.headers["x-request-id"]
    held = httpx.get(f"{server.v1}/responses/{rid}", timeout=30).json()
    assert held["id"] == rid and held["status"] in ("completed", "incomplete")
    if kind == "a tool call":
        assert held["output"][-1]["type"] == "function_call"
    if kind == "reasoning":
        assert [item["type"] for item in held["output"]] == ["reasoning", "message"]
    data = json.loads((sessions_dir / f"{rid}.response.json").read_text())
    copied = _new_id()
    (sessions_dir / f"{copied}.response.json").write_text(json.dumps(_as(data, copied)))
    got = httpx.get(f"{server.v1}/responses/{copied}", timeout=30)
    assert got.status_code == 200, got.text[:300]
    assert got.json() == {**held, "id": copied}
    follow = {"model": body["model"], "input": "Go on", "previous_response_id": copied}
    if kind == "a tool call":
        call = held["output"][-1]["call_id"]
        follow["input"] = [{"type": "function_call_output", "call_id": call, "output": "21 C"}]
    assert post(server, {**follow, "max_output_tokens": 2}).status_code == 200


def test_a_stored_response_name_that_is_no_regular_file_is_absent(
    server: RunningServer, sessions_dir: Path, genuine: dict[str, Any]
) -> None:
    """A link (to a genuine file), a directory and a FIFO named like a stored response: each a
    404, the FIFO never opened for a blocking read."""
    target = sessions_dir / "elsewhere.json"
    linked = _new_id()
    target.write_text(json.dumps(_as(genuine, linked)))
    (sessions_dir / f"{linked}.response.json").symlink_to(target)
    directory = _new_id()
    (sessions_dir / f"{directory}.response.json").mkdir()
    fifo = _new_id()
    os.mkfifo(sessions_dir / f"{fifo}.response.json")
    for rid in (linked, directory, fifo):
        _check_absent(server, rid, sessions_dir)


# ---- disk: bounded ------------------------------------------------------------------------------


def _on_disk(directory: Path) -> tuple[set[str], set[str]]:
    """The stored responses' ids in `directory`: by their files, by their KV's session files."""
    files = {p.name.removesuffix(".response.json") for p in directory.glob("resp_*.response.json")}
    kv = {p.name.removesuffix(".safetensors") for p in directory.glob("resp_*.safetensors")}
    return files, kv


def test_stored_responses_on_disk_are_bounded_the_oldest_removed(tmp_path: Path) -> None:
    """Past the count (or the bytes) of stored responses on disk, the oldest's file and KV are
    removed, and it is gone (404); a restart with a lower bound removes the oldest at once."""
    kwargs: dict[str, Any] = dict(model=MODEL, max_output_tokens=3, temperature=0.0)
    limits = StoreLimits(disk_files=2)
    with run_server(fixture_model(MODEL), sessions_dir=tmp_path, stored_responses=limits) as s:
        api = client(s)
        a, b, c = (api.responses.create(input=f"Story {i}", **kwargs).id for i in range(3))
        assert _on_disk(tmp_path) == ({b, c}, {b, c})
        with pytest.raises(openai.NotFoundError):
            api.responses.retrieve(a)
        assert api.responses.retrieve(b).id == b
        kept = api.responses.create(input="More", previous_response_id=c, **kwargs)
        assert _on_disk(tmp_path) == ({c, kept.id}, {c, kept.id})
    os.utime(tmp_path / f"{c}.response.json", (1_000_000, 1_000_000))  # the older of the two
    limits = StoreLimits(disk_files=1)
    with run_server(fixture_model(MODEL), sessions_dir=tmp_path, stored_responses=limits) as s:
        assert _on_disk(tmp_path) == ({kept.id}, {kept.id})
        api = client(s)
        assert api.responses.retrieve(kept.id).id == kept.id
        with pytest.raises(openai.NotFoundError):
            api.responses.retrieve(c)
    limits = StoreLimits(disk_bytes=1)  # every response's file and KV is more: only the newest
    with run_server(fixture_model(MODEL), sessions_dir=tmp_path, stored_responses=limits) as s:
        api = client(s)
        newest = api.responses.create(input="Again", **kwargs).id
        assert _on_disk(tmp_path) == ({newest}, {newest})
        api.responses.delete(newest)
        assert _on_disk(tmp_path) == (set(), set())


# ---- the sessions listing -----------------------------------------------------------------------


def test_the_sessions_listing_shows_no_stored_responses_kv(server: RunningServer) -> None:
    """A stored response's KV is a session named by its id; listing them would hand every
    key holder every client's response ids (and so their conversations). Sessions a client
    named are listed; a response's is shown only to whoever names it."""
    api = client(server)
    out = api.responses.create(model=MODEL, input="Secret", max_output_tokens=3, temperature=0.0)
    api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_body={"session": "named-by-me"},
    )
    listed = [s["id"] for s in httpx.get(f"{server.v1}/sessions", timeout=30).json()["data"]]
    assert "named-by-me" in listed
    assert not [name for name in listed if name.startswith("resp_")], listed
    shown = httpx.get(f"{server.v1}/sessions/{out.id}", timeout=30)
    assert shown.status_code == 200 and shown.json()["id"] == out.id


# ---- follow-ups across models -------------------------------------------------------------------


def test_a_follow_up_on_another_model_replays_the_conversation_there(
    server: RunningServer,
) -> None:
    """previous_response_id names a response of MODEL, whose KV (a session file of MODEL's)
    is no use to OTHER: the follow-up on OTHER prefills the conversation, writing what a replay
    on OTHER writes, as it does without --sessions-dir; and continues back on MODEL as well."""
    api = client(server)
    kwargs: dict[str, Any] = dict(max_output_tokens=8, temperature=0.0)
    first = api.responses.create(model=MODEL, input="Tell me a story", **kwargs)
    follow = api.responses.create(
        model=OTHER, input="And then?", previous_response_id=first.id, **kwargs
    )
    replay = api.responses.create(
        model=OTHER,
        input=[
            {"role": "user", "content": "Tell me a story"},
            *[item.model_dump(exclude_none=True) for item in first.output],
            {"role": "user", "content": "And then?"},
        ],
        store=False,
        **kwargs,
    )
    assert follow.model == OTHER and follow.output_text == replay.output_text
    assert follow.usage.input_tokens == replay.usage.input_tokens
    back = api.responses.create(
        model=MODEL, input="The end.", previous_response_id=follow.id, **kwargs
    )
    assert back.status in ("completed", "incomplete") and back.previous_response_id == follow.id
