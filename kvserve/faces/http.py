"""Small HTTP helpers every face uses: reading the JSON body, writing JSON responses,
and the ASGI middlewares that bound a request body (``--max-request-bytes``), answer
HEAD as GET and, with ``-v``, log requests (:class:`RequestLogMiddleware`).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import re
import time
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from kvserve.faces.api_error import ApiError
from kvserve.faces.paths import route_path

_log = logging.getLogger("kvserve.server")


def dumps(obj) -> str:
    """Compact JSON with non-ASCII escaped (``\\u05ea``), as llama-server's JSON library writes it."""
    return json.dumps(obj, ensure_ascii=True, separators=(",", ":"), allow_nan=False)


def json_response(obj, status: int = 200) -> Response:
    """A JSON response (``application/json; charset=utf-8``)."""
    return Response(dumps(obj), status_code=status, media_type="application/json; charset=utf-8")


def error_response(e: ApiError) -> Response:
    """The error envelope as a response."""
    return json_response(e.body(), e.status)


# -- JSON with numpy arrays (embedding vectors) ---------------------------------------------

try:
    import orjson

    def dumps_json(obj: Any) -> bytes:
        """JSON bytes of ``obj``; numpy arrays are written as lists (float32 in shortest form)."""
        return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)
except ImportError:  # pragma: no cover - orjson is a dependency; this keeps a broken install working
    def dumps_json(obj: Any) -> bytes:
        """JSON bytes of ``obj`` (numpy arrays written as lists)."""
        return json.dumps(obj, separators=(",", ":"), default=lambda a: a.tolist()).encode()


#: Bodies (and prompts) above this many bytes are parsed, tokenized and rendered off the event
#: loop, so that one large request does not stall every other connection.
LARGE_BODY = 64 * 1024


#: the 400 texts for an empty body and for a body that is not an object: kvserve's own, and
#: Ollama's (its Go handlers' ``missing request body`` and json.Unmarshal's type error)
EMPTY_BODY = "request body is empty: a JSON object is required"
NOT_AN_OBJECT = "request body must be a JSON object"
OLLAMA_EMPTY_BODY = "missing request body"
OLLAMA_NOT_AN_OBJECT = "json: cannot unmarshal into Go value: the request body must be a JSON object"


async def read_json(request: HttpRequest, *, required: bool = True, empty: str = EMPTY_BODY,
                    not_object: str = NOT_AN_OBJECT) -> dict:
    """The request body as a JSON object, whatever the Content-Type (curl -d sends form type):
    every face's one body reader. ``empty`` and ``not_object`` are the dialect's 400 texts.

    Malformed JSON is a 400 ``invalid_request_error``: llama-server answers it with 500
    ``server_error`` (seed Example 17), which makes a client bug look like a server fault.
    Bodies over :data:`LARGE_BODY` bytes are parsed on a worker thread.

    Raises:
        ApiError: 400 on malformed JSON, an integer literal of more than 4,300 digits
            (Python's int-string limit), a lone surrogate (naming its field), an empty body
            (``empty``, when ``required``) or a body that is not an object (``not_object``); 413 from
            :class:`BodyLimitMiddleware` when the body exceeds ``--max-request-bytes``.
        ClientDisconnected: the client closed the connection before sending the whole body
            (Starlette's ``ClientDisconnect``): logged as one INFO line, the line
            :class:`kvserve.app.CrashGuardMiddleware` writes for it, with no traceback; the
            app (and each face) answers it with a 499 nobody reads.
    """
    try:
        raw = await request.body()
    except ClientDisconnect:
        from kvserve.faces.sse import ClientDisconnected  # sse imports this module

        _log.info("client disconnected before sending the whole body: %s %s", request.method, request.url.path,
                  extra={"func": "handle"})
        raise ClientDisconnected("client disconnected while sending the request body") from None
    if not raw.strip():
        if required:
            raise ApiError(400, empty)
        return {}
    body = await asyncio.to_thread(parse_json_body, raw) if len(raw) > LARGE_BODY else parse_json_body(raw)
    if not isinstance(body, dict):
        raise ApiError(400, not_object)
    if _SURROGATE_ESCAPE.search(raw):  # only a \uD800-\uDFFF escape can make a lone surrogate
        from kvserve.faces.params import check_text

        await asyncio.to_thread(check_text, body) if len(raw) > LARGE_BODY else check_text(body)
    return body


#: a JSON escape of a UTF-16 surrogate; strict UTF-8 cannot carry one, so without this the
#: parsed body holds none and the full walk (check_text) is skipped
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json_body(raw: bytes):
    """``json.loads`` with every failure as a 400 :class:`ApiError` naming the problem."""
    try:
        return json.loads(raw)
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not valid UTF-8: byte {e.object[e.start]:#04x} at offset {e.start} "
                            "does not belong there") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, f"invalid JSON: parse error at line {e.lineno}, column {e.colno}: {e.msg}") from e
    except RecursionError:
        raise ApiError(400, "invalid JSON: nesting too deep") from None
    except ValueError as e:  # an integer literal beyond sys.get_int_max_str_digits()
        raise ApiError(400, _huge_int_message(raw)) from e


class _HugeInt:
    __slots__ = ("digits",)

    def __init__(self, digits: int):
        self.digits = digits


def _huge_int_message(raw: bytes) -> str:
    """Name the field holding a too-long integer: parse again, keeping such integers as markers."""
    import sys

    limit = sys.get_int_max_str_digits()

    def parse_int(s: str):
        return _HugeInt(len(s.lstrip("-"))) if len(s) > limit else int(s)

    where, digits = "", 0
    try:
        stack = [("", json.loads(raw, parse_int=parse_int))]
    except (ValueError, RecursionError):
        stack = []
    while stack:
        path, v = stack.pop()
        if isinstance(v, _HugeInt):
            where, digits = path, v.digits
            break
        if isinstance(v, dict):
            stack += [(f"{path}.{k}" if path else str(k), x) for k, x in v.items()]
        elif isinstance(v, list):
            stack += [(f"{path}[{i}]", x) for i, x in enumerate(v)]
    field = f"Field '{where}': " if where else ""
    size = f"{digits} digits" if digits else "too many digits"
    return f"{field}integer literal has {size}, more than the {limit} digits allowed"


# -- ASGI middlewares ----------------------------------------------------------------------

#: A body of at least this many bytes returns its freed memory to the OS when its request ends.
TRIM_AFTER = 8 * 1024 * 1024


def release_memory() -> None:
    """Give freed heap pages back to the OS (glibc ``malloc_trim(0)``; a no-op elsewhere).

    glibc keeps the arenas a large request freed (a refused 30 MB prompt left GBs of RSS
    before); trimming after such a request brings RSS back near where it was.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _anthropic_path(path: str) -> bool:
    """Anthropic's routes (``/v1/messages...``) answer in Anthropic's envelope."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


async def _send_error(send, e: ApiError, path: str = "") -> None:
    if _anthropic_path(path):
        body = dumps({"type": "error", "error": {"type": "request_too_large" if e.status == 413 else
                                                 "invalid_request_error", "message": e.message}}).encode()
    else:
        body = dumps(e.body()).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json; charset=utf-8"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def too_large(limit: int) -> ApiError:
    """The 413 for a body over ``--max-request-bytes``."""
    return ApiError(413, f"request body is larger than {limit} bytes (--max-request-bytes)")


BODY_IDLE_S = 60.0  # seconds a request body may send nothing before it is refused (408)
#: a request body must be whole within BODY_DEADLINE_S seconds of the first read plus one second
#: per BODY_MIN_RATE bytes received (408 otherwise): a client trickling a byte every 59 s passes
#: BODY_IDLE_S but not this, so slow bodies cannot pile up to --limit-concurrency and lock
#: everyone out; a 64 MiB body may take 60 s + 1024 s.
BODY_DEADLINE_S = 60.0
BODY_MIN_RATE = 64 * 1024  # bytes per second


class BodyLimitMiddleware:
    """ASGI middleware: a body over ``max_bytes`` gets 413 in the error envelope (Anthropic's
    ``request_too_large`` on ``/v1/messages...``).

    A ``Content-Length`` above the limit is answered before any of the body is read; a
    chunked body is counted as it arrives and reading stops (``receive`` raises the 413
    :class:`ApiError`, which the handlers answer) as soon as it passes the limit, so at
    most ``max_bytes`` plus one chunk is ever held. Covers every route. A request whose
    body was large (>= :data:`TRIM_AFTER`) trims the heap when it ends (:func:`release_memory`).
    Paths starting with one of ``unlimited`` (Ollama's ``/api/blobs/``: model weights, streamed
    to disk by their handler) have no limit. A body that sends nothing for :data:`BODY_IDLE_S`
    seconds, or that is not whole :data:`BODY_DEADLINE_S` seconds (plus one per
    :data:`BODY_MIN_RATE` bytes received) after the handler first reads it, is refused with 408
    (a slow-body client holds no handler forever).
    """

    def __init__(self, app, max_bytes: int, unlimited: tuple[str, ...] = ()):
        self.app = app
        self.max_bytes = max_bytes
        self.unlimited = tuple(unlimited)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or (self.unlimited and route_path(scope).startswith(self.unlimited)):
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            await _send_error(send, too_large(limit), route_path(scope))
            return
        seen = 0
        started = None
        body_done = False

        async def counted():
            nonlocal seen, body_done, started
            if body_done:  # the body is read: what remains is the wait for a disconnect
                return await receive()
            now = time.monotonic()
            started = now if started is None else started
            left = started + BODY_DEADLINE_S + seen / BODY_MIN_RATE - now
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, min(BODY_IDLE_S, left)))
            except asyncio.TimeoutError:
                if left > BODY_IDLE_S:
                    raise ApiError(408, f"the request body sent nothing for {BODY_IDLE_S:g} s") from None
                raise ApiError(408, f"the request body arrived too slowly (it must be whole within "
                                    f"{BODY_DEADLINE_S:g} s plus 1 s per {BODY_MIN_RATE} bytes)") from None
            body_done = msg["type"] != "http.request" or not msg.get("more_body")
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise too_large(limit)
            return msg

        try:
            await self.app(scope, counted, send)
        finally:
            if seen >= TRIM_AFTER:
                await asyncio.to_thread(release_memory)


class HeadAsGetMiddleware:
    """ASGI middleware answering ``HEAD`` as ``GET`` without the body (RFC 9110 9.3.2):
    same status and headers, Content-Length included. FastAPI's routes list no HEAD."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "HEAD":
            await self.app(scope, receive, send)
            return

        async def no_body(msg):
            if msg["type"] == "http.response.body":
                msg = {**msg, "body": b""}
            await send(msg)

        await self.app({**scope, "method": "GET"}, receive, no_body)


# -- --verbose request logging ----------------------------------------------------------------

#: paths llama-server's request logger skips (polled often: health checks, model lists, props, metrics)
QUIET_PATHS = frozenset({"/health", "/v1/health", "/models", "/v1/models", "/props", "/metrics"})
#: at most this many bytes of a request or response body are logged
LOG_BODY_BYTES = 2048


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def log_safe(s: str) -> str:
    """``s`` with control characters (C0, DEL, C1, U+2028/2029) escaped (``\\n``, ``\\x1b``,
    ``\\u2028``): a decoded path such as ``/v1/models%0aFAKE``
    cannot start a log line of its own."""
    def esc(m: re.Match) -> str:
        c = m.group()
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c) or (
            f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
    return _CONTROL.sub(esc, s)


#: JSON string values of these body fields are logged ``***`` (cache_salt isolates tenants' prefix caches)
SECRET_FIELDS = ("cache_salt",)


def _json_char(c: str) -> str:
    """A regex matching ``c`` as JSON may write it: itself or ``\\uXXXX`` (any hex case), ``\\/``."""
    alts = [re.escape(c)]
    if ord(c) < 0x10000:
        alts.append("\\\\u" + "".join(f"[{h.lower()}{h.upper()}]" if h.isalpha() else h for h in f"{ord(c):04x}"))
    if c == "/":
        alts.append("\\\\/")
    return "(?:" + "|".join(alts) + ")"


def secret_pattern(secrets: tuple[str, ...]) -> re.Pattern | None:
    """One regex for every key in ``secrets``, literal or JSON-escaped character by character, and
    for the string values of :data:`SECRET_FIELDS` (to the end of the text when cut inside)."""
    parts = ["".join(_json_char(c) for c in k) for k in sorted(set(secrets), key=len, reverse=True) if k]
    fields = "|".join(re.escape(f) for f in SECRET_FIELDS)
    parts.append(f'(?<=")(?:{fields})"\\s*:\\s*"(?:[^"\\\\]|\\\\.)*(?:"|\\\\?$)')
    return re.compile("|".join(f"({p})" for p in parts), re.S)


def _masked(m: re.Match) -> str:
    t = m.group()
    for f in SECRET_FIELDS:
        if t.startswith(f + '"'):
            return t[:t.index('"', len(f) + 1) + 1] + '***"'
    return "***"


def mask_secrets(s: str, pattern: re.Pattern | None, cut: int | None = None) -> str:
    """``s`` with every match of :func:`secret_pattern` written ``***`` (a field keeps its name),
    then cut at character ``cut`` of ``s`` (a match that starts before the cut is written whole)."""
    cut = len(s) if cut is None else cut
    if pattern is None:
        return s[:cut]
    out, pos = [], 0
    for m in pattern.finditer(s):
        if m.start() >= cut:
            break
        out += (s[pos:m.start()], _masked(m))
        pos = m.end()
    if pos < cut:
        out.append(s[pos:cut])
    return "".join(out)


class _Capture:
    """The first ``limit`` bytes of a body (kept with ``margin`` more, so that a secret crossing
    the cut is masked whole before the cut) and how many more there were."""

    __slots__ = ("data", "total", "limit", "keep")

    def __init__(self, limit: int, margin: int = 0):
        self.data = bytearray()
        self.total = 0
        self.limit = limit
        self.keep = limit + margin

    def add(self, chunk: bytes) -> None:
        room = self.keep - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        self.total += len(chunk)

    def text(self, pattern: re.Pattern | None) -> str:
        """The logged text: decoded, masked (:func:`mask_secrets`), cut at ``limit`` bytes."""
        full = self.data.decode("utf-8", errors="replace")
        cut = len(bytes(self.data[:self.limit]).decode("utf-8", errors="ignore"))
        extra = self.total - min(self.total, self.limit)
        return mask_secrets(full, pattern, cut) + (f" ... ({extra} more bytes)" if extra else "")


class RequestLogMiddleware:
    """ASGI middleware for ``-v``/``--verbose`` (``-lv`` 4 and up): after each request, the debug
    lines llama-server's ``log_server_request`` writes: ``done request: METHOD PATH CLIENT STATUS``,
    then ``request:  BODY`` and ``response: BODY``. Bounded: at most :data:`LOG_BODY_BYTES` of each
    body (the rest counted, ``... (N more bytes)``); streamed responses are captured up to the same
    bound. Never logs a header (so never an ``Authorization`` or ``X-Api-Key``), nor the query
    string, and every configured API key that appears in a body, literally or JSON-escaped
    (``\\u0073ekret``), is written ``***``, as are ``cache_salt`` values (masked before the cut, so
    a key crossing it is hidden whole); control characters of the path, client and bodies are
    escaped (:func:`log_safe`: no forged log lines). Skips
    :data:`QUIET_PATHS`, as llama-server does.

    Args:
        app: the wrapped ASGI app.
        secrets: API keys to hide.
        limit: bytes of each body to log.
    """

    def __init__(self, app, secrets: tuple[str, ...] = (), limit: int = LOG_BODY_BYTES):
        self.app = app
        self.secrets = tuple(k for k in secrets if k)
        self.limit = limit
        self.pattern = secret_pattern(self.secrets)
        # a JSON-escaped key is at most 6 bytes a character
        self.margin = 6 * max((len(k) for k in self.secrets), default=0) + 16

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or route_path(scope) in QUIET_PATHS:
            await self.app(scope, receive, send)
            return
        req, res = _Capture(self.limit, self.margin), _Capture(self.limit, self.margin)
        status = [0]

        async def recv():
            msg = await receive()
            if msg["type"] == "http.request":
                req.add(msg.get("body", b""))
            return msg

        async def snd(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            elif msg["type"] == "http.response.body":
                res.add(msg.get("body", b""))
            await send(msg)

        try:
            await self.app(scope, recv, snd)
        finally:
            client = str((scope.get("client") or ("-", 0))[0])
            extra = {"func": "log_server_r"}
            _log.debug("done request: %s %s %s %d", log_safe(str(scope.get("method"))),
                       log_safe(str(scope.get("path"))), log_safe(client), status[0], extra=extra)
            _log.debug("request:  %s", log_safe(req.text(self.pattern)), extra=extra)
            _log.debug("response: %s", log_safe(res.text(self.pattern)), extra=extra)
