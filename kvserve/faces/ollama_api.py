"""Ollama's face: the ``/api/*`` routes, NDJSON streams and Ollama's JSON shapes (seed 004,
Examples 1-5; Ollama's ``server/routes.go`` and ``api/types.go`` are the reference).

Routes: ``POST /api/generate``, ``/api/chat``, ``/api/show``, ``/api/copy``, ``/api/embed``,
``/api/embeddings``, ``/api/pull``, ``/api/push``, ``/api/create``, ``HEAD|POST
/api/blobs/{digest}``, ``DELETE /api/delete``, ``GET|HEAD /api/tags``, ``GET /api/ps``,
``GET|HEAD /api/version``; ``GET /`` (``Ollama is running``) is in :mod:`kvserve.faces.webui`.
Responses are the wire types of :mod:`kvserve.faces.ollama_types`, written as Go's
``encoding/json`` writes them (``<``, ``>``, ``&`` escaped, UTF-8).

Streams: ``stream`` defaults to **true**. A stream is NDJSON (``application/x-ndjson``): one
object per line, one per piece of text, then a final object with ``done: true``. With
``"stream": false`` one JSON object holds the whole answer. Every final object carries
``done_reason`` (``stop``, ``length``, ``load``, ``unload``) and the six metrics, durations in
nanoseconds: ``total_duration`` (request received to final object), ``load_duration`` (waiting
for and loading the model), ``prompt_eval_count`` / ``prompt_eval_duration`` (prefill),
``eval_count`` / ``eval_duration`` (generated tokens). Prompt caching works as on the other
faces; ``prompt_eval_count`` counts the prompt tokens actually evaluated, as Ollama's
llama-server children report it (``timings.prompt_n``): tokens reused from the prefix cache
are not in it, so a repeated prompt shows a small count (at least 1). ``created_at`` is UTC,
RFC 3339 with nanoseconds. The ``model`` a response shows is the name the request gave.

Errors: ``{"error": "..."}`` with Ollama's status and text: 400 ``missing request body``,
``model is required``; 404 ``model 'x' not found``; 400 for bad fields (``option "top_k" must
be of type integer``); 503 when the server cannot take the request now; 500 otherwise. An
error after a stream started is one last NDJSON line ``{"error": "..."}``.

Loading without generating (ChatHandler/GenerateHandler): an empty ``messages`` (``prompt``)
loads the model and answers ``done_reason: "load"``; with ``keep_alive: 0`` it unloads it
instead (``"unload"``, nothing is loaded for it). Before loading, a model that does not generate
text (an embedding model) is 400 ``"x" does not support chat`` / ``"x" does not support
generate``, as Ollama checks the model's capabilities first. ``keep_alive`` takes Ollama's forms
(:func:`kvserve.serving.manager.parse_keep_alive`).

Options (``options`` of the request over the model's ``params`` layer over Ollama's
``api.DefaultOptions``): see :data:`DEFAULT_OPTIONS` and :func:`ollama_options`. ``num_ctx``
is the context of one sequence, as in Ollama: a runner loaded with another one is reloaded
(``ModelSpec(n_ctx=num_ctx x slots)``) once idle; without ``num_ctx`` the server's ``-c``
applies. ``use_mmap`` picks how the weights of a model the request loads are held, as Ollama's
runner option: false reads them into memory, true keeps the file's mapping (``--no-mmap`` /
``--mmap`` for that model; without it, the server's mode); a runner loaded with another mode is
reloaded once idle, and one loaded in the server's mode is kept where that mode is the one asked
for (Ollama's ``needsReload``). Options Ollama knows but kvserve has no use for (``num_batch``,
``num_gpu``, ``num_thread``, ``main_gpu``, ``draft_num_predict``, ``num_keep``: kvserve does
no context shift) are accepted; unknown ones are ignored with a warning in the log
(``invalid option provided``), as Ollama does. Sampling is otherwise llama.cpp's chain.
``num_predict`` -1 or -2 (unlimited, Ollama's default) stops when the sequence's context is full,
as Ollama stops at ``num_ctx``; when neither ``num_ctx`` nor the server's ``-c`` (or
``OLLAMA_CONTEXT_LENGTH``) sets that context, so that it is the model's own (8192 tokens for
SmolLM2, 128k for many models), it stops after :data:`UNLIMITED_N_PREDICT` tokens, Ollama's default
context length, with ``done_reason: "length"``: a model that loops does not run for many minutes.
The model file's own sampling defaults (``generation_config.json``, GGUF ``general.sampling.*``:
:func:`kvserve.serving.generation_config.ollama_layer`) sit under the params layer (kvserve's).

Chat (``/api/chat``): the model's MESSAGE layer and SYSTEM (unless the request starts with a
system message) come first, as in Ollama; messages carry ``content``, ``thinking``,
``tool_calls`` (arguments as objects), ``tool_name``; ``images`` are refused (400 ``vision is
not supported``). ``tools`` are rendered by the model's chat template and calls are parsed
from its output (the parser detected from the template, as llama-server does, or
``--tool-call-parser``); they come back as ``message.tool_calls`` with ``arguments`` objects.
A forced call: a final assistant message whose content is the opening of a call in the
template's format (``<tool_call>\\n`` for hermes-style templates) is continued under a grammar
that only allows a valid call of one of ``tools`` (``tool_choice`` ``required``). A chat becomes
kvserve's :class:`~kvserve.serving.chat_request.ChatRequest` (:func:`_chat_request`: the options
as sampling fields, a ``num_predict`` that is a default as ``n_predict_is_default``), planned by
:func:`kvserve.serving.chat_plan.plan_chat`. ``format`` is ``"json"`` or a JSON schema (the output
is constrained to it).
``think``: for a model whose template thinks, default on, the thinking goes to
``message.thinking``; ``false`` turns it off (``enable_thinking``); ``true`` for a model that
does not think is 400 ``"x" does not support thinking``.

Generate (``/api/generate``): ``prompt`` with ``system`` (else the model's SYSTEM) rendered by
the chat template, or with ``raw`` as it is; ``template`` renders with a Go template
(:mod:`kvserve.chat.go_template`, Ollama's TEMPLATE language); ``context`` (deprecated in
Ollama, still accepted) prepends token ids, and the final object returns ``context`` (prompt
and response ids) unless ``raw``. ``suffix`` needs a template with ``.Suffix`` (400 ``"x" does
not support insert`` otherwise). ``images``: 400 ``vision is not supported``.

Embeddings (``/api/embed``, the older ``/api/embeddings``): an embedding model (or any model
with ``--embeddings``) answers; a generative model is 400 ``this model does not support
embeddings`` (after resolving the model: 404 for an unknown one) before anything loads.
``/api/embed`` takes ``input`` (a string or a list of strings), ``truncate`` (default true),
``dimensions``, ``options`` (``num_ctx`` lowers the context) and ``keep_alive``, and answers
L2-normalized ``embeddings`` with ``total_duration``, ``load_duration`` and
``prompt_eval_count``; ``/api/embeddings`` takes ``prompt`` and answers ``embedding`` as the
model gives it. No input loads the model (``embeddings: []``, ``embedding: []``).

Create (``/api/create``): :func:`kvserve.ollama.create.iter_create` on the server's store (from a
stored model, pulled first when missing, as Ollama does; from GGUF blobs uploaded with POST
/api/blobs; TEMPLATE, SYSTEM, parameters, messages, licenses), its statuses streamed as NDJSON
(``parsing GGUF``, ``using existing layer sha256:…``, ``creating new layer sha256:…``, ``writing
manifest``, ``success``). A runner loaded under the created name is unloaded (once idle), so the
next request renders with the new TEMPLATE and SYSTEM. ``/api/pull`` and ``/api/push`` stream
:mod:`kvserve.store.registry_client`'s progress events (``pulling manifest``, ``pulling <12 hex>`` with
``total``/``completed``, ``verifying sha256 digest``, ``writing manifest``, ``success``); a failure
is 500 ``{"error": ...}`` as in Ollama (400 for an invalid name).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import math
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request as HttpRequest
from starlette.responses import Response, StreamingResponse

from kvserve.engine.request import SEED_RANDOM, RequestOutput
from kvserve.errors import InvalidInputError, KvserveError, NotFoundError
from kvserve.faces.auth import caller
from kvserve.faces.chat_features import parse_tools
from kvserve.faces.api_error import INTERNAL_ERROR, ApiError
from kvserve.faces.limits import batch_cap, check_count, check_input_bytes, input_bytes_cap
from kvserve.faces.http import OLLAMA_EMPTY_BODY, OLLAMA_NOT_AN_OBJECT, dumps_json, read_json
from kvserve.faces.models import LeasedResponse, acquire_model, serves_embeddings
from kvserve.faces.ollama_types import (
    ChatResponse,
    ErrorResponse,
    GenerateResponse,
    ListModel,
    ListResponse,
    Message,
    ModelDetails,
    ProcessModel,
    ProcessResponse,
    ShowResponse,
    ToolCall,
    ToolCallFunction,
    VersionResponse,
)
from kvserve.faces.params import sampling_fields, slot_view, stop_strings
from kvserve.faces import route_table
from kvserve.faces.route_table import Route
from kvserve.faces.sse import ClientDisconnected, until_disconnect
from kvserve.serving.chat_output import Piece, ReasoningPiece, TextPiece, ToolCallPiece
from kvserve.serving.chat_plan import plan_chat, render_prompt
from kvserve.serving.chat_request import ChatRequest, ReasoningOptions, TemplateOptions
from kvserve.serving.choices import chat_events
from kvserve.serving.completion_plan import plan_completion
from kvserve.serving.ids import new_id
from kvserve.serving.completion_request import CompletionRequest, Prompt
from kvserve.serving.generation_config import ollama_layer
from kvserve.serving.manager import Lease, ModelSpec, parse_keep_alive
from kvserve.serving.chat_runner import Runner
from kvserve.serving.state import ServerState

__all__ = ["DEFAULT_OPTIONS", "OLLAMA_VERSION", "build_router", "go_time", "ollama_options"]

log = logging.getLogger("kvserve.server")

#: The Ollama release whose API this face follows (the seed's reference, v0.35.1): what
#: ``/api/version`` answers, so clients that gate features on the server's version enable them.
OLLAMA_VERSION = "0.35.1"
NDJSON = "application/x-ndjson"
JSON_TYPE = "application/json; charset=utf-8"
_FOREVER_NS = 2**63 - 1  # Go's maximal time.Duration: "forever" keep_alive shows ~292 years ahead

#: Ollama's ``api.DefaultOptions`` for the options kvserve applies (``repeat_penalty`` 1.0 and
#: ``min_p`` 0.0 (unset) as in Ollama's source at commit fb30760, Aug 2026, ``api/types.go``, and its
#: Modelfile docs; ``num_ctx`` comes from the server's ``-c`` instead of Ollama's VRAM tiers).
DEFAULT_OPTIONS: dict[str, Any] = {
    "num_keep": 4, "seed": -1, "num_predict": -1, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "typical_p": 1.0,
    "repeat_last_n": 64, "temperature": 0.8, "repeat_penalty": 1.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "stop": [],
}

#: where an unlimited ``num_predict`` stops when the context is the model's own (tokens): Ollama's
#: default context length (``envconfig.ContextLength``), where Ollama itself would stop
UNLIMITED_N_PREDICT = 4096

# Ollama's api.Options fields by JSON type (its FromMap checks these types)
_INT_OPTIONS = ("num_keep", "seed", "num_predict", "top_k", "repeat_last_n", "num_ctx", "num_batch", "num_gpu",
                "main_gpu", "num_thread", "draft_num_predict")
_FLOAT_OPTIONS = ("top_p", "min_p", "typical_p", "temperature", "repeat_penalty", "presence_penalty",
                  "frequency_penalty")
_BOOL_OPTIONS = ("use_mmap",)
_LIST_OPTIONS = ("stop",)
# api.Options -> the SamplingParams field (same meaning; sampling_fields reads these names too)
_SAMPLING_FIELDS = {"top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "typical_p": "typical_p",
                    "repeat_last_n": "repeat_last_n", "temperature": "temperature", "repeat_penalty": "repeat_penalty",
                    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                    "seed": "seed", "stop": "stop", "num_predict": "n_predict"}


# ------------------------------------------------------------------------ small helpers


def go_time(ns: int | None = None) -> str:
    """``ns`` (nanoseconds since the epoch, default now) as Go marshals a UTC ``time.Time``:
    RFC 3339 with up to 9 fraction digits, trailing zeros (and a bare dot) dropped, ``Z``."""
    if ns is None:
        ns = time.time_ns()
    sec, frac = divmod(ns, 1_000_000_000)
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
    digits = f"{frac:09d}".rstrip("0")
    return text + ("." + digits if digits else "") + "Z"


def _go_json(obj: Any) -> bytes:
    """JSON as Go's ``json.Marshal`` writes it (compact, UTF-8, ``<>&`` escaped), no newline."""
    from kvserve.store import go_json

    return go_json(obj)[:-1]


def _json(obj: Any, status: int = 200) -> Response:
    return Response(_go_json(obj), status_code=status, media_type=JSON_TYPE)


def _error(status: int, message: str) -> Response:
    return _json(ErrorResponse(error=message).wire(), status)


def _status_message(e: BaseException) -> tuple[int, str]:
    """Ollama's (status, text) for an exception; server faults are logged with their traceback."""
    if isinstance(e, (ApiError, KvserveError)):
        err = ApiError.from_exception(e)
        if err.status >= 500 and not isinstance(e, ApiError):
            log.error("request failed: %s", err.message)
        return err.status, err.message
    log.exception("request failed", exc_info=e)
    return 500, INTERNAL_ERROR


def _error_of(e: BaseException) -> Response:
    if isinstance(e, ClientDisconnected):
        return Response(status_code=499)
    return _error(*_status_message(e))


async def _body(http: HttpRequest) -> dict:
    """The JSON object of the request (:func:`kvserve.faces.http.read_json`) with Ollama's texts:
    400 ``missing request body`` when there is none."""
    return await read_json(http, empty=OLLAMA_EMPTY_BODY, not_object=OLLAMA_NOT_AN_OBJECT)


def _string(body: dict, key: str) -> str:
    v = body.get(key)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise ApiError(400, f"json: cannot unmarshal {_go_type(v)} into Go struct field .{key} of type string")
    return v


def _go_type(v: Any) -> str:
    return {bool: "bool", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(v), "value")


def _flag(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"json: cannot unmarshal {_go_type(v)} into Go struct field .{key} of type bool")
    return v


def _model_name(body: dict, *keys: str) -> str:
    """The request's model name (``model``, else the deprecated ``name``): 400 ``model is required``."""
    for k in keys or ("model",):
        v = _string(body, k)
        if v:
            return v
    raise ApiError(400, "model is required")


def _store(state: ServerState):
    from kvserve.store import open_store

    return open_store(state.args.models_dir)


# ------------------------------------------------------------------------ options


@dataclass
class OllamaOptions:
    """A request's options merged over the model's params layer and Ollama's defaults.

    Attributes:
        sampling: the fields for the chat/completion plan (``temperature``, ``n_predict``...).
        num_ctx: tokens of context per sequence, None when neither the request nor the
            model sets it (the server's ``-c`` applies).
        use_mmap: Ollama's ``use_mmap`` (True: the file's mapping, False: read into memory),
            None when neither the request nor the model sets it (the server's mode).
    """

    sampling: dict[str, Any]
    num_ctx: int | None = None
    use_mmap: bool | None = None

    @staticmethod
    def sampling_given(request_options: dict) -> dict[str, Any]:
        """The sampling options a request's ``options`` set itself (checked, by Ollama's names;
        nulls and unknown keys left out): what a remote model forwards."""
        return {k: _check_option(k, v) for k, v in request_options.items()
                if k in _SAMPLING_FIELDS and v is not None}


def _check_option(key: str, v: Any) -> Any:
    """Ollama's ``Options.FromMap`` type checks (its error texts), returning the value."""
    if key in _INT_OPTIONS:  # Go's int is 64 bits: a larger number does not decode into it
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)) \
                or not -(2 ** 63) <= v < 2 ** 63:
            raise ApiError(400, f'option "{key}" must be of type integer')
        return int(v)
    if key in _FLOAT_OPTIONS:  # an integer beyond float range is no float32 either
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, int) and abs(v) > 2 ** 128) \
                or not math.isfinite(float(v)):
            raise ApiError(400, f'option "{key}" must be of type float32')
        return float(v)
    if key in _BOOL_OPTIONS:
        if not isinstance(v, bool):
            raise ApiError(400, f'option "{key}" must be of type boolean')
        return v
    if key in _LIST_OPTIONS:
        if isinstance(v, str):  # a Modelfile's single PARAMETER stop may be stored as a string
            return [v]
        if not isinstance(v, list):
            raise ApiError(400, f'option "{key}" must be of type array')
        if not all(isinstance(s, str) for s in v):
            raise ApiError(400, f'option "{key}" must be of an array of strings')
        return list(v)
    return v


def ollama_options(model_params: dict | None, request_options: Any) -> OllamaOptions:
    """Ollama's option layering: :data:`DEFAULT_OPTIONS`, then the model's params layer, then the
    request's ``options`` (null values are skipped, as Ollama's FromMap does).

    Mapping onto the sampler: ``num_predict`` -> n_predict (-1, and Ollama's -2 "fill the
    context", generate until the context is full); ``seed`` -1 -> a random seed; the other
    sampling options keep their names (llama.cpp's). Unknown keys are logged and ignored.

    Raises:
        ApiError: 400 for an ``options`` that is not an object or a value of the wrong type.
    """
    if request_options is not None and not isinstance(request_options, dict):
        raise ApiError(400, "json: cannot unmarshal into Go struct field .options of type map[string]interface {}")
    merged: dict[str, Any] = dict(DEFAULT_OPTIONS)
    num_ctx: int | None = None
    for layer in (model_params or {}, request_options or {}):
        for key, v in layer.items():
            if v is None:
                continue
            if key not in _INT_OPTIONS + _FLOAT_OPTIONS + _BOOL_OPTIONS + _LIST_OPTIONS:
                log.warning('invalid option provided: option "%s" is ignored', key, extra={"func": "ollama"})
                continue
            v = _check_option(key, v)
            if key == "num_ctx":
                num_ctx = v if v > 0 else None
            merged[key] = v
    sampling = {_SAMPLING_FIELDS[k]: merged[k] for k in _SAMPLING_FIELDS}
    sampling["n_predict"] = max(sampling["n_predict"], -1)
    return OllamaOptions(sampling, num_ctx, merged.get("use_mmap"))


# ------------------------------------------------------------------------ the model's layers


@dataclass
class ModelLayers:
    """What a store model adds to a request: its params, SYSTEM, MESSAGE and TEMPLATE layers,
    the stored manifest (None for a model outside the store) and its config details."""

    params: dict = field(default_factory=dict)
    system: str = ""
    messages: list = field(default_factory=list)
    template: str | None = None
    stored: Any = None
    details: dict = field(default_factory=dict)


def _layers(state: ServerState, spec: ModelSpec) -> ModelLayers:
    """The layers of the store model ``spec`` names (worker-thread work: reads small blobs)."""
    store = _store(state)
    try:
        stored = store.get(spec.name)
    except ValueError:  # not a store name (a path, a -m alias)
        stored = None
    if stored is None or (spec.path and stored.model_path is not None and str(stored.model_path) != spec.path):
        return ModelLayers()
    key = (str(store.root), stored.digest)
    known = _LAYERS.get(key)
    if known is None:
        m = stored.manifest
        try:
            known = ModelLayers(store.params(m), store.layer_text(m, "system") or "", store.messages(m),
                                store.layer_text(m, "template"), None, _config(store, m))
        except (OSError, KvserveError) as e:
            log.warning("model '%s': cannot read its layers: %s", spec.name, e)
            return ModelLayers(stored=stored)
        if len(_LAYERS) >= 256:
            _LAYERS.clear()
        _LAYERS[key] = known
    return dataclasses.replace(known, stored=stored)


#: the layers read per (store root, manifest digest): a manifest names its blobs by digest, so the
#: same manifest bytes always mean the same layers; a request reads only the manifest (a model's
#: first request, usually the one that loads it, reads the blobs). Values are shared: never mutated.
_LAYERS: dict[tuple[str, str], ModelLayers] = {}


def _config(store, manifest) -> dict:
    try:
        data = json.loads(store.blob_path(manifest.config.digest).read_bytes())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _details(config: dict) -> ModelDetails:
    fams = config.get("model_families")
    return ModelDetails(parent_model="", format=str(config.get("model_format") or ""),
                        family=str(config.get("model_family") or ""),
                        families=[str(f) for f in fams] if isinstance(fams, list) else None,
                        parameter_size=str(config.get("model_type") or ""),
                        quantization_level=str(config.get("file_type") or ""))


# ------------------------------------------------------------------------ leases


def _spec_for(state: ServerState, spec: ModelSpec, num_ctx: int | None, use_mmap: bool | None = None) -> ModelSpec:
    """``spec`` with the context ``num_ctx`` (tokens per sequence) and the weight memory mode
    ``use_mmap`` ask for; a loaded runner that already has them keeps its spec (no reload): its
    sequences' context, and for ``use_mmap`` the server's mode when that is the one asked for (as
    Ollama keeps a runner whose mmap choice was its default). Pinned models (``-m``) keep the
    server's context and mode (logged)."""
    spec = _mmap_spec(state, spec, use_mmap)
    if num_ctx is None:
        return spec
    if spec.pinned:
        log.warning("num_ctx %d ignored: the model was given with -m (its context is -c)", num_ctx,
                    extra={"func": "ollama"})
        return spec
    e = state.manager.get(spec.name)
    if e is not None and e.runner is not None and e.runner.engine is not None \
            and e.runner.engine.n_ctx_slot == num_ctx:
        return dataclasses.replace(spec, n_ctx=e.spec.n_ctx)
    cfg = state.args.engine_config()
    return dataclasses.replace(spec, n_ctx=num_ctx * (1 if cfg.unified else max(cfg.n_slots, 1)))


def _mmap_spec(state: ServerState, spec: ModelSpec, use_mmap: bool | None) -> ModelSpec:
    """``spec`` with ``use_mmap`` (see :func:`_spec_for`)."""
    if use_mmap is None:
        return spec
    if spec.pinned:
        log.warning("use_mmap %s ignored: the model was given with -m (--mmap / --no-mmap hold its weights)",
                    str(use_mmap).lower(), extra={"func": "ollama"})
        return spec
    e = state.manager.get(spec.name)
    if e is not None and e.runner is not None \
            and getattr(e.runner, "weight_memory", None) == ("mmap" if use_mmap else "read"):
        # its weights are held as asked (the server's mode, or a read that fell back to the mapping):
        # the loaded runner's own value, so no reload
        return dataclasses.replace(spec, use_mmap=e.spec.use_mmap)
    return dataclasses.replace(spec, use_mmap=use_mmap)


# ------------------------------------------------------------------------ chat and generate


@dataclass
class _Call:
    """One /api/chat or /api/generate request, read and checked before any model is held."""

    kind: str  # "chat" | "generate"
    model: str  # the name as the request gave it (responses echo it)
    body: dict
    stream: bool
    keep_alive: float | None
    t0: int  # monotonic ns when the request arrived
    layers: ModelLayers = field(default_factory=ModelLayers)
    options: OllamaOptions | None = None
    t_loaded: int = 0


@dataclass
class _Run:
    """A planned request: the serving layer's plan plus what Ollama's output needs."""

    plan: Any  # kvserve.serving.chat_plan.Plan
    with_context: bool = False  # generate, not raw: return the token ids


def _think_value(body: dict) -> bool | str | None:
    v = body.get("think")
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, str) and v in ("high", "medium", "low", "max"):
        return v
    if isinstance(v, str):
        raise ApiError(400, f'invalid think value: "{v}" (must be "high", "medium", "low", "max", true, or false)')
    raise ApiError(400, 'think must be a boolean or string ("high", "medium", "low", "max", true, or false)')


def template_source(runner: Runner) -> str:
    """The chat template text a runner renders with ("" without one)."""
    t = runner.template
    return getattr(t, "source", "") or "" if t is not None else ""


def capabilities(template: str, tool_parser: str | None = None) -> list[str]:
    """Ollama's capabilities of a model from its chat template: ``completion``; ``tools`` when
    a tool-call parser fits the template (or ``--tool-call-parser`` is set); ``thinking`` when
    the template writes or switches thinking blocks (``<think>``, ``enable_thinking``) or writes
    harmony messages (gpt-oss's analysis channel)."""
    from kvserve.chat.tool_calls import detect_tool_parser

    caps = ["completion"]
    if tool_parser or (template and detect_tool_parser(template)):
        caps.append("tools")
    if "<think>" in template or "enable_thinking" in template or ("<|channel|>" in template and
                                                                    "<|message|>" in template):
        caps.append("thinking")  # harmony (gpt-oss): the analysis channel
    return caps


def _chat_messages(messages: Any) -> list[dict]:
    """Ollama messages -> the OpenAI-style messages the chat renderer takes: ``thinking`` ->
    ``reasoning_content``, ``tool_name`` -> ``name``; ``images`` refused (400)."""
    if not isinstance(messages, list):
        raise ApiError(400, "json: cannot unmarshal into Go struct field .messages of type []api.Message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}]: expected an object")
        if m.get("images"):
            raise ApiError(400, "vision is not supported")
        msg = {k: v for k, v in m.items() if k not in ("images", "thinking", "tool_name")}
        role = msg.get("role")
        msg["role"] = role.lower() if isinstance(role, str) else role  # Ollama lower-cases roles
        if msg.get("content") is None:
            msg["content"] = ""
        if isinstance(m.get("thinking"), str) and m["thinking"]:
            msg["reasoning_content"] = m["thinking"]
        if isinstance(m.get("tool_name"), str) and m["tool_name"] and "name" not in msg:
            msg["name"] = m["tool_name"]
        out.append(msg)
    return out


def _with_model_turns(messages: list[dict], layers: ModelLayers) -> list[dict]:
    """Ollama's ChatHandler order: the model's MESSAGE turns, then the request's, and the
    model's SYSTEM first unless the request starts with a system message."""
    msgs = [*layers.messages, *messages]
    if messages and messages[0].get("role") != "system" and layers.system:
        msgs = [{"role": "system", "content": layers.system}, *msgs]
    return msgs


@dataclass
class _Rules:
    """What a chat or generate request's ``options``, ``format`` and ``think`` mean, for any plan.

    Attributes:
        n_predict: the token limit after Ollama's rule (:func:`_n_predict`).
        n_predict_is_default: the limit is a default (capped to the context's room, never refused).
        spec: the ``format`` constraint (a ConstraintSpec) or None.
        reasoning: the reasoning options ``think`` selects.
        variables: template variables ``think`` sets (``enable_thinking``).
    """

    n_predict: int
    n_predict_is_default: bool
    spec: Any
    reasoning: ReasoningOptions
    variables: dict


def _n_predict(call: _Call, runner: Runner) -> tuple[int, bool]:
    """Ollama's ``num_predict`` -> ``(n_predict, is_default)``: unlimited on the model's own context
    stops at :data:`UNLIMITED_N_PREDICT` (where Ollama stops); a limit the request's ``options`` did
    not set (the model's params layer) is a default."""
    n = call.options.sampling["n_predict"]
    opts = call.body.get("options")
    default = False
    if n < 0 and call.options.num_ctx is None and not runner.args.ctx_size:
        n, default = UNLIMITED_N_PREDICT, True  # unlimited, on the model's own context: Ollama's 4096
    if n > 0 and not (isinstance(opts, dict) and opts.get("num_predict") is not None):
        default = True  # a default: capped to the context's room, never refused
    return n, default


def _thinking(call: _Call, runner: Runner) -> tuple[ReasoningOptions, dict]:
    """``think`` -> the reasoning options and template variables (400 for a model that does not
    think): false switches thinking off in the template and the output is not split; a level is the
    template's ``reasoning_effort``; a model without thinking is never split."""
    think = _think_value(call.body)
    source = template_source(runner)
    thinks = "thinking" in capabilities(source, runner.args.tool_call_parser)
    if think not in (None, False) and not thinks:
        raise ApiError(400, f'"{call.model}" does not support thinking')
    effort = think if isinstance(think, str) else None
    if thinks and "<|channel|>" in source:
        # gpt-oss always writes its analysis channel (Ollama: think takes low / medium / high); it is
        # parsed out of the answer whatever think says, false included
        return ReasoningOptions(effort=effort), {}
    if thinks and think is False:
        return ReasoningOptions(format="none"), {"enable_thinking": False}
    if thinks:
        return ReasoningOptions(effort=effort), {}
    return ReasoningOptions(format="none"), {}


def _rules(call: _Call, runner: Runner) -> _Rules:
    """Read ``options`` (already layered), ``format`` and ``think`` (400s in Ollama's words)."""
    from kvserve.structured.spec import constraint_from_body

    n_predict, default = _n_predict(call, runner)
    spec = constraint_from_body({"format": call.body.get("format")}, "ollama")  # Ollama's field names in errors
    reasoning, variables = _thinking(call, runner)
    return _Rules(n_predict, default, spec, reasoning, variables)


def _sampling(call: _Call, rules: _Rules) -> dict[str, Any]:
    """The options' sampler values as SamplingParams fields, with llama.cpp's meanings: ``top_k``
    <= 0 is off, a negative ``seed`` is random, seeds are 32 bits."""
    opts = call.options.sampling
    kw = {k: v for k, v in opts.items() if k != "stop"}
    kw["n_predict"] = rules.n_predict
    kw["top_k"] = max(kw["top_k"], 0)
    kw["seed"] = SEED_RANDOM if kw["seed"] < 0 else kw["seed"] & 0xFFFFFFFF
    if opts["stop"]:
        kw["stop"] = stop_strings(opts["stop"])
    return kw


def _chat_request(call: _Call, runner: Runner, rules: _Rules, messages: list[dict], tools: Any = None) -> ChatRequest:
    """An Ollama chat (or a generate rendered with the model's chat template) -> kvserve's
    ChatRequest. ``tools`` are checked as tool definitions; a final assistant message that opens a
    call in the template's format forces that call (``required``)."""
    parsed = parse_tools(tools) if tools else None
    forced = bool(tools) and _forced_call(runner, messages, tools)
    choice = "required" if forced else ("auto" if parsed else "none")
    return ChatRequest(messages, new_id("chatcmpl-"), model=call.model, keep_alive=call.keep_alive,
                       tools=parsed, tool_choice=choice, response_format=rules.spec, reasoning=rules.reasoning,
                       template=TemplateOptions(variables=dict(rules.variables)), sampling=_sampling(call, rules),
                       n_predict_is_default=rules.n_predict_is_default, owner=caller())


def _completion_request(call: _Call, runner: Runner, rules: _Rules, prompt: Prompt) -> CompletionRequest:
    """A generate that is not rendered as a chat (raw, a template given, a context) -> kvserve's
    CompletionRequest: the options' sampler values (read with llama.cpp's names and checks),
    ``format`` as the constraint, the ``num_predict`` rule."""
    fields: dict[str, Any] = dict(call.options.sampling)
    fields["n_predict"] = rules.n_predict
    if not fields["stop"]:
        del fields["stop"]
    sampling = sampling_fields(fields, runner.tokenizer, max_logprobs=runner.args.max_logprobs)
    return CompletionRequest([prompt], new_id("cmpl-"), model=call.model, keep_alive=call.keep_alive,
                             sampling=sampling, n_predict_is_default=rules.n_predict_is_default,
                             response_format=rules.spec, refuse_empty=True, owner=caller())


def _forced_call(runner: Runner, messages: list[dict], tools: Any) -> bool:
    """True when ``tools`` are given and the final assistant message is the opening of a call in
    the template's format (e.g. ``<tool_call>\\n``): that call is then forced by a grammar."""
    if not tools or not messages or messages[-1].get("role") != "assistant":
        return False
    content = messages[-1].get("content")
    if not isinstance(content, str) or not content.strip():
        return False
    from kvserve.chat.tool_calls import detect_tool_parser
    from kvserve.chat.tool_grammar import TOOL_GRAMMAR_FORMATS, tool_call_prefix

    parser = runner.args.tool_call_parser or detect_tool_parser(template_source(runner))
    if parser not in TOOL_GRAMMAR_FORMATS:
        return False
    return content == tool_call_prefix(parser)


def _chat_run(runner: Runner, req: ChatRequest, with_context: bool = False) -> _Run:
    plan = plan_chat(runner, req)
    return _Run(plan, with_context)


def _remote_plan(runner, call: _Call) -> _Run:
    """/api/chat and /api/generate for a remote model (:mod:`kvserve.remote`): the request as a chat
    (a generate's ``system`` and ``prompt`` as its messages) with only the ``options`` the request
    set (the upstream's own defaults apply to the rest), ``format``, ``think`` and tools; the
    upstream renders the prompt, so ``raw``, ``template``, ``suffix`` and ``context`` are refused."""
    from kvserve.structured.spec import constraint_from_body

    b = call.body
    if call.kind == "chat":
        msgs = _chat_messages(b.get("messages"))
        tools = b.get("tools")
    else:
        prompt, suffix, system, template, raw, context = _generate_fields(call)
        if raw or template or suffix or context:
            raise ApiError(400, f'"{call.model}" is a remote model: raw, template, suffix and context are not '
                                "forwarded")
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        tools = None
    opts = b.get("options") if isinstance(b.get("options"), dict) else {}
    sampling = {_SAMPLING_FIELDS[k]: v for k, v in call.options.sampling_given(opts).items()}
    if "stop" in sampling:
        sampling["stop"] = stop_strings(sampling["stop"]) if sampling["stop"] else ()
    if sampling.get("seed", 0) < 0:
        del sampling["seed"]
    think = _think_value(b)
    reasoning = ReasoningOptions(effort=think if isinstance(think, str) else None)
    variables = {"enable_thinking": think} if isinstance(think, bool) else {}
    parsed = parse_tools(tools) if tools else None
    req = ChatRequest(msgs, new_id("chatcmpl-"), model=call.model, keep_alive=call.keep_alive, tools=parsed,
                      tool_choice="auto" if parsed else "none",
                      response_format=constraint_from_body({"format": b.get("format")}, "ollama"),
                      reasoning=reasoning, template=TemplateOptions(variables=variables), sampling=sampling,
                      owner=caller())
    return _Run(plan_chat(runner, req))


def _plan(runner: Runner, call: _Call) -> _Run:
    """Build the engine requests (worker-thread work: rendering, tokenizing, grammar compiles)."""
    if getattr(runner, "remote", None) is not None:
        return _remote_plan(runner, call)
    rules = _rules(call, runner)
    b = call.body
    if call.kind == "chat":
        msgs = _with_model_turns(_chat_messages(b.get("messages")), call.layers)
        return _chat_run(runner, _chat_request(call, runner, rules, msgs, b.get("tools")))
    return _generate_plan(runner, call, rules)


def _generate_fields(call: _Call) -> tuple[str, str, str, str, bool, list[int]]:
    """``(prompt, suffix, system, template, raw, context)`` of a generate request (Ollama's 400s)."""
    b = call.body
    prompt, suffix, system, template = (_string(b, k) for k in ("prompt", "suffix", "system", "template"))
    raw = _flag(b, "raw", False)
    context = b.get("context")
    if context is not None and (not isinstance(context, list)
                                or not all(isinstance(t, int) and not isinstance(t, bool) for t in context)):
        raise ApiError(400, "json: cannot unmarshal into Go struct field .context of type []int")
    context = context or []
    if raw and (template or system or context):
        raise ApiError(400, "raw mode does not support template, system, or context")
    if suffix and not template:
        raise ApiError(400, f'"{call.model}" does not support insert')
    return prompt, suffix, system, template, raw, context


def _check_context(context: list[int], n_vocab: int) -> None:
    """Every id of ``context`` is in the vocabulary: else 400 naming the field and the first bad
    id (Ollama detokenizes the ids through its llama-server child and answers its 500
    ``detokenize error: ... vector::_M_range_check ...``; a client's bad id is a 400 here)."""
    bad = next((t for t in context if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise ApiError(400, f"Field 'context': token id {bad} out of range [0, {n_vocab})")


def _generate_plan(runner: Runner, call: _Call, rules: _Rules) -> _Run:
    prompt, suffix, system, template, raw, context = _generate_fields(call)
    _check_context(context, runner.tokenizer.n_vocab)
    if raw:
        return _Run(plan_completion(runner, _completion_request(call, runner, rules, prompt)))
    msgs = [{"role": "system", "content": system or call.layers.system}] if system or call.layers.system else []
    if not context:
        msgs += call.layers.messages
    msgs.append({"role": "user", "content": prompt})
    if template:
        text = _go_template(template, msgs, _think_value(call.body), prompt, suffix, call.model)
    elif context:  # Ollama prepends the context's text to the rendered prompt
        text, _ = render_prompt(runner, msgs, add_generation_prompt=True, continue_final_message=False,
                                variables=rules.variables)
    else:
        return _chat_run(runner, _chat_request(call, runner, rules, msgs), with_context=True)
    req = _completion_request(call, runner, rules, [*context, text] if context else text)
    return _Run(plan_completion(runner, req), with_context=True)


def _go_template(template: str, msgs: list[dict], think, prompt: str, suffix: str, model: str) -> str:
    """Render an Ollama (Go) template given with the request."""
    try:
        from kvserve.chat.go_template import OllamaTemplate
    except ImportError:
        raise ApiError(501, "templates in Go's template language are not supported yet") from None
    t = OllamaTemplate(template)
    if suffix:
        if "suffix" not in t.vars:
            raise ApiError(400, f'"{model}" does not support insert')
        return t.render(think=think, prompt=prompt, suffix=suffix)
    return t.render(msgs, think=think)


# -- output ---------------------------------------------------------------------------------


def _tool_calls(calls: list[ToolCallPiece]) -> list[ToolCall]:
    """The answer's calls (arguments as JSON text) -> Ollama's (arguments as objects; text that
    is not a JSON object becomes ``{}``)."""
    out = []
    for c in calls:
        try:
            args = json.loads(c.arguments or "{}")
        except ValueError:
            args = {}
        out.append(ToolCall(id=c.id or "", function=ToolCallFunction(
            index=c.index, name=c.name, arguments=args if isinstance(args, dict) else {})))
    return out


def _fields(pieces: list[Piece]) -> tuple[str, str, list[ToolCall]]:
    """One step's pieces as Ollama's ``content``, ``thinking`` and ``tool_calls``."""
    content, thinking, calls = [], [], []
    for p in pieces:
        if type(p) is TextPiece:
            content.append(p.text)
        elif type(p) is ReasoningPiece:
            thinking.append(p.text)
        else:
            calls.append(p)
    return "".join(content), "".join(thinking), _tool_calls(calls)


def _metrics(call: _Call, out: RequestOutput | None) -> dict:
    now = time.monotonic_ns()
    m = {"total_duration": now - call.t0, "load_duration": max(call.t_loaded - call.t0, 0),
         "prompt_eval_count": 0, "prompt_eval_duration": 0, "eval_count": 0, "eval_duration": 0}
    if out is not None:
        t = out.timings
        m.update(prompt_eval_count=t.prompt_n, prompt_eval_duration=int(t.prompt_ms * 1e6),
                 eval_count=out.num_output_tokens, eval_duration=int(t.predicted_ms * 1e6))
    return m


def _object(call: _Call, content: str, thinking: str = "", calls: list[ToolCall] | None = None, *,
            done: bool = False, reason: str = "", out: RequestOutput | None = None,
            context: list[int] | None = None) -> dict:
    """One response object of ``call``'s kind (a stream line, or the whole answer)."""
    extra: dict[str, Any] = {}
    if done:
        extra.update(done_reason=reason, **_metrics(call, out))
    if call.kind == "chat":
        msg = Message(role="assistant", content=content)
        if thinking:
            msg.thinking = thinking
        if calls:
            msg.tool_calls = calls
        return ChatResponse(model=call.model, created_at=go_time(), message=msg, done=done, **extra).wire()
    r = GenerateResponse(model=call.model, created_at=go_time(), response=content, done=done, **extra)
    if thinking:
        r.thinking = thinking
    if context is not None:
        r.context = context
    if calls:
        r.tool_calls = calls
    return r.wire()


async def _stream_lines(runner: Runner, call: _Call, run: _Run) -> AsyncIterator[bytes]:
    """The NDJSON lines of a streamed answer (the serving layer's pieces, :func:`chat_events`)."""
    ids: list[int] = []
    async for ev in chat_events(runner, run.plan, slot_view(run.plan.grammar)):
        out = ev.output
        ids += out.new_token_ids
        content, thinking, calls = _fields(ev.pieces)
        if content or thinking or calls:
            yield _go_json(_object(call, content, thinking, calls)) + b"\n"
        if out.finished:
            ctx = [*run.plan.requests[0].prompt_token_ids, *ids] if run.with_context else None
            yield _go_json(_object(call, "", done=True, reason=out.finish_reason or "stop", out=out,
                                   context=ctx)) + b"\n"


async def _whole(runner: Runner, call: _Call, run: _Run) -> dict:
    """The one object of a non-streamed answer (the serving layer's whole answer)."""
    ids, last = [], None
    async for ev in chat_events(runner, run.plan, slot_view(run.plan.grammar), whole=True):
        ids += ev.output.new_token_ids
        if ev.answer is not None:
            last = ev
    ans = last.answer
    ctx = [*run.plan.requests[0].prompt_token_ids, *ids] if run.with_context else None
    return _object(call, ans.text, ans.reasoning or "", _tool_calls(ans.tool_calls), done=True,
                   reason=last.output.finish_reason or "stop", out=last.output, context=ctx)


async def _ndjson(lines: AsyncIterator[bytes]) -> StreamingResponse:
    """An NDJSON response whose first line exists before the response starts (so an error found
    by then is a plain JSON error); later errors become one ``{"error": ...}`` line."""
    it = lines.__aiter__()
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        first = b""

    async def body():
        try:
            if first:
                yield first
            async for line in it:
                yield line
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - after the start an error is the last line
            yield _go_json(ErrorResponse(error=_status_message(e)[1]).wire()) + b"\n"
        finally:
            await it.aclose()

    return StreamingResponse(body(), media_type=NDJSON)


async def _check_generates(spec: ModelSpec, kind: str, model: str) -> None:
    """Ollama's capability check before anything loads (``scheduleRunner``'s
    ``CheckCapabilities``): a model that does not generate text (an embedding model) answers
    /api/chat and /api/generate, an empty one included, with 400 ``"<model>" does not support
    chat`` / ``generate`` (the name as the request gave it); read from the model's files."""
    from kvserve.serving.embed_runner import cached_task, model_task

    task = cached_task(spec.path) or await asyncio.to_thread(model_task, spec.path)
    if task != "generate":
        raise ApiError(400, f'"{model}" does not support {"chat" if kind == "chat" else "generate"}')


async def _infer(state: ServerState, http: HttpRequest, kind: str) -> Response:
    """/api/chat and /api/generate (see the module docstring)."""
    t0 = time.monotonic_ns()
    lease: Lease | None = None
    try:
        b = await _body(http)
        model = _model_name(b)
        keep_alive = parse_keep_alive(b["keep_alive"]) if b.get("keep_alive") is not None else None
        call = _Call(kind, model, b, _flag(b, "stream", True), keep_alive, t0)
        if kind == "chat":
            if b.get("messages") is not None and not isinstance(b["messages"], list):
                _chat_messages(b["messages"])  # the type error
            empty = not b.get("messages")
        else:
            if b.get("images"):
                raise ApiError(400, "vision is not supported")
            empty = not _string(b, "prompt") and not _string(b, "suffix")
        spec = state.resolve(model)
        if empty and keep_alive == 0:  # unload: nothing is loaded for it
            await state.manager.unload(spec.name)
            call.t_loaded = time.monotonic_ns()
            return _json(_object(call, "", done=True, reason="unload"))
        if not spec.remote:  # a remote model (kvserve.remote): no files, no layers; its upstream decides
            await _check_generates(spec, kind, model)
            call.layers = await asyncio.to_thread(_layers, state, spec)
        call.options = ollama_options(call.layers.params, b.get("options"))
        lease = await acquire_model(state, spec if spec.remote else _spec_for(state, spec, call.options.num_ctx,
                                                                              call.options.use_mmap),
                                    keep_alive, http)
        call.t_loaded = time.monotonic_ns()
        if empty:
            return _json(_object(call, "", done=True, reason="load"))
        runner = lease.runner
        # the model's own defaults (generation_config.json, general.sampling.*) under its params layer
        if runner.generation is not None:
            call.options = ollama_options({**ollama_layer(runner.generation),
                                           **(call.layers.params or {})}, b.get("options"))
        run = await asyncio.to_thread(_plan, runner, call)
        if call.stream:
            response = await _ndjson(_stream_lines(runner, call, run))
            held, lease = lease, None
            return LeasedResponse(response, held)
        return _json(await until_disconnect(http, _whole(runner, call, run)))
    except Exception as e:  # noqa: BLE001 - every failure answers {"error": ...}
        return _error_of(e)
    finally:
        if lease is not None:
            lease.release()


# ------------------------------------------------------------------------ models


def _show(state: ServerState, body: dict) -> dict:
    """/api/show (worker-thread work: reads the GGUF header)."""
    from kvserve.loaders.gguf import read_gguf_header

    name = _model_name(body, "model", "name")
    spec = state.resolve(name)
    if spec.remote and spec.name in getattr(state, "engines", {}):
        return _show_engine(state, spec)
    if spec.remote:
        return _show_remote(state, spec)
    layers = _layers(state, spec)
    if layers.stored is None and not spec.path:
        raise NotFoundError(f"model '{name}' not found")
    from kvserve.serving.embed_runner import hf_header, model_task

    if spec.path and os.path.isdir(spec.path):  # an HF directory (all-minilm): its config.json's facts
        md, tensors = hf_header(spec.path), []
    else:
        md, tensors = read_gguf_header(spec.path) if spec.path else ({}, [])
    source = _runner_template(state, layers, md)
    system = _string(body, "system") or layers.system
    verbose = _flag(body, "verbose", False)
    info = _model_info(md, tensors, verbose)
    config = layers.details or _config_from_header(md, tensors)
    r = ShowResponse(details=_details(config), model_info=info, modified_at=go_time(
        int((layers.stored.modified if layers.stored else time.time()) * 1e9)))
    lic = _license(state, layers)
    if lic:
        r.license = lic
    from kvserve.ollama.modelfile import show_modelfile, show_parameters

    r.modelfile = show_modelfile(short_name=layers.stored.display if layers.stored is not None else spec.name,
                                 model_path=spec.path, template=layers.template, system=system,
                                 adapters=[p for p, _ in spec.adapters] +  # LoRA: the model's own, the chosen
                                 [a.path for a in getattr(spec, "selected", ())],
                                 parameters=layers.params, licenses=[lic] if lic else [],
                                 messages=layers.messages)
    params = show_parameters(layers.params)
    if params:
        r.parameters = params
    if source:
        r.template = source
    if system:
        r.system = system
    if layers.messages:
        r.messages = [{"role": m.get("role", ""), "content": m.get("content", "")} for m in layers.messages]
    r.capabilities = capabilities(source, state.args.tool_call_parser) if model_task(spec.path) == "generate" \
        else ["embedding"]
    return r.wire()


def _show_engine(state: ServerState, spec: ModelSpec) -> dict:
    """/api/show of a supervised engine (:mod:`kvserve.supervisor`): its command (``ENGINE`` in the
    modelfile text and ``engine``, values that look like keys written ``***``) and, while its child
    runs, the child's loopback URL (``remote_host``)."""
    from kvserve.supervisor.modelfile import engine_modelfile
    from kvserve.supervisor.spec import shown_command

    eng = state.engines[spec.name]
    e = state.manager.get(spec.name)
    runner = e.runner if e is not None else None
    return ShowResponse(details=_details({}), model_info={}, modified_at=go_time(int(state.started * 1e9)),
                        modelfile=engine_modelfile(eng), capabilities=["completion", "tools"],
                        engine=shown_command(eng.argv), engine_model=eng.model or None,
                        remote_model=runner.remote.upstream_model if runner is not None else None,
                        remote_host=runner.remote.shown_url if runner is not None else None).wire()


def _show_remote(state: ServerState, spec: ModelSpec) -> dict:
    """/api/show of a remote model (:mod:`kvserve.remote`): its upstream (Ollama's ``remote_model``
    and ``remote_host``) and the start-up check run now (``remote_check``: ok with the upstream's
    models, rejected key, or no server; logged too). Never the key. Worker-thread work."""
    from kvserve.remote import check_remote

    remote = state.remote_of(spec.name)
    check = check_remote(remote)
    log.log(logging.INFO if check.ok else logging.WARNING, "remote model '%s' (%s, %s): %s", spec.name,
            remote.dialect, remote.shown_url, check.message, extra={"func": "remote"})
    e = state.manager.get(spec.name)
    if e is not None and e.runner is not None:
        e.runner.last_check = check
    lines = [f"FROM {remote.upstream_model}", f"REMOTE {remote.shown_url} dialect={remote.dialect}"
             + (f" key={remote.key_env}" if remote.key_env else "")]
    return ShowResponse(details=_details({}), model_info={}, modified_at=go_time(int(state.started * 1e9)),
                        modelfile="\n".join(lines) + "\n", capabilities=["completion", "tools"],
                        remote_model=remote.upstream_model, remote_host=remote.shown_url,
                        remote_check=check.message).wire()


def _runner_template(state: ServerState, layers: ModelLayers, md: dict) -> str:
    """The template a runner of this model renders with, as :func:`make_template` picks it: the
    TEMPLATE layer, else ``--chat-template-file``, ``--chat-template``, the GGUF's."""
    if layers.template:
        return layers.template
    a = state.args
    if a.chat_template_file:
        try:
            with open(a.chat_template_file, encoding="utf-8") as f:
                return f.read()
        except OSError:
            return ""
    if a.chat_template:
        from kvserve.serving.chat_runner import CHATML

        return CHATML if a.chat_template == "chatml" else a.chat_template
    return str(md.get("tokenizer.chat_template") or "")


def _license(state: ServerState, layers: ModelLayers) -> str:
    if layers.stored is None:
        return ""
    store = _store(state)
    texts = []
    for layer in layers.stored.manifest.layers_of("license"):
        try:
            texts.append(store.blob_path(layer.digest).read_text(encoding="utf-8", errors="replace"))
        except OSError:
            pass
    return "\n".join(texts)


def _model_info(md: dict, tensors: list, verbose: bool) -> dict:
    """The GGUF header as Ollama's /api/show writes it: without ``general.name`` and
    ``tokenizer.chat_template``, arrays of more than 5 items empty unless ``verbose``, and
    ``general.parameter_count``."""
    info: dict[str, Any] = {}
    for k, v in md.items():
        if k in ("general.name", "tokenizer.chat_template", "GGUF.version"):
            continue
        if isinstance(v, (list, tuple)) or hasattr(v, "tolist"):
            v = list(v.tolist() if hasattr(v, "tolist") else v)
            if len(v) > 5 and not verbose:
                v = []
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        info[k] = v
    info.setdefault("general.parameter_count", sum(t.n_elements for t in tensors))
    return dict(sorted(info.items()))


def _config_from_header(md: dict, tensors: list) -> dict:
    from kvserve.store.manifest import human_number

    arch = str(md.get("general.architecture") or "")

    return {"model_format": "gguf", "model_family": arch, "model_families": [arch] if arch else None,
            "model_type": human_number(sum(t.n_elements for t in tensors)) if tensors else "",
            "file_type": ""}


def _tags(state: ServerState) -> dict:
    store = _store(state)
    models = []
    for m in store.list():
        cfg = _config(store, m.manifest)
        lm = ListModel(name=m.display, model=m.display, modified_at=go_time(int(m.modified * 1e9)),
                       size=m.size, digest=m.digest, details=_details(cfg))
        if cfg.get("remote_host"):  # a remote model of the store (Modelfile REMOTE)
            from kvserve.remote import redact_url

            lm.remote_model, lm.remote_host = str(cfg.get("remote_model") or ""), redact_url(str(cfg["remote_host"]))
        models.append(lm)
    for name, r in state.remotes.items():  # remote models (--remote): no files; the upstream named
        models.append(ListModel(name=name, model=name, modified_at=go_time(int(state.started * 1e9)), size=0,
                                digest="", details=_details({}), remote_model=r.upstream_model,
                                remote_host=r.shown_url))
    for name in state.all_engines():  # supervised engines (kvserve.supervisor): the child's files are its own
        models.append(ListModel(name=name, model=name, modified_at=go_time(int(state.started * 1e9)), size=0,
                                digest="", details=_details({})))
    return ListResponse(models=models).wire()


def _ps(state: ServerState) -> dict:
    """/api/ps: the loaded runners, the longest time left first (Ollama sorts by expires_at,
    descending, stable)."""
    mgr = state.manager
    now_ns, now_clock = time.time_ns(), mgr.clock()
    store = _store(state)
    rows = []
    for e in list(mgr.loaded.values()):
        r = e.runner
        if r is None or r.engine is None or e.closing:
            continue
        if e.spec.pinned or e.keep_alive < 0 or math.isinf(e.keep_alive):
            expires = now_ns + _FOREVER_NS
        elif e.expires_at is not None:
            expires = now_ns + int((e.expires_at - now_clock) * 1e9)
        else:  # busy: its timer starts when the last request ends
            expires = now_ns + int(e.keep_alive * 1e9)
        try:
            stored = store.get(e.spec.name)
        except ValueError:
            stored = None
        config = _config(store, stored.manifest) if stored is not None else {}
        device = r.device
        rows.append((expires, ProcessModel(
            name=e.spec.name, model=e.spec.name, size=int(e.size), digest=stored.digest if stored else "",
            details=_details(config), expires_at=go_time(min(expires, 2**63 - 1)),
            size_vram=0 if device.startswith(("cpu", "remote")) else int(e.size),
            context_length=0 if getattr(r.engine, "remote", False) else r.engine.n_ctx_slot)))
    rows.sort(key=lambda row: -(row[0] // 1_000_000_000))
    return ProcessResponse(models=[p for _, p in rows]).wire()


def _copy(state: ServerState, body: dict) -> None:
    from kvserve.store import parse_name

    src, dst = _string(body, "source"), _string(body, "destination")
    for what, n in (("source", src), ("destination", dst)):
        try:
            parse_name(n)
        except ValueError:
            raise ApiError(400, f'{what} "{n}" is invalid') from None
    store = _store(state)
    if store.get(src) is None:
        raise NotFoundError(f'model "{src}" not found')
    store.copy(src, dst)


def _delete(state: ServerState, body: dict) -> None:
    from kvserve.store import parse_name

    name = _string(body, "model") or _string(body, "name")
    try:
        parse_name(name)
    except ValueError:
        raise ApiError(400, f'name "{name}" is invalid') from None
    store = _store(state)
    if store.get(name) is None:
        raise NotFoundError(f"model '{name}' not found")
    store.delete(name)


# ------------------------------------------------------------------------ pull and push


#: Blob uploads, pulls, pushes and creates run on these threads, never on the default executor
#: that tokenizing and model loads use: six stalled transfers once took all of that one (its size
#: is min(32, cores + 4)) and every route that needs a worker thread hung.
IO_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvserve-io")
MAX_UPLOADS = 4  # concurrent POST /api/blobs; more get 503
UPLOAD_IDLE_S = 60.0  # an upload that sends nothing for this long is cut (408)
DISK_RESERVE = 512 << 20  # an upload stops when the store's file system has less free space left
_uploads_running = 0


def _progress_events(state: ServerState, kind: str, name: str, insecure: bool,
                     cancel: threading.Event | None = None):
    """The generator of /api/pull or /api/push progress events (:mod:`kvserve.store.registry_client`);
    ``cancel`` stops the transfer at its next chunk (the client left)."""
    import inspect

    from kvserve.store import registry_client as registry

    fn = registry.iter_pull if kind == "pull" else registry.iter_push
    kw = {"cancel": cancel} if cancel is not None and "cancel" in inspect.signature(fn).parameters else {}
    if kind == "pull":  # --pull-timeout, --pull-max-blob-size (0: none)
        kw.update(deadline=state.args.pull_timeout, max_blob_bytes=state.args.pull_max_blob_size)
    return fn(name, insecure=insecure, models_dir=state.args.models_dir, **kw)


async def _events(gen, cancel: threading.Event | None = None) -> AsyncIterator[dict]:
    """Drive a blocking progress generator on an :data:`IO_POOL` thread; closing this iterator
    (the client left) sets ``cancel`` and closes the generator at its next event (a pull keeps
    its partial download)."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    stop = False

    def drive() -> None:
        try:
            for event in gen:
                loop.call_soon_threadsafe(q.put_nowait, ("event", event))
                if stop:
                    break
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            loop.call_soon_threadsafe(q.put_nowait, ("error", e))
            return
        finally:
            gen.close()
        loop.call_soon_threadsafe(q.put_nowait, ("end", None))

    worker = loop.run_in_executor(IO_POOL, drive)
    try:
        while True:
            kind, item = await q.get()
            if kind == "end":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        stop = True
        if cancel is not None:
            cancel.set()
        await asyncio.shield(worker)


def _registry_status(e: BaseException) -> tuple[int, str]:
    """Ollama answers a failed pull or push with 500 (400 for an invalid name)."""
    status, message = _status_message(e)
    return (400 if status == 400 else 500), message


async def _pull_push(state: ServerState, http: HttpRequest, kind: str) -> Response:
    """/api/pull and /api/push: Ollama's progress statuses as NDJSON (``stream`` default true),
    or the last status as one object; a failure is ``{"error": ...}`` (a last line once the
    stream started)."""
    from kvserve.store import parse_name

    try:
        b = await _body(http)
        name = _string(b, "model") or _string(b, "name")
        if not name:
            raise ApiError(400, "invalid model name" if kind == "pull" else "model is required")
        try:
            parse_name(name)
        except ValueError:
            raise ApiError(400, "invalid model name") from None
        cancel = threading.Event()
        events = _events(_progress_events(state, kind, name, _flag(b, "insecure", False), cancel), cancel)
        if not _flag(b, "stream", True):
            async def last_event() -> dict:
                last: dict = {}
                async for ev in events:
                    last = ev
                return last

            # a client that leaves stops the transfer (it held a thread for as long as the registry trickled)
            return _json(await until_disconnect(http, last_event()))

        async def lines():
            async for ev in events:
                yield _go_json(ev) + b"\n"

        it = lines().__aiter__()
        first = await it.__anext__()

        async def body():
            yield first
            try:
                async for line in it:
                    yield line
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the last line
                yield _go_json(ErrorResponse(error=_registry_status(e)[1]).wire()) + b"\n"
            finally:
                await it.aclose()

        return StreamingResponse(body(), media_type=NDJSON)
    except StopAsyncIteration:
        return Response(b"", media_type=NDJSON)
    except Exception as e:  # noqa: BLE001
        if isinstance(e, ClientDisconnected):
            return Response(status_code=499)
        return _error(*_registry_status(e))


# ------------------------------------------------------------------------ create


def _create_events(state: ServerState, body: dict):
    """The blocking generator of /api/create's statuses (:func:`kvserve.ollama.create.iter_create`
    on the server's store); a base model the store lacks is pulled first, as Ollama does."""
    from kvserve.ollama.create import iter_create
    from kvserve.store import registry_client as registry

    store = _store(state)
    return iter_create(store, body, pull=lambda name: registry.iter_pull(name, store=store))


async def _created(state: ServerState, name: str) -> None:
    """After a create: a runner loaded under that name was built from the old layers (its
    template, its default system): it is unloaded now if idle, else when its last request
    ends, so the next request loads the new model."""
    try:
        spec = state.resolve(name)
    except Exception:  # noqa: BLE001 - nothing loaded under a name that does not resolve
        return
    if state.manager.get(spec.name) is not None:
        await state.manager.unload(spec.name, "re-created")


async def _create(state: ServerState, http: HttpRequest) -> Response:
    """POST /api/create: Ollama's create statuses as NDJSON (``stream`` default true), or the last
    one as a JSON object; an error before the first status is a plain ``{"error": ...}`` with
    its status (400 bad request, 404 missing blob or model, 501 not supported yet, 500), after it
    the stream's last line."""
    try:
        b = await _body(http)
        stream = _flag(b, "stream", True)
        name = _string(b, "model") or _string(b, "name")
        events = _events(_create_events(state, b))
        if not stream:
            last: dict = {}
            async for ev in events:
                last = ev
            await _created(state, name)
            return _json(last)

        async def lines():
            async for ev in events:
                if ev.get("status") == "success":
                    await _created(state, name)
                yield _go_json(ev) + b"\n"

        return await _ndjson(lines())
    except Exception as e:  # noqa: BLE001
        return _error_of(e)


# ------------------------------------------------------------------------ blobs


async def _upload_blob(state: ServerState, http: HttpRequest, digest: str) -> Response:
    """POST /api/blobs/:digest: 200 when present, 201 when written and verified, 400 on a digest
    mismatch or a malformed digest. The body streams to a temp file in the store's blob folder
    (hashed and written on an :data:`IO_POOL` thread, never held in memory), renamed when its
    sha256 matches. Bounded: at most :data:`MAX_UPLOADS` at once (503), 408 after
    :data:`UPLOAD_IDLE_S` without data, 507 when the disk would keep less than
    :data:`DISK_RESERVE` free. A client that leaves mid-body leaves no file behind."""
    global _uploads_running
    import hashlib
    import shutil
    import tempfile

    from starlette.requests import ClientDisconnect

    from kvserve.store import normalize_digest
    from kvserve.store.layout import DigestMismatchError

    try:
        want = normalize_digest(digest)
        store = _store(state)
        if store.has_blob(want):
            return Response(status_code=200)
    except Exception as e:  # noqa: BLE001
        return _error_of(e)
    if _uploads_running >= MAX_UPLOADS:
        return _error(503, f"too many blob uploads in progress (at most {MAX_UPLOADS}); try again")
    _uploads_running += 1
    loop = asyncio.get_running_loop()
    tmp = None
    f = None
    try:
        store.blobs_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=store.blobs_dir, prefix=".upload-")
        f = os.fdopen(fd, "wb")
        h = hashlib.sha256()
        written = 0
        checked = 0

        def write(chunk: bytes) -> None:
            h.update(chunk)
            f.write(chunk)

        it = http.stream().__aiter__()
        while True:
            try:
                chunk = await asyncio.wait_for(it.__anext__(), UPLOAD_IDLE_S)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                return _error(408, f"upload sent no data for {UPLOAD_IDLE_S:.0f} s")
            if not chunk:
                continue
            await loop.run_in_executor(IO_POOL, write, chunk)
            written += len(chunk)
            if written - checked >= 64 << 20:  # every 64 MiB: is there room left?
                checked = written
                if shutil.disk_usage(store.blobs_dir).free < DISK_RESERVE:
                    return _error(507, "not enough disk space for this blob")
        await loop.run_in_executor(IO_POOL, f.close)
        got = "sha256:" + h.hexdigest()
        if got != want:
            return _error_of(DigestMismatchError(want, got))
        os.replace(tmp, store.blob_path(want))
        tmp = None
        return Response(status_code=201)
    except ClientDisconnect:
        log.info("client disconnected during a blob upload (%s)", digest[:80], extra={"func": "api_blobs"})
        return Response(status_code=499)
    except Exception as e:  # noqa: BLE001
        return _error_of(e)
    finally:
        _uploads_running -= 1
        if f is not None and not f.closed:
            f.close()
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _head_blob(state: ServerState, digest: str) -> Response:
    from kvserve.store import normalize_digest

    try:
        want = normalize_digest(digest)
    except InvalidInputError as e:
        return _error(400, e.message)
    if not _store(state).has_blob(want):
        return _error(404, f'blob "{digest}" not found')
    return Response(status_code=200)


# ------------------------------------------------------------------------ routes


# ------------------------------------------------------------------------ embeddings

NO_EMBEDDINGS = "this model does not support embeddings"
TOO_LONG = "the input length exceeds the context length"


def _embed_inputs(value: Any, args: Any = None) -> list[str]:
    """EmbedHandler's ``input``: a string (empty: none) or a list of strings; else 400
    ``invalid input type``; 400 past ``--max-batch-inputs`` inputs or ``--max-input-bytes`` of text."""
    if value is None:
        return []
    if isinstance(value, str):
        check_input_bytes("input", (value,), input_bytes_cap(args))
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        check_count("input", len(value), batch_cap(args), "inputs", "--max-batch-inputs")
        check_input_bytes("input", value, input_bytes_cap(args))
        return list(value)
    raise ApiError(400, "invalid input type")


def _int_field(body: dict, key: str) -> int:
    v = body.get(key)
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"json: cannot unmarshal {_go_type(v)} into Go struct field .{key} of type int")
    return v


async def _embed_lease(state: ServerState, http: HttpRequest, body: dict, use_mmap: bool | None = None):
    """Hold the runner of the request's model for an embedding; 400 ``this model does not
    support embeddings`` for a generative model (without ``--embeddings``), before it loads.
    ``use_mmap`` (the request's ``options.use_mmap``) picks the weight memory of the load it
    causes, as for chat (:func:`_mmap_spec`; Ollama's EmbedHandler schedules its runner with the
    request's options too)."""
    from kvserve.serving.embed_runner import EmbeddingRunner

    name = _model_name(body)
    keep_alive = parse_keep_alive(body["keep_alive"]) if body.get("keep_alive") is not None else None
    spec = state.resolve(name)
    if not await serves_embeddings(state, name):
        raise ApiError(400, NO_EMBEDDINGS)
    if not spec.remote:
        spec = _mmap_spec(state, spec, use_mmap)
    lease = await acquire_model(state, spec, keep_alive, http)
    if not isinstance(lease.runner, EmbeddingRunner):
        lease.release()
        raise ApiError(400, NO_EMBEDDINGS)
    return lease


async def _embed(state: ServerState, http: HttpRequest) -> Response:
    """POST /api/embed (Ollama's EmbedHandler): ``input`` a string or a list of strings,
    ``truncate`` (default true: cut to the context, special tokens kept; false: 400 ``the
    input length exceeds the context length``), ``dimensions`` (cut, normalized again),
    ``options.num_ctx`` (a smaller context), ``options.use_mmap`` (the weight memory of the load it
    causes, as for chat), ``keep_alive``. Vectors are L2-normalized, as
    Ollama normalizes them; no input loads the model and answers ``embeddings: []``."""
    t0 = time.monotonic_ns()
    try:
        body = await _body(http)
        inputs = _embed_inputs(body.get("input"), state.args)
        truncate, dims = _flag(body, "truncate", True), _int_field(body, "dimensions")
        options = ollama_options(None, body.get("options"))
        num_ctx = options.num_ctx
        lease = await _embed_lease(state, http, body, options.use_mmap)
        try:
            t_loaded = time.monotonic_ns()
            if not inputs:
                return _json({"model": body["model"], "embeddings": []})
            runner = lease.runner
            limit = min(num_ctx or runner.n_ctx, runner.n_ctx)
            ids = await asyncio.to_thread(_fit_inputs, runner, inputs, limit, truncate)
            res = await until_disconnect(http, runner.embed_ids(ids, normalize=2))
        finally:
            lease.release()
        from kvserve.serving.embed_runner import cut_dimensions

        vectors = cut_dimensions(res.vectors, dims if 0 < dims < runner.dim else None)
        out = {"model": body["model"], "embeddings": vectors, "total_duration": time.monotonic_ns() - t0,
               "load_duration": t_loaded - t0}
        if res.total_tokens:
            out["prompt_eval_count"] = res.total_tokens
        return Response(dumps_json(out), media_type=JSON_TYPE)
    except Exception as e:  # noqa: BLE001
        return _error_of(e)


def _fit_inputs(runner, inputs: list[str], limit: int, truncate: bool) -> list[list[int]]:
    """Token ids of ``inputs`` within ``limit`` tokens: cut when ``truncate``, else 400."""
    from kvserve.serving.embed_runner import InputTooLongError

    try:
        ids = runner.tokenize(inputs, truncate=limit if truncate else None)
    except InputTooLongError:
        raise ApiError(400, TOO_LONG) from None
    if any(len(x) > limit for x in ids):
        raise ApiError(400, TOO_LONG)
    return ids


async def _embeddings(state: ServerState, http: HttpRequest) -> Response:
    """POST /api/embeddings (Ollama's older EmbeddingsHandler): ``prompt`` -> ``{"embedding":
    [...]}`` as the model gives it (its own pooling and normalization); an empty prompt loads
    the model and answers ``embedding: []``."""
    try:
        body = await _body(http)
        prompt = _string(body, "prompt")
        check_input_bytes("prompt", (prompt,), input_bytes_cap(state.args))
        options = ollama_options(None, body.get("options"))  # type-checked as Ollama does; use_mmap applies
        lease = await _embed_lease(state, http, body, options.use_mmap)
        try:
            if not prompt:
                return _json({"embedding": []})
            try:
                res = await until_disconnect(http, lease.runner.embed([prompt]))
            except KvserveError as e:
                if getattr(e, "type", None) == "exceed_context_size_error":
                    raise ApiError(400, TOO_LONG) from None
                raise
        finally:
            lease.release()
        return Response(dumps_json({"embedding": res.vectors[0].astype("float64")}), media_type=JSON_TYPE)
    except Exception as e:  # noqa: BLE001
        return _error_of(e)


# -- the routes: one function each, then the table ----------------------------------------

async def version(state: ServerState, http: HttpRequest) -> Response:
    """GET /api/version: Ollama's version that kvserve matches (:data:`OLLAMA_VERSION`)."""
    return _json(VersionResponse(version=OLLAMA_VERSION).wire())


async def generate(state: ServerState, http: HttpRequest) -> Response:
    """POST /api/generate."""
    return await _infer(state, http, "generate")


async def chat(state: ServerState, http: HttpRequest) -> Response:
    """POST /api/chat."""
    return await _infer(state, http, "chat")


async def tags(state: ServerState, http: HttpRequest) -> Response:
    """GET /api/tags: the store's models."""
    try:
        return _json(await asyncio.to_thread(_tags, state))
    except Exception as e:  # noqa: BLE001
        return _error_of(e)


async def ps(state: ServerState, http: HttpRequest) -> Response:
    """GET /api/ps: the loaded models."""
    try:
        return _json(await asyncio.to_thread(_ps, state))
    except Exception as e:  # noqa: BLE001
        return _error_of(e)


async def show(state: ServerState, http: HttpRequest) -> Response:
    """POST /api/show: one model's details, template, parameters and model info."""
    try:
        body = await _body(http)
        return _json(await asyncio.to_thread(_show, state, body))
    except Exception as e:  # noqa: BLE001
        return _error_of(e)


async def copy(state: ServerState, http: HttpRequest) -> Response:
    """POST /api/copy: ``source`` -> ``destination`` in the store; an empty 200."""
    try:
        await asyncio.to_thread(_copy, state, await _body(http))
        return Response(status_code=200)
    except Exception as e:  # noqa: BLE001
        return _error_of(e)


async def delete(state: ServerState, http: HttpRequest) -> Response:
    """DELETE /api/delete: removes ``model`` from the store; an empty 200."""
    try:
        await asyncio.to_thread(_delete, state, await _body(http))
        return Response(status_code=200)
    except Exception as e:  # noqa: BLE001
        return _error_of(e)


async def head_blob(state: ServerState, http: HttpRequest) -> Response:
    """HEAD /api/blobs/{digest} (arrives as GET: :class:`~kvserve.faces.http.HeadAsGetMiddleware`)."""
    digest: str = http.path_params["digest"]
    return await asyncio.to_thread(_head_blob, state, digest)


async def create_blob(state: ServerState, http: HttpRequest) -> Response:
    """POST /api/blobs/{digest}: :func:`_upload_blob`."""
    digest: str = http.path_params["digest"]
    return await _upload_blob(state, http, digest)


async def pull(state: ServerState, http: HttpRequest) -> Response:
    """POST /api/pull."""
    return await _pull_push(state, http, "pull")


async def push(state: ServerState, http: HttpRequest) -> Response:
    """POST /api/push."""
    return await _pull_push(state, http, "push")


GET, POST, DELETE = ("GET",), ("POST",), ("DELETE",)

#: the Ollama face's routes in Starlette's matching order (the first match wins)
ROUTES: tuple[Route, ...] = (
    Route("/api/version", GET, version),
    Route("/api/generate", POST, generate),
    Route("/api/chat", POST, chat),
    Route("/api/tags", GET, tags),
    Route("/api/ps", GET, ps),
    Route("/api/show", POST, show),
    Route("/api/copy", POST, copy),
    Route("/api/delete", DELETE, delete),
    Route("/api/blobs/{digest}", GET, head_blob),  # HEAD arrives as GET (HeadAsGetMiddleware)
    Route("/api/blobs/{digest}", POST, create_blob),
    Route("/api/embed", POST, _embed),
    Route("/api/embeddings", POST, _embeddings),
    Route("/api/pull", POST, pull),
    Route("/api/push", POST, push),
    Route("/api/create", POST, _create),
)


def build_router(state: ServerState) -> APIRouter:
    """The Ollama face's routes (:data:`ROUTES`), bound to ``state``."""
    return route_table.build_router(state, ROUTES)
