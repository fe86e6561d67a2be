""":func:`load_supervised`: the model manager's loader for a supervised engine. It starts the
child (:class:`~kvserve.supervisor.child.EngineChild`) and serves it exactly as a remote model at
the child's base URL: a :class:`SupervisedRunner` is a :class:`kvserve.remote.RemoteRunner`
whose ``close`` stops the child. So every face reaches it with no code of its own, and keep_alive,
``keep_alive: 0``, eviction and shutdown stop the child through the manager's unload.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

from kvserve.errors import ServerFaultError
from kvserve.remote import RemoteRunner, RemoteSpec
from kvserve.supervisor.child import EngineChild
from kvserve.supervisor.spec import HOST, EngineSpec

log = logging.getLogger("kvserve.server")

__all__ = ["SupervisedRunner", "load_supervised"]


class SupervisedRunner(RemoteRunner):
    """A supervised engine as the manager and the faces hold it: a RemoteRunner pointed at the
    child's loopback URL, plus the child.

    Attributes (beyond RemoteRunner's): ``child`` (the :class:`EngineChild`), ``engine_spec``.
    """

    def __init__(self, engine_spec: EngineSpec, child: EngineChild, upstream_model: str, args: Any, *,
                 model_spec: Any, build_info: str = ""):
        remote = RemoteSpec(engine_spec.name, child.base_url, dialect="openai", model=upstream_model)
        super().__init__(remote, args, model_spec=model_spec, build_info=build_info,
                         on_close=lambda: child.stop("unload"))
        self.engine_spec = engine_spec
        self.child = child
        self.measured_bytes = _rss_bytes(child.pid)
        child.on_restart = self._moved

    def _moved(self, port: int) -> None:
        """The child was restarted on ``port``: requests go there from now on."""
        self.remote = RemoteSpec(self.remote.name, f"http://{HOST}:{port}/v1", dialect="openai",
                                 model=self.remote.model)

    @property
    def device(self) -> str:
        return "engine"

    def require_ready(self) -> None:
        """Raises ServerFaultError when unloaded, or when the child died for good (twice, or
        its restart failed): the message names the model and the cause."""
        super().require_ready()
        if self.child.error is not None:
            raise ServerFaultError(self.child.error)

    def needs_reload(self, spec: Any) -> bool:
        """A child dead for good is started afresh by the next request."""
        return self.child.error is not None


def _rss_bytes(pid: int | None) -> int:
    """The resident bytes of ``pid`` (``/proc``), 0 when unknown."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _served_model(child: EngineChild, fallback: str) -> str:
    """The first model id of the child's ``/v1/models`` (llama-server and vLLM name it by its
    path unless told otherwise), else ``fallback``."""
    try:
        r = httpx.get(child.base_url + "/models", timeout=5.0, trust_env=False)
        if r.status_code == 200 and len(r.content) <= 1 << 20:
            data = r.json().get("data") or []
            if data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str):
                return data[0]["id"]
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return fallback


def load_supervised(engine_spec: EngineSpec, args: Any, model_spec: Any, build_info: str = "") -> SupervisedRunner:
    """Start the engine of ``engine_spec`` and return its runner (worker-thread work: it blocks
    until the child is healthy).

    Raises:
        EngineStartError (a ServerFaultError): the child exited first or was not healthy within its
            start timeout; the message names the model and the cause.
    """
    child = EngineChild(engine_spec)
    child.start()
    try:
        return SupervisedRunner(engine_spec, child, _served_model(child, engine_spec.name), args,
                                model_spec=model_spec, build_info=build_info)
    except BaseException:
        child.stop("load failed")
        raise
