"""Issue #11 on the real model: prompts that cannot fit are refused from their length, large
tokenizations run off the event loop, and a body over --max-request-bytes is 413 unread."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx

BIG = 8_000_000  # characters: > 2048 tokens x 81 bytes (SmolLM2's longest token) many times over


def _refused(r: httpx.Response, at_least: int) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == 2048
    assert err["n_prompt_tokens"] >= at_least


def test_big_prompts_are_refused_quickly(smollm2_server):
    url = smollm2_server.url
    t0 = time.monotonic()
    r = httpx.post(url("/completion"), json={"prompt": "hello world " * (BIG // 12), "n_predict": 1}, timeout=60)
    _refused(r, BIG // 81)
    assert "at least" in r.json()["error"]["message"]
    r = httpx.post(url("/v1/chat/completions"), timeout=60,
                   json={"messages": [{"role": "user", "content": "x" * BIG}], "max_tokens": 1})
    _refused(r, BIG // 81)
    r = httpx.post(url("/v1/completions"), json={"prompt": "y" * BIG, "max_tokens": 1}, timeout=60)
    _refused(r, BIG // 81)
    r = httpx.post(url("/completion"), json={"prompt": [1] * 1_000_000, "n_predict": 1}, timeout=60)
    _refused(r, 1_000_000)
    assert r.json()["error"]["n_prompt_tokens"] == 1_000_000  # ids are counted exactly
    assert time.monotonic() - t0 < 20  # tokenizing one of these alone took ~10 s before
    r = httpx.post(url("/completion"), json={"prompt": "Hi", "n_predict": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 2


def test_large_tokenize_does_not_block_other_requests(smollm2_server):
    url = smollm2_server.url
    # 2.03 MB, under --max-input-bytes (2 MiB by default; larger texts are a 400 before any
    # tokenizing): seconds of tokenizing
    text = "hello world, this is a test. " * 70_000
    result = {}

    def tokenize():
        result["r"] = httpx.post(url("/tokenize"), json={"content": text}, timeout=120)

    th = threading.Thread(target=tokenize)
    th.start()
    time.sleep(0.5)  # the tokenization is under way
    slowest = 0.0
    while th.is_alive():
        t0 = time.monotonic()
        assert httpx.get(url("/health"), timeout=30).status_code == 200
        slowest = max(slowest, time.monotonic() - t0)
        time.sleep(0.05)
    th.join()
    assert result["r"].status_code == 200 and len(result["r"].json()["tokens"]) > 500_000
    # before: the HF library's single encode held the GIL, and /health waited for the whole tokenization
    assert slowest < 2.0


def test_body_over_max_request_bytes_is_413_before_it_is_sent(smollm2_server):
    s = socket.create_connection(("127.0.0.1", smollm2_server.port), timeout=30)
    s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 40000000\r\n\r\n{\"prompt\": \"")
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ")
    assert json.loads(body) == {"error": {"code": 413, "type": "invalid_request_error",
                                          "message": "request body is larger than 33554432 bytes "
                                                     "(--max-request-bytes)"}}
