"""Fixtures for the browser tests: Debian's chromium driven by selenium through Debian's
chromedriver (no browser download: selenium-manager is never asked, as the driver's path is
given), and kvserve servers on the tiny random-weight model (fast streaming, no real model).

``browser`` is one headless chromium for the module; ``tiny_server(*args)`` starts
``kvserve serve <tiny.gguf> --host 127.0.0.1 --port <free> ...`` for the module and waits for
/health (or not, to start several at once). Every process is stopped at teardown. Without the chromium or chromedriver binaries
the tests skip, saying which one is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("KVSERVE_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("KVSERVE_CHROMEDRIVER", "/usr/bin/chromedriver")


def _binary(path: str) -> str | None:
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else shutil.which(os.path.basename(path))


@dataclass
class TinyServer:
    """A running ``kvserve serve`` on the tiny model."""

    base_url: str
    proc: subprocess.Popen
    log_path: Path

    def url(self, path: str) -> str:
        return self.base_url + path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> TinyServer:
        """Poll /health until 200; fail with the log when the process exits or time runs out."""
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
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_server(tiny_gguf, tmp_path_factory):
    """Factory ``tiny_server(*args, wait=True) -> TinyServer``: servers live for the module;
    ``wait=False`` returns at once (start several, then call ``wait_ready()`` on each)."""
    servers: list[TinyServer] = []
    logdir = tmp_path_factory.mktemp("browser-logs")

    def start(*args: str, wait: bool = True) -> TinyServer:
        port = _free_port()
        log_path = Path(tempfile.mkstemp(prefix="kvserve-", suffix=".log", dir=logdir)[1])
        cmd = [sys.executable, "-m", "kvserve", "serve", tiny_gguf, "--host", "127.0.0.1", "--port", str(port), *args]
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1"))
        srv = TinyServer(f"http://127.0.0.1:{port}", proc, log_path)
        servers.append(srv)
        return srv.wait_ready() if wait else srv

    yield start
    for srv in servers:
        srv.stop()


@pytest.fixture(scope="module")
def browser():
    """A headless chromium (selenium WebDriver), 1280x900, for the module."""
    chromium, driver = _binary(CHROMIUM), _binary(CHROMEDRIVER)
    if chromium is None or driver is None:
        missing = [n for n, p in (("chromium", chromium), ("chromedriver", driver)) if p is None]
        pytest.skip(f"no {' and no '.join(missing)} binary ({CHROMIUM}, {CHROMEDRIVER}): "
                    "install Debian's chromium and chromium-driver packages")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1280,900", "--no-first-run", "--disable-extensions"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(executable_path=driver), options=opts)
    drv.set_script_timeout(20)
    try:
        yield drv
    finally:
        drv.quit()
