"""Mixture-of-experts MLP blocks (Qwen3-MoE, Mixtral, OLMoE): a router picks, per token, the
top-k of E experts (each a SiLU-gated MLP of its own), and the token's output is their
outputs weighted by the router's probabilities.

The router computes as transformers does: its logits in the model's dtype (the router weight
is kept as the checkpoint holds it, never quantized), the softmax over the E experts in
float32, top-k, renormalized over the k where the family does (Mixtral always, Qwen3-MoE and
OLMoE as `norm_topk_prob` says), and the k weights cast back to the model's dtype before they
scale the experts' outputs (Qwen3-MoE, OLMoE; Mixtral scales in float32). In float32 models
all of this is float32. (A router kept in float32 in a bfloat16 model was measured against
transformers' bfloat16 forward of the tiny OLMoE fixture: its experts' choices part from the
reference's on near-ties at bfloat16's resolution, and the logits with them, 1.7 off where the
router in the model's dtype stays within 0.63; so the reference's arithmetic it is.)

The experts run grouped: the step's N * k (token, expert) assignments are sorted by expert and
counted, and each expert that some token chose runs once over all of its tokens (one gate/up
and one down projection over a contiguous slice of the gathered inputs); experts nobody chose
do not run at all. The weighted outputs are summed back into their tokens with one index_add_,
each token's contributions in ascending expert order as transformers adds them. There is no
per-token Python loop: one per expert present in the step.

Each expert's gate/up and down are linear layers of arch/linear.py (`make_linear`), so every
`--quantize` mode applies to each expert as to a dense projection, and a float expert gets
oneDNN's packed weight on the CPU. (A stacked [E, 2I, H] layout driven by one batched matmul
would need every expert's tokens padded to the largest group, or a grouped-GEMM kernel plain
PyTorch does not offer on the CPU; per-expert packed linears over exact slices do no wasted
work and keep the quantized kinds.)

Tensor parallelism splits every expert as the dense MLP is split (arch/weights.py): rank r of
N holds columns [r*I/N, (r+1)*I/N) of each expert's gate and up (column-parallel) and the same
input columns of its down (row-parallel); the router is replicated, so every rank routes every
token alike (the same full hidden state in, the same float32 arithmetic). Each rank's block
output is then a partial sum of the full one (the routing weights scale it linearly), and the
all-reduce that follows the MLP in LlamaModel._finish_layer completes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from neuronpy.arch.linear import AnyLinear, Linear, make_linear

# model_type -> (the config's field for the experts' intermediate size, whether the top-k
# probabilities are always renormalized, whether they scale the experts in the model's dtype)
MOE_MODEL_TYPES = {
    "qwen3_moe": ("moe_intermediate_size", False, True),
    "mixtral": ("intermediate_size", True, False),
    "olmoe": ("intermediate_size", False, True),
}


@dataclass(frozen=True)
class MoeConfig:
    """What a mixture-of-experts model's sparse MLP blocks need."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's (this rank's share of it, in a shard's config)
    norm_topk_prob: bool  # renormalize the top-k probabilities to sum to one
    sparse_layers: tuple[int, ...]  # the layers whose MLP is a MoE block (the rest are dense)
    cast_weights: bool = True  # routing weights cast to the model's dtype before they scale

    def shard(self, world_size: int) -> MoeConfig:
        """One tensor-parallel rank's: its share of every expert's intermediate columns."""
        return dataclasses.replace(self, intermediate_size=self.intermediate_size // world_size)


def moe_config(hf_config: Any) -> MoeConfig | None:
    """The MoE settings of a transformers config; None for a dense family."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MOE_MODEL_TYPES:
        return None
    size_field, always_norm, cast = MOE_MODEL_TYPES[model_type]
    num_experts = getattr(hf_config, "num_experts", None) or hf_config.num_local_experts
    layers = range(hf_config.num_hidden_layers)
    if model_type == "qwen3_moe":  # dense MLPs mixed in: mlp_only_layers, decoder_sparse_step
        dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
        step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        sparse = tuple(i for i in layers if i not in dense and num_experts and (i + 1) % step == 0)
    else:
        sparse = tuple(layers)
    return MoeConfig(
        num_experts=int(num_experts),
        top_k=int(hf_config.num_experts_per_tok),
        intermediate_size=int(getattr(hf_config, size_field)),
        norm_topk_prob=always_norm or bool(getattr(hf_config, "norm_topk_prob", False)),
        sparse_layers=sparse,
        cast_weights=cast,
    )


class MoeBlock:
    """One layer's sparse MLP: x [N, hidden] (post-attention normed) -> [N, hidden]."""

    def __init__(
        self,
        config: MoeConfig,
        router: Linear,
        gate_up: list[AnyLinear],
        down: list[AnyLinear],
    ) -> None:
        if not len(gate_up) == len(down) == config.num_experts == router.out_features:
            raise ValueError("a MoE block needs a gate/up and a down for each routed expert")
        self.config = config
        self.router = router  # hidden -> experts
        self.gate_up = gate_up  # per expert: hidden -> 2 * inter (gate, then up)
        self.down = down  # per expert: inter -> hidden

    def linears(self) -> list[Any]:
        """Every projection of the block: the router and each expert's two."""
        return [self.router, *self.gate_up, *self.down]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> each token's top-k routing weights [N, k] (float32) and experts
        [N, k], as transformers computes them: float32 softmax, top-k, renormalized or not."""
        probs = self.router(x).softmax(dim=-1, dtype=torch.float32)  # [N, E]
        weights, experts = probs.topk(self.config.top_k, dim=-1)
        if self.config.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        k = self.config.top_k
        flat = experts.reshape(-1)  # [N * k]: assignment j is token j // k's
        order = flat.argsort(stable=True)  # by expert; each token's in ascending expert order
        counts = torch.bincount(flat, minlength=self.config.num_experts).tolist()
        tokens = order // k
        inputs = x[tokens]  # [N * k, hidden], grouped by expert
        outs, at = [], 0
        for expert, n in enumerate(counts):
            if n:
                outs.append(self._expert(expert, inputs[at : at + n]))
                at += n
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        scale = weights.reshape(-1)[order, None]
        if self.config.cast_weights:
            scale = scale.to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, (out * scale).to(x.dtype))

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up[expert](x).chunk(2, dim=-1)
        return self.down[expert](F.silu(gate) * up)


def take_moe_block(
    tensor: Callable[[str], Any],
    prefix: str,
    config: MoeConfig,
    rank: int = 0,
    world_size: int = 1,
    quantize: str = "none",
    dtype: torch.dtype = torch.float32,
) -> MoeBlock:
    """Rank `rank`'s MoE block of the layer whose MLP is at `prefix` (e.g.
    "model.layers.3.mlp"), from transformers' fused expert tensors: `{prefix}.gate.weight`
    [E, hidden], `{prefix}.experts.gate_up_proj` [E, 2 * I, hidden] (gate rows, then up) and
    `{prefix}.experts.down_proj` [E, hidden, I]. `config` is the whole model's; `tensor`
    answers a tensor by name. Each expert becomes `quantize`'s linear kind after slicing, so
    that quantization scales are per shard (as arch/weights.py does for dense projections)."""
    inter = config.intermediate_size
    if inter % world_size:
        raise ValueError(f"an expert intermediate size of {inter} does not split {world_size} ways")
    share = inter // world_size
    lo, hi = rank * share, (rank + 1) * share
    router = tensor(f"{prefix}.gate.weight")
    gate_up = tensor(f"{prefix}.experts.gate_up_proj")
    down = tensor(f"{prefix}.experts.down_proj")
    for name, t in (("gate_up_proj", gate_up), ("down_proj", down), ("gate", router)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{prefix}: expert tensor {name} is stored in a layout not supported")
    experts = config.num_experts
    if gate_up.shape[:2] != (experts, 2 * inter) or down.shape[::2] != (experts, inter):
        raise ValueError(
            f"{prefix}: expert tensors {list(gate_up.shape)} and {list(down.shape)} do not "
            f"match {experts} experts of intermediate size {inter}"
        )
    whole = (lo, hi) == (0, inter)
    ups, downs = [], []
    for e in range(experts):
        w = gate_up[e]
        if not whole:  # a copy, so that the full weights can be freed
            w = torch.cat((w[lo:hi], w[inter + lo : inter + hi]))
        ups.append(make_linear(w.detach(), None, quantize, dtype=dtype))
        d = down[e] if whole else down[e][:, lo:hi].contiguous()
        downs.append(make_linear(d.detach(), None, quantize, dtype=dtype))
    return MoeBlock(config.shard(world_size), Linear(router.detach().to(dtype)), ups, downs)
