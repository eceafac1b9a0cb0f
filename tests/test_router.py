"""Two replicas of the tiny Llama behind the real vllm-router, started by `neuronpy replicas`
as a user would: requests spread, a session keeps landing on the replica that holds its KV, a
replica drained under load loses nothing, and one killed outright costs only the streams it
was sending (the router fails over; the cut streams end in an error, never a hang or a
truncated text that looks whole)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import TINY_LLAMA

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-llama"
LONG = 300  # tokens of each request of the load (ignore_eos: exactly this many)
KEY = "fleet-test-key"  # the replicas' API key: clients send it through the router
AUTH = {"Authorization": f"Bearer {KEY}"}

pytestmark = [
    pytest.mark.soak,  # two replica processes behind the router, drained, killed, restarted
    pytest.mark.skipif(
        shutil.which("vllm-router") is None,
        reason="vllm-router is not installed (pip install vllm-router: Linux x86-64 wheels only)",
    ),
]


@dataclass
class Fleet:
    """`neuronpy replicas`: the router's URL, the replicas' URLs, and the launcher's log."""

    process: subprocess.Popen[bytes]
    router: str
    replicas: list[str]
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def served(self) -> list[float]:
        """Requests each replica has finished since it started (vLLM's metric name)."""
        counts = []
        for url in self.replicas:
            text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).text
            counts.append(
                sum(
                    s.value
                    for f in text_string_to_metric_families(text)
                    if f.name == "vllm:request_success"
                    for s in f.samples
                    if s.name == "vllm:request_success_total"
                )
            )
        return counts

    def wait_all_healthy(self, timeout: float = 300) -> None:
        """Until the router counts every replica healthy (after a start or a restart)."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, self.log_text()[-4000:]
            with contextlib.suppress(httpx.HTTPError, ValueError):
                ready = httpx.get(f"{self.router}/readiness", timeout=5).json()
                if ready.get("healthy_workers") == len(self.replicas) and all(
                    httpx.get(f"{url}/health", timeout=5).status_code == 200
                    for url in self.replicas
                ):
                    return
            assert time.monotonic() < deadline, "the replicas never all became healthy"
            time.sleep(0.2)

    def pid(self, replica: int) -> int:
        port = self.replicas[replica].rsplit(":", 1)[1]
        for process in psutil.process_iter(["cmdline"]):
            cmdline = process.info["cmdline"] or []
            at = cmdline.index("--port") + 1 if "--port" in cmdline[:-1] else None
            if "serve" in cmdline and at is not None and cmdline[at] == port:
                return process.pid
        raise AssertionError(f"no replica process on port {port}")

    def wait_for_load(self, replica: int, timeout: float = 120) -> None:
        """Until `replica` holds requests (the router has sent it some of the load)."""
        deadline = time.monotonic() + timeout
        while httpx.get(f"{self.replicas[replica]}/get_load", timeout=5).json()["load"] == 0:
            assert time.monotonic() < deadline, "the replica never got any of the load"
            time.sleep(0.02)


def _free_run(count: int) -> int:
    """A port such that it and the `count - 1` after it are free now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + count):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    port = _free_run(3)
    directory = tmp_path_factory.mktemp("fleet")
    log = directory / "replicas.log"
    command = [sys.executable, "-m", "neuronpy", "replicas", "-n", "2", "--port", str(port)]
    command += ["--policy", "consistent_hash"]  # affinity by the X-Session-ID header
    command += ["--", "--model", str(TINY_LLAMA), "--drain-timeout", "600"]
    command += ["--max-in-flight", "8", "--sessions-dir", str(directory / "sessions")]
    command += ["--api-key", KEY]
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    running = Fleet(
        process,
        f"http://127.0.0.1:{port}",
        [f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"],
        log,
    )
    try:
        running.wait_all_healthy()
        yield running
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # drains the replicas, stops the router
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
        for child in psutil.Process().children(recursive=True):  # nothing left behind
            with contextlib.suppress(psutil.NoSuchProcess):
                if "neuronpy" in " ".join(child.cmdline()) or "vllm" in child.name():
                    child.kill()


def _chat(session: str, text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 0,
        **extra,
    }


def test_requests_spread_over_the_replicas_and_a_session_sticks_to_one(fleet: Fleet) -> None:
    before = fleet.served()
    for i in range(16):
        response = httpx.post(
            f"{fleet.router}/v1/chat/completions",
            json=_chat(f"user-{i}", f"hello {i}"),
            headers={"X-Session-ID": f"user-{i}", **AUTH},
            timeout=120,
        )
        assert response.status_code == 200, response.text
    spread = [after - b for after, b in zip(fleet.served(), before, strict=True)]
    assert sum(spread) == 16 and min(spread) > 0, spread
    # one session, asked four times: always the same replica
    before = fleet.served()
    for _ in range(4):
        httpx.post(
            f"{fleet.router}/v1/chat/completions",
            json=_chat("one", "the same conversation"),
            headers={"X-Session-ID": "one-conversation", **AUTH},
            timeout=120,
        ).raise_for_status()
    landed = sorted(after - b for after, b in zip(fleet.served(), before, strict=True))
    assert landed == [0, 4]
    # the key goes through the router to the replica, which checks it
    refused = httpx.post(f"{fleet.router}/v1/chat/completions", json=_chat("x", "no key"))
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def test_a_sessions_second_turn_lands_where_its_kv_is_and_reuses_it(fleet: Fleet) -> None:
    client = openai.OpenAI(base_url=f"{fleet.router}/v1", api_key=KEY, max_retries=0)
    headers = {"X-Session-ID": "rivers-2f9c"}
    messages = [{"role": "user", "content": "Name three rivers of Europe."}]
    before = fleet.served()
    first = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, extra_headers=headers
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "Which is the longest?"},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, extra_headers=headers
    )
    landed = sorted(after - b for after, b in zip(fleet.served(), before, strict=True))
    assert landed == [0, 2]  # both turns on one replica
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens, (cached, first.usage)


Outcome = tuple[str, Any]  # ("ok", tokens) | ("error", the exception) | ("bad", what came)


def _load(fleet: Fleet, count: int, offset: int, outcomes: list[Outcome]) -> list[threading.Thread]:
    """`count` long requests through the router on threads, streamed and not, each with its
    own session key (so they hash over both replicas)."""

    def one(i: int) -> None:
        body = _chat(f"load-{i}", f"tell me a story, number {i}", max_tokens=LONG, ignore_eos=True)
        headers = {"X-Session-ID": f"load-{i}", **AUTH}
        url = f"{fleet.router}/v1/chat/completions"
        try:
            if i % 2:
                response = httpx.post(url, json=body, headers=headers, timeout=300)
                if response.status_code != 200:  # an error a client can read is fine here
                    readable = response.status_code >= 500 and "error" in response.text
                    what = (i, response.status_code, response.text[:300])
                    outcomes.append(("error" if readable else "bad", what))
                    return
                tokens = response.json()["usage"]["completion_tokens"]
                outcomes.append(("ok", tokens) if tokens == LONG else ("bad", tokens))
                return
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", url, json=body, headers=headers, timeout=300) as response:
                lines = [line for line in response.iter_lines() if line]
            usage = [line for line in lines if '"completion_tokens":' in line]
            whole = response.status_code == 200 and lines[-1:] == ["data: [DONE]"] and usage
            what = (i, response.status_code, lines[-2:])
            outcomes.append(("ok", LONG) if whole else ("bad", what))
        except httpx.TimeoutException as exc:  # a hang: never acceptable
            outcomes.append(("bad", exc))
        except httpx.HTTPError as exc:
            outcomes.append(("error", exc))

    threads = [threading.Thread(target=one, args=(offset + i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads


def test_a_replica_drained_under_load_loses_nothing(fleet: Fleet) -> None:
    outcomes: list[Outcome] = []
    threads = _load(fleet, 16, 0, outcomes)
    fleet.wait_for_load(0)
    drained = fleet.pid(0)
    assert httpx.post(f"{fleet.replicas[0]}/drain", timeout=10).status_code == 401
    response = httpx.post(f"{fleet.replicas[0]}/drain", headers=AUTH, timeout=10)
    assert response.status_code == 202 and response.json()["load"] > 0
    threads += _load(fleet, 16, 100, outcomes)  # arriving while it drains
    for thread in threads:
        thread.join(timeout=600)
    assert outcomes == [("ok", LONG)] * 32, [o for o in outcomes if o[0] != "ok"]
    fleet.wait_all_healthy()  # the launcher started it again, and the router took it back
    assert fleet.pid(0) != drained
    assert "replica 0 exited with 0; starting it again" in fleet.log_text()


def test_a_replica_killed_outright_fails_over_and_cut_streams_end_in_an_error(
    fleet: Fleet,
) -> None:
    outcomes: list[Outcome] = []
    threads = _load(fleet, 16, 200, outcomes)
    fleet.wait_for_load(1)
    os.kill(fleet.pid(1), signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=600)
    assert len(outcomes) == 16
    assert not [o for o in outcomes if o[0] == "bad"], outcomes  # no hang, nothing cut short
    assert ("ok", LONG) in outcomes  # those on the other replica went on
    # what arrives after the kill is served by the replica left
    after: list[Outcome] = []
    for thread in _load(fleet, 8, 300, after):
        thread.join(timeout=600)
    assert after == [("ok", LONG)] * 8, after
    fleet.wait_all_healthy()
    assert "replica 1 exited with -9; starting it again" in fleet.log_text()


def test_sighup_restarts_the_replicas_one_at_a_time_and_no_request_fails(fleet: Fleet) -> None:
    before = [fleet.pid(0), fleet.pid(1)]
    fleet.process.send_signal(signal.SIGHUP)
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + 600
    wave = 0
    while True:  # load in waves until both replicas are new processes, serving
        for thread in _load(fleet, 8, 500 + 8 * wave, outcomes):
            thread.join(timeout=600)
        wave += 1
        with contextlib.suppress(AssertionError):
            if all(fleet.pid(i) != before[i] for i in range(2)):
                break
        assert time.monotonic() < deadline, "the rolling restart never finished"
    fleet.wait_all_healthy()
    assert outcomes == [("ok", LONG)] * len(outcomes), [o for o in outcomes if o[0] != "ok"]
    log = fleet.log_text()
    assert log.index("rolling restart: draining replica 0") < log.index(
        "rolling restart: draining replica 1"
    )
