"""Who gets a row, without a model: who leaves, who joins, in which order."""

from __future__ import annotations

import pytest

from neuronpy.engine.budget import RowView, plan_rows


def rows(*spec: tuple[int, bool]) -> list[RowView]:
    return [RowView(i, done) for i, done in spec]


def test_finished_rows_leave_and_oldest_waiting_fill_free_rows() -> None:
    plan = plan_rows(rows((1, False), (2, True), (3, False)), rows((4, False), (5, False)), 3)
    assert plan.survivors == (1, 3) and plan.leaving == (2,)
    assert plan.joining == (4,) and plan.leaving


def test_cancelled_waiting_requests_are_dropped_not_joined() -> None:
    plan = plan_rows([], rows((7, True), (8, False), (9, False)), 1)
    assert plan.dropped == (7,) and plan.joining == (8,)


def test_steady_batch_needs_no_rebatch() -> None:
    plan = plan_rows(rows((1, False), (2, False)), rows((3, False)), 2)
    assert not plan.leaving and plan.joining == ()


def test_rows_still_prefilling_count_against_max_running() -> None:
    plan = plan_rows(rows((1, False)), rows((2, False), (3, False)), 3, prefilling=1)
    assert plan.joining == (2,)
    plan = plan_rows(rows((1, False)), rows((2, True), (3, False)), 2, prefilling=1)
    assert plan.joining == () and plan.dropped == (2,)


def test_max_running_is_validated() -> None:
    with pytest.raises(ValueError):
        plan_rows([], [], 0)
