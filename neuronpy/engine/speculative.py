"""Speculative decoding's pure parts: its configuration, each row's draft length and what its
proposer holds of it (the proposers themselves: engine/drafting/).

A row with drafts feeds its next token and k drafted tokens in one lockstep step; the target
model's logits at those k + 1 positions decide how many drafts stand (greedy: the longest
prefix the target would have chosen itself; sampled: the rejection rule, engine/sampling.py),
and one more token always comes from the target. No torch, no anyio: plain data.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from neuronpy.defaults import SPECULATIVE_METHODS

__all__ = [
    "DEFAULT_DRAFTS",
    "SPECULATIVE_METHODS",
    "DraftLength",
    "Speculation",
    "SpeculativeConfig",
    "cut_at_stop",
    "share_budget",
]

# the most drafts per row and step by method, unless configured: prompt lookup's cost nothing to
# make and most stand where any do; each of a draft model's costs one of its forwards
DEFAULT_DRAFTS = {"ngram": 8, "draft": 4}
# a row's acceptance rate is a moving average with this weight on the newest step
ACCEPTANCE_WEIGHT = 0.3
# draft the j-th token only while the chance that drafts 1..j all stand is at least this
MIN_RUN_CHANCE = 0.2
# a row whose drafts stopped paying (k fell to 0) tries one draft again every this many steps
PROBE_EVERY = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """How a model speculates: `method` "off", "ngram" (prompt lookup: the continuation of the last
    earlier occurrence of the context's last n tokens, for n from `lookup_max` down to
    `lookup_min`) or "draft" (a smaller model of the same tokenizer drafts), at most
    `num_tokens` drafts per row and step, and `step_budget` over a step's greedy rows."""

    method: str = "off"
    num_tokens: int = 0  # 0: by method (DEFAULT_DRAFTS)
    lookup_min: int = 2
    lookup_max: int = 4
    # the most drafted tokens one step verifies over its greedy rows together (their drafts
    # never change what they emit, so the batch may share them out: a step's cost grows with
    # its tokens once the batch is wide); sampled rows keep their own draft lengths
    step_budget: int = 32
    # what one token of a row's KV in the draft model costs in the KV budget, in tokens of the
    # model's KV (the two models' KV bytes per token, divided); 0: no draft model
    draft_kv_ratio: float = 0.0

    def tokens_for(self, method: str) -> int:
        """The most drafts a row of this method verifies per step."""
        return self.num_tokens or DEFAULT_DRAFTS.get(method, 4)


def cut_at_stop(drafts: tuple[int, ...], stop_ids: Collection[int]) -> tuple[int, ...]:
    """The drafts up to the first stop token (kept: it may stand), none after it: nothing
    after a stop token is ever emitted."""
    for i, token in enumerate(drafts):
        if token in stop_ids:
            return drafts[: i + 1]
    return drafts


class DraftLength:
    """How many tokens a row drafts next: the longest run whose chance of standing in full
    (its acceptance rate to that power) is at least MIN_RUN_CHANCE, from `num_tokens` while
    nothing is measured; a row whose drafts stop paying drafts one token every PROBE_EVERY
    steps, to notice when they would pay again. Each row's own history decides, never the
    batch's, so that a seeded request draws the same random numbers in any batch."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.rate = 1.0  # the moving average of drafts accepted / drafted
        self._idle = 0

    def next(self, room: int) -> int:
        """The draft length for the next step, within `room` (what max_tokens and the
        context leave after the step's own token)."""
        k = 0
        chance = self.rate
        while k < self.num_tokens and chance >= MIN_RUN_CHANCE:
            k += 1
            chance *= self.rate
        if k == 0:
            self._idle += 1
            if self._idle >= PROBE_EVERY:
                self._idle, k = 0, 1
        return max(0, min(k, room))

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted:
            rate = accepted / drafted
            self.rate += ACCEPTANCE_WEIGHT * (rate - self.rate)


class Speculation:
    """One request's speculation: its method, its draft length, and what its method's proposer
    holds of it (engine/drafting/proposer.py), as the scheduler records it: `fed` tokens of its
    context at its last proposal, `held` tokens then held (the context and any drafts the
    proposer fed itself), of which `kept` still agree with the context once the target has
    verified (the rest, `held - kept`, the next proposal rolls back). All 0: it holds nothing.
    """

    def __init__(self, config: SpeculativeConfig, method: str) -> None:
        self.config = config
        self.method = method
        self.length = DraftLength(config.tokens_for(method))
        self.fed = self.held = self.kept = 0
        # the drafts its verify steps fed the target, and of those the ones that stood (its
        # usage's accepted / rejected prediction tokens)
        self.drafted = self.accepted = 0

    @property
    def proposed(self) -> bool:
        """Whether its proposer holds anything of it."""
        return self.held > 0

    def forget(self) -> None:
        """Its proposer's state of it went (released)."""
        self.fed = self.held = self.kept = 0

    def book(self, fed: int, held: int) -> None:
        """A proposal for it: its proposer had `fed` tokens of its context, holds `held`."""
        self.fed, self.held, self.kept = fed, held, fed

    def book_verified(self, accepted: int) -> None:
        """The target accepted the first `accepted` of its drafts: the proposer's drafts among
        them (those it fed itself) still agree with the context."""
        self.kept = self.fed + min(accepted, self.held - self.fed)

    def kv_need(self, tokens: int) -> int:
        """What its draft KV takes through its next step, in tokens of the model's KV, for a
        request of `tokens` tokens: its context and the drafts the draft model feeds itself
        (none but with a draft model)."""
        if self.method != "draft" or not self.config.draft_kv_ratio:
            return 0
        return math.ceil(self.config.draft_kv_ratio * (tokens + self.length.num_tokens))

    def kv_held(self) -> int:
        """What its draft KV takes now, in tokens of the model's KV."""
        if self.method != "draft" or not self.config.draft_kv_ratio:
            return 0
        return math.ceil(self.config.draft_kv_ratio * self.held)


def share_budget(lengths: list[int], greedy: Sequence[bool], budget: int) -> list[int]:
    """Draft lengths within `budget` drafts in all: the greedy rows' longest are shortened,
    one draft at a time, until the sum fits (or they are all zero); the others stay."""
    out = list(lengths)
    excess = sum(out) - budget
    while excess > 0:
        longest = max(
            (i for i, g in enumerate(greedy) if g and out[i]), key=out.__getitem__, default=None
        )
        if longest is None:
            break
        out[longest] -= 1
        excess -= 1
    return out
