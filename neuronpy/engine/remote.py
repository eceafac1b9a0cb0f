"""An engine in a process of its own, as the server's process uses it: `EngineClient` has the
Engine's interface (submit, streams, stats, drain, embed), and each request's router task
(detokenizing, stop strings, reasoning and tool-call markup) runs here, where its client's
stream is. The engine's side of the channel is engine/host.py; the process is started by
neuronpy/engine_process.py.

Why a process: the server's event loop (HTTP, JSON, SSE, detokenizing) and the engine's
device worker share one GIL in one process, and each time the worker hands it over between
two operations it may wait for the loop's next switch (a busy loop made a 28 ms compiled step
take 0.2 s). In its own process the engine's step waits for nothing of the server's."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import socket
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Union

import anyio
from anyio.abc import ObjectSendStream, TaskGroup
from transformers import PreTrainedTokenizerBase

from neuronpy.engine.channel import Channel
from neuronpy.engine.counters import EngineStats, StepProfile
from neuronpy.engine.embeddings import Pooling
from neuronpy.engine.engine import Engine
from neuronpy.engine.request import Finish, RouterMessage
from neuronpy.engine.router import route
from neuronpy.engine.stream import Generates, RequestStream
from neuronpy.engine.types import FinishReason, GenerationEvent, SamplingParams, SessionRequest
from neuronpy.engine.wire import (
    Call,
    Cancel,
    Close,
    EngineInfo,
    Facts,
    Frame,
    Leave,
    ModelFacts,
    Reply,
    Status,
    Submit,
)
from neuronpy.errors import EngineUnhealthyError, QueueFullError, ShuttingDownError

log = logging.getLogger(__name__)

CLOSE_SECONDS = 30.0  # an engine process's own shutdown, before it is killed


class RemoteRequest:
    """A request as the server's process knows it: what its stream reports of it, updated
    from the engine's frames."""

    def __init__(
        self,
        client: EngineClient,
        id: int,
        index: int,
        prompt_ids: tuple[int, ...],
        label: str | None = None,
    ):
        self._client = client
        self.id = id
        self.index = index
        self.prompt_ids = prompt_ids
        self._label = label
        self.cached_tokens = 0
        self.drafts = (0, 0)
        self.queue_seconds: float | None = None

    @property
    def label(self) -> str | None:
        return self._label

    def learn(self, facts: Facts) -> None:
        self.cached_tokens = facts.cached_tokens
        self.drafts = facts.drafts
        self.queue_seconds = facts.queue_seconds


@dataclass
class _Waiting:
    """A call's answer, once it comes."""

    done: anyio.Event = field(default_factory=anyio.Event)
    reply: Reply | None = None


class EngineClient(Generates):
    """An engine in another process, behind the Engine's interface. Enter it (`async with`)
    on the event loop that uses it; the process ends when it is exited."""

    def __init__(
        self,
        info: EngineInfo,
        tokenizer: PreTrainedTokenizerBase,
        status: Status,
        sock: socket.socket,
        process: subprocess.Popen[bytes] | None = None,
        processor: Any = None,
    ) -> None:
        self.info = info
        self.processor = processor
        self.name = info.name
        self.config = info.config
        self.admission = info.admission
        self.tokenizer = tokenizer
        self.context_len = info.admission.context_len
        self.vocab_size = info.admission.vocab_size
        self.eos_token_ids = info.admission.eos_token_ids
        self.max_running = info.admission.max_running
        self.kv_capacity_tokens = info.kv_capacity_tokens
        self.task = info.task
        self.fingerprint = info.fingerprint
        self._sock = sock
        self.process = process
        self._channel: Channel | None = None
        self._tg: TaskGroup | None = None
        self._routers: dict[int, tuple[RemoteRequest, ObjectSendStream[RouterMessage]]] = {}
        self._ids = itertools.count(1)
        self._calls: dict[int, _Waiting] = {}
        self._call_ids = itertools.count(1)
        self._status = status
        self._rejected = 0  # refused here at admission (the engine never saw them)
        self._refusal: str | None = None
        self._failure: str | None = None
        self._closing = False
        self.lost = anyio.Event()  # set when the engine process ended on its own

    @property
    def facts(self) -> ModelFacts:
        return self.info.facts

    @property
    def pooling(self) -> Pooling:
        return self.info.pooling

    @property
    def admitted(self) -> int:
        """Requests admitted here whose end the engine has not reported yet."""
        return len(self._routers)

    @property
    def supports_sessions(self) -> bool:
        return self.admission.sessions

    @property
    def drafts_with_model(self) -> bool:
        return self.admission.draft_model

    # ---- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> EngineClient:
        self._channel = await Channel.open(self._sock)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._read, name=f"neuronpy-engine-client-{self.name}")
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self._closing = True
        self._failure = self._failure or "the engine has shut down"
        self.send(Close())
        if self.process is not None:  # (it ends whatever cancelled the caller)
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._end_process)
        self._end_all(self._failure)
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)
        if self._channel is not None:
            self._channel.close()

    def _end_process(self) -> None:
        assert self.process is not None
        try:
            self.process.wait(CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            log.warning("%s: the engine process did not stop in %g s; killing it", self.name,
                        CLOSE_SECONDS)  # fmt: skip
            self.process.kill()
            self.process.wait()

    # ---- the engine's side --------------------------------------------------------------------

    def send(self, message: object) -> None:
        if self._channel is None or self.lost.is_set():
            return  # not started, or the process has gone: nothing is listening
        # (gone meanwhile: the reader sees the channel's end and fails what is admitted)
        with contextlib.suppress(ConnectionError):
            self._channel.send(message)

    async def _read(self) -> None:
        assert self._channel is not None
        while True:
            try:
                message = await self._channel.receive()
            except EOFError:
                break
            if isinstance(message, Frame):
                self._take(message)
            elif isinstance(message, Reply):
                waiting = self._calls.pop(message.call, None)
                if waiting is not None:
                    waiting.reply = message
                    waiting.done.set()
        if not self._closing:
            await self._lose()

    def _take(self, frame: Frame) -> None:
        self._status = frame.status
        for id, facts in frame.facts:
            if (entry := self._routers.get(id)) is not None:
                entry[0].learn(facts)
        for id, message in frame.messages:
            entry = self._routers.get(id)
            if entry is None:
                continue
            to_router = entry[1]
            # (its router may have ended already: a stop string, its consumer gone)
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                to_router.send_nowait(message)
            if isinstance(message, Finish):
                to_router.close()
                del self._routers[id]

    async def _lose(self) -> None:
        """The engine process has gone on its own: every request it held fails, and so does
        every later one, until the model is started again."""
        code = None
        if self.process is not None:
            with anyio.move_on_after(5):
                code = await anyio.to_thread.run_sync(self.process.wait)
        how = f"exit code {code}" if code is None or code >= 0 else f"killed by signal {-code}"
        self._failure = (
            f"model {self.name!r} failed and is unavailable (its engine process ended: {how})"
        )
        log.error("%s", self._failure)
        self._end_all(self._failure)
        self.lost.set()

    def _end_all(self, why: str) -> None:
        for _, to_router in self._routers.values():
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                to_router.send_nowait(Finish(FinishReason.ERROR, why))
            to_router.close()
        self._routers.clear()
        for waiting in self._calls.values():
            waiting.reply = Reply(0, error=EngineUnhealthyError(why))
            waiting.done.set()
        self._calls.clear()

    async def _call(self, method: str, *args: Any) -> Any:
        if self._failure is not None:
            raise EngineUnhealthyError(self._failure)
        call = next(self._call_ids)
        waiting = self._calls[call] = _Waiting()
        try:
            self.send(Call(call, method, args))
            await waiting.done.wait()
        finally:
            self._calls.pop(call, None)
        assert waiting.reply is not None
        if waiting.reply.error is not None:
            raise waiting.reply.error
        return waiting.reply.value

    # ---- the Engine's interface ----------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self._failure is None and self._status.healthy

    @property
    def failure(self) -> str | None:
        return self._failure or self._status.failure

    def stats(self) -> EngineStats:
        s = self._status.stats
        return replace(s, rejected=s.rejected + self._rejected, healthy=self.healthy)

    def retry_after(self) -> float:
        return self._status.retry_after

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        self.admission.check_prompt(prompt_ids, params)

    async def prepare(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if params.constraint is not None:
            await self._call("prepare", tuple(prompt_ids), params)

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> RequestStream:
        return self.submit_many(prompt_ids, params, 1)[0]

    def submit_many(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        n: int,
        session: SessionRequest | None = None,
        labels: Sequence[str | None] = (),
    ) -> list[RequestStream]:
        """As Engine.submit_many: checked here by the engine's own rules (Admission), so a
        refusal is raised before anything is sent; the engine checks again, and a request it
        refuses after all (it failed meanwhile) ends with that error."""
        if labels and len(labels) != n:
            raise ValueError(f"{len(labels)} labels for {n} copies")
        prompt = self.admission.check(prompt_ids, params, n, session)
        if not self.healthy:
            raise EngineUnhealthyError(self.failure or f"model {self.name!r} is not ready")
        if self._refusal is not None:
            raise ShuttingDownError(self._refusal)
        # every request not yet finished here counts, so this refuses no later than the engine
        if self.admitted + n > self.max_running + self.config.max_queue:
            self._rejected += 1
            raise QueueFullError(
                f"model {self.name!r} is at capacity ({self.max_running} running, "
                f"{self.config.max_queue} queued); retry later",
                retry_after=self.retry_after(),
            )
        stop_ids = self.admission.stop_ids(params)
        streams = []
        ids = []
        for index, copy in enumerate(self.admission.copies(params, n)):
            label = labels[index] if labels else None
            request = RemoteRequest(self, next(self._ids), index, prompt, label)
            streams.append(self._start_router(request, copy, stop_ids))
            ids.append(request.id)
        self.send(Submit(tuple(ids), prompt, params, session, tuple(labels)))
        return streams

    def _start_router(
        self, request: RemoteRequest, params: SamplingParams, stop_ids: frozenset[int]
    ) -> RequestStream:
        to_router, inbox = anyio.create_memory_object_stream[RouterMessage](math.inf)
        outbox, events = anyio.create_memory_object_stream[GenerationEvent](
            self.config.max_buffered_events
        )
        self._routers[request.id] = (request, to_router)
        assert self._tg is not None
        self._tg.start_soon(
            lambda: route(
                inbox,
                outbox,
                tokenizer=self.tokenizer,
                prompt_ids=request.prompt_ids,
                params=params,
                silent_ids=stop_ids,
                request_leave=lambda: self.send(Leave(request.id)),
            ),
            name=f"neuronpy-router-{request.id}",
        )
        return RequestStream(request, events, lambda r: self.send(Cancel(r.id)))

    def stop_admitting(self, reason: str = "the server is shutting down") -> None:
        self._refusal = reason
        self.send(Call(0, "stop_admitting", (reason,)))

    async def drain(self, timeout: float) -> int:
        if self.lost.is_set():
            return 0  # what it held has failed already
        try:
            return int(await self._call("drain", timeout))
        except EngineUnhealthyError:
            return 0  # it went meanwhile: the same

    async def embed(self, inputs: Sequence[Sequence[int]]) -> list[Any]:
        return list(await self._call("embed", [list(ids) for ids in inputs]))

    async def worker_stats(self) -> Any:
        return await self._call("worker_stats")

    async def profile(self, seconds: float) -> StepProfile:
        return await self._call("profile", seconds)  # type: ignore[no-any-return]

    async def batch_rows(self) -> list[dict[str, object]]:
        return list(await self._call("rows"))


# What the server serves: an engine in its process, or one in a process of its own.
ServingEngine = Union[Engine, EngineClient]  # noqa: UP007 (a runtime alias on Python 3.10)
