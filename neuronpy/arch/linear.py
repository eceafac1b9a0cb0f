"""Linear layers whose weights are prepared once for the device's fastest built-in kernel."""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn.functional as F

from neuronpy.defaults import QUANTIZE_MODES
from neuronpy.envflags import env_flag

log = logging.getLogger(__name__)

# The batch size oneDNN lays the packed weight out for; any batch size works with it.
PACK_BATCH_HINT = 8


def onednn_enabled() -> bool:
    """oneDNN packed weights on CPU (NEURON_ONEDNN=0 turns them off, e.g. to compare)."""
    return env_flag("NEURON_ONEDNN") and torch.backends.mkldnn.is_available()


def native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bfloat16 natively (x86's avx512_bf16 or AMX, as its flags in
    `cpuinfo` say) and oneDNN runs it: bf16 weights then halve what a decode step reads, at no
    cost in speed. False where it cannot tell (no /proc/cpuinfo: other systems)."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            flags = {word for line in f if line.startswith("flags") for word in line.split()}
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"}) and packable(torch.bfloat16)


def packable(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of `dtype` on this CPU: float32 always; bfloat16 where
    oneDNN runs it (avx512_core and up: natively with avx512_bf16 or AMX)."""
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Linear:
    """y = x W^T + b, x: [..., in] -> [..., out].

    On CPU, plain `F.linear` goes through a general GEMM that re-packs the whole weight at every
    call; at decode's small row counts that packing costs as much as the product itself. The
    oneDNN kernel PyTorch ships takes a weight packed once, ahead of time: about 2x faster per
    decode step here, 3x on the vocabulary projection. Elsewhere (CUDA, MPS) it is `F.linear`.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self._packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = weight
        if weight.device.type == "cpu" and packable(weight.dtype) and onednn_enabled():
            self._pack(weight)

    def _pack(self, weight: torch.Tensor) -> None:
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
            probe = torch.randn(2, self.in_features, dtype=weight.dtype)
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, self.bias, "none", [], "")
            tol = 1e-3 if weight.dtype == torch.float32 else 2e-2
            if not torch.allclose(got, F.linear(probe, weight, self.bias), atol=tol, rtol=tol):
                raise RuntimeError("packed linear disagrees with F.linear")
        except (RuntimeError, AttributeError) as exc:  # an older or different build
            log.warning("oneDNN packed linear unavailable (%s); using F.linear", exc)
            return
        self._packed = packed
        self.weight = None  # the packed copy replaces it

    @property
    def packed(self) -> bool:
        return self._packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            # (the overload itself: resolving it from the packet costs a few µs a call)
            return torch.ops.mkldnn._linear_pointwise.default(
                x, self._packed, self.bias, "none", [], ""
            )
        return F.linear(x, self.weight, self.bias)  # type: ignore[arg-type]


SMOOTH_ALPHA = 0.5  # share of the activations' outlier range moved into the weights


class Int8Linear:
    """y ~= x W^T + b with int8 weights (one scale per output channel) and int8 activations (one
    scale per row), through PyTorch's fbgemm dynamic-quantized kernel.

    That kernel derives one activation scale from the whole input, which would make a row's
    result depend on the other rows. So each row is first divided by its own absolute maximum,
    and a guard row holding +1 and -1 pins the input's range to exactly [-1, 1]: the kernel's
    scale is then the same for every batch, the integer product is exact, and each row's
    output (multiplied back by its own scale) is bitwise independent of the rest of the batch.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        input_absmax: torch.Tensor | None = None,
        alpha: float = SMOOTH_ALPHA,
    ) -> None:
        if weight.device.type != "cpu":
            raise ValueError("int8 mode runs on the CPU (fbgemm); use bf16/fp16 on GPUs")
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
        scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
        zeros = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():
            # torch 2.13 marks quantized tensor creation deprecated; the kernel itself is current
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(w, scales, zeros, 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.bias = None if bias is None else bias.detach().float()
        self._guard = torch.zeros(1, self.in_features)
        self._guard[0, 0], self._guard[0, -1] = 1.0, -1.0
        self.dtype = weight.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).float()  # [N, in]
        if self.smooth is not None:
            rows = rows / self.smooth
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)  # [N, 1]
        unit = torch.cat((rows / scale, self._guard))  # [N + 1, in], range exactly [-1, 1]
        y = torch.ops.quantized.linear_dynamic(unit, self._packed, True)[:-1] * scale
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.dtype).reshape(*lead, self.out_features)


def make_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    quantize: str = "none",
    input_absmax: torch.Tensor | None = None,
) -> Linear | Int8Linear:
    """The linear layer for `quantize` ("none": the weight as it is; "int8": see Int8Linear,
    smoothed with the calibrated per-channel `input_absmax` when given)."""
    if quantize == "int8":
        return Int8Linear(weight, bias, input_absmax)
    if quantize != "none":
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_MODES)}, got {quantize!r}")
    return Linear(weight, bias)
