"""The tool commands' reaper: ``python -I -S reaper.py STATUS_FD ARGV...`` runs ARGV as its child and
makes sure no process ARGV starts outlives the call, even one that leaves the process group and
session (``setsid``, a double fork + ``setsid()``, ``nohup setsid``).

It marks itself a *child subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``): every descendant that loses
its parent is reparented to it instead of init, whatever session or group it moved to, so the
reaper's children are always the command's whole remaining tree. Then:

- ARGV runs in a process group of its own (its pid), the reaper stays in the one kvserve made;
- ARGV's parent is not the reaper but a fork of it that only waits (:func:`_middle`): a command that
  kills its parent (``kill -9 $PPID``) kills that one, and the command and everything it started are
  reparented to the reaper, which still kills them at the end and still reports the command's exit
  status (the middle process waits for the command without reaping it, so the reaper reaps it);
- it reports on ``STATUS_FD`` (a pipe to kvserve): ``S<pid>\\n`` once ARGV is running, or ``E<errno>\\n`` when
  it could not be run (the reaper then exits 127); ``X<code>\\n`` when ARGV's own process ended
  (``code`` as :attr:`subprocess.Popen.returncode`: the exit status, or -SIGNAL);
- on SIGTERM (kvserve: the call is over, it timed out or was cancelled; or kvserve died: its parent-death
  signal is SIGTERM) it SIGKILLs its children, over and over until none is left (each one killed hands
  its own children to the reaper), reaps them, and exits;
- it exits by itself once every descendant has ended.

The reaper keeps none of the command's descriptors: the output pipe closes when the command's
processes close it, as without a reaper. Only the standard library: it starts in milliseconds.
"""

import ctypes
import errno
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
#: the most rounds of SIGKILL the cleanup sends (a fork loop cannot outrun it: killed processes fork no more)
MAX_ROUNDS = 2000


class _Stop(Exception):
    pass


def _stop(signum, frame):
    raise _Stop()


def _children(me: int) -> list[int]:
    """The live or zombie children of ``me`` (``/proc/*/stat``'s ppid field)."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == me:
            out.append(int(name))
    return out


def _code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _report(fd: int, text: str) -> None:
    try:
        os.write(fd, text.encode())
    except OSError:
        pass


def _reap(main: int, fd: int, block: bool) -> bool:
    """Reap ended children (reporting ``main``'s end); False once there are no children at all."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
        if pid == main:
            _report(fd, f"X{_code(status)}\n")
        if block:
            return True


def _kill_all(main: int, fd: int) -> None:
    me = os.getpid()
    for _ in range(MAX_ROUNDS):
        kids = _children(me)
        if not kids:
            break
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if not _reap(main, fd, False):
            break
        time.sleep(0.001)
    while _reap(main, fd, False) and _children(me):
        time.sleep(0.001)


def _middle(info_w: int, status_fd: int, argv: list[str], libc) -> None:
    """The process between the reaper and the command (a fork of the reaper, never exec'd): the
    command's parent, so the command's ``$PPID`` is not the reaper and a command that kills its parent
    (``kill -9 $PPID``) kills only this one; the command and its descendants are then reparented to
    the reaper (the nearest child subreaper), which still kills them all and still reaps the command
    for its exit code. Forks and execs ARGV, writes ``S<pid>`` or ``E<errno>`` on ``info_w``, waits for
    the command to end *without reaping it* (``waitid(WNOWAIT)``) and exits: the command's zombie goes
    to the reaper, which reaps it and reports its status. Never returns."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the reaper's handler (its cleanup is its own)
        os.close(status_fd)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the reaper gone: nothing to wait for
        check_r, check_w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:
            try:
                os.close(check_r)
                os.close(info_w)
                # SIGPIPE, SIGXFSZ: Python ignores them, and the command would inherit that (subprocess restores them)
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ):
                    signal.signal(sig, signal.SIG_DFL)
                libc.prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)
                os.setpgid(0, 0)  # the command leads its own process group, as without a reaper
                os.execvp(argv[0], argv)
            except OSError as e:
                os.write(check_w, str(e.errno or errno.ENOENT).encode())
            finally:
                os._exit(127)
        os.close(check_w)
        err = b""
        while chunk := os.read(check_r, 64):
            err += chunk
        os.close(check_r)
        if err:
            os.waitpid(pid, 0)
            os.write(info_w, b"E%d\n" % int(err))
            os._exit(127)
        os.write(info_w, b"S%d\n" % pid)
        os.close(info_w)
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except OSError as e:  # fork failed (EAGAIN, ENOMEM): the reaper reports it as exec's errno
        try:
            os.write(info_w, b"E%d\n" % (e.errno or errno.EAGAIN))
        except OSError:
            pass
    finally:
        os._exit(0)


def main() -> None:
    fd = int(sys.argv[1])
    argv = sys.argv[2:]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    parent = os.getppid()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)  # kvserve gone: clean up (was SIGKILL)
    if os.getppid() != parent or parent == 1:
        os._exit(1)
    main_pid = -1
    try:
        info_r, info_w = os.pipe2(os.O_CLOEXEC)
        if os.fork() == 0:
            os.close(info_r)
            _middle(info_w, fd, argv, libc)
        os.close(info_w)
        first = b""
        while chunk := os.read(info_r, 64):
            first += chunk
        os.close(info_r)
        if not first.startswith((b"S", b"E")):  # the middle process was killed before it could tell
            _report(fd, f"E{errno.ECHILD}\n")
            _kill_all(main_pid, fd)
            os._exit(127)
        if first.startswith(b"E"):
            _report(fd, first.decode())
            while _reap(main_pid, fd, True):
                pass
            os._exit(127)
        main_pid = int(first[1:])
        _report(fd, f"S{main_pid}\n")
        null = os.open(os.devnull, os.O_RDWR)
        for std in (0, 1, 2):  # the command's pipes are its own: EOF comes when its processes close them
            os.dup2(null, std)
        os.close(null)
        while _reap(main_pid, fd, True):
            pass
    except _Stop:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _kill_all(main_pid, fd)
    os._exit(0)


if __name__ == "__main__":
    main()
