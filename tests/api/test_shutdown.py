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


@pytest.mark.parametrize("after_s", [0.5, None])
def test_ctrl_c_in_start_up_or_after_it_exits_130_without_a_traceback(tiny_gguf, tmp_path, after_s):
    """SIGINT (Ctrl-C) while ``kvserve serve`` imports or loads (0.5 s), or once it is serving (None:
    after /health answers): exit status 130 and one line, never a Python traceback (it printed one from
    inside the imports, wrapped in whatever module was loading)."""
    import os
    import subprocess
    import sys

    from servers import REPO, free_port

    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # the child takes SIGINT's default action (a shell's background job would ignore it)
    p = subprocess.Popen([sys.executable, "-m", "kvserve", "serve", tiny_gguf, "--host", "127.0.0.1", "--port",
                          str(port), "-c", "256", "-np", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         cwd=REPO, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        if after_s is None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert p.poll() is None
                time.sleep(0.2)
            else:
                pytest.fail("no /health 200 in 120 s")
        else:
            time.sleep(after_s)
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    text = out.decode(errors="replace")
    assert p.returncode == 130, text[-2000:]
    assert "Traceback" not in text and text.rstrip().endswith("kvserve: interrupted"), text[-2000:]
