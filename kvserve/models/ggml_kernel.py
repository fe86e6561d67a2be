"""Products with GGUF weights as the file stores them: the ``ggml`` submodule of kvserve's CPU extension (``ggml_cpu.cpp``).

``y[M, N] = x[M, K] @ W[N, K]^T`` (float32 in, float32 out) where W is the tensor's bytes exactly
as the GGUF holds them (a view of the file's mapping: no copy, so the weights' memory is the page
cache, shared by every process that maps the file). Activations are quantized as llama.cpp does
for each type: int8 per block of 32 (q8_0) for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL and MXFP4;
llama.cpp's q8_K (int8 per block of 256, a float32 scale, sums of 16) for Q2_K..Q6_K and IQ4_XS;
F16 and BF16 rows are widened to float32 and multiplied with the float32 activations. Row i of an
M-row product equals the one-row product bit for bit (see ggml_cpu.cpp).

Small batches (the batched decode step, speculative verification: 6 rows or more, below
``gemm_min_rows``) of matrices made only of Q4_K / Q5_K / Q6_K parts take a small-batch path in
AVX512-VNNI builds: groups of 32 weight rows unpacked into a per-thread panel (as the int8 prefill
path does) and multiplied with every activation row by ``vpdpbusd``, each super-block's sums kept
exact in int32 and added into the output in the per-row kernels' float order, so each row is still
the one-row product bit for bit (about 2x the per-row kernels at 16 rows on one Zen 4 core). Matrices
of Q5_0 / IQ4_NL / MXFP4 parts (alone or with those K-quants) take the same route from 2 rows:
``panel32`` in ggml_gemm8.h keeps the per-row kernel's 8 float lanes per output (two weight rows per
512-bit vector), the one-row bits again.

Q8_0 in AVX512-VNNI builds has one arithmetic at every row count and on every route (ggml_gemm8.h:
``q80_x8`` for one row, ``q80_rows`` for 2+, ``kern32`` for prefill): per output one float32 chain
over the blocks in order, ``y = fma(float(S), d_w * d_x, y)`` from 0, S the block's exact integer
sum. So its batched decode rows, its one-row products and its prefill rows all agree bit for bit.
One row reads 8 weight rows at a time from the file's blocks (about 24 GB/s from memory at one
thread on the 1B shapes, against dot32's 20-21); 2+ rows put 16 weight rows in the lanes of a
transposed 2-block tile, an eighth of dot32's float work per value (the 1B Q8_0 step's products at
16 rows and one thread: about 205 ms against 315). In the AVX2 build Q8_0 keeps dot32 (8 float lanes
per output, then a horizontal sum) at every row count.
``mm(x, 0, "rows")`` on :attr:`BlockMatrix.matrix` runs the per-row kernels alone (tests, benchmarks).

Prefill-sized products (``BlockMatrix.gemm_min_rows``: at least that many rows) take one of two other
paths, picked by ``BlockMatrix.gemm_path``, where the build has them (:func:`prefill_paths`): the int8
one in every AVX512-VNNI build (``mod.GEMM8 == "avx512vnni"``), the bfloat16 one where the CPU also has
AVX512-BF16 (``mod.GEMM == "avx512bf16"``):

* the int8 path (``ggml_gemm8.h``; "auto" takes it where every part's type has it: all of
  :data:`TYPES` but F16 and BF16): llama.cpp's arithmetic, as the per-row kernels (the same q8_0 /
  q8_K activations, exact integer sums per block / super-block, float scaling per block) with the
  float sums in another order (a few float32 ulps from the per-row kernels; Q8_0's and Q4_K's in the
  same order: the same bits as decode, see above); groups of 32 weight rows
  unpacked from the file's blocks into a per-thread buffer (K x 32 bytes), AVX512-VNNI vpdpbusd.
  About 1.3-1.6x the bfloat16 path at 512 rows on one Zen 4 core (``benchmarks/prefill_gemm.py``);
* the bfloat16 path (``ggml_gemm.h``; "auto" for BF16 rows, or ``gemm_path = "bf16"``):
  activations rounded to bfloat16 (a copy of x in tiles, M x K x 2 bytes), groups of up to 48 weight
  rows dequantized from the file's blocks to bfloat16 into a per-thread buffer (at most 768 KiB, at
  K = 8192), float32 sums of vdpbf16ps products. Its numerics differ from the per-row kernels' q8
  rounding (about bfloat16's 2^-9 on each operand, no block-wise quantization of x).

On either path row i of a product is the same whatever the other rows are. Elsewhere (AVX2, AVX512
without VNNI) every row count runs the per-row kernels.

Built as part of kvserve's one CPU extension (:mod:`kvserve.models.decode_native`: the ``ggml``
submodule of the native decode step's build, which composes its projections from these products):
``-march=native`` (or ``$KVSERVE_NATIVE_MARCH``), an AVX512-VNNI build or an AVX2 + FMA + F16C build,
cached under ``$KVSERVE_EXTENSIONS_DIR/cpu_<key>``. :func:`ensure_built` builds it in a child
process (a minute or two of one core the first time) and is what the model loader calls: the
packed weights need the kernel from the first product on. ``KVSERVE_GGML_KERNELS=0`` turns it off
(weights dequantized at load, as before).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from kvserve.models import decode_native


#: ggml type names with a kernel here, in the order of ``gguf.GGMLQuantizationType``
TYPES = ("F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
         "IQ4_XS", "BF16", "MXFP4")
#: the types the int8 prefill path takes (ggml_gemm8.h)
INT8_TYPES = tuple(t for t in TYPES if t not in ("F16", "BF16"))


def enabled() -> bool:
    """False when ``KVSERVE_GGML_KERNELS=0`` or where the extension cannot be built (CPU, compiler)."""
    return os.environ.get("KVSERVE_GGML_KERNELS", "1") != "0" and decode_native.unavailable_reason() is None


#: /proc/cpuinfo flags the int8 prefill path's build needs (ggml_gemm8.h: AVX512-VNNI; Cascade Lake,
#: Ice Lake, Sapphire Rapids, Zen 4 ...) and the bfloat16 one's (ggml_gemm.h: also AVX512-BF16)
INT8_PREFILL_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
BF16_PREFILL_FLAGS = INT8_PREFILL_FLAGS | {"avx512_bf16"}


def repack_q4_0() -> bool:
    """Whether model families ask :class:`BlockMatrix` to repack Q4_0 parts (``repack``):
    KVSERVE_Q4_0_REPACK=1 / 0 (default 1: on, AVX512-VNNI builds)."""
    return os.environ.get("KVSERVE_Q4_0_REPACK", "1").strip().lower() in ("1", "true", "on", "yes")


def prefill_paths(flags=None) -> tuple[str, ...]:
    """The prefill paths the build made here has, by what each needs of the CPU: ("int8", "bf16") with
    AVX512-VNNI and AVX512-BF16, ("int8",) with AVX512-VNNI alone, () elsewhere (AVX2 builds; also
    with the kernels off or ``$KVSERVE_NATIVE_MARCH`` naming another target). For choices made before
    the build is loaded (the model's prefill dtype); once loaded, ``mod.GEMM8`` / ``mod.GEMM`` say.

    Args:
        flags: the CPU's /proc/cpuinfo flags (default: this CPU's, ``q4_kernel.cpu_flags()``).
    """
    from kvserve.models import q4_kernel

    if not enabled() or os.environ.get("KVSERVE_NATIVE_MARCH", "").strip():
        return ()
    have = set(q4_kernel.cpu_flags() if flags is None else flags)
    return tuple(name for name, need in (("int8", INT8_PREFILL_FLAGS), ("bf16", BF16_PREFILL_FLAGS)) if need <= have)


def load_cached():
    """The kernels (the extension's ``ggml`` submodule) if the extension is cached, else None."""
    mod = decode_native.load_cached()
    return None if mod is None else mod.ggml


def ensure_built(nice: int = 0):
    """The kernels (the extension's ``ggml`` submodule: ISA, TYPES, quantize, Matrix), the extension
    built first (in a child process, blocking) when not cached; None where they cannot be used
    (:func:`enabled` False, or the build failed: logged once)."""
    if not enabled():
        return None
    mod = decode_native.ensure_built(nice=nice)
    return None if mod is None else mod.ggml


class BlockMatrix:
    """A weight matrix [N, K] made of row blocks of GGUF bytes (a fused q|k|v or gate|up: the parts
    may differ in type, as a Q4_K_M file's attn_v does), multiplied by :meth:`mm`.

    Args:
        mod: the extension (:func:`ensure_built`).
        parts: (raw, type name) per row block; raw uint8 [rows, row bytes], C-contiguous (a view of
            the file's np.memmap is kept, not copied, and must stay mapped: this object holds it).
        k: input features.
        repack: copy the Q4_0 parts of 16k rows into the kernels' own layout (AVX512-VNNI builds:
            ggml_cpu.cpp's repacked Q4_0, ``q4_repack.h``, one float chain per output), then give the
            resident memory of their file bytes back (:func:`kvserve.loaders.weight_read.give_back`:
            the parts still read the file's bytes, e.g. for :meth:`dequantize`); ignored elsewhere.
        give_back: False keeps the repacked parts' bytes where they are (a tied head: the embedding
            lookup reads them every step, and a file truncated under the server would make that read
            SIGBUS once they are the file's pages again).

    Attributes:
        gemm_path: which prefill path: "auto" (default: int8 where every part's type has it, else
            bfloat16), "int8" or "bf16" (see the module docstring).
        gemm_min_rows: products of at least this many rows run the prefill path (see the module
            docstring) where this build and these types have it; 0 (default) = never.

    Raises:
        ValueError: a type without a kernel, K not a multiple of its block, or rows of the wrong size.
    """

    def __init__(self, mod, parts: list[tuple[np.ndarray, str]], k: int, repack: bool = False,
                 give_back: bool = True):
        self.gemm_min_rows = 0
        self.gemm_path = "auto"
        import gguf

        self.parts = [np.ascontiguousarray(r) for r, _ in parts]  # views stay views when already contiguous
        self.types = [name for _, name in parts]
        types, rows = [], []
        for raw, name in parts:
            qt = gguf.GGMLQuantizationType[name]
            block, nbytes = gguf.GGML_QUANT_SIZES[qt]
            if name not in TYPES or k % block:
                raise ValueError(f"no GGUF block kernel for {name} rows of {k}")
            if raw.ndim != 2 or raw.shape[1] != k // block * nbytes:
                raise ValueError(f"{name} rows of {k} values take {k // block * nbytes} bytes, got {raw.shape}")
            types.append(int(qt))
            rows.append(raw.shape[0])
        self.shape = (sum(rows), k)
        self.nbytes = sum(p.nbytes for p in self.parts)
        self._m = mod.Matrix([p.ctypes.data for p in self.parts], types, rows, k, repack)
        #: per part: True where the kernels read their own repacked copy (``repack``)
        self.repacked = list(self._m.repacked)
        #: bytes of the repacked parts' file pages given back to the kernel
        self.given_back = 0
        if give_back and any(self.repacked):
            from kvserve.loaders import weight_read

            for p, r in zip(self.parts, self.repacked):
                if r:
                    self.given_back += weight_read.give_back(p)

    @property
    def matrix(self):
        """The extension's Matrix (what the native decode step composes its projections from)."""
        return self._m

    @property
    def has_gemm(self) -> bool:
        """True where products of :attr:`gemm_min_rows` rows or more take the prefill path (this build
        has it and every part's type is one it takes)."""
        return bool(self._m.gemm)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 -> [M, N] float32 (see the module docstring for the arithmetic)."""
        return self._m.mm(x, self.gemm_min_rows, self.gemm_path)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: the blocks' values (gguf's dequantization), a new tensor; for callers
        that repack the weights into a layout of their own (the native decode step's head)."""
        from kvserve.loaders.weights import Weight

        k = self.shape[1]
        return torch.from_numpy(np.concatenate(
            [Weight((p.shape[0], k), raw=p, source_type=t).to_dense() for p, t in zip(self.parts, self.types)]))
