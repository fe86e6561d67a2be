"""Ollama's manifests (OCI image manifests, schemaVersion 2) and the config blob they point to.

A manifest lists a model's blobs::

    {"schemaVersion":2,"mediaType":"application/vnd.docker.distribution.manifest.v2+json",
     "config":{"mediaType":"application/vnd.docker.container.image.v1+json","digest":"sha256:…","size":487},
     "layers":[{"mediaType":"application/vnd.ollama.image.model","digest":"sha256:…","size":4683087332},
               {"mediaType":"application/vnd.ollama.image.template","digest":"sha256:…","size":1626}]}

Each layer's media type says what its blob is (:data:`LAYER_TYPES`): ``model`` (GGUF weights),
``params`` (default options, a JSON object), ``template`` (a Go text/template), ``system``,
``license``, ``adapter`` (LoRA GGUF), ``projector`` (vision GGUF), ``messages`` (a JSON list).
The config blob is a JSON object (:func:`config_json`): ``model_format``, ``model_family``,
``model_families``, ``model_type`` (parameter size, e.g. ``135M``), ``file_type``
(quantization, e.g. ``Q4_1``), optional fields, then ``architecture``/``os``.

JSON is written as Go's encoding/json writes it (:func:`go_json`: compact, ``<``, ``>``, ``&``
escaped, a trailing newline), so a manifest or config kvserve writes has the same bytes, and so
the same digest, as the one Ollama would write for the same content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvserve.errors import InvalidInputError
from kvserve.store.blobs import normalize_digest

__all__ = [
    "CONFIG_MEDIA_TYPE",
    "LAYER_TYPES",
    "MANIFEST_MEDIA_TYPE",
    "MEDIA_PREFIX",
    "Layer",
    "Manifest",
    "config_json",
    "go_json",
    "human_number",
    "media_type",
]

MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA_TYPE = "application/vnd.docker.container.image.v1+json"
MEDIA_PREFIX = "application/vnd.ollama.image."
LAYER_TYPES = ("model", "params", "template", "system", "license", "adapter", "projector", "messages")


def media_type(kind: str) -> str:
    """``application/vnd.ollama.image.<kind>`` for a short kind (``model``, ``params``, ...); a full
    media type is returned unchanged."""
    return kind if "/" in kind else MEDIA_PREFIX + kind


def go_json(value: Any) -> bytes:
    """``value`` encoded as Go's ``json.NewEncoder(w).Encode`` writes it (compact, HTML-escaped,
    ``\\n`` at the end). Dict keys keep their order."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    for raw, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                     ("\u2029", "\\u2029")):
        text = text.replace(raw, esc)
    return (text + "\n").encode("utf-8")


@dataclass
class Layer:
    """One blob of a manifest: ``mediaType``, ``digest`` (``sha256:<hex>``), ``size`` (bytes), and
    Ollama's optional ``from`` and ``name``. Other keys read from a manifest are kept in ``extra``."""

    media_type: str
    digest: str
    size: int
    from_: str = ""
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """The short kind (``model``, ``template``, ...); the full media type when not Ollama's."""
        t = self.media_type
        return t.removeprefix(MEDIA_PREFIX)

    def to_dict(self) -> dict[str, Any]:
        """The layer as manifest JSON (Go's field order; empty ``from``/``name`` omitted)."""
        d: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.from_:
            d["from"] = self.from_
        if self.name:
            d["name"] = self.name
        d.update(self.extra)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Layer:
        """Parse one layer object.

        Raises:
            InvalidInputError: not an object, or a missing/ill-typed ``mediaType``/``digest``/``size``.
        """
        if not isinstance(d, dict):
            raise InvalidInputError("manifest layer is not an object")
        mt, digest, size = d.get("mediaType"), d.get("digest"), d.get("size")
        if not isinstance(mt, str) or not isinstance(digest, str):
            raise InvalidInputError("manifest layer needs a mediaType and a digest")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidInputError("manifest layer needs a size in bytes")
        extra = {k: v for k, v in d.items() if k not in ("mediaType", "digest", "size", "from", "name")}
        return cls(mt, normalize_digest(digest), size, str(d.get("from") or ""), str(d.get("name") or ""), extra)


@dataclass
class Manifest:
    """A parsed manifest. ``size`` is what ``ollama list`` shows: every layer plus the config."""

    config: Layer | None
    layers: list[Layer]
    schema_version: int = 2
    media_type_: str = MANIFEST_MEDIA_TYPE
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """Bytes of all layers plus the config blob (Ollama's Manifest.Size)."""
        return sum(layer.size for layer in self.layers) + (self.config.size if self.config else 0)

    def blobs(self) -> list[Layer]:
        """Every blob it references: the layers, then the config."""
        return [*self.layers, *([self.config] if self.config is not None else [])]

    def digests(self) -> set[str]:
        """The ``sha256:<hex>`` of every blob it references."""
        return {layer.digest for layer in self.blobs()}

    def layer(self, kind: str) -> Layer | None:
        """The last layer of this kind (``model``, ``template``, ... or a full media type), or None.

        Ollama reads the last one when a manifest has several (later layers override)."""
        mt = media_type(kind)
        found = None
        for layer in self.layers:
            if layer.media_type == mt:
                found = layer
        return found

    def layers_of(self, kind: str) -> list[Layer]:
        """Every layer of this kind, in order (e.g. several ``adapter`` or ``projector`` layers)."""
        mt = media_type(kind)
        return [layer for layer in self.layers if layer.media_type == mt]

    def to_dict(self) -> dict[str, Any]:
        """The manifest as JSON (Go's field order)."""
        d: dict[str, Any] = {"schemaVersion": self.schema_version, "mediaType": self.media_type_,
                             "config": self.config.to_dict() if self.config else {"mediaType": "", "digest": "",
                                                                                  "size": 0},
                             "layers": [layer.to_dict() for layer in self.layers]}
        d.update(self.extra)
        return d

    def to_bytes(self) -> bytes:
        """The bytes written to disk and pushed: :func:`go_json` of :meth:`to_dict`."""
        return go_json(self.to_dict())

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """Parse manifest JSON (from disk or a registry).

        Raises:
            InvalidInputError: not JSON, not an object, schemaVersion other than 2, bad layers.
        """
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidInputError(f"manifest is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise InvalidInputError("manifest is not a JSON object")
        if d.get("schemaVersion") != 2:
            raise InvalidInputError(f"unsupported manifest schemaVersion {d.get('schemaVersion')!r} (want 2)")
        layers = d.get("layers") or []
        if not isinstance(layers, list):
            raise InvalidInputError("manifest layers is not a list")
        cfg = d.get("config")
        config = Layer.from_dict(cfg) if isinstance(cfg, dict) and cfg.get("digest") else None
        extra = {k: v for k, v in d.items() if k not in ("schemaVersion", "mediaType", "config", "layers")}
        return cls(config, [Layer.from_dict(x) for x in layers], 2, str(d.get("mediaType") or MANIFEST_MEDIA_TYPE),
                   extra)


def human_number(n: int) -> str:
    """Ollama's format.HumanNumber: ``135M``, ``1.5B``, ``7B``, ``12K``, ``999`` (parameter sizes)."""
    for scale, suffix, fmt in ((10**9, "B", "{:.1f}"), (10**6, "M", "{:.2f}")):
        if n >= scale:
            v = n / scale
            return (f"{v:.0f}" if v == int(v) else fmt.format(v)) + suffix
    if n >= 1000:
        return f"{n / 1000:.0f}K"
    return str(n)


_CONFIG_OPTIONAL = ("renderer", "parser", "requires", "remote_host", "remote_model", "remote_dialect", "remote_key_env",
                    "capabilities",
                    "context_length", "embedding_length", "base_name", "draft")


def config_json(model_format: str = "", model_family: str = "", model_families: list[str] | None = None,
                model_type: str = "", file_type: str = "", **optional: Any) -> bytes:
    """The config blob's bytes, as Ollama's create writes its ConfigV2.

    ``optional`` holds the omitempty fields in Go's order when given and not empty: renderer,
    parser, requires, remote_host, remote_model, capabilities, context_length, embedding_length,
    base_name, draft. ``architecture`` is ``amd64`` and ``os`` ``linux`` (what Ollama writes).
    ``model_families`` None is written ``null`` (a Go nil slice).
    """
    d: dict[str, Any] = {"model_format": model_format, "model_family": model_family,
                         "model_families": model_families, "model_type": model_type, "file_type": file_type}
    unknown = set(optional) - set(_CONFIG_OPTIONAL) - {"architecture", "os"}
    if unknown:
        raise TypeError(f"unknown config fields: {sorted(unknown)}")
    for key in _CONFIG_OPTIONAL:
        if optional.get(key):
            d[key] = optional[key]
    d["architecture"] = optional.get("architecture", "amd64")
    d["os"] = optional.get("os", "linux")
    return go_json(d)
