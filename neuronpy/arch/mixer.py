"""Layers whose per-sequence state is fixed-size, not a KV cache that grows with the sequence:
Gated DeltaNet (Qwen3-Next, Qwen3.5: a short convolution window and a recurrent matrix per
head), Mamba2 (Granite 4: a convolution window and an SSM state per head), LFM2's gated short
convolutions (a convolution window).

A mixer takes the layer's input-normed hidden states and gives the layer's output (after its
own output projection, before the residual), reading and advancing its state in place:
- `prefill(x [T, hidden], state, start)`: one sequence's T tokens at absolute positions
  [start, start + T); each state tensor is [1, ...];
- `step(x [B, hidden], state)`: one token for each of B rows, state tensors [B, ...].

The parity contract holds for them as for attention (design.md): a row's result does not
depend on the other rows of a step, and a prompt prefilled in calls that split it at multiples
of STATE_BLOCK gives the same bits as one call. So a mixer computes per row (elementwise
operations, and products whose batch dimension is the rows), and a chunked prefill cuts its
chunks at absolute multiples of STATE_BLOCK, whatever the calls' boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

# Prefill chunks of a mixer's chunked form start at multiples of this absolute position; the
# prefix cache keeps a fixed-size state only at such a boundary (arch/kv.py, worker).
STATE_BLOCK = 64


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of a layer, per row: its shape (without the row dimension) and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class Mixer(Protocol):
    """A layer whose per-sequence state is a few fixed-size tensors (see the module's docstring)."""

    def state_specs(self) -> tuple[StateSpec, ...]:
        """The state tensors a row holds (zeros before its first token)."""
        ...

    def prefill(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], start: int) -> torch.Tensor:
        """x [T, hidden] of one sequence at positions [start, start + T) -> [T, hidden]; the
        state ([1, ...] each) is advanced in place past the T tokens."""
        ...

    def step(self, x: torch.Tensor, state: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x [B, hidden], one token per row -> [B, hidden]; the state ([B, ...] each) is
        advanced in place by each row's token."""
        ...

    def linears(self) -> list[Any]:
        """Every projection of the layer (for the weights' bytes and the load log)."""
        ...


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)). PyTorch's own sigmoid (and SiLU, softplus) gives an element other last
    bits by where it lies in the tensor (its vectorized body and scalar tail differ), so a row's
    result would depend on the batch; exp, log, rsqrt and the four operations do not (measured
    over sizes 1 to 40000 at every offset)."""
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), place-independent as `sigmoid`."""
    return x * sigmoid(x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)), x itself above 20 as F.softplus; place-independent as `sigmoid` (within
    1e-6 of F.softplus)."""
    return torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x.clamp(max=20.0))))


def project(linear: Any, x: torch.Tensor) -> torch.Tensor:
    """linear(x) for x [M, in], each row the same bits whatever M: oneDNN's packed product gives
    a lone row other last bits than the same row among others when the input is wide (measured:
    any M >= 2 agrees, M = 1 does not), so a lone row goes through twice."""
    if x.shape[0] == 1:
        return linear(torch.cat((x, x)))[:1]
    return linear(x)


def causal_conv(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """A depthwise causal convolution that carries its window: x [B, T, C], `window`
    [B, C, K - 1] (the inputs before x[:, 0], oldest first; replaced in place by the last
    K - 1 inputs), weight [C, K] -> [B, T, C] (no activation).

    Written as K shifted products added in order, so that each output is the same arithmetic
    whatever T, B or the split of a sequence into calls (F.conv1d's blocking follows the
    shapes)."""
    k = weight.shape[1]
    full = torch.cat((window.transpose(1, 2).to(x.dtype), x), dim=1)  # [B, K - 1 + T, C]
    t = x.shape[1]
    w = weight.to(x.dtype)
    out = full[:, 0:t] * w[:, 0]
    for j in range(1, k):
        out = out + full[:, j : j + t] * w[:, j]
    if bias is not None:
        out = out + bias.to(x.dtype)
    if k > 1:
        window.copy_(full[:, t:].transpose(1, 2))
    return out


class ShortConv:
    """LFM2's gated short convolution: in_proj gives B, C and x; the depthwise causal
    convolution runs over B * x; C gates its output; out_proj. Its state is the convolution's
    window, the last K - 1 values of B * x."""

    def __init__(
        self, in_proj: Any, out_proj: Any, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        self.in_proj = in_proj  # hidden -> 3 * hidden: B, C, x
        self.out_proj = out_proj  # hidden -> hidden
        self.weight = weight  # [hidden, K]
        self.bias = bias  # [hidden] or None
        self.hidden = weight.shape[0]

    def state_specs(self) -> tuple[StateSpec, ...]:
        return (StateSpec((self.hidden, self.weight.shape[1] - 1), self.weight.dtype),)

    def _mix(self, x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        rows, t = x.shape[:2]  # x [R, T, hidden]
        b, c, h = project(self.in_proj, x.flatten(0, 1)).unflatten(0, (rows, t)).chunk(3, dim=-1)
        conv = causal_conv(b * h, window, self.weight, self.bias)
        return project(self.out_proj, (c * conv).flatten(0, 1)).unflatten(0, (rows, t))

    def prefill(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], start: int) -> torch.Tensor:
        return self._mix(x[None], state[0])[0]

    def step(self, x: torch.Tensor, state: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self._mix(x[:, None], state[0])[:, 0]

    def linears(self) -> list[Any]:
        return [self.in_proj, self.out_proj]
