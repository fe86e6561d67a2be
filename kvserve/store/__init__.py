"""The model store: content-addressed blobs plus manifests under ``$KVSERVE_HOME``.

Public API: :func:`pull`, :func:`resolve_model`, :func:`list_models`,
:func:`remove`, :class:`PullError`, :class:`ModelNotFoundError`,
:func:`kvserve_home`. Note that ``kvserve.store.pull`` as an attribute
is the function; reach the module as ``sys.modules["kvserve.store.pull"]``
(or ``importlib.import_module``), e.g. to monkeypatch ``REGISTRY``. See :mod:`kvserve.store.blobs` for the on-disk layout.
"""

from kvserve.store.blobs import Manifest, blob_path, kvserve_home, manifest_path
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
    "DEFAULT_MODEL",
    "KnownModel",
    "Manifest",
    "ModelNotFoundError",
    "PullError",
    "REGISTRY",
    "blob_path",
    "canonical_name",
    "kvserve_home",
    "list_models",
    "manifest_path",
    "pull",
    "remove",
    "resolve_model",
]
