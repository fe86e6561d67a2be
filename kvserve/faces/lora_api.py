"""vLLM's runtime LoRA routes: ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``.

As vLLM's API server, the routes exist only when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true
(``1``/``true``) when the server starts (a WARNING says so); otherwise they answer 404 as any
unknown path. Bodies (vLLM's ``LoadLoRAAdapterRequest`` / ``UnloadLoRAAdapterRequest``)::

    load:    lora_name, lora_path, load_inplace (false), base_model_name (a kvserve extension)
    unload:  lora_name

Success is vLLM's ``200 text/plain`` sentence (``Success: LoRA adapter 'x' added successfully.``);
an error is vLLM's ``{"error": {"message", "type", "param", "code"}}`` with its type
(``InvalidUserInput``, ``NotFoundError``, ``BadRequestError``) and status. The work is
:class:`kvserve.serving.lora_modules.LoraServing`'s.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter
from starlette.requests import Request as HttpRequest
from starlette.responses import PlainTextResponse, Response

from kvserve.faces import route_table
from kvserve.faces.api_error import ApiError
from kvserve.faces.http import json_response, read_json
from kvserve.faces.route_table import Route
from kvserve.serving.lora_modules import LoraApiError
from kvserve.serving.state import ServerState

log = logging.getLogger("kvserve.server")

__all__ = ["ROUTES", "build_router"]


def _error(e: LoraApiError) -> Response:
    return json_response({"error": {"message": e.message, "type": e.type, "param": None, "code": e.status}},
                         e.status)


async def _body(http: HttpRequest) -> dict:
    try:
        return await read_json(http)
    except ApiError as e:
        raise LoraApiError(e.status, e.message, "BadRequestError") from None


async def load_lora_adapter(state: ServerState, http: HttpRequest) -> Response:
    """POST /v1/load_lora_adapter: vLLM's load (see the module docstring)."""
    try:
        text = await state.loras.load(state, await _body(http))
    except LoraApiError as e:
        return _error(e)
    return PlainTextResponse(text)


async def unload_lora_adapter(state: ServerState, http: HttpRequest) -> Response:
    """POST /v1/unload_lora_adapter: vLLM's unload (see the module docstring)."""
    try:
        text = await state.loras.unload(await _body(http))
    except LoraApiError as e:
        return _error(e)
    return PlainTextResponse(text)


ROUTES: tuple[Route, ...] = (
    Route("/v1/load_lora_adapter", ("POST",), load_lora_adapter),
    Route("/v1/unload_lora_adapter", ("POST",), unload_lora_adapter),
)


def build_router(state: ServerState) -> APIRouter:
    """The routes when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true, else an empty router."""
    if not state.loras.runtime_updates:
        return APIRouter()
    log.warning("LoRA dynamic loading & unloading is enabled in the API server. This should ONLY be used for "
                "local development!", extra={"func": "lora"})
    return route_table.build_router(state, ROUTES)
