"""One path logic for every route and every guard (issue 31, Build 1).

``route_path(scope)`` is the path the app routes on: ``scope["path"]`` less ``scope["root_path"]``
(ASGI puts the root path in front of the path, as uvicorn does with vLLM's ``--root-path``;
Starlette strips it the same way when it matches a route). The API-key check, the ``/api`` origin
and host guard, the body limit, the error envelopes and the request log all read it, so a prefix
cannot turn a guard off (the guard once tested ``scope["path"].startswith("/api/")``: with a prefix,
cross-site pages could copy, delete, create and pull models).

llama-server's ``--api-prefix P`` serves every route under ``P`` as well
(:class:`ApiPrefixMiddleware` moves ``P`` into ``root_path`` for a request under it); vLLM's
``--root-path R`` is for a proxy that strips ``R`` before the request arrives (uvicorn's
``root_path``). ``/health`` stays public with ``--api-key`` under either (``P/health`` too), as
llama-server keeps it.
"""

from __future__ import annotations

__all__ = ["ApiPrefixMiddleware", "normalize_prefix", "route_path"]


def route_path(scope) -> str:
    """The path the app routes ``scope`` on (see the module docstring); ``""`` for a non-HTTP scope."""
    if scope.get("type") not in ("http", "websocket"):
        return ""
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):] or "/"
    return path


def normalize_prefix(prefix: str | None) -> str:
    """``/pfx`` for ``pfx``, ``/pfx/`` or ``/pfx``; ``""`` for none or ``/``."""
    p = (prefix or "").strip().strip("/")
    return f"/{p}" if p else ""


class ApiPrefixMiddleware:
    """ASGI middleware (outermost): a request whose route path is ``prefix`` or under it is served as
    the route below it (``root_path`` grows by ``prefix``; ``path`` is unchanged, as ASGI wants);
    other requests pass as they are."""

    def __init__(self, app, prefix: str):
        self.app = app
        self.prefix = normalize_prefix(prefix)

    async def __call__(self, scope, receive, send):
        if self.prefix:
            path = route_path(scope)
            if path == self.prefix or path.startswith(self.prefix + "/"):
                scope = {**scope, "root_path": scope.get("root_path", "") + self.prefix}
        await self.app(scope, receive, send)
