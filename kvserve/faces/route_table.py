"""A face's routes declared as a table (issue 33, Build 5): one :class:`Route` row per path and
methods, in Starlette's matching order (the first route that matches a request answers it), and
:func:`build_router`, which binds each row's handler to the server state.

A handler is either

* an async function ``handler(state, http) -> Response`` (path parameters are read from
  ``http.path_params``), or
* a class built once per router with the state, whose instance is called as ``await route(http)``:
  for a handler that keeps something per router (llama-server's ``/props`` remembers the pinned
  model's answer while it sleeps). Rows that name the same class share one instance.

FastAPI reads nothing for a handler (no query, body or dependency parameters): the handler reads
the request itself, with :func:`kvserve.faces.http.read_json` and the dialect's checks.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import APIRouter
from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from kvserve.serving.state import ServerState

Handler = Callable[[ServerState, HttpRequest], Awaitable[Response]]

__all__ = ["Handler", "Route", "build_router"]


@dataclass(frozen=True, slots=True)
class Route:
    """One row of a face's route table: ``methods`` (``"GET"``, ``"POST"``, ...) on ``path``
    (Starlette's syntax: ``/slots/{id_slot}``, ``/v1/models/{model_id:path}``) go to ``handler``."""

    path: str
    methods: tuple[str, ...]
    handler: Handler | type


def build_router(state: ServerState, routes: tuple[Route, ...]) -> APIRouter:
    """A router with ``routes`` in their order, each handler bound to ``state`` (the route's name
    is the handler's)."""
    router = APIRouter()
    made: dict[type, Callable[[HttpRequest], Awaitable[Response]]] = {}
    for route in routes:
        if isinstance(route.handler, type):
            endpoint = made.get(route.handler) or made.setdefault(route.handler, route.handler(state))
        else:
            endpoint = _bound(route.handler, state)
        router.add_api_route(route.path, endpoint, methods=list(route.methods), name=route.handler.__name__)
    return router


def _bound(handler: Handler, state: ServerState) -> Callable[[HttpRequest], Awaitable[Response]]:
    async def endpoint(http: HttpRequest) -> Response:
        return await handler(state, http)

    return endpoint
