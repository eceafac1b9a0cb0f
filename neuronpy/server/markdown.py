"""Markdown for the chat page, rendered here rather than in the browser: CommonMark with
tables and strikethrough (markdown-it-py), code highlighted by Pygments, and TeX math
(`$...$`, `$$...$$`, `\\(...\\)`, `\\[...\\]`) as MathML (latex2mathml), which browsers draw
themselves. POST /render takes {"texts": [...]} and answers {"html": [...]}.

What a model writes is never trusted: raw HTML in it is shown as text, links go only to
http(s) and mailto, images are shown as links (the page loads nothing from elsewhere), and the
MathML is rebuilt from an allow-list of MathML elements and attributes, its text escaped."""

from __future__ import annotations

import html
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from functools import cache
from typing import Any

import anyio
from latex2mathml.converter import convert as latex_to_mathml
from markdown_it import MarkdownIt
from markdown_it.common.utils import escapeHtml
from markdown_it.rules_inline import StateInline
from mdit_py_plugins.dollarmath import dollarmath_plugin
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from neuronpy.server.errors import ApiError
from neuronpy.server.requests import BodyLimits, read_json

MAX_TEXTS = 256  # texts in one request (a page shows a conversation's replies at once)
MAX_CHARS = 400_000  # characters in one request, all texts together
MAX_MATH_CHARS = 4_000  # longer math is shown as its TeX
# The lookahead a render may take, counted in the inline parser's skipToken calls: markdown-it's
# link and image rules look for a label's closing bracket token by token, again from each `[`
# (the tokens are cached, the walk is not). An ordinary reply takes well under one call per
# character (0.6 in text dense with links and indexing such as a[i][j]); runs of unclosed `[`
# or `![` or deeply nested brackets take 20 to 40, seconds of a core for 100 KB. A text that
# would take more is rendered without links and images (LINEAR), which looks nothing ahead.
LOOKAHEAD_PER_CHAR = 2
LOOKAHEAD_ALLOWANCE = 10_000
LINK_SCHEMES = ("http:", "https:", "mailto:")
# one render at a time, off the event loop: a long text never holds up a stream, and renders
# never take more than a core from the model
_LIMITER = anyio.CapacityLimiter(1)

MATHML_ELEMENTS = frozenset(
    [
        "math",
        "mrow",
        "mi",
        "mn",
        "mo",
        "ms",
        "mtext",
        "mspace",
        "mfrac",
        "msqrt",
        "mroot",
        "mstyle",
        "merror",
        "mpadded",
        "mphantom",
        "msub",
        "msup",
        "msubsup",
        "munder",
        "mover",
        "munderover",
        "mmultiscripts",
        "mprescripts",
        "none",
        "mtable",
        "mtr",
        "mtd",
        "menclose",
        "semantics",
        "annotation",
    ]
)
MATHML_ATTRIBUTES = frozenset(
    [
        "display",
        "mathvariant",
        "stretchy",
        "fence",
        "separator",
        "accent",
        "accentunder",
        "lspace",
        "rspace",
        "minsize",
        "maxsize",
        "movablelimits",
        "symmetric",
        "largeop",
        "form",
        "columnalign",
        "rowalign",
        "columnspacing",
        "rowspacing",
        "columnlines",
        "rowlines",
        "frame",
        "framespacing",
        "displaystyle",
        "scriptlevel",
        "linethickness",
        "width",
        "height",
        "depth",
        "notation",
        "open",
        "close",
        "separators",
        "columnspan",
        "rowspan",
        "encoding",
    ]
)
_MATHML_NS = "{http://www.w3.org/1998/Math/MathML}"


def _clean_mathml(node: ET.Element) -> str:
    """`node` as MathML of allowed elements and attributes only; text escaped; an element not
    allowed keeps only its text."""
    tag = node.tag.removeprefix(_MATHML_NS)
    inner = html.escape(node.text or "") + "".join(
        _clean_mathml(child) + html.escape(child.tail or "") for child in node
    )
    if tag not in MATHML_ELEMENTS:
        return inner
    attrs = "".join(
        f' {name}="{html.escape(value)}"'
        for name, value in node.attrib.items()
        if name in MATHML_ATTRIBUTES
    )
    if tag == "math":
        attrs = ' xmlns="http://www.w3.org/1998/Math/MathML"' + attrs
    return f"<{tag}{attrs}>{inner}</{tag}>"


def math_html(tex: str, display: bool) -> str:
    """TeX as MathML; TeX it cannot draw is shown as itself, as code."""
    shown = f'<code class="math">{escapeHtml(tex)}</code>'
    if len(tex) > MAX_MATH_CHARS:
        return shown
    try:
        tree = ET.fromstring(latex_to_mathml(tex, display="block" if display else "inline"))
    except Exception:  # latex2mathml's errors are many kinds; any one: show the TeX
        return shown
    return _clean_mathml(tree)


def _highlighted(code: str, lang: str, _attrs: Any) -> str:
    """A fence in a named language, highlighted (Pygments' classes); "" (markdown-it then
    escapes it as plain code) for no language or one Pygments does not know."""
    name = lang.split()[0] if lang.strip() else ""
    if not name:
        return ""
    try:
        lexer = get_lexer_by_name(name)
    except ClassNotFound:
        return ""
    body = highlight(code, lexer, HtmlFormatter(nowrap=True))
    return f'<pre class="highlight"><code class="language-{escapeHtml(name)}">{body}</code></pre>'


def _linkable(url: object) -> bool:
    return isinstance(url, str) and url.strip().lower().startswith(LINK_SCHEMES)


def _bracket_math(state: StateInline, silent: bool) -> bool:
    """\\(...\\) (inline) and \\[...\\] (display) math, as LaTeX and many models write it, in
    linear time: once no closing delimiter follows one opening, none is looked for after a
    later one (mdit-py-plugins' texmath rule is quadratic in unclosed openings)."""
    src, pos = state.src, state.pos
    if not src.startswith(("\\(", "\\["), pos):
        return False
    close = "\\)" if src[pos + 1] == "(" else "\\]"
    misses: dict[str, int] = state.__dict__.setdefault("_math_misses", {})
    if misses.get(close, len(src)) <= pos:
        return False
    end = src.find(close, pos + 2)
    if end < 0:
        misses[close] = pos
        return False
    if not src[pos + 2 : end].strip():
        return False
    if not silent:
        kind = "math_inline" if close == "\\)" else "math_inline_double"
        token = state.push(kind, "math", 0)
        token.content = src[pos + 2 : end]
        token.markup = src[pos : pos + 2]
    state.pos = end + 2
    return True


@dataclass
class Work:
    """A render's lookahead: what it may take (`budget`), what it took, and whether the budget
    ran out, so that the text was rendered without links and images (`linear`)."""

    budget: int
    spent: int = 0
    linear: bool = False

    @classmethod
    def for_text(cls, text: str) -> Work:
        return cls(LOOKAHEAD_PER_CHAR * len(text) + LOOKAHEAD_ALLOWANCE)


class _OutOfLookahead(Exception):
    """A render's lookahead ran past its budget (raised out of markdown-it's parse)."""


_WORK = "neuronpy.work"  # (where a render's Work is in markdown-it's env)


def _metered(md: MarkdownIt) -> MarkdownIt:
    """`md`, its inline lookahead counted against the Work in the render's env."""
    skip = md.inline.skipToken

    def counted(state: StateInline) -> None:
        work: Work = state.env[_WORK]
        if work.spent >= work.budget:
            raise _OutOfLookahead
        work.spent += 1
        skip(state)

    md.inline.skipToken = counted  # type: ignore[method-assign]
    return md


def _parser() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False, "highlight": _highlighted})
    md.enable(["table", "strikethrough"])
    # $...$ and $$...$$ (not "$5 and $10": no space or digit may follow an opening $)
    md.use(dollarmath_plugin, allow_space=False, allow_digits=False, double_inline=True)
    md.inline.ruler.before("escape", "bracket_math", _bracket_math)  # (\( is no escape)
    md.validateLink = _linkable

    def inline_math(self: Any, tokens: Any, idx: int, options: Any, env: Any) -> str:
        return math_html(tokens[idx].content, display=False)

    def display_math(self: Any, tokens: Any, idx: int, options: Any, env: Any) -> str:
        return math_html(tokens[idx].content, display=True)  # $$...$$ within a paragraph

    def block_math(self: Any, tokens: Any, idx: int, options: Any, env: Any) -> str:
        return f'<div class="math-block">{math_html(tokens[idx].content, display=True)}</div>\n'

    md.add_render_rule("math_inline", inline_math)
    md.add_render_rule("math_inline_double", display_math)
    for kind in ("math_block", "math_block_label"):  # (a label: not shown)
        md.add_render_rule(kind, block_math)

    def link_open(self: Any, tokens: Any, idx: int, options: Any, env: Any) -> str:
        token = tokens[idx]
        if not _linkable(token.attrGet("href")):  # ([x]() is not validated: no href then)
            return "<a>"
        token.attrSet("target", "_blank")
        token.attrSet("rel", "noopener noreferrer nofollow")
        return self.renderToken(tokens, idx, options, env)

    def image(self: Any, tokens: Any, idx: int, options: Any, env: Any) -> str:
        token = tokens[idx]
        src = str(token.attrGet("src") or "")
        alt = escapeHtml(self.renderInlineAsText(token.children or [], options, env) or src)
        if not _linkable(src):
            return alt
        return (
            f'<a href="{escapeHtml(src)}" target="_blank" rel="noopener noreferrer nofollow">'
            f"{alt}</a>"
        )

    md.add_render_rule("link_open", link_open)
    md.add_render_rule("image", image)
    return md


_MD = _metered(_parser())
# the same without the two rules that look ahead: linear in the text (no skipToken calls)
LINEAR = _metered(_parser().disable(["link", "image"]))


def render_markdown(text: str, work: Work | None = None) -> str:
    """`text` (a model's reply) as safe HTML; without links and images (its brackets as
    written) when its lookahead would pass `work`'s budget (by default the text's own:
    Work.for_text), so that no text takes more than a linear amount of work."""
    work = Work.for_text(text) if work is None else work
    try:
        return _MD.render(text, {_WORK: work})
    except _OutOfLookahead:
        work.linear = True
        return LINEAR.render(text, {_WORK: work})


@cache
def highlight_css() -> str:
    """The highlighter's colours: a light scheme, and a dark one for a dark page."""
    light = HtmlFormatter(style="default").get_style_defs(".highlight")
    dark = HtmlFormatter(style="monokai").get_style_defs(".highlight")
    return f"{light}\n@media (prefers-color-scheme: dark) {{\n{dark}\n}}\n"


def _texts(body: Any) -> list[str]:
    texts = body.get("texts") if isinstance(body, dict) else None
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise ApiError(400, "'texts' must be a list of strings", param="texts")
    if len(texts) > MAX_TEXTS:
        raise ApiError(400, f"'texts' holds at most {MAX_TEXTS} texts", param="texts")
    if sum(len(t) for t in texts) > MAX_CHARS:
        raise ApiError(400, f"'texts' holds at most {MAX_CHARS} characters", param="texts")
    return texts


async def render(request: Request, limits: BodyLimits) -> Response:
    """POST /render: {"texts": [markdown, ...]} -> {"html": [html, ...]}, in order."""
    texts = _texts(await read_json(request, limits))
    rendered = await anyio.to_thread.run_sync(
        lambda: [render_markdown(t) for t in texts], limiter=_LIMITER
    )
    return JSONResponse({"html": rendered}, headers={"Cache-Control": "no-store"})
