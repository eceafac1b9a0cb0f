"""Constrained decoding: a request's Constraint compiled by xgrammar (its grammar from
constraint_grammar.py), and each request's matcher, which masks its logits row to the tokens
the grammar allows next.

A compiled grammar is shared by every request with the same constraint (a cache bounded in
bytes); a matcher is one request's position in it. The runner fills a matcher's bitmask on the
event loop's thread while the step's forward runs on the worker's; the sampler applies it to
that row's logits after the forward and advances the matcher with the chosen token. Rows
without a constraint never touch any of this.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from neuronpy.defaults import (
    DEFAULT_GRAMMAR_CACHE_BYTES,
    DEFAULT_MAX_COMPILE_BYTES,
    DEFAULT_MAX_COMPILE_SECONDS,
    DEFAULT_MAX_MASK_MS,
)
from neuronpy.engine.compile_child import (
    CAN_FORK,
    CompileCancelled,
    CompileLimitError,
    try_in_child,
)
from neuronpy.engine.constraint_grammar import Reasoning, grammar_of
from neuronpy.engine.types import Constraint
from neuronpy.errors import InvalidRequestError

log = logging.getLogger(__name__)

COMPILE_THREADS = 2
# xgrammar's errors start "[13:03:32] /project/cpp/json_schema_converter.cc:5082: "
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class GrammarError(Exception):
    """A matcher cannot go on: no token is allowed next, or the one chosen was refused."""


class Grammars:
    """Compiles constraints for one model's tokenizer and keeps the compiled grammars, least
    recently used first out, within `cache_bytes`. Thread-safe; compiling blocks, so the
    engine calls `compile` on a thread of its own."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_ids: Sequence[int],
        cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES,
        compile_seconds: float = DEFAULT_MAX_COMPILE_SECONDS,
        compile_bytes: int = DEFAULT_MAX_COMPILE_BYTES,
        token_seconds: float = DEFAULT_MAX_MASK_MS / 1000,
    ) -> None:
        """`compile_seconds` and `compile_bytes` bound one compile (0 seconds: no bound, and
        compiles run on the calling thread); `token_seconds` one request's matcher on one
        token (see Matcher)."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_ids = sorted(stop_ids)
        self.cache_bytes = cache_bytes
        self.compile_seconds_bound = compile_seconds
        self.compile_bytes_bound = compile_bytes
        self.token_seconds = token_seconds
        self._compiler: xgr.GrammarCompiler | None = None  # made on first use (~0.1-1 s)
        self._info: xgr.TokenizerInfo | None = None
        self._lock = threading.Lock()  # the cache's
        self._init_lock = threading.Lock()  # the compiler's making (never held with the other)
        self._cache: OrderedDict[tuple[Constraint, Reasoning | None], xgr.CompiledGrammar] = (
            OrderedDict()
        )
        self._bytes = 0
        self.compiled = 0  # grammars compiled (cache misses)
        self.compile_seconds = 0.0

    @property
    def stop_ids(self) -> frozenset[int]:
        """The tokens that end a constrained reply once its grammar is complete."""
        self._ensure_compiler()
        assert self._info is not None
        return frozenset(self._info.stop_token_ids)

    def warm(self) -> None:
        """Indexes the vocabulary now (blocking: the engine runs it on a thread at start), so
        that the first constrained request does not wait for it."""
        self._ensure_compiler()

    def _ensure_compiler(self) -> xgr.GrammarCompiler:
        with self._init_lock:
            if self._compiler is None:
                self._info = info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer,
                    vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_ids or None,
                )
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=COMPILE_THREADS, cache_enabled=False
                )
                self._vocab_bytes: list[bytes] = list(info.decoded_vocab)
            return self._compiler

    @property
    def cache_bytes_used(self) -> int:
        return self._bytes

    def cached(self, constraint: Constraint, reasoning: Reasoning | None = None) -> bool:
        with self._lock:
            return (constraint, reasoning) in self._cache

    def compile(
        self,
        constraint: Constraint,
        reasoning: Reasoning | None = None,
        cancelled: threading.Event | None = None,
    ) -> xgr.CompiledGrammar:
        """The compiled grammar of `constraint` (cached). `reasoning`: the reply's reasoning
        block, which comes before the constraint (None: none). InvalidRequestError naming the
        constraint's field when it cannot be compiled, or not within the compile's bounds;
        CompileCancelled when `cancelled` is set before it is done."""
        key = (constraint, reasoning)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            compiler = self._ensure_compiler()
        except Exception as exc:  # (xgrammar could not read this tokenizer's vocabulary)
            log.warning("no constrained decoding for this tokenizer: %r", exc)
            raise InvalidRequestError(
                f"'{constraint.param}': this model's tokenizer does not support constrained "
                f"decoding ({type(exc).__name__})",
                constraint.param,
            ) from None
        began = time.perf_counter()
        try:
            grammar = grammar_of(constraint, reasoning)
            compiled = self._compile(compiler, grammar, cancelled)
        except CompileLimitError as exc:
            raise InvalidRequestError(
                f"'{constraint.param}' is too costly to compile: {exc} (this server's bounds: "
                f"max_compile_seconds = {self.compile_seconds_bound:g}, max_compile_bytes = "
                f"{self.compile_bytes_bound})",
                constraint.param,
            ) from None
        except (InvalidRequestError, CompileCancelled):
            raise
        except (RuntimeError, ValueError, TypeError, KeyError) as exc:
            raise _refused(constraint, exc) from None
        seconds = time.perf_counter() - began
        if not _writes_anything(compiled, self.vocab_size):
            raise InvalidRequestError(
                f"'{constraint.param}' allows no text at all: no token can start it (a rule that "
                "only refers to itself, such as left recursion 'root ::= root \"a\"', never "
                "ends)",
                constraint.param,
            )
        size = compiled.memory_size_bytes
        if size > self.cache_bytes:
            raise InvalidRequestError(
                f"'{constraint.param}' compiles to a grammar of {size} bytes, more than this "
                f"server's grammar cache holds ({self.cache_bytes} bytes)",
                constraint.param,
            )
        log.debug("compiled a %s constraint in %.3f s (%d bytes)", constraint.kind, seconds, size)
        with self._lock:
            self.compiled += 1
            self.compile_seconds += seconds
            if key not in self._cache:
                self._cache[key] = compiled
                self._bytes += size
            while self._bytes > self.cache_bytes and len(self._cache) > 1:
                _, evicted = self._cache.popitem(last=False)
                self._bytes -= evicted.memory_size_bytes
        return compiled

    def _compile(
        self,
        compiler: xgr.GrammarCompiler,
        grammar: xgr.Grammar,
        cancelled: threading.Event | None,
    ) -> xgr.CompiledGrammar:
        """`grammar` compiled, once a child process has compiled it within the bounds (see
        compile_child.py; without them, at once)."""
        if CAN_FORK and self.compile_seconds_bound > 0:
            info = self._info
            assert info is not None
            # (a compiler of its own: the parent's thread pool has no threads in the child)
            try_in_child(
                lambda: xgr.GrammarCompiler(
                    info, max_threads=COMPILE_THREADS, cache_enabled=False
                ).compile_grammar(grammar),
                self.compile_seconds_bound,
                self.compile_bytes_bound,
                cancelled,
            )
        return compiler.compile_grammar(grammar)

    def matcher(self, constraint: Constraint, reasoning: Reasoning | None = None) -> Matcher:
        """A fresh matcher at the start of `constraint`'s grammar."""
        compiled = self.compile(constraint, reasoning)
        self._ensure_compiler()
        return Matcher(
            compiled, self.vocab_size, self.token_seconds, self.encode, self._vocab_bytes
        )

    def encode(self, text: str) -> list[int]:
        """`text`'s tokens as the tokenizer gives them (no special tokens added): the Rust
        tokenizer's own encode where there is one (it reads no settings that another thread's
        call might be changing)."""
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return list(backend.encode(text, add_special_tokens=False).ids)
        with self._lock:
            return list(self._tokenizer.encode(text, add_special_tokens=False))


def _writes_anything(compiled: xgr.CompiledGrammar, vocab_size: int) -> bool:
    """Whether a reply can start at all: some token (the end of the reply included, where the
    grammar accepts the empty text) is allowed first. A grammar that allows none would fail its
    request at its first step, after admission."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


class Matcher:
    """One request's place in its grammar. `fill_ahead` (any thread, never waits) computes the
    next token's bitmask; `mask` (the sampling thread) applies it, computing it first if
    nobody has; `accept` advances by the chosen token. A lock keeps the three apart.

    The lockstep batch waits for every row's mask, so one row's matcher must not set the pace:
    one whose work on a token (its mask and its advance) takes more than `token_seconds` twice
    in a row stops, and its next mask is a GrammarError (that row ends; the others go on). Twice,
    so that one stall of the machine does not end a request; the work of a grammar that grows
    with every token (nested unbounded repetition) only grows."""

    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        vocab_size: int,
        token_seconds: float = math.inf,
        encode: Callable[[str], list[int]] | None = None,
        vocab: Sequence[bytes] | None = None,
    ) -> None:
        """`encode` (text to tokens) and `vocab` (each token's bytes): the tokenizer's, for
        jump-forward (None: no jump-forward)."""
        self._matcher = xgr.GrammarMatcher(compiled)
        self._encode = encode
        self._vocab = vocab
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._vocab_size = vocab_size
        self._lock = threading.Lock()
        self._filled = False
        self.filled_ahead = 0  # masks computed while a forward ran (for the bench)
        self.token_seconds = token_seconds
        self._spent = 0.0  # seconds of work on the current token so far
        self._slow = 0  # tokens in a row that took longer than token_seconds
        self._stopped: str | None = None  # why it stopped (too slow)

    def fill_ahead(self) -> None:
        if self._filled or not self._lock.acquire(blocking=False):
            return
        try:
            if not self._filled and self._stopped is None and not self._matcher.is_terminated():
                self._fill()
                self.filled_ahead += 1
        finally:
            self._lock.release()

    def _fill(self) -> None:
        began = time.perf_counter()
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._spent += time.perf_counter() - began
        self._filled = True

    def _check(self) -> None:
        if self._stopped is not None:
            raise GrammarError(self._stopped)
        if self._matcher.is_terminated():
            raise GrammarError("the reply's grammar is complete and allows no more tokens")

    def mask(self, logits: torch.Tensor) -> None:
        """Sets the logits ([vocab] float32, a copy) of tokens the grammar forbids to -inf;
        GrammarError when it forbids every one, or the matcher stopped (too slow)."""
        with self._lock:
            self._check()
            if not self._filled:
                self._fill()
            width = min(logits.shape[0], self._vocab_size)
            xgr.apply_token_bitmask_inplace(logits[:width], self._bitmask[0])
            if logits.shape[0] > width:
                logits[width:] = float("-inf")
        if not torch.isfinite(logits.max()):
            raise GrammarError("the reply's grammar allows no token the model can write next")

    def allows(self, token: int) -> bool:
        """Whether the grammar allows `token` next (a greedy row whose plain argmax it allows
        needs no mask: the masked argmax is that token)."""
        with self._lock:
            if self._stopped is not None or self._matcher.is_terminated():
                return False
            if not self._filled:
                self._fill()
            if not 0 <= token < self._vocab_size:
                return False
            return bool((int(self._bitmask[0, token >> 5]) >> (token & 31)) & 1)

    def accept(self, token: int) -> None:
        with self._lock:
            self._filled = False
            began = time.perf_counter()
            accepted = self._matcher.accept_token(token)
            spent, self._spent = self._spent + time.perf_counter() - began, 0.0
            self._slow = self._slow + 1 if spent > self.token_seconds else 0
            if self._slow >= 2:
                self._stopped = (
                    f"the constraint took {spent * 1000:.3g} ms for one token, past this "
                    f"server's bound of {self.token_seconds * 1000:g} ms (max_mask_ms): its "
                    "work grows with every token (nested unbounded repetition, such as "
                    "(a+)* or (\\w+\\s*)*, does)"
                )
            if not accepted:
                raise GrammarError(f"the reply's grammar refused token {token}")

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the first, the grammar allows in a row from here (the
        matcher is left where it was)."""
        with self._lock:
            n = 0
            for token in tokens:
                if self._matcher.is_terminated() or not self._matcher.accept_token(token):
                    break
                n += 1
            if n:
                self._matcher.rollback(n)
            return n

    @property
    def complete(self) -> bool:
        return self._matcher.is_terminated()

    def jump_forward(self, last: int | None = None) -> tuple[int, ...]:
        """The tokens of the text the grammar allows next and nothing else (a forced tool
        call's fixed markup, a schema's keys and punctuation), as the tokenizer writes that
        text: the reply then carries them rather than the model's spelling of them, one
        character at a time when it would never write them of its own accord. A token is
        forced only where every token the grammar allows there lies within the text: where one
        reaches past it (`"Paris` past `"`, `<tool_call>` past `<t`) the model chooses, as the
        tokenizer would join the text to what follows. Nothing is forced where the tokenizer
        would join the text's first token to the reply's `last` token. Empty where there is no
        such text (or no tokenizer)."""
        if self._encode is None or self._vocab is None:
            return ()
        with self._lock:
            if self._stopped is not None or self._matcher.is_terminated():
                return ()
            text = self._matcher.find_jump_forward_string()
        if not text:
            return ()
        tokens = self._encode(text)
        if last is not None and not self._joins_after(last, text, tokens):
            return ()
        return self._within(text.encode("utf-8"), tokens)

    def _within(self, text: bytes, tokens: list[int]) -> tuple[int, ...]:
        """The first of `tokens` (`text`'s) that the grammar allows, each where every token it
        allows lies within the rest of `text` (the matcher is left where it was)."""
        assert self._vocab is not None
        vocab = self._vocab
        mask = xgr.allocate_token_bitmask(1, self._vocab_size)
        taken: list[int] = []
        with self._lock:
            try:
                for token in tokens:
                    self._matcher.fill_next_token_bitmask(mask)
                    bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")
                    allowed = np.flatnonzero(bits[: self._vocab_size])
                    if token not in allowed or any(
                        a >= len(vocab) or not text.startswith(vocab[a]) for a in allowed.tolist()
                    ):
                        break
                    if not self._matcher.accept_token(token):
                        break
                    taken.append(token)
                    text = text[len(vocab[token]) :]
            finally:
                if taken:
                    self._matcher.rollback(len(taken))
        return tuple(taken)

    def _joins_after(self, last: int, text: str, tokens: list[int]) -> bool:
        """Whether `tokens` (`text`'s) are what the tokenizer gives after the token `last`
        when the two texts are written together (its first token not joined to `last`)."""
        assert self._encode is not None and self._vocab is not None
        if not 0 <= last < len(self._vocab):
            return False
        try:
            head = self._vocab[last].decode("utf-8")
        except UnicodeDecodeError:
            return False
        together = self._encode(head + text)
        return together[: 1 + len(tokens)] == [last, *tokens]


def _refused(c: Constraint, exc: Exception) -> InvalidRequestError:
    why = _LOCATION.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else "")
    noun = {"regex": "regex", "grammar": "grammar"}.get(c.kind, "schema")
    return InvalidRequestError(f"'{c.param}': the {noun} cannot be compiled ({why[:300]})", c.param)
