"""The draft model's Proposer: its drafts come from DraftTokens jobs on the device worker, where
it keeps its KV of each row (neuronpy/worker/drafting.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from neuronpy.engine.plans import DraftRow, Proposal
from neuronpy.engine.sampling import Sampler
from neuronpy.worker.jobs import DraftResult, DraftTokens, Job, ReleaseDraftKv


class DraftModelProposer:
    """Drafts with the draft model: a sampled row's drafts are drawn on the worker thread
    from the parameters and seed its sampler gives (Sampler.draft_sampling), and its sampler
    keeps the distributions they came from for the verify step."""

    def __init__(self, call: Callable[[Job], Awaitable[Any]], samplers: Mapping[int, Sampler]):
        self._call = call  # runs a job on the device worker
        self._samplers = samplers  # by request id: the runner's

    async def propose(self, rows: Sequence[DraftRow]) -> Proposal:
        samplers = [self._samplers.get(r.key) for r in rows]
        sampling = tuple(None if s is None else s.draft_sampling() for s in samplers)
        job = DraftTokens(
            tuple(r.key for r in rows),
            tuple(r.tokens for r in rows),
            tuple(r.rollback for r in rows),
            tuple(r.fresh for r in rows),
            tuple(r.length for r in rows),
            sampling=sampling if any(sampling) else (),
        )
        result: DraftResult = await self._call(job)
        for sampler, probs in zip(samplers, result.probs, strict=False):
            if sampler is not None and probs:
                sampler.drafted(probs)
        return Proposal(result.drafts, result.held)

    async def release(self, keys: Sequence[int]) -> None:
        await self._call(ReleaseDraftKv(tuple(keys)))
