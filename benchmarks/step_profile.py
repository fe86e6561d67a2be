"""Where a decode step's CPU goes, in process (``EngineCore``, no HTTP): the native step against the rest.

    python benchmarks/step_profile.py --model FILE [--streams 16] [--n-predict 48] [--threads 1]
                                      [--prompt-tokens 32] [--runs 2] [--cprofile]

Starts ``--streams`` greedy requests at once (distinct prompts, ``ignore_eos``) and, over the steps in
which every stream decodes, measures the engine thread's CPU time (``time.thread_time``: with
``--threads 1`` the native step runs on this thread, so its CPU is all of the step's) split into:
``native`` (``NativeDecode.__call__``: embedding, the C++ layers, the head), and inside it
``decoder_step`` (the C++ layers) and ``head`` (``Decoder.logits``), ``prepare``
(``ModelRunner.prepare``: the flat batch), ``sample`` (``ModelRunner.sample``), ``schedule``
(``Scheduler.schedule``), ``update`` (``EngineCore._update``: appending tokens, stop checks, outputs)
and ``other`` (the rest of ``EngineCore.step``), with ``step_wall`` (the step's wall time) and ``step_process_cpu``
(every thread's CPU in it). Prints one JSON object: ms per step and per token
for each part (medians over runs). ``--cprofile`` also prints cProfile's top functions by own time
over the non-native part (the native call excluded) to stderr.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kvserve, not the venv's

PARTS = ("prepare", "native", "decoder_step", "head", "sample", "schedule", "update")


class _Timer:
    """Wraps ``obj.name`` to add its thread CPU seconds to ``acc[part]`` (nested parts count in both)."""

    def __init__(self, acc: dict, part: str, obj, name: str):
        self.acc, self.part, self.obj, self.name = acc, part, obj, name
        self.orig = getattr(obj, name)
        acc.setdefault(part, 0.0)
        timer = self

        def wrapped(*a, **k):
            t0 = time.thread_time()
            try:
                return timer.orig(*a, **k)
            finally:
                timer.acc[timer.part] += time.thread_time() - t0

        setattr(obj, name, wrapped)


class _DecoderProxy:
    """Forwards to the C++ Decoder, timing ``step`` and ``logits``."""

    def __init__(self, dec, acc):
        self._dec, self._acc = dec, acc

    def step(self, *a):
        t0 = time.thread_time()
        try:
            return self._dec.step(*a)
        finally:
            self._acc["decoder_step"] += time.thread_time() - t0

    def logits(self, *a):
        t0 = time.thread_time()
        try:
            return self._dec.logits(*a)
        finally:
            self._acc["head"] += time.thread_time() - t0

    def __getattr__(self, k):
        return getattr(self._dec, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--n-predict", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=0, help="n_ctx (0: 1024 per stream)")
    ap.add_argument("--cprofile", action="store_true")
    a = ap.parse_args()

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from agent_edit import _wait_native

    from kvserve.config import EngineConfig
    from kvserve.engine.core import EngineCore
    from kvserve.engine.request import Request, SamplingParams
    from kvserve.models.build import load_files

    loaded = load_files(a.model)
    core = EngineCore(loaded, EngineConfig(n_ctx=a.ctx or 1024 * a.streams, n_parallel=a.streams,
                                           kv_unified=True, threads=a.threads, cache_ram=0))
    _wait_native({"engine": core})
    runner = core.runner
    nat = runner.native
    acc: dict[str, float] = {p: 0.0 for p in PARTS}
    _Timer(acc, "prepare", runner, "prepare")
    _Timer(acc, "sample", runner, "sample")
    _Timer(acc, "schedule", core.scheduler, "schedule")
    _Timer(acc, "update", core, "_update")
    if nat is not None and nat.ready:
        nat.decoder = _DecoderProxy(nat.decoder, acc)
        call = type(nat).__call__

        def timed_call(self, *args, **kw):
            t0 = time.thread_time()
            try:
                return call(self, *args, **kw)
            finally:
                acc["native"] += time.thread_time() - t0

        type(nat).__call__ = timed_call
    import gc

    gc_t = {"start": 0.0}
    gc_acc = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}  # generation -> [collections, thread CPU seconds]

    def on_gc(phase, info):
        if phase == "start":
            gc_t["start"] = time.thread_time()
        else:
            e = gc_acc[info["generation"]]
            e[0] += 1
            e[1] += time.thread_time() - gc_t["start"]

    gc.callbacks.append(on_gc)
    vocab = loaded.config.n_vocab
    g = torch.Generator().manual_seed(0)
    prof = cProfile.Profile() if a.cprofile else None

    def run_once(n_streams, n_predict, measure):
        reqs = [Request(f"p{time.monotonic_ns()}-{i}",
                        torch.randint(100, vocab - 1, (a.prompt_tokens,), generator=g).tolist(),
                        SamplingParams(n_predict=n_predict, temperature=0.0, ignore_eos=True))
                for i in range(n_streams)]
        for r in reqs:
            core.add_request(r)
        left = {r.request_id for r in reqs}
        steps = toks = 0
        cpu = wall = proc = 0.0
        part0 = dict(acc)
        parts = {p: 0.0 for p in PARTS}
        while left:
            all_dec = all(r.num_computed_tokens >= r.num_prompt_tokens for r in reqs if r.request_id in left)
            full = all_dec and len(left) == len(reqs)
            before = dict(acc)
            if full and prof is not None and measure:
                prof.enable()
            t0, w0, p0 = time.thread_time(), time.perf_counter(), time.process_time()
            outs = core.step()
            dt = time.thread_time() - t0
            dw, dp = time.perf_counter() - w0, time.process_time() - p0
            if prof is not None:
                prof.disable()
            if full:
                steps += 1
                toks += sum(len(o.new_token_ids) for o in outs)
                cpu += dt
                wall += dw
                proc += dp
                for p in PARTS:
                    parts[p] += acc[p] - before[p]
            for o in outs:
                if o.finished:
                    left.discard(o.request_id)
        del part0
        return steps, toks, cpu, parts, wall, proc

    run_once(2, 4, False)  # warm-up
    for e in gc_acc.values():
        e[0], e[1] = 0, 0.0
    rows = []
    for _ in range(a.runs):
        steps, toks, cpu, parts, wall, proc = run_once(a.streams, a.n_predict, True)
        other = cpu - parts["prepare"] - parts["native"] - parts["sample"] - parts["schedule"] - parts["update"]
        ms = {p: parts[p] * 1e3 / steps for p in PARTS}
        ms["native_python"] = ms["native"] - ms["decoder_step"] - ms["head"]
        ms["other"] = other * 1e3 / steps
        ms["outside_native"] = (cpu - parts["native"]) * 1e3 / steps
        ms["step"] = cpu * 1e3 / steps
        ms["step_wall"] = wall * 1e3 / steps  # the step's wall time (with --threads > 1: the figure that counts)
        ms["step_process_cpu"] = proc * 1e3 / steps  # every thread's CPU during the step (workers' spin included)
        rows.append({"steps": steps, "tokens": toks, "ms_per_step": {k: round(v, 3) for k, v in ms.items()},
                     "ms_per_token": round(cpu * 1e3 / toks, 3)})
    keys = rows[0]["ms_per_step"].keys()
    med = {k: round(statistics.median(r["ms_per_step"][k] for r in rows), 3) for k in keys}
    print(json.dumps({"benchmark": "step_profile", "model": a.model, "streams": a.streams, "threads": a.threads,
                      "native": bool(nat is not None and nat.ready),
                      "median_ms_per_step": med,
                      "median_ms_per_token": round(statistics.median(r["ms_per_token"] for r in rows), 3),
                      "gc": {f"gen{k}": {"collections": v[0], "ms": round(v[1] * 1e3, 2)} for k, v in gc_acc.items()},
                      "runs": rows}, indent=1))
    if prof is not None:
        st = pstats.Stats(prof, stream=sys.stderr)
        st.sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
