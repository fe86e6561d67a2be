"""llama-server's ``/cors-proxy`` (``--ui-mcp-proxy``): only the headers named
``x-llama-server-proxy-header-*`` reach the target, the answer comes back, and without the flag
both methods are 403 (llama.cpp's tests/unit/test_security.py, run here in process against a
local target)."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kvserve.app import build_app
from kvserve.serving.args import parse_args
from kvserve.serving.state import ServerState

KEY = "sk-test-1234"


class _Target(BaseHTTPRequestHandler):
    def _answer(self, body: bytes) -> None:
        self.server.seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/capture")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        out = json.dumps({"ok": True, "got": body.decode()}).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Target", "yes")
        self.send_header("Access-Control-Allow-Origin", "https://target.example")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self):
        self._answer(b"")

    def do_POST(self):
        self._answer(self.rfile.read(int(self.headers.get("Content-Length", "0"))))

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def target():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Target)
    srv.seen = []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _app(*argv):
    st = ServerState(parse_args(["--api-key", KEY, *argv]))
    st.preloading = True  # no model: the proxy needs none
    return build_app(st)


def _call(app, method, path, headers=None, content=None):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8080") as c:
            return await c.request(method, path, headers=headers or {}, content=content)

    return asyncio.run(go())


def test_only_explicit_proxy_headers_reach_the_target(target):
    app = _app("--ui-mcp-proxy")
    url = f"http://127.0.0.1:{target.server_port}/capture?x=1"
    r = _call(app, "GET", f"/cors-proxy?url={url}", headers={
        "Authorization": f"Bearer {KEY}", "Proxy-Authorization": "Basic secret", "X-Api-Key": KEY,
        "Cookie": "session=secret", "x-llama-server-proxy-header-accept": "application/json",
        "x-llama-server-proxy-header-authorization": "Bearer explicit",
        "x-llama-server-proxy-header-content-length": "99"})
    assert (r.status_code, r.json()) == (201, {"ok": True, "got": ""})
    assert r.headers["content-type"] == "application/json" and r.headers["x-target"] == "yes"
    assert r.headers.get("access-control-allow-origin") != "https://target.example"
    method, path, seen, _ = target.seen[-1]
    assert (method, path) == ("GET", "/capture?x=1")
    assert seen["accept"] == "application/json" and seen["authorization"] == "Bearer explicit"
    for name in ("proxy-authorization", "x-api-key", "cookie"):
        assert name not in seen
    assert seen["accept-encoding"] == "identity"


def test_post_body_travels_and_redirects_are_followed(target):
    app = _app("--ui-mcp-proxy")
    base = f"http://127.0.0.1:{target.server_port}"
    r = _call(app, "POST", f"/cors-proxy?url={base}/capture", content=b'{"jsonrpc": "2.0"}', headers={
        "Authorization": f"Bearer {KEY}", "x-llama-server-proxy-header-content-type": "application/json"})
    assert (r.status_code, r.json()) == (201, {"ok": True, "got": '{"jsonrpc": "2.0"}'})
    assert target.seen[-1][0] == "POST" and target.seen[-1][2]["content-type"] == "application/json"
    r = _call(app, "GET", f"/cors-proxy?url={base}/moved", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 201 and [s[1] for s in target.seen[-2:]] == ["/moved", "/capture"]


def test_disabled_bad_targets_and_the_key(target):
    auth = {"Authorization": f"Bearer {KEY}"}
    off = _app()
    for method in ("GET", "POST"):
        r = _call(off, method, "/cors-proxy?url=http://127.0.0.1/", headers=auth)
        assert (r.status_code, r.json()) == (403, {"error": {"message": "this feature is disabled",
                                                             "type": "feature_disabled"}})
    on = _app("--ui-mcp-proxy")
    n = len(target.seen)
    assert _call(on, "GET", f"/cors-proxy?url=http://127.0.0.1:{target.server_port}/").status_code == 401
    for url, msg in (("ftp://127.0.0.1/x", "unsupported URL scheme in target URL: ftp"),
                     ("http:///x", "invalid target URL: missing host"), ("", "invalid target URL: missing host"),
                     (f"http://u:p@127.0.0.1:{target.server_port}/", "authentication in target URL is not supported")):
        r = _call(on, "GET", f"/cors-proxy?url={url}", headers=auth)
        assert (r.status_code, r.json()["error"]["message"]) == (400, msg)
    assert len(target.seen) == n  # none of those reached the target
    with socket_closed() as port:
        r = _call(on, "GET", f"/cors-proxy?url=http://127.0.0.1:{port}/", headers=auth)
    assert r.status_code == 502 and r.json()["error"]["message"].startswith("proxy: the target could not be reached")


def test_foreign_origin_and_rebinding_host_are_refused(target):
    """/cors-proxy reaches anything this machine can (intranet, loopback services): it takes the
    /tools guard (a foreign Origin, a non-loopback Host on a loopback listener: 403), as /tools."""
    app = _app("--ui-mcp-proxy")
    auth = {"Authorization": f"Bearer {KEY}"}
    url = f"http://127.0.0.1:{target.server_port}/capture"
    n = len(target.seen)
    for method in ("GET", "POST"):
        r = _call(app, method, f"/cors-proxy?url={url}", headers={**auth, "Origin": "https://evil.example"})
        assert (r.status_code, r.json()) == (403, {"error": {"message": "origin not allowed",
                                                             "type": "permission_error", "code": 403}})
    r = _call(app, "OPTIONS", f"/cors-proxy?url={url}", headers={"Origin": "https://evil.example",
                                                                 "Access-Control-Request-Method": "POST"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    r = _call(app, "GET", f"/cors-proxy?url={url}", headers={**auth, "Host": "rebind.example:8080"})
    assert (r.status_code, r.json()["error"]["message"]) == (403, "host not allowed")
    assert len(target.seen) == n  # none reached the target
    r = _call(app, "GET", f"/cors-proxy?url={url}", headers={**auth, "Origin": "http://localhost:5173"})
    assert (r.status_code, r.json()) == (201, {"ok": True, "got": ""})
    assert len(target.seen) == n + 1


class socket_closed:
    """A loopback port nothing listens on (bound, then closed)."""

    def __enter__(self) -> int:
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        return port

    def __exit__(self, *exc) -> None:
        return None
