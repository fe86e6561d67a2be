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
import dataclasses
import logging
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator

from kvserve.engine.core import EngineCore
from kvserve.engine.request import InvalidRequestError, Request, RequestOutput

log = logging.getLogger("kvserve.engine")


class EngineDeadError(RuntimeError):
    """The engine thread failed; no further requests can run."""


#: seconds a non-streamed request's merged outputs wait on the engine thread at most before the
#: loop gets them (its first output and its last go at once)
WHOLE_FLUSH_S = 0.05

#: steps in a row that fail as a whole (no step ran in between) before the engine counts as dead
MAX_CONSECUTIVE_FAILED_STEPS = 5


class AsyncEngine:
    """Asynchronous front of one EngineCore.

    Args:
        core: the EngineCore to drive (moved to the engine thread).

    Attributes (read-only from other threads): tokenizer, model_info,
    n_ctx, n_ctx_slot, n_slots, n_vocab, stats. ``core`` and ``tokenizer`` are None after
    :meth:`shutdown`; the others stay readable.
    """

    def __init__(self, core: EngineCore):
        self.core: EngineCore | None = core
        self.tokenizer = core.tokenizer
        self.model_info = core.model_info
        self._n_ctx, self._n_ctx_slot, self._n_slots = core.n_ctx, core.n_ctx_slot, core.n_slots
        self._n_vocab = core.model_config.n_vocab
        self._stats = core.stats
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self.error: BaseException | None = None
        self.step_listeners: list = []  # callables(core, outputs) run on the engine thread after each step
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        listeners = getattr(core.runner, "lost_listeners", None)  # a runner that learns of its own death
        if listeners is not None:                                    # (a parallel worker lost while idle)
            listeners.append(_weak_call(self.fail))
        self._thread.start()

    # -- facts for faces -----------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def n_ctx_slot(self) -> int:
        return self._n_ctx_slot

    @property
    def n_slots(self) -> int:
        return self._n_slots

    @property
    def n_vocab(self) -> int:
        """The model's vocabulary size (the logits' width), which prompt token ids must stay below."""
        return self._n_vocab

    @property
    def stats(self):
        return self._stats

    @property
    def slot_cache(self):
        """Slot id -> tokens the idle slot's KV holds (:attr:`EngineCore.slot_cache`, safe
        from any thread); empty after :meth:`shutdown`."""
        core = self.core
        return core.slot_cache if core is not None else {}

    # -- API -------------------------------------------------------------------------

    def validate(self, request: Request) -> None:
        """Raise InvalidRequestError/ContextSizeExceededError now (:meth:`EngineCore.validate`,
        read-only); EngineDeadError after :meth:`shutdown`. The serving layer admits requests
        itself (:func:`kvserve.serving.admission.admit`)."""
        self._core().validate(request)

    async def generate(self, request: Request, *, whole: bool = False) -> AsyncIterator[RequestOutput]:
        """Submit ``request`` and yield its outputs until the finished one.

        ``whole``: the caller wants the answer only when it is complete (a non-streamed
        response): after the first output, outputs come merged (:meth:`RequestOutput.merge`,
        ``parts`` telling them apart), at the finish and every :data:`WHOLE_FLUSH_S` seconds.

        Raises InvalidRequestError (incl. ContextSizeExceededError) before the
        first output when the engine refuses the request (:meth:`EngineCore.add_request`
        checks it on the engine thread); EngineDeadError if the engine thread died.
        Cancelling the iteration aborts the request.
        """
        self._raise_if_dead()
        st = _Stream(asyncio.get_running_loop(), whole)
        rid = request.request_id
        lock = self._lock
        with lock:  # with the death path's lock: a request is either seen by it or refused here
            self._raise_if_dead()
            self._streams[rid] = st
            self._inbox.put(("add", request))
        finished = False
        try:
            while True:
                with lock:
                    batch, st.items = st.items, []
                    if not batch:
                        st.waiter = waiter = st.loop.create_future()
                if not batch:
                    await waiter
                    continue
                for item in batch:
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

    def fail(self, error: BaseException) -> None:
        """Mark the engine dead from any thread (the runner knows it cannot run another step, e.g.
        a tensor-parallel worker died while the server was idle): the engine thread raises
        ``error`` as if a step had, so ``error`` is set, every open stream and later request gets
        EngineDeadError and ``/health`` answers 500, without running a step."""
        self._inbox.put(("fail", error))

    def _core(self) -> EngineCore:
        core = self.core
        if core is None:
            raise self._dead()
        return core

    def shutdown(self, timeout: float | None = 30.0) -> bool:
        """Stop the engine thread and let go of the model.

        Open streams and queued calls fail with EngineDeadError. Waits up to ``timeout``
        seconds for the engine thread to end (it finishes the step it is in). Then the core
        is closed (:meth:`EngineCore.close`: weights, KV tensors, tokenizer dropped) and this
        object holds no reference to it, to its tokenizer or to an exception's frames, so
        the model's memory is freed once the caller drops its own references (and
        ``gc.collect()`` runs for cycles). Idempotent.

        Returns:
            True when the thread ended; False when it was still in a step after ``timeout``
            (it then closes the core itself when the step ends).
        """
        self._stopped = True
        self._inbox.put(("stop", None))
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)
        if self._thread.is_alive():
            log.warning("engine thread still in a step %.0f s after shutdown; it frees the model when the step ends",
                        timeout or 0)
            return False
        self._release()
        return True

    def _release(self) -> None:
        """Drop every reference to the core (closing it), the tokenizer and step listeners;
        strip tracebacks, whose frames would hold the core. Once the engine thread ended."""
        with self._lock:
            core, self.core = self.core, None
            self.tokenizer = None
            self.step_listeners = []
            err = self.error
        _drop_tracebacks(err)
        self._drain(self._dead() if err is not None else EngineDeadError("the engine was shut down"))
        if core is not None:
            core.close()

    # -- engine thread -----------------------------------------------------------------

    def _deliver(self, rid: str, item, now: float = 0.0) -> None:
        """Hand ``item`` (a RequestOutput or an exception) to request ``rid``'s consumer, if it
        still listens; on the engine thread. ``now``: the ``time.monotonic()`` to stamp outputs
        with (0: read it here)."""
        if isinstance(item, RequestOutput):
            item.made_time = now or time.monotonic()
        with self._lock:
            st = self._streams.get(rid)
            if st is None:
                return
            if st.whole and isinstance(item, RequestOutput) and item.prompt_progress is None:
                if st.started:  # merge until the finish or the flush interval
                    held = st.held
                    if held is None:
                        held = st.held = dataclasses.replace(item)
                    else:
                        held.merge(item)
                    if not item.finished and item.made_time - st.flushed < WHOLE_FLUSH_S:
                        return
                    item, st.held = held, None
                st.started, st.flushed = True, item.made_time
            elif st.held is not None:  # an error after merged outputs: they go first
                st.items.append(st.held)
                st.held = None
            st.items.append(item)
            if st.woken:
                return  # the consumer's wake is on its way and takes this too
            st.woken = True
        try:
            st.loop.call_soon_threadsafe(self._wake, st)
        except RuntimeError:  # loop closed
            pass

    def _wake(self, st: _Stream) -> None:
        """On the consumer's loop: let :meth:`generate` take what arrived."""
        with self._lock:
            st.woken = False
            waiter, st.waiter = st.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

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
        elif kind == "fail":  # fail(): the engine dies here
            raise payload
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
        if self._stopped:  # shutdown() gave up waiting for this step, or is about to release
            self._release()

    def _loop(self) -> None:
        from kvserve.engine import heap

        core = self.core
        stepped = False  # a step ran since the heap was last trimmed
        while not self._stopped:
            block = not core.has_work()
            try:
                kind, payload = self._inbox.get(block=block, timeout=(heap.IDLE_TRIM_S if stepped else None)
                                                if block else 0)
            except queue.Empty:
                if block:  # idle IDLE_TRIM_S seconds after work: the steps' freed buffers go back to the kernel
                    heap.trim()
                    stepped = False
                    continue
            else:
                try:
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
            stepped = True
            now = time.monotonic()
            for out in outputs:
                self._deliver(out.request_id, out, now)
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
        self._drain(err)

    def _drain(self, err: BaseException) -> None:
        """Empty the inbox, failing queued calls with ``err`` (adds and aborts are dropped)."""
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "call" and payload[1].set_running_or_notify_cancel():
                payload[1].set_exception(err)


class _Stream:
    """One consumer of :meth:`AsyncEngine.generate`: its loop, what arrived for it (``items``,
    guarded by the engine's lock), the future it waits on, whether a wake is scheduled, and for
    a ``whole`` request the merged outputs held back (``held``) and when it last got some."""

    __slots__ = ("loop", "whole", "items", "waiter", "woken", "held", "started", "flushed")

    def __init__(self, loop: asyncio.AbstractEventLoop, whole: bool):
        self.loop, self.whole = loop, whole
        self.items: list = []
        self.waiter: asyncio.Future | None = None
        self.woken = False
        self.held: RequestOutput | None = None
        self.started = False
        self.flushed = 0.0


def _weak_call(method):
    """``method`` called through a weak reference (a no-op once its object is gone): a runner's
    listener must not keep the AsyncEngine (and so the core) alive."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        m = ref()
        if m is not None:
            m(*args)
    return call


def _drop_tracebacks(exc: BaseException | None) -> None:
    """Clear the tracebacks of ``exc`` and of its cause/context chain (their frames hold the
    engine's locals: the core, its model)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__
