"""MXFP4 weights as gpt-oss checkpoints ship their experts, read back to floats at load.

A tensor `W` [..., rows, cols] is stored as two uint8 tensors (OCP microscaling, the layout of
transformers.integrations.mxfp4):
- `*_blocks` [..., rows, cols / 32, 16]: each byte two FP4 (E2M1) values along a row, the low
  nibble first (column 2j), the high nibble second (column 2j + 1);
- `*_scales` [..., rows, cols / 32]: one E8M0 scale per 32 values of a row, the power of two
  2 ** (byte - 127).
The last dimension (`cols`) is the blocked one. For gpt-oss's experts that is the input: the
stored rows of `gate_up_proj` are its 2 * I outputs and of `down_proj` its hidden outputs, so
the dequantized tensor is already in a linear layer's [out, in] layout (transformers transposes
it to its own [in, out] one after dequantizing).

They are dequantized once, at load, and never computed with as MXFP4: plain PyTorch has no
MXFP4 matmul on the CPU, and every FP4 value times its power of two is exact in bfloat16 and
float32, so the float weights are the checkpoint's values exactly; `--quantize` then applies to
them as to any float weight.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per scale
# the 16 E2M1 codes: sign bit 3, then two exponent bits and one mantissa bit
FP4_VALUES = (
    *(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0),
    *(-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0),
)
SCALE_BIAS = 127


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`*_blocks` [..., rows, G, 16] and `*_scales` [..., rows, G] (uint8) -> [..., rows, G * 32]
    in `dtype`, vectorized over the whole tensor (a table lookup and an ldexp)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype}, {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)} "
            f"({BLOCK // 2} bytes per block of {BLOCK})"
        )
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    # [..., G, 16, 2]: each byte's low nibble, then its high one
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()
    values = lut[codes].flatten(-2)  # [..., rows, G, 32]
    exponent = scales.to(torch.int32)[..., None] - SCALE_BIAS
    return torch.ldexp(values, exponent).to(dtype).flatten(-2)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float tensor [..., rows, cols] (cols a multiple of 32) packed as MXFP4: (blocks,
    scales) as dequantize_mxfp4 reads them. Each block's scale is the smallest power of two
    that brings its largest magnitude within 6 (FP4's largest), each value rounded to the
    nearest FP4 one. Values already FP4 times a power of two shared by their block come back
    exactly (what the tests pack)."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 packs rows of a multiple of {BLOCK} values, got {w.shape[-1]}")
    x = w.float().reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    top = x.abs().amax(-1)
    # 2 ** e with top / 2 ** e <= 6: e = ceil(log2(top / 6)) (0 for an all-zero block)
    e = torch.where(top > 0, torch.ceil(torch.log2(top / 6.0)), torch.zeros_like(top))
    e = e.clamp(-SCALE_BIAS, 255 - SCALE_BIAS)
    scaled = torch.ldexp(x, -e[..., None].to(torch.int32))
    lut = torch.tensor(FP4_VALUES[:8])
    nearest = (scaled.abs()[..., None] - lut).abs().argmin(-1)  # magnitude code 0..7
    codes = (nearest + 8 * (scaled < 0)).to(torch.uint8)
    pairs = codes.reshape(*codes.shape[:-1], BLOCK // 2, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks, (e.to(torch.int32) + SCALE_BIAS).to(torch.uint8)
