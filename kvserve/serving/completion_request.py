"""kvserve's own raw-prompt request: what the completion faces (OpenAI's ``/v1/completions``,
llama-server's ``/completion`` and ``/infill``, Ollama's ``/api/generate`` in raw, template and
context forms) build from their wire types and the serving layer plans
(:func:`kvserve.serving.completion_plan.plan_completion`).

A face reads its dialect's JSON (field names, types, defaults, its error texts) into a
:class:`CompletionRequest`: prompts already split by its rule (a list of several prompts, or one
mixed list) and checked for shape (texts, token ids, lists of both). What needs the vocabulary or
the context (tokenizing, token id ranges, the fill-in-the-middle layout, truncation, the limits)
is the planner's. Nothing here knows a dialect's field names or HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from kvserve.serving.chat_request import StreamOptions

__all__ = ["CompletionRequest", "Infill", "Prompt"]

#: one prompt: a text, or token ids mixed with texts (llama-server's mixed prompt; only the first
#: piece, when it is a text, gets the vocabulary's BOS)
Prompt = Union[str, list[Union[int, str]]]


@dataclass(slots=True)
class Infill:
    """Fill-in-the-middle (llama-server's ``/infill`` layout, :func:`kvserve.serving.fim.fim_prompt`):
    each of the request's prompts is the code before the hole, tokenized without BOS and without
    parsing special tokens, as this suffix is.

    Attributes:
        suffix: the code after the hole.
        extra: ``(filename, text)`` chunks of other files, before the prefix.
        prompt: text placed after the prefix (special tokens parsed), ``/infill``'s ``prompt``.
    """

    suffix: Prompt = ""
    extra: list[tuple[str, str]] = field(default_factory=list)
    prompt: str = ""


@dataclass(slots=True)
class CompletionRequest:
    """One raw-prompt request, as kvserve plans it (no dialect's field names).

    Attributes:
        prompts: one or more :data:`Prompt`; each runs ``n`` times. Texts are tokenized with the
            vocabulary's BOS and special tokens parsed (except under ``infill``).
        request_id: the response's id; engine request k is ``<request_id>-<k>``, prompt-major.
        model: the model name the request gave ("" when none).
        keep_alive: seconds to keep the model loaded after this request, as the face read it
            (None: not given, or left to the model lease).
        infill: fill-in-the-middle around the prompts (None: plain prompts).
        sampling: :class:`kvserve.engine.request.SamplingParams` fields the request sets (the rest
            are the model's defaults, see ``default_n_predict``).
        default_n_predict: the dialect's token limit when ``sampling`` sets none (OpenAI's 16 for
            legacy completions); None: the model's default.
        n_predict_is_default: ``sampling["n_predict"]`` is a bound the face applied, not the
            client's demand: capped to the room the prompt leaves instead of refused (Ollama).
        n: choices per prompt.
        seed_per_request: engine request k samples with ``seed + k`` over prompts and choices
            (the OpenAI face's rule); False: only the choices of one prompt differ, every prompt's
            first keeps the seed (llama-server's ``/completion``).
        refuse_empty: refuse a prompt with no tokens (``Field 'prompt': the prompt is empty``)
            before the engine does with its own text.
        echo: each choice's text starts with its prompt's text.
        logprobs: top candidates to report per generated token (None: no logprobs); with ``echo``
            the prompt's tokens are reported too.
        prompt_logprobs: candidates to report per prompt token (None: none); the prompt is then
            not reused from the cache.
        truncate_prompt_tokens: keep only the last k prompt tokens (None: keep all; a prompt that
            cannot fit is refused instead).
        stream: :class:`~kvserve.serving.chat_request.StreamOptions`.
        response_format: the output constraint (a :class:`kvserve.structured.spec.ConstraintSpec`),
            None for free text.
        skip_special_tokens: hide control tokens in the text.
        spaces_between_special_tokens: accepted, no effect.
        id_slot: the slot to run in (-1: any).
        cache_salt: an extra key of the prefix cache's hashes (None: none).
        lora: the LoRA adapters to apply, ``(adapter id, scale)`` pairs (llama-server's per-request
            ``lora``, adapters not listed get 0); None or empty = the runner's global scales
            (``LoraRegistry.default_lora``). Checked by ``LoraRegistry.resolve`` when planned.
        owner: the caller's id (:attr:`kvserve.engine.request.Request.owner`).
        token_ids: write logprobs tokens as ``token_id:N``.
    """

    prompts: list[Prompt]
    request_id: str
    model: str = ""
    keep_alive: float | None = None
    infill: Infill | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    default_n_predict: int | None = None
    n_predict_is_default: bool = False
    n: int = 1
    seed_per_request: bool = True
    refuse_empty: bool = False
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    stream: StreamOptions = field(default_factory=StreamOptions)
    response_format: Any = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    id_slot: int = -1
    cache_salt: str | None = None
    owner: str | None = None
    lora: Any = None
    token_ids: bool = False
