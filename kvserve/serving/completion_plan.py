"""A :class:`~kvserve.serving.completion_request.CompletionRequest` -> a
:class:`~kvserve.serving.chat_plan.Plan` of kind ``"text"``, for any face
(:func:`plan_completion`).

What the plan decides, with the loaded model in hand:

- the prompts' token ids: texts tokenized (BOS on the first text piece when the vocabulary asks
  for it, special tokens parsed), token ids checked against the vocabulary, a prompt whose text
  alone cannot fit the context refused before tokenizing (unless it is to be truncated);
  fill-in-the-middle laid out with the model's FIM tokens (:mod:`kvserve.serving.fim`);
  truncation to the last k tokens when asked.
- the sampling parameters: the model's defaults, the dialect's default limit, the request's
  fields, logprobs (with ``echo``, the prompt's too) and the detokenizer's rules.
- the engine requests: one per prompt and choice, each with its own constraint, admitted now
  (:func:`kvserve.serving.admission.admit`) so a stream never starts for a request the engine
  would refuse.

Errors are :mod:`kvserve.errors`' domain errors (a face maps them to its envelope).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from kvserve.engine.request import SamplingParams
from kvserve.errors import InvalidInputError
from kvserve.serving.chat_output import OutputMode
from kvserve.serving.chat_plan import (
    Plan,
    apply_sampling,
    constraint_factory,
    engine_requests,
    grammar_text,
    truncate_ids,
    validate_requests,
    with_prompt_logprobs,
    with_special_tokens,
)
from kvserve.serving.completion_request import CompletionRequest, Infill, Prompt

if TYPE_CHECKING:
    from kvserve.serving.chat_runner import Runner

__all__ = ["plan_completion", "prompt_ids"]


def _tokenize(tok, prompt: Prompt, *, add_special: bool, parse_special: bool) -> list[int]:
    """One prompt's token ids: texts encoded (only a first text piece gets BOS, as llama-server's
    ``tokenize_mixed``), ids kept."""
    if isinstance(prompt, str):
        return tok.encode(prompt, add_special=add_special, parse_special=parse_special)
    ids: list[int] = []
    for k, piece in enumerate(prompt):
        if isinstance(piece, str):
            ids += tok.encode(piece, add_special=add_special and k == 0, parse_special=parse_special)
        else:
            ids.append(piece)
    return ids


def _check_ids(ids: list[int], n_vocab: int) -> list[int]:
    """``ids`` when every id is in the vocabulary (InvalidInputError naming the first that is not)."""
    bad = next((t for t in ids if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise InvalidInputError(f"Field 'prompt': token id {bad} out of range [0, {n_vocab})")
    return ids


def _plain_ids(runner: Runner, req: CompletionRequest) -> list[list[int]]:
    """The token ids of plain prompts; a text that cannot fit is refused before tokenizing (not
    when it is to be truncated)."""
    tok, n_ctx = runner.tokenizer, runner.engine.n_ctx_slot
    out = []
    for p in req.prompts:
        if req.truncate_prompt_tokens is None:
            tok.check_fits(p, n_ctx)  # TooManyTokensError / ContextSizeExceededError
        ids = _check_ids(_tokenize(tok, p, add_special=True, parse_special=True), tok.n_vocab)
        if req.refuse_empty and not ids:
            raise InvalidInputError("Field 'prompt': the prompt is empty")
        out.append(ids)
    return out


def _infill_ids(runner: Runner, req: CompletionRequest, infill: Infill) -> list[list[int]]:
    """One fill-in-the-middle prompt per prompt (the code before the hole), laid out as
    llama-server's ``/infill`` (the face has checked that the vocabulary has FIM tokens)."""
    from kvserve.serving.fim import fim_prompt, fim_tokens

    tok, args = runner.tokenizer, runner.args
    fim = fim_tokens(tok)

    def raw(p: Prompt) -> list[int]:
        return _tokenize(tok, p, add_special=False, parse_special=False)

    suffix = raw(infill.suffix)
    middle = tok.encode(infill.prompt, add_special=False, parse_special=True) if infill.prompt else []
    return [_check_ids(fim_prompt(tok, fim, raw(p), suffix, prompt=middle, extra=infill.extra,
                                  n_batch=getattr(args, "batch_size", 2048), n_predict=getattr(args, "n_predict", -1),
                                  n_ctx=runner.engine.n_ctx_slot, spm_infill=bool(getattr(args, "spm_infill", False))),
                       tok.n_vocab)
            for p in req.prompts]


def prompt_ids(runner: Runner, req: CompletionRequest) -> list[list[int]]:
    """Every prompt's token ids as the engine gets them (tokenized or laid out, checked,
    truncated).

    Raises:
        InvalidInputError: a token id outside the vocabulary; an empty prompt (``refuse_empty``).
        TooManyTokensError / ContextSizeExceededError: a prompt that cannot fit the context.
    """
    prompts = _infill_ids(runner, req, req.infill) if req.infill is not None else _plain_ids(runner, req)
    return [truncate_ids(p, req.truncate_prompt_tokens) for p in prompts]


def _sampling(runner: Runner, req: CompletionRequest) -> SamplingParams:
    """The engine's sampling parameters: the model's defaults (with the dialect's default limit),
    the request's fields, logprobs (the prompt's too with ``echo``) and the detokenizer's rules."""
    defaults = runner.default_params
    fields = dict(req.sampling)
    if "n_predict" in fields:
        fields["n_predict_default"] = req.n_predict_is_default
    elif req.default_n_predict is not None:
        defaults = dataclasses.replace(defaults, n_predict=req.default_n_predict)
    params = apply_sampling(defaults, fields)
    if req.logprobs is not None:
        params = dataclasses.replace(params, n_probs=max(req.logprobs, 1))
        if req.echo:  # prompt logprobs need logits at every prompt position: no prefix reuse
            params = dataclasses.replace(params, prompt_logprobs=max(req.logprobs, 1), cache_prompt=False)
    params = with_prompt_logprobs(params, req.prompt_logprobs)
    return with_special_tokens(params, req.skip_special_tokens, req.spaces_between_special_tokens)


def plan_completion(runner: Runner, req: CompletionRequest) -> Plan:
    """Plan ``req`` on ``runner``: tokenize, constrain, build and check the engine requests.

    Raises:
        ServerFaultError: the runner's engine died or was unloaded.
        NotSupportedError: an encoder (it generates no text).
        InvalidInputError: a bad token id, an empty prompt, a constraint that does not compile, a
            value the sampler refuses, an unknown slot.
        TooManyTokensError / ContextSizeExceededError: a prompt cannot fit the context.
    """
    runner.require_ready()
    runner.require_generative()
    prompts = prompt_ids(runner, req)
    params = _sampling(runner, req)
    spec = req.response_format
    make = constraint_factory(runner, spec, "", OutputMode(), -1) if spec is not None else None
    reqs = engine_requests(runner, req.request_id, prompts, params, req.n, make, id_slot=req.id_slot,
                           cache_salt=req.cache_salt, owner=req.owner, return_progress=req.stream.return_progress,
                           seed_per_request=req.seed_per_request, lora=req.lora)
    validate_requests(runner, reqs)
    echo_texts = [runner.tokenizer.decode(r.prompt_token_ids) if req.echo else "" for r in reqs]
    return Plan("text", req.request_id, int(time.time()), runner.model_alias, reqs, req.n, req.stream.stream,
                req.stream.include_usage, req.logprobs, echo_texts, grammar=grammar_text(runner, spec),
                prompt_logprobs=req.prompt_logprobs, token_ids=req.token_ids)
