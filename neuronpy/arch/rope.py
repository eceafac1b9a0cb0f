"""Rotary position embeddings at arbitrary per-row positions."""

from __future__ import annotations

import torch


def rope_cos_sin(
    inv_freq: torch.Tensor, scale: float, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for the given positions.

    inv_freq: [D/2] float32; positions: [B, T] integer -> cos, sin: [B, T, D] in `dtype`.
    Computed in float32 as transformers does, so positions far into the context stay exact.
    """
    freqs = positions[..., None].float() * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos, sin: [B, T, D] -> [B, H, T, D] (rotate-half convention)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
