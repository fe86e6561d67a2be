"""A clean stop on SIGTERM (issue 31, Build 8).

On SIGTERM (or SIGINT) :func:`kvserve.app.main` calls :meth:`Drain.begin` before uvicorn
stops listening. From then on:

* a request that arrives (on a connection that was already open) is answered 503 ``the server is
  shutting down`` in its route's dialect (:mod:`kvserve.faces.envelopes`), with
  ``Connection: close``;
* requests in flight go on for up to ``--shutdown-timeout`` seconds (default 5); those that finish
  in time end as usual;
* after that each one still running is stopped (its handler is cancelled, which aborts its
  engine request) and ended in its dialect: a response that has not started gets the 503 JSON;
  a stream that has started gets a last error event (``data: {"error": ...}`` for SSE, Anthropic's
  ``event: error``, the Responses API's ``event: error`` ``{"type": "error", "code", "message",
  "param", "sequence_number"}`` (one past the last event sent) on ``/v1/responses``, one
  ``{"error": ...}`` line for Ollama's NDJSON) and then ends.

Nothing accepted is cut without a word; uvicorn's own graceful-shutdown timeout is set a few
seconds longer so that this middleware ends the requests first. Then the lifespan shutdown unloads
the models and the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time

from kvserve.faces.envelopes import dialect_error_body, dialect_of
from kvserve.faces.api_error import ApiError
from kvserve.faces.paths import route_path

__all__ = ["SHUTTING_DOWN", "Drain", "DrainMiddleware"]

SHUTTING_DOWN = "the server is shutting down"


def _error_json(path: str) -> bytes:
    dialect = dialect_of(path)
    obj = dialect_error_body(dialect, 503, SHUTTING_DOWN) if dialect else ApiError(503, SHUTTING_DOWN).body()
    return json.dumps(obj, separators=(",", ":")).encode()


#: a Responses stream event's number as the face writes it (an escaped one inside text has ``\\"``)
_SEQUENCE = re.compile(rb'"sequence_number":\s*(\d+)')


def _responses_error(seq: int) -> bytes:
    """The Responses API's ``error`` event numbered ``seq``."""
    err = ApiError(503, SHUTTING_DOWN)
    obj = {"type": "error", "code": err.type, "message": SHUTTING_DOWN, "param": None, "sequence_number": seq}
    return b"event: error\ndata: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _last_event(path: str, content_type: bytes, last_seq: int = -1) -> bytes:
    """The error that ends a started stream of ``content_type`` on ``path`` (``last_seq``: the last
    ``sequence_number`` a Responses stream sent)."""
    if (path == "/v1/responses" or path.startswith("/v1/responses/")) and b"event-stream" in content_type:
        return _responses_error(last_seq + 1)
    body = _error_json(path)
    if b"ndjson" in content_type:
        return body + b"\n"
    if dialect_of(path) == "anthropic":
        return b"event: error\ndata: " + body + b"\n\n"
    return b"data: " + body + b"\n\n"


class Drain:
    """The shutdown state one app's :class:`DrainMiddleware` reads (``app.state.drain``).

    Args:
        grace: seconds in-flight requests may go on after :meth:`begin` (``--shutdown-timeout``).
    """

    def __init__(self, grace: float = 5.0):
        self.grace = max(float(grace), 0.0)
        self.draining_since: float | None = None
        self.in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._expired: asyncio.Event | None = None
        #: called once by :meth:`begin` (so each must be safe from a signal handler): work that must
        #: stop at once rather than drain, e.g. MCP servers' calls (kvserve.tools.mcp)
        self.on_begin: list = []

    def begin(self) -> None:
        """Start draining (idempotent; safe from a signal handler or another thread)."""
        if self.draining_since is not None:
            return
        self.draining_since = time.monotonic()
        for fn in self.on_begin:
            fn()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._arm)

    def _arm(self) -> None:
        assert self._loop is not None and self._expired is not None
        self._loop.call_later(self.grace, self._expired.set)

    def expired(self) -> asyncio.Event:
        """Set once the grace period after :meth:`begin` has passed (made on the serving loop)."""
        loop = asyncio.get_running_loop()
        if self._expired is None or self._loop is not loop:  # one per loop (tests run several)
            self._loop = loop
            self._expired = asyncio.Event()
            if self.draining_since is not None:  # begun before the first request
                self._arm()
        return self._expired


class DrainMiddleware:
    """ASGI middleware (outermost but the prefix's): see the module docstring."""

    def __init__(self, app, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        drain = self.drain
        expired = drain.expired()
        path = route_path(scope)
        if drain.draining_since is not None:
            await _answer_503(send, path)
            return
        state = {"started": False, "ended": False, "ctype": b"", "seq": -1}
        responses = path.startswith("/v1/responses")

        async def watch(msg):
            if msg["type"] == "http.response.start":
                state["started"] = True
                state["ctype"] = dict(msg.get("headers") or []).get(b"content-type", b"")
            elif msg["type"] == "http.response.body":
                state["ended"] = not msg.get("more_body")
                if responses:
                    numbers = _SEQUENCE.findall(msg.get("body") or b"")
                    state["seq"] = int(numbers[-1]) if numbers else state["seq"]
            await send(msg)

        drain.in_flight += 1
        task = asyncio.ensure_future(self.app(scope, receive, watch))
        stop = asyncio.ensure_future(expired.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                task.result()
                return
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            await self._end(send, path, state)
        finally:
            drain.in_flight -= 1
            stop.cancel()
            if not task.done():
                task.cancel()

    @staticmethod
    async def _end(send, path: str, state: dict) -> None:
        """End a request stopped by the deadline in its dialect (see the module docstring)."""
        with contextlib.suppress(Exception):  # the client may be gone already
            if not state["started"]:
                await _answer_503(send, path)
            elif not state["ended"]:
                await send({"type": "http.response.body",
                            "body": _last_event(path, state["ctype"], state["seq"]), "more_body": False})


async def _answer_503(send, path: str) -> None:
    body = _error_json(path)
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
