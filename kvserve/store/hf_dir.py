"""HF model directories in the Ollama-layout store.

Ollama's store holds one GGUF per model (its ``model`` layer). A model kvserve serves from an
HF directory (config.json, model.safetensors, tokenizer.json, sentence-transformers'
modules.json and ``1_Pooling/config.json``...) is stored the same content-addressed way:

- every file is a blob (``blobs/sha256-<hex>``), listed in the manifest as a layer of media type
  :data:`HF_FILE_MEDIA_TYPE` whose ``name`` is the file's path inside the directory
  (``config.json``, ``1_Pooling/config.json``); Ollama's own tools keep such layers (its prune
  reads every layer's digest) and skip them when running;
- the config blob says ``model_format: safetensors`` and the architecture's family;
- the loaders get a directory: :func:`model_dir` lays out ``<root>/kvserve/hf/<key>/`` with
  one relative symbolic link per file into ``blobs/`` (no copy), ``<key>`` the sha256 of the
  (name, digest) list, so manifests with the same files share one view. A view whose links no
  longer resolve (a blob was removed) is laid out again, or gives None when a blob is missing.

Thread-safety: as the store's: every view appears by an atomic rename of a complete temporary
directory, so concurrent callers see either no view or a whole one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from kvserve.errors import InvalidInputError

if TYPE_CHECKING:  # pragma: no cover
    from kvserve.store.layout import Store
    from kvserve.store.manifest import Manifest

__all__ = ["HF_FILE_MEDIA_TYPE", "VIEWS_DIR", "check_file_name", "hf_files", "model_dir"]

#: media type of one file of an HF model directory (its path in the layer's ``name``)
HF_FILE_MEDIA_TYPE = "application/vnd.kvserve.hf.file"
#: where the directory views are, under the store's root
VIEWS_DIR = Path("kvserve") / "hf"


def check_file_name(name: str) -> str:
    """A layer's ``name`` as a safe relative path (``a/b.json``).

    Raises:
        InvalidInputError: empty, absolute, with ``..``, a backslash or a NUL: a manifest must
            not place a file outside its directory.
    """
    p = PurePosixPath(name)
    if not name or "\\" in name or "\x00" in name or p.is_absolute() or any(part in ("..", ".", "") for part in
                                                                           name.split("/")):
        raise InvalidInputError(f"invalid file name in an HF directory layer: {name[:128]!r}")
    return str(p)


def hf_files(manifest: Manifest) -> list[tuple[str, str]]:
    """(relative path, digest) of each HF file layer of ``manifest``, in order ([] for a GGUF model).

    Raises:
        InvalidInputError: a layer with an unsafe name (see :func:`check_file_name`).
    """
    return [(check_file_name(layer.name), layer.digest) for layer in manifest.layers_of(HF_FILE_MEDIA_TYPE)]


def _key(files: list[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for name, digest in sorted(files):
        h.update(f"{name}\x00{digest}\n".encode())
    return h.hexdigest()


def _intact(view: Path, files: list[tuple[str, str]], store: Store) -> bool:
    for name, digest in files:
        link = view / name
        try:
            if link.resolve(strict=True) != store.blob_path(digest).resolve(strict=True):
                return False
        except OSError:
            return False
    return True


def model_dir(store: Store, manifest: Manifest) -> Path | None:
    """The directory the loaders read for ``manifest``'s HF files (laid out on first use), or
    None when it has none, a blob is missing, or the view cannot be written.

    Raises:
        InvalidInputError: a layer with an unsafe name.
    """
    files = hf_files(manifest)
    if not files or not all(store.has_blob(d) for _, d in files):
        return None
    view = store.root / VIEWS_DIR / _key(files)
    if view.is_dir() and _intact(view, files, store):
        return view
    try:
        return _lay_out(store, view, files)
    except OSError:
        return None


def _lay_out(store: Store, view: Path, files: list[tuple[str, str]]) -> Path:
    view.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=view.parent))
    try:
        for name, digest in files:
            link = tmp / name
            link.parent.mkdir(parents=True, exist_ok=True)
            target = store.blob_path(digest)
            # relative to the link's final place (same depth inside view as inside tmp)
            os.symlink(os.path.relpath(target, (view / name).parent), link)
        if view.exists():
            shutil.rmtree(view, ignore_errors=True)
        try:
            os.replace(tmp, view)
        except OSError:  # another writer laid it out meanwhile
            if not (view.is_dir() and _intact(view, files, store)):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return view
