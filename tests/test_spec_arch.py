"""Arch parity of speculative verification: a step that feeds each row its next token and
drafts, at its own positions, then gives back the rejected drafts' columns (KvBatch.trim),
decodes every sequence exactly as one-token lockstep steps do."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neuronpy.arch.kv import KvBatch, assemble_batch
from neuronpy.arch.llama import LlamaModel, PrefillChunk
from tests.factories import hf_model

PROMPTS = ([5, 17, 42, 99, 3, 250, 71], [12, 8], [300, 1, 44, 44, 19, 7, 65, 80, 91, 2, 33], [60])
STEPS = 8


def native(name: str) -> LlamaModel:
    return LlamaModel.from_hf(hf_model(name))


def reference(model: LlamaModel, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens o_0..o_steps of the prompt decoded alone, one token a step, and the hidden
    state h_i after feeding o_i (which predicts o_(i+1))."""
    snapshot, hidden = model.prefill(prompt)
    batch = assemble_batch([snapshot])
    tokens = [int(model.logits(hidden[-1]).argmax())]
    states = []
    for _ in range(steps):
        h = model.forward_batch_decode(batch, torch.tensor([[tokens[-1]]]))[0]
        states.append(h)
        tokens.append(int(model.logits(h).argmax()))
    return tokens, torch.stack(states)


def verify(
    model: LlamaModel,
    batch: KvBatch,
    fed: list[list[int]],
    refs: list[tuple[list[int], torch.Tensor]],
    done: list[int],
) -> list[int]:
    """One verify step of row r's tokens fed[r] (its next token and drafts), checked against
    the one-token reference: the tokens it emits (the drafts that stand, then one more) and
    the hidden states of those positions. Advances `done`; answers each row's rejected
    drafts (the columns to give back)."""
    counts = [len(f) for f in fed]
    flat = torch.tensor([t for f in fed for t in f])
    hidden = model.forward_step(batch, flat, counts=counts).hidden
    assert hidden.shape[0] == sum(counts)
    argmax = model.logits(hidden).argmax(-1).tolist()
    drops, at = [], 0
    for r, (truth, states) in enumerate(refs):
        n, accepted, first = counts[r], 0, done[r]
        while accepted < n - 1 and argmax[at + accepted] == fed[r][accepted + 1]:
            accepted += 1
        emitted = [*fed[r][1 : accepted + 1], argmax[at + accepted]]
        assert emitted == truth[first + 1 : first + 2 + accepted], r
        torch.testing.assert_close(
            hidden[at : at + accepted + 1],
            states[first : first + accepted + 1],
            atol=1e-4,
            rtol=1e-4,
        )
        drops.append(n - 1 - accepted)
        done[r] += accepted + 1
        at += n
    return drops


def drafts_for(row: int, step: int, truth: list[int], at: int, left: int) -> list[int]:
    """Row by row a different mix: all right, none, the second wrong, all wrong, varying k."""
    k = min((3, 0, 4, 2)[row] + step % 2, left)
    guess = list(truth[at + 1 : at + 1 + k])
    if row == 2 and len(guess) > 1:
        guess[1] = (guess[1] + 1) % 256
    if row == 3:
        guess = [(t + 7) % 256 for t in guess]
    return guess


@pytest.mark.parametrize(
    # (and the hybrids, whose fixed-size states a verify step advances token by token and
    # `trim` returns to the last accepted token's)
    "name",
    [
        "tiny-llama",
        "tiny-qwen3",
        "tiny-mistral",
        "tiny-qwen3-moe",
        "tiny-qwen3-next",
        "tiny-granite-hybrid",
        "tiny-lfm2",
        "tiny-gpt-oss",  # (attention sinks and a sliding window over several tokens a step)
    ],
)
def test_parity_verify_steps_equal_one_token_steps(name: str) -> None:
    model = native(name)
    refs = [reference(model, list(p), STEPS * 5 + 2) for p in PROMPTS]
    # two KV groups: rows 0 and 1 from a batch that has decoded a step, rows 2 and 3 new
    first = assemble_batch([model.prefill(list(p))[0] for p in PROMPTS[:2]])
    model.forward_batch_decode(first, torch.tensor([[refs[0][0][0]], [refs[1][0][0]]]))
    batch = assemble_batch(
        [first.row(0), first.row(1), *(model.prefill(list(p))[0] for p in PROMPTS[2:])]
    )
    assert len(batch.groups) == 2
    done = [1, 1, 0, 0]  # o_done is each row's next token to feed
    step = 0
    while min(done) < STEPS:
        fed = []
        for row, (truth, _) in enumerate(refs):
            guess = drafts_for(row, step, truth, done[row], len(truth) - 2 - done[row])
            fed.append([truth[done[row]], *guess])
        drops = verify(model, batch, fed, refs, done)
        batch.trim(drops)
        assert batch.row_lengths == [len(p) + d for p, d in zip(PROMPTS, done, strict=True)]
        step += 1
    assert done[0] >= 4 * step and done[3] == step  # all accepted, all rejected
    assert len(batch.groups) == 2
    # a row extracted after ragged steps is its tokens' KV, contiguous, gaps dropped
    for row, prompt in enumerate(PROMPTS):
        snap = batch.row(row).materialize()
        assert snap.token_ids == list(prompt) + refs[row][0][: done[row]]
        fresh, _ = model.prefill(snap.token_ids)
        for a, b in zip(snap.keys + snap.values, fresh.keys + fresh.values, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_rows_that_lag_decode_one_token_steps_and_rebatch() -> None:
    """After a verify step leaves rows at different lengths in one group, plain one-token
    steps, a chunk riding along, and a rebatch (narrowing the group) all keep parity."""
    model = native("tiny-llama")
    refs = [reference(model, list(p), 10) for p in PROMPTS[:3]]
    batch = assemble_batch([model.prefill(list(p))[0] for p in PROMPTS[:3]])
    # row 0 feeds 3 right drafts, row 1 none, row 2 two wrong ones
    fed = [refs[0][0][:4], refs[1][0][:1], [refs[2][0][0], 1, 2]]
    hidden = model.forward_step(
        batch, torch.tensor([t for f in fed for t in f]), counts=[4, 1, 3]
    ).hidden
    assert model.logits(hidden).argmax(-1).tolist()[:4] == refs[0][0][1:5]
    batch.trim([0, 0, 2])
    done = [4, 1, 1]
    assert not batch.groups[0].uniform
    joiner = PROMPTS[3] * 5
    riding = None
    for i in range(3):
        tokens = torch.tensor([[refs[r][0][done[r]]] for r in range(3)])
        out = model.forward_step(batch, tokens, [PrefillChunk(joiner)] if i == 0 else [])
        riding = riding if i else out.chunk_hidden[0]
        for r in range(3):
            torch.testing.assert_close(out.hidden[r], refs[r][1][done[r]], atol=1e-4, rtol=1e-4)
            done[r] += 1
    _, alone = model.prefill(joiner)
    torch.testing.assert_close(riding, alone[-1], atol=1e-4, rtol=1e-4)
    narrowed = assemble_batch([batch.row(0), batch.row(2)])
    tokens = torch.tensor([[refs[0][0][done[0]]], [refs[2][0][done[2]]]])
    h = model.forward_batch_decode(narrowed, tokens)
    torch.testing.assert_close(h[0], refs[0][1][done[0]], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(h[1], refs[2][1][done[2]], atol=1e-4, rtol=1e-4)


def test_trim_refuses_more_than_a_row_holds() -> None:
    model = native("tiny-llama")
    batch = assemble_batch([model.prefill(list(PROMPTS[1]))[0]])
    model.forward_step(batch, torch.tensor([1, 2, 3]), counts=[3])
    with pytest.raises(ValueError):
        batch.trim([4])
    with pytest.raises(ValueError):
        model.forward_step(batch, torch.tensor([1, 2]), counts=[3])


def test_rows_feeding_as_many_tokens_each_keep_parity() -> None:
    """Every row of a group with the same number of tokens (no gather: the tokens lie in
    order), before and after the rows lag one another."""
    model = native("tiny-qwen3")
    refs = [reference(model, list(p), 12) for p in PROMPTS[:3]]
    batch = assemble_batch([model.prefill(list(p))[0] for p in PROMPTS[:3]])
    done = [0, 0, 0]
    for drops in ([0, 1, 2], [2, 0, 1], [0, 0, 0]):
        fed = [refs[r][0][done[r] : done[r] + 3] for r in range(3)]
        hidden = model.forward_step(
            batch, torch.tensor([t for f in fed for t in f]), counts=[3, 3, 3]
        ).hidden
        for r in range(3):
            keep = 3 - drops[r]
            torch.testing.assert_close(
                hidden[3 * r : 3 * r + keep],
                refs[r][1][done[r] : done[r] + keep],
                atol=1e-4,
                rtol=1e-4,
            )
            done[r] += keep
        batch.trim(drops)


@settings(max_examples=12, deadline=None)
@given(st.data())
def test_parity_any_pattern_of_drafts_and_rejections(data: st.DataObject) -> None:
    """Hypothesis picks, step by step, each row's draft count, which drafts are right, and a
    rebatch now and then (a row extracted and assembled again beside the others): the tokens
    and hidden states are always those of one-token steps."""
    model = native("tiny-llama")
    refs = [reference(model, list(p), 40) for p in PROMPTS[:3]]
    batch = assemble_batch([model.prefill(list(p))[0] for p in PROMPTS[:3]])
    done = [0, 0, 0]
    for _ in range(data.draw(st.integers(2, 5), label="steps")):
        fed = []
        for r in range(3):
            truth = refs[r][0]
            k = data.draw(st.integers(0, min(4, len(truth) - 2 - done[r])), label="k")
            wrong = data.draw(st.integers(0, k), label="first wrong draft (k: none)")
            guess = list(truth[done[r] + 1 : done[r] + 1 + k])
            if wrong < k:
                guess[wrong] = (guess[wrong] + 1) % 300
            fed.append([truth[done[r]], *guess])
        drops = verify(model, batch, fed, refs, done)
        batch.trim(drops)
        if data.draw(st.booleans(), label="rebatch"):
            order = data.draw(st.permutations([0, 1, 2]), label="order")
            rows = [batch.row(r) for r in order]
            moved = data.draw(st.sampled_from(order), label="extracted")
            sources = [
                row.materialize() if o == moved else row for o, row in zip(order, rows, strict=True)
            ]
            batch = assemble_batch(sources)
            refs = [refs[o] for o in order]
            done = [done[o] for o in order]
