"""The model store, in Ollama's layout (seed 004, Example 3).

Where it is
    ``open_store(models_dir=None) -> Store``: the root is ``models_dir`` (the server's
    ``--models-dir``: ``state.args.models_dir``), else ``$OLLAMA_MODELS`` (an existing Ollama
    store, read and written in place), else ``$KVSERVE_HOME/models`` (``~/.cache/kvserve/models``).
    Opening kvserve's own store moves models of the old layout (``$KVSERVE_HOME/manifests/*.json``)
    into it first, by hard link or rename (:mod:`kvserve.store.legacy`)::

        <root>/manifests/<host>/<namespace>/<model>/<tag>    one manifest per name
        <root>/blobs/sha256-<64 hex>                         blobs, shared between manifests

Names (:mod:`kvserve.store.names`)
    ``parse_name(s) -> ModelName`` with Ollama's rules: defaults ``registry.ollama.ai``,
    ``library``, ``latest``; one ``/`` sets the namespace, two the host
    (``hf.co/<user>/<repo>:<quant>``). Invalid names raise ``InvalidModelNameError`` (an
    ``InvalidInputError``, message ``invalid model name``, ``.name`` the input). ``ModelName``
    has ``.display`` (``smollm2:latest``, ``myteam/coder:q4``, ``hf.co/u/r:Q4_K_M``: what
    ``ollama list`` shows and what the manager keys runners by), ``.full``, ``.parts``,
    ``.repository``, ``.manifest_url()``, ``.blob_url(digest)``, ``.key()`` (case-folded).

Manifests (:mod:`kvserve.store.manifest`)
    ``Manifest(config: Layer, layers: list[Layer])`` with ``.size`` (layers + config, bytes),
    ``.layer(kind)``, ``.layers_of(kind)``, ``.digests()``, ``.to_bytes()`` (as Go writes it),
    ``Manifest.from_bytes``. ``Layer(media_type, digest, size, from_, name)``; kinds are
    ``LAYER_TYPES`` (model, params, template, system, license, adapter, projector, messages) and
    ``media_type(kind)`` gives ``application/vnd.ollama.image.<kind>``. ``config_json(...)``
    builds a config blob (ConfigV2 fields, Go's order); ``gguf_config(path)`` the one Ollama's
    create writes for a GGUF; ``go_json(value)`` Go's JSON bytes (params, messages).

The store (:class:`kvserve.store.layout.Store`) — names are any form ``parse_name`` takes and
match stored manifests case-insensitively; a missing model raises ``NotFoundError``
``model 'x' not found``:
    - ``find(name) -> ModelName | None`` (the stored spelling), ``get(name) -> StoredModel | None``,
      ``require(name) -> StoredModel``, ``read_manifest(name) -> Manifest``;
    - ``list() -> list[StoredModel]`` (most recently modified first). ``StoredModel`` has
      ``name``, ``display``, ``manifest``, ``size`` (layers + config), ``digest`` (sha256 hex of
      the manifest file, ``ollama list``'s ID is its first 12), ``modified`` (epoch seconds),
      ``modified_at`` (RFC 3339), ``manifest_path``, ``model_path`` (the GGUF blob or None);
    - ``model_path(name) -> Path``: the model layer's blob, always under ``<root>/blobs``;
    - ``layer_bytes/layer_text/layer_json(name_or_manifest, kind)``, ``params(...) -> dict``,
      ``messages(...) -> list``: a layer's content by kind (None / empty when absent);
    - ``write_blob(stream, digest=None, size=None, update=None) -> BlobWrite(digest, size,
      existed)``: temp file + rename, digest verified (``DigestMismatchError``: Ollama's
      ``digest mismatch, expected "…", got "…"``); ``write_blob_bytes(data)``,
      ``import_file(path)`` (hard link when possible), ``has_blob``, ``blob_path``,
      ``partial_path(digest)`` + ``finish_partial(digest)`` for resumable downloads;
    - ``new_layer(data, kind) -> Layer``, ``layer_for_blob(digest, kind) -> Layer``;
    - ``create(name, layers, config=None) -> StoredModel`` (config None: derived from the model
      layer's GGUF), ``write_manifest(name, Manifest | raw bytes)`` (blobs must be present);
    - ``copy(src, dst)`` (same manifest bytes, shared blobs), ``delete(name) -> removed digests``
      (blobs another manifest references are kept), ``referenced_digests()``.

Package-index models and lookups (:mod:`kvserve.store.pull`), kept for their callers:
:func:`pull` (``smollm2`` -> ``smollm2:latest``: a config blob and the GGUF as model layer),
:func:`resolve_model` (a .gguf path, an HF directory or a store name -> a path),
:func:`canonical_name` (the display name a runner is keyed by), :func:`list_models` (dicts),
:func:`remove`, :class:`PullError`, :class:`ModelNotFoundError`, :func:`kvserve_home`. Each
takes ``models_dir=`` as :func:`open_store` does. Note that ``kvserve.store.pull`` as an
attribute is the function; reach the module as ``sys.modules["kvserve.store.pull"]`` (or
``importlib.import_module``), e.g. to monkeypatch ``REGISTRY``.
"""

from kvserve.store.blobs import (
    INVALID_DIGEST,
    digest_hex,
    kvserve_home,
    normalize_digest,
)
from kvserve.store.layout import (
    BlobWrite,
    DigestMismatchError,
    Store,
    StoredModel,
    default_models_dir,
    gguf_config,
    open_store,
)
from kvserve.store.manifest import (
    CONFIG_MEDIA_TYPE,
    LAYER_TYPES,
    MANIFEST_MEDIA_TYPE,
    Layer,
    Manifest,
    config_json,
    go_json,
    media_type,
)
from kvserve.store.names import (
    DEFAULT_HOST,
    DEFAULT_NAMESPACE,
    DEFAULT_TAG,
    InvalidModelNameError,
    ModelName,
    parse_name,
)
from kvserve.store.pull import (
    DEFAULT_MODEL,
    REGISTRY,
    KnownModel,
    ModelNotFoundError,
    PullError,
    canonical_name,
    list_models,
    pull,
    remove,
    resolve_model,
)

__all__ = [
    "CONFIG_MEDIA_TYPE",
    "DEFAULT_HOST",
    "DEFAULT_MODEL",
    "DEFAULT_NAMESPACE",
    "DEFAULT_TAG",
    "INVALID_DIGEST",
    "LAYER_TYPES",
    "MANIFEST_MEDIA_TYPE",
    "REGISTRY",
    "BlobWrite",
    "DigestMismatchError",
    "InvalidModelNameError",
    "KnownModel",
    "Layer",
    "Manifest",
    "ModelName",
    "ModelNotFoundError",
    "PullError",
    "Store",
    "StoredModel",
    "canonical_name",
    "config_json",
    "default_models_dir",
    "digest_hex",
    "gguf_config",
    "go_json",
    "kvserve_home",
    "list_models",
    "media_type",
    "normalize_digest",
    "open_store",
    "parse_name",
    "pull",
    "remove",
    "resolve_model",
]
