"use strict";
// The batch view: every half second, each model's live batch from /v1/batch.

const history = {};  // model -> recent live batch sizes
const steps = {};  // model -> [decode steps, time] of the previous poll
const KEEP = 120;

function sparkline(values, most) {
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("viewBox", "0 0 " + KEEP + " 60");
  svg.setAttribute("preserveAspectRatio", "none");
  const line = document.createElementNS(ns, "polyline");
  const top = Math.max(1, most);
  line.setAttribute("points", values.map((v, i) => i + "," + (58 - (56 * v) / top)).join(" "));
  svg.appendChild(line);
  return svg;
}

function card(name, m) {
  const now = performance.now();
  const past = history[name] || (history[name] = []);
  past.push(m.live_batch_size || 0);
  if (past.length > KEEP) past.shift();
  const prev = steps[name];
  const rate = prev ? ((m.decode_steps - prev[0]) / ((now - prev[1]) / 1000)) : 0;
  steps[name] = [m.decode_steps, now];
  const node = el("section", "card");
  node.dataset.model = name;
  node.appendChild(el("h2", "", name + " (" + m.status + ")"));
  const figures = el("div", "figures");
  const figure = (label, value) => {
    const span = el("span", "", label + " ");
    span.appendChild(el("b", "", String(value)));
    figures.appendChild(span);
  };
  figure("live batch", m.live_batch_size + " / " + m.max_in_flight);
  figure("running", m.running);
  figure("queued", m.queued);
  figure("decode steps/s", rate.toFixed(1));
  figure("prefix cache hits", m.prefix_cache_hits + " of " + (m.prefix_cache_hits + m.prefix_cache_misses));
  node.appendChild(figures);
  const kv = el("div", "", "KV held: " + m.kv_tokens + " of " + m.kv_capacity + " tokens ");
  const bar = el("span", "bar");
  const fill = el("span");
  fill.style.width = Math.min(100, (100 * m.kv_tokens) / Math.max(1, m.kv_capacity)) + "%";
  bar.appendChild(fill);
  kv.appendChild(bar);
  node.appendChild(kv);
  node.appendChild(sparkline(past, m.max_in_flight));
  const table = el("table");
  const head = el("tr");
  for (const h of ["request", "state", "prompt tokens", "tokens so far", "max_tokens"]) head.appendChild(el("th", "", h));
  table.appendChild(head);
  for (const r of m.requests) {
    const row = el("tr", "request");
    row.appendChild(el("td", "", r.label || String(r.id)));  // the id its client sees
    row.appendChild(el("td", "state-" + r.state, r.state));
    row.appendChild(el("td", "", String(r.prompt_tokens)));
    row.appendChild(el("td", "", String(r.output_tokens)));
    row.appendChild(el("td", "", String(r.max_tokens)));
    table.appendChild(row);
  }
  node.appendChild(table);
  return node;
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
