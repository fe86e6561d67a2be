"""Where a tool's processes run, and how they are started, capped and killed.

Runtimes (llama-server's ``x-tool-runtime`` / ``--tools-runtime`` specs, :func:`parse_runtime`):

* none: the host, in the call's cwd;
* ``docker-container:ID`` / ``podman-container:ID``: an already running container, driven through
  ``ENGINE exec [-i] ID ARGV...``. The id must start with a letter or digit and hold only letters,
  digits, ``.``, ``-`` and ``_`` (llama-server's rule): an id such as ``--privileged`` would become an
  option of the engine. The engine is one of the two fixed names, never the caller's text, and
  everything the caller gives (cwd, paths, the command) travels after the id, where the engine reads
  no options: the inner ``sh -c 'cd "$1" ...' _ CWD`` takes the cwd as a positional argument, never
  spliced into a script. Any other spec is refused with llama-server's texts: ``docker:IMAGE`` (a
  container kvserve would start: not available here), ``ssh:TARGET`` (remoting, not isolation: not
  offered; a target starting with ``-`` is refused as ``invalid ssh target`` first, as llama-server),
  anything else ``unknown tool runtime: SPEC``.

Processes (:func:`run_process`): every command starts in its own session and process group
(``start_new_session``), with stdin from ``/dev/null`` (or the bytes given), stdout and stderr
combined; output past ``max_output`` bytes is read and dropped (the child never blocks on a full pipe)
and ``[output truncated]`` is added. The whole group gets SIGKILL, repeated until it is empty, when
the time is up, when the call's :attr:`~kvserve.tools.base.ToolContext.cancelled` is set (client
gone) or the server stops (:meth:`~kvserve.tools.base.ToolRegistry.close`), and always once the
command's own process has exited (background children it left die with it).

On Linux every command runs under a reaper (kvserve/tools/reaper.py: a child subreaper, which the
command's orphaned descendants are reparented to, whatever session or group they moved to): at each of
those ends kvserve first SIGTERMs the reaper, which SIGKILLs the command's whole remaining tree, so a
``setsid``/double-fork child dies with its call too. If kvserve itself is SIGKILLed, the reaper gets
SIGTERM from the kernel (its parent-death signal) and does the same. A command that SIGKILLs its
parent hands its tree to the reaper (the parent is a waiting fork of it); one that SIGKILLs the reaper
itself leaves orphans that kvserve finds by the per-call variable ``KVSERVE_TOOL_CALL`` they started
with (:func:`kill_marked`) and kills.
"""

from __future__ import annotations

import asyncio
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvserve import procs
from kvserve.tools.base import ToolContext, ToolRuntimeError

ENGINES = ("docker", "podman")
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
_SSH_TARGET = re.compile(r"[A-Za-z0-9._@-]+\Z")
#: seconds a container's auxiliary command (stat, cat, find) may take (llama-server's)
ISOLATE_EXEC_TIMEOUT = 15.0
#: bytes read from a pipe at once
_CHUNK = 4096
#: how long the kill loop keeps sending SIGKILL to a group that still has members (s)
_KILL_WINDOW = 2.0
#: the reaper every command runs under (Linux: kvserve/tools/reaper.py, see :func:`stream_process`)
_REAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reaper.py")
USE_REAPER = sys.platform.startswith("linux")
#: seconds the reaper may take to start the command (at most: a call's shorter timeout bounds it), and
#: to clean up when told to
_REAPER_START_S = 10.0
_REAPER_STOP_S = 2.0


_EXECUTOR = None


def in_thread(fn, *args):
    """Run ``fn(*args)`` in the tools' own worker threads (4 at most; an awaitable): file I/O, walks
    and regular expressions of tool calls never take the default executor's threads, which model
    loading and the other faces use."""
    global _EXECUTOR
    if _EXECUTOR is None:
        from concurrent.futures import ThreadPoolExecutor

        _EXECUTOR = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvserve-tools")
    return asyncio.get_running_loop().run_in_executor(_EXECUTOR, fn, *args)


@dataclass(frozen=True, slots=True)
class RuntimeSpec:
    """A validated container runtime: ``engine`` (``docker`` | ``podman``) and ``container``."""

    engine: str
    container: str

    @property
    def spec(self) -> str:
        return f"{self.engine}-container:{self.container}"


def parse_runtime(spec: str | None) -> RuntimeSpec | None:
    """The runtime ``spec`` names (None or "": the host). Raises ToolRuntimeError with llama-server's
    texts: ``invalid container id: X``, ``tool runtime must name a running container: X``,
    ``invalid ssh target: X``, ``unknown tool runtime: X``."""
    if not spec:
        return None
    for engine in ENGINES:
        attach = f"{engine}-container:"
        if spec.startswith(attach):
            cid = spec[len(attach):]
            if not _ID.match(cid):
                raise ToolRuntimeError(f"invalid container id: {cid}")
            return RuntimeSpec(engine, cid)
        if spec.startswith(f"{engine}:"):
            raise ToolRuntimeError(f"tool runtime must name a running container: {spec}")
    if spec.startswith("ssh:"):
        target = spec[4:]
        if not target or target.startswith("-") or not _SSH_TARGET.match(target):
            raise ToolRuntimeError(f"invalid ssh target: {target}")
        raise ToolRuntimeError(f"unknown tool runtime: {spec} (kvserve runs tools on the host or in a running "
                               "docker/podman container)")
    raise ToolRuntimeError(f"unknown tool runtime: {spec}")


def container_argv(rt: RuntimeSpec, inner: list[str], stdin: bool = False, cwd: str | None = None) -> list[str]:
    """The host argv that runs ``inner`` (a complete argv) in ``rt``'s container: ``ENGINE exec [-i]
    ID [sh -c 'cd "$1" || exit 127; shift; exec "$@"' _ CWD] INNER...`` (no option after the id)."""
    if cwd:
        inner = ["sh", "-c", 'cd "$1" || exit 127; shift; exec "$@"', "_", cwd, *inner]
    return [rt.engine, "exec", *(["-i"] if stdin else []), rt.container, *inner]


@dataclass
class ProcessResult:
    """What :func:`run_process` saw: ``output`` (text, capped, ``[output truncated]`` appended when
    cut), ``exit_code`` (the command's status; -SIG when killed by a signal; -1 when it could not
    start), ``timed_out``, ``cancelled`` (the caller went away) and ``raw`` (the capped bytes)."""

    output: str
    exit_code: int
    timed_out: bool = False
    cancelled: bool = False
    raw: bytes = b""


def _proc_files(leaf: str):
    """(pid, bytes of /proc/PID/<leaf>) for every process this one can read (Linux); nothing elsewhere.
    A process that ends during the scan is skipped."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/{leaf}", "rb") as f:
                yield int(name), f.read()
        except OSError:
            continue


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of group ``pgid``, read from ``/proc`` (Linux); [] elsewhere."""
    out = []
    for pid, stat in _proc_files("stat"):
        fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if len(fields) > 2 and fields[0] != b"Z" and int(fields[2]) == pgid:
            out.append(pid)
    return out


def _running(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] != b"Z"


#: the environment variable every reaped command starts with (a per-call token; :func:`kill_marked`)
CALL_MARKER = "KVSERVE_TOOL_CALL"


def kill_marked(token: str) -> list[int]:
    """SIGKILL every process whose initial environment (``/proc/PID/environ``) holds
    ``KVSERVE_TOOL_CALL=token``; the pids signalled. The fallback for a reaper that died before it could
    clean up (a command that SIGKILLed it): its orphans, reparented to init, are found by the marker
    their call gave them. A process that replaced its environment by exec (``env -i``) is not found."""
    want = f"{CALL_MARKER}={token}".encode()
    hit = []
    me = os.getpid()
    for pid, env in _proc_files("environ"):
        if pid == me:
            continue
        if want in env.split(b"\0"):
            try:
                os.kill(pid, signal.SIGKILL)
                hit.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
    return hit


def kill_group(pgid: int) -> None:
    """End a tool command's group: when its leader is a reaper (kvserve/tools/reaper.py), SIGTERM it (it
    SIGKILLs every descendant of the command, those that left its group included) and wait for it at most
    :data:`_REAPER_STOP_S` seconds; then
    SIGKILL every process of group ``pgid``, repeated while live members remain (a fork loop may
    add members while a signal is delivered), for at most :data:`_KILL_WINDOW` seconds."""
    try:
        with open(f"/proc/{pgid}/cmdline", "rb") as f:
            reaper = _REAPER.encode() in f.read().split(b"\0")
    except OSError:
        reaper = False
    if reaper:
        try:
            os.kill(pgid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        end = time.monotonic() + _REAPER_STOP_S
        while _running(pgid) and time.monotonic() < end:
            time.sleep(0.005)
    end = time.monotonic() + _KILL_WINDOW
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # gone, or the id is someone else's now
            return
        if not group_members(pgid) or time.monotonic() > end:
            return
        time.sleep(0.005)


def _kill_group_soon(pgid: int) -> None:
    """SIGKILL group ``pgid`` now; when members are still alive after the first signal, the repeats of
    :func:`kill_group` go on in a tools worker thread, not on the event loop."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    if group_members(pgid):
        in_thread(kill_group, pgid)


class _Status:
    """The reaper's status pipe (kvserve/tools/reaper.py): whether the command's own process has ended,
    and its exit code (:attr:`subprocess.Popen.returncode`'s convention). Without a reaper: the
    process itself."""

    def __init__(self, proc: subprocess.Popen, fd: int | None, pgid: int):
        self.proc, self.fd = proc, fd
        #: the command's process group (its own pid; without a reaper: the process's)
        self.pgid = pgid
        self.code: int | None = None
        #: the call's :data:`CALL_MARKER` value (under the reaper), for :func:`kill_marked`
        self.token: str | None = None
        self._buf = b""

    def _read(self) -> None:
        while self.fd is not None:
            try:
                data = os.read(self.fd, 256)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # the reaper is gone
                os.close(self.fd)
                self.fd = None
                return
            self._buf += data
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                if line.startswith(b"X"):
                    self.code = int(line[1:])

    def exited(self) -> bool:
        """Whether the command's own process has ended (or its reaper did)."""
        if self.fd is None and self.code is None:
            return self.proc.poll() is not None
        self._read()
        return self.code is not None or self.fd is None

    def returncode(self) -> int:
        self._read()
        if self.code is not None:
            return self.code
        return self.proc.returncode if self.proc.returncode is not None else -1

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _StartTimeout(OSError):
    """The call's time ran out before the reaper had started the command (reported as a timeout)."""


def _first_status(fd: int, wait_s: float = _REAPER_START_S) -> bytes:
    """The reaper's first line (``S<pid>`` or ``E<errno>``); b"" when none came within ``wait_s`` seconds
    (a worker thread)."""
    out = b""
    end = time.monotonic() + wait_s
    while not out.endswith(b"\n") and len(out) < 64:
        left = end - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return b""
        c = os.read(fd, 1)
        if not c:
            return b""
        out += c
    return out.strip()


async def _spawn(argv: list[str], cwd: str | None, stdin: bool,
                 limit_s: float = _REAPER_START_S) -> tuple[subprocess.Popen, _Status]:
    """``argv`` for a tool call (:func:`spawn_reaped`): stdin from a pipe (``stdin``) or ``/dev/null``,
    stdout and stderr into one pipe. Raises as :func:`spawn_reaped`."""
    kw = dict(cwd=cwd or None, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return await spawn_reaped(argv, limit_s, **kw)


async def spawn_reaped(argv: list[str], limit_s: float = _REAPER_START_S,
                       **kw) -> tuple[subprocess.Popen, _Status]:
    """``argv`` through :func:`kvserve.procs.spawn_async` (``kw``: its pipes, cwd, env): a new session (its own
    process group), every other descriptor of the server closed (``close_fds``: uvloop's own spawn lets
    its sockets and pipes leak into the child, where a background grandchild would hold the output open
    and a command could write into the server's descriptors), SIGKILLed by the kernel if kvserve dies.
    On Linux ``argv`` runs under the reaper (kvserve/tools/reaper.py, the process spawned here and the
    group's leader; the command leads a group of its own, ``_Status.pgid``), which kills every
    descendant of the command when told to (SIGTERM: :func:`kill_group`), those that left its session
    included. The reaper gets :data:`_REAPER_START_S` seconds to start the command, or ``limit_s`` when
    shorter. Tool commands (:func:`stream_process`) and MCP stdio servers (kvserve/tools/mcp.py) start here.

    Raises OSError: ``argv`` cannot run (the reaper reports exec's errno); _StartTimeout (an OSError):
    ``limit_s`` (< :data:`_REAPER_START_S`) passed before the reaper had started it."""
    if not USE_REAPER:
        proc = await procs.spawn_async(argv, **kw)
        return proc, _Status(proc, None, proc.pid)
    token = os.urandom(8).hex()
    kw["env"] = {**(kw.get("env") or os.environ), CALL_MARKER: token}
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        proc = await procs.spawn_async([sys.executable, "-I", "-S", _REAPER, str(w), *argv], pass_fds=(w,), **kw)
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    try:
        wait_s = min(_REAPER_START_S, max(limit_s, 0.0))
        first = await in_thread(_first_status, r, wait_s)
    except BaseException:
        os.close(r)
        _kill_group_soon(proc.pid)
        raise
    if not (first.startswith(b"S") and first[1:].isdigit()):
        os.close(r)
        _kill_group_soon(proc.pid)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.wait()
        if first.startswith(b"E") and first[1:].isdigit():
            code = int(first[1:])
            raise OSError(code, os.strerror(code), argv[0])
        if not first and wait_s < _REAPER_START_S:
            raise _StartTimeout("the call's time ran out before its command started")
        raise OSError("the command's reaper did not start")
    os.set_blocking(r, False)
    status = _Status(proc, r, int(first[1:]))
    status.token = token
    return proc, status


def _feed(pipe, data: bytes) -> None:
    """Write ``data`` to the child's stdin and close it (a worker thread; a child that stops reading
    gets its stdin closed when it is killed)."""
    try:
        pipe.write(data)
    except (BrokenPipeError, OSError, ValueError):
        pass
    finally:
        try:
            pipe.close()
        except (BrokenPipeError, OSError):
            pass


async def _wait_exit(status: _Status, deadline: float, ctx: ToolContext, res: ProcessResult) -> None:
    """Poll until the command's process exits, its deadline passes (``res.timed_out``) or the call is
    cancelled (``res.cancelled``)."""
    pause = 0.001
    while not status.exited():
        if ctx.cancelled.is_set():
            res.cancelled = True
            return
        if time.monotonic() >= deadline:
            res.timed_out = True
            return
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.05)


async def stream_process(argv: list[str], ctx: ToolContext, timeout_s: float, max_output: int,
                         cwd: str | None = None, stdin: bytes | None = None,
                         registry=None, result: ProcessResult | None = None) -> AsyncIterator[bytes]:
    """Run ``argv`` (its own process group) and yield its combined output as it comes, at most
    ``max_output`` bytes; fill ``result`` (exit code, timed_out, cancelled, the capped bytes) when
    done. Kills the group on timeout, on ``ctx.cancelled``, when the consumer stops iterating
    (client gone: the generator is closed) and after the command exits."""
    res = result if result is not None else ProcessResult("", -1)
    limit = max(0.0, min(timeout_s, ctx.remaining()))
    try:
        proc, status = await _spawn(argv, cwd, stdin is not None, limit)
    except _StartTimeout:
        res.output, res.exit_code, res.timed_out = "", -1, True
        return
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        res.output = f"failed to spawn process: {e.strerror or e}" if isinstance(e, OSError) else \
            "failed to spawn process"
        res.exit_code = -1
        return
    pgid = proc.pid  # the reaper's group (the command's own: status.pgid)
    if registry is not None:
        registry.track(pgid)
        registry.track(status.pgid)
    loop = asyncio.get_running_loop()
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    readable = asyncio.Event()
    loop.add_reader(fd, readable.set)
    feeder = in_thread(_feed, proc.stdin, stdin) if stdin is not None else None
    kept = bytearray()
    truncated = False
    deadline = time.monotonic() + limit
    cancel_wait = asyncio.ensure_future(ctx.cancelled.wait())
    try:
        while True:
            try:
                data = os.read(fd, _CHUNK)
            except BlockingIOError:
                readable.clear()
                left = deadline - time.monotonic()
                if left <= 0:
                    res.timed_out = True
                    break
                ready = asyncio.ensure_future(readable.wait())
                done, _ = await asyncio.wait({ready, cancel_wait}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                ready.cancel()
                if cancel_wait in done:
                    res.cancelled = True
                    break
                if ready not in done:
                    res.timed_out = True
                    break
                continue
            if not data:
                # the output is closed (a coreutils program closes it before it exits): the command
                # still has until its deadline to exit, as llama-server waits for it
                await _wait_exit(status, deadline, ctx, res)
                break
            await asyncio.sleep(0)  # a flood must not hold the event loop
            if truncated:
                if time.monotonic() >= deadline:
                    res.timed_out = True
                    break
                continue
            room = max_output - len(kept)
            if len(data) > room:
                data = data[:room]
                truncated = True
            if data:
                kept += data
                yield data
    finally:
        cancel_wait.cancel()
        loop.remove_reader(fd)
        if status.fd is not None:  # the reaper kills every descendant (those that left the group too)
            try:
                os.kill(pgid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
            end = time.monotonic() + _REAPER_STOP_S
            while proc.poll() is None and time.monotonic() < end:
                await asyncio.sleep(0.002)
        _kill_group_soon(status.pgid)
        _kill_group_soon(pgid)
        proc.stdout.close()
        end = time.monotonic() + 5
        while proc.poll() is None and time.monotonic() < end:
            await asyncio.sleep(0.005)
        if status.token is not None and (proc.returncode or 0) < 0:  # the reaper was killed: no cleanup ran
            await in_thread(kill_marked, status.token)
        res.exit_code = status.returncode()
        status.close()
        if feeder is not None:
            await asyncio.wait({feeder}, timeout=5)
        if registry is not None:
            registry.untrack(pgid)
            registry.untrack(status.pgid)
        res.raw = bytes(kept)
        res.output = bytes(kept).decode("utf-8", "replace") + ("\n[output truncated]" if truncated else "")


async def run_process(argv: list[str], ctx: ToolContext, timeout_s: float, max_output: int,
                      cwd: str | None = None, stdin: bytes | None = None, registry=None) -> ProcessResult:
    """:func:`stream_process` to the end: the whole :class:`ProcessResult`."""
    res = ProcessResult("", -1)
    async for _ in stream_process(argv, ctx, timeout_s, max_output, cwd, stdin, registry, res):
        pass
    return res
