"""An engine served to the server's process from an engine process of its own: the engine's
side of the channel (the server's side is engine/remote.py).

Inside the engine process the seed's shape holds as it does in one process: the engine's
loop on this process's event loop, the device worker on its thread. What changes is where a
request's router messages go: not to a router task here but into a frame, one per turn of
the loop, which the server's process reads and hands to the request's router there."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from neuronpy.engine.channel import Channel
from neuronpy.engine.engine import Engine
from neuronpy.engine.request import Finish, Request, RouterMessage
from neuronpy.engine.types import FinishReason
from neuronpy.engine.wire import (
    Call,
    Cancel,
    Close,
    Facts,
    Frame,
    Leave,
    Reply,
    Status,
    Submit,
)
from neuronpy.errors import InvalidRequestError, QueueFullError, ShuttingDownError

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 1.0  # a status frame at least this often: the client's stats stay fresh


def _portable(exc: BaseException) -> BaseException:
    """`exc`, or a RuntimeError saying what it was where it does not survive pickling."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def refusal(exc: Exception) -> Finish:
    """How a request the engine refused at admission ends for its client: a 400 naming its
    field, a 503 (the engine is full, stopping or failed), or a 500."""
    if isinstance(exc, InvalidRequestError):
        return Finish(FinishReason.ERROR, exc.message, param=exc.param or "prompt")
    if isinstance(exc, (QueueFullError, ShuttingDownError)):
        return Finish(FinishReason.ABORT, str(exc))
    return Finish(FinishReason.ERROR, str(exc))


class _Outlet:
    """One request's router messages, into the host's next frame."""

    def __init__(self, host: EngineHost, id: int) -> None:
        self._host = host
        self._id = id

    def send_nowait(self, message: RouterMessage) -> None:
        self._host.put(self._id, message)

    def close(self) -> None:
        self._host.ended(self._id)


class EngineHost:
    """Serves one started Engine to its client over `channel` until the client closes it or
    goes away."""

    def __init__(self, engine: Engine, channel: Channel) -> None:
        self.engine = engine
        self.channel = channel
        self._requests: dict[int, Request] = {}  # the client's id -> the engine's request
        self._facts: dict[int, Facts] = {}  # what the client was last told of each
        self._pending: list[tuple[int, RouterMessage]] = []
        self._ending: set[int] = set()
        self._flush_scheduled = False
        self.calls: dict[str, Callable[..., Awaitable[Any]]] = {
            "prepare": engine.prepare,
            "drain": engine.drain,
            "embed": engine.embed,
            "worker_stats": engine.worker_stats,
            "profile": engine.profile,
            "rows": engine.batch_rows,
        }

    async def serve(self) -> None:
        """Reads the client's messages until Close or the end of the channel; then returns
        (the caller's exit from the engine aborts what is still admitted)."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._heartbeat)
            while True:
                try:
                    message = await self.channel.receive()
                except EOFError:
                    log.warning("%s: the server's process has gone; stopping", self.engine.name)
                    break
                if isinstance(message, Close):
                    break
                self._handle(message, tg)
            tg.cancel_scope.cancel()
        self.flush()

    def _handle(self, message: object, tg: anyio.abc.TaskGroup) -> None:
        match message:
            case Submit():
                self._submit(message)
            case Cancel(id=id):
                if (request := self._requests.get(id)) is not None:
                    self.engine.cancel(request)
            case Leave(id=id):
                if (request := self._requests.get(id)) is not None:
                    self.engine.leave(request)
            case Call(method="stop_admitting", args=args):
                self.engine.stop_admitting(*args)
            case Call():
                tg.start_soon(self._answer, message)
            case _:
                log.error("%s: an unknown message from the server: %r", self.engine.name, message)
        self._schedule_flush()  # the status after it, soon

    def _submit(self, message: Submit) -> None:
        try:
            requests = self.engine.admit(
                message.prompt, message.params, len(message.ids), message.session, message.labels
            )
        except Exception as exc:  # refused: what the client admitted meanwhile ends with it
            for id in message.ids:
                self._pending.append((id, refusal(exc)))
            return
        for id, request in zip(message.ids, requests, strict=True):
            self._requests[id] = request
            self.engine.attach(request, _Outlet(self, id))

    async def _answer(self, call: Call) -> None:
        try:
            reply = Reply(call.call, await self.calls[call.method](*call.args))
        except Exception as exc:
            reply = Reply(call.call, error=_portable(exc))
        self.flush()  # what happened before the answer reaches the client before it
        self.channel.send(reply)

    async def _heartbeat(self) -> None:
        while True:
            await anyio.sleep(HEARTBEAT_SECONDS)
            self.flush()

    # ---- the engine's side: its router messages, framed ----------------------------------------

    def put(self, id: int, message: RouterMessage) -> None:
        self._pending.append((id, message))
        self._schedule_flush()

    def ended(self, id: int) -> None:
        """Its Finish is in the next frame: forget it once that is sent."""
        self._ending.add(id)

    def _schedule_flush(self) -> None:
        # every message the loop delivers in one go (a turn's) goes in one frame
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def status(self) -> Status:
        e = self.engine
        return Status(e.stats(), e.healthy, e.failure, e.retry_after())

    def flush(self) -> None:
        """Sends what is pending (or the status alone) as one frame."""
        self._flush_scheduled = False
        messages, self._pending = self._pending, []
        facts = []
        for id in dict.fromkeys(id for id, _ in messages):
            request = self._requests.get(id)
            if request is None:
                continue
            now = Facts(request.cached_tokens, request.drafts, request.queue_seconds)
            if self._facts.get(id) != now:
                self._facts[id] = now
                facts.append((id, now))
        for id in self._ending:
            self._requests.pop(id, None)
            self._facts.pop(id, None)
        self._ending.clear()
        # (the server's process may have gone: serve() ends at the channel's end)
        with contextlib.suppress(ConnectionError):
            self.channel.send(Frame(tuple(messages), tuple(facts), self.status()))
