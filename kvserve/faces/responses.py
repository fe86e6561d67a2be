"""OpenAI's Responses API: ``POST /v1/responses`` (being built)."""

from __future__ import annotations

from fastapi import APIRouter

from kvserve.serving.state import ServerState


def build_router(state: ServerState) -> APIRouter:
    """The Responses API's routes, bound to ``state``."""
    return APIRouter()
