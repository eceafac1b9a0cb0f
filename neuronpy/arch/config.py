"""ArchConfig: what the native Llama-family forward needs, read off a transformers config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from neuronpy.arch.moe import MOE_MODEL_TYPES, MoeConfig, moe_config
from neuronpy.errors import UnsupportedArchitectureError

# model_type -> the family features it may use. Everything else is refused by name.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *MOE_MODEL_TYPES)
# RoPE variants whose inverse frequencies do not depend on the sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    tie_word_embeddings: bool
    moe: MoeConfig | None = None  # mixture-of-experts families (arch/moe.py); None when dense
    qk_norm_full: bool = False  # OLMoE: q/k RMSNorm over the whole projection, not per head

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )

    @property
    def group_size(self) -> int:
        """Query heads that share one KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf_config: Any, arch_name: str | None = None) -> ArchConfig:
        """Reads a transformers config; refuses what the native layer cannot compute exactly."""
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = getattr(hf_config, "architectures", None) or [arch_name or model_type]
            raise UnsupportedArchitectureError(
                f"architecture {', '.join(map(str, archs))} (model_type {model_type!r}) is not "
                f"supported; neuronpy supports the Llama family: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedArchitectureError(f"hidden_act {act!r} is not supported (only silu)")
        rope_type = rope_parameters(hf_config).get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise UnsupportedArchitectureError(
                f"RoPE type {rope_type!r} is not supported; "
                f"supported: {', '.join(STATIC_ROPE_TYPES)}"
            )
        if getattr(hf_config, "clip_qkv", None) is not None:
            raise UnsupportedArchitectureError("clip_qkv (OLMoE) is not supported")
        if getattr(hf_config, "partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedArchitectureError("partial rotary embeddings are not supported")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        context_len = hf_config.max_position_embeddings
        # With a sliding window no longer than the context, full attention over at most
        # `window` tokens is exactly sliding-window attention: cap the context there.
        window = getattr(hf_config, "sliding_window", None)
        if model_type == "qwen2" and not getattr(hf_config, "use_sliding_window", False):
            window = None
        if window:
            context_len = min(context_len, int(window))
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=hf_config.intermediate_size,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            context_len=int(context_len),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "olmoe"),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            moe=moe_config(hf_config),
            qk_norm_full=model_type == "olmoe",
        )


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


def rope_inv_freq(hf_config: Any) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the cos/sin scale, as transformers computes them."""
    params = rope_parameters(hf_config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = float(params.get("rope_theta", 10000.0))
        dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads
        )
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    return inv_freq.float(), float(scale)
