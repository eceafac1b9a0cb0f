"""A constraint as a grammar: what each kind of Constraint means as xgrammar's Grammar (a JSON
Schema, any JSON object, a regex, choices, an EBNF grammar, tool calls; after a reasoning
block), and the checks that refuse, before anything is compiled, what would not be enforced
(JSON Schema keywords xgrammar compiles away) or what is recognizably too slow to compile or
to match (nested repetition). Each refusal is an InvalidRequestError naming the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from keyword import iskeyword
from typing import Any

try:  # the regex parser of Python's re module (3.11+; sre_parse before)
    import re._parser as _sre  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    import sre_parse as _sre  # type: ignore[no-redef]

import xgrammar as xgr

from neuronpy.engine import harmony
from neuronpy.engine.reasoning import REASONING_MARKERS
from neuronpy.engine.tools import TOOL_FORMATS
from neuronpy.engine.types import Constraint
from neuronpy.errors import InvalidRequestError

MAX_SCHEMA_DEPTH = 32  # nesting of a JSON Schema's objects and arrays
# Counted repetition nested in counted repetition, (x{1,50}){1,50}, compiles in time that grows
# far faster than the product of the counts (that one: 75 s on this 2-core machine, 16x16:
# 0.04 s). A product above this is refused.
MAX_NESTED_REPETITION = 1024
_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")
_REPEATS = (_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", None))
_ATOMIC = getattr(_sre, "ATOMIC_GROUP", None)  # (Python 3.11+)

# A reply's reasoning block before its constraint: (the reasoning parser, whether the prompt
# opened the block, so that the reply starts inside it); None: the reply has none.
Reasoning = tuple[str, bool]


def grammar_of(c: Constraint, reasoning: Reasoning | None = None) -> xgr.Grammar:
    """The grammar of what `c` allows, after the reply's reasoning block when it has one;
    InvalidRequestError naming c's field when c is refused before compiling."""
    grammar = _grammar(c)
    if reasoning is not None and reasoning[0] == harmony.NAME and c.kind != "tools":
        # a harmony reply's answer is a final message: its framing before what `c` allows
        # (tool calls carry their own)
        grammar = _after_text(grammar, harmony.FINAL_FRAME)
    return grammar if reasoning is None else _after_reasoning(grammar, *reasoning)


def _after_text(grammar: xgr.Grammar, text: str) -> xgr.Grammar:
    """`text`, then `grammar`."""
    elements = [
        {"type": "const_string", "value": text},
        {"type": "grammar", "grammar": str(grammar)},
    ]
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}
    return xgr.Grammar.from_structural_tag(json.dumps(tag))


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


def _enforceable(schema: Any) -> Any:
    """`schema` without the keywords the grammar would not enforce (an allOf of several
    schemas dropped whole), for the calls a model may choose to write (tool_choice "auto"):
    such a call is held to the rest of its schema, where a forced one is refused instead."""
    if isinstance(schema, list):
        return [_enforceable(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in UNENFORCED_KEYWORDS or (
            key == "allOf" and isinstance(value, list) and len(value) > 1
        ):
            continue
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _enforceable(sub) for name, sub in value.items()}
        elif key in (*_SUBSCHEMA, *_SUBSCHEMA_LISTS):
            out[key] = _enforceable(value)
        else:
            out[key] = value
    return out


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


# FunctionGemma's argument notation (engine/tools.py): `key:value` pairs, strings between
# <escape> markers. Its keys are the schema's properties when it names them, each value of its
# property's type (a string's maxLength and an enum of strings kept); the rest of the schema
# (required keys, nested schemas) is not enforced.
_GEMMA_VALUES = r"""
value ::= string | number | "true" | "false" | "null"
    | "{" (KEY ":" value ("," KEY ":" value)*)? "}" | "[" (value ("," value)*)? "]"
string ::= "<escape>" [^<]{0,4096} "<escape>"
integer ::= "-"? [0-9]{1,18}
number ::= "-"? [0-9]{1,18} ("." [0-9]{1,18})?
"""
_GEMMA_KEY = "[a-zA-Z_] [a-zA-Z0-9_]{0,63}"
_GEMMA_TYPES = {"integer": "integer", "number": "number", "boolean": '("true" | "false")'}


def _gemma_arguments(params: dict[str, Any]) -> str:
    """The grammar of FunctionGemma arguments for a tool's `params` schema."""
    properties = params.get("properties")
    if not isinstance(properties, dict) or not properties:
        pair, rules, most = f'({_GEMMA_KEY}) ":" value', [], 64
    else:
        most = len(properties)  # (a key may still come twice: the parser keeps the last)
        pairs, rules = [], []
        for i, (key, prop) in enumerate(properties.items()):
            prop = prop if isinstance(prop, dict) else {}
            enum = prop.get("enum")
            if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
                rule = " | ".join(_literal(f"<escape>{e}<escape>") for e in enum)
            elif prop.get("type") == "string" and isinstance(prop.get("maxLength"), int):
                rule = f'"<escape>" [^<]{{0,{max(0, prop["maxLength"])}}} "<escape>"'
            elif prop.get("type") == "string":
                rule = "string"
            else:
                rule = _GEMMA_TYPES.get(prop.get("type"), "value")
            rules.append(f"v{i} ::= {rule}")
            pairs.append(f'{_literal(key)} ":" v{i}')
        pair = " | ".join(f"({p})" for p in pairs)
    more = f"{{0,{most - 1}}}"
    body = f'root ::= (pair ("," pair){more})?\npair ::= {pair}\n' + "\n".join(rules)
    return body + _GEMMA_VALUES.replace("KEY", f"({_GEMMA_KEY})")


# Qwen3-Coder / Qwen3.5's XML arguments (engine/tools.py): `<parameter=KEY>\n` VALUE
# `\n</parameter>\n` for each property of the schema in its order, the required ones always; a
# string's value is any text without the markup that would end it (its maxLength kept: then
# without "<" at all, FunctionGemma's bound), an enum of strings one of them, any other value
# JSON valid against the property's schema. A schema without "properties" takes any keys.
_XML_ENDS = ("</parameter>", "</tool_call>")  # what a raw string value may not hold
_XML_KEY = "[a-zA-Z_] [a-zA-Z0-9_.-]{0,63}"


def _without(words: list[str], k: int = 0) -> str:
    """The text after a `<` (up to the next one) that does not open one of `words` (the ends
    after their `<`, sharing their first `k` characters)."""
    nexts = sorted({w[k] for w in words})
    options = ['""', f"[^{''.join(nexts)}<] [^<]*"]
    for c in nexts:
        sub = [w for w in words if w[k] == c]
        if all(len(w) > k + 1 for w in sub):  # (a whole word is not allowed)
            options.append(f"{_literal(c)} {_without(sub, k + 1)}")
    return f"({' | '.join(options)})"


_XML_TEXT = f'[^<]* ("<" {_without([w[1:] for w in _XML_ENDS])})*'


def _xml_value(prop: Any, param: str) -> dict[str, Any]:
    """The structural-tag format of one property's value."""
    prop = prop if isinstance(prop, dict) else {}
    enum = prop.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
        rule = " | ".join(_literal(e) for e in enum)
    elif prop.get("type") == "string" and isinstance(prop.get("maxLength"), int):
        rule = f"[^<]{{0,{max(0, prop['maxLength'])}}}"
    elif prop.get("type") == "string":
        rule = _XML_TEXT
    else:
        return {"type": "grammar", "grammar": str(_json_grammar(_schema(json.dumps(prop), param)))}
    return {"type": "grammar", "grammar": f"root ::= {rule}"}


def _xml_arguments(params: dict[str, Any], param: str) -> dict[str, Any]:
    """The structural-tag format of XML arguments for a tool's `params` schema."""
    properties = params.get("properties")
    if not isinstance(properties, dict):
        free = f'("<parameter=" {_XML_KEY} ">\\n" {_XML_TEXT} "\\n</parameter>\\n"){{0,64}}'
        return {"type": "grammar", "grammar": f"root ::= {free}"}
    required = params.get("required")
    required = set(required) if isinstance(required, list) else set()
    elements: list[dict[str, Any]] = []
    for key, prop in properties.items():
        one: dict[str, Any] = {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": f"<parameter={key}>\n"},
                _xml_value(prop, param),
                {"type": "const_string", "value": "\n</parameter>\n"},
            ],
        }
        elements.append(one if key in required else {"type": "optional", "content": one})
    if not elements:
        return {"type": "grammar", "grammar": 'root ::= ""'}
    return {"type": "sequence", "elements": elements}


# LFM2's notation (engine/tools.py): keyword arguments whose values are Python literals. Their
# keys are the schema's properties in its order, each once, the required ones present; a value
# is a literal of its property's type (strings double-quoted, True/False/None, lists, dicts),
# nested the same way (enum and const, anyOf and type lists kept; a string's minLength and
# maxLength kept, its pattern and format not; array lengths and numeric bounds not enforced).
_PY_VALUES = r"""
value ::= string | number | "True" | "False" | "None" | "[" (value (", " value)*)? "]" | dict
dict ::= "{" (string ": " value (", " string ": " value)*)? "}"
string ::= "\"" char* "\""
char ::= [^\0-\x1f\"\\] | "\\" ["\\bfnrt]
integer ::= "-"? ("0" | [1-9] [0-9]{0,17})
number ::= integer ("." [0-9]{1,18})?
"""
_PY_TYPES = {
    "integer": "integer",
    "number": "number",
    "boolean": '("True" | "False")',
    "null": '"None"',
}
_PY_KEY = '[a-zA-Z_] [a-zA-Z0-9_]{0,63} "="'


def _py_literal(value: Any) -> str:
    """A JSON value as a Python literal (strings in double quotes)."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_py_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        pairs = (f"{_py_literal(str(k))}: {_py_literal(v)}" for k, v in value.items())
        return "{" + ", ".join(pairs) + "}"
    return json.dumps(value, ensure_ascii=False)


class _PythonicRules:
    """The rules of one tool's keyword arguments (see _pythonic_arguments)."""

    def __init__(self) -> None:
        self.rules: list[str] = []

    def add(self, body: str) -> str:
        name = f"p{len(self.rules)}"
        self.rules.append(f"{name} ::= {body}")
        return name

    def ordered(self, pairs: list[tuple[str, bool]]) -> str:
        """The rule of `pairs` (each a pair's rule and whether it is required) written in
        their order, each at most once, the required ones present, ", " between."""
        first, more = '""', '""'  # the pairs from the i-th on: none written yet / some were
        for pair, required in reversed(pairs):
            skip_more, skip_first = ("", "") if required else (f" | {more}", f" | {first}")
            more, first = (
                self.add(f'", " {pair} {more}{skip_more}'),
                self.add(f"{pair} {more}{skip_first}"),
            )
        return first

    def pairs(
        self, schema: dict[str, Any], depth: int, key: Callable[[str], str | None]
    ) -> str | None:
        """The rule of an object's entries or a call's keyword arguments: its properties'
        (`key(name)`: the text before a value, None to leave the property out); '""' when
        there are none; None when it names none but allows any."""
        properties = schema.get("properties")
        if not isinstance(properties, dict) or not properties:
            extra = schema.get("additionalProperties")
            if extra is False or extra is None or isinstance(properties, dict):
                return '""'
            return None
        required = schema.get("required")
        required = set(required) if isinstance(required, list) else set()
        pairs = []
        for name, prop in properties.items():
            before = key(name)
            if before is not None:
                pairs.append((f"{before} {self.value(prop, depth + 1)}", name in required))
        return self.ordered(pairs)

    def value(self, schema: Any, depth: int) -> str:
        """The rule of a Python literal valid against `schema`."""
        if not isinstance(schema, dict) or depth > MAX_SCHEMA_DEPTH:
            return "value"
        if "const" in schema:
            return _literal(_py_literal(schema["const"]))
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            return "(" + " | ".join(_literal(_py_literal(e)) for e in enum) + ")"
        for keyword in ("anyOf", "oneOf"):
            options = schema.get(keyword)
            if isinstance(options, list) and options:
                return "(" + " | ".join(self.value(o, depth + 1) for o in options) + ")"
        kind = schema.get("type")
        if isinstance(kind, list) and kind:
            return "(" + " | ".join(self.value({**schema, "type": k}, depth) for k in kind) + ")"
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else None
        if kind == "string":
            low, high = schema.get("minLength"), schema.get("maxLength")
            if not isinstance(low, int) and not isinstance(high, int):
                return "string"
            low = max(0, low) if isinstance(low, int) else 0
            count = f"{{{low},{max(low, high)}}}" if isinstance(high, int) else f"{{{low},}}"
            return f'("\\"" char{count} "\\"")'
        if kind == "array":
            items = schema.get("items")
            item = self.value(items, depth + 1) if isinstance(items, dict) else "value"
            return self.add(f'"[" ({item} (", " {item})*)? "]"')
        if kind == "object":
            inner = self.pairs(
                schema, depth, lambda k: _literal(json.dumps(k, ensure_ascii=False) + ": ")
            )
            if inner is None:
                return "dict"
            return '"{}"' if inner == '""' else self.add(f'"{{" {inner} "}}"')
        return _PY_TYPES.get(kind, "value") if isinstance(kind, str) else "value"


def _pythonic_arguments(params: dict[str, Any], tool: str, param: str) -> str:
    """The grammar of LFM2's keyword arguments for a tool's `params` schema; an
    InvalidRequestError when a parameter it requires cannot be passed that way."""
    if not tool.isidentifier() or iskeyword(tool):
        raise InvalidRequestError(
            f"tool '{tool}' cannot be called in LFM2's notation (a Python call: its name must "
            "be an identifier)",
            param,
        )
    rules = _PythonicRules()
    required = params.get("required")
    required = required if isinstance(required, list) else []

    def keyword(name: str) -> str | None:
        if name.isidentifier() and not iskeyword(name):
            return _literal(f"{name}=")
        if name in required:
            raise InvalidRequestError(
                f"tool '{tool}' requires the parameter '{name}', which LFM2's calls cannot "
                "pass (they write Python keyword arguments: a name must be an identifier)",
                param,
            )
        return None  # an optional one is left out

    root = rules.pairs(params, 0, keyword)
    if root is None:  # any keyword arguments
        root = f'({_PY_KEY} value (", " {_PY_KEY} value){{0,63}})?'
    return "\n".join([f"root ::= {root}", *rules.rules]) + _PY_VALUES


def _tool_calls(c: Constraint) -> xgr.Grammar:
    """Well-formed calls in the tool format of the spec (Hermes when it names none): one or
    more (exactly one when parallel calls are off), each naming one of the tools, its
    arguments valid against that tool's parameters schema (FunctionGemma's, whose notation is
    not JSON: keys of the schema and values of their types, see _gemma_arguments; the XML
    notation's: see _xml_arguments; LFM2's, a Python list of calls: see
    _pythonic_arguments)."""
    spec = json.loads(c.spec)
    fmt = TOOL_FORMATS[spec.get("format", "hermes")]
    tags = []
    for tool in spec["tools"]:
        params = tool.get("parameters") or {"type": "object", "properties": {}}
        if spec.get("auto"):  # the model's own choice: what can be held is held
            params = _enforceable(params)
        if fmt.notation == "json":
            arguments = str(_json_grammar(_schema(json.dumps(params), c.param)))
            content = {"type": "grammar", "grammar": arguments}
        elif fmt.notation == "gemma":
            content = {"type": "grammar", "grammar": _gemma_arguments(params)}
        elif fmt.notation == "python":
            arguments = _pythonic_arguments(params, tool["name"], c.param)
            content = {"type": "grammar", "grammar": arguments}
        else:
            content = _xml_arguments(params, c.param)
        name = json.dumps(tool["name"]) if fmt.quote_name else tool["name"]
        tags.append(
            {
                "type": "tag",
                "begin": f"{fmt.call_begin}{name}{fmt.name_end}",
                "content": content,
                "end": fmt.call_end,
            }
        )
    if spec.get("auto"):  # free text; a call, once begun, held to its shape
        if fmt.bracketed or not all(t["begin"].startswith(fmt.start) for t in tags):
            raise InvalidRequestError(
                f"tool_choice 'auto' is held by the grammar only in tagged formats, not "
                f"{fmt.name}'s",
                c.param,
            )
        triggered = {
            "type": "triggered_tags",
            "triggers": [fmt.start],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": not spec.get("parallel", True),
        }
        return xgr.Grammar.from_structural_tag(
            json.dumps({"type": "structural_tag", "format": triggered})
        )
    calls: dict[str, Any] = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": fmt.separator,
        "at_least_one": True,
        "stop_after_first": not spec.get("parallel", True),
    }
    if fmt.bracketed:  # the calls as one list after the marker (LFM2's: before its end too)
        calls = {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": f"{fmt.start}["},
                calls,
                {"type": "const_string", "value": f"]{fmt.end}"},
            ],
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
