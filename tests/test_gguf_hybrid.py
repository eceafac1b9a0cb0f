"""GGUF files of the hybrid families read as they are stored: each written from a tiny fixture
as llama.cpp's convert_hf_to_gguf.py writes it (its tensor names from gguf's own tensor map,
its transformations of the tensors, its metadata keys), then loaded by neuronpy's GGUF path
(loading.load_gguf_checkpoint, as `neuronpy serve --model file.gguf` does): the config the
fixture's where neuronpy reads it, an F32 file's logits the fixture's, a quantized file's
greedy tokens its dequantized model's. Qwen3.5 from a model built here (the fixture's shape
with as many value heads as key heads, the layout llama.cpp's converter leaves as it is), saved
as a transformers directory, the F32 file's logits those of that directory read by neuronpy."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers

from neuronpy.arch.config import ArchConfig
from neuronpy.arch.gguf import hf_name, read_index
from neuronpy.arch.llama import LlamaModel
from neuronpy.errors import ModelLoadError
from neuronpy.loading import load_gguf_checkpoint, load_pretrained
from tests.factories import fixture_builder, fixture_dir
from tests.gguf_files import add_fixture_tokenizer, encode

ARCHS = {
    "tiny-lfm2": gguf.MODEL_ARCH.LFM2,
    "qwen3.5-kv": gguf.MODEL_ARCH.QWEN35,
    "qwen3-next-kv": gguf.MODEL_ARCH.QWEN3NEXT,
    "tiny-granite-hybrid": gguf.MODEL_ARCH.GRANITE_HYBRID,
}
# and the files written only to be refused: tiny-qwen3.5 has 2 key heads, 4 value heads
WRITERS = {**ARCHS, "tiny-qwen3.5": gguf.MODEL_ARCH.QWEN35}
TEXT = "The quick brown fox jumps over the lazy dog. " * 20
BUILT: dict[str, Path] = {}  # "root": where this run builds its models (source_dir)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


# ---- the models ------------------------------------------------------------------------------


def variant_of(fixture: str, path: Path, seed: int, **changes: Any) -> Path:
    """Fixture `fixture`'s config with `changes`, its weights drawn as the fixtures' are
    (build_fixtures.init_weights, from `seed`), saved with its tokenizer at `path`."""
    fields = json.loads((fixture_dir(fixture) / "config.json").read_text())
    for key in ("architectures", "transformers_version", "dtype"):
        fields.pop(key)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **{**fields, **changes})
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    fixture_builder().init_weights(model, seed=seed)
    model.generation_config = transformers.GenerationConfig.from_pretrained(fixture_dir(fixture))
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(fixture_dir(fixture) / name, path / name)
    return path


def build_qwen35(path: Path, value_heads: int = 2, seed: int = 35) -> Path:
    """tiny-qwen3.5 with `value_heads` value heads in its linear attention (the fixture's 4
    beside 2 key heads: a layout llama.cpp's converter reorders)."""
    return variant_of("tiny-qwen3.5", path, seed, linear_num_value_heads=value_heads)


@pytest.fixture(scope="module", autouse=True)
def _built_models(tmp_path_factory: pytest.TempPathFactory) -> None:
    BUILT["root"] = tmp_path_factory.mktemp("models")


@functools.cache
def source_dir(family: str) -> Path:
    """The transformers directory of `family`: a fixture's, or one built here (once a run)."""
    if family == "qwen3.5-kv":
        return build_qwen35(BUILT["root"] / family)
    if family == "qwen3-next-kv":
        return build_qwen3_next(BUILT["root"] / family)
    return fixture_dir(family)


@functools.cache
def hf_model(family: str) -> Any:
    """The transformers model of `family` (cached: read-only)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        source_dir(family), dtype="float32"
    ).eval()


@functools.cache
def tokenizer(family: str) -> Any:
    return transformers.AutoTokenizer.from_pretrained(source_dir(family))


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


def _qwen35_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    """Qwen3_5TextModel.set_gguf_parameters (TextModel's, Qwen3NextModel's, the MRoPE mixin's):
    the head size, the linear attention's shape, the attention layers' interval, the rotary
    share as a count of dimensions, MRoPE's default sections."""
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    interval = config.layer_types.index("full_attention") + 1
    assert all(
        (t == "full_attention") == ((i + 1) % interval == 0)
        for i, t in enumerate(config.layer_types)
    )
    writer.add_full_attention_interval(interval)
    partial = config.rope_parameters["partial_rotary_factor"]
    writer.add_rope_dimension_count(int(config.head_dim * partial))
    if config.model_type == "qwen3_5_text":
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    else:  # Qwen2MoeModel's
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _tiled(w: torch.Tensor, dim: int, nk: int, head_dim: int) -> torch.Tensor:
    """_LinearAttentionVReorderBase._reorder_v_heads: value heads along `dim` from grouped by
    key head (nk groups) to tiled."""
    shape = list(w.shape)
    w = w.reshape(*shape[:dim], nk, -1, head_dim, *shape[dim + 1 :])
    return w.transpose(dim, dim + 1).reshape(shape)


def _qwen35_tensors(name: str, w: torch.Tensor, config: Any) -> list[tuple[str, torch.Tensor]]:
    """Qwen3_5TextModel.modify_tensors: with fewer key heads than value heads, the value heads
    reordered from grouped to tiled (_LinearAttentionVReorderBase); then Qwen3NextModel's: A_log
    as -exp(A_log), dt_bias renamed dt_proj.bias, the convolution squeezed to 2-D, every (1 + w)
    norm stored as 1 + w."""
    nk, dk, dv = (
        config.linear_num_key_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
    )
    if nk != config.linear_num_value_heads and "linear_attn." in name:
        if ".in_proj_qkv." in name:
            w = torch.cat([w[: 2 * nk * dk], _tiled(w[2 * nk * dk :], 0, nk, dv)])
        elif ".in_proj_z." in name:
            w = _tiled(w, 0, nk, dv)
        elif (
            ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias"))
        ):
            w = _tiled(w, 0, nk, 1)
        elif ".conv1d." in name:
            w = torch.cat([w[: 2 * nk * dk], _tiled(w[2 * nk * dk :], 0, nk, dv)])
        elif ".out_proj." in name:
            w = _tiled(w, 1, nk, dv)
    if name.endswith(".A_log"):
        w = -torch.exp(w)
    elif name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    elif "conv1d" in name:
        w = w.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        w = w + 1
    return [(name, w)]


def _qwen3_next_tensors(name: str, w: torch.Tensor, config: Any) -> list[tuple[str, torch.Tensor]]:
    """Qwen3NextModel.modify_tensors: in_proj_qkvz ([q, k, v, z] a key head) split into all of
    q, k, v (attn_qkv) and z (attn_gate); then Qwen3.5's steps but the reorder, which
    Qwen3NextModel does not do; Qwen2MoeModel's experts stacked [E, rows, columns] (from the
    separate experts of a checkpoint; transformers holds gate and up fused)."""
    if name.endswith(".in_proj_qkvz.weight"):
        nk, dk = config.linear_num_key_heads, config.linear_key_head_dim
        dv = config.linear_num_value_heads // nk * config.linear_value_head_dim
        q, k, v, z = w.reshape(nk, 2 * dk + 2 * dv, -1).split([dk, dk, dv, dv], dim=1)
        stem = name.removesuffix(".in_proj_qkvz.weight")
        hidden = w.shape[1]
        qkv = torch.cat([t.reshape(-1, hidden) for t in (q, k, v)])
        return [
            (f"{stem}.in_proj_qkv.weight", qkv),
            (f"{stem}.in_proj_z.weight", z.reshape(-1, hidden)),
        ]
    layer = name.split(".")[2] if name.startswith("model.layers.") else ""
    if name.endswith(".experts.gate_up_proj"):
        gate, up = w.chunk(2, dim=1)
        return [
            (f"blk.{layer}.ffn_gate_exps.weight", gate),
            (f"blk.{layer}.ffn_up_exps.weight", up),
        ]
    if name.endswith(".experts.down_proj"):
        return [(f"blk.{layer}.ffn_down_exps.weight", w)]
    return _qwen35_tensors(name, w, config)


def _granite_attention_layers(config: Any) -> list[int]:
    """GraniteHybridModel.get_attn_layers, of a checkpoint's layer types as Granite 4's configs
    name them ("attention" / "mamba"; transformers renames them full_attention /
    linear_attention)."""
    return [i for i, t in enumerate(config.layer_types) if t in ("attention", "full_attention")]


def _granite_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    """GraniteHybridModel.set_gguf_parameters: TextModel's and LlamaModel's fields, Granite's
    four multipliers as scales, the shared MLP's size (GraniteMoeModel's), the Mamba2 shape
    (time_step_rank: its head count), head_count_kv per layer (0 for a Mamba2 layer), and, the
    attention being without positions, rope.scaling.finetuned false and the context length
    overwritten by 2**20."""
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_attention_scale(config.attention_multiplier)
    writer.add_embedding_scale(config.embedding_multiplier)
    writer.add_residual_scale(config.residual_multiplier)
    writer.add_logit_scale(config.logits_scaling)
    writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)
    writer.add_ssm_conv_kernel(config.mamba_d_conv)
    writer.add_ssm_state_size(config.mamba_d_state)
    writer.add_ssm_group_count(config.mamba_n_groups)
    writer.add_ssm_inner_size(config.mamba_expand * config.hidden_size)
    writer.add_ssm_time_step_rank(config.mamba_n_heads)
    attention = _granite_attention_layers(config)
    writer.add_head_count_kv(
        [
            config.num_key_value_heads if i in attention else 0
            for i in range(len(config.layer_types))
        ]
    )
    assert config.position_embedding_type != "rope"
    writer.add_rope_scaling_finetuned(False)
    writer.add_context_length(2**20)


def _granite_tensors(name: str, w: torch.Tensor, config: Any) -> list[tuple[str, torch.Tensor]]:
    """GraniteHybridModel.modify_tensors on the checkpoint's tensors (its files' names): the
    experts' and the shared MLP's input_linear split into gate (the first half) and up
    (GraniteMoeModel's); a Mamba2 layer's as Mamba2Model's: dt_bias renamed dt_proj.bias, the
    convolution squeezed, A and D [heads, 1], the norm [groups, inner / groups], A_log as
    -exp(A_log); an attention layer's q and k rows permuted as LlamaModel's (undo_permute)."""
    layer = name.split(".")[2] if name.startswith("model.layers.") else ""
    if name.endswith("block_sparse_moe.input_linear.weight"):
        gate, up = w.split(config.intermediate_size, dim=-2)
        return [
            (f"blk.{layer}.ffn_gate_exps.weight", gate),
            (f"blk.{layer}.ffn_up_exps.weight", up),
        ]
    if name.endswith("shared_mlp.input_linear.weight"):
        gate, up = w.split(config.shared_intermediate_size, dim=-2)
        tail = "_shexp" if config.num_local_experts else ""
        return [
            (f"blk.{layer}.ffn_gate{tail}.weight", gate),
            (f"blk.{layer}.ffn_up{tail}.weight", up),
        ]
    if not layer:
        return [(name, w)]
    if int(layer) in _granite_attention_layers(config):
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            n = heads if "q_proj" in name else kv
            w = w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        return [(name, w)]
    if name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    if "conv1d.weight" in name:
        w = w.squeeze()
    elif name.endswith((".A_log", ".D")):
        w = w.reshape(*w.shape, 1)
    elif name.endswith("mamba.norm.weight"):
        groups = config.mamba_n_groups
        w = w.reshape(groups, -1)
    if name.endswith(".A_log"):
        w = -torch.exp(w)
    return [(name, w)]


METADATA = {
    gguf.MODEL_ARCH.LFM2: _lfm2_metadata,
    gguf.MODEL_ARCH.QWEN35: _qwen35_metadata,
    gguf.MODEL_ARCH.QWEN3NEXT: _qwen35_metadata,
    gguf.MODEL_ARCH.GRANITE_HYBRID: _granite_metadata,
}
TENSORS = {
    gguf.MODEL_ARCH.LFM2: _lfm2_tensors,
    gguf.MODEL_ARCH.QWEN35: _qwen35_tensors,
    gguf.MODEL_ARCH.QWEN3NEXT: _qwen3_next_tensors,
    gguf.MODEL_ARCH.GRANITE_HYBRID: _granite_tensors,
}


def checkpoint_tensors(family: str) -> dict[str, torch.Tensor]:
    """The tensors the converter reads: Granite's files' own (transformers renames its experts
    and router in memory), the other families' transformers model's state dict."""
    if WRITERS[family] == gguf.MODEL_ARCH.GRANITE_HYBRID:
        from safetensors.torch import load_file

        return load_file(source_dir(family) / "model.safetensors")
    return hf_model(family).state_dict()


def write_hybrid_gguf(path: Path, family: str, kind: str = "F32", *, mtp: bool = False) -> Path:
    """Fixture `family` as a GGUF file of its llama.cpp architecture: 2-D projections in `kind`
    (norms, convolutions and per-head vectors F32, as llama-quantize leaves them), every name
    mapped by gguf's tensor map as the converter maps it; a tied head left out. `mtp`: one
    multi-token-prediction layer after the others, as the Qwen3.5 converter writes one (counted
    in block_count, its tensors blk.N.*; here random)."""
    arch = WRITERS[family]
    model = hf_model(family)
    config = model.config
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(family)
    writer.add_block_count(config.num_hidden_layers + mtp)
    if mtp:
        writer.add_nextn_predict_layers(1)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    METADATA[arch](writer, config)
    add_fixture_tokenizer(writer, source_dir(family))
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for hf, tensor in checkpoint_tensors(family).items():
        if hf == "lm_head.weight" and config.tie_word_embeddings:
            continue
        for name, w in TENSORS[arch](hf, tensor.detach().float(), config):
            target = name if name.startswith("blk.") else None  # (the experts: named above)
            target = target or names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert target is not None, name
            data = w.contiguous().numpy()
            kernel = target.endswith((".shortconv.conv.weight", ".ssm_conv1d.weight"))
            quantized = data.ndim in (2, 3) and data.shape[-1] % 32 == 0 and not kernel
            # (llama-quantize's rules: the router and the norms stay F32)
            quantized &= not target.endswith((".ffn_gate_inp.weight", "_norm.weight"))
            data, qtype = encode(data, kind if quantized else "F32")
            writer.add_tensor(target, data, raw_dtype=qtype)
    if mtp:
        gen = torch.Generator().manual_seed(0)
        hidden, n = config.hidden_size, config.num_hidden_layers
        for name, shape in (
            ("nextn.eh_proj.weight", (hidden, 2 * hidden)),
            ("nextn.enorm.weight", (hidden,)),
            ("attn_norm.weight", (hidden,)),
            ("attn_q.weight", (2 * config.num_attention_heads * config.head_dim, hidden)),
            ("ffn_up.weight", (config.intermediate_size, hidden)),
        ):
            writer.add_tensor(f"blk.{n}.{name}", torch.randn(shape, generator=gen).numpy())
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
    # (GGUF stores the epsilon as a float32: the value the norms add in float32 either way;
    # Granite's reader gives the decimal it was written from)
    eps = float(np.float32(theirs.rms_norm_eps))
    if family == "tiny-granite-hybrid":
        eps = theirs.rms_norm_eps
        # the converter writes a NoPE model's context length as 2**20, not the checkpoint's
        assert ours.context_len == 2**20
        theirs = dataclasses.replace(theirs, context_len=ours.context_len)
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
    loaded = load_pretrained(str(source_dir(family)), dtype="float32", cache_dir=tmp_path / "cache")
    native = LlamaModel.from_hf(loaded.hf_model)
    torch.testing.assert_close(logits_of(model, ids), logits_of(native, ids), atol=0, rtol=0)
    with torch.no_grad():
        want = hf_model(family)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits_of(model, ids), want, atol=5e-4, rtol=1e-4)


@pytest.mark.parametrize("family", list(ARCHS))
def test_a_q8_0_file_stays_quantized_and_runs_close(family: str, tmp_path: Path) -> None:
    """The projections in Q8_0, kept so (8-bit groups; Qwen3-Next's and Granite's routed
    experts are dequantized once at load, and quantized again as `quantize` says); the logits
    near those of the file's dequantized model, its next tokens mostly the same, and greedy
    decoding runs."""
    path = write_hybrid_gguf(tmp_path / f"{family}.gguf", family, "Q8_0")
    kinds = {t.kind for t in read_index(path)[1]}
    assert kinds == {"Q8_0", "F32"}
    checkpoint, _, _ = load_gguf_checkpoint(
        str(path), cache_dir=tmp_path / "cache", log=lambda _: None
    )
    assert "Q8_0 -> 8-bit groups of 32" in checkpoint.describe()
    model = LlamaModel.from_hf(checkpoint, quantize="auto")
    projections = model.describe_weights().split(";")[0]
    assert "from Q8_0" in projections
    if family == "tiny-granite-hybrid":  # float: each layer's router and its routed experts'
        # two linears each (dequantized at load); its shared MLP, attention and Mamba2 kept
        config = hf_model(family).config
        floats = config.num_hidden_layers * (1 + 2 * config.num_local_experts)
        assert projections.startswith(f"projections: {floats} float32,")
    elif family != "qwen3-next-kv":  # (its routed experts: float, dequantized at load)
        assert "float32" not in projections  # every projection
    ids = prompt(family)
    got = logits_of(model, ids)
    # the reference: the same file's weights dequantized, computing in float32 (the kept
    # layers' kernels take bfloat16 inputs: ~1e-2 relative on these logits)
    reference = load(path, tmp_path / "cache")
    want = logits_of(reference, ids)
    error = (got - want).abs()
    if family == "qwen3-next-kv":  # (a token whose router picks another expert on the kept
        # layers' bf16 inputs is off by more than its neighbours: the typical error is bound)
        assert float(error.mean()) < 0.02 * float(want.abs().max())
    else:
        assert float(error.max()) < 0.1 * float(want.abs().max())
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


def test_qwen35_names() -> None:
    """llama.cpp's qwen35 names: the Gated DeltaNet's parts, A_log and dt_bias without a
    .weight (ssm_a, ssm_dt.bias), the norm after attention post_attention_norm."""
    cases = {
        "blk.0.ssm_a": "model.layers.0.linear_attn.A_log",
        "blk.0.ssm_dt.bias": "model.layers.0.linear_attn.dt_bias",
        "blk.2.attn_qkv.weight": "model.layers.2.linear_attn.in_proj_qkv.weight",
        "blk.2.attn_gate.weight": "model.layers.2.linear_attn.in_proj_z.weight",
        "blk.2.ssm_beta.weight": "model.layers.2.linear_attn.in_proj_b.weight",
        "blk.2.ssm_alpha.weight": "model.layers.2.linear_attn.in_proj_a.weight",
        "blk.2.ssm_out.weight": "model.layers.2.linear_attn.out_proj.weight",
        "blk.2.ssm_norm.weight": "model.layers.2.linear_attn.norm.weight",
        "blk.2.ssm_conv1d.weight": "model.layers.2.linear_attn.conv1d.weight",
        "blk.1.post_attention_norm.weight": "model.layers.1.post_attention_layernorm.weight",
        "blk.1.attn_q.weight": "model.layers.1.self_attn.q_proj.weight",
        "blk.3.nextn.eh_proj.weight": None,
        "blk.0.ssm_a.weight": None,
    }
    for name, want in cases.items():
        assert hf_name(name, "qwen35") == want, name


def test_a_qwen35_file_with_mtp_layers_reads_the_model_alone(tmp_path: Path) -> None:
    """The converter counts the multi-token-prediction layers in block_count (and says how
    many in nextn_predict_layers): the model is the layers before them, its logits the same."""
    family = "qwen3.5-kv"
    path = write_hybrid_gguf(tmp_path / "mtp.gguf", family, mtp=True)
    plain = write_hybrid_gguf(tmp_path / "plain.gguf", family)
    checkpoint, _, _ = load_gguf_checkpoint(
        str(path), cache_dir=tmp_path / "cache", log=lambda _: None
    )
    assert checkpoint.config.num_hidden_layers == 3
    reference, _, _ = load_gguf_checkpoint(
        str(plain), cache_dir=tmp_path / "cache", log=lambda _: None
    )
    assert checkpoint.types() == reference.types()
    ids = prompt(family)
    got = logits_of(LlamaModel.from_hf(checkpoint), ids)
    torch.testing.assert_close(got, logits_of(LlamaModel.from_hf(reference), ids), atol=0, rtol=0)


def test_a_qwen35_file_with_more_value_heads_than_key_heads_is_refused(tmp_path: Path) -> None:
    """The converter reorders such a file's value heads (grouped -> tiled): refused by name,
    saying why, before a tensor is read."""
    path = write_hybrid_gguf(tmp_path / "nv4.gguf", "tiny-qwen3.5")
    with pytest.raises(ModelLoadError, match=r"2 key heads and 4 value heads.*reordered"):
        load_gguf_checkpoint(str(path), cache_dir=tmp_path / "cache", log=lambda _: None)


def build_qwen3_next(path: Path, seed: int = 36) -> Path:
    """tiny-qwen3-next with every layer sparse (llama.cpp names no dense one) and as many
    value heads as key heads."""
    heads = json.loads((fixture_dir("tiny-qwen3-next") / "config.json").read_text())
    return variant_of(
        "tiny-qwen3-next",
        path,
        seed,
        mlp_only_layers=[],
        decoder_sparse_step=1,
        norm_topk_prob=True,
        linear_num_value_heads=heads["linear_num_key_heads"],
    )


def test_granite_hybrid_names() -> None:
    """llama.cpp's granitehybrid names: the Mamba2 layer's parts (A_log, D and dt_bias without
    a .weight), the router, the experts stacked (a pattern), the shared MLP's split gate and
    up (ffn_*_shexp; ffn_gate / ffn_up / ffn_down in a model of no routed experts)."""
    cases = {
        "blk.0.ssm_a": "model.layers.0.mamba.A_log",
        "blk.0.ssm_d": "model.layers.0.mamba.D",
        "blk.0.ssm_dt.bias": "model.layers.0.mamba.dt_bias",
        "blk.0.ssm_in.weight": "model.layers.0.mamba.in_proj.weight",
        "blk.0.ssm_conv1d.weight": "model.layers.0.mamba.conv1d.weight",
        "blk.0.ssm_conv1d.bias": "model.layers.0.mamba.conv1d.bias",
        "blk.0.ssm_norm.weight": "model.layers.0.mamba.norm.weight",
        "blk.0.ssm_out.weight": "model.layers.0.mamba.out_proj.weight",
        "blk.1.attn_q.weight": "model.layers.1.self_attn.q_proj.weight",
        "blk.1.attn_output.weight": "model.layers.1.self_attn.o_proj.weight",
        "blk.1.ffn_norm.weight": "model.layers.1.post_attention_layernorm.weight",
        "blk.1.ffn_gate_inp.weight": "model.layers.1.block_sparse_moe.router.layer.weight",
        "blk.1.ffn_gate_exps.weight": "model.layers.1.block_sparse_moe.experts.{}.gate_proj.weight",
        "blk.1.ffn_down_exps.weight": "model.layers.1.block_sparse_moe.experts.{}.down_proj.weight",
        "blk.1.ffn_up_shexp.weight": "model.layers.1.shared_mlp.up_proj.weight",
        "blk.1.ffn_gate.weight": "model.layers.1.shared_mlp.gate_proj.weight",
        "blk.1.ffn_down.weight": "model.layers.1.shared_mlp.down_proj.weight",
        "blk.0.ssm_a.weight": None,
    }
    for name, want in cases.items():
        assert hf_name(name, "granitehybrid") == want, name


def test_a_granite_hybrid_file_restores_its_mamba_tensors(tmp_path: Path) -> None:
    """The file's Mamba2 tensors as the checkpoint holds them: D, the norm and the convolution
    reshaped back exactly; A_log read back in float64 so that -exp of it, rounded to float32,
    is the checkpoint's -exp(A_log) bit for bit (what Mamba2Mixer computes from it); q and k
    rows in the checkpoint's order."""
    from safetensors.torch import load_file

    family = "tiny-granite-hybrid"
    path = write_hybrid_gguf(tmp_path / "g.gguf", family)
    checkpoint, _, _ = load_gguf_checkpoint(
        str(path), cache_dir=tmp_path / "cache", log=lambda _: None
    )
    stored = load_file(source_dir(family) / "model.safetensors")
    for name in ("D", "norm.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "in_proj.weight"):
        got, want = (
            checkpoint.get(f"model.layers.0.mamba.{name}"),
            stored[f"model.layers.0.mamba.{name}"],
        )
        assert isinstance(got, torch.Tensor)
        assert torch.equal(got, want), name
    a_log = checkpoint.get("model.layers.2.mamba.A_log")
    assert isinstance(a_log, torch.Tensor) and a_log.dtype == torch.float64
    want = -torch.exp(stored["model.layers.2.mamba.A_log"].float())
    assert torch.equal((-a_log.exp()).float(), want)
    for name in ("q_proj", "k_proj"):
        got = checkpoint.get(f"model.layers.1.self_attn.{name}.weight")
        assert torch.equal(got, stored[f"model.layers.1.self_attn.{name}.weight"])  # type: ignore[arg-type]
