"""Cost of one native decode step by its rows (issue #17: the draft-length policy's cost model).

    python benchmarks/step_cost.py [--model smollm2] [--ctx 800] [--max-rows 16] [--reps 5] [--threads 0]

Loads the model into an ``EngineCore`` (no server), waits for the native decode step, fills the
KV cache with random values and times ``NativeDecode`` on B rows of one sequence at ``--ctx``
cached tokens (a verification chunk: row b at position ctx + b attends to the ctx + b + 1 rows
before and at it), for B = 1 .. ``--max-rows``; each B ten steps per repetition, B values
interleaved per repetition so that machine load hits them alike, the minimum over repetitions.
The engine's own host work per step (scheduling, sampling, updating) is not included.

Prints one JSON object: ms per step by B, and the least-squares line ``ms = a + b * B`` over them
(``fit``; ``fit_short`` over B <= 8, the usual drafts), with ``base_rows = a / b``: the draft-length policy's ``STEP_BASE_ROWS_NATIVE`` (a step of B rows
costs ``base_rows + B`` row-units; kvserve/engine/spec_decode.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kvserve, not the venv's


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--ctx", type=int, default=800)
    ap.add_argument("--max-rows", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from agent_edit import _wait_native

    from kvserve.config import EngineConfig
    from kvserve.engine.core import EngineCore
    from kvserve.models.build import load_files
    from kvserve.store import resolve_model

    loaded = load_files(resolve_model(a.model, pull_missing=True))
    core = EngineCore(loaded, EngineConfig(n_ctx=max(4096, a.ctx + a.max_rows + 64), n_parallel=1,
                                           threads=a.threads, cache_ram=0))
    _wait_native({"engine": core})
    runner = core.runner
    nat = runner.native
    if nat is None or not nat.ready:
        print(json.dumps({"error": "the native decode step is not available here", "reason": getattr(nat, "reason", None)}))
        return
    gen = torch.Generator().manual_seed(0)
    for k, v in runner.kv_caches:
        k.copy_(torch.randn(k.shape, generator=gen).to(k.dtype))
        v.copy_(torch.randn(v.shape, generator=gen).to(v.dtype))
    first = runner.block_size  # block 0 is the null block
    n_vocab = loaded.config.n_vocab
    times: dict[int, list[float]] = {}
    rows = list(range(1, a.max_rows + 1))
    for _ in range(a.reps):
        for b in rows:
            pos = torch.arange(a.ctx, a.ctx + b)
            ids = torch.randint(0, n_vocab, (b,), generator=gen)
            slots = pos + first
            kv_index = (torch.arange(a.ctx + b) + first).unsqueeze(0).expand(b, -1).contiguous()
            lens = pos + 1
            t = time.perf_counter()
            for _ in range(10):
                nat(ids, pos, slots, kv_index, lens, runner.kv_caches)
            times.setdefault(b, []).append((time.perf_counter() - t) / 10 * 1e3)
    ms = {b: min(v) for b, v in times.items()}

    def fit(bs: list[int]) -> dict:
        mx, my = sum(bs) / len(bs), sum(ms[b] for b in bs) / len(bs)
        slope = sum((b - mx) * (ms[b] - my) for b in bs) / sum((b - mx) ** 2 for b in bs)
        icpt = my - slope * mx
        return {"rows": f"1-{bs[-1]}", "ms_fixed": round(icpt, 3), "ms_per_row": round(slope, 3),
                "base_rows": round(icpt / slope, 2)}
    print(json.dumps({
        "benchmark": "step_cost",
        "model": a.model,
        "machine": platform.processor() or platform.machine(),
        "isa": nat.isa,
        "threads": core.threads,
        "ctx": a.ctx,
        "ms_by_rows": {b: round(v, 2) for b, v in ms.items()},
        "fit": fit(rows),
        "fit_short": fit(rows[:8]) if len(rows) > 8 else None,  # the policy's usual drafts
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }, indent=1))


if __name__ == "__main__":
    main()
