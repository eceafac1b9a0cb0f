"""Attention whose result for a query depends on that query's own keys and values alone: not on
the batch's other rows, a row's padding gap or padded length, nor on how many queries one call
holds. What the parity contract needs on the CPU in float32, from plain PyTorch products.

PyTorch's fused attention (SDPA) changes a row's output in its last bits with the padded key
length, the gap and the query count, and with the int4 kernels' bf16 inputs one such bit turns
into a different token now and then. Measured here (torch 2.13, MKL), the pieces below are
exact, and `tests/test_exact_attention.py` holds each one to it:
- scores with the keys as rows (MIN_KEYS or more) and a token's query heads as columns: each
  the same wherever its key lies and whatever else the batch holds;
- weights by values with at most NARROW query rows sum along the keys in order, one key after
  another, so masked keys (zero weights) anywhere add exact zeros, whatever the batch holds;
- a product with MIN_ROWS query rows or more gives each row what it gives that row among any
  others; one of fixed shape (KEY_BLOCK keys) is the same whatever else is computed beside it;
- `amax` is exact in any order; `exp` gives each element the same value wherever it lies;
- `cumsum` accumulates in order (in double on the CPU): a sum that zeros cannot change.

Attention sinks (gpt-oss): a learned logit per query head that joins every softmax's
denominator and nothing else (a column of scores whose value is dropped). The max a row's
weights are taken against includes it, and its exp(sink - max) is added to the row's sum after
the keys' in-order sum: both elementwise, so the properties above hold as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NARROW = 3  # query rows per weights-by-values product in step_attention (more: not exact)
MIN_ROWS = 4  # query rows a chunk_attention product needs for rows independent of their count
KEY_BLOCK = 64  # keys per product in chunk_attention: every product the same shape
MIN_KEYS = 8  # keys a step_attention product needs (2 to 6 keys take another kernel)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): Gemma 2's bound on attention scores and logits."""
    return torch.tanh(x / cap) * cap


def grouped_sinks(sinks: torch.Tensor, kv_heads: int, rows: int) -> torch.Tensor:
    """Per query head sinks [H] -> [KVH, rows], one per grouped query row: `rows` is G * T,
    each KV head's G query heads with their T tokens each, head-major (as
    LlamaModel.group_queries lays them), so row g * T + t holds head h * G + g's sink."""
    g = sinks.shape[0] // kv_heads
    per = sinks.reshape(kv_heads, g, 1)
    return per.expand(kv_heads, g, rows // g).reshape(kv_heads, rows)


@torch.profiler.record_function("exact_attention")
def step_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    cap: float | None = None,
    tokens: int = 1,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A decode or verify step's attention: q [B, KVH, G * T, D] (`tokens` T per row, each
    with its G query heads, head-major as LlamaModel.group_queries lays them), k and v
    [B, KVH, L, D] (views of the live batch's buffers, gap included), mask broadcasting to
    [B, KVH, G * T, L] (True = attend; None: every key), `sinks` [H] float32 (gpt-oss: each
    query head's sink logit; None: none) -> [B, KVH, G * T, D]. Each query's
    output is what it would be with its row alone in the batch and its token alone in the
    step, whatever the gap, the padded length or the other rows."""
    b, h, nq, d = q.shape
    if k.shape[2] < MIN_KEYS:  # a prompt of a few tokens: masked zero keys up to MIN_KEYS
        pad = MIN_KEYS - k.shape[2]
        if mask is None:
            mask = torch.ones(1, 1, 1, k.shape[2], dtype=torch.bool, device=k.device)
        mask = F.pad(mask, (0, pad), value=False)
        k, v = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
    n, length, g = b * h, k.shape[2], nq // tokens
    dv = v.shape[-1]  # the values' width (latent attention's differs from the keys')
    keys = k.reshape(n, length, d)  # [n, L, D]: views (B and KVH merge)
    values = v.reshape(n, length, dv)
    queries = (q * scale).reshape(n, g, tokens, d)
    blocked = None  # what each token's query heads may not see, broadcasting to [B, KVH, G, L]
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        mb, mh, mq, _ = mask.shape
        blocked = ~(mask if mq == 1 else mask.reshape(mb, mh, g, tokens, length))
    sink = None  # [n, G, 1]: each of a token's query heads' sink (the same for every token)
    if sinks is not None:
        sink = sinks.reshape(1, h, g).expand(b, h, g).reshape(n, g, 1)
    outs = []
    for t in range(tokens):
        # [n, L, G]: keys as rows, one token's query heads as the columns (a transposed view);
        # then laid out keys last, [B, KVH, G, L], for what follows to run along them
        scores = torch.bmm(keys, queries[:, :, t].transpose(1, 2))
        scores = scores.transpose(1, 2).reshape(b, h, g, length)
        if cap is not None:
            scores = soft_cap(scores, cap)
        if blocked is not None:
            scores = scores.masked_fill(blocked if mq == 1 else blocked[..., t, :], float("-inf"))
        scores = scores.reshape(n, g, length)
        top = scores.amax(-1, keepdim=True)
        if sink is not None:  # the sink joins the max, and the sum after the keys'
            top = torch.maximum(top, sink)
        weights = torch.exp(scores - top)  # [n, G, L]
        total = weights.cumsum(-1)[..., -1]  # [n, G]: in key order
        if sink is not None:
            total = total + torch.exp(sink - top)[..., 0]
        parts = [torch.bmm(weights[:, lo : lo + NARROW], values) for lo in range(0, g, NARROW)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [n, G, D]
        outs.append(out / total[..., None])
    out = outs[0] if tokens == 1 else torch.stack(outs, dim=2)  # [n, G, T, Dv]
    return out.reshape(b, h, nq, dv)


@torch.profiler.record_function("exact_attention")
def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A prompt chunk's attention over its own sequence (no gap): q [B, KVH, Q, D], k and v
    [B, KVH, L, D], mask broadcasting to [B, KVH, Q, L] (True = attend), `sinks` [H] float32
    (each query head's sink logit, Q being G * T grouped rows; None: none) -> [B, KVH, Q, D].
    Each query's output is the same however the prompt was cut into chunks (a prefix-cache
    restore, a chunk prefilled in a decode step's forward) and whatever keys past its own the
    call holds."""
    b, h, nq, d = q.shape
    length = k.shape[2]
    blocks = -(-length // KEY_BLOCK)
    rows = max(nq, MIN_ROWS)
    pad_keys, pad_rows = blocks * KEY_BLOCK - length, rows - nq
    queries = F.pad(q * scale, (0, 0, 0, pad_rows))  # [B, KVH, rows, D]
    keys = F.pad(k, (0, 0, 0, pad_keys)).reshape(b, h, blocks, KEY_BLOCK, d)
    values = F.pad(v, (0, 0, 0, pad_keys)).reshape(b, h, blocks, KEY_BLOCK, v.shape[-1])
    mask = mask.expand(b, h, nq, length)
    # padding rows see every key (a row that saw none would be NaN); padding keys none
    mask = F.pad(F.pad(mask, (0, 0, 0, pad_rows), value=True), (0, pad_keys), value=False)
    mask = mask.reshape(b, h, rows, blocks, KEY_BLOCK).transpose(2, 3)  # [B, KVH, nb, rows, KB]
    scores = torch.matmul(queries[:, :, None], keys.transpose(-1, -2))  # [B, KVH, nb, rows, KB]
    if cap is not None:
        scores = soft_cap(scores, cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    top = scores.amax(dim=(2, 4), keepdim=True)  # [B, KVH, 1, rows, 1]
    sink = None
    if sinks is not None:  # (padding rows get sink 0: their output is dropped)
        sink = F.pad(grouped_sinks(sinks, h, nq), (0, pad_rows))[None, :, None, :, None]
        top = torch.maximum(top, sink)
    weights = torch.exp(scores - top)
    partial = torch.matmul(weights, values)  # [B, KVH, nb, rows, D]: a block's share
    out = partial.cumsum(2)[:, :, -1]  # [B, KVH, rows, D]: the blocks in order
    total = weights.transpose(2, 3).reshape(b, h, rows, blocks * KEY_BLOCK).cumsum(-1)[..., -1:]
    if sink is not None:  # its share of the denominator, after the keys' sum
        total = total + torch.exp(sink - top)[:, :, 0]
    return (out / total)[:, :, :nq]
