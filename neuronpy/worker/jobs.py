"""The device worker's jobs and results. Results carry no tensors but CPU logits."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# Chooses tokens from a [B, vocab] logits tensor, one per row (None: no token wanted for that
# row). Runs on the worker thread, so that every tensor operation of the engine runs there.
RowSampler = Callable[[torch.Tensor], Sequence[int | None]]


@dataclass(frozen=True)
class Prefill:
    """Prefill `token_ids` at B=1 (after snapshot `parent_id`'s tokens, if given) into snapshot
    `snapshot_id`; answer the last position's logits. With `parent_id == snapshot_id` the
    snapshot is extended (a prompt prefilled chunk by chunk between decode steps)."""

    snapshot_id: int
    token_ids: tuple[int, ...]
    parent_id: int | None = None
    sample: RowSampler | None = None  # given: answer the sampled token rather than the logits
    reserve: int = 0  # tokens the snapshot will grow to (chunk by chunk): allocated up front


@dataclass(frozen=True)
class PrefillResult:
    snapshot_id: int
    length: int
    logits: torch.Tensor | None  # [vocab] float32, CPU; None when the job sampled
    token: int | None = None  # the sampled token, when the job had `sample`


@dataclass(frozen=True)
class AssembleKvBatch:
    """Build the live batch from these snapshots, in this row order. The snapshots move into the
    batch (they leave the store) unless `keep_snapshots`. Replaces any previous live batch."""

    snapshot_ids: tuple[int, ...]
    keep_snapshots: bool = False


@dataclass(frozen=True)
class AssembleResult:
    batch_size: int
    padded_len: int
    padding_columns: int


@dataclass(frozen=True)
class ForwardLogitsBatch:
    """One lockstep decode step: row b consumes token_ids[b]. Positions and the padding mask come
    from the live batch the worker holds."""

    token_ids: tuple[int, ...]
    sample: RowSampler | None = None  # given: answer sampled tokens rather than the logits


@dataclass(frozen=True)
class ForwardResult:
    logits: torch.Tensor | None  # [B, vocab] float32, CPU; None when the job sampled
    tokens: tuple[int | None, ...] | None = None  # when the job had `sample`


@dataclass(frozen=True)
class ExtractKvRows:
    """Store live rows `rows` back as contiguous snapshots `snapshot_ids` (gap dropped), then
    release the live batch: every join or leave is extract-survivors, then assemble again."""

    rows: tuple[int, ...]
    snapshot_ids: tuple[int, ...]


@dataclass(frozen=True)
class ExtractResult:
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class DropKvSnapshot:
    snapshot_ids: tuple[int, ...]


@dataclass(frozen=True)
class DropResult:
    dropped: int


@dataclass(frozen=True)
class WorkerStats:
    """Ask what the worker holds (for metrics and leak checks)."""


@dataclass(frozen=True)
class WorkerStatsResult:
    snapshots: int
    snapshot_bytes: int
    live_batch_size: int
    live_kv_columns: int


@dataclass(frozen=True)
class Shutdown:
    """Stop the worker thread after the jobs queued before it."""


Job = (
    Prefill
    | AssembleKvBatch
    | ForwardLogitsBatch
    | ExtractKvRows
    | DropKvSnapshot
    | WorkerStats
    | Shutdown
)
