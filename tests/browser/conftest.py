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

import pytest
from servers import Server, spawn

CHROMIUM = os.environ.get("KVSERVE_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("KVSERVE_CHROMEDRIVER", "/usr/bin/chromedriver")


def _binary(path: str) -> str | None:
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else shutil.which(os.path.basename(path))


@pytest.fixture(scope="module")
def tiny_server(tiny_gguf, tmp_path_factory):
    """Factory ``tiny_server(*args, wait=True) -> Server``: servers live for the module;
    ``wait=False`` returns at once (start several, then call ``wait_ready()`` on each)."""
    servers: list[Server] = []
    logdir = tmp_path_factory.mktemp("browser-logs")

    def start(*args: str, wait: bool = True) -> Server:
        srv = spawn(tiny_gguf, args, logdir)
        servers.append(srv)
        if wait:
            srv.wait_ready()
        return srv

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
