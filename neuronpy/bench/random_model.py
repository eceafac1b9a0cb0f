"""Random-weight models of a real model's shape, for `neuronpy bench --model DIR` where the
weights themselves are not at hand: decode speed depends on the shapes, not the values.

    python -m neuronpy.bench.random_model gemma3-270m /tmp/gemma3-270m
    python -m neuronpy.bench.random_model qwen3-moe-small /tmp/qwen3-moe-small
    python -m neuronpy.bench.random_model qwen3.5-0.8b /tmp/qwen3.5-0.8b
    python -m neuronpy.bench.random_model llama3.2-1b /tmp/llama1b --gguf Q4_K_M,Q8_0
    neuronpy bench --model /tmp/gemma3-270m --k 1,8 --peers none
    neuronpy bench --model /tmp/llama1b-Q4_K_M.gguf --k 1,8,16 --peers none
    python -m neuronpy.bench.serving --server ... --server ...   # against llama-server, vLLM

`--gguf` writes the same weights as GGUF files beside the directory (`/tmp/llama1b-Q4_K_M.gguf`),
in the type mix llama.cpp's `llama-quantize` gives each preset (Q4_K_M: Q4_K, with Q6_K for the
tied embedding and for attn_v and ffn_down in the layers it gives more bits), tokenizer and
chat template included, so that llama-server, vLLM and neuronpy all serve one file. Only the
Llama-family shapes have a GGUF layout here.

The tokenizer is the default model's (SmolLM2's, 49,152 entries); the model keeps its own
vocabulary size (Gemma 3's 262,144: the LM head's cost is part of its shape), and the ids past
the tokenizer's decode to nothing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
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


def _llama(layers: int, hidden: int, mlp: int, tied: bool) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=hidden // 32,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=tied,
    )


def _llama3_2_1b() -> Any:
    """Llama-3.2-1B's shape with SmolLM2's vocabulary (1.07B parameters): 16 layers, hidden
    2048, MLP 8192, 32 query heads and 8 KV heads of 64, tied. The size people serve on a CPU;
    its step is its weights, where the default model's is mostly fixed cost."""
    return _llama(16, 2048, 8192, tied=True)


def _llama3_1_8b() -> Any:
    """Llama-3.1-8B's shape with SmolLM2's vocabulary (7.4B parameters): 32 layers, hidden
    4096, MLP 14336, 32 query heads and 8 KV heads of 128, an untied head. For the GPU bench:
    about 14.8 GB in bf16."""
    return _llama(32, 4096, 14336, tied=False)


SHAPES = {
    "llama3.2-1b": _llama3_2_1b,
    "llama3.1-8b": _llama3_1_8b,
    "gemma3-270m": _gemma3_270m,
    "qwen3-moe-small": _qwen3_moe_small,
    "qwen3.5-0.8b": _qwen3_5_0_8b,
}


GGUF_PRESETS = ("Q4_K_M", "Q8_0")


def gguf_path(out: Path, preset: str) -> Path:
    """Where `build` writes the `preset` GGUF file of the model in directory `out`."""
    return out.parent / f"{out.name}-{preset}.gguf"


def build(
    shape: str,
    out: Path,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    gguf: Sequence[str] = (),
    config: Any | None = None,
) -> list[Path]:
    """Writes a random-weight model of `shape` (SHAPES; or `config`, a transformers config, for
    a shape of the caller's) and the default model's tokenizer to directory `out`, and the same
    weights as a GGUF file in each preset of `gguf` (GGUF_PRESETS) beside it. Returns the paths
    written: the directory, then the files."""
    from transformers import AutoModelForCausalLM

    from neuronpy.bench.gguf_files import write_preset
    from neuronpy.loading import _gguf_metadata, default_cache_dir, default_model_path

    for preset in gguf:
        if preset not in GGUF_PRESETS:
            raise ValueError(f"GGUF preset {preset!r}: choose from {', '.join(GGUF_PRESETS)}")
    torch.manual_seed(seed)
    config = config if config is not None else SHAPES[shape]()
    if gguf and config.model_type != "llama":
        raise ValueError(f"{shape}: GGUF files are written for the Llama-family shapes only")
    config.eos_token_id = config.pad_token_id = 2
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    _, tokenizer = _gguf_metadata(default_model_path(), default_cache_dir(), lambda _: None)
    tokenizer.save_pretrained(out)
    written = [out]
    for preset in gguf:
        written.append(write_preset(gguf_path(out, preset), model, preset, tokenizer_dir=out))
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--gguf",
        default="",
        help=f"comma-separated GGUF presets to write beside OUT ({', '.join(GGUF_PRESETS)})",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    presets = [p for p in args.gguf.split(",") if p]
    for path in build(args.shape, args.out, seed=args.seed, gguf=presets):
        print(path)


if __name__ == "__main__":
    main(sys.argv[1:])
