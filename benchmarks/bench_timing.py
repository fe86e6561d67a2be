"""Timing shared by the kernel benchmarks (prefill_gemm.py, quant_matvec.py).

On a shared machine, load hits whatever runs while it lasts: functions compared in one run are timed
in turn (A, B, C, A, B, C, ...) so that it hits them alike, and reported by their median.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved(fns: dict[str, Callable[[], object]], reps: int, warmup: int = 1,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds per call of each function, on ``clock``.

    Args:
        fns: name -> a function of no arguments (its result is discarded).
        reps: timed calls of each function, interleaved: round r calls every function once, in order.
        warmup: untimed calls of each function first.
        clock: seconds; ``time.process_time`` for the process's CPU time (with one thread: the time the
            call had a core, steadier than wall time on a shared machine).

    Returns:
        name -> median seconds, in ``fns``' order.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}
