"""A decode step of the native model against transformers' own `generate` on the same weights,
model alone (no server), at several batch sizes: for families whose cost is not yet known, as
the hybrids' fixed-size-state layers.

    python -m neuronpy.bench.versus --shape qwen3.5-0.8b --batch 1,8,16
    python -m neuronpy.bench.versus --model DIR

Both run in float32, eager, on the same random (or given) weights; each row of the batch has a
prompt of `--prompt` random tokens. neuronpy's figure is one lockstep step (the LM head
included); transformers' is its time per generated token, with `generate` run for one token
and for `--steps + 1` tokens, the difference divided by `--steps` (its prefill left out).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from neuronpy.arch.kv import assemble_batch
from neuronpy.arch.llama import LlamaModel


def step_seconds(model: LlamaModel, prompts: torch.Tensor, steps: int) -> float:
    """One lockstep decode step of these prompts' rows, averaged over `steps` after 3."""
    batch = assemble_batch([model.prefill(p.tolist())[0] for p in prompts])
    tokens = torch.full((prompts.shape[0], 1), 5)
    for _ in range(3):
        model.logits(model.forward_batch_decode(batch, tokens))
    began = time.perf_counter()
    for _ in range(steps):
        model.logits(model.forward_batch_decode(batch, tokens))
    return (time.perf_counter() - began) / steps


def generate_seconds(hf_model: Any, prompts: torch.Tensor, steps: int) -> float:
    """transformers' time per generated token (all rows), its prefill left out."""

    def timed(n: int) -> float:
        began = time.perf_counter()
        with torch.no_grad():
            hf_model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
            )
        return time.perf_counter() - began

    timed(2)  # warm
    # the fastest of three of each: a busy machine's pauses fall on one run, not on all three
    one = min(timed(1) for _ in range(3))
    more = min(timed(1 + steps) for _ in range(3))
    return max(more - one, 1e-9) / steps


def main(argv: Sequence[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM

    from neuronpy.bench.random_model import SHAPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--shape", choices=sorted(SHAPES), help="random weights of this shape")
    source.add_argument("--model", help="a Hugging Face checkpoint directory")
    parser.add_argument("--batch", default="1,8,16")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.shape:
        config = SHAPES[args.shape]()
        config.eos_token_id = config.pad_token_id = 2
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    native = LlamaModel.from_hf(hf)
    vocab = min(hf.config.vocab_size, 40000)
    print(f"{sum(p.numel() for p in hf.parameters()) / 1e9:.2f}B parameters, float32, eager")
    print("B   neuronpy step   transformers per token   ratio")
    for b in (int(x) for x in args.batch.split(",")):
        prompts = torch.randint(
            3, vocab, (b, args.prompt), generator=torch.Generator().manual_seed(b)
        )
        ours = step_seconds(native, prompts, args.steps)
        theirs = generate_seconds(hf, prompts, args.steps)
        print(
            f"{b:<3} {ours * 1e3:7.1f} ms ({b / ours:6.1f} tok/s)   "
            f"{theirs * 1e3:7.1f} ms ({b / theirs:6.1f} tok/s)   {theirs / ours:.3g}x"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
