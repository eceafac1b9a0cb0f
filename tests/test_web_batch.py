"""The batch view's plots (GET /batch, batch.js) in a real headless browser: per model, the last
two minutes of polls of /v1/batch as three SVG plots (batch size, decode steps/s, KV held).

Nothing here waits on the clock: a running request is held to the page's polls (`Paced`), so it
stays in the batch however fast or slow this machine is, and the plots' arithmetic is checked
on polls the test writes itself (playwright's request routing)."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest

from tests.scripted import Paced, hold_plans, live_requests, wait_for
from tests.servers import open_streams
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
  const states = [...card.querySelectorAll("tr.request td:nth-child(2)")].map((n) => n.textContent);
  const kv = card.querySelector(".figures + div");
  const empty = card.querySelector(".empty");
  return {
    plots, figures, rows, states, kv: kv && kv.textContent, empty: empty && empty.textContent,
  };
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
    context = chromium.new_context(**{"viewport": {"width": 1200, "height": 900}, **options})
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
    assert loading == {
        "plots": {},
        "figures": {},
        "rows": [],
        "states": [],
        "kv": None,
        "empty": None,
    }
    # legible in this colour scheme: text 4.5:1 on the card, lines 3:1
    assert colours
    for tag, panel, colour, opacity in colours:
        seen = blend(colour, opacity, panel)
        assert contrast(panel, seen) >= (4.5 if tag == "text" else 3), (scheme, tag, seen)


# ---- decode steps/s while the steps are slower than the polls; nothing running; phones ---------


class EveryNthPoll:
    """Holds one engine's steps to the batch view's polls, slower than them: while a request
    labelled `prefix...` runs, the engine takes a step at every `every`-th poll of /v1/batch
    and at no other time, and that poll is answered once the step has been booked (its
    counters then hold it). So of every `every` polls, one sees exactly one more decode step
    and the others none: a model whose step takes longer than the page's poll, however fast
    this machine is."""

    def __init__(self, engine: Any, prefix: str, every: int) -> None:
        self._engine = engine
        self._prefix = prefix
        self._every = every
        self._go = threading.Event()  # a step may run
        self._parked = threading.Event()  # the engine waits for the next go
        self._free = threading.Event()
        self._undo: Any = None
        self.polls = 0

    def _running(self) -> bool:
        return any(str(r["label"] or "").startswith(self._prefix) for r in self._engine.rows())

    def __enter__(self) -> EveryNthPoll:
        prefix, go, parked, free = self._prefix, self._go, self._parked, self._free
        live = live_requests(self._engine)

        def held(requests: Any) -> bool:
            return not free.is_set() and any(
                (live[r.id].label or "").startswith(prefix) and not live[r.id].done
                for r in requests
            )

        async def paced(requests: Any) -> None:  # (on the engine's event loop, before a step)
            if held(requests):
                parked.set()
                while held(requests) and not await wait_for(go, 0.05):
                    pass
                go.clear()

        async def rows() -> list[dict[str, object]]:  # (on the server's event loop)
            self.polls += 1
            if self.polls % self._every == 0 and parked.is_set():
                parked.clear()
                go.set()
                with anyio.fail_after(60):  # until the step is booked and the next one waits
                    while not parked.is_set() and not free.is_set() and self._running():
                        await anyio.sleep(0.005)
            return self._engine.rows()  # type: ignore[no-any-return]

        self._engine.batch_rows = rows
        self._undo = hold_plans(self._engine, paced)
        return self

    def __exit__(self, *exc: object) -> None:
        self._free.set()
        self._go.set()
        self._undo()
        del self._engine.batch_rows


NEW_POLL = "([model, t]) => polls[model] && polls[model][polls[model].length - 1].t > t"
LAST_POLL = "(model) => polls[model][polls[model].length - 1].t"


def test_decode_steps_per_second_show_while_six_rows_decode_slower_than_the_polls(
    browser: Any,  # noqa: F811
    served: Any,  # noqa: F811
) -> None:
    server, scripts = served
    model = "tiny-llama"
    script(scripts[model], server, model, "[six]", "la " * 200)  # 400 tokens, no early EOS
    engine = server.state.models[model].engine
    body = {"model": model, "max_tokens": 440, "stream": True}
    paced = EveryNthPoll(engine, "six-", every=3)
    with paced, batch_page(browser) as (page, errors), contextlib.ExitStack() as streams:
        page.goto(server.url + "/batch")
        page.wait_for_selector(CARD.format(model) + " svg.plot.batch-size")
        # (the readers kept: one let go closes its stream, which cancels its request)
        _readers = open_streams(streams, server, body, "[six]", "six-", 6, wait=False, timeout=120)
        # the six decoding, and a rate shown
        decoding = (
            "s.states.length === 6 && s.states.every((x) => x === 'decoding')"
            " && Number(s.figures['decode steps/s']) > 0"
        )
        snapshot_when(page, model, decoding, timeout=120_000)
        seen = []
        for _ in range(9):  # the next nine polls, each as the page showed it
            t = page.evaluate(LAST_POLL, model)
            page.wait_for_function(NEW_POLL, arg=[model, t], timeout=60_000)
            seen.append(page.evaluate(SNAPSHOT, model))
        steps = page.evaluate("(model) => polls[model].map((p) => p.steps)", model)
        polled = paced.polls
    assert not errors, errors
    # the engine stepped at one poll in three: most polls saw no new step ...
    last = steps[-10:]
    moved = sum(b > a for a, b in itertools.pairwise(last))
    assert 2 <= moved <= 4 and polled >= 9, (last, polled)
    assert all(b - a <= 1 for a, b in itertools.pairwise(last)), last
    # ... yet every poll, while the six rows decode, shows a rate
    for shot in seen:
        assert shot["states"] == ["decoding"] * 6, shot["states"]
        assert float(shot["figures"]["decode steps/s"]) > 0, shot["figures"]
        assert float(shot["plots"]["decode-steps-per-s"]["latest"]) > 0
    server.wait_for(lambda s: s["running"] == 0, model=model)  # (the streams closed: cancelled)


def test_the_batch_view_says_when_nothing_runs(browser: Any, served: Any) -> None:  # noqa: F811
    server, _ = served
    fetched: list[int] = []

    def answer(route: Any) -> None:
        fetched.append(len(fetched))
        route.fulfill(json=batch_of(fetched[-1]))

    with batch_page(browser) as (page, errors):
        page.route("**/v1/batch", answer)
        page.goto(server.url + "/batch")
        busy = snapshot_when(page, "stepping", "s.rows.length === 1")
        idle = page.evaluate(SNAPSHOT, "no-capacity")
        assert page.locator(CARD.format("no-capacity") + " table").count() == 0
        assert page.locator(CARD.format("stepping") + " .empty").count() == 0
    assert not errors, errors
    assert busy["empty"] is None and busy["rows"] == ["r-1"]
    assert idle["rows"] == [] and idle["empty"] is not None
    assert idle["empty"].startswith("No requests running")
    # and on a real server with nothing admitted
    model = "tiny-llama"
    server.wait_for(lambda s: s["running"] == 0 and s["queued"] == 0, model=model)
    with batch_page(browser) as (page, errors):
        page.goto(server.url + "/batch")
        shown = snapshot_when(page, model, "s.empty !== null")
    assert not errors, errors
    assert shown["rows"] == [] and shown["empty"].startswith("No requests running")


def test_the_batch_view_fits_a_phone(browser: Any, served: Any) -> None:  # noqa: F811
    server, _ = served
    long = "chatcmpl-3f9c0e8a5b7d4e21a6c9f0b1d2e3f4a5"  # (ids as clients send them)
    fetched: list[int] = []

    def answer(route: Any) -> None:
        fetched.append(len(fetched))
        polled = batch_of(fetched[-1])
        stepping = polled["models"]["stepping"]
        stepping["requests"] = [
            {
                **stepping["requests"][0],
                "label": f"{long}-{i}",
                "id": i,
                "prompt_tokens": 1234,
                "output_tokens": 100 + i,
                "max_tokens": 4096,
            }
            for i in range(6)
        ]
        route.fulfill(json=polled)

    with batch_page(browser, viewport={"width": 390, "height": 844}) as (page, errors):
        page.route("**/v1/batch", answer)
        page.goto(server.url + "/batch")
        snapshot_when(page, "stepping", "s.rows.length === 6")
        width = page.evaluate("document.documentElement.scrollWidth")
        inner = page.evaluate("window.innerWidth")
        tables = page.evaluate(
            "() => [...document.querySelectorAll('table')].map((t) => [t.getBoundingClientRect()"
            ".right, t.parentElement.scrollWidth > t.parentElement.clientWidth])"
        )
    assert not errors, errors
    assert width <= inner == 390, width  # nothing sideways
    for right, scrolls in tables:
        assert right <= 390 and not scrolls, tables  # the table fits, not scrolled either
