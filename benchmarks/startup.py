"""Start-up of ``kvserve serve``: wall time and CPU time to ``/health`` 200, and the first requests (issue #29).

    python benchmarks/startup.py [--model smollm2] [--rounds 5] [--checkout DIR ...] [--requests 10]
        [--kvserve-args "-np 1 -c 4096 -t 2"]

For each round, for each checkout in turn (rounds alternate the order, so machine load hits all
alike), starts ``python -m kvserve serve MODEL ARGS --port P`` with that checkout first on
PYTHONPATH and polls ``GET /health`` as ``benchmarks/vs_llama_server.py`` does (one client, every
50 ms) until it answers 200:

- ``wall_s``: seconds from the spawn to the first 200 (the model file in the page cache);
- ``cpu_s``: the server process tree's user + system CPU seconds at that moment (``/proc/PID/stat``
  and its children's): robust to other processes' load on a shared machine, unlike ``wall_s``;

then, ``--pause-s`` seconds later, sends ``--requests`` identical greedy ``/completion`` requests one after another (a fresh
16-token prompt of random token ids each time, so nothing is cached, 32 tokens out, streamed) and
records the first's and the last's time to first token (client clock), prefill time
(``timings.prompt_ms``), decode speed (``timings.predicted_per_second``) and the server's CPU
seconds over the request (``cpu_req_N_s``: the process tree's, so background start-up work that
runs meanwhile, such as weight packing, counts against that request). Stops the server (SIGTERM to its process group, bounded wait).

Prints one JSON object: per checkout, each figure's per-round values and median.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_llama_server import completion, free_port  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (``/proc``), plus the children it has
    reaped (cutime/cstime)."""
    total = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / _TICK
            for t in Path(f"/proc/{p}/task").iterdir():
                kids = (t / "children").read_text().split()
                todo.extend(int(k) for k in kids)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def one_start(checkout: str, model: str, extra: list[str], requests: int, rng: random.Random,
              pause_s: float = 0.0) -> dict:
    """Start, time /health, run ``requests`` completions, stop; the figures of this one start."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": checkout}
    cmd = [sys.executable, "-m", "kvserve", "serve", model, *extra, "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                            env=env, cwd="/tmp")
    out: dict = {}
    try:
        with httpx.Client(timeout=2) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{checkout}: exited with {proc.returncode}: {proc.stderr.read()[-2000:]!r}")
                try:
                    if client.get(url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - t0 > 300:
                    raise RuntimeError("not healthy after 300 s")
                time.sleep(0.05)
        out["wall_s"] = time.perf_counter() - t0
        out["cpu_s"] = tree_cpu_s(proc.pid)
        if requests:
            time.sleep(pause_s)  # a client that does not send at once (background start-up work may run then)
            with httpx.Client(timeout=300) as client:
                for i in range(requests):
                    prompt = [rng.randrange(1000, 20000) for _ in range(16)]
                    cpu0 = tree_cpu_s(proc.pid)
                    c = completion(client, url, {"prompt": prompt, "n_predict": 32, "ignore_eos": True,
                                                 "cache_prompt": False})
                    cpu = tree_cpu_s(proc.pid) - cpu0
                    for n in {1, requests} if i + 1 in (1, requests) else ():
                        if i + 1 == n:
                            out[f"ttft_{n}_s"] = c["ttft"]
                            out[f"prompt_{n}_ms"] = c["timings"]["prompt_ms"]
                            out[f"decode_{n}_tok_s"] = c["timings"]["predicted_per_second"]
                            out[f"cpu_req_{n}_s"] = cpu
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--checkout", action="append", default=None,
                    help="a kvserve checkout to time (repeat to compare; default: this one)")
    ap.add_argument("--requests", type=int, default=10, help="completions after /health (0: none)")
    ap.add_argument("--kvserve-args", default="-np 1 -c 4096 -t 2")
    ap.add_argument("--pause-s", type=float, default=0.0, help="seconds between /health 200 and the first request")
    a = ap.parse_args()
    checkouts = a.checkout or [str(Path(__file__).resolve().parents[1])]
    rng = random.Random(1234)
    runs: dict[str, dict[str, list]] = {c: {} for c in checkouts}
    for rnd in range(a.rounds):
        for c in (checkouts if rnd % 2 == 0 else checkouts[::-1]):
            for k, v in one_start(c, a.model, a.kvserve_args.split(), a.requests, rng, a.pause_s).items():
                runs[c].setdefault(k, []).append(round(v, 3))
            print(json.dumps({"round": rnd, "checkout": c, **{k: v[-1] for k, v in runs[c].items()}}),
                  file=sys.stderr, flush=True)
    result = {"model": a.model, "args": a.kvserve_args, "rounds": a.rounds,
              "figures": {c: {k: {"runs": v, "median": round(statistics.median(v), 3)} for k, v in f.items()}
                          for c, f in runs.items()}}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
