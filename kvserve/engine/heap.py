"""Giving the C heap's free memory back to the kernel (glibc's ``malloc_trim``).

torch's CPU tensors, numpy arrays and the tokenizer's objects come from glibc's ``malloc``. A prefill
step allocates and frees tens of MiB of activations (a 500-token prompt on a 1B model: ~60 MiB in the
engine thread's arena); glibc keeps what was freed in its arenas for the next allocation, so the
process's resident set stays at its largest step's size while it idles (measured on ``kvserve serve``
of the 1B Q8_0 file: +60-80 MiB after one long prompt). ``malloc_trim(0)`` returns the free pages of
every arena (``MADV_DONTNEED``; the address space stays, the next step faults them in again).

:func:`trim` is called once a model has loaded (the load's temporary objects: the GGUF header's
strings, the tokenizer's build) and by :class:`kvserve.engine.async_engine.AsyncEngine` once the
engine has been idle for :data:`IDLE_TRIM_S` seconds after work (never between the steps of a busy
engine, nor between requests that follow each other closely, so it costs no request any time). On a
C library without ``malloc_trim`` (musl, macOS) it does nothing.

``malloc_trim`` gives back the free chunks inside every arena, but the free space at the top of a
thread's own arena only when a ``free`` in it finds that space above glibc's trim threshold (which
grows with the largest buffers freed: up to 64 MiB). Measured on ``kvserve serve``: the engine
thread's arena kept 51 MiB resident of which 0.7 MiB were in use. So ``kvserve serve`` limits glibc
to one arena (:func:`one_arena`, ``mallopt(M_ARENA_MAX, 1)``, before it starts any thread): every
thread allocates from the main arena, whose top ``malloc_trim`` does shrink. Python's own objects come
from its object allocator (its own pools), torch's and numpy's buffers are few and large, so the
threads hardly contend for the arena's lock.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("kvserve.engine")

#: seconds of an idle engine (after a step) before its free heap memory is given back
IDLE_TRIM_S = 1.0

_fn = None
_looked = False


def _malloc_trim():
    global _fn, _looked
    if not _looked:
        _looked = True
        try:
            libc = ctypes.CDLL(None)
            fn = libc.malloc_trim
            fn.argtypes = [ctypes.c_size_t]
            fn.restype = ctypes.c_int
            _fn = fn
        except (OSError, AttributeError):  # not glibc
            _fn = None
    return _fn


def one_arena() -> bool:
    """Make every thread allocate from glibc's main arena (``mallopt(M_ARENA_MAX, 1)``), so that
    :func:`trim` can give back all of the heap's free memory. Call before the process starts threads
    (arenas made before stay). False on a C library without ``mallopt``, where it refuses, or where
    glibc's default is kept.

    ``KVSERVE_MALLOC_ARENAS``: ``0`` / ``false`` / ``off`` / ``no`` (any case; the words KVSERVE_MMAP
    takes) keep glibc's default (one arena per thread, up to 8 per core); a number N > 0 allows N
    arenas; unset, 1, or a value that is neither (warned): one. When it is unset and glibc's own
    ``MALLOC_ARENA_MAX`` is set, that is the user's choice and stays (``mallopt`` would override it)."""
    import os

    raw = os.environ.get("KVSERVE_MALLOC_ARENAS")
    if raw is None and os.environ.get("MALLOC_ARENA_MAX"):
        return False
    val = (raw or "1").strip().lower()
    if val in ("0", "false", "off", "no"):
        return False
    try:
        n = int(val)
    except ValueError:
        n = 0
    if n < 1:
        log.warning("KVSERVE_MALLOC_ARENAS=%r is not 0/false/off/no or a number of arenas: one arena", raw[:64])
        n = 1
    try:
        fn = ctypes.CDLL(None).mallopt
        fn.argtypes = [ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        return bool(fn(_M_ARENA_MAX, n))
    except (OSError, AttributeError):
        return False


_M_ARENA_MAX = -8  # glibc malloc.h


def trim() -> bool:
    """Give the C heap's free pages back to the kernel (``malloc_trim(0)``): True when glibc did
    release memory, False when there was none or the C library has no ``malloc_trim``. Safe from any
    thread at any time (glibc locks each arena while it trims it)."""
    fn = _malloc_trim()
    if fn is None:
        return False
    try:
        return bool(fn(0))
    except Exception as e:  # noqa: BLE001 - a failed trim costs only memory
        log.debug("malloc_trim failed: %s", e)
        return False
