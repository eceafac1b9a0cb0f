"""The chat page's markdown (server/markdown.py, POST /render): what it draws, and that nothing a
model writes comes out as markup that runs, loads or links anywhere but http(s) and mailto."""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neuronpy.server.markdown import (
    MATHML_ATTRIBUTES,
    MATHML_ELEMENTS,
    MAX_TEXTS,
    Work,
    math_html,
    render_markdown,
)
from tests.servers import fixture_model, run_server

DOCS = Path(__file__).resolve().parents[1] / "docs"
HTML_ELEMENTS = frozenset(
    [
        "p",
        "br",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
        "ul",
        "ol",
        "li",
        "blockquote",
        "hr",
        "pre",
        "code",
        "span",
        "em",
        "strong",
        "s",
        "a",
        "table",
        "thead",
        "tbody",
        "tr",
        "th",
        "td",
        "div",
    ]
)
HTML_ATTRIBUTES = frozenset({"class", "href", "target", "rel", "start", "style", "xmlns"})


class Elements(HTMLParser):
    """Every element and attribute of a piece of HTML."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str | None]]] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found.append((tag, dict(attrs)))


def assert_safe(html: str) -> None:
    for tag, attrs in Elements(html).found:
        assert tag in HTML_ELEMENTS | MATHML_ELEMENTS, tag
        for name, value in attrs.items():
            assert name in HTML_ATTRIBUTES | MATHML_ATTRIBUTES, (tag, name)
            if name == "style":  # markdown-it's table alignment, nothing else
                assert value in ("text-align:left", "text-align:right", "text-align:center")
            if name == "href":
                assert value is not None
                assert value.startswith(("http:", "https:", "mailto:")), value


def test_commonmark_tables_math_and_code() -> None:
    html = render_markdown(
        "# T\n\n- a\n- b\n\n| x | y |\n|---|---|\n| 1 | 2 |\n\n"
        "Costs $5 and $10; $e^{i\\pi}$ and \\(a_1\\).\n\n\\[\\sqrt{2}\\]\n\n"
        "```python\nx = 1\n```\n"
    )
    assert "<h1>T</h1>" in html and html.count("<li>") == 2 and "<table>" in html
    assert "Costs $5 and $10;" in html  # money is not math
    assert html.count("<math") == 3 and "<msqrt>" in html and "<msub>" in html
    assert '<pre class="highlight"><code class="language-python">' in html
    assert '<span class="n">x</span>' in html  # highlighted
    assert_safe(html)


def test_a_language_the_highlighter_does_not_know_is_plain_code() -> None:
    html = render_markdown("```nosuch\n<b>x</b>\n```\n")
    assert html == '<pre><code class="language-nosuch">&lt;b&gt;x&lt;/b&gt;\n</code></pre>\n'


def test_raw_html_script_links_and_images_are_defused() -> None:
    html = render_markdown(
        '<script>alert(1)</script> <img src=x onerror="alert(2)"> '
        "[a](javascript:alert(3)) [b](JaVaScRiPt:alert(4)) [c](data:text/html,x) "
        "[d](https://ok.example) ![e](https://elsewhere.example/e.png)"
    )
    assert "<script" not in html and "<img" not in html
    assert "&lt;script&gt;" in html
    assert html.count("<a ") == 2  # d, and the image as a link to it (loaded by nobody)
    assert '<a href="https://elsewhere.example/e.png" target="_blank"' in html
    assert_safe(html)


def test_mathml_is_rebuilt_from_mathml_alone() -> None:
    # latex2mathml copies \text and \href as it finds them: what comes out is rebuilt
    html = math_html("\\text{<script>alert(1)</script>} \\href{javascript:alert(1)}{x}", False)
    assert "<script" not in html and "href" not in html
    assert "alert(1)" in html  # the text itself stays, as text
    assert_safe(html)
    assert math_html("\\frac{", False) == '<code class="math">\\frac{</code>'  # not TeX: shown
    assert math_html("a&b", False).startswith("<")  # whatever it is, well-formed and safe
    assert_safe(math_html("\\mathrm{a&b}", True))


# pieces of markdown, HTML, links and TeX, in any order
MARKDOWNISH = st.lists(
    st.sampled_from(
        [*"ab <>&\"'=/\\$`*_[]()!#|-:\n", "javascript:", "http:", "\\text{", "\\href{", "```"]
    ),
    max_size=120,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(MARKDOWNISH)
def test_nothing_a_model_writes_renders_as_unsafe_markup(text: str) -> None:
    assert_safe(render_markdown(text))


def test_render_route_checks_its_body_and_needs_the_key() -> None:
    with run_server(fixture_model(), api_key="render-key-0123456789") as server:
        url = server.url + "/render"
        key = {"Authorization": "Bearer render-key-0123456789"}
        assert httpx.post(url, json={"texts": ["*x*"]}).status_code == 401
        ok = httpx.post(url, json={"texts": ["*x*", "`y`"]}, headers=key)
        assert ok.status_code == 200
        assert ok.json() == {"html": ["<p><em>x</em></p>\n", "<p><code>y</code></p>\n"]}
        for bad in ({"texts": "x"}, {"texts": [1]}, {}, {"texts": ["x"] * (MAX_TEXTS + 1)}):
            refused = httpx.post(url, json=bad, headers=key)
            assert refused.status_code == 400, bad
            assert refused.json()["error"]["param"] == "texts"
        css = httpx.get(server.url + "/static/highlight.css", headers=key)
        assert css.status_code == 200 and ".highlight .k" in css.text
        assert css.headers["content-type"].startswith("text/css")


def test_the_pages_own_requests_stay_out_of_the_access_log_unless_they_fail() -> None:
    import logging

    from neuronpy.cli import QuietProbes

    def line(path: str, status: int) -> logging.LogRecord:
        args = ("127.0.0.1:5000", "POST", path, "1.1", status)
        return logging.LogRecord(
            "uvicorn.access", logging.INFO, "", 0, "%s %s %s %s %d", args, None
        )

    quiet = QuietProbes()
    assert not quiet.filter(line("/render", 200)) and not quiet.filter(line("/v1/batch", 200))
    assert quiet.filter(line("/render", 400)) and quiet.filter(line("/v1/chat/completions", 200))


# ---- work: linear in the text, whatever it holds ------------------------------------------------

# Runs that make a markdown parser re-scan (the families of cmark's pathological tests), each
# repeated to the length a test asks for.
PATHOLOGICAL = [
    "![",
    "[",
    "[a",
    "![[]()",
    "[ (](",
    "[ a_",
    "[a](b",
    "[a](<b",
    "*a **a ",
    "a_ ",
    "_a ",
    "*a_ ",
    "c* ",
    "a]",
    "`a",
    "e``",
    "<",
    "</<!--",
    "\\(",
    "\\[",
    "$a",
    "a|b\n",
    "a\n",
]
BRACKETS = ["![", "[", "[a", "![[]()", "[ a_"]  # what the link and image rules look ahead on


def _repeated(unit: str, length: int) -> str:
    return (unit * (length // len(unit) + 1))[:length]


def _calls(text: str) -> int:
    """The Python calls rendering `text` makes: a measure of its work that no machine's speed
    changes (the same code and text make the same calls)."""
    count = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal count
        count += event == "call"

    sys.setprofile(profile)
    try:
        render_markdown(text)
    finally:
        sys.setprofile(None)
    return count


@pytest.mark.parametrize("unit", PATHOLOGICAL)
def test_a_run_takes_work_linear_in_its_length(unit: str) -> None:
    """Twice the text is at most about twice the work (quadratic work would be four times)."""
    small, large = _calls(_repeated(unit, 3000)), _calls(_repeated(unit, 6000))
    assert large <= 2.3 * small, (unit, small, large)


@pytest.mark.parametrize("unit", BRACKETS)
def test_100k_of_brackets_stay_within_the_lookahead_budget(unit: str) -> None:
    """100,000 characters of unclosed brackets run out of lookahead (20 to 40 skipToken calls
    a character, where the budget gives 2) and are rendered without links, their brackets as
    written; the lookahead spent never passes the budget."""
    text = _repeated(unit, 100_000)
    work = Work.for_text(text)
    rendered = render_markdown(text, work)
    assert work.linear and work.spent <= work.budget
    assert rendered.startswith("<p>") and "<a" not in rendered and "[" in rendered


def test_ordinary_markdown_keeps_its_links_well_within_the_budget() -> None:
    """The docs, and text dense with links and brackets, render on the usual path (links and
    images drawn), taking under a third of their budget."""
    dense = "See [the docs](https://example.com/a) and ![a chart](https://example.com/c.png); "
    dense += "x = a[i][j] + b[k]; [[nested]](https://example.com/n) [ref][r]\n\n"
    texts = [path.read_text() for path in sorted(DOCS.glob("*.md"))] + [dense * 500]
    for text in texts:
        work = Work.for_text(text)
        rendered = render_markdown(text, work)
        assert not work.linear and work.spent * 3 < work.budget
    assert '<a href="https://example.com/c.png"' in rendered
