"""Fixtures that run real ``kvserve serve`` processes on 127.0.0.1 (free ports).

``start_server(*args, model=None, wait=True)`` (per test) and ``start_server_module`` (per
module) start one and wait for /health 200 (120 s at most, failing with the server's log);
every process is terminated at teardown. ``smollm2_server`` is one shared server (``-np 2 -c 4096 --metrics``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
HEALTH_TIMEOUT_S = 120.0


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A running ``kvserve serve`` process."""

    base_url: str
    proc: subprocess.Popen
    log_path: Path
    port: int

    def log(self) -> str:
        """Everything the server wrote to stdout/stderr so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def url(self, path: str) -> str:
        return self.base_url + path

    def wait_ready(self, timeout: float = HEALTH_TIMEOUT_S) -> None:
        """Poll /health until 200; fail with the log on timeout or exit."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url("/health"), timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        pytest.fail(f"server not ready after {timeout} s:\n{self.log()}")

    def stop(self) -> None:
        """Terminate (then kill) the process."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _spawn(model: str, args: tuple[str, ...], logdir: Path, env_extra: dict | None = None) -> Server:
    """Start ``kvserve serve [model] ...``; ``model`` "" starts it with no ``-m`` (several models)."""
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="kvserve-", suffix=".log", dir=logdir)[1])
    cmd = [sys.executable, "-m", "kvserve", "serve", *([model] if model else []), "--host", "127.0.0.1",
           "--port", str(port), *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    return Server(f"http://127.0.0.1:{port}", proc, log_path, port)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The real SmolLM2 GGUF ($KVSERVE_SMOLLM2, else the store; pulled if missing)."""
    p = os.environ.get("KVSERVE_SMOLLM2")
    if p and os.path.exists(p):
        return p
    from kvserve.store import resolve_model

    return str(resolve_model("smollm2", pull_missing=True))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    """Our tokenizer for SmolLM2 (pinned to llama.cpp's), for expected token counts."""
    from kvserve.loaders.tokenizer import Tokenizer

    return Tokenizer.from_gguf_file(smollm2_path)


@pytest.fixture
def start_server(smollm2_path, tmp_path_factory):
    """Factory: ``start_server(*args, model=None, wait=True, env=None) -> Server``; stopped at
    teardown. ``model=""`` starts with no model given (several models, from ``$KVSERVE_HOME``)."""
    servers: list[Server] = []
    logdir = tmp_path_factory.mktemp("logs")

    def start(*args: str, model: str | None = None, wait: bool = True, env: dict | None = None) -> Server:
        srv = _spawn(smollm2_path if model is None else model, tuple(args), logdir, env)
        servers.append(srv)
        if wait:
            srv.wait_ready()
        return srv

    yield start
    for srv in servers:
        srv.stop()


@pytest.fixture(scope="session")
def smollm2_server(smollm2_path, tmp_path_factory):
    """One shared server: 2 slots, 4096 tokens of context (2048 per slot), metrics on."""
    srv = _spawn(smollm2_path, ("-np", "2", "-c", "4096", "--metrics", "-a", "tiny-coder"),
                 tmp_path_factory.mktemp("shared"))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def start_server_module(smollm2_path, tmp_path_factory):
    """Like ``start_server`` but the servers live for the test module (shared by its tests)."""
    servers: list[Server] = []
    logdir = tmp_path_factory.mktemp("mlogs")

    def start(*args: str, model: str | None = None) -> Server:
        srv = _spawn(model or smollm2_path, tuple(args), logdir)
        servers.append(srv)
        srv.wait_ready()
        return srv

    yield start
    for srv in servers:
        srv.stop()
