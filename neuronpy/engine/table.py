"""The request table: every admitted request by status, the ids the engine hands out, and its
counters. `RequestTable.move` is the only code that changes a request's status.

Pure: no torch, no anyio. The scheduler owns the table; the planners (the live batch's, the
prefills', drafting's) read it and return plans, and the scheduler moves requests as those
plans and the device's answers to them say.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable

from neuronpy.engine.counters import Counters
from neuronpy.engine.request import Request, RequestStatus

W, P, R, S = (
    RequestStatus.WAITING,
    RequestStatus.PREFILLING,
    RequestStatus.RUNNING,
    RequestStatus.SAVING,
)
# the moves a request may make (and to any finished status from any live one)
ALLOWED: dict[RequestStatus, frozenset[RequestStatus]] = {
    W: frozenset({P}),
    P: frozenset({W, R, S}),  # preempted; joins the live batch; ends and saves its session
    R: frozenset({W, S}),  # preempted; ends and saves its session
    S: frozenset(),
}


class MoveError(AssertionError):
    """A move the request's status does not allow: a bug of the scheduler."""


class RequestTable:
    """The admitted requests by status, each in exactly one place:

    - waiting: in arrival order (a preempted request goes back before every newer one);
    - prefilling: holds a row; its prompt is being prefilled;
    - running: a row of the live batch, in row order;
    - saving: ended; its KV is being written to its session file.

    A finished request is in none of them but for a row of the live batch: that stays a row
    until the rebatch that takes it out of the batch (`drop_rows`). Readers get tuples: a plan
    keeps what it read."""

    def __init__(self) -> None:
        self.counters = Counters()
        self._waiting: deque[Request] = deque()
        self._prefilling: list[Request] = []
        self._running: list[Request] = []
        self._saving: list[Request] = []
        self._request_ids = itertools.count()
        self._kv_ids = itertools.count()  # snapshots, cache entries, clones, sessions read

    # ---- ids ----------------------------------------------------------------------------------

    def new_request_id(self) -> int:
        return next(self._request_ids)

    def new_kv_id(self) -> int:
        """An id for a snapshot, a prefix-cache entry, a copy's snapshot or a session read."""
        return next(self._kv_ids)

    # ---- reading ------------------------------------------------------------------------------

    @property
    def waiting(self) -> tuple[Request, ...]:
        return tuple(self._waiting)

    @property
    def prefilling(self) -> tuple[Request, ...]:
        return tuple(self._prefilling)

    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._running)

    @property
    def saving(self) -> tuple[Request, ...]:
        return tuple(self._saving)

    def active(self) -> tuple[Request, ...]:
        """Every request admitted and not yet ended (saving ones aside), and the rows of the
        live batch that ended and leave at the next rebatch."""
        return (*self._running, *self._prefilling, *self._waiting)

    @property
    def idle(self) -> bool:
        return not (self._waiting or self._prefilling or self._running or self._saving)

    # ---- changing -----------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """An admitted request, at the end of the queue."""
        if request.status is not W or request in self._waiting:
            raise MoveError(f"request {request.id} is admitted twice")
        self._waiting.append(request)

    def move(self, request: Request, to: RequestStatus) -> None:
        """Moves the request to status `to` (and to its place: the end of the running rows, or
        its arrival order among the waiting). A move its status does not allow raises
        MoveError, and changes nothing."""
        now = request.status
        if now.finished or not (to.finished or to in ALLOWED[now]):
            raise MoveError(f"request {request.id} cannot move from {now.name} to {to.name}")
        if not (now is R and to.finished):  # (an ended row stays a row: see drop_rows)
            self._list(now).remove(request)
        request.status = to
        if to is W:
            at = next((i for i, w in enumerate(self._waiting) if w.id > request.id), None)
            self._waiting.insert(len(self._waiting) if at is None else at, request)
        elif not to.finished:
            self._list(to).append(request)

    def add_row(self, request: Request) -> None:
        """A request that ended while the rebatch that makes it a row of the live batch ran:
        a row until the next rebatch, as any row that ends."""
        if not request.status.finished or request in self._running:
            raise MoveError(f"request {request.id} is not an ended request without a row")
        self._running.append(request)

    def drop_rows(self, requests: Iterable[Request]) -> None:
        """Rows that ended, taken out of the live batch by a rebatch."""
        for request in requests:
            if not request.status.finished:
                raise MoveError(f"request {request.id} leaves the live batch without ending")
            self._running.remove(request)

    def clear(self) -> None:
        """After a fault, once every active request has ended: the live batch is gone, and
        with it the rows of the requests that ended in it."""
        if self._waiting or self._prefilling or any(not r.status.finished for r in self._running):
            raise MoveError("the table is cleared with requests still active")
        self._running.clear()

    def _list(self, status: RequestStatus) -> deque[Request] | list[Request]:
        return {W: self._waiting, P: self._prefilling, R: self._running, S: self._saving}[status]
