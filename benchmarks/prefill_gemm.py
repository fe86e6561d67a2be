"""Prefill-sized products on GGUF blocks (kvserve.models.ggml_kernel): prints JSON.

For each weight type and each of Llama-3.2-1B's projection shapes (N x K: q/o 2048 x 2048, k/v
512 x 2048, gate/up 8192 x 2048, down 2048 x 8192), a random matrix of that type's blocks times
M float32 rows (default 512, a prompt chunk), in GFLOP/s (2 M N K / the median time):

* ``rows``: the per-row kernels (q8 activations, integer block dot products; every row count);
* ``gemm_bf16``: the bfloat16 prefill path (weights dequantized a panel at a time to bfloat16,
  AVX512-BF16 dot products; ggml_gemm.h), where this build has it (``Matrix.mm(x, 1, "bf16")``);
* ``gemm_int8``: the int8 prefill path (activations quantized to q8 as llama.cpp does, weights unpacked
  a panel at a time, AVX512-VNNI integer dot products; ggml_gemm8.h), where this build and the type have
  it (``Matrix.mm(x, 1, "int8")``; the default prefill path there), and its ratio to ``gemm_bf16``;
* ``torch_bf16``: torch's bfloat16 ``F.linear`` on a dense bfloat16 copy of the same weights (what
  kvserve ran before the weights stayed packed; 2 bytes a weight of extra memory).

With ``--llama-server BIN --model FILE`` also both servers' prefill on that file, alternating
(402-token prompts, ``timings.prompt_per_second``; and tokens per CPU-second of each server, the
steadier figure on a shared machine; see servers_prefill), turned into GFLOP/s of the projections:
tokens/s x 2 x the weights of the ``blk.*`` matrices (attention's own products left out, so a
slight under-estimate of what it computes).

    python benchmarks/prefill_gemm.py [--m 512] [--threads 2] [--types Q4_K,Q6_K,Q8_0,Q4_0] [--reps 5]
        [--llama-server BIN --model /tmp/l1b-Q4_K_M.gguf [--rounds 3] [--servers-only]]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))

from bench_timing import interleaved  # noqa: E402
from kvserve.models import ggml_kernel  # noqa: E402

SHAPES = {"q_o": (2048, 2048), "k_v": (512, 2048), "gate_up": (8192, 2048), "down": (2048, 8192)}


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` and its threads used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def servers_prefill(binary: str, model: str, threads: int, rounds: int) -> dict:
    """llama-server's and kvserve's prefill on ``model`` (``-np 1 -c 4096 -t threads``), 402-token
    prompts in alternating rounds after a warm-up: per server the wall figure
    (``timings.prompt_per_second``) and tokens per CPU-second of the server process (its threads
    included) times ``threads``: what the prefill would reach with the cores to itself, steadier than
    wall time on a shared machine (spinning threads count too); medians, and the GFLOP/s of the
    blk.* projections at the wall rate."""
    import random

    import gguf
    import httpx

    from vs_llama_server import fig_prefill, free_port, wait_health

    params = sum(int(np.prod(t.shape)) for t in gguf.GGUFReader(model).tensors
                 if t.name.startswith("blk.") and len(t.shape) == 2)
    common = ["-np", "1", "-c", "4096", "-t", str(threads), "--host", "127.0.0.1"]
    cmds = {"llama-server": [binary, "-m", model, *common],
            "kvserve": [sys.executable, "-m", "kvserve", "serve", model, *common]}
    procs, urls = {}, {}
    figs: dict = {name: {"wall": [], "cpu": []} for name in cmds}
    try:
        for name, cmd in cmds.items():
            port = free_port()
            procs[name] = subprocess.Popen([*cmd, "--port", str(port)], stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL, cwd=str(Path(__file__).resolve().parents[1]))
            urls[name] = f"http://127.0.0.1:{port}"
            wait_health(urls[name], procs[name])
        rng = random.Random(7)
        with httpx.Client(timeout=600) as client:
            for name in cmds:
                fig_prefill(client, urls[name], rng)
            for r in range(rounds):
                for name in (list(cmds) if r % 2 == 0 else list(cmds)[::-1]):
                    c0 = _cpu_s(procs[name].pid)
                    wall = fig_prefill(client, urls[name], rng)
                    cpu = _cpu_s(procs[name].pid) - c0
                    figs[name]["wall"].append(round(wall, 1))
                    figs[name]["cpu"].append(round(402 / cpu * threads, 1))
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(30)
    out = {}
    for name, f in figs.items():
        w = statistics.median(f["wall"])
        out[name] = {"prefill_tok_s": f["wall"], "cpu_tok_s": f["cpu"], "median_tok_s": w,
                     "median_cpu_tok_s": statistics.median(f["cpu"]), "gflops": round(w * 2 * params / 1e9, 1)}
    out["ratio"] = round(out["kvserve"]["median_tok_s"] / out["llama-server"]["median_tok_s"], 3)
    out["ratio_cpu"] = round(out["kvserve"]["median_cpu_tok_s"] / out["llama-server"]["median_cpu_tok_s"], 3)
    return out


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
    ap.add_argument("--rounds", type=int, default=3, help="prefill rounds per server (with --llama-server)")
    ap.add_argument("--servers-only", action="store_true", help="only the servers' prefill (no kernel figures)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    mod = ggml_kernel.ensure_built()
    if mod is None:
        print(json.dumps({"error": "the GGUF block kernels cannot be built here"}))
        return 1
    from test_ggml_kernel import random_rows  # the tests' random blocks of each type

    gemm = bool(getattr(mod, "GEMM", ""))
    gemm8 = bool(getattr(mod, "GEMM8", ""))
    rng = np.random.default_rng(0)
    out: dict = {"m": a.m, "threads": a.threads, "clock": "cpu" if a.cpu_time else "wall", "isa": mod.ISA, "gemm": getattr(mod, "GEMM", ""), "gflops": {}}
    for t in ([] if a.servers_only else a.types.split(",")):
        for s in a.shapes.split(","):
            n, k = SHAPES[s]
            raw = random_rows(t, n, k, rng)
            bm = ggml_kernel.BlockMatrix(mod, [(raw, t)], k)
            x = torch.from_numpy(rng.standard_normal((a.m, k)).astype(np.float32))
            w16 = bm.dequantize().to(torch.bfloat16)
            flop = 2.0 * a.m * n * k
            row = {}
            fns = {"rows": lambda: bm._m.mm(x), "torch_bf16": lambda: torch.nn.functional.linear(x.to(torch.bfloat16), w16)}
            if gemm:
                fns["gemm_bf16"] = lambda: bm._m.mm(x, 1, "bf16")
            if gemm8 and bm._m.gemm8:
                fns["gemm_int8"] = lambda: bm._m.mm(x, 1, "int8")
            clock = time.process_time if a.cpu_time else time.perf_counter
            for name, sec in interleaved(fns, a.reps, clock=clock).items():
                row[name] = round(flop / sec / 1e9, 1)
            if "gemm_int8" in row and "gemm_bf16" in row:
                row["int8_over_bf16"] = round(row["gemm_int8"] / row["gemm_bf16"], 3)
            out["gflops"][f"{t} {s} {n}x{k}"] = row
            print(json.dumps({f"{t} {s}": row}), file=sys.stderr, flush=True)
    if a.llama_server and a.model:
        out["servers"] = servers_prefill(a.llama_server, a.model, a.threads, a.rounds)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
