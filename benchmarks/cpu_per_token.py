"""CPU time per decoded token of kvserve and llama-server, one thread each: a figure a busy machine leaves alone.

    python benchmarks/cpu_per_token.py --llama-server BIN --model FILE [--tokens 128] [--rounds 3]

Wall-clock speed on a shared machine measures the other tenants as much as the server (issue #30's MoE
goal was measured with the load average at 15-20 on 2 cores). The CPU time a server's process tree
spends per decoded token (``utime + stime`` from /proc, all its threads) does not depend on how long
it waited for a core. Each server runs with ``-t 1`` (no spinning pool threads to count) and
``-np 1``; per round and server: a 16-token prompt with 1 token out, then the same prompt (not
cached) with ``--tokens + 1`` out; the difference of their CPU times over ``--tokens`` is one
decoded token's CPU time (the prefill cancels). Rounds alternate the servers. Prints one JSON
object: per server the per-round ms of CPU per token and their median, and the ratio
kvserve / llama-server (below 1: kvserve spends less CPU per token).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_llama_server import _this_checkout_env, free_port, stop_servers, wait_health  # noqa: E402


def tree_cpu_s(pid: int) -> float:
    """utime + stime (seconds) of ``pid`` and its descendants, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for t in Path(f"/proc/{p}/task").iterdir():
                kids = (t / "children").read_text().split()
                todo += [int(k) for k in kids]
        except OSError:
            continue
    return total


def one(client: httpx.Client, url: str, pid: int, prompt: list[int], n: int) -> float:
    """CPU seconds of the server's tree for one /completion of ``n`` tokens (greedy, nothing cached)."""
    c0 = tree_cpu_s(pid)
    r = client.post(url + "/completion", json={"prompt": prompt, "n_predict": n, "ignore_eos": True,
                                               "temperature": 0, "cache_prompt": False})
    r.raise_for_status()
    return tree_cpu_s(pid) - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=4096)
    a = ap.parse_args()
    common = ["-np", "1", "-c", str(a.ctx), "-t", "1", "--host", "127.0.0.1"]
    specs = {"llama-server": [a.llama_server, "-m", a.model, *common],
             "kvserve": [sys.executable, "-m", "kvserve", "serve", a.model, *common]}
    procs, urls = {}, {}
    logs = tempfile.mkdtemp(prefix="cpu_per_token_")
    out: dict = {"model": a.model, "flags": " ".join(common), "tokens": a.tokens, "logs": logs}
    prompt = list(range(1000, 1016))
    try:
        for name, cmd in specs.items():
            port = free_port()
            log = open(os.path.join(logs, f"{name}.log"), "wb")
            procs[name] = subprocess.Popen([*cmd, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True, env=_this_checkout_env())
            urls[name] = f"http://127.0.0.1:{port}"
            wait_health(urls[name], procs[name])
        ms: dict[str, list[float]] = {n: [] for n in specs}
        with httpx.Client(timeout=1200) as client:
            for name in specs:  # warm-up
                one(client, urls[name], procs[name].pid, prompt, 8)
            for rnd in range(a.rounds):
                for name in (list(specs) if rnd % 2 == 0 else list(specs)[::-1]):
                    pid = procs[name].pid
                    base = one(client, urls[name], pid, prompt, 1)
                    full = one(client, urls[name], pid, prompt, a.tokens + 1)
                    ms[name].append(round((full - base) / a.tokens * 1e3, 2))
        out["cpu_ms_per_token"] = {n: {"runs": v, "median": statistics.median(v)} for n, v in ms.items()}
        out["ratio_kvserve_over_llama_server"] = round(
            out["cpu_ms_per_token"]["kvserve"]["median"] / out["cpu_ms_per_token"]["llama-server"]["median"], 3)
    finally:
        stop_servers(procs)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
