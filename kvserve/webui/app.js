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
// Tools (llama-server's web UI agent loop, our own code): when GET tools answers a list (kvserve or
// llama-server started with --tools or MCP servers), each conversation offers the tools it has not
// switched off as OpenAI tool definitions; the model's tool calls run through POST tools (x-tool-cwd
// only when the settings name a working directory; exec_shell_command streamed), each shown as a
// collapsed block, and their results go back as role "tool" messages until the model answers
// without a tool call, at most "max tool rounds" (default 10) rounds. Writes, shell commands and MCP
// tools not marked read-only wait for the user's confirmation unless allowed for the conversation.
// Only the user's choices decide what runs: a call naming a tool the conversation switched off,
// or one the server does not list, is answered with an error message and never sent to the server.
// No tool list (404, 403, an error): no tool controls, and requests are exactly as without tools.
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
  const DEFAULT_TOOL_ROUNDS = 10; // tool rounds per answer when the settings leave it empty
  const MAX_TOOL_ROUNDS = 100;
  const MAX_CALLS_PER_ROUND = 32; // more calls in one answer are answered with an error, not run
  const MAX_TOOL_OUTPUT = 256 * 1024; // characters of one tool result kept, shown and sent back
  // always asked first, whatever a server's listing says about them
  const CONFIRM_TOOLS = new Set(["write_file", "edit_file", "exec_shell_command"]);
  const STREAM_TOOLS = new Set(["exec_shell_command"]); // llama-server streams only this one

  const $ = (id) => document.getElementById(id);
  const ui = {
    convs: $("conversations"), newChat: $("new-chat"), model: $("model"), note: $("server-note"),
    settingsToggle: $("settings-toggle"), settings: $("settings"), system: $("set-system"),
    temperature: $("set-temperature"), maxTokens: $("set-max-tokens"), messages: $("messages"),
    empty: $("empty"), composer: $("composer"), input: $("input"), send: $("send"), stop: $("stop"),
    keyOverlay: $("key-overlay"), keyForm: $("key-form"), keyInput: $("key-input"), keyError: $("key-error"),
    toolsToggle: $("tools-toggle"), toolsPanel: $("tools-panel"), toolsAll: $("tools-all"), toolsList: $("tools-list"),
    toolSettings: $("tool-settings"), cwd: $("set-cwd"), toolRounds: $("set-tool-rounds"),
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
    settings: Object.assign({ system: "", temperature: "", max_tokens: "", cwd: "", tool_rounds: "" },
                            load(STORE_SETTINGS, {})),
    busy: null, // {controller, conv} while an answer streams or its tools run
    tools: null, // the server's tools ([toolInfo]), null when it has none
    draftTools: null, // the tool choices made before the first message (no conversation yet)
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
                messages: [], updated: Date.now(), tools: state.draftTools || defaultToolChoices() };
    state.draftTools = null;
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
    ui.cwd.value = state.settings.cwd;
    ui.toolRounds.value = state.settings.tool_rounds;
  }

  for (const [field, input] of [["system", ui.system], ["temperature", ui.temperature], ["max_tokens", ui.maxTokens],
                                ["cwd", ui.cwd], ["tool_rounds", ui.toolRounds]]) {
    input.addEventListener("input", () => {
      state.settings[field] = input.value;
      save(STORE_SETTINGS, state.settings);
    });
  }

  ui.settingsToggle.addEventListener("click", () => {
    ui.settings.hidden = !ui.settings.hidden;
    ui.settingsToggle.setAttribute("aria-expanded", String(!ui.settings.hidden));
  });

  // ------------------------------------------------------------------ tools (the server's list)

  /** One entry of GET tools (llama-server's shape: {tool, display_name, type, permissions: {write},
   *  definition: {type: "function", function: {name, description, parameters}}}) as this page
   *  uses it, or null when the entry is malformed. `confirm`: the user must confirm each call;
   *  `stream`: POST tools with stream: true. */
  function toolInfo(t) {
    const fn = t && t.definition && t.definition.function;
    const name = fn && typeof fn.name === "string" ? fn.name : (t && typeof t.tool === "string" ? t.tool : "");
    if (!name || name.length > 256) return null;
    const type = typeof t.type === "string" ? t.type : "server";
    const readOnly = t.read_only === true || (t.annotations && t.annotations.readOnlyHint === true);
    const write = !!(t.permissions && t.permissions.write);
    return {
      name, type,
      display: typeof t.display_name === "string" && t.display_name ? t.display_name : name,
      description: fn && typeof fn.description === "string" ? fn.description : "",
      parameters: fn && fn.parameters && typeof fn.parameters === "object" ? fn.parameters
                                                                           : { type: "object", properties: {} },
      confirm: CONFIRM_TOOLS.has(name) || write || (type !== "server" && !readOnly),
      stream: STREAM_TOOLS.has(name) || t.support_stream === true,
    };
  }

  /** GET tools: the server's tools, or none (404 without --tools, llama-server's 403, errors). */
  async function loadTools() {
    let list = [];
    try {
      const r = await api("tools");
      if (r.ok) {
        const body = await r.json();
        if (Array.isArray(body)) list = body.map(toolInfo).filter(Boolean);
      }
    } catch (e) { /* no tools */ }
    const seen = new Set();
    list = list.filter((t) => !seen.has(t.name) && seen.add(t.name));
    state.tools = list.length ? list : null;
    ui.toolsToggle.hidden = !state.tools;
    ui.toolSettings.hidden = !state.tools;
    if (!state.tools) ui.toolsPanel.hidden = true;
    document.body.dataset.tools = String(list.length);
    renderToolsPanel();
  }

  function defaultToolChoices() {
    return { enabled: true, disabled: [], allowed: [] };
  }

  /** The tool choices of a conversation (or of the one about to start): {enabled, disabled: [name],
   *  allowed: [name]}, repaired when stored data is malformed. */
  function toolChoices(conv) {
    const holder = conv || state;
    const key = conv ? "tools" : "draftTools";
    let c = holder[key];
    if (!c || typeof c !== "object") c = defaultToolChoices();
    if (!Array.isArray(c.disabled)) c.disabled = [];
    if (!Array.isArray(c.allowed)) c.allowed = [];
    c.enabled = c.enabled !== false;
    holder[key] = c;
    return c;
  }

  /** The tools offered to the model in `conv`: the server's, less those the user switched off. */
  function offeredTools(conv) {
    if (!state.tools) return [];
    const c = toolChoices(conv);
    return c.enabled ? state.tools.filter((t) => !c.disabled.includes(t.name)) : [];
  }

  function saveToolChoices() {
    if (currentConv()) saveConvs();
  }

  function renderToolsPanel() {
    ui.toolsList.replaceChildren();
    if (!state.tools) return;
    const c = toolChoices(currentConv());
    const n = offeredTools(currentConv()).length;
    ui.toolsToggle.textContent = "Tools " + n + "/" + state.tools.length;
    ui.toolsToggle.title = n + " of the server's " + state.tools.length + " tools offered in this conversation";
    ui.toolsAll.checked = c.enabled;
    for (const t of state.tools) {
      const row = document.createElement("div");
      row.className = "tool-row";
      row.dataset.tool = t.name;
      const on = document.createElement("label");
      const box = document.createElement("input");
      box.type = "checkbox";
      box.className = "tool-enabled";
      box.checked = !c.disabled.includes(t.name);
      box.disabled = !c.enabled;
      box.addEventListener("change", () => {
        const ch = toolChoices(currentConv());
        ch.disabled = ch.disabled.filter((n) => n !== t.name);
        if (!box.checked) ch.disabled.push(t.name);
        saveToolChoices();
        renderToolsPanel();
      });
      const name = document.createElement("span");
      name.className = "tool-display";
      name.textContent = t.display;
      name.title = t.name + (t.description ? ": " + t.description : "");
      on.append(box, " ", name);
      row.appendChild(on);
      if (t.type !== "server") row.appendChild(badge(t.type.toUpperCase(), "tool-kind"));
      if (t.confirm) {
        row.appendChild(badge("asks first", "tool-asks"));
        const al = document.createElement("label");
        al.className = "tool-allow";
        const allow = document.createElement("input");
        allow.type = "checkbox";
        allow.className = "tool-always";
        allow.checked = c.allowed.includes(t.name);
        allow.addEventListener("change", () => setAllowed(currentConv(), t.name, allow.checked));
        al.append(allow, " always allow");
        row.appendChild(al);
      }
      ui.toolsList.appendChild(row);
    }
  }

  function badge(text, cls) {
    const b = document.createElement("span");
    b.className = "badge " + cls;
    b.textContent = text;
    return b;
  }

  function setAllowed(conv, name, on) {
    const ch = toolChoices(conv);
    ch.allowed = ch.allowed.filter((n) => n !== name);
    if (on) ch.allowed.push(name);
    saveToolChoices();
  }

  ui.toolsAll.addEventListener("change", () => {
    toolChoices(currentConv()).enabled = ui.toolsAll.checked;
    saveToolChoices();
    renderToolsPanel();
  });

  ui.toolsToggle.addEventListener("click", () => {
    ui.toolsPanel.hidden = !ui.toolsPanel.hidden;
    ui.toolsToggle.setAttribute("aria-expanded", String(!ui.toolsPanel.hidden));
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
    renderToolsPanel();
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

  const TOOL_STATUS = { pending: "waiting for you", running: "running\u2026", done: "done", error: "error",
                        denied: "denied", stopped: "cancelled" };

  /** The collapsed block of one tool call and its result (a role "tool" message, which keeps the
   *  call's name and arguments beside its result). Everything shown is set as text. */
  function toolNode(m) {
    const wrap = document.createElement("div");
    wrap.className = "msg tool";
    wrap.dataset.tool = m.name || "";
    wrap.dataset.callId = m.tool_call_id || "";
    const d = document.createElement("details");
    d.className = "tool-call";
    const s = document.createElement("summary");
    const name = document.createElement("span");
    name.className = "tool-name";
    const tool = state.tools && state.tools.find((t) => t.name === m.name);
    name.textContent = tool ? tool.display : (m.name || "?");
    name.title = m.name || "";
    const brief = document.createElement("code");
    brief.className = "tool-brief";
    brief.textContent = argsBrief(m);
    const st = document.createElement("span");
    st.className = "badge tool-status";
    const exit = document.createElement("span");
    exit.className = "badge tool-exit";
    s.append(name, " ", brief, " ", st, " ", exit);
    const args = document.createElement("pre");
    args.className = "tool-args";
    args.textContent = argsPretty(m.arguments);
    const result = document.createElement("pre");
    result.className = "tool-result";
    d.append(s, label("Arguments"), args, label("Result"), result);
    wrap.appendChild(d);
    updateToolNode(wrap, m);
    return wrap;
  }

  function label(text) {
    const l = document.createElement("div");
    l.className = "tool-label";
    l.textContent = text;
    return l;
  }

  /** Refresh a tool block's status, exit code and result from its message. */
  function updateToolNode(node, m) {
    node.dataset.status = m.status || "done";
    const st = node.querySelector(".tool-status");
    st.textContent = TOOL_STATUS[m.status] || m.status || "";
    st.dataset.value = m.status || "";
    const exit = node.querySelector(".tool-exit");
    exit.hidden = m.exit_code === undefined || m.exit_code === null;
    exit.textContent = exit.hidden ? "" : "exit " + m.exit_code + (m.timed_out ? " (timed out)" : "");
    exit.dataset.value = exit.hidden ? "" : String(m.exit_code);
    node.querySelector(".tool-result").textContent = m.content || "";
  }

  function parseArgs(text) {
    try {
      const v = JSON.parse(text || "{}");
      return v && typeof v === "object" && !Array.isArray(v) ? v : null;
    } catch (e) {
      return null;
    }
  }

  function argsPretty(text) {
    const v = parseArgs(text);
    return v ? JSON.stringify(v, null, 2) : String(text || "");
  }

  /** One line for the summary: a shell command as it is, else the arguments as compact JSON. */
  function argsBrief(m) {
    const v = parseArgs(m.arguments);
    let s = v && typeof v.command === "string" ? v.command : v && typeof v.path === "string" ? v.path
      : v ? JSON.stringify(v) : String(m.arguments || "");
    s = s.replace(/\s+/g, " ");
    return s.length > 120 ? s.slice(0, 119) + "\u2026" : s;
  }

  /** The element of one message; assistant text as Markdown, user text as plain text, a tool
   *  call's result as its collapsed block. */
  function messageNode(m) {
    if (m.role === "tool") return toolNode(m);
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

  function requestBody(conv, tools) {
    const messages = [];
    const system = state.settings.system.trim();
    if (system) messages.push({ role: "system", content: system });
    for (const m of conv.messages) {
      if (m.role === "tool") {
        if (m.status !== "pending" && m.status !== "running") {
          messages.push({ role: "tool", tool_call_id: m.tool_call_id, content: m.content || "" });
        }
        continue;
      }
      if (m.role === "assistant" && m.status === "error" && !m.content && !(m.tool_calls && m.tool_calls.length)) continue;
      if (m.role === "assistant" && m.status === "streaming") continue;
      const out = { role: m.role, content: m.content };
      if (m.role === "assistant" && Array.isArray(m.tool_calls) && m.tool_calls.length) {
        out.tool_calls = m.tool_calls.map((c) => ({ id: c.id, type: "function",
                                                    function: { name: c.function.name, arguments: c.function.arguments } }));
      }
      messages.push(out);
    }
    const body = { messages, stream: true, stream_options: { include_usage: true } };
    if (tools && tools.length) {
      body.tools = tools.map((t) => ({ type: "function",
                                       function: { name: t.name, description: t.description, parameters: t.parameters } }));
    }
    if (ui.model.value) body.model = ui.model.value;
    const t = parseFloat(state.settings.temperature);
    if (!Number.isNaN(t)) body.temperature = t;
    const n = parseInt(state.settings.max_tokens, 10);
    if (!Number.isNaN(n) && n > 0) body.max_tokens = n;
    return body;
  }

  /** Read a stream of JSON lines: Server-Sent Events (`data: {...}`) or NDJSON (`{...}`); calls
   *  onEvent(obj) for each until [DONE] or the end. Other lines (comments, blanks) are skipped. */
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
        let line = buf.slice(0, nl).replace(/\r$/, "");
        buf = buf.slice(nl + 1);
        if (line.startsWith("data:")) line = line.slice(5).trim();
        else if (!line.startsWith("{")) continue; // comments (":" pings), blank lines
        if (line === "[DONE]") return;
        let obj;
        try { obj = JSON.parse(line); } catch (e) { continue; }
        if (onEvent(obj) === false) return;
      }
    }
  }

  /** The answer of this conversation: one streamed completion, then, while the model calls tools
   *  and rounds are left, the calls run (or are refused) and another completion follows. */
  async function sendMessage(text) {
    if (state.busy) return;
    let conv = currentConv();
    if (!conv) conv = newConv();
    if (!conv.messages.length) conv.title = text.replace(/\s+/g, " ").slice(0, 60);
    conv.messages.push({ role: "user", content: text });
    conv.updated = Date.now();
    saveConvs();
    renderAll();
    const controller = new AbortController();
    state.busy = { controller, conv };
    setBusy(true);
    try {
      const maxRounds = toolRounds();
      for (let round = 0; ; round++) {
        // past the last round no tools are offered: the model is asked to answer in words
        const tools = round < maxRounds ? offeredTools(conv) : [];
        const msg = await streamAnswer(conv, tools, controller.signal);
        if (msg.status !== "done" || !msg.tool_calls || !msg.tool_calls.length) break;
        const over = round >= maxRounds ? "the limit of " + maxRounds + " tool rounds per answer was reached"
          : msg.stats.finish_reason === "length" ? "the answer reached max tokens before its tool calls were complete"
          : "";
        const ran = await runToolCalls(conv, msg, over, controller.signal);
        if (!ran || over) break;
      }
    } finally {
      state.busy = null;
      setBusy(false);
      conv.updated = Date.now();
      saveConvs();
      renderSidebar();
      scrollDown(false);
      ui.input.focus();
    }
  }

  function toolRounds() {
    const n = parseInt(state.settings.tool_rounds, 10);
    return Number.isNaN(n) || n < 1 ? DEFAULT_TOOL_ROUNDS : Math.min(n, MAX_TOOL_ROUNDS);
  }

  /** Append a message to the conversation and its node to the page (when it is the one shown). */
  function appendMessage(conv, m) {
    conv.messages.push(m);
    conv.updated = Date.now();
    saveConvs();
    if (currentConv() !== conv) return null;
    ui.empty.hidden = true;
    const node = messageNode(m);
    ui.messages.appendChild(node);
    scrollDown(true);
    return node;
  }

  /** One streamed completion into a new assistant message; returns it with status done, stopped
   *  or error, and its tool_calls when the server has tools and the model called some. */
  async function streamAnswer(conv, tools, signal) {
    const msg = { role: "assistant", content: "", reasoning: "", model: ui.model.value || "", status: "streaming", stats: {} };
    const body = requestBody(conv, tools); // before the message joins the conversation
    renderSidebar();
    let node = appendMessage(conv, msg);
    if (!node) node = messageNode(msg); // another conversation is shown: paint off-page
    const content = node.querySelector(".content");
    const calls = []; // by index: {id, type, function: {name, arguments}}

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
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal,
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
          if (state.tools && Array.isArray(d.tool_calls)) addToolCallDeltas(calls, d.tool_calls);
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
    }
    // calls of a finished answer only: a cut-off call's arguments are not whole
    const whole = calls.filter((c) => c && c.function.name);
    if (msg.status === "done" && whole.length) {
      const ids = new Set(); // each call needs its own id: its result is matched by it
      msg.tool_calls = whole.map((c, i) => {
        const id = c.id && !ids.has(c.id) ? c.id : "call_" + Date.now().toString(36) + "_" + i;
        ids.add(id);
        return { id, type: "function", function: { name: c.function.name, arguments: c.function.arguments } };
      });
    }
    conv.updated = Date.now();
    saveConvs();
    const fresh = messageNode(msg);
    fresh.dataset.chunks = String(chunks);
    if (node.isConnected) node.replaceWith(fresh);
    return msg;
  }

  /** Merge streamed tool-call deltas (OpenAI's: {index, id, function: {name, arguments}} pieces). */
  function addToolCallDeltas(calls, deltas) {
    for (const d of deltas) {
      if (!d || typeof d !== "object") continue;
      const i = Number.isInteger(d.index) ? d.index : calls.length;
      if (i < 0 || i > MAX_CALLS_PER_ROUND * 4) continue;
      const c = calls[i] || (calls[i] = { id: "", type: "function", function: { name: "", arguments: "" } });
      if (typeof d.id === "string" && d.id) c.id = d.id;
      const f = d.function || {};
      if (typeof f.name === "string") c.function.name += f.name;
      if (typeof f.arguments === "string") c.function.arguments += f.arguments;
    }
  }

  // ------------------------------------------------------------------ tool calls

  /** Run (or refuse) each call of `msg`, appending one role "tool" message per call. `over`, when
   *  set, is why none may run. Returns false when the user stopped the answer. */
  async function runToolCalls(conv, msg, over, signal) {
    const pending = msg.tool_calls.map((call) => ({ role: "tool", tool_call_id: call.id, name: call.function.name,
                                                   arguments: call.function.arguments, content: "", status: "pending" }));
    const nodes = [];
    let i = 0;
    try {
      for (; i < pending.length; i++) {
        const m = pending[i];
        const node = nodes[i] = appendMessage(conv, m) || toolNode(m);
        const refusal = over || (i >= MAX_CALLS_PER_ROUND ? "too many tool calls in one answer" : refuse(conv, m));
        if (refusal) {
          finishTool(conv, node, m, "error", "Error: " + refusal);
          continue;
        }
        const tool = state.tools.find((t) => t.name === m.name);
        if (tool.confirm && !toolChoices(conv).allowed.includes(tool.name)) {
          const yes = await askConfirm(conv, node, tool, signal);
          // the user may have switched the tool off while it waited
          const late = refuse(conv, m);
          if (late) {
            finishTool(conv, node, m, "error", "Error: " + late);
            continue;
          }
          if (!yes) {
            finishTool(conv, node, m, "denied", "The user denied this tool call.");
            continue;
          }
        }
        try {
          await execTool(conv, node, tool, m, signal);
        } catch (e) {
          if (e.name === "AbortError") throw e;
          finishTool(conv, node, m, "error", (m.content ? m.content + "\n" : "") + "Error: " + (e.message || String(e)));
        }
      }
      return true;
    } catch (e) {
      if (e.name !== "AbortError") throw e;
      // the model's history needs an answer for every call: the rest are marked cancelled
      for (let j = i; j < pending.length; j++) {
        const m = pending[j];
        m.status = "stopped";
        m.content = (m.content ? m.content + "\n" : "") + "The user stopped this tool call.";
        if (nodes[j]) updateToolNode(nodes[j], m);
        else appendMessage(conv, m);
      }
      saveConvs();
      return false;
    }
  }

  /** Why the call `m` may not run in `conv` (the user's choices, the server's list, its
   *  arguments), or "" when it may. Only the user's choices enable a tool: never the model's. */
  function refuse(conv, m) {
    const tool = state.tools && state.tools.find((t) => t.name === m.name);
    if (!tool) return 'unknown tool "' + m.name + '"';
    if (!offeredTools(conv).includes(tool)) return 'tool "' + m.name + '" is disabled by the user in this conversation';
    if (parseArgs(m.arguments) === null) return "the arguments are not a JSON object: " + String(m.arguments).slice(0, 200);
    return "";
  }

  function finishTool(conv, node, m, status, content) {
    m.status = status;
    m.content = content;
    updateToolNode(node, m);
    saveConvs();
  }

  /** Show the confirmation under a tool block; resolves true (run) or false (deny). "Always allow"
   *  allows this tool for the rest of the conversation. Rejects with AbortError on Stop. */
  function askConfirm(conv, node, tool, signal) {
    const box = document.createElement("div");
    box.className = "tool-confirm";
    const q = document.createElement("div");
    q.className = "tool-question";
    q.textContent = "Run " + tool.display + (tool.display !== tool.name ? " (" + tool.name + ")" : "") + "?";
    const args = document.createElement("pre");
    args.className = "tool-confirm-args";
    args.textContent = node.querySelector(".tool-args").textContent;
    const run = document.createElement("button");
    run.type = "button";
    run.className = "tool-run";
    run.textContent = "Run";
    const deny = document.createElement("button");
    deny.type = "button";
    deny.className = "tool-deny";
    deny.textContent = "Deny";
    const al = document.createElement("label");
    al.className = "tool-allow";
    const always = document.createElement("input");
    always.type = "checkbox";
    always.className = "tool-confirm-always";
    al.append(always, " always allow " + tool.name + " in this conversation");
    const row = document.createElement("div");
    row.className = "tool-buttons";
    row.append(run, deny, al);
    box.append(q, args, row);
    node.appendChild(box);
    scrollDown(true);
    return new Promise((resolve, reject) => {
      const done = (yes) => {
        box.remove();
        signal.removeEventListener("abort", onAbort);
        if (yes && always.checked) {
          setAllowed(conv, tool.name, true);
          renderToolsPanel();
        }
        resolve(yes);
      };
      const onAbort = () => {
        box.remove();
        reject(new DOMException("stopped", "AbortError"));
      };
      if (signal.aborted) return onAbort();
      signal.addEventListener("abort", onAbort, { once: true });
      run.addEventListener("click", () => done(true), { once: true });
      deny.addEventListener("click", () => done(false), { once: true });
    });
  }

  /** POST tools for one call (x-tool-cwd when the settings name a directory; streamed for the
   *  tools that stream), showing its output as it arrives. */
  async function execTool(conv, node, tool, m, signal) {
    m.status = "running";
    updateToolNode(node, m);
    const headers = { "Content-Type": "application/json" };
    const cwd = (state.settings.cwd || "").trim();
    if (cwd) headers["x-tool-cwd"] = cwd;
    const req = { tool: tool.name, params: parseArgs(m.arguments) };
    if (tool.stream) req.stream = true;
    const r = await api("tools", { method: "POST", headers, body: JSON.stringify(req), signal });
    let text = "", error = "";
    if (!r.ok) {
      error = await errorText(r);
    } else if (tool.stream) {
      const out = node.querySelector(".tool-result");
      await readSSE(r, (ev) => {
        if (typeof ev.chunk === "string" && text.length < MAX_TOOL_OUTPUT) {
          const piece = ev.chunk.slice(0, MAX_TOOL_OUTPUT - text.length);
          text += piece;
          m.content = text; // kept should the user stop it
          out.appendChild(document.createTextNode(piece));
          scrollDown(false);
        }
        if (ev.done) {
          if (ev.error) error = String(ev.error);
          return false;
        }
        return true;
      });
    } else {
      const res = await r.json();
      if (res && typeof res === "object" && "error" in res) error = typeof res.error === "string" ? res.error
        : (res.error && res.error.message) || JSON.stringify(res.error);
      else if (res && typeof res.plain_text_response === "string") text = res.plain_text_response;
      else text = JSON.stringify(res);
    }
    if (text.length > MAX_TOOL_OUTPUT) text = text.slice(0, MAX_TOOL_OUTPUT);
    const exit = /\[exit code: (-?\d+)\]( \[exit due to timed out\])?\s*$/.exec(text);
    if (exit) {
      m.exit_code = parseInt(exit[1], 10);
      if (exit[2]) m.timed_out = true;
    }
    const content = error ? (text ? text + "\n" : "") + "Error: " + error : text;
    finishTool(conv, node, m, error ? "error" : "done", content);
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

  // A conversation left "streaming" by a closed tab is shown as stopped; so are its tool calls
  // left waiting or running (their results never came).
  for (const c of state.convs) {
    for (const m of c.messages || []) {
      if (m.status === "streaming") m.status = "stopped";
      if (m.role === "tool" && (m.status === "pending" || m.status === "running")) {
        m.status = "stopped";
        m.content = (m.content ? m.content + "\n" : "") + "The user stopped this tool call.";
      }
    }
  }

  // nothing stored may stop the page: the model picker loads whatever the conversations hold
  try { fillSettings(); } catch (e) { console.error("settings", e); }
  try { renderAll(); } catch (e) { console.error("conversations", e); }
  Promise.all([loadModels(), loadTools()]).then(() => { document.body.dataset.ready = "1"; });
  ui.input.focus();
})();
