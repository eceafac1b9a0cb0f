"""Reasoning blocks and tool calls: the parser, the router (token ids in), and the server
through the real openai client, with the markup cut at every point of the text."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from neuronpy.config import EngineConfig, load_config
from neuronpy.engine.output import Parsed, output_parser
from neuronpy.engine.reasoning import resolve_reasoning_parser
from neuronpy.engine.request import Finish, RouterMessage
from neuronpy.engine.router import route
from neuronpy.engine.tools import parse_tool_call
from neuronpy.engine.types import (
    FinishReason,
    GenerationEvent,
    OutputFormat,
    SamplingParams,
    TokenLogprob,
)
from neuronpy.server.prompts import render_chat
from tests.factories import skip_unless_built_with_this_transformers
from tests.scripted import Scripts
from tests.servers import FIXTURES, RunningServer, fixture_model, run_server
from tests.test_fixtures import bf

MODEL = bf.TOOLS_FIXTURE
THINK_AND_TOOLS = OutputFormat(reasoning="think", tool_calls=True)

# A reply with a reasoning block, some content and two parallel tool calls.
PARALLEL = (
    "<think>\nThe user wants both.\n</think>\n\nLet me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)
# A malformed call (not JSON) comes back as text; the well-formed one after it is a call.
MALFORMED = 'Hi <tool_call>{"name": oops}</tool_call>\n<tool_call>{"name": "f"}</tool_call>'


@dataclass(frozen=True)
class Reply:
    """What a client ends up with: reasoning, content, tool calls (name, arguments object)."""

    reasoning: str
    content: str
    calls: tuple[tuple[str, Any], ...]
    finish: str | None = None


PARALLEL_REPLY = Reply(
    "The user wants both.",
    "Let me check.",
    (("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})),
    "tool_calls",
)
STRIDE = 7  # the HTTP test cuts every 7th character (see cuts())
MALFORMED_REPLY = Reply("", 'Hi <tool_call>{"name": oops}</tool_call>', (("f", {}),), "tool_calls")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(FIXTURES / MODEL)


def splits(text: str) -> Iterator[tuple[str, str]]:
    for i in range(len(text) + 1):
        yield text[:i], text[i:]


# ---- the parser: text deltas in ---------------------------------------------------------------


def parse(pieces: Sequence[str], output: OutputFormat = THINK_AND_TOOLS, opened: bool = False):
    parser = output_parser(output, opened=opened)
    out = Parsed()
    for piece in pieces:
        out.extend(parser.push(piece))
    out.extend(parser.finish())
    return out


def summary(out: Parsed) -> tuple[str, str, list[tuple[str, str]]]:
    calls = [(c.name, c.arguments) for c in out.tool_calls]
    assert all("".join(c.pieces) == c.arguments for c in out.tool_calls)
    assert [c.index for c in out.tool_calls] == list(range(len(out.tool_calls)))
    return out.reasoning, out.content, calls


PARSER_CASES = [
    (PARALLEL, THINK_AND_TOOLS),
    (MALFORMED, THINK_AND_TOOLS),
    # unterminated call and reasoning cut short: text, never lost
    ('  <think> x </think> y <tool_call>{"name": "f"}', THINK_AND_TOOLS),
    ("<think>still thinking </thi", THINK_AND_TOOLS),
    # lookalikes: markers are only markers when whole, reasoning only at the start
    ("a <tool_ca <think> b </think> <tool_call", THINK_AND_TOOLS),
    ("<thinking> is a word\n\n", THINK_AND_TOOLS),
    # without tools or reasoning, everything is content, exactly
    (PARALLEL, OutputFormat()),
    (PARALLEL, OutputFormat(reasoning="think")),
]


@pytest.mark.parametrize(("text", "output"), PARSER_CASES)
def test_parser_gives_the_same_split_wherever_the_deltas_are_cut(text, output) -> None:
    whole = summary(parse([text], output))
    for head, tail in splits(text):
        assert summary(parse([head, tail], output)) == whole, (head, tail)
        for j in range(0, len(tail) + 1, 5):
            assert summary(parse([head, tail[:j], tail[j:]], output)) == whole
    assert summary(parse(list(text), output)) == whole  # one character per delta


def test_parser_results() -> None:
    reasoning, content, calls = summary(parse([PARALLEL]))
    assert (reasoning, content) == ("The user wants both.", "Let me check.")
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')]
    assert summary(parse([MALFORMED]))[1:] == (MALFORMED_REPLY.content, [("f", "{}")])
    assert summary(parse([PARALLEL], OutputFormat())) == ("", PARALLEL, [])
    # a prompt that opened the block: the reply starts inside it
    assert summary(parse(["hmm\n</think>\n\nok"], opened=True)) == ("hmm", "ok", [])
    unterminated = summary(parse(['Sure. <tool_call>{"name": "f"'], THINK_AND_TOOLS))
    assert unterminated == ("", 'Sure. <tool_call>{"name": "f"', [])
    # parallel_tool_calls false: the first call only
    one = OutputFormat(tool_calls=True, parallel_tool_calls=False)
    assert [c[0] for c in summary(parse([PARALLEL], one))[2]] == ["get_weather"]


def test_arguments_stream_in_the_pieces_the_model_wrote_them() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"a": [1, 2], "b": "x"}}</tool_call>'
    cut = text.index("[1") + 2
    (call,) = parse([text[:cut], text[cut:]]).tool_calls
    assert call.arguments == '{"a": [1, 2], "b": "x"}'
    assert call.pieces == ('{"a": [1', ', 2], "b": "x"}')
    assert call.id.startswith("call_")


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('{"name": "f", "arguments": {"x": 1}}', ("f", '{"x": 1}')),
        ('\n{"name": "f", "parameters": {}}\n', ("f", "{}")),
        ('{"name": "f", "arguments": "{\\"x\\": 1}"}', ("f", '{"x": 1}')),
        ('{"name": "f"}', ("f", "{}")),
        ('{"name": "", "arguments": {}}', None),
        ('{"arguments": {}}', None),
        ('{"name": "f", "arguments": [1]}', None),
        ('{"name": "f", "arguments": "nope"}', None),
        ('[{"name": "f"}]', None),
        ('{"name": "f", "arguments": {}', None),
    ],
)
def test_tool_call_bodies(body: str, expected: tuple[str, str] | None) -> None:
    call = parse_tool_call(body)
    assert (call and (call.name, call.arguments)) == expected


# ---- the router: token ids in -----------------------------------------------------------------


async def run_router(
    tokenizer: Any,
    ids: Sequence[int | TokenLogprob],
    params: SamplingParams,
    prompt: Sequence[int] = (5, 6),
) -> list[GenerationEvent]:
    to_router, inbox = anyio.create_memory_object_stream[RouterMessage](math.inf)
    outbox, events = anyio.create_memory_object_stream[GenerationEvent](math.inf)
    for token in ids:
        to_router.send_nowait(token)
    to_router.send_nowait(Finish(FinishReason.STOP))
    to_router.close()
    await route(
        inbox,
        outbox,
        tokenizer=tokenizer,
        prompt_ids=tuple(prompt),
        params=params,
        silent_ids={tokenizer.eos_token_id},
        request_leave=lambda: None,
    )
    async with events:
        return [event async for event in events]


def reply_of(events: Sequence[GenerationEvent]) -> Reply:
    calls = tuple((c.name, json.loads(c.arguments)) for e in events for c in e.tool_calls)
    reasoning = "".join(e.reasoning for e in events)
    return Reply(reasoning, "".join(e.text for e in events), calls, None)


@pytest.mark.anyio
async def test_router_splits_markup_cut_at_every_point_of_the_token_stream(tokenizer) -> None:
    """The markup tokens are added tokens: cutting the text anywhere spells the markers cut
    there out of byte-level pieces, or keeps them whole."""
    params = SamplingParams(output=THINK_AND_TOOLS)
    eos = tokenizer.eos_token_id
    for text, expected in ((PARALLEL, PARALLEL_REPLY), (MALFORMED, MALFORMED_REPLY)):
        expected = Reply(expected.reasoning, expected.content, expected.calls)
        for head, tail in splits(text):
            ids = [*tokenizer.encode(head), *tokenizer.encode(tail), eos]
            events = await run_router(tokenizer, ids, params)
            assert reply_of(events) == expected, (head, tail)
            assert events[-1].completion_tokens == len(ids)
            assert sum(len(e.token_ids) for e in events) == len(ids)
    # each character its own token: every point is cut at once
    ids = [t for ch in PARALLEL for t in tokenizer.encode(ch)]
    assert len(ids) == len(PARALLEL)
    events = await run_router(tokenizer, ids, params)
    expected = PARALLEL_REPLY
    assert reply_of(events) == Reply(expected.reasoning, expected.content, expected.calls)


@pytest.mark.anyio
async def test_router_starts_inside_a_block_the_prompt_opened(tokenizer) -> None:
    prompt = tokenizer.encode("<|im_start|>assistant\n<think>\n")
    ids = tokenizer.encode("plan\n</think>\n\nanswer")
    events = await run_router(tokenizer, ids, SamplingParams(output=THINK_AND_TOOLS), prompt)
    assert reply_of(events) == Reply("plan", "answer", ())
    # no reasoning parser: the same tokens are content
    events = await run_router(tokenizer, ids, SamplingParams(), prompt)
    assert reply_of(events) == Reply("", "plan\n</think>\n\nanswer", ())


@pytest.mark.anyio
async def test_router_sends_an_event_per_token_with_its_logprobs(tokenizer) -> None:
    ids = tokenizer.encode("<tool_call>x")
    lps = [TokenLogprob(t, -0.5, ((t, -0.5),)) for t in ids]
    params = SamplingParams(logprobs=1, output=THINK_AND_TOOLS)
    events = await run_router(tokenizer, lps, params)
    assert [e.logprobs for e in events[:-1]] == [(lp,) for lp in lps]  # text held or not
    assert "".join(e.text for e in events) == "<tool_call>x"  # never closed: text


def test_reasoning_parser_is_detected_from_the_chat_template(tokenizer) -> None:
    plain = AutoTokenizer.from_pretrained(FIXTURES / "tiny-llama")
    assert resolve_reasoning_parser("auto", tokenizer) == "think"
    assert resolve_reasoning_parser("auto", plain) is None
    assert resolve_reasoning_parser("think", plain) == "think"
    assert resolve_reasoning_parser("none", tokenizer) is None
    with pytest.raises(ValueError, match="reasoning_parser"):
        EngineConfig(reasoning_parser="xml")
    with pytest.raises(ValueError, match="reasoning_parser"):
        load_config(models=[{"reasoning_parser": "xml"}], environ={})
    (spec,) = load_config(models=[{"reasoning_parser": "none"}], environ={}).models
    assert spec.engine.reasoning_parser == "none"


def test_tools_fixture_rebuilds_byte_identical(tmp_path: Path) -> None:
    skip_unless_built_with_this_transformers(FIXTURES / MODEL)
    bf.build_tools_fixture(tmp_path)
    committed, rebuilt = FIXTURES / MODEL, tmp_path / MODEL
    files = sorted(p.name for p in committed.iterdir())
    assert files == sorted(p.name for p in rebuilt.iterdir())
    assert sum((committed / f).stat().st_size for f in files) < 500_000
    for name in files:
        assert (committed / name).read_bytes() == (rebuilt / name).read_bytes(), name


# ---- the server, through the openai client ----------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
        },
    },
]


NAMES_ONLY = [{"type": "function", "function": {"name": t["function"]["name"]}} for t in TOOLS]


@dataclass
class ToolServer:
    server: RunningServer
    scripts: Scripts
    tokenizer: Any

    def script(self, key: str, *texts: str) -> list[dict[str, str]]:
        """The reply to a request with these messages: `texts` tokenized one by one (cut
        between them), then EOS."""
        ids = [t for text in texts for t in self.tokenizer.encode(text)]
        self.scripts.add(key, [*ids, self.tokenizer.eos_token_id])
        return [{"role": "user", "content": f"Go {key}"}]

    def api(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.server.v1, api_key="unused", max_retries=0, timeout=120
        )


@pytest.fixture(scope="module")
def tools_server(tokenizer: Any) -> Iterator[ToolServer]:
    with run_server(fixture_model(MODEL, max_in_flight=16, max_queue=1024)) as server:
        engine = server.state.models[MODEL].engine
        assert engine is not None
        scripts = Scripts()
        scripts.attach(engine)
        yield ToolServer(server, scripts, tokenizer)


async def ask(api: openai.AsyncOpenAI, stream: bool, **kwargs: Any) -> Reply:
    """One chat request; what the client makes of it, streamed or not."""
    kwargs = {"model": MODEL, "temperature": 0.0, "max_tokens": 300, **kwargs}
    if not stream:
        out = await api.chat.completions.create(**kwargs)
        (choice,) = out.choices
        message = choice.message
        calls = tuple(
            (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()
        )
        assert all(
            c.id.startswith("call_") and c.type == "function" for c in message.tool_calls or ()
        )
        extra = message.model_extra or {}
        reasoning = extra.get("reasoning_content") or ""
        assert (extra.get("reasoning") or "") == reasoning  # vLLM's name for the same text
        return Reply(reasoning, message.content or "", calls, choice.finish_reason)
    reasoning, content, finish = "", "", None
    calls: dict[int, dict[str, Any]] = {}
    async for chunk in await api.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            extra = delta.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            assert extra.get("reasoning") == extra.get("reasoning_content")
            content += delta.content or ""
            for call in delta.tool_calls or ():
                if call.index not in calls:  # the first chunk of a call: id and name
                    assert call.id and call.id.startswith("call_") and call.function.name
                    calls[call.index] = {"name": call.function.name, "arguments": ""}
                else:
                    assert call.id is None and call.function.name is None
                calls[call.index]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert sorted(calls) == list(range(len(calls)))
    parsed = tuple((calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls))
    return Reply(reasoning, content, parsed, finish)


def cuts(text: str, offset: int, stride: int = STRIDE) -> list[str]:
    """`text` cut at `offset`, `offset + stride`, `offset + 2 * stride`, ..."""
    edges = [0, *range(offset, len(text), stride), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(edges)]


@pytest.mark.anyio
async def test_http_markup_cut_at_every_point_streamed_and_not(tools_server: ToolServer) -> None:
    """Both replies through the server, streamed and not, cut at every point of their text:
    request k cuts at k, k + STRIDE, k + 2 * STRIDE... (each piece tokenized on its own), so
    STRIDE requests cover every point; one more request cuts at every character. They run all
    at once, sharing the batch. (The router test above takes each cut alone.)"""
    jobs = []
    for name, text, expected in (
        ("par", PARALLEL, PARALLEL_REPLY),
        ("bad", MALFORMED, MALFORMED_REPLY),
    ):
        for k in range(STRIDE):
            messages = tools_server.script(f"[{name}-{k}]", *cuts(text, k))
            jobs += [(messages, stream, expected) for stream in (False, True)]
        messages = tools_server.script(f"[{name}-chars]", *text)
        jobs += [(messages, stream, expected) for stream in (False, True)]
    results: list[Reply | None] = [None] * len(jobs)
    async with tools_server.api() as api, anyio.create_task_group() as tg:
        for k, (messages, stream, _) in enumerate(jobs):

            async def one(k: int = k, messages: Any = messages, stream: bool = stream) -> None:
                results[k] = await ask(api, stream, messages=messages, tools=NAMES_ONLY)

            tg.start_soon(one)
    for (messages, stream, expected), got in zip(jobs, results, strict=True):
        assert got == expected, (messages, stream)


@pytest.mark.anyio
async def test_http_plain_reply_reasoning_and_text_markup(tools_server: ToolServer) -> None:
    tok = tools_server.tokenizer
    inside = tok.encode(PARALLEL).index(tok.convert_tokens_to_ids("</tool_call>"))
    after = PARALLEL[PARALLEL.index("Let") :]
    cases: list[tuple[str, tuple[str, ...], dict[str, Any], Any]] = [
        # reasoning and a plain answer: finish stop, trailing newline kept
        (
            "plain",
            ("<think>hm</think>", "Hello!\n"),
            {"tools": TOOLS},
            Reply("hm", "Hello!\n", (), "stop"),
        ),
        # no tools in the request: tool-call markup stays text (the reasoning is still split)
        ("notools", (PARALLEL,), {}, Reply("The user wants both.", after, (), "stop")),
        # tool_choice none: the same
        (
            "none",
            (PARALLEL,),
            {"tools": TOOLS, "tool_choice": "none"},
            Reply("The user wants both.", after, (), "stop"),
        ),
        # cut by max_tokens inside the first call: text, finish length
        ("cut", (PARALLEL,), {"tools": TOOLS, "max_tokens": inside}, "cut"),
        # parallel_tool_calls false: the first call only
        (
            "first",
            (PARALLEL,),
            {"tools": TOOLS, "parallel_tool_calls": False},
            Reply("The user wants both.", "Let me check.", PARALLEL_REPLY.calls[:1], "tool_calls"),
        ),
    ]
    jobs = [(case, stream) for case in cases for stream in (False, True)]
    results: list[Reply | None] = [None] * len(jobs)
    async with tools_server.api() as api, anyio.create_task_group() as tg:
        for k, ((name, texts, extra, _), stream) in enumerate(jobs):
            messages = tools_server.script(f"[{name}-{stream}]", *texts)

            async def one(k: int = k, messages: Any = messages, extra: Any = extra) -> None:
                results[k] = await ask(api, jobs[k][1], messages=messages, **extra)

            tg.start_soon(one)
    for ((name, _, _, expected), stream), got in zip(jobs, results, strict=True):
        assert got is not None
        if expected == "cut":
            assert got.finish == "length" and got.calls == (), stream
            assert got.content.startswith("Let me check.\n<tool_call>"), stream
        else:
            assert got == expected, (name, stream)


def rendered(tokenizer: Any, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
    return render_chat(tokenizer, messages, tools)


@pytest.mark.anyio
async def test_tools_and_tool_results_go_through_the_template(tools_server: ToolServer) -> None:
    tok = tools_server.tokenizer
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather and time in Paris? [history]"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"tz": "CET"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    ]
    # what the template gets: arguments as objects, content "" for a null one
    expected_messages = [dict(m) for m in history]
    expected_messages[2] = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": {"tz": "CET"}},
            },
        ],
    }
    text = tok.apply_chat_template(
        expected_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon" in text
    assert '"name": "get_weather"' in text.split("<|im_start|>user")[0]  # tools in the system turn
    ids = rendered(tok, expected_messages, TOOLS)
    # the template's own markup (instructions, the two calls) is tokens, not text
    assert ids.count(tok.convert_tokens_to_ids("<tool_call>")) == text.count("<tool_call>") == 4
    tools_server.script("[history]", "Sunny, noon.")
    async with tools_server.api() as api:
        out = await api.chat.completions.create(
            model=MODEL, messages=history, tools=TOOLS, temperature=0.0, max_tokens=50
        )
        assert out.usage.prompt_tokens == len(ids)
        assert out.choices[0].message.content == "Sunny, noon."
        # tool_choice none hides the tools; a named one shows that tool alone
        hidden = await api.chat.completions.create(
            model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=1
        )
        assert hidden.usage.prompt_tokens == len(rendered(tok, expected_messages))
        named = await api.chat.completions.create(
            model=MODEL,
            messages=history,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            max_tokens=1,
        )
        assert named.usage.prompt_tokens == len(rendered(tok, expected_messages, TOOLS[1:]))
        required = await api.chat.completions.create(
            model=MODEL, messages=history, tools=TOOLS, tool_choice="required", max_tokens=1
        )
        assert required.usage.prompt_tokens == len(ids)


def test_markup_in_a_user_message_is_plain_text(tools_server: ToolServer) -> None:
    tok = tools_server.tokenizer
    messages = [{"role": "user", "content": '<tool_call>{"name": "x"}</tool_call><think>'}]
    ids = rendered(tok, messages, TOOLS)
    markup = {tok.convert_tokens_to_ids(t) for t in bf.TOOL_TOKENS}
    user_turn = ids[ids.index(tok.convert_tokens_to_ids("<|im_start|>"), 1) :]
    assert not markup & set(user_turn)


@pytest.mark.anyio
async def test_parity_tool_calls_and_logprobs_batched_and_solo(tools_server: ToolServer) -> None:
    """Scripted tool-call replies with log-probabilities: alone, one after another, and all at
    once in one batch, the same calls, text and (within rounding) log-probabilities."""
    keys = [f"[parity-{i}]" for i in range(4)]
    for i, key in enumerate(keys):
        cut = 7 + 17 * i
        tools_server.script(key, PARALLEL[:cut], PARALLEL[cut:])

    async def one(api: openai.AsyncOpenAI, key: str) -> tuple[Any, ...]:
        out = await api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Go {key}"}],
            tools=TOOLS,
            temperature=0.0,
            max_tokens=300,
            logprobs=True,
            top_logprobs=3,
        )
        choice = out.choices[0]
        calls = tuple((c.function.name, c.function.arguments) for c in choice.message.tool_calls)
        lps = [
            (t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
            for t in choice.logprobs.content
        ]
        return calls, choice.message.content, choice.finish_reason, lps

    async with tools_server.api() as api:
        solo = [await one(api, key) for key in keys]
        before = tools_server.server.stats()
        together: list[Any] = [None] * len(keys)
        async with anyio.create_task_group() as tg:
            for i, key in enumerate(keys):

                async def run(i: int = i, key: str = key) -> None:
                    together[i] = await one(api, key)

                tg.start_soon(run)
    assert tools_server.server.stats()["multi_row_steps"] > before["multi_row_steps"]
    for alone, batched in zip(solo, together, strict=True):
        assert alone[:3] == batched[:3]
        assert alone[0] == (("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}'))
        assert alone[2] == "tool_calls"
        assert len(alone[3]) == len(batched[3])
        for (tok_a, lp_a, top_a), (tok_b, lp_b, top_b) in zip(alone[3], batched[3], strict=True):
            assert tok_a == tok_b and lp_a == pytest.approx(lp_b, abs=1e-4)
            assert [v for _, v in top_a] == pytest.approx([v for _, v in top_b], abs=1e-4)


# ---- validation: 400 naming the field -----------------------------------------------------------

MSG = [{"role": "user", "content": "hi"}]
TOOL = TOOLS[0]
BAD_TOOLS: list[tuple[str, dict[str, Any], str]] = [
    ("tools-not-list", {"tools": {"a": 1}}, "tools"),
    ("tool-not-function", {"tools": [{"type": "code"}]}, "tools[0].type"),
    ("tool-no-function", {"tools": [{"type": "function"}]}, "tools[0].function"),
    (
        "tool-bad-name",
        {"tools": [{"type": "function", "function": {"name": "a b"}}]},
        "tools[0].function.name",
    ),
    ("tool-no-name", {"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ("tool-duplicate", {"tools": [TOOL, TOOL]}, "tools[1].function.name"),
    (
        "tool-bad-parameters",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
        "tools[0].function.parameters",
    ),
    (
        "tools-too-many",
        {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
        "tools",
    ),
    ("choice-unknown", {"tools": [TOOL], "tool_choice": "always"}, "tool_choice"),
    ("choice-required-no-tools", {"tool_choice": "required"}, "tool_choice"),
    (
        "choice-not-a-tool",
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ("choice-malformed", {"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice"),
    ("choice-number", {"tools": [TOOL], "tool_choice": 3}, "tool_choice"),
    ("parallel-not-bool", {"tools": [TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ("functions", {"functions": [{"name": "f"}]}, "functions"),
    (
        "tool-message-no-id",
        {"messages": [*MSG, {"role": "tool", "content": "x"}]},
        "messages[1].tool_call_id",
    ),
    (
        "assistant-calls-not-list",
        {"messages": [*MSG, {"role": "assistant", "content": None, "tool_calls": {}}]},
        "messages[1].tool_calls",
    ),
    (
        "assistant-call-bad-arguments",
        {
            "messages": [
                *MSG,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{oops"},
                        }
                    ],
                },
            ]
        },
        "messages[1].tool_calls",
    ),
    (
        "reasoning-not-string",
        {"messages": [*MSG, {"role": "assistant", "content": "x", "reasoning_content": 5}]},
        "messages[1].reasoning_content",
    ),
]


@pytest.mark.parametrize(
    ("body", "param"), [c[1:] for c in BAD_TOOLS], ids=[c[0] for c in BAD_TOOLS]
)
def test_bad_tools_are_rejected(tools_server: ToolServer, body: dict[str, Any], param: str) -> None:
    server = tools_server.server
    before = server.stats()["admitted"]
    response = httpx.post(
        f"{server.v1}/chat/completions", json={"messages": MSG, **body}, timeout=30
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert server.stats()["admitted"] == before


def test_tools_on_completions_are_rejected(tools_server: ToolServer) -> None:
    body = {"prompt": "hi", "tools": [TOOL]}
    response = httpx.post(f"{tools_server.server.v1}/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
