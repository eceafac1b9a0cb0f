"""Tools on a model whose chat template cannot show them (tiny-llama's, like SmolLM2's): the
generic format, through the clients people use unmodified (LangChain, Anthropic's SDK,
Ollama's, litellm), and what those clients send that other servers take (system messages
anywhere, a max_tokens past the context, a JSON body without its Content-Type)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from transformers import AutoTokenizer

from neuronpy.server.generic_tools import (
    CALL_START,
    RESULT_START,
    messages_with_tools,
    system_messages_first,
)
from neuronpy.server.protocol import parse
from tests.servers import FIXTURES, RunningServer, fixture_model, run_server

MODEL = "tiny-llama"  # its chat template drops tools
CONTEXT = 512
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}
ASK = "Weather in Paris?"


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server(fixture_model(MODEL)) as running:
        yield running


def prompt_tokens(server: RunningServer, **body: Any) -> int:
    """The prompt's length as the server counts it (one token generated)."""
    reply = httpx.post(
        f"{server.v1}/chat/completions",
        json={"model": MODEL, "max_tokens": 1, **body},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens"]


# ---- the format --------------------------------------------------------------------------------


def test_a_conversation_with_calls_and_results_is_written_in_the_generic_shape() -> None:
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Lyon"}},
                },
            ],
        },
        {"role": "tool", "content": "18 C, sunny", "tool_call_id": "a"},
        {"role": "tool", "content": "21 C, cloudy", "tool_call_id": "b"},
    ]
    shown = messages_with_tools(history, [WEATHER], "auto")
    assert [m["role"] for m in shown] == ["system", "user", "assistant", "user"]
    assert shown[0]["content"].startswith("Be brief.\n\nYou have these tools:")
    assert json.dumps(WEATHER["function"]["parameters"]) in shown[0]["content"]
    calls = shown[2]["content"].split("\n")
    assert calls[:3] == [
        CALL_START,
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "</tool_call>",
    ]
    assert '{"name": "get_weather", "arguments": {"city": "Lyon"}}' in calls
    assert "tool_calls" not in shown[2]
    # both results in one user turn, in order: templates that insist on alternation take it
    results = shown[3]["content"]
    assert results.count(RESULT_START) == 2 and results.index("18 C") < results.index("21 C")
    # "required" says the reply is a call; no system message: one is made first
    forced = messages_with_tools([{"role": "user", "content": ASK}], [WEATHER], "required")
    assert forced[0]["role"] == "system" and "Answer by calling a tool" in forced[0]["content"]
    # a template without a system role: the tools open the first user turn
    inline = messages_with_tools([{"role": "user", "content": ASK}], [WEATHER], "auto", False)
    assert [m["role"] for m in inline] == ["user"] and inline[0]["content"].endswith(ASK)


REFUSES_LATE_SYSTEM = (
    "{%- for m in messages -%}{%- if m['role'] == 'system' and not loop.first -%}"
    "{{ raise_exception('System message must be at the beginning.') }}{%- endif -%}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
REFUSES_SYSTEM = (
    "{%- for m in messages -%}{%- if m['role'] == 'system' -%}"
    "{{ raise_exception('System role not supported') }}{%- endif -%}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)


def test_templates_that_refuse_system_messages_where_clients_send_them() -> None:
    """A system message after the first turn (Anthropic's mid-conversation ones) goes to the
    front where the template takes one only there; where it takes none, the generic tools
    open the first user turn."""
    tokenizer = AutoTokenizer.from_pretrained(FIXTURES / MODEL)
    tokenizer.chat_template = REFUSES_LATE_SYSTEM
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": ASK},
    ]
    assert system_messages_first(messages) == [
        {"role": "system", "content": "Be brief.\n\nAnswer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "user", "content": ASK},
    ]
    req = parse("chat", {"model": MODEL, "messages": messages})
    text = tokenizer.decode(req.prompt_ids(tokenizer))
    assert text.startswith("<|im_start|>system\nBe brief.\n\nAnswer in French.<|im_end|>")
    tokenizer.chat_template = REFUSES_SYSTEM
    req = parse("chat", {"model": MODEL, "messages": messages[1:2], "tools": [WEATHER]})
    req.show_tools_generically()
    text = tokenizer.decode(req.prompt_ids(tokenizer))
    assert text.startswith("<|im_start|>user\nYou have these tools:")


# ---- the server ----------------------------------------------------------------------------------


def test_auto_tools_are_shown_and_the_model_chooses(server: RunningServer) -> None:
    """With tools and no tool_choice (every agent's default) the reply is a 200: the tools are
    in the prompt, and the reply is text or well-formed calls."""
    bare = prompt_tokens(server, messages=[{"role": "user", "content": ASK}])
    shown = prompt_tokens(server, messages=[{"role": "user", "content": ASK}], tools=[WEATHER])
    assert shown > bare + 30
    api = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    reply = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASK}], tools=[WEATHER], max_tokens=24
    )
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for call in choice.message.tool_calls or ():
        assert call.function.name == "get_weather"
        assert set(json.loads(call.function.arguments)) == {"city"}
    # a named function: held to a call of it, its arguments valid
    named = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": ASK}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
    )
    (call,) = named.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    assert len(json.loads(call.function.arguments)["city"]) <= 12


def test_langchain_bind_tools_and_a_tool_result_turn(server: RunningServer) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL, base_url=server.v1, api_key="unused", max_tokens=16, max_retries=0
    )
    bound = llm.bind_tools([WEATHER])
    first = bound.invoke([HumanMessage(ASK)])
    assert isinstance(first, AIMessage)
    assert first.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    call = {"name": "get_weather", "args": {"city": "Paris"}, "id": "call_1", "type": "tool_call"}
    history = [
        HumanMessage(ASK),
        AIMessage("", tool_calls=[call]),
        ToolMessage("18 C and sunny", tool_call_id="call_1"),
    ]
    second = bound.invoke(history)
    assert isinstance(second, AIMessage)
    assert second.usage_metadata and second.usage_metadata["input_tokens"] > 0


def test_anthropic_tools_auto_system_anywhere_and_max_tokens_past_the_context(
    server: RunningServer,
) -> None:
    """What Claude Code's first request holds: tools without tool_choice, a system message
    in the middle of `messages`, max_tokens 32000 over a smaller context, thinking "adaptive",
    context_management and output_config.effort; the SDK reads `request-id`."""
    api = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tool = {
        "name": "get_weather",
        "input_schema": WEATHER["function"]["parameters"],
    }
    with api.messages.stream(  # (the SDK streams a request this long, as Claude Code does)
        model=MODEL,
        max_tokens=32000,
        system="You are a helpful assistant.",
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "system", "content": "Answer briefly."},  # type: ignore[misc,list-item]
            {"role": "user", "content": ASK},
        ],
        tools=[tool],
        thinking={"type": "adaptive"},  # type: ignore[arg-type,typeddict-item]
        extra_body={"context_management": {"edits": []}, "output_config": {"effort": "low"}},
    ) as stream:
        reply = stream.get_final_message()
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert reply.usage.input_tokens + reply.usage.output_tokens <= CONTEXT
    for block in reply.content:
        assert block.type in ("text", "tool_use")
        if block.type == "tool_use":
            assert block.name == "get_weather" and set(block.input) == {"city"}
    # the tool's result turn
    raw = api.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=8,
        messages=[
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "t1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "18 C"}],
            },
        ],
        tools=[tool],
        tool_choice={"type": "auto"},
    )
    follow = raw.parse()
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert raw.headers["request-id"] == raw.headers["x-request-id"] == follow._request_id


def test_ollama_tools_and_num_predict_past_the_context(server: RunningServer) -> None:
    api = ollama.Client(host=server.url)
    plain = api.chat(
        model=MODEL, messages=[{"role": "user", "content": ASK}], options={"num_predict": 1}
    )
    reply = api.chat(
        model=MODEL,
        messages=[{"role": "user", "content": ASK}],
        tools=[WEATHER],
        options={"num_predict": 100_000},
    )
    assert (reply.prompt_eval_count or 0) > (plain.prompt_eval_count or 0) + 30  # tools shown
    assert (reply.prompt_eval_count or 0) + (reply.eval_count or 0) <= CONTEXT
    assert reply.done_reason in ("stop", "length")
    for call in reply.message.tool_calls or ():
        assert call.function.name == "get_weather"
    shown = api.show(MODEL)
    assert "tools" in (shown.capabilities or [])
    assert shown.details and shown.details.quantization_level == "F32"
    assert shown.details.parameter_size and shown.details.parameter_size.endswith(("K", "M"))


def test_litellm_ollama_providers_send_no_content_type(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """litellm's ollama/ (/api/generate) and ollama_chat/ (/api/chat) providers post JSON
    without a Content-Type; Ollama's own server takes that, and so does this one."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # (it would fetch it)
    import litellm

    for provider in ("ollama", "ollama_chat"):
        out = litellm.completion(
            model=f"{provider}/{MODEL}",
            api_base=server.url,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
        )
        assert out.choices[0].message.content is not None
        assert out.usage.completion_tokens and out.usage.completion_tokens <= 4


JS = Path(__file__).parent / "js"


@pytest.mark.skipif(
    shutil.which("node") is None or not (JS / "node_modules" / "ai").is_dir(),
    reason="the Vercel AI SDK is not installed (npm ci --prefix tests/js)",
)
def test_vercel_ai_sdk_tools_and_a_tool_result_turn(server: RunningServer) -> None:
    """The AI SDK's generateText with tools (its default: the model chooses) through its
    OpenAI-compatible provider, then a tool-result turn (tests/js/ai_sdk_tools.mjs)."""
    done = subprocess.run(
        ["node", str(JS / "ai_sdk_tools.mjs"), server.v1, MODEL],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for turn in ("first", "second"):
        assert out[turn]["finishReason"] in ("stop", "length", "tool-calls"), out
        assert out[turn]["inputTokens"] > 0
        for call in out[turn]["toolCalls"]:
            assert call["name"] == "get_weather" and set(call["input"]) == {"city"}
    assert out["second"]["inputTokens"] > out["first"]["inputTokens"]  # the call and its result
