"""Format-neutral model description shared by the GGUF and safetensors loaders.

A loader produces a :class:`ModelConfig` (hyper-parameters), a
:class:`ModelInfo` (what ``/v1/models`` ``meta`` and ``/props`` report) and a
dict of :class:`Weight` objects under kvserve's internal tensor names
(llama.cpp's GGUF names: ``token_embd.weight``, ``blk.N.attn_q.weight``, ...).

Q/K projection rows are always in llama.cpp's interleaved-pair RoPE layout
here (rotary pairs are adjacent rows, so RoPE is one complex multiply): GGUF
llama weights already are (llama.cpp's converter permutes them); HF weights
and GGUF qwen2 weights (NEOX layout) are permuted at load by
:func:`interleave_qk`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


class ModelLoadError(ValueError):
    """A model file or directory that cannot be loaded; the message names the problem."""


@dataclass(slots=True)
class ModelConfig:
    """Hyper-parameters of one decoder-only model (the families of :mod:`kvserve.models.family`
    that build on the llama block).

    Attributes:
        arch: the GGUF ``general.architecture`` name ("llama", "mistral", "qwen2", ...); its family
            (kvserve.models.family.family_of) says what it means.
        n_layer, n_embd, n_head, n_head_kv, n_ff, n_vocab: sizes (counts).
        head_dim: per-head size (n_embd // n_head unless the file says otherwise).
        n_ctx_train: training context (tokens).
        rope_freq_base: RoPE theta.
        rope_scaling: None or dict(type="linear"|"llama3", factor=..., ...) (the readers refuse
            other types).
        rms_eps: RMSNorm epsilon.
        qkv_bias: q/k/v projections carry biases (qwen2; HF ``attention_bias``).
        tie_embeddings: output head shares token_embd.weight.
        attn_bias: the attention output projection carries a bias (HF ``attention_bias``).
        mlp_bias: the gate, up and down projections carry biases (HF ``mlp_bias``).
        qk_norm: per-head RMSNorm of q and k before RoPE (qwen3: ``attn_q_norm``/``attn_k_norm``).
    """

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    head_dim: int
    n_ctx_train: int
    rope_freq_base: float = 10000.0
    rope_scaling: dict | None = None
    rms_eps: float = 1e-5
    qkv_bias: bool = False
    tie_embeddings: bool = False
    attn_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if self.n_head <= 0 or self.n_head_kv <= 0 or self.n_head % self.n_head_kv:
            raise ModelLoadError(f"bad head counts: n_head={self.n_head}, n_head_kv={self.n_head_kv}")


@dataclass(slots=True)
class ModelInfo:
    """Descriptive facts about the loaded model (``/v1/models`` meta, ``/props``).

    size is bytes of tensor data in the file; ftype is llama.cpp's file-type
    text (e.g. "Q4_1", "all F32"); vocab_type is llama.cpp's enum (1 SPM, 2 BPE).
    """

    path: str
    name: str
    format: str  # "gguf" | "safetensors"
    arch: str
    ftype: str
    n_params: int
    size: int
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    vocab_type: int = 2
    quantization_level: str = ""
    metadata: dict = field(default_factory=dict)


@dataclass(slots=True)
class Weight:
    """One tensor, torch layout ([out, in] for matrices).

    Either ``dense`` (float32 numpy array), or a 4-bit block format kept packed:
    ``q4`` (uint8 [out, in] values 0..15) with ``q4_scale`` and ``q4_zero``
    (float32 [out, in // 32]) such that ``w = (q - 8) * scale + zero``
    (torch's int4pack convention; for GGUF Q4_1 ``scale = d``, ``zero = m + 8d``;
    for Q4_0 ``scale = d``, ``zero = 0``), or ``raw``: a matrix's GGUF bytes as the
    file stores them (uint8 [out, bytes per row], or [E, out, bytes per row] for a MoE layer's
    stacked experts; usually a view of the file's
    np.memmap: no copy), of ggml type ``source_type`` (the block kernels of
    :mod:`kvserve.models.ggml_kernel` multiply with it; :meth:`to_dense` dequantizes).
    ``q4_raw``: beside ``q4``, the same Q4_0/Q4_1 blocks as the file stores them (a view of its
    mapping, no copy), which the block kernels' prefill path multiplies (Linear, steps of more than
    ``small_batch_rows`` rows) in place of a dense copy; None where there is none (a permuted or
    sliced weight, a checkpoint's repacked groups).
    """

    shape: tuple[int, ...]
    dense: np.ndarray | None = None
    q4: np.ndarray | None = None
    q4_scale: np.ndarray | None = None
    q4_zero: np.ndarray | None = None
    source_type: str = "F32"
    raw: np.ndarray | None = None
    q4_raw: np.ndarray | None = None

    def to_dense(self) -> np.ndarray:
        """float32 array of ``shape`` (dequantized when packed; a new array each call for ``raw``)."""
        if self.dense is not None:
            return self.dense
        if self.raw is not None:
            return _dequantize_raw(np.asarray(self.raw), self.source_type, self.shape)
        out, inp = self.shape
        q = self.q4.astype(np.float32).reshape(out, inp // 32, 32)
        w = (q - 8.0) * self.q4_scale[:, :, None] + self.q4_zero[:, :, None]
        return w.reshape(out, inp)

    def dense_rows(self, ids: np.ndarray) -> np.ndarray:
        """float32 [len(ids), in] copy of rows ``ids`` (int array, values in [0, out); numpy's
        IndexError otherwise), the same values as ``to_dense()[ids]``; of ``raw`` GGUF blocks only
        those rows are dequantized (an embedding lookup without a float copy of the table)."""
        if self.raw is not None and len(ids) == 0:
            return np.zeros((0, self.shape[1]), np.float32)
        if self.raw is not None:
            return _dequantize_raw(np.asarray(self.raw)[ids], self.source_type, (len(ids), self.shape[1]))
        return np.ascontiguousarray(self.to_dense()[ids], dtype=np.float32)

    def rows(self, a: int, b: int) -> "Weight":
        """Rows (output features) ``a:b`` of a matrix, or elements ``a:b`` of a vector: GGUF block
        rows stay a view of the file's mapping (whole rows of blocks), packed 4-bit rows stay packed,
        float32 rows are copied. Raises numpy's errors for bounds outside the tensor."""
        if self.raw is not None:
            return Weight((b - a, *self.shape[1:]), raw=self.raw[a:b], source_type=self.source_type)
        if self.dense is not None:
            return Weight((b - a, *self.shape[1:]), dense=np.ascontiguousarray(self.dense[a:b]),
                          source_type=self.source_type)
        return Weight((b - a, self.shape[1]), q4=np.ascontiguousarray(self.q4[a:b]),
                      q4_scale=np.ascontiguousarray(self.q4_scale[a:b]),
                      q4_zero=np.ascontiguousarray(self.q4_zero[a:b]), source_type=self.source_type)

    def permute_rows(self, order: np.ndarray) -> "Weight":
        """The same weight with rows (output features) reordered by ``order``."""
        if self.dense is not None:
            return Weight(self.shape, dense=np.ascontiguousarray(self.dense[order]), source_type=self.source_type)
        if self.raw is not None:  # whole rows of blocks: a copy in the new order (no longer the file's pages)
            return Weight(self.shape, raw=np.ascontiguousarray(self.raw[order]), source_type=self.source_type)
        return Weight(
            self.shape,
            q4=np.ascontiguousarray(self.q4[order]),
            q4_scale=np.ascontiguousarray(self.q4_scale[order]),
            q4_zero=np.ascontiguousarray(self.q4_zero[order]),
            source_type=self.source_type,
        )


def interleave_order(n_rows: int, n_head: int) -> np.ndarray:
    """Row order turning the half-split (HF / NEOX) Q/K layout into interleaved pairs.

    Per head, HF row ``half * hd/2 + i`` becomes row ``2 * i + half``, as
    llama.cpp's converter does for llama (``permute``). Returns ``order`` with
    ``interleaved_rows = hf_rows[order]``.
    """
    hd = n_rows // n_head
    idx = np.arange(n_rows).reshape(n_head, 2, hd // 2)  # hf position of (h, half, i)
    return idx.transpose(0, 2, 1).reshape(n_rows)  # (h, i, half) -> hf position


def interleave_qk(config: "ModelConfig", weights: dict) -> None:
    """Permute every layer's Q/K weights (and biases, and per-head q/k norm weights) from
    half-split to interleaved, in place."""
    norm_order = interleave_order(config.head_dim, 1)
    for i in range(config.n_layer):
        for name in ("attn_q_norm", "attn_k_norm"):
            w = weights.get(f"blk.{i}.{name}.weight")
            if w is not None:
                weights[f"blk.{i}.{name}.weight"] = Weight(w.shape,
                                                           dense=np.ascontiguousarray(w.to_dense()[norm_order]))
        for name, heads in (("attn_q", config.n_head), ("attn_k", config.n_head_kv)):
            w = weights[f"blk.{i}.{name}.weight"]
            order = interleave_order(w.shape[0], heads)
            weights[f"blk.{i}.{name}.weight"] = w.permute_rows(order)
            b = weights.get(f"blk.{i}.{name}.bias")
            if b is not None:
                weights[f"blk.{i}.{name}.bias"] = Weight(b.shape, dense=np.ascontiguousarray(b.to_dense()[order]))


@dataclass(slots=True)
class LoadedModel:
    """Everything a loader returns: config, info, weights, tokenizer, chat template."""

    config: ModelConfig
    info: ModelInfo
    weights: dict[str, Weight]
    tokenizer: object
    chat_template: str | None = None
    generation_defaults: dict = field(default_factory=dict)
    #: how a GGUF file's weights ended up held: "read" (private memory) or "mmap" (the file's mapping,
    #: also when the private memory could not be had); None for other formats
    weight_memory: str | None = None


def check_tensors(required: list[str], weights: dict[str, Weight], source: str) -> None:
    """Raise ModelLoadError naming the first tensor of ``required`` (a family's list, see
    kvserve.models.family.Family.required_tensors) that ``weights`` lacks."""
    for name in required:
        if name not in weights:
            raise ModelLoadError(f"{source}: missing tensor '{name}'")


def _dequantize_raw(raw: np.ndarray, source_type: str, shape: tuple[int, int]) -> np.ndarray:
    """float32 ``shape`` array of GGUF rows ``raw`` (uint8 [rows, bytes per row]) of ggml type
    ``source_type``: gguf.quants.dequantize's values, Q8_0 bit for bit on a faster path."""
    if source_type == "Q8_0":  # gguf's values bit for bit, in one float32 buffer (~4x faster)
        blocks = raw.reshape(-1, 34)
        w = blocks[:, 2:].view(np.int8).astype(np.float32)
        w *= blocks[:, :2].copy().view(np.float16).astype(np.float32)
        return w.reshape(shape)
    import gguf

    arr = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[source_type])
    return np.ascontiguousarray(arr.reshape(shape), dtype=np.float32)


#: byte offsets of the float16 scales in a block of each ggml type (F16 / BF16: the values themselves)
_RAW_SCALES = {"Q4_0": (18, (0,)), "Q4_1": (20, (0, 2)), "Q5_0": (22, (0,)), "Q5_1": (24, (0, 2)),
               "Q8_0": (34, (0,)), "IQ4_NL": (18, (0,)), "Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)),
               "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,)), "IQ4_XS": (136, (0,))}


def raw_scale_bits(w: Weight) -> list[tuple[np.ndarray, int]]:
    """The float16 scales of a ``raw`` GGUF weight's blocks (F16 / BF16: the values) as uint16
    views of the file's bytes (strided, no copy), each with its exponent mask: a value is NaN or
    Inf when ``bits & mask == mask`` (0x7C00 for float16, 0x7F80 for bfloat16). Empty for other
    weights and for types whose scales cannot be NaN (MXFP4's are powers of two). For
    :func:`check_finite`."""
    if w.raw is None:
        return []
    if w.source_type in ("F16", "BF16"):
        return [(np.asarray(w.raw).reshape(-1).view(np.uint16), 0x7C00 if w.source_type == "F16" else 0x7F80)]
    if w.source_type not in _RAW_SCALES:
        return []
    size, offsets = _RAW_SCALES[w.source_type]
    blocks = np.asarray(w.raw).reshape(-1, size).view(np.uint16)  # every block size is even
    return [(blocks[:, o // 2], 0x7C00) for o in offsets]


def _count_nonfinite_bits(bits: np.ndarray, mask: int) -> int:
    """Values of ``bits`` (uint16 float16/bfloat16 patterns) whose exponent is all ones (NaN, Inf)."""
    return int(np.count_nonzero((bits & np.uint16(mask)) == mask))


def check_finite(weights: dict[str, Weight], source: str) -> None:
    """Raise ModelLoadError naming the first tensor holding NaN or Inf.

    Such a model loads and generates nothing useful (every logit NaN: empty text), so it is
    refused at load. Cheap: one float32 sum per float array (NaN and Inf propagate through it; about
    40 ms for SmolLM2-360M's 28 M float values and Q4 scales, 1% of its load); only a sum that
    is not finite is checked element by element (a finite tensor whose sum overflows passes).
    Packed 4-bit weights are finite by construction except for their scales and zeros; of ``raw``
    GGUF blocks the float16 scales are checked by their exponent bits on views of the file's
    bytes (:func:`raw_scale_bits`: no copy; a 1B Q4_K_M file's 10 M scales in ~30 ms, the
    float32 copies they replaced took ~0.4 s).
    """
    for name, w in weights.items():
        bad = total = 0
        for a in (w.dense, w.q4_scale, w.q4_zero):
            if a is None or math.isfinite(float(a.sum(dtype=np.float32))):
                continue
            bad, total = int(a.size - np.count_nonzero(np.isfinite(a))), a.size
            if bad:
                break
        if not bad:
            scales = raw_scale_bits(w)
            bad, total = sum(_count_nonfinite_bits(b, m) for b, m in scales), sum(b.size for b, _ in scales)
        if bad:
            raise ModelLoadError(f"{source}: tensor '{name}' has {bad} NaN/Inf values "
                                 f"(of {total}): the weights are corrupt")
