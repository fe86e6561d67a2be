"""The server tools (``--tools``, ``/tools``; issue 36) under attack: what llama.cpp's own
test_tools_builtin.py does not check (it runs in tests/api/test_llama_cpp_suite.py).

* paths: ``..`` and symlinks out of the caller's cwd, FIFOs and device files are refused (a FIFO
  read would hang llama-server), grep does not follow a symlink out; ``--tools-confine`` keeps
  absolute paths in too;
* the container runtime: a header cannot put an option on the engine's command line (the argv
  built is checked; no container engine is needed), and params cannot choose cwd or runtime;
* bounds: an output flood is capped in bytes, a command past its timeout dies with its whole
  process group (background children and double-forked ones included), and so does one whose
  client goes away (streaming and not) or whose server stops;
* the gate: 403 without ``--tools``, 401 without the key, 403 for a foreign Origin or Host.

Real ``kvserve serve`` processes with no model (``--no-preload``) on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from servers import spawn

from kvserve.tools import ToolContext, ToolRegistry, ToolRuntimeError
from kvserve.tools import builtin as B
from kvserve.tools.runtime import ProcessResult, container_argv, group_members, parse_runtime

KEY = "sk-tools-test"


def _server(tmp_path_factory, *flags):
    d = tmp_path_factory.mktemp("tools-srv")
    srv = spawn("", ("--no-preload", "--models-dir", str(d / "models"), *flags), d)
    srv.wait_ready()
    return srv


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = _server(tmp_path_factory, "--tools", "all")
    yield s
    s.stop()


def call(srv, tool, params, headers=None, timeout=30.0, **extra):
    r = httpx.post(srv.url("/tools"), json={"tool": tool, "params": params, **extra}, headers=headers or {},
                   timeout=timeout)
    return r.status_code, r.json()


def _wait_gone(pgid: int, seconds: float = 10.0) -> list[int]:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        left = group_members(pgid)
        if not left:
            return []
        time.sleep(0.05)
    return group_members(pgid)


# -- paths --------------------------------------------------------------------------------------

@pytest.fixture
def box(tmp_path):
    """A cwd with a file, a secret next to it (outside), a symlink out, a FIFO."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "ok.txt").write_text("inside\n")
    (tmp_path / "secret.txt").write_text("SECRET-MARKER-42\n")
    (cwd / "out").symlink_to(tmp_path)  # a directory link leaving the cwd
    (cwd / "leak.txt").symlink_to(tmp_path / "secret.txt")  # a file link leaving it
    os.mkfifo(cwd / "fifo")
    return cwd


def test_relative_paths_stay_inside_cwd(srv, box):
    h = {"x-tool-cwd": str(box)}
    assert call(srv, "read_file", {"path": "ok.txt"}, h) == (200, {"plain_text_response": "inside\n"})
    for path in ("../secret.txt", "sub/../../secret.txt", "out/secret.txt", "leak.txt"):
        status, body = call(srv, "read_file", {"path": path}, h)
        assert status == 200 and "SECRET" not in json.dumps(body), (path, body)
        assert body["error"].startswith(("path is outside the working directory",
                                         "path leaves the working directory")), body
    status, body = call(srv, "write_file", {"path": "out/pwned.txt", "content": "x"}, h)
    assert "through a symlink" in body["error"] and not (box.parent / "pwned.txt").exists()
    status, body = call(srv, "write_file", {"path": "../pwned.txt", "content": "x"}, h)
    assert "outside the working directory" in body["error"] and not (box.parent / "pwned.txt").exists()
    status, body = call(srv, "edit_file", {"path": "leak.txt", "edits": [{"old_text": "SECRET", "new_text": "x"}]}, h)
    assert "through a symlink" in body["error"]
    assert (box.parent / "secret.txt").read_text() == "SECRET-MARKER-42\n"
    # an absolute path that lies in the cwd cannot leave it through a link either
    status, body = call(srv, "read_file", {"path": str(box / "leak.txt")}, h)
    assert "through a symlink" in body["error"]


def test_grep_and_glob_do_not_follow_links_out(srv, box):
    h = {"x-tool-cwd": str(box)}
    status, body = call(srv, "grep_search", {"path": ".", "pattern": "SECRET-MARKER"}, h)
    assert status == 200 and body["plain_text_response"] == "\n---\nTotal matches: 0\n"
    status, body = call(srv, "grep_search", {"path": ".", "pattern": "inside"}, h)
    assert body["plain_text_response"] == "ok.txt:inside\n\n---\nTotal matches: 1\n"
    status, body = call(srv, "file_glob_search", {"path": ".", "type": "all"}, h)
    # the directory link is listed, never walked; the FIFO is no file
    assert sorted(e["path"] for e in body["entries"]) == ["leak.txt", "ok.txt", "out"]


def test_fifo_and_devices_refused_without_hanging(srv, box):
    h = {"x-tool-cwd": str(box)}
    t0 = time.monotonic()
    for tool, params in (("read_file", {"path": "fifo"}), ("write_file", {"path": "fifo", "content": "x"}),
                         ("edit_file", {"path": "fifo", "edits": [{"old_text": "a", "new_text": "b"}]}),
                         ("read_file", {"path": "/dev/zero", "start_line": 1, "end_line": 2}),
                         ("read_file", {"path": "/dev/urandom"}),
                         ("write_file", {"path": "/dev/null", "content": "x"})):
        status, body = call(srv, tool, params, h, timeout=10)
        assert status == 200 and "not a regular file" in body["error"], (tool, params, body)
    assert time.monotonic() - t0 < 10


def test_confine_keeps_absolute_paths_inside(tmp_path_factory, box):
    s = _server(tmp_path_factory, "--tools", "read_file,write_file", "--tools-confine")
    try:
        h = {"x-tool-cwd": str(box)}
        status, body = call(s, "read_file", {"path": str(box.parent / "secret.txt")}, h)
        assert status == 200 and body["error"].startswith("path is outside the working directory"), body
        assert call(s, "read_file", {"path": str(box / "ok.txt")}, h)[1] == {"plain_text_response": "inside\n"}
        status, body = call(s, "read_file", {"path": "~/.bashrc"}, h)
        assert "outside the working directory" in body["error"]
        # only the tools named are offered
        assert [t["tool"] for t in httpx.get(s.url("/tools")).json()] == ["read_file", "write_file"]
        assert call(s, "exec_shell_command", {"command": "id"})[0] == 404
    finally:
        s.stop()


def test_params_cannot_choose_cwd_or_runtime(srv, box, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "ok.txt").write_text("other\n")
    status, body = call(srv, "read_file", {"path": "ok.txt", "cwd": str(other), "runtime": "docker-container:x",
                                           "resp_type": "base64"}, {"x-tool-cwd": str(box)})
    assert (status, body) == (200, {"plain_text_response": "inside\n"})
    status, body = call(srv, "exec_shell_command", {"command": "pwd", "cwd": "/", "runtime": "docker-container:x"},
                        {"x-tool-cwd": str(box)})
    assert body == {"plain_text_response": f"{box}\n\n[exit code: 0]"}


# -- the container runtime: no option smuggled onto the engine's command line -----------------------

@pytest.mark.parametrize("spec, message", [
    ("docker-container:--privileged", "invalid container id: --privileged"),
    ("podman-container:-v/:/host", "invalid container id: -v/:/host"),
    ("docker-container:abc --privileged", "invalid container id: abc --privileged"),
    ("docker-container:abc;id", "invalid container id: abc;id"),
    ("docker-container:", "invalid container id: "),
    ("docker-container:abc/../x", "invalid container id: abc/../x"),
    ("docker:busybox", "tool runtime must name a running container: docker:busybox"),
    ("ssh:-oProxyCommand=touch /tmp/pwned", "invalid ssh target: -oProxyCommand=touch /tmp/pwned"),
    ("nerdctl-container:abc", "unknown tool runtime: nerdctl-container:abc"),
    ("DOCKER-container:abc", "unknown tool runtime: DOCKER-container:abc"),
])
def test_runtime_specs_refused(srv, spec, message):
    with pytest.raises(ToolRuntimeError) as e:
        parse_runtime(spec)
    assert e.value.message == message
    status, body = call(srv, "exec_shell_command", {"command": "echo hi"}, {"x-tool-runtime": spec})
    assert status == 500 and body["error"]["message"].startswith(message), body


def test_container_argv_keeps_caller_text_after_the_id(monkeypatch):
    """The argv built for a container: ENGINE exec [-i] ID, then only the inner command; the caller's
    cwd, paths and command are positional arguments of sh, never options of the engine."""
    seen: list[list[str]] = []

    async def fake_run(argv, ctx, timeout_s, max_output, cwd=None, stdin=None, registry=None):
        seen.append(list(argv))
        return ProcessResult("", 0)

    monkeypatch.setattr(B, "run_process", fake_run)
    cwd = '/w"; rm -rf / #'
    ctx = ToolContext(cwd=cwd, runtime="podman-container:c0ffee_1.x")
    tool = B.ExecShellCommand()
    asyncio.run(tool.run({"command": "--privileged; id", "timeout": 7}, ctx))
    assert seen[-1] == ["podman", "exec", "-i", "c0ffee_1.x", "sh", "-c", 'cd "$1" || exit 127; shift; exec "$@"',
                        "_", cwd, "timeout", "7s", "sh", "-c", "--privileged; id"]
    asyncio.run(B.ReadFile().run({"path": "-rf"}, ToolContext(cwd="/w", runtime="docker-container:abc")))
    assert seen[-2] == ["docker", "exec", "abc", "sh", "-c", '[ -f "$1" ]', "_", "/w/-rf"]
    asyncio.run(B.WriteFile().run({"path": "/x y", "content": "z"}, ToolContext(runtime="docker-container:abc")))
    assert seen[-1] == ["docker", "exec", "-i", "abc", "sh", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1"', "_",
                        "/x y"]
    for argv in seen:  # nothing before the id looks like an option but the engine's own -i
        i = argv.index("abc") if "abc" in argv else argv.index("c0ffee_1.x")
        assert [a for a in argv[1:i] if a.startswith("-")] in ([], ["-i"])
    assert container_argv(parse_runtime("docker-container:a"), ["ls"]) == ["docker", "exec", "a", "ls"]


FAKE_ENGINE = """#!/bin/sh
# stands in for `docker exec [-i] ID CMD...` (no container engine on this machine): logs the id and
# runs CMD here, so the tools' container code paths run end to end
[ "$1" = exec ] || exit 125
shift
[ "$1" = -i ] && shift
printf '%s\\n' "$1" >> "$FAKE_ENGINE_LOG"
shift
exec "$@"
"""


def test_container_runtime_end_to_end_with_a_stand_in_engine(monkeypatch, tmp_path):
    """The container I/O (write through stdin, cat, wc, find, the in-container timeout) against a
    stand-in ``docker`` that runs the command on this machine (a mock: no engine can run here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(FAKE_ENGINE)
    (bin_dir / "docker").chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    log = tmp_path / "engine.log"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_ENGINE_LOG", str(log))
    reg = ToolRegistry.from_names("all")

    def run(tool, params):
        return asyncio.run(reg.get(tool).run(params, ToolContext(cwd=str(work), runtime="docker-container:c1")))

    assert run("write_file", {"path": "sub/test.log", "content": "hello container\n"}) == {
        "result": "file written successfully", "path": "sub/test.log", "bytes": 16}
    assert (work / "sub" / "test.log").read_text() == "hello container\n"
    assert run("read_file", {"path": "sub/test.log", "append_loc": True}) == {
        "plain_text_response": "1\u2192hello container\n"}
    assert run("exec_shell_command", {"command": "cat sub/test.log"}) == {
        "plain_text_response": "hello container\n\n[exit code: 0]"}
    assert run("edit_file", {"path": "sub/test.log", "edits": [{"old_text": "hello", "new_text": "bye"}]})[
        "edits_applied"] == 1
    assert run("grep_search", {"path": ".", "pattern": "bye"})["plain_text_response"] == (
        "sub/test.log:bye container\n\n---\nTotal matches: 1\n")
    res = run("file_glob_search", {"path": ".", "type": "all"})
    assert sorted((e["path"], e["type"]) for e in res["entries"]) == [("sub", "dir"), ("sub/test.log", "file")]
    assert run("read_file", {"path": "missing.txt"}) == {"error": "cannot stat file: missing.txt"}
    res = run("exec_shell_command", {"command": "sleep 30", "timeout": 1})
    assert res["plain_text_response"].startswith("\n[exit code: 124]")  # the in-container timeout's status
    assert set(log.read_text().split()) == {"c1"}


# -- bounds: floods, timeouts, process groups -----------------------------------------------------

def test_output_flood_capped(srv):
    t0 = time.monotonic()
    status, body = call(srv, "exec_shell_command", {"command": "yes", "timeout": 2})
    text = body["plain_text_response"]
    assert status == 200 and time.monotonic() - t0 < 15
    assert text.endswith("\n[output truncated]\n[exit code: -9] [exit due to timed out]")
    assert len(text.split("\n[output truncated]")[0].encode()) == B.EXEC_MAX_OUTPUT_SIZE
    status, body = call(srv, "exec_shell_command", {"command": "head -c 100000 /dev/zero | tr '\\0' a",
                                                    "max_output_size": 100})
    assert body["plain_text_response"] == "a" * 100 + "\n[output truncated]\n[exit code: 0]"
    # the stream stops sending at the cap too
    events = _stream(srv, {"command": "yes | head -c 1000000", "max_output_size": 5000})
    chunks = "".join(e.get("chunk", "") for e in events)
    assert chunks == "y\n" * 2500 + "\n[output truncated]\n[exit code: 0]" and events[-1] == {"done": True}


def _stream(srv, params, headers=None):
    with httpx.stream("POST", srv.url("/tools"), json={"tool": "exec_shell_command", "params": params,
                                                        "stream": True}, headers=headers or {}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


FORK_LOOP = ("echo $$; i=0; while [ $i -lt 100 ]; do sleep 300 & i=$((i+1)); done; "
             "(sleep 300 &); (sh -c 'sleep 300 & sleep 300' &); sleep 300")


def test_timeout_kills_the_whole_group(srv):
    t0 = time.monotonic()
    status, body = call(srv, "exec_shell_command", {"command": FORK_LOOP, "timeout": 2})
    text = body["plain_text_response"]
    assert time.monotonic() - t0 < 20
    pgid = int(text.split("\n", 1)[0])
    assert text.endswith("[exit code: -9] [exit due to timed out]")
    assert _wait_gone(pgid) == []


def test_command_end_kills_its_background_children(srv):
    # the shell exits at once; a child that closed its output would live on without the group kill
    status, body = call(srv, "exec_shell_command", {"command": "echo $$; sleep 300 >/dev/null 2>&1 &"})
    pgid = int(body["plain_text_response"].split("\n", 1)[0])
    assert body["plain_text_response"].endswith("[exit code: 0]")
    assert _wait_gone(pgid) == []


def test_stream_client_gone_kills_the_group(srv):
    with httpx.stream("POST", srv.url("/tools"), json={"tool": "exec_shell_command", "stream": True,
                                                      "params": {"command": FORK_LOOP, "timeout": 60}},
                      timeout=30) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the response
        first = next(line for line in lines if line.startswith("data: "))
        pgid = int(json.loads(first[6:])["chunk"].split("\n", 1)[0])
        end = time.monotonic() + 10
        while len(group_members(pgid)) < 100 and time.monotonic() < end:
            time.sleep(0.05)
        assert len(group_members(pgid)) >= 100  # the client is still there: the command runs on
    # the connection is closed: the command must not run on to its 60 s
    assert _wait_gone(pgid, 15) == []


def test_stream_client_gone_before_any_output(srv, tmp_path):
    pidfile = tmp_path / "pid"
    with pytest.raises(httpx.ReadTimeout):
        with httpx.stream("POST", srv.url("/tools"), json={"tool": "exec_shell_command", "stream": True, "params": {
                "command": f"echo $$ > {pidfile}; sleep 300", "timeout": 60}}, timeout=2) as r:
            r.read()
    pgid = int(pidfile.read_text())
    assert _wait_gone(pgid, 15) == []


def test_utf8_cwd_header(srv, tmp_path):
    d = tmp_path / "d\u00e9j\u00e0-vu"
    d.mkdir()
    (d / "f.txt").write_text("ok\n")
    r = httpx.post(srv.url("/tools"), json={"tool": "read_file", "params": {"path": "f.txt"}},
                   headers={"x-tool-cwd": str(d).encode()}, timeout=10)
    assert r.json() == {"plain_text_response": "ok\n"}


def test_client_gone_kills_a_non_streaming_call(srv, tmp_path):
    pidfile = tmp_path / "pid"
    with pytest.raises(httpx.ReadTimeout):
        call(srv, "exec_shell_command", {"command": f"echo $$ > {pidfile}; sleep 300 & sleep 300",
                                         "timeout": 60}, timeout=2)
    pgid = int(pidfile.read_text())
    assert _wait_gone(pgid, 15) == []


def test_server_stop_kills_running_commands(tmp_path_factory, tmp_path):
    s = _server(tmp_path_factory, "--tools", "exec_shell_command")
    pidfile = tmp_path / "pid"
    try:
        with httpx.stream("POST", s.url("/tools"), json={"tool": "exec_shell_command", "stream": True,
                                                        "params": {"command": f"echo $$ > {pidfile}; echo go; "
                                                                              "sleep 300", "timeout": 60}},
                          timeout=30) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            pgid = int(pidfile.read_text())
            assert group_members(pgid)
            s.proc.send_signal(signal.SIGTERM)
            s.proc.wait(timeout=30)
    except httpx.HTTPError:
        pass
    finally:
        s.stop()
    assert _wait_gone(pgid, 15) == []


def test_file_names_that_are_not_utf8(srv, tmp_path):
    d = tmp_path / "names"
    d.mkdir()
    with open(os.path.join(os.fsencode(d), b"bad-\xff.txt"), "w") as f:
        f.write("hit\n")
    status, body = call(srv, "file_glob_search", {"path": str(d)})
    assert status == 200 and body["entries"] == [{"path": "bad-\ufffd.txt", "type": "file"}]
    status, body = call(srv, "grep_search", {"path": str(d), "pattern": "hit"})
    assert body["plain_text_response"] == "bad-\ufffd.txt:hit\n\n---\nTotal matches: 1\n"


def test_read_range_of_a_huge_line_is_bounded(monkeypatch, tmp_path):
    """A line range of a file with one huge line reads at most the range cap (here 1 MiB), not the line."""
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.write(b"x" * (3 << 20) + b"\nsecond\n")
    monkeypatch.setattr(B, "READ_FILE_MAX_RANGE_SIZE", 1 << 20)
    res = asyncio.run(B.ReadFile().run({"path": str(big), "start_line": 2, "end_line": 2}, ToolContext()))
    assert res == {"plain_text_response": "[output truncated]"}
    res = asyncio.run(B.ReadFile().run({"path": str(big), "start_line": 1, "end_line": 1}, ToolContext()))
    assert res == {"plain_text_response": "[output truncated]"}
    (tmp_path / "s.txt").write_text("a\nb\nc")
    res = asyncio.run(B.ReadFile().run({"path": str(tmp_path / "s.txt"), "start_line": 2}, ToolContext()))
    assert res == {"plain_text_response": "b\nc\n"}


def test_missing_cwd_and_bad_params(srv, tmp_path):
    status, body = call(srv, "exec_shell_command", {"command": "echo hi"}, {"x-tool-cwd": str(tmp_path / "nope")})
    assert status == 200 and body["plain_text_response"].endswith("[exit code: -1]")
    assert call(srv, "read_file", {}) == (400, {"error": {"code": 400, "message": "missing required param 'path'",
                                                          "type": "invalid_request_error"}})
    assert call(srv, "read_file", {"path": 5})[0] == 400
    assert call(srv, "grep_search", {"path": ".", "pattern": "("})[1]["error"].startswith("invalid regex")
    assert call(srv, "read_file", {"path": "a\u0000b"})[1]["error"].startswith("invalid path (NUL byte)")
    r = httpx.post(srv.url("/tools"), content=b"{not json", timeout=10)
    assert r.status_code == 400
    assert call(srv, "get_info", {}, stream=True) == (404, {"error": {
        "code": 404, "message": 'tool "get_info" does not support stream = true', "type": "invalid_request_error"}})


def test_grep_regex_cannot_run_away(monkeypatch, tmp_path):
    """A backtracking pattern is stopped by the search's time limit (here 1 s, 15 s in the server),
    in a worker thread: the event loop keeps serving."""
    (tmp_path / "a.txt").write_text("a" * 40 + "!\n")
    (tmp_path / "b.txt").write_text("aaa\n")
    monkeypatch.setattr(B, "LIST_TIMEOUT", 1.0)

    async def run():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        t = asyncio.ensure_future(tick())
        res = await B.GrepSearch().run({"path": str(tmp_path), "pattern": "(a|aa)+$", "include": "a.txt"},
                                       ToolContext())
        t.cancel()
        return res, ticks

    t0 = time.monotonic()
    res, ticks = asyncio.run(run())
    assert time.monotonic() - t0 < 20 and ticks > 3
    assert res == {"plain_text_response": "\n---\nTotal matches: 0\n[search stopped: time or output limit reached. "
                                          "Narrow the path/pattern/include.]\n"}


# -- the gate: flag, key, origin, host ------------------------------------------------------------

def test_off_without_tools_flag(tmp_path_factory):
    s = _server(tmp_path_factory)
    try:
        disabled = {"error": {"message": "this feature is disabled", "type": "feature_disabled"}}
        r = httpx.get(s.url("/tools"))
        assert (r.status_code, r.json()) == (403, disabled)
        r = httpx.post(s.url("/tools"), json={"tool": "exec_shell_command", "params": {"command": "id"}})
        assert (r.status_code, r.json()) == (403, disabled)
    finally:
        s.stop()


def test_api_key_origin_and_host(tmp_path_factory):
    s = _server(tmp_path_factory, "--tools", "all", "--api-key", KEY)
    try:
        body = {"tool": "get_info", "params": {}}
        for method in ("GET", "POST"):
            r = httpx.request(method, s.url("/tools"), json=body if method == "POST" else None)
            assert r.status_code == 401 and r.json()["error"]["message"] == "Invalid API Key"
        auth = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(s.url("/tools"), headers=auth).status_code == 200
        assert httpx.post(s.url("/tools"), json=body, headers=auth).json()["cwd"]
        r = httpx.post(s.url("/tools"), json=body, headers={**auth, "Origin": "http://localhost:5173"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:5173"
        r = httpx.post(s.url("/tools"), json=body, headers={**auth, "Origin": "https://evil.example"})
        assert (r.status_code, r.json()["error"]["message"]) == (403, "origin not allowed")
        r = httpx.options(s.url("/tools"), headers={"Origin": "https://evil.example",
                                                    "Access-Control-Request-Method": "POST"})
        assert r.status_code == 403
        r = httpx.post(s.url("/tools"), json=body, headers={**auth, "Host": "rebind.example"})
        assert (r.status_code, r.json()["error"]["message"]) == (403, "host not allowed")
    finally:
        s.stop()


def test_flags_refuse_unknown_tools_and_runtimes(tmp_path):
    import subprocess
    import sys

    for flags, text in ((["--tools", "read_file,rm_rf"], 'tools setup failed: unknown tool "rm_rf". available tools: '
                         "read_file, file_glob_search, grep_search, exec_shell_command, write_file, edit_file, "
                         "get_info"),
                        (["--tools", "all", "--tools-runtime", "docker:busybox"],
                         "tools setup failed: tool runtime must name a running container: docker:busybox"),
                        (["--tools", "all", "--tools-runtime", "docker-container:-v"],
                         "tools setup failed: invalid container id: -v")):
        p = subprocess.run([sys.executable, "-m", "kvserve", "serve", "--no-preload", *flags], capture_output=True,
                           text=True, timeout=60, cwd=str(Path(__file__).resolve().parents[2]))
        assert p.returncode == 2 and text in p.stderr, p.stderr


def test_registry_interface():
    reg = ToolRegistry.from_names("read_file,get_info")
    assert [t.name for t in reg.list()] == ["read_file", "get_info"] and reg.enabled
    assert reg.get("read_file").entry() == {
        "display_name": "Read file", "tool": "read_file", "type": "server", "permissions": {"write": False},
        "uses_cwd": True, "definition": B.ReadFile().definition()}
    assert not ToolRegistry.from_names([]).enabled
    assert reg.add(B.GetInfo()) is False  # a taken name is skipped
    with pytest.raises(ValueError, match='unknown tool "x"'):
        ToolRegistry.from_names(["x"])
    assert [t.name for t in ToolRegistry.from_names("all").list()] == list(
        ("read_file", "file_glob_search", "grep_search", "exec_shell_command", "write_file", "edit_file", "get_info"))


def test_glob_rules():
    assert B.path_glob_match("*.cpp", "a/b/c.cpp") and not B.path_glob_match("*.cpp", "a/b/c.h")
    assert B.path_glob_match("src/*.cpp", "src/a.cpp") and B.path_glob_match("src/*.cpp", "x/src/a.cpp")
    assert not B.path_glob_match("src/*.cpp", "src/sub/a.cpp") and B.path_glob_match("src/**/*.cpp", "src/s/t/a.cpp")
    assert B.path_glob_match("*proj*", "project-alpha") and B.path_glob_match("[!a]*.txt", "b.txt")
    assert not B.path_glob_match("[!a]*.txt", "a.txt") and B.path_glob_match("?.md", "x/a.md")


def test_edit_rules():
    assert B.apply_edits("a\nb\n", [("a", "x"), ("b", "y")], "f") == ("x\ny\n", None)
    assert B.apply_edits("dup dup", [("dup", "x")], "f")[1] == "found 2 occurrences of edits[0].old_text in f, it " \
                                                            "must be unique"
    assert B.apply_edits("l1\nl2\n", [("l1\nl2", "a"), ("l2", "b")], "f")[1] == (
        "edits[0] and edits[1] overlap in f; merge them into one edit or target disjoint regions")
    # fuzzy: trailing spaces and smart quotes in the file, plain text in the edit; untouched lines kept
    assert B.apply_edits("keep  \nsay \u201chi\u201d  \n", [('say "hi"', "bye")], "f") == ("keep  \nbye\n", None)
    assert B.apply_edits("a", [("a", "a")], "f")[1] == "no changes made: the replacement(s) produced identical content"
    assert B.apply_edits("a", [("zz", "a")], "f")[1].startswith("could not find edits[0].old_text in f")


# -- llama-server as the oracle ---------------------------------------------------------------------

def _oracle_cases(d: Path) -> list[tuple[str, dict]]:
    f = str(d / "a.txt")
    return [
        ("write_file", {"path": f, "content": "alpha\nbeta\n  gamma  \nbeta2\ndelta"}),
        ("read_file", {"path": f}),
        ("read_file", {"path": f, "start_line": 2, "end_line": 3, "append_loc": True}),
        ("read_file", {"path": f, "start_line": 9}),
        ("read_file", {"path": str(d / "missing.txt")}),
        ("grep_search", {"path": str(d), "pattern": "beta"}),
        ("grep_search", {"path": str(d), "pattern": "BETA", "ignore_case": True, "return_line_numbers": True}),
        ("grep_search", {"path": str(d), "pattern": "gamma", "context_lines": 1}),
        ("grep_search", {"path": f, "pattern": "a.", "literal": True}),
        ("grep_search", {"path": str(d), "pattern": "alpha", "include": "*.md"}),
        ("grep_search", {"path": str(d), "pattern": "alpha", "exclude": "a.*"}),
        ("grep_search", {"path": str(d / "nope"), "pattern": "x"}),
        ("write_file", {"path": str(d / "sub" / "deep" / "b.md"), "content": "alpha\n"}),
        ("file_glob_search", {"path": str(d)}),
        ("file_glob_search", {"path": str(d), "type": "dir"}),
        ("file_glob_search", {"path": str(d), "type": "all", "max_depth": 2}),
        ("file_glob_search", {"path": str(d), "include": "*.md", "limit": 1}),
        ("file_glob_search", {"path": str(d), "limit": 0}),
        ("file_glob_search", {"path": str(d), "type": "x"}),
        ("file_glob_search", {"path": str(d / "nope")}),
        ("edit_file", {"path": f, "edits": [{"old_text": "beta", "new_text": "B"}]}),
        ("edit_file", {"path": f, "edits": [{"old_text": "alpha\nbeta", "new_text": "x"},
                                            {"old_text": "beta\n", "new_text": "y"}]}),
        ("edit_file", {"path": f, "edits": [{"old_text": "zzz", "new_text": "y"}]}),
        ("edit_file", {"path": f, "edits": [{"old_text": "", "new_text": "y"}]}),
        ("edit_file", {"path": f, "edits": []}),
        ("edit_file", {"path": f, "edits": [{"old_text": "delta", "new_text": "delta"}]}),
        ("edit_file", {"path": f, "edits": [{"old_text": "gamma\n", "new_text": "G\n"},
                                            {"old_text": "alpha", "new_text": "A"}]}),
        ("read_file", {"path": f}),
        ("exec_shell_command", {"command": "echo out; echo err >&2; exit 4"}),
        ("exec_shell_command", {"command": "printf 'x%.0s' $(seq 50)", "max_output_size": 10}),
    ]


def test_answers_match_llama_server(srv, smollm2_path, tmp_path):
    """The same calls, in two fresh directories, answered by kvserve and by the real llama-server
    (``$KVSERVE_LLAMA_SERVER``, built from the commit the seeds pin): identical JSON, the paths aside."""
    import subprocess

    binary = os.environ.get("KVSERVE_LLAMA_SERVER")
    if not binary or not os.path.exists(binary):
        pytest.skip("set KVSERVE_LLAMA_SERVER to a llama-server binary")
    from servers import free_port

    port = free_port()
    proc = subprocess.Popen([binary, "-m", smollm2_path, "--host", "127.0.0.1", "--port", str(port), "-c", "512",
                             "--tools", "all"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert httpx.get(base + "/tools").json() == httpx.get(srv.url("/tools")).json()
        answers = {}
        for who, url in (("llama", base), ("kv", srv.base_url)):
            d = tmp_path / who
            d.mkdir()
            out = []
            for tool, params in _oracle_cases(d):
                r = httpx.post(url + "/tools", json={"tool": tool, "params": params}, timeout=30)
                out.append((r.status_code, json.loads(r.text.replace(str(d), "<D>"))))
            answers[who] = out
        for case, a, b in zip(_oracle_cases(tmp_path), answers["llama"], answers["kv"]):
            assert a == b, case
    finally:
        proc.terminate()
        proc.wait(timeout=10)
