"""Response header names written as llama-server writes them (``Content-Type``,
``Access-Control-Allow-Origin``, ``Vary``, ``Process-Start-Time-Unix``).

HTTP header names are case-insensitive, but some clients look them up in a plain dict
(llama.cpp's own server tests do, after ``requests``); llama-server (cpp-httplib) writes each
name as its code spells it, which is Title-Case for every header it sends. Starlette keeps
names lower-case and uvicorn's httptools writer lower-cases them again, so the response head
is re-cased on its way to the socket: :class:`TitleCaseHeads` is a mixin for uvicorn's
``HttpToolsProtocol`` that gives each request/response cycle a transport whose first response
head (``HTTP/1.1 <status>`` up to the blank line) goes out with names in Title-Case. Bodies and
values are written untouched.
"""

from __future__ import annotations

__all__ = ["HeadCaseTransport", "TitleCaseHeads", "title_case_head", "title_case_name"]

#: names whose usual spelling is not plain Title-Case
_SPECIAL = {b"www-authenticate": b"WWW-Authenticate", b"etag": b"ETag", b"te": b"TE"}


def title_case_name(name: bytes) -> bytes:
    """``b"access-control-allow-origin"`` -> ``b"Access-Control-Allow-Origin"`` (each
    dash-separated part capitalised, the rest of it kept); a few names as RFC 9110 spells them."""
    special = _SPECIAL.get(name.lower())
    if special is not None:
        return special
    return b"-".join(p[:1].upper() + p[1:] for p in name.split(b"-"))


def title_case_head(head: bytes) -> bytes:
    """Re-case the header names of one response head (status line, ``Name: value`` lines, the
    blank line; CRLF line ends). Anything after the blank line is returned unchanged."""
    top, sep, rest = head.partition(b"\r\n\r\n")
    lines = top.split(b"\r\n")
    for i in range(1, len(lines)):
        name, colon, value = lines[i].partition(b":")
        if colon:
            lines[i] = title_case_name(name) + colon + value
    return b"\r\n".join(lines) + sep + rest


class HeadCaseTransport:
    """One request/response cycle's view of the connection's transport: writes go through
    unchanged, except response heads (a write starting with ``HTTP/``) before the final one:
    ``100 Continue`` passes, the next head is re-cased and ends the watch. Every other attribute
    is the wrapped transport's."""

    __slots__ = ("_transport", "_head_sent")

    def __init__(self, transport) -> None:
        self._transport = transport
        self._head_sent = False

    def write(self, data: bytes) -> None:
        """Write ``data``; the response head has its names in Title-Case."""
        if not self._head_sent and data[:5] == b"HTTP/":
            self._head_sent = data[9:12] != b"100"
            data = title_case_head(data)
        self._transport.write(data)

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class TitleCaseHeads:
    """Mixin for ``uvicorn.protocols.http.httptools_impl.HttpToolsProtocol`` (listed before it):
    each cycle, whether started at once or after a pipelined one, writes through a
    :class:`HeadCaseTransport`."""

    def _start_asgi_task(self, cycle, app) -> None:
        cycle.transport = HeadCaseTransport(cycle.transport)
        super()._start_asgi_task(cycle, app)
