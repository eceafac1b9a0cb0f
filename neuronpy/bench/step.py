"""The model alone: one decode step at B rows, for each weight mode, against its floor (the
weights' bytes over this machine's measured read bandwidth: a step cannot read them faster).

    python -m neuronpy.bench.step --model /tmp/llama1b-Q4_K_M.gguf --modes auto,int8
    python -m neuronpy.bench.step --model /tmp/llama1b --modes none --batch 1,8,16

Each mode's model is built as `neuronpy serve --quantize MODE` builds it (compiled as
`--compile` says, the default `auto`), one at a time. The step is `forward_batch_decode` and the
logits on a batch of B copies of a `--context`-token prompt, the median of `--steps`; no server,
no sampling, no rebatching: what the weights and the attention cost.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import dataclass

import torch

from neuronpy.arch.kv import assemble_batch
from neuronpy.arch.llama import LlamaModel
from neuronpy.compose import load_source, native_model
from neuronpy.config import EngineConfig, ModelSpec

BANDWIDTH_BYTES = 2 << 30  # past any cache this machine's CPU reports (here: 480 MiB of L3)


def read_bandwidth(nbytes: int = BANDWIDTH_BYTES, repeats: int = 5) -> float:
    """Bytes a second this machine's cores read from memory, all threads (torch's sum over a
    buffer far larger than the caches; the best of `repeats`)."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - began)
    return nbytes / best


@dataclass(frozen=True)
class StepTimes:
    mode: str
    weights: str  # what the load log says they became
    weight_bytes: int
    ms: dict[int, float]  # B -> the median step, milliseconds


def time_steps(model: LlamaModel, batches: list[int], context: int, steps: int) -> dict[int, float]:
    prompt = list(range(100, 100 + context))
    snapshot = model.prefill(prompt)[0]
    times: dict[int, float] = {}
    for size in batches:
        batch = assemble_batch([snapshot] * size)
        tokens = torch.full((size, 1), 5)
        samples = []
        for step in range(steps + 2):  # two warm-up steps
            began = time.perf_counter()
            model.logits(model.forward_batch_decode(batch, tokens))
            if step >= 2:
                samples.append(time.perf_counter() - began)
        times[size] = statistics.median(samples) * 1e3
    return times


def measure(
    model_path: str | None,
    mode: str,
    batches: list[int],
    *,
    context: int = 128,
    steps: int = 10,
    dtype: str = "auto",
    compile: str = "auto",
) -> StepTimes:
    spec = ModelSpec(
        path=model_path,
        dtype=dtype,
        device="cpu",
        engine=EngineConfig(quantize=mode, compile=compile),
    )
    source, tokenizer = load_source(spec, lambda message: None)
    model = native_model(source, tokenizer, name=mode, config=spec.engine)
    del source
    gc.collect()
    with torch.inference_mode():
        ms = time_steps(model, batches, context, steps)
    return StepTimes(mode, model.describe_weights(), model.weight_bytes(), ms)


def table(results: list[StepTimes], batches: list[int], bandwidth: float) -> str:
    head = ["mode", "weights MiB", "floor ms"] + [f"B={b} ms (x floor)" for b in batches]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        floor = r.weight_bytes / bandwidth * 1e3
        cells = [f"{r.ms[b]:.1f} ({r.ms[b] / floor:.2f}x)" for b in batches]
        lines.append(
            f"| {r.mode} | {r.weight_bytes / 2**20:.0f} | {floor:.1f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--modes", default="auto", help="weight modes, comma-separated")
    parser.add_argument("--batch", default="1,8,16")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--compile", default="auto", choices=("auto", "on", "off"))
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; context {args.context}", flush=True)
    results = []
    for mode in args.modes.split(","):
        result = measure(
            args.model,
            mode,
            batches,
            context=args.context,
            steps=args.steps,
            dtype=args.dtype,
            compile=args.compile,
        )
        print(
            f"{mode}: {result.weights}; "
            + ", ".join(f"B={b} {t:.1f} ms" for b, t in result.ms.items()),
            flush=True,
        )
        results.append(result)
        gc.collect()
    print(table(results, batches, bandwidth))


if __name__ == "__main__":
    main()
