"""Breaker finding on remote models (issue 35's bad input: "an upstream that streams forever").

An upstream that keeps its stream alive with SSE comments and empty deltas (no content) held a
request without end: ``max_tokens`` counts only content pieces and the 300 s silence bound
(httpx's read timeout) is reset by every byte. Found by hand: ``/v1/chat/completions`` for such a
model with ``max_tokens`` 5 was still open after 90 s. The silence bound must count time without
an answer piece, not without bytes.

The upstream is a real HTTP server on 127.0.0.1 (a thread); the bound is lowered to 1 s.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvserve.errors import BadGatewayError
from kvserve.remote import RemoteRunner, parse_remote
from kvserve.serving.args import parse_args
from kvserve.serving.chat_request import ChatRequest


@pytest.fixture
def pinger():
    stop = threading.Event()

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            empty = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "up",
                     "choices": [{"index": 0, "delta": {}, "finish_reason": None}]}
            try:
                while not stop.is_set():
                    self.wfile.write(f": keepalive\n\ndata: {json.dumps(empty)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(0.1)
            except OSError:
                pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    stop.set()
    srv.shutdown()
    srv.server_close()


def test_keepalive_only_stream_is_cut_by_the_silence_bound(pinger, monkeypatch):
    import kvserve.remote.runner as R

    monkeypatch.setattr(R, "READ_TIMEOUT_S", 1.0)
    r = RemoteRunner(parse_remote(f"up={pinger}"), parse_args([]))
    plan = r.plan_chat(ChatRequest([{"role": "user", "content": "hi"}], "chatcmpl-1",
                                   sampling={"n_predict": 5}))

    async def run():
        async for _ in r.chat_events(plan, whole=True):
            pass

    t0 = time.monotonic()
    try:
        with pytest.raises(BadGatewayError) as e:
            asyncio.run(asyncio.wait_for(run(), 10))
    finally:
        r.close()
    assert time.monotonic() - t0 < 5
    assert str(e.value) == "remote model 'up': the upstream sent nothing for 1 s"
