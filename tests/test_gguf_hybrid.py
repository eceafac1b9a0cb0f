"""GGUF files of the hybrid families read as they are stored: each written from a tiny fixture
as llama.cpp's convert_hf_to_gguf.py writes it (its tensor names from gguf's own tensor map,
its transformations of the tensors, its metadata keys), then loaded by neuronpy's GGUF path
(loading.load_gguf_checkpoint, as `neuronpy serve --model file.gguf` does): the config the
fixture's where neuronpy reads it, an F32 file's logits the fixture's, a quantized file's
greedy tokens its dequantized model's."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from neuronpy.arch.config import ArchConfig
from neuronpy.arch.gguf import hf_name, read_index
from neuronpy.arch.llama import LlamaModel
from neuronpy.loading import load_gguf_checkpoint
from tests.factories import fixture_dir, hf_model, tokenizer
from tests.gguf_files import add_fixture_tokenizer, encode

ARCHS = {"tiny-lfm2": gguf.MODEL_ARCH.LFM2}
TEXT = "The quick brown fox jumps over the lazy dog. " * 20


# ---- the files, as llama.cpp's converter writes them -----------------------------------------


def _lfm2_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    """LFM2Model.set_gguf_parameters: head_count_kv per layer, 0 for a convolution layer; the
    MLP's size as built (the fixture's needs no adjusting); the convolution's length."""
    writer.add_head_count_kv(
        [config.num_key_value_heads if t != "conv" else 0 for t in config.layer_types]
    )
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_shortconv_l_cache(config.conv_L_cache)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    assert not config.block_auto_adjust_ff_dim
    writer.add_feed_forward_length(config.intermediate_size)


def _lfm2_tensors(name: str, w: torch.Tensor, config: Any) -> list[tuple[str, torch.Tensor]]:
    """LFM2Model.modify_tensors: the convolution's weight squeezed to 2-D."""
    if "conv.conv" in name:
        w = w.squeeze(1)
    return [(name, w)]


METADATA = {gguf.MODEL_ARCH.LFM2: _lfm2_metadata}
TENSORS = {gguf.MODEL_ARCH.LFM2: _lfm2_tensors}


def write_hybrid_gguf(path: Path, family: str, kind: str = "F32") -> Path:
    """Fixture `family` as a GGUF file of its llama.cpp architecture: 2-D projections in `kind`
    (norms, convolutions and per-head vectors F32, as llama-quantize leaves them), every name
    mapped by gguf's tensor map as the converter maps it; a tied head left out."""
    arch = ARCHS[family]
    model = hf_model(family)
    config = model.config
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(family)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    METADATA[arch](writer, config)
    add_fixture_tokenizer(writer, fixture_dir(family))
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for hf, tensor in model.state_dict().items():
        if hf == "lm_head.weight" and config.tie_word_embeddings:
            continue
        for name, w in TENSORS[arch](hf, tensor.detach().float(), config):
            target = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert target is not None, name
            data = w.numpy()
            kernel = target.endswith((".shortconv.conv.weight", ".ssm_conv1d.weight"))
            quantized = data.ndim == 2 and data.shape[1] % 32 == 0 and not kernel
            data, qtype = encode(data, kind if quantized else "F32")
            writer.add_tensor(target, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---- what neuronpy reads ---------------------------------------------------------------------


def load(path: Path, cache: Path) -> LlamaModel:
    checkpoint, _, _ = load_gguf_checkpoint(str(path), cache_dir=cache, log=lambda _: None)
    return LlamaModel.from_hf(checkpoint)


def logits_of(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        _, hidden = model.prefill(ids)
        return model.logits(hidden)


def greedy_ids(model: LlamaModel, ids: list[int], count: int) -> list[int]:
    out = list(ids)
    for _ in range(count):
        out.append(int(logits_of(model, out)[-1].argmax()))
    return out[len(ids) :]


def prompt(family: str) -> list[int]:
    ids = tokenizer(family).encode(TEXT)[:100]
    assert len(ids) == 100
    return ids


@pytest.mark.parametrize("family", list(ARCHS))
def test_the_config_is_the_fixtures(family: str, tmp_path: Path) -> None:
    path = write_hybrid_gguf(tmp_path / f"{family}.gguf", family)
    checkpoint, tok, _ = load_gguf_checkpoint(
        str(path), cache_dir=tmp_path / "cache", log=lambda _: None
    )
    want = hf_model(family).config
    assert checkpoint.config.model_type == want.model_type
    ours, theirs = ArchConfig.from_hf(checkpoint.config), ArchConfig.from_hf(want)
    # (GGUF stores the epsilon as a float32: the value the norms add in float32 either way)
    eps = float(np.float32(theirs.rms_norm_eps))
    assert ours == dataclasses.replace(theirs, rms_norm_eps=eps)
    assert tok.encode(TEXT) == tokenizer(family).encode(TEXT)


@pytest.mark.parametrize("family", list(ARCHS))
def test_an_f32_file_computes_the_fixtures_logits(family: str, tmp_path: Path) -> None:
    """Every tensor as transformers holds it: the logits of a 100-token prompt and of a few
    greedy steps those of the fixture read by transformers, and greedy tokens the same."""
    path = write_hybrid_gguf(tmp_path / f"{family}.gguf", family)
    model = load(path, tmp_path / "cache")
    ids = prompt(family)
    ids = ids + greedy_ids(model, ids, 4)
    native = LlamaModel.from_hf(hf_model(family))
    torch.testing.assert_close(logits_of(model, ids), logits_of(native, ids), atol=0, rtol=0)
    with torch.no_grad():
        want = hf_model(family)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits_of(model, ids), want, atol=5e-4, rtol=1e-4)


@pytest.mark.parametrize("family", list(ARCHS))
def test_a_q8_0_file_stays_quantized_and_runs_close(family: str, tmp_path: Path) -> None:
    """The projections in Q8_0, kept so (8-bit groups); the logits near those of the file's
    dequantized model, its next tokens mostly the same, and greedy decoding runs."""
    path = write_hybrid_gguf(tmp_path / f"{family}.gguf", family, "Q8_0")
    kinds = {t.kind for t in read_index(path)[1]}
    assert kinds == {"Q8_0", "F32"}
    checkpoint, _, _ = load_gguf_checkpoint(
        str(path), cache_dir=tmp_path / "cache", log=lambda _: None
    )
    assert "Q8_0 -> 8-bit groups of 32" in checkpoint.describe()
    model = LlamaModel.from_hf(checkpoint, quantize="auto")
    assert "float32" not in model.describe_weights().split(";")[0]  # every projection
    ids = prompt(family)
    got = logits_of(model, ids)
    # the reference: the same file's weights dequantized, computing in float32 (the kept
    # layers' kernels take bfloat16 inputs: ~1e-2 relative on these logits)
    reference = load(path, tmp_path / "cache")
    want = logits_of(reference, ids)
    assert float((got - want).abs().max()) < 0.1 * float(want.abs().max())
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
    assert float(agree) >= 0.9
    tokens = greedy_ids(model, ids, 4)
    assert len(tokens) == 4 and all(0 <= t < hf_model(family).config.vocab_size for t in tokens)


def test_lfm2_names_read_under_either_final_norm_name() -> None:
    """llama.cpp's converter names LFM2's final norm token_embd_norm; other converters
    (ollama's) output_norm: both are transformers' embedding_norm."""
    for name in ("token_embd_norm.weight", "output_norm.weight"):
        assert hf_name(name, "lfm2") == "model.embedding_norm.weight"
    assert hf_name("blk.2.shortconv.in_proj.weight", "lfm2") == "model.layers.2.conv.in_proj.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"  # (the Llama family's)
