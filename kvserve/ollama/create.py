"""Ollama's create: a new model from another one or from GGUF weights, as a stream of statuses.

:func:`iter_create` runs Ollama's ``POST /api/create`` (``server/create.go``) on a
:class:`~kvserve.store.Store`: it takes the request's JSON, writes the new small layers and the
manifest, and yields Ollama's progress objects. The /api face streams them as NDJSON (``stream``
false: the last one), the CLI prints their ``status``. :func:`iter_create_modelfile` is the same
from a Modelfile in this process (what ``ollama create NAME -f Modelfile`` does on the client
side first: ``gathering model components``, the weights put into the store, then the create).

The request (Ollama's ``api.CreateRequest``)::

    model (or the older name)   the new model's name (``invalid model name`` when it breaks the rules)
    from                        a stored model to build on, or a blob digest ``sha256:<hex>``
    files                       {file name: digest} of GGUF blobs already in the store (POST /api/blobs)
    template, system            Go template text / system prompt: replace the base's
    license                     a string or a list of strings: added to the base's licenses
    parameters                  an object: merged over the base's params layer (a key given wins)
    messages                    [{role, content}]: replace the base's MESSAGE layer when not empty
    renderer, parser, requires  kept in the config (else the base's)
    info                        Ollama's config overrides: capabilities, model_family, base_name,
                                quantization_level, parameter_size, context_length, embedding_length
    adapters                    {file name: digest}: one LoRA GGUF, or a PEFT directory's files
                                (``adapter_config.json`` + ``*.safetensors``, converted to a GGUF);
                                an ``adapter`` layer after the base's layers (see below)
    remote_host                 a remote model (:mod:`kvserve.remote`): ``from`` is the upstream's model;
                                kvserve's ``remote_dialect`` (ollama, the default as in Ollama, or openai) and
                                ``remote_key_env`` (the key's environment variable) go with it
    quantize, draft_files       refused: not supported yet (see below)
    modelfile                   the older form (Ollama < 0.5): a Modelfile's text, parsed with
                                :mod:`kvserve.ollama.modelfile`; FROM must then be a model name or a
                                blob digest (the server cannot read the client's files)

How the layers are built (Ollama's ``CreateHandler``/``createModel``):

1. The base layers: ``from`` a model reuses every layer of its manifest (``from`` set to its
   short name, the blob shared: a derived model costs only its small new layers); ``files``
   makes one ``model`` layer per GGUF blob (``from`` the file name; ``parsing GGUF`` per file).
   A missing base model is pulled when the caller gives ``pull`` (Ollama pulls it from its
   registry; the /api face does), else ``model 'x' not found``.
2. TEMPLATE (checked by the Go template parser: ``template error: ...``) and SYSTEM replace the
   base's layer of that kind; each license adds a layer; the parameters are merged over every
   params layer of the base (one new params layer, even when only the base had parameters:
   Ollama re-writes it, at the end); messages replace the base's layer when given.
3. The config: model fields from the weights' GGUF header (``gguf``, the architecture, the
   parameter count as Ollama's HumanNumber, the file type), renderer/parser/requires/
   capabilities from the request, else from the base's config, then ``info``.
4. ``adapters`` (Ollama's ``convertModelFromFiles(..., isAdapter)``): a LoRA GGUF blob becomes an
   ``application/vnd.ollama.image.adapter`` layer as it is (``parsing GGUF``); a PEFT directory's
   files are converted to one LoRA GGUF blob (``converting adapter``, as Ollama does, so that the
   layer is one file that llama-server's ``--lora`` and Ollama's registry carry:
   :mod:`kvserve.ollama.adapter_convert`). Unlike Ollama, the adapter is checked against the base
   model's weights here (architecture, every module's shape: a 400 naming the module), not when
   the model first loads. A model with adapter layers serves with each applied at scale 1.0 in
   every face (:mod:`kvserve.serving.lora_modules`).
5. One ``using existing layer sha256:…`` / ``creating new layer sha256:…`` per layer in
   manifest order, ``writing manifest``, the manifest, then the blobs only the replaced
   manifest of that name used are removed, and ``success``.

Differences from Ollama, on purpose: a GGUF given as ``files`` is stored as it is (Ollama
re-writes it through llama-quantize to validate it, and maps its Jinja chat template to one of
its library's Go templates: kvserve renders the GGUF's own Jinja template when there is no
TEMPLATE, so no template layer is invented); files that are not GGUF, more than one model GGUF,
split GGUFs, projectors (vision), draft models, safetensors weights and
``quantize`` are refused with a :class:`~kvserve.errors.NotSupportedError` or an
:class:`~kvserve.errors.InvalidInputError` that says so. A safetensors (Hugging Face) directory
is refused: the store keeps one GGUF weights file per model, and converting is llama.cpp's
``convert_hf_to_gguf.py``'s job; a directory holding ``.gguf`` files is taken as those files.

Errors are domain errors (raised before the first status or between two), with Ollama's texts:
InvalidInputError ``invalid model name``, ``neither 'from' or 'files' was specified``, ``file
path must be relative``, ``invalid digest format``, ``unknown type``, ``supplied file was not in
GGUF format``, ``template error: ...``, ``json: cannot unmarshal ...`` (a field of the wrong
JSON type); NotFoundError ``model 'x' not found``, ``blob "sha256:…" not found``;
NotSupportedError for what kvserve has no support for yet.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvserve.errors import InvalidInputError, NotFoundError, NotSupportedError
from kvserve.store import (
    Layer,
    Store,
    StoredModel,
    config_json,
    gguf_config,
    media_type,
    normalize_digest,
    parse_name,
)

__all__ = ["Pull", "iter_create", "iter_create_modelfile", "refuse_other_formats", "request_file_names"]

#: ``pull(name)``: the progress events of pulling a missing base model into the store (e.g.
#: ``lambda n: kvserve.store.registry_client.iter_pull(n, store=store)``).
Pull = Callable[[str], Iterator[dict]]

_DIGEST = re.compile(r"@?sha256[:-][0-9a-fA-F]{64}")

QUANTIZE_UNSUPPORTED = ("quantize is not supported yet: kvserve serves a GGUF's weights as they are "
                        "(quantize it with llama.cpp's llama-quantize first)")
ONLY_ONE_ADAPTER = "only one adapter is currently supported"  # Ollama's errOnlyOneAdapterSupported
DRAFT_UNSUPPORTED = "DRAFT is not supported yet: kvserve has no draft-model speculative decoding (prompt lookup: kvserve serve --spec-type ngram)"
SAFETENSORS_UNSUPPORTED = ("creating a model from safetensors weights is not supported yet: kvserve's store "
                           "holds GGUF weights (convert them with llama.cpp's convert_hf_to_gguf.py, then "
                           "FROM the .gguf file)")


# ------------------------------------------------------------------------------ request checks


def _go_type(v: Any) -> str:
    return {bool: "bool", int: "number", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(v), "value")


def _unmarshal_error(v: Any, field: str, go_type: str) -> InvalidInputError:
    return InvalidInputError(f"json: cannot unmarshal {_go_type(v)} into Go struct field CreateRequest.{field} "
                             f"of type {go_type}")


def _str(body: dict, key: str) -> str:
    v = body.get(key)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise _unmarshal_error(v, key, "string")
    return v


def _str_map(body: dict, key: str) -> dict[str, str] | None:
    """A JSON object of strings (``files``, ``adapters``): None when absent."""
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _unmarshal_error(v, key, "map[string]string")
    for x in v.values():
        if not isinstance(x, str):
            raise _unmarshal_error(x, key, "string")
    return {str(k): x for k, x in v.items()}


def _valid_path(p: str) -> bool:
    """Go's ``io/fs.ValidPath``: unrooted, slash-separated, no empty, ``.`` or ``..`` element
    (``.`` alone names the root)."""
    if p == ".":
        return True
    return bool(p) and all(e not in ("", ".", "..") for e in p.split("/"))


def _digest(d: str) -> str:
    """``sha256:<hex>`` for a well-formed digest; InvalidInputError ``invalid digest format``."""
    if not _DIGEST.fullmatch(d.strip()):
        raise InvalidInputError("invalid digest format")
    return normalize_digest(d.strip().lstrip("@"))


def _check_request(body: dict) -> None:
    """What Ollama's CreateHandler checks before it starts: file paths and digests, then what
    kvserve refuses (quantize, adapters, draft models)."""
    for key in ("files", "draft_files"):
        for name, digest in (_str_map(body, key) or {}).items():
            if not _valid_path(name):
                raise InvalidInputError("file path must be relative")
            if not digest:
                raise InvalidInputError("invalid digest format")
    if _str(body, "draft_quantize") and not _str_map(body, "draft_files"):
        raise InvalidInputError("--draft-quantize requires a DRAFT model")
    for digest in (_str_map(body, "adapters") or {}).values():
        if not digest:
            raise InvalidInputError("invalid digest format")
    if _str(body, "quantize") or _str(body, "quantization"):
        raise NotSupportedError(QUANTIZE_UNSUPPORTED)
    for name in _str_map(body, "adapters") or {}:
        if not _valid_path(name):
            raise InvalidInputError("file path must be relative")
    if _str_map(body, "draft_files") or _str(body, "draft_quantize"):
        raise NotSupportedError(DRAFT_UNSUPPORTED)


def _from_modelfile_text(body: dict) -> dict:
    """The older request form: ``modelfile`` (a Modelfile's text) -> the fields of the current
    form. FROM must be a model name or a blob digest (the server has no access to the client's
    files; Ollama's old clients uploaded them and wrote ``FROM @sha256:…``)."""
    from kvserve.ollama.modelfile import parse_modelfile

    mf = parse_modelfile(_str(body, "modelfile"))
    mf.check_supported()
    req = mf.create_request(None)
    for s in req.sources:
        if s.kind not in ("model", "blob"):
            raise InvalidInputError(f"FROM {s.value}: a file path needs the current create request (upload the "
                                    "file with POST /api/blobs/:digest and name it in 'files')")
    adapters = {}
    for a in req.adapters[-1:]:
        if not _DIGEST.fullmatch(a):
            raise InvalidInputError(f"ADAPTER {a}: a file path needs the current create request (upload the file "
                                    "with POST /api/blobs/:digest and name it in 'adapters')")
        adapters = {"adapter.gguf": _digest(a)}
    out = {k: v for k, v in body.items() if k != "modelfile"}
    for k, v in req.to_json(adapters=adapters or None).items():
        out.setdefault(k, v)
    return out


# ------------------------------------------------------------------------------ base layers


def _header(path: Path) -> dict:
    from kvserve.loaders.gguf import read_gguf_header

    try:
        md, _ = read_gguf_header(str(path))
    except Exception as e:  # noqa: BLE001 - any unreadable header is the client's file
        raise InvalidInputError(f"invalid GGUF file: {e}") from None
    return md


def _config_of(store: Store, stored: StoredModel) -> dict:
    cfg = stored.manifest.config
    if cfg is None:
        return {}
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(store.blob_path(cfg.digest).read_bytes())
        if isinstance(data, dict):
            return data
    return {}


def _base_model(store: Store, source: str, pull: Pull | None) -> Iterator[dict | tuple[list[Layer], dict]]:
    """Layers and config of the stored model ``source`` (pulled first when missing and ``pull``
    is given); yields the pull's events, then one tuple."""
    try:
        base = store.get(source)
    except InvalidInputError:
        raise InvalidInputError("invalid model name") from None
    if base is None and pull is not None:
        yield from pull(source)
        base = store.get(source)
    if base is None:
        raise NotFoundError(f"model '{source}' not found")
    layers = []
    for x in base.manifest.layers:
        p = store.blob_path(x.digest)
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            raise NotFoundError(f'blob "{x.digest}" not found') from None
        layers.append(Layer(x.media_type, x.digest, size, base.display, x.name))
    yield layers, _config_of(store, base)


#: the formats of kvserve.loaders.detect that are HF checkpoints (create stores GGUF weights only)
_HF_KEYS = ("safetensors", "safetensors-quantized", "pytorch-bin")


def refuse_other_formats(directory: str | os.PathLike) -> None:
    """A FROM directory laid out as a format kvserve does not run (ONNX Runtime GenAI, EXL2/EXL3,
    MLX, TensorRT-LLM) gets that format's one line (:mod:`kvserve.loaders.detect`); GGUF, HF
    checkpoints and unknown folders are left to create's own checks.

    Raises:
        UnsupportedFormatError: the format's one line.
    """
    from kvserve.loaders.detect import detect

    kind = detect(directory, deep=False)
    if kind.format.key not in ("gguf", "gguf-folder", "unknown", "hf-no-weights", *_HF_KEYS):
        kind.require_loadable()


def _refuse_other_formats(store: Store, files: dict[str, str]) -> None:
    """A ``files`` listing laid out as a format kvserve does not run (ONNX Runtime GenAI, EXL2,
    MLX, TensorRT-LLM) gets that format's one line (:mod:`kvserve.loaders.detect`); an HF
    checkpoint gets :data:`SAFETENSORS_UNSUPPORTED`; anything else is left to the GGUF checks."""
    from kvserve.loaders.detect import detect_files

    config = None
    if "config.json" in files:
        try:
            blob = store.blob_path(_digest(files["config.json"]))
            if blob.is_file() and blob.stat().st_size <= 4 << 20:
                config = json.loads(blob.read_bytes())
        except (OSError, ValueError):
            config = None
    kind = detect_files(files, config)
    if kind.format.key in _HF_KEYS:
        raise NotSupportedError(SAFETENSORS_UNSUPPORTED)
    if kind.format.key not in ("gguf", "gguf-folder", "unknown", "hf-no-weights"):
        kind.require_loadable()


def _gguf_layers(store: Store, files: dict[str, str]) -> Iterator[dict | list[Layer]]:
    """One ``model`` layer per GGUF blob of ``files`` (sorted by name, ``parsing GGUF`` before
    each); yields the statuses, then the list of layers."""
    names = sorted(files)
    _refuse_other_formats(store, files)
    if any(n.endswith(".safetensors") for n in names):
        raise NotSupportedError(SAFETENSORS_UNSUPPORTED)
    if not names or not any(n.endswith(".gguf") or _is_gguf(store, files[n]) for n in names):
        raise InvalidInputError("unknown type")  # Ollama's errUnknownType (an empty files, no GGUF)
    layers: list[Layer] = []
    for name in names:
        yield {"status": "parsing GGUF"}
        digest = _digest(files[name])
        path = store.blob_path(digest)
        if not path.is_file():
            raise NotFoundError(f'blob "{digest}" not found')
        if not _is_gguf(store, digest):
            raise InvalidInputError("supplied file was not in GGUF format")
        md = _header(path)
        kind = str(md.get("general.type") or "")
        if kind == "adapter":
            raise InvalidInputError("a LoRA adapter GGUF was given as the model's weights: name the base model in "
                                    "FROM and the adapter in ADAPTER ('adapters')")
        if kind in ("projector", "mmproj") or str(md.get("general.architecture")) == "clip":
            raise NotSupportedError("projector (vision) GGUF files are not supported yet: kvserve has no vision "
                                    "models")
        if _split_count(md) > 1:
            raise NotSupportedError("split GGUF files are not supported yet: merge them into one file first "
                                    "(llama.cpp's llama-gguf-split --merge)")
        if layers:
            raise InvalidInputError("more than one model GGUF was given: a kvserve model has one weights file")
        layers.append(Layer(media_type("model"), digest, path.stat().st_size, name))
    yield layers


def _is_gguf(store: Store, digest: str) -> bool:
    try:
        with open(store.blob_path(_digest(digest)), "rb") as f:
            return f.read(4) == b"GGUF"
    except (OSError, InvalidInputError):
        return False


def _split_count(md: dict) -> int:
    arch = str(md.get("general.architecture") or "")
    for key in ("split.count", f"{arch}.split.count"):
        v = md.get(key)
        if isinstance(v, int):
            return v
    return 0


# ------------------------------------------------------------------------------ adapters


def _base_weights(store: Store, layers: list[Layer]) -> Path:
    """The base model's weights blob (the ``model`` layer): what an adapter is checked against."""
    for x in layers:
        if x.media_type == media_type("model"):
            return store.blob_path(x.digest)
    raise InvalidInputError("an ADAPTER needs a base model with weights (FROM a model or a GGUF file)")


def _adapter_layers(store: Store, adapters: dict[str, str], base: list[Layer],
                    created: set[str]) -> Iterator[dict | list[Layer]]:
    """The ``adapter`` layer of ``adapters`` ({file name: digest}): a LoRA GGUF as it is, a PEFT
    directory's files converted to one LoRA GGUF (its digest added to ``created`` when the blob is
    new); each checked against the base's weights. Yields statuses, then the list of layers.

    Raises:
        InvalidInputError: Ollama's ``unknown type``, ``only one adapter is currently supported``,
            ``invalid digest format``; a GGUF that is not a LoRA adapter; a PEFT directory without
            ``adapter_config.json``; an adapter that does not fit the base (naming the module).
        NotFoundError: ``blob "sha256:…" not found``.
    """
    from kvserve.serving.chat_runner import model_shape

    digests = {name: _digest(d) for name, d in adapters.items()}
    for d in digests.values():
        if not store.blob_path(d).is_file():
            raise NotFoundError(f'blob "{d}" not found')
    base_path = _base_weights(store, base)
    config = model_shape(str(base_path))[0]
    names = sorted(digests)
    if any(n.endswith(".safetensors") for n in names):
        yield {"status": "converting adapter"}
        layer, existed = _convert_peft(store, digests, config)
        if not existed:
            created.add(layer.digest)
        yield [layer]
        return
    if not any(n.endswith(".gguf") or _is_gguf(store, digests[n]) for n in names):
        raise InvalidInputError("unknown type")
    if len(names) > 1:
        raise InvalidInputError(ONLY_ONE_ADAPTER)
    name = names[0]
    yield {"status": "parsing GGUF"}
    digest = digests[name]
    path = store.blob_path(digest)
    if not _is_gguf(store, digest):
        raise InvalidInputError("supplied file was not in GGUF format")
    kind = str(_header(path).get("general.type") or "")
    if kind != "adapter":
        raise InvalidInputError(f"the ADAPTER file {name} is not a LoRA adapter (its GGUF general.type is "
                                f"{kind or 'unset'!r}, not 'adapter')")
    _check_adapter(str(path), config, name)
    yield [Layer(media_type("adapter"), digest, path.stat().st_size, name)]


def _check_adapter(path: str, config, shown: str) -> None:
    """The adapter read against the base's config; its errors name ``shown``, not the blob path."""
    from kvserve.lora import LoraBase, load_adapter

    try:
        load_adapter(path, LoraBase.of(config))
    except InvalidInputError as e:
        raise InvalidInputError(str(e).replace(path, shown)) from None


def _convert_peft(store: Store, digests: dict[str, str], config) -> tuple[Layer, bool]:
    """A PEFT adapter's blobs, linked under their names into a temporary directory of the store,
    converted to one LoRA GGUF blob (Ollama's ``convertFromSafetensors`` with ``isAdapter``); the
    layer and whether its blob was in the store already."""
    import shutil
    import tempfile

    from kvserve.ollama.adapter_convert import peft_to_gguf

    if "adapter_config.json" not in {posixpath.basename(n) for n in digests}:
        raise InvalidInputError("a PEFT adapter needs its adapter_config.json beside its .safetensors file")
    store.blobs_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="kvserve-adapter-", dir=store.root))
    try:
        src = tmp / "peft"
        for name, digest in digests.items():
            target = src / name
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(store.blob_path(digest), target)
            except OSError:
                shutil.copyfile(store.blob_path(digest), target)
        peft = next(p.parent for p in src.rglob("adapter_config.json"))
        out = tmp / "adapter.gguf"
        try:
            peft_to_gguf(peft, config, out)
        except InvalidInputError as e:
            raise InvalidInputError(str(e).replace(str(peft), "the PEFT adapter")) from None
        w = store.import_file(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Layer(media_type("adapter"), w.digest, w.size), w.existed


# ------------------------------------------------------------------------------ new layers


class _Layers:
    """The layer list being built and the status of each new blob (Ollama's ``Layer.Status``)."""

    def __init__(self, store: Store, base: list[Layer]):
        self.store = store
        self.layers = list(base)
        self.status = {x.digest: "using existing layer" for x in base}

    def remove(self, kind: str) -> None:
        self.layers = [x for x in self.layers if x.media_type != media_type(kind)]

    def add(self, kind: str, data: bytes) -> None:
        w = self.store.write_blob_bytes(data)
        # a blob written by this create is new even when a later layer shares it
        self.status.setdefault(w.digest, "using existing layer" if w.existed else "creating new layer")
        self.layers.append(Layer(media_type(kind), w.digest, w.size))

    def replace(self, kind: str, data: bytes) -> None:
        self.remove(kind)
        self.add(kind, data)

    def events(self) -> Iterator[dict]:
        for x in self.layers:
            yield {"status": f"{self.status.get(x.digest, 'using existing layer')} {x.digest}"}


def _template(layers: _Layers, text: str) -> None:
    from kvserve.chat.go_template import GoTemplateError, OllamaTemplate

    layers.remove("template")
    try:
        OllamaTemplate(text)
    except GoTemplateError as e:
        raise InvalidInputError(f"template error: {e}") from None
    layers.add("template", text.encode("utf-8"))


def _licenses(value: Any) -> list[str]:
    """``license``: a string (one layer unless empty) or a list of strings (one layer each)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    if isinstance(value, list):
        bad = next(v for v in value if not isinstance(v, str))
        raise InvalidInputError(f"json: cannot unmarshal {_go_type(bad)} into Go value of type string")
    raise InvalidInputError(f"json: cannot unmarshal {_go_type(value)} into Go value of type []string")


def _params(layers: _Layers, parameters: Any) -> None:
    """Ollama's ``setParameters``: the request's parameters over every params layer of the base
    (keys it does not give are kept; a given ``stop`` replaces the base's list); one new
    params layer at the end whenever there are any parameters at all."""
    from kvserve.ollama.modelfile import params_layer

    if parameters is None:
        parameters = {}
    if not isinstance(parameters, dict):
        raise _unmarshal_error(parameters, "parameters", "map[string]interface {}")
    merged: dict[str, Any] = {}
    for x in layers.layers:
        if x.media_type != media_type("params"):
            continue
        try:
            existing = json.loads(layers.store.blob_path(x.digest).read_bytes())
        except (OSError, ValueError) as e:
            raise InvalidInputError(f"the base model's params layer {x.digest} cannot be read: {e}") from None
        if isinstance(existing, dict):
            merged = {**existing, **merged}
    try:
        data = params_layer(dict(parameters), merged)
    except (ValueError, TypeError, RecursionError) as e:  # NaN, nested too deep: Go's encoder refuses them too
        raise InvalidInputError(f"invalid parameters: {e}" if isinstance(e, ValueError) else
                                "invalid parameters: not JSON data") from None
    if data is not None:
        layers.replace("params", data)


def _messages(layers: _Layers, messages: Any) -> None:
    """Ollama's ``setMessages``: the base's messages stay unless the request gives some."""
    from kvserve.ollama.modelfile import messages_layer

    if not messages:
        return
    if not isinstance(messages, list):
        raise _unmarshal_error(messages, "messages", "[]api.Message")
    items = []
    for m in messages:
        if not isinstance(m, dict):
            raise InvalidInputError(f"json: cannot unmarshal {_go_type(m)} into Go struct field "
                                    "CreateRequest.messages of type api.Message")
        role, content = m.get("role", ""), m.get("content", "")
        if not isinstance(role, str) or not isinstance(content, str):
            raise InvalidInputError("json: cannot unmarshal into Go struct field Message.messages.role/content "
                                    "of type string")
        items.append({"role": role, "content": content})
    layers.replace("messages", messages_layer(items))


def _remote(body: dict, target, source: str) -> dict | None:
    """A remote model's config fields (``remote_host``, ``remote_model``, ``remote_dialect``,
    ``remote_key_env``) from the request, checked as ``--remote`` checks them; None when
    ``remote_host`` is not given."""
    host = _str(body, "remote_host")
    if not host:
        return None
    from kvserve.remote import RemoteSpec

    if not source or _DIGEST.fullmatch(source.strip()):
        raise InvalidInputError("a remote model needs 'from' to name the upstream's model")
    dialect = _str(body, "remote_dialect") or "ollama"  # Ollama's remote_host names an Ollama server
    key_env = _str(body, "remote_key_env") or None
    spec = RemoteSpec("remote", host, dialect, source, key_env)  # InvalidInputError: a bad URL, dialect, env name
    return {"remote_host": spec.base_url, "remote_model": source, "remote_dialect": dialect,
            "remote_key_env": key_env or ""}


def _config(store: Store, layers: list[Layer], base: dict, body: dict) -> bytes:
    """The config blob (Ollama's ConfigV2 as its create fills it)."""
    opt: dict[str, Any] = {k: base[k] for k in ("remote_host", "remote_model", "remote_dialect", "remote_key_env")
                           if base.get(k) and _str(body, "remote_host")}
    for key in ("renderer", "parser", "requires"):
        opt[key] = _str(body, key) or str(base.get(key) or "")
    caps = [c for c in base.get("capabilities") or [] if isinstance(c, str)]
    info = body.get("info")
    if info is not None and not isinstance(info, dict):
        raise _unmarshal_error(info, "info", "map[string]interface {}")
    info = info or {}
    if isinstance(info.get("capabilities"), list):
        caps += [c for c in info["capabilities"] if isinstance(c, str)]
    if caps:
        opt["capabilities"] = caps
    fields = {k: _info_str(info, k) for k in ("model_family", "base_name", "quantization_level", "parameter_size")}
    for k in ("context_length", "embedding_length"):
        if k in info:
            v = info[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise InvalidInputError(f'info field "{k}" must be a number')
            if v < 0 or v != int(v):
                raise InvalidInputError(f'info field "{k}" must be a non-negative integer')
            opt[k] = int(v)
    if fields["base_name"]:
        opt["base_name"] = fields["base_name"]
    family = fields["model_family"]
    families = [family] if family else []
    fmt, model_type, file_type = str(base.get("model_format") or ""), fields["parameter_size"], \
        fields["quantization_level"]
    for x in layers:
        if x.media_type != media_type("model"):
            continue
        g = json.loads(gguf_config(store.blob_path(x.digest)))
        fmt = fmt or g.get("model_format") or ""
        family = family or g.get("model_family") or ""
        model_type = model_type or g.get("model_type") or ""
        file_type = file_type or g.get("file_type") or ""
        families.append(g.get("model_family") or "")
    if not any(x.media_type == media_type("model") for x in layers):  # a base without a GGUF layer
        family = family or str(base.get("model_family") or "")
        families = families or [str(f) for f in base.get("model_families") or []]
        model_type = model_type or str(base.get("model_type") or "")
        file_type = file_type or str(base.get("file_type") or "")
    return config_json(fmt, family, families or None, model_type, file_type, **opt)


def _info_str(info: dict, key: str) -> str:
    v = info.get(key)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise InvalidInputError(f'info field "{key}" must be a string')
    return v


# ------------------------------------------------------------------------------ create


def iter_create(store: Store, body: dict, *, pull: Pull | None = None) -> Iterator[dict]:
    """Ollama's POST /api/create on ``store``: yields its progress objects, the last
    ``{"status": "success"}`` (see the module docstring for the fields and rules).

    Args:
        store: where the base model and the uploaded blobs are, and where the model is written.
        body: the request JSON (``stream`` is the caller's business and is ignored here).
        pull: called with the base model's name when ``from`` names a model the store lacks;
            its events are passed on (Ollama pulls the base). None: ``model 'x' not found``.

    Yields:
        ``{"status": ...}``: ``parsing GGUF`` (per file), the pull's events, ``using existing
        layer sha256:…`` / ``creating new layer sha256:…`` per layer, ``writing manifest``,
        ``success``.

    Raises:
        InvalidInputError, NotFoundError, NotSupportedError (module docstring), before the
        first event for a malformed request, later for what is found on the way. Nothing is
        written under the model's name unless it succeeds (new small blobs may stay).
    """
    if not isinstance(body, dict):
        raise InvalidInputError("the create request must be a JSON object")
    if _str(body, "modelfile") and not (body.get("from") or body.get("files")):
        body = _from_modelfile_text(body)
    _check_request(body)
    name = _str(body, "model") or _str(body, "name")
    try:
        target = store.find(name) or parse_name(name)
    except InvalidInputError:
        raise InvalidInputError("invalid model name") from None
    source, files = _str(body, "from"), _str_map(body, "files")
    old = store.get(target)

    base_config: dict = {}
    remote = _remote(body, target, source)
    if remote is not None:  # a remote model: no weights, the upstream's model named by ``from``
        base, base_config = [], remote
    elif source and _DIGEST.fullmatch(source.strip()):
        digest = _digest(source)
        if not _is_gguf(store, digest):
            if not store.has_blob(digest):
                raise NotFoundError(f'blob "{digest}" not found')
            raise InvalidInputError("supplied file was not in GGUF format")
        base = [store.layer_for_blob(digest, "model")]
        yield {"status": "parsing GGUF"}
        _header(store.blob_path(digest))
    elif source:
        base = []
        for item in _base_model(store, source, pull):
            if isinstance(item, dict):
                yield item
            else:
                base, base_config = item
    elif files is not None:
        base = []
        for item in _gguf_layers(store, files):
            if isinstance(item, dict):
                yield item
            else:
                base = item
    else:
        raise InvalidInputError("neither 'from' or 'files' was specified")

    adapters, converted = _str_map(body, "adapters"), set()
    if adapters:
        for item in _adapter_layers(store, adapters, base, converted):
            if isinstance(item, dict):
                yield item
            else:
                base = base + item
    layers = _Layers(store, base)
    layers.status.update({d: "creating new layer" for d in converted})
    template, system = _str(body, "template"), _str(body, "system")
    if template:
        _template(layers, template)
    if system:
        layers.replace("system", system.encode("utf-8"))
    for text in _licenses(body.get("license")):
        layers.add("license", text.encode("utf-8"))
    _params(layers, body.get("parameters"))
    _messages(layers, body.get("messages"))
    config = _config(store, layers.layers, base_config, body)

    yield from layers.events()
    yield {"status": "writing manifest"}
    store.create(target, layers.layers, config=config)
    if old is not None:  # Ollama's RemoveLayers: blobs only the replaced manifest used
        for digest in sorted(old.manifest.digests() - store.referenced_digests()):
            with contextlib.suppress(FileNotFoundError):
                store.blob_path(digest).unlink()
    yield {"status": "success"}


def request_file_names(paths: list[str]) -> dict[str, str]:
    """Ollama's ``createRequestFileNames``: path -> the name a create request gives it (the
    base name, or the path below the files' common directory when there are several)."""
    names = {p: os.path.basename(p) for p in paths}
    if len(paths) > 1:
        root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
        names = {p: posixpath.join(*Path(os.path.relpath(os.path.abspath(p), root)).parts) for p in paths}
    return names


def _weights_files(source) -> list[str]:
    """The GGUF files a FROM path stands for: the file, or the ``.gguf`` files of a directory
    (a safetensors directory is refused)."""
    if source.kind == "gguf":
        return [source.path]
    d = Path(source.path)
    refuse_other_formats(d)
    # safetensors before GGUF, as Ollama's client picks a directory's files
    if any(d.glob("*.safetensors")) or any(d.glob("pytorch_model*.bin")) or any(d.glob("consolidated*.pth")):
        raise NotSupportedError(SAFETENSORS_UNSUPPORTED)
    found = sorted(str(p) for p in d.glob("*.gguf"))
    if not found:
        raise InvalidInputError(f"no GGUF files found in {source.path}")
    return found


def _file_is_gguf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _check_local_ggufs(names: dict[str, str]) -> None:
    """Refuse FROM files that are not GGUF before any is put into the store, with the error
    :func:`iter_create` would give for them once stored (``unknown type`` when none looks like
    a GGUF, else ``supplied file was not in GGUF format``); safetensors names are left to it."""
    if any(n.endswith(".safetensors") for n in names.values()):
        return
    magic = {p: _file_is_gguf(p) for p in names}
    if all(magic.values()):
        return
    if not any(ok or names[p].endswith(".gguf") for p, ok in magic.items()):
        raise InvalidInputError("unknown type")
    raise InvalidInputError("supplied file was not in GGUF format")


def iter_create_modelfile(store: Store, name: str, modelfile: Any, base_dir: str | os.PathLike | None = None, *,
                          pull: Pull | None = None) -> Iterator[dict]:
    """``ollama create NAME -f Modelfile`` in this process: what Ollama's client does (parse,
    put the FROM files into the store: hard links where the file system allows, no copy), then
    :func:`iter_create`.

    Args:
        name: the new model's name.
        modelfile: a parsed :class:`~kvserve.ollama.modelfile.Modelfile`, or its text (str/bytes).
        base_dir: the Modelfile's directory (FROM paths are relative to it); default: the
            current directory.
        pull: as for :func:`iter_create`.

    Yields:
        ``gathering model components``, ``copying file sha256:… 100%`` per weights file, then
        :func:`iter_create`'s statuses.

    Raises:
        ModelfileError (an InvalidInputError) for a Modelfile that does not parse (with its line),
        NotSupportedError (DRAFT, safetensors weights), NotFoundError (a FROM or ADAPTER path that
        is not there), InvalidInputError ``invalid model name``, and what :func:`iter_create` raises.
    """
    from kvserve.ollama.modelfile import Modelfile, parse_modelfile

    try:
        parse_name(name)
    except InvalidInputError:
        raise InvalidInputError("invalid model name") from None
    yield {"status": "gathering model components"}
    mf = modelfile if isinstance(modelfile, Modelfile) else parse_modelfile(modelfile)
    mf.check_supported()
    req = mf.create_request(base_dir if base_dir is not None else os.getcwd())
    paths = [p for s in req.sources if s.kind in ("gguf", "directory") for p in _weights_files(s)]
    names = request_file_names(paths)
    _check_local_ggufs(names)
    files: dict[str, str] = {}
    for path in paths:
        w = store.import_file(path)
        yield {"status": f"copying file {w.digest} 100%"}
        files[names[path]] = w.digest
    adapters: dict[str, str] = {}
    for value in req.adapters[-1:]:  # Ollama's client: the last ADAPTER line's files
        if _DIGEST.fullmatch(value):
            adapters = {"adapter.gguf": _digest(value)}
            continue
        found = _adapter_files(value)
        for path, shown in request_file_names(found).items():
            w = store.import_file(path)
            yield {"status": f"copying file {w.digest} 100%"}
            adapters[shown] = w.digest
    yield from iter_create(store, req.to_json(model=name, files=files or None, adapters=adapters or None),
                           pull=pull)


def _adapter_files(path: str) -> list[str]:
    """The files an ADAPTER path stands for: the file (a LoRA GGUF), or a PEFT directory's
    ``adapter_config.json`` and ``*.safetensors`` (Ollama's ``filesForModel`` of an adapter)."""
    p = Path(path)
    if p.is_file():
        return [str(p)]
    found = sorted(str(x) for x in p.glob("*.safetensors"))
    if not found:
        if (p / "adapter_model.bin").is_file():
            raise InvalidInputError(f"ADAPTER {path}: adapter_model.bin (a pickle) is not read: save the adapter as "
                                    "safetensors (PEFT's save_pretrained(safe_serialization=True))")
        raise InvalidInputError(f"ADAPTER {path}: no .safetensors file and no GGUF: not a LoRA adapter")
    if not (p / "adapter_config.json").is_file():
        raise InvalidInputError(f"ADAPTER {path}: no adapter_config.json: not a PEFT adapter directory")
    return [str(p / "adapter_config.json"), *found]
