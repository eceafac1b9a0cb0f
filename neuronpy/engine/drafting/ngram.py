"""Prompt lookup: drafts are the continuation of the latest earlier occurrence of the context's
last n tokens. Pure: no torch, no anyio."""

from __future__ import annotations

from collections.abc import Sequence

from neuronpy.engine.plans import DraftRow, Proposal


class NgramDrafter:
    """Prompt lookup over one sequence (its prompt and its output so far): an index from each
    n-gram (n in [lookup_min, lookup_max]) to the position after its latest occurrence that is
    not the sequence's own end, kept up to date token by token (O(n sizes) per token)."""

    def __init__(self, token_ids: Sequence[int], lookup_min: int = 2, lookup_max: int = 4):
        if not 1 <= lookup_min <= lookup_max:
            raise ValueError(f"lookup sizes {lookup_min}..{lookup_max}")
        self.sizes = range(lookup_max, lookup_min - 1, -1)
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}
        self.extend(token_ids)

    def extend(self, token_ids: Sequence[int]) -> None:
        """The sequence grew by these tokens."""
        tokens, after = self.tokens, self._after
        for token in token_ids:
            # the n-grams ending at the old last token are no longer the sequence's end: from
            # now on their continuation is the token appended here
            end = len(tokens)
            for n in self.sizes:
                if n <= end:
                    after[tuple(tokens[end - n : end])] = end
            tokens.append(token)

    def propose(self, k: int) -> tuple[int, ...]:
        """Up to k tokens that followed the longest recent match of the sequence's end."""
        tokens = self.tokens
        if k < 1:
            return ()
        for n in self.sizes:
            if n > len(tokens):
                continue
            at = self._after.get(tuple(tokens[len(tokens) - n :]))
            if at is not None:
                return tuple(tokens[at : at + k])
        return ()


class NgramProposer:
    """The Proposer of prompt lookup: one NgramDrafter per row, fed each row's new tokens. It
    never feeds itself its drafts, so it holds exactly each row's context (nothing to roll
    back)."""

    def __init__(self, lookup_min: int = 2, lookup_max: int = 4) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max
        self.rows: dict[int, NgramDrafter] = {}

    async def propose(self, rows: Sequence[DraftRow]) -> Proposal:
        return self.propose_now(rows)

    def propose_now(self, rows: Sequence[DraftRow]) -> Proposal:
        """`propose`, without an event loop (it never waits)."""
        drafts, held = [], []
        for row in rows:
            if row.rollback:
                raise ValueError(f"prompt lookup holds no drafts to roll back (row {row.key})")
            drafter = None if row.fresh else self.rows.get(row.key)
            if drafter is None:
                drafter = NgramDrafter(row.tokens, self.lookup_min, self.lookup_max)
                self.rows[row.key] = drafter
            else:
                drafter.extend(row.tokens)
            drafts.append(drafter.propose(row.length))
            held.append(len(drafter.tokens))
        return Proposal(tuple(drafts), tuple(held))

    async def release(self, keys: Sequence[int]) -> None:
        for key in keys:
            self.rows.pop(key, None)
