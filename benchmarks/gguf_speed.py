"""Prefill (512-token prompt) and one-stream decode tok/s of a GGUF file, with resident memory
after load: ``python benchmarks/gguf_speed.py FILE [--decode N]``; prints one JSON object.

For quick before/after figures of the GGUF block kernels (kvserve.bench runs 4 and 16 streams
and a 1,500-token prompt too, minutes on a 1B model on 2 cores)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.bench import _prompt, _run  # noqa: E402
from kvserve.config import EngineConfig  # noqa: E402
from kvserve.engine.core import create_engine_core  # noqa: E402


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("-np", "--parallel", type=int, default=1, help="slots (kvserve bench uses 16, one pool)")
    ap.add_argument("--thread", action="store_true",
                    help="step the engine from a second thread, as the server's engine thread does")
    a = ap.parse_args()
    t0 = time.perf_counter()
    core = create_engine_core(a.model, EngineConfig(n_ctx=4096, n_parallel=a.parallel, kv_unified=True))
    if a.thread:
        import threading

        th = threading.Thread(target=_measure, args=(core, a, t0))
        th.start()
        th.join()
        return 0
    _measure(core, a, t0)
    return 0


def _measure(core, a, t0) -> None:
    res = {"load_s": round(time.perf_counter() - t0, 2), "rss_after_load_mib": round(_rss_mib())}
    _run(core, [_prompt(core, 16, 0)], 4)  # warm-up
    if a.prefill:
        r = _run(core, [_prompt(core, a.prefill, 1)], 1)
        res[f"prefill_tok_s_{a.prefill}"] = round(a.prefill / (list(r["first"].values())[0] - r["t0"]), 1)
    c0 = time.process_time()
    r = _run(core, [_prompt(core, 16, 2)], a.decode)
    res["cpu_ms_per_token"] = round((time.process_time() - c0) * 1e3 / a.decode, 1)
    res["decode_tok_s"] = round((a.decode - 1) / (r["t1"] - list(r["first"].values())[0]), 1)
    res["rss_end_mib"] = round(_rss_mib())
    res["thread"] = a.thread
    print(json.dumps(res))


if __name__ == "__main__":
    sys.exit(main())
