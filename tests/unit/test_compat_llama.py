"""llama-server compatibility details found by running llama.cpp's own server tests (issue 32, build 1)."""

from __future__ import annotations

import socket

import pytest

from kvserve.faces.head_case import HeadCaseTransport, title_case_head, title_case_name


def _raw(port: int, request: bytes) -> bytes:
    """One HTTP/1.1 exchange on a fresh connection (the server closes it: Connection: close)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(request)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    return data


# -- header names as llama-server writes them -------------------------------------------------

@pytest.mark.parametrize("name,want", [
    (b"content-type", b"Content-Type"), (b"access-control-allow-origin", b"Access-Control-Allow-Origin"),
    (b"vary", b"Vary"), (b"process-start-time-unix", b"Process-Start-Time-Unix"),
    (b"x-request-id", b"X-Request-Id"), (b"www-authenticate", b"WWW-Authenticate"), (b"etag", b"ETag"),
    (b"Content-Length", b"Content-Length"),
])
def test_title_case_name(name, want):
    assert title_case_name(name) == want


def test_title_case_head_touches_names_only():
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; charset=utf-8\r\nvary: origin\r\n\r\nbody: x\r\n"
    assert title_case_head(head) == \
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\nVary: origin\r\n\r\nbody: x\r\n"


class _Sink:
    def __init__(self):
        self.out: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def is_closing(self) -> bool:
        return self.closing


def test_transport_recases_the_response_head_only():
    sink = _Sink()
    t = HeadCaseTransport(sink)
    t.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 27\r\n\r\n")
    t.write(b"HTTP/1.1 200 OK\r\nx-body: 1\r\n")  # a body that looks like a head is left alone
    assert sink.out == [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 27\r\n\r\n",
                        b"HTTP/1.1 200 OK\r\nx-body: 1\r\n"]
    assert t.is_closing() is False  # everything else is the wrapped transport's


def test_live_server_writes_llama_server_header_names():
    from test_hardening_http import _Live, _state

    from kvserve.app import build_app

    with _Live(build_app(_state())) as live:
        data = _raw(live.port, b"GET /health HTTP/1.1\r\nHost: x\r\nOrigin: http://localhost:8080\r\n"
                               b"Connection: close\r\n\r\n")
        pre = _raw(live.port, b"OPTIONS /completion HTTP/1.1\r\nHost: x\r\nOrigin: http://localhost:8080\r\n"
                              b"Access-Control-Request-Method: POST\r\nConnection: close\r\n\r\n")
    head = data.partition(b"\r\n\r\n")[0].split(b"\r\n")
    names = [ln.partition(b":")[0] for ln in head[1:]]
    assert head[0] == b"HTTP/1.1 503 Service Unavailable"  # the model never loads in this state
    assert {b"Content-Type", b"Content-Length", b"Access-Control-Allow-Origin", b"Vary"} <= set(names), names
    assert all(n == title_case_name(n) for n in names), names
    pre_names = [ln.partition(b":")[0] for ln in pre.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]]
    assert {b"Access-Control-Allow-Origin", b"Access-Control-Allow-Methods", b"Access-Control-Allow-Headers",
            b"Vary"} <= set(pre_names), pre_names
