"""Each model's engine in a process of its own (`neuronpy serve`'s default): what a client gets
is what an engine in the server's process gives, and the server outlives its engine process."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import httpx
import openai
import psutil
import pytest

from neuronpy.config import EngineConfig, ModelSpec
from neuronpy.engine.remote import EngineClient
from neuronpy.engine.types import SamplingParams
from neuronpy.engine_process import start_engine_process
from neuronpy.errors import QueueFullError
from tests.servers import (
    FIXTURES,
    RunningServer,
    engine_loader,
    process_loader,
    run_server,
)

PROMPTS = ["The quick brown fox", "Once upon a time", "Servers that batch", "In 1984 the"]


def client_of(server: RunningServer, name: str = "tiny-llama") -> EngineClient:
    engine = server.state.models[name].engine
    assert isinstance(engine, EngineClient), "the engine should run in a process of its own"
    return engine


def greedy(api: openai.OpenAI, prompt: str, max_tokens: int = 24, model: str = "tiny-llama"):
    out = api.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    return out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server(
        {
            "tiny-llama": process_loader(compile="off"),
            "tiny-qwen3": process_loader(FIXTURES / "tiny-qwen3", compile="off"),
        }
    ) as running:
        yield running


def test_each_model_has_a_process_of_its_own_and_replies_as_in_the_servers(
    server: RunningServer,
) -> None:
    llama, qwen = client_of(server), client_of(server, "tiny-qwen3")
    assert llama.process is not None and qwen.process is not None
    assert len({llama.process.pid, qwen.process.pid, os.getpid()}) == 3
    api = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    remote = {p: greedy(api, p) for p in PROMPTS}
    remote_qwen = greedy(api, PROMPTS[0], model="tiny-qwen3")
    with run_server({"tiny-llama": engine_loader(compile="off")}) as here:
        local_api = openai.OpenAI(base_url=here.v1, api_key="unused", max_retries=0)
        assert {p: greedy(local_api, p) for p in PROMPTS} == remote
    assert remote_qwen[2] == 24
    # the model card says what the engine process's model is
    card = httpx.get(f"{server.v1}/models/tiny-llama", timeout=10).json()
    assert card["id"] == "tiny-llama"


@pytest.mark.anyio
async def test_a_full_engine_refuses_at_once_and_cancels_free_the_rows() -> None:
    """max_in_flight 4 + max_queue 2 requests admitted; the next one is refused with a retry
    hint in the server's process, before anything is sent (the client counts what it has
    admitted until the engine says it ended); cancelling them frees every row."""
    spec = ModelSpec(
        path=str(FIXTURES / "tiny-llama"),
        dtype="float32",
        engine=EngineConfig(max_in_flight=4, max_queue=2, compile="off"),
    )
    client = await anyio.to_thread.run_sync(start_engine_process, "tiny-llama", spec)
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    async with client:
        streams = [client.submit([5, 6, 7], params) for _ in range(6)]
        with pytest.raises(QueueFullError) as full:
            client.submit([5, 6, 7], params)
        assert full.value.retry_after >= 1
        assert client.stats().rejected == 1
        first = await streams[0].__anext__()
        assert first.token_ids
        for stream in streams:
            stream.cancel()
        with anyio.fail_after(60):
            while (s := client.stats()).running or s.queued or s.cancelled < 6:
                await anyio.sleep(0.05)
        done = await client.complete([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
        assert done.completion_tokens == 3


def test_structured_output_and_bad_requests_through_the_process(server: RunningServer) -> None:
    """A constraint compiles in the engine process (its errors come back as 400s naming the
    field); a prompt too long is refused before anything is sent."""
    api = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    out = api.completions.create(
        model="tiny-llama",
        prompt="pick",
        max_tokens=5,
        temperature=0.0,
        extra_body={"structured_outputs": {"choice": ["red", "green"]}},
    )
    assert out.choices[0].text in ("red", "green")
    with pytest.raises(openai.BadRequestError) as bad:
        api.completions.create(
            model="tiny-llama",
            prompt="pick",
            max_tokens=5,
            extra_body={"structured_outputs": {"regex": "(unclosed"}},
        )
    assert bad.value.body["param"] is not None  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="context"):
        api.completions.create(model="tiny-llama", prompt="word " * 5000, max_tokens=5)


def test_an_engine_process_that_dies_fails_its_requests_and_is_started_again() -> None:
    """The engine process is stopped (SIGSTOP: nothing it holds can finish), a request is
    admitted, then the process is killed: the request fails with a 503 saying what happened,
    the model is started again, and it then replies as before. Another model's process is
    not touched."""
    with run_server(
        {
            "tiny-llama": process_loader(compile="off"),
            "tiny-qwen3": process_loader(FIXTURES / "tiny-qwen3", compile="off"),
        }
    ) as server:
        api = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        before = greedy(api, PROMPTS[1])
        other = client_of(server, "tiny-qwen3")
        victim = client_of(server).process
        assert victim is not None
        os.kill(victim.pid, signal.SIGSTOP)
        with ThreadPoolExecutor(1) as pool:
            body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 20, "stream": True}
            pending = pool.submit(httpx.post, f"{server.v1}/completions", json=body, timeout=120)
            server.wait_for(lambda s: s["status"] == "ready" and s["healthy"], model="tiny-llama")
            while not client_of(server).admitted:  # admitted in the server's process
                time.sleep(0.01)
            os.kill(victim.pid, signal.SIGKILL)
            failed = pending.result()
        assert failed.status_code == 503
        message = failed.json()["error"]["message"]
        assert "engine process ended" in message and "signal 9" in message
        # started again: ready once more (polled, however long loading takes here)
        server.wait_for(
            lambda s: s["status"] == "ready" and s["healthy"], timeout=300, model="tiny-llama"
        )
        assert client_of(server).process is not victim
        assert greedy(api, PROMPTS[1]) == before
        assert client_of(server, "tiny-qwen3") is other and other.healthy


def test_embeddings_from_an_engine_process_match_the_servers_own() -> None:
    name = "tiny-qwen3-embedding"
    inputs = ["a cat", "a dog sleeps"]
    vectors = []
    for loader in (process_loader, engine_loader):
        with run_server({name: loader(FIXTURES / name, compile="off")}) as server:
            api = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
            out = api.embeddings.create(model=name, input=inputs)
            vectors.append([d.embedding for d in out.data])
    assert vectors[0] == vectors[1]


def test_neuronpy_serve_runs_the_engine_apart_and_it_ends_with_the_server(tmp_path: Path) -> None:
    """`neuronpy serve` (the default: an engine process) answers; killed outright (SIGKILL:
    none of its own clean-up runs), its engine process ends too rather than live on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path / "server.log"
    command = [sys.executable, "-m", "neuronpy", "serve", "--model", str(FIXTURES / "tiny-llama")]
    command += ["--port", str(port), "--compile", "off", "--dtype", "float32"]
    with log.open("wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, log.read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server never became healthy"
            time.sleep(0.1)
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert greedy(api, PROMPTS[0], 8)[2] == 8
        (engine,) = psutil.Process(server.pid).children()
        assert "neuronpy.engine_process" in " ".join(engine.cmdline())
        assert "its engine runs in process" in log.read_text()
        server.kill()
        server.wait()
        engine.wait(timeout=60)  # psutil.TimeoutExpired if it outlived the server
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_the_engine_process_is_the_default_and_can_be_turned_off(tmp_path: Path) -> None:
    from neuronpy.cli import build_parser, config_from_args
    from neuronpy.config import load_config

    parse = build_parser().parse_args
    assert config_from_args(parse(["serve"])).server.engine_process
    assert not config_from_args(parse(["serve", "--engine-process", "off"])).server.engine_process
    path = tmp_path / "neuronpy.toml"
    path.write_text("[server]\nengine_process = false\n")
    assert not load_config(path, environ={}).server.engine_process
    with pytest.raises(ValueError, match="engine_process"):
        load_config(None, {"server": {"engine_process": "yes"}}, environ={})
