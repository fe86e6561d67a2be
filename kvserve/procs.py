"""Child processes that die with kvserve: the one way kvserve starts long-lived or untrusted
programs (supervised engines, ``/tools`` shell commands, MCP stdio servers).

:func:`spawn` is :class:`subprocess.Popen` with three fixed choices:

- **its own session and process group** (``start_new_session``): the caller stops the program
  and everything it started with one ``killpg`` of ``proc.pid``;
- **no inherited descriptors** (``close_fds``, Popen's default, kept on purpose: uvloop's own
  spawn lets the server's listening sockets and pipes leak into the child);
- **death with kvserve**: ``PR_SET_PDEATHSIG`` = SIGKILL (Linux ``prctl``), so a kvserve that is
  SIGKILLed (no ``finally``, no atexit) still leaves no direct child running. The kernel sends the
  signal when the *thread* that forked the child ends, not the process, so every child is forked
  from one long-lived spawner thread (:data:`_SPAWNER`, never shut down) rather than from a
  short-lived worker or whichever thread happened to call. If kvserve dies between ``fork`` and
  the ``prctl``, the child sees a new parent and exits at once.

The limit: the signal reaches the direct child only. Its own children (a shell's background job, an
MCP server's worker processes) are not signalled when kvserve is SIGKILLed: they are reparented to
init and live on until they exit by themselves (many do, on the EOF or EPIPE of the pipes they
shared with their killed parent; ``sleep 600 &`` does not). Every orderly stop (a call's end,
timeout or cancel, an MCP server's close, an engine's unload, kvserve's shutdown) kills the whole
process group, grandchildren included. Without ``prctl`` (not Linux) only those stops remain.
``/tools`` commands go further (kvserve/tools/reaper.py): they run under a child subreaper that kills
every descendant, one that left the process group or session included, at the call's end and when
kvserve dies.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

__all__ = ["spawn", "spawn_async"]

_PR_SET_PDEATHSIG = 1
#: every child is forked from this thread (PR_SET_PDEATHSIG fires when the forking thread ends)
_SPAWNER = ThreadPoolExecutor(1, thread_name_prefix="kvserve-spawner")


def _die_with_parent(parent: int) -> Callable[[], None]:
    """The ``preexec_fn`` that asks the kernel for SIGKILL when the forking thread ends; exits
    the child (code 1) when ``parent`` is already gone."""
    def preexec() -> None:  # runs in the child between fork and exec
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # not Linux: the process group and the callers' stops remain
            return
        if os.getppid() != parent:  # kvserve died before prctl took effect
            os._exit(1)
    return preexec


def _popen(argv: list[str], kwargs: dict[str, Any]) -> subprocess.Popen:
    return subprocess.Popen(argv, start_new_session=True, close_fds=True,
                            preexec_fn=_die_with_parent(os.getpid()), **kwargs)


def spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen:
    """Start ``argv`` in its own session and process group, with no inherited descriptors, set to
    die (SIGKILL) when kvserve dies; blocks the calling thread for the fork (milliseconds).

    Args:
        argv: the program and its arguments (no shell).
        **kwargs: any other :class:`subprocess.Popen` argument (stdin, stdout, stderr, cwd, env);
            ``start_new_session``, ``close_fds`` and ``preexec_fn`` are fixed here and refused.

    Returns:
        the :class:`subprocess.Popen` (its ``pid`` is also its process group id).

    Raises:
        OSError: the program cannot run (no such file, not executable, bad cwd).
        TypeError: a fixed argument was given.
    """
    for fixed in ("start_new_session", "close_fds", "preexec_fn", "process_group"):
        if fixed in kwargs:
            raise TypeError(f"procs.spawn fixes {fixed}")
    return _SPAWNER.submit(_popen, argv, kwargs).result()


async def spawn_async(argv: list[str], **kwargs: Any) -> subprocess.Popen:
    """:func:`spawn` for a coroutine: the fork runs on the spawner thread while the event loop
    goes on. Same arguments, result and errors; a caller cancelled while the fork runs leaves no
    child (its group is killed as soon as it exists)."""
    for fixed in ("start_new_session", "close_fds", "preexec_fn", "process_group"):
        if fixed in kwargs:
            raise TypeError(f"procs.spawn fixes {fixed}")
    fut = _SPAWNER.submit(_popen, argv, kwargs)
    try:
        return await asyncio.shield(asyncio.wrap_future(fut))
    except asyncio.CancelledError:  # the caller is gone: the child it would have owned dies at once
        fut.add_done_callback(_kill_unowned)
        raise


def _kill_unowned(fut) -> None:
    if fut.cancelled() or fut.exception() is not None:
        return
    proc = fut.result()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
