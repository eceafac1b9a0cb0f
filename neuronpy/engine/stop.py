"""Stop strings over a stream of text deltas: emit what is safe, never any part of a stop."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Cuts a text stream at the earliest occurrence of any stop string.

    Text that could still be the start of a stop string is held back until the next delta
    settles it. A complete stop is reported once no stop string starting earlier can still
    complete, so the result never depends on how the text was split into deltas: the
    concatenated output is exactly the text before the earliest occurrence.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._held = ""
        self._stopped = False
        self._matched: str | None = None

    @property
    def stopped(self) -> bool:
        """Whether a stop string has matched (by `push` or by `flush`)."""
        return self._stopped

    @property
    def matched(self) -> str | None:
        """The stop string that matched, else None; of several starting at one place, the
        shortest (the one that completes first: the same however the text was split)."""
        return self._matched

    def push(self, delta: str) -> tuple[str, bool]:
        """Add a delta; return (text safe to emit now, stopped?)."""
        if self._stopped:
            return "", True
        if not self._stops:
            return delta, False
        text = self._held + delta
        hit = self._earliest_match(text)
        pending = self._pending_start(text)
        if hit >= 0 and hit <= pending:
            self._held = ""
            self._stop_at(text, hit)
            return text[:hit], True
        # With a match past `pending`, a longer stop that starts earlier may still complete
        # and win, so the match stays held (pending < hit) until that is settled.
        self._held = text[pending:]
        return text[:pending], False

    def flush(self) -> str:
        """Return the held-back text at the end of the stream, cut at a stop if one matched."""
        if self._stopped:
            return ""
        text, self._held = self._held, ""
        hit = self._earliest_match(text)
        if hit >= 0:
            self._stop_at(text, hit)
            return text[:hit]
        return text

    def _stop_at(self, text: str, hit: int) -> None:
        self._stopped = True
        self._matched = min((s for s in self._stops if text.startswith(s, hit)), key=len)

    def _earliest_match(self, text: str) -> int:
        """Start of the earliest complete stop string in `text`, or -1."""
        starts = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        return min(starts, default=-1)

    def _pending_start(self, text: str) -> int:
        """Start of the longest suffix of `text` that is a proper prefix of a stop string
        (len(text) if none): the earliest place a stop could still begin."""
        best = len(text)
        for stop in self._stops:
            # Only the last len(stop) - 1 characters can begin an unfinished match.
            i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
            while 0 <= i < best:
                if stop.startswith(text[i:]):
                    best = i
                    break
                i = text.find(stop[0], i + 1)
        return best
