"""The face for people: ``GET /``.

Programs that probe ``/`` (Ollama's clients, health checks) get Ollama's plain
``Ollama is running``.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from kvserve.serving.state import ServerState


def build_router(state: ServerState) -> APIRouter:
    """The web UI's routes, bound to ``state``."""
    r = APIRouter()

    @r.get("/")
    async def root() -> Response:
        return Response("Ollama is running", media_type="text/plain; charset=utf-8")

    return r
