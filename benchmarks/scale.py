"""kvserve replicas behind vllm-router: the router's added latency per request, and 1 vs 2 replicas
on an agent workload. JSON on stdout (and ``--out FILE``).

    python benchmarks/scale.py [--model tiny|smollm2|PATH] [--agents 8] [--requests 6] [--runs 30]

Everything runs on 127.0.0.1 with free ports and is stopped by pid at the end: ``kvserve serve``
replicas (``-t`` ``--threads`` each, ``-np`` = agents) and ``vllm-router --policy cache_aware
--cb-failure-threshold 1``.

* ``overhead``: one replica; the same request sent straight to it and through a router, one
  at a time, alternating, ``--runs`` times each (keep-alive clients on both paths); medians
  and p90 in ms, and the difference: what the router adds per request. Two request shapes:
  ``short`` (a 5-token prompt, 1 token out) and ``agent`` (a warm ~650-token prefix, 8 tokens
  out). Measured with a router over 1 replica and over 2 (it asks every worker to render
  each request, so its cost grows with the workers).
* ``replicas``: ``--agents`` agents, each with its own long prefix, each sending
  ``--requests`` requests one after another, all agents at once, through the router to 1 and
  to 2 replicas: wall time, requests/s, median latency, the fraction of prompt tokens reused,
  and how the agents were spread.
* ``not_measured``: tensor/pipeline parallelism (issue #18 items 1-2) is not measured here.

On a 2-core machine two replicas share the cores one replica had: the point is correctness
(the prefix stays where it is cached) and the router's overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
WORDS = ("alpha beta gamma delta kernel buffer tensor cache block slot router replica token prefix module "
         "parser").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_model(name: str, workdir: Path) -> str:
    """``tiny``: the tests' random-weight model (tests/tinymodel.py); ``smollm2``: the store's;
    else a path."""
    if name == "tiny":
        sys.path.insert(0, str(REPO / "tests"))
        import tinymodel

        return str(tinymodel.write_tiny_gguf(workdir / "tiny.gguf", ctx=4096))
    if name == "smollm2":
        from kvserve.store import resolve_model as store_resolve

        return str(store_resolve("smollm2", pull_missing=True))
    return name


class Proc:
    """A child process with its log file, stopped by pid (SIGTERM, then SIGKILL)."""

    def __init__(self, cmd: list[str], log: Path, url: str, ready_path: str):
        self.url, self.ready_path, self.log = url, ready_path, log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)

    def wait_ready(self, timeout: float = 180.0) -> Proc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args[0]} exited:\n{self.log.read_text(errors='replace')[-3000:]}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"not ready after {timeout} s: {self.proc.args}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_replicas(model: str, n: int, args: argparse.Namespace, workdir: Path) -> list[Proc]:
    reps = []
    for i in range(n):
        port = free_port()
        cmd = [sys.executable, "-m", "kvserve", "serve", model, "--host", "127.0.0.1", "--port", str(port),
               "-a", f"rep-{i}", "-c", str(args.ctx * args.agents), "-np", str(args.agents), "-t", str(args.threads)]
        reps.append(Proc(cmd, workdir / f"rep-{i}-{port}.log", f"http://127.0.0.1:{port}", "/health"))
    return [r.wait_ready() for r in reps]


def start_router(exe: str, workers: list[Proc], workdir: Path) -> Proc:
    port = free_port()
    cmd = [exe, "--worker-urls", *[w.url for w in workers], "--policy", "cache_aware", "--host", "127.0.0.1",
           "--port", str(port), "--prometheus-port", str(free_port()), "--cb-failure-threshold", "1",
           "--worker-startup-check-interval", "1", "--log-level", "warning"]
    return Proc(cmd, workdir / f"router-{port}.log", f"http://127.0.0.1:{port}", "/readiness").wait_ready()


def prefix_text(name: str, n_words: int) -> str:
    rnd = random.Random(name)
    return f"{name} notes: " + " ".join(rnd.choice(WORDS) for _ in range(n_words))


def agent_messages(name: str, k: int, n_words: int) -> list[dict]:
    return [{"role": "system", "content": prefix_text(name, n_words)},
            {"role": "user", "content": f"{name}, question {k}: what is step {k * 7}?"}]


def post_chat(client: httpx.Client, url: str, msgs: list[dict], max_tokens: int) -> tuple[float, dict]:
    body = {"model": "m", "messages": msgs, "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    r = client.post(url + "/v1/chat/completions", json=body, timeout=300)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    return dt, r.json()


def stats_ms(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_ms": round(statistics.median(xs) * 1000, 2),
            "p90_ms": round(xs[min(len(xs) - 1, int(0.9 * len(xs)))] * 1000, 2), "n": len(xs)}


def overhead(replica: Proc, router: Proc, runs: int, n_words: int) -> dict:
    """Alternate direct and routed requests of each shape; medians and the router's addition."""
    shapes = {"short": ([{"role": "user", "content": "hello"}], 1),
              "agent": (agent_messages("Bench", 1, n_words), 8)}
    out = {}
    with httpx.Client() as direct, httpx.Client() as routed:
        for name, (msgs, max_tokens) in shapes.items():
            for c, url in ((direct, replica.url), (routed, router.url)):  # warm both paths and the prefix
                for _ in range(3):
                    post_chat(c, url, msgs, max_tokens)
            times: dict[str, list[float]] = {"direct": [], "router": []}
            for i in range(runs):
                order = (("direct", direct, replica.url), ("router", routed, router.url))
                for label, c, url in order if i % 2 == 0 else order[::-1]:
                    times[label].append(post_chat(c, url, msgs, max_tokens)[0])
            d, r = stats_ms(times["direct"]), stats_ms(times["router"])
            out[name] = {"direct": d, "router": r,
                         "router_added_ms_median": round(r["median_ms"] - d["median_ms"], 2)}
    return out


def render_cost(replica: Proc, runs: int, n_words: int) -> dict:
    """What one render (the router's per-worker prompt-token query) costs on a replica."""
    body = {"model": "m", "messages": agent_messages("Bench", 1, n_words), "max_tokens": 8}
    times = []
    with httpx.Client() as c:
        for _ in range(runs + 3):
            t0 = time.perf_counter()
            c.post(replica.url + "/v1/chat/completions/render", json=body).raise_for_status()
            times.append(time.perf_counter() - t0)
    return stats_ms(times[3:])


def agent_workload(router: Proc, agents: int, requests: int, n_words: int) -> dict:
    names = [f"Agent{i}" for i in range(agents)]
    lat: list[float] = []
    served: dict[str, set] = {n: set() for n in names}
    prompt = cached = 0
    lock = threading.Lock()
    errors: list[BaseException] = []
    barrier = threading.Barrier(agents)

    def run(name: str) -> None:
        nonlocal prompt, cached
        try:
            with httpx.Client() as c:
                barrier.wait()
                for k in range(1, requests + 1):
                    dt, r = post_chat(c, router.url, agent_messages(name, k, n_words), 32 if k == 1 else 8)
                    with lock:
                        lat.append(dt)
                        served[name].add(r["model"])
                        prompt += r["usage"]["prompt_tokens"]
                        cached += r["usage"]["prompt_tokens_details"]["cached_tokens"]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(n,)) for n in names]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    per_replica: dict[str, int] = {}
    for s in served.values():
        for m in s:
            per_replica[m] = per_replica.get(m, 0) + 1
    return {"agents": agents, "requests": len(lat), "wall_s": round(wall, 3),
            "requests_per_s": round(len(lat) / wall, 2), "latency": stats_ms(lat),
            "prompt_tokens": prompt, "cached_tokens": cached, "cached_fraction": round(cached / max(prompt, 1), 4),
            "agents_on_one_replica": sum(len(s) == 1 for s in served.values()),
            "agents_per_replica": dict(sorted(per_replica.items()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny (the tests' random model), smollm2, or a GGUF path")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--requests", type=int, default=6, help="requests per agent")
    ap.add_argument("--words", type=int, default=130, help="prefix words (~650 tokens with the tiny model)")
    ap.add_argument("--runs", type=int, default=30, help="requests per path and shape in the overhead part")
    ap.add_argument("--threads", type=int, default=1, help="-t of each replica")
    ap.add_argument("--ctx", type=int, default=2048, help="context per slot (tokens)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    exe = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    if not os.path.exists(exe):
        sys.exit("vllm-router is not installed (pip install vllm-router==0.1.17)")
    workdir = Path(tempfile.mkdtemp(prefix="kvserve-scale-"))
    model = resolve_model(args.model, workdir)
    procs: list[Proc] = []
    result: dict = {"benchmark": "scale", "model": args.model, "machine": {"cpus": os.cpu_count(),
                    "python": platform.python_version()},
                    "router": "vllm-router 0.1.17 --policy cache_aware --cb-failure-threshold 1",
                    "replica_flags": f"-t {args.threads} -np {args.agents} -c {args.ctx * args.agents}"}
    try:
        reps = start_replicas(model, 2, args, workdir)
        procs += reps
        r1 = start_router(exe, reps[:1], workdir)
        procs.append(r1)
        result["overhead"] = {"router_over_1_replica": overhead(reps[0], r1, args.runs, args.words)}
        result["render_per_worker"] = render_cost(reps[0], args.runs, args.words)
        result["replicas"] = {"1": agent_workload(r1, args.agents, args.requests, args.words)}
        r1.stop()
        # fresh replicas for the 2-replica run: nothing of the 1-replica run cached
        for p in reps:
            p.stop()
        reps = start_replicas(model, 2, args, workdir)
        procs += reps
        r2 = start_router(exe, reps, workdir)
        procs.append(r2)
        result["replicas"]["2"] = agent_workload(r2, args.agents, args.requests, args.words)
        result["overhead"]["router_over_2_replicas"] = overhead(reps[0], r2, args.runs, args.words)
        result["not_measured"] = {"tp": "tensor parallelism (-tp, issue #18 item 1) is not measured here",
                                  "pp": "pipeline parallelism (-pp, issue #18 item 2) is not measured here"}
    finally:
        for p in procs:
            p.stop()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
