"""A real OCI registry for tests: Debian's ``docker-registry`` (the Docker distribution registry),
plus an in-process token realm and a recording proxy.

* :func:`running_registry` starts ``docker-registry serve`` on a free 127.0.0.1 port with a
  temporary config (filesystem storage under the work directory, plain http, no auth unless a
  :class:`TokenRealm` is given), waits (bounded) until ``GET /v2/`` answers, and stops it by pid.
* :class:`TokenRealm` answers the distribution token flow in-process (``GET /token?service=&scope=``
  -> ``{"token": <JWT>}``): an RS256 JWT signed with a throw-away key (``openssl`` makes the key, the
  self-signed certificate the registry trusts as ``rootcertbundle``, and the signatures; the JWT's
  ``kid`` is the key's libtrust fingerprint, which is how the registry finds the key).
* :class:`Proxy` forwards HTTP to the registry, records each request (method, path, Range header),
  and can misbehave on blob GETs: ``stall`` (send the first ``cut_at`` bytes, then hang until
  released), ``drop`` (send ``cut_at`` bytes, then close the connection, once), ``corrupt`` (flip the
  first byte).

Everything binds 127.0.0.1 and every wait is bounded. ``docker-registry`` missing: the callers skip.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.server
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx

REGISTRY_BINARY = "docker-registry"
MISSING = ("docker-registry is not installed (Debian package docker-registry: "
           "`apt-get install -y docker-registry`; .ci/run installs it)")


def registry_binary() -> str | None:
    """The registry executable, or None."""
    return shutil.which(REGISTRY_BINARY) or (f"/usr/bin/{REGISTRY_BINARY}"
                                             if os.access(f"/usr/bin/{REGISTRY_BINARY}", os.X_OK) else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def _serve(handler: type, owner: object) -> tuple[_Server, threading.Thread]:
    server = _Server(("127.0.0.1", 0), handler)
    server.owner = owner  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return server, thread


# -- the token realm


class TokenRealm:
    """An in-process token server for the registry's ``auth: token:`` (see the module docstring).

    ``requests`` lists each token request's query (``{"service": [...], "scope": [...]}``).
    """

    service = "kvserve-test"
    issuer = "kvserve-test-issuer"

    def __init__(self, workdir: Path):
        if shutil.which("openssl") is None:
            raise RuntimeError("openssl is not installed")
        workdir.mkdir(parents=True, exist_ok=True)
        self.key = workdir / "realm-key.pem"
        self.cert = workdir / "realm-cert.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(self.key),
                        "-out", str(self.cert), "-days", "2", "-subj", "/CN=kvserve-test-realm"],
                       check=True, capture_output=True, timeout=60)
        der = subprocess.run(["openssl", "pkey", "-in", str(self.key), "-pubout", "-outform", "DER"],
                             check=True, capture_output=True, timeout=30).stdout
        b32 = base64.b32encode(hashlib.sha256(der).digest()[:30]).decode().rstrip("=")
        self.kid = ":".join(b32[i:i + 4] for i in range(0, len(b32), 4))  # libtrust's KeyID
        self.requests: list[dict[str, list[str]]] = []
        self._server, self._thread = _serve(_RealmHandler, self)

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/token"

    def token(self, scopes: list[str]) -> str:
        """An RS256 JWT granting ``scopes`` (``repository:<name>:<actions>``)."""
        access = []
        for scope in scopes:
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            access.append({"type": kind, "name": name, "actions": [a for a in actions.split(",") if a]})
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "kid": self.kid}
        claims = {"iss": self.issuer, "sub": "kvserve-test", "aud": self.service, "exp": now + 600,
                  "nbf": now - 60, "iat": now, "jti": uuid.uuid4().hex, "access": access}
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        sig = subprocess.run(["openssl", "dgst", "-sha256", "-sign", str(self.key)], input=signing_input.encode(),
                             check=True, capture_output=True, timeout=30).stdout
        return f"{signing_input}.{_b64url(sig)}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _RealmHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        realm: TokenRealm = self.server.owner  # type: ignore[attr-defined]
        query = parse_qs(urlsplit(self.path).query)
        realm.requests.append(query)
        body = json.dumps({"token": realm.token(query.get("scope", []))}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


# -- the registry


@dataclass
class Registry:
    """A running ``docker-registry``: ``host`` is ``127.0.0.1:<port>`` (the host part of model names)."""

    host: str
    proc: subprocess.Popen
    root: Path
    log: Path

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def name(self, model: str) -> str:
        """``127.0.0.1:<port>/<model>`` (``library/tiny:latest`` -> a full model name)."""
        return f"{self.host}/{model}"

    def log_tail(self, n: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        return ""


def _config(port: int, storage: Path, realm: TokenRealm | None) -> str:
    lines = ["version: 0.1", "log:", "  level: warn", "  accesslog:", "    disabled: true", "storage:",
             "  filesystem:", f"    rootdirectory: {storage}", "  delete:", "    enabled: true", "http:",
             f"  addr: 127.0.0.1:{port}", "  secret: kvserve-test-secret"]
    if realm is not None:
        lines += ["auth:", "  token:", f"    realm: {realm.realm}", f"    service: {realm.service}",
                  f"    issuer: {realm.issuer}", f"    rootcertbundle: {realm.cert}"]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def running_registry(workdir: Path, realm: TokenRealm | None = None, start_timeout: float = 30.0) -> Iterator[Registry]:
    """Start ``docker-registry`` (see the module docstring); stop it (SIGTERM, then SIGKILL) on exit.

    Raises:
        FileNotFoundError: the binary is missing. RuntimeError: it did not answer in ``start_timeout`` s.
    """
    exe = registry_binary()
    if exe is None:
        raise FileNotFoundError(MISSING)
    workdir.mkdir(parents=True, exist_ok=True)
    storage = workdir / "storage"
    log = workdir / "registry.log"
    for _attempt in range(3):  # a port taken between free_port() and the bind: try another
        port = free_port()
        config = workdir / "config.yml"
        config.write_text(_config(port, storage, realm))
        with open(log, "ab") as logf:
            proc = subprocess.Popen([exe, "serve", str(config)], stdout=logf, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        reg = Registry(f"127.0.0.1:{port}", proc, storage, log)
        deadline = time.monotonic() + start_timeout
        ready = False
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{reg.url}/v2/", timeout=1.0).status_code in (200, 401):
                    ready = True
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        if ready:
            break
        _stop(proc)
    else:
        raise RuntimeError(f"docker-registry did not start:\n{reg.log_tail()}")
    try:
        yield reg
    finally:
        _stop(reg.proc)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


# -- the recording, misbehaving proxy


@dataclass
class Seen:
    method: str
    path: str
    range: str | None


@dataclass
class Proxy:
    """Forwards to ``upstream`` (``http://127.0.0.1:<port>``); see the module docstring."""

    upstream: str
    mode: str | None = None  # None, "stall", "drop", "corrupt"
    cut_at: int = 0
    requests: list[Seen] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._client = httpx.Client(timeout=30.0)
        self._server, self._thread = _serve(_ProxyHandler, self)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self._server.server_address[1]}"

    def blob_gets(self) -> list[Seen]:
        return [r for r in self.requests if r.method == "GET" and "/blobs/" in r.path]

    def close(self) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()
        self._client.close()


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _forward(self) -> None:
        proxy: Proxy = self.server.owner  # type: ignore[attr-defined]
        proxy.requests.append(Seen(self.command, self.path, self.headers.get("Range")))
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length", "connection")}
        req = proxy._client.build_request(self.command, proxy.upstream + self.path, headers=headers, content=body)
        resp = proxy._client.send(req, stream=True)
        try:
            self.send_response(resp.status_code)
            for k, v in resp.headers.items():
                if k.lower() not in ("transfer-encoding", "connection", "content-encoding"):
                    self.send_header(k, v)
            self.end_headers()
            if self.command == "HEAD":
                return
            misbehave = proxy.mode if "/blobs/" in self.path and self.command == "GET" else None
            sent = 0
            for chunk in resp.iter_raw():
                if misbehave == "corrupt" and sent == 0 and chunk:
                    chunk = bytes([chunk[0] ^ 0xFF]) + chunk[1:]
                if misbehave in ("stall", "drop") and sent + len(chunk) >= proxy.cut_at:
                    self.wfile.write(chunk[:proxy.cut_at - sent])
                    self.wfile.flush()
                    if misbehave == "stall":
                        proxy.release.wait(60)
                    else:
                        proxy.mode = None  # once
                    self.close_connection = True
                    return
                self.wfile.write(chunk)
                sent += len(chunk)
            self.wfile.flush()
        finally:
            resp.close()

    do_GET = do_HEAD = do_PUT = do_POST = do_PATCH = _forward
