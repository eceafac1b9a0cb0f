"""Batch planning as a pure function: who leaves the live batch, who joins it from the queue."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RowView:
    """What the planner needs to know of a running row or a waiting request."""

    id: int
    done: bool = False


@dataclass(frozen=True)
class StepPlan:
    survivors: tuple[int, ...]  # running rows that stay, in their current order
    leaving: tuple[int, ...]  # running rows that leave (finished, stopped, cancelled)
    dropped: tuple[int, ...]  # waiting requests cancelled before they ran: never prefilled
    joining: tuple[int, ...]  # waiting requests to prefill and add, in arrival order

    @property
    def rebatch(self) -> bool:
        """Whether the live batch changes shape (extract the survivors, assemble again)."""
        return bool(self.leaving or self.joining)


def plan_step(
    running: Sequence[RowView],
    waiting: Sequence[RowView],
    max_running: int,
    prefilling: int = 0,
) -> StepPlan:
    """Finished rows leave first, then the oldest waiting requests fill the free rows (FIFO).

    `prefilling` requests already hold a row each: they are joining over several steps.
    """
    if max_running < 1:
        raise ValueError("max_running must be at least 1")
    survivors = tuple(r.id for r in running if not r.done)
    leaving = tuple(r.id for r in running if r.done)
    dropped = tuple(w.id for w in waiting if w.done)
    free = max_running - len(survivors) - prefilling
    joining = tuple(w.id for w in waiting if not w.done)[: max(free, 0)]
    return StepPlan(survivors, leaving, dropped, joining)
