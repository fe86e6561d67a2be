"""CPU cost of the grammar warm-up a server runs beside its first requests (issue #29: a first request as
fast as the tenth).

    python benchmarks/grammar_warmup.py [--model /tmp/bf/l1b-Q4_K_M.gguf] [--rounds 3] [--checkout DIR ...]

For each round and checkout (alternating), a fresh interpreter with that checkout first on PYTHONPATH
imports what ``kvserve serve`` has imported when its warm-up thread starts (torch, tokenizers,
kvserve.serving.chat_runner), reads the model's tokenizer, and times ``GrammarBackend._get_compiler()``
(what ``chat_runner._warm_grammars`` does: import xgrammar, build the TokenizerInfo and the compiler):
``cpu_s`` (that thread's CPU seconds: robust to the machine's load), ``wall_s``, and whether
``transformers`` got imported. Prints one JSON object: per checkout, the runs and medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = r'''
import json, sys, time
import torch, tokenizers  # noqa: F401 - imported by the server before the warm-up
import kvserve.serving.chat_runner  # noqa: F401
from kvserve.loaders.tokenizer import Tokenizer
from kvserve.structured.backend import GrammarBackend
tok = Tokenizer.from_gguf_file(sys.argv[1])
be = GrammarBackend(tok, tok.n_vocab)
c, w = time.thread_time(), time.perf_counter()
be._get_compiler()
print(json.dumps({"cpu_s": round(time.thread_time() - c, 3), "wall_s": round(time.perf_counter() - w, 3),
                  "transformers": "transformers" in sys.modules}))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/tmp/bf/l1b-Q4_K_M.gguf", help="a GGUF file (its tokenizer is read)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--checkout", action="append", default=None,
                    help="a kvserve checkout to time (repeat to compare; default: this one)")
    a = ap.parse_args()
    checkouts = a.checkout or [str(Path(__file__).resolve().parents[1])]
    runs: dict[str, list[dict]] = {c: [] for c in checkouts}
    for rnd in range(a.rounds):
        for c in (checkouts if rnd % 2 == 0 else checkouts[::-1]):
            out = subprocess.run([sys.executable, "-c", _CHILD, a.model], capture_output=True, text=True,
                                 timeout=300, env={**os.environ, "PYTHONPATH": c}, cwd="/tmp")
            if out.returncode != 0:
                raise RuntimeError(f"{c}: {out.stderr[-2000:]}")
            runs[c].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(json.dumps({"model": a.model, "rounds": a.rounds, "checkouts": {
        c: {"runs": r, "cpu_s_median": statistics.median(x["cpu_s"] for x in r),
            "wall_s_median": statistics.median(x["wall_s"] for x in r)} for c, r in runs.items()}}, indent=1))


if __name__ == "__main__":
    main()
