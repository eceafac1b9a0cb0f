"""IncrementalDetokenizer: streamed deltas never split a character and add up to the full decode."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from neuronpy.engine.detokenize import IncrementalDetokenizer

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-llama"
MULTIBYTE = "café 日本語 🙂 🚀 é!"
ALPHABET = "ab é日本語🙂🚀ñ\n"

# Repeated multi-byte runs make byte-level BPE merge bytes across character boundaries
# (the end of 日 with the start of 本), the hardest case for a streaming detokenizer.
TRAIN_CORPUS = (
    "日本語の日本語です。日本の語。",
    "🙂🚀🙂🚀 rockets and smiles 🙂🚀",
    "the cat sat on the mat, the cat ate",
    "naïve café, résumé, piñata",
) * 4


@pytest.fixture(scope="module")
def fixture_tokenizer() -> Any:
    if not FIXTURE.is_dir():
        pytest.skip("tests/fixtures/tiny-llama not built")
    return PreTrainedTokenizerFast.from_pretrained(FIXTURE)


@pytest.fixture(scope="module")
def trained_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 / Llama 3 / Qwen style) with cross-character merges."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        special_tokens=["<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAIN_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


@pytest.fixture(scope="module")
def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE (Llama 2 / Mistral): "▁" for spaces, <0xXX> byte fallback,
    and a decoder that strips the text's leading space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(["Say hi: Hello world, hello there.", *TRAIN_CORPUS], trainer=trainer)
    # The trainer cannot add the 256 byte pieces as ordinary (non-special) vocabulary entries.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(params=["fixture", "trained"])
def byte_level(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_tokenizer")


@pytest.fixture(params=["fixture", "trained", "sentencepiece"])
def any_tokenizer(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_tokenizer")


def encode(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(
    tok: Any, ids: Sequence[int], prompt: Sequence[int] = (), skip_special_tokens: bool = True
) -> tuple[list[str], str, IncrementalDetokenizer]:
    """Feed `ids` one by one; return the deltas from add(), flush()'s text and the detokenizer."""
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(i) for i in ids]
    return deltas, detok.flush(), detok


def byte_ids(tok: Any) -> list[int]:
    """The id of each single-byte token of a byte-level BPE, indexed by byte value."""
    # GPT-2's printable stand-ins for bytes: printable Latin-1 maps to itself, the rest to 256+.
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}
    vocab = tok.get_vocab()
    return [vocab[char[b]] for b in range(256)]


def test_multibyte_characters_split_across_tokens_never_stream_half_a_character(
    byte_level: Any,
) -> None:
    ids = encode(byte_level, MULTIBYTE)
    # The case under test: some tokens alone are only part of a character.
    assert any("\ufffd" in byte_level.decode([i]) for i in ids)
    deltas, tail, detok = stream(byte_level, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert tail == ""
    assert "".join(deltas) == detok.text == byte_level.decode(ids, skip_special_tokens=True)
    assert detok.text == MULTIBYTE


@pytest.mark.parametrize("text", ["é", "日本語", "🙂", "🚀", "🙂🚀日本語éé"])
def test_each_character_comes_out_whole(byte_level: Any, text: str) -> None:
    ids = encode(byte_level, text)
    deltas, tail, _ = stream(byte_level, ids)
    emitted = [d for d in deltas if d]
    # Every delta is whole characters of the text, in order.
    assert "".join(emitted) == text and tail == ""
    assert all("\ufffd" not in d for d in emitted)


def test_random_text_streams_to_the_full_decode(any_tokenizer: Any) -> None:
    rng = random.Random(1234)
    for _ in range(150):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 30)))
        ids = encode(any_tokenizer, text)
        deltas, tail, detok = stream(any_tokenizer, ids)
        full = any_tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(deltas) + tail == detok.text == full, text
        assert not any("\ufffd" in d for d in deltas), text


def test_long_stream_matches_full_decode(any_tokenizer: Any) -> None:
    text = " ".join(["The cat sat 日本語 🙂🚀 café"] * 60)
    ids = encode(any_tokenizer, text)
    assert len(ids) > 300  # past the point where old ids are dropped from the window
    _, _, detok = stream(any_tokenizer, ids)
    assert detok.text == any_tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_skipped(fixture_tokenizer: Any) -> None:
    tok = fixture_tokenizer
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = [*encode(tok, "hi "), start, *encode(tok, "日本 🙂"), end, *encode(tok, "!")]
    _, _, detok = stream(tok, ids)
    assert detok.text == "hi 日本 🙂!" == tok.decode(ids, skip_special_tokens=True)
    _, _, kept = stream(tok, ids, skip_special_tokens=False)
    assert kept.text == tok.decode(ids) == "hi <|im_start|>日本 🙂<|im_end|>!"


def test_incomplete_character_at_the_end_is_flushed_as_replacement(byte_level: Any) -> None:
    to_id = byte_ids(byte_level)
    ids = [*encode(byte_level, "ok "), *(to_id[b] for b in "日".encode()[:2])]
    deltas, tail, detok = stream(byte_level, ids)
    assert "".join(deltas) == "ok "
    assert tail == "\ufffd"
    assert detok.text == byte_level.decode(ids) == "ok \ufffd"


def test_random_invalid_bytes_match_full_decode_and_keep_streaming(byte_level: Any) -> None:
    to_id = byte_ids(byte_level)
    rng = random.Random(7)
    for _ in range(300):
        raw = bytearray()
        for _ in range(rng.randint(1, 15)):
            kind = rng.random()
            char = rng.choice("é日🙂a ").encode()
            if kind < 0.4:
                raw += char
            elif kind < 0.7 and len(char) > 1:
                raw += char[: rng.randint(1, len(char) - 1)]  # a truncated character
            else:
                raw.append(rng.randrange(256))
        ids = [to_id[b] for b in raw]
        deltas, tail, detok = stream(byte_level, ids)
        assert "".join(deltas) + tail == detok.text == byte_level.decode(ids), bytes(raw)
        assert detok.text == bytes(raw).decode("utf-8", errors="replace")


def test_a_run_of_invalid_bytes_does_not_hold_back_the_stream(byte_level: Any) -> None:
    stray = byte_ids(byte_level)[0x80]  # a continuation byte with nothing to continue
    deltas, tail, _ = stream(byte_level, [stray] * 50)
    streamed = "".join(deltas)
    assert streamed + tail == "\ufffd" * 50
    assert len(streamed) >= 40  # emitted as it goes, not all at flush


def test_prompt_text_is_never_emitted(any_tokenizer: Any) -> None:
    prompt = encode(any_tokenizer, "Say hi: Hello there")
    gen = encode(any_tokenizer, "日本語 🙂 ok")
    _, _, detok = stream(any_tokenizer, gen, prompt=prompt)
    full = any_tokenizer.decode(prompt + gen)
    assert full.endswith(detok.text)
    assert detok.text.strip() == "日本語 🙂 ok"


def test_byte_level_prompt_context_changes_nothing(byte_level: Any) -> None:
    prompt = encode(byte_level, "the cat 日本")
    gen = encode(byte_level, "語 🚀 sat")
    _, _, detok = stream(byte_level, gen, prompt=prompt)
    assert detok.text == byte_level.decode(gen) == "語 🚀 sat"


def test_sentencepiece_prompt_context_keeps_the_leading_space(
    sentencepiece_tokenizer: Any,
) -> None:
    tok = sentencepiece_tokenizer
    ids = encode(tok, "Say hi: Hello world 🚀")
    prompt = encode(tok, "Say hi:")
    gen = ids[len(prompt) :]
    assert ids[: len(prompt)] == prompt
    assert tok.convert_ids_to_tokens(gen[0]).startswith("▁")
    # Alone the first generated token would lose its space to the decoder's Strip.
    assert tok.decode(gen) == "Hello world 🚀"
    _, _, detok = stream(tok, gen, prompt=prompt)
    assert detok.text == " Hello world 🚀"
    assert tok.decode(prompt) + detok.text == tok.decode(ids)


def test_prompt_ending_mid_character_is_not_used_as_context(byte_level: Any) -> None:
    to_id = byte_ids(byte_level)
    head, *rest = "日".encode()
    prompt = [*encode(byte_level, "ok "), to_id[head]]
    gen = [*(to_id[b] for b in rest), *encode(byte_level, "ab")]
    _, _, detok = stream(byte_level, gen, prompt=prompt)
    # The orphaned continuation bytes decode as they would alone; the prompt's byte stays out.
    assert detok.text == byte_level.decode(gen) == "\ufffd\ufffdab"
