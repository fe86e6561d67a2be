"""Tiny random-weight test models, written as a GGUF file and as an HF directory.

Fast unit tests need a real model file without downloading anything. This
module writes one in two formats from one set of weights:

* :func:`write_tiny_gguf` writes a GGUF file with ``gguf.GGUFWriter`` using
  llama.cpp's key and tensor names (``llama.block_count``, ``blk.0.attn_q.weight``...).
* :func:`write_tiny_hf_dir` writes a Hugging Face model directory
  (``config.json``, ``model.safetensors``, ``tokenizer.json``,
  ``tokenizer_config.json``, ``generation_config.json``).

Called with the same seed and shape arguments, both hold THE SAME MODEL, so a
test can load each and check that they give identical logits:

* The weights are generated once, in HF layout (torch shape ``[out, in]``),
  by :func:`tiny_weights` from ``numpy.random.RandomState(seed)``.
* llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``)
  reorders the rows of the HF ``q_proj``/``k_proj`` weights for the ``llama``
  arch, because GGUF llama uses the "normal" (interleaved pairs) rope layout
  while HF uses the NEOX (rotate-half) layout::

      w.reshape(n_head, 2, head_dim // 2, n_in).swapaxes(1, 2).reshape(w.shape)

  (with ``n_head_kv`` heads for ``k``). :func:`write_tiny_gguf` writes q/k
  permuted like that for arch ``llama``. For ``qwen2`` the GGUF uses the NEOX
  rope layout and llama.cpp does not permute, so neither do we.
* For a quantized ``qtype`` the GGUF holds the quantized blocks; pass the same
  ``qtype`` to :func:`write_tiny_hf_dir` and its float tensors are exactly the
  values those blocks dequantize to (quantization is per row, along the input
  dimension, so it commutes with the q/k row permutation).

GGUF stores a 2-D weight of torch shape ``[out, in]`` with ``ne = [in, out]``;
``gguf.GGUFReader`` reports ``tensor.shape`` as ``[in, out]`` and
``tensor.data.shape`` as ``[out, in]`` (in bytes along the last axis for
quantized types). We pass arrays in torch layout to ``GGUFWriter.add_tensor``.

Quant types: ``F32``, ``F16``, ``BF16``, ``Q8_0``, ``Q4_0``, ``Q4_1``,
``Q5_0``, ``Q5_1`` use ``gguf.quants.quantize``. The gguf package cannot
quantize ``Q4_K`` or ``Q6_K`` (only dequantize), so this module packs those
itself with a simple min/max quantizer (:func:`_quantize_q4_k`,
:func:`_quantize_q6_k`): the blocks are valid and ``gguf.quants.dequantize``
reads them, but the bytes differ from what ``llama-quantize`` would choose.
K-quants need rows that are a multiple of 256 values (``n_embd`` and ``n_ff``
multiples of 256). Norm weights and biases always stay F32.

The tokenizer is a small byte-level BPE ("gpt2" model, ``smollm`` pre-tokenizer:
single digits split, then the GPT-2 regex), the same vocab and merges in both
formats: ``<|endoftext|>`` (0), ``<|im_start|>`` (1), ``<|im_end|>`` (2), the
256 GPT-2 byte characters, then :data:`MERGES` in order. The chat template is
ChatML (:data:`CHATML_TEMPLATE`). Defaults: bos 0, eos 0, eot ``<|im_end|>``
(2), ``add_bos_token`` false; pass ``bos_token_id=1, eos_token_id=2`` to copy
SmolLM2-Instruct's choice.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

__all__ = [
    "CHATML_TEMPLATE",
    "MERGES",
    "QTYPES",
    "SPECIAL_TOKENS",
    "byte_to_unicode",
    "permute_qk",
    "tiny_vocab",
    "tiny_weights",
    "hf_tokenizer",
    "write_tiny_gguf",
    "write_tiny_hf_dir",
]

SPECIAL_TOKENS: list[str] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
"""Special (control) tokens, ids 0, 1, 2."""

#: BPE merges in priority order, over GPT-2 byte-level characters ("Ġ" is a space).
MERGES: list[tuple[str, str]] = [
    ("Ġ", "t"), ("h", "e"), ("Ġ", "a"), ("i", "n"), ("Ġt", "he"), ("e", "r"),
    ("o", "n"), ("Ġ", "s"), ("r", "e"), ("Ġ", "w"), ("a", "n"), ("o", "u"),
    ("Ġ", "o"), ("i", "s"), ("e", "d"), ("i", "t"), ("e", "n"), ("Ġ", "c"),
    ("a", "t"), ("Ġ", "b"), ("o", "r"), ("Ġ", "f"), ("Ġ", "h"), ("Ġ", "i"),
    ("Ġ", "m"), ("n", "g"), ("in", "g"), ("l", "l"), ("e", "s"), ("Ġa", "n"),
    ("Ġan", "d"), ("Ġo", "f"), ("Ġ", "l"), ("Ġ", "d"), ("Ġ", "p"), ("a", "r"),
    ("Ġt", "o"), ("Ġi", "s"), ("Ġi", "n"), ("l", "o"), ("Ċ", "Ċ"), ("Ġ", "Ġ"),
]

CHATML_TEMPLATE: str = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""A small ChatML template (Jinja), the same in the GGUF and the HF directory."""

#: GGUF general.file_type (llama.cpp ``LlamaFileType``) for each supported qtype.
_FILE_TYPE: dict[str, int] = {
    "F32": 0, "F16": 1, "BF16": 32, "Q8_0": 7, "Q4_0": 2, "Q4_1": 3,
    "Q5_0": 8, "Q5_1": 9, "Q4_K": 15, "Q6_K": 18,
}
QTYPES: tuple[str, ...] = tuple(_FILE_TYPE)
"""Every qtype :func:`write_tiny_gguf` can write."""

_HF_ARCH: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_GGUF_ARCH: dict[str, str] = {v: k for k, v in _HF_ARCH.items()}


# --------------------------------------------------------------------------- tokenizer


@functools.lru_cache(maxsize=None)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (256 entries; do not mutate)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """Return ``(tokens, token_types, merges)`` of the tiny byte-level BPE vocab.

    ``token_types`` uses llama.cpp's values (1 normal, 3 control); ``merges``
    are GGUF-style ``"left right"`` strings. Token id = index in ``tokens``.
    """
    table = byte_to_unicode()
    byte_chars = [table[b] for b in range(256)]
    tokens = list(SPECIAL_TOKENS) + byte_chars
    known = set(tokens)
    for left, right in MERGES:
        assert left in known and right in known, (left, right)
        merged = left + right
        assert merged not in known, merged
        tokens.append(merged)
        known.add(merged)
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    return tokens, types, [f"{a} {b}" for a, b in MERGES]


def hf_tokenizer():
    """Build the tiny vocab as a ``tokenizers.Tokenizer`` (what tokenizer.json holds)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, _, _ = tiny_vocab()
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(MERGES), fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


# --------------------------------------------------------------------------- weights


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: HF (NEOX rope) rows -> GGUF llama rows.

    Works on float weights ``[out, in]``, on 1-D biases and on quantized byte
    rows alike, since it only reorders rows.
    """
    head_dim = w.shape[0] // n_head
    return (w.reshape(n_head, 2, head_dim // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def tiny_weights(*, arch: str = "llama", n_layer: int = 2, n_embd: int = 64, n_head: int = 4,
                 n_head_kv: int = 2, n_ff: int = 128, seed: int = 0,
                 tie_embeddings: bool = False, n_vocab: int | None = None) -> dict[str, np.ndarray]:
    """Deterministic float32 weights in HF layout and HF names.

    Linear weights ~ N(0, 0.05), embeddings ~ N(0, 0.1), norms ~ 1 + N(0, 0.1),
    qwen2 q/k/v biases ~ N(0, 0.05). ``arch`` is "llama" or "qwen2" (or the HF
    class names). ``lm_head.weight`` is absent when ``tie_embeddings``.
    """
    arch = _GGUF_ARCH.get(arch, arch)
    if arch not in _HF_ARCH:
        raise ValueError(f"unsupported arch {arch!r}; use one of {sorted(_HF_ARCH)}")
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must divide by n_head and n_head by n_head_kv")
    head_dim = n_embd // n_head
    if head_dim % 2:
        raise ValueError("head_dim must be even")
    n_vocab = n_vocab or len(tiny_vocab()[0])
    rng = np.random.RandomState(seed)

    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> np.ndarray:
        return (mean + std * rng.standard_normal(shape)).astype(np.float32)

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal((n_vocab, n_embd), 0.1)}
    for i in range(n_layer):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = normal((n_embd,), 0.1, 1.0)
        w[p + "self_attn.q_proj.weight"] = normal((n_head * head_dim, n_embd), 0.05)
        w[p + "self_attn.k_proj.weight"] = normal((n_head_kv * head_dim, n_embd), 0.05)
        w[p + "self_attn.v_proj.weight"] = normal((n_head_kv * head_dim, n_embd), 0.05)
        if arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = normal((n_head * head_dim,), 0.05)
            w[p + "self_attn.k_proj.bias"] = normal((n_head_kv * head_dim,), 0.05)
            w[p + "self_attn.v_proj.bias"] = normal((n_head_kv * head_dim,), 0.05)
        w[p + "self_attn.o_proj.weight"] = normal((n_embd, n_head * head_dim), 0.05)
        w[p + "post_attention_layernorm.weight"] = normal((n_embd,), 0.1, 1.0)
        w[p + "mlp.gate_proj.weight"] = normal((n_ff, n_embd), 0.05)
        w[p + "mlp.up_proj.weight"] = normal((n_ff, n_embd), 0.05)
        w[p + "mlp.down_proj.weight"] = normal((n_embd, n_ff), 0.05)
    w["model.norm.weight"] = normal((n_embd,), 0.1, 1.0)
    if not tie_embeddings:
        w["lm_head.weight"] = normal((n_vocab, n_embd), 0.1)
    return w


def _gguf_name(hf_name: str) -> str:
    """Map an HF tensor name to llama.cpp's GGUF name."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    parts = hf_name.split(".")  # model.layers.N.<module...>.<weight|bias>
    layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    table = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    return f"blk.{layer}.{table[module]}.{kind}"


# --------------------------------------------------------------------------- quantization


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """Pack float32 ``[..., n*256]`` rows into Q6_K blocks (210 bytes per 256 values)."""
    shape = rows.shape
    x = rows.reshape(-1, 16, 16).astype(np.float32)  # blocks*16 sub-blocks of 16
    n = x.shape[0]
    amax_idx = np.abs(x).argmax(axis=-1)
    vmax = np.take_along_axis(x, amax_idx[..., None], axis=-1)[..., 0]  # signed max |x|
    scale = vmax / -32.0  # q = -32 at the extreme, like llama.cpp
    max_scale_idx = np.abs(scale).argmax(axis=-1)
    smax = np.take_along_axis(scale, max_scale_idx[..., None], axis=-1)[..., 0]
    d = _f16(smax / -128.0)
    df = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df[:, None] != 0, np.round(scale / df[:, None]), 0)
    sc = np.clip(sc, -128, 127).astype(np.int8)
    step = df[:, None, None] * sc.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step != 0, np.round(x / step), 0)
    q6 = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    lo = (q6 & 0x0F).reshape(n, 2, 2, 64)
    hi = (q6 >> 4).reshape(n, 2, 4, 32)
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(n, 128)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.reshape(n, 1).view(np.uint8)], axis=1)
    return blocks.reshape(*shape[:-1], shape[-1] // 256 * 210)


def _quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """Pack float32 ``[..., n*256]`` rows into Q4_K blocks (144 bytes per 256 values)."""
    shape = rows.shape
    x = rows.reshape(-1, 8, 32).astype(np.float32)  # blocks*8 sub-blocks of 32
    n = x.shape[0]
    lo = np.minimum(x.min(axis=-1), 0.0)
    hi = x.max(axis=-1)
    scale = (hi - lo) / 15.0
    mins = -lo
    d = _f16(scale.max(axis=-1) / 63.0)
    dmin = _f16(mins.max(axis=-1) / 63.0)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df != 0, np.round(scale / df), 0)
        mn = np.where(dminf != 0, np.round(mins / dminf), 0)
    sc = np.clip(sc, 0, 63).astype(np.uint8)
    mn = np.clip(mn, 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    offset = (dminf * mn)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step != 0, np.round((x + offset) / step), 0)
    q = np.clip(q, 0, 15).astype(np.uint8)  # [n, 8, 32]
    scales = np.concatenate([
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
        mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),
    ], axis=1)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)
    blocks = np.concatenate([d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8),
                             scales, qs], axis=1)
    return blocks.reshape(*shape[:-1], shape[-1] // 256 * 144)


def quantize(array: np.ndarray, qtype: str) -> np.ndarray:
    """Quantize float32 ``array`` (torch layout) to ``qtype`` as GGUFWriter expects it.

    F32/F16 return float arrays; every other type returns uint8 block bytes.
    Raises ``ValueError`` if the row length is not a multiple of the block size,
    ``NotImplementedError`` for a type outside :data:`QTYPES`.
    """
    from gguf import GGMLQuantizationType, GGML_QUANT_SIZES
    from gguf import quants

    if qtype not in _FILE_TYPE:
        raise NotImplementedError(f"tiny GGUF writer cannot write {qtype!r}; supported: {', '.join(QTYPES)}")
    t = GGMLQuantizationType[qtype]
    block = GGML_QUANT_SIZES[t][0]
    if array.shape[-1] % block:
        raise ValueError(f"{qtype} needs rows that are a multiple of {block} values, got {array.shape}")
    array = np.ascontiguousarray(array, dtype=np.float32)
    if qtype == "Q4_K":
        return _quantize_q4_k(array)
    if qtype == "Q6_K":
        return _quantize_q6_k(array)
    return quants.quantize(array, t)


def dequantize(data: np.ndarray, qtype: str) -> np.ndarray:
    """Inverse of :func:`quantize` via ``gguf.quants.dequantize`` (float32, torch layout)."""
    from gguf import GGMLQuantizationType
    from gguf import quants

    return np.asarray(quants.dequantize(data, GGMLQuantizationType[qtype]), dtype=np.float32)


def _stored(hf_name: str, value: np.ndarray, qtype: str, embd_qtype: str) -> tuple[str, np.ndarray]:
    """The qtype a tensor is stored as, and its dequantized (= effective) float values."""
    if value.ndim == 1:
        return "F32", value
    t = embd_qtype if hf_name == "model.embed_tokens.weight" else qtype
    if t == "F32":
        return t, value
    return t, dequantize(quantize(value, t), t).reshape(value.shape)


# --------------------------------------------------------------------------- writers


def write_tiny_gguf(path: str | Path, *, arch: str = "llama", n_layer: int = 2, n_embd: int = 64,
                    n_head: int = 4, n_head_kv: int = 2, n_ff: int = 128, ctx: int = 512, seed: int = 0,
                    qtype: str = "F32", tie_embeddings: bool = False, rope_freq_base: float = 10000.0,
                    rms_eps: float = 1e-5, embd_qtype: str | None = None, bos_token_id: int = 0,
                    eos_token_id: int = 0, chat_template: str | None = CHATML_TEMPLATE,
                    metadata: dict | None = None, extra_control_tokens: tuple[str, ...] = ()) -> Path:
    """Write a tiny random-weight GGUF model and return its path.

    ``qtype`` (one of :data:`QTYPES`) applies to every 2-D weight;
    ``embd_qtype`` overrides it for ``token_embd.weight`` (default: same).
    Norms and biases stay F32. ``output.weight`` is omitted when
    ``tie_embeddings``. ``metadata``: further keys (e.g. ``general.sampling.temp``), an int
    written as uint32 (int32 when negative), a float as float32, a str as a string. See the
    module docstring for layout and tokenizer. ``extra_control_tokens``: texts appended to the
    vocabulary as control tokens (token type 3), ids ``len(tiny_vocab()[0])`` onwards.
    """
    import gguf

    arch = _GGUF_ARCH.get(arch, arch)
    embd_qtype = embd_qtype or qtype
    for t in (qtype, embd_qtype):
        if t not in _FILE_TYPE:
            raise NotImplementedError(f"tiny GGUF writer cannot write {t!r}; supported: {', '.join(QTYPES)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, types, merges = tiny_vocab()
    tokens, types = tokens + list(extra_control_tokens), types + [3] * len(extra_control_tokens)
    weights = tiny_weights(arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                           n_ff=n_ff, seed=seed, tie_embeddings=tie_embeddings, n_vocab=len(tokens))
    head_dim = n_embd // n_head

    w = gguf.GGUFWriter(path, arch)
    w.add_name("kvserve tiny test model")
    w.add_block_count(n_layer)
    w.add_context_length(ctx)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(rope_freq_base)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_file_type(_FILE_TYPE[qtype])
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(head_dim)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(bos_token_id)
    w.add_eos_token_id(eos_token_id)
    w.add_eot_token_id(SPECIAL_TOKENS.index("<|im_end|>"))
    w.add_unk_token_id(0)
    w.add_pad_token_id(eos_token_id)
    w.add_add_bos_token(False)
    w.add_add_space_prefix(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            (w.add_uint32 if value >= 0 else w.add_int32)(key, int(value))

    for hf_name, value in weights.items():
        name = _gguf_name(hf_name)
        t = "F32" if value.ndim == 1 else (embd_qtype if name == "token_embd.weight" else qtype)
        data = value if t == "F32" else quantize(value, t)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            data = permute_qk(data, n_head)
        elif arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            data = permute_qk(data, n_head_kv)
        if t in ("F32", "F16"):
            w.add_tensor(name, np.ascontiguousarray(data))
        else:
            w.add_tensor(name, np.ascontiguousarray(data), raw_shape=data.shape,
                         raw_dtype=gguf.GGMLQuantizationType[t])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_hf_dir(path: str | Path, *, arch: str = "LlamaForCausalLM", n_layer: int = 2, n_embd: int = 64,
                      n_head: int = 4, n_head_kv: int = 2, n_ff: int = 128, ctx: int = 512, seed: int = 0,
                      qtype: str = "F32", tie_embeddings: bool = False, rope_freq_base: float = 10000.0,
                      rms_eps: float = 1e-5, embd_qtype: str | None = None, bos_token_id: int = 0,
                      eos_token_id: int = 0, chat_template: str | None = CHATML_TEMPLATE,
                      torch_dtype: str = "float32") -> Path:
    """Write the HF-directory twin of :func:`write_tiny_gguf` and return the directory.

    Same arguments mean same model: ``qtype``/``embd_qtype`` make the float
    tensors equal to what the GGUF's quantized blocks dequantize to.
    ``torch_dtype`` ("float32", "float16", "bfloat16") is the safetensors
    dtype; only float32 is exactly the GGUF F32 model (float16 matches a GGUF
    written with ``qtype="F16"``).
    """
    from safetensors.numpy import save_file

    hf_arch = _HF_ARCH.get(arch, arch)
    if hf_arch not in _GGUF_ARCH:
        raise ValueError(f"unsupported arch {arch!r}; use one of {sorted(_GGUF_ARCH)}")
    embd_qtype = embd_qtype or qtype
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokens, _, _ = tiny_vocab()
    weights = tiny_weights(arch=hf_arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                           n_ff=n_ff, seed=seed, tie_embeddings=tie_embeddings, n_vocab=len(tokens))
    tensors: dict[str, np.ndarray] = {}
    for name, value in weights.items():
        _, eff = _stored(name, value, qtype, embd_qtype)
        tensors[name] = eff
    if torch_dtype == "bfloat16":
        import torch
        from safetensors.torch import save_file as save_torch

        save_torch({k: torch.from_numpy(v.copy()).to(torch.bfloat16) for k, v in tensors.items()},
                   str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        np_dtype = {"float32": np.float32, "float16": np.float16}[torch_dtype]
        save_file({k: np.ascontiguousarray(v.astype(np_dtype)) for k, v in tensors.items()},
                  str(path / "model.safetensors"), metadata={"format": "pt"})

    model_type = _GGUF_ARCH[hf_arch]
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": n_embd,
        "intermediate_size": n_ff,
        "num_hidden_layers": n_layer,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv,
        "head_dim": n_embd // n_head,
        "hidden_act": "silu",
        "rms_norm_eps": rms_eps,
        "rope_theta": rope_freq_base,
        "max_position_embeddings": ctx,
        "vocab_size": len(tokens),
        "tie_word_embeddings": tie_embeddings,
        "torch_dtype": torch_dtype,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }
    if model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    im_end = SPECIAL_TOKENS.index("<|im_end|>")
    eos_ids = [eos_token_id] if eos_token_id == im_end else [eos_token_id, im_end]
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos_token_id, "eos_token_id": eos_ids}, indent=2) + "\n")
    hf_tokenizer().save(str(path / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": tokens[bos_token_id],
        "eos_token": tokens[eos_token_id],
        "unk_token": tokens[0],
        "pad_token": tokens[eos_token_id],
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": ctx,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
    }
    if chat_template is not None:
        tok_config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return path
