"""The runner: turns the scheduler's plans into device worker jobs and awaits every one of them."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import anyio
import torch

from neuronpy.arch.kv import DEFAULT_HEADROOM
from neuronpy.engine.drafting.drafter import Drafter
from neuronpy.engine.drafting.model import DraftModelProposer
from neuronpy.engine.drafting.ngram import NgramProposer
from neuronpy.engine.drafting.proposer import Proposer
from neuronpy.engine.grammar import GrammarError, Matcher
from neuronpy.engine.plans import (
    CacheOutcome,
    DecodeOutcome,
    DecodePlan,
    DropCached,
    DropSnapshots,
    Loaded,
    LoadSession,
    Offload,
    Op,
    PrefillOutcome,
    PrefillPlan,
    RebatchOutcome,
    RebatchPlan,
    ReleaseDrafts,
    RowRef,
    Sampled,
    SaveSession,
    StepOutcome,
    StepPlan,
)
from neuronpy.engine.sampling import Sampler, sample_rows, serial_ops_here, verify_rows
from neuronpy.engine.speculative import SpeculativeConfig
from neuronpy.engine.types import TokenLogprob
from neuronpy.errors import WorkerError
from neuronpy.worker.jobs import (
    AssembleKvBatch,
    AssembleResult,
    CacheKvSnapshots,
    CacheResult,
    DropCachedKv,
    DropKvSnapshot,
    ExtractKvRows,
    ForwardLogitsBatch,
    ForwardResult,
    Job,
    LoadKvSnapshot,
    LoadResult,
    OffloadKv,
    Prefill,
    PrefillResult,
    SaveKvSnapshot,
    SaveResult,
    WorkerStats,
    WorkerStatsResult,
)
from neuronpy.worker.session_files import SessionFileError
from neuronpy.worker.worker import DeviceWorker

log = logging.getLogger(__name__)
T = TypeVar("T")

# a session's save is recorded once its file is on disk: (request id, None) or (id, error)
OnSaved = Callable[[int, str | None], None]
Spawn = Callable[[Callable[[], Awaitable[None]], str], None]


async def result_of(fut: Future[T]) -> T:
    """A worker job's result. On asyncio the worker's completion wakes the event loop itself
    (a thread waiting on the future in between cost every job one more thread hop, and one more
    turn at the GIL beside the worker); elsewhere a thread waits. Cancelling the wait leaves
    the job running, as the worker's jobs must."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # another event loop (trio)
        return await anyio.to_thread.run_sync(fut.result, abandon_on_cancel=True)
    return await asyncio.shield(asyncio.wrap_future(fut))


class Runner:
    """Runs plans on one device worker. A job's error is raised where that job is awaited, so
    the engine knows which job failed; each request's sampler lives here, by request id, from
    `add_sampler` to `drop_sampler`."""

    def __init__(
        self,
        worker: DeviceWorker,
        *,
        fingerprint: str,
        session_metadata: Callable[[], Mapping[str, str]],
        on_saved: OnSaved,
        spawn: Spawn,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        """`speculative`: how prompt lookup looks (the draft model drafts where the worker
        has one)."""
        self.worker = worker
        self.fingerprint = fingerprint
        self.samplers: dict[int, Sampler] = {}
        spec = speculative or SpeculativeConfig()
        proposers: dict[str, Proposer] = {"ngram": NgramProposer(spec.lookup_min, spec.lookup_max)}
        if worker.drafts is not None:
            proposers["draft"] = DraftModelProposer(self.call, self.samplers)
        self.drafter = Drafter(proposers, self._matcher)
        self._session_metadata = session_metadata
        self._on_saved = on_saved
        self._spawn = spawn
        self._errors: dict[int, Exception] = {}  # request id -> why its sampler raised

    def add_sampler(self, request_id: int, sampler: Sampler) -> None:
        self.samplers[request_id] = sampler

    def drop_sampler(self, request_id: int) -> None:
        self.samplers.pop(request_id, None)

    async def run(self, plan: StepPlan) -> StepOutcome:
        """Runs the plan's parts in order (see StepPlan), every job awaited, and answers what
        each gave."""
        await self.run_ops(plan.ops)
        loads = tuple([await self.load_session(load) for load in plan.loads])
        prefill = None if plan.prefill is None else await self.prefill(plan.prefill)
        rebatch = None if plan.rebatch is None else await self.rebatch(plan.rebatch)
        decode, draft_seconds = None, 0.0
        if plan.decode is not None:
            drafts = await self.drafter.propose(plan.decode)  # (empty: no row drafts)
            rows, forced = drafts.rows, plan.decode.forced
            if forced:  # what the rows' grammars force, fed as drafts that stand
                proposed = rows or ((),) * len(forced)
                rows = tuple(f or d for f, d in zip(forced, proposed, strict=True))
            decode = await self.decode(plan.decode, rows)
            decode = dataclasses.replace(
                decode, proposed=drafts.proposed, forced=tuple(len(f) for f in forced)
            )
            draft_seconds = drafts.seconds
        return StepOutcome(loads, prefill, rebatch, decode, draft_seconds)

    async def call(self, job: Job, meanwhile: Callable[[], None] | None = None) -> Any:
        """Runs `job` on the worker; `meanwhile` runs here while the worker starts on it."""
        fut: Future[Any] = self.worker.submit(job)
        if meanwhile is not None:
            meanwhile()
        return await result_of(fut)

    async def _timed(self, job: Job, constrained: Sequence[RowRef] = ()) -> tuple[Any, float]:
        """The job's result and its seconds. The `constrained` requests' next-token bitmasks
        are filled while its forward runs."""
        began = time.perf_counter()
        matchers = [m for r in constrained if (m := self._matcher(r)) is not None]
        fill = (lambda: [m.fill_ahead() for m in matchers]) if matchers else None
        result = await self.call(job, fill)
        return result, time.perf_counter() - began

    def _matcher(self, row: RowRef) -> Matcher | None:
        sampler = None if row.done else self.samplers.get(row.id)
        return None if sampler is None else sampler.matcher

    def _greedy(self, requests: Sequence[RowRef]) -> bool:
        """Whether any of the requests samples its argmax (the job answers the argmax then)."""
        return any(
            not r.done and (s := self.samplers.get(r.id)) is not None and s.plain_greedy
            for r in requests
        )

    def sample(
        self,
        requests: Sequence[RowRef],
        logits: torch.Tensor,
        argmax: Sequence[int] | None = None,
    ) -> list[int | None]:
        """Each request's token from its row of `logits` ([B, vocab], CPU: the job's answer),
        by its sampler; `argmax`: each row's, as the job answered it (a plain greedy row's
        token then costs this thread no tensor operation). A request done by now gets no
        token; one whose sampler raises gets none either, and its error (see `_sampled`)."""
        samplers = self._samplers_of(requests)
        return self._collect(requests, lambda errors: sample_rows(samplers, logits, errors, argmax))

    def verify(
        self,
        requests: Sequence[RowRef],
        logits: torch.Tensor,
        drafts: Sequence[tuple[int, ...]],
        argmax: Sequence[int] | None = None,
    ) -> list[tuple[int, ...] | None]:
        """Each request's emitted tokens from a verify step's logits ([N, vocab]: row b's
        1 + len(drafts[b]) rows in turn), as `sample` samples."""
        samplers = self._samplers_of(requests)
        return self._collect(
            requests, lambda errors: verify_rows(samplers, logits, drafts, errors, argmax)
        )

    def _samplers_of(self, requests: Sequence[RowRef]) -> tuple[Sampler | None, ...]:
        """The requests' samplers (None: done by now), to run on this thread, whose tensor
        operations then run on it alone (see serial_ops_here)."""
        serial_ops_here()
        return tuple(None if r.done else self.samplers[r.id] for r in requests)

    def _collect(self, requests: Sequence[RowRef], run: Callable[[dict[int, Exception]], T]) -> T:
        """Runs `run(errors)`, keeping the rows' errors by request."""
        errors: dict[int, Exception] = {}
        try:
            return run(errors)
        finally:
            for row, exc in errors.items():
                self._errors[requests[row].id] = exc

    def _failure(self, request: RowRef) -> Sampled | None:
        """The row's sampling error as its outcome, if its sampler raised."""
        exc = self._errors.pop(request.id, None)
        if exc is None:
            return None
        constraint = request.params.constraint
        if isinstance(exc, GrammarError) and constraint is not None:
            # (its own constraint: a 400 naming the field, as before admission)
            log.info("request %d's constraint ended it: %s", request.id, exc)
            return Sampled(None, error=f"'{constraint.param}': {exc}", error_param=constraint.param)
        log.warning("sampling failed for request %d: %r", request.id, exc)
        return Sampled(None, error=f"sampling failed ({type(exc).__name__}: {exc})")

    def _sampled(
        self, requests: Sequence[RowRef], tokens: Sequence[int | None]
    ) -> tuple[Sampled, ...]:
        """Each row's token with the log-probabilities its sampler recorded with it, or the
        error its sampler raised."""
        out = []
        for request, token in zip(requests, tokens, strict=True):
            failed = self._failure(request)
            if failed is not None:
                out.append(failed)
            elif token is None:
                out.append(Sampled(None))
            else:
                sampler = self.samplers[request.id]
                out.append(Sampled(token, sampler.take_logprob(), forced=sampler.forced))
        return tuple(out)

    # ---- housekeeping -------------------------------------------------------------------------

    async def run_ops(self, ops: Sequence[Op]) -> None:
        for op in ops:
            match op:
                case DropSnapshots(ids):
                    await self.call(DropKvSnapshot(ids))
                case DropCached(ids):
                    await self.call(DropCachedKv(ids))
                case Offload(ids):
                    await self.call(OffloadKv(ids))
                case SaveSession():
                    await self._save(op)
                case ReleaseDrafts():
                    await self.drafter.release(op)

    async def _save(self, op: SaveSession) -> None:
        """Takes the snapshot's CPU copy now (jobs that follow may drop it); the file is written
        on a thread of its own, and the request ends once it is on disk."""
        request = op.row
        job = SaveKvSnapshot(op.snapshot_id, op.path, self._session_metadata(), drop=op.drop)
        try:
            result: SaveResult = await self.call(job)
        except Exception as exc:
            self._saved(request, exc)
            return

        async def wait() -> None:
            try:
                await anyio.to_thread.run_sync(result.written.result)
            except Exception as exc:
                self._saved(request, exc)
            else:
                self._on_saved(request.id, None)

        self._spawn(wait, f"neuronpy-session-{request.id}")

    def _saved(self, request: RowRef, exc: Exception) -> None:
        log.warning("session %r not saved: %s", request.session, exc)
        # the client's words: what went wrong, never where (an OSError's text names the path)
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        assert request.session is not None
        self._on_saved(request.id, f"session {request.session.name!r} could not be saved ({why})")

    # ---- prefill and decode -------------------------------------------------------------------

    async def load_session(self, load: LoadSession) -> Loaded:
        """A session file read for a prefill; a file that cannot be read fails that request."""
        try:
            result: LoadResult = await self.call(
                LoadKvSnapshot(load.cache_id, load.path, self.fingerprint)
            )
        except WorkerError as exc:
            return Loaded(error=str(exc), invalid=isinstance(exc.__cause__, SessionFileError))
        return Loaded(result.token_ids)

    def _prefill_job(self, plan: PrefillPlan) -> Prefill:
        return Prefill(
            plan.snapshot_id,
            plan.tokens,
            parent_id=plan.parent_id,
            # later chunks grow it in place; the headroom lets it join without a copy
            reserve=plan.row.prompt_len + DEFAULT_HEADROOM,
            parent_length=plan.parent_length,
            cache_id=plan.cache_id,
            clone_ids=plan.clone_ids,
            logits=plan.last,
            argmax=plan.last and self._greedy(plan.sampled),
            media=plan.row.media if min(plan.tokens) < 0 else (),
        )

    def _prefill_outcome(self, plan: PrefillPlan, result: PrefillResult) -> PrefillOutcome:
        """The chunk's outcome; the prompt's last samples each copy's first token from the
        same logits row."""
        sampled: tuple[Sampled, ...] = ()
        if plan.last:
            assert result.logits is not None
            rows = result.logits[None].expand(len(plan.sampled), -1)
            argmax = None if result.argmax is None else [result.argmax] * len(plan.sampled)
            sampled = self._sampled(plan.sampled, self.sample(plan.sampled, rows, argmax))
        return PrefillOutcome(sampled, result.cached_bytes, cached_length=result.cached_length)

    async def prefill(self, plan: PrefillPlan) -> PrefillOutcome:
        """A chunk in a forward of its own."""
        sampled = plan.sampled if plan.last else ()
        result, seconds = await self._timed(self._prefill_job(plan), sampled)
        began = time.perf_counter()
        outcome = self._prefill_outcome(plan, result)
        sampling = time.perf_counter() - began
        return dataclasses.replace(outcome, seconds=seconds, sampling_seconds=sampling)

    async def decode(
        self, plan: DecodePlan, drafts: Sequence[tuple[int, ...]] = ()
    ) -> DecodeOutcome:
        """One lockstep step, and the prompt chunks prefilled in its forward; with `drafts` (per
        row), a verify step."""
        drafts = tuple(drafts)
        job = ForwardLogitsBatch(
            plan.tokens,
            prefills=tuple(self._prefill_job(ride) for ride in plan.rides),
            drafts=drafts,
            argmax=self._greedy(plan.rows),
            trim=plan.trim,
        )
        riding = [r for ride in plan.rides if ride.last for r in ride.sampled]
        result, seconds = await self._timed(job, [*plan.rows, *riding])
        assert isinstance(result, ForwardResult)
        began = time.perf_counter()
        rides = tuple(
            self._prefill_outcome(ride, done)
            for ride, done in zip(plan.rides, result.prefills, strict=True)
        )
        argmax = result.argmax or None
        if not drafts:
            tokens = self._sampled(plan.rows, self.sample(plan.rows, result.logits, argmax))
            sampling = time.perf_counter() - began
            return DecodeOutcome(tokens, rides, seconds, sampling)
        chosen = self.verify(plan.rows, result.logits, drafts, argmax)
        verified = self._verified(plan.rows, chosen)
        sampling = time.perf_counter() - began
        drafted = tuple(len(d) for d in drafts)
        return DecodeOutcome(verified, rides, seconds, sampling, drafted)

    def _verified(
        self, requests: Sequence[RowRef], rows: Sequence[tuple[int, ...] | None]
    ) -> tuple[Sampled, ...]:
        """Each row's emitted tokens with their log-probabilities, or its sampler's error."""
        out = []
        for request, tokens in zip(requests, rows, strict=True):
            failed = self._failure(request)
            if failed is not None:
                out.append(failed)
            elif not tokens:
                out.append(Sampled(None))
            else:
                sampler = self.samplers[request.id]
                asked = sampler.take_logprobs()  # one a token, if asked
                logprobs: list[TokenLogprob | None] = [*asked] if asked else [None] * len(tokens)
                pairs = tuple(zip(tokens, logprobs, strict=True))
                out.append(
                    Sampled(tokens[-1], logprobs[-1], accepted=pairs[:-1], forced=sampler.forced)
                )
        return tuple(out)

    # ---- rebatch ------------------------------------------------------------------------------

    async def rebatch(self, plan: RebatchPlan) -> RebatchOutcome:
        """Extracts the rows kept, runs the plan's offloads and saves, caches what the prefix
        cache keeps, then assembles the new live batch (if any row is left)."""
        began = time.perf_counter()
        if plan.extract:
            await self.call(ExtractKvRows(plan.rows, plan.ids, plan.trim))
        await self.run_ops(plan.ops)
        cached = None
        if plan.cache:
            ids = tuple(i for _, i in plan.cache)
            keep = tuple(r.prompt_len for r, _ in plan.cache)
            result: CacheResult = await self.call(CacheKvSnapshots(ids, keep))
            cached = CacheOutcome(result.nbytes, result.lengths)
        padding = 0
        if plan.assemble:
            assembled: AssembleResult = await self.call(AssembleKvBatch(plan.assemble))
            padding = assembled.padding_columns
        return RebatchOutcome(cached, padding, time.perf_counter() - began)

    async def worker_stats(self) -> WorkerStatsResult:
        result: WorkerStatsResult = await self.call(WorkerStats())
        return result
