"""The small random llama model of the llama.cpp numerics fixtures (tests/reference/llama_numerics).

One deterministic float32 model (numpy's PCG64, seed :data:`SEED`), llama-shaped with every row a
multiple of 256 values so every GGUF type applies, K-quants included, and ffn_down's rows two
superblocks long: n_embd 256, n_ff 512, 2 layers, 4 query heads of 64, 2 KV heads, an untied output
head, tests/tinymodel.py's byte-level BPE vocabulary (301 tokens). The scales give peaked, varied
next-token distributions (not near-uniform logits; llama.cpp's top-1 probability averages about
0.57): embeddings N(0, 1), the head N(0, 0.3^2), norms 1 + N(0, 0.1^2), q and k N(0, 1/n_in), the
other projections N(0, 0.25/n_in), so each layer changes the residual stream by about half its size,
as trained models' layers change it a little. With unit-gain layers (0.5 -> 1) the model is chaotic:
llama.cpp's int8 rounding of every matrix product's input turns a 0.001 difference in attention
(its float16 KV cache) into 0.05 mean |d logprob| at the output, and near ties flip top-1 on
1-2% of positions whatever the implementation; at 0.5 that is about 0.014.

:func:`write_gguf` writes it as F32, or converted by the ``gguf`` package to a type that package
writes exactly as ``llama-quantize --pure`` does (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4:
regen.py checks the bytes, and the fixture records each tensor's SHA-256, so the tests rebuild these
files instead of storing them). The other types (K-quants, IQ4_NL, IQ4_XS, the Q4_K_M / Q5_K_M mixes)
only llama-quantize writes; their files are stored beside the fixtures.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

import tinymodel

SEED = 29
SHAPE = dict(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, ctx=1024)
#: types the ``gguf`` package quantizes byte for byte as llama-quantize does (checked by regen.py)
REBUILT = ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4")
_FILE_TYPE = {"F32": 0, "F16": 1, "BF16": 32, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q8_0": 7,
              "MXFP4": 38}


def weights() -> list[tuple[str, np.ndarray]]:
    """(GGUF tensor name, float32 array in torch layout [out, in]) in file order."""
    s = SHAPE
    rng = np.random.default_rng(SEED)
    n_vocab = len(tinymodel.tiny_vocab()[0])
    e, f, hd = s["n_embd"], s["n_ff"], s["n_embd"] // s["n_head"]

    def normal(shape, std, mean=0.0):
        return (mean + std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)

    out = [("token_embd.weight", normal((n_vocab, e), 1.0))]
    for i in range(s["n_layer"]):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", normal((e,), 0.1, 1.0)),
                (p + "attn_q.weight", normal((s["n_head"] * hd, e), 1 / e ** 0.5)),
                (p + "attn_k.weight", normal((s["n_head_kv"] * hd, e), 1 / e ** 0.5)),
                (p + "attn_v.weight", normal((s["n_head_kv"] * hd, e), 0.5 / e ** 0.5)),
                (p + "attn_output.weight", normal((e, s["n_head"] * hd), 0.5 / e ** 0.5)),
                (p + "ffn_norm.weight", normal((e,), 0.1, 1.0)),
                (p + "ffn_gate.weight", normal((f, e), 0.5 / e ** 0.5)),
                (p + "ffn_up.weight", normal((f, e), 0.5 / e ** 0.5)),
                (p + "ffn_down.weight", normal((e, f), 0.5 / f ** 0.5))]
    out += [("output_norm.weight", normal((e,), 0.1, 1.0)), ("output.weight", normal((n_vocab, e), 0.3))]
    return out


def write_gguf(path: str | Path, qtype: str = "F32") -> Path:
    """Write the model with every 2-D tensor in ``qtype`` (F32 or one of :data:`REBUILT`); norms F32.

    Raises ValueError for another type."""
    import gguf
    from gguf import quants

    if qtype != "F32" and qtype not in REBUILT:
        raise ValueError(f"{qtype} is written by llama-quantize only (see tests/reference/llama_numerics)")
    s = SHAPE
    tokens, types, merges = tinymodel.tiny_vocab()
    path = Path(path)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("kvserve llama.cpp numerics model")
    w.add_block_count(s["n_layer"])
    w.add_context_length(s["ctx"])
    w.add_embedding_length(s["n_embd"])
    w.add_feed_forward_length(s["n_ff"])
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_head_kv"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(_FILE_TYPE[qtype])
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(s["n_embd"] // s["n_head"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(tinymodel.CHATML_TEMPLATE)
    for name, a in weights():
        if a.ndim == 1 or qtype == "F32":
            w.add_tensor(name, a)
        elif qtype == "F16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            t = gguf.GGMLQuantizationType[qtype]
            data = quants.quantize(a, t)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tensor_digests(path: str | Path) -> dict[str, str]:
    """{tensor name: "TYPE sha256-of-its-bytes"} of a GGUF file (what the fixtures record)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    return {t.name: f"{t.tensor_type.name} {hashlib.sha256(np.ascontiguousarray(t.data).tobytes()).hexdigest()}"
            for t in r.tensors}
