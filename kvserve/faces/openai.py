"""The OpenAI-compatible face: ``/v1/chat/completions`` (also ``/chat/completions``) and the
legacy ``/v1/completions``.

Shapes follow llama-server (000_6dcbf6b03a8c9f77.txt Examples 4, 5, 17): ``chatcmpl-`` + 32
characters, ``system_fingerprint`` = build string, ``usage.prompt_tokens_details.cached_tokens``
always present, llama.cpp's ``timings`` on the response / the finish chunk. As in llama-server,
``/completions`` without ``/v1`` is the native endpoint (the llama face), not this one.
Requests are read by :mod:`kvserve.faces.params` and the getters here; a chat completion becomes
kvserve's :class:`~kvserve.serving.chat_request.ChatRequest` (:func:`chat_request`), which the
serving layer plans (:func:`kvserve.serving.chat_plan.plan_chat`); responses and chunks are
the wire types of :mod:`kvserve.faces.openai_types`, written with ``.wire()``.

Streaming (SSE): a role-only first chunk, one chunk per text delta, a finish chunk with an
empty delta, ``finish_reason`` and ``timings``, with ``stream_options.include_usage`` a chunk
with ``"choices": []`` and ``usage``, then ``data: [DONE]``. While nothing arrives for
``--sse-ping-interval`` seconds (long prefills) the comment line ``:`` is sent. Errors found
before the response starts are plain JSON errors; after that, one ``data: {"error": ...}``
event and the stream ends without ``[DONE]``. A client that disconnects cancels its
generations (the engine aborts them).

``model`` names the model (resolved by the server state: a store name, or with ``-m`` any name,
which the one pinned model answers, as llama-server does); the response names the model that
served it. An unknown name is 404 ``model 'x' not found``. Ollama's ``keep_alive`` is accepted.

Deviations from OpenAI:
``n`` > 1 runs n independent requests (choice i uses ``seed + i`` when a seed is given).

vLLM's request details (its ``protocol.py``): ``prompt_logprobs`` k (or -1: the whole
vocabulary) on both endpoints answers, per prompt token, the token's own logprob and ``rank``
plus the k most likely tokens (``{"<id>": {"logprob", "rank", "decoded_token"}}``, null for the
first token), on each legacy choice and at the top of a chat completion; refused with a stream
(400, vLLM's text) unless 0; it needs logits at every prompt position, so the prompt is not
reused from the cache. ``rank`` is null for a token outside the reported candidates (the engine
reports the top k, not the rank of the rest). ``truncate_prompt_tokens`` k keeps the last k
prompt tokens (-1: ``max_model_len``; above it: 400 with vLLM's text). ``suffix`` on
``/v1/completions`` is fill-in-the-middle with the model's FIM tokens (:mod:`kvserve.serving.fim`,
llama-server's ``/infill`` layout); a vocabulary without them is 400 naming the missing tokens.

vLLM's server flags: ``--return-tokens-as-token-ids`` (or the request's
``return_tokens_as_token_ids``) writes every logprobs token as ``token_id:N`` (chat: the sampled
token's ``bytes`` stay its text's, each top candidate's are its ``token_id:N`` string's, as vLLM's
``_create_chat_logprobs``; legacy: ``tokens``, ``top_logprobs`` keys and ``text_offset`` count the
``token_id:N`` strings); ``--enable-force-include-usage`` ends every stream with the usage chunk
whatever ``stream_options`` says; ``--response-role`` is the answer's role (``message.role`` and the
first chunk's ``delta.role``) when the prompt ends with the generation prompt, else the role of the
message being continued (vLLM's ``get_chat_request_role``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

from fastapi import APIRouter
from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from kvserve.engine.request import (
    Request,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from kvserve.faces.chat_features import read_chat_options
from kvserve.faces.auth import caller
from kvserve.faces.api_error import ApiError
from kvserve.faces.http import json_response, read_json
from kvserve.faces.models import keep_alive_field, model_field, serve_model
from kvserve.faces.server_extensions import ProgressEvents
from kvserve.faces.openai_types import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    FunctionCall,
    CompletionTokensDetails,
    InputTokens,
    LegacyLogprobs,
    PromptLogprob,
    PromptTokensDetails,
    TextChoice,
    TextCompletion,
    TextCompletionChunk,
    Timings,
    ToolCall,
    Usage,
)
from kvserve.faces.params import (
    check_logprobs,
    get_bool,
    get_int,
    get_str,
    lora_field,
    sampling_fields,
    slot_view,
    type_error,
)
from kvserve.faces.sse import (
    ClientDisconnected,
    error_answer,
    sse_response,
    until_disconnect,
)
from kvserve.serving.chat_output import Answer, Piece, ReasoningPiece, TextPiece
from kvserve.serving.chat_plan import Plan, plan_chat, with_special_tokens
from kvserve.serving.chat_request import ChatRequest, StreamOptions
from kvserve.serving.choices import ChatEvent, ChatUsage, chat_events, run_choices
from kvserve.serving.completion_plan import plan_completion
from kvserve.serving.ids import new_id
from kvserve.serving.completion_request import CompletionRequest, Infill, Prompt
from kvserve.serving.chat_runner import Runner
from kvserve.serving.state import ServerState

__all__ = ["Plan", "build_router", "chat_plan", "chat_request", "completion_plan", "completion_request", "router"]

_MAX_N = 128
# prompts x n of one completions request (and of its render): each is an engine request. OpenAI's
# legacy completions take at most 2,048 prompts (as its embeddings' inputs); vLLM and llama-server
# set no bound, so 200,000 one-token prompts ran for minutes. Split larger batches.
MAX_ENGINE_REQUESTS = 2048
_LOGPROB_FLOOR = -9999.0  # OpenAI/vLLM's stand-in for -inf (JSON has no infinities)


def _lp(v: float) -> float:
    return v if math.isfinite(v) else _LOGPROB_FLOOR


# ------------------------------------------------------------------------ request plan


def _top_n(runner: Runner, body: dict, key: str) -> int | None:
    """``top_logprobs`` (chat) / ``logprobs`` (legacy): >= 0 and at most ``--max-logprobs``."""
    n = get_int(body, key)
    if n is not None:
        if n < 0:
            raise ApiError(400, f"Field '{key}': must be >= 0")
        check_logprobs(n, _max_logprobs(runner), runner.tokenizer.n_vocab)
    return n


def _max_logprobs(runner: Runner) -> int:
    return runner.args.max_logprobs


def _n_choices(body: dict) -> int:
    n = get_int(body, "n", 1)
    if not 1 <= n <= _MAX_N:
        raise ApiError(400, f"Field 'n': must be between 1 and {_MAX_N}")
    return n


def _stream_flags(body: dict, force_usage: bool = False) -> tuple[bool, bool]:
    """``(stream, include_usage)``; ``force_usage`` is vLLM's ``--enable-force-include-usage``
    (its ``should_include_usage``: a stream ends with the usage chunk whatever
    ``stream_options`` says)."""
    stream = get_bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise type_error("stream_options", "object", opts)
        include_usage = bool(get_bool(opts, "include_usage", False))
    return stream, include_usage or force_usage


def _token_ids_field(runner: Runner, body: dict) -> bool:
    """vLLM's ``return_tokens_as_token_ids``: the request's field, else the server's
    ``--return-tokens-as-token-ids``."""
    v = get_bool(body, "return_tokens_as_token_ids")
    return bool(getattr(runner.args, "return_tokens_as_token_ids", False) if v is None else v)


def token_id_text(token_id: int) -> str:
    """vLLM's ``format_token_id_placeholder``: ``token_id:N``."""
    return f"token_id:{token_id}"


def _prompt_logprobs_field(runner: Runner, body: dict, stream: bool) -> int | None:
    """vLLM's ``prompt_logprobs``: None (not asked, or 0 with a stream: nothing is sent), else
    the candidates per prompt token (-1 = the vocabulary); vLLM's checks and texts."""
    if body.get("prompt_logprobs") is None:
        return None
    n = get_int(body, "prompt_logprobs")
    if stream and (n > 0 or n == -1):
        raise ApiError(400, "`prompt_logprobs` are not available when `stream=True`.")
    if n < 0 and n != -1:
        raise ApiError(400, "`prompt_logprobs` must be a positive value or -1.")
    if stream:
        return None
    n = runner.tokenizer.n_vocab if n == -1 else n
    check_logprobs(n, _max_logprobs(runner), runner.tokenizer.n_vocab, prompt=True)
    return n


def _truncate_field(runner: Runner, body: dict) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: keep the last k prompt tokens (-1: ``max_model_len``)."""
    k = get_int(body, "truncate_prompt_tokens")
    if k is None:
        return None
    max_len = runner.engine.n_ctx_slot
    if k < -1:
        raise ApiError(400, "Field 'truncate_prompt_tokens': must be >= -1")
    if k <= -1:
        k = max_len
    if k > max_len:
        raise ApiError(400, f"truncate_prompt_tokens value ({k}) is greater than max_model_len ({max_len}). "
                            "Please, select a smaller truncation size.")
    return k


def chat_request(runner: Runner, body: dict) -> ChatRequest:
    """An OpenAI chat-completions body (with llama-server's and vLLM's fields) -> kvserve's
    :class:`~kvserve.serving.chat_request.ChatRequest` (ApiError 400 on bad fields, in this face's
    wording; the model's limits on logprobs and truncation are checked here too)."""
    runner.require_ready()
    if "messages" not in body or body["messages"] is None:
        raise ApiError(400, "'messages' is required")
    stream, include_usage = _stream_flags(body, bool(getattr(runner.args, "enable_force_include_usage", False)))
    n = _n_choices(body)
    logprobs = get_bool(body, "logprobs", False)
    top = _top_n(runner, body, "top_logprobs")
    if top is not None and not logprobs:
        raise ApiError(400, "top_logprobs requires logprobs to be set to true")
    # keep_alive: applied by the model lease before planning (the render route never reads it)
    req = ChatRequest(body["messages"], new_id("chatcmpl-"), model=model_field(body) or "", n=n,
                      logprobs=(top or 0) if logprobs else None)
    read_chat_options(runner.args, body, req)
    req.truncate_prompt_tokens = _truncate_field(runner, body)
    req.prompt_logprobs = _prompt_logprobs_field(runner, body, stream)
    req.template.continue_final_message, req.template.add_generation_prompt = _continuation_fields(body)
    req.sampling = sampling_fields(body, runner.tokenizer, max_tokens_keys=_CHAT_MAX_TOKENS_KEYS,
                                   max_logprobs=_max_logprobs(runner))
    req.response_format = _constraint_spec(body)
    req.skip_special_tokens, req.spaces_between_special_tokens = _special_token_fields(body)
    req.stream = StreamOptions(stream, include_usage, _return_progress(body))
    _request_fields(runner, body, req)
    return req


_CHAT_MAX_TOKENS_KEYS = ("max_completion_tokens", "max_tokens", "n_predict")


def _continuation_fields(body: dict) -> tuple[bool | None, bool | None]:
    """``(continue_final_message, add_generation_prompt)`` as sent (None: absent); both true is
    vLLM's 400."""
    cont = get_bool(body, "continue_final_message")
    add_gen = get_bool(body, "add_generation_prompt")
    if cont and add_gen:
        raise ApiError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    return cont, add_gen


def _request_fields(runner: Runner, body: dict, req: ChatRequest) -> None:
    """The slot, cache and reporting fields: ``id_slot``, ``cache_salt``, ``verbose``,
    ``return_tokens_as_token_ids``, and the caller."""
    id_slot = get_int(body, "id_slot", -1)
    req.id_slot = id_slot if id_slot is not None else -1
    req.cache_salt = get_str(body, "cache_salt") or None
    req.lora = lora_field(body)  # llama-server's per-request LoRA scales
    req.owner = caller()
    req.token_ids = _token_ids_field(runner, body)
    req.verbose = _verbose(runner, body)


def chat_plan(runner: Runner, body: dict) -> Plan:
    """Parse a chat completion request and plan it (raises ApiError 400 on bad fields; the
    serving layer's domain errors for what the model refuses)."""
    return plan_chat(runner, chat_request(runner, body))


def _verbose(runner: Runner, body: dict) -> bool:
    """llama-server's ``__verbose`` object (its ``prompt``: the rendered chat prompt) is wanted when
    the server runs with ``--verbose`` or the request sets ``"verbose": true``."""
    return bool(get_bool(body, "verbose", False) or runner.args.log_verbosity >= 5)


def _special_token_fields(body: dict) -> tuple[bool, bool]:
    """vLLM's ``skip_special_tokens`` (default true; false renders every control token) and
    ``spaces_between_special_tokens`` (accepted, no effect); 400 on a non-boolean."""
    return get_bool(body, "skip_special_tokens", True), get_bool(body, "spaces_between_special_tokens", True)


def _special_tokens(body: dict, params: SamplingParams, preserved: frozenset[int] = frozenset()) -> SamplingParams:
    """:func:`_special_token_fields` applied to ``params``, keeping the ``preserved`` control
    tokens (:func:`kvserve.serving.chat_output.preserved_token_ids`)."""
    return with_special_tokens(params, *_special_token_fields(body), preserved)


def _return_progress(body: dict) -> bool:
    """llama-server's ``return_progress``: ``prompt_progress`` chunks before the first token, in
    streams only."""
    return bool(get_bool(body, "stream", False)) and bool(get_bool(body, "return_progress", False))


def _constraint_spec(body: dict):
    """The structured-output constraint of an OpenAI-face request (any dialect), or None."""
    from kvserve.structured.spec import constraint_from_body

    return constraint_from_body(body, "openai")


def _prompt_list(prompt) -> list[Prompt]:
    """Legacy ``prompt``: a string, token ids, a list of strings, or a list of token-id lists,
    split into kvserve's prompts (checked for shape; the planner tokenizes them).

    Token lists may mix ids and strings (llama-server); strings are tokenized with special
    tokens parsed and BOS added when the vocabulary asks for it, as ``/completion`` does.
    """
    if prompt is None:
        raise ApiError(400, "'prompt' is required")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        raise type_error("prompt", "string or array", prompt)
    if not prompt:
        raise ApiError(400, "Field 'prompt': must not be empty")
    if _several(prompt):
        return [_one_prompt(p) for p in prompt]  # several prompts: strings and/or token lists
    return [_one_prompt(prompt)]  # one prompt of token ids, possibly mixed with strings


def _one_prompt(p) -> Prompt:
    """One prompt: a string, or a list of token ids and strings (400 otherwise)."""
    if isinstance(p, str):
        return p
    if not isinstance(p, list) or any(isinstance(el, bool) or not isinstance(el, (int, str)) for el in p):
        raise ApiError(400, "Field 'prompt': elements must be token ids or strings")
    return p


def _several(prompt: list) -> bool:
    """A list of prompts (strings and/or token lists), not one prompt of (mixed) token ids."""
    return any(isinstance(p, list) for p in prompt) or all(isinstance(p, str) for p in prompt)


def _prompt_count(prompt) -> int:
    """How many prompts ``prompt`` holds (as :func:`_prompt_list` splits it), before tokenizing."""
    return len(prompt) if isinstance(prompt, list) and _several(prompt) else 1


def check_request_count(n_prompts: int, n: int) -> None:
    """Refuse more than :data:`MAX_ENGINE_REQUESTS` prompts x ``n`` in one request.

    Raises:
        ApiError 400: ``Field 'prompt': 5000 prompts x n 128 = 640000 completions, more than 2048
            per request (split the request)``.
    """
    if n_prompts * n > MAX_ENGINE_REQUESTS:
        raise ApiError(400, f"Field 'prompt': {n_prompts} prompts x n {n} = {n_prompts * n} completions, "
                            f"more than {MAX_ENGINE_REQUESTS} per request (split the request)")


def completion_request(runner: Runner, body: dict, *, render: bool = False) -> CompletionRequest:
    """A legacy completions body (with llama-server's and vLLM's fields) -> kvserve's
    :class:`~kvserve.serving.completion_request.CompletionRequest` (ApiError 400 on bad fields, in
    this face's wording). ``render``: one request per prompt (``/v1/completions/render``: ``n``
    does not change the ids; the bound of :func:`check_request_count` still counts it)."""
    runner.require_ready()
    suffix = get_str(body, "suffix")
    stream, include_usage = _stream_flags(body, bool(getattr(runner.args, "enable_force_include_usage", False)))
    n = _n_choices(body)
    check_request_count(_prompt_count(body.get("prompt")), n)
    req = CompletionRequest([], new_id("cmpl-"), model=model_field(body) or "", n=1 if render else n,
                            echo=bool(get_bool(body, "echo", False)), logprobs=_top_n(runner, body, "logprobs"),
                            truncate_prompt_tokens=_truncate_field(runner, body),
                            prompt_logprobs=_prompt_logprobs_field(runner, body, stream))
    req.prompts, req.infill = _prompts_of(runner, body, suffix)
    req.refuse_empty = req.infill is None
    # OpenAI's default max_tokens for completions is 16 (llama-server uses -1).
    req.sampling, req.default_n_predict = _completion_sampling(runner, body), 16
    req.response_format = _constraint_spec(body)
    req.skip_special_tokens, req.spaces_between_special_tokens = _special_token_fields(body)
    req.stream = StreamOptions(stream, include_usage, _return_progress(body))
    id_slot = get_int(body, "id_slot", -1)
    req.id_slot = id_slot if id_slot is not None else -1
    req.cache_salt, req.owner = get_str(body, "cache_salt") or None, caller()
    req.lora = lora_field(body)  # llama-server's per-request LoRA scales
    req.token_ids = _token_ids_field(runner, body)
    return req


def _completion_sampling(runner: Runner, body: dict) -> dict:
    """The sampling fields of a legacy completion (``max_tokens`` or ``n_predict`` the limit)."""
    fields = sampling_fields(body, runner.tokenizer, max_tokens_keys=("max_tokens", "n_predict"),
                             max_logprobs=_max_logprobs(runner))
    return fields


def _prompts_of(runner: Runner, body: dict, suffix: str | None) -> tuple[list[Prompt], Infill | None]:
    """The prompts, and with a ``suffix`` the fill-in-the-middle around them (each prompt the code
    before the hole; none: one empty prefix); 400 naming the missing FIM tokens when the
    vocabulary has none."""
    if not suffix:
        return _prompt_list(body.get("prompt")), None
    from kvserve.serving.fim import fim_tokens, missing_text

    fim = fim_tokens(runner.tokenizer)
    if fim.missing:
        raise ApiError(400, f"'suffix' is not supported by this model: {missing_text(fim)}".rstrip())
    prompt = body.get("prompt")
    return (_prompt_list(prompt) if prompt not in (None, "") else [[]]), Infill(suffix)


def completion_plan(runner: Runner, body: dict, *, render: bool = False) -> Plan:
    """Parse a legacy completion request and plan it (raises ApiError 400 on bad fields; the
    serving layer's domain errors for what the model refuses)."""
    return plan_completion(runner, completion_request(runner, body, render=render))


# ------------------------------------------------------------------------ running choices


def _check_output(out: RequestOutput) -> None:
    if out.error:
        raise ApiError(500, out.error)


# ------------------------------------------------------------------------ logprobs shapes


def _chat_logprob(lp: TokenLogprob, top_n: int, token_ids: bool = False) -> ChatTokenLogprob:
    """One chat ``logprobs.content`` entry. With ``token_ids`` (vLLM's
    ``--return-tokens-as-token-ids``) every ``token`` reads ``token_id:N``; as in vLLM's
    ``_create_chat_logprobs``, the sampled token's ``bytes`` stay those of its text while each
    top candidate's ``bytes`` are those of its ``token_id:N`` string."""
    top = sorted(lp.top_logprobs, key=lambda t: t.logprob, reverse=True)[:top_n]
    if token_ids:
        tops = [ChatTopLogprob(token=(tt := token_id_text(t.id)), logprob=_lp(t.logprob), bytes=list(tt.encode()))
                for t in top]
        return ChatTokenLogprob(token=token_id_text(lp.id), logprob=_lp(lp.logprob), bytes=list(lp.bytes),
                                top_logprobs=tops)
    return ChatTokenLogprob(token=lp.token, logprob=_lp(lp.logprob), bytes=list(lp.bytes),
                            top_logprobs=[ChatTopLogprob(token=t.token, logprob=_lp(t.logprob), bytes=list(t.bytes))
                                          for t in top])


class _LegacyLogprobs:
    """Accumulates OpenAI's legacy ``logprobs`` object (:class:`LegacyLogprobs`): tokens,
    token_logprobs, top_logprobs, text_offset (character offsets into the choice's full text,
    echo included)."""

    def __init__(self, top_n: int, offset: int = 0, token_ids: bool = False):
        self.top_n = top_n
        self.offset = offset
        self.token_ids = token_ids  # vLLM's --return-tokens-as-token-ids: "token_id:N" (offsets count them)
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict | None] = []
        self.text_offset: list[int] = []

    def add(self, lp: TokenLogprob | None, token_text: str | None = None, token_id: int | None = None) -> None:
        text = lp.token if lp is not None else (token_text or "")
        if self.token_ids and (lp is not None or token_id is not None):
            text = token_id_text(lp.id if lp is not None else token_id)
        self.tokens.append(text)
        self.text_offset.append(self.offset)
        self.offset += len(text)
        if lp is None:
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
            return
        self.token_logprobs.append(_lp(lp.logprob))
        top = sorted(lp.top_logprobs, key=lambda t: t.logprob, reverse=True)[: self.top_n]
        self.top_logprobs.append({(token_id_text(t.id) if self.token_ids else t.token): _lp(t.logprob) for t in top})

    def result(self) -> LegacyLogprobs:
        """The entries so far as the wire object."""
        return LegacyLogprobs(tokens=self.tokens, token_logprobs=self.token_logprobs,
                              top_logprobs=self.top_logprobs, text_offset=self.text_offset)

    def take(self) -> LegacyLogprobs:
        """The entries so far (for one stream chunk), then start over at the current offset."""
        d = self.result()
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return d


def vllm_prompt_logprobs(plp: list[TokenLogprob | None], k: int) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs`` list: per prompt token (null for the first) a dict keyed by
    token id (a string in JSON): the prompt token itself first, with its rank (1 = the most
    likely; null when outside the candidates the engine reported), then the ``k`` most likely
    tokens with ranks 1..k (a token both the prompt's and a candidate appears once)."""
    res: list[dict[str, PromptLogprob] | None] = []
    for lp in plp:
        if lp is None:
            res.append(None)
            continue
        top = lp.top_logprobs  # the engine's order: most likely first
        rank = next((i + 1 for i, t in enumerate(top) if t.id == lp.id), None)
        d: dict[str, PromptLogprob] = {str(lp.id): {"logprob": _lp(lp.logprob), "rank": rank,
                                                    "decoded_token": lp.token}}
        for i, t in enumerate(top[:k]):
            d[str(t.id)] = {"logprob": _lp(t.logprob), "rank": i + 1, "decoded_token": t.token}
        res.append(d)
    return res


def _add_prompt_logprobs(acc: _LegacyLogprobs, runner: Runner, req: Request, out: RequestOutput) -> None:
    plp = out.prompt_logprobs or [None] * len(req.prompt_token_ids)
    for tok, lp in zip(req.prompt_token_ids, plp):
        acc.add(lp, runner.tokenizer.token_bytes(tok).decode("utf-8", errors="replace") if lp is None else None,
                token_id=tok)


# ------------------------------------------------------------------------ responses


def _usage(outs: list[RequestOutput], n_per_prompt: int) -> Usage:
    """OpenAI's ``usage`` of a legacy completion's final outputs (a prompt counts once for its n)."""
    prompt = sum(o.num_prompt_tokens for o in outs[::n_per_prompt]) if outs else 0
    completion = sum(o.num_output_tokens for o in outs)
    cached = sum(o.num_cached_tokens for o in outs[::n_per_prompt]) if outs else 0
    return Usage(completion_tokens=completion, prompt_tokens=prompt, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _chat_usage(u: ChatUsage) -> Usage:
    """OpenAI's ``usage`` of a chat plan's counts (``completion_tokens_details`` when the reasoning
    is split)."""
    out = Usage(completion_tokens=u.completion_tokens, prompt_tokens=u.prompt_tokens,
                total_tokens=u.prompt_tokens + u.completion_tokens,
                prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens))
    if u.reasoning_tokens is not None:
        out.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=u.reasoning_tokens)
    if u.estimated:  # a remote model's upstream gave no usage (kvserve.remote): counted from the text
        out.estimated = True
    return out


def _chat_finish_reason(ev: ChatEvent) -> str:
    """OpenAI's ``finish_reason``: ``tool_calls`` when the choice called tools, else the engine's."""
    return "tool_calls" if ev.called_tools else ev.finish_reason


def _reasoning_key(runner: Runner) -> str:
    """The message's and delta's reasoning field: vLLM's ``reasoning`` under ``--reasoning-parser``,
    else llama-server's ``reasoning_content``."""
    return "reasoning" if runner.args.reasoning_parser else "reasoning_content"


def _message(runner: Runner, plan: Plan, ans: Answer) -> ChatMessage:
    """The whole answer as OpenAI's ``message``: the reasoning (:func:`_reasoning_key`) when it
    was split out, ``tool_calls`` when there are any."""
    fields: dict = {"role": plan.role, "content": ans.text}
    if ans.reasoning is not None:
        fields[_reasoning_key(runner)] = ans.reasoning
    if ans.tool_calls:
        fields["tool_calls"] = [ToolCall(type="function", function=FunctionCall(name=c.name, arguments=c.arguments),
                                         id=c.id) for c in ans.tool_calls]
    return ChatMessage(**fields)


def _delta(runner: Runner, piece: Piece) -> dict:
    """One piece as a chunk's ``delta`` object (one field: ``content``, the reasoning field,
    ``tool_calls``), validated as :class:`ChatDelta` with the chunk."""
    t = type(piece)
    if t is TextPiece:
        return {"content": piece.text}
    if t is ReasoningPiece:
        return {_reasoning_key(runner): piece.text}
    return {"tool_calls": [{"index": piece.index, "id": piece.id, "type": "function",
                            "function": {"name": piece.name, "arguments": piece.arguments}}]}


async def _complete_chat(runner: Runner, plan: Plan) -> ChatCompletion:
    """Run a non-streaming chat completion to the end (:func:`chat_events`, whole answers)."""
    n = len(plan.requests)
    chat_lps: list[list[ChatTokenLogprob]] = [[] for _ in range(n)]
    prompt_lps: list[list | None] = [None] * n
    lasts: list[ChatEvent | None] = [None] * n
    usage = None
    async for ev in chat_events(runner, plan, slot_view(plan.grammar), whole=True):
        i, out = ev.index, ev.output
        if plan.prompt_logprobs is not None and out.prompt_logprobs is not None and prompt_lps[i] is None:
            prompt_lps[i] = vllm_prompt_logprobs(out.prompt_logprobs, plan.prompt_logprobs)
        for lp in out.logprobs or []:
            chat_lps[i].append(_chat_logprob(lp, plan.logprobs or 0, plan.token_ids))
        if ev.answer is not None:
            lasts[i] = ev
        usage = ev.usage or usage
    evs = [e for e in lasts if e is not None]
    choices = []
    for i, ev in enumerate(evs):
        c = ChatChoice(finish_reason=_chat_finish_reason(ev), index=i, message=_message(runner, plan, ev.answer))
        if plan.logprobs is not None:
            c.logprobs = ChatLogprobs(content=chat_lps[i])
        choices.append(c)
    resp = ChatCompletion(choices=choices, created=plan.created, model=plan.model, system_fingerprint=runner.build_info,
                          object="chat.completion", usage=_chat_usage(usage), id=plan.response_id,
                          timings=Timings.of(evs[0].output.timings))
    if plan.prompt_logprobs is not None:
        resp.prompt_logprobs = prompt_lps[0] if prompt_lps else None
    return resp


async def complete(runner: Runner, plan: Plan) -> ChatCompletion | TextCompletion:
    """Run a non-streaming request to the end and build the response object."""
    if plan.kind == "chat":
        return await _complete_chat(runner, plan)
    texts = ["" for _ in plan.requests]
    finals: list[RequestOutput | None] = [None] * len(plan.requests)
    legacy = [_LegacyLogprobs(plan.logprobs or 0, 0, plan.token_ids) for _ in plan.requests]
    started = [False] * len(plan.requests)
    prompt_lps: list[list | None] = [None] * len(plan.requests)
    async for i, out in run_choices(runner, plan, slot_view(plan.grammar), whole=True):
        _check_output(out)
        if plan.prompt_logprobs is not None and out.prompt_logprobs is not None and prompt_lps[i] is None:
            prompt_lps[i] = vllm_prompt_logprobs(out.prompt_logprobs, plan.prompt_logprobs)
        if plan.logprobs is not None and not started[i] and plan.echo_texts[i]:
            _add_prompt_logprobs(legacy[i], runner, plan.requests[i], out)
        started[i] = True
        texts[i] += out.text
        for lp in out.logprobs or []:
            legacy[i].add(lp)
        if out.finished:
            finals[i] = out
    outs = [f for f in finals if f is not None]
    tchoices = []
    for i, out in enumerate(outs):
        tc = TextChoice(finish_reason=out.finish_reason, index=i, text=plan.echo_texts[i] + texts[i],
                        logprobs=legacy[i].result() if plan.logprobs is not None else None)
        if plan.prompt_logprobs is not None:
            tc.prompt_logprobs = prompt_lps[i]
        tchoices.append(tc)
    return TextCompletion(choices=tchoices, object="text_completion", created=plan.created, model=plan.model,
                          system_fingerprint=runner.build_info, usage=_usage(outs, plan.n), id=plan.response_id,
                          timings=Timings.of(outs[0].timings))


class _ChatSteps:
    """The choices of a chat stream's chunks: the role first, then one per piece of the answer
    (:func:`chat_events`), each with the logprobs of the tokens not reported yet."""

    def __init__(self, runner: Runner, plan: Plan):
        self.runner, self.plan = runner, plan
        self.pending: list[list[TokenLogprob]] = [[] for _ in plan.requests]

    def opening(self) -> list[ChatChunkChoice]:
        return [ChatChunkChoice(finish_reason=None, index=i, delta=ChatDelta(role=self.plan.role, content=None))
                for i in range(len(self.pending))]

    def empty(self, i: int) -> ChatChunkChoice:
        # the role went in the stream's first chunk: sent again, openai-python's stream helper
        # would concatenate it ('assistantassistant...')
        return ChatChunkChoice(finish_reason=None, index=i, delta=ChatDelta())

    def _choice(self, i: int, delta: dict, finish_reason: str | None = None) -> dict:
        """One choice of a chunk (validated as :class:`ChatChunkChoice` with the chunk: one
        validation per chunk, not three), with the logprobs of the tokens not reported yet
        (when any were asked for)."""
        c = {"finish_reason": finish_reason, "index": i, "delta": delta}
        if self.pending[i]:
            lps, self.pending[i] = self.pending[i], []
            c["logprobs"] = ChatLogprobs(content=[_chat_logprob(lp, self.plan.logprobs, self.plan.token_ids)
                                                  for lp in lps])
        return c

    def pieces(self, ev: ChatEvent) -> list[dict]:
        i, out = ev.index, ev.output
        if out.logprobs and self.plan.logprobs is not None:
            self.pending[i].extend(out.logprobs)
        return [self._choice(i, _delta(self.runner, p)) for p in ev.pieces]

    def finish(self, ev: ChatEvent) -> dict:
        return self._choice(ev.index, {}, _chat_finish_reason(ev))


class _TextSteps:
    """The choices of a legacy completion stream's chunks: text pieces (the prompt first under
    ``echo``), each with the legacy logprobs of its tokens."""

    def __init__(self, runner: Runner, plan: Plan):
        n = len(plan.requests)
        self.runner, self.plan = runner, plan
        self.legacy = [_LegacyLogprobs(plan.logprobs or 0, 0, plan.token_ids) for _ in range(n)]
        self.pending: list[list[TokenLogprob]] = [[] for _ in range(n)]
        self.started = [False] * n

    def opening(self) -> list[TextChoice]:
        return []

    def empty(self, i: int) -> TextChoice:
        return TextChoice(finish_reason=None, index=i, text="", logprobs=None)

    def _logprobs(self, i: int) -> LegacyLogprobs | None:
        if self.plan.logprobs is None:
            return None
        lps, self.pending[i] = self.pending[i], []
        for lp in lps:
            self.legacy[i].add(lp)
        return self.legacy[i].take()

    def pieces(self, i: int, out: RequestOutput) -> list[TextChoice]:
        text, plan = out.text, self.plan
        if not self.started[i]:
            self.started[i] = True
            if plan.echo_texts[i]:
                if plan.logprobs is not None:
                    _add_prompt_logprobs(self.legacy[i], self.runner, plan.requests[i], out)
                text = plan.echo_texts[i] + text
        self.pending[i].extend(out.logprobs or [])
        return [TextChoice(finish_reason=None, index=i, text=text, logprobs=self._logprobs(i))] if text else []

    def finish(self, i: int, out: RequestOutput) -> TextChoice:
        return TextChoice(finish_reason=out.finish_reason, index=i, text="",
                          logprobs=self._logprobs(i) if self.pending[i] else None)



def _chunk_maker(runner: Runner, plan: Plan):
    """``chunk(choices, **extra)``: one stream chunk of ``plan``, as a JSON object."""
    chat = plan.kind == "chat"
    make = ChatCompletionChunk if chat else TextCompletionChunk
    envelope = {"created": plan.created, "id": plan.response_id, "model": plan.model,
                "system_fingerprint": runner.build_info, "object": "chat.completion.chunk" if chat else "text_completion"}

    def chunk(choices: list, **extra) -> dict:
        return make(choices=choices, **envelope, **extra).wire()

    return chunk


def _progress(plan: Plan) -> list[ProgressEvents | None]:
    """llama-server's ``return_progress`` per choice (None: not asked for)."""
    return [ProgressEvents() if getattr(r, "return_progress", False) else None for r in plan.requests]


def stream_events(runner: Runner, plan: Plan) -> AsyncIterator[dict]:
    """The SSE events of a streaming request, as JSON objects (see the module docstring):
    :class:`ChatCompletionChunk` / :class:`TextCompletionChunk` written with ``.wire()``, their
    choices from :class:`_ChatSteps` (the serving layer's :func:`chat_events`) /
    :class:`_TextSteps`; llama-server's ``prompt_progress`` chunks (``return_progress``) before a
    choice's first token; :func:`kvserve.faces.sse.sse_response` writes them, pings, the error
    event and [DONE]."""
    return _chat_stream(runner, plan) if plan.kind == "chat" else _text_stream(runner, plan)


async def _chat_stream(runner: Runner, plan: Plan) -> AsyncIterator[dict]:
    chunk, steps, progress = _chunk_maker(runner, plan), _ChatSteps(runner, plan), _progress(plan)
    first = None
    for c in steps.opening():
        yield chunk([c])
    async for ev in chat_events(runner, plan, slot_view(plan.grammar), progress=any(progress)):
        i, out = ev.index, ev.output
        if progress[i] is not None:  # llama-server's progress chunks: an empty delta
            for prog, _timings in progress[i].feed(out):
                yield chunk([steps.empty(i)], prompt_progress=prog)
            if out.prompt_progress is not None:
                continue
        for c in steps.pieces(ev):
            yield chunk([c])
        if out.finished:
            first = first or (ev if i == 0 else None)
            yield chunk([steps.finish(ev)], timings=Timings.of(out.timings))
        if ev.usage is not None and plan.include_usage:
            yield chunk([], usage=_chat_usage(ev.usage), timings=Timings.of(first.output.timings))


async def _text_stream(runner: Runner, plan: Plan) -> AsyncIterator[dict]:
    chunk, steps, progress = _chunk_maker(runner, plan), _TextSteps(runner, plan), _progress(plan)
    finals: list[RequestOutput | None] = [None] * len(plan.requests)
    async for i, out in run_choices(runner, plan, slot_view(plan.grammar)):
        _check_output(out)
        if progress[i] is not None:  # llama-server's progress chunks: empty text
            for prog, _timings in progress[i].feed(out):
                yield chunk([steps.empty(i)], prompt_progress=prog)
        if out.prompt_progress is not None:
            continue
        for c in steps.pieces(i, out):
            yield chunk([c])
        if out.finished:
            finals[i] = out
            yield chunk([steps.finish(i, out)], timings=Timings.of(out.timings))
    outs = [f for f in finals if f is not None]
    if plan.include_usage:
        yield chunk([], usage=_usage(outs, plan.n), timings=Timings.of(outs[0].timings))


# ------------------------------------------------------------------------ routes


async def _serve(state: ServerState, http: HttpRequest, make_plan) -> Response:
    try:
        body = await read_json(http)

        async def run(runner: Runner) -> Response:
            # tokenizing, template rendering and grammar compiles are CPU work: off the event loop
            plan = await asyncio.to_thread(make_plan, runner, body)
            if plan.stream:
                return await sse_response(stream_events(runner, plan), ping_interval=state.args.sse_ping_interval,
                                          done=True, headers={"X-Accel-Buffering": "no"})
            out = (await until_disconnect(http, complete(runner, plan))).wire()
            if plan.verbose is not None:
                out["__verbose"] = plan.verbose
            return json_response(out)

        return await serve_model(state, model_field(body), keep_alive_field(body), run, http)
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as e:  # noqa: BLE001 - every failure answers with the error envelope
        return error_answer(e)


def input_tokens_plan(runner: Runner, body: dict) -> InputTokens:
    """llama-server's ``/v1/chat/completions/input_tokens``: the request is read as a chat
    completion (the same checks, rendering and tokenization; a prompt that cannot fit the context
    is a 400) and nothing runs."""
    plan = chat_plan(runner, {**body, "stream": False})
    return InputTokens(input_tokens=plan.input_tokens())


async def _count(state: ServerState, http: HttpRequest) -> Response:
    async def run(runner: Runner) -> Response:
        return json_response((await asyncio.to_thread(input_tokens_plan, runner, body)).wire())

    try:
        body = await read_json(http)
        return await serve_model(state, model_field(body), keep_alive_field(body), run, http)
    except Exception as e:  # noqa: BLE001 - every failure answers with the error envelope
        return error_answer(e)


def build_router(state: ServerState) -> APIRouter:
    """The OpenAI face's routes, bound to ``state``."""
    r = APIRouter()

    @r.post("/v1/chat/completions")
    @r.post("/chat/completions")
    async def chat_completions(http: HttpRequest) -> Response:
        return await _serve(state, http, chat_plan)

    @r.post("/v1/completions")
    async def completions(http: HttpRequest) -> Response:
        return await _serve(state, http, completion_plan)

    @r.post("/v1/chat/completions/input_tokens")
    @r.post("/chat/completions/input_tokens")
    async def chat_input_tokens(http: HttpRequest) -> Response:
        return await _count(state, http)

    return r


router = build_router  # the name the brief asked for
