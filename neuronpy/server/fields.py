"""One validator per request field; each raises InvalidRequestError naming its field."""

from __future__ import annotations

import re
from typing import Any

from neuronpy.engine.types import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_VALUE, MAX_LOGPROBS
from neuronpy.errors import InvalidRequestError

# Fields with a meaning neuronpy does not implement, and the values that ask for nothing.
UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),  # the deprecated form of tools
    "function_call": (None, "none", "auto"),
}
_TOKEN_ID = re.compile(r"^[0-9]{1,10}$")  # a logit_bias key


# What a JSON value is called in errors (and the tags of schema.py's unions).
JSON_NOUNS = {str: "a string", list: "an array", dict: "an object", bool: "a boolean"}
JSON_NOUNS |= {int: "a number", float: "a number", type(None): "null"}


def json_type(value: object) -> str:
    """A JSON value's kind, as errors name it: a string, an array, an object, ..."""
    return JSON_NOUNS.get(type(value), "a value")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def unsupported(body: dict[str, Any]) -> None:
    """Refuses a field of UNSUPPORTED set to anything but a value that asks for nothing."""
    for name, allowed in UNSUPPORTED.items():
        if name in body and not any(_same(body[name], a) for a in allowed):
            raise InvalidRequestError(f"'{name}' is not supported by this server", name)


def _same(value: object, allowed: object) -> bool:
    """Equality that keeps True apart from 1 and False apart from 0."""
    return type(value) is type(allowed) and value == allowed


def value(body: dict[str, Any], name: str, default: Any) -> Any:
    """The field, or `default` when absent or null (the engine checks the value itself)."""
    found = body.get(name)
    return default if found is None else found


def optional(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    found = body.get(name)
    if found is None:
        return default
    if not isinstance(found, kind):
        raise InvalidRequestError(f"'{name}' must be a {kind.__name__}", name)
    return found


def stream_options(body: dict[str, Any], stream: bool) -> bool:
    """Whether the stream ends with a usage chunk."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise InvalidRequestError(
            "'stream_options' is only allowed with stream=true", "stream_options"
        )
    if not isinstance(options, dict):
        raise InvalidRequestError("'stream_options' must be an object", "stream_options")
    return optional(options, "include_usage", bool, False)


def stop(found: object) -> tuple[str, ...]:
    if found is None:
        return ()
    if isinstance(found, str):
        return (found,)
    if isinstance(found, list) and all(isinstance(s, str) for s in found):
        return tuple(found)
    raise InvalidRequestError("'stop' must be a string or a list of strings", "stop")


def int_tuple(body: dict[str, Any], name: str) -> tuple[int, ...]:
    found = body.get(name)
    if found is None:
        return ()
    if not isinstance(found, list) or not all(is_int(v) for v in found):
        raise InvalidRequestError(f"'{name}' must be a list of integers", name)
    return tuple(found)


def session(found: object) -> tuple[str | None, bool]:
    """`"session": "NAME"` (continue from it and save into it) or `{"name": "NAME", "save":
    false}` (continue from it, leave it as it is); the name is checked against the store."""
    if found is None:
        return None, True
    if isinstance(found, str):
        return found, True
    if isinstance(found, dict) and isinstance(found.get("name"), str):
        unknown = sorted(set(found) - {"name", "save"})
        save = found.get("save", True)
        if not unknown and isinstance(save, bool):
            return found["name"], save
    raise InvalidRequestError(
        '\'session\' must be a session name or {"name": NAME, "save": true|false}, got '
        f"{json_type(found)}",
        "session",
    )


def logprobs(chat: bool, body: dict[str, Any]) -> int | None:
    """How many top alternatives to report per token (0: the chosen token's only), or None.
    Chat: `logprobs: true` and `top_logprobs: N`; completions: `logprobs: N`."""
    cap = f"an integer from 0 to {MAX_LOGPROBS}"
    if not chat:
        found = body.get("logprobs")
        if found is not None and (not is_int(found) or not 0 <= found <= MAX_LOGPROBS):
            raise InvalidRequestError(f"'logprobs' must be null or {cap}", "logprobs")
        return found
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise InvalidRequestError("'logprobs' must be a boolean", "logprobs")
    top = body.get("top_logprobs")
    if top is not None and (not is_int(top) or not 0 <= top <= MAX_LOGPROBS):
        raise InvalidRequestError(f"'top_logprobs' must be {cap}", "top_logprobs")
    if top and not wanted:
        raise InvalidRequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def logit_bias(found: object) -> tuple[tuple[int, float], ...]:
    """{"token id": bias}: ids written as integers, biases in [-100, 100]; a 400 lists the
    entries that are not (ids outside the vocabulary are the engine's to refuse)."""
    if found is None:
        return ()
    if not isinstance(found, dict):
        raise InvalidRequestError(
            "'logit_bias' must be an object mapping token ids to biases", "logit_bias"
        )
    if len(found) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(
            f"'logit_bias' takes at most {MAX_LOGIT_BIAS} entries, got {len(found)}",
            "logit_bias",
        )
    bad_keys = [k for k in found if not _TOKEN_ID.match(k)]
    bad_values = [
        k
        for k, v in found.items()
        if isinstance(v, bool)
        or not isinstance(v, (int, float))
        or not -MAX_LOGIT_BIAS_VALUE <= v <= MAX_LOGIT_BIAS_VALUE
    ]
    if bad_keys or bad_values:
        raise InvalidRequestError(
            "'logit_bias' maps token ids (integers, as strings) to biases in [-100, 100]; "
            f"bad keys: {[k[:20] for k in bad_keys[:20]]}, bad biases for: "
            f"{[k[:20] for k in bad_values[:20]]}",
            "logit_bias",
        )
    bias = {int(k): float(v) for k, v in found.items()}
    if len(bias) != len(found):
        raise InvalidRequestError("'logit_bias' names a token id twice", "logit_bias")
    return tuple(bias.items())


MAX_PROMPTS = 256  # prompts in one completions request


def prompts(found: object) -> tuple[str | list[int], ...]:
    """A completions prompt, or several: a non-empty string, a non-empty list of token ids, or
    a list of those (each its own request in the batch, one choice each)."""
    if isinstance(found, list) and found and all(isinstance(p, (str, list)) for p in found):
        if len(found) > MAX_PROMPTS:
            raise InvalidRequestError(
                f"'prompt' takes at most {MAX_PROMPTS} prompts, got {len(found)}", "prompt"
            )
        return tuple(_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(found))
    return (_one_prompt(found, "prompt"),)


def _one_prompt(found: object, where: str) -> str | list[int]:
    if isinstance(found, str):
        if not found:
            raise InvalidRequestError(f"'{where}' is empty", "prompt")
        return found
    if isinstance(found, list) and found and all(is_int(t) for t in found):
        return found
    raise InvalidRequestError(
        f"'{where}' must be a non-empty string or a non-empty list of token ids", "prompt"
    )
