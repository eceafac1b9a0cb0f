"""Linear layers whose weights are prepared once for the device's fastest built-in kernel."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from neuronpy.arch.int8 import Int8Linear, Int8WeightLinear
from neuronpy.arch.quant import (
    AnyWeight,
    ChannelQuant,
    GroupQuant,
    Int4Linear,
    QuantEmbedding,
    Quantized,
    SubBlockQuant,
    dequantized,
)
from neuronpy.defaults import QUANTIZE_MODES, WEIGHT_ONLY_MODES
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

    @property
    def kind(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def dtype(self) -> torch.dtype:
        return (self._packed if self._packed is not None else self.weight).dtype  # type: ignore[union-attr]

    @property
    def nbytes(self) -> int:
        w = self._packed if self._packed is not None else self.weight
        return w.nbytes + (0 if self.bias is None else self.bias.nbytes)  # type: ignore[union-attr]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            # (the overload itself: resolving it from the packet costs a few µs a call)
            return torch.ops.mkldnn._linear_pointwise.default(
                x, self._packed, self.bias, "none", [], ""
            )
        return F.linear(x, self.weight, self.bias)  # type: ignore[arg-type]


class FusedLinear:
    """Projections that read one input, run side by side and concatenated: what a fused
    q/k/v or gate/up becomes when a checkpoint stores its parts in different types (a
    Q4_K_M file's Q6_K v beside Q4_K q and k)."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features
        self.bias = None
        self.kind = " + ".join(p.kind for p in parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


AnyLinear = Linear | Int8Linear | Int4Linear | Int8WeightLinear | FusedLinear


def int4_group(quantize: str) -> int:
    """The group size an "int4" mode names ("int4": 32; "int4-g128": 128)."""
    return int(quantize.partition("-g")[2] or 32)


def head_mode(quantize: str) -> str:
    """What the vocabulary projection becomes under `quantize`: 8 bits per channel where the
    others get 4 (the head's errors reach every logit directly: a 4-bit head costs more
    quality per byte saved than any other layer, so llama.cpp's and most int4 recipes keep it
    wider); else the same as the others."""
    return "int8-weight" if quantize.startswith("int4") else quantize


def make_linear(
    weight: AnyWeight,
    bias: torch.Tensor | None = None,
    quantize: str = "none",
    input_absmax: torch.Tensor | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> AnyLinear:
    """The linear layer `quantize` makes of `weight` (a tensor, or 4-bit groups or 8-bit
    channels as a GGUF file held them), computing in `dtype` (the weight's own by default):

    - "auto": as the checkpoint holds it: grouped 4- and 8-bit weights through the int4 kernel
      (Int4Linear), per-channel 8-bit ones through the int8 one (Int8WeightLinear), a float
      one as it is (Linear);
    - "none": a float weight, dequantized if it was quantized;
    - "int4", "int4-g64", "int4-g128": 4-bit groups of 32 (64, 128), weight-only; a 4-bit
      weight of that group size as it is, others quantized (round to nearest, per group);
    - "int8-weight": 8 bits per output channel, weight-only;
    - "int8": int8 weights and activations (Int8Linear), smoothed with `input_absmax`.
    """
    if dtype is None:
        dtype = weight.dtype if isinstance(weight, torch.Tensor) else torch.float32
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_MODES)}, got {quantize!r}")
    if quantize == "auto":
        if isinstance(weight, GroupQuant | SubBlockQuant):
            return Int4Linear(weight, bias, dtype)
        if isinstance(weight, ChannelQuant):
            return Int8WeightLinear(weight, bias, dtype)
        return Linear(weight.to(dtype), bias)
    if quantize.startswith("int4"):
        group = int4_group(quantize)
        if not (isinstance(weight, GroupQuant) and weight.group == group and weight.bits == 4):
            k = weight.shape[1]
            if k % group:
                raise ValueError(
                    f"{quantize}: a projection of {k} inputs is not a whole number of groups "
                    f"of {group}; choose a group size that divides it"
                )
            weight = GroupQuant.from_float(dequantized(weight, torch.float32), group)
        return Int4Linear(weight, bias, dtype)
    if quantize == "int8-weight":
        if not isinstance(weight, ChannelQuant):
            weight = ChannelQuant.from_float(dequantized(weight, torch.float32))
        return Int8WeightLinear(weight, bias, dtype)
    plain = dequantized(weight, dtype)
    if quantize == "int8":
        return Int8Linear(plain, bias, input_absmax)
    return Linear(plain, bias)


def make_embedding(
    weight: AnyWeight, quantize: str, dtype: torch.dtype
) -> torch.Tensor | QuantEmbedding:
    """The token embedding `quantize` makes of `weight`: kept quantized where the checkpoint
    is (in any mode but "none": a lookup dequantizes the rows it gathers, each exactly the
    whole table's, so the int8 mode computes what it did from a float copy at a quarter of its
    memory) or a weight-only mode asks it (8 bits per row from a float table: a lookup costs
    nothing, the table's memory is what counts); else a float table of `dtype`."""
    if isinstance(weight, Quantized) and quantize != "none":
        return QuantEmbedding(weight, dtype)
    if isinstance(weight, torch.Tensor) and quantize in WEIGHT_ONLY_MODES:
        return QuantEmbedding(ChannelQuant.from_float(weight), dtype)
    table = dequantized(weight, dtype)
    # a table of its own: one that is the checkpoint's tensor would keep a whole
    # memory-mapped safetensors file resident after the model is built (2.2 GB more RSS
    # for a 1B model in bf16)
    aliased = isinstance(weight, torch.Tensor) and table.data_ptr() == weight.data_ptr()
    return table.clone() if aliased else table
