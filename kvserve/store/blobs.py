"""Digests, hashing copies and atomic writes: the byte-level helpers of the store.

A blob is named by the sha256 of its content: ``sha256:<64 hex>`` in manifests and on the wire,
``sha256-<64 hex>`` as a file name (Ollama's BlobsPath turns the ``:`` into ``-``). Every write
is atomic: bytes go to a temp file in the destination's directory, are fsynced, then
``os.replace``d onto the final name, so a reader never sees half a blob or manifest.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import IO, Any

from kvserve.errors import InvalidInputError

__all__ = [
    "INVALID_DIGEST",
    "atomic_write_bytes",
    "atomic_write_text",
    "blob_file_name",
    "copy_hashing",
    "digest_hex",
    "kvserve_home",
    "normalize_digest",
    "sha256_file",
]

INVALID_DIGEST = "invalid digest format"  # Ollama's manifest.ErrInvalidDigestFormat
_DIGEST_RE = re.compile(r"^sha256[:-]([0-9a-fA-F]{64})$")
_HEX_RE = re.compile(r"^[0-9a-fA-F]{64}$")
_CHUNK = 1 << 20  # bytes per read while copying/hashing


def kvserve_home() -> Path:
    """kvserve's cache root: ``$KVSERVE_HOME`` or ``~/.cache/kvserve`` (read on every call)."""
    env = os.environ.get("KVSERVE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvserve"


def digest_hex(digest: str) -> str:
    """The 64 lowercase hex digits of ``sha256:<hex>``, ``sha256-<hex>`` or a bare ``<hex>``.

    Raises:
        InvalidInputError: ``invalid digest format`` (Ollama's text) for anything else.
    """
    if isinstance(digest, str):
        m = _DIGEST_RE.match(digest)
        if m:
            return m.group(1).lower()
        if _HEX_RE.match(digest):
            return digest.lower()
    raise InvalidInputError(INVALID_DIGEST)


def normalize_digest(digest: str) -> str:
    """``sha256:<64 lowercase hex>`` for any form :func:`digest_hex` accepts."""
    return f"sha256:{digest_hex(digest)}"


def blob_file_name(digest: str) -> str:
    """``sha256-<hex>``: the blob's file name under ``blobs/``."""
    return f"sha256-{digest_hex(digest)}"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same directory, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def copy_hashing(src: IO[bytes], dst: IO[bytes], update: Any = None) -> tuple[str, int]:
    """Copy ``src`` to ``dst`` in 1 MiB chunks; return ``(sha256 hex, bytes copied)``.

    ``update(n)`` (e.g. ``tqdm.update``) is called with each chunk's size in bytes. ``dst`` is
    flushed and fsynced at the end.
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


def sha256_file(path: Path | str) -> str:
    """The sha256 hex digest of a file's content."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
