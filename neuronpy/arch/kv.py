"""KV snapshots, the live batch's KV (KvBatch), and the assemble / extract / mask primitives
of rebatching.

Keys are stored after RoPE, so what lies in a padding column (and at which position) never
matters: only the mask does. Padding columns and headroom hold zeros until written: a verify
step's queries attend over columns up to its longest row's, and a masked column must hold finite
values (a NaN left in memory would reach the output through its zero attention weight).
The live batch is one or more groups; within a group every row has exactly one padding gap.

Layers whose state is fixed-size (arch/mixer.py: Gated DeltaNet, Mamba2, short convolutions)
keep it beside the KV, per layer a few tensors with the row as dim 0 (`states`): concatenated
when rows are assembled, sliced whole (copied) when one is extracted, with nothing to pad and
nothing to mask. `keys` and `values` then hold the attention layers only, in order. A state is
a sequence's after its last token: it cannot be cut to a shorter prefix as KV can.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

# one fixed-size-state layer's tensors for some rows: [rows, ...] each
States = tuple[torch.Tensor, ...]

# Decode columns allocated ahead of need, so a step writes in place instead of growing the cache.
DEFAULT_HEADROOM = 64
# Groups a live batch may hold: each costs one attention call per layer and step, and saves
# the padding (and the copy) of fitting rows of very different lengths into one buffer.
DEFAULT_MAX_GROUPS = 3


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
    # per fixed-size-state layer (arch/mixer.py): its state after the last token, [1, ...] each
    states: list[States] = field(default_factory=list, repr=False)
    # the states after an earlier token count (a STATE_BLOCK boundary, for the prefix cache):
    # (that count, per layer its states), taken by a prefill asked to (`capture`)
    checkpoint: tuple[int, list[States]] | None = field(default=None, repr=False)

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
    def num_states(self) -> int:
        return len(self.states)

    @property
    def capacity(self) -> int:
        """Columns it can hold without a new buffer (its length unless it has `buffers`)."""
        return self.buffers[0][0].shape[2] if self.buffers else self.length

    @property
    def nbytes(self) -> int:
        keys, values = self.buffers or (self.keys, self.values)
        return sum(t.numel() * t.element_size() for t in (*keys, *values)) + states_nbytes(
            self.states
        )

    def layer(self, kind: Literal["keys", "values"], layer: int) -> torch.Tensor:
        """One layer's K or V as [KVH, columns, D]; its columns are `spans()`."""
        return getattr(self, kind)[layer][0]

    def row_states(self, layer: int) -> States:
        """Fixed-size-state layer `layer`'s state tensors, [1, ...] each."""
        return self.states[layer]

    def spans(self) -> tuple[tuple[int, int], ...]:
        """The column ranges of `layer()` that hold this sequence, in order."""
        return ((0, self.length),)


@dataclass
class KvGroup:
    """Rows of a live batch that share one KV buffer: snapshots right-padded to `padded_len`
    and concatenated on dim 0, then one column per decode step for every row.

    Per layer K and V: [B_g, KVH, capacity, D]. Row b's valid columns are [0, P_b) (its
    snapshot) and [padded_len, padded_len + steps) (its decode steps); [P_b, padded_len) is its
    one gap, zeroed. Columns from `used` to `capacity` are headroom for the next steps.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    prefix_lens: list[int]
    padded_len: int
    steps: int = 0
    # per row: how many of the last `steps` decode columns are not its own (drafts a verify
    # step rejected, dropped by `trim`); None: every row holds all `steps`
    lags: list[int] | None = None
    # per fixed-size-state layer: its state tensors, [B_g, ...] each (see the module's docstring)
    states: list[States] = field(default_factory=list)
    # the states of the steps `trim` may take back: per step, each row's token count and per
    # such layer the states after 0, 1, ... of the step's tokens. A verify step keeps its
    # own; a group that `record`s (a draft model's, whose drafts span steps) keeps every
    # step's until a trim
    history: list[tuple[list[int], list[list[States]]]] | None = field(default=None, repr=False)
    record: bool = False
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
        return [p + s for p, s in zip(self.prefix_lens, self.row_steps, strict=True)]

    @property
    def row_steps(self) -> list[int]:
        """Each row's decode columns: [padded_len, padded_len + row_steps[b]) are its own."""
        if self.lags is None:
            return [self.steps] * self.batch_size
        return [self.steps - lag for lag in self.lags]

    @property
    def uniform(self) -> bool:
        """Whether every row holds all `steps` decode columns (one write column for all)."""
        return self.lags is None

    @property
    def padding_columns(self) -> int:
        """Padded KV columns across the group (the waste of right-padding)."""
        return sum(self.padded_len - p for p in self.prefix_lens)

    def prefix_lens_tensor(self) -> torch.Tensor:
        """prefix_lens as a [B_g] int64 tensor on the cache's device (cached: never changes)."""
        if self._prefix_lens_t is None:
            device = self.keys[0].device if self.keys else "cpu"
            self._prefix_lens_t = torch.tensor(self.prefix_lens, dtype=torch.long, device=device)
        return self._prefix_lens_t

    def positions(self) -> torch.Tensor:
        """RoPE position of each row's next token: [B_g] = P_b + its decode steps."""
        if self.lags is None:
            return self.prefix_lens_tensor() + self.steps
        return self.prefix_lens_tensor() + torch.tensor(self.row_steps, device=self.device)

    @property
    def device(self) -> torch.device:
        return self.keys[0].device if self.keys else torch.device("cpu")

    def decode_mask(self) -> torch.Tensor | None:
        """The attention mask of the next step (see batch_decode_mask); uniform groups only."""
        assert self.lags is None, "a group whose rows lag has a mask per row (_RaggedStep)"
        return batch_decode_mask(self.prefix_lens_tensor(), self.padded_len, self.used + 1)

    def spans(self, row: int) -> tuple[tuple[int, int], ...]:
        """Row `row`'s valid column ranges, in order."""
        prefix, steps = self.prefix_lens[row], self.row_steps[row]
        if not steps:
            return ((0, prefix),)
        return ((0, prefix), (self.padded_len, self.padded_len + steps))

    def advance(self, counts: Sequence[int]) -> None:
        """Each row has written counts[b] more decode columns, from its own next column."""
        steps = [s + n for s, n in zip(self.row_steps, counts, strict=True)]
        self._set_steps(steps)

    def trim(self, drops: Sequence[int]) -> None:
        """Each row gives back its last drops[b] decode columns (rejected drafts): they are
        masked from now on and rewritten by its next steps, not copied out."""
        steps = self.row_steps
        if any(not 0 <= d <= s for d, s in zip(drops, steps, strict=True)):
            raise ValueError(f"cannot drop {list(drops)} of decode columns {steps}")
        if self.states and any(drops):
            self._restore_states(drops)
        self._set_steps([s - d for s, d in zip(steps, drops, strict=True)])

    def _restore_states(self, drops: Sequence[int]) -> None:
        """Each row's fixed-size states back to what they were after the tokens it keeps (the
        states cannot be cut as KV is: `history` kept them after each token of the steps
        since the last trim)."""
        steps = self.history or []
        for row, drop in enumerate(drops):
            if not drop:
                continue
            left = drop
            for counts, layers in reversed(steps):  # the last step first
                if left <= counts[row]:
                    # (kept[n]: the states after n of that step's tokens)
                    for states, kept in zip(self.states, layers, strict=True):
                        for t, old in zip(states, kept[counts[row] - left], strict=True):
                            t[row] = old[row]
                    break
                left -= counts[row]
            else:
                raise ValueError(
                    f"row {row} cannot drop {drop} tokens: its fixed-size states are kept for "
                    f"{drop - left} (the steps since a verify step or a trim)"
                )
        self.history = None

    def keep_states(self, counts: Sequence[int], layer: int, kept: list[States]) -> None:
        """Keeps fixed-size-state layer `layer`'s states after 0, 1, ... of this step's
        tokens (counts[b] per row), for `trim`; the first layer of a step opens its entry."""
        if self.history is None:
            self.history = []
        if layer == 0:
            self.history.append((list(counts), []))
        self.history[-1][1].append(kept)

    def _set_steps(self, steps: Sequence[int]) -> None:
        self.steps = max(steps, default=0)
        lags = [self.steps - s for s in steps]
        self.lags = lags if any(lags) else None

    def ensure_headroom(self, columns: int = 1) -> None:
        """Grows every layer's buffer so `columns` more decode steps fit (amortised doubling)."""
        need = self.used + columns
        if need <= self.capacity:
            return
        new_cap = max(need, self.capacity + max(DEFAULT_HEADROOM, self.capacity // 2))
        for cache in (self.keys, self.values):
            for i, t in enumerate(cache):
                grown = t.new_empty(t.shape[0], t.shape[1], new_cap, t.shape[3])
                grown[:, :, : self.used] = t[:, :, : self.used]
                grown[:, :, self.used :].zero_()  # (see the module's docstring)
                cache[i] = grown

    def take_rows(self, rows: Sequence[int]) -> KvGroup:
        """A group of these rows only, in this order, laid out as they are (one copy of each)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.keys[0].device)
        cap = min(self.capacity, self.used + DEFAULT_HEADROOM)
        group = KvGroup(
            keys=[t[:, :, :cap].index_select(0, index) for t in self.keys],
            values=[t[:, :, :cap].index_select(0, index) for t in self.values],
            prefix_lens=[self.prefix_lens[r] for r in rows],
            padded_len=self.padded_len,
            steps=self.steps,
            states=[tuple(t.index_select(0, index) for t in st) for st in self.states],
        )
        if self.lags is not None:
            group._set_steps([self.row_steps[r] for r in rows])
        return group


@dataclass(frozen=True)
class BatchRow:
    """A row of a live batch released by extraction, not copied out yet: a snapshot in all but
    storage. `assemble_batch` keeps its group when it can and copies it once when it cannot,
    rather than out and back in; `materialize` gives it storage of its own (which releases the
    old buffers once no row refers to them). Valid until the group decodes again."""

    group: KvGroup
    row: int
    token_ids: list[int]

    @property
    def length(self) -> int:
        return self.group.row_lengths[self.row]

    @property
    def num_layers(self) -> int:
        return len(self.group.keys)

    @property
    def nbytes(self) -> int:
        """What the row would take as a snapshot of its own."""
        per_column = sum(
            t.shape[1] * t.shape[3] * t.element_size()
            for t in (*self.group.keys, *self.group.values)
        )
        return per_column * self.length + states_nbytes(self.group.states) // max(
            1, self.group.batch_size
        )

    def layer(self, kind: Literal["keys", "values"], layer: int) -> torch.Tensor:
        return getattr(self.group, kind)[layer][self.row]

    def row_states(self, layer: int) -> States:
        """Its state tensors in fixed-size-state layer `layer`, [1, ...] each (views)."""
        return tuple(t[self.row : self.row + 1] for t in self.group.states[layer])

    def spans(self) -> tuple[tuple[int, int], ...]:
        return self.group.spans(self.row)

    def materialize(self) -> KvSnapshot:
        """A contiguous snapshot: the row's prefix, then its decode columns (gap dropped)."""

        def take(t: torch.Tensor) -> torch.Tensor:  # [B_g, KVH, cap, D] -> [1, KVH, P, D]
            parts = [t[self.row : self.row + 1, :, lo:hi] for lo, hi in self.spans()]
            if len(parts) > 1:
                return torch.cat(parts, dim=2)
            return parts[0].clone(memory_format=torch.contiguous_format)

        return KvSnapshot(
            keys=[take(k) for k in self.group.keys],
            values=[take(v) for v in self.group.values],
            token_ids=list(self.token_ids),
            states=[tuple(t.clone() for t in self.row_states(i)) for i in range(self.num_states)],
        )

    @property
    def num_states(self) -> int:
        return len(self.group.states)


KvSource = KvSnapshot | BatchRow


@dataclass
class KvBatch:
    """The live batch's KV: B sequences decoding in lockstep, held as one or more KvGroups
    whose rows, in order, are the batch's rows (which sequences these are is the engine's
    plan: engine/live_batch.py). A decode step runs each weight once over all B rows;
    attention runs per group, so a long sequence entering the batch pads only its own group,
    and a rebatch copies only the groups whose rows changed."""

    groups: list[KvGroup]
    token_ids: list[list[int]]

    @property
    def batch_size(self) -> int:
        return sum(g.batch_size for g in self.groups)

    @property
    def row_lengths(self) -> list[int]:
        return [n for g in self.groups for n in g.row_lengths]

    @property
    def padding_columns(self) -> int:
        return sum(g.padding_columns for g in self.groups)

    @property
    def padded_len(self) -> int:
        """The longest padded snapshot of any group."""
        return max(g.padded_len for g in self.groups)

    @property
    def kv_columns(self) -> int:
        """KV columns a step attends over, padding included, summed over the rows."""
        return sum(g.used * g.batch_size for g in self.groups)

    def locate(self, row: int) -> tuple[KvGroup, int]:
        """The group holding batch row `row`, and the row's index in it."""
        if not 0 <= row < self.batch_size:
            raise IndexError(f"row {row} of a batch of {self.batch_size}")
        for group in self.groups:
            if row < group.batch_size:
                return group, row
            row -= group.batch_size
        raise AssertionError("unreachable")

    def row(self, row: int) -> BatchRow:
        """Batch row `row` as a snapshot source, not copied (see BatchRow)."""
        group, index = self.locate(row)
        return BatchRow(group, index, self.token_ids[row])

    def trim(self, drops: Sequence[int]) -> None:
        """Row b drops its last drops[b] tokens' KV (drafts a verify step rejected)."""
        if len(drops) != self.batch_size:
            raise ValueError(f"{len(drops)} drops for a batch of {self.batch_size}")
        at = 0
        for group in self.groups:
            part = drops[at : at + group.batch_size]
            at += group.batch_size
            if any(part):
                group.trim(part)
        for row, drop in zip(self.token_ids, drops, strict=True):
            if drop:
                del row[len(row) - drop :]


def assemble_batch(
    sources: Sequence[KvSource],
    headroom: int = DEFAULT_HEADROOM,
    max_groups: int = DEFAULT_MAX_GROUPS,
) -> KvBatch:
    """The live batch of these sources, in this order.

    Rows of a previous batch (BatchRow) keep their group: a group whose rows all come back, in
    order, is reused as it is; one that lost rows is narrowed to the others (`take_rows`), its
    layout unchanged. New snapshots given one after another form a new group, right-padded to
    the longest of them. While there are more than `max_groups` groups, the two neighbours
    whose merge pads the least are assembled into one."""
    if not sources:
        raise ValueError("cannot assemble an empty batch")
    runs: list[list[KvSource]] = []
    for src in sources:
        last = runs[-1][-1] if runs else None
        if isinstance(src, BatchRow):
            joins = isinstance(last, BatchRow) and src.group is last.group and src.row > last.row
        else:
            joins = isinstance(last, KvSnapshot)
        if joins:
            runs[-1].append(src)
        else:
            runs.append([src])
    groups = [_group_of(run, headroom) for run in runs]
    while len(groups) > max(1, max_groups):
        i = min(range(len(groups) - 1), key=lambda j: _merged_padding(groups[j], groups[j + 1]))
        rows = [BatchRow(g, r, []) for g in groups[i : i + 2] for r in range(g.batch_size)]
        groups[i : i + 2] = [_assemble_group(rows, headroom)]
    return KvBatch(groups=groups, token_ids=[list(s.token_ids) for s in sources])


def _group_of(run: Sequence[KvSource], headroom: int) -> KvGroup:
    first = run[0]
    if isinstance(first, KvSnapshot) and len(run) == 1 and first.capacity > first.length:
        # a snapshot with room of its own becomes its group as it is: no copy (a long prompt
        # entering the batch costs the decoding rows nothing but its attention)
        assert first.buffers is not None
        keys, values = first.buffers
        return KvGroup(
            keys=list(keys),
            values=list(values),
            prefix_lens=[first.length],
            padded_len=first.length,
            # the batch advances its states in place: a copy, the snapshot's own stay as they are
            states=[tuple(t.clone() for t in st) for st in first.states],
        )
    if not isinstance(first, BatchRow):
        return _assemble_group(run, headroom)
    rows = [src.row for src in run if isinstance(src, BatchRow)]
    if rows == list(range(first.group.batch_size)):
        return first.group  # every row, in order: the group goes on as it is
    return first.group.take_rows(rows)


def _merged_padding(a: KvGroup, b: KvGroup) -> int:
    """Padding columns of one group holding a's and b's rows, assembled afresh."""
    lengths = a.row_lengths + b.row_lengths
    return max(lengths) * len(lengths) - sum(lengths)


def _assemble_group(sources: Sequence[KvSource], headroom: int) -> KvGroup:
    """Right-pads each source to the longest and stacks them on dim 0. Every column a source
    holds is copied once; the padding gaps and the headroom are zeroed."""
    prefix_lens = [s.length for s in sources]
    padded_len = max(prefix_lens)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    kinds: tuple[tuple[list[torch.Tensor], Literal["keys", "values"]], ...] = (
        (keys, "keys"),
        (values, "values"),
    )
    for layer in range(sources[0].num_layers):
        for dst, kind in kinds:
            first = sources[0].layer(kind, layer)  # [KVH, columns, D]
            out = first.new_empty(
                len(sources), first.shape[0], padded_len + headroom, first.shape[2]
            )
            for b, src in enumerate(sources):
                t, at = src.layer(kind, layer), 0
                for lo, hi in src.spans():
                    out[b, :, at : at + hi - lo] = t[:, lo:hi]
                    at += hi - lo
                if at < padded_len:
                    out[b, :, at:padded_len].zero_()
            out[:, :, padded_len:].zero_()
            dst.append(out)
    states = [
        tuple(torch.cat(parts) for parts in zip(*(s.row_states(i) for s in sources), strict=True))
        for i in range(sources[0].num_states)
    ]
    return KvGroup(
        keys=keys, values=values, prefix_lens=prefix_lens, padded_len=padded_len, states=states
    )


def states_nbytes(states: Sequence[States]) -> int:
    """The bytes of fixed-size-state layers' tensors."""
    return sum(t.numel() * t.element_size() for st in states for t in st)


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
