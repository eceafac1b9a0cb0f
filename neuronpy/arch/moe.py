"""Mixture-of-experts MLP blocks (Qwen3-MoE, Mixtral, OLMoE, GLM-4.5; the hybrid families'
Qwen3-Next, Qwen3.5-MoE and Granite-4.0-H; DeepSeek-V2/V3's blocks): a router picks, per
token, the top-k of E experts (each a SiLU-gated MLP of its own), and the token's output is
their outputs weighted by the router's probabilities, plus, where the family has one, a shared
expert's output.

The router computes as transformers does: its logits in the model's dtype (the router weight
is kept as the checkpoint holds it, never quantized), then one of these orders:
- softmax, then top-k (Qwen3-MoE, Mixtral, OLMoE, Qwen3-Next, Qwen3.5-MoE): the softmax over
  the E experts in float32, top-k, renormalized over the k where the family does (Mixtral and
  Qwen3.5-MoE always, Qwen3-MoE, OLMoE and Qwen3-Next as `norm_topk_prob` says);
- top-k, then softmax (Granite): the top-k of the logits (upcast to float32), and the softmax
  over those k alone, so the k weights always sum to one;
- DeepSeek's router (DeepSeek-V2, DeepSeek-V3, GLM-4.5), all in float32, its weight kept
  float32 in any model (as transformers keeps it): scores, a softmax (V2) or a sigmoid (V3,
  GLM) of the logits; the scores to choose by, the scores plus a per-expert bias
  (`e_score_correction_bias`, V3 and GLM); where only topk_group of n_group groups are kept,
  the groups scored (V3, GLM: the sum of each group's two best; V2's group_limited_greedy:
  its best) and the experts of the others left out; the top-k of the rest; their weights the
  scores without the bias, renormalized where norm_topk_prob says, times
  routed_scaling_factor. These are MoeConfig fields, not a family's switch: MoeBlock.route.
The k weights are cast back to the model's dtype before they scale the experts' outputs
(every family but Mixtral, which scales in float32). In float32 models all of this is
float32. (A router kept in float32 in a bfloat16 model was measured against transformers'
bfloat16 forward of the tiny OLMoE fixture: its experts' choices part from the reference's on
near-ties at bfloat16's resolution, and the logits with them, 1.7 off where the router in the
model's dtype stays within 0.63; so the reference's arithmetic it is.)

A shared expert (Qwen3-Next, Qwen3.5-MoE: `mlp.shared_expert`; DeepSeek and GLM:
`mlp.shared_experts`, their n_shared_experts fused into one; Granite: the layer's
`shared_mlp`) is one more SiLU-gated MLP, of its own intermediate size, that every token runs
through; its output is added to the routed experts' sum, scaled first by a per-token
sigmoid(`shared_expert_gate`(x)) where the family has that gate (the Qwens; the gate, a
[1, hidden] weight, is kept float as the router is). A Granite model of no routed experts
(num_local_experts 0) has the shared MLP alone: its MoeConfig says 0 experts, and its block is
the shared MLP, with no router to run.

The experts run grouped: the step's N * k (token, expert) assignments are sorted by expert and
counted, and each expert that some token chose runs once over all of its tokens (one gate/up
and one down projection over a contiguous slice of the gathered inputs); experts nobody chose
do not run at all. The weighted outputs are summed back into their tokens with one index_add_,
each token's contributions in ascending expert order. Where the weights are cast to the model's
dtype first, the sum is in that dtype too (as transformers' per-expert loop adds them; k of 2
adds alike in any order). Where they scale in float32 (Mixtral, DeepSeek's router), each
token's weighted outputs are summed in float32 and rounded once, as transformers' default
experts forward ("grouped_mm") does: rounding each to bfloat16 before the sum, as its
per-expert loop does, gave Mixtral's bfloat16 logits 0.34 off the loaded model's, the float32
sum none. There is no per-token Python loop: one per expert present in the step.

Each expert's gate/up and down are linear layers of arch/linear.py (`make_linear`), so every
`--quantize` mode applies to each expert (and the shared one) as to a dense projection, and a
float expert gets oneDNN's packed weight on the CPU. (A stacked [E, 2I, H] layout driven by one
batched matmul would need every expert's tokens padded to the largest group, or a grouped-GEMM
kernel plain PyTorch does not offer on the CPU; per-expert packed linears over exact slices do
no wasted work and keep the quantized kinds.)

gpt-oss (`gpt_oss`) routes as Granite does (the top-k of the logits, a softmax over the k,
in the model's dtype as transformers' GptOssTopKRouter computes it), its router's logits with
a bias. Its experts have biases on both projections and a clamped SwiGLU:
`(up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g)`, g = `gate.clamp(max=limit)`. The
checkpoint holds them as transformers' GptOssExperts does, `experts.gate_up_proj` [E, hidden,
2 * I] (the input dim first, against a linear layer's [out, in]) with the gate and up columns
interleaved (gate even, up odd), `experts.down_proj` [E, I, hidden], and their biases; or as
the released checkpoints ship them, MXFP4 `*_blocks` and `*_scales` (arch/mxfp4.py),
dequantized here. Either is turned at load into the layout above: each expert's gate rows,
then its up rows, [out, in], so the forward is the one every family runs.

Tensor parallelism splits every expert as the dense MLP is split (arch/weights.py): rank r of
N holds columns [r*I/N, (r+1)*I/N) of each expert's gate and up (column-parallel) and the same
input columns of its down (row-parallel); the shared expert is split alike over its own
intermediate size. The router and the shared expert's gate are replicated, so every rank
routes every token alike (the same full hidden state in, the same float32 arithmetic) and
scales its share of the shared expert by the same sigmoid. Each rank's block output is then a
partial sum of the full one (the routing weights and the sigmoid scale it linearly), and the
all-reduce that follows the MLP in LlamaModel._finish_layer completes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from neuronpy.arch.linear import AnyLinear, Linear, make_linear
from neuronpy.arch.mxfp4 import dequantize_mxfp4
from neuronpy.arch.quant import AnyWeight, cat_weights, dequantized

# model_type -> (the config's field for the experts' intermediate size, whether the top-k
# probabilities are always renormalized, whether they scale the experts in the model's dtype)
MOE_MODEL_TYPES = {
    "qwen3_moe": ("moe_intermediate_size", False, True),
    "mixtral": ("intermediate_size", True, False),
    "olmoe": ("intermediate_size", False, True),
}
# The hybrid families (linear-attention or Mamba layers beside attention) whose MoE blocks
# moe_config reads and take_moe_block builds. They are not in MOE_MODEL_TYPES, which
# arch/config.py serves whole: their token mixers are another module's.
HYBRID_MOE_MODEL_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "granitemoehybrid")
# The families of DeepSeek's MoE block: DeepSeek's router, shared experts without a gate, the
# first layers dense. Only GLM-4.5 is served whole (arch/config.py); the DeepSeeks' attention
# (multi-head latent attention) is another module's, so for them moe_config and
# take_moe_block are the MoE side alone.
DEEPSEEK_MOE_MODEL_TYPES = ("glm4_moe", "deepseek_v3", "deepseek_v2")
# DeepSeek-V2's ways of choosing the top-k (its config's topk_method): "greedy", the top-k of
# all the experts; "group_limited_greedy", within the best topk_group groups
DEEPSEEK_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class MoeConfig:
    """What a mixture-of-experts model's sparse MLP blocks need."""

    num_experts: int  # routed experts; 0: the block is its shared expert alone (Granite)
    top_k: int
    intermediate_size: int  # each expert's (this rank's share of it, in a shard's config)
    norm_topk_prob: bool  # renormalize the top-k probabilities to sum to one
    sparse_layers: tuple[int, ...]  # the layers whose MLP is a MoE block (the rest are dense)
    cast_weights: bool = True  # routing weights cast to the model's dtype before they scale
    shared_intermediate_size: int = 0  # the shared expert's (this rank's share); 0: none
    shared_gate: bool = False  # the shared expert's output scaled by sigmoid(a [1, H] gate)
    topk_then_softmax: bool = False  # top-k of the logits, softmax over the k (Granite)
    # gpt-oss: biases on the router and on each expert's projections, and the clamped SwiGLU
    # of `swiglu_limit` and `swiglu_alpha` in place of SiLU(gate) * up (None: SiLU's)
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    # DeepSeek's router (DeepSeek-V2, DeepSeek-V3, GLM-4.5): see MoeBlock.route
    float32_router: bool = False  # logits of the float32 input by a float32 weight
    scoring: str = "softmax"  # how the logits become scores: "softmax" or "sigmoid"
    score_bias: bool = False  # a per-expert bias added to the scores, for choosing only
    n_group: int = 1  # the experts split into this many groups of consecutive ones...
    topk_group: int = 1  # ...of which each token chooses within this many only
    group_score: str = "max"  # a group's score: its best ("max") or its two best summed ("top2")
    routed_scaling_factor: float = 1.0  # the k weights times this, after renormalizing

    def shard(self, world_size: int) -> MoeConfig:
        """One tensor-parallel rank's: its share of every expert's intermediate columns."""
        return dataclasses.replace(
            self,
            intermediate_size=self.intermediate_size // world_size,
            shared_intermediate_size=self.shared_intermediate_size // world_size,
        )


def _sparse_layers(hf_config: Any, num_experts: int) -> tuple[int, ...]:
    """Qwen's layers of experts: not in mlp_only_layers, every decoder_sparse_step-th."""
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    layers = range(hf_config.num_hidden_layers)
    return tuple(i for i in layers if i not in dense and num_experts and (i + 1) % step == 0)


def moe_config(hf_config: Any) -> MoeConfig | None:
    """The MoE settings of a transformers config; None for a dense family.

    A Granite hybrid (granitemoehybrid) of num_local_experts 0 gets a config of 0 experts
    whose every layer is "sparse": its blocks are the shared MLP alone (take_moe_block reads
    no router and no experts for it), so that a caller builds every Granite layer's MLP the
    one way. A Qwen3-Next of 0 experts gets no sparse layers (every MLP is dense, as
    transformers builds it)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type in HYBRID_MOE_MODEL_TYPES:
        return _hybrid_moe_config(hf_config)
    if model_type in DEEPSEEK_MOE_MODEL_TYPES:
        return _deepseek_moe_config(hf_config)
    if model_type == "gpt_oss":
        return _gpt_oss_moe_config(hf_config)
    if model_type not in MOE_MODEL_TYPES:
        return None
    size_field, always_norm, cast = MOE_MODEL_TYPES[model_type]
    num_experts = getattr(hf_config, "num_experts", None) or hf_config.num_local_experts
    if model_type == "qwen3_moe":  # dense MLPs mixed in: mlp_only_layers, decoder_sparse_step
        sparse = _sparse_layers(hf_config, num_experts)
    else:
        sparse = tuple(range(hf_config.num_hidden_layers))
    return MoeConfig(
        num_experts=int(num_experts),
        top_k=int(hf_config.num_experts_per_tok),
        intermediate_size=int(getattr(hf_config, size_field)),
        norm_topk_prob=always_norm or bool(getattr(hf_config, "norm_topk_prob", False)),
        sparse_layers=sparse,
        cast_weights=cast,
    )


def _hybrid_moe_config(hf_config: Any) -> MoeConfig:
    model_type = hf_config.model_type
    if model_type == "qwen3_5_moe":  # the multimodal config: its language model's
        hf_config = hf_config.text_config
        model_type = hf_config.model_type
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"a {model_type} MoE block with hidden_act {act!r} is not supported")
    layers = tuple(range(hf_config.num_hidden_layers))
    if model_type == "granitemoehybrid":
        num_experts = int(getattr(hf_config, "num_local_experts", 0) or 0)
        return MoeConfig(
            num_experts=num_experts,
            top_k=int(hf_config.num_experts_per_tok) if num_experts else 0,
            intermediate_size=int(hf_config.intermediate_size) if num_experts else 0,
            norm_topk_prob=False,  # the softmax over the k: they sum to one already
            sparse_layers=layers,  # every layer: routed experts and/or the shared MLP
            shared_intermediate_size=int(hf_config.shared_intermediate_size),
            topk_then_softmax=True,
        )
    num_experts = int(hf_config.num_experts)
    qwen3_next = model_type == "qwen3_next"
    return MoeConfig(
        num_experts=num_experts,
        top_k=int(hf_config.num_experts_per_tok),
        intermediate_size=int(hf_config.moe_intermediate_size),
        # Qwen3.5-MoE always renormalizes; Qwen3-Next as norm_topk_prob says
        norm_topk_prob=not qwen3_next or bool(getattr(hf_config, "norm_topk_prob", False)),
        # Qwen3.5-MoE: every layer; Qwen3-Next: as Qwen3-MoE
        sparse_layers=_sparse_layers(hf_config, num_experts) if qwen3_next else layers,
        shared_intermediate_size=int(hf_config.shared_expert_intermediate_size),
        shared_gate=True,
    )


def _deepseek_moe_config(hf_config: Any) -> MoeConfig:
    """DeepSeek-V2's, DeepSeek-V3's or GLM-4.5's MoE settings, as transformers builds the
    blocks: layers from first_k_dense_replace on have experts (the first ones a dense MLP of
    intermediate_size), each with n_shared_experts shared experts fused into one MLP of
    moe_intermediate_size * n_shared_experts, added without a gate.

    DeepSeek-V3 and GLM-4.5 score with a sigmoid, choose with e_score_correction_bias added
    (the routing weights are the unbiased scores), within the topk_group best of n_group
    groups (a group's score: the sum of its two best biased scores). DeepSeek-V2 scores with a
    softmax and chooses among all ("greedy") or within the topk_group groups whose best score
    is highest ("group_limited_greedy"); transformers never renormalizes its k weights, whatever
    norm_topk_prob says, so neither does this."""
    model_type = hf_config.model_type
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"a {model_type} MoE block with hidden_act {act!r} is not supported")
    v2 = model_type == "deepseek_v2"
    if v2 and getattr(hf_config, "mlp_bias", False):
        raise ValueError("a deepseek_v2 MoE block with mlp_bias is not supported")
    # DeepSeek's own code (not transformers') has experts only in every moe_layer_freq-th
    # layer; transformers builds them in every layer past the dense ones. The two agree at 1,
    # which is what the released models use; any other value is refused rather than guessed.
    freq = int(getattr(hf_config, "moe_layer_freq", 1) or 1)
    if freq != 1:
        raise ValueError(f"{model_type}: moe_layer_freq {freq} is not supported (only 1)")
    method = getattr(hf_config, "topk_method", None) or "greedy"
    if v2 and method not in DEEPSEEK_V2_TOPK_METHODS:
        raise ValueError(f"deepseek_v2: topk_method {method!r} is not supported")
    num_experts = int(hf_config.n_routed_experts)
    first_dense = int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
    grouped = not v2 or method == "group_limited_greedy"
    n_group = int(getattr(hf_config, "n_group", None) or 1) if grouped else 1
    topk_group = int(getattr(hf_config, "topk_group", None) or n_group) if grouped else 1
    if num_experts % n_group or not 0 < topk_group <= n_group:
        raise ValueError(
            f"{model_type}: {num_experts} experts in {n_group} groups, {topk_group} of them "
            "kept, is not a valid grouping"
        )
    shared = int(getattr(hf_config, "n_shared_experts", None) or 0)
    inter = int(hf_config.moe_intermediate_size)
    return MoeConfig(
        num_experts=num_experts,
        top_k=int(hf_config.num_experts_per_tok),
        intermediate_size=inter,
        norm_topk_prob=not v2 and bool(getattr(hf_config, "norm_topk_prob", False)),
        sparse_layers=tuple(range(first_dense, int(hf_config.num_hidden_layers))),
        cast_weights=False,  # the float32 weights scale each expert's output
        shared_intermediate_size=inter * shared,
        float32_router=True,
        scoring="softmax" if v2 else "sigmoid",
        score_bias=not v2,
        n_group=n_group,
        topk_group=topk_group,
        group_score="max" if v2 else "top2",
        routed_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0),
    )


def _gpt_oss_moe_config(hf_config: Any) -> MoeConfig:
    """gpt-oss: experts in every layer, top-k then softmax, biases, the clamped SwiGLU."""
    return MoeConfig(
        num_experts=int(hf_config.num_local_experts),
        top_k=int(hf_config.num_experts_per_tok),
        intermediate_size=int(hf_config.intermediate_size),
        norm_topk_prob=False,  # the softmax over the k: they sum to one already
        sparse_layers=tuple(range(hf_config.num_hidden_layers)),
        topk_then_softmax=True,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=float(hf_config.swiglu_limit),
        swiglu_alpha=float(hf_config.swiglu_alpha),
    )


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float
) -> torch.Tensor:
    """gpt-oss's expert activation, in transformers' order of operations (GptOssExperts)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class MoeBlock:
    """One layer's sparse MLP: x [N, hidden] (post-attention normed) -> [N, hidden]."""

    def __init__(
        self,
        config: MoeConfig,
        router: Linear | None,
        gate_up: Sequence[AnyLinear],
        down: Sequence[AnyLinear],
        shared_gate_up: AnyLinear | None = None,
        shared_down: AnyLinear | None = None,
        shared_gate: Linear | None = None,
        score_bias: torch.Tensor | None = None,
    ) -> None:
        routers = 0 if router is None else router.out_features
        if not len(gate_up) == len(down) == config.num_experts == routers:
            raise ValueError("a MoE block needs a gate/up and a down for each routed expert")
        if (shared_gate_up is None) != (shared_down is None) or (
            (shared_gate_up is not None) != bool(config.shared_intermediate_size)
        ):
            raise ValueError("a shared expert needs a gate/up and a down, as the config says")
        if (shared_gate is not None) != (config.shared_gate and shared_gate_up is not None):
            raise ValueError("a shared expert's gate is there where the config says it is")
        if not config.num_experts and shared_gate_up is None:
            raise ValueError("a MoE block of no routed experts needs a shared expert")
        if (score_bias is not None) != config.score_bias or (
            score_bias is not None and score_bias.shape != (config.num_experts,)
        ):
            raise ValueError("a score bias, one per expert, is there where the config says")
        self.config = config
        self.router = router  # hidden -> experts (None: no routed experts)
        self.gate_up = list(gate_up)  # per expert: hidden -> 2 * inter (gate, then up)
        self.down = list(down)  # per expert: inter -> hidden
        self.shared_gate_up = shared_gate_up  # hidden -> 2 * shared inter (gate, then up)
        self.shared_down = shared_down  # shared inter -> hidden
        self.shared_gate = shared_gate  # hidden -> 1: sigmoid-scales the shared expert
        self.score_bias = score_bias  # [E] float32, added to the scores for choosing only

    def linears(self) -> list[Any]:
        """Every projection of the block: the router, each expert's two, the shared expert's
        two and its gate."""
        shared = [self.shared_gate_up, self.shared_down, self.shared_gate]
        head = [] if self.router is None else [self.router]
        return [*head, *self.gate_up, *self.down, *(lin for lin in shared if lin is not None)]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> each token's top-k routing weights [N, k] (float32) and experts
        [N, k], as transformers computes them: float32 softmax, top-k, renormalized or not;
        or (topk_then_softmax) the top-k logits and a float32 softmax over them."""
        if self.router is None:
            raise ValueError("a MoE block of no routed experts routes nothing")
        if self.config.float32_router:
            return self._route_float32(x)
        logits = self.router(x)  # [N, E]
        if self.config.topk_then_softmax:
            top, experts = logits.float().topk(self.config.top_k, dim=-1)
            return top.softmax(dim=-1), experts
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.config.top_k, dim=-1)
        if self.config.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def _route_float32(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek's router (DeepSeek-V2/V3, GLM-4.5), in transformers' order of operations,
        all in float32: the logits of the float32 input by the float32 weight; scores, their
        softmax or sigmoid; the scores to choose by, the scores plus the bias where there is
        one; where only some groups are kept, each group scored (its best, or its two best
        summed) and the experts outside the topk_group best groups masked out (to -inf, or to
        0 under a softmax, whose scores are all above it); the top-k of what is left (unsorted,
        as transformers takes it); their weights, the unbiased scores of the chosen, then
        renormalized (over the sum plus 1e-20) where norm_topk_prob says, then times
        routed_scaling_factor."""
        assert self.router is not None
        c = self.config
        logits = self.router(x.float())  # [N, E]
        if c.scoring == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1, dtype=torch.float32)
        choice = scores if self.score_bias is None else scores + self.score_bias
        if c.topk_group < c.n_group:  # (keeping every group masks nothing: skipped)
            grouped = choice.view(-1, c.n_group, c.num_experts // c.n_group)
            if c.group_score == "top2":
                group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            else:
                group_scores = grouped.max(dim=-1).values
            kept = torch.topk(group_scores, k=c.topk_group, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(group_scores).scatter_(1, kept, 1)
            mask = mask.unsqueeze(-1).expand_as(grouped).reshape(-1, c.num_experts)
            fill = 0.0 if c.scoring == "softmax" else float("-inf")
            choice = choice.masked_fill(~mask.bool(), fill)
        experts = torch.topk(choice, k=c.top_k, dim=-1, sorted=False)[1]
        # a softmax's weights are the masked scores (DeepSeek-V2 takes the top-k's values: an
        # expert of a masked group, chosen only where the kept groups hold fewer than k,
        # weighs 0); a sigmoid's, the scores as they were before bias and mask
        weights = (choice if c.scoring == "softmax" else scores).gather(1, experts)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, experts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shared = self._shared(x)
        if shared is None:
            return self._routed(x)
        # no router: the block is its shared MLP alone (Granite's dense hybrids)
        return shared if self.router is None else self._routed(x) + shared

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
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
        # float32 weights: each token's weighted outputs summed in float32, rounded to the
        # model's dtype once (transformers' default experts forward, "grouped_mm", sums them
        # so; its per-expert loop rounds each one first: the two part in bfloat16's last bit)
        summed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return summed.index_add_(0, tokens, (out * scale).float()).to(x.dtype)

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up[expert](x).chunk(2, dim=-1)
        if self.config.swiglu_limit is not None:  # gpt-oss
            act = clamped_swiglu(gate, up, self.config.swiglu_limit, self.config.swiglu_alpha)
            return self.down[expert](act)
        return self.down[expert](F.silu(gate) * up)

    def _shared(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.shared_gate_up is None or self.shared_down is None:
            return None
        gate, up = self.shared_gate_up(x).chunk(2, dim=-1)
        out = self.shared_down(F.silu(gate) * up)
        if self.shared_gate is not None:
            out = torch.sigmoid(self.shared_gate(x)) * out
        return out


def _first(tensor: Callable[[str], Any], names: Sequence[str]) -> tuple[str, Any]:
    """The first of `names` the checkpoint holds, and its tensor."""
    for name in names:
        try:
            return name, tensor(name)
        except KeyError:
            continue
    raise KeyError(f"the checkpoint has none of {', '.join(repr(n) for n in names)}")


def _gate_tensor(t: Any, dtype: torch.dtype) -> torch.Tensor:
    """A router's or a shared expert's gate weight in `dtype`: a quantized one (a GGUF file's)
    dequantized, its values the file's."""
    return dequantized(t, dtype)


def _plain_tensor(name: str, t: Any) -> torch.Tensor:
    """An expert's weight as a tensor: a quantized one (a GGUF file's experts) dequantized to
    float32 here, once, and made what `quantize` says by the expert's own linear layers."""
    if not isinstance(t, torch.Tensor):
        return dequantized(t, torch.float32)
    return t.detach()


def _gated_mlp(
    gate_up: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    down: torch.Tensor,
    inter: int,
    lo: int,
    hi: int,
    quantize: str,
    dtype: torch.dtype,
) -> tuple[AnyLinear, AnyLinear]:
    """One SiLU-gated MLP's gate/up and down linears, intermediate columns [lo, hi) of
    `inter`: gate_up is one [2 * inter, hidden] weight (gate rows, then up) or the gate and
    the up [inter, hidden] apart; down is [hidden, inter]."""
    whole = (lo, hi) == (0, inter)
    if isinstance(gate_up, tuple):
        gate, up = gate_up
        w = torch.cat((gate[lo:hi], up[lo:hi]))
    elif whole:
        w = gate_up
    else:  # a copy, so that the full weights can be freed
        w = torch.cat((gate_up[lo:hi], gate_up[inter + lo : inter + hi]))
    d = down if whole else down[:, lo:hi].contiguous()
    return make_linear(w, None, quantize, dtype=dtype), make_linear(d, None, quantize, dtype=dtype)


def _split(size: int, what: str, rank: int, world_size: int) -> tuple[int, int]:
    if size % world_size:
        raise ValueError(f"{what} of {size} does not split {world_size} ways")
    share = size // world_size
    return rank * share, (rank + 1) * share


def take_moe_block(
    tensor: Callable[[str], Any],
    prefix: str,
    config: MoeConfig,
    rank: int = 0,
    world_size: int = 1,
    quantize: str = "none",
    dtype: torch.dtype = torch.float32,
    *,
    shared_prefix: str | None = None,
) -> MoeBlock:
    """Rank `rank`'s MoE block of the layer whose MoE module is at `prefix` (e.g.
    "model.layers.3.mlp"; Granite's "model.layers.3.block_sparse_moe"). `config` is the whole
    model's; `tensor` answers a tensor by name and raises KeyError for one the checkpoint does
    not hold (each piece is looked up under its names in turn, the first held taken). Each
    expert becomes `quantize`'s linear kind after slicing, so that quantization scales are
    per shard (as arch/weights.py does for dense projections); the router and the shared
    expert's gate stay float.

    The router: `{prefix}.gate.weight` or `{prefix}.router.weight` (Granite in transformers;
    `{prefix}.router.layer.weight` in its files), [E, hidden].
    The routed experts, one of:
    - transformers' fused tensors `{prefix}.experts.gate_up_proj` [E, 2 * I, hidden] (gate
      rows, then up) and `{prefix}.experts.down_proj` [E, hidden, I];
    - Granite's files' stacked `{prefix}.input_linear.weight` [E, 2 * I, hidden] (the same
      chunk order: gate, then up) and `{prefix}.output_linear.weight` [E, hidden, I];
    - the Qwens' files' per-expert `{prefix}.experts.{e}.gate_proj.weight`, `up_proj` [I,
      hidden] and `down_proj` [hidden, I].
    The shared expert (where config.shared_intermediate_size says there is one), at
    `shared_prefix` (by default `{prefix}.shared_expert`, the Qwens', or
    `{prefix}.shared_experts`, DeepSeek's and GLM's; Granite's is the layer's
    "model.layers.3.shared_mlp"), one of: `{shared_prefix}.gate_proj.weight`, `up_proj` and
    `down_proj` apart, or `{shared_prefix}.input_linear.weight` [2 * S, hidden] (gate rows,
    then up) and `{shared_prefix}.output_linear.weight` [hidden, S]. Quantized ones apart (a
    GGUF file's, gate and up of one layout) are kept so on one rank, gate and up fused. Its
    gate (where config.shared_gate says) is `{prefix}.shared_expert_gate.weight` [1, hidden].
    The score bias (where config.score_bias says) is `{prefix}.gate.e_score_correction_bias`
    [E] (or `{prefix}.e_score_correction_bias`); it and, under config.float32_router, the
    router weight are kept float32.

    A config of 0 routed experts (Granite's dense hybrids) reads the shared expert alone."""
    router: Linear | None = None
    ups: list[AnyLinear] = []
    downs: list[AnyLinear] = []
    if config.num_experts:
        name, w = _first(
            tensor, [f"{prefix}.{r}.weight" for r in ("gate", "router", "router.layer")]
        )
        # DeepSeek's router computes in float32 whatever the model's dtype (transformers keeps
        # its weight and bias float32 in a bfloat16 model): so is it kept here
        router_dtype = torch.float32 if config.float32_router else dtype
        bias = None
        if config.router_bias:  # gpt-oss
            bias = _gate_tensor(tensor(name.removesuffix("weight") + "bias"), router_dtype)
        router = Linear(_gate_tensor(w, router_dtype), bias)
        experts = _biased_experts if config.expert_bias else _routed_experts
        ups, downs = experts(tensor, prefix, config, rank, world_size, quantize, dtype)
    score_bias = None
    if config.score_bias:
        names = [f"{prefix}.gate.e_score_correction_bias", f"{prefix}.e_score_correction_bias"]
        score_bias = _gate_tensor(_first(tensor, names)[1], torch.float32)
    shared_gate_up = shared_down = shared_gate = None
    if config.shared_intermediate_size:
        at = shared_prefix or _shared_prefix(tensor, prefix)
        shared_gate_up, shared_down = _shared_expert(
            tensor, at, config.shared_intermediate_size, rank, world_size, quantize, dtype
        )
        if config.shared_gate:
            name = f"{prefix}.shared_expert_gate.weight"
            shared_gate = Linear(_gate_tensor(tensor(name), dtype))
    return MoeBlock(
        config.shard(world_size),
        router,
        ups,
        downs,
        shared_gate_up,
        shared_down,
        shared_gate,
        score_bias,
    )


def _shared_prefix(tensor: Callable[[str], Any], prefix: str) -> str:
    """Where the MoE module at `prefix` keeps its shared expert: `{prefix}.shared_expert` (the
    Qwens') or `{prefix}.shared_experts` (DeepSeek's and GLM's, the n_shared_experts fused)."""
    for at in (f"{prefix}.shared_expert", f"{prefix}.shared_experts"):
        try:
            _first(tensor, [f"{at}.gate_proj.weight", f"{at}.input_linear.weight"])
        except KeyError:
            continue
        return at
    return f"{prefix}.shared_expert"  # (its absence is reported by name when read)


def _weight(tensor: Callable[[str], Any], name: str) -> torch.Tensor:
    return _plain_tensor(name, tensor(name))


def _routed_experts(
    tensor: Callable[[str], Any],
    prefix: str,
    config: MoeConfig,
    rank: int,
    world_size: int,
    quantize: str,
    dtype: torch.dtype,
) -> tuple[list[AnyLinear], list[AnyLinear]]:
    """Each routed expert's gate/up and down linears, rank `rank`'s columns (see
    take_moe_block for the layouts read)."""
    experts, inter = config.num_experts, config.intermediate_size
    lo, hi = _split(inter, "an expert intermediate size", rank, world_size)
    stacked = {  # the stacked layouts: gate/up's name -> down's
        f"{prefix}.experts.gate_up_proj": f"{prefix}.experts.down_proj",
        f"{prefix}.input_linear.weight": f"{prefix}.output_linear.weight",
    }
    try:
        name, gate_up = _first(tensor, list(stacked))
    except KeyError:
        name, gate_up = "", None  # the per-expert layout
    if gate_up is not None:
        gate_up, down = _plain_tensor(name, gate_up), _weight(tensor, stacked[name])
        if gate_up.shape[:2] != (experts, 2 * inter) or down.shape[::2] != (experts, inter):
            raise ValueError(
                f"{prefix}: expert tensors {list(gate_up.shape)} and {list(down.shape)} do "
                f"not match {experts} experts of intermediate size {inter}"
            )
    ups, downs = [], []
    for e in range(experts):
        if gate_up is not None:
            gu, d = _gated_mlp(gate_up[e], down[e], inter, lo, hi, quantize, dtype)
        else:
            at = f"{prefix}.experts.{e}"
            gate, up = (
                _weight(tensor, f"{at}.gate_proj.weight"),
                _weight(tensor, f"{at}.up_proj.weight"),
            )
            d = _weight(tensor, f"{at}.down_proj.weight")
            if gate.shape[0] != inter or up.shape != gate.shape or d.shape[1] != inter:
                raise ValueError(f"{at}: expert weights do not match intermediate size {inter}")
            gu, d = _gated_mlp((gate, up), d, inter, lo, hi, quantize, dtype)
        ups.append(gu)
        downs.append(d)
    return ups, downs


def _expert_weight(
    tensor: Callable[[str], Any], name: str, expert: int, dtype: torch.dtype
) -> torch.Tensor:
    """Expert `expert`'s slice of gpt-oss's stacked `name`, [out, in]: dequantized from the
    MXFP4 `{name}_blocks` and `{name}_scales` where the checkpoint holds those (already
    [out, in]), else transformers' float [in, out] transposed."""
    try:
        blocks, scales = tensor(f"{name}_blocks"), tensor(f"{name}_scales")
    except KeyError:
        w = _plain_tensor(name, tensor(name))
        if w.dtype == torch.uint8:  # transformers' MXFP4 kernel modules: no float weight
            raise ValueError(
                f"{name}: MXFP4 weights kept packed by transformers' kernels; load the model "
                "with Mxfp4Config(dequantize=True), or read its checkpoint as stored"
            ) from None
        return w[expert].transpose(0, 1)
    # one expert at a time: a whole layer's float copy of a large model's experts is GBs
    return dequantize_mxfp4(blocks[expert], scales[expert], dtype)


def _biased_experts(
    tensor: Callable[[str], Any],
    prefix: str,
    config: MoeConfig,
    rank: int,
    world_size: int,
    quantize: str,
    dtype: torch.dtype,
) -> tuple[list[AnyLinear], list[AnyLinear]]:
    """gpt-oss's experts (see the module docstring), rank `rank`'s columns: gate/up
    de-interleaved into gate rows then up rows, each with its bias; down with its bias, which
    rank 0 alone adds (the ranks' outputs are partial sums)."""
    inter = config.intermediate_size
    lo, hi = _split(inter, "an expert intermediate size", rank, world_size)
    at = f"{prefix}.experts"
    gate_up_bias = dequantized(tensor(f"{at}.gate_up_proj_bias"), dtype)  # [E, 2I], interleaved
    down_bias = dequantized(tensor(f"{at}.down_proj_bias"), dtype)  # [E, hidden]
    ups, downs = [], []
    for e in range(config.num_experts):
        w = _expert_weight(tensor, f"{at}.gate_up_proj", e, dtype)  # [2I, hidden]
        d = _expert_weight(tensor, f"{at}.down_proj", e, dtype)  # [hidden, I]
        if w.shape[0] != 2 * inter or d.shape[1] != inter:
            raise ValueError(f"{at}: expert weights do not match intermediate size {inter}")
        gate, up = w[0::2], w[1::2]  # interleaved columns: gate even, up odd
        gb, ub = gate_up_bias[e, 0::2], gate_up_bias[e, 1::2]
        # copies: contiguous, and the stacked tensors can be freed
        fused = torch.cat((gate[lo:hi], up[lo:hi]))
        bias = torch.cat((gb[lo:hi], ub[lo:hi]))
        ups.append(make_linear(fused, bias, quantize, dtype=dtype))
        db = down_bias[e].clone() if rank == 0 else None
        downs.append(make_linear(d[:, lo:hi].contiguous(), db, quantize, dtype=dtype))
    return ups, downs


def _kept_quantized(gate: Any, up: Any, down: Any, inter: int) -> AnyWeight | None:
    """A shared expert's gate and up fused as the file holds them (a GGUF file's quantized
    ffn_gate_shexp and ffn_up_shexp, of one layout, and a quantized down), so that its linears
    are `quantize`'s of the stored weights, as a dense MLP's are; None where any is a float
    tensor or the layouts differ (then each is dequantized)."""
    if any(isinstance(w, torch.Tensor) for w in (gate, up, down)):
        return None
    if gate.shape != up.shape or gate.shape[0] != inter or down.shape[1] != inter:
        return None
    return cat_weights([gate, up])


def _shared_expert(
    tensor: Callable[[str], Any],
    at: str,
    inter: int,
    rank: int,
    world_size: int,
    quantize: str,
    dtype: torch.dtype,
) -> tuple[AnyLinear, AnyLinear]:
    """The shared expert at `at`: its gate/up and down linears, rank `rank`'s columns."""
    lo, hi = _split(inter, "a shared expert intermediate size", rank, world_size)
    name, first = _first(tensor, [f"{at}.input_linear.weight", f"{at}.gate_proj.weight"])
    gate_up: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    if name.endswith("input_linear.weight"):  # Granite's: [gate; up] in one weight
        gate_up, down = _plain_tensor(name, first), _weight(tensor, f"{at}.output_linear.weight")
        rows = gate_up.shape[0] // 2
    else:
        up, down_w = tensor(f"{at}.up_proj.weight"), tensor(f"{at}.down_proj.weight")
        kept = _kept_quantized(first, up, down_w, inter) if world_size == 1 else None
        if kept is not None:
            return make_linear(kept, None, quantize, dtype=dtype), make_linear(
                down_w, None, quantize, dtype=dtype
            )
        gate_up = (_plain_tensor(name, first), _plain_tensor(name, up))
        down = _plain_tensor(name, down_w)
        rows = gate_up[0].shape[0] if gate_up[1].shape == gate_up[0].shape else -1
    if rows != inter or down.shape[1] != inter:
        raise ValueError(f"{at}: shared expert weights do not match intermediate size {inter}")
    return _gated_mlp(gate_up, down, inter, lo, hi, quantize, dtype)
