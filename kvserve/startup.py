"""Start-up of ``kvserve serve``: the cyclic garbage collector paused until the start-up model is in.

Importing torch, numpy, FastAPI and kvserve's own modules and loading a model create about 250,000
Python objects, nearly all of which live as long as the process. CPython's collector runs a young
pass every 700 net allocations of container objects, and a full pass (every tracked object) whenever
the objects that survived young passes since the last one reach a quarter of those it kept: measured
on ``kvserve serve`` of a 1B GGUF file, 4 full and ~560 younger passes before ``/health`` answers 200,
0.35-0.4 s of CPU of about 2.6 s, freeing next to nothing (start-up makes few reference cycles;
reference counting frees the rest).

So ``kvserve serve`` turns the collector off before its imports (:func:`pause`), moves the objects
that exist once the app is built, modules and classes that are never freed, to the permanent
generation (:func:`freeze`: ``gc.freeze``, so no later full pass walks them again, a shorter pause
in every full pass while serving too), and turns the collector back on once the start-up model has
loaded or failed to (:func:`resume`), or at once under ``--no-preload``. Objects made by the model
load are not frozen: an unloaded model's cycles are collected as before. Python's documentation
recommends the same pair (``gc.disable()`` early, ``gc.freeze()`` once set up) for pre-fork servers.

``KVSERVE_STARTUP_GC=1`` keeps the collector on throughout (for comparison and as an escape hatch).
"""

from __future__ import annotations

import gc
import os
import sys

_paused = False


def pause() -> None:
    """Turn the collector off for start-up, unless ``KVSERVE_STARTUP_GC=1`` or it is off already
    (a caller that disabled it keeps it so: :func:`resume` only undoes this call's own pause)."""
    global _paused
    if os.environ.get("KVSERVE_STARTUP_GC") == "1" or not gc.isenabled():
        return
    gc.disable()
    _paused = True


def paused() -> bool:
    """Whether :func:`pause` has the collector off now."""
    return _paused


def freeze() -> None:
    """Move every object tracked now to the permanent generation (``gc.freeze``), when start-up
    paused the collector: call once the modules are imported and the app is built, before the model
    loads."""
    if _paused:
        gc.freeze()


def resume() -> None:
    """Turn the collector back on when :func:`pause` turned it off (idempotent), and free a weight
    prefetch the start-up load did not claim (:func:`kvserve.loaders.weight_read.release`)."""
    global _paused
    if _paused:
        _paused = False
        gc.enable()
    wr = sys.modules.get("kvserve.loaders.weight_read")
    if wr is not None:  # a prefetched file the start-up load did not take (kvserve.loaders.weight_read)
        wr.release()
