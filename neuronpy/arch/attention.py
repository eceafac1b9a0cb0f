"""What a forward's tokens attend to, layer by layer: a prompt chunk its own causal span
(SequenceAttention), the rows of a lockstep group one column each (UniformStep) or rows that
lag, each its own count (RaggedStep), a decode step and the prompt chunks prefilled in the
same forward (StepAttention), whole sequences packed one after another that keep no KV
(PackedAttention: embeddings); and the snapshot a chunk's K/V make (snapshot_of).

The same objects run the layers whose state is fixed-size (`mix`, arch/mixer.py) over the
same spans of the forward's tokens: a group's rows step their own states, a chunk advances its
sequence's. The caches are indexed by a layer's place among the attention layers
(`model.kv_index`), the states by its place among the others (`model.state_index`)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from neuronpy.arch.config import ArchConfig
from neuronpy.arch.kv import KvGroup, KvSnapshot, States
from neuronpy.arch.mixer import Mixer

# what an attention call is: a decode or verify step's rows, one sequence's prompt chunk, or
# whole sequences packed one after another (see AttentionModel.sdpa)
AttentionForm = Literal["step", "chunk", "packed"]


class AttentionModel(Protocol):
    """What the attention objects below use of the model (arch/llama.py's LlamaModel): its
    config, each layer's place among the attention and the fixed-size-state layers, and its
    attention and mixer primitives. The model imports this module; this module names the
    model only through this protocol, so the two do not import each other."""

    config: ArchConfig
    kv_index: list[int]  # per layer: its place among the attention layers (-1: not one)
    state_index: list[int]  # per layer: its place among the fixed-size-state layers (-1: not one)

    def sdpa(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        banded: torch.Tensor | None = None,
        form: AttentionForm = "step",
    ) -> torch.Tensor:
        """Attention over grouped queries: q [B, KVH, Q, D], k and v [B, KVH, L, D] ->
        [B, KVH, Q, D]."""
        ...

    def group_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q [B, T, H, D] -> [B, KVH, G * T, D]."""
        ...

    def ungroup(self, out: torch.Tensor, t: int) -> torch.Tensor:
        """[B, KVH, G * T, D] -> [B * T, H * D]."""
        ...

    def mixer(self, layer: int) -> Mixer:
        """Layer `layer`'s fixed-size-state mixer."""
        ...

    def zero_states(self, layer: int, rows: int = 1) -> States:
        """A state before any token of mixer layer `layer`, for `rows` rows."""
        ...


class Attention(Protocol):
    """What one forward's tokens attend to in each layer (and where their K/V go)."""

    tokens: int  # the forward's tokens this attention covers

    def attend(
        self, model: AttentionModel, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q [N, H, D], k and v [N, KVH, D] (this layer's, every token's) -> [N, H * D]."""
        ...

    def mix(self, model: AttentionModel, layer: int, x: torch.Tensor) -> torch.Tensor:
        """A fixed-size-state layer over every token: x [N, hidden] (input-normed) ->
        [N, hidden], each span's states advanced in place."""
        ...


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens of one sequence entering the live batch, prefilled in the same forward as
    a decode step (forward_step): after `past` (None: from the start), into buffers of
    `reserve` columns, growing past's own buffers in place when `extend` (as
    LlamaModel.prefill)."""

    token_ids: Sequence[int]
    past: KvSnapshot | None = None
    reserve: int = 0
    extend: bool = False
    capture: int | None = None  # keep the fixed-size states after this many tokens too
    # the rows of the images whose media ids the tokens hold, by image number (see prefill)
    media: Mapping[int, torch.Tensor] | None = None


@dataclass(frozen=True)
class StepOutput:
    hidden: torch.Tensor  # [B, hidden], final-normed: the decode rows
    snapshots: tuple[KvSnapshot, ...] = ()  # per chunk: its sequence, past and chunk
    chunk_hidden: tuple[torch.Tensor, ...] = ()  # per chunk: [hidden], its last token, normed


def snapshot_of(
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    past: KvSnapshot | None,
    new: list[int],
    states: list[States] | None = None,
    checkpoint: tuple[int, list[States]] | None = None,
) -> KvSnapshot:
    """The snapshot of past's tokens then `new`, over buffers that may hold more columns, with
    the fixed-size states after them (and at `checkpoint`, when taken)."""
    token_ids = (list(past.token_ids) if past is not None else []) + new
    total = len(token_ids)
    states = states or []
    if keys[0].shape[2] == total:
        return KvSnapshot(
            keys=keys, values=values, token_ids=token_ids, states=states, checkpoint=checkpoint
        )
    # room left: views of the first `total` columns, the buffers kept beside them
    return KvSnapshot(
        keys=[k[:, :, :total] for k in keys],
        values=[v[:, :, :total] for v in values],
        token_ids=token_ids,
        buffers=(keys, values),
        states=states,
        checkpoint=checkpoint,
    )


def column_positions(group: KvGroup, columns: int) -> torch.Tensor:
    """[B_g, columns]: the position of the token in each row's KV column (a row's prefix
    columns are its first positions, its decode columns the ones after; what a padding gap
    column gets is never read, the padding mask hides it)."""
    col = torch.arange(columns, device=group.device)[None, :]
    decoded = group.prefix_lens_tensor()[:, None] + (col - group.padded_len)
    return torch.where(col < group.padded_len, col, decoded)


def window_decode_mask(group: KvGroup, positions: torch.Tensor, window: int) -> torch.Tensor:
    """The next step's mask in a sliding-window layer: [B_g, 1, 1, used + 1], the padding mask
    and, per row, only the columns less than `window` positions behind its query (at
    `positions` [B_g])."""
    near = column_positions(group, group.used + 1) > positions[:, None] - window
    padding = group.decode_mask()  # None: no row has a gap
    near = near[:, None, None, :]
    return near if padding is None else padding & near


@dataclass(frozen=True)
class UniformStep:
    """A group whose rows each feed one token into the same column (`used`)."""

    group: KvGroup
    first: int  # the group's first row among the forward's tokens
    mask: torch.Tensor | None
    positions: torch.Tensor  # [B_g]
    banded: torch.Tensor | None = None  # the sliding-window layers' mask (window_decode_mask)

    @property
    def tokens(self) -> int:
        return self.group.batch_size

    def advance(self) -> None:
        self.group.steps += 1

    def attend(
        self, model: AttentionModel, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """This group's rows' attention, [B_g, H * D]."""
        group, lo = self.group, self.first
        hi = lo + group.batch_size
        c = model.config
        slot = model.kv_index[layer]
        k_cache, v_cache, col = group.keys[slot], group.values[slot], group.used
        k_cache[:, :, col] = k[lo:hi]
        v_cache[:, :, col] = v[lo:hi]
        q_g = q[lo:hi].reshape(hi - lo, c.num_kv_heads, c.group_size, c.head_dim)
        out = model.sdpa(
            layer, q_g, k_cache[:, :, : col + 1], v_cache[:, :, : col + 1], self.mask, self.banded
        )  # [B_g, KVH, G, D]: one query per row and head
        return out.reshape(hi - lo, c.num_heads * c.value_dim)

    def mix(self, model: AttentionModel, layer: int, x: torch.Tensor) -> torch.Tensor:
        """This group's rows, one token each, through their own states: [B_g, hidden]."""
        group, lo = self.group, self.first
        index = model.state_index[layer]
        state = group.states[index]
        before = [tuple(t.clone() for t in state)] if group.record else []
        out = model.mixer(layer).step(x[lo : lo + group.batch_size], state)
        if group.record:  # (a draft model's: its drafts may be taken back, steps later)
            before.append(tuple(t.clone() for t in state))
            group.keep_states([1] * group.batch_size, index, before)
        return out


@dataclass(frozen=True)
class RaggedStep:
    """A group whose rows feed counts[b] tokens each (a verify step), or whose rows hold
    different numbers of decode columns (after one): row b's tokens go to its own next columns
    [base_b, base_b + counts[b]), each query seeing the row's prefix, its decode columns and
    the row's tokens before it. The rows are padded to T = max(counts) queries; a padding
    query repeats its row's last token, writes past the row's columns (never read: masked,
    and rewritten later) and its output is dropped."""

    group: KvGroup
    counts: list[int]
    take: torch.Tensor  # [B_g, T]: which of the forward's tokens each (row, query) is
    cols: torch.Tensor  # [B_g, T]: the KV column each (row, query) writes
    rows: torch.Tensor  # [B_g, 1]: the row index, for the writes
    keep: torch.Tensor  # [n_g]: the real queries of the [B_g * T] outputs, in order
    mask: torch.Tensor  # [B_g, 1, G * T, columns]
    columns: int  # KV columns attended
    positions: torch.Tensor  # [n_g]: the RoPE position of each token, in the forward's order
    first: int = 0  # the group's first token in the forward
    banded: torch.Tensor | None = None  # the sliding-window layers' mask, as `mask`

    @property
    def tokens(self) -> int:
        return sum(self.counts)

    def advance(self) -> None:
        self.group.advance(self.counts)

    @classmethod
    def plan(
        cls, model: AttentionModel, group: KvGroup, counts: Sequence[int], first: int
    ) -> RaggedStep:
        dev = group.device
        t = max(counts)
        base = [group.padded_len + s for s in group.row_steps]
        group.ensure_headroom(max(base) + t - group.used)
        columns = max(base) + t
        starts = list(itertools.accumulate(counts, initial=first))[:-1]
        j = torch.arange(t, device=dev)
        n = torch.tensor(counts, device=dev)
        take = torch.tensor(starts, device=dev)[:, None] + torch.minimum(j[None], n[:, None] - 1)
        base_t = torch.tensor(base, device=dev)
        cols = base_t[:, None] + j[None]  # [B_g, T]
        real = j[None] < n[:, None]  # [B_g, T]
        keep = torch.nonzero(real.reshape(-1)).squeeze(1)
        col = torch.arange(columns, device=dev)
        prefix = group.prefix_lens_tensor()
        valid = (col[None, None] < prefix[:, None, None]) | (
            (col[None, None] >= group.padded_len) & (col[None, None] <= cols[:, :, None])
        )  # [B_g, T, columns]
        g = model.config.group_size
        mask = valid.repeat(1, g, 1)[:, None]
        lens = torch.tensor(group.row_lengths, device=dev)
        query_pos = lens[:, None] + j[None]  # [B_g, T]
        banded = None
        window = model.config.sliding_window if model.config.windowed else None
        if window is not None:
            near = column_positions(group, columns)[:, None, :] > query_pos[:, :, None] - window
            banded = (valid & near).repeat(1, g, 1)[:, None]
        positions = query_pos[real]
        rows = torch.arange(group.batch_size, device=dev)[:, None]
        return cls(
            group, list(counts), take, cols, rows, keep, mask, columns, positions, first, banded
        )

    def attend(
        self, model: AttentionModel, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """This group's tokens' attention, [n_g, H * D] in the forward's order."""
        b, t = self.take.shape
        even = len(self.keep) == b * t
        if even:  # as many tokens in every row: they lie in order, [B_g, T] of them
            lo = self.first
            q_t, k_t, v_t = (x[lo : lo + b * t].unflatten(0, (b, t)) for x in (q, k, v))
        else:
            q_t, k_t, v_t = (x[self.take] for x in (q, k, v))  # [B_g, T, heads, D]
        slot = model.kv_index[layer]
        k_cache, v_cache = self.group.keys[slot], self.group.values[slot]
        k_cache[self.rows, :, self.cols] = k_t
        v_cache[self.rows, :, self.cols] = v_t
        out = model.sdpa(
            layer,
            model.group_queries(q_t),  # [B_g, KVH, G * T, D]
            k_cache[:, :, : self.columns],
            v_cache[:, :, : self.columns],
            self.mask,
            self.banded,
        )
        out = model.ungroup(out, t)  # [B_g * T, H * D]
        return out if even else out[self.keep]

    def mix(self, model: AttentionModel, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Each row's tokens one after another through its states, as decode steps would
        run them (a step's rows give each row's own bits): token j of every row that has one,
        in one step. The states after each j are kept (KvGroup.history) for `trim` to return a
        row to the token it keeps."""
        group, lo = self.group, self.first
        state = group.states[model.state_index[layer]]
        mixer = model.mixer(layer)
        out = x.new_empty(self.tokens, x.shape[1])
        kept = [tuple(t.clone() for t in state)]
        for j in range(self.take.shape[1]):
            rows = [b for b, n in enumerate(self.counts) if n > j]
            at = self.take[rows, j]
            if len(rows) == group.batch_size:
                out[at - lo] = mixer.step(x[at], state)
            else:
                index = torch.tensor(rows, device=x.device)
                part = tuple(t.index_select(0, index) for t in state)
                out[at - lo] = mixer.step(x[at], part)
                for t, p in zip(state, part, strict=True):
                    t.index_copy_(0, index, p)
            kept.append(tuple(t.clone() for t in state))
        group.keep_states(self.counts, model.state_index[layer], kept)
        return out


@dataclass(frozen=True)
class SequenceAttention:
    """One sequence's tokens at columns [start, total) of its own K/V buffers (a prompt's
    chunk, prefilled alone or in a decode step's forward): each token sees the columns up to
    its own."""

    keys: list[torch.Tensor]  # per layer [1, KVH, capacity, D]
    values: list[torch.Tensor]
    start: int
    total: int
    mask: torch.Tensor  # [G * T, total] (see LlamaModel._causal_mask)
    banded: torch.Tensor | None = None  # the sliding-window layers' mask, as `mask`
    # per fixed-size-state layer: the sequence's states, [1, ...] each, advanced in place
    states: list[States] = field(default_factory=list)
    # (a token count in (start, total), the states after it per layer, filled as layers run)
    capture: tuple[int, list[States]] | None = None

    @property
    def tokens(self) -> int:
        return self.total - self.start

    def mix(self, model: AttentionModel, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], the sequence's states advanced past the chunk (and
        copied at `capture` on the way: a call cut at a STATE_BLOCK multiple gives the same
        bits as one call)."""
        mixer = model.mixer(layer)
        state = self.states[model.state_index[layer]]
        if self.capture is None:
            return mixer.prefill(x, state, self.start)
        at, kept = self.capture
        cut = at - self.start
        head = mixer.prefill(x[:cut], state, self.start)
        kept.append(tuple(t.clone() for t in state))
        tail = mixer.prefill(x[cut:], state, at)
        return torch.cat((head, tail))

    def attend(
        self, model: AttentionModel, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q [T, H, D], k and v [T, KVH, D] -> [T, H * D]."""
        slot = model.kv_index[layer]
        k_cache, v_cache = self.keys[slot], self.values[slot]
        k_cache[0, :, self.start : self.total] = k.transpose(0, 1)
        v_cache[0, :, self.start : self.total] = v.transpose(0, 1)
        out = model.sdpa(
            layer,
            model.group_queries(q[None]),
            k_cache[:, :, : self.total],
            v_cache[:, :, : self.total],
            self.mask,
            self.banded,
            form="chunk",
        )
        return model.ungroup(out, self.tokens)


@dataclass(frozen=True)
class NoAttention:
    """Attention that reads and writes no cache (zeros out): what `compile` traces with."""

    tokens: int

    def attend(
        self, model: AttentionModel, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return q.new_zeros(q.shape[0], q.shape[1] * model.config.value_dim)

    def mix(self, model: AttentionModel, layer: int, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


@dataclass(frozen=True)
class StepAttention:
    """A decode (or verify) step's: each KV group's rows, then the tokens of each prompt
    chunk prefilled in the same forward."""

    steps: Sequence[GroupStep]
    chunks: Sequence[SequenceAttention]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in (*self.steps, *self.chunks))

    def attend(
        self, model: AttentionModel, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        outs = [s.attend(model, layer, q, k, v) for s in self.steps]
        at = sum(s.tokens for s in self.steps)
        for chunk in self.chunks:
            hi = at + chunk.tokens
            outs.append(chunk.attend(model, layer, q[at:hi], k[at:hi], v[at:hi]))
            at = hi
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def mix(self, model: AttentionModel, layer: int, x: torch.Tensor) -> torch.Tensor:
        outs = [s.mix(model, layer, x) for s in self.steps]
        at = sum(s.tokens for s in self.steps)
        for chunk in self.chunks:
            hi = at + chunk.tokens
            outs.append(chunk.mix(model, layer, x[at:hi]))
            at = hi
        return outs[0] if len(outs) == 1 else torch.cat(outs)


@dataclass(frozen=True)
class PackedAttention:
    """Whole sequences packed one after another, keeping no KV (a pooling forward): each
    token sees its own sequence's tokens up to itself. Sequences of one length lie side by
    side, and each such run is one batched attention call of that length (no padding)."""

    runs: Sequence[tuple[int, int]]  # (length, how many sequences of it), in packing order
    masks: dict[int, torch.Tensor]  # length -> causal mask [G * L, L] (LlamaModel._causal_mask)
    banded: dict[int, torch.Tensor]  # the sliding-window layers' masks, as `masks` (or none)

    @property
    def tokens(self) -> int:
        return sum(length * n for length, n in self.runs)

    def attend(
        self, model: AttentionModel, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q [T, H, D], k and v [T, KVH, D] -> [T, H * D]."""
        outs, at = [], 0
        for length, n in self.runs:
            hi = at + length * n
            qs = model.group_queries(q[at:hi].reshape(n, length, *q.shape[1:]))
            ks = k[at:hi].reshape(n, length, *k.shape[1:]).transpose(1, 2)
            vs = v[at:hi].reshape(n, length, *v.shape[1:]).transpose(1, 2)
            mask, banded = self.masks[length], self.banded.get(length)
            out = model.sdpa(layer, qs, ks, vs, mask, banded, form="packed")
            outs.append(model.ungroup(out, length))
            at = hi
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def mix(self, model: AttentionModel, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Each sequence from a zero state, one after another."""
        outs, at = [], 0
        for length, n in self.runs:
            for _ in range(n):
                state = model.zero_states(layer)
                outs.append(model.mixer(layer).prefill(x[at : at + length], state, 0))
                at += length
        return outs[0] if len(outs) == 1 else torch.cat(outs)


GroupStep = UniformStep | RaggedStep
