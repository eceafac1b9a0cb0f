"""Drafting's contract with the device: a draft job carries each row's new tokens only, the
draft model's KV kept between jobs drafts what a fresh prefill of the whole context would,
and a row let go leaves nothing behind."""

from __future__ import annotations

from typing import Any

import pytest

from neuronpy.arch.llama import LlamaModel
from neuronpy.errors import WorkerError
from neuronpy.worker.drafting import DraftBatch
from neuronpy.worker.jobs import DraftTokens
from tests.factories import hf_model, make_engine, tokenizer

A = (5, 17, 42, 99, 3, 250, 71, 8)  # contexts: a prompt, then a first token
B = (12, 8, 300, 1, 44)


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel.from_hf(hf_model("tiny-llama"))


def job(rows: list[tuple[int, tuple[int, ...], int, bool, int]]) -> DraftTokens:
    """A greedy draft job: per row (key, tokens, rollback, fresh, length)."""
    keys, tokens, rollback, fresh, lengths = zip(*rows, strict=True)
    return DraftTokens(keys, tokens, rollback, fresh, lengths)


def test_the_draft_kv_kept_between_jobs_drafts_as_a_fresh_prefill_does(
    model: LlamaModel,
) -> None:
    drafts = DraftBatch(model, prefill_chunk=4)
    first = drafts.draft(job([(1, A, 0, False, 4), (2, B, 0, False, 2)]))
    # every row is fed the batch's drafts but its last: 3 each, whatever its own length
    assert [len(d) for d in first.drafts] == [4, 2]
    assert first.held == (len(A) + 3, len(B) + 3)
    a1, a2 = first.drafts[0][:2]
    # the target accepted a's first two drafts, then wrote 7; none of b's, then wrote 9: a
    # gives back its third draft, b all three; each is fed its new token alone
    again = drafts.draft(job([(1, (7,), 1, False, 3), (2, (9,), 3, False, 3)]))
    assert again.held == (len(A) + 3 + 2, len(B) + 1 + 2)
    fresh = DraftBatch(model, prefill_chunk=4).draft(
        job([(1, (*A, a1, a2, 7), 0, False, 3), (2, (*B, 9), 0, False, 3)])
    )
    assert again.drafts == fresh.drafts


def test_a_released_row_leaves_the_draft_batch_and_a_job_must_name_every_row_held(
    model: LlamaModel,
) -> None:
    drafts = DraftBatch(model, prefill_chunk=4)
    drafts.draft(job([(1, A, 0, False, 2), (2, B, 0, False, 2)]))
    with pytest.raises(WorkerError, match="leaves out"):
        drafts.draft(job([(1, (7,), 1, False, 2)]))  # (b is held: it must ride)
    drafts.release([1])
    assert drafts.rows == 1 and drafts.batch is not None
    # b alone now; a comes back new (its whole context, prefilled again)
    out = drafts.draft(job([(2, (9,), 1, False, 2), (1, (*A, 7), 0, False, 2)]))
    assert drafts.keys == [2, 1] and out.held == (len(B) + 2, len(A) + 2)
    drafts.release([1, 2])
    assert drafts.rows == 0 and drafts.batch is None


@pytest.mark.anyio
async def test_an_engines_draft_jobs_carry_only_the_new_tokens() -> None:
    """End to end, greedy, two requests together, the model drafting for itself (its drafts
    stand, so every step drafts): after its first job a row's draft job carries what it
    lacks (the target's token, and a last draft that stood but was never fed to the draft
    model: at most 1 + num_speculative_tokens), never its whole context."""
    jobs: list[DraftTokens] = []
    prompts = [tokenizer().encode("the cat sat on the mat and the cat sat on the mat")] * 2
    async with make_engine(draft="tiny-llama", speculative="draft") as engine:
        worker = engine._worker
        submit = worker.submit

        def record(job: Any) -> Any:
            if isinstance(job, DraftTokens):
                jobs.append(job)
            return submit(job)

        worker.submit = record  # type: ignore[method-assign]
        streams = [engine.submit(p, engine_params()) for p in prompts]
        for stream in streams:
            async with stream:
                async for _ in stream:
                    pass
        assert worker.drafts is not None and worker.drafts.rows == 0
    seen: set[int] = set()
    assert len(jobs) > 3
    for drafted in jobs:
        for key, tokens, fresh in zip(drafted.keys, drafted.tokens, drafted.fresh, strict=True):
            if key in seen and not fresh:
                assert 1 <= len(tokens) <= 1 + 4, (key, tokens)
            else:
                assert len(tokens) > len(prompts[0])  # the whole context, once
            seen.add(key)
    assert engine.stats().spec_draft_tokens > 0


def engine_params() -> Any:
    from neuronpy.engine.types import SamplingParams

    return SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
