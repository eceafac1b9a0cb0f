"""Sampler: penalties by hand, truncation supports, seeded reproducibility, distribution."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from neuronpy.engine.sampling import Sampler, sample_rows
from neuronpy.engine.types import SamplingParams
from neuronpy.errors import InvalidRequestError

BASE = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
PROBS = [0.5, 0.3, 0.15, 0.05]
VOCAB = 50


def sampler(prompt: tuple[int, ...] = (), vocab: int = 5, **params: Any) -> Sampler:
    return Sampler(SamplingParams(**params), prompt, vocab)


def force(s: Sampler, tokens: list[int], vocab: int = 5) -> None:
    """Put `tokens` into the sampler's history through sample() (temperature-0 samplers)."""
    for t in tokens:
        logits = torch.zeros(vocab)
        logits[t] = 100.0
        assert s.sample(logits) == t


def support(logits: torch.Tensor, draws: int = 300, **params: Any) -> set[int]:
    """The ids drawn by `draws` samplers with different seeds."""
    return {
        sampler(vocab=logits.numel(), seed=seed, **params).sample(logits) for seed in range(draws)
    }


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # Not torch.testing.assert_close: its first call costs over a second of imports.
    assert torch.allclose(actual, expected, atol=1e-6), (actual, expected)


def nonzero(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs).squeeze(1).tolist())


def test_greedy_is_argmax() -> None:
    gen = torch.Generator().manual_seed(0)
    s = sampler(vocab=1000, temperature=0.0)
    for _ in range(50):
        logits = torch.randn(1000, generator=gen)
        assert s.sample(logits) == int(torch.argmax(logits))


def test_greedy_ties_go_to_the_lowest_id() -> None:
    assert sampler(vocab=4, temperature=0.0).sample(torch.tensor([1.0, 3.0, 3.0, 0.0])) == 1


def test_repetition_penalty_over_prompt_and_output() -> None:
    s = sampler(prompt=(0, 1), temperature=0.0, repetition_penalty=2.0)
    force(s, [3])
    # Seen ids 0, 1, 3: positive logits halve, negative ones double; 2 and 4 are untouched.
    expected = torch.tensor([1.0, -2.0, 0.5, 1.5, -2.0])
    assert_close(s.penalize(BASE), expected)


def test_frequency_and_presence_penalties_over_output_only() -> None:
    s = sampler(prompt=(0,), temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25)
    force(s, [2, 2, 3])
    # id 2: 2 * 0.5 + 0.25; id 3: 1 * 0.5 + 0.25; prompt id 0 untouched.
    expected = torch.tensor([2.0, -1.0, -0.75, 2.25, -2.0])
    assert_close(s.penalize(BASE), expected)


def test_penalties_apply_in_order_and_steer_greedy() -> None:
    params = dict(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)
    s = sampler(prompt=(1,), temperature=0.0, **params)
    force(s, [3, 3])
    # id 3: 3.0 / 2 (repetition) - (2 * 1.0 + 0.5) (frequency, presence) = -1.0
    expected = torch.tensor([2.0, -2.0, 0.5, -1.0, -2.0])
    assert_close(s.penalize(BASE), expected)
    assert s.sample(BASE) == 0  # 3 would win without the penalties
    assert s.output_ids == [3, 3, 0]


def test_neutral_penalties_change_nothing() -> None:
    s = sampler(prompt=(0, 1, 3), temperature=0.0)
    force(s, [3, 2])
    assert_close(s.penalize(BASE), BASE)


def test_top_k_restricts_the_support() -> None:
    logits = torch.randn(100, generator=torch.Generator().manual_seed(1)) * 0.3
    top5 = set(torch.topk(logits, 5).indices.tolist())
    assert support(logits, top_k=5) == top5
    assert nonzero(sampler(vocab=100, top_k=5).probs(logits)) == top5


def test_top_k_keeps_ties_at_the_boundary() -> None:
    logits = torch.tensor([3.0, 2.0, 2.0, 1.0])
    assert nonzero(sampler(vocab=4, top_k=2).probs(logits)) == {0, 1, 2}


@pytest.mark.parametrize(("top_p", "kept"), [(0.4, {0}), (0.7, {0, 1}), (0.9, {0, 1, 2})])
def test_top_p_keeps_the_smallest_set_reaching_top_p(top_p: float, kept: set[int]) -> None:
    logits = torch.tensor(PROBS).log()
    assert support(logits, top_p=top_p) == kept
    probs = sampler(vocab=4, top_p=top_p).probs(logits)
    assert nonzero(probs) == kept
    # Renormalized over what is kept.
    want = torch.tensor([p if i in kept else 0.0 for i, p in enumerate(PROBS)])
    assert_close(probs, want / want.sum())


def test_top_p_over_a_wide_flat_distribution() -> None:
    # Needs the nucleus search to widen past its first guesses.
    n = len(nonzero(sampler(vocab=1000, top_p=0.55).probs(torch.zeros(1000))))
    assert 550 <= n <= 551


def test_top_p_applies_after_top_k() -> None:
    logits = torch.tensor([*PROBS, 0.001]).log()
    # After top-k=2 the kept probabilities are 0.625 and 0.375: top_p=0.6 keeps only id 0.
    assert nonzero(sampler(vocab=5, top_k=2, top_p=0.6).probs(logits)) == {0}
    assert nonzero(sampler(vocab=5, top_k=3, top_p=0.7).probs(logits)) == {0, 1}


@pytest.mark.parametrize(("min_p", "kept"), [(0.2, {0, 1, 2}), (0.5, {0, 1}), (1.0, {0})])
def test_min_p_drops_tokens_below_a_fraction_of_the_top(min_p: float, kept: set[int]) -> None:
    logits = torch.tensor(PROBS).log()
    assert support(logits, min_p=min_p) == kept
    assert nonzero(sampler(vocab=4, min_p=min_p).probs(logits)) == kept


def test_same_seed_same_draws_different_seed_different_draws() -> None:
    rows = torch.randn(40, 50, generator=torch.Generator().manual_seed(3))

    def draws(seed: int) -> list[int]:
        s = sampler(vocab=50, seed=seed, temperature=1.5)
        return [s.sample(row) for row in rows]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_draws_do_not_depend_on_other_requests() -> None:
    rows = torch.randn(30, 50, generator=torch.Generator().manual_seed(4))
    alone = sampler(vocab=50, seed=11)
    solo = [alone.sample(row) for row in rows]
    # Interleaved with other requests, as in a batch, on their own logits.
    a, b, c = (sampler(vocab=50, seed=s) for s in (11, 12, None))
    batched = []
    for row in rows:
        b.sample(-row)
        batched.append(a.sample(row))
        c.sample(row * 2)
    assert batched == solo


def test_unseeded_requests_differ_and_any_64_bit_seed_works() -> None:
    logits = torch.zeros(1000)
    first, second = sampler(vocab=1000), sampler(vocab=1000)
    assert [first.sample(logits) for _ in range(20)] != [second.sample(logits) for _ in range(20)]
    for seed in (-(2**63), -1, 0, 2**64 - 1):
        assert 0 <= sampler(vocab=1000, seed=seed).sample(logits) < 1000
    for seed in (-(2**63) - 1, 2**64, 2**70):  # past what the generator takes: refused up front
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(seed=seed)
        assert info.value.param == "seed"


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_empirical_distribution_matches_softmax(temperature: float) -> None:
    logits = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]).log()
    want = torch.softmax(logits / temperature, dim=0)
    s = sampler(vocab=6, seed=2024, temperature=temperature)
    draws = 4000
    counts = torch.bincount(torch.tensor([s.sample(logits) for _ in range(draws)]), minlength=6)
    expected = want * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 5 degrees of freedom: 20.5 is the 0.1% tail; a wrong distribution lands far above it.
    assert chi2 < 20.5, (counts.tolist(), expected.tolist())


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.0),
        dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4),
        dict(temperature=0.7, top_k=3, top_p=0.8, min_p=0.1, seed=1),
        dict(repetition_penalty=0.7, presence_penalty=-0.5, frequency_penalty=1.0, seed=2),
        dict(temperature=1.0, seed=3),
    ],
)
def test_caller_logits_are_not_modified(params: dict[str, Any]) -> None:
    logits = torch.randn(64, generator=torch.Generator().manual_seed(5))
    before = logits.clone()
    s = sampler(prompt=(1, 2, 3), vocab=64, **params)
    for _ in range(5):
        s.sample(logits)
        s.probs(logits)
    assert torch.equal(logits, before)


def test_logits_longer_than_the_vocab() -> None:
    # Models often pad the vocabulary: the row may be longer than vocab_size.
    s = sampler(prompt=(1,), vocab=10, temperature=0.0, frequency_penalty=2.0)
    logits = torch.zeros(16)
    logits[12] = 1.0
    assert s.sample(logits) == 12
    assert s.penalize(logits)[12] == pytest.approx(1.0 - 2.0)
    assert s.sample(logits) == 0


def test_rejects_a_row_shorter_than_the_vocab() -> None:
    with pytest.raises(ValueError):
        sampler(vocab=10).sample(torch.zeros(8))


def test_tiny_temperature_is_greedy() -> None:
    logits = torch.tensor([1.0, 1.0 + 1e-3, -math.inf])
    assert all(sampler(vocab=3, temperature=1e-7, seed=s).sample(logits) == 1 for s in range(5))


def test_sample_rows_matches_row_by_row_and_skips_none() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, VOCAB)
    logits[3, 7] = logits[3, 9] = logits[3].max() + 1  # a tie: the first id wins either way
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.9, seed=5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0),
    ]
    batched = [Sampler(p, [1, 2], VOCAB) for p in params]
    alone = [Sampler(p, [1, 2], VOCAB) for p in params]
    rows: list[Sampler | None] = [*batched[:4], None]
    tokens = sample_rows(rows, logits)
    assert tokens[:4] == [alone[i].sample(logits[i]) for i in range(4)]
    assert tokens[3] == 7 and tokens[4] is None
    assert [s.output_ids for s in batched[:4]] == [s.output_ids for s in alone[:4]]
    assert batched[4].output_ids == []
    with pytest.raises(ValueError, match="samplers for logits"):
        sample_rows(rows[:3], logits)
    # given each row's argmax as the device worker answers it: the same tokens, and a greedy
    # row's token (even alone) comes from it
    given = [Sampler(p, [1, 2], VOCAB) for p in params]
    argmax = logits.argmax(dim=-1).tolist()
    assert sample_rows([*given[:4], None], logits, argmax=argmax) == tokens
    (lone,) = [Sampler(SamplingParams(temperature=0.0), [1, 2], VOCAB)]
    assert sample_rows([lone], logits[:1], argmax=[11]) == [11]


def test_the_engine_threads_sampling_runs_serial_and_leaves_other_threads_parallel() -> None:
    """The engine samples on its own thread while the device worker waits: that thread's
    tensor operations run on it alone (no OpenMP team of its own beside the worker's), and
    every other thread keeps its own thread count."""
    import threading

    from neuronpy.engine.sampling import _omp_set_num_threads, serial_ops_here

    if _omp_set_num_threads() is None:
        pytest.skip("torch runs without an OpenMP runtime here")
    capped = torch.get_num_threads()  # (the suite's workers run on a share of the cores)
    seen: list[int] = []

    def engine_thread() -> None:
        seen.append(torch.get_num_threads())  # (a new thread starts with the process's count)
        serial_ops_here()
        seen.append(torch.get_num_threads())
        seen.append(sample_rows([sampler(vocab=VOCAB, temperature=0.7)], torch.randn(1, VOCAB))[0])

    torch.set_num_threads(2)  # a worker's team of two, whatever this process was given
    try:
        thread = threading.Thread(target=engine_thread)
        thread.start()
        thread.join()
        assert seen[:2] == [2, 1] and 0 <= seen[2] < VOCAB
        assert torch.get_num_threads() == 2  # this thread's own count is untouched
    finally:
        torch.set_num_threads(capped)
