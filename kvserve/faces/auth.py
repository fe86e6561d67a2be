"""API keys and CORS for every face.

With ``--api-key``/``--api-key-file`` every route except ``/health``,
``/v1/health`` and the web page (``/`` and its assets under ``/webui/``, so that a browser
can load the page before it asks the person for the key; llama-server makes only ``/``
public) needs ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``; keys are
compared in constant time (``hmac.compare_digest``) against each configured key.
Unlike vLLM (which leaves /metrics and others open), nothing else is public.
CORS follows llama-server's ``--cors-origins/--cors-methods/--cors-headers/--cors-credentials``
(llama.cpp PR #25655; vLLM's ``--allowed-*``/``--allow-credentials`` map onto them, see
:func:`kvserve.serving.args._cors`), answered by :class:`CorsMiddleware` outside the key check, as
browsers send preflights without credentials:

* every ``OPTIONS`` request is a preflight, answered ``200`` with an empty body (llama-server
  answers them before routing); an allowed ``Origin`` gets ``Access-Control-Allow-Origin`` (the
  origin itself), ``Access-Control-Allow-Credentials: true`` (unless ``--no-cors-credentials``),
  ``Access-Control-Allow-Methods`` (``--cors-methods``, default ``GET, POST, DELETE, OPTIONS``),
  ``Access-Control-Allow-Headers`` (``--cors-headers``, default ``*``) and ``Vary: Origin``;
* other responses to an allowed ``Origin`` carry ``Access-Control-Allow-Origin``, the credentials
  header and ``Vary: Origin``;
* an origin that is not allowed gets no ``Access-Control-*`` header at all (the browser then
  refuses to hand the answer to the page); a request without ``Origin`` gets none either;
* ``Vary: Origin`` is on every answer (allowed origin, other origin or none: caches must not
  hand one origin's answer to another, Fetch spec) unless the answer cannot depend on the
  origin: a plain ``*`` without credentials, or no origin allowed;
* an explicitly empty list (``--cors-origins ''``) allows no cross-origin page: no CORS header
  at all. CORS only hides answers from pages: a cross-origin "simple" POST still runs, so use
  ``--api-key`` when a hostile page may run in a browser that can reach the server.

Origins: ``*`` allows every origin (reflected while credentials are on, since browsers refuse
``*`` with credentials; ``*`` itself with ``--no-cors-credentials``); ``localhost`` allows pages
served from ``localhost``, ``127.0.0.1`` or ``[::1]`` at any scheme and port; anything else is
compared with the ``Origin`` exactly (case-insensitively). Unlike llama-server, which writes a
comma list into the header verbatim (llama.cpp issue #26988; browsers reject such a header),
kvserve answers with the one origin of the list that matched.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import json

from kvserve.faces.paths import route_path

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

#: who sent the request being handled: a digest of its API key (None: no key configured or given);
#: set by :class:`ApiKeyMiddleware` for the request's task (and the threads it hands work to)
_CALLER: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvserve_caller", default=None)


def caller() -> str | None:
    """The current request's caller id (:attr:`kvserve.engine.request.Request.owner`): the first 16
    hex digits of sha256 of the API key it carried, None without ``--api-key``. Used only to decide
    whose cached text ``cache_miss`` may show the caller."""
    return _CALLER.get()


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


def unambiguous_keys(raw: list[tuple[bytes, bytes]], keys: list[str]) -> bool:
    """False when which key counts could depend on a proxy in front: an ``Authorization`` or
    ``X-Api-Key`` header given twice, or both given and one of them not a valid key (a request
    sending the same valid key in both, as llama.cpp's own tests do, passes, as on llama-server,
    which reads ``Authorization`` and falls back to ``X-Api-Key``)."""
    given = [(n.lower(), v) for n, v in raw if n.lower() in (b"authorization", b"x-api-key")]
    if len(given) != len({n for n, _ in given}):
        return False
    return len(given) < 2 or all(key_matches(request_key({n: v}), keys) for n, v in given)


class ApiKeyMiddleware:
    """ASGI middleware answering 401 ``Invalid API Key`` to requests without a valid key
    (in Anthropic's envelope ``{"type": "error", "error": {...}}`` on ``/v1/messages`` and
    below, in llama-server's everywhere else).

    A request with two ``Authorization`` or two ``X-Api-Key`` headers is refused the same way
    (which one counts would depend on the proxy in front), and so is one with both whose keys
    are not both valid (:func:`unambiguous_keys`).

    Args:
        app: the wrapped ASGI app.
        keys: accepted keys; empty disables the check.
        public_prefixes: path prefixes served without a key (:data:`PUBLIC_PREFIXES`, the built-in
            page's assets; none with ``--path``, whose files need the key as llama-server's do).
    """

    def __init__(self, app, keys: list[str], public_prefixes: tuple[str, ...] = PUBLIC_PREFIXES):
        self.app = app
        self.keys = list(keys)
        self.public_prefixes = tuple(public_prefixes)

    async def __call__(self, scope, receive, send):
        path = route_path(scope)
        public = path in PUBLIC_PATHS or bool(self.public_prefixes and path.startswith(self.public_prefixes))
        if scope["type"] != "http" or not self.keys or public or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        raw = scope.get("headers") or []
        headers = dict(raw)
        key = request_key(headers)
        if unambiguous_keys(raw, self.keys) and key_matches(key, self.keys):
            token = _CALLER.set(hashlib.sha256(key.encode()).hexdigest()[:16])
            try:
                await self.app(scope, receive, send)
            finally:
                _CALLER.reset(token)
            return
        anthropic = path == _ANTHROPIC_PATH or path.startswith(_ANTHROPIC_PATH + "/")
        body = _INVALID_ANTHROPIC if anthropic else _INVALID
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json; charset=utf-8"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class CorsPolicy:
    """Which origins may read answers and what a preflight says (module docstring).

    Args:
        origins: ``--cors-origins`` entries (``*``, ``localhost`` or exact origins).
        methods: ``Access-Control-Allow-Methods`` of preflights.
        headers: ``Access-Control-Allow-Headers`` of preflights.
        credentials: send ``Access-Control-Allow-Credentials: true``.
    """

    def __init__(self, origins: list[str], methods: str = "GET, POST, DELETE, OPTIONS", headers: str = "*",
                 credentials: bool = True):
        self.any = "*" in origins
        self.local = any(o.lower() == "localhost" for o in origins)
        self.exact = frozenset(o.strip().rstrip("/").lower() for o in origins if o not in ("*",)
                               and o.lower() != "localhost")
        self.methods = methods.encode("latin-1", "replace")
        self.headers = headers.encode("latin-1", "replace")
        self.credentials = credentials
        # answers depend on Origin (Fetch: Vary: Origin on every answer, allowed or not) unless
        # every origin gets the same plain "*", or none gets any CORS header
        self.varies = (self.any or self.local or bool(self.exact)) and not (self.any and not credentials)

    def allow_origin(self, origin: str) -> str | None:
        """The ``Access-Control-Allow-Origin`` value for a request from ``origin``, or None."""
        if not origin:
            return None
        if self.any:
            return origin if self.credentials else "*"
        low = origin.strip().lower()
        if low in self.exact:
            return origin
        if self.local and _is_local_origin(low):
            return origin
        return None


def _is_local_origin(origin: str) -> bool:
    """``http(s)://localhost|127.0.0.1|[::1][:port]`` (lower case)."""
    import re

    return re.fullmatch(r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?", origin) is not None


class CorsMiddleware:
    """ASGI middleware answering CORS as llama-server does (module docstring).

    Args:
        app: the wrapped ASGI app.
        policy: the :class:`CorsPolicy`.
    """

    def __init__(self, app, policy: CorsPolicy):
        self.app = app
        self.policy = policy

    def _headers(self, allowed: str) -> list[tuple[bytes, bytes]]:
        out = [(b"access-control-allow-origin", allowed.encode("latin-1", "replace"))]
        if self.policy.credentials:
            out.append((b"access-control-allow-credentials", b"true"))
        if self.policy.varies:
            out.append((b"vary", b"Origin"))
        return out

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = b""
        for k, val in scope.get("headers") or ():
            if k == b"origin":
                origin = val
                break
        allowed = self.policy.allow_origin(origin.decode("latin-1"))
        if scope.get("method") == "OPTIONS":  # llama-server: every OPTIONS is a preflight, answered at once
            head = [(b"content-type", b"text/html"), (b"content-length", b"0")]
            if allowed is not None:
                head += self._headers(allowed) + [(b"access-control-allow-methods", self.policy.methods),
                                                  (b"access-control-allow-headers", self.policy.headers)]
            elif self.policy.varies:
                head.append((b"vary", b"Origin"))
            await send({"type": "http.response.start", "status": 200, "headers": head})
            await send({"type": "http.response.body", "body": b""})
            return
        if allowed is None and not self.policy.varies:
            await self.app(scope, receive, send)
            return
        extra = self._headers(allowed) if allowed is not None else [(b"vary", b"Origin")]

        async def with_cors(msg):
            if msg["type"] == "http.response.start":
                msg = dict(msg)
                names = {n for n, _ in extra}
                kept, vary = [], None
                for n, v in msg.get("headers", []):
                    if n.lower() == b"vary":
                        vary = v  # merged below: the app's Vary stays
                    elif n.lower() not in names:
                        kept.append((n, v))
                if vary is None:
                    extra_now = extra
                elif any(n == b"vary" for n, _ in extra):  # the app's Vary plus Origin (once)
                    merged = vary if b"origin" in vary.lower() else vary + b", Origin"
                    extra_now = [(n, merged if n == b"vary" else v) for n, v in extra]
                else:
                    extra_now = extra + [(b"vary", vary)]
                msg["headers"] = kept + extra_now
            await send(msg)

        await self.app(scope, receive, with_cors)


def add_security(app, api_keys: list[str], cors: CorsPolicy | list[str], public_assets: bool = True) -> None:
    """Wrap ``app`` with the key check and, outside it, CORS (a :class:`CorsPolicy`, or a list of
    origins with llama-server's defaults for the rest). ``public_assets`` False (``--path``): files
    under ``/webui/`` need the key too."""
    policy = cors if isinstance(cors, CorsPolicy) else CorsPolicy(list(cors) or ["*"])
    app.add_middleware(ApiKeyMiddleware, keys=api_keys, public_prefixes=PUBLIC_PREFIXES if public_assets else ())
    app.add_middleware(CorsMiddleware, policy=policy)


def cors_policy(args) -> CorsPolicy:
    """The :class:`CorsPolicy` of a :class:`~kvserve.serving.args.ServerArgs`."""
    return CorsPolicy(list(args.cors_origins), getattr(args, "cors_methods", "GET, POST, DELETE, OPTIONS"),
                      getattr(args, "cors_headers", "*"), bool(getattr(args, "cors_credentials", True)))


# -- Ollama's routes: local origins and hosts only, as Ollama allows by default ---------------

#: Ollama's default allowed origins (envconfig.AllowedOrigins), as fnmatch patterns.
LOCAL_ORIGINS = tuple(f"{scheme}://{host}{port}" for scheme in ("http", "https")
                      for host in ("localhost", "127.0.0.1", "0.0.0.0", "[::1]")
                      for port in ("", ":*")) + (
    "app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*")

_FORBIDDEN = json.dumps({"error": "origin not allowed"}, separators=(",", ":")).encode()
_BAD_HOST = json.dumps({"error": "host not allowed"}, separators=(",", ":")).encode()
_BAD_HOST_LLAMA = json.dumps({"error": {"message": "host not allowed", "type": "permission_error", "code": 403}},
                             separators=(",", ":")).encode()
_BAD_ORIGIN_LLAMA = json.dumps({"error": {"message": "origin not allowed", "type": "permission_error", "code": 403}},
                               separators=(",", ":")).encode()
#: llama-server routes under /api's rules (local origins; loopback Host names on a loopback listener),
#: in llama-server's envelope: the server tools, which read, write and run things on this machine, and
#: the web page's proxy (``--ui-mcp-proxy``), which reaches whatever this machine can
LOCAL_ONLY_PATHS = frozenset({"/tools", "/cors-proxy"})


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
    models) and ``/tools``, ``/cors-proxy`` (:data:`LOCAL_ONLY_PATHS`, llama-server's envelope): a browser request whose
    ``Origin`` is not local (Ollama's defaults, plus
    ``OLLAMA_ORIGINS``) gets 403, preflights included; and when the server listens on loopback, a
    ``Host`` that is not a loopback name gets 403 (DNS rebinding), as Ollama does. The other faces
    keep llama-server's CORS rules (``--cors-origins``, default ``*``), with one check more (issue
    31): on a loopback listener without ``--api-key``, a browser request (one with an ``Origin``)
    whose ``Host`` is not a loopback name gets 403 ``host not allowed`` in llama-server's envelope,
    so a DNS-rebinding page cannot use the server. Programs send no ``Origin`` and are not affected;
    with a key the key is the fence.

    Args:
        bind_host: the address the server listens on (``--host``).
        extra_origins: more allowed origin patterns (``OLLAMA_ORIGINS``, comma-separated).
    """

    def __init__(self, app, bind_host: str = "127.0.0.1", extra_origins: tuple[str, ...] = (), keyed: bool = False):
        import ipaddress

        self.app = app
        self.origins = LOCAL_ORIGINS + tuple(extra_origins)
        self.keyed = keyed
        try:
            self.check_host = ipaddress.ip_address(bind_host.strip("[]")).is_loopback
        except ValueError:
            self.check_host = bind_host in ("localhost",)

    def _origin_ok(self, origin: str) -> bool:
        import fnmatch

        o = origin.strip().lower()  # "[" of an IPv6 origin is literal, not a character class
        return any(fnmatch.fnmatchcase(o, p.lower().replace("[", "[[]")) for p in self.origins)

    async def __call__(self, scope, receive, send):
        path = route_path(scope) if scope["type"] == "http" else ""
        ollama = path == "/api" or path.startswith("/api/")
        if ollama or path in LOCAL_ONLY_PATHS:
            headers = {k.lower(): v for k, v in scope.get("headers", [])}
            origin = headers.get(b"origin")
            if origin is not None and not self._origin_ok(origin.decode("latin-1")):
                return await _plain(send, 403, _FORBIDDEN if ollama else _BAD_ORIGIN_LLAMA)
            host = headers.get(b"host")
            if self.check_host and host is not None and not local_host(_host_of(host.decode("latin-1"))):
                return await _plain(send, 403, _BAD_HOST if ollama else _BAD_HOST_LLAMA)
        elif path and self.check_host and not self.keyed:
            headers = {k.lower(): v for k, v in scope.get("headers", [])}
            host = headers.get(b"host")
            if b"origin" in headers and host is not None and not local_host(_host_of(host.decode("latin-1"))):
                return await _plain(send, 403, _BAD_HOST_LLAMA)
        await self.app(scope, receive, send)


async def _plain(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json; charset=utf-8"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def add_api_guard(app, bind_host: str, keyed: bool = False) -> None:
    """Mount :class:`ApiOriginGuard` outermost (call after :func:`add_security`)."""
    import os

    extra = tuple(o.strip() for o in os.environ.get("OLLAMA_ORIGINS", "").split(",") if o.strip())
    app.add_middleware(ApiOriginGuard, bind_host=bind_host, extra_origins=extra, keyed=keyed)
