"""Server-sent events and disconnect handling shared by the faces.

:func:`sse_response` turns an async iterator of JSON-able events into a
``text/event-stream`` response with llama-server's rules (seed Examples 5, 17):

- the first event is produced before the response starts, so a request that
  fails before its first token gets a plain HTTP error (the ApiError envelope);
- after streaming began, an error becomes one ``data: {"error": {...}}`` event and
  the stream closes without ``[DONE]``;
- while nothing else is sent, the SSE comment ``:`` plus a blank line goes out
  every ``ping_interval`` seconds;
- a client disconnect closes the iterator, which aborts the request in the engine.

:func:`until_disconnect` does the last point for non-streaming requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import Request as HttpRequest
from starlette.responses import StreamingResponse

from kvserve.engine.request import InvalidRequestError
from kvserve.errors import KvserveError
from kvserve.faces.api_error import ApiError
from kvserve.faces.http import dumps, json_response

log = logging.getLogger("kvserve.server")

PING = ":\n\n"
DONE = "data: [DONE]\n\n"


def sse_data(obj) -> str:
    """One ``data: {json}`` event."""
    return f"data: {dumps(obj)}\n\n"


def error_body(e: BaseException) -> dict:
    """The envelope for any exception (no stack trace: server errors are logged)."""
    client = isinstance(e, (ApiError, InvalidRequestError)) or (isinstance(e, KvserveError) and e.kind != "server")
    if not client:  # client mistakes (and "not now") are not server faults: no traceback
        log.exception("request failed", exc_info=e)
    return ApiError.from_exception(e).body()


def error_answer(e: BaseException):
    """The error envelope of any exception as a JSON response with its status (a server fault is
    logged with its traceback, as :func:`error_body` does)."""
    return json_response(error_body(e), ApiError.from_exception(e).status)


def sse_named(obj: dict) -> str:
    """One ``event: <type>`` + ``data: {json}`` event (OpenAI's typed Responses events and
    Anthropic's events name themselves by their ``type``; an object without one is data only)."""
    name = obj.get("type")
    return f"event: {name}\n{sse_data(obj)}" if isinstance(name, str) else sse_data(obj)


async def sse_response(events: AsyncIterator[dict], *, ping_interval: float = 30.0,
                       done: bool = True, headers: dict | None = None,
                       encode: Callable[[dict], str] = sse_data, ping: str = PING,
                       ping_before_first: bool = True,
                       error_event: Callable[[BaseException], dict] | None = None) -> StreamingResponse:
    """Stream ``events`` as SSE; start once the first exists or one ping interval passed.

    Args:
        events: async iterator of JSON-able dicts (closed when the client leaves).
        ping_interval: seconds between pings while idle (<= 0: never).
        done: end a successful stream with ``data: [DONE]`` (OpenAI endpoints;
            llama-server's ``/completion`` sends none).
        headers: extra response headers.
        encode: one event's text (:func:`sse_data`, or :func:`sse_named` for ``event:`` lines).
        ping: the idle text (the ``:`` comment; Anthropic's ``event: ping``).
        ping_before_first: ping while the first event is awaited (False: Anthropic's stream
            opens with ``message_start``, so a request queued behind busy slots waits silently).
        error_event: the event for an error after the start (default :func:`error_body`).

    Raises:
        whatever ``events`` raises before its first event (the caller answers it
        as a plain HTTP error).
    """
    it = events.__aiter__()
    # Wait for the first event up to one ping interval: errors found by then (validation,
    # context size, no such slot) get a plain HTTP error; a longer prefill starts the
    # stream so that pings can flow while it runs.
    first: asyncio.Future = asyncio.ensure_future(it.__anext__())
    try:
        await asyncio.wait({first}, timeout=ping_interval if ping_interval > 0 else None)
    except BaseException:
        first.cancel()
        await _aclose(it)
        raise
    if first.done() and first.exception() is not None and not isinstance(first.exception(), StopAsyncIteration):
        await _aclose(it)
        raise first.exception()

    on_error = error_event or error_body

    async def body():
        nxt: asyncio.Future | None = first
        started = False
        try:
            while True:
                while True:
                    finished, _ = await asyncio.wait({nxt}, timeout=ping_interval if ping_interval > 0 else None)
                    if finished:
                        break
                    if started or ping_before_first:
                        yield ping
                try:
                    ev = nxt.result()
                except StopAsyncIteration:
                    nxt = None
                    break
                nxt = None
                yield encode(ev)
                started = True
                nxt = asyncio.ensure_future(it.__anext__())
            if done:
                yield DONE
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - after the start an error is one event
            nxt = None
            yield encode(on_error(e))
        finally:
            if nxt is not None and not nxt.done():
                nxt.cancel()
                try:
                    await nxt
                except BaseException:  # noqa: BLE001 - the iterator is being torn down
                    pass
            await _aclose(it)

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", **(headers or {})})


async def _aclose(it) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # noqa: BLE001 - closing after an error
            pass


class ClientDisconnected(Exception):
    """The client went away before a non-streaming response was ready (answered with an empty
    499, nginx's "client closed request", and no traceback in the log)."""


async def until_disconnect(request: HttpRequest, work: Awaitable, poll_s: float = 0.25):
    """Await ``work``; if the client disconnects first, cancel it (aborting its generation).

    Returns ``work``'s result; raises :class:`ClientDisconnected` after a disconnect.
    """
    task = asyncio.ensure_future(work)
    try:
        while True:
            finished, _ = await asyncio.wait({task}, timeout=poll_s)
            if finished:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                try:
                    await task
                except BaseException:  # noqa: BLE001
                    pass
                raise ClientDisconnected("client disconnected")
    finally:
        if not task.done():
            task.cancel()
