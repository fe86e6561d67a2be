"""A stand-in engine for the supervised-engine tests (a mock: real engines such as llama-server
or ``vllm serve`` cannot be built or run in CI; the by-hand check with llama-server is in the
issue's closing note). It behaves as llama-server does where the supervisor looks:

- prints ``loading model`` (``loading model PATH`` with ``--model PATH``), then listens on 127.0.0.1:PORT and prints ``listening``;
- ``GET /health`` answers 503 ``{"error": ...loading...}`` for its first ``--loading N`` polls,
  then 200 (``--never-healthy``: 503 forever);
- ``GET /v1/models`` lists one model ``standin``;
- ``POST /v1/chat/completions`` answers ``hello from pid PID`` (streamed as SSE with
  ``"stream": true``) with usage;
- SIGTERM prints ``received SIGTERM, shutting down`` and exits 143 (``--ignore-term``: ignores
  it, so only SIGKILL stops it);
- ``--exit N``: prints ``cannot load model`` and exits with N at once.

Run: ``python engine_standin.py --port PORT [--loading 2] [--never-healthy] [--exit N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--loading", type=int, default=2)
    p.add_argument("--never-healthy", action="store_true")
    p.add_argument("--exit", type=int, default=None)
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--model", default=None)
    a = p.parse_args()
    print("loading model" + (f" {a.model}" if a.model else ""), flush=True)
    if a.exit is not None:
        print("cannot load model", flush=True)
        sys.exit(a.exit)
    polls = [0]
    lock = threading.Lock()
    answer = f"hello from pid {os.getpid()}"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet: the test reads the supervisor's log lines
            pass

        def send(self, code: int, body: dict | None) -> None:
            data = json.dumps(body).encode() if body is not None else b""
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                with lock:
                    polls[0] += 1
                    n = polls[0]
                if a.never_healthy or n <= a.loading:
                    self.send(503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
                else:
                    self.send(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self.send(200, {"object": "list", "data": [{"id": "standin", "object": "model"}]})
            else:
                self.send(404, {"error": "not found"})

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n) or b"{}")
            if self.path != "/v1/chat/completions":
                self.send(404, {"error": "not found"})
                return
            usage = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
            if not body.get("stream"):
                self.send(200, {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "standin",
                                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                                             "finish_reason": "stop"}], "usage": usage})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            words = answer.split(" ")
            for i, w in enumerate(words):
                piece = w if i == 0 else " " + w
                chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "standin",
                         "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            last = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "standin",
                    "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage}
            self.wfile.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
            self.wfile.flush()

    server = ThreadingHTTPServer(("127.0.0.1", a.port), Handler)

    def on_term(signum, frame):
        if a.ignore_term:
            return
        print("received SIGTERM, shutting down", flush=True)
        os._exit(143)

    signal.signal(signal.SIGTERM, on_term)
    print("listening", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
