"""Content-addressed blob storage and per-name manifests for the model cache.

Layout under the cache root (:func:`kvserve_home`: env ``KVSERVE_HOME``,
default ``~/.cache/kvserve``)::

    <home>/blobs/sha256-<64 hex>       one file per distinct content, named by its sha256
    <home>/blobs/.partial-XXXX         a blob being written (removed on failure)
    <home>/manifests/<name>.json       one manifest per model name

A manifest (:class:`Manifest`, version 1) is a small JSON object::

    {"schema_version": 1, "name": "smollm2", "format": "gguf",
     "digest": "sha256:<hex>", "filename": "SmolLM2-135M-Instruct.Q4_1.gguf",
     "size": 98362432, "source": {...}, "created": "2025-01-01T00:00:00+00:00"}

``digest`` names the blob; ``filename`` is the file's original name (blobs
have none); ``size`` is in bytes; ``source`` says where the blob came from
(for a wheel: ``{"type": "pip-wheel", "package", "version", "member"}``).
A later version moves to OCI image manifests (a config blob plus layers);
``schema_version`` tells them apart.

Every write is atomic: data goes to a temp file in the same directory, is
fsynced, then ``os.replace``d onto its final name, so readers never see a
half-written blob or manifest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = [
    "MANIFEST_SCHEMA_VERSION",
    "Manifest",
    "atomic_write_text",
    "blob_path",
    "blobs_dir",
    "copy_hashing",
    "digest_hex",
    "kvserve_home",
    "manifest_path",
    "manifests_dir",
    "partial_blob",
    "read_manifest",
    "sha256_file",
    "write_manifest",
]

MANIFEST_SCHEMA_VERSION = 1
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_HEX_RE = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20  # bytes per read while copying/hashing


def kvserve_home() -> Path:
    """The model cache root: ``$KVSERVE_HOME`` or ``~/.cache/kvserve`` (read on every call)."""
    env = os.environ.get("KVSERVE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvserve"


def blobs_dir(home: Path | None = None) -> Path:
    """``<home>/blobs``."""
    return (home or kvserve_home()) / "blobs"


def manifests_dir(home: Path | None = None) -> Path:
    """``<home>/manifests``."""
    return (home or kvserve_home()) / "manifests"


def digest_hex(digest: str) -> str:
    """Return the 64 lowercase hex digits of ``"sha256:<hex>"``, ``"sha256-<hex>"`` or ``"<hex>"``."""
    hexpart = digest.lower()
    for prefix in ("sha256:", "sha256-"):
        if hexpart.startswith(prefix):
            hexpart = hexpart[len(prefix):]
    if not _HEX_RE.match(hexpart):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return hexpart


def blob_path(digest: str, home: Path | None = None) -> Path:
    """Path of the blob with this sha256 digest: ``<home>/blobs/sha256-<hex>``."""
    return blobs_dir(home) / f"sha256-{digest_hex(digest)}"


def manifest_path(name: str, home: Path | None = None) -> Path:
    """Path of the manifest for ``name``: ``<home>/manifests/<name>.json``.

    ``name`` must be a canonical name (letters, digits, ``.``, ``_``, ``-``).
    """
    if not _NAME_RE.match(name):
        raise ValueError(f"invalid model name for the store: {name!r}")
    return manifests_dir(home) / f"{name}.json"


@dataclass
class Manifest:
    """What the store records for one model name (see the module docstring)."""

    name: str
    digest: str
    filename: str
    size: int
    format: str = "gguf"
    source: dict[str, Any] = field(default_factory=dict)
    created: str = ""
    schema_version: int = MANIFEST_SCHEMA_VERSION

    def blob_path(self, home: Path | None = None) -> Path:
        """Where this manifest's blob lives."""
        return blob_path(self.digest, home)

    def to_json(self) -> str:
        """Serialize as indented JSON (one trailing newline)."""
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """Build from a parsed manifest; unknown keys are ignored."""
        return cls(
            name=str(data["name"]),
            digest=str(data["digest"]),
            filename=str(data.get("filename", "")),
            size=int(data["size"]),
            format=str(data.get("format", "gguf")),
            source=dict(data.get("source") or {}),
            created=str(data.get("created", "")),
            schema_version=int(data.get("schema_version", MANIFEST_SCHEMA_VERSION)),
        )


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temp file in the same dir, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_manifest(manifest: Manifest, home: Path | None = None) -> Path:
    """Atomically write ``manifest`` to its path and return that path."""
    path = manifest_path(manifest.name, home)
    atomic_write_text(path, manifest.to_json())
    return path


def read_manifest(name: str, home: Path | None = None) -> Manifest | None:
    """Read the manifest for canonical ``name``; None if there is none or it is unreadable."""
    try:
        path = manifest_path(name, home)
        return Manifest.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextlib.contextmanager
def partial_blob(home: Path | None = None) -> Iterator[tuple[IO[bytes], Path]]:
    """Open a new ``<home>/blobs/.partial-XXXX`` file for writing.

    Yields ``(file, path)``. If the body raises, the partial file is removed;
    on success the caller is expected to have renamed it (whatever is still at
    ``path`` afterwards is removed too).
    """
    directory = blobs_dir(home)
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".partial-", dir=directory)
    path = Path(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f, path
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def copy_hashing(src: IO[bytes], dst: IO[bytes], update: Any = None) -> tuple[str, int]:
    """Copy ``src`` to ``dst`` in 1 MiB chunks; return ``(sha256 hex, bytes copied)``.

    ``update(n)`` (e.g. ``tqdm.update``) is called with each chunk's size.
    """
    h = hashlib.sha256()
    n = 0
    while chunk := src.read(_CHUNK):
        h.update(chunk)
        dst.write(chunk)
        n += len(chunk)
        if update is not None:
            update(len(chunk))
    dst.flush()
    os.fsync(dst.fileno())
    return h.hexdigest(), n


def sha256_file(path: Path) -> str:
    """sha256 hex digest of a file's content."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
