"""The per-model engine: submit, stream, stats, drain; its loop schedules, runs and updates."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import anyio
import torch
from anyio.abc import TaskGroup
from transformers import PreTrainedTokenizerBase

from neuronpy.arch.llama import LlamaModel
from neuronpy.arch.mixer import STATE_BLOCK
from neuronpy.config import EngineConfig
from neuronpy.engine import harmony
from neuronpy.engine.admission import Admission
from neuronpy.engine.compiles import Compiles
from neuronpy.engine.counters import EngineStats, StepProfile
from neuronpy.engine.embeddings import Embedder, Pooling
from neuronpy.engine.grammar import Grammars, Reasoning
from neuronpy.engine.lifecycle import Messages
from neuronpy.engine.reasoning import prompt_opens_reasoning
from neuronpy.engine.request import Cause, Finish, Request, RouterMessage
from neuronpy.engine.router import route
from neuronpy.engine.runner import Runner
from neuronpy.engine.sampling import Sampler
from neuronpy.engine.scheduler import Scheduler
from neuronpy.engine.sessions import dtype_name
from neuronpy.engine.speculative import SpeculativeConfig
from neuronpy.engine.stream import Generates, RequestStream
from neuronpy.engine.types import GenerationEvent, SamplingParams, SessionRequest
from neuronpy.engine.wire import EngineInfo, ModelFacts
from neuronpy.errors import (
    EngineUnhealthyError,
    InvalidRequestError,
    ShuttingDownError,
    WorkerError,
)
from neuronpy.worker.jobs import ProfileResult, StartProfile, StopProfile, WorkerStatsResult
from neuronpy.worker.session_files import model_fingerprint, session_metadata
from neuronpy.worker.worker import DeviceWorker

__all__ = ["Engine", "EngineStats", "RequestStream"]


class Outlet(Protocol):
    """Where one request's router messages go: its router task's inbox, or an engine
    process's channel to the router in the server's process (engine/host.py)."""

    def send_nowait(self, message: RouterMessage) -> None: ...

    def close(self) -> None: ...


log = logging.getLogger(__name__)

# embedding inputs that may wait per admission slot (max_in_flight + max_queue)
MAX_INPUTS_PER_SLOT = 16


def kv_bytes_per_token(model: LlamaModel) -> int:
    """K and V, every attention layer: what one token of a sequence's context takes (a
    hybrid's fixed-size states are per sequence, not per token: see `state_bytes`; latent
    attention caches its latent and shared key alone)."""
    c = model.config
    width = c.head_dim + c.cached_value_dim
    return model.num_kv_layers * c.num_kv_heads * width * model.dtype.itemsize


# A reranker's answer tokens, in the order its scores read them: P(yes) = softmax(no, yes)[1]
RERANK_TOKENS = ("no", "yes")


def rerank_token_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The ids of RERANK_TOKENS, each one token of `tokenizer` (ValueError otherwise)."""
    ids = []
    for word in RERANK_TOKENS:
        encoded = tokenizer.encode(word, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"a reranker's tokenizer must have {word!r} as one token")
        ids.append(encoded[0])
    return tuple(ids)


class Engine(Generates):
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
        task: str = "generate",
        pooling: Pooling | None = None,
        source: tuple[int, str] = (0, ""),
        processor: Any = None,
    ) -> None:
        """`worker`: the device worker to run jobs on (one driving other processes, for
        tensor parallelism); by default a DeviceWorker of its own over `model`. `fingerprint`:
        what identifies the weights in saved sessions (the composition root hashes the
        checkpoint's; by default a hash of the embeddings and norms). `task`: "generate"
        (generations, and embeddings of the hidden states) or "embed" (embeddings only);
        `pooling`: how embeddings pool (by default the last token's, normalized). `source`:
        the checkpoint's parameter count and how it stores them (ModelFacts). `processor`: a
        vision-language model's (transformers'): what turns a conversation's images into
        the prompt's media (its worker then holds the vision tower)."""
        self.model = model
        self.processor = processor
        self._source = source
        self.tokenizer = tokenizer
        self.name = name
        self.config = config = config or EngineConfig()
        self.context_len = model.config.context_len
        self.vocab_size = model.config.vocab_size
        # (a harmony tokenizer's reply-ending tokens, <|return|> and <|call|>, end every reply
        # even where the checkpoint's generation config leaves them out)
        self.eos_token_ids = harmony.stop_token_ids(tokenizer, eos_token_ids)
        self.max_running = config.max_in_flight if config.batching else 1
        self.kv_bytes_per_token = kv_bytes_per_token(model)
        kv_budget = int(config.kv_budget)
        self.kv_budget_tokens = kv_budget // self.kv_bytes_per_token
        if kv_budget and not self.kv_budget_tokens:
            raise ValueError(
                f"kv_budget {kv_budget} holds no token of this model's KV "
                f"({self.kv_bytes_per_token} bytes per token)"
            )
        self.fingerprint = fingerprint or model_fingerprint(
            model.identity(), extra=(config.quantize,)
        )
        self._worker = worker or DeviceWorker(model, name, config.prefill_chunk)
        if config.speculative == "draft" and self._worker.drafts is None:
            raise ValueError(f'model {name!r}: speculative = "draft" needs its draft model loaded')
        drafts = self._worker.drafts
        speculative = SpeculativeConfig(
            config.speculative,
            config.num_speculative_tokens,
            config.prompt_lookup_min,
            config.prompt_lookup_max,
            config.max_drafts_per_step,
            # (the draft model's KV counts in the budget, in this model's tokens)
            kv_bytes_per_token(drafts.model) / self.kv_bytes_per_token if drafts else 0.0,
        )
        self._scheduler = Scheduler(
            name=name,
            max_running=self.max_running,
            max_queue=config.max_queue,
            queue_timeout=config.queue_timeout,
            context_len=self.context_len,
            vocab_size=self.vocab_size,
            kv_budget_tokens=self.kv_budget_tokens,
            prefix_cache_bytes=config.prefix_cache_bytes if config.prefix_cache else 0,
            chunk_steps=config.chunk_steps,
            prefill_chunk=config.prefill_chunk,
            speculative=speculative,
            state_block=STATE_BLOCK if model.has_states else 0,
        )
        self._runner = Runner(
            self._worker,
            fingerprint=self.fingerprint,
            session_metadata=lambda: session_metadata(name, self.fingerprint, model.dtype),
            on_saved=self._saved,
            spawn=self._spawn,
            speculative=speculative,
        )
        assert isinstance(config.max_compile_bytes, int)
        self.grammars = Grammars(
            tokenizer,
            self.vocab_size,
            sorted(self.eos_token_ids),
            config.grammar_cache_bytes,
            compile_seconds=config.max_compile_seconds,
            compile_bytes=config.max_compile_bytes,
            token_seconds=config.max_mask_ms / 1000,
        )
        self.compiles = Compiles(self.grammars, name, config.max_compiles, config.max_queue)
        self.admission = Admission(
            name=name,
            max_n=config.max_n,
            max_running=self.max_running,
            max_queue=config.max_queue,
            context_len=self.context_len,
            vocab_size=self.vocab_size,
            kv_budget_tokens=self.kv_budget_tokens,
            eos_token_ids=self.eos_token_ids,
            grammar_stop_ids=self.grammars.stop_ids,
            sessions=self._worker.supports_sessions,
            draft_model=self._worker.drafts is not None,
            vision=getattr(self._worker, "vision", None) is not None,
        )
        if task not in ("generate", "embed", "rerank"):
            raise ValueError(f"task must be 'generate', 'embed' or 'rerank', got {task!r}")
        self.task = task
        self.embedder = Embedder(
            self._worker,
            pooling or Pooling(),
            batch_tokens=config.prefill_chunk,
            max_waiting=max(1, config.max_queue + config.max_in_flight) * MAX_INPUTS_PER_SLOT,
            name=name,
            score_ids=rerank_token_ids(tokenizer) if task == "rerank" else None,
        )
        self._routers: dict[int, Outlet] = {}
        self._healthy = False
        self._failure: str | None = None
        self._refusal: str | None = None  # why submit refuses: set when shutting down
        self._wake = anyio.Event()
        self._idle = anyio.Event()  # set whenever nothing is admitted: drain waits on it
        self._tg: TaskGroup | None = None
        self._turns = 0  # of the loop (see loop_turns)

    # ---- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> Engine:
        self._worker.start()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._healthy = True
        self._tg.start_soon(self._loop, name=f"neuronpy-engine-{self.name}")
        self.compiles.start(self._tg)
        self._tg.start_soon(self.embedder.run, name=f"neuronpy-embeddings-{self.name}")
        self._tg.start_soon(self._warm_grammars, name=f"neuronpy-grammars-{self.name}")
        return self

    async def _warm_grammars(self) -> None:
        """The vocabulary indexed for constrained decoding (~0.2 s for 49k tokens), on a
        thread, so that the first constrained request does not wait for it; a failure here
        is the first constrained request's to report."""
        try:
            await anyio.to_thread.run_sync(self.grammars.warm)
        except Exception:
            log.warning("could not index %s's vocabulary for constraints", self.name, exc_info=True)

    async def __aexit__(self, *exc_info: Any) -> None:
        self._healthy = False
        self._failure = self._failure or "the engine has shut down"
        self._deliver(self._scheduler.end_all(Cause.ABORTED))
        self.embedder.fail_all(ShuttingDownError(self._failure))
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)
        await anyio.to_thread.run_sync(self._worker.shutdown, 30.0)

    @property
    def drafts_with_model(self) -> bool:
        """Whether a draft model drafts for this model (speculative "draft")."""
        return self._worker.drafts is not None

    @property
    def supports_sessions(self) -> bool:
        """Whether requests may continue from and save into session files (not across
        tensor-parallel ranks)."""
        return self._worker.supports_sessions

    @property
    def healthy(self) -> bool:
        """Whether the engine serves: started, not failed, its worker not broken (a lost
        tensor-parallel rank). Reading it changes nothing."""
        return self._healthy and self._worker.broken is None

    def _unavailable(self) -> str:
        return self.failure or f"model {self.name!r} is not ready"

    @property
    def failure(self) -> str | None:
        """Why it no longer serves (a fault of the device or the model), or None."""
        if self._failure is None and self._worker.broken is not None:
            return self._failed(self._worker.broken)
        return self._failure

    @property
    def facts(self) -> ModelFacts:
        """What the server says of the model: its kind, sizes, dtype, weights and device."""
        model, c = self.model, self.model.config
        return ModelFacts(
            model_type=c.model_type,
            hidden_size=c.hidden_size,
            dtype=dtype_name(model.dtype),
            num_kv_layers=model.num_kv_layers,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            weight_bytes=model.weight_bytes(),
            device=model.device.type,
            parameters=self._source[0],
            file_type=self._source[1],
        )

    @property
    def pooling(self) -> Pooling:
        """How its embeddings pool the hidden states."""
        return self.embedder.pooling

    def info(self) -> EngineInfo:
        """Its fixed facts, for a client in another process (engine/remote.py)."""
        return EngineInfo(
            name=self.name,
            config=self.config,
            admission=self.admission,
            facts=self.facts,
            task=self.task,
            pooling=self.pooling,
            fingerprint=self.fingerprint,
            kv_capacity_tokens=self.kv_capacity_tokens,
        )

    def _failed(self, why: str) -> str:
        return f"model {self.name!r} failed and is unavailable ({why})"

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
        labels: Sequence[str | None] = (),
    ) -> list[RequestStream]:
        """Admits `n` completions of one prompt (OpenAI's `n`), or raises before anything is
        allocated; each copy counts as one request against max_in_flight and max_queue. The
        prompt is prefilled once and its snapshot cloned into each copy. Copy i samples with
        its own sampler, seeded `seed + i` when `params.seed` is set.

        `session`: continue from that session's saved KV (as much of it as starts the prompt)
        and, when the request ends on its own, save its KV there (see engine/sessions.py).
        `labels`: what its client and the server's log call each copy (none: empty)."""
        admitted = self.admit(prompt_ids, params, n, session, labels)
        return [self._start_router(r) for r in admitted]

    def admit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        n: int,
        session: SessionRequest | None = None,
        labels: Sequence[str | None] = (),
    ) -> list[Request]:
        """What `submit_many` does but route: admits the `n` completions (or raises before
        anything is allocated) with their samplers; their caller routes their messages (a
        router task each, or `attach`) before it awaits anything."""
        prompt = self.admission.check(prompt_ids, params, n, session)
        reasoning = self._reasoning(prompt, params)
        if params.constraint is not None:  # (compiles here unless prepare() did)
            self.grammars.compile(params.constraint, reasoning)
        if not self.healthy:
            raise EngineUnhealthyError(self._unavailable())
        if self._refusal is not None:
            raise ShuttingDownError(self._refusal)
        copies = self.admission.copies(params, n)
        stop_ids = self.admission.stop_ids(params)
        requests = self._scheduler.admit(prompt, copies, stop_ids, session, labels=labels)
        for request in requests:
            self._start_sampler(request, reasoning)
        self._idle = anyio.Event()
        self._wake.set()
        return requests

    def attach(self, request: Request, outlet: Outlet) -> None:
        """Where an admitted request's router messages go instead of a router task of this
        process's (an engine served to another process: engine/host.py); `outlet` is closed
        after its Finish."""
        self._routers[request.id] = outlet

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """What `submit` checks of a prompt and its parameters, without admitting anything:
        InvalidRequestError (too long for the context, ids outside the vocabulary, ...)."""
        self.admission.check_prompt(prompt_ids, params)

    def _reasoning(self, prompt_ids: Sequence[int], params: SamplingParams) -> Reasoning | None:
        """The reply's reasoning block before its constraint, if it has both."""
        parser = params.output.reasoning
        if params.constraint is None or parser is None:
            return None
        return parser, prompt_opens_reasoning(self.tokenizer, prompt_ids, parser)

    async def prepare(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Compiles the request's constraint (if any, and not cached) on a thread, so that
        `submit` does not block the event loop on it; InvalidRequestError naming the
        constraint's field when it cannot be compiled, QueueFullError past max_compiles
        compiling and max_queue waiting (see Compiles)."""
        if params.constraint is not None:
            await self.compiles.compile(params.constraint, self._reasoning(prompt_ids, params))

    def _start_sampler(self, request: Request, reasoning: Reasoning | None) -> None:
        """The request's sampler, with its grammar's matcher when constrained."""
        constraint = request.params.constraint
        matcher = None if constraint is None else self.grammars.matcher(constraint, reasoning)
        sampler = Sampler(request.params, request.prompt_ids, self.vocab_size, matcher)
        self._runner.add_sampler(request.id, sampler)

    def _start_router(self, request: Request) -> RequestStream:
        """The request's router task and its event stream."""
        to_router, inbox = anyio.create_memory_object_stream[RouterMessage](math.inf)
        # bounded: a consumer that stops reading ends its request (see route)
        bound = self.config.max_buffered_events
        outbox, events = anyio.create_memory_object_stream[GenerationEvent](bound)
        self._routers[request.id] = to_router
        assert self._tg is not None
        self._tg.start_soon(
            lambda: route(
                inbox,
                outbox,
                tokenizer=self.tokenizer,
                prompt_ids=request.prompt_ids,
                params=request.params,
                silent_ids=request.stop_ids,
                request_leave=lambda: self.leave(request),
            ),
            name=f"neuronpy-router-{request.id}",
        )
        return RequestStream(request, events, self.cancel)

    def stats(self) -> EngineStats:
        g = self.grammars
        return dataclasses.replace(
            self._scheduler.stats(self.healthy),
            grammars_compiled=g.compiled,
            grammar_compile_seconds=g.compile_seconds,
            grammar_cache_bytes=g.cache_bytes_used,
        )

    @property
    def idle(self) -> bool:
        """Whether nothing is admitted (nor writing its session): the loop sleeps until a
        submit wakes it."""
        return self._idle.is_set()

    @property
    def loop_turns(self) -> int:
        """Turns the engine's loop has taken (a diagnostic): each one moves something on, and
        an engine with nothing admitted takes none."""
        return self._turns

    @property
    def kv_capacity_tokens(self) -> int:
        """The KV the running requests may hold, in tokens: the KV budget, or without one
        max_in_flight rows of the whole context."""
        return self.kv_budget_tokens or self.max_running * self.context_len

    def rows(self) -> list[dict[str, object]]:
        """Each admitted request: id, state, prompt tokens, tokens so far (the batch view)."""
        return self._scheduler.rows()

    async def batch_rows(self) -> list[dict[str, object]]:
        """`rows()`, as a client of an engine in another process asks for them too."""
        return self.rows()

    def retry_after(self) -> float:
        """Seconds until a row is likely free: the queue ahead at the measured request time."""
        return self._scheduler.retry_after()

    def stop_admitting(self, reason: str = "the server is shutting down") -> None:
        """From now on `submit` raises ShuttingDownError(reason); admitted requests carry on."""
        self._refusal = reason
        self.embedder.stop_admitting(reason)

    async def embed(self, inputs: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Each input's pooled hidden states (`self.embedder.pooling`): one float32 vector
        each, batched with the inputs of concurrent requests (engine/embeddings.py).
        InvalidRequestError for an empty input or one longer than the context (the index
        named as `input[i]`); EngineUnhealthyError, ShuttingDownError, QueueFullError."""
        if not self.healthy:
            raise EngineUnhealthyError(self._unavailable())
        for i, ids in enumerate(inputs):
            if not ids:
                raise InvalidRequestError(f"input[{i}] is empty", f"input[{i}]")
            if len(ids) > self.context_len:
                raise InvalidRequestError(
                    f"input[{i}] has {len(ids)} tokens; model '{self.name}' takes at most "
                    f"{self.context_len}",
                    f"input[{i}]",
                )
        return await self.embedder.embed(inputs)

    async def drain(self, timeout: float) -> int:
        """Waits up to `timeout` seconds for every admitted request to end, then aborts the rest
        (finish reason abort). Returns how many were aborted. Call stop_admitting first."""
        s = self._scheduler
        if not s.idle:
            with anyio.move_on_after(timeout):
                await self._idle.wait()
        aborted = sum(not r.status.finished for r in s.active())
        self._deliver(s.end_all(Cause.ABORTED, "the server is shutting down"))
        if aborted:
            self._wake.set()  # the loop drops the aborted rows at its next schedule
        return aborted

    async def worker_stats(self) -> WorkerStatsResult:
        """What the device worker holds: snapshots, bytes, live batch (for leak checks)."""
        return await self._runner.worker_stats()

    async def profile(self, seconds: float, until: anyio.Event | None = None) -> StepProfile:
        """Records where the engine's steps spend the next `seconds` (or until `until` is set,
        if sooner): torch.profiler on the device worker, CPU time of the event loop's thread.
        A diagnostic that slows each operation a little while it records; call it from the
        engine's event loop."""
        before, cpu = self.stats(), time.thread_time()
        await self._runner.call(StartProfile())
        try:
            with anyio.move_on_after(seconds):
                await (until.wait() if until is not None else anyio.sleep(seconds))
        finally:
            with anyio.CancelScope(shield=True):
                result: ProfileResult = await self._runner.call(StopProfile())
        after, cpu = self.stats(), time.thread_time() - cpu
        return StepProfile(
            seconds=result.seconds,
            decode_steps=after.decode_steps - before.decode_steps,
            decoded_rows=after.decoded_rows - before.decoded_rows,
            worker_busy=result.busy_seconds,
            op_seconds=dict(result.op_seconds),
            op_calls=result.op_calls,
            event_loop_cpu=cpu,
            timing={k: v - before.timing.get(k, 0.0) for k, v in after.timing.items()},
        )

    # ---- from the routers and streams ---------------------------------------------------------

    def cancel(self, request: Request) -> None:
        """Its client has gone: it ends (a queued request never runs)."""
        self._scheduler.cancel(request)
        self._wake.set()

    def leave(self, request: Request) -> None:
        """Its router ended its stream (a stop string): its row leaves at the next step."""
        self._scheduler.leave(request)
        self._wake.set()

    def _saved(self, request_id: int, error: str | None) -> None:
        self._deliver(self._scheduler.record_saved(request_id, error))
        self._wake.set()

    def _spawn(self, fn: Callable[[], Awaitable[None]], name: str) -> None:
        assert self._tg is not None
        self._tg.start_soon(fn, name=name)

    # ---- the loop: schedule, run, update, deliver ------------------------------------------------

    async def _loop(self) -> None:
        """While anything is admitted (or housekeeping waits): the scheduler plans, the runner
        runs the plan, the scheduler records its outcome, the routers get their messages. A turn
        that moves nothing on is a bug: the scheduler fails what it strands rather than let the
        loop spin. With nothing admitted it sleeps until a submit (or a session written) wakes
        it."""
        s = self._scheduler
        try:
            while True:
                if not s.has_work:
                    if not s.saving:  # (a session's write wakes the loop when done)
                        self._idle.set()
                    self._wake = anyio.Event()
                    await self._wake.wait()
                    continue
                self._turns += 1
                plan = s.schedule()
                outcome = await self._runner.run(plan)
                self._deliver(s.update(plan, outcome))
                await anyio.sleep(0)  # let routers and submitters run
        except Exception as exc:
            log.exception("engine for %s failed; marking it unhealthy", self.name)
            self._fail(exc)

    def _deliver(self, messages: Messages) -> None:
        """Hands the scheduler's messages to the routers; a Finish ends the router's inbox."""
        for request, message in messages:
            to_router = self._routers.get(request.id)
            if to_router is None:
                continue
            # the router may have ended already (stop string, consumer gone)
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                to_router.send_nowait(message)
            if isinstance(message, Finish):
                to_router.close()
                del self._routers[request.id]
                self._runner.drop_sampler(request.id)

    def _fail(self, exc: BaseException) -> None:
        """A fault of the device or the model: every active request fails, later ones fail
        fast."""
        self._healthy = False
        # a worker's own errors say what broke (a lost tensor-parallel rank); others, their type
        why = str(exc) if isinstance(exc, WorkerError) else type(exc).__name__
        self._failure = self._failed(why)
        messages = self._scheduler.end_all(Cause.FAILED, self._failure)
        self._scheduler.clear()
        self.embedder.fail_all(EngineUnhealthyError(self._failure))
        self._deliver(messages)
        self._idle.set()
