"""Issue 31, Build 4's last clause, through a real server: an embedding request whose client leaves,
or that SIGTERM's drain ends, stops computing. The attack run saw 10^6 rerank documents keep a core
busy 4.6 minutes after the client's timeout and hold SIGTERM off for 270 s.

A tiny random BERT (tests/embed_conftest.py) with ``-b 6``: every input ("the cat sat ." is 6
tokens with [CLS] and [SEP]) is one forward pass, counted by ``llamacpp:n_decode_total``. A request
of 20,000 inputs would take 20,000 passes; the client closes its socket once some have run, and
the count must then stop within a few passes of the close and stay still, while the next request
is answered (exactly its own 3 passes)."""

from __future__ import annotations

import json
import re
import signal
import socket
import time

import httpx
import pytest

from embed_conftest import write_tiny_bert
from servers import spawn

pytest.importorskip("transformers", reason="transformers is a test-only dependency ([test] extra)")

N_INPUTS = 20_000
TEXT = "the cat sat ."


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("cancel")
    model = write_tiny_bert(d / "tiny-bert", seed=3)
    s = spawn(str(model), ("-b", "6", "--max-batch-inputs", str(N_INPUTS), "--metrics", "--shutdown-timeout", "1",
                           "--models-dir", str(d / "models")), d)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def n_decode(srv) -> int:
    text = httpx.get(srv.url("/metrics"), timeout=30).text
    return int(re.search(r"^llamacpp:n_decode_total (\d+)$", text, re.M).group(1))


def send_raw(srv, path: str, body: dict) -> socket.socket:
    """POST ``body`` on a new connection and return the socket without reading the answer."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def wait_running(srv, start: int, timeout: float = 60.0) -> int:
    """Poll until more than ``start`` + 20 passes have run (the big request is computing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = n_decode(srv)
        if n > start + 20:
            return n
        time.sleep(0.05)
    pytest.fail(f"the request did not start computing:\n{srv.log()[-3000:]}")


def settled(srv) -> int:
    """n_decode_total once it has not moved for one second."""
    last = n_decode(srv)
    for _ in range(30):
        time.sleep(1.0)
        now = n_decode(srv)
        if now == last:
            return now
        last = now
    pytest.fail("n_decode_total never stopped moving")


@pytest.mark.parametrize("path,body", [
    ("/v1/embeddings", {"input": [TEXT] * N_INPUTS}),
    ("/api/embed", {"model": "tiny-bert", "input": [TEXT] * N_INPUTS}),
], ids=["openai", "ollama"])
def test_disconnect_stops_the_batches(srv, path, body):
    if path == "/api/embed":  # Ollama names the model; the server's -m is served as its directory's name
        body = {**body, "model": httpx.get(srv.url("/v1/models"), timeout=30).json()["data"][0]["id"]}
    start = settled(srv)
    sock = send_raw(srv, path, body)
    at_close = wait_running(srv, start)
    sock.close()
    stopped = settled(srv)
    print(f"{path}: passes before {start}, at the close {at_close}, settled {stopped} of {N_INPUTS}")
    # one poll of the disconnect watch (0.25 s) at most: far fewer than the 20,000 passes left
    assert stopped - start < N_INPUTS // 4, (start, at_close, stopped)
    r = httpx.post(srv.url("/v1/embeddings"), json={"input": [TEXT, TEXT, TEXT]}, timeout=60)
    assert r.status_code == 200 and len(r.json()["data"]) == 3
    assert n_decode(srv) == stopped + 3  # the other request ran its own 3 passes, the left one none
    assert "Traceback" not in srv.log()


def test_sigterm_ends_the_batches(srv):
    """SIGTERM with the big request in flight: the drain (--shutdown-timeout 1) answers it 503 and
    cancels its batches, so the process exits in seconds (it would compute the rest first)."""
    start = settled(srv)
    sock = send_raw(srv, "/v1/embeddings", {"input": [TEXT] * N_INPUTS})
    wait_running(srv, start)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        answer += chunk
    sock.close()
    assert answer.startswith(b"HTTP/1.1 503"), answer[:300]
    assert answer.split(b"\r\n\r\n", 1)[1] == (b'{"error":{"code":503,"message":"the server is shutting down",'
                                               b'"type":"unavailable_error"}}')
    assert srv.proc.wait(timeout=30) in (0, -signal.SIGTERM)
    assert time.monotonic() - t0 < 15
    assert "Traceback" not in srv.log()
