"""Every error answer in its route's dialect (issue 31, Build 7).

Errors raised outside a face's own handlers (unknown paths and methods, a body over
``--max-request-bytes``, a missing API key, the origin guard, an unexpected exception, uvicorn's
``Invalid HTTP request``) are written by shared code in llama-server's envelope
``{"error": {"message", "type", "code"}}``. :class:`DialectErrorMiddleware`, outermost, rewrites an
error answer (status >= 400) that is not yet in its route's dialect:

* ``/api`` and below (Ollama): ``{"error": "<message>"}``;
* ``/v1/messages`` and below (Anthropic): ``{"type": "error", "error": {"type": <Anthropic's type
  for the status>, "message": "<message>"}}``;
* other routes: unchanged.

The message is the one the shared code wrote (``File Not Found``, ``Invalid API Key``, ...), or
the status's reason phrase when the answer had none. Answers already in the dialect and bodies over
:data:`MAX_REWRITE_BYTES` pass unchanged; ``HEAD`` answers are not touched.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from kvserve.faces.paths import route_path

__all__ = ["ANTHROPIC_ERROR_TYPES", "DialectErrorMiddleware", "dialect_error_body", "dialect_of"]

MAX_REWRITE_BYTES = 64 << 10  # error bodies are small; a larger one is passed through as it is

ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}
"""Anthropic's error ``type`` per status (its API's errors page); other 4xx: invalid_request_error,
other 5xx: api_error."""


def dialect_of(path: str) -> str | None:
    """``"ollama"`` for ``/api`` and below, ``"anthropic"`` for ``/v1/messages`` and below, else None."""
    if path == "/api" or path.startswith("/api/"):
        return "ollama"
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    return None


def _message(status: int, body: bytes) -> tuple[str, bool]:
    """``(message, already in a dialect's shape)`` read from an error body of any envelope."""
    try:
        obj: Any = json.loads(body) if body else None
    except (ValueError, RecursionError):
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"], obj.get("type") == "error"
        if isinstance(err, str):
            return err, True
        if isinstance(obj.get("detail"), str):
            return obj["detail"], False
    text = body.decode("utf-8", "replace").strip() if obj is None else ""
    if text and len(text) <= 1024 and "\n" not in text:
        return text, False
    try:
        return HTTPStatus(status).phrase, False
    except ValueError:
        return "error", False


def dialect_error_body(dialect: str, status: int, message: str) -> dict:
    """The error object of ``dialect`` (see the module docstring) for ``status`` and ``message``."""
    if dialect == "ollama":
        return {"error": message}
    etype = ANTHROPIC_ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": etype, "message": message}}


def _in_dialect(dialect: str, body: bytes) -> bool:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return False
    if not isinstance(obj, dict):
        return False
    if dialect == "ollama":
        return isinstance(obj.get("error"), str)
    return obj.get("type") == "error" and isinstance(obj.get("error"), dict)


class DialectErrorMiddleware:
    """ASGI middleware: see the module docstring. Holds back the start and body of an error answer on
    an Ollama or Anthropic route (at most :data:`MAX_REWRITE_BYTES`), then sends it in the dialect."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = route_path(scope) if scope["type"] == "http" else ""
        dialect = dialect_of(path) if path and scope.get("method") != "HEAD" else None
        if dialect is None:
            await self.app(scope, receive, send)
            return
        held: dict | None = None
        parts: list[bytes] = []
        size = 0

        async def watch(msg):
            nonlocal held, size
            if msg["type"] == "http.response.start" and msg["status"] >= 400:
                held = msg
                return
            if held is None or msg["type"] != "http.response.body":
                await send(msg)
                return
            parts.append(msg.get("body", b""))
            size += len(parts[-1])
            if msg.get("more_body") and size <= MAX_REWRITE_BYTES:
                return
            await self._flush(send, dialect, held, b"".join(parts), bool(msg.get("more_body")))
            held = None

        await self.app(scope, receive, watch)

    @staticmethod
    async def _flush(send, dialect: str, start: dict, body: bytes, more: bool) -> None:
        status = start["status"]
        if more or len(body) > MAX_REWRITE_BYTES or _in_dialect(dialect, body):
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": more})
            return
        message, _ = _message(status, body)
        new = json.dumps(dialect_error_body(dialect, status, message), separators=(",", ":")).encode()
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length", b"content-type")]
        headers += [(b"content-type", b"application/json; charset=utf-8"), (b"content-length", str(len(new)).encode())]
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": new})
