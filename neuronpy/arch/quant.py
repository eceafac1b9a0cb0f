"""Weights kept quantized: 4-bit groups and 8-bit channels, the layer that computes with the
groups through PyTorch's own int4 kernel (`Int4Linear`; the 8-bit channels' layer is
arch/int8.py's `Int8WeightLinear`), and the embedding lookup over them.

Two layouts, each what one kernel takes (both CPU kernels; on other devices these weights are
dequantized at load):
- `GroupQuant`, 4- or 8-bit values in groups of `group` (32 for GGUF's Q4_0, Q4_1, Q4_K, Q5_0,
  Q5_1, Q5_K and Q8_0) along the input: w[n, k] = q[n, k] * scale[n, k // group] +
  low[n, k // group]. PyTorch's `_weight_int4pack_mm_for_cpu` computes (q - 8) * s + z, so it
  is given z = low + 8 * scale. An 8-bit q = 16 * hi + lo runs as two 4-bit planes in one call:
  [x, x] against [hi | lo] with scales [16 s | s] (exact: the kernel accumulates in fp32).
- `ChannelQuant`, 8 bits with one scale per output channel: w[n, k] = q[n, k] * scale[n], for
  `_weight_int8pack_mm`.
Both kernels take bf16 activations (fp32 ones run them 10-60x slower): a layer casts its input to
bf16 and its output back. Each output row depends on its own input row alone (checked for every
row count up to 64), so the batched-equals-alone contract holds with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

# what the int4 kernel's packing asks of a weight: output channels in multiples of 16
INT4_N_MULTIPLE = 16
INT4_GROUPS = (32, 64, 128, 256)
KERNEL_DTYPE = torch.bfloat16


@dataclass
class GroupQuant:
    """4- or 8-bit values in groups along the input (see the module docstring)."""

    q: torch.Tensor  # uint8 [N, K], each below 2 ** bits (4, 5 or 8)
    scale: torch.Tensor  # float32 [N, K // group]
    low: torch.Tensor  # float32 [N, K // group]
    group: int
    kind: str  # what it came from, for the load log: "Q4_1", "float"
    bits: int = 4

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    @property
    def values(self) -> torch.Tensor:
        return self.q

    @property
    def levels(self) -> str:
        return f"int{self.bits}"

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes + self.low.nbytes

    @classmethod
    def from_float(cls, w: torch.Tensor, group: int) -> GroupQuant:
        """Round-to-nearest asymmetric 4-bit groups of a float weight [N, K] (K % group == 0):
        each group's minimum and maximum are its levels 0 and 15."""
        n, k = w.shape
        g = w.detach().float().reshape(n, k // group, group)
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        scale = ((hi - lo) / 15).clamp_min(1e-10)
        q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
        return cls(q.reshape(n, k), scale, lo, group, "float")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        g = self.q.reshape(n, k // self.group, self.group).float()
        w = g * self.scale[..., None] + self.low[..., None]
        return w.reshape(n, k).to(dtype)

    def rows(self, lo: int, hi: int) -> GroupQuant:
        return GroupQuant(
            self.q[lo:hi].clone(),
            self.scale[lo:hi].clone(),
            self.low[lo:hi].clone(),
            self.group,
            self.kind,
            self.bits,
        )

    def cols(self, lo: int, hi: int) -> GroupQuant:
        if lo % self.group or hi % self.group:
            raise ValueError(f"columns [{lo}, {hi}) cut a group of {self.group}")
        glo, ghi = lo // self.group, hi // self.group
        return GroupQuant(
            self.q[:, lo:hi].clone(),
            self.scale[:, glo:ghi].clone(),
            self.low[:, glo:ghi].clone(),
            self.group,
            self.kind,
            self.bits,
        )

    def take_rows(self, index: torch.Tensor) -> GroupQuant:
        return GroupQuant(
            self.q[index], self.scale[index], self.low[index], self.group, self.kind, self.bits
        )

    @staticmethod
    def cat(parts: Sequence[GroupQuant]) -> GroupQuant:
        """Parts stacked along the output channels (fused q/k/v, gate/up): one group size;
        narrower parts beside wider ones keep their levels (a 4-bit level is a 5-bit one)."""
        if len({p.group for p in parts}) != 1:
            raise ValueError("cannot fuse quantized weights of different group sizes")
        return GroupQuant(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.low for p in parts]),
            parts[0].group,
            "+".join(sorted({p.kind for p in parts})),
            max(p.bits for p in parts),
        )


@dataclass
class ChannelQuant:
    """8-bit values, one scale per output channel (see the module docstring)."""

    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N]
    kind: str

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    @property
    def values(self) -> torch.Tensor:
        return self.q

    levels = "int8"

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    @classmethod
    def from_float(cls, w: torch.Tensor, kind: str = "float") -> ChannelQuant:
        """Symmetric round-to-nearest: each channel's largest magnitude is level 127."""
        w = w.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-10)
        q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        return cls(q, scale, kind)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(dtype)

    def rows(self, lo: int, hi: int) -> ChannelQuant:
        return ChannelQuant(self.q[lo:hi].clone(), self.scale[lo:hi].clone(), self.kind)

    def cols(self, lo: int, hi: int) -> ChannelQuant:
        return ChannelQuant(self.q[:, lo:hi].clone(), self.scale.clone(), self.kind)

    def take_rows(self, index: torch.Tensor) -> ChannelQuant:
        return ChannelQuant(self.q[index], self.scale[index], self.kind)

    @staticmethod
    def cat(parts: Sequence[ChannelQuant]) -> ChannelQuant:
        return ChannelQuant(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            "+".join(sorted({p.kind for p in parts})),
        )


@dataclass
class SubBlockQuant:
    """Signed 6-bit levels with a scale per 16 values (GGUF's Q6_K): w[n, k] = u[n, k] *
    scale[n, k // 16], u in [-32, 31]. The int4 kernel's groups are 32 wide, so each 16-value
    sub-block runs as one group of its own 32 kernel columns: u = 8 * hi + lo, the hi levels
    against the sub-block's inputs times 8 (exact in bf16), the lo levels against the inputs."""

    u: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K // 16]
    kind: str
    group = 16

    @property
    def shape(self) -> tuple[int, int]:
        return (self.u.shape[0], self.u.shape[1])

    @property
    def values(self) -> torch.Tensor:
        return self.u

    levels = "int6"

    @property
    def nbytes(self) -> int:
        return self.u.nbytes + self.scale.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        w = self.u.reshape(n, k // 16, 16).float() * self.scale[..., None]
        return w.reshape(n, k).to(dtype)

    def rows(self, lo: int, hi: int) -> SubBlockQuant:
        return SubBlockQuant(self.u[lo:hi].clone(), self.scale[lo:hi].clone(), self.kind)

    def cols(self, lo: int, hi: int) -> SubBlockQuant:
        if lo % 16 or hi % 16:
            raise ValueError(f"columns [{lo}, {hi}) cut a sub-block of 16")
        scale = self.scale[:, lo // 16 : hi // 16].clone()
        return SubBlockQuant(self.u[:, lo:hi].clone(), scale, self.kind)

    def take_rows(self, index: torch.Tensor) -> SubBlockQuant:
        return SubBlockQuant(self.u[index], self.scale[index], self.kind)

    @staticmethod
    def cat(parts: Sequence[SubBlockQuant]) -> SubBlockQuant:
        return SubBlockQuant(
            torch.cat([p.u for p in parts]),
            torch.cat([p.scale for p in parts]),
            "+".join(sorted({p.kind for p in parts})),
        )


Quantized = GroupQuant | ChannelQuant | SubBlockQuant
# Each layout has: shape, values (its stored integer levels), levels (their width, for the
# load log), nbytes, dequantize, rows, cols, take_rows and cat. Code that takes any layout
# goes through these alone, never a layout's own fields.
AnyWeight = torch.Tensor | GroupQuant | ChannelQuant | SubBlockQuant


def dequantized(w: AnyWeight, dtype: torch.dtype) -> torch.Tensor:
    """`w` as a plain tensor of `dtype`."""
    if isinstance(w, torch.Tensor):
        return w.to(dtype)
    return w.dequantize(dtype)


def cat_weights(parts: Sequence[AnyWeight]) -> AnyWeight | None:
    """Parts fused along the output channels when they share a layout, else None (a
    checkpoint that mixes types within one fused projection: its parts then run side by
    side, each in its own layout)."""
    if all(isinstance(p, GroupQuant) for p in parts):
        if len({p.group for p in parts}) == 1:  # type: ignore[union-attr]
            return GroupQuant.cat(parts)  # type: ignore[arg-type]
        return None
    for layout in (ChannelQuant, SubBlockQuant):
        if all(isinstance(p, layout) for p in parts):
            return layout.cat(parts)  # type: ignore[attr-defined]
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)  # type: ignore[arg-type]
    return None


# the overload itself: resolving it from its packet costs a few µs a call
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default


def kernel_rows(x: torch.Tensor, features: int) -> torch.Tensor:
    """x [..., features] as the weight-only kernels take it: [N, features], contiguous, bf16."""
    rows = x.reshape(-1, features)
    return (rows if rows.dtype == KERNEL_DTYPE else rows.to(KERNEL_DTYPE)).contiguous()


class Int4Linear:
    """y ~= x W^T + b with W in groups (GroupQuant), through PyTorch's
    `_weight_int4pack_mm_for_cpu`: the weight stays packed at half a byte per 4-bit value (an
    8-bit weight as two 4-bit planes, see the module docstring)."""

    def __init__(
        self, weight: GroupQuant | SubBlockQuant, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        self.bias = None if bias is None else bias.detach().to(dtype)
        # how kernel columns read the input: as it is, twice (planes), or gathered and scaled
        self._columns: tuple[torch.Tensor, torch.Tensor] | None = None
        self.planes = 1
        # kernel levels, scales and zeros: the kernel computes (q - 8) * scale + zero
        if isinstance(weight, SubBlockQuant):
            q, scale, zero = self._sub_blocks(weight)
            self.group = 32
            self.kind = f"int4 sub-block pairs from {weight.kind}"
        else:
            self.group = weight.group
            if weight.bits > 4:
                q, scale, zero = self._planes(weight)
            else:
                q, scale, zero = weight.q, weight.scale, weight.low + 8 * weight.scale
            kernel = "int4" if self.planes == 1 else "two int4 planes"
            self.kind = f"{kernel} g{weight.group} from {weight.kind}"
        pad = -self.out_features % INT4_N_MULTIPLE  # the packing wants N % 16 == 0
        if pad:
            q = torch.cat((q, q.new_full((pad, q.shape[1]), 8)))
            scale = torch.cat((scale, scale.new_zeros(pad, scale.shape[1])))
            zero = torch.cat((zero, zero.new_zeros(pad, zero.shape[1])))
        self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        # the kernel's own output, nothing around it: one plane, no padding, no bias
        self._direct = self.planes == 1 and self._columns is None and not pad and bias is None
        # [K // group, N, 2]: each group's scale and zero
        self._scales = torch.stack((scale, zero), dim=-1).transpose(0, 1).to(KERNEL_DTYPE)
        self._scales = self._scales.contiguous()

    def _planes(self, weight: GroupQuant) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Kernel levels, scales and zeros of a 5- or 8-bit weight as two 4-bit planes: each
        level q taken from the middle one, q - mid = 16 * hi + lo (hi from -8), so that the
        planes' zeros stay the size of a weight (a zero far larger than the weights it offsets
        would lose them to its bf16 rounding): hi's zero carries low + mid * scale, lo's 8 s."""
        self.planes = 2
        mid = 1 << (weight.bits - 1)
        c = weight.q.to(torch.int32) - mid
        hi = torch.div(c, 16, rounding_mode="floor")
        q = torch.cat((hi + 8, c - 16 * hi), dim=1)
        s = weight.scale
        return q, torch.cat((16 * s, s), dim=1), torch.cat((weight.low + mid * s, 8 * s), dim=1)

    def _sub_blocks(self, weight: SubBlockQuant) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Kernel levels, scales and zeros for 16-value sub-blocks (see SubBlockQuant): each
        sub-block's 16 hi levels, then its 16 lo levels, one 32-column group with its scale."""
        n, k = weight.shape
        u = weight.u.to(torch.int32).reshape(n, k // 16, 16)
        hi = torch.div(u, 8, rounding_mode="floor")  # [-4, 3]
        lo = u - 8 * hi  # [0, 7]
        q = (torch.stack((hi, lo), dim=2) + 8).reshape(n, 2 * k).to(torch.uint8)
        scale = weight.scale  # [N, K // 16]: one per 32 kernel columns
        cols = torch.arange(k).reshape(k // 16, 1, 16).expand(k // 16, 2, 16).reshape(2 * k)
        times = torch.tensor([8.0, 1.0]).repeat_interleave(16).repeat(k // 16)
        self._columns = (cols, times.to(KERNEL_DTYPE))
        return q, scale, torch.zeros_like(scale)

    @property
    def nbytes(self) -> int:
        return self._packed.nbytes + self._scales.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._direct and x.dtype == KERNEL_DTYPE and x.dim() == 2 and x.is_contiguous():
            # a decode step's common case, in as few calls as it takes (~15 µs a call less)
            return _INT4_MM(x, self._packed, self.group, self._scales)
        lead = x.shape[:-1]
        rows = kernel_rows(x, self.in_features)
        if self.planes == 2:
            rows = torch.cat((rows, rows), dim=1)
        elif self._columns is not None:
            cols, times = self._columns
            rows = rows[:, cols] * times
        y = _INT4_MM(rows, self._packed, self.group, self._scales)
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


class QuantEmbedding:
    """The token embedding kept quantized, in any layout above: a lookup gathers its rows
    (take_rows) and dequantizes them with the layout's own dequantize, so each row is exactly
    the full dequantized table's. 4-bit levels are kept two a byte."""

    def __init__(self, weight: Quantized, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.shape = weight.shape
        self.device = weight.values.device
        self.kind = f"{weight.levels} from {weight.kind}"
        # a 4-bit level takes half a byte; the layout keeps a byte each for the int4 kernel's
        # packing, which the table never sees: a lookup unpacks only the rows it gathers
        self._nibbles = isinstance(weight, GroupQuant) and weight.bits == 4
        if isinstance(weight, GroupQuant) and self._nibbles:
            n, k = weight.shape
            pairs = weight.q.reshape(n, k // 2, 2)  # even columns in the low nibble
            weight = replace(weight, q=pairs[..., 0] | (pairs[..., 1] << 4))
        self._table: Quantized = weight

    @property
    def values(self) -> torch.Tensor:
        """The stored integer values (what a fingerprint samples)."""
        return self._table.values

    @property
    def nbytes(self) -> int:
        return self._table.nbytes

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids, self.dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` [N] of the table, dequantized to `dtype`: [N, hidden]."""
        part = self._table.take_rows(ids)
        if isinstance(part, GroupQuant) and self._nibbles:
            q = torch.stack((part.q & 15, part.q >> 4), dim=-1).reshape(ids.shape[0], -1)
            part = replace(part, q=q)
        return part.dequantize(dtype)
