"""What a remote model is: :class:`RemoteSpec` (a served name, the upstream's base URL, its
dialect, the upstream's model name and the *name* of the environment variable holding its key),
and :func:`parse_remote` for ``--remote name=URL[,key=ENV_VAR][,model=upstream][,dialect=...]``.

The key itself is read from the environment when a request is sent (:meth:`RemoteSpec.api_key`)
and never kept in the spec, its ``repr``, the logs or any response.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from kvserve.errors import InvalidInputError

__all__ = ["DIALECTS", "RemoteSpec", "parse_remote", "redact_url", "remote_host_allowed", "REMOTE_NOT_ALLOWED"]

#: the upstream dialects kvserve forwards to: OpenAI chat completions, Ollama's /api/chat
DIALECTS = ("openai", "ollama")

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NAME = re.compile(r"[^\s,=]{1,256}")


#: Ollama's answer (400) for a stored remote model whose host is not in ``OLLAMA_REMOTES``
REMOTE_NOT_ALLOWED = "this server cannot run this remote model"


def remote_host_allowed(base_url: str) -> bool:
    """True when the host of ``base_url`` is in ``OLLAMA_REMOTES`` (a comma list of host names,
    compared exactly and without case; unset or empty: ``ollama.com``), Ollama's allow-list for
    remote models stored in the model store. A stored model is data any client of ``/api/create``
    can write: without this rule it could point the server at any host and name any of the
    server's environment variables as its key. ``--remote`` models are the operator's and are
    not checked."""
    raw = (os.environ.get("OLLAMA_REMOTES") or "").strip()
    hosts = {h.strip().lower() for h in raw.split(",") if h.strip()} if raw else {"ollama.com"}
    try:
        host = (urlsplit(base_url).hostname or "").lower()
    except ValueError:
        return False
    return bool(host) and host in hosts


def redact_url(url: str) -> str:
    """``url`` without its user-info part (``https://user:pw@h/v1`` -> ``https://h/v1``) and
    without its query string: what logs and responses may show of a base URL."""
    try:
        p = urlsplit(url)
    except ValueError:
        return "<invalid URL>"
    host = p.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = p.port
    except ValueError:
        port = None
    netloc = f"{host}:{port}" if port else host
    return urlunsplit((p.scheme, netloc, p.path, "", ""))


@dataclass(frozen=True)
class RemoteSpec:
    """One remote model: a name kvserve serves whose answers come from a server elsewhere.

    Attributes:
        name: the model name clients use at kvserve (``/v1/models`` id, Ollama's ``model``).
        base_url: the upstream's base URL, ``http`` or ``https``. For ``openai`` it is the URL
            the OpenAI clients take (``http://host:8000/v1``: kvserve appends ``/models`` and
            ``/chat/completions``); one with no path gets ``/v1``. For ``ollama`` it is the
            server's root (``http://host:11434``: kvserve appends ``/api/tags`` and ``/api/chat``).
        dialect: ``openai`` (OpenAI chat completions: vLLM, llama-server, another kvserve,
            hosted APIs) or ``ollama`` (Ollama's ``/api/chat``).
        model: the model name sent upstream ("" = ``name``).
        key_env: the name of the environment variable holding the upstream's API key (sent as
            ``Authorization: Bearer ...``), or None for no key. Never the key itself.

    Raises:
        InvalidInputError: a base URL that is not ``http(s)://host...``, one carrying user
            info (a key belongs in ``key_env``), an unknown dialect, a bad name or env var name.
    """

    name: str
    base_url: str
    dialect: str = "openai"
    model: str = ""
    key_env: str | None = None

    def __post_init__(self) -> None:
        if not self.name or not _NAME.fullmatch(self.name):
            raise InvalidInputError(f"remote model name {self.name[:64]!r}: 1-256 characters without spaces, "
                                    "',' or '='")
        if self.dialect not in DIALECTS:
            raise InvalidInputError(f"remote model '{self.name}': unknown dialect {self.dialect[:32]!r} "
                                    f"(one of {', '.join(DIALECTS)})")
        if self.key_env is not None and not _ENV_NAME.fullmatch(self.key_env):
            raise InvalidInputError(f"remote model '{self.name}': key= takes the name of an environment "
                                    f"variable (letters, digits, '_'), not a key")
        try:
            p = urlsplit(self.base_url)
            p.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError:
            raise InvalidInputError(f"remote model '{self.name}': base URL is not a valid URL") from None
        if p.scheme not in ("http", "https") or not p.hostname:
            raise InvalidInputError(f"remote model '{self.name}': base URL {redact_url(self.base_url)!r} must "
                                    "start with http:// or https:// and name a host")
        if p.username is not None or p.password is not None:
            raise InvalidInputError(f"remote model '{self.name}': base URL must not carry user info; give the "
                                    "key's environment variable with key=ENV_VAR")
        if p.query or p.fragment:
            raise InvalidInputError(f"remote model '{self.name}': base URL must not have a query or fragment")
        path = p.path.rstrip("/")
        if self.dialect == "openai" and not path:
            path = "/v1"
        object.__setattr__(self, "base_url", urlunsplit((p.scheme, p.netloc, path, "", "")))

    def __repr__(self) -> str:  # the key is never here anyway; the env var's name is harmless
        return (f"RemoteSpec(name={self.name!r}, base_url={self.base_url!r}, dialect={self.dialect!r}, "
                f"model={self.upstream_model!r}, key_env={self.key_env!r})")

    @property
    def upstream_model(self) -> str:
        """The model name sent upstream."""
        return self.model or self.name

    def api_key(self) -> str | None:
        """The key from ``key_env`` now (None: no key configured, or the variable is unset/empty)."""
        if not self.key_env:
            return None
        return os.environ.get(self.key_env) or None

    def headers(self) -> dict[str, str]:
        """Request headers for the upstream (``Authorization`` when a key is set)."""
        key = self.api_key()
        return {"Authorization": f"Bearer {key}"} if key else {}

    def url(self, what: str) -> str:
        """The upstream URL of ``what``: ``models`` / ``chat`` (the dialect's paths)."""
        paths = {"openai": {"models": "/models", "chat": "/chat/completions"},
                 "ollama": {"models": "/api/tags", "chat": "/api/chat"}}
        return self.base_url + paths[self.dialect][what]

    @property
    def shown_url(self) -> str:
        """The base URL as logs and responses show it (:func:`redact_url`)."""
        return redact_url(self.base_url)


def parse_remote(value: str) -> RemoteSpec:
    """``name=URL[,key=ENV_VAR][,model=upstream_name][,dialect=openai|ollama]`` -> RemoteSpec.

    Raises:
        InvalidInputError: a malformed value (the message says which part), or what
            :class:`RemoteSpec` refuses.
    """
    if not isinstance(value, str) or "=" not in value:
        raise InvalidInputError("--remote takes name=URL[,key=ENV_VAR][,model=NAME][,dialect=openai|ollama]")
    head, *rest = value.split(",")
    name, _, url = head.partition("=")
    opts: dict[str, str] = {}
    for part in rest:
        k, sep, v = part.partition("=")
        k = k.strip()
        if not sep or k not in ("key", "model", "dialect") or not v:
            raise InvalidInputError(f"--remote {name.strip()}: unknown or empty option {k[:32]!r} (key=ENV_VAR, "
                                    "model=NAME, dialect=openai|ollama)")
        if k in opts:
            raise InvalidInputError(f"--remote {name.strip()}: {k}= given twice")
        opts[k] = v.strip()
    return RemoteSpec(name.strip(), url.strip(), opts.get("dialect", "openai"), opts.get("model", ""),
                      opts.get("key"))
