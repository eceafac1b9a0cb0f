"""Tensor parallelism below the worker's job interface: rank 0's device worker drives the others.

Every rank holds a shard of the model (arch/tp.py) and its own heads' KV. Rank 0's worker takes
the engine's jobs as any device worker does; before running each one it broadcasts it to the
followers, which run the same job on their shards in lockstep (the all-reduces inside the
forward keep them in step), and after it every rank reports whether the job failed. Only rank 0
answers. The engine, the server and the router do not know.

Start-up, one machine: `start_tensor_parallel_worker` loads the weights, spawns N-1 follower
processes (torch.multiprocessing, spawn) and returns rank 0's worker (neuronpy.compose builds
the Engine over it). Several machines: rank 0 starts it with `spawn=False` and each other rank
calls `run_follower`, all with the standard MASTER_ADDR / MASTER_PORT / WORLD_SIZE (and RANK for
followers) environment.
Rank 0 runs the rendezvous store at MASTER_ADDR:MASTER_PORT and publishes there what to load, so
a follower needs no other setting (`model=` when its copy of the weights lives elsewhere).

The groups are private ProcessGroupGloo instances over that store (what init_process_group
builds), not the process-global default group, so a server may run several tensor-parallel
models side by side. A collective that fails (a peer process died: immediately) or waits longer
than `timeout` (a peer hangs) marks the worker broken: the in-flight requests fail, the engine
turns unhealthy, and no job waits forever. An idle rank 0 broadcasts a heartbeat every
`heartbeat` seconds, so each side notices the other's loss while nothing runs.

Jobs travel pickled, as torch.distributed's object collectives send them: the rendezvous port
must only be reachable by the ranks themselves.
"""

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
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from neuronpy.arch.config import ArchConfig
from neuronpy.arch.llama import LlamaModel
from neuronpy.arch.tp import shard_from_hf
from neuronpy.arch.weights import check_divisible
from neuronpy.defaults import DEFAULT_PREFILL_CHUNK
from neuronpy.errors import ModelLoadError, WorkerError
from neuronpy.loading import LoadedWeights, calibration_ids, load_pretrained, resolve_device
from neuronpy.worker.collectives import Collectives, RankLostError, first_line
from neuronpy.worker.jobs import Job, Shutdown
from neuronpy.worker.worker import DeviceWorker

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30.0  # seconds a collective may wait before its peer is declared lost
DEFAULT_STARTUP_TIMEOUT = 900.0  # seconds for every rank to load its weights
DEFAULT_MASTER_ADDR = "127.0.0.1"
_SPEC_KEY = "neuronpy/tp/spec"


@dataclass(frozen=True)
class Heartbeat:
    """A no-op job an idle rank 0 broadcasts, so that both sides see a lost peer while idle."""


@dataclass(frozen=True)
class ShardSpec:
    """What every rank loads: picklable, it reaches the followers through the rendezvous store.
    `model`, `dtype`, `device`: as load_pretrained takes them (a CUDA device becomes the rank's
    own GPU, cuda:LOCAL_RANK)."""

    model: str | None
    world_size: int
    dtype: str = "auto"
    device: str = "cpu"
    quantize: str = "none"
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    timeout: float = DEFAULT_TIMEOUT
    heartbeat: float | None = None  # None: a fifth of `timeout`, at most 5 s
    threads: int | None = None  # torch threads of a follower (None: torch's default)

    @property
    def heartbeat_seconds(self) -> float:
        return self.heartbeat if self.heartbeat is not None else min(5.0, self.timeout / 5)


def _without_sampler(job: Any) -> Any:
    """The job as followers get it: samplers (closures over the engine) only run on rank 0,
    riding prefill chunks' included."""
    changes = {}
    for name in ("sample", "verify"):
        if getattr(job, name, None) is not None:
            changes[name] = None
    if getattr(job, "prefills", ()):
        changes["prefills"] = tuple(_without_sampler(p) for p in job.prefills)
    return dataclasses.replace(job, **changes) if changes else job


class TensorParallelWorker(DeviceWorker):
    """Rank 0's device worker: runs every job on all ranks in lockstep, answers rank 0's result.

    `followers`: the follower processes this process started (killed when the group breaks,
    joined at shutdown); empty when they run on other machines.
    """

    # each rank's snapshots hold its own KV heads: a session file holds every head
    supports_sessions = False

    def __init__(
        self,
        model: LlamaModel,
        collectives: Collectives,
        *,
        name: str = "model",
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        heartbeat: float = DEFAULT_TIMEOUT / 5,
        followers: Sequence[BaseProcess] = (),
        store: Any = None,
    ) -> None:
        super().__init__(model, name, prefill_chunk)
        self.idle_seconds = heartbeat
        self.collectives = collectives
        self.followers = list(followers)
        self._store = store  # the rendezvous server: kept alive with the group
        self._start_lock = threading.Lock()
        self._started = False

    def start(self) -> TensorParallelWorker:
        """Idempotent: the launcher starts it at once, so that heartbeats flow before the engine
        is entered (which starts its worker again)."""
        with self._start_lock:
            if not self._started:
                self._started = True
                super().start()
        return self

    def on_idle(self) -> None:
        if self.broken is None:
            with contextlib.suppress(WorkerError):  # `broken` says why; the engine reads it
                self.handle(Heartbeat())

    def handle(self, job: Job | Heartbeat) -> Any:  # type: ignore[override]
        if self.broken is not None:
            if isinstance(job, Shutdown):
                self._release(grace=0.0)
                return None
            raise WorkerError(self.broken)
        # pickled before any collective: a job that cannot travel fails alone, breaking nothing
        payload = pickle.dumps(_without_sampler(job))
        result: Any = None
        error: Exception | None = None
        try:
            self.collectives.broadcast_job(payload)
            if not isinstance(job, Heartbeat):
                try:
                    result = super().handle(job)
                except RankLostError:
                    raise
                except Exception as exc:  # the followers likely failed the same way: compared below
                    error = exc
            failed = self.collectives.acknowledge(error is not None)
        except RankLostError as exc:
            self._lose(exc)
        if failed and failed != list(range(self.collectives.world_size)):
            # one rank failed a job another ran: their KV stores differ now
            self._set_broken(
                f"tensor-parallel ranks diverged: rank(s) {failed} failed a "
                f"{type(job).__name__} job the others ran"
            )
            raise WorkerError(self.broken) from error
        if error is not None:
            raise error
        if isinstance(job, Shutdown):
            self._release(grace=10.0)
        return result

    def _lose(self, exc: RankLostError) -> NoReturn:
        """A collective failed: say which rank is lost, and stop the local followers."""
        time.sleep(0.1)  # a killed follower's exit is seen a moment after its socket closes
        dead = [rank for rank, p in enumerate(self.followers, start=1) if not p.is_alive()]
        if dead:
            who = f"rank {', '.join(map(str, dead))}"
        elif self.collectives.world_size == 2:
            who = "rank 1"
        else:
            who = "a rank"
        self._set_broken(f"tensor-parallel {who} is lost: {exc}")
        self._release(grace=0.0)
        raise WorkerError(self.broken) from exc

    def _set_broken(self, message: str) -> None:
        if self.broken is None:
            self.broken = message
            log.error("%s", message)

    def _release(self, grace: float) -> None:
        """Waits up to `grace` seconds for the local followers to exit, then kills the rest."""
        deadline = time.monotonic() + grace
        for proc in self.followers:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        self._store = None


# ---- start-up ----------------------------------------------------------------------------------


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


# ---- followers ---------------------------------------------------------------------------------


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


def follow(worker: DeviceWorker, collectives: Collectives) -> None:
    """The follower loop: receive a job, run it on this rank's shard (on this thread: the
    worker's own thread is never started), report, until Shutdown."""
    while True:
        job = collectives.broadcast_job(None)
        failed = False
        if not isinstance(job, Heartbeat):
            try:
                with torch.inference_mode():
                    worker.handle(job)
            except RankLostError:
                raise
            except Exception:  # rank 0 likely failed the same way; the acknowledgement says
                log.exception(
                    "tensor-parallel rank %d: job %s failed", collectives.rank, type(job).__name__
                )
                failed = True
        collectives.acknowledge(failed)
        if isinstance(job, Shutdown):
            return


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
