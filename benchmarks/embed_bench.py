"""Embedding throughput: kvserve's server (HTTP included) against sentence-transformers' ``encode``
in-process, on the same CPU, the same 1,000 sentences, batch 32.

    python benchmarks/embed_bench.py [--model all-minilm] [--sentences 1000] [--batch 32] [--runs 3]
                                     [--url http://127.0.0.1:8080]  # a server already running

Without ``--url`` a ``kvserve serve MODEL`` process is started on a free loopback port (the
model is pulled first when missing: ``kvserve pull all-minilm``) and stopped at the end. The
sentences are made from a fixed seed (5 to 40 words of English and code-ish vocabulary), so
every run sends the same inputs. Each side gets one warm-up pass, then ``--runs`` timed passes,
alternating so machine load hits both alike (and the two formats alternating which goes first);
the best pass counts. kvserve's client sends the
batches one after another (as ``encode`` runs them), each as one ``POST /v1/embeddings`` with
32 inputs, in ``float`` (JSON numbers) and in ``base64`` (what the openai client asks for);
``--concurrency N`` also sends N batches at a time (the engine then merges them).

Prints one JSON object: sentences/s of each, the ratio kvserve / sentence-transformers, and
the smallest cosine similarity between the two sides' vectors.
"""

from __future__ import annotations

import argparse
import base64
import gc
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

WORDS = [
    "the", "a", "server", "model", "vector", "cache", "request", "token", "prompt", "slot", "batch", "query",
    "document", "search", "index", "python", "java", "rust", "function", "class", "return", "value", "error",
    "retry", "timeout", "network", "memory", "thread", "queue", "apple", "river", "mountain", "city",
    "music", "garden", "window", "coffee", "morning", "evening", "quickly", "slowly", "green", "blue", "def",
    "fn", "main()", "{}", "[]", "=>", "==", "!=", "import", "from", "public", "static", "void", "int", "str",
    "list", "dict", "len", "map",
]


def sentences(n: int, seed: int = 14) -> list[str]:
    """``n`` fixed pseudo-random sentences of 5 to 40 words."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(5, 40))]
        out.append(" ".join(words).capitalize() + ".")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="embed-bench-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "kvserve", "serve", model, "--host", "127.0.0.1", "--port", str(port), *extra]
    with open(log, "wb") as out:
        root = str(Path(__file__).resolve().parents[1])  # this checkout's kvserve, not the venv's
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited:\n{log.read_text(errors='replace')}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit(f"server not ready:\n{log.read_text(errors='replace')}")


def kvserve_pass(client: httpx.Client, url: str, model: str, batches: list[list[str]], fmt: str,
                 concurrency: int) -> tuple[float, list[np.ndarray]]:
    """(seconds, vectors) of one pass over ``batches``."""

    def one(batch: list[str]) -> list[np.ndarray]:
        r = client.post(url + "/v1/embeddings", json={"model": model, "input": batch, "encoding_format": fmt},
                        timeout=600)
        r.raise_for_status()
        data = r.json()["data"]
        if fmt == "base64":
            return [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data]
        return [np.asarray(d["embedding"], dtype=np.float32) for d in data]

    t0 = time.perf_counter()
    if concurrency <= 1:
        out = [one(b) for b in batches]
    else:
        with ThreadPoolExecutor(concurrency) as pool:
            out = list(pool.map(one, batches))
    return time.perf_counter() - t0, [v for vs in out for v in vs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="all-minilm", help="store name or HF directory (default all-minilm)")
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4, help="also time N batches in flight (0: skip)")
    ap.add_argument("--url", help="a kvserve already running (the model is named by --model)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra flag for kvserve serve")
    args = ap.parse_args(argv)

    from sentence_transformers import SentenceTransformer

    from kvserve.store import canonical_name, resolve_model

    path = Path(args.model) if Path(args.model).is_dir() else resolve_model(args.model, pull_missing=True)
    texts = sentences(args.sentences)
    batches = [texts[i:i + args.batch] for i in range(0, len(texts), args.batch)]
    proc = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        proc, url, _ = start_server(args.model, args.server_arg)
    name = canonical_name(args.model) if not Path(args.model).is_dir() else str(path)
    try:
        st = SentenceTransformer(str(path), device="cpu")
        st.encode(texts[: args.batch * 2], batch_size=args.batch)  # warm-up
        client = httpx.Client()
        kvserve_pass(client, url, name, batches[:2], "float", 1)  # warm-up
        # the models and libraries loaded so far are long-lived: keep the collector from rescanning
        # them each time the float answers' millions of small objects trigger a collection (that
        # cost ~1 s of the float pass in this client process; it is not the server's time)
        gc.collect()
        gc.freeze()
        best = {"st": float("inf"), "float": float("inf"), "base64": float("inf"), "concurrent": float("inf")}
        st_vecs = kv_vecs = None
        for run in range(args.runs):
            t0 = time.perf_counter()
            st_vecs = st.encode(texts, batch_size=args.batch)
            best["st"] = min(best["st"], time.perf_counter() - t0)
            # the formats alternate which goes first (right after encode, whose threads may still spin)
            for fmt in (("float", "base64") if run % 2 == 0 else ("base64", "float")):
                s, vecs = kvserve_pass(client, url, name, batches, fmt, 1)
                best[fmt] = min(best[fmt], s)
                kv_vecs = vecs if fmt == "float" else kv_vecs
            if args.concurrency > 1:
                s, _ = kvserve_pass(client, url, name, batches, "base64", args.concurrency)
                best["concurrent"] = min(best["concurrent"], s)
        cos = [float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b))) for a, b in zip(kv_vecs, st_vecs)]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    n = len(texts)
    rate = {k: (n / v if v != float("inf") else None) for k, v in best.items()}
    import torch

    result = {
        "model": name, "sentences": n, "batch": args.batch, "runs": args.runs,
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "sentence_transformers": {"seconds": round(best["st"], 3), "sentences_per_s": round(rate["st"], 1)},
        "kvserve_float": {"seconds": round(best["float"], 3), "sentences_per_s": round(rate["float"], 1)},
        "kvserve_base64": {"seconds": round(best["base64"], 3), "sentences_per_s": round(rate["base64"], 1)},
        "ratio_float": round(rate["float"] / rate["st"], 3),
        "ratio_base64": round(rate["base64"] / rate["st"], 3),
        "min_cosine": round(min(cos), 6),
    }
    if rate["concurrent"]:
        result["kvserve_base64_concurrency"] = {"in_flight": args.concurrency, "seconds": round(best["concurrent"], 3),
                                               "sentences_per_s": round(rate["concurrent"], 1),
                                               "ratio": round(rate["concurrent"] / rate["st"], 3)}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
