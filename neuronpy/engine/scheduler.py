"""The scheduler: every decision of the engine, as plain data in and plans out.

It never awaits and never touches a tensor: the engine loop asks it for a plan, the runner runs
the plan's jobs on the device worker, and the loop books the results back here. Events for the
routers and housekeeping jobs (drops, offloads, session saves) collect in `outbox` and `ops`,
which the loop empties after each call.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Sequence

from neuronpy.engine.admission import check_prompt
from neuronpy.engine.budget import fit
from neuronpy.engine.costs import StepCosts, ema
from neuronpy.engine.counters import Counters, EngineStats
from neuronpy.engine.planner import RowView, plan_step
from neuronpy.engine.plans import (
    AssemblePlan,
    CacheOutcome,
    DecodeOutcome,
    DecodePlan,
    DropSnapshots,
    Offload,
    Op,
    PrefillOutcome,
    PrefillPlan,
    RebatchPlan,
    Sampled,
    SaveSession,
)
from neuronpy.engine.prefill import Prefills
from neuronpy.engine.prefix_cache import PrefixIndex
from neuronpy.engine.request import (
    Cause,
    Ending,
    Finish,
    Request,
    RequestStatus,
    RouterMessage,
)
from neuronpy.engine.speculative import (
    Speculation,
    SpeculativeConfig,
    cut_at_stop,
    share_budget,
)
from neuronpy.engine.types import SamplingParams, SessionRequest, TokenLogprob
from neuronpy.errors import QueueFullError

# the most Retry-After says: past it a client is better off with its own backoff (and a row
# whose max_tokens is the whole context, before any reply has been measured, is no estimate)
MAX_RETRY_AFTER = 60.0
# what a request found unable to progress is told (the engine's log has the details)
STUCK = "the request could not make progress (an internal error of the server); retry it"


class Scheduler:
    """Admission, queue deadlines, the KV budget, prefill and rebatch plans, the prefix index."""

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
    ) -> None:
        """`queue_timeout` 0: no deadline; `kv_budget_tokens` 0: no budget;
        `prefix_cache_bytes` 0: no prefix cache."""
        self.name = name
        self.max_running = max_running
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.kv_budget_tokens = kv_budget_tokens
        self.costs = StepCosts(chunk_steps, prefill_chunk)
        self.counters = Counters()
        self.waiting: deque[Request] = deque()
        self.joining: list[Request] = []  # hold a row; being prefilled
        self.running: list[Request] = []  # row order of the live batch
        # prefilled joiners between a rebatch's plan and its booking (the device is at work)
        self.entering: list[Request] = []
        self.saving: set[Request] = set()  # ended; their session file being written
        self.has_batch = False
        self.outbox: list[tuple[Request, RouterMessage]] = []  # to the routers, in order
        self.ops: list[Op] = []  # housekeeping jobs, to run before the next plan's
        self._request_ids = itertools.count()
        self._kv_ids = itertools.count()  # snapshots, cache entries, clones, sessions read
        self.prefix = PrefixIndex(prefix_cache_bytes) if prefix_cache_bytes else None
        self.prefills = Prefills(self.prefix, self.counters, self.ops, self._kv_ids, self.finish)
        self._preempting: list[Request] = []  # rows leaving the live batch at the next rebatch
        self._riding: list[Request] = []  # joiners whose next chunks ride the next step
        self._padding_columns = 0  # of the live batch
        self._request_seconds = 0.0  # moving average of a request's time, for Retry-After
        self._output_tokens = 0.0  # moving average of a finished request's tokens (the same)
        # per row of the live batch: decode columns the last verify step gave back, for the
        # next job that reads the batch (decode or extract) to trim first
        self._trim: tuple[int, ...] = ()
        self.speculative = speculative or SpeculativeConfig()
        self._ended = 0  # requests finished, or gone to write their session

    @property
    def moves(self) -> int:
        """How often the scheduler has moved on: chunks prefilled, rebatches, decode steps,
        requests ended. A turn of the engine's loop that leaves it unchanged ran nothing."""
        c = self.counters
        return c.prefill_chunks + c.rebatches + c.decode_steps + self._ended

    # ---- admission ----------------------------------------------------------------------------

    def active(self) -> list[Request]:
        """Every request admitted and not yet ended (saving ones aside)."""
        return [*self.running, *self.entering, *self.joining, *self.waiting]

    @property
    def idle(self) -> bool:
        return not self.active() and not self.saving

    def rows(self) -> list[dict[str, object]]:
        """Each admitted request as the batch view shows it: its id, state (queued,
        prefilling, decoding, preempted), prompt tokens, tokens so far and max_tokens."""
        out: list[dict[str, object]] = []
        for r in self.active():
            if r.status is RequestStatus.WAITING:
                state = "preempted" if r.preemptions else "queued"
            elif r.status is RequestStatus.PREFILLING:
                state = "prefilling"
            else:
                state = "decoding"
            out.append(
                {
                    "id": r.id,
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
    ) -> list[Request]:
        """Queues one request per entry of `copies` (a validated prompt's n completions), or
        raises QueueFullError when they do not fit in max_in_flight + max_queue."""
        n = len(copies)
        if len(self.active()) + n > self.max_running + self.max_queue:
            self.counters.rejected += 1
            raise QueueFullError(
                f"model {self.name!r} is at capacity ({self.max_running} running, "
                f"{self.max_queue} queued); retry later",
                retry_after=self.retry_after(),
            )
        arrived = time.monotonic() if now is None else now
        group: list[Request] = []
        for index, params in enumerate(copies):
            request = Request(
                next(self._request_ids), prompt, params, stop_ids, arrived, index, group, session
            )
            method = self.speculation_method(params)
            if method != "off":
                request.speculation = Speculation(self.speculative, method)
            group.append(request)
            self.waiting.append(request)
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
            for r in self.running
            if not r.done
        )
        ahead = len(self.waiting) + 1  # the refused request would wait behind the queue
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

    def expire(self, now: float | None = None) -> None:
        """Requests that waited past queue_timeout for a row end now, never prefilled."""
        if not self.queue_timeout or not self.waiting:
            return
        now = time.monotonic() if now is None else now
        # decided for every request before any ends: the copies of one request (n > 1) end
        # together or not at all
        expired = [
            r
            for r in self.waiting
            if now - r.arrived_at > self.queue_timeout
            # cancelled: dropped at the next join; preempted, or a copy of a request that has
            # started: it waits behind its own request's rows, not for a first row
            and not r.done
            and not any(copy.started for copy in r.group)
        ]
        for request in expired:
            self.waiting.remove(request)
            self.counters.timed_out += 1
            request.end(
                Cause.TIMED_OUT,
                f"the request waited {now - request.arrived_at:.1f} s for model {self.name!r} "
                f"without getting a row (queue_timeout {self.queue_timeout:g} s); retry later",
            )
            self.finish(request)

    # ---- joining: who gets a row, who is preempted --------------------------------------------

    def join(self) -> None:
        """Requests ended while queued leave; the oldest waiting take the free rows (within the
        KV budget, preempting newer rows if that makes room); joiners that ended leave."""
        self._riding = []
        self.joining = [r for r in self.joining if not self._leave_if_done(r)]  # (rows freed)
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
        if request.snapshot_id is not None:
            self.ops.append(Offload((request.snapshot_id,)))
        self._requeue(request)

    def _requeue(self, request: Request) -> None:
        """A preempted request waits again, in arrival order: before every newer request."""
        request.status = RequestStatus.WAITING
        at = next((i for i, w in enumerate(self.waiting) if w.id > request.id), len(self.waiting))
        self.waiting.insert(at, request)

    def _leave_if_done(self, request: Request) -> bool:
        """A joiner that ended before joining (first token EOS, cancelled) drops its snapshot
        (or saves it to its session) and finishes."""
        if not request.done:
            return False
        sid, request.snapshot_id = request.snapshot_id, None
        if sid is not None and self._saves_session(request):
            self.ops.append(self._save(request, sid, drop=True))
            return True
        if sid is not None:
            self.ops.append(DropSnapshots((sid,)))
        self.finish(request)
        return True

    # ---- prefill ------------------------------------------------------------------------------

    def to_prefill(self) -> list[Request]:
        """Joiners to prefill whole, each in a forward of its own: nobody waits on a decode
        step. While rows decode, the joiners' chunks ride the steps instead (`riding`)."""
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

    def audit(self) -> list[tuple[Request, str]]:
        """The invariant the engine checks on every turn of its loop: a joiner prefills (its
        own prompt, or a copy's whose last chunk fills it), or has its whole prompt and joins
        at the next rebatch, or has ended and leaves at the next join. A joiner in none of
        these states is a bug that would hold its row forever: it ends now (failed, alone),
        and comes back with what was wrong with it, for the engine to log."""
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
        """When a turn of the engine's loop moved nothing on (`moves`) while requests are
        admitted (nothing can progress: a bug), every one of them ends now (failed), for the
        engine to log, rather than wait forever on a loop that spins."""
        stuck = [r for r in self.active() if not r.done]
        for request in stuck:
            request.end(Cause.FAILED, STUCK)
        return stuck

    def riding(self) -> list[Request]:
        """The joiners, oldest first, whose next chunks may ride the next decode step (they
        share `ride_budget`): those that still have prompt to prefill."""
        rides, self._riding = self._riding, []
        return [r for r in rides if not r.done and r.prefilled < len(r.prompt_ids)]

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
            self._accept(request, sampled)

    # ---- rebatch: extract the survivors, assemble again -----------------------------------------

    def plan_rebatch(self) -> RebatchPlan | None:
        """The join or leave to make now (None: the batch keeps its shape): joiners whose
        prompt is in join; rows that ended leave (their KV to the prefix cache or their session,
        or dropped); preempted rows become snapshots that wait."""
        joined = [r for r in self.joining if r.prefilled == len(r.prompt_ids)]
        self.joining = [r for r in self.joining if r not in joined]
        joined = [r for r in joined if not self._leave_if_done(r)]
        preempted, self._preempting = self._preempting, []
        preempted = [r for r in preempted if not r.done]  # those that ended just leave
        plan = plan_step([RowView(r.id, r.done) for r in self.running], [], self.max_running)
        rows = {r.id: r for r in self.running}
        leaving = tuple(rows[i] for i in plan.leaving)
        survivors = [rows[i] for i in plan.survivors if rows[i] not in preempted]
        if not leaving and not joined and not preempted:
            return None
        self.entering = joined
        self.counters.rebatches += 1
        extracted: tuple[Request, ...] = ()
        ids: tuple[int, ...] = ()
        cache: tuple[tuple[Request, int], ...] = ()
        ops: list[Op] = []
        if self.has_batch:
            kept = self.prefills.worth_caching(leaving)
            saved = [r for r in leaving if self._saves_session(r)]
            extracted = (*survivors, *preempted, *kept, *(r for r in saved if r not in kept))
            ids = tuple(next(self._kv_ids) for _ in extracted)
            for request, sid in zip(extracted, ids, strict=True):
                request.snapshot_id = sid
            cache = tuple((r, sid) for r, sid in zip(extracted, ids, strict=True) if r in kept)
            if preempted:
                ops.append(Offload(tuple(ids[len(survivors) : len(survivors) + len(preempted)])))
            for request in preempted:
                self._requeue(request)
            for request in saved:  # (the worker copies them before the prefix cache takes them)
                sid = ids[extracted.index(request)]
                ops.append(self._save(request, sid, drop=request not in kept))
            for request, _ in cache:
                request.snapshot_id = None  # it moves into the prefix cache
        trim, self._trim = self._trim, ()
        return RebatchPlan(
            tuple(self.running.index(r) for r in extracted),
            ids,
            tuple(ops),
            cache,
            leaving,
            (*survivors, *joined),
            extract=self.has_batch,
            trim=trim if self.has_batch else (),
        )

    def book_rebatch(self, plan: RebatchPlan, cached: CacheOutcome | None) -> AssemblePlan | None:
        """Indexes what the prefix cache took, ends the rows that left, and gives the new row
        order (None: no row is left)."""
        self.has_batch = False
        self.entering = []
        if cached is not None:
            for (request, sid), nbytes, length in zip(
                plan.cache, cached.nbytes, cached.lengths, strict=True
            ):
                # the row's KV holds the tokens fed so far: the last sampled one may not be
                fed = (*request.prompt_ids, *request.output_ids)[:length]
                self.prefills.index_entry(sid, fed, nbytes)
        for request in plan.leaving:
            if request.status is not RequestStatus.SAVING:
                self.finish(request)
        self.running = list(plan.order)
        if not self.running:
            return None
        return AssemblePlan(tuple(r.snapshot_id for r in self.running))  # type: ignore[misc]

    def book_assemble(self, padding_columns: int) -> None:
        self._padding_columns = padding_columns
        self.has_batch = True
        for request in self.running:
            request.status = RequestStatus.RUNNING
            request.snapshot_id = None  # moved into the live batch

    def add_time(self, kind: str, seconds: float) -> None:
        """Books time the engine spent: forward, prefill, rebatch or sampling."""
        self.counters.timing[kind] += seconds

    # ---- decode -------------------------------------------------------------------------------

    def plan_decode(self, rides: Sequence[PrefillPlan] = ()) -> DecodePlan:
        """The next step: every row's token, the drafts of rows that speculate (within what
        max_tokens and the context leave), the columns the last verify step gave back."""
        rows = tuple(self.running)
        tokens = tuple(r.next_token for r in rows)
        lengths = [self._draft_length(r) for r in rows]
        if sum(lengths) > self.speculative.step_budget:
            greedy = [r.params.greedy for r in rows]
            lengths = share_budget(lengths, greedy, self.speculative.step_budget)
        drafts = tuple(
            self._draft(r, k) if r.speculation and r.speculation.method == "ngram" else ()
            for r, k in zip(rows, lengths, strict=True)
        )
        model_drafts = tuple(
            k if r.speculation and r.speculation.method == "draft" else 0
            for r, k in zip(rows, lengths, strict=True)
        )
        trim, self._trim = self._trim, ()
        return DecodePlan(
            rows,
            tokens,  # type: ignore[arg-type]
            tuple(rides),
            drafts if any(drafts) else (),
            trim,
            model_drafts if any(model_drafts) else (),
        )

    def _draft_length(self, request: Request) -> int:
        """How many tokens the request drafts for its next step: none once it is done, never
        past max_tokens or the context (the step emits one token of its own besides)."""
        spec = request.speculation
        if spec is None or request.done:
            return 0
        room = min(
            request.params.max_tokens - len(request.output_ids),
            self.context_len - request.total_tokens,
        )
        return spec.length.next(room - 1)

    def _draft(self, request: Request, k: int) -> tuple[int, ...]:
        """Prompt-lookup drafts for the request's next step."""
        if not k:
            return ()
        assert request.speculation is not None
        drafts = request.speculation.propose(request.prompt_ids, request.output_ids, k)
        return cut_at_stop(drafts, request.stop_ids)

    def book_decode(self, plan: DecodePlan, outcome: DecodeOutcome) -> None:
        """One step's tokens, and the riding chunks' results."""
        c, seconds = self.counters, outcome.seconds
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
                self.book_prefill(ride, done, alone=False)
        rows = plan.rows
        alone = None
        if len(rows) == 1:
            alone = "no_peer"
            if self.joining or self.waiting:
                alone = "peer_prefilling" if self.joining else "peer_queued"
        kv = sum(r.total_tokens for r in rows)  # fed tokens, this step's included
        c.count_step(len(rows), self._padding_columns, kv, self.kv_held(), alone)
        if not outcome.drafted:
            for request, sampled in zip(rows, outcome.tokens, strict=True):
                self._accept(request, sampled)
            return
        trim = []
        for request, sampled, drafted in zip(rows, outcome.tokens, outcome.drafted, strict=True):
            taken = self._accept(request, sampled)
            # the row's KV keeps its fed token and the drafts before its last emitted token
            trim.append(drafted + 1 - max(1, taken))
            if drafted:
                accepted = len(sampled.accepted)
                c.spec_verify_rows += 1
                c.spec_draft_tokens += drafted
                c.spec_accepted_tokens += accepted
                c.spec_emitted_tokens += taken
                if request.speculation is not None:
                    request.speculation.length.observe(drafted, accepted)
        self._trim = tuple(trim) if any(trim) else ()

    def _accept(self, request: Request, sampled: Sampled) -> int:
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
        return taken

    def _accept_one(self, request: Request, token: int, logprob: TokenLogprob | None) -> None:
        """Records a sampled token, hands it to the router, and decides EOS / length."""
        request.output_ids.append(token)
        request.next_token = token
        self.counters.generated_tokens += 1
        self.outbox.append((request, token if logprob is None else logprob))
        if token in request.stop_ids:
            request.end(Cause.STOP)
        elif (
            len(request.output_ids) >= request.params.max_tokens
            or request.total_tokens >= self.context_len
        ):
            request.end(Cause.LENGTH)

    def kv_held(self) -> int:
        """Tokens of KV the running rows (those not leaving) and the joiners hold now."""
        running = sum(r.total_tokens for r in (*self.running, *self.entering) if not r.done)
        return running + sum(r.prefilled for r in self.joining)

    # ---- ending -------------------------------------------------------------------------------

    def finish(self, request: Request, session_error: str | None = None) -> None:
        """Ends a request whose end is decided: its final message to the router, the counters.
        `session_error`: why its session could not be saved (the reply itself stands)."""
        if request.status.finished:
            return
        assert request.ending is not None
        if request.status is RequestStatus.WAITING and request.snapshot_id is not None:
            # a copy of an n > 1 request cloned while it waited, or a preempted one
            self.ops.append(DropSnapshots((request.snapshot_id,)))
            request.snapshot_id = None
        ending = request.ending
        cause, reason = ending.cause, ending.cause.reason
        request.status = RequestStatus.finished_with(reason)
        self._ended += 1
        self.outbox.append((request, Finish(reason, ending.error, session_error, ending.param)))
        if cause is Cause.FAILED:
            self.counters.failed += 1
        elif cause not in (Cause.CANCELLED, Cause.TIMED_OUT):  # (counted when they happened)
            self.counters.finished += 1
            elapsed = time.monotonic() - request.arrived_at
            self._request_seconds = ema(self._request_seconds, elapsed)
            self._output_tokens = ema(self._output_tokens, len(request.output_ids))

    def end_all(self, cause: Cause, error: str | None = None) -> None:
        """Ends every admitted request now with `cause` (shutdown, drain, a fault), whatever
        was decided before but a cancellation. Their rows and snapshots go with the next
        rebatch, or with the worker."""
        for request in self.active():
            if request.status.finished:
                continue
            if request.ending is None or request.ending.cause is not Cause.CANCELLED:
                request.ending = Ending(cause, error)
            self.finish(request)

    def clear(self) -> None:
        """After a fault: nothing is running, joining or waiting any more."""
        self.running.clear()
        self.entering.clear()
        self.joining.clear()
        self.waiting.clear()
        self.ops.clear()
        self.has_batch = False
        self._trim = ()

    def _saves_session(self, request: Request) -> bool:
        """Whether an ended request's KV goes to its session: it ended on its own and asked."""
        session, ending = request.session, request.ending
        return bool(session and session.save and ending and ending.cause.on_its_own)

    def _save(self, request: Request, snapshot_id: int, *, drop: bool) -> SaveSession:
        """The request ends once its KV is in its session file (book_saved)."""
        assert request.session is not None
        request.status = RequestStatus.SAVING
        request.snapshot_id = None
        self.saving.add(request)
        self._ended += 1
        session = request.session
        return SaveSession(request, snapshot_id, session.save_path or session.path, drop)

    def book_saved(self, request: Request, error: str | None = None) -> None:
        """Its session file is on disk, or could not be written: the request still ends as it
        ended (its reply is the user's), and says so."""
        self.saving.discard(request)
        if error is None:
            self.counters.sessions_saved += 1
        else:
            self.counters.session_save_failures += 1
        self.finish(request, session_error=error)

    # ---- stats --------------------------------------------------------------------------------

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
            live_batch_size=len(self.running) if self.has_batch else 0,
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
