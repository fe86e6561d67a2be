"""llama-server's ``/tools`` routes (``--tools``; server-tools.cpp's ``handle_get``/``handle_post``):
translation only, the tools themselves are :mod:`kvserve.tools`.

* ``GET /tools``: the registry's entries (:meth:`kvserve.tools.Tool.entry`), a JSON array.
* ``POST /tools`` ``{"tool": NAME, "params": {...}, "stream": bool}``: the tool's answer, 200
  (``plain_text_response``/``result``/``error``); ``stream: true``: ``text/event-stream`` events
  ``data: {"chunk": TEXT}\\n\\n`` ending with ``data: {"done": true}\\n\\n`` (plus ``"error"`` when the
  tool failed). An unknown tool, or ``stream`` for a tool that cannot, is 404
  (``invalid_request_error``, llama-server's); a bad body or params 400; a refused runtime 500 with
  llama-server's texts (``unknown tool runtime: X``, ``invalid container id: X``).
* The call's context comes from headers only: ``x-tool-cwd`` (the working directory), ``x-tool-runtime``
  (``docker-container:ID``/``podman-container:ID``; else ``--tools-runtime``), ``x-resp-type``; the
  same names in ``params`` are dropped, as llama-server drops them, so nothing a model writes moves
  the call elsewhere.
* Without ``--tools`` (and no MCP tools) both answer 403 ``this feature is disabled``
  (``feature_disabled``), llama-server's body.

A client that goes away ends the call: the stream's generator is closed (Starlette stops iterating),
a non-streaming call is watched for ``http.disconnect``; either sets the context's ``cancelled`` event
and the tool's processes die with it.
"""

from __future__ import annotations

import asyncio
import json
import logging

from starlette.requests import Request as HttpRequest
from starlette.responses import Response, StreamingResponse

from kvserve.faces import route_table
from kvserve.faces.api_error import ApiError
from kvserve.faces.http import json_response, read_json
from kvserve.faces.route_table import Route
from kvserve.serving.state import ServerState
from kvserve.tools import ToolContext, ToolError, ToolRegistry

log = logging.getLogger("kvserve.server")

#: the most seconds one tool call may take (a shell command's own timeout is at most 60 s)
CALL_TIMEOUT_S = 120.0
#: llama-server's answer while the feature is off
DISABLED = {"error": {"message": "this feature is disabled", "type": "feature_disabled"}}
#: the params keys only headers may set
_HEADER_ONLY = ("cwd", "runtime", "resp_type")


def registry(state: ServerState) -> ToolRegistry | None:
    """The server's tool registry when the routes are enabled, else None."""
    reg = getattr(state, "tools", None)
    return reg if reg is not None and reg.enabled else None


async def list_tools(state: ServerState, http: HttpRequest) -> Response:
    reg = registry(state)
    if reg is None:
        return json_response(DISABLED, 403)
    return json_response([t.entry() for t in reg.list()])


def _context(reg: ToolRegistry, http: HttpRequest) -> ToolContext:
    """The call's context from the headers (and ``--tools-runtime``)."""
    from kvserve.tools.runtime import parse_runtime

    runtime = _header(http, "x-tool-runtime") or reg.runtime
    parse_runtime(runtime)  # raises ToolRuntimeError (500) for a refused spec
    return ToolContext(cwd=_header(http, "x-tool-cwd") or None, runtime=runtime or None,
                       resp_type=_header(http, "x-resp-type") or None, timeout_s=CALL_TIMEOUT_S)


def _header(http: HttpRequest, name: str) -> str:
    """A header's value as UTF-8 text (llama-server reads the bytes as UTF-8; Starlette decodes
    latin-1): a cwd with non-ASCII letters names the same directory. Bytes that are not UTF-8 stay
    as surrogate escapes, as Python's file functions take them."""
    value = http.headers.get(name) or ""
    try:
        return value.encode("latin-1").decode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return value


def _error(e: ToolError) -> Response:
    return json_response(ApiError(e.status, e.message, "invalid_request_error" if e.status < 500 else None).body(),
                         e.status)


async def call_tool(state: ServerState, http: HttpRequest) -> Response:
    reg = registry(state)
    if reg is None:
        return json_response(DISABLED, 403)
    body = await read_json(http)
    name = body.get("tool")
    if not isinstance(name, str):
        raise ApiError(400, "Field 'tool': expected a string (the tool's name)")
    params = body.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ApiError(400, "Field 'params': expected an object")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "Field 'stream': expected a boolean")
    params = {k: v for k, v in params.items() if k not in _HEADER_ONLY}
    try:
        tool = reg.get(name, stream=stream)
        ctx = _context(reg, http)
    except ToolError as e:
        return _error(e)
    if stream:
        return await _stream(http, tool, params, ctx)
    watcher = asyncio.ensure_future(_watch_disconnect(http, ctx))
    try:
        result = await tool.run(params, ctx)
    except ToolError as e:
        return _error(e)
    finally:
        watcher.cancel()
    return json_response(clean_text(result))


async def _watch_disconnect(http: HttpRequest, ctx: ToolContext) -> None:
    """Set ``ctx.cancelled`` when the client goes away (the body was read: the next message is
    ``http.disconnect``)."""
    while True:
        msg = await http.receive()
        if msg["type"] == "http.disconnect":
            ctx.cancelled.set()
            return


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(clean_text(obj), ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def clean_text(obj):
    """``obj`` with every string made valid Unicode: a file name that is not UTF-8 (kept by Python
    as surrogate escapes) is answered with U+FFFD in place of its bad bytes."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
            return obj
        except UnicodeEncodeError:
            return obj.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if isinstance(obj, dict):
        return {clean_text(k): clean_text(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clean_text(v) for v in obj]
    return obj


async def _stream(http: HttpRequest, tool, params: dict, ctx: ToolContext) -> Response:
    # a refused call (bad params, path outside the cwd) answers with its status before the stream;
    # a client that leaves while the first chunk is awaited cancels the call too
    watcher = asyncio.ensure_future(_watch_disconnect(http, ctx))
    try:
        chunks = tool.stream(params, ctx).__aiter__()
        first = await chunks.__anext__()
    except StopAsyncIteration:
        first = None
    except ToolError as e:
        return _error(e)
    finally:
        watcher.cancel()

    async def events():
        error = None
        try:
            if first is not None:
                yield _event({"chunk": first})
                async for chunk in chunks:
                    if chunk:
                        yield _event({"chunk": chunk})
        except ToolError as e:
            error = e.message
        except Exception as e:  # noqa: BLE001 - the stream has started: end it with the error
            log.exception("tool %s failed", tool.name, extra={"func": "tools"})
            error = str(e) or type(e).__name__
        finally:  # the end, or the client gone (the generator closed): nothing of the call outlives it
            ctx.cancelled.set()
            await chunks.aclose()
        yield _event({"done": True, **({"error": error} if error else {})})

    return _ToolStream(events(), ctx)


class _ToolStream(StreamingResponse):
    """The event stream; however it ends (done, client gone, server stop), the call is cancelled
    and its generators closed, so its processes die with the request."""

    def __init__(self, events, ctx: ToolContext):
        super().__init__(events, media_type="text/event-stream")
        self._events, self._ctx = events, ctx

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._ctx.cancelled.set()
            try:
                await self._events.aclose()
            except RuntimeError:  # still running: the cancellation reached it and its finally ran
                pass


ROUTES = (
    Route("/tools", ("GET",), list_tools),
    Route("/tools", ("POST",), call_tool),
)


def build_router(state: ServerState):
    """The ``/tools`` routes bound to ``state``."""
    return route_table.build_router(state, ROUTES)
