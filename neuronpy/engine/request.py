"""One request's state inside the engine: its status, its tokens, its KV, and how it ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from neuronpy.engine.plans import RowRef
from neuronpy.engine.speculative import Speculation
from neuronpy.engine.types import FinishReason, SamplingParams, SessionRequest, TokenLogprob
from neuronpy.media import Media, media_of


class Cause(enum.Enum):
    """How a request ended (decided once: the first cause stands)."""

    STOP = "stop"  # EOS or a stop token, seen by the engine
    LENGTH = "length"  # max_tokens or the context window
    ROUTER_ENDED = "router_ended"  # its router ended the stream (a stop string, its consumer gone)
    CANCELLED = "cancelled"  # the client went away
    ABORTED = "aborted"  # shutdown or drain
    TIMED_OUT = "timed_out"  # waited past the queue deadline without getting a row
    FAILED = "failed"  # this request, or the model, failed

    @property
    def reason(self) -> FinishReason:
        """The finish reason its router reports."""
        return _REASONS[self]

    @property
    def on_its_own(self) -> bool:
        """Whether the generation ended by itself (what a session saves), not cut short."""
        return self in (Cause.STOP, Cause.LENGTH, Cause.ROUTER_ENDED)


_REASONS = {
    Cause.STOP: FinishReason.STOP,
    Cause.LENGTH: FinishReason.LENGTH,
    Cause.ROUTER_ENDED: FinishReason.STOP,
    Cause.CANCELLED: FinishReason.ABORT,
    Cause.ABORTED: FinishReason.ABORT,
    Cause.TIMED_OUT: FinishReason.ABORT,
    Cause.FAILED: FinishReason.ERROR,
}


@dataclass(frozen=True)
class Ending:
    cause: Cause
    error: str | None = None  # what the client is told (FAILED, or why it was aborted)
    # FAILED by what the request itself sent (its session file, say): the field to name in a
    # 400; None: a fault on the server's side
    param: str | None = None


class RequestStatus(enum.IntEnum):
    """Ordered: a request only moves forward, but for preemption (RUNNING or PREFILLING back to
    WAITING, its snapshot kept). The finished members carry the finish reason."""

    WAITING = 0  # admitted, queued behind max_in_flight (or preempted)
    PREFILLING = 1  # holds a row; its prompt is being prefilled
    RUNNING = 2  # a row of the live batch
    SAVING = 3  # ended; its KV is being written to its session file
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @classmethod
    def finished_with(cls, reason: FinishReason) -> RequestStatus:
        return _FINISHED[reason]


_FINISHED = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}


@dataclass(frozen=True)
class Finish:
    """Engine -> router: no more tokens; why."""

    reason: FinishReason
    error: str | None = None
    session_error: str | None = None  # its session could not be saved (the reply stands)
    param: str | None = None  # the request's field its error is about (see Ending.param)


RouterMessage = int | TokenLogprob | Finish  # a token id, or one with its log-probabilities


@dataclass(eq=False)
class Request:
    """One completion (one of a request's `n` copies): what the scheduler knows of it."""

    id: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stop_ids: frozenset[int]  # EOS (unless ignored) and stop tokens: end the stream, no text
    arrived_at: float
    index: int = 0  # which of its request's n completions
    # every copy of one request (n > 1), itself included: the first to be prefilled clones its
    # snapshot into the others
    group: list[Request] = field(default_factory=list, repr=False)
    session: SessionRequest | None = None  # continues from / saves into a session file
    status: RequestStatus = RequestStatus.WAITING
    ending: Ending | None = None  # set once, when its end is decided
    output_ids: list[int] = field(default_factory=list)
    next_token: int | None = None  # sampled, not yet fed to the model
    # the tokens its grammar forces after next_token (jump-forward): fed with it, next step
    forced: tuple[int, ...] = ()
    snapshot_id: int | None = None  # its KV while prefilling, waiting or between batches
    # its session's KV, read for its first chunk and not yet prefilled after: (the snapshot's
    # id in the cache store, the prompt tokens it holds)
    restored: tuple[int, int] | None = None
    prefilled: int = 0  # prompt tokens already in the snapshot
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache or a session
    preemptions: int = 0  # times it left the live batch to keep within the KV budget
    label: str | None = None  # what its client and the server's log call it (the batch view)
    scheduled_at: float | None = None  # when it first left the queue for a row (monotonic)
    # its drafter and draft length, when it speculates (engine/speculative.py)
    speculation: Speculation | None = field(default=None, repr=False)

    @property
    def media(self) -> tuple[Media, ...]:
        """The images its prompt's media ids name (neuronpy/media.py)."""
        return media_of(self.prompt_ids)

    @property
    def done(self) -> bool:
        """Whether it leaves at the next rebatch (or never joins): its end is decided."""
        return self.ending is not None

    @property
    def started(self) -> bool:
        """Whether it has had a row (or was preempted from one), or a copy's prefill filled it."""
        holds_row = RequestStatus.PREFILLING <= self.status <= RequestStatus.SAVING
        return holds_row or self.preemptions > 0 or self.prefilled > 0

    @property
    def drafts(self) -> tuple[int, int]:
        """Of the drafted tokens its verify steps fed (speculative decoding), how many there
        were and how many stood: (0, 0) when it did not speculate."""
        s = self.speculation
        return (0, 0) if s is None else (s.drafted, s.accepted)

    @property
    def queue_seconds(self) -> float | None:
        """How long it waited in the queue for a row (None: it has not left the queue)."""
        return None if self.scheduled_at is None else self.scheduled_at - self.arrived_at

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def kv_need(self) -> int:
        """KV columns it needs through its next step: its tokens so far and one more, and what
        its draft KV takes then, when a draft model drafts for it (in the model's columns)."""
        spec = self.speculation
        draft = spec.kv_need(self.total_tokens) if spec is not None else 0
        return self.total_tokens + 1 + draft

    def ref(self) -> RowRef:
        """How a plan names it: frozen, as it is now."""
        prompt = len(self.prompt_ids)
        total = prompt + len(self.output_ids)
        return RowRef(
            self.id,
            prompt,
            total,
            self.params,
            self.stop_ids,
            self.session,
            self.done,
            self.media,
        )

    def end(self, cause: Cause, error: str | None = None, param: str | None = None) -> None:
        """Decides how it ends; a later cause changes nothing."""
        if self.ending is None and self.status < RequestStatus.SAVING:
            self.ending = Ending(cause, error, param)
