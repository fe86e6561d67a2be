"""Domain errors: what went wrong, with no HTTP in it.

The layers below the faces (engine, chat, structured, serving) raise these; each face maps
a :class:`KvserveError` to its dialect's envelope and status through ``kind``
(``kvserve.faces.api_error.ApiError.from_exception``). ``kind`` is one of:

- ``invalid_request``: the client's input is wrong (HTTP 400);
- ``not_found``: the thing named does not exist (404);
- ``unavailable``: not now: loading, no room, no slot (503);
- ``not_supported``: a feature this build or this model does not have (501);
- ``server``: our fault (500);
- ``bad_gateway``: the server kvserve forwards to (a remote model's upstream) failed (502).

``message`` is the text a client reads; ``extra`` holds further members of the error object
(for example ``n_prompt_tokens`` and ``n_ctx`` of a context-size error).

The engine's ``kvserve.engine.request.InvalidRequestError`` is :class:`InvalidInputError`
under its older name (the same class), so every ``except InvalidRequestError`` also takes the
chat and structured layers' input errors.
"""

from __future__ import annotations

KINDS = ("invalid_request", "not_found", "unavailable", "not_supported", "server", "bad_gateway")


class KvserveError(Exception):
    """Base of the domain errors.

    Args:
        message: the text a client reads (the contract's exact wording where the seed gives one).
        type: an explicit error ``type`` for the envelope (default: the face's type for ``kind``).
        extra: further members of the error object.
    """

    kind = "server"

    def __init__(self, message: str, type: str | None = None, **extra):
        super().__init__(message)
        self.message = message
        self.type = type
        self.extra = extra


class InvalidInputError(KvserveError, ValueError):
    """The client's input is wrong (a face answers 400)."""

    kind = "invalid_request"


class NotFoundError(KvserveError, LookupError):
    """The model, slot file or object named does not exist (404)."""

    kind = "not_found"


class UnavailableError(KvserveError):
    """The server cannot do it now: a model is loading, memory is short (503)."""

    kind = "unavailable"


class NotSupportedError(KvserveError):
    """A feature this server or model does not have (501)."""

    kind = "not_supported"


class ServerFaultError(KvserveError):
    """Our fault: a model failed to load, an engine died (500)."""

    kind = "server"


class BadGatewayError(KvserveError):
    """The upstream server of a remote model refused or failed the request (502)."""

    kind = "bad_gateway"
