"""kvserve and llama-server side by side in one run, on the same GGUF and the same flags (issue #17).

    python benchmarks/vs_llama_server.py --llama-server PATH/llama-server [--model smollm2]
        [--rounds 2] [--parallel 16] [--ctx 65536] [--threads 2] [--skip-agent]

Starts llama-server and ``kvserve serve`` (no speed flag: the default mode) on free loopback
ports with ``-np P -c C -t T``, and a second kvserve with ``--spec-type ngram`` for the agent
workload, then measures each figure on each server in turn, round after round, so machine load
hits all alike. Every request goes through llama-server's ``/completion`` (kvserve has it too),
greedy, and the figures come from the final chunk's ``timings``, which both servers fill the same
way (``prompt_per_second``, ``predicted_per_second``), or from the client's clock:

- ``prefill_tok_s``: a fresh 402-token prompt of random token ids (nothing cached), one token out:
  ``timings.prompt_per_second``.
- ``decode_1_tok_s``: one stream, 128 tokens out (``ignore_eos``) after a 16-token prompt:
  ``timings.predicted_per_second``.
- ``decode_16_tok_s``: ``--parallel`` streams at once, 128 tokens each, 32-token prompts: all
  output tokens / the time from the first stream's first token to the last stream's end
  (``decode_16_wall_tok_s``: over the whole wall time, prefills included). With ``--parallel 1`` these
  are ``decode_1_client_tok_s`` / ``decode_1_client_wall_tok_s``: one stream by the client's clock.
- ``ttft_cold_s`` / ``ttft_warm_s``: time to the first streamed token of a fresh 1,500-token prompt,
  then of the same prompt plus one token (``cache_n`` of the warm one is printed).
- ``agent_tok_s``: ``benchmarks/agent_edit.py``'s prompt (a 500-token source file to be printed
  back with one rename), 400 tokens greedy, on llama-server, kvserve plain and kvserve ngram;
  ``agent_identical``: kvserve's two outputs are the same text (they must be).
- ``startup_s``: seconds from each server's start to ``/health`` 200 (model file already in the
  store; the page cache warm).
- ``rss_mib`` / ``peak_rss_mib``: each server's resident memory after the rounds (``VmRSS`` of its
  process tree, file pages mapped and touched included, as ``ps`` shows them) and its peak
  (``VmHWM``), read from /proc.
- ``decode_1_read_gb_s``: the weight bytes one decode step reads (the file's tensor bytes less the
  token embedding, which a step gathers one row of) x ``decode_1_tok_s``: the effective read
  bandwidth, to set beside the machine's (``--measure-bandwidth``: numpy sums over 2 GiB, the
  threads the servers use).

Prints one JSON object: each figure's per-round values and median per server, and the ratios
kvserve / llama-server of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_edit import ASK, SOURCE, SYSTEM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _this_checkout_env() -> dict[str, str]:
    """The environment with this checkout first on PYTHONPATH, so ``python -m kvserve`` runs this
    checkout's code whatever the caller's directory (the venv's editable install may be another)."""
    root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


def wait_health(url: str, proc: subprocess.Popen, timeout: float = 600) -> float:
    """Seconds until GET /health answers 200; raises if the process exits first. One client for
    all polls: ``httpx.get`` builds a client (and its TLS context) per call, which took about a
    third of a core at 20 polls a second, taken from the server being timed."""
    t0 = time.perf_counter()
    with httpx.Client(timeout=2) as client:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
            try:
                if client.get(url + "/health").status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    raise RuntimeError(f"{url} not healthy after {timeout} s")


def completion(client: httpx.Client, url: str, body: dict) -> dict:
    """One streamed /completion: {"ttft": s, "end": perf_counter at the end, "first": perf_counter of
    the first token, "content": text, "timings": the final chunk's timings}. A kept-alive connection
    the server closed before answering (llama-server's HTTP library closes idle or much-used ones; the
    client finds out only on its next request) is retried once on a new one."""
    try:
        return _completion(client, url, body)
    except httpx.RemoteProtocolError:
        with httpx.Client(timeout=client.timeout) as fresh:
            return _completion(fresh, url, body)


def _completion(client: httpx.Client, url: str, body: dict) -> dict:
    body = {"temperature": 0, "cache_prompt": True, **body, "stream": True}
    t0 = time.perf_counter()
    first = None
    text: list[str] = []
    timings: dict = {}
    with client.stream("POST", url + "/completion", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:].strip()
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if ev.get("content"):
                if first is None:
                    first = time.perf_counter()
                text.append(ev["content"])
            if ev.get("timings"):
                timings = ev["timings"]
    end = time.perf_counter()
    first = first or end
    return {"ttft": first - t0, "first": first, "end": end, "content": "".join(text), "timings": timings}


def random_ids(rng: random.Random, n: int) -> list[int]:
    # ordinary tokens of SmolLM2's vocabulary (no control tokens, which sit below 17)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def fig_prefill(client, url, rng) -> float:
    return completion(client, url, {"prompt": random_ids(rng, 402), "n_predict": 1})["timings"]["prompt_per_second"]


def fig_decode_1(client, url, rng) -> float:
    r = completion(client, url, {"prompt": random_ids(rng, 16), "n_predict": 128, "ignore_eos": True})
    return r["timings"]["predicted_per_second"]


def fig_decode_n(client, url, rng, n: int) -> tuple[float, float]:
    prompts = [random_ids(rng, 32) for _ in range(n)]
    results: list[dict] = [None] * n  # type: ignore[list-item]

    def one(i):
        with httpx.Client(timeout=600) as c:
            results[i] = completion(c, url, {"prompt": prompts[i], "n_predict": 128, "ignore_eos": True})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    toks = sum(r["timings"]["predicted_n"] for r in results)
    first = min(r["first"] for r in results)
    end = max(r["end"] for r in results)
    return toks / (end - first), toks / (end - t0)


def fig_ttft(client, url, rng) -> tuple[float, float, int]:
    ids = random_ids(rng, 1500)
    cold = completion(client, url, {"prompt": ids, "n_predict": 4})
    warm = completion(client, url, {"prompt": ids + [rng.randrange(1000, 40000)], "n_predict": 4})
    return cold["ttft"], warm["ttft"], warm["timings"].get("cache_n", -1)


AGENT_PROMPT = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{ASK}<|im_end|>\n<|im_start|>assistant\n"
                "```python\n" + SOURCE.split("\n")[0] + "\n")


def fig_agent(client, url) -> tuple[float, str]:
    # cache_prompt off: each run prefills and decodes the same way (the figure is decode speed)
    r = completion(client, url, {"prompt": AGENT_PROMPT, "n_predict": 400, "cache_prompt": False})
    return r["timings"]["predicted_per_second"], r["content"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True, help="path of the llama-server binary")
    ap.add_argument("--model", default="smollm2", help="kvserve store name or GGUF path")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=65536)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-agent", action="store_true")
    ap.add_argument("--kvserve-args", default="", help="extra kvserve serve flags (default: none)")
    ap.add_argument("--skip-ttft", action="store_true", help="no cold/warm TTFT figures (1,500-token prompts)")
    ap.add_argument("--measure-bandwidth", action="store_true", help="also the machine's read bandwidth")
    a = ap.parse_args()

    from kvserve.store import resolve_model

    gguf = str(resolve_model(a.model, pull_missing=True))
    common = ["-np", str(a.parallel), "-c", str(a.ctx), "-t", str(a.threads), "--host", "127.0.0.1"]
    specs = {"llama-server": [a.llama_server, "-m", gguf, *common],
             "kvserve": [sys.executable, "-m", "kvserve", "serve", gguf, *common, *a.kvserve_args.split()]}
    if not a.skip_agent:
        specs["kvserve-ngram"] = [*specs["kvserve"], "--spec-type", "ngram"]
    procs: dict[str, subprocess.Popen] = {}
    urls: dict[str, str] = {}
    out: dict = {"model": gguf, "flags": " ".join(common), "rounds": a.rounds, "cpu": _cpu()}
    logs = tempfile.mkdtemp(prefix="vs_llama_server_")  # each server's output (named in the JSON)
    out["logs"] = logs
    try:
        for name, cmd in specs.items():
            port = free_port()
            log = open(os.path.join(logs, f"{name}.log"), "wb")
            procs[name] = subprocess.Popen([*cmd, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True, env=_this_checkout_env())
            urls[name] = f"http://127.0.0.1:{port}"
            secs = wait_health(urls[name], procs[name])
            out.setdefault("startup_s", {})[name] = round(secs, 2)
            if name == "kvserve":
                out["kvserve_startup_s"] = round(secs, 2)
        rng = random.Random(1234)
        main_servers = ["llama-server", "kvserve"]
        figs: dict[str, dict[str, list]] = {}

        def add(fig, name, v):
            figs.setdefault(fig, {}).setdefault(name, []).append(round(v, 4) if isinstance(v, float) else v)

        agent_texts: dict[str, str] = {}
        with httpx.Client(timeout=600) as client:
            for name in main_servers:  # warm-up: first requests pay one-time costs
                fig_decode_1(client, urls[name], rng)
            for rnd in range(a.rounds):
                order = main_servers if rnd % 2 == 0 else main_servers[::-1]
                for name in order:
                    u = urls[name]
                    add("prefill_tok_s", name, fig_prefill(client, u, rng))
                    add("decode_1_tok_s", name, fig_decode_1(client, u, rng))
                    d, w = fig_decode_n(client, u, rng, a.parallel)
                    # --parallel 1: the client's clock, not mixed into decode_1_tok_s (the servers' timings)
                    many = f"decode_{a.parallel}" if a.parallel > 1 else "decode_1_client"
                    add(f"{many}_tok_s", name, d)
                    add(f"{many}_wall_tok_s", name, w)
                    if not a.skip_ttft:
                        c, wm, cn = fig_ttft(client, u, rng)
                        add("ttft_cold_s", name, c)
                        add("ttft_warm_s", name, wm)
                        add("ttft_warm_cache_n", name, cn)
                if not a.skip_agent:
                    for name in (order + ["kvserve-ngram"]):
                        v, text = fig_agent(client, urls[name])
                        add("agent_tok_s", name, v)
                        agent_texts.setdefault(name, text)
        for name in main_servers:
            rss, peak = tree_memory_mib(procs[name].pid)
            add("rss_mib", name, rss)
            add("peak_rss_mib", name, peak)
        step_bytes = decode_weight_bytes(gguf)
        for name in main_servers:
            for v in figs["decode_1_tok_s"][name]:
                add("decode_1_read_gb_s", name, step_bytes * v / 1e9)
        out["decode_step_weight_bytes"] = step_bytes
        if a.measure_bandwidth:
            out["machine_read_gb_s"] = read_bandwidth_gb_s(a.threads)
        out["figures"] = {f: {n: {"runs": v, "median": statistics.median(v)} for n, v in per.items()}
                          for f, per in figs.items()}
        ratios = {}
        for f, per in out["figures"].items():
            if "llama-server" in per and "kvserve" in per and per["llama-server"]["median"]:
                ratios[f] = round(per["kvserve"]["median"] / per["llama-server"]["median"], 3)
        if not a.skip_agent:
            ag = out["figures"]["agent_tok_s"]
            ratios["agent_ngram_vs_llama_server"] = round(ag["kvserve-ngram"]["median"] / ag["llama-server"]["median"], 3)
            ratios["agent_ngram_vs_kvserve_plain"] = round(ag["kvserve-ngram"]["median"] / ag["kvserve"]["median"], 3)
            out["agent_identical"] = agent_texts.get("kvserve") == agent_texts.get("kvserve-ngram")
            out["agent_identical_llama_server"] = agent_texts.get("kvserve") == agent_texts.get("llama-server")
        out["ratios_kvserve_over_llama_server"] = ratios
    except Exception:
        for name, p in procs.items():
            if p.poll() is not None:
                print(f"{name} exited with {p.returncode}; its log: {logs}/{name}.log", file=sys.stderr)
        raise
    finally:
        stop_servers(procs)
    print(json.dumps(out, indent=1))


def stop_servers(procs: dict) -> None:
    """SIGTERM each server's process group, then SIGKILL any still up after 20 s."""
    for p in procs.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs.values():
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def tree_memory_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MiB summed over ``pid`` and its descendants (kvserve's native build runs
    in a child; llama-server is one process)."""
    def status(p: int) -> dict:
        try:
            return {k: v for k, _, v in (ln.partition(":") for ln in Path(f"/proc/{p}/status").read_text().splitlines())}
        except OSError:
            return {}

    def children(p: int) -> list[int]:
        try:
            return [int(c) for t in os.listdir(f"/proc/{p}/task")
                    for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
        except OSError:
            return []

    rss = peak = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        st = status(p)
        rss += int(st.get("VmRSS", "0 kB").split()[0]) / 1024
        peak += int(st.get("VmHWM", "0 kB").split()[0]) / 1024
        todo += children(p)
    return round(rss, 1), round(peak, 1)


def decode_weight_bytes(path: str) -> int:
    """Bytes of the tensors one decode step reads: every tensor of the GGUF but the token
    embedding (a step gathers one of its rows), or the embedding too where it is also the output
    head (tied: no ``output.weight``); of a mixture of experts' stacked ``*_exps`` tensors the share
    of the experts a token runs (``expert_used_count / expert_count``)."""
    from kvserve.loaders.gguf import read_gguf_header

    md, infos = read_gguf_header(path)
    names = {t.name for t in infos}
    arch = md.get("general.architecture")
    used, count = md.get(f"{arch}.expert_used_count"), md.get(f"{arch}.expert_count")
    share = used / count if used and count else 1.0
    return int(sum(t.n_bytes * (share if "_exps." in t.name else 1.0) for t in infos
                   if t.name != "token_embd.weight" or "output.weight" not in names))


def read_bandwidth_gb_s(threads: int) -> float:
    """The machine's read bandwidth: ``threads`` threads each summing its share of a 2 GiB
    buffer (numpy releases the GIL), best of three passes, GB/s."""
    import numpy as np

    buf = np.ones(1 << 28, dtype=np.float64)  # 2 GiB
    parts = np.array_split(buf, threads)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        ts = [threading.Thread(target=np.sum, args=(p,)) for p in parts]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = max(best, buf.nbytes / (time.perf_counter() - t0) / 1e9)
    return round(best, 1)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
