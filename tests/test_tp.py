"""Tensor parallelism (arch/weights.py and tp.py, worker/tp.py, compose.py): a model split over
2 ranks, in 2 processes on gloo, computes what one device computes, and a lost rank fails
requests instead of hanging."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
import torch

from neuronpy.arch.llama import LlamaModel
from neuronpy.arch.tp import shard_from_hf
from neuronpy.arch.weights import TensorParallelError, check_divisible
from neuronpy.compose import start_tensor_parallel
from neuronpy.config import EngineConfig
from neuronpy.engine.engine import Engine
from neuronpy.engine.types import FinishReason
from neuronpy.errors import WorkerError
from neuronpy.worker.jobs import (
    AssembleKvBatch,
    DropKvSnapshot,
    ExtractKvRows,
    ForwardLogitsBatch,
    Prefill,
)
from neuronpy.worker.tp import ShardSpec, TensorParallelWorker
from neuronpy.worker.tp_start import start_tensor_parallel_worker
from neuronpy.worker.worker import DeviceWorker
from tests.factories import fixture_dir, hf_model, make_engine, tokenizer
from tests.servers import run_server
from tests.test_engine_parity import MAX_TOKENS, TEXTS, concurrently, greedy, summary

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 10.0  # the group's collective timeout in these tests
HANG_TIMEOUT = 4.0  # ... where a test waits it out
# Logits reach about 30 on the tiny fixture; summing the two ranks' partial outputs in another
# order than one device's GEMM moves them by up to ~3e-5 (1e-6 relative): float32 rounding.
TOL = {"atol": 1e-4, "rtol": 1e-5}


@pytest.fixture(autouse=True)
def no_orphans() -> Iterator[None]:
    """Whatever a test does or fails to do, no follower process outlives it."""
    yield
    for proc in multiprocessing.active_children():
        if proc.name.startswith("neuronpy-tp-rank"):
            proc.kill()
            proc.join(5)
            pytest.fail(f"{proc.name} was still running after the test")


def followers() -> list[Any]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("neuronpy-tp-rank")]


# ---- the split, in one process (two threads stand in for two ranks) ---------------------------


class ThreadedReduce:
    """An all-reduce between threads of this process, in rank order as Collectives sums."""

    def __init__(self, world: int) -> None:
        self.parts: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=30)

    def for_rank(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t
            self.barrier.wait()
            total = self.parts[0].clone()  # type: ignore[union-attr]
            for part in self.parts[1:]:
                total += part  # type: ignore[operator]
            self.barrier.wait()  # nobody overwrites a part before everyone has summed
            return total

        return reduce


def split_prefill(name: str, ids: list[int], quantize: str, world: int = 2) -> torch.Tensor:
    """Last-position logits of `ids` through `world` shards run side by side in threads."""
    hf = hf_model(name)
    reduce = ThreadedReduce(world)
    calibration = ids if quantize != "none" else []
    shards = [
        shard_from_hf(
            hf,
            r,
            world,
            quantize=quantize,
            calibration_ids=calibration,
            reduce=reduce.for_rank(r),
            lm_head=r == 0,
        )
        for r in range(world)
    ]
    hidden: list[torch.Tensor | None] = [None] * world

    def run(rank: int) -> None:
        hidden[rank] = shards[rank].prefill(ids)[1]

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert shards[1].logits(hidden[1]).shape[-1] == 0  # followers carry no LM head
    return shards[0].logits(hidden[0])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_parity_shards_in_threads_match_one_device(name: str) -> None:
    """Column/row split with GQA grouping, q/k/v bias (qwen2) and q/k norms (qwen3)."""
    ids = tokenizer(name).encode("The quick brown fox jumps over the lazy dog")
    model = LlamaModel.from_hf(hf_model(name))
    expected = model.logits(model.prefill(ids)[1])
    torch.testing.assert_close(split_prefill(name, ids, "none"), expected, **TOL)


def test_int8_shards_are_as_close_to_float_as_one_int8_device() -> None:
    """int8 quantizes each shard after slicing (per-shard scales): not bitwise the unsplit int8
    model, but as close to the float one."""
    ids = tokenizer().encode("The quick brown fox jumps over the lazy dog")
    ref = LlamaModel.from_hf(hf_model())
    exact = ref.logits(ref.prefill(ids)[1])
    single = LlamaModel.from_hf(hf_model(), quantize="int8", calibration_ids=ids)
    one = single.logits(single.prefill(ids)[1])
    split = split_prefill("tiny-llama", ids, "int8")

    def cosine(a: torch.Tensor) -> float:
        return torch.nn.functional.cosine_similarity(a, exact, dim=-1).min().item()

    assert cosine(split) > 0.95 and cosine(split) > cosine(one) - 0.02


def test_counts_that_do_not_divide_are_refused_by_name() -> None:
    config = LlamaModel.from_hf(hf_model()).config  # 4 heads, 2 KV heads, intermediate 128
    check_divisible(config, 2)
    with pytest.raises(TensorParallelError, match=r"num_key_value_heads = 2 is not divisible by 4"):
        check_divisible(config, 4)
    with pytest.raises(ValueError, match=r"num_attention_heads = 4, num_key_value_heads = 2, "):
        shard_from_hf(hf_model(), 0, 3, reduce=lambda t: t)


# ---- two processes over gloo ------------------------------------------------------------------


def spec(**kw: Any) -> ShardSpec:
    return ShardSpec(str(fixture_dir()), 2, dtype="float32", threads=1, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def follower_from_environment(port: int) -> Iterator[subprocess.Popen[bytes]]:
    """Rank 1 as another machine starts it: a process of its own that knows the group only from
    RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."""
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(port)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, "-m", "neuronpy", "tp-follower"], env=env)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def test_parity_tp2_prefill_and_batched_decode_logits() -> None:
    """Rank 0 in this process and rank 1 started from the environment (as on two machines):
    every job's logits equal one device's, through chunked prefill, a ragged batched decode, a
    leave (extract + reassemble) and more decode. A job failing on both ranks alike breaks
    nothing; a hung rank breaks the group within the collective timeout."""
    port = free_port()
    with follower_from_environment(port) as rank1:
        worker, _ = start_tensor_parallel_worker(
            spec(prefill_chunk=8, timeout=HANG_TIMEOUT), spawn=False, master_port=port
        )
        try:
            _check_logits_and_a_hang(worker, rank1)
        finally:
            worker.shutdown(30)


def _check_logits_and_a_hang(worker: TensorParallelWorker, rank1: subprocess.Popen[bytes]) -> None:
    reference = DeviceWorker(LlamaModel.from_hf(hf_model()), prefill_chunk=8)
    tok = tokenizer()
    prompts = [tok.encode(t) for t in TEXTS[:4]]

    def run(call: Callable[[Any], Any]) -> list[torch.Tensor]:
        out = [call(Prefill(i, tuple(p))).logits for i, p in enumerate(prompts)]
        call(AssembleKvBatch((0, 1, 2, 3)))
        tokens: tuple[int, ...] = (5, 6, 7, 8)
        for step in range(6):
            if step == 3:  # row 1 leaves: the survivors are extracted and batched again
                call(ExtractKvRows((0, 2, 3), (10, 12, 13)))
                call(DropKvSnapshot((1,)))
                call(AssembleKvBatch((10, 12, 13)))
                tokens = tokens[:1] + tokens[2:]
            logits = call(ForwardLogitsBatch(tokens)).logits
            out.append(logits)
            tokens = tuple(logits.argmax(-1).tolist())
        return out

    got = run(lambda job: worker.submit(job).result(timeout=60))
    expected = run(reference.handle)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    with pytest.raises(Exception, match="unknown snapshots"):  # fails on both ranks alike
        worker.submit(AssembleKvBatch((99,))).result(timeout=60)
    assert worker.broken is None
    time.sleep(1.5 * worker.idle_seconds)  # type: ignore[operator]  # heartbeats only
    assert worker.broken is None and rank1.poll() is None

    # a rank that hangs (stopped, its sockets open) is lost after the collective timeout; rank
    # 0 cannot kill a rank it did not start (the fixture does)
    os.kill(rank1.pid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"tensor-parallel rank 1 is lost: .*[Tt]imed out"):
        worker.submit(ForwardLogitsBatch((1, 2, 3))).result(timeout=60)
    assert time.monotonic() - started < HANG_TIMEOUT + 5
    with pytest.raises(WorkerError, match="rank 1 is lost"):  # later jobs fail fast
        worker.submit(ForwardLogitsBatch((1, 2, 3))).result(timeout=1)


async def start_engine(**config: Any) -> Engine:
    return await anyio.to_thread.run_sync(
        lambda: start_tensor_parallel(
            str(fixture_dir()),
            2,
            name="tiny-llama",
            config=EngineConfig(**config),
            dtype="float32",
            timeout=TIMEOUT,
            threads=1,
        )
    )


@pytest.mark.anyio
async def test_parity_tp2_engine_with_joins_and_leaves_is_byte_identical() -> None:
    tok = tokenizer()
    jobs = [(tok.encode(t), greedy(m)) for t, m in zip(TEXTS, MAX_TOKENS, strict=True)]
    # a long prompt joins while the others decode: its chunks ride the decode steps
    jobs.append((tok.encode(" ".join(TEXTS * 3))[:150], greedy(20)))
    async with make_engine(max_in_flight=1, prefill_chunk=32) as serial:
        expected = [await serial.complete(p, sp) for p, sp in jobs]
    engine = await start_engine(max_in_flight=8, prefill_chunk=32)
    async with engine:
        (rank1,) = followers()
        got = await concurrently(engine, jobs)
        stats = engine.stats()
        assert engine.healthy
    assert [summary(c) for c in got] == [summary(c) for c in expected]
    assert stats.max_batch_size >= 3 and stats.rebatches >= 4
    assert rank1.exitcode == 0  # shut down with the engine


@pytest.mark.anyio
async def test_parity_tp2_with_prompt_lookup_speculation() -> None:
    """Verify steps over two ranks: each rank trims the rejected drafts' columns alike (the
    trim rides the next job), and the output is one device's without speculation."""
    tok = tokenizer()
    jobs = [(tok.encode(t), greedy(m)) for t, m in zip(TEXTS, MAX_TOKENS, strict=True)]
    async with make_engine(max_in_flight=1) as serial:
        expected = [await serial.complete(p, sp) for p, sp in jobs]
    engine = await start_engine(max_in_flight=8, speculative="ngram", prompt_lookup_min=1)
    async with engine:
        got = await concurrently(engine, jobs)
        stats = engine.stats()
        assert engine.healthy
    assert [summary(c) for c in got] == [summary(c) for c in expected]
    assert stats.spec_accepted_tokens > 0 and stats.spec_draft_tokens > stats.spec_accepted_tokens


@pytest.mark.anyio
async def test_killing_a_rank_mid_batch_fails_requests_and_marks_unhealthy() -> None:
    tok = tokenizer()
    engine = await start_engine(max_in_flight=8)
    async with engine:
        streams = [engine.submit(tok.encode(t), greedy(400, ignore_eos=True)) for t in TEXTS[:4]]
        finals: list[Any] = [None] * len(streams)
        tokens = [0] * len(streams)
        killed = anyio.Event()

        async def read(i: int) -> None:
            async for event in streams[i]:
                tokens[i] += len(event.token_ids)
                if event.finish_reason is not None:
                    finals[i] = event

        async def kill_when_all_decode() -> None:
            while min(tokens) < 5:
                await anyio.sleep(0.01)
            (rank1,) = followers()
            rank1.kill()
            killed.set()

        with anyio.fail_after(TIMEOUT + 20):  # no hang: bounded by the collective timeout
            async with anyio.create_task_group() as tg:
                tg.start_soon(kill_when_all_decode)
                for i in range(len(streams)):
                    tg.start_soon(read, i)
        assert killed.is_set()
        for final in finals:
            assert final.finish_reason is FinishReason.ERROR and final.error
        assert engine.healthy is False
        broken = engine._worker.broken  # type: ignore[attr-defined]
        assert broken and broken.startswith("tensor-parallel rank 1 is lost")
        assert max(tokens) < 400


def test_a_rank_killed_mid_stream_fails_it_and_turns_health_503_over_http(tmp_path: Path) -> None:
    """A TP-2 model behind the real server: it serves; a session is refused (each rank holds
    its own heads); a follower killed while a stream runs ends that stream with an error
    naming the lost rank, and /health and the model's later requests answer 503."""

    def load() -> Engine:
        return start_tensor_parallel(
            str(fixture_dir()), 2, name="tiny-llama", dtype="float32", timeout=TIMEOUT, threads=1
        )

    with run_server({"tiny-llama": load}, sessions_dir=tmp_path) as server:
        assert server.health().status_code == 200
        body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        ok = httpx.post(f"{server.v1}/completions", json=body, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        refused = httpx.post(f"{server.v1}/completions", json={**body, "session": "s"}, timeout=30)
        assert refused.status_code == 400 and "tensor parallel" in refused.text
        api = openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0, timeout=60)
        stream = api.completions.create(
            model="tiny-llama",
            prompt="Once upon a time",
            max_tokens=400,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        received = 0
        with pytest.raises(openai.APIError, match="tensor-parallel rank 1 is lost"):
            for _chunk in stream:
                received += 1
                if received == 5:
                    (rank1,) = followers()
                    rank1.kill()
        assert 5 <= received < 400
        health = server.health()
        assert health.status_code == 503
        assert health.json()["models"]["tiny-llama"] == "unhealthy"
        after = httpx.post(f"{server.v1}/completions", json=body, timeout=30)
        assert after.status_code == 503
