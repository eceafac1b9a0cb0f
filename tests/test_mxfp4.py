"""arch/mxfp4.py: gpt-oss's MXFP4 expert weights read back exactly, and a checkpoint holding
its experts packed so loaded end to end."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from neuronpy.arch.llama import LlamaModel
from neuronpy.arch.mxfp4 import FP4_VALUES, dequantize_mxfp4, quantize_mxfp4
from tests.factories import hf_model


def test_known_codes_and_scales_read_back_exactly() -> None:
    """Each byte's low nibble is the even column, its high nibble the odd one; a block's scale
    byte s multiplies its 32 values by 2 ** (s - 127)."""
    codes = torch.arange(32) % 16  # every E2M1 code, twice
    byte_row = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8)  # [16]
    blocks = byte_row.repeat(2, 2, 1)  # [rows 2, G 2, 16]
    scales = torch.tensor([[127, 130], [120, 127]], dtype=torch.uint8)  # 1, 8, 2**-7, 1
    got = dequantize_mxfp4(blocks, scales)
    values = torch.tensor(FP4_VALUES)[codes]
    want = torch.cat(
        [torch.cat([values * 2.0**e for e in pair]) for pair in ((0, 3), (-7, 0))]
    ).reshape(2, 64)
    assert torch.equal(got, want)
    assert torch.equal(got.signbit(), want.signbit())  # -0.0 is code 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_as_transformers_reads_the_packed_experts(dtype: torch.dtype) -> None:
    """transformers' own reader (its [E, in, out] result transposed back) gives the same
    values; packing them again gives them back."""
    w = torch.randn(3, 10, 96) * 4
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 10, 3, 16) and scales.shape == (3, 10, 3)
    got = dequantize_mxfp4(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
    assert torch.equal(got, theirs)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(got)), got.float())
    assert (got.float() - w).abs().max() <= w.abs().max() / 4  # a coarse copy of w


class DictCheckpoint:
    """A checkpoint's tensors as a file holds them (arch/weights.py's Checkpoint)."""

    def __init__(self, tensors: dict[str, torch.Tensor], config: Any) -> None:
        self.tensors, self.config, self.dtype = tensors, config, torch.float32

    def get(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors


def test_a_checkpoint_of_packed_experts_loads_end_to_end(tmp_path: Path) -> None:
    """tiny-gpt-oss's experts packed as the released checkpoints ship them (`*_blocks` and
    `*_scales` in place of gate_up_proj and down_proj), saved to a safetensors file and read
    back: the model's logits are transformers' over the same weights dequantized."""
    hf = copy.deepcopy(hf_model("tiny-gpt-oss"))
    tensors = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # stored [E, out, in] with the input blocked; transformers holds [E, in, out]
                blocks, scales = quantize_mxfp4(p.transpose(1, 2))
                tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
                p.copy_(dequantize_mxfp4(blocks, scales).transpose(1, 2))  # the reference's
            else:
                tensors[name] = p.detach().clone()
    save_file(tensors, tmp_path / "model.safetensors")
    stored = load_file(tmp_path / "model.safetensors")
    assert stored["model.layers.0.mlp.experts.gate_up_proj_blocks"].dtype == torch.uint8
    model = LlamaModel.from_hf(DictCheckpoint(stored, hf.config))
    ids = [5, 17, 42, 99, 3, 250, 71, 12, 8, 300, 1]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = model.logits(model.prefill(ids)[1])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    # and what transformers' float layout gives: the same weights, the same logits
    plain = LlamaModel.from_hf(hf)
    torch.testing.assert_close(plain.logits(plain.prefill(ids)[1]), got, atol=1e-5, rtol=1e-5)
