"""The per-model engine task: admission, join/leave by rebatching, lockstep decode steps."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import ObjectReceiveStream, TaskGroup
from transformers import PreTrainedTokenizerBase

from neuronpy.arch.calibration import CALIBRATION_TEXT
from neuronpy.arch.kv import DEFAULT_HEADROOM
from neuronpy.arch.linear import QUANTIZE_MODES
from neuronpy.arch.llama import DEFAULT_PREFILL_CHUNK, LlamaModel
from neuronpy.engine.planner import RowView, plan_step
from neuronpy.engine.prefix_cache import PrefixIndex
from neuronpy.engine.reasoning import REASONING_PARSERS
from neuronpy.engine.router import route
from neuronpy.engine.sampling import Sampler, sample_rows
from neuronpy.engine.sessions import SessionRequest, model_fingerprint, session_metadata
from neuronpy.engine.slot import Finish, RouterMessage, Slot, SlotStatus
from neuronpy.engine.types import Completion, FinishReason, GenerationEvent, SamplingParams
from neuronpy.envflags import env_flag
from neuronpy.errors import (
    EngineUnhealthyError,
    InvalidRequestError,
    QueueFullError,
    ShuttingDownError,
    WorkerError,
)
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
    RowSampler,
    SaveKvSnapshot,
    SaveResult,
    WorkerStats,
    WorkerStatsResult,
)
from neuronpy.worker.worker import DeviceWorker

log = logging.getLogger(__name__)

DEFAULT_PREFIX_CACHE_BYTES = 1 << 30  # the prefix cache's KV budget per model
DEFAULT_MAX_N = 8  # completions one request may ask for


def batching_enabled() -> bool:
    """NEURON_BATCHING=0 in the environment forces one-at-a-time decoding."""
    return env_flag("NEURON_BATCHING")


@dataclass(frozen=True)
class EngineConfig:
    max_in_flight: int = 8  # rows of the lockstep batch
    max_queue: int = 64  # admitted requests waiting for a row; beyond that, QueueFullError
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    # how much a joiner's prompt chunk may lengthen a decode step, in decode steps: smaller
    # keeps the decoding rows' inter-token gaps smoother, larger lets prompts join sooner
    chunk_steps: float = 0.5
    batching: bool = True  # False: one sequence at a time, through the same code
    quantize: str = "none"  # "int8": int8 weights and per-row int8 activations (CPU)
    queue_timeout: float | None = None  # seconds a request may wait for a row; None: no limit
    prefix_cache: bool = True  # keep prompts' (and finished requests') KV to reuse as prefixes
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES  # its budget; 0 turns it off
    max_n: int = DEFAULT_MAX_N  # completions one request may ask for (n)
    # bytes of KV the running sequences may hold together (0: no limit). A join or a step that
    # would pass it preempts the newest rows: their snapshots leave the live batch (to CPU
    # memory from a GPU) and rejoin later exactly where they stopped, before newer requests.
    kv_budget_bytes: int = 0
    # how chat replies' thinking blocks are split out (the server reads it): "auto" (from the
    # chat template), "none", or a parser of neuronpy.engine.reasoning ("think")
    reasoning_parser: str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_in_flight", "prefill_chunk", "max_n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if (
            isinstance(self.max_queue, bool)
            or not isinstance(self.max_queue, int)
            or self.max_queue < 0
        ):
            raise ValueError(f"max_queue must be an integer >= 0, got {self.max_queue!r}")
        for name in ("prefix_cache_bytes", "kv_budget_bytes"):
            budget = getattr(self, name)
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {budget!r}")
        if not isinstance(self.prefix_cache, bool):
            raise ValueError(f"prefix_cache must be True or False, got {self.prefix_cache!r}")
        timeout = self.queue_timeout
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ValueError(f"queue_timeout must be a number > 0 or None, got {timeout!r}")
        steps = self.chunk_steps
        if isinstance(steps, bool) or not isinstance(steps, (int, float)) or not steps > 0:
            raise ValueError(f"chunk_steps must be a number > 0, got {steps!r}")
        if self.quantize not in QUANTIZE_MODES:
            raise ValueError(
                f"quantize must be one of {', '.join(QUANTIZE_MODES)}, got {self.quantize!r}"
            )
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                f"got {self.reasoning_parser!r}"
            )


@dataclass(frozen=True)
class EngineStats:
    running: int  # rows in (or about to join) the live batch
    queued: int
    live_batch_size: int
    max_batch_size: int  # the largest batch a decode step has run
    decode_steps: int
    decoded_rows: int  # sum of the batch size over decode steps
    multi_row_steps: int  # decode steps with more than one row
    rebatches: int
    prefills: int
    prefill_chunks: int  # prefill jobs: a long prompt joining mid-batch takes several
    riding_chunks: int  # of those, chunks that rode a decode step (no weight reads of their own)
    admitted: int
    rejected: int  # refused at admission: the queue was full
    timed_out: int  # admitted, then waited past queue_timeout without getting a row
    cancelled: int  # ended by the client (or a stop string's router) before finishing
    finished: int  # ended on their own (stop, length) or aborted by shutdown
    failed: int
    prompt_tokens: int  # of admitted requests
    generated_tokens: int  # sampled tokens, over every request
    healthy: bool
    padded_kv_columns: int  # padding-gap KV columns, summed over decode steps (batching's waste)
    kv_columns: int  # real KV columns attended, summed over decode steps
    timing: dict[str, float]  # cumulative seconds: forward, prefill, rebatch, sampling
    batch_size_steps: dict[int, int]  # decode steps by their batch size
    alone_steps: dict[str, int]  # one-row steps by why: no_peer, peer_prefilling, peer_queued
    prefill_tokens: int = 0  # prompt tokens actually prefilled (a prefix-cache hit's not)
    prefix_cache_hits: int = 0  # prompts that restored a cached prefix
    prefix_cache_misses: int = 0  # prompts prefilled from scratch with the cache on
    prefix_cache_reused_tokens: int = 0  # prompt tokens restored rather than prefilled
    prefix_cache_entries: int = 0  # snapshots the cache holds now
    prefix_cache_bytes: int = 0  # what they take
    preemptions: int = 0  # rows moved out of the live batch to keep within kv_budget_bytes
    preempted: int = 0  # rows waiting to resume now (counted in `queued`)
    kv_budget_tokens: int = 0  # tokens of KV the budget holds (0: no budget)
    kv_tokens: int = 0  # tokens of KV the running rows hold now
    max_kv_tokens: int = 0  # the most a decode step has held (running rows and joiners)
    sessions_saved: int = 0  # conversations written to session files
    sessions_restored: int = 0  # prompts that continued from a session file


class RequestStream:
    """One request's events: an async iterator and an async context manager (exit cancels)."""

    def __init__(self, engine: Engine, slot: Slot, events: ObjectReceiveStream[GenerationEvent]):
        self._engine = engine
        self._slot = slot
        self._events = events
        self._done = False
        self.prompt_tokens = len(slot.prompt_ids)

    @property
    def id(self) -> int:
        return self._slot.id

    @property
    def index(self) -> int:
        """Which of its request's n completions this is (0 when n is 1)."""
        return self._slot.index

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens restored from the prefix cache rather than prefilled (known once the
        first event has arrived; for n > 1, the prefill all the copies share)."""
        return self._slot.cached_tokens

    def cancel(self) -> None:
        """Idempotent. A running row leaves within one decode step; a queued one never runs."""
        if not self._done:
            self._done = True
            self._engine._cancel(self._slot)
            self._events.close()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> GenerationEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            event = await self._events.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._done = True
            raise StopAsyncIteration from None
        if event.finished:
            self._done = True
            self._events.close()
        return event

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.cancel()


class Engine:
    """Serves many generations of one model through one lockstep (B, 1) decode per step."""

    def __init__(
        self,
        model: LlamaModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        name: str,
        config: EngineConfig | None = None,
        eos_token_ids: Sequence[int] = (),
        worker: DeviceWorker | None = None,
        fingerprint: str | None = None,
    ) -> None:
        """`worker`: the device worker to run jobs on (one driving other processes, for
        tensor parallelism); by default a DeviceWorker of its own over `model`. `fingerprint`:
        what identifies the weights in saved sessions (from_pretrained hashes the
        checkpoint's; by default a hash of the embeddings and norms)."""
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.config = config or EngineConfig()
        self.context_len = model.config.context_len
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        # found at start-up, kept apart from the configuration
        batching = self.config.batching and batching_enabled()
        self.max_running = self.config.max_in_flight if batching else 1
        self._worker = worker or DeviceWorker(model, name, self.config.prefill_chunk)
        self._ids = itertools.count()
        self._waiting: deque[Slot] = deque()
        self._running: list[Slot] = []  # row order of the live batch
        self._joining: list[Slot] = []  # being prefilled, about to join
        self._has_batch = False
        self._healthy = False
        self._failure: str | None = None
        self._wake = anyio.Event()
        self._tg: TaskGroup | None = None
        self._counts = dict.fromkeys(
            (
                "max_batch_size",
                "decode_steps",
                "decoded_rows",
                "multi_row_steps",
                "rebatches",
                "prefills",
                "prefill_chunks",
                "riding_chunks",
                "padded_kv_columns",
                "kv_columns",
                "admitted",
                "rejected",
                "timed_out",
                "cancelled",
                "finished",
                "failed",
                "prompt_tokens",
                "generated_tokens",
                "prefill_tokens",
                "prefix_cache_hits",
                "prefix_cache_misses",
                "prefix_cache_reused_tokens",
                "preemptions",
                "max_kv_tokens",
                "sessions_saved",
                "sessions_restored",
            ),
            0,
        )
        on = self.config.prefix_cache and self.config.prefix_cache_bytes > 0
        self._prefix = PrefixIndex(self.config.prefix_cache_bytes) if on else None
        self._batch_size_steps: dict[int, int] = {}
        self._alone_steps = dict.fromkeys(("no_peer", "peer_prefilling", "peer_queued"), 0)
        self._refusal: str | None = None  # why submit refuses: set when shutting down
        self._idle = anyio.Event()  # set whenever nothing is admitted: drain waits on it
        self._request_seconds = 0.0  # moving average, for Retry-After
        self._step_seconds = 0.0  # moving average of a decode step's forward
        self._prefill_cost = PrefillCost()  # seconds a prefill of n tokens takes
        self._padding_columns = 0  # of the live batch
        self._sampled_seconds = 0.0  # the last job's sampling time, on the worker thread
        self._riding: Slot | None = None  # a joiner whose next chunk rides the next step
        self._ride_seconds_per_token = 0.0  # what a riding chunk adds to a step, per token
        self._timing = dict.fromkeys(("forward", "prefill", "rebatch", "sampling"), 0.0)
        c = model.config
        # K and V, every layer: what one token of a sequence's context takes
        self.kv_bytes_per_token = (
            2 * c.num_layers * c.num_kv_heads * c.head_dim * model.dtype.itemsize
        )
        self.kv_budget_tokens = self.config.kv_budget_bytes // self.kv_bytes_per_token
        if self.config.kv_budget_bytes and not self.kv_budget_tokens:
            raise ValueError(
                f"kv_budget_bytes {self.config.kv_budget_bytes} holds no token of this model's "
                f"KV ({self.kv_bytes_per_token} bytes per token)"
            )
        self._preempting: list[Slot] = []  # rows to move out of the live batch at this rebatch
        self._saving: set[Slot] = set()  # ended, their session file being written
        norms = {f"{i}.{n}": getattr(lw, n) for i, lw in enumerate(model.layers) for n in NORMS}
        self.fingerprint = fingerprint or model_fingerprint(
            {"embed": model.embed, "norm": model.norm, **norms}, extra=(self.config.quantize,)
        )

    @classmethod
    def from_pretrained(
        cls,
        hf_model: Any,
        tokenizer: PreTrainedTokenizerBase,
        *,
        name: str,
        config: EngineConfig | None = None,
    ) -> Engine:
        """Builds the native model from a loaded transformers model; EOS ids from both sources."""
        config = config or EngineConfig()
        calibration = calibration_ids(hf_model, tokenizer, config.quantize)
        return cls(
            LlamaModel.from_hf(hf_model, quantize=config.quantize, calibration_ids=calibration),
            tokenizer,
            name=name,
            config=config,
            eos_token_ids=eos_token_ids(hf_model, tokenizer),
            fingerprint=model_fingerprint(hf_model.state_dict(), extra=(config.quantize,)),
        )

    # ---- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> Engine:
        self._worker.start()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._healthy = True
        self._tg.start_soon(self._loop, name=f"neuronpy-engine-{self.name}")
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self._healthy = False
        self._failure = self._failure or "the engine has shut down"
        for slot in self._active():
            self._finish(slot, FinishReason.ABORT)
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)
        await anyio.to_thread.run_sync(self._worker.shutdown, 30.0)

    @property
    def healthy(self) -> bool:
        if self._healthy and self._worker.broken is not None:
            self._fail(WorkerError(self._worker.broken))
        return self._healthy

    # ---- public API ---------------------------------------------------------------------------

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> RequestStream:
        """Validates and admits a request, or raises before anything is allocated.

        InvalidRequestError (bad prompt or max_tokens), EngineUnhealthyError, QueueFullError.
        """
        return self.submit_many(prompt_ids, params, 1)[0]

    def submit_many(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        n: int,
        session: SessionRequest | None = None,
    ) -> list[RequestStream]:
        """Admits `n` completions of one prompt (OpenAI's `n`), or raises before anything is
        allocated; each copy counts as one request against max_in_flight and max_queue. The
        prompt is prefilled once and its snapshot cloned into each copy. Copy i samples with
        its own sampler, seeded `seed + i` when `params.seed` is set.

        `session`: continue from that session's saved KV (as much of it as starts the prompt)
        and, when the request ends on its own, save its KV there (see engine/sessions.py)."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.config.max_n:
            raise InvalidRequestError(
                f"'n' must be an integer from 1 to {self.config.max_n}, got {n!r}", "n"
            )
        prompt = self._validate(prompt_ids, params)
        if session is not None and n != 1:
            raise InvalidRequestError("a request with a 'session' returns one choice (n = 1)", "n")
        if session is not None and not self._worker.supports_sessions:
            raise InvalidRequestError(
                f"model {self.name!r} cannot save or restore sessions (tensor parallel)", "session"
            )
        if not self._healthy:
            raise EngineUnhealthyError(self._failure or f"model {self.name!r} is not ready")
        if self._refusal is not None:
            raise ShuttingDownError(self._refusal)
        in_system = len(self._waiting) + len(self._joining) + len(self._running)
        if in_system + n > self.max_running + self.config.max_queue:
            self._counts["rejected"] += 1
            raise QueueFullError(
                f"model {self.name!r} is at capacity ({self.max_running} running, "
                f"{self.config.max_queue} queued); retry later",
                retry_after=self.retry_after(),
            )
        group: list[Slot] = []
        streams = []
        for index in range(n):
            copy = params
            if index and params.seed is not None:
                copy = dataclasses.replace(params, seed=params.seed + index)
            streams.append(self._admit(prompt, copy, index, group, session))
        self._idle = anyio.Event()
        self._wake.set()
        return streams

    def _admit(
        self,
        prompt: tuple[int, ...],
        params: SamplingParams,
        index: int,
        group: list[Slot],
        session: SessionRequest | None = None,
    ) -> RequestStream:
        """One admitted copy: its slot (queued), its router task and its event stream."""
        to_router, inbox = anyio.create_memory_object_stream[RouterMessage](math.inf)
        outbox, events = anyio.create_memory_object_stream[GenerationEvent](math.inf)
        slot = Slot(
            id=next(self._ids),
            prompt_ids=prompt,
            params=params,
            sampler=Sampler(params, prompt, self.vocab_size),
            to_router=to_router,
            stop_ids=self._stop_ids(params),
            index=index,
            group=group,
            session=session,
        )
        group.append(slot)
        assert self._tg is not None
        self._tg.start_soon(
            lambda: route(
                inbox,
                outbox,
                tokenizer=self.tokenizer,
                prompt_ids=prompt,
                params=params,
                silent_ids=slot.stop_ids,
                request_leave=lambda: self._leave(slot),
            ),
            name=f"neuronpy-router-{slot.id}",
        )
        self._waiting.append(slot)
        self._counts["admitted"] += 1
        self._counts["prompt_tokens"] += len(prompt)
        return RequestStream(self, slot, events)

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[GenerationEvent]:
        """Submits and yields the request's events; leaving the loop early cancels it."""
        async with self.submit(prompt_ids, params) as stream:
            async for event in stream:
                yield event

    async def complete(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        """Runs a request to the end and gathers its text, tokens and finish reason."""
        out = Completion()
        async for event in self.generate(prompt_ids, params):
            out.text += event.text
            out.token_ids.extend(event.token_ids)
            out.prompt_tokens = event.prompt_tokens
            out.completion_tokens = event.completion_tokens
            out.finish_reason = event.finish_reason
            out.reasoning += event.reasoning
            out.tool_calls.extend(event.tool_calls)
            out.logprobs.extend(event.logprobs)
        return out

    def stats(self) -> EngineStats:
        return EngineStats(
            # rows leaving at the next rebatch no longer count: never above max_running
            running=sum(not s.done for s in self._running) + len(self._joining),
            queued=len(self._waiting),
            live_batch_size=len(self._running) if self._has_batch else 0,
            healthy=self._healthy,
            timing=dict(self._timing),
            batch_size_steps=dict(self._batch_size_steps),
            alone_steps=dict(self._alone_steps),
            prefix_cache_entries=len(self._prefix) if self._prefix else 0,
            prefix_cache_bytes=self._prefix.bytes if self._prefix else 0,
            preempted=sum(s.preemptions > 0 for s in self._waiting),
            kv_budget_tokens=self.kv_budget_tokens,
            kv_tokens=self._kv_held(),
            **self._counts,
        )

    def stop_admitting(self, reason: str = "the server is shutting down") -> None:
        """From now on `submit` raises ShuttingDownError(reason); admitted requests carry on."""
        self._refusal = reason

    async def drain(self, timeout: float) -> int:
        """Waits up to `timeout` seconds for every admitted request to end, then aborts the rest
        (finish reason abort). Returns how many were aborted. Call stop_admitting first."""
        if self._active() or self._saving:
            with anyio.move_on_after(timeout):
                await self._idle.wait()
        aborted = [s for s in self._active() if s.status is not SlotStatus.FINISHED]
        for slot in aborted:
            slot.finish_reason = FinishReason.ABORT  # the loop drops its row
            self._finish(slot, FinishReason.ABORT, "the server is shutting down")
        if aborted:
            self._wake.set()  # the loop drops the aborted rows at its next schedule
        return len(aborted)

    async def worker_stats(self) -> WorkerStatsResult:
        """What the device worker holds: snapshots, bytes, live batch (for leak checks)."""
        result: WorkerStatsResult = await self._call(WorkerStats())
        return result

    # ---- admission helpers --------------------------------------------------------------------

    def _validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> tuple[int, ...]:
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be SamplingParams")
        prompt = tuple(prompt_ids)
        if not prompt:
            raise InvalidRequestError("the prompt is empty", "prompt")
        bad = [
            t
            for t in prompt
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size
        ]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids out of the vocabulary [0, {self.vocab_size}): {bad[:10]}",
                "prompt",
            )
        if len(prompt) >= self.context_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} tokens; this model's context is "
                f"{self.context_len} tokens, and at least one must be left to generate",
                "prompt",
            )
        if len(prompt) + params.max_tokens > self.context_len:
            raise InvalidRequestError(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"this model's context of {self.context_len} tokens",
                "max_tokens",
            )
        if self.kv_budget_tokens and len(prompt) + 1 > self.kv_budget_tokens:
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} tokens; model {self.name!r} keeps at most "
                f"{self.kv_budget_tokens} tokens of KV (kv_budget_bytes)",
                "prompt",
            )
        biased = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if biased:
            raise InvalidRequestError(
                f"'logit_bias' token ids out of the vocabulary [0, {self.vocab_size}): "
                f"{biased[:20]}",
                "logit_bias",
            )
        return prompt

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        return eos | frozenset(params.stop_token_ids)

    def retry_after(self) -> float:
        """Seconds until a row is likely free: the queue ahead at the measured request time."""
        per_request = self._request_seconds or 1.0
        return max(1.0, per_request * (len(self._waiting) + 1) / self.max_running)

    def _cancel(self, slot: Slot) -> None:
        if slot.status is not SlotStatus.FINISHED and not slot.cancelled:
            slot.cancelled = True
            self._counts["cancelled"] += 1
            self._wake.set()

    def _leave(self, slot: Slot) -> None:
        slot.leave_requested = True
        self._wake.set()

    # ---- the loop -----------------------------------------------------------------------------

    async def _call(self, job: Job) -> Any:
        fut: Future[Any] = self._worker.submit(job)
        return await anyio.to_thread.run_sync(fut.result, abandon_on_cancel=True)

    async def _loop(self) -> None:
        try:
            while True:
                if not self._active():
                    if not self._saving:  # (a session's write wakes the loop when done)
                        self._idle.set()
                    self._wake = anyio.Event()
                    await self._wake.wait()
                await self._schedule()
                if self._running:
                    await self._step()
                else:
                    await anyio.sleep(0)  # let routers and submitters run
        except Exception as exc:
            log.exception("engine for %s failed; marking it unhealthy", self.name)
            self._fail(exc)

    async def _schedule(self) -> None:
        """Plan, advance the joiners' prefill, and rebatch: extract survivors, assemble again."""
        self._riding = None
        self._expire_waiting()
        plan = plan_step(
            [RowView(s.id, s.done) for s in self._running],
            [RowView(s.id, s.done) for s in self._waiting],
            self.max_running,
            prefilling=len(self._joining),
        )
        by_id = {s.id: s for s in self._waiting}
        for sid in plan.dropped:
            slot = by_id[sid]
            self._waiting.remove(slot)
            # a copy of an n > 1 request may have ended on its first token (its clone's)
            self._finish(slot, slot.finish_reason or self._abort_reason(slot))
        joining = [by_id[sid] for sid in plan.joining]
        if self.kv_budget_tokens:
            joining = self._within_budget(joining)
        for slot in joining:
            self._waiting.remove(slot)
            slot.status = SlotStatus.PREFILLING
            self._joining.append(slot)
        self._joining = [s for s in self._joining if not self._drop_if_done(s)]
        # (a copy of an n > 1 request is filled by its first copy's prefill: it has nothing left)
        todo = [s for s in self._joining if s.prefilled < len(s.prompt_ids)]
        if self._running:
            # rows are decoding: one chunk, sized to cost about chunk_steps decode steps, rides
            # the next step (sharing its weight reads); the chunk that ends the prompt samples
            # its first token in the same step
            if todo:
                self._riding = todo[0]
        else:
            for slot in todo:  # nobody waits on a decode step: prefill whole prompts
                if slot.prefilled < len(slot.prompt_ids):
                    await self._prefill(slot, None)
        # rows may have finished or been cancelled while the prefills ran
        joined = [s for s in self._joining if s.prefilled == len(s.prompt_ids)]
        self._joining = [s for s in self._joining if s not in joined]
        joined = [s for s in joined if not self._drop_if_done(s)]
        preempted, self._preempting = self._preempting, []
        leaving = [s for s in self._running if s.done]
        preempted = [s for s in preempted if not s.done]  # those that finished just leave
        survivors = [s for s in self._running if not s.done and s not in preempted]
        if not leaving and not joined and not preempted:
            return
        started = time.perf_counter()
        self._counts["rebatches"] += 1
        saved: list[Slot] = []
        if self._has_batch:
            kept = self._cacheable(leaving)  # leaving rows whose KV the prefix cache keeps
            saved = [s for s in leaving if self._saves_session(s)]
            moving = (*survivors, *preempted)  # rows whose snapshots are kept for them
            extracted = (*moving, *kept, *(s for s in saved if s not in kept))
            rows = tuple(self._running.index(s) for s in extracted)
            ids = tuple(next(self._ids) for _ in rows)
            await self._call(ExtractKvRows(rows, ids))
            self._has_batch = False
            for slot, sid in zip(extracted, ids, strict=True):
                slot.snapshot_id = sid
            if preempted:
                self._worker.submit(OffloadKv(tuple(s.snapshot_id for s in preempted)))
                for slot in preempted:
                    self._requeue(slot)
            kept_ids = [s.snapshot_id for s in kept]
            for slot in saved:  # (the worker copies them before the prefix cache takes them)
                self._save_session(slot, drop=slot not in kept)
            if kept:
                await self._cache_rows(kept, kept_ids)
        for slot in leaving:
            if slot not in saved:
                self._finish(slot, slot.finish_reason or self._abort_reason(slot))
        self._running = survivors + joined
        if self._running:
            assembled: AssembleResult = await self._call(
                AssembleKvBatch(tuple(s.snapshot_id for s in self._running))
            )
            self._padding_columns = assembled.padding_columns
            self._has_batch = True
            for slot in self._running:
                slot.status = SlotStatus.RUNNING
                slot.snapshot_id = None  # moved into the live batch
        self._timing["rebatch"] += time.perf_counter() - started

    # ---- the KV budget: preemption --------------------------------------------------------------

    def _kv_held(self) -> int:
        """Tokens of KV the running rows (those not leaving) and the joiners hold now."""
        running = sum(s.total_tokens for s in self._running if not s.done)
        return running + sum(s.prefilled for s in self._joining)

    @staticmethod
    def _kv_need(slot: Slot) -> int:
        """KV columns a row needs through its next step: its tokens so far and one more."""
        return slot.total_tokens + 1

    def _within_budget(self, candidates: list[Slot]) -> list[Slot]:
        """Keeps the rows' KV within kv_budget_tokens, oldest request first. While the running
        rows and joiners outgrow it, the newest of them is preempted (one row always runs).
        Then `candidates` (waiting, oldest first) join while they fit; one that does not fit
        preempts newer rows if that makes room, or else waits, and so does everyone behind it.
        Returns the candidates that join."""
        budget = self.kv_budget_tokens
        live = [s for s in (*self._running, *self._joining) if not s.done]
        need = sum(self._kv_need(s) for s in live)
        while need > budget and len(live) > 1:
            victim = max(live, key=lambda s: s.id)
            live.remove(victim)
            need -= self._kv_need(victim)
            self._preempt(victim)
        admitted = []
        for slot in candidates:
            want = self._kv_need(slot)
            if live and need + want > budget:
                victims, freed = [], 0
                for row in sorted((s for s in live if s.id > slot.id), key=lambda s: -s.id):
                    if need - freed + want <= budget:
                        break
                    victims.append(row)
                    freed += self._kv_need(row)
                if need - freed + want > budget:
                    break  # it waits for older rows to finish; so does everyone behind it
                for row in victims:
                    live.remove(row)
                    self._preempt(row)
                need -= freed
            admitted.append(slot)
            live.append(slot)
            need += want
        return admitted

    def _preempt(self, slot: Slot) -> None:
        """Moves a row out of the live batch (at this schedule's rebatch) or a joiner out of
        its prefill; its snapshot waits, with its tokens and sampler, to resume."""
        self._counts["preemptions"] += 1
        slot.preemptions += 1
        if slot in self._running:
            self._preempting.append(slot)
            return
        self._joining.remove(slot)
        if slot.snapshot_id is not None:
            self._worker.submit(OffloadKv((slot.snapshot_id,)))
        self._requeue(slot)

    def _requeue(self, slot: Slot) -> None:
        """A preempted slot waits again, in arrival order: before every newer request."""
        slot.status = SlotStatus.WAITING
        at = next((i for i, w in enumerate(self._waiting) if w.id > slot.id), len(self._waiting))
        self._waiting.insert(at, slot)

    def _expire_waiting(self) -> None:
        """Requests that waited past queue_timeout for a row end now, never prefilled."""
        timeout = self.config.queue_timeout
        if timeout is None or not self._waiting:
            return
        now = time.monotonic()
        for slot in [s for s in self._waiting if now - s.arrived_at > timeout]:
            if slot.done or slot.preemptions:
                continue  # cancelled: the planner drops it; preempted: it has started
            self._waiting.remove(slot)
            self._counts["timed_out"] += 1
            slot.finish_reason = FinishReason.ABORT
            message = (
                f"the request waited {now - slot.arrived_at:.1f} s for model {self.name!r} "
                f"without getting a row (queue_timeout {timeout:g} s); retry later"
            )
            self._finish(slot, FinishReason.ABORT, message, counted=True)

    def _ride_budget(self) -> int:
        """Prompt tokens a riding chunk may add: about `chunk_steps` decode steps' time at what
        riding chunks have cost per token (no weight reads of their own: more tokens fit than
        in a chunk run on its own)."""
        fit = self._prefill_cost.fit()
        # a chunk's compute costs at least about what it does run on its own, weights aside:
        # the fit's per-token figure bounds a noisy (or not yet measured) riding estimate
        per_token = max(self._ride_seconds_per_token, fit[1] if fit else 0.0)
        if not per_token or not self._step_seconds:
            return MIN_CHUNK
        budget = int(self.config.chunk_steps * self._step_seconds / per_token)
        return max(MIN_CHUNK, min(self.config.prefill_chunk, budget))

    async def _prefill(self, slot: Slot, budget: int | None) -> None:
        """Prefills the next `budget` prompt tokens (all, if None) into the slot's snapshot, in
        a forward of its own; after the last chunk, samples the first token."""
        plan = await self._plan_prefill(slot, budget)
        if plan is None:
            return
        self._sampled_seconds = 0.0
        began = time.perf_counter()
        result: PrefillResult = await self._call(plan.job)
        elapsed = time.perf_counter() - began - self._sampled_seconds
        self._prefill_cost.observe(len(plan.job.token_ids), elapsed)
        self._timing["prefill"] += elapsed
        self._prefilled(slot, plan, result)

    async def _plan_prefill(self, slot: Slot, budget: int | None) -> PrefillPlan | None:
        """The Prefill job of the slot's next `budget` prompt tokens (all, if None): its first
        chunk restores the longest cached prefix (the prefix cache's, or its session's); its
        last samples the first token and fills the request's other copies (n > 1). None when
        the slot failed (its session could not be read)."""
        start = slot.prefilled
        parent = slot.snapshot_id
        parent_length = None
        loaded = None  # a session's snapshot, read for this prefill only
        if parent is None:
            limit = len(slot.prompt_ids) - 1  # one token is left to prefill: it samples
            hit = self._prefix.lookup(slot.prompt_ids, limit) if self._prefix is not None else None
            if slot.session is not None and slot.session.token_ids:
                loaded = await self._load_session(slot, hit[1] if hit else 0)
                if slot.done:  # it could not be read: the request has failed
                    return None
            if loaded is not None:
                hit = loaded
            else:
                self._count_prefix_hit(hit)
            if hit is not None:
                slot.cached_tokens = hit[1]
            slot.snapshot_id = next(self._ids)
            if hit is not None:  # prefill after a cached prefix (a copy of it)
                parent, parent_length = hit
                start = slot.prefilled = parent_length
        end = len(slot.prompt_ids) if budget is None else min(len(slot.prompt_ids), start + budget)
        last = end == len(slot.prompt_ids)
        cache_id = None
        clones: list[Slot] = []
        if last:
            cache_id = self._cache_id(slot.prompt_ids)
            clones = [
                s for s in slot.group if s.prefilled == 0 and s.snapshot_id is None and not s.done
            ]
        job = Prefill(
            slot.snapshot_id,
            slot.prompt_ids[start:end],
            parent_id=parent,
            sample=self._sampling([slot, *clones]) if last else None,
            # later chunks grow it in place; the headroom lets it join without a copy
            reserve=len(slot.prompt_ids) + DEFAULT_HEADROOM,
            parent_length=parent_length,
            cache_id=cache_id,
            clone_ids=tuple(next(self._ids) for _ in clones),
            logits=last,
        )
        return PrefillPlan(job, last, clones, loaded[0] if loaded else None)

    def _prefilled(self, slot: Slot, plan: PrefillPlan, result: PrefillResult) -> None:
        """Books a prefill chunk's result: the cache entry, the counters, and after the last
        chunk the first tokens of the slot and its copies."""
        job = plan.job
        self._counts["prefill_tokens"] += len(job.token_ids)
        if plan.session_id is not None:
            self._worker.submit(DropCachedKv((plan.session_id,)))
        if job.cache_id is not None:
            self._remember(job.cache_id, slot.prompt_ids, result.cached_bytes)
        slot.prefilled += len(job.token_ids)
        self._counts["prefill_chunks"] += 1
        if not plan.last:
            return
        self._counts["prefills"] += 1
        if not slot.done and result.token is not None:
            self._accept(slot, result.token)
        for clone, sid, token in zip(plan.clones, job.clone_ids, result.clone_tokens, strict=True):
            clone.snapshot_id = sid
            clone.prefilled = len(clone.prompt_ids)
            clone.cached_tokens = slot.cached_tokens
            if not clone.done and token is not None:
                self._accept(clone, token)

    # ---- the prefix cache ---------------------------------------------------------------------

    def _count_prefix_hit(self, hit: tuple[int, int] | None) -> None:
        """Counts a prompt's prefix-cache lookup (the cached snapshot and the prefix length it
        gives: one prompt token, at least, is left to prefill, as its logits give the first
        token), when the cache is on."""
        if self._prefix is None:
            return
        if hit is None:
            self._counts["prefix_cache_misses"] += 1
        else:
            self._counts["prefix_cache_hits"] += 1
            self._counts["prefix_cache_reused_tokens"] += hit[1]

    async def _load_session(self, slot: Slot, cached: int) -> tuple[int, int] | None:
        """Reads the slot's session into the worker when it holds more of the prompt than the
        `cached` tokens the prefix cache does: (its snapshot id, the prefix length it gives),
        or None. A session that cannot be read fails this request alone."""
        session = slot.session
        assert session is not None and session.token_ids is not None
        limit = len(slot.prompt_ids) - 1  # one token is left to prefill: it samples
        if common_prefix(session.token_ids[:limit], slot.prompt_ids) <= cached:
            return None
        sid = next(self._ids)
        try:
            result: LoadResult = await self._call(
                LoadKvSnapshot(sid, session.path, self.fingerprint)
            )
        except WorkerError as exc:
            slot.finish_reason = FinishReason.ERROR
            self._finish(slot, FinishReason.ERROR, f"session {session.name!r}: {exc}")
            return None
        # the file may have changed since the request read its header
        common = common_prefix(result.token_ids[:limit], slot.prompt_ids)
        if common <= cached:
            self._worker.submit(DropCachedKv((sid,)))
            return None
        self._counts["sessions_restored"] += 1
        return sid, common

    def _saves_session(self, slot: Slot) -> bool:
        """Whether a leaving slot's KV goes to its session: it ended on its own (not cancelled,
        not aborted, not failed) and asked to save."""
        if slot.session is None or not slot.session.save or slot.cancelled:
            return False
        ended = slot.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        return ended or slot.leave_requested

    def _save_session(self, slot: Slot, *, drop: bool) -> None:
        """Writes the slot's snapshot to its session file; the request ends once the file is on
        disk (or with an error if it could not be written). `drop`: the worker then drops the
        snapshot (else a job that follows takes it)."""
        assert slot.session is not None and slot.snapshot_id is not None and self._tg is not None
        reason = slot.finish_reason or self._abort_reason(slot)
        metadata = session_metadata(self.name, self.fingerprint, self.model.dtype)
        job = SaveKvSnapshot(slot.snapshot_id, slot.session.path, metadata, drop=drop)
        # submitted now: it runs before any job that takes or drops the snapshot
        saving = self._worker.submit(job)
        slot.snapshot_id = None
        self._saving.add(slot)

        async def wait() -> None:
            try:
                result: SaveResult = await anyio.to_thread.run_sync(saving.result)
                await anyio.to_thread.run_sync(result.written.result)
            except Exception as exc:
                log.warning("session %r of %s not saved: %s", slot.session, self.name, exc)
                message = f"the session could not be saved ({type(exc).__name__}: {exc})"
                self._finish(slot, FinishReason.ERROR, message)
            else:
                self._counts["sessions_saved"] += 1
                self._finish(slot, reason)
            finally:
                self._saving.discard(slot)
                self._wake.set()

        self._tg.start_soon(wait, name=f"neuronpy-session-{slot.id}")

    def _cache_id(self, tokens: Sequence[int]) -> int | None:
        """A new id for the prefix cache to keep these tokens' snapshot under, or None when
        it would add nothing (too short, or a stored sequence starts with them)."""
        index = self._prefix
        if index is None or len(tokens) < index.block or index.covers(tokens):
            return None
        return next(self._ids)

    def _remember(self, cache_id: int, tokens: Sequence[int], nbytes: int) -> None:
        """Indexes a snapshot the worker has cached; drops what that makes redundant or what
        no longer fits the budget (least recently used first)."""
        assert self._prefix is not None
        dropped = self._prefix.insert(cache_id, tokens, nbytes)
        if dropped:
            self._worker.submit(DropCachedKv(tuple(dropped)))

    def _cacheable(self, leaving: Sequence[Slot]) -> list[Slot]:
        """Leaving rows worth keeping in the prefix cache: their prompt and output's KV."""
        if self._prefix is None:
            return []
        return [
            s
            for s in leaving
            if s.total_tokens > self._prefix.block
            and not self._prefix.covers((*s.prompt_ids, *s.output_ids[:-1]))
        ]

    async def _cache_rows(self, slots: Sequence[Slot], ids: Sequence[int]) -> None:
        """Moves extracted rows into the worker's prefix cache and indexes them."""
        result: CacheResult = await self._call(CacheKvSnapshots(tuple(ids)))
        for slot, sid, nbytes, length in zip(
            slots, ids, result.nbytes, result.lengths, strict=True
        ):
            # the row's KV holds the tokens fed so far: the last sampled one may not be
            self._remember(sid, (*slot.prompt_ids, *slot.output_ids)[:length], nbytes)

    def _drop_if_done(self, slot: Slot) -> bool:
        """A joiner that finished before joining (first token EOS, cancelled) drops its snapshot
        (or saves it to its session)."""
        if not slot.done:
            return False
        if slot.snapshot_id is not None and self._saves_session(slot):
            self._save_session(slot, drop=True)
        elif slot.snapshot_id is not None:
            self._worker.submit(DropKvSnapshot((slot.snapshot_id,)))
            slot.snapshot_id = None
        self._finish(slot, slot.finish_reason or self._abort_reason(slot))
        return True

    async def _step(self) -> None:
        """One lockstep decode step over every live row."""
        rows = self._running
        tokens = tuple(s.next_token for s in rows)
        ride, self._riding = self._riding, None
        plan = None
        if ride is not None and not ride.done and ride.prefilled < len(ride.prompt_ids):
            plan = await self._plan_prefill(ride, self._ride_budget())
        self._sampled_seconds = 0.0
        began = time.perf_counter()
        job = ForwardLogitsBatch(
            tokens,  # type: ignore[arg-type]
            sample=self._sampling(rows),
            prefill=plan.job if plan is not None else None,
        )
        result: ForwardResult = await self._call(job)
        elapsed = time.perf_counter() - began - self._sampled_seconds
        if plan is None:
            self._step_seconds = _ema(self._step_seconds, elapsed)
            self._timing["forward"] += elapsed
        else:
            assert ride is not None and result.prefill is not None
            n = len(plan.job.token_ids)
            extra = max(0.0, elapsed - self._step_seconds)
            self._ride_seconds_per_token = _ema(self._ride_seconds_per_token, extra / n)
            self._timing["forward"] += elapsed - extra
            self._timing["prefill"] += extra
            self._counts["riding_chunks"] += 1
            self._prefilled(ride, plan, result.prefill)
        c = self._counts
        c["decode_steps"] += 1
        c["decoded_rows"] += len(rows)
        c["multi_row_steps"] += len(rows) > 1
        self._batch_size_steps[len(rows)] = self._batch_size_steps.get(len(rows), 0) + 1
        if len(rows) == 1:
            if self._joining:
                self._alone_steps["peer_prefilling"] += 1
            else:
                self._alone_steps["peer_queued" if self._waiting else "no_peer"] += 1
        c["max_batch_size"] = max(c["max_batch_size"], len(rows))
        c["padded_kv_columns"] += self._padding_columns
        c["kv_columns"] += sum(s.total_tokens for s in rows)  # fed tokens, this step's included
        c["max_kv_tokens"] = max(c["max_kv_tokens"], self._kv_held())
        assert result.tokens is not None
        for slot, token in zip(rows, result.tokens, strict=True):
            if not slot.done and token is not None:
                self._accept(slot, token)

    def _sampling(self, slots: Sequence[Slot]) -> RowSampler:
        """Samples the slots' rows on the worker thread, so that no tensor operation runs on
        the event loop's thread: two threads running parallel ops make OpenMP's teams
        oversubscribe the cores and both run slower. A slot done by now gets no token."""
        samplers = tuple(None if s.done else s.sampler for s in slots)

        def sample(logits: Any) -> list[int | None]:
            began = time.perf_counter()
            try:
                return sample_rows(samplers, logits)
            finally:
                # a job may sample twice (the rows, and a riding chunk's first token)
                spent = time.perf_counter() - began
                self._sampled_seconds += spent
                self._timing["sampling"] += spent

        return sample

    def _accept(self, slot: Slot, token: int) -> None:
        """Records a sampled token, hands it to the router, and decides EOS / length."""
        slot.output_ids.append(token)
        slot.next_token = token
        self._counts["generated_tokens"] += 1
        logprob = slot.sampler.take_logprob()  # sampled with the token, on the worker thread
        self._send(slot, token if logprob is None else logprob)
        if token in slot.stop_ids:
            slot.finish_reason = FinishReason.STOP
        elif (
            len(slot.output_ids) >= slot.params.max_tokens or slot.total_tokens >= self.context_len
        ):
            slot.finish_reason = FinishReason.LENGTH

    @staticmethod
    def _abort_reason(slot: Slot) -> FinishReason:
        # a router-requested leave (stop string) was already reported by the router itself
        return FinishReason.STOP if slot.leave_requested else FinishReason.ABORT

    def _send(self, slot: Slot, message: RouterMessage) -> None:
        # the router may have ended already (stop string, consumer gone)
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            slot.to_router.send_nowait(message)

    def _finish(
        self, slot: Slot, reason: FinishReason, error: str | None = None, *, counted: bool = False
    ) -> None:
        """Ends a request: its final message to the router, and the counters (`counted`: the
        caller has counted it already)."""
        if slot.status is SlotStatus.FINISHED:
            return
        if slot.status is SlotStatus.WAITING and slot.snapshot_id is not None:
            # a copy of an n > 1 request, cloned while it waited for a row
            self._worker.submit(DropKvSnapshot((slot.snapshot_id,)))
            slot.snapshot_id = None
        slot.status = SlotStatus.FINISHED
        self._send(slot, Finish(reason, error))
        slot.to_router.close()
        if counted or slot.cancelled:
            pass  # timed out, or cancelled: counted when it happened
        elif reason is FinishReason.ERROR:
            self._counts["failed"] += 1
        else:
            self._counts["finished"] += 1
            elapsed = time.monotonic() - slot.arrived_at
            self._request_seconds = _ema(self._request_seconds, elapsed)

    def _fail(self, exc: BaseException) -> None:
        """A worker fault: every active request fails, and later ones fail fast."""
        self._healthy = False
        # a worker's own errors say what broke (a lost tensor-parallel rank); others, their type
        why = str(exc) if isinstance(exc, WorkerError) else type(exc).__name__
        self._failure = f"model {self.name!r} failed and is unavailable ({why})"
        for slot in self._active():
            self._finish(slot, FinishReason.ERROR, self._failure)
        self._running.clear()
        self._joining.clear()
        self._waiting.clear()
        self._idle.set()

    def _active(self) -> list[Slot]:
        return [*self._running, *self._joining, *self._waiting]


MIN_CHUNK = 16  # the fewest prompt tokens a chunk prefills


@dataclass(frozen=True)
class PrefillPlan:
    """A prompt chunk's Prefill job, and what booking its result needs."""

    job: Prefill
    last: bool  # it ends the prompt: it samples the first token
    clones: list[Slot]  # the request's other copies (n > 1), filled by the last chunk
    session_id: int | None  # a session's snapshot read for this chunk only: dropped after


NORMS = ("input_norm", "post_norm")  # per-layer weights a fingerprint of a bare model hashes


class PrefillCost:
    """Fits prefill time = fixed + per_token * tokens over the recent prefills run on their own.
    The fixed part is reading every weight once, which a chunk riding a decode step does not
    pay: its per-token part is what such a chunk costs at the least (see _ride_budget)."""

    def __init__(self, window: int = 32) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, tokens: int, seconds: float) -> None:
        self._samples.append((tokens, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before there are samples."""
        if not self._samples:
            return None
        n = len(self._samples)
        mean_x = sum(x for x, _ in self._samples) / n
        mean_y = sum(y for _, y in self._samples) / n
        var = sum((x - mean_x) ** 2 for x, _ in self._samples)
        if var > 0:
            slope = sum((x - mean_x) * (y - mean_y) for x, y in self._samples) / var
            fixed = mean_y - slope * mean_x
            if slope > 0 and fixed >= 0:
                return fixed, slope
        # one chunk size only, or a fit that makes no sense: all of it per token
        return 0.0, mean_y / max(mean_x, 1e-9)


def calibration_ids(hf_model: Any, tokenizer: PreTrainedTokenizerBase, quantize: str) -> list[int]:
    """The tokens a quantized model's activation ranges are measured on (none for "none")."""
    if quantize == "none":
        return []
    return list(tokenizer.encode(CALIBRATION_TEXT)[: hf_model.config.max_position_embeddings])


def eos_token_ids(hf_model: Any, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The end-of-sequence ids of a transformers model: its generation config's, its config's
    and its tokenizer's."""
    eos: set[int] = set()
    for source in (getattr(hf_model, "generation_config", None), hf_model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            eos.add(value)
        elif isinstance(value, (list, tuple)):
            eos.update(v for v in value if isinstance(v, int))
    return sorted(eos)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens two sequences share from the start."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _ema(average: float, sample: float, weight: float = 0.2) -> float:
    """Exponential moving average; the first sample stands alone."""
    return sample if not average else (1 - weight) * average + weight * sample
