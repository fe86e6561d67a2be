"""Stand-in upstream servers for the remote-model tests (tests/api/test_remote.py): small HTTP
servers on 127.0.0.1 that play what cannot be a real kvserve there. Run as a script:
``python tests/remote_standin.py MODE PORT``. They are stand-ins, not mocks of kvserve's code:
kvserve talks to them over real sockets.

Modes:

- ``ollama``: speaks only Ollama's ``GET /api/tags`` and ``POST /api/chat`` (NDJSON streams;
  ``stream: false`` gives one object). Its models answer deterministically:

  - ``echo``: ``"echo: " + the last user message``, streamed 4 characters a line, the final line
    with ``prompt_eval_count`` (words in all messages) and ``eval_count`` (lines sent). With
    ``tools`` it calls the first tool once with ``{"path": <first enum value or "x">}``; with a
    ``format`` it answers ``{"echo": <the last user message>}``; ``think`` true adds ``thinking``
    ``"hmm"`` first;
  - ``nousage``: as ``echo`` without the counts (kvserve then estimates them);
  - ``forever``: a line ``"x"`` every 10 ms until the client leaves (counted: ``GET /stats``);
  - ``huge``: one 100 MB JSON line, written 1 MiB at a time (stops when the client leaves);
  - ``die``: two lines, then the connection is cut (no final line);
  - anything else: 404 ``{"error": "model 'x' not found"}``.

  ``GET /last`` returns the last ``/api/chat`` body; ``GET /stats`` ``{"disconnects": n}``.
- ``reject``: every request gets 401 ``{"error": "Unauthorized"}`` (vLLM's answer to a bad key).
- ``redirect``: every request gets 307 to the same path on another host (``127.0.0.2``).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STATE = {"last": None, "disconnects": 0}
LOCK = threading.Lock()


def _last_user(messages: list) -> str:
    for m in reversed(messages or []):
        if isinstance(m, dict) and m.get("role") == "user":
            return str(m.get("content") or "")
    return ""


def _tool_args(tool: dict) -> dict:
    props = ((tool.get("function") or {}).get("parameters") or {}).get("properties") or {}
    for k, v in props.items():
        return {k: (v.get("enum") or ["x"])[0]}
    return {}


class Handler(BaseHTTPRequestHandler):
    mode = "ollama"
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):  # quiet
        pass

    def _send(self, status: int, obj, headers: dict | None = None) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _other(self) -> bool:
        if self.mode == "reject":
            self._send(401, {"error": "Unauthorized"})
            return True
        if self.mode == "redirect":
            port = self.server.server_address[1]
            self._send(307, {}, {"Location": f"http://127.0.0.2:{port}{self.path}"})
            return True
        return False

    def do_GET(self):
        if self._other():
            return
        if self.path == "/api/tags":
            self._send(200, {"models": [{"name": n, "model": n} for n in ("echo", "nousage", "forever", "huge",
                                                                             "die")]})
        elif self.path == "/last":
            self._send(200, STATE["last"])
        elif self.path == "/stats":
            self._send(200, {"disconnects": STATE["disconnects"]})
        else:
            self._send(404, {"error": "404 page not found"})

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n)
        if self._other():
            return
        if self.path != "/api/chat":
            self._send(404, {"error": "404 page not found"})
            return
        body = json.loads(raw)
        with LOCK:
            STATE["last"] = body
        model = body.get("model")
        if model not in ("echo", "nousage", "forever", "huge", "die"):
            self._send(404, {"error": f"model '{model}' not found"})
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            getattr(self, "_" + model if model != "nousage" else "_echo")(body, model)
        except (BrokenPipeError, ConnectionResetError):
            with LOCK:
                STATE["disconnects"] += 1
        self.close_connection = True

    def _line(self, obj) -> None:
        self.wfile.write(json.dumps(obj).encode() + b"\n")
        self.wfile.flush()

    def _msg(self, model: str, **message) -> dict:
        return {"model": model, "created_at": "2026-01-01T00:00:00Z",
                "message": {"role": "assistant", "content": "", **message}, "done": False}

    def _echo(self, body: dict, model: str) -> None:
        user = _last_user(body.get("messages"))
        sent = 0
        if body.get("think") is True:
            self._line(self._msg(model, thinking="hmm"))
            sent += 1
        if body.get("tools"):
            tool = body["tools"][0]
            self._line(self._msg(model, tool_calls=[{"function": {"name": tool["function"]["name"],
                                                                  "arguments": _tool_args(tool)}}]))
            sent += 1
        else:
            text = json.dumps({"echo": user}) if body.get("format") else "echo: " + user
            for i in range(0, len(text), 4):
                self._line(self._msg(model, content=text[i:i + 4]))
                sent += 1
        final = {"model": model, "created_at": "2026-01-01T00:00:00Z",
                 "message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "stop"}
        if model == "echo":
            words = sum(len(str(m.get("content") or "").split()) for m in body.get("messages") or [])
            final.update(prompt_eval_count=words, eval_count=sent)
        self._line(final)

    def _forever(self, body: dict, model: str) -> None:
        while True:
            self._line(self._msg(model, content="x"))
            time.sleep(0.01)

    def _huge(self, body: dict, model: str) -> None:
        self.wfile.write(b'{"model": "huge", "message": {"role": "assistant", "content": "')
        chunk = b"a" * (1 << 20)
        for _ in range(100):
            self.wfile.write(chunk)
            self.wfile.flush()
        self.wfile.write(b'"}, "done": true}\n')

    def _die(self, body: dict, model: str) -> None:
        self._line(self._msg(model, content="one "))
        self._line(self._msg(model, content="two "))
        self.wfile.flush()
        self.connection.shutdown(2)


def main() -> None:
    mode, port = sys.argv[1], int(sys.argv[2])
    Handler.mode = mode
    srv = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    srv.daemon_threads = True
    print(f"standin {mode} on {port}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
