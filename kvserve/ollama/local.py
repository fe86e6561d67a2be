"""Ollama's model operations on a store, in-process: what the ``/api`` routes answer, without a server.

``kvserve list``, ``show``, ``rm``, ``cp`` and ``create`` use :class:`LocalApi` when no server
answers at ``KVSERVE_HOST`` (and :class:`kvserve.ollama.client.ServerApi`, with the same method
names and return shapes, when one does). Shapes are Ollama's ``api/types.go`` JSON, as the
/api face writes them:

- :meth:`LocalApi.tags` -> ``{"models": [{"name", "model", "modified_at", "size", "digest",
  "details"}, ...]}`` (GET /api/tags; most recently modified first);
- :meth:`LocalApi.ps` -> ``{"models": []}``: nothing is loaded without a server;
- :meth:`LocalApi.show` -> the /api/show object (``modelfile``, ``parameters``, ``template``,
  ``system``, ``license``, ``details``, ``model_info``, ``capabilities``, ``modified_at``,
  ``messages``; ``tensors`` with ``verbose``);
- :meth:`LocalApi.delete`, :meth:`LocalApi.copy`: DELETE /api/delete, POST /api/copy;
- :meth:`LocalApi.create` / :func:`iter_create`: POST /api/create in Ollama's JSON form, as a
  generator of its progress objects (``parsing GGUF``, ``using existing layer sha256:…``,
  ``creating new layer sha256:…``, ``writing manifest``, ``success``).

Create follows Ollama's ``server/create.go``: ``from`` (a stored model: its layers are reused,
so a derived model costs only its new small layers) or ``files`` (file name -> digest of a blob
already in the store: GGUF only); TEMPLATE (checked by the Go template parser), SYSTEM and the
params and messages layers replace the base's, licenses add to them, parameters merge over the
base's (a new ``stop`` replaces the old list); the config is derived from the weights' GGUF
header; the manifest is written last, then blobs only the old manifest of that name used are
removed. ``quantize``, ``adapters`` and draft files are refused (:class:`NotSupportedError`,
``... is not supported yet``).

Errors are domain errors (:mod:`kvserve.errors`) with Ollama's texts: ``model 'x' not found``,
``model "x" not found`` (copy's source), ``invalid model name``, ``name "x" is invalid``,
``source "x" is invalid``, ``neither 'from' or 'files' was specified``, ``supplied file was not
in GGUF format``, ``template error: ...``.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from kvserve.chat.go_template import go_quote
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

__all__ = ["LocalApi", "capabilities_of", "go_time", "iter_create"]


def go_time(seconds: float) -> str:
    """Seconds since the epoch as Go marshals a UTC ``time.Time`` (RFC 3339, up to 9 fraction
    digits without trailing zeros, ``Z``)."""
    ns = round(seconds * 1e9)
    sec, frac = divmod(ns, 1_000_000_000)
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
    digits = f"{frac:09d}".rstrip("0")
    return text + ("." + digits if digits else "") + "Z"


def capabilities_of(template: str, config: dict | None = None) -> list[str]:
    """Ollama's capabilities of a model: ``completion``; ``tools`` when a tool-call parser fits the
    chat template; ``insert`` when the template uses ``.Suffix``; ``thinking`` when it writes or
    switches thinking blocks; then those the config lists (CAPABILITY lines), each once."""
    from kvserve.chat.tool_calls import detect_tool_parser

    caps = ["completion"]
    if template and detect_tool_parser(template):
        caps.append("tools")
    if ".Suffix" in template:
        caps.append("insert")
    if "<think>" in template or "enable_thinking" in template:
        caps.append("thinking")
    for c in (config or {}).get("capabilities") or []:
        if isinstance(c, str) and c not in caps:
            caps.append(c)
    return caps


def _config(store: Store, stored: StoredModel) -> dict:
    cfg = stored.manifest.config
    if cfg is None:
        return {}
    try:
        data = json.loads(store.blob_path(cfg.digest).read_bytes())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _details(config: dict) -> dict:
    fams = config.get("model_families")
    return {"parent_model": "", "format": str(config.get("model_format") or ""),
            "family": str(config.get("model_family") or ""),
            "families": [str(f) for f in fams] if isinstance(fams, list) else None,
            "parameter_size": str(config.get("model_type") or ""),
            "quantization_level": str(config.get("file_type") or "")}


def _header(path: Path | None) -> tuple[dict, list]:
    if path is None:
        return {}, []
    from kvserve.loaders.gguf import read_gguf_header

    try:
        return read_gguf_header(str(path))
    except Exception:  # noqa: BLE001 - an unreadable header shows no model_info, as a broken blob would
        return {}, []


def _model_info(md: dict, tensors: list, verbose: bool) -> dict:
    """The GGUF header as /api/show's ``model_info``: without ``general.name`` and the chat
    template, arrays of more than 5 items empty unless ``verbose``, ``general.parameter_count``."""
    info: dict[str, Any] = {}
    for k, v in md.items():
        if k in ("general.name", "tokenizer.chat_template", "GGUF.version"):
            continue
        if hasattr(v, "tolist"):
            v = v.tolist()
        if isinstance(v, tuple):
            v = list(v)
        if isinstance(v, list) and len(v) > 5 and not verbose:
            v = []
        if isinstance(v, bytes):
            v = v.decode("utf-8", "replace")
        info[k] = v
    info.setdefault("general.parameter_count", sum(t.n_elements for t in tensors))
    return dict(sorted(info.items()))


def _tensor_type(t: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(t).name
    except (ImportError, ValueError):
        return str(t)


class LocalApi:
    """Ollama's model routes answered from ``store`` in this process (see the module docstring).

    Args:
        store: the model store (:func:`kvserve.store.open_store`).
    """

    def __init__(self, store: Store):
        self.store = store

    def __repr__(self) -> str:
        return f"LocalApi({self.store!r})"

    def tags(self) -> dict:
        """GET /api/tags: every stored model, most recently modified first."""
        models = []
        for m in self.store.list():
            models.append({"name": m.display, "model": m.display, "modified_at": go_time(m.modified),
                           "size": m.size, "digest": m.digest, "details": _details(_config(self.store, m))})
        return {"models": models}

    def ps(self) -> dict:
        """GET /api/ps: without a server nothing is loaded."""
        return {"models": []}

    def _stored(self, name: str) -> StoredModel:
        try:
            stored = self.store.get(name)
        except InvalidInputError:
            raise InvalidInputError("invalid model name") from None
        if stored is None:
            raise NotFoundError(f"model '{name}' not found")
        return stored

    def show(self, name: str, verbose: bool = False) -> dict:
        """POST /api/show for a stored model.

        The template is the TEMPLATE layer, else the GGUF's own chat template (what kvserve
        renders with when a model has no TEMPLATE); the ``modelfile`` writes a TEMPLATE line only
        for a TEMPLATE layer (a GGUF's Jinja template is not Go template text, and creating a
        model from that Modelfile must not fail). Raises NotFoundError ``model 'x' not found``,
        InvalidInputError ``invalid model name``.
        """
        from kvserve.ollama.modelfile import show_modelfile, show_parameters

        stored = self._stored(name)
        store, m = self.store, stored.manifest
        config = _config(store, stored)
        md, tensors = _header(stored.model_path)
        go_template = store.layer_text(m, "template")
        template = go_template if go_template is not None else str(md.get("tokenizer.chat_template") or "")
        system = store.layer_text(m, "system") or ""
        licenses = [store.blob_path(x.digest).read_text("utf-8", "replace") for x in m.layers_of("license")
                    if store.has_blob(x.digest)]
        params = store.params(m)
        messages = [{"role": str(x.get("role", "")), "content": str(x.get("content", ""))}
                    for x in store.messages(m) if isinstance(x, dict)]
        weights = m.layer("model")
        model_path = str(store.blob_path(weights.digest)) if weights is not None else ""
        resp: dict[str, Any] = {}
        if licenses:
            resp["license"] = "\n".join(licenses)
        resp["modelfile"] = show_modelfile(
            short_name=stored.display, model_path=model_path, template=go_template, system=system,
            renderer=str(config.get("renderer") or ""), parser=str(config.get("parser") or ""),
            parameters=params, licenses=licenses, messages=messages,
            capabilities=[c for c in config.get("capabilities") or [] if isinstance(c, str)])
        text = show_parameters(params)
        if text:
            resp["parameters"] = text
        if template:
            resp["template"] = template
        if system:
            resp["system"] = system
        resp["details"] = _details(config)
        if messages:
            resp["messages"] = messages
        for key in ("renderer", "parser", "requires"):
            if config.get(key):
                resp[key] = str(config[key])
        resp["model_info"] = _model_info(md, tensors, verbose)
        if verbose:
            resp["tensors"] = [{"name": t.name, "type": _tensor_type(t.ggml_type), "shape": list(t.shape)}
                               for t in tensors]
        resp["capabilities"] = capabilities_of(template, config)
        resp["modified_at"] = go_time(stored.modified)
        return resp

    def delete(self, name: str) -> None:
        """DELETE /api/delete: the manifest, then the blobs no other model uses.

        Raises InvalidInputError ``name "x" is invalid``, NotFoundError ``model 'x' not found``."""
        try:
            parse_name(name)
        except InvalidInputError:
            raise InvalidInputError(f"name {go_quote(name)} is invalid") from None
        if self.store.get(name) is None:
            raise NotFoundError(f"model '{name}' not found")
        self.store.delete(name)

    def copy(self, source: str, destination: str) -> None:
        """POST /api/copy: a second name for the same manifest (every blob shared).

        Raises InvalidInputError ``source "x" is invalid`` / ``destination "x" is invalid``,
        NotFoundError ``model "x" not found``."""
        for what, n in (("source", source), ("destination", destination)):
            try:
                parse_name(n)
            except InvalidInputError:
                raise InvalidInputError(f"{what} {go_quote(n)} is invalid") from None
        if self.store.get(source) is None:
            raise NotFoundError(f"model {go_quote(source)} not found")
        self.store.copy(source, destination)

    def has_blob(self, digest: str) -> bool:
        """HEAD /api/blobs/:digest."""
        return self.store.has_blob(digest)

    def upload_blob(self, path: str | Path, digest: str) -> None:
        """POST /api/blobs/:digest with a local file: hard-linked into the store when it can be
        (no copy), else copied; the digest is checked (``DigestMismatchError``)."""
        self.store.import_file(path, digest)

    def create(self, body: dict) -> Iterator[dict]:
        """POST /api/create: :func:`iter_create` on this store."""
        return iter_create(self.store, body)


# ---------------------------------------------------------------------------------- create

_HEX_DIGEST = re.compile(r"sha256[:-][0-9a-fA-F]{64}")


def _refuse_unsupported(body: dict) -> None:
    if body.get("quantize") or body.get("quantization"):
        raise NotSupportedError("quantize is not supported yet: kvserve serves a GGUF's weights as they are "
                                "(quantize it with llama.cpp's llama-quantize first)")
    if body.get("adapters"):
        raise NotSupportedError("ADAPTER is not supported yet: kvserve has no LoRA adapters")
    if body.get("draft_files") or body.get("draft_quantize"):
        raise NotSupportedError("DRAFT is not supported yet: kvserve has no speculative decoding")


def _from_model(store: Store, source: str) -> tuple[list[Layer], dict, Path | None]:
    """The layers of a stored base model (reused as they are), its config and weights file."""
    try:
        base = store.get(source)
    except InvalidInputError:
        raise InvalidInputError("invalid model name") from None
    if base is None:
        raise NotFoundError(f"model '{source}' not found")
    layers = [Layer(x.media_type, x.digest, x.size, base.display, x.name) for x in base.manifest.layers]
    for x in layers:
        if not store.has_blob(x.digest):
            raise NotFoundError(f'blob "{x.digest}" not found')
    return layers, _config(store, base), base.model_path


def _gguf_kind(path: Path) -> str:
    """``model``, ``projector`` or ``adapter`` from a GGUF's ``general.type`` (Ollama's checks)."""
    md, _ = _header(path)
    kind = str(md.get("general.type") or "")
    if kind == "adapter":
        return "adapter"
    if kind in ("projector", "mmproj"):
        return "projector"
    return "model"


def _from_files(store: Store, files: dict) -> Iterator[dict | tuple[list[Layer], Path | None]]:
    """Layers for ``files`` (name -> digest of a blob in the store); yields ``parsing GGUF``
    per file, then one tuple (layers, weights path)."""
    layers: list[Layer] = []
    weights = None
    for fname, digest in files.items():
        p = PurePosixPath(str(fname))
        if p.is_absolute() or ".." in p.parts or not str(fname):
            raise InvalidInputError("file path must be relative")
        if not isinstance(digest, str) or not _HEX_DIGEST.fullmatch(digest.strip()):
            raise InvalidInputError("invalid digest format")
        digest = normalize_digest(digest)
        if str(fname).endswith((".safetensors", ".bin", ".pth")):
            raise NotSupportedError("creating a model from safetensors or torch files is not supported yet: "
                                    "kvserve stores GGUF models (convert it with llama.cpp's convert_hf_to_gguf.py)")
        if str(fname).endswith((".json", ".model", ".txt", ".jinja")):
            continue  # tokenizer and config files beside weights: a GGUF carries its own
        yield {"status": "parsing GGUF"}
        path = store.blob_path(digest)
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
        except FileNotFoundError:
            raise NotFoundError(f'blob "{digest}" not found') from None
        if magic != b"GGUF":
            raise InvalidInputError("supplied file was not in GGUF format")
        kind = _gguf_kind(path)
        if kind == "adapter":
            raise NotSupportedError("ADAPTER is not supported yet: kvserve has no LoRA adapters")
        layers.append(store.layer_for_blob(digest, kind))
        if kind == "model" and weights is None:
            weights = path
    if not layers:
        raise InvalidInputError("no files provided to convert")
    yield layers, weights


def _replace(layers: list[Layer], kind: str, new: Layer | None) -> list[Layer]:
    kept = [x for x in layers if x.media_type != media_type(kind)]
    return kept + ([new] if new is not None else [])


def _new_layer(store: Store, data: bytes, kind: str, status: dict[str, str]) -> Layer:
    w = store.write_blob_bytes(data)
    status[w.digest] = "using existing layer" if w.existed else "creating new layer"
    return Layer(media_type(kind), w.digest, w.size)


def _base_params(store: Store, layers: list[Layer]) -> dict:
    merged: dict = {}
    for x in layers:
        if x.media_type == media_type("params"):
            with contextlib.suppress(OSError, ValueError):
                value = json.loads(store.blob_path(x.digest).read_bytes())
                if isinstance(value, dict):
                    merged = {**value, **merged}
    return merged


def _licenses(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise InvalidInputError(f"unknown license type: {type(value).__name__}")


def _config_for(weights: Path | None, base: dict, body: dict) -> bytes:
    """The new config blob: model fields from the weights' GGUF header, renderer, parser,
    requires and capabilities from the request, else from the base model's config."""
    d = json.loads(gguf_config(weights)) if weights is not None else json.loads(config_json("gguf"))
    optional = {k: d[k] for k in d if k not in ("model_format", "model_family", "model_families", "model_type",
                                                 "file_type")}
    for key in ("renderer", "parser", "requires"):
        value = body.get(key) or base.get(key)
        if value:
            optional[key] = str(value)
    info = body.get("info") if isinstance(body.get("info"), dict) else {}
    caps = [c for c in (info.get("capabilities") or []) if isinstance(c, str)]
    caps = caps or [c for c in base.get("capabilities") or [] if isinstance(c, str)]
    if caps:
        optional["capabilities"] = caps
    return config_json(d.get("model_format") or "gguf", d.get("model_family") or "", d.get("model_families"),
                       d.get("model_type") or "", d.get("file_type") or "", **optional)


def iter_create(store: Store, body: dict) -> Iterator[dict]:
    """Ollama's /api/create on ``store``: yields its progress objects, the last ``success``.

    Args:
        body: the request JSON: ``model`` (or ``name``), ``from`` (a stored model, or a blob digest
            ``sha256:<hex>``) or ``files`` (name -> digest; the blobs must be in the store: POST
            /api/blobs or :meth:`LocalApi.upload_blob` first), ``template``, ``system``,
            ``license`` (a string or a list), ``parameters`` (an object), ``messages``,
            ``renderer``, ``parser``, ``requires``, ``info.capabilities``.

    Raises (before or while yielding): InvalidInputError (``invalid model name``, ``neither
    'from' or 'files' was specified``, ``template error: ...``, ``supplied file was not in GGUF
    format``), NotFoundError (``model 'x' not found`` for ``from``), NotSupportedError (quantize,
    adapters, draft models, safetensors files).
    """
    from kvserve.ollama.modelfile import messages_layer, params_layer

    name = body.get("model") or body.get("name") or ""
    try:
        target = parse_name(str(name))
    except InvalidInputError:
        raise InvalidInputError("invalid model name") from None
    _refuse_unsupported(body)
    old = store.get(target)
    source, files = body.get("from") or "", body.get("files") or {}
    if isinstance(source, str) and _HEX_DIGEST.fullmatch(source.strip().lstrip("@")):
        files, source = {"model.gguf": source.strip().lstrip("@")}, ""
    status: dict[str, str] = {}
    if source:
        layers, base_config, weights = _from_model(store, str(source))
    elif files:
        if not isinstance(files, dict):
            raise InvalidInputError("files must be an object of file names and digests")
        base_config, result = {}, None
        for item in _from_files(store, files):
            if isinstance(item, dict):
                yield item
            else:
                result = item
        layers, weights = result
    else:
        raise InvalidInputError("neither 'from' or 'files' was specified")

    template = body.get("template")
    if template:
        from kvserve.chat.go_template import GoTemplateError, OllamaTemplate

        try:
            OllamaTemplate(str(template))
        except GoTemplateError as e:
            raise InvalidInputError(f"template error: {e}") from None
        layers = _replace(layers, "template", _new_layer(store, str(template).encode(), "template", status))
    if body.get("system"):
        layers = _replace(layers, "system", _new_layer(store, str(body["system"]).encode(), "system", status))
    for text in _licenses(body.get("license")):
        layers.append(_new_layer(store, text.encode(), "license", status))
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInputError("parameters must be an object")
    data = params_layer(params, _base_params(store, layers))
    if data is not None:
        layers = _replace(layers, "params", _new_layer(store, data, "params", status))
    messages = body.get("messages") or []
    if messages:
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InvalidInputError("messages must be a list of objects")
        data = messages_layer([{"role": str(m.get("role", "")), "content": str(m.get("content", ""))}
                               for m in messages])
        layers = _replace(layers, "messages", _new_layer(store, data, "messages", status))

    config = _config_for(weights, base_config, body)
    for x in layers:
        yield {"status": f"{status.get(x.digest, 'using existing layer')} {x.digest}"}
    yield {"status": "writing manifest"}
    store.create(target, layers, config=config)
    if old is not None:  # blobs only the replaced manifest used (Ollama's RemoveLayers)
        for digest in sorted(old.manifest.digests() - store.referenced_digests()):
            with contextlib.suppress(FileNotFoundError):
                store.blob_path(digest).unlink()
    yield {"status": "success"}
