"""The hybrid families' MoE blocks (arch/moe.py): Qwen3-Next's (softmax, top-k, and a shared
expert scaled by a sigmoid gate) and Granite-4.0-H's (top-k, then softmax over the k, and the
layer's shared MLP) against transformers' own modules, seeded random weights read in every
layout a checkpoint holds them, split over tensor-parallel ranks and quantized; Granite's
dense hybrids (no routed experts) as the shared MLP alone; and the configs that say so."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import GraniteMoeHybridConfig, Qwen3_5MoeTextConfig, Qwen3NextConfig
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
    GraniteMoeHybridMLP,
    GraniteMoeHybridMoE,
)
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from neuronpy.arch.config import ArchConfig
from neuronpy.arch.moe import MoeBlock, MoeConfig, moe_config, take_moe_block
from neuronpy.arch.weights import TensorParallelError, check_divisible
from tests.factories import hf_model

HIDDEN = 64
SIZES = (1, 5, 33)
TIGHT = {"atol": 1e-5, "rtol": 1e-5}
QWEN = "model.layers.1.mlp"
GRANITE = "model.layers.1.block_sparse_moe"
GRANITE_SHARED = "model.layers.1.shared_mlp"


def qwen_config(**kw: Any) -> Qwen3NextConfig:
    settings: dict[str, Any] = {
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "norm_topk_prob": True,
    }
    return Qwen3NextConfig(**(settings | kw))


def granite_config(**kw: Any) -> GraniteMoeHybridConfig:
    settings: dict[str, Any] = {
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "num_local_experts": 6,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "shared_intermediate_size": 48,
    }
    return GraniteMoeHybridConfig(**(settings | kw))


def randomized(*modules: torch.nn.Module, seed: int = 0) -> None:
    """Seeded random weights in place of transformers' init (its router starts at zero, its
    experts uninitialized); the shared expert's gate wide enough that its sigmoid spans
    (0, 1) over random tokens rather than sitting near one half."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in modules:
            for name, p in module.named_parameters():
                std = 0.4 if name == "shared_expert_gate.weight" else 0.1
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def qwen_block(config: Qwen3NextConfig) -> Qwen3NextSparseMoeBlock:
    block = Qwen3NextSparseMoeBlock(config).eval()
    randomized(block)
    return block


def granite_modules(config: GraniteMoeHybridConfig) -> tuple[GraniteMoeHybridMoE | None, Any]:
    moe = GraniteMoeHybridMoE(config).eval() if config.num_local_experts else None
    shared = GraniteMoeHybridMLP(config).eval()
    randomized(*(m for m in (moe, shared) if m is not None))
    return moe, shared


def lookup(params: dict[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """A checkpoint's `tensor`: KeyError for a name it does not hold."""

    def tensor(name: str) -> torch.Tensor:
        if name not in params:
            raise KeyError(name)
        return params[name]

    return tensor


def state(prefix: str, module: torch.nn.Module | None) -> dict[str, torch.Tensor]:
    """A module's parameters under a model's names, as transformers holds them."""
    if module is None:
        return {}
    return {f"{prefix}.{n}": p.detach() for n, p in module.named_parameters()}


def qwen_files(params: dict[str, torch.Tensor], inter: int) -> dict[str, torch.Tensor]:
    """The Qwens' checkpoint files' layout: each expert's gate, up and down apart."""
    out = {k: v for k, v in params.items() if ".experts." not in k}
    gate_up, down = params[f"{QWEN}.experts.gate_up_proj"], params[f"{QWEN}.experts.down_proj"]
    for e in range(gate_up.shape[0]):
        out[f"{QWEN}.experts.{e}.gate_proj.weight"] = gate_up[e, :inter].clone()
        out[f"{QWEN}.experts.{e}.up_proj.weight"] = gate_up[e, inter:].clone()
        out[f"{QWEN}.experts.{e}.down_proj.weight"] = down[e].clone()
    return out


def granite_files(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Granite's checkpoint files' names: the experts stacked as input_linear / output_linear,
    the router's weight under router.layer."""
    renames = {
        f"{GRANITE}.experts.gate_up_proj": f"{GRANITE}.input_linear.weight",
        f"{GRANITE}.experts.down_proj": f"{GRANITE}.output_linear.weight",
        f"{GRANITE}.router.weight": f"{GRANITE}.router.layer.weight",
    }
    return {renames.get(k, k): v for k, v in params.items()}


def inputs(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed + n))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()


def test_configs_say_which_layers_route_and_how() -> None:
    qwen = moe_config(qwen_config(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert qwen is not None and qwen.sparse_layers == (1,)  # 0 and 2 off-step, 3 dense
    assert (qwen.num_experts, qwen.top_k, qwen.intermediate_size) == (8, 2, 32)
    assert (qwen.shared_intermediate_size, qwen.shared_gate) == (48, True)
    assert qwen.norm_topk_prob and qwen.cast_weights and not qwen.topk_then_softmax
    assert not moe_config(qwen_config(norm_topk_prob=False)).norm_topk_prob  # type: ignore[union-attr]
    assert moe_config(qwen_config(num_experts=0)).sparse_layers == ()  # type: ignore[union-attr]
    text = Qwen3_5MoeTextConfig(hidden_size=HIDDEN, num_hidden_layers=3, num_experts=4)
    qwen35 = moe_config(text)
    assert qwen35 is not None and qwen35.sparse_layers == (0, 1, 2)
    assert qwen35.norm_topk_prob and qwen35.shared_gate  # always renormalized
    granite = moe_config(granite_config())
    assert granite == MoeConfig(
        num_experts=6,
        top_k=2,
        intermediate_size=32,
        norm_topk_prob=False,
        sparse_layers=(0, 1),
        shared_intermediate_size=48,
        topk_then_softmax=True,
    )
    dense = moe_config(granite_config(num_local_experts=0))
    assert dense is not None and (dense.num_experts, dense.top_k, dense.intermediate_size) == (
        0,
        0,
        0,
    )
    assert dense.sparse_layers == (0, 1) and dense.shared_intermediate_size == 48
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        moe_config(granite_config(hidden_act="gelu"))


@pytest.mark.parametrize("layout", ["transformers", "files"])
def test_qwen3_next_block_equals_transformers(layout: str) -> None:
    config = qwen_config()
    reference = qwen_block(config)
    moe = moe_config(config)
    assert moe is not None
    params = state(QWEN, reference)
    if layout == "files":
        params = qwen_files(params, moe.intermediate_size)
    block = take_moe_block(lookup(params), QWEN, moe)
    assert block.shared_gate is not None and block.shared_gate.kind == "float32"
    for n in SIZES:
        x = inputs(n)
        with torch.no_grad():
            _, ref_weights, ref_experts = reference.gate(x)
            expected = reference(x[None])[0]
            gates = torch.sigmoid(reference.shared_expert_gate(x))
        assert n < 33 or (gates.min() < 0.2 and gates.max() > 0.8)  # no constant gate
        weights, experts = block.route(x)
        assert torch.equal(experts, ref_experts)
        torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(block(x), expected, **TIGHT)


@pytest.mark.parametrize("layout", ["transformers", "files"])
def test_granite_block_equals_transformers(layout: str) -> None:
    config = granite_config()
    moe_module, shared = granite_modules(config)
    assert moe_module is not None
    moe = moe_config(config)
    assert moe is not None
    params = state(GRANITE, moe_module) | state(GRANITE_SHARED, shared)
    if layout == "files":
        params = granite_files(params)
    block = take_moe_block(lookup(params), GRANITE, moe, shared_prefix=GRANITE_SHARED)
    assert block.shared_gate is None
    for n in SIZES:
        x = inputs(n)
        with torch.no_grad():
            _, ref_weights, ref_experts = moe_module.router(x)
            expected = moe_module(x[None])[0] + shared(x)
        weights, experts = block.route(x)
        assert torch.equal(experts, ref_experts)
        torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(weights.sum(-1), torch.ones(n))  # softmax over the k
        torch.testing.assert_close(block(x), expected, **TIGHT)


def test_granite_without_routed_experts_is_its_shared_mlp() -> None:
    config = granite_config(num_local_experts=0)
    _, shared = granite_modules(config)
    moe = moe_config(config)
    assert moe is not None
    block = take_moe_block(
        lookup(state(GRANITE_SHARED, shared)), GRANITE, moe, shared_prefix=GRANITE_SHARED
    )
    assert block.router is None and block.gate_up == [] and len(block.linears()) == 2
    for n in SIZES:
        x = inputs(n)
        with torch.no_grad():
            expected = shared(x)
        torch.testing.assert_close(block(x), expected, **TIGHT)
    with pytest.raises(ValueError, match="routes nothing"):
        block.route(inputs(1))


def built(
    family: str, shared: int = 48
) -> tuple[dict[str, torch.Tensor], MoeConfig, dict[str, Any]]:
    """A family's parameters (a shared expert of `shared` columns), its MoeConfig and the
    take_moe_block keywords it needs."""
    if family == "qwen3_next":
        config: Any = qwen_config(shared_expert_intermediate_size=shared)
        params, kw = state(QWEN, qwen_block(config)), {"prefix": QWEN}
    else:
        config = granite_config(shared_intermediate_size=shared)
        moe_module, mlp = granite_modules(config)
        params = state(GRANITE, moe_module) | state(GRANITE_SHARED, mlp)
        kw = {"prefix": GRANITE, "shared_prefix": GRANITE_SHARED}
    moe = moe_config(config)
    assert moe is not None
    return params, moe, kw


def take(
    params: dict[str, torch.Tensor], moe: MoeConfig, kw: dict[str, Any], **more: Any
) -> MoeBlock:
    return take_moe_block(lookup(params), config=moe, **kw, **more)


@pytest.mark.parametrize("family", ["qwen3_next", "granite"])
def test_expert_and_shared_expert_shards_sum_to_the_whole_block(family: str) -> None:
    """Every expert's and the shared expert's intermediate columns split over 2 ranks, the
    router and the shared expert's gate replicated: the ranks' outputs sum to the block's."""
    params, moe, kw = built(family)
    whole = take(params, moe, kw)
    ranks = [take(params, moe, kw, rank=r, world_size=2) for r in range(2)]
    assert ranks[0].config.intermediate_size == moe.intermediate_size // 2
    assert ranks[0].config.shared_intermediate_size == moe.shared_intermediate_size // 2
    for n in SIZES:
        x = inputs(n)
        torch.testing.assert_close(ranks[0](x) + ranks[1](x), whole(x), **TIGHT)
    # 32 columns split 32 ways, the shared expert's 48 do not
    with pytest.raises(ValueError, match="shared expert intermediate size of 48 does not split 32"):
        take(params, moe, kw, world_size=32)


@pytest.mark.parametrize("mode", ["int8-weight", "int4"])
@pytest.mark.parametrize("family", ["qwen3_next", "granite"])
def test_quantized_experts_stay_close_to_float(family: str, mode: str) -> None:
    """Every expert and the shared one quantized alike, the router and the shared gate kept
    float: the same routing as the float block, and nearly its output."""
    params, moe, kw = built(family, shared=64)  # int4's groups of 32 inputs
    exact = take(params, moe, kw)
    block = take(params, moe, kw, quantize=mode)
    assert block.shared_gate_up is not None and block.shared_down is not None
    kinds = {
        lin.kind for lin in [*block.gate_up, *block.down, block.shared_gate_up, block.shared_down]
    }
    assert len(kinds) == 1 and kinds != {"float32"}
    assert block.router is not None and block.router.kind == "float32"
    x = inputs(64)
    assert torch.equal(block.route(x)[1], exact.route(x)[1])
    assert cosine(block(x), exact(x)) > 0.95


def test_splits_that_cut_the_shared_expert_are_refused() -> None:
    config = ArchConfig.from_hf(hf_model("tiny-qwen3-moe").config)
    assert config.moe is not None

    def with_shared(size: int) -> ArchConfig:
        moe = dataclasses.replace(config.moe, shared_intermediate_size=size)  # type: ignore[arg-type]
        return dataclasses.replace(config, moe=moe)

    check_divisible(with_shared(48), 2)
    with pytest.raises(TensorParallelError, match="shared_expert_intermediate_size = 33 is not"):
        check_divisible(with_shared(33), 2)
