"""Anthropic's Messages API: ``POST /v1/messages`` (being built)."""

from __future__ import annotations

from fastapi import APIRouter

from kvserve.serving.state import ServerState


def build_router(state: ServerState) -> APIRouter:
    """The Messages API's routes, bound to ``state``."""
    return APIRouter()
