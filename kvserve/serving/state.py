"""Per-process server state: the flags, the model manager, and which names are servable.

``ServerState`` resolves the ``model`` a request names (:meth:`ServerState.resolve`) and hands
out runners through the :class:`~kvserve.serving.manager.ModelManager`
(:meth:`ServerState.acquire`). A name resolves, in order:

1. with ``-m/--model`` (llama-server's single-model mode) every name is that model: the pinned
   runner, never unloaded, answers any ``model`` (llama-server does the same);
2. a model in the store (names as ``kvserve list`` shows them, aliases, ``:latest``);
3. with ``--allow-model-paths``, a path to a ``.gguf`` file or an HF directory on the server
   (off by default: a remote client must not make the server open its files);
4. else :class:`~kvserve.errors.NotFoundError` ``model 'x' not found``.

A request that names no model gets the default model (``-m``, else the default store model).

Thread-safety: read and changed only on the server's asyncio loop (the preload runs its file
work in worker threads).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.config import mem_available_bytes
from kvserve.errors import (
    InvalidInputError,
    NotFoundError,
    ServerFaultError,
    UnavailableError,
)
from kvserve.serving.lora_modules import AdapterSpec, LoraServing
from kvserve.serving.manager import Lease, ModelManager, ModelSpec, format_keep_alive
from kvserve.serving.metrics import KeptMetrics
from kvserve.serving.chat_runner import (
    Runner,
    estimate_runner_memory,
    load_runner,
    trim_heap,
)

if TYPE_CHECKING:  # pragma: no cover
    from kvserve.serving.args import ServerArgs
    from kvserve.serving.metrics import Metrics

log = logging.getLogger("kvserve.server")

MAX_MODEL_NAME = 1024


def build_info() -> str:
    """``b<commits>-<sha7>`` from the source checkout's git, else ``kvserve-<version>``."""
    root = Path(__file__).resolve().parents[2]
    try:
        def git(*a: str) -> str:
            return subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True,
                                  timeout=5, check=True).stdout.strip()

        return f"b{git('rev-list', '--count', 'HEAD')}-{git('rev-parse', '--short=7', 'HEAD')}"
    except (OSError, subprocess.SubprocessError):
        try:
            from importlib.metadata import version

            return f"kvserve-{version('kvserve')}"
        except Exception:  # noqa: BLE001 - metadata missing in odd installs
            return "kvserve-0"


@dataclass
class ServableModel:
    """One row of the catalog (``GET /v1/models``): a model that a request may name."""

    name: str
    path: str
    aliases: list[str]
    runner: Runner | None  # loaded now
    loading: bool
    size: int  # bytes of the file(s)
    modified: float  # seconds since the epoch (file mtime)
    remote: Any = None  # a remote model's RemoteSpec (kvserve.remote), None for a local one

    @property
    def available(self) -> bool:
        """False for a remote model whose upstream failed its latest check or request."""
        return self.runner is None or getattr(self.runner, "available", True)


class ServerState:
    """Everything one server process shares between requests.

    Attributes:
        args: the parsed command line (ServerArgs).
        manager: the ModelManager (which runners are loaded).
        build_info: ``b<N>-<sha7>`` or ``kvserve-<version>``.
        pinned: started with ``-m``: one model, never unloaded, answers every name.
        default_name: what a request that names no model gets.
        preloading: True while the start-up model loads (``/health`` answers 503).
        load_error: message when the start-up model failed to load (the server then exits).
    """

    def __init__(self, args: "ServerArgs", manager: ModelManager | None = None):
        self.args = args
        self.build_info = build_info()
        self.pinned = bool(args.model_given)
        names = list(args.served_names())
        self.default_name = names[0] if self.pinned else args.model
        self._pinned_spec: ModelSpec | None = None
        self.preloading = False
        self.load_error: str | None = None
        if not self.pinned:  # several models share the host tier of the prompt cache
            args.cache_ram_share = max(1, args.max_loaded_models)
        # with -m (llama-server's mode) the one model loads whatever it takes, unless --max-memory
        check_memory = not self.pinned or args.max_memory is not None
        #: remote models (``--remote``; kvserve.remote): served name -> RemoteSpec
        self.remotes = {r.name: r for r in getattr(args, "remote", None) or ()}
        #: supervised engines (``--engine``; kvserve.supervisor): served name -> EngineSpec
        self.engines = {e.name: dataclasses.replace(e, start_timeout_s=getattr(args, "engine_start_timeout", 600.0))
                        for e in getattr(args, "engine", None) or ()}
        #: remote models of the store (Modelfile REMOTE), found on first use: name -> RemoteSpec
        self.store_remotes: dict = {}
        self._refused_remotes: set[str] = set()  # store remote models outside OLLAMA_REMOTES (warned once)
        self.manager = manager or ModelManager(
            self._load, estimate=self._estimate, enforce_memory=check_memory,
            max_loaded=args.max_loaded_models, default_keep_alive=args.keep_alive,
            max_memory=args.max_memory, mem_available=mem_available_bytes, max_queue=args.max_queue,
            on_event=self._log_event, cleanup=trim_heap)
        self.started = time.time()
        self.preload_task: asyncio.Task | None = None
        #: called with each runner once it has loaded (on the event loop): a face keeps what it
        #: must still answer while the model sleeps (the llama face's /props)
        self.on_loaded: list[Callable[[Runner], None]] = [self._keep_metrics]
        #: each model's latest Metrics (served name -> Metrics, bounded): /metrics answers from it
        #: while the model sleeps or is unloaded, and the next runner of that name continues its counters
        self.kept_metrics = KeptMetrics()
        #: the tools /tools serves (kvserve.tools): --tools' built-in ones, then what MCP servers add
        from kvserve.tools import ToolRegistry

        self.tools = ToolRegistry.from_names(getattr(args, "tools", None) or [], getattr(args, "tools_runtime", None),
                                             confine=bool(getattr(args, "tools_confine", False)))
        #: the MCP servers of --mcp-servers-config / --mcp-servers-json (kvserve.tools.mcp.McpManager), or None
        self.mcp = None
        #: vLLM's served LoRA adapters (--lora-modules, /v1/load_lora_adapter) and the adapters each
        #: runner holds (kvserve.serving.lora_modules)
        self.loras = LoraServing(args)

    # -- names

    def resolve(self, name: str | None) -> ModelSpec:
        """The ModelSpec a request's ``model`` means (see the module docstring).

        Raises:
            NotFoundError: ``model 'x' not found``.
            InvalidInputError: a name longer than 1,024 characters.
            UnavailableError: ``Loading model`` while the pinned model's file is being found.
        """
        if name is not None and len(name) > MAX_MODEL_NAME:
            raise InvalidInputError(f"Field 'model': longer than {MAX_MODEL_NAME} characters")
        module = self.loras.lookup(name)
        if module is not None:  # a vLLM adapter's name: its base with the adapter (AdapterSpec)
            return self.loras.spec(self, module)
        remote = self.remote_spec(name) or self.engine_spec(name)
        if remote is not None:
            return remote
        if self.pinned:
            if self._pinned_spec is None:
                raise UnavailableError("Loading model")
            return self._pinned_spec
        if not name:
            name = self.default_name
        found = self._store_path(name)
        if found is not None:  # a store model; its adapter layers load with it at scale 1 (Ollama's --lora)
            return ModelSpec(found[0], found[1], adapters=tuple((p, 1.0) for p in found[2]))
        if self.args.allow_model_paths:
            spec = self._path_spec(name)
            if spec is not None:
                return spec
        loaded = self.manager.get(name)  # e.g. a path model loaded before its file was removed
        if loaded is not None:
            return loaded.spec
        raise NotFoundError(f"model '{name[:256]}' not found")

    def remote_spec(self, name: str | None) -> ModelSpec | None:
        """The ModelSpec of remote model ``name`` (``--remote``, or a store model created with a
        Modelfile's REMOTE: :meth:`store_remote`), else None. A remote model is pinned (never
        unloaded by keep_alive or to make room) and has no memory."""
        if not name:
            return None
        if name not in self.remotes:
            if self.pinned:  # with -m every other name is that model (the store is not read)
                return None
            found = self.store_remote(name)
            if found is None:
                return None
            name = found.name
        return ModelSpec(name, pinned=True, remote=True)

    def engine_spec(self, name: str | None) -> ModelSpec | None:
        """The ModelSpec of supervised engine ``name`` (``--engine``), else None. Served as a
        remote model (no memory estimate, not counted against ``--max-loaded-models``: the
        child's memory is its own) but not pinned: keep_alive and eviction unload it, which
        stops the child."""
        if not name:
            return None
        if name not in self.engines:
            found = self._store_engine(name)
            if found is None:
                return None
            name = found.name
        return ModelSpec(name, pinned=False, remote=True)

    def all_engines(self) -> dict:
        """Every supervised engine a request may name: ``--engine``'s and (without ``-m``) the
        store's ENGINE models (kvserve.supervisor.modelfile); served name -> EngineSpec."""
        if not self.pinned:
            from kvserve.store import open_store
            from kvserve.supervisor.modelfile import engine_files

            for eng in engine_files(open_store(self.args.models_dir).root):
                self.engines.setdefault(eng.name, dataclasses.replace(
                    eng, start_timeout_s=getattr(self.args, "engine_start_timeout", 600.0)))
        return self.engines

    def _store_engine(self, name: str):
        """The store's ENGINE model ``name`` means (``kvserve create`` with an ENGINE line:
        kvserve.supervisor.modelfile), remembered in :attr:`engines`; else None."""
        from kvserve.store import canonical_name, open_store
        from kvserve.supervisor.modelfile import find_engine

        if self.pinned:  # with -m only --engine's
            return None
        try:
            display = canonical_name(name, self.args.models_dir)
        except ValueError:
            return None
        found = find_engine(open_store(self.args.models_dir).root, display)
        if found is None:
            return None
        found = dataclasses.replace(found, start_timeout_s=getattr(self.args, "engine_start_timeout", 600.0))
        self.engines[found.name] = found
        return found

    def _find_store_remotes(self) -> None:
        """Every store model whose config names a remote upstream, into :attr:`store_remotes`."""
        from kvserve.store import open_store

        try:
            stored = open_store(self.args.models_dir).list()
        except OSError:
            return
        for m in stored:
            if m.model_path is None and m.display not in self.store_remotes:
                try:
                    self.store_remote(m.display)
                except InvalidInputError:
                    pass  # its host is not in OLLAMA_REMOTES: logged, never contacted

    def remote_of(self, name: str):
        """The RemoteSpec of remote model ``name`` (a flag's or the store's). KeyError: none."""
        return self.remotes[name] if name in self.remotes else self.store_remotes[name]

    def store_remote(self, name: str):
        """The RemoteSpec of store model ``name`` when its config names a remote upstream
        (``remote_host``: kvserve's Modelfile REMOTE, or Ollama's create with ``remote_host``; an
        Ollama-created one speaks Ollama's dialect), kept in :attr:`store_remotes`; else None.
        Raises InvalidInputError (Ollama's 400 ``this server cannot run this remote model``) when
        its host is not in ``OLLAMA_REMOTES`` (:func:`kvserve.remote.remote_host_allowed`): the
        store is writable by any client of ``/api/create``, so its models may not send requests
        and the key of their ``remote_key_env`` to hosts the operator did not allow."""
        import json as _json

        from kvserve.store import canonical_name, open_store

        try:
            store = open_store(self.args.models_dir)
            stored = store.get(canonical_name(name, self.args.models_dir))
        except (ValueError, OSError):
            return None
        if stored is None or stored.model_path is not None or stored.manifest.config is None:
            return None
        try:
            cfg = _json.loads(store.blob_path(stored.manifest.config.digest).read_bytes())
        except (OSError, ValueError):
            return None
        if not isinstance(cfg, dict) or not cfg.get("remote_host"):
            return None
        from kvserve.remote import RemoteSpec

        try:
            spec = RemoteSpec(stored.display, str(cfg["remote_host"]), str(cfg.get("remote_dialect") or "ollama"),
                              str(cfg.get("remote_model") or ""), str(cfg.get("remote_key_env") or "") or None)
        except InvalidInputError as e:
            log.warning("store model '%s': its remote upstream is not usable: %s", stored.display, e)
            return None
        from kvserve.remote import REMOTE_NOT_ALLOWED, remote_host_allowed

        if not remote_host_allowed(spec.base_url):
            if spec.name in self._refused_remotes:
                raise InvalidInputError(REMOTE_NOT_ALLOWED)
            self._refused_remotes.add(spec.name)  # logged once, not at every listing
            log.warning("store model '%s': its remote host %s is not in OLLAMA_REMOTES: %s", stored.display,
                        spec.shown_url, REMOTE_NOT_ALLOWED)
            raise InvalidInputError(REMOTE_NOT_ALLOWED)
        self.store_remotes[spec.name] = spec
        return spec

    def _load(self, spec: ModelSpec):
        """The manager's loader: a supervised engine's :class:`kvserve.supervisor.SupervisedRunner`
        (its child started and healthy), a :class:`kvserve.remote.RemoteRunner` for a remote
        model, else :func:`load_runner`."""
        if spec.remote and spec.name in self.engines:
            from kvserve.supervisor import load_supervised

            return load_supervised(self.engines[spec.name], self.args, spec, self.build_info)
        if spec.remote:
            from kvserve.remote import RemoteRunner

            return RemoteRunner(self.remote_of(spec.name), self.args, model_spec=spec, build_info=self.build_info)
        return load_runner(self.args, spec, self.build_info)

    def _estimate(self, spec: ModelSpec):
        from kvserve.serving.manager import NO_ESTIMATE

        return NO_ESTIMATE if spec.remote else estimate_runner_memory(self.args, spec)

    async def start_remotes(self) -> None:
        """Start-up: check every remote model's upstream (seed 004 Example 13: ok, rejected key, no
        server, each logged with its own message) and hold its runner. An upstream that fails the
        check does not stop the server: its model lists as unavailable and its requests answer
        502/503 with the upstream's reason until it answers."""
        if not self.remotes and not self.store_remotes and self.pinned:
            return
        from kvserve.remote import check_remote  # httpx: only with remote models

        async def one(remote) -> None:
            spec = self.remote_spec(remote.name)
            check = await asyncio.to_thread(check_remote, remote)
            level = logging.INFO if check.ok else logging.WARNING
            log.log(level, "remote model '%s' (%s, %s): %s", remote.name, remote.dialect, remote.shown_url,
                    check.message, extra={"func": "remote"})
            try:
                await self.manager.preload(spec)
            except Exception as e:  # noqa: BLE001 - one remote model's trouble is not the server's
                log.error("remote model '%s': %s", remote.name, e, extra={"func": "remote"})
                return
            e = self.manager.get(remote.name)
            if e is not None and e.runner is not None:
                e.runner.last_check = check

        if not self.pinned:
            await asyncio.to_thread(self._find_store_remotes)
        await asyncio.gather(*(one(r) for r in {**self.store_remotes, **self.remotes}.values()))

    def _store_path(self, name: str) -> tuple[str, str, list[str]] | None:
        """``(display name, model blob, adapter blobs)`` of the store model ``name`` means (any of Ollama's forms:
        ``smollm2``, ``smollm2:latest``, ``registry.ollama.ai/library/smollm2:latest``, or a
        registry alias), else None (no such model, no weights blob, or not a valid name)."""
        from kvserve.store import canonical_name, open_store

        store = open_store(self.args.models_dir)
        try:
            stored = store.get(canonical_name(name, self.args.models_dir))
        except ValueError:  # not a valid Ollama name (InvalidModelNameError): maybe a path
            return None
        if stored is None or stored.model_path is None:
            return None
        adapters = [str(store.blob_path(x.digest)) for x in stored.manifest.layers_of("adapter")]
        return stored.display, str(stored.model_path), adapters

    def _path_spec(self, name: str) -> ModelSpec | None:
        p = Path(name).expanduser()
        try:
            if not (p.is_file() or p.is_dir()):
                return None
            from kvserve.loaders.detect import detect

            found = detect(p, deep=False)
        except OSError:
            return None
        if found.format.key in ("unknown", "not-gguf"):  # not a model: "not found", as before
            return None
        found.require_loadable()  # ONNX, EXL2, MLX...: the format's one line (a NotSupportedError)
        if found.weights is not None:
            p = Path(found.weights)
        full = str(p.resolve())
        from kvserve.store import list_models

        for m in list_models(self.args.models_dir):  # a store blob named by its path is that store model (one runner)
            if str(Path(m["path"]).resolve()) == full:
                return ModelSpec(m["name"], m["path"])
        return ModelSpec(full, full)

    def catalog(self) -> list[ServableModel]:
        """Every model a request may name now: loaded ones and the store's, sorted by name
        (the pinned model alone with ``-m``)."""
        out: dict[str, ServableModel] = {}
        for e in list(self.manager.loaded.values()):
            out[e.name] = ServableModel(e.name, e.spec.path, e.spec.served_names(), e.runner,
                                        e.runner is None, *_file_facts(e.spec.path))
        if not self.pinned:
            self._find_store_remotes()
        for name, r in {**self.store_remotes, **self.remotes}.items():
            if name not in out:
                out[name] = ServableModel(name, "", [name], None, False, 0, 0.0)
            out[name].remote = r
        for name in self.all_engines():  # supervised engines: listed as remote models while their child runs
            if name not in out:
                out[name] = ServableModel(name, "", [name], None, False, 0, 0.0)
            elif out[name].runner is not None:
                out[name].remote = out[name].runner.remote
        if self.pinned:
            if self._pinned_spec is not None and self._pinned_spec.name not in out:
                s = self._pinned_spec
                out[s.name] = ServableModel(s.name, s.path, s.served_names(), None, self.preloading,
                                            *_file_facts(s.path))
            return list(out.values())
        from kvserve.store import list_models

        for m in list_models(self.args.models_dir):
            if m["name"] not in out:
                out[m["name"]] = ServableModel(m["name"], m["path"], [m["name"]], None, False,
                                               *_file_facts(m["path"]))
        return [out[k] for k in sorted(out)]

    # -- runners

    async def acquire(self, model: str | ModelSpec | None, keep_alive: float | None = None) -> Lease:
        """Hold the runner for ``model`` (a request's name, or a spec :meth:`resolve` gave) for
        one request, loading it if needed: the one way a face holds a model.

        Raises:
            NotFoundError, UnavailableError, ServerFaultError: see :meth:`resolve` and
            :meth:`ModelManager.acquire`; ServerFaultError also when the runner's engine died.
        """
        self.require_up()
        spec = model if isinstance(model, ModelSpec) else self.resolve(model)
        if isinstance(spec, AdapterSpec):  # the base runner, with the request's adapters held in it
            lease = _ready(await self.manager.acquire(spec.base(), keep_alive))
            return await self.loras.attach(self, lease, spec)
        return _ready(await self.manager.acquire(spec, keep_alive))

    def hold_loaded(self, name: str | None) -> Lease:
        """Hold the runner of ``name`` only when it is loaded and ready, leaving its keep_alive
        and expiry as they were (:meth:`ModelManager.hold_loaded`).

        Raises:
            NotFoundError: an unknown name; UnavailableError: not loaded, or loading;
            ServerFaultError: its engine died.
        """
        self.require_up()
        return _ready(self.manager.hold_loaded(self.resolve(name).name))

    def peek(self, name: str | None) -> Runner | None:
        """The loaded runner for ``name`` without loading anything (None when not loaded).

        Raises:
            NotFoundError: an unknown name.
        """
        spec = self.resolve(name)
        e = self.manager.get(spec.name)
        return e.runner if e is not None else None

    def peek_metrics(self, name: str | None) -> Metrics | None:
        """``name``'s Metrics without loading anything: the loaded runner's, else the snapshot
        its last runner left (a sleeping model), else None (never loaded).

        Raises:
            NotFoundError: an unknown name.
        """
        runner = self.peek(name)
        if runner is not None:
            return runner.metrics
        return self.kept_metrics.get(self.resolve(name).name)

    def require_up(self) -> None:
        """``/health``: 503 ``Loading model`` while the start-up model loads, 500 when it failed
        or the pinned model's engine died."""
        if self.load_error:
            raise ServerFaultError(f"model failed to load: {self.load_error}")
        if self.preloading:
            raise UnavailableError("Loading model")
        if self.pinned:
            e = self.manager.get(self._pinned_spec.name) if self._pinned_spec is not None else None
            if e is None or e.runner is None:
                if self._pinned_spec is not None and self._pinned_spec.sleep_s is not None:
                    return  # asleep (--sleep-idle-seconds): the request loads it again
                raise UnavailableError("Loading model")
            e.runner.require_ready()

    # -- start-up

    def preload_blocking_part(self) -> ModelSpec:
        """Find (pulling if needed) the start-up model's files: worker-thread work. Its spec carries
        the ``--lora`` / ``--lora-scaled`` adapters (ServerArgs.lora_adapters)."""
        import dataclasses

        spec = self._startup_spec()
        adapters = self.args.lora_adapters() if hasattr(self.args, "lora_adapters") else ()
        adapters = self._store_adapters() + tuple(adapters)  # a store model's ADAPTER layers first
        return dataclasses.replace(spec, adapters=adapters) if adapters else spec

    def _store_adapters(self) -> tuple[tuple[str, float], ...]:
        """The start-up model's adapter layers (``(blob path, 1.0)``) when it is a store model."""
        if Path(self.args.model).expanduser().exists():
            return ()
        found = self._store_path(self.args.model)
        return tuple((p, 1.0) for p in found[2]) if found is not None else ()

    def _startup_spec(self) -> ModelSpec:
        from kvserve.store import resolve_model

        given = Path(self.args.model).expanduser()
        path = str(given) if given.is_file() else str(resolve_model(self.args.model, pull_missing=not getattr(self.args, "offline", False),
                                                                      models_dir=self.args.models_dir))
        if self.pinned:
            names = tuple(self.args.served_names())
            sleep = getattr(self.args, "sleep_idle_seconds", -1)
            return ModelSpec(names[0], path, pinned=True, names=names, sleep_s=sleep if sleep >= 0 else None)
        if given.is_file() or given.is_dir():
            full = str(given.resolve())
            return ModelSpec(full, full)
        from kvserve.store import canonical_name

        return ModelSpec(canonical_name(self.args.model, self.args.models_dir), path)

    async def preload(self) -> None:
        """Load the start-up model: the pinned one, else the default (its keep_alive starts at
        once). Raises what the load raised (the server reports it and exits)."""
        self.preloading = True
        try:
            spec = await asyncio.to_thread(self.preload_blocking_part)
            if self.pinned:
                self._pinned_spec = spec
            await self.manager.preload(spec)
        finally:
            self.preloading = False
        await self.loras.check_static(self)  # vLLM: a bad --lora-modules adapter stops the server

    def _keep_metrics(self, runner: Runner) -> None:
        """``on_loaded`` hook: a reloaded model's runner takes over the counters its previous
        runner left (llama-server keeps its metrics through sleep), else its own are kept."""
        self.kept_metrics.keep(runner.spec.name, runner)

    def _log_event(self, t: float, action: str, name: str, reason: str) -> None:
        m = self.manager
        if action == "load":
            e = m.loaded.get(name)
            if e is not None and e.spec.remote:
                log.info("model manager: load remote model '%s' (no memory, not counted)", name, extra={"func": "manager"})
            else:
                log.info("model manager: load '%s' (%d of at most %d loaded)%s", name,
                         sum(not x.spec.remote for x in m.loaded.values()), m.max_loaded,
                         f", {reason}" if reason else "", extra={"func": "manager"})
        elif action == "loaded":
            e = m.loaded.get(name)
            keep = "forever (pinned)" if e is not None and e.spec.pinned else \
                format_keep_alive(e.keep_alive if e is not None and e.keep_alive >= 0 else math.inf)
            log.info("model manager: '%s' loaded, %s, keep_alive %s", name, reason, keep, extra={"func": "manager"})
        elif action == "unload":
            log.info("model manager: unload '%s' (%s)", name, reason, extra={"func": "manager"})
        elif action == "fail":
            log.error("model manager: '%s' failed to load: %s", name, reason, extra={"func": "manager"})
        if action == "loaded" and (e := m.loaded.get(name)) is not None and e.runner is not None:
            for hook in self.on_loaded:
                hook(e.runner)


def _ready(lease: Lease) -> Lease:
    """``lease`` when its runner is ready; else the lease is released and the runner's error
    (ServerFaultError: its engine died) raised."""
    try:
        lease.runner.require_ready()
    except BaseException:
        lease.release()
        raise
    return lease


def _file_facts(path: str) -> tuple[int, float]:
    p = Path(path)
    try:
        if p.is_dir():
            files = [f for f in p.iterdir() if f.is_file()]
            return sum(f.stat().st_size for f in files), max((f.stat().st_mtime for f in files), default=0.0)
        st = p.stat()
        return st.st_size, st.st_mtime
    except OSError:
        return 0, 0.0
