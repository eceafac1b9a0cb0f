"""The int8 linear layers, both on the CPU through PyTorch's own kernels:

- `Int8WeightLinear`: weight-only, 8 bits per output channel (a `ChannelQuant` weight, see
  arch/quant.py), activations kept in floating point: the "int8-weight" mode, and the
  vocabulary projection of the int4 modes.
- `Int8Linear`: int8 weights and int8 activations (W8A8), smoothed (SmoothQuant): the "int8"
  mode.

Each row's output depends on that row alone, so the batched-equals-alone contract holds.
"""

from __future__ import annotations

import warnings

import torch

from neuronpy.arch.quant import KERNEL_DTYPE, ChannelQuant, kernel_rows

# the overload itself: resolving it from its packet costs a few µs a call
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default


class Int8WeightLinear:
    """y ~= x W^T + b with W in 8-bit channels (ChannelQuant), through PyTorch's
    `_weight_int8pack_mm` (activations stay in floating point: weight-only)."""

    def __init__(self, weight: ChannelQuant, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.out_features, self.in_features = weight.shape
        self.kind = f"int8 per channel from {weight.kind}"
        self.dtype = dtype
        self.bias = None if bias is None else bias.detach().to(dtype)
        self._q = weight.q.contiguous()
        self._scale = weight.scale.to(KERNEL_DTYPE)

    @property
    def nbytes(self) -> int:
        return self._q.nbytes + self._scale.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = _INT8_MM(kernel_rows(x, self.in_features), self._q, self._scale)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


SMOOTH_ALPHA = 0.5  # share of the activations' outlier range moved into the weights


def onednn_int8() -> bool:
    """Whether this PyTorch has oneDNN's int8 linear kernel (x86 builds: AMX or VNNI where
    the CPU has them)."""
    return hasattr(torch.ops.onednn, "qlinear_pointwise") and torch.backends.mkldnn.is_available()


class Int8Linear:
    """y ~= x W^T + b with int8 weights (one scale per output channel) and int8 activations (one
    scale per row): each row is divided by its own absolute maximum over 127 and rounded, so
    the integer product of a row depends on that row alone, and is exact (int32 sums).

    Two kernels, both PyTorch's own:
    - oneDNN's int8 linear (`torch.ops.onednn.qlinear_pointwise`, AMX or VNNI on x86), given
      the rows already quantized (uint8 around 128) with a scale of 1: it reads the weight once
      a call whatever the row count (the 1B model's projections: 58 ms a step at 1 to 16 rows,
      where the int4 kernel takes 51 ms at 1 row and 242 at 16). Probed at build against the
      exact integer product: a kernel that saturates or rounds is not used.
    - fbgemm's dynamic-quantized kernel elsewhere. It derives one activation scale from the
      whole input, so each row is first divided by its own absolute maximum and a guard row of
      +1 and -1 pins the input's range to exactly [-1, 1]: the kernel's scale is then the same
      for every batch.
    Either way each row's output (multiplied back by its own scale) is bitwise independent of
    the rest of the batch.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        input_absmax: torch.Tensor | None = None,
        alpha: float = SMOOTH_ALPHA,
        *,
        kernel: str | None = None,
    ) -> None:
        if weight.device.type != "cpu":
            raise ValueError("int8 mode runs on the CPU (oneDNN, fbgemm); use bf16/fp16 on GPUs")
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        # SmoothQuant: a few input channels carry outliers that would crush every other value
        # of the row into a handful of int8 levels; move part of their range into the weights
        # (x / s) (s W) with s from calibration. Perplexity on the default model: fp32 20.05,
        # int8 22.84 without this, 20.80 with it.
        self.smooth: torch.Tensor | None = None
        if input_absmax is not None:
            wmax = w.abs().amax(dim=0).clamp_min(1e-5)
            s = input_absmax.float().clamp_min(1e-5) ** alpha / wmax ** (1 - alpha)
            self.smooth = s.clamp_min(1e-5)
            w = w * self.smooth
        scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
        self.bias = None if bias is None else bias.detach().float()
        self.dtype = weight.dtype
        q = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        use_onednn = onednn_int8() if kernel is None else kernel == "onednn"
        if use_onednn and self._pack_onednn(q, scales.float()):
            self.kernel = "onednn"
        else:
            self.kernel = "fbgemm"
            self._pack_fbgemm(q, scales.double())

    def _pack_onednn(self, q: torch.Tensor, scales: torch.Tensor) -> bool:
        try:
            packed = torch.ops.onednn.qlinear_prepack(q, [1, self.in_features])
        except RuntimeError:
            return False
        self._packed = packed
        self._scales = scales
        self._zeros = torch.zeros(self.out_features, dtype=torch.int64)
        # the kernel must give the exact integer products (no saturating pair sums): two rows
        # at the extremes of the levels, and one of random levels, against int64 arithmetic
        gen = torch.Generator().manual_seed(0)
        probe = torch.randint(-127, 128, (3, self.in_features), generator=gen)
        probe[0], probe[1] = 127, -127
        exact = (probe @ q.long().t()).double() * scales.double()
        got = self._onednn(probe.add(128).to(torch.uint8)).double()
        return bool(torch.allclose(got, exact, rtol=1e-6, atol=0))

    def _pack_fbgemm(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        zeros = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():
            # torch 2.13 marks quantized tensor creation deprecated; the kernel itself is current
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch._make_per_channel_quantized_tensor(q, scales, zeros, 0)
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        self._guard = torch.zeros(1, self.in_features)
        self._guard[0, 0], self._guard[0, -1] = 1.0, -1.0

    def _onednn(self, levels: torch.Tensor) -> torch.Tensor:
        """fp32 [rows, out]: the rows' levels (uint8, 128 for 0) times the weight's, exactly,
        times each channel's scale."""
        return torch.ops.onednn.qlinear_pointwise(
            levels, 1.0, 128, self._packed, self._scales, self._zeros, None,
            1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip

    @property
    def kind(self) -> str:
        return f"int8 (W8A8, {self.kernel})"

    @property
    def nbytes(self) -> int:
        return self.out_features * (self.in_features + 8)  # int8 values, a scale and zero each

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).float()  # [N, in]
        if self.smooth is not None:
            rows = rows / self.smooth
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)  # [N, 1]
        if self.kernel == "onednn":
            levels = torch.round(rows * (127 / scale)).add_(128).to(torch.uint8)
            y = self._onednn(levels) * (scale / 127)
        else:
            unit = torch.cat((rows / scale, self._guard))  # [N + 1, in], range exactly [-1, 1]
            y = torch.ops.quantized.linear_dynamic(unit, self._packed, True)[:-1] * scale
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.dtype).reshape(*lead, self.out_features)
