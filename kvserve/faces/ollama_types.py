"""Wire types of the Ollama face (:mod:`kvserve.faces.ollama_api`): the JSON objects of ``/api/*``.

They follow Ollama's ``api/types.go`` (the reference the seed 004 Examples 1-5 cite) key for key
and in its order: :class:`GenerateResponse` and :class:`ChatResponse` (one per NDJSON line, the
last with ``done: true`` and the metrics), :class:`ListResponse` (``/api/tags``),
:class:`ShowResponse`, :class:`ProcessResponse` (``/api/ps``), :class:`VersionResponse`,
:class:`ProgressResponse` (pull, push and create statuses) and :class:`ErrorResponse`
(``{"error": "..."}``, Ollama's only error shape).

Which keys are written: see :mod:`kvserve.faces.wire`. A field without a default is always
written (Go fields without ``omitempty``, e.g. ``done``, ``message.content``, the ``details``
strings); a field with a default only when the face gives it (Go's ``omitempty`` fields, e.g.
``done_reason``, ``thinking``, ``tool_calls``). Unlike Go's ``omitempty``, the metrics of a
final object are written even when zero (``prompt_eval_count: 0`` on a load), so every final
object carries all six.

Units: every ``*_duration`` is in nanoseconds (Go's ``time.Duration``); ``size`` and
``size_vram`` in bytes; ``created_at``, ``modified_at`` and ``expires_at`` are RFC 3339 with
nanoseconds, trailing zeros dropped, as Go's ``time.Time`` marshals (``2026-10-03T12:00:00.5Z``;
kvserve writes UTC).

Requests are not modelled here, as on the other faces: the face reads them field by field
(:mod:`kvserve.faces.ollama_api`) because Ollama's error texts (``option "top_k" must be of type
integer``, ``missing request body``) and its lenient options map are the contract.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from kvserve.faces.wire import WireModel

__all__ = [
    "ChatResponse",
    "ErrorResponse",
    "GenerateResponse",
    "ListModel",
    "ListResponse",
    "Message",
    "ModelDetails",
    "ProcessModel",
    "ProcessResponse",
    "ProgressResponse",
    "ShowResponse",
    "ToolCall",
    "ToolCallFunction",
    "VersionResponse",
]


class ErrorResponse(WireModel):
    """``{"error": "..."}``: every failure, as a whole body or as the last NDJSON line of a stream."""

    error: str


class ModelDetails(WireModel):
    """``details`` of a model (from its config blob): format (``gguf``), family and families
    (``general.architecture``), parameter_size (``135M``), quantization_level (``Q8_0``)."""

    parent_model: str
    format: str
    family: str
    families: list[str] | None
    parameter_size: str
    quantization_level: str


class ToolCallFunction(WireModel):
    """``function`` of a tool call: ``index`` (its place among the turn's calls), ``name`` and
    ``arguments`` as a JSON object (Ollama never sends arguments as a string)."""

    index: int
    name: str
    arguments: dict[str, Any]


class ToolCall(WireModel):
    """One tool call of an assistant message: ``id`` (omitted when empty) and ``function``."""

    id: str = ""
    function: ToolCallFunction


class Message(WireModel):
    """An assistant message (or its piece in a stream): ``role``, ``content`` (always written),
    and, when present, ``thinking`` (the text of a thinking block), ``tool_calls``."""

    role: str
    content: str
    thinking: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)


class GenerateResponse(WireModel):
    """One ``/api/generate`` object. Streaming: one per piece of text (``done: false``), then the
    final one (``response`` empty when streamed). ``context`` (final object, not raw): the token
    ids of prompt and response, to send back as ``context``. Metrics on the final object only."""

    model: str
    created_at: str
    response: str
    thinking: str = ""
    done: bool
    done_reason: str = ""
    context: list[int] = Field(default_factory=list)
    total_duration: int = 0
    load_duration: int = 0
    prompt_eval_count: int = 0
    prompt_eval_duration: int = 0
    eval_count: int = 0
    eval_duration: int = 0
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatResponse(WireModel):
    """One ``/api/chat`` object: ``message`` (a piece of the assistant message when streaming,
    the whole of it otherwise), ``done``, and on the final object ``done_reason`` and metrics."""

    model: str
    created_at: str
    message: Message
    done: bool
    done_reason: str = ""
    total_duration: int = 0
    load_duration: int = 0
    prompt_eval_count: int = 0
    prompt_eval_duration: int = 0
    eval_count: int = 0
    eval_duration: int = 0


class ListModel(WireModel):
    """One ``/api/tags`` model: name and model (the display name, ``smollm2:latest``), the
    manifest's mtime, size (layers + config, bytes), digest (sha256 hex of the manifest)."""

    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails
    remote_model: str | None = None  # a remote model (kvserve.remote): Ollama's fields for one
    remote_host: str | None = None


class ListResponse(WireModel):
    """``/api/tags``: the store's models, most recently modified first."""

    models: list[ListModel]


class ShowResponse(WireModel):
    """``/api/show``: the Modelfile Ollama would print, the params as ``PARAMETER`` lines, the
    template, system prompt, license, details, the GGUF header (``model_info``: every key but
    ``general.name`` and ``tokenizer.chat_template``; arrays of more than 5 items empty unless
    ``verbose``), capabilities (``completion``, ``tools``, ``thinking``) and the manifest's mtime."""

    license: str = ""
    modelfile: str = ""
    parameters: str = ""
    template: str = ""
    system: str = ""
    details: ModelDetails
    messages: list[dict[str, Any]] = Field(default_factory=list)
    model_info: dict[str, Any]
    capabilities: list[str] = Field(default_factory=list)
    modified_at: str
    remote_model: str | None = None  # a remote model (kvserve.remote): Ollama's fields for one
    remote_host: str | None = None
    remote_check: str | None = None  # kvserve: the check run for this answer (ok / rejected / no server)
    engine: str | None = None  # kvserve: a supervised engine's command line (key-like values ***)
    engine_model: str | None = None  # kvserve: what {model} becomes in it (a Modelfile's FROM)


class ProcessModel(WireModel):
    """One ``/api/ps`` model: its size in memory (bytes: the load's measured growth, else the
    prediction), ``size_vram`` (0 on CPU), ``expires_at`` (when its keep_alive runs out; about
    year 2318 for forever, as Go's saturated time gives) and ``context_length`` (tokens per
    sequence)."""

    name: str
    model: str
    size: int
    digest: str
    details: ModelDetails
    expires_at: str
    size_vram: int
    context_length: int


class ProcessResponse(WireModel):
    """``/api/ps``: the loaded models, the one with the longest time left first."""

    models: list[ProcessModel]


class VersionResponse(WireModel):
    """``/api/version``."""

    version: str


class ProgressResponse(WireModel):
    """A status line of ``/api/pull``, ``/api/push`` and ``/api/create`` (``pulling manifest``,
    ``pulling <12 hex>`` with ``digest``, ``total`` and ``completed`` bytes, ``success``)."""

    status: str
    digest: str = ""
    total: int = 0
    completed: int = 0
