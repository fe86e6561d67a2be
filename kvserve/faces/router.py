"""What the vLLM project's router (``vllm-router``, its Rust load balancer) reads from a worker,
beyond the OpenAI face: kvserve replicas behind ``vllm-router --policy cache_aware``.

Found by running ``vllm-router`` 0.1.17 (the wheel on the package index) against kvserve
behind a logging proxy, in regular (non-PD) mode:

* ``GET /health`` at start-up (until 200; ``--worker-startup-timeout-secs``) and every
  ``--health-check-interval-secs`` (default 60 s; ``--health-failure-threshold`` misses mark
  the worker unhealthy). The llama face answers it (503 ``Loading model`` while loading).
* With ``--enable-igw`` a worker added by ``POST /add_worker?url=...`` is asked
  ``GET /v1/models``; ``data[0].id`` becomes its model id (the llama face's list).
* Per ``/v1/chat/completions`` and ``/v1/completions`` request, with ``cache_aware``, the router
  asks EVERY worker for the prompt's token ids: ``POST /v1/chat/completions/render`` (resp.
  ``/v1/completions/render``) with the request body, and when that is 404, ``POST /tokenize``
  with the ``messages`` (or ``prompt``); it waits about 1 s for these, and past that routes the
  request without its prefix decision. Its prefix tree is over those token ids (a fake worker
  that renders two different texts to the same ids gets ``match_rate=1.0`` for the second): a
  request goes to the worker whose history shares more than ``--cache-threshold`` (0.3) of its
  tokens, else to the worker with the fewest requests in flight (the router's own count; ties:
  the first listed), so concurrent traffic is what spreads new prefixes. The request then goes
  to the chosen worker,
  re-serialized with vLLM/SGLang defaults added (``skip_special_tokens``, ``ignore_eos``,
  ``no_stop_trim``, ``separate_reasoning`` ...) and unknown fields (``cache_prompt``,
  ``id_slot``, ``cache_salt``) kept. Streams are passed through byte for byte.
* ``GET /get_loads`` on the router asks each worker ``GET /get_load`` and reads
  ``{"load": <int>}`` (-1 when absent); ``power_of_two`` polls it every 5 s. ``cache_aware``
  balances on the router's own count of requests in flight, not on this.
* ``/v1/models``, ``/get_model_info``, ``/get_server_info`` and ``/health_generate`` on the router
  are proxied to the first healthy worker (the last three are SGLang's: kvserve answers 404).

This module answers the two the router asks that no other face has:

* ``POST /v1/chat/completions/render`` and ``POST /v1/completions/render`` (vLLM's render
  endpoints, ``vllm/entrypoints/serve/render``): the prompt's token ids as vLLM's token-in
  ``GenerateRequest`` (``request_id``, ``token_ids``, ``features``, ``sampling_params``,
  ``model``, ``stream``, ``stream_options``, ``cache_salt``, ``priority``,
  ``kv_transfer_params``); the completions one answers a list, one per prompt, as vLLM does.
  The ids are exactly those the OpenAI face would prefill (it builds the same plan:
  chat template, ``truncate_prompt_tokens``, FIM ``suffix``), so the router's tree and each
  replica's prefix cache agree. Errors are the OpenAI face's (same checks, same texts).
  Answering render saves the router one round trip per worker and request (the 404, then
  ``/tokenize``). Since the router sends every client body to every worker, a render never
  loads, unloads or wakes a model and ignores ``keep_alive`` (the runner's expiry stays as it
  was): a model that is not loaded answers 503 ``model 'x' is not loaded`` at once (503 rather
  than 404, which would send the router to ``/tokenize``, which loads), and the router routes
  that request without this worker's prefix decision (:func:`kvserve.faces.models.serve_loaded`).
* ``GET /get_load`` (``{"load": N}``, SGLang's shape as the router reads it) and vLLM's
  ``GET /load`` (``{"server_load": N}``, vLLM's ``--enable-server-load-tracking`` shape, here
  always on): N = requests in the engines (running, queued, waiting for a slot) plus requests
  queued for a model (:func:`server_load`). Neither loads a model.

Not provided: ``kv_aware`` routing (it needs vLLM's ZMQ KV-cache events), PD disaggregation
(``--vllm-pd-disaggregation``: kvserve has no KV transfer connector), SGLang's
``/get_server_info``, ``/get_model_info``, ``/health_generate`` and ``/flush_cache``.
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter
from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from kvserve.engine.request import SEED_RANDOM, Request, SamplingParams
from kvserve.faces.http import json_response, read_json
from kvserve.faces.models import model_field, serve_loaded
from kvserve.serving.chat_runner import Runner
from kvserve.serving.state import ServerState

__all__ = ["build_router", "generate_request", "server_load", "vllm_sampling_params"]


def vllm_sampling_params(p: SamplingParams) -> dict:
    """``p`` under vLLM's ``SamplingParams`` names (the render answer's ``sampling_params``).

    Only the fields with the same meaning in both: ``max_tokens`` (None: until the context is
    full, kvserve's ``n_predict`` -1), ``temperature``, ``top_p``, ``top_k`` (-1: off, kvserve's
    0), ``min_p``, ``typical_p``, ``seed`` (None: random), ``stop``, ``presence_penalty``,
    ``frequency_penalty``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``logprobs``
    (None: off), ``prompt_logprobs``, ``logit_bias`` (token id string -> bias; a banned token's
    -inf as -100, OpenAI's floor).
    """
    def bias(b: float) -> float:
        return b if abs(b) != float("inf") else (100.0 if b > 0 else -100.0)

    return {
        "max_tokens": None if p.n_predict < 0 else p.n_predict,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else -1,
        "min_p": p.min_p,
        "typical_p": p.typical_p,
        "seed": None if p.seed == SEED_RANDOM else p.seed,
        "stop": list(p.stop),
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "repetition_penalty": p.repeat_penalty,
        "ignore_eos": p.ignore_eos,
        "min_tokens": p.min_tokens,
        "logprobs": p.n_probs or None,
        "prompt_logprobs": p.prompt_logprobs,
        "logit_bias": {str(t): bias(b) for t, b in sorted(p.logit_bias.items())} or None,
    }


def _stream_options(v: object) -> dict | None:
    """vLLM's ``StreamOptions`` fields of the body's ``stream_options`` (``include_usage``,
    ``continuous_usage_stats``, booleans); other members are not echoed (vLLM ignores them too)."""
    if not isinstance(v, dict):
        return None
    return {k: v[k] for k in ("include_usage", "continuous_usage_stats") if isinstance(v.get(k), bool)}


def generate_request(req: Request, model: str, body: dict) -> dict:
    """One engine request as vLLM's token-in ``GenerateRequest`` (its ``disagg/protocol.py``):
    ``token_ids`` are the prompt's ids (list[int]); ``stream``, ``stream_options`` and
    ``cache_salt`` as the body gave them; ``features`` null (text only); ``priority`` 0."""
    return {
        "request_id": uuid.uuid4().hex,
        "token_ids": list(req.prompt_token_ids),
        "features": None,
        "sampling_params": vllm_sampling_params(req.params),
        "model": model,
        "stream": bool(body.get("stream") or False),
        "stream_options": _stream_options(body.get("stream_options")),
        "cache_salt": req.cache_salt,
        "priority": 0,
        "kv_transfer_params": None,
    }


def _engine_load(runner) -> int:
    """Requests in one runner's engine: its batch, its queue, and those waiting for a slot
    (llama-server's deferred ones); what ``vllm:num_requests_running`` + ``_waiting`` count.
    Plain reads of the engine thread's containers: racy by a step, harmless."""
    slots = runner.slots
    deferred = slots.n_deferred if slots is not None else 0
    try:
        running, queued, _ = runner.engine_counts()
    except Exception:  # noqa: BLE001 - a closing engine
        return deferred
    return running + queued + deferred


def server_load(state: ServerState) -> int:
    """What ``/get_load`` and ``/load`` report: requests in every loaded model's engine (running,
    queued, waiting for a slot) plus requests queued for a model to load or for room; a
    request whose tokens are all generated no longer counts, even while its stream drains."""
    manager = state.manager
    return sum(_engine_load(e.runner) for e in manager.runners()) + int(manager.waiting)


async def _render(state: ServerState, http: HttpRequest, chat: bool) -> Response:
    from kvserve.faces.openai import chat_plan, completion_plan

    body = await read_json(http)

    async def run(runner: Runner) -> Response:
        # the same plan the OpenAI face runs: the same ids, checks and error texts (raised to
        # the app's handlers, which write the envelope)
        # (completions: one request per prompt whatever n is, n still counted in the bound)
        if chat:
            plan = await asyncio.to_thread(chat_plan, runner, body)
        else:
            plan = await asyncio.to_thread(completion_plan, runner, body, render=True)
        firsts = plan.requests[::plan.n]  # prompt-major: one per prompt
        out = [generate_request(r, plan.model, body) for r in firsts]
        return json_response(out[0] if chat else out)

    return await serve_loaded(state, model_field(body), run)


def build_router(state: ServerState) -> APIRouter:
    """The routes ``vllm-router`` reads that no other face serves, bound to ``state``."""
    r = APIRouter()

    @r.post("/v1/chat/completions/render")
    async def render_chat(http: HttpRequest) -> Response:
        return await _render(state, http, chat=True)

    @r.post("/v1/completions/render")
    async def render_completion(http: HttpRequest) -> Response:
        return await _render(state, http, chat=False)

    @r.get("/get_load")
    async def get_load() -> Response:
        return json_response({"load": server_load(state)})

    @r.get("/load")
    async def load() -> Response:
        return json_response({"server_load": server_load(state)})

    return r
