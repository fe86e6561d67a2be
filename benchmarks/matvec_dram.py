"""CPU time of one-row (decode) products whose weights come from memory, not cache: prints JSON.

``matvec_cpu_time.py`` repeats one matrix, so shapes under the last-level cache (32 MiB here) measure
it; a decode step of a 1-8B model reads every weight once per token from DRAM. This benchmark lays
``--layers`` copies of one layer's matrices (Llama-3.1-8B's by default: q|k|v 6144 x 4096, o 4096 x
4096, gate|up 28672 x 4096, down 4096 x 14336, and the head) in 2 MiB-aligned memory advised
MADV_HUGEPAGE (as the GGUF loader's weights are), and runs them in the decode step's order, layer after
layer, at one thread. For each matrix: the median over rounds of the calling thread's CPU time per
call (``time.thread_time_ns``, us) and the read rate at it (GB/s, 1e9), then the total per round.

    PYTHONPATH=. python benchmarks/matvec_dram.py [--layers 4] [--rounds 7] [--down Q6_K] [--head]
        [--shape 8b|1b]
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))

from kvserve.models import ggml_kernel  # noqa: E402

SHAPES = {
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
           "head": (128256, 4096)},
    "1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
           "head": (128256, 2048)},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--type", default="Q4_K", help="the type of q|k|v, o, gate|up")
    ap.add_argument("--down", default="Q6_K", help="the down projection's type")
    ap.add_argument("--head", default="", help="the head's type (e.g. Q6_K); none by default")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    mod = ggml_kernel.ensure_built()
    if mod is None:
        print(json.dumps({"error": "the GGUF block kernels cannot be built here"}))
        return 1
    import gguf
    from test_ggml_kernel import random_rows

    shp = SHAPES[a.shape]
    kinds = [("qkv", a.type), ("o", a.type), ("gate_up", a.type), ("down", a.down)]
    sizes = {}
    for name, t in kinds + ([("head", a.head)] if a.head else []):
        n, k = shp[name]
        block, nb = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]]
        sizes[name] = (n, k, t, k // block * nb)
    total = sum(n * rb for n, _, _, rb in (sizes[k] for k, _ in kinds)) * a.layers
    if a.head:
        n, _, _, rb = sizes["head"]
        total += n * rb
    huge = 2 << 20
    m = mmap.mmap(-1, total + 16 * huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    whole = np.frombuffer(m, dtype=np.uint8)
    off = -whole.ctypes.data % huge
    rng = np.random.default_rng(0)
    seeds = {}
    mats = []  # (name, BlockMatrix)

    def place(name):
        nonlocal off
        n, k, t, rb = sizes[name]
        if (t, k) not in seeds:
            seeds[(t, k)] = random_rows(t, 256, k, rng)
        view = whole[off: off + n * rb].reshape(n, rb)
        for r in range(0, n, 256):
            view[r: r + 256] = seeds[(t, k)][: n - r]
        off += (n * rb + 4095) // 4096 * 4096
        mats.append((name, ggml_kernel.BlockMatrix(mod, [(view, t)], k)))

    for _ in range(a.layers):
        for name, _ in kinds:
            place(name)
    if a.head:
        place("head")
    xs = {k: torch.from_numpy(rng.standard_normal((1, k)).astype(np.float32)) for k in {s[1] for s in sizes.values()}}
    times: dict[str, list[float]] = {name: [] for name in sizes}
    per_round = []
    for r in range(a.rounds + 1):
        acc = {name: 0 for name in sizes}
        t_round = 0
        for name, bm in mats:
            t0 = time.thread_time_ns()
            bm.matrix.mm(xs[bm.shape[1]])
            dt = time.thread_time_ns() - t0
            acc[name] += dt
            t_round += dt
        if r == 0:
            continue  # the first round faults the pages in
        for name in sizes:
            times[name].append(acc[name] / (a.layers if name != "head" else 1))
        per_round.append(t_round)
    out = {"isa": mod.ISA, "threads": a.threads, "us_gbps": {}}
    for name, (n, k, t, rb) in sizes.items():
        med = statistics.median(times[name])
        out["us_gbps"][f"{name} {t} {n}x{k}"] = [round(med / 1e3, 1), round(n * rb / med, 1)]
    med = statistics.median(per_round)
    out["round_ms_gbps"] = [round(med / 1e6, 2), round(total / med, 1)]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
