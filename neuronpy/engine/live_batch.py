"""The live batch's plans: the rebatch (extract the survivors, assemble again) and the decode
step over it, and the booking of what the device answered to them. Pure: no torch, no anyio.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from neuronpy.engine.costs import StepCosts
from neuronpy.engine.drafting.planner import DraftPlanner
from neuronpy.engine.lifecycle import Lifecycle
from neuronpy.engine.planner import RowView, plan_step
from neuronpy.engine.plans import (
    DecodeOutcome,
    DecodePlan,
    Offload,
    Op,
    PrefillOutcome,
    PrefillPlan,
    RebatchOutcome,
    RebatchPlan,
)
from neuronpy.engine.prefill import Prefills
from neuronpy.engine.request import Request, RequestStatus
from neuronpy.engine.speculative import cut_at_stop

BookPrefill = Callable[[PrefillPlan, PrefillOutcome, bool], None]


class LiveBatch:
    """What the live batch holds between plans (whether there is one, its padding, the columns
    the last verify step gave back), its rebatch and decode plans, and their booking, over the
    requests' states in `requests`."""

    def __init__(
        self,
        requests: Lifecycle,
        prefills: Prefills,
        costs: StepCosts,
        kv_ids: Iterator[int],
        book_prefill: BookPrefill,
    ) -> None:
        self.requests = requests
        self.prefills = prefills
        self.costs = costs
        self._kv_ids = kv_ids  # the scheduler's
        self._book_prefill = book_prefill  # a riding chunk's result
        self.live = False  # whether the running rows are a batch on the device
        self._padding_columns = 0
        # per row of the live batch: decode columns the last verify step gave back, for the
        # next job that reads the batch (decode or extract) to trim first
        self._trim: tuple[int, ...] = ()
        self.drafting = DraftPlanner(requests.speculative, requests.context_len)

    def clear(self) -> None:
        self.live, self._trim = False, ()
        self.drafting.clear()

    # ---- rebatch: extract the survivors, assemble again -----------------------------------------

    def plan_rebatch(self, preempted: Sequence[Request]) -> RebatchPlan | None:
        """The join or leave to make now (None: the batch keeps its shape): joiners whose
        prompt is in join; rows that ended leave (their KV to the prefix cache or their session,
        or dropped); `preempted` rows become snapshots that wait."""
        q = self.requests
        joined = [r for r in q.joining if r.prefilled == len(r.prompt_ids)]
        q.joining = [r for r in q.joining if r not in joined]
        joined = [r for r in joined if not q.leave_if_done(r)]
        plan = plan_step([RowView(r.id, r.done) for r in q.running], [], q.max_running)
        rows = {r.id: r for r in q.running}
        leaving = tuple(rows[i] for i in plan.leaving)
        survivors = [rows[i] for i in plan.survivors if rows[i] not in preempted]
        if not leaving and not joined and not preempted:
            return None
        q.entering = joined
        q.counters.rebatches += 1
        extracted: tuple[Request, ...] = ()
        ids: tuple[int, ...] = ()
        cache: tuple[tuple[Request, int], ...] = ()
        ops: list[Op] = []
        if self.live:
            kept = self.prefills.worth_caching(leaving)
            saved = [r for r in leaving if q.saves_session(r)]
            extracted = (*survivors, *preempted, *kept, *(r for r in saved if r not in kept))
            ids = tuple(next(self._kv_ids) for _ in extracted)
            for request, sid in zip(extracted, ids, strict=True):
                request.snapshot_id = sid
            cache = tuple((r, sid) for r, sid in zip(extracted, ids, strict=True) if r in kept)
            if preempted:
                ops.append(Offload(tuple(ids[len(survivors) : len(survivors) + len(preempted)])))
            for request in preempted:
                q.requeue(request)
            for request in saved:  # (the worker copies them before the prefix cache takes them)
                sid = ids[extracted.index(request)]
                ops.append(q.save(request, sid, drop=request not in kept))
            for request, _ in cache:
                request.snapshot_id = None  # it moves into the prefix cache
        trim, self._trim = self._trim, ()
        order = (*survivors, *joined)
        return RebatchPlan(
            tuple(q.running.index(r) for r in extracted),
            ids,
            tuple(ops),
            cache,
            leaving,
            order,
            tuple(r.snapshot_id for r in order),  # type: ignore[misc]
            extract=self.live,
            trim=trim if self.live else (),
        )

    def book_rebatch(self, plan: RebatchPlan, outcome: RebatchOutcome) -> None:
        """Indexes what the prefix cache took, ends the rows that left; the new live batch
        (if any row is left) runs."""
        q = self.requests
        q.entering = []
        if outcome.cached is not None:
            for (request, sid), nbytes, length in zip(
                plan.cache, outcome.cached.nbytes, outcome.cached.lengths, strict=True
            ):
                # the worker kept the prompt's columns (see Prefills.worth_caching)
                self.prefills.index_entry(sid, request.prompt_ids[:length], nbytes)
        for request in plan.leaving:
            if request.status is not RequestStatus.SAVING:
                q.finish(request)
        q.running = list(plan.order)
        q.counters.timing["rebatch"] += outcome.seconds
        self.live = bool(plan.order)
        self._padding_columns = outcome.padding_columns
        for request in q.running:
            request.status = RequestStatus.RUNNING
            request.snapshot_id = None  # moved into the live batch

    # ---- decode -------------------------------------------------------------------------------

    def plan_decode(
        self, rows: tuple[Request, ...], rides: Sequence[PrefillPlan] = ()
    ) -> DecodePlan:
        """The next step over `rows` (the live batch's, as the rebatch before it leaves them):
        every row's token, the rows that draft and how (see DraftPlanner), the columns the last
        verify step gave back."""
        tokens = tuple(r.next_token for r in rows)
        trim, self._trim = self._trim, ()
        forced = tuple(self._forced(r) for r in rows)
        return DecodePlan(
            rows,
            tokens,  # type: ignore[arg-type]
            tuple(rides),
            self.drafting.plan(rows),
            trim,
            forced if any(forced) else (),
        )

    def _forced(self, request: Request) -> tuple[int, ...]:
        """The tokens the row's grammar forces after its next token, as many as its
        max_tokens and the context leave room for beside one more, up to a stop token."""
        if request.done or not request.forced:
            return ()
        room = min(
            request.params.max_tokens - len(request.output_ids),
            self.requests.context_len - request.total_tokens,
        )
        return cut_at_stop(request.forced[: max(0, room - 1)], request.stop_ids)

    def book_decode(self, plan: DecodePlan, outcome: DecodeOutcome) -> None:
        """One step's tokens, and the riding chunks' results."""
        q = self.requests
        c, seconds = q.counters, outcome.seconds
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
                self._book_prefill(ride, done, False)
        rows = plan.rows
        alone = None
        if len(rows) == 1:
            alone = "no_peer"
            if q.joining or q.waiting:
                alone = "peer_prefilling" if q.joining else "peer_queued"
        kv = sum(r.total_tokens for r in rows)  # fed tokens, this step's included
        c.count_step(len(rows), self._padding_columns, kv, q.kv_held(), alone)
        if plan.proposals:
            self.drafting.book(
                rows, plan.proposals, outcome.proposed, outcome.tokens, outcome.drafted
            )
        if not outcome.drafted:
            for request, sampled in zip(rows, outcome.tokens, strict=True):
                q.accept(request, sampled)
            return
        trim = []
        forced = outcome.forced or (0,) * len(rows)
        for request, sampled, drafted, jumped in zip(
            rows, outcome.tokens, outcome.drafted, forced, strict=True
        ):
            taken = q.accept(request, sampled)
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
        self._trim = tuple(trim) if any(trim) else ()
