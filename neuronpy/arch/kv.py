"""KV snapshots, the live batch, and the assemble / extract / mask primitives of rebatching.

Keys are stored after RoPE, so what lies in a padding column (and at which position) never
matters: only the mask does (padding columns hold zeros, so that masked scores stay finite).
Every row of a live batch has exactly one padding gap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

# Decode columns allocated ahead of need, so a step writes in place instead of growing the cache.
DEFAULT_HEADROOM = 64


@dataclass
class KvSnapshot:
    """One sequence's KV cache, contiguous: per layer K and V of shape [1, KVH, P, D].

    `token_ids` are the P tokens whose keys and values these are, in order.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    token_ids: list[int]
    # The whole per-layer K and V buffers when `keys` and `values` are views of their first P
    # columns: room reserved for a prompt prefilled chunk by chunk to grow into, in place.
    buffers: tuple[list[torch.Tensor], list[torch.Tensor]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.keys and self.keys[0].shape[2] != len(self.token_ids):
            raise ValueError(
                f"snapshot holds {self.keys[0].shape[2]} KV columns "
                f"for {len(self.token_ids)} tokens"
            )

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def capacity(self) -> int:
        """Columns it can hold without a new buffer (its length unless it has `buffers`)."""
        return self.buffers[0][0].shape[2] if self.buffers else self.length

    @property
    def nbytes(self) -> int:
        keys, values = self.buffers or (self.keys, self.values)
        return sum(t.numel() * t.element_size() for t in (*keys, *values))

    def layer(self, kind: Literal["keys", "values"], layer: int) -> torch.Tensor:
        """One layer's K or V as [KVH, columns, D]; its columns are `spans()`."""
        return getattr(self, kind)[layer][0]

    def spans(self) -> tuple[tuple[int, int], ...]:
        """The column ranges of `layer()` that hold this sequence, in order."""
        return ((0, self.length),)


@dataclass(frozen=True)
class BatchRow:
    """A row of a live batch released by extraction, not copied out yet: a snapshot in all but
    storage. `assemble_batch` copies it straight into the next batch, so a rebatch copies each
    surviving row once rather than out and back in; `materialize` gives it storage of its own
    (which releases the old batch's buffers once no row refers to them)."""

    batch: LiveBatch
    row: int

    @property
    def length(self) -> int:
        return self.batch.prefix_lens[self.row] + self.batch.steps

    @property
    def token_ids(self) -> list[int]:
        return self.batch.token_ids[self.row]

    @property
    def num_layers(self) -> int:
        return len(self.batch.keys)

    @property
    def nbytes(self) -> int:
        """What the row would take as a snapshot of its own."""
        per_column = sum(
            t.shape[1] * t.shape[3] * t.element_size()
            for t in (*self.batch.keys, *self.batch.values)
        )
        return per_column * self.length

    def layer(self, kind: Literal["keys", "values"], layer: int) -> torch.Tensor:
        return getattr(self.batch, kind)[layer][self.row]

    def spans(self) -> tuple[tuple[int, int], ...]:
        b = self.batch
        prefix = b.prefix_lens[self.row]
        return ((0, prefix), (b.padded_len, b.used)) if b.steps else ((0, prefix),)

    def materialize(self) -> KvSnapshot:
        return extract_row(self.batch, self.row)


KvSource = KvSnapshot | BatchRow


@dataclass
class LiveBatch:
    """B sequences decoding in lockstep.

    Per layer K and V: [B, KVH, capacity, D]. Row b's valid columns are [0, P_b) (its snapshot)
    and [padded_len, padded_len + steps) (its decode steps); [P_b, padded_len) is its one gap.
    Columns from `used` to `capacity` are headroom for the next steps.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    prefix_lens: list[int]
    padded_len: int
    token_ids: list[list[int]]
    steps: int = 0
    _prefix_lens_t: torch.Tensor | None = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return len(self.prefix_lens)

    @property
    def used(self) -> int:
        """KV columns written so far: the padded snapshots plus one column per decode step."""
        return self.padded_len + self.steps

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def row_lengths(self) -> list[int]:
        """Each row's real sequence length (the padding gap not counted)."""
        return [p + self.steps for p in self.prefix_lens]

    @property
    def padding_columns(self) -> int:
        """Padded KV columns across the batch (the waste of right-padding)."""
        return sum(self.padded_len - p for p in self.prefix_lens)

    def prefix_lens_tensor(self) -> torch.Tensor:
        """prefix_lens as a [B] int64 tensor on the cache's device (cached: it never changes)."""
        if self._prefix_lens_t is None:
            device = self.keys[0].device if self.keys else "cpu"
            self._prefix_lens_t = torch.tensor(self.prefix_lens, dtype=torch.long, device=device)
        return self._prefix_lens_t

    def positions(self) -> torch.Tensor:
        """RoPE position of each row's next token: [B] = P_b + steps."""
        return self.prefix_lens_tensor() + self.steps

    def ensure_headroom(self, columns: int = 1) -> None:
        """Grows every layer's buffer so `columns` more decode steps fit (amortised doubling)."""
        need = self.used + columns
        if need <= self.capacity:
            return
        new_cap = max(need, self.capacity + max(DEFAULT_HEADROOM, self.capacity // 2))
        for cache in (self.keys, self.values):
            for i, t in enumerate(cache):
                # columns past `used` are written by a step before any step reads them
                grown = t.new_empty(t.shape[0], t.shape[1], new_cap, t.shape[3])
                grown[:, :, : self.used] = t[:, :, : self.used]
                cache[i] = grown


def assemble_batch(snapshots: Sequence[KvSource], headroom: int = DEFAULT_HEADROOM) -> LiveBatch:
    """Right-pads each snapshot to the longest and stacks them on dim 0 into a live batch.

    Every column a source holds is copied once; only the padding gaps are zeroed (headroom
    columns are written by a decode step before any step reads them)."""
    if not snapshots:
        raise ValueError("cannot assemble an empty batch")
    prefix_lens = [s.length for s in snapshots]
    padded_len = max(prefix_lens)
    batch = len(snapshots)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    kinds: tuple[tuple[list[torch.Tensor], Literal["keys", "values"]], ...] = (
        (keys, "keys"),
        (values, "values"),
    )
    for layer in range(snapshots[0].num_layers):
        for dst, kind in kinds:
            first = snapshots[0].layer(kind, layer)  # [KVH, columns, D]
            out = first.new_empty(batch, first.shape[0], padded_len + headroom, first.shape[2])
            for b, src in enumerate(snapshots):
                t, at = src.layer(kind, layer), 0
                for lo, hi in src.spans():
                    out[b, :, at : at + hi - lo] = t[:, lo:hi]
                    at += hi - lo
                if at < padded_len:
                    out[b, :, at:padded_len].zero_()
            dst.append(out)
    return LiveBatch(
        keys=keys,
        values=values,
        prefix_lens=prefix_lens,
        padded_len=padded_len,
        token_ids=[list(s.token_ids) for s in snapshots],
    )


def batch_decode_mask(
    prefix_lens: torch.Tensor, padded_len: int, kv_len: int
) -> torch.Tensor | None:
    """Which KV columns each row attends to: [B, 1, 1, kv_len] bool (True = attend).

    Row b sees [0, P_b) and [padded_len, kv_len): its one padding gap is masked out. None when
    no row has a gap (all prefix lengths equal), so attention can skip the mask entirely.
    """
    if bool((prefix_lens == padded_len).all()):
        return None
    cols = torch.arange(kv_len, device=prefix_lens.device)  # [L]
    valid = (cols[None, :] < prefix_lens[:, None]) | (cols[None, :] >= padded_len)  # [B, L]
    return valid[:, None, None, :]


def extract_row(batch: LiveBatch, row: int) -> KvSnapshot:
    """Turns one live row back into a contiguous snapshot: its prefix, then its decode columns."""
    p, lo, hi = batch.prefix_lens[row], batch.padded_len, batch.used

    def take(t: torch.Tensor) -> torch.Tensor:  # [B, KVH, cap, D] -> [1, KVH, p + steps, D]
        return torch.cat((t[row : row + 1, :, :p], t[row : row + 1, :, lo:hi]), dim=2)

    return KvSnapshot(
        keys=[take(k) for k in batch.keys],
        values=[take(v) for v in batch.values],
        token_ids=list(batch.token_ids[row]),
    )
