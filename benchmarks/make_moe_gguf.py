"""Write a random-weight qwen3moe GGUF of Qwen3-30B-A3B's shape, shrunk to fit a small machine (issue #30 Build 4).

Qwen3-30B-A3B (its config.json): 48 layers, hidden 2048, 32 q heads / 4 KV heads of 128, 128 experts of
width 768, 8 used per token, vocab 151,936. The shape here keeps what makes the MoE step what it is (128
experts, top 8, head_dim 128, the ratio of attention to active-expert weights) and shrinks the rest:
``--layers`` (default 12), hidden 1024, 16 q heads / 2 KV heads, experts of width 512 (a multiple of 256,
so llama-quantize keeps Q4_K/Q6_K on every expert tensor), SmolLM2's tokenizer (49,152 pieces: the
benchmark's prompts are ids of that vocabulary). Weights random normal (std 0.02; norms 1.0), F16,
llama.cpp's tensor and metadata names, written tensor by tensor. Then quantize with llama-quantize::

    python benchmarks/make_moe_gguf.py -o /tmp/q3moe-f16.gguf
    llama-quantize /tmp/q3moe-f16.gguf /tmp/q3moe-Q4_K_M.gguf Q4_K_M
    python benchmarks/vs_llama_server.py --llama-server BIN --model /tmp/q3moe-Q4_K_M.gguf \\
        --rounds 1 --parallel 1 --ctx 4096 --skip-agent --skip-ttft

Prints one JSON object: the path, the shape, the tensor count and the file's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_shaped_gguf import _tokenizer_kv, write_random_tensors  # noqa: E402

#: Qwen3-30B-A3B with widths shrunk (see the module docstring); "n_layer" is --layers
SHAPE = dict(n_embd=1024, n_head=16, n_head_kv=2, head_dim=128, n_expert=128, n_expert_used=8, n_ff_expert=512,
             rope_theta=1000000.0, n_ctx=40960, eps=1e-6)


def tensors(s: dict, n_layer: int, n_vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, torch shape) of every tensor in file order (qwen3moe's names; untied output)."""
    e, hd, E, ff = s["n_embd"], s["head_dim"], s["n_expert"], s["n_ff_expert"]
    t = [("token_embd.weight", (n_vocab, e))]
    for i in range(n_layer):
        p = f"blk.{i}."
        t += [(p + "attn_norm.weight", (e,)), (p + "attn_q.weight", (s["n_head"] * hd, e)),
              (p + "attn_k.weight", (s["n_head_kv"] * hd, e)), (p + "attn_v.weight", (s["n_head_kv"] * hd, e)),
              (p + "attn_q_norm.weight", (hd,)), (p + "attn_k_norm.weight", (hd,)),
              (p + "attn_output.weight", (e, s["n_head"] * hd)), (p + "ffn_norm.weight", (e,)),
              (p + "ffn_gate_inp.weight", (E, e)), (p + "ffn_gate_exps.weight", (E, ff, e)),
              (p + "ffn_up_exps.weight", (E, ff, e)), (p + "ffn_down_exps.weight", (E, e, ff))]
    return t + [("output_norm.weight", (e,)), ("output.weight", (n_vocab, e))]


def write(out: str, tokenizer_src: str, n_layer: int, seed: int = 0) -> dict:
    """Write the file; returns the JSON summary."""
    import gguf

    s = SHAPE
    tok = _tokenizer_kv(tokenizer_src)
    n_vocab = len(next(v for k, v, *_ in tok if k == "tokenizer.ggml.tokens"))
    w = gguf.GGUFWriter(out, "qwen3moe")
    w.add_name("random qwen3-30b-a3b (shrunk)")
    w.add_block_count(n_layer)
    w.add_context_length(s["n_ctx"])
    w.add_embedding_length(s["n_embd"])
    w.add_feed_forward_length(6144)  # Qwen3-30B-A3B's intermediate_size (no dense layer uses it)
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_head_kv"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_dimension_count(s["head_dim"])
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_expert_count(s["n_expert"])
    w.add_expert_used_count(s["n_expert_used"])
    w.add_expert_feed_forward_length(s["n_ff_expert"])
    w.add_file_type(1)  # F16
    w.add_vocab_size(n_vocab)
    for key, val, vtype, sub in tok:
        w.add_key_value(key, val, vtype, sub_type=sub)
    ts = tensors(s, n_layer, n_vocab)
    write_random_tensors(w, ts, seed, keep_f32=lambda name: name.endswith("ffn_gate_inp.weight"))
    return {"path": out, "shape": {**s, "n_layer": n_layer, "n_vocab": n_vocab}, "n_tensors": len(ts),
            "bytes": os.path.getsize(out)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--tokenizer-from", default=None,
                    help="GGUF whose tokenizer to copy (default: smollm2 from kvserve's store)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    src = a.tokenizer_from
    if src is None:
        from kvserve.store import resolve_model

        src = resolve_model("smollm2", pull_missing=False)
    t0 = time.perf_counter()
    res = write(a.output, str(src), a.layers, a.seed)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    json.dump(res, sys.stdout)
    print()


if __name__ == "__main__":
    main()
