"""Wire types of the llama-server face (:mod:`kvserve.faces.llama_api`): the response objects of
llama.cpp's native endpoints.

They follow llama-server's ``tools/server/README.md`` and, for field order, the real outputs in
seed 000 (``/work/shared/seeds/000_*.txt``): Example 2 (``/health``), 3 (``/props``), 6 (the
``/completion`` final result), 7 (``/tokenize``, ``/detokenize``, ``/apply-template``) and 11
(slot files). llama-server builds its JSON with nlohmann's ``ordered_json``, so key order is
insertion order, and the field order below is part of the contract. ``Timings`` and
``PromptProgress``, which the OpenAI face also writes, live in :mod:`kvserve.faces.server_extensions`
(re-exported here).

Which keys are written: see :mod:`kvserve.faces.wire` (fields without a default always; fields
with a default only when given). Build with the constructor, write with ``.wire()``.

Requests are not modelled here: they are read by :mod:`kvserve.faces.params` and the getters in
the face, because llama-server's contract includes its error texts (``Field 'temperature':
type must be number, but is string``), which field is checked first, lenient shapes (a prompt is
a string, token ids, a mix, or a list of those) and defaults that come from the server's flags;
a pydantic validation error would say something else.

``generation_settings`` (and ``/props`` ``params``) stay ``dict``: their ~50 keys are
:func:`kvserve.faces.params.params_to_dict`'s, written in one place.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import with_config
from typing_extensions import TypedDict

from kvserve.faces.server_extensions import PromptProgress, Timings
from kvserve.faces.wire import LEAF_CONFIG, WireModel

__all__ = [
    "ApplyTemplateResponse",
    "CompletionChunk",
    "CompletionResult",
    "DefaultGenerationSettings",
    "DetokenizeResponse",
    "HealthResponse",
    "Modalities",
    "PromptProgress",
    "Props",
    "PropsUpdateResponse",
    "RestoreTimings",
    "SaveTimings",
    "SlotEraseResponse",
    "SlotRestoreResponse",
    "SlotSaveResponse",
    "Timings",
    "TokenLogprobs",
    "TokenPiece",
    "TokenProbs",
    "TokenizePiecesResponse",
    "TokenizeResponse",
    "TopLogprob",
    "TopProb",
    "VersionResponse",
    "VllmTokenizeResponse",
]


# -- completion_probabilities ---------------------------------------------------------------
# TypedDicts, not models: a stream writes 1 + n_probs of them per token, and a model each costs
# ~2-3 µs to build; the enclosing model validates them (order, types, no unknown keys) at once.

@with_config(LEAF_CONFIG)
class TopLogprob(TypedDict):
    """One candidate in ``top_logprobs`` (natural log; -inf is written -9999.0)."""

    id: int
    token: str
    bytes: list[int]
    logprob: float


@with_config(LEAF_CONFIG)
class TokenLogprobs(TypedDict):
    """One ``completion_probabilities`` entry (``n_probs`` > 0): the sampled token and its top
    candidates before the sampler chain."""

    id: int
    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopLogprob]


@with_config(LEAF_CONFIG)
class TopProb(TypedDict):
    """One candidate in ``top_probs`` (a probability after the sampler chain)."""

    id: int
    token: str
    bytes: list[int]
    prob: float


@with_config(LEAF_CONFIG)
class TokenProbs(TypedDict):
    """One ``completion_probabilities`` entry with ``post_sampling_probs``: probabilities after
    the sampler chain (0 for filtered candidates)."""

    id: int
    token: str
    bytes: list[int]
    prob: float
    top_probs: list[TopProb]


# -- /completion ----------------------------------------------------------------------------

class CompletionChunk(WireModel):
    """One streamed ``/completion`` event before the last (``stop`` false, ``stop_type``
    ``none``): the new text (and ids with ``return_tokens``); with ``return_progress``, the
    events before the first token carry ``prompt_progress`` and no text."""

    index: int
    content: str
    tokens: list[int]
    stop: bool
    id_slot: int
    stop_type: str
    tokens_predicted: int
    tokens_evaluated: int
    timings: Timings | None = None  # timings_per_token (llama-server's): the timings so far
    prompt_progress: PromptProgress | None = None
    completion_probabilities: list[TokenLogprobs | TokenProbs] | None = None


class CompletionResult(WireModel):
    """The ``/completion`` final result (seed 000 Example 6 field order); the last event of a
    stream, where ``content`` is "" and ``tokens`` [].

    ``stop_type``: ``eos``, ``limit``, ``word`` (``stopping_word`` says which) or ``none``.
    ``tokens_cached``: tokens in the slot's KV after the request (the last sampled token is never
    decoded). ``completion_probabilities``: only when not streaming and ``n_probs`` > 0.
    """

    index: int
    content: str
    tokens: list[int]
    id_slot: int
    stop: bool
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    generation_settings: dict[str, Any]
    prompt: str
    has_new_line: bool
    truncated: bool
    stop_type: str
    stopping_word: str
    tokens_cached: int
    timings: Timings
    completion_probabilities: list[TokenLogprobs | TokenProbs] | None = None


# -- /tokenize, /detokenize, /apply-template, /health ---------------------------------------

@with_config(LEAF_CONFIG)
class TokenPiece(TypedDict):
    """One ``/tokenize`` ``with_pieces`` entry: the id and its text, or its byte values when they
    are not valid UTF-8 alone. A TypedDict, not a model: a large text has millions of them, and
    a model per entry costs ~3 µs more."""

    id: int
    piece: str | list[int]


class TokenizeResponse(WireModel):
    """``/tokenize``: ``{"tokens": [ids]}``."""

    tokens: list[int]


class TokenizePiecesResponse(WireModel):
    """``/tokenize`` with ``with_pieces``: ``{"tokens": [{"id", "piece"}]}``."""

    tokens: list[TokenPiece]


class VllmTokenizeResponse(WireModel):
    """``/tokenize`` asked in vLLM's shape (``prompt`` or ``messages``): vLLM's
    ``TokenizeResponse``: ``count``, ``max_model_len``, ``tokens`` and ``token_strs`` (the
    vocabulary's texts of the tokens with ``return_token_strs``, else null)."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(WireModel):
    """``/detokenize``: ``{"content": text}`` (llama-server), with ``prompt`` (vLLM's name for
    the same text) beside it when the face sets it."""

    content: str
    prompt: str | None = None


class VersionResponse(WireModel):
    """vLLM's ``GET /version``: ``{"version": the server's version}``."""

    version: str


class ApplyTemplateResponse(WireModel):
    """``/apply-template``: ``{"prompt": the rendered chat prompt}``."""

    prompt: str


class HealthResponse(WireModel):
    """``/health`` when ready: ``{"status": "ok"}`` (loading and errors use the error envelope)."""

    status: Literal["ok"]


# -- /props ---------------------------------------------------------------------------------

class DefaultGenerationSettings(WireModel):
    """``/props`` ``default_generation_settings`` (llama-server's ``get_props``): the server's
    sampling defaults (``params``: :func:`kvserve.faces.params.params_to_dict` without the
    fields llama-server leaves out of its metrics view, :data:`kvserve.serving.slots.TEXT_PARAMS`)
    and one slot's context ``n_ctx``, in that order (seed 000 Example 3)."""

    params: dict[str, Any]
    n_ctx: int


class Modalities(WireModel):
    """``/props`` ``modalities``: input kinds the model takes besides text."""

    vision: bool
    video: bool
    audio: bool


class Props(WireModel):
    """GET ``/props``: llama-server's ``get_props`` fields in its order (seed 000 Example 3).

    ``n_ctx`` is one slot's context. The flag-driven fields come from the command line:
    ``endpoint_slots`` (``--slots``/``--no-slots``), ``endpoint_props`` (``--props``),
    ``endpoint_metrics`` (``--metrics``), ``ui``/``webui`` (``--webui``/``--no-webui``), ``ui_settings``/
    ``webui_settings`` ({}: ``--ui-config`` has no effect here), ``cors_proxy_enabled``
    (``--ui-mcp-proxy``: ``/cors-proxy`` is served), ``is_sleeping`` (``--sleep-idle-seconds`` unloaded the model). llama-server's
    ``media_marker`` is left out: kvserve takes no media.
    """

    default_generation_settings: DefaultGenerationSettings
    total_slots: int
    model_alias: str
    model_path: str
    modalities: Modalities
    endpoint_slots: bool
    endpoint_props: bool
    endpoint_metrics: bool
    ui: bool
    ui_settings: dict[str, Any]
    webui: bool
    webui_settings: dict[str, Any]
    chat_template: str
    chat_template_caps: dict[str, bool]
    bos_token: str | None
    eos_token: str | None
    build_info: str
    is_sleeping: bool
    cors_proxy_enabled: bool


class PropsUpdateResponse(WireModel):
    """POST ``/props`` (with ``--props``): ``{"success": true}``."""

    success: bool


# -- /slots/{id}?action= (seed 000 Example 11) ------------------------------------------------

class SaveTimings(WireModel):
    """``timings`` of a slot save (ms)."""

    save_ms: float


class RestoreTimings(WireModel):
    """``timings`` of a slot restore (ms)."""

    restore_ms: float


class SlotSaveResponse(WireModel):
    """``action=save``: tokens saved and bytes written."""

    id_slot: int
    filename: str
    n_saved: int
    n_written: int
    timings: SaveTimings


class SlotRestoreResponse(WireModel):
    """``action=restore``: tokens restored and bytes read."""

    id_slot: int
    filename: str
    n_restored: int
    n_read: int
    timings: RestoreTimings


class SlotEraseResponse(WireModel):
    """``action=erase``: tokens dropped from the slot."""

    id_slot: int
    n_erased: int
