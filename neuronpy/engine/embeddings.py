"""Embeddings: the inputs of concurrent requests pooled together, in batches of packed
prefill-only sequences on the model's one device worker (they keep no KV and never join the
decode batch; the worker runs their jobs between decode steps, as it does prompt chunks)."""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio
import torch

from neuronpy.engine.runner import result_of
from neuronpy.errors import InvalidRequestError, QueueFullError, ShuttingDownError
from neuronpy.worker.jobs import EmbedBatch, EmbedResult
from neuronpy.worker.worker import DeviceWorker

log = logging.getLogger(__name__)

POOLING_MODES = ("last", "mean", "cls")


@dataclass(frozen=True)
class Pooling:
    """How a model's hidden states become one vector per input: the token(s) pooled ("last",
    "mean" or "cls"), whether the vector is L2-normalized, and where that was read (for the
    API's model card and the logs: "sentence-transformers" config, "config" or "default")."""

    mode: str = "last"
    normalize: bool = True
    source: str = "default"

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            modes = ", ".join(POOLING_MODES)
            raise ValueError(f"pooling must be one of {modes}, got {self.mode!r}")


@dataclass
class _Input:
    ids: tuple[int, ...]
    done: anyio.Event = field(default_factory=anyio.Event)
    vector: torch.Tensor | None = None
    error: BaseException | None = None
    abandoned: bool = False  # its request went away before it ran: skipped


class Embedder:
    """Pools inputs on the device worker, many per job: each job takes waiting inputs in
    arrival order (whatever request they came in) up to `batch_tokens` tokens (at least one
    input), so that one job holds the worker about as long as a prompt chunk does. At most
    `max_waiting` inputs wait; past that a request is refused (503 with Retry-After)."""

    def __init__(
        self,
        worker: DeviceWorker,
        pooling: Pooling,
        *,
        batch_tokens: int,
        max_waiting: int,
        name: str,
        score_ids: tuple[int, ...] | None = None,
    ) -> None:
        """`score_ids`: a reranker's, whose vectors are the logits of these tokens after each
        input (its "no" and "yes")."""
        self.pooling = pooling
        self.score_ids = score_ids
        self._worker = worker
        self._batch_tokens = batch_tokens
        self._max_waiting = max_waiting
        self._name = name
        self._waiting: collections.deque[_Input] = collections.deque()
        self._wake = anyio.Event()
        self._refusal: str | None = None
        self.inputs = 0  # pooled so far (metrics)
        self.tokens = 0
        self.jobs = 0

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def stop_admitting(self, reason: str) -> None:
        self._refusal = reason

    def fail_all(self, error: BaseException) -> None:
        """Every waiting input fails with `error` (the engine failed or shut down), and so
        does every later request."""
        self._refusal = str(error)
        while self._waiting:
            item = self._waiting.popleft()
            item.error = error
            item.done.set()

    async def embed(self, inputs: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Each input's pooled vector (float32, CPU), in order. Raises InvalidRequestError
        when they could never fit among those waiting, QueueFullError when they do not now,
        and a failed job's error for its inputs.
        Cancelled (the client left), its inputs that have not run yet are dropped."""
        if self._refusal is not None:
            raise ShuttingDownError(self._refusal)  # (the engine reports a failure itself)
        if len(inputs) > self._max_waiting:
            raise InvalidRequestError(
                f"'input' has {len(inputs)} inputs; model '{self._name}' takes at most "
                f"{self._max_waiting} at once",
                "input",
            )
        if len(self._waiting) + len(inputs) > self._max_waiting:
            raise QueueFullError(
                f"model '{self._name}' has {len(self._waiting)} embedding inputs waiting and "
                f"takes at most {self._max_waiting}; retry later"
            )
        items = [_Input(tuple(int(t) for t in ids)) for ids in inputs]
        self._waiting.extend(items)
        self._wake.set()
        try:
            for item in items:
                await item.done.wait()
        finally:
            for item in items:
                item.abandoned = True
        for item in items:
            if item.error is not None:
                raise item.error
        return [item.vector for item in items if item.vector is not None]

    async def run(self) -> None:
        """The batching task (in the engine's task group): a job whenever inputs wait."""
        while True:
            if not self._waiting:
                self._wake = anyio.Event()
                await self._wake.wait()
                continue
            batch = self._take()
            if not batch:
                continue
            job = EmbedBatch(
                tuple(i.ids for i in batch),
                self.pooling.mode,
                self.pooling.normalize,
                self.score_ids,
            )
            try:
                result: EmbedResult = await result_of(self._worker.submit(job))
            except Exception as exc:  # this job's inputs fail; the next job may run
                log.warning("an embedding job of %s failed: %s", self._name, exc)
                for item in batch:
                    item.error = exc
                    item.done.set()
                continue
            self.jobs += 1
            self.inputs += len(batch)
            self.tokens += sum(len(i.ids) for i in batch)
            for item, vector in zip(batch, result.vectors, strict=True):
                item.vector = vector
                item.done.set()

    def _take(self) -> list[_Input]:
        """The next job's inputs: those waiting, in order, up to the token budget."""
        batch: list[_Input] = []
        tokens = 0
        while self._waiting:
            item = self._waiting[0]
            if item.abandoned:
                self._waiting.popleft()
                continue
            if batch and tokens + len(item.ids) > self._batch_tokens:
                break
            batch.append(self._waiting.popleft())
            tokens += len(item.ids)
        return batch
