"""`python -m neuronpy.bench.gpu`: neuronpy on one GPU, on an 8B-shaped Llama with random
weights (decode speed does not depend on their values), against the card's memory bandwidth
and against transformers' continuous batching (`generate_batch`) on the same card, same run.

It reports K=1 decode tokens/s as a share of the roofline (the measured device-to-device copy
bandwidth over the bytes of weights a step reads) and W1 at each K for neuronpy and
`hf-generate-batch`. `--shape tiny --device cpu` runs the same code in seconds (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from neuronpy.bench.config import BenchConfig, Progress
from neuronpy.bench.lineup import Weights
from neuronpy.bench.results import BenchResults
from neuronpy.bench.runner import run_bench
from neuronpy.bench.systems import HF_CB, NEURONPY

SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.1-8B's shape
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=1024,
    ),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TARGET_ROOFLINE_SHARE = 0.60  # K=1 decode, of the bandwidth roofline
TARGET_K64_RATIO = 2.0  # neuronpy / generate_batch at K=64


def random_llama(shape: str, device: str, dtype: torch.dtype, seed: int = 0) -> Any:
    """A Llama of `shape` with random weights (N(0, 0.02)), built on `device` directly."""
    config = LlamaConfig(**SHAPES[shape], tie_word_embeddings=False, eos_token_id=1)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A tokenizer of `vocab_size` words `t0`, `t1`, ... (one per id), so that any id the
    random model writes decodes."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", eos_token="t1")


def copy_bandwidth(device: str, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy (read and write both counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    began = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * repeats / (time.perf_counter() - began)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def weight_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def report(results: BenchResults, bandwidth: float, nbytes: int) -> tuple[str, dict[str, Any]]:
    """The table, and the figures against the targets."""
    points = results.workloads["W1"].points
    roofline = bandwidth / nbytes  # steps/s if a step only read every weight once
    lines = [
        f"weights {nbytes / 1e9:.2f} GB, copy bandwidth {bandwidth / 1e9:.0f} GB/s: "
        f"roofline {roofline:.1f} tokens/s at K=1",
        "K      neuronpy tok/s   generate_batch tok/s   ratio",
    ]
    summary: dict[str, Any] = {"roofline_tok_s": roofline, "bandwidth_bytes_s": bandwidth}
    for p in points:
        k = p.params["k"]
        ours, theirs = p.rate(NEURONPY), p.rate(HF_CB)
        ratio = ours / theirs if ours and theirs else None
        shown = [f"{v:.1f}" if v else "-" for v in (ours, theirs)]
        lines.append(
            f"{k:<6} {shown[0]:>14}   {shown[1]:>20}   {f'{ratio:.2f}x' if ratio else '-':>5}"
        )
        if k == 1 and ours:
            summary["k1_roofline_share"] = ours / roofline
        if k == 64 and ratio:
            summary["k64_ratio"] = ratio
    share = summary.get("k1_roofline_share")
    if share is not None:
        met = "met" if share >= TARGET_ROOFLINE_SHARE else "not met"
        lines.append(
            f"K=1: {share:.0%} of the roofline (target {TARGET_ROOFLINE_SHARE:.0%}: {met})"
        )
    if "k64_ratio" in summary:
        met = "met" if summary["k64_ratio"] >= TARGET_K64_RATIO else "not met"
        ratio = summary["k64_ratio"]
        lines.append(f"K=64: {ratio:.2f}x generate_batch (target {TARGET_K64_RATIO:g}x: {met})")
    return "\n".join(lines), summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m neuronpy.bench.gpu", description=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--k", default="1,2,4,8,16,32,64,128,256", help="concurrencies")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--peers", default=HF_CB, help=f"{HF_CB} or none")
    parser.add_argument("--out", type=Path, default=None, help="a JSON file for the results")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: nothing measured", file=sys.stderr)
        return 2
    progress = Progress()
    ks = tuple(int(k) for k in args.k.split(","))
    model = random_llama(args.shape, args.device, DTYPES[args.dtype])
    tokenizer = word_tokenizer(model.config.vocab_size)
    nbytes = weight_bytes(model)
    bandwidth = copy_bandwidth(args.device, nbytes=min(1 << 30, max(1 << 20, nbytes)))
    config = BenchConfig(
        device=args.device,
        dtype=args.dtype,
        ks=ks,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        repeats=1,
        peers=() if args.peers == "none" else (args.peers,),
        max_in_flight=max(ks),
    )
    weights = Weights(model, tokenizer, f"random-llama-{args.shape}", "random weights")
    results = run_bench(config, weights=weights, progress=progress, argv=argv)
    text, summary = report(results, bandwidth, nbytes)
    print(text)
    if args.out is not None:
        args.out.write_text(
            json.dumps({"summary": summary, "bench": results.to_json()}, default=str)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
