"""Reading a GGUF file's bytes into private huge-page memory, and doing it before it is needed.

:func:`kvserve.loaders.gguf.load_gguf` holds a file's tensor data in private anonymous memory that
asks for transparent huge pages (mode "read" of :func:`kvserve.loaders.gguf.set_weight_memory`):
decode reads the weights through 2 MiB pages. Filling that memory costs the kernel more than the
copy from the page cache: measured on this project's 2-core VM (``perf record`` of the read of the
1.1 GB Q8_0 1B file), ~45% of the time is ``clear_page_erms`` zeroing fresh huge pages (memory the
hypervisor backs on first touch), ~5% the copy; 0.3 s on a quiet machine, 1-4 s when other
processes keep the machine busy.

So ``kvserve serve MODEL.gguf`` starts that read on a thread of its own before it imports torch,
FastAPI and the rest (:func:`prefetch`, from :mod:`kvserve.cli`): the imports hold one core for
1.5-3 s and the read, all of it in the kernel (``preadv`` releases the GIL), runs on the other. The
loader takes the buffer (:func:`claim`) when it gets there, helping with the pieces not read yet;
a buffer nobody claims (another model loaded, a child process loads it, the load failed first) is
freed when start-up ends (:func:`release`).

A buffer is only handed to a loader that asks for the same file (same path, device, inode, size,
modification and change times as when the read began, and again once it ended): a file replaced
meanwhile is read again by the loader. This module imports nothing heavy (no numpy), so the read
starts within milliseconds of the process.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time

log = logging.getLogger("kvserve.loaders")

#: a transparent huge page (x86-64's PMD size): the buffer's start is aligned to it
HUGE = 2 << 20
#: bytes per ``preadv`` piece: small enough for two readers to share the tail evenly
PIECE = 32 << 20


def _identity(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class WeightRead:
    """One file's bytes being read into private anonymous memory, 2 MiB-aligned and advised
    ``MADV_HUGEPAGE``, in :data:`PIECE`-byte pieces that any number of threads take in turn.

    Args:
        path: the file.
        start: the first file offset to read (the first tensor's; rounded down to a 4 KiB page);
            the bytes before it are never touched (no memory). 0 when not known yet (a prefetch
            before the header is parsed): :meth:`result` then gives back the pages below the
            first tensor.

    Attributes:
        path, size (bytes, at the start of the read), ident (the stat identity then).

    Raises:
        OSError: the file cannot be opened or stat'ed, or the memory cannot be mapped.
    """

    def __init__(self, path: str, start: int = 0):
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(self._fd)
            self.ident = _identity(st)
            self.size = st.st_size
            self._map = mmap.mmap(-1, self.size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except BaseException:
            os.close(self._fd)
            raise
        # the mapping's address (a ctypes export: the mapping cannot be closed while it lives)
        self._anchor = ctypes.c_char.from_buffer(self._map)
        addr = ctypes.addressof(self._anchor)
        self.shift = -addr % HUGE  # the 2 MiB-aligned start: every whole 2 MiB of it can be one page
        try:
            self._map.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, AttributeError):  # a kernel without THP: the copy still loads, on 4 KiB pages
            pass
        self._view = memoryview(self._map)[self.shift: self.shift + self.size]
        start -= start % 4096
        self.start = start
        self._pieces = [(o, min(self.size, o + PIECE)) for o in range(start, self.size, PIECE)]
        self._got = [0] * len(self._pieces)
        self._next = 0
        self._active = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self.read_s = 0.0  # seconds of the read (first piece taken to last piece done)
        self._t0 = None

    def _take(self) -> int | None:
        with self._lock:
            if self._next >= len(self._pieces) or self._fd < 0:
                return None
            i = self._next
            self._next += 1
            self._active += 1
            if self._t0 is None:
                self._t0 = time.perf_counter()
            return i

    def _done(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0 and self._next >= len(self._pieces):
                self.read_s = time.perf_counter() - (self._t0 or time.perf_counter())
            self._idle.notify_all()

    def work(self) -> None:
        """Read pieces until none is left to take (any thread; ``preadv`` releases the GIL)."""
        while (i := self._take()) is not None:
            try:
                a, b = self._pieces[i]
                pos = a
                try:
                    while pos < b:
                        n = os.preadv(self._fd, [self._view[pos:b]], pos)
                        if n <= 0:  # the file is shorter than its size a moment ago
                            break
                        pos += n
                except OSError as e:  # an I/O error: the tensors past it fail as truncated
                    log.debug("weight read %s: %s", self.path, e)
                self._got[i] = pos - a
            finally:
                self._done()

    def finish(self, threads: int = 1) -> None:
        """Read what is left on this thread and ``threads - 1`` more, and wait for every piece."""
        extra = []
        for _ in range(max(0, threads - 1)):
            t = threading.Thread(target=self.work, name="weight-read", daemon=True)
            t.start()
            extra.append(t)
        self.work()
        for t in extra:
            t.join()
        with self._lock:
            while self._active:
                self._idle.wait()

    def changed(self) -> bool:
        """True when the file (the descriptor the bytes come from: the same inode even if another file
        was renamed over the path) no longer has the identity it had when the read began: written in
        place meanwhile, so the bytes read may mix old and new. Call after :meth:`finish`, before
        :meth:`result` (which closes the descriptor)."""
        with self._lock:
            fd = self._fd
        if fd < 0:
            return True
        try:
            return _identity(os.fstat(fd)) != self.ident
        except OSError:
            return True

    def result(self, start: int | None = None):
        """The bytes read, as a read-only memoryview of [file size] indexed by file offset (shorter
        when the file was cut meanwhile: the tensors past its end fail as truncated); the pages
        below ``start`` (rounded down to 4 KiB) are given back to the kernel. Call after
        :meth:`finish`; the file is closed."""
        self._close_fd()
        n = self.size
        for (a, b), got in zip(self._pieces, self._got):
            if got < b - a:
                n = a + got
                break
        if start is not None:
            hi = start - start % 4096
            if hi > self.start:  # shift and start are multiples of the page size
                try:
                    self._map.madvise(mmap.MADV_DONTNEED, self.shift + self.start, hi - self.start)
                except (OSError, ValueError):
                    pass
        return self._view[:n].toreadonly()

    def _close_fd(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def close(self) -> None:
        """Stop reading (pieces already taken finish) and drop this object's hold on the memory
        (it is freed once no view of it is left)."""
        self._close_fd()
        with self._lock:
            while self._active:
                self._idle.wait()
        self._view.release()
        del self._anchor


def thp_available() -> bool:
    """True where the kernel gives transparent huge pages to memory that asks (madvise) or to all."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            txt = f.read()
    except OSError:
        return False
    return ("[always]" in txt or "[madvise]" in txt) and hasattr(mmap, "MADV_HUGEPAGE")


def weight_memory_mode(setting: str = "auto") -> str:
    """"read" or "mmap": how a GGUF file's tensor bytes are held for ``setting`` ("auto", "read" or
    "mmap"; :func:`kvserve.loaders.gguf.set_weight_memory`). "auto": KVSERVE_MMAP=1 / 0 (also
    true/false, on/off, yes/no) gives "mmap" / "read"; unset, "read" where
    :func:`thp_available`, else "mmap" (without huge pages the copy buys nothing)."""
    if setting != "auto":
        return setting
    env = os.environ.get("KVSERVE_MMAP", "").strip().lower()
    if env in ("1", "true", "on", "yes"):
        return "mmap"
    if env in ("0", "false", "off", "no"):
        return "read"
    return "read" if thp_available() else "mmap"


_lock = threading.Lock()
_pending: dict[str, WeightRead] = {}


def prefetch(path: str, setting: str = "auto") -> bool:
    """Start reading ``path`` into huge-page memory on a daemon thread, for a later :func:`claim`.

    Does nothing (False) unless ``path`` is a regular file that begins with ``GGUF``, the weights
    would be read, not mapped (:func:`weight_memory_mode` of ``setting``: the kernel grants
    transparent huge pages and KVSERVE_MMAP does not ask for the mapping), and the file is under
    half of ``MemAvailable``. Never raises."""
    try:
        path = os.path.realpath(path)
        if weight_memory_mode(setting) != "read" or not os.path.isfile(path):
            return False
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return False
        if os.path.getsize(path) * 2 > _mem_available():
            return False
        with _lock:
            if path in _pending:
                return True
            r = WeightRead(path)
            _pending[path] = r
        threading.Thread(target=r.work, name="weight-prefetch", daemon=True).start()
        return True
    except Exception as e:  # noqa: BLE001 - a prefetch that cannot start costs only its speed-up
        log.debug("weight prefetch of %s not started: %s", path, e)
        return False


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


def claim(path: str) -> WeightRead | None:
    """The prefetch of ``path`` (:func:`prefetch`), when one was started and the file has the same
    identity as when it began; removed from the pending set either way. The caller finishes it
    (:meth:`WeightRead.finish`) and checks the identity again after."""
    path = os.path.realpath(path)
    with _lock:
        r = _pending.pop(path, None)
    if r is None:
        return None
    try:
        same = _identity(os.stat(path)) == r.ident
    except OSError:
        same = False
    if not same:
        r.close()
        return None
    return r


def release() -> None:
    """Free every prefetch nobody claimed (start-up is over: the model that would have used it
    loaded from elsewhere, in another process, or failed first)."""
    with _lock:
        left = list(_pending.values())
        _pending.clear()
    for r in left:
        r.close()


def pending() -> list[str]:
    """The paths with an unclaimed prefetch (tests)."""
    with _lock:
        return list(_pending)


def model_path_from_argv(argv: list[str]) -> str | None:
    """The model file a ``kvserve serve`` command line names, found without parsing the flags: the
    value of ``-m`` / ``--model`` (``--model=X``), else the first argument when it is not a flag
    (``kvserve serve MODEL ...``). None otherwise (the server's own parsing decides the rest)."""
    for i, a in enumerate(argv):
        if a in ("-m", "--model") and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--model="):
            return a.split("=", 1)[1]
    if argv and not argv[0].startswith("-"):
        return argv[0]
    return None


def _argv_weight_memory(argv: list[str]) -> str:
    """"read", "mmap" or "auto": how ``kvserve serve``'s flags ask GGUF weights to be held, read as its
    parser does (:func:`kvserve.serving.args.parse_args`): the last of ``--mmap`` / ``--no-mmap``, else
    llama-server's ``-lm`` / ``--load-mode`` (or LLAMA_ARG_LOAD_MODE): mmap, mmap+mlock -> "mmap";
    none, mlock, dio -> "read"; auto or anything else -> "auto"."""
    mode, load_mode = None, None
    for i, a in enumerate(argv):
        if a == "--mmap":
            mode = "mmap"
        elif a == "--no-mmap":
            mode = "read"
        elif a in ("-lm", "--load-mode") and i + 1 < len(argv):
            load_mode = argv[i + 1]
        elif a.startswith(("--load-mode=", "-lm=")):
            load_mode = a.split("=", 1)[1]
    if mode:
        return mode
    if load_mode is None:
        load_mode = os.environ.get("LLAMA_ARG_LOAD_MODE", "")
    return {"mmap": "mmap", "mmap+mlock": "mmap", "none": "read", "mlock": "read", "dio": "read"}.get(
        load_mode.strip(), "auto")


def prefetch_for_argv(argv: list[str]) -> bool:
    """:func:`prefetch` of the model file ``argv`` (``kvserve serve``'s arguments) names, unless the
    flags ask for the file's mapping (``--mmap``, ``-lm mmap``: :func:`_argv_weight_memory`) or
    ``--no-preload``; ``--no-mmap`` / ``-lm none`` set the read as KVSERVE_MMAP=0 does."""
    if "--no-preload" in argv:
        return False
    mode = _argv_weight_memory(argv)
    if mode == "mmap":
        return False
    p = model_path_from_argv(argv)
    if not p:
        return False
    return prefetch(os.path.expanduser(p), mode)


# ---------------------------------------------------------------- giving pages back
# The file-indexed arrays the loader hands out (uint8 [file size], index = file offset: the file's
# mapping, or a WeightRead buffer), so that a part of one that a kernel copied into a layout of its
# own (ggml_cpu.cpp's repacked Q4_0) can take no resident memory while still reading the file's bytes.
_VIEWS: list[tuple] = []  # (weakref to the bytes' owner, address of offset 0, size, path, identity, kind)
_VIEWS_LOCK = threading.Lock()


def _owner(a):
    """The object that holds an array's memory: the end of its ``.base`` chain (an mmap, a memoryview)."""
    while getattr(a, "base", None) is not None:
        a = a.base
    return a


def register_file_view(arr, path: str, kind: str, ident: tuple | None = None) -> None:
    """Record ``arr`` (uint8 [file size] of ``path``, index = file offset; ``kind`` "mmap": the file's
    read-only mapping, "read": a :class:`WeightRead` buffer) for :func:`give_back`. ``ident``: the
    identity of the file the bytes came from (a read's :attr:`WeightRead.ident`); default the path's
    now (a file renamed over the path after the read would otherwise be taken for the one read).
    Entries whose memory is gone are dropped (weak references)."""
    import weakref

    try:
        ref = weakref.ref(_owner(arr))
        ident = ident if ident is not None else _identity(os.stat(path))
    except (TypeError, OSError):  # an owner without weak references, or the file gone: nothing recorded
        return
    with _VIEWS_LOCK:
        _VIEWS[:] = [v for v in _VIEWS if v[0]() is not None]
        _VIEWS.append((ref, int(arr.ctypes.data), int(arr.size), path, ident, kind))


_LIBC = None


def _libc():
    """libc's mmap and madvise through ctypes (loaded once)."""
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _LIBC = libc
    return _LIBC


def _mmap_fixed(addr: int, length: int, fd: int, offset: int) -> bool:
    r = _libc().mmap(addr, length, mmap.PROT_READ, mmap.MAP_PRIVATE | 0x10, fd, offset)  # 0x10: MAP_FIXED
    return r == addr


def give_back(part) -> int:
    """Give the resident memory of ``part``'s whole 4 KiB pages back to the kernel while the array
    keeps reading the file's bytes: ``part`` (a C-contiguous view of an array given to
    :func:`register_file_view`, not written since) of the file's mapping: ``madvise(MADV_DONTNEED)``
    (a later read faults the page cache's page in again); of a read buffer: the file mapped over those
    pages (``mmap(MAP_PRIVATE | MAP_FIXED)`` at the same file offsets), so a later reader sees the same
    bytes from the page cache. Returns the bytes given back: 0 where ``part`` is no such view, or the
    file is no longer the one loaded (identity changed), or the call failed (nothing changed then)."""
    addr, n = int(part.ctypes.data), int(part.nbytes)
    owner = _owner(part)
    with _VIEWS_LOCK:
        hit = next((v for v in reversed(_VIEWS) if v[0]() is owner and v[1] <= addr and addr + n <= v[1] + v[2]), None)
    if hit is None:
        return 0
    _, base, _, path, ident, kind = hit
    lo = (addr + 4095) // 4096 * 4096
    hi = (addr + n) // 4096 * 4096
    if hi <= lo or (lo - base) % 4096:
        return 0
    if kind == "mmap":
        try:
            if _libc().madvise(lo, hi - lo, mmap.MADV_DONTNEED) != 0:
                return 0
        except (OSError, AttributeError):
            return 0
        return hi - lo
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0
    try:
        if _identity(os.fstat(fd)) != ident or not _mmap_fixed(lo, hi - lo, fd, lo - base):
            return 0
    finally:
        os.close(fd)
    return hi - lo
