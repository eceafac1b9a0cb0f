"""arch/mxfp4.py: gpt-oss's MXFP4 expert weights read back exactly; a checkpoint holding its
experts packed so loaded end to end, read as stored and as a served model directory."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from neuronpy.arch.llama import LlamaModel
from neuronpy.arch.mxfp4 import FP4_VALUES, dequantize_mxfp4, quantize_mxfp4
from neuronpy.arch.stored import StackedTensor, StoredCheckpoint
from neuronpy.compose import load_engine, load_source, source_facts
from neuronpy.config import ModelSpec
from neuronpy.engine.types import SamplingParams
from neuronpy.loading import load_pretrained
from tests.factories import fixture_dir, hf_model


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


def packed_gpt_oss() -> tuple[Any, dict[str, torch.Tensor]]:
    """tiny-gpt-oss's experts packed as the released checkpoints ship them (`*_blocks` and
    `*_scales` in place of gate_up_proj and down_proj): the tensors, and a transformers model
    holding the same weights dequantized (the reference)."""
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
    return hf, tensors


IDS = [5, 17, 42, 99, 3, 250, 71, 12, 8, 300, 1]


def reference_logits(hf: Any) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([IDS])).logits[0]


def test_a_checkpoint_of_packed_experts_loads_end_to_end(tmp_path: Path) -> None:
    """The packed tensors saved to a safetensors file and read back as stored: the model's
    logits are transformers' over the same weights dequantized."""
    hf, tensors = packed_gpt_oss()
    save_file(tensors, tmp_path / "model.safetensors")
    stored = load_file(tmp_path / "model.safetensors")
    assert stored["model.layers.0.mlp.experts.gate_up_proj_blocks"].dtype == torch.uint8
    model = LlamaModel.from_hf(DictCheckpoint(stored, hf.config))
    got = model.logits(model.prefill(IDS)[1])
    torch.testing.assert_close(got, reference_logits(hf), atol=2e-4, rtol=1e-4)
    # and what transformers' float layout gives: the same weights, the same logits
    plain = LlamaModel.from_hf(hf)
    torch.testing.assert_close(plain.logits(plain.prefill(IDS)[1]), got, atol=1e-5, rtol=1e-5)


def packed_directory(path: Path) -> Any:
    """A model directory as gpt-oss ships (the packed experts, `quant_method: mxfp4`) at
    `path`; the transformers model of the same weights dequantized (the reference)."""
    hf, tensors = packed_gpt_oss()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    for f in fixture_dir("tiny-gpt-oss").iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, path / f.name)
    config = json.loads((path / "config.json").read_text())
    # (as the released config.json: the attention, the router, embeddings and head unpacked)
    unpacked = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens"]
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [*unpacked, "lm_head"],
    }
    (path / "config.json").write_text(json.dumps(config))
    return hf


def test_a_served_mxfp4_directory_is_read_as_stored_one_expert_at_a_time(tmp_path: Path) -> None:
    """On the CPU a served gpt-oss directory is read as stored: a packed tensor answers one
    expert's rows at a time (never a layer's experts in float at once), and the engine's
    greedy reply is transformers' over the dequantized weights."""
    hf = packed_directory(tmp_path)
    spec = ModelSpec(path=str(tmp_path), dtype="float32", device="cpu")
    source, _ = load_source(spec, lambda _: None)
    assert isinstance(source, StoredCheckpoint) and source_facts(source)[1] == "MXFP4"
    packed = source.get("model.layers.0.mlp.experts.gate_up_proj_blocks")
    assert isinstance(packed, StackedTensor) and packed[1].shape == packed.shape[1:]
    model = LlamaModel.from_hf(source)
    got = model.logits(model.prefill(IDS)[1])
    torch.testing.assert_close(got, reference_logits(hf), atol=2e-4, rtol=1e-4)

    async def reply() -> list[int]:
        engine = load_engine("gpt-oss", ModelSpec(path=str(tmp_path), dtype="float32"))
        async with engine:
            params = SamplingParams(max_tokens=12, temperature=0.0)
            return (await engine.complete(IDS, params)).token_ids

    with torch.no_grad():
        out = hf.generate(torch.tensor([IDS]), max_new_tokens=12, do_sample=False)
    assert anyio.run(reply) == out[0, len(IDS) :].tolist()[:12]


def test_an_mxfp4_checkpoint_directory_loads_dequantized(tmp_path: Path) -> None:
    """A model directory as gpt-oss ships (the packed experts, `quant_method: mxfp4`) loaded
    as a served model is: transformers dequantizes the experts (never its MXFP4 kernels, which
    it would fetch from the Hub where they are installed), and the native model computes
    transformers' logits."""
    hf = packed_directory(tmp_path)
    loaded = load_pretrained(str(tmp_path), dtype="float32").hf_model
    experts = loaded.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float32
    model = LlamaModel.from_hf(loaded)
    got = model.logits(model.prefill(IDS)[1])
    torch.testing.assert_close(got, reference_logits(hf), atol=2e-4, rtol=1e-4)
