"""kvserve's own compiled modules kept under ``$KVSERVE_HOME/cache/bytecode`` when Python writes none.

With ``PYTHONDONTWRITEBYTECODE=1`` (or ``python -B``; common in containers and CI) Python compiles every
imported module that has no ``__pycache__`` file from its source on every start, and writes nothing
back. An installed wheel carries its ``.pyc`` files (pip compiles them at install time), but a source
checkout or an editable install does not: there ``kvserve serve`` compiled its ~190 modules on every
start, 0.2-0.3 s of CPU (of ~2.5 s to ``/health`` 200 on a 1B GGUF file).

:func:`install` (called from ``kvserve/__init__.py``) adds an import finder for ``kvserve.*`` modules
only, and only while ``sys.dont_write_bytecode`` is set: a module whose source has no ``__pycache__``
file beside it is compiled once and its code object kept in this cache, one file per source path
(the name is a digest of the absolute path, the interpreter's magic number and optimization level).
An entry records the source's size and modification time in nanoseconds and is used only when both
match (CPython's own ``.pyc`` check, with a finer clock); anything else (a stale, truncated, foreign
or unreadable entry) is compiled again and rewritten, by a temporary file renamed into place, so
concurrent starts never read half an entry. A cache directory that cannot be written costs only the
speed-up. Module attributes (``__file__``, ``__cached__``), tracebacks and ``inspect.getsource`` are as
without it.

``KVSERVE_BYTECODE_CACHE=0`` turns it off; ``$KVSERVE_CACHE_DIR`` moves it with the other caches.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import marshal
import os
import stat
import sys
import tempfile
import types

#: the entry's header: magic, source size, source mtime (ns); then the marshalled code object
_MAGIC = b"kvsbc1\n" + importlib.util.MAGIC_NUMBER


def cache_dir() -> str:
    """``$KVSERVE_CACHE_DIR/bytecode``, else ``$KVSERVE_HOME/cache/bytecode`` (default
    ``~/.cache/kvserve/cache/bytecode``), as :func:`kvserve.loaders.file_cache.cache_dir` places its files."""
    base = os.environ.get("KVSERVE_CACHE_DIR")
    if not base:
        home = os.environ.get("KVSERVE_HOME")
        base = os.path.join(os.path.expanduser(home) if home else os.path.join(os.path.expanduser("~"), ".cache",
                                                                                 "kvserve"), "cache")
    return os.path.join(os.path.expanduser(base), "bytecode")


def entry_path(directory: str, source: str) -> str:
    """The cache file of the module at ``source`` (an absolute path)."""
    key = f"{sys.implementation.cache_tag}\0{sys.flags.optimize}\0{source}".encode("utf-8", "surrogatepass")
    return os.path.join(directory, f"{os.path.basename(source)[:-3]}-{hashlib.sha256(key).hexdigest()[:24]}.bin")


def _header(st: os.stat_result) -> bytes:
    return _MAGIC + st.st_size.to_bytes(8, "little") + st.st_mtime_ns.to_bytes(8, "little", signed=True)


class CachingSourceLoader(importlib.machinery.SourceFileLoader):
    """A source module's loader that reads its code object from the cache (see the module docstring)."""

    directory: str = ""

    def get_code(self, fullname):
        """The module's code: the cached one when its entry matches the source, else compiled and kept."""
        source = self.get_filename(fullname)
        if os.path.exists(importlib.util.cache_from_source(source)):
            return super().get_code(fullname)  # a __pycache__ file beside it: Python's own path
        try:
            st = os.stat(source)
        except OSError:
            return super().get_code(fullname)
        path = entry_path(self.directory, source)
        head = _header(st)
        try:
            code = _read_entry(path, head)
            if code is not None:
                return code
        except (OSError, EOFError, ValueError, TypeError):  # missing, truncated or foreign: compiled again
            pass
        code = self.source_to_code(self.get_data(source), source)
        _write(path, head + marshal.dumps(code))
        return code


def _read_entry(path: str, head: bytes) -> types.CodeType | None:
    """The code object of the entry at ``path`` when its header is ``head``; None for an entry of another
    source, a body that is not a code object, or anything but a regular file (a FIFO or device is
    opened without blocking and never read). Raises OSError / EOFError / ValueError / TypeError for a
    missing or damaged entry."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = f.read()
    finally:
        if fd >= 0:
            os.close(fd)
    if data[:len(head)] != head:
        return None
    code = marshal.loads(memoryview(data)[len(head):])
    return code if isinstance(code, types.CodeType) else None


def _write(path: str, data: bytes) -> None:
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=os.path.dirname(path))
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        tmp = None
    except OSError:  # a read-only cache: only the speed-up is lost
        pass
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


class KvserveBytecodeFinder:
    """A ``sys.meta_path`` finder for ``kvserve.*`` source modules: Python's path finder's spec, with
    :class:`CachingSourceLoader` as its loader."""

    def __init__(self, directory: str):
        self.directory = directory

    def find_spec(self, fullname, path=None, target=None):
        """The spec of a ``kvserve.`` submodule (None for any other name: the next finder's)."""
        if path is None or not fullname.startswith("kvserve."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader:
            loader = CachingSourceLoader(spec.loader.name, spec.loader.path)
            loader.directory = self.directory
            spec.loader = loader
        return spec


def install() -> bool:
    """Put the finder first on ``sys.meta_path`` when Python writes no bytecode and
    ``KVSERVE_BYTECODE_CACHE`` is not ``0`` (once per process). True when installed now or before."""
    if any(isinstance(f, KvserveBytecodeFinder) for f in sys.meta_path):
        return True
    if not sys.dont_write_bytecode or os.environ.get("KVSERVE_BYTECODE_CACHE", "1") == "0":
        return False
    sys.meta_path.insert(0, KvserveBytecodeFinder(cache_dir()))
    return True
