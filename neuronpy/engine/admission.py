"""Admission checks: a prompt and its sampling parameters against one model's limits."""

from __future__ import annotations

from collections.abc import Sequence

from neuronpy.engine.types import SamplingParams
from neuronpy.errors import InvalidRequestError


def check_prompt(
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    name: str,
    context_len: int,
    vocab_size: int,
    kv_budget_tokens: int = 0,
) -> tuple[int, ...]:
    """The prompt as a tuple, or InvalidRequestError naming what does not fit: an empty prompt,
    ids out of the vocabulary, no room in the context for the prompt and max_tokens, a prompt
    larger than the KV budget (0: none), logit_bias or allowed_token_ids ids out of the
    vocabulary."""
    if not isinstance(params, SamplingParams):
        raise TypeError("params must be SamplingParams")
    prompt = tuple(prompt_ids)
    if not prompt:
        raise InvalidRequestError("the prompt is empty", "prompt")
    bad = [
        t
        for t in prompt
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size
    ]
    if bad:
        raise InvalidRequestError(
            f"prompt token ids out of the vocabulary [0, {vocab_size}): {bad[:10]}",
            "prompt",
        )
    if len(prompt) >= context_len:
        raise InvalidRequestError(
            f"the prompt has {len(prompt)} tokens; this model's context is "
            f"{context_len} tokens, and at least one must be left to generate",
            "prompt",
        )
    if len(prompt) + params.max_tokens > context_len:
        raise InvalidRequestError(
            f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
            f"this model's context of {context_len} tokens",
            "max_tokens",
        )
    if kv_budget_tokens and len(prompt) + 1 > kv_budget_tokens:
        raise InvalidRequestError(
            f"the prompt has {len(prompt)} tokens; model {name!r} keeps at most "
            f"{kv_budget_tokens} tokens of KV (kv_budget)",
            "prompt",
        )
    biased = [t for t, _ in params.logit_bias if t >= vocab_size]
    if biased:
        raise InvalidRequestError(
            f"'logit_bias' token ids out of the vocabulary [0, {vocab_size}): {biased[:20]}",
            "logit_bias",
        )
    outside = [t for t in params.allowed_token_ids or () if t >= vocab_size]
    if outside:
        raise InvalidRequestError(
            f"'allowed_token_ids' holds ids out of the vocabulary [0, {vocab_size}): "
            f"{outside[:20]}",
            "allowed_token_ids",
        )
    return prompt
