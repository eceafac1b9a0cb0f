"""The compiled layers (PyTorch's inductor, arch/ops.py) against the eager ones: the same
forwards (prefill chunks, decode, verify steps, riding chunks) from one graph, in float32 and
bfloat16, and the knob that chooses (EngineConfig.compile, --compile)."""

from __future__ import annotations

import functools
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch._dynamo
from transformers import AutoModelForCausalLM

from neuronpy.arch.kv import assemble_batch
from neuronpy.arch.llama import LlamaModel, PrefillChunk
from neuronpy.cli import build_parser, config_from_args
from neuronpy.compose import engine_from_hf
from neuronpy.config import EngineConfig
from neuronpy.engine.types import FinishReason, SamplingParams
from tests.factories import FAMILIES, compiled_model, fixture_dir, hf_model, tokenizer
from tests.gguf_files import write_gguf

ROOT = Path(__file__).resolve().parent.parent
# where a start would find caches other than its HOME's (the test's two starts share a HOME)
CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "NEURONPY_CACHE_DIR", "XDG_CACHE_HOME")

PROMPTS = ([5, 17, 42, 99, 3, 250, 71], [12, 8], [300, 1, 44, 44, 19, 7, 65, 80, 91, 2, 33], [60])


@functools.cache
def hf_bf16(name: str) -> Any:
    """A fixture's transformers model in bfloat16 (cached: read-only)."""
    return AutoModelForCausalLM.from_pretrained(fixture_dir(name), dtype="bfloat16").eval()


def pair(hf: Any) -> tuple[LlamaModel, LlamaModel]:
    """The same weights eager and compiled."""
    compiled = LlamaModel.from_hf(hf)
    compiled.compile()
    assert compiled.compiled
    return LlamaModel.from_hf(hf), compiled


def run(model: LlamaModel, steps: int = 6) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Every kind of forward on `model`: chunked prefills, ragged lockstep decode steps, one
    verify step of several tokens a row, and a prompt's chunk riding a decode step. Answers
    the hidden states of each forward and the greedy tokens."""
    states, tokens = [], []
    snaps, firsts = [], []
    for p in PROMPTS:
        snap, hidden = model.prefill(p, chunk_size=3)  # chunks of 3, and a lone last token
        states.append(hidden)
        snaps.append(snap)
        firsts.append(int(model.logits(hidden[-1]).argmax()))
    batch = assemble_batch(snaps)
    fed = list(firsts)
    for _ in range(steps):
        hidden = model.forward_batch_decode(batch, torch.tensor(fed)[:, None])
        states.append(hidden)
        fed = model.logits(hidden).argmax(-1).tolist()
        tokens.append(fed)
    counts = [3, 1, 2, 1]  # a verify step: each row its token and drafts
    flat = [t for row, n in zip(fed, counts, strict=True) for t in [row] * n]
    states.append(model.forward_step(batch, torch.tensor(flat), counts=counts).hidden)
    batch.trim([n - 1 for n in counts])
    alone = assemble_batch([batch.row(1).materialize()])  # one row alone: a batch of one
    out = model.forward_step(alone, torch.tensor([[fed[1]]]), [PrefillChunk([7, 8, 9, 10, 11])])
    states += [out.hidden, *out.chunk_hidden]
    return states, tokens


@pytest.mark.parametrize("name", FAMILIES)
def test_compiled_forwards_equal_eager_in_float32(name: str) -> None:
    want, want_tokens = run(LlamaModel.from_hf(hf_model(name)))
    with compiled_model(name) as compiled:  # (the engines' own: compiled once for the suite)
        assert compiled.compiled, "its layers did not compile (the log says why)"
        got, got_tokens = run(compiled)
    assert got_tokens == want_tokens
    for g, w in zip(got, want, strict=True):
        # 1e-5 of the hidden state's size (the Gemma fixtures' final norm makes it RMS ~8)
        size = max(1.0, float(w.pow(2).mean().sqrt()))
        torch.testing.assert_close(g, w, atol=1e-5 * size, rtol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_compiled_forwards_round_as_eager_in_bfloat16(name: str) -> None:
    """The graph rounds where eager PyTorch rounds (emulated precision casts): compiled or
    not, bfloat16 gives the same answers."""
    eager, compiled = pair(hf_bf16(name))
    want, want_tokens = run(eager)
    got, got_tokens = run(compiled)
    assert got_tokens == want_tokens
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        size = max(1.0, float(w.float().pow(2).mean().sqrt()))  # (as in float32, above)
        # LFM2's gated convolution multiplies three bf16 projections of a token: a lone
        # token's (one row eager, two in the graph) lands one bf16 step (1/64) apart on a
        # couple of its logits
        atol = (2e-2 if name == "tiny-lfm2" else 1e-2) * size
        torch.testing.assert_close(g, w, atol=atol, rtol=1e-2)


def test_one_graph_serves_every_forward() -> None:
    """Once compiled, no forward compiles again: any token count (one token included),
    prefill chunks, decode and verify steps, riding chunks, another model of the same shape."""
    _, compiled = pair(hf_model("tiny-qwen3"))
    again = LlamaModel.from_hf(hf_model("tiny-qwen3"))
    with torch._dynamo.config.patch(error_on_recompile=True):
        run(compiled)
        again.compile()
        run(again, steps=2)


def test_compile_off_on_and_auto() -> None:
    with pytest.raises(ValueError, match="compile"):
        EngineConfig(compile="sometimes")
    for mode, compiled in (("off", False), ("on", True), ("auto", True)):  # (auto: on the CPU)
        engine = engine_from_hf(
            hf_model(), tokenizer(), name="m", config=EngineConfig(compile=mode)
        )
        assert engine.model.compiled is compiled
    args = build_parser().parse_args(["serve", "--compile", "off"])
    (spec,) = config_from_args(args).models
    assert spec.engine.compile == "off"
    assert EngineConfig().compile == "auto"


def test_a_model_the_compiler_cannot_take_serves_eagerly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(self: LlamaModel) -> None:
        raise RuntimeError("the compiler gave up\nwith a long story")

    monkeypatch.setattr(LlamaModel, "compile", broken)
    with caplog.at_level(logging.WARNING, logger="neuronpy"):
        engine = engine_from_hf(hf_model(), tokenizer(), name="m", config=EngineConfig())
    assert not engine.model.compiled
    (record,) = [r for r in caplog.records if "could not compile" in r.getMessage()]
    assert "the compiler gave up" in record.getMessage()
    assert "long story" not in record.getMessage()  # one line

    async def serve() -> FinishReason | None:
        async with engine:
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            return (await engine.complete(tokenizer().encode("Hello"), params)).finish_reason

    assert anyio.run(serve) is FinishReason.LENGTH


# what `neuronpy serve` logs once its layers are compiled (compose.compile_model)
COMPILED = re.compile(
    r"compiled its layers in [\d.]+ s \((\d+) graphs? from the cache, (\d+) compiled\)"
)


def start_compiled(model: Path, home: Path, log: Path, timeout: float = 600) -> tuple[int, int]:
    """Starts `neuronpy serve` on `model` with `home` as its HOME (its caches under it), until
    it has compiled its layers: (graphs from the cache, graphs compiled), from its log."""
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
    env["HOME"] = str(home)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "neuronpy", "serve", "--model", str(model)]
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*command, "--port", str(port)], cwd=ROOT, env=env, stdout=out, stderr=out
        )
    try:
        deadline = time.monotonic() + timeout
        while (found := COMPILED.search(log.read_text(errors="replace"))) is None:
            assert process.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, "the layers were never compiled"
            time.sleep(0.2)
    finally:
        process.kill()
        process.wait()
    return int(found[1]), int(found[2])


def test_a_second_start_compiles_nothing(tmp_path: Path) -> None:
    """A start with the compile cache the first start wrote takes every graph from it: nothing
    traced or compiled again (the quantized layers of a GGUF file, as the default model's).
    Two servers in fresh processes sharing one HOME, where their caches are."""
    model = write_gguf(
        tmp_path / "tiny-llama.gguf", hf_model(), "Q4_1", tokenizer_dir=fixture_dir()
    )
    home = tmp_path / "home"
    home.mkdir()
    first = start_compiled(model, home, tmp_path / "first.log")
    assert first[1] >= 1, "the first start found a cache in a fresh HOME"
    assert any((home / ".cache" / "neuronpy" / "inductor").iterdir())
    from_cache, compiled = start_compiled(model, home, tmp_path / "second.log")
    assert (from_cache, compiled) == (first[1], 0)
