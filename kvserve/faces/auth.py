"""API keys and CORS for every face.

With ``--api-key``/``--api-key-file`` every route except ``/health``,
``/v1/health`` and the web page (``/`` and its assets under ``/webui/``, so that a browser
can load the page before it asks the person for the key; llama-server makes only ``/``
public) needs ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``; keys are
compared in constant time (``hmac.compare_digest``) against each configured key.
Unlike vLLM (which leaves /metrics and others open), nothing else is public.
CORS preflight (``OPTIONS``) is answered by Starlette's CORSMiddleware, which runs
outside the key check, as browsers send preflights without credentials.
"""

from __future__ import annotations

import hmac
import json

from starlette.middleware.cors import CORSMiddleware

PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/"})
#: path prefixes served without a key: the web page's static assets
PUBLIC_PREFIXES = ("/webui/",)

_INVALID = json.dumps({"error": {"message": "Invalid API Key", "type": "authentication_error",
                                 "code": 401}}, separators=(",", ":")).encode()
#: the same refusal in Anthropic's envelope, for its routes (``/v1/messages...``)
_INVALID_ANTHROPIC = json.dumps({"type": "error", "error": {"type": "authentication_error",
                                                            "message": "Invalid API Key"}},
                                separators=(",", ":")).encode()
_ANTHROPIC_PATH = "/v1/messages"


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
    """ASGI middleware answering 401 ``Invalid API Key`` to requests without a valid key
    (in Anthropic's envelope ``{"type": "error", "error": {...}}`` on ``/v1/messages`` and
    below, in llama-server's everywhere else).

    Args:
        app: the wrapped ASGI app.
        keys: accepted keys; empty disables the check.
    """

    def __init__(self, app, keys: list[str]):
        self.app = app
        self.keys = list(keys)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.keys or scope["path"] in PUBLIC_PATHS \
                or scope["path"].startswith(PUBLIC_PREFIXES) or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if key_matches(request_key(headers), self.keys):
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        anthropic = path == _ANTHROPIC_PATH or path.startswith(_ANTHROPIC_PATH + "/")
        body = _INVALID_ANTHROPIC if anthropic else _INVALID
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json; charset=utf-8"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def add_security(app, api_keys: list[str], cors_origins: list[str]) -> None:
    """Wrap ``app`` with the key check and, outside it, CORS (``--cors-origins``)."""
    app.add_middleware(ApiKeyMiddleware, keys=api_keys)
    app.add_middleware(CORSMiddleware, allow_origins=cors_origins or ["*"], allow_methods=["*"],
                       allow_headers=["*"], allow_credentials=False)


# -- Ollama's routes: local origins and hosts only, as Ollama allows by default ---------------

#: Ollama's default allowed origins (envconfig.AllowedOrigins), as fnmatch patterns.
LOCAL_ORIGINS = tuple(f"{scheme}://{host}{port}" for scheme in ("http", "https")
                      for host in ("localhost", "127.0.0.1", "0.0.0.0", "[::1]")
                      for port in ("", ":*")) + (
    "app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*")

_FORBIDDEN = json.dumps({"error": "origin not allowed"}, separators=(",", ":")).encode()
_BAD_HOST = json.dumps({"error": "host not allowed"}, separators=(",", ":")).encode()


def _host_of(value: str) -> str:
    """``Host`` header -> the host part, lower case (``[::1]:8080`` -> ``::1``)."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1:v.find("]")] if "]" in v else v
    return v.rsplit(":", 1)[0] if v.count(":") == 1 else v


def local_host(host: str) -> bool:
    """Names a loopback client may use to reach a loopback server (Ollama's allowedHost):
    localhost and *.localhost, 127.0.0.0/8, ::1, the machine's own names (*.local, *.internal)."""
    import ipaddress
    import socket

    if host in ("localhost", "") or host.endswith((".localhost", ".local", ".internal")):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        return host in (socket.gethostname().lower(), socket.getfqdn().lower())
    except OSError:
        return False


class ApiOriginGuard:
    """ASGI middleware for ``/api/*`` (Ollama's face, whose routes delete, copy, create and pull
    models): a browser request whose ``Origin`` is not local (Ollama's defaults, plus
    ``OLLAMA_ORIGINS``) gets 403, preflights included; and when the server listens on loopback, a
    ``Host`` that is not a loopback name gets 403 (DNS rebinding), as Ollama does. The other faces
    keep llama-server's CORS rules (``--cors-origins``, default ``*``).

    Args:
        bind_host: the address the server listens on (``--host``).
        extra_origins: more allowed origin patterns (``OLLAMA_ORIGINS``, comma-separated).
    """

    def __init__(self, app, bind_host: str = "127.0.0.1", extra_origins: tuple[str, ...] = ()):
        import ipaddress

        self.app = app
        self.origins = LOCAL_ORIGINS + tuple(extra_origins)
        try:
            self.check_host = ipaddress.ip_address(bind_host.strip("[]")).is_loopback
        except ValueError:
            self.check_host = bind_host in ("localhost",)

    def _origin_ok(self, origin: str) -> bool:
        import fnmatch

        o = origin.strip().lower()
        return any(fnmatch.fnmatchcase(o, p.lower()) for p in self.origins)

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path == "/api" or path.startswith("/api/"):
            headers = {k.lower(): v for k, v in scope.get("headers", [])}
            origin = headers.get(b"origin")
            if origin is not None and not self._origin_ok(origin.decode("latin-1")):
                return await _plain(send, 403, _FORBIDDEN)
            host = headers.get(b"host")
            if self.check_host and host is not None and not local_host(_host_of(host.decode("latin-1"))):
                return await _plain(send, 403, _BAD_HOST)
        await self.app(scope, receive, send)


async def _plain(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json; charset=utf-8"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def add_api_guard(app, bind_host: str) -> None:
    """Mount :class:`ApiOriginGuard` outermost (call after :func:`add_security`)."""
    import os

    extra = tuple(o.strip() for o in os.environ.get("OLLAMA_ORIGINS", "").split(",") if o.strip())
    app.add_middleware(ApiOriginGuard, bind_host=bind_host, extra_origins=extra)
