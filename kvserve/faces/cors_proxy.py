"""llama-server's ``/cors-proxy`` (``--ui-mcp-proxy``, experimental there too): ``GET`` / ``POST
/cors-proxy?url=TARGET`` forwards the request to an ``http``/``https`` ``TARGET`` on behalf of a
browser page (llama-server's web UI uses it to reach MCP servers that send no CORS headers).

As llama-server's ``server-cors-proxy.h``: only the request headers the caller names explicitly
travel, each sent as ``x-llama-server-proxy-header-NAME: value`` and forwarded as ``NAME: value``
(so the caller's own ``Authorization``, ``X-Api-Key``, ``Cookie`` and ``Proxy-Authorization`` never
reach the target); ``Accept-Encoding``, ``Transfer-Encoding``, ``Content-Length`` and ``Host`` among
them are dropped. The body of a ``POST`` travels as it came. Redirects are followed; the answer's
status, ``Content-Type`` and body come back, its other headers too except ``Server``,
``Transfer-Encoding``, ``Content-Length``, ``Keep-Alive`` and ``Access-Control-*`` (this server's
CORS answer applies). Without ``--ui-mcp-proxy`` both methods answer 403 ``this feature is
disabled`` (llama-server's body). A target URL without a host, with credentials or with another
scheme is a 400 here (llama-server answers those with a 500); an unreachable target is a 502.
The route sits behind ``--api-key`` like every non-page route, and behind the ``/tools`` guard
(:class:`kvserve.faces.auth.ApiOriginGuard`): a page of a foreign ``Origin``, or a ``Host`` that is
not a loopback name on a loopback listener (DNS rebinding), gets 403, since the proxy reaches
whatever this machine can.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from fastapi import APIRouter
from starlette.background import BackgroundTask
from starlette.requests import Request as HttpRequest
from starlette.responses import Response, StreamingResponse

from kvserve.faces.api_error import ApiError
from kvserve.faces.http import json_response
from kvserve.serving.state import ServerState

if TYPE_CHECKING:  # httpx is imported on the first proxied request: ~40-70 ms less at every start
    import httpx

#: the request header prefix that names a header to forward (llama-server's)
PROXY_HEADER_PREFIX = "x-llama-server-proxy-header-"
#: forwarded-header names never sent on (the client library sets them from the body and URL)
_DROP_REQUEST = frozenset({"accept-encoding", "transfer-encoding", "content-length", "host"})
#: answer headers not passed back (llama-server's should_strip_proxy_header)
_DROP_RESPONSE = frozenset({"server", "transfer-encoding", "content-length", "keep-alive", "content-type",
                            "content-encoding"})
#: llama-server's read and write timeouts for the target (seconds)
TIMEOUT_S = 600.0


def target_url(url: str | None) -> str:
    """The ``url`` query parameter, checked: an ``http``/``https`` URL with a host and no
    credentials. Raises ApiError 400 otherwise (llama-server's messages)."""
    if not url:
        raise ApiError(400, "invalid target URL: missing host")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ApiError(400, f"unsupported URL scheme in target URL: {parts.scheme}")
    if not parts.hostname:
        raise ApiError(400, "invalid target URL: missing host")
    if parts.username is not None or parts.password is not None:
        raise ApiError(400, "authentication in target URL is not supported")
    return url


def forwarded_headers(headers) -> dict[str, str]:
    """The headers to send to the target: those named ``x-llama-server-proxy-header-NAME``, as
    ``NAME`` (``headers``: any mapping or Starlette's Headers; names compared lower-case)."""
    out: dict[str, str] = {}
    for key, value in headers.items():
        name = key.lower()
        if not name.startswith(PROXY_HEADER_PREFIX):
            continue
        name = name[len(PROXY_HEADER_PREFIX):]
        if name and name not in _DROP_REQUEST:
            out[name] = value
    return out


def answer_headers(headers: httpx.Headers) -> dict[str, str]:
    """The target's answer headers passed back to the caller."""
    return {k: v for k, v in headers.items()
            if k.lower() not in _DROP_RESPONSE and not k.lower().startswith("access-control-")}


def build_router(state: ServerState) -> APIRouter:
    """``GET``/``POST /cors-proxy``: the proxy with ``--ui-mcp-proxy``, else 403."""
    router = APIRouter()
    enabled = bool(getattr(state.args, "ui_mcp_proxy", False))

    async def cors_proxy(http: HttpRequest) -> Response:
        if not enabled:
            return json_response({"error": {"message": "this feature is disabled", "type": "feature_disabled"}}, 403)
        url = target_url(http.query_params.get("url"))
        body = await http.body() if http.method == "POST" else None
        import httpx

        client = httpx.AsyncClient(follow_redirects=True, timeout=httpx.Timeout(TIMEOUT_S), trust_env=False)
        try:
            # llama-server asks for no compression; the caller's own choice is not forwarded either
            headers = {"accept-encoding": "identity", **forwarded_headers(http.headers)}
            req = client.build_request(http.method, url, headers=headers, content=body)
            upstream = await client.send(req, stream=True)
        except httpx.HTTPError as e:
            await client.aclose()
            raise ApiError(502, f"proxy: the target could not be reached: {type(e).__name__}") from None

        async def close() -> None:
            await upstream.aclose()
            await client.aclose()

        return StreamingResponse(upstream.aiter_bytes(), status_code=upstream.status_code,
                                 headers=answer_headers(upstream.headers),
                                 media_type=upstream.headers.get("content-type"), background=BackgroundTask(close))

    router.add_api_route("/cors-proxy", cors_proxy, methods=["GET", "POST"], include_in_schema=False)
    return router
