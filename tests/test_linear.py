"""Packed linear layers compute what F.linear computes, for any row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from neuronpy.arch.int8 import Int8Linear, onednn_int8
from neuronpy.arch.linear import Linear, make_linear


@pytest.mark.parametrize("rows", [1, 3, 8, 17])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 32, generator=gen)
    bias = torch.randn(48, generator=gen) if with_bias else None
    x = torch.randn(rows, 1, 32, generator=gen)  # [B, T, in], as the decode step calls it
    lin = Linear(weight, bias)
    torch.testing.assert_close(lin(x), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lin(x[:, 0]), F.linear(x[:, 0], weight, bias), atol=1e-5, rtol=1e-5)


def test_packing_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURON_ONEDNN", "0")
    weight = torch.randn(4, 4)
    lin = Linear(weight)
    assert not lin.packed and lin.weight is weight


def test_cpu_float32_weights_are_packed_where_onednn_exists() -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch build has no oneDNN")
    assert Linear(torch.randn(4, 4)).packed
    assert not Linear(torch.randn(4, 4, dtype=torch.float64)).packed


INT8_KERNELS = [
    "fbgemm",
    pytest.param(
        "onednn",
        marks=pytest.mark.skipif(not onednn_int8(), reason="this PyTorch has no oneDNN int8"),
    ),
]


@pytest.mark.parametrize("kernel", INT8_KERNELS)
def test_int8_linear_is_close_and_bitwise_independent_of_other_rows(kernel: str) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 48, generator=gen) * 0.1
    bias = torch.randn(64, generator=gen)
    x = torch.randn(9, 1, 48, generator=gen) * torch.logspace(-2, 2, 9)[:, None, None]
    lin = Int8Linear(weight, bias, kernel=kernel)
    assert lin.kernel == kernel
    y = lin(x)
    ref = F.linear(x, weight, bias)
    # int8 weights and activations: within a few percent of each row's magnitude
    assert ((y - ref).abs().amax(-1) <= 0.03 * ref.abs().amax(-1) + 1e-3).all()
    for row in range(9):  # alone, or with any other rows: the very same bits
        assert torch.equal(lin(x[row : row + 1]), y[row : row + 1])
        assert torch.equal(lin(x[[row, 0, 5]])[0], y[row])


def test_int8_uses_onednn_where_it_computes_exact_integer_products() -> None:
    if not onednn_int8():
        pytest.skip("this PyTorch has no oneDNN int8")
    lin = make_linear(torch.randn(32, 64), None, "int8")
    assert isinstance(lin, Int8Linear) and lin.kernel == "onednn"  # the probe passed


@pytest.mark.parametrize("kernel", INT8_KERNELS)
def test_int8_rows_are_their_own_at_a_real_width_and_any_row_count(kernel: str) -> None:
    """The 1B model's MLP width: every row count from 1 to 40, the rows taken from either end
    of a batch of 40 with magnitudes 10^4 apart, gives each row the bits it has alone."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(2048, 8192, generator=gen) * 0.02
    lin = Int8Linear(weight, None, kernel=kernel)
    x = torch.randn(40, 8192, generator=gen) * torch.logspace(-2, 2, 40)[:, None]
    alone = torch.cat([lin(x[i : i + 1]) for i in range(40)])
    for rows in range(1, 41):
        for start in {0, 40 - rows}:
            assert torch.equal(lin(x[start : start + rows]), alone[start : start + rows]), rows
    ref = F.linear(x, weight)
    assert ((alone - ref).abs().amax(-1) <= 0.03 * ref.abs().amax(-1)).all()


def test_unknown_quantize_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="int8-weight"):
        make_linear(torch.randn(2, 2), None, "int3")


def test_int4_refuses_a_width_that_is_not_whole_groups() -> None:
    with pytest.raises(ValueError, match="48 inputs is not a whole number of groups of 32"):
        make_linear(torch.randn(16, 48), None, "int4")


def test_int8_smoothing_tames_outlier_channels() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 48, generator=gen) * 0.1
    x = torch.randn(16, 48, generator=gen)
    x[:, 3] *= 60  # one outlier channel, as LLM activations have
    ref = F.linear(x, weight)
    plain = make_linear(weight, None, "int8")
    smooth = make_linear(weight, None, "int8", input_absmax=x.abs().amax(0))
    err_plain = (plain(x) - ref).abs().mean()
    err_smooth = (smooth(x) - ref).abs().mean()
    assert err_smooth < 0.5 * err_plain
    for row in range(16):  # smoothing keeps rows independent of each other
        assert torch.equal(smooth(x[row : row + 1]), smooth(x)[row : row + 1])
