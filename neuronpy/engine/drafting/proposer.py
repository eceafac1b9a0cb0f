"""The proposer interface. What the scheduler asks of a drafter and what it answers (DraftRow,
Proposals, Proposal) are plain data in engine/plans.py, beside the plans that carry them.

A proposer drafts for the rows of one method and keeps what it needs of each row between
calls (prompt lookup: its n-gram index; a draft model: its KV), so each call carries only what
is new of a row since its last: the scheduler, which knows how many drafts the target
accepted, says how much of what the proposer holds to give back (`rollback`) and what to add.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from neuronpy.engine.plans import DraftRow, Proposal


class Proposer(Protocol):
    """Drafts for the rows of one method (see the module's docstring)."""

    async def propose(self, rows: Sequence[DraftRow]) -> Proposal: ...

    async def release(self, keys: Sequence[int]) -> None:
        """What it holds of these rows goes: they left the batch, ended or were preempted."""
        ...
