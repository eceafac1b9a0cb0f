"""`neuronpy eval`: what a quantization mode costs in quality and saves in memory, on one
fixed text (eval_text.txt, ~900 tokens of plain English prose written for this purpose).

Perplexity is exp(mean negative log-likelihood of each token given the ones before it), one
prefill over the whole text. Every mode is compared with the float32 model computing on the
checkpoint's dequantized weights (`--quantize none --dtype float32`): the model as stored,
without any further rounding."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from neuronpy.arch.llama import LlamaModel
from neuronpy.compose import load_source, native_model
from neuronpy.config import EngineConfig, ModelSpec
from neuronpy.defaults import DTYPES, QUANTIZE_MODES

EVAL_TEXT = resources.files("neuronpy.bench").joinpath("eval_text.txt").read_text("utf-8")


def perplexity(model: LlamaModel, token_ids: Sequence[int]) -> float:
    """The model's perplexity on `token_ids` (at least two), in one prefill."""
    ids = list(token_ids)
    if len(ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    with torch.inference_mode():
        _, hidden = model.prefill(ids)
        logprobs = model.logits(hidden[:-1]).log_softmax(-1)
        nll = -logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    return math.exp(nll)


def add_parser(subparsers: Any) -> None:
    """Adds the `eval` subcommand to a `neuronpy` argparse subparsers object."""
    parser = subparsers.add_parser(
        "eval",
        help="perplexity and weight memory of quantization modes",
        description=(__doc__ or "").split("\n\n")[0],
    )
    parser.add_argument(
        "--model",
        help="a .gguf file, model directory or hub id (default: the bundled SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--quantize",
        default="auto,none",
        help=f"modes to evaluate, separated by commas (of {', '.join(QUANTIZE_MODES)})",
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16,float32",
        help=f"dtypes to compute in, separated by commas (of {', '.join(DTYPES[1:])})",
    )
    parser.add_argument("--text", type=Path, help="a UTF-8 text file (default: the bundled one)")


def _load(spec: str | None, mode: str, dtype: str) -> tuple[LlamaModel, Any]:
    """The model `neuronpy serve --quantize mode --dtype dtype` serves (the int8 mode
    calibrated as it is there), its layers run eagerly."""
    model_spec = ModelSpec(
        path=spec, dtype=dtype, device="cpu", engine=EngineConfig(quantize=mode, compile="off")
    )
    source, tokenizer = load_source(model_spec, lambda _: None)
    return native_model(source, tokenizer, name=mode, config=model_spec.engine), tokenizer


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.quantize.split(",") if m.strip()]
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    bad = [m for m in modes if m not in QUANTIZE_MODES] + [d for d in dtypes if d not in DTYPES]
    if bad:
        raise SystemExit(f"neuronpy eval: unknown mode or dtype: {', '.join(bad)}")
    text = args.text.read_text("utf-8") if args.text else EVAL_TEXT
    reference, tokenizer = _load(args.model, "none", "float32")
    ids = tokenizer.encode(text)[: reference.config.context_len]
    base = perplexity(reference, ids)
    print(
        f"{len(ids)} tokens; reference (none, float32): perplexity {base:.3f}, weights "
        f"{reference.weight_bytes() / 2**20:.1f} MiB"
    )
    print(f"{'mode':<12} {'dtype':<9} {'perplexity':>10} {'vs ref':>8} {'weights':>11} {'load':>7}")
    del reference
    for mode in modes:
        for dtype in dtypes:
            started = time.perf_counter()
            model, _ = _load(args.model, mode, dtype)
            load = time.perf_counter() - started
            ppl = perplexity(model, ids)
            print(
                f"{mode:<12} {dtype:<9} {ppl:>10.3f} {ppl / base - 1:>+8.2%} "
                f"{model.weight_bytes() / 2**20:>7.1f} MiB {load:>6.1f}s  "
                f"{model.describe_weights()}",
                flush=True,
            )
    return 0
