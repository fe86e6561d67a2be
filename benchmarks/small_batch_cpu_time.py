"""CPU time of 16-row (batched decode) products on GGUF block weights at one thread: prints JSON.

For each shape of the Llama-3.2-1B Q4_K_M file's decode step (the fused q|k|v, o, gate|up, down and
the tied Q6_K head), a random matrix of the tests' blocks times a float32 [M, K] input through
``Matrix.mm`` with ``gemm_min_rows`` 0 (the decode route: ``mm_raw``'s small-batch path), timed with
``time.thread_time_ns`` at one thread: the median and the minimum over ``--reps`` calls (ms), and
the step's total (each shape times its count per step).

    PYTHONPATH=. python benchmarks/small_batch_cpu_time.py [--rows 16] [--reps 7] [--prefill 0] [--type Q8_0] [--file q4_0]

``--prefill R``: instead time ``mm`` with ``gemm_min_rows`` 1 on R rows (the int8 prefill path).
``--type T``: every part of type T instead (the 1B Q8_0 file: ``--type Q8_0``), the same shapes.
``--file q4_0``: the 1B Q4_0 file's shapes and types instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))

from kvserve.models import ggml_kernel  # noqa: E402

# (name, parts [(type, rows)], K, count per step) for the 1B Q4_K_M file (half the layers' v and down Q6_K)
SHAPES = [
    ("qkv", [("Q4_K", 2048), ("Q4_K", 512), ("Q6_K", 512)], 2048, 16),
    ("o", [("Q4_K", 2048)], 2048, 16),
    ("gate_up", [("Q4_K", 8192), ("Q4_K", 8192)], 2048, 16),
    ("down_q6k", [("Q6_K", 2048)], 8192, 8),
    ("down_q4k", [("Q4_K", 2048)], 8192, 8),
    ("head", [("Q6_K", 49152)], 2048, 1),
]
# the same for the 1B Q4_0 file (every layer's matrix Q4_0, the tied head Q6_K)
SHAPES_Q4_0 = [
    ("qkv", [("Q4_0", 2048), ("Q4_0", 512), ("Q4_0", 512)], 2048, 16),
    ("o", [("Q4_0", 2048)], 2048, 16),
    ("gate_up", [("Q4_0", 8192), ("Q4_0", 8192)], 2048, 16),
    ("down", [("Q4_0", 2048)], 8192, 16),
    ("head", [("Q6_K", 49152)], 2048, 1),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--prefill", type=int, default=0)
    ap.add_argument("--only", default="")
    ap.add_argument("--type", default="", help="every part of this ggml type (e.g. Q8_0) instead of the Q4_K_M mix")
    ap.add_argument("--file", default="q4_k_m", choices=["q4_k_m", "q4_0"], help="whose shapes and types")
    a = ap.parse_args()
    torch.set_num_threads(1)
    mod = ggml_kernel.ensure_built()
    from test_ggml_kernel import random_rows

    rng = np.random.default_rng(0)
    out: dict = {"isa": mod.ISA, "rows": a.prefill or a.rows, "type": a.type or "Q4_K_M mix", "ms_median_min": {}}
    total = 0.0
    for name, parts, k, count in (SHAPES_Q4_0 if a.file == "q4_0" else SHAPES):
        if a.only and name not in a.only.split(","):
            continue
        bm = ggml_kernel.BlockMatrix(mod, [(random_rows(a.type or t, n, k, rng), a.type or t) for t, n in parts], k)
        m = bm.matrix
        rows = a.prefill or a.rows
        x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
        gmr = 1 if a.prefill else 0
        m.mm(x, gmr, "auto")
        ns = []
        for _ in range(a.reps):
            t0 = time.thread_time_ns()
            m.mm(x, gmr, "auto")
            ns.append(time.thread_time_ns() - t0)
        med = statistics.median(ns) / 1e6
        out["ms_median_min"][name] = [round(med, 3), round(min(ns) / 1e6, 3)]
        total += med * count
    out["step_ms"] = round(total, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
