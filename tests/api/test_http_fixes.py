"""Review fixes of the HTTP features (session 22, "fixhttp"): the render endpoints never load,
unload or touch a model's keep_alive; render / completions bounds; -v request-log escaping and
key masking; ``return_progress`` sends the chat role once; ``--cors-origins ''``,
``--response-role ''``, ``Vary: Origin``; ``/slots`` while the model sleeps.

Servers: the tiny random model (tests/tinymodel.py), 127.0.0.1, free ports, stopped by pid."""

from __future__ import annotations

import datetime
import time

import httpx
import pytest
import tinymodel
from servers import spawn


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    """A server with no ``-m``: two tiny GGUF files named by path (``--allow-model-paths``)."""
    d = tmp_path_factory.mktemp("fixhttp")
    a = str(tinymodel.write_tiny_gguf(d / "a.gguf"))
    b = str(tinymodel.write_tiny_gguf(d / "b.gguf"))
    home = d / "home"
    home.mkdir()
    srv = spawn("", ("--allow-model-paths", "-t", "1", "-c", "512"), d, {"KVSERVE_HOME": str(home)})
    try:
        srv.wait_ready()
        yield srv, a, b
    finally:
        srv.stop()


def _ps(base: str) -> dict[str, str]:
    return {m["name"]: m["expires_at"] for m in httpx.get(base + "/api/ps").json()["models"]}


def _t(go_time: str) -> float:
    """Seconds of a Go time (``2026-12-01T23:02:10.534410389Z``; nanoseconds cut to micro)."""
    head, _, frac = go_time.rstrip("Z").partition(".")
    return datetime.datetime.fromisoformat(head + "+00:00").timestamp() + float("0." + (frac or "0"))


def test_render_never_loads_unloads_or_changes_keep_alive(multi):
    srv, a, b = multi
    base = srv.base_url
    msgs = [{"role": "user", "content": "hi"}]
    # b is not loaded: 503 at once, and it stays unloaded
    t0 = time.monotonic()
    r = httpx.post(base + "/v1/chat/completions/render", json={"model": b, "messages": msgs}, timeout=30)
    assert time.monotonic() - t0 < 2.0
    assert r.status_code == 503
    assert r.json()["error"]["message"] == f"model '{b}' is not loaded"
    r = httpx.post(base + "/v1/completions/render", json={"model": b, "prompt": "ab"}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["message"] == f"model '{b}' is not loaded"
    assert b not in _ps(base)
    # a loaded for 10 minutes: a render with keep_alive 0 or 1h neither unloads it nor moves its expiry
    r = httpx.post(base + "/v1/completions", json={"model": a, "prompt": "ab", "max_tokens": 1, "keep_alive": "10m"},
                   timeout=60)
    assert r.status_code == 200, r.text
    before = _t(_ps(base)[a])
    for ka in (0, "1h"):
        r = httpx.post(base + "/v1/completions/render", json={"model": a, "prompt": "ab", "keep_alive": ka}, timeout=30)
        assert r.status_code == 200, r.text
        assert [x["token_ids"] for x in r.json()] == [[100, 101]]
        r = httpx.post(base + "/v1/chat/completions/render", json={"model": a, "messages": msgs, "keep_alive": ka},
                       timeout=30)
        assert r.status_code == 200, r.text
    ps = _ps(base)
    assert a in ps and b not in ps
    assert abs(_t(ps[a]) - before) < 1.0


def test_completion_request_count_bound(multi):
    srv, a, _ = multi
    base = srv.base_url
    httpx.post(base + "/v1/completions", json={"model": a, "prompt": "ab", "max_tokens": 1}, timeout=60)
    msg = ("Field 'prompt': 5000 prompts x n 128 = 640000 completions, more than 2048 per request "
           "(split the request)")
    for path in ("/v1/completions/render", "/v1/completions"):
        t0 = time.monotonic()
        r = httpx.post(base + path, json={"model": a, "prompt": ["x"] * 5000, "n": 128, "max_tokens": 1}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["message"] == msg
        r = httpx.post(base + path, json={"model": a, "prompt": [[5]] * 200000, "max_tokens": 1}, timeout=60)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == ("Field 'prompt': 200000 prompts x n 1 = 200000 completions, "
                                                "more than 2048 per request (split the request)")
        assert time.monotonic() - t0 < 5.0
    # at the bound: render plans one request per prompt (n does not change the ids)
    r = httpx.post(base + "/v1/completions/render", json={"model": a, "prompt": ["ab"] * 16, "n": 128}, timeout=60)
    assert r.status_code == 200
    assert [x["token_ids"] for x in r.json()] == [[100, 101]] * 16


# -- -v request log: escaping and masking (the middleware on a small ASGI app) ----------------

def _log_lines(caplog, path: str, body: bytes, secrets=("sekret",), client=("127.0.0.1", 5), answer=b"{}"):
    import asyncio
    import logging

    from kvserve.faces.http import RequestLogMiddleware

    async def app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": answer})

    sent = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return sent.pop(0) if sent else {"type": "http.disconnect"}

    async def send(msg):
        pass

    scope = {"type": "http", "method": "POST", "path": path, "client": client, "headers": []}
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        asyncio.run(RequestLogMiddleware(app, secrets)(scope, receive, send))
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(("done request", "request:", "response:"))]


def test_request_log_escapes_control_characters(caplog):
    lines = _log_lines(caplog, "/v1/models\nFAKE LINE\r\x1b[31m", b'{"a":1}', client=("1.2.3.4\nX", 9))
    assert lines == ["done request: POST /v1/models\\nFAKE LINE\\r\\x1b[31m 1.2.3.4\\nX 200",
                     'request:  {"a":1}', "response: {}"]


def test_request_log_masks_keys_across_the_cut_escaped_and_cache_salt(caplog):
    body = b"x" * 2045 + b"sekret tail"  # the key crosses the 2048-byte cut
    assert _log_lines(caplog, "/v1/completions", body)[1] == "request:  " + "x" * 2045 + "*** ... (8 more bytes)"
    body = b'{"prompt":"\\u0073ekret \\u0073EKRET","api":"s\\u0065kret","cache_salt":"tenant-a\\"b"}'
    assert _log_lines(caplog, "/v1/completions", body)[1] == (
        'request:  {"prompt":"*** \\u0073EKRET","api":"***","cache_salt":"***"}')
    body = b'{"cache_salt": "' + b"t" * 3000 + b'"}'  # cut inside the salt: nothing of it shown
    assert _log_lines(caplog, "/v1/completions", body)[1] == 'request:  {"cache_salt": "***" ... (970 more bytes)'


# -- --cors-origins '', --response-role '', Vary: Origin --------------------------------------

def _cors_answer(policy, origin: str | None, method: str = "GET") -> dict[str, str]:
    import asyncio

    from kvserve.faces.auth import CorsMiddleware

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    got = {}

    async def send(msg):
        if msg["type"] == "http.response.start":
            got.update((k.decode(), v.decode()) for k, v in msg["headers"])

    async def receive():
        return {"type": "http.request", "body": b""}

    headers = [(b"origin", origin.encode())] if origin is not None else []
    asyncio.run(CorsMiddleware(app, policy)({"type": "http", "method": method, "path": "/v1/models",
                                             "headers": headers}, receive, send))
    got.pop("content-type", None)
    got.pop("content-length", None)
    return got


def test_empty_cors_origins_allows_no_origin():
    from kvserve.faces.auth import cors_policy
    from kvserve.serving.args import parse_args

    args = parse_args(["m.gguf", "--cors-origins", ""], environ={})
    assert args.cors_origins == []
    assert _cors_answer(cors_policy(args), "http://evil.example") == {}
    assert _cors_answer(cors_policy(args), "http://evil.example", "OPTIONS") == {}
    assert parse_args(["m.gguf", "--allowed-origins", "[]"], environ={}).cors_origins == []
    assert parse_args(["m.gguf"], environ={}).cors_origins == ["*"]


def test_empty_response_role_is_refused(capsys):
    from kvserve.serving.args import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["m.gguf", "--response-role", ""], environ={})
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: --response-role: the role must not be empty (e.g. --response-role assistant)")


def test_vary_origin_on_every_answer_that_depends_on_it():
    from kvserve.faces.auth import CorsPolicy

    listed = CorsPolicy(["http://a.example"])
    assert _cors_answer(listed, "http://b.example") == {"vary": "Origin"}
    assert _cors_answer(listed, None) == {"vary": "Origin"}
    assert _cors_answer(listed, "http://b.example", "OPTIONS") == {"vary": "Origin"}
    assert _cors_answer(listed, "http://a.example") == {"access-control-allow-origin": "http://a.example",
                                                        "access-control-allow-credentials": "true", "vary": "Origin"}
    assert _cors_answer(CorsPolicy(["*"]), None) == {"vary": "Origin"}  # reflected while credentials are on
    assert _cors_answer(CorsPolicy(["*"], credentials=False), "http://b.example") == {
        "access-control-allow-origin": "*"}
    assert _cors_answer(CorsPolicy(["*"], credentials=False), None) == {}


def test_return_progress_chat_stream_role_once_with_the_openai_stream_helper(multi):
    openai = pytest.importorskip("openai")
    srv, a, _ = multi
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    roles = []
    with client.chat.completions.stream(model=a, messages=[{"role": "user", "content": "x" * 30}], max_tokens=2,
                                        temperature=0, extra_body={"return_progress": True,
                                                                   "cache_prompt": False}) as s:
        n_progress = 0
        for ev in s:
            if ev.type == "chunk":
                n_progress += "prompt_progress" in (ev.chunk.model_extra or {})
                roles += [c.delta.role for c in ev.chunk.choices if c.delta.role is not None]
        snapshot = s.current_completion_snapshot  # (get_final_completion refuses a length finish)
    assert n_progress >= 2
    assert roles == ["assistant"]
    assert snapshot.choices[0].message.role == "assistant"
