"""Constrained decoding: a request's Constraint compiled by xgrammar, and each request's
matcher, which masks its logits row to the tokens the grammar allows next.

A compiled grammar is shared by every request with the same constraint (a cache bounded in
bytes); a matcher is one request's position in it. The runner fills a matcher's bitmask on the
event loop's thread while the step's forward runs on the worker's; the sampler applies it to
that row's logits after the forward and advances the matcher with the chosen token. Rows
without a constraint never touch any of this.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

try:  # the regex parser of Python's re module (3.11+; sre_parse before)
    import re._parser as _sre  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    import sre_parse as _sre  # type: ignore[no-redef]

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
from neuronpy.engine.reasoning import REASONING_MARKERS
from neuronpy.engine.tools import TOOL_CALL_END, TOOL_CALL_START
from neuronpy.engine.types import Constraint
from neuronpy.errors import InvalidRequestError

log = logging.getLogger(__name__)

MAX_SCHEMA_DEPTH = 32  # nesting of a JSON Schema's objects and arrays
# Counted repetition nested in counted repetition, (x{1,50}){1,50}, compiles in time that grows
# far faster than the product of the counts (that one: 75 s on this 2-core machine, 16x16:
# 0.04 s). A product above this is refused.
MAX_NESTED_REPETITION = 1024
_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")
_REPEATS = (_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", None))
_ATOMIC = getattr(_sre, "ATOMIC_GROUP", None)  # (Python 3.11+)
COMPILE_THREADS = 2
# xgrammar's errors start "[13:03:32] /project/cpp/json_schema_converter.cc:5082: "
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")

# A reply's reasoning block before its constraint: (the reasoning parser, whether the prompt
# opened the block, so that the reply starts inside it); None: the reply has none.
Reasoning = tuple[str, bool]


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
            grammar = _grammar(constraint)
            if reasoning is not None:
                grammar = _after_reasoning(grammar, *reasoning)
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
        return Matcher(self.compile(constraint, reasoning), self.vocab_size, self.token_seconds)


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
        self, compiled: xgr.CompiledGrammar, vocab_size: int, token_seconds: float = math.inf
    ) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
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
                    f"the constraint took {spent * 1000:.0f} ms for one token, past this "
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


# ---- constraint -> grammar ----------------------------------------------------------------------


def _nested_repetition(text: str, quoted: bool = False) -> int:
    """The largest product of counted repetitions nested in one another in a regex (or, with
    `quoted`, an EBNF grammar, whose "..." literals are skipped)."""
    stack, last, worst, i = [1], 1, 1, 0
    while i < len(text):
        c = text[i]
        count = _COUNT.match(text, i)
        if count is not None:
            bound = max(1, int(count.group(2) or count.group(1)))
            if last > 1:  # a counted group holding counted repetition
                worst = max(worst, last * bound)
            stack[-1] = max(stack[-1], last * bound)
            last, i = 1, count.end()
            continue
        if c == "\\":
            i += 2
        elif c == "[":
            i += 1
            while i < len(text) and text[i] != "]":
                i += 2 if text[i] == "\\" else 1
            i += 1
        elif quoted and c == '"':
            i += 1
            while i < len(text) and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
        elif c == "(":
            stack.append(1)
            i += 1
            continue
        elif c == ")" and len(stack) > 1:
            last = stack.pop()
            i += 1
            continue
        else:
            i += 1
        last = 1
    return worst


def _check_repetition(text: str, param: str, quoted: bool = False) -> None:
    if _nested_repetition(text, quoted) > MAX_NESTED_REPETITION:
        raise InvalidRequestError(
            f"'{param}' nests counted repetitions whose counts multiply past "
            f"{MAX_NESTED_REPETITION} (such as (x{{1,50}}){{1,50}}): it would take too long to "
            "compile",
            param,
        )


def _check_regex(text: str, param: str) -> None:
    """A regex's repetitions checked before it is compiled: counted ones nested past
    MAX_NESTED_REPETITION, and unbounded repetition of what may be empty or is itself one
    unbounded repetition ((a*)*, (a?b*)+, (a+)+): the same language as without the outer one,
    and a matcher whose work on each token grows with the tokens before it (by the hundredth,
    (a*)* takes 500 ms a token on a 49k vocabulary), so refused by name."""
    _check_repetition(text, param)
    found = _redundant_repeat(text)
    if found is not None:
        raise InvalidRequestError(
            f"'{param}' repeats without bound a part that {found}, such as (a*)* or (a+)+: "
            "write the inner repetition alone (the same text matches); nested like this, "
            "matching it grows slower with every token",
            param,
        )


def _redundant_repeat(pattern: str) -> str | None:
    """How an unbounded repetition in `pattern` is redundant ("may be empty", "is itself an
    unbounded repetition"), or None (none is, or Python's regex parser, whose syntax is
    nearly the one xgrammar reads, cannot parse it: the run-time bound is then the guard)."""
    try:
        tree = _sre.parse(pattern)
        stack = [list(tree)]
        while stack:
            for op, arg in stack.pop():
                if op in _REPEATS:
                    _, high, body = arg
                    if high == _sre.MAXREPEAT and _nullable(body):
                        return "may be empty"
                    if high == _sre.MAXREPEAT and _one_unbounded(body):
                        return "is itself an unbounded repetition"
                    stack.append(list(body))
                elif op == _sre.SUBPATTERN:
                    stack.append(list(arg[-1]))
                elif op == _sre.BRANCH:
                    stack.extend(list(b) for b in arg[1])
                elif op == _ATOMIC:
                    stack.append(list(arg))
    except Exception:  # (re.error, RecursionError, and what else a private parser may raise)
        return None
    return None


def _nullable(items: Any) -> bool:
    """Whether a parsed regex sequence matches the empty text."""
    for op, arg in items:
        if op in _REPEATS:
            if arg[0] > 0 and not _nullable(arg[2]):
                return False
        elif op == _sre.SUBPATTERN:
            if not _nullable(arg[-1]):
                return False
        elif op == _ATOMIC:
            if not _nullable(arg):
                return False
        elif op == _sre.BRANCH:
            if not any(_nullable(b) for b in arg[1]):
                return False
        elif op not in (_sre.AT, _sre.ASSERT, _sre.ASSERT_NOT):
            return False  # a character (or a back-reference: not counted as empty)
    return True


def _one_unbounded(items: Any) -> bool:
    """Whether a parsed regex sequence is one unbounded repetition (in groups or not)."""
    while len(items) == 1 and items[0][0] in (_sre.SUBPATTERN, _ATOMIC):
        op, arg = items[0]
        items = arg[-1] if op == _sre.SUBPATTERN else arg
    return len(items) == 1 and items[0][0] in _REPEATS and items[0][1][1] == _sre.MAXREPEAT


def _patterns(schema: Any) -> list[str]:
    """Every regex in a JSON Schema: `pattern` values and `patternProperties` keys."""
    found, stack = [], [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("pattern"), str):
                found.append(item["pattern"])
            if isinstance(item.get("patternProperties"), dict):
                found.extend(item["patternProperties"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _grammar(c: Constraint) -> xgr.Grammar:
    if c.kind == "json_object":
        return _json_grammar('{"type": "object"}', strict=False)
    if c.kind == "json_schema":
        return _json_grammar(_schema(c.spec, c.param))
    if c.kind == "regex":
        _check_regex(c.spec, c.param)
        return xgr.Grammar.from_regex(c.spec)
    if c.kind == "choice":
        literals = " | ".join(_literal(choice) for choice in c.choices)
        return xgr.Grammar.from_ebnf(f"root ::= {literals}")
    if c.kind == "grammar":
        _check_repetition(c.spec, c.param, quoted=True)
        return xgr.Grammar.from_ebnf(c.spec)
    assert c.kind == "tools"
    return _tool_calls(c)


# xgrammar (0.2.9) writes a string with minLength/maxLength as characters of this class, which
# lets control characters through (JSON forbids them unescaped): such a string is then refused
# by any strict JSON parser. Ours keeps them out (and escapes, as xgrammar's does).
_LOOSE_CHARACTER = r"[^\"\\\r\n]"
_JSON_CHARACTER = r"[^\0-\x1f\"\\]"


def _json_grammar(schema: str, strict: bool = True) -> xgr.Grammar:
    """The grammar of JSON text valid against `schema`, compact (one space after `:` and
    `,`, no newlines: small models otherwise loop on whitespace)."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    text = str(grammar)
    if _LOOSE_CHARACTER not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHARACTER, _JSON_CHARACTER))


def _schema(text: str, param: str) -> str:
    """A JSON Schema's text, checked: valid JSON, an object (or a boolean), not too deep, no
    regex in it too slow to compile."""
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):
        raise InvalidRequestError(f"'{param}' is not valid JSON", param) from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(f"'{param}' must be a JSON Schema object", param)
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(f"'{param}' nests deeper than {MAX_SCHEMA_DEPTH} levels", param)
    for pattern in _patterns(schema):
        _check_regex(pattern, param)
    found = _unenforced(schema)
    if found is not None:
        keyword, where = found
        at = f" (at {where})" if where else ""
        raise InvalidRequestError(
            f"'{param}' uses '{keyword}'{at}, which constrained decoding here does not enforce "
            '(a reply could break it with finish_reason "stop"); remove it, or check the '
            "reply yourself",
            param,
        )
    return text


# JSON Schema keywords xgrammar's converter compiles away without enforcing them (checked in
# tests/test_structured.py: its grammar accepts a value each forbids), refused rather than
# silently broken. (unevaluatedProperties is ignored too, but strict mode already allows no
# property the schema does not name; an allOf, where it would matter, is refused below.)
UNENFORCED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
)
# keywords whose value is a schema, a list of schemas, or a map of names to schemas
_SUBSCHEMA = ("additionalProperties", "items", "additionalItems", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def _unenforced(schema: Any) -> tuple[str, str] | None:
    """The first keyword of a JSON Schema the grammar would not enforce, and where it is
    (keywords only: a property named "not" is no keyword); an allOf of several schemas too
    (xgrammar turns it into any JSON). None if there is none."""
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        for keyword in UNENFORCED_KEYWORDS:
            if keyword in node:
                return keyword, where
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return "allOf", where
        for key in _SUBSCHEMA:
            if isinstance(node.get(key), dict):
                stack.append((node[key], f"{where}.{key}".lstrip(".")))
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(
                    (sub, f"{where}.{key}[{i}]".lstrip(".")) for i, sub in enumerate(node[key])
                )
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(
                    (sub, f"{where}.{key}.{name}".lstrip(".")) for name, sub in node[key].items()
                )
    return None


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value, without recursing (a hostile schema is deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            if depth > MAX_SCHEMA_DEPTH:
                return depth
            stack.extend((child, depth + 1) for child in item)
    return deepest


def _literal(text: str) -> str:
    """`text` as an EBNF string literal (JSON's escapes are xgrammar's)."""
    return json.dumps(text, ensure_ascii=False)


def _tool_calls(c: Constraint) -> xgr.Grammar:
    """One or more `<tool_call>` blocks (exactly one when parallel calls are off), each naming
    one of the tools, its arguments valid against that tool's parameters schema."""
    spec = json.loads(c.spec)
    tags = []
    for tool in spec["tools"]:
        params = tool.get("parameters") or {"type": "object", "properties": {}}
        arguments = _json_grammar(_schema(json.dumps(params), c.param))
        name = json.dumps(tool["name"])
        tags.append(
            {
                "type": "tag",
                "begin": f'{TOOL_CALL_START}\n{{"name": {name}, "arguments": ',
                "content": {"type": "grammar", "grammar": str(arguments)},
                "end": f"}}\n{TOOL_CALL_END}",
            }
        )
    calls = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": not spec.get("parallel", True),
    }
    return xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": calls}))


def _after_reasoning(grammar: xgr.Grammar, parser: str, opened: bool) -> xgr.Grammar:
    """`grammar` after a reasoning block: any text up to the end marker and a little
    whitespace; the block may be left out, unless the prompt opened it."""
    start, end = REASONING_MARKERS[parser]
    think: dict[str, Any] = {
        "type": "tag",
        "begin": "" if opened else start,
        "content": {"type": "any_text"},
        "end": end,
    }
    # a few newlines after the block (Qwen3 writes two); unbounded, small models loop on them
    block: dict[str, Any] = {
        "type": "sequence",
        "elements": [think, {"type": "grammar", "grammar": "root ::= [ \\t\\n]{0,4}"}],
    }
    if not opened:
        block = {"type": "optional", "content": block}
    elements = [block, {"type": "grammar", "grammar": str(grammar)}]
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}
    return xgr.Grammar.from_structural_tag(json.dumps(tag))


def _refused(c: Constraint, exc: Exception) -> InvalidRequestError:
    why = _LOCATION.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else "")
    noun = {"regex": "regex", "grammar": "grammar"}.get(c.kind, "schema")
    return InvalidRequestError(f"'{c.param}': the {noun} cannot be compiled ({why[:300]})", c.param)
