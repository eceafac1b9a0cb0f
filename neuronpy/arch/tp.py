"""Tensor-parallel shards of a Llama-family model: rank r of N holds 1/N of every projection.

The split itself is arch/weights.py's; a shard is a LlamaModel over one rank's weights whose
`reduce` (an all-reduce over the ranks) completes the row-parallel projections' partial sums
before each residual add, so every rank holds the full hidden state again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from neuronpy.arch.llama import LlamaModel
from neuronpy.arch.weights import TensorParallelError, take_weights


def shard_from_hf(
    hf_model: Any,
    rank: int,
    world_size: int,
    *,
    quantize: str = "none",
    calibration_ids: Sequence[int] = (),
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    lm_head: bool = True,
) -> LlamaModel:
    """Rank `rank`'s shard of a loaded transformers `*ForCausalLM` (see take_weights for the
    split, `quantize`, `calibration_ids` and `lm_head`). `reduce` sums a tensor over the ranks
    (in place or not); it is required when world_size > 1."""
    if world_size > 1 and reduce is None:
        raise TensorParallelError("a model split over several ranks needs an all-reduce")
    weights = take_weights(
        hf_model,
        rank,
        world_size,
        quantize=quantize,
        calibration_ids=calibration_ids,
        lm_head=lm_head,
    )
    model = LlamaModel.from_weights(weights)
    model.reduce = reduce if world_size > 1 else None
    return model
