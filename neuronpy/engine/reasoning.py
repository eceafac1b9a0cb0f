"""Reasoning parsers: which markers open and close a model's thinking block, and which models
have one (configured per model, or detected from the chat template)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from neuronpy.defaults import REASONING_PARSERS
from neuronpy.engine import harmony
from neuronpy.media import text_ids

# name -> (start marker, end marker). "think": Qwen3, QwQ, DeepSeek-R1 and their distills.
# "harmony": gpt-oss's analysis message (its reply is read by engine/output.py's
# HarmonyParser, which knows the framing between messages; the markers serve what only needs
# the block's ends: a prompt that opened it, a constrained reply's optional block).
# (neuronpy.defaults.REASONING_PARSERS lists these names, with "auto" and "none".)
REASONING_MARKERS: dict[str, tuple[str, str]] = {
    "think": ("<think>", "</think>"),
    harmony.NAME: (harmony.REASONING_START, harmony.END),
}

# Prompt ids decoded to see whether the chat template left a thinking block open.
PROMPT_TAIL_IDS = 8


def resolve_reasoning_parser(setting: str, tokenizer: object) -> str | None:
    """The reasoning parser a model's `setting` means: None for "none"; for "auto", the parser
    whose two markers the model's chat template writes (None when it writes none of them);
    "harmony" for a template that writes harmony's framing.
    `tokenizer`: a transformers tokenizer (its `chat_template` is read)."""
    if setting not in REASONING_PARSERS:
        raise ValueError(
            f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {setting!r}"
        )
    if setting == "none":
        return None
    if setting != "auto":
        return setting
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    if harmony.is_harmony_template(template):  # (its markers are built of several tokens)
        return harmony.NAME
    for name, (start, end) in REASONING_MARKERS.items():
        if start in template and end in template:
            return name
    return None


def opens_reasoning(prompt_tail: str, parser: str) -> bool:
    """Whether a prompt ending in `prompt_tail` leaves the thinking block open (the template
    wrote the start marker, DeepSeek-R1 style): then the reply begins inside it."""
    return prompt_tail.rstrip().endswith(REASONING_MARKERS[parser][0])


def prompt_opens_reasoning(tokenizer: Any, prompt_ids: Sequence[int], parser: str | None) -> bool:
    """Whether the prompt `prompt_ids` leaves parser `parser`'s thinking block open (None: no
    parser, so no block). `tokenizer`: a transformers tokenizer (its last ids are decoded)."""
    if parser is None or not prompt_ids:
        return False
    tail = tokenizer.decode(text_ids(prompt_ids[-PROMPT_TAIL_IDS:]), skip_special_tokens=False)
    return opens_reasoning(tail, parser)
