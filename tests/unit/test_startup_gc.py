"""kvserve.startup: the garbage collector off during ``kvserve serve``'s start-up, on again after the
start-up model's load (or its failure), never turned on where the caller had it off."""

from __future__ import annotations

import asyncio
import gc

import pytest

from kvserve import app, startup


@pytest.fixture()
def gc_state(monkeypatch):
    monkeypatch.delenv("KVSERVE_STARTUP_GC", raising=False)
    was = gc.isenabled()
    gc.enable()
    monkeypatch.setattr(startup, "_paused", False)
    yield
    startup.resume()
    gc.unfreeze()
    (gc.enable if was else gc.disable)()


def test_pause_then_resume(gc_state):
    startup.pause()
    assert not gc.isenabled() and startup.paused()
    startup.pause()  # twice: still one pause
    startup.resume()
    assert gc.isenabled() and not startup.paused()
    startup.resume()  # idempotent
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off(gc_state):
    gc.disable()
    startup.pause()
    assert not startup.paused()
    startup.resume()
    assert not gc.isenabled()


def test_the_escape_hatch_keeps_the_collector_on(gc_state, monkeypatch):
    monkeypatch.setenv("KVSERVE_STARTUP_GC", "1")
    startup.pause()
    assert gc.isenabled() and not startup.paused()


def test_freeze_only_while_paused(gc_state):
    gc.unfreeze()
    startup.freeze()
    assert gc.get_freeze_count() == 0
    startup.pause()
    startup.freeze()
    assert gc.get_freeze_count() > 1000  # the modules imported so far
    startup.resume()
    assert gc.isenabled()


class _Args:
    model = "m.gguf"
    host, hosts, port, webui, api_keys = "127.0.0.1", [], 8080, False, []
    ssl_key_file = ssl_cert_file = None


class _State:
    def __init__(self, error: BaseException | None):
        self.args, self.error, self.load_error = _Args(), error, None

    async def preload(self):
        assert not gc.isenabled()  # the load runs with the collector off
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize("error", [None, FileNotFoundError("model file not found: m.gguf")])
def test_the_preload_turns_the_collector_back_on(gc_state, error):
    failed = []
    startup.pause()
    asyncio.run(app._preload(_State(error), lambda: failed.append(1)))
    assert gc.isenabled() and not startup.paused()
    assert failed == ([] if error is None else [1])


def test_uvicorn_runs_without_websocket_support():
    """No route speaks WebSocket: uvicorn is told so (its "auto" would import the websockets package
    at every start)."""
    import subprocess
    import sys
    from pathlib import Path

    assert app.uvicorn_config(None).ws == "none"
    code = ("import sys; from fastapi import FastAPI; from kvserve import app; "
            "c = app.uvicorn_config(FastAPI()); c.load(); print(c.ws_protocol_class, 'websockets' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.stdout.split() == ["None", "False"]


def test_no_preload_turns_the_collector_back_on_at_start(gc_state, tmp_path):
    """``--no-preload``: nothing to wait for, the collector is on again once the server has started."""
    from fastapi import FastAPI

    class _Manager:
        def start_reaper(self):
            pass

    class _NoPreload(_State):
        pinned, mcp = False, None

        def __init__(self):
            super().__init__(None)
            self.args.preload, self.args.models_dir = False, str(tmp_path / "models")
            self.manager = _Manager()

        async def start_remotes(self):
            pass

    fast = FastAPI()
    app.add_startup(fast, _NoPreload(), lambda: None)
    startup.pause()

    async def run():
        await fast.router.on_startup[0]()

    asyncio.run(run())
    assert gc.isenabled() and not startup.paused()
