"""The operations a compiled forward leaves to the model itself: its linear layers, its
attention and its mixture-of-experts blocks, called by handle from the graph PyTorch's
compiler builds around them.

A compiled graph holds tensors and numbers, not Python objects. The model's linear layers keep
weights the graph cannot hold (oneDNN-packed, int8: opaque layouts), and its attention runs
the step's own plan (KV groups, prompt chunks, verify steps) over caches that live outside the
graph and change every step. So the graph calls these two operators with a handle (a 0-d int64
tensor naming the model, a graph input like any other, so one graph serves every model of the
same shape) and plain ints (which projection, which layer); each finds the model and runs its
eager code. Everything between them (norms, RoPE, residuals, SiLU, the embedding) is the
compiler's to fuse. A mixture-of-experts block (arch/moe.py) is one operator too: which
experts run, over how many tokens each, depends on the routing, a shape no graph can fix.
A layer whose state is fixed-size (arch/mixer.py) is one too: its states live outside the
graph, per group and per chunk, as the KV does.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Protocol

import torch


class Opaque(Protocol):
    """What the operators call on the model a handle names."""

    def linear_at(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Projection `index` (LlamaModel's numbering) over x."""
        ...

    def attend_at(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """The running forward's attention in `layer`: [N, H * D]."""
        ...

    def moe_at(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s mixture-of-experts block over x: [N, hidden]."""
        ...

    def mix_at(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The running forward's fixed-size-state layer `layer` over x: [N, hidden]."""
        ...


_MODELS: dict[int, weakref.ref[Opaque]] = {}
_KEYS = itertools.count()


def register(model: Opaque) -> torch.Tensor:
    """A handle for `model` (held weakly: the handle dies with it)."""
    key = next(_KEYS)
    _MODELS[key] = weakref.ref(model, lambda _: _MODELS.pop(key, None))
    return torch.tensor(key, dtype=torch.long)


def _model(handle: torch.Tensor) -> Opaque:
    model = _MODELS[int(handle)]()
    if model is None:
        raise RuntimeError("a compiled forward ran for a model that no longer exists")
    return model


_LIB = torch.library.Library("neuronpy", "DEF")
_LIB.define("linear(Tensor x, Tensor model, int index, int out_features) -> Tensor")
_LIB.define("attend(Tensor q, Tensor k, Tensor v, Tensor model, int layer, int width) -> Tensor")
_LIB.define("moe(Tensor x, Tensor model, int layer) -> Tensor")
_LIB.define("mix(Tensor x, Tensor model, int layer) -> Tensor")


def _linear(x: torch.Tensor, model: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    return _model(model).linear_at(index, x)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    model: torch.Tensor,
    layer: int,
    width: int,
) -> torch.Tensor:
    return _model(model).attend_at(layer, q, k, v)


def _moe(x: torch.Tensor, model: torch.Tensor, layer: int) -> torch.Tensor:
    return _model(model).moe_at(layer, x)


def _mix(x: torch.Tensor, model: torch.Tensor, layer: int) -> torch.Tensor:
    return _model(model).mix_at(layer, x)


# (a Library kernel costs about a third of what a torch.library.custom_op does per call)
_LIB.impl("linear", _linear, "CompositeExplicitAutograd")
_LIB.impl("attend", _attend, "CompositeExplicitAutograd")
_LIB.impl("moe", _moe, "CompositeExplicitAutograd")
_LIB.impl("mix", _mix, "CompositeExplicitAutograd")


@torch.library.register_fake("neuronpy::linear")
def _linear_shape(
    x: torch.Tensor, model: torch.Tensor, index: int, out_features: int
) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.register_fake("neuronpy::attend")
def _attend_shape(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    model: torch.Tensor,
    layer: int,
    width: int,
) -> torch.Tensor:
    return q.new_empty(q.shape[0], width)


@torch.library.register_fake("neuronpy::moe")
def _moe_shape(x: torch.Tensor, model: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.register_fake("neuronpy::mix")
def _mix_shape(x: torch.Tensor, model: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(x)


def linear(x: torch.Tensor, model: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    """In a compiled graph: the model's projection `index` over x ([..., out_features])."""
    return torch.ops.neuronpy.linear(x, model, index, out_features)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    model: torch.Tensor,
    layer: int,
    width: int,
) -> torch.Tensor:
    """In a compiled graph: the model's running attention in `layer` ([N, width]: each token's
    heads' outputs side by side, H * D, or H * kv_lora_rank for latent attention)."""
    return torch.ops.neuronpy.attend(q, k, v, model, layer, width)


def moe(x: torch.Tensor, model: torch.Tensor, layer: int) -> torch.Tensor:
    """In a compiled graph: the model's mixture-of-experts block in `layer` ([N, hidden])."""
    return torch.ops.neuronpy.moe(x, model, layer)


def mix(x: torch.Tensor, model: torch.Tensor, layer: int) -> torch.Tensor:
    """In a compiled graph: the model's fixed-size-state layer `layer` ([N, hidden]), over the
    running forward's states (arch/mixer.py)."""
    return torch.ops.neuronpy.mix(x, model, layer)
