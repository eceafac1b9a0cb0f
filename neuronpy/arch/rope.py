"""Rotary position embeddings at arbitrary per-token positions."""

from __future__ import annotations

import torch


def rope_cos_sin(
    inv_freq: torch.Tensor, scale: float, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for the given positions.

    inv_freq: [R/2] float32; positions: [N] integer -> cos, sin: [N, R] in `dtype`.
    Computed in float32 as transformers does, so positions far into the context stay exact.
    """
    freqs = positions[:, None].float() * inv_freq  # [N, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D]; cos, sin: [N, R] -> [N, heads, D] (rotate-half convention). With
    R < D (partial rotary embeddings) the first R dims of each head rotate, the rest pass."""
    if cos.shape[-1] < x.shape[-1]:
        rot, rest = x.split([cos.shape[-1], x.shape[-1] - cos.shape[-1]], dim=-1)
        return torch.cat((apply_rope(rot, cos, sin), rest), dim=-1)
    cos, sin = cos[:, None], sin[:, None]  # [N, 1, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
