"""Soak test: N clients for T seconds against any running kvserve, with random hang-ups.

    python benchmarks/soak.py --url http://127.0.0.1:8080 --clients 64 --seconds 300 [--api-key K]

Each client loops: it sends one request, waits for its answer, and sends the next. A request is
``/completion`` (llama-server dialect) or ``/v1/chat/completions`` (OpenAI), streaming or not, with
a small random ``n_predict`` / ``max_tokens`` and a prompt that sometimes shares a prefix with
others (so the prompt cache is exercised). About ``--hangup`` of them are abandoned on purpose:
a stream is closed after its first few events, a non-streaming request is cancelled mid-flight
(the connection closes; the server should abort the generation and free the slot).

Every request ends as exactly one of: completed (2xx and a whole answer: a JSON body, or a stream
that ended with ``"stop": true`` / ``[DONE]``), hung_up (abandoned on purpose), an error (by kind:
``http_<status>``, the exception class, ``stream_error_event``, ``stream_incomplete``) or hung (no
end within ``--deadline`` seconds). ``lost`` counts requests that ended as none of these (a bug of
this script; it should be 0).

The server's RSS (VmRSS of /proc/<pid>/status) is sampled every second: the pid is ``--pid``, or
found from the URL's port (the listening socket's inode in /proc/net/tcp{,6}, then the process
holding it in /proc/*/fd) when the server runs on this machine. After the run and ``--grace``
seconds, GET /slots says how many slots are idle.

Prints ONE JSON object on stdout:
  {"url", "clients", "seconds", "sent", "completed", "hung_up", "hung", "lost", "errors": {kind: n},
   "latency_ms": {"p50", "p95", "max"} (completed requests, end to end), "ttft_ms": {"p50", "p95"}
   (completed streams), "requests_per_s", "rss_mb": {"start", "max", "end", "pid", "every_s", "samples"}
   ("samples": the RSS every ``--rss-every`` seconds from the start, to show a plateau),
   "slots": {"idle", "total", "all_idle"}}
Progress goes to stderr. Depends on httpx only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from urllib.parse import urlparse

import httpx

PREFIXES = ["You are a helpful assistant. Answer in one short sentence.",
            "Summarize the following text for a busy reader:",
            "Translate into French:",
            ""]
TOPICS = ["the moon", "a cat on a mat", "prime numbers", "the history of bread", "why the sky is blue",
          "a haiku about rain", "binary search", "the Rhine river", "how to boil an egg", "a limerick"]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Output: one JSON object on stdout (see the module docstring).")
    ap.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL (default %(default)s)")
    ap.add_argument("--clients", type=int, default=64, help="concurrent clients (default %(default)s)")
    ap.add_argument("--seconds", type=float, default=300, help="how long clients keep sending (default %(default)s)")
    ap.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: none)")
    ap.add_argument("--pid", type=int, default=None,
                    help="server pid for RSS (default: found from the URL's port via /proc, local servers only)")
    ap.add_argument("--deadline", type=float, default=120,
                    help="seconds after which a request counts as hung (default %(default)s)")
    ap.add_argument("--hangup", type=float, default=0.1,
                    help="share of requests abandoned on purpose mid-flight (default %(default)s)")
    ap.add_argument("--stream", type=float, default=0.5, help="share of streaming requests (default %(default)s)")
    ap.add_argument("--chat", type=float, default=0.5,
                    help="share of /v1/chat/completions (the rest: /completion) (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=16,
                    help="n_predict / max_tokens drawn from 1..N (default %(default)s)")
    ap.add_argument("--grace", type=float, default=5,
                    help="seconds to wait after the run before GET /slots and the last RSS (default %(default)s)")
    ap.add_argument("--rss-every", type=int, default=10,
                    help="seconds between the RSS samples listed in the output (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the request mix (default %(default)s)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return ap.parse_args(argv)


# -- the server's RSS ----------------------------------------------------------------------

def pid_of_port(port: int) -> int | None:
    """The pid of the local process listening on TCP ``port`` (via /proc), or None."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                        inodes.add(cols[9])
        except OSError:
            continue
    if not inodes:
        return None
    wanted = {f"socket:[{i}]" for i in inodes}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    return int(pid)
        except OSError:
            continue
    return None


def rss_mb(pid: int | None) -> float | None:
    """VmRSS of ``pid`` in MiB, or None."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


async def sample_rss(pid: int | None, samples: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        v = rss_mb(pid)
        if v is not None:
            samples.append(v)
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


# -- one request -----------------------------------------------------------------------------

class Stats:
    def __init__(self):
        self.sent = 0
        self.completed = 0
        self.hung_up = 0
        self.hung = 0
        self.errors: Counter = Counter()
        self.latency_ms: list[float] = []
        self.ttft_ms: list[float] = []

    def ended(self) -> int:
        return self.completed + self.hung_up + self.hung + sum(self.errors.values())


def make_request(rng: random.Random, args) -> tuple[str, dict, bool]:
    """(path, body, stream) of one random request."""
    prefix, topic = rng.choice(PREFIXES), rng.choice(TOPICS)
    text = f"{prefix} Tell me about {topic}. ({rng.randrange(10**6)})".strip()
    n, stream = rng.randint(1, args.max_tokens), rng.random() < args.stream
    if rng.random() < args.chat:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": n,
                                        "stream": stream}, stream
    return "/completion", {"prompt": text, "n_predict": n, "stream": stream}, stream


async def run_one(client: httpx.AsyncClient, path: str, body: dict, stream: bool, hangup: bool,
                  rng: random.Random, st: Stats) -> None:
    """Send one request and count how it ended (raises nothing but CancelledError/TimeoutError)."""
    t0 = time.perf_counter()
    if not stream:
        if hangup:  # cancel it mid-flight: the connection closes before the answer
            try:
                await asyncio.wait_for(client.post(path, json=body), rng.uniform(0.01, 0.5))
            except asyncio.TimeoutError:
                st.hung_up += 1
                return
            except httpx.HTTPError as e:
                st.errors[type(e).__name__] += 1
                return
            st.completed += 1  # it was faster than the hang-up
            st.latency_ms.append((time.perf_counter() - t0) * 1e3)
            return
        r = await client.post(path, json=body)
        if r.status_code >= 300:
            st.errors[f"http_{r.status_code}"] += 1
            return
        r.json()
        st.completed += 1
        st.latency_ms.append((time.perf_counter() - t0) * 1e3)
        return
    stop_after = rng.randint(1, 3) if hangup else None
    async with client.stream("POST", path, json=body) as r:
        if r.status_code >= 300:
            await r.aread()
            st.errors[f"http_{r.status_code}"] += 1
            return
        n_events, last, ttft = 0, None, None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if ttft is None:
                ttft = (time.perf_counter() - t0) * 1e3
            n_events += 1
            last = data
            if data != "[DONE]" and '"error"' in data[:12]:
                st.errors["stream_error_event"] += 1
                return
            if stop_after is not None and n_events >= stop_after:
                st.hung_up += 1  # leaving the block closes the stream early
                return
        whole = last == "[DONE]" or (path == "/completion" and last is not None and json.loads(last).get("stop"))
        if not whole:
            st.errors["stream_incomplete"] += 1
            return
        st.completed += 1
        st.latency_ms.append((time.perf_counter() - t0) * 1e3)
        if ttft is not None:
            st.ttft_ms.append(ttft)


async def client_loop(cid: int, client: httpx.AsyncClient, args, until: float, st: Stats) -> None:
    rng = random.Random(args.seed * 100_003 + cid)
    while time.monotonic() < until:
        path, body, stream = make_request(rng, args)
        hangup = rng.random() < args.hangup
        st.sent += 1
        try:
            await asyncio.wait_for(run_one(client, path, body, stream, hangup, rng, st), args.deadline)
        except asyncio.TimeoutError:
            st.hung += 1
        except (httpx.HTTPError, ValueError) as e:  # ValueError: a body that is not JSON
            st.errors[type(e).__name__] += 1


# -- the run ----------------------------------------------------------------------------------

def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(p / 100 * len(xs)))], 1)


async def slot_state(client: httpx.AsyncClient) -> dict:
    try:
        r = await client.get("/slots", timeout=30)
    except httpx.HTTPError as e:
        return {"error": type(e).__name__}
    if r.status_code != 200:
        return {"error": f"http_{r.status_code}"}
    views = r.json()
    idle = sum(1 for v in views if not v.get("is_processing"))
    return {"idle": idle, "total": len(views), "all_idle": idle == len(views)}


async def soak(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    port = urlparse(args.url).port or (443 if args.url.startswith("https") else 80)
    pid = args.pid or pid_of_port(port)
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    timeout = httpx.Timeout(None, connect=30)
    st, samples, stop = Stats(), [], asyncio.Event()
    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits, timeout=timeout) as client:
        h = await client.get("/health", timeout=30)
        if h.status_code != 200:
            raise SystemExit(f"GET /health answered {h.status_code}: {h.text[:200]}")
        rss_start = rss_mb(pid)
        sampler = asyncio.create_task(sample_rss(pid, samples, stop))
        t0 = time.monotonic()
        until = t0 + args.seconds
        progress = None if args.quiet else asyncio.create_task(report_progress(st, t0))
        await asyncio.gather(*(client_loop(i, client, args, until, st) for i in range(args.clients)))
        elapsed = time.monotonic() - t0
        if progress:
            progress.cancel()
        await asyncio.sleep(args.grace)
        slots = await slot_state(client)
        rss_end = rss_mb(pid)
        stop.set()
        await sampler
    return {
        "url": args.url, "clients": args.clients, "seconds": args.seconds,
        "sent": st.sent, "completed": st.completed, "hung_up": st.hung_up, "hung": st.hung,
        "lost": st.sent - st.ended(), "errors": dict(st.errors),
        "latency_ms": {"p50": pct(st.latency_ms, 50), "p95": pct(st.latency_ms, 95),
                       "max": round(max(st.latency_ms), 1) if st.latency_ms else None},
        "ttft_ms": {"p50": pct(st.ttft_ms, 50), "p95": pct(st.ttft_ms, 95)},
        "requests_per_s": round(st.ended() / elapsed, 2),
        "rss_mb": {"start": rss_start, "max": max(samples + [rss_end or 0]) if samples else None, "end": rss_end,
                   "pid": pid, "every_s": args.rss_every, "samples": samples[::max(args.rss_every, 1)]},
        "slots": slots,
    }


async def report_progress(st: Stats, t0: float) -> None:
    while True:
        await asyncio.sleep(10)
        print(f"[{time.monotonic() - t0:6.0f} s] sent {st.sent} completed {st.completed} hung_up {st.hung_up} "
              f"errors {sum(st.errors.values())} hung {st.hung}", file=sys.stderr, flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    print(json.dumps(asyncio.run(soak(args))))


if __name__ == "__main__":
    main()
