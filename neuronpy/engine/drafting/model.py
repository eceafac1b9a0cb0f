"""The draft model's Proposer: its drafts come from DraftTokens jobs on the device worker, where
it keeps its KV of each row (neuronpy/worker/drafting.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import torch

from neuronpy.engine.plans import DraftRow, Proposal
from neuronpy.engine.sampling import Sampler
from neuronpy.worker.jobs import DraftResult, DraftSampler, DraftTokens, Job, ReleaseDraftKv


class DraftModelProposer:
    """Drafts with the draft model, each row by its own sampler (see Sampler.draft)."""

    def __init__(self, call: Callable[[Job], Awaitable[Any]], samplers: Mapping[int, Sampler]):
        self._call = call  # runs a job on the device worker
        self._samplers = samplers  # by request id: the runner's

    async def propose(self, rows: Sequence[DraftRow]) -> Proposal:
        job = DraftTokens(
            tuple(r.key for r in rows),
            tuple(r.tokens for r in rows),
            tuple(r.rollback for r in rows),
            tuple(r.fresh for r in rows),
            tuple(r.length for r in rows),
            sample=self._sampling(rows),
        )
        result: DraftResult = await self._call(job)
        return Proposal(result.drafts, result.held)

    async def release(self, keys: Sequence[int]) -> None:
        await self._call(ReleaseDraftKv(tuple(keys)))

    def _sampling(self, rows: Sequence[DraftRow]) -> DraftSampler:
        """Draft tokens from the draft model's logits on the worker thread. A row's sampler
        draws only its own drafts: the steps the batch takes past its length (another row's
        longer drafts) take the argmax, so that its random numbers do not depend on the
        others."""
        samplers = [self._samplers.get(r.key) for r in rows]
        lengths = [r.length for r in rows]

        def sample(logits: torch.Tensor, step: int) -> list[int]:
            if step == 0:
                for s in samplers:
                    if s is not None:
                        s.end_verify()
            return [
                s.draft(logits[i]) if s is not None and step < k else int(torch.argmax(logits[i]))
                for i, (s, k) in enumerate(zip(samplers, lengths, strict=True))
            ]

        return sample
