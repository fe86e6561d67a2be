"""Engine arguments, named after llama-server's and vLLM's flags.

``EngineConfig`` is what the engine needs; the CLI fills it from llama-server
flags (``-c``, ``-np``, ``-ctk``...) or vLLM names (``--max-model-len``,
``--max-num-seqs``...).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvserve.engine.spec_decode import SpecConfig

#: llama-server's ``--cache-ram`` default (MiB)
DEFAULT_CACHE_RAM_MIB = 8192
#: host-tier budget when the machine's memory cannot be read at all (MiB)
FALLBACK_CACHE_RAM_MIB = 1024


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; None where the file or the line is missing."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _phys_mem_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def auto_cache_ram_mib(meminfo: str = "/proc/meminfo") -> int:
    """Host-tier budget when ``--cache-ram`` is not given: min(8192 MiB, MemAvailable / 4).

    Without ``/proc/meminfo`` (not Linux): a quarter of the physical memory, capped
    the same way; without either, ``FALLBACK_CACHE_RAM_MIB``. So a soak cannot push
    the process toward 8 GiB on a machine that cannot spare it (issue #11).
    """
    avail = mem_available_bytes(meminfo)
    if avail is None:
        avail = _phys_mem_bytes()
    if avail is None:
        return FALLBACK_CACHE_RAM_MIB
    return min(DEFAULT_CACHE_RAM_MIB, (avail // 4) >> 20)


@dataclass(slots=True)
class EngineConfig:
    """Engine sizing and numerics.

    Attributes:
        n_ctx: total KV context in tokens (``-c``); 0 = the model's n_ctx_train.
        n_parallel: slots (``-np``); -1 = auto: 4 slots sharing a unified KV.
        kv_unified: every sequence may use the whole n_ctx (llama-server's
            ``kv_unified``); None = True for auto n_parallel, False otherwise.
        block_size: tokens per KV block.
        kv_dtype: K's cache type (``-ctk``): "f16" (llama-server's default), "bf16",
            "f32", "q8_0", "q4_0" (llama.cpp's block types), "fp8_e4m3" or "fp8_e5m2"
            (vLLM's ``--kv-cache-dtype``; "fp8" = "fp8_e4m3"); see kvserve.engine.kv_quant.
        kv_dtype_v: V's cache type (``-ctv``), the same names; None = K's type.
        max_num_batched_tokens: token budget of one step (vLLM name; llama-server
            ``-b``); default 2048.
        max_model_len: cap on one sequence's context (vLLM name); 0 = n_ctx_slot.
        dtype: weight/activation dtype: "auto" | "float32" | "bfloat16" | "float16".
            auto on CPU: float32 activations; Q4_0/Q4_1 weights kept packed
            (int4 kernel for small batches, a dense copy in ``large_batch_dtype``
            for large ones), every other type dequantized. On CUDA: bfloat16.
        cpu_kernel: dtype auto on CPU: the kernel for steps of at most
            ``small_batch_rows`` rows (decode): "auto" (default: Q4_0/Q4_1
            projections stay packed for torch's int4pack kernel, which
            represents them exactly; other quantized weights are requantized
            per row to int8 for torch's int8pack kernel; the output head to
            int8 for the "w8a8" kernel, whose logits are float32, on CPUs with
            VNNI/AMX int8 dot products, float32 elsewhere; float weights
            stay float32), "int8", "int4" or "dense". Teacher-forced top-1
            agreement with llama.cpp on SmolLM2 Q4_1 (352 positions): auto 343,
            int4 everywhere 343, int8 everywhere 340, float32 343.
        large_batch_dtype: dtype auto on CPU: the dense copy used by steps of
            more than ``small_batch_rows`` rows (prefill, many decodes): "auto"
            (bfloat16 where the CPU computes it natively, AVX512-BF16 or AMX,
            float32 elsewhere), "bfloat16" or "float32". Measured on a 2-core
            AVX512-BF16 EPYC, SmolLM2 FFN GEMMs at 512 rows: bfloat16 240 GFLOP/s,
            float32 90. In bfloat16, GGUF matrices keep no dense copy where the block
            kernels' prefill paths run (AVX512-BF16 + VNNI): such steps multiply the
            file's blocks, a panel at a time (kvserve.models.ggml_kernel): every type
            but F16/BF16 on the int8 path (llama.cpp's q8 activations and integer block
            sums, AVX512-VNNI; about 1.5x the bfloat16 path), BF16 rows on the bfloat16
            one; in float32 they run the per-row block kernels (the same q8 arithmetic,
            slower at prefill sizes; or, for Q4_0/Q4_1, a float32 copy).
        small_batch_rows: steps with more rows than this use the dense copy
            (default 16; 0 = always ``cpu_kernel``). Per layer of SmolLM2 on
            a 2-core AVX2 machine at 1 / 16 / 32 rows: int8 0.24 / 1.47 / 3.8
            ms, int4 0.32 / 1.98 / 4.0 ms, float32 0.45 / 1.54 / 2.96 ms. With
            weights already in cache a bfloat16 copy wins from about 8 rows, but
            a decode step streams every weight from memory, and there the
            packed int4 weights (a quarter of the bytes) win up to 16 rows and
            more: 16 streams on the EPYC above, 291 tok/s with int4, 225 with
            the bfloat16 copy.
        threads: torch intra-op threads (``-t``); 0 or less = all cores (llama.cpp's ``-t``: a
            value <= 0 becomes the hardware's thread count).
        compile: compile the decode-only step with ``torch.compile`` in a
            background thread, serving eagerly until it is ready (see
            ``kvserve.models.llama.CompiledDecode``; ``--compile``). Off by default:
            the first compile costs about 90 s of CPU on 2 cores.
        native_kernels: with ``compile``, also build kvserve's own kernel for
            Q4_0/Q4_1 weights on CPUs with AVX512-VNNI and use it for every step
            of up to ``small_batch_rows`` rows (``kvserve.models.q4_kernel``: int8
            activations per block of 32, llama.cpp's rounding; about 25% faster
            than torch's int4 kernel at one row in isolation, within noise for a
            whole decode step, 20-25% slower at 4-16 rows). Off by default
            (``--native-kernels``).
        cache_ram: host-tier budget in MiB for unreferenced cached KV blocks
            (llama-server ``--cache-ram``: -1 = no limit, i.e. half the machine's
            memory; 0 = off). None (the flag not given) = what the machine can
            spare: the smaller of llama-server's default 8192 MiB and a quarter of
            MemAvailable at start-up (:func:`auto_cache_ram_mib`).
        device: "auto" | "cpu" | "cuda".
        spec: speculative decoding (``--spec-type ngram`` / ``--speculative-config``, see
            :class:`kvserve.engine.spec_decode.SpecConfig`); off by default. On the CPU a
            step's draft tokens fill at most ``small_batch_rows`` rows in all, so that
            verification runs the small-batch kernels a plain decode runs.
        kv_cache_memory_bytes: vLLM's ``--kv-cache-memory-bytes``: the pool for running
            sequences holds this many bytes of blocks (any device); None = not given.
        gpu_memory_utilization: vLLM's ``--gpu-memory-utilization`` when given: on CUDA the
            pool gets that share of the device's memory less what is in use after loading
            (see :mod:`kvserve.engine.kv_budget`); ignored on the CPU.
        cpu_kv_cache_memory_bytes: the CPU's budget in bytes (vLLM's ``VLLM_CPU_KVCACHE_SPACE``
            GiB); used on the CPU only, under ``kv_cache_memory_bytes``.
        num_gpu_blocks_override: vLLM's ``--num-gpu-blocks-override``: the pool's block count.
            With none of these four the pool is llama-server's: ``n_ctx`` tokens plus a block per
            slot.
        tensor_parallel_size, pipeline_parallel_size: vLLM's ``-tp`` / ``-pp``: the model split over
            that many ranks (processes; kvserve.engine.parallel); 1 and 1 = one process.
    """

    n_ctx: int = 0
    n_parallel: int = -1
    kv_unified: bool | None = None
    block_size: int = 16
    kv_dtype: str = "f16"
    kv_dtype_v: str | None = None
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0
    dtype: str = "auto"
    cpu_kernel: str = "auto"
    large_batch_dtype: str = "auto"
    small_batch_rows: int = 16
    threads: int = 0
    compile: bool = False
    native_kernels: bool = False
    device: str = "auto"
    cache_ram: int | None = None
    spec: SpecConfig = field(default_factory=SpecConfig)
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    cpu_kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.n_ctx < 0:
            raise ValueError("n_ctx must be >= 0")
        if self.n_parallel == 0 or self.n_parallel < -1:
            raise ValueError("n_parallel must be -1 (auto) or >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        from kvserve.engine.kv_quant import canonical_kv_type

        self.kv_dtype = canonical_kv_type(self.kv_dtype)  # ValueError names the types
        self.kv_dtype_v = canonical_kv_type(self.kv_dtype_v or self.kv_dtype)
        if self.cpu_kernel not in ("auto", "int8", "int4", "dense"):
            raise ValueError(f"unsupported cpu_kernel '{self.cpu_kernel}' (auto, int8, int4, dense)")
        if self.cache_ram is not None and self.cache_ram < -1:
            raise ValueError("cache_ram must be -1 (no limit), 0 (off) or a size in MiB")
        if self.large_batch_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"unsupported large_batch_dtype '{self.large_batch_dtype}' (auto, float32, bfloat16)")
        if self.small_batch_rows < 0:
            raise ValueError("small_batch_rows must be >= 0")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype '{self.dtype}'")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1")

    def cache_ram_mib(self) -> int:
        """The host-tier budget in MiB that ``cache_ram`` means on this machine (0 = off)."""
        if self.cache_ram is None:
            return auto_cache_ram_mib()
        if self.cache_ram < 0:
            phys = _phys_mem_bytes()
            return (phys // 2) >> 20 if phys else DEFAULT_CACHE_RAM_MIB
        return self.cache_ram

    def host_tier_blocks(self, block_bytes: int, active_blocks: int, mib: int | None = None) -> int:
        """Blocks of the host tier for ``mib`` MiB (default :meth:`cache_ram_mib`), capped at 65536."""
        mib = self.cache_ram_mib() if mib is None else mib
        return max(0, min((mib << 20) // max(block_bytes, 1), 65536))

    @property
    def n_slots(self) -> int:
        return 4 if self.n_parallel == -1 else self.n_parallel

    @property
    def unified(self) -> bool:
        return self.kv_unified if self.kv_unified is not None else self.n_parallel == -1

    def resolve_n_ctx(self, n_ctx_train: int) -> int:
        return self.n_ctx or n_ctx_train

    def n_ctx_slot(self, n_ctx_train: int) -> int:
        """Context of one sequence in tokens (llama-server ``n_ctx_slot``)."""
        n = self.resolve_n_ctx(n_ctx_train)
        per = n if self.unified else n // self.n_slots
        if self.max_model_len:
            per = min(per, self.max_model_len)
        return per

    def resolve_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def apply_threads(self) -> int:
        import torch

        n = self.threads if self.threads > 0 else (os.cpu_count() or 1)
        if torch.get_num_threads() != n:  # a process-wide setting: loading another model leaves it
            torch.set_num_threads(n)
        return n
