"""A transformers model's weights as the native model takes them: whole, or one rank's shard.

Tensor parallelism is a Megatron-style split, two all-reduces per layer:
- column-parallel (rows of the weight): the fused q/k/v, so that rank r computes its own
  attention heads, and the fused gate/up, so that it computes its own slice of the MLP;
- row-parallel (columns of the weight): o_proj and down read only that rank's heads / slice
  and produce a partial sum of the full output, which an all-reduce completes (arch/tp.py).
Embeddings and norms are replicated. The LM head is kept whole where logits are wanted (rank 0)
and dropped elsewhere: only rank 0 answers jobs, so a follower's logits would go unread. One
device is the split over one rank, so both paths take the weights the same way. A
mixture-of-experts block splits every expert as the dense MLP is split, its router
replicated (arch/moe.py).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from neuronpy.arch.config import ArchConfig, MlaConfig, layer_ropes, rope_inv_freq
from neuronpy.arch.gdn import take_gdn
from neuronpy.arch.linear import (
    AnyLinear,
    FusedLinear,
    head_mode,
    make_embedding,
    make_linear,
)
from neuronpy.arch.mamba2 import take_mamba2
from neuronpy.arch.mixer import Mixer, ShortConv
from neuronpy.arch.moe import MoeBlock, take_moe_block
from neuronpy.arch.quant import AnyWeight, QuantEmbedding, cat_weights, dequantized
from neuronpy.errors import NeuronError


class TensorParallelError(NeuronError, ValueError):
    """A model that cannot be split over the requested number of ranks."""


@dataclass
class MlaWeights:
    """A multi-head latent attention layer's own parts (arch/config.py's MlaConfig). Its
    first projection (LayerWeights.qkv) gives the query (or its low-rank step) beside the
    latent and the shared RoPE key; the key and value up-projections are kept apart, per head,
    for attention in latent space."""

    q_b: AnyLinear | None  # q_lora_rank -> H * (nope + rope) (None: the query came whole)
    q_norm: torch.Tensor | None  # [q_lora_rank]: the norm between the query's two steps
    kv_norm: torch.Tensor  # [kv_lora_rank]: the latent's norm
    w_uk: torch.Tensor  # [H, nope, kv_lora_rank]: each head's key up-projection
    w_uv: torch.Tensor  # [H, kv_lora_rank, v_dim]: each head's value up-projection


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    # hidden -> (H + 2*KVH) * D: q, k and v fused into one weight read (None beside `mixer`)
    qkv: AnyLinear | None
    q_norm: torch.Tensor | None  # Qwen3: [D]
    k_norm: torch.Tensor | None
    o_proj: AnyLinear | None  # H * D -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: AnyLinear | None  # hidden -> 2 * inter: gate and up fused (None beside `moe`)
    down: AnyLinear | None  # inter -> hidden
    moe: MoeBlock | None = None  # a mixture-of-experts MLP in place of the dense one
    # Gemma's sandwich norms: on the attention's output and the MLP's, before each residual
    attn_out_norm: torch.Tensor | None = None  # [hidden]
    mlp_out_norm: torch.Tensor | None = None  # [hidden]
    # a layer whose state is fixed-size (arch/mixer.py) in place of attention
    mixer: Mixer | None = None
    # multi-head latent attention's parts (DeepSeek): then qkv gives [q or q_a; latent; key]
    mla: MlaWeights | None = None
    # gpt-oss: each query head's attention sink, a logit in every softmax's denominator
    sinks: torch.Tensor | None = None  # [H] (this rank's heads)


@dataclass
class ModelWeights:
    """Everything LlamaModel computes with; `config` is the shard's (its local head counts)."""

    config: ArchConfig
    embed: torch.Tensor | QuantEmbedding  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: Any  # AnyLinear, or a stand-in giving [..., 0] on ranks whose logits go unread
    inv_freq: torch.Tensor  # [rotary_dim/2] float32
    rope_scale: float
    # every RoPE the layers use (config.layer_rope indexes it); the first is inv_freq's
    ropes: list[tuple[torch.Tensor, float]] = dataclasses.field(default_factory=list)


class Checkpoint(Protocol):
    """A model's tensors under transformers' parameter names: a loaded transformers model's
    (HFCheckpoint) or a file's read as they are stored (arch/gguf.py's GGUFCheckpoint)."""

    config: Any  # transformers' config
    dtype: torch.dtype  # what the model computes in

    def get(self, name: str) -> AnyWeight | None:
        """Tensor `name` (a plain tensor, or a quantized layout of arch/quant.py), or None."""
        ...

    def __contains__(self, name: str) -> bool:
        """Whether it holds tensor `name` (nothing is read)."""
        ...


class HFCheckpoint:
    """The parameters of a loaded transformers `*ForCausalLM`, as they are (no copies), and its
    saved buffers (a router's e_score_correction_bias is one: DeepSeek-V3, GLM-4.5)."""

    def __init__(self, hf_model: Any) -> None:
        self.model = hf_model
        self.config = hf_model.config
        self._params = dict(hf_model.named_parameters(remove_duplicate=False))
        # the model's dtype: its embedding's (some parameters are kept float32 in a bfloat16
        # model, a router's weight among them)
        self.dtype = next(iter(self._params.values())).dtype
        saved = set(hf_model.state_dict(keep_vars=True))
        for name, buffer in hf_model.named_buffers(remove_duplicate=False):
            if name in saved:  # a persistent buffer, not a cache such as RoPE's inv_freq
                self._params.setdefault(name, buffer)

    def get(self, name: str) -> AnyWeight | None:
        t = self._params.get(name)
        return None if t is None else t.detach()

    def __contains__(self, name: str) -> bool:
        return name in self._params


# the submodule names of transformers' vision-language models' language model (their
# `get_decoder()`), which their checkpoints' text weights live under
LANGUAGE_MODELS = ("language_model", "text_model")


# the vision-language families whose images neuronpy reads: an image's rows take its
# placeholder tokens' places and the language model's positions stay 1-D (its tokens see
# each other causally, or, in Gemma 3, the whole image: arch/vision.py's BIDIRECTIONAL).
# Others (Qwen-VL's multimodal RoPE) serve their language model, text only.
IMAGE_FAMILIES = ("idefics3", "smolvlm", "gemma3")


def is_vision_language(config: Any) -> bool:
    """Whether a transformers config is a vision-language model's (a text and a vision part)."""
    return getattr(config, "vision_config", None) is not None and hasattr(config, "text_config")


def reads_images(config: Any) -> bool:
    """Whether a transformers config is a vision-language model of IMAGE_FAMILIES."""
    return is_vision_language(config) and getattr(config, "model_type", None) in IMAGE_FAMILIES


class LanguageModelCheckpoint(HFCheckpoint):
    """A loaded vision-language model's language model under the names a `*ForCausalLM` gives
    it (`model.layers.0...`, `lm_head.weight`): the checkpoint neuronpy's layers are built
    from. Its config is the text config (tied as the whole model ties its head)."""

    def __init__(self, hf_model: Any) -> None:
        super().__init__(hf_model)
        inner = hf_model.model
        name = next(n for n in LANGUAGE_MODELS if getattr(inner, n, None) is not None)
        prefix = f"model.{name}."
        params = {
            "model." + k.removeprefix(prefix): v
            for k, v in self._params.items()
            if k.startswith(prefix)
        }
        params.update({k: v for k, v in self._params.items() if k.startswith("lm_head.")})
        self._params = params
        config = copy.deepcopy(hf_model.config.text_config)
        config.tie_word_embeddings = bool(getattr(hf_model.config, "tie_word_embeddings", False))
        self.config = config
        self.dtype = params["model.embed_tokens.weight"].dtype


# model_type -> (transformers' Llama name, the family's own) for the parts named otherwise
RENAMED = {
    "lfm2": (
        (".self_attn.o_proj.", ".self_attn.out_proj."),
        (".self_attn.q_norm.", ".self_attn.q_layernorm."),
        (".self_attn.k_norm.", ".self_attn.k_layernorm."),
        (".input_layernorm.", ".operator_norm."),
        (".post_attention_layernorm.", ".ffn_norm."),
        (".mlp.gate_proj.", ".feed_forward.w1."),
        (".mlp.up_proj.", ".feed_forward.w3."),
        (".mlp.down_proj.", ".feed_forward.w2."),
        ("model.norm.", "model.embedding_norm."),
    ),
}


class Renamed:
    """A checkpoint read under Llama's names where the family names a part otherwise."""

    def __init__(self, ckpt: Checkpoint, pairs: Sequence[tuple[str, str]]) -> None:
        self.ckpt = ckpt
        self.config = ckpt.config
        self.dtype = ckpt.dtype
        self.model = getattr(ckpt, "model", ckpt)
        self._pairs = pairs

    def _name(self, name: str) -> str:
        for ours, theirs in self._pairs:
            name = name.replace(ours, theirs)
        return name

    def get(self, name: str) -> AnyWeight | None:
        return self.ckpt.get(self._name(name))

    def __contains__(self, name: str) -> bool:
        return self._name(name) in self.ckpt


def as_checkpoint(source: Any) -> Checkpoint:
    """A Checkpoint as it is; a transformers model wrapped in one."""
    if hasattr(source, "get") and hasattr(source, "dtype"):
        return source
    if is_vision_language(source.config):
        return LanguageModelCheckpoint(source)
    return HFCheckpoint(source)


def input_absmax(hf_model: Any, token_ids: Sequence[int]) -> dict[str, torch.Tensor]:
    """Calibration: each nn.Linear's largest absolute input per channel over `token_ids`, by
    the module's name."""
    stats: dict[str, torch.Tensor] = {}

    def recorder(name: str) -> Callable[..., None]:
        def record(_module: Any, inputs: tuple[torch.Tensor, ...], _output: Any) -> None:
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).abs().amax(dim=0).float()
            stats[name] = torch.maximum(stats[name], x) if name in stats else x

        return record

    hooks = [
        m.register_forward_hook(recorder(name))
        for name, m in hf_model.named_modules()
        if isinstance(m, torch.nn.Linear)
    ]
    try:
        with torch.inference_mode():
            device = next(hf_model.parameters()).device
            hf_model(torch.tensor([list(token_ids)], device=device))
    finally:
        for hook in hooks:
            hook.remove()
    return stats


def check_divisible(config: ArchConfig, world_size: int) -> None:
    """Refuses a split that would cut an attention head, a KV group or the MLP unevenly."""
    if world_size < 1:
        raise TensorParallelError(f"tensor-parallel size must be at least 1, got {world_size}")
    counts = {
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "intermediate_size": config.intermediate_size,
    }
    if config.moe is not None:
        counts["moe_intermediate_size"] = config.moe.intermediate_size
        if config.moe.shared_intermediate_size:  # a shared expert splits as the routed ones
            counts["shared_expert_intermediate_size"] = config.moe.shared_intermediate_size
    if config.mla is not None and world_size > 1:
        raise TensorParallelError(
            f"{config.model_type}: tensor parallelism over multi-head latent attention is not "
            "supported (every head reads the one latent: each rank would hold all of it)"
        )
    if config.qk_norm_full and world_size > 1:
        raise TensorParallelError(
            "cannot split this model over tensor-parallel ranks: its q/k norm spans every "
            "attention head at once (OLMoE)"
        )
    bad = [f"{name} = {value}" for name, value in counts.items() if value % world_size]
    if bad:
        raise TensorParallelError(
            f"cannot split this model over {world_size} tensor-parallel ranks: "
            f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not divisible by {world_size} "
            f"(the model has {config.num_heads} attention heads, {config.num_kv_heads} KV heads "
            f"and an intermediate size of {config.intermediate_size})"
        )


def shard_config(config: ArchConfig, world_size: int) -> ArchConfig:
    """The configuration one rank computes with: its local head counts and MLP width."""
    check_divisible(config, world_size)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // world_size,
        num_kv_heads=config.num_kv_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
        moe=None if config.moe is None else config.moe.shard(world_size),
    )


class _NoLogits:
    """Stands in for the LM head on ranks whose logits nobody reads: an empty [..., 0]."""

    bias = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], 0)


def take_mixer(
    kind: str,
    tensor: Callable[[str], AnyWeight],
    block: str,
    hf_config: Any,
    quantize: str,
    dtype: torch.dtype,
) -> Mixer:
    """Layer `block`'s fixed-size-state mixer of `kind` (arch/mixer.py), from the checkpoint."""
    if kind == "conv":
        conv = f"{block}.conv"
        bias = hf_config.conv_bias

        def linear(name: str) -> AnyLinear:
            b = dequantized(tensor(f"{name}.bias"), dtype) if bias else None
            return make_linear(tensor(f"{name}.weight"), b, quantize, dtype=dtype)

        weight = dequantized(tensor(f"{conv}.conv.weight"), dtype)
        return ShortConv(
            linear(f"{conv}.in_proj"),
            linear(f"{conv}.out_proj"),
            weight.reshape(weight.shape[0], -1),
            dequantized(tensor(f"{conv}.conv.bias"), dtype) if bias else None,
        )
    if kind == "gdn":
        return take_gdn(tensor, f"{block}.linear_attn", hf_config, quantize, dtype)
    if kind == "mamba2":
        return take_mamba2(tensor, f"{block}.mamba", hf_config, quantize, dtype)
    raise ValueError(f"unknown layer kind {kind!r}")


def rope_rows(mla: MlaConfig) -> torch.Tensor:
    """The order MLA's rotated rows are put in at load: interleaved pairs (x0, x1), (x2, x3)...
    become the half-split layout apply_rope rotates (every even dim, then every odd one).
    A query and a key permuted alike have the same dot products, and each rotated output is
    the same sum as the interleaved rotation's, so nothing else changes."""
    dims = torch.arange(mla.rope_dim)
    return torch.cat((dims[0::2], dims[1::2])) if mla.interleaved else dims


def _query_rows(w: torch.Tensor, heads: int, mla: MlaConfig) -> torch.Tensor:
    """A query projection's rows [H * (nope + rope), ...] with each head's rotated rows in
    rope_rows' order."""
    qk = mla.nope_dim + mla.rope_dim
    per_head = w.reshape(heads, qk, *w.shape[1:])
    rope = per_head[:, mla.nope_dim :][:, rope_rows(mla)]
    return torch.cat((per_head[:, : mla.nope_dim], rope), dim=1).reshape(w.shape)


def take_mla(
    tensor: Callable[[str], AnyWeight],
    get: Callable[[str], AnyWeight | None],
    attn: str,
    config: ArchConfig,
    quantize: str,
    dtype: torch.dtype,
    stats: Mapping[str, torch.Tensor],
) -> tuple[AnyLinear, MlaWeights, AnyLinear]:
    """A multi-head latent attention layer under `attn` (e.g. "model.layers.0.self_attn"):
    its first projection (q_a_proj or q_proj, then kv_a_proj_with_mqa, fused: both read the
    normed hidden state), its MlaWeights and its o_proj. `get` answers None for a tensor the
    checkpoint does not hold (the biases). The up-projections stay in `dtype`: they are
    multiplied head by head (a batched product), not as a linear layer."""
    mla = config.mla
    assert mla is not None
    heads, r = config.num_heads, mla.kv_lora_rank
    q_name = f"{attn}.q_a_proj" if mla.q_lora_rank else f"{attn}.q_proj"
    kv_name = f"{attn}.kv_a_proj_with_mqa"
    order = torch.cat((torch.arange(r), r + rope_rows(mla)))
    wq = dequantized(tensor(f"{q_name}.weight"), dtype)
    if not mla.q_lora_rank:
        wq = _query_rows(wq, heads, mla)
    wkv = dequantized(tensor(f"{kv_name}.weight"), dtype)[order]
    bq, bkv = (_plain(get(f"{m}.bias"), dtype) for m in (q_name, kv_name))
    bias = None
    if bq is not None or bkv is not None:
        bq = torch.zeros(wq.shape[0], dtype=dtype) if bq is None else bq
        bkv = torch.zeros(wkv.shape[0], dtype=dtype) if bkv is None else bkv[order]
        if not mla.q_lora_rank:
            bq = _query_rows(bq, heads, mla)
        bias = torch.cat((bq, bkv))
    first = make_linear(torch.cat((wq, wkv)), bias, quantize, stats.get(q_name), dtype=dtype)
    q_b = q_norm = None
    if mla.q_lora_rank:
        wb = _query_rows(dequantized(tensor(f"{attn}.q_b_proj.weight"), dtype), heads, mla)
        q_b = make_linear(wb, None, quantize, stats.get(f"{attn}.q_b_proj"), dtype=dtype)
        q_norm = dequantized(tensor(f"{attn}.q_a_layernorm.weight"), dtype).clone()
    kv_b = dequantized(tensor(f"{attn}.kv_b_proj.weight"), dtype)
    kv_b = kv_b.reshape(heads, mla.nope_dim + mla.v_dim, r)
    o_bias = _plain(get(f"{attn}.o_proj.bias"), dtype)
    o_proj = make_linear(
        tensor(f"{attn}.o_proj.weight"), o_bias, quantize, stats.get(f"{attn}.o_proj"), dtype=dtype
    )
    weights = MlaWeights(
        q_b=q_b,
        q_norm=q_norm,
        kv_norm=dequantized(tensor(f"{attn}.kv_a_layernorm.weight"), dtype).clone(),
        w_uk=kv_b[:, : mla.nope_dim].contiguous(),
        w_uv=kv_b[:, mla.nope_dim :].transpose(1, 2).contiguous(),
    )
    return first, weights, o_proj


def _rows(t: AnyWeight | None, lo: int, hi: int) -> AnyWeight | None:
    if t is None or (lo, hi) == (0, t.shape[0]):
        return t
    # a slice is a copy, not a view, so that the full weight it came from can be freed
    return t[lo:hi].clone() if isinstance(t, torch.Tensor) else t.rows(lo, hi)


def _cols(t: AnyWeight, lo: int, hi: int) -> AnyWeight:
    if (lo, hi) == (0, t.shape[1]):
        return t
    return t[:, lo:hi].clone() if isinstance(t, torch.Tensor) else t.cols(lo, hi)


def _plain(t: AnyWeight | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bias as a tensor of its own (see `norm` in take_weights)."""
    return None if t is None else dequantized(t, dtype).clone()


def take_weights(
    source: Any,
    rank: int = 0,
    world_size: int = 1,
    *,
    quantize: str = "none",
    calibration_ids: Sequence[int] = (),
    lm_head: bool = True,
    input_ranges: Mapping[str, torch.Tensor] | None = None,
) -> ModelWeights:
    """Rank `rank`'s weights of a checkpoint (a loaded transformers `*ForCausalLM`, or a
    Checkpoint) split over `world_size` ranks (the whole model for 0 of 1).

    Rank r takes KV heads [r*KVH/N, (r+1)*KVH/N) and the query heads that attend to them (query
    head h shares KV head h // G, so those are heads [r*H/N, (r+1)*H/N)), and MLP columns
    [r*I/N, (r+1)*I/N) of both gate and up. `quantize` says what every projection (the
    vocabulary one included) becomes, after slicing, so that scales are per shard (see
    make_linear); "int8" is smoothed with activation ranges measured on `calibration_ids`
    when given (a transformers model only), or with `input_ranges` (each projection's largest
    absolute input per channel, by module name: see llama.measure_input_ranges).
    `lm_head=False` leaves out the vocabulary projection (see the module docstring).
    """
    ckpt = as_checkpoint(source)
    hf_config = ckpt.config
    dtype = ckpt.dtype
    config = ArchConfig.from_hf(hf_config, type(getattr(ckpt, "model", ckpt)).__name__)
    if config.model_type in RENAMED:
        ckpt = Renamed(ckpt, RENAMED[config.model_type])
    mixers = any(t != "attention" for t in config.layer_types)
    if mixers and world_size > 1:
        raise TensorParallelError(
            f"{config.model_type}: tensor parallelism over layers with fixed-size states "
            "(linear attention, Mamba2, short convolutions) is not supported"
        )
    local = shard_config(config, world_size)
    if not 0 <= rank < world_size:
        raise TensorParallelError(f"rank {rank} is not in [0, {world_size})")
    stats: Mapping[str, torch.Tensor] = input_ranges or {}
    if quantize == "int8" and calibration_ids and isinstance(ckpt, HFCheckpoint):
        stats = input_absmax(ckpt.model, calibration_ids)
    d = config.head_dim
    q_lo, q_hi = rank * local.num_heads * d, (rank + 1) * local.num_heads * d
    kv_lo, kv_hi = rank * local.num_kv_heads * d, (rank + 1) * local.num_kv_heads * d
    i_lo, i_hi = rank * local.intermediate_size, (rank + 1) * local.intermediate_size

    def tensor(name: str) -> AnyWeight:
        t = ckpt.get(name)
        if t is None:
            raise KeyError(f"the checkpoint has no tensor {name!r}")
        return t

    def column(parts: list[tuple[str, int, int]]) -> AnyLinear:
        """Rows [lo, hi) of each module's weight (and bias), fused in this order."""
        weights = [_rows(tensor(f"{m}.weight"), lo, hi) for m, lo, hi in parts]
        biases = [_plain(_rows(ckpt.get(f"{m}.bias"), lo, hi), dtype) for m, lo, hi in parts]
        if any(b is not None for b in biases):
            biases = [
                b if b is not None else torch.zeros(hi - lo, dtype=dtype)
                for b, (_, lo, hi) in zip(biases, parts, strict=True)
            ]
        # every part reads the same input (the normed hidden state): the first one's ranges
        absmax = stats.get(parts[0][0])
        fused = cat_weights(weights)  # type: ignore[arg-type]
        if fused is None and quantize in ("none", "int8"):
            # all float in the end, or quantized again from float row by row (int8: a scale
            # per output row): one weight after all, one call a step
            fused = torch.cat([dequantized(w, dtype) for w in weights])  # type: ignore[arg-type]
        if fused is None:  # parts stored in different layouts: side by side, each its own
            return FusedLinear(
                [
                    make_linear(w, b, quantize, absmax, dtype=dtype)  # type: ignore[arg-type]
                    for w, b in zip(weights, biases, strict=True)
                ]
            )
        bias = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
        return make_linear(fused, bias, quantize, absmax, dtype=dtype)

    def row(module: str, lo: int, hi: int) -> AnyLinear:
        """Input columns [lo, hi): a partial sum. The bias is added once, by rank 0."""
        weight = _cols(tensor(f"{module}.weight"), lo, hi)
        bias = _plain(ckpt.get(f"{module}.bias"), dtype) if rank == 0 else None
        absmax = stats.get(module)
        return make_linear(
            weight, bias, quantize, None if absmax is None else absmax[lo:hi], dtype=dtype
        )

    def norm(name: str) -> torch.Tensor:
        if config.norm_offset:  # Gemma's (1 + w), in float32 as it computes it
            return dequantized(tensor(name), torch.float32) + config.norm_offset
        if config.norm_fp32:  # gpt-oss multiplies in float32 before it rounds
            return dequantized(tensor(name), torch.float32).clone()
        # a copy of its own: the checkpoint's tensor may be a view of a memory-mapped
        # safetensors file, which it would keep resident whole (2.2 GB for a 1B bf16 model)
        return dequantized(tensor(name), dtype).clone()

    hd, kvd, inter = config.num_heads * d, config.num_kv_heads * d, config.intermediate_size

    def parts(
        fused: str, modules: list[str], spans: list[tuple[int, int, int]]
    ) -> list[tuple[str, int, int]]:
        """Rows [lo, hi) of each module (spans: lo, hi and the module's rows), or of their
        segments in one weight when the checkpoint holds them fused (Phi-3's qkv_proj and
        gate_up_proj), each segment after the ones before it."""
        if f"{fused}.weight" not in ckpt:
            return [(m, lo, hi) for m, (lo, hi, _) in zip(modules, spans, strict=True)]
        offsets = itertools.accumulate((rows for _, _, rows in spans), initial=0)
        return [(fused, at + lo, at + hi) for at, (lo, hi, _) in zip(offsets, spans, strict=False)]

    def qkv(attn: str) -> list[tuple[str, int, int]]:
        modules = [f"{attn}.{p}_proj" for p in "qkv"]
        q = 2 if config.attn_gate else 1  # Qwen3-Next: each head's query, then its gate
        spans = [(q * q_lo, q * q_hi, q * hd), (kv_lo, kv_hi, kvd), (kv_lo, kv_hi, kvd)]
        return parts(f"{attn}.qkv_proj", modules, spans)

    def gate_up(mlp: str) -> list[tuple[str, int, int]]:
        modules = [f"{mlp}.gate_proj", f"{mlp}.up_proj"]
        return parts(f"{mlp}.gate_up_proj", modules, [(i_lo, i_hi, inter)] * 2)

    def sinks(attn: str) -> torch.Tensor | None:
        """gpt-oss's sink logits of this rank's query heads (split as the heads are)."""
        if not config.attn_sinks:
            return None
        lo, hi = rank * local.num_heads, (rank + 1) * local.num_heads
        return dequantized(tensor(f"{attn}.sinks"), dtype)[lo:hi].clone()

    def sandwich(name: str) -> torch.Tensor | None:
        return norm(name) if config.sandwich_norms else None

    # Gemma's norms: input, then post_attention on the attention's output, pre_feedforward
    # before the MLP and post_feedforward on its output; Llama's post_attention is the MLP's
    pre_mlp = "pre_feedforward_layernorm" if config.sandwich_norms else "post_attention_layernorm"
    granite_moe = config.model_type == "granitemoehybrid"

    def moe_block(block: str, moe: Any) -> MoeBlock:
        if granite_moe:  # routed experts beside a shared MLP, under their own names
            return take_moe_block(
                tensor,
                f"{block}.block_sparse_moe",
                moe,
                rank,
                world_size,
                quantize,
                dtype,
                shared_prefix=f"{block}.shared_mlp",
            )
        return take_moe_block(tensor, f"{block}.mlp", moe, rank, world_size, quantize, dtype)

    layers = []
    for i in range(config.num_layers):
        block = f"model.layers.{i}"
        attn, mlp = f"{block}.self_attn", f"{block}.mlp"
        moe = config.moe if config.moe and i in config.moe.sparse_layers else None  # experts
        kind = config.layer_types[i] if config.layer_types else "attention"
        mixer = None
        if kind != "attention":
            mixer = take_mixer(kind, tensor, block, hf_config, quantize, dtype)
        attends = mixer is None
        if attends and config.mla is not None:
            first, mla, o_proj = take_mla(tensor, ckpt.get, attn, config, quantize, dtype, stats)
        else:
            first = column(qkv(attn)) if attends else None
            o_proj = row(f"{attn}.o_proj", q_lo, q_hi) if attends else None
            mla = None
        layers.append(
            LayerWeights(
                input_norm=norm(f"{block}.input_layernorm.weight"),
                qkv=first,
                q_norm=norm(f"{attn}.q_norm.weight") if config.qk_norm and attends else None,
                k_norm=norm(f"{attn}.k_norm.weight") if config.qk_norm and attends else None,
                o_proj=o_proj,
                mixer=mixer,
                post_norm=norm(f"{block}.{pre_mlp}.weight"),
                gate_up=None if moe else column(gate_up(mlp)),
                down=None if moe else row(f"{mlp}.down_proj", i_lo, i_hi),
                moe=None if moe is None else moe_block(block, moe),
                attn_out_norm=sandwich(f"{block}.post_attention_layernorm.weight"),
                mlp_out_norm=sandwich(f"{block}.post_feedforward_layernorm.weight"),
                mla=mla,
                sinks=sinks(attn) if attends else None,
            )
        )
    embed_weight = tensor("model.embed_tokens.weight")
    head: Any = _NoLogits()
    if lm_head:  # a tied head (none of its own) computes with the embedding's very tensors
        weight = ckpt.get("lm_head.weight")
        bias = _plain(ckpt.get("lm_head.bias"), dtype)
        weight = embed_weight if weight is None else weight
        head = make_linear(weight, bias, head_mode(quantize), stats.get("lm_head"), dtype=dtype)
    ropes = [rope_inv_freq(hf_config, params) for params in layer_ropes(hf_config)[0]]
    inv_freq, scale = ropes[0]
    return ModelWeights(
        config=local,
        embed=make_embedding(embed_weight, quantize, dtype),
        layers=layers,
        norm=norm("model.norm.weight"),
        lm_head=head,
        inv_freq=inv_freq,
        rope_scale=scale,
        ropes=ropes,
    )
