"use strict";
// The batch view: every half second, each model's live batch from /v1/batch, and under its
// figures the last two minutes of polls as three plots: batch size, decode steps/s, KV held.

const SVG = "http://www.w3.org/2000/svg";
const WINDOW_MS = 120000;  // what the plots show: the polls of the last two minutes
// decode steps/s: the steps over the polls of the last RATE_MS, and never fewer than RATE_POLLS
// polls back, so that a step slower than the polls (a big model, a long batch) still reads as
// a rate rather than 0 at each poll that fell between two steps
const RATE_MS = 5000;
const RATE_POLLS = 8;
const polls = {};  // model -> its polls within the window, oldest first: {t, batch, steps, rate, kv}

// The decode steps/s at `now` of a model whose counter reads `steps`: from the oldest of its
// kept polls within RATE_MS (or RATE_POLLS polls back), none for the first poll; never across a
// poll where the counter went back (the model was loaded again).
function stepRate(kept, steps, now) {
  let base = null;
  let later = steps;
  for (let i = kept.length - 1; i >= 0; i--) {
    const p = kept[i];
    if (p.steps > later) break;
    base = p;
    later = p.steps;
    if (kept.length - i >= RATE_POLLS && p.t <= now - RATE_MS) break;
  }
  return base && now > base.t ? (steps - base.steps) / ((now - base.t) / 1000) : null;
}

// Keeps this poll of model `name` (seen at `now`, in ms) and drops those older than the window.
function record(name, m, now) {
  const kept = polls[name] || (polls[name] = []);
  const rate = stepRate(kept, m.decode_steps, now);
  kept.push({ t: now, batch: m.live_batch_size, steps: m.decode_steps, rate, kv: m.kv_tokens });
  while (kept[0].t < now - WINDOW_MS) kept.shift();
  return kept;
}

// an SVG element with these attributes (and text, as text)
function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

// One series over the window, as an <svg class="plot KIND">: its name (the axis label) and its
// latest value above the plot, the top of its scale labelled ("max 8": a limit, drawn dashed;
// or the window's peak), and a line through its polls. data-latest / data-max / data-unit hold
// the latest value, the top label's value and the unit, as numbers and text, for tests and
// tools. `values` is [[time in ms, value or null]], `now` the latest poll's time.
const W = 300, H = 124, TOP = 34, BOTTOM = 108;
function panel({ kind, label, unit, colour, values, now, limit, format }) {
  const seen = values.filter(([, v]) => Number.isFinite(v));
  const latest = seen.length ? seen[seen.length - 1][1] : null;
  const peak = Math.max(0, ...seen.map(([, v]) => v));
  const most = limit ? Math.max(limit, peak) : peak;  // the scale's top
  const top = limit ? "max " + format(limit) : "peak " + format(peak);
  const x = (t) => (W * (t - (now - WINDOW_MS))) / WINDOW_MS;
  const y = (v) => BOTTOM - ((BOTTOM - TOP) * v) / Math.max(most, 1e-9);
  const current = latest === null ? "–" : format(latest);

  const plot = svg("svg", {
    class: "plot " + kind, viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img",
    "data-latest": latest === null ? "" : latest, "data-max": limit || peak, "data-unit": unit,
    "aria-label": `${label}, last 2 minutes: now ${current}, ${top}`,
  });
  plot.appendChild(svg("title", {}, `${label} over the last 2 minutes`));
  // text in the page's own colour (currentColor), so it reads in either colour scheme
  const text = (cls, at, baseline, anchor, size, content) => plot.appendChild(svg("text", {
    class: cls, x: at, y: baseline, "text-anchor": anchor, "font-size": size,
    fill: "currentColor", "fill-opacity": size > 11 ? 1 : 0.75, "font-weight": size > 11 ? 600 : 400,
  }, content));
  text("label", 0, 14, "start", 13, label);
  text("latest", W, 14, "end", 14, current);
  text("top", 2, TOP - 5, "start", 11, top);
  text("since", 0, H - 2, "start", 11, "2 min ago");
  text("now", W, H - 2, "end", 11, "now");
  plot.appendChild(svg("rect", {
    class: "frame", x: 0.5, y: TOP, width: W - 1, height: BOTTOM - TOP,
    fill: "none", stroke: "currentColor", "stroke-opacity": 0.25,
  }));
  if (limit) {
    plot.appendChild(svg("line", {
      class: "limit", x1: 0, x2: W, y1: y(limit), y2: y(limit),
      stroke: "currentColor", "stroke-opacity": 0.5, "stroke-dasharray": "4 3",
    }));
  }
  const points = seen.map(([t, v]) => x(t).toFixed(1) + "," + y(v).toFixed(1)).join(" ");
  plot.appendChild(svg("polyline", {
    points, fill: "none", stroke: colour, "stroke-width": 2, "stroke-linejoin": "round",
  }));
  if (seen.length) {
    const [t, v] = seen[seen.length - 1];
    plot.appendChild(svg("circle", { cx: x(t), cy: y(v), r: 3, fill: colour }));
  }
  return plot;
}

// mid-tone colours that read on the light and the dark panel alike (3:1 or more on both)
const BLUE = "#3b82f6", GREEN = "#16a34a", AMBER = "#d97706";
const whole = (v) => String(Math.round(v));
const tenths = (v) => v.toFixed(1);
const percent = (v) => (Number.isInteger(v) ? v : v.toFixed(1)) + "%";

// the three plots of a model's polls
function plots(kept, m) {
  const now = kept[kept.length - 1].t;
  const series = (key) => kept.map((p) => [p.t, p[key]]);
  const box = el("div", "plots");
  box.appendChild(panel({
    kind: "batch-size", label: "batch size", unit: "rows", colour: BLUE,
    values: series("batch"), now, limit: m.max_in_flight, format: whole,
  }));
  box.appendChild(panel({
    kind: "decode-steps-per-s", label: "decode steps/s", unit: "steps/s", colour: GREEN,
    values: series("rate"), now, format: tenths,
  }));
  const capacity = m.kv_capacity;
  box.appendChild(capacity > 0
    ? panel({
      kind: "kv-held", label: "KV held (of " + capacity + " tokens)", unit: "%", colour: AMBER,
      values: kept.map((p) => [p.t, (100 * p.kv) / capacity]), now, limit: 100, format: percent,
    })
    : panel({
      kind: "kv-held", label: "KV held (tokens)", unit: "tokens", colour: AMBER,
      values: series("kv"), now, format: whole,
    }));
  return box;
}

function card(name, m) {
  const node = el("section", "card");
  node.dataset.model = name;
  const title = el("h2", "", name + " ");
  title.appendChild(el("span", "badge " + m.status, m.status));
  node.appendChild(title);
  if (m.live_batch_size === undefined) return node;  // no engine (yet): nothing more to show
  const kept = record(name, m, performance.now());
  const rate = kept[kept.length - 1].rate;
  const figures = el("div", "figures");
  const figure = (label, value) => {
    const span = el("span", "", label + " ");
    span.appendChild(el("b", "", String(value)));
    figures.appendChild(span);
  };
  figure("live batch", m.live_batch_size + " / " + m.max_in_flight);
  figure("running", m.running);
  figure("queued", m.queued);
  figure("decode steps/s", rate === null ? "–" : rate.toFixed(1));  // (– : the first poll)
  figure("prefix cache hits", m.prefix_cache_hits + " of " + (m.prefix_cache_hits + m.prefix_cache_misses));
  node.appendChild(figures);
  if (m.kv_capacity > 0) {
    const kv = el("div", "kv", "KV held: " + m.kv_tokens + " of " + m.kv_capacity + " tokens ");
    const bar = el("span", "bar");
    const fill = el("span");
    fill.style.width = Math.min(100, (100 * m.kv_tokens) / m.kv_capacity) + "%";
    bar.appendChild(fill);
    kv.appendChild(bar);
    node.appendChild(kv);
  } else {
    node.appendChild(el("div", "kv", "KV held: " + m.kv_tokens + " tokens"));
  }
  node.appendChild(plots(kept, m));
  node.appendChild(m.requests.length ? requestTable(m.requests) : idle(m));
  return node;
}

// each admitted request, a row: the id its client sees, its state, its tokens
function requestTable(requests) {
  const table = el("table");
  const head = el("tr");
  for (const h of ["request", "state", "prompt tokens", "tokens so far", "max tokens"]) head.appendChild(el("th", "", h));
  table.appendChild(head);
  for (const r of requests) {
    const row = el("tr", "request");
    row.appendChild(el("td", "label", r.label || String(r.id)));  // the id its client (and the log) sees
    row.appendChild(el("td", "state-" + r.state, r.state));
    row.appendChild(el("td", "", String(r.prompt_tokens)));
    row.appendChild(el("td", "", String(r.output_tokens)));
    row.appendChild(el("td", "", String(r.max_tokens)));
    table.appendChild(row);
  }
  const wrap = el("div", "table-wrap");
  wrap.appendChild(table);
  return wrap;
}

// what a model with no admitted request shows in place of the table
function idle(m) {
  const box = el("p", "empty");
  box.appendChild(el("b", "", "No requests running"));
  box.appendChild(document.createTextNode(
    "Requests appear here, a row each, while they are queued, prefilled and decoded (up to "
    + m.max_in_flight + " at once)."));
  return box;
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const response = await api("/v1/batch");
    if (!response.ok) {
      status.textContent = await errorText(response);
    } else {
      const { models } = await response.json();
      document.getElementById("models").replaceChildren(
        ...Object.entries(models).map(([name, m]) => card(name, m)));
      status.textContent = "updated " + new Date().toLocaleTimeString();
    }
  } catch (error) {
    status.textContent = String(error);
  }
  setTimeout(poll, 500);
}

window.addEventListener("DOMContentLoaded", poll);
