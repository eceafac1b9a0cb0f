"""A transformers model's weights as the native model takes them: whole, or one rank's shard.

Tensor parallelism is a Megatron-style split, two all-reduces per layer:
- column-parallel (rows of the weight): the fused q/k/v, so that rank r computes its own
  attention heads, and the fused gate/up, so that it computes its own slice of the MLP;
- row-parallel (columns of the weight): o_proj and down read only that rank's heads / slice
  and produce a partial sum of the full output, which an all-reduce completes (arch/tp.py).
Embeddings and norms are replicated. The LM head is kept whole where logits are wanted (rank 0)
and dropped elsewhere: only rank 0 answers jobs, so a follower's logits would go unread. One
device is the split over one rank, so both paths take the weights the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from neuronpy.arch.config import ArchConfig, rope_inv_freq
from neuronpy.arch.linear import Int8Linear, Linear, make_linear
from neuronpy.errors import NeuronError

AnyLinear = Linear | Int8Linear


class TensorParallelError(NeuronError, ValueError):
    """A model that cannot be split over the requested number of ranks."""


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: AnyLinear  # hidden -> (H + 2*KVH) * D: q, k and v fused into one weight read
    q_norm: torch.Tensor | None  # Qwen3: [D]
    k_norm: torch.Tensor | None
    o_proj: AnyLinear  # H * D -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: AnyLinear  # hidden -> 2 * inter: gate and up fused
    down: AnyLinear  # inter -> hidden


@dataclass
class ModelWeights:
    """Everything LlamaModel computes with; `config` is the shard's (its local head counts)."""

    config: ArchConfig
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: Any  # AnyLinear, or a stand-in giving [..., 0] on ranks whose logits go unread
    inv_freq: torch.Tensor  # [D/2] float32
    rope_scale: float


def input_absmax(hf_model: Any, token_ids: Sequence[int]) -> dict[Any, torch.Tensor]:
    """Calibration: each nn.Linear's largest absolute input per channel over `token_ids`."""
    stats: dict[Any, torch.Tensor] = {}

    def record(module: Any, inputs: tuple[torch.Tensor, ...], _output: Any) -> None:
        x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).abs().amax(dim=0).float()
        stats[module] = torch.maximum(stats[module], x) if module in stats else x

    hooks = [
        m.register_forward_hook(record)
        for m in hf_model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    try:
        with torch.inference_mode():
            device = next(hf_model.parameters()).device
            hf_model(torch.tensor([list(token_ids)], device=device))
    finally:
        for hook in hooks:
            hook.remove()
    return stats


def check_divisible(config: ArchConfig, world_size: int) -> None:
    """Refuses a split that would cut an attention head, a KV group or the MLP unevenly."""
    if world_size < 1:
        raise TensorParallelError(f"tensor-parallel size must be at least 1, got {world_size}")
    counts = {
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "intermediate_size": config.intermediate_size,
    }
    bad = [f"{name} = {value}" for name, value in counts.items() if value % world_size]
    if bad:
        raise TensorParallelError(
            f"cannot split this model over {world_size} tensor-parallel ranks: "
            f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not divisible by {world_size} "
            f"(the model has {config.num_heads} attention heads, {config.num_kv_heads} KV heads "
            f"and an intermediate size of {config.intermediate_size})"
        )


def shard_config(config: ArchConfig, world_size: int) -> ArchConfig:
    """The configuration one rank computes with: its local head counts and MLP width."""
    check_divisible(config, world_size)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // world_size,
        num_kv_heads=config.num_kv_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
    )


class _NoLogits:
    """Stands in for the LM head on ranks whose logits nobody reads: an empty [..., 0]."""

    bias = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], 0)


def _rows(t: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.detach()
    # a slice is a copy, not a view, so that the full weight it came from can be freed
    return t if (lo, hi) == (0, t.shape[0]) else t[lo:hi].clone()


def take_weights(
    hf_model: Any,
    rank: int = 0,
    world_size: int = 1,
    *,
    quantize: str = "none",
    calibration_ids: Sequence[int] = (),
    lm_head: bool = True,
) -> ModelWeights:
    """Rank `rank`'s weights of a loaded transformers `*ForCausalLM` split over `world_size`
    ranks (the whole model for 0 of 1).

    Rank r takes KV heads [r*KVH/N, (r+1)*KVH/N) and the query heads that attend to them (query
    head h shares KV head h // G, so those are heads [r*H/N, (r+1)*H/N)), and MLP columns
    [r*I/N, (r+1)*I/N) of both gate and up. `quantize="int8"` turns every projection (the
    vocabulary one included) into an int8 one (see Int8Linear) after slicing, so scales are per
    shard, smoothed with activation ranges measured on `calibration_ids` when given.
    `lm_head=False` leaves out the vocabulary projection (see the module docstring).
    """
    config = ArchConfig.from_hf(hf_model.config, type(hf_model).__name__)
    local = shard_config(config, world_size)
    if not 0 <= rank < world_size:
        raise TensorParallelError(f"rank {rank} is not in [0, {world_size})")
    stats = (
        input_absmax(hf_model, calibration_ids) if quantize != "none" and calibration_ids else {}
    )
    d = config.head_dim
    q_lo, q_hi = rank * local.num_heads * d, (rank + 1) * local.num_heads * d
    kv_lo, kv_hi = rank * local.num_kv_heads * d, (rank + 1) * local.num_kv_heads * d
    i_lo, i_hi = rank * local.intermediate_size, (rank + 1) * local.intermediate_size

    def column(parts: list[tuple[Any, int, int]]) -> AnyLinear:
        """Rows [lo, hi) of each layer's weight (and bias), fused in this order."""
        weight = torch.cat([_rows(lin.weight, lo, hi) for lin, lo, hi in parts])  # type: ignore[misc]
        biases = [_rows(lin.bias, lo, hi) for lin, lo, hi in parts]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [
                    b if b is not None else weight.new_zeros(hi - lo)
                    for b, (_, lo, hi) in zip(biases, parts, strict=True)
                ]
            )
        # every part reads the same input (the normed hidden state): the first one's ranges
        return make_linear(weight, bias, quantize, stats.get(parts[0][0]))

    def row(lin: Any, lo: int, hi: int) -> AnyLinear:
        """Input columns [lo, hi): a partial sum. The bias is added once, by rank 0."""
        weight = lin.weight.detach()
        if (lo, hi) != (0, weight.shape[1]):
            weight = weight[:, lo:hi].clone()
        bias = lin.bias.detach().clone() if lin.bias is not None and rank == 0 else None
        absmax = stats.get(lin)
        return make_linear(weight, bias, quantize, None if absmax is None else absmax[lo:hi])

    inner = hf_model.model
    layers = []
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layers.append(
            LayerWeights(
                input_norm=layer.input_layernorm.weight.detach(),
                qkv=column(
                    [
                        (attn.q_proj, q_lo, q_hi),
                        (attn.k_proj, kv_lo, kv_hi),
                        (attn.v_proj, kv_lo, kv_hi),
                    ]
                ),
                q_norm=attn.q_norm.weight.detach() if config.qk_norm else None,
                k_norm=attn.k_norm.weight.detach() if config.qk_norm else None,
                o_proj=row(attn.o_proj, q_lo, q_hi),
                post_norm=layer.post_attention_layernorm.weight.detach(),
                gate_up=column([(mlp.gate_proj, i_lo, i_hi), (mlp.up_proj, i_lo, i_hi)]),
                down=row(mlp.down_proj, i_lo, i_hi),
            )
        )
    head: Any = _NoLogits()
    if lm_head:
        lin = hf_model.lm_head
        bias = None if lin.bias is None else lin.bias.detach()
        head = make_linear(lin.weight.detach(), bias, quantize, stats.get(lin))
    inv_freq, scale = rope_inv_freq(hf_model.config)
    return ModelWeights(
        config=local,
        embed=inner.embed_tokens.weight.detach(),
        layers=layers,
        norm=inner.norm.weight.detach(),
        lm_head=head,
        inv_freq=inv_freq,
        rope_scale=scale,
    )
