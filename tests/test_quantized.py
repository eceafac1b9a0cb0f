"""Weights kept quantized: GGUF blocks decoded exactly, the int4/int8 weight-only layers, a
GGUF file's model against its dequantized copy, and batched == alone in every mode."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from neuronpy.arch.gguf import (
    PLAIN_TYPES,
    SUPPORTED_TYPES,
    TensorInfo,
    decode,
    decode_groups,
    read_index,
)
from neuronpy.arch.int8 import Int8WeightLinear
from neuronpy.arch.linear import make_embedding, make_linear
from neuronpy.arch.llama import LlamaModel
from neuronpy.arch.quant import (
    ChannelQuant,
    GroupQuant,
    Int4Linear,
    QuantEmbedding,
    Quantized,
    SubBlockQuant,
)
from neuronpy.compose import engine_from_hf, load_source
from neuronpy.config import EngineConfig, ModelSpec
from neuronpy.errors import ModelLoadError
from tests.factories import fixture_dir, hf_model, tokenizer
from tests.gguf_files import (
    K_ENCODERS,
    PRESETS,
    checkpoint,
    dequantized_model,
    preset_type,
    preset_types,
    quantize_q4_k,
    write_gguf,
    write_preset,
)
from tests.test_engine_parity import MAX_TOKENS, TEXTS, concurrently, greedy, one_at_a_time, summary


def weights(n: int, k: int, seed: int = 0) -> np.ndarray:
    gen = np.random.default_rng(seed)
    w = gen.standard_normal((n, k)).astype(np.float32) * 0.05
    w[:, 3] += 0.4  # a column of outliers, as real weights have
    return w


def info(data: np.ndarray, kind: str, shape: tuple[int, int]) -> TensorInfo:
    qtype = gguf.GGMLQuantizationType[kind]
    return TensorInfo("t", kind, qtype, shape, data.reshape(shape[0], -1))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_4bit_blocks_decode_to_exactly_what_gguf_dequantizes(kind: str) -> None:
    w = weights(48, 512)
    qtype = gguf.GGMLQuantizationType[kind]
    data = quantize_q4_k(w) if kind == "Q4_K" else gguf.quants.quantize(w, qtype)
    reference = gguf.quants.dequantize(data, qtype).reshape(48, 512)
    groups = decode_groups(data, kind, (48, 512))
    assert groups.group == 32 and groups.q.dtype == torch.uint8 and int(groups.q.max()) <= 15
    # the same numbers, whatever order GGML multiplies them in: to an fp32 rounding or two
    np.testing.assert_allclose(groups.dequantize().numpy(), reference, rtol=0, atol=2e-7)
    assert np.abs(reference - w).max() < 0.1  # and the encoder is a real one


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_the_k_type_encoders_write_what_gguf_decodes(kind: str) -> None:
    """The test files' own K-type encoders (the gguf package only decodes these types): gguf's
    reference dequantizer reads back the weights to within half a level, and the loader's
    decode gives exactly gguf's values."""
    w = weights(48, 512)
    qtype = gguf.GGMLQuantizationType[kind]
    data = K_ENCODERS[kind](w)
    assert data.shape == (48, 512 // 256 * gguf.GGML_QUANT_SIZES[qtype][1])
    reference = gguf.quants.dequantize(data, qtype).reshape(48, 512)
    step = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 31}[kind]
    assert np.abs(reference - w).max() < 0.6 * np.ptp(w) / step
    got = decode(info(data, kind, (48, 512)))
    np.testing.assert_allclose(got.dequantize().numpy(), reference, rtol=0, atol=2e-7)


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q5_1"])
def test_5_and_8_bit_types_decode_exactly_to_groups(kind: str) -> None:
    w = weights(40, 64)
    qtype = gguf.GGMLQuantizationType[kind]
    data = gguf.quants.quantize(w, qtype)
    got = decode(info(data, kind, (40, 64)))
    assert isinstance(got, GroupQuant) and got.bits == (8 if kind == "Q8_0" else 5)
    assert int(got.q.max()) < 1 << got.bits
    reference = gguf.quants.dequantize(data, qtype).reshape(40, 64)
    np.testing.assert_allclose(got.dequantize().numpy(), reference, rtol=0, atol=2e-7)


def test_q6_k_decodes_exactly_to_sub_blocks() -> None:
    """Q6_K through llama.cpp's layout: the gguf package decodes it; its levels and 16-value
    scales, recovered from a block written here, give the same values back."""
    gen = np.random.default_rng(3)
    n, k = 16, 256
    blocks = np.zeros((n, 210), dtype=np.uint8)
    blocks[:, :192] = gen.integers(0, 256, (n, 192))  # 6-bit levels: low nibbles, high pairs
    blocks[:, 192:208] = gen.integers(-40, 40, (n, 16)).astype(np.int8).view(np.uint8)
    blocks[:, 208:210] = np.full((n, 1), 0.01, np.float16).view(np.uint8)
    reference = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q6_K).reshape(n, k)
    got = decode(info(blocks, "Q6_K", (n, k)))
    assert isinstance(got, SubBlockQuant) and int(got.u.min()) >= -32 and int(got.u.max()) <= 31
    np.testing.assert_allclose(got.dequantize().numpy(), reference, rtol=0, atol=1e-7)
    lin = make_linear(got, None, "auto", dtype=torch.float32)
    x = torch.randn(5, k)
    ref = F.linear(x.bfloat16().float(), torch.from_numpy(reference))
    assert (lin(x) - ref).abs().max() < 0.01 * ref.abs().max()
    for m in range(1, 5):
        assert torch.equal(lin(x[:m]), lin(x)[:m])


@pytest.mark.parametrize("bits", [5, 8])
def test_wider_groups_run_as_two_planes_as_exactly_as_one(bits: int) -> None:
    """A 5- or 8-bit weight through the int4 kernel's two planes computes what its
    dequantized weight does, to bf16's rounding of the products."""
    gen = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 1 << bits, (48, 64), generator=gen, dtype=torch.uint8)
    scale = torch.rand(48, 2, generator=gen) * 0.01 - 0.005  # signed, as Q5_0's are
    low = torch.randn(48, 2, generator=gen) * 0.05
    groups = GroupQuant(q, scale, low, 32, "test", bits)
    lin = make_linear(groups, None, "auto", dtype=torch.float32)
    assert isinstance(lin, Int4Linear) and lin.planes == 2
    x = torch.randn(9, 64, generator=gen)
    ref = F.linear(x.bfloat16().float(), groups.dequantize())
    assert (lin(x) - ref).abs().max() < 0.01 * ref.abs().max()


def test_int4_layer_matches_its_dequantized_weight_and_rows_stand_alone() -> None:
    w = torch.from_numpy(weights(360, 128))  # 360 outputs: padded to the kernel's 16
    groups = GroupQuant.from_float(w, 32)
    bias = torch.randn(360)
    lin = make_linear(groups, bias, "auto", dtype=torch.float32)
    assert isinstance(lin, Int4Linear) and lin.out_features == 360
    x = torch.randn(40, 128)
    y = lin(x)
    ref = F.linear(x.bfloat16().float(), groups.dequantize(), bias)
    assert y.shape == (40, 360) and y.dtype == torch.float32
    assert (y - ref).abs().max() < 0.02 * ref.abs().max()
    for m in range(1, 40):  # a row's result is the same alone or among any others
        assert torch.equal(lin(x[:m]), y[:m])
    assert torch.equal(lin(x[[7]]), y[[7]])


def test_int8_weight_layer_matches_and_rows_stand_alone() -> None:
    w = torch.from_numpy(weights(96, 64))
    lin = make_linear(w, None, "int8-weight")
    assert isinstance(lin, Int8WeightLinear)
    # its weights: each channel within half a step of the float ones
    quantized = ChannelQuant.from_float(w)
    dequantized, step = quantized.dequantize(), quantized.scale.float().reshape(-1, 1)
    assert ((dequantized - w).abs() <= step / 2 + 1e-6).all()
    # its product: those weights times bf16 rows (what the kernel takes), seeded inputs (the
    # float weights' own product differs by their rounding, ~2% of the largest output)
    x = torch.randn(33, 64, generator=torch.Generator().manual_seed(0))
    y = lin(x)
    ref = F.linear(x.bfloat16().float(), dequantized)
    assert (y - ref).abs().max() < 0.01 * ref.abs().max()
    for m in (1, 2, 5, 16, 32):
        assert torch.equal(lin(x[:m]), y[:m])


def layout_of(layout: str, w: torch.Tensor) -> Quantized:
    """`w` [N, K] in one of the quantized layouts, as a GGUF type of each width becomes it."""
    if layout == "channels":
        return ChannelQuant.from_float(w)
    if layout == "sub-blocks":  # Q6_K's: 6-bit levels, a scale per 16 values
        n, k = w.shape
        scale = w.reshape(n, k // 16, 16).abs().amax(dim=2) / 31
        u = (w.reshape(n, k // 16, 16) / scale[..., None]).round().clamp(-32, 31)
        return SubBlockQuant(u.to(torch.int8).reshape(n, k), scale, "Q6_K")
    groups = GroupQuant.from_float(w, 32)
    if layout == "groups":
        return groups
    bits = int(layout.removeprefix("groups"))  # Q5_*'s and Q8_0's wider levels
    gen = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 1 << bits, w.shape, generator=gen, dtype=torch.uint8)
    return GroupQuant(q, groups.scale / (1 << (bits - 4)), groups.low, 32, "test", bits)


@pytest.mark.parametrize("layout", ["groups", "groups5", "groups8", "channels", "sub-blocks"])
def test_quantized_embedding_gathers_the_dequantized_rows_exactly(layout: str) -> None:
    """Every layout a GGUF type becomes serves as the embedding: its rows exactly the
    dequantized table's, the table kept quantized; and as the tied head beside it."""
    w = torch.from_numpy(weights(50, 64))
    q = layout_of(layout, w)
    table = q.dequantize()
    embed = make_embedding(q, "auto", torch.float32)
    ids = torch.tensor([0, 49, 7, 7, 3])
    assert torch.equal(embed(ids), table[ids])
    assert torch.equal(embed.rows(ids, torch.float32), table[ids])
    assert torch.equal(embed.rows(ids[:1], torch.bfloat16), table[ids[:1]].bfloat16())
    assert embed.nbytes < table.nbytes / 2.5
    assert embed.kind.startswith("int")
    head = make_linear(q, None, "auto", dtype=torch.float32)
    x = torch.randn(3, 64)
    ref = F.linear(x.bfloat16().float(), table)
    assert (head(x) - ref).abs().max() < 0.02 * ref.abs().max()


def test_int4_mode_refuses_what_it_cannot_group() -> None:
    with pytest.raises(ValueError, match="choose a group size that divides it"):
        make_linear(torch.randn(32, 96), None, "int4-g64")


# ---- a GGUF file's model ---------------------------------------------------------------------


def big_llama() -> transformers.PreTrainedModel:
    """A random Llama whose widths are whole Q4_K super-blocks (256), the fixture's vocabulary."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=360,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).eval()


def logits_of(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        _, hidden = model.prefill(ids)
        return model.logits(hidden)


# the file types these tests write: what llama.cpp's Q4_K_M, Q4_1 and Q8_0 files mostly hold
FILES = {
    "Q4_K_M": ("Q4_K", {"blk.1.ffn_down.weight": "Q5_1", "blk.0.attn_v.weight": "Q8_0"}),
    "Q4_1": ("Q4_1", {"token_embd.weight": "Q8_0"}),
    "Q8_0": ("Q8_0", {}),
    "Q4_0": ("Q4_0", {}),
}


@pytest.mark.parametrize("file", list(FILES))
def test_a_gguf_model_computes_what_its_dequantized_copy_does(file: str, tmp_path: Path) -> None:
    source = big_llama() if file == "Q4_K_M" else hf_model("tiny-llama")
    kind, kinds = FILES[file]
    path = write_gguf(tmp_path / f"m-{file}.gguf", source, kind, kinds)
    reference = LlamaModel.from_hf(dequantized_model(path, source))
    ids = tokenizer("tiny-llama").encode("The quick brown fox jumps over the lazy dog")
    want = logits_of(reference, ids)
    # read as stored, dequantized: the same weights (names, q/k rows, the tied head)
    plain = LlamaModel.from_hf(checkpoint(path, source), quantize="none")
    torch.testing.assert_close(logits_of(plain, ids), want, rtol=1e-4, atol=1e-4)
    # kept quantized: the same weights, bf16 products; as close as bf16 itself comes
    kept = LlamaModel.from_hf(checkpoint(path, source), quantize="auto")
    got = logits_of(kept, ids)
    bf16 = LlamaModel.from_hf(checkpoint(path, source, torch.bfloat16), quantize="none")
    bf16_error = (logits_of(bf16, ids) - want).abs().max()
    assert (got - want).abs().max() < 3 * bf16_error + 1e-3 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    assert kept.weight_bytes() < plain.weight_bytes() / 2


# ---- the files llama-quantize writes ---------------------------------------------------------


def test_the_preset_type_mix_is_llama_quantizes() -> None:
    """What llama.cpp's llama_tensor_get_type picks, for a 16-layer model of 2048-wide rows."""

    def kind(name: str, preset: str, tied: bool = False, columns: int = 2048) -> str:
        return preset_type(name, columns, preset, 16, tied)

    # attn_v and ffn_down: Q6_K in the first and last eighth and every third layer between
    more = [i for i in range(16) if kind(f"blk.{i}.attn_v.weight", "Q4_K_M") == "Q6_K"]
    assert more == [0, 1, 4, 7, 10, 13, 14, 15]
    assert [kind(f"blk.{i}.ffn_down.weight", "Q5_K_M") for i in (3, 4)] == ["Q5_K", "Q6_K"]
    assert kind("blk.4.attn_q.weight", "Q4_K_M") == "Q4_K"
    assert kind("blk.4.attn_v.weight", "Q4_0") == "Q4_0"  # only the _M presets add bits
    # the head, or a tied model's embedding (the head too): Q6_K but in Q8_0 files
    heads = {"Q4_K_M": "Q6_K", "Q5_K_M": "Q6_K", "Q6_K": "Q6_K", "Q4_0": "Q6_K", "Q8_0": "Q8_0"}
    for preset, head in heads.items():
        assert kind("output.weight", preset) == head
        assert kind("token_embd.weight", preset, tied=True) == head
    assert kind("token_embd.weight", "Q4_K_M") == "Q4_K"  # untied: the preset's own type
    # rows that are no whole number of 256-value super-blocks: the 32-value fallbacks
    assert kind("blk.0.attn_q.weight", "Q4_K_M", columns=64) == "Q5_0"
    assert kind("blk.0.attn_q.weight", "Q5_K_M", columns=64) == "Q5_1"
    assert kind("blk.0.attn_v.weight", "Q4_K_M", columns=64) == "Q8_0"
    assert kind("token_embd.weight", "Q4_K_M", tied=True, columns=64) == "Q8_0"


def wide_llama(tied: bool, init: float = 0.02) -> transformers.PreTrainedModel:
    """big_llama, its embedding tied to its head or not; `init`: its weights' spread (at
    0.1 the layers outweigh the embedding in the residual: greedy tokens vary, where at the
    default a tied model repeats the prompt's last token)."""
    torch.manual_seed(0)
    config = big_llama().config
    config.tie_word_embeddings = tied
    config.initializer_range = init
    return transformers.LlamaForCausalLM(config).eval()


# the models the preset files are written from: rows of whole K super-blocks (256 wide), and
# the fixtures' 64-wide ones (the K types' 32-value fallbacks: Q5_0, Q5_1, Q8_0)
PRESET_MODELS = {
    "wide-tied": lambda: wide_llama(tied=True),
    "wide-untied": lambda: wide_llama(tied=False),
    "tiny-llama": lambda: hf_model("tiny-llama"),  # tied
    "tiny-llama3": lambda: hf_model("tiny-llama3"),  # untied
}


def greedy_ids(model: LlamaModel, ids: list[int], count: int) -> list[int]:
    """The `count` tokens greedy decoding appends to `ids` (each step a fresh prefill)."""
    out = list(ids)
    for _ in range(count):
        out.append(int(logits_of(model, out)[-1].argmax()))
    return out[len(ids) :]


@pytest.mark.parametrize("model", list(PRESET_MODELS))
@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_preset_file_loads_kept_quantized_and_computes_its_dequantized_model(
    preset: str, model: str, tmp_path: Path
) -> None:
    """A file in the type mix llama-quantize writes for `preset` (a tied model's embedding in
    Q6_K for most: the head's type) loads in the default mode, weights kept quantized, and
    computes what its dequantized fp32 model does; greedy tokens the same."""
    source = PRESET_MODELS[model]()
    path = write_preset(tmp_path / f"m-{preset}.gguf", source, preset)
    types = {t.name: t.kind for t in read_index(path)[1]}
    assert {k: v for k, v in types.items() if v != "F32"} == preset_types(source, preset)
    reference = LlamaModel.from_hf(dequantized_model(path, source))
    prompt = tokenizer("tiny-llama").encode("The quick brown fox jumps over the lazy dog")
    # the prompt and the reference's greedy continuation: each step's next-token logits
    ids = prompt + greedy_ids(reference, prompt, 8)
    want = logits_of(reference, ids)
    kept = LlamaModel.from_hf(checkpoint(path, source), quantize="auto")
    got = logits_of(kept, ids)
    bf16 = LlamaModel.from_hf(checkpoint(path, source, torch.bfloat16), quantize="none")
    bf16_error = (logits_of(bf16, ids) - want).abs().max()
    assert (got - want).abs().max() < 3 * bf16_error + 1e-3 * want.abs().max()
    # greedy decoding picks the reference's tokens (so it continues as the reference does).
    # The fixtures' peaky logits (~30) put the bf16 copy's own error near 1, where it reorders
    # a close pair itself: there a step whose two leading tokens lie closer than twice that
    # error may go either way; the wide models' every step must agree.
    steps = slice(len(prompt) - 1, None)
    lead = want[steps].topk(2, dim=-1).values
    clear = lead[:, 0] - lead[:, 1] > 2 * bf16_error
    if model.startswith("wide"):
        clear = torch.ones_like(clear)
    assert bool(clear.any())
    assert torch.equal(got[steps].argmax(-1)[clear], want[steps].argmax(-1)[clear])
    # the embedding stays quantized, its rows the file's (to GGML's fp32 order of products)
    assert isinstance(kept.embed, QuantEmbedding)
    vocab, hidden = source.config.vocab_size, source.config.hidden_size
    assert kept.embed.nbytes < vocab * hidden * 4 / 2.5
    rows = kept.embed.rows(torch.arange(vocab), torch.float32)
    torch.testing.assert_close(rows, reference.embed, rtol=0, atol=2e-7)
    assert kept.weight_bytes() < reference.weight_bytes() / 2


@pytest.mark.parametrize("kind", SUPPORTED_TYPES)
def test_every_type_serves_as_the_embedding_and_the_tied_head(kind: str, tmp_path: Path) -> None:
    """A tied model's embedding in any type the projections read: loaded in the default mode,
    its lookups exactly gguf's dequantized rows, its head's logits (the leading ones
    recomputed in fp32 from those rows where the head is quantized) the dequantized model's."""
    source = wide_llama(tied=True)
    path = write_gguf(tmp_path / f"e-{kind}.gguf", source, "Q8_0", {"token_embd.weight": kind})
    (embd,) = (t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    table = torch.from_numpy(
        np.array(gguf.quants.dequantize(embd.data, embd.tensor_type), dtype=np.float32)
    ).reshape(360, 256)
    kept = LlamaModel.from_hf(checkpoint(path, source), quantize="auto")
    ids = torch.tensor([0, 359, 17, 17, 200])
    exactly = {"rtol": 0, "atol": 2e-7}  # (to the order GGML multiplies a K type's scales in)
    if kind in PLAIN_TYPES:  # a float table, as it is
        assert isinstance(kept.embed, torch.Tensor)
        torch.testing.assert_close(kept.embed[ids], table[ids], **exactly)
    else:
        assert isinstance(kept.embed, QuantEmbedding) and kept.embed.nbytes < table.nbytes / 2.5
        torch.testing.assert_close(kept.embed(ids), table[ids], **exactly)
        torch.testing.assert_close(kept.embed.rows(ids, torch.float32), table[ids], **exactly)
        assert kept._refines_logits
    hidden = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    exact = hidden @ table.T
    logits = kept.logits(hidden)
    assert (logits - exact).abs().max() < 0.02 * exact.abs().max()
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))


@pytest.mark.anyio
async def test_serving_a_tied_q4_k_m_file_generates_its_dequantized_models_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`neuronpy serve --model m-Q4_K_M.gguf`'s load path, end to end: a whole file (metadata
    and tokenizer too) of a tied model, its embedding in Q6_K, read as it is stored; greedy
    tokens the dequantized model's."""
    from neuronpy.compose import load_engine
    from neuronpy.config import ModelSpec

    monkeypatch.setenv("NEURONPY_CACHE_DIR", str(tmp_path / "cache"))  # the metadata's cache
    source = wide_llama(tied=True, init=0.1)
    path = write_preset(
        tmp_path / "m-Q4_K_M.gguf", source, "Q4_K_M", tokenizer_dir=fixture_dir("tiny-llama")
    )
    assert {t.name: t.kind for t in read_index(path)[1]}["token_embd.weight"] == "Q6_K"
    prompt = tokenizer("tiny-llama").encode("The quick brown fox jumps over the lazy dog")
    want = greedy_ids(LlamaModel.from_hf(dequantized_model(path, source)), prompt, 10)
    assert len(set(want)) > 5  # (a model that repeats one token would tell little)
    spec = ModelSpec(path=str(path), device="cpu", engine=EngineConfig(compile="off"))
    async with load_engine("m", spec) as engine:
        assert isinstance(engine.model.embed, QuantEmbedding)
        assert "int6 from Q6_K" in engine.model.describe_weights()
        done = await engine.complete(prompt, greedy(10))
    assert done.token_ids == want[: len(done.token_ids)]
    assert done.finish_reason == "stop" or done.token_ids == want


def test_an_unsupported_ggml_type_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "q2k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    # one Q2_K block (84 bytes per 256 values): refused before any tensor is read
    writer.add_tensor(
        "blk.0.attn_q.weight", np.zeros((4, 84), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q2_K
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_index(path)[1][0].kind == "Q2_K"
    with pytest.raises(ModelLoadError, match="GGML type Q2_K, which neuronpy does not read"):
        checkpoint(path, hf_model("tiny-llama"))


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        read_index(path)


# ---- batched == alone --------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("mode", "compile"),
    [
        ("Q4_1", "off"),
        ("Q4_1", "on"),
        ("Q8_0", "off"),
        ("Q4_K_M", "off"),
        ("int4", "off"),
        ("int8-weight", "off"),
        ("Q4_K_M int8", "off"),
        ("Q4_K_M int8", "on"),
    ],
)
async def test_quantized_parity_concurrent_equals_sequential(
    mode: str, compile: str, tmp_path: Path
) -> None:
    """Greedy output batched == alone, byte for byte, with weights kept quantized (fp32
    activations: the exact mode), from a GGUF file of each kind or quantized at load."""
    tok = tokenizer("tiny-llama")
    jobs = [(tok.encode(t), greedy(m)) for t, m in zip(TEXTS, MAX_TOKENS, strict=True)]
    file, _, at_load = mode.partition(" ")  # "Q4_K_M int8": the file, served in int8
    if file in FILES:
        model = big_llama() if file == "Q4_K_M" else hf_model("tiny-llama")
        path = write_gguf(tmp_path / "m.gguf", model, *FILES[file])
        source, quantize = checkpoint(path, model), at_load or "auto"
    else:
        source, quantize = hf_model("tiny-llama"), mode

    def engine(rows: int):
        config = EngineConfig(max_in_flight=rows, quantize=quantize, compile=compile)
        return engine_from_hf(source, tok, name="q", config=config)

    async with engine(1) as serial:
        expected = await one_at_a_time(serial, jobs)
    async with engine(8) as batched:
        assert batched.model.compiled is (compile == "on")
        assert "int" in batched.model.describe_weights()
        got = await concurrently(batched, jobs)
        assert batched.stats().max_batch_size >= 3
    assert [summary(c) for c in got] == [summary(c) for c in expected]
    assert all(c.completion_tokens for c in got)


def test_a_tied_quantized_head_gives_the_leading_logits_in_fp32(tmp_path: Path) -> None:
    """The kernel's logits are bf16; the leading ones of each row are recomputed in fp32 from
    the embedding's exact rows, row by row (so alone == batched)."""
    source = hf_model("tiny-llama")  # a tied embedding
    path = write_gguf(tmp_path / "tied.gguf", source, "Q4_1", {"token_embd.weight": "Q8_0"})
    model = LlamaModel.from_hf(checkpoint(path, source), quantize="auto")
    table = model.embed.rows(torch.arange(360), torch.float32)
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    logits = model.logits(hidden)
    exact = hidden @ table.T
    top = model.lm_head(hidden).float().topk(16, dim=-1).indices  # the kernel's leading 16
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    assert not torch.equal(logits, exact)  # the tail stays the kernel's
    for row in range(5):
        assert torch.equal(model.logits(hidden[row : row + 1]), logits[row : row + 1])


def test_weights_kept_quantized_compute_in_fp32_by_default() -> None:
    from neuronpy.loading import resolve_dtype

    assert resolve_dtype("auto", "cpu", quantized=True) == torch.float32
    assert resolve_dtype("bfloat16", "cpu", quantized=True) == torch.bfloat16


@pytest.mark.parametrize("mode", ["int8", "int8-weight", "int4"])
def test_modes_that_quantize_at_load_compute_in_fp32_by_default(mode: str) -> None:
    """The exact mode: with --dtype auto their model computes between the layers in fp32 (the
    int8 mode's parity within itself needs the exact attention), whatever the machine's bf16."""
    spec = ModelSpec(path=str(fixture_dir()), engine=EngineConfig(quantize=mode))
    source, _ = load_source(spec, lambda _: None)
    assert source.dtype == torch.float32
    bf16 = ModelSpec(path=str(fixture_dir()), dtype="bfloat16", engine=EngineConfig(quantize=mode))
    assert load_source(bf16, lambda _: None)[0].dtype == torch.bfloat16


def test_int8_from_a_gguf_file_read_as_stored_is_calibrated_on_it(tmp_path: Path) -> None:
    """`--quantize int8` on a GGUF file reads it as it is stored (no float copy of the model is
    made): its activation ranges are measured on the model as the file holds it, close to
    those transformers' model of the dequantized file gives, and every projection is smoothed
    by them."""
    from neuronpy.arch.int8 import Int8Linear
    from neuronpy.arch.llama import measure_input_ranges
    from neuronpy.arch.weights import input_absmax
    from neuronpy.compose import native_model
    from neuronpy.loading import calibration_ids

    source = hf_model("tiny-llama")
    path = write_gguf(tmp_path / "m.gguf", source, *FILES["Q4_1"])
    ckpt, tok = checkpoint(path, source), tokenizer("tiny-llama")
    ids = calibration_ids(ckpt, tok, "int8")
    ranges = measure_input_ranges(LlamaModel.from_hf(ckpt, quantize="auto"), ids)
    reference = input_absmax(dequantized_model(path, source), ids)
    for i in range(source.config.num_hidden_layers):
        for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
            key = f"model.layers.{i}.{name}"
            torch.testing.assert_close(ranges[key], reference[key], rtol=0.1, atol=0.05)
    model = native_model(ckpt, tok, name="m", config=EngineConfig(quantize="int8", compile="off"))
    projections = [p for lw in model.layers for p in (lw.qkv, lw.o_proj, lw.gate_up, lw.down)]
    assert all(isinstance(p, Int8Linear) and p.smooth is not None for p in projections)
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.smooth is not None
    assert isinstance(model.embed, QuantEmbedding)  # kept as the file stores it
