"""CPU time of one-row (decode, M = 1) products on GGUF block weights at one thread: prints JSON.

A shared machine's wall clock measures the other tenants; the CPU time of the calling thread
(``time.thread_time_ns``, the product runs on the calling thread at one thread) does not count the
waits, and the minimum over many calls drops most of what cache sharing adds. For each type and shape
N x K (weight rows x values per row), a random [N, K] matrix of the type's blocks (the kernel tests'
random_rows) times one float32 row: the minimum and the 10th percentile of the per-call CPU time (us)
over enough calls to read about 300 MB, and the read rate at the minimum (GB/s, 1e9). Shapes that
fit the core's L2 (e.g. 256 x 2048) measure the kernels' arithmetic; larger ones (32768 x 2048) add
the memory's.

    PYTHONPATH=. python benchmarks/matvec_cpu_time.py [--types Q4_K,Q6_K] [--shapes 2048x2048,768x2048]

To compare two checkouts, run each with its own PYTHONPATH in turns (each builds its own extension).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))

from kvserve.models import ggml_kernel  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--shapes", default="256x2048,768x2048,2048x2048,8192x2048,2048x8192")
    ap.add_argument("--bytes", type=float, default=3e8, help="weight bytes to read per shape (sets the call count)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    mod = ggml_kernel.ensure_built()
    if mod is None:
        print(json.dumps({"error": "the GGUF block kernels cannot be built here"}))
        return 1
    from test_ggml_kernel import random_rows  # the tests' random blocks of each type

    rng = np.random.default_rng(0)
    out: dict = {"isa": mod.ISA, "us_min_p10_gbps": {}}
    for name in a.types.split(","):
        for shape in a.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            raw = random_rows(name, n, k, rng)
            mat = ggml_kernel.BlockMatrix(mod, [(raw, name)], k).matrix
            x = torch.from_numpy(rng.standard_normal((1, k)).astype(np.float32))
            for _ in range(5):
                mat.mm(x)
            ns = []
            for _ in range(max(50, int(a.bytes // raw.nbytes))):
                t0 = time.thread_time_ns()
                mat.mm(x)
                ns.append(time.thread_time_ns() - t0)
            ns.sort()
            out["us_min_p10_gbps"][f"{name} {n}x{k}"] = [round(ns[0] / 1e3, 1), round(ns[len(ns) // 10] / 1e3, 1),
                                                        round(raw.nbytes / ns[0], 1)]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
