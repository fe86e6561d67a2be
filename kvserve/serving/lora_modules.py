"""vLLM's LoRA adapters chosen by model name (``--lora-modules``, ``/v1/load_lora_adapter``).

Each adapter is a model name of its own (``--lora-modules name=path``, its JSON form ``{"name",
"path", "base_model_name"}``, ``POST /v1/load_lora_adapter``); ``/v1/models`` lists it with
``parent`` (its base) and ``root`` (its path). :class:`LoraServing` keeps the table of these names
(:class:`LoraModulePath`). (Ollama's adapter layers are a store model's own ``ModelSpec.adapters``,
loaded with its runner at global scale 1.0, as Ollama starts llama-server with ``--lora``: see
:meth:`kvserve.serving.state.ServerState.resolve`.)

For an adapter's name :meth:`kvserve.serving.state.ServerState.resolve` answers an
:class:`AdapterSpec`: the base model's spec plus the adapter to apply (:class:`AdapterRef`, scale
1.0). :meth:`LoraServing.attach` then holds the base runner (the manager loads, counts and evicts it
as any model) and makes sure the adapter is in that runner's :class:`~kvserve.lora.LoraRegistry`:
an adapter not in memory is read now (:func:`kvserve.lora.load_adapter`, checked against the base),
at most ``--max-cpu-loras`` of them stay in memory per model (the least recently used idle one is
evicted first; when every one is in use the request waits), and their bytes count in the model's
size in the model manager. The face then sees an :class:`AdapterRunner`: the base runner whose
``lora`` registry's default for a request is that adapter, and whose ``model_alias`` is the
adapter's name (vLLM answers ``"model": "<adapter name>"``). Adapters enter the registry with
global scale 0, so requests for the base model (and llama-server's ``/lora-adapters`` defaults) are
not touched by them. ``--max-loras`` (the engine's distinct adapters per step) holds back rows of
further adapters to a later step: requests queue, none is refused.

Differences from vLLM, on purpose: a failure to read an adapter at ``/v1/load_lora_adapter`` is a
400 ``BadRequestError`` with the reason (vLLM >= 0.10 answers 500 for everything but a missing
path); ``base_model_name`` may be given there too (a kvserve extension: vLLM ties runtime adapters to
its first base model; kvserve's default is the default model); ``--lora-modules`` implies
``--enable-lora``.

Thread-safety: everything runs on the server's event loop; adapter files are read in worker threads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.errors import InvalidInputError, NotFoundError, NotSupportedError
from kvserve.serving.manager import Lease, ModelSpec

if TYPE_CHECKING:  # pragma: no cover
    from kvserve.serving.state import ServerState

log = logging.getLogger("kvserve.server")

#: vLLM's environment variable that turns on /v1/load_lora_adapter and /v1/unload_lora_adapter
ALLOW_RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"

__all__ = ["ALLOW_RUNTIME_ENV", "AdapterRef", "AdapterRunner", "AdapterSpec", "LoraApiError", "LoraModulePath",
           "LoraServing", "parse_lora_module", "parse_lora_modules", "runtime_updates_allowed"]


# -- the flag --------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class LoraModulePath:
    """One vLLM adapter served as a model name (vLLM's ``LoRAModulePath``).

    Attributes:
        name: the model name requests use. path: a PEFT directory or a LoRA GGUF file.
        base_model_name: the served model it applies to (None: the default model).
    """

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(item: str) -> LoraModulePath:
    """One ``--lora-modules`` word as vLLM's ``LoRAParserAction`` reads it: ``name=path`` (a word with
    ``=`` and no ``,``), else a JSON object with ``name``, ``path`` and optionally ``base_model_name``.

    Raises:
        ValueError: vLLM's texts ``Invalid JSON format for --lora-modules: ITEM`` and ``Invalid
            fields for --lora-modules: ITEM - REASON``; an empty name or path.
    """
    if "=" in item and "," not in item:
        name, _, path = item.partition("=")
        if not name or not path:
            raise ValueError(f"Invalid fields for --lora-modules: {item} - expected name=path")
        return LoraModulePath(name, path)
    try:
        d = json.loads(item)
    except json.JSONDecodeError:
        raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
    if not isinstance(d, dict):
        raise ValueError(f"Invalid fields for --lora-modules: {item} - expected a JSON object")
    unknown = sorted(set(d) - {"name", "path", "base_model_name"})
    if unknown:
        raise ValueError(f"Invalid fields for --lora-modules: {item} - unexpected keyword argument "
                         f"'{unknown[0]}'")
    for key in ("name", "path"):
        if not isinstance(d.get(key), str) or not d[key]:
            raise ValueError(f"Invalid fields for --lora-modules: {item} - '{key}' must be a non-empty string")
    base = d.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"Invalid fields for --lora-modules: {item} - 'base_model_name' must be a string")
    return LoraModulePath(d["name"], d["path"], base or None)


def parse_lora_modules(words: list[str]) -> list[LoraModulePath]:
    """Every ``--lora-modules`` word (empty words skipped, as vLLM). Raises ValueError: see
    :func:`parse_lora_module`; a name given twice."""
    out: list[LoraModulePath] = []
    for w in words:
        if w in (None, ""):
            continue
        m = parse_lora_module(w)
        if any(x.name == m.name for x in out):
            raise ValueError(f"--lora-modules: the name {m.name!r} is given twice")
        out.append(m)
    return out


def runtime_updates_allowed(environ: Any = None) -> bool:
    """``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` as vLLM reads it: ``1`` or ``true`` (any case)."""
    env = os.environ if environ is None else environ
    return str(env.get(ALLOW_RUNTIME_ENV, "0")).strip().lower() in ("1", "true")


# -- what a request resolves to -------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class AdapterRef:
    """One adapter a request applies.

    Attributes:
        name: its name in the base runner's LoRA registry (the vLLM model name, or an Ollama
            adapter blob's file name).
        path: its PEFT directory or GGUF file.
        scale: the request's scale (1.0: vLLM and Ollama).
        max_rank: the largest rank accepted (vLLM's ``--max-lora-rank``); None: any (Ollama).
    """

    name: str
    path: str
    scale: float = 1.0
    max_rank: int | None = None


@dataclass(frozen=True)
class AdapterSpec(ModelSpec):
    """A request's model that is a served adapter: the base runner's spec (``name``, ``path``, its
    own ``adapters``...) plus ``selected`` (the adapters this request applies) and ``alias`` (the name
    responses show: the adapter's). The manager never sees it: :meth:`base` is what it loads."""

    selected: tuple[AdapterRef, ...] = ()
    alias: str = ""

    def base(self) -> ModelSpec:
        """The plain ModelSpec of the base runner."""
        return ModelSpec(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ModelSpec)})


class LoraApiError(Exception):
    """An error of vLLM's adapter routes with vLLM's ``type`` and status (the face renders it)."""

    def __init__(self, status: int, message: str, type: str):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type


def _missing(name: str, path: str) -> NotFoundError:
    """vLLM's ``LoRAAdapterNotFoundError`` text."""
    return NotFoundError(f"Loading lora {name} failed: No adapter found for {path}")


# -- the runner a face sees -----------------------------------------------------------------------

class _SelectedRegistry:
    """A runner's LoRA registry whose default for a request (``lora`` None) is ``selection``;
    everything else is the registry's."""

    def __init__(self, registry, selection: tuple[tuple[int, float], ...]):
        self._registry = registry
        self.selection = selection

    def default_lora(self) -> tuple[tuple[int, float], ...]:
        return self.selection

    def resolve(self, lora=None):
        return self._registry.resolve(self.selection if lora is None else lora)

    def __getattr__(self, name: str):
        return getattr(self._registry, name)


class AdapterRunner:
    """A loaded runner seen through one request's adapters: every attribute is the base runner's,
    except ``lora`` (its registry, with this request's adapters as the default ``lora`` tuple of
    ``(adapter id, scale)`` pairs; an explicit per-request ``lora`` field replaces it, as it replaces
    llama-server's global scales), ``model_alias`` and ``served_names`` (the adapter's name).

    Attributes:
        base_runner: the runner it wraps. lora_selection: the ``(id, scale)`` tuple applied.
    """

    def __init__(self, runner, selection: tuple[tuple[int, float], ...], alias: str):
        self.base_runner = runner
        self.lora_selection = selection
        self.lora = _SelectedRegistry(runner.lora, selection)
        self.model_alias = alias
        self.served_names = [alias]

    def __getattr__(self, name: str):
        return getattr(self.base_runner, name)


class AdapterLease:
    """A request's hold on a base runner and on its adapters (:class:`~kvserve.serving.manager.Lease`'s
    interface): :meth:`release` (idempotent) lets the adapters be evicted again, then releases the
    runner."""

    def __init__(self, lease: Lease, runner: AdapterRunner, held: list, cache: "_RunnerAdapters"):
        self._lease, self._held, self._cache = lease, held, cache
        self.runner = runner

    def release(self) -> None:
        if not self._lease.released:
            self._cache.release(self._held)
            self._lease.release()

    @property
    def released(self) -> bool:
        return self._lease.released


# -- the adapters of one runner ---------------------------------------------------------------------

@dataclass
class _Held:
    id: int
    nbytes: int
    path: str
    users: int = 0
    doomed: bool = False  # unloaded by /v1/unload_lora_adapter while in use: removed at its last release


class _RunnerAdapters:
    """The adapters loaded into one runner's registry by this module, in LRU order.

    Args:
        runner: the base runner (its ``lora`` registry). capacity: ``--max-cpu-loras`` (vLLM
            adapters in memory at once). on_bytes: ``(delta bytes)``
            when adapter memory is added or freed (the manager's count of the model's size).
    """

    def __init__(self, runner, capacity: int, on_bytes):
        self._runner = weakref.ref(runner)  # the server's table is keyed weakly by runner: no strong cycle
        self.capacity = max(1, capacity)
        self.on_bytes = on_bytes
        self.held: OrderedDict[str, _Held] = OrderedDict()
        self.loading: dict[str, asyncio.Future] = {}
        self.changed = asyncio.Condition()

    @property
    def runner(self):
        runner = self._runner()
        if runner is None:  # pragma: no cover - a lease holds the runner while this is used
            raise NotFoundError("the model was unloaded")
        return runner

    async def hold(self, ref: AdapterRef) -> int:
        """Make sure ``ref`` is loaded, count one user; its registry id.

        Raises:
            NotFoundError: its path is gone (vLLM's text). InvalidInputError: it does not fit the
            base, or its rank is above ``ref.max_rank`` (vLLM's text).
        """
        while True:
            h = self.held.get(ref.name)
            if h is not None and not h.doomed:
                if h.path != ref.path:  # replaced in place (load_inplace): the old weights go
                    if h.users:
                        await self._wait()
                        continue
                    self._drop(ref.name)
                    continue
                h.users += 1
                self.held.move_to_end(ref.name)
                return h.id
            if h is not None:  # being unloaded: wait for its users to finish
                await self._wait()
                continue
            fut = self.loading.get(ref.name)
            if fut is not None:
                await asyncio.shield(fut)  # a failed load raises here too
                continue
            if self._count() >= self.capacity:
                victim = next((k for k, x in self.held.items() if x.users == 0), None)
                if victim is None:
                    await self._wait()  # every adapter in memory is in use: vLLM queues the request
                    continue
                self._drop(victim)
                continue
            fut = asyncio.get_running_loop().create_future()
            self.loading[ref.name] = fut
            try:
                h = await asyncio.to_thread(self._load, ref)
            except BaseException as e:
                fut.set_exception(e)
                fut.exception()  # retrieved: no "never retrieved" warning when nobody else waits
                raise
            finally:
                self.loading.pop(ref.name, None)
                self._notify()
            self.held[ref.name] = h
            self.on_bytes(h.nbytes)
            fut.set_result(None)
            log.info("LoRA adapter '%s' loaded for model '%s' (rank %s, %.1f MiB)", ref.name,
                     self.runner.model_alias, getattr(self.runner.lora.by_id(h.id).adapter, "rank", "?"),
                     h.nbytes / (1 << 20), extra={"func": "lora"})

    def _count(self) -> int:
        return len(self.held) + sum(1 for k in self.loading if k not in self.held)

    def _load(self, ref: AdapterRef) -> _Held:
        """Worker thread: read, check and register the adapter (global scale 0)."""
        from kvserve.lora import load_adapter

        if not os.path.exists(ref.path):
            raise _missing(ref.name, ref.path)
        reg = self.runner.lora
        adapter = load_adapter(ref.path, reg.base, ref.name)
        if ref.max_rank is not None and adapter.rank > ref.max_rank:
            raise InvalidInputError(f"LoRA rank {adapter.rank} is greater than max_lora_rank {ref.max_rank}.")
        aid = reg.add(adapter, scale=0.0)
        return _Held(aid, reg.installed_nbytes(adapter), ref.path)

    def release(self, names: list[str]) -> None:
        for name in names:
            h = self.held.get(name)
            if h is None:
                continue
            h.users = max(0, h.users - 1)
            if h.users == 0 and h.doomed:
                self._drop(name)
        self._notify()

    def forget(self, name: str) -> None:
        """Unload ``name`` now when idle, else when its last user releases it."""
        h = self.held.get(name)
        if h is None:
            return
        if h.users == 0:
            self._drop(name)
        else:
            h.doomed = True

    def _drop(self, name: str) -> None:
        h = self.held.pop(name)
        try:
            self.runner.lora.remove(h.id)
        except NotFoundError:  # already gone with the runner
            pass
        self.on_bytes(-h.nbytes)
        log.info("LoRA adapter '%s' unloaded from model '%s'", name, self.runner.model_alias, extra={"func": "lora"})
        self._notify()

    async def _wait(self) -> None:
        async with self.changed:
            await self.changed.wait()

    def _notify(self) -> None:
        async def wake():
            async with self.changed:
                self.changed.notify_all()

        asyncio.get_running_loop().create_task(wake())


# -- the server's adapters ---------------------------------------------------------------------------

class LoraServing:
    """The server's vLLM adapter names and the adapters each loaded runner holds.

    Args:
        args: ServerArgs (``enable_lora``, ``lora_modules``, ``max_lora_rank``, ``max_cpu_loras``,
            ``max_loras``).
        environ: the environment (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), default ``os.environ``.

    Attributes:
        modules: served adapter name -> LoraModulePath, in the order added.
        runtime_updates: whether /v1/load_lora_adapter and /v1/unload_lora_adapter exist.
    """

    def __init__(self, args, environ: Any = None):
        self.args = args
        self.enabled = bool(getattr(args, "enable_lora", False))
        self.modules: dict[str, LoraModulePath] = {m.name: m for m in getattr(args, "lora_modules", []) or []}
        self.runtime_updates = runtime_updates_allowed(environ)
        self._runners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._locks: dict[str, asyncio.Lock] = {}

    # -- names

    def lookup(self, name: str | None) -> LoraModulePath | None:
        """The served adapter ``name`` means, or None."""
        return self.modules.get(name) if name else None

    def spec(self, state: "ServerState", module: LoraModulePath) -> AdapterSpec:
        """The AdapterSpec of a served adapter: its base's spec (``base_model_name``, else the
        default model) plus the adapter at scale 1.0, with vLLM's ``--max-lora-rank``.

        Raises:
            NotFoundError: the base model is not served.
        """
        base = state.resolve(module.base_model_name or None)
        ref = AdapterRef(module.name, module.path, 1.0, self.args.max_lora_rank)
        return _with_adapters(base, (ref,), module.name)

    def parent(self, state: "ServerState", module: LoraModulePath) -> str:
        """The name ``/v1/models`` shows as ``parent`` (vLLM: the base model's name)."""
        if module.base_model_name:
            return module.base_model_name
        return state.default_name

    # -- runners

    async def attach(self, state: "ServerState", lease: Lease, spec: AdapterSpec) -> AdapterLease:
        """Hold ``spec``'s adapters in ``lease``'s runner (loading each one not in memory) and
        answer a lease whose runner is an :class:`AdapterRunner`. On any error ``lease`` is
        released.

        Raises:
            InvalidInputError: the model is not generative (an encoder), or an adapter does not fit.
            NotFoundError: an adapter's path is gone.
        """
        runner = lease.runner
        held: list[str] = []
        cache = None
        try:
            if getattr(runner, "lora", None) is None:
                raise InvalidInputError(f"model '{spec.name}' cannot apply LoRA adapters (not a generative model)")
            cache = self._cache(state, runner, spec)
            ids = []
            for ref in spec.selected:
                ids.append((await cache.hold(ref), ref.scale))
                held.append(ref.name)
        except BaseException:
            if cache is not None:
                cache.release(held)
            lease.release()
            raise
        selection = tuple(sorted(ids))
        return AdapterLease(lease, AdapterRunner(runner, selection, spec.alias or spec.name), held, cache)

    def _cache(self, state: "ServerState", runner, spec: AdapterSpec) -> _RunnerAdapters:
        cache = self._runners.get(runner)
        if cache is None:
            name = spec.name
            cache = _RunnerAdapters(runner, self.args.max_cpu_loras,
                                    lambda delta: state.manager.add_bytes(name, delta))
            self._runners[runner] = cache
        return cache

    # -- vLLM's runtime routes

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    async def load(self, state: "ServerState", body: dict) -> str:
        """``POST /v1/load_lora_adapter``: check, load into the base runner (loading the base if it
        is not loaded), add the name. Returns vLLM's success text.

        Raises:
            LoraApiError: vLLM's 400 ``InvalidUserInput`` texts (a field missing, a name taken
            without ``load_inplace``), 404 ``NotFoundError`` (no such path), 400 ``BadRequestError``
            (an adapter that does not fit its base, a rank above ``--max-lora-rank``, no such base).
        """
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path or not isinstance(name, str) or not isinstance(path, str):
            raise LoraApiError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        inplace = body.get("load_inplace") is True
        base_name = body.get("base_model_name")
        if base_name is not None and not isinstance(base_name, str):
            raise LoraApiError(400, "'base_model_name' must be a string", "BadRequestError")
        async with self._lock(name):
            if name in self.modules and not inplace:
                raise LoraApiError(400, f"The lora adapter '{name}' has already been loaded. If you want to load "
                                        "the adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
            if not self.enabled:
                raise LoraApiError(400, "LoRA is not enabled: start the server with --enable-lora",
                                   "BadRequestError")
            if name not in self.modules and await asyncio.to_thread(_served_model_name, state, name):
                # an adapter by a served model's name would answer that model's every client
                raise LoraApiError(400, f"The lora adapter name '{name}' is the name of a served model: "
                                        "choose another name.", "BadRequestError")
            module = LoraModulePath(name, path, base_name or None)
            if not os.path.exists(path):
                raise LoraApiError(404, str(_missing(name, path)), "NotFoundError")
            try:
                spec = self.spec(state, module)
                lease = await state.acquire(spec)  # loads the adapter: it is checked against its base
                lease.release()
            except LoraApiError:
                raise
            except NotFoundError as e:
                if "No adapter found" in str(e):
                    raise LoraApiError(404, str(e), "NotFoundError") from None
                raise LoraApiError(400, str(e), "BadRequestError") from None
            except (InvalidInputError, NotSupportedError) as e:
                raise LoraApiError(400, str(e), "BadRequestError") from None
            self.modules[name] = module
        log.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path, extra={"func": "lora"})
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: dict) -> str:
        """``POST /v1/unload_lora_adapter``: the name goes at once; each runner drops the adapter
        when its last request under it ends. Returns vLLM's success text.

        Raises:
            LoraApiError: 400 ``InvalidUserInput`` (no ``lora_name``), 404 ``NotFoundError``.
        """
        name = body.get("lora_name")
        if not name or not isinstance(name, str):
            raise LoraApiError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        async with self._lock(name):
            if name not in self.modules:
                raise LoraApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
            del self.modules[name]
            for cache in list(self._runners.values()):
                cache.forget(name)
        log.info("Removed LoRA adapter: name '%s'", name, extra={"func": "lora"})
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def check_static(self, state: "ServerState") -> None:
        """Start-up: every ``--lora-modules`` adapter read and checked against its base (vLLM's
        ``init_static_loras``: a bad one stops the server). Only where the base is loaded
        already (``-m``); else its path is checked and the adapter loads on first use.

        Raises:
            NotFoundError / InvalidInputError / NotSupportedError: the first bad adapter.
        """
        for m in list(self.modules.values()):
            if not os.path.exists(m.path):
                raise _missing(m.name, m.path)
            spec = self.spec(state, m)
            if state.manager.get(spec.name) is not None:
                lease = await state.acquire(spec)
                lease.release()


def _with_adapters(base: ModelSpec, refs: tuple[AdapterRef, ...], alias: str) -> AdapterSpec:
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelSpec)}
    return AdapterSpec(**fields, selected=refs, alias=alias)


def _served_model_name(state: "ServerState", name: str) -> bool:
    """True when ``name`` already names a model this server serves (a loaded or store model, a
    remote or supervised one, the pinned model's served names): a runtime adapter may not take it
    (kvserve refuses it where vLLM would let the adapter shadow the base for every client)."""
    for m in state.catalog():
        if name == m.name or name in m.aliases:
            return True
    if state.pinned:
        return name in state.args.served_names()
    try:
        return state._store_path(name) is not None
    except (OSError, ValueError):
        return False
