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
(function () {
  "use strict";

  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
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

  function isBlockStart(line, next) {
    return FENCE.test(line) || HEADING.test(line) || HR.test(line) || QUOTE.test(line) ||
      ITEM.test(line) || (line.includes("|") && next !== undefined && TABLE_SEP.test(next));
  }

  function splitRow(line) {
    let s = line.trim();
    if (s.startsWith("|")) s = s.slice(1);
    if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
    return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
  }

  // Block level: append the blocks of `lines` to `parent`.
  function blocks(lines, parent) {
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
      if ((m = HEADING.exec(line))) {
        const h = el("h" + m[1].length);
        inline(m[2], h);
        parent.appendChild(h);
        i++;
        continue;
      }
      if (HR.test(line)) { parent.appendChild(el("hr")); i++; continue; }
      if (QUOTE.test(line)) {
        const inner = [];
        while (i < lines.length && lines[i].trim() && QUOTE.test(lines[i])) {
          inner.push(lines[i].replace(QUOTE, ""));
          i++;
        }
        const q = el("blockquote");
        blocks(inner, q);
        parent.appendChild(q);
        continue;
      }
      if (ITEM.test(line)) { i = list(lines, i, parent); continue; }
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

  function list(lines, i, parent) {
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
      if (body.length === 1) inline(body[0], li); else blocks(body, li);
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

  // Inline level: code spans first (their content is literal), then emphasis and links.
  const INLINE = new RegExp([
    "(`+)([\\s\\S]*?[^`])\\1(?!`)",              // 1,2 code span
    "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*",         // 3 strong
    "__(?=\\S)([\\s\\S]*?\\S)__(?!\\w)",          // 4 strong
    "~~(?=\\S)([\\s\\S]*?\\S)~~",                 // 5 del
    "\\*(?=[^\\s*])([\\s\\S]*?[^\\s*])\\*",       // 6 em
    "(?<![\\w\\\\])_(?=[^\\s_])([\\s\\S]*?[^\\s_])_(?!\\w)", // 7 em, not inside snake_case
    "\\[([^\\]\\n]+)\\]\\(\\s*<?([^)\\s>]+)>?(?:\\s+\"[^\"]*\")?\\s*\\)", // 8,9 link
    "<(https?:\\/\\/[^\\s>]+)>",                  // 10 autolink
  ].join("|"));

  function inline(text, parent) {
    let rest = text;
    while (rest) {
      const m = INLINE.exec(rest);
      if (!m) { parent.appendChild(document.createTextNode(unescape(rest))); return; }
      if (m.index) parent.appendChild(document.createTextNode(unescape(rest.slice(0, m.index))));
      if (m[2] !== undefined) {
        const c = el("code");
        c.textContent = m[2].length > 2 && m[2].startsWith(" ") && m[2].endsWith(" ") ? m[2].slice(1, -1) : m[2];
        parent.appendChild(c);
      } else if (m[3] !== undefined || m[4] !== undefined) {
        const s = el("strong");
        inline(m[3] !== undefined ? m[3] : m[4], s);
        parent.appendChild(s);
      } else if (m[5] !== undefined) {
        const d = el("del");
        inline(m[5], d);
        parent.appendChild(d);
      } else if (m[6] !== undefined || m[7] !== undefined) {
        const e = el("em");
        inline(m[6] !== undefined ? m[6] : m[7], e);
        parent.appendChild(e);
      } else if (m[8] !== undefined) {
        parent.appendChild(link(m[9], m[8], m[0]));
      } else {
        parent.appendChild(link(m[10], m[10], m[0]));
      }
      rest = rest.slice(m.index + m[0].length);
    }
  }

  function link(url, label, raw) {
    if (!SAFE_URL.test(url)) return document.createTextNode(raw);
    const a = el("a");
    a.href = url;
    a.rel = "noopener noreferrer nofollow";
    a.target = "_blank";
    inline(label, a);
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
