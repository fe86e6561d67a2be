"""Time to first token, cold and warm, against any server with llama-server's /completion.

    python benchmarks/prefix_ttft.py --url http://127.0.0.1:8080 [--url http://127.0.0.1:8081 ...]

For each server: a fresh ~1,500-token prompt (random words, so nothing is
cached) is sent with ``stream: true``; the time until the first streamed token
is the cold TTFT. Then a second prompt sharing that prefix plus a new question
is sent; its TTFT is the warm one. Repeated ``--runs`` times; the medians are
printed as one JSON object per server (``cache_n``/``prompt_n`` from the last
chunk's timings when the server reports them). Several ``--url`` values are
measured side by side in one run, alternating, so machine load hits all alike.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import httpx

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu code review patch build test").split()


def make_prefix(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def ttft(client: httpx.Client, url: str, prompt: str) -> tuple[float, dict]:
    """Seconds to the first streamed token, and the final chunk's timings."""
    body = {"prompt": prompt, "n_predict": 4, "temperature": 0, "stream": True, "cache_prompt": True}
    t0 = time.perf_counter()
    first = None
    timings: dict = {}
    with client.stream("POST", url.rstrip("/") + "/completion", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data.strip() == "[DONE]":
                break
            ev = json.loads(data)
            if first is None and ev.get("content"):
                first = time.perf_counter() - t0
            if ev.get("timings"):
                timings = ev["timings"]
            if ev.get("stop"):
                break
    return (first if first is not None else time.perf_counter() - t0), timings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", action="append", required=True)
    ap.add_argument("--words", type=int, default=880, help="words in the shared prefix (~1,500 tokens with SmolLM2)")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    rng = random.Random(1234)
    res: dict[str, dict[str, list]] = {u: {"cold": [], "warm": [], "timings": []} for u in a.url}
    with httpx.Client(timeout=600) as client:
        for _ in range(a.runs):
            prefix = make_prefix(rng, a.words)
            for u in a.url:
                cold, _ = ttft(client, u, prefix + " Question: what comes first?")
                warm, t = ttft(client, u, prefix + " Question: what comes last?")
                res[u]["cold"].append(cold)
                res[u]["warm"].append(warm)
                res[u]["timings"].append(t)
    for u, r in res.items():
        last = r["timings"][-1]
        print(json.dumps({
            "url": u,
            "cold_ttft_ms": round(statistics.median(r["cold"]) * 1e3, 1),
            "warm_ttft_ms": round(statistics.median(r["warm"]) * 1e3, 1),
            "warm_cache_n": last.get("cache_n"),
            "warm_prompt_n": last.get("prompt_n"),
            "runs": a.runs,
        }))


if __name__ == "__main__":
    main()
