"""The draft model's side of speculative decoding: its own lockstep batch of the rows that
draft with it, kept between verify steps on the device worker's thread."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from neuronpy.arch.kv import DEFAULT_HEADROOM, KvBatch, KvSource, assemble_batch
from neuronpy.arch.llama import LlamaModel
from neuronpy.errors import WorkerError
from neuronpy.worker.draw import distribution, draw, generator_of
from neuronpy.worker.jobs import DraftResult, DraftTokens


class DraftBatch:
    """The draft model and its live batch: one row per key (request) that drafts with it. What
    each row's KV holds, what it gives back and what it is fed are the engine's to say
    (DraftTokens); this only checks that the job fits what it holds."""

    def __init__(self, model: LlamaModel, prefill_chunk: int) -> None:
        self.model = model
        self.prefill_chunk = prefill_chunk
        self.batch: KvBatch | None = None
        self.keys: list[int | None] = []  # per row of `batch`: its key (None: released)

    @property
    def rows(self) -> int:
        """How many rows it holds."""
        return sum(key is not None for key in self.keys)

    def release(self, keys: Sequence[int]) -> None:
        """These rows' KV goes (the batch drops their columns at its next rebuild; with no row
        left, at once)."""
        gone = set(keys)
        self.keys = [None if key in gone else key for key in self.keys]
        if not self.rows:
            self.batch, self.keys = None, []

    def draft(self, job: DraftTokens) -> DraftResult:
        n = len(job.keys)
        if not n == len(job.tokens) == len(job.rollback) == len(job.fresh) == len(job.lengths):
            raise WorkerError("DraftTokens needs tokens, a rollback, fresh and a length per key")
        if job.sampling and len(job.sampling) != n:
            raise WorkerError("DraftTokens' sampling, when given, is one entry per key")
        held = {key: i for i, key in enumerate(self.keys) if key is not None}
        left_out = set(held) - set(job.keys)
        if left_out:
            raise WorkerError(f"a draft job leaves out rows the draft model holds: {left_out}")
        if not n:
            return DraftResult((), ())
        model = self.model
        sources, feeds = self._rebuild(job, held)
        fresh = any(key not in held or f for key, f in zip(job.keys, job.fresh, strict=True))
        if fresh or list(job.keys) != self.keys or self.batch is None:
            self.batch = assemble_batch(sources)
            self.keys = list(job.keys)
            for group in self.batch.groups:  # its drafts span steps: all may be taken back
                group.record = True
        counts = [len(f) for f in feeds]
        flat = torch.tensor([t for f in feeds for t in f], dtype=torch.long, device=model.device)
        hidden = model.forward_step(self.batch, flat, counts=counts).hidden
        lasts = torch.tensor(counts, device=model.device).cumsum(0) - 1
        steps = max(job.lengths)
        drafts: list[list[int]] = [[] for _ in job.keys]
        # the sampled rows: each its truncation and its own generator for this job
        sampled = [
            (b, how.truncation, generator_of(how.seed))
            for b, how in enumerate(job.sampling)
            if how is not None
        ]
        probs: list[list[torch.Tensor]] = [[] for _ in job.keys]
        for step in range(steps):
            logits = model.logits(hidden[lasts] if step == 0 else hidden).to("cpu")
            tokens = logits.argmax(dim=-1).tolist()
            for b, truncation, generator in sampled:
                if step < job.lengths[b]:
                    q = distribution(logits[b].to(torch.float32, copy=True), truncation)
                    probs[b].append(q)
                    tokens[b] = draw(q, generator)
            for row, token in zip(drafts, tokens, strict=True):
                row.append(token)
            if step + 1 < steps:
                fed = torch.tensor(tokens, dtype=torch.long, device=model.device)[:, None]
                hidden = model.forward_batch_decode(self.batch, fed)
        out = tuple(tuple(d[:k]) for d, k in zip(drafts, job.lengths, strict=True))
        held = tuple(len(t) for t in self.batch.token_ids)
        return DraftResult(out, held, tuple(tuple(p) for p in probs))

    def _rebuild(
        self, job: DraftTokens, held: dict[int, int]
    ) -> tuple[list[KvSource], list[list[int]]]:
        """Each row's KV source (its row of the last batch, its rejected drafts given back
        first; or a new prefill of its context) and the tokens it feeds next."""
        batch = self.batch
        if batch is not None:
            drops = [0] * batch.batch_size
            for key, back, fresh in zip(job.keys, job.rollback, job.fresh, strict=True):
                old = held.get(key)
                if old is None or fresh:
                    continue
                # (the drafts it fed itself are decode columns of the batch they were fed in,
                # this one: a rollback past them reaches into what it was built from)
                group, index = batch.locate(old)
                if back > group.row_steps[index]:
                    raise WorkerError(f"row {key}'s rollback of {back} reaches past its drafts")
                drops[old] = back
            if any(drops):
                batch.trim(drops)
            for group in batch.groups:  # (what a rollback could take back is now fed for good)
                group.history = None
        sources: list[KvSource] = []
        feeds: list[list[int]] = []
        for key, tokens, fresh in zip(job.keys, job.tokens, job.fresh, strict=True):
            old = held.get(key)
            if old is None or fresh:
                if len(tokens) < 2:
                    raise WorkerError("a new row's context holds its prompt and a token more")
                snapshot, _ = self.model.prefill(
                    tokens[:-1],
                    chunk_size=self.prefill_chunk,
                    reserve=len(tokens) + DEFAULT_HEADROOM,
                )
                sources.append(snapshot)
                feeds.append([tokens[-1]])
            else:
                if not tokens:
                    raise WorkerError(f"row {key} is fed nothing: its next token is new to it")
                assert batch is not None
                sources.append(batch.row(old))
                feeds.append(list(tokens))
        return sources, feeds
