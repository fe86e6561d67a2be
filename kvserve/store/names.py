"""Model names with Ollama's rules (types/model/name.go): ``[host/][namespace/]model[:tag]``.

A name has four parts; the missing ones take Ollama's defaults::

    llama3.2                           registry.ollama.ai / library / llama3.2 / latest
    qwen2.5-coder:7b                   registry.ollama.ai / library / qwen2.5-coder / 7b
    myteam/coder:q4                    registry.ollama.ai / myteam  / coder / q4
    hf.co/unsloth/Qwen3-8B-GGUF:Q4_K_M hf.co              / unsloth / Qwen3-8B-GGUF / Q4_K_M

The tag is what follows the last ``:`` when that ``:`` comes after the last ``/`` (so a host
may carry a port: ``localhost:5000/ns/m``). One ``/`` sets the namespace, two the host; a host
may start with ``http://`` or ``https://`` (the scheme the registry is reached with).

Each part must match Ollama's pattern (first character a letter, digit or ``_``; then also
``-`` and ``_``; ``.`` everywhere but the namespace; ``:`` only in the host) and length
(host 1-350, the others 1-80). A ``/`` or ``:`` that promises a part that is empty makes the
name invalid (``a/:x``, ``m:``). Invalid names raise :class:`InvalidModelNameError`, an
:class:`~kvserve.errors.InvalidInputError` whose message is Ollama's ``invalid model name``
(``errtypes.InvalidModelNameErrMsg``, what /api/chat, /api/generate and /api/show answer with
400); faces that answer otherwise (/api/copy's ``source "x" is invalid``, /api/delete's
``name "x" is invalid``) read ``.name`` and build their own text.

Display (``ollama list``'s NAME, DisplayShortest): ``model:tag`` for the default host and
namespace, ``namespace/model:tag`` for another namespace on the default host, else
``host/namespace/model:tag``. Names compare case-insensitively, as Ollama's do.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.errors import InvalidInputError

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_NAMESPACE",
    "DEFAULT_TAG",
    "INVALID_MODEL_NAME",
    "InvalidModelNameError",
    "ModelName",
    "is_valid_part",
    "parse_name",
]

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
DEFAULT_SCHEME = "https"
INVALID_MODEL_NAME = "invalid model name"  # Ollama's errtypes.InvalidModelNameErrMsg

_MISSING = "!MISSING!"  # a part promised by a separator but empty: never valid (as Ollama's MissingPart)
_KINDS = ("host", "namespace", "model", "tag")
_MAX_LEN = {"host": 350, "namespace": 80, "model": 80, "tag": 80}


class InvalidModelNameError(InvalidInputError):
    """A model name that breaks Ollama's rules (a face answers 400).

    Attributes:
        name: the name as given.
        message: ``invalid model name`` unless the caller gave another text.
    """

    def __init__(self, name: str, message: str = INVALID_MODEL_NAME):
        super().__init__(message)
        self.name = name


def _word(c: str) -> bool:
    return c == "_" or ("a" <= c <= "z") or ("A" <= c <= "Z") or ("0" <= c <= "9")


def is_valid_part(kind: str, s: str) -> bool:
    """Whether ``s`` is a valid ``kind`` part (``host``, ``namespace``, ``model``, ``tag``): Ollama's
    isValidPart (ASCII letters, digits and ``_`` first; then also ``-``, ``_``; ``.`` except in a
    namespace; ``:`` only in a host; length 1-350 for a host, 1-80 otherwise)."""
    if not 1 <= len(s) <= _MAX_LEN[kind] or not _word(s[0]):
        return False
    for c in s[1:]:
        if c in "-_" or _word(c):
            continue
        if c == "." and kind != "namespace":
            continue
        if c == ":" and kind == "host":
            continue
        return False
    return True


def _cut_last(s: str, sep: str) -> tuple[str, str, bool]:
    i = s.rfind(sep)
    if i < 0:
        return s, "", False
    return s[:i] or _MISSING, s[i + 1:] or _MISSING, True


@dataclass(frozen=True, slots=True)
class ModelName:
    """A fully qualified model name (every part present and valid when made by :func:`parse_name`).

    ``scheme`` is ``https`` unless the name's host was written ``http://host``; it is not part of
    the name's identity on disk.
    """

    host: str
    namespace: str
    model: str
    tag: str
    scheme: str = DEFAULT_SCHEME

    @property
    def display(self) -> str:
        """The name as ``ollama list`` shows it (Ollama's DisplayShortest)."""
        if self.host.lower() != DEFAULT_HOST:
            return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"
        if self.namespace.lower() != DEFAULT_NAMESPACE:
            return f"{self.namespace}/{self.model}:{self.tag}"
        return f"{self.model}:{self.tag}"

    @property
    def full(self) -> str:
        """``host/namespace/model:tag`` (Ollama's Name.String)."""
        return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"

    @property
    def parts(self) -> tuple[str, str, str, str]:
        """``(host, namespace, model, tag)``: the manifest's path under ``manifests/``."""
        return (self.host, self.namespace, self.model, self.tag)

    @property
    def repository(self) -> str:
        """``namespace/model``: the repository in registry URLs ``/v2/<namespace>/<model>/...``."""
        return f"{self.namespace}/{self.model}"

    @property
    def base_url(self) -> str:
        """``<scheme>://<host>``: where the registry answers."""
        return f"{self.scheme}://{self.host}"

    def manifest_url(self) -> str:
        """The OCI distribution URL of this name's manifest: ``<base>/v2/<ns>/<model>/manifests/<tag>``."""
        return f"{self.base_url}/v2/{self.namespace}/{self.model}/manifests/{self.tag}"

    def blob_url(self, digest: str) -> str:
        """The URL of one of its blobs: ``<base>/v2/<ns>/<model>/blobs/<digest>``."""
        return f"{self.base_url}/v2/{self.namespace}/{self.model}/blobs/{digest}"

    def key(self) -> tuple[str, str, str, str]:
        """The parts lower-cased: names equal under Ollama's EqualFold have equal keys."""
        return (self.host.lower(), self.namespace.lower(), self.model.lower(), self.tag.lower())

    def with_parts(self, host: str, namespace: str, model: str, tag: str) -> ModelName:
        """The same name spelled with these parts (e.g. as an existing manifest spells them)."""
        return ModelName(host, namespace, model, tag, self.scheme)

    def __str__(self) -> str:
        return self.display


def parse_name(name: str | ModelName) -> ModelName:
    """Parse ``name`` with Ollama's rules and defaults (ParseName merged with DefaultName).

    Returns a fully qualified, valid :class:`ModelName` (a ModelName is returned unchanged).

    Raises:
        InvalidModelNameError: a part is empty, too long or has a character the rules forbid
            (message ``invalid model name``; ``.name`` holds the input).
    """
    if isinstance(name, ModelName):
        return name
    if not isinstance(name, str):
        raise InvalidModelNameError(str(name))
    s = name
    tag = model = namespace = host = ""
    scheme = DEFAULT_SCHEME
    if s.rfind(":") > s.rfind("/"):  # "/" is not a tag character, so a later ":" starts the tag
        s, tag, _ = _cut_last(s, ":")
    s, model, promised = _cut_last(s, "/")
    if not promised:
        model = s
    else:
        s, namespace, promised = _cut_last(s, "/")
        if not promised:
            namespace = s
        else:
            if "://" in s:
                scheme, _, s = s.partition("://")
            host = s
    parts = (host or DEFAULT_HOST, namespace or DEFAULT_NAMESPACE, model, tag or DEFAULT_TAG)
    if not all(is_valid_part(kind, part) for kind, part in zip(_KINDS, parts)):
        raise InvalidModelNameError(name)
    return ModelName(*parts, scheme=scheme or DEFAULT_SCHEME)
