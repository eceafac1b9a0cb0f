"""Per-request sampling from one CPU logits row: penalties, temperature, top-k, top-p, min-p."""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import secrets
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from neuronpy.engine.grammar import Matcher
from neuronpy.engine.types import SamplingParams, TokenLogprob
from neuronpy.media import text_ids
from neuronpy.worker.draw import DraftSampling, Truncation, distribution, draw, generator_of


class Sampler:
    """Chooses one request's tokens and keeps the history its penalties need.

    Every draw uses the request's own torch.Generator and its own logits row only, so a
    seeded request gets the same tokens alone or in any batch.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        vocab_size: int,
        matcher: Matcher | None = None,
    ) -> None:
        """`matcher`: the request's constraint (its logits are masked to what the grammar
        allows, before anything else)."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        prompt = text_ids([int(t) for t in prompt_ids])  # (an image's tokens as its placeholder)
        if any(t < 0 for t in prompt):
            raise ValueError("prompt ids must be non-negative")
        self.params = params
        self.matcher = matcher
        self.output_ids: list[int] = []
        # the tokens the grammar forces next (jump-forward: Matcher.jump_forward), chosen
        # without the logits; None: not worked out since the last token
        self._forced: list[int] | None = None
        self._greedy = params.greedy
        self._repetition = params.repetition_penalty != 1.0
        self._frequency = params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        self._bias = bool(params.logit_bias)
        self._bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        self._bias_values = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
        allowed = params.allowed_token_ids
        self._allowed = None if allowed is None else torch.tensor(sorted(set(allowed)))
        # the last step's tokens', when params.logprobs (one, or a verify step's several)
        self._logprobs: list[TokenLogprob] = []
        # a draft model's distributions of the drafts of the next verify step, in order
        self._draft_probs: list[torch.Tensor] = []
        self._min_vocab = max(vocab_size, max(prompt, default=-1) + 1)
        # Incremental state, so that a step costs O(distinct ids seen), not O(history). The
        # sets answer "new id?" without reading a tensor; the id tensors index the logits.
        self._seen = set(prompt)  # prompt and generated ids (repetition penalty)
        self._seen_ids = torch.tensor(sorted(self._seen), dtype=torch.long)
        self._generated: set[int] = set()  # generated ids (frequency and presence penalties)
        self._generated_ids = torch.empty(0, dtype=torch.long)
        # [vocab] count per id; made on first use (on the thread that samples, not this one)
        self._counts = torch.empty(0, dtype=torch.float32)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._generator = generator_of(seed)
        self._truncation = Truncation(
            params.greedy, params.temperature, params.top_k, params.top_p, params.min_p
        )

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no penalty: the token is the row's argmax (rows can share one argmax),
        unless the row's constraint forbids it (see `take_argmax`)."""
        masked = self._bias or self._allowed is not None
        return self._greedy and not (self._repetition or self._frequency or masked)

    @property
    def forced(self) -> tuple[int, ...]:
        """The tokens the request's grammar allows next and nothing else, as the tokenizer
        writes them (Matcher.jump_forward): they are the next tokens whatever the logits say,
        and the engine feeds them all in its next step (as drafts that stand)."""
        if self._forced is None:
            if self.matcher is None:
                self._forced = []
            else:
                last = self.output_ids[-1] if self.output_ids else None
                self._forced = list(self.matcher.jump_forward(last))
        return tuple(self._forced)

    def take_argmax(self, token: int) -> bool:
        """For a plain greedy row whose raw argmax is `token`: records it and answers True
        when the row's constraint (if any) allows it, which makes it the masked argmax too
        (the first maximum among the allowed ids); False: the row needs its mask, or its
        grammar forces the token (`sample` takes it)."""
        if self.matcher is not None and (self.forced or not self.matcher.allows(token)):
            return False
        self._record(token)
        return True

    def sample(self, logits: torch.Tensor) -> int:
        """Choose the next token from `logits` ([vocab] CPU), record it and return it."""
        if self.matcher is not None and self.forced:
            self._check(logits)
            return self._chosen(self.forced[0])
        if self.plain_greedy:
            token = int(torch.argmax(self._check(logits)))
            if self.take_argmax(token):
                return token
            token = int(torch.argmax(self.penalize(logits)))
        elif self._greedy:
            token = int(torch.argmax(self.penalize(logits)))
        else:
            token = self._draw(self.probs(logits))
        self._record(token)
        return token

    def penalize(self, logits: torch.Tensor) -> torch.Tensor:
        """A float32 copy of `logits`, masked to what the request's grammar or its
        allowed_token_ids allow (first), with the logit_bias, then the repetition, frequency
        and presence penalties."""
        out = self._check(logits).to(torch.float32, copy=True)
        p = self.params
        if self.matcher is not None:
            self.matcher.mask(out)
        if self._allowed is not None:
            kept = out[self._allowed]
            out.fill_(-math.inf)
            out[self._allowed] = kept
        if self._bias:
            out[self._bias_ids] += self._bias_values
        if self._repetition:
            ids = self._seen_ids
            vals = out[ids]
            # CTRL / HF style: a seen id's logit moves toward zero if positive, away if not.
            pen = p.repetition_penalty
            out[ids] = torch.where(vals > 0, vals / pen, vals * pen)
        if self._frequency:
            ids = self._generated_ids
            out[ids] -= p.frequency_penalty * self._counts[ids] + p.presence_penalty
        return out

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The [vocab] distribution `sample` draws from (one-hot at the argmax when greedy)."""
        return self._distribution(self.penalize(logits))

    def draft_sampling(self) -> DraftSampling | None:
        """How the draft model draws this request's drafts of its next draft job (on the
        worker thread, from plain data): with this request's temperature and truncation (no
        penalty, bias or grammar: the verify step applies them to the target's logits), from a
        generator seeded by its own; None when greedy (the draft model's argmax). Forgets the
        draft distributions of a verify step that did not reach them (a draft rejected)."""
        self.end_verify()
        if self._greedy:
            return None
        seed = int(torch.randint(0, 2**62, (1,), generator=self._generator))
        return DraftSampling(self._truncation, seed)

    def drafted(self, probs: Sequence[torch.Tensor]) -> None:
        """The draft distributions its draft job drew its drafts from, in order, kept for the
        verify step (`verify`)."""
        self._draft_probs = list(probs)

    def _distribution(self, x: torch.Tensor) -> torch.Tensor:
        """x: a float32 copy of penalized logits, changed in place."""
        return distribution(x, self._truncation)

    def verify(self, logits: torch.Tensor, draft: int) -> int:
        """The token at a position whose drafted token is `draft` ([vocab] logits of the
        target there), recorded: `draft` itself when it stands, else the target's own choice.
        Greedy: the token this sampler would choose (so the draft stands exactly when it is
        that token). Sampled, with a draft that had all its drafter's probability: it stands
        with the target's probability p(draft); else the token is drawn from p without it,
        renormalized (speculative sampling's rule for a one-hot draft distribution), so the
        token is distributed exactly as `sample` draws it."""
        if self._greedy or (self.matcher is not None and self.forced):
            return self.sample(logits)
        probs = self.probs(logits)
        q = self._draft_probs.pop(0) if self._draft_probs else None
        if not 0 <= draft < probs.shape[0]:
            return self._chosen(self._draw(probs))
        u = float(torch.rand(1, generator=self._generator, dtype=torch.float64))
        if q is None:  # the drafter's whole probability on the draft (prompt lookup)
            if u < float(probs[draft]):
                return self._chosen(draft)
            probs[draft] = 0.0
        else:  # a draft model's distribution q: it stands with probability min(1, p/q)
            q = _fit(q, probs.shape[0])
            if u * float(q[draft]) < float(probs[draft]):
                return self._chosen(draft)
            probs = (probs - q).clamp_(min=0.0)  # the rest is drawn from max(0, p - q)
        if not float(probs.sum()) > 0.0:  # (p was all where q is: u < 1 accepted it)
            return self._chosen(draft)
        return self._chosen(self._draw(probs))

    def end_verify(self) -> None:
        """Forgets draft distributions a verify step did not reach (a draft rejected)."""
        self._draft_probs.clear()

    def _chosen(self, token: int) -> int:
        self._record(token)
        return token

    def _draw(self, probs: torch.Tensor) -> int:
        return draw(probs, self._generator)

    def _check(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dim() != 1:
            raise ValueError(f"expected one logits row, got shape {tuple(logits.shape)}")
        if logits.shape[0] < self._min_vocab:
            raise ValueError(f"{logits.shape[0]} logits for a vocabulary of {self._min_vocab}")
        return logits

    def record(self, token: int) -> None:
        """Note a token chosen for this request elsewhere."""
        self._record(token)

    def take_logprob(self) -> TokenLogprob | None:
        """The log-probabilities of the token chosen last (once), when the request asked."""
        logprobs = self.take_logprobs()
        return logprobs[-1] if logprobs else None

    def take_logprobs(self) -> list[TokenLogprob]:
        """The log-probabilities of the last step's tokens (once), when the request asked."""
        logprobs, self._logprobs = self._logprobs, []
        return logprobs

    def _record(self, token: int) -> None:
        if self.matcher is not None:
            self.matcher.accept(token)
            forced = self._forced
            self._forced = forced[1:] if forced and forced[0] == token else None
        self.output_ids.append(token)
        if self._frequency:
            if not self._counts.numel():
                self._counts = torch.zeros(self._min_vocab, dtype=torch.float32)
            if token >= self._counts.numel():
                # The model's vocabulary may be padded past the tokenizer's.
                grow = token + 1 - self._counts.numel()
                self._counts = torch.cat([self._counts, self._counts.new_zeros(grow)])
            self._counts[token] += 1
            if token not in self._generated:
                self._generated.add(token)
                self._generated_ids = torch.cat([self._generated_ids, torch.tensor([token])])
        if self._repetition and token not in self._seen:
            self._seen.add(token)
            self._seen_ids = torch.cat([self._seen_ids, torch.tensor([token])])


_serial = threading.local()


def serial_ops_here() -> None:
    """Makes the calling thread's tensor operations run on it alone, from now on (once per
    thread). The engine's thread samples while the device worker waits, and any thread that
    runs a parallel operation keeps an OpenMP team of its own: with the worker's team that is
    more threads than cores, and libgomp then sleeps between operations rather than spin, which
    made every decode step slower. OpenMP's thread count is the calling thread's own setting,
    so this thread's operations go serial while the worker's stay parallel. (torch's own
    set_num_threads would change every thread started after it.)"""
    if getattr(_serial, "done", False):
        return
    _serial.done = True
    set_threads = _omp_set_num_threads()
    if set_threads is not None:
        torch.get_num_threads()  # (torch sets a thread's count on its first use: first that)
        set_threads(1)


@functools.cache
def _omp_set_num_threads() -> ctypes._CFuncPtr | None:
    """The OpenMP runtime's omp_set_num_threads, of the runtime torch runs on (None: none
    found, as in a build without OpenMP)."""
    names = ("libgomp", "libomp", "libiomp5")
    own = Path(torch.__file__).parent / "lib"
    loaded = []
    maps = Path("/proc/self/maps")
    if maps.exists():
        for line in maps.read_text().splitlines():
            path = Path(line.rsplit(" ", 1)[-1])
            if any(path.name.startswith(n) for n in names):
                loaded.append(path)
    # torch's own runtime first, where it ships one (another library's may be loaded too)
    loaded.sort(key=lambda path: path.parent != own)
    loaded += [p for n in names for p in own.glob(f"{n}*")]
    for path in dict.fromkeys(loaded):
        try:
            return ctypes.CDLL(str(path)).omp_set_num_threads
        except (OSError, AttributeError):
            continue
    return None


def sample_rows(
    samplers: Sequence[Sampler | None],
    logits: torch.Tensor,
    errors: dict[int, Exception] | None = None,
    argmax: Sequence[int] | None = None,
) -> list[int | None]:
    """One token per row of `logits` ([B, vocab] CPU) from that row's sampler (None: skip the
    row). Plain greedy rows share one argmax over their rows, the same tokens as row by row;
    `argmax` given: each row's, computed where the logits were (the device worker's thread).

    `errors` given: a row whose sampler raises (its parameters or its data) gets no token and
    its exception there, by row, and the other rows are sampled as ever; else the error
    propagates."""
    if logits.dim() != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"{len(samplers)} samplers for logits of shape {tuple(logits.shape)}")
    tokens: list[int | None] = [None] * len(samplers)
    live = list(samplers)

    def failed(i: int, exc: Exception) -> None:
        if errors is None:
            raise exc
        errors[i] = exc
        live[i] = None
        tokens[i] = None

    greedy = [i for i, s in enumerate(samplers) if s is not None and s.plain_greedy]
    if greedy and (argmax is not None or len(greedy) > 1):
        if argmax is not None:
            found = [argmax[i] for i in greedy]
        else:
            rows = logits if len(greedy) == len(samplers) else logits[greedy]
            found = rows.argmax(dim=-1).tolist()
        for i, token in zip(greedy, found, strict=True):
            sampler = samplers[i]
            assert sampler is not None
            try:
                sampler._check(logits[i])
                if sampler.take_argmax(token):
                    tokens[i] = token
            except Exception as exc:
                failed(i, exc)
    for i, sampler in enumerate(samplers):
        if sampler is not None and tokens[i] is None and live[i] is not None:
            try:
                tokens[i] = sampler.sample(logits[i])
            except Exception as exc:
                failed(i, exc)
    emitted = [None if t is None else (t,) for t in tokens]
    _record_logprobs(live, logits, emitted, range(len(tokens)))
    return tokens


def verify_rows(
    samplers: Sequence[Sampler | None],
    logits: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    errors: dict[int, Exception] | None = None,
    argmax: Sequence[int] | None = None,
) -> list[tuple[int, ...] | None]:
    """Each row's tokens from a verify step: `logits` [N, vocab] holds row b's 1 + len(
    drafts[b]) rows one after another (after its fed token, after each draft). A row emits
    its drafts while they stand, then the token the target chose where one did not (or one
    more after the last): 1 to 1 + len(drafts[b]) tokens, each chosen by the row's sampler
    exactly as one-token steps would (greedy: the same tokens; sampled: the same distribution).
    Rows without drafts are sampled as `sample_rows` does. `errors`, `argmax`: as
    `sample_rows`."""
    counts = [1 + len(d) for d in drafts]
    if logits.dim() != 2 or logits.shape[0] != sum(counts) or len(samplers) != len(drafts):
        raise ValueError(f"{len(samplers)} rows' {counts} tokens for logits {tuple(logits.shape)}")
    greedy = any(s is not None and s.plain_greedy for s in samplers)
    if argmax is None:
        argmax = logits.argmax(dim=-1).tolist() if greedy else []
    out: list[tuple[int, ...] | None] = []
    at = 0
    for i, (sampler, row_drafts) in enumerate(zip(samplers, drafts, strict=True)):
        n = 1 + len(row_drafts)
        if sampler is None:
            out.append(None)
            at += n
            continue
        try:
            sampler._check(logits[at])
            tokens: list[int] = []
            for j in range(n):
                row = logits[at + j]
                if sampler.plain_greedy and sampler.take_argmax(argmax[at + j]):
                    token = argmax[at + j]
                elif j < len(row_drafts):
                    token = sampler.verify(row, row_drafts[j])
                else:
                    token = sampler.sample(row)
                tokens.append(token)
                if j == len(row_drafts) or token != row_drafts[j]:
                    break
        except Exception as exc:
            if errors is None:
                raise
            errors[i] = exc
            out.append(None)
        else:
            out.append(tuple(tokens))
        finally:
            sampler.end_verify()
        at += n
    starts = list(itertools.accumulate(counts, initial=0))[:-1]
    _record_logprobs(samplers, logits, out, starts)
    return out


def _logprobs(
    samplers: Sequence[Sampler], logits: torch.Tensor, tokens: Sequence[int]
) -> list[TokenLogprob]:
    """The TokenLogprob of tokens[i] from logits row i, with samplers[i]'s count of top ids."""
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [W, vocab]
    chosen = torch.tensor([[t] for t in tokens], dtype=torch.long)
    picked = logp.gather(1, chosen)[:, 0].tolist()
    counts = [s.params.logprobs or 0 for s in samplers]
    k = min(max(counts), logp.shape[1])
    top_values, top_ids = torch.topk(logp, k, dim=-1) if k else (logp[:, :0], chosen[:, :0])
    return [
        TokenLogprob(
            int(chosen[row, 0]),
            picked[row],
            tuple(zip(top_ids[row, :n].tolist(), top_values[row, :n].tolist(), strict=True)),
        )
        for row, n in enumerate(counts)
    ]


def _record_logprobs(
    samplers: Sequence[Sampler | None],
    logits: torch.Tensor,
    emitted: Sequence[tuple[int, ...] | None],
    starts: Sequence[int],
) -> None:
    """For the rows whose request asked: each emitted token's log-probability and its logits
    row's most likely ids, from a log-softmax of the raw logits row the token was chosen from
    (vLLM's default, raw_logprobs): row b's tokens from rows starts[b], starts[b] + 1, ...
    Costs nothing when no row asked."""
    owners = [
        (sampler, start + j, token)
        for sampler, tokens, start in zip(samplers, emitted, starts, strict=True)
        if sampler is not None and tokens and sampler.params.logprobs is not None
        for j, token in enumerate(tokens)
    ]
    if not owners:
        return
    asking = [s for s, _, _ in owners]
    found = _logprobs(asking, logits[[p for _, p, _ in owners]], [t for _, _, t in owners])
    for sampler in dict.fromkeys(asking):
        sampler._logprobs = [lp for s, lp in zip(asking, found, strict=True) if s is sampler]


def _fit(q: torch.Tensor, size: int) -> torch.Tensor:
    """A draft distribution over the target's vocabulary (a draft model's may be padded
    differently: ids past either's have no probability)."""
    if q.shape[0] == size:
        return q
    if q.shape[0] > size:
        return q[:size]
    return torch.cat([q, q.new_zeros(size - q.shape[0])])
