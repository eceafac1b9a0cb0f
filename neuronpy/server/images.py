"""Images in requests: decoded and checked (what a client may send, and what a bad one gets: a
400 naming the part), then turned into a prompt's media by the model's own processor
(transformers': its resizing, tiling and normalization, and the placeholder tokens its chat
template and processor write for each image). See neuronpy/media.py for what the engine
does with them."""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from neuronpy.errors import InvalidRequestError
from neuronpy.media import Media, Prompt, media_key
from neuronpy.server.prompts import Expanded

MAX_IMAGES = 8  # per request
MAX_IMAGE_BYTES = 20 << 20  # an image file's size, decoded from base64
MAX_IMAGE_PIXELS = 40_000_000  # width x height: past it a file is a decompression bomb
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MIME_TYPES = {
    "image/png": "PNG",
    "image/jpeg": "JPEG",
    "image/jpg": "JPEG",
    "image/webp": "WEBP",
    "image/gif": "GIF",
    "image/bmp": "BMP",
}
_DATA_URI = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?);base64,", re.I)


@dataclass(frozen=True)
class ImageInput:
    """One image of a request, decoded: `where` names its part ("messages[0].content[1]")."""

    image: Image.Image
    where: str
    nbytes: int


def image_from_url(url: str, where: str) -> ImageInput:
    """An `image_url` part's image: a `data:` URI with base64 content. Remote URLs are not
    fetched (a server that fetched what its clients name would reach what they cannot)."""
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"'{where}' needs a url", where)
    match = _DATA_URI.match(url[:256])
    if match is None:
        if re.match(r"^https?://", url, re.I):
            raise InvalidRequestError(
                f"'{where}': this server fetches no remote images (its operator may allow "
                "them: --image-urls); send the image inline as a data: URI "
                "(data:image/png;base64,...)",
                where,
            )
        raise InvalidRequestError(
            f"'{where}': an image url must be a data: URI with base64 content "
            "(data:image/png;base64,...)",
            where,
        )
    mime = (match.group("mime") or "").lower()
    if mime and mime not in MIME_TYPES:
        raise InvalidRequestError(
            f"'{where}': images of type {mime[:64]!r} are not read; send one of "
            f"{', '.join(sorted(MIME_TYPES))}",
            where,
        )
    return image_from_base64(url[match.end() :], where)


def image_from_base64(data: str, where: str) -> ImageInput:
    """An image sent as base64 text (Anthropic's `source.data`, Ollama's `images`)."""
    if not isinstance(data, str):
        raise InvalidRequestError(f"'{where}' must be base64 text", where)
    if len(data) > (MAX_IMAGE_BYTES * 4) // 3 + 4:
        raise InvalidRequestError(
            f"'{where}': the image is larger than {MAX_IMAGE_BYTES >> 20} MiB", where
        )
    try:
        raw = base64.b64decode(re.sub(r"\s+", "", data), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"'{where}': the image is not valid base64", where) from None
    return decode_image(raw, where)


def decode_image(raw: bytes, where: str) -> ImageInput:
    """The image in a file's bytes, fully decoded (a truncated file fails here, not later), as
    RGB; InvalidRequestError naming `where` for anything that is not a whole image of a
    format read here, within the size bounds."""
    if len(raw) > MAX_IMAGE_BYTES:
        raise InvalidRequestError(
            f"'{where}': the image is larger than {MAX_IMAGE_BYTES >> 20} MiB", where
        )
    if not raw:
        raise InvalidRequestError(f"'{where}': the image is empty", where)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw), formats=FORMATS)
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise InvalidRequestError(
                    f"'{where}': the image is {width}x{height} pixels; at most "
                    f"{MAX_IMAGE_PIXELS // 1_000_000} million are read",
                    where,
                )
            image.load()
            image = image.convert("RGB")
    except InvalidRequestError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidRequestError(
            f"'{where}': the image decompresses to more than "
            f"{MAX_IMAGE_PIXELS // 1_000_000} million pixels",
            where,
        ) from None
    except UnidentifiedImageError:
        raise InvalidRequestError(
            f"'{where}' is not an image of a format read here ({', '.join(FORMATS)})", where
        ) from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise InvalidRequestError(
            f"'{where}': the image cannot be decoded ({str(exc)[:120] or type(exc).__name__})",
            where,
        ) from None
    return ImageInput(image, where, len(raw))


def check_image_count(count: int, where: str) -> None:
    """InvalidRequestError naming `where` (the image that is one too many) past MAX_IMAGES."""
    if count > MAX_IMAGES:
        raise InvalidRequestError(f"a request may hold at most {MAX_IMAGES} images", where)


def image_marker(tokenizer: Any) -> tuple[int, ...]:
    """The tokens a model's chat template writes for an image part ("<image>", Gemma 3's
    "<start_of_image>", Qwen's "<|vision_start|><|image_pad|><|vision_end|>"): where a
    conversation with one image differs from one without, in the template's own tokens.
    Worked out once per tokenizer."""
    found = _MARKERS.get(tokenizer)
    if found is None:
        found = _MARKERS[tokenizer] = _image_marker(tokenizer)
    return found


_MARKERS: weakref.WeakKeyDictionary[Any, tuple[int, ...]] = weakref.WeakKeyDictionary()


def _image_marker(tokenizer: Any) -> tuple[int, ...]:
    with_image = _render_probe(tokenizer, [{"type": "image"}, {"type": "text", "text": "a"}])
    without = _render_probe(tokenizer, [{"type": "text", "text": "a"}])
    head = 0
    while head < min(len(with_image), len(without)) and with_image[head] == without[head]:
        head += 1
    tail = 0
    while (
        tail < min(len(with_image), len(without)) - head
        and with_image[-1 - tail] == without[-1 - tail]
    ):
        tail += 1
    marker = tuple(with_image[head : len(with_image) - tail])
    if not marker:
        raise ValueError("the chat template writes nothing for an image")
    return marker


def _render_probe(tokenizer: Any, content: list[dict[str, Any]]) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return [int(t) for t in ids]


def render_with_images(
    processor: Any,
    marker: Sequence[int],
    ids: Sequence[int],
    images: Sequence[ImageInput],
) -> Prompt:
    """A prompt rendered by the chat template (`ids`, its user text encoded as text), whose
    image parts the template wrote as `marker` (image_marker's) in the order of `images`,
    with each marker expanded as the model's processor expands it for that image (its
    tiles' framing tokens and the placeholders its rows take), and each image's
    placeholders turned into its media ids; the processor's arrays for each image go with
    them (what the vision tower takes). `ids` that the processor rendered (render_chat's
    Expanded) have their placeholders written out already: those become the media ids."""
    marker_text = processor.tokenizer.decode(list(marker))
    expansions = [_expand(processor, marker_text, image) for image in images]
    placeholder = _placeholder(processor, expansions[0][0]) if expansions else 0
    media = [
        _media(expanded, inputs, placeholder, image)
        for (expanded, inputs), image in zip(expansions, images, strict=True)
    ]
    if isinstance(ids, Expanded):  # the processor rendered the prompt, its images expanded
        return _with_media_ids(list(ids), media, placeholder)
    out: list[int] = []
    at, i, n = 0, 0, len(marker)
    while i < len(ids):
        if tuple(ids[i : i + n]) != tuple(marker):
            out.append(int(ids[i]))
            i += 1
            continue
        if at == len(media):
            raise InvalidRequestError("the prompt holds more images than were sent", "messages")
        slots = iter(media[at].ids())
        out.extend(next(slots) if t == placeholder else t for t in expansions[at][0])
        at += 1
        i += n
    if at != len(images):
        raise InvalidRequestError(
            f"the chat template placed {at} of the {len(images)} images", "messages"
        )
    return Prompt(out, media)


def _placeholder(processor: Any, expanded: Sequence[int]) -> int:
    """The placeholder token of an image's expansion: the one its rows take the place of,
    the added token written most (once per row: SmolVLM's <image>, Gemma 3's
    <image_soft_token>; framing tokens fewer times, and text such as newlines is not one)."""
    added = set(processor.tokenizer.added_tokens_decoder)
    found = [t for t in expanded if t in added] or list(expanded)
    return max(set(found), key=found.count)


def _media(
    expanded: Sequence[int], inputs: dict[str, Any], placeholder: int, image: ImageInput
) -> Media:
    tokens = sum(1 for t in expanded if t == placeholder)
    return Media(media_key(inputs), tokens, inputs, image.nbytes, placeholder)


def _expand(
    processor: Any, marker_text: str, image: ImageInput
) -> tuple[list[int], dict[str, Any]]:
    """The processor's tokens for one image's marker, and its arrays for the image alone
    (what the vision tower takes)."""
    try:
        out = processor(
            text=[marker_text],
            images=[[image.image]],
            return_tensors="np",
            add_special_tokens=False,
        )
    except (ValueError, TypeError, OSError) as exc:
        raise InvalidRequestError(
            f"'{image.where}': the image cannot be prepared for this model ({str(exc)[:160]})",
            image.where,
        ) from None
    ids = [int(t) for t in np.asarray(out["input_ids"]).reshape(-1)]
    inputs = {
        k: np.asarray(v)
        for k, v in out.items()
        if k not in ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")
        and isinstance(v, np.ndarray)
    }
    return ids, inputs


def _with_media_ids(ids: list[int], media: Sequence[Media], placeholder: int) -> Prompt:
    """`ids` with the placeholder tokens, in order, replaced by each image's media ids."""
    slots = [i for i, t in enumerate(ids) if t == placeholder]
    if len(slots) != sum(m.tokens for m in media):
        raise InvalidRequestError(
            f"the prompt has {len(slots)} image tokens for {len(media)} images of "
            f"{sum(m.tokens for m in media)}: the chat template placed the images otherwise "
            "than the processor counts them",
            "messages",
        )
    out = list(ids)
    at = 0
    for m in media:
        for media_id in m.ids():
            out[slots[at]] = media_id
            at += 1
    return Prompt(out, media)
