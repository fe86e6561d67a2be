"""CPU time per decoded token of kvserve's main thread (its asyncio loop: HTTP, faces, metrics) and of
its whole process, for non-streamed and streamed ``/completion`` requests, at ``-t 1``.

    python benchmarks/loop_cpu_per_token.py CHECKOUT MODEL [--tokens 400] [--rounds 3]

CHECKOUT is the kvserve tree to run (put first on PYTHONPATH), MODEL a GGUF path or a store name
(``smollm2``). Per round and mode: a 16-token prompt with 1 token out, then the same prompt (not
cached) with ``--tokens + 1`` out; the difference of their CPU times over ``--tokens`` is one
token's. CPU time is the scheduler's exact ``sum_exec_runtime`` (``/proc/PID/task/TID/schedstat``),
not tick samples, so short runs on a busy machine still give stable figures. Prints one JSON object:
per figure its median and the per-round values (ms per token).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx


def cpu_s(pid: int, tid: int | None = None) -> float:
    """Exact CPU seconds of thread ``tid`` of ``pid``, or of all of ``pid``'s threads."""
    total = 0
    for t in ([tid] if tid else os.listdir(f"/proc/{pid}/task")):
        try:
            total += int(Path(f"/proc/{pid}/task/{t}/schedstat").read_text().split()[0])
        except OSError:
            pass
    return total / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout")
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = {**os.environ, "PYTHONPATH": os.path.abspath(a.checkout)}
    proc = subprocess.Popen([sys.executable, "-m", "kvserve", "serve", a.model, "-np", "1", "-c", "4096", "-t", "1",
                             "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    body = {"prompt": list(range(1000, 1016)), "ignore_eos": True, "temperature": 0, "cache_prompt": False}
    try:
        with httpx.Client(timeout=1200) as c:
            for _ in range(1200):
                try:
                    if c.get(url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None:
                    raise SystemExit(f"the server exited with {proc.returncode}")
                time.sleep(0.5)

            def run(n: int, stream: bool) -> tuple[float, float]:
                m0, p0 = cpu_s(proc.pid, proc.pid), cpu_s(proc.pid)
                b = {**body, "n_predict": n, "stream": stream}
                if stream:
                    with c.stream("POST", url + "/completion", json=b) as resp:
                        for _ in resp.iter_lines():
                            pass
                else:
                    c.post(url + "/completion", json=b).raise_for_status()
                return cpu_s(proc.pid, proc.pid) - m0, cpu_s(proc.pid) - p0

            run(8, False)  # warm-up
            res: dict[str, list[float]] = {"main": [], "process": [], "main_stream": [], "process_stream": []}
            for _ in range(a.rounds):
                for stream in (False, True):
                    bm, bp = run(1, stream)
                    fm, fp = run(a.tokens + 1, stream)
                    k = "_stream" if stream else ""
                    res["main" + k].append(round((fm - bm) / a.tokens * 1e3, 3))
                    res["process" + k].append(round((fp - bp) / a.tokens * 1e3, 3))
        print(json.dumps({"model": a.model, "checkout": a.checkout, "tokens": a.tokens,
                          "cpu_ms_per_token": {k: {"median": statistics.median(v), "runs": v} for k, v in res.items()}},
                         indent=1))
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)


if __name__ == "__main__":
    main()
