"""neuronpy behind its OpenAI-compatible server, streamed over HTTP: a server at a given URL, or
one this system starts on loopback around an engine it builds."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import httpx

from neuronpy.bench.driver import drive, precompile
from neuronpy.bench.http_client import completions_send, fetch_stats, make_client, served_models
from neuronpy.bench.metrics import engine_delta
from neuronpy.bench.records import ProfiledSteps, RunOutput
from neuronpy.bench.systems.neuronpy_engine import engine_snapshot
from neuronpy.bench.threads import EventLoopThread, in_fresh_thread
from neuronpy.bench.workloads import WORKLOADS, Workload

if TYPE_CHECKING:
    from neuronpy.engine.engine import Engine


class LoopbackServer:
    """`create_app` serving one engine, by uvicorn on a loopback port in a background thread;
    ready (healthy) once constructed."""

    def __init__(self, name: str, engine: Engine, timeout: float = 600.0):
        import uvicorn

        from neuronpy.server.app import create_app

        self.app = create_app({name: lambda: engine})
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(
            uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5)
        )
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        self._wait_healthy(timeout)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._thread.is_alive():
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            time.sleep(0.05)
        self.close()
        raise RuntimeError(f"the benchmark's loopback server never became healthy ({self.url})")

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()


class NeuronpyHttp:
    """neuronpy behind its OpenAI-compatible server, streamed over HTTP: a server at `url`, or
    one this system starts on loopback (`load_engine` builds its engine). The engine's figures
    come from the engine itself on loopback, else from the server's GET /stats."""

    def __init__(
        self,
        name: str,
        *,
        url: str | None = None,
        load_engine: Callable[[], Engine] | None = None,
        model: str | None = None,
        max_connections: int = 512,
        notes: Sequence[str] = (),
        workloads: frozenset[str] = frozenset(WORKLOADS),
    ):
        if (url is None) == (load_engine is None):
            raise ValueError("give a server url or an engine to serve, not both")
        self.name = name
        self.url = url.rstrip("/") if url else None
        self.model = model
        self.workloads = workloads
        where = f"at {self.url}" if url else "on loopback (uvicorn)"
        self.description = " ".join([f"neuronpy server {where}", *(f"({n})" for n in notes)])
        self._load_engine = load_engine
        self._max_connections = max_connections
        self._engine: Engine | None = None  # the loopback server's
        self._server: LoopbackServer | None = None
        self._loop: EventLoopThread | None = None
        self._client: httpx.AsyncClient | None = None

    def start(self, warmup: Workload) -> None:
        if self._load_engine is not None:
            self._engine = in_fresh_thread(self._load_engine)
            self._server = LoopbackServer(self.model or "model", self._engine)
            self.url = self._server.url
        assert self.url is not None
        ids = served_models(self.url)
        if not ids:
            raise RuntimeError(f"{self.url}/v1/models lists no model")
        if self.model not in ids:
            self.model = ids[0]
        self._loop = EventLoopThread()
        connections = self._max_connections
        self._client = self._loop.call(lambda: make_client(connections))  # the loop's client
        self.run(warmup)

    def _snapshot(self) -> dict[str, Any] | None:
        if self._engine is not None:
            return engine_snapshot(self._engine)
        assert self.url is not None
        return fetch_stats(self.url, self.model or "")

    def run(self, workload: Workload) -> RunOutput:
        loop, client = self._loop, self._client
        assert loop is not None and client is not None and self.url and self.model, "start it"
        send = completions_send(client, self.url, self.model)
        loop.call(lambda: precompile(workload.requests, send))
        before = self._snapshot()
        records, duration = loop.call(lambda: drive(workload.requests, send))
        return RunOutput(records, duration, engine_delta(before, self._snapshot(), duration))

    def profile(self, workload: Workload) -> ProfiledSteps | None:
        return None  # the engine's profiler is for the engine in-process

    def close(self) -> None:
        if self._loop is not None:
            client = self._client
            if client is not None:
                self._loop.call(client.aclose)
                self._client = None
            self._loop.close()
            self._loop = None
        if self._server is not None:
            self._server.close()
            self._server = None
        self._engine = None

    def info(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "drive": "http",
            "url": self.url,
            "model": self.model,
        }
