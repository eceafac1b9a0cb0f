"""What a benchmark run depends on (`BenchConfig`, written into the results), its --quick
sizes, and where its progress lines go."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from neuronpy.bench.systems import PEERS


@dataclass(frozen=True)
class BenchConfig:
    """Everything a run depends on (written into the JSON)."""

    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    dtype: str = "auto"
    device: str = "auto"
    max_in_flight: int | None = None  # None: the largest K (at least 8 for W2-W4)
    quantize: str | None = None  # neuronpy's weight mode, where the engine has one ("int8")
    chunk_steps: float | None = None  # neuronpy's EngineConfig.chunk_steps (None: its default)
    tensor_parallel: int = 1  # ranks neuronpy's model is split over (> 1 adds a 1-device peer)
    workloads: tuple[str, ...] = ("W1",)
    ks: tuple[int, ...] = (1, 2, 4, 8, 16)
    prompt_len: int = 128
    output_len: int = 128
    repeats: int = 3
    peers: tuple[str, ...] = PEERS
    drive: str = "engine"  # "engine" (in-process) or "http"
    url: str | None = None  # drive == "http": a running server; None: start one on loopback
    seed: int = 0
    w2_loads: tuple[float, ...] = (0.25, 0.5, 0.75, 0.9)
    requests: int = 32  # W2 and W3
    prompt_range: tuple[int, int] = (32, 512)  # W2 and W3
    output_range: tuple[int, int] = (16, 256)  # W2 and W3
    long_prompt: int = 2000  # W4
    w4_decode_len: int = 256  # W4: enough tokens for the decoders to outlast the join
    cb_max_batch_tokens: int = 512  # transformers' continuous batching: tokens per forward
    # neuronpy with speculative decoding ("ngram") beside it, as neuronpy-spec; None: not run
    speculative: str | None = None
    num_speculative_tokens: int | None = None
    quick: bool = False

    def resolved_max_in_flight(self) -> int:
        if self.max_in_flight is not None:
            return self.max_in_flight
        need = max(self.ks)
        if set(self.workloads) & {"W2", "W3", "W4"}:
            need = max(need, 8)
        return need


def quick_config(**overrides: Any) -> BenchConfig:
    """Small sizes for a smoke run (minutes on a laptop CPU)."""
    base = BenchConfig(
        ks=(1, 2),
        prompt_len=32,
        output_len=16,
        repeats=1,
        w2_loads=(0.75,),
        requests=8,
        prompt_range=(16, 64),
        output_range=(8, 32),
        long_prompt=256,
        w4_decode_len=48,
        quick=True,
    )
    return dataclasses.replace(base, **overrides)


@dataclass
class Progress:
    """Where progress lines go (stderr by default; tests pass a no-op)."""

    write: Callable[[str], None] = field(
        default=lambda line: print(line, file=sys.stderr, flush=True)
    )
