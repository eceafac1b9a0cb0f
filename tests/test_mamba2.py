"""The Mamba2 mixer (arch/mamba2.py) against transformers' GraniteMoeHybrid mamba layer (its
torch path, with the model's cache), and the parity contract: splits at multiples of
STATE_BLOCK give the same bits as one call, a step's row the same bits whatever the batch."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from transformers import DynamicCache, GraniteMoeHybridConfig
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
    GraniteMoeHybridMambaLayer,
)

from neuronpy.arch.mamba2 import Mamba2Mixer, Mamba2Shape, take_mamba2
from neuronpy.arch.mixer import STATE_BLOCK

PREFIX = "model.layers.0.mamba"
HIDDEN = 64


def config(groups: int) -> GraniteMoeHybridConfig:
    """A tiny Granite 4 hybrid: a mamba layer, then an attention one."""
    return GraniteMoeHybridConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        layer_types=["mamba", "attention"],
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_n_groups=groups,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=256,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )


def reference(groups: int) -> tuple[GraniteMoeHybridConfig, GraniteMoeHybridMambaLayer]:
    """The reference layer with seeded random weights, its per-head constants non-trivial."""
    cfg = config(groups)
    torch.manual_seed(groups)
    layer = GraniteMoeHybridMambaLayer(cfg, 0).eval()
    heads = cfg.mamba_n_heads
    with torch.no_grad():
        layer.A_log.copy_(torch.log(torch.linspace(0.5, 12.0, heads)))
        layer.dt_bias.copy_(torch.randn(heads) - 2.0)
        layer.D.copy_(torch.randn(heads))
        layer.norm.weight.copy_(1 + 0.2 * torch.randn_like(layer.norm.weight))
    return cfg, layer


def ours(cfg: GraniteMoeHybridConfig, layer: GraniteMoeHybridMambaLayer, quantize: str = "none"):
    weights = {f"{PREFIX}.{k}": v.detach() for k, v in layer.state_dict().items()}
    return take_mamba2(weights.__getitem__, PREFIX, cfg, quantize, torch.float32)


def zero_state(mixer: Mamba2Mixer, rows: int = 1) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros(rows, *spec.shape, dtype=spec.dtype) for spec in mixer.state_specs())


def random_state(mixer: Mamba2Mixer, rows: int) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(rows, *spec.shape, dtype=spec.dtype) for spec in mixer.state_specs())


def clone(state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.clone() for t in state)


@pytest.fixture(scope="module", params=[1, 2], ids=["groups1", "groups2"])
def pair(request: pytest.FixtureRequest):
    cfg, layer = reference(request.param)
    return cfg, layer, ours(cfg, layer)


def test_state_specs_and_linears(pair) -> None:
    cfg, _, mixer = pair
    conv_dim = 2 * HIDDEN + 2 * cfg.mamba_n_groups * cfg.mamba_d_state
    window, ssm = mixer.state_specs()
    assert window.shape == (conv_dim, 3) and window.dtype == torch.float32
    assert ssm.shape == (8, 16, 16) and ssm.dtype == torch.float32
    assert [lin.out_features for lin in mixer.linears()] == [2 * HIDDEN + conv_dim + 8, HIDDEN]


@torch.no_grad()
def test_prefill_and_decode_match_the_reference(pair) -> None:
    """Prefill of 150 tokens from a zero state, then 6 decode steps, against transformers'
    layer with its cache: outputs, and the conv and SSM states after each."""
    cfg, layer, mixer = pair
    torch.manual_seed(7)
    x = torch.randn(1, 156, HIDDEN)
    cache = DynamicCache(config=cfg)
    want = layer(x[:, :150], cache=cache)[0]
    state = zero_state(mixer)
    got = mixer.prefill(x[0, :150], state, 0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state[0], cache.get_conv_state(0)[..., 1:], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(state[1], cache.get_recurrent_state(0), atol=1e-4, rtol=1e-4)
    for i in range(150, 156):
        want = layer(x[:, i : i + 1], cache=cache)[0]
        got = mixer.step(x[:, i], state)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(state[0], cache.get_conv_state(0)[..., 1:], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(state[1], cache.get_recurrent_state(0), atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_prefill_from_a_state_matches_the_reference(pair) -> None:
    """A second prefill continues from the state the first left (the reference's cache
    carries it into its chunked scan too)."""
    cfg, layer, mixer = pair
    torch.manual_seed(8)
    x = torch.randn(1, 100, HIDDEN)
    cache = DynamicCache(config=cfg)
    layer(x[:, :40], cache=cache)
    want = layer(x[:, 40:], cache=cache)[0]
    state = zero_state(mixer)
    mixer.prefill(x[0, :40], state, 0)
    got = mixer.prefill(x[0, 40:], state, 40)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state[1], cache.get_recurrent_state(0), atol=1e-4, rtol=1e-4)


def prefill_in_parts(mixer: Mamba2Mixer, x: torch.Tensor, cuts: list[int]):
    state = zero_state(mixer)
    bounds = [0, *cuts, x.shape[0]]
    out = torch.cat([mixer.prefill(x[a:b], state, a) for a, b in itertools.pairwise(bounds)])
    return out, state


@torch.no_grad()
@pytest.mark.parametrize("cuts", [[64], [128], [64, 128]])
def test_prefill_split_at_state_blocks_gives_the_same_bits(pair, cuts: list[int]) -> None:
    _, _, mixer = pair
    assert all(c % STATE_BLOCK == 0 for c in cuts)
    x = torch.randn(150, HIDDEN, generator=torch.Generator().manual_seed(9))
    whole, whole_state = prefill_in_parts(mixer, x, [])
    parts, parts_state = prefill_in_parts(mixer, x, cuts)
    assert torch.equal(parts, whole)
    assert all(torch.equal(a, b) for a, b in zip(parts_state, whole_state, strict=True))


@torch.no_grad()
@pytest.mark.parametrize("cuts", [[1], [50], [100, 101], [130]])
def test_prefill_split_elsewhere_is_close(pair, cuts: list[int]) -> None:
    """Cuts off the blocks change the chunks, so the bits may move; the values may not."""
    _, _, mixer = pair
    x = torch.randn(150, HIDDEN, generator=torch.Generator().manual_seed(9))
    whole, whole_state = prefill_in_parts(mixer, x, [])
    parts, parts_state = prefill_in_parts(mixer, x, cuts)
    torch.testing.assert_close(parts, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(parts_state[1], whole_state[1], atol=1e-5, rtol=1e-5)


def step_rows(
    mixer: Mamba2Mixer, x: torch.Tensor, state: tuple[torch.Tensor, ...], rows: list[int]
):
    """Step the given rows of x and state as one batch: their outputs and states after."""
    s = clone(tuple(t[rows] for t in state))
    return mixer.step(x[rows], s), s


@torch.no_grad()
def test_step_rows_are_independent_of_the_batch(pair) -> None:
    """Rows with different states stepped together (5, 8, 16 rows, and 16 shuffled) == each
    stepped alone, bitwise, outputs and states."""
    _, _, mixer = pair
    torch.manual_seed(10)
    x = torch.randn(16, HIDDEN)
    state = random_state(mixer, 16)
    alone = [step_rows(mixer, x, state, [row]) for row in range(16)]
    shuffled = torch.randperm(16, generator=torch.Generator().manual_seed(3)).tolist()
    for rows in (list(range(5)), list(range(8)), list(range(16)), shuffled):
        out, s = step_rows(mixer, x, state, rows)
        for at, row in enumerate(rows):
            want_out, want_state = alone[row]
            assert torch.equal(out[at], want_out[0]), (len(rows), row)
            assert all(torch.equal(a[at], b[0]) for a, b in zip(s, want_state, strict=True)), (
                len(rows),
                row,
            )


@torch.no_grad()
def test_prefill_then_steps_is_close_to_one_prefill(pair) -> None:
    _, _, mixer = pair
    x = torch.randn(150, HIDDEN, generator=torch.Generator().manual_seed(11))
    whole, whole_state = prefill_in_parts(mixer, x, [])
    state = zero_state(mixer)
    outs = [mixer.prefill(x[:100], state, 0)]
    outs += [mixer.step(x[i : i + 1], state) for i in range(100, 150)]
    torch.testing.assert_close(torch.cat(outs), whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state[0], whole_state[0], atol=0, rtol=0)
    torch.testing.assert_close(state[1], whole_state[1], atol=1e-4, rtol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("quantize", ["int8-weight", "int4"])
def test_quantized_projections_stay_close(pair, quantize: str) -> None:
    cfg, layer, mixer = pair
    quant = ours(cfg, layer, quantize)
    assert all(
        type(q) is not type(f) for q, f in zip(quant.linears(), mixer.linears(), strict=True)
    )
    x = torch.randn(70, HIDDEN, generator=torch.Generator().manual_seed(12))
    want = mixer.prefill(x, zero_state(mixer), 0)
    got = quant.prefill(x, zero_state(quant), 0)
    assert (got - want).norm() / want.norm() < (0.15 if quantize == "int4" else 0.02)


def test_time_step_limit_clamps_prefill_as_the_reference_does() -> None:
    cfg, layer = reference(1)
    cfg.time_step_limit = layer.time_step_limit = (0.05, 0.2)
    mixer = ours(cfg, layer)
    assert mixer.shape.dt_limit == (0.05, 0.2)
    x = torch.randn(1, 70, HIDDEN, generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        want = layer(x, cache=DynamicCache(config=cfg))[0]
        got = mixer.prefill(x[0], zero_state(mixer), 0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_shape_from_other_families_configs() -> None:
    """Mamba2 and Nemotron-H name the same geometry otherwise; Falcon-H1's mixer differs."""
    from transformers import FalconH1Config, Mamba2Config, NemotronHConfig
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HfMamba2
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    m2 = Mamba2Config(hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=2)
    nh = NemotronHConfig(
        hidden_size=64, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2
    )
    for cfg, module in ((m2, HfMamba2(m2, 0)), (nh, NemotronHMamba2Mixer(nh, 0))):
        shape = Mamba2Shape.from_hf(cfg)
        assert (shape.num_heads, shape.head_dim, shape.state_size, shape.n_groups) == (
            module.num_heads,
            module.head_dim,
            module.ssm_state_size,
            module.n_groups,
        )
        assert shape.inner == module.intermediate_size and shape.conv_dim == module.conv_dim
        assert shape.conv_kernel == module.conv_kernel_size
        assert shape.eps == module.norm.variance_epsilon
        assert shape.dt_limit == tuple(module.time_step_limit) or module.time_step_limit == (
            0.0,
            math.inf,
        )
    with pytest.raises(ValueError, match="falcon_h1"):
        Mamba2Shape.from_hf(FalconH1Config())
