"""Real uvicorn servers on loopback ports for the HTTP tests, serving tiny fixture models."""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from neuronpy.config import EngineConfig, ModelSpec
from neuronpy.engine.engine import Engine
from neuronpy.engine.remote import EngineClient
from neuronpy.engine_process import start_engine_process
from neuronpy.loading import load_pretrained
from neuronpy.server.app import ServerState, create_app
from tests.factories import pooled_engine

FIXTURES = Path(__file__).parent / "fixtures"
TINY_LLAMA = FIXTURES / "tiny-llama"


@dataclass
class RunningServer:
    """A live server: its base URL (`http://127.0.0.1:PORT`) and its app state."""

    url: str
    state: ServerState

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def stats(self, model: str | None = None) -> dict[str, Any]:
        """One model's /stats: `model`'s, or the only model's."""
        if model is None:
            (stats,) = httpx.get(f"{self.url}/stats", timeout=10).json()["models"].values()
            return stats
        return httpx.get(f"{self.url}/stats", params={"model": model}, timeout=10).json()

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=10)

    def wait_for(
        self,
        predicate: Callable[[dict[str, Any]], bool],
        timeout: float = 20.0,
        model: str | None = None,
    ) -> dict[str, Any]:
        """Poll a model's /stats until `predicate` holds; fail the test if it never does."""
        deadline = time.monotonic() + timeout
        stats = self.stats(model)
        while not predicate(stats):
            if time.monotonic() > deadline:
                pytest.fail(f"engine stats never reached the expected state: {stats}")
            time.sleep(0.02)
            stats = self.stats(model)
        return stats


def engine_loader(
    model_dir: Path = TINY_LLAMA, dtype: str = "float32", **config: Any
) -> Callable[[], Engine]:
    """What `create_app` calls to build an engine: a fixture model with an EngineConfig, in
    float32 unless told otherwise (the exact mode: greedy output batched == alone)."""

    def load() -> Engine:
        weights = load_pretrained(str(model_dir), dtype=dtype)
        return pooled_engine(  # (its model built and compiled once for the suite: factories.py)
            weights.hf_model,
            weights.tokenizer,
            # (a fixture's key as make_engine's: one build serves both)
            key=(model_dir.name if model_dir.parent == FIXTURES else str(model_dir), dtype),
            name=weights.name,
            config=EngineConfig(**config),
        )

    return load


def process_loader(
    model_dir: Path = TINY_LLAMA, dtype: str = "float32", **config: Any
) -> Callable[[], EngineClient]:
    """What `create_app` calls to start a fixture model's engine in a process of its own (as
    `neuronpy serve` does), with the settings `engine_loader` takes."""
    spec = ModelSpec(path=str(model_dir), dtype=dtype, engine=EngineConfig(**config))
    return functools.partial(start_engine_process, model_dir.name, spec)


def fixture_model(name: str = "tiny-llama", **config: Any) -> dict[str, Callable[[], Engine]]:
    """One fixture model, served under its folder's name: `run_server(fixture_model(...))`."""
    return {name: engine_loader(FIXTURES / name, **config)}


@contextlib.contextmanager
def run_server(
    models: Mapping[str, Callable[[], Engine | EngineClient]],
    *,
    wait_ready: bool = True,
    **app_options: Any,
) -> Iterator[RunningServer]:
    """Start a real uvicorn server for `create_app(models)` in a background thread, on a
    loopback socket bound here (so no other process can take the port), and stop it after.
    With `wait_ready`, return once every model is ready."""
    app = create_app(models, **app_options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # idle connections kept 2 minutes (uvicorn's default is 5 s): a module's client reuses its
    # pooled connections between tests, and one the server closed just as the client sent on
    # it is "Server disconnected without sending a response", a race of the test, not the app
    config = uvicorn.Config(
        app, log_level="warning", timeout_graceful_shutdown=5, timeout_keep_alive=120
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    running = RunningServer(f"http://127.0.0.1:{port}", app.state.neuron)
    try:
        if wait_ready:
            _wait_healthy(running, thread)
        else:
            _wait_listening(running)
        yield running
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def _wait_healthy(server: RunningServer, thread: threading.Thread, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and thread.is_alive():
        with contextlib.suppress(httpx.TransportError):
            if server.health().status_code == 200:
                return
        if any(m.status == "failed" for m in server.state.models.values()):
            break
        time.sleep(0.05)
    states = {m.name: (m.status, m.error) for m in server.state.models.values()}
    pytest.fail(f"server never became healthy: {states}")


def _wait_listening(server: RunningServer, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            server.health()
            return
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def open_streams(
    stack: contextlib.ExitStack,
    server: RunningServer,
    body: dict[str, Any],
    key: str,
    label: str,
    n: int,
    *,
    wait: bool = True,
    timeout: float = 60,
) -> list[Iterator[str]]:
    """`n` streamed chat requests kept open on `stack` (a stream let go cancels its request),
    the i-th asking "{i} {key}" as `x-request-id` "{label}{i}". `wait`: each has answered its
    first line (it runs) before the next is sent; else all are sent at once (a stream's
    headers come with its first token, which may wait for the others). Their readers."""

    def stream(i: int) -> contextlib.AbstractContextManager[httpx.Response]:
        sent = {**body, "messages": [{"role": "user", "content": f"{i} {key}"}]}
        return httpx.stream(
            "POST",
            f"{server.v1}/chat/completions",
            json=sent,
            headers={"x-request-id": f"{label}{i}"},
            timeout=timeout,
        )

    if wait:
        readers = []
        for i in range(n):
            readers.append(stack.enter_context(stream(i)).iter_lines())
            next(readers[-1])
        return readers
    streams = [stream(i) for i in range(n)]
    with ThreadPoolExecutor(n) as pool:
        entering = [pool.submit(s.__enter__) for s in streams]
    failed = None
    responses = []
    for s, entered in zip(streams, entering, strict=True):
        try:
            responses.append(entered.result())
            stack.push(s.__exit__)
        except Exception as exc:  # (the others still closed by the stack)
            failed = failed or exc
    if failed is not None:
        raise failed
    return [response.iter_lines() for response in responses]
