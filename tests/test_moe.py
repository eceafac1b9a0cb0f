"""Mixture-of-experts models (arch/moe.py): the router and the grouped experts against
transformers' block, only the experts a step routes to running, every quantize mode per
expert, the tensor-parallel split of every expert, one compiled graph for any routing, and an
engine's concurrent requests against one at a time."""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch
import torch._dynamo

from neuronpy.arch.config import ArchConfig
from neuronpy.arch.llama import LlamaModel
from neuronpy.arch.moe import MoeBlock
from neuronpy.arch.weights import TensorParallelError, check_divisible
from tests.factories import MOE_FAMILIES, hf_model, make_engine, tokenizer
from tests.test_engine_parity import MAX_TOKENS, TEXTS, concurrently, greedy, one_at_a_time, summary
from tests.test_tp import TOL, split_prefill

TEXT = "The quick brown fox jumps over the lazy dog"


def native(name: str, **kw: Any) -> LlamaModel:
    return LlamaModel.from_hf(hf_model(name), **kw)


def sparse_blocks(model: LlamaModel) -> list[tuple[int, MoeBlock]]:
    return [(i, lw.moe) for i, lw in enumerate(model.layers) if lw.moe is not None]


def test_configs_say_which_layers_route_and_how() -> None:
    qwen = ArchConfig.from_hf(hf_model("tiny-qwen3-moe").config)
    assert qwen.moe is not None and qwen.moe.sparse_layers == (1,)  # layer 0 is dense
    assert (qwen.intermediate_size, qwen.moe.intermediate_size) == (128, 32)
    assert (qwen.moe.num_experts, qwen.moe.top_k, qwen.moe.norm_topk_prob) == (8, 2, True)
    assert qwen.qk_norm and not qwen.qk_norm_full
    mixtral = ArchConfig.from_hf(hf_model("tiny-mixtral").config)
    assert mixtral.moe is not None and mixtral.moe.sparse_layers == (0, 1)
    assert mixtral.moe.norm_topk_prob and not mixtral.qk_norm  # Mixtral always renormalizes
    olmoe = ArchConfig.from_hf(hf_model("tiny-olmoe").config)
    assert olmoe.moe is not None and not olmoe.moe.norm_topk_prob
    assert olmoe.qk_norm and olmoe.qk_norm_full
    assert ArchConfig.from_hf(hf_model("tiny-qwen3").config).moe is None
    model = native("tiny-qwen3-moe")
    assert model.layers[0].moe is None and model.layers[0].gate_up is not None
    assert model.layers[1].moe is not None and model.layers[1].gate_up is None


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_router_and_grouped_experts_equal_transformers_block(name: str) -> None:
    """Random hidden states through each sparse layer's block: the same experts for every
    token, the same routing weights, the same output."""
    hf = hf_model(name)
    model = native(name)
    gen = torch.Generator().manual_seed(0)
    for layer, block in sparse_blocks(model):
        x = torch.randn(53, 64, generator=gen)
        reference = hf.model.layers[layer].mlp
        with torch.no_grad():
            # (gpt-oss names its router `router`, and its block returns the routing too)
            router = reference.router if hasattr(reference, "router") else reference.gate
            _, ref_weights, ref_experts = router(x)
            out = reference(x[None])
            expected = (out[0] if isinstance(out, tuple) else out)[0]
        weights, experts = block.route(x)
        assert torch.equal(experts, ref_experts)
        torch.testing.assert_close(weights, ref_weights.float(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(block(x), expected, atol=1e-5, rtol=1e-5)
        if not block.config.norm_topk_prob and not block.config.topk_then_softmax:
            # OLMoE: the k probabilities sum to less than 1
            assert weights.sum(-1).max() < 1 - 1e-3


def test_glm4_moe_fixture_routing_features_change_the_logits() -> None:
    """GLM-4.5's fixture: layer 0 dense, layer 1 routed with a shared expert; its score bias,
    group limiting and scaling each move the logits (parity on the fixture covers them)."""
    config = ArchConfig.from_hf(hf_model("tiny-glm4-moe").config)
    assert config.moe is not None and config.moe.sparse_layers == (1,)
    assert (config.moe.n_group, config.moe.topk_group, config.moe.scoring) == (2, 1, "sigmoid")
    assert config.qk_norm and config.rotary_dim == 8 and config.head_dim == 16
    model = native("tiny-glm4-moe")
    assert model.layers[0].moe is None and model.layers[0].gate_up is not None
    block = model.layers[1].moe
    assert block is not None and block.shared_gate_up is not None and block.shared_gate is None
    ids = tokenizer("tiny-glm4-moe").encode(TEXT)
    want = model.logits(model.prefill(ids)[1])
    torch.testing.assert_close(
        want, hf_model("tiny-glm4-moe")(torch.tensor([ids])).logits[0], atol=2e-4, rtol=1e-4
    )
    assert block.score_bias is not None
    for change in (
        {"score_bias": torch.zeros_like(block.score_bias)},
        {"config": dataclasses.replace(block.config, topk_group=2)},
        {"config": dataclasses.replace(block.config, routed_scaling_factor=1.0)},
    ):
        kept = {name: getattr(block, name) for name in change}
        for name, value in change.items():
            setattr(block, name, value)
        moved = (model.logits(model.prefill(ids)[1]) - want).abs().max()
        assert moved > 1e-2, change
        for name, value in kept.items():
            setattr(block, name, value)


class Counted:
    """A projection that counts its calls and the rows it was given."""

    def __init__(self, inner: Any, calls: Counter[int], rows: Counter[int], expert: int) -> None:
        self.inner, self.calls, self.rows, self.expert = inner, calls, rows, expert

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls[self.expert] += 1
        self.rows[self.expert] += x.shape[0]
        return self.inner(x)


def test_a_step_runs_only_the_experts_its_tokens_route_to_once_each() -> None:
    model = native("tiny-mixtral")
    (_, block), _ = sparse_blocks(model)
    calls: Counter[int] = Counter()
    rows: Counter[int] = Counter()
    block.gate_up = [Counted(g, calls, rows, e) for e, g in enumerate(block.gate_up)]
    gen = torch.Generator().manual_seed(1)
    for n in (1, 2, 40):
        x = torch.randn(n, 64, generator=gen)
        calls.clear()
        rows.clear()
        expected = block(x)
        _, experts = block.route(x)
        chosen = Counter(experts.flatten().tolist())
        assert calls == Counter(dict.fromkeys(chosen, 1))  # one pass per expert present
        assert rows == chosen  # over exactly the tokens routed to it
        if n == 1:
            assert len(calls) == block.config.top_k < block.config.num_experts
        # the same output as every expert running over every token, weighted by the routing
        weights, experts = block.route(x)
        dense = torch.zeros_like(x)
        for e in range(block.config.num_experts):
            gate, up = block.gate_up[e].inner(x).chunk(2, dim=-1)  # type: ignore[attr-defined]
            out = block.down[e](torch.nn.functional.silu(gate) * up)
            dense += out * (weights * (experts == e)).sum(-1, keepdim=True)
        torch.testing.assert_close(expected, dense, atol=1e-5, rtol=1e-5)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-glm4-moe", "tiny-gpt-oss"])
@pytest.mark.parametrize("mode", ["int8", "int8-weight", "int4"])
def test_quantized_experts_stay_close_to_float(mode: str, name: str) -> None:
    """Each expert quantized alike (GLM-4.5's shared expert too), the router kept float: each
    block routes random hidden states as the float one does and computes nearly its output;
    int8's logits stay close to the float model's (int4's, on these tiny random weights, are
    as rough as a dense fixture's: not checked)."""
    ids = tokenizer(name).encode(TEXT)
    exact = native(name)
    model = native(name, quantize=mode, calibration_ids=ids)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    for (_, block), (_, float_block) in zip(
        sparse_blocks(model), sparse_blocks(exact), strict=True
    ):
        shared = [lin for lin in (block.shared_gate_up, block.shared_down) if lin is not None]
        kinds = {lin.kind for lin in block.gate_up + block.down + shared}
        assert len(kinds) == 1 and kinds != {"float32"}  # every expert quantized alike
        assert block.router.kind == "float32"  # the router never is
        assert torch.equal(block.route(x)[1], float_block.route(x)[1])
        assert cosine(block(x), float_block(x)) > 0.95
    assert model.weight_bytes() < exact.weight_bytes()
    if mode == "int8":
        want = exact.logits(exact.prefill(ids)[1])
        assert cosine(model.logits(model.prefill(ids)[1]), want) > 0.95


def test_weight_counts_include_every_expert() -> None:
    hf = hf_model("tiny-mixtral")
    model = native("tiny-mixtral")
    params = sum(p.nbytes for p in hf.parameters())
    assert model.weight_bytes() == params
    # per layer: qkv, o_proj, the router and 8 experts' two projections
    assert model.describe_weights().startswith("projections: 38 float32;")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_block_equals_transformers_in_float32_and_bfloat16(dtype: torch.dtype) -> None:
    """gpt-oss's block (the router's bias, top-k then softmax, the interleaved gate/up turned
    into gate rows then up rows, the biases, the clamped SwiGLU) against transformers'
    GptOssMLP on random hidden states large enough to clamp: float32 tightly, bfloat16 within
    its rounding (the same experts chosen)."""
    hf = copy.deepcopy(hf_model("tiny-gpt-oss")).to(dtype)
    model = native_of(hf)
    gen = torch.Generator().manual_seed(3)
    config = model.config.moe
    assert config is not None and config.swiglu_limit == 3.0 and config.router_bias
    for layer, block in sparse_blocks(model):
        x = (torch.randn(61, 64, generator=gen) * 2).to(dtype)
        reference = hf.model.layers[layer].mlp
        with torch.no_grad():
            _, ref_weights, ref_experts = reference.router(x)
            expected = reference(x[None])[0][0]
            # the clamp bites: some gate/up values of the experts past the limit
            up = x @ reference.experts.gate_up_proj[0] + reference.experts.gate_up_proj_bias[0]
            assert (up.abs() > config.swiglu_limit).float().mean() > 0.05
        weights, experts = block.route(x)
        assert torch.equal(experts, ref_experts)
        got = block(x)
        assert got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(weights.to(dtype), ref_weights, atol=1e-2, rtol=0)
            # (transformers rounds the product, then adds the bias and rounds again; a linear
            # layer with a bias rounds once: measured one bf16 step of the largest outputs)
            err = (got.float() - expected.float()).abs().max()
            assert err <= 0.01 * expected.float().abs().max(), err


def native_of(hf: Any, **kw: Any) -> LlamaModel:
    return LlamaModel.from_hf(hf, **kw)


@pytest.mark.parametrize(
    "name", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-glm4-moe", "tiny-gpt-oss"]
)
def test_parity_expert_shards_in_threads_match_one_device(name: str) -> None:
    """Every expert's intermediate columns split over 2 ranks (GLM-4.5's shared expert too),
    the router and its score bias replicated: the all-reduce after the MLP completes the
    block."""
    ids = tokenizer(name).encode(TEXT)
    model = native(name)
    expected = model.logits(model.prefill(ids)[1])
    torch.testing.assert_close(split_prefill(name, ids, "none"), expected, **TOL)


def test_splits_that_cut_experts_or_olmoe_norms_are_refused() -> None:
    config = native("tiny-qwen3-moe").config
    check_divisible(config, 2)
    assert config.moe is not None
    odd = dataclasses.replace(config, moe=dataclasses.replace(config.moe, intermediate_size=31))
    with pytest.raises(TensorParallelError, match=r"moe_intermediate_size = 31 is not divisible"):
        check_divisible(odd, 2)
    olmoe = native("tiny-olmoe").config
    check_divisible(olmoe, 1)
    with pytest.raises(TensorParallelError, match="q/k norm spans every attention head"):
        check_divisible(olmoe, 2)


def test_one_compiled_graph_serves_any_routing() -> None:
    """The block is an opaque operator: token counts and routings of every kind run the one
    graph, and give the eager answers."""
    eager = native("tiny-olmoe")
    compiled = native("tiny-olmoe")
    compiled.compile()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for ids in ([5], [12, 8], list(range(3, 60))):
            want = eager.prefill(ids)[1]
            torch.testing.assert_close(compiled.prefill(ids)[1], want, atol=1e-5, rtol=1e-5)


@pytest.mark.anyio
@pytest.mark.parametrize("compile", ["off", "on"])
async def test_parity_concurrent_equals_sequential_on_an_moe_model(compile: str) -> None:
    name = "tiny-qwen3-moe"
    tok = tokenizer(name)
    jobs = [(tok.encode(t), greedy(m)) for t, m in zip(TEXTS, MAX_TOKENS, strict=True)]
    async with make_engine(name, max_in_flight=1, compile=compile) as serial:
        expected = await one_at_a_time(serial, jobs)
    async with make_engine(name, max_in_flight=8, compile=compile) as engine:
        assert engine.model.compiled is (compile == "on")
        got = await concurrently(engine, jobs)
        assert engine.stats().max_batch_size >= 3
    assert [summary(c) for c in got] == [summary(c) for c in expected]
    assert all(c.completion_tokens for c in got)


# DeepSeek's MoE block (DeepSeek-V2, DeepSeek-V3, GLM-4.5), each routing variant against
# transformers' own block module: (model_type, config fields)
DEEPSEEK_BLOCKS = {
    "glm4_moe": (  # sigmoid scores, a score bias, 2 groups of which 1 kept
        "glm4_moe",
        dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1),
        dict(norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1),
    ),
    "deepseek_v3": (  # 4 groups of which 2 kept, 4 of 16 chosen, not renormalized
        "deepseek_v3",
        dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2),
        dict(norm_topk_prob=False, routed_scaling_factor=2.5, n_shared_experts=2),
    ),
    "deepseek_v2_greedy": (  # softmax scores, the top-k of all
        "deepseek_v2",
        dict(n_routed_experts=8, num_experts_per_tok=2, topk_method="greedy"),
        dict(routed_scaling_factor=1.0, n_shared_experts=2),
    ),
    "deepseek_v2_grouped": (  # softmax scores within the 2 of 4 groups of the best scores
        "deepseek_v2",
        dict(n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2),
        dict(topk_method="group_limited_greedy", routed_scaling_factor=16.0, n_shared_experts=1),
    ),
}


def deepseek_block(variant: str, dtype: torch.dtype) -> tuple[Any, MoeBlock]:
    """transformers' MoE block of `variant` with random weights (its router's weight and score
    bias float32, as transformers keeps them in a bfloat16 model), and neuronpy's of the same
    tensors."""
    import transformers

    from neuronpy.arch.moe import moe_config, take_moe_block

    model_type, routing, rest = DEEPSEEK_BLOCKS[variant]
    config_class, block_class = {
        "glm4_moe": (transformers.Glm4MoeConfig, "Glm4MoeMoE"),
        "deepseek_v3": (transformers.DeepseekV3Config, "DeepseekV3MoE"),
        "deepseek_v2": (transformers.DeepseekV2Config, "DeepseekV2Moe"),
    }[model_type]
    config = config_class(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        hidden_act="silu",
        **routing,
        **rest,
    )
    # the experts forward a loaded model runs by default (a block built alone would run the
    # per-expert loop, which rounds each expert's weighted output to bfloat16 before the sum)
    config._experts_implementation = "grouped_mm"
    module = getattr(transformers.models, model_type)
    reference = getattr(getattr(module, f"modeling_{model_type}"), block_class)(config).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.25 if "gate." not in name else 0.5))
        if hasattr(reference.gate, "e_score_correction_bias"):
            reference.gate.e_score_correction_bias.copy_(torch.randn(config.n_routed_experts) * 0.1)
        reference.to(dtype)
        reference.gate.float()  # transformers keeps the router float32 in any dtype
    tensors = {f"mlp.{k}": v for k, v in reference.state_dict().items()}

    def tensor(name: str) -> torch.Tensor:
        return tensors[name]

    moe = moe_config(config)
    assert moe is not None and moe.sparse_layers == (1, 2)  # layer 0 dense
    return reference, take_moe_block(tensor, "mlp", moe, dtype=dtype)


@pytest.mark.parametrize("variant", DEEPSEEK_BLOCKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepseek_routing_equals_transformers_block(variant: str, dtype: torch.dtype) -> None:
    """Random hidden states through transformers' block of each routing variant and
    neuronpy's: the same experts for every token, the same weights (float32, as transformers
    computes them whatever the dtype), and the same output (float32: within rounding;
    bfloat16: the same bits, as transformers' default experts forward sums in float32)."""
    reference, block = deepseek_block(variant, dtype)
    assert block.router is not None and block.router.kind == "float32"
    x = torch.randn(97, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    with torch.no_grad():
        _, ref_weights, ref_experts = reference.gate(x)
        expected = reference(x[None])[0]
    weights, experts = block.route(x)
    assert torch.equal(experts.sort(-1).values, ref_experts.sort(-1).values)
    assert weights.dtype == ref_weights.dtype == torch.float32
    torch.testing.assert_close(
        weights.gather(1, experts.argsort(-1)),
        ref_weights.gather(1, ref_experts.argsort(-1)),
        atol=1e-6,
        rtol=1e-6,
    )
    got = block(x)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:
        # (a unit of bfloat16 at the output's size at most, should the projections' sums
        # round otherwise)
        torch.testing.assert_close(got.float(), expected.float(), atol=0.1, rtol=1e-2)
    c = block.config
    if c.topk_group < c.n_group:  # group limiting bites: every token's experts in kept groups
        groups = experts // (c.num_experts // c.n_group)
        assert all(len(set(row)) <= c.topk_group for row in groups.tolist())


def test_deepseek_score_bias_chooses_but_does_not_weigh() -> None:
    """The score bias moves which experts are chosen; the weights are the unbiased scores."""
    _, block = deepseek_block("glm4_moe", torch.float32)
    assert block.score_bias is not None
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(5))
    experts = block.route(x)[1]
    block.score_bias = block.score_bias + torch.linspace(-2, 2, 8)  # favours the last experts
    moved_weights, moved = block.route(x)
    assert not torch.equal(moved.sort(-1).values, experts.sort(-1).values)
    scores = block.router(x).sigmoid().gather(1, moved)  # type: ignore[misc]
    want = scores / scores.sum(-1, keepdim=True) * block.config.routed_scaling_factor
    torch.testing.assert_close(moved_weights, want)


def test_deepseek_configs_refuse_what_transformers_would_build_otherwise() -> None:
    import transformers

    from neuronpy.arch.moe import moe_config

    base = dict(hidden_size=64, moe_intermediate_size=16, num_hidden_layers=4)
    base["num_experts_per_tok"] = 2
    v2 = moe_config(transformers.DeepseekV2Config(**base, first_k_dense_replace=2, n_group=2))
    assert v2 is not None and v2.sparse_layers == (2, 3)
    assert (v2.scoring, v2.n_group, v2.norm_topk_prob) == ("softmax", 1, False)  # greedy
    with pytest.raises(ValueError, match="moe_layer_freq 2"):
        moe_config(transformers.DeepseekV2Config(**base, moe_layer_freq=2))
    with pytest.raises(ValueError, match="topk_method 'noaux_tc'"):
        moe_config(transformers.DeepseekV2Config(**base, topk_method="noaux_tc"))
    v3 = moe_config(transformers.DeepseekV3Config(**base, n_shared_experts=2))
    assert v3 is not None and v3.shared_intermediate_size == 32 and not v3.shared_gate
    assert (v3.scoring, v3.score_bias, v3.group_score) == ("sigmoid", True, "top2")
