"""A request's life in the engine, from admission to its end: the queues, deadlines,
cancellation, the tokens it is given, how it ends and what its router is told.

Pure: no torch, no anyio. The requests themselves are in the scheduler's RequestTable; this
moves them through it as their lives go. What the routers are to be told, and the housekeeping
jobs an end leaves (snapshots to drop, sessions to save), queue here in order; the scheduler
hands them out with its plans and its answers, never as a list another part holds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from neuronpy.engine.admission import check_prompt
from neuronpy.engine.costs import ema
from neuronpy.engine.plans import DropCached, DropSnapshots, Op, Sampled, SaveSession
from neuronpy.engine.request import (
    Cause,
    Ending,
    Finish,
    Request,
    RequestStatus,
    RouterMessage,
)
from neuronpy.engine.speculative import Speculation, SpeculativeConfig
from neuronpy.engine.table import RequestTable
from neuronpy.engine.types import SamplingParams, SessionRequest, TokenLogprob
from neuronpy.errors import QueueFullError

# the most Retry-After says: past it a client is better off with its own backoff (and a row
# whose max_tokens is the whole context, before any reply has been measured, is no estimate)
MAX_RETRY_AFTER = 60.0

# what the routers are told, in order: (request, a token or its Finish)
Messages = tuple[tuple[Request, RouterMessage], ...]


class Lifecycle:
    """Every change of a request's life but the scheduling ones, over the scheduler's table:
    admission, queue deadlines, cancellation, accepted tokens, the end and its message."""

    def __init__(
        self,
        table: RequestTable,
        *,
        name: str,
        max_running: int,
        max_queue: int,
        queue_timeout: float,
        context_len: int,
        vocab_size: int,
        kv_budget_tokens: int = 0,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        """`queue_timeout` 0: no deadline; `kv_budget_tokens` 0: no budget."""
        self.name = name
        self.max_running = max_running
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.kv_budget_tokens = kv_budget_tokens
        self.speculative = speculative or SpeculativeConfig()
        self.table = table
        self.counters = table.counters
        self._messages: list[tuple[Request, RouterMessage]] = []  # to the routers, in order
        self._ops: list[Op] = []  # housekeeping jobs, for the next plan to run first
        self._request_seconds = 0.0  # moving average of a request's time, for Retry-After
        self._output_tokens = 0.0  # moving average of a finished request's tokens (the same)
        self.ended = 0  # requests finished, or gone to write their session

    # ---- what is queued for others ------------------------------------------------------------

    def take_messages(self) -> Messages:
        """What the routers are to be told since this was last asked, in order."""
        messages, self._messages = tuple(self._messages), []
        return messages

    def take_ops(self) -> tuple[Op, ...]:
        """The housekeeping jobs queued since this was last asked, in order."""
        ops, self._ops = tuple(self._ops), []
        return ops

    def queue(self, op: Op) -> None:
        self._ops.append(op)

    @property
    def has_ops(self) -> bool:
        return bool(self._ops)

    # ---- admission ----------------------------------------------------------------------------

    def rows(self) -> list[dict[str, object]]:
        """Each admitted request as the batch view shows it: its id, state (queued,
        prefilling, decoding, preempted), prompt tokens, tokens so far and max_tokens."""
        out: list[dict[str, object]] = []
        for r in self.table.active():
            if r.status is RequestStatus.WAITING:
                state = "preempted" if r.preemptions else "queued"
            elif r.status is RequestStatus.PREFILLING:
                state = "prefilling"
            else:
                state = "decoding"
            out.append(
                {
                    "id": r.id,
                    "label": r.label,
                    "state": state,
                    "prompt_tokens": len(r.prompt_ids),
                    "output_tokens": len(r.output_ids),
                    "max_tokens": r.params.max_tokens,
                }
            )
        return out

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> tuple[int, ...]:
        """The prompt as a tuple, or InvalidRequestError naming what does not fit the model."""
        return check_prompt(
            prompt_ids,
            params,
            name=self.name,
            context_len=self.context_len,
            vocab_size=self.vocab_size,
            kv_budget_tokens=self.kv_budget_tokens,
        )

    def admit(
        self,
        prompt: tuple[int, ...],
        copies: Sequence[SamplingParams],
        stop_ids: frozenset[int],
        session: SessionRequest | None = None,
        now: float | None = None,
        labels: Sequence[str | None] = (),
    ) -> list[Request]:
        """Queues one request per entry of `copies` (a validated prompt's n completions), or
        raises QueueFullError when they do not fit in max_in_flight + max_queue. `labels`: what
        each copy is called (none: empty)."""
        if labels and len(labels) != len(copies):
            raise ValueError(f"{len(labels)} labels for {len(copies)} copies")
        n = len(copies)
        if len(self.table.active()) + n > self.max_running + self.max_queue:
            self.counters.rejected += 1
            raise QueueFullError(
                f"model {self.name!r} is at capacity ({self.max_running} running, "
                f"{self.max_queue} queued); retry later",
                retry_after=self.retry_after(),
            )
        arrived = time.monotonic() if now is None else now
        group: list[Request] = []
        for index, params in enumerate(copies):
            rid = self.table.new_request_id()
            request = Request(rid, prompt, params, stop_ids, arrived, index, group, session)
            request.label = labels[index] if labels else None
            method = self.speculation_method(params)
            if method != "off":
                request.speculation = Speculation(self.speculative, method)
            group.append(request)
            self.table.add(request)
            self.counters.admitted += 1
            self.counters.prompt_tokens += len(prompt)
        return group

    def speculation_method(self, params: SamplingParams) -> str:
        """How a request speculates: as it asks, else as the model does ("off" when the model
        does not)."""
        return params.speculative or self.speculative.method

    def retry_after(self) -> float:
        """Seconds until a row is likely free for a request refused now: the running rows'
        remaining tokens (each at most what requests have been writing, on average) at the
        measured decode step time, then the queue ahead at the measured request time. From one
        second to MAX_RETRY_AFTER; one second when nothing has been measured yet."""
        c = self.counters
        if not c.decode_steps:
            return 1.0
        step = c.timing.get("forward", 0.0) / c.decode_steps
        typical = self._output_tokens or math.inf
        remaining = sorted(
            max(0.0, min(r.params.max_tokens, typical) - len(r.output_ids))
            for r in self.table.running
            if not r.done
        )
        ahead = len(self.table.waiting) + 1  # the refused request would wait behind the queue
        if ahead <= len(remaining):
            estimate = remaining[ahead - 1] * step
        else:
            last = remaining[-1] * step if remaining else 0.0
            per_request = self._request_seconds or last or 1.0
            estimate = last + math.ceil((ahead - len(remaining)) / self.max_running) * per_request
        return min(MAX_RETRY_AFTER, max(1.0, estimate))

    def cancel(self, request: Request) -> None:
        """The client went away: a running row leaves at the next rebatch, a queued one never
        runs. Counted now."""
        cancelled = request.ending is not None and request.ending.cause is Cause.CANCELLED
        if not request.status.finished and not cancelled:
            request.ending = Ending(Cause.CANCELLED)
            self.counters.cancelled += 1

    def leave(self, request: Request) -> None:
        """Its router has ended the stream and reported the end (a stop string matched, or its
        consumer went away): the row leaves at the next rebatch."""
        request.end(Cause.ROUTER_ENDED)

    def expired(self, now: float | None = None) -> tuple[Request, ...]:
        """The requests that waited past queue_timeout for a row: they end, never prefilled."""
        if not self.queue_timeout:
            return ()
        now = time.monotonic() if now is None else now
        # decided for every request at once: the copies of one request (n > 1) end together
        # or not at all
        return tuple(
            r
            for r in self.table.waiting
            if now - r.arrived_at > self.queue_timeout
            # cancelled: dropped at the next join; preempted, or a copy of a request that has
            # started: it waits behind its own request's rows, not for a first row
            and not r.done
            and not any(copy.started for copy in r.group)
        )

    def time_out(self, request: Request, now: float) -> None:
        """A request `expired` named ends (as it ended, if that was decided since)."""
        if not request.done:
            self.counters.timed_out += 1
            request.end(
                Cause.TIMED_OUT,
                f"the request waited {now - request.arrived_at:.1f} s for model {self.name!r} "
                f"without getting a row (queue_timeout {self.queue_timeout:g} s); retry later",
            )
        self.finish(request)

    # ---- tokens -------------------------------------------------------------------------------

    def accept(self, request: Request, sampled: Sampled) -> int:
        """Records a row's tokens (a verify step's several, else one) in order until one ends
        the request; answers how many it took."""
        if sampled.error is not None:
            request.end(Cause.FAILED, sampled.error, sampled.error_param)  # it alone leaves
        taken = 0
        for token, logprob in sampled.tokens:
            if request.done:
                break
            self._accept_one(request, token, logprob)
            taken += 1
        request.forced = () if request.done else sampled.forced
        return taken

    def _accept_one(self, request: Request, token: int, logprob: TokenLogprob | None) -> None:
        """Records a sampled token, hands it to the router, and decides EOS / length."""
        request.output_ids.append(token)
        request.next_token = token
        self.counters.generated_tokens += 1
        self._messages.append((request, token if logprob is None else logprob))
        if token in request.stop_ids:
            request.end(Cause.STOP)
        elif (
            len(request.output_ids) >= request.params.max_tokens
            or request.total_tokens >= self.context_len
        ):
            request.end(Cause.LENGTH)

    def kv_held(self) -> int:
        """Tokens of KV the running rows (those not leaving) and the joiners hold now, the
        running rows' draft KV included (in the model's tokens: Speculation.kv_held)."""
        running = sum(
            r.total_tokens + (r.speculation.kv_held() if r.speculation else 0)
            for r in self.table.running
            if not r.done
        )
        return running + sum(r.prefilled for r in self.table.prefilling)

    # ---- ending -------------------------------------------------------------------------------

    def end_before_joining(self, request: Request) -> None:
        """A request that ended before joining the live batch (its first token was EOS, it
        was cancelled) drops its snapshot, or saves it to its session, and finishes."""
        sid, request.snapshot_id = request.snapshot_id, None
        if sid is not None and self.saves_session(request):
            self.queue(self.save_op(request, sid, drop=True))
            self.saved(request)
            return
        if sid is not None:
            self.queue(DropSnapshots((sid,)))
        self.finish(request)

    def finish(self, request: Request, session_error: str | None = None) -> None:
        """Ends a request whose end is decided: its final message to the router, the counters.
        `session_error`: why its session could not be saved (the reply itself stands)."""
        if request.status.finished:
            return
        assert request.ending is not None
        if request.status is RequestStatus.WAITING and request.snapshot_id is not None:
            # a copy of an n > 1 request cloned while it waited, or a preempted one
            self.queue(DropSnapshots((request.snapshot_id,)))
            request.snapshot_id = None
        if request.restored is not None:  # a session read for a first chunk never planned
            self.queue(DropCached((request.restored[0],)))
            request.restored = None
        ending = request.ending
        cause, reason = ending.cause, ending.cause.reason
        self.table.move(request, RequestStatus.finished_with(reason))
        self.ended += 1
        self._messages.append((request, Finish(reason, ending.error, session_error, ending.param)))
        if cause is Cause.FAILED:
            self.counters.failed += 1
        elif cause not in (Cause.CANCELLED, Cause.TIMED_OUT):  # (counted when they happened)
            self.counters.finished += 1
            elapsed = time.monotonic() - request.arrived_at
            self._request_seconds = ema(self._request_seconds, elapsed)
            self._output_tokens = ema(self._output_tokens, len(request.output_ids))

    def end_all(self, cause: Cause, error: str | None = None) -> Messages:
        """Ends every admitted request now with `cause` (shutdown, drain, a fault), whatever
        was decided before but a cancellation; answers what the routers are to be told. Their
        rows and snapshots go with the next rebatch, or with the worker."""
        for request in self.table.active():
            if request.status.finished:
                continue
            if request.ending is None or request.ending.cause is not Cause.CANCELLED:
                request.ending = Ending(cause, error)
            self.finish(request)
        return self.take_messages()

    def saves_session(self, request: Request) -> bool:
        """Whether an ended request's KV goes to its session: it ended on its own and asked."""
        session, ending = request.session, request.ending
        return bool(session and session.save and ending and ending.cause.on_its_own)

    def save_op(self, request: Request, snapshot_id: int, *, drop: bool) -> SaveSession:
        """The job that writes the request's snapshot to its session file."""
        assert request.session is not None
        session = request.session
        return SaveSession(request.ref(), snapshot_id, session.save_path or session.path, drop)

    def saved(self, request: Request) -> None:
        """The request's session is being written (`save_op`): it ends once the file is on
        disk (record_saved)."""
        self.table.move(request, RequestStatus.SAVING)
        self.ended += 1

    def record_saved(self, request: Request, error: str | None = None) -> Messages:
        """Its session file is on disk, or could not be written: the request still ends as it
        ended (its reply is the user's), and says so; answers what the routers are to be told."""
        self.end_saved(request, error)
        return self.take_messages()

    def end_saved(self, request: Request, error: str | None = None) -> None:
        """As `record_saved`, within a record whose messages are taken once it is done."""
        if error is None:
            self.counters.sessions_saved += 1
        else:
            self.counters.session_save_failures += 1
        self.finish(request, session_error=error)
