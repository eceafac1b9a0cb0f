"""Arch parity: our forward == transformers' forward, and ragged lockstep decode == one by one."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from neuronpy.arch.config import ArchConfig
from neuronpy.arch.kv import BatchRow, assemble_batch, batch_decode_mask, extract_row
from neuronpy.arch.llama import LlamaModel
from neuronpy.arch.rope import apply_rope, rope_cos_sin
from neuronpy.errors import UnsupportedArchitectureError
from tests.factories import FAMILIES, hf_model

PROMPTS = ([5, 17, 42, 99, 3, 250, 71], [12, 8], [300, 1, 44, 44, 19, 7, 65, 80, 91, 2, 33], [60])


def native(name: str) -> LlamaModel:
    return LlamaModel.from_hf(hf_model(name))


def reference_logits(name: str, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(name)(torch.tensor([ids])).logits[0]  # [T, vocab]


@pytest.mark.parametrize("name", FAMILIES)
def test_parity_prefill_matches_transformers(name: str) -> None:
    model = native(name)
    ids = PROMPTS[2] + PROMPTS[0]
    snapshot, hidden = model.prefill(ids, chunk_size=5)  # chunked on purpose
    assert snapshot.length == len(ids) and snapshot.token_ids == ids
    torch.testing.assert_close(
        model.logits(hidden), reference_logits(name, ids), atol=2e-4, rtol=1e-4
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_parity_decode_matches_transformers(name: str) -> None:
    """Greedy decode through the live batch gives transformers' logits for the whole sequence."""
    model = native(name)
    ids = list(PROMPTS[0])
    snapshot, hidden = model.prefill(ids)
    batch = assemble_batch([snapshot], headroom=2)  # small headroom: the buffer must grow
    token = int(model.logits(hidden[-1]).argmax())
    for _ in range(6):
        ids.append(token)
        logits = model.logits(model.forward_batch_decode(batch, torch.tensor([[token]])))[0]
        torch.testing.assert_close(logits, reference_logits(name, ids)[-1], atol=2e-4, rtol=1e-4)
        token = int(logits.argmax())


@pytest.mark.parametrize("name", FAMILIES)
def test_parity_ragged_lockstep_equals_sequential(name: str) -> None:
    """Four prompts of different lengths decoded in one batch == each decoded alone,
    hidden state for hidden state, at every step; greedy tokens exactly."""
    model = native(name)
    batch = assemble_batch([model.prefill(p)[0] for p in PROMPTS])
    solo = [model.prefill(p)[0] for p in PROMPTS]
    tokens = [int(model.logits(model.prefill(p)[1][-1]).argmax()) for p in PROMPTS]
    solo_tokens = list(tokens)
    for _ in range(10):
        hidden = model.forward_batch_decode(batch, torch.tensor(tokens)[:, None])
        for row in range(len(PROMPTS)):
            alone = assemble_batch([solo[row]])
            h = model.forward_batch_decode(alone, torch.tensor([[solo_tokens[row]]]))
            solo[row] = extract_row(alone, 0)
            torch.testing.assert_close(hidden[row], h[0], atol=1e-4, rtol=1e-4)
            solo_tokens[row] = int(model.logits(h[0]).argmax())
        tokens = model.logits(hidden).argmax(-1).tolist()
        assert tokens == solo_tokens


def test_parity_extract_then_continue_alone() -> None:
    """A row extracted from a batch continues alone exactly as if it had never been batched."""
    model = native("tiny-qwen3")
    batch = assemble_batch([model.prefill(p)[0] for p in PROMPTS[:3]])
    tokens = [7, 8, 9]
    for _ in range(4):
        tokens = (
            model.logits(model.forward_batch_decode(batch, torch.tensor(tokens)[:, None]))
            .argmax(-1)
            .tolist()
        )
    snap = extract_row(batch, 1)
    assert snap.length == len(PROMPTS[1]) + 4
    assert snap.keys[0].is_contiguous() and snap.keys[0].shape[2] == snap.length
    # the extracted KV equals a fresh prefill of the same tokens
    fresh, _ = model.prefill(snap.token_ids)
    for a, b in zip(snap.keys + snap.values, fresh.keys + fresh.values, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_rebatch_from_batch_rows_equals_extract_then_assemble() -> None:
    """Survivors taken straight from the old batch (one copy) give the very batch that
    extracting them first and assembling again gives, padding gaps zeroed."""
    model = native("tiny-llama")
    batch = assemble_batch([model.prefill(p)[0] for p in PROMPTS[:3]])
    for _ in range(3):
        model.forward_batch_decode(batch, torch.tensor([[4], [5], [6]]))
    joiner = model.prefill(PROMPTS[3] * 20)[0]  # longer than every row: the padding grows
    direct = assemble_batch([BatchRow(batch, 2), BatchRow(batch, 0), joiner])
    copied = assemble_batch([extract_row(batch, 2), extract_row(batch, 0), joiner])
    assert direct.prefix_lens == copied.prefix_lens and direct.padded_len == joiner.length
    assert direct.token_ids == copied.token_ids
    used = direct.used
    for a, b in zip(direct.keys + direct.values, copied.keys + copied.values, strict=True):
        assert torch.equal(a[:, :, :used], b[:, :, :used])
    for row, length in enumerate(direct.prefix_lens):
        assert not direct.keys[0][row, :, length:used].any()  # the gap holds zeros
    assert BatchRow(batch, 0).length == len(PROMPTS[0]) + 3
    assert torch.equal(BatchRow(batch, 1).materialize().keys[-1], extract_row(batch, 1).keys[-1])


def test_chunked_prefill_grows_its_reserved_snapshot_in_place() -> None:
    model = native("tiny-llama")
    ids = PROMPTS[2] * 3
    whole, _ = model.prefill(ids[:10], chunk_size=4)
    whole, _ = model.prefill(ids[10:], whole, chunk_size=4)
    grown, _ = model.prefill(ids[:10], chunk_size=4, reserve=len(ids))
    assert grown.capacity == len(ids) and grown.length == 10
    storage = grown.keys[0].data_ptr()
    grown, _ = model.prefill(ids[10:], grown, chunk_size=4, extend=True)
    assert grown.keys[0].data_ptr() == storage  # no copy of the first chunk
    assert grown.length == grown.capacity == len(ids) and grown.token_ids == ids
    for a, b in zip(grown.keys + grown.values, whole.keys + whole.values, strict=True):
        assert torch.equal(a, b)


def test_mask_has_exactly_one_gap_per_row() -> None:
    prefix = torch.tensor([3, 5, 1])
    mask = batch_decode_mask(prefix, padded_len=5, kv_len=8)
    assert mask is not None and mask.shape == (3, 1, 1, 8)
    rows = mask[:, 0, 0].int().tolist()
    assert rows == [[1, 1, 1, 0, 0, 1, 1, 1], [1] * 8, [1, 0, 0, 0, 0, 1, 1, 1]]
    assert batch_decode_mask(torch.tensor([4, 4]), padded_len=4, kv_len=6) is None


def test_rope_per_row_positions_match_uniform_tables() -> None:
    model = native("tiny-llama3")
    positions = torch.tensor([[0], [7], [200]])
    cos, sin = rope_cos_sin(model.inv_freq, model.rope_scale, positions, torch.float32)
    full_cos, _ = rope_cos_sin(
        model.inv_freq, model.rope_scale, torch.arange(256)[None], torch.float32
    )
    torch.testing.assert_close(cos[:, 0], full_cos[0, positions[:, 0]])
    x = torch.randn(3, 2, 1, 16)
    rotated = apply_rope(x, cos, sin)
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5)  # a rotation


def test_unsupported_architecture_is_refused_by_name() -> None:
    gpt2 = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, bos_token_id=0, eos_token_id=0)
    )
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        LlamaModel.from_hf(gpt2)
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        ArchConfig.from_hf(gpt2.config)
