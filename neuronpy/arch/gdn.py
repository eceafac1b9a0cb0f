"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the linear-attention mixer of their hybrid layers.

Per token t, in each value head: q, k (L2-normalized, from a key head shared by
num_v_heads // num_k_heads value heads) and v come out of a short causal convolution and SiLU;
a decay g = -exp(A_log) * softplus(a + dt_bias) <= 0 and a rate beta = sigmoid(b) come from
the input; the head's state S [head_k_dim, head_v_dim] follows the gated delta rule

    S = exp(g) S + k (beta (v - exp(g) S^T k))^T,   o = S^T q / sqrt(head_k_dim),

and the heads' outputs go through an RMSNorm gated by SiLU(z) and the output projection. A
step runs this recurrence; a prefill runs its chunked form (transformers'
`torch_chunk_gated_delta_rule`: within a chunk, a triangular solve condenses the chunk's
updates into a few products), in chunks cut at absolute multiples of STATE_BLOCK, so a prompt
prefilled in calls split there gives the bits of one call (arch/mixer.py).

Both families' projections are one linear: Qwen3.5 stores q/k/v, z, b and a apart, Qwen3-Next
fuses them per key head (q, k, v, z of a head's group side by side, then b, a); its rows are
permuted at load into Qwen3.5's order, [q | k | v | z | b | a], so the forward is one code.

Batch invariance: PyTorch's vectorized SiLU, sigmoid and softplus give an element different
bits depending on where it falls in the tensor (the vector body or the scalar tail of a
loop), measured on this AVX-512 CPU; exp, log1p, division and rsqrt do not. So those three
are written here from exp and log1p, and a row's arithmetic no longer depends on how many
rows or tokens share the call. The step's products are matmuls whose batch is rows x heads.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from neuronpy.arch.linear import AnyLinear, FusedLinear, make_linear
from neuronpy.arch.mixer import (
    STATE_BLOCK,
    StateSpec,
    causal_conv,
    project,
    sigmoid,
    silu,
    softplus,
)
from neuronpy.arch.quant import AnyWeight, cat_weights, dequantized

L2NORM_EPS = 1e-6  # transformers' l2norm (FLA's)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / |x| over the last dim, as transformers' (and FLA's) l2norm: x * rsqrt(sum x^2 + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _take_rows(weight: AnyWeight, index: torch.Tensor) -> AnyWeight:
    if isinstance(weight, torch.Tensor):
        return weight.index_select(0, index)
    return weight.take_rows(index)


def interleaved_qkvz_order(nk: int, nv: int, dk: int, dv: int) -> torch.Tensor:
    """Rows of Qwen3-Next's in_proj_qkvz (per key head: q, k, then the v and z of its
    nv // nk value heads) in the order [q | k | v | z], each by head."""
    r = nv // nk
    group = 2 * dk + 2 * r * dv
    base = torch.arange(nk)[:, None] * group  # [nk, 1]
    q = base + torch.arange(dk)
    k = base + dk + torch.arange(dk)
    v = base + 2 * dk + torch.arange(r * dv)
    z = base + 2 * dk + r * dv + torch.arange(r * dv)
    return torch.cat([part.reshape(-1) for part in (q, k, v, z)])


def interleaved_ba_order(nk: int, nv: int) -> torch.Tensor:
    """Rows of Qwen3-Next's in_proj_ba (per key head: the b, then the a of its value heads)
    in the order [b | a]."""
    r = nv // nk
    base = torch.arange(nk)[:, None] * 2 * r
    b = base + torch.arange(r)
    a = base + r + torch.arange(r)
    return torch.cat((b.reshape(-1), a.reshape(-1)))


class GatedDeltaNet:
    """One Gated DeltaNet layer (see the module's docstring): x [.., hidden], the input-normed
    hidden states -> [.., hidden], before the residual. Implements arch/mixer.py's Mixer."""

    def __init__(
        self,
        in_proj: AnyLinear,
        out_proj: AnyLinear,
        conv_weight: torch.Tensor,
        a_log: torch.Tensor,
        dt_bias: torch.Tensor,
        norm_weight: torch.Tensor,
        *,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        eps: float,
        dtype: torch.dtype,
    ) -> None:
        if num_v_heads % num_k_heads:
            raise ValueError("Gated DeltaNet needs num_v_heads a multiple of num_k_heads")
        self.nk, self.nv, self.dk, self.dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        if in_proj.out_features != self.conv_dim + self.value_dim + 2 * num_v_heads:
            raise ValueError("in_proj must give [q | k | v | z | b | a]")
        self.in_proj = in_proj  # hidden -> [q | k | v | z | b | a]
        self.out_proj = out_proj  # value_dim -> hidden
        self.conv_weight = conv_weight  # [conv_dim, K], model dtype
        self.kernel = conv_weight.shape[1]
        # [nv] float32: -exp(A_log), as the reference; from a float64 A_log (a GGUF file's,
        # log of its stored -exp(A_log)) taken in float64, so that it rounds to the stored value
        self.neg_a = (
            (-a_log.exp()).float() if a_log.dtype == torch.float64 else -a_log.float().exp()
        )
        self.dt_bias = dt_bias.float()  # [nv]
        self.norm_weight = norm_weight  # [head_v_dim], model dtype
        self.eps = eps
        self.dtype = dtype
        self.scale = head_k_dim**-0.5

    def state_specs(self) -> tuple[StateSpec, ...]:
        """The convolution's last K - 1 inputs (model dtype) and each value head's recurrent
        state (float32, as the reference keeps it)."""
        return (
            StateSpec((self.conv_dim, self.kernel - 1), self.dtype),
            StateSpec((self.nv, self.dk, self.dv), torch.float32),
        )

    def linears(self) -> list[Any]:
        """The fused input projection and the output projection."""
        return [self.in_proj, self.out_proj]

    def _inputs(
        self, x: torch.Tensor, rows: int, window: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B * T, hidden] of B rows of T tokens -> q, k [B, T, nv, dk] (normalized, q
        scaled; key heads repeated), v [B, T, nv, dv] (float32), z [B, T, nv, dv] (model
        dtype), g, beta [B, T, nv] (float32). Advances the convolution's window."""
        b_, t = rows, x.shape[0] // rows
        proj = project(self.in_proj, x).reshape(b_, t, -1)
        c, vd, nv = self.conv_dim, self.value_dim, self.nv
        qkv = silu(causal_conv(proj[..., :c], window, self.conv_weight, None))
        z = proj[..., c : c + vd].reshape(b_, t, nv, self.dv)
        beta = sigmoid(proj[..., c + vd : c + vd + nv]).float()
        g = self.neg_a * softplus(proj[..., c + vd + nv :].float() + self.dt_bias)
        qkv = qkv.float()
        q = qkv[..., : self.key_dim].reshape(b_, t, self.nk, self.dk)
        k = qkv[..., self.key_dim : 2 * self.key_dim].reshape(b_, t, self.nk, self.dk)
        v = qkv[..., 2 * self.key_dim :].reshape(b_, t, nv, self.dv)
        if nv != self.nk:
            q = q.repeat_interleave(nv // self.nk, dim=2)
            k = k.repeat_interleave(nv // self.nk, dim=2)
        return l2norm(q) * self.scale, l2norm(k), v, z, g, beta

    def _finish(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o [.., nv, dv] (float32), z alike (model dtype) -> the gated RMSNorm of each head
        (transformers' RMSNormGated: float32 statistics, weight times o in the model's dtype,
        times SiLU(z) in float32) and the output projection."""
        o = o.to(self.dtype).float()  # the reference's core output is in the model's dtype
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        o = (self.norm_weight * o.to(self.dtype)) * silu(z.float())
        flat = o.to(self.dtype).flatten(-2)
        return project(self.out_proj, flat.flatten(0, -2)).unflatten(0, flat.shape[:-1])

    def step(self, x: torch.Tensor, state: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x [B, hidden] -> [B, hidden]: the recurrence for one token per row, all rows at
        once; the state ([B, conv_dim, K - 1], [B, nv, dk, dv]) advanced in place."""
        window, s = state
        q, k, v, z, g, beta = self._inputs(x, x.shape[0], window)
        q, k, v, z, g, beta = q[:, 0], k[:, 0], v[:, 0], z[:, 0], g[:, 0], beta[:, 0]
        rows = x.shape[0] * self.nv
        flat = s.view(rows, self.dk, self.dv)
        # S's one read: q and k against the old state together; the decay applied after
        # (exp(g) S)^T k = exp(g) S^T k, and o = S_new^T q = exp(g) S^T q + (k . q) delta
        read = torch.bmm(torch.stack((q, k), dim=2).view(rows, 2, self.dk), flat)
        read = read.view(*q.shape[:2], 2, self.dv)
        decay = torch.exp(g)[..., None]  # [B, nv, 1]
        delta = (v - decay * read[:, :, 1]) * beta[..., None]
        o = decay * read[:, :, 0] + (q * k).sum(dim=-1, keepdim=True) * delta
        flat.mul_(decay.view(rows, 1, 1))
        flat.baddbmm_(k.reshape(rows, self.dk, 1), delta.reshape(rows, 1, self.dv))
        return self._finish(o, z)

    def prefill(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], start: int) -> torch.Tensor:
        """x [T, hidden] of one sequence at positions [start, start + T) -> [T, hidden]: the
        chunked rule over chunks cut at absolute multiples of STATE_BLOCK; the state ([1, ..]
        each) advanced in place."""
        window, s = state
        q, k, v, z, g, beta = self._inputs(x, 1, window)
        q, k, v, g, beta = q[0], k[0], v[0], g[0], beta[0]
        t = x.shape[0]
        cuts = [0]
        while cuts[-1] < t:
            cuts.append(
                min(t, (start + cuts[-1]) // STATE_BLOCK * STATE_BLOCK + STATE_BLOCK - start)
            )
        rec = s[0]
        outs = []
        for lo, hi in itertools.pairwise(cuts):
            o, rec = self._chunk(
                *(part[lo:hi].transpose(0, 1).contiguous() for part in (q, k, v, g, beta)), rec
            )
            outs.append(o)
        s[0].copy_(rec)
        o = torch.cat(outs, dim=1).transpose(0, 1)  # [T, nv, dv]
        return self._finish(o, z[0])

    @staticmethod
    def _chunk(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        s: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk of L tokens by head, as transformers' torch_chunk_gated_delta_rule does
        each of its chunks: q, k [H, L, dk], v [H, L, dv], g, beta [H, L], s [H, dk, dv] ->
        the chunk's outputs [H, L, dv] and the state after it."""
        n = q.shape[1]
        cum = g.cumsum(dim=-1)  # [H, L]
        upper = torch.ones(n, n, dtype=torch.bool, device=g.device).triu(1)
        pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
        k_beta = k * beta[..., None]
        ut = (k_beta @ k.transpose(-1, -2)) * pair
        decay = cum.exp()[..., None]
        new_v = torch.linalg.solve_triangular(
            ut, v * beta[..., None], upper=False, unitriangular=True
        )
        k_decay = torch.linalg.solve_triangular(ut, k_beta * decay, upper=False, unitriangular=True)
        attn = (q @ k.transpose(-1, -2)) * pair
        v_new = new_v - k_decay @ s
        o = (q * decay) @ s + attn @ v_new
        last = cum[..., -1:]  # [H, 1]
        k_rest = k * (last - cum).exp()[..., None]
        s = s * last.exp()[..., None] + k_rest.transpose(-1, -2) @ v_new
        return o, s


def take_gdn(
    tensor: Callable[[str], AnyWeight],
    prefix: str,
    hf_config: Any,
    quantize: str,
    dtype: torch.dtype,
) -> GatedDeltaNet:
    """The layer under `prefix` (e.g. "model.layers.0.linear_attn") from a checkpoint's tensors
    by transformers' names: Qwen3-Next's in_proj_qkvz / in_proj_ba (rows permuted out of their
    per-key-head layout) or Qwen3.5's in_proj_qkv / _z / _b / _a (or _qkv / _z / _ba, as
    llama.cpp's Qwen3-Next converter writes them), fused into one projection
    (side by side where the parts' layouts differ), every projection as `quantize` makes it."""
    nk, nv = hf_config.linear_num_key_heads, hf_config.linear_num_value_heads
    dk, dv = hf_config.linear_key_head_dim, hf_config.linear_value_head_dim

    def weight(name: str) -> AnyWeight:
        return tensor(f"{prefix}.{name}.weight")

    def plain(name: str, dt: torch.dtype) -> torch.Tensor:
        return dequantized(tensor(f"{prefix}.{name}"), dt)

    try:
        qkvz, ba = weight("in_proj_qkvz"), weight("in_proj_ba")
    except KeyError:
        parts = [weight("in_proj_qkv"), weight("in_proj_z")]
        try:
            parts += [weight("in_proj_b"), weight("in_proj_a")]
        except KeyError:  # Qwen3-Next's GGUF files: q/k/v/z apart, b and a interleaved
            parts.append(_take_rows(weight("in_proj_ba"), interleaved_ba_order(nk, nv)))
    else:
        parts = [
            _take_rows(qkvz, interleaved_qkvz_order(nk, nv, dk, dv)),
            _take_rows(ba, interleaved_ba_order(nk, nv)),
        ]
    fused = cat_weights(parts)
    if fused is None and quantize == "none":
        fused = torch.cat([dequantized(w, dtype) for w in parts])
    in_proj: AnyLinear
    if fused is None:  # parts stored in different layouts: side by side, each its own
        in_proj = FusedLinear([make_linear(w, None, quantize, None, dtype=dtype) for w in parts])
    else:
        in_proj = make_linear(fused, None, quantize, None, dtype=dtype)
    conv = plain("conv1d.weight", dtype)
    a_log = tensor(f"{prefix}.A_log")  # float64 kept (see GatedDeltaNet), else float32
    if not (isinstance(a_log, torch.Tensor) and a_log.dtype == torch.float64):
        a_log = dequantized(a_log, torch.float32)
    return GatedDeltaNet(
        in_proj,
        make_linear(weight("out_proj"), None, quantize, None, dtype=dtype),
        conv.reshape(conv.shape[0], -1),  # [conv_dim, 1, K] -> [conv_dim, K]
        a_log,
        plain("dt_bias", torch.float32),
        plain("norm.weight", dtype),
        num_k_heads=nk,
        num_v_heads=nv,
        head_k_dim=dk,
        head_v_dim=dv,
        eps=hf_config.rms_norm_eps,
        dtype=dtype,
    )
