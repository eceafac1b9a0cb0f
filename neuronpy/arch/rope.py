"""Rotary position embeddings at arbitrary per-token positions."""

from __future__ import annotations

import torch


def rope_cos_sin(
    inv_freq: torch.Tensor, scale: float, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for the given positions.

    inv_freq: [D/2] float32; positions: [N] integer -> cos, sin: [N, D] in `dtype`.
    Computed in float32 as transformers does, so positions far into the context stay exact.
    """
    freqs = positions[:, None].float() * inv_freq  # [N, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D]; cos, sin: [N, D] -> [N, heads, D] (rotate-half convention)."""
    cos, sin = cos[:, None], sin[:, None]  # [N, 1, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
