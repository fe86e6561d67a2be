"""Admitting engine requests: the one place a request is checked and normalized against the
loaded model before it reaches the engine (:func:`admit`).

Every face's request becomes engine :class:`~kvserve.engine.request.Request` objects in the
planners (:func:`kvserve.serving.chat_plan.plan_chat`,
:func:`kvserve.serving.completion_plan.plan_completion`), which admit them here before any
response starts; ``kvserve.LLM`` (no server) admits its requests here too. What is checked
where:

- a field's JSON type and range: the face, while reading its wire types
  (:mod:`kvserve.faces.params`);
- a sampling value's range: :class:`~kvserve.engine.request.SamplingParams` itself (its
  ``__post_init__``), when the planner builds the request's parameters;
- the prompt and its limit against the model (empty prompt, token ids outside the vocabulary,
  prompt plus ``n_predict`` beyond the slot's context) and the ``id_slot``: :func:`admit`,
  which also caps a server-default ``n_predict`` to the context's room.

The engine checks the same prompt invariants again when a request arrives
(:func:`kvserve.engine.request.check_prompt`, cheap and read-only); it never changes a
request's parameters.
"""

from __future__ import annotations

import dataclasses

from kvserve.engine.request import Request, SamplingParams, check_prompt
from kvserve.errors import InvalidInputError

__all__ = ["admit", "fit_default_n_predict"]


def fit_default_n_predict(params: SamplingParams, n_prompt: int, n_ctx_slot: int) -> SamplingParams:
    """``params`` with a server-default ``n_predict`` (``params.n_predict_default``) larger than
    the room the prompt leaves in the slot's context capped to that room, as vLLM's
    ``get_max_tokens`` does (``min(default, max_model_len - prompt_len)``); a request's own
    ``n_predict`` is left for :func:`~kvserve.engine.request.check_prompt` to refuse.

    Args:
        n_prompt: the prompt's length [tokens]; n_ctx_slot: one sequence's context [tokens].
    """
    if (params.n_predict_default and params.n_predict > 0 and n_prompt < n_ctx_slot
            and n_prompt + params.n_predict > n_ctx_slot):
        return dataclasses.replace(params, n_predict=n_ctx_slot - n_prompt)
    return params


def admit(request: Request, *, n_ctx_slot: int, n_vocab: int, n_slots: int | None = None) -> None:
    """Check and normalize ``request`` for a model before it is submitted (it is still the
    caller's: this is the one place its ``params`` are replaced, by
    :func:`fit_default_n_predict`).

    Args:
        n_ctx_slot: one sequence's context [tokens]; n_vocab: the model's vocabulary size (the
            logits' width); n_slots: the server's slots (None: no ``id_slot`` to check).

    Raises:
        InvalidRequestError / ContextSizeExceededError: the prompt is empty, has a token id
            outside the vocabulary, or cannot fit with its ``n_predict``
            (:func:`~kvserve.engine.request.check_prompt`'s texts).
        InvalidInputError: ``Invalid id_slot: N`` for a slot the server does not have.
    """
    n = len(request.prompt_token_ids)
    request.params = fit_default_n_predict(request.params, n, n_ctx_slot)
    check_prompt(request.prompt_token_ids, request.params.n_predict, n_ctx_slot, n_vocab)
    if n_slots is not None and request.priority_slot >= n_slots:
        raise InvalidInputError(f"Invalid id_slot: {request.priority_slot}")
