"""Facts derived from a model file, kept across starts under ``$KVSERVE_HOME/cache``.

Some start-up work depends on nothing but a model file's bytes: parsing a GGUF header whose
vocabulary holds 49k-128k strings takes 0.5-1 s of Python on each start, reading it back as
JSON ~30 ms. Such a result is kept here as one JSON file per (kind, file identity).

The identity of a file is its absolute path, device, inode, size, modification and change times
(ns): an edit, a rewrite in place that kept the size and the modification time (``cp -p``, a
restored ``mtime``: the change time still moves), a copy (a new inode) or a replacement by
``rename`` gives another identity, so a changed file never reuses an entry of the old one (a
file changed in the last :data:`RACY_S` seconds is not cached: its next change could fall within
the file system's clock tick). The identity is stored inside the entry too and compared on
reading (the file name is a hash of it).

Entries are written to a temporary file in the same directory and renamed into place, so
concurrent starts never see half an entry (the last rename wins; both wrote the same facts). An
entry that cannot be read, parsed or does not match (a crash mid-write on a file system without
atomic rename, another format version, a hand edit) is ignored and rewritten. A cache directory
that cannot be written (read-only home) costs only the speed-up. At most :data:`MAX_ENTRIES`
entries of a kind are kept (the oldest are removed). ``KVSERVE_FILE_CACHE=0`` turns the cache
off; ``$KVSERVE_CACHE_DIR`` moves it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("kvserve.loaders")

#: bumped when what an entry holds changes meaning: entries of another version are ignored
FORMAT = 1
#: entries kept per kind (each a few MB at most: a 128k vocabulary's header is ~5 MB of JSON)
MAX_ENTRIES = 32
#: a file changed less than this many seconds ago is not cached (git's "racy" rule): file systems
#: stamp times from a coarse clock (a few ms; FAT and some network file systems: 1-2 s), so a
#: second write that soon could leave every part of the identity as it was
RACY_S = 2.0


def enabled() -> bool:
    """False when ``KVSERVE_FILE_CACHE=0`` (read on every call)."""
    return os.environ.get("KVSERVE_FILE_CACHE", "1") != "0"


def cache_dir() -> Path:
    """``$KVSERVE_CACHE_DIR``, else ``$KVSERVE_HOME/cache`` (read on every call)."""
    env = os.environ.get("KVSERVE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    from kvserve.store.blobs import kvserve_home

    return kvserve_home() / "cache"


def identity(path: str | os.PathLike, st: os.stat_result | None = None) -> list:
    """[absolute path, device, inode, size, mtime_ns, ctime_ns] of ``path`` (``st``: its stat,
    when the caller has it). Raises OSError when the file cannot be stat'ed."""
    st = st if st is not None else os.stat(path)
    return [os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def entry_path(kind: str, ident: list) -> Path:
    """Where the entry of ``kind`` for the file ``ident`` lives: ``<cache_dir>/<kind>-<hash>.json``."""
    digest = hashlib.sha256(json.dumps([FORMAT, kind, ident]).encode()).hexdigest()[:32]
    return cache_dir() / f"{kind}-{digest}.json"


def load(kind: str, ident: list) -> Any | None:
    """The value stored for (``kind``, ``ident``), or None: no entry, the cache off, or an entry
    that cannot be read or does not match (ignored; :func:`store` replaces it)."""
    if not enabled():
        return None
    p = entry_path(kind, ident)
    try:
        doc = json.loads(p.read_bytes())
        if doc["format"] == FORMAT and doc["kind"] == kind and doc["identity"] == ident:
            return doc["value"]
        log.debug("file cache: %s does not match its file; ignored", p)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as e:  # a corrupt entry: rebuilt by the caller
        log.debug("file cache: %s unreadable (%s); ignored", p, e)
    return None


def store(kind: str, ident: list, value: Any) -> bool:
    """Keep ``value`` (JSON-serializable) for (``kind``, ``ident``: :func:`identity`'s list): written
    to a temporary file and renamed into place. True when written; False (logged at debug level)
    when the cache is off, the file changed less than :data:`RACY_S` ago, or the directory cannot
    be written."""
    if not enabled():
        return False
    if time.time() - max(ident[4], ident[5]) / 1e9 < RACY_S:
        log.debug("file cache: %s changed %.1f s ago; not cached yet", ident[0], RACY_S)
        return False
    p = entry_path(kind, ident)
    tmp = None
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps({"format": FORMAT, "kind": kind, "identity": ident, "value": value},
                          ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, p)
        tmp = None
    except (OSError, TypeError, ValueError) as e:
        log.debug("file cache: cannot write %s (%s)", p, e)
        return False
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    _prune(kind, p.parent)
    return True


def _prune(kind: str, d: Path) -> None:
    """Remove the oldest entries of ``kind`` beyond :data:`MAX_ENTRIES`."""
    try:
        entries = sorted(d.glob(f"{kind}-*.json"), key=lambda q: q.stat().st_mtime_ns)
        for q in entries[:-MAX_ENTRIES]:
            q.unlink(missing_ok=True)
    except OSError:  # another start pruned the same entry meanwhile
        pass
