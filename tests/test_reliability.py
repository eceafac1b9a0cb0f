"""Overload, queue deadline, client timeouts, load with cancellations, faults and SIGTERM, on
real servers over loopback (shared/reliability.md, items 17, 18, 20, 21, 23-26)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

from neuronpy.bench.load import plan, run_load
from neuronpy.cli import build_parser, config_from_args
from neuronpy.compose import load_engine
from neuronpy.config import EngineConfig, load_config
from neuronpy.engine.engine import Engine
from neuronpy.worker.jobs import WorkerStatsResult
from tests.servers import TINY_LLAMA, RunningServer, fixture_model, run_server

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-llama"
CHAT = "/chat/completions"
TEXT = "/completions"


def engine_of(server: RunningServer) -> Engine:
    engine = server.state.models[MODEL].engine
    assert engine is not None
    return engine


def wrap_decode(engine: Engine, before: Callable[[], None]) -> None:
    """Run `before` ahead of every batched decode forward, on the device worker's thread: a
    gate, a delay (so requests overlap on a model that decodes thousands of tokens/s), or a
    fault."""
    decode = engine.model.forward_batch_decode

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        before()
        return decode(*args, **kwargs)

    engine.model.forward_batch_decode = wrapped  # type: ignore[method-assign]


def body(max_tokens: int, *, chat: bool = False, stream: bool = False, **extra: Any) -> dict:
    out: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.0}
    out |= {"ignore_eos": True, **extra}
    if chat:
        out["messages"] = [{"role": "user", "content": "The quick brown fox"}]
    else:
        out["prompt"] = "Once upon a time"
    if stream:
        out |= {"stream": True, "stream_options": {"include_usage": True}}
    return out


async def post(client: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> dict[str, Any]:
    """One request, streamed or not, gathered into {status, headers, error | text, finish,
    tokens, events}: what the client saw, in one shape."""
    path = CHAT if "messages" in payload else TEXT
    async with client.stream("POST", f"{url}/v1{path}", json=payload) as response:
        out: dict[str, Any] = {"status": response.status_code, "headers": response.headers}
        if response.status_code != 200 or not payload.get("stream"):
            data = json.loads(await response.aread())
            if response.status_code != 200:
                return {**out, "error": data["error"]}
            choice = data["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            tokens = data["usage"]["completion_tokens"]
            return {**out, "text": text, "finish": choice["finish_reason"], "tokens": tokens}
        events: list[Any] = []
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
    chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
    text = "".join(_chunk_text(c["choices"][0]) for c in chunks)
    finish = next((c["choices"][0]["finish_reason"] for c in chunks[::-1]), None)
    usage = next((e["usage"] for e in events if isinstance(e, dict) and e.get("usage")), None)
    return {
        **out,
        "text": text,
        "finish": finish,
        "tokens": usage and usage["completion_tokens"],
        "events": events,
        "error": next((e["error"] for e in events if isinstance(e, dict) and "error" in e), None),
    }


def _chunk_text(choice: dict[str, Any]) -> str:
    return choice["text"] if "text" in choice else choice["delta"].get("content") or ""


def assert_clean_503(result: dict[str, Any], retry_after: bool = True) -> dict[str, Any]:
    """A 503 with OpenAI's error body (nothing of the server's internals) and, if asked, an
    integer Retry-After."""
    assert result["status"] == 503, result
    error = result["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in error["message"] and ".py" not in error["message"]
    if retry_after:
        value = result["headers"].get("retry-after", "")
        assert value.isdigit() and int(value) >= 1, f"Retry-After {value!r} is not an integer"
    return error


def worker_stats(engine: Engine) -> Any:
    """What the device worker stores now (snapshots, their bytes, the live batch), from a
    thread that runs no event loop."""
    return anyio.run(engine.worker_stats)


def held(stats: WorkerStatsResult, engine: Engine) -> WorkerStatsResult:
    """What the worker holds for requests: the prefix cache's snapshots left out (they stay on
    purpose, within their budget, and the engine's index accounts for every byte of them)."""
    assert stats.cached_bytes == engine.stats().prefix_cache_bytes
    assert stats.cached_bytes <= engine.config.prefix_cache_bytes
    return dataclasses.replace(stats, cached_snapshots=0, cached_bytes=0)


def rss_bytes() -> int | None:
    """This process's resident memory (the in-process server's included), where /proc has it."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


# ---- configuration ------------------------------------------------------------------------------


def test_queue_and_drain_timeouts_come_from_the_file_and_the_flags(tmp_path: Path) -> None:
    path = tmp_path / "neuronpy.toml"
    path.write_text(
        "[server]\ndrain_timeout = 12.5\n[admission]\nqueue_timeout = 30\n"
        '[[models]]\nname = "a"\npath = "x"\n'
        '[[models]]\nname = "b"\npath = "y"\nadmission = { queue_timeout = 0 }\n'
    )
    config = load_config(path, environ={})
    assert config.server.drain_timeout == 12.5
    assert [m.engine.queue_timeout for m in config.models] == [30, 0]
    args = ["serve", "--config", str(path), "--queue-timeout", "2.5", "--drain-timeout", "0"]
    flagged = config_from_args(build_parser().parse_args(args))
    assert flagged.server.drain_timeout == 0
    assert [m.engine.queue_timeout for m in flagged.models] == [2.5, 2.5]
    assert load_config(environ={}).models[0].engine.queue_timeout == 60.0  # the default
    for bad in (-1, float("inf"), "30", True):
        with pytest.raises(ValueError, match="queue_timeout"):
            EngineConfig(queue_timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="drain_timeout"):
        load_config(None, {"server": {"drain_timeout": -5}}, environ={})
    # 0 is no deadline, and the engine gets it as it is
    (spec,) = load_config(
        None, {"admission": {"queue_timeout": 0}}, [{"path": str(TINY_LLAMA)}], environ={}
    ).models
    assert load_engine(MODEL, spec).config.queue_timeout == 0


# ---- admission: bounded running and queue, clean rejections ---------------------------------


@pytest.mark.anyio
async def test_overload_serves_exactly_running_plus_queue_and_rejects_the_rest() -> None:
    running, queue, extra = 2, 3, 4
    with run_server(fixture_model(max_in_flight=running, max_queue=queue)) as server:
        engine = engine_of(server)
        gate = threading.Event()
        wrap_decode(engine, lambda: gate.wait(60))  # nobody finishes until every one arrived
        before = server.stats()
        payloads = [
            body(40, chat=i % 3 == 0, stream=i % 2 == 0) for i in range(running + queue + extra)
        ]
        results: list[dict[str, Any]] = []
        async with httpx.AsyncClient(timeout=60) as client:

            async def send(payload: dict[str, Any]) -> None:
                results.append(await post(client, server.url, payload))

            async with anyio.create_task_group() as tg:
                for payload in payloads:
                    tg.start_soon(send, payload)
                with anyio.fail_after(30):  # the k rejections come back while the rest wait
                    while len(results) < extra:
                        await anyio.sleep(0.01)
                held = server.stats()
                # every admitted one holds a row or a queue place (how many got a row before
                # the gated first step began depends on arrival order)
                assert held["running"] + held["queued"] == running + queue
                assert 1 <= held["running"] <= running
                gate.set()
            served = [r for r in results if r["status"] == 200]
            assert len(served) == running + queue
            assert all(r["finish"] == "length" and r["tokens"] == 40 for r in served)
            for rejected in [r for r in results if r["status"] != 200]:
                assert_clean_503(rejected)
            after = server.stats()
            assert after["rejected"] - before["rejected"] == extra
            assert after["max_batch_size"] <= running
            for i in range(5):  # then one at a time: every one is served
                alone = await post(client, server.url, body(8, stream=i % 2 == 1))
                assert alone["status"] == 200 and alone["tokens"] == 8
        assert server.stats()["rejected"] == after["rejected"]


@pytest.mark.anyio
async def test_queue_deadline_ends_waiting_requests_with_503_and_spares_the_running_one() -> None:
    with run_server(fixture_model(max_in_flight=1, max_queue=8, queue_timeout=0.5)) as server:
        engine = engine_of(server)
        long = body(150, stream=True)
        async with httpx.AsyncClient(timeout=60) as client:
            alone = await post(client, server.url, long)
            wrap_decode(engine, lambda: time.sleep(0.01))  # the running request takes ~1.5 s
            before = server.stats()
            results: dict[str, dict[str, Any]] = {}

            async def send(name: str, payload: dict[str, Any]) -> None:
                results[name] = await post(client, server.url, payload)

            async with anyio.create_task_group() as tg:
                tg.start_soon(send, "running", long)
                await anyio.to_thread.run_sync(
                    lambda: server.wait_for(lambda s: s["decode_steps"] > before["decode_steps"])
                )
                tg.start_soon(send, "queued", body(8))
                tg.start_soon(send, "queued-stream", body(8, stream=True, chat=True))
        for name in ("queued", "queued-stream"):
            error = assert_clean_503(results[name])
            assert "queue_timeout 0.5 s" in error["message"], error
        assert results["running"]["status"] == 200
        for key in ("text", "finish", "tokens"):
            assert results["running"][key] == alone[key]
        after = server.stats()
        assert after["timed_out"] - before["timed_out"] == 2
        assert after["prefills"] - before["prefills"] == 1  # the timed-out ones never ran
        assert (after["running"], after["queued"]) == (0, 0)


def test_openai_client_sees_a_queue_timeout_as_a_503() -> None:
    """The real openai client, streamed: the 503 comes before any chunk (no 200 first)."""
    with run_server(fixture_model(max_in_flight=1, max_queue=4, queue_timeout=0.2)) as server:
        engine = engine_of(server)
        gate = threading.Event()
        wrap_decode(engine, lambda: gate.wait(60))
        api = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=30)
        holder = threading.Thread(
            target=lambda: api.completions.create(
                model=MODEL, prompt="Hi", max_tokens=4, extra_body={"ignore_eos": True}
            )
        )
        holder.start()
        server.wait_for(lambda s: s["running"] == 1)

        def release() -> None:  # once the stream waits, hold it past its deadline
            server.wait_for(lambda s: s["queued"] == 1)
            time.sleep(0.4)
            gate.set()

        releaser = threading.Thread(target=release)
        releaser.start()
        with pytest.raises(openai.APIStatusError) as late:
            for _ in api.completions.create(model=MODEL, prompt="Hi", max_tokens=4, stream=True):
                pytest.fail("a chunk arrived for a request that timed out in the queue")
        releaser.join(30)
        holder.join(30)
        assert late.value.status_code == 503
        assert int(late.value.response.headers["retry-after"]) >= 1
        assert "queue_timeout" in late.value.message


# ---- faults -----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_many_clients_timing_out_at_once_leave_nothing_behind() -> None:
    with run_server(fixture_model(max_in_flight=4, max_queue=64)) as server:
        engine = engine_of(server)
        baseline = held(await engine.worker_stats(), engine)
        wrap_decode(engine, lambda: time.sleep(0.002))  # 400 steps: ~1 s, past the timeouts
        before = server.stats()
        clients = 32
        timed_out = 0
        async with httpx.AsyncClient(timeout=0.3) as impatient:

            async def send(i: int) -> None:  # gives up after 0.3 s, streamed or not
                nonlocal timed_out
                payload = body(400, stream=i % 2 == 0, chat=i % 3 == 0)
                with anyio.move_on_after(0.3) as deadline:
                    with contextlib.suppress(httpx.TimeoutException):
                        await post(impatient, server.url, payload)
                        return
                    timed_out += 1
                timed_out += deadline.cancelled_caught

            async with anyio.create_task_group() as tg:
                for i in range(clients):
                    tg.start_soon(send, i)
        assert timed_out == clients
        began = time.monotonic()
        async with httpx.AsyncClient(timeout=30) as client:
            fresh = await post(client, server.url, body(8))
        assert fresh["status"] == 200 and fresh["tokens"] == 8
        assert time.monotonic() - began < 5  # served promptly, not behind 32 abandoned requests
        after = server.wait_for(lambda s: s["running"] == 0 and s["queued"] == 0)
        assert after["cancelled"] - before["cancelled"] == clients
        assert after["admitted"] - before["admitted"] == clients + 1
        assert held(await engine.worker_stats(), engine) == baseline


@pytest.mark.anyio
async def test_a_forward_fault_mid_batch_fails_every_in_flight_request() -> None:
    with run_server(fixture_model(max_in_flight=4)) as server:
        engine = engine_of(server)
        broken = threading.Event()

        def step() -> None:
            if broken.is_set():
                raise RuntimeError("device fell over at /secret/path.py")
            time.sleep(0.005)

        wrap_decode(engine, step)
        results: list[dict[str, Any]] = []
        async with httpx.AsyncClient(timeout=60) as client:

            async def send(payload: dict[str, Any]) -> None:
                results.append(await post(client, server.url, payload))

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(send, body(400, stream=i < 2, chat=i % 2 == 0))
                steps = server.stats()["decode_steps"]
                await anyio.to_thread.run_sync(  # all four decode together, text sent
                    lambda: server.wait_for(
                        lambda s: s["live_batch_size"] == 4 and s["decode_steps"] > steps + 20
                    )
                )
                broken.set()
            streamed = [r for r in results if "events" in r]
            assert len(streamed) == 2
            for r in streamed:  # tokens, then an error event, then [DONE]
                assert r["status"] == 200 and r["text"] and r["finish"] is None
                assert r["events"][-1] == "[DONE]" and "error" in r["events"][-2]
                assert "secret" not in json.dumps(r["events"][-2])
            for r in [r for r in results if "events" not in r]:
                assert "secret" not in assert_clean_503(r, retry_after=False)["message"]
            later = await post(client, server.url, body(4, stream=True))
            assert_clean_503(later, retry_after=False)
        health = server.health()
        assert health.status_code == 503 and health.json()["models"] == {MODEL: "unhealthy"}
        stats = server.stats()
        assert stats["failed"] == 4 and not stats["healthy"]
        assert (stats["running"], stats["queued"]) == (0, 0)


# ---- load -------------------------------------------------------------------------------------


def test_load_with_cancellations_serves_the_rest_and_leaks_nothing() -> None:
    running, queue = 8, 64  # room for every client: all served but the cancelled
    requests = plan(200, min_tokens=4, max_tokens=16, stream_share=0.5, cancel_share=0.2)
    with run_server(fixture_model(max_in_flight=running, max_queue=queue)) as server:
        engine = engine_of(server)
        baseline = held(worker_stats(engine), engine)
        peaks = {"running": 0, "live_batch_size": 0, "queued": 0}
        sampling = threading.Event()

        def sample() -> None:  # running and queued stay within their bounds throughout
            while not sampling.is_set():
                stats = engine.stats()
                for key in peaks:
                    peaks[key] = max(peaks[key], getattr(stats, key))
                time.sleep(0.005)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        memory: list[int | None] = []
        for _ in range(2):  # the second round must not grow what the first left
            report = anyio.run(lambda: run_load(server.url, requests, concurrency=32))
            assert report.failed == 0, report.errors
            assert report.rejected == 0
            assert report.cancelled == 40  # 20% of 200, hung up on after their first chunk
            assert report.served == len(requests) - report.cancelled
            stats = server.wait_for(lambda s: s["running"] == 0 and s["queued"] == 0)
            assert stats["healthy"]
            stored = held(worker_stats(engine), engine)
            assert stored == baseline and stored.snapshot_bytes == 0
            memory.append(rss_bytes())
        sampling.set()
        sampler.join()
        assert 1 < peaks["live_batch_size"] <= running  # batched, never past the bound
        assert peaks["running"] <= running
        assert 1 < stats["max_batch_size"] <= running and peaks["queued"] <= queue
        first, second = memory
        if first is not None and second is not None:
            assert second - first < 32 << 20, f"RSS grew {(second - first) >> 20} MiB"


# ---- SIGTERM ------------------------------------------------------------------------------------


@dataclass
class CliServer:
    """A `python -m neuronpy serve` process on the tiny Llama, and where it listens and logs."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path

    @classmethod
    def start(cls, log: Path, *flags: str) -> CliServer:
        """Starts one on a free port with `flags`, its output in `log`. Eager: what these tests
        test is the server's, not the layers'."""
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        command = [sys.executable, "-m", "neuronpy", "serve", "--model", str(TINY_LLAMA)]
        command += ["--port", str(port), "--compile", "off", *flags]
        with log.open("wb") as out:
            process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        return cls(process, f"http://127.0.0.1:{port}", log)

    def wait_healthy(self, deadline: float) -> None:
        """Until its /health answers 200; fails the test if it exits first or `deadline` (of
        time.monotonic) passes."""
        while True:
            assert self.process.poll() is None, self.log_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            assert time.monotonic() < deadline, "the server never became healthy"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


# seconds of --drain-timeout: "finish" far past what its requests need on any machine, however
# loaded (the server exits as soon as they are done, so it costs nothing), "abort" far short
DRAINS = {"finish": 600.0, "abort": 1.0}


@pytest.fixture(scope="module")
def cli_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, CliServer]]:
    """Two CLI servers, started together (they load in parallel), each for one SIGTERM test:
    `finish` drains for up to 600 s (it exits as soon as its requests are done), `abort` for
    1 s with one request running at a time, so most of its requests outlast the drain."""
    flags = {"finish": [], "abort": ["--max-in-flight", "1"]}
    servers: dict[str, CliServer] = {}
    try:
        for name, extra in flags.items():
            log = tmp_path_factory.mktemp(name) / "server.log"
            servers[name] = CliServer.start(log, "--drain-timeout", str(DRAINS[name]), *extra)
        deadline = time.monotonic() + 180
        for server in servers.values():
            server.wait_healthy(deadline)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.mark.anyio
async def test_sigterm_stops_admitting_lets_in_flight_requests_finish_and_exits_0(
    cli_servers: dict[str, CliServer],
) -> None:
    server, drain = cli_servers["finish"], DRAINS["finish"]
    url = server.url
    results: list[dict[str, Any]] = []
    started = 0
    async with httpx.AsyncClient(timeout=60) as client:

        async def stream(i: int) -> None:
            nonlocal started
            payload = body(240, stream=True, chat=i % 2 == 0)
            path = CHAT if i % 2 == 0 else TEXT
            events = []
            async with client.stream("POST", f"{url}/v1{path}", json=payload) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        started += not events
                        events.append(line.removeprefix("data: "))
            results.append({"status": response.status_code, "events": events})

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(stream, i)
            with anyio.fail_after(60):
                while started < 4:
                    await anyio.sleep(0.01)
            server.process.send_signal(signal.SIGTERM)
            with anyio.fail_after(10):
                while (health := await client.get(f"{url}/health")).status_code == 200:
                    await anyio.sleep(0.01)
            assert health.json() == {"status": "stopping", "models": {MODEL: "stopping"}}
            refused = await post(client, url, body(4))
            assert not results, "the in-flight requests ended before the drain could be seen"
            assert "shutting down" in assert_clean_503(refused, retry_after=False)["message"]
    rc = await anyio.to_thread.run_sync(lambda: server.process.wait(drain + 15))
    assert rc == 0, server.log_text()[-3000:]
    assert len(results) == 4
    for r in results:  # each finished whole: its finish_reason, its usage, then [DONE]
        assert r["status"] == 200 and r["events"][-1] == "[DONE]"
        chunks = [json.loads(e) for e in r["events"][:-1]]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
        assert finishes[-1] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 240
    with pytest.raises(httpx.ConnectError):  # drained and stopped: nothing listens any more
        httpx.get(f"{url}/health", timeout=5)
    assert "4 request(s) finished, 0 aborted" in server.log_text(), server.log_text()[-3000:]


@pytest.mark.anyio
async def test_sigterm_aborts_what_outlasts_the_drain_timeout_and_exits_0(
    cli_servers: dict[str, CliServer],
) -> None:
    server, drain, count = cli_servers["abort"], DRAINS["abort"], 8
    url = server.url
    results: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=60) as client:

        async def send(i: int) -> None:
            results.append(await post(client, url, body(480, stream=i % 2 == 0)))

        async with anyio.create_task_group() as tg:
            for i in range(count):  # one runs, the others wait for its row
                tg.start_soon(send, i)
            with anyio.fail_after(30):
                while True:
                    stats = (await client.get(f"{url}/stats")).json()["models"][MODEL]
                    if stats["running"] == 1 and stats["queued"] == count - 1:
                        break
                    await anyio.sleep(0.01)
            server.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
        ended = time.monotonic() - signalled
    rc = await anyio.to_thread.run_sync(lambda: server.process.wait(drain + 15))
    elapsed = time.monotonic() - signalled
    assert rc == 0, server.log_text()[-3000:]
    assert ended < drain + 30 and elapsed < drain + 45  # (the counts below tell abort apart)
    finished = [r for r in results if r["status"] == 200 and r["finish"] == "length"]
    aborted = [r for r in results if r not in finished]
    assert len(aborted) >= count - 2, results
    for r in aborted:
        if r["status"] == 200:  # it was streaming: an abort chunk, the error, then [DONE]
            assert r["finish"] == "abort" and r["events"][-1] == "[DONE]"
            assert "shutting down" in r["error"]["message"]
        else:  # it had not started: a plain 503, nothing streamed
            assert "shutting down" in assert_clean_503(r)["message"]
    assert f"{len(finished)} request(s) finished, {len(aborted)} aborted" in server.log_text()


# ---- what one client can hold: head and body deadlines, the concurrency limit ----------------

HEAD_TIMEOUT, BODY_TIMEOUT, CONCURRENCY = 1.5, 2.0, 2
PARTIAL_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
HEADER_LINES = b"\r\nX-Slow: 1" * 50  # what a slowloris client sends, a byte at a time


def test_limits_come_from_the_file_and_the_flags(tmp_path: Path) -> None:
    defaults = load_config(environ={}).server
    assert (defaults.header_timeout, defaults.body_timeout, defaults.limit_concurrency) == (
        10.0,
        30.0,
        256,
    )
    path = tmp_path / "neuronpy.toml"
    path.write_text("[server]\nheader_timeout = 5\nbody_timeout = 0\nlimit_concurrency = 64\n")
    server = load_config(path, environ={}).server
    assert (server.header_timeout, server.body_timeout, server.limit_concurrency) == (5, 0, 64)
    args = ["serve", "--config", str(path), "--header-timeout", "2.5", "--limit-concurrency", "0"]
    flagged = config_from_args(build_parser().parse_args(args)).server
    assert (flagged.header_timeout, flagged.body_timeout, flagged.limit_concurrency) == (2.5, 0, 0)
    for key, bad in [
        ("header_timeout", -1),
        ("body_timeout", float("inf")),
        ("body_timeout", "30"),
        ("limit_concurrency", 1.5),
        ("limit_concurrency", -1),
    ]:
        with pytest.raises(ValueError, match=key):
            load_config(None, {"server": {key: bad}}, environ={})


def connect(url: str, data: bytes = b"") -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    if data:
        sock.sendall(data)
    return sock


def closed_within(sock: socket.socket, seconds: float) -> tuple[bytes, float]:
    """What the server sent before it closed `sock`, and when it did; fails if it stays open."""
    started, received = time.monotonic(), b""
    sock.settimeout(seconds)
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        pytest.fail(f"the server kept the connection open past {seconds}s ({received[:80]!r})")
    except ConnectionResetError:
        pass
    return received, time.monotonic() - started


def trickle(sock: socket.socket, data: bytes, stop: threading.Event) -> None:
    """Send `data` a byte every 0.2 s (what resets uvicorn's own keep-alive timer each time)."""
    with contextlib.suppress(OSError):
        for byte in data:
            if stop.wait(0.2):
                return
            sock.sendall(bytes([byte]))


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CliServer]:
    """`neuronpy serve` with short head and body deadlines and a concurrency limit of 2."""
    server = CliServer.start(
        tmp_path_factory.mktemp("guarded") / "server.log",
        *("--header-timeout", str(HEAD_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT)),
        *("--limit-concurrency", str(CONCURRENCY)),
    )
    try:
        server.wait_healthy(time.monotonic() + 180)
        yield server
    finally:
        server.stop()


def completion(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1{TEXT}", json=body(6), timeout=30)


def test_slow_and_idle_clients_are_cut_off_while_health_is_served(guarded: CliServer) -> None:
    url = guarded.url
    before = completion(url)
    assert before.status_code == 200, before.text
    stop = threading.Event()
    idle = [connect(url) for _ in range(20)]  # connected, sending nothing
    partial = [connect(url, PARTIAL_HEAD) for _ in range(60)]  # a head that never ends
    slow_head = connect(url)
    head = PARTIAL_HEAD + b"\r\nContent-Length: 200\r\n\r\n"
    slow_bodies = [connect(url, head + b'{"pro') for _ in range(CONCURRENCY - 1)]
    slow_bodies.append(connect(url, head))
    trickling = [
        threading.Thread(target=trickle, args=(slow_head, PARTIAL_HEAD + HEADER_LINES, stop)),
        threading.Thread(target=trickle, args=(slow_bodies[-1], b'{"prompt": "x"}' * 4, stop)),
    ]
    for thread in trickling:
        thread.start()
    try:
        # the slow bodies hold both requests the server handles at once: /health and /metrics
        # are still answered, anything else is refused at once (OpenAI's body, Retry-After)
        deadline = time.monotonic() + 1
        refused = completion(url)
        while refused.status_code == 200 and time.monotonic() < deadline:
            refused = completion(url)  # (the slow heads may not be read yet)
        assert refused.status_code == 503, refused.text
        assert_clean_503({"status": 503, "headers": refused.headers, **refused.json()})
        assert "limit_concurrency" in refused.json()["error"]["message"]
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 200 and health.elapsed.total_seconds() < 1
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert 'neuronpy_requests_rejected_total{model="",reason="concurrency_limit"}' in metrics
        # each slow body gets a 408 once its deadline passes, and its connection closes
        for sock in slow_bodies:
            answer, _ = closed_within(sock, BODY_TIMEOUT + 5)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b'"code":"request_timeout"' in answer
        # every connection whose head did not arrive in time is closed, trickling or not
        for sock in [*idle, *partial, slow_head]:
            answer, _ = closed_within(sock, HEAD_TIMEOUT + 5)
            assert answer == b""
    finally:
        stop.set()
        for thread in trickling:
            thread.join()
        for sock in [*idle, *partial, slow_head, *slow_bodies]:
            sock.close()
    after = completion(url)
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    assert "Traceback" not in guarded.log_text()


def test_a_connection_closes_when_the_next_head_is_late(guarded: CliServer) -> None:
    """After a response, the next request's head has the same deadline (a slow client that
    keeps sending a byte at a time never resets it)."""
    sock = connect(guarded.url, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    stop = threading.Event()
    next_head = b"GET /health HTTP/1.1\r\n" + HEADER_LINES
    thread = threading.Thread(target=trickle, args=(sock, next_head, stop))
    try:
        first = sock.recv(65536)
        head, _, content = first.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), first
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(content) < length:  # (the body may come in a packet of its own)
            content += sock.recv(65536)
        thread.start()
        answer, took = closed_within(sock, HEAD_TIMEOUT + 5)
        assert answer == b"" and took < HEAD_TIMEOUT + 3
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
        sock.close()


def test_clients_that_hang_up_mid_body_leave_no_traceback(guarded: CliServer) -> None:
    head = PARTIAL_HEAD + b"\r\nContent-Length: 1000\r\n\r\n"
    for _ in range(20):
        sock = connect(guarded.url, head + b'{"prompt": "')
        time.sleep(0.01)  # (the server is reading the body)
        sock.close()
    for _ in range(20):  # and hung up before the head was whole
        connect(guarded.url, PARTIAL_HEAD).close()
    assert completion(guarded.url).status_code == 200  # served after them
    log = guarded.log_text()
    assert "Traceback" not in log and "ClientDisconnect" not in log, log[-3000:]
    assert "Exception in ASGI application" not in log


# ---- a session that cannot be saved keeps its reply ----------------------------------------------


@pytest.mark.anyio
async def test_a_session_save_failure_returns_the_reply_and_says_why(tmp_path: Path) -> None:
    sessions = tmp_path / "sessions"
    with run_server(fixture_model(), sessions_dir=sessions) as server:
        async with httpx.AsyncClient(timeout=60) as client:
            plain = await post(client, server.url, body(6, chat=True))
            sessions.rmdir()  # the directory is gone: every save fails
            saved = await post(client, server.url, body(6, chat=True, session="talk"))
            whole = await client.post(f"{server.v1}{CHAT}", json=body(6, chat=True, session="talk"))
            streamed = await post(
                client, server.url, body(6, chat=True, stream=True, session="talk2")
            )
            metrics = (await client.get(f"{server.url}/metrics")).text
        for result in (saved, streamed):
            assert result["status"] == 200, result
            assert (result["text"], result["finish"]) == (plain["text"], plain["finish"])
        header = saved["headers"]["x-neuronpy-session-error"]
        assert "talk" in header and str(tmp_path) not in header
        assert whole.json()["session_error"].startswith(header[:40])
        assert str(tmp_path) not in whole.text
        (finishing,) = [
            e for e in streamed["events"] if isinstance(e, dict) and "session_error" in e
        ]
        assert finishing["choices"][0]["finish_reason"] == "length"
        assert "talk2" in finishing["session_error"]
        assert str(tmp_path) not in finishing["session_error"]
        line = 'neuronpy_session_save_failures_total{model="tiny-llama"} 3.0'
        assert line in metrics
        assert server.stats()["failed"] == 0
