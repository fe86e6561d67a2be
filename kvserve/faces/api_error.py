"""The error envelope every face uses: ``{"error": {"code", "message", "type", ...}}``.

Types and status codes follow llama-server (000_6dcbf6b03a8c9f77.txt Example 17):
invalid_request_error 400, authentication_error 401, not_found_error 404,
exceed_context_size_error 400 (+ n_prompt_tokens, n_ctx), not_supported_error
501, unavailable_error 503, server_error 500. A body over ``--max-request-bytes``
is 413 invalid_request_error (llama-server has no such limit).

The layers below the faces raise the domain errors of :mod:`kvserve.errors`, which know no
HTTP; :meth:`ApiError.from_exception` maps them to a status by their ``kind``
(:data:`KIND_STATUS`).
"""

from __future__ import annotations

from kvserve.engine.request import ContextSizeExceededError
from kvserve.errors import KvserveError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    500: "server_error",
    501: "not_supported_error",
    502: "bad_gateway_error",
    503: "unavailable_error",
}


#: HTTP status of each domain error kind (``kvserve.errors.KINDS``).
KIND_STATUS = {
    "invalid_request": 400,
    "not_found": 404,
    "unavailable": 503,
    "not_supported": 501,
    "server": 500,
    "bad_gateway": 502,
}


INTERNAL_ERROR = "internal server error (the server log has the details)"
"""The message of an unexpected 500: never the exception's own text."""


class ApiError(Exception):
    """An error to answer with the envelope.

    Args:
        status: HTTP status code.
        message: human-readable text (the contract's exact wording where the seed gives one).
        type: error type; default from ``ERROR_TYPES``.
        extra: additional members of the error object (e.g. n_prompt_tokens, n_ctx).
    """

    def __init__(self, status: int, message: str, type: str | None = None, **extra):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ERROR_TYPES.get(status, "server_error")
        self.extra = extra

    def body(self) -> dict:
        err = {"code": self.status, "message": self.message, "type": self.type}
        err.update(self.extra)
        return {"error": err}

    @classmethod
    def from_exception(cls, e: BaseException) -> "ApiError":
        """The API error for any exception.

        - an ``ApiError``: itself;
        - the engine's ``ContextSizeExceededError``: 400 ``exceed_context_size_error`` with
          ``n_prompt_tokens`` and ``n_ctx`` (and ``n_predict`` when the prompt alone fits);
        - any other :class:`kvserve.errors.KvserveError` (``InvalidRequestError`` included):
          the status of its ``kind`` (:data:`KIND_STATUS`), its message, its explicit ``type``
          if it has one (else the status's), and its ``extra`` members;
        - anything else: 500 ``server_error`` :data:`INTERNAL_ERROR` (the exception's text and
          traceback go to the log only: they may name server paths and internals).
        """
        if isinstance(e, ApiError):
            return e
        if isinstance(e, ContextSizeExceededError):
            extra = {"n_prompt_tokens": e.n_prompt_tokens, "n_ctx": e.n_ctx}
            if e.n_prompt_tokens < e.n_ctx and e.n_predict:
                extra["n_predict"] = e.n_predict
            return cls(400, str(e), "exceed_context_size_error", **extra)
        if isinstance(e, KvserveError):
            # getattr: a subclass that skips KvserveError.__init__ must not break the last-stop handlers
            return cls(KIND_STATUS.get(e.kind, 500), getattr(e, "message", str(e)), getattr(e, "type", None),
                       **getattr(e, "extra", {}))
        return cls(500, INTERNAL_ERROR)


def bad_request(message: str) -> ApiError:
    return ApiError(400, message)


def not_supported(message: str) -> ApiError:
    return ApiError(501, message)


def unavailable(message: str) -> ApiError:
    return ApiError(503, message)
