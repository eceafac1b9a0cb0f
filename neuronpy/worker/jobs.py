"""The device worker's jobs and results: plain data, never code of the engine (the worker runs
no closure of it). Results carry no tensors but CPU logits (and draft distributions)."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from neuronpy.media import Media
from neuronpy.worker.draw import DraftSampling


@dataclass(frozen=True)
class Prefill:
    """Prefill `token_ids` at B=1 (after snapshot `parent_id`'s tokens, if given) into snapshot
    `snapshot_id`; answer the last position's logits. With `parent_id == snapshot_id` the
    snapshot is extended (a prompt prefilled chunk by chunk between decode steps). The engine
    samples from the logits: a job carries plain data, never code of the engine."""

    snapshot_id: int
    token_ids: tuple[int, ...]
    parent_id: int | None = None
    reserve: int = 0  # tokens the snapshot will grow to (chunk by chunk): allocated up front
    # Only the parent's first `parent_length` tokens (a prefix-cache hit may use part of a
    # cached snapshot). The parent may be a cached snapshot: it is copied, never extended.
    parent_length: int | None = None
    # Keep the finished snapshot's columns in the prefix cache under this id (shared, not
    # copied: they are never written again).
    cache_id: int | None = None
    # Copies of the finished snapshot, stored under these ids (n > 1 completions of one
    # prompt): each samples its first token from the same logits.
    clone_ids: tuple[int, ...] = ()
    # False: answer no logits (a chunk before the prompt's last: the vocabulary projection is
    # not computed)
    logits: bool = True
    # answer the logits' argmax too (the first token of a plain greedy request: the engine's
    # thread then runs no tensor operation for it)
    argmax: bool = False
    # the images whose media ids the tokens hold (neuronpy/media.py): the worker encodes each
    # with the model's vision tower, once while its rows stay cached
    media: tuple[Media, ...] = ()


@dataclass(frozen=True)
class PrefillResult:
    snapshot_id: int
    length: int
    logits: torch.Tensor | None  # [vocab] float32, CPU; None when the job asked for none
    argmax: int | None = None  # the logits' argmax, when the job asked
    cached_bytes: int = 0  # what the prefix-cache entry (cache_id) holds: its whole buffers
    # the tokens the entry holds: the whole prompt, or (a model with fixed-size states) up to
    # the last STATE_BLOCK boundary its states were kept at; 0: no entry was kept
    cached_length: int = 0


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
    # prompt chunks of sequences entering the batch (one sequence each), prefilled in the
    # same forward: they share the step's weight reads (LlamaModel.forward_step); a chunk
    # that ends its prompt answers its last logits
    prefills: tuple[Prefill, ...] = ()
    # per row: tokens drafted to follow token_ids[b], verified in this step (row b feeds
    # 1 + len(drafts[b]) tokens, and has as many logits rows). Empty: no drafts
    drafts: tuple[tuple[int, ...], ...] = ()
    # answer each logits row's argmax too (the tokens of plain greedy rows)
    argmax: bool = False
    # per row of the live batch: decode columns to give back before the step (the drafts the
    # previous verify step rejected); empty: none
    trim: tuple[int, ...] = ()


@dataclass(frozen=True)
class ForwardResult:
    # [B, vocab] float32, CPU (with drafts: [N, vocab], row b's 1 + len(drafts[b]) in turn)
    logits: torch.Tensor
    prefills: tuple[PrefillResult, ...] = ()  # the prefill chunks', in order
    argmax: tuple[int, ...] = ()  # each logits row's argmax, when the job asked


@dataclass(frozen=True)
class DraftTokens:
    """The draft model drafts up to lengths[b] tokens to follow row b's context (its prompt and
    output so far, the last token fed to neither model yet), for the target's next verify
    step. Its KV of each row is kept between jobs under keys[b]: it first gives back the last
    rollback[b] tokens of it (drafts the target rejected), then feeds tokens[b] (what it lacks
    of the context), every row in one batched step of its own; a row it does not hold, or
    `fresh[b]`, starts over: tokens[b] is its whole context, prefilled. Then lengths' max
    (B, 1) steps draft. Every row the draft model holds is in the job (ReleaseDraftKv lets
    one go). A row drafts its draft model's argmax, or with `sampling[b]` (empty: every row
    greedy), draws from its truncated distribution; a row draws only its own lengths[b] drafts
    (steps past them take the argmax), so its draws never depend on the other rows."""

    keys: tuple[int, ...]
    tokens: tuple[tuple[int, ...], ...]
    rollback: tuple[int, ...]
    fresh: tuple[bool, ...]
    lengths: tuple[int, ...]
    sampling: tuple[DraftSampling | None, ...] = ()


@dataclass(frozen=True)
class DraftResult:
    drafts: tuple[tuple[int, ...], ...]  # per row: lengths[b] tokens
    # per row: the tokens of KV the draft model holds of it now (its context, and the drafts
    # it fed itself: lengths' max - 1 of them)
    held: tuple[int, ...] = ()
    # per row: the distributions its drafts were drawn from (a sampled row's; empty: greedy)
    probs: tuple[tuple[torch.Tensor, ...], ...] = ()


@dataclass(frozen=True)
class ReleaseDraftKv:
    """The draft model's KV of these rows (keys) goes."""

    keys: tuple[int, ...]


@dataclass(frozen=True)
class ExtractKvRows:
    """Store live rows `rows` back as contiguous snapshots `snapshot_ids` (gap dropped), then
    release the live batch: when rows enter or leave, the rows that stay are extracted, then
    the batch is assembled again."""

    rows: tuple[int, ...]
    snapshot_ids: tuple[int, ...]
    trim: tuple[int, ...] = ()  # per row of the batch: columns to give back first (see Forward)


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
class CacheKvSnapshots:
    """Move stored snapshots (rows extracted from the live batch included) into the prefix
    cache, compact, under the same ids: they leave the store of running snapshots. `keep`:
    per snapshot, the leading columns the cache takes (its prompt's), the rest dropped."""

    snapshot_ids: tuple[int, ...]
    keep: tuple[int, ...]


@dataclass(frozen=True)
class CacheResult:
    nbytes: tuple[int, ...]
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class DropCachedKv:
    """Evict these snapshots from the prefix cache."""

    cache_ids: tuple[int, ...]


@dataclass(frozen=True)
class OffloadKv:
    """Stored snapshots (rows extracted from the live batch included) of preempted sequences:
    given storage of their own, in CPU memory (the model's device is a GPU). Assembling them
    into a live batch again brings them back."""

    snapshot_ids: tuple[int, ...]


@dataclass(frozen=True)
class OffloadResult:
    nbytes: int  # what the snapshots take, now in CPU memory


@dataclass(frozen=True)
class SaveKvSnapshot:
    """Write stored snapshot `snapshot_id` to the session file `path`, with `metadata` (see
    engine/sessions.py). The worker takes a CPU copy; the file is written on a thread of its own
    and the result's `written` resolves once it is on disk. `drop`: the snapshot then leaves the
    store (else it stays, for a job that follows to take)."""

    snapshot_id: int
    path: Path
    metadata: Mapping[str, str]
    drop: bool = True


@dataclass(frozen=True)
class SaveResult:
    tokens: int
    written: Future[None]


@dataclass(frozen=True)
class LoadKvSnapshot:
    """Read the session file `path` (saved from the model of `fingerprint`) into the prefix
    cache's store under `cache_id`: read-only, a prefill copies what it uses of it."""

    cache_id: int
    path: Path
    fingerprint: str


@dataclass(frozen=True)
class LoadResult:
    token_ids: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class EmbedBatch:
    """Pool each sequence's final hidden states into one vector (embeddings), keeping no KV:
    the sequences packed into one forward (LlamaModel.pooled)."""

    sequences: tuple[tuple[int, ...], ...]
    pooling: str  # "last", "mean" or "cls"
    normalize: bool
    # given: answer the logits of these tokens after each sequence instead (a reranker's
    # "no" and "yes"), not the pooled hidden states
    score_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class EmbedResult:
    # [len(sequences), hidden] float32, CPU, in the job's order ([.., len(score_ids)] with them)
    vectors: torch.Tensor


@dataclass(frozen=True)
class WorkerStats:
    """Ask what the worker holds (for metrics and leak checks)."""


@dataclass(frozen=True)
class WorkerStatsResult:
    snapshots: int
    snapshot_bytes: int
    live_batch_size: int
    live_kv_columns: int
    cached_snapshots: int = 0  # held by the prefix cache (not counted in `snapshots`)
    cached_bytes: int = 0


@dataclass(frozen=True)
class StartProfile:
    """Start recording the time of every tensor operation the worker runs (torch.profiler),
    until StopProfile: where a served step's time goes."""


@dataclass(frozen=True)
class StopProfile:
    """Stop recording; answer the time spent in operations by class."""


@dataclass(frozen=True)
class ProfileResult:
    seconds: float  # wall time between StartProfile and StopProfile
    busy_seconds: float  # of which the worker thread ran jobs
    op_seconds: dict[str, float]  # inside operations, by class: linear, attention, other ops
    op_calls: int  # operations recorded (nested ones included: aten::linear and what it calls)


@dataclass(frozen=True)
class Shutdown:
    """Stop the worker thread after the jobs queued before it."""


Job = (
    Prefill
    | AssembleKvBatch
    | ForwardLogitsBatch
    | ExtractKvRows
    | DraftTokens
    | ReleaseDraftKv
    | DropKvSnapshot
    | CacheKvSnapshots
    | DropCachedKv
    | OffloadKv
    | SaveKvSnapshot
    | LoadKvSnapshot
    | EmbedBatch
    | WorkerStats
    | StartProfile
    | StopProfile
    | Shutdown
)
