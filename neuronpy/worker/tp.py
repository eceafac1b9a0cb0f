"""Tensor parallelism below the worker's job interface: rank 0's device worker drives the others.

Every rank holds a shard of the model (arch/tp.py) and its own heads' KV. Rank 0's worker takes
the engine's jobs as any device worker does; before running each one it broadcasts it to the
followers, which run the same job on their shards in lockstep (the all-reduces inside the
forward keep them in step), and after it every rank reports whether the job failed. Only rank 0
answers. The engine, the server and the router do not know.

Start-up (tp_start.py), one machine: `start_tensor_parallel_worker` loads the weights, spawns
N-1 follower processes (torch.multiprocessing, spawn) and returns rank 0's worker
(neuronpy.compose builds the Engine over it). Several machines: rank 0 starts it with
`spawn=False` and each other rank calls `run_follower`, all with the standard MASTER_ADDR /
MASTER_PORT / WORLD_SIZE (and RANK for followers) environment.
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
import logging
import pickle
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

import torch

from neuronpy.arch.llama import LlamaModel
from neuronpy.defaults import DEFAULT_PREFILL_CHUNK
from neuronpy.errors import WorkerError
from neuronpy.worker.collectives import Collectives, RankLostError
from neuronpy.worker.jobs import Job, Shutdown
from neuronpy.worker.worker import DeviceWorker

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30.0  # seconds a collective may wait before its peer is declared lost


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
        payload = pickle.dumps(job)
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


# ---- followers ---------------------------------------------------------------------------------


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
