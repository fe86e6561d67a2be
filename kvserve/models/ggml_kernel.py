"""Products with GGUF weights as the file stores them: ``kvserve_ggml_cpu`` (``ggml_cpu.cpp``).

``y[M, N] = x[M, K] @ W[N, K]^T`` (float32 in, float32 out) where W is the tensor's bytes exactly
as the GGUF holds them (a view of the file's mapping: no copy, so the weights' memory is the page
cache, shared by every process that maps the file). Activations are quantized as llama.cpp does
for each type: int8 per block of 32 (q8_0) for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL and MXFP4;
llama.cpp's q8_K (int8 per block of 256, a float32 scale, sums of 16) for Q2_K..Q6_K and IQ4_XS;
F16 and BF16 rows are widened to float32 and multiplied with the float32 activations. Row i of an
M-row product equals the one-row product bit for bit (see ggml_cpu.cpp).

Prefill-sized products (``BlockMatrix.gemm_min_rows``: at least that many rows) take another path
where the build has AVX512-BF16 (``mod.GEMM == "avx512bf16"``) and every part's type is one it
takes (all of :data:`TYPES` but F16; ``ggml_gemm.h``): activations rounded to bfloat16 (a copy of x in
tiles, M x K x 2 bytes), groups of up to 48 weight rows dequantized from the file's blocks to bfloat16
into a per-thread buffer (at most 768 KiB, at K = 8192), float32 sums of vdpbf16ps products. Its numerics differ from the per-row kernels' q8
rounding (about bfloat16's 2^-9 on each operand, no block-wise quantization of x); among its own
products row i is again the same whatever the other rows are. About 2.3x the per-row kernels at
512 rows on one Zen 4 core (``benchmarks/prefill_gemm.py``); elsewhere (AVX2, AVX512 without BF16)
every row count runs the per-row kernels.

Built like the native decode step (:mod:`kvserve.models.decode_native`): torch's C++ extension
tooling, ``-march=native`` (or ``$KVSERVE_NATIVE_MARCH``), an AVX512-VNNI build or an AVX2 + FMA +
F16C build, cached under ``$KVSERVE_EXTENSIONS_DIR/ggml_cpu_<key>`` (default
``$KVSERVE_HOME/extensions``), the key a hash of the sources, the flags, torch's and Python's
versions and the CPU's flags. :func:`ensure_built` builds in a child process (about a minute of one
core the first time) and is what the model loader calls: the packed weights need the kernel from
the first product on. ``KVSERVE_GGML_KERNELS=0`` turns it off (weights dequantized at load, as
before).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from kvserve.models import decode_native

log = logging.getLogger("kvserve.engine")

NAME = "kvserve_ggml_cpu"
_DIR = Path(__file__).resolve().parent
SOURCES = ("ggml_cpu.cpp", "ggml_gemm.h", "thread_pool.h")

#: ggml type names with a kernel here, in the order of ``gguf.GGMLQuantizationType``
TYPES = ("F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
         "IQ4_XS", "BF16", "MXFP4")

_lock = threading.Lock()
_module = None
_build_error: str | None = None


def build_key() -> str:
    """Hash of the sources, the compiler flags, torch's and Python's versions and this CPU's model
    and flags (16 hex)."""
    h = hashlib.sha256()
    for s in SOURCES:
        h.update((_DIR / s).read_bytes())
    h.update(" ".join(decode_native.cflags() + decode_native.LDFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "model name")):
                h.update(line.encode())
                if line.startswith("flags"):
                    break
    except OSError:
        pass
    return h.hexdigest()[:16]


def build_dir() -> Path:
    """``extensions_dir() / ggml_cpu_<build_key>`` (see decode_native.extensions_dir)."""
    return decode_native.extensions_dir() / f"ggml_cpu_{build_key()}"


def enabled() -> bool:
    """False when ``KVSERVE_GGML_KERNELS=0`` or where the extension cannot be built (CPU, compiler)."""
    return os.environ.get("KVSERVE_GGML_KERNELS", "1") != "0" and decode_native.unavailable_reason() is None


def gemm_expected(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True where the build made here has the prefill path (``GEMM``): the kernels on, no
    ``$KVSERVE_NATIVE_MARCH`` (another target), and this CPU's flags include AVX512-BF16 and the
    AVX512-VNNI build's (read from /proc/cpuinfo; for estimates made before the build is loaded)."""
    if not enabled() or os.environ.get("KVSERVE_NATIVE_MARCH", "").strip():
        return False
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return {"avx512_bf16", "avx512_vnni", "avx512bw", "avx512vl"} <= set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return False


def load_cached():
    """The extension if a build of these sources is cached (loaded once), else None."""
    global _module
    with _lock:
        if _module is not None:
            return _module
        so = build_dir() / f"{NAME}.so"
        if not so.exists():
            return None
        loader = importlib.machinery.ExtensionFileLoader(NAME, str(so))
        spec = importlib.util.spec_from_file_location(NAME, str(so), loader=loader)
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        _module = mod
        return mod


def build_now() -> None:
    """Build in this process (``python -m kvserve.models.ggml_kernel --build``), under an exclusive
    flock on ``<build dir>.lock`` (builders of one directory take turns; see decode_native.build_now)."""
    from torch.utils.cpp_extension import load

    d = build_dir()
    d.mkdir(parents=True, exist_ok=True)
    with open(str(d) + ".lock", "a+") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        try:
            (d / "lock").unlink(missing_ok=True)
            load(name=NAME, sources=[str(_DIR / "ggml_cpu.cpp")], extra_cflags=decode_native.cflags(),
                 extra_ldflags=list(decode_native.LDFLAGS), build_directory=str(d), is_python_module=True, verbose=False)
        finally:
            fcntl.flock(lk, fcntl.LOCK_UN)


def ensure_built(nice: int = 0):
    """The extension, built first (in a child process, blocking) when not cached; None where it
    cannot be used (:func:`enabled` False, or the build failed: logged once)."""
    global _build_error
    if not enabled():
        return None
    mod = load_cached()
    if mod is not None or _build_error is not None:
        return mod
    t0 = time.perf_counter()
    err = decode_native.build_in_child(nice=nice, cmd=[sys.executable, "-m", "kvserve.models.ggml_kernel", "--build"])
    if err is None:
        try:
            mod = load_cached()
        except Exception as e:  # noqa: BLE001 - a broken build: dense weights
            err = f"{type(e).__name__}: {e}"
    if mod is None:
        _build_error = err or "the build left no module"
        log.warning("GGUF block kernels not available, weights dequantized at load: %s", _build_error)
    else:
        log.info("built the GGUF block kernels in %.1f s (%s)", time.perf_counter() - t0, build_dir())
    return mod


class BlockMatrix:
    """A weight matrix [N, K] made of row blocks of GGUF bytes (a fused q|k|v or gate|up: the parts
    may differ in type, as a Q4_K_M file's attn_v does), multiplied by :meth:`mm`.

    Args:
        mod: the extension (:func:`ensure_built`).
        parts: (raw, type name) per row block; raw uint8 [rows, row bytes], C-contiguous (a view of
            the file's np.memmap is kept, not copied, and must stay mapped: this object holds it).
        k: input features.

    Attributes:
        gemm_min_rows: products of at least this many rows run the prefill path (see the module
            docstring) where this build and these types have it; 0 (default) = never.

    Raises:
        ValueError: a type without a kernel, K not a multiple of its block, or rows of the wrong size.
    """

    def __init__(self, mod, parts: list[tuple[np.ndarray, str]], k: int):
        self.gemm_min_rows = 0
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
        self._m = mod.Matrix([p.ctypes.data for p in self.parts], types, rows, k)

    @property
    def has_gemm(self) -> bool:
        """True where products of :attr:`gemm_min_rows` rows or more take the prefill path (this build
        has it and every part's type is one it takes)."""
        return bool(self._m.gemm)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 -> [M, N] float32 (see the module docstring for the arithmetic)."""
        return self._m.mm(x, self.gemm_min_rows)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: the blocks' values (gguf's dequantization), a new tensor; for callers
        that repack the weights into a layout of their own (the native decode step's head)."""
        from kvserve.loaders.weights import Weight

        k = self.shape[1]
        return torch.from_numpy(np.concatenate(
            [Weight((p.shape[0], k), raw=p, source_type=t).to_dense() for p, t in zip(self.parts, self.types)]))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--build"]:
        parent = os.environ.get("KVSERVE_BUILD_PARENT")
        if parent and parent.isdigit():
            decode_native._die_with_parent(int(parent))
        build_now()
        print(build_dir())
        return 0
    print("usage: python -m kvserve.models.ggml_kernel --build", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
