"""Small HTTP helpers every face uses: reading the JSON body, writing JSON responses."""

from __future__ import annotations

import json

from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from kvserve.faces.errors import ApiError


def dumps(obj) -> str:
    """Compact JSON with non-ASCII escaped (``\\u05ea``), as llama-server's JSON library writes it."""
    return json.dumps(obj, ensure_ascii=True, separators=(",", ":"), allow_nan=False)


def json_response(obj, status: int = 200) -> Response:
    """A JSON response (``application/json; charset=utf-8``)."""
    return Response(dumps(obj), status_code=status, media_type="application/json; charset=utf-8")


def error_response(e: ApiError) -> Response:
    """The error envelope as a response."""
    return json_response(e.body(), e.status)


async def read_json(request: HttpRequest, *, required: bool = True) -> dict:
    """The request body as a JSON object, whatever the Content-Type (curl -d sends form type).

    Malformed JSON is a 400 ``invalid_request_error``: llama-server answers it with 500
    ``server_error`` (seed Example 17), which makes a client bug look like a server fault.

    Raises:
        ApiError: 400 on malformed JSON or a body that is not an object.
    """
    raw = await request.body()
    if not raw.strip():
        if required:
            raise ApiError(400, "request body is empty: a JSON object is required")
        return {}
    try:
        body = json.loads(raw)
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not valid UTF-8: {e}") from e
    except json.JSONDecodeError as e:
        raise ApiError(400, f"invalid JSON: parse error at line {e.lineno}, column {e.colno}: {e.msg}") from e
    except RecursionError:
        raise ApiError(400, "invalid JSON: nesting too deep") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body
