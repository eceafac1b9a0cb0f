"""Arch parity: our forward == transformers' forward, and ragged lockstep decode == one by one."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

from neuronpy.arch.config import ArchConfig, rope_inv_freq
from neuronpy.arch.kv import KvSnapshot, assemble_batch, batch_decode_mask
from neuronpy.arch.llama import LlamaModel, PrefillChunk
from neuronpy.arch.rope import apply_rope, rope_cos_sin
from neuronpy.errors import UnsupportedArchitectureError
from tests.factories import FAMILIES, hf_model

PROMPTS = ([5, 17, 42, 99, 3, 250, 71], [12, 8], [300, 1, 44, 44, 19, 7, 65, 80, 91, 2, 33], [60])


def native(name: str) -> LlamaModel:
    return LlamaModel.from_hf(hf_model(name))


def reference_logits(name: str, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(name)(torch.tensor([ids])).logits[0]  # [T, vocab]


@pytest.mark.parametrize("name", FAMILIES)
def test_parity_prefill_matches_transformers(name: str) -> None:
    model = native(name)
    ids = PROMPTS[2] + PROMPTS[0]
    snapshot, hidden = model.prefill(ids, chunk_size=5)  # chunked on purpose
    assert snapshot.length == len(ids) and snapshot.token_ids == ids
    # (the delta rule's chunks of 5 sum their products in other groups than transformers' one
    # chunk of all 18 tokens: a few 1e-4 on logits of std ~8)
    atol = 5e-4 if name in ("tiny-qwen3-next", "tiny-qwen3.5") else 2e-4
    torch.testing.assert_close(
        model.logits(hidden), reference_logits(name, ids), atol=atol, rtol=1e-4
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_parity_decode_matches_transformers(name: str) -> None:
    """Greedy decode through the live batch gives transformers' logits for the whole sequence."""
    model = native(name)
    ids = list(PROMPTS[0])
    snapshot, hidden = model.prefill(ids)
    batch = assemble_batch([snapshot], headroom=2)  # small headroom: the buffer must grow
    token = int(model.logits(hidden[-1]).argmax())
    for _ in range(6):
        ids.append(token)
        logits = model.logits(model.forward_batch_decode(batch, torch.tensor([[token]])))[0]
        torch.testing.assert_close(logits, reference_logits(name, ids)[-1], atol=2e-4, rtol=1e-4)
        token = int(logits.argmax())


@pytest.mark.parametrize("name", FAMILIES)
def test_parity_ragged_lockstep_equals_sequential(name: str) -> None:
    """Four prompts of different lengths decoded in one batch == each decoded alone,
    hidden state for hidden state, at every step; greedy tokens exactly."""
    model = native(name)
    batch = assemble_batch([model.prefill(p)[0] for p in PROMPTS])
    solo = [model.prefill(p)[0] for p in PROMPTS]
    tokens = [int(model.logits(model.prefill(p)[1][-1]).argmax()) for p in PROMPTS]
    solo_tokens = list(tokens)
    for _ in range(10):
        hidden = model.forward_batch_decode(batch, torch.tensor(tokens)[:, None])
        for row in range(len(PROMPTS)):
            alone = assemble_batch([solo[row]])
            h = model.forward_batch_decode(alone, torch.tensor([[solo_tokens[row]]]))
            solo[row] = alone.row(0).materialize()
            torch.testing.assert_close(hidden[row], h[0], atol=1e-4, rtol=1e-4)
            solo_tokens[row] = int(model.logits(h[0]).argmax())
        tokens = model.logits(hidden).argmax(-1).tolist()
        assert tokens == solo_tokens


def test_parity_extract_then_continue_alone() -> None:
    """A row extracted from a batch continues alone exactly as if it had never been batched."""
    model = native("tiny-qwen3")
    batch = assemble_batch([model.prefill(p)[0] for p in PROMPTS[:3]])
    tokens = [7, 8, 9]
    for _ in range(4):
        tokens = (
            model.logits(model.forward_batch_decode(batch, torch.tensor(tokens)[:, None]))
            .argmax(-1)
            .tolist()
        )
    snap = batch.row(1).materialize()
    assert snap.length == len(PROMPTS[1]) + 4
    assert snap.keys[0].is_contiguous() and snap.keys[0].shape[2] == snap.length
    # the extracted KV equals a fresh prefill of the same tokens
    fresh, _ = model.prefill(snap.token_ids)
    for a, b in zip(snap.keys + snap.values, fresh.keys + fresh.values, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def same_kv(a: KvSnapshot, b: KvSnapshot) -> bool:
    pairs = zip(a.keys + a.values, b.keys + b.values, strict=True)
    return a.token_ids == b.token_ids and all(torch.equal(x, y) for x, y in pairs)


def test_rebatch_keeps_unchanged_groups_and_narrows_the_others() -> None:
    """Survivors stay where they are: a group whose rows all survive is reused as it is, one
    that lost a row is narrowed to the rest, a joiner gets a group of its own; every row's KV
    is exactly what it was, and the padding gaps hold zeros."""
    model = native("tiny-llama")
    batch = assemble_batch([model.prefill(p)[0] for p in PROMPTS[:3]])
    for _ in range(3):
        model.forward_batch_decode(batch, torch.tensor([[4], [5], [6]]))
    before = [batch.row(r).materialize() for r in range(3)]
    same = assemble_batch([batch.row(0), batch.row(1), batch.row(2)])
    assert same.groups == batch.groups and same.groups[0] is batch.groups[0]  # no copy at all

    joiner = model.prefill(PROMPTS[3] * 20)[0]  # far longer than every row
    rebatched = assemble_batch([batch.row(0), batch.row(2), joiner])
    narrowed, own = rebatched.groups
    assert narrowed.padded_len == batch.groups[0].padded_len  # layout unchanged
    assert own.padded_len == joiner.length and rebatched.padding_columns == 11 - 7
    for row, expected in ((0, before[0]), (1, before[2]), (2, joiner)):
        assert same_kv(rebatched.row(row).materialize(), expected)

    merged = assemble_batch([batch.row(2), batch.row(0), joiner], max_groups=1)
    assert len(merged.groups) == 1 and merged.padded_len == joiner.length
    for row, expected in ((0, before[2]), (1, before[0]), (2, joiner)):
        assert same_kv(merged.row(row).materialize(), expected)
    group = merged.groups[0]
    for row, length in enumerate(group.prefix_lens):
        assert not group.keys[0][row, :, length : group.padded_len].any()  # zeroed gaps
    assert batch.row(0).length == len(PROMPTS[0]) + 3


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3"])
def test_parity_several_groups_decode_like_one(name: str) -> None:
    """A batch of two KV groups decodes exactly as the same rows in one group, and greedy tokens
    match row by row: the groups share every linear layer, attention stays per group."""
    model = native(name)
    first = assemble_batch([model.prefill(p)[0] for p in PROMPTS[:2]])
    second = assemble_batch([model.prefill(p)[0] for p in PROMPTS[2:]])
    grouped = assemble_batch([first.row(0), first.row(1), second.row(0), second.row(1)])
    single = assemble_batch([model.prefill(p)[0] for p in PROMPTS], max_groups=1)
    assert len(grouped.groups) == 2 and len(single.groups) == 1
    assert grouped.padding_columns < single.padding_columns
    tokens = [[7], [8], [9], [10]]
    for _ in range(6):
        a = model.forward_batch_decode(grouped, torch.tensor(tokens))
        b = model.forward_batch_decode(single, torch.tensor(tokens))
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        next_a = model.logits(a).argmax(-1)
        assert next_a.tolist() == model.logits(b).argmax(-1).tolist()
        tokens = next_a[:, None].tolist()
    assert grouped.row_lengths == single.row_lengths
    assert grouped.row(3).materialize().token_ids == single.row(3).materialize().token_ids


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-gemma3"])
def test_parity_prefill_chunk_riding_a_decode_step(name: str) -> None:
    """A joiner's prompt prefilled chunk by chunk inside decode steps gives the decode rows
    what they get without it, and the joiner what a plain prefill gives."""
    model = native(name)
    joiner = PROMPTS[2] * 3
    batch = assemble_batch([model.prefill(p)[0] for p in PROMPTS[:2]])
    alone = assemble_batch([model.prefill(p)[0] for p in PROMPTS[:2]])
    tokens = torch.tensor([[4], [5]])
    past, at = None, 0
    for size in (7, 12, len(joiner) - 19):
        chunk = PrefillChunk(joiner[at : at + size], past, reserve=len(joiner), extend=True)
        out = model.forward_step(batch, tokens, [chunk])
        torch.testing.assert_close(
            out.hidden, model.forward_batch_decode(alone, tokens), atol=1e-4, rtol=1e-4
        )
        (past,), at = out.snapshots, at + size
    assert past is not None and past.token_ids == joiner and len(out.chunk_hidden) == 1
    whole, hidden = model.prefill(joiner)
    torch.testing.assert_close(out.chunk_hidden[0], hidden[-1], atol=1e-4, rtol=1e-4)
    for a, b in zip(past.keys + past.values, whole.keys + whole.values, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert batch.row_lengths == alone.row_lengths


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-gemma2"])
def test_parity_several_joiners_ride_one_decode_step(name: str) -> None:
    """Chunks of three joiners in one step, of different lengths and progress (one starting,
    one after a past of its own): each gets what its plain prefill gives, the decode rows what
    they get alone."""
    model = native(name)
    joiners = [PROMPTS[2] * 2, PROMPTS[0], PROMPTS[1] * 5]
    batch = assemble_batch([model.prefill(p)[0] for p in PROMPTS[:2]])
    alone = assemble_batch([model.prefill(p)[0] for p in PROMPTS[:2]])
    tokens = torch.tensor([[4], [5]])
    first = PrefillChunk(joiners[0][:9], reserve=len(joiners[0]), extend=True)
    (past,) = model.forward_step(batch, tokens, [first]).snapshots
    model.forward_batch_decode(alone, tokens)
    chunks = [
        PrefillChunk(joiners[0][9:], past, reserve=len(joiners[0]), extend=True),
        PrefillChunk(joiners[1]),
        PrefillChunk(joiners[2], reserve=len(joiners[2]) + 4),
    ]
    out = model.forward_step(batch, tokens, chunks)
    torch.testing.assert_close(
        out.hidden, model.forward_batch_decode(alone, tokens), atol=1e-4, rtol=1e-4
    )
    assert len(out.snapshots) == len(out.chunk_hidden) == 3
    for joiner, snapshot, last in zip(joiners, out.snapshots, out.chunk_hidden, strict=True):
        whole, hidden = model.prefill(joiner)
        assert snapshot.token_ids == joiner
        torch.testing.assert_close(last, hidden[-1], atol=1e-4, rtol=1e-4)
        for a, b in zip(snapshot.keys + snapshot.values, whole.keys + whole.values, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert batch.row_lengths == alone.row_lengths


def test_chunked_prefill_grows_its_reserved_snapshot_in_place() -> None:
    model = native("tiny-llama")
    ids = PROMPTS[2] * 3
    whole, _ = model.prefill(ids[:10], chunk_size=4)
    whole, _ = model.prefill(ids[10:], whole, chunk_size=4)
    grown, _ = model.prefill(ids[:10], chunk_size=4, reserve=len(ids))
    assert grown.capacity == len(ids) and grown.length == 10
    storage = grown.keys[0].data_ptr()
    grown, _ = model.prefill(ids[10:], grown, chunk_size=4, extend=True)
    assert grown.keys[0].data_ptr() == storage  # no copy of the first chunk
    assert grown.length == grown.capacity == len(ids) and grown.token_ids == ids
    for a, b in zip(grown.keys + grown.values, whole.keys + whole.values, strict=True):
        assert torch.equal(a, b)


def test_mask_has_exactly_one_gap_per_row() -> None:
    prefix = torch.tensor([3, 5, 1])
    mask = batch_decode_mask(prefix, padded_len=5, kv_len=8)
    assert mask is not None and mask.shape == (3, 1, 1, 8)
    rows = mask[:, 0, 0].int().tolist()
    assert rows == [[1, 1, 1, 0, 0, 1, 1, 1], [1] * 8, [1, 0, 0, 0, 0, 1, 1, 1]]
    assert batch_decode_mask(torch.tensor([4, 4]), padded_len=4, kv_len=6) is None


def test_rope_per_row_positions_match_uniform_tables() -> None:
    model = native("tiny-llama3")
    positions = torch.tensor([0, 7, 200])
    cos, sin = rope_cos_sin(model.inv_freq, model.rope_scale, positions, torch.float32)
    full_cos, _ = rope_cos_sin(model.inv_freq, model.rope_scale, torch.arange(256), torch.float32)
    torch.testing.assert_close(cos, full_cos[positions])
    x = torch.randn(3, 2, 16)
    rotated = apply_rope(x, cos, sin)
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5)  # a rotation


# what each family's fixture is built to exercise: the config field of the feature, and a
# value that turns it off. Turned off, the logits move: parity on the fixture covers it.
FEATURES = [
    ("tiny-gemma2", "sliding_layers", ()),
    ("tiny-gemma2", "attn_softcap", None),
    ("tiny-gemma2", "final_softcap", None),
    ("tiny-gemma2", "attn_scale", None),
    ("tiny-gemma3", "sliding_layers", ()),
    ("tiny-gemma3", "layer_rope", ()),
    ("tiny-gemma3", "act", "silu"),
    ("tiny-phi3", "rotary_dim", 0),
    ("tiny-glm4-moe", "rotary_dim", 0),
    ("tiny-smollm3", "layer_rope", ()),
    ("tiny-granite", "embed_scale", 1.0),
    ("tiny-granite", "residual_scale", 1.0),
    ("tiny-granite", "attn_scale", None),
    ("tiny-granite", "logits_scale", 1.0),
    ("tiny-gpt-oss", "sliding_layers", ()),
]


@pytest.mark.parametrize(("name", "field", "off"), FEATURES)
def test_each_family_feature_changes_the_logits(name: str, field: str, off: object) -> None:
    model = native(name)
    ids = PROMPTS[2] + PROMPTS[0]  # 18 tokens: past the fixtures' sliding window of 8
    expected = reference_logits(name, ids)
    torch.testing.assert_close(model.logits(model.prefill(ids)[1]), expected, atol=2e-4, rtol=1e-4)
    if field == "rotary_dim":  # RoPE over every dim of each head instead of its first half
        d = model.config.head_dim
        model.ropes = [(1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d)), 1.0)]
    model.config = dataclasses.replace(model.config, **{field: off})
    moved = (model.logits(model.prefill(ids)[1]) - expected).abs().max()
    assert moved > 1e-2, f"{name}: {field} = {off!r} leaves the logits as they are"


def test_gemma_sliding_layers_see_only_their_window() -> None:
    """Layer 0 slides over 8 tokens: its output at position p depends on tokens p-7..p only,
    so layer 1's keys past position 7 are the same whatever token 0 was; a mixed model keeps
    its whole context."""
    model = native("tiny-gemma3")
    assert model.config.sliding_layers == (True, False) and model.config.sliding_window == 8
    assert model.config.context_len == 512
    ids = PROMPTS[2] + PROMPTS[0]
    other = [ids[0] + 1, *ids[1:]]
    a, b = model.prefill(ids, chunk_size=5)[0], model.prefill(other, chunk_size=5)[0]
    assert torch.equal(a.keys[1][:, :, 8:], b.keys[1][:, :, 8:])
    assert not torch.allclose(a.keys[1][:, :, :8], b.keys[1][:, :, :8])
    model.config = dataclasses.replace(model.config, sliding_layers=())  # no window: it moves
    a, b = model.prefill(ids)[0], model.prefill(other)[0]
    assert not torch.allclose(a.keys[1][:, :, 8:], b.keys[1][:, :, 8:])


def test_gpt_oss_reads_its_features_and_its_sinks_count() -> None:
    """gpt-oss's config: sliding layers from its layer_types (the released models' alternate,
    a window of 128, the context not capped), sinks and float32 norms, yarn RoPE as
    transformers computes it (with `truncate` either way); the fixture's sinks move its
    logits (and they were drawn to)."""
    released = ArchConfig.from_hf(GptOssConfig())  # the 120B model's shape
    assert released.sliding_layers == (True, False) * 18 and released.sliding_window == 128
    assert released.context_len == 131072 and released.attn_sinks and released.norm_fp32
    assert released.moe is not None and released.moe.swiglu_limit == 7.0
    assert (released.moe.num_experts, released.moe.top_k) == (128, 4)
    for truncate in (False, True):
        hf_config = GptOssConfig(
            rope_parameters={**GptOssConfig().rope_parameters, "truncate": truncate}
        )
        inv_freq, scale = rope_inv_freq(hf_config)
        want = GptOssRotaryEmbedding(hf_config)
        assert torch.equal(inv_freq, want.inv_freq) and scale == want.attention_scaling
    model = native("tiny-gpt-oss")
    ids = PROMPTS[2] + PROMPTS[0]
    expected = reference_logits("tiny-gpt-oss", ids)
    for lw in model.layers:
        assert lw.sinks is not None
        lw.sinks = None
    assert (model.logits(model.prefill(ids)[1]) - expected).abs().max() > 1.0


def test_gpt_oss_sinks_outside_the_exact_attention() -> None:
    """The written-out attention with sinks (the fused kernel has none), as packed sequences
    (pooling) and as prefill with the exact attention turned off, gives transformers'
    hidden states and logits."""
    model = native("tiny-gpt-oss")
    hf = hf_model("tiny-gpt-oss")
    sequences = [PROMPTS[2] + PROMPTS[0], PROMPTS[1], [7] * 11]
    pooled = model.pooled(sequences, "last", False)
    for row, ids in enumerate(sequences):
        with torch.no_grad():
            want = hf.model(torch.tensor([ids])).last_hidden_state[0, -1]
        torch.testing.assert_close(pooled[row], want, atol=1e-5, rtol=1e-5)
    model.__dict__["exact"] = False  # (a cached property: as NEURON_EXACT_ATTENTION=0 sets it)
    ids = sequences[0]
    got = model.logits(model.prefill(ids, chunk_size=5)[1])
    torch.testing.assert_close(got, reference_logits("tiny-gpt-oss", ids), atol=2e-4, rtol=1e-4)


def test_longrope_caps_the_context_at_its_short_factors() -> None:
    config = ArchConfig.from_hf(hf_model("tiny-phi3").config)
    assert config.context_len == 256 and config.rotary_dim == 8
    model = native("tiny-phi3")
    with pytest.raises(ValueError, match="exceeds the context of 256"):
        model.prefill(list(range(3, 260)))


def test_unsupported_architecture_is_refused_by_name() -> None:
    gpt2 = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, bos_token_id=0, eos_token_id=0)
    )
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        LlamaModel.from_hf(gpt2)
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        ArchConfig.from_hf(gpt2.config)
