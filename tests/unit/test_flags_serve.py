"""Command lines copied from llama-server's and vLLM's documentation start kvserve and serve
(issue #15): one server per line on the tiny random model, a free loopback port, /health and
one completion, stopped by pid. The llama-server line also serves HTTPS (--ssl-key-file /
--ssl-cert-file through uvicorn), logs to --log-file and sleeps after --sleep-idle-seconds."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(argv: list[str], log: Path, url: str, verify=True) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for k in list(env):
        if k.startswith(("LLAMA_ARG_", "VLLM_")):
            env.pop(k)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvserve", "serve", *argv], stdout=out,
                                stderr=subprocess.STDOUT, cwd=REPO, env=env)
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        try:
            if httpx.get(url + "/health", timeout=2, verify=verify).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            _stop(proc)
            pytest.fail("server not ready:\n" + log.read_text(errors="replace"))
        time.sleep(0.1)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _cert(tmp: Path) -> tuple[str, str]:
    key, cert = tmp / "key.pem", tmp / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return str(key), str(cert)


def test_llama_server_command_line(tiny_gguf, tmp_path):
    key, cert = _cert(tmp_path)
    port = _free_port()
    url = f"https://127.0.0.1:{port}"
    logfile = tmp_path / "kv.log"
    # llama-server's README style: model, context, GPU layers, flash attention, slots, threads, batching,
    # the web UI off, metrics, TLS, a log file, sleeping when idle
    argv = ["-m", tiny_gguf, "-c", "512", "-ngl", "99", "-fa", "on", "-np", "1", "-t", "1", "-tb", "1",
            "-b", "256", "-ub", "256", "-cb", "--mlock", "--no-mmap", "-kvu", "--jinja", "--no-webui",
            "--metrics", "-a", "tiny", "--temp", "0.7", "--top-k", "40", "-to", "60", "--offline",
            "--host", "127.0.0.1", "--port", str(port), "--ssl-key-file", key, "--ssl-cert-file", cert,
            "--log-file", str(logfile), "--sleep-idle-seconds", "1"]
    log = tmp_path / "out.log"
    proc = _start(argv, log, url, verify=False)
    try:
        with httpx.Client(verify=False, timeout=60) as c:
            r = c.post(url + "/completion", json={"prompt": "hello", "n_predict": 3, "temperature": 0})
            assert r.status_code == 200, r.text
            first = r.json()
            assert first["tokens_predicted"] == 3
            deadline = time.monotonic() + 30
            while "unload 'tiny' (idle for --sleep-idle-seconds)" not in logfile.read_text(errors="replace"):
                assert time.monotonic() < deadline, logfile.read_text(errors="replace")
                time.sleep(0.2)
            assert c.get(url + "/health").status_code == 200  # asleep, not loading
            again = c.post(url + "/completion", json={"prompt": "hello", "n_predict": 3, "temperature": 0})
            assert again.status_code == 200, again.text
            assert again.json()["content"] == first["content"]
        text = logfile.read_text(errors="replace")
        assert "flag -ngl 99: no effect here" in text
        assert "flag -fa on: no effect here" in text
        assert "flag -cb: no effect here: continuous batching is always on" in text
        assert text.count("model manager: load 'tiny'") == 2
        assert f"listening on https://127.0.0.1:{port}" in text
        with pytest.raises(httpx.HTTPError):  # TLS only: plain HTTP gets no answer
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        _stop(proc)


def test_vllm_serve_command_line(tiny_gguf, tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    # vLLM's docs style (vllm serve MODEL ...); the positional model comes first
    argv = [tiny_gguf, "--served-model-name", "tiny-vllm", "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "512", "--gpu-memory-utilization", "0.9", "--enable-prefix-caching",
            "--max-num-seqs", "2", "--max-num-batched-tokens", "256", "--block-size", "32",
            "--tensor-parallel-size", "1", "--dtype", "auto", "--trust-remote-code", "--enforce-eager",
            "--disable-log-requests", "--uvicorn-log-level", "warning", "--api-key", "token-abc123",
            "--seed", "0", "--swap-space", "4", "--enable-chunked-prefill", "--generation-config", "vllm",
            "--kv-cache-dtype", "auto", "--max-logprobs", "5"]
    log = tmp_path / "out.log"
    proc = _start(argv, log, url)
    try:
        r = httpx.post(url + "/v1/completions", timeout=60, headers={"Authorization": "Bearer token-abc123"},
                       json={"model": "tiny-vllm", "prompt": "hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "tiny-vllm"
        assert body["usage"]["completion_tokens"] == 3
        assert httpx.post(url + "/v1/completions", timeout=60, json={"model": "tiny-vllm", "prompt": "x"}
                          ).status_code == 401
        text = log.read_text(errors="replace")
        assert "flag --tensor-parallel-size" not in text  # a real flag now (kvserve.engine.parallel): no note
        assert "flag --enable-prefix-caching: no effect here: prefix caching is always on" in text
    finally:
        _stop(proc)
