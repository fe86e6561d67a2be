"""API keys and CORS for every face.

With ``--api-key``/``--api-key-file`` every route except ``/health`` and
``/v1/health`` needs ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``; keys are
compared in constant time (``hmac.compare_digest``) against each configured key.
Unlike vLLM (which leaves /metrics and others open), nothing else is public.
CORS preflight (``OPTIONS``) is answered by Starlette's CORSMiddleware, which runs
outside the key check, as browsers send preflights without credentials.
"""

from __future__ import annotations

import hmac
import json

from starlette.middleware.cors import CORSMiddleware

PUBLIC_PATHS = frozenset({"/health", "/v1/health"})

_INVALID = json.dumps({"error": {"message": "Invalid API Key", "type": "authentication_error",
                                 "code": 401}}, separators=(",", ":")).encode()


def key_matches(given: str, keys: list[str]) -> bool:
    """True when ``given`` equals one of ``keys`` (constant time per key)."""
    ok = False
    g = given.encode()
    for k in keys:
        ok |= hmac.compare_digest(g, k.encode())
    return ok


def request_key(headers: dict[bytes, bytes]) -> str:
    """The key a request carries: ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY`` ("" if none)."""
    auth = headers.get(b"authorization", b"").decode("latin-1").strip()
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return headers.get(b"x-api-key", b"").decode("latin-1").strip()


class ApiKeyMiddleware:
    """ASGI middleware answering 401 ``Invalid API Key`` to requests without a valid key.

    Args:
        app: the wrapped ASGI app.
        keys: accepted keys; empty disables the check.
    """

    def __init__(self, app, keys: list[str]):
        self.app = app
        self.keys = list(keys)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.keys or scope["path"] in PUBLIC_PATHS \
                or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if key_matches(request_key(headers), self.keys):
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json; charset=utf-8"),
                                (b"content-length", str(len(_INVALID)).encode())]})
        await send({"type": "http.response.body", "body": _INVALID})


def add_security(app, api_keys: list[str], cors_origins: list[str]) -> None:
    """Wrap ``app`` with the key check and, outside it, CORS (``--cors-origins``)."""
    app.add_middleware(ApiKeyMiddleware, keys=api_keys)
    app.add_middleware(CORSMiddleware, allow_origins=cors_origins or ["*"], allow_methods=["*"],
                       allow_headers=["*"], allow_credentials=False)
