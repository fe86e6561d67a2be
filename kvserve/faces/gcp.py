"""Google Cloud Vertex AI's custom-container protocol, as llama-server implements it
(``server-http.cpp``, ``register_gcp_compat``).

With ``AIP_MODE=PREDICTION`` in the environment:

- the server listens on ``AIP_HTTP_PORT`` (default 8080), whatever ``--port`` says (a warning is
  logged when they differ);
- ``POST AIP_PREDICT_ROUTE`` (default ``/predict``) takes ``{"instances": [...]}``, at most 128
  JSON objects, each with a string ``@requestFormat``: a route's camelCase alias
  (``chatCompletions`` for ``/v1/chat/completions``: ``/v1`` dropped, ``/``, ``-`` and ``_`` start
  a capital; the first route registered under an alias keeps it) or a route's path. The rest of
  the instance is that route's request body (a ``stream`` member is set to false, and added as
  false for Ollama's ``/api/*`` routes, which stream by default: llama-server has none); the instances
  run concurrently, and the answer is ``{"predictions": [...]}``, each the route's JSON answer
  (its error envelope included, whatever its status), in the instances' order. An instance that
  is not an object, lacks ``@requestFormat`` or names no route gets an error object in its place;
  a route that answers with a stream gets ``predict route does not support streaming
  responses``. The body must be an object with an ``instances`` array: else 400.
- ``AIP_HEALTH_ROUTE``, when set, answers as ``GET /health``.

A predict route that is already a route is refused at start (llama-server exits). Each instance
is served by the whole app (its API key check, limits and error envelopes included) with the
caller's headers, as llama-server calls its handler with the caller's request.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass

from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from kvserve.faces.api_error import ApiError
from kvserve.faces.http import json_response, read_json

__all__ = ["GcpSettings", "MAX_INSTANCES", "PredictRouteConflict", "gcp_format", "install"]

#: llama-server's cap on ``instances`` per request
MAX_INSTANCES = 128

_STREAM_TYPES = ("text/event-stream", "application/x-ndjson")


class PredictRouteConflict(ValueError):
    """``AIP_PREDICT_ROUTE`` names a route the server already has (llama-server exits)."""


def _route_env(environ, name: str, default: str) -> str:
    value = environ.get(name) or default
    return value if not value or value.startswith("/") else "/" + value


@dataclass(frozen=True, slots=True)
class GcpSettings:
    """What the ``AIP_*`` variables ask for (Vertex AI's custom-container requirements).

    Attributes:
        enabled: ``AIP_MODE`` is ``PREDICTION``.
        health_route: ``AIP_HEALTH_ROUTE`` with a leading ``/`` ("" = none: ``/health`` serves).
        predict_route: ``AIP_PREDICT_ROUTE`` with a leading ``/`` (default ``/predict``).
        port: ``AIP_HTTP_PORT`` (default 8080).
    """

    enabled: bool = False
    health_route: str = ""
    predict_route: str = "/predict"
    port: int = 8080

    @classmethod
    def from_env(cls, environ=None) -> GcpSettings:
        """The settings of ``environ`` (default ``os.environ``).

        Raises:
            ValueError: ``AIP_HTTP_PORT`` is not an integer in 0-65535 (with ``AIP_MODE=PREDICTION``).
        """
        env = os.environ if environ is None else environ
        if env.get("AIP_MODE", "") != "PREDICTION":
            return cls()
        port = env.get("AIP_HTTP_PORT") or "8080"
        try:
            port_n = int(port)
        except ValueError:
            port_n = -1
        if not 0 <= port_n <= 65535:  # as --port: else bind() raises OverflowError (a traceback)
            raise ValueError(f"AIP_HTTP_PORT must be a port number, got {port[:32]!r}")
        return cls(True, _route_env(env, "AIP_HEALTH_ROUTE", ""), _route_env(env, "AIP_PREDICT_ROUTE", "/predict"),
                   port_n)


def gcp_format(path: str) -> str:
    """A route's ``@requestFormat`` alias, as llama-server derives it: ``/v1`` and the leading
    ``/`` dropped, each ``/``, ``-`` or ``_`` capitalizes the next character, and the alias ends
    at a path parameter (``/v1/chat/completions`` -> ``chatCompletions``, ``/apply-template`` ->
    ``applyTemplate``, ``/slots/{id_slot}`` -> ``slots``)."""
    s = path[3:] if len(path) > 3 and path.startswith("/v1") else path
    s = s[1:] if s.startswith("/") else s
    out, cap = [], False
    for c in s:
        if c in ":{":
            break
        if c in "/-_":
            cap = True
        else:
            out.append(c.upper() if cap else c)
            cap = False
    return "".join(out)


def _flat_routes(routes) -> list:
    """The app's routes in registration order, included routers opened (FastAPI >= 0.165 keeps an
    included router as one entry with its ``original_router``; kvserve includes them without a
    prefix)."""
    out = []
    for route in routes:
        inner = getattr(route, "original_router", None)
        out += _flat_routes(inner.routes) if inner is not None else [route]
    return out


def _route_table(app) -> dict[str, tuple[str, str]]:
    """Every route without path parameters: {path: (path, method)} plus {alias: (path, method)}
    (first registration wins), the method POST where the route takes it."""
    paths: dict[str, tuple[str, str]] = {}
    for route in _flat_routes(app.routes):
        path, methods = getattr(route, "path", None), getattr(route, "methods", None)
        if not path or not methods or "{" in path:
            continue
        target = (path, "POST" if "POST" in methods else sorted(methods)[0])
        paths.setdefault(path, target)
    aliases: dict[str, tuple[str, str]] = {}
    for path, target in paths.items():
        aliases.setdefault(gcp_format(path), target)
    return {**paths, **aliases}


def _error(message: str, status: int = 400) -> dict:
    return ApiError(status, message).body()


async def _serve_instance(http: HttpRequest, target: tuple[str, str], payload: dict):
    """Run ``payload`` through the whole app as ``target`` (path, method) with the caller's
    headers; returns the answer's JSON (its text when it is not JSON, None when empty)."""
    path, method = target
    body = json.dumps(payload).encode()
    outer = http.scope
    headers = [(k, v) for k, v in outer.get("headers", []) if k not in (b"content-length", b"content-type")]
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    root = outer.get("root_path", "")
    scope = {k: outer[k] for k in ("type", "asgi", "http_version", "scheme", "server", "client", "state",
                                   "extensions") if k in outer}
    scope.update(method=method, path=root + path, raw_path=(root + path).encode(), root_path=root,
                 query_string=outer.get("query_string", b""), headers=headers)
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await http.receive()  # then the caller's disconnect, when it comes

    start: dict = {}
    chunks: list[bytes] = []

    async def send(msg):
        if msg["type"] == "http.response.start":
            start.update(msg)
        elif msg["type"] == "http.response.body":
            chunks.append(msg.get("body", b""))

    await outer["app"](scope, receive, send)
    ctype = dict(start.get("headers", [])).get(b"content-type", b"").decode("latin-1")
    if ctype.startswith(_STREAM_TYPES):
        return _error("predict route does not support streaming responses")
    data = b"".join(chunks)
    if not data:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return data.decode("utf-8", "replace")


async def _predict(http: HttpRequest, table: dict[str, tuple[str, str]]) -> Response:
    try:
        data = await read_json(http, required=False)
    except ApiError as e:
        return json_response(e.body(), e.status)
    if not isinstance(data, dict):
        return json_response(_error("request body must be a JSON object"), 400)
    instances = data.get("instances")
    if not isinstance(instances, list):
        return json_response(_error("request body must include an array field named instances"), 400)
    if len(instances) > MAX_INSTANCES:
        return json_response(_error(f"instances array exceeds maximum size of {MAX_INSTANCES}"), 400)

    async def one(instance):
        if not isinstance(instance, dict):
            return _error("each instance must be a JSON object")
        fmt = instance.get("@requestFormat")
        if not isinstance(fmt, str):
            return _error("each instance must include a string @requestFormat")
        target = table.get(fmt)
        if target is None:
            return _error("no handler registered for @requestFormat: " + fmt[:256])
        payload = {k: v for k, v in instance.items() if k != "@requestFormat"}
        if "stream" in payload or target[0].startswith("/api/"):  # Ollama's routes stream by default
            payload["stream"] = False
        return await _serve_instance(http, target, payload)

    return json_response({"predictions": list(await asyncio.gather(*(one(i) for i in instances)))})


def install(app, settings: GcpSettings) -> None:
    """Add the predict route (and the health alias) to ``app`` when ``settings.enabled``; call it
    after every other route is mounted (the aliases are those routes').

    Raises:
        PredictRouteConflict: the predict route is already one of the app's routes.
    """
    if not settings.enabled:
        return
    table = _route_table(app)
    routes = _flat_routes(app.routes)
    if settings.predict_route in {getattr(r, "path", None) for r in routes}:
        raise PredictRouteConflict(f"AIP_PREDICT_ROUTE={settings.predict_route} conflicts with an existing route")
    if settings.health_route:
        health = next(r for r in routes if getattr(r, "path", None) == "/health")
        app.add_api_route(settings.health_route, health.endpoint, methods=["GET"])

    async def predict(http: HttpRequest) -> Response:
        return await _predict(http, table)

    app.add_api_route(settings.predict_route, predict, methods=["POST"])
