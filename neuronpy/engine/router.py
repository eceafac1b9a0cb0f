"""Per-slot router task: token ids in, events out (detokenization, stop strings, reasoning and
tool-call markup, log-probabilities)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Collection

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from transformers import PreTrainedTokenizerBase

from neuronpy.engine import harmony
from neuronpy.engine.detokenize import IncrementalDetokenizer, marker_ids
from neuronpy.engine.output import HarmonyParser, OutputParser, Parsed, output_parser, uses_harmony
from neuronpy.engine.reasoning import prompt_opens_reasoning
from neuronpy.engine.request import Finish, RouterMessage
from neuronpy.engine.stop import StopMatcher
from neuronpy.engine.tools import TOOL_FORMATS
from neuronpy.engine.types import FinishReason, GenerationEvent, SamplingParams, TokenLogprob

log = logging.getLogger(__name__)


class StalledReader(Exception):
    """The request's consumer let its events pile up to the bound: the request ends."""


async def route(
    inbox: MemoryObjectReceiveStream[RouterMessage],
    outbox: MemoryObjectSendStream[GenerationEvent],
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
    (`request_leave`); tokens the engine produced meanwhile are ignored. Stop strings apply to
    the generated text as it is, before `params.output` splits it into reasoning, content and
    tool calls. A request that asked for log-probabilities gets an event per token. A fault
    here (say, the detokenizer raising) fails this request alone.

    What waits for the consumer is bounded by `outbox`'s buffer: when the consumer has left
    all but one of its slots unread (a client that stopped reading), the last one gets an
    error event and the request ends, so a stalled reader holds no memory past the bound.
    """
    prompt_tokens = len(prompt_ids)
    count = 0
    unreported: list[int] = []
    logprobs: list[TokenLogprob] = []
    per_token = params.logprobs is not None

    def event(
        parsed: Parsed, reason: FinishReason | None = None, error: str | None = None
    ) -> GenerationEvent:
        ids, lps = tuple(unreported), tuple(logprobs)
        unreported.clear()
        logprobs.clear()
        return GenerationEvent(
            parsed.content,
            ids,
            reason,
            prompt_tokens,
            count,
            error,
            reasoning=parsed.reasoning,
            tool_calls=tuple(parsed.tool_calls),
            logprobs=lps,
        )

    async with inbox, outbox:
        try:
            keep: frozenset[int] = frozenset()
            if uses_harmony(params.output):  # its framing is read: it stays in the text
                keep = marker_ids(tokenizer, harmony.TOKENS)
            elif params.output.tool_calls:  # the markers stay text even as special tokens
                keep = marker_ids(tokenizer, TOOL_FORMATS[params.output.tool_format].markers)
            detok = IncrementalDetokenizer(tokenizer, prompt_ids, keep_special=keep)
            stop = StopMatcher(params.stop)
            parser = _parser(tokenizer, prompt_ids, params)
            async for msg in inbox:
                if isinstance(msg, Finish):
                    text = "" if msg.reason is FinishReason.ERROR else detok.flush()
                    emit, stopped = stop.push(text)
                    if not stopped:
                        emit += stop.flush()
                        stopped = stop.stopped  # a stop can only be decided at the very end
                    parsed = parser.push(emit)
                    if msg.reason is not FinishReason.ERROR:
                        parsed.extend(parser.finish())
                    reason = FinishReason.STOP if stopped else msg.reason
                    last = dataclasses.replace(
                        event(parsed, reason, msg.error),
                        session_error=msg.session_error,
                        error_param=msg.param,
                        stop_sequence=stop.matched,
                    )
                    await outbox.send(last)
                    return
                if isinstance(msg, TokenLogprob):
                    logprobs.append(msg)
                    token = msg.token_id
                else:
                    token = msg
                count += 1
                unreported.append(token)
                if token in silent_ids:
                    continue
                emit, stopped = stop.push(detok.add(token))
                parsed = parser.push(emit)
                if stopped:
                    request_leave()
                    last = event(parsed.extend(parser.finish()), FinishReason.STOP)
                    await outbox.send(dataclasses.replace(last, stop_sequence=stop.matched))
                    return
                if parsed or (per_token and logprobs):
                    stats = outbox.statistics()
                    if stats.current_buffer_used >= stats.max_buffer_size - 1:
                        raise StalledReader(
                            f"the client left {stats.current_buffer_used} events unread; "
                            "the request was ended"
                        )
                    await outbox.send(event(parsed))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            request_leave()  # the consumer went away: nobody to route to
        except StalledReader as exc:
            log.warning("%s", exc)
            request_leave()
            outbox.send_nowait(event(Parsed(), FinishReason.ERROR, str(exc)))
        except Exception as exc:
            log.exception("router failed")
            request_leave()
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await outbox.send(
                        event(Parsed(), FinishReason.ERROR, f"output processing failed: {exc}")
                    )


def _parser(
    tokenizer: PreTrainedTokenizerBase, prompt_ids: tuple[int, ...], params: SamplingParams
) -> OutputParser | HarmonyParser:
    """The reply's parser; it starts inside the reasoning block if the prompt opened one."""
    output = params.output
    opened = prompt_opens_reasoning(tokenizer, prompt_ids, output.reasoning)
    return output_parser(output, opened=opened)
