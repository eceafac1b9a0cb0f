"""The scheduler's part of drafting: which rows draft and how many tokens, what each proposer
lacks of each row, what it gives back, and what it releases. Pure: no torch, no anyio."""

from __future__ import annotations

from collections.abc import Sequence

from neuronpy.engine.plans import DraftRow, Proposal, Proposals, ReleaseDrafts, Sampled
from neuronpy.engine.request import Request
from neuronpy.engine.speculative import SpeculativeConfig, share_budget
from neuronpy.media import text_ids

# a draft model steps, in its own lockstep batch, every row it holds whenever it drafts: a row
# whose draft KV lags its context by more than this many tokens starts again from its whole
# context (a long catch-up would make every row's first draft step that long)
MAX_CATCH_UP = 32
# the methods whose proposer is a lockstep batch of its own (above)
BATCHED = frozenset({"draft"})


class DraftPlanner:
    """Plans each decode step's proposals and records their answers, over the rows' Speculation
    (what each row's proposer holds of it)."""

    def __init__(self, config: SpeculativeConfig, context_len: int) -> None:
        self.config = config
        self.context_len = context_len
        self._held: dict[int, Request] = {}  # the rows a proposer holds anything of, by id

    def clear(self) -> None:
        self._held.clear()

    def plan(self, rows: Sequence[Request]) -> tuple[Proposals, ...]:
        """Each method's drafting rows of a step over `rows`: those with a draft length
        (within the step's budget over its greedy rows), and with a batched proposer that
        drafts this step, every other row it holds too (it catches up)."""
        lengths = [self._length(r) for r in rows]
        budget = self.config.step_budget
        if sum(lengths) > budget:
            lengths = share_budget(lengths, [r.params.greedy for r in rows], budget)
        drafting = {
            r.speculation.method for r, k in zip(rows, lengths, strict=True) if k and r.speculation
        }
        by_method: dict[str, list[DraftRow]] = {}
        for i, (request, k) in enumerate(zip(rows, lengths, strict=True)):
            spec = request.speculation
            if spec is None or request.done or request.forced:
                continue  # (a row its grammar forces feeds those tokens instead)
            rides = spec.method in BATCHED and spec.method in drafting and spec.proposed
            if k or rides:
                by_method.setdefault(spec.method, []).append(self._row(i, request, k))
        return tuple(Proposals(method, tuple(rows)) for method, rows in by_method.items())

    def _length(self, request: Request) -> int:
        """How many tokens the request drafts for its next step: none once it is done, never
        past max_tokens or the context (the step emits one token of its own besides)."""
        spec = request.speculation
        if spec is None or request.done or request.forced:
            return 0
        room = min(
            request.params.max_tokens - len(request.output_ids),
            self.context_len - request.total_tokens,
        )
        return spec.length.next(room - 1)

    def _row(self, index: int, request: Request, k: int) -> DraftRow:
        spec = request.speculation
        assert spec is not None
        total = request.total_tokens
        fresh = not spec.proposed or (spec.method in BATCHED and total - spec.kept > MAX_CATCH_UP)
        start = 0 if fresh else spec.kept
        self._held[request.id] = request
        return DraftRow(
            index,
            request.id,
            k,
            _context_from(request, start),
            rollback=0 if fresh else spec.held - spec.kept,
            fresh=fresh,
            context=total,
        )

    def book(
        self,
        rows: Sequence[Request],
        proposals: Sequence[Proposals],
        answers: Sequence[Proposal],
        tokens: Sequence[Sampled],
        drafted: Sequence[int],
    ) -> None:
        """A step's proposals answered and its drafts verified: what each proposer holds of
        its rows, and of that what still agrees with the context; each row's draft length
        learns from its acceptance."""
        for plan, answer in zip(proposals, answers, strict=True):
            for row, held in zip(plan.rows, answer.held, strict=True):
                spec = rows[row.row].speculation
                assert spec is not None
                spec.book(row.context, held)
                accepted = len(tokens[row.row].accepted)
                spec.book_verified(accepted)
                if row.row < len(drafted) and drafted[row.row]:
                    spec.length.observe(drafted[row.row], accepted)

    def releases(self, rows: Sequence[Request]) -> tuple[ReleaseDrafts, ...]:
        """What the proposers release now: the rows they hold that are not among `rows` (the
        next step's) or have ended: they left, were preempted or are leaving."""
        staying = {r.id for r in rows if not r.done}
        gone: dict[str, list[int]] = {}
        for rid, request in list(self._held.items()):
            if rid in staying:
                continue
            del self._held[rid]
            spec = request.speculation
            assert spec is not None
            spec.forget()
            gone.setdefault(spec.method, []).append(rid)
        return tuple(ReleaseDrafts(method, tuple(keys)) for method, keys in gone.items())


def _context_from(request: Request, start: int) -> tuple[int, ...]:
    """The request's context (prompt and output) from token `start` on (an image's tokens as
    token 0: a drafter reads text; what it drafts is verified)."""
    prompt = request.prompt_ids
    if start >= len(prompt):
        return tuple(request.output_ids[start - len(prompt) :])
    return (*text_ids(prompt[start:]), *request.output_ids)
