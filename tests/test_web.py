"""The web page in a real headless browser: Debian's chromium, driven by playwright through
`executable_path` (nothing is downloaded), against a real server on the tiny fixtures. The
models' replies are scripted (tests/scripted.py) so that the page's rendering can be checked
exactly. NEURONPY_SCREENSHOTS=DIR saves the screenshots of docs/api.md ("The web page") there."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.scripted import Paced, Scripts
from tests.servers import (
    RunningServer,
    engine_loader,
    fixture_model,
    open_streams,
    run_server,
)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip(
        "no chromium here: the browser tests need Debian's (apt-get install chromium)",
        allow_module_level=True,
    )
sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")

MODELS = ("tiny-llama", "tiny-mistral", "tiny-qwen3-tools")  # the last reasons and calls tools
KEY = "web-test-key-0123456789"
SCREENSHOTS = os.environ.get("NEURONPY_SCREENSHOTS")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        # (--no-sandbox: the tests may run as root, where chromium's sandbox cannot start)
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[RunningServer, dict[str, Scripts]]]:
    models = {name: loader for m in MODELS for name, loader in fixture_model(m).items()}
    with run_server(models) as server:
        scripts = {}
        for name in MODELS:
            engine = server.state.models[name].engine
            assert engine is not None
            scripts[name] = Scripts()
            scripts[name].attach(engine)
        yield server, scripts


def script(scripts: Scripts, server: RunningServer, model: str, key: str, text: str) -> None:
    engine = server.state.models[model].engine
    assert engine is not None
    tok = engine.tokenizer
    scripts.add(key, [*tok.encode(text), tok.eos_token_id])


@pytest.fixture
def page(browser: Any, served: tuple[RunningServer, dict[str, Scripts]]) -> Iterator[Any]:
    server, _ = served
    context = browser.new_context(viewport={"width": 1200, "height": 800})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(server.url + "/")
    page.wait_for_selector("#model option", state="attached")
    yield page
    context.close()
    assert not errors, errors  # the page's scripts never threw


def open_settings(page: Any) -> None:
    """The settings dialog (the gear in the top bar), open."""
    if not page.is_visible("#settings"):
        page.click("#settings-toggle")
    page.wait_for_selector("#settings[open]")


def close_settings(page: Any) -> None:
    if page.is_visible("#settings"):
        page.click("#settings-done")
    page.wait_for_selector("#settings:not([open])", state="attached")


def ask(page: Any, text: str, *, max_tokens: int = 64) -> Any:
    open_settings(page)
    page.fill("#temperature", "0")
    page.fill("#max_tokens", str(max_tokens))
    close_settings(page)
    page.fill("#prompt", text)
    page.click("#send")
    return page.locator(".message.assistant").last


def test_a_message_gets_a_streamed_reply_rendered_safely(page: Any, served: Any) -> None:
    server, scripts = served
    script(scripts["tiny-llama"], server, "tiny-llama", "[hello]", "Hello from **neuronpy**!")
    reply = ask(page, "Say hi [hello]")
    reply.locator(".meta .stats").wait_for()  # the reply has ended: TTFT and tokens/s shown
    assert reply.locator(".content").inner_text().strip() == "Hello from neuronpy!"
    assert reply.locator(".content strong").inner_text() == "neuronpy"
    assert "TTFT" in reply.locator(".stats").inner_text()
    assert page.locator(".message.user .content").last.inner_text() == "Say hi [hello]"
    # the conversation is kept in the browser: a reload shows it again
    page.reload()
    page.wait_for_selector(".message.assistant")
    assert "Hello from" in page.locator(".message.assistant").last.inner_text()


def test_markup_in_a_reply_is_shown_never_run(page: Any, served: Any) -> None:
    server, scripts = served
    evil = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'
    script(scripts["tiny-llama"], server, "tiny-llama", "[evil]", evil)
    reply = ask(page, "Be evil [evil]")
    reply.locator(".meta .stats").wait_for()
    assert reply.locator(".content").inner_text().strip() == evil
    assert reply.locator(".content script, .content img").count() == 0
    assert page.evaluate("window.pwned") is None


def test_stop_cancels_the_request_on_the_server(page: Any, served: Any) -> None:
    server, scripts = served
    tok = server.state.models["tiny-llama"].engine.tokenizer
    # 400 tokens, held at the tenth until Stop has been pressed
    scripts["tiny-llama"].add("[stop-me]", tok.encode("na " * 200), hold_after=10)
    cancelled = server.stats("tiny-llama")["cancelled"]
    reply = ask(page, "Go on [stop-me]", max_tokens=440)
    started = "() => document.querySelector('.message.assistant:last-child .content').innerText"
    page.wait_for_function(f"{started}.length > 0")
    page.click("#stop")
    reply.locator(".error").wait_for()
    assert reply.locator(".error").inner_text() == "stopped"
    scripts["tiny-llama"].release("[stop-me]")
    server.wait_for(lambda s: s["running"] == 0, model="tiny-llama")
    assert reply.locator(".content").inner_text().count("na") < 200  # it was cut short
    assert server.stats("tiny-llama")["cancelled"] == cancelled + 1  # ended by its client


def test_the_model_picker_switches_models(page: Any, served: Any) -> None:
    server, scripts = served
    options = page.locator("#model option").all_inner_texts()
    assert options == list(MODELS)
    script(scripts["tiny-mistral"], server, "tiny-mistral", "[which]", "I am mistral.")
    page.select_option("#model", "tiny-mistral")
    before = server.stats("tiny-mistral")["admitted"]
    reply = ask(page, "Who are you? [which]")
    reply.locator(".meta .stats").wait_for()
    assert reply.locator(".content").inner_text().strip() == "I am mistral."
    assert server.stats("tiny-mistral")["admitted"] == before + 1


def test_the_batch_view_shows_a_running_request(browser: Any, served: Any) -> None:
    server, scripts = served
    script(scripts["tiny-llama"], server, "tiny-llama", "[watch]", "la " * 200)
    context = browser.new_context(viewport={"width": 1200, "height": 800})
    page = context.new_page()
    page.goto(server.url + "/batch")
    page.wait_for_selector("section.card[data-model='tiny-llama']")
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "[watch]"}],
        "max_tokens": 440,
        "stream": True,
    }
    engine = server.state.models["tiny-llama"].engine
    # (the batch held to the page's polls while the first runs: the three stay in it)
    with Paced(engine, "watch-0"), contextlib.ExitStack() as streams:
        # three rows in the batch (the readers kept: one let go cancels its request)
        _readers = open_streams(streams, server, body, "[watch]", "watch-", 3)
        rows = page.locator("section.card[data-model='tiny-llama'] tr.request")
        page.wait_for_function(
            "() => document.querySelectorAll(\"section.card[data-model='tiny-llama'] "
            'tr.request").length === 3'
        )
        states = {rows.nth(i).locator("td").nth(1).inner_text() for i in range(3)}
        assert states <= {"prefilling", "decoding"}
        # each row named as its client and the log name the request (its x-request-id)
        labels = {rows.nth(i).locator("td").nth(0).inner_text() for i in range(3)}
        assert labels == {"watch-0", "watch-1", "watch-2"}
    context.close()


def test_the_page_asks_for_the_api_key(browser: Any) -> None:
    with run_server(fixture_model("tiny-llama"), api_key=KEY) as server:
        assert httpx.get(server.url + "/").status_code == 200  # the page itself needs no key
        assert httpx.get(server.url + "/v1/batch").status_code == 401
        context = browser.new_context()
        page = context.new_page()
        page.goto(server.url + "/")
        page.wait_for_selector("#key-dialog[open]")
        page.fill("#key", KEY)
        page.click("#key-form button")
        page.wait_for_selector("#model option", state="attached")
        assert page.locator("#model option").all_inner_texts() == ["tiny-llama"]
        context.close()


def test_no_web_serves_no_page() -> None:
    with run_server(fixture_model("tiny-llama"), web=False) as server:
        assert httpx.get(server.url + "/").status_code == 404
        assert httpx.get(server.url + "/static/chat.js").status_code == 404
        assert httpx.post(server.url + "/render", json={"texts": ["x"]}).status_code == 404
        assert httpx.get(server.url + "/health").status_code == 200


TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
# arguments a random model cannot make endless: its forced call closes within a few tokens
SHORT_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "maxLength": 4}},
            "required": ["tz"],
        },
    },
}


def test_reasoning_folds_code_renders_and_tool_calls_show(page: Any, served: Any) -> None:
    server, scripts = served
    model = "tiny-qwen3-tools"
    reply = (
        "<think>\nThe user wants *code*.\n</think>\n\nSee `x`:\n```\nx = 1 < 2\n```\n"
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    )
    script(scripts[model], server, model, "[rich]", reply)
    page.select_option("#model", model)
    open_settings(page)
    page.fill("#tools", json.dumps([TOOL]))
    answer = ask(page, "Show me [rich]")
    answer.locator(".meta .stats").wait_for()
    details = answer.locator("details.reasoning")
    assert details.get_attribute("open") is None  # folded
    # markdown, as the reply is (rendered once the reply has ended: the locator waits for it)
    assert details.locator("em").text_content() == "code"
    assert "The user wants code." in (details.text_content() or "")
    assert answer.locator(".content code").first.inner_text() == "x"
    assert answer.locator(".content pre code").inner_text().strip() == "x = 1 < 2"
    assert answer.locator(".tool-call").inner_text() == 'get_time({"tz": "CET"})'


# ---- what a new user hit: loading, the key dialog, phones, scrolling, settings, tools ----------


def test_a_page_opened_while_the_model_loads_works_once_it_is_ready(browser: Any) -> None:
    gate = threading.Event()
    load = engine_loader()

    def slow() -> Any:
        gate.wait(120)
        return load()

    with run_server({"tiny-llama": slow}, wait_ready=False) as server:
        context = browser.new_context()
        page = context.new_page()
        page.goto(server.url + "/")
        page.locator("#status", has_text="waiting for a model").wait_for()
        page.fill("#prompt", "too early")
        page.click("#send")  # kept, not sent to a model named ''
        assert page.locator(".message").count() == 0
        assert page.input_value("#prompt") == "too early"
        gate.set()
        page.wait_for_selector("#model option", state="attached", timeout=120_000)
        answer = ask(page, "hello", max_tokens=4)
        answer.locator(".meta .stats").wait_for(timeout=60_000)
        assert answer.locator(".error").count() == 0
        context.close()


def test_escape_on_the_key_dialog_leaves_the_page_usable(browser: Any) -> None:
    with run_server(fixture_model("tiny-llama"), api_key=KEY) as server:
        context = browser.new_context()
        page = context.new_page()
        page.goto(server.url + "/")
        page.wait_for_selector("#key-dialog[open]")
        page.keyboard.press("Escape")
        page.wait_for_selector("#key-dialog:not([open])", state="attached")
        page.locator("#status", has_text="needs an API key").wait_for()
        assert page.is_enabled("#send") and page.is_disabled("#stop")
        open_settings(page)
        page.fill("#api-key", KEY)  # the key entered in the settings instead
        page.press("#api-key", "Tab")
        page.wait_for_selector("#model option", state="attached")
        answer = ask(page, "hello", max_tokens=4)
        answer.locator(".meta .stats").wait_for(timeout=60_000)
        assert answer.locator(".error").count() == 0
        page.reload()  # the key is kept
        page.wait_for_selector("#model option", state="attached")
        assert page.input_value("#api-key") == KEY
        context.close()


def test_the_page_fits_a_phone(browser: Any, served: Any) -> None:
    server, _ = served
    context = browser.new_context(viewport={"width": 390, "height": 844}, has_touch=True)
    page = context.new_page()
    page.goto(server.url + "/")
    page.wait_for_selector("#model option", state="attached")
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390, width
    assert not page.is_visible("#settings")
    for button in ("#send", "#stop", "#new-chat", "#settings-toggle", "#history-toggle"):
        box = page.locator(button).bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 390, button
    page.click("#settings-toggle")
    assert page.is_visible("#settings")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "4")
    page.click("#settings-close")  # (the settings are a dialog: closed from inside it)
    assert not page.is_visible("#settings")
    page.fill("#prompt", "hello")
    page.tap("#send")  # (playwright fails a tap that something else would catch)
    page.locator(".message.assistant .meta .stats").wait_for(timeout=60_000)
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    context.close()


def test_a_long_reply_keeps_the_page_at_its_end_and_stop_in_view(page: Any, served: Any) -> None:
    server, scripts = served
    model = "tiny-llama"
    script(scripts[model], server, model, "[long]", "\n\n".join(f"line {i}" for i in range(80)))
    answer = ask(page, "Write [long]", max_tokens=400)
    answer.locator(".meta .stats").wait_for(timeout=60_000)
    at_end = page.evaluate(
        "window.innerHeight + window.scrollY >= document.documentElement.scrollHeight - 80"
    )
    assert at_end
    box = page.locator("#stop").bounding_box()
    assert box is not None and box["y"] >= 0 and box["y"] + box["height"] <= 800


def test_settings_are_kept_across_a_reload(page: Any) -> None:
    open_settings(page)
    values = {"#system": "You are terse.", "#temperature": "0.3", "#max_tokens": "77"}
    for selector, value in values.items():
        page.fill(selector, value)
    page.select_option("#tool_choice", "required")
    page.reload()
    page.wait_for_selector("#model option", state="attached")
    for selector, value in values.items():
        assert page.input_value(selector) == value, selector
    assert page.input_value("#tool_choice") == "required"


def test_tool_choice_required_calls_a_tool_on_a_template_without_tools(page: Any) -> None:
    page.select_option("#model", "tiny-llama")  # its template cannot show tools
    open_settings(page)
    page.fill("#tools", json.dumps([SHORT_TOOL]))
    page.select_option("#tool_choice", "required")
    sent: list[Any] = []
    page.on("request", lambda r: sent.append(r.post_data_json) if "completions" in r.url else None)
    answer = ask(page, "What time is it?", max_tokens=120)  # (a character a token)
    answer.locator(".meta .stats").wait_for(timeout=60_000)
    assert answer.locator(".error").count() == 0, answer.inner_text()
    assert answer.locator(".tool-call").first.inner_text().startswith("get_time(")
    # the request is the conversation so far: the reply being written is not in it
    (body,) = sent
    assert body["messages"] == [{"role": "user", "content": "What time is it?"}]
    assert body["tool_choice"] == "required"


def test_the_sampling_settings_reach_the_request(page: Any) -> None:
    sent: list[Any] = []
    page.on("request", lambda r: sent.append(r.post_data_json) if "completions" in r.url else None)
    open_settings(page)
    page.click("#more-sampling summary")
    page.fill("#top_k", "5")
    page.fill("#min_p", "0.05")
    page.fill("#repetition_penalty", "1.1")
    page.fill("#stop_strings", "END\nSTOP")
    page.fill("#extra", json.dumps({"response_format": {"type": "json_object"}, "stream": False}))
    answer = ask(page, "Give me JSON", max_tokens=8)
    answer.locator(".meta .stats").wait_for(timeout=60_000)
    assert answer.locator(".error").count() == 0
    (body,) = sent
    assert body["top_k"] == 5 and body["min_p"] == 0.05 and body["repetition_penalty"] == 1.1
    assert body["stop"] == ["END", "STOP"]
    assert body["response_format"] == {"type": "json_object"} and body["stream"] is True
    assert "presence_penalty" not in body  # (left empty: the server's default)


def test_a_dark_scheme_gets_dark_colours(browser: Any, served: Any) -> None:
    server, _ = served
    context = browser.new_context(color_scheme="dark")
    page = context.new_page()
    page.goto(server.url + "/")
    page.wait_for_selector("#model option", state="attached")
    page.click("#settings-toggle")  # the dialog and its controls too
    for selector in ("body", "#settings", "#max_tokens", "#tool_choice", ".composer-box"):
        background = page.evaluate(
            "(s) => getComputedStyle(document.querySelector(s)).backgroundColor", selector
        )
        rgb = (int(v) for v in background[background.index("(") + 1 : -1].split(",")[:3])
        assert max(rgb) < 60, (selector, background)
    context.close()


def test_conversations_are_listed_searched_switched_and_deleted(page: Any) -> None:
    ask(page, "first about rivers", max_tokens=4).locator(".meta .stats").wait_for()
    page.click("#new-chat")
    assert page.locator(".message").count() == 0
    ask(page, "second about cats", max_tokens=4).locator(".meta .stats").wait_for()
    titles = page.locator("#conversations .open").all_inner_texts()
    assert titles == ["second about cats", "first about rivers"]
    page.locator("#conversations .open", has_text="first about rivers").click()
    assert page.locator(".message.user .content").all_inner_texts() == ["first about rivers"]
    page.fill("#search", "CATS")
    assert page.locator("#conversations .open").all_inner_texts() == ["second about cats"]
    page.fill("#search", "")
    page.reload()
    page.wait_for_selector("#model option", state="attached")
    assert page.locator(".message.user .content").all_inner_texts() == ["first about rivers"]
    page.locator("#conversations li.current .delete").click()
    assert page.locator("#conversations .open").all_inner_texts() == ["second about cats"]
    assert page.locator(".message.user .content").all_inner_texts() == ["second about cats"]


def test_conversations_export_and_import(page: Any, tmp_path: Path) -> None:
    ask(page, "kept for later", max_tokens=4).locator(".meta .stats").wait_for()
    with page.expect_download() as download:
        page.click("#export")
    saved = tmp_path / "conversations.json"
    download.value.save_as(saved)
    exported = json.loads(saved.read_text())
    (only,) = exported["conversations"]
    assert [m["role"] for m in only["messages"]] == ["user", "assistant"]
    page.set_input_files("#import", str(saved))
    page.locator("#status", has_text="imported 1 conversation").wait_for()
    assert page.locator("#conversations .open").all_inner_texts() == ["kept for later"] * 2


def test_edit_branches_and_any_reply_regenerates(page: Any) -> None:
    sent: list[Any] = []
    page.on("request", lambda r: sent.append(r.post_data_json) if "completions" in r.url else None)
    ask(page, "one", max_tokens=4).locator(".meta .stats").wait_for()
    ask(page, "two", max_tokens=4).locator(".meta .stats").wait_for()
    page.locator(".message.assistant .regenerate").first.click()  # the first reply again
    page.locator(".message.assistant .meta .stats").last.wait_for()
    assert page.locator(".message.user .content").all_inner_texts() == ["one"]
    assert [m["content"] for m in sent[-1]["messages"]] == ["one"]
    page.locator(".message.user .edit").click()
    page.fill(".edit-box", "one, edited")
    page.click(".save-edit")
    page.locator(".message.assistant .meta .stats").last.wait_for()
    assert page.locator(".message.user .content").all_inner_texts() == ["one, edited"]
    assert page.locator(".message.assistant").count() == 1
    assert [m["content"] for m in sent[-1]["messages"]] == ["one, edited"]


def test_continue_asks_for_more_of_the_last_reply(page: Any, served: Any) -> None:
    server, scripts = served
    script(scripts["tiny-llama"], server, "tiny-llama", "[count]", "one two three four five six")
    sent: list[Any] = []
    page.on("request", lambda r: sent.append(r.post_data_json) if "completions" in r.url else None)
    answer = ask(page, "Count [count]", max_tokens=2)
    answer.locator(".meta .stats").wait_for()
    before = answer.locator(".content").inner_text()
    page.click(".message.assistant .continue")
    page.locator(".message.assistant .meta .stats").wait_for()
    body = sent[-1]
    assert body["continue_final_message"] is True
    assert body["messages"][-1] == {"role": "assistant", "content": before}
    after = page.locator(".message.assistant .content").inner_text()
    assert after.startswith(before) and len(after) > len(before)
    assert page.locator(".message.assistant").count() == 1


def test_a_schema_holds_the_reply_to_json(page: Any) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    open_settings(page)
    page.fill("#schema", "{not json")  # said at once, and not sent
    assert page.locator("#schema-error").inner_text().startswith("not JSON")
    close_settings(page)
    page.fill("#prompt", "Is the sky blue?")
    page.click("#send")
    assert "not a JSON object" in page.locator("#status").inner_text()
    assert page.locator(".message").count() == 0 and page.input_value("#prompt")
    open_settings(page)
    page.fill("#schema", json.dumps(schema))
    assert page.locator("#schema-error").inner_text() == ""
    answer = ask(page, "Is the sky blue?", max_tokens=40)
    answer.locator(".meta .stats").wait_for()
    # shown as its JSON, indented and highlighted
    code = answer.locator(".content pre.highlight code.language-json")
    shown = code.text_content()
    assert json.loads(shown)["answer"] in ("yes", "no")
    assert shown == json.dumps(json.loads(shown), indent=2) + "\n"


def test_a_conversation_kept_as_a_server_session(browser: Any, tmp_path: Path) -> None:
    with run_server(fixture_model("tiny-llama"), sessions_dir=tmp_path) as server:
        context = browser.new_context()
        page = context.new_page()
        page.goto(server.url + "/")
        page.wait_for_selector("#model option", state="attached")
        open_settings(page)
        page.check("#server-session")
        ask(page, "Remember this", max_tokens=4).locator(".meta .stats").wait_for()
        (listed,) = httpx.get(server.v1 + "/sessions").json()["data"]
        current = page.evaluate("Conversations.current.id")
        assert listed["id"] == f"page-{current}" and listed["tokens"] > 0
        sent: list[Any] = []
        page.on("request", lambda r: sent.append(r.post_data_json) if "chat" in r.url else None)
        ask(page, "And this", max_tokens=4)
        page.locator(".message.assistant .meta .stats").nth(1).wait_for()
        (body,) = sent
        assert body["session"] == listed["id"]  # the second turn asks for the same session
        (again,) = httpx.get(server.v1 + "/sessions").json()["data"]
        assert again["id"] == listed["id"] and again["tokens"] > listed["tokens"]
        context.close()


# ---- markdown, rendered by the server; what speculation did for each reply ---------------------

RICH = """## Steps

1. first, *carefully*
2. then ~~not~~ **this**

| name | value |
|------|-------|
| pi | $\\pi \\approx 3.14$ |

> quoted

See [the docs](https://example.com/docs) and [this](javascript:alert(1)).

$$\\frac{a}{b}$$

```python
def add(a, b):
    return a + b
```
"""


def test_a_reply_is_shown_as_markdown_with_math_and_highlighted_code(
    page: Any, served: Any
) -> None:
    server, scripts = served
    script(scripts["tiny-llama"], server, "tiny-llama", "[rich-md]", RICH)
    reply = ask(page, "Explain [rich-md]", max_tokens=300)
    reply.locator(".meta .stats").wait_for()  # ended: shown as the server rendered it
    content = reply.locator(".content")
    assert content.locator("h2").inner_text() == "Steps"
    assert content.locator("ol > li").count() == 2
    assert content.locator("ol em").inner_text() == "carefully"
    assert content.locator("ol s").inner_text() == "not"
    assert content.locator("table th").all_inner_texts() == ["name", "value"]
    assert content.locator("table td math").count() == 1  # TeX as MathML
    assert content.locator("blockquote").inner_text().strip() == "quoted"
    link = content.locator("a")
    assert link.count() == 1  # the javascript: one stays text
    assert link.get_attribute("href") == "https://example.com/docs"
    assert link.get_attribute("target") == "_blank" and "noopener" in link.get_attribute("rel")
    assert "[this](javascript:alert(1))" in content.inner_text()
    assert content.locator(".math-block math mfrac").count() == 1
    code = content.locator("pre.highlight code.language-python")
    assert code.text_content().strip() == "def add(a, b):\n    return a + b"
    assert code.locator("span.k").first.inner_text() == "def"  # highlighted
    # the code's copy button copies the code alone
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    content.locator("pre .copy-code").click()
    copied = page.evaluate("navigator.clipboard.readText()")
    assert copied.strip() == "def add(a, b):\n    return a + b"
    # a reload redraws it rendered
    page.reload()
    page.locator(".message.assistant .content h2").wait_for()


def test_each_reply_says_what_its_drafts_did(browser: Any) -> None:
    config = {"speculative": "ngram", "prompt_lookup_min": 1}
    with run_server(fixture_model("tiny-llama", **config)) as server:
        context = browser.new_context()
        page = context.new_page()
        page.goto(server.url + "/")
        page.wait_for_selector("#model option", state="attached")
        before = server.stats()
        reply = ask(page, "the cat sat on the mat and the cat sat on the mat", max_tokens=48)
        reply.locator(".meta .stats").wait_for()
        after = server.stats()
        drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
        accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        assert drafted > 0
        share = round(100 * accepted / drafted)
        want = f"drafts: {accepted} of {drafted} accepted ({share}%)"
        assert reply.locator(".meta .speculation").inner_text() == want
        # turned off in the settings: the request says so, and its reply drafted nothing
        open_settings(page)
        page.select_option("#speculative", "off")
        sent: list[Any] = []
        page.on("request", lambda r: sent.append(r.post_data_json) if "chat" in r.url else None)
        ask(page, "again", max_tokens=8)
        page.locator(".message.assistant .meta .stats").nth(1).wait_for()
        assert [b["speculative"] for b in sent] == ["off"]
        assert page.locator(".message.assistant").nth(1).locator(".speculation").count() == 0
        assert server.stats()["spec_draft_tokens"] == after["spec_draft_tokens"]
        context.close()


def focus_by_tab(page: Any, matches: str, *, back: bool = False, most: int = 80) -> None:
    """Tab (Shift+Tab with `back`) until the focused element matches the CSS selector: the
    keyboard reaches it, in the page's focus order."""
    for _ in range(most):
        page.keyboard.press("Shift+Tab" if back else "Tab")
        if page.evaluate(f"document.activeElement.matches({json.dumps(matches)})"):
            assert page.evaluate("document.activeElement.matches(':focus-visible')"), matches
            return
    raise AssertionError(f"Tab never reached {matches}")


def test_the_page_works_from_the_keyboard_alone(page: Any, served: Any) -> None:
    server, scripts = served
    script(scripts["tiny-llama"], server, "tiny-llama", "[keys]", "Typed **reply**.")
    tok = server.state.models["tiny-llama"].engine.tokenizer  # type: ignore[union-attr]
    scripts["tiny-llama"].add("[keys-long]", tok.encode("na " * 20), hold_after=10)
    focus_by_tab(page, "#settings-toggle")  # the settings: a dialog, opened from the top bar
    page.keyboard.press("Enter")
    assert page.is_visible("#settings")
    for field, value in (("#temperature", "0"), ("#max_tokens", "64")):
        focus_by_tab(page, field)
        page.keyboard.press("Control+a")
        page.keyboard.type(value)
        assert page.input_value(field) == value
    page.keyboard.press("Escape")  # closed from the keyboard
    assert not page.is_visible("#settings")
    focus_by_tab(page, "#prompt")
    page.keyboard.type("Hello [keys]")
    page.keyboard.press("Enter")
    reply = page.locator(".message.assistant").last
    reply.locator(".meta .stats").wait_for()
    assert reply.locator(".content strong").inner_text() == "reply"
    # back from the message box to the reply's buttons: regenerate it with Enter
    focus_by_tab(page, ".message.assistant .regenerate", back=True)
    page.keyboard.press("Enter")
    page.locator(".message.assistant .meta .stats").wait_for()
    assert page.locator(".message.assistant").count() == 1
    assert page.locator(".message.assistant .content strong").inner_text() == "reply"
    # a new conversation, from the keyboard too
    focus_by_tab(page, "#new-chat")
    page.keyboard.press("Enter")
    assert page.locator(".message").count() == 0
    # a long reply stopped from the keyboard: Tab from the message box reaches Stop (a new
    # conversation: a script is chosen by a key anywhere in the prompt, "[keys]" included)
    focus_by_tab(page, "#prompt")
    page.keyboard.type("More [keys-long]")
    page.keyboard.press("Enter")
    started = "() => document.querySelector('.message.assistant:last-child .content').innerText"
    page.wait_for_function(f"{started}.length > 0")  # (and held at its tenth token)
    focus_by_tab(page, "#stop")
    page.keyboard.press("Enter")
    page.locator(".message.assistant").last.locator(".error").wait_for()
    assert page.locator(".message.assistant").last.locator(".error").inner_text() == "stopped"
    scripts["tiny-llama"].release("[keys-long]")
    server.wait_for(lambda s: s["running"] == 0, model="tiny-llama")


def test_the_phone_layout_works_from_the_keyboard(browser: Any, served: Any) -> None:
    server, _ = served
    context = browser.new_context(viewport={"width": 390, "height": 844})
    page = context.new_page()
    page.goto(server.url + "/")
    page.wait_for_selector("#model option", state="attached")
    assert not page.is_visible("#settings")
    focus_by_tab(page, "#settings-toggle")
    page.keyboard.press("Enter")
    assert page.is_visible("#settings")
    assert page.get_attribute("#settings-toggle", "aria-expanded") == "true"
    focus_by_tab(page, "#max_tokens")  # the folded settings are in the focus order once open
    page.keyboard.press("Control+a")
    page.keyboard.type("4")
    focus_by_tab(page, "#settings-close", back=True)  # (closed from inside the dialog)
    page.keyboard.press("Enter")
    assert not page.is_visible("#settings")
    page.wait_for_selector("#settings-toggle[aria-expanded='false']")  # (said on its close event)
    focus_by_tab(page, "#prompt")
    page.keyboard.type("hello")
    page.keyboard.press("Enter")
    page.locator(".message.assistant .meta .stats").wait_for(timeout=60_000)
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    context.close()


def test_a_streaming_reply_shows_its_reasoning_and_text_as_they_come(
    page: Any, served: Any
) -> None:
    server, scripts = served
    model = "tiny-qwen3-tools"
    tok = server.state.models[model].engine.tokenizer  # type: ignore[union-attr]
    first = "<think>\nplan it\n</think>\n\nPart **one**."
    held = len(tok.encode(first))
    scripts[model].add(
        "[live]", [*tok.encode(first + " Part two."), tok.eos_token_id], hold_after=held
    )
    page.select_option("#model", model)
    reply = ask(page, "Think [live]")
    # held after "Part one.": the page shows what came, in the reply's own (live) node
    reply.locator(".content strong").wait_for()  # rendered as markdown while it streams
    assert reply.locator(".content").inner_text().strip() == "Part one."
    assert reply.locator("details.reasoning").text_content().strip().endswith("plan it")
    assert reply.locator(".meta .stats").count() == 0  # (it has not ended)
    scripts[model].release("[live]")
    reply.locator(".meta .stats").wait_for()
    assert reply.locator(".content").inner_text().strip() == "Part one. Part two."


# ---- the look: the top bar in view, an icon, settings in plain words, styled controls, phones ---

SIZES = [(1280, 900), (390, 844)]  # a laptop, a phone


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_the_page_opens_at_its_top_with_the_header_in_view(
    browser: Any, served: Any, width: int, height: int
) -> None:
    server, _ = served
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    failed: list[str] = []
    page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    page.goto(server.url + "/")
    page.wait_for_selector("#model option", state="attached")
    page.wait_for_load_state("load")
    assert page.evaluate("window.scrollY") == 0
    box = page.locator("header.topbar").bounding_box()
    assert box is not None and box["y"] >= 0 and box["y"] + box["height"] <= height
    # an empty conversation fits the window: there is nothing to scroll
    assert page.evaluate("document.documentElement.scrollHeight") <= height
    assert page.is_visible("#empty")
    assert not failed, failed  # every file the page asked for came (its icon included)
    # a conversation longer than the window opens at its end, the top bar still in view
    long = [
        {"role": r, "content": f"line {i}\n" * 6} for i in range(12) for r in ("user", "assistant")
    ]
    page.evaluate(
        """(messages) => {
          localStorage.setItem("neuronpy.conversations",
            JSON.stringify([{id: "long", title: "long", messages, updated: 1}]));
          localStorage.setItem("neuronpy.current", "long");
        }""",
        long,
    )
    page.reload()
    page.wait_for_selector("#model option", state="attached")
    page.wait_for_function(
        "() => window.innerHeight + window.scrollY >= document.documentElement.scrollHeight - 80"
    )
    assert page.evaluate("window.scrollY") > 0
    box = page.locator("header.topbar").bounding_box()
    assert box is not None and box["y"] >= 0 and box["y"] + box["height"] <= height
    assert page.locator("#settings-toggle").is_visible()
    assert not page.is_visible("#empty")
    context.close()


def test_the_favicon_is_served(served: Any) -> None:
    server, _ = served
    icon = httpx.get(server.url + "/favicon.ico")
    assert icon.status_code == 200
    assert icon.headers["content-type"].startswith("image/")
    body = icon.content
    assert body[:6] == b"\x00\x00\x01\x00\x01\x00"  # an ICO holding one image ...
    assert body[22:30] == b"\x89PNG\r\n\x1a\n"  # ... a PNG, 32 x 32
    assert int.from_bytes(body[38:42], "big") == int.from_bytes(body[42:46], "big") == 32
    svg = httpx.get(server.url + "/static/favicon.svg")
    assert svg.status_code == 200 and svg.headers["content-type"] == "image/svg+xml"
    assert svg.text.startswith("<svg")
    for page in ("/", "/batch"):  # both pages link it
        assert '<link rel="icon" href="/static/favicon.svg"' in httpx.get(server.url + page).text


# each setting: its words on the page, and the API's name shown beside them as a hint
PLAIN = {
    "system": ("What the model should know or do", "system message"),
    "temperature": ("Creativity", "temperature"),
    "top_p": ("Word variety", "top_p"),
    "max_tokens": ("Longest reply", "max_tokens"),
    "seed": ("Repeatable replies", "seed"),
    "speculative": ("Write ahead by guessing", "speculative"),
    "schema": ("Reply as JSON of this shape", "response_format"),
    "tools": ("Tools the model can call", "tools"),
    "tool_choice": ("Let the model use tools", "tool_choice"),
    "server-session": ("Keep this conversation's memory on the server", "session"),
    "top_k": ("Only the likeliest few words", "top_k"),
    "min_p": ("Skip unlikely words", "min_p"),
    "presence_penalty": ("Move on to new topics", "presence_penalty"),
    "frequency_penalty": ("Repeat words less", "frequency_penalty"),
    "repetition_penalty": ("Hold back on repeats", "repetition_penalty"),
    "stop_strings": ("Stop when the reply writes", "stop"),
    "api-key": ("API key", "Bearer"),
}


def test_the_settings_are_a_dialog_in_plain_words(page: Any) -> None:
    # nothing beside the chat names a request field: the list of conversations and the top bar
    for outside in ("#sidebar", "header.topbar"):
        text = page.locator(outside).inner_text()
        for name in ("temperature", "top_p", "max_tokens", "tool_choice", "seed"):
            assert name not in text, (outside, name)
    assert not page.is_visible("#settings")
    page.click("#settings-toggle")
    assert page.is_visible("#settings")
    assert page.evaluate("document.getElementById('settings').open")
    page.click("#more-sampling summary")
    for field, (words, api) in PLAIN.items():
        label = page.locator(f"label[for='{field}']")
        assert label.is_visible(), field
        text = label.inner_text()
        assert text.startswith(words), (field, text)
        assert api in label.locator(".api").inner_text(), (field, text)  # the hint
        assert page.locator("#" + field).is_visible(), field
    # tool_choice's choices in words, their API values kept
    options = page.locator("#tool_choice option")
    assert [options.nth(i).get_attribute("value") for i in range(3)] == ["auto", "required", "none"]
    assert options.nth(1).inner_text() == "Always: it must call one (required)"
    # the slider moves its number field (the value sent)
    page.locator("#temperature-slider").fill("1.5")
    assert page.input_value("#temperature") == "1.5"
    page.keyboard.press("Escape")
    assert not page.is_visible("#settings")
    page.wait_for_selector("#settings-toggle[aria-expanded='false']")  # (said on its close event)


# every control the page shows: [selector, font family, border radius, appearance]
CONTROLS = """() => [...document.querySelectorAll("button, select, textarea, input, .button")]
  .filter((n) => n.getClientRects().length && getComputedStyle(n).visibility === "visible"
    && n.offsetWidth > 1)
  .map((n) => {
    const s = getComputedStyle(n);
    return [n.id || n.className || n.tagName, s.fontFamily, s.borderRadius, s.appearance];
  })"""


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_the_controls_are_styled_and_the_import_button_is_whole(
    browser: Any, served: Any, scheme: str
) -> None:
    server, _ = served
    context = browser.new_context(viewport={"width": 1280, "height": 900}, color_scheme=scheme)
    page = context.new_page()
    page.goto(server.url + "/")
    page.wait_for_selector("#model option", state="attached")
    body_font = page.evaluate("getComputedStyle(document.body).fontFamily")
    seen = page.evaluate(CONTROLS)
    page.click("#settings-toggle")
    page.click("#more-sampling summary")
    seen += page.evaluate(CONTROLS)
    assert len(seen) > 25
    for name, font, radius, appearance in seen:
        assert font == body_font or "monospace" in font, (name, font)  # the page's type
        assert radius != "0px", name  # drawn by the page, not the browser's default
        assert appearance == "none", (name, appearance)
    # the import control: a button-like label with its whole word shown, inside the sidebar
    page.keyboard.press("Escape")
    picker = page.locator("label.file-button")
    assert picker.inner_text().strip() == "Import"
    assert page.evaluate(
        "() => { const l = document.querySelector('label.file-button');"
        " return l.scrollWidth <= l.clientWidth && l.scrollHeight <= l.clientHeight; }"
    )
    box, side = picker.bounding_box(), page.locator("#sidebar").bounding_box()
    assert box is not None and side is not None
    assert side["x"] <= box["x"] and box["x"] + box["width"] <= side["x"] + side["width"]
    hidden = page.locator("#import").bounding_box()  # (the file input: hidden in its label)
    assert hidden is None or hidden["width"] <= 1
    context.close()


def test_a_reply_s_stats_fit_a_phone(browser: Any, served: Any) -> None:
    server, scripts = served
    script(scripts["tiny-llama"], server, "tiny-llama", "[phone-stats]", "Short and sweet.")
    context = browser.new_context(viewport={"width": 390, "height": 844}, has_touch=True)
    page = context.new_page()
    page.goto(server.url + "/")
    page.wait_for_selector("#model option", state="attached")
    page.select_option("#model", "tiny-llama")
    reply = ask(page, "Reply [phone-stats]")
    stats = reply.locator(".meta .stats")
    stats.wait_for()
    assert "TTFT" in stats.inner_text() and "tok/s" in stats.inner_text()
    shape = stats.evaluate(
        """(n) => ({height: n.getBoundingClientRect().height,
                   line: parseFloat(getComputedStyle(n).lineHeight),
                   right: n.getBoundingClientRect().right,
                   overflow: n.scrollWidth > n.clientWidth})"""
    )
    assert shape["height"] <= 2 * shape["line"] + 1, shape  # one line, two at most
    assert shape["right"] <= 390 and not shape["overflow"], shape
    for button in ("copy", "regenerate", "continue"):
        box = reply.locator(f".meta .{button}").bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 390, button
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    # the conversations: a drawer over the chat, closed by choosing one
    assert not page.is_visible("#conversations")
    page.tap("#history-toggle")
    page.locator("#conversations .open").first.wait_for()
    assert page.get_attribute("#history-toggle", "aria-expanded") == "true"
    page.locator("#conversations .open").first.tap()
    page.wait_for_selector("#sidebar:not(.open)", state="attached")
    assert page.get_attribute("#history-toggle", "aria-expanded") == "false"
    context.close()


def test_screenshots_for_the_docs(browser: Any, served: Any) -> None:
    """NEURONPY_SCREENSHOTS=DIR: the pages of docs/api.md at 1280 x 900 and 390 x 844."""
    if not SCREENSHOTS:
        pytest.skip("set NEURONPY_SCREENSHOTS=DIR to make the screenshots")
    out = Path(SCREENSHOTS)
    out.mkdir(parents=True, exist_ok=True)
    server, scripts = served
    model = "tiny-llama"
    # (a script is chosen by the first key registered that the prompt holds: the second turn's
    # prompt holds the first's key too)
    script(scripts[model], server, model, "[shot-md]", RICH)
    script(scripts[model], server, model, "[shot-hi]", "Hello from **neuronpy**! Ask away.")
    # the chat (light), on a phone, and in the dark scheme: a reply as markdown at the end
    shots = [
        ((1280, 900), "light", "chat", "settings"),
        ((390, 844), "light", "chat-phone", "settings-phone"),
        ((1280, 900), "dark", "chat-markdown", None),
    ]
    for (width, height), scheme, chat, settings in shots:
        context = browser.new_context(
            viewport={"width": width, "height": height}, color_scheme=scheme
        )
        page = context.new_page()
        page.goto(server.url + "/")
        page.wait_for_selector("#model option", state="attached")
        page.select_option("#model", model)
        ask(page, "Say hi [shot-hi]").locator(".meta .stats").wait_for()
        rich = ask(page, "Show me some markdown [shot-md]", max_tokens=300)
        rich.locator(".meta .stats").wait_for()
        page.locator(".message.assistant .content h2").wait_for()
        page.evaluate("window.scrollTo(0, document.documentElement.scrollHeight)")
        page.screenshot(path=str(out / f"{chat}.png"))
        if settings:
            page.click("#settings-toggle")
            page.screenshot(path=str(out / f"{settings}.png"))
        context.close()
    # the batch view, with three requests held in it (one step per poll)
    body = {"model": model, "max_tokens": 440, "stream": True}
    script(scripts[model], server, model, "[shot-batch]", "la " * 200)
    engine = server.state.models[model].engine
    for (width, height), suffix in zip(SIZES, ("", "-phone"), strict=True):
        context = browser.new_context(viewport={"width": width, "height": height})
        page = context.new_page()
        page.goto(server.url + "/batch")
        page.wait_for_selector(f"section.card[data-model='{model}']")
        with Paced(engine, "shot-0"), contextlib.ExitStack() as streams:
            _readers = open_streams(streams, server, body, "[shot-batch]", "shot-", 3)
            page.wait_for_function(
                f"() => document.querySelectorAll(\"section.card[data-model='{model}'] "
                'tr.request").length === 3'
            )
            time.sleep(3)  # a few polls: the plots over time
            if suffix:  # (a phone: the page down to the table)
                clip = {"x": 0, "y": 0, "width": width, "height": 1400}
                page.screenshot(path=str(out / f"batch{suffix}.png"), full_page=True, clip=clip)
            else:
                page.screenshot(path=str(out / f"batch{suffix}.png"))
        context.close()
        server.wait_for(lambda s: s["running"] == 0, model=model)


def test_the_attach_button_shows_only_for_a_model_that_reads_images(page: Any) -> None:
    assert page.locator("#attach").is_hidden()


def test_an_attached_and_a_pasted_image_reach_the_model(browser: Any, tmp_path: Path) -> None:
    """A vision-language model: a picture attached with the button and one pasted into the
    message box go with the message (its `image_url` parts), are shown in it, and the reply is
    transformers' greedy reply to both pictures and the text."""
    from tests.test_vision import MODEL, PATH, PICTURES, png, transformers_reply

    attached = tmp_path / "attached.png"
    attached.write_bytes(png(PICTURES[0]))
    pasted = list(png(PICTURES[1]))
    with run_server({MODEL: engine_loader(PATH)}) as server:
        context = browser.new_context(viewport={"width": 1200, "height": 800})
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(server.url + "/")
        page.wait_for_selector("#attach:not([hidden])")
        page.set_input_files("#image-file", str(attached))
        page.wait_for_selector(".attachment img")
        page.evaluate(
            """(bytes) => {
                const file = new File([new Uint8Array(bytes)], "pasted.png", {type: "image/png"});
                const data = new DataTransfer();
                data.items.add(file);
                const event = new ClipboardEvent("paste", {clipboardData: data, bubbles: true,
                                                           cancelable: true});
                document.getElementById("prompt").dispatchEvent(event);
            }""",
            pasted,
        )
        page.wait_for_function("document.querySelectorAll('.attachment img').length === 2")
        reply = ask(page, "Compare them.", max_tokens=12)
        reply.locator(".meta .stats").wait_for()
        assert page.locator(".message.user .images img").count() == 2
        assert page.locator("#attachments").is_hidden()  # sent: the box is empty again
        text = page.evaluate("Conversations.current.messages.at(-1).content")
        context.close()
    assert not errors, errors
    assert text == transformers_reply("Compare them.", PICTURES[0], PICTURES[1])
