"""The Gated DeltaNet mixer (arch/gdn.py) against transformers' Qwen3-Next and Qwen3.5 layers
(forward from a zero cache, then decode steps on that cache), and the parity contract of
arch/mixer.py: a prefill split at multiples of STATE_BLOCK gives one call's bits, and a row of
a step gives its bits whatever the other rows and the batch size."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from transformers import DynamicCache, Qwen3NextConfig
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from neuronpy.arch.gdn import GatedDeltaNet, take_gdn
from neuronpy.arch.mixer import STATE_BLOCK

PREFIX = "model.layers.0.linear_attn"
HIDDEN = 64
T = 150
# (family, key heads, value heads, key head dim, value head dim)
SHAPES = {
    "qwen3_next": ("qwen3_next", 2, 4, 16, 32),  # 2 value heads per key head: the interleave
    "qwen3_next-mha": ("qwen3_next", 2, 2, 32, 16),
    "qwen3_5": ("qwen3_5", 2, 6, 32, 16),
}
ATOL = 1e-4


def reference(name: str) -> tuple[torch.nn.Module, Any]:
    return reference_of(*SHAPES[name])


def reference_of(
    family: str, nk: int, nv: int, dk: int, dv: int, hidden: int = HIDDEN
) -> tuple[torch.nn.Module, Any]:
    """transformers' layer of this shape, seeded, with non-trivial decays, biases and norms."""
    kw = dict(
        hidden_size=hidden,
        linear_num_key_heads=nk,
        linear_num_value_heads=nv,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        linear_conv_kernel_dim=4,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
    )
    torch.manual_seed(0)
    if family == "qwen3_next":
        config: Any = Qwen3NextConfig(**kw)
        module: torch.nn.Module = Qwen3NextGatedDeltaNet(config, 0)
    else:
        config = Qwen3_5TextConfig(**kw)
        module = Qwen3_5GatedDeltaNet(config, 0)
    with torch.no_grad():  # decays from fast to slow, non-trivial biases and norm weights
        module.A_log.copy_(torch.empty(nv).uniform_(0.05, 2.0).log())
        module.dt_bias.copy_(torch.randn(nv))
        module.norm.weight.copy_(1 + 0.3 * torch.randn(dv))
    return module.eval(), config


@pytest.fixture(scope="module", params=list(SHAPES))
def layer(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, Any, GatedDeltaNet]:
    module, config = reference(request.param)
    return module, config, native(module, config)


def native(module: torch.nn.Module, config: Any) -> GatedDeltaNet:
    """Our layer of transformers' `module`'s weights."""
    weights = {f"{PREFIX}.{k}": v.detach().clone() for k, v in module.state_dict().items()}

    def tensor(name: str) -> torch.Tensor:
        if name not in weights:
            raise KeyError(name)
        return weights[name]

    return take_gdn(tensor, PREFIX, config, "none", torch.float32)


def zeros(gdn: GatedDeltaNet, rows: int) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros(rows, *s.shape, dtype=s.dtype) for s in gdn.state_specs())


def inputs(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def prefill_in(gdn: GatedDeltaNet, x: torch.Tensor, cuts: list[int]) -> tuple[torch.Tensor, ...]:
    """x prefilled from a zero state in calls [cuts[i], cuts[i + 1]): the outputs and state."""
    state = zeros(gdn, 1)
    outs = [gdn.prefill(x[lo:hi], state, lo) for lo, hi in itertools.pairwise(cuts)]
    return (torch.cat(outs), *state)


def test_state_specs(layer: tuple[torch.nn.Module, Any, GatedDeltaNet]) -> None:
    module, _, gdn = layer
    conv, rec = gdn.state_specs()
    assert conv.shape == (module.conv_dim, module.conv_kernel_size - 1)
    assert conv.dtype == torch.float32 and rec.dtype == torch.float32
    assert rec.shape == (module.num_v_heads, module.head_k_dim, module.head_v_dim)
    assert len(gdn.linears()) == 2  # one fused input projection, one output


def test_prefill_and_decode_match_transformers(
    layer: tuple[torch.nn.Module, Any, GatedDeltaNet],
) -> None:
    module, config, gdn = layer
    x = inputs(T + 4)
    cache = DynamicCache(config=config)
    with torch.no_grad():
        want = module(x[None, :T], cache=cache)[0]
    state = zeros(gdn, 1)
    got = gdn.prefill(x[:T], state, 0)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    ref = cache.layers[0]
    # the reference keeps the last K inputs of the convolution, this layer the K - 1 it needs
    torch.testing.assert_close(state[0], ref.conv_states[0][..., 1:], atol=0, rtol=0)
    torch.testing.assert_close(state[1], ref.recurrent_states[0], atol=ATOL, rtol=1e-4)
    for i in range(T, T + 4):
        with torch.no_grad():
            want = module(x[None, i : i + 1], cache=cache)[0]
        torch.testing.assert_close(gdn.step(x[i : i + 1], state), want, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(state[0], ref.conv_states[0][..., 1:], atol=1e-6, rtol=0)
    torch.testing.assert_close(state[1], ref.recurrent_states[0], atol=ATOL, rtol=1e-4)


def test_prefill_split_at_state_blocks_is_bitwise_one_call(
    layer: tuple[torch.nn.Module, Any, GatedDeltaNet],
) -> None:
    gdn = layer[2]
    x = inputs(T)
    whole = prefill_in(gdn, x, [0, T])
    b = STATE_BLOCK
    for cuts in ([0, b, T], [0, 2 * b, T], [0, b, 2 * b, T]):
        parts = prefill_in(gdn, x, cuts)
        for a, b in zip(whole, parts, strict=True):
            assert torch.equal(a, b), cuts


def test_prefill_split_elsewhere_is_close(
    layer: tuple[torch.nn.Module, Any, GatedDeltaNet],
) -> None:
    """Calls cut off a multiple of STATE_BLOCK cut a chunk in two: other arithmetic, close."""
    gdn = layer[2]
    x = inputs(T)
    whole = prefill_in(gdn, x, [0, T])
    for cuts in ([0, 30, T], [0, 100, T]):
        for a, b in zip(whole, prefill_in(gdn, x, cuts), strict=True):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)


def test_step_rows_are_batch_invariant(layer: tuple[torch.nn.Module, Any, GatedDeltaNet]) -> None:
    gdn = layer[2]
    rows = 16
    gen = torch.Generator().manual_seed(7)
    states = [
        tuple(torch.randn(1, *s.shape, generator=gen).to(s.dtype) for s in gdn.state_specs())
        for _ in range(rows)
    ]
    x = inputs(rows, seed=99)

    def stepped(index: list[int]) -> tuple[torch.Tensor, ...]:
        state = tuple(torch.cat([states[r][j] for r in index]) for j in range(2))
        return (gdn.step(x[index], state), *state)

    alone = [stepped([r]) for r in range(rows)]
    for index in ([0, 3, 5, 9, 14], list(range(8)), list(range(16)), [15, 2]):
        batched = stepped(index)
        for i, r in enumerate(index):
            for a, b in zip(batched, alone[r], strict=True):
                assert torch.equal(a[i], b[0]), (index, r)


def test_prefill_then_steps_close_to_one_prefill(
    layer: tuple[torch.nn.Module, Any, GatedDeltaNet],
) -> None:
    gdn = layer[2]
    x = inputs(T)
    whole = prefill_in(gdn, x, [0, T])
    state = zeros(gdn, 1)
    head = gdn.prefill(x[:128], state, 0)
    tail = [gdn.step(x[i : i + 1], state) for i in range(128, T)]
    for a, b in zip(whole, (torch.cat([head, *tail]), *state), strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)


def test_interleaved_layout_is_undone_at_load() -> None:
    """Qwen3-Next's fused rows land in Qwen3.5's order: [q | k | v | z] and [b | a] by head."""
    from neuronpy.arch.gdn import interleaved_ba_order, interleaved_qkvz_order

    order = interleaved_qkvz_order(2, 4, 1, 1)  # per key head: q, k, v v, z z
    assert order.tolist() == [0, 6, 1, 7, 2, 3, 8, 9, 4, 5, 10, 11]
    assert interleaved_ba_order(2, 4).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]


@pytest.mark.parametrize(("quantize", "tol"), [("int8-weight", 0.05), ("int4", 0.5)])
def test_quantized_projections(quantize: str, tol: float) -> None:
    """Every projection through make_linear: a weight-only mode stays near the float layer, and
    a step's rows keep their bits among others."""
    module, config = reference("qwen3_next")
    weights = {f"{PREFIX}.{k}": v.detach().clone() for k, v in module.state_dict().items()}
    plain = take_gdn(weights.__getitem__, PREFIX, config, "none", torch.float32)
    gdn = take_gdn(weights.__getitem__, PREFIX, config, quantize, torch.float32)
    x = inputs(T)
    torch.testing.assert_close(
        prefill_in(gdn, x, [0, T])[0], prefill_in(plain, x, [0, T])[0], atol=tol, rtol=0
    )
    gen = torch.Generator().manual_seed(3)
    state = tuple(torch.randn(5, *s.shape, generator=gen).to(s.dtype) for s in gdn.state_specs())
    alone = [gdn.step(x[r : r + 1], tuple(s[r : r + 1].clone() for s in state)) for r in range(5)]
    batched = gdn.step(x[:5], state)
    for r in range(5):
        assert torch.equal(batched[r], alone[r][0])


def test_a_lone_row_steps_as_it_does_among_others_at_a_real_width() -> None:
    """Qwen3.5-0.8B's linear-attention width (16 value heads of 128: a 2048-wide output
    projection), where oneDNN's packed product gives a lone row other bits than the same row
    among others: a step of one row == that row in a step of three, bit for bit."""
    hidden = 256
    gdn = native(*reference_of("qwen3_5", 16, 16, 128, 128, hidden))
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(3))
    states = [tuple(t.clone() for t in zeros(gdn, 3)) for _ in range(2)]
    together = gdn.step(x, states[0])
    alone = gdn.step(x[:1], tuple(t[:1].clone() for t in states[1]))
    assert torch.equal(alone, together[:1])
