"""Speed of the GGUF block kernels (kvserve.models.ggml_kernel) per weight type: prints JSON.

For each type, a random [N, K] matrix of that type's blocks (default 2048 x 8192, Llama-3.2-1B's
ffn_down) times M = 1 and M = 16 float32 rows: the median milliseconds per product over
``--reps`` runs (after warm-up) and the effective read bandwidth, weight bytes / time (GB/s, 1e9).

    python benchmarks/quant_matvec.py [--n 2048] [--k 8192] [--threads 2] [--types Q8_0,Q4_K] [--reps 30]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))

from bench_timing import interleaved  # noqa: E402
from kvserve.models import ggml_kernel  # noqa: E402


def _time(fn, x, reps: int, nbytes: int) -> dict:
    """Median ms of ``fn(x)`` over ``reps`` runs after 3 warm-ups, and ``nbytes`` / that time in GB/s."""
    ms = interleaved({"fn": lambda: fn(x)}, reps, warmup=3)["fn"] * 1e3
    return {"ms": round(ms, 3), "gbps": round(nbytes / (ms * 1e-3) / 1e9, 1)}


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
    # the same machine's read rate in this run: torch's float32 matrix-vector product (4 bytes a weight)
    w32 = torch.from_numpy(rng.standard_normal((a.n, a.k)).astype(np.float32))
    out["torch_f32_m1"] = _time(lambda x: torch.nn.functional.linear(x, w32), torch.ones(1, a.k), a.reps, w32.numel() * 4)
    del w32
    for name in a.types.split(","):
        raw = random_rows(name, a.n, a.k, rng)
        mat = ggml_kernel.BlockMatrix(mod, [(raw, name)], a.k)
        res = {"bytes": int(raw.nbytes)}
        for m in (1, 16):
            x = torch.from_numpy(rng.standard_normal((m, a.k)).astype(np.float32))
            r = _time(mat.mm, x, a.reps, raw.nbytes)
            res[f"ms_m{m}"], res[f"gbps_m{m}"] = r["ms"], r["gbps"]
        out["types"][name] = res
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
