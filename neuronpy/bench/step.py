"""One decode step timed directly on the model: F.linear vs packed oneDNN vs int8, side by side.

python -m neuronpy.bench.step [--batch 1,8,16] [--context 128] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from neuronpy.arch.calibration import CALIBRATION_TEXT
from neuronpy.arch.kv import assemble_batch
from neuronpy.arch.llama import LlamaModel
from neuronpy.loading import load_pretrained


def variants(hf_model: object, calibration: list[int]) -> dict[str, LlamaModel]:
    """The same weights three ways (NEURON_ONEDNN is read when a layer is built)."""
    previous = os.environ.get("NEURON_ONEDNN")
    try:
        os.environ["NEURON_ONEDNN"] = "0"
        plain = LlamaModel.from_hf(hf_model)
        os.environ["NEURON_ONEDNN"] = "1"
        packed = LlamaModel.from_hf(hf_model)
    finally:
        if previous is None:
            os.environ.pop("NEURON_ONEDNN", None)
        else:
            os.environ["NEURON_ONEDNN"] = previous
    int8 = LlamaModel.from_hf(hf_model, quantize="int8", calibration_ids=calibration)
    return {"F.linear": plain, "oneDNN packed": packed, "int8": int8}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--batch", default="1,8,16")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    weights = load_pretrained(args.model, dtype="float32", device="cpu")
    calibration = weights.tokenizer.encode(CALIBRATION_TEXT)
    models = variants(weights.hf_model, calibration)
    prompt = list(range(100, 100 + args.context))
    print(f"decode step, context {args.context}, tokens/s over the batch (median of {args.steps})")
    for size in (int(b) for b in args.batch.split(",")):
        tokens = torch.full((size, 1), 5)
        batches = {k: assemble_batch([m.prefill(prompt)[0]] * size) for k, m in models.items()}
        times: dict[str, list[float]] = {k: [] for k in models}
        for step in range(args.steps + 2):  # interleaved, so noise hits every variant alike
            for name, model in models.items():
                began = time.perf_counter()
                model.logits(model.forward_batch_decode(batches[name], tokens))
                if step >= 2:
                    times[name].append(time.perf_counter() - began)
        row = "  ".join(f"{k} {size / sorted(v)[len(v) // 2]:.1f}" for k, v in times.items())
        print(f"B={size}: {row}", flush=True)


if __name__ == "__main__":
    main()
