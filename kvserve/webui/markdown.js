// A small, safe Markdown renderer for model answers.
//
// Safety: the model's text never goes through innerHTML. Every piece of text becomes a DOM text
// node (which the browser never parses as HTML, the same as escaping it first), and the only
// elements are the ones this file creates: p, br, h1-h6, pre/code, blockquote, ul/ol/li, table,
// hr, strong, em, del, a. Links keep http(s) and mailto URLs only; others stay plain text.
//
// Covers what chat models write: fenced code blocks (``` or ~~~, with a language; an unclosed
// fence, as while streaming, renders what has arrived), ATX headings, lists (nested by
// indentation), block quotes, pipe tables, horizontal rules, inline code, bold, italics,
// strikethrough, links. Paragraph line breaks are kept (as chat UIs do).
//
// Bounded work on any text: quotes and lists nest at most MAX_BLOCK_DEPTH levels (deeper
// markers stay text), emphasis, links and strikethrough at most MAX_INLINE_DEPTH, and the inline
// scanner is linear (the closer of each construct is looked up in tables built once per run of
// text, never searched for again from each opener), so an answer of 6,000 `>` or 20,000 `*a `
// renders in milliseconds instead of throwing RangeError or hanging the tab.
(function () {
  "use strict";

  const MAX_BLOCK_DEPTH = 16;
  const MAX_INLINE_DEPTH = 8;
  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
  const HEADING_START = /^ {0,3}(#{1,6})\s+/;
  const HR = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}>\s?/;
  const ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
  const SAFE_URL = /^(https?:\/\/|mailto:)/i;

  function el(tag, cls) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    return e;
  }

  // An ATX heading: [level, text] or null (the closing #s and spaces dropped, without a
  // backtracking regex: `(.*?)\s*#*\s*$` is cubic on a long run of spaces).
  function heading(line) {
    const m = HEADING_START.exec(line);
    if (!m) return null;
    let text = line.slice(m[0].length).trimEnd();
    let end = text.length;
    while (end > 0 && text[end - 1] === "#") end--;
    if (end === 0 || /\s/.test(text[end - 1])) text = text.slice(0, end).trimEnd();
    return [m[1].length, text];
  }

  function isBlockStart(line, next) {
    return FENCE.test(line) || HEADING_START.test(line) || HR.test(line) || QUOTE.test(line) ||
      ITEM.test(line) || (line.includes("|") && next !== undefined && TABLE_SEP.test(next));
  }

  function splitRow(line) {
    let s = line.trim();
    if (s.startsWith("|")) s = s.slice(1);
    if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
    return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
  }

  // Block level: append the blocks of `lines` to `parent`.
  function blocks(lines, parent, depth) {
    depth = depth || 0;
    const nest = depth < MAX_BLOCK_DEPTH; // deeper quotes and lists stay paragraph text
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      if (!line.trim()) { i++; continue; }
      let m;
      if ((m = FENCE.exec(line))) {
        const fence = m[1], lang = m[2].replace(/[^\w+#.-]/g, "");
        const body = [];
        i++;
        while (i < lines.length && !(lines[i].trim().startsWith(fence[0].repeat(fence.length)) &&
                                     lines[i].trim().replace(/[`~]/g, "") === "")) {
          body.push(lines[i]);
          i++;
        }
        i++; // the closing fence (or past the end)
        parent.appendChild(codeBlock(body.join("\n"), lang));
        continue;
      }
      if ((m = heading(line))) {
        const h = el("h" + m[0]);
        inline(m[1], h);
        parent.appendChild(h);
        i++;
        continue;
      }
      if (HR.test(line)) { parent.appendChild(el("hr")); i++; continue; }
      if (nest && QUOTE.test(line)) {
        const inner = [];
        while (i < lines.length && lines[i].trim() && QUOTE.test(lines[i])) {
          inner.push(lines[i].replace(QUOTE, ""));
          i++;
        }
        const q = el("blockquote");
        blocks(inner, q, depth + 1);
        parent.appendChild(q);
        continue;
      }
      if (nest && ITEM.test(line)) { i = list(lines, i, parent, depth); continue; }
      if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1])) {
        i = table(lines, i, parent);
        continue;
      }
      const para = [];
      while (i < lines.length && lines[i].trim() && (para.length === 0 || !isBlockStart(lines[i], lines[i + 1]))) {
        para.push(lines[i].trim());
        i++;
      }
      const p = el("p");
      para.forEach((t, k) => {
        if (k) p.appendChild(el("br"));
        inline(t, p);
      });
      parent.appendChild(p);
    }
  }

  function list(lines, i, parent, depth) {
    const first = ITEM.exec(lines[i]);
    const indent = first[1].length;
    const ordered = /\d/.test(first[2]);
    const l = el(ordered ? "ol" : "ul");
    if (ordered && parseInt(first[2], 10) !== 1) l.start = parseInt(first[2], 10);
    while (i < lines.length) {
      const m = ITEM.exec(lines[i]);
      if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
      const body = [m[3]];
      i++;
      // the item's continuation: indented lines (nested lists, code) and lazy paragraph lines
      while (i < lines.length) {
        const s = lines[i];
        if (!s.trim()) {
          const next = lines[i + 1];
          if (next !== undefined && next.length - next.trimStart().length > indent) { body.push(""); i++; continue; }
          break;
        }
        const lead = s.length - s.trimStart().length;
        if (lead > indent) { body.push(s.slice(Math.min(lead, indent + m[2].length + 1))); i++; continue; }
        if (!ITEM.test(s) && !isBlockStart(s, lines[i + 1])) { body.push(s.trim()); i++; continue; }
        break;
      }
      const li = el("li");
      if (body.length === 1) inline(body[0], li); else blocks(body, li, depth + 1);
      l.appendChild(li);
      while (i < lines.length && !lines[i].trim()) {
        const next = lines[i + 1];
        const n = next !== undefined ? ITEM.exec(next) : null;
        if (n && n[1].length === indent) i++; else break;
      }
    }
    parent.appendChild(l);
    return i;
  }

  function table(lines, i, parent) {
    const head = splitRow(lines[i]);
    const aligns = splitRow(lines[i + 1]).map((c) =>
      c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : "");
    const t = el("table");
    const thead = el("thead"), tr = el("tr");
    head.forEach((c, k) => {
      const th = el("th");
      if (aligns[k]) th.style.textAlign = aligns[k];
      inline(c, th);
      tr.appendChild(th);
    });
    thead.appendChild(tr);
    t.appendChild(thead);
    const tbody = el("tbody");
    i += 2;
    while (i < lines.length && lines[i].trim() && lines[i].includes("|")) {
      const row = el("tr");
      splitRow(lines[i]).slice(0, head.length).forEach((c, k) => {
        const td = el("td");
        if (aligns[k]) td.style.textAlign = aligns[k];
        inline(c, td);
        row.appendChild(td);
      });
      tbody.appendChild(row);
      i++;
    }
    t.appendChild(tbody);
    const wrap = el("div", "table-wrap");
    wrap.appendChild(t);
    parent.appendChild(wrap);
    return i;
  }

  function codeBlock(text, lang) {
    const pre = el("pre");
    const bar = el("div", "code-bar");
    const name = el("span", "code-lang");
    name.textContent = lang || "code";
    const copy = el("button", "code-copy");
    copy.type = "button";
    copy.textContent = "Copy";
    copy.addEventListener("click", () => copyText(text, copy));
    bar.appendChild(name);
    bar.appendChild(copy);
    const code = el("code");
    if (lang) code.className = "language-" + lang;
    code.textContent = text;
    pre.appendChild(bar);
    pre.appendChild(code);
    return pre;
  }

  function copyText(text, button) {
    const done = () => { button.textContent = "Copied"; setTimeout(() => { button.textContent = "Copy"; }, 1200); };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, () => {});
      return;
    }
    const ta = document.createElement("textarea"); // plain http on a LAN address: no clipboard API
    ta.value = text;
    ta.style.position = "fixed";
    ta.style.opacity = "0";
    document.body.appendChild(ta);
    ta.select();
    try { document.execCommand("copy"); done(); } catch (e) { /* nothing to do */ }
    ta.remove();
  }

  // Inline level, one left-to-right scan. At each position the first construct that matches
  // wins, in this order: code span (a run of n backticks up to the next run of exactly n; its
  // content is literal), **strong**, __strong__ (not followed by a word character), ~~del~~,
  // *em*, _em_ (not inside snake_case), [label](url "title"), <http(s)://autolink>. Emphasis and
  // strikethrough close at the nearest valid closer (their content starts and ends with a
  // non-space). Each "nearest closer at or after k" comes from a table built right to left once
  // per call, so the scan is linear in the text; the content of a construct is scanned again one
  // level down (at most MAX_INLINE_DEPTH levels).
  const WORD = /\w/;
  const SPACE = /\s/;

  // next[k] = the smallest j >= k with ok(j), or n
  function nextTable(n, ok) {
    const t = new Int32Array(n + 2).fill(n);
    for (let j = n - 1; j >= 0; j--) t[j] = ok(j) ? j : t[j + 1];
    return t;
  }

  // end[k] = the end of the run of characters from k for which ok holds
  function runTable(s, ok) {
    const n = s.length;
    const t = new Int32Array(n + 1);
    t[n] = n;
    for (let j = n - 1; j >= 0; j--) t[j] = ok(s[j]) ? t[j + 1] : j;
    return t;
  }

  function tables(s) {
    const n = s.length;
    const sp = (j) => j >= 0 && j < n && SPACE.test(s[j]);
    const word = (j) => j >= 0 && j < n && WORD.test(s[j]);
    const pair = (j, c) => s[j] === c && s[j + 1] === c;
    return {
      // closers: the character before is a non-space (and for single delimiters, not the delimiter)
      strong: nextTable(n, (j) => pair(j, "*") && j > 0 && !sp(j - 1)),
      under2: nextTable(n, (j) => pair(j, "_") && j > 0 && !sp(j - 1) && !word(j + 2)),
      del: nextTable(n, (j) => pair(j, "~") && j > 0 && !sp(j - 1)),
      em: nextTable(n, (j) => s[j] === "*" && j > 0 && !sp(j - 1) && s[j - 1] !== "*"),
      under: nextTable(n, (j) => s[j] === "_" && j > 0 && !sp(j - 1) && s[j - 1] !== "_" && !word(j + 1)),
      bracket: nextTable(n, (j) => s[j] === "]"),
      newline: nextTable(n, (j) => s[j] === "\n"),
      quote: nextTable(n, (j) => s[j] === '"'),
      ticks: runTable(s, (c) => c === "`"),
      spaces: runTable(s, (c) => SPACE.test(c)),
      url: runTable(s, (c) => c !== ")" && c !== ">" && !SPACE.test(c)),
      auto: runTable(s, (c) => c !== ">" && !SPACE.test(c)),
      tickRuns: null, // run length -> sorted start positions of maximal backtick runs, built on first use
    };
  }

  function tickRuns(s, t) {
    if (t.tickRuns) return t.tickRuns;
    const runs = new Map();
    for (let j = 0; j < s.length;) {
      if (s[j] !== "`") { j++; continue; }
      const e = t.ticks[j];
      const len = e - j;
      if (!runs.has(len)) runs.set(len, { starts: [], at: 0 });
      runs.get(len).starts.push(j);
      j = e;
    }
    t.tickRuns = runs;
    return runs;
  }

  // A code span opening at i: [content, end] or null.
  function codeSpan(s, i, t) {
    if (i > 0 && s[i - 1] === "`") return null; // inside a run that did not open a span
    const e = t.ticks[i];
    const r = tickRuns(s, t).get(e - i);
    // the positions are visited left to right, so each list's cursor only moves forward
    while (r.at < r.starts.length && r.starts[r.at] <= e) r.at++;
    if (r.at >= r.starts.length) return null;
    const close = r.starts[r.at];
    return [s.slice(e, close), close + (e - i)];
  }

  // A link opening at i ("["): [label, url, end] or null.
  function linkAt(s, i, t) {
    const close = t.bracket[i + 1];
    if (close >= s.length || close === i + 1 || t.newline[i + 1] < close || s[close + 1] !== "(") return null;
    const label = s.slice(i + 1, close);
    let j = t.spaces[close + 2];
    const tries = s[j] === "<" ? [[j + 1, t.url], [j, t.url]] : [[j, t.url]];
    for (const [u, run] of tries) {
      const ue = run[u];
      if (ue === u) continue;
      let k = ue;
      if (s[k] === ">") k++;
      const afterSpaces = t.spaces[k];
      if (afterSpaces > k && s[afterSpaces] === '"') { // a title
        const q = t.quote[afterSpaces + 1];
        if (q < s.length) {
          const e = t.spaces[q + 1];
          if (s[e] === ")") return [label, s.slice(u, ue), e + 1];
        }
      }
      if (s[afterSpaces] === ")") return [label, s.slice(u, ue), afterSpaces + 1];
    }
    return null;
  }

  // A delimited construct at i: [kind, content, end] or null.
  function delimited(s, i, t) {
    const n = s.length;
    const c = s[i];
    const open = (w) => i + w < n && !SPACE.test(s[i + w]);
    if (c === "*" && s[i + 1] === "*" && open(2)) {
      const k = t.strong[i + 3];
      if (k < n) return ["strong", s.slice(i + 2, k), k + 2];
    }
    if (c === "_" && s[i + 1] === "_" && open(2)) {
      const k = t.under2[i + 3];
      if (k < n) return ["strong", s.slice(i + 2, k), k + 2];
    }
    if (c === "~" && s[i + 1] === "~" && open(2)) {
      const k = t.del[i + 3];
      if (k < n) return ["del", s.slice(i + 2, k), k + 2];
    }
    if (c === "*" && open(1) && s[i + 1] !== "*") {
      const k = t.em[i + 2];
      if (k < n) return ["em", s.slice(i + 1, k), k + 1];
    }
    if (c === "_" && open(1) && s[i + 1] !== "_" && !(i > 0 && (WORD.test(s[i - 1]) || s[i - 1] === "\\"))) {
      const k = t.under[i + 2];
      if (k < n) return ["em", s.slice(i + 1, k), k + 1];
    }
    return null;
  }

  function inline(text, parent, depth) {
    depth = depth || 0;
    const s = text;
    if (depth >= MAX_INLINE_DEPTH) { parent.appendChild(document.createTextNode(unescape(s))); return; }
    const t = tables(s);
    let from = 0; // start of the text not yet emitted
    const flush = (to) => {
      if (to > from) parent.appendChild(document.createTextNode(unescape(s.slice(from, to))));
    };
    for (let i = 0; i < s.length;) {
      const c = s[i];
      let m = null;
      if (c === "`") {
        m = codeSpan(s, i, t);
        if (m) {
          flush(i);
          const code = el("code");
          const v = m[0];
          code.textContent = v.length > 2 && v.startsWith(" ") && v.endsWith(" ") ? v.slice(1, -1) : v;
          parent.appendChild(code);
          i = from = m[1];
          continue;
        }
        i = t.ticks[i]; // the whole run is text
        continue;
      }
      if (c === "*" || c === "_" || c === "~") {
        m = delimited(s, i, t);
        if (m) {
          flush(i);
          const e = el(m[0]);
          inline(m[1], e, depth + 1);
          parent.appendChild(e);
          i = from = m[2];
          continue;
        }
      } else if (c === "[") {
        m = linkAt(s, i, t);
        if (m) {
          flush(i);
          parent.appendChild(link(m[1], m[0], s.slice(i, m[2]), depth));
          i = from = m[2];
          continue;
        }
      } else if (c === "<" && /^<https?:\/\//.test(s.slice(i, i + 9))) {
        const e = t.auto[i + 1];
        if (s[e] === ">" && /^https?:\/\/./.test(s.slice(i + 1, e))) {
          flush(i);
          const url = s.slice(i + 1, e);
          parent.appendChild(link(url, url, s.slice(i, e + 1), depth));
          i = from = e + 1;
          continue;
        }
      }
      i++;
    }
    flush(s.length);
  }

  function link(url, label, raw, depth) {
    if (!SAFE_URL.test(url)) return document.createTextNode(raw);
    const a = el("a");
    a.href = url;
    a.rel = "noopener noreferrer nofollow";
    a.target = "_blank";
    inline(label, a, (depth || 0) + 1);
    return a;
  }

  function unescape(s) {
    return s.replace(/\\([\\`*_{}\[\]()#+\-.!|~<>])/g, "$1");
  }

  /** Render `text` (Markdown) into `container`, replacing what it held. */
  function render(text, container) {
    const frag = document.createDocumentFragment();
    blocks(String(text).replace(/\r\n?/g, "\n").split("\n"), frag);
    container.replaceChildren(frag);
  }

  window.kvMarkdown = { render };
})();
