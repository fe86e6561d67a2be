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
* ``parallel`` (``--part parallel``; issue #18 items 1-2): in-process engines (EngineCore, the
  server's numerics) of one process (``-t 2``), ``-tp 2`` (SmolLM2: ``-tp 3``, its 9 heads allow
  no 2) and ``-pp 2`` (one thread per rank):
  prefill tok/s (a fresh ~``--prefill``-token prompt), decode tok/s at 1 and 4 streams, and the
  communication per step from rank 0's counters (the step broadcast, all-reduce count x mean
  time, the logits gather, pipeline sends/receives). tp=1 and each parallel layout alternate
  in rounds in one process (``--rounds``); the ratios are of medians measured side by side.
  ``collectives_alone``: a gloo all-reduce of one [1, n_embd] row and a step header between
  processes that do nothing else (microseconds per call): communication without compute waits.

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
WORDS = ["alpha", "beta", "gamma", "delta", "kernel", "buffer", "tensor", "cache", "block", "slot", "router", "replica", "token", "prefix", "module", "parser"]


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


def _engine(model: str, tp: int, pp: int, ctx: int):
    from kvserve.config import EngineConfig
    from kvserve.engine.core import EngineCore
    from kvserve.models.build import load_files

    return EngineCore(load_files(model), EngineConfig(n_ctx=4 * ctx, n_parallel=4, tensor_parallel_size=tp,
                                                      pipeline_parallel_size=pp, threads=2 if tp * pp == 1 else 1))


def _gen(core, prompts: list[list[int]], n: int) -> tuple[float, float, int, int]:
    """Run prompts to n tokens each: (seconds to every first token, seconds of the decode steps after,
    decode tokens, decode steps)."""
    from kvserve.engine.request import Request, SamplingParams

    for i, ids in enumerate(prompts):
        core.add_request(Request(f"b{time.monotonic_ns()}-{i}", ids, SamplingParams(temperature=0.0, n_predict=n,
                                                                                    ignore_eos=True)))
    t0 = time.perf_counter()
    first = None
    toks = steps = 0
    seen: set = set()
    while core.has_work():
        outs = core.step()
        for o in outs:
            if o.request_id not in seen and o.new_token_ids:
                seen.add(o.request_id)
            elif o.new_token_ids:
                toks += len(o.new_token_ids)
        if first is None and len(seen) == len(prompts):
            first = time.perf_counter()
        elif first is not None:
            steps += 1
    end = time.perf_counter()
    return first - t0, end - first, toks, steps


def _comm_delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in a}


def _measure(core, tp: int, pp: int, words: int, rnd: random.Random) -> dict:
    import torch

    torch.set_num_threads(2 if tp * pp == 1 else 1)  # process-wide: a parallel runner set 1 for rank 0
    tok = core.tokenizer
    runner = core.runner
    stats = getattr(runner, "stats", None)
    out = {}

    def prompt(n_words):
        return tok.encode(" ".join(rnd.choice(WORDS) for _ in range(n_words)), add_special=True)

    for label, n_streams, n_words, n_out in (("prefill", 1, words, 1), ("decode_1", 1, 8, 33),
                                             ("decode_4", 4, 8, 33)):
        ps = [prompt(n_words) for _ in range(n_streams)]
        before = stats.as_dict() if stats else None
        t_first, t_dec, toks, steps = _gen(core, ps, n_out)
        if label == "prefill":
            out[label] = {"tokens": len(ps[0]), "tok_s": len(ps[0]) / t_first}
        else:
            out[label] = {"tok_s": toks / t_dec if t_dec else None, "steps": steps}
        if stats:
            d = _comm_delta(before, stats.as_dict())
            n = max(d["steps"], 1)
            out[label]["comm_per_step"] = {
                "broadcast_ms": 1e3 * d["bcast_s"] / n, "broadcast_bytes": d["bcast_bytes"] / n,
                "allreduce_count": d["allreduce_calls"] / n,
                "allreduce_ms_each": 1e3 * d["allreduce_s"] / max(d["allreduce_calls"], 1),
                "allreduce_ms": 1e3 * d["allreduce_s"] / n,
                "gather_ms": 1e3 * d["gather_s"] / n, "p2p_wait_ms": 1e3 * d["p2p_s"] / n,
                "micro_batches": d["micro_batches"] / n}
    return out


def _median_of(runs: list[dict], path: tuple[str, ...]):
    vals = []
    for r in runs:
        v = r
        for k in path:
            v = v[k]
        vals.append(v)
    return statistics.median(vals)


def _collective_worker(rank: int, world: int, port: int, n_embd: int, iters: int, q) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.zeros(1, n_embd)
    h = torch.zeros(512, dtype=torch.long)
    # a 4-stream decode step as Python objects, for broadcast_object_list (pickle + 2 broadcasts)
    step = {"shifts": [], "copies": [], "ids": [5, 6, 7, 8], "pos": [40, 41, 42, 43], "slots": [40, 57, 74, 91],
            "kv_index": [list(range(i * 16, i * 16 + 44)) for i in range(4)], "lens": [41, 42, 43, 44],
            "prefills": [], "need": None}

    def pickled():
        box = [step if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)

    out = {}
    for name, fn in (("allreduce_1row_us", lambda: dist.all_reduce(x)), ("broadcast_header_us",
                                                                          lambda: dist.broadcast(h, src=0)),
                     ("broadcast_pickled_step_us", pickled)):
        for _ in range(20):
            fn()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        out[name] = 1e6 * (time.perf_counter() - t0) / iters
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def collective_micro(world: int, n_embd: int, iters: int = 500) -> dict:
    """gloo on loopback between ``world`` processes with nothing else to do: one all-reduce of a
    [1, n_embd] float32 row (a decode step's per-layer message) and one 512-value step header, mean
    microseconds per call; what a step pays for communication alone, without waiting for compute. And
    the same 4-stream decode step sent as a pickled object (``broadcast_object_list``), against
    kvserve's one int64 tensor (the header)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    ps = [ctx.Process(target=_collective_worker, args=(r, world, port, n_embd, iters, q)) for r in range(world)]
    for p in ps:
        p.start()
    out = q.get(timeout=300)
    for p in ps:
        p.join(30)
    return {"world": world, "n_embd": n_embd, "iters": iters, **{k: round(v, 1) for k, v in out.items()}}


def parallel_bench(model: str, rounds: int, words: int, ctx: int, tp: int = 0) -> dict:
    """tp=1 vs tp=N and tp=1 vs pp=2, alternating in rounds (see the module docstring). ``tp`` 0: 2
    when the model's heads allow it, else the smallest size they allow (SmolLM2's 9 heads: 3)."""
    from kvserve.engine.parallel import parallel_error
    from kvserve.serving.startup_checks import read_header

    cfg = read_header(model).config
    if not tp:
        tp = next(n for n in range(2, cfg.n_head + 1) if parallel_error(cfg, n, 1) is None)
    rnd = random.Random(0)
    micro = [collective_micro(w, cfg.n_embd) for w in sorted({2, tp})]
    one = _engine(model, 1, 1, ctx)
    result: dict = {"collectives_alone": micro, "flags": f"tp=1: -t 2; tp={tp} / pp=2: one thread per rank (-t 1 each), on "
                             f"{os.cpu_count()} cores", "rounds": rounds,
                    "tp_note": f"{cfg.n_head} heads, {cfg.n_head_kv} KV heads: tp={tp} is the smallest size "
                               "above 1 they allow" if tp != 2 else ""}
    try:
        for t, pp in ((tp, 1), (1, 2)):
            par = _engine(model, t, pp, ctx)
            a, b = [], []
            try:
                for _ in range(rounds):
                    a.append(_measure(one, 1, 1, words, rnd))
                    b.append(_measure(par, t, pp, words, rnd))
            finally:
                par.close()
            key = f"tp{t}" if t > 1 else f"pp{pp}"
            row = {}
            for label, metric in (("prefill", "tok_s"), ("decode_1", "tok_s"), ("decode_4", "tok_s")):
                m1, m2 = _median_of(a, (label, metric)), _median_of(b, (label, metric))
                row[label] = {"tp1_tok_s": round(m1, 1), f"{key}_tok_s": round(m2, 1), "ratio": round(m2 / m1, 3)}
                comm = {k: round(_median_of(b, (label, "comm_per_step", k)), 4)
                        for k in b[0][label]["comm_per_step"]}
                row[label]["comm_per_step"] = comm
            row["prefill"]["tokens"] = b[0]["prefill"]["tokens"]
            result[key] = row
    finally:
        one.close()
    return result


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
    ap.add_argument("--part", choices=("replicas", "parallel", "all"), default="replicas",
                    help="replicas behind vllm-router, tensor/pipeline parallelism, or both")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds in the parallel part")
    ap.add_argument("--prefill", type=int, default=100, help="prefill prompt words in the parallel part")
    ap.add_argument("--tp", type=int, default=0, help="tensor-parallel size to compare (0: 2, or the smallest the "
                    "model's heads allow)")
    args = ap.parse_args()
    if args.part == "parallel":
        workdir = Path(tempfile.mkdtemp(prefix="kvserve-scale-"))
        model = resolve_model(args.model, workdir)
        result = {"benchmark": "scale", "model": args.model, "machine": {"cpus": os.cpu_count(),
                  "python": platform.python_version()},
                  "parallel": parallel_bench(model, args.rounds, args.prefill, args.ctx, args.tp)}
        text = json.dumps(result, indent=2)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return
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
        if args.part == "all":
            for p in procs:
                p.stop()
            result["parallel"] = parallel_bench(model, args.rounds, args.prefill, args.ctx, args.tp)
    finally:
        for p in procs:
            p.stop()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
