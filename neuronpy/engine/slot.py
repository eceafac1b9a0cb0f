"""One request's state inside the engine, and the messages the engine sends its router."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from anyio.abc import ObjectSendStream

from neuronpy.engine.sampling import Sampler
from neuronpy.engine.sessions import SessionRequest
from neuronpy.engine.types import FinishReason, SamplingParams, TokenLogprob


class SlotStatus(enum.IntEnum):
    """Ordered: a slot only moves forward, but for preemption (RUNNING or PREFILLING back to
    WAITING, its snapshot kept)."""

    WAITING = 0  # admitted, queued behind max_in_flight
    PREFILLING = 1
    RUNNING = 2  # a row of the live batch
    FINISHED = 3


@dataclass(frozen=True)
class Finish:
    """Engine -> router: no more tokens; why."""

    reason: FinishReason
    error: str | None = None


RouterMessage = int | TokenLogprob | Finish  # a token id, or one with its log-probabilities


@dataclass(eq=False)
class Slot:
    id: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    sampler: Sampler
    to_router: ObjectSendStream[RouterMessage]
    stop_ids: frozenset[int]  # EOS (unless ignored) and stop tokens: end the stream, no text
    status: SlotStatus = SlotStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    next_token: int | None = None  # sampled, not yet fed to the model
    snapshot_id: int | None = None  # while prefilling or between batches
    prefilled: int = 0  # prompt tokens already in the snapshot
    finish_reason: FinishReason | None = None  # decided by the engine (EOS, length)
    leave_requested: bool = False  # the router stopped (stop string) or the client went away
    cancelled: bool = False
    arrived_at: float = field(default_factory=time.monotonic)
    index: int = 0  # which of its request's n completions
    # every copy of one request (n > 1), itself included: the first to be prefilled clones its
    # snapshot into the others
    group: list[Slot] = field(default_factory=list, repr=False)
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache
    preemptions: int = 0  # times it left the live batch to keep within the KV budget
    session: SessionRequest | None = None  # continues from / saves into a session file

    @property
    def done(self) -> bool:
        """Whether the slot should leave the batch at the next rebatch."""
        return self.finish_reason is not None or self.leave_requested or self.cancelled

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)
