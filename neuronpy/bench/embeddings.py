"""`neuronpy bench --embeddings`: embedding throughput, neuronpy's engine against transformers'
own forward of the same weights, in one process and one run.

For each batch size, the same random-token inputs go through both: neuronpy's `Engine.embed`
(packed, no padding; engine/embeddings.py) and transformers' decoder (`model.model`, the
inputs right-padded with an attention mask, pooled as the engine pools). Each point is the
median of `repeats` timed calls after one warm-up; the vectors of the two are compared once, so
that the figures are of the same computation."""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.nn.functional as F

from neuronpy.config import EngineConfig
from neuronpy.engine.embeddings import Pooling

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_LENGTH = "128"


@dataclasses.dataclass(frozen=True)
class EmbedPoint:
    """One batch size: its inputs' tokens and each system's median seconds for the batch."""

    batch: int
    tokens: int
    neuronpy_s: float
    transformers_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "tokens": self.tokens,
            "neuronpy": {"seconds": self.neuronpy_s, **_rates(self, self.neuronpy_s)},
            "transformers": {"seconds": self.transformers_s, **_rates(self, self.transformers_s)},
            "ratio": self.transformers_s / self.neuronpy_s,
        }


def _rates(point: EmbedPoint, seconds: float) -> dict[str, float]:
    return {"inputs_per_s": point.batch / seconds, "tokens_per_s": point.tokens / seconds}


@dataclasses.dataclass(frozen=True)
class EmbedResults:
    model: str
    dtype: str
    lengths: str
    pooling: Pooling
    min_cosine: float  # the two systems' vectors, the largest batch
    points: tuple[EmbedPoint, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "dtype": self.dtype,
            "input_lengths": self.lengths,
            "pooling": dataclasses.asdict(self.pooling),
            "min_cosine": self.min_cosine,
            "points": [p.to_json() for p in self.points],
        }


def parse_lengths(text: str) -> tuple[int, int]:
    """`N` (every input N tokens) or `LO-HI` (each drawn uniformly in that range)."""
    lo, _, hi = text.partition("-")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"input lengths are N or LO-HI, got {text!r}") from None
    if not 1 <= low <= high:
        raise ValueError(f"input lengths must be 1 <= LO <= HI, got {text!r}")
    return low, high


def random_inputs(
    count: int, lengths: tuple[int, int], vocab: int, avoid: set[int], seed: int
) -> list[list[int]]:
    """`count` inputs of random ids (none of `avoid`: the special tokens), of random lengths
    in `lengths`, the same for the same seed."""
    rng = random.Random(seed)
    ids = [i for i in range(vocab) if i not in avoid]
    return [[rng.choice(ids) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def transformers_embed(decoder: Any, inputs: list[list[int]], pooling: Pooling) -> torch.Tensor:
    """transformers' forward of `inputs` as one right-padded batch, pooled as `pooling`."""
    longest = max(len(x) for x in inputs)
    ids = torch.zeros(len(inputs), longest, dtype=torch.long)
    mask = torch.zeros(len(inputs), longest, dtype=torch.long)
    for row, x in enumerate(inputs):
        ids[row, : len(x)] = torch.tensor(x)
        mask[row, : len(x)] = 1
    with torch.inference_mode():
        hidden = decoder(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    lengths = mask.sum(1)
    if pooling.mode == "last":
        out = hidden[torch.arange(len(inputs)), lengths - 1]
    elif pooling.mode == "cls":
        out = hidden[:, 0]
    else:
        out = (hidden * mask[..., None]).sum(1) / lengths[:, None]
    return F.normalize(out, dim=-1) if pooling.normalize else out


def _median_seconds(fn: Any, repeats: int) -> tuple[float, Any]:
    fn()  # warm-up (the compiled graph, the allocator)
    times, out = [], None
    for _ in range(repeats):
        began = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times), out


def run_embedding_bench(
    model: str | None,
    *,
    dtype: str = "float32",
    quantize: str = "none",
    batches: Sequence[int] = DEFAULT_BATCHES,
    lengths: str = DEFAULT_LENGTH,
    repeats: int = 3,
    seed: int = 0,
    log: Any = print,
) -> EmbedResults:
    """The benchmark (see the module's docstring) of the checkpoint `model` (None: the
    default model), both systems on the same loaded weights in `dtype`."""
    from neuronpy.compose import engine_from_hf
    from neuronpy.loading import load_pretrained

    span = parse_lengths(lengths)
    weights = load_pretrained(model, dtype=dtype)
    hf, tokenizer = weights.hf_model, weights.tokenizer
    config = EngineConfig(quantize=quantize, max_queue=max(batches))
    engine = engine_from_hf(hf, tokenizer, name=weights.name, config=config)
    pooling = engine.embedder.pooling
    decoder = hf.model  # the decoder without its head: last_hidden_state
    avoid = set(tokenizer.all_special_ids)
    points: list[EmbedPoint] = []
    min_cosine = 1.0

    async def measure() -> None:
        nonlocal min_cosine
        async with engine:
            for batch in batches:
                inputs = random_inputs(batch, span, engine.vocab_size, avoid, seed + batch)
                tokens = sum(len(x) for x in inputs)
                ours, mine = await _median_async(engine, inputs, repeats)
                forward = functools.partial(transformers_embed, decoder, inputs, pooling)
                theirs, reference = await anyio.to_thread.run_sync(
                    _median_seconds, forward, repeats
                )
                got = torch.stack(mine)
                min_cosine = min(min_cosine, F.cosine_similarity(got, reference).min().item())
                point = EmbedPoint(batch, tokens, ours, theirs)
                points.append(point)
                log(
                    f"batch {batch:3d}: neuronpy {batch / ours:8.1f} inputs/s, transformers "
                    f"{batch / theirs:8.1f} inputs/s ({theirs / ours:.2f}x)"
                )

    anyio.run(measure)
    return EmbedResults(weights.name, str(hf.dtype), lengths, pooling, min_cosine, tuple(points))


async def _median_async(
    engine: Any, inputs: list[list[int]], repeats: int
) -> tuple[float, list[torch.Tensor]]:
    await engine.embed(inputs)  # warm-up
    times, out = [], []
    for _ in range(repeats):
        began = time.perf_counter()
        out = await engine.embed(inputs)
        times.append(time.perf_counter() - began)
    return statistics.median(times), out


def format_table(results: EmbedResults) -> str:
    """The results as the table `neuronpy bench --embeddings` prints."""
    lines = [
        f"embeddings: {results.model} ({results.dtype}), inputs of {results.lengths} tokens, "
        f"pooling {results.pooling.mode}{', normalized' if results.pooling.normalize else ''}",
        f"the two systems' vectors agree to a cosine of {results.min_cosine:.6f} or more",
        "",
        f"{'batch':>5}  {'neuronpy in/s':>13}  {'tok/s':>9}  {'transformers in/s':>17}  "
        f"{'tok/s':>9}  {'ratio':>6}",
    ]
    for p in results.points:
        lines.append(
            f"{p.batch:>5}  {p.batch / p.neuronpy_s:>13.1f}  {p.tokens / p.neuronpy_s:>9.0f}  "
            f"{p.batch / p.transformers_s:>17.1f}  {p.tokens / p.transformers_s:>9.0f}  "
            f"{p.transformers_s / p.neuronpy_s:>5.2f}x"
        )
    return "\n".join(lines) + "\n"


def write_json(results: EmbedResults, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results.to_json(), indent=2) + "\n")
    return path
