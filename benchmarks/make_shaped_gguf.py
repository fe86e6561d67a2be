"""Write a random-weight GGUF of a real model's shape, for benchmarks at realistic sizes.

The weights are random (normal, std 0.02; norms 1.0) in F16, written tensor by tensor so an 8B file
never sits in memory; the tokenizer, chat template and special tokens are SmolLM2-135M-Instruct's
(49,152 pieces), copied from the GGUF in kvserve's store, as the figures in issue 29 were taken.
Quantize the result with llama.cpp's ``llama-quantize`` (``benchmarks/build_llama_server.sh``
builds it beside llama-server)::

    python benchmarks/make_shaped_gguf.py --shape llama-3.2-1b -o /tmp/l1b-f16.gguf
    llama-quantize /tmp/l1b-f16.gguf /tmp/l1b-q4km.gguf Q4_K_M

Prints one JSON object: the path, the shape, the tensor count and the file's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

#: the shapes of real checkpoints (config.json of each); vocab is SmolLM2's tokenizer's
SHAPES = {
    "llama-3.2-1b": dict(n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, n_ff=8192, head_dim=64,
                         rope_theta=500000.0, n_ctx=131072, tied=True),
    "llama-3.2-3b": dict(n_layer=28, n_embd=3072, n_head=24, n_head_kv=8, n_ff=8192, head_dim=128,
                         rope_theta=500000.0, n_ctx=131072, tied=True),
    "llama-3.1-8b": dict(n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, head_dim=128,
                         rope_theta=500000.0, n_ctx=131072, tied=False),
}


def _tokenizer_kv(src: str) -> list[tuple[str, object, object]]:
    """(key, value, GGUFValueType) of every tokenizer.* entry of ``src`` (a GGUF file)."""
    import gguf

    reader = gguf.GGUFReader(src)
    out = []
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[1]
            if sub == gguf.GGUFValueType.STRING:
                val = [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
            else:
                val = [field.parts[i].tolist()[0] for i in field.data]
            out.append((field.name, val, vtype, sub))
        elif vtype == gguf.GGUFValueType.STRING:
            out.append((field.name, bytes(field.parts[field.data[0]]).decode("utf-8"), vtype, None))
        else:
            out.append((field.name, field.parts[field.data[0]].tolist()[0], vtype, None))
    return out


def _tensors(s: dict, n_vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, torch shape [out, in]) of every tensor, in file order."""
    e, hd = s["n_embd"], s["head_dim"]
    t = [("token_embd.weight", (n_vocab, e))]
    for i in range(s["n_layer"]):
        p = f"blk.{i}."
        t += [(p + "attn_norm.weight", (e,)), (p + "attn_q.weight", (s["n_head"] * hd, e)),
              (p + "attn_k.weight", (s["n_head_kv"] * hd, e)), (p + "attn_v.weight", (s["n_head_kv"] * hd, e)),
              (p + "attn_output.weight", (e, s["n_head"] * hd)), (p + "ffn_norm.weight", (e,)),
              (p + "ffn_gate.weight", (s["n_ff"], e)), (p + "ffn_up.weight", (s["n_ff"], e)),
              (p + "ffn_down.weight", (e, s["n_ff"]))]
    t.append(("output_norm.weight", (e,)))
    if not s["tied"]:
        t.append(("output.weight", (n_vocab, e)))
    return t


def write_random_tensors(w, tensors: list[tuple[str, tuple[int, ...]]], seed: int,
                         keep_f32=lambda name: False) -> None:
    """Write the header, the metadata and ``tensors`` (name, torch shape) to the GGUFWriter ``w``,
    one tensor at a time (a 16 GB file never sits in memory), and close it: 1-D tensors ones in
    float32, matrices N(0, 0.02) in float16 (float32 where ``keep_f32(name)``), drawn from ``seed``."""
    def dtype(name, shp):
        return np.float32 if len(shp) == 1 or keep_f32(name) else np.float16

    for name, shp in tensors:
        dt = np.dtype(dtype(name, shp))
        w.add_tensor_info(name, shp, dt, int(np.prod(shp)) * dt.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shp in tensors:
        if len(shp) == 1:
            w.write_tensor_data(np.ones(shp, dtype=np.float32))
            continue
        a = rng.standard_normal(shp, dtype=np.float32)
        a *= 0.02
        w.write_tensor_data(a if dtype(name, shp) is np.float32 else a.astype(np.float16))
        del a
    w.close()


def write(shape: str, out: str, tokenizer_src: str, seed: int = 0) -> dict:
    """Write the file; returns the JSON summary."""
    import gguf

    s = SHAPES[shape]
    tok = _tokenizer_kv(tokenizer_src)
    n_vocab = len(next(v for k, v, *_ in tok if k == "tokenizer.ggml.tokens"))
    w = gguf.GGUFWriter(out, "llama")
    w.add_name(f"random {shape}")
    w.add_block_count(s["n_layer"])
    w.add_context_length(s["n_ctx"])
    w.add_embedding_length(s["n_embd"])
    w.add_feed_forward_length(s["n_ff"])
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_head_kv"])
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(1)  # F16
    w.add_vocab_size(n_vocab)
    w.add_rope_dimension_count(s["head_dim"])
    for key, val, vtype, sub in tok:
        w.add_key_value(key, val, vtype, sub_type=sub)
    tensors = _tensors(s, n_vocab)
    write_random_tensors(w, tensors, seed)
    return {"path": out, "shape": shape, "n_tensors": len(tensors), "bytes": os.path.getsize(out)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--tokenizer-from", default=None,
                    help="GGUF whose tokenizer to copy (default: smollm2 from kvserve's store)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    src = a.tokenizer_from
    if src is None:
        from kvserve.store import resolve_model

        src = resolve_model("smollm2", pull_missing=True)
    t0 = time.perf_counter()
    res = write(a.shape, a.output, str(src), a.seed)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    json.dump(res, sys.stdout)
    print()


if __name__ == "__main__":
    main()
