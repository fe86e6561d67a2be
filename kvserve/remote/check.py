"""The start-up check of a remote model (seed 004 Example 13): ask the upstream for its model
list with the configured key and say which of three things is true, each with its own message:

- ``ok``: the server answered 200 with its models (``ok: serves coder, ...``);
- ``rejected``: 401/403 (``rejected: check the API key``): fix the key;
- ``no_server``: nothing answered at the base URL (connection refused, unknown host, timed out):
  start or reach the server;

plus ``unexpected`` for any other answer (``unexpected status 500``) and ``refused`` for a base
URL that redirects to another host (kvserve never sends the key to a host it was not given).

Bounded: a connect timeout of :data:`CONNECT_TIMEOUT_S`, the whole check within
:data:`CHECK_TIMEOUT_S`, at most :data:`MAX_LIST_BYTES` of the model list read.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from kvserve.remote.spec import RemoteSpec

__all__ = ["CHECK_TIMEOUT_S", "CONNECT_TIMEOUT_S", "MAX_LIST_BYTES", "RemoteCheck", "check_remote",
           "models_of"]

CONNECT_TIMEOUT_S = 5.0
CHECK_TIMEOUT_S = 10.0
MAX_LIST_BYTES = 1 << 20

#: the check's outcomes
OUTCOMES = ("ok", "rejected", "no_server", "unexpected", "refused")


@dataclass(frozen=True)
class RemoteCheck:
    """One check's result.

    Attributes:
        outcome: one of :data:`OUTCOMES`.
        message: the line to log and show (never the key; the base URL without user info).
        models: the upstream's model names (``ok`` only).
        status: the HTTP status the upstream answered (None when none came).
        checked_at: ``time.time()`` of the check.
    """

    outcome: str
    message: str
    models: tuple[str, ...] = ()
    status: int | None = None
    checked_at: float = field(default_factory=time.time)

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


def models_of(dialect: str, body: bytes) -> tuple[str, ...]:
    """Model names of a model list: OpenAI's ``{"data": [{"id"}]}`` or Ollama's
    ``{"models": [{"name"}]}`` (either is read whatever the dialect; bad JSON: ``()``)."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ()
    if not isinstance(doc, dict):
        return ()
    out = []
    for key, item_key in (("data", "id"), ("models", "name"), ("models", "model")):
        items = doc.get(key)
        if isinstance(items, list):
            for it in items:
                if isinstance(it, dict) and isinstance(it.get(item_key), str) and it[item_key] not in out:
                    out.append(it[item_key])
        if out:
            break
    return tuple(out[:256])


def same_origin(a: httpx.URL, b: httpx.URL) -> bool:
    """Scheme, host and port equal (a redirect kvserve follows)."""
    return (a.scheme, a.host, a.port) == (b.scheme, b.host, b.port)


def check_remote(spec: RemoteSpec, *, timeout_s: float = CHECK_TIMEOUT_S, transport=None) -> RemoteCheck:
    """Check ``spec``'s upstream once (blocking; run it in a worker thread on a server).

    Returns a :class:`RemoteCheck`; never raises for anything the network or the upstream does.
    ``transport``: an httpx transport (tests).
    """
    where = f"{spec.shown_url}"
    url = spec.url("models")
    timeout = httpx.Timeout(min(timeout_s, CHECK_TIMEOUT_S), connect=min(CONNECT_TIMEOUT_S, timeout_s))
    deadline = time.monotonic() + timeout_s
    try:
        with httpx.Client(timeout=timeout, follow_redirects=False, transport=transport, trust_env=False) as c:
            for _hop in range(4):
                with c.stream("GET", url, headers=spec.headers()) as r:
                    if r.is_redirect:
                        nxt = r.url.join(r.headers.get("location", ""))
                        if not same_origin(r.url, nxt):
                            return RemoteCheck("refused", f"refused: {where} redirects to another host "
                                                          f"({nxt.scheme}://{nxt.host}); kvserve does not follow it",
                                               status=r.status_code)
                        url = str(nxt)
                        continue
                    body = b""
                    if r.status_code == 200:
                        for chunk in r.iter_bytes():
                            body += chunk
                            if len(body) > MAX_LIST_BYTES or time.monotonic() > deadline:
                                break
                    return _outcome(spec, r.status_code, body)
            return RemoteCheck("unexpected", f"unexpected: {where} redirects too many times")
    except httpx.TimeoutException:
        return RemoteCheck("no_server", f"no server at the base URL {where} (no answer within {timeout_s:g} s)")
    except (httpx.TransportError, OSError) as e:
        return RemoteCheck("no_server", f"no server at the base URL {where} ({_cause(e)})")


def _outcome(spec: RemoteSpec, status: int, body: bytes) -> RemoteCheck:
    if status == 200:
        models = models_of(spec.dialect, body)
        shown = ", ".join(models[:16]) + (", ..." if len(models) > 16 else "") if models else "no models"
        msg = f"ok: {spec.shown_url} serves {shown}"
        if models and spec.upstream_model not in models:
            msg += f" (not '{spec.upstream_model}': requests may fail)"
        return RemoteCheck("ok", msg, models, status)
    if status in (401, 403):
        hint = f" (${spec.key_env})" if spec.key_env else " (none is configured: add key=ENV_VAR)"
        return RemoteCheck("rejected", f"rejected: check the API key{hint}", status=status)
    return RemoteCheck("unexpected", f"unexpected status {status} from {spec.shown_url}", status=status)


def _cause(e: BaseException) -> str:
    """A short cause without URLs or headers (httpx's texts name only the failure)."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text[:200]
