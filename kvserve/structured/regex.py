"""Regular expressions as xgrammar reads them, and where that differs from what clients mean.

xgrammar (0.2.9) matches a regex against the whole output. Three differences matter:

- ``^`` or ``$`` anywhere but the very start or end is dropped with only a log warning
  (``a^b`` would then match ``ab``): refused (:func:`check_anchors`);
- ``.`` matches a newline; in Python's ``re`` (vLLM's ``regex`` field is a Python
  regex) it does not: :func:`python_dots` rewrites ``.`` to ``[^\\n]`` for the ``regex``
  constraint;
- in a JSON-schema ``pattern``, characters outside character classes are written as
  they are, so a pattern that can produce ``"``, ``\\`` or a control character would
  write them unescaped, which is invalid JSON: refused (:func:`check_json_pattern`).
"""

from __future__ import annotations

__all__ = ["RegexError", "check_anchors", "check_json_pattern", "python_dots"]


class RegexError(ValueError):
    """The expression uses something the grammar backend would not enforce as written."""


def _atoms(p: str) -> list[tuple[str, str, int, int]]:
    """Split a regex into ``(kind, text, in_class, position)``: kind "esc" (a backslash
    escape with its arguments), "char" (one character) or "class_open"/"class_close";
    in_class is 0 outside a character class, 1 inside ``[...]``, 2 inside ``[^...]``."""
    out: list[tuple[str, str, int, int]] = []
    i, n = 0, len(p)
    in_class = 0
    class_start = -1
    while i < n:
        c = p[i]
        if c == "\\" and i + 1 < n:
            k = p[i + 1]
            if k in "xu" and p.startswith("{", i + 2):
                close = p.find("}", i + 2)
                j = n if close < 0 else close + 1
            else:
                j = i + {"x": 4, "u": 6, "c": 3}.get(k, 2)
            j = max(min(j, n), i + 2)
            out.append(("esc", p[i:j], in_class, i))
            i = j
            continue
        if in_class:
            if c == "]" and i > class_start:
                out.append(("class_close", c, in_class, i))
                in_class = 0
            else:
                out.append(("char", c, in_class, i))
            i += 1
            continue
        if c == "[":
            out.append(("class_open", c, 0, i))
            in_class = 1
            i += 1
            if i < n and p[i] == "^":
                in_class = 2
                i += 1
            class_start = i + 1  # a "]" right after "[" or "[^" is a literal
            continue
        out.append(("char", c, 0, i))
        i += 1
    return out


def _escape_value(esc: str) -> int | None:
    """Code point of a ``\\xHH`` / ``\\uHHHH`` / ``\\u{H..}`` / ``\\x{H..}`` escape, else None."""
    body = esc[2:].strip("{}")
    if esc[1] in "xu" and body:
        try:
            return int(body, 16)
        except ValueError:
            return None
    return None


def check_anchors(p: str) -> None:
    """Refuse ``^`` / ``$`` other than at the very start / end (xgrammar drops those).

    Raises:
        RegexError: naming the anchor and its position.
    """
    atoms = _atoms(p)
    for kind, text, in_class, pos in atoms:
        if kind == "char" and not in_class and (
                (text == "^" and pos != 0) or (text == "$" and pos != len(p) - 1)):
            raise RegexError(f"'{text}' at position {pos} is only supported at the "
                             f"{'start' if text == '^' else 'end'} of the whole expression")


def check_json_pattern(p: str) -> None:
    """Refuse a JSON-schema ``pattern`` that can produce ``"``, ``\\`` or a control character
    (listed outside a negated class ``[^...]``).

    Raises:
        RegexError: naming the character (or escape) and its position.
    """
    check_anchors(p)
    for kind, text, in_class, pos in _atoms(p):
        bad = False
        if in_class == 2:
            continue  # excluded characters are harmless
        if kind == "char":
            bad = text == '"' or ord(text) < 0x20
        elif kind == "esc":
            k = text[1]
            v = _escape_value(text)
            bad = k in '"\\tnrfv0aec' or (v is not None and (v < 0x20 or v in (0x22, 0x5C)))
        if bad:
            raise RegexError(f"{text!r} at position {pos} can produce '\"', '\\' or a control character, which the "
                             "grammar backend would write unescaped (invalid JSON)")


def python_dots(p: str) -> str:
    """``p`` with each ``.`` outside character classes replaced by ``[^\\n]`` (Python's meaning)."""
    parts: list[str] = []
    last = 0
    for kind, text, in_class, pos in _atoms(p):
        if kind == "char" and text == "." and not in_class:
            parts.append(p[last:pos])
            parts.append("[^\\n]")
            last = pos + 1
    parts.append(p[last:])
    return "".join(parts)
