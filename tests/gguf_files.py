"""Tiny GGUF files written at test time from a transformers model: the writer and its
encoders are the bench's (neuronpy/bench/gguf_files.py: llama.cpp's layout, any type neuronpy
reads, each preset's type mix), and here the readers' side: a file read as the loader reads
one, the reference model holding its dequantized weights. And metadata-only files: a
fixture's config and tokenizer, or a 1B-class model's with a synthetic 49k-token vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers

from neuronpy.arch.gguf import GGUFCheckpoint
from neuronpy.bench.gguf_files import (
    K_ENCODERS,
    PRESETS,
    add_fixture_metadata,
    add_fixture_tokenizer,
    encode,
    gguf_name,
    preset_type,
    preset_types,
    quantize_q4_k,
    write_gguf,
    write_preset,
)

__all__ = [
    "K_ENCODERS",
    "PRESETS",
    "add_fixture_metadata",
    "add_fixture_tokenizer",
    "checkpoint",
    "dequantized_model",
    "encode",
    "preset_type",
    "preset_types",
    "quantize_q4_k",
    "write_fixture_metadata",
    "write_gguf",
    "write_large_vocab_gguf",
    "write_preset",
]


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


_SPECIAL, _NORMAL = 3, 1  # llama.cpp's token types: control, normal


def _write(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_fixture_metadata(
    path: Path,
    fixture: Path,
    arch: str = "llama",
    *,
    name: str | None = None,
    pre: str = "default",
    with_vocab_size: bool = True,
    untied_head: bool = False,
) -> Path:
    """A fixture's config and byte-level BPE tokenizer as llama.cpp's converter writes them into
    a GGUF file of architecture `arch`, without weights: only an `output.weight` (a tiny F32
    placeholder) where `untied_head`, which is all the config reads of the tensors."""
    cfg = json.loads((fixture / "config.json").read_text())
    tok = json.loads((fixture / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(str(path), arch)
    if name is not None:
        writer.add_name(name)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    if with_vocab_size:
        writer.add_vocab_size(cfg["vocab_size"])
    tokens = [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])]
    special = {added["id"] for added in tok["added_tokens"] if added["special"]}
    for added in tok["added_tokens"]:
        tokens[added["id"]] = added["content"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([_SPECIAL if i in special else _NORMAL for i in range(len(tokens))])
    writer.add_token_merges(
        [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    )
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template((fixture / "chat_template.jinja").read_text())
    if untied_head:
        writer.add_tensor("output.weight", np.zeros((4, 32), dtype=np.float32))
    _write(writer)
    return path


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: each byte as the printable character its BPE spells it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


SMOLLM_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_large_vocab_gguf(path: Path, vocab_size: int = 49152, seed: int = 0) -> Path:
    """A 1B-class Llama model's metadata (SmolLM2-1.7B's shape) with a synthetic byte-level BPE
    vocabulary of `vocab_size` tokens, as llama.cpp writes one, and no weights: 17 special
    tokens, the 256-byte alphabet, then merges, each joining two tokens into a new one (letters
    and the space marker mostly, so that ordinary text meets them). Deterministic in `seed`."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    specials += [f"<reserved_{i}>" for i in range(17 - len(specials))]
    alphabet = _byte_alphabet()
    tokens = specials + alphabet
    known = set(tokens)
    # what merges start from: lowercase and capital letters, the space marker, digits, and a
    # few punctuation marks, lowercase letters weighted up as in text
    seeds = list("abcdefghijklmnopqrstuvwxyz") * 4 + list("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    seeds += ["\u0120"] * 20 + list("0123456789.,'-")
    pool = list(seeds)  # tokens new merges draw on: the seeds and what merges made of them
    merges = []
    rng = np.random.default_rng(seed)
    while len(tokens) < vocab_size:
        left = rng.integers(len(pool), size=4096)
        right = rng.integers(len(seeds), size=4096)
        for i, j in zip(left.tolist(), right.tolist(), strict=True):
            a, b = pool[i], seeds[j]
            joined = a + b
            if joined in known or len(joined) > 12 or len(tokens) >= vocab_size:
                continue
            known.add(joined)
            tokens.append(joined)
            pool.append(joined)
            merges.append(f"{a} {b}")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("Synthetic 1.7B")
    writer.add_context_length(8192)
    writer.add_embedding_length(2048)
    writer.add_block_count(24)
    writer.add_feed_forward_length(8192)
    writer.add_head_count(32)
    writer.add_head_count_kv(32)
    writer.add_rope_freq_base(130000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_vocab_size(vocab_size)
    writer.add_rope_dimension_count(64)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([_SPECIAL if i < len(specials) else _NORMAL for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(SMOLLM_TEMPLATE)
    _write(writer)
    return path
