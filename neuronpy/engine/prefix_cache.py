"""The prefix cache's index, on the engine's side: which token sequences the device worker keeps
KV snapshots of, the longest stored prefix of a prompt, and least-recently-used eviction within
a byte budget. The worker only holds the snapshots, by id; this index decides.

Lookups hash block-aligned prefixes (a chain hash per BLOCK tokens), so finding the longest
stored prefix of a P-token prompt costs P / BLOCK dictionary lookups plus one token comparison
per candidate; the match is then extended token by token within the last block. A match
shorter than one block is not worth a restore and is never reported.

An exact index (a model whose layers keep fixed-size states, arch/mixer.py) reports only
entries whose every token starts the prompt: a state holds after its entry's last token alone,
so an entry cannot be cut shorter, and an entry that is a prefix of another is kept.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

BLOCK = 16  # tokens per hashed block: the shortest prefix the cache restores
MAX_CANDIDATES = 16  # entries compared at the deepest matching block (they share that prefix)


@dataclass
class CacheEntry:
    id: int  # the worker's snapshot id
    tokens: tuple[int, ...]
    nbytes: int


def _boundaries(tokens: Sequence[int], block: int) -> Iterator[tuple[int, int]]:
    """(prefix length, chain hash of that prefix) at every full block of `tokens`."""
    h = 0
    for end in range(block, len(tokens) + 1, block):
        h = hash((h, tuple(tokens[end - block : end])))
        yield end, h


class PrefixIndex:
    """Token sequences with a KV snapshot on the worker, most recently used last."""

    def __init__(self, budget_bytes: int, block: int = BLOCK, *, exact: bool = False) -> None:
        if budget_bytes < 0 or block < 1:
            raise ValueError("the budget must be >= 0 and the block >= 1")
        self.budget_bytes = budget_bytes
        self.block = block
        self.exact = exact
        self.bytes = 0
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()
        self._by_prefix: dict[int, set[int]] = {}  # chain hash -> entries holding that prefix
        self._by_end: dict[int, set[int]] = {}  # chain hash of an entry's last full block -> it

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._entries

    def lookup(self, tokens: Sequence[int], limit: int | None = None) -> tuple[int, int] | None:
        """The entry sharing the longest prefix with `tokens` and that prefix's length (at most
        `limit`, at least one block), or None. Marks the entry as used."""
        found = self._longest(tokens, limit)
        if found is not None:
            self._entries.move_to_end(found[0])
        return found

    def covers(self, tokens: Sequence[int]) -> bool:
        """Whether a stored sequence starts with all of `tokens` (storing them adds nothing)."""
        found = self._longest(tokens, None)
        return found is not None and found[1] == len(tokens)

    def _longest(self, tokens: Sequence[int], limit: int | None) -> tuple[int, int] | None:
        if self.exact:
            return self._longest_whole(tokens, limit)
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        depth, candidates = 0, None
        for end, h in _boundaries(tokens, self.block):
            ids = self._by_prefix.get(h)
            if not ids:
                break
            depth, candidates = end, ids
        if candidates is None or min(depth, limit) < self.block:
            return None
        want = tuple(tokens[:depth])
        best: tuple[int, int] | None = None
        for entry_id in itertools.islice(candidates, MAX_CANDIDATES):
            stored = self._entries[entry_id].tokens
            if stored[:depth] != want:  # a hash collision
                continue
            n, stop = depth, min(len(stored), len(tokens))
            while n < stop and stored[n] == tokens[n]:
                n += 1
            if best is None or n > best[1]:
                best = (entry_id, n)
        if best is None:
            return None
        return best[0], min(best[1], limit)

    def _longest_whole(self, tokens: Sequence[int], limit: int | None) -> tuple[int, int] | None:
        """The longest entry all of whose tokens start `tokens` (and number at most `limit`)."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        best = None
        for end, h in _boundaries(tokens, self.block):
            if end > limit or not self._by_prefix.get(h):
                break
            for entry_id in self._by_end.get(h, ()):
                stored = self._entries[entry_id].tokens
                if len(stored) == end and tuple(tokens[:end]) == stored:
                    best = (entry_id, end)
        return best

    def insert(self, entry_id: int, tokens: Sequence[int], nbytes: int) -> list[int]:
        """Records a snapshot the worker now caches under `entry_id`. Returns the ids the
        worker should drop: entries that are prefixes of this one (it holds them all), the
        least recently used ones past the budget, or this one itself when it is shorter than a
        block, already covered by a stored sequence, or larger than the whole budget."""
        tokens = tuple(tokens)
        if entry_id in self._entries:
            raise ValueError(f"entry {entry_id} is cached already")
        if len(tokens) < self.block or nbytes > self.budget_bytes or self.covers(tokens):
            return [entry_id]
        dropped = []
        boundaries = list(_boundaries(tokens, self.block))
        for end, h in [] if self.exact else boundaries:  # stored ones ending within this one
            for other in list(self._by_end.get(h, ())):
                stored = self._entries[other].tokens
                if len(stored) < end + self.block and tokens[: len(stored)] == stored:
                    self._remove(other)
                    dropped.append(other)
        self._entries[entry_id] = CacheEntry(entry_id, tokens, nbytes)
        for _, h in boundaries:
            self._by_prefix.setdefault(h, set()).add(entry_id)
        self._by_end.setdefault(boundaries[-1][1], set()).add(entry_id)
        self.bytes += nbytes
        while self.bytes > self.budget_bytes:
            oldest = next(iter(self._entries))
            self._remove(oldest)
            dropped.append(oldest)
        return dropped

    def clear(self) -> list[int]:
        """Forgets every entry; returns their ids."""
        ids = list(self._entries)
        for entry_id in ids:
            self._remove(entry_id)
        return ids

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self.bytes -= entry.nbytes
        boundaries = list(_boundaries(entry.tokens, self.block))
        for _, h in boundaries:
            ids = self._by_prefix[h]
            ids.discard(entry_id)
            if not ids:
                del self._by_prefix[h]
        last = boundaries[-1][1]
        ends = self._by_end[last]
        ends.discard(entry_id)
        if not ends:
            del self._by_end[last]
