"""The systems a benchmark runs, all on the same loaded weights: neuronpy (in-process engine or
over HTTP) and its peers (neuronpy serial, Hugging Face `generate()` serial and static-batched,
transformers' continuous batching).

Every system runs a `Workload` and returns what its clients saw, as `RequestRecord`s with times
in seconds since the workload started, so one set of metric functions covers them all.

Threads and fairness. PyTorch's CPU kernels run on OpenMP (libgomp), and libgomp gives every OS
thread that runs a parallel region a team of its own. Once the process holds more OpenMP threads
than CPUs, libgomp stops spin-waiting between parallel regions and sleeps instead, which made
`generate()` 1.3-2x slower on a 2-core machine while an idle engine merely existed in the same
process. So each system lives only for its own run (started, warmed up, run, closed), and any
torch work outside the measured threads (loading, building an engine) runs in a short-lived
thread (`in_fresh_thread`) whose OpenMP team goes away with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.from_thread

from neuronpy.bench.metrics import RequestRecord, engine_delta
from neuronpy.bench.workloads import UNCONSTRAINED, WORKLOADS, BenchRequest, Workload
from neuronpy.threads import start_in_own_thread

log = logging.getLogger(__name__)

T = TypeVar("T")

# peer names, in the order the table shows them
NEURONPY = "neuronpy"
NEURONPY_SERIAL = "neuronpy-serial"
NEURONPY_EAGER = "neuronpy-eager"
NEURONPY_SPEC = "neuronpy-spec"  # neuronpy with speculative decoding (bench --speculative)
# with --tensor-parallel N: the same engine on one device, beside the split one
NEURONPY_ONE_DEVICE = "neuronpy-1-device"
HF_SERIAL = "hf-generate"
HF_STATIC = "hf-static"
HF_CB = "hf-generate-batch"
PEERS = (NEURONPY_SERIAL, NEURONPY_EAGER, HF_SERIAL, HF_STATIC, HF_CB)

PEER_HELP = {
    NEURONPY_SERIAL: "neuronpy with max_in_flight=1 (one request at a time)",
    NEURONPY_EAGER: "neuronpy with its layers run eagerly (compile off)",
    HF_SERIAL: "transformers generate(), one request at a time",
    HF_STATIC: "transformers generate() over static left-padded batches (K wide in W1)",
    HF_CB: "transformers continuous batching (the manager behind model.generate_batch)",
}

WARMUP_TOKENS = 4


def in_fresh_thread(fn: Callable[[], T], name: str = "neuronpy-bench") -> T:
    """Runs `fn` in a new thread and returns its result (or raises its error). The thread ends
    with it, and so does the OpenMP team its torch work created (see the module docstring)."""
    fut, thread = start_in_own_thread(fn, name)
    thread.join()  # gone, with its OpenMP team, before the next measurement starts
    return fut.result()


PROFILE_SECONDS = 3.0  # the window Engine.profile records in a profiled run


@dataclass
class RunOutput:
    records: list[RequestRecord]
    duration: float
    engine: dict[str, Any] | None = None


class System:
    """One system under test, started for each run: `start` builds it and warms it up once,
    `run` measures, `close` tears it down (the runner does all three in one fresh thread)."""

    name: str = ""
    description: str = ""
    drive: str = "in-process"
    workloads: frozenset[str] = frozenset(WORKLOADS)

    def applies(self, workload: Workload) -> bool:
        return workload.name in self.workloads

    def start(self, warmup: Workload) -> None:
        self.run(warmup)

    def run(self, workload: Workload) -> RunOutput:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def profile(self, workload: Workload) -> dict[str, Any] | None:
        """Runs the workload again (unmeasured) while recording where the system's steps
        spend their time; None when the system cannot say."""
        return None

    def info(self) -> dict[str, Any]:
        return {"description": self.description, "drive": self.drive}


# ---- the async client side: arrivals, joins, per-chunk timestamps ------------------------------

Send = Callable[[BenchRequest, RequestRecord, Callable[[int], None]], Awaitable[None]]


async def drive(requests: Sequence[BenchRequest], send: Send) -> tuple[list[RequestRecord], float]:
    """Sends every request at its arrival time (or when its join condition holds) through
    `send`, which streams the reply and calls `on_chunk(tokens)` per chunk (0: unknown)."""
    n = len(requests)
    records = [
        RequestRecord(sent=0.0, prompt_tokens=len(r.prompt_ids), tag=r.tag) for r in requests
    ]
    progress = [0] * n
    finished = [False] * n
    gates = {i: anyio.Event() for i, r in enumerate(requests) if r.after_tokens is not None}
    t0 = time.perf_counter()

    def check_gates() -> None:
        for j, gate in gates.items():
            need = requests[j].after_tokens or 0
            earlier = [i for i in range(j) if i not in gates]
            if not gate.is_set() and all(finished[i] or progress[i] >= need for i in earlier):
                gate.set()

    def chunk(i: int, tokens: int) -> None:
        records[i].chunk_times.append(time.perf_counter() - t0)
        progress[i] += max(tokens, 1)
        if gates:
            check_gates()

    async def one(i: int) -> None:
        req = requests[i]
        if i in gates:
            await gates[i].wait()
        else:
            delay = t0 + req.arrival - time.perf_counter()
            if delay > 0:
                await anyio.sleep(delay)
        rec = records[i]
        rec.sent = time.perf_counter() - t0
        try:
            await send(req, rec, lambda tokens: chunk(i, tokens))
        except Exception as exc:
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            finished[i] = True
            if gates:
                check_gates()

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    start = min((r.sent for r in records), default=0.0)
    end = max((r.end for r in records), default=start)
    return records, end - start


async def precompile(requests: Sequence[BenchRequest], send: Send) -> None:
    """W5's schemas compiled before its measured run: each request once with one output token
    (untimed). W5 then measures what constrained decoding costs per step; compiling is a cost
    per distinct schema, counted by /metrics (neuronpy_grammar_compile_seconds)."""
    first = [dataclasses.replace(r, max_tokens=1, arrival=0.0) for r in requests if r.schema]
    if first:
        await drive(first, send)


class _Portal:
    """An event loop in a background thread, kept across runs (the engine lives in it)."""

    def __init__(self) -> None:
        self._cm = anyio.from_thread.start_blocking_portal(backend="asyncio")
        self.portal = self._cm.__enter__()

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


# ---- neuronpy, in-process ----------------------------------------------------------------------


def engine_snapshot(engine: Any) -> dict[str, Any]:
    """The engine's counters and, where it exposes one, its cumulative time split (seconds).
    Read defensively: `stats().timing` if the engine has it, else the private `_timing`."""
    stats = engine.stats()
    snap = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(stats)
    timing = snap.pop("timing", None)
    if timing is None:
        timing = getattr(engine, "_timing", None)
    if isinstance(timing, Mapping):
        snap["timing"] = {k: float(v) for k, v in timing.items() if isinstance(v, (int, float))}
    return snap


def engine_label(config: Any) -> str:
    """max_in_flight, and the weight mode where it is not the default."""
    label = f"max_in_flight={config.max_in_flight}"
    quantize = getattr(config, "quantize", "none")
    return label if quantize in (None, "none") else f"{label}, quantize={quantize}"


def engine_send(engine: Any) -> Send:
    from neuronpy.engine.types import Constraint, FinishReason, SamplingParams

    async def send(req: BenchRequest, rec: RequestRecord, on_chunk: Callable[[int], None]) -> None:
        constraint = None if req.schema is None else Constraint("json_schema", req.schema)
        params = SamplingParams(
            max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True, constraint=constraint
        )
        await engine.prepare(req.prompt_ids, params)  # (a schema's compile counts in TTFT)
        ids: list[int] = []
        text: list[str] = []
        async with engine.submit(req.prompt_ids, params) as stream:
            async for event in stream:
                if event.token_ids:
                    on_chunk(len(event.token_ids))
                    ids.extend(event.token_ids)
                text.append(event.text)
                if event.finished:
                    rec.output_tokens = event.completion_tokens
                    if event.finish_reason not in (FinishReason.LENGTH, FinishReason.STOP):
                        rec.error = f"finished with {event.finish_reason.value}: {event.error}"
        rec.token_ids, rec.text = ids, "".join(text)

    return send


class NeuronpyEngine(System):
    """neuronpy's Engine in this process, driven through its Python API."""

    def __init__(self, name: str, config: Any, build: Callable[[], Any]):
        """`build`: makes the engine with `config` (blocking; run on a thread that ends)."""
        self.name = name
        self.config = config
        self.description = f"neuronpy engine in-process ({engine_label(config)})"
        self._build = build
        self._portal: _Portal | None = None
        self._engine_cm: Any = None
        self.engine: Any = None

    def start(self, warmup: Workload) -> None:
        self.engine = in_fresh_thread(self._build)
        self._portal = _Portal()
        self._engine_cm = self._portal.portal.wrap_async_context_manager(self.engine)
        self._engine_cm.__enter__()
        self.run(warmup)

    def run(self, workload: Workload) -> RunOutput:
        assert self._portal is not None
        send = engine_send(self.engine)
        self._portal.portal.call(precompile, workload.requests, send)
        before = engine_snapshot(self.engine)
        records, duration = self._portal.portal.call(drive, workload.requests, send)
        after = engine_snapshot(self.engine)
        return RunOutput(records, duration, engine_delta(before, after, duration))

    def profile(self, workload: Workload) -> dict[str, Any] | None:
        """The workload again, with Engine.profile recording a window of its steady state:
        from when the batch is as full as the workload makes it, for up to PROFILE_SECONDS."""
        assert self._portal is not None
        engine = self.engine
        full = min(engine.max_running, len(workload.requests))

        async def profiled() -> Any:
            found: list[Any] = []
            done = anyio.Event()
            async with anyio.create_task_group() as tg:

                async def window() -> None:
                    while engine.stats().live_batch_size < full:
                        if done.is_set():
                            return  # the batch never filled: no window
                        await anyio.sleep(0.02)
                    found.append(await engine.profile(PROFILE_SECONDS, until=done))

                tg.start_soon(window)
                await drive(workload.requests, engine_send(engine))
                done.set()  # a window still recording ends with the run
            return found[0] if found else None

        result = self._portal.portal.call(profiled)
        if result is None or not result.decode_steps:
            return None
        return {
            "per_step_ms": result.per_step_ms(),
            "seconds": result.seconds,
            "decode_steps": result.decode_steps,
            "mean_batch_size": result.decoded_rows / result.decode_steps,
            "op_calls_per_step": result.op_calls / result.decode_steps,
        }

    def close(self) -> None:
        if self._engine_cm is not None:
            self._engine_cm.__exit__(None, None, None)
            self._engine_cm = None
        if self._portal is not None:
            self._portal.close()
            self._portal = None
        self.engine = None

    def info(self) -> dict[str, Any]:
        return super().info() | {"engine_config": dataclasses.asdict(self.config)}


# ---- neuronpy over HTTP --------------------------------------------------------------------------


class LoopbackServer:
    """`create_app` served by uvicorn on a loopback port in a background thread."""

    def __init__(self, name: str, load_engine: Callable[[], Any], timeout: float = 600.0):
        import uvicorn

        from neuronpy.server.app import create_app

        self.name = name
        self.app = create_app(_app_models(create_app, name, load_engine))
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

    @property
    def engine(self) -> Any:
        """The served engine (the app's state: one model, or a map of served models)."""
        state = getattr(self.app.state, "neuron", None)
        models = getattr(state, "models", None)
        if isinstance(models, Mapping):
            served = models.get(self.name) or next(iter(models.values()), None)
            return getattr(served, "engine", None)
        return getattr(state, "engine", None)

    def _wait_healthy(self, timeout: float) -> None:
        import httpx

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


def _app_models(create_app: Callable[..., Any], name: str, load: Callable[[], Any]) -> Any:
    """What `create_app` takes first: a map of served models {name: loader}, or one loader."""
    import inspect

    first = next(iter(inspect.signature(create_app).parameters.values()), None)
    if first is not None and first.name == "models":
        return {name: load}
    return load


def http_send(client: Any, url: str, model: str) -> Send:
    async def send(req: BenchRequest, rec: RequestRecord, on_chunk: Callable[[int], None]) -> None:
        body = {
            "model": model,
            "prompt": list(req.prompt_ids),
            "max_tokens": req.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if req.schema is not None:
            schema = {"name": "w5", "schema": json.loads(req.schema)}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        text: list[str] = []
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                raise RuntimeError(f"HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"].get("message", chunk["error"])))
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    on_chunk(0)  # the SSE chunk does not say how many tokens it carries
                    text.append(choices[0]["text"])
                usage = chunk.get("usage")
                if usage:
                    rec.output_tokens = int(usage.get("completion_tokens", 0))
        rec.text = "".join(text)
        if not rec.output_tokens:  # a server without usage: one token per chunk
            rec.output_tokens = len(rec.chunk_times)

    return send


def _stats_from_json(body: Any, model: str) -> dict[str, Any] | None:
    """An engine's counters out of GET /stats (one model at the top, or a list / map of them)."""
    if not isinstance(body, dict):
        return None
    if "decode_steps" in body:
        return body
    models = body.get("models")
    if isinstance(models, dict):
        entry = models.get(model) or next(iter(models.values()), None)
        return entry if isinstance(entry, dict) else None
    if isinstance(models, list):
        for entry in models:
            if isinstance(entry, dict) and entry.get("model") in (model, None):
                return entry
    return None


class NeuronpyHttp(System):
    """neuronpy behind its OpenAI-compatible server, streamed over HTTP: a server at `url`, or
    one this system starts on loopback (`load_engine` builds its engine)."""

    drive = "http"

    def __init__(
        self,
        name: str,
        *,
        url: str | None = None,
        load_engine: Callable[[], Any] | None = None,
        model: str | None = None,
        max_connections: int = 512,
    ):
        if (url is None) == (load_engine is None):
            raise ValueError("give a server url or an engine to serve, not both")
        self.name = name
        self.url = url.rstrip("/") if url else None
        self._load_engine = load_engine
        self.model = model
        self._server: LoopbackServer | None = None
        self._portal: _Portal | None = None
        self._client: Any = None
        self._max_connections = max_connections
        self.description = (
            f"neuronpy server at {self.url}" if url else "neuronpy server on loopback (uvicorn)"
        )

    def start(self, warmup: Workload) -> None:
        import httpx

        if self._load_engine is not None:
            engine = in_fresh_thread(self._load_engine)
            self._server = LoopbackServer(self.model or "model", lambda: engine)
            self.url = self._server.url
        assert self.url is not None
        models = httpx.get(f"{self.url}/v1/models", timeout=30).json().get("data") or []
        ids = [m.get("id") for m in models]
        if not ids:
            raise RuntimeError(f"{self.url}/v1/models lists no model")
        if self.model not in ids:
            self.model = ids[0]
        self._portal = _Portal()
        limits = httpx.Limits(max_connections=self._max_connections, max_keepalive_connections=64)
        self._client = self._portal.portal.call(
            lambda: _make_client(limits)  # the client belongs to the portal's loop
        )
        self.run(warmup)

    def _snapshot(self) -> dict[str, Any] | None:
        if self._server is not None and self._server.engine is not None:
            return engine_snapshot(self._server.engine)
        import httpx

        try:
            body = httpx.get(f"{self.url}/stats", timeout=10).json()
        except (httpx.HTTPError, ValueError):
            return None
        return _stats_from_json(body, self.model or "")

    def run(self, workload: Workload) -> RunOutput:
        assert self._portal is not None and self.url and self.model
        send = http_send(self._client, self.url, self.model)
        self._portal.portal.call(precompile, workload.requests, send)
        before = self._snapshot()
        records, duration = self._portal.portal.call(drive, workload.requests, send)
        return RunOutput(records, duration, engine_delta(before, self._snapshot(), duration))

    def close(self) -> None:
        if self._portal is not None:
            if self._client is not None:
                self._portal.portal.call(self._client.aclose)
            self._portal.close()
            self._portal = None
        if self._server is not None:
            self._server.close()
            self._server = None

    def info(self) -> dict[str, Any]:
        return super().info() | {"url": self.url, "model": self.model}


async def _make_client(limits: Any) -> Any:
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits)


# ---- Hugging Face generate() ---------------------------------------------------------------------


class _TimingStreamer:
    """A transformers streamer that only records when each generated token arrives. The first
    `put` is the prompt; each later one is one step's token(s) for every row."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter() - self.t0)

    def end(self) -> None:
        pass


def _pad_id(hf_model: Any, tokenizer: Any) -> int:
    for source in (tokenizer, getattr(hf_model, "generation_config", None), hf_model.config):
        value = getattr(source, "pad_token_id", None)
        if isinstance(value, int):
            return value
    for source in (tokenizer, getattr(hf_model, "generation_config", None), hf_model.config):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            return value
        if isinstance(value, (list, tuple)) and value:
            return int(value[0])
    return 0


def _eos_ids(hf_model: Any) -> list[int]:
    out: list[int] = []
    for source in (getattr(hf_model, "generation_config", None), hf_model.config):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, int))
    return sorted(set(out))


class HfGenerate(System):
    """`model.generate()` in greedy mode, EOS ignored (min_new_tokens = max_new_tokens). Serial:
    one request at a time, in arrival order. Static: left-padded batches taken in arrival order,
    K wide in W1 (else `batch_size` wide), each running to its longest request."""

    workloads = frozenset({"W1", "W2", "W3"})

    def __init__(self, name: str, hf_model: Any, tokenizer: Any, *, static: bool, batch_size: int):
        self.name = name
        self.static = static
        self.batch_size = batch_size
        self.description = PEER_HELP[HF_STATIC if static else HF_SERIAL]
        self._model = hf_model
        self._pad = _pad_id(hf_model, tokenizer)
        self._eos = _eos_ids(hf_model)

    def run(self, workload: Workload) -> RunOutput:
        import torch
        from transformers import GenerationConfig

        requests = workload.requests
        width = 1 if not self.static else (workload.concurrency or self.batch_size)
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
        records = [RequestRecord(sent=r.arrival, prompt_tokens=len(r.prompt_ids)) for r in requests]
        device = self._model.device
        t0 = time.perf_counter()
        for at in range(0, len(order), width):
            group = order[at : at + width]
            ready = max(requests[i].arrival for i in group)
            delay = t0 + ready - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            longest = max(len(requests[i].prompt_ids) for i in group)
            ids = [
                [self._pad] * (longest - len(requests[i].prompt_ids)) + list(requests[i].prompt_ids)
                for i in group
            ]
            mask = [
                [0] * (longest - len(requests[i].prompt_ids)) + [1] * len(requests[i].prompt_ids)
                for i in group
            ]
            new = max(requests[i].max_tokens for i in group)
            config = GenerationConfig(
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=self._pad,
                eos_token_id=self._eos or None,
            )
            streamer = _TimingStreamer(t0)
            try:
                with torch.inference_mode():
                    out = self._model.generate(
                        input_ids=torch.tensor(ids, device=device),
                        attention_mask=torch.tensor(mask, device=device),
                        generation_config=config,
                        streamer=streamer,
                    )
            except Exception as exc:
                for i in group:
                    records[i].error = f"{type(exc).__name__}: {exc}"[:300]
                continue
            for row, i in enumerate(group):
                n = requests[i].max_tokens
                rec = records[i]
                rec.chunk_times = streamer.times[:n]
                rec.output_tokens = len(rec.chunk_times)
                rec.token_ids = out[row, longest : longest + n].tolist()
        start = min((r.sent for r in records), default=0.0)
        return RunOutput(records, max((r.end for r in records), default=start) - start)

    def info(self) -> dict[str, Any]:
        width = f"K in W1, else {self.batch_size}" if self.static else 1
        return super().info() | {"batch": width}


# ---- transformers continuous batching ------------------------------------------------------------


class HfContinuousBatching(System):
    """transformers' continuous batching: the manager `model.generate_batch` runs, here started
    per run (its KV cache sized to the workload), warmed up with a short request, then fed each
    request at its arrival time. Token times are the manager's own (record_timestamps)."""

    def __init__(
        self, name: str, hf_model: Any, *, max_batch_tokens: int = 512, page_size: int = 256
    ):
        self.name = name
        self.description = PEER_HELP[HF_CB]
        self.workloads = UNCONSTRAINED  # it has no constrained decoding
        self._model = hf_model
        self.max_batch_tokens = max_batch_tokens
        self.page_size = page_size

    def start(self, warmup: Workload) -> None:
        pass  # each run starts its own manager and warms it up first

    def _blocks(self, requests: Sequence[BenchRequest]) -> int:
        page = self.page_size
        need = sum(math.ceil((len(r.prompt_ids) + r.max_tokens) / page) + 1 for r in requests)
        return need + 4  # and the warm-up request

    def run(self, workload: Workload) -> RunOutput:
        from transformers import ContinuousBatchingConfig, GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        requests = workload.requests
        cb_config = ContinuousBatchingConfig(
            num_blocks=self._blocks(requests),
            max_batch_tokens=max(self.max_batch_tokens, 64),
            page_size=self.page_size,
        )
        gen_config = GenerationConfig(
            do_sample=False, max_new_tokens=workload.max_output_len, eos_token_id=-1
        )
        hints = WorkloadHints(
            max_prompt_length=workload.max_prompt_len,
            max_generated_length=workload.max_output_len,
            num_requests=len(requests) + 1,
        )
        records = [
            RequestRecord(sent=0.0, prompt_tokens=len(r.prompt_ids), tag=r.tag) for r in requests
        ]
        with self._model.continuous_batching_context_manager(
            generation_config=gen_config,
            continuous_batching_config=cb_config,
            block=True,
            timeout=60,
            warmup=False,
            workload_hints=hints,
        ) as manager:
            warm = list(requests[0].prompt_ids[:32])
            manager.add_request(
                warm, request_id="warmup", max_new_tokens=WARMUP_TOKENS, eos_token_id=-1
            )
            while True:
                result = manager.get_result(timeout=1)
                if result is not None and result.request_id == "warmup" and result.is_finished():
                    break
                if result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop died in warm-up")
            self._feed(manager, workload, records)
        start = min((r.sent for r in records), default=0.0)
        return RunOutput(records, max((r.end for r in records), default=start) - start)

    def _feed(self, manager: Any, workload: Workload, records: list[RequestRecord]) -> None:
        requests = workload.requests
        streaming = workload.triggered  # partial results only to know when a join is due
        progress = [0] * len(requests)
        finished = [False] * len(requests)
        waiting = sorted(
            (i for i, r in enumerate(requests) if r.after_tokens is None),
            key=lambda i: requests[i].arrival,
        )
        gated = [i for i, r in enumerate(requests) if r.after_tokens is not None]
        t0 = time.perf_counter()

        def add(i: int) -> None:
            r = requests[i]
            records[i].sent = time.perf_counter() - t0
            manager.add_request(
                list(r.prompt_ids),
                request_id=f"r{i}",
                max_new_tokens=r.max_tokens,
                streaming=streaming,
                record_timestamps=True,
                eos_token_id=-1,
            )

        done = 0
        while done < len(requests):
            now = time.perf_counter() - t0
            while waiting and requests[waiting[0]].arrival <= now:
                add(waiting.pop(0))
            for j in list(gated):
                need = requests[j].after_tokens or 0
                if all(finished[i] or progress[i] >= need for i in range(j) if i not in gated):
                    gated.remove(j)
                    add(j)
            wait = 0.05
            if waiting:
                wait = min(wait, max(0.001, requests[waiting[0]].arrival - now))
            result = manager.get_result(timeout=wait)
            if result is None:
                if not manager.is_running():
                    for i, rec in enumerate(records):
                        if not finished[i]:
                            rec.error = "transformers' continuous batching loop stopped"
                    return
                continue
            if not result.request_id.startswith("r"):
                continue
            i = int(result.request_id[1:])
            progress[i] = len(result.generated_tokens)
            if not result.is_finished() or finished[i]:
                continue
            finished[i] = True
            done += 1
            rec = records[i]
            rec.token_ids = list(result.generated_tokens)
            rec.output_tokens = len(rec.token_ids)
            rec.chunk_times = [ts - t0 for ts in (result.timestamps or [])]
            if result.error is not None:
                rec.error = str(result.error)[:300]

    def info(self) -> dict[str, Any]:
        return super().info() | {
            "max_batch_tokens": self.max_batch_tokens,
            "page_size": self.page_size,
            "num_blocks": "sized to each workload",
        }
