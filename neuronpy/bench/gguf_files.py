"""GGUF files written from a transformers model as llama.cpp's converter lays them out (its
tensor names, q and k rows permuted for its RoPE) in any GGML type neuronpy reads: Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, F16, BF16 and F32 through the gguf package's own quantizers, Q4_K, Q5_K and
Q6_K through the small round-to-nearest encoders below (the package only decodes them); and in
the type mix llama.cpp's `llama-quantize` writes for each preset (preset_type), so that a
random-weight model's Q4_K_M file is laid out as a real one and every peer can read it. No
network: the bench builds its 1B-class files with this (`neuronpy.bench.random_model`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import transformers

_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    stem, _, suffix = hf_name.rpartition(".")
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{suffix}"
    _, _, layer, module = stem.split(".", 3)
    return f"blk.{layer}.{_LAYER[module]}.{suffix}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (the inverse of what the loader undoes)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _over(values: np.ndarray, step: np.ndarray) -> np.ndarray:
    """`values` [blocks, n] in units of each block's fp16 `step` [blocks]; 0 where the step
    rounded to 0 (a block of zeros, such as an embedding's padding row)."""
    s = step.astype(np.float32)[:, None]
    return np.divide(values, s, out=np.zeros_like(values, dtype=np.float32), where=s != 0)


def _k_sub_blocks(w: np.ndarray, top: int) -> tuple[np.ndarray, ...]:
    """Round-to-nearest levels 0..`top` of Q4_K's and Q5_K's layout: [N, K] float32 (K % 256
    == 0) -> (d, dmin as fp16 [blocks], their 12 packed bytes of 6-bit scales and minimums
    [blocks, 12], levels [blocks, 8, 32]), each 32-value sub-block's step d * sc, offset
    dmin * m."""
    sub = w.reshape(-1, 8, 32).astype(np.float32)  # [blocks, 8, 32]
    lo = np.minimum(sub.min(axis=2), 0)
    scale = (sub.max(axis=2) - lo) / top
    d = np.maximum(scale.max(axis=1), 1e-8) / 63
    dmin = np.maximum((-lo).max(axis=1), 1e-8) / 63
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.round(_over(scale, d16)), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(_over(-lo, dmin16)), 0, 63).astype(np.uint8)
    step = d16.astype(np.float32)[:, None] * sc
    offset = dmin16.astype(np.float32)[:, None] * mn
    safe = np.where(step != 0, step, 1)[..., None]  # (a step of 0: every level 0)
    q = np.where(step[..., None] != 0, np.round((sub + offset[..., None]) / safe), 0)
    q = np.clip(q, 0, top).astype(np.uint8)
    scales = np.zeros((sub.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return d16, dmin16, scales, q


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """[blocks, 8, 32] levels' low nibbles as GGML's K types pack them: four 32-byte chunks,
    sub-block 2j in chunk j's low nibbles, 2j + 1 in its high ones -> [blocks, 128]."""
    pairs = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """A plain round-to-nearest Q4_K encoder: [N, K] float32 (K % 256 == 0) -> [N, K/256*144]
    bytes, each super-block's 8 sub-blocks with a 6-bit scale and minimum."""
    n, k = w.shape
    d16, dmin16, scales, q = _k_sub_blocks(w, 15)
    blocks = np.concatenate(
        [d16[:, None].view(np.uint8), dmin16[:, None].view(np.uint8), scales, _nibble_pairs(q)],
        axis=1,
    )
    return blocks.reshape(n, k // 256 * 144)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """Q5_K as Q4_K with a fifth bit: [N, K] -> [N, K/256*176] bytes, the 8 sub-blocks' high
    bits in 32 bytes (bit i of byte l: sub-block i's value l) before the nibbles."""
    n, k = w.shape
    d16, dmin16, scales, q = _k_sub_blocks(w, 31)
    bit = np.arange(8, dtype=np.uint8)[None, :, None]
    qh = ((q >> 4) << bit).sum(axis=1, dtype=np.uint8)  # [blocks, 32]
    blocks = np.concatenate(
        [
            d16[:, None].view(np.uint8),
            dmin16[:, None].view(np.uint8),
            scales,
            qh,
            _nibble_pairs(q),
        ],
        axis=1,
    )
    return blocks.reshape(n, k // 256 * 176)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """A plain round-to-nearest Q6_K encoder: [N, K] float32 (K % 256 == 0) -> [N, K/256*210]
    bytes: levels q - 32 in [-32, 31] with an int8 scale per 16 values times the block's fp16
    d; the low nibbles (128 bytes), the high bit pairs (64 bytes), the scales, d."""
    n, k = w.shape
    sub = w.reshape(-1, 16, 16).astype(np.float32)  # [blocks, 16, 16]
    scale = np.abs(sub).max(axis=2) / 31  # levels -31..31: the largest magnitude is 31
    d16 = (np.maximum(scale.max(axis=1), 1e-8) / 127).astype(np.float16)
    sc = np.clip(np.round(_over(scale, d16)), 0, 127).astype(np.int8)
    step = d16.astype(np.float32)[:, None] * sc
    safe = np.where(step != 0, step, 1)[..., None]  # (a scale of 0: every level 0)
    u = np.where(step[..., None] != 0, np.round(sub / safe), 0)
    q = (np.clip(u, -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    # value h*128 + s*64 + b (s < 2, b < 64): low nibble in byte h*64 + b, shifted 4*s
    low = (q & 0x0F).reshape(-1, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    # value h*128 + s*32 + b (s < 4, b < 32): high pair in byte h*32 + b, shifted 2*s
    high = (q >> 4).reshape(-1, 2, 4, 32)
    shift = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    qh = (high << shift).sum(axis=2, dtype=np.uint8).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d16[:, None].view(np.uint8)], axis=1)
    return blocks.reshape(n, k // 256 * 210)


# the K types' encoders here (the gguf package only decodes them)
K_ENCODERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def encode(w: np.ndarray, kind: str) -> tuple[np.ndarray, Any]:
    qtype = gguf.GGMLQuantizationType[kind]
    if kind in K_ENCODERS:
        return K_ENCODERS[kind](w), qtype
    if kind in ("F32", "F16"):
        return w.astype(np.float32 if kind == "F32" else np.float16), qtype
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


# ---- what llama.cpp's llama-quantize writes for each preset --------------------------------------

# each preset's default type (llama.cpp's src/llama-quant.cpp, llama_tensor_get_type)
PRESETS = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K", "Q8_0": "Q8_0", "Q4_0": "Q4_0"}
# a type whose 256-value super-blocks do not fit a tensor's rows falls back to one of 32
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _block(kind: str) -> int:
    return 256 if kind in K_FALLBACK else 32


def _use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v and ffn_down get Q6_K in a _M preset: the
    first eighth, the last eighth, and every third one between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def preset_type(name: str, columns: int, preset: str, layers: int, tied: bool) -> str:
    """The GGML type llama-quantize writes 2-D tensor `name` (GGUF's name, `columns` values a
    row) in under `preset`, for a model of `layers` blocks. The output projection, or a tied
    model's token embedding (which serves as it), takes Q6_K unless the preset is Q8_0 (Q8_0
    where a row is no whole number of the preset's blocks); an untied embedding the preset's
    type; a _M preset's attn_v and ffn_down Q6_K in the layers _use_more_bits names."""
    kind = PRESETS[preset]
    more_bits = preset.endswith("_M") and name.endswith((".attn_v.weight", ".ffn_down.weight"))
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        if columns % _block(kind):
            kind = "Q8_0"
        elif kind != "Q8_0":
            kind = "Q6_K"
    elif more_bits and _use_more_bits(int(name.split(".")[1]), layers):
        kind = "Q6_K"
    if columns % _block(kind):
        kind = K_FALLBACK[kind]
    return kind


def preset_types(hf_model: Any, preset: str) -> dict[str, str]:
    """Every 2-D tensor's GGML type (by GGUF name) in `hf_model`'s `preset` file."""
    config = hf_model.config
    tied = bool(config.tie_word_embeddings)
    return {
        gguf_name(name): preset_type(
            gguf_name(name), tensor.shape[1], preset, config.num_hidden_layers, tied
        )
        for name, tensor in hf_model.state_dict().items()
        if tensor.dim() == 2 and not (name == "lm_head.weight" and tied)
    }


def add_fixture_metadata(
    writer: gguf.GGUFWriter, tokenizer_dir: Path, config: Any | None = None
) -> None:
    """The hyperparameters (`config`'s, else the fixture folder `tokenizer_dir`'s) and its
    byte-level BPE tokenizer, all but the block count, as llama.cpp's converter writes them:
    transformers (and so neuronpy's GGUF loader) reads the file as a whole model, which
    `neuronpy serve` serves alone."""
    if config is None:
        config = transformers.AutoConfig.from_pretrained(tokenizer_dir)
    writer.add_name(tokenizer_dir.name)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    add_fixture_tokenizer(writer, tokenizer_dir)


def add_fixture_tokenizer(writer: gguf.GGUFWriter, tokenizer_dir: Path) -> None:
    """A fixture's byte-level BPE tokenizer, its special ids and chat template, as llama.cpp's
    converter writes them."""
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    tokens = [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])]
    for added in tok["added_tokens"]:
        tokens[added["id"]] = added["content"]
    special = {added["id"] for added in tok["added_tokens"] if added["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges(
        [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    )
    fixture = json.loads((tokenizer_dir / "config.json").read_text())
    writer.add_eos_token_id(fixture["eos_token_id"])
    writer.add_pad_token_id(fixture["pad_token_id"])
    writer.add_chat_template((tokenizer_dir / "chat_template.jinja").read_text())


def write_gguf(
    path: Path,
    hf_model: Any,
    kind: str = "Q4_1",
    kinds: dict[str, str] | None = None,
    *,
    tokenizer_dir: Path | None = None,
) -> Path:
    """`hf_model`'s weights as a GGUF file: 2-D weights in `kind` (or `kinds[gguf name]`),
    norms in F32; a tied LM head left out, as llama.cpp does. Tensors alone, unless
    `tokenizer_dir` (a fixture's) is given: then a whole model, with that tokenizer."""
    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    if tokenizer_dir is not None:
        add_fixture_metadata(writer, tokenizer_dir, config)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = tensor.detach().float().numpy()
        if name.endswith("q_proj.weight"):
            w = _permute(w, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = _permute(w, config.num_key_value_heads)
        target = gguf_name(name)
        want = (kinds or {}).get(target, kind) if w.ndim == 2 else "F32"
        data, qtype = encode(w, want)
        writer.add_tensor(target, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_preset(
    path: Path, hf_model: Any, preset: str, *, tokenizer_dir: Path | None = None
) -> Path:
    """`hf_model` as llama-quantize writes its `preset` file (see preset_type)."""
    kinds = preset_types(hf_model, preset)
    return write_gguf(path, hf_model, PRESETS[preset], kinds, tokenizer_dir=tokenizer_dir)
