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
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from neuronpy.defaults import DEFAULT_GRAMMAR_CACHE_BYTES
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
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_ids = sorted(stop_ids)
        self.cache_bytes = cache_bytes
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
        self, constraint: Constraint, reasoning: Reasoning | None = None
    ) -> xgr.CompiledGrammar:
        """The compiled grammar of `constraint` (cached). `reasoning`: the reply's reasoning
        block, which comes before the constraint (None: none). InvalidRequestError naming the
        constraint's field when it cannot be compiled."""
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
            compiled = compiler.compile_grammar(grammar)
        except InvalidRequestError:
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

    def matcher(self, constraint: Constraint, reasoning: Reasoning | None = None) -> Matcher:
        """A fresh matcher at the start of `constraint`'s grammar."""
        return Matcher(self.compile(constraint, reasoning), self.vocab_size)


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
    nobody has; `accept` advances by the chosen token. A lock keeps the three apart."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._vocab_size = vocab_size
        self._lock = threading.Lock()
        self._filled = False
        self.filled_ahead = 0  # masks computed while a forward ran (for the bench)

    def fill_ahead(self) -> None:
        if self._filled or not self._lock.acquire(blocking=False):
            return
        try:
            if not self._filled and not self._matcher.is_terminated():
                self._fill()
                self.filled_ahead += 1
        finally:
            self._lock.release()

    def _fill(self) -> None:
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._filled = True

    def mask(self, logits: torch.Tensor) -> None:
        """Sets the logits ([vocab] float32, a copy) of tokens the grammar forbids to -inf;
        GrammarError when it forbids every one."""
        with self._lock:
            if self._matcher.is_terminated():
                raise GrammarError("the reply's grammar is complete and allows no more tokens")
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
            if self._matcher.is_terminated():
                return False
            if not self._filled:
                self._fill()
            if not 0 <= token < self._vocab_size:
                return False
            return bool((int(self._bitmask[0, token >> 5]) >> (token & 31)) & 1)

    def accept(self, token: int) -> None:
        with self._lock:
            self._filled = False
            if not self._matcher.accept_token(token):
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
        _check_repetition(c.spec, c.param)
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
        _check_repetition(pattern, param)
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
