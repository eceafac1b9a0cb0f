"""The collectives of a tensor-parallel group: job broadcast, acknowledgements, all-reduce."""

from __future__ import annotations

import pickle
import re
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from neuronpy.errors import WorkerError

_JOB_BUFFER = 4096  # bytes of one job broadcast; a decode step's job takes a few hundred
_GATHER_MAX = 1 << 18  # elements gathered at most: past that, the ring all-reduce moves less


class RankLostError(WorkerError):
    """A collective failed or timed out: a peer rank died or hangs, and the group is unusable."""


class Collectives:
    """One rank's end of the group: job broadcast, per-job acknowledgement, tensor all-reduce.

    The groups are attached once every rank has loaded its weights (`attach`); the shard's
    `reduce` is `all_reduce`, bound before that. Any failure raises RankLostError.
    """

    def __init__(self, rank: int, world_size: int, timeout: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timedelta(seconds=timeout)
        self._jobs: Any = None  # gloo: jobs and acknowledgements (CPU)
        self._tensors: Any = None  # the model's all-reduces: gloo on CPU, NCCL on CUDA

    def attach(self, store: Any, device: torch.device) -> None:
        """Builds the groups (a rendezvous through `store`: every rank calls it)."""
        prefix = dist.PrefixStore("neuronpy/tp/gloo", store)
        self._jobs = dist.ProcessGroupGloo(prefix, self.rank, self.world_size, self.timeout)
        self._tensors = self._jobs
        if device.type == "cuda":  # not exercised by the tests: they run on CPU
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            nccl_store = dist.PrefixStore("neuronpy/tp/nccl", store)
            self._tensors = dist.ProcessGroupNCCL(nccl_store, self.rank, self.world_size, options)

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:  # gloo: "Connection closed by peer", "Timed out ..."
            raise RankLostError(f"{what} failed: {first_line(exc)}") from exc

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums `t` over the ranks (the shard's LlamaModel.reduce).

        Small tensors (a decode step's rows) on gloo: gathered, then summed here in rank order.
        One exchange instead of the ring's two: 2-3x faster on a small CPU machine, and every
        rank adds the same numbers in the same order, so all hold bitwise the same result."""
        t = t.contiguous()
        if self._tensors is not self._jobs or t.numel() * self.world_size > _GATHER_MAX:
            self._wait(self._tensors.allreduce(t), "an all-reduce")
            return t
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self._wait(self._jobs.allgather([parts], [t]), "an all-reduce")
        total = parts[0]
        for part in parts[1:]:
            total += part
        return total

    def broadcast_job(self, payload: bytes | None) -> Any:
        """Rank 0 sends a pickled job (`payload`); the others receive and unpickle it. One
        broadcast of a fixed-size buffer (its first 8 bytes: the length), a second one for the
        rest of a job that does not fit (a long prompt)."""
        head = torch.zeros(_JOB_BUFFER, dtype=torch.uint8)
        if self.rank == 0:
            assert payload is not None
            framed = len(payload).to_bytes(8, "little") + payload
            first = framed[:_JOB_BUFFER]
            head[: len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        self._wait(self._jobs.broadcast(head, 0), "a job broadcast")
        size = int.from_bytes(head[:8].numpy().tobytes(), "little")
        rest = 8 + size - _JOB_BUFFER
        if rest > 0:
            tail = torch.empty(rest, dtype=torch.uint8)
            if self.rank == 0:
                tail.copy_(torch.frombuffer(bytearray(framed[_JOB_BUFFER:]), dtype=torch.uint8))
            self._wait(self._jobs.broadcast(tail, 0), "a job broadcast")
        if self.rank == 0:
            return None
        data = head[8:].numpy().tobytes()[:size]
        if rest > 0:
            data += tail.numpy().tobytes()
        return pickle.loads(data)

    def acknowledge(self, failed: bool) -> list[int]:
        """Every rank says whether its job failed; answers the ranks that did."""
        flag = torch.tensor([int(failed)], dtype=torch.int32)
        flags = [torch.empty_like(flag) for _ in range(self.world_size)]
        self._wait(self._jobs.allgather([flags], [flag]), "a job acknowledgement")
        return [rank for rank, f in enumerate(flags) if f.item()]


def first_line(exc: BaseException) -> str:
    # gloo opens its messages with its source location: "[.../pair.cc:537] Read error ..."
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip())
    # ... and some close with advice meant for someone else's logs
    text = text.split(". This is typically caused")[0]
    return text.splitlines()[0][:300] if text else type(exc).__name__
