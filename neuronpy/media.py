"""Images in a prompt, as every layer sees them (no torch: the scheduler core reads it too).

A vision-language model reads an image as a run of placeholder tokens in its prompt, whose
embeddings the vision tower's output replaces. In neuronpy's prompts each such token is a
*media id*: a negative number that names the image (the SHA-256 of its pixels as the
processor prepared them) and the token's place among the image's own. So a prompt's ids say
what it holds, pictures included, and everything keyed by ids works for images unchanged:
the prefix cache matches a follow-up turn with the same image (and never one with another
image), a preempted request prefills the same thing again, n copies share one prefill. The
worker resolves media ids into the vision tower's rows (worker/worker.py); nothing else
feeds them to a model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# bits for a token's place within its image: 2**20 tokens per image is far above any tower's
TOKEN_BITS = 20


@dataclass(frozen=True, eq=False)
class Media:
    """One image of a prompt, prepared by its model's processor: `inputs` are what the vision
    tower takes (arrays, by the names transformers' `get_image_features` uses), `tokens` how
    many placeholder tokens it fills, `key` the SHA-256 of the inputs."""

    key: str
    tokens: int
    inputs: Mapping[str, Any] = field(repr=False)
    nbytes: int = 0  # the image file's size, as received
    placeholder: int = 0  # the token its media ids stand for (the processor's placeholder)

    @property
    def number(self) -> int:
        return int(self.key, 16)

    def ids(self) -> tuple[int, ...]:
        """The media ids of its `tokens` placeholder tokens, in order."""
        base = self.number << TOKEN_BITS
        return tuple(-(base + j) - 1 for j in range(self.tokens))


class Prompt(tuple[int, ...]):
    """A prompt's token ids, media ids among them, with the images they name: what a request
    with images is submitted as (a plain sequence of ids holds none)."""

    media: tuple[Media, ...]

    def __new__(cls, ids: Sequence[int], media: Sequence[Media] = ()) -> Prompt:
        self = super().__new__(cls, ids)
        self.media = tuple(media)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (Prompt, (tuple(self), self.media))


def media_of(ids: Sequence[int]) -> tuple[Media, ...]:
    """The images a prompt's ids name (none for a plain sequence)."""
    return ids.media if isinstance(ids, Prompt) else ()


def media_key(inputs: Mapping[str, Any]) -> str:
    """The SHA-256 of a processor's arrays for one image (names, shapes, dtypes and bytes)."""
    digest = hashlib.sha256()
    for name in sorted(inputs):
        value = inputs[name]
        digest.update(name.encode())
        layout = (getattr(value, "shape", None), str(getattr(value, "dtype", "")))
        digest.update(repr(layout).encode())
        tobytes = getattr(value, "tobytes", None)
        digest.update(tobytes() if tobytes is not None else repr(value).encode())
    return digest.hexdigest()


def split_media_id(token: int) -> tuple[int, int]:
    """(the image's number, the token's place in it) of a media id."""
    value = -token - 1
    return value >> TOKEN_BITS, value & ((1 << TOKEN_BITS) - 1)


def past_image(tokens: Sequence[int], end: int) -> int:
    """`end`, or where the image it would cut in two ends: a prefill chunk holds an image's
    run of tokens whole (a model whose image tokens see their whole image at prefill, Gemma
    3's, needs them in one forward)."""
    while 0 < end < len(tokens) and tokens[end] < 0 and tokens[end - 1] < 0:
        if split_media_id(tokens[end])[0] != split_media_id(tokens[end - 1])[0]:
            break
        end += 1
    return end


def text_ids(ids: Sequence[int], placeholder: int = 0) -> list[int]:
    """`ids` with every media id replaced by `placeholder` (a real token id): for what reads a
    prompt's tokens as text (a detokenizer's context, repetition penalties)."""
    return [placeholder if t < 0 else t for t in ids]


def check_media_ids(ids: Sequence[int], media: Sequence[Media]) -> None:
    """ValueError unless every media id in `ids` names a token of one of `media`."""
    known = {m.number: m.tokens for m in media}
    for t in ids:
        if t < 0:
            number, j = split_media_id(t)
            if known.get(number, 0) <= j:
                raise ValueError("the prompt names an image token that none of its images has")
