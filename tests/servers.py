"""The test harness for real ``kvserve serve`` processes on 127.0.0.1 (free ports), shared by
tests/api and tests/browser: :func:`free_port`, :class:`Server` (wait for /health, stop by pid)
and :func:`spawn`.
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

REPO = Path(__file__).resolve().parents[1]  # the checkout this file is in: its servers run its code
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

    def wait_ready(self, timeout: float = HEALTH_TIMEOUT_S) -> Server:
        """Poll /health until 200 and return self; fail with the log on timeout or exit."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url("/health"), timeout=2).status_code == 200:
                    return self
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


def spawn(model: str, args: tuple[str, ...], logdir: Path, env_extra: dict | None = None) -> Server:
    """Start ``kvserve serve [model] ...``; ``model`` "" starts it with no ``-m`` (several models)."""
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="kvserve-", suffix=".log", dir=logdir)[1])
    cmd = [sys.executable, "-m", "kvserve", "serve", *([model] if model else []), "--host", "127.0.0.1",
           "--port", str(port), *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    return Server(f"http://127.0.0.1:{port}", proc, log_path, port)


def app_client(path, d, *flags):
    """An in-process server: ``kvserve serve -m PATH -a tiny -c 512 -np 2 --models-dir D/models
    FLAGS`` behind starlette's TestClient, its model preloaded; ``.state`` is its ServerState (the
    caller shuts its manager down)."""
    from starlette.testclient import TestClient

    from kvserve.app import build_app
    from kvserve.serving.args import parse_args
    from kvserve.serving.state import ServerState

    state = ServerState(parse_args(["-m", str(path), "-a", "tiny", "-c", "512", "-np", "2",
                                    "--models-dir", str(d / "models"), *flags]))
    c = TestClient(build_app(state), base_url="http://127.0.0.1")
    c.__enter__()
    c.portal.call(state.preload)
    c.state = state
    return c
