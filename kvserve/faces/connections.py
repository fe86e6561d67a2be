"""Bounds on connections, below the app (issue 31, Build 8).

:func:`guarded_protocol` wraps uvicorn's httptools protocol class (the one
:func:`kvserve.app.http_protocol` gives) so that:

* a connection that sends no complete request head within ``--header-timeout`` seconds (default
  :data:`HEADER_TIMEOUT_S`), after it opens and after each response, is closed (slowloris headers, half-open sockets: the attack run held
  5,000 open and nothing closed them); uvicorn's keep-alive timeout still closes idle connections
  sooner;
* a connection beyond ``--limit-concurrency`` open ones (default :data:`MAX_CONNECTIONS`; uvicorn's
  flag name, whose own limit would answer 503 in plain text) is closed at once.

The h11 class (used when httptools is missing) is returned unchanged. Slow bodies are bounded in
:class:`kvserve.faces.http.BodyLimitMiddleware` (``BODY_IDLE_S``).
"""

from __future__ import annotations

__all__ = ["HEADER_TIMEOUT_S", "MAX_CONNECTIONS", "guarded_protocol"]

HEADER_TIMEOUT_S = 30.0  # seconds a connection has to send a whole request head
MAX_CONNECTIONS = 4096  # open connections at most; a newer one is closed at once


def guarded_protocol(cls: type, header_timeout: float = HEADER_TIMEOUT_S,
                     max_connections: int = MAX_CONNECTIONS) -> type:
    """A subclass of the httptools protocol ``cls`` with the bounds of the module docstring (``cls``
    itself when it is not httptools-based).

    Args:
        header_timeout: seconds (> 0) a connection has to send a whole request head.
        max_connections: open connections at most (>= 1); a newer one is closed at once.
    """
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return cls
    if not issubclass(cls, HttpToolsProtocol):
        return cls

    class Guarded(cls):  # type: ignore[misc, valid-type]
        _header_timer = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:  # a flood of sockets: refuse the newest
                transport.close()
                return
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout, self._header_timeout)

        def _header_timeout(self) -> None:
            if not self.transport.is_closing():
                self.transport.close()

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def on_headers_complete(self) -> None:
            self._cancel_header_timer()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():  # the next request's head has the same bound
                self._cancel_header_timer()
                self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{cls.__name__}"
    return Guarded
