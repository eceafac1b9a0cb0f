"""/metrics in the Prometheus text format: request outcomes, latencies and the engine's batching
figures, scraped from real servers on loopback after real requests."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import openai
import pytest
from prometheus_client import REGISTRY
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from neuronpy.errors import QueueFullError, ShuttingDownError
from neuronpy.server.app import create_app
from neuronpy.server.errors import ApiError, api_error
from neuronpy.server.metrics import rejection_reason
from neuronpy.server.models import ServedModel
from tests.servers import RunningServer, fixture_model, run_server

MODEL = "tiny-llama"
TOKENS = 12  # per request; with ignore_eos every request samples exactly this many
CONCURRENT = 4

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server(fixture_model(max_in_flight=CONCURRENT, max_queue=8)) as running:
        yield running


def scrape(server: RunningServer) -> Samples:
    """Every sample of /metrics, parsed by prometheus_client's own parser: {(name, labels): v}."""
    response = httpx.get(f"{server.url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[name, frozenset({"model": MODEL, **labels}.items())]


def completion(api: openai.OpenAI, prompt: str, **kwargs: Any) -> Any:
    return api.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
        **kwargs,
    )


def test_metrics_count_requests_tokens_steps_and_latencies(server: RunningServer) -> None:
    before = scrape(server)
    api = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)
    prompt_tokens = 0

    async def concurrent() -> None:
        nonlocal prompt_tokens
        async with (
            openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0) as aapi,
            anyio.create_task_group() as tg,
        ):

            async def one(i: int) -> None:
                nonlocal prompt_tokens
                out = await aapi.completions.create(
                    model=MODEL,
                    prompt=f"Request number {i} says",
                    max_tokens=TOKENS,
                    temperature=0.0,
                    extra_body={"ignore_eos": True},
                )
                prompt_tokens += out.usage.prompt_tokens

            for i in range(CONCURRENT):
                tg.start_soon(one, i)

    anyio.run(concurrent)
    prompt_tokens += completion(api, "One at a time").usage.prompt_tokens
    streamed = list(
        completion(api, "Streamed", stream=True, stream_options={"include_usage": True})
    )
    assert streamed[-2].choices[0].finish_reason == "length"
    prompt_tokens += streamed[-1].usage.prompt_tokens
    requests = CONCURRENT + 2
    bad = httpx.post(f"{server.v1}/completions", json={"prompt": ""}, timeout=10)
    unknown = httpx.post(f"{server.v1}/completions", json={"model": "nope", "prompt": "x"})
    assert (bad.status_code, unknown.status_code) == (400, 404)
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("neuronpy_requests_admitted_total") == requests
    assert delta("neuronpy_requests_finished_total", finish_reason="length") == requests
    assert delta("neuronpy_generation_tokens_total") == requests * TOKENS
    assert delta("neuronpy_prompt_tokens_total") == prompt_tokens
    assert delta("neuronpy_requests_rejected_total", reason="invalid_request") == 1
    assert (
        after[
            "neuronpy_requests_rejected_total",
            frozenset({"model": "", "reason": "invalid_request"}.items()),
        ]
        >= 1
    )  # the unknown model: no served model to name
    assert delta("neuronpy_decode_steps_total") > 0
    assert delta("neuronpy_multi_row_steps_total") > 0
    assert value(after, "neuronpy_max_batch_size") >= 2
    # the batch-size histogram is the engine's per-size step counts: one observation per step
    steps = value(after, "neuronpy_decode_steps_total")
    assert value(after, "neuronpy_decode_batch_size_count") == steps
    assert value(after, "neuronpy_decode_batch_size_sum") == value(
        after, "neuronpy_decoded_rows_total"
    )
    assert value(after, "neuronpy_decode_batch_size_bucket", le="+Inf") == steps
    single = value(after, "neuronpy_decode_batch_size_bucket", le="1.0")
    assert single == steps - value(after, "neuronpy_multi_row_steps_total")
    alone = sum(
        value(after, "neuronpy_alone_steps_total", reason=r)
        for r in ("no_peer", "peer_prefilling", "peer_queued")
    )
    assert alone == single
    assert value(after, "neuronpy_decode_batch_size_bucket", le=f"{CONCURRENT}.0") == steps
    # latencies: one first token and one end per request, gaps between the later tokens
    admitted = value(after, "neuronpy_requests_admitted_total")
    assert value(after, "neuronpy_time_to_first_token_seconds_count") == admitted
    assert value(after, "neuronpy_request_latency_seconds_count") == admitted
    assert delta("neuronpy_inter_token_latency_seconds_count") > 0
    assert value(after, "neuronpy_time_to_first_token_seconds_sum") > 0
    for phase in ("forward", "prefill", "rebatch", "sampling"):
        assert delta("neuronpy_engine_seconds_total", phase=phase) > 0
    assert delta("neuronpy_rebatches_total") > 0
    assert delta("neuronpy_kv_columns_total") > 0
    # idle again, healthy, and the limits
    assert value(after, "neuronpy_requests_running") == 0
    assert value(after, "neuronpy_requests_queued") == 0
    assert value(after, "neuronpy_model_healthy") == 1
    assert value(after, "neuronpy_max_in_flight") == CONCURRENT
    assert value(after, "neuronpy_max_queue") == 8


def test_openmetrics_on_request(server: RunningServer) -> None:
    accept = {"Accept": "application/openmetrics-text; version=1.0.0"}
    response = httpx.get(f"{server.url}/metrics", headers=accept, timeout=10)
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.endswith("# EOF\n")
    names = {family.name for family in openmetrics_families(response.text)}
    assert {"neuronpy_decode_steps", "neuronpy_time_to_first_token_seconds"} <= names


def test_queue_full_and_cancelled_are_counted() -> None:
    """One row and no queue: a second request is refused while the first streams; the first,
    dropped by its client, counts as cancelled."""
    with run_server(fixture_model(max_in_flight=1, max_queue=0)) as server:
        before = scrape(server)
        body = json.dumps(
            {"prompt": "Long", "max_tokens": 480, "ignore_eos": True, "stream": True}
        ).encode()
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            received = b""
            while b"data: " not in received:
                received += sock.recv(65536)
            running = scrape(server)
            full = httpx.post(f"{server.v1}/completions", json={"prompt": "x", "max_tokens": 1})
            assert full.status_code == 503
        server.wait_for(lambda s: s["running"] == 0 and s["cancelled"] == 1)
        after = scrape(server)
    assert value(running, "neuronpy_requests_running") == 1
    assert value(running, "neuronpy_live_batch_size") == 1
    assert value(after, "neuronpy_requests_rejected_total", reason="queue_full") == 1
    assert value(after, "neuronpy_requests_cancelled_total") == 1
    assert value(after, "neuronpy_requests_admitted_total") == 1
    # it never ended on its own: no end, no end-to-end latency
    assert value(after, "neuronpy_request_latency_seconds_count") == 0
    assert value(after, "neuronpy_time_to_first_token_seconds_count") == 1
    assert value(before, "neuronpy_requests_cancelled_total") == 0


def test_each_app_has_its_own_registry() -> None:
    first, second = create_app(fixture_model()), create_app(fixture_model())  # no clash
    assert first is not second
    assert not any(family.name.startswith("neuronpy") for family in REGISTRY.collect())


def test_rejection_reasons() -> None:
    model = ServedModel(MODEL, lambda: None)  # type: ignore[arg-type,return-value]

    def raised(exc: Exception) -> ApiError:
        try:
            raise exc
        except (QueueFullError, ShuttingDownError) as cause:
            try:
                raise api_error(cause) from None
            except ApiError as error:
                return error

    assert rejection_reason(raised(QueueFullError("full")), model) == "queue_full"
    assert rejection_reason(raised(ShuttingDownError("bye")), model) == "shutting_down"
    assert rejection_reason(ApiError(400, "bad"), model) == "invalid_request"
    assert rejection_reason(ApiError(404, "who"), None) == "invalid_request"
    assert rejection_reason(ApiError(503, "wait"), model) == "loading"
    model.status = "failed"
    assert rejection_reason(ApiError(503, "broken"), model) == "unhealthy"
    assert rejection_reason(ApiError(500, "oops"), model) == "error"
    model.status = "stopping"
    assert rejection_reason(ApiError(503, "stopping"), model) == "shutting_down"


def test_per_request_histograms_for_vllm_style_dashboards(server: RunningServer) -> None:
    """Queue, prefill and decode time, time per output token, prompt and generated tokens per
    request: each moves by one observation per request, with the sums a request's figures
    make; the KV usage ratio stays within [0, 1]."""
    names = (
        "neuronpy_request_queue_time_seconds",
        "neuronpy_request_prefill_time_seconds",
        "neuronpy_request_decode_time_seconds",
        "neuronpy_request_time_per_output_token_seconds",
        "neuronpy_request_prompt_tokens",
        "neuronpy_request_generation_tokens",
    )
    before = scrape(server)
    api = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)
    outs = [completion(api, f"Hello number {i}") for i in range(3)]
    after = scrape(server)
    for name in names:
        assert value(after, f"{name}_count") - value(before, f"{name}_count") == 3, name
    generated = value(after, "neuronpy_request_generation_tokens_sum") - value(
        before, "neuronpy_request_generation_tokens_sum"
    )
    assert generated == 3 * TOKENS
    prompts = value(after, "neuronpy_request_prompt_tokens_sum") - value(
        before, "neuronpy_request_prompt_tokens_sum"
    )
    assert prompts == sum(o.usage.prompt_tokens for o in outs)
    assert 0.0 <= value(after, "neuronpy_kv_cache_usage_ratio") <= 1.0
    decode = value(after, "neuronpy_request_decode_time_seconds_sum") - value(
        before, "neuronpy_request_decode_time_seconds_sum"
    )
    tpot = value(after, "neuronpy_request_time_per_output_token_seconds_sum") - value(
        before, "neuronpy_request_time_per_output_token_seconds_sum"
    )
    assert tpot == pytest.approx(decode / (TOKENS - 1), rel=1e-6)
