"""llama-server's native endpoints (seed Examples 2, 3, 6, 7, 8, 12, 15, 17).

GET /health /v1/health /v1/models /models /v1/models/{id} /props /slots /metrics; POST /props
/completion /completions /infill /tokenize /detokenize /apply-template /slots/{id};
/embedding(s), /v1/embeddings and /rerank are in :mod:`kvserve.faces.embeddings`.
vLLM's ``GET /version`` and ``GET|POST /ping`` live here too, and ``/tokenize`` also takes vLLM's
request shape (``prompt`` or ``messages``, ``add_special_tokens``, ``return_token_strs``) and then
answers vLLM's ``count``, ``max_model_len``, ``tokens``, ``token_strs``; ``/detokenize`` answers
llama-server's ``content`` and vLLM's ``prompt``.

``/infill`` is llama-server's: ``input_prefix``, ``input_suffix``, ``input_extra``
(``[{"filename", "text"}]``) and ``prompt`` laid out with the model's FIM tokens
(:mod:`kvserve.serving.fim`), then run as ``/completion`` (same fields, same answer); a vocabulary
without them is 501 ``Infill is not supported by this model: prefix token is missing. ...``.

Each handler only translates: request JSON (read by :mod:`kvserve.faces.params` and the getters
here) -> engine Request -> output -> a wire type of :mod:`kvserve.faces.llama_types`, written
with ``.wire()`` as JSON or SSE. The model is the body's
``model`` (``?model=`` on GET /props, /slots, /metrics and POST /slots/{id}), resolved by the
server state (:mod:`kvserve.faces.models`); a request that names none gets the default model.

``/completion`` reads ``grammar`` (GBNF), ``json_schema`` and ``response_format``
(:func:`kvserve.structured.spec.constraint_from_body`); each prompt's Request gets its
own matcher, and ``generation_settings.grammar`` shows the grammar used.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from dataclasses import dataclass, field

from fastapi import APIRouter
from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from kvserve.engine.request import Request, RequestOutput, SamplingParams, TokenLogprob
from kvserve.errors import UnavailableError
from kvserve.faces.auth import caller
from kvserve.faces.api_error import ApiError
from kvserve.faces.limits import batch_cap, check_count, check_input_bytes, input_bytes_cap
from kvserve.faces.http import json_response, read_json
from kvserve.faces.llama_types import (
    ApplyTemplateResponse,
    CompletionChunk,
    CompletionResult,
    DefaultGenerationSettings,
    DetokenizeResponse,
    HealthResponse,
    Modalities,
    PromptProgress,
    Props,
    PropsUpdateResponse,
    RestoreTimings,
    SaveTimings,
    SlotEraseResponse,
    SlotRestoreResponse,
    SlotSaveResponse,
    Timings,
    TokenizePiecesResponse,
    TokenizeResponse,
    TokenLogprobs,
    TokenPiece,
    TokenProbs,
    TopLogprob,
    TopProb,
    VersionResponse,
    VllmTokenizeResponse,
)
from kvserve.faces.models import (
    keep_alive_field,
    model_field,
    model_json,
    models_json,
    serve_loaded,
    serve_model,
    shown_path,
)
from kvserve.faces.params import (
    get_bool,
    get_int,
    get_str,
    lora_field,
    params_to_dict,
    sampling_fields,
    type_error,
)
from kvserve.faces import route_table
from kvserve.faces.route_table import Route
from kvserve.faces.server_extensions import ProgressEvents
from kvserve.faces.sse import sse_response, until_disconnect
from kvserve.serving import metrics as metrics_mod
from kvserve.serving.chat_request import StreamOptions
from kvserve.serving.completion_plan import plan_completion
from kvserve.serving.ids import new_id
from kvserve.serving.completion_request import CompletionRequest, Infill, Prompt
from kvserve.serving.manager import KEEP_CURRENT
from kvserve.serving.chat_runner import Runner, fair_share, generate
from kvserve.serving.state import ServerState
from kvserve.structured.spec import constraint_from_body

EMBEDDINGS_OFF = "This server does not support embeddings. Start it with `--embeddings`"
PROPS_OFF = "This server does not support changing global properties. Start it with `--props`"
SLOTS_OFF = "This server does not support slots endpoint. Start it with `--slots`"
METRICS_OFF = "This server does not support metrics endpoint. Start it with `--metrics`"
SLOT_ACTIONS_OFF = "This server does not support slots action. Start it with `--slot-save-path`"

_ids = itertools.count()


# -- prompts ------------------------------------------------------------------------------

def _is_token(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def tokenize_mixed(tokenizer, prompt, *, add_special: bool, parse_special: bool = True,
                   field_name: str = "prompt", n_ctx: int | None = None) -> list[int]:
    """A prompt as a string, token ids, or a mixed list of ids and strings -> token ids.

    Only the first string piece gets the special tokens (BOS per the tokenizer's add_bos),
    as llama-server's ``tokenize_mixed`` does. A prompt object ``{"prompt_string": ...}`` is its
    string (:func:`prompt_object_text`). With ``n_ctx``, a prompt that cannot fit is
    refused from its length before tokenizing (``Tokenizer.check_fits``: TooManyTokensError).
    """
    if isinstance(prompt, dict):
        prompt = prompt_object_text(prompt, field_name)
    if n_ctx is not None and isinstance(prompt, (str, list)):
        tokenizer.check_fits(prompt, n_ctx)
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special=add_special, parse_special=parse_special)
    if isinstance(prompt, list):
        out: list[int] = []
        for i, p in enumerate(prompt):
            if _is_token(p):
                out.append(p)
            elif isinstance(p, str):
                out += tokenizer.encode(p, add_special=add_special and i == 0, parse_special=parse_special)
            else:
                raise type_error(field_name, "string, token id or an array of them", p)
        return out
    raise type_error(field_name, "string or array", prompt)


def prompt_value(prompt, field_name: str = "prompt") -> Prompt:
    """One prompt as kvserve's :data:`~kvserve.serving.completion_request.Prompt`: a string, or
    token ids mixed with strings; a prompt object is its string (:func:`prompt_object_text`).
    The types :func:`tokenize_mixed` takes, with its 400s."""
    if isinstance(prompt, dict):
        return prompt_object_text(prompt, field_name)
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list):
        raise type_error(field_name, "string or array", prompt)
    for p in prompt:  # not next(..., None): a null element is itself the bad value
        if not (_is_token(p) or isinstance(p, str)):
            raise type_error(field_name, "string, token id or an array of them", p)
    return prompt


def prompt_object_text(obj: dict, field_name: str = "prompt") -> str:
    """llama-server's prompt object ``{"prompt_string": str, "multimodal_data": [base64...]}``
    -> its string. kvserve serves text-only models, so non-empty ``multimodal_data`` is a 400
    (llama-server answers a server without ``--mmproj`` the same way).

    Raises:
        ApiError: 400 without a ``prompt_string`` string, or with multimodal data.
    """
    text = obj.get("prompt_string")
    if not isinstance(text, str):
        raise ApiError(400, f"Field '{field_name}': a prompt object needs a \"prompt_string\" string")
    if obj.get("multimodal_data"):
        raise ApiError(400, "multimodal_data: image input is not supported by this model")
    return text


def split_prompts(prompt) -> list:
    """llama-server's rule: a string, ids, a mixed list or a prompt object is one prompt; another
    array (of those) is several."""
    if isinstance(prompt, list) and prompt:
        if all(_is_token(p) for p in prompt):
            return [prompt]
        has_num = any(_is_token(p) for p in prompt)
        has_str = any(isinstance(p, str) for p in prompt)
        if has_num and has_str and all(_is_token(p) or isinstance(p, str) for p in prompt):
            return [prompt]
        return list(prompt)
    return [prompt]


# -- probabilities ------------------------------------------------------------------------

def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def token_probs(lp: TokenLogprob, post_sampling: bool) -> TokenLogprobs | TokenProbs:
    """One ``completion_probabilities`` entry in llama-server's shape: probabilities after the
    sampler chain with ``post_sampling_probs``, else logprobs."""
    if post_sampling:
        return TokenProbs(id=lp.id, token=lp.token, bytes=lp.bytes, prob=math.exp(lp.logprob),
                          top_probs=[TopProb(id=t.id, token=t.token, bytes=t.bytes, prob=math.exp(t.logprob))
                                     for t in lp.top_logprobs])
    return TokenLogprobs(id=lp.id, token=lp.token, bytes=lp.bytes, logprob=_finite(lp.logprob),
                         top_logprobs=[TopLogprob(id=t.id, token=t.token, bytes=t.bytes, logprob=_finite(t.logprob))
                                       for t in lp.top_logprobs])


# -- /completion --------------------------------------------------------------------------

@dataclass
class _Completion:
    """What one /completion task accumulates from its outputs."""

    index: int
    prompt_text: str
    prompt_ids: list[int]
    request: Request
    content: str = ""
    tokens: list[int] = field(default_factory=list)
    probs: list[TokenLogprobs | TokenProbs] = field(default_factory=list)
    last: RequestOutput | None = None

    def add(self, out: RequestOutput, post_sampling: bool) -> None:
        self.content += out.text
        self.tokens += out.new_token_ids
        if out.logprobs:
            self.probs += [token_probs(lp, post_sampling) for lp in out.logprobs]
        self.last = out


async def completion(state: ServerState, http: HttpRequest) -> Response:
    """POST /completion and /completions: find the model, then :class:`CompletionHandler`."""
    body = await read_json(http)
    return await serve_model(state, model_field(body), keep_alive_field(body),
                             lambda runner: CompletionHandler(runner).serve(http, body), http)


class CompletionHandler:
    """One /completion request on one model's runner: one or more prompts, streaming or not."""

    def __init__(self, runner: Runner):
        self.runner = runner

    def _build(self, body: dict, infill: tuple[Prompt, Infill] | None = None) \
            -> tuple[list[_Completion], SamplingParams, dict]:
        runner = self.runner
        tok = runner.tokenizer
        if infill is None and ("prompt" not in body or body["prompt"] is None):
            raise ApiError(400, '"prompt" must be provided')
        sampling = sampling_fields(body, tok, max_tokens_keys=("n_predict", "max_tokens"),
                                   max_logprobs=runner.args.max_logprobs)
        id_slot = get_int(body, "id_slot", -1)
        opts = {
            "stream": bool(get_bool(body, "stream", False)),
            "return_tokens": bool(get_bool(body, "return_tokens", False)),
            "id_slot": id_slot if id_slot is not None and id_slot >= 0 else -1,
            "constraint": constraint_from_body(body, "llama"),
            "grammar": "",
        }
        # llama-server's return_progress: prompt_progress events, in streams only
        opts["return_progress"] = opts["stream"] and bool(get_bool(body, "return_progress", False))
        # llama-server's timings_per_token: every streamed event carries the timings so far
        opts["response_fields"] = response_fields(body)
        opts["timings_per_token"] = opts["stream"] and bool(get_bool(body, "timings_per_token", False))
        prompts = [infill[0]] if infill is not None else split_prompts(body["prompt"])
        check_count("prompt", len(prompts), batch_cap(runner.args), "prompts", "--max-batch-inputs")
        prompts = [prompt_value(p) for p in prompts]
        req = CompletionRequest(prompts, new_id("cmpl-"), sampling=sampling,
                                infill=infill[1] if infill is not None else None, seed_per_request=False,
                                response_format=opts["constraint"], id_slot=opts["id_slot"],
                                stream=StreamOptions(opts["stream"], False, opts["return_progress"]),
                                cache_salt=get_str(body, "cache_salt") or None, owner=caller(),
                                lora=lora_field(body))
        plan = plan_completion(runner, req)  # tokenizing and grammar compiles: the caller runs this off the loop
        opts["grammar"] = plan.grammar
        opts["lora"] = plan.requests[0].lora
        tasks = [_Completion(i, p if isinstance(p, str) and infill is None else tok.decode(r.prompt_token_ids),
                             r.prompt_token_ids, r) for i, (p, r) in enumerate(zip(prompts, plan.requests))]
        return tasks, plan.requests[0].params, opts

    def final_json(self, c: _Completion, params: SamplingParams, opts: dict, *, stream: bool) -> CompletionResult:
        """The final result object (Example 6 field order)."""
        out = c.last
        assert out is not None
        if out.error:
            raise ApiError(500, out.error)
        n_pred = out.num_output_tokens
        res = CompletionResult(
            index=c.index,
            content="" if stream else c.content,
            tokens=[] if stream or not opts["return_tokens"] else c.tokens,
            id_slot=c.request.priority_slot,
            stop=True,
            model=self.runner.model_alias,
            tokens_predicted=n_pred,
            tokens_evaluated=out.num_prompt_tokens,
            generation_settings=params_to_dict(params, stream=opts["stream"], grammar=opts["grammar"],
                                               lora=getattr(c.request, "lora", ())),
            prompt=c.prompt_text,
            has_new_line="\n" in c.content,
            truncated=out.truncated,
            stop_type=out.stop_type if out.stop_type != "abort" else "none",
            stopping_word=out.stopping_word,
            # tokens in the slot's KV: the last sampled token is never decoded
            tokens_cached=out.num_prompt_tokens + max(n_pred - 1, 0),
            timings=Timings.of(out.timings),
        )
        if params.n_probs > 0 and not stream:
            res.completion_probabilities = c.probs
        return res

    def _params_view(self, params: SamplingParams, opts: dict) -> dict:
        return params_to_dict(params, grammar=opts["grammar"], lora=opts.get("lora", ()))

    async def run_one(self, c: _Completion, params: SamplingParams, opts: dict) -> None:
        """Drive one task to its end (non-streaming)."""
        async for out in generate(self.runner, c.request, self._params_view(params, opts), whole=True):
            c.add(out, params.post_sampling_probs)

    async def serve(self, http: HttpRequest, body, infill: tuple[Prompt, Infill] | None = None) -> Response:
        """Answer ``body`` (with ``infill``: /infill's prefix and fill-in-the-middle parts)."""
        self.runner.require_ready()
        tasks, params, opts = await asyncio.to_thread(self._build, body, infill)  # tokenizing: off the loop
        if opts["stream"]:
            if len(tasks) != 1:
                raise ApiError(400, "streaming supports one prompt per request")
            return await sse_response(self._stream(tasks[0], params, opts), done=False,
                                      ping_interval=self.runner.args.sse_ping_interval)
        gate = fair_share(self.runner)

        async def run_gated(c: _Completion) -> None:
            async with gate:
                await self.run_one(c, params, opts)

        async def run_all():
            await asyncio.gather(*(run_gated(c) for c in tasks))

        await until_disconnect(http, run_all())
        results = [nested_values(opts["response_fields"], self.final_json(c, params, opts, stream=False).wire())
                   for c in tasks]
        return json_response(results[0] if len(results) == 1 else results)

    def _progress_chunk(self, c: _Completion, prog: PromptProgress, timings: Timings | None) -> dict:
        chunk = CompletionChunk(index=c.index, content="", tokens=[], stop=False, id_slot=c.request.priority_slot,
                                stop_type="none", tokens_predicted=0, tokens_evaluated=prog.total)
        if timings is not None:
            chunk.timings = timings
        chunk.prompt_progress = prog
        return chunk.wire()

    async def _stream(self, c: _Completion, params: SamplingParams, opts: dict):
        """The stream's events. With ``return_progress`` (llama-server's): before the first token,
        one event at 0% (``processed`` = ``cache``), one per prompt chunk the engine ran, and one
        at 100% (``processed`` = ``total``)."""
        progress = ProgressEvents() if opts["return_progress"] else None
        per_token = opts["timings_per_token"]
        async for out in generate(self.runner, c.request, self._params_view(params, opts)):
            if progress is not None:
                for prog, timings in progress.feed(out):
                    yield self._progress_chunk(c, prog, Timings.of(timings) if per_token else None)
            if out.prompt_progress is not None:
                continue
            c.add(out, params.post_sampling_probs)
            if out.text or (out.logprobs and params.n_probs > 0):
                chunk = CompletionChunk(index=c.index, content=out.text,
                                        tokens=out.new_token_ids if opts["return_tokens"] else [],
                                        stop=False, id_slot=c.request.priority_slot, stop_type="none",
                                        tokens_predicted=out.num_output_tokens,
                                        tokens_evaluated=out.num_prompt_tokens)
                if per_token:
                    chunk.timings = Timings.of(out.timings)
                if params.n_probs > 0 and out.logprobs:
                    chunk.completion_probabilities = [token_probs(lp, params.post_sampling_probs)
                                                      for lp in out.logprobs]
                yield chunk.wire()
            if out.finished:
                yield nested_values(opts["response_fields"], self.final_json(c, params, opts, stream=True).wire())


def response_fields(body: dict) -> list[str]:
    """llama-server's ``response_fields``: paths (``"a/b"``: member ``b`` of member ``a``) of the
    final result to return instead of the whole result; [] (absent or null) returns it all.
    Raises ApiError 400 when it is not an array of strings."""
    v = body.get("response_fields")
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(p, str) for p in v):
        raise ApiError(400, "'response_fields' must be an array of strings")
    return v


def nested_values(paths: list[str], result: dict) -> dict:
    """llama-server's ``json_get_nested_values``: ``{path: value}`` for each of ``paths`` found in
    ``result`` (split on ``/``), in the order given; paths not found are left out. No paths:
    ``result`` itself."""
    if not paths:
        return result
    out: dict = {}
    for path in paths:
        cur, found = result, True
        for k in path.split("/"):
            if isinstance(cur, dict) and k in cur:
                cur = cur[k]
            else:
                found = False
                break
        if found:
            out[path] = cur
    return out


async def infill(state: ServerState, http: HttpRequest) -> Response:
    """POST /infill: llama-server's checks and texts, the FIM prompt, then /completion."""
    body = await read_json(http)

    async def run(runner: Runner) -> Response:
        runner.require_ready()
        return await CompletionHandler(runner).serve(http, body, infill_parts(runner, body))

    return await serve_model(state, model_field(body), keep_alive_field(body), run, http)


def infill_parts(runner: Runner, body: dict) -> tuple[Prompt, Infill]:
    """The prefix and the fill-in-the-middle parts of an ``/infill`` request (llama-server's
    ``handle_infill`` checks, in its order and with its texts; the planner lays them out with
    :func:`kvserve.serving.fim.fim_prompt`).

    Raises:
        ApiError: 501 when the vocabulary has no FIM tokens; 400 for a bad field.
    """
    from kvserve.serving.fim import fim_tokens, missing_text

    fim = fim_tokens(runner.tokenizer)
    if fim.missing:
        raise ApiError(501, f"Infill is not supported by this model: {missing_text(fim)}")
    if "prompt" in body and not isinstance(body["prompt"], str):
        raise ApiError(400, '"prompt" must be a string')
    for key in ("input_prefix", "input_suffix"):
        if key not in body:
            raise ApiError(400, f'"{key}" is required')
    extra = body.get("input_extra", [])
    if not isinstance(extra, list):
        raise ApiError(400, '"input_extra" must be an array of {"filename": string, "text": string}')
    chunks = []
    for c in extra:
        if not isinstance(c, dict) or not isinstance(c.get("text"), str):
            raise ApiError(400, 'extra_context chunk must contain a "text" field with a string value')
        if "filename" in c and not isinstance(c["filename"], str):
            raise ApiError(400, 'extra_context chunk\'s "filename" field must be a string')
        chunks.append((c.get("filename", "tmp"), c["text"]))
    prefix = prompt_value(body["input_prefix"], "input_prefix")
    suffix = prompt_value(body["input_suffix"], "input_suffix")
    return prefix, Infill(suffix, chunks, body.get("prompt") or "")


def vllm_tokenize(runner: Runner, body: dict) -> VllmTokenizeResponse:
    """``/tokenize`` in vLLM's shape (its ``TokenizeCompletionRequest`` / ``TokenizeChatRequest``):
    ``prompt`` tokenized with ``add_special_tokens`` (default true), or ``messages`` rendered
    with the chat template (``add_generation_prompt`` default true, ``continue_final_message``,
    ``tools``, ``chat_template_kwargs``) and tokenized with ``add_special_tokens`` (default
    false: the template writes its own BOS)."""
    tok = runner.tokenizer
    n_ctx = runner.engine.n_ctx_slot
    if "messages" in body and body.get("prompt") is None:
        if runner.template is None:
            raise ApiError(500, "the model has no chat template")
        from kvserve.faces.chat_features import parse_tools, prompt_messages, request_chat_template, template_kwargs
        from kvserve.serving.chat_plan import render_prompt, with_request_template

        tools = parse_tools(body.get("tools"))
        # vLLM's TokenizeChatRequest takes chat_template too, under the same trust rule
        runner = with_request_template(runner, request_chat_template(runner.args, body))
        text, ids = render_prompt(runner, prompt_messages(runner, body),
                                  add_generation_prompt=get_bool(body, "add_generation_prompt", True),
                                  tools=tools,
                                  continue_final_message=bool(get_bool(body, "continue_final_message", False)),
                                  variables=template_kwargs(runner.args, body, runner.template, tools))
        if get_bool(body, "add_special_tokens", False):
            ids = tok.encode(text, add_special=True, parse_special=True)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise type_error("prompt", "string", prompt)
        ids = tok.encode(prompt, add_special=bool(get_bool(body, "add_special_tokens", True)), parse_special=True)
    strs = [tok.token_text(t) for t in ids] if get_bool(body, "return_token_strs", False) else None
    return VllmTokenizeResponse(count=len(ids), max_model_len=n_ctx, tokens=ids, token_strs=strs)


# -- the router ---------------------------------------------------------------------------

def props_json(runner: Runner, *, is_sleeping: bool = False) -> Props:
    """GET /props (llama-server's ``get_props``, seed 000 Example 3) of one model's runner; the
    flag-driven fields from its ServerArgs (see :class:`~kvserve.faces.llama_types.Props`)."""
    from kvserve.serving.slots import metrics_params

    runner.require_ready()
    args, tok, tmpl = runner.args, runner.tokenizer, runner.template
    webui = bool(getattr(args, "webui", True))
    return Props(
        default_generation_settings=DefaultGenerationSettings(
            params=metrics_params(params_to_dict(runner.default_params)), n_ctx=runner.engine.n_ctx_slot),
        total_slots=runner.engine.n_slots,
        model_alias=runner.model_alias,
        model_path=shown_path(args, runner.model_path, runner.model_alias),
        modalities=Modalities(vision=False, video=False, audio=False),
        endpoint_slots=args.slots,
        endpoint_props=args.props,
        endpoint_metrics=args.metrics,
        ui=webui,
        ui_settings={},
        webui=webui,
        webui_settings={},
        chat_template=tmpl.source if tmpl else "",
        chat_template_caps=dict(tmpl.caps) if tmpl else {},
        bos_token=tok.bos_token if tok else "",  # a remote model (kvserve.remote): no tokenizer here
        eos_token=tok.eos_token if tok else "",
        build_info=runner.build_info,
        is_sleeping=is_sleeping,
        cors_proxy_enabled=bool(getattr(runner.args, "ui_mcp_proxy", False)),
    )


def _asleep(state: ServerState) -> bool:
    """The ``-m`` model was unloaded by ``--sleep-idle-seconds`` (a request loads it again)."""
    if not state.pinned or getattr(state.args, "sleep_idle_seconds", -1) < 0 or state.preloading:
        return False
    try:
        return state.peek(None) is None
    except Exception:  # noqa: BLE001 - not resolvable yet: not asleep
        return False


def slots_debug() -> bool:
    """llama-server's ``LLAMA_SERVER_SLOTS_DEBUG`` (any value but "" and "0"): ``GET /slots``
    shows full ``params`` and the last request's ``prompt`` and ``generated`` texts."""
    import os

    return os.environ.get("LLAMA_SERVER_SLOTS_DEBUG", "") not in ("", "0")


# -- the routes: one function each, then the table ----------------------------------------

def query_model(http: HttpRequest) -> str | None:
    """The ``?model=`` of a GET /props, /slots, /metrics or POST /slots/{id} (None: the default)."""
    return model_field(dict(http.query_params))


async def health(state: ServerState, http: HttpRequest) -> Response:
    """GET /health and /v1/health: 200 ``{"status": "ok"}``, 503 while the start-up model loads."""
    state.require_up()
    return json_response(HealthResponse(status="ok").wire())


async def models(state: ServerState, http: HttpRequest) -> Response:
    """GET /models and /v1/models: the served models (llama-server's and OpenAI's lists in one)."""
    return json_response(await asyncio.to_thread(models_json, state))


async def model(state: ServerState, http: HttpRequest) -> Response:
    """GET /v1/models/{model_id}: one model (the id may hold slashes)."""
    model_id = http.path_params["model_id"]
    state.require_up()
    return json_response(model_json(state, model_id))


class PropsRoute:
    """GET /props: the model's :func:`props_json`. llama-server answers /props without waking a
    sleeping server (``is_sleeping: true``): the pinned model's answer as it loaded is kept for that
    (one per router, fed by ``state.on_loaded``)."""

    def __init__(self, state: ServerState):
        self.state = state
        self.last_props: dict[str, dict] = {}  # the pinned model's /props as it loaded, answered while it sleeps
        state.on_loaded.append(self.remember_props)

    def remember_props(self, runner: Runner) -> None:
        if self.state.pinned and not getattr(runner.spec, "remote", False):
            self.last_props["pinned"] = props_json(runner).wire()

    async def __call__(self, http: HttpRequest) -> Response:
        state, last_props = self.state, self.last_props
        # llama-server answers /props without waking a sleeping server (is_sleeping: true)
        name = query_model(http)
        if name is None and _asleep(state) and "pinned" in last_props:
            state.require_up()
            return json_response({**last_props["pinned"], "is_sleeping": True})

        async def run(runner: Runner) -> Response:
            return json_response(props_json(runner).wire())

        if state.peek(name) is not None:
            # a loaded model's expiry stays as it was: polling /props does not keep it awake
            try:
                return await serve_loaded(state, name, run)
            except UnavailableError:  # unloaded meanwhile
                pass
        # loads the model if needed, but leaves a loaded model's keep_alive as it is
        return await serve_model(state, name, KEEP_CURRENT, run, http)


async def set_props(state: ServerState, http: HttpRequest) -> Response:
    """POST /props: 501 without ``--props``; else the body is read and ``{"success": true}``."""
    if not state.args.props:
        raise ApiError(501, PROPS_OFF)
    state.require_up()
    await read_json(http, required=False)
    return json_response(PropsUpdateResponse(success=True).wire())


async def version(state: ServerState, http: HttpRequest) -> Response:
    """GET /version (vLLM's): kvserve's version."""
    from kvserve import __version__

    return json_response(VersionResponse(version=__version__).wire())


async def ping(state: ServerState, http: HttpRequest) -> Response:
    """GET and POST /ping (vLLM's): an empty 200."""
    state.require_up()  # as /health: 503 while the start-up model loads
    return Response(status_code=200)  # vLLM answers an empty 200


async def tokenize(state: ServerState, http: HttpRequest) -> Response:
    """POST /tokenize: llama-server's ``content`` (``with_pieces``) or vLLM's ``prompt`` / ``messages``."""
    body = await read_json(http)
    field = "content" if body.get("content") is not None else "prompt"
    texts = body.get(field)  # refused before any model is asked: a 30 MB text took 21 s and +4 GB
    check_input_bytes(field, texts if isinstance(texts, list) else (texts,), input_bytes_cap(state.args))

    async def run(runner: Runner) -> Response:
        runner.require_ready()
        tok = runner.tokenizer

        def work() -> Response:  # off the event loop: 2 MiB of text takes about a second
            if body.get("content") is None and ("prompt" in body or "messages" in body):
                return json_response(vllm_tokenize(runner, body).wire())
            ids: list[int] = []
            if body.get("content") is not None:
                ids = tokenize_mixed(tok, body["content"],
                                     add_special=bool(get_bool(body, "add_special", False)),
                                     parse_special=bool(get_bool(body, "parse_special", True)),
                                     field_name="content")
            # built unvalidated (model_construct, TokenPiece entries as dict literals): the ids
            # come from the tokenizer, and a large text has millions (1e6 pieces: +4% over dumps)
            if get_bool(body, "with_pieces", False):
                pieces: list[TokenPiece] = [{"id": t, "piece": tok.piece(t)} for t in ids]
                return json_response(TokenizePiecesResponse.model_construct(tokens=pieces).wire())
            return json_response(TokenizeResponse.model_construct(tokens=ids).wire())

        return await asyncio.to_thread(work)

    return await serve_model(state, model_field(body), keep_alive_field(body), run, http)


async def detokenize(state: ServerState, http: HttpRequest) -> Response:
    """POST /detokenize: ``tokens`` -> llama-server's ``content`` and vLLM's ``prompt``."""
    body = await read_json(http)
    if isinstance(body.get("tokens"), list):  # one id per byte: the most /tokenize makes of a text it accepts
        check_count("tokens", len(body["tokens"]), input_bytes_cap(state.args), "token ids", "--max-input-bytes")

    async def run(runner: Runner) -> Response:
        runner.require_ready()
        tok = runner.tokenizer

        def work() -> Response:  # off the event loop: checking 10^7 ids takes a second
            ids = body.get("tokens") or []
            if not isinstance(ids, list) or not all(_is_token(t) for t in ids):
                raise type_error("tokens", "array of token ids", ids)
            bad = next((t for t in ids if not 0 <= t < tok.n_vocab), None)
            if bad is not None:
                raise ApiError(400, f"token id {bad} is out of range (vocabulary size {tok.n_vocab})")
            text = tok.decode(ids)
            return json_response(DetokenizeResponse(content=text, prompt=text).wire())

        return await asyncio.to_thread(work)

    return await serve_model(state, model_field(body), keep_alive_field(body), run, http)


async def apply_template(state: ServerState, http: HttpRequest) -> Response:
    """POST /apply-template: the chat template's prompt for ``messages`` (:func:`render_prompt`)."""
    body = await read_json(http)

    async def run(runner: Runner) -> Response:
        runner.require_ready()
        prompt = await asyncio.to_thread(render_prompt, runner, body)
        return json_response(ApplyTemplateResponse(prompt=prompt).wire())

    return await serve_model(state, model_field(body), keep_alive_field(body), run, http)


async def slots(state: ServerState, http: HttpRequest) -> Response:
    """GET /slots (``--slots``): the model's slot views; ``?fail_on_no_slot=1``: 503 when none is idle."""
    if not state.args.slots:
        raise ApiError(501, SLOTS_OFF)
    state.require_up()
    if query_model(http) is None and _asleep(state):
        # llama-server: every route but /health and /props wakes a sleeping server
        # (llama.cpp PR #18228), /slots too: load the -m model, then answer its slots
        async def woken(runner: Runner) -> Response:
            return json_response(runner.slots.views(show_text=state.args.slots_text or slots_debug(),
                                                    detokenize=runner.tokenizer.decode if slots_debug() else None))

        return await serve_model(state, None, KEEP_CURRENT, woken, http)
    runner = state.peek(query_model(http))  # a model that is not loaded has no slots
    fail = http.query_params.get("fail_on_no_slot", "")
    if fail not in ("", "0", "false") and (runner is None or not runner.slots.has_idle()):
        raise ApiError(503, "no slot available")
    if runner is None:
        return json_response([])
    runner.require_ready()
    debug = slots_debug()
    detok = runner.tokenizer.decode if debug else None
    return json_response(runner.slots.views(show_text=state.args.slots_text or debug, detokenize=detok))


async def slot_action(state: ServerState, http: HttpRequest) -> Response:
    """POST /slots/{id_slot}?action=save|restore|erase (``--slot-save-path``): :func:`_slot_file_action`."""
    id_slot: str = http.path_params["id_slot"]
    if not state.args.slot_save_path:
        raise ApiError(501, SLOT_ACTIONS_OFF)
    action = http.query_params.get("action", "")
    # the body is read before waiting for the model: the disconnect watch consumes messages
    body = (await read_json(http, required=False) or {}) if action in ("save", "restore") else {}

    async def run(runner: Runner) -> Response:
        runner.require_ready()
        runner.require_generative()  # an encoder has no KV cache to save, restore or erase: 501
        # ASCII digits only: int() would also take "١" (Arabic-Indic one), " 1" or "1_0"
        if not (id_slot.isascii() and id_slot.isdigit()) or len(id_slot) > 9 \
                or int(id_slot) >= len(runner.slots.slots):
            raise ApiError(400, "Invalid slot ID")
        slot = runner.slots.slots[int(id_slot)]
        if action not in ("save", "restore", "erase"):
            raise ApiError(400, "Invalid action")
        if slot.is_processing:
            raise ApiError(400, "Slot is busy")
        return json_response((await _slot_file_action(runner, slot, action, body)).wire())

    # loads the model if needed, but leaves a loaded model's keep_alive as it is
    return await serve_model(state, query_model(http), KEEP_CURRENT, run, http)


async def metrics(state: ServerState, http: HttpRequest) -> Response:
    """GET /metrics (``--metrics``): one model's llama-server lines, or every model's."""
    if not state.args.metrics:
        raise ApiError(501, METRICS_OFF)
    state.require_up()
    name = query_model(http)
    if name is not None or state.pinned:  # one model: llama-server's exact lines
        kept = state.peek_metrics(name)  # a sleeping model answers from its snapshot
        if kept is None:
            return Response(metrics_mod.render_empty(), headers=metrics_mod.response_headers())
        return Response(kept.render(), headers=metrics_mod.response_headers())
    return Response(metrics_mod.render_models(state.manager, state.kept_metrics),
                    headers=metrics_mod.response_headers())


def _lora_entries(runner: Runner) -> list[dict]:
    """llama-server's ``GET /lora-adapters`` list: ``id``, ``path``, ``scale`` (the global scale),
    ``task_name``, ``prompt_prefix`` (the GGUF's ``adapter.lora.*`` keys, "" otherwise)."""
    reg = getattr(runner, "lora", None)  # an embedding runner has none
    if reg is None:
        return []
    return [{"id": e.id, "path": e.path, "scale": e.scale, "task_name": e.adapter.task_name,
             "prompt_prefix": e.adapter.prompt_prefix} for e in reg.entries()]


async def lora_adapters(state: ServerState, http: HttpRequest) -> Response:
    """GET /lora-adapters: the model's LoRA adapters (``?model=`` picks one in router mode)."""
    async def run(runner: Runner) -> Response:
        runner.require_ready()
        return json_response(_lora_entries(runner))

    return await serve_model(state, query_model(http), KEEP_CURRENT, run, http)


async def set_lora_adapters(state: ServerState, http: HttpRequest) -> Response:
    """POST /lora-adapters ``[{"id": N, "scale": S}, ...]``: the global scales (adapters not listed get
    0, as llama-server); ``{"success": true}``. 400 (nothing changed): a body that is not an array, an
    unknown id (llama-server ignores it), a scale that is not a finite number in [-1000, 1000]."""
    from kvserve.faces.http import parse_json_body
    from kvserve.faces.params import lora_field

    body = parse_json_body(await http.body() or b"null")
    if not isinstance(body, list):
        raise ApiError(400, "Request body must be an array")
    scales = dict(lora_field({"lora": body}) or [])

    async def run(runner: Runner) -> Response:
        runner.require_ready()
        reg = getattr(runner, "lora", None)
        if reg is None:
            if scales:
                raise ApiError(400, f"invalid adapter id {next(iter(scales))}: this model has no LoRA adapters")
            return json_response({"success": True})
        reg.set_scales(scales)
        return json_response({"success": True})

    return await serve_model(state, query_model(http), KEEP_CURRENT, run, http)


GET, POST = ("GET",), ("POST",)

#: the native endpoints in Starlette's matching order (the first match wins)
ROUTES: tuple[Route, ...] = (
    Route("/v1/health", GET, health),
    Route("/health", GET, health),
    Route("/models", GET, models),
    Route("/v1/models", GET, models),
    Route("/v1/models/{model_id:path}", GET, model),
    Route("/props", GET, PropsRoute),
    Route("/props", POST, set_props),
    Route("/completion", POST, completion),
    Route("/completions", POST, completion),
    Route("/infill", POST, infill),
    Route("/version", GET, version),
    Route("/ping", POST, ping),
    Route("/ping", GET, ping),
    Route("/tokenize", POST, tokenize),
    Route("/detokenize", POST, detokenize),
    Route("/apply-template", POST, apply_template),
    Route("/slots", GET, slots),
    Route("/slots/{id_slot}", POST, slot_action),
    Route("/metrics", GET, metrics),
    Route("/lora-adapters", GET, lora_adapters),
    Route("/lora-adapters", POST, set_lora_adapters),
)


def build_router(state: ServerState) -> APIRouter:
    """The native endpoints (:data:`ROUTES`) bound to ``state``."""
    return route_table.build_router(state, ROUTES)


def _slot_filename(runner: Runner, body: dict) -> tuple[str, str]:
    """(filename, full path) of a save/restore request; 400 ``Invalid filename`` for anything
    that could leave the save directory."""
    import os

    name = body.get("filename")
    if isinstance(name, str):
        from kvserve.faces.params import check_text

        check_text(name, "filename")  # a lone surrogate: 400 naming the field
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or ".." in name \
            or "\x00" in name or name in (".",) or os.path.isabs(name):
        raise ApiError(400, "Invalid filename")
    return name, os.path.join(runner.args.slot_save_path, name)


async def _slot_file_action(runner: Runner, slot, action: str, body: dict) \
        -> SlotSaveResponse | SlotRestoreResponse | SlotEraseResponse:
    """POST /slots/{id}?action=save|restore|erase (seed Example 11).

    The engine thread only copies KV rows out (save) or in (restore) and erases; reading
    and writing the file run in a worker thread, so a slow disk or a FIFO in the slot
    folder cannot stall generation (``kvserve.engine.slot_file`` refuses anything that is
    not a regular file)."""
    import asyncio

    from kvserve.engine.slot_file import SlotFileError, read_slot_file, write_slot_file

    sid = slot.id
    engine = runner.engine
    filename, path = "", ""
    if action in ("save", "restore"):
        filename, path = _slot_filename(runner, body)
    t0 = time.perf_counter()
    try:
        if action == "save":
            hdr, tokens, layers = await asyncio.wrap_future(engine.call(lambda core: core.snapshot_slot(sid)))
            n = await asyncio.to_thread(write_slot_file, path, hdr, tokens, layers)
            res = {"n_saved": len(tokens), "n_written": n}
        elif action == "restore":
            spec = await asyncio.wrap_future(engine.call(lambda core: core.slot_file_spec()))
            hdr, tokens, layers, n_read = await asyncio.to_thread(read_slot_file, path, **spec)
            res = await asyncio.wrap_future(engine.call(lambda core: core.load_slot(sid, tokens, layers, hdr.meta)))
            res["n_read"] = n_read
        else:
            res = await asyncio.wrap_future(engine.call(lambda core: core.erase_slot(sid)))
    except FileNotFoundError:
        raise ApiError(404, f"slot file not found: {filename}") from None
    except SlotFileError as e:
        raise ApiError(400, str(e)) from None
    except OSError as e:  # e.g. name too long: say what, never the server's directory
        raise ApiError(400, f"cannot {action} slot file '{filename[:64]}': {e.strerror}") from None
    ms = (time.perf_counter() - t0) * 1e3
    if action == "save":
        return SlotSaveResponse(id_slot=sid, filename=filename, n_saved=res["n_saved"], n_written=res["n_written"],
                                timings=SaveTimings(save_ms=ms))
    if action == "restore":
        if not slot.is_processing:  # a request may have taken the slot while the file was read
            slot.set_cached(res["tokens"])
        return SlotRestoreResponse(id_slot=sid, filename=filename, n_restored=res["n_restored"],
                                   n_read=res["n_read"], timings=RestoreTimings(restore_ms=ms))
    slot.set_cached([])
    return SlotEraseResponse(id_slot=sid, n_erased=res["n_erased"])


def render_prompt(runner: Runner, body: dict) -> str:
    """The chat prompt text for ``body["messages"]``, rendered as the chat endpoint does."""
    if runner.template is None:
        raise ApiError(500, "the model has no chat template")
    if "messages" not in body:
        raise ApiError(400, "'messages' is required")
    from kvserve.faces.chat_features import parse_tools, prompt_messages, template_kwargs
    from kvserve.serving.chat_plan import render_prompt

    tools = parse_tools(body.get("tools"))
    add = get_bool(body, "add_generation_prompt", True)  # llama-server honours false (no assistant header)
    text, _ = render_prompt(runner, prompt_messages(runner, body),
                            add_generation_prompt=add is not False, tools=tools,
                            continue_final_message=body.get("continue_final_message"),
                            variables=template_kwargs(runner.args, body, runner.template, tools))  # as the chat endpoint renders
    return text
