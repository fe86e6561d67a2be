"""Issue 31, Build 8, through a real server (SmolLM2): SIGTERM with a stream and a JSON request in flight.
The stream ends with a last error event, the JSON request gets the 503 envelope, the process exits;
nothing is cut without a word (the attack run saw streams cut with no final event and uvicorn's plain
500 for the others)."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

LONG = {"prompt": "Count from one to ten thousand: one, two,", "n_predict": 4000, "ignore_eos": True,
        "temperature": 0}


def test_sigterm_ends_every_request_in_its_dialect(start_server):
    srv = start_server("-np", "2", "--shutdown-timeout", "1")
    answers: dict[str, object] = {}

    def plain():
        r = httpx.post(srv.base_url + "/completion", json=LONG, timeout=60)
        answers["json"] = (r.status_code, r.json())

    t = threading.Thread(target=plain)
    t.start()
    lines = []
    with httpx.stream("POST", srv.base_url + "/v1/completions", json={**LONG, "stream": True, "max_tokens": 4000},
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == 3:
                t0 = time.monotonic()
                srv.proc.send_signal(signal.SIGTERM)
    t.join(30)
    assert time.monotonic() - t0 < 15
    assert json.loads(lines[-1].removeprefix("data: ")) == {
        "error": {"code": 503, "message": "the server is shutting down", "type": "unavailable_error"}}
    assert answers["json"] == (503, {"error": {"code": 503, "message": "the server is shutting down",
                                               "type": "unavailable_error"}})
    assert srv.proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    assert "Traceback" not in srv.log()
