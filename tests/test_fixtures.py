"""Checks that the committed tiny model fixtures load, carry their features, and rebuild exactly."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from tests.factories import fixture_builder, skip_unless_built_with_this_transformers

FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"


bf = fixture_builder()
TIED = {
    "tiny-llama",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-gemma2",
    "tiny-gemma3",
    "tiny-smollm3",
    "tiny-granite",
    "tiny-granite-hybrid",
    "tiny-lfm2",
}


@cache
def _model(name: str) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(FIXTURES_DIR / name).eval()


@cache
def _tokenizer(name: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(FIXTURES_DIR / name)


def _files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("name", bf.FIXTURE_NAMES)
def test_fixture_loads_and_is_consistent(name: str) -> None:
    d = FIXTURES_DIR / name
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= set(
        _files(d)
    )
    assert sum(len(b) for b in _files(d).values()) < 1_000_000
    model, tok = _model(name), _tokenizer(name)
    cfg = model.config
    assert cfg.vocab_size == len(tok) == bf.VOCAB_SIZE
    # (Mixtral's and OLMoE's intermediate_size is each expert's; Qwen3-MoE's its dense layer's)
    # (and Granite 4's the experts'); the hybrids have a layer of each kind on either side
    dense_first = ("tiny-qwen3-moe", "tiny-glm4-moe")  # their intermediate_size: layer 0's
    moe_only = name in (*bf.MOE_FIXTURES, "tiny-granite-hybrid") and name not in dense_first
    inter = bf.MOE_INTERMEDIATE_SIZE if moe_only else 128
    layers = bf.HYBRID_LAYERS if name in bf.HYBRID_FIXTURES else 2
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (64, layers, inter)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if name in bf.MLA_FIXTURES:  # latent attention: one latent of 32 for the 4 heads
        latent = (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
        assert (cfg.num_attention_heads, *latent) == (4, 32, 16, 8, 16)
    else:
        assert (cfg.num_attention_heads, cfg.num_key_value_heads, head_dim) == (4, 2, 16)
    assert cfg.max_position_embeddings == 512
    assert cfg.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert cfg.pad_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>") == 0
    assert model.generation_config.eos_token_id == cfg.eos_token_id
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("name", bf.FIXTURE_NAMES)
def test_tied_and_untied_heads(name: str) -> None:
    model = _model(name)
    head, emb = model.lm_head.weight, model.model.embed_tokens.weight
    with safe_open(FIXTURES_DIR / name / "model.safetensors", "pt") as f:
        stored = set(f.keys())
    if name in TIED:
        assert model.config.tie_word_embeddings
        assert head.data_ptr() == emb.data_ptr()
        assert "lm_head.weight" not in stored
    else:
        assert not model.config.tie_word_embeddings
        assert head.data_ptr() != emb.data_ptr()
        assert "lm_head.weight" in stored
        assert not torch.equal(head, emb)


def test_qwen2_has_nonzero_qkv_bias() -> None:
    attn = _model("tiny-qwen2").model.layers[0].self_attn
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.bias is not None
        assert proj.bias.abs().min() > 0
    assert attn.o_proj.bias is None


def test_qwen3_has_q_norm_k_norm_and_explicit_head_dim() -> None:
    attn = _model("tiny-qwen3").model.layers[0].self_attn
    for norm in (attn.q_norm, attn.k_norm):
        assert norm.weight.shape == (16,)
        assert norm.weight.abs().min() > 0
        assert not torch.allclose(norm.weight, torch.ones(16))
    raw = json.loads((FIXTURES_DIR / "tiny-qwen3" / "config.json").read_text())
    assert raw["head_dim"] == 16


def test_moe_fixtures_route_to_experts() -> None:
    """8 experts, 2 per token; Qwen3-MoE's and GLM-4.5's layer 0 dense; OLMoE's q/k norms over
    the whole projection (not per head). (gpt-oss's: test_gpt_oss_fixture_carries_its_features.)"""
    for name in bf.MOE_FIXTURES:
        if name == "tiny-gpt-oss":
            continue
        model = _model(name)
        for i, layer in enumerate(model.model.layers):
            if name in ("tiny-qwen3-moe", "tiny-glm4-moe") and i == 0:
                assert layer.mlp.gate_proj.weight.shape == (128, 64)
                continue
            assert layer.mlp.gate.weight.shape == (8, 64)
            assert layer.mlp.experts.gate_up_proj.shape == (8, 2 * bf.MOE_INTERMEDIATE_SIZE, 64)
            assert layer.mlp.experts.down_proj.shape == (8, 64, bf.MOE_INTERMEDIATE_SIZE)
        assert model.config.num_experts_per_tok == 2
    attn = _model("tiny-olmoe").model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (64,) and attn.k_norm.weight.shape == (32,)


def test_glm4_moe_fixture_carries_its_features() -> None:
    """DeepSeek's router with group limiting and a nonzero score bias, a shared expert, q/k/v
    biases, per-head q/k norms, RoPE over half of each head."""
    model = _model("tiny-glm4-moe")
    cfg = model.config
    assert (cfg.n_group, cfg.topk_group, cfg.first_k_dense_replace) == (bf.GLM_GROUPS, 1, 1)
    assert cfg.routed_scaling_factor == bf.GLM_SCALING and cfg.norm_topk_prob
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.5 and cfg.use_qk_norm
    mlp = model.model.layers[1].mlp
    assert mlp.gate.e_score_correction_bias.abs().min() > 0
    assert mlp.shared_experts.gate_proj.weight.shape == (bf.MOE_INTERMEDIATE_SIZE, 64)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.q_proj.bias.abs().min() > 0
    assert attn.q_norm.weight.shape == (16,)


def test_llama3_rope_scaling_changes_frequencies() -> None:
    model = _model("tiny-llama3")
    rope = model.config.rope_parameters
    assert rope["rope_type"] == "llama3"
    assert rope["factor"] == 8.0
    assert rope["original_max_position_embeddings"] == 64
    default = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    inv_freq = model.model.rotary_emb.inv_freq
    assert torch.allclose(inv_freq[0], default[0])  # highest frequency kept as is
    assert not torch.allclose(inv_freq, default)  # low frequencies scaled down


def test_mistral_has_no_sliding_window() -> None:
    assert _model("tiny-mistral").config.sliding_window is None


def test_gemma_fixtures_carry_their_features() -> None:
    for name in ("tiny-gemma2", "tiny-gemma3"):
        cfg = _model(name).config
        assert cfg.layer_types == ["sliding_attention", "full_attention"]
        assert cfg.sliding_window == bf.SLIDING_WINDOW < 18  # the parity prompts pass it
        assert cfg.query_pre_attn_scalar == bf.GEMMA_QUERY_SCALAR != cfg.head_dim
        assert cfg.hidden_activation == "gelu_pytorch_tanh"
        layer = _model(name).model.layers[0]
        assert layer.pre_feedforward_layernorm.weight.abs().min() > 0
    g2 = _model("tiny-gemma2").config
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (10.0, 30.0)
    g3 = _model("tiny-gemma3").config
    assert g3.rope_parameters["full_attention"]["rope_type"] == "linear"
    assert g3.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0


def test_gpt_oss_fixture_carries_its_features() -> None:
    """Sinks and biases drawn non-zero, a sliding layer of a window the parity prompts pass
    beside a full one, yarn RoPE, 4 experts of 2 per token in transformers' [E, hidden, 2I]
    layout, a SwiGLU limit below 7."""
    model = _model("tiny-gpt-oss")
    cfg = model.config
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    assert cfg.sliding_window == bf.SLIDING_WINDOW < 18
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.attention_bias
    assert (cfg.num_local_experts, cfg.num_experts_per_tok) == (bf.GPT_OSS_EXPERTS, 2)
    assert cfg.swiglu_limit == bf.GPT_OSS_SWIGLU_LIMIT < 7
    for layer in model.model.layers:
        attn, experts = layer.self_attn, layer.mlp.experts
        assert attn.sinks.shape == (4,) and attn.sinks.abs().min() > 0
        for bias in (attn.q_proj.bias, attn.o_proj.bias, layer.mlp.router.bias):
            assert bias.abs().min() > 0
        assert experts.gate_up_proj.shape == (4, 64, 2 * bf.MOE_INTERMEDIATE_SIZE)
        assert experts.down_proj.shape == (4, bf.MOE_INTERMEDIATE_SIZE, 64)
        assert experts.gate_up_proj_bias.abs().min() > 0 < experts.down_proj_bias.abs().min()


def test_phi3_smollm3_and_granite_fixtures_carry_their_features() -> None:
    phi = _model("tiny-phi3")
    assert phi.config.rope_parameters["rope_type"] == "longrope"
    assert phi.config.rope_parameters["partial_rotary_factor"] == 0.5
    assert phi.model.layers[0].self_attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 16, 64)
    assert phi.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 128, 64)
    assert _model("tiny-smollm3").config.no_rope_layers == [1, 0]
    granite = _model("tiny-granite").config
    multipliers = (
        granite.embedding_multiplier,
        granite.residual_multiplier,
        granite.attention_multiplier,
        granite.logits_scaling,
    )
    assert multipliers == (0.5, 1.5, 0.2, 0.5)


def test_rebuild_is_byte_identical(tmp_path: Path) -> None:
    skip_unless_built_with_this_transformers(FIXTURES_DIR / "tiny-llama")
    bf.build(tmp_path)
    for name in (bf.TOKENIZER_DIR, *bf.FIXTURE_NAMES, bf.EMBEDDING_FIXTURE, bf.RERANKER_FIXTURE):
        committed, rebuilt = _files(FIXTURES_DIR / name), _files(tmp_path / name)
        assert sorted(committed) == sorted(rebuilt), name
        for rel, data in committed.items():
            assert rebuilt[rel] == data, f"{name}/{rel} differs from a fresh build"


@pytest.mark.parametrize(
    "text", [bf.MULTIBYTE_SAMPLE, "naïve Ελληνικά 🚀 ünïcödé ✓ 中文 x\n\t 42,000.5!"]
)
def test_tokenizer_round_trips(text: str) -> None:
    tok = _tokenizer(bf.TOKENIZER_DIR)
    ids = tok.encode(text)
    assert not set(ids) & {0, 1, 2}  # encode adds no special tokens
    assert tok.decode(ids) == text


@pytest.mark.parametrize("name", (bf.TOKENIZER_DIR, *bf.FIXTURE_NAMES))
def test_every_folder_tokenizes_like_tokenizer_json(name: str) -> None:
    """transformers may pick another class per model type (qwen2 -> Qwen2Tokenizer, which
    rebuilds its own pipeline); the ids must still be those of the raw tokenizer.json."""
    tok = _tokenizer(name)
    raw = Tokenizer.from_file(str(FIXTURES_DIR / name / "tokenizer.json"))
    text = "In 1984 it's café 日本語 🙂!\n\n  <|im_start|>user\nhi<|im_end|>\n 3.14 x"
    assert tok.encode(text) == raw.encode(text).ids
    assert tok.decode(tok.encode(text)) == text


def test_multibyte_character_spans_several_tokens() -> None:
    tok = _tokenizer(bf.TOKENIZER_DIR)
    ids = tok.encode(bf.MULTIBYTE_SAMPLE)
    pieces = [tok.decode([i]) for i in ids]
    # A token holding only part of a character decodes to U+FFFD on its own.
    assert any("\ufffd" in p for p in pieces)
    # Concatenating the bytes of the tokens rebuilds the text; find a boundary inside a character.
    byte_decoder = {v: k for k, v in _bytes_to_unicode().items()}
    token_bytes = [bytes(byte_decoder[c] for c in t) for t in tok.convert_ids_to_tokens(ids)]
    assert b"".join(token_bytes) == bf.MULTIBYTE_SAMPLE.encode()
    boundaries, pos = set(), 0
    for b in token_bytes:
        pos += len(b)
        boundaries.add(pos)
    char_start, split_chars = 0, []
    for ch in bf.MULTIBYTE_SAMPLE:
        n = len(ch.encode())
        if any(char_start < cut < char_start + n for cut in boundaries):
            split_chars.append(ch)
        char_start += n
    assert "日" in split_chars and "🙂" in split_chars


def test_chat_template() -> None:
    tok = _tokenizer(bf.TOKENIZER_DIR)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "café?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\ncafé?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, tokenize=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tok.eos_token_id) == 2


@pytest.mark.parametrize("name", bf.FIXTURE_NAMES)
def test_greedy_margins(name: str) -> None:
    gaps, outputs = bf.greedy_stats(_model(name), _tokenizer(name))
    assert len(gaps) == len(bf.CHECK_PROMPTS) * bf.CHECK_NEW_TOKENS
    assert min(gaps) >= bf.CHECK_MIN_GAP
    assert all(len(out) == bf.CHECK_NEW_TOKENS for out in outputs)  # no early EOS
    least = bf.CHECK_MIN_DISTINCT_OF.get(name, bf.CHECK_MIN_DISTINCT)
    assert all(len(set(out)) >= least for out in outputs)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by the ByteLevel pre-tokenizer."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += range(ord("®"), ord("ÿ") + 1)
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))
