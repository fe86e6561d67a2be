// kvserve's chat page: plain JavaScript, no build step, no network beyond this server.
//
// Requests: GET v1/models (the picker), POST v1/chat/completions with stream: true and
// stream_options.include_usage (the answer, as Server-Sent Events). Stop aborts the fetch
// (AbortController); the server sees the connection close and cancels the generation.
// Storage: conversations and settings in localStorage (bounded: MAX_CONVERSATIONS, and the
// oldest are dropped when the browser's quota is full); the API key, when the server asks for
// one (401), in sessionStorage, sent as Authorization: Bearer.
// Figures under each answer: prompt tokens and cached tokens (usage.prompt_tokens,
// usage.prompt_tokens_details.cached_tokens, else timings.cache_n), generated tokens, decode speed
// (timings.predicted_per_second), and time to first token as this page measured it.
(function () {
  "use strict";

  const STORE_CONVS = "kvserve.conversations";
  const STORE_CURRENT = "kvserve.current";
  const STORE_SETTINGS = "kvserve.settings";
  const STORE_MODEL = "kvserve.model";
  const STORE_KEY = "kvserve.apiKey";
  const MAX_CONVERSATIONS = 50;
  const MAX_INPUT_CHARS = 200000;
  const PAINT_MS = 100; // while streaming, the answer is rendered at most once per this many ms

  const $ = (id) => document.getElementById(id);
  const ui = {
    convs: $("conversations"), newChat: $("new-chat"), model: $("model"), note: $("server-note"),
    settingsToggle: $("settings-toggle"), settings: $("settings"), system: $("set-system"),
    temperature: $("set-temperature"), maxTokens: $("set-max-tokens"), messages: $("messages"),
    empty: $("empty"), composer: $("composer"), input: $("input"), send: $("send"), stop: $("stop"),
    keyOverlay: $("key-overlay"), keyForm: $("key-form"), keyInput: $("key-input"), keyError: $("key-error"),
  };

  // ------------------------------------------------------------------ storage

  function load(key, fallback) {
    try {
      const v = localStorage.getItem(key);
      return v === null ? fallback : JSON.parse(v);
    } catch (e) {
      return fallback;
    }
  }

  function save(key, value) {
    try {
      localStorage.setItem(key, JSON.stringify(value));
      return true;
    } catch (e) {
      return false; // quota full or storage disabled
    }
  }

  const state = {
    convs: load(STORE_CONVS, []),
    current: load(STORE_CURRENT, null),
    settings: Object.assign({ system: "", temperature: "", max_tokens: "" }, load(STORE_SETTINGS, {})),
    busy: null, // {controller, conv, msg} while an answer streams
  };
  if (!Array.isArray(state.convs)) state.convs = [];

  function saveConvs() {
    state.convs.sort((a, b) => b.updated - a.updated);
    state.convs.length = Math.min(state.convs.length, MAX_CONVERSATIONS);
    while (!save(STORE_CONVS, state.convs) && state.convs.length > 1) {
      state.convs.pop(); // the oldest goes first when the quota is full
    }
    save(STORE_CURRENT, state.current);
  }

  function currentConv() {
    return state.convs.find((c) => c.id === state.current) || null;
  }

  function newConv() {
    const c = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 8), title: "New chat",
                messages: [], updated: Date.now() };
    state.convs.unshift(c);
    state.current = c.id;
    return c;
  }

  // ------------------------------------------------------------------ API key

  function apiKey() {
    try { return sessionStorage.getItem(STORE_KEY) || ""; } catch (e) { return ""; }
  }

  let keyWaiters = null;

  /** Show the key form (once for any number of waiting requests); resolves when a key is entered. */
  function askKey(message) {
    if (!keyWaiters) {
      keyWaiters = [];
      ui.keyError.hidden = !message;
      ui.keyError.textContent = message || "";
      ui.keyInput.value = "";
      ui.keyOverlay.hidden = false;
      ui.keyInput.focus();
    }
    return new Promise((resolve) => keyWaiters.push(resolve));
  }

  ui.keyForm.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = ui.keyInput.value.trim();
    if (!key) return;
    try { sessionStorage.setItem(STORE_KEY, key); } catch (e) { /* kept in memory below */ }
    memoryKey = key;
    ui.keyOverlay.hidden = true;
    const waiters = keyWaiters || [];
    keyWaiters = null;
    waiters.forEach((w) => w());
  });

  let memoryKey = "";

  /** fetch() against this server with the key; a 401 asks for the key and tries again. */
  async function api(path, options) {
    let asked = false;
    for (;;) {
      const key = apiKey() || memoryKey;
      const headers = Object.assign({}, (options && options.headers) || {});
      if (key) headers.Authorization = "Bearer " + key;
      const r = await fetch(path, Object.assign({}, options, { headers }));
      if (r.status !== 401) return r;
      try { sessionStorage.removeItem(STORE_KEY); } catch (e) { /* ignore */ }
      memoryKey = "";
      await askKey(asked || key ? "That key was not accepted." : "");
      asked = true;
    }
  }

  async function errorText(r) {
    try {
      const body = await r.json();
      const e = body && body.error;
      if (typeof e === "string") return e;
      if (e && e.message) return e.message;
    } catch (e) { /* not JSON */ }
    return r.status + " " + r.statusText;
  }

  // ------------------------------------------------------------------ models

  async function loadModels() {
    let list = [], loaded = [];
    try {
      const r = await api("v1/models");
      if (!r.ok) throw new Error(await errorText(r));
      const body = await r.json();
      // Ollama's listing beside OpenAI's says which models embed only: those cannot chat
      const caps = {};
      for (const m of body.models || []) caps[m.model || m.name] = m.capabilities || [];
      const chat = (id) => !(caps[id] && caps[id].includes("embedding") && !caps[id].includes("completion"));
      const models = (body.data || []).filter((m) => chat(m.id));
      list = models.map((m) => m.id);
      loaded = models.filter((m) => m.status && m.status.value === "loaded").map((m) => m.id);
    } catch (e) {
      ui.note.textContent = "Could not list models: " + e.message;
    }
    const wanted = load(STORE_MODEL, null);
    ui.model.replaceChildren();
    for (const id of list) {
      const o = document.createElement("option");
      o.value = id;
      o.textContent = shortName(id);
      o.title = id;
      ui.model.appendChild(o);
    }
    // the last one chosen here, else one the server has loaded (its default), else the first
    if (wanted && list.includes(wanted)) ui.model.value = wanted;
    else if (loaded.length) ui.model.value = loaded[0];
    ui.model.disabled = list.length === 0;
    document.body.dataset.models = String(list.length);
  }

  /** A model id as shown: a file path by its file name (the id itself is sent). */
  function shortName(id) {
    return /[\\/]/.test(id) ? id.split(/[\\/]/).pop() : id;
  }

  ui.model.addEventListener("change", () => save(STORE_MODEL, ui.model.value));

  // ------------------------------------------------------------------ settings

  function fillSettings() {
    ui.system.value = state.settings.system;
    ui.temperature.value = state.settings.temperature;
    ui.maxTokens.value = state.settings.max_tokens;
  }

  for (const [field, input] of [["system", ui.system], ["temperature", ui.temperature], ["max_tokens", ui.maxTokens]]) {
    input.addEventListener("input", () => {
      state.settings[field] = input.value;
      save(STORE_SETTINGS, state.settings);
    });
  }

  ui.settingsToggle.addEventListener("click", () => {
    ui.settings.hidden = !ui.settings.hidden;
    ui.settingsToggle.setAttribute("aria-expanded", String(!ui.settings.hidden));
  });

  // ------------------------------------------------------------------ rendering

  function renderSidebar() {
    ui.convs.replaceChildren();
    for (const c of state.convs) {
      const row = document.createElement("div");
      row.className = "conv" + (c.id === state.current ? " active" : "");
      const open = document.createElement("button");
      open.type = "button";
      open.className = "conv-open";
      open.textContent = c.title || "New chat";
      open.title = c.title || "";
      open.addEventListener("click", () => { if (!state.busy) { state.current = c.id; saveConvs(); renderAll(); } });
      const del = document.createElement("button");
      del.type = "button";
      del.className = "conv-delete";
      del.textContent = "\u00d7";
      del.title = "Delete this conversation";
      del.setAttribute("aria-label", "Delete conversation");
      del.addEventListener("click", () => {
        if (state.busy && state.busy.conv === c) return;
        state.convs = state.convs.filter((x) => x !== c);
        if (state.current === c.id) state.current = state.convs.length ? state.convs[0].id : null;
        saveConvs();
        renderAll();
      });
      row.appendChild(open);
      row.appendChild(del);
      ui.convs.appendChild(row);
    }
  }

  function renderMessages() {
    const conv = currentConv();
    ui.messages.replaceChildren(ui.empty);
    ui.empty.hidden = !!(conv && conv.messages.length);
    if (!conv) return;
    for (const m of conv.messages) ui.messages.appendChild(messageNode(m));
    scrollDown(true);
  }

  function renderAll() {
    renderSidebar();
    renderMessages();
  }

  /** Render `text` as Markdown into `container`; should the renderer fail on it (a bug, or a
   *  browser limit), the text is shown as plain text: one bad message never stops the page. */
  function renderContent(text, container) {
    try {
      window.kvMarkdown.render(text, container);
      container.classList.remove("plain");
    } catch (e) {
      console.error("markdown rendering failed; showing plain text", e);
      container.classList.add("plain");
      container.textContent = String(text);
    }
  }

  /** The element of one message; assistant text as Markdown, user text as plain text. */
  function messageNode(m) {
    const wrap = document.createElement("div");
    wrap.className = "msg " + m.role;
    const who = document.createElement("div");
    who.className = "who";
    who.textContent = m.role === "user" ? "You" : (m.model ? shortName(m.model) : "assistant");
    wrap.appendChild(who);
    if (m.role === "assistant") {
      const d = document.createElement("details");
      d.className = "reasoning";
      d.hidden = !m.reasoning;
      const s = document.createElement("summary");
      s.textContent = "Reasoning";
      const text = document.createElement("div");
      text.className = "reasoning-text";
      text.textContent = m.reasoning || "";
      d.appendChild(s);
      d.appendChild(text);
      wrap.appendChild(d);
    }
    const body = document.createElement("div");
    body.className = "content";
    if (m.role === "user") body.textContent = m.content;
    else renderContent(m.content, body);
    wrap.appendChild(body);
    if (m.error) {
      const e = document.createElement("div");
      e.className = "error";
      e.textContent = m.error;
      wrap.appendChild(e);
    }
    if (m.role === "assistant") wrap.appendChild(statsNode(m.stats || {}, m.status));
    if (m.status) wrap.dataset.status = m.status;
    return wrap;
  }

  function fmtInt(n) { return Number(n).toLocaleString("en-US"); }

  /** The figures line under an answer; each figure is a span with data-stat and data-value. */
  function statsNode(st, status) {
    const line = document.createElement("div");
    line.className = "stats";
    const add = (name, value, text, title) => {
      if (value === undefined || value === null || Number.isNaN(value)) return;
      const s = document.createElement("span");
      s.className = "stat";
      s.dataset.stat = name;
      s.dataset.value = String(value);
      s.textContent = text;
      if (title) s.title = title;
      line.appendChild(s);
    };
    add("prompt", st.prompt_tokens, fmtInt(st.prompt_tokens) + " prompt tokens", "usage.prompt_tokens");
    add("cached", st.cached_tokens, fmtInt(st.cached_tokens) + " cached",
        "prompt tokens reused from the prefix cache (usage.prompt_tokens_details.cached_tokens)");
    add("completion", st.completion_tokens, fmtInt(st.completion_tokens) + " tokens", "generated tokens");
    if (st.tokens_per_s !== undefined) {
      add("speed", st.tokens_per_s.toFixed(1), (st.speed_estimated ? "~" : "") + st.tokens_per_s.toFixed(1) + " tok/s",
          st.speed_estimated ? "estimated by this page (stream chunks / time)" : "decode speed (timings.predicted_per_second)");
    }
    if (st.ttft_ms !== undefined) {
      add("ttft", Math.round(st.ttft_ms), "TTFT " + fmtTime(st.ttft_ms), "time to first token, measured by this page");
    }
    if (status === "streaming") add("status", "streaming", "streaming\u2026");
    else if (status === "stopped") add("status", "stopped", "stopped", "stopped by you; the server cancelled the request");
    else if (status === "error") add("status", "error", "error");
    else if (st.finish_reason) add("finish", st.finish_reason, FINISH[st.finish_reason] || st.finish_reason,
                                   "finish_reason: " + st.finish_reason);
    return line;
  }

  const FINISH = { stop: "complete", length: "max tokens reached", tool_calls: "tool call" };

  function fmtTime(ms) {
    return ms < 1000 ? Math.round(ms) + " ms" : (ms / 1000).toFixed(2) + " s";
  }

  function nearBottom() {
    const el = ui.messages;
    return el.scrollHeight - el.scrollTop - el.clientHeight < 80;
  }

  function scrollDown(force) {
    if (force || nearBottom()) ui.messages.scrollTop = ui.messages.scrollHeight;
  }

  // ------------------------------------------------------------------ chat

  function requestBody(conv) {
    const messages = [];
    const system = state.settings.system.trim();
    if (system) messages.push({ role: "system", content: system });
    for (const m of conv.messages) {
      if (m.role === "assistant" && m.status === "error" && !m.content) continue;
      if (m.role === "assistant" && m.status === "streaming") continue;
      messages.push({ role: m.role, content: m.content });
    }
    const body = { messages, stream: true, stream_options: { include_usage: true } };
    if (ui.model.value) body.model = ui.model.value;
    const t = parseFloat(state.settings.temperature);
    if (!Number.isNaN(t)) body.temperature = t;
    const n = parseInt(state.settings.max_tokens, 10);
    if (!Number.isNaN(n) && n > 0) body.max_tokens = n;
    return body;
  }

  /** Read an SSE body; calls onEvent(obj) for each JSON `data:` line until [DONE]. */
  async function readSSE(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, nl).replace(/\r$/, "");
        buf = buf.slice(nl + 1);
        if (!line.startsWith("data:")) continue; // comments (":" pings), blank lines
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        let obj;
        try { obj = JSON.parse(data); } catch (e) { continue; }
        onEvent(obj);
      }
    }
  }

  async function sendMessage(text) {
    if (state.busy) return;
    let conv = currentConv();
    if (!conv) conv = newConv();
    if (!conv.messages.length) conv.title = text.replace(/\s+/g, " ").slice(0, 60);
    conv.messages.push({ role: "user", content: text });
    const msg = { role: "assistant", content: "", reasoning: "", model: ui.model.value || "", status: "streaming", stats: {} };
    conv.messages.push(msg);
    conv.updated = Date.now();
    saveConvs();
    renderAll();
    const node = ui.messages.lastElementChild;
    const content = node.querySelector(".content");
    const controller = new AbortController();
    state.busy = { controller, conv, msg };
    setBusy(true);

    let chunks = 0, firstAt = null, painted = false, lastPaint = 0;
    const t0 = performance.now();
    const reasoning = node.querySelector(".reasoning");
    const paint = () => {
      painted = false;
      lastPaint = performance.now();
      renderContent(msg.content, content);
      reasoning.hidden = !msg.reasoning;
      reasoning.querySelector(".reasoning-text").textContent = msg.reasoning;
      node.dataset.chunks = String(chunks);
      node.querySelector(".stats").replaceWith(statsNode(msg.stats, msg.status));
      scrollDown(false);
    };
    // the whole answer is rendered again on each paint: at most one paint per PAINT_MS, so a long
    // answer costs O(length) per PAINT_MS, not per animation frame
    const schedule = () => {
      if (painted) return;
      painted = true;
      const wait = Math.max(0, lastPaint + PAINT_MS - performance.now());
      setTimeout(() => requestAnimationFrame(paint), wait);
    };

    try {
      const r = await api("v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(requestBody(conv)), signal: controller.signal,
      });
      if (!r.ok) throw new Error(await errorText(r));
      await readSSE(r, (ev) => {
        if (ev.error) throw new Error(ev.error.message || String(ev.error));
        const choice = ev.choices && ev.choices[0];
        if (choice && choice.delta) {
          const d = choice.delta;
          const piece = d.content || "";
          const thought = d.reasoning_content || d.reasoning || "";
          if (piece || thought) {
            if (firstAt === null) {
              firstAt = performance.now();
              msg.stats.ttft_ms = firstAt - t0;
            }
            chunks++;
            msg.content += piece;
            msg.reasoning += thought;
          }
          if (choice.finish_reason) msg.stats.finish_reason = choice.finish_reason;
        }
        if (ev.timings) {
          const tm = ev.timings;
          if (msg.stats.cached_tokens === undefined) msg.stats.cached_tokens = tm.cache_n;
          if (tm.predicted_per_second) msg.stats.tokens_per_s = tm.predicted_per_second;
          msg.stats.completion_tokens = tm.predicted_n;
          msg.stats.prompt_tokens = tm.cache_n + tm.prompt_n;
        }
        if (ev.usage) {
          const u = ev.usage;
          msg.stats.prompt_tokens = u.prompt_tokens;
          msg.stats.completion_tokens = u.completion_tokens;
          const det = u.prompt_tokens_details;
          if (det && det.cached_tokens !== undefined && det.cached_tokens !== null) msg.stats.cached_tokens = det.cached_tokens;
        }
        if (ev.model) msg.model = ev.model;
        schedule();
      });
      msg.status = "done";
    } catch (e) {
      if (e.name === "AbortError") {
        msg.status = "stopped";
        const secs = (performance.now() - (firstAt || t0)) / 1000;
        if (chunks && secs > 0 && msg.stats.tokens_per_s === undefined) {
          msg.stats.tokens_per_s = chunks / secs;
          msg.stats.speed_estimated = true;
        }
      } else {
        msg.status = "error";
        msg.error = e.message || String(e);
      }
    } finally {
      state.busy = null;
      setBusy(false);
      conv.updated = Date.now();
      saveConvs();
      const fresh = messageNode(msg);
      fresh.dataset.chunks = String(chunks);
      if (node.isConnected) node.replaceWith(fresh);
      renderSidebar();
      scrollDown(false);
      ui.input.focus();
    }
  }

  function setBusy(on) {
    ui.send.hidden = on;
    ui.stop.hidden = !on;
    document.body.dataset.busy = on ? "1" : "";
  }

  ui.composer.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = ui.input.value.trim();
    if (!text || state.busy) return;
    if (text.length > MAX_INPUT_CHARS) {
      ui.note.textContent = "Message too long (" + fmtInt(text.length) + " characters).";
      return;
    }
    ui.input.value = "";
    sendMessage(text);
  });

  ui.input.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      ui.composer.requestSubmit();
    }
  });

  ui.stop.addEventListener("click", () => {
    if (state.busy) state.busy.controller.abort();
  });

  const startNewChat = () => {
    if (state.busy) return;
    const c = currentConv();
    if (c && !c.messages.length) return; // already on an empty one
    newConv();
    saveConvs();
    renderAll();
    ui.input.focus();
  };
  ui.newChat.addEventListener("click", startNewChat);
  $("new-chat-top").addEventListener("click", startNewChat);

  // A conversation left "streaming" by a closed tab is shown as stopped.
  for (const c of state.convs) {
    for (const m of c.messages || []) if (m.status === "streaming") m.status = "stopped";
  }

  // nothing stored may stop the page: the model picker loads whatever the conversations hold
  try { fillSettings(); } catch (e) { console.error("settings", e); }
  try { renderAll(); } catch (e) { console.error("conversations", e); }
  loadModels().then(() => { document.body.dataset.ready = "1"; });
  ui.input.focus();
})();
