"""The batch view's plots (GET /batch, batch.js) in a real headless browser: per model, the last
two minutes of polls of /v1/batch as three SVG plots (batch size, decode steps/s, KV held).

Nothing here waits on the clock: a running request is held to the page's polls (`Paced`), so it
stays in the batch however fast or slow this machine is, and the plots' arithmetic is checked
on polls the test writes itself (playwright's request routing)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.scripted import Paced
from tests.test_web import browser, script, served  # noqa: F401  (the fixtures)

CARD = "section.card[data-model='{}']"
KINDS = ("batch-size", "decode-steps-per-s", "kv-held")

# Each plot of a model's card as the page shows it at one moment, with the card's figures (the
# same poll's): what a test compares. null when the card or a plot is missing.
SNAPSHOT = """(model) => {
  const card = document.querySelector(`section.card[data-model='${model}']`);
  if (!card) return null;
  const plots = {};
  for (const svg of card.querySelectorAll("svg.plot")) {
    const kind = [...svg.classList].find((c) => c !== "plot");
    const text = (cls) => svg.querySelector("text." + cls).textContent;
    plots[kind] = {
      latest: svg.dataset.latest, max: svg.dataset.max, unit: svg.dataset.unit,
      points: svg.querySelector("polyline").getAttribute("points"),
      label: text("label"), shown: text("latest"), top: text("top"),
    };
  }
  const figures = {};
  for (const span of card.querySelectorAll(".figures span")) {
    const value = span.querySelector("b").textContent;
    figures[span.textContent.slice(0, -value.length).trim()] = value;
  }
  const rows = [...card.querySelectorAll("tr.request td:first-child")].map((td) => td.textContent);
  const kv = card.querySelector(".figures + div");
  return { plots, figures, rows, kv: kv && kv.textContent };
}"""


def snapshot_when(page: Any, model: str, condition: str, timeout: float = 60_000) -> Any:
    """The model's snapshot at the first moment `condition` (JS over `s`, the snapshot) holds."""
    found = page.wait_for_function(
        f"(model) => {{ const s = ({SNAPSHOT})(model); return s && ({condition}) ? s : null; }}",
        arg=model,
        timeout=timeout,
    )
    return found.json_value()


def points(plot: dict[str, Any]) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in (p.split(",") for p in plot["points"].split())]


@contextlib.contextmanager
def batch_page(chromium: Any, **options: Any) -> Iterator[tuple[Any, list[str]]]:
    """A new page, and the errors its scripts throw (a test asserts there are none)."""
    context = chromium.new_context(viewport={"width": 1200, "height": 900}, **options)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        yield page, errors
    finally:
        context.close()


def test_the_plots_follow_a_running_request(browser: Any, served: Any) -> None:  # noqa: F811
    server, scripts = served
    model = "tiny-llama"
    script(scripts[model], server, model, "[plotted]", "la " * 200)  # 400 tokens, no early EOS
    reported = httpx.get(f"{server.v1}/batch").json()["models"][model]
    engine = server.state.models[model].engine
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Go on [plotted]"}],
        "max_tokens": 440,
        "stream": True,
    }
    with Paced(engine, "plot-watch"), batch_page(browser) as (page, errors):
        page.goto(server.url + "/batch")
        page.wait_for_selector(CARD.format(model) + " svg.plot.batch-size")
        with httpx.stream(
            "POST",
            f"{server.v1}/chat/completions",
            json=body,
            headers={"x-request-id": "plot-watch"},
            timeout=60,
        ) as stream:
            reader = stream.iter_lines()  # (kept: a reader let go closes the stream)
            next(reader)  # it runs
            running = snapshot_when(
                page,
                model,
                "s.plots['batch-size'] && Number(s.plots['batch-size'].latest) >= 1"
                " && Number(s.plots['decode-steps-per-s'].latest) > 0",
            )
        # (the stream closed: the server cancels the request and frees its row)
        idle = snapshot_when(page, model, "s.plots['batch-size'].latest === '0' && !s.rows.length")
    assert not errors, errors  # the page's scripts never threw

    plots = running["plots"]
    assert sorted(plots) == sorted(KINDS)
    assert "plot-watch" in running["rows"]
    # batch size: against max_in_flight, as /v1/batch says and the figures show (the same poll)
    size = plots["batch-size"]
    most = reported["max_in_flight"]
    latest = int(size["latest"])
    assert latest >= 1 and size["shown"] == str(latest)
    assert size["max"] == str(most) and size["top"] == f"max {most}"
    assert running["figures"]["live batch"] == f"{latest} / {most}"
    # decode steps/s: the page's own rate, as its figure shows it
    rate = plots["decode-steps-per-s"]
    assert float(rate["latest"]) > 0 and float(rate["max"]) >= float(rate["latest"])
    assert rate["shown"] == running["figures"]["decode steps/s"] == f"{float(rate['latest']):.1f}"
    assert rate["top"].startswith("peak ")
    # KV held: a share of the capacity /v1/batch gives
    kv = plots["kv-held"]
    capacity = reported["kv_capacity"]
    assert capacity > 0 and kv["unit"] == "%" and kv["max"] == "100" and kv["top"] == "max 100%"
    assert str(capacity) in kv["label"]
    held = int(running["kv"].split()[2])  # "KV held: N of C tokens"
    assert held > 0 and float(kv["latest"]) == pytest.approx(100 * held / capacity)
    share = 100 * held / capacity
    assert kv["shown"] == (f"{share:.0f}%" if share == int(share) else f"{share:.1f}%")
    for plot in plots.values():
        assert points(plot)  # a line through the polls
    assert len(points(size)) >= 2 and len(points(rate)) >= 1
    # once it ended: back to 0, more polls in the line
    assert int(idle["plots"]["batch-size"]["latest"]) == 0
    assert len(points(idle["plots"]["batch-size"])) > len(points(size))


def batch_of(poll: int) -> dict[str, Any]:
    """The /v1/batch the page gets at its `poll`-th fetch: written here, so exact."""
    row = {"label": "r-1", "id": 1, "state": "decoding", "prompt_tokens": 5, "max_tokens": 64}
    common = {"status": "ready", "running": 2, "queued": 0, "prefix_cache_hits": 0}
    return {
        "models": {
            "stepping": {
                **common,
                "live_batch_size": 2,
                "max_in_flight": 4,
                "decode_steps": 100 + 7 * poll,  # 7 steps a poll: a positive rate
                "kv_tokens": 250,
                "kv_capacity": 1000,
                "prefix_cache_misses": 1,
                "requests": [{**row, "output_tokens": poll}],
            },
            "no-capacity": {
                **common,
                "live_batch_size": 1,
                "max_in_flight": 2,
                "decode_steps": 50,  # no steps: 0 a second
                "kv_tokens": 250,
                "kv_capacity": None,
                "prefix_cache_misses": 0,
                "requests": [],
            },
            "loading": {"status": "loading"},  # no engine yet: no figures, no plots
        }
    }


def luminance(css: str) -> float:
    """The relative luminance (WCAG) of a computed colour, `rgb(r, g, b)`."""
    channels = [int(v) / 255 for v in css[css.index("(") + 1 : -1].split(",")[:3]]
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(a: str, b: str) -> float:
    light, dark = sorted((luminance(a), luminance(b)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


def blend(css: str, opacity: float, under: str) -> str:
    """`css` drawn at `opacity` over `under`, as the browser composites it."""
    top, bottom = ([int(v) for v in c[c.index("(") + 1 : -1].split(",")[:3]] for c in (css, under))
    mixed = (round(opacity * a + (1 - opacity) * b) for a, b in zip(top, bottom, strict=True))
    return "rgb({}, {}, {})".format(*mixed)


# every plot's text and line: [tag, the card's background, its colour, its opacity]
COLOURS = """() => [...document.querySelectorAll("section.card")].flatMap((card) => {
  const panel = getComputedStyle(card).backgroundColor;
  return [...card.querySelectorAll("svg.plot text, svg.plot polyline")].map((node) => {
    const style = getComputedStyle(node), text = node.tagName === "text";
    return [node.tagName, panel, text ? style.fill : style.stroke,
            Number(text ? style.fillOpacity : style.strokeOpacity)];
  });
})"""


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_the_plots_show_what_the_polls_said(browser: Any, served: Any, scheme: str) -> None:  # noqa: F811
    server, _ = served
    fetched: list[int] = []

    def answer(route: Any) -> None:
        fetched.append(len(fetched))
        route.fulfill(json=batch_of(fetched[-1]))

    with batch_page(browser, color_scheme=scheme) as (page, errors):
        page.route("**/v1/batch", answer)
        page.goto(server.url + "/batch")
        # three polls or more in the line
        three = "s.plots['batch-size'] && s.plots['batch-size'].points.split(' ').length >= 3"
        stepping = snapshot_when(page, "stepping", three)
        other = page.evaluate(SNAPSHOT, "no-capacity")
        loading = page.evaluate(SNAPSHOT, "loading")
        colours = page.evaluate(COLOURS)
    assert not errors, errors

    size, rate, kv = (stepping["plots"][k] for k in KINDS)
    assert (size["latest"], size["max"], size["top"], size["shown"]) == ("2", "4", "max 4", "2")
    assert all(y == points(size)[0][1] for _, y in points(size))  # flat: 2 at every poll
    assert float(rate["latest"]) > 0 and rate["unit"] == "steps/s"
    assert len(points(rate)) == len(points(size)) - 1  # the first poll has no rate
    assert (kv["unit"], kv["latest"], kv["max"], kv["shown"]) == ("%", "25", "100", "25%")
    assert kv["label"] == "KV held (of 1000 tokens)"
    # the line runs left to right (older to newer), inside the plot
    xs = [x for x, _ in points(size)]
    assert xs == sorted(xs) and xs[0] >= 0 and xs[-1] == pytest.approx(300)
    # no capacity: KV held in tokens, against the window's peak; no steps: 0 a second
    other_kv, other_rate = other["plots"]["kv-held"], other["plots"]["decode-steps-per-s"]
    assert (other_kv["unit"], other_kv["latest"], other_kv["top"]) == ("tokens", "250", "peak 250")
    assert other_kv["label"] == "KV held (tokens)"
    assert other_rate["latest"] == "0" and other_rate["shown"] == "0.0"
    assert other["plots"]["batch-size"]["top"] == "max 2"
    assert other["kv"] == "KV held: 250 tokens"
    assert loading == {"plots": {}, "figures": {}, "rows": [], "kv": None}
    # legible in this colour scheme: text 4.5:1 on the card, lines 3:1
    assert colours
    for tag, panel, colour, opacity in colours:
        seen = blend(colour, opacity, panel)
        assert contrast(panel, seen) >= (4.5 if tag == "text" else 3), (scheme, tag, seen)
