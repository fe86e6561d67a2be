"""The model manager: the one owner of which models are loaded (Ollama's scheduler).

Each loaded model is a *runner* (here :class:`~kvserve.serving.chat_runner.Runner`, or anything with
``close()``): its engine with its own engine thread, tokenizer, template and slots. The manager
keeps a reference count per runner (requests in progress) and applies Ollama's rules
(004_f1934c15643344cc.txt, Example 2) exactly:

- when a runner's count drops to zero its ``keep_alive`` timer starts; when it fires the runner
  is unloaded (``keep_alive elapsed``);
- the latest request's ``keep_alive`` wins; 0 unloads as soon as the count is zero
  (``keep_alive 0``); a negative one keeps the runner forever;
- at most ``max_loaded`` runners: to make room, runners are sorted by keep_alive (forever last),
  then by name, and the first *idle* one is unloaded (``make room``). When none is idle the
  request waits (``waiting`` counts it) until one is: a running request is never killed;
- before loading, the runner's size is predicted (:func:`estimate_memory`); idle runners are
  unloaded until it fits in the memory available (``mem_available()``, capped by ``max_memory``).
  When it cannot fit even with every idle and busy runner gone the request is refused with
  :class:`~kvserve.errors.UnavailableError` naming the MiB needed and available; when it would
  fit once busy runners finish, it waits;
- concurrent requests for a model that is loading share one load; a failed load fails those
  requests with its error and leaves every other runner serving;
- a request whose options need another context size reloads the runner (when it is idle).

Loading and unloading run in worker threads (``asyncio.to_thread``): the event loop and other
runners' engine threads go on meanwhile. One load runs at a time, so that two large loads do
not both count on the same free memory.

Time comes from ``clock`` (seconds, monotonic) so tests drive the rules with a fake clock; in a
server :meth:`ModelManager.start_reaper` runs a task that wakes at the next expiry. Every change
is reported to ``on_event(t, action, name, reason)``; the server logs it.

Thread-safety: every method is called on one asyncio loop.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import re
import time
import traceback
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.errors import InvalidInputError, ServerFaultError, UnavailableError

log = logging.getLogger("kvserve.server")

MIB = 1 << 20
DEFAULT_KEEP_ALIVE_S = 300.0  # Ollama's envconfig.KeepAlive default, 5 minutes
DEFAULT_MAX_LOADED = 3  # Ollama's defaultModelsPerGPU
DEFAULT_MAX_QUEUE = 512  # Ollama's OLLAMA_MAX_QUEUE
MAX_KEEP_ALIVE_S = 10.0 ** 9  # ~31 years: a larger value means "forever"
FAILURE_MEMO_S = 5.0  # a model that failed to load fails requests at once for this long


class _KeepCurrent(float):
    """``keep_alive`` that leaves a loaded runner's keep_alive as it is (read-only routes)."""


KEEP_CURRENT = _KeepCurrent(0.0)


class LoadFailedError(ServerFaultError):
    """A model failed to load (a face answers 500 with ``message``).

    Attributes:
        cause_type: the class of the loader's exception (e.g. ModelLoadError).
        detail: its one-line text, as the loader wrote it (paths included: for the log).
    """

    def __init__(self, message: str, cause_type: type = Exception, detail: str = ""):
        super().__init__(message)
        self.cause_type = cause_type
        self.detail = detail or message

    @classmethod
    def of(cls, spec: "ModelSpec", exc: BaseException) -> "LoadFailedError":
        """From the loader's exception; the client's text names the model, not the server's path."""
        detail = _one_line(exc)
        shown = detail.replace(spec.path, spec.name) if spec.path else detail
        return cls(f"model '{spec.name}' failed to load: {shown}", type(exc), detail)

# -- keep_alive ---------------------------------------------------------------------------

_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def parse_keep_alive(value: Any, field_name: str = "keep_alive") -> float:
    """Ollama's ``keep_alive`` -> seconds; ``math.inf`` means forever.

    Accepts what Ollama accepts: a number of seconds (JSON number), a Go duration string
    (``"10m"``, ``"1h30m"``, ``"300ms"``, ``"-1s"``), or a number as a string (``"-1"``,
    ``"300"``: seconds, as ``OLLAMA_KEEP_ALIVE`` takes it). Any negative value keeps the model
    loaded forever; 0 unloads it when its last request ends. Values beyond 10^9 s count as
    forever.

    Integers beyond float range count as forever. Raises:
        InvalidInputError: anything else (naming ``field_name``): booleans, NaN, +-Infinity,
            strings that are neither a duration nor a number, other JSON types.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidInputError(f"Field '{field_name}': expected a number of seconds or a duration "
                                f"string such as \"5m\", got {type(value).__name__}")
    if isinstance(value, float) and math.isinf(value):
        raise InvalidInputError(f"Field '{field_name}': must be a finite number of seconds (-1 keeps the model "
                                "loaded forever)")
    if isinstance(value, str):
        s = value.strip()
        if len(s) > 64:
            raise InvalidInputError(f"Field '{field_name}': duration string too long")
        if _NUMBER.fullmatch(s):
            seconds = float(s)
        else:
            seconds = _parse_go_duration(s)
            if seconds is None:
                raise InvalidInputError(f"Field '{field_name}': invalid duration {value[:64]!r} "
                                        "(expected e.g. \"5m\", \"1h30m\", \"-1\" or a number of seconds)")
    else:
        try:
            seconds = float(value)
        except OverflowError:  # an integer beyond float range: as long as any, or forever if negative
            return math.inf
    if math.isnan(seconds):
        raise InvalidInputError(f"Field '{field_name}': must be a number of seconds, not NaN")
    if seconds < 0 or seconds > MAX_KEEP_ALIVE_S:
        return math.inf
    return seconds


def _parse_go_duration(s: str) -> float | None:
    """Go's ``time.ParseDuration`` grammar: ``[-+]?(\\d*(\\.\\d*)?unit)+`` or ``0``."""
    sign = 1.0
    if s[:1] in "+-" and s:
        sign = -1.0 if s[0] == "-" else 1.0
        s = s[1:]
    if s == "0":
        return 0.0
    if not s:
        return None
    pos, total = 0, 0.0
    while pos < len(s):
        m = _GO_PART.match(s, pos)
        if m is None:
            return None
        total += float(m.group(1)) * _GO_UNITS[m.group(2)]
        pos = m.end()
    return sign * total


def format_keep_alive(seconds: float) -> str:
    """Seconds -> a Go-style duration for logs (``5m0s``, ``forever``)."""
    if math.isinf(seconds):
        return "forever"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return (f"{h}h" if h else "") + (f"{m}m" if h or m else "") + f"{sec}s"


# -- memory -------------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted memory of one runner in bytes, before it loads (seed 004 Example 5).

    Attributes:
        weights: bytes of weights as held in memory (Ollama counts the whole file; kvserve adds
            the dense copy it keeps for large batches, see :func:`weights_in_memory`).
        kv: bytes of the KV cache, 2 x layers x kv_heads x head_dim x n_ctx x bytes per element.
        compute: bytes of the compute buffers (activations and logits of one batch).
        cache: bytes the host tier of the prompt cache may grow to (``--cache-ram``), which
            Ollama's llama-server children do not have.
        tokenizer: bytes of the tokenizer's tables (vocabulary, merges, piece bytes).

    :attr:`resident` is what the model adds to the process's resident memory once loaded with
    its KV cache written (``/proc``'s VmRSS growth, KV counted as the manager's measured size
    counts it); ``compute`` comes on top while a batch runs, ``cache`` as the host tier fills.
    """

    weights: int
    kv: int
    compute: int = 0
    cache: int = 0
    tokenizer: int = 0

    @property
    def total(self) -> int:
        """weights + kv + compute + cache + tokenizer: what the manager reserves."""
        return self.weights + self.kv + self.compute + self.cache + self.tokenizer

    @property
    def total_mib(self) -> float:
        return self.total / MIB

    @property
    def resident(self) -> int:
        """weights + kv + tokenizer (bytes)."""
        return self.weights + self.kv + self.tokenizer

    def summary(self) -> str:
        """The log's text: ``estimate 787 MiB resident (weights 638, KV 128, tokenizer 21), compute
        320 MiB, host cache up to 4562 MiB``."""
        return (f"estimate {self.resident / MIB:.0f} MiB resident (weights {self.weights / MIB:.0f}, KV "
                f"{self.kv / MIB:.0f}, tokenizer {self.tokenizer / MIB:.0f}), compute {self.compute / MIB:.0f} MiB, "
                f"host cache up to {self.cache / MIB:.0f} MiB")


#: what :meth:`ModelManager._make_room` returns without an estimator
NO_ESTIMATE = MemoryEstimate(0, 0)


def estimate_memory(weights_bytes: int, n_layers: int, n_kv_heads: int, head_dim: int, n_ctx: int,
                    kv_bytes_per_element: int = 2, compute_bytes: int = 0) -> MemoryEstimate:
    """Ollama's prediction (``PredictServerVRAM``): weights + 2 x layers x kv_heads x head_dim x
    n_ctx x bytes per element (K and V), plus a compute buffer.

    The seed's figures: ``estimate_memory(328_377_376, 4, 2, 32, 4096).total_mib`` is 317.17 MiB
    (313.17 MiB file + 4.00 MiB KV) and an 8B Q4_K_M (4.92 GB, 32 layers, 8 KV heads, head size
    128) at 4,096 tokens is 5204.08 MiB.
    """
    kv = 2 * n_layers * n_kv_heads * head_dim * n_ctx * kv_bytes_per_element
    return MemoryEstimate(int(weights_bytes), int(kv), int(compute_bytes))


# -- the manager --------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSpec:
    """What to load: a model's served name, where its files are and its per-model options.

    Attributes:
        name: the name the API shows and the manager keys on (a store name, an alias, a path).
        path: the resolved ``.gguf`` file or HF directory ("" for fakes in tests).
        pinned: never unloaded and never counted for eviction (``-m``, as llama-server).
        n_ctx: the context size this runner must have (None: the server's flags); a loaded
            runner with another size is reloaded.
        names: every name the runner answers to (defaults to ``[name]``).
        sleep_s: a pinned runner is unloaded after this many idle seconds and loads again on
            the next request (llama-server's ``--sleep-idle-seconds``); None: never.
        adapters: LoRA adapters loaded with it, ``(path, global scale)`` pairs (ids 0, 1, ... in
            this order; kvserve.lora): llama-server's ``--lora`` / ``--lora-scaled`` for the start-up
            model. A path that does not load fails the load, naming the file.
        remote: a remote model (:mod:`kvserve.remote`): no memory, not counted against
            ``max_loaded``.
        use_mmap: how a GGUF file's weights are held (Ollama's ``use_mmap`` option): True keeps
            the file's mapping, False reads them into memory (llama-server's ``--mmap`` /
            ``--no-mmap``, kvserve.loaders.gguf.set_weight_memory); None: the server's mode. A
            loaded runner with another value is reloaded, as Ollama reloads on changed runner options.
    """

    name: str
    path: str = ""
    pinned: bool = False
    n_ctx: int | None = None
    names: tuple[str, ...] = ()
    sleep_s: float | None = None
    adapters: tuple[tuple[str, float], ...] = ()
    remote: bool = False
    use_mmap: bool | None = None

    def served_names(self) -> list[str]:
        return list(self.names) if self.names else [self.name]


@dataclass(eq=False)
class Entry:
    """The manager's record of one runner (loading or loaded)."""

    spec: ModelSpec
    keep_alive: float
    ref_count: int = 0
    expires_at: float | None = None  # clock time; None while busy or kept forever
    runner: Any = None  # set when the load finishes
    loading: asyncio.Future | None = None
    size: int = 0  # bytes: the prediction, then what the load measured
    loaded_at: float = 0.0
    closing: bool = False  # unloaded: no new request may take it

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def idle(self) -> bool:
        return self.ref_count == 0 and self.runner is not None and not self.closing

    def sort_key(self) -> tuple[float, str]:
        return (math.inf if self.keep_alive < 0 else self.keep_alive, self.spec.name)


class Lease:
    """One request's hold on a runner; :meth:`release` (idempotent) drops it.

    Attributes:
        runner: the loaded runner.
    """

    def __init__(self, manager: "ModelManager", entry: Entry, before: tuple[float | None, bool] | None = None):
        self._manager = manager
        self._entry = entry
        self._before = before  # a hold_loaded hold: (the expiry it found, whether the runner was busy)
        self.runner = entry.runner
        self._released = False

    def release(self) -> None:
        """Drop the hold: when it was the last one the runner's keep_alive timer starts (a
        :meth:`ModelManager.hold_loaded` hold on an idle runner puts back the expiry it found)."""
        if not self._released:
            self._released = True
            self._manager._release(self._entry, self._before)

    @property
    def released(self) -> bool:
        return self._released


@dataclass
class ManagerStats:
    """Counters for ``/metrics``."""

    loads: int = 0
    load_failures: int = 0
    unloads: dict[str, int] = field(default_factory=dict)  # reason -> count


class ModelManager:
    """Loads models on demand and unloads them by keep_alive, count and memory (see module docs).

    Args:
        loader: ``loader(spec) -> runner``, run in a worker thread; the runner has ``close()``
            (run in a worker thread on unload), optionally ``measured_bytes`` (the real size
            after loading, used instead of the prediction from then on) and
            ``needs_reload(spec) -> bool``.
        estimate: ``estimate(spec) -> MemoryEstimate`` (run in a worker thread), or None to skip
            the memory check; the ``load`` event's reason is its :meth:`MemoryEstimate.summary`.
        enforce_memory: False: the estimate is logged (and is a loading runner's size) but never
            unloads a runner nor refuses a load, and an estimate that fails is left to the loader
            (llama-server's mode, ``-m``: the one model loads whatever it takes).
        max_loaded: most runners at once (``--max-loaded-models``; Ollama's default 3).
        default_keep_alive: seconds (``math.inf`` forever) for requests that give none.
        max_memory: cap in bytes on all runners together (``--max-memory``), or None.
        mem_available: ``() -> bytes`` the machine has free (MemAvailable), or None (no limit).
        max_queue: most requests waiting for room at once; more get UnavailableError
            (Ollama's OLLAMA_MAX_QUEUE, 512).
        clock: ``() -> seconds`` (monotonic).
        cleanup: ``() -> None`` run after a failed load (the server trims the heap).
        on_event: ``(t, action, name, reason)``: action ``load`` (a load starts; reason: the
            estimate's summary, or ""), ``loaded``
            (reason: its size), ``unload`` (reason: ``keep_alive elapsed``, ``keep_alive 0``,
            ``make room``, ``reload``, ``requested``, ``shutdown``) or ``fail`` (reason: the error).
    """

    def __init__(self, loader: Callable[[ModelSpec], Any], *,
                 estimate: Callable[[ModelSpec], MemoryEstimate] | None = None,
                 max_loaded: int = DEFAULT_MAX_LOADED, default_keep_alive: float = DEFAULT_KEEP_ALIVE_S,
                 max_memory: int | None = None, mem_available: Callable[[], int | None] | None = None,
                 max_queue: int = DEFAULT_MAX_QUEUE, clock: Callable[[], float] = time.monotonic,
                 on_event: Callable[[float, str, str, str], None] | None = None,
                 cleanup: Callable[[], None] | None = None, enforce_memory: bool = True):
        self.loader = loader
        self.estimate = estimate
        self.enforce_memory = enforce_memory
        self.max_loaded = max(1, max_loaded)
        self.default_keep_alive = default_keep_alive
        self.max_memory = max_memory
        self.mem_available = mem_available
        self.max_queue = max_queue
        self.clock = clock
        self.on_event = on_event
        self.loaded: dict[str, Entry] = {}  # insertion order = load order
        self.cleanup = cleanup  # after a failed load, in the loader's thread (e.g. malloc_trim)
        self._queue: deque[object] = deque()  # tickets of waiting requests, first come first served
        # failed loads by (name, file, num_ctx, use_mmap): another file under the name or other runner
        # options load again at once
        self._failures: dict[tuple, tuple[float, LoadFailedError]] = {}
        self.stats = ManagerStats()
        self._changed: asyncio.Condition | None = None
        self._load_lock: asyncio.Lock | None = None
        self._closing: set[asyncio.Task] = set()
        self._reaper: asyncio.Task | None = None
        self._shutdown = False

    # -- events and bookkeeping

    def _emit(self, action: str, name: str, reason: str = "") -> None:
        if self.on_event is not None:
            try:
                self.on_event(self.clock(), action, name, reason)
            except Exception:  # noqa: BLE001 - a logging hook never breaks scheduling
                log.exception("model manager event hook failed")

    def _cond(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def _notify(self) -> None:
        """Wake waiters (from sync code on the loop)."""
        cond = self._cond()

        async def wake():
            async with cond:
                cond.notify_all()

        try:
            asyncio.get_running_loop().create_task(wake())
        except RuntimeError:  # no loop (sync tests): nobody can be waiting
            pass

    def get(self, name: str) -> Entry | None:
        """The entry of a loaded (or loading) model, or None."""
        e = self.loaded.get(name)
        return e if e is not None and not e.closing else None

    def runners(self) -> list[Entry]:
        """Loaded runners (loading ones excluded), in load order."""
        return [e for e in self.loaded.values() if e.runner is not None and not e.closing]

    def ps(self) -> list[Entry]:
        """Loaded runners sorted by expiry (soonest first, busy and forever last), as ``ollama ps``."""
        return sorted(self.runners(), key=lambda e: (e.expires_at is None, e.expires_at or 0.0, e.name))

    # -- expiry

    def expire(self, now: float | None = None) -> None:
        """Unload every idle runner whose keep_alive elapsed by ``now``."""
        now = self.clock() if now is None else now
        for e in list(self.loaded.values()):
            if e.idle and e.expires_at is not None and e.expires_at <= now:
                self._unload(e, "idle for --sleep-idle-seconds" if e.spec.pinned else "keep_alive elapsed")

    def next_expiry(self) -> float | None:
        times = [e.expires_at for e in self.loaded.values() if e.idle and e.expires_at is not None]
        return min(times) if times else None

    def start_reaper(self) -> None:
        """Start the task that unloads runners when their keep_alive fires (call on the loop)."""
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        cond = self._cond()
        while not self._shutdown:
            nxt = self.next_expiry()
            timeout = None if nxt is None else max(0.0, nxt - self.clock()) + 0.01
            async with cond:
                try:
                    await asyncio.wait_for(cond.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
            self.expire()

    # -- acquiring and releasing

    @property
    def waiting(self) -> int:
        """Requests waiting for room (or behind one that does), first come first served."""
        return len(self._queue)

    async def acquire(self, spec: ModelSpec, keep_alive: float | None = None) -> Lease:
        """Hold the runner of ``spec`` for one request, loading it (and making room) if needed.

        Requests that must wait (for room, or for a busy runner to be reloaded) queue first come
        first served: while any request waits, a newcomer queues behind it even when its own
        model is loaded, so steady traffic on one model cannot starve a request for another.

        Args:
            spec: the resolved model.
            keep_alive: seconds for this request (None: the manager's default; ``KEEP_CURRENT``:
                leave a loaded runner's keep_alive as it is); the latest request's value wins.

        Returns:
            a :class:`Lease`; call ``release()`` when the request ends (streams: when the last
            byte is sent).

        Raises:
            UnavailableError: the model cannot fit in memory, or too many requests wait.
            LoadFailedError: the model failed to load (every request sharing the load gets it,
                and so does each request in the next ``FAILURE_MEMO_S`` seconds).
        """
        cond = self._cond()
        ticket: object | None = None
        try:
            while True:
                if self._shutdown:
                    raise UnavailableError("the server is shutting down")
                self.expire()
                self._check_failure_memo(spec)
                if self._queue and self._queue[0] is not ticket:  # someone waits ahead of us
                    ticket = await self._wait(cond, ticket)
                    continue
                e = self.get(spec.name)
                if e is not None and e.runner is None and self._needs_reload(e, spec):
                    # loading with other runner options (num_ctx, use_mmap): wait for that load, then
                    # reload for this request as below (joining it would run with the other options)
                    ticket = await self._wait(cond, ticket)
                    continue
                if e is not None and e.runner is not None and self._needs_reload(e, spec):
                    if e.ref_count == 0:
                        self._unload(e, "reload")
                        e = None
                    else:
                        ticket = await self._wait(cond, ticket)
                        continue
                if e is None:
                    room = await self._make_room(spec)
                    if room is None:
                        ticket = await self._wait(cond, ticket)
                        continue
                    if self.get(spec.name) is not None or (self._queue and self._queue[0] is not ticket):
                        continue  # the state changed while we measured: look again
                    e = self._start_load(spec, self._keep(None, keep_alive), room)
                e.ref_count += 1
                e.keep_alive = self._keep(e, keep_alive)  # the latest request's keep_alive wins
                e.expires_at = None
                break
        finally:
            if ticket is not None:
                self._queue.remove(ticket)
                self._notify()  # the next in line looks again
        try:
            if e.loading is not None and not e.loading.done():
                await asyncio.shield(e.loading)
            elif e.loading is not None:
                e.loading.result()
        except BaseException:
            e.ref_count -= 1
            if e.runner is not None and e.ref_count == 0:  # cancelled while a shared load ran on
                self._idle(e)
            raise
        return Lease(self, e)

    def add_bytes(self, name: str, delta: int) -> None:
        """Count ``delta`` more bytes (negative: fewer) in the loaded runner ``name``'s size: memory
        it took after loading (LoRA adapters read on demand). Nothing when it is not loaded."""
        e = self.get(name)
        if e is not None and e.runner is not None:
            e.size = max(0, e.size + int(delta))

    def hold_loaded(self, name: str) -> Lease:
        """Hold the runner of ``name`` only when it is loaded already: outside the queue, without
        loading, unloading or waking anything, and without counting as use (the runner is not
        evicted while held; on release its expiry is the one it had when idle before, or the
        timer its other requests' end starts when it was busy). For vllm-router's render calls.

        Raises:
            UnavailableError: ``Loading model`` while it loads; ``model 'x' is not loaded`` when
                it is not loaded (or is being unloaded).
        """
        e = self.get(name)
        if e is None:
            raise UnavailableError(f"model '{name[:256]}' is not loaded")
        if e.runner is None:
            raise UnavailableError("Loading model")
        before = (e.expires_at, e.ref_count > 0)
        e.ref_count += 1
        e.expires_at = None  # not expired by the reaper while held
        return Lease(self, e, before)

    def _keep(self, e: Entry | None, keep_alive: float | None) -> float:
        if keep_alive is KEEP_CURRENT:
            return e.keep_alive if e is not None else self.default_keep_alive
        return self.default_keep_alive if keep_alive is None else keep_alive

    async def _wait(self, cond: asyncio.Condition, ticket: object | None) -> object:
        """Wait for the next change (a release, unload, finished load or a queue move). The
        first wait of a request takes a place in the queue (at most ``max_queue``)."""
        new = ticket is None
        if new:
            if len(self._queue) >= self.max_queue:
                raise UnavailableError("server busy, please try again. maximum pending requests exceeded")
            ticket = object()
            self._queue.append(ticket)
        try:
            async with cond:
                await cond.wait()
        except BaseException:
            if new:  # the caller never saw this ticket: take it out here
                self._queue.remove(ticket)
                self._notify()
            raise
        return ticket

    @staticmethod
    def _failure_key(spec: ModelSpec) -> tuple:
        return (spec.name, spec.path, spec.n_ctx, spec.use_mmap)

    def _check_failure_memo(self, spec: ModelSpec) -> None:
        key = self._failure_key(spec)
        hit = self._failures.get(key)
        if hit is not None:
            when, err = hit
            if self.clock() - when < FAILURE_MEMO_S and self.get(spec.name) is None:
                raise LoadFailedError(err.message, err.cause_type, err.detail)
            del self._failures[key]

    def _record_failure(self, spec: ModelSpec, exc: BaseException) -> LoadFailedError:
        err = exc if isinstance(exc, LoadFailedError) else LoadFailedError.of(spec, exc)
        now = self.clock()
        for k in [k for k, (when, _) in self._failures.items() if now - when >= FAILURE_MEMO_S]:
            del self._failures[k]  # bounded: old entries go when another failure comes
        self._failures[self._failure_key(spec)] = (now, err)
        self.stats.load_failures += 1
        self._emit("fail", spec.name, err.detail)
        return err

    def _needs_reload(self, e: Entry, spec: ModelSpec) -> bool:
        if spec.n_ctx != e.spec.n_ctx:  # None is the server's default: one client's num_ctx does not stick
            return True
        if spec.use_mmap != e.spec.use_mmap:  # nor its use_mmap (Ollama: changed runner options reload)
            return True
        check = getattr(e.runner, "needs_reload", None)
        return bool(check(spec)) if check is not None else False

    def _release(self, e: Entry, before: tuple[float | None, bool] | None = None) -> None:
        e.ref_count -= 1
        if e.ref_count == 0:
            if before is None or before[1]:  # a request's end, or a hold its requests overlapped
                self._idle(e)
            else:
                e.expires_at = before[0]  # as before the hold: it did not count as use
        self._notify()

    def _idle(self, e: Entry) -> None:
        """The count reached zero: start the keep_alive timer (or unload at once for 0)."""
        if e.closing or e.spec.pinned:
            if not e.closing and e.spec.sleep_s is not None:  # --sleep-idle-seconds
                e.expires_at = self.clock() + e.spec.sleep_s
                self._notify()
            return
        if e.keep_alive == 0:
            self._unload(e, "keep_alive 0")
        elif e.keep_alive < 0 or math.isinf(e.keep_alive):
            e.expires_at = None
        else:
            e.expires_at = self.clock() + e.keep_alive
        self._notify()

    # -- making room

    def _victim(self) -> Entry | None:
        """The first idle, unpinned runner by (keep_alive, name), or None."""
        for e in sorted(self.loaded.values(), key=Entry.sort_key):
            if e.idle and not e.spec.pinned:
                return e
        return None

    async def _make_room(self, spec: ModelSpec) -> MemoryEstimate | None:
        """Unload idle runners until ``spec`` fits by count and memory. Returns the prediction
        (:data:`NO_ESTIMATE` without an estimator), or None when the request must wait (room will
        come when a busy runner finishes). From the last check to the return nothing awaits, so
        the caller's load starts on the state checked; a loading runner counts with its
        predicted size.

        Raises:
            UnavailableError: it cannot fit even with every other unpinned runner gone.
            LoadFailedError: the file's header cannot be read for the estimate.
        """
        need = None
        if self.estimate is not None:
            try:
                need = await asyncio.to_thread(self.estimate, spec)
            except Exception as exc:  # noqa: BLE001 - a bad header is a failed load, said once
                if self.enforce_memory:
                    raise self._record_failure(spec, exc) from None
        while True:
            await self._closed()  # memory of runners being unloaded is back before we measure
            if sum(not e.spec.remote for e in self.loaded.values()) >= self.max_loaded and not spec.remote:
                victim = self._victim()
                if victim is None:
                    return None
                self._unload(victim, "make room")
                continue
            if need is None or not self.enforce_memory:
                return need or NO_ESTIMATE
            avail = self._available()
            if avail is None or need.total <= avail:
                return need
            victim = self._victim()
            if victim is None:
                break
            self._unload(victim, "make room")
        # not even with every idle runner gone: could the busy ones make room later? (the error
        # names what would be free with every unpinned runner gone)
        others = sum(e.size for e in self.loaded.values() if not e.spec.pinned)
        if self.loaded and need.total <= avail + others:
            return None
        msg = (f"model '{spec.name}' requires more system memory ({need.total / MIB:.0f} MiB) "
               f"than is available ({max(avail + others, 0) / MIB:.0f} MiB)")
        log.warning("model manager: %s", msg, extra={"func": "manager"})
        raise UnavailableError(msg)

    def _available(self) -> int | None:
        """Bytes a new runner may take: MemAvailable less what loading runners will take (they
        have not allocated it yet), capped by ``max_memory`` less every runner's size."""
        free = self.mem_available() if self.mem_available is not None else None
        if free is not None:
            free -= sum(e.size for e in self.loaded.values() if e.runner is None)
        if self.max_memory is not None:
            left = self.max_memory - sum(e.size for e in self.loaded.values())
            free = left if free is None else min(free, left)
        return free

    async def _closed(self) -> None:
        while self._closing:
            await asyncio.gather(*list(self._closing), return_exceptions=True)

    # -- loading and unloading

    def _start_load(self, spec: ModelSpec, keep: float, need: MemoryEstimate) -> Entry:
        e = Entry(spec, keep, size=need.total)
        self.loaded[spec.name] = e
        self._emit("load", spec.name, need.summary() if need is not NO_ESTIMATE else "")
        e.loading = asyncio.get_running_loop().create_task(self._load(e))
        return e

    def _call_loader(self, spec: ModelSpec):
        """Run the loader (worker thread). A failure leaves nothing behind: its traceback's
        frames (which hold the half-built model) are cleared, the garbage collected and the
        heap trimmed, and a plain LoadFailedError carries its text (measured: without this each
        failed SmolLM2 load kept ~340 MiB resident)."""
        try:
            return self.loader(spec)
        except Exception as exc:  # noqa: BLE001 - turned into LoadFailedError below
            err = LoadFailedError.of(spec, exc)
            traceback.clear_frames(exc.__traceback__)
            del exc
        gc.collect()
        if self.cleanup is not None:
            self.cleanup()
        raise err

    async def _load(self, e: Entry) -> None:
        if self._load_lock is None:
            self._load_lock = asyncio.Lock()
        try:
            async with self._load_lock:
                await self._closed()
                runner = await asyncio.to_thread(self._call_loader, e.spec)
        except BaseException as exc:
            if self.loaded.get(e.name) is e:
                del self.loaded[e.name]
            err = self._record_failure(e.spec, exc) if isinstance(exc, Exception) else None
            self._notify()
            if err is None:  # cancelled, KeyboardInterrupt
                raise
            raise err from None
        measured = getattr(runner, "measured_bytes", None)
        if measured:
            e.size = int(measured)
        e.runner = runner
        e.loaded_at = self.clock()
        self.stats.loads += 1
        self._emit("loaded", e.name, f"{e.size / MIB:.0f} MiB")
        if e.ref_count == 0 and self.loaded.get(e.name) is e:  # preloaded: the timer starts now
            self._idle(e)
        self._notify()

    async def preload(self, spec: ModelSpec, keep_alive: float | None = None) -> None:
        """Load ``spec`` with no request holding it (start-up); its keep_alive timer starts
        when it is loaded (pinned runners stay)."""
        lease = await self.acquire(spec, keep_alive)
        lease.release()

    def _unload(self, e: Entry, reason: str) -> None:
        """Take ``e`` out now (no new request gets it) and close it in a worker thread."""
        if e.closing:
            return
        e.closing = True
        if self.loaded.get(e.name) is e:
            del self.loaded[e.name]
        self.stats.unloads[reason] = self.stats.unloads.get(reason, 0) + 1
        self._emit("unload", e.name, reason)
        runner, e.runner = e.runner, None
        if runner is not None and hasattr(runner, "close"):
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                runner.close()
            else:
                task = loop.create_task(asyncio.to_thread(runner.close))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
                task.add_done_callback(_log_close_error)
        self._notify()

    async def unload(self, name: str, reason: str = "requested") -> bool:
        """Unload ``name`` now if it is idle; a busy one gets keep_alive 0 (it unloads when its
        last request ends). Returns True when it was unloaded now."""
        e = self.get(name)
        if e is None or e.spec.pinned:
            return False
        if e.idle:
            self._unload(e, reason)
            await self._closed()
            return True
        e.keep_alive = 0
        return False

    async def shutdown(self) -> None:
        """Unload everything (pinned runners too) and wait for their engines to stop."""
        self._shutdown = True
        if self._reaper is not None:
            self._reaper.cancel()
        for e in list(self.loaded.values()):
            if e.loading is not None and not e.loading.done():
                try:
                    await asyncio.shield(e.loading)
                except BaseException:  # noqa: BLE001 - a failed load has nothing to close
                    pass
            self._unload(e, "shutdown")
        await self._closed()
        self._notify()


def _one_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text.splitlines()[0] if text else type(e).__name__


def _log_close_error(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("unloading a model failed: %s", task.exception())


async def run_with(lease_awaitable: Awaitable[Lease], work: Callable[[Any], Awaitable[Any]]) -> Any:
    """Acquire, run ``work(runner)``, release: for work that ends before the response does."""
    lease = await lease_awaitable
    try:
        return await work(lease.runner)
    finally:
        lease.release()
