"""The OpenAI requests this server takes, as typed models: `ChatCompletionRequest`
(/v1/chat/completions) and `CompletionRequest` (/v1/completions). Each field is typed and
checked where it is declared (its errors name it, worded as clients have always read them),
and a request yields the engine's SamplingParams (`sampling_params`), which keep their own
checks as the engine's contract. A field is added here and in the engine, nowhere else.

`parse(kind, body)` is the one way in (the Responses API builds a ChatCompletionRequest of its
own). The body is structurally sound already (structure.py) and names a model the server
serves (the route looked first).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import PrivateAttr, ValidationInfo, field_validator, model_validator
from transformers import PreTrainedTokenizerBase

from neuronpy.engine.tools import parameter_types
from neuronpy.engine.types import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_LOGPROBS,
    Constraint,
    OutputFormat,
    SamplingParams,
)
from neuronpy.errors import InvalidRequestError
from neuronpy.server.chat_input import ChatInput
from neuronpy.server.constraints import (
    CONSTRAINT_FIELDS,
    parse_constraint,
    tool_constraint,
    with_tool_format,
)
from neuronpy.server.generic_tools import messages_with_tools, system_messages_first
from neuronpy.server.prompts import check_template_kwargs, encode_prompt, render_chat
from neuronpy.server.schema import WireModel, either, is_int, json_type, validate

Kind = Literal["chat", "text"]

DEFAULT_COMPLETION_MAX_TOKENS = 16  # /v1/completions, as OpenAI; chat defaults to the context
MAX_PROMPTS = 256  # prompts in one completions request
# Fields with a meaning neuronpy does not implement, and the values that ask for nothing.
UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),  # the deprecated form of tools
    "function_call": (None, "none", "auto"),
}
_TOKEN_ID = re.compile(r"^[0-9]{1,10}$")  # a logit_bias key
_CHECK_CONTEXT = 1 << 40  # (a context no prompt fills: the checks' max_tokens default)


class StreamOptions(WireModel):
    include_usage: bool | None = None


class SamplingRequest(WireModel):
    """What both endpoints read: the model, how many choices, streaming, and how to sample."""

    kind: ClassVar[Kind]

    model: str | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: either(("a string", str), ("an array", list[str])) | None = None  # type: ignore[valid-type]
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, Any] | None = None  # {"token id": bias}; the check lists bad entries
    allowed_token_ids: list[int] | None = None  # vLLM's: the only ids it may sample
    # what the output must match (constraints.py reads these fields, one of them at most)
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    speculative: str | None = None  # "off", "ngram" or "draft": this request's speculation
    # neuronpy's: "NAME" (continue from it and save into it) or {"name": NAME, "save": false}
    # (continue from it, leave it as it is); the name is checked against the store
    session: tuple[str, bool] | None = None
    _constraint: Constraint | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, body: Any) -> Any:
        """A field of UNSUPPORTED set to anything but a value that asks for nothing is a 400."""
        if isinstance(body, dict):
            for name, allowed in UNSUPPORTED.items():
                if name in body and not any(_same(body[name], a) for a in allowed):
                    raise InvalidRequestError(f"'{name}' is not supported by this server", name)
        return body

    @field_validator("n")
    @classmethod
    def _n(cls, n: int | None) -> int | None:
        # (the engine checks its own cap, max_n, before admitting)
        if n is not None and n < 1:
            raise InvalidRequestError(f"'n' must be an integer >= 1, got {n!r}", "n")
        return n

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value < 1:
            name = str(info.field_name)
            raise InvalidRequestError(f"'{name}' must be an integer >= 1", name)
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, found: dict[str, Any] | None) -> dict[str, Any] | None:
        """Ids written as integers, biases in [-100, 100]; a 400 lists the entries that are
        not (ids outside the vocabulary are the engine's to refuse)."""
        if found is None:
            return None
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
        if len({int(k) for k in found}) != len(found):
            raise InvalidRequestError("'logit_bias' names a token id twice", "logit_bias")
        return found

    @field_validator("session", mode="before")
    @classmethod
    def _session(cls, found: Any) -> tuple[str, bool] | None:
        if found is None:
            return None
        if isinstance(found, str):
            return found, True
        if isinstance(found, dict) and isinstance(found.get("name"), str):
            save = found.get("save", True)
            if not set(found) - {"name", "save"} and isinstance(save, bool):
                return found["name"], save
        raise InvalidRequestError(
            '\'session\' must be a session name or {"name": NAME, "save": true|false}, got '
            f"{json_type(found)}",
            "session",
        )

    @model_validator(mode="after")
    def _whole(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "'stream_options' is only allowed with stream=true", "stream_options"
            )
        self._constraint = self._own_constraint()
        # the engine's own checks, run once here so that a bad value is refused before the
        # prompt is rendered (the prompt's length settles only max_tokens' default)
        self.sampling_params(0, _CHECK_CONTEXT)
        return self

    def _own_constraint(self) -> Constraint | None:
        return parse_constraint({name: getattr(self, name) for name in CONSTRAINT_FIELDS})

    # ---- what the request means ---------------------------------------------------------------

    @property
    def copies(self) -> int:
        """The completions of each prompt to return (choices)."""
        return 1 if self.n is None else self.n

    @property
    def streamed(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        """Whether the stream ends with a usage chunk."""
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def max_tokens_param(self) -> str:
        """The field max_tokens came from: max_completion_tokens, when given, or max_tokens."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def param_names(self) -> dict[str, str]:
        """What this request calls the parameters the engine names, for its errors."""
        return {"max_tokens": self.max_tokens_param}

    @property
    def constraint(self) -> Constraint | None:
        return self._constraint

    @property
    def session_name(self) -> str | None:
        return None if self.session is None else self.session[0]

    @property
    def session_save(self) -> bool:
        return self.session is None or self.session[1]

    @property
    def prompt_count(self) -> int:
        return 1

    def logprobs_count(self) -> int | None:
        """How many top alternatives to report per token (0: the chosen token's only), or
        None: no log-probabilities."""
        raise NotImplementedError

    def output_format(self, reasoning: str | None, tool_format: str = "hermes") -> OutputFormat:
        return OutputFormat()

    # whether a max_tokens past what the context holds after the prompt is cut to what fits
    # (Anthropic's and Ollama's APIs: their servers do so), rather than refused (OpenAI's 400)
    caps_max_tokens: ClassVar[bool] = False

    def default_max_tokens(self, room: int) -> int:
        """max_tokens when the request gives none, `room` tokens left in the context."""
        return max(1, room)

    def prompt_ids(
        self, tokenizer: PreTrainedTokenizerBase, index: int = 0, processor: Any = None
    ) -> list[int]:
        """Prompt `index`'s token ids (blocking: run it in a thread); InvalidRequestError if it
        cannot be encoded. `processor`: a vision-language model's (for images)."""
        raise NotImplementedError

    def sampling_params(
        self,
        prompt_len: int,
        context_len: int,
        reasoning: str | None = None,
        tool_format: str = "hermes",
    ) -> SamplingParams:
        """How the engine samples a prompt of `prompt_len` tokens: the request's max_tokens,
        or its default (at least 1, so that a too-long prompt is reported as such); a chat
        reply split by the model's reasoning parser `reasoning` and, with tools, into tool
        calls written in the model's `tool_format` (the markup a forced tool_choice writes,
        too)."""
        max_tokens = self.requested_max_tokens
        if max_tokens is None:
            max_tokens = self.default_max_tokens(context_len - prompt_len)
        elif self.caps_max_tokens and prompt_len < context_len:
            max_tokens = min(max_tokens, context_len - prompt_len)  # (ends with "length")

        def given(value: Any, default: Any) -> Any:
            return default if value is None else value

        bias, allowed = self.logit_bias or {}, self.allowed_token_ids
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=given(self.temperature, 1.0),
            top_p=given(self.top_p, 1.0),
            top_k=given(self.top_k, -1),
            min_p=given(self.min_p, 0.0),
            repetition_penalty=given(self.repetition_penalty, 1.0),
            presence_penalty=given(self.presence_penalty, 0.0),
            frequency_penalty=given(self.frequency_penalty, 0.0),
            seed=self.seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            logprobs=self.logprobs_count(),
            logit_bias=tuple((int(k), float(v)) for k, v in bias.items()),
            allowed_token_ids=None if allowed is None else tuple(allowed),
            output=self.output_format(reasoning, tool_format),
            constraint=with_tool_format(self._constraint, tool_format),
            speculative=self.speculative,
        )


# OpenAI's reasoning efforts (a chat request's `reasoning_effort`, a Responses request's
# `reasoning.effort`): the chat template's `reasoning_effort` variable
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class ChatCompletionRequest(SamplingRequest, ChatInput):
    """POST /v1/chat/completions: the conversation through the model's chat template."""

    kind: ClassVar[Kind] = "chat"
    # the model's template does not show tools: they are shown in the generic format
    _generic_tools: bool = PrivateAttr(default=False)

    logprobs: bool | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: variables for the template
    # OpenAI's; given to the template as `reasoning_effort`, as vLLM does (gpt-oss's harmony
    # template writes it into the system message: `Reasoning: high`); others ignore it
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None  # type: ignore[valid-type]
    # vLLM's: the reply goes on from the last (assistant) message instead of a new turn
    continue_final_message: bool | None = None

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _template_kwargs(cls, value: Any) -> dict[str, Any] | None:
        return check_template_kwargs(value)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, top: int | None) -> int | None:
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"'top_logprobs' must be an integer from 0 to {MAX_LOGPROBS}", "top_logprobs"
            )
        return top

    def _own_constraint(self) -> Constraint | None:
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise InvalidRequestError(
                "'continue_final_message' needs the last message to be the assistant's",
                "continue_final_message",
            )
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return tool_constraint(self.chat_tools, super()._own_constraint(), self._generic_tools)

    def show_tools_generically(self) -> None:
        """For a model whose chat template does not show tools: they are written into the
        system message in the generic format (generic_tools.py), and with tool_choice "auto"
        a call the model starts is held to that format by the grammar."""
        if self.chat_tools.tools and not self._generic_tools:
            self._generic_tools = True
            self._constraint = self._own_constraint()

    @property
    def generic_tools(self) -> bool:
        return self._generic_tools

    @property
    def param_names(self) -> dict[str, str]:
        return {**super().param_names, "prompt": "messages"}

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def output_format(self, reasoning: str | None, tool_format: str = "hermes") -> OutputFormat:
        tools = self.chat_tools
        types = parameter_types([t["function"] for t in tools.tools or ()])
        return OutputFormat(reasoning, tools.parse, tools.parallel, tool_format, types)

    def prompt_ids(
        self, tokenizer: PreTrainedTokenizerBase, index: int = 0, processor: Any = None
    ) -> list[int]:
        """The conversation as token ids; with images, a Prompt holding them (`processor`: a
        vision-language model's, None for a model that reads no images: a 400 then)."""
        self.check_images(processor)
        ids = self._rendered(tokenizer, processor)
        return self.with_images(ids, tokenizer, processor)

    def _rendered(self, tokenizer: PreTrainedTokenizerBase, processor: Any) -> list[int]:
        """The chat template's tokens (with a vision-language model's `processor`, each
        message's content as a list of parts, its images rendered by render_chat)."""
        parts = processor is not None
        pictures = self.pictures() if self.has_images else []
        tools = self.chat_tools
        continue_final = bool(self.continue_final_message)
        generic = self._generic_tools and bool(tools.tools)
        variables = self.chat_template_kwargs
        if self.reasoning_effort is not None:  # (chat_template_kwargs may name it too: theirs)
            variables = {"reasoning_effort": self.reasoning_effort, **(variables or {})}

        def render(messages: list[dict[str, Any]], system: bool = True) -> list[int]:
            if generic:
                shown = messages_with_tools(messages, tools.tools or [], tools.choice, system)
                return render_chat(
                    tokenizer, shown, None, variables, continue_final, pictures, processor
                )
            return render_chat(
                tokenizer, messages, tools.tools, variables, continue_final, pictures, processor
            )

        messages = self.template_messages(parts)
        try:
            return render(messages)
        except InvalidRequestError:
            gathered = system_messages_first(messages)
            if gathered != messages:  # a template that takes a system message first only
                try:
                    return render(gathered)
                except InvalidRequestError:
                    pass
            if not generic:
                raise
            # a template that refuses a system role (Gemma's): the tools in the first user turn
            return render(gathered, system=False)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions: a prompt, or several (each its own request in the batch, with
    `n` choices each)."""

    kind: ClassVar[Kind] = "text"

    # a non-empty string or token ids, or a list of those (the check words each case)
    prompt: either(("a string", str), ("an array", list[Any]))  # type: ignore[valid-type]
    logprobs: int | None = None  # completions' logprobs is a count
    tools: Any = None  # (a chat request's: a 400 here says so)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, found: str | list[Any]) -> tuple[str | list[int], ...]:
        if isinstance(found, list) and found and all(isinstance(p, (str, list)) for p in found):
            if len(found) > MAX_PROMPTS:
                raise InvalidRequestError(
                    f"'prompt' takes at most {MAX_PROMPTS} prompts, got {len(found)}", "prompt"
                )
            return tuple(_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(found))
        return (_one_prompt(found, "prompt"),)

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, found: int | None) -> int | None:
        if found is not None and not 0 <= found <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"'logprobs' must be null or an integer from 0 to {MAX_LOGPROBS}", "logprobs"
            )
        return found

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, tools: Any) -> None:
        if tools:
            raise InvalidRequestError("'tools' needs /v1/chat/completions", "tools")
        return None

    @model_validator(mode="after")
    def _one_session(self) -> CompletionRequest:
        if self.session is not None and len(self.prompts) > 1:
            raise InvalidRequestError("a request with a 'session' takes one prompt", "prompt")
        return self

    @property
    def prompts(self) -> tuple[str | list[int], ...]:
        return self.prompt  # type: ignore[return-value]  (the validator made it a tuple)

    @property
    def prompt_count(self) -> int:
        return len(self.prompts)

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def default_max_tokens(self, room: int) -> int:
        return max(1, min(DEFAULT_COMPLETION_MAX_TOKENS, room))

    def prompt_ids(
        self, tokenizer: PreTrainedTokenizerBase, index: int = 0, processor: Any = None
    ) -> list[int]:
        return encode_prompt(tokenizer, self.prompts[index])


REQUESTS: dict[Kind, type[SamplingRequest]] = {
    "chat": ChatCompletionRequest,
    "text": CompletionRequest,
}


def parse(kind: Kind, body: dict[str, Any]) -> SamplingRequest:
    """An OpenAI chat (kind 'chat') or completions ('text') body as its request model;
    InvalidRequestError naming the first field that is wrong."""
    return validate(REQUESTS[kind], body)


def _same(value: object, allowed: object) -> bool:
    """Equality that keeps True apart from 1 and False apart from 0."""
    return type(value) is type(allowed) and value == allowed


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
