"""Ollama's API requests (/api/chat, /api/generate), validated, and the chat or completions
request each means: `options` become the sampling parameters, `format` the structured output,
`think` whether reasoning is answered, `tools` the chat's. What Ollama allows but neuronpy
cannot honour is refused by name; its load-time options are accepted and left as the server
was started (they are not per request here)."""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import ConfigDict, field_validator, model_validator

from neuronpy.errors import InvalidRequestError
from neuronpy.server.chat_input import (
    CalledFunction,
    Message,
    TextPart,
    Tool,
    ToolCall,
    image_part,
)
from neuronpy.server.protocol import ChatCompletionRequest, CompletionRequest
from neuronpy.server.schema import FieldError, WireModel, build, json_type, validate

LATEST = ":latest"  # the tag Ollama gives a model named without one
# options that set how Ollama loads a model: this server's are set when it starts
LOAD_OPTIONS = (
    "num_ctx",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "low_vram",
    "num_thread",
    "numa",
    "use_mmap",
    "use_mlock",
    "vocab_only",
    "embedding_only",
    "logits_all",
    "num_keep",
    "f16_kv",
)
# sampling options taken as they are (Ollama's name: the OpenAI/vLLM parameter)
SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# what the chat request's errors name, as Ollama's request names it
OPTION_NAMES = {chat: f"options.{name}" for name, chat in SAMPLING.items()}
OPTION_NAMES |= {"max_tokens": "options.num_predict", "response_format": "format"}
THINK_LEVELS = ("low", "medium", "high")
# samplers neuronpy does not have: refused unless set to what turns them off
OFF = {"mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0}
# accepted and without effect: the penalty window (the penalties see the whole context) and a
# deprecated flag
IGNORED = ("repeat_last_n", "penalize_newline", "mirostat_tau", "mirostat_eta")


def model_name(name: str) -> str:
    """The served model an Ollama name means: `NAME:latest` is NAME."""
    return name[: -len(LATEST)] if name.endswith(LATEST) else name


def tagged(name: str) -> str:
    """How Ollama lists a model: with its tag (`:latest` when it has none)."""
    return name if ":" in name else name + LATEST


def sampling(options: dict[str, Any] | None) -> dict[str, Any]:
    """`options` as the chat/completions request's sampling parameters; InvalidRequestError
    naming `options.NAME` for one neuronpy cannot honour."""
    out: dict[str, Any] = {}
    for key, value in (options or {}).items():
        where = f"options.{key}"
        if key in SAMPLING:
            out[SAMPLING[key]] = value
        elif key == "num_predict":
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidRequestError(f"'{where}' must be an integer", where)
            if value > 0:
                out["max_tokens"] = value
            elif value not in (-1, -2):  # -1: no limit, -2: fill the context (both: the rest)
                raise InvalidRequestError(f"'{where}' must be positive, -1 or -2", where)
        elif key in OFF:
            if value is not None and value != OFF[key]:
                raise InvalidRequestError(
                    f"'{where}' is not supported by this server (only {OFF[key]}: off)", where
                )
        elif key not in LOAD_OPTIONS and key not in IGNORED:
            raise InvalidRequestError(f"'{where}' is not an option this server knows", where)
    if isinstance(out.get("temperature"), int) and not isinstance(out["temperature"], bool):
        out["temperature"] = float(out["temperature"])
    for name in ("top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if isinstance(out.get(name), int) and not isinstance(out[name], bool):
            out[name] = float(out[name])
    return out


def structured(fmt: object) -> dict[str, Any] | None:
    """`format` as a response_format: "json" any JSON object, a JSON Schema that schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise InvalidRequestError("'format' must be \"json\" or a JSON Schema object", "format")


class OllamaToolCallFunction(WireModel):
    name: str
    arguments: dict[str, Any] | None = None
    index: int | None = None


class OllamaToolCall(WireModel):
    function: OllamaToolCallFunction


class OllamaMessage(WireModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = None
    images: list[Any] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None

    @model_validator(mode="after")
    def _images(self) -> OllamaMessage:
        if self.images and self.role != "user":
            raise FieldError("{at}.images: only a user's message may hold images", "{at}.images")
        if self.images and not all(isinstance(i, str) for i in self.images):
            raise FieldError("{at}.images must be a list of base64 strings", "{at}.images")
        return self

    def as_chat(self, index: int) -> Message:
        """This message (`messages[index]`) as the chat message it means, built from its fields
        (`build`): a value the chat's rules refuse is a 400 naming this message."""
        at = ("messages", index)
        if self.role == "tool":
            call_id = self.tool_name or f"call_{index}"
            return build(Message, at, role="tool", content=self.content or "", tool_call_id=call_id)
        calls = [
            build(
                ToolCall,
                (*at, "tool_calls", j),
                id=f"call_{index}_{j}",
                function=build(
                    CalledFunction,
                    (*at, "tool_calls", j, "function"),
                    name=c.function.name,
                    arguments=json.dumps(c.function.arguments or {}),
                ),
            )
            for j, c in enumerate(self.tool_calls or ())
        ]
        content: str | list[TextPart] = self.content or ""
        if self.images:  # the images, then the text (as Ollama's templates place them)
            content = [
                *(
                    image_part(d, f"messages[{index}].images[{k}]")
                    for k, d in enumerate(self.images)
                ),
                TextPart(type="text", text=self.content or ""),
            ]
        return build(
            Message,
            at,
            role=self.role,
            content=content,
            tool_calls=calls or None,
            reasoning_content=self.thinking if self.role == "assistant" else None,
        )


class OllamaBase(WireModel):
    """What /api/chat and /api/generate share."""

    model: str
    stream: bool = True
    format: Any = None
    options: dict[str, Any] | None = None
    keep_alive: Any = None  # (the model stays loaded while the server runs)
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("think", mode="before")
    @classmethod
    def _think(cls, value: Any) -> Any:
        # (checked before the union, whose own error would name its member: 'think.bool')
        if value is None or isinstance(value, bool) or value in THINK_LEVELS:
            return value
        shown = f"{value[:40]!r}" if isinstance(value, str) else json_type(value)
        raise InvalidRequestError(
            f'\'think\' must be true, false, "low", "medium" or "high", got {shown}', "think"
        )

    @property
    def shows_thinking(self) -> bool:
        return self.think is not None and self.think is not False

    def common(self) -> dict[str, Any]:
        values = sampling(self.options)
        response_format = structured(self.format)
        if response_format is not None:
            values["response_format"] = response_format
        if self.logprobs:
            values["logprobs"] = True
            if self.top_logprobs:
                values["top_logprobs"] = self.top_logprobs
        if isinstance(self.think, str):  # a level: the template's reasoning effort (gpt-oss's)
            values["reasoning_effort"] = self.think
        return values


class OllamaChatRequest(OllamaBase):
    messages: list[OllamaMessage]
    tools: list[Tool] | None = None

    def chat(self) -> OllamaChat:
        values = {
            **self.common(),
            "messages": [m.as_chat(i) for i, m in enumerate(self.messages)],
            "tools": self.tools,
        }
        return translated(OllamaChat, values)


class OllamaGenerateRequest(OllamaBase):
    prompt: str = ""
    system: str | None = None
    raw: bool | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[Any] | None = None

    @model_validator(mode="after")
    def _honoured(self) -> OllamaGenerateRequest:
        if self.suffix:
            raise InvalidRequestError("'suffix' (fill in the middle) is not supported", "suffix")
        if self.template:
            raise InvalidRequestError(
                "'template' is not supported: the model's own chat template is used (or none, "
                "with raw)",
                "template",
            )
        if self.context:
            raise InvalidRequestError(
                "'context' (token ids of an earlier reply) is not supported: send the "
                "conversation to /api/chat instead",
                "context",
            )
        if self.images and not all(isinstance(i, str) for i in self.images):
            raise InvalidRequestError("'images' must be a list of base64 strings", "images")
        if self.images and self.raw:
            raise InvalidRequestError("'images' need a templated prompt (raw is true)", "images")
        return self

    def request(self) -> OllamaChat | OllamaText:
        """The chat request (the prompt through the model's template, after `system`) or,
        with `raw`, the completions request (the prompt as it is)."""
        values = self.common()
        if self.raw:
            if self.system:
                raise InvalidRequestError("'system' needs a templated prompt (raw is true)", "raw")
            logprobs = values.pop("logprobs", None)
            top = values.pop("top_logprobs", None)
            if logprobs:
                values["logprobs"] = top or 0
            return translated(OllamaText, {**values, "prompt": self.prompt})
        content: Any = self.prompt
        if self.images:
            pictures = [image_part(d, f"images[{k}]") for k, d in enumerate(self.images)]
            content = [*pictures, TextPart(type="text", text=self.prompt)]
        messages: list[Any] = [build(Message, ("prompt",), role="user", content=content)]
        if self.system:
            messages.insert(0, {"role": "system", "content": self.system})
        return translated(OllamaChat, {**values, "messages": messages})


class OllamaChat(ChatCompletionRequest):
    """The chat request an Ollama request means, the engine's errors named as Ollama names
    its fields."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    caps_max_tokens: ClassVar[bool] = True  # (num_predict past the context: what fits)

    @property
    def param_names(self) -> dict[str, str]:
        return {"max_tokens": "options.num_predict", "prompt": "messages"}


class OllamaText(CompletionRequest):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    caps_max_tokens: ClassVar[bool] = True  # (num_predict past the context: what fits)

    @property
    def param_names(self) -> dict[str, str]:
        return {"max_tokens": "options.num_predict"}


M = TypeVar("M", OllamaChat, OllamaText)


def translated(model: type[M], values: dict[str, Any]) -> M:
    """The chat or completions request an Ollama request means; InvalidRequestError naming the
    field as Ollama's request names it (`options.top_k`, not the chat request's `top_k`)."""
    try:
        return validate(model, values)
    except InvalidRequestError as exc:
        param = exc.param or ""
        name = OPTION_NAMES.get(re.split(r"[.\[]", param)[0])
        if name is None:
            raise
        # (a schema's place within `format` is chat's `response_format.json_schema.schema`)
        message = re.sub(rf"\b{re.escape(param)}\b", name, exc.message)
        raise InvalidRequestError(message, name) from None


def parse(model: type[OllamaBase], body: dict[str, Any]) -> Any:
    return validate(model, body)
