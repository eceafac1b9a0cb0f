"""The scheduler: every decision of the engine, as plain data in and plans out.

It never awaits and never touches a tensor. The engine's loop asks it for a plan
(`schedule`), the runner runs the whole plan on the device worker, and the loop hands the
outcome back (`update`), which answers what the routers are to be told. Nothing is shared
between the three but those frozen plans and outcomes.

A turn of the loop takes up to three kinds of plan, in this order, each planned whole once
the device's answer to the one before is booked:
1. LOAD: the session files the turn's first chunks start after (the tokens a file holds
   decide where its chunk starts);
2. PREFILL, while no row decodes: each joiner's whole prompt in a forward of its own, one
   plan each (the prompt after it may start from its KV in the prefix cache, and its first
   token decides whether it joins at all);
3. STEP: the rebatch (extract the survivors, assemble them with the joiners), then one decode
   step over the new batch with joiners' chunks riding it. The decode needs nothing the
   rebatch answers: its rows and their snapshots are known when it is planned.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque

from neuronpy.engine.budget import fit
from neuronpy.engine.costs import MIN_CHUNK, StepCosts
from neuronpy.engine.counters import EngineStats
from neuronpy.engine.lifecycle import Lifecycle, Messages
from neuronpy.engine.live_batch import LiveBatch
from neuronpy.engine.planner import RowView, plan_step
from neuronpy.engine.plans import (
    Offload,
    Phase,
    PrefillOutcome,
    PrefillPlan,
    StepOutcome,
    StepPlan,
)
from neuronpy.engine.prefill import Prefills
from neuronpy.engine.prefix_cache import PrefixIndex
from neuronpy.engine.request import Cause, Request, RequestStatus
from neuronpy.engine.speculative import SpeculativeConfig

log = logging.getLogger(__name__)

# what a request found unable to progress is told (the engine's log has the details)
STUCK = "the request could not make progress (an internal error of the server); retry it"


class Scheduler(Lifecycle):
    """Plans each turn (who joins and who is preempted within the KV budget, the prefills,
    the rebatch, the decode step) and books what the device answered; the requests' own
    lifecycle (admission, deadlines, cancellation, their end) is Lifecycle's."""

    def __init__(
        self,
        *,
        name: str,
        max_running: int,
        max_queue: int,
        queue_timeout: float,
        context_len: int,
        vocab_size: int,
        kv_budget_tokens: int = 0,
        prefix_cache_bytes: int = 0,
        chunk_steps: float = 0.5,
        prefill_chunk: int = 512,
        speculative: SpeculativeConfig | None = None,
        state_block: int = 0,
    ) -> None:
        """`queue_timeout` 0: no deadline; `kv_budget_tokens` 0: no budget;
        `prefix_cache_bytes` 0: no prefix cache; `state_block`: the model keeps fixed-size
        states, advanced in chunks cut at multiples of it (see Prefills; 0: KV alone)."""
        super().__init__(
            name=name,
            max_running=max_running,
            max_queue=max_queue,
            queue_timeout=queue_timeout,
            context_len=context_len,
            vocab_size=vocab_size,
            kv_budget_tokens=kv_budget_tokens,
            speculative=speculative,
        )
        self.costs = StepCosts(chunk_steps, prefill_chunk)
        self._kv_ids = itertools.count()  # snapshots, cache entries, clones, sessions read
        exact = bool(state_block)
        self.prefix = PrefixIndex(prefix_cache_bytes, exact=exact) if prefix_cache_bytes else None
        self.prefills = Prefills(
            self.prefix, self.counters, self.queue, self._kv_ids, self.finish, state_block
        )
        self.batch = LiveBatch(self, self.prefills, self.costs, self._kv_ids, self.book_prefill)
        self._preempting: list[Request] = []  # rows leaving the live batch at the next rebatch
        self._riding: list[Request] = []  # joiners whose next chunks ride this turn's step
        # this turn's joiners still to prefill whole, one plan each; None: no turn under way
        self._turn: deque[Request] | None = None
        # `moves` when this turn began (None: it began with nothing admitted, housekeeping
        # only; a request admitted since joins at the next turn)
        self._turn_moves: int | None = None
        self._loads = 0  # sessions read (a turn that reads one has moved on)

    @property
    def moves(self) -> int:
        """How often the scheduler has moved on: sessions read, chunks prefilled, rebatches,
        decode steps, requests ended. A turn of the engine's loop that leaves it unchanged
        ran nothing."""
        c = self.counters
        return self._loads + c.prefill_chunks + c.rebatches + c.decode_steps + self._ended

    @property
    def has_work(self) -> bool:
        """Whether a plan would do anything: requests are admitted, or housekeeping waits."""
        return bool(self.active()) or self.has_ops

    # ---- schedule -> run -> update -------------------------------------------------------------

    def schedule(self, now: float | None = None) -> StepPlan:
        """The next plan of the turn under way, or of a new turn (see the module's docstring)."""
        if self._turn is None:
            self._turn_moves = self.moves if self.active() else None
            self.expire(now)
            self._join()
            whole = self._to_prefill()
            self._turn = deque(whole)
            loads = tuple(
                load
                for request in (*whole, *self._riding)
                if (load := self.prefills.session_load(request)) is not None
            )
            if loads:
                return StepPlan(Phase.LOAD, self.take_ops(), loads=loads)
        while self._turn:
            prefill = self.prefills.plan(self._turn.popleft(), None)
            if prefill is not None:
                return StepPlan(Phase.PREFILL, self.take_ops(), prefill=prefill)
        self._turn = None
        rebatch = self.batch.plan_rebatch(self._preempted())
        for request, why in self.audit():
            log.error("%s: request %d is stuck (%s); it fails", self.name, request.id, why)
        rows = tuple(self.running) if rebatch is None else rebatch.order
        decode = self.batch.plan_decode(rows, self._rides()) if rows else None
        for release in self.batch.drafting.releases(rows):  # (rows gone: their drafts' state)
            self.queue(release)
        return StepPlan(Phase.STEP, self.take_ops(), rebatch=rebatch, decode=decode)

    def update(self, plan: StepPlan, outcome: StepOutcome) -> Messages:
        """Books what the device answered to `plan`; answers what the routers are to be told
        (everything since the last answer, in order)."""
        for load, loaded in zip(plan.loads, outcome.loads, strict=True):
            self._loads += 1
            self.prefills.book_session_load(load, loaded)
        if plan.prefill is not None:
            assert outcome.prefill is not None
            self.book_prefill(plan.prefill, outcome.prefill)
        if plan.rebatch is not None:
            assert outcome.rebatch is not None
            self.batch.book_rebatch(plan.rebatch, outcome.rebatch)
        if plan.decode is not None:
            assert outcome.decode is not None
            self.counters.timing["draft"] += outcome.draft_seconds
            self.batch.book_decode(plan.decode, outcome.decode)
        elif plan.phase is Phase.STEP and self.moves == self._turn_moves and self.active():
            # (a turn that began with requests admitted and ended without moving one on)
            stuck = self.stalled()
            log.error(
                "%s: a turn moved nothing on; %d requests fail: %s",
                self.name,
                len(stuck),
                {r.id: r.status.name.lower() for r in stuck},
            )
        return self.take_messages()

    # ---- joining: who gets a row, who is preempted --------------------------------------------

    def _join(self) -> None:
        """Requests ended while queued leave; the oldest waiting take the free rows (within the
        KV budget, preempting newer rows if that makes room); joiners that ended leave."""
        self._riding = []
        self.joining = [r for r in self.joining if not self.leave_if_done(r)]  # (rows freed)
        plan = plan_step(
            [RowView(r.id, r.done) for r in self.running],
            [RowView(r.id, r.done) for r in self.waiting],
            self.max_running,
            prefilling=len(self.joining),
        )
        by_id = {r.id: r for r in self.waiting}
        for rid in plan.dropped:
            request = by_id[rid]
            self.waiting.remove(request)
            self.finish(request)  # (a copy of an n > 1 request may have ended on its first token)
        joining = [by_id[rid] for rid in plan.joining]
        if self.kv_budget_tokens:
            live = [r for r in (*self.running, *self.joining) if not r.done]
            preempt, joining = fit(live, joining, self.kv_budget_tokens)
            for request in preempt:
                self._preempt(request)
        now = time.monotonic()
        for request in joining:
            self.waiting.remove(request)
            if request.scheduled_at is None:
                request.scheduled_at = now
            request.status = RequestStatus.PREFILLING
            self.joining.append(request)

    def _preempt(self, request: Request) -> None:
        """A row leaves the live batch at this rebatch, or a joiner its prefill; its snapshot
        waits, with its tokens and sampler, to resume where it stopped."""
        self.counters.preemptions += 1
        request.preemptions += 1
        if request in self.running:
            self._preempting.append(request)
            return
        self.joining.remove(request)
        self.prefills.forget(request)
        if request.snapshot_id is not None:
            self.queue(Offload((request.snapshot_id,)))
        self.requeue(request)

    def _preempted(self) -> list[Request]:
        """The rows preempted for this rebatch (those that have ended since just leave)."""
        preempted, self._preempting = self._preempting, []
        return [r for r in preempted if not r.done]

    def finish(self, request: Request, session_error: str | None = None) -> None:
        self.prefills.forget(request)  # (a session read for a first chunk never planned)
        super().finish(request, session_error)

    # ---- prefill ------------------------------------------------------------------------------

    def _to_prefill(self) -> list[Request]:
        """Joiners to prefill whole, each in a forward of its own: nobody waits on a decode
        step. While rows decode, the joiners' chunks ride the steps instead (`_riding`)."""
        todo = self._prefilling()
        if self.running:
            self._riding = todo
            return []
        return todo

    def _prefilling(self) -> list[Request]:
        """The joiners with prompt left to prefill, oldest first, but for copies (n > 1) that
        another copy's prefill fills: of a request's copies, one prefills (one that has
        started, else the first), and its last chunk gives the others its snapshot. Were two
        prefilled in one step, the second would count its prompt twice and never join."""
        todo = [r for r in self.joining if not r.done and r.prefilled < len(r.prompt_ids)]
        at = {r: i for i, r in enumerate(todo)}

        def filled_by_copy(request: Request) -> bool:
            if request.snapshot_id is not None:  # it has started: it goes on with its own
                return False
            return any(
                copy.snapshot_id is not None or at[copy] < at[request]
                for copy in request.group
                if copy is not request and copy in at
            )

        return [r for r in todo if not filled_by_copy(r)]

    def _rides(self) -> tuple[PrefillPlan, ...]:
        """The chunks riding this turn's decode step: the joiners', oldest first, within the
        step's budget of prompt tokens (`ride_budget`)."""
        rides = [r for r in self._riding if not r.done and r.prefilled < len(r.prompt_ids)]
        self._riding = []
        budget, chunks = self.ride_budget(len(rides)), []
        for ride in rides:
            if chunks and budget < MIN_CHUNK:
                break
            chunk = self.prefills.plan(ride, budget)
            if chunk is not None:
                chunks.append(chunk)
                budget -= len(chunk.tokens)
        return tuple(chunks)

    def ride_budget(self, joiners: int = 1) -> int:
        """Prompt tokens `joiners` riding chunks may add to the next step, together."""
        return self.costs.ride_budget(joiners)

    def book_prefill(self, plan: PrefillPlan, outcome: PrefillOutcome, alone: bool = True) -> None:
        """A chunk's result; after the last chunk, the first tokens of the request and its
        copies. `alone`: it ran in a forward of its own (its time then feeds the cost model),
        rather than riding a decode step."""
        if alone:
            self.costs.prefill.observe(len(plan.tokens), outcome.seconds)
            self.counters.timing["prefill"] += outcome.seconds
            self.counters.timing["sampling"] += outcome.sampling_seconds
        self.prefills.book(plan, outcome)
        for request, sampled in zip(plan.sampled, outcome.tokens, strict=True):
            self.accept(request, sampled)

    # ---- the invariants ---------------------------------------------------------------------

    def audit(self) -> list[tuple[Request, str]]:
        """The invariant checked on every turn, before its decode step: a joiner prefills (its
        own prompt, or a copy's whose last chunk fills it), or has its whole prompt and joins
        at the next rebatch, or has ended and leaves at the next join. A joiner in none of
        these states is a bug that would hold its row forever: it ends now (failed, alone),
        and comes back with what was wrong with it, for the log."""
        prefilling = set(self._prefilling())
        stuck = []
        for request in self.joining:
            prompt = len(request.prompt_ids)
            if request.done or request.prefilled == prompt or request in prefilling:
                continue
            if request.prefilled > prompt:
                why = f"it holds {request.prefilled} of its {prompt} prompt tokens"
            elif any(copy in prefilling for copy in request.group):
                continue  # a copy's prefill fills it
            else:
                why = f"nothing prefills the {prompt - request.prefilled} prompt tokens it lacks"
            request.end(Cause.FAILED, STUCK)
            stuck.append((request, why))
        return stuck

    def stalled(self) -> list[Request]:
        """When a turn moved nothing on (`moves`) while requests are admitted (nothing can
        progress: a bug), every one of them ends now (failed), for the log, rather than wait
        forever on a loop that spins."""
        stuck = [r for r in self.active() if not r.done]
        for request in stuck:
            request.end(Cause.FAILED, STUCK)
        return stuck

    # ---- the rest -----------------------------------------------------------------------------

    def add_time(self, kind: str, seconds: float) -> None:
        """Books time the engine spent: forward, prefill, rebatch, sampling or draft."""
        self.counters.timing[kind] += seconds

    def clear(self) -> None:
        """After a fault: nothing is running, joining or waiting any more, nor queued."""
        self.running.clear()
        self.entering.clear()
        self.joining.clear()
        self.waiting.clear()
        self.take_ops()
        self.prefills.clear()
        self.batch.clear()
        self._preempting, self._riding, self._turn = [], [], None

    def stats(self, healthy: bool) -> EngineStats:
        """The counters and the queues' sizes now. Meant for the engine's thread; another
        thread (a test's sampler) may read it too: the queue is copied in one step first."""
        c = self.counters
        counts = {k: v for k, v in vars(c).items() if not isinstance(v, dict)}
        return EngineStats(
            # rows leaving at the next rebatch no longer count: never above max_running
            running=sum(not r.done for r in self.running)
            + sum(not r.done for r in self.entering)
            + len(self.joining),
            queued=len(self.waiting),
            live_batch_size=len(self.running) if self.batch.live else 0,
            healthy=healthy,
            timing=dict(c.timing),
            batch_size_steps=dict(c.batch_size_steps),
            alone_steps=dict(c.alone_steps),
            prefix_cache_entries=len(self.prefix) if self.prefix else 0,
            prefix_cache_bytes=self.prefix.bytes if self.prefix else 0,
            preempted=sum(r.preemptions > 0 for r in list(self.waiting)),
            kv_budget_tokens=self.kv_budget_tokens,
            kv_tokens=self.kv_held(),
            **counts,
        )
