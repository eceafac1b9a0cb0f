"""The Mamba2 mixer (Granite 4's "mamba" layers; the same arithmetic as transformers' Mamba2
and Nemotron-H mixers), in plain PyTorch, under the parity contract of arch/mixer.py.

A layer's input goes through one projection into z (the gate), x, B, C (through a depthwise
causal convolution and SiLU) and dt (one time step per head). Per head h, with a = -exp(A_log)
and dt = softplus(dt + dt_bias), the state S [head_dim, d_state] moves one token on by

    S <- exp(dt a) S + dt x B^T,    y = S C + D x,

B and C shared by the heads of a group. Then y * silu(z), an RMS norm per group (the "gated
RMSNorm" of the reference, norm after gate), and the output projection.

- `prefill` runs the chunked (SSD) form, as transformers' torch path does: within a chunk, a
  masked products form over its positions; between chunks, the state. Chunks are cut at
  absolute multiples of STATE_BLOCK and each is computed on its own (the state carried from
  one to the next elementwise, not summed over all chunks at once as the reference does), so a
  chunk's arithmetic is the same whatever call it falls in: prompts split at multiples of
  STATE_BLOCK give the same bits as one call.
- `step` runs the recurrence for B rows at once: elementwise operations, and the readout
  S C as elementwise products summed along d_state (a reduction of fixed length per row).

The state is a row's convolution window [conv_dim, K - 1] in the compute dtype (what the
reference's cache holds as its conv state, less its oldest column, which the next token no
longer reads) and the SSM state [heads, head_dim, d_state] in float32 (the reference's chunked
scan produces it in float32, and its cache keeps it so). The scan computes in float32 whatever
the compute dtype.

As in the reference, the time-step limits clamp dt in the chunked form only; a decode step
takes softplus(dt + dt_bias) unclamped (mamba_ssm's step kernel does the same). With the
default limits (0, inf) the two agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from neuronpy.arch.linear import AnyLinear, make_linear
from neuronpy.arch.mixer import STATE_BLOCK, StateSpec, causal_conv, project, silu, softplus
from neuronpy.arch.quant import AnyWeight, dequantized

# model_type -> the config's fields for: heads, head_dim, d_state, groups, conv kernel, norm
# eps, projection bias, conv bias, activation. Falcon-H1 is not here: its mixer also scales the
# input and the projection (ssm_in_multiplier, mup_vector) and may skip the norm or gate after
# it (mamba_rms_norm, mamba_norm_before_gate).
MAMBA2_FIELDS = {
    "granitemoehybrid": (
        "mamba_n_heads",
        "mamba_d_head",
        "mamba_d_state",
        "mamba_n_groups",
        "mamba_d_conv",
        "rms_norm_eps",
        "mamba_proj_bias",
        "mamba_conv_bias",
        "hidden_act",
    ),
    "mamba2": (
        "num_heads",
        "head_dim",
        "state_size",
        "n_groups",
        "conv_kernel",
        "layer_norm_epsilon",
        "use_bias",
        "use_conv_bias",
        "hidden_act",
    ),
    "nemotron_h": (
        "mamba_num_heads",
        "mamba_head_dim",
        "ssm_state_size",
        "n_groups",
        "conv_kernel",
        "layer_norm_epsilon",
        "use_bias",
        "use_conv_bias",
        "mamba_hidden_act",
    ),
}


@dataclass(frozen=True)
class Mamba2Shape:
    """The geometry and constants of a model's Mamba2 layers."""

    num_heads: int
    head_dim: int
    state_size: int  # d_state
    n_groups: int  # B and C are shared by num_heads / n_groups heads each
    conv_kernel: int
    eps: float  # the gated RMS norm's
    proj_bias: bool
    conv_bias: bool
    dt_limit: tuple[float, float] = (0.0, math.inf)

    @property
    def inner(self) -> int:
        """The width of z, x and y: num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The convolved channels: x, B and C."""
        return self.inner + 2 * self.n_groups * self.state_size

    @classmethod
    def from_hf(cls, hf_config: Any) -> Mamba2Shape:
        """The shape a transformers config gives its Mamba2 layers (see MAMBA2_FIELDS)."""
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in MAMBA2_FIELDS:
            raise ValueError(f"no Mamba2 mixer for model type {model_type!r}")
        heads, dim, state, groups, kernel, eps, bias, conv_bias, act = (
            getattr(hf_config, f) for f in MAMBA2_FIELDS[model_type]
        )
        if act not in ("silu", "swish"):
            raise ValueError(f"a Mamba2 layer with activation {act!r} is not supported")
        if heads % groups:
            raise ValueError(f"{heads} Mamba2 heads do not split into {groups} groups")
        limit = getattr(hf_config, "time_step_limit", None) or (0.0, math.inf)
        return cls(
            num_heads=int(heads),
            head_dim=int(dim),
            state_size=int(state),
            n_groups=int(groups),
            conv_kernel=int(kernel),
            eps=float(eps),
            proj_bias=bool(bias),
            conv_bias=bool(conv_bias),
            dt_limit=(float(limit[0]), float(limit[1])),
        )


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """a [..., L] -> [..., L, L]: out[i, j] = a[j+1] + ... + a[i] for j <= i, -inf above the
    diagonal (the reference's form: masked cumulative sums, not differences of one cumsum)."""
    length = a.shape[-1]
    x = a[..., None].expand(*a.shape, length)
    below = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(-1)
    sums = x.masked_fill(~below, 0).cumsum(dim=-2)
    upper = torch.ones(length, length, dtype=torch.bool, device=a.device).tril()
    return sums.masked_fill(~upper, -math.inf)


class Mamba2Mixer:
    """One Mamba2 layer under the Mixer protocol: x [.., hidden] (input-normed) -> [.., hidden]
    (after out_proj, before the residual)."""

    def __init__(
        self,
        shape: Mamba2Shape,
        in_proj: AnyLinear,
        out_proj: AnyLinear,
        conv_weight: torch.Tensor,
        conv_bias: torch.Tensor | None,
        A_log: torch.Tensor,
        D: torch.Tensor,
        dt_bias: torch.Tensor,
        norm_weight: torch.Tensor,
        dtype: torch.dtype,
    ) -> None:
        s = shape
        if in_proj.out_features != s.inner + s.conv_dim + s.num_heads:
            raise ValueError(f"in_proj gives {in_proj.out_features} features, not z, xBC and dt")
        if tuple(conv_weight.shape) != (s.conv_dim, s.conv_kernel):
            raise ValueError(f"conv weight {list(conv_weight.shape)} is not [conv_dim, kernel]")
        self.shape = shape
        self.in_proj = in_proj  # hidden -> z, x B C, dt
        self.out_proj = out_proj  # inner -> hidden
        self.conv_weight = conv_weight  # [conv_dim, K], compute dtype
        self.conv_bias = conv_bias  # [conv_dim] or None
        # [heads] float32: -exp(A_log), as the reference; from a float64 A_log (a GGUF file's,
        # log of its stored -exp(A_log)) taken in float64, so that it rounds to the stored value
        self.A = (-A_log.exp()).float() if A_log.dtype == torch.float64 else -A_log.float().exp()
        self.D = D.float()  # [heads]
        self.dt_bias = dt_bias.float()  # [heads]
        self.norm_weight = norm_weight.float()  # [inner]
        self.dtype = dtype

    def state_specs(self) -> tuple[StateSpec, ...]:
        """The convolution window, then the SSM state (see the module's docstring)."""
        s = self.shape
        return (
            StateSpec((s.conv_dim, s.conv_kernel - 1), self.dtype),
            StateSpec((s.num_heads, s.head_dim, s.state_size), torch.float32),
        )

    def linears(self) -> list[Any]:
        """The input and output projections."""
        return [self.in_proj, self.out_proj]

    def _split(self, x: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, T, hidden] -> z [B, T, inner], the convolved x [B, T, heads, head_dim], B and
        C [B, T, groups, d_state] (float32), and the raw dt [B, T, heads] (float32)."""
        s = self.shape
        b, t, _ = x.shape
        zxbcdt = project(self.in_proj, x.reshape(b * t, -1)).reshape(b, t, -1)
        z, xbc, dt = zxbcdt.split([s.inner, s.conv_dim, s.num_heads], dim=-1)
        xbc = silu(causal_conv(xbc, window, self.conv_weight, self.conv_bias)).float()
        xs, bm, cm = xbc.split([s.inner, s.n_groups * s.state_size, s.n_groups * s.state_size], -1)
        return (
            z,
            xs.reshape(b, t, s.num_heads, s.head_dim),
            bm.reshape(b, t, s.n_groups, s.state_size),
            cm.reshape(b, t, s.n_groups, s.state_size),
            dt.float(),
        )

    def _finish(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated RMS norm (y * silu(z), normed per group) and out_proj: y [N, inner]
        (float32), z [N, inner] -> [N, hidden]."""
        s = self.shape
        g = (y * silu(z.float())).reshape(y.shape[0], s.n_groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + s.eps)
        g = self.norm_weight * g.reshape(y.shape)
        return project(self.out_proj, g.to(self.dtype))

    def prefill(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], start: int) -> torch.Tensor:
        """x [T, hidden] of one sequence at positions [start, start + T) -> [T, hidden]; the
        window and SSM state ([1, ...] each) advanced in place past the T tokens."""
        s = self.shape
        window, ssm = state
        t = x.shape[0]
        z, xs, bm, cm, dt = self._split(x[None], window)
        xs, bm, cm = xs[0], bm[0], cm[0]
        dt = softplus(dt[0] + self.dt_bias).clamp(*s.dt_limit)  # [T, heads]
        h = ssm[0].float()  # [heads, head_dim, d_state]
        outs = []
        cut = (start // STATE_BLOCK + 1) * STATE_BLOCK - start  # the first absolute boundary
        lo = 0
        while lo < t:
            hi = min(t, lo + cut) if lo == 0 else min(t, lo + STATE_BLOCK)
            y, h = self._chunk(xs[lo:hi], bm[lo:hi], cm[lo:hi], dt[lo:hi], h)
            outs.append(y)
            lo = hi
        ssm.copy_(h[None])
        y = torch.cat(outs) if len(outs) > 1 else outs[0]  # [T, heads, head_dim]
        return self._finish(y.reshape(t, s.inner), z[0])

    def _chunk(
        self,
        x: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        dt: torch.Tensor,
        h: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk of L positions: x [L, heads, head_dim], b and c [L, groups, d_state],
        dt [L, heads] (after softplus), h the state before it [heads, head_dim, d_state] ->
        y [L, heads, head_dim] (D's skip included) and the state after it."""
        s = self.shape
        length, heads, p = x.shape
        groups, per = s.n_groups, s.num_heads // s.n_groups
        a = (self.A * dt).T  # [heads, L]
        a_cum = a.cumsum(-1)
        xdt = (x * dt[..., None]).permute(1, 0, 2)  # [heads, L, head_dim]
        bg, cg = b.permute(1, 0, 2), c.permute(1, 0, 2)  # [groups, L, d_state]
        # within the chunk: y[l] = sum over s <= l of (C[l] . B[s]) exp(a[s+1] + .. + a[l]) xdt[s]
        scores = torch.matmul(cg, bg.transpose(-1, -2))  # [groups, L, L]
        scores = scores[:, None].expand(groups, per, length, length).reshape(heads, length, length)
        y = torch.matmul(scores * torch.exp(_segment_sum(a)), xdt)  # [heads, L, head_dim]
        # from the state before the chunk: y[l] += exp(a[0] + .. + a[l]) C[l] h
        hg = h.reshape(groups, per * p, s.state_size).transpose(-1, -2)  # [groups, N, per * P]
        off = torch.matmul(cg, hg).reshape(groups, length, per, p).permute(1, 0, 2, 3)
        off = off.reshape(length, heads, p) * torch.exp(a_cum).T[..., None]
        y = y.permute(1, 0, 2) + off + x * self.D[:, None]  # [L, heads, head_dim]
        # the state after: h decayed over the chunk, plus each position's input decayed from it
        decay = torch.exp(a_cum[:, -1:] - a_cum)  # [heads, L]
        weighted = (xdt * decay[..., None]).reshape(groups, per, length, p)
        weighted = weighted.permute(0, 1, 3, 2).reshape(groups, per * p, length)
        new = torch.matmul(weighted, bg).reshape(heads, p, s.state_size)
        return y, h * torch.exp(a_cum[:, -1])[:, None, None] + new

    def step(self, x: torch.Tensor, state: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x [B, hidden], one token per row -> [B, hidden]; each row's window and SSM state
        ([B, ...] each) advanced in place by its token. All rows in one update."""
        s = self.shape
        window, ssm = state
        rows = x.shape[0]
        z, xs, bm, cm, dt = self._split(x[:, None], window)
        xs, bm, cm = xs[:, 0], bm[:, 0], cm[:, 0]  # [B, heads, P], [B, groups, N]
        dt = softplus(dt[:, 0] + self.dt_bias)  # [B, heads] (the reference clamps not here)
        # each group's B and C for its heads: [B, heads, 1, N]
        heads = (rows, s.n_groups, s.num_heads // s.n_groups, s.state_size)
        bh = bm[:, :, None].expand(heads).reshape(rows, s.num_heads, 1, s.state_size)
        ch = cm[:, :, None].expand(heads).reshape(rows, s.num_heads, 1, s.state_size)
        decay = torch.exp(dt * self.A)[..., None, None]  # [B, heads, 1, 1]
        # in place, the input's outer product added without a temporary: the state is the
        # step's largest tensor ([B, heads, P, N] float32)
        ssm.mul_(decay).addcmul_(dt[..., None, None] * bh, xs[..., None])
        # S C as products summed along N (6x faster here than the batched product, B = 8)
        y = (ssm * ch).sum(-1) + xs * self.D[:, None]  # [B, heads, head_dim]
        return self._finish(y.reshape(rows, s.inner), z[:, 0])


def take_mamba2(
    tensor: Callable[[str], AnyWeight],
    prefix: str,
    hf_config: Any,
    quantize: str = "none",
    dtype: torch.dtype = torch.float32,
) -> Mamba2Mixer:
    """The Mamba2 layer at `prefix` (e.g. "model.layers.0.mamba") from transformers' tensors:
    in_proj, out_proj (linears of `quantize`'s kind computing in `dtype`), conv1d [conv_dim,
    1, K], A_log (float64 kept: a GGUF file's, see Mamba2Mixer), D, dt_bias, norm.weight.
    `tensor` answers a tensor by name."""
    shape = Mamba2Shape.from_hf(hf_config)

    def small(name: str) -> torch.Tensor:
        return dequantized(tensor(f"{prefix}.{name}"), torch.float32)

    def linear(name: str) -> AnyLinear:
        bias = small(f"{name}.bias").to(dtype) if shape.proj_bias else None
        return make_linear(tensor(f"{prefix}.{name}.weight"), bias, quantize, None, dtype=dtype)

    a_log = tensor(f"{prefix}.A_log")  # float64 kept (see Mamba2Mixer), else float32
    if not (isinstance(a_log, torch.Tensor) and a_log.dtype == torch.float64):
        a_log = dequantized(a_log, torch.float32)
    conv = small("conv1d.weight")
    conv_bias = small("conv1d.bias").to(dtype) if shape.conv_bias else None
    return Mamba2Mixer(
        shape,
        linear("in_proj"),
        linear("out_proj"),
        conv.reshape(conv.shape[0], -1).to(dtype),
        conv_bias,
        a_log,
        small("D"),
        small("dt_bias"),
        small("norm.weight"),
        dtype,
    )
