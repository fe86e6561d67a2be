"""The llama block in torch: llama, SmolLM, Mistral-style, qwen2 (q/k/v biases), qwen3 (per-head
q/k RMSNorm), qwen3moe (a mixture-of-experts FFN, kvserve.models.moe), with optional
attention-output and MLP biases and llama 3's per-dimension RoPE factors (``rope_freqs.weight``).
The families that run it are records of kvserve.models.family.

One forward pass takes a flat batch of tokens from several sequences (decodes
and prompt chunks mixed, continuous batching) and reads/writes a paged KV cache
through an :class:`AttentionBatch` built by the model runner. Logits are
computed only for the rows the runner asks for.

RoPE uses llama.cpp's interleaved-pair layout (the loaders permute HF and
qwen2 weights into it), so rotating q and k is one complex multiply.
"""

from __future__ import annotations

import functools

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.kv_quant import QuantKV, kv_gather, kv_round, kv_write
from kvserve.loaders.weights import ModelConfig, Weight
from kvserve.models import q4_kernel


@dataclass
class PrefillGroup:
    """One sequence's prompt chunk inside the flat batch.

    Tokens ``[start, end)`` of the batch are this chunk; ``kv_index`` ([n_kv]
    long) lists the cache rows of all of the sequence's tokens up to and
    including the chunk (None when the chunk starts at position 0: attention
    then uses the chunk's own K/V with a causal mask); ``n_past`` is the
    number of tokens before the chunk.

    ``per_row`` (a speculative-decoding verification chunk, with ``kv_index``):
    each query attends exactly as a one-sequence decode step would (one SDPA
    call over its own ``n_past + i + 1`` rows, no mask), so the verified logits
    and the K/V they leave behind are bit for bit those of plain decoding; the
    rows are gathered once for the whole chunk.
    """

    start: int
    end: int
    n_past: int
    kv_index: torch.Tensor | None = None
    per_row: bool = False
    #: position of ``kv_index``'s first row (a sliding-window view reads from the window's first
    #: block; 0 otherwise)
    kv_start: int = 0
    _mask: torch.Tensor | None = None
    _grouped: torch.Tensor | None = None

    def mask(self) -> torch.Tensor:
        """[Lq, Lk] bool, bottom-right aligned causal: query i sees keys j <= n_past + i.
        Built once per step and shared by every layer."""
        if self._mask is None:
            lq, lk = self.end - self.start, self.kv_index.shape[0]
            self._mask = torch.ones(lq, lk, dtype=torch.bool, device=self.kv_index.device).tril(diagonal=lk - lq)
        return self._mask

    def grouped_mask(self, n_group: int, dtype) -> torch.Tensor:
        """[1, 1, n_group * Lq, Lk] additive mask (0 / -inf) for LlamaModel._grouped_attention:
        :meth:`mask` repeated for each of the ``n_group`` query heads of a KV head. Built
        once per step (SDPA would turn a bool mask into this in every layer)."""
        if self._grouped is None:
            m = self.mask()
            lq, lk = m.shape
            bias = torch.zeros(lq, lk, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
            self._grouped = bias.unsqueeze(0).expand(n_group, lq, lk).reshape(1, 1, n_group * lq, lk)
        return self._grouped


@dataclass
class AttentionBatch:
    """Where each token's K/V goes and what each query attends to.

    Layout of the flat batch: the ``n_decode`` single-token queries first, then
    the prefill chunks in order.

    Attributes:
        positions: [T] long, absolute positions (RoPE).
        slot_mapping: [T] long, cache row (block * block_size + offset) per token.
        n_decode: number of single-token queries at the front.
        decode_kv_index: [n_decode, L] long, cache rows each decode query reads
            (padded with row 0).
        decode_mask: [n_decode, 1, 1, L] bool, True where a row is valid; None when
            no row is padded (every decode query reads L rows).
        decode_lens: [n_decode] long, the valid rows of each decode query (the native
            decode step's form of the mask).
        prefills: prompt chunks (see PrefillGroup).
        decode_kv_start: [n_decode] long, the position of each decode query's first row (a
            sliding-window view); None: every row list starts at position 0.
        windows: window (tokens) -> the batch as the layers with that sliding window see it
            (their own cache rows; ModelRunner builds them when the KV cache has sliding-window
            groups); empty: every layer reads the rows above.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    n_decode: int = 0
    decode_kv_index: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    prefills: list[PrefillGroup] = field(default_factory=list)
    decode_kv_start: torch.Tensor | None = None
    windows: dict[int, "AttentionBatch"] = field(default_factory=dict)


def _int4_pack(w: Weight, device) -> tuple[torch.Tensor, torch.Tensor]:
    """torch int4pack weight and [K/32, N, 2] bf16 scales/zeros for _weight_int4pack_mm_for_cpu.

    The packed layout is row by row, so it is built 256 rows at a time: the int32 copy the
    conversion takes stays small (SmolLM2's whole-matrix copies, 425 MB of fresh pages, took
    ~0.5 s of start-up; chunked ~0.1 s), the same bytes."""
    rows = 256
    packed = torch.cat([torch._convert_weight_to_int4pack_for_cpu(
        torch.from_numpy(w.q4[r:r + rows].astype("int32")), 1) for r in range(0, w.shape[0], rows)])
    sz = torch.stack(
        [torch.from_numpy(w.q4_scale).t(), torch.from_numpy(w.q4_zero).t()], dim=-1
    ).to(torch.bfloat16)
    return packed.to(device), sz.contiguous().to(device)


class Linear(nn.Module):
    """y = x @ W.T (+ b) with a small-batch kernel and a dense large-batch path.

    Args:
        weights: row blocks concatenated along the output dimension (fused
            q|k|v or gate|up).
        bias: matching bias blocks or None.
        dtype: dtype of the dense weights.
        device: torch device.
        kernel: small-batch kernel on CPU: "auto" (int4 for Q4_0/Q4_1 weights, whose
            blocks it represents exactly; int8 for other quantized GGUF types;
            dense for float weights), "int8" (weights requantized per
            output row to int8, bfloat16 scales rounded before quantizing, torch's
            ``_weight_int8pack_mm`` with bfloat16 activations; its output is
            bfloat16), "w8a8" (the same int8 weights with float32 scales, and
            activations quantized per row to int8 at run time: torch's
            ``_int_mm``, int32 accumulation, float32 output; the output head's
            kernel, where bfloat16 logits would be rounded to steps of 0.125 at
            magnitude 16-32 and tie), "int4" (Q4_0/Q4_1
            blocks kept packed for ``_weight_int4pack_mm_for_cpu``, group size 32,
            zero = m + 8d; other types fall back to dense) or "dense".
            Under "auto" (and "w8a8", the head's auto choice), weights that keep their GGUF bytes
            (``Weight.raw``: every type of :mod:`kvserve.models.ggml_kernel`) are
            multiplied by the GGUF block kernels at every row count, with no dense copy
            (``kernel`` becomes "gguf"): with ``large_dtype`` bfloat16, steps of more than
            ``small_max_rows`` rows take their prefill path (weights dequantized a panel at a time
            to bfloat16, see kvserve.models.ggml_kernel) where the CPU has AVX512-BF16; the per-row
            kernels elsewhere, at fewer rows (so decode steps of up to ``small_max_rows`` rows
            keep their numerics) and with ``large_dtype`` float32; where those kernels cannot be
            built they are dequantized as other types are.
        small_max_rows: batches of at most this many rows use ``kernel``; larger
            ones use the dense weights (a dense GEMM wins there); for "int4" weights
            loaded from a GGUF file and ``large_dtype`` bfloat16, the file's blocks on the
            block kernels' prefill path instead where it runs (AVX512-BF16:
            ``large_blocks``, no dense copy).
            0 = always ``kernel`` and no dense copy is kept.
        large_dtype: dtype of that dense copy when ``kernel`` is not "dense":
            bfloat16 on CPUs with native bfloat16 (AVX512-BF16/AMX: 2-2.5x the
            float32 GEMM rate, half the memory), float32 otherwise.
        native_q4: with the "int4" kernel and a multiple of 64 input features, also
            keep the weights in the layout of kvserve's own kernel
            (:mod:`kvserve.models.q4_kernel`), used in place of torch's int4 kernel
            once it is built (``--compile --native-kernels``); 5 more bits per weight
            of memory. "decode": the same layout for the native decode step only
            (:mod:`kvserve.models.decode_native`), packed when it first asks
            (:meth:`native_weights`, off the start-up path) and never used by ``forward``.
        tied: the weight is also the token embedding (a tied head): its file bytes stay where they
            are when the block kernels repack them (``_block_matrix``'s ``give_back``).

    Input x: [T, in] float32; output [T, out] float32 (the small-batch kernels
    and a bfloat16 dense copy compute in bfloat16, accumulating in float32).
    """

    def __init__(self, weights: list[Weight], bias: list[Weight] | None, dtype, device, kernel: str = "dense",
                 small_max_rows: int = 0, large_dtype=torch.float32, native_q4: bool | str = False,
                 tied: bool = False):
        super().__init__()
        cpu = torch.device(device).type == "cpu"
        self.blocks = None  # the GGUF block kernels' matrix (kernel "gguf")
        #: kernel "int4": the file's Q4_0/Q4_1 blocks for steps of more than small_max_rows rows (the block
        #: kernels' prefill path, in place of a dense copy), or None
        self.large_blocks = None
        if cpu and kernel in ("auto", "w8a8") and all(w.raw is not None for w in weights):
            self.blocks = _block_matrix(weights, give_back=not tied)
            if self.blocks is not None:
                kernel = "gguf"
                # bfloat16 prefill (the dense copies' dtype elsewhere): steps of more rows take the prefill path
                self.blocks.gemm_min_rows = small_max_rows + 1 if small_max_rows > 0 and large_dtype == torch.bfloat16 else 0
        if kernel == "int4" or kernel == "auto" and self.blocks is None:
            # GGUF Q4_0/Q4_1 blocks (Weight.raw) for torch's int4 kernel: asked for, or no block kernels
            weights = [_unpack_q4(w) for w in weights]
        packed = all(w.q4 is not None for w in weights)
        if kernel == "auto":
            quantized = all(w.source_type not in _FLOAT_TYPES for w in weights)
            kernel = "int4" if packed else "int8" if quantized else "dense"
        n_out = sum(w.shape[0] for w in weights)
        if kernel == "int4" and (not packed or n_out % 16) or not cpu:  # the int4pack layout needs N % 16 == 0
            kernel = "dense"
        self.kernel = kernel
        self.small_max_rows = small_max_rows
        self.out_features = sum(w.shape[0] for w in weights)
        self.in_features = weights[0].shape[1]
        self.packed = self.scales = self.q8 = self.weight = None
        self.q4w: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._q4_src: Weight | None = None  # native_q4 "decode": packed by native_weights()
        #: native_q4 "decode": the packed weights by layout ("pair", "tile16"; see native_weights)
        self._q4_native: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        if kernel == "gguf":
            dense = None
        elif kernel == "int4":
            merged = Weight(
                (self.out_features, self.in_features),
                q4=_np_cat([w.q4 for w in weights]),
                q4_scale=_np_cat([w.q4_scale for w in weights]),
                q4_zero=_np_cat([w.q4_zero for w in weights]),
            )
            self.packed, self.scales = _int4_pack(merged, device)
            if native_q4 == "decode" and self.in_features % 64 == 0:
                self._q4_src = merged
            elif native_q4 and self.in_features % 64 == 0:
                self.q4w = q4_kernel.pack(merged.q4, merged.q4_scale, merged.q4_zero)
            if small_max_rows:
                # larger steps: the file's blocks on the block kernels' prefill path where it runs (bfloat16
                # prefill), else a dense copy (straight to its dtype: no float32 copy of the whole matrix)
                if large_dtype == torch.bfloat16:
                    self.large_blocks = _q4_block_matrix(weights)
                if self.large_blocks is None:
                    self.weight = _q4_dense(merged, large_dtype).to(device)
            dense = None
        else:
            dense = _np_cat([w.to_dense() for w in weights])
            if kernel in ("int8", "w8a8"):
                self.q8, self.scales = _int8_rows(torch.from_numpy(dense))
                if kernel == "w8a8":
                    # [K, N], _int_mm's right operand: a contiguous copy reads ~10% faster
                    # than the transposed view (49152 x 576 head, one row: 2.15 -> 1.92 ms)
                    self.q8 = self.q8.t().contiguous()
                    self.scales = self.scales.float()
                if not small_max_rows:
                    dense = None
        if dense is not None:
            self.weight = torch.from_numpy(dense).to(device=device, dtype=large_dtype if kernel != "dense" else dtype)
        self.bias = None
        if bias is not None:
            self.bias = torch.from_numpy(_np_cat([b.to_dense() for b in bias])).to(device=device, dtype=torch.float32)
        #: LoRA adapters of this projection (kvserve.lora.apply.LoraLinear), attached when one is added
        self.lora = None

    @property
    def has_native_weights(self) -> bool:
        """True when the native q4 layout is kept (packed or still to pack)."""
        return self.q4w is not None or self._q4_src is not None or bool(self._q4_native)

    def native_weights(self, layout: str = "pair") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The weights in the native kernel's layout: "pair" (q4_kernel.pack) or "tile16" (the AVX512
        native step's, q4_kernel.to_tiles: wq, d and m in tiles of 16 rows; out_features is a
        multiple of 16 wherever these weights are kept), packing them on the first call under
        native_q4 "decode" (about 20 ms for a 1536 x 576 projection) and keeping only the layouts
        asked for; None without them."""
        if layout == "pair" and self.q4w is not None:
            return self.q4w
        if layout in self._q4_native:
            return self._q4_native[layout]
        base = self.q4w if self.q4w is not None else self._q4_native.get("pair")
        if base is None and self._q4_src is not None:
            w = self._q4_src
            # not q4w: forward keeps torch's int4 kernel (its numerics do not change mid-run); the
            # source is dropped only once packed, so has_native_weights never reads False meanwhile
            # (the packing runs on a background thread while others may ask)
            if layout == "tile16":  # straight to tiles (the pair order is made only if asked for later)
                self._q4_native[layout] = q4_kernel.pack_tiles(w.q4, w.q4_scale, w.q4_zero)
                self._q4_src = None
                return self._q4_native[layout]
            base = q4_kernel.pack_torch(w.q4, w.q4_scale, w.q4_zero)
            self._q4_src = None
        if base is None and "tile16" in self._q4_native:  # a pair copy asked for after the tile one
            g = self._q4_native["tile16"]
            base = (q4_kernel.to_tiles(g[0], "q4", inverse=True), q4_kernel.scales_to_tiles(g[1], inverse=True),
                    q4_kernel.scales_to_tiles(g[2], inverse=True))
        if base is None:
            return None
        if layout == "pair":
            out = base
        else:
            out = (q4_kernel.to_tiles(base[0], "q4"), q4_kernel.scales_to_tiles(base[1]),
                   q4_kernel.scales_to_tiles(base[2]))
        self._q4_native[layout] = out
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, in] float32 -> [T, out] float32 (see the class docstring for the kernels)."""
        w = self.weight
        if self.blocks is not None:
            y = self.blocks.mm(x)
        elif self.large_blocks is not None and x.shape[0] > self.small_max_rows:
            y = self.large_blocks.mm(x)
        elif w is None or (self.kernel != "dense" and x.shape[0] <= self.small_max_rows):
            if self.kernel == "w8a8":
                y = _w8a8_mm(x, self.q8, self.scales)  # float32 logits from int8 x int8
            elif self.kernel == "int8":
                y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.q8, self.scales).to(x.dtype)
            elif self.q4w is not None and q4_kernel.READY:
                y = q4_kernel.q4_mm(x, *self.q4w)
            elif self.kernel == "int4":
                y = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, 32, self.scales).to(x.dtype)
            else:
                y = F.linear(x.to(w.dtype), w).to(x.dtype)
        else:
            y = F.linear(x.to(w.dtype), w).to(x.dtype)
        if self.bias is not None:
            # in place: y is a new tensor on every path above (float32 ones stay float32 as y + bias keeps them)
            y = y.add_(self.bias) if y.dtype == self.bias.dtype else y + self.bias
        if self.lora is not None:  # the step's adapter rows get their deltas (kvserve.lora.apply)
            y = self.lora.apply(x, y)
        return y


def _unpack_q4(w: Weight) -> Weight:
    """A GGUF Q4_0/Q4_1 matrix kept as the file's blocks, unpacked to nibbles and scales (torch's
    int4 kernel's form); any other weight as it is."""
    if w.raw is None or w.source_type not in ("Q4_0", "Q4_1"):
        return w
    from kvserve.loaders.gguf import _q4_blocks

    return _q4_blocks(w.raw, w.shape[0], w.shape[1], w.source_type)


def _block_matrix(weights: list[Weight], repack: bool | None = None, give_back: bool = True):
    """The GGUF block kernels' matrix over ``weights`` (raw GGUF rows, stacked along the output
    dimension, the bytes not copied; Q4_0 parts repacked where ``repack``, default
    :func:`~kvserve.models.ggml_kernel.repack_q4_0`: then their file pages are given back unless
    ``give_back`` is False: a tied head, whose bytes the embedding lookup keeps reading every step), or
    None where the kernels cannot be used (not built here, ``KVSERVE_GGML_KERNELS=0``, a type or row
    length they lack)."""
    from kvserve.models import ggml_kernel

    mod = ggml_kernel.ensure_built()
    if mod is None:
        return None
    try:
        return ggml_kernel.BlockMatrix(mod, [(w.raw, w.source_type) for w in weights], weights[0].shape[1],
                                       repack=ggml_kernel.repack_q4_0() if repack is None else repack,
                                       give_back=give_back)
    except ValueError:
        return None


def _q4_block_matrix(weights: list[Weight]):
    """The block matrix over Q4_0/Q4_1 weights' file blocks (``Weight.q4_raw``), its prefill path on for
    every row count it is given, or None where that path does not run here (no AVX512-VNNI build,
    the kernels off or not built, a weight without its blocks)."""
    if any(w.q4_raw is None for w in weights):
        return None
    # the file's layout: the prefill path reads it (a repacked Q4_0 part has its own kernel, no prefill path)
    m = _block_matrix([Weight(w.shape, raw=w.q4_raw, source_type=w.source_type) for w in weights], repack=False)
    if m is None or not m.has_gemm:
        return None
    m.gemm_min_rows = 1
    return m


_FLOAT_TYPES = {"F32", "F16", "BF16", "F64", "torch.float32", "torch.float16", "torch.bfloat16"}


@functools.lru_cache(maxsize=4)
def int8_gemm_is_fast(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True where torch's ``_int_mm`` (int8 x int8 -> int32) has a fast CPU path: x86 CPUs
    with VNNI (AVX512-VNNI, AVX-VNNI) or AMX-INT8, read from /proc/cpuinfo's flags. Elsewhere it
    falls back to a reference loop: on an AVX2-only EPYC one row of SmolLM2's 49,152 x 576
    head took 180 ms (float32: 10 ms), and decode ran at 6-7 tokens/s instead of ~80."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})
    except OSError:
        pass
    return False


def auto_head_kernel() -> str:
    """The output head's small-batch kernel under ``cpu_kernel`` "auto": "w8a8" (float32
    logits from int8 weights, a quarter of the bytes) where :func:`int8_gemm_is_fast`, else
    "dense" (float32 weights and logits)."""
    return "w8a8" if int8_gemm_is_fast() else "dense"


def _w8a8_mm(x: torch.Tensor, q8t: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ int8 weights ([K, N], float32 scales [N]) -> [M, N] float32.

    x is written as two int8 limbs per row, x ~ a * s1 + b * s2 (a = round(x / s1),
    b = round((x - a * s1) / s2), s2 = s1 / 127), so activations keep about 14 bits:
    one int8 limb alone (per-row scale) moved a near-tie logprob of SmolLM2 by 0.35.
    Both limbs go through one ``_int_mm`` ([2M, K] rows): a decode step is bound by
    reading the weights, so the second limb is nearly free. int32 accumulation
    (|sum| <= K * 127 * 127 fits for K < 133,000).
    """
    m = x.shape[0]
    s1 = x.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-30).div_(127.0)
    a = torch.round(x / s1)
    s2 = s1 / 127.0
    b = torch.round((x - a * s1).div_(s2))
    y = torch._int_mm(torch.cat([a, b]).to(torch.int8), q8t).float()
    return (y[:m].mul_(s1).add_(y[m:].mul_(s2))).mul_(scales)


def _int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantization: (q int8 [N, K], scale bfloat16 [N]).

    The scale is rounded to bfloat16 before quantizing, so the kernel's
    bfloat16 scale adds no error of its own.
    """
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def _q4_dense(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """The dense [out, in] tensor of a packed 4-bit Weight, in ``dtype``.

    The same float32 values as :meth:`Weight.to_dense` (``(q - 8) * scale + zero``, each operation
    rounded on its own, so bit for bit), then rounded to ``dtype`` as ``Tensor.to`` rounds. Built
    in chunks of 256 Ki weights with torch's threads, so no float32 copy of the whole matrix is
    made: SmolLM2's 106 M projection weights took ~0.9 s of start-up through numpy, ~0.1-0.3 s
    here."""
    out, inp = w.shape
    q = torch.from_numpy(w.q4).view(out, inp // 32, 32)
    scale = torch.from_numpy(w.q4_scale).unsqueeze(-1)
    zero = torch.from_numpy(w.q4_zero).unsqueeze(-1)
    res = torch.empty((out, inp), dtype=dtype)
    step = max(1, (1 << 18) // inp)
    for r in range(0, out, step):
        f = q[r:r + step].to(torch.float32)
        f.sub_(8.0).mul_(scale[r:r + step]).add_(zero[r:r + step])
        res[r:r + step] = f.view(-1, inp)
    return res


def _biases(weights: dict[str, Weight], prefix: str, on: bool, *names: str) -> list[Weight] | None:
    """The ``prefix + name + ".bias"`` tensors of a projection (concatenated like its weights), or
    None when the config's flag ``on`` is off."""
    return [weights[f"{prefix}{n}.bias"] for n in names] if on else None


def _np_cat(arrays):
    import numpy as np

    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)


class RMSNorm(nn.Module):
    def __init__(self, weight: Weight, eps: float, device):
        super().__init__()
        self.weight = torch.from_numpy(weight.to_dense()).to(device=device, dtype=torch.float32)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x * rsqrt(mean(x^2) + eps) * weight over the last dimension.

        float32 (CPU): the same operations as torch's composite ``F.rms_norm`` in
        the same order (bit-identical), written with in-place steps: about half
        of its per-call time, which matters at one token per step.
        """
        if x.dtype != torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        r = x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return (x * r).mul_(self.weight)


def rope_inv_freq(config: ModelConfig, factors: Weight | None = None) -> torch.Tensor:
    """[head_dim/2] float32 inverse frequencies, with linear, llama3 or yarn scaling.

    ``factors``: llama.cpp's ``rope_freqs.weight`` ([head_dim/2] float32, what its converter writes
    for llama 3's scaling): each frequency is divided by its factor, as llama.cpp's ``freq_factors``.

    Raises:
        ValueError: factors of another length than head_dim/2.
    """
    d = config.head_dim
    inv = 1.0 / (config.rope_freq_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if factors is not None:
        f = torch.from_numpy(factors.to_dense()).reshape(-1).double()
        if f.shape[0] != d // 2:
            raise ValueError(f"rope_freqs.weight has {f.shape[0]} factors, head_dim/2 is {d // 2}")
        inv = inv / f
    sc = config.rope_scaling
    if sc and sc.get("type") == "linear" and sc.get("factor", 1.0) != 1.0:
        inv = inv / sc["factor"]
    elif sc and sc.get("type") == "llama3":
        factor = sc.get("factor", 8.0)
        low, high = sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old_ctx = sc.get("original_context_length") or 8192
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif sc and sc.get("type") == "yarn":
        inv = yarn_inv_freq(inv, sc, d, config.rope_freq_base)
    return inv.to(torch.float32)


def yarn_inv_freq(inv: torch.Tensor, sc: dict, dim: int, base: float) -> torch.Tensor:
    """YaRN's frequencies (transformers' ``_compute_yarn_parameters``, llama.cpp's
    ``rope_yarn``): dims that turn fewer than ``beta_slow`` times over the original context are
    interpolated (divided by ``factor``), those turning more than ``beta_fast`` times kept, a
    linear ramp between (bounds floored / ceiled unless ``truncate`` is False).

    ``inv``: [dim/2] the unscaled inverse frequencies; ``sc``: the scaling dict (``factor``,
    ``original_context_length``, optional ``beta_fast`` 32, ``beta_slow`` 1, ``truncate``)."""
    factor = float(sc["factor"])
    orig = float(sc["original_context_length"])
    fast, slow = float(sc.get("beta_fast") or 32), float(sc.get("beta_slow") or 1)

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(fast), corr_dim(slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: interpolate
    return inv / factor * (1 - extrapolation) + inv * extrapolation


def rope_attention_factor(config: ModelConfig) -> float:
    """The scale of cos/sin (so of q.k: its square): YaRN's ``attention_factor``, else
    0.1 ln(factor) + 1 (with ``mscale`` / ``mscale_all_dim``: their ratio, as transformers);
    1.0 for every other RoPE."""
    sc = config.rope_scaling
    if not sc or sc.get("type") != "yarn":
        return 1.0
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    factor = float(sc["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if sc.get("mscale") and sc.get("mscale_all_dim"):
        return mscale(float(sc["mscale"])) / mscale(float(sc["mscale_all_dim"]))
    return mscale()


class LlamaModel(nn.Module):
    """Decoder-only llama-family transformer over a paged KV cache.

    Args:
        config: ModelConfig.
        weights: dict of Weight by GGUF tensor name (Q/K rows in interleaved-pair order).
        dtype: dense weight dtype (torch.float32 / bfloat16 / float16).
        device: torch device.
        kernel, small_max_rows, large_dtype: small-batch kernel of every
            projection and of the output head, the rows up to which it is used
            and the dtype of the dense copy used above that (see Linear).
        native_q4: keep the projections' 4-bit weights for kvserve's own
            4-bit kernel too (see Linear; built by CompiledDecode); "decode": for the
            native decode step only, packed when it asks (Linear.native_weights).
        max_positions: size of the RoPE tables (tokens).
    """

    def __init__(self, config: ModelConfig, weights: dict[str, Weight], dtype=torch.float32, device="cpu",
                 kernel: str = "dense", small_max_rows: int = 0, max_positions: int = 8192,
                 large_dtype=torch.float32, native_q4: bool | str = False):
        super().__init__()
        self.config = config
        self.device = torch.device(device)
        self.compute_dtype = torch.float32 if self.device.type == "cpu" else dtype
        c = config
        emb = weights["token_embd.weight"]
        #: the embedding table [V, E] as GGUF blocks (a view of the file's mapping; rows dequantized
        #: by embed()) on CPU when the file's type stays raw, else None and tok_embd is dense
        self.tok_embd_raw: Weight | None = emb if emb.raw is not None and self.device.type == "cpu" else None
        self.tok_embd: torch.Tensor | None = None
        if self.tok_embd_raw is None:
            self.tok_embd = torch.from_numpy(emb.to_dense()).to(device=device, dtype=self.compute_dtype)
        self.layers = nn.ModuleList()
        lin = dict(dtype=dtype, device=device, kernel=kernel, small_max_rows=small_max_rows, large_dtype=large_dtype,
                   native_q4=native_q4)
        for i in range(c.n_layer):
            p = f"blk.{i}."
            layer = nn.Module()
            layer.attn_norm = RMSNorm(weights[p + "attn_norm.weight"], c.rms_eps, device)
            bias = [weights[p + f"attn_{x}.bias"] for x in "qkv"] if c.qkv_bias else None
            layer.wqkv = Linear([weights[p + f"attn_{x}.weight"] for x in "qkv"], bias, **lin)
            # qwen3: per-head RMSNorm of q and k before RoPE (weights [head_dim], pair order)
            layer.q_norm = RMSNorm(weights[p + "attn_q_norm.weight"], c.rms_eps, device) if c.qk_norm else None
            layer.k_norm = RMSNorm(weights[p + "attn_k_norm.weight"], c.rms_eps, device) if c.qk_norm else None
            layer.wo = Linear([weights[p + "attn_output.weight"]], _biases(weights, p, c.attn_bias, "attn_output"),
                              **lin)
            layer.ffn_norm = RMSNorm(weights[p + "ffn_norm.weight"], c.rms_eps, device)
            layer.moe = layer.w_gate_up = layer.w_down = None
            if getattr(c, "is_moe", None) is not None and c.is_moe(i):  # a mixture of experts (kvserve.models.moe)
                from kvserve.models.moe import build_moe

                layer.moe = build_moe(c, weights, i, device, lin)
            else:
                layer.w_gate_up = Linear([weights[p + "ffn_gate.weight"], weights[p + "ffn_up.weight"]],
                                         _biases(weights, p, c.mlp_bias, "ffn_gate", "ffn_up"), **lin)
                layer.w_down = Linear([weights[p + "ffn_down.weight"]], _biases(weights, p, c.mlp_bias, "ffn_down"),
                                      **lin)
            self.layers.append(layer)
        self.output_norm = RMSNorm(weights["output_norm.weight"], c.rms_eps, device)
        # tied embeddings: the head is token_embd.weight (its own copy, in the head's formats)
        head = weights["token_embd.weight"] if c.tie_embeddings or "output.weight" not in weights \
            else weights["output.weight"]
        # the head's dense copy stays float32: bfloat16 logits (steps with many logits rows:
        # prompt logprobs, many sequences finishing a prefill together) would tie
        self.output = Linear([head], None, dtype=dtype, device=device, tied=head is emb,
                             kernel=auto_head_kernel() if kernel == "auto" else kernel, small_max_rows=small_max_rows)
        w = self.output.weight
        if head is emb and w is not None and self.tok_embd is not None and w.dtype == self.tok_embd.dtype:
            self.output.weight = self.tok_embd  # tied: one dense copy of the embedding, not two
        elif head is emb and w is not None and w.dtype == torch.float32 and tuple(w.shape) == tuple(emb.shape):
            self.tok_embd, self.tok_embd_raw = w, None  # the head dequantized its blocks: look up in that copy
        inv = rope_inv_freq(c, weights.get("rope_freqs.weight"))
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv.double())  # [P, D/2]
        mag = torch.full_like(freqs, rope_attention_factor(c))  # YaRN scales cos/sin; 1 otherwise
        self.rope_cis = torch.polar(mag, freqs).to(torch.complex64).to(device)  # [P, D/2]
        # the same rotation as real tables, for the compiled decode graph (inductor has no complex numbers)
        self.rope_cos = self.rope_cis.real.contiguous()
        self.rope_sin = self.rope_cis.imag.contiguous()
        self.q_size = c.n_head * c.head_dim
        self.kv_size = c.n_head_kv * c.head_dim
        # [P] float32 per-position query scale after RoPE (mistral3's attention temperature), or None
        self.q_scale: torch.Tensor | None = None
        self.scale = 1.0 / math.sqrt(c.head_dim)

    def projections(self) -> list[Linear]:
        """Every layer's projections (qkv, output, gate|up, down), in layer order."""
        return [lin for layer in self.layers for lin in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)
                if lin is not None]

    # -- pieces -------------------------------------------------------------

    def _attention(self, q, k, v, k_cache, v_cache, batch: AttentionBatch) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] (already written to the cache) -> [T, H*D]."""
        c = self.config
        T = q.shape[0]
        nd = batch.n_decode
        if nd == T:  # decode-only step: the attention output is the result, no scatter into a buffer
            return self._decode_attention(q, k_cache, v_cache, batch).reshape(T, -1)
        out = torch.empty(T, c.n_head, c.head_dim, dtype=q.dtype, device=q.device)
        if nd:
            out[:nd] = self._decode_attention(q[:nd], k_cache, v_cache, batch)
        for g in batch.prefills:
            qp = q[g.start:g.end].transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
            if g.kv_index is None:
                # the chunk's own K/V, rounded like the cache stores them, so results do
                # not depend on whether a prefix came from the cache or from this chunk
                kp = kv_round(k_cache, k[g.start:g.end], q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, Lq, D]
                vp = kv_round(v_cache, v[g.start:g.end], q.dtype).transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=self.scale, enable_gqa=True)
            elif g.per_row:
                out[g.start:g.end] = self._per_row_attention(q[g.start:g.end], k_cache, v_cache, g)
                continue
            else:
                kp = kv_gather(k_cache, g.kv_index, q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, Lk, D]
                vp = kv_gather(v_cache, g.kv_index, q.dtype).transpose(0, 1).unsqueeze(0)
                if g.end - g.start <= self.GROUPED_QUERY_MAX:
                    mask = g.grouped_mask(c.n_head // c.n_head_kv, q.dtype)
                    out[g.start:g.end] = self._grouped_attention(q[g.start:g.end], kp, vp, mask)
                    continue
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=g.mask(), scale=self.scale, enable_gqa=True)
            out[g.start:g.end] = o.squeeze(0).transpose(0, 1)
        return out.reshape(T, -1)

    #: prompt chunks over a cached prefix with at most this many tokens use _grouped_attention
    GROUPED_QUERY_MAX = 16

    def _grouped_attention(self, q, kp, vp, mask) -> torch.Tensor:
        """q: [R, H, D] queries of one sequence over its cached rows kp/vp ([1, Hkv, Lk, D],
        mask [1, 1, H/Hkv * R, Lk] additive, see PrefillGroup.grouped_mask) -> [R, H, D].

        The query heads that share a KV head become rows of one SDPA query
        ([1, Hkv, G * R, D]), so K and V are read once per KV head; SDPA's
        ``enable_gqa`` on CPU is several times slower for a few queries over many
        keys. Measured (SmolLM2 shapes, 30 layers, 1,500 cached rows): 3 queries
        27.9 -> 12.5 ms, 2 queries 22.2 -> 13.8 ms; equal from about 64 queries on.
        """
        r, h, d = q.shape
        hkv = kp.shape[1]
        g = h // hkv
        qg = q.view(r, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * r, d)
        o = F.scaled_dot_product_attention(qg, kp, vp, attn_mask=mask, scale=self.scale)  # [1, Hkv, G * R, D]
        return o.view(hkv, g, r, d).permute(2, 0, 1, 3).reshape(r, h, d)

    def _per_row_attention(self, q, k_cache, v_cache, g: PrefillGroup) -> torch.Tensor:
        """q: [R, H, D], the queries of a verification chunk (see PrefillGroup.per_row) -> [R, H, D].

        Query i reads rows [0, n_past + i + 1): the same tensors (values, shapes and
        strides) and the same SDPA call as :meth:`_attend_rows` for one decode query, so
        the result does not depend on how many positions were verified together."""
        kp = kv_gather(k_cache, g.kv_index, q.dtype)  # [Lk, Hkv, D], contiguous
        vp = kv_gather(v_cache, g.kv_index, q.dtype)
        out = torch.empty_like(q)
        for i in range(q.shape[0]):
            n = g.n_past + i + 1
            kd = kp[:n].unsqueeze(0).transpose(1, 2)  # [1, Hkv, n, D]
            vd = vp[:n].unsqueeze(0).transpose(1, 2)
            o = F.scaled_dot_product_attention(q[i: i + 1].unsqueeze(2), kd, vd, scale=self.scale, enable_gqa=True)
            out[i] = o[0, :, 0]
        return out

    def _decode_attention(self, qd, k_cache, v_cache, batch: AttentionBatch) -> torch.Tensor:
        """qd: [B, H, D], the single-token queries -> [B, H, D] over each one's cached rows."""
        idx = batch.decode_kv_index  # [B, L]
        return self._attend_rows(qd, k_cache, v_cache, idx.view(-1), idx.shape[1], batch.decode_mask)

    def _attend_rows(self, qd, k_cache, v_cache, flat, L: int, mask) -> torch.Tensor:
        """qd: [B, H, D] single-token queries over cache rows ``flat`` ([B * L] long,
        each query's L rows in turn; mask [B, 1, 1, L] bool or None) -> [B, H, D]."""
        B = qd.shape[0]
        # index_select on the flat index: a row copy per index, several times faster on CPU
        # than advanced indexing with a 2-D index (same values)
        kd = kv_gather(k_cache, flat, qd.dtype).view(B, L, *k_cache.shape[1:]).transpose(1, 2)  # [B, Hkv, L, D]
        vd = kv_gather(v_cache, flat, qd.dtype).view(B, L, *v_cache.shape[1:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(qd.unsqueeze(2), kd, vd, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o.squeeze(2)

    def _attend_rows_fused(self, qd, k_cache, v_cache, flat, L: int, mask) -> torch.Tensor:
        """The same as :meth:`_attend_rows`, written as plain reductions for inductor -> [B, H * D].

        Scores are ``sum_d q * K[flat]`` over the cache rows in place (the gather and
        the float32 cast fuse into the dot product: no [B, Hkv, L, D] float32 copy of K
        or V), the softmax runs over L, and the output is ``sum_l p * V[flat]``. Eagerly
        this would materialize [B, L, Hkv, H/Hkv, D] products; compiled it is about 40%
        faster than SDPA on CPU (SmolLM2 shapes, 2-core EPYC, 30 layers: one query over
        1,500 rows 12.4 -> 7.5 ms, 16 queries over 150 rows 9.0 -> 5.6 ms), where SDPA's
        small-M GEMMs run at 10-20 GFLOP/s.
        """
        B = qd.shape[0]
        hkv, hd = k_cache.shape[1], k_cache.shape[2]
        g = qd.shape[1] // hkv  # query heads per KV head (GQA: head h reads KV head h // g)
        kd = _rows_fused(k_cache, flat, (B, L, hkv, 1, hd), qd.dtype)
        s = (kd * qd.view(B, 1, hkv, g, hd)).sum(-1) * self.scale  # [B, L, Hkv, G]
        s = s.masked_fill(~mask.view(B, L, 1, 1), float("-inf"))
        p = torch.softmax(s, dim=1)
        vd = _rows_fused(v_cache, flat, (B, L, hkv, 1, hd), qd.dtype)
        return (p.unsqueeze(-1) * vd).sum(1).reshape(B, hkv * g * hd)  # [B, Hkv, G, D] -> [B, H * D]

    # -- forward -------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the token embedding: input_ids [T] long -> [T, E] in the compute dtype (a new
        tensor). A GGUF table kept as blocks (``tok_embd_raw``) has only these rows dequantized
        (gguf's values, as the dense table would hold); ids out of range raise IndexError."""
        if self.tok_embd is not None:
            return self.tok_embd.index_select(0, input_ids)
        ids = input_ids.cpu().numpy()
        n = self.tok_embd_raw.shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            raise IndexError(f"token id out of range [0, {n})")
        return torch.from_numpy(self.tok_embd_raw.dense_rows(ids))

    def embedding_nbytes(self) -> int:
        """Bytes the embedding table holds that no other part of the model does: the dense table,
        or the GGUF blocks unless the tied head multiplies the same blocks (0 then)."""
        if self.tok_embd is not None:
            return self.tok_embd.nbytes
        raw = np.asarray(self.tok_embd_raw.raw)
        blocks = getattr(self.output, "blocks", None)
        if blocks is not None and any(p.ctypes.data == raw.ctypes.data for p in blocks.parts):
            return 0
        return raw.nbytes

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                logits_indices: torch.Tensor | None, return_hidden: bool = False,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run the flat batch; return float32 logits [len(logits_indices), n_vocab].

        input_ids: [T] long; kv_caches: per layer (k_cache, v_cache), each
        [n_cache_rows, n_head_kv, head_dim]: a float tensor, or a quantized
        ``kv_quant.QuantKV`` (written with kv_write, read back dequantized to the
        activations' dtype); logits_indices: rows of the batch that need logits
        (None = all rows).

        The layer loop calls the submodules' ``forward`` directly (no nn.Module
        hooks: at one token per step the Python per call is a visible share of
        the step) and rotates q/k in place inside the fused qkv output.

        Pipeline stages (kvserve.engine.parallel): ``hidden`` ([T, E], the previous stage's
        output) replaces the embedding lookup; a model without ``output_norm`` (a stage that
        is not the last) returns its layers' output [T, E] for every row.
        """
        c = self.config
        T = input_ids.shape[0]
        x = self.embed(input_ids) if hidden is None else hidden  # [T, E]: the residual adds below are in place
        cis = self.rope_cis[batch.positions].unsqueeze(1)  # [T, 1, D/2]
        q_scale = None if self.q_scale is None else self.q_scale[batch.positions].view(T, 1, 1)
        slots = batch.slot_mapping
        nq, nkv, hd = c.n_head, c.n_head_kv, c.head_dim
        qs, qks = self.q_size, self.q_size + self.kv_size
        attention = self._attention
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h = layer.attn_norm.forward(x)
            qkv = layer.wqkv.forward(h)  # [T, (H + 2 Hkv) D], a fresh tensor
            if layer.q_norm is not None:  # per-head RMSNorm of q and k, before RoPE
                qkv[:, :qs] = layer.q_norm.forward(qkv[:, :qs].view(T, nq, hd)).view(T, qs)
                qkv[:, qs:qks] = layer.k_norm.forward(qkv[:, qs:qks].view(T, nkv, hd)).view(T, qks - qs)
            # RoPE on the q|k part, in place: pairs (2i, 2i+1) as complex numbers times cis
            torch.view_as_complex(qkv[:, :qks].view(T, nq + nkv, hd // 2, 2)).mul_(cis)
            q = qkv[:, :qs].view(T, nq, hd)
            if q_scale is not None:
                q.mul_(q_scale)
            k = qkv[:, qs:qks].view(T, nkv, hd)
            v = qkv[:, qks:].view(T, nkv, hd)
            kv_write(k_cache, slots, k)
            kv_write(v_cache, slots, v)
            x.add_(layer.wo.forward(attention(q, k, v, k_cache, v_cache, batch)))
            if layer.moe is not None:
                x.add_(layer.moe.forward(layer.ffn_norm.forward(x)))
                continue
            gate, up = layer.w_gate_up.forward(layer.ffn_norm.forward(x)).chunk(2, dim=-1)
            x.add_(layer.w_down.forward(F.silu(gate).mul_(up)))
        if self.output_norm is None:
            return x
        if logits_indices is not None:
            x = x[logits_indices]
        x = self.output_norm.forward(x)
        if return_hidden:
            return x
        return self.output.forward(x).float()

    # -- the decode-only graph (torch.compile) ---------------------------------------

    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                    kv_index: torch.Tensor, kv_mask: torch.Tensor,
                    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One step of B single-token decodes -> float32 logits [B, n_vocab].

        input_ids, positions, slot_mapping: [B] long; kv_index: [B * L] long, the
        cache rows each query reads, flattened (padded with row 0); kv_mask:
        [B, 1, 1, L] bool, True where a row is valid (always given, so one graph
        serves padded and unpadded steps). The same computation as :meth:`forward` for a
        decode-only batch, written for ``torch.compile`` (see
        :class:`CompiledDecode`): RoPE with real cos/sin tables instead of a
        complex multiply, no in-place updates of intermediates. Results agree
        with forward to float rounding, not bit for bit.
        """
        c = self.config
        B, L = kv_mask.shape[0], kv_mask.shape[-1]
        nq, nkv, hd = c.n_head, c.n_head_kv, c.head_dim
        nqk = (nq + nkv) * hd
        x = self.embed(input_ids)
        cos = self.rope_cos[positions].view(B, 1, hd // 2)
        sin = self.rope_sin[positions].view(B, 1, hd // 2)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            qkv = layer.wqkv.forward(layer.attn_norm.forward(x))
            if layer.q_norm is not None:
                qkv = torch.cat([layer.q_norm.forward(qkv[:, :nq * hd].view(B, nq, hd)).view(B, -1),
                                 layer.k_norm.forward(qkv[:, nq * hd:nqk].view(B, nkv, hd)).view(B, -1),
                                 qkv[:, nqk:]], dim=-1)
            pairs = qkv[:, :nqk].view(B, nq + nkv, hd // 2, 2)
            a, b = pairs[..., 0], pairs[..., 1]
            qk = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).view(B, nq + nkv, hd)
            q, k = qk[:, :nq], qk[:, nq:]
            if self.q_scale is not None:
                q = q * self.q_scale[positions].view(B, 1, 1)
            v = qkv[:, nqk:].view(B, nkv, hd)
            kv_write(k_cache, slot_mapping, k)
            kv_write(v_cache, slot_mapping, v)
            o = self._attend_rows_fused(q, k_cache, v_cache, kv_index, L, kv_mask)
            x = x + layer.wo.forward(o)
            if layer.moe is not None:
                x = x + layer.moe.forward(layer.ffn_norm.forward(x))
                continue
            gate, up = layer.w_gate_up.forward(layer.ffn_norm.forward(x)).chunk(2, dim=-1)
            x = x + layer.w_down.forward(F.silu(gate) * up)
        return self.output.forward(self.output_norm.forward(x)).float()


def _rows_fused(cache, flat: torch.Tensor, shape: tuple[int, ...], dtype) -> torch.Tensor:
    """Cache rows ``flat`` viewed as ``shape``, in ``dtype``, for the compiled graph: a float cache by
    advanced indexing (the gather and cast fuse into the consumer), a quantized one dequantized
    (kv_quant.QuantKV.gather)."""
    if isinstance(cache, QuantKV):
        return cache.gather(flat, dtype).view(shape)
    return cache[flat].view(shape).to(dtype)


def _dummy_cache(like, rows: int):
    """A zeroed cache of ``like``'s type and heads with ``rows`` rows (the compile warm-up's)."""
    if isinstance(like, QuantKV):
        return like.empty_like(rows)
    return torch.zeros(rows, *like.shape[1:], dtype=like.dtype, device=like.device)


class CompiledDecode:
    """``torch.compile`` of :meth:`LlamaModel.decode_step`, built in a background thread.

    The engine serves eagerly until the graphs are ready, then runs decode-only
    steps of at most :attr:`max_batch` rows through them: one fused C++ kernel
    where eager torch runs a dozen small ops (norms, RoPE, residual adds, dtype
    casts), so less time goes to per-op overhead. A step no warmed-up graph
    accepts runs eagerly (``fail_on_recompile``: no tracing while serving).
    Measured on SmolLM2 Q4_1, 2-core EPYC, model step alone: one stream 53 ->
    75 tok/s, 4 streams 159 -> 261, 16 streams 254 -> 404. Compiling costs
    about 90 s of CPU the first time (two graphs: B = 1, which torch specializes,
    and B >= 2 with dynamic shapes); the compiled artifacts are cached on disk
    (``TORCHINDUCTOR_CACHE_DIR``, default ``$KVSERVE_HOME/inductor``), so later
    starts take about 20-25 s. Needs a C++ compiler; without one, or on any
    compile error, the error is logged and the engine stays eager.

    Args:
        model: the LlamaModel.
        kv_like: one layer's (k_cache, v_cache), for the dummy caches of the warm-up.
        max_rows: the most rows of a decode-only step (sequences times the rows a
            short prompt chunk may add, see ModelRunner.DECODE_LIKE_MAX).
    """

    def __init__(self, model: LlamaModel, kv_like: tuple[torch.Tensor, torch.Tensor], max_rows: int):
        if model.tok_embd is None and model.tok_embd_raw is not None:
            # the graph cannot trace the numpy row lookup of a table kept as GGUF blocks (dynamo's
            # guards fail on tensors made from numpy): --compile keeps a dense table, as before
            model.tok_embd = torch.from_numpy(model.tok_embd_raw.to_dense()).to(model.compute_dtype)
        self.model = model
        self.fn = None
        self.error: str | None = None
        self.seconds: float | None = None
        self._kv_like = kv_like
        self._max_rows = max(1, max_rows)
        self._thread = None
        self.calls = 0  # compiled steps run
        self.fallbacks = 0  # steps that would have needed a new graph: run eagerly instead
        # Linear picks its kernel by row count (a dense copy above small_max_rows), so
        # larger steps would need another graph: those stay eager
        split = [lin.small_max_rows for lin in [*model.projections(), model.output]
                 if lin.kernel != "dense" and (lin.weight is not None or getattr(lin, "large_blocks", None) is not None)
                 and lin.small_max_rows > 0]
        self.max_batch = min(split) if split else 1 << 30

    def start(self) -> None:
        """Compile in a daemon thread; :attr:`ready` turns True when done."""
        import os
        import threading
        import warnings

        if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            from kvserve.store.blobs import kvserve_home

            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(kvserve_home() / "inductor")
        warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed")  # inductor's codegen note
        self._thread = threading.Thread(target=self._build, name="kvserve-compile", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the compile ended (ready or failed); True when ready."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.ready

    @property
    def ready(self) -> bool:
        return self.fn is not None

    def _build(self) -> None:
        import logging
        import time

        log = logging.getLogger("kvserve.engine")
        t0 = time.perf_counter()
        self._build_q4_kernel(log)
        try:
            fn = torch.compile(self.model.decode_step, dynamic=True)
            k, v = self._kv_like
            # warm-up sizes that equal no model dimension (head_dim, n_head_kv...): torch
            # gives equal sizes one symbol, which would pin the cache rows or L to a constant
            # and recompile on the first real step
            rows, L = 97, 7
            dummy = [(_dummy_cache(k, rows), _dummy_cache(v, rows)) for _ in self.model.layers]
            dev = self.model.device
            # B = 1 is specialized and B >= 2 shares a dynamic graph, warmed up with B = 11
            # (no model dimension is 11); with fewer rows, each B (a small B may equal a
            # model dimension and be pinned; the others reuse the dynamic graph)
            cap = min(self._max_rows, self.max_batch)
            for b in (1, 11) if cap >= 11 else range(1, cap + 1):
                ids = torch.zeros(b, dtype=torch.long, device=dev)
                pos = torch.full((b,), L - 1, dtype=torch.long, device=dev)
                slots = torch.arange(b, device=dev) + 40
                idx = torch.arange(L, device=dev).repeat(b)
                mask = torch.ones(b, 1, 1, L, dtype=torch.bool, device=dev)
                with torch.inference_mode():
                    fn(ids, pos, slots, idx, mask, dummy)
            self.seconds = time.perf_counter() - t0
            self.fn = fn
            log.info("compiled the decode step in %.1f s", self.seconds)
        except Exception as e:  # noqa: BLE001 - any compile failure leaves the engine eager
            self.error = f"{type(e).__name__}: {e}"
            log.warning("torch.compile of the decode step failed, serving eagerly: %s", self.error)

    def _build_q4_kernel(self, log) -> None:
        """Build kvserve's 4-bit kernel when the model kept weights for it (before tracing,
        so the graph calls it); on failure, log, drop those weights, stay on torch's."""
        linears = [lin for lin in self.model.projections() if lin.q4w is not None]
        if not linears:
            return
        try:
            q4_kernel.build()
            log.info("built the native q4 kernel")
        except Exception as e:  # noqa: BLE001 - torch's int4 kernel stays in use
            log.warning("native q4 kernel not available, using torch's int4 kernel: %s", e)
            for lin in linears:
                lin.q4w = None

    def __call__(self, input_ids, positions, slot_mapping, kv_index, kv_mask, kv_caches) -> torch.Tensor | None:
        """Run the compiled graph (only once :attr:`ready`); None when the inputs match no
        warmed-up graph: tracing one now would stall the engine for tens of seconds
        (``fail_on_recompile``), so the caller runs that step eagerly."""
        try:
            with torch.inference_mode(), torch.compiler.set_stance("fail_on_recompile"):
                out = self.fn(input_ids, positions, slot_mapping, kv_index, kv_mask, kv_caches)
        except Exception:  # noqa: BLE001 - a guard miss (or any graph failure): eager for this step
            self.fallbacks += 1
            return None
        self.calls += 1
        return out
