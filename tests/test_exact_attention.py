"""arch/exact.py: attention whose result for a query depends on that query's own keys alone,
whatever the batch, the padding gap, the padded length or the chunking; and the same attention
as PyTorch's fused kernel computes, within float32's rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from neuronpy.arch.exact import chunk_attention, step_attention

D = 64
SCALE = D**-0.5


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE)


@pytest.mark.parametrize("queries", [1, 3, 4, 7, 12])
@pytest.mark.parametrize("length", [2, 5, 37, 300, 1100])
def test_step_attention_is_the_attention_and_ignores_gap_padding_and_other_rows(
    queries: int, length: int
) -> None:
    """A row alone (its keys contiguous) against the same row in a batch of 5, its keys split
    by a gap of masked columns and followed by masked padding: bitwise equal; and within
    float32's rounding of PyTorch's kernel."""
    torch.manual_seed(length * 31 + queries)
    heads = 3
    q = torch.randn(1, heads, queries, D)
    k, v = torch.randn(1, heads, length, D), torch.randn(1, heads, length, D)
    alone = step_attention(q, k, v, None, SCALE)
    torch.testing.assert_close(alone, reference(q, k, v, None), rtol=1e-5, atol=1e-5)
    for gap, trail in [(0, 9), (1, 0), (130, 64), (700, 3)]:
        at = max(1, length // 2)
        total = length + gap + trail
        keys = torch.randn(5, heads, total + 20, D)  # buffers with room to spare
        values = torch.randn(5, heads, total + 20, D)
        keys[2, :, :at], keys[2, :, at + gap : length + gap] = k[0, :, :at], k[0, :, at:]
        values[2, :, :at], values[2, :, at + gap : length + gap] = v[0, :, :at], v[0, :, at:]
        values[2, :, at : at + gap] = 0  # what assembly writes into a gap
        mask = torch.ones(5, 1, 1, total, dtype=torch.bool)
        mask[2, ..., at : at + gap] = False
        mask[2, ..., length + gap :] = False
        rows = torch.randn(5, heads, queries, D)
        rows[2] = q[0]
        batched = step_attention(rows, keys[:, :, :total], values[:, :, :total], mask, SCALE)
        assert torch.equal(batched[2:3], alone), (gap, trail)


@pytest.mark.parametrize("heads_per_kv", [1, 3, 4, 8])
def test_a_verify_steps_tokens_each_get_what_a_decode_step_gives_them(heads_per_kv: int) -> None:
    """Four tokens of a row in one step (its next token and three drafts, each seeing the
    columns up to its own) == each token alone in a step of its own, bitwise."""
    torch.manual_seed(heads_per_kv)
    kv_heads, length, t = 2, 90, 4
    k, v = torch.randn(3, kv_heads, length, D), torch.randn(3, kv_heads, length, D)
    q = torch.randn(3, kv_heads, heads_per_kv, t, D)  # head-major, as group_queries lays out
    sees = torch.arange(length)[None, :] <= torch.arange(length - t, length)[:, None]  # [T, L]
    mask = sees.repeat(heads_per_kv, 1)[None, None]  # [1, 1, G * T, L]
    flat = q.reshape(3, kv_heads, heads_per_kv * t, D)
    verify = step_attention(flat, k, v, mask, SCALE, tokens=t).reshape(q.shape)
    for i in range(t):
        alone = step_attention(q[:, :, :, i], k, v, sees[i][None, None, None], SCALE)
        assert torch.equal(verify[:, :, :, i], alone), i


@pytest.mark.parametrize("heads_per_kv", [1, 3, 4, 7])
@pytest.mark.parametrize("length", [9, 70, 300])
def test_chunk_attention_gives_a_query_the_same_output_however_the_prompt_is_cut(
    heads_per_kv: int, length: int
) -> None:
    """Each position's output in one chunk of the whole prompt == in any later chunk (a
    prefix-cache restore, a riding chunk of another size), bitwise; == PyTorch's kernel within
    float32's rounding."""
    torch.manual_seed(length * 7 + heads_per_kv)
    kv_heads = 2
    qs = torch.randn(1, kv_heads, heads_per_kv, length, D)  # a query per head and position
    k, v = torch.randn(1, kv_heads, length, D), torch.randn(1, kv_heads, length, D)

    def run(lo: int, hi: int) -> torch.Tensor:  # positions [lo, hi), grouped as the model does
        q = qs[..., lo:hi, :].reshape(1, kv_heads, heads_per_kv * (hi - lo), D)
        pos = torch.arange(lo, hi).repeat(heads_per_kv)
        mask = torch.arange(hi)[None, :] <= pos[:, None]
        out = chunk_attention(q, k[:, :, :hi], v[:, :, :hi], mask, SCALE)
        return out.reshape(1, kv_heads, heads_per_kv, hi - lo, D)

    whole = run(0, length)
    q = qs.reshape(1, kv_heads, heads_per_kv * length, D)
    causal = torch.arange(length)[None, :] <= torch.arange(length).repeat(heads_per_kv)[:, None]
    expected = reference(q, k, v, causal).reshape(whole.shape)
    torch.testing.assert_close(whole, expected, rtol=1e-5, atol=1e-5)
    for lo, hi in [(length - 1, length), (length // 2, length), (length // 3, length // 2 + 1)]:
        if lo < hi:
            assert torch.equal(run(lo, hi), whole[..., lo:hi, :]), (lo, hi)


def test_soft_capped_scores_match_the_capped_reference() -> None:
    """Gemma 2's cap on the scores, applied in both forms."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 6, D), torch.randn(1, 2, 40, D), torch.randn(1, 2, 40, D)
    cap = 5.0
    scores = torch.tanh(q @ k.transpose(-1, -2) * SCALE / cap) * cap
    expected = torch.softmax(scores, dim=-1) @ v
    got = step_attention(q, k, v, None, SCALE, cap)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    mask = torch.ones(6, 40, dtype=torch.bool)
    torch.testing.assert_close(chunk_attention(q, k, v, mask, SCALE, cap), expected)


def sink_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, sinks, g: int):
    """transformers' gpt-oss attention (eager_attention_forward): each query head's sink one
    more column of scores, the max taken over all, softmaxed, the column dropped. q is
    grouped [B, KVH, G * T, D]; sinks [KVH * G]."""
    b, h, rows, _ = q.shape
    scores = q @ k.transpose(-1, -2) * SCALE
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    column = sinks.reshape(h, g, 1).expand(h, g, rows // g).reshape(1, h, rows, 1)
    combined = torch.cat((scores, column.expand(b, h, rows, 1)), dim=-1)
    combined = combined - combined.amax(-1, keepdim=True)
    return torch.softmax(combined, dim=-1)[..., :-1] @ v


@pytest.mark.parametrize("heads_per_kv", [1, 3, 4])
def test_attention_sinks_join_the_denominator_and_keep_exactness(heads_per_kv: int) -> None:
    """gpt-oss's sinks: a step's and a chunk's attention equal the reference's within float32's
    rounding; a verify step's tokens each get their decode step's bits, a padded batch row its
    own row's alone, a chunk's positions theirs however the prompt is cut."""
    torch.manual_seed(heads_per_kv)
    kv_heads, length, t = 2, 90, 4
    sinks = torch.randn(kv_heads * heads_per_kv) * 2 + 3  # as large as the top scores
    k, v = torch.randn(3, kv_heads, length, D), torch.randn(3, kv_heads, length, D)
    q = torch.randn(3, kv_heads, heads_per_kv, t, D)
    sees = torch.arange(length)[None, :] <= torch.arange(length - t, length)[:, None]  # [T, L]
    mask = sees.repeat(heads_per_kv, 1)[None, None]
    flat = q.reshape(3, kv_heads, heads_per_kv * t, D)
    verify = step_attention(flat, k, v, mask, SCALE, tokens=t, sinks=sinks)
    expected = sink_reference(flat, k, v, mask, sinks, heads_per_kv)
    torch.testing.assert_close(verify, expected, rtol=1e-5, atol=1e-5)
    without = step_attention(flat, k, v, mask, SCALE, tokens=t)
    assert (verify - without).abs().max() > 1e-2  # the sinks take their share
    verify = verify.reshape(q.shape)
    for i in range(t):
        alone = step_attention(q[:, :, :, i], k, v, sees[i][None, None, None], SCALE, sinks=sinks)
        assert torch.equal(verify[:, :, :, i], alone), i
        # row 1 alone in its batch, its keys followed by masked padding
        padded_k = torch.cat((k[1:2], torch.randn(1, kv_heads, 30, D)), dim=2)
        padded_v = torch.cat((v[1:2], torch.randn(1, kv_heads, 30, D)), dim=2)
        padded = torch.nn.functional.pad(sees[i], (0, 30))[None, None, None]
        row = step_attention(q[1:2, :, :, i], padded_k, padded_v, padded, SCALE, sinks=sinks)
        assert torch.equal(row, alone[1:2]), i

    qs = torch.randn(1, kv_heads, heads_per_kv, length, D)

    def run(lo: int, hi: int) -> torch.Tensor:
        q = qs[..., lo:hi, :].reshape(1, kv_heads, heads_per_kv * (hi - lo), D)
        pos = torch.arange(lo, hi).repeat(heads_per_kv)
        mask = torch.arange(hi)[None, :] <= pos[:, None]
        out = chunk_attention(q, k[:1, :, :hi], v[:1, :, :hi], mask, SCALE, sinks=sinks)
        return out.reshape(1, kv_heads, heads_per_kv, hi - lo, D)

    whole = run(0, length)
    q_all = qs.reshape(1, kv_heads, heads_per_kv * length, D)
    causal = torch.arange(length)[None, :] <= torch.arange(length).repeat(heads_per_kv)[:, None]
    want = sink_reference(q_all, k[:1], v[:1], causal, sinks, heads_per_kv)
    torch.testing.assert_close(whole, want.reshape(whole.shape), rtol=1e-5, atol=1e-5)
    for lo, hi in [(length - 1, length), (length // 2, length), (length // 3, length // 2 + 1)]:
        assert torch.equal(run(lo, hi), whole[..., lo:hi, :]), (lo, hi)
