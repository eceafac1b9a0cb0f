"""The one place drafts are made: each method's proposer drafts for the rows the plan says
draft, and the drafts are cut where nothing after them could be emitted."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from neuronpy.engine.drafting.proposer import Proposer
from neuronpy.engine.grammar import Matcher
from neuronpy.engine.plans import DecodePlan, Proposal, ReleaseDrafts, RowRef
from neuronpy.engine.speculative import cut_at_stop


@dataclass(frozen=True)
class Drafts:
    """A decode step's drafts: per row (empty: none), what each proposer answered (one per
    DecodePlan.proposals), and the seconds drafting took."""

    rows: tuple[tuple[int, ...], ...]
    proposed: tuple[Proposal, ...]
    seconds: float


class Drafter:
    """Asks the proposers, by method, for the drafts of a step's drafting rows (and lets them
    release what they hold of rows that went). A row's drafts end at its first stop token
    (nothing after one is emitted) and before the first its grammar refuses (constrained rows:
    no step verifies a token it could never emit)."""

    def __init__(
        self,
        proposers: Mapping[str, Proposer],
        matcher: Callable[[RowRef], Matcher | None],
    ) -> None:
        self.proposers = proposers
        self._matcher = matcher  # a request's grammar, when constrained and not done

    async def propose(self, plan: DecodePlan) -> Drafts:
        if not plan.proposals:
            return Drafts((), (), 0.0)
        began = time.perf_counter()
        rows: list[tuple[int, ...]] = [()] * len(plan.rows)
        answers = []
        for proposals in plan.proposals:
            answer = await self.proposers[proposals.method].propose(proposals.rows)
            answers.append(answer)
            for row, drafts in zip(proposals.rows, answer.drafts, strict=True):
                rows[row.row] = self._cut(plan.rows[row.row], drafts)
        drafted = tuple(rows) if any(rows) else ()
        return Drafts(drafted, tuple(answers), time.perf_counter() - began)

    def _cut(self, request: RowRef, drafts: Sequence[int]) -> tuple[int, ...]:
        drafts = cut_at_stop(tuple(drafts), request.stop_ids)
        matcher = self._matcher(request) if drafts else None
        return drafts if matcher is None else drafts[: matcher.valid_prefix(drafts)]

    async def release(self, op: ReleaseDrafts) -> None:
        proposer = self.proposers.get(op.method)
        if proposer is not None:
            await proposer.release(op.keys)
