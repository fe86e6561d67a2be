"""What Ollama's command line prints, as text: sizes, times, tables and ``ollama show``.

The rules are those of Ollama's ``format`` package and of the table writer its ``cmd`` package
uses (olekukonko/tablewriter v0.0.5 with ``SetBorder(false)``, ``SetNoWhiteSpace(true)``,
``SetTablePadding("    ")``), so ``kvserve list`` and ``kvserve ps`` line up as ``ollama list``
and ``ollama ps`` do, trailing blanks included:

- :func:`human_bytes`: decimal units (``2.0 GB``, ``138 MB``, ``512 B``); from 10 units up the
  value is truncated to an integer, below it has one decimal unless it is whole.
- :func:`human_time`: ``2 minutes ago``, ``4 minutes from now``, ``Forever`` (more than 20
  years ahead), ``Never`` for a zero time; :func:`human_duration` the words in between
  (``Less than a second``, ``About a minute``, ``3 hours``, ``2 weeks``...).
- :func:`go_duration`: Go's ``time.Duration.String`` (``1.5s``, ``12.3ms``, ``2m3s``), for the
  ``--verbose`` timings.
- :func:`render_table`: columns padded to their widest cell, separated by four blanks; every
  row ends with the padding, the header with one blank; cells wider than the column limit (30,
  or 100 for System and License) wrap at blanks with the writer's minimal-raggedness rule.
- :func:`show_info`: ``ollama show NAME`` from an /api/show response (sections Model,
  Capabilities, Parameters, Metadata and Tensors with ``verbose``, System, License).

Everything takes ``now`` (seconds since the epoch) where a time is printed, so tests can fix it.
"""

from __future__ import annotations

import datetime as _dt
import math
import unicodedata
from collections.abc import Iterable, Sequence
from typing import Any

from kvserve.chat.go_template import go_format_float
from kvserve.store.manifest import human_number

__all__ = ["go_duration", "human_bytes", "human_duration", "human_time", "parse_go_time", "render_table",
           "show_info", "text_width"]

_KB, _MB, _GB, _TB = 10**3, 10**6, 10**9, 10**12


def human_bytes(n: int) -> str:
    """Ollama's ``format.HumanBytes``: ``n`` bytes in decimal units (B, KB, MB, GB, TB)."""
    for scale, unit in ((_TB, "TB"), (_GB, "GB"), (_MB, "MB"), (_KB, "KB")):
        if n >= scale:
            value = n / scale
            break
    else:
        return f"{n} B"
    if value >= 10 or value == math.trunc(value):
        return f"{int(value)} {unit}"
    return f"{value:.1f} {unit}"


def _go_round(x: float) -> int:
    """Go's ``math.Round``: half away from zero."""
    return math.floor(abs(x) + 0.5) * (1 if x >= 0 else -1)


def human_duration(seconds: float) -> str:
    """Ollama's ``humanDuration``: a length of time in words (``seconds`` >= 0)."""
    s = int(seconds)
    if s < 1:
        return "Less than a second"
    if s == 1:
        return "1 second"
    if s < 60:
        return f"{s} seconds"
    minutes = int(seconds / 60)
    if minutes == 1:
        return "About a minute"
    if minutes < 60:
        return f"{minutes} minutes"
    hours = _go_round(seconds / 3600)
    if hours == 1:
        return "About an hour"
    if hours < 48:
        return f"{hours} hours"
    if hours < 24 * 7 * 2:
        return f"{hours // 24} days"
    if hours < 24 * 30 * 2:
        return f"{hours // 24 // 7} weeks"
    if hours < 24 * 365 * 2:
        return f"{hours // 24 // 30} months"
    return f"{int(seconds / 3600) // 24 // 365} years"


def human_time(t: float | None, now: float, zero: str = "Never") -> str:
    """Ollama's ``format.HumanTime``: ``t`` (seconds since the epoch; None for Go's zero time)
    relative to ``now``: ``... ago``, ``... from now``, or ``Forever`` beyond 20 years ahead."""
    if t is None:
        return zero
    delta = now - t
    if _go_div(_go_div(int(delta / 3600), 24), 365) < -20:
        return "Forever"
    if delta < 0:
        return human_duration(-delta) + " from now"
    return human_duration(delta) + " ago"


def _go_div(a: int, b: int) -> int:
    """Go's integer division (truncates toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def parse_go_time(text: str) -> float | None:
    """An RFC 3339 time as Go marshals it (``2026-12-01T15:30:00.123456789Z``, offsets allowed)
    -> seconds since the epoch; None for Go's zero time (year 1) or text that is not a time."""
    if not isinstance(text, str) or not text:
        return None
    s = text.strip()
    if s.endswith(("Z", "z")):
        s = s[:-1] + "+00:00"
    date, sep, rest = s.partition("T")
    if sep and "." in rest:  # Python keeps 6 fraction digits; Go writes up to 9
        whole, _, tail = rest.partition(".")
        digits = "".join(c for c in tail if c.isdigit())
        rest = f"{whole}.{digits[:6].ljust(6, '0')}{tail[len(digits):]}"
    try:
        t = _dt.datetime.fromisoformat(f"{date}T{rest}" if sep else s)
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.UTC)
    if t.year <= 1:
        return None
    return t.timestamp()


def go_duration(ns: int) -> str:
    """Go's ``time.Duration.String`` of ``ns`` nanoseconds: ``0s``, ``999ns``, ``1.5µs``,
    ``12.345ms``, ``1.234567891s``, ``2m3.5s``, ``1h0m0s``."""
    if ns == 0:
        return "0s"
    sign, u = ("-" if ns < 0 else ""), abs(int(ns))
    if u < 1_000_000_000:
        for scale, unit in ((1, "ns"), (1_000, "µs"), (1_000_000, "ms")):
            if u < scale * 1000:
                return sign + _frac(u, scale) + unit
    h, rem = divmod(u, 3_600_000_000_000)
    m, rem = divmod(rem, 60_000_000_000)
    text = _frac(rem, 1_000_000_000) + "s"
    if h:
        return f"{sign}{h}h{m}m{text}"
    if m:
        return f"{sign}{m}m{text}"
    return sign + text


def _frac(v: int, scale: int) -> str:
    whole, part = divmod(v, scale)
    if scale == 1 or part == 0:
        return str(whole)
    width = len(str(scale)) - 1
    return f"{whole}." + f"{part:0{width}d}".rstrip("0")


# ------------------------------------------------------------------------------- tables

_PADDING = "    "


def text_width(s: str) -> int:
    """Columns a string takes on a terminal (East Asian wide and full-width characters take
    two, combining marks none), as go-runewidth counts them."""
    w = 0
    for ch in s:
        if unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me", "Cf"):
            continue
        w += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
    return w


def _wrap_words(words: list[str], lim: int, pen: int = 100_000) -> list[list[str]]:
    """tablewriter's ``WrapWords``: break ``words`` into lines of at most ``lim`` columns with
    the least raggedness (sum of squared shortfalls; over-long lines cost ``pen`` more)."""
    n = len(words)
    widths = [text_width(w) for w in words]
    length = [[0] * n for _ in range(n)]
    for i in range(n):
        length[i][i] = widths[i]
        for j in range(i + 1, n):
            length[i][j] = length[i][j - 1] + 1 + widths[j]
    nbrk, cost = [0] * n, [2**31 - 1] * n
    for i in range(n - 1, -1, -1):
        if length[i][n - 1] <= lim:
            cost[i], nbrk[i] = 0, n
            continue
        for j in range(i + 1, n):
            d = lim - length[i][j - 1]
            c = d * d + cost[j] + (pen if length[i][j - 1] > lim else 0)
            if c < cost[i]:
                cost[i], nbrk[i] = c, j
    lines, i = [], 0
    while i < n:
        lines.append(words[i:nbrk[i]])
        i = nbrk[i]
    return lines


def _wrap(s: str, lim: int) -> list[str]:
    """tablewriter's ``WrapString``: ``s`` split at blanks into lines of ``lim`` columns (a
    word wider than that widens the limit)."""
    words = s.replace("\n", " ").split(" ")
    lim = max([lim, *(text_width(w) for w in words)])
    return [" ".join(line) for line in _wrap_words(words, lim)]


def _cell_lines(text: str, limit: int) -> tuple[list[str], int]:
    """tablewriter's ``parseDimension`` with wrapping and reflow on: a cell's lines and width."""
    raw = text.split("\n")
    width = min(max(text_width(line) for line in raw), limit)
    lines = _wrap(" ".join(raw), width)
    return lines, max([width, *(text_width(line) for line in lines)])


def render_table(rows: Sequence[Sequence[str]], header: Sequence[str] | None = None, *,
                 col_width: int = 30) -> str:
    """A table as Ollama's ``cmd`` package prints one (see the module docstring).

    Args:
        rows: the cells of each row (rows may differ in length).
        header: the column names (printed upper-cased, left-aligned); None: no header line.
        col_width: the widest a cell may be before it wraps at blanks (tablewriter's
            ``SetColWidth``; 30 unless set).

    Returns the text, every line ending in a newline ("" without header and rows).
    """
    widths: dict[int, int] = {}

    def measure(cells: Sequence[str]) -> list[list[str]]:
        out = []
        for i, cell in enumerate(cells):
            lines, w = _cell_lines(str(cell), col_width)
            if i not in widths or widths[i] < w:
                widths[i] = w
            out.append(lines)
        return out

    head = measure(header) if header else []
    body = [measure(r) for r in rows]
    parts: list[str] = []
    if head:
        last = max(widths) if widths else -1
        for x in range(max(len(c) for c in head)):
            for y in range(last + 1):
                h = head[y][x] if y < len(head) and x < len(head[y]) else ""
                h = h.replace("_", " ").strip().upper() or (" " if h else "")
                parts.append(_pad(h, widths.get(y, 0)) + (" " if y == last else _PADDING))
            parts.append("\n")
    for cells in body:
        height = max((len(c) for c in cells), default=0)
        for x in range(height):
            for y, lines in enumerate(cells):
                parts.append(_pad(lines[x] if x < len(lines) else "  ", widths[y]) + _PADDING)
            parts.append("\n")
    return "".join(parts)


def _pad(s: str, width: int) -> str:
    return s + " " * max(0, width - text_width(s))


# --------------------------------------------------------------------------- ollama show


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _format_plain(f: float) -> str:
    """Go's ``strconv.FormatFloat(f, 'f', -1, 64)``: positional, shortest digits."""
    from decimal import Decimal

    if not math.isfinite(f):
        return go_format_float(f)
    if f == int(f):
        return str(int(f))
    return format(Decimal(repr(f)), "f")


def _go_v(v: Any) -> str:
    """Go's ``%v`` of a value decoded from JSON (float64, string, bool, nil, []any, map)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "<nil>"
    if isinstance(v, (int, float)):
        return go_format_float(float(v))
    if isinstance(v, list):
        return "[" + " ".join(_go_v(x) for x in v) + "]"
    if isinstance(v, dict):
        return "map[" + " ".join(f"{k}:{_go_v(v[k])}" for k in sorted(v)) + "]"
    return str(v)


def _metadata_value(v: Any) -> str:
    """A model_info value as ``ollama show --verbose`` prints it: arrays cut to about 10
    columns with ``...+N more]``, other types by their Go type name."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return v
    if _number(v) is not None:
        return go_format_float(float(v))
    if isinstance(v, list):
        shown, total = 0, 1
        for i, item in enumerate(v):
            w = text_width(_go_v(item)) + (2 if i > 0 else 0)
            if total + w > 10 and i > 0:
                break
            total += w
            shown += 1
        if shown < len(v):
            return _go_v(v[:shown])[:-1] + f" ...+{len(v) - shown} more]"
        return _go_v(v)
    if v is None:
        return "<nil>"
    return "map[string]interface {}" if isinstance(v, dict) else type(v).__name__


def _head(text: str, n: int) -> list[list[str]]:
    """The first ``n`` non-blank lines (trimmed), then ``...`` when there are more."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    rows = [["", ln] for ln in lines[:n]]
    if len(lines) > n:
        rows.append(["", "..."])
    return rows


def _model_rows(resp: dict) -> list[list[str]]:
    details = resp.get("details") or {}
    info = resp.get("model_info")
    rows: list[list[str]] = []
    if resp.get("engine"):  # kvserve's supervised engines: the command that serves it, no file of ours
        rows.append(["", "Engine", str(resp["engine"])])
        if resp.get("engine_model"):
            rows.append(["", "Engine model", str(resp["engine_model"])])
        if not resp.get("remote_host"):
            return rows
    if resp.get("remote_host"):
        rows += [["", "Remote model", str(resp.get("remote_model") or "")],
                 ["", "Remote URL", str(resp["remote_host"])]]
        if resp.get("remote_check"):  # kvserve: the upstream's check (ok / rejected / no server)
            rows.append(["", "Remote check", str(resp["remote_check"])])
        if not info and not details.get("quantization_level"):  # kvserve's remote models: no file to describe
            return rows
    if isinstance(info, dict):
        arch = info.get("general.architecture")
        arch = arch if isinstance(arch, str) else ""
        if arch:
            rows.append(["", "architecture", arch])
        params = str(details.get("parameter_size") or "")
        count = _number(info.get("general.parameter_count"))
        if not params and count is not None:
            params = human_number(int(count))
        if params:
            rows.append(["", "parameters", params])
        for key, label in (("context_length", "context length"), ("embedding_length", "embedding length")):
            value = _number(info.get(f"{arch}.{key}"))
            if value is not None:
                rows.append(["", label, _format_plain(value)])
    else:
        rows += [["", "architecture", str(details.get("family") or "")],
                 ["", "parameters", str(details.get("parameter_size") or "")]]
    rows.append(["", "quantization", str(details.get("quantization_level") or "")])
    if resp.get("requires"):
        rows.append(["", "requires", str(resp["requires"])])
    return rows


def _sections(resp: dict, verbose: bool) -> Iterable[tuple[str, list[list[str]]]]:
    yield "Model", _model_rows(resp)
    caps = resp.get("capabilities") or []
    if caps:
        yield "Capabilities", [["", str(c)] for c in caps]
    params = resp.get("parameters") or ""
    if params:
        yield "Parameters", [["", *line.split()] for line in params.splitlines() if line]
    info = resp.get("model_info")
    if verbose and isinstance(info, dict):
        yield "Metadata", [["", k, _metadata_value(info[k])] for k in sorted(info)]
    tensors = resp.get("tensors") or []
    if verbose and tensors:
        yield "Tensors", [["", str(t.get("name", "")), str(t.get("type", "")), _go_v(t.get("shape") or [])]
                          for t in tensors]
    if resp.get("system"):
        yield "System", _head(resp["system"], 2)
    if resp.get("license"):
        yield "License", _head(resp["license"], 2)


def show_info(resp: dict, verbose: bool = False) -> str:
    """``ollama show NAME`` (no section flag) from an /api/show response: for each section a
    title line (``  Model``), its table (a blank first column, so rows start with four blanks),
    then a blank line."""
    out = []
    for title, rows in _sections(resp, verbose):
        width = 100 if title in ("Template", "System", "License") else 30
        if title == "Model" and resp.get("engine"):
            width = 4096  # an engine's command line is printed whole (it is copied into a shell)
        out.append(f"  {title}\n" + render_table(rows, col_width=width) + "\n")
    return "".join(out)
