"""xgrammar's exception texts, made readable for a client (a leaf module: imports nothing of
kvserve, so :mod:`~kvserve.structured.schema` and :mod:`~kvserve.structured.backend` can both
use it)."""

from __future__ import annotations

import re

__all__ = ["clean_error"]

#: the ``[hh:mm:ss] /project/cpp/x.cc:94: `` prefix xgrammar's C++ puts before each line.
_NOISE = re.compile(r"\[\d\d:\d\d:\d\d\] \S+?:\d+: ")


def clean_error(e: BaseException) -> str:
    """xgrammar's exception text without the ``[hh:mm:ss] /project/cpp/x.cc:94: `` prefixes and
    its stack trace, on one line (the exception's type name when nothing is left)."""
    text = _NOISE.sub("", str(e))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("Stack trace")]
    return " ".join(lines) if lines else type(e).__name__
