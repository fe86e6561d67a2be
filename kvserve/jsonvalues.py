"""Checks on parsed JSON values that every layer shares (no HTTP, no dialect).

- :func:`json_type`: nlohmann::json's name of a value's type, the word llama-server's
  messages use (``type must be number, but is string``);
- :func:`check_text`: refuse a lone surrogate. ``json.loads`` accepts ``"\\ud800"``, a string
  no UTF-8 encoder (tokenizer, hash, log) can write.

Both raise :class:`kvserve.errors.InvalidInputError` (a face answers 400).
"""

from __future__ import annotations

import re
from typing import Any

from kvserve.errors import InvalidInputError

__all__ = ["SURROGATE", "check_text", "json_type"]

#: one lone surrogate code point (U+D800..U+DFFF).
SURROGATE = re.compile("[\ud800-\udfff]")


def json_type(v: Any) -> str:
    """nlohmann::json's name of a value's type (null, boolean, number, string, array, object);
    the Python type name for anything else."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _surrogate_error(path: str, text: str, *, key: bool = False) -> InvalidInputError:
    ch = SURROGATE.search(text).group()
    what = "an object key" if key else "string"
    return InvalidInputError(f"Field '{path}': {what} is not valid Unicode (lone surrogate U+{ord(ch):04X})")


def check_text(obj: Any, path: str = "") -> None:
    """Refuse a lone surrogate in any string or object key of ``obj`` (a parsed JSON value).

    Walks the whole value without recursion (deep nesting is fine), in document order, and
    names the first offending field by its path below ``path``: ``cache_salt``,
    ``messages[0].content``, ``logit_bias`` (for a key). Cost: one C regex scan per string.

    Raises:
        InvalidInputError: ``Field 'messages[0].content': string is not valid Unicode (lone
            surrogate U+D800)``.
    """
    stack: list[tuple[Any, str]] = [(obj, path)]
    while stack:
        v, where = stack.pop()
        if isinstance(v, str):
            if SURROGATE.search(v):
                raise _surrogate_error(where or "body", v)
        elif isinstance(v, dict):
            children = []
            for k, x in v.items():
                if SURROGATE.search(k):
                    raise _surrogate_error(where or "body", k, key=True)
                if isinstance(x, (str, list, dict)):
                    children.append((x, f"{where}.{k[:64]}" if where else k[:64]))
            stack.extend(reversed(children))
        elif isinstance(v, list):
            for i in range(len(v) - 1, -1, -1):
                if isinstance(v[i], (str, list, dict)):
                    stack.append((v[i], f"{where}[{i}]"))
