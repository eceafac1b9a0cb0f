"use strict";
// The chat page: a conversation streamed over /v1/chat/completions. A reply is shown as
// markdown rendered by the server (markdown.js: raw HTML in it comes back as text); everything
// else the model writes (reasoning, tool calls) is put on the page as text nodes, never as
// HTML, so markup in a reply is shown, not run.

const SETTINGS_STORE = "neuronpy.settings";
// the settings kept in this browser across reloads (the API key is common.js's)
const NUMBERS = ["top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"];
const SETTINGS = [
  "system", "temperature", "top_p", "max_tokens", "seed", "speculative", "tools", "tool_choice",
  ...NUMBERS, "stop_strings", "extra", "schema",
];
const MAX_IMAGE_BYTES = 20 * 1024 * 1024;  // the server's bound on one image
const MAX_IMAGES = 8;  // and on a request's
// a picture larger than this (bytes, or pixels on its longest side) is sent scaled down as a
// JPEG: a request's body is 4 MiB unless the server says more, and the models' processors
// scale pictures to at most 2048 pixels anyway
const SEND_AS_IS_BYTES = 1024 * 1024;
const MAX_SIDE = 2048;
const MODELS_RETRY_MS = 2000;  // while the server loads its models, ask again this often
const $ = (id) => document.getElementById(id);
let conversation = [];  // the messages of the conversation shown (Conversations.current's)
let controller = null;

function save() {
  Conversations.touch();
  renderHistory();
}

// the list of conversations, filtered by the search box; the shown one marked
function renderHistory() {
  const items = Conversations.search($("search").value).map((c) => {
    const item = el("li", c === Conversations.current ? "current" : "");
    const open = el("button", "open", c.title || "(new conversation)");
    open.type = "button";
    open.addEventListener("click", () => show(c.id));
    const drop = el("button", "delete", "×");
    drop.type = "button";
    drop.title = "delete this conversation";
    drop.addEventListener("click", () => {
      if (controller) return;
      Conversations.remove(c.id);
      show(Conversations.current.id);
    });
    item.append(open, drop);
    return item;
  });
  $("conversations").replaceChildren(...items);
}

function show(id) {
  if (controller) return;  // (not while a reply streams into the one shown)
  Conversations.select(id);
  conversation = Conversations.current.messages;
  renderHistory();
  render();
  if (narrow.matches) setDrawer(false);  // (on a phone the list is a drawer over the chat)
}

// ---- the list of conversations: a sidebar, on a phone a drawer; the settings: a dialog --------

const narrow = window.matchMedia("(max-width: 760px)");
const SIDEBAR_STORE = "neuronpy.sidebar";

function setDrawer(open) {
  $("sidebar").classList.toggle("open", open);
  $("scrim").hidden = !open;
  $("history-toggle").setAttribute("aria-expanded", String(open));
  if (open) $("history-close").focus();
}

function toggleHistory() {
  if (narrow.matches) {
    const open = !$("sidebar").classList.contains("open");
    setDrawer(open);
    if (!open) $("history-toggle").focus();
    return;
  }
  const closed = document.body.classList.toggle("sidebar-closed");
  localStorage.setItem(SIDEBAR_STORE, closed ? "closed" : "");
  $("history-toggle").setAttribute("aria-expanded", String(!closed));
}

// the toggle says whether the list shows: beside the chat (wide) or as the drawer (phone)
function syncHistoryToggle() {
  const shown = narrow.matches ? $("sidebar").classList.contains("open")
    : !document.body.classList.contains("sidebar-closed");
  $("history-toggle").setAttribute("aria-expanded", String(shown));
  if (!narrow.matches) $("scrim").hidden = true;
}

function openSettings() {
  const dialog = $("settings");
  if (!dialog.open) dialog.showModal();
  $("settings-toggle").setAttribute("aria-expanded", "true");
}

// the sliders beside temperature and top_p move with their number fields (which are sent)
const SLIDERS = ["temperature", "top_p"];
function syncSliders() {
  for (const id of SLIDERS) if ($(id).value !== "") $(id + "-slider").value = $(id).value;
}

// the message box grows with what is typed, up to a limit (then it scrolls)
function fitPrompt() {
  const box = $("prompt");
  box.style.height = "auto";
  box.style.height = box.scrollHeight + 2 + "px";
}

function saveSettings() {
  const values = {};
  for (const id of SETTINGS) values[id] = $(id).value;
  values["server-session"] = $("server-session").checked ? "on" : "";
  localStorage.setItem(SETTINGS_STORE, JSON.stringify(values));
}

function restoreSettings() {
  let values = {};
  try {
    values = JSON.parse(localStorage.getItem(SETTINGS_STORE) || "{}") || {};
  } catch (e) {
    values = {};
  }
  for (const id of SETTINGS) if (typeof values[id] === "string") $(id).value = values[id];
  $("api-key").value = apiKey();
  $("server-session").checked = values["server-session"] === "on";
}

// whether the page is scrolled to (about) its end: a streaming reply keeps it there
function atBottom() {
  return window.innerHeight + window.scrollY >= document.documentElement.scrollHeight - 80;
}

function toBottom() {
  window.scrollTo(0, document.documentElement.scrollHeight);
}

// a reply as it is shown: one held to a schema as its JSON, indented, in a code block
function shownReply(message) {
  const content = message.content || "";
  if (message.format !== "json") return content;
  try {
    return "```json\n" + JSON.stringify(JSON.parse(content), null, 2) + "\n```";
  } catch (e) {
    return content;  // (not JSON: cut short by max_tokens, or stopped)
  }
}

// the schema field says at once whether it holds JSON (a bad one is not sent)
function checkSchema() {
  const text = $("schema").value.trim();
  let problem = "";
  if (text) {
    try {
      const schema = JSON.parse(text);
      if (typeof schema !== "object" || schema === null || Array.isArray(schema)) problem = "a schema is a JSON object";
    } catch (e) {
      problem = "not JSON: " + (e.message || e);
    }
  }
  $("schema-error").textContent = problem;
  $("schema").setAttribute("aria-invalid", String(Boolean(problem)));
  return !problem;
}

// The images the next message carries (data: URIs), shown above the message box, and the
// models that read images (the attach button shows for those).
let attached = [];
let imageModels = new Set();

function showAttached() {
  const row = $("attachments");
  row.replaceChildren(...attached.map((url, i) => {
    const item = el("span", "attachment");
    const img = el("img");
    img.src = url;
    img.alt = "attached image " + (i + 1);
    const drop = el("button", "remove", "×");
    drop.type = "button";
    drop.title = "Remove this image";
    drop.addEventListener("click", () => {
      attached.splice(i, 1);
      showAttached();
    });
    item.append(img, drop);
    return item;
  }));
  row.hidden = !attached.length;
}

function attachFiles(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    if (attached.length >= MAX_IMAGES) {
      $("status").textContent = "a message takes at most " + MAX_IMAGES + " images";
      return;
    }
    if (file.size > MAX_IMAGE_BYTES) {
      $("status").textContent = (file.name || "the image") + " is larger than 20 MB";
      continue;
    }
    const reader = new FileReader();
    reader.addEventListener("load", () => fitImage(reader.result, file.size));
    reader.readAsDataURL(file);
  }
}

// attaches a picture (a data: URI), scaled down to MAX_SIDE as a JPEG when it is large
function fitImage(url, size) {
  const img = new Image();
  img.addEventListener("load", () => {
    const side = Math.max(img.naturalWidth, img.naturalHeight);
    if (size <= SEND_AS_IS_BYTES && side <= MAX_SIDE) {
      attached.push(url);
    } else {
      const scale = Math.min(1, MAX_SIDE / side);
      const canvas = document.createElement("canvas");
      canvas.width = Math.max(1, Math.round(img.naturalWidth * scale));
      canvas.height = Math.max(1, Math.round(img.naturalHeight * scale));
      canvas.getContext("2d").drawImage(img, 0, 0, canvas.width, canvas.height);
      attached.push(canvas.toDataURL("image/jpeg", 0.9));
    }
    showAttached();
  });
  img.addEventListener("error", () => {
    $("status").textContent = "that file is not an image the browser can read";
  });
  img.src = url;
}

function showAttachButton() {
  $("attach").hidden = !imageModels.has($("model").value);
}

function messageNode(message, index) {
  const node = el("div", "message " + message.role);
  node.appendChild(el("div", "role", message.role));
  if (message.images && message.images.length) {
    const row = el("div", "images");
    for (const url of message.images) {
      const img = el("img");
      img.src = url;
      img.alt = "an image of the message";
      row.appendChild(img);
    }
    node.appendChild(row);
  }
  if (message.reasoning) {
    const details = el("details", "reasoning");
    details.appendChild(el("summary", "", "reasoning"));
    const thinking = el("div", "thinking");
    if (controller && message === conversation[conversation.length - 1]) {
      thinking.textContent = message.reasoning;  // (streaming: as text until it has ended)
    } else showMarkdown(thinking, message.reasoning);
    details.appendChild(thinking);
    node.appendChild(details);
  }
  const body = el("div", "content");
  if (message.role === "assistant") showMarkdown(body, shownReply(message));
  else addLines(body, message.content || "");
  node.appendChild(body);
  for (const call of message.tool_calls || []) {
    node.appendChild(el("div", "tool-call", call.function.name + "(" + call.function.arguments + ")"));
  }
  if (message.error) node.appendChild(el("div", "error", message.error));
  if (message.role === "assistant") {
    const meta = el("div", "meta");
    if (message.stats) meta.appendChild(el("span", "stats", message.stats));
    if (message.speculation) meta.appendChild(el("span", "speculation", message.speculation));
    const copy = el("button", "copy", "copy");
    copy.type = "button";
    copy.addEventListener("click", () => navigator.clipboard.writeText(message.content || ""));
    meta.appendChild(copy);
    const again = el("button", "regenerate", "regenerate");
    again.type = "button";
    again.addEventListener("click", () => regenerate(index));
    meta.appendChild(again);
    if (index === conversation.length - 1 && message.error !== "stopped") {
      const more = el("button", "continue", "continue");
      more.type = "button";
      more.addEventListener("click", () => continueReply(index));
      meta.appendChild(more);
    }
    node.appendChild(meta);
  }
  if (message.role === "user") {
    const meta = el("div", "meta");
    const edit = el("button", "edit", "edit");
    edit.type = "button";
    edit.addEventListener("click", () => startEdit(node, index));
    meta.appendChild(edit);
    node.appendChild(meta);
  }
  return node;
}

function render() {
  const box = $("messages");
  box.replaceChildren(...conversation.map(messageNode));
  $("empty").hidden = conversation.length > 0;
  toBottom();  // (a page that fits its window has nowhere to scroll: the top bar stays put)
}

// The served models; while none is ready (the server still loads them) the page says so and
// asks again every MODELS_RETRY_MS, so a page opened during start-up works once it is up.
let modelsTimer = null;
async function loadModels() {
  clearTimeout(modelsTimer);
  let response;
  try {
    response = await api("/v1/models");
  } catch (e) {
    response = null;  // the server is not answering (yet): try again
  }
  if (response && response.status === 401) {
    $("status").textContent = "this server needs an API key: enter it in Settings (the gear at the top)";
    return;
  }
  const data = response && response.ok ? (await response.json()).data : [];
  if (!data.length) {
    const why = response ? await errorText(response) : "the server is not answering";
    $("status").textContent = "waiting for a model (" + why + "); trying again";
    modelsTimer = setTimeout(loadModels, MODELS_RETRY_MS);
    return;
  }
  const select = $("model");
  select.replaceChildren(...data.map((m) => el("option", "", m.id)));
  imageModels = new Set(data.filter((m) => (m.input_modalities || []).includes("image")).map((m) => m.id));
  const wanted = localStorage.getItem("neuronpy.model");
  if (wanted && data.some((m) => m.id === wanted)) select.value = wanted;
  showAttachButton();
  $("status").textContent = "";
}

// the request for the conversation so far, `pending` (the reply being written) left out
function requestBody(pending, continuing) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const m of conversation) {
    if (m === pending || (m.error && !m.content)) continue;
    const item = { role: m.role, content: m.content || "" };
    if (m.images && m.images.length) {  // its images, then its text
      const images = m.images.map((url) => ({ type: "image_url", image_url: { url } }));
      item.content = [...images, { type: "text", text: m.content || "" }];
    }
    if (m.tool_calls && m.tool_calls.length) item.tool_calls = m.tool_calls;
    messages.push(item);
  }
  const body = {
    model: $("model").value,
    messages,
    ...(continuing ? { continue_final_message: true } : {}),
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    max_tokens: Number($("max_tokens").value),
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  if ($("speculative").value) body.speculative = $("speculative").value;
  for (const id of NUMBERS) if ($(id).value !== "") body[id] = Number($(id).value);
  const stops = $("stop_strings").value.split("\n").filter((s) => s !== "");
  if (stops.length) body.stop = stops;
  const schema = $("schema").value.trim();
  if (schema) {  // structured outputs: the reply held to the schema (a bad one: the reply's error)
    body.response_format = {
      type: "json_schema",
      json_schema: { name: "reply", schema: JSON.parse(schema), strict: true },
    };
  }
  // a server session named by the conversation: its KV is saved after each reply and the
  // next turn continues from it, across restarts of the server too
  if ($("server-session").checked) body.session = "page-" + Conversations.current.id;
  const extra = $("extra").value.trim();
  // (not an object: the error is shown in the reply; the stream itself cannot be turned off)
  if (extra) Object.assign(body, JSON.parse(extra), { stream: true });
  const tools = $("tools").value.trim();
  if (tools) {
    body.tools = JSON.parse(tools);  // (a bad list: the error is shown in the reply)
    // "required" holds the reply to a call: tools then work on a model whose template
    // cannot show them (the server enforces the call's shape)
    if ($("tool_choice").value !== "auto") body.tool_choice = $("tool_choice").value;
  }
  return body;
}

// a reply streamed into the conversation: a new one, or more of `continued` (the last one)
async function complete(continued) {
  const reply = continued || { role: "assistant", content: "", reasoning: "" };
  if (!continued && $("schema").value.trim()) reply.format = "json";
  if (continued) {
    delete reply.error;
    delete reply.stats;
    delete reply.speculation;
    reply.reasoning = reply.reasoning || "";
  } else conversation.push(reply);
  render();
  let node = $("messages").lastChild;
  const view = new StreamingMarkdown(node.querySelector(".content"));
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
      body: JSON.stringify(requestBody(continued ? null : reply, Boolean(continued))),
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
        const following = atBottom();
        if (reply.reasoning && !node.querySelector("details")) {
          render();  // (the reply's node anew, now with its folded reasoning)
          node = $("messages").lastChild;
          view.node = node.querySelector(".content");
        }
        const thinking = node.querySelector("details.reasoning > .thinking");
        if (thinking && thinking.textContent !== reply.reasoning) thinking.textContent = reply.reasoning;
        view.update(reply.content);
        if (following) toBottom();
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
  reply.speculation = speculationText(usage);
  await view.finish();  // (the whole reply rendered before the page is redrawn)
  save();
  render();
}

// what the reply's speculative decoding did: its drafted tokens and how many of them stood
// (the usage's accepted / rejected prediction tokens; none when it did not speculate)
function speculationText(usage) {
  const details = usage && usage.completion_tokens_details;
  if (!details || details.accepted_prediction_tokens === undefined) return "";
  const accepted = details.accepted_prediction_tokens;
  const drafted = accepted + details.rejected_prediction_tokens;
  if (!drafted) return "";
  const share = Math.round((100 * accepted) / drafted);
  return "drafts: " + accepted + " of " + drafted + " accepted (" + share + "%)";
}

function send(event) {
  if (event) event.preventDefault();
  const text = $("prompt").value;
  if ((!text.trim() && !attached.length) || controller) return;
  if (!$("model").value) {
    $("status").textContent = "no model is ready yet: your message is kept until one is";
    return;
  }
  if (!checkSchema()) {
    $("status").textContent = "the schema under Settings is not a JSON object: fix it or empty it";
    return;
  }
  const message = { role: "user", content: text };
  if (attached.length) message.images = attached;
  conversation.push(message);
  attached = [];
  showAttached();
  $("prompt").value = "";
  fitPrompt();
  save();
  complete();
}

// a new reply in place of reply `index` (the conversation after it is dropped: a branch)
function regenerate(index) {
  if (controller) return;
  conversation.splice(index);
  save();
  complete();
}

// more of the last reply: it is sent as the start of the assistant's turn, and what comes
// is added to it
function continueReply(index) {
  if (controller || index !== conversation.length - 1) return;
  complete(conversation[index]);
}

// user message `index` edited in place; saving drops what came after it and asks again
function startEdit(node, index) {
  if (controller) return;
  const box = el("textarea", "edit-box");
  box.value = conversation[index].content;
  box.rows = 3;
  const saveButton = el("button", "save-edit", "Save and send");
  saveButton.type = "button";
  saveButton.addEventListener("click", () => {
    if (controller || !box.value.trim()) return;
    conversation.splice(index);
    conversation.push({ role: "user", content: box.value });
    save();
    complete();
  });
  node.querySelector(".content").replaceChildren(box, saveButton);
  box.focus();
}

// the page opens at the end of the conversation shown (not where a reload left it)
if ("scrollRestoration" in history) history.scrollRestoration = "manual";

window.addEventListener("DOMContentLoaded", () => {
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) send(e);
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("new-chat").addEventListener("click", () => {
    if (controller) return;
    const empty = Conversations.current && !Conversations.current.messages.length;
    show(empty ? Conversations.current.id : Conversations.create().id);
  });
  $("search").addEventListener("input", renderHistory);
  $("export").addEventListener("click", () => {
    const blob = new Blob([Conversations.exportJson()], { type: "application/json" });
    const link = el("a");
    link.href = URL.createObjectURL(blob);
    link.download = "neuronpy-conversations.json";
    link.click();
    URL.revokeObjectURL(link.href);
  });
  $("import").addEventListener("change", async () => {
    const file = $("import").files[0];
    if (!file) return;
    try {
      const added = Conversations.importJson(await file.text());
      $("status").textContent = "imported " + added + " conversation(s)";
    } catch (error) {
      $("status").textContent = "import: " + (error.message || error);
    }
    $("import").value = "";
    renderHistory();
  });
  Conversations.load();
  conversation = Conversations.current.messages;
  renderHistory();
  $("model").addEventListener("change", () => {
    localStorage.setItem("neuronpy.model", $("model").value);
    showAttachButton();
  });
  $("attach").addEventListener("click", () => $("image-file").click());
  $("image-file").addEventListener("change", () => {
    attachFiles($("image-file").files);
    $("image-file").value = "";
  });
  $("prompt").addEventListener("paste", (e) => {  // a pasted image is attached, not typed
    const files = [...((e.clipboardData && e.clipboardData.files) || [])].filter((f) => f.type.startsWith("image/"));
    if (!files.length) return;
    e.preventDefault();
    attachFiles(files);
  });
  restoreSettings();
  for (const id of SETTINGS) $(id).addEventListener("input", saveSettings);
  $("server-session").addEventListener("change", saveSettings);
  $("schema").addEventListener("input", checkSchema);
  $("api-key").addEventListener("change", () => {
    setApiKey($("api-key").value);
    loadModels();
  });
  $("settings-toggle").addEventListener("click", openSettings);
  for (const id of ["settings-close", "settings-done"]) $(id).addEventListener("click", () => $("settings").close());
  $("settings").addEventListener("close", () => $("settings-toggle").setAttribute("aria-expanded", "false"));
  $("settings").addEventListener("click", (e) => {  // a click on the backdrop closes it
    if (e.target === $("settings")) $("settings").close();
  });
  for (const id of SLIDERS) {
    $(id + "-slider").addEventListener("input", () => {
      $(id).value = $(id + "-slider").value;
      saveSettings();
    });
    $(id).addEventListener("input", syncSliders);
  }
  syncSliders();
  if (localStorage.getItem(SIDEBAR_STORE) === "closed") document.body.classList.add("sidebar-closed");
  $("history-toggle").addEventListener("click", toggleHistory);
  $("history-close").addEventListener("click", () => {
    setDrawer(false);
    $("history-toggle").focus();
  });
  $("scrim").addEventListener("click", () => setDrawer(false));
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && $("sidebar").classList.contains("open")) {
      setDrawer(false);
      $("history-toggle").focus();
    }
  });
  narrow.addEventListener("change", () => {
    setDrawer(false);
    syncHistoryToggle();
  });
  syncHistoryToggle();
  $("prompt").addEventListener("input", fitPrompt);
  checkSchema();
  render();
  loadModels();
});
