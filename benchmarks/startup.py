"""Start-up of ``kvserve serve``: wall time and CPU time to ``/health`` 200, and the first requests (issue #29).

    python benchmarks/startup.py [--model smollm2] [--rounds 5] [--checkout DIR ...] [--requests 10]
        [--kvserve-args "-np 1 -c 4096 -t 2"] [--idle-s 2] [--llama-server BIN]

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
runs meanwhile, such as weight packing, counts against that request), and the server's resident
memory (``/proc/PID/smaps_rollup``, MiB): ``rss_health_mib`` at the first 200, ``rss_after_mib`` at
once after the last request, ``rss_idle_mib`` ``--idle-s`` seconds later (kvserve gives its heap's
free memory back after 1 s of an idle engine: kvserve.engine.heap), with that moment's
``anon_mib`` / ``anon_huge_mib`` / ``file_mib`` split (private memory, of it in transparent huge
pages, and mapped file pages). Stops the server (SIGTERM to its process group, bounded wait).

``--llama-server BIN`` adds llama-server (same model, ``--kvserve-args`` as its flags) as one more
"checkout" named ``llama-server``, started and measured the same way.

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


def memory_mib(pid: int) -> dict:
    """``/proc/PID/smaps_rollup`` in MiB: rss, anon (private anonymous), anon_huge (of it in transparent
    huge pages), file (mapped file pages); {} when the process is gone."""
    names = {"Rss": "rss", "Anonymous": "anon", "AnonHugePages": "anon_huge"}
    out: dict = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in names:
                out[names[k]] = int(v.split()[0]) / 1024
    except OSError:
        return {}
    out["file"] = out.get("rss", 0.0) - out.get("anon", 0.0)
    return out


LLAMA = "llama-server"


def one_start(checkout: str, model: str, extra: list[str], requests: int, rng: random.Random,
              pause_s: float = 0.0, idle_s: float = 2.0, llama_bin: str | None = None) -> dict:
    """Start, time /health, run ``requests`` completions, read the memory, stop; the figures of this
    one start. ``checkout`` :data:`LLAMA`: ``llama_bin`` on the same model and flags."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": checkout}
    cmd = [sys.executable, "-m", "kvserve", "serve", model, *extra, "--host", "127.0.0.1", "--port", str(port)]
    if checkout == LLAMA:
        cmd = [llama_bin, "-m", model, *extra, "--host", "127.0.0.1", "--port", str(port)]
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
        out["rss_health_mib"] = memory_mib(proc.pid).get("rss", 0.0)
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
            out["rss_after_mib"] = memory_mib(proc.pid).get("rss", 0.0)
            time.sleep(idle_s)
            mem = memory_mib(proc.pid)
            out["rss_idle_mib"] = mem.get("rss", 0.0)
            for k in ("anon", "anon_huge", "file"):
                out[f"{k}_mib"] = mem.get(k, 0.0)
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
    ap.add_argument("--idle-s", type=float, default=2.0,
                    help="seconds after the last request before rss_idle_mib is read")
    ap.add_argument("--llama-server", default=None, metavar="BIN",
                    help="also start this llama-server binary (same model and flags) as checkout 'llama-server'")
    a = ap.parse_args()
    checkouts = a.checkout or [str(Path(__file__).resolve().parents[1])]
    if a.llama_server:
        checkouts.append(LLAMA)
    rng = random.Random(1234)
    runs: dict[str, dict[str, list]] = {c: {} for c in checkouts}
    for rnd in range(a.rounds):
        for c in (checkouts if rnd % 2 == 0 else checkouts[::-1]):
            for k, v in one_start(c, a.model, a.kvserve_args.split(), a.requests, rng, a.pause_s, a.idle_s,
                                  a.llama_server).items():
                runs[c].setdefault(k, []).append(round(v, 3))
            print(json.dumps({"round": rnd, "checkout": c, **{k: v[-1] for k, v in runs[c].items()}}),
                  file=sys.stderr, flush=True)
    result = {"model": a.model, "args": a.kvserve_args, "rounds": a.rounds,
              "figures": {c: {k: {"runs": v, "median": round(statistics.median(v), 3)} for k, v in f.items()}
                          for c, f in runs.items()}}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
