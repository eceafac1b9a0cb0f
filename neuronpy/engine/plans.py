"""What the scheduler asks of the device (plans) and what the runner answers: plain frozen data.

A plan names a request by a frozen `RowRef` (its id and what the device side needs of it as it
was planned), never by the scheduler's live Request object: nothing a plan holds changes after
it is made, and the scheduler finds its requests by id when it records the answer."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from neuronpy.engine.types import SamplingParams, SessionRequest, TokenLogprob
from neuronpy.media import Media


@dataclass(frozen=True)
class RowRef:
    """A request as a plan names it, frozen when the plan was made."""

    id: int
    prompt_len: int  # its prompt's tokens
    total_tokens: int  # its prompt's and its output's, when planned
    params: SamplingParams
    stop_ids: frozenset[int]  # the tokens that end it (a draft is cut at one)
    session: SessionRequest | None = None
    done: bool = False  # its end was decided when planned: it gets no token
    media: tuple[Media, ...] = ()  # the images its prompt's media ids name (neuronpy/media.py)


# ---- drafting: what the scheduler asks of a proposer and what it answers


@dataclass(frozen=True)
class DraftRow:
    """One row's part in a proposal: up to `length` drafts to follow its context (its prompt
    and output so far; the last token is the one the target is fed next). The proposer first
    gives back the last `rollback` tokens it holds of the row (its own drafts that the target
    rejected), then takes `tokens`, the part of the context it lacks. `fresh`: it holds nothing
    of the row, or drops what it holds; `tokens` is then the whole context."""

    row: int  # the row's index in its decode step (DecodePlan.rows)
    key: int  # the request's id: what the proposer keeps the row's state under
    length: int
    tokens: tuple[int, ...]
    rollback: int = 0
    fresh: bool = False
    context: int = 0  # tokens of the row's context: what the proposer has of it after the call


@dataclass(frozen=True)
class Proposals:
    """The rows of one decode step that draft with one method, in row order."""

    method: str
    rows: tuple[DraftRow, ...]


@dataclass(frozen=True)
class Proposal:
    """A proposer's answer, per row of its Proposals: the drafts (at most its `length`), and
    the tokens it now holds of the row (its context, and any drafts it fed itself: those of
    them the target accepts it keeps, the rest the next call rolls back)."""

    drafts: tuple[tuple[int, ...], ...]
    held: tuple[int, ...]


# ---- housekeeping: KV to drop or move; the scheduler queues them, the runner runs them in order


@dataclass(frozen=True)
class DropSnapshots:
    """Snapshots of requests that no longer need them."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class DropCached:
    """Prefix-cache entries (or a session's snapshot read for one prefill) to evict."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class Offload:
    """Snapshots of preempted requests: to CPU memory while they wait (from a GPU)."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class SaveSession:
    """Write the request's snapshot to its session file; the request ends once it is on disk.
    `drop`: the snapshot then goes (else a job that follows takes it: the prefix cache)."""

    row: RowRef
    snapshot_id: int
    path: Path
    drop: bool


@dataclass(frozen=True)
class ReleaseDrafts:
    """What the proposer of `method` holds of these rows (requests) goes: they left the live
    batch, ended or were preempted (a draft model's KV of them, prompt lookup's index)."""

    method: str
    keys: tuple[int, ...]


Op = DropSnapshots | DropCached | Offload | SaveSession | ReleaseDrafts


# ---- plans with results


@dataclass(frozen=True)
class LoadSession:
    """Read the request's session file into the cache store under `cache_id`, for its prefill.
    `hit`: what the prefix cache offered instead ((entry id, tokens) or None)."""

    row: RowRef
    cache_id: int
    path: Path
    hit: tuple[int, int] | None


@dataclass(frozen=True)
class Loaded:
    """A session read: its token ids, or why it could not be read (that request fails)."""

    token_ids: tuple[int, ...] = ()
    error: str | None = None
    invalid: bool = False  # the error is the file's (a 400 for its request), not the server's


@dataclass(frozen=True)
class PrefillPlan:
    """Prefill `tokens` of the request's prompt into snapshot `snapshot_id` (after the first
    `parent_length` tokens of `parent_id`, when given). The chunk that ends the prompt (`last`)
    samples the first token of the request and of its `clones` (its other copies, n > 1), whose
    snapshots are copies stored under `clone_ids`; `cache_id`: the prompt's KV joins the prefix
    cache under it. `session_id`: a session's snapshot read for this chunk only, dropped after."""

    row: RowRef
    snapshot_id: int
    tokens: tuple[int, ...]
    parent_id: int | None
    parent_length: int | None
    last: bool
    cache_id: int | None = None
    clones: tuple[RowRef, ...] = ()
    clone_ids: tuple[int, ...] = ()
    session_id: int | None = None
    start: int = 0  # where `tokens` start in the prompt

    @property
    def sampled(self) -> tuple[RowRef, ...]:
        """The requests this chunk samples a token for, in the order of the answer."""
        return (self.row, *self.clones) if self.last else ()


@dataclass(frozen=True)
class Sampled:
    """One row's sampled token (None: the row was done by then, or its sampling failed) and
    its log-probabilities."""

    token: int | None
    logprob: TokenLogprob | None = None
    error: str | None = None  # why this row's sampling failed: it fails that request alone
    error_param: str | None = None  # the request's field the error is about (its constraint)
    # a verify step's drafts that stood, before `token`, each with its log-probabilities
    accepted: tuple[tuple[int, TokenLogprob | None], ...] = ()
    # the tokens the row's grammar forces after `token` (Sampler.forced): its next step feeds
    # them (jump-forward)
    forced: tuple[int, ...] = ()

    @property
    def tokens(self) -> tuple[tuple[int, TokenLogprob | None], ...]:
        """Every token the row emits this step, in order, with its log-probabilities."""
        if self.token is None:
            return ()
        return (*self.accepted, (self.token, self.logprob))


@dataclass(frozen=True)
class PrefillOutcome:
    tokens: tuple[Sampled, ...]  # one per PrefillPlan.sampled
    cached_bytes: int = 0  # what the prefix-cache entry (cache_id) holds
    seconds: float = 0.0  # the job's time, sampling aside (run on its own)
    # the prompt's tokens the entry holds (fewer than all where states are kept at a boundary)
    cached_length: int | None = None
    sampling_seconds: float = 0.0


@dataclass(frozen=True)
class DecodePlan:
    """One lockstep step: row b feeds tokens[b]. The prompt chunks of requests joining the
    batch (`rides`, one each) are prefilled in the same forward."""

    rows: tuple[RowRef, ...]
    tokens: tuple[int, ...]
    rides: tuple[PrefillPlan, ...] = ()
    # the rows that draft before the step (speculative decoding), by method: the runner asks
    # their proposers, and the step verifies what they drafted; empty: no row drafts
    proposals: tuple[Proposals, ...] = ()
    # per row: decode columns to give back first (the last verify step's rejected drafts)
    trim: tuple[int, ...] = ()
    # per row: the tokens its grammar forces after its token (jump-forward), fed in this step
    # as drafts that stand; such a row does not draft otherwise. Empty: no row has any
    forced: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class DecodeOutcome:
    tokens: tuple[Sampled, ...]  # one per row
    rides: tuple[PrefillOutcome, ...] = ()  # one per DecodePlan.rides
    seconds: float = 0.0  # the forward's time, sampling aside
    sampling_seconds: float = 0.0
    # per row: the drafts verified (the proposers', cut at a stop token or where a row's
    # grammar refused one); empty: none
    drafted: tuple[int, ...] = ()
    proposed: tuple[Proposal, ...] = ()  # one per DecodePlan.proposals
    # per row: of its drafted tokens, those its grammar forced (DecodePlan.forced); empty: none
    forced: tuple[int, ...] = ()


@dataclass(frozen=True)
class RebatchPlan:
    """A join or leave. On the device: the live rows `rows` become snapshots `ids` (survivors,
    preempted rows, and leaving rows the prefix cache or a session keeps), then `ops` run
    (offload the preempted, save sessions), then the rows in `cache` join the prefix cache, then
    the snapshots `assemble` (the rows of `order`, in that order) become the new live batch.
    Recording it, the scheduler ends `leaving`, queues `preempted` again and runs `order`."""

    rows: tuple[int, ...]
    ids: tuple[int, ...]
    ops: tuple[Op, ...]
    cache: tuple[tuple[RowRef, int], ...]  # (request, its extracted snapshot id)
    leaving: tuple[RowRef, ...]
    order: tuple[RowRef, ...]  # survivors, then joiners
    assemble: tuple[int, ...]  # the snapshot of each row of `order`; empty: no row is left
    extract: bool = True  # False: there is no live batch yet to take rows from
    trim: tuple[int, ...] = ()  # per row of the live batch: as DecodePlan.trim, before extracting
    joined: tuple[RowRef, ...] = ()  # the joiners of `order` (its last rows)
    preempted: tuple[RowRef, ...] = ()  # rows that wait as snapshots (`ids` after survivors')
    saving: tuple[RowRef, ...] = ()  # of `leaving`, those whose KV goes to their session


@dataclass(frozen=True)
class CacheOutcome:
    nbytes: tuple[int, ...]  # per RebatchPlan.cache entry
    lengths: tuple[int, ...]  # tokens of KV each holds


@dataclass(frozen=True)
class RebatchOutcome:
    cached: CacheOutcome | None  # None: the plan cached nothing
    padding_columns: int = 0  # of the new live batch
    seconds: float = 0.0


# ---- one call of the runner: the scheduler plans it whole, the runner answers it whole


@dataclass(frozen=True)
class Joins:
    """Who gets a row and who gives one up, decided at the start of a turn (and, for joiners
    that ended, before its rebatch): the scheduler moves them when it records the plan."""

    expired: tuple[RowRef, ...] = ()  # waited past queue_timeout: they end
    dropped: tuple[RowRef, ...] = ()  # queued, ended before they ran (cancelled, say)
    ended: tuple[RowRef, ...] = ()  # joiners that ended before joining the live batch
    # over the KV budget: joiners wait again now, rows at the turn's rebatch
    preempted: tuple[RowRef, ...] = ()
    joined: tuple[RowRef, ...] = ()  # waiting requests that get a row, oldest first
    now: float = 0.0  # when it was decided (what a timed-out request is told it waited)

    def __bool__(self) -> bool:
        return bool(self.expired or self.dropped or self.ended or self.preempted or self.joined)


class Phase(enum.Enum):
    """Which part of a turn of the engine's loop a StepPlan is (see Scheduler.schedule). A
    part that needs the device's answer to an earlier one is planned once that is recorded."""

    JOIN = "join"  # who joins, leaves the queue or is preempted (housekeeping jobs alone)
    LOAD = "load"  # the session files the turn's first chunks start after
    PREFILL = "prefill"  # one joiner's whole prompt (nothing decodes): the next may start after it
    # the rebatch, then one decode step, with joining requests' prompt chunks in its forward
    STEP = "step"


@dataclass(frozen=True)
class StepPlan:
    """Everything one call of the runner does, in this order: the housekeeping `ops` queued
    since the last plan (`joins` needs nothing of the device: the scheduler records it), the
    session `loads`, the `prefill` in a forward of its own, the
    `rebatch` (extract, cache, assemble), then the `decode` step (its drafting rows' proposers
    draft first: `DecodePlan.proposals`)."""

    phase: Phase
    ops: tuple[Op, ...] = ()
    joins: Joins | None = None
    loads: tuple[LoadSession, ...] = ()
    prefill: PrefillPlan | None = None
    rebatch: RebatchPlan | None = None
    decode: DecodePlan | None = None


@dataclass(frozen=True)
class StepOutcome:
    """What the device answered to a StepPlan: one entry per part the plan has."""

    loads: tuple[Loaded, ...] = ()  # one per StepPlan.loads
    prefill: PrefillOutcome | None = None
    rebatch: RebatchOutcome | None = None
    decode: DecodeOutcome | None = None
    draft_seconds: float = 0.0  # the proposers' drafting before the decode step
