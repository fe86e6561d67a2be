"""llama.cpp GBNF -> the EBNF dialect xgrammar parses.

The two notations are nearly the same (``name ::= ...``, ``"literals"``, ``[classes]``,
``( )``, ``* + ?``, ``{m}``, ``{m,n}``, ``{m,}``, ``#`` comments). What llama.cpp accepts and
xgrammar does not is rewritten here, text only, keeping every line where it was so that
xgrammar's error positions still point at the client's line:

- an empty alternative (``space ::= | " "``, ``("a" | )``) becomes ``""``;
- ``.`` (any character) becomes ``[\\0-\\U0010FFFF]``;
- ``{,n}`` becomes ``{0,n}``.

Token references (``<[1234]>``, ``<|im_end|>``, ``!<...>``), a newer llama.cpp feature, are
refused with a clear message rather than a lexer error.
"""

from __future__ import annotations

import re

__all__ = ["GbnfError", "gbnf_to_ebnf"]

_ANY_CHAR = r"[\0-\U0010FFFF]"
_WORD = re.compile(r"[A-Za-z0-9_\-]+")
_BRACE = re.compile(r"\{\s*(\d*)\s*(,?)\s*(\d*)\s*\}")


class GbnfError(ValueError):
    """The grammar uses a llama.cpp feature that cannot be translated (message says which)."""


def _lex(text: str) -> list[tuple[str, str]]:
    """Split GBNF into (kind, text) tokens; kinds: ws, comment, str, cls, name, def, bar, lp, rp,
    brace, dot, op, other. Unterminated literals are left for xgrammar to report."""
    out: list[tuple[str, str]] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            j = i
            while j < n and text[j].isspace():
                j += 1
            out.append(("ws", text[i:j]))
            i = j
        elif c == "#":
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(("comment", text[i:j]))
            i = j
        elif c in "\"[":
            close = '"' if c == '"' else "]"
            j = i + 1
            while j < n and text[j] != close:
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(("str" if c == '"' else "cls", text[i:j]))
            i = j
        elif text.startswith("::=", i):
            out.append(("def", "::="))
            i += 3
        elif c == "|":
            out.append(("bar", c))
            i += 1
        elif c == "(":
            out.append(("lp", c))
            i += 1
        elif c == ")":
            out.append(("rp", c))
            i += 1
        elif c == "{":
            m = _BRACE.match(text, i)
            if m is None:
                out.append(("other", c))
                i += 1
            else:
                lo, comma, hi = m.groups()
                out.append(("brace", "{" + (lo or ("0" if comma else "")) + comma + hi + "}"))
                i = m.end()
        elif c == ".":
            out.append(("dot", c))
            i += 1
        elif c in "*+?":
            out.append(("op", c))
            i += 1
        elif c in "<!":
            raise GbnfError("token references such as <[1234]>, <|im_end|> or !<...> are not supported; "
                            "write the text as a string literal")
        else:
            m = _WORD.match(text, i)
            if m is None:
                out.append(("other", c))
                i += 1
            else:
                out.append(("name", m.group(0)))
                i = m.end()
    return out


def gbnf_to_ebnf(text: str) -> str:
    """Translate llama.cpp GBNF into xgrammar EBNF (see the module docstring).

    Args:
        text: the grammar as the client sent it.

    Returns:
        EBNF text for ``xgrammar.Grammar.from_ebnf``; identical to ``text`` when nothing
        needed rewriting.

    Raises:
        GbnfError: token references (``<...>``), which xgrammar cannot express.
    """
    toks = _lex(text)
    sig = [k for k, (kind, _) in enumerate(toks) if kind not in ("ws", "comment")]
    out = [t for _, t in toks]
    opened = {"def", "bar", "lp"}
    for pos, k in enumerate(sig):
        kind = toks[k][0]
        if kind == "dot":
            out[k] = _ANY_CHAR
        if kind not in opened:
            continue
        nxt = sig[pos + 1] if pos + 1 < len(sig) else None
        nkind = toks[nxt][0] if nxt is not None else "eof"
        new_rule = nkind == "name" and pos + 2 < len(sig) and toks[sig[pos + 2]][0] == "def"
        if nkind in ("bar", "rp", "eof") or new_rule:
            out[k] = out[k] + ' ""'
    return "".join(out)
