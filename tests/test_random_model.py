"""The bench's random-weight models: the 1B shape is Llama-3.2-1B's, and `build` writes a
directory and GGUF files in llama-quantize's type mix that neuronpy serves like any model."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM

from neuronpy.bench import random_model
from neuronpy.bench.gguf_files import preset_types
from neuronpy.loading import load_gguf_checkpoint, load_pretrained


def _parameters(shape: str) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(random_model.SHAPES[shape]())
    return sum(p.numel() for p in model.parameters())


def test_the_1b_shape_is_llama_3_2_1b_with_the_default_vocabulary() -> None:
    config = random_model.SHAPES["llama3.2-1b"]()
    shape = (config.num_hidden_layers, config.hidden_size, config.intermediate_size)
    heads = (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    assert shape == (16, 2048, 8192) and heads == (32, 8, 64)
    assert config.tie_word_embeddings and config.vocab_size == 49152
    assert round(_parameters("llama3.2-1b") / 1e9, 2) == 1.07
    assert round(_parameters("llama3.1-8b") / 1e9, 1) == 7.4


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A 2-layer model of the 1B's layout, small enough to build in a test."""
    config = random_model._llama(2, 256, 512, tied=True)
    out = tmp_path_factory.mktemp("random") / "tiny-llama"
    return random_model.build("llama3.2-1b", out, gguf=["Q4_K_M", "Q8_0"], config=config)


def test_build_writes_the_directory_and_a_file_per_preset_beside_it(built: list[Path]) -> None:
    out, q4, q8 = built
    assert q4 == random_model.gguf_path(out, "Q4_K_M") and q4.parent == out.parent
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    # (each file read once: gguf's reader takes seconds over a 49k-token vocabulary)
    stored = {path: stored_types(path) for path in (q4, q8)}
    for path, preset in ((q4, "Q4_K_M"), (q8, "Q8_0")):
        for name, kind in preset_types(model, preset).items():
            assert stored[path][name] == kind, (path.name, name)
    # llama-quantize's Q4_K_M mix: the tied embedding and some attn_v/ffn_down in Q6_K
    assert set(stored[q4].values()) == {"F32", "Q4_K", "Q6_K"}
    assert set(stored[q8].values()) == {"F32", "Q8_0"}


def stored_types(path: Path) -> dict[str, str]:
    """Each tensor's type in a GGUF file, by name."""
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def test_the_files_load_as_whole_models_kept_quantized(built: list[Path], tmp_path: Path) -> None:
    out, q4, _ = built
    checkpoint, tokenizer, _ = load_gguf_checkpoint(str(q4), cache_dir=tmp_path)
    assert checkpoint.config.num_hidden_layers == 2 and checkpoint.config.num_key_value_heads == 8
    reference = load_pretrained(str(out), dtype="float32", device="cpu", cache_dir=tmp_path)
    prompt = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(prompt, tokenize=False)
    assert text == reference.tokenizer.apply_chat_template(prompt, tokenize=False)
    assert tokenizer.encode("hello world") == reference.tokenizer.encode("hello world")


def test_presets_and_shapes_are_checked_before_anything_is_built(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Q4_K_M, Q8_0"):
        random_model.build("llama3.2-1b", tmp_path / "a", gguf=["Q3_K"])
    with pytest.raises(ValueError, match="Llama-family"):
        random_model.build("gemma3-270m", tmp_path / "b", gguf=["Q8_0"])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
