"""Breaker finding on supervised engines (issue 35's bad input: "a child engine that never becomes
healthy").

Found by hand: ``kvserve serve --engine 'junk=python3 -c "<an HTTP server answering 404>" {port}'``,
a request for ``junk`` (the client gave up after 20 s), then SIGTERM: kvserve did not exit; it
kept polling the child's ``/v1/models`` once a second (the start timeout is 600 s) and logged no
shutdown. The same server's later request for another engine waited behind that start. Fixed: SIGTERM sets
kvserve.supervisor.child.abandon_starts (Drain.on_begin), and the start loop gives up at its next poll.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

import httpx
import pytest
from servers import spawn

JUNK = (f"junk={sys.executable} -c \"import http.server,sys; http.server.HTTPServer(('127.0.0.1', "
        f"int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()\" {{port}}")


@pytest.mark.slow
def test_sigterm_while_an_engine_never_becomes_healthy(tmp_path):
    srv = spawn("", ("--no-preload", "--engine", JUNK), tmp_path)
    try:
        srv.wait_ready()

        def ask():
            try:
                httpx.post(srv.url("/v1/chat/completions"), timeout=30,
                           json={"model": "junk", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            except httpx.HTTPError:
                pass

        threading.Thread(target=ask, daemon=True).start()
        deadline = time.monotonic() + 30
        while "GET /v1/models" not in srv.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "GET /v1/models" in srv.log()  # the child is up and being polled
        srv.proc.send_signal(signal.SIGTERM)
        try:
            code = srv.proc.wait(timeout=15)
        except Exception:  # noqa: BLE001 - still running: the finding
            code = None
        assert code is not None, "kvserve still running 15 s after SIGTERM"
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait(timeout=10)
