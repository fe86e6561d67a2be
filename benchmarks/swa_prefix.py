"""Prefix reuse on a sliding-window model: an 8,000-token prompt resent with 20 new tokens.

    python benchmarks/swa_prefix.py [--family gemma3|gpt-oss] [--prompt 8000] [--tail 20] [--window 1024]
        [--rounds 2]

Builds two random-weight models of the same size with transformers (tests/family_models.py): a
sliding-window one and a llama-shaped one (every layer global), and runs each in kvserve's engine in
this process (no HTTP). The sliding-window model is ``--family``: gemma3 (5 sliding-window layers to
1 global, window ``--window``) or gpt-oss (sliding-window and global layers alternating, window
``--window``: 128 in the released models; attention sinks; ``--experts`` experts of ``--ff`` each,
``--experts-used`` of them per token, so its FFN does that many times the llama's work). For each:
the prompt is computed once (cold), then resent with ``--tail`` new tokens; the resend's
``cache_n`` (tokens reused) and its time to first token (add_request to the first sampled token,
in-engine) are measured. Rounds alternate the two models so machine load hits both alike. Also
reported: KV blocks the sequence held per layer group at the end of the resend (from the engine's
KV cache manager) and the pool's KV bytes. Prints one JSON object.

Issue #30 Build 3's goal: gemma3's resend ``cache_n`` >= prompt - 10 and its TTFT within 1.2x of
llama's (``ttft_ratio_gemma3_over_llama``; ``ttft_ratio_gpt-oss_over_llama`` for gpt-oss).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's kvserve and the tests' model builder

import family_models as fmod  # noqa: E402
from kvserve.config import EngineConfig  # noqa: E402
from kvserve.engine.core import EngineCore  # noqa: E402
from kvserve.engine.request import Request, SamplingParams  # noqa: E402
from kvserve.models.build import load_files  # noqa: E402


def build_models(root: Path, args) -> dict[str, str]:
    """HF directories of the two shapes (same widths, layers, heads): ``args.family`` and llama."""
    common = dict(hidden_size=args.embd, intermediate_size=args.ff, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  head_dim=args.embd // args.heads, max_position_embeddings=args.ctx)
    if args.family == "gpt-oss":  # YaRN as the released config (factor 32 over 4,096), no rounding
        swa = fmod.build("gpt_oss", seed=1, sliding_window=args.window, num_local_experts=args.experts,
                         num_experts_per_tok=args.experts_used,
                         rope_parameters={"rope_type": "yarn", "factor": 32.0, "rope_theta": 150000.0,
                                          "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                          "beta_slow": 1.0, "truncate": False}, **common)
    else:
        swa = fmod.build("gemma3_text", seed=1, sliding_window=args.window,
                         query_pre_attn_scalar=args.embd // args.heads, **common)
    llama = fmod.build("llama", seed=1, tie_word_embeddings=True, **common)
    return {args.family: str(fmod.save_hf(swa, root / args.family)), "llama": str(fmod.save_hf(llama, root / "llama"))}


def run(core: EngineCore, rid: str, ids: list[int]) -> tuple[float, int, dict]:
    """(seconds to the first sampled token, cache_n, KV blocks held then) of one request of 2
    generated tokens (the second keeps the sequence alive while its blocks are counted)."""
    t0 = time.perf_counter()
    core.add_request(Request(rid, ids, SamplingParams(n_predict=2, temperature=0.0, ignore_eos=True)))
    while True:
        for out in core.step():
            if out.request_id == rid and out.new_token_ids:
                ttft = time.perf_counter() - t0
                held = held_blocks(core, rid)
                while core.has_work():
                    core.step()
                return ttft, out.num_cached_tokens, held


def held_blocks(core: EngineCore, rid: str) -> dict:
    """Blocks the request's sequence holds now, per layer group (KV spec) when the manager has groups."""
    kv = core.kv
    if hasattr(kv, "group_tables"):
        return {name: sum(1 for b in t if b) for name, t in kv.group_tables(rid).items()}
    return {"all layers": len(kv.block_table(rid))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=("gemma3", "gpt-oss"), default="gemma3")
    ap.add_argument("--experts", type=int, default=8, help="gpt-oss: experts per layer")
    ap.add_argument("--experts-used", type=int, default=4, help="gpt-oss: experts per token (the released: 4)")
    ap.add_argument("--prompt", type=int, default=8000)
    ap.add_argument("--tail", type=int, default=20)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--ff", type=int, default=768)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_models(Path(tmp), args)
        cores = {name: EngineCore(load_files(p), EngineConfig(n_ctx=args.ctx, n_parallel=1, dtype="float32"))
                 for name, p in paths.items()}
        res: dict[str, dict] = {n: {"ttft_ms": [], "cold_ms": [], "cache_n": []} for n in cores}
        for r in range(args.rounds):
            prompt = [rng.randrange(3, fmod.N_VOCAB) for _ in range(args.prompt)]
            resend = prompt + [rng.randrange(3, fmod.N_VOCAB) for _ in range(args.tail)]
            for name, core in cores.items():  # interleaved: the window model, llama, the window model, llama
                cold, _, _ = run(core, f"c{r}", prompt)
                t, n, held = run(core, f"w{r}", resend)
                res[name]["kv_blocks_held"] = held
                res[name]["cold_ms"].append(round(cold * 1e3, 1))
                res[name]["ttft_ms"].append(round(t * 1e3, 1))
                res[name]["cache_n"].append(n)
        out = {"family": args.family, "prompt": args.prompt, "tail": args.tail, "window": args.window,
               "layers": args.layers, "embd": args.embd}
        for name, core in cores.items():
            d = res[name]
            d["ttft_ms_median"] = statistics.median(d["ttft_ms"])
            d["kv_pool_mib"] = round(core.runner.kv_bytes / 2**20, 1)  # the host tier included (torch.empty)
            lay = getattr(core, "kv_layout", None)
            if lay is not None:  # the pool for running sequences, and the resend's own KV at its first token
                d["kv_active_mib"] = round(lay.kv_bytes(core.pool.active_blocks, core.n_slots) / 2**20, 1)
                held = d["kv_blocks_held"]
                per = [lay.block_bytes, *lay.window_block_bytes]
                d["kv_held_mib"] = round(sum(n * b for n, b in zip(held.values(), per)) / 2**20, 2)
                d["kv_held_all_layers_mib"] = round(held["full"] * lay.all_block_bytes / 2**20, 2)
            out[name] = d
        f = args.family
        out[f"ttft_ratio_{f}_over_llama"] = round(out[f]["ttft_ms_median"] / out["llama"]["ttft_ms_median"], 3)
        print(json.dumps(out))


if __name__ == "__main__":
    main()
