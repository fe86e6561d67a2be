"""Issue 31, Build 7: every error on /api/* in Ollama's ``{"error": ...}`` and on /v1/messages* in
Anthropic's envelope (unknown paths and methods, shared-code refusals, uvicorn's 400), no exception text
in any message, and the attack run's five 500s as 400s. The app runs around a state whose model never
loads (tests/unit/test_hardening_http.py's helpers)."""

from __future__ import annotations

import asyncio
import json
import math
import socket

import httpx
import pytest
from test_hardening_http import _Live, _state

from kvserve.app import build_app
from kvserve.engine.request import Request
from kvserve.errors import InvalidInputError
from kvserve.faces.api_error import INTERNAL_ERROR, ApiError
from kvserve.faces.http import json_response
from kvserve.faces.ollama_api import ollama_options
from kvserve.faces.router import generate_request
from kvserve.ollama.create import iter_create
from kvserve.store import Store

OLLAMA_404 = {"error": "File Not Found"}


def _call(app, method: str, path: str, host: str = "127.0.0.1", **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=f"http://{host}") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


@pytest.mark.parametrize("method,path", [("GET", "/api/nothing"), ("POST", "/api/nothing/deeper")])
def test_unknown_api_paths_are_ollamas_envelope(method, path):
    r = _call(build_app(_state()), method, path)
    assert (r.status_code, r.json(), r.headers["content-type"]) == (404, OLLAMA_404, "application/json; charset=utf-8")
    assert int(r.headers["content-length"]) == len(r.content)


@pytest.mark.parametrize("method,path,allow", [("GET", "/api/chat", "POST"), ("DELETE", "/api/chat", "POST"),
                                               ("DELETE", "/api/generate", "POST"), ("PUT", "/api/tags", "GET"),
                                               ("GET", "/api/delete", "DELETE")])
def test_other_methods_on_api_paths_are_405_as_ollama(method, path, allow):
    """Review 6: Ollama (gin with HandleMethodNotAllowed) answers a known path's other methods 405; was 404."""
    r = _call(build_app(_state()), method, path)
    assert (r.status_code, r.json(), r.headers["allow"]) == (405, {"error": "405 method not allowed"}, allow)
    assert int(r.headers["content-length"]) == len(r.content)
    assert _call(build_app(_state()), "DELETE", "/completion").status_code == 404  # elsewhere llama-server's 404


def test_other_routes_keep_llamas_envelope():
    r = _call(build_app(_state()), "GET", "/nothing")
    assert r.json() == {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}


@pytest.mark.parametrize("path", ["/v1/messages/nothing", "/v1/messages/count_tokens/x"])
def test_unknown_messages_paths_are_anthropics_envelope(path):
    r = _call(build_app(_state()), "POST", path, json={})
    assert r.status_code == 404
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error" and set(body) == {"type", "error"}


def test_shared_refusals_on_api_are_ollamas_envelope():
    app = build_app(_state("--max-request-bytes", "100"))
    r = _call(app, "POST", "/api/chat", content=b"{" + b" " * 200 + b"}", headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and set(r.json()) == {"error"} and isinstance(r.json()["error"], str)
    r = _call(app, "POST", "/v1/messages", content=b"{" + b" " * 200 + b"}",
              headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["type"] == "error" and r.json()["error"]["type"] == "request_too_large"
    r = _call(app, "GET", "/api/tags", host="evil.example")  # the origin/host guard's refusal
    assert r.status_code == 403 and set(r.json()) == {"error"} and isinstance(r.json()["error"], str)
    keyed = build_app(_state("--api-key", "k"))
    r = _call(keyed, "GET", "/api/tags")
    assert (r.status_code, r.json()) == (401, {"error": "Invalid API Key"})
    r = _call(keyed, "GET", "/api/nothing", headers={"Authorization": "Bearer k"})
    assert (r.status_code, r.json()) == (404, OLLAMA_404)


def test_unexpected_error_text_is_never_in_the_message():
    state = _state()

    def boom(*a, **k):
        raise RuntimeError("secret /home/user/.cache/kvserve/models path")

    state.require_up = boom
    app = build_app(state)
    r = _call(app, "GET", "/props")
    assert (r.status_code, r.json()["error"]["message"]) == (500, INTERNAL_ERROR)
    assert ApiError.from_exception(KeyError("x")).message == INTERNAL_ERROR


def test_uvicorn_400_on_api_is_ollamas_envelope():
    with _Live(build_app(_state())) as live:
        answers = []
        for request in (b"GET /api/tags HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header\r\n\r\n",
                        b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header\r\n\r\n"):
            s = socket.create_connection(("127.0.0.1", live.port), timeout=10)
            s.sendall(request)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            s.close()
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400 ")
            answers.append(json.loads(body))
    assert answers == [{"error": "Invalid HTTP request received."},
                       {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "Invalid HTTP request received."}}]


# -- the five 500s of the attack run -----------------------------------------------------------------

@pytest.mark.parametrize("options,message", [
    ({"temperature": 10 ** 400}, 'option "temperature" must be of type float32'),
    ({"num_ctx": 10 ** 400}, 'option "num_ctx" must be of type integer'),
    ({"num_ctx": 2 ** 63}, 'option "num_ctx" must be of type integer'),
])
def test_ollama_options_beyond_range_are_400(options, message):
    with pytest.raises(ApiError) as e:
        ollama_options(None, options)
    assert (e.value.status, e.value.message) == (400, message)
    assert ollama_options(None, {"num_ctx": 2 ** 62, "temperature": 10 ** 30}).num_ctx == 2 ** 62


def _nested(depth: int) -> dict:
    v: object = 1
    for _ in range(depth):
        v = {"a": v}
    return v  # type: ignore[return-value]


@pytest.mark.parametrize("parameters,message", [
    ({"temperature": math.nan}, "invalid parameters: json: unsupported value: NaN"),
    (_nested(300), "invalid parameters: json: value nested too deeply"),
])
def test_create_parameters_nan_or_too_deep_are_400(tmp_path, tiny_gguf, parameters, message):
    store = Store(tmp_path / "models")
    digest = store.import_file(tiny_gguf).digest
    with pytest.raises(InvalidInputError) as e:
        list(iter_create(store, {"model": "m", "from": digest, "parameters": parameters}))
    assert e.value.message == message
    assert ApiError.from_exception(e.value).status == 400


def test_render_echoes_only_vllms_stream_options():
    req = Request("r", [1, 2, 3])
    out = generate_request(req, "m", {"stream": True, "stream_options": {"a": math.nan, "include_usage": True,
                                                                           "continuous_usage_stats": "yes"}})
    assert out["stream_options"] == {"include_usage": True}
    assert json_response(out).status_code == 200  # NaN once made this a 500
