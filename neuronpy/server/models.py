"""The served models: each one's state, its start-up (load, warm up), its batch log, and the
graceful shutdown (stop admitting, drain, abort the rest)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import anyio

from neuronpy.engine.remote import ServingEngine
from neuronpy.engine.types import FinishReason, SamplingParams
from neuronpy.errors import EngineUnhealthyError, ModelLoadError, NeuronError
from neuronpy.server.errors import ApiError, unavailable
from neuronpy.server.prompts import template_renders_tools
from neuronpy.threads import run_in_own_thread

log = logging.getLogger(__name__)

SHUTTING_DOWN = "the server is shutting down"


@dataclass
class ServedModel:
    """One model: where it stands, and its engine once started. Its own task writes it, the
    routes read it."""

    name: str
    load: Callable[[], ServingEngine]  # blocking: loads the weights and builds the engine
    status: str = "loading"  # loading -> ready -> stopping; or failed
    engine: ServingEngine | None = None
    error: str | None = None  # why it failed, for the log and the operator (never for clients)
    renders_tools: bool = True  # whether its chat template writes tools into the prompt
    image_urls: bool = False  # whether its requests' http(s) image URLs are fetched

    @property
    def state(self) -> str:
        """What /health says: loading, ready, unhealthy (its worker failed), failed, stopping."""
        if self.status == "ready" and (self.engine is None or not self.engine.healthy):
            return "unhealthy"
        return self.status

    def ready_engine(self) -> ServingEngine:
        """The engine, or 503 while loading, stopping, failed or unhealthy."""
        if self.status == "loading":
            raise unavailable(f"the model '{self.name}' is loading; retry shortly", retry_after=5)
        if self.status == "failed":
            raise unavailable(f"the model '{self.name}' could not be started")
        if self.status == "stopping":
            raise unavailable(f"{SHUTTING_DOWN}; it admits no new requests")
        if self.status != "ready" or self.engine is None:
            raise unavailable("the server is not serving requests")
        if not self.engine.healthy:
            raise unavailable(f"the model '{self.name}' is unavailable after an internal error")
        return self.engine

    def stop_admitting(self) -> None:
        """From now on its requests get 503; those already admitted carry on."""
        if self.status in ("loading", "ready"):
            self.status = "stopping"
        if self.engine is not None:
            self.engine.stop_admitting(SHUTTING_DOWN)


TOKENIZE_THREADS = 4  # /tokenize and /detokenize calls running at once, on threads


@dataclass
class ServerState:
    """Every served model, by name, in the configured order."""

    models: dict[str, ServedModel]
    started: int = field(default_factory=lambda: int(time.time()))
    # set while the app runs: what request_shutdown() signals, on the app's event loop
    _loop: asyncio.AbstractEventLoop | None = field(default=None, init=False, repr=False)
    _drain: anyio.Event | None = field(default=None, init=False, repr=False)
    _hurry: anyio.Event | None = field(default=None, init=False, repr=False)
    _shutdown_requests: int = field(default=0, init=False, repr=False)
    # a drain has begun: /health says 503 (admission may go on for the drain's grace)
    unready: bool = field(default=False, init=False)
    _tokenize_threads: anyio.CapacityLimiter | None = field(default=None, init=False, repr=False)

    @property
    def tokenize_threads(self) -> anyio.CapacityLimiter:
        """The threads /tokenize and /detokenize may hold at once (TOKENIZE_THREADS; more
        wait): of the pool that tokenizes every request's prompt, a flood of them may never
        hold it all. (Made on the app's event loop, at first use.)"""
        if self._tokenize_threads is None:
            self._tokenize_threads = anyio.CapacityLimiter(TOKENIZE_THREADS)
        return self._tokenize_threads

    def request_shutdown(self) -> bool:
        """Begin a graceful shutdown; safe to call from a signal handler or another thread. The
        first call stops admitting and drains (`drain_on_request`); the second aborts what is
        still running at once. False when there is nothing more it can do (the app is not
        running, or both were asked for already): the caller stops the server itself."""
        if self._loop is None or self._drain is None or self._hurry is None:
            return False
        if self._shutdown_requests >= 2:
            return False
        self._shutdown_requests += 1
        event = self._drain if self._shutdown_requests == 1 else self._hurry
        try:
            self._loop.call_soon_threadsafe(event.set)
        except RuntimeError:  # the loop has closed
            return False
        return True

    def begin_drain(self) -> bool:
        """The first step of `request_shutdown` only (stop admitting, drain), however often it
        is called: what an HTTP call may ask, where a retried call must not abort the requests
        the first one let finish. False when the app is not running."""
        if self._loop is None or self._drain is None:
            return False
        if self._shutdown_requests == 0:
            return self.request_shutdown()
        return True

    def health_of(self, model: ServedModel) -> str:
        """What /health says of `model`: its state, or `stopping` once a drain has begun
        (while the drain's grace still admits requests too)."""
        return "stopping" if self.unready and model.state == "ready" else model.state

    @property
    def settling(self) -> bool:
        """Whether an unready /health is what this server says of itself in its own log: its
        models loading (or starting again) or the server draining, none failed or unhealthy."""
        states = {self.health_of(model) for model in self.models.values()}
        return states <= {"loading", "ready", "stopping"}

    @property
    def status(self) -> str:
        """ok when every model is ready; their common state if they share one; else degraded."""
        states = {self.health_of(model) for model in self.models.values()}
        if states == {"ready"}:
            return "ok"
        return states.pop() if len(states) == 1 else "degraded"

    def find(self, name: str | None) -> ServedModel:
        """The model a request names (None: the first one), or 404 listing the ids."""
        if name is None or (name == "" and len(self.models) == 1):  # "": the only one
            return next(iter(self.models.values()))
        model = self.models.get(name)
        if model is None:
            raise ApiError(
                404,
                f"the model '{name[:200]}' does not exist; available models: "
                f"{', '.join(self.models)}",
                param="model",
                code="model_not_found",
            )
        return model


# An engine process that ends on its own (killed for memory, say) is started again, at most
# this many times in a row; a run of STEADY_SECONDS ready resets the count.
RESTARTS = 3
STEADY_SECONDS = 60.0


async def serve_model(
    model: ServedModel, stop: anyio.Event, on_failed: Callable[[BaseException], None]
) -> None:
    """Load the model (in a thread of its own), start and warm up its engine, serve until
    `stop`, then stop the engine. A failure marks only this model failed. An engine whose
    process ends on its own (engine/remote.py) fails what it held, and is started again
    (RESTARTS in a row at most) while its requests get 503s."""
    restarts = 0
    while True:
        started = time.perf_counter()
        try:
            engine = await _load(model, stop)
            if engine is None or model.status != "loading":
                return  # the server is stopping: no need to start it
            async with engine:
                await _warm_up(engine)
                model.renders_tools = await anyio.to_thread.run_sync(
                    template_renders_tools, engine.tokenizer
                )
                model.engine = engine
                if model.status != "loading":  # the server began to stop while it warmed up
                    engine.stop_admitting(SHUTTING_DOWN)
                    return
                model.status = "ready"
                ready = time.perf_counter()
                log.info(
                    "ready: serving %s (context %d tokens, %d in flight) after %.1f s",
                    model.name,
                    engine.context_len,
                    engine.max_running,
                    ready - started,
                )
                if not await _serve_until(stop, engine):
                    return
        except Exception as exc:
            model.status, model.error = "failed", str(exc)
            if isinstance(exc, (ModelLoadError, NeuronError)):
                log.error("could not start the model %s: %s", model.name, exc)
            else:
                log.exception("could not start the model %s", model.name)
            on_failed(exc)
            return
        # its engine process has gone (the client has failed its requests)
        restarts = 1 if time.perf_counter() - ready >= STEADY_SECONDS else restarts + 1
        if restarts > RESTARTS or model.status != "ready":
            model.status = "failed" if model.status == "ready" else model.status
            model.error = engine.failure
            if model.status == "failed":
                log.error("%s: not restarted after %d restarts in a row", model.name, RESTARTS)
                on_failed(EngineUnhealthyError(engine.failure or "its engine has gone"))
            return
        log.warning("%s: starting its engine again (restart %d)", model.name, restarts)
        model.status, model.engine = "loading", None


async def _load(model: ServedModel, stop: anyio.Event) -> ServingEngine | None:
    """The model's engine, loaded on a thread of its own; None when the server stops first
    (the load is then not waited for). Raises what the load raised."""
    engine: ServingEngine | None = None
    failure: Exception | None = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            await stop.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            engine = await run_in_own_thread(model.load, f"neuronpy-load-{model.name}")
        except Exception as exc:  # raised below, as it is (not in a group)
            failure = exc
        tg.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return engine


async def _serve_until(stop: anyio.Event, engine: ServingEngine) -> bool:
    """Serves until `stop` (False) or until the engine's process ends on its own (True)."""
    lost = getattr(engine, "lost", None)
    if lost is None:  # an engine in this process
        await stop.wait()
        return False
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            await lost.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        await stop.wait()
        tg.cancel_scope.cancel()
    return not stop.is_set()


async def _warm_up(engine: ServingEngine) -> None:
    """One tiny greedy generation, so the first client does not pay for first-call costs."""
    prompt = engine.tokenizer.encode("Hello") or [0]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    done = await engine.complete(prompt[: engine.context_len - 2], params)
    if done.finish_reason is not FinishReason.LENGTH:
        raise RuntimeError(f"warm-up generation ended with {done.finish_reason}")


async def log_batches(models: Iterable[ServedModel], stop: anyio.Event, seconds: float) -> None:
    """Every `seconds`, a `batch:` line for each model that decoded since the last one."""
    last_steps: dict[str, int] = {}
    while not stop.is_set():
        with anyio.move_on_after(seconds):
            await stop.wait()
        for model in models:
            if model.engine is None or stop.is_set():
                continue
            s = model.engine.stats()
            if s.decode_steps == last_steps.get(model.name, 0):
                continue
            last_steps[model.name] = s.decode_steps
            log.info(
                "batch: model=%s running=%d queued=%d live_batch=%d max_batch=%d "
                "mean_batch=%.2f decode_steps=%d finished=%d cancelled=%d",
                model.name,
                s.running,
                s.queued,
                s.live_batch_size,
                s.max_batch_size,
                s.decoded_rows / s.decode_steps,
                s.decode_steps,
                s.finished,
                s.cancelled,
            )


async def drain_on_request(
    state: ServerState,
    timeout: float,
    on_drained: Callable[[], None] | None,
    grace: float = 0.0,
) -> None:
    """Run for the app's lifetime: once `state.request_shutdown()` is called, /health turns
    503 (`stopping`) at once; `grace` seconds later (the time a load balancer takes to see
    it and send nothing more; requests are still admitted meanwhile) stop admitting on every
    model at once (new requests get 503), give the admitted requests up to `timeout` seconds
    to finish (a second request cuts either wait short), abort the rest, then call
    `on_drained` (the CLI stops the HTTP server)."""
    state._loop = asyncio.get_running_loop()
    state._drain, state._hurry = anyio.Event(), anyio.Event()
    await state._drain.wait()
    state.unready = True
    if grace > 0:
        log.info("stopping: unready now; admitting for %g s more while routers notice", grace)
        with anyio.move_on_after(grace):
            await state._hurry.wait()
    models = list(state.models.values())
    for model in models:
        model.stop_admitting()
    engines = [m.engine for m in models if m.engine is not None]
    in_flight = sum(e.stats().running + e.stats().queued for e in engines)
    log.info(
        "stopping: admitting no new requests; %d in flight get up to %g s to finish "
        "(a second Ctrl-C or SIGTERM aborts them now)",
        in_flight,
        timeout,
    )
    aborted = 0

    async def drain(engine: ServingEngine) -> None:
        nonlocal aborted
        assert state._hurry is not None
        hurried = False
        async with anyio.create_task_group() as tg:

            async def hurry() -> None:
                nonlocal hurried
                assert state._hurry is not None
                await state._hurry.wait()
                log.info("stopping now: aborting what is still running")
                hurried = True
                tg.cancel_scope.cancel()

            tg.start_soon(hurry)
            aborted += await engine.drain(timeout)
            tg.cancel_scope.cancel()
        if hurried:  # cut short: abort the rest now
            aborted += await engine.drain(0.0)

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for engine in engines:
            tg.start_soon(drain, engine)
    log.info(
        "drained after %.1f s: %d request(s) finished, %d aborted",
        time.perf_counter() - started,
        in_flight - aborted,
        aborted,
    )
    if on_drained is not None:
        on_drained()
