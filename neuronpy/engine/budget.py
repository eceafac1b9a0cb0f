"""Who gets a row, as pure functions: the rows that leave and the queued requests that take
the free ones (`plan_rows`), and within the KV budget who is preempted and who joins (`fit`),
oldest request first."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


@dataclass(frozen=True)
class RowView:
    """What `plan_rows` needs to know of a running row or a waiting request."""

    id: int
    done: bool = False


@dataclass(frozen=True)
class RowChanges:
    survivors: tuple[int, ...]  # running rows that stay, in their current order
    leaving: tuple[int, ...]  # running rows that leave (finished, stopped, cancelled)
    dropped: tuple[int, ...]  # waiting requests cancelled before they ran: never prefilled
    joining: tuple[int, ...]  # waiting requests to prefill and add, in arrival order


def plan_rows(
    running: Sequence[RowView],
    waiting: Sequence[RowView],
    max_running: int,
    prefilling: int = 0,
) -> RowChanges:
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
    return RowChanges(survivors, leaving, dropped, joining)


class Row(Protocol):
    @property
    def id(self) -> int: ...  # arrival order: a smaller id is an older request

    @property
    def kv_need(self) -> int: ...  # KV columns it needs through its next step


R = TypeVar("R", bound=Row)


def fit(live: Sequence[R], candidates: Sequence[R], budget: int) -> tuple[list[R], list[R]]:
    """(preempt, admit): keeps the rows' KV within `budget` tokens, oldest request first.

    While the `live` rows (running and prefilling) outgrow it, the newest of them is preempted;
    one row always runs, even alone over the budget. Then `candidates` (waiting, oldest first)
    join while they fit; one that does not fit preempts newer live rows if that makes room, or
    else waits, and so does everyone behind it (no overtaking)."""
    live = list(live)
    preempt: list[R] = []
    need = sum(r.kv_need for r in live)
    while need > budget and len(live) > 1:
        victim = max(live, key=lambda r: r.id)
        live.remove(victim)
        need -= victim.kv_need
        preempt.append(victim)
    admit: list[R] = []
    for row in candidates:
        want = row.kv_need
        if live and need + want > budget:
            victims, freed = [], 0
            for newer in sorted((r for r in live if r.id > row.id), key=lambda r: -r.id):
                if need - freed + want <= budget:
                    break
                victims.append(newer)
                freed += newer.kv_need
            if need - freed + want > budget:
                break
            for victim in victims:
                live.remove(victim)
                preempt.append(victim)
            need -= freed
        admit.append(row)
        live.append(row)
        need += want
    return preempt, admit
