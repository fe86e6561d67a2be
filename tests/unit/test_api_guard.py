"""Ollama's routes answer local origins and loopback hosts only (review of #13: any web page could
delete, copy and create models through CORS *; DNS rebinding was not blocked)."""

from __future__ import annotations

import asyncio

import httpx

from kvserve.app import build_app
from kvserve.serving.args import parse_args
from kvserve.serving.state import ServerState


def _call(app, method, path, headers=None, base="http://127.0.0.1:8080"):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base) as c:
            return await c.request(method, path, headers=headers or {})

    return asyncio.run(go())


def _app(*argv):
    st = ServerState(parse_args(list(argv)))
    st.preloading = True
    return build_app(st)


def test_foreign_origin_is_refused_on_api_routes_preflight_included():
    app = _app()
    r = _call(app, "OPTIONS", "/api/delete", {"Origin": "https://evil.example",
                                             "Access-Control-Request-Method": "DELETE"})
    assert (r.status_code, r.json()) == (403, {"error": "origin not allowed"})
    assert "access-control-allow-origin" not in r.headers
    r = _call(app, "POST", "/api/copy", {"Origin": "https://evil.example", "Content-Type": "text/plain"})
    assert r.status_code == 403
    for origin in ("http://localhost:3000", "http://127.0.0.1", "app://ollama", "vscode-webview://x"):
        r = _call(app, "GET", "/api/version", {"Origin": origin})
        assert r.status_code == 200, origin
    # the OpenAI and llama-server routes keep --cors-origins (default *: the origin reflected, as llama-server)
    r = _call(app, "GET", "/health", {"Origin": "https://evil.example"})
    assert r.status_code == 503 and r.headers["access-control-allow-origin"] == "https://evil.example"


def test_ollama_origins_env_adds_patterns(monkeypatch):
    monkeypatch.setenv("OLLAMA_ORIGINS", "https://*.example.com")
    app = _app()
    assert _call(app, "GET", "/api/version", {"Origin": "https://ui.example.com"}).status_code == 200
    assert _call(app, "GET", "/api/version", {"Origin": "https://evil.example"}).status_code == 403


def test_foreign_host_is_refused_when_listening_on_loopback():
    app = _app()
    r = _call(app, "GET", "/api/tags", base="http://evil.example:8080")
    assert (r.status_code, r.json()) == (403, {"error": "host not allowed"})
    for base in ("http://localhost:11434", "http://127.0.0.1:8080", "http://[::1]:8080", "http://box.local"):
        assert _call(app, "GET", "/api/version", base=base).status_code == 200, base
    # listening on all interfaces: any Host (a LAN name or address)
    app = _app("--host", "0.0.0.0")
    assert _call(app, "GET", "/api/version", base="http://192.168.1.20:8080").status_code == 200


def test_dns_rebinding_page_is_refused_outside_api_without_a_key():
    """Issue 31: outside /api every Origin was reflected and no Host checked, so a page whose name was
    rebound to 127.0.0.1 could use a server without a key. A browser request (it has an Origin) with a
    foreign Host is now 403 on a loopback listener; programs (no Origin), local names, a key, or a
    server on all interfaces are unaffected."""
    evil = {"Origin": "http://rebind.example:8080"}
    app = _app()
    r = _call(app, "POST", "/completion", evil, base="http://rebind.example:8080")
    assert (r.status_code, r.json()) == (403, {"error": {"message": "host not allowed", "type": "permission_error",
                                                         "code": 403}})
    assert _call(app, "GET", "/health", base="http://rebind.example:8080").status_code == 503  # no Origin
    r = _call(app, "GET", "/health", {"Origin": "https://evil.example"})  # a cross-origin page on localhost
    assert r.status_code == 503 and r.headers["access-control-allow-origin"] == "https://evil.example"
    assert _call(_app("--api-key", "k"), "POST", "/completion", evil, base="http://rebind.example:8080"
                 ).status_code == 401
    assert _call(_app("--host", "0.0.0.0"), "GET", "/health", evil, base="http://rebind.example:8080"
                 ).status_code == 503
