"""Per-chunk cost of the OpenAI face's chat stream, in process, without an engine.

The engine's outputs are made up front (one token of text each) and handed to the face by a fake
``run_choices``; the face builds every chunk (``stream_events``: the wire types and ``.wire()``; the JSON text,
written by the SSE writer and paid the same either way, is left out). Printed: CPU µs per chunk (this process's CPU time, the best of ``--repeat`` runs), for plain text
and for a reasoning split (``--reasoning-format deepseek``: the text goes through ChoiceOutput).

    python benchmarks/face_chunk_cost.py                      # this checkout
    python benchmarks/face_chunk_cost.py --compare /work/main # this checkout and another, A B A B

``--compare`` runs this script on both checkouts in turn (separate processes, ``PYTHONPATH`` set
to each) for ``--rounds`` rounds and prints each run's figures and the ratios of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace


def _outputs(n: int, think: bool) -> list:
    from kvserve.engine.request import RequestOutput

    texts = ["<think>"] + [" a"] * (n // 2) + ["</think>"] + [" b"] * (n // 2) if think else [" word"] * n
    outs = [RequestOutput("r", [7], t, num_prompt_tokens=5, num_output_tokens=k + 1) for k, t in enumerate(texts)]
    last = outs[-1]
    outs[-1] = RequestOutput("r", [7], last.text, finished=True, stop_type="eos", num_prompt_tokens=5,
                             num_output_tokens=len(texts))
    return outs


def _patch(outs: list) -> None:
    """Hand ``outs`` to the face: both where the face calls ``run_choices`` directly (before) and
    where ``chat_events`` does (after)."""
    import kvserve.faces.openai as face
    import kvserve.serving.choices as choices

    async def fake(runner, plan, view=None):
        for out in outs:
            yield 0, out

    choices.run_choices = fake
    if hasattr(face, "run_choices"):
        face.run_choices = fake


def _plan(think: bool):
    from kvserve.serving.chat_output import OutputMode
    from kvserve.serving.chat_plan import Plan

    req = SimpleNamespace(return_progress=False, prompt_token_ids=[1, 2, 3, 4, 5])
    mode = OutputMode(reasoning_style="deepseek") if think else OutputMode()
    return Plan(kind="chat", response_id="chatcmpl-x", created=1, model="m", requests=[req], stream=True,
                include_usage=True, mode=mode)


def _run_once(plan, n_chunks: int) -> float:
    from kvserve.faces.openai import stream_events

    runner = SimpleNamespace(build_info="b1", args=SimpleNamespace(reasoning_parser=None))

    async def consume() -> int:
        k = 0
        async for _ev in stream_events(runner, plan):
            k += 1
        return k

    t0 = time.process_time()  # CPU time: the machine is shared, waiting for a core is not the face's cost
    k = asyncio.run(consume())
    dt = time.process_time() - t0
    assert k >= n_chunks, k
    return dt / k * 1e6


def measure(n: int, repeat: int) -> dict:
    """µs per chunk, best of ``repeat``, for plain text and a reasoning split."""
    res = {}
    for name, think in (("plain", False), ("reasoning", True)):
        outs = _outputs(n, think)
        _patch(outs)
        plan = _plan(think)
        res[name] = round(min(_run_once(plan, n) for _ in range(repeat)), 3)
    return res


def compare(other: str, rounds: int, n: int, repeat: int) -> dict:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs: dict[str, list[dict]] = {"this": [], "other": []}
    for _ in range(rounds):
        for key, repo in (("this", here), ("other", other)):
            env = {**os.environ, "PYTHONPATH": repo}
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--n", str(n), "--repeat", str(repeat)],
                                 cwd=repo, env=env, capture_output=True, text=True, check=True).stdout
            runs[key].append(json.loads(out))
    med = {k: {c: statistics.median(r[c] for r in v) for c in ("plain", "reasoning")} for k, v in runs.items()}
    ratio = {c: round(med["this"][c] / med["other"][c], 4) for c in ("plain", "reasoning")}
    return {"this": here, "other": other, "runs": runs, "median_us_per_chunk": med, "ratio_this_over_other": ratio}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="chunks (engine outputs) per stream")
    ap.add_argument("--repeat", type=int, default=7, help="streams per figure (the best is kept)")
    ap.add_argument("--compare", metavar="REPO", help="another checkout to compare with, alternating")
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    if a.compare:
        print(json.dumps(compare(a.compare, a.rounds, a.n, a.repeat), indent=1))
    else:
        print(json.dumps(measure(a.n, a.repeat)))


if __name__ == "__main__":
    main()
