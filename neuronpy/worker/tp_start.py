"""Tensor parallelism's start-up: rank 0 loads the weights, publishes what to load at its
rendezvous store, starts (or awaits) the followers and returns its worker over its own shard
(`start_tensor_parallel_worker`); a follower, spawned here or started on another machine from
MASTER_ADDR / MASTER_PORT / WORLD_SIZE / RANK, loads its shard and follows rank 0's jobs
(`run_follower`). The worker itself, and how a job runs on every rank, is tp.py's."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from neuronpy.arch.config import ArchConfig
from neuronpy.arch.tp import shard_from_hf
from neuronpy.arch.weights import check_divisible
from neuronpy.errors import ModelLoadError
from neuronpy.loading import LoadedWeights, calibration_ids, load_pretrained, resolve_device
from neuronpy.worker.collectives import Collectives, RankLostError, first_line
from neuronpy.worker.tp import ShardSpec, TensorParallelWorker, follow
from neuronpy.worker.worker import DeviceWorker

log = logging.getLogger(__name__)

DEFAULT_STARTUP_TIMEOUT = 900.0  # seconds for every rank to load its weights
DEFAULT_MASTER_ADDR = "127.0.0.1"
_SPEC_KEY = "neuronpy/tp/spec"


def _env(name: str, given: Any, default: Any = None) -> Any:
    if given is not None:
        return given
    value = os.environ.get(name)
    if value is None and default is None:
        raise ValueError(f"{name} is not set (pass it, or set it in the environment)")
    return value if value is not None else default


def _rank_device(device: str, local_rank: int) -> str:
    """The rank's own accelerator: "cuda" on one machine means cuda:0 for rank 0, cuda:1 ..."""
    resolved = resolve_device(device)
    if resolved == "cuda":
        return f"cuda:{local_rank}"
    return resolved


_ENVIRON_LOCK = threading.Lock()


@contextlib.contextmanager
def _follower_environment(device: str) -> Iterator[None]:
    """The environment a spawned follower starts with. On a CPU the ranks share this machine's
    cores: OpenMP threads spinning between operations (libgomp's default) then take the cores
    the other ranks need, and each collective waits on a rank that is not running. Sleeping
    waits (OMP_WAIT_POLICY=PASSIVE) made a TP-2 decode step about 4x faster here. A policy the
    user set is kept."""
    with _ENVIRON_LOCK:  # (models load in threads of their own: one changes it at a time)
        if resolve_device(device) != "cpu" or "OMP_WAIT_POLICY" in os.environ:
            yield
            return
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        try:
            yield
        finally:
            del os.environ["OMP_WAIT_POLICY"]


def _wait_ready(
    store: Any, world_size: int, followers: Sequence[BaseProcess], timeout: float
) -> None:
    """Until every follower has loaded its shard; a follower's failure or death ends it early."""
    deadline = time.monotonic() + timeout
    pending = set(range(1, world_size))
    while pending:
        for rank in sorted(pending):
            key = f"neuronpy/tp/ready/{rank}"
            if store.check([key]):
                status = store.get(key).decode()
                if status != "ok":
                    raise ModelLoadError(f"tensor-parallel rank {rank} could not start: {status}")
                pending.discard(rank)
        for rank, proc in enumerate(followers, start=1):
            if rank in pending and not proc.is_alive():
                raise ModelLoadError(
                    f"tensor-parallel rank {rank} exited during start-up (exit code "
                    f"{proc.exitcode})"
                )
        if pending and time.monotonic() > deadline:
            raise ModelLoadError(
                f"tensor-parallel rank(s) {sorted(pending)} did not load their weights within "
                f"{timeout:.0f} s"
            )
        if pending:
            time.sleep(0.05)


def start_tensor_parallel_worker(
    spec: ShardSpec,
    *,
    name: str = "model",
    spawn: bool = True,
    master_addr: str | None = None,
    master_port: int | None = None,
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    log_fn: Callable[[str], None] = log.info,
) -> tuple[TensorParallelWorker, LoadedWeights]:
    """Rank 0: loads the weights, starts (`spawn`) or awaits the followers, and returns the
    started worker over rank 0's shard, with the loaded weights (for the tokenizer and config;
    drop them once used).

    The rendezvous store listens at `master_addr`:`master_port`, else MASTER_ADDR / MASTER_PORT
    from the environment, else 127.0.0.1 and a free port (spawned followers only: followers
    on other machines must be told the port).
    """
    world = spec.world_size
    weights = load_pretrained(
        spec.model, dtype=spec.dtype, device=_rank_device(spec.device, 0), log=log_fn
    )
    check_divisible(ArchConfig.from_hf(weights.hf_model.config), world)
    addr = _env("MASTER_ADDR", master_addr, DEFAULT_MASTER_ADDR)
    port = int(_env("MASTER_PORT", master_port, 0 if spawn else None))
    store = dist.TCPStore(
        addr,
        port,
        world,
        is_master=True,
        timeout=timedelta(seconds=startup_timeout),
        wait_for_workers=False,
    )
    store.set(_SPEC_KEY, pickle.dumps(spec))
    followers: list[BaseProcess] = []
    try:
        if spawn:
            ctx = mp.get_context("spawn")
            for rank in range(1, world):
                proc = ctx.Process(
                    target=_spawned_follower,
                    args=(rank, world, addr, store.port, startup_timeout),
                    name=f"neuronpy-tp-rank{rank}",
                    daemon=True,  # ended with this process, should it exit without shutting down
                )
                with _follower_environment(spec.device):
                    proc.start()
                followers.append(proc)
            log_fn(
                f"started {world - 1} tensor-parallel follower(s) (rendezvous {addr}:{store.port})"
            )
        else:
            log_fn(f"waiting for {world - 1} tensor-parallel follower(s) at {addr}:{store.port}")
        collectives = Collectives(0, world, spec.timeout)
        shard = shard_from_hf(
            weights.hf_model,
            0,
            world,
            quantize=spec.quantize,
            calibration_ids=calibration_ids(weights.hf_model, weights.tokenizer, spec.quantize),
            reduce=collectives.all_reduce,
        )
        _wait_ready(store, world, followers, startup_timeout)
        collectives.attach(store, shard.device)
        worker = TensorParallelWorker(
            shard,
            collectives,
            name=name,
            prefill_chunk=spec.prefill_chunk,
            heartbeat=spec.heartbeat_seconds,
            followers=followers,
            store=store,
        )
    except BaseException:
        for proc in followers:
            proc.kill()
            proc.join(5.0)
        raise
    log_fn(f"tensor-parallel group of {world} ranks ready")
    return worker.start(), weights


def run_follower(
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    *,
    model: str | None = None,
    local_rank: int | None = None,
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    log_fn: Callable[[str], None] = log.info,
) -> None:
    """Runs rank `rank` (> 0) of a tensor-parallel group until rank 0 shuts it down; returns
    then. Arguments not given come from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
    LOCAL_RANK (default 0: the GPU of a CUDA rank). What to load comes from rank 0; `model`
    overrides its path (where this machine keeps the same weights elsewhere).

    Raises RankLostError when rank 0 dies or stops answering for the group's timeout."""
    rank = int(_env("RANK", rank))
    world = int(_env("WORLD_SIZE", world_size))
    addr = _env("MASTER_ADDR", master_addr)
    port = int(_env("MASTER_PORT", master_port))
    local = int(_env("LOCAL_RANK", local_rank, 0))
    if not 0 < rank < world:
        raise ValueError(f"a follower's rank must be in [1, {world}), got {rank}")
    store = dist.TCPStore(
        addr, port, world, is_master=False, timeout=timedelta(seconds=startup_timeout)
    )
    spec: ShardSpec = pickle.loads(store.get(_SPEC_KEY))
    if model is not None:
        spec = dataclasses.replace(spec, model=model)
    if spec.threads:
        torch.set_num_threads(spec.threads)
    ready = f"neuronpy/tp/ready/{rank}"
    try:
        device = _rank_device(spec.device, local)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        weights = load_pretrained(spec.model, dtype=spec.dtype, device=device, log=log_fn)
        collectives = Collectives(rank, world, spec.timeout)
        shard = shard_from_hf(
            weights.hf_model,
            rank,
            world,
            quantize=spec.quantize,
            calibration_ids=calibration_ids(weights.hf_model, weights.tokenizer, spec.quantize),
            reduce=collectives.all_reduce,
            lm_head=False,
        )
        del weights  # the shard holds copies of its slices: the full model can go
    except Exception as exc:
        store.set(ready, f"{type(exc).__name__}: {first_line(exc)}")
        raise
    store.set(ready, "ok")
    collectives.attach(store, shard.device)
    log_fn(f"tensor-parallel rank {rank} of {world} ready")
    follow(DeviceWorker(shard, f"tp-rank{rank}", spec.prefill_chunk), collectives)


def _spawned_follower(
    rank: int, world_size: int, master_addr: str, master_port: int, startup_timeout: float
) -> None:
    """The entry point of a follower process started by start_tensor_parallel_worker."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(message)s")
    try:
        run_follower(
            rank,
            world_size,
            master_addr,
            master_port,
            local_rank=rank,
            startup_timeout=startup_timeout,
        )
    except RankLostError as exc:
        log.error("tensor-parallel rank %d: rank 0 is lost (%s); exiting", rank, exc)
        _exit_now(1)
    _exit_now(0)


def _exit_now(code: int) -> NoReturn:
    """Ends a spawned follower without the interpreter's teardown: its process groups'
    native threads, destroyed in whatever order finalization reaches them, could abort the
    process ("terminate called without an active exception", exit code -6) after a clean
    shutdown. Nothing of the follower's needs saving but its output."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
