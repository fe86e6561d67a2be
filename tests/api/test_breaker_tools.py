"""Breaker findings on the server tools (issue 36), run in-process through the registry (no HTTP
needed: the process handling is the same code the ``/tools`` route calls).

A command that starts its own session (``setsid``, a double fork + ``setsid()``, ``nohup setsid``)
leaves the process group kvserve kills, so it outlives its request (timeout, client gone, server
stop). Found by hand: ``exec_shell_command {"command": "setsid sleep 301 &", "timeout": 2}``
left ``sleep 301`` running (ppid 1) after the call answered ``[exit due to timed out]``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import pytest

from kvserve.tools import ToolContext, ToolRegistry


def _pids_with(marker: str) -> list[int]:
    """Live pids whose command line holds ``marker``."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        out.append(int(d))
            except OSError:
                pass
    return out


def test_setsid_child_dies_with_its_call(tmp_path):
    marker = f"{uuid.uuid4().int % 10**6 + 10**6}"  # a unique sleep length: `sleep 1234567`
    reg = ToolRegistry.from_names("exec_shell_command")
    ctx = ToolContext(cwd=str(tmp_path))
    try:
        t0 = time.monotonic()
        out = asyncio.run(reg.get("exec_shell_command").run(
            {"command": f"setsid sleep {marker} & echo started", "timeout": 2}, ctx))
        assert time.monotonic() - t0 < 10
        assert out["plain_text_response"].startswith("started\n")
        time.sleep(1.0)
        assert _pids_with(f"sleep\x00{marker}") == []
    finally:
        reg.close()
        for pid in _pids_with(f"sleep\x00{marker}"):
            os.kill(pid, signal.SIGKILL)


DOUBLE_FORK = ("python3 -c 'import os, sys, time\n"
               "if os.fork() == 0:\n"
               "    os.setsid()\n"
               "    if os.fork() == 0:\n"
               "        os.execvp(\"sleep\", [\"sleep\", sys.argv[1]])\n"
               "    os._exit(0)\n"
               "os.wait()\n' {marker}")


@pytest.mark.parametrize("form", ["nohup setsid sleep {marker} >/dev/null 2>&1 & echo started",
                                  "setsid -f sleep {marker}; echo started",
                                  DOUBLE_FORK + "; echo started"])
def test_escaped_children_die_when_the_command_ends(tmp_path, form):
    """Every process the command left, in any session, dies with the call (the call ends at once when
    the output is closed, else at its timeout: the left process still holds the output)."""
    marker = f"{uuid.uuid4().int % 10**6 + 10**6}"
    reg = ToolRegistry.from_names("exec_shell_command")
    try:
        t0 = time.monotonic()
        out = asyncio.run(reg.get("exec_shell_command").run(
            {"command": form.format(marker=marker), "timeout": 3}, ToolContext(cwd=str(tmp_path))))
        assert out["plain_text_response"].startswith("started\n"), out
        assert time.monotonic() - t0 < (3 if form.startswith("nohup") else 10)
        time.sleep(0.5)
        assert _pids_with(f"sleep\x00{marker}") == []
    finally:
        reg.close()
        for pid in _pids_with(f"sleep\x00{marker}"):
            os.kill(pid, signal.SIGKILL)


def test_escaped_child_dies_when_the_call_is_cancelled_or_the_server_stops(tmp_path):
    """A call still running: cancelling it (client gone) and the registry's close (server stop) kill
    the process that left the session too."""
    reg = ToolRegistry.from_names("exec_shell_command")
    markers = [f"{uuid.uuid4().int % 10**6 + 10**6}" for _ in range(2)]

    async def scenario():
        ctx = ToolContext(cwd=str(tmp_path))
        call = asyncio.ensure_future(reg.get("exec_shell_command").run(
            {"command": f"setsid sleep {markers[0]} & sleep 30", "timeout": 60}, ctx))
        for _ in range(200):
            if _pids_with(f"sleep\x00{markers[0]}"):
                break
            await asyncio.sleep(0.05)
        assert len(_pids_with(f"sleep\x00{markers[0]}")) == 1
        ctx.cancelled.set()
        await asyncio.wait_for(call, 10)
        stuck = asyncio.ensure_future(reg.get("exec_shell_command").run(
            {"command": f"setsid sleep {markers[1]} & sleep 30", "timeout": 60}, ToolContext(cwd=str(tmp_path))))
        for _ in range(200):
            if _pids_with(f"sleep\x00{markers[1]}"):
                break
            await asyncio.sleep(0.05)
        assert len(_pids_with(f"sleep\x00{markers[1]}")) == 1
        await asyncio.get_running_loop().run_in_executor(None, reg.close)
        await asyncio.wait_for(stuck, 10)

    try:
        asyncio.run(scenario())
        time.sleep(0.5)
        assert [_pids_with(f"sleep\x00{m}") for m in markers] == [[], []]
    finally:
        reg.close()
        for m in markers:
            for pid in _pids_with(f"sleep\x00{m}"):
                os.kill(pid, signal.SIGKILL)


def test_escaped_child_dies_when_kvserve_is_sigkilled(tmp_path):
    """The process running the tools is SIGKILLed mid-call (no cleanup runs): the reaper gets its
    parent-death signal and kills the child that left the session."""
    import subprocess
    import sys

    marker = f"{uuid.uuid4().int % 10**6 + 10**6}"
    code = ("import asyncio\nfrom kvserve.tools import ToolContext, ToolRegistry\n"
            "reg = ToolRegistry.from_names('exec_shell_command')\n"
            f"asyncio.run(reg.get('exec_shell_command').run({{'command': 'setsid sleep {marker} & sleep 600', "
            f"'timeout': 600}}, ToolContext(cwd={str(tmp_path)!r})))\n")
    import kvserve

    root = os.path.dirname(os.path.dirname(os.path.abspath(kvserve.__file__)))
    host = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": root})
    try:
        end = time.monotonic() + 30
        while not _pids_with(f"sleep\x00{marker}") and time.monotonic() < end:
            time.sleep(0.05)
        assert len(_pids_with(f"sleep\x00{marker}")) == 1
        host.kill()
        host.wait(10)
        end = time.monotonic() + 5
        while _pids_with(f"sleep\x00{marker}") and time.monotonic() < end:
            time.sleep(0.05)
        assert _pids_with(f"sleep\x00{marker}") == []
    finally:
        if host.poll() is None:
            host.kill()
        for pid in _pids_with(f"sleep\x00{marker}"):
            os.kill(pid, signal.SIGKILL)


def test_command_that_kills_its_reaper_leaves_nothing_behind(tmp_path):
    """brk2: a command that SIGKILLs its parent ($PPID, which was the reaper) escaped it: its setsid child
    outlived the call (reparented to init) and the call reported the reaper's -9 as the command's exit
    code although the command exited 0. The command's parent is now a fork of the reaper that only
    waits; killing it hands the command and its children to the reaper (the subreaper above it)."""
    marker = f"{uuid.uuid4().int % 10**6 + 10**6}"
    reg = ToolRegistry.from_names("exec_shell_command")
    try:
        out = asyncio.run(reg.get("exec_shell_command").run(
            {"command": f"sleep 0.3; kill -9 $PPID; setsid sleep {marker} >/dev/null 2>&1 & sleep 0.3; echo started",
             "timeout": 3}, ToolContext(cwd=str(tmp_path))))
        time.sleep(0.5)
        left = _pids_with(f"sleep\x00{marker}")
        assert (out["plain_text_response"], left) == ("started\n\n[exit code: 0]", [])
    finally:
        reg.close()
        for pid in _pids_with(f"sleep\x00{marker}"):
            os.kill(pid, signal.SIGKILL)


def test_commands_get_sigpipe_and_sigxfsz_at_their_default(tmp_path):
    """brk2: the reaper (a Python process, which ignores SIGPIPE and SIGXFSZ) forked and exec'd the command
    with both still ignored, so ``yes | head -n 2`` printed ``yes: standard output: Broken pipe`` and a
    pipeline's producer exited 1 instead of 141; without the reaper (subprocess's restore_signals) both
    were at their default. The command now gets them at their default again."""
    reg = ToolRegistry.from_names("exec_shell_command")
    tool = reg.get("exec_shell_command")

    def run(command: str) -> dict:
        return asyncio.run(tool.run({"command": command, "timeout": 10}, ToolContext(cwd=str(tmp_path))))
    try:
        out = run("yes | head -n 2")
        assert out == {"plain_text_response": "y\ny\n\n[exit code: 0]"}
        out = run("bash -c 'seq 1 100000 | head -n 1; echo ${PIPESTATUS[@]}'")
        assert out == {"plain_text_response": "1\n141 0\n\n[exit code: 0]"}
        out = run("grep SigIgn /proc/self/status")
        ignored = int(out["plain_text_response"].split()[1], 16)
        assert ignored & (1 << (signal.SIGPIPE - 1) | 1 << (signal.SIGXFSZ - 1)) == 0, out
    finally:
        reg.close()


def test_reaper_start_wait_is_bounded_by_the_calls_timeout(tmp_path, monkeypatch):
    """The reaper's start-up wait (10 s) ignored a shorter call timeout: a call with a 0.5 s timeout whose
    reaper was slow to start took 10 s and reported ``failed to spawn process``. It now ends at its
    timeout, reported as one (``timed_out``), and the slow reaper is killed. (The slow reaper is a
    stand-in script that never reports; a real one starts in milliseconds.)"""
    from kvserve.tools import runtime

    marker = f"{uuid.uuid4().int % 10**6 + 10**6}"
    slow = tmp_path / "slow_reaper.py"
    slow.write_text(f"import time\ntime.sleep({marker})\n")
    monkeypatch.setattr(runtime, "_REAPER", str(slow))
    t0 = time.monotonic()
    res = asyncio.run(runtime.run_process(["true"], ToolContext(cwd=str(tmp_path)), 0.5, 1000))
    took = time.monotonic() - t0
    time.sleep(0.2)
    assert (res.output, res.exit_code, res.timed_out, _pids_with(str(slow))) == ("", -1, True, [])
    assert 0.4 < took < 3.0, took
