"use strict";
// Replies shown as markdown. The server renders it (POST /render: CommonMark, tables, TeX
// math as MathML, highlighted code; raw HTML in a reply comes back as text), so the page holds
// no parser of its own. While a reply streams, its rendered part is shown with the text that
// came since after it, as text, and the server is asked again at most every RENDER_EVERY_MS,
// one request at a time, and less often for a reply whose render takes long (a long code
// block): never sooner than RENDER_SHARE times the last render's time after it, so that a
// streaming reply's renders take at most about a tenth of a core from the model. A reply the
// server cannot render is shown as plain text.

const RENDER_EVERY_MS = 250;
const RENDER_SHARE = 10;
const RENDERED_KEEP = 400;  // rendered replies kept for redrawing the page (the latest ones)
const renderedHtml = new Map();  // reply text -> its HTML

function remember(text, html) {
  renderedHtml.delete(text);
  renderedHtml.set(text, html);
  if (renderedHtml.size > RENDERED_KEEP) renderedHtml.delete(renderedHtml.keys().next().value);
}

// `text` as text nodes, its line breaks as <br>
function addLines(parent, text) {
  text.split("\n").forEach((line, i) => {
    if (i) parent.appendChild(document.createElement("br"));
    parent.appendChild(document.createTextNode(line));
  });
}

// the server's HTML of each of `texts`, in order (null: it could not render them)
async function renderTexts(texts) {
  try {
    const response = await api("/render", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ texts }),
    });
    if (!response.ok) return null;
    const html = (await response.json()).html;
    texts.forEach((text, i) => remember(text, html[i]));
    return html;
  } catch (e) {
    return null;
  }
}

// each code block gets a button copying its code
function addCopyButtons(node) {
  for (const pre of node.querySelectorAll("pre")) {
    const button = el("button", "copy-code", "copy");
    button.type = "button";
    button.title = "copy this code";
    button.addEventListener("click", () => navigator.clipboard.writeText(pre.querySelector("code").textContent));
    pre.prepend(button);
  }
}

// `node` shows `html` (the server's, rendered from `text`), then `tail` as text
function showRendered(node, html, tail) {
  const template = document.createElement("template");
  template.innerHTML = html;
  node.replaceChildren(template.content);
  addCopyButtons(node);
  if (tail) {
    const rest = el("p", "unrendered");
    addLines(rest, tail);
    node.appendChild(rest);
  }
}

// the replies drawn before the server has rendered them: asked for together, shortly after
let waiting = [];
let waitingTimer = null;

// `node` shows reply `text`: rendered if it was, else as text until the server has rendered it
function showMarkdown(node, text) {
  node.dataset.text = text;
  if (renderedHtml.has(text)) return showRendered(node, renderedHtml.get(text), "");
  node.replaceChildren();
  addLines(node, text);
  if (!text.trim()) return;
  waiting.push(node);
  if (!waitingTimer) waitingTimer = setTimeout(renderWaiting, 0);
}

async function renderWaiting() {
  const nodes = waiting;
  waiting = [];
  waitingTimer = null;
  const texts = [...new Set(nodes.map((n) => n.dataset.text))];
  // in requests within the server's bounds (/render: at most 256 texts, 400,000 characters)
  for (let start = 0, size = 0, i = 0; i <= texts.length; i++) {
    if (i === texts.length || i - start === 64 || size + texts[i].length > 100000) {
      if (i > start) await renderTexts(texts.slice(start, i));
      [start, size] = [i, 0];
    }
    if (i < texts.length) size += texts[i].length;
  }
  for (const node of nodes) {  // (unless it has been redrawn meanwhile)
    const text = node.dataset.text;
    if (node.isConnected && renderedHtml.has(text)) showRendered(node, renderedHtml.get(text), "");
  }
}

// a reply being streamed into `node`: update() with its text so far, as often as it grows;
// finish() once it has ended, which resolves when the whole reply is rendered
class StreamingMarkdown {
  constructor(node) {
    this.node = node;
    this.text = "";
    this.shown = "";  // the text the shown HTML is of
    this.html = "";
    this.pending = null;  // the render asked for and not yet answered
    this.lastAsked = 0;
    this.lastTook = 0;  // how long the last render took, in ms (the round trip)
    this.timer = null;
    this.failed = false;
    this.finished = false;
  }

  update(text) {
    this.text = text;
    this.draw();
    if (!this.pending && !this.timer && !this.failed && !this.finished) {
      const every = Math.max(RENDER_EVERY_MS, RENDER_SHARE * this.lastTook);
      const wait = Math.max(0, this.lastAsked + every - performance.now());
      this.timer = setTimeout(() => {
        this.timer = null;
        this.ask();
      }, wait);
    }
  }

  draw() {
    const { node, text, shown } = this;
    node.dataset.text = text;
    if (this.failed || !shown || !text.startsWith(shown)) {
      node.replaceChildren();
      addLines(node, text);
    } else showRendered(node, this.html, text.slice(shown.length));
  }

  // one render at a time: the one under way, or a new one of the text so far
  ask() {
    if (this.pending || this.failed) return this.pending;
    this.lastAsked = performance.now();
    const text = this.text;
    this.pending = renderTexts([text]).then((html) => {
      this.lastTook = performance.now() - this.lastAsked;
      this.pending = null;
      if (html === null) this.failed = true;
      else [this.shown, this.html] = [text, html[0]];
      this.draw();
      if (!this.failed && this.text !== this.shown) this.update(this.text);
    });
    return this.pending;
  }

  async finish() {
    this.finished = true;
    clearTimeout(this.timer);
    this.timer = null;
    await this.pending;
    if (!this.text.trim() || this.failed) return;
    if (this.text !== this.shown) await this.ask();
  }
}
