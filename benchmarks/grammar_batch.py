"""Per-token cost of structured-output masks at 1 and N constrained streams: one by one after the
forward (the way before), in one batch on the engine thread, in one batch beside the forward.

    python benchmarks/grammar_batch.py [--model smollm2] [--streams 1,16] [--n-predict 64] [--runs 3]
                                       [--modes serial,batch,overlap] [--temperature 0.8]

In process (``EngineCore``, no HTTP). Each run decodes ``streams`` requests together, every one
under the same JSON schema (an object with a name, a count and a list of tags), sampled with its
own seed (``--temperature 0`` for greedy). The modes are ``EngineCore.grammar_batch`` /
``grammar_overlap``: ``serial`` (each row's ``mask()`` in the sampler), ``batch`` (xgrammar's
``BatchGrammarMatcher`` for the step's rows before the forward, on the engine thread) and
``overlap`` (the same batch in a worker thread while the forward runs). The modes alternate
within each round so that machine load hits them alike, and their tokens must be identical.

The mask cost is measured inside, with perf counters, not from tokens/s (the machine is shared
and noisy): ``engine_us_per_token`` is engine-thread time spent on masks per constrained token
(in ``mask()``, which includes waiting for a batch still being filled, plus handing the batch
over); ``fill_us_per_token`` is the time the fill itself took (worker or engine thread); the
``*_cpu_*`` figures are the same spans in the thread's CPU time (``time.thread_time``), which a
loaded machine's preemption does not inflate;
``step_ms`` is the median engine step while all streams decode, to show what overlapping costs
the forward on a machine with few cores. Prints one JSON object: per stream count and mode the
median over rounds of each figure, every round's figures, and whether the tokens were identical.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kvserve, not the venv's

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24}, "count": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6}},
          "required": ["name", "count", "tags"]}
PROMPT = "Describe one product of a hardware store as JSON with its name, the count in stock and a few tags:"
MODES = {"serial": (False, False), "batch": (True, False), "overlap": (True, True)}


class _Clock:
    """Adds up engine-thread seconds in GrammarConstraint.mask and EngineCore._prefetch_masks."""

    def __init__(self):
        from kvserve.engine.core import EngineCore
        from kvserve.structured.backend import GrammarConstraint

        self.seconds = 0.0
        self.cpu = 0.0
        self.calls = 0
        mask, prefetch = GrammarConstraint.mask, EngineCore._prefetch_masks
        clock = self

        def timed_mask(c):
            t, u = time.perf_counter(), time.thread_time()
            m = mask(c)
            clock.seconds += time.perf_counter() - t
            clock.cpu += time.thread_time() - u
            clock.calls += 1
            return m

        def timed_prefetch(core, sched):
            t, u = time.perf_counter(), time.thread_time()
            b = prefetch(core, sched)
            clock.seconds += time.perf_counter() - t
            clock.cpu += time.thread_time() - u
            return b

        GrammarConstraint.mask = timed_mask
        EngineCore._prefetch_masks = timed_prefetch


def _run(core, backend, spec, prompt, streams: int, n_predict: int, temperature: float, tag: str, clock):
    from kvserve.engine.request import Request, SamplingParams
    from kvserve.structured import batch as mask_batch

    reqs = [Request(f"{tag}-{i}", list(prompt),
                    SamplingParams(n_predict=n_predict, temperature=temperature, seed=1000 + i, cache_prompt=True),
                    grammar=backend.constraint(spec)) for i in range(streams)]
    for r in reqs:
        core.add_request(r)
    toks = {r.request_id: [] for r in reqs}
    clock.seconds, clock.cpu, clock.calls = 0.0, 0.0, 0
    mask_batch.STATS.reset()
    steps = []
    t0 = time.perf_counter()
    while core.has_work():
        t = time.perf_counter()
        outs = core.step()
        dt = time.perf_counter() - t
        if len(core.last_step_chunks) == streams and all(n == 1 for _, _, n in core.last_step_chunks):
            steps.append(dt)
        for o in outs:
            toks[o.request_id] += o.new_token_ids
    wall = time.perf_counter() - t0
    n = clock.calls  # one mask per constrained token sampled
    st = mask_batch.STATS
    fill = st.worker_seconds / st.rows if st.rows else clock.seconds / max(n, 1)
    fill_cpu = st.worker_cpu_seconds / st.rows if st.rows else clock.cpu / max(n, 1)
    return [toks[r.request_id] for r in reqs], {
        "tokens": sum(len(t) for t in toks.values()),
        "engine_us_per_token": round(clock.seconds / max(n, 1) * 1e6, 1),
        "engine_cpu_us_per_token": round(clock.cpu / max(n, 1) * 1e6, 1),
        "fill_us_per_token": round(fill * 1e6, 1),
        "fill_cpu_us_per_token": round(fill_cpu * 1e6, 1),
        "wait_us_per_token": round(st.wait_seconds / max(n, 1) * 1e6, 1),
        "step_ms": round(statistics.median(steps) * 1e3, 2) if steps else None,
        "tok_s": round(sum(len(t) for t in toks.values()) / wall, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", default="serial,batch,overlap")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()

    from kvserve.config import EngineConfig
    from kvserve.engine.core import EngineCore
    from kvserve.models.build import load_files
    from kvserve.store import resolve_model
    from kvserve.structured.backend import GrammarBackend
    from kvserve.structured.spec import schema_spec

    streams = [int(s) for s in a.streams.split(",")]
    modes = a.modes.split(",")
    loaded = load_files(resolve_model(a.model, pull_missing=True))
    core = EngineCore(loaded, EngineConfig(n_ctx=512 * max(streams), n_parallel=max(streams), kv_unified=True,
                                           threads=a.threads, cache_ram=0))
    backend = GrammarBackend(core.tokenizer, core.model_config.n_vocab)
    spec = schema_spec(SCHEMA, "json_schema")
    prompt = core.tokenizer.encode(PROMPT, add_special=True)
    clock = _Clock()
    from kvserve.structured import batch as mask_batch

    mask_batch.STATS.cpu_clock = True
    _run(core, backend, spec, prompt, 2, 8, a.temperature, "warm", clock)  # xgrammar, the compile, the cache
    result = {}
    identical = True
    for n in streams:
        rounds, first = [], {}
        for i in range(a.runs):
            order = modes if i % 2 == 0 else modes[::-1]
            rnd = {}
            for m in order:
                core.grammar_batch, core.grammar_overlap = MODES[m]
                toks, r = _run(core, backend, spec, prompt, n, a.n_predict, a.temperature, f"{m}{n}-{i}", clock)
                first.setdefault(m, toks)
                identical &= toks == first[modes[0]] if modes[0] in first else True
                rnd[m] = r
            rounds.append(rnd)
        med = {m: {k: statistics.median(r[m][k] for r in rounds if r[m][k] is not None)
                   for k in ("engine_us_per_token", "engine_cpu_us_per_token", "fill_us_per_token",
                             "fill_cpu_us_per_token", "wait_us_per_token", "step_ms", "tok_s")
                   if any(r[m][k] is not None for r in rounds)} for m in modes}
        result[str(n)] = {"median": med, "rounds": rounds}
    core.grammar_batch = core.grammar_overlap = True
    print(json.dumps({
        "benchmark": "grammar_batch",
        "model": a.model,
        "machine": platform.processor() or platform.machine(),
        "threads": core.threads,
        "n_predict": a.n_predict,
        "temperature": a.temperature,
        "runs": a.runs,
        "schema": SCHEMA,
        "streams": result,
        "identical": identical,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }, indent=2))


if __name__ == "__main__":
    main()
