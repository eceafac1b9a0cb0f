"""Per-slot router task: token ids in, text events out (detokenization, stop strings)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from transformers import PreTrainedTokenizerBase

from neuronpy.engine.detokenize import IncrementalDetokenizer
from neuronpy.engine.slot import Finish, RouterMessage
from neuronpy.engine.stop import StopMatcher
from neuronpy.engine.types import FinishReason, GenerationEvent, SamplingParams

log = logging.getLogger(__name__)


async def route(
    inbox: ObjectReceiveStream[RouterMessage],
    outbox: ObjectSendStream[GenerationEvent],
    *,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: tuple[int, ...],
    params: SamplingParams,
    silent_ids: Collection[int],
    request_leave: Callable[[], None],
) -> None:
    """Turns one slot's token stream into GenerationEvents until it finishes.

    `silent_ids` (EOS, stop tokens) count as generated tokens but never become text. When a stop
    string matches, the router ends the stream itself and asks the engine to drop the row
    (`request_leave`); tokens the engine produced meanwhile are ignored. A fault here (say, the
    detokenizer raising) fails this request alone.
    """
    prompt_tokens = len(prompt_ids)
    count = 0
    unreported: list[int] = []

    def event(text: str, reason: FinishReason | None = None, error: str | None = None):
        ids = tuple(unreported)
        unreported.clear()
        return GenerationEvent(text, ids, reason, prompt_tokens, count, error)

    async with inbox, outbox:
        try:
            detok = IncrementalDetokenizer(tokenizer, prompt_ids)
            stop = StopMatcher(params.stop)
            async for msg in inbox:
                if isinstance(msg, Finish):
                    text = "" if msg.reason is FinishReason.ERROR else detok.flush()
                    emit, stopped = stop.push(text)
                    if not stopped:
                        emit += stop.flush()
                        stopped = stop.stopped  # a stop can only be decided at the very end
                    reason = FinishReason.STOP if stopped else msg.reason
                    await outbox.send(event(emit, reason, msg.error))
                    return
                count += 1
                unreported.append(msg)
                if msg in silent_ids:
                    continue
                emit, stopped = stop.push(detok.add(msg))
                if stopped:
                    request_leave()
                    await outbox.send(event(emit, FinishReason.STOP))
                    return
                if emit:
                    await outbox.send(event(emit))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            request_leave()  # the consumer went away: nobody to route to
        except Exception as exc:
            log.exception("router failed")
            request_leave()
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await outbox.send(
                        event("", FinishReason.ERROR, f"output processing failed: {exc}")
                    )
