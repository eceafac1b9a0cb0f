"""The scheduler: every decision of the engine, as plain data in and plans out.

It never awaits and never touches a tensor. The engine's loop asks it for a plan
(`schedule`), the runner runs the whole plan on the device worker, and the loop hands the
outcome back (`update`), which answers what the routers are to be told. Nothing is shared
between the three but those frozen plans and outcomes.

The admitted requests are in a RequestTable, by status. Planning moves none of them: a plan
says who joins, leaves or is preempted, and `update` makes those moves as it records the
device's answer (the planners, LiveBatch and Prefills, only read the table). The only moves
made elsewhere come from outside a turn: an admission, a session file written, and ending
every request at once (a drain past its deadline, a fault).

A turn of the loop takes up to four kinds of plan, in this order, each planned whole once
the device's answer to the one before is recorded:
1. JOIN, when anything changes: queued requests that timed out or were cancelled end, the
   oldest waiting ones take the free rows (within the KV budget, preempting newer rows if
   that makes room);
2. LOAD: the session files the turn's first prompt chunks start after (the tokens a file
   holds decide where its chunk starts);
3. PREFILL, while no row decodes: each joiner's whole prompt in a forward of its own, one
   plan each (the prompt after it may start from its KV in the prefix cache, and its first
   token decides whether it joins at all);
4. STEP: the rebatch (extract the survivors, assemble them with the joiners), then one decode
   step over the new batch, with joiners' prompt chunks prefilled in the same forward. The
   decode needs nothing the rebatch answers: its rows and their snapshots are known when it is
   planned.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence

from neuronpy.engine.budget import RowView, fit, plan_rows
from neuronpy.engine.costs import MIN_CHUNK, StepCosts
from neuronpy.engine.counters import EngineStats
from neuronpy.engine.lifecycle import Lifecycle, Messages
from neuronpy.engine.live_batch import LiveBatch, refs
from neuronpy.engine.plans import (
    DecodeOutcome,
    DecodePlan,
    DropCached,
    DropSnapshots,
    Joins,
    Offload,
    Op,
    Phase,
    PrefillOutcome,
    PrefillPlan,
    RebatchOutcome,
    RebatchPlan,
    RowRef,
    StepOutcome,
    StepPlan,
)
from neuronpy.engine.prefill import Prefills
from neuronpy.engine.prefix_cache import PrefixIndex
from neuronpy.engine.request import Cause, Request, RequestStatus
from neuronpy.engine.speculative import SpeculativeConfig
from neuronpy.engine.table import RequestTable
from neuronpy.engine.types import SamplingParams, SessionRequest

log = logging.getLogger(__name__)

# what a request found unable to progress is told (the engine's log has the details)
STUCK = "the request could not make progress (an internal error of the server); retry it"


class Scheduler:
    """Plans each turn (who joins and who is preempted within the KV budget, the prefills,
    the rebatch, the decode step) and records what the device answered, over its request table;
    the requests' own lifecycle (admission, deadlines, cancellation, their end) is its
    Lifecycle's."""

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
        self.name = name
        self.table = RequestTable()
        self.counters = self.table.counters
        self.lifecycle = Lifecycle(
            self.table,
            name=name,
            max_running=max_running,
            max_queue=max_queue,
            queue_timeout=queue_timeout,
            context_len=context_len,
            vocab_size=vocab_size,
            kv_budget_tokens=kv_budget_tokens,
            speculative=speculative,
        )
        self.max_running = max_running
        self.kv_budget_tokens = kv_budget_tokens
        self.costs = StepCosts(chunk_steps, prefill_chunk)
        exact = bool(state_block)
        self.prefix = PrefixIndex(prefix_cache_bytes, exact=exact) if prefix_cache_bytes else None
        self.prefills = Prefills(self.prefix, self.counters, self.table.new_kv_id, state_block)
        self.batch = LiveBatch(self.lifecycle, self.prefills)
        self._preempting: list[Request] = []  # rows leaving the live batch at the next rebatch
        # this turn's joiners whose next chunks are prefilled in its decode step
        self._riding: list[Request] = []
        # this turn's joiners still to prefill whole, one plan each; None: no turn under way
        self._turn: deque[Request] | None = None
        self._loads_due = False  # the turn's session loads are still to plan
        # `moves` when this turn began (None: it began with nothing admitted, housekeeping
        # only; a request admitted since joins at the next turn)
        self._turn_moves: int | None = None
        self._loads = 0  # sessions read (a turn that reads one has made progress)
        # sessions written before the rebatch that ends their requests was recorded, by id
        self._saved_early: dict[int, str | None] = {}
        # the requests a plan may name, by id, as they were when it was made (`_get`)
        self._named: dict[int, Request] = {}

    # ---- what the engine asks of the table and the lifecycle ----------------------------------

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> tuple[int, ...]:
        return self.lifecycle.validate(prompt_ids, params)

    def admit(
        self,
        prompt: tuple[int, ...],
        copies: Sequence[SamplingParams],
        stop_ids: frozenset[int],
        session: SessionRequest | None = None,
        now: float | None = None,
        labels: Sequence[str | None] = (),
    ) -> list[Request]:
        return self.lifecycle.admit(prompt, copies, stop_ids, session, now, labels)

    def cancel(self, request: Request) -> None:
        self.lifecycle.cancel(request)

    def leave(self, request: Request) -> None:
        self.lifecycle.leave(request)

    def retry_after(self) -> float:
        return self.lifecycle.retry_after()

    def rows(self) -> list[dict[str, object]]:
        return self.lifecycle.rows()

    def kv_held(self) -> int:
        return self.lifecycle.kv_held()

    def end_all(self, cause: Cause, error: str | None = None) -> Messages:
        return self.lifecycle.end_all(cause, error)

    def active(self) -> tuple[Request, ...]:
        return self.table.active()

    @property
    def idle(self) -> bool:
        return self.table.idle

    @property
    def saving(self) -> tuple[Request, ...]:
        return self.table.saving

    @property
    def moves(self) -> int:
        """How often the scheduler has made progress: sessions read, chunks prefilled, rebatches,
        decode steps, requests ended. A turn of the engine's loop that leaves it unchanged
        ran nothing."""
        c = self.counters
        return self._loads + c.prefill_chunks + c.rebatches + c.decode_steps + self.lifecycle.ended

    @property
    def has_work(self) -> bool:
        """Whether a plan would do anything: requests are admitted, or housekeeping waits."""
        return bool(self.table.active()) or self.lifecycle.has_ops

    # ---- schedule -> run -> update -------------------------------------------------------------

    def schedule(self, now: float | None = None) -> StepPlan:
        """The next plan of the turn under way, or of a new turn (see the module's docstring)."""
        self._named = {r.id: r for r in self.table.active()}
        if self._turn is None:
            self._turn_moves = self.moves if self.table.active() else None
            self._riding = []
            joins = self._plan_joins(now)
            self._turn = deque()
            if joins:
                return StepPlan(Phase.JOIN, self.lifecycle.take_ops(), joins=joins)
            self._start_prefills()
        if self._loads_due:
            self._loads_due = False
            loads = tuple(
                load
                for request in (*self._turn, *self._riding)
                if (load := self.prefills.session_load(request)) is not None
            )
            if loads:
                return StepPlan(Phase.LOAD, self.lifecycle.take_ops(), loads=loads)
        while self._turn:
            prefill = self.prefills.plan(self._turn.popleft(), None)
            if prefill is not None:
                return StepPlan(Phase.PREFILL, self.lifecycle.take_ops(), prefill=prefill)
        self._turn = None
        # joiners whose first token ended them leave rather than join
        ended = tuple(
            r for r in self.table.prefilling if r.done and r.prefilled == len(r.prompt_ids)
        )
        rebatch = self.batch.plan_rebatch(self._take_preempted())
        for request, why in self.audit():
            log.error("%s: request %d is stuck (%s); it fails", self.name, request.id, why)
        rows = self.table.running if rebatch is None else self._get_all(rebatch.order)
        decode = self.batch.plan_decode(rows, self._rides()) if rows else None
        for release in self.batch.drafting.releases(rows):  # (rows gone: their drafts' state)
            self.lifecycle.queue(release)
        return StepPlan(
            Phase.STEP,
            self.lifecycle.take_ops(),
            joins=Joins(ended=refs(ended)) if ended else None,
            rebatch=rebatch,
            decode=decode,
        )

    def update(self, plan: StepPlan, outcome: StepOutcome) -> Messages:
        """Records what the device answered to `plan`, making the moves it says; answers what the
        routers are to be told (everything since the last answer, in order)."""
        if plan.joins is not None:
            self._record_joins(plan.joins)
        if plan.phase is Phase.JOIN:
            self._start_prefills()
        for load, loaded in zip(plan.loads, outcome.loads, strict=True):
            self._loads += 1
            request = self._get(load.row)
            drop = self.prefills.record_session_load(request, load, loaded)
            self._queue(() if drop is None else (drop,))
            if loaded.error is not None:
                self.lifecycle.finish(request)
        if plan.prefill is not None:
            assert outcome.prefill is not None
            self._record_prefill(plan.prefill, outcome.prefill)
        if plan.rebatch is not None:
            assert outcome.rebatch is not None
            self._record_rebatch(plan.rebatch, outcome.rebatch)
        if plan.decode is not None:
            assert outcome.decode is not None
            self.counters.timing["draft"] += outcome.draft_seconds
            self._record_decode(plan.decode, outcome.decode)
        elif plan.phase is Phase.STEP and self.moves == self._turn_moves and self.active():
            # (a turn that began with requests admitted and ended without letting one make progress)
            stuck = self.stalled()
            log.error(
                "%s: a turn made no progress; %d requests fail: %s",
                self.name,
                len(stuck),
                {r.id: r.status.name.lower() for r in stuck},
            )
        return self.lifecycle.take_messages()

    def record_saved(self, request_id: int, error: str | None = None) -> Messages:
        """A request's session file is on disk, or could not be written: the request ends as
        it ended (its reply is the user's), and says so; answers what the routers are to be
        told. A file written before the rebatch that moved its request to SAVING is recorded
        with it; one of a request ended meanwhile (a drain, a fault) changes nothing."""
        saving = next((r for r in self.table.saving if r.id == request_id), None)
        if saving is not None:
            return self.lifecycle.record_saved(saving, error)
        if any(r.id == request_id and not r.status.finished for r in self.table.running):
            self._saved_early[request_id] = error
        return ()

    def _get(self, ref: RowRef) -> Request:
        """The request a plan names."""
        return self._named[ref.id]

    def _get_all(self, refs: Sequence[RowRef]) -> tuple[Request, ...]:
        return tuple(self._named[ref.id] for ref in refs)

    def _queue(self, ops: Sequence[Op]) -> None:
        for op in ops:
            self.lifecycle.queue(op)

    # ---- joining: who gets a row, who is preempted --------------------------------------------

    def _plan_joins(self, now: float | None) -> Joins:
        """The turn's start, decided: queued requests past their deadline or ended leave; joiners
        that ended leave; the oldest waiting take the free rows (within the KV budget,
        preempting newer rows if that makes room)."""
        table, lifecycle = self.table, self.lifecycle
        now = time.monotonic() if now is None else now
        expired = lifecycle.expired(now)
        ended = tuple(r for r in table.prefilling if r.done)
        waiting = [r for r in table.waiting if r not in expired]
        changes = plan_rows(
            [RowView(r.id, r.done) for r in table.running],
            [RowView(r.id, r.done) for r in waiting],
            self.max_running,
            prefilling=len(table.prefilling) - len(ended),
        )
        by_id = {r.id: r for r in waiting}
        joining = [by_id[rid] for rid in changes.joining]
        preempted: list[Request] = []
        if self.kv_budget_tokens:
            live = [r for r in (*table.running, *table.prefilling) if not r.done]
            preempted, joining = fit(live, joining, self.kv_budget_tokens)
        return Joins(
            refs(expired),
            tuple(by_id[rid].ref() for rid in changes.dropped),
            refs(ended),
            refs(preempted),
            refs(joining),
            now,
        )

    def _record_joins(self, joins: Joins) -> None:
        lifecycle = self.lifecycle
        for request in self._get_all(joins.expired):
            lifecycle.time_out(request, joins.now)
        for request in self._get_all(joins.ended):
            lifecycle.end_before_joining(request)
        for request in self._get_all(joins.dropped):
            # (a copy of an n > 1 request may have ended on its first token)
            lifecycle.finish(request)
        # (a drain may have ended any of them meanwhile)
        for request in self._get_all(joins.preempted):
            if not request.status.finished:
                self._preempt(request)
        now = time.monotonic()
        for request in self._get_all(joins.joined):
            if request.status.finished:
                continue
            if request.scheduled_at is None:
                request.scheduled_at = now
            self.table.move(request, RequestStatus.PREFILLING)

    def _preempt(self, request: Request) -> None:
        """A row leaves the live batch at this turn's rebatch, or a joiner its prefill; its
        snapshot waits, with its tokens and sampler, to resume where it stopped."""
        self.counters.preemptions += 1
        request.preemptions += 1
        if request.status is RequestStatus.RUNNING:
            self._preempting.append(request)
            return
        if request.restored is not None:  # (a session read for a first chunk never planned)
            self.lifecycle.queue(DropCached((request.restored[0],)))
            request.restored = None
        if request.snapshot_id is not None:
            self.lifecycle.queue(Offload((request.snapshot_id,)))
        self.table.move(request, RequestStatus.WAITING)

    def _take_preempted(self) -> list[Request]:
        """The rows preempted for this rebatch (those that have ended since just leave)."""
        preempted, self._preempting = self._preempting, []
        return [r for r in preempted if not r.done and r.status is RequestStatus.RUNNING]

    # ---- prefill ------------------------------------------------------------------------------

    def _start_prefills(self) -> None:
        """The turn's joiners to prefill: each whole, in a forward of its own, while no row
        decodes (nobody waits on a decode step); else in chunks within the decode steps."""
        todo = self._prefilling()
        if self.table.running:
            self._riding, self._turn = todo, deque()
        else:
            self._turn = deque(todo)
        self._loads_due = True

    def _prefilling(self) -> list[Request]:
        """The joiners with prompt left to prefill, oldest first, but for copies (n > 1) that
        another copy's prefill fills: of a request's copies, one prefills (one that has
        started, else the first), and its last chunk gives the others its snapshot. Were two
        prefilled in one step, the second would count its prompt twice and never join."""
        todo = [r for r in self.table.prefilling if not r.done and r.prefilled < len(r.prompt_ids)]
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
        """The joiners' chunks prefilled in this turn's decode step, oldest first, within the
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
        """Prompt tokens `joiners` chunks in a decode step may add to it, together."""
        return self.costs.ride_budget(joiners)

    def _record_prefill(
        self, plan: PrefillPlan, outcome: PrefillOutcome, alone: bool = True
    ) -> None:
        """A chunk's result; after the last chunk, the first tokens of the request and its
        copies. `alone`: it ran in a forward of its own (its time then feeds the cost model),
        rather than in a decode step."""
        if alone:
            self.costs.prefill.observe(len(plan.tokens), outcome.seconds)
            self.counters.timing["prefill"] += outcome.seconds
            self.counters.timing["sampling"] += outcome.sampling_seconds
        request, clones = self._get(plan.row), self._get_all(plan.clones)
        self._queue(self.prefills.record(request, clones, plan, outcome))
        for row, sampled in zip(plan.sampled, outcome.tokens, strict=True):
            self.lifecycle.accept(self._get(row), sampled)

    # ---- the rebatch and the decode step -------------------------------------------------------

    def _record_rebatch(self, plan: RebatchPlan, outcome: RebatchOutcome) -> None:
        """Indexes what the prefix cache took, ends the rows that left, queues the preempted
        again; the new live batch (if any row is left) runs."""
        lifecycle, table = self.lifecycle, self.table
        self.counters.rebatches += 1
        if outcome.cached is not None:
            for (row, sid), nbytes, length in zip(
                plan.cache, outcome.cached.nbytes, outcome.cached.lengths, strict=True
            ):
                # the worker kept the prompt's columns (see Prefills.worth_caching)
                prompt = self._get(row).prompt_ids[:length]
                self._queue(self.prefills.index_entry(sid, prompt, nbytes))
        # (a drain or a fault may have ended any of them while the device rebatched)
        saving = {row.id for row in plan.saving}
        for request in self._get_all(plan.leaving):
            if request.id in saving and not request.status.finished:
                lifecycle.saved(request)
                if request.id in self._saved_early:
                    lifecycle.end_saved(request, self._saved_early.pop(request.id))
                continue
            lifecycle.finish(request)
            table.drop_rows((request,))
        survivors = len(plan.order) - len(plan.joined)  # (extracted first, then the preempted)
        waits = plan.ids[survivors : survivors + len(plan.preempted)]
        for request, sid in zip(self._get_all(plan.preempted), waits, strict=True):
            if request.status.finished:
                table.drop_rows((request,))
                lifecycle.queue(DropSnapshots((sid,)))
                continue
            request.snapshot_id = sid
            table.move(request, RequestStatus.WAITING)
        for request in self._get_all(plan.joined):
            if request.status.finished:
                table.add_row(request)
            else:
                table.move(request, RequestStatus.RUNNING)
            request.snapshot_id = None  # moved into the live batch
        order = tuple(row.id for row in plan.order)
        assert tuple(r.id for r in table.running) == order, "the rows are the rebatch's order"
        self.counters.timing["rebatch"] += outcome.seconds
        self.batch.live = bool(plan.order)
        self.batch.padding_columns = outcome.padding_columns

    def _record_decode(self, plan: DecodePlan, outcome: DecodeOutcome) -> None:
        """One step's tokens, and the results of the chunks prefilled in it."""
        lifecycle, c, seconds = self.lifecycle, self.counters, outcome.seconds
        c.timing["sampling"] += outcome.sampling_seconds
        if not plan.rides:
            self.costs.observe_step(seconds)
            c.timing["forward"] += seconds
        else:
            extra = self.costs.observe_ride(seconds, sum(len(r.tokens) for r in plan.rides))
            c.timing["forward"] += seconds - extra
            c.timing["prefill"] += extra
            c.riding_chunks += len(plan.rides)
            for ride, done in zip(plan.rides, outcome.rides, strict=True):
                self._record_prefill(ride, done, alone=False)
        rows = self._get_all(plan.rows)
        alone = None
        if len(rows) == 1:
            alone = "no_peer"
            if self.table.prefilling or self.table.waiting:
                alone = "peer_prefilling" if self.table.prefilling else "peer_queued"
        kv = sum(r.total_tokens for r in rows)  # fed tokens, this step's included
        c.count_step(len(rows), self.batch.padding_columns, kv, self.kv_held(), alone)
        drafting = self.batch.drafting
        if plan.proposals:
            drafting.book(rows, plan.proposals, outcome.proposed, outcome.tokens, outcome.drafted)
        if not outcome.drafted:
            for request, sampled in zip(rows, outcome.tokens, strict=True):
                lifecycle.accept(request, sampled)
            return
        trim = []
        forced = outcome.forced or (0,) * len(rows)
        for request, sampled, drafted, jumped in zip(
            rows, outcome.tokens, outcome.drafted, forced, strict=True
        ):
            taken = lifecycle.accept(request, sampled)
            # the row's KV keeps its fed token and the drafts before its last emitted token
            trim.append(drafted + 1 - max(1, taken))
            if jumped:
                c.jump_forward_tokens += min(jumped, max(0, taken - 1))
            elif drafted:
                assert request.speculation is not None
                request.speculation.drafted += drafted
                request.speculation.accepted += len(sampled.accepted)
                c.spec_verify_rows += 1
                c.spec_draft_tokens += drafted
                c.spec_accepted_tokens += len(sampled.accepted)
                c.spec_emitted_tokens += taken
        self.batch.trim = tuple(trim) if any(trim) else ()

    # ---- the invariants ---------------------------------------------------------------------

    def audit(self) -> list[tuple[Request, str]]:
        """The invariant checked on every turn, before its decode step: a joiner prefills (its
        own prompt, or a copy's whose last chunk fills it), or has its whole prompt and joins
        at the next rebatch, or has ended and leaves at the next join. A joiner in none of
        these states is a bug that would hold its row forever: it ends now (failed, alone),
        and comes back with what was wrong with it, for the log."""
        prefilling = set(self._prefilling())
        stuck = []
        for request in self.table.prefilling:
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
        """When a turn made no progress (`moves`) while requests are admitted (nothing can
        progress: a bug), every one of them ends now (failed), for the log, rather than wait
        forever on a loop that spins."""
        stuck = [r for r in self.active() if not r.done]
        for request in stuck:
            request.end(Cause.FAILED, STUCK)
        return stuck

    # ---- the rest -----------------------------------------------------------------------------

    def clear(self) -> None:
        """After a fault, once every request has ended (`end_all`): nothing is queued any
        more, and the worker's stores are gone."""
        self.table.clear()
        self.lifecycle.take_ops()
        self.batch.clear()
        self._preempting, self._riding, self._turn = [], [], None
        self._loads_due = False
        self._saved_early.clear()
        self._named = {}

    def stats(self, healthy: bool) -> EngineStats:
        """The counters and the queues' sizes now. Meant for the engine's thread; another
        thread may read it too: the table's lists are copied in one step."""
        c, table = self.counters, self.table
        counts = {k: v for k, v in vars(c).items() if not isinstance(v, dict)}
        running, prefilling, waiting = table.running, table.prefilling, table.waiting
        return EngineStats(
            # rows leaving at the next rebatch no longer count: never above max_running
            running=sum(not r.done for r in running) + len(prefilling),
            queued=len(waiting),
            live_batch_size=len(running) if self.batch.live else 0,
            healthy=healthy,
            timing=dict(c.timing),
            batch_size_steps=dict(c.batch_size_steps),
            alone_steps=dict(c.alone_steps),
            prefix_cache_entries=len(self.prefix) if self.prefix else 0,
            prefix_cache_bytes=self.prefix.bytes if self.prefix else 0,
            preempted=sum(r.preemptions > 0 for r in waiting),
            kv_budget_tokens=self.kv_budget_tokens,
            kv_tokens=self.kv_held(),
            **counts,
        )
