"use strict";
// The chat page: a conversation streamed over /v1/chat/completions. Everything the model
// writes is put on the page as text nodes (never as HTML), so markup in a reply is shown, not
// run.

const STORE = "neuronpy.chat";
const $ = (id) => document.getElementById(id);
let conversation = JSON.parse(localStorage.getItem(STORE) || "[]");
let controller = null;

function save() {
  localStorage.setItem(STORE, JSON.stringify(conversation));
}

// A small, safe markdown: ``` fences, `code`, **bold**, *italics*, paragraphs, line breaks.
function renderInline(parent, text) {
  const pattern = /(`[^`\n]+`|\*\*[^*\n]+\*\*|\*[^*\n]+\*)/g;
  let last = 0;
  for (const match of text.matchAll(pattern)) {
    if (match.index > last) addLines(parent, text.slice(last, match.index));
    const token = match[0];
    if (token.startsWith("`")) parent.appendChild(el("code", "", token.slice(1, -1)));
    else if (token.startsWith("**")) parent.appendChild(el("strong", "", token.slice(2, -2)));
    else parent.appendChild(el("em", "", token.slice(1, -1)));
    last = match.index + token.length;
  }
  if (last < text.length) addLines(parent, text.slice(last));
}

function addLines(parent, text) {
  text.split("\n").forEach((line, i) => {
    if (i) parent.appendChild(document.createElement("br"));
    parent.appendChild(document.createTextNode(line));
  });
}

function renderMarkdown(parent, text) {
  parent.replaceChildren();
  const fence = /```[^\n]*\n?([\s\S]*?)(```|$)/g;
  let last = 0;
  const prose = (chunk) => {
    for (const para of chunk.split(/\n{2,}/)) {
      if (!para.trim()) continue;
      const p = el("p");
      renderInline(p, para);
      parent.appendChild(p);
    }
  };
  for (const match of text.matchAll(fence)) {
    prose(text.slice(last, match.index));
    const pre = el("pre");
    pre.appendChild(el("code", "", match[1]));
    parent.appendChild(pre);
    last = match.index + match[0].length;
    if (!match[0].length) break;
  }
  prose(text.slice(last));
}

function messageNode(message, index) {
  const node = el("div", "message " + message.role);
  node.appendChild(el("div", "role", message.role));
  if (message.reasoning) {
    const details = el("details", "reasoning");
    details.appendChild(el("summary", "", "reasoning"));
    details.appendChild(el("div", "", message.reasoning));
    node.appendChild(details);
  }
  const body = el("div", "content");
  if (message.role === "assistant") renderMarkdown(body, message.content || "");
  else addLines(body, message.content || "");
  node.appendChild(body);
  for (const call of message.tool_calls || []) {
    node.appendChild(el("div", "tool-call", call.function.name + "(" + call.function.arguments + ")"));
  }
  if (message.error) node.appendChild(el("div", "error", message.error));
  if (message.role === "assistant") {
    const meta = el("div", "meta");
    if (message.stats) meta.appendChild(el("span", "stats", message.stats));
    const copy = el("button", "copy", "copy");
    copy.type = "button";
    copy.addEventListener("click", () => navigator.clipboard.writeText(message.content || ""));
    meta.appendChild(copy);
    if (index === conversation.length - 1) {
      const again = el("button", "regenerate", "regenerate");
      again.type = "button";
      again.addEventListener("click", regenerate);
      meta.appendChild(again);
    }
    node.appendChild(meta);
  }
  return node;
}

function render() {
  const box = $("messages");
  box.replaceChildren(...conversation.map(messageNode));
  window.scrollTo(0, document.body.scrollHeight);
}

async function loadModels() {
  const response = await api("/v1/models");
  if (!response.ok) {
    $("status").textContent = "models: " + (await errorText(response));
    return;
  }
  const { data } = await response.json();
  const select = $("model");
  select.replaceChildren(...data.map((m) => el("option", "", m.id)));
  const wanted = localStorage.getItem("neuronpy.model");
  if (wanted && data.some((m) => m.id === wanted)) select.value = wanted;
  $("status").textContent = "";
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const m of conversation) {
    if (m.error && !m.content) continue;
    const item = { role: m.role, content: m.content || "" };
    if (m.tool_calls && m.tool_calls.length) item.tool_calls = m.tool_calls;
    messages.push(item);
  }
  const body = {
    model: $("model").value,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    max_tokens: Number($("max_tokens").value),
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  const tools = $("tools").value.trim();
  if (tools) body.tools = JSON.parse(tools);  // (a bad list: the error is shown in the reply)
  return body;
}

async function complete() {
  const reply = { role: "assistant", content: "", reasoning: "" };
  conversation.push(reply);
  render();
  const node = $("messages").lastChild;
  const body = node.querySelector(".content");
  controller = new AbortController();
  $("stop").disabled = false;
  $("send").disabled = true;
  const started = performance.now();
  let first = null;
  let usage = null;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const line = buffer.slice(0, cut).trim();
        buffer = buffer.slice(cut + 2);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const delta = choice.delta || {};
          if (first === null && (delta.content || delta.reasoning)) first = performance.now();
          reply.content += delta.content || "";
          reply.reasoning += delta.reasoning || "";
          for (const call of delta.tool_calls || []) {
            reply.tool_calls = reply.tool_calls || [];
            const known = reply.tool_calls[call.index];
            if (!known) reply.tool_calls[call.index] = { id: call.id, type: "function", function: { name: call.function.name || "", arguments: call.function.arguments || "" } };
            else known.function.arguments += call.function.arguments || "";
          }
        }
        renderMarkdown(body, reply.content);
        if (reply.reasoning && !node.querySelector("details")) render();
      }
    }
  } catch (error) {
    if (error.name !== "AbortError") reply.error = String(error.message || error);
    else reply.error = "stopped";
  } finally {
    controller = null;
    $("stop").disabled = true;
    $("send").disabled = false;
  }
  const ended = performance.now();
  if (first !== null) {
    const ttft = Math.round(first - started);
    const tokens = usage ? usage.completion_tokens : null;
    const rate = tokens && ended > first ? (tokens / ((ended - first) / 1000)).toFixed(1) : null;
    reply.stats = "TTFT " + ttft + " ms" + (rate ? " · " + rate + " tok/s" : "") + (tokens ? " · " + tokens + " tokens" : "");
  }
  save();
  render();
}

function send(event) {
  if (event) event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || controller) return;
  conversation.push({ role: "user", content: text });
  $("prompt").value = "";
  save();
  complete();
}

function regenerate() {
  if (controller) return;
  if (conversation.length && conversation[conversation.length - 1].role === "assistant") conversation.pop();
  complete();
}

window.addEventListener("DOMContentLoaded", () => {
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) send(e);
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("new-chat").addEventListener("click", () => {
    conversation = [];
    save();
    render();
  });
  $("model").addEventListener("change", () => localStorage.setItem("neuronpy.model", $("model").value));
  render();
  loadModels();
});
