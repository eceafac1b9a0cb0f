"""Sampling's arithmetic over plain data: a distribution from one logits row by temperature and
truncation, and one draw from it with a given generator. The engine's samplers build on it (after
their penalties and constraints); the draft model's job draws its drafts with it on the worker
thread, from the parameters and seed its job carries."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Truncation:
    """How a row's distribution is shaped: temperature, top-k, top-p and min-p (as vLLM's
    sampling parameters name them); `greedy`: the argmax alone."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 or past the vocabulary: no top-k
    top_p: float = 1.0
    min_p: float = 0.0


@dataclass(frozen=True)
class DraftSampling:
    """A sampled row's draft draws in one draft job: its truncation, and the seed of the
    generator its draws of that job come from (the request's own generator gave it, so a
    seeded request drafts the same tokens alone or in any batch)."""

    truncation: Truncation
    seed: int


def distribution(x: torch.Tensor, how: Truncation) -> torch.Tensor:
    """The [vocab] distribution a row is drawn from: `x` is a float32 copy of its (penalized)
    logits, changed in place. Greedy: one-hot at the argmax."""
    if how.greedy:
        return torch.zeros_like(x).scatter_(0, torch.argmax(x).view(1), 1.0)
    if how.temperature != 1.0:
        x.div_(how.temperature)
    probs = torch.softmax(x, dim=0)
    truncated = False
    if 0 < how.top_k < probs.shape[0]:
        kth = torch.topk(probs, how.top_k, sorted=False).values.min()
        # Ids tied with the k-th stay, as in HF and vLLM.
        probs.masked_fill_(probs < kth, 0.0)
        truncated = True
    if how.top_p < 1.0:
        # Over what top-k left, renormalized, as in HF and vLLM.
        keep = _nucleus(probs, how.top_p)
        probs = torch.zeros_like(probs).index_copy_(0, keep, probs[keep])
        truncated = True
    if how.min_p > 0.0:
        probs.masked_fill_(probs < how.min_p * probs.max(), 0.0)
        truncated = True
    return probs / probs.sum() if truncated else probs


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Inverse-CDF draw: one uniform from `generator` (torch.multinomial draws one exponential
    per vocabulary entry, ~10x slower at 50k entries)."""
    cdf = torch.cumsum(probs, dim=0, dtype=torch.float64)
    total = cdf[-1]
    u = torch.rand(1, generator=generator, dtype=torch.float64) * total
    # right=True never lands on a zero-probability id: its cdf equals its predecessor's.
    token = int(torch.searchsorted(cdf, u, right=True))
    if token >= cdf.numel():
        # u rounded up to the total: take the last id with nonzero probability.
        token = int(torch.searchsorted(cdf, total.view(1)))
    return token


def generator_of(seed: int) -> torch.Generator:
    """A CPU generator seeded with any Python int (manual_seed takes any 64-bit pattern)."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return generator


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Ids of the smallest set of most likely ids that holds top_p of the mass of `probs`.

    Sorting is the cost, so only the ids within a factor of the most likely one are sorted,
    widening the factor only while they hold too little mass: a peaked distribution sorts a
    handful of values rather than the whole vocabulary.
    """
    target = top_p * float(probs.sum())
    top = probs.max()
    for ratio in (1e-3, 1e-6, 0.0):
        # ratio 0: every id with any mass (few of them after top-k).
        cand = torch.nonzero(probs >= top * ratio if ratio else probs > 0).squeeze(1)
        if not ratio or float(probs[cand].sum()) >= target:
            break
    vals, order = torch.sort(probs[cand], descending=True, stable=True)
    mass = torch.cumsum(vals, dim=0)
    # Rounding may leave the whole mass a hair under the target: then keep all of them.
    n = min(int(torch.searchsorted(mass, target)) + 1, vals.numel())
    return cand[order[:n]]
