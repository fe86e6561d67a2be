"""AsyncEngine: the engine on its own thread, talked to through queues.

The engine thread owns the EngineCore (scheduler, KV cache, model). Faces call
``async for out in engine.generate(request)`` from any asyncio loop; requests
and aborts go in through a thread-safe queue, outputs come back through
``loop.call_soon_threadsafe`` into a per-request ``asyncio.Queue``. Cancelling
the consumer (client disconnect) aborts the request; its blocks are freed
within one step.

Failure handling: an exception raised for one request (adding, scheduling,
updating it) fails that request only (its stream gets a final output with
``error``); one that fails a whole step fails that step's requests
(:meth:`EngineCore.step`). The engine counts as dead (``error`` set, every
stream and pending ``call`` gets :class:`EngineDeadError` at once, later ones
fail at once too) only when the recovery itself raises or
``MAX_CONSECUTIVE_FAILED_STEPS`` steps in a row fail.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator

from kvserve.engine.core import EngineCore
from kvserve.engine.request import InvalidRequestError, Request, RequestOutput

log = logging.getLogger("kvserve.engine")


class EngineDeadError(RuntimeError):
    """The engine thread failed; no further requests can run."""


#: steps in a row that fail as a whole (no step ran in between) before the engine counts as dead
MAX_CONSECUTIVE_FAILED_STEPS = 5


class AsyncEngine:
    """Asynchronous front of one EngineCore.

    Args:
        core: the EngineCore to drive (moved to the engine thread).

    Attributes (read-only from other threads): tokenizer, model_info,
    n_ctx, n_ctx_slot, n_slots, stats.
    """

    def __init__(self, core: EngineCore):
        self.core = core
        self.tokenizer = core.tokenizer
        self.model_info = core.model_info
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self.error: BaseException | None = None
        self.step_listeners: list = []  # callables(core, outputs) run on the engine thread after each step
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    # -- facts for faces -----------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        return self.core.n_ctx

    @property
    def n_ctx_slot(self) -> int:
        return self.core.n_ctx_slot

    @property
    def n_slots(self) -> int:
        return self.core.n_slots

    @property
    def stats(self):
        return self.core.stats

    # -- API -------------------------------------------------------------------------

    def validate(self, request: Request) -> None:
        """Raise InvalidRequestError/ContextSizeExceededError now (before any streaming starts)."""
        self.core.validate(request)

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Submit ``request`` and yield its outputs until the finished one.

        Raises InvalidRequestError (incl. ContextSizeExceededError) before the
        first output when the request is refused; EngineDeadError if the engine
        thread died. Cancelling the iteration aborts the request.
        """
        self._raise_if_dead()
        self.core.validate(request)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        rid = request.request_id
        with self._lock:  # with the death path's lock: a request is either seen by it or refused here
            self._raise_if_dead()
            self._streams[rid] = (loop, q)
            self._inbox.put(("add", request))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not finished:
                self._inbox.put(("abort", rid))

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread."""
        self._inbox.put(("abort", request_id))

    def call(self, fn) -> concurrent.futures.Future:
        """Run ``fn(core)`` on the engine thread between steps; returns a concurrent Future.

        The future holds ``fn``'s result or exception; EngineDeadError at once when the
        engine is dead or stopped (it never hangs)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.error is not None:
                fut.set_exception(self._dead())
            else:
                self._inbox.put(("call", (fn, fut)))
        return fut

    @property
    def alive(self) -> bool:
        """False once the engine thread failed or stopped (``error`` says why)."""
        return self.error is None

    def _dead(self) -> EngineDeadError:
        return EngineDeadError(f"engine failed: {self.error}")

    def _raise_if_dead(self) -> None:
        if self.error is not None:
            raise self._dead()

    def shutdown(self) -> None:
        self._stopped = True
        self._inbox.put(("stop", None))
        self._thread.join(timeout=10)

    # -- engine thread -----------------------------------------------------------------

    def _deliver(self, rid: str, item) -> None:
        with self._lock:
            target = self._streams.get(rid)
        if target is None:
            return
        loop, q = target
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # loop closed
            pass

    def _handle(self, kind: str, payload) -> None:
        core = self.core
        if kind == "add":
            try:
                core.add_request(payload)
            except InvalidRequestError as e:
                self._deliver(payload.request_id, e)
            except Exception as e:  # noqa: BLE001 - fails this request only
                self._deliver(payload.request_id, core.fail_request(payload, e, "add"))
        elif kind == "abort":
            core.abort_request(payload)
        elif kind == "call":
            fn, fut = payload
            if not fut.set_running_or_notify_cancel():
                return  # the caller gave up (cancelled)
            try:
                fut.set_result(fn(core))
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                fut.set_exception(e)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - engine death must reach every waiter
            log.exception("engine thread failed; no further requests can run")
            self._die(e)
        else:
            self._die(EngineDeadError("the engine was shut down"))

    def _loop(self) -> None:
        core = self.core
        while not self._stopped:
            block = not core.has_work()
            try:
                kind, payload = self._inbox.get(block=block, timeout=None if block else 0)
                if kind == "stop":
                    return
                self._handle(kind, payload)
                while True:  # drain everything that arrived
                    kind, payload = self._inbox.get_nowait()
                    if kind == "stop":
                        return
                    self._handle(kind, payload)
            except queue.Empty:
                pass
            if not core.has_work():
                continue
            outputs = core.step()
            for out in outputs:
                self._deliver(out.request_id, out)
            if core.consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
                raise EngineDeadError(f"{core.consecutive_failed_steps} engine steps in a row failed")
            for fn in self.step_listeners:
                try:
                    fn(core, outputs)
                except Exception:  # noqa: BLE001 - a listener's bug must not stop the engine
                    log.exception("engine step listener %r failed", fn)

    def _die(self, e: BaseException) -> None:
        """Mark the engine dead and fail every stream and queued call now."""
        with self._lock:
            self.error = e
            rids = list(self._streams)
        err = self._dead()
        for rid in rids:
            self._deliver(rid, err)
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "call" and payload[1].set_running_or_notify_cancel():
                payload[1].set_exception(err)
