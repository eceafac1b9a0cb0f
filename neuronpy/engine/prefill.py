"""Prefill plans: which cached prefix or session a prompt starts after, its chunks, its copies."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from neuronpy.engine.counters import Counters
from neuronpy.engine.plans import (
    DropCached,
    Loaded,
    LoadSession,
    Op,
    PrefillOutcome,
    PrefillPlan,
)
from neuronpy.engine.prefix_cache import PrefixIndex
from neuronpy.engine.request import Cause, Request
from neuronpy.media import past_image


class Prefills:
    """Plans prompts' prefill chunks, with the prefix cache's index (None: the cache is off)
    and the sessions' restores; records their results into the requests and the index.

    Planning changes nothing: a plan names the snapshot, the prefix it starts after and the
    copies it fills, and recording its result applies them. What a recording leaves to run on the
    device (cache entries or a session's snapshot to drop) is returned, never queued here.

    A session's KV is read before its request's first chunk is planned (the tokens the file
    holds decide where the chunk starts), in a plan of its own: the request keeps it
    (`Request.restored`) until that chunk takes it, or drops it if it ends or is preempted
    first."""

    def __init__(
        self,
        prefix: PrefixIndex | None,
        counters: Counters,
        new_kv_id: Callable[[], int],
        state_block: int = 0,
    ) -> None:
        """`state_block`: the model's layers keep fixed-size states besides KV, advanced by
        prefill chunks cut at multiples of this many tokens (0: none do): chunks end at such
        multiples, and the prefix cache keeps a prompt up to its last one (its states hold
        there alone). `new_kv_id`: the table's ids for snapshots and cache entries."""
        self.prefix = prefix
        self.state_block = state_block
        self._counters = counters
        self._new_kv_id = new_kv_id

    def session_load(self, request: Request) -> LoadSession | None:
        """Before a request's first chunk: its session's KV to read, when the session holds
        more of the prompt than the prefix cache does (and has not been read already)."""
        session = request.session
        if request.done or request.snapshot_id is not None or not session or not session.token_ids:
            return None
        if request.restored is not None:
            return None
        hit = self._lookup(request)
        limit = len(request.prompt_ids) - 1  # one token is left to prefill: it samples
        if common_prefix(session.token_ids[:limit], request.prompt_ids) <= (hit[1] if hit else 0):
            return None
        return LoadSession(request.ref(), self._new_kv_id(), session.path, hit)

    def record_session_load(self, request: Request, load: LoadSession, loaded: Loaded) -> Op | None:
        """Keeps what the session gives (its snapshot and the prefix length) for the request's
        first chunk; answers the snapshot to drop when the file changed and holds no more than
        the cache. A file that could not be read fails the request (the scheduler ends it)."""
        if loaded.error is not None:
            assert request.session is not None
            param = "session" if loaded.invalid else None
            request.end(Cause.FAILED, f"session {request.session.name!r}: {loaded.error}", param)
            return DropCached((load.cache_id,))
        limit = len(request.prompt_ids) - 1
        common = common_prefix(loaded.token_ids[:limit], request.prompt_ids)
        whole = not self.state_block or common == len(loaded.token_ids)
        # (fixed-size states hold after the session's last token: all of it, or none)
        if common <= (load.hit[1] if load.hit else 0) or request.done or not whole:
            return DropCached((load.cache_id,))
        self._counters.sessions_restored += 1
        request.restored = (load.cache_id, common)
        return None

    def plan(self, request: Request, budget: int | None) -> PrefillPlan | None:
        """The next `budget` prompt tokens (all, if None) of the request. Its first chunk starts
        after the longest cached prefix (its session's, when read, or the prefix cache's);
        its last samples the first token and fills the request's other copies (n > 1). None
        when there is nothing to prefill: the request has ended (its session could not be
        read, say), or a copy's prefill has filled it."""
        if request.done or request.prefilled == len(request.prompt_ids):
            return None
        start = request.prefilled
        parent, parent_length, session_id = request.snapshot_id, None, None
        snapshot_id = request.snapshot_id
        if snapshot_id is None:
            hit = request.restored
            if hit is not None:
                session_id = hit[0]
            else:
                hit = self._lookup(request)
            if hit is not None:
                parent, parent_length = hit
                start = parent_length
            snapshot_id = self._new_kv_id()
        prompt = request.prompt_ids
        end = len(prompt) if budget is None else min(len(prompt), start + budget)
        if self.state_block and end < len(prompt):
            # (a mixer cuts its chunks at these multiples: a chunk ending elsewhere would give
            # other bits than a prompt prefilled whole; at least one block, past the budget)
            block = self.state_block
            end = min(len(prompt), max((end // block) * block, (start // block + 1) * block))
        end = past_image(prompt, end)
        last = end == len(prompt)
        cache_id = None
        clones: tuple[Request, ...] = ()
        if last:
            cache_id = self._entry_id_for(self._cacheable(prompt))
            clones = tuple(
                r
                for r in request.group
                if r is not request and r.prefilled == 0 and r.snapshot_id is None and not r.done
            )
        return PrefillPlan(
            request.ref(),
            snapshot_id,
            prompt[start:end],
            parent,
            parent_length,
            last,
            cache_id,
            tuple(c.ref() for c in clones),
            tuple(self._new_kv_id() for _ in clones),
            session_id,
            start,
        )

    def record(
        self,
        request: Request,
        clones: Sequence[Request],
        plan: PrefillPlan,
        outcome: PrefillOutcome,
    ) -> tuple[Op, ...]:
        """A chunk's result (the plan's request and its clones given): the request's snapshot
        and progress, the cache entry, the counters, and after the last chunk the copies'
        snapshots (their first tokens are the scheduler's to accept). Answers the jobs it
        leaves (snapshots to drop)."""
        c = self._counters
        ops: list[Op] = []
        if request.snapshot_id is None:  # its first chunk
            if plan.session_id is not None:
                request.restored = None
            elif self.prefix is not None:
                self._count_lookup(plan.parent_length)
            if plan.parent_length is not None:
                request.cached_tokens = plan.parent_length
            request.snapshot_id = plan.snapshot_id
        c.prefill_tokens += len(plan.tokens)
        if plan.session_id is not None:
            ops.append(DropCached((plan.session_id,)))
        if plan.cache_id is not None:
            length = outcome.cached_length
            tokens = request.prompt_ids if length is None else request.prompt_ids[:length]
            if tokens:
                ops += self.index_entry(plan.cache_id, tokens, outcome.cached_bytes)
        request.prefilled = plan.start + len(plan.tokens)
        c.prefill_chunks += 1
        if plan.last:
            c.prefills += 1
            for clone, sid in zip(clones, plan.clone_ids, strict=True):
                clone.snapshot_id = sid
                clone.prefilled = len(clone.prompt_ids)
                clone.cached_tokens = request.cached_tokens
        return tuple(ops)

    # ---- the prefix cache ---------------------------------------------------------------------

    def _lookup(self, request: Request) -> tuple[int, int] | None:
        """The longest cached prefix of the prompt: (entry id, tokens), leaving one to prefill
        (its logits give the first token)."""
        if self.prefix is None:
            return None
        return self.prefix.lookup(request.prompt_ids, len(request.prompt_ids) - 1)

    def _count_lookup(self, reused: int | None) -> None:
        """A first chunk's prefix-cache lookup: `reused` tokens, or None for a miss."""
        if reused is None:
            self._counters.prefix_cache_misses += 1
        else:
            self._counters.prefix_cache_hits += 1
            self._counters.prefix_cache_reused_tokens += reused

    def _cacheable(self, prompt: Sequence[int]) -> Sequence[int]:
        """What of a prompt the prefix cache can keep: all of it, or up to its last
        `state_block` boundary."""
        if not self.state_block:
            return prompt
        return prompt[: len(prompt) // self.state_block * self.state_block]

    def _entry_id_for(self, tokens: Sequence[int]) -> int | None:
        """An id to keep a finished prompt's KV under in the prefix cache, or None when it
        would add nothing (too short, or a stored sequence starts with it)."""
        index = self.prefix
        if index is None or len(tokens) < index.block or index.covers(tokens):
            return None
        return self._new_kv_id()

    def worth_caching(self, leaving: Sequence[Request]) -> list[Request]:
        """Leaving rows worth keeping in the prefix cache: their prompt's KV. Only the prompt's:
        a prefill computes a token's keys and values as every other prefill does, however the
        prompt was cut into chunks, but a decode step computes them otherwise (in the last
        bits), so a later prompt that holds this reply gets what a fresh prefill gives it."""
        if self.prefix is None or self.state_block:
            return []  # (a leaving row's states are past its prompt: kept at its prefill)
        return [
            r
            for r in leaving
            if len(r.prompt_ids) >= self.prefix.block and not self.prefix.covers(r.prompt_ids)
        ]

    def index_entry(self, cache_id: int, tokens: Sequence[int], nbytes: int) -> tuple[Op, ...]:
        """Indexes an entry the worker now caches; answers the eviction of what that makes
        redundant or what no longer fits the budget (least recently used first)."""
        assert self.prefix is not None
        dropped = self.prefix.insert(cache_id, tokens, nbytes)
        return (DropCached(tuple(dropped)),) if dropped else ()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens two sequences share from the start."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
