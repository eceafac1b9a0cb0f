"""Tiny GGUF files written at test time from a transformers model, as llama.cpp's converter
lays them out (its tensor names, q and k rows permuted for its RoPE), in any GGML types: Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, F16 and F32 through the gguf package's own quantizers, Q4_K through the
small reference encoder below (the package only decodes it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers

from neuronpy.arch.gguf import GGUFCheckpoint

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


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """A plain round-to-nearest Q4_K encoder: [N, K] float32 (K % 256 == 0) -> [N, K/256*144]
    bytes, each super-block's 8 sub-blocks with a 6-bit scale and minimum."""
    n, k = w.shape
    sub = w.reshape(-1, 8, 32).astype(np.float32)  # [blocks, 8, 32]
    lo = np.minimum(sub.min(axis=2), 0)
    scale = (sub.max(axis=2) - lo) / 15
    d = np.maximum(scale.max(axis=1), 1e-8) / 63
    dmin = np.maximum((-lo).max(axis=1), 1e-8) / 63
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.round(scale / d16.astype(np.float32)[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / dmin16.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    step = d16.astype(np.float32)[:, None] * sc
    offset = dmin16.astype(np.float32)[:, None] * mn
    q = np.clip(np.round((sub + offset[..., None]) / step[..., None]), 0, 15).astype(np.uint8)
    scales = np.zeros((sub.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    pairs = q.reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate(
        [d16[:, None].view(np.uint8), dmin16[:, None].view(np.uint8), scales, qs], axis=1
    )
    return blocks.reshape(n, k // 256 * 144)


def encode(w: np.ndarray, kind: str) -> tuple[np.ndarray, Any]:
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "Q4_K":
        return quantize_q4_k(w), qtype
    if kind in ("F32", "F16"):
        return w.astype(np.float32 if kind == "F32" else np.float16), qtype
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


def add_fixture_metadata(writer: gguf.GGUFWriter, src: Path) -> None:
    """Fixture folder `src`'s config and byte-level BPE tokenizer as GGUF metadata (all but
    the block count), so that the file serves alone, as a downloaded one does."""
    cfg = json.loads((src / "config.json").read_text())
    tok = json.loads((src / "tokenizer.json").read_text())
    writer.add_name(src.name)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(cfg["vocab_size"])
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
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])
    writer.add_chat_template((src / "chat_template.jinja").read_text())


def write_gguf(
    path: Path,
    hf_model: Any,
    kind: str = "Q4_1",
    kinds: dict[str, str] | None = None,
    metadata_from: Path | None = None,
) -> Path:
    """`hf_model`'s weights as a GGUF file: 2-D weights in `kind` (or `kinds[gguf name]`),
    norms in F32; a tied LM head left out, as llama.cpp does. `metadata_from`: the fixture
    folder whose config and tokenizer the file carries too (one `neuronpy serve` can serve);
    else tensors only."""
    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    if metadata_from is not None:
        add_fixture_metadata(writer, metadata_from)
    writer.add_block_count(config.num_hidden_layers)
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


def checkpoint(path: Path, hf_model: Any, dtype: torch.dtype = torch.float32) -> GGUFCheckpoint:
    """A tensors-only GGUF file read as the loader reads one, with the model's own config."""
    config = hf_model.config
    return GGUFCheckpoint(
        path,
        config=config,
        generation_config=transformers.GenerationConfig.from_model_config(config),
        dtype=dtype,
        fingerprint=path.name,
        permute=(config.num_attention_heads, config.num_key_value_heads),
    )


def dequantized_model(path: Path, hf_model: Any) -> Any:
    """A copy of `hf_model` holding the file's dequantized weights (the reference)."""
    from gguf import GGUFReader

    model = type(hf_model)(hf_model.config).eval()
    config = hf_model.config
    reader = GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    state = {}
    for name, tensor in hf_model.state_dict().items():
        source = gguf_name(name)
        if name == "lm_head.weight" and source not in by_name:
            source = "token_embd.weight"
        t = by_name[source]
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tensor.shape)
        if name.endswith(("q_proj.weight", "k_proj.weight")) and t.name == source:
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            dim = w.shape[0] // heads // 2
            w = w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        state[name] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    model.load_state_dict(state)
    return model
