"use strict";
// Shared by the chat page and the batch view: the API key (asked for on a 401, kept in this
// browser's local storage, sent as a bearer token) and fetch with it.

const KEY_STORE = "neuronpy.apiKey";

function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

function askForKey() {
  const dialog = document.getElementById("key-dialog");
  const form = document.getElementById("key-form");
  const input = document.getElementById("key");
  return new Promise((resolve) => {
    form.addEventListener("submit", () => {
      localStorage.setItem(KEY_STORE, input.value.trim());
      resolve();
    }, { once: true });
    dialog.showModal();
    input.focus();
  });
}

// fetch with the key; a 401 asks for the key once and tries again
async function api(path, options = {}) {
  for (let attempt = 0; ; attempt++) {
    const headers = Object.assign({}, options.headers || {});
    if (apiKey()) headers["Authorization"] = "Bearer " + apiKey();
    const response = await fetch(path, Object.assign({}, options, { headers }));
    if (response.status !== 401 || attempt > 0) return response;
    await askForKey();
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || response.statusText;
  } catch (e) {
    return response.statusText;
  }
}

// an element holding `text` as text (never as HTML)
function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}
