"""The scheduling policy without a model: the scheduler driven by hand-made device results."""

from __future__ import annotations

import subprocess
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neuronpy.engine.budget import fit
from neuronpy.engine.costs import MIN_CHUNK
from neuronpy.engine.drafting.ngram import NgramProposer
from neuronpy.engine.lifecycle import Messages
from neuronpy.engine.plans import (
    CacheOutcome,
    DecodeOutcome,
    DecodePlan,
    DropCached,
    DropSnapshots,
    Loaded,
    Offload,
    Phase,
    PrefillOutcome,
    Proposal,
    Proposals,
    RebatchOutcome,
    ReleaseDrafts,
    Sampled,
    SaveSession,
    StepOutcome,
    StepPlan,
)
from neuronpy.engine.request import Cause, Finish, Request, RequestStatus
from neuronpy.engine.scheduler import Scheduler
from neuronpy.engine.speculative import SpeculativeConfig
from neuronpy.engine.types import FinishReason, SamplingParams, SessionRequest
from neuronpy.errors import QueueFullError

ROOT = Path(__file__).parent.parent
EOS = 0
TOKEN = 7  # what the hand-made device samples unless told otherwise
# what the routers have been told, by scheduler, since the test last looked (`finishes`)
SENT: weakref.WeakKeyDictionary[Scheduler, list] = weakref.WeakKeyDictionary()

# ---- factories ----------------------------------------------------------------------------------


def make_scheduler(**kw: object) -> Scheduler:
    defaults: dict[str, object] = {
        "name": "m",
        "max_running": 4,
        "max_queue": 8,
        "queue_timeout": 0.0,
        "context_len": 1000,
        "vocab_size": 1000,
    }
    return Scheduler(**{**defaults, **kw})  # type: ignore[arg-type]


def admit(
    s: Scheduler,
    length: int = 10,
    max_tokens: int = 50,
    n: int = 1,
    now: float = 0.0,
    session: SessionRequest | None = None,
    first: int = 1,
) -> list[Request]:
    prompt = s.validate(range(first, first + length), SamplingParams(max_tokens=max_tokens))
    copies = [SamplingParams(max_tokens=max_tokens)] * n
    return s.admit(prompt, copies, frozenset({EOS}), session, now=now)


def answer(
    plan: StepPlan,
    pick: Callable[[Request], int] | dict[int, int] | None = None,
    decode: DecodeOutcome | None = None,
) -> StepOutcome:
    """What a hand-made device answers: sessions that hold nothing, first tokens TOKEN, each
    cached row 1000 bytes, each decode row `pick`'s token (by request id; TOKEN by default)
    unless `decode` is given."""
    if isinstance(pick, dict):
        picks = pick
        pick = lambda r: picks.get(r.id, TOKEN)  # noqa: E731
    choose = pick or (lambda r: TOKEN)
    prefill = None
    if plan.prefill is not None:
        prefill = PrefillOutcome(tuple(Sampled(TOKEN) for _ in plan.prefill.sampled))
    rebatch = None
    if plan.rebatch is not None:
        cached = None
        if plan.rebatch.cache:
            cached = CacheOutcome(
                tuple(1000 for _ in plan.rebatch.cache),
                tuple(r.total_tokens - 1 for r, _ in plan.rebatch.cache),
            )
        rebatch = RebatchOutcome(cached)
    if plan.decode is not None and decode is None:
        d = plan.decode
        rides = tuple(PrefillOutcome(tuple(Sampled(TOKEN) for _ in c.sampled)) for c in d.rides)
        proposed = tuple(held(p) for p in d.proposals)  # (it drafts nothing)
        decode = DecodeOutcome(tuple(Sampled(choose(r)) for r in d.rows), rides, proposed=proposed)
    return StepOutcome(tuple(Loaded() for _ in plan.loads), prefill, rebatch, decode)


def held(proposals: Proposals, fed_itself: int = 0) -> Proposal:
    """A hand-made proposer's answer: no drafts; it holds each row's context and
    `fed_itself` drafts of its own."""
    rows = proposals.rows
    return Proposal(tuple(() for _ in rows), tuple(r.context + fed_itself for r in rows))


def lookup(s: Scheduler, plan: DecodePlan) -> tuple[tuple[tuple[int, ...], ...], Proposal]:
    """What prompt lookup (a proposer kept per scheduler) drafts for the plan's rows: per
    row, and its answer."""
    proposer = NGRAM.setdefault(s, NgramProposer(1, 4))
    (proposals,) = plan.proposals
    assert proposals.method == "ngram"
    proposal = proposer.propose_now(proposals.rows)
    drafts: list[tuple[int, ...]] = [()] * len(plan.rows)
    for row, row_drafts in zip(proposals.rows, proposal.drafts, strict=True):
        drafts[row.row] = row_drafts
    return tuple(drafts), proposal


NGRAM: weakref.WeakKeyDictionary[Scheduler, NgramProposer] = weakref.WeakKeyDictionary()


def update(s: Scheduler, plan: StepPlan, outcome: StepOutcome) -> None:
    """Books the outcome as the engine's loop does; what the routers are told is kept."""
    SENT.setdefault(s, []).extend(s.update(plan, outcome))


def schedule(s: Scheduler, now: float = 0.0) -> StepPlan:
    """The scheduler's next plan past a turn's JOIN plan (answered and booked on the way), if
    the turn starts with one."""
    plan = s.schedule(now)
    if plan.phase is Phase.JOIN:
        update(s, plan, answer(plan))
        plan = s.schedule(now)
    return plan


def until_step(s: Scheduler, now: float = 0.0) -> StepPlan:
    """Runs a turn's plans up to its STEP plan (answered by hand), and returns that one,
    not yet answered."""
    plan = s.schedule(now)
    while plan.phase is not Phase.STEP:
        update(s, plan, answer(plan))
        plan = s.schedule(now)
    return plan


def turn(
    s: Scheduler,
    pick: Callable[[Request], int] | dict[int, int] | None = None,
    now: float = 0.0,
) -> StepPlan:
    """One turn of the engine's loop, each plan answered by hand; returns its STEP plan."""
    plan = until_step(s, now)
    update(s, plan, answer(plan, pick))
    return plan


def ids(requests: object) -> list[int]:
    return [r.id for r in requests]  # type: ignore[attr-defined]


def finishes(s: Scheduler, more: Messages = ()) -> dict[int, Finish]:
    """The Finish messages the routers would have got since the last call (and `more`), by
    request id."""
    sent = [*SENT.pop(s, []), *more]
    return {r.id: m for r, m in sent if isinstance(m, Finish)}


@dataclass
class Row:
    id: int
    kv_need: int


# ---- admission and order ------------------------------------------------------------------------


def test_head_of_line_order_fills_free_rows_oldest_first() -> None:
    s = make_scheduler(max_running=2)
    admit(s), admit(s), admit(s), admit(s)
    plan = turn(s, {0: EOS})  # request 0 ends on EOS in the first step
    assert plan.rebatch is not None and ids(plan.rebatch.order) == [0, 1]
    assert ids(s.table.running) == [0, 1] and ids(s.table.waiting) == [2, 3]
    assert all(r.status is RequestStatus.RUNNING for r in s.table.running)
    plan = turn(s)  # it leaves, the oldest waiter takes its row
    assert plan.rebatch is not None and ids(plan.rebatch.leaving) == [0]
    assert ids(plan.rebatch.order) == [1]
    assert finishes(s)[0] == Finish(FinishReason.STOP)
    assert s.counters.finished == 1
    # a row decodes: the joiner's prompt rides the step, then it joins
    assert plan.decode is not None and [c.row.id for c in plan.decode.rides] == [2]
    assert ids(s.table.prefilling) == [2] and ids(s.table.waiting) == [3]
    assert s.counters.riding_chunks == 1
    plan = turn(s)
    assert plan.rebatch is not None and ids(plan.rebatch.order) == [1, 2]
    assert ids(s.table.waiting) == [3]


def test_admission_counts_every_copy_and_refuses_past_the_queue() -> None:
    s = make_scheduler(max_running=2, max_queue=1)
    admit(s, n=2)
    with pytest.raises(QueueFullError):
        admit(s, n=2)
    assert s.counters.rejected == 1 and s.counters.admitted == 2
    admit(s)  # one more still fits the queue
    assert len(s.table.waiting) == 3


# ---- the KV budget ------------------------------------------------------------------------------


def test_fit_preempts_the_newest_live_rows_first() -> None:
    live = [Row(1, 10), Row(2, 10), Row(3, 10)]
    preempt, admit_ = fit(live, [], 25)
    assert ids(preempt) == [3] and admit_ == []
    preempt, _ = fit(live, [], 15)
    assert ids(preempt) == [3, 2]


def test_fit_lets_an_older_waiter_preempt_newer_rows_but_never_overtake() -> None:
    live = [Row(5, 10), Row(6, 10)]
    preempt, joined = fit(live, [Row(3, 10)], 25)
    assert ids(preempt) == [6] and ids(joined) == [3]
    # a waiter that cannot make room (the live rows are older) waits, and so does the one behind
    preempt, joined = fit([Row(1, 20)], [Row(4, 10), Row(5, 1)], 25)
    assert preempt == [] and joined == []


def test_fit_keeps_one_row_running_alone_over_the_budget() -> None:
    preempt, joined = fit([Row(1, 100)], [], 50)
    assert preempt == [] and joined == []
    preempt, joined = fit([Row(1, 100), Row(2, 1)], [], 50)
    assert ids(preempt) == [2]


def test_the_newest_row_is_preempted_and_resumes_before_newer_requests() -> None:
    s = make_scheduler(max_running=4, kv_budget_tokens=40)
    admit(s), admit(s), admit(s)  # 10-token prompts: 11 columns each to join
    plan = turn(s)
    assert plan.rebatch is not None and ids(plan.rebatch.order) == [0, 1, 2]
    # 12 tokens each after the first step: each needs 13 columns through the next, 39 of 40
    assert turn(s).rebatch is None
    plan = turn(s)  # 14 columns each: 42 > 40, the newest goes
    assert plan.rebatch is not None and ids(plan.rebatch.order) == [0, 1]
    (preempted,) = s.table.waiting
    assert preempted.id == 2 and preempted.preemptions == 1
    assert preempted.status is RequestStatus.WAITING
    assert Offload((preempted.snapshot_id,)) in plan.rebatch.ops  # its KV waits, kept
    assert s.counters.preemptions == 1 and s.stats(True).preempted == 1
    # a newer request that would fit (6 columns beside the rows' 30) waits behind it (14):
    # no overtaking
    admit(s, length=5)
    assert turn(s).rebatch is None and ids(s.table.waiting) == [2, 3]
    turn(s, {0: EOS})  # request 0 ends: the preempted one rejoins where it stopped
    plan = turn(s)
    assert plan.rebatch is not None and ids(plan.rebatch.order) == [1, 2]
    assert ids(s.table.prefilling) == [3]
    (rejoined,) = [r for r in s.table.running if r.id == plan.rebatch.order[1].id]
    assert rejoined.preemptions == 1 and rejoined.status is RequestStatus.RUNNING
    assert len(rejoined.output_ids) == 3 + 1  # where it stopped, and this turn's step


def test_one_row_runs_alone_even_past_the_budget() -> None:
    s = make_scheduler(kv_budget_tokens=12)
    (request,) = admit(s, max_tokens=8)
    turn(s)
    for _ in range(6):
        assert turn(s).rebatch is None  # never preempted: it would have nothing to wait for
    assert request.done and request.ending is not None
    assert request.ending.cause is Cause.LENGTH and s.counters.preemptions == 0


# ---- queue deadline -----------------------------------------------------------------------------


def test_a_request_waiting_past_the_queue_timeout_ends_unprefilled() -> None:
    s = make_scheduler(max_running=1, queue_timeout=5.0)
    admit(s, now=0.0), admit(s, now=0.0), admit(s, now=4.0)
    turn(s, now=0.0)
    turn(s, now=6.0)  # request 1 has waited 6 s, request 2 only 2 s
    ended = finishes(s)
    assert list(ended) == [1]
    assert ended[1].reason is FinishReason.ABORT and "queue_timeout 5 s" in (ended[1].error or "")
    assert s.counters.timed_out == 1 and s.counters.finished == 0
    assert ids(s.table.waiting) == [2] and ids(s.table.running) == [0]


def test_a_preempted_request_is_never_expired() -> None:
    s = make_scheduler(max_running=2, kv_budget_tokens=25, queue_timeout=1.0)
    admit(s), admit(s)
    turn(s)
    turn(s, now=0.5)  # 13 + 13 > 25: request 1 is preempted
    assert ids(s.table.waiting) == [1]
    turn(s, now=100.0)
    assert ids(s.table.waiting) == [1] and s.counters.timed_out == 0


# ---- n > 1 ---------------------------------------------------------------------------------------


def test_n_copies_share_one_prefill_and_each_gets_a_snapshot() -> None:
    s = make_scheduler(max_running=1)
    first, *copies = admit(s, n=3)
    step = schedule(s)
    plan = step.prefill
    assert step.phase is Phase.PREFILL and plan is not None
    assert plan.last and plan.row.id == first.id
    assert ids(plan.clones) == ids(copies) and len(set(plan.clone_ids)) == 2
    assert plan.snapshot_id not in plan.clone_ids
    update(s, step, StepOutcome(prefill=PrefillOutcome((Sampled(4), Sampled(5), Sampled(6)))))
    assert [r.output_ids for r in (first, *copies)] == [[4], [5], [6]]
    assert [r.snapshot_id for r in copies] == list(plan.clone_ids)
    assert all(r.prefilled == 10 and r.status is RequestStatus.WAITING for r in copies)
    assert s.counters.prefills == 1 and s.counters.prefill_tokens == 10
    # a filled copy has nothing left to prefill when its row comes
    assert s.prefills.plan(copies[0], None) is None
    # a waiting copy that is cancelled drops the snapshot it was given
    update(s, step := schedule(s), answer(step))  # the turn's step: the first copy runs
    s.cancel(copies[1])
    step = schedule(s)
    assert DropSnapshots((plan.clone_ids[1],)) in step.ops
    update(s, step, answer(step))
    assert finishes(s)[copies[1].id].reason is FinishReason.ABORT


def test_copies_joining_while_a_row_decodes_share_one_riding_prefill() -> None:
    """The copies of a request that joins beside a decoding row: its first copy's chunks ride
    the steps alone, and its last chunk fills the others (they never prefill themselves)."""
    s = make_scheduler(max_running=8)
    admit(s)
    turn(s)
    first, second = admit(s, n=2)
    plan = turn(s)
    assert plan.decode is not None and [c.row.id for c in plan.decode.rides] == [first.id]
    assert s.counters.riding_chunks == 1 and s.counters.prefill_tokens == 10 + 10
    assert [r.prefilled for r in (first, second)] == [10, 10]
    assert [r.output_ids for r in (first, second)] == [[TOKEN], [TOKEN]]
    rebatch = turn(s).rebatch  # both join together
    assert rebatch is not None and ids(rebatch.order[1:]) == ids((first, second))
    assert s.table.prefilling == () and {first.status, second.status} == {RequestStatus.RUNNING}


def test_copies_of_a_long_prompt_wait_for_its_chunks_and_join_together() -> None:
    """A prompt of several chunks: only its first copy prefills, chunk by chunk beside the
    others' riding joiners; every copy stays accounted for meanwhile, and all join at once."""
    s = make_scheduler(max_running=8)
    admit(s)
    turn(s)
    copies = admit(s, length=5 * MIN_CHUNK, n=3)
    (other,) = admit(s, length=12, first=500)
    steps, before = 0, s.counters.prefill_tokens
    while copies[0].prefilled < len(copies[0].prompt_ids):
        assert [c.prefilled for c in copies[1:]] == [0, 0]  # filled by the last chunk only
        plan = turn(s)
        assert plan.decode is not None
        assert plan.decode.rides[0].row.id == copies[0].id  # the oldest rides first
        steps += 1
        assert s.audit() == []  # the waiting copies are waiting for a named reason
    assert steps > 1 and [c.prefilled for c in copies] == [5 * MIN_CHUNK] * 3
    assert s.counters.prefill_tokens - before == 5 * MIN_CHUNK + other.prefilled
    assert [len(c.output_ids) for c in copies] == [1, 1, 1]
    rebatch = turn(s).rebatch
    assert rebatch is not None and set(ids(copies)) <= set(ids(rebatch.order))


def test_several_requests_of_n_copies_joining_together_all_run_to_their_end() -> None:
    s = make_scheduler(max_running=8, max_queue=16)
    admit(s, max_tokens=40)
    turn(s)
    groups = [admit(s, n=2, max_tokens=5, first=100 * i) for i in range(1, 4)]
    for _ in range(20):
        turn(s)
    ended = finishes(s)
    assert all(ended[r.id].reason is FinishReason.LENGTH for g in groups for r in g)
    assert all(len(r.output_ids) == 5 for g in groups for r in g)
    assert s.counters.prefills == 1 + 3


def test_a_joiner_in_no_state_that_can_move_on_fails_alone() -> None:
    """The engine's invariant: a joiner prefills (its own prompt or a copy's), has its prompt
    and joins, or has ended. One found otherwise (a bug) ends with an error, and leaves."""
    s = make_scheduler(max_running=4)
    broken, fine = admit(s), admit(s, first=300)
    plan = schedule(s)  # both join; the first prefills
    assert plan.prefill is not None and plan.prefill.row.id == broken[0].id
    update(s, plan, answer(plan))
    broken[0].prefilled = 12  # more than its 10 prompt tokens: it would never join
    (stuck,) = s.audit()
    assert stuck[0] is broken[0] and "12 of its 10 prompt tokens" in stuck[1]
    assert broken[0].ending is not None and broken[0].ending.cause is Cause.FAILED
    turn(s)  # the rest of the turn: the other prefills and joins
    turn(s)  # the broken one leaves
    ended = finishes(s)
    assert ended[broken[0].id].reason is FinishReason.ERROR and ended[broken[0].id].error
    assert fine[0].status is RequestStatus.RUNNING and s.audit() == []


ARRIVAL = st.tuples(
    st.integers(0, 12),  # the turn it arrives at
    st.integers(1, 70),  # prompt tokens (one chunk or several)
    st.integers(1, 3),  # n
    st.integers(1, 12),  # max_tokens
    st.sampled_from([1, 100, 200]),  # its first token: prompts share prefixes
)


@settings(max_examples=150, deadline=None)
@given(
    max_running=st.integers(1, 4),
    budget=st.sampled_from([0, 100, 200]),
    cache=st.booleans(),
    arrivals=st.lists(ARRIVAL, min_size=1, max_size=10),
    rng=st.randoms(use_true_random=False),
)
def test_any_mix_of_arrivals_copies_cancellations_and_budgets_ends_every_request_once(
    max_running: int, budget: int, cache: bool, arrivals: list[tuple[int, ...]], rng: object
) -> None:
    """Driven as the engine's loop drives it, with rows ending on EOS and requests cancelled
    at random: every turn moves something on, no joiner is ever out of the audited states,
    and every copy of every request ends exactly once, as it was made to end."""
    import random

    assert isinstance(rng, random.Random)
    s = make_scheduler(
        max_running=max_running,
        max_queue=64,
        kv_budget_tokens=budget,
        prefix_cache_bytes=(1 << 20) if cache else 0,
    )
    admitted: list[Request] = []
    ended: dict[int, list[Finish]] = {}
    cancelled: set[int] = set()
    for tick in range(2000):
        for at, length, n, max_tokens, first in arrivals:
            if at == tick:
                admitted += admit(s, length=length, max_tokens=max_tokens, n=n, first=first)
        if tick > max(a[0] for a in arrivals) and s.idle:
            break
        for request in s.active():
            if rng.random() < 0.03:
                s.cancel(request)
                cancelled.add(request.id)
        moves, admitted_now = s.moves, bool(s.active())
        turn(s, lambda r: EOS if rng.random() < 0.08 else TOKEN)
        assert s.audit() == []
        assert s.moves > moves or not admitted_now, "a turn that ran nothing"
        for request, message in SENT.pop(s, []):
            if isinstance(message, Finish):
                ended.setdefault(request.id, []).append(message)
        for request in admitted:
            assert request.prefilled <= len(request.prompt_ids)
            assert len(request.output_ids) <= request.params.max_tokens
    assert s.idle and not s.table.running and not s.table.prefilling and not s.table.waiting
    for request in admitted:
        (finish,) = ended[request.id]
        if finish.reason is FinishReason.ABORT:
            assert request.id in cancelled
        elif finish.reason is FinishReason.STOP:
            assert request.output_ids[-1] == EOS
        else:
            assert finish.reason is FinishReason.LENGTH
            assert len(request.output_ids) == request.params.max_tokens


# ---- leaving: the prefix cache or the session ---------------------------------------------------


def test_a_leaving_row_goes_to_the_prefix_cache_and_its_session() -> None:
    s = make_scheduler(prefix_cache_bytes=1 << 20)
    session = SessionRequest("chat", Path("/sessions/chat.safetensors"))
    (saved,) = admit(s, length=20, session=session)
    (cached,) = admit(s, length=20, first=30)
    (cancelled,) = admit(s, length=20, first=60, session=session)
    turn(s, {saved.id: EOS, cached.id: EOS})
    s.cancel(cancelled)
    plan = turn(s).rebatch
    assert plan is not None and set(ids(plan.leaving)) == {saved.id, cached.id, cancelled.id}
    saves = [op for op in plan.ops if isinstance(op, SaveSession)]
    # the prefix cache took each prompt once it was prefilled, and it keeps prompts alone (a
    # reply's KV is a decode step's, not what a prefill of it computes): the rows leaving add
    # nothing to it, so the one with a session saves and its snapshot goes with the save
    assert [(op.row.id, op.drop) for op in saves] == [(saved.id, True)]
    assert plan.cache == ()
    assert saved.status is RequestStatus.SAVING and saved in s.saving
    assert cancelled.status is RequestStatus.FINISHED_ABORTED
    assert cached.status is RequestStatus.FINISHED_STOPPED
    prompts = {tuple(r.prompt_ids) for r in (saved, cached, cancelled)}
    held = {entry.tokens for entry in s.prefix._entries.values()}  # type: ignore[union-attr]
    assert held == prompts
    ended = finishes(s)
    assert saved.id not in ended  # it ends once its file is on disk
    assert finishes(s, s.record_saved(saved.id))[saved.id] == Finish(FinishReason.STOP)
    assert s.counters.sessions_saved == 1 and s.idle


def test_a_session_that_cannot_be_written_keeps_its_reply_and_says_so() -> None:
    s = make_scheduler()
    (request,) = admit(s, session=SessionRequest("x", Path("/s/x.safetensors")))
    (other,) = admit(s)
    turn(s, {request.id: EOS})
    turn(s)
    error = "session 'x' could not be saved (No space left on device)"
    finish = finishes(s, s.record_saved(request.id, error))[request.id]
    assert finish.reason is FinishReason.STOP and finish.error is None
    assert finish.session_error == "session 'x' could not be saved (No space left on device)"
    assert (s.counters.session_save_failures, s.counters.failed, s.counters.finished) == (1, 0, 1)
    assert other.status is RequestStatus.RUNNING


def test_a_session_written_before_its_rebatch_is_recorded_loses_no_other_rows_message() -> None:
    """The engine writes a session file while the device rebatches, so the file can be on disk
    before the rebatch that moved its row to SAVING is recorded: recording it then ends that
    request, and every other message of that record (the rows that left beside it) still
    reaches the routers."""
    s = make_scheduler()
    (other,) = admit(s)
    (saved,) = admit(s, session=SessionRequest("x", Path("/s/x.safetensors")))
    turn(s, {other.id: EOS, saved.id: EOS})
    plan = until_step(s)
    assert plan.rebatch is not None and set(ids(plan.rebatch.leaving)) == {other.id, saved.id}
    assert s.record_saved(saved.id) == ()  # (its row has not left yet)
    update(s, plan, answer(plan))
    ended = finishes(s)
    assert ended == {other.id: Finish(FinishReason.STOP), saved.id: Finish(FinishReason.STOP)}
    assert s.counters.sessions_saved == 1 and s.idle and not s.saving


def test_a_session_is_read_in_a_plan_of_its_own_and_its_chunk_starts_after_it() -> None:
    """The tokens a session file holds decide where the first chunk starts: the turn reads it
    first (LOAD), and plans the prefill once that is booked."""
    s = make_scheduler()
    held = tuple(range(1, 9))  # the first 8 of the prompt's 10 tokens
    session = SessionRequest("chat", Path("/s/chat.safetensors"), token_ids=held)
    (request,) = admit(s, session=session)
    plan = schedule(s)
    assert plan.phase is Phase.LOAD and plan.prefill is None and plan.decode is None
    (load,) = plan.loads
    assert load.row.id == request.id
    update(s, plan, StepOutcome(loads=(Loaded(held),)))
    plan = schedule(s)
    chunk = plan.prefill
    assert plan.phase is Phase.PREFILL and chunk is not None and not plan.loads
    assert (chunk.parent_id, chunk.parent_length) == (load.cache_id, 8)
    assert chunk.session_id == load.cache_id  # (dropped once the chunk is in)
    assert chunk.tokens == (9, 10) and s.counters.sessions_restored == 1
    update(s, plan, answer(plan))
    plan = until_step(s)  # the session's snapshot goes once its chunk is in
    assert DropCached((load.cache_id,)) in plan.ops
    assert plan.rebatch is not None and ids(plan.rebatch.order) == [request.id]


def test_a_session_read_for_a_chunk_never_planned_is_dropped() -> None:
    s = make_scheduler()
    session = SessionRequest("chat", Path("/s/chat.safetensors"), token_ids=tuple(range(1, 9)))
    (request,) = admit(s, session=session)
    plan = schedule(s)
    (load,) = plan.loads
    update(s, plan, StepOutcome(loads=(Loaded(session.token_ids or ()),)))
    s.cancel(request)  # before its first chunk
    plan = schedule(s)
    assert plan.prefill is None and plan.phase is Phase.STEP
    update(s, plan, answer(plan))
    plan = schedule(s)  # the next turn: it leaves, and what it read goes
    assert DropCached((load.cache_id,)) in plan.ops
    update(s, plan, answer(plan))
    assert finishes(s)[request.id].reason is FinishReason.ABORT and s.idle


def test_plans_and_outcomes_are_frozen_and_share_no_list_with_the_scheduler() -> None:
    s = make_scheduler(max_running=2)
    admit(s), admit(s)
    turn(s)
    plan = until_step(s)
    assert plan.decode is not None and isinstance(plan.ops, tuple)
    rows = plan.decode.rows
    assert isinstance(rows, tuple) and isinstance(s.table.running, tuple)
    update(s, plan, answer(plan, {rows[0].id: EOS}))
    turn(s)  # the first row leaves the table's running rows; the plan keeps both
    assert plan.decode.rows == rows and len(rows) == 2 and ids(s.table.running) == ids(rows[1:])
    with pytest.raises(AttributeError):
        plan.decode = None  # type: ignore[misc]


# ---- cancellation in every state ----------------------------------------------------------------


def test_cancelled_while_waiting_is_never_prefilled() -> None:
    s = make_scheduler(max_running=1)
    admit(s)
    (waiting,) = admit(s)
    turn(s)
    s.cancel(waiting)
    s.cancel(waiting)  # idempotent
    turn(s)
    assert finishes(s)[waiting.id].reason is FinishReason.ABORT
    assert waiting.prefilled == 0 and waiting.snapshot_id is None
    assert s.counters.cancelled == 1 and s.counters.finished == 0 and not s.table.waiting


def test_cancelled_while_prefilling_leaves_without_joining() -> None:
    s = make_scheduler()
    admit(s)
    turn(s)
    (joiner,) = admit(s, length=200)
    plan = turn(s)  # a row decodes: the joiner's chunks ride the steps
    assert plan.decode is not None and plan.prefill is None
    (chunk,) = plan.decode.rides
    assert chunk.row.id == joiner.id and not chunk.last and len(chunk.tokens) < 200
    s.cancel(joiner)
    plan = schedule(s)  # it leaves: its partial snapshot is dropped
    assert DropSnapshots((chunk.snapshot_id,)) in plan.ops
    update(s, plan, answer(plan))
    assert joiner.status is RequestStatus.FINISHED_ABORTED and not s.table.prefilling


def test_cancelled_while_running_leaves_at_the_next_rebatch() -> None:
    s = make_scheduler()
    (stays,) = admit(s)
    (goes,) = admit(s)
    turn(s)
    s.cancel(goes)
    assert s.stats(True).running == 1  # a leaving row no longer counts
    plan = turn(s).rebatch
    assert plan is not None and ids(plan.leaving) == [goes.id] and ids(plan.order) == [stays.id]
    assert finishes(s)[goes.id].reason is FinishReason.ABORT
    assert s.counters.cancelled == 1 and s.counters.finished == 0


def test_cancelled_while_saving_is_counted_once() -> None:
    s = make_scheduler()
    (request,) = admit(s, session=SessionRequest("x", Path("/s/x.safetensors")))
    turn(s, {request.id: EOS})
    turn(s)
    assert request.status is RequestStatus.SAVING
    s.cancel(request)
    s.record_saved(request.id)
    assert request.status is RequestStatus.FINISHED_ABORTED
    assert (s.counters.cancelled, s.counters.finished) == (1, 0)


def test_cancelling_a_finished_request_changes_nothing() -> None:
    s = make_scheduler()
    (request,) = admit(s, max_tokens=1)
    turn(s)  # its first token ends it: it never joins
    assert request.status is RequestStatus.FINISHED_LENGTH
    s.cancel(request)
    assert request.ending is not None and request.ending.cause is Cause.LENGTH
    assert (s.counters.cancelled, s.counters.finished) == (0, 1)


def test_end_all_fails_every_active_request_but_keeps_cancellations() -> None:
    s = make_scheduler(max_running=1)
    (running,) = admit(s)
    (waiting,) = admit(s)
    (gone,) = admit(s)
    turn(s)
    s.cancel(gone)
    ended = finishes(s, s.end_all(Cause.FAILED, "model 'm' failed"))
    assert ended[running.id] == Finish(FinishReason.ERROR, "model 'm' failed")
    assert ended[waiting.id].reason is FinishReason.ERROR
    assert ended[gone.id].reason is FinishReason.ABORT
    assert (s.counters.failed, s.counters.cancelled) == (2, 1)


def test_joiners_ride_one_step_together_oldest_first_and_join_in_one_rebatch() -> None:
    """A burst of arrivals while a row decodes: their chunks share each step's budget, oldest
    first, so they join together rather than one by one while the batch decodes half empty."""
    s = make_scheduler(max_running=8)
    admit(s)
    turn(s)
    joiners = [admit(s, length=10 + i)[0] for i in range(3)]
    budget = s.ride_budget(3)
    assert budget == 3 * s.ride_budget(1)  # nothing measured yet: the least chunk each
    plan = turn(s)
    assert plan.decode is not None and [c.row.id for c in plan.decode.rides] == ids(joiners)
    assert s.counters.riding_chunks == 3 and all(j.prefilled == len(j.prompt_ids) for j in joiners)
    rebatch = turn(s).rebatch
    assert rebatch is not None and ids(rebatch.order[1:]) == ids(joiners)
    # measured costs: the budget is chunk_steps of a step per joiner, never past max_chunk
    s.costs.step_seconds, s.costs.ride_seconds_per_token = 0.1, 0.001
    per_joiner = s.ride_budget(1)
    assert per_joiner == int(s.costs.chunk_steps * 100)
    assert s.ride_budget(2) == 2 * per_joiner
    assert s.ride_budget(1000) == s.costs.max_chunk
    s.costs.ride_seconds_per_token = 1.0  # a chunk costing far more than a step: the least each
    assert (s.ride_budget(1), s.ride_budget(3)) == (MIN_CHUNK, 3 * MIN_CHUNK)


def test_a_request_joining_while_its_rebatch_runs_stays_counted_and_can_be_ended() -> None:
    """Between the plan of a join and its booking (the device extracts and assembles), the
    joiner belongs to no list of its own: it must still count as running, keep the scheduler
    from looking idle, and be ended by end_all (a drain that times out then)."""
    s = make_scheduler(max_running=2)
    (first,) = admit(s)
    turn(s)
    (second,) = admit(s)
    while second.prefilled < len(second.prompt_ids):
        turn(s)  # its prompt rides the decode steps of the live row
    plan = schedule(s)  # the device is now rebatching: nothing is booked yet
    rebatch = plan.rebatch
    assert rebatch is not None and second.id in ids(rebatch.order)
    assert s.stats(healthy=True).running == 2
    assert not s.idle and {first, second} <= set(s.active())
    ended = finishes(s, s.end_all(Cause.ABORTED, "the server is shutting down"))
    assert set(ended) == {first.id, second.id}
    update(s, plan, answer(plan))  # the ended rows leave at the next rebatch
    assert s.table.running == (first, second)
    turn(s)
    assert s.idle and s.stats(healthy=True).running == 0


# ---- the core is pure ---------------------------------------------------------------------------

CORE = (
    *("request", "admission", "lifecycle", "scheduler", "live_batch", "prefill", "budget"),
    *("costs", "counters", "plans", "table", "prefix_cache", "types"),
)


def test_the_engine_core_runs_with_torch_anyio_and_transformers_unimportable() -> None:
    """The scheduler core is imported and drives a request to its end in a process where
    importing torch, anyio or transformers fails."""
    code = f"""
import sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "anyio", "transformers"):
            raise ImportError(f"{{name}} is not importable here")

sys.meta_path.insert(0, Refuse())
for module in {CORE!r}:
    __import__(f"neuronpy.engine.{{module}}")
from neuronpy.engine.plans import (
    DecodeOutcome, PrefillOutcome, RebatchOutcome, Sampled, StepOutcome
)
from neuronpy.engine.scheduler import Scheduler
from neuronpy.engine.speculative import SpeculativeConfig
from neuronpy.engine.types import SamplingParams

s = Scheduler(name="m", max_running=2, max_queue=2, queue_timeout=0,
              context_len=64, vocab_size=32)
params = SamplingParams(max_tokens=3)
(request,) = s.admit(s.validate([1, 2, 3], params), [params], frozenset())
while not request.done:
    plan = s.schedule()
    s.update(plan, StepOutcome(
        prefill=plan.prefill and PrefillOutcome((Sampled(5),)),
        rebatch=plan.rebatch and RebatchOutcome(None),
        decode=plan.decode and DecodeOutcome((Sampled(6),)),
    ))
assert request.output_ids == [5, 6, 6], request.output_ids
assert not {{"torch", "anyio", "transformers"}} & set(sys.modules)
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=ROOT)


def test_retry_after_is_when_a_row_frees_at_the_measured_step_time() -> None:
    s = make_scheduler(max_running=2, max_queue=1)
    assert s.retry_after() == 1.0  # nothing measured yet
    admit(s, max_tokens=40), admit(s, max_tokens=100)
    for _ in range(10):
        turn(s)
        s.counters.timing["forward"] += 0.25  # each step took a quarter of a second
    # 11 tokens each (the prefill's and 10 steps'): 29 and 89 to go. A refused request waits
    # behind the queue (empty): the first row frees in 29 steps
    assert s.retry_after() == pytest.approx(29 * 0.25)
    admit(s, max_tokens=40)  # the queue's one place: now the second row is the one to wait for
    assert s.retry_after() == pytest.approx(89 * 0.25)
    # what requests have been writing bounds what a row is likely to still write
    s.lifecycle._output_tokens = 20.0
    assert s.retry_after() == pytest.approx(9 * 0.25)
    # never past a minute, however long the rows may still write
    s.lifecycle._output_tokens = 0.0
    s.counters.timing["forward"] += 1000.0  # (steps of a second each, say)
    assert s.retry_after() == 60.0


# ---- speculative decoding -------------------------------------------------------------------


def test_verify_steps_book_several_tokens_and_trim_the_rejected_columns_next() -> None:
    s = make_scheduler(speculative=SpeculativeConfig("ngram", num_tokens=4, lookup_min=1))
    prompt = s.validate([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=6))
    (a,) = s.admit(prompt, [SamplingParams(max_tokens=6)], frozenset({EOS}), now=0.0)
    prompt = s.validate([1, 2, 3], SamplingParams(max_tokens=6))
    (b,) = s.admit(prompt, [SamplingParams(max_tokens=6)], frozenset({EOS}), now=0.0)
    step = until_step(s)  # both prefilled, first token TOKEN (7): a's context ends 5 6 7
    plan = step.decode
    assert plan is not None and step.rebatch is not None
    drafts, proposal = lookup(s, plan)
    assert drafts[0] == (8, 5, 6, 7) and drafts[1] == () and plan.trim == ()
    # a: two drafts stand, then its own 3; b: its one token
    verified = DecodeOutcome(
        (Sampled(3, accepted=((8, None), (5, None))), Sampled(9)),
        drafted=(4, 0),
        proposed=(proposal,),
    )
    update(s, step, answer(step, decode=verified))
    assert a.output_ids == [7, 8, 5, 3] and b.output_ids == [7, 9]
    assert s.stats(True).spec_accepted_tokens == 2 and s.stats(True).spec_draft_tokens == 4
    step = until_step(s)
    nxt = step.decode
    assert nxt is not None and step.rebatch is None
    assert nxt.trim == (2, 0)  # a fed 5 tokens, keeps 3 (7, 8, 5: its last emitted is not fed)
    _, proposal = lookup(s, nxt)
    answered = DecodeOutcome((Sampled(6), Sampled(9)), proposed=(proposal,))
    update(s, step, answer(step, decode=answered))  # a: 7 8 5 3 6
    step = until_step(s)
    third = step.decode
    assert third is not None and third.trim == ()  # the trim is given once
    # drafts never run past max_tokens (6): a has 5 tokens, so its step may emit one: no draft
    # (b, whose reply repeats 9, drafts 9 again)
    drafts, proposal = lookup(s, third)
    assert drafts == ((), (9,)) and [r.row for r in third.proposals[0].rows] == [1]
    # a's draft is rejected (EOS instead: it ends); b ends too
    answered = DecodeOutcome((Sampled(EOS), Sampled(EOS)), proposed=(proposal,))
    update(s, step, answer(step, decode=answered))
    assert a.done and a.output_ids == [7, 8, 5, 3, 6, EOS] and b.done


def test_a_rebatch_after_a_verify_step_carries_the_trim() -> None:
    s = make_scheduler(speculative=SpeculativeConfig("ngram", num_tokens=3, lookup_min=1))
    prompt = s.validate([4, 7, 4, 7, 4], SamplingParams(max_tokens=20))
    (a,) = s.admit(prompt, [SamplingParams(max_tokens=20)], frozenset({EOS}), now=0.0)
    (b,) = s.admit(prompt, [SamplingParams(max_tokens=20)], frozenset({EOS}), now=0.0)
    step = until_step(s)  # first tokens 7: contexts end 4 7 4 7 4 7
    plan = step.decode
    assert plan is not None
    drafts, proposal = lookup(s, plan)
    assert drafts == ((4, 7), (4, 7))  # what followed "4 7 4 7" before: all there is
    # a: one draft stands then 9; b: the first draft is rejected, and b ends (EOS)
    outcome = DecodeOutcome(
        (Sampled(9, accepted=((4, None),)), Sampled(EOS)), drafted=(2, 2), proposed=(proposal,)
    )
    update(s, step, answer(step, decode=outcome))
    assert b.done and a.output_ids == [7, 4, 9]
    step = until_step(s)  # b leaves: the survivors are extracted after the trim
    rebatch = step.rebatch
    assert rebatch is not None and rebatch.extract and rebatch.trim == (1, 2)
    assert step.decode is not None and step.decode.trim == ()  # the rebatch took it
    # and prompt lookup lets b's index go
    assert ReleaseDrafts("ngram", (b.id,)) in step.ops


# ---- drafting: what the proposers are asked, what they hold -------------------------------------


def drafting(num_tokens: int = 4, ratio: float = 0.0, **kw: object) -> Scheduler:
    """A scheduler whose requests draft with a draft model (its KV `ratio` of the model's)."""
    spec = SpeculativeConfig("draft", num_tokens=num_tokens, draft_kv_ratio=ratio)
    return make_scheduler(speculative=spec, **kw)


def test_a_draft_job_carries_only_what_is_new_and_rolls_back_what_was_rejected() -> None:
    s = drafting(num_tokens=4)
    (a,) = admit(s, length=5, max_tokens=40)  # prompt 1..5
    step = until_step(s)
    plan = step.decode
    assert plan is not None
    (proposals,) = plan.proposals
    (row,) = proposals.rows
    # new to the draft model: its whole context, the first token (TOKEN) last
    assert proposals.method == "draft" and row.fresh and row.length == 4
    assert row.tokens == (1, 2, 3, 4, 5, TOKEN) and row.rollback == 0 and row.context == 6
    # it drafts 4 (feeding itself 3 of them); the target accepts 2, then writes 9
    answered = DecodeOutcome(
        (Sampled(9, accepted=((11, None), (12, None))),),
        drafted=(4,),
        proposed=(Proposal(((11, 12, 13, 14),), (6 + 3,)),),
    )
    update(s, step, answer(step, decode=answered))
    assert a.output_ids == [TOKEN, 11, 12, 9]
    step = until_step(s)
    assert step.decode is not None
    (row,) = step.decode.proposals[0].rows
    # it keeps the context and the 2 drafts that stood; the third goes; it is fed 9 alone
    assert not row.fresh and row.rollback == 1 and row.tokens == (9,) and row.context == 9
    # every draft stands: it lacks its last draft (never fed to itself) and the target's token
    answered = DecodeOutcome(
        (Sampled(8, accepted=((21, None), (22, None), (23, None), (24, None))),),
        drafted=(4,),
        proposed=(Proposal(((21, 22, 23, 24),), (9 + 3,)),),
    )
    update(s, step, answer(step, decode=answered))
    step = until_step(s)
    assert step.decode is not None
    (row,) = step.decode.proposals[0].rows
    assert row.rollback == 0 and row.tokens == (24, 8) and row.context == 14


def test_a_draft_model_steps_every_row_it_holds_and_restarts_one_far_behind() -> None:
    from neuronpy.engine.drafting.planner import MAX_CATCH_UP

    s = drafting(num_tokens=2)
    a, b = admit(s, length=5, max_tokens=200)[0], admit(s, length=5, max_tokens=200)[0]
    step = until_step(s)
    assert step.decode is not None
    assert [r.key for r in step.decode.proposals[0].rows] == [a.id, b.id]
    update(s, step, answer(step))  # (nothing drafted: each holds its context)
    # b stops drafting (its drafts stopped paying) and a drafts on: b rides a's draft job to
    # keep its draft KV up to date
    b.speculation.length.rate = 0.0  # type: ignore[union-attr]
    step = until_step(s)
    assert step.decode is not None
    rows = {r.key: r for r in step.decode.proposals[0].rows}
    assert rows[a.id].length == 2 and rows[b.id].length == 0 and rows[b.id].tokens == (TOKEN,)
    update(s, step, answer(step))
    # a row whose draft KV lags its context too far starts again from its whole context
    b.speculation.kept -= MAX_CATCH_UP  # type: ignore[union-attr]
    step = until_step(s)
    assert step.decode is not None
    row = {r.key: r for r in step.decode.proposals[0].rows}[b.id]
    assert row.fresh and row.rollback == 0 and len(row.tokens) == b.total_tokens


def test_a_row_that_leaves_or_is_preempted_lets_its_draft_kv_go() -> None:
    s = drafting(num_tokens=2, max_running=2)
    a, b = admit(s, max_tokens=200)[0], admit(s, max_tokens=200)[0]
    update(s, step := until_step(s), answer(step, {a.id: EOS}))  # a ends on its first step
    step = until_step(s)  # a leaves: the draft model lets its KV go, b's stays
    assert step.rebatch is not None and ids(step.rebatch.leaving) == [a.id]
    assert [op for op in step.ops if isinstance(op, ReleaseDrafts)] == [
        ReleaseDrafts("draft", (a.id,))
    ]
    assert a.speculation.held == 0 and b.speculation.held > 0  # type: ignore[union-attr]
    update(s, step, answer(step))
    # b is preempted (a KV budget, by hand): its draft KV goes with its row
    s._preempt(b)
    step = until_step(s)
    assert ReleaseDrafts("draft", (b.id,)) in step.ops and not b.speculation.held  # type: ignore[union-attr]


def test_the_draft_models_kv_counts_in_the_kv_budget() -> None:
    """A row that drafts with a draft model needs its draft KV too (its context and the drafts
    it feeds itself, at what a token of it costs in the model's KV): two rows of 30 tokens fit
    a budget of 70 without it, and not with a draft KV half the model's."""
    for ratio, together in ((0.0, True), (0.5, False)):
        s = drafting(num_tokens=4, ratio=ratio, kv_budget_tokens=70)
        a, b = admit(s, length=30)[0], admit(s, length=30)[0]
        assert a.kv_need == 31 + (0 if not ratio else 17)  # ceil(0.5 * (30 + 4))
        update(s, step := until_step(s), answer(step))
        assert (b in s.table.running) is together and a in s.table.running
        if not together:
            assert b in s.table.waiting or b in s.table.prefilling
    # the KV held counts it too, once the draft model holds the row
    s = drafting(num_tokens=4, ratio=0.5)
    (a,) = admit(s, length=30)
    step = until_step(s)
    update(s, step, answer(step))  # (its proposer holds its context: 31 tokens)
    assert s.kv_held() == a.total_tokens + 16  # ceil(0.5 * 31)
