"""The served models: each one's state, its start-up (load, warm up) and its batch log."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import anyio

from neuronpy.engine.engine import Engine
from neuronpy.engine.types import FinishReason, SamplingParams
from neuronpy.errors import ModelLoadError, NeuronError
from neuronpy.server.protocol import ApiError, unavailable

log = logging.getLogger(__name__)


@dataclass
class ServedModel:
    """One model: where it stands, and its engine once started. Its own task writes it, the
    routes read it."""

    name: str
    load: Callable[[], Engine]  # blocking: loads the weights and builds the engine
    status: str = "loading"  # loading -> ready -> stopping; or failed
    engine: Engine | None = None
    error: str | None = None  # why it failed, for the log and the operator (never for clients)

    @property
    def state(self) -> str:
        """What /health says: loading, ready, unhealthy (its worker failed), failed, stopping."""
        if self.status == "ready" and (self.engine is None or not self.engine.healthy):
            return "unhealthy"
        return self.status

    def ready_engine(self) -> Engine:
        """The engine, or 503 while loading, stopping, failed or unhealthy."""
        if self.status == "loading":
            raise unavailable(f"the model '{self.name}' is loading; retry shortly", retry_after=5)
        if self.status == "failed":
            raise unavailable(f"the model '{self.name}' could not be started")
        if self.status != "ready" or self.engine is None:
            raise unavailable("the server is not serving requests")
        if not self.engine.healthy:
            raise unavailable(f"the model '{self.name}' is unavailable after an internal error")
        return self.engine


@dataclass
class ServerState:
    """Every served model, by name, in the configured order."""

    models: dict[str, ServedModel]
    started: int = field(default_factory=lambda: int(time.time()))

    @property
    def status(self) -> str:
        """ok when every model is ready; their common state if they share one; else degraded."""
        states = {model.state for model in self.models.values()}
        if states == {"ready"}:
            return "ok"
        return states.pop() if len(states) == 1 else "degraded"

    def find(self, name: str | None) -> ServedModel:
        """The model a request names (None: the first one), or 404 listing the ids."""
        if name is None:
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


async def serve_model(
    model: ServedModel,
    stop: anyio.Event,
    loading: anyio.CancelScope,
    on_failed: Callable[[BaseException], None],
) -> None:
    """Load the model (in a thread of its own), start and warm up its engine, serve until
    `stop`, then stop the engine. A failure marks only this model failed."""
    try:
        started = time.perf_counter()
        with loading:
            engine = await anyio.to_thread.run_sync(model.load, abandon_on_cancel=True)
        if loading.cancelled_caught:
            return
        async with engine:
            await _warm_up(engine)
            model.engine, model.status = engine, "ready"
            log.info(
                "ready: serving %s (context %d tokens, %d in flight) after %.1f s",
                model.name,
                engine.context_len,
                engine.max_running,
                time.perf_counter() - started,
            )
            await stop.wait()
    except Exception as exc:
        model.status, model.error = "failed", str(exc)
        if isinstance(exc, (ModelLoadError, NeuronError)):
            log.error("could not start the model %s: %s", model.name, exc)
        else:
            log.exception("could not start the model %s", model.name)
        on_failed(exc)


async def _warm_up(engine: Engine) -> None:
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
