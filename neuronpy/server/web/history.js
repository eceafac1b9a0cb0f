"use strict";
// The conversations kept in this browser (local storage): the list, the one shown, search,
// and export / import as a JSON file. Each is {id, title, messages, updated}.

const HISTORY_STORE = "neuronpy.conversations";
const CURRENT_STORE = "neuronpy.current";
const OLD_STORE = "neuronpy.chat";  // (one conversation, as earlier versions of the page kept it)

const Conversations = {
  all: [],
  current: null,

  load() {
    try {
      this.all = JSON.parse(localStorage.getItem(HISTORY_STORE) || "[]");
    } catch (e) {
      this.all = [];
    }
    if (!Array.isArray(this.all)) this.all = [];
    const old = localStorage.getItem(OLD_STORE);
    if (old) {
      try {
        const messages = JSON.parse(old);
        if (Array.isArray(messages) && messages.length) this.all.unshift(this.make(messages));
      } catch (e) { /* an unreadable old conversation is dropped */ }
      localStorage.removeItem(OLD_STORE);
    }
    const wanted = localStorage.getItem(CURRENT_STORE);
    this.current = this.all.find((c) => c.id === wanted) || this.all[0] || this.create();
    this.save();
  },

  make(messages) {
    const id = Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
    return { id, title: "", messages, updated: Date.now() };
  },

  create() {
    const conversation = this.make([]);
    this.all.unshift(conversation);
    this.current = conversation;
    this.save();
    return conversation;
  },

  select(id) {
    const found = this.all.find((c) => c.id === id);
    if (found) this.current = found;
    this.save();
  },

  remove(id) {
    this.all = this.all.filter((c) => c.id !== id);
    if (!this.current || this.current.id === id) this.current = this.all[0] || null;
    if (!this.current) this.create();
    this.save();
  },

  save() {
    const c = this.current;
    for (const each of this.all) {  // (a title: the first user message's start)
      const first = each.messages.find((m) => m.role === "user");
      each.title = first ? first.content.slice(0, 60) : "";
    }
    try {
      localStorage.setItem(HISTORY_STORE, JSON.stringify(this.all));
    } catch (e) {  // the browser's storage is full (pictures take room): kept without them
      const text = JSON.stringify(this.all, (key, value) => (key === "images" ? undefined : value));
      try {
        localStorage.setItem(HISTORY_STORE, text);
      } catch (again) {
        return;  // (the conversations stay in this page; they are not kept)
      }
    }
    if (c) localStorage.setItem(CURRENT_STORE, c.id);
  },

  touch() {
    if (this.current) this.current.updated = Date.now();
    this.save();
  },

  // the conversations whose title or any message holds `query` (all, for an empty one)
  search(query) {
    const q = query.trim().toLowerCase();
    if (!q) return this.all;
    return this.all.filter((c) =>
      (c.title || "").toLowerCase().includes(q)
      || c.messages.some((m) => (m.content || "").toLowerCase().includes(q)));
  },

  exportJson() {
    return JSON.stringify({ neuronpy: "conversations", conversations: this.all }, null, 2);
  },

  // conversations from an exported file, added to the list; how many were added
  importJson(text) {
    const data = JSON.parse(text);
    const list = Array.isArray(data) ? data : data.conversations;
    if (!Array.isArray(list)) throw new Error("not a file of exported conversations");
    let added = 0;
    for (const item of list) {
      if (!item || !Array.isArray(item.messages)) continue;
      const messages = item.messages
        .filter((m) => m && typeof m.role === "string")
        .map((m) => ({ ...m, content: typeof m.content === "string" ? m.content : "" }));
      const conversation = this.make(messages);
      conversation.updated = Number(item.updated) || Date.now();
      this.all.push(conversation);
      added++;
    }
    this.save();
    return added;
  },
};
