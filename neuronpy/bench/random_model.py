"""Random-weight models of a real model's shape, for `neuronpy bench --model DIR` where the
weights themselves are not at hand: decode speed depends on the shapes, not the values.

    python -m neuronpy.bench.random_model gemma3-270m /tmp/gemma3-270m
    python -m neuronpy.bench.random_model qwen3-moe-small /tmp/qwen3-moe-small
    python -m neuronpy.bench.random_model qwen3.5-0.8b /tmp/qwen3.5-0.8b
    neuronpy bench --model /tmp/gemma3-270m --k 1,8 --peers none

The tokenizer is the default model's (SmolLM2's, 49,152 entries); the model keeps its own
vocabulary size (Gemma 3's 262,144: the LM head's cost is part of its shape), and the ids past
the tokenizer's decode to nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

GEMMA3_LAYERS = 18


def _gemma3_270m() -> Any:
    from transformers import Gemma3TextConfig

    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
    return Gemma3TextConfig(
        vocab_size=262144,
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=GEMMA3_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        layer_types=types,
        max_position_embeddings=32768,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        tie_word_embeddings=True,
    )


def _qwen3_moe_small() -> Any:
    """Qwen3-30B-A3B's layout (GQA, q/k norms, top-8 of 128 experts) scaled to fit a small
    machine: 8 layers, hidden 1024, 32 experts of 256, 4 per token."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=49152,
        hidden_size=1024,
        intermediate_size=3072,
        moe_intermediate_size=256,
        num_experts=32,
        num_experts_per_tok=4,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        norm_topk_prob=True,
    )


def _qwen3_5_0_8b() -> Any:
    """Qwen3.5-0.8B's shape: 24 layers, three Gated DeltaNet layers (16 heads of 128) to one
    gated attention layer (8 query heads, 2 KV heads of 256, a quarter of each rotated),
    hidden 1024, MLP 3584, its 248,320-token vocabulary, tied."""
    from transformers import Qwen3_5TextConfig

    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(24)]
    return Qwen3_5TextConfig(
        vocab_size=248320,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=types,
        max_position_embeddings=32768,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
        },
        tie_word_embeddings=True,
    )


SHAPES = {
    "gemma3-270m": _gemma3_270m,
    "qwen3-moe-small": _qwen3_moe_small,
    "qwen3.5-0.8b": _qwen3_5_0_8b,
}


def build(shape: str, out: Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """Writes a random-weight model of `shape` (SHAPES) and the default model's tokenizer."""
    from transformers import AutoModelForCausalLM

    from neuronpy.loading import _gguf_metadata, default_cache_dir, default_model_path

    torch.manual_seed(seed)
    config = SHAPES[shape]()
    config.eos_token_id = config.pad_token_id = 2
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    _, tokenizer = _gguf_metadata(default_model_path(), default_cache_dir(), lambda _: None)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    print(build(args.shape, args.out))


if __name__ == "__main__":
    main(sys.argv[1:])
