"""Import xgrammar without importing transformers (issue #29: a first request as fast as the tenth).

xgrammar 0.2's package ``__init__`` imports ``transformers`` for two things kvserve never uses:
``TokenizerInfo.from_huggingface`` (kvserve builds its TokenizerInfo from its own tokenizer's bytes,
``VocabType.RAW``) and ``xgrammar.contrib.hf.LogitsProcessor`` (a ``transformers.generate`` hook).
Importing transformers costs ~1.4-1.6 s of a core, most of it holding the GIL; in a server warming
its grammar compiler in the background that stretch slowed the first requests after ``/health``
(TTFT 2.0-3.6 s instead of 0.7-1.2 s on the 1B file). :func:`xgrammar_module` imports xgrammar
with a stand-in ``transformers`` module in ``sys.modules`` for the length of that import: its
classes are placeholders whose ``isinstance``/``issubclass`` checks import the real transformers
and ask its class, so ``from_huggingface`` still works for a caller that has transformers. The
stand-in is removed afterwards; a later ``import transformers`` loads the real package.

Where transformers is already imported (or xgrammar is), the plain import is used.

Where xgrammar cannot be imported (not installed, a missing or mismatched native library), every
caller gets :class:`StructuredOutputUnavailableError`: "structured output is unavailable: xgrammar
failed to import: <why>", a server fault each face answers 500 in its own envelope with that text
(before, a bare ImportError became the faces' generic "internal server error"). The failure is
remembered: a broken package is not imported again for every request.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
import threading
import types

from kvserve.errors import ServerFaultError

__all__ = ["StructuredOutputUnavailableError", "xgrammar_module"]

#: the names xgrammar 0.2 takes from transformers at import time
_NAMES = ("PreTrainedTokenizerBase", "PreTrainedTokenizerFast", "LogitsProcessor")

_lock = threading.Lock()
_module: types.ModuleType | None = None  # xgrammar, once its import is over
_failure: str | None = None  # why xgrammar's import failed, once it has (as clients see it)

log = logging.getLogger("kvserve.structured")

#: the directories of an absolute path (``/home/u/.venv/.../``): clients see a file's name, not where
#: the server's packages live (the log has the whole text)
_DIRS = re.compile(r"(?<![\w.~:/])/(?:[^\s/'\"()\[\]<>]+/)+")
_REASON_MAX = 500  # characters of the cause a client sees


def _public_reason(text: str) -> str:
    """``text`` (an import error's message) as a client sees it: absolute paths cut to their file
    names, one line, at most :data:`_REASON_MAX` characters."""
    out = " ".join(_DIRS.sub("", text).split())
    return out if len(out) <= _REASON_MAX else out[:_REASON_MAX - 3] + "..."


class StructuredOutputUnavailableError(ServerFaultError, ImportError):
    """xgrammar failed to import, so no constrained output (JSON schema, grammar, regex, choice, forced
    tool calls) can be served: a server fault (a face answers 500 in its dialect's envelope, with the
    message; llama-server built without its grammar support has no such state). An ImportError too, for
    callers that treat a missing optional package as such."""

    def __init__(self, reason: str):
        super().__init__(f"structured output is unavailable: xgrammar failed to import: {reason}")


class _Deferred(type):
    """Metaclass of the stand-in classes: type checks against a stand-in itself are answered by the
    real transformers class of the same name (imported then); a subclass of a stand-in (xgrammar's
    ``contrib.hf.LogitsProcessor``) checks as an ordinary class."""

    def _real(cls):
        return getattr(importlib.import_module("transformers"), cls.__name__)

    def __instancecheck__(cls, obj) -> bool:
        if cls.__dict__.get("_kvserve_stand_in"):
            return isinstance(obj, cls._real())
        return super().__instancecheck__(obj)

    def __subclasscheck__(cls, sub) -> bool:
        if cls.__dict__.get("_kvserve_stand_in"):
            return issubclass(sub, cls._real())
        return super().__subclasscheck__(sub)


def _stand_in(importer: int) -> types.ModuleType:
    """The stand-in ``transformers`` module. To the importing thread (``importer``, a thread ident) it
    offers only the placeholder classes of :data:`_NAMES`; another thread that ran ``import
    transformers`` while it was in ``sys.modules`` gets every attribute (a placeholder's name too)
    from the real package, imported once xgrammar's import is over (PEP 562 ``__getattr__``)."""
    mod = types.ModuleType("transformers", "kvserve's stand-in for transformers while xgrammar is imported")
    classes = {name: _Deferred(name, (), {"_kvserve_stand_in": True, "__module__": "transformers"})
               for name in _NAMES}

    def __getattr__(name: str):
        if threading.get_ident() == importer:
            if name in classes:
                return classes[name]
            raise AttributeError(f"module 'transformers' has no attribute {name!r}")
        with _lock:  # wait out xgrammar's import: the stand-in is out of sys.modules after it
            pass
        return getattr(importlib.import_module("transformers"), name)

    mod.__getattr__ = __getattr__
    return mod


def xgrammar_module() -> types.ModuleType:
    """The ``xgrammar`` module, imported on first call without importing ``transformers`` (see the
    module docstring). Thread-safe: a caller never gets the module half-imported by another thread;
    later calls return the same module.

    Raises:
        StructuredOutputUnavailableError: xgrammar is not installed or fails to import (an
            ImportError, and a :class:`~kvserve.errors.ServerFaultError` naming the cause); the
            first failure is remembered and raised again without a new import. Its message
            names files but not their directories (:func:`_public_reason`); the log has the whole
            text, once.
    """
    global _module, _failure
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            if _failure is not None:
                raise StructuredOutputUnavailableError(_failure)
            try:
                _module = _import()
            except Exception as e:  # noqa: BLE001 - ImportError, or whatever a broken package raises
                why = f"{type(e).__name__}: {e}" if not isinstance(e, ImportError) else str(e)
                log.error("structured output is unavailable: xgrammar failed to import: %s", why)
                _failure = _public_reason(why)
                raise StructuredOutputUnavailableError(_failure) from e
    return _module


def _import() -> types.ModuleType:
    """``import xgrammar`` (with the stand-in transformers where neither is imported yet); the caller
    holds :data:`_lock`."""
    if "xgrammar" in sys.modules or "transformers" in sys.modules:
        return importlib.import_module("xgrammar")  # waits for an import in progress elsewhere
    stand_in = _stand_in(threading.get_ident())
    sys.modules["transformers"] = stand_in
    try:
        return importlib.import_module("xgrammar")
    finally:
        if sys.modules.get("transformers") is stand_in:
            del sys.modules["transformers"]
