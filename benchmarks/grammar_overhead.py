"""Decode speed with and without a JSON-schema constraint, in the engine (no server).

    python benchmarks/grammar_overhead.py [--model smollm2] [--n-predict 64] [--runs 5] [--batch 1]

The same prompt is generated ``--runs`` times unconstrained and ``--runs`` times under a
schema that allows long output (an array of at least 8 strings), alternating so machine
load hits both alike. Decode speed is tokens after the first divided by the time after
the first token (``timings.predicted_*``), so runs of different lengths compare fairly.
Prints one JSON object: medians of both, the slowdown ratio, and the time spent in the
constraint's ``mask()``/``accept_token()`` per token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kvserve, not the venv's

from kvserve.config import EngineConfig
from kvserve.engine.core import create_engine_core
from kvserve.engine.request import Request, SamplingParams
from kvserve.structured.backend import GrammarBackend
from kvserve.structured.spec import schema_spec

SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 8}
PROMPT = "List the names of the files in a small Java project as a JSON array of strings:"


class _Timed:
    """Wraps a constraint and adds up the seconds spent in it (same hook protocol)."""

    def __init__(self, inner):
        self.inner = inner
        self.seconds = 0.0
        self.calls = 0

    def mask(self):
        t = time.perf_counter()
        m = self.inner.mask()
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return m

    def accept_token(self, token_id: int) -> bool:
        t = time.perf_counter()
        ok = self.inner.accept_token(token_id)
        self.seconds += time.perf_counter() - t
        return ok

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()


def run(core, backend, spec, params, batch: int, tag: str) -> tuple[float, int, float]:
    """One batch; returns (decode tokens/s per sequence, tokens generated, constraint us per token)."""
    ids = core.tokenizer.encode(PROMPT, add_special=True)
    reqs = []
    for i in range(batch):
        g = _Timed(backend.constraint(spec)) if spec is not None else None
        reqs.append(Request(f"{tag}-{i}", ids, params, grammar=g))
        core.add_request(reqs[-1])
    last = {}
    while len(last) < batch:
        for out in core.step():
            if out.finished:
                last[out.request_id] = out
    rates, n_tok, gsec, gcalls = [], 0, 0.0, 0
    for r in reqs:
        t = last[r.request_id].timings
        n_tok += t.predicted_n
        if t.predicted_n > 1 and t.predicted_ms > 0:
            rates.append((t.predicted_n - 1) / (t.predicted_ms / 1e3))
        if r.grammar is not None:
            gsec += r.grammar.seconds
            gcalls += r.grammar.calls
    return statistics.mean(rates), n_tok, (gsec / gcalls * 1e6) if gcalls else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.8)
    args = ap.parse_args()

    core = create_engine_core(args.model, EngineConfig(n_ctx=4096, n_parallel=max(args.batch, 1), kv_unified=True))
    backend = GrammarBackend(core.tokenizer, core.model_config.n_vocab)
    spec = schema_spec(SCHEMA, "json_schema")
    params = SamplingParams(n_predict=args.n_predict, temperature=args.temperature, seed=42)
    run(core, backend, spec, params, args.batch, "warm-g")  # loads xgrammar, compiles, warms the model
    run(core, backend, None, params, args.batch, "warm-f")
    free, cons, gus, n_free, n_cons = [], [], [], [], []
    for k in range(args.runs):
        rate, n, _ = run(core, backend, None, params, args.batch, f"f{k}")
        free.append(rate)
        n_free.append(n)
        rate, n, us = run(core, backend, spec, params, args.batch, f"g{k}")
        cons.append(rate)
        n_cons.append(n)
        gus.append(us)
    f, c = statistics.median(free), statistics.median(cons)
    print(json.dumps({
        "model": args.model,
        "batch": args.batch,
        "n_predict": args.n_predict,
        "temperature": args.temperature,
        "runs": args.runs,
        "threads": core.threads,
        "schema": SCHEMA,
        "tokens_per_run_unconstrained": statistics.median(n_free),
        "tokens_per_run_constrained": statistics.median(n_cons),
        "decode_tok_s_unconstrained": round(f, 2),
        "decode_tok_s_constrained": round(c, 2),
        "slowdown": round(f / c - 1.0, 4),
        "constraint_us_per_token": round(statistics.median(gus), 1),
    }))


if __name__ == "__main__":
    main()
