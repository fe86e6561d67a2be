"""POST /api/blobs under load (review of #13: six concurrent slow uploads took every worker thread
and the server hung for good)."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time

import httpx


def _slow_body(data: bytes, pieces: int = 8, pause: float = 0.25):
    step = -(-len(data) // pieces)
    for i in range(0, len(data), step):
        time.sleep(pause)
        yield data[i:i + step]


def test_concurrent_slow_uploads_leave_the_server_serving(start_server, tmp_path):
    home = tmp_path / "home"
    srv = start_server("--no-preload", model="", env={"KVSERVE_HOME": str(home)})
    blobs = [os.urandom(300_000 + i) for i in range(6)]
    codes: list[int] = []

    def upload(data: bytes) -> None:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        r = httpx.post(f"{srv.base_url}/api/blobs/{digest}", content=_slow_body(data), timeout=60)
        codes.append(r.status_code)

    threads = [threading.Thread(target=upload, args=(b,)) for b in blobs]
    for t in threads:
        t.start()
    time.sleep(0.6)  # all six are sending
    t0 = time.monotonic()
    r = httpx.get(srv.base_url + "/api/tags", timeout=10)
    assert r.status_code == 200 and time.monotonic() - t0 < 5
    for t in threads:
        t.join(60)
    assert sorted(codes) == [201, 201, 201, 201, 503, 503]  # at most four at once
    # a wrong digest: 400, and nothing left in blobs/
    data = os.urandom(1000)
    r = httpx.post(f"{srv.base_url}/api/blobs/sha256:{'0' * 64}", content=data, timeout=30)
    assert r.status_code == 400 and r.json()["error"].startswith("digest mismatch")
    # a client that leaves mid-body leaves no file either
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    s.sendall(f"POST /api/blobs/sha256:{'1' * 64} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\n"
              .encode() + b"x" * 5000)
    time.sleep(0.3)
    s.close()
    time.sleep(0.5)
    left = [p.name for p in (home / "models" / "blobs").iterdir()]
    assert sorted(p for p in left if not p.startswith("sha256-")) == []
    assert len([p for p in left if p.startswith("sha256-")]) == 4
    assert httpx.get(srv.base_url + "/api/tags", timeout=10).status_code == 200
