"""The proposer interface: what the scheduler asks of a drafter and what it answers. Pure data.

A proposer drafts for the rows of one method and keeps what it needs of each row between
calls (prompt lookup: its n-gram index; a draft model: its KV), so each call carries only what
is new of a row since its last: the scheduler, which knows how many drafts the target
accepted, says how much of what the proposer holds to give back (`rollback`) and what to add.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class DraftRow:
    """One row's part in a proposal: up to `length` drafts to follow its context (its prompt
    and output so far; the last token is the one the target is fed next). The proposer first
    gives back the last `rollback` tokens it holds of the row (its own drafts that the target
    rejected), then takes `tokens`, the part of the context it lacks. `fresh`: it holds nothing
    of the row, or drops what it holds; `tokens` is then the whole context."""

    row: int  # the row's index in its decode step (DecodePlan.rows)
    key: int  # the request's id: what the proposer keeps the row's state under
    length: int
    tokens: tuple[int, ...]
    rollback: int = 0
    fresh: bool = False
    context: int = 0  # tokens of the row's context: what the proposer has of it after the call


@dataclass(frozen=True)
class Proposals:
    """The rows of one decode step that draft with one method, in row order."""

    method: str
    rows: tuple[DraftRow, ...]


@dataclass(frozen=True)
class Proposal:
    """A proposer's answer, per row of its Proposals: the drafts (at most its `length`), and
    the tokens it now holds of the row (its context, and any drafts it fed itself: those of
    them the target accepts it keeps, the rest the next call rolls back)."""

    drafts: tuple[tuple[int, ...], ...]
    held: tuple[int, ...]


class Proposer(Protocol):
    """Drafts for the rows of one method (see the module's docstring)."""

    async def propose(self, rows: Sequence[DraftRow]) -> Proposal: ...

    async def release(self, keys: Sequence[int]) -> None:
        """What it holds of these rows goes: they left the batch, ended or were preempted."""
        ...
