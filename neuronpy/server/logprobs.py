"""Log-probabilities in OpenAI's shapes: chat's `logprobs.content` and completions' lists."""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from neuronpy.engine.types import TokenLogprob

# JSON has no -Infinity: a log-probability that underflowed is written as this (as vLLM does).
MIN_LOGPROB = -9999.0
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte fallback


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: each printable stand-in -> its byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    table, extra = {chr(b): b for b in kept}, 0
    for b in range(256):
        if b not in kept:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTES = _byte_decoder()


class TokenTexts:
    """Token ids as OpenAI writes them in logprobs: each token's own text and its UTF-8 bytes
    (a token holding part of a character has U+FFFD in its text; its bytes are exact)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = "ByteLevel" in repr(getattr(backend, "decoder", None))
        self._added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            raw = self._bytes(token_id)
            found = (raw.decode("utf-8", errors="replace"), list(raw))
            self._cache[token_id] = found
        return found

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):  # past the tokenizer's vocabulary (a padded head)
            return b""
        if self._byte_level and all(c in _BYTES for c in piece):
            return bytes(_BYTES[c] for c in piece)
        byte = _BYTE_TOKEN.match(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        return piece.replace("\u2581", " ").encode()  # SentencePiece's word marker is a space


_TEXTS: weakref.WeakKeyDictionary[Any, TokenTexts] = weakref.WeakKeyDictionary()


def token_texts(tokenizer: PreTrainedTokenizerBase) -> TokenTexts:
    """The tokenizer's TokenTexts, shared by its requests (its cache fills as they run)."""
    texts = _TEXTS.get(tokenizer)
    if texts is None:
        texts = _TEXTS[tokenizer] = TokenTexts(tokenizer)
    return texts


def _value(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def chat_logprobs(texts: TokenTexts, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """Chat's `logprobs`: one entry per token, each with its `top_logprobs`, most likely first."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = texts(token_id)
        return {"token": text, "logprob": _value(logprob), "bytes": raw}

    content = [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
        for lp in logprobs
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    texts: TokenTexts, logprobs: Sequence[TokenLogprob], offset: int = 0
) -> dict[str, Any]:
    """Completions' `logprobs`: parallel lists; each `top_logprobs` maps the top tokens' texts
    (and the chosen one's) to their log-probabilities. `offset`: where the first token's text
    begins in the completion (text_offset counts the tokens' own texts)."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in logprobs:
        text = texts(lp.token_id)[0]
        top: dict[str, float] = {}
        for i, v in lp.top:  # two tokens may have one text (U+FFFD): the likelier one stays
            top.setdefault(texts(i)[0], _value(v))
        top.setdefault(text, _value(lp.logprob))
        tokens.append(text)
        values.append(_value(lp.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
