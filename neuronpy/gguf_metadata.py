"""A GGUF file's transformers config and tokenizer, from one quick read of its metadata.

transformers (5.25) builds a Llama-family GGUF's config with gguf's GGUFReader, which makes a
numpy object for every element of every metadata array, then parses each element in Python:
the vocabulary, its merges and the token types of a 49k-token model are ~150k of them, about
5 s on a busy 2-core machine. AutoTokenizer builds that config a second time only to choose
the tokenizer's class. Here
the config comes from read_index (arch/gguf.py: scalars and numeric arrays, the vocabulary
left unread), laid out by transformers' own tables exactly as its GGUF reader lays it out, and
the tokenizer is built by the class AutoTokenizer would choose, from the file, by transformers'
own GGUF tokenizer path. Any other architecture, or a file beside a tokenizer_config.json,
goes through transformers' Auto classes as before. tests/test_gguf_metadata.py checks both
against transformers' own path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import transformers

from neuronpy.arch.gguf import NATIVE_ARCHITECTURES, SkippedArray, read_index


def read_gguf_metadata(path: Path) -> tuple[Any, transformers.PreTrainedTokenizerBase]:
    """(config, tokenizer) of GGUF file `path`, as transformers' AutoConfig and AutoTokenizer
    with gguf_file= give them. Raises what those raise (ValueError, OSError, ...)."""
    config = gguf_config(path)
    if config is None:
        return transformers_metadata(path)
    tokenizer_class = _tokenizer_class(path, config)
    if tokenizer_class is None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name
        )
    else:
        tokenizer = tokenizer_class.from_pretrained(str(path.parent), gguf_file=path.name)
    return config, tokenizer


def transformers_metadata(path: Path) -> tuple[Any, transformers.PreTrainedTokenizerBase]:
    """(config, tokenizer) by transformers' own GGUF path: the reference read_gguf_metadata
    matches, and the way for the architectures it does not read itself."""
    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return config, tokenizer


def gguf_config(path: Path) -> Any | None:
    """The transformers config of a Llama-family GGUF file (None: another architecture, or a
    file whose config needs a value read_index leaves unread)."""
    fields, tensors = read_index(path)
    config = gguf_config_dict(fields, [t.name for t in tensors])
    if config is None:
        return None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if config.get("model_type") not in CONFIG_MAPPING:
        return None  # (transformers' own path raises its own error)
    # (AutoConfig names the config after the folder it read)
    return CONFIG_MAPPING[config["model_type"]].from_dict(config, name_or_path=str(path.parent))


def gguf_config_dict(fields: dict[str, Any], tensor_names: list[str]) -> dict[str, Any] | None:
    """The config dict transformers' load_gguf_checkpoint(return_tensors=False) returns for a
    GGUF file of one of NATIVE_ARCHITECTURES with these metadata fields (read_index's) and
    tensors; None for anything else. Its steps for these architectures, in its order: the
    Mistral rename, the tied head, the architecture's defaults, each field renamed by
    GGUF_CONFIG_MAPPING, the vocabulary's length when the file states no vocab_size."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    architecture = fields.get("general.architecture")
    if architecture in ("qwen35", "qwen3next"):
        return qwen_next_config_dict(fields, tensor_names, architecture)
    if architecture == "granitehybrid":
        return granite_hybrid_config_dict(fields, tensor_names)
    if architecture not in NATIVE_ARCHITECTURES or architecture not in GGUF_CONFIG_MAPPING:
        return None
    # transformers tests `"mistral" in model_name` on the list of general.name's values: an
    # exact match, not a substring
    renamed = architecture
    if "llama" in architecture and fields.get("general.name") == "mistral":
        renamed = "mistral"
    config: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in tensor_names}
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(
        renamed, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {}
    )
    for key, value in defaults.items():
        config.setdefault(key, value)
    for key, value in fields.items():
        key = key.replace(architecture, renamed)
        prefix, _, config_key = key.partition(".")
        target = GGUF_CONFIG_MAPPING.get(prefix, {}).get(config_key)
        if target is None or target == -1:
            continue
        if isinstance(value, SkippedArray):
            return None  # a config value read_index did not decode: transformers' path reads it
        if isinstance(value, np.ndarray):
            value = value.tolist()  # Python numbers, as transformers parses them
            if len(value) == 1:
                value = value[0]  # as transformers unwraps a one-element array
        if isinstance(value, str):
            value = value.replace(architecture, renamed)
        config[target] = value
    if "vocab_size" not in config:
        tokens = fields.get("tokenizer.ggml.tokens")
        if isinstance(tokens, SkippedArray):
            config["vocab_size"] = tokens.count
    if architecture == "lfm2":
        _lfm2_config(config)
    return config


def _lfm2_config(config: dict[str, Any]) -> None:
    """transformers' LFM2 steps after the renames: llama.cpp writes head_count_kv per layer (0
    for a convolution layer), which gives the attention layers (full_attn_idxs) and the KV
    head count; feed_forward_length is the MLP's size as built, so nothing is derived from it.
    And the one field transformers' table misses: Lfm2Config's norm_eps, which it reads as
    rms_norm_eps (neuronpy reads either)."""
    heads = config["num_key_value_heads"]
    heads = heads if isinstance(heads, list) else [heads] * config["num_hidden_layers"]
    config["num_key_value_heads"] = max(heads)
    config["block_auto_adjust_ff_dim"] = False
    config["full_attn_idxs"] = [i for i, n in enumerate(heads) if n > 0]
    if "rms_norm_eps" in config:
        config["norm_eps"] = config["rms_norm_eps"]


def qwen_next_config_dict(
    fields: dict[str, Any], tensor_names: list[str], architecture: str
) -> dict[str, Any]:
    """transformers' Qwen3_5TextConfig dict of a llama.cpp "qwen35" file, Qwen3NextConfig's of
    a "qwen3next" one (transformers reads neither: their fields as llama.cpp's Qwen3_5TextModel
    and Qwen3NextModel converters write them; Qwen3-Next's every layer a mixture of experts,
    the only layout llama.cpp names, its top-k weights normalized as it computes them). The
    block count includes the multi-token-prediction layers (nextn_predict_layers), which are
    not read; the layer types follow from full_attention_interval as transformers lays them out
    by default; the rotary share is rope.dimension_count of a head. The MRoPE sections are left
    out: a text prompt's three position streams are equal, so they rotate as one RoPE."""

    def field(key: str, default: Any = None) -> Any:
        value = fields.get(f"{architecture}.{key}", default)
        if isinstance(value, np.ndarray):
            value = value.tolist()
        return value

    heads = int(field("attention.head_count"))
    hidden = int(field("embedding_length"))
    head_dim = int(field("attention.key_length", hidden // heads))
    layers = int(field("block_count")) - int(field("nextn_predict_layers", 0))
    interval = int(field("full_attention_interval", 4))
    value_heads = int(field("ssm.time_step_rank"))
    vocab = field("vocab_size")
    if vocab is None:
        tokens = fields.get("tokenizer.ggml.tokens")
        vocab = tokens.count if isinstance(tokens, SkippedArray) else None
    next_ = architecture == "qwen3next"
    config: dict[str, Any] = {
        "model_type": "qwen3_next" if next_ else "qwen3_5_text",
        "architectures": ["Qwen3NextForCausalLM" if next_ else "Qwen3_5ForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(field("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "intermediate_size": int(field("feed_forward_length")),
        "max_position_embeddings": int(field("context_length")),
        "rms_norm_eps": float(field("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(field("rope.freq_base", 10000.0)),
            "partial_rotary_factor": int(field("rope.dimension_count", head_dim)) / head_dim,
        },
        "layer_types": [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ],
        "linear_conv_kernel_dim": int(field("ssm.conv_kernel")),
        "linear_key_head_dim": int(field("ssm.state_size")),
        "linear_num_key_heads": int(field("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(field("ssm.inner_size")) // value_heads,
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    if next_:
        config.update(
            num_experts=int(field("expert_count")),
            num_experts_per_tok=int(field("expert_used_count")),
            moe_intermediate_size=int(field("expert_feed_forward_length")),
            shared_expert_intermediate_size=int(field("expert_shared_feed_forward_length")),
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
    for key in ("eos_token_id", "pad_token_id"):
        token = fields.get(f"tokenizer.ggml.{key}")
        if token is not None:
            config[key] = int(token)
    return config


def _float32(value: Any) -> float:
    """A float32 field as the decimal it was written from: its shortest repr that rounds to
    the same float32 (0.2, not 0.20000000298), as the checkpoint's config gave it."""
    return float(str(np.float32(value)))


def granite_hybrid_config_dict(fields: dict[str, Any], tensor_names: list[str]) -> dict[str, Any]:
    """transformers' GraniteMoeHybridConfig dict of a llama.cpp "granitehybrid" file (Granite
    4; transformers does not read these), from the fields llama.cpp's GraniteHybridModel
    converter writes: head_count_kv per layer (0 for a Mamba2 layer) gives the layer types and
    the KV head count; the Mamba2 shape from ssm.* (time_step_rank is its head count, inner_size
    its heads times head size, group_count, state_size, conv_kernel); Granite's four multipliers
    from attention.scale, embedding_scale, residual_scale and logit_scale; the routed experts
    (expert_count, expert_used_count; feed_forward_length their size) and the shared MLP's size
    (expert_shared_feed_forward_length); rope.scaling.finetuned true where the attention
    rotates (Bamba's, or a model of no Mamba2 layers), else no positions. A NoPE model's
    context_length is the converter's 2**20 (the checkpoint's own is not written). The biases
    follow from the tensors the file holds; the time-step limits are transformers' default (0,
    inf): the converter writes none."""

    def field(key: str, default: Any = None) -> Any:
        value = fields.get(f"granitehybrid.{key}", default)
        if isinstance(value, np.ndarray):
            value = value.tolist()
        return value

    layers = int(field("block_count"))
    hidden = int(field("embedding_length"))
    kv = field("attention.head_count_kv", 0)
    kv = kv if isinstance(kv, list) else [kv] * layers
    heads = int(field("attention.head_count"))
    ssm_heads = int(field("ssm.time_step_rank"))
    inner = int(field("ssm.inner_size"))
    experts = int(field("expert_count", 0) or 0)
    vocab = field("vocab_size")
    if vocab is None:
        tokens = fields.get("tokenizer.ggml.tokens")
        vocab = tokens.count if isinstance(tokens, SkippedArray) else None
    rope = bool(field("rope.scaling.finetuned", False))
    ffn = field("expert_feed_forward_length") or field("feed_forward_length", 0)
    config: dict[str, Any] = {
        "model_type": "granitemoehybrid",
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(int(n) for n in kv) or heads,
        "intermediate_size": int(ffn),
        "shared_intermediate_size": int(field("expert_shared_feed_forward_length", 0) or 0),
        "num_local_experts": experts,
        "num_experts_per_tok": int(field("expert_used_count", 0) or 0),
        "max_position_embeddings": int(field("context_length")),
        "rms_norm_eps": _float32(field("attention.layer_norm_rms_epsilon", 1e-6)),
        "attention_multiplier": _float32(field("attention.scale", 1.0)),
        "embedding_multiplier": _float32(field("embedding_scale", 1.0)),
        "residual_multiplier": _float32(field("residual_scale", 1.0)),
        "logits_scaling": _float32(field("logit_scale", 1.0)),
        "layer_types": ["attention" if int(n) > 0 else "mamba" for n in kv],
        "position_embedding_type": "rope" if rope else None,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(field("rope.freq_base", 10000.0)),
        },
        "mamba_n_heads": ssm_heads,
        "mamba_d_head": inner // ssm_heads,
        "mamba_d_state": int(field("ssm.state_size")),
        "mamba_n_groups": int(field("ssm.group_count", 1)),
        "mamba_d_conv": int(field("ssm.conv_kernel")),
        "mamba_expand": inner // hidden,
        "mamba_conv_bias": any(n.endswith(".ssm_conv1d.bias") for n in tensor_names),
        "mamba_proj_bias": any(n.endswith(".ssm_in.bias") for n in tensor_names),
        "attention_bias": any(n.endswith(".attn_q.bias") for n in tensor_names),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    for key in ("eos_token_id", "pad_token_id"):
        token = fields.get(f"tokenizer.ggml.{key}")
        if token is not None:
            config[key] = int(token)
    return config


def _tokenizer_class(path: Path, config: Any) -> type | None:
    """The tokenizer class AutoTokenizer.from_pretrained(gguf_file=) chooses for a GGUF file
    whose config is `config`, where the choice follows from the config alone (its
    TOKENIZER_MAPPING, by the config's class); None where AutoTokenizer looks further (a
    tokenizer_config.json beside the file, a class the config names, a Mistral tokenizer
    format), for AutoTokenizer to choose."""
    from transformers.models.auto import tokenization_auto

    backend = getattr(tokenization_auto, "TokenizersBackend", None)
    if backend is None or (path.parent / "tokenizer_config.json").exists():
        return None
    if getattr(config, "tokenizer_class", None):
        return None
    # (AutoTokenizer also matches the config's name against model ids it treats apart; the
    # config it builds for a GGUF file has no name, so none matches)
    chosen = tokenization_auto.TOKENIZER_MAPPING.get(type(config), backend)
    if chosen is None or chosen.__name__ == "MistralCommonBackend":
        return None
    return chosen
