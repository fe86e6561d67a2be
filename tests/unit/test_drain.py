"""Issue 31, Build 8: SIGTERM with requests in flight. DrainMiddleware on fake ASGI apps (a stream that
never ends, a slow JSON answer, a quick one), then a real ``kvserve serve`` process stopped with SIGTERM."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvserve.faces.drain import SHUTTING_DOWN, Drain, DrainMiddleware


def _scope(path: str) -> dict:
    return {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": []}


async def _receive():
    await asyncio.sleep(3600)


def _stream_app(ctype: bytes, chunk: bytes):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype)]})
        while True:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await asyncio.sleep(0.02)
    return app


async def _slow_json(scope, receive, send):
    await asyncio.sleep(3600)


def _quick_after(seconds: float):
    async def app(scope, receive, send):
        await asyncio.sleep(seconds)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"ok":true}'})
    return app


def _run(app, path: str, grace: float = 0.2, begin_after: float = 0.1, before: bool = False):
    """Run one request through DrainMiddleware; drain begins ``begin_after`` s in (or before it)."""
    sent: list[dict] = []
    drain = Drain(grace)

    async def send(msg):
        sent.append(msg)

    async def go():
        if before:
            drain.expired()
            drain.begin()
        task = asyncio.ensure_future(DrainMiddleware(app, drain)(_scope(path), _receive, send))
        await asyncio.sleep(begin_after)
        drain.begin()
        await asyncio.wait_for(task, 5)

    asyncio.run(go())
    return sent


def _body(sent):
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


@pytest.mark.parametrize("path,ctype,chunk,last", [
    ("/v1/chat/completions", b"text/event-stream", b"data: {}\n\n",
     b'data: {"error":{"code":503,"message":"the server is shutting down","type":"unavailable_error"}}\n\n'),
    ("/v1/messages", b"text/event-stream", b"event: ping\ndata: {}\n\n",
     b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
     b'"message":"the server is shutting down"}}\n\n'),
    ("/api/chat", b"application/x-ndjson", b'{"done":false}\n', b'{"error":"the server is shutting down"}\n'),
])
def test_a_stream_still_running_at_the_deadline_ends_with_an_error_event(path, ctype, chunk, last):
    sent = _run(_stream_app(ctype, chunk), path)
    assert sent[0]["status"] == 200
    assert sent[-1] == {"type": "http.response.body", "body": last, "more_body": False}
    assert _body(sent[:-1]).startswith(chunk)


@pytest.mark.parametrize("path,body", [
    ("/completion", {"error": {"code": 503, "message": SHUTTING_DOWN, "type": "unavailable_error"}}),
    ("/api/generate", {"error": SHUTTING_DOWN}),
    ("/v1/messages", {"type": "error", "error": {"type": "overloaded_error", "message": SHUTTING_DOWN}}),
])
def test_a_json_answer_not_ready_at_the_deadline_is_a_503_in_its_dialect(path, body):
    sent = _run(_slow_json, path)
    assert sent[0]["status"] == 503 and (b"connection", b"close") in sent[0]["headers"]
    assert json.loads(_body(sent)) == body


def test_a_request_that_finishes_within_the_grace_ends_as_usual():
    sent = _run(_quick_after(0.2), "/completion", grace=1.0)
    assert sent[0]["status"] == 200 and _body(sent) == b'{"ok":true}'


def test_a_request_arriving_while_draining_is_refused():
    sent = _run(_quick_after(0.0), "/api/tags", before=True, begin_after=0.0)
    assert sent[0]["status"] == 503 and json.loads(_body(sent)) == {"error": SHUTTING_DOWN}


# -- idle and slow connections (slowloris) ----------------------------------------------------------

def _live(monkeypatch, *flags: str, **consts):
    """A real uvicorn serving an app of ``kvserve serve FLAGS`` (flags reach uvicorn as in
    ``kvserve serve``); ``consts`` patch kvserve.faces.http (``BODY_IDLE_S``)."""
    import kvserve.app as app_mod
    import kvserve.faces.http as http_mod
    from test_hardening_http import _Live, _state

    for name, value in consts.items():
        monkeypatch.setattr(http_mod, name, value)
    state = _state(*flags)
    return _Live(app_mod.build_app(state), state.args)


def _closed_within(sock, seconds: float) -> bytes:
    import time

    sock.settimeout(seconds)
    data = b""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    raise AssertionError("still open")


def test_half_open_and_slow_header_connections_are_closed(monkeypatch):
    import socket

    with _live(monkeypatch, "--header-timeout", "0.5") as live:
        idle = socket.create_connection(("127.0.0.1", live.port))
        slow = socket.create_connection(("127.0.0.1", live.port))
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finishes its head
        assert _closed_within(idle, 5) == b"" and _closed_within(slow, 5) == b""
        ok = socket.create_connection(("127.0.0.1", live.port))  # a whole head in time is served
        ok.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        ok.settimeout(5)
        assert ok.recv(65536).startswith(b"HTTP/1.1 503 ")  # the model is loading
        for s in (idle, slow, ok):
            s.close()


def test_connections_beyond_the_cap_are_closed(monkeypatch):
    import socket

    with _live(monkeypatch, "--limit-concurrency", "3") as live:
        socks = [socket.create_connection(("127.0.0.1", live.port)) for _ in range(3)]
        extra = socket.create_connection(("127.0.0.1", live.port))
        assert _closed_within(extra, 5) == b""
        socks[0].sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # the first three are served
        socks[0].settimeout(5)
        assert socks[0].recv(65536).startswith(b"HTTP/1.1 503 ")
        for s in (*socks, extra):
            s.close()


def test_connection_bounds_default_and_refuse_bad_values():
    from kvserve.faces.connections import HEADER_TIMEOUT_S, MAX_CONNECTIONS
    from kvserve.serving.args import parse_args

    a = parse_args([])
    assert (a.header_timeout, a.limit_concurrency) == (HEADER_TIMEOUT_S, MAX_CONNECTIONS) == (30.0, 4096)
    b = parse_args(["--header-timeout", "2.5", "--limit-concurrency", "64", "--timeout-keep-alive", "7"])
    assert (b.header_timeout, b.limit_concurrency, b.timeout) == (2.5, 64, 7.0)
    for argv in (["--header-timeout", "0"], ["--limit-concurrency", "0"]):
        with pytest.raises(SystemExit):
            parse_args(argv)


def test_a_body_that_stops_arriving_is_408(monkeypatch):
    import socket

    with _live(monkeypatch, BODY_IDLE_S=0.5) as live:
        s = socket.create_connection(("127.0.0.1", live.port))
        s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"content\": ")
        s.settimeout(10)
        data = s.recv(65536)
        s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert json.loads(body)["error"]["message"] == "the request body sent nothing for 0.5 s"


def test_a_body_trickling_in_is_408_at_its_deadline(monkeypatch):
    """One byte every 0.3 s never trips the idle timeout (5 s here) but the body must be whole
    within BODY_DEADLINE_S (+ 1 s per BODY_MIN_RATE bytes): 408 about 1 s after the first read."""
    import socket
    import time

    with _live(monkeypatch, BODY_IDLE_S=5.0, BODY_DEADLINE_S=1.0, BODY_MIN_RATE=10**9) as live:
        s = socket.create_connection(("127.0.0.1", live.port))
        s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{")
        s.settimeout(0.3)
        t0, data = time.monotonic(), b""
        while time.monotonic() - t0 < 8 and not data:
            try:
                data = s.recv(65536)
            except socket.timeout:
                s.sendall(b" ")
        elapsed = time.monotonic() - t0
        s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), data
    assert 0.9 < elapsed < 4
    assert json.loads(body)["error"]["message"] == ("the request body arrived too slowly (it must be whole within 1 s "
                                                    "plus 1 s per 1000000000 bytes)")


def test_a_responses_stream_ends_with_a_responses_error_event():
    """Review 6: /v1/responses' last event at the deadline is the Responses API's ``error`` event, numbered one
    past the last event sent (a delta whose text holds an escaped "sequence_number" does not count)."""
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        n = 0
        while True:
            ev = {"type": "response.output_text.delta", "sequence_number": n, "delta": '"sequence_number":999'}
            await send({"type": "http.response.body", "more_body": True,
                        "body": f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n".encode()})
            n += 1
            await asyncio.sleep(0.02)

    sent = _run(app, "/v1/responses")
    n_events = _body(sent[:-1]).count(b"event: response.output_text.delta")
    assert n_events >= 2
    last = sent[-1]["body"]
    assert last.startswith(b"event: error\ndata: ") and last.endswith(b"\n\n")
    assert json.loads(last[len(b"event: error\ndata: "):]) == {
        "type": "error", "code": "unavailable_error", "message": SHUTTING_DOWN, "param": None,
        "sequence_number": n_events}
