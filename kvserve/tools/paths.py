"""Where a tool's path may point, on the host (issue 36's security rules; llama-server resolves
paths the same way but checks none of this).

:func:`resolve` turns a tool's ``path`` param into an absolute path:

* ``~`` and ``~/x`` expand to ``$HOME`` (llama-server's ``expand_home``), and the result counts as
  absolute;
* a relative path joins the call's cwd (``x-tool-cwd``; the server's own cwd without one) and must
  stay inside it: a ``..`` that climbs out is refused, and so is a path that leaves it through a
  symlink (the real path, symlinks followed, must be inside the cwd's real path);
* an absolute path goes where it names, as llama-server and its tests expect, unless
  ``--tools-confine``: then it obeys the relative path's rules; an absolute path that lies inside
  the cwd cannot leave it through a symlink either;
* a NUL byte, or an empty path, is refused.

:func:`open_regular` then opens the file without following a final symlink and without blocking
(a FIFO with no writer would hang a read forever) and refuses anything that is not a regular file:
device files, FIFOs, sockets, directories.
"""

from __future__ import annotations

import os
import stat

from kvserve.tools.base import ToolParamsError

__all__ = ["PathRefused", "resolve", "open_regular", "is_inside"]


class PathRefused(ToolParamsError):
    """A path the rules refuse; the tool answers ``{"error": TEXT}`` with the message."""


def is_inside(path: str, base: str) -> bool:
    """True when ``path`` is ``base`` or below it (both absolute and normalized)."""
    return path == base or path.startswith(base.rstrip(os.sep) + os.sep)


def _expand_home(path: str) -> str:
    if path == "~" or path.startswith("~/"):
        home = os.environ.get("HOME", "")
        if home:
            return home + path[1:]
    return path


def base_dir(cwd: str | None) -> str:
    """The call's cwd, absolute and normalized (the server's cwd without one)."""
    return os.path.normpath(os.path.abspath(_expand_home(cwd))) if cwd else os.getcwd()


def resolve(path: str, cwd: str | None, confine: bool = False) -> str:
    """The absolute, normalized path ``path`` names (see the module docstring). Raises PathRefused."""
    if not isinstance(path, str) or not path:
        raise PathRefused("path must be a non-empty string")
    if "\x00" in path or (cwd and "\x00" in cwd):
        raise PathRefused(f"invalid path (NUL byte): {path!r}")
    p = _expand_home(path)
    base = base_dir(cwd)
    absolute = os.path.isabs(p)
    full = os.path.normpath(p if absolute else os.path.join(base, p))
    if absolute and not confine and not is_inside(full, base):
        return full  # the caller named it (llama-server's contract)
    if not is_inside(full, base):
        raise PathRefused(f"path is outside the working directory {base}: {path}")
    real_base = os.path.realpath(base)
    real = os.path.realpath(full)
    if not is_inside(real, real_base):
        raise PathRefused(f"path leaves the working directory {base} through a symlink: {path}")
    return real


def check_regular(path: str) -> os.stat_result | None:
    """The stat of ``path`` when it exists (None when it does not). Raises PathRefused when it is a
    device, FIFO, socket or directory."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise PathRefused(f"cannot stat file: {path} ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise PathRefused(f"not a regular file: {path}")
    return st


def open_regular(path: str, write: bool = False) -> int:
    """An fd of the regular file ``path`` (opened for reading, or for writing: created with 0644
    when missing, not truncated: the caller truncates once the fd is checked). ``O_NONBLOCK`` keeps a
    FIFO from blocking the open; the fd is then checked to be a regular file. Raises PathRefused
    (special files) or OSError (missing, permissions)."""
    flags = (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY) | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    flags |= getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno in (6, 19):  # ENXIO (a FIFO with no reader), ENODEV
            raise PathRefused(f"not a regular file: {path}") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PathRefused(f"not a regular file: {path}")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
