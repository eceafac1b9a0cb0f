"""The chunk cost model: what steps and prefills take, and how large a prompt chunk prefilled
within a decode step's forward may be."""

from __future__ import annotations

from collections import deque

MIN_CHUNK = 16  # the fewest prompt tokens a chunk prefills


def ema(average: float, sample: float, weight: float = 0.2) -> float:
    """Exponential moving average; the first sample stands alone."""
    return sample if not average else (1 - weight) * average + weight * sample


class PrefillCost:
    """Fits prefill time = fixed + per_token * tokens over the recent prefills run on their own.
    The fixed part is reading every weight once, which a prompt chunk prefilled within a decode
    step does not pay: its per-token part is what such a chunk costs at the least (see
    StepCosts.ride_budget)."""

    def __init__(self, window: int = 32) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, tokens: int, seconds: float) -> None:
        self._samples.append((tokens, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before there are samples."""
        if not self._samples:
            return None
        n = len(self._samples)
        mean_x = sum(x for x, _ in self._samples) / n
        mean_y = sum(y for _, y in self._samples) / n
        var = sum((x - mean_x) ** 2 for x, _ in self._samples)
        if var > 0:
            slope = sum((x - mean_x) * (y - mean_y) for x, y in self._samples) / var
            fixed = mean_y - slope * mean_x
            if slope > 0 and fixed >= 0:
                return fixed, slope
        # one chunk size only, or a fit that makes no sense: all of it per token
        return 0.0, mean_y / max(mean_x, 1e-9)


class StepCosts:
    """Measured costs: a decode step's forward, a prefill's, and what a prompt chunk prefilled
    within a step adds."""

    def __init__(self, chunk_steps: float, max_chunk: int) -> None:
        # decode steps' time a prompt chunk may add to the step it is prefilled in
        self.chunk_steps = chunk_steps
        self.max_chunk = max_chunk
        self.step_seconds = 0.0  # moving average of a decode step's forward
        self.ride_seconds_per_token = 0.0  # what a prompt chunk adds to its step, per token
        self.prefill = PrefillCost()

    def observe_step(self, seconds: float) -> None:
        self.step_seconds = ema(self.step_seconds, seconds)

    def observe_ride(self, seconds: float, tokens: int) -> float:
        """Records a step that carried a chunk of `tokens`; returns the chunk's share of it."""
        extra = max(0.0, seconds - self.step_seconds)
        self.ride_seconds_per_token = ema(self.ride_seconds_per_token, extra / tokens)
        return extra

    def ride_budget(self, joiners: int = 1) -> int:
        """Prompt tokens the chunks prefilled within one step may add: about `chunk_steps` decode
        steps' time per joining request, at what such chunks have cost per token (no weight
        reads of their own: more tokens fit than in a chunk run on its own), at least MIN_CHUNK
        per joining request, and never past `max_chunk`.
        The joining requests share it oldest first, so a burst of arrivals fills the batch
        within a few steps instead of joining one by one while the batch decodes half empty."""
        fit = self.prefill.fit()
        # a chunk's compute costs at least about what it does run on its own, weights aside:
        # the fit's per-token figure bounds a noisy (or not yet measured) estimate
        per_token = max(self.ride_seconds_per_token, fit[1] if fit else 0.0)
        joiners = max(1, joiners)
        budget = 0
        if per_token and self.step_seconds:
            budget = int(joiners * self.chunk_steps * self.step_seconds / per_token)
        # every joiner gets at least the least chunk (MIN_CHUNK), the step at most max_chunk
        return max(MIN_CHUNK, min(self.max_chunk, max(MIN_CHUNK * joiners, budget)))
