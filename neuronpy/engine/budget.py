"""The KV budget as a pure function: who is preempted and who joins, oldest request first."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar


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
