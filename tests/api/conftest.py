"""Fixtures that run real ``kvserve serve`` processes on 127.0.0.1 (free ports).

``start_server(*args, model=None, wait=True)`` (per test) and ``start_server_module`` (per
module) start one and wait for /health 200 (120 s at most, failing with the server's log);
every process is terminated at teardown. ``smollm2_server`` is one shared server (``-np 2 -c 4096 --metrics``).
"""

from __future__ import annotations

import os

import pytest
from servers import Server, spawn


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
        srv = spawn(smollm2_path if model is None else model, tuple(args), logdir, env)
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
    srv = spawn(smollm2_path, ("-np", "2", "-c", "4096", "--metrics", "-a", "tiny-coder"),
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
        srv = spawn(model or smollm2_path, tuple(args), logdir)
        servers.append(srv)
        srv.wait_ready()
        return srv

    yield start
    for srv in servers:
        srv.stop()
