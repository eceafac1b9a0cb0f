"""The live batch's plans: the rebatch (extract the survivors, assemble again) and the decode
step over it. Pure: no torch, no anyio. Planning changes no request: the scheduler moves them
when the device has answered.
"""

from __future__ import annotations

from collections.abc import Sequence

from neuronpy.engine.budget import RowView, plan_rows
from neuronpy.engine.drafting.planner import DraftPlanner
from neuronpy.engine.lifecycle import Lifecycle
from neuronpy.engine.plans import DecodePlan, Offload, Op, PrefillPlan, RebatchPlan, RowRef
from neuronpy.engine.prefill import Prefills
from neuronpy.engine.request import Request
from neuronpy.engine.speculative import cut_at_stop


class LiveBatch:
    """What the live batch holds between plans (whether there is one, its padding, the columns
    the last verify step gave back), and its rebatch and decode plans over the scheduler's
    request table (read through `requests`)."""

    def __init__(self, requests: Lifecycle, prefills: Prefills) -> None:
        self.requests = requests
        self.prefills = prefills
        self.live = False  # whether the running rows are a batch on the device
        self.padding_columns = 0
        # per row of the live batch: decode columns the last verify step gave back, for the
        # next job that reads the batch (decode or extract) to trim first
        self.trim: tuple[int, ...] = ()
        self.drafting = DraftPlanner(requests.speculative, requests.context_len)

    def clear(self) -> None:
        self.live, self.trim = False, ()
        self.drafting.clear()

    # ---- rebatch: extract the survivors, assemble again -----------------------------------------

    def plan_rebatch(self, preempted: Sequence[Request]) -> RebatchPlan | None:
        """The join or leave to make now (None: the batch keeps its shape): joiners whose
        prompt is in join (not those that have ended: see Scheduler); rows that ended leave
        (their KV to the prefix cache or their session, or dropped); `preempted` rows become
        snapshots that wait."""
        q = self.requests
        table = q.table
        joined = tuple(
            r for r in table.prefilling if r.prefilled == len(r.prompt_ids) and not r.done
        )
        running = table.running
        changes = plan_rows([RowView(r.id, r.done) for r in running], [], q.max_running)
        rows = {r.id: r for r in running}
        leaving = tuple(rows[i] for i in changes.leaving)
        survivors = [rows[i] for i in changes.survivors if rows[i] not in preempted]
        if not leaving and not joined and not preempted:
            return None
        extracted: tuple[Request, ...] = ()
        ids: tuple[int, ...] = ()
        cache: tuple[tuple[RowRef, int], ...] = ()
        saving: tuple[Request, ...] = ()
        ops: list[Op] = []
        if self.live:
            kept = self.prefills.worth_caching(leaving)
            saving = tuple(r for r in leaving if q.saves_session(r))
            extracted = (*survivors, *preempted, *kept, *(r for r in saving if r not in kept))
            ids = tuple(q.table.new_kv_id() for _ in extracted)
            sid = dict(zip(extracted, ids, strict=True))
            cache = tuple((r.ref(), sid[r]) for r in extracted if r in kept)
            if preempted:
                ops.append(Offload(tuple(sid[r] for r in preempted)))
            for request in saving:  # (the worker copies them before the prefix cache takes them)
                ops.append(q.save_op(request, sid[request], drop=request not in kept))
            snapshots = [sid[r] for r in survivors]
        else:
            snapshots = []
        trim, self.trim = self.trim, ()
        order = (*survivors, *joined)
        snapshots += [r.snapshot_id for r in joined]  # type: ignore[misc]
        return RebatchPlan(
            tuple(running.index(r) for r in extracted),
            ids,
            tuple(ops),
            cache,
            refs(leaving),
            refs(order),
            tuple(snapshots) if order else (),
            extract=self.live,
            trim=trim if self.live else (),
            joined=refs(joined),
            preempted=refs(preempted),
            saving=refs(saving),
        )

    # ---- decode -------------------------------------------------------------------------------

    def plan_decode(self, rows: Sequence[Request], rides: Sequence[PrefillPlan] = ()) -> DecodePlan:
        """The next step over `rows` (the live batch's, as the rebatch before it leaves them):
        every row's token, the rows that draft and how (see DraftPlanner), the columns the last
        verify step gave back."""
        tokens = tuple(r.next_token for r in rows)
        trim, self.trim = self.trim, ()
        forced = tuple(self._forced(r) for r in rows)
        return DecodePlan(
            refs(rows),
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


def refs(requests: Sequence[Request]) -> tuple[RowRef, ...]:
    """How a plan names these requests."""
    return tuple(r.ref() for r in requests)
