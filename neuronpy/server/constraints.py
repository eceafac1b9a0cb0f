"""What a request's output must match: OpenAI's `response_format`, vLLM's `structured_outputs`
and `guided_*` fields, and `tool_choice` "required" or a named function, as one Constraint.

At most one of them per request; the engine compiles it (a 400 when it cannot) before the
request is admitted.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from neuronpy.engine.types import Constraint
from neuronpy.errors import InvalidRequestError
from neuronpy.server.chat_input import ChatTools
from neuronpy.server.schema import json_type

# vLLM's names (its older guided_* fields, and structured_outputs' keys) -> our kinds
GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# the request fields parse_constraint reads
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", *GUIDED)
STRUCTURED = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}


def parse_constraint(body: dict[str, Any]) -> Constraint | None:
    """The one constraint of `body` (the request's CONSTRAINT_FIELDS), or None;
    InvalidRequestError naming the field when a field is malformed or a second one asks for
    another constraint."""
    found: list[Constraint] = []
    rf = _response_format(body.get("response_format"))
    if rf is not None:
        found.append(rf)
    so = body.get("structured_outputs")
    if so is not None:
        found.append(_structured_outputs(so))
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append(_constraint(kind, body[name], name))
    if len(found) > 1:
        raise InvalidRequestError(
            f"'{found[1].param}' and '{found[0].param}' both constrain the output; give one",
            found[1].param,
        )
    return found[0] if found else None


def tool_constraint(
    tools: ChatTools, other: Constraint | None, generic: bool = False
) -> Constraint | None:
    """`tool_choice` "required" or a named function: the reply is well-formed calls of the
    given tools (one, for a named function or parallel_tool_calls false). "auto": free, but
    where the tools are shown in the generic format (`generic`: the model's template does not
    show them) a call the model begins is held to it ("auto": true in the spec), unless
    another constraint holds the reply."""
    if tools.tools is None or tools.choice not in ("required", "function", "auto"):
        return other
    if tools.choice == "auto" and (not generic or other is not None):
        return other
    if other is not None:
        raise InvalidRequestError(
            f"'tool_choice' {tools.choice!r} and '{other.param}' both constrain the output; "
            "give one",
            "tool_choice",
        )
    spec = {
        "tools": [
            {"name": t["function"]["name"], "parameters": t["function"].get("parameters")}
            for t in tools.tools
        ],
        "parallel": tools.parallel and tools.choice in ("required", "auto"),
    }
    if tools.choice == "auto":
        spec["auto"] = True
        return Constraint("tools", json.dumps(spec), param="tools")
    return Constraint("tools", json.dumps(spec), param="tool_choice")


def with_tool_format(constraint: Constraint | None, tool_format: str) -> Constraint | None:
    """`constraint`, its calls written in the model's `tool_format` when it is a tools one."""
    if constraint is None or constraint.kind != "tools":
        return constraint
    spec = json.loads(constraint.spec)
    if spec.get("format", "hermes") == tool_format:
        return constraint
    return dataclasses.replace(constraint, spec=json.dumps({**spec, "format": tool_format}))


def _response_format(value: object) -> Constraint | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", param="response_format")
    if kind == "json_schema":
        inner = value.get("json_schema")  # type: ignore[union-attr]
        param = "response_format.json_schema"
        if not isinstance(inner, dict):
            raise InvalidRequestError(f"'{param}' must be an object with a 'schema'", param)
        schema = inner.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                f"'{param}.schema' must be a JSON Schema object, got {json_type(schema)}",
                f"{param}.schema",
            )
        return Constraint("json_schema", json.dumps(schema), param=f"{param}.schema")
    raise InvalidRequestError(
        "'response_format' must be an object whose type is 'text', 'json_object' or 'json_schema'",
        "response_format",
    )


def _structured_outputs(value: object) -> Constraint:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise InvalidRequestError(f"'{param}' must be an object", param)
    given = [k for k in STRUCTURED if value.get(k) not in (None, False)]
    unknown = sorted(
        k for k in value if k not in STRUCTURED and k not in ("backend", "disable_fallback")
    )
    if unknown:
        raise InvalidRequestError(
            f"'{param}' has no field {unknown[0]!r}; it takes one of {', '.join(STRUCTURED)}",
            f"{param}.{unknown[0]}",
        )
    if len(given) != 1:
        raise InvalidRequestError(
            f"'{param}' takes exactly one of {', '.join(STRUCTURED)}, got {len(given)}", param
        )
    (key,) = given
    if key == "json_object":
        if value[key] is not True:
            raise InvalidRequestError(f"'{param}.json_object' must be true", f"{param}.json_object")
        return Constraint("json_object", param=f"{param}.json_object")
    return _constraint(STRUCTURED[key], value[key], f"{param}.{key}")


def _constraint(kind: str, value: object, param: str) -> Constraint:
    """A constraint of `kind` from the field `param`'s value."""
    if kind == "json_schema":
        if isinstance(value, str):  # vLLM takes a schema's JSON text too
            return Constraint(kind, value, param=param)
        if not isinstance(value, dict):
            raise InvalidRequestError(
                f"'{param}' must be a JSON Schema object, got {json_type(value)}", param
            )
        return Constraint(kind, json.dumps(value), param=param)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidRequestError(f"'{param}' must be a list of strings", param)
        return Constraint(kind, choices=tuple(value), param=param)
    if not isinstance(value, str):
        raise InvalidRequestError(f"'{param}' must be a string, got {json_type(value)}", param)
    return Constraint(kind, value, param=param)
