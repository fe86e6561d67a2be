"""Moving kvserve's first cache layout into Ollama's layout, once, without copying weights.

The old layout (kvserve before issue #13) was::

    $KVSERVE_HOME/manifests/<name>.json   {"schema_version": 1, "name", "digest": "sha256:<hex>",
                                           "filename", "size", "format", "source", "created"}
    $KVSERVE_HOME/blobs/sha256-<hex>      the GGUF

:func:`migrate` turns each old manifest into ``$KVSERVE_HOME/models/manifests/registry.ollama.ai/
library/<name>/latest`` (a config blob from the GGUF header plus one ``model`` layer), moves the
blob into ``models/blobs/`` by hard link then unlink (a rename where links fail; never a copy),
then removes the old manifest and the old directories once empty. A manifest whose blob is gone
or whose name is not a valid Ollama name stays where it is (logged). Safe to run twice, and by
two processes at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

from kvserve.errors import InvalidInputError
from kvserve.store.blobs import normalize_digest
from kvserve.store.manifest import Layer, media_type
from kvserve.store.names import parse_name

__all__ = ["migrate"]

log = logging.getLogger("kvserve.store")


def migrate(home: Path, store) -> list[str]:
    """Move every old-layout model under ``home`` into ``store`` (a :class:`~kvserve.store.layout.Store`).

    Returns the display names migrated.
    """
    old_manifests = home / "manifests"
    done: list[str] = []
    for path in sorted(old_manifests.glob("*.json")):
        name = _migrate_one(path, home, store)
        if name:
            done.append(name)
    for d in (old_manifests, home / "blobs"):
        with contextlib.suppress(OSError):
            d.rmdir()  # only when empty
    return done


def _migrate_one(path: Path, home: Path, store) -> str | None:
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
        digest = normalize_digest(str(old["digest"]))
        name = parse_name(str(old.get("name") or path.stem))
    except FileNotFoundError:
        return None  # another process moved it
    except (OSError, ValueError, KeyError, TypeError, InvalidInputError) as e:
        log.warning("old-layout manifest %s not migrated: %s", path, e)
        return None
    old_blob = home / "blobs" / f"sha256-{digest.split(':', 1)[1]}"
    new_blob = store.blob_path(digest)
    if not new_blob.is_file():
        if not old_blob.is_file():
            log.warning("old-layout manifest %s not migrated: its blob %s is missing", path, old_blob)
            return None
        new_blob.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(old_blob, new_blob)
        except FileExistsError:
            pass
        except OSError:
            try:
                os.replace(old_blob, new_blob)
            except OSError as e:  # another file system: no copy of the weights, leave it
                log.warning("old-layout model %s not migrated: cannot link or move %s into %s: %s",
                            name.display, old_blob, store.blobs_dir, e)
                return None
    if store.get(name) is None:
        layer = Layer(media_type("model"), digest, new_blob.stat().st_size)
        store.create(name, [layer])
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    with contextlib.suppress(FileNotFoundError):
        if new_blob.is_file():  # the same content by its digest: the old name is not needed
            old_blob.unlink()
    log.info("moved old-layout model %s into %s", name.display, store.root)
    return name.display
