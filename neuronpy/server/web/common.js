"use strict";
// Shared by the chat page and the batch view: the API key (asked for on a 401, kept in this
// browser's local storage, sent as a bearer token) and fetch with it.

const KEY_STORE = "neuronpy.apiKey";

function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

function setApiKey(key) {
  localStorage.setItem(KEY_STORE, key.trim());
  const field = document.getElementById("api-key");
  if (field) field.value = key.trim();
}

// The key dialog: true once a key was entered, false when it was dismissed (Escape), so
// that a caller never waits on a dialog nobody will answer. One dialog at a time.
let asking = null;
function askForKey() {
  if (asking) return asking;
  const dialog = document.getElementById("key-dialog");
  const form = document.getElementById("key-form");
  const input = document.getElementById("key");
  let given = false;
  asking = new Promise((resolve) => {
    const submitted = () => {
      given = true;
      setApiKey(input.value);
    };
    form.addEventListener("submit", submitted, { once: true });
    dialog.addEventListener("close", () => {
      form.removeEventListener("submit", submitted);
      asking = null;
      resolve(given);
    }, { once: true });
    dialog.showModal();
    input.focus();
  });
  return asking;
}

// fetch with the key; a 401 asks for the key once and tries again (dismissed: the 401)
async function api(path, options = {}) {
  for (let attempt = 0; ; attempt++) {
    const headers = Object.assign({}, options.headers || {});
    if (apiKey()) headers["Authorization"] = "Bearer " + apiKey();
    const response = await fetch(path, Object.assign({}, options, { headers }));
    if (response.status !== 401 || attempt > 0) return response;
    if (!(await askForKey())) return response;
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
