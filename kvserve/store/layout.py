"""The model store in Ollama's layout: manifests by name, blobs by digest, under one root.

::

    <root>/manifests/<host>/<namespace>/<model>/<tag>   a manifest (JSON, see kvserve.store.manifest)
    <root>/blobs/sha256-<64 hex>                        a blob, shared by every manifest that lists it
    <root>/blobs/sha256-<64 hex>-partial                a download in progress (resumable)
    <root>/blobs/.tmp-XXXX                              a blob being written (renamed when verified)
    <root>/blobs/.upload-XXXX                           a POST /api/blobs body being received

Temp files (``.tmp-*``, ``.upload-*``) untouched for :data:`TEMP_MAX_AGE` seconds and partial downloads
untouched for :data:`PARTIAL_MAX_AGE` seconds are crash leftovers: :meth:`Store.clean_temp_files`
removes them (the server runs it at start).

The root is, in order: ``models_dir`` given by the caller (the server's ``--models-dir``),
``$OLLAMA_MODELS`` (an existing Ollama store, read and written in place: a user's pulled models
serve without copying), else ``$KVSERVE_HOME/models`` (``~/.cache/kvserve/models``). See
:func:`open_store`.

Thread-safety: a :class:`Store` holds no state but its root; concurrent writers are safe because
every file appears by an atomic rename (two writers of one blob write the same bytes).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvserve.errors import InvalidInputError, NotFoundError
from kvserve.store.blobs import (
    atomic_write_bytes,
    blob_file_name,
    copy_hashing,
    kvserve_home,
    normalize_digest,
    sha256_file,
)
from kvserve.store.manifest import (
    CONFIG_MEDIA_TYPE,
    Layer,
    Manifest,
    config_json,
    human_number,
    media_type,
)
from kvserve.store.names import ModelName, parse_name

__all__ = ["BlobWrite", "DigestMismatchError", "Store", "StoredModel", "default_models_dir", "gguf_config",
           "open_store"]

log = logging.getLogger("kvserve.store")

TEMP_MAX_AGE = 600.0  # seconds: a live writer touches its temp file far more often (uploads idle out at 60 s)
PARTIAL_MAX_AGE = 7 * 86400.0  # seconds: a partial download older than this is not resumed but removed


class DigestMismatchError(InvalidInputError):
    """Bytes whose sha256 is not the digest they were sent or pulled as (Ollama's text:
    ``digest mismatch, expected "sha256:…", got "sha256:…"``)."""

    def __init__(self, expected: str, got: str):
        super().__init__(f'digest mismatch, expected "{expected}", got "{got}"')
        self.expected = expected
        self.got = got


@dataclass(frozen=True)
class BlobWrite:
    """What :meth:`Store.write_blob` did: the blob's ``digest`` (``sha256:<hex>``), ``size`` in
    bytes, and ``existed`` (it was already there: Ollama's ``using existing layer``)."""

    digest: str
    size: int
    existed: bool


@dataclass(frozen=True)
class StoredModel:
    """One manifest in the store, as :meth:`Store.list` and :meth:`Store.get` return it.

    Attributes:
        name: the name as the store spells it (parts as on disk).
        manifest: the parsed manifest.
        digest: sha256 hex of the manifest file's bytes (Ollama's /api/tags ``digest``; its
            first 12 characters are ``ollama list``'s ID).
        modified: the manifest file's mtime, seconds since the epoch.
        manifest_path: the manifest file.
        model_path: the ``model`` layer's blob when the manifest has one and the blob is present;
            for an HF directory stored file by file, the directory view of its blobs
            (:func:`kvserve.store.hf_dir.model_dir`).
    """

    name: ModelName
    manifest: Manifest
    digest: str
    modified: float
    manifest_path: Path
    model_path: Path | None

    @property
    def display(self) -> str:
        """The name as ``ollama list`` shows it (``smollm2:latest``)."""
        return self.name.display

    @property
    def size(self) -> int:
        """Bytes of every layer plus the config (``ollama list``'s SIZE)."""
        return self.manifest.size

    @property
    def modified_at(self) -> str:
        """``modified`` as RFC 3339 in UTC with seconds (``2025-01-01T00:00:00+00:00``)."""
        return _dt.datetime.fromtimestamp(self.modified, _dt.UTC).isoformat(timespec="seconds")

    def as_dict(self) -> dict[str, Any]:
        """``{"name", "model", "size", "digest", "modified", "path", "format", "filename"}`` (``name``
        and ``model`` the display name, ``path`` the model blob or HF directory, ``format`` ``gguf``
        or ``safetensors``)."""
        return {"name": self.display, "model": self.display, "size": self.size, "digest": self.digest,
                "modified": self.modified_at, "path": str(self.model_path) if self.model_path else "",
                "format": "safetensors" if self.model_path is not None and self.model_path.is_dir() else "gguf",
                "filename": self.model_path.name if self.model_path else ""}


def default_models_dir() -> Path:
    """``$OLLAMA_MODELS`` when set, else ``$KVSERVE_HOME/models`` (read on every call)."""
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else kvserve_home() / "models"


def open_store(models_dir: str | os.PathLike | None = None) -> Store:
    """The store at ``models_dir``, else at :func:`default_models_dir`.

    When the store is kvserve's own (``$KVSERVE_HOME/models``) and ``$KVSERVE_HOME`` still holds
    models in the old layout (``manifests/<name>.json`` + ``blobs/``), they are moved in first
    (:func:`kvserve.store.legacy.migrate`: blobs hard-linked or renamed, never copied).
    """
    root = Path(models_dir).expanduser() if models_dir else default_models_dir()
    store = Store(root)
    home = kvserve_home()
    if root == home / "models" and (home / "manifests").is_dir():
        from kvserve.store.legacy import migrate

        migrate(home, store)
    return store


def gguf_config(path: str | os.PathLike) -> bytes:
    """The config blob Ollama's create writes for a GGUF file: model_format ``gguf``,
    model_family/model_families from ``general.architecture``, model_type the parameter count
    (Ollama's HumanNumber of the tensors' elements, e.g. ``135M``), file_type the quantization
    (Ollama's FileType names; ``unknown`` when ``general.file_type`` is absent or 0, as Ollama's
    ``t > 0`` test gives). A file whose header cannot be read gets empty fields."""
    from kvserve.loaders.gguf import read_gguf_header

    try:
        md, tensors = read_gguf_header(str(path))
    except Exception as e:  # noqa: BLE001 - a broken file still gets stored; loading it says why
        log.warning("cannot read the GGUF header of %s: %s", path, e)
        return config_json("gguf")
    arch = str(md.get("general.architecture") or "unknown")
    n_params = sum(t.n_elements for t in tensors)
    ft = md.get("general.file_type")
    file_type = _FILE_TYPES.get(int(ft), "unknown") if isinstance(ft, int) and ft > 0 else "unknown"
    return config_json("gguf", arch, [arch], human_number(n_params), file_type)


# Ollama's fs/ggml FileType.String names by general.file_type (llama_ftype).
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
               11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
               18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S",
               25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M",
               32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4_MOE", 39: "NVFP4", 40: "Q1_0"}


class Store:
    """Models under one root in Ollama's layout (see the module docstring).

    Names are anything :func:`~kvserve.store.names.parse_name` takes (``smollm2``,
    ``smollm2:latest``, ``registry.ollama.ai/library/smollm2:latest``, a ModelName) and match the
    store's manifests case-insensitively, as Ollama's getExistingName does. Methods that read a
    model raise :class:`~kvserve.errors.NotFoundError` ``model 'x' not found`` when there is
    none, and :class:`~kvserve.store.names.InvalidModelNameError` for an invalid name; bad
    digests raise :class:`~kvserve.errors.InvalidInputError` ``invalid digest format``.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    @property
    def manifests_dir(self) -> Path:
        """``<root>/manifests``."""
        return self.root / "manifests"

    @property
    def blobs_dir(self) -> Path:
        """``<root>/blobs``."""
        return self.root / "blobs"

    # -- blobs

    def clean_temp_files(self, temp_max_age: float = TEMP_MAX_AGE,
                         partial_max_age: float = PARTIAL_MAX_AGE) -> list[str]:
        """Remove crash leftovers in ``blobs/``: ``.tmp-*`` and ``.upload-*`` files not modified for
        ``temp_max_age`` seconds, ``*-partial`` downloads not modified for ``partial_max_age`` seconds
        (younger ones may belong to a writer in another process, or be resumed). Returns the names
        removed; a file that cannot be removed is skipped."""
        now = time.time()
        removed = []
        try:
            entries = list(os.scandir(self.blobs_dir))
        except FileNotFoundError:
            return []
        for entry in entries:
            if entry.name.startswith((".tmp-", ".upload-")):
                max_age = temp_max_age
            elif entry.name.startswith("sha256-") and entry.name.endswith("-partial"):
                max_age = partial_max_age
            else:
                continue
            with contextlib.suppress(OSError):
                if entry.is_file(follow_symlinks=False) and now - entry.stat().st_mtime >= max_age:
                    os.unlink(entry.path)
                    removed.append(entry.name)
        if removed:
            log.info("removed %d leftover temp/partial file(s) in %s", len(removed), self.blobs_dir)
        return sorted(removed)

    def blob_path(self, digest: str) -> Path:
        """``<root>/blobs/sha256-<hex>`` for a ``sha256:<hex>``/``sha256-<hex>`` digest (present or not)."""
        return self.blobs_dir / blob_file_name(digest)

    def partial_path(self, digest: str) -> Path:
        """``<root>/blobs/sha256-<hex>-partial``: where a download of this blob accumulates (append
        to it, resume it with a Range request, then :meth:`finish_partial`)."""
        return self.blobs_dir / (blob_file_name(digest) + "-partial")

    def has_blob(self, digest: str) -> bool:
        """Whether the blob is present (Ollama's HEAD /api/blobs/:digest)."""
        return self.blob_path(digest).is_file()

    def write_blob(self, src: IO[bytes], digest: str | None = None, size: int | None = None,
                   update: Callable[[int], Any] | None = None) -> BlobWrite:
        """Stream ``src`` into a blob: a temp file in ``blobs/``, hashed while written, renamed onto
        ``sha256-<hex>`` once its digest (and ``size``, when given) check out. Used by
        POST /api/blobs/:digest, pulls and create.

        ``update(n)`` is called with each chunk's size. When ``digest`` is given and that blob is
        already present (with ``size`` bytes, when given), ``src`` is not read (``existed`` True).

        Raises:
            DigestMismatchError: the bytes' sha256 is not ``digest`` (nothing is kept).
            InvalidInputError: a malformed ``digest``; ``size mismatch ...`` when ``size`` is wrong.
        """
        want = normalize_digest(digest) if digest is not None else None
        if want is not None and self.has_blob(want):
            have = self.blob_path(want).stat().st_size
            if size is None or have == size:  # a blob of the wrong size is written again
                return BlobWrite(want, have, True)
        self.blobs_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.blobs_dir)
        try:
            with os.fdopen(fd, "wb") as out:
                got_hex, n = copy_hashing(src, out, update)
            got = f"sha256:{got_hex}"
            if want is not None and got != want:
                raise DigestMismatchError(want, got)
            if size is not None and n != size:
                raise InvalidInputError(f"size mismatch for {got}: expected {size} bytes, got {n}")
            return self._commit(Path(tmp), got, n)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def write_blob_bytes(self, data: bytes) -> BlobWrite:
        """Store small content (a template, params JSON, a config) as a blob."""
        import io

        return self.write_blob(io.BytesIO(data))

    def finish_partial(self, digest: str) -> BlobWrite:
        """Verify ``sha256-<hex>-partial`` against ``digest`` and rename it onto the blob.

        Raises:
            NotFoundError: no partial file.
            DigestMismatchError: its content has another digest (the partial file is removed).
        """
        want = normalize_digest(digest)
        part = self.partial_path(want)
        if not part.is_file():
            raise NotFoundError(f"no partial download of {want}")
        got = f"sha256:{sha256_file(part)}"
        if got != want:
            part.unlink()
            raise DigestMismatchError(want, got)
        return self._commit(part, got, part.stat().st_size)

    def import_file(self, path: str | os.PathLike, digest: str | None = None) -> BlobWrite:
        """Put a local file's content into the store as a blob: hard-linked when the file is on
        the same file system (no copy, the source stays), else copied through :meth:`write_blob`.
        ``digest`` (when known) saves hashing a file that is already stored.

        Raises:
            FileNotFoundError: no such file. DigestMismatchError: ``digest`` is not the file's.
        """
        path = Path(path).resolve()  # a symlink's target: a hard link to the link itself would dangle
        want = normalize_digest(digest) if digest else f"sha256:{sha256_file(path)}"
        target = self.blob_path(want)
        if target.is_file():
            return BlobWrite(want, target.stat().st_size, True)
        self.blobs_dir.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except FileExistsError:
            return BlobWrite(want, target.stat().st_size, True)
        except OSError:
            with open(path, "rb") as f:
                return self.write_blob(f, want)
        if digest:  # trust but verify: a wrong digest must not name the file
            got = f"sha256:{sha256_file(target)}"
            if got != want:
                target.unlink()
                raise DigestMismatchError(want, got)
        return BlobWrite(want, target.stat().st_size, False)

    def _commit(self, tmp: Path, digest: str, size: int) -> BlobWrite:
        target = self.blob_path(digest)
        existed = target.is_file()
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)  # verified bytes: replacing a damaged copy is safe
        return BlobWrite(digest, size, existed)

    def new_layer(self, data: bytes, kind: str) -> Layer:
        """Store ``data`` as a blob and return its layer of ``kind`` (``template``, ``system``, ...)."""
        w = self.write_blob_bytes(data)
        return Layer(media_type(kind), w.digest, w.size)

    def layer_for_blob(self, digest: str, kind: str, from_: str = "") -> Layer:
        """A layer of ``kind`` for a blob already present (Ollama's NewLayerFromLayer).

        Raises:
            NotFoundError: ``blob "sha256:…" not found``.
        """
        p = self.blob_path(digest)
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            raise NotFoundError(f'blob "{normalize_digest(digest)}" not found') from None
        return Layer(media_type(kind), normalize_digest(digest), size, from_)

    # -- names and manifests

    def find(self, name: str | ModelName) -> ModelName | None:
        """The stored name matching ``name`` case-insensitively, spelled as on disk; None if none.

        Raises:
            InvalidModelNameError: ``name`` breaks Ollama's rules.
        """
        n = parse_name(name)
        exact = self.manifests_dir.joinpath(*n.parts)
        if exact.is_file():
            return n
        def walk(d: Path, rest: tuple[str, ...], got: tuple[str, ...]) -> tuple[str, ...] | None:
            # every case-insensitive match at each level: REGISTRY.OLLAMA.AI/... and
            # registry.ollama.ai/... may both exist (a copy onto a differently cased name)
            if not rest:
                return got if d.is_file() else None
            try:
                entries = sorted(os.listdir(d))
            except OSError:
                return None
            for e in entries:
                if e.lower() == rest[0].lower():
                    hit = walk(d / e, rest[1:], got + (e,))
                    if hit is not None:
                        return hit
            return None

        parts = walk(self.manifests_dir, tuple(n.parts), ())
        return n.with_parts(*parts) if parts is not None else None

    def manifest_path(self, name: str | ModelName) -> Path:
        """Where ``name``'s manifest is (or would be written): the stored spelling when it exists."""
        n = self.find(name) or parse_name(name)
        return self.manifests_dir.joinpath(*n.parts)

    def get(self, name: str | ModelName) -> StoredModel | None:
        """The stored model ``name`` names, or None (no manifest, or one that cannot be parsed).

        Raises:
            InvalidModelNameError: ``name`` breaks Ollama's rules.
        """
        n = self.find(name)
        if n is None:
            return None
        return self._load(n, self.manifests_dir.joinpath(*n.parts))

    def require(self, name: str | ModelName) -> StoredModel:
        """:meth:`get`, raising NotFoundError ``model 'x' not found`` instead of returning None."""
        m = self.get(name)
        if m is None:
            raise NotFoundError(f"model '{str(name)[:256]}' not found")
        return m

    def read_manifest(self, name: str | ModelName) -> Manifest:
        """The parsed manifest of ``name``.

        Raises:
            NotFoundError: ``model 'x' not found``. InvalidModelNameError: an invalid name.
        """
        return self.require(name).manifest

    def _load(self, n: ModelName, path: Path) -> StoredModel | None:
        import hashlib

        try:
            data = path.read_bytes()
            st = path.stat()
            manifest = Manifest.from_bytes(data)
        except (OSError, InvalidInputError) as e:
            log.warning("skipping bad manifest %s: %s", path, e)
            return None
        layer = manifest.layer("model")
        model_path = None
        if layer is not None:
            p = self.blob_path(layer.digest)
            model_path = p if p.is_file() else None
        else:  # an HF directory stored file by file: the loaders get a directory of links to its blobs
            from kvserve.store.hf_dir import model_dir

            try:
                model_path = model_dir(self, manifest)
            except InvalidInputError as e:
                log.warning("manifest %s: %s", path, e)
        return StoredModel(n, manifest, hashlib.sha256(data).hexdigest(), st.st_mtime, path, model_path)

    def write_manifest(self, name: str | ModelName, manifest: Manifest | bytes) -> StoredModel:
        """Write ``name``'s manifest atomically (the stored spelling when the name exists).

        ``manifest`` is a :class:`Manifest` (written as Go's encoder writes it) or raw bytes (a
        manifest pulled from a registry, kept byte for byte so its digest stays the registry's).

        Raises:
            InvalidModelNameError: an invalid name. InvalidInputError: bytes that are not a manifest.
            NotFoundError: ``blob "sha256:…" not found`` when it references a blob not in the store.
        """
        data = manifest if isinstance(manifest, bytes) else manifest.to_bytes()
        parsed = Manifest.from_bytes(data)
        for layer in parsed.blobs():
            if not self.has_blob(layer.digest):
                raise NotFoundError(f'blob "{layer.digest}" not found')
        n = self.find(name) or parse_name(name)
        path = self.manifests_dir.joinpath(*n.parts)
        atomic_write_bytes(path, data)
        loaded = self._load(n, path)
        assert loaded is not None
        return loaded

    def create(self, name: str | ModelName, layers: list[Layer], config: bytes | dict | Layer | None = None,
               model_file: str | os.PathLike | None = None) -> StoredModel:
        """Write a manifest for ``name`` from layers whose blobs are in the store (/api/create,
        Modelfile create, pulls from the package index).

        ``config`` is the config blob: a Layer already stored, its bytes, a dict of ConfigV2 fields
        (given to :func:`~kvserve.store.manifest.config_json`), or None to derive it from the
        ``model`` layer's GGUF (:func:`gguf_config`; ``model_file`` may name the file to read).

        Raises:
            NotFoundError: a layer's blob is missing. InvalidModelNameError: an invalid name.
        """
        if isinstance(config, Layer):
            cfg = config
        else:
            if config is None:
                model = next((x for x in layers if x.media_type == media_type("model")), None)
                src = model_file or (self.blob_path(model.digest) if model is not None else None)
                data = gguf_config(src) if src is not None else config_json()
            elif isinstance(config, dict):
                data = config_json(**config)
            else:
                data = config
            w = self.write_blob_bytes(data)
            cfg = Layer(CONFIG_MEDIA_TYPE, w.digest, w.size)
        return self.write_manifest(name, Manifest(cfg, list(layers)))

    def list(self) -> list[StoredModel]:
        """Every readable manifest, most recently modified first (``ollama list``'s order; ties by
        name). Manifests that cannot be parsed or whose path is not a valid name are skipped."""
        out = []
        root = self.manifests_dir
        if not root.is_dir():
            return out
        for path in root.glob("*/*/*/*"):
            if not path.is_file() or path.name.startswith("."):
                continue
            host, namespace, model, tag = path.relative_to(root).parts
            try:
                n = parse_name(f"{host}/{namespace}/{model}:{tag}")
            except InvalidInputError:
                continue
            if n.parts != (host, namespace, model, tag):
                continue
            m = self._load(n, path)
            if m is not None:
                out.append(m)
        out.sort(key=lambda m: (-int(m.modified), m.display))
        return out

    def model_path(self, name: str | ModelName) -> Path:
        """The ``model`` layer's blob (the GGUF the loaders read), always inside ``blobs/``; for an
        HF directory stored file by file, its directory view (links into ``blobs/``).

        Raises:
            NotFoundError: no such model, no model layer, or its blob is missing.
        """
        m = self.require(name)
        if m.model_path is None:
            raise NotFoundError(f"model '{str(name)[:256]}' not found: its weights blob is missing")
        return m.model_path

    def layer_bytes(self, name: str | ModelName | Manifest, kind: str) -> bytes | None:
        """The content of the last layer of ``kind`` (``params``, ``template``, ``system``,
        ``license``, ``messages``, ...) of a model or manifest; None when it has none.

        Raises:
            NotFoundError: no such model, or the layer's blob is missing.
        """
        manifest = name if isinstance(name, Manifest) else self.read_manifest(name)
        layer = manifest.layer(kind)
        if layer is None:
            return None
        try:
            return self.blob_path(layer.digest).read_bytes()
        except FileNotFoundError:
            raise NotFoundError(f'blob "{layer.digest}" not found') from None

    def layer_text(self, name: str | ModelName | Manifest, kind: str) -> str | None:
        """:meth:`layer_bytes` decoded as UTF-8 (template, system, license)."""
        data = self.layer_bytes(name, kind)
        return None if data is None else data.decode("utf-8", errors="replace")

    def layer_json(self, name: str | ModelName | Manifest, kind: str) -> Any:
        """:meth:`layer_bytes` parsed as JSON (``params`` -> dict, ``messages`` -> list); None when
        there is no such layer.

        Raises:
            InvalidInputError: the blob is not JSON.
        """
        import json

        data = self.layer_bytes(name, kind)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError as e:
            raise InvalidInputError(f"the {kind} layer is not JSON: {e}") from None

    def params(self, name: str | ModelName | Manifest) -> dict[str, Any]:
        """The ``params`` layer as a dict of Ollama options (``{}`` when none)."""
        value = self.layer_json(name, "params")
        return value if isinstance(value, dict) else {}

    def messages(self, name: str | ModelName | Manifest) -> list[dict[str, Any]]:
        """The ``messages`` layer (``[{"role", "content"}, ...]``; ``[]`` when none)."""
        value = self.layer_json(name, "messages")
        return value if isinstance(value, list) else []

    # -- copy and delete

    def copy(self, src: str | ModelName, dst: str | ModelName) -> StoredModel:
        """Give ``src``'s manifest a second name: the manifest's bytes are copied (so its digest is
        the same) and every blob is shared (Ollama's CopyModel). Copying onto itself does nothing.

        Raises:
            NotFoundError: ``model 'src' not found``. InvalidModelNameError: an invalid name.
        """
        source = self.require(src)
        target = self.find(dst) or parse_name(dst)
        if target.key() == source.name.key():
            return source
        path = self.manifests_dir.joinpath(*target.parts)
        atomic_write_bytes(path, source.manifest_path.read_bytes())
        loaded = self._load(target, path)
        assert loaded is not None
        return loaded

    def delete(self, name: str | ModelName) -> list[str]:
        """Remove ``name``'s manifest, then each of its blobs that no other manifest references
        (Ollama's Manifest.Remove + RemoveLayers); empty manifest directories are pruned.

        Returns the digests of the blobs removed.

        Raises:
            NotFoundError: ``model 'x' not found``. InvalidModelNameError: an invalid name.
        """
        m = self.require(name)
        m.manifest_path.unlink()
        d = m.manifest_path.parent
        while d != self.manifests_dir and d.is_relative_to(self.manifests_dir):
            try:
                d.rmdir()
            except OSError:
                break
            d = d.parent
        in_use: set[str] = set()
        for other in self.list():
            in_use |= other.manifest.digests()
        removed = []
        for digest in sorted(m.manifest.digests() - in_use):
            with contextlib.suppress(FileNotFoundError):
                self.blob_path(digest).unlink()
                removed.append(digest)
        return removed

    def referenced_digests(self) -> set[str]:
        """The digests every readable manifest references (what a pruning pass must keep)."""
        out: set[str] = set()
        for m in self.list():
            out |= m.manifest.digests()
        return out

