"""Prefill-sized products on GGUF blocks (kvserve.models.ggml_kernel): prints JSON.

For each weight type and each of Llama-3.2-1B's projection shapes (N x K: q/o 2048 x 2048, k/v
512 x 2048, gate/up 8192 x 2048, down 2048 x 8192), a random matrix of that type's blocks times
M float32 rows (default 512, a prompt chunk), in GFLOP/s (2 M N K / the median time):

* ``rows``: the per-row kernels (q8 activations, integer block dot products; every row count);
* ``gemm``: the large-M path (weights dequantized a panel at a time to bfloat16, AVX512-BF16 dot
  products), where this build has it (``Matrix.mm(x, gemm_min_rows=1)``);
* ``torch_bf16``: torch's bfloat16 ``F.linear`` on a dense bfloat16 copy of the same weights (what
  kvserve ran before the weights stayed packed; 2 bytes a weight of extra memory).

With ``--llama-server BIN --model FILE`` also llama-server's prefill on that file (402-token
prompts, ``timings.prompt_per_second``, median of 3) turned into GFLOP/s of its projections:
tokens/s x 2 x the weights of the ``blk.*`` matrices (attention's own products left out, so a
slight under-estimate of what it computes).

    python benchmarks/prefill_gemm.py [--m 512] [--threads 2] [--types Q4_K,Q6_K,Q8_0,Q4_0] [--reps 5]
        [--llama-server BIN --model /tmp/l1b-Q4_K_M.gguf]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))

from kvserve.models import ggml_kernel  # noqa: E402

SHAPES = {"q_o": (2048, 2048), "k_v": (512, 2048), "gate_up": (8192, 2048), "down": (2048, 8192)}


def _ms(fn, reps: int, clock=time.perf_counter) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after one warm-up, on ``clock``."""
    fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times) * 1e3


def llama_server_gflops(binary: str, model: str, threads: int) -> dict:
    """llama-server's prefill tokens/s on ``model`` (median of 3 402-token prompts after a warm-up)
    and the GFLOP/s of its blk.* projections at that rate."""
    import random

    import gguf
    import httpx

    from vs_llama_server import fig_prefill, free_port, wait_health

    params = sum(int(np.prod(t.shape)) for t in gguf.GGUFReader(model).tensors
                 if t.name.startswith("blk.") and len(t.shape) == 2)
    port = free_port()
    proc = subprocess.Popen([binary, "-m", model, "-np", "1", "-c", "4096", "-t", str(threads), "--host", "127.0.0.1",
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_health(url, proc)
        rng = random.Random(7)
        with httpx.Client(timeout=600) as client:
            fig_prefill(client, url, rng)
            tok_s = statistics.median(fig_prefill(client, url, rng) for _ in range(3))
    finally:
        proc.terminate()
        proc.wait(30)
    return {"prefill_tok_s": round(tok_s, 1), "gflops": round(tok_s * 2 * params / 1e9, 1),
            "projection_params": params}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q4_0")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--cpu-time", action="store_true",
                    help="time on the process's CPU clock (with --threads 1: the time the product had a core, "
                         "steadier on a shared machine than wall time)")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    mod = ggml_kernel.ensure_built()
    if mod is None:
        print(json.dumps({"error": "the GGUF block kernels cannot be built here"}))
        return 1
    from test_ggml_kernel import random_rows  # the tests' random blocks of each type

    gemm = bool(getattr(mod, "GEMM", ""))
    rng = np.random.default_rng(0)
    out: dict = {"m": a.m, "threads": a.threads, "clock": "cpu" if a.cpu_time else "wall", "isa": mod.ISA, "gemm": getattr(mod, "GEMM", ""), "gflops": {}}
    for t in a.types.split(","):
        for s in a.shapes.split(","):
            n, k = SHAPES[s]
            raw = random_rows(t, n, k, rng)
            bm = ggml_kernel.BlockMatrix(mod, [(raw, t)], k)
            x = torch.from_numpy(rng.standard_normal((a.m, k)).astype(np.float32))
            w16 = bm.dequantize().to(torch.bfloat16)
            flop = 2.0 * a.m * n * k
            row = {}
            # interleaved: each path timed in turn, so load on the shared machine hits all alike
            fns = {"rows": lambda: bm._m.mm(x), "torch_bf16": lambda: torch.nn.functional.linear(x.to(torch.bfloat16), w16)}
            if gemm:
                fns["gemm"] = lambda: bm._m.mm(x, 1)
            for name, fn in fns.items():
                clock = time.process_time if a.cpu_time else time.perf_counter
                row[name] = round(flop / (_ms(fn, a.reps, clock) * 1e-3) / 1e9, 1)
            out["gflops"][f"{t} {s} {n}x{k}"] = row
            print(json.dumps({f"{t} {s}": row}), file=sys.stderr, flush=True)
    if a.llama_server and a.model:
        out["llama_server"] = llama_server_gflops(a.llama_server, a.model, a.threads)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
