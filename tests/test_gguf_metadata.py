"""A GGUF file's config and tokenizer read by neuronpy/gguf_metadata.py == transformers' own."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import transformers

from neuronpy.arch.gguf import SkippedArray, read_index
from neuronpy.gguf_metadata import gguf_config, read_gguf_metadata, transformers_metadata
from neuronpy.loading import _gguf_metadata, default_model_path
from tests.gguf_files import write_fixture_metadata, write_gguf, write_large_vocab_gguf

FIXTURES = Path(__file__).parent / "fixtures"

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX.",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnewlines\r\n\n\nand more",
    "numbers 1234567890 3.14159 -42 1e-5 0x1F",
    "def f(x):\n    return x ** 2  # a comment\n",
    "Ünïcödé: café, naïve, Straße, Ελληνικά, русский, 日本語のテキスト, 中文, 한국어",
    "emoji 🙂🚀👍🏽 and symbols ©®™ ∑∫√ ≤≥",
    "don't won't it's we're they've I'm you'll he'd",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after an end<|endoftext|>",
    "a" * 300,
    " ".join(f"w{i}" for i in range(200)),
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy? 🙂"},
]


def assert_same_tokenizer(ours: Any, theirs: Any, tmp_path: Path) -> None:
    """The same class, pipeline (vocabulary, merges, normalizer, pre-tokenizer, decoder, added
    tokens), special tokens, chat template, ids and saved files."""
    assert type(ours) is type(theirs)
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    assert ours.init_kwargs == theirs.init_kwargs
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.all_special_ids == theirs.all_special_ids
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "chat_template"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert len(ours) == len(theirs) and ours.get_vocab() == theirs.get_vocab()
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), text
        assert ours.decode(ids) == theirs.decode(ids)
    if ours.chat_template:
        for prompt in (True, False):
            got = ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt)
            assert got == theirs.apply_chat_template(
                CHAT, tokenize=False, add_generation_prompt=prompt
            )
    ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "theirs")
    names = sorted(p.name for p in (tmp_path / "theirs").iterdir())
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == names
    for name in names:
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "theirs" / name).read_bytes()


def assert_same_metadata(path: Path, tmp_path: Path) -> tuple[Any, Any]:
    config, tokenizer = read_gguf_metadata(path)
    want_config, want_tokenizer = transformers_metadata(path)
    assert type(config) is type(want_config)
    assert config.to_dict() == want_config.to_dict()
    assert vars(config) == vars(want_config)
    assert_same_tokenizer(tokenizer, want_tokenizer, tmp_path)
    return config, tokenizer


@pytest.mark.parametrize(
    ("fixture", "arch", "options"),
    [
        ("tiny-llama", "llama", {}),
        ("tiny-llama", "llama", {"untied_head": True, "name": "tiny"}),
        ("tiny-llama", "llama", {"with_vocab_size": False}),  # vocab_size: the tokens counted
        ("tiny-mistral", "llama", {"name": "mistral"}),  # transformers renames it Mistral
        ("tiny-qwen2", "qwen2", {"pre": "qwen2"}),  # Qwen2Tokenizer
        ("tiny-qwen3", "qwen3", {"pre": "qwen2"}),
    ],
)
def test_a_fixture_file_reads_as_transformers_reads_it(
    fixture: str, arch: str, options: dict[str, Any], tmp_path: Path
) -> None:
    path = write_fixture_metadata(tmp_path / f"{fixture}.gguf", FIXTURES / fixture, arch, **options)
    config, tokenizer = assert_same_metadata(path, tmp_path)
    assert config.tie_word_embeddings is not options.get("untied_head", False)
    assert config.vocab_size == len(tokenizer) == 360
    if options.get("name") == "mistral":
        assert config.model_type == "mistral"


def test_the_synthetic_49k_vocabulary_reads_as_transformers_reads_it(tmp_path: Path) -> None:
    """The slow case: a 1B-class model's 49k-token vocabulary and 49k merges."""
    path = write_large_vocab_gguf(tmp_path / "synthetic-1.7b.gguf")
    fields, _ = read_index(path)
    assert fields["tokenizer.ggml.tokens"] == SkippedArray(49152)
    config, tokenizer = assert_same_metadata(path, tmp_path)
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (49152, 2048, 24)
    # the merges apply to ordinary text: fewer tokens than characters
    text = "the quick brown fox jumps over the lazy dog"
    assert len(tokenizer.encode(text)) < len(text)


def test_a_tensors_only_file_gives_transformers_config(tmp_path: Path) -> None:
    """A file with hardly any metadata (tests/gguf_files.py's weights-only ones): the same
    config, defaults and all."""
    model = transformers.AutoModelForCausalLM.from_pretrained(FIXTURES / "tiny-llama")
    path = write_gguf(tmp_path / "weights.gguf", model, "F32")
    config = gguf_config(path)
    want = transformers.AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert config is not None and vars(config) == vars(want)


def test_a_file_beside_a_tokenizer_config_is_left_to_autotokenizer(tmp_path: Path) -> None:
    """AutoTokenizer reads a tokenizer_config.json beside the file to choose the class: there
    the tokenizer is its own, and still the same."""
    path = write_fixture_metadata(tmp_path / "tiny.gguf", FIXTURES / "tiny-llama")
    shutil.copy(FIXTURES / "tiny-qwen2" / "tokenizer_config.json", tmp_path)
    assert_same_metadata(path, tmp_path)


def test_the_cache_entry_keeps_what_the_file_gave(tmp_path: Path) -> None:
    """What _gguf_metadata writes to the cache, read back on a second start, is the same.
    (A Llama file's: a Qwen2 file's tokenizer gains an NFC normalizer when Qwen2Tokenizer
    reads its saved copy back, which transformers' GGUF path leaves out, both before and
    after gguf_metadata.)"""
    path = write_fixture_metadata(tmp_path / "tiny.gguf", FIXTURES / "tiny-llama")
    first = _gguf_metadata(path, tmp_path / "cache", print)
    second = _gguf_metadata(path, tmp_path / "cache", print)
    assert (tmp_path / "cache" / "gguf-meta").is_dir()
    named = {"_name_or_path"}  # the folder each was read from
    assert {k: v for k, v in first[0].to_dict().items() if k not in named} == {
        k: v for k, v in second[0].to_dict().items() if k not in named
    }
    assert first[1].backend_tokenizer.to_str() == second[1].backend_tokenizer.to_str()
    assert type(first[1]) is type(second[1])


@pytest.mark.slow
def test_the_default_model_reads_as_transformers_reads_it(tmp_path: Path) -> None:
    config, tokenizer = assert_same_metadata(default_model_path(), tmp_path)
    assert (config.vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_id) == (49152, 1, 2)


def test_a_files_parameter_count_and_type_come_from_its_header() -> None:
    """What Ollama's /api/show reports of the default model (`ollama show`: "134.52M",
    "Q4_1"), read from the file's header alone."""
    from neuronpy.compose import gguf_file_facts
    from neuronpy.server.ollama_api.routes import parameter_size

    count, kind = gguf_file_facts(default_model_path())
    assert (count, kind) == (134_515_008, "Q4_1")
    assert parameter_size(count) == "134.52M" and parameter_size(1_235_814_400) == "1.2B"
