"""Speed of the GGUF block kernels (kvserve.models.ggml_kernel) per weight type: prints JSON.

For each type, a random [N, K] matrix of that type's blocks (default 2048 x 8192, Llama-3.2-1B's
ffn_down) times M = 1 and M = 16 float32 rows: the median milliseconds per product over
``--reps`` runs (after warm-up) and the effective read bandwidth, weight bytes / time (GB/s, 1e9).

    python benchmarks/quant_matvec.py [--n 2048] [--k 8192] [--threads 2] [--types Q8_0,Q4_K] [--reps 30]
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--types", default=",".join(ggml_kernel.TYPES))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    mod = ggml_kernel.ensure_built()
    if mod is None:
        print(json.dumps({"error": "the GGUF block kernels cannot be built here"}))
        return 1
    from test_ggml_kernel import random_rows  # the tests' random blocks of each type

    rng = np.random.default_rng(0)
    out = {"n": a.n, "k": a.k, "threads": a.threads, "isa": mod.ISA, "types": {}}
    for name in a.types.split(","):
        raw = random_rows(name, a.n, a.k, rng)
        mat = ggml_kernel.BlockMatrix(mod, [(raw, name)], a.k)
        res = {"bytes": int(raw.nbytes)}
        for m in (1, 16):
            x = torch.from_numpy(rng.standard_normal((m, a.k)).astype(np.float32))
            for _ in range(3):
                mat.mm(x)
            times = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                mat.mm(x)
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            res[f"ms_m{m}"] = round(ms, 3)
            res[f"gbps_m{m}"] = round(raw.nbytes / (ms * 1e-3) / 1e9, 1)
        out["types"][name] = res
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
