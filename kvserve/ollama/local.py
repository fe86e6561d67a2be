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

Create is :mod:`kvserve.ollama.create` (Ollama's ``server/create.go`` rules), the same executor
the /api face runs.

Errors are domain errors (:mod:`kvserve.errors`) with Ollama's texts: ``model 'x' not found``,
``model "x" not found`` (copy's source), ``invalid model name``, ``name "x" is invalid``,
``source "x" is invalid``, ``neither 'from' or 'files' was specified``, ``supplied file was not
in GGUF format``, ``template error: ...``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvserve.chat.go_template import go_quote
from kvserve.errors import InvalidInputError, NotFoundError
from kvserve.store import (
    Store,
    StoredModel,
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


def _task(path: Path | None) -> str:
    """``generate``, ``embed`` or ``score`` for a stored model's weights (``generate`` without them)."""
    from kvserve.serving.embed_runner import model_task

    return model_task(str(path)) if path is not None else "generate"


def capabilities_of(template: str, config: dict | None = None, task: str = "generate") -> list[str]:
    """Ollama's capabilities of a model: ``embedding`` alone for an embedding model (``task``
    ``embed``, or a reranker: ``score``, as the server answers), else ``completion``; ``tools`` when a
    tool-call parser fits the chat template; ``insert`` when the template uses ``.Suffix``;
    ``thinking`` when it writes or switches thinking blocks; then those the config lists
    (CAPABILITY lines), each once."""
    from kvserve.chat.tool_calls import detect_tool_parser

    if task != "generate":
        return ["embedding"]
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
        models += self._engine_models()
        return {"models": models}

    def _engine_models(self) -> list[dict]:
        """The store's ENGINE models (kvserve.supervisor.modelfile) as /api/tags entries: no files of
        kvserve's (size 0, no digest), modified when created; after the stored models, by name."""
        from kvserve.supervisor.modelfile import engine_files, engine_modified

        out = []
        for spec in engine_files(self.store.root):
            modified = engine_modified(self.store.root, spec.name) or 0.0
            out.append({"name": spec.name, "model": spec.name, "modified_at": go_time(modified), "size": 0,
                        "digest": "", "details": _details({})})
        return out

    def _show_engine(self, name: str) -> dict | None:
        """/api/show of the store's ENGINE model ``name``, else None: its Modelfile (FROM and the
        ENGINE line, key-like values ``***``), ``engine`` (that command line) and ``engine_model``
        (what ``{model}`` becomes)."""
        from kvserve.supervisor.modelfile import engine_modelfile, engine_modified, find_engine
        from kvserve.supervisor.spec import shown_command

        try:
            display = parse_name(name).display
        except InvalidInputError:
            return None
        spec = find_engine(self.store.root, display)
        if spec is None:
            return None
        return {"license": "", "modelfile": engine_modelfile(spec), "parameters": "", "template": "", "system": "",
                "details": _details({}), "model_info": {}, "capabilities": ["completion", "tools"],
                "modified_at": go_time(engine_modified(self.store.root, display) or 0.0),
                "engine": shown_command(spec.argv), "engine_model": spec.model or None}

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

        try:
            found = self.store.get(name)
        except InvalidInputError:
            found = None
        if found is None and (engine := self._show_engine(name)) is not None:
            return engine
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
            adapters=[str(store.blob_path(x.digest)) for x in m.layers_of("adapter")],
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
        resp["capabilities"] = capabilities_of(template, config, _task(stored.model_path))
        resp["modified_at"] = go_time(stored.modified)
        if config.get("remote_host"):  # a remote model (Modelfile REMOTE): its upstream, checked now
            _show_remote(resp, stored.display, config)
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


def iter_create(store: Store, body: dict) -> Iterator[dict]:
    """POST /api/create in-process: :func:`kvserve.ollama.create.iter_create` (the one create
    executor, shared with the /api face), without pulling a missing base model."""
    from kvserve.ollama.create import iter_create as create

    return create(store, body)


def _show_remote(resp: dict, name: str, config: dict) -> None:
    """A remote store model's ``show``: the upstream (Ollama's ``remote_model``, ``remote_host``),
    the start-up check run now (``remote_check``: ok, rejected key or no server; never the key),
    and its REMOTE line in the Modelfile."""
    from kvserve.errors import InvalidInputError
    from kvserve.remote import REMOTE_NOT_ALLOWED, RemoteSpec, check_remote, remote_host_allowed

    try:
        spec = RemoteSpec(name, str(config["remote_host"]), str(config.get("remote_dialect") or "ollama"),
                          str(config.get("remote_model") or ""), str(config.get("remote_key_env") or "") or None)
    except InvalidInputError as e:
        resp["remote_check"] = f"not usable: {e}"
        return
    resp["remote_model"], resp["remote_host"] = spec.upstream_model, spec.shown_url
    resp["remote_check"] = (check_remote(spec).message if remote_host_allowed(spec.base_url) else
                            f"not run: {REMOTE_NOT_ALLOWED} (its host is not in OLLAMA_REMOTES)")
    resp["capabilities"] = ["completion", "tools"]
    resp["model_info"] = {}
    lines = [f"FROM {spec.upstream_model}" if ln.startswith("FROM ") else ln
             for ln in resp.get("modelfile", "").splitlines()]
    remote = f"REMOTE {spec.shown_url} dialect={spec.dialect}" + (f" key={spec.key_env}" if spec.key_env else "")
    froms = [i for i, ln in enumerate(lines) if ln.startswith("FROM ")]
    at = froms[-1] + 1 if froms else len(lines)
    resp["modelfile"] = "\n".join([*lines[:at], remote, *lines[at:]]) + "\n"
