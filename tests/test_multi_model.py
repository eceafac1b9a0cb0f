"""Several models in one server: routing by `model`, per-model limits, health and failures."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import httpx
import openai
import pytest

from neuronpy.engine.engine import Engine
from neuronpy.errors import ModelLoadError
from tests.servers import FIXTURES, RunningServer, engine_loader, fixture_model, run_server
from tests.test_server_parity import Case, Outcome, run_case

LLAMA, QWEN = "tiny-llama", "tiny-qwen3"
CASES = {
    LLAMA: [
        Case("chat", "The quick brown fox", 40, stream=True),
        Case("text", "Once upon a time, there was", 12, stream=False),
        Case("chat", "What changed? Mostly the roads", 30, stream=False),
        Case("text", "Servers that handle many requests", 45, stream=True, ignore_eos=False),
    ],
    QWEN: [
        Case("text", "She ordered a café au lait", 30, stream=True),
        Case("chat", "A language model reads a sequence", 25, stream=False),
        Case("text", "In 1984 the station recorded", 35, stream=False),
    ],
}


def two_models(**per_model: dict[str, Any]) -> dict[str, Callable[[], Engine]]:
    """The tiny Llama and Qwen3 fixtures, each with its own engine config."""
    return {name: engine_loader(FIXTURES / name, **per_model.get(name, {})) for name in CASES}


def api(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


def engine(server: RunningServer, name: str) -> Engine:
    served = server.state.models[name].engine
    assert served is not None
    return served


async def short(client: openai.AsyncOpenAI, model: str, prompt: str = "Hello") -> str:
    out = await client.completions.create(
        model=model, prompt=prompt, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server(two_models()) as running:
        yield running


# ---- routing and parity --------------------------------------------------------------------------


@pytest.mark.anyio
async def test_parity_two_models_concurrently_match_each_served_alone(
    server: RunningServer,
) -> None:
    alone: dict[str, list[Outcome]] = {}
    for name, cases in CASES.items():
        with run_server(fixture_model(name)) as solo:
            async with api(solo) as client:
                alone[name] = [await run_case(client, case, name) for case in cases]
    # interleaved: the two models' requests arrive mixed, and join while the others decode
    jobs = sorted(
        ((name, i) for name, cases in CASES.items() for i in range(len(cases))), key=lambda j: j[1]
    )
    before = {name: server.stats(name) for name in CASES}
    together: dict[tuple[str, int], Outcome] = {}

    async def run(k: int, name: str, i: int) -> None:
        await anyio.sleep(0.01 * k)  # joins land while the others decode
        together[name, i] = await run_case(client, CASES[name][i], name)

    async with api(server) as client, anyio.create_task_group() as tg:
        for k, (name, i) in enumerate(jobs):
            tg.start_soon(run, k, name, i)
    for name, i in jobs:
        assert together[name, i] == alone[name][i], f"{name}: {CASES[name][i]} differs"
    assert alone[LLAMA][0] != alone[QWEN][0]  # the two models really differ
    for name, cases in CASES.items():  # each batch held its own requests, and only those
        after = server.stats(name)
        assert after["admitted"] - before[name]["admitted"] == len(cases)
        assert 2 <= after["max_batch_size"] <= len(cases)
        assert after["running"] == 0 and after["queued"] == 0


@pytest.mark.anyio
async def test_models_are_listed_and_routed_by_name(server: RunningServer) -> None:
    async with api(server) as client:
        assert [m.id for m in (await client.models.list()).data] == [LLAMA, QWEN]
        assert (await client.models.retrieve(QWEN)).id == QWEN
        with pytest.raises(openai.NotFoundError) as missing:
            await short(client, "gpt-4")
        llama, qwen = await short(client, LLAMA), await short(client, QWEN)
        chat = await client.chat.completions.create(
            model=QWEN, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    assert chat.model == QWEN
    error = missing.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert f"available models: {LLAMA}, {QWEN}" in error["message"]
    assert llama != qwen
    # a request that names no model goes to the first one
    body = {"prompt": "Hello", "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    unnamed = httpx.post(f"{server.v1}/completions", json=body, timeout=30).json()
    assert unnamed["model"] == LLAMA and unnamed["choices"][0]["text"] == llama
    stats = httpx.get(f"{server.url}/stats", timeout=10).json()["models"]
    assert list(stats) == [LLAMA, QWEN] and all(s["status"] == "ready" for s in stats.values())
    health = server.health()
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "models": {LLAMA: "ready", QWEN: "ready"}}
    one = httpx.get(f"{server.url}/health", params={"model": QWEN})
    assert one.status_code == 200 and one.json() == {"status": "ready", "model": QWEN}
    assert httpx.get(f"{server.url}/health", params={"model": "nope"}).status_code == 404


# ---- limits and faults stay with their model -----------------------------------------------------


@pytest.mark.anyio
async def test_a_full_queue_on_one_model_does_not_reject_the_other() -> None:
    with run_server(two_models(**{LLAMA: {"max_in_flight": 1, "max_queue": 1}})) as server:
        gate = threading.Event()
        llama = engine(server, LLAMA)
        decode = llama.model.forward_batch_decode

        def held(*args: Any, **kwargs: Any) -> Any:  # holds the Llama's running row in place
            gate.wait(60)
            return decode(*args, **kwargs)

        llama.model.forward_batch_decode = held  # type: ignore[method-assign]
        async with api(server) as client, anyio.create_task_group() as tg:
            for prompt in ("one", "two"):  # one running, one queued: the Llama is full
                tg.start_soon(short, client, LLAMA, prompt)
            await anyio.to_thread.run_sync(
                lambda: server.wait_for(
                    lambda s: s["running"] == 1 and s["queued"] == 1, model=LLAMA
                )
            )
            with pytest.raises(openai.APIStatusError) as full:
                await short(client, LLAMA)
            assert full.value.status_code == 503
            assert int(full.value.response.headers["retry-after"]) >= 1
            with anyio.fail_after(60):
                served = [await short(client, QWEN, p) for p in ("a", "b", "c")]
            assert all(served)
            gate.set()  # the Llama's two requests finish now
        assert server.stats(LLAMA)["rejected"] == 1 and server.stats(LLAMA)["finished"] >= 3
        assert server.stats(QWEN)["rejected"] == 0


@pytest.mark.anyio
async def test_a_failed_worker_fails_only_its_own_model() -> None:
    with run_server(two_models()) as server:
        async with api(server) as client:
            reference = await short(client, LLAMA, "The farmer wakes up")

            def broken(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("device fell over")

            engine(server, QWEN).model.forward_batch_decode = broken  # type: ignore[method-assign]
            results: dict[str, Any] = {}

            async def call(name: str, prompt: str) -> None:
                try:
                    results[name] = await short(client, name, prompt)
                except openai.APIStatusError as exc:
                    results[name] = exc

            async with anyio.create_task_group() as tg:
                tg.start_soon(call, QWEN, "Hello")
                tg.start_soon(call, LLAMA, "The farmer wakes up")
            assert results[LLAMA] == reference  # its neighbour failing changed nothing
            assert isinstance(results[QWEN], openai.APIStatusError)
            assert results[QWEN].status_code == 503
            assert "device fell over" not in str(results[QWEN].body)
            with pytest.raises(openai.APIStatusError) as later:
                await short(client, QWEN)
            assert later.value.status_code == 503
            assert await short(client, LLAMA, "The farmer wakes up") == reference
            assert [m.id for m in (await client.models.list()).data] == [LLAMA]
        health = server.health()
        assert health.status_code == 503
        assert health.json() == {
            "status": "degraded",
            "models": {LLAMA: "ready", QWEN: "unhealthy"},
        }
        assert httpx.get(f"{server.url}/health", params={"model": LLAMA}).status_code == 200
        assert httpx.get(f"{server.url}/health", params={"model": QWEN}).status_code == 503
        qwen = server.stats(QWEN)
        assert qwen["status"] == "unhealthy" and not qwen["healthy"] and qwen["failed"] >= 1


def test_a_model_that_fails_to_load_leaves_the_others_serving() -> None:
    fatal: list[BaseException] = []

    def broken() -> Engine:
        raise ModelLoadError("no such model file or directory: 'nowhere'")

    models = {**fixture_model(LLAMA), "broken": broken}
    with run_server(models, wait_ready=False, on_fatal=fatal.append) as server:
        wait_health(server, {LLAMA: "ready", "broken": "failed"})
        health = server.health()
        assert health.status_code == 503 and health.json()["status"] == "degraded"
        body = {"model": "broken", "prompt": "Hello", "max_tokens": 2}
        failed = httpx.post(f"{server.v1}/completions", json=body, timeout=30)
        assert failed.status_code == 503 and "nowhere" not in failed.text
        served = httpx.post(f"{server.v1}/completions", json={**body, "model": LLAMA}, timeout=30)
        assert served.status_code == 200
        assert not fatal  # the server keeps running for the model that works


def test_models_load_concurrently_and_each_serves_once_ready() -> None:
    both_loading = threading.Barrier(2, timeout=30)  # breaks unless the two loads overlap
    release_qwen = threading.Event()
    loaders = two_models()

    def load(name: str) -> Callable[[], Engine]:
        def run() -> Engine:
            both_loading.wait()
            if name == QWEN:
                release_qwen.wait(30)
            return loaders[name]()

        return run

    with run_server({name: load(name) for name in loaders}, wait_ready=False) as server:
        wait_health(server, {LLAMA: "ready", QWEN: "loading"})
        body = {"prompt": "Hello", "max_tokens": 2}
        llama = httpx.post(f"{server.v1}/completions", json={**body, "model": LLAMA}, timeout=30)
        qwen = httpx.post(f"{server.v1}/completions", json={**body, "model": QWEN}, timeout=30)
        assert llama.status_code == 200
        assert qwen.status_code == 503 and qwen.headers["retry-after"] == "5"
        models = httpx.get(f"{server.v1}/models").json()["data"]
        assert [m["id"] for m in models] == [LLAMA]
        release_qwen.set()
        wait_health(server, {LLAMA: "ready", QWEN: "ready"})
        assert server.health().status_code == 200


def wait_health(server: RunningServer, expected: dict[str, str], timeout: float = 60) -> None:
    """Poll /health until its models are in the `expected` states."""
    deadline = time.monotonic() + timeout
    while (models := server.health().json()["models"]) != expected:
        if time.monotonic() > deadline:
            pytest.fail(f"/health never showed {expected}; last: {models}")
        time.sleep(0.05)
