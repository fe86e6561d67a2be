"""One supervised engine process (seed 004 Example 12, "Integration A"): started on a free
loopback port, its log read into kvserve's, ``/health`` polled with backoff until it answers 200,
stopped with SIGTERM then SIGKILL, restarted once if it dies while serving.

Each step answers one supervision problem:

- **a free port**: bound on 127.0.0.1 with port 0, then given to the child (``{port}``);
- **its log**: stdout and stderr (merged) read line by line on a thread into the
  ``kvserve.server`` logger, each line prefixed with ``[MODEL]`` (a line longer than
  :data:`MAX_LINE_BYTES` is logged in pieces of that size); the last :data:`TAIL_LINES` are kept
  for error messages;
- **ready**: ``GET /health`` from 50 ms, doubling to 1 s between polls. Connection refused is not
  recorded (how many happen depends on how fast the child starts); each change of status is
  (``[503, 200]``: llama-server answers 503 while it loads). A child without ``/health`` (404)
  is ready when ``GET /v1/models`` answers 200. Bounded by the spec's start timeout;
- **stop**: SIGTERM to the child's process group (it has its own: ``start_new_session``), SIGKILL
  to the group after :data:`STOP_GRACE_S`; the log is read to its end before the exit code is
  taken, so the child's last lines are kept;
- **kvserve dies**: the child is started by :func:`kvserve.procs.spawn` (``PR_SET_PDEATHSIG`` =
  SIGKILL from one long-lived spawner thread), so even a SIGKILLed kvserve leaves no child.
  (Processes the engine starts itself, such as vLLM's workers, are the engine's to stop: they
  see their parent die.)
- **dies while serving**: a watcher thread sees the exit; the child is started again once (a new
  port, the same health wait); a second death, or a failed restart, leaves it dead with the
  reason in :attr:`EngineChild.error`.

Thread-safety: :meth:`start`, :meth:`stop` and the watcher serialize on one lock; the log reader
only appends to a bounded deque.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from typing import Callable

import httpx

from kvserve import procs
from kvserve.errors import ServerFaultError
from kvserve.supervisor.spec import HOST, EngineSpec

log = logging.getLogger("kvserve.server")

__all__ = ["EngineChild", "EngineStartError", "STOP_GRACE_S", "free_port"]

#: seconds a child has between SIGTERM and SIGKILL
STOP_GRACE_S = 10.0
#: a log line longer than this is logged in pieces (bytes)
MAX_LINE_BYTES = 8192
#: the child's last log lines kept for error messages
TAIL_LINES = 20
#: first and longest wait between two health polls, seconds
POLL_FIRST_S, POLL_MAX_S = 0.05, 1.0
#: one health request's timeout, seconds
POLL_TIMEOUT_S = 5.0

#: set by :func:`abandon_starts` when the server stops: children still starting give up at their next
#: health poll (at most POLL_MAX_S later) and are stopped, so a stop never waits for a start timeout
_SERVER_STOPPING = False


def abandon_starts() -> None:
    """The server is stopping: every child still waiting to become healthy gives up and is stopped
    (its load fails with "was stopped while starting"). Only sets a flag, so it is safe from a
    signal handler (``Drain.on_begin``)."""
    global _SERVER_STOPPING
    _SERVER_STOPPING = True


class EngineStartError(ServerFaultError):
    """A supervised engine that exited before it became healthy, or never became healthy in
    its start timeout; the message names the model and the cause (exit code or timeout, the
    health states seen and the child's last log line)."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (bound with port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class EngineChild:
    """One supervised engine process and its port.

    Args:
        spec: the :class:`EngineSpec` (name, command, start timeout).
        on_restart: called with the new port after a restart succeeded (the runner points its
            upstream there).

    Attributes:
        port: the loopback port the current child serves on (0 before :meth:`start`).
        pid: the current child's process id (None before start).
        states: the health statuses seen by the last start (``[503, 200]``).
        restarts: how many times it was started again after dying while serving (at most 1).
        error: why it is dead for good (a died-twice or a failed restart), else None.
    """

    def __init__(self, spec: EngineSpec, on_restart: Callable[[int], None] | None = None):
        self.spec = spec
        self.on_restart = on_restart
        self.port = 0
        self.pid: int | None = None
        self.states: list[int] = []
        self.restarts = 0
        self.error: str | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._lock = threading.RLock()
        self._stopping = False
        self._serving = False

    @property
    def base_url(self) -> str:
        """The child's OpenAI base URL (``http://127.0.0.1:PORT/v1``)."""
        return f"http://{HOST}:{self.port}/v1"

    @property
    def alive(self) -> bool:
        p = self._proc
        return p is not None and p.poll() is None

    # -- start

    def start(self) -> None:
        """Start the child and wait until ``/health`` answers 200; then watch it.

        Raises:
            EngineStartError: it exited first (its exit code and last log line), or it was not
                healthy within the start timeout (it is then stopped).
            FileNotFoundError/PermissionError (as EngineStartError): the program cannot run.
        """
        with self._lock:
            self._spawn_and_wait()
            self._serving = True
        threading.Thread(target=self._watch, args=(self._proc,), name=f"engine-watch-{self.spec.name}",
                         daemon=True).start()

    def _spawn_and_wait(self) -> None:
        self.port = free_port()
        argv = self.spec.command(self.port)
        log.info("engine '%s': starting %s", self.spec.name, " ".join(argv), extra={"func": "engine"})
        t0 = time.monotonic()
        try:
            proc = procs.spawn(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        except OSError as e:
            raise EngineStartError(f"engine for model '{self.spec.name}' cannot start: {self.spec.program}: "
                                   f"{e.strerror or e}") from None
        self._proc, self.pid = proc, proc.pid
        self.tail.clear()
        self._reader = threading.Thread(target=self._read_log, args=(proc,), name=f"engine-log-{self.spec.name}",
                                        daemon=True)
        self._reader.start()
        try:
            self.states = self._wait_healthy(proc, t0)
        except BaseException:
            self._terminate(proc)
            raise
        log.info("engine '%s': pid %d healthy on port %d in %.1f s, health states %s", self.spec.name, proc.pid,
                 self.port, time.monotonic() - t0, self.states, extra={"func": "engine"})

    def _wait_healthy(self, proc: subprocess.Popen, t0: float) -> list[int]:
        states: list[int] = []
        wait = POLL_FIRST_S
        deadline = t0 + self.spec.start_timeout_s
        path = "/health"
        with httpx.Client(timeout=POLL_TIMEOUT_S, trust_env=False) as http:
            while True:
                code = None
                try:
                    code = http.get(f"http://{HOST}:{self.port}{path}").status_code
                except httpx.HTTPError:
                    pass  # not listening yet
                if code == 404 and path == "/health":  # no health route: its model list says it is up
                    path = "/v1/models"
                    continue
                if code is not None and (not states or states[-1] != code):
                    states.append(code)
                    log.info("engine '%s': health %s", self.spec.name, code, extra={"func": "engine"})
                if code == 200:
                    return states
                if self._stopping or _SERVER_STOPPING:
                    raise EngineStartError(f"engine for model '{self.spec.name}' was stopped while starting")
                rc = proc.poll()
                if rc is not None:
                    self._reader.join(timeout=2)  # its last lines
                    raise EngineStartError(f"engine for model '{self.spec.name}' exited with {_status(rc)} before "
                                           f"it became healthy (health states {states}{self._last_line()})")
                if time.monotonic() >= deadline:
                    raise EngineStartError(f"engine for model '{self.spec.name}' did not become healthy within "
                                           f"{self.spec.start_timeout_s:g} s (health states {states}"
                                           f"{self._last_line()}); stopped it")
                time.sleep(min(wait, max(deadline - time.monotonic(), 0.0)))
                wait = min(wait * 2, POLL_MAX_S)

    def _last_line(self) -> str:
        return f"; its last log line: {self.tail[-1]}" if self.tail else ""

    def _read_log(self, proc: subprocess.Popen) -> None:
        name = self.spec.name
        for raw in iter(lambda: proc.stdout.readline(MAX_LINE_BYTES), b""):
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            self.tail.append(line)
            log.info("[%s] %s", name, line, extra={"func": "engine"})
        proc.stdout.close()

    # -- watching and restarting

    def _watch(self, proc: subprocess.Popen) -> None:
        rc = proc.wait()
        with self._lock:
            if self._stopping or proc is not self._proc:
                return
            if self._reader is not None:
                self._reader.join(timeout=2)
            cause = f"engine for model '{self.spec.name}' (pid {proc.pid}) exited with {_status(rc)} while serving"
            if self.restarts >= 1:
                self._serving = False
                self.error = f"{cause}, after its one restart{self._last_line()}"
                log.error("%s", self.error, extra={"func": "engine"})
                return
            self.restarts += 1
            log.warning("%s; restarting it (once)", cause, extra={"func": "engine"})
            try:
                self._spawn_and_wait()
            except EngineStartError as e:
                self._serving = False
                if self._stopping:  # unloaded while it restarted
                    return
                self.error = f"{cause}; its restart failed: {e.message}"
                log.error("%s", self.error, extra={"func": "engine"})
                return
            new = self._proc
        if self.on_restart is not None:
            self.on_restart(self.port)
        self._watch(new)

    # -- stop

    def stop(self, reason: str = "unload") -> int | None:
        """Stop the child (SIGTERM to its group, SIGKILL after :data:`STOP_GRACE_S`), read its log
        to the end and return its exit code (None when none was running). Idempotent."""
        self._stopping = True  # before the lock: a restart waiting for health gives up at its next poll
        with self._lock:
            self._serving = False
            proc = self._proc
            if proc is None:
                return None
            log.info("engine '%s': stopping pid %d (%s)", self.spec.name, proc.pid, reason, extra={"func": "engine"})
            rc = self._terminate(proc)
            log.info("engine '%s': pid %d exited with %s", self.spec.name, proc.pid, _status(rc),
                     extra={"func": "engine"})
            return rc

    def _terminate(self, proc: subprocess.Popen) -> int:
        if proc.poll() is None:
            _killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                log.warning("engine '%s': pid %d ignored SIGTERM for %g s: SIGKILL", self.spec.name, proc.pid,
                            STOP_GRACE_S, extra={"func": "engine"})
        _killpg(proc.pid, signal.SIGKILL)  # whatever of its group is left
        rc = proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=2)
        return rc


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _status(rc: int) -> str:
    """``code 1`` / ``signal SIGKILL (code 137)`` as a shell reports it (128 + signal)."""
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"{name} (code {128 - rc})"
    return f"code {rc}"
