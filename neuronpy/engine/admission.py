"""Admission checks: a prompt and its sampling parameters against one model's limits."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from neuronpy.engine.types import SamplingParams, SessionRequest
from neuronpy.errors import InvalidRequestError
from neuronpy.media import Prompt, check_media_ids, media_of


def check_prompt(
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    name: str,
    context_len: int,
    vocab_size: int,
    kv_budget_tokens: int = 0,
    vision: bool = False,
) -> tuple[int, ...]:
    """The prompt as a tuple, or InvalidRequestError naming what does not fit: an empty prompt,
    ids out of the vocabulary, no room in the context for the prompt and max_tokens, a prompt
    larger than the KV budget (0: none), logit_bias or allowed_token_ids ids out of the
    vocabulary."""
    if not isinstance(params, SamplingParams):
        raise TypeError("params must be SamplingParams")
    prompt = prompt_ids if isinstance(prompt_ids, Prompt) else tuple(prompt_ids)
    if not prompt:
        raise InvalidRequestError("the prompt is empty", "prompt")
    media = media_of(prompt)
    if media:
        if not vision:
            raise InvalidRequestError(f"model {name!r} reads no images", "prompt")
        try:
            check_media_ids(prompt, media)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "prompt") from None
    bad = [
        t
        for t in prompt
        if isinstance(t, bool)
        or not isinstance(t, int)
        or not (0 <= t < vocab_size or (bool(media) and t < 0))  # (media ids: checked above)
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


@dataclass(frozen=True)
class Admission:
    """What admitting a request checks it against: one engine's limits and abilities. The
    engine checks with it, and so does a client of an engine in another process before it
    sends anything (engine/remote.py): the same rules, the same messages."""

    name: str
    max_n: int
    max_running: int
    max_queue: int
    context_len: int
    vocab_size: int
    kv_budget_tokens: int
    eos_token_ids: frozenset[int]
    grammar_stop_ids: frozenset[int]  # what ends a complete constrained reply
    sessions: bool  # whether requests may continue from and save into session files
    draft_model: bool  # whether a draft model drafts for this one
    vision: bool = False  # whether it reads images (a vision-language model)

    def check(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        n: int,
        session: SessionRequest | None,
    ) -> tuple[int, ...]:
        """The prompt as a tuple, or InvalidRequestError naming what cannot be admitted: `n`,
        the prompt against the model's limits (check_prompt), a session the request or the
        model cannot have, a draft model the model lacks."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.max_n:
            raise InvalidRequestError(
                f"'n' must be an integer from 1 to {self.max_n}, got {n!r}", "n"
            )
        if n > self.max_running + self.max_queue:
            raise InvalidRequestError(
                f"'n' = {n} copies can never be admitted together: model {self.name!r} runs "
                f"{self.max_running} and queues {self.max_queue}",
                "n",
            )
        prompt = self.check_prompt(prompt_ids, params)
        if session is not None and n != 1:
            raise InvalidRequestError("a request with a 'session' returns one choice (n = 1)", "n")
        if session is not None and not self.sessions:
            raise InvalidRequestError(
                f"model {self.name!r} cannot save or restore sessions (tensor parallel)", "session"
            )
        if params.speculative == "draft" and not self.draft_model:
            raise InvalidRequestError(
                f"model {self.name!r} has no draft model: 'speculative' may be off or ngram",
                "speculative",
            )
        return prompt

    def check_prompt(self, prompt_ids: Sequence[int], params: SamplingParams) -> tuple[int, ...]:
        """The prompt as a tuple, or InvalidRequestError naming what does not fit the model."""
        return check_prompt(
            prompt_ids,
            params,
            name=self.name,
            context_len=self.context_len,
            vocab_size=self.vocab_size,
            kv_budget_tokens=self.kv_budget_tokens,
            vision=self.vision,
        )

    def copies(self, params: SamplingParams, n: int) -> list[SamplingParams]:
        """Each of the n completions' parameters: copy i seeded `seed + i` when a seed is set."""
        return [
            dataclasses.replace(params, seed=params.seed + i)
            if i and params.seed is not None
            else params
            for i in range(n)
        ]

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The tokens that end a reply without becoming text: EOS (unless ignored; a
        constrained reply's grammar allows only its own stop tokens at its end) and the
        request's stop tokens."""
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        if params.constraint is not None:
            eos = self.grammar_stop_ids
        return eos | frozenset(params.stop_token_ids)
