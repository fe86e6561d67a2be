"""How a face finds the model a request names, and the model lists.

Every face resolves ``model`` (a body field, or ``?model=`` on GET routes) through the server
state's model manager (:meth:`kvserve.serving.state.ServerState.acquire`) and holds the
runner until its response is sent: :func:`serve_model` for handlers, which releases the hold
when the last byte of a stream went out (or the client left).

``GET /v1/models`` (and ``/models``) lists every servable model, loaded or not, in llama-server's
shape (Ollama-style ``models`` plus OpenAI ``data``) with vLLM's ``root`` and ``max_model_len``
and llama-server router mode's ``status``; ``GET /v1/models/{id}`` answers one model.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

from starlette.requests import Request as HttpRequest
from starlette.responses import Response, StreamingResponse

from kvserve.errors import NotFoundError
from kvserve.faces.api_error import ApiError
from kvserve.faces.params import check_text, type_error
from kvserve.faces.sse import ClientDisconnected
from kvserve.serving.manager import Lease, ModelSpec, parse_keep_alive
from kvserve.serving.chat_runner import Runner
from kvserve.serving.state import ServableModel, ServerState


def model_field(body: dict | None, key: str = "model") -> str | None:
    """The request's ``model`` (None when absent, null or empty).

    Raises:
        ApiError 400: not a string.
    """
    if not isinstance(body, dict):
        return None
    v = body.get(key)
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise type_error(key, "string", v)
    check_text(v, key)
    return v


def keep_alive_field(body: dict | None) -> float | None:
    """The request's ``keep_alive`` in seconds (Ollama's forms), None when absent.

    Raises:
        InvalidInputError: a value :func:`~kvserve.serving.manager.parse_keep_alive` refuses.
    """
    if not isinstance(body, dict) or body.get("keep_alive") is None:
        return None
    return parse_keep_alive(body["keep_alive"])


async def serves_embeddings(state: ServerState, name: str | None) -> bool:
    """Whether the model ``name`` means answers embedding routes: an encoder always, a
    generative model only with ``--embeddings`` (read from the model's header, nothing loads).

    Raises:
        NotFoundError / UnavailableError / InvalidInputError: as ``ServerState.resolve``.
    """
    from kvserve.serving.embed_runner import cached_task, model_task

    spec = state.resolve(name)
    if state.args.embeddings:
        return True
    task = cached_task(spec.path) or await asyncio.to_thread(model_task, spec.path)
    return task != "generate"


class LeasedResponse(Response):
    """A response that holds a model until it is sent: streams keep the runner busy (never
    evicted, keep_alive not running) until their last byte, or until the client leaves."""

    def __init__(self, inner: Response, lease: Lease):
        self.inner = inner
        self.lease = lease
        self.status_code = inner.status_code
        self.background = None
        self.raw_headers = inner.raw_headers

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            self.lease.release()


async def acquire_model(state: ServerState, model: str | ModelSpec | None, keep_alive: float | None,
                        http: HttpRequest | None = None, poll_s: float = 0.25) -> Lease:
    """Hold the runner of ``model`` (a request's name, or a resolved spec) for one request
    (:meth:`ServerState.acquire`, loading it if needed): the one way a face takes a lease. With
    ``http``, a client that leaves while its model loads or while it waits for room stops waiting
    (its place in the queue is freed; a shared load goes on for the others).

    Raises:
        whatever resolving or loading raises; ClientDisconnected when the client left while waiting.
    """
    if http is None:
        return await state.acquire(model, keep_alive)
    return await watch_acquire(http, state.acquire(model, keep_alive), poll_s)


async def serve_model(state: ServerState, name: str | ModelSpec | None, keep_alive: float | None,
                      handler: Callable[[Runner], Awaitable[Response]], http: HttpRequest | None = None) -> Response:
    """Acquire the runner of ``name`` (:func:`acquire_model`), run ``handler(runner)``, and release
    it when the response is done: at once for a plain response, after the last byte for a stream.

    Raises:
        whatever resolving, loading or the handler raises (the hold is released first);
        ClientDisconnected when the client left while waiting.
    """
    lease = await acquire_model(state, name, keep_alive, http)
    try:
        response = await handler(lease.runner)
    except BaseException:
        lease.release()
        raise
    if isinstance(response, StreamingResponse):
        return LeasedResponse(response, lease)
    lease.release()
    return response


async def serve_loaded(state: ServerState, name: str | None,
                       handler: Callable[[Runner], Awaitable[Response]]) -> Response:
    """Run ``handler(runner)`` on the runner of ``name`` only when it is loaded already
    (:meth:`ServerState.hold_loaded`): never loads, unloads or wakes a model, takes no place in the
    manager's queue, and leaves the runner's keep_alive and expiry as they were (the render
    endpoints that ``vllm-router`` calls on every replica for every request; a body's
    ``keep_alive`` is not read). ``handler`` must answer a plain (non-streaming) response.

    Raises:
        NotFoundError: an unknown name (``model 'x' not found``).
        UnavailableError 503: ``Loading model`` while it loads; ``model 'x' is not loaded`` when
            it is not loaded (also a ``-m`` model asleep by ``--sleep-idle-seconds``).
        whatever the handler raises (the hold is released first).
    """
    lease = state.hold_loaded(name)
    try:
        return await handler(lease.runner)
    finally:
        lease.release()


async def watch_acquire(http: HttpRequest, acquiring: Awaitable[Lease], poll_s: float = 0.25) -> Lease:
    """Await a lease, giving up (ClientDisconnected) when the client disconnects meanwhile. A
    lease that arrives while the disconnect is being noticed is released, never dropped (it would
    pin the model)."""
    task = asyncio.ensure_future(acquiring)

    def drop_late_lease(t: asyncio.Task) -> None:
        if not t.cancelled() and t.exception() is None:
            t.result().release()

    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await http.is_disconnected():
                raise ClientDisconnected("client disconnected")
    except BaseException:
        if task.done():
            drop_late_lease(task)
        else:
            task.cancel()
            task.add_done_callback(drop_late_lease)
        raise


# -- model lists ------------------------------------------------------------------------

def _status(m: ServableModel) -> str:
    if m.remote is not None:  # a remote model (kvserve.remote): its upstream's latest state
        return "loaded" if m.runner is not None and m.available else "unavailable" if m.runner is not None \
            else "loading"
    return "loaded" if m.runner is not None else "loading" if m.loading else "unloaded"


def _remote_fields(m: ServableModel) -> dict:
    """A remote model's ``remote`` member: its upstream (base URL without user info, dialect,
    upstream model name), ``available`` and the latest check's message (never the key)."""
    r = m.remote
    check = getattr(m.runner, "last_check", None)
    return {"url": r.shown_url, "dialect": r.dialect, "model": r.upstream_model, "available": m.available,
            "check": check.message if check is not None else None}


def _max_model_len(state: ServerState, m: ServableModel) -> int | None:
    if m.remote is not None or getattr(getattr(m.runner, "engine", None), "remote", False):
        return None  # the upstream's
    if m.runner is not None and m.runner.engine is not None:
        return m.runner.engine.n_ctx_slot
    try:
        from kvserve.serving.manager import ModelSpec
        from kvserve.serving.chat_runner import engine_config, model_shape

        cfg_m, _, _ = model_shape(m.path)
        return engine_config(state.args, ModelSpec(m.name, m.path)).n_ctx_slot(cfg_m.n_ctx_train)
    except Exception:  # noqa: BLE001 - a broken file still lists; loading it says what is wrong
        return None


def _permission(created: int) -> list[dict]:
    """vLLM's ``ModelCard.permission``: one ``model_permission`` object with its defaults."""
    return [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
             "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
             "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
             "organization": "*", "group": None, "is_blocking": False}]


def shown_path(args, path: str | None, name: str) -> str | None:
    """A model's file as ``/props`` (``model_path``) and ``/v1/models`` (``root``) show it (issue 31):
    the path itself under ``--api-key`` (every caller of those routes then holds a key) or when the
    model was named by a path outside the store; a file inside the store (``.../models/blobs/
    sha256-...``: the server's home directory) is shown to a server without a key as the model's
    ``name`` only."""
    if not path or getattr(args, "api_keys", None):
        return path
    from pathlib import Path

    from kvserve.store import open_store

    try:
        root = open_store(getattr(args, "models_dir", None)).root.resolve()
        inside = Path(path).resolve().is_relative_to(root)
    except (OSError, ValueError):
        inside = True  # unsure: say less
    return name if inside else path


def model_entry(state: ServerState, m: ServableModel, created: int) -> dict:
    """One ``data`` item: OpenAI's fields, vLLM's ``root`` (the model's file or directory),
    ``parent`` (null: no adapters), ``max_model_len`` (one sequence's context, tokens) and
    ``permission``, llama-server's ``aliases``/``tags`` (``--tags``)/``meta`` (when loaded) and router
    mode's ``status``."""
    # --tags: llama-server's model_tags, a std::set (sorted, each once), on every model served
    d = {"id": m.name, "aliases": list(m.aliases), "tags": sorted(set(getattr(state.args, "tags", ()) or ())),
         "object": "model", "created": created,
         "owned_by": "llamacpp", "root": shown_path(state.args, m.path, m.name), "parent": None,
         "max_model_len": _max_model_len(state, m),
         "permission": _permission(created), "status": {"value": _status(m)}}
    r = m.runner
    if m.remote is not None:
        d["owned_by"], d["root"] = "remote", m.remote.upstream_model
        d["remote"] = _remote_fields(m)
    elif r is not None and r.engine is not None and r.engine.model_info is not None:
        info = r.engine.model_info
        d["meta"] = {"vocab_type": info.vocab_type, "n_vocab": info.n_vocab, "n_ctx": r.engine.n_ctx_slot,
                     "n_ctx_train": info.n_ctx_train, "n_embd": info.n_embd, "n_params": info.n_params,
                     "size": info.size, "ftype": info.ftype}
    return d


def _capabilities(m: ServableModel) -> list[str]:
    """``["embedding"]`` for an encoder (loaded, or known from its file's header: read once per
    file, then remembered), else ``["completion"]``. Reads files: call off the event loop."""
    if m.remote is not None:
        return ["completion", "tools"]
    task = getattr(m.runner, "task", None) if m.runner is not None else None
    if task is None and m.path:
        from kvserve.serving.embed_runner import model_task

        task = model_task(m.path)
    return ["embedding"] if task in ("embed", "score") else ["completion"]


def _ollama_entry(m: ServableModel) -> dict:
    r = m.runner
    info = r.engine.model_info if r is not None and r.engine is not None else None
    if m.remote is not None:
        return {"name": m.name, "model": m.name, "modified_at": "", "size": 0, "digest": "", "type": "model",
                "description": "", "tags": [""], "capabilities": _capabilities(m), "parameters": "",
                "status": {"value": _status(m)}, "remote_model": m.remote.upstream_model,
                "remote_host": m.remote.shown_url,
                "details": {"parent_model": "", "format": "", "family": "", "families": [""], "parameter_size": "",
                            "quantization_level": ""}}
    return {
        "name": m.name, "model": m.name, "modified_at": "", "size": m.size if info is None else info.size,
        "digest": "", "type": "model", "description": "", "tags": [""], "capabilities": _capabilities(m),
        "parameters": "",
        "details": {"parent_model": "", "format": info.format if info else "", "family": "", "families": [""],
                    "parameter_size": "", "quantization_level": (info.quantization_level or "") if info else ""},
    }


def models_json(state: ServerState) -> dict:
    """GET /v1/models and /models: every servable model, loaded or not (reads the store and
    model headers: call it off the event loop)."""
    state.require_up()
    created = int(time.time())
    cat = state.catalog()
    return {"models": [_ollama_entry(m) for m in cat], "object": "list",
            "data": [model_entry(state, m, created) for m in cat]}


def model_json(state: ServerState, model_id: str) -> dict:
    """GET /v1/models/{id}: the model a request naming ``model_id`` gets (the same resolution:
    store names with or without ``:latest``, aliases; with ``-m`` the pinned model), 404
    ``model 'x' not found`` otherwise."""
    spec = state.resolve(model_id)
    for m in state.catalog():
        if m.name == spec.name:
            return model_entry(state, m, int(time.time()))
    raise NotFoundError(f"model '{model_id[:256]}' not found")


__all__ = ["ApiError", "LeasedResponse", "acquire_model", "keep_alive_field", "model_entry", "model_field", "model_json",
           "models_json", "serve_loaded", "serve_model", "serves_embeddings"]
