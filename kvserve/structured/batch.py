"""Next-token masks of many constraints at once, beside the model's forward.

Without this each constrained row of a step computes its mask when the sampler asks for it,
after the forward, one ``GrammarMatcher.fill_next_token_bitmask`` and one ``np.unpackbits`` per
row, on the engine thread. Here the engine hands the step's constraints over before the forward
(:func:`prefetch_masks`, reached through ``GrammarConstraint.prefetch_masks``): one
``xgrammar.BatchGrammarMatcher.batch_fill_next_token_bitmask`` call fills a packed
``int32 [B, ceil(vocab / 32)]`` bitmask for all of them and one ``np.unpackbits`` expands it to
``bool [B, n_vocab]``, in a worker thread while the forward runs (xgrammar's C++ fill and
numpy's unpacking release the GIL; torch's kernels do too). ``GrammarConstraint.mask()`` then
returns its row (waiting for the worker if it is not done yet). The masks are the same bits
either way (``tests/unit/test_grammar_batch.py`` compares them bit for bit), so tokens do not
change.

Why it is valid: a matcher changes state only when the engine accepts a sampled token, after
the step's sampling; between the start of a step and its sampling nothing touches it, so the
mask computed before the forward is the one the sampler would have computed after it.

Threads: one worker per engine thread (``threading.local``), so engines of several models in
one process do not wait on each other; the BatchGrammarMatcher runs on 1 thread (the forward
already uses the cores; measured on 2 cores: 2 threads were slower at 1 and 16 rows).

Counters (:data:`STATS`, process-wide, for benchmarks): rows filled, seconds the worker spent,
seconds the engine thread spent handing work over and waiting for it.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger("kvserve.structured")

__all__ = ["STATS", "MaskBatch", "MaskStats", "fill_masks", "prefetch_masks"]


@dataclass
class MaskStats:
    """Process-wide counters of batched mask computation (perf_counter seconds).

    Attributes:
        batches, rows: batches filled and constrained rows in them.
        worker_seconds: time inside the batch fill and unpacking (the worker thread, or the
            engine thread when ``background`` is off).
        submit_seconds: engine-thread time to hand a batch over.
        wait_seconds: engine-thread time ``mask()`` waited for a batch still being filled.
    """

    batches: int = 0
    rows: int = 0
    worker_seconds: float = 0.0
    submit_seconds: float = 0.0
    wait_seconds: float = 0.0

    def reset(self) -> None:
        self.batches = self.rows = 0
        self.worker_seconds = self.submit_seconds = self.wait_seconds = 0.0


#: the counters of this process (read by benchmarks/grammar_batch.py)
STATS = MaskStats()


class _Worker:
    """One engine thread's batch matcher, bitmask buffer and worker thread."""

    def __init__(self) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.matcher = xgr.BatchGrammarMatcher(max_threads=1)
        self.bits: torch.Tensor | None = None  # int32 [capacity, words], reused
        self.pool: ThreadPoolExecutor | None = None

    def buffer(self, rows: int, vocab_size: int) -> torch.Tensor:
        words = -(-vocab_size // 32)
        b = self.bits
        if b is None or b.shape[0] < rows or b.shape[1] != words:
            b = self.bits = self.xgr.allocate_token_bitmask(max(rows, 16), vocab_size)
        return b[:rows]

    def executor(self) -> ThreadPoolExecutor:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-masks")
        return self.pool


_local = threading.local()


def _worker() -> _Worker:
    w = getattr(_local, "worker", None)
    if w is None:
        w = _local.worker = _Worker()
    return w


def fill_masks(matchers: list, bits: torch.Tensor, n_vocab: int, stop_ids: list[int],
               batch_matcher) -> torch.Tensor:
    """Masks of ``matchers`` (``xgrammar.GrammarMatcher``, none terminated) in one call.

    Args:
        matchers: B matchers of one vocabulary.
        bits: int32 [B, ceil(vocab_size / 32)] CPU buffer (overwritten).
        n_vocab: width of the logits (<= 32 * words).
        stop_ids: end-of-generation ids (< n_vocab), the only ones allowed in a row that
            allows nothing else (cannot happen with a vocabulary holding every byte; logged).
        batch_matcher: an ``xgrammar.BatchGrammarMatcher``.

    Returns:
        bool [B, n_vocab] CPU tensor, True = allowed (bit j of word i is token 32 * i + j).
    """
    t = time.perf_counter()
    batch_matcher.batch_fill_next_token_bitmask(matchers, bits)
    out = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")[:, :n_vocab]
    empty = ~out.any(axis=1)
    if empty.any():
        log.warning("output constraint allows no token; allowing only end-of-generation tokens")
        for r in np.flatnonzero(empty):
            out[r, stop_ids] = 1
    STATS.worker_seconds += time.perf_counter() - t
    STATS.batches += 1
    STATS.rows += len(matchers)
    return torch.from_numpy(out).view(torch.bool)


class MaskBatch:
    """A batch of masks being filled (or filled); each constraint holds ``(batch, row)``.

    ``rows()`` waits for the result (bool [B, n_vocab]); ``release()`` detaches the
    constraints that did not take their row (a step that failed or did not sample them),
    so that a later ``mask()`` computes afresh.
    """

    __slots__ = ("_future", "_result", "constraints")

    def __init__(self, constraints: list, future: Future | None, result: torch.Tensor | None):
        self.constraints = constraints
        self._future = future
        self._result = result

    def rows(self) -> torch.Tensor:
        if self._result is None:
            t = time.perf_counter()
            self._result = self._future.result()
            STATS.wait_seconds += time.perf_counter() - t
        return self._result

    def release(self) -> None:
        for c in self.constraints:
            if c._pending is not None and c._pending[0] is self:
                c._pending = None
        if self._future is not None and self._result is None:
            try:  # never leave the worker writing into the buffer the next batch reuses
                self._future.result()
            except Exception:  # noqa: BLE001 - the step is over; the next mask() recomputes
                pass


def prefetch_masks(constraints: list, background: bool = True) -> MaskBatch | None:
    """Start computing the next-token masks of ``constraints`` (``GrammarConstraint``s of one
    backend) in one batch; their ``mask()`` returns the prefetched row.

    Args:
        constraints: the step's constrained rows (duplicates and terminated matchers are
            left to ``mask()``, which handles them itself).
        background: fill in the worker thread (returns at once) or here.

    Returns:
        The MaskBatch (call ``release()`` once the step sampled), or None when nothing was
        batched. Errors of the fill surface in ``mask()`` (the row's request fails alone)."""
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
    if not todo:
        return None
    w = _worker()
    first = todo[0]
    bits = w.buffer(len(todo), first._vocab_size)
    args = ([c._matcher for c in todo], bits, first._n_vocab, first._stop_ids, w.matcher)
    if background:
        batch = MaskBatch(todo, w.executor().submit(fill_masks, *args), None)
    else:
        batch = MaskBatch(todo, None, fill_masks(*args))
    for i, c in enumerate(todo):
        c._pending = (batch, i)
    STATS.submit_seconds += time.perf_counter() - t
    return batch
