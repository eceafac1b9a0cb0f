"""ArchConfig: what the native decoder forward needs, read off a transformers config.

A family is a set of features over one forward (arch/llama.py), not a copy of it:
- Llama, Mistral, Qwen2, Qwen3: the base (Qwen2's q/k/v biases, Qwen3's per-head q/k norm).
- Gemma 2 / Gemma 3 (text): GeGLU, `(1 + w)` RMSNorm (folded into the weights at load),
  sandwich norms around attention and the MLP, embeddings scaled by sqrt(hidden), a query
  scale of its own; Gemma 2's tanh soft-capping of attention scores and logits; Gemma 3's
  per-head q/k norm; sliding-window layers mixed with global ones, each with its RoPE base.
- Phi-3 / Phi-4-mini: q/k/v and gate/up fused in the checkpoint (split where a shard needs
  it), partial rotary embeddings, longrope (the context capped at its short-factor range).
- SmolLM3: RoPE skipped on some layers. Granite 3: its four scalar multipliers.
- Mixtures of experts (arch/moe.py): Qwen3-MoE, Mixtral, OLMoE (q/k norms over the whole
  projection); GLM-4.5 (q/k/v biases, partial RoPE over the first half of each head's dims,
  q/k norms where use_qk_norm says, DeepSeek's router and shared experts, dense first layers).
- Hybrids, whose layers are attention or a fixed-size-state mixer (arch/mixer.py):
  Qwen3-Next and Qwen3.5 (Gated DeltaNet beside gated attention with partial RoPE, `(1 + w)`
  norms; Qwen3-Next's MoE with a shared expert), Granite 4 (Mamba2 beside attention without
  RoPE, MoE and a shared MLP, Granite's multipliers), LFM2 (gated short convolutions beside
  attention with q/k norms).
- gpt-oss: attention sinks (a learned logit per query head in every softmax's denominator),
  sliding-window layers beside full ones, q/k/v and o_proj biases, yarn RoPE, norms that
  multiply in float32; routed experts with biases and a clamped SwiGLU (arch/moe.py).
- DeepSeek-V2 / V3 (and Kimi K2): multi-head latent attention (MlaConfig): each token caches
  one compressed latent and a shared RoPE key instead of per-head K and V.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from neuronpy.arch.moe import HYBRID_MOE_MODEL_TYPES, MOE_MODEL_TYPES, MoeConfig, moe_config
from neuronpy.errors import UnsupportedArchitectureError

log = logging.getLogger(__name__)

# multi-head latent attention (MlaConfig)
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
# model_type -> the family features it may use. Everything else is refused by name.
SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "phi3",
    "smollm3",
    "granite",
    *MOE_MODEL_TYPES,
    "glm4_moe",
    *HYBRID_MOE_MODEL_TYPES,
    "qwen3_5_text",
    "lfm2",
    *MLA_MODEL_TYPES,
    "gpt_oss",
)
# model_type -> {the config's name of a layer type: the layer it is (arch/mixer.py's kinds)}
HYBRID_LAYERS = {
    "qwen3_next": {"linear_attention": "gdn", "full_attention": "attention"},
    "qwen3_5_text": {"linear_attention": "gdn", "full_attention": "attention"},
    "qwen3_5_moe_text": {"linear_attention": "gdn", "full_attention": "attention"},
    "granitemoehybrid": {
        "linear_attention": "mamba2",
        "mamba": "mamba2",
        "attention": "attention",
        "full_attention": "attention",
    },
    "lfm2": {"conv": "conv", "full_attention": "attention", "attention": "attention"},
}
QWEN_NEXT = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# families with an RMSNorm over each head's q and k before RoPE
QK_NORM = ("qwen3", "gemma3_text", "qwen3_moe", "olmoe", "lfm2", *QWEN_NEXT)
# RoPE variants whose inverse frequencies do not depend on the sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# ...and longrope, whose short factors hold up to its original context (the context is capped
# there: past it, transformers switches every position to the long factors at once)
ROPE_TYPES = (*STATIC_ROPE_TYPES, "longrope")
# hidden_act / hidden_activation -> the MLP's gate activation
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
GEMMA = ("gemma2", "gemma3_text")
# families whose config's layer_types mix sliding-window layers with full ones
MIXED_WINDOW = (*GEMMA, "gpt_oss")


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2 / V3). Each token's key and value for every
    head come from one latent of `kv_lora_rank` values (plus a `rope_dim` key shared by the
    heads), so the cache holds the latent and the shared key alone: one "KV head" of
    kv_lora_rank + rope_dim keys and no values of its own (the latent is the values).

    Attention runs in latent space: each head's query (its `nope_dim` part) is multiplied by
    that head's key up-projection, so its scores are taken against the latent directly, and
    the weighted sum of latents is multiplied by the head's value up-projection after. This is
    the same sum as expanding every cached latent into per-head keys and values, in another
    order, and it reads kv_lora_rank + rope_dim values per cached token instead of
    heads * (nope_dim + rope_dim + v_dim)."""

    q_lora_rank: int  # the query's own low-rank step (0: one q_proj)
    kv_lora_rank: int
    nope_dim: int  # each head's query/key dims without RoPE
    rope_dim: int  # each head's rotated query dims, and the shared key's
    v_dim: int  # each head's value dims (before o_proj)
    # RoPE over interleaved pairs (x0, x1), (x2, x3)...: the checkpoint's rotated rows are put
    # in half-split order at load (every even dim, then every odd one), the same rotation
    interleaved: bool = True

    @property
    def key_dim(self) -> int:
        """The cached width per token: the latent, then the shared RoPE key."""
        return self.kv_lora_rank + self.rope_dim

    @classmethod
    def from_hf(cls, hf_config: Any) -> MlaConfig:
        return cls(
            q_lora_rank=int(getattr(hf_config, "q_lora_rank", None) or 0),
            kv_lora_rank=int(hf_config.kv_lora_rank),
            nope_dim=int(hf_config.qk_nope_head_dim),
            rope_dim=int(hf_config.qk_rope_head_dim),
            v_dim=int(hf_config.v_head_dim),
            # DeepSeek-V2 rotates interleaved pairs always (complex products); V3 as it says
            interleaved=hf_config.model_type == "deepseek_v2"
            or bool(getattr(hf_config, "rope_interleave", True)),
        )


@dataclass(frozen=True)
class ArchConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    context_len: int
    qk_norm: bool  # Qwen3, Gemma 3: RMSNorm over head_dim on q and k before RoPE
    tie_word_embeddings: bool
    act: str = "silu"  # the MLP's gate activation: "silu" or "gelu_tanh" (GeGLU)
    attn_scale: float | None = None  # the query scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    embed_scale: float = 1.0  # Gemma: sqrt(hidden); Granite: embedding_multiplier
    embed_scale_rounded: bool = False  # Gemma: the scale rounded to the model's dtype first
    residual_scale: float = 1.0  # Granite: each block's output times residual_multiplier
    logits_scale: float = 1.0  # Granite: logits divided by logits_scaling
    sandwich_norms: bool = False  # Gemma: RMSNorm on the attention and MLP outputs too
    norm_offset: float = 0.0  # Gemma: norms multiply by (offset + w)
    rotary_dim: int = 0  # rotated dims of each head (0: all; Phi-4-mini: 3/4 of them)
    # per layer: the RoPE it uses, an index into the model's ropes (None: no RoPE, SmolLM3);
    # empty: every layer uses rope 0
    layer_rope: tuple[int | None, ...] = ()
    sliding_window: int | None = None  # the window of the layers that have one
    # per layer: whether it attends within `sliding_window` (empty: none does)
    sliding_layers: tuple[bool, ...] = ()
    moe: MoeConfig | None = None  # mixture-of-experts families (arch/moe.py); None when dense
    qk_norm_full: bool = False  # OLMoE: q/k RMSNorm over the whole projection, not per head
    attn_gate: bool = False  # Qwen3-Next: a sigmoid gate per head and dim on attention's output
    # per layer: "attention", or the fixed-size-state mixer it has instead (arch/mixer.py:
    # "gdn", "mamba2", "conv"); empty: every layer attends
    layer_types: tuple[str, ...] = ()
    attn_sinks: bool = False  # gpt-oss: a learned sink logit per query head (self_attn.sinks)
    # gpt-oss: norms multiply in float32, then round (`(w * x).to(dtype)`): weights kept float32
    norm_fp32: bool = False
    # DeepSeek's multi-head latent attention (then num_kv_heads is 1 and head_dim the cached
    # width, MlaConfig.key_dim); None for every other family
    mla: MlaConfig | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )

    @property
    def value_dim(self) -> int:
        """Each head's attention output width: head_dim, or an MLA model's latent width."""
        return self.mla.kv_lora_rank if self.mla is not None else self.head_dim

    @property
    def cached_value_dim(self) -> int:
        """The values' width in the KV cache per KV head: head_dim, or 0 for an MLA model
        (its cached keys begin with the latent, which is its values)."""
        return 0 if self.mla is not None else self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads that share one KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: it attends to the whole context)."""
        if self.sliding_layers and self.sliding_layers[layer]:
            return self.sliding_window
        return None

    @property
    def windowed(self) -> bool:
        """Whether any layer attends within a sliding window."""
        return any(self.sliding_layers)

    def rope_of(self, layer: int) -> int | None:
        """Which of the model's ropes `layer` uses (None: none)."""
        return self.layer_rope[layer] if self.layer_rope else 0

    @classmethod
    def from_hf(cls, hf_config: Any, arch_name: str | None = None) -> ArchConfig:
        """Reads a transformers config; refuses what the native layer cannot compute exactly."""
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = getattr(hf_config, "architectures", None) or [arch_name or model_type]
            raise UnsupportedArchitectureError(
                f"architecture {', '.join(map(str, archs))} (model_type {model_type!r}) is not "
                f"supported; neuronpy supports: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = getattr(hf_config, "hidden_activation", None) or getattr(
            hf_config, "hidden_act", "silu"
        )
        if act not in ACTIVATIONS:
            raise UnsupportedArchitectureError(
                f"hidden_act {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
            )
        layer_types = hybrid_layer_types(hf_config)
        if getattr(hf_config, "clip_qkv", None) is not None:
            raise UnsupportedArchitectureError("clip_qkv (OLMoE) is not supported")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        context_len = int(hf_config.max_position_embeddings)
        layers = int(hf_config.num_hidden_layers)
        ropes, layer_rope = layer_ropes(hf_config)
        partial = 1.0
        for params in ropes:
            rope_type = params.get("rope_type", "default")
            if rope_type not in ROPE_TYPES:
                raise UnsupportedArchitectureError(
                    f"RoPE type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
                )
            if rope_type == "longrope":
                short = int(params["original_max_position_embeddings"])
                if short < context_len:
                    log.warning(
                        "longrope: the context is capped at %d tokens (its short factors' "
                        "range); the model's %d would switch every position to the long "
                        "factors past it",
                        short,
                        context_len,
                    )
                    context_len = short
            partial = partial_rotary_factor(hf_config, params)
        rotary_dim = int(head_dim * partial)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise UnsupportedArchitectureError(f"partial rotary factor {partial} is not supported")
        window = getattr(hf_config, "sliding_window", None)
        if model_type in ("qwen2", "smollm3") and not getattr(hf_config, "use_sliding_window", 0):
            window = None  # a window in the config that the model does not use
        sliding: tuple[bool, ...] = ()
        if model_type in MIXED_WINDOW and window:
            # sliding-window layers mixed with global ones: a banded mask per layer, over the
            # full KV (exact; the cache keeps every column of the sliding layers too)
            types = getattr(hf_config, "layer_types", None) or [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
            ]
            sliding = tuple(t == "sliding_attention" for t in types)
        elif window:
            # every layer slides: with a window no longer than the context, full attention over
            # at most `window` tokens is exactly sliding-window attention: cap the context there
            context_len = min(context_len, int(window))
            window = None
        gemma = model_type in GEMMA
        granite = model_type in ("granite", "granitemoehybrid")
        qwen_next = model_type in QWEN_NEXT
        if model_type == "granitemoehybrid" and hf_config.position_embedding_type != "rope":
            layer_rope = (None,) * layers  # Granite 4: attention without positions (NoPE)
        scalar = getattr(hf_config, "query_pre_attn_scalar", None)
        mla = MlaConfig.from_hf(hf_config) if model_type in MLA_MODEL_TYPES else None
        if mla is not None:
            # one cached "KV head" of the latent and the shared RoPE key; RoPE is applied
            # to the rotated parts alone (rotary_dim is theirs); the query scale as
            # transformers' (YaRN's mscale folded in for every dim)
            from transformers.modeling_rope_utils import yarn_apply_mscale

            num_kv_heads, head_dim, rotary_dim = 1, mla.key_dim, mla.key_dim
            scalar_mla = yarn_apply_mscale(
                rope_parameters(hf_config), (mla.nope_dim + mla.rope_dim) ** -0.5
            )
        else:
            num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
            scalar_mla = None
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=mlp_size(hf_config),
            rms_norm_eps=float(getattr(hf_config, "rms_norm_eps", None) or hf_config.norm_eps),
            context_len=int(context_len),
            qk_norm=model_type in QK_NORM or _flag_qk_norm(hf_config),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            act=ACTIVATIONS[act],
            attn_scale=(
                float(hf_config.attention_multiplier)
                if granite
                else (float(scalar) ** -0.5 if gemma and scalar else scalar_mla)
            ),
            attn_softcap=_cap(getattr(hf_config, "attn_logit_softcapping", None)),
            final_softcap=_cap(getattr(hf_config, "final_logit_softcapping", None)),
            embed_scale=(
                float(hf_config.hidden_size) ** 0.5
                if gemma
                else float(getattr(hf_config, "embedding_multiplier", 1.0))
            ),
            embed_scale_rounded=gemma,
            residual_scale=float(getattr(hf_config, "residual_multiplier", 1.0)),
            logits_scale=float(getattr(hf_config, "logits_scaling", 1.0)),
            sandwich_norms=gemma,
            norm_offset=1.0 if gemma or qwen_next else 0.0,
            rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
            layer_rope=layer_rope,
            sliding_window=int(window) if sliding and any(sliding) else None,
            sliding_layers=sliding if any(sliding) else (),
            moe=moe_config(hf_config),
            qk_norm_full=model_type == "olmoe",
            attn_gate=qwen_next,
            layer_types=layer_types,
            attn_sinks=model_type == "gpt_oss",
            norm_fp32=model_type == "gpt_oss",
            mla=mla,
        )


def _flag_qk_norm(hf_config: Any) -> bool:
    """GLM-4.5's per-head q/k RMSNorm, there where its config's use_qk_norm says."""
    return hf_config.model_type == "glm4_moe" and bool(getattr(hf_config, "use_qk_norm", False))


def hybrid_layer_types(hf_config: Any) -> tuple[str, ...]:
    """Per layer, "attention" or its fixed-size-state mixer's kind, for a hybrid family; empty
    for the others (every layer attends)."""
    model_type = getattr(hf_config, "model_type", None)
    kinds = HYBRID_LAYERS.get(model_type)
    if kinds is None:
        return ()
    types = list(getattr(hf_config, "layer_types", None) or ())
    if model_type == "lfm2" and not types:
        full = set(getattr(hf_config, "full_attn_idxs", None) or ())
        types = [
            "full_attention" if i in full else "conv" for i in range(hf_config.num_hidden_layers)
        ]
    if len(types) != hf_config.num_hidden_layers:
        raise UnsupportedArchitectureError(f"{model_type}: the config's layer_types do not fit")
    unknown = sorted(set(types) - set(kinds))
    if unknown:
        raise UnsupportedArchitectureError(f"{model_type}: layer types {unknown} are not supported")
    out = tuple(kinds[t] for t in types)
    if "attention" not in out:
        raise UnsupportedArchitectureError(
            f"{model_type} without an attention layer is not supported (its snapshot is KV)"
        )
    return out


def mlp_size(hf_config: Any) -> int:
    """The dense MLP's intermediate size (LFM2 derives it from the config's, as it builds it)."""
    size = int(hf_config.intermediate_size)
    if getattr(hf_config, "model_type", None) == "lfm2" and hf_config.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if hf_config.block_ffn_dim_multiplier is not None:
            size = int(hf_config.block_ffn_dim_multiplier * size)
            multiple = hf_config.block_multiple_of
            size = multiple * ((size + multiple - 1) // multiple)
    return size


def partial_rotary_factor(hf_config: Any, params: dict[str, Any]) -> float:
    """The share of each head's dims RoPE rotates (1: all), from `params` (one of
    layer_ropes') or the config."""
    fallback = getattr(hf_config, "partial_rotary_factor", 1)
    return float(params.get("partial_rotary_factor", fallback) or 1.0)


def _cap(value: Any) -> float | None:
    return float(value) if value else None


def layer_ropes(hf_config: Any) -> tuple[list[dict[str, Any]], tuple[int | None, ...]]:
    """The distinct RoPE settings of a model, and per layer the index of its own (None: the
    layer has no RoPE): one for most models; Gemma 3 one per layer type (a local base for the
    sliding layers); SmolLM3 none on the layers its `no_rope_layers` marks 0."""
    params = rope_parameters(hf_config)
    layers = int(hf_config.num_hidden_layers)
    types = getattr(hf_config, "layer_types", None)
    if types and all(isinstance(params.get(t), dict) for t in set(types)):
        kinds = sorted(set(types), key=list(types).index)
        return [dict(params[k], layer_type=k) for k in kinds], tuple(kinds.index(t) for t in types)
    use = getattr(hf_config, "no_rope_layers", None)
    if use is not None and not all(use):
        return [params], tuple(0 if u else None for u in use[:layers])
    return [params], ()


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """RoPE settings under either spelling (transformers 5 `rope_parameters`, 4 `rope_scaling`)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        return dict(params)
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    out = dict(scaling)
    out.setdefault("rope_type", out.pop("type", "default"))
    out.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return out


def rope_inv_freq(
    hf_config: Any, params: dict[str, Any] | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim/2] and the cos/sin scale, as transformers computes them,
    of `params` (one of layer_ropes'; None: the model's only one)."""
    params = rope_parameters(hf_config) if params is None else params
    rope_type = params.get("rope_type", "default")
    layer_type = params.get("layer_type")
    if rope_type == "default":
        base = float(params.get("rope_theta", 10000.0))
        head_dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads
        )
        dim = int(head_dim * partial_rotary_factor(hf_config, params))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, **kwargs)
    return inv_freq.float(), float(scale)
