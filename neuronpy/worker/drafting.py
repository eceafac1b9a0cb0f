"""The draft model's side of speculative decoding: its own lockstep batch of the rows that
draft with it, kept between verify steps on the device worker's thread."""

from __future__ import annotations

import torch

from neuronpy.arch.kv import DEFAULT_HEADROOM, BatchRow, KvSource, LiveBatch, assemble_batch
from neuronpy.arch.llama import LlamaModel
from neuronpy.worker.jobs import DraftResult, DraftTokens

# a row whose draft KV lags its context by more than this many tokens is prefilled again
# (a long prompt-length catch-up would make every row's first draft step that long)
MAX_CATCH_UP = 32


class DraftBatch:
    """The draft model and its live batch: one row per key (request) that drafts with it."""

    def __init__(self, model: LlamaModel, prefill_chunk: int) -> None:
        self.model = model
        self.prefill_chunk = prefill_chunk
        self.batch: LiveBatch | None = None
        self.keys: list[int] = []

    @property
    def rows(self) -> int:
        return len(self.keys)

    def draft(self, job: DraftTokens) -> DraftResult:
        if not len(job.keys) == len(job.contexts) == len(job.lengths):
            raise ValueError("DraftTokens needs a context and a length per key")
        if any(len(c) < 2 for c in job.contexts):
            raise ValueError("a draft context holds the prompt and at least one output token")
        if not job.keys:  # nothing drafts now: the draft KV goes
            self.batch, self.keys = None, []
            return DraftResult(())
        model = self.model
        sources, feeds = self._rebuild(job)
        fresh = any(not isinstance(s, BatchRow) for s in sources)  # a row prefilled anew
        if fresh or list(job.keys) != self.keys or self.batch is None:
            self.batch = assemble_batch(sources)
            self.keys = list(job.keys)
        counts = [len(f) for f in feeds]
        flat = torch.tensor([t for f in feeds for t in f], dtype=torch.long, device=model.device)
        hidden = model.forward_step(self.batch, flat, counts=counts).hidden
        lasts = torch.tensor(counts, device=model.device).cumsum(0) - 1
        steps = max(job.lengths, default=0)
        drafts: list[list[int]] = [[] for _ in job.keys]
        for step in range(steps):
            logits = model.logits(hidden[lasts] if step == 0 else hidden).to("cpu")
            tokens = (
                logits.argmax(dim=-1).tolist()
                if job.sample is None
                else [int(t) for t in job.sample(logits, step)]
            )
            for row, token in zip(drafts, tokens, strict=True):
                row.append(token)
            if step + 1 < steps:
                fed = torch.tensor(tokens, dtype=torch.long, device=model.device)[:, None]
                hidden = model.forward_batch_decode(self.batch, fed)
        out = tuple(tuple(d[:n]) for d, n in zip(drafts, job.lengths, strict=True))
        return DraftResult(out)

    def _rebuild(self, job: DraftTokens) -> tuple[list[KvSource], list[list[int]]]:
        """Each row's KV source (its row of the last batch, rolled back to what agrees with its
        context; or a new prefill of the context) and the tokens it feeds next."""
        batch = self.batch
        where = {key: i for i, key in enumerate(self.keys)}
        plans: list[tuple[int, int] | None] = []  # (old row, tokens kept) or None: prefill
        drops = [0] * (batch.batch_size if batch is not None else 0)
        for key, context in zip(job.keys, job.contexts, strict=True):
            old = where.get(key)
            if batch is None or old is None:
                plans.append(None)
                continue
            have = batch.token_ids[old]
            keep = min(_common_prefix(have, context), len(context) - 1)
            group, index = batch.locate(old)
            own = group.row_steps[index]
            if len(have) - keep > own or len(context) - keep > MAX_CATCH_UP:
                plans.append(None)  # (what disagrees reaches into its prompt: start again)
                continue
            drops[old] = len(have) - keep
            plans.append((old, keep))
        if batch is not None and any(drops):
            batch.trim(drops)
        sources: list[KvSource] = []
        feeds: list[list[int]] = []
        for plan, context in zip(plans, job.contexts, strict=True):
            if plan is None:
                snapshot, _ = self.model.prefill(
                    context[:-1],
                    chunk_size=self.prefill_chunk,
                    reserve=len(context) + DEFAULT_HEADROOM,
                )
                sources.append(snapshot)
                feeds.append([context[-1]])
            else:
                old, keep = plan
                assert batch is not None
                sources.append(batch.row(old))
                feeds.append(list(context[keep:]))
        return sources, feeds


def _common_prefix(a: list[int], b: tuple[int, ...]) -> int:
    """How many leading tokens a and b share (a's tokens agree with b's but for the last few,
    usually: those are compared one by one)."""
    n = min(len(a), len(b))
    start = max(0, n - 64)
    if a[:start] != list(b[:start]):
        start = 0
    for i in range(start, n):
        if a[i] != b[i]:
            return i
    return n
