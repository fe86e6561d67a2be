"""A client of a running server's Ollama routes (``/api/*``), for kvserve's command line.

Where the server is (:func:`server_url`), in the forms Ollama's ``envconfig.Host`` takes
(``host``, ``host:port``, ``http://host:port``, ``https://host``, ``[::1]:port``):

1. ``$KVSERVE_HOST``, a port left out meaning 8080 (kvserve's);
2. else ``$OLLAMA_HOST``, a port left out meaning 11434 (Ollama's; 80/443 with an explicit
   ``http://``/``https://``);
3. else ``http://127.0.0.1:8080``.

An unspecified bind address (``0.0.0.0``, ``::``) is reached through loopback, as Ollama's
``ConnectableHost`` does. :func:`probe` tells whether a server answers there (``GET /`` within a
short, bounded time: any HTTP answer counts).

:class:`ServerApi` has the method names and return shapes of
:class:`kvserve.ollama.local.LocalApi` (Ollama's JSON), plus the streams only a server has
(:meth:`ServerApi.chat`, :meth:`ServerApi.generate`, :meth:`ServerApi.pull`,
:meth:`ServerApi.push`). Streams are NDJSON read line by line as they arrive. An answer
``{"error": "..."}`` (or an ``error`` line in a stream) raises :class:`ServerError`, which is
the domain error of its status (404 :class:`~kvserve.errors.NotFoundError`, 400
:class:`~kvserve.errors.InvalidInputError`, 501 :class:`~kvserve.errors.NotSupportedError`)
so callers handle both backends alike; connection failures raise :class:`ServerUnreachable`.
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from kvserve.errors import (
    InvalidInputError,
    KvserveError,
    NotFoundError,
    NotSupportedError,
    UnavailableError,
)

__all__ = ["ServerApi", "ServerError", "ServerUnreachable", "parse_host", "probe", "server_url"]

KVSERVE_DEFAULT_PORT = 8080
OLLAMA_DEFAULT_PORT = 11434


def _split_host_port(hostport: str) -> tuple[str, str] | None:
    """Go's ``net.SplitHostPort`` (None where it fails: no port, too many colons)."""
    if hostport.startswith("["):
        end = hostport.find("]")
        if end < 0 or hostport[end + 1:end + 2] != ":":
            return None
        return hostport[1:end], hostport[end + 2:]
    host, sep, port = hostport.rpartition(":")
    if not sep or ":" in host:
        return None
    return host, port


def _host_port(value: str, default_port: int) -> tuple[str, str, str, str]:
    """``(scheme, host, port, path)`` of a host setting in Ollama's forms (see :func:`parse_host`);
    the host as written (``0.0.0.0`` stays; ``""`` for ``:PORT``)."""
    s = value.strip()
    scheme, sep, hostport = s.partition("://")
    port_default = str(default_port)
    if not sep:
        scheme, hostport = "http", s
    elif scheme == "http":
        port_default = "80"
    elif scheme == "https":
        port_default = "443"
    hostport, _, path = hostport.partition("/")
    split = _split_host_port(hostport)
    if split is None:
        host, port = "127.0.0.1", port_default
        stripped = hostport.strip("[]")
        try:
            host = str(ipaddress.ip_address(stripped))
        except ValueError:
            if hostport:
                host = hostport
    else:
        host, port = split
    if not (port.isdigit() and 0 <= int(port) <= 65535):
        port = port_default
    return scheme, host, port, path


def parse_host(value: str, default_port: int) -> str:
    """A host setting in Ollama's forms -> a base URL (``http://127.0.0.1:11434``).

    Follows ``envconfig.Host``: the scheme defaults to ``http`` (an explicit ``http://`` makes
    the default port 80, ``https://`` 443); a bare host takes ``default_port``; an empty host is
    127.0.0.1; a path after the host is kept; a port that is not a number in 0..65535 falls back
    to the default. ``0.0.0.0`` and ``::`` become loopback addresses.
    """
    scheme, host, port, path = _host_port(value, default_port)
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"{scheme}://{netloc}" + (f"/{path}" if path else "")


def listen_address(value: str, default_port: int) -> tuple[str, int]:
    """``(host, port)`` a server listens on for a host setting in Ollama's forms (``OLLAMA_HOST``
    as Ollama's server reads it: ``0.0.0.0:11434``, ``:8080``, ``[::]``...); unlike
    :func:`parse_host`, unspecified addresses stay as given (``:PORT``, with no host, listens on
    every interface, as Go's listener does for Ollama)."""
    _, host, port, _ = _host_port(value, default_port)
    return host or "0.0.0.0", int(port)


def server_url(environ: Mapping[str, str] | None = None) -> str:
    """The base URL of the server the command line talks to (see the module docstring)."""
    env = os.environ if environ is None else environ
    if env.get("KVSERVE_HOST", "").strip():
        return parse_host(env["KVSERVE_HOST"], KVSERVE_DEFAULT_PORT)
    if env.get("OLLAMA_HOST", "").strip():
        return parse_host(env["OLLAMA_HOST"], OLLAMA_DEFAULT_PORT)
    return f"http://127.0.0.1:{KVSERVE_DEFAULT_PORT}"


def probe(url: str, timeout: float = 1.0) -> bool:
    """Whether a server answers ``GET /`` at ``url`` within ``timeout`` seconds (connecting and
    reading the status line together; the body is not read). Any HTTP status counts."""
    import httpx

    try:
        with httpx.Client(timeout=httpx.Timeout(timeout), trust_env=False) as c, \
                c.stream("GET", url.rstrip("/") + "/", headers={"Accept": "text/plain"}):
            return True
    except (httpx.HTTPError, OSError, ValueError):
        return False


class ServerUnreachable(UnavailableError):
    """The server could not be reached, or the connection broke (``could not connect to ...``)."""


class ServerError(KvserveError):
    """An ``{"error": "..."}`` answer. ``status`` is the HTTP status (200 for an error line in
    a stream that had started). Instances are also the domain error of the status (see
    :func:`_error`)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


_KINDS: dict[int, type[KvserveError]] = {400: InvalidInputError, 404: NotFoundError, 501: NotSupportedError,
                                         503: UnavailableError}
_CLASSES: dict[type, type] = {}


def _error(message: str, status: int) -> ServerError:
    base = _KINDS.get(status)
    if base is None:
        return ServerError(message, status)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(f"Server{base.__name__}", (ServerError, base), {})
    return cls(message, status)


def _message(body: bytes, status: int) -> str:
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("error"), str):
        return obj["error"]
    text = body.decode("utf-8", "replace").strip()
    return text or f"the server answered {status}"


class ServerApi:
    """Ollama's routes on the server at ``base_url`` (see the module docstring).

    Args:
        base_url: e.g. ``http://127.0.0.1:8080`` (:func:`server_url`).
        timeout: seconds to connect and, for answers that are not streams, to wait for them.
    """

    def __init__(self, base_url: str, timeout: float = 300.0):
        import httpx

        self.base_url = base_url.rstrip("/")
        self._httpx = httpx
        self._client = httpx.Client(base_url=self.base_url, trust_env=False,
                                    timeout=httpx.Timeout(timeout, connect=10.0))

    def __repr__(self) -> str:
        return f"ServerApi({self.base_url!r})"

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    # -- plumbing

    def _request(self, method: str, path: str, body: Any = None, **kw) -> Any:
        httpx = self._httpx
        try:
            r = self._client.request(method, path, json=body, **kw) if body is not None else \
                self._client.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise ServerUnreachable(f"could not connect to the server at {self.base_url}: {e}") from None
        if r.status_code >= 400:
            raise _error(_message(r.content, r.status_code), r.status_code)
        if not r.content or method == "HEAD":
            return None
        try:
            return r.json()
        except ValueError:
            return None

    def _stream(self, path: str, body: dict) -> Iterator[dict]:
        """POST ``body`` and yield each NDJSON object as its line arrives."""
        httpx = self._httpx
        try:
            with self._client.stream("POST", path, json=body, timeout=httpx.Timeout(None, connect=10.0)) as r:
                if r.status_code >= 400:
                    raise _error(_message(r.read(), r.status_code), r.status_code)
                for line in r.iter_lines():
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        raise ServerError(f"the server sent a line that is not JSON: {line[:200]}", r.status_code) \
                            from None
                    if isinstance(obj, dict) and obj.get("error"):
                        raise _error(str(obj["error"]), r.status_code)
                    yield obj
        except httpx.HTTPError as e:
            raise ServerUnreachable(f"lost the connection to the server at {self.base_url}: {e}") from None

    # -- the routes

    def tags(self) -> dict:
        """GET /api/tags."""
        return self._request("GET", "/api/tags") or {"models": []}

    def ps(self) -> dict:
        """GET /api/ps."""
        return self._request("GET", "/api/ps") or {"models": []}

    def show(self, name: str, verbose: bool = False) -> dict:
        """POST /api/show."""
        body: dict[str, Any] = {"model": name}
        if verbose:
            body["verbose"] = True
        return self._request("POST", "/api/show", body) or {}

    def delete(self, name: str) -> None:
        """DELETE /api/delete."""
        self._request("DELETE", "/api/delete", content=json.dumps({"model": name}),
                      headers={"Content-Type": "application/json"})

    def copy(self, source: str, destination: str) -> None:
        """POST /api/copy."""
        self._request("POST", "/api/copy", {"source": source, "destination": destination})

    def has_blob(self, digest: str) -> bool:
        """HEAD /api/blobs/:digest (True: present)."""
        try:
            self._request("HEAD", f"/api/blobs/{digest}")
        except NotFoundError:
            return False
        return True

    def upload_blob(self, path: str | Path, digest: str, update: Callable[[int], Any] | None = None) -> None:
        """POST /api/blobs/:digest with a file's bytes, streamed (``update(n)`` per chunk sent)."""

        def chunks() -> Iterator[bytes]:
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    if update is not None:
                        update(len(chunk))
                    yield chunk

        self._request("POST", f"/api/blobs/{digest}", content=chunks(),
                      timeout=self._httpx.Timeout(None, connect=10.0))

    def create(self, body: dict) -> Iterator[dict]:
        """POST /api/create, streamed: Ollama's progress objects."""
        return self._stream("/api/create", {**body, "stream": True})

    def pull(self, name: str, insecure: bool = False) -> Iterator[dict]:
        """POST /api/pull, streamed."""
        return self._stream("/api/pull", {"model": name, "insecure": insecure, "stream": True})

    def push(self, name: str, insecure: bool = False) -> Iterator[dict]:
        """POST /api/push, streamed."""
        return self._stream("/api/push", {"model": name, "insecure": insecure, "stream": True})

    def chat(self, body: dict) -> Iterator[dict]:
        """POST /api/chat, streamed (``stream`` forced true)."""
        return self._stream("/api/chat", {**body, "stream": True})

    def generate(self, body: dict) -> Iterator[dict]:
        """POST /api/generate, streamed (``stream`` forced true)."""
        return self._stream("/api/generate", {**body, "stream": True})
