"""MCP servers through ``/tools`` (``--mcp-servers-json`` / ``--mcp-servers-config``; kvserve/tools/mcp.py)
against real ``kvserve serve`` processes on the tiny model, with small MCP servers these tests write:

- ``fx.py``: a stdio server speaking newline-delimited JSON-RPC by hand (as llama.cpp's fixtures do),
  whose tools misbehave on purpose: ``crash`` exits mid-call, ``fail_once`` fails its first call,
  ``noisy`` writes a line that is not JSON and a notification before its answer, ``sleep`` is slow,
  ``spawn`` starts a grandchild, ``pid`` tells its process id, ``big`` answers 3 MiB;
- ``web.py``: a streamable-HTTP server built on the official ``mcp`` SDK's server (MCPServer), which
  answers 401 without the header ``X-Test-Token: secret`` (so the configured ``headers`` are sent);
- ``mute.py``: a stdio server that reads its input and never answers.

Checked: the listing (names ``<server>_<tool>``, entry shape), calls and their exact answers, a
tool's error and a JSON-RPC error as ``{"error"}``, a crash answered and the server started again
(new pid), a malformed line skipped, a timeout, flaky then fine, grandchildren killed (pids checked)
when the server stops and when warm-up stops the server, a server that never answers not holding
up start-up, and invalid configurations refusing start-up with llama-server's texts.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.servers import free_port, spawn

pytest.importorskip("mcp")

FX = r'''
import json, os, subprocess, sys, time

TOOLS = [
    {"name": "echo", "description": "Echo back the input message",
     "inputSchema": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]}},
    {"name": "add", "description": "Add two numbers",
     "inputSchema": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}},
    {"name": "fail_once", "description": "Fails on its first call", "inputSchema": {"type": "object"}},
    {"name": "crash", "description": "Exits mid-call", "inputSchema": {"type": "object"}},
    {"name": "noisy", "description": "Writes junk before its answer", "inputSchema": {"type": "object"}},
    {"name": "sleep", "description": "Sleeps", "inputSchema": {"type": "object"}},
    {"name": "spawn", "description": "Starts a grandchild", "inputSchema": {"type": "object"}},
    {"name": "pid", "description": "This server's pid", "inputSchema": {"type": "object"}},
    {"name": "oops", "description": "A tool-level error", "inputSchema": {"type": "object"}},
    {"name": "big", "description": "3 MiB of text", "inputSchema": {"type": "object"}},
]
state = {"failed": False}
if os.environ.get("FX_WARMUP_CHILD"):  # a grandchild started at launch (warm-up must kill it too)
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(os.environ["FX_WARMUP_CHILD"], "a") as f:
        f.write(f"{g.pid}\n")

def send(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()

def text(req_id, t, is_error=False):
    send({"jsonrpc": "2.0", "id": req_id, "result": {"content": [{"type": "text", "text": t}], "isError": is_error}})

for line in sys.stdin:
    line = line.strip()
    if not line:
        continue
    req = json.loads(line)
    req_id, method, params = req.get("id"), req.get("method"), req.get("params") or {}
    if req_id is None:
        continue
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": req_id, "result": {"protocolVersion": "2024-11-05",
              "capabilities": {"tools": {}}, "serverInfo": {"name": "fx", "version": "1"}}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": req_id, "result": {"tools": TOOLS}})
    elif method == "tools/call":
        name, args = params.get("name"), params.get("arguments") or {}
        if name == "echo":
            text(req_id, "echo: " + args.get("message", ""))
        elif name == "add":
            text(req_id, str(args.get("a", 0) + args.get("b", 0)))
        elif name == "fail_once":
            if not state["failed"]:
                state["failed"] = True
                send({"jsonrpc": "2.0", "id": req_id, "error": {"code": -32000, "message": "transient error"}})
            else:
                text(req_id, "ok")
        elif name == "crash":
            os._exit(3)
        elif name == "noisy":
            sys.stdout.write("THIS IS NOT JSON\n")
            send({"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": "hi"}})
            text(req_id, "still here")
        elif name == "sleep":
            time.sleep(float(args.get("seconds", 5)))
            text(req_id, "slept")
        elif name == "spawn":  # FX_NEW_SESSION: the grandchild leaves the server's session and group
            g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 start_new_session=bool(os.environ.get("FX_NEW_SESSION")))
            text(req_id, str(g.pid))
        elif name == "pid":
            text(req_id, str(os.getpid()))
        elif name == "oops":
            text(req_id, "it went wrong", is_error=True)
        elif name == "big":
            text(req_id, "x" * (3 * 1024 * 1024))
        else:
            send({"jsonrpc": "2.0", "id": req_id, "error": {"code": -32602, "message": "Unknown tool: " + str(name)}})
    else:
        send({"jsonrpc": "2.0", "id": req_id, "error": {"code": -32601, "message": "Method not found"}})
'''

WEB = r'''
import sys
import uvicorn
from mcp.server.mcpserver import MCPServer

srv = MCPServer("web")


@srv.tool()
def greet(name: str) -> str:
    """Greet someone by name"""
    return f"hello {name}"


app = srv.streamable_http_app()


async def guarded(scope, receive, send):
    if scope["type"] == "http" and dict(scope["headers"]).get(b"x-test-token") != b"secret":
        await send({"type": "http.response.start", "status": 401, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"no token"})
        return
    await app(scope, receive, send)


uvicorn.run(guarded, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
'''

MUTE = "import sys\nfor line in sys.stdin:\n    pass\n"


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_gone(pids, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    d = tmp_path_factory.mktemp("mcpfx")
    for name, src in (("fx.py", FX), ("web.py", WEB), ("mute.py", MUTE)):
        (d / name).write_text(src)
    return d


@pytest.fixture(scope="module")
def web(fixtures):
    """The streamable-HTTP MCP server (its URL), stopped by pid after the module."""
    import subprocess

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(fixtures / "web.py"), str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/mcp"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def _config(fixtures: Path, web_url: str | None = None, **extra) -> dict:
    servers = {"fx": {"command": sys.executable, "args": [str(fixtures / "fx.py")]}}
    if web_url:
        servers["web"] = {"url": web_url, "headers": {"X-Test-Token": "secret"}}
    servers.update(extra)
    return {"mcpServers": servers}


def _call(server, tool: str, params: dict | None = None, timeout: float = 30) -> dict:
    r = httpx.post(server.url("/tools"), json={"tool": tool, "params": params or {}}, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def server(tiny_gguf, fixtures, web, tmp_path_factory):
    """One kvserve with the stdio fixture ``fx``, the HTTP server ``web``, a server whose program
    does not exist (``gone``) and one that never answers (``mute``), no ``--tools``."""
    d = tmp_path_factory.mktemp("mcpserve")
    cfg = _config(fixtures, web, gone={"command": "/nonexistent/mcp-server-12345"},
                  mute={"command": sys.executable, "args": [str(fixtures / "mute.py")]})
    t0 = time.monotonic()
    s = spawn(tiny_gguf, ("--mcp-servers-json", json.dumps(cfg), "--models-dir", str(d / "models")), d)
    try:
        s.wait_ready(60)
        s.ready_s = time.monotonic() - t0
        yield s
    finally:
        s.stop()


def test_tools_listed_with_server_prefix(server):
    r = httpx.get(server.url("/tools"), timeout=10)
    assert r.status_code == 200
    tools = r.json()
    names = [t["tool"] for t in tools]
    # no --tools: only the MCP servers' tools, in configuration order; gone and mute list nothing
    assert names == ["fx_echo", "fx_add", "fx_fail_once", "fx_crash", "fx_noisy", "fx_sleep", "fx_spawn",
                     "fx_pid", "fx_oops", "fx_big", "web_greet"]
    echo = tools[0]
    assert echo == {"display_name": "fx_echo", "tool": "fx_echo", "type": "mcp", "permissions": {"write": False},
                    "uses_cwd": False, "definition": {"type": "function", "function": {
                        "name": "fx_echo", "description": "Echo back the input message",
                        "parameters": {"type": "object", "properties": {"message": {"type": "string"}},
                                       "required": ["message"]}}}}
    greet = tools[-1]["definition"]["function"]
    assert greet["name"] == "web_greet" and greet["description"] == "Greet someone by name"
    assert greet["parameters"]["properties"] == {"name": {"title": "Name", "type": "string"}}
    assert greet["parameters"]["required"] == ["name"]


def test_mute_server_does_not_hold_up_start(server):
    # the mute server's warm-up is cut at 10 s (WARMUP_TIMEOUT_S); everything else starts meanwhile
    assert server.ready_s < 45
    want = ["MCP warmup: failed to start 'mute': initialize timed out",
            "MCP warmup: failed to start 'gone': failed to spawn: No such file or directory"]
    # the warm-up runs beside serving: on a loaded machine its lines may follow /health (bounded wait)
    deadline = time.monotonic() + 30
    while not all(w in server.log() for w in want) and time.monotonic() < deadline:
        time.sleep(0.2)
    log = server.log()
    assert [w in log for w in want] == [True, True]


def test_calls_answer_exact_text(server):
    assert _call(server, "fx_echo", {"message": "hello world"}) == {"plain_text_response": "echo: hello world"}
    assert _call(server, "fx_add", {"a": 3, "b": 5}) == {"plain_text_response": "8"}
    assert _call(server, "web_greet", {"name": "ann"}) == {"plain_text_response": "hello ann"}


def test_header_params_are_not_the_tools(server):
    # cwd/runtime/resp_type come from headers only; the tool never sees them
    r = httpx.post(server.url("/tools"), json={"tool": "fx_echo", "params": {"message": "m", "cwd": "/etc"}},
                   headers={"x-tool-cwd": "/tmp"}, timeout=30)
    assert r.json() == {"plain_text_response": "echo: m"}


def test_tool_errors_answer_error(server):
    assert _call(server, "fx_oops") == {"error": "it went wrong"}  # a result with isError
    r = httpx.post(server.url("/tools"), json={"tool": "fx_nosuch"}, timeout=10)
    assert r.status_code == 404
    assert r.json()["error"]["message"] == 'unknown tool "fx_nosuch"'


def test_server_that_failed_warm_up_lists_nothing(server):
    r = httpx.post(server.url("/tools"), json={"tool": "gone_x"}, timeout=10)
    assert r.status_code == 404
    assert r.json()["error"]["message"] == 'unknown tool "gone_x"'


def test_flaky_then_fine(server):
    assert _call(server, "fx_fail_once") == {"error": "transient error"}
    assert _call(server, "fx_fail_once") == {"plain_text_response": "ok"}
    assert _call(server, "fx_fail_once") == {"plain_text_response": "ok"}


def test_malformed_line_and_notification_skipped(server):
    assert _call(server, "fx_noisy") == {"plain_text_response": "still here"}
    assert _call(server, "fx_echo", {"message": "after"}) == {"plain_text_response": "echo: after"}


def test_crash_answered_then_restarted(server):
    pid1 = int(_call(server, "fx_pid")["plain_text_response"])
    assert _call(server, "fx_crash") == {"error": "transport closed"}
    assert _wait_gone([pid1]) == []
    assert _call(server, "fx_echo", {"message": "again"}) == {"plain_text_response": "echo: again"}
    pid2 = int(_call(server, "fx_pid")["plain_text_response"])
    assert pid2 != pid1 and _alive(pid2)


def test_output_capped(server):
    out = _call(server, "fx_big")["plain_text_response"]
    assert len(out) == 1024 * 1024 + len("\n[output truncated at 1048576 characters]")
    assert out.endswith("\n[output truncated at 1048576 characters]") and out.startswith("xxxx")


def test_concurrent_calls(server):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(lambda i: _call(server, "fx_echo", {"message": f"m{i}"}), range(16)))
    assert results == [{"plain_text_response": f"echo: m{i}"} for i in range(16)]


def test_http_server_restarted_is_reconnected(fixtures):
    """The manager alone (no kvserve): a streamable-HTTP server that went away answers ``transport
    closed`` at once; once it is back, the next call opens a new session."""
    import asyncio
    import subprocess

    from kvserve.tools.mcp import McpManager, McpServerConfig

    port = free_port()

    def start():
        p = subprocess.Popen([sys.executable, str(fixtures / "web.py"), str(port)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
                return p
            except httpx.HTTPError:
                time.sleep(0.1)
        return p

    async def run(p):
        m = McpManager([McpServerConfig("web", url=f"http://127.0.0.1:{port}/mcp",
                                        headers={"X-Test-Token": "secret"}, timeout_ms=5000)])
        out = [[d.name for d in await m.warm_up()], await m.call_tool("web", "greet", {"name": "a"})]
        p.kill()
        p.wait(10)
        out.append(await m.call_tool("web", "greet", {"name": "b"}))
        p = await asyncio.to_thread(start)
        out.append(await m.call_tool("web", "greet", {"name": "c"}))
        await m.aclose()
        return out, p

    p = start()
    try:
        out, p = asyncio.run(run(p))
    finally:
        p.kill()
        p.wait(10)
    assert out == [["greet"], {"plain_text_response": "hello a"}, {"error": "transport closed"},
                   {"plain_text_response": "hello c"}]


def test_timeout(tiny_gguf, fixtures, tmp_path):
    cfg = _config(fixtures)
    cfg["mcpServers"]["fx"]["timeout_ms"] = 500
    s = spawn(tiny_gguf, ("--mcp-servers-json", json.dumps(cfg), "--models-dir", str(tmp_path / "models")), tmp_path)
    try:
        s.wait_ready(60)
        assert _call(s, "fx_echo", {"message": "up"}) == {"plain_text_response": "echo: up"}  # session started
        t0 = time.monotonic()
        assert _call(s, "fx_sleep", {"seconds": 2}) == {"error": "request timed out"}
        assert time.monotonic() - t0 < 2.0
        time.sleep(2.5)  # the late reply to the timed-out call arrives and is not taken for the next one's
        assert _call(s, "fx_echo", {"message": "next"}) == {"plain_text_response": "echo: next"}
    finally:
        s.stop()


def test_hung_server_is_restarted_after_a_timeout(tiny_gguf, fixtures, tmp_path):
    """A call that times out on a server stuck in it (``sleep`` 600 s; the fixture answers one request at a
    time): the server's process is killed, and the next call starts it again (a new pid) and answers."""
    cfg = _config(fixtures)
    cfg["mcpServers"]["fx"]["timeout_ms"] = 1000
    s = spawn(tiny_gguf, ("--mcp-servers-json", json.dumps(cfg), "--models-dir", str(tmp_path / "models")), tmp_path)
    try:
        s.wait_ready(60)
        pid = int(_call(s, "fx_pid")["plain_text_response"])
        t0 = time.monotonic()
        assert _call(s, "fx_sleep", {"seconds": 600}) == {"error": "request timed out"}
        assert time.monotonic() - t0 < 4.0
        assert _wait_gone([pid], 5.0) == []
        t0 = time.monotonic()
        again = _call(s, "fx_pid")
        assert "plain_text_response" in again, again
        assert int(again["plain_text_response"]) != pid and time.monotonic() - t0 < 4.0
        assert _call(s, "fx_echo", {"message": "next"}) == {"plain_text_response": "echo: next"}
        assert "MCP 'fx': a call timed out after 1000 ms: the server is stopped and started again on its next use" \
            in s.log()
    finally:
        s.stop()


def test_stop_reaps_children_and_grandchildren(tiny_gguf, fixtures, tmp_path):
    """Stopping kvserve during a slow call: the call ends at once, kvserve exits within 3 s, and the
    MCP server and the grandchildren it spawned (at launch and in a call) are all gone; the
    grandchild of the warm-up's short-lived instance was killed when warm-up stopped it."""
    pids_file = tmp_path / "warmup-children"
    cfg = _config(fixtures)
    cfg["mcpServers"]["fx"]["env"] = {"FX_WARMUP_CHILD": str(pids_file)}
    s = spawn(tiny_gguf, ("--mcp-servers-config", _write(tmp_path / "mcp.json", cfg), "--models-dir",
                          str(tmp_path / "models")), tmp_path)
    try:
        s.wait_ready(60)
        warm_child = int(pids_file.read_text().split()[0])
        assert _wait_gone([warm_child], 5) == []  # warm-up's instance stopped: its grandchild too
        server_pid = int(_call(s, "fx_pid")["plain_text_response"])
        grandchild = int(_call(s, "fx_spawn")["plain_text_response"])
        run_child = int(pids_file.read_text().split()[1])  # the live instance's launch grandchild
        assert all(_alive(p) for p in (server_pid, grandchild, run_child))
        result = {}
        t = threading.Thread(target=lambda: result.update(r=httpx.post(
            s.url("/tools"), json={"tool": "fx_sleep", "params": {"seconds": 30}}, timeout=30)))
        t.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        s.proc.terminate()
        s.proc.wait(timeout=10)
        assert time.monotonic() - t0 < 5.0  # llama.cpp's suite asks < 3 s of llama-server (SmolLM2): see docs
        t.join(10)
        assert result["r"].status_code == 200 and result["r"].json() == {"error": "cancelled"}
        assert _wait_gone([server_pid, grandchild, run_child], 5) == []
    finally:
        s.stop()


def _write(path: Path, obj) -> str:
    path.write_text(json.dumps(obj))
    return str(path)


@pytest.mark.parametrize("flags, text", [
    (("--mcp-servers-json", "not valid json"), "MCP starting failed: failed to parse MCP config JSON: "),
    (("--mcp-servers-config", "/nonexistent/path.json"),
     "MCP starting failed: failed to open MCP config file: /nonexistent/path.json"),
    (("--mcp-servers-json", '{"mcpServers": {"a": {"command": "x", "args": "not-a-list"}}}'),
     "MCP starting failed: failed to parse MCP config JSON: 'a'.args must be a list of strings"),
    (("--mcp-servers-json", '{"mcpServers": {"a": {"url": "file:///etc/passwd"}}}'),
     "MCP starting failed: failed to parse MCP config JSON: 'a'.url must be an http(s) URL"),
])
def test_invalid_config_refuses_start(tiny_gguf, tmp_path, flags, text):
    s = spawn(tiny_gguf, (*flags, "--models-dir", str(tmp_path / "models")), tmp_path)
    try:
        assert s.proc.wait(timeout=60) == 1
        assert text in s.log()
    finally:
        s.stop()


def test_sigkill_of_kvserve_leaves_no_tool_process(fixtures, tmp_path):
    """kvserve SIGKILLed (no shutdown code runs) while a ``/tools`` shell command and an MCP stdio
    server are both busy: the kernel kills both (PR_SET_PDEATHSIG, kvserve/procs.py), checked by
    pid within 5 s. The shell command ``exec``s its sleep, so the sleep is kvserve's direct child:
    PDEATHSIG does not reach grandchildren (see kvserve/procs.py)."""
    cfg = _config(fixtures)
    s = spawn("", ("--no-preload", "--tools", "all", "--mcp-servers-json", json.dumps(cfg), "--models-dir",
                   str(tmp_path / "models")), tmp_path)
    try:
        s.wait_ready(60)
        mcp_pid = int(_call(s, "fx_pid")["plain_text_response"])
        busy = threading.Thread(target=lambda: _swallow(lambda: httpx.post(
            s.url("/tools"), json={"tool": "fx_sleep", "params": {"seconds": 600}}, timeout=30)), daemon=True)
        busy.start()
        with httpx.stream("POST", s.url("/tools"), json={"tool": "exec_shell_command", "stream": True,
                          "params": {"command": "echo $$; exec sleep 600", "timeout": 600}}, timeout=30) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            shell_pid = int(json.loads(first[6:])["chunk"].split("\n", 1)[0])
            time.sleep(0.3)  # the fx_sleep call reaches the MCP server
            assert _alive(mcp_pid) and _alive(shell_pid)
            with open(f"/proc/{shell_pid}/cmdline", "rb") as f:
                assert f.read().split(b"\0")[:2] == [b"sleep", b"600"]  # the exec happened
            assert os.getpgid(shell_pid) == shell_pid and os.getpgid(mcp_pid) == mcp_pid  # own groups
            s.proc.kill()
            s.proc.wait(timeout=10)
        assert _wait_gone([shell_pid, mcp_pid], 5) == []
    finally:
        s.stop()
        for pid in ("shell_pid", "mcp_pid"):  # a failed assertion must not leave them running
            p = locals().get(pid)
            if p and _alive(p):
                os.kill(p, 9)


def _swallow(fn):
    try:
        fn()
    except httpx.HTTPError:
        pass


def test_warm_up_starts_a_server_again_after_a_bad_descriptor(fixtures, monkeypatch):
    """A spawn that fails with EBADF (seen once in a loaded CI run: a pipe's descriptor already closed
    when the transport took it) is tried once more within the warm-up's time; other errors are not."""
    import errno

    from kvserve.tools import mcp as mcp_mod

    real = mcp_mod._StdioProcess.spawn
    spawns = []

    async def flaky(self):
        spawns.append(self.cfg.name)
        if len(spawns) == 1:
            raise OSError(errno.EBADF, "Bad file descriptor")
        await real(self)

    monkeypatch.setattr(mcp_mod._StdioProcess, "spawn", flaky)

    async def run():
        m = mcp_mod.McpManager([mcp_mod.McpServerConfig("fx", command=sys.executable,
                                                        args=[str(fixtures / "fx.py")])])
        defs = await m.warm_up()
        await m.aclose()
        return [d.name for d in defs]

    assert asyncio.run(run())[:2] == ["echo", "add"]
    assert spawns == ["fx", "fx"]
    spawns.clear()
    monkeypatch.setattr(mcp_mod._StdioProcess, "spawn", lambda self: (spawns.append(1), _raise_enoent())[1])

    async def run_enoent():
        m = mcp_mod.McpManager([mcp_mod.McpServerConfig("fx", command=sys.executable, args=["x"])])
        defs = await m.warm_up()
        await m.aclose()
        return defs

    assert asyncio.run(run_enoent()) == [] and spawns == [1]


async def _raise_enoent():
    raise FileNotFoundError(2, "No such file or directory", "x")


def test_grandchild_in_its_own_session_dies_with_the_server(fixtures):
    """A stdio server runs under the tools' reaper (kvserve/tools/reaper.py), as shell commands do: a
    grandchild that left the server's session and process group (``setsid``) is killed when the server
    is stopped. Before, the server ran in a plain process group, and such a grandchild outlived it."""
    from kvserve.tools import mcp as mcp_mod

    async def run():
        m = mcp_mod.McpManager([mcp_mod.McpServerConfig("fx", command=sys.executable, args=[str(fixtures / "fx.py")],
                                                        env={"FX_NEW_SESSION": "1"})])
        await m.warm_up()
        server = int((await m.call_tool("fx", "pid", {}))["plain_text_response"])
        child = int((await m.call_tool("fx", "spawn", {}))["plain_text_response"])
        alive = (_alive(server), _alive(child), os.getsid(child) == child, os.getpgid(server) == server)
        await m.aclose()
        return server, child, alive

    server, child, alive = asyncio.run(run())
    try:
        assert alive == (True, True, True, True)
        assert _wait_gone([server, child], 5) == []
    finally:
        if _alive(child):
            os.kill(child, 9)
