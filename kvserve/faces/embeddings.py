"""The routes that ask for vectors and scores: OpenAI's and vLLM's ``/v1/embeddings``,
llama-server's ``/embedding`` and ``/embeddings`` and its ``/rerank`` (``/reranking``,
``/v1/rerank``, ``/v1/reranking``), and vLLM's ``/v1/score`` (``/score``). Ollama's
``/api/embed`` and ``/api/embeddings`` live in :mod:`kvserve.faces.ollama_api` and use the input
and JSON helpers here.

Which models answer: an encoder (an embedding model such as ``all-minilm``, or a cross-encoder
reranker) always, with or without ``--embeddings``; a generative model only when the server
runs with ``--embeddings`` (llama-server's mode: every model is then loaded for its hidden
states and generates nothing). Without the flag a generative model answers 501 ``This server
does not support embeddings. Start it with `--embeddings``` (seed 000 Example 17; ``/rerank``:
llama-server's ``... Start it with `--reranking```), decided from the model's header, before
anything loads. Requests name the model as on every face (``model``, resolved by the model
manager): an embedding model and a chat model are served side by side, each by name.

``POST /v1/embeddings`` (OpenAI, vLLM, llama-server's OAI route)
    ``input``: a string, a list of strings, a list of token ids (one input), or a list of lists
    of ids; an empty string is an input (BERT embeds ``[CLS] [SEP]``), an empty list is 400.
    ``encoding_format`` ``float`` (default) or ``base64`` (little-endian float32, as the openai
    client decodes it); ``dimensions`` (see :meth:`EmbeddingRunner.check_dimensions
    <kvserve.serving.embed_runner.EmbeddingRunner.check_dimensions>`: 400 unless the model was
    trained for Matryoshka cuts); ``truncate_prompt_tokens`` (vLLM: k >= 1 or -1 for the
    model's maximum; the special tokens at both ends are kept); ``embd_normalize``
    (llama-server's, default: the model's own, e.g. its sentence-transformers Normalize
    module). An input over the model's maximum without truncation is 400
    ``exceed_context_size_error`` naming the limit (``n_prompt_tokens``, ``n_ctx``). Answer, in
    llama-server's key order: ``{"model", "object": "list", "usage": {"prompt_tokens",
    "total_tokens"}, "data": [{"embedding", "index", "object": "embedding"}]}``
    (``"encoding_format": "base64"`` added to each item for base64, as llama-server does).
    A model whose pooling is ``none`` is 400 ``Pooling type 'none' is not OAI compatible``.
    A body with ``content`` and no ``input`` gets the native shape below (llama-server does
    the same).

``POST /embedding``, ``/embeddings`` (llama-server's native routes)
    ``content`` (or ``input``) as above; answer ``[{"index", "embedding": [[...]]}]``: each
    ``embedding`` a list of vectors, one per token with pooling ``none``, else the one pooled
    vector (seed 000 Example 16).

``POST /rerank`` (``/reranking``, ``/v1/rerank``, ``/v1/reranking``; llama-server, Jina's shape)
    ``query`` (a string), ``documents`` (a non-empty list of strings; ``texts`` instead selects
    TEI's shape), ``top_n`` (default: all); answer ``{"model", "object": "list", "usage",
    "results": [{"index", "relevance_score"}]}`` sorted by score, highest first, cut to
    ``top_n``; TEI's is ``[{"index", "score"(, "text" with ``return_text``)}]``. A cross-encoder's
    score is its raw logit (llama-server's); an embedding model's, the cosine similarity.

``POST /v1/score``, ``/score`` (vLLM)
    ``text_1`` and ``text_2`` (also ``queries``/``documents`` or ``data_1``/``data_2``): a string
    or a list each, paired 1:1, 1:N or N:N; answer ``{"id", "object": "list", "created",
    "model", "data": [{"index", "object": "score", "score"}], "usage"}``. A cross-encoder's score
    is the sigmoid of its logit (vLLM's default activation for a one-label classifier); an
    embedding model's, the cosine similarity of the two vectors, as vLLM answers it.

Errors use the faces' common envelope (``{"error": {"code", "message", "type"}}``).
Tokenizing a request's texts (one call to the tokenizers batch encoder) runs on a worker
thread; the vectors come from the model's engine thread; only JSON is written on the loop
(``orjson``, float32 written in their shortest form: 384 x 1,000 floats in ~20 ms where
``json.dumps`` of Python floats takes ~0.5 s on this CPU).
"""

from __future__ import annotations

import asyncio
import base64
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from fastapi import APIRouter
from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from kvserve.faces.api_error import ApiError
from kvserve.faces.limits import batch_cap, check_count, check_input_bytes, input_bytes_cap
from kvserve.faces.http import dumps_json, read_json
from kvserve.faces.models import keep_alive_field, model_field, serve_model, serves_embeddings
from kvserve.faces.params import get_int, get_str, type_error
from kvserve.faces.sse import until_disconnect
from kvserve.serving.embed_runner import (
    EmbeddingRunner,
    cut_dimensions,
)
from kvserve.serving.state import ServerState

__all__ = ["EMBEDDINGS_OFF", "RERANK_OFF", "build_router", "dumps_json", "embedding_inputs",
           "require_embedder", "serves_embeddings"]

EMBEDDINGS_OFF = "This server does not support embeddings. Start it with `--embeddings`"
RERANK_OFF = "This server does not support reranking. Start it with `--reranking`"
POOLING_NONE_OAI = "Pooling type 'none' is not OAI compatible. Please use a different pooling type"
BAD_FORMAT = "The format to return the embeddings in. Can be either float or base64"

Inputs = list  # list[str | list[int]]


# -- JSON -------------------------------------------------------------------------------------

def _json(obj: Any, status: int = 200) -> Response:
    return Response(dumps_json(obj), status_code=status, media_type="application/json; charset=utf-8")


# -- reading inputs ---------------------------------------------------------------------------

def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def embedding_inputs(value: Any, field: str = "input", args: Any = None) -> Inputs:
    """A request's input -> texts and token-id lists (llama-server's ``tokenize_input_prompts``
    rule: a list of numbers is one input, any other list is one input per element).

    Raises:
        ApiError: 400 for a missing input, an empty list, an element that is neither a string
            nor a list of token ids, more than ``--max-batch-inputs`` inputs or more than
            ``--max-input-bytes`` of text (``args``: the server's; None: the defaults,
            :mod:`kvserve.faces.limits`).
    """
    if value is None:
        raise ApiError(400, f'"{field}" must be provided')
    if isinstance(value, str):
        check_input_bytes(field, (value,), input_bytes_cap(args))
        return [value]
    if not isinstance(value, list):
        raise type_error(field, "string or array", value)
    if not value:
        raise ApiError(400, f"Field '{field}': must not be an empty array")
    if all(_is_id(x) for x in value):
        return [list(value)]
    check_count(field, len(value), batch_cap(args), "inputs", "--max-batch-inputs")
    check_input_bytes(field, value, input_bytes_cap(args))
    out: Inputs = []
    for i, x in enumerate(value):
        if isinstance(x, str):
            out.append(x)
        elif isinstance(x, list) and all(_is_id(t) for t in x):
            out.append(list(x))
        else:
            raise ApiError(400, f"Field '{field}[{i}]': type must be string or array of token ids")
    return out


def _truncate(body: dict) -> int | None:
    return get_int(body, "truncate_prompt_tokens")


def _normalize(body: dict) -> int | None:
    return get_int(body, "embd_normalize")


# -- which model ------------------------------------------------------------------------------

def require_embedder(runner: Any, message: str = EMBEDDINGS_OFF) -> EmbeddingRunner:
    """``runner`` as an :class:`EmbeddingRunner`, or 501 ``message`` for a generative runner."""
    if not isinstance(runner, EmbeddingRunner):
        raise ApiError(501, message)
    runner.require_ready()
    return runner


async def _serve(state: ServerState, http: HttpRequest, body: dict, off: str,
                 handler: Callable[[EmbeddingRunner], Awaitable[Response]]) -> Response:
    """Resolve ``body["model"]``, refuse a generative model with 501 ``off``, then run ``handler``
    on the held runner (released when the response is done). A client that leaves meanwhile
    cancels ``handler``, and with it the batches of its inputs not yet run (499, no answer)."""
    name = model_field(body)
    state.require_up()
    if not await serves_embeddings(state, name):
        raise ApiError(501, off)

    async def run(runner) -> Response:
        return await until_disconnect(http, handler(require_embedder(runner, off)))

    return await serve_model(state, name, keep_alive_field(body), run, http)


def _model_name(body: dict, runner: EmbeddingRunner) -> str:
    """The ``model`` a response shows: the request's, else the served name (llama-server)."""
    v = body.get("model")
    return v if isinstance(v, str) and v else runner.model_alias


# -- /v1/embeddings and /embedding(s) ------------------------------------------------------------

async def _embed(runner: EmbeddingRunner, body: dict, inputs: Inputs, *, oai: bool):
    if oai and runner.embedder.pooling == "none":
        raise ApiError(400, POOLING_NONE_OAI)
    dims = runner.check_dimensions(get_int(body, "dimensions")) if oai else None
    res = await runner.embed(inputs, truncate=_truncate(body), normalize=_normalize(body))
    return res, cut_dimensions(res.vectors, dims)


def oai_embeddings_json(model: str, vectors: list[np.ndarray], n_tokens: int, b64: bool) -> dict:
    """``/v1/embeddings``' answer in llama-server's key order (see the module docstring)."""
    data = []
    for i, v in enumerate(vectors):
        if b64:
            data.append({"embedding": base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode(),
                         "index": i, "object": "embedding", "encoding_format": "base64"})
        else:
            data.append({"embedding": v, "index": i, "object": "embedding"})
    return {"model": model, "object": "list", "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
            "data": data}


def native_embeddings_json(vectors: list[np.ndarray]) -> list[dict]:
    """llama-server's ``/embedding`` answer: per input ``{"index", "embedding": [vector, ...]}``."""
    return [{"index": i, "embedding": v if v.ndim == 2 else v[None, :]} for i, v in enumerate(vectors)]


async def oai_embeddings(state: ServerState, http: HttpRequest) -> Response:
    """POST /v1/embeddings."""
    body = await read_json(http)
    if body.get("input") is None and body.get("content") is not None:
        return await native_embeddings(state, http, body)
    fmt = get_str(body, "encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise ApiError(400, BAD_FORMAT)
    inputs = embedding_inputs(body.get("input"), args=state.args)

    async def run(runner: EmbeddingRunner) -> Response:
        res, vectors = await _embed(runner, body, inputs, oai=True)
        return _json(oai_embeddings_json(_model_name(body, runner), vectors, res.total_tokens, fmt == "base64"))

    return await _serve(state, http, body, EMBEDDINGS_OFF, run)


async def native_embeddings(state: ServerState, http: HttpRequest, body: dict | None = None) -> Response:
    """POST /embedding and /embeddings (llama-server's native shape)."""
    if body is None:
        body = await read_json(http)
    key = "input" if body.get("input") is not None else "content"
    if body.get(key) is None:
        raise ApiError(400, '"input" or "content" must be provided')
    inputs = embedding_inputs(body.get(key), key, state.args)

    async def run(runner: EmbeddingRunner) -> Response:
        _, vectors = await _embed(runner, body, inputs, oai=False)
        return _json(native_embeddings_json(vectors))

    return await _serve(state, http, body, EMBEDDINGS_OFF, run)


# -- /rerank --------------------------------------------------------------------------------------

def _string_list(body: dict, key: str) -> list[str] | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ApiError(400, f'"{key}" must be a non-empty string array')
    return v


def rerank_json(body: dict, model: str, scores: list[float], n_tokens: int, docs: list[str], tei: bool,
                top_n: int) -> Any:
    """llama-server's rerank answer: Jina's object, or TEI's array when the request had ``texts``."""
    label = "score" if tei else "relevance_score"
    rows = [{"index": i, label: s} for i, s in enumerate(scores)]
    if tei and body.get("return_text") is True:
        for r in rows:
            r["text"] = docs[r["index"]]
    rows.sort(key=lambda r: -r[label])
    rows = rows[:max(top_n, 0)]
    if tei:
        return rows
    return {"model": model, "object": "list", "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
            "results": rows}


async def rerank(state: ServerState, http: HttpRequest) -> Response:
    """POST /rerank, /reranking, /v1/rerank, /v1/reranking."""
    body = await read_json(http)
    query = body.get("query")
    if query is None:
        raise ApiError(400, '"query" must be provided')
    if not isinstance(query, str):
        raise ApiError(400, '"query" must be a string')
    tei = "texts" in body
    docs = _string_list(body, "documents") or _string_list(body, "texts") or []
    if not docs:
        raise ApiError(400, '"documents" must be a non-empty string array')
    field = "texts" if tei else "documents"
    check_count(field, len(docs), batch_cap(state.args), "documents", "--max-batch-inputs")
    check_input_bytes(field, [query, *docs], input_bytes_cap(state.args))
    top_n = get_int(body, "top_n", len(docs))

    async def run(runner: EmbeddingRunner) -> Response:
        res = await runner.score([(query, d) for d in docs], truncate=_truncate(body))
        return _json(rerank_json(body, _model_name(body, runner), res.scores, res.total_tokens, docs, tei, top_n))

    return await _serve(state, http, body, RERANK_OFF, run)


# -- /v1/score ------------------------------------------------------------------------------------

_SCORE_FIELDS = (("text_1", "text_2"), ("queries", "documents"), ("data_1", "data_2"))


def score_pairs(body: dict) -> list[tuple[str, str]]:
    """vLLM's pairing of ``text_1`` and ``text_2``: 1:1, 1:N (the first against each) or N:N.

    Raises:
        ApiError: 400 for a missing or empty side, a non-string item, or lengths N:M.
    """
    first, second = next(((a, b) for a, b in _SCORE_FIELDS if a in body or b in body), _SCORE_FIELDS[0])
    sides = []
    for key in (first, second):
        v = body.get(key)
        if v is None:
            raise ApiError(400, f'"{key}" must be provided')
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or not items or not all(isinstance(x, str) for x in items):
            raise ApiError(400, f'"{key}" must be a string or a non-empty array of strings')
        sides.append(items)
    a, b = sides
    if len(a) == 1:
        return [(a[0], d) for d in b]
    if len(a) != len(b):
        raise ApiError(400, f"{first} and {second} must pair 1:1, 1:N or N:N, got {len(a)}:{len(b)} items")
    return list(zip(a, b))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def score_json(model: str, scores: list[float], n_tokens: int) -> dict:
    """vLLM's ScoreResponse."""
    return {"id": f"score-{secrets.token_hex(16)}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}}


async def score(state: ServerState, http: HttpRequest) -> Response:
    """POST /v1/score and /score."""
    body = await read_json(http)
    pairs = score_pairs(body)
    check_count("text_2", len(pairs), batch_cap(state.args), "pairs", "--max-batch-inputs")
    check_input_bytes("text_1", (t for pair in pairs for t in pair), input_bytes_cap(state.args))

    async def run(runner: EmbeddingRunner) -> Response:
        res = await runner.score(pairs, truncate=_truncate(body))
        scores = [_sigmoid(s) for s in res.scores] if runner.task == "score" else res.scores
        return _json(score_json(_model_name(body, runner), scores, res.total_tokens))

    return await _serve(state, http, body, EMBEDDINGS_OFF, run)


# -- the router -------------------------------------------------------------------------------

def build_router(state: ServerState) -> APIRouter:
    """The embedding, rerank and score routes bound to ``state``."""
    r = APIRouter()

    async def v1_embeddings(http: HttpRequest) -> Response:
        return await oai_embeddings(state, http)

    async def embedding(http: HttpRequest) -> Response:
        return await native_embeddings(state, http)

    async def rerank_route(http: HttpRequest) -> Response:
        return await rerank(state, http)

    async def score_route(http: HttpRequest) -> Response:
        return await score(state, http)

    r.add_api_route("/v1/embeddings", v1_embeddings, methods=["POST"])
    for path in ("/embedding", "/embeddings"):
        r.add_api_route(path, embedding, methods=["POST"])
    for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
        r.add_api_route(path, rerank_route, methods=["POST"])
    for path in ("/v1/score", "/score"):
        r.add_api_route(path, score_route, methods=["POST"])
    return r
