"""Issue 31, Build 1: --api-prefix and --root-path leave every guard on, on every route.

The repro: with a prefix the /api origin guard (``path.startswith("/api/")``) saw ``/pfx/api/...`` and
let cross-site pages copy, delete, create and pull models; the prefix itself did not route; with
--api-key even /health needed the key. Served by a real uvicorn (its root_path handling is what a
deployment gets), around a state whose model never loads."""

from __future__ import annotations

import re
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi.routing import APIRoute

from kvserve.app import build_app, uvicorn_config
from kvserve.faces.paths import route_path
from kvserve.serving.args import parse_args
from kvserve.serving.state import ServerState

KEY = "k-123"


class Live:
    def __init__(self, *argv: str):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        state = ServerState(parse_args([*argv, "--api-key", KEY, "--no-preload"], environ={}))
        state.preloading = True
        self.app = build_app(state)
        self.server = uvicorn.Server(uvicorn_config(self.app, state.args, host="127.0.0.1", port=self.port,
                                                    log_config=None))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)

    def request(self, method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(method, f"http://127.0.0.1:{self.port}{path}", timeout=10, **kw)


def _routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route, path parameters filled with ``x``."""
    out = []
    stack = list(app.routes)
    while stack:
        r = stack.pop()
        inner = getattr(r, "original_router", None)  # FastAPI's included routers
        if inner is not None:
            stack += inner.routes
        elif isinstance(r, APIRoute):
            path = re.sub(r"\{[^}]*\}", "x", r.path)
            out += [(m, path) for m in sorted(r.methods) if m != "HEAD"]
    return sorted(set(out))


@pytest.fixture(scope="module", params=[("--api-prefix", "/pfx"), ("--api-prefix", "pfx/"), ("--root-path", "/pfx")],
                ids=["api-prefix", "api-prefix-bare", "root-path"])
def live(request):
    with Live(*request.param) as server:
        yield request.param[0], server


def _spellings(flag: str, path: str) -> list[str]:
    """How a client reaches ``path``: under the prefix and without it (--api-prefix); with uvicorn's
    --root-path a proxy strips the prefix, so the request arrives without it."""
    return [f"/pfx{path}", path] if flag == "--api-prefix" else [path]


def test_every_route_needs_the_key_but_health(live):
    flag, server = live
    routes = _routes(server.app)
    assert len(routes) > 60
    for method, path in routes:
        for url in _spellings(flag, path):
            r = server.request(method, url)
            public = path in ("/health", "/v1/health", "/") or path.startswith("/webui/")
            if public:
                assert r.status_code != 401, (method, url)
            else:
                assert r.status_code == 401, (method, url, r.status_code, r.text)
    for url in _spellings(flag, "/health"):
        r = server.request("GET", url)
        assert (r.status_code, r.json()["error"]["message"]) == (503, "Loading model"), url  # public, no key


def test_every_api_route_keeps_the_origin_and_host_guard(live):
    flag, server = live
    api = [(m, p) for m, p in _routes(server.app) if p.startswith("/api/")]
    assert {("POST", "/api/pull"), ("POST", "/api/copy"), ("DELETE", "/api/delete"), ("POST", "/api/create"),
            ("POST", "/api/chat"), ("GET", "/api/tags")} <= set(api)  # the repro's routes among them
    auth = {"Authorization": f"Bearer {KEY}"}
    for method, path in api:
        for url in _spellings(flag, path):
            r = server.request(method, url, headers={**auth, "Origin": "https://evil.example"})
            assert (r.status_code, r.json()) == (403, {"error": r.json()["error"]}), (method, url)
            assert isinstance(r.json()["error"], str)
            r = server.request(method, url, headers={**auth, "Host": "evil.example"})
            assert r.status_code == 403, (method, url)


def test_the_prefix_routes(live):
    flag, server = live
    auth = {"Authorization": f"Bearer {KEY}"}
    for url in _spellings(flag, "/api/version"):
        r = server.request("GET", url, headers=auth)
        assert r.status_code == 200 and "version" in r.json(), url
    r = server.request("GET", "/pfx/nope" if flag == "--api-prefix" else "/nope", headers=auth)
    assert r.status_code == 404
    r = server.request("GET", _spellings(flag, "/api/nope")[0], headers=auth)
    assert (r.status_code, r.json()) == (404, {"error": "File Not Found"})


def test_route_path():
    assert route_path({"type": "http", "path": "/pfx/api/tags", "root_path": "/pfx"}) == "/api/tags"
    assert route_path({"type": "http", "path": "/pfx", "root_path": "/pfx"}) == "/"
    assert route_path({"type": "http", "path": "/pfxapi/tags", "root_path": "/pfx"}) == "/pfxapi/tags"
    assert route_path({"type": "http", "path": "/api/tags", "root_path": ""}) == "/api/tags"
    assert route_path({"type": "lifespan"}) == ""


# -- Build 9: the smaller findings ---------------------------------------------------------------------

def _app(*argv: str):
    state = ServerState(parse_args([*argv, "--no-preload"], environ={}))
    state.preloading = True
    return build_app(state)


def _call(app, method: str, path: str, **kw) -> httpx.Response:
    import asyncio

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def test_ipv6_loopback_origin_is_accepted_on_api():
    app = _app()
    for origin in ("http://[::1]", "http://[::1]:8080", "http://localhost:3000"):
        assert _call(app, "GET", "/api/version", headers={"Origin": origin}).status_code == 200, origin
    r = _call(app, "GET", "/api/version", headers={"Origin": "http://[::2]"})
    assert (r.status_code, r.json()) == (403, {"error": "origin not allowed"})


def test_two_authorization_headers_are_refused():
    app = _app("--api-key", KEY)
    ok = _call(app, "GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code != 401
    for headers in ([("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {KEY}")],
                    [("Authorization", f"Bearer {KEY}"), ("Authorization", f"Bearer {KEY}")],
                    [("X-Api-Key", KEY), ("X-Api-Key", KEY)],
                    [("Authorization", f"Bearer {KEY}"), ("X-Api-Key", "wrong")],
                    [("Authorization", "Bearer wrong"), ("X-Api-Key", KEY)],
                    [("Authorization", f"Basic {KEY}"), ("X-Api-Key", KEY)]):
        r = _call(app, "GET", "/v1/models", headers=headers)
        assert (r.status_code, r.json()["error"]["message"]) == (401, "Invalid API Key"), headers
    # the same valid key in both (llama.cpp's test_security.py sends this): accepted, as llama-server does
    both = _call(app, "GET", "/v1/models", headers=[("Authorization", f"Bearer {KEY}"), ("X-Api-Key", KEY)])
    assert both.status_code == ok.status_code != 401


def test_path_files_need_the_key(tmp_path):
    (tmp_path / "index.html").write_text("<p>page</p>")
    (tmp_path / "secret.txt").write_text("hunter2")
    app = _app("--api-key", KEY, "--path", str(tmp_path))
    page = _call(app, "GET", "/", headers={"Accept": "text/html"})
    assert (page.status_code, page.text) == (200, "<p>page</p>")  # public, as llama-server's page
    for url in ("/webui/secret.txt", "/secret.txt"):
        assert _call(app, "GET", url).status_code == 401, url
        r = _call(app, "GET", url, headers={"Authorization": f"Bearer {KEY}"})
        assert (r.status_code, r.text) == (200, "hunter2"), url
    builtin = _app("--api-key", KEY)  # the built-in page's assets stay public
    assert _call(builtin, "GET", "/webui/app.js").status_code == 200
