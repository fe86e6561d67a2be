"""Native CPU kernel for 4-bit GGUF weights at small batches: ``kvserve::q4_mm``.

torch's ``_weight_int4pack_mm_for_cpu`` unpacks nibbles and multiplies in bfloat16; at one
row (a single decode stream) it is compute-bound at about 10 GB/s of weights per core. This
kernel (``q4_cpu.cpp``) quantizes each activation row to int8 per block of 32, as llama.cpp
does for its Q4_0/Q4_1 dot products, and multiplies with AVX512-VNNI integer dot products.
Measured on SmolLM2's projections (2-core EPYC, 30 layers): one row 4.3 -> 3.2 ms, two
rows 5.0 -> 4.5 ms, but 4 rows 6.4 -> 7.7 ms and 16 rows 22 -> 28 ms (torch's kernel shares
more work across rows). Once built it replaces torch's kernel for every step of up to
``small_batch_rows`` rows, not only one-row steps: a row's result does not depend on the
other rows of its step, so a sequence's tokens do not depend on what else runs with it
(with torch's kernel for some batch sizes and this one for others, they would).

It is built at run time with torch's C++ extension tooling (needs g++ and ninja), only with
``--compile --native-kernels`` (the build joins the background compile: about 30 s the first
time, then cached under ``$KVSERVE_HOME/extensions``), and only on x86-64 CPUs with
AVX512F/BW/VL and AVX512-VNNI. Anywhere else, or if the build fails, torch's kernel is used.
In ``kvserve bench`` runs the whole decode step was within noise of torch's kernel at one
stream and 10-20% slower at 16, so it is opt-in: what it adds is llama.cpp's rounding.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import threading
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("kvserve.engine")

#: True once ``kvserve::q4_mm`` is loaded; Linear uses the kernel only then
READY = False
_lock = threading.Lock()
_REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")


def cpu_flags() -> list[str]:
    """The CPU's feature flags from /proc/cpuinfo on x86-64 Linux (empty elsewhere)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])


def cpu_supported() -> bool:
    """True on x86-64 Linux CPUs with AVX512F, AVX512BW, AVX512VL and AVX512-VNNI."""
    flags = cpu_flags()
    return bool(flags) and all(f in flags for f in _REQUIRED_FLAGS)


def build() -> None:
    """Build (or load the cached build of) the kernel and register ``kvserve::q4_mm``.

    Raises:
        RuntimeError: unsupported CPU or no C++ compiler.
        Exception: whatever torch's extension build raises (compiler errors).
    """
    global READY
    with _lock:
        if READY:
            return
        if not cpu_supported():
            raise RuntimeError("the q4 kernel needs an x86-64 CPU with AVX512-VNNI")
        if shutil.which(os.environ.get("CXX", "c++")) is None and shutil.which("g++") is None:
            raise RuntimeError("the q4 kernel needs a C++ compiler (g++)")
        from torch.utils.cpp_extension import load

        from kvserve.store.blobs import kvserve_home

        tag = torch.__version__.replace("+", "_").replace(".", "_")
        build_dir = kvserve_home() / "extensions" / f"q4_cpu_{tag}"
        build_dir.mkdir(parents=True, exist_ok=True)
        src = Path(__file__).with_name("q4_cpu.cpp")
        load(name="kvserve_q4_cpu", sources=[str(src)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
             build_directory=str(build_dir), is_python_module=False, verbose=False)
        torch.library.register_fake("kvserve::q4_mm")(_fake_q4_mm)
        READY = True


def _fake_q4_mm(x, wq, wd, wm):
    return x.new_empty((x.shape[0], wq.shape[0]))


def pack(q4: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights in the kernel's layout.

    Args:
        q4: uint8 [N, K] values 0..15 (K a multiple of 64); scale, zero: float32 [N, K/32],
            the loader's form w = (q - 8) * scale + zero.

    Returns:
        (wq uint8 [N, K/2] pairs of blocks, d float16 [N, K/32], m float16 [N, K/32]) with
        w = q * d + m; for GGUF Q4_0/Q4_1 d and m are the file's float16 values.
    """
    n, k = q4.shape
    if k % 64:
        raise ValueError(f"the q4 kernel needs a multiple of 64 input features, got {k}")
    p = np.arange(64)
    lane = p // 4
    blk, idx = lane % 2, 4 * (lane // 2) + p % 4
    u = q4.reshape(n, k // 64, 2, 32)[:, :, blk, idx]  # [N, pairs, 64] in lane order
    wq = (u[..., :32] | (u[..., 32:] << 4)).astype(np.uint8).reshape(n, k // 2)
    d = scale.astype(np.float16)
    m = (zero - 8.0 * scale).astype(np.float16)
    return torch.from_numpy(np.ascontiguousarray(wq)), torch.from_numpy(d), torch.from_numpy(m)


def pack_torch(q4: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`pack` with torch ops (they release the GIL: the native decode step packs in a
    background thread while the server starts); the same tensors."""
    n, k = q4.shape
    if k % 64:
        raise ValueError(f"the q4 kernel needs a multiple of 64 input features, got {k}")
    p = torch.arange(64)
    lane = p // 4
    blk, idx = lane % 2, 4 * (lane // 2) + p % 4
    u = torch.from_numpy(q4).view(n, k // 64, 2, 32)[:, :, blk, idx]  # [N, pairs, 64] in lane order
    wq = (u[..., :32] | (u[..., 32:] << 4)).reshape(n, k // 2).contiguous()
    s, z = torch.from_numpy(scale), torch.from_numpy(zero)
    return wq, s.to(torch.float16), (z - 8.0 * s).to(torch.float16)


def pack_tiles(q4: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weights straight in the AVX512 native step's tile layout: the same tensors as
    ``to_tiles(pack_torch(...)[0], "q4")`` and :func:`scales_to_tiles` of its scales, without the
    pair order's gather in between (torch ops: the GIL is released while the server starts).

    Args:
        q4: uint8 [N, K] values 0..15, N a multiple of 16, K of 64; scale, zero: float32 [N, K/32]
            (w = (q - 8) * scale + zero).

    Raises:
        ValueError: N not a multiple of 16 or K not of 64.
    """
    n, k = q4.shape
    if n % 16 or k % 64:
        raise ValueError(f"tiles need rows in 16s and a multiple of 64 input features, got {n} x {k}")
    q = torch.from_numpy(q4).view(n // 16, 16, k // 32, 2, 4, 4)  # [tile, row, block, half, step, byte]
    packed = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # low nibbles values 4 t + j, high 16 + 4 t + j
    wq = packed.permute(0, 2, 3, 1, 4).contiguous().view(n, k // 2)  # [tile, block, step, row, byte]
    s, z = torch.from_numpy(scale), torch.from_numpy(zero)
    return wq, scales_to_tiles(s.to(torch.float16)), scales_to_tiles((z - 8.0 * s).to(torch.float16))


def to_tiles(t: torch.Tensor, kind: str, inverse: bool = False) -> torch.Tensor:
    """Rows in the pair order (uint8 [N, bytes], N a multiple of 16: :func:`pack`'s wq for kind
    "q4", the native head's q8 bytes for "int8") -> the AVX512 native step's tile layout (decode_cpu.cpp,
    LAYOUT "tile16"; a new tensor of the same shape): per tile of 16 rows and block of 32 values,
    4 ("q4") or 8 ("int8") vectors of 16 lanes, lane i the 32-bit word of row i that meets
    activation step t (the pair order's word 2 t + block % 2 of the block's pair). ``inverse``:
    tile layout -> pair order.

    Raises:
        ValueError: N not a multiple of 16, or rows that are not whole pairs of blocks.
    """
    steps = 4 if kind == "q4" else 8
    n, nbytes = t.shape
    if n % 16 or nbytes % (8 * steps):
        raise ValueError(f"tiles need rows in 16s and whole pairs of blocks, got {n} x {nbytes} bytes")
    words = t.contiguous().view(torch.int32)
    pairs = words.shape[1] // (2 * steps)
    if inverse:  # [tile, pair, block, step, row] -> [tile, row, pair, step, block]
        out = words.view(n // 16, pairs, 2, steps, 16).permute(0, 4, 1, 3, 2)
    else:
        out = words.view(n // 16, 16, pairs, steps, 2).permute(0, 2, 4, 3, 1)
    return out.contiguous().view(n, -1).view(t.dtype)


def scales_to_tiles(s: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Per-block scales [N, G] (N a multiple of 16) -> the tile layout's [N / 16, G, 16], flattened
    back to [N, G] (a new tensor); ``inverse``: back to rows."""
    n, g = s.shape
    if inverse:
        return s.view(n // 16, g, 16).transpose(1, 2).contiguous().view(n, g)
    return s.view(n // 16, 16, g).transpose(1, 2).contiguous().view(n, g)


def q4_mm(x: torch.Tensor, wq: torch.Tensor, wd: torch.Tensor, wm: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ packed weights (see :func:`pack`) -> [M, N] float32. Needs :data:`READY`."""
    return torch.ops.kvserve.q4_mm(x, wq, wd, wm)


def reference_q4_mm(x: torch.Tensor, wq: torch.Tensor, wd: torch.Tensor, wm: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in float64 torch (tests): int8 activations per block of 32
    (round half to even, scale max|x| / 127), exact integer dot products, float scales."""
    m_rows, k = x.shape
    n = wq.shape[0]
    p = torch.arange(64)
    lane = p // 4
    blk, idx = lane % 2, 4 * (lane // 2) + p % 4
    pairs = wq.view(n, k // 64, 32)
    u = torch.cat([pairs & 15, pairs >> 4], dim=-1)  # [N, pairs, 64] in lane order
    q = torch.empty(n, k // 64, 2, 32, dtype=torch.float64)
    q[:, :, blk, idx] = u.double()
    q = q.view(n, k // 32, 32)
    xb = x.double().view(m_rows, k // 32, 32)
    dx = xb.float().abs().amax(-1).div(127.0).double()  # float32 scale, as the kernel computes it
    inv = torch.where(dx > 0, 1.0 / dx.float().double(), torch.zeros_like(dx))
    xq = torch.round((x.float().view(m_rows, k // 32, 32) * inv.float()[..., None]).double())
    dots = torch.einsum("rgj,ngj->rng", xq, q)  # exact integers
    d, mm = wd.double(), wm.double()
    return (dots * dx[:, None, :] * d[None] + mm[None] * (dx * xq.sum(-1))[:, None, :]).sum(-1)
