"""Next-token masks of many constraints at once, beside the model's forward.

Without this each constrained row of a step computes its mask when the sampler asks for it,
after the forward, one ``GrammarMatcher.fill_next_token_bitmask`` and one ``np.unpackbits`` per
row, on the engine thread. Here the engine hands the step's constraints over before the forward
(:func:`prefetch_masks`, reached through ``GrammarConstraint.prefetch_masks``): one
``xgrammar.BatchGrammarMatcher.batch_fill_next_token_bitmask`` call fills a packed
``int32 [B, ceil(vocab / 32)]`` bitmask for all of them and one ``np.unpackbits`` expands it to
``bool [B, n_vocab]``, in a worker thread while the forward runs (xgrammar's C++ fill and
numpy's unpacking release the GIL, measured: a Python loop on the engine thread runs at full
speed beside a filling worker; torch's kernels release it too). On machines of fewer than 8
cores the rows are filled one after the other by the worker (``fill_next_token_bitmask(bits,
i)``): the batch matcher's own thread hand-offs cost more there than they spread. ``GrammarConstraint.mask()`` then
returns its row (waiting for the worker if it is not done yet). The masks are the same bits
either way (``tests/unit/test_grammar_batch.py`` compares them bit for bit), so tokens do not
change.

Why it is valid: a matcher changes state only when the engine accepts a sampled token, after
the step's sampling; between the start of a step and its sampling nothing touches it, so the
mask computed before the forward is the one the sampler would have computed after it.

Threads: one worker per engine thread (``threading.local``), so engines of several models in
one process do not wait on each other; it ends when its engine thread's state is collected.
Measured on the 2-core machine (SmolLM2's 49k vocabulary, JSON-schema states): one row's fill
1-40 us and its unpack ~8 us; 16 rows ~300 us of fill and ~50 us of unpack in all; the batch
matcher with 2 threads was slower than 1 at 1 and 16 rows, and with 1 thread no faster than the
loop while waiting on its own thread.

Counters (:data:`STATS`, process-wide, for benchmarks): rows filled, seconds the worker spent,
seconds the engine thread spent handing work over and waiting for it.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.structured.xgr import xgrammar_module

log = logging.getLogger("kvserve.structured")

__all__ = ["STATS", "MaskBatch", "MaskStats", "fill_masks", "prefetch_masks"]


@dataclass
class MaskStats:
    """Process-wide counters of batched mask computation (perf_counter seconds).

    Attributes:
        batches, rows: batches filled and constrained rows in them.
        worker_seconds: time inside the batch fill and unpacking (the worker thread, or the
            engine thread when ``background`` is off); worker_cpu_seconds: that thread's CPU
            time there (``time.thread_time``: what a loaded machine's preemption does not inflate).
        submit_seconds: engine-thread time to hand a batch over.
        wait_seconds: engine-thread time ``mask()`` waited for a batch still being filled.
    """

    batches: int = 0
    rows: int = 0
    #: also count the fill's thread CPU time (``time.thread_time``: ~2.5 us a call here, so off
    #: unless a benchmark asks)
    cpu_clock: bool = False
    worker_seconds: float = 0.0
    worker_cpu_seconds: float = 0.0
    submit_seconds: float = 0.0
    wait_seconds: float = 0.0

    def reset(self) -> None:
        self.batches = self.rows = 0
        self.worker_seconds = self.worker_cpu_seconds = self.submit_seconds = self.wait_seconds = 0.0


#: the counters of this process (read by benchmarks/grammar_batch.py)
STATS = MaskStats()

#: fewer constrained rows than this in a step compute their masks themselves, as before: at one
#: row the hand-over to the worker cost more than the fill it hid (measured on the loaded 2-core
#: machine: ~0.3 ms serial vs ~0.8 ms of engine-thread wall time per token, the worker waking and
#: the GIL passing back and forth), while at 16 rows it paid (84 -> 55 us a token)
MIN_ROWS = 2


class _Worker:
    """One engine thread's bitmask buffer and worker thread.

    The hand-over is a job on a ``queue.SimpleQueue`` and a lock the worker releases when the
    job is done (a few microseconds each way; a ThreadPoolExecutor's future costs several times
    that, which at one constrained row is as much as the mask)."""

    def __init__(self) -> None:
        xgr = xgrammar_module()
        self.xgr = xgr
        #: xgrammar's BatchGrammarMatcher, used where it has cores to spread rows over (see fill_masks)
        self.threads = _batch_threads()
        self.matcher = xgr.BatchGrammarMatcher(max_threads=self.threads) if self.threads > 1 else None
        self.bits: torch.Tensor | None = None  # int32 [capacity, words], reused
        self.jobs: queue.SimpleQueue | None = None

    def buffer(self, rows: int, vocab_size: int) -> torch.Tensor:
        words = -(-vocab_size // 32)
        b = self.bits
        if b is None or b.shape[0] < rows or b.shape[1] != words:
            b = self.bits = self.xgr.allocate_token_bitmask(max(rows, 16), vocab_size)
        return b[:rows]

    def submit(self, batch: MaskBatch, args: tuple) -> None:
        if self.jobs is None:
            self.jobs = queue.SimpleQueue()
            t = threading.Thread(target=_serve, args=(self.jobs,), name="kvserve-masks", daemon=True)
            t.start()
            _threads[t] = self.jobs
            weakref.finalize(self, self.jobs.put, None)  # the engine thread gone: the worker ends
        batch._done.acquire()
        self.jobs.put((batch, args))


def _serve(jobs: queue.SimpleQueue) -> None:
    """The worker thread: fill each job's masks, then release its lock; ends at a None job (its
    engine thread's _Worker was collected)."""
    while True:
        job = jobs.get()
        if job is None:
            return
        batch, args = job
        try:
            batch._result = fill_masks(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the engine thread's mask()
            batch._error = e
        finally:
            batch._done.release()


def _batch_threads() -> int:
    """Threads for xgrammar's BatchGrammarMatcher: 1 (rows filled one after the other by the worker,
    no matcher) on machines of fewer than 8 cores, where the forward already has every core;
    else a quarter of them, at most 4."""
    n = os.cpu_count() or 1
    return 1 if n < 8 else min(4, n // 4)


_local = threading.local()
#: live worker threads -> their job queues, stopped at interpreter exit (a daemon thread still
#: inside xgrammar's C++ code while the interpreter finalizes can abort the process)
_threads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@atexit.register
def _stop_workers() -> None:
    for t, jobs in list(_threads.items()):
        jobs.put(None)
        t.join(timeout=2.0)


def _worker() -> _Worker:
    w = getattr(_local, "worker", None)
    if w is None:
        w = _local.worker = _Worker()
    return w


def fill_masks(matchers: list, bits: torch.Tensor, n_vocab: int, stop_ids: list[int],
               batch_matcher=None) -> torch.Tensor:
    """Masks of ``matchers`` (``xgrammar.GrammarMatcher``, none terminated), one unpack for all.

    Args:
        matchers: B matchers of one vocabulary.
        bits: int32 [B, ceil(vocab_size / 32)] CPU buffer (overwritten).
        n_vocab: width of the logits (<= 32 * words).
        stop_ids: end-of-generation ids (< n_vocab), the only ones allowed in a row that
            allows nothing else (cannot happen with a vocabulary holding every byte; logged).
        batch_matcher: an ``xgrammar.BatchGrammarMatcher`` (one call, its threads spread the
            rows), or None: each matcher fills its row in turn (``fill_next_token_bitmask(bits,
            i)``; on 2 cores as fast, without the batch matcher's thread hand-offs).

    Returns:
        bool [B, n_vocab] CPU tensor, True = allowed (bit j of word i is token 32 * i + j).
    """
    cpu = STATS.cpu_clock
    t, c = time.perf_counter(), time.thread_time() if cpu else 0.0
    if batch_matcher is not None:
        batch_matcher.batch_fill_next_token_bitmask(matchers, bits)
    else:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bits, i)
    words = bits.numpy().view(np.uint32)
    full, rem = divmod(n_vocab, 32)
    live = words[:, :full].any(axis=1)  # on the packed words: 32 times fewer than the bools
    if rem:
        live |= (words[:, full] & np.uint32((1 << rem) - 1)) != 0
    out = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :n_vocab]
    if not live.all():
        log.warning("output constraint allows no token; allowing only end-of-generation tokens")
        for r in np.flatnonzero(~live):
            out[r, stop_ids] = 1
    STATS.worker_seconds += time.perf_counter() - t
    if cpu:
        STATS.worker_cpu_seconds += time.thread_time() - c
    STATS.batches += 1
    STATS.rows += len(matchers)
    return torch.from_numpy(out).view(torch.bool)


class MaskBatch:
    """A batch of masks being filled (or filled); each constraint holds ``(batch, row)``.

    ``rows()`` waits for the result (bool [B, n_vocab]; re-raises the fill's error);
    ``release()`` detaches the constraints that did not take their row (a step that failed or
    did not sample them), so that a later ``mask()`` computes afresh, and waits until the
    worker is done with the matchers.
    """

    __slots__ = ("_done", "_error", "_result", "constraints")

    def __init__(self, constraints: list):
        self.constraints = constraints
        self._done = threading.Lock()  # held while the worker fills
        self._result: torch.Tensor | None = None
        self._error: BaseException | None = None

    def _wait(self) -> None:
        if self._done.locked():
            t = time.perf_counter()
            with self._done:
                pass
            STATS.wait_seconds += time.perf_counter() - t

    def rows(self) -> torch.Tensor:
        self._wait()
        if self._error is not None:
            raise self._error
        return self._result

    def release(self) -> None:
        for c in self.constraints:
            if c._pending is not None and c._pending[0] is self:
                c._pending = None
        self._wait()  # never leave the worker on matchers that change or a buffer reused next


def prefetch_masks(constraints: list, background: bool = True) -> MaskBatch | None:
    """Start computing the next-token masks of ``constraints`` (``GrammarConstraint``s of one
    backend) in one batch; their ``mask()`` returns the prefetched row.

    Args:
        constraints: the step's constrained rows (duplicates and terminated matchers are
            left to ``mask()``, which handles them itself).
        background: fill in the worker thread (returns at once) or here.

    Returns:
        The MaskBatch (call ``release()`` once the step sampled), or None when nothing was
        batched (fewer than :data:`MIN_ROWS` rows to do). Errors of the fill surface in ``mask()`` (the row's request fails alone)."""
    t = time.perf_counter()
    seen: set[int] = set()
    todo = []
    shape = None
    for c in constraints:
        if id(c) in seen or c._pending is not None or c._matcher.is_terminated():
            continue
        if shape is None:
            shape = (c._vocab_size, c._n_vocab)
        elif (c._vocab_size, c._n_vocab) != shape:  # another vocabulary: left to its mask()
            continue
        seen.add(id(c))
        todo.append(c)
    if len(todo) < MIN_ROWS:
        return None  # its own mask() is the same work with less around it
    w = _worker()
    first = todo[0]
    bits = w.buffer(len(todo), first._vocab_size)
    args = ([c._matcher for c in todo], bits, first._n_vocab, first._stop_ids, w.matcher)
    batch = MaskBatch(todo)
    if background:
        w.submit(batch, args)
    else:
        batch._result = fill_masks(*args)
    for i, c in enumerate(todo):
        c._pending = (batch, i)
    STATS.submit_seconds += time.perf_counter() - t
    return batch
