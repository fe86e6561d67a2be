"""The native decode step: every layer of a decode-only step in one C++ call (``decode_cpu.cpp``).

At one token per step, eager torch spends most of a SmolLM2 step outside the weights: about
20 small ops per layer (norms, RoPE, casts, the KV write, attention, residuals), each a few
microseconds of Python and dispatch, 30 layers deep. The native step runs a layer's RMSNorm,
q|k|v projection, RoPE, KV write, attention, output projection, SwiGLU MLP and residuals for
the B rows of a decode-only step in C++ (qwen3's per-head q/k RMSNorm before RoPE; qwen3moe's
mixture of experts in place of the MLP: the router's softmax, the top-k experts, their weights
renormalised, the chosen experts' gate|up and down on the file's blocks with the rows grouped by
expert, as llama.cpp's mul_mat_id: ggml_cpu.cpp's ``Matrix.mm_jobs``), then the output norm and the head, on the step's own
worker threads (``thread_pool.h``, as many as torch's). Its projections are per-operation
kernels the step composes: unpacked Q4 weights (HF int4 checkpoints, ``--cpu-kernel int4``) in
kvserve's 4-bit tile kernel (``q4_core.h`` and the tiles here: AVX512-VNNI, or AVX2 + FMA + F16C,
picked by ``-march=native``; GGUF Q4_1 blocks are repacked into it too, :func:`q4_tiles`, and
Q4_0 on the AVX2 build; :func:`q4_repacked`), every other GGUF type (Q4_0 on AVX512) as the
file stores it through the per-type block products of ``ggml_cpu.cpp``
(:mod:`kvserve.models.ggml_kernel`: Q4_K, Q5_K, Q6_K, Q8_0, Q5_0, F16 ...: the same products
the eager path runs, so a Q4_K_M file decodes with no copy of its weights); activations
quantized as llama.cpp does for each type, once per projection and step (a fused q|k|v or
gate|up shares it). The head: a small Q8_0 one in the step's int8 tiles (:func:`pack_q8`), a
head of other GGUF blocks through its block product. Both sources are one extension, built
and cached once (:func:`ensure_built`, :func:`ensure_started`).

Numerics: llama.cpp-style q4 x q8 rounding instead of torch's bfloat16 int4 kernel, so logits
differ from the eager path by that rounding (prefill stays eager, but a prompt's last token runs
here, in a step of its own: ``Scheduler.split_last_token``). Every row is computed with
the same operations whatever else runs in its step: a sequence's tokens do not depend on its
batch (for decode-only steps; a step mixed with a prompt chunk runs eagerly, as before).

When it is used (the default): ``dtype`` auto on an x86-64 CPU with AVX512F/BW/VL and
AVX512-VNNI or with AVX2, FMA and F16C (:func:`cpu_isa`), projections kept as GGUF blocks (any
type of :mod:`kvserve.models.ggml_kernel`) or Q4 weights whose input sizes are multiples of 64, head_dim a multiple
of 32, a float KV cache (f32/f16/bf16) and no ``--compile`` (the compiled graph takes those
steps); speculative decoding's verification rows run through it as decode rows (see
ModelRunner._decode_rows), so verified tokens equal plain decoding's. Rows of LoRA adapters
(kvserve.lora) run in it too: each projection adds its rows' ``scale * B (A x)`` in float32 after the
base product, the rows grouped by adapter (:meth:`NativeDecode.lora_ready`, ``Decoder.step_lora``). ``KVSERVE_NATIVE_DECODE=0``
turns it off.

How it is built: with torch's C++ extension tooling (g++ and ninja) in a child process under
``nice -n 19`` started when the engine loads, so start-up does not wait and serving keeps its
cores (about 40-60 s of one core the first time); the shared object is cached under
``$KVSERVE_EXTENSIONS_DIR/cpu_<key>`` (default ``$KVSERVE_HOME/extensions``), the key a
hash of the sources, torch's version and the CPU's flags, and reused by later starts and by
every model (it holds no model shapes). The child runs in its own process group and kills it
(the compiler included) when its parent dies; builders of one directory take turns under a
file lock (``<dir>.lock``, flock: released by the kernel when a builder dies).

One path per process (a greedy request gives the same tokens whenever it is sent): with a
cached build, the weights are packed in a thread while the server starts, and the engine's
first step waits for that packing (:meth:`NativeDecode.activate`), so every decode step runs
natively. Without one, decode steps run eagerly until the background build is loaded, and
the engine switches to the native step only at a step where no request is running (an idle
engine), logging it once. Wherever it cannot be used (no compiler, other CPUs, a failed
build: logged once), decode steps run eagerly.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from kvserve.models import q4_kernel

log = logging.getLogger("kvserve.engine")

#: kvserve's one CPU extension: the native decode step (decode_cpu.cpp) and the GGUF block kernels
#: (ggml_cpu.cpp, the ``ggml`` submodule, :mod:`kvserve.models.ggml_kernel`), one build, one cache
NAME = "kvserve_cpu"
_DIR = Path(__file__).resolve().parent
CPP_SOURCES = ("decode_cpu.cpp", "ggml_cpu.cpp")
SOURCES = (*CPP_SOURCES, "ggml_cpu.h", "ggml_gemm.h", "ggml_gemm8.h", "q4_core.h", "q4_repack.h", "q8_quant.h", "thread_pool.h")
#: -fopenmp: at::parallel_for runs its loop in one thread when an extension is compiled without it
#: (ATen/ParallelOpenMP.h is behind _OPENMP). The step itself now runs on its own worker threads
#: (thread_pool.h: libgomp throttled its team's spin in a server, see docs/performance.md); the
#: flag stays for the headers' parallel code it still includes
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


def cflags() -> list[str]:
    """:data:`CFLAGS`, with ``-march=$KVSERVE_NATIVE_MARCH`` when that is set (for example
    ``haswell``: the AVX2 build on an AVX512 machine, to test it or to run the same rounding as an
    AVX2 fleet; part of the build key)."""
    march = os.environ.get("KVSERVE_NATIVE_MARCH", "").strip()
    return [f"-march={march}" if f == "-march=native" and march else f for f in CFLAGS]
_lock = threading.Lock()
_module = None  # the loaded extension
_build_error: str | None = None
_build_thread: threading.Thread | None = None
waiters: list = []  # callbacks of ensure_started waiting for the background build


_KEYS: dict[tuple, str] = {}


def build_key() -> str:
    """Hash of the sources, the compiler flags, torch's and Python's versions and this CPU's model
    and flags (16 hex). Remembered per process for the same flags and sources' sizes and
    modification times (an edited source gives a new key)."""
    memo = (tuple(cflags()), tuple((s, st.st_size, st.st_mtime_ns) for s in SOURCES for st in [(_DIR / s).stat()]))
    if memo not in _KEYS:
        _KEYS[memo] = _build_key()
    return _KEYS[memo]


def _build_key() -> str:
    h = hashlib.sha256()
    for s in SOURCES:
        h.update((_DIR / s).read_bytes())
    h.update(" ".join(cflags() + LDFLAGS).encode())
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


def extensions_dir() -> Path:
    """The build cache: ``$KVSERVE_EXTENSIONS_DIR``, else ``$KVSERVE_HOME/extensions`` (read on every call)."""
    env = os.environ.get("KVSERVE_EXTENSIONS_DIR")
    if env:
        return Path(env).expanduser()
    from kvserve.store.blobs import kvserve_home

    return kvserve_home() / "extensions"


def build_dir() -> Path:
    """Where the extension is built and cached: ``extensions_dir() / cpu_<build_key>``."""
    return extensions_dir() / f"cpu_{build_key()}"


_AVX2_FLAGS = ("avx2", "fma", "f16c")


def cpu_isa() -> str | None:
    """The instruction set the step is built for here: "avx512" (AVX512F/BW/VL + AVX512-VNNI),
    "avx2" (AVX2 + FMA + F16C: x86-64 CPUs since 2013-2015, AMD Zen 1-3 included), or None."""
    if q4_kernel.cpu_supported():
        return "avx512"
    flags = q4_kernel.cpu_flags()
    if flags and all(f in flags for f in _AVX2_FLAGS):
        return "avx2"
    return None


def cpu_supported() -> bool:
    """True on x86-64 CPUs the native decode step builds for (see :func:`cpu_isa`)."""
    return cpu_isa() is not None


_REASONS: dict[tuple, str | None] = {}


def unavailable_reason() -> str | None:
    """Why the extension cannot be built here (None when it can): CPU or compiler missing.

    Remembered per ``$CXX`` and ``$PATH`` (the loader asks once per projection: reading
    /proc/cpuinfo and searching PATH each time was ~0.1 s of a 1B model's start-up)."""
    key = (os.environ.get("CXX"), os.environ.get("PATH"))
    if key not in _REASONS:
        _REASONS[key] = _unavailable_reason()
    return _REASONS[key]


def _unavailable_reason() -> str | None:
    if not cpu_supported():
        return "the CPU lacks AVX2/FMA/F16C and AVX512-VNNI (or is not x86-64)"
    if shutil.which(os.environ.get("CXX", "c++")) is None and shutil.which("g++") is None:
        return "no C++ compiler (g++)"
    if shutil.which("ninja") is None and not _ninja_module():
        return "no ninja (torch's extension builds need it)"
    return None


def _ninja_module() -> bool:
    return importlib.util.find_spec("ninja") is not None


def load_cached():
    """The extension module if a build of these sources is cached (loads it once), else None."""
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
    """Build the extension in this process (``python -m kvserve.models.decode_native --build``).

    Holds an exclusive flock on ``<build dir>.lock`` meanwhile, so builders of one directory (two
    servers started at once, the test session's build and a server's) take turns: the later one
    finds the build done (ninja's no-op). torch's own lock file (``<build dir>/lock``), left
    behind by a builder that was killed, would make later builds wait forever: under the flock
    no other builder runs, so one found there is stale and removed."""
    from torch.utils.cpp_extension import load

    d = build_dir()
    d.mkdir(parents=True, exist_ok=True)
    with open(str(d) + ".lock", "a+") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        try:
            (d / "lock").unlink(missing_ok=True)
            load(name=NAME, sources=[str(_DIR / s) for s in CPP_SOURCES], extra_cflags=cflags(), extra_ldflags=list(LDFLAGS),
                 build_directory=str(d), is_python_module=True, verbose=False)
        finally:
            fcntl.flock(lk, fcntl.LOCK_UN)


_PR_SET_PDEATHSIG = 1


def _child_setup() -> None:  # in the forked child, before exec
    os.setpgid(0, 0)  # its own group: the compiler it starts is killed with it
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _descendants(pid: int) -> list[int]:
    """The process ids below ``pid`` (children first), from /proc."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def _die_with_parent(ppid: int) -> None:
    """In the build child: on SIGTERM (the parent-death signal) or once the parent is gone
    (reparented), kill every process below it (ninja, and the compiler jobs ninja starts in
    process groups of their own) and then its own group."""
    def kill_group(*_):
        for k in _descendants(os.getpid()):
            try:
                os.kill(k, signal.SIGKILL)
            except OSError:
                pass
        os.killpg(os.getpgid(0), signal.SIGKILL)

    if os.getpgid(0) == os.getpid():  # only when the parent gave it its own group
        signal.signal(signal.SIGTERM, kill_group)

        def watch():
            while os.getppid() == ppid:
                time.sleep(0.5)
            kill_group()

        threading.Thread(target=watch, daemon=True).start()


def build_in_child(nice: int = 19, timeout: float = 900.0, cmd: list[str] | None = None) -> str | None:
    """Build in a child process under ``nice`` (one compile job); None on success, else the
    error text (the last lines of its output).

    The child is in its own process group and dies with this process (its thread, exactly:
    PR_SET_PDEATHSIG, and a watch on its parent id), killing the compiler it started; a timeout
    kills the group too. ``cmd``: the child's command instead of the build (tests)."""
    env = dict(os.environ, MAX_JOBS="1", KVSERVE_BUILD_PARENT=str(os.getpid()))
    cmd = cmd or [sys.executable, "-m", "kvserve.models.decode_native", "--build"]
    if shutil.which("nice"):
        cmd = ["nice", "-n", str(nice), *cmd]
    try:
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, preexec_fn=_child_setup)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as e:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        p.communicate()
        return f"{type(e).__name__}: {e}"
    if p.returncode != 0:
        tail = out.decode(errors="replace").strip().splitlines()[-6:]
        return f"build exited {p.returncode}: " + " | ".join(tail)
    return None


def ensure_built(nice: int = 0):
    """The extension, built first (in a child process, blocking) when not cached; None where it
    cannot be built here (:func:`unavailable_reason`) or the build failed (logged once). What the
    model loader calls when GGUF blocks need the block kernels from the first product on."""
    global _build_error
    if unavailable_reason() is not None:
        return None
    mod = load_cached()
    if mod is not None or _build_error is not None:
        return mod
    t0 = time.perf_counter()
    t = _build_thread
    if t is not None:  # a background build (ensure_started) is under way: wait for it
        t.join()
        return _module
    err = build_in_child(nice=nice)
    if err is None:
        try:
            mod = load_cached()
        except Exception as e:  # noqa: BLE001 - a broken build
            err = f"{type(e).__name__}: {e}"
    if mod is None:
        _build_error = err or "the build left no module"
        log.warning("kvserve's CPU extension not available (GGUF weights dequantized, decoding eagerly): %s",
                    _build_error)
    else:
        log.info("built kvserve's CPU extension in %.1f s (%s)", time.perf_counter() - t0, build_dir())
    return mod


def ensure_started(on_ready) -> bool:
    """Load the cached build now and call ``on_ready(module)`` in a thread (it packs the weights), or
    start one background build (once per process) that calls ``on_ready(module)`` when loaded, or
    ``on_ready(None)`` after logging why it failed. True when the build was cached (or this
    process had already loaded it)."""
    global _build_thread, _build_error
    mod = load_cached()
    if mod is not None:
        # packing the weights takes ~2 s for SmolLM2: off the start-up path (the engine's
        # first step waits for it, NativeDecode.activate). Not a daemon: a process that ends while
        # it packs waits for it (torch's and the block kernels' threads torn down under a running
        # op aborted the process: "terminate called without an active exception")
        threading.Thread(target=on_ready, args=(mod,), name="kvserve-native-pack").start()
        return True
    if _build_error is not None:
        on_ready(None)
        return False
    with _lock:
        waiters.append(on_ready)
        if _build_thread is not None:
            return

        def work():
            global _build_error
            t0 = time.perf_counter()
            err = build_in_child()
            mod = None
            if err is None:
                try:
                    mod = load_cached()
                except Exception as e:  # noqa: BLE001 - a broken build: eager
                    err = f"{type(e).__name__}: {e}"
            if mod is None:
                _build_error = err or "the build left no module"
                log.warning("native decode step not available, decoding eagerly: %s", _build_error)
            else:
                log.info("built the native decode step in %.1f s (%s)", time.perf_counter() - t0, build_dir())
            with _lock:
                fns = list(waiters)
                waiters.clear()
            for fn in fns:
                fn(mod)

        _build_thread = threading.Thread(target=work, name="kvserve-native-build", daemon=True)
        _build_thread.start()
    return False


def wait_build(timeout: float | None = None) -> bool:
    """Block until a background build started by :func:`ensure_started` ended; True when loaded."""
    t = _build_thread
    if t is not None:
        t.join(timeout)
    return _module is not None


def model_reason(model) -> str | None:
    """Why ``model`` cannot use the native step (None when it can): weights or shapes."""
    c = model.config
    if model.device.type != "cpu":
        return "not a CPU model"
    lins = model.projections()
    if not lins or any(not native_projection(lin) for lin in lins):
        return "the projections are neither Q4_0/Q4_1 kept for the native kernel nor GGUF blocks"
    why = experts_reason(model)
    if why is not None:
        return why
    if c.head_dim % 32 or c.n_head % c.n_head_kv:
        return f"head_dim {c.head_dim} is not a multiple of 32"
    if getattr(model, "stage_layers", None) is not None:
        return "a pipeline stage"
    return None


def experts_reason(model) -> str | None:
    """Why the step cannot run ``model``'s mixture-of-experts layers (kvserve.models.moe.MoE), None
    when it can (or there are none): every expert's gate|up and down must be GGUF blocks the block
    kernels multiply (:attr:`Linear.blocks`), without biases, and the expert width a multiple of 32."""
    for layer in model.layers:
        moe = getattr(layer, "moe", None)
        if moe is None:
            continue
        lins = [*moe.gate_up, *moe.down]
        if any(getattr(lin, "blocks", None) is None for lin in lins):
            return "experts that are not GGUF blocks"
        if any(lin.bias is not None for lin in lins):
            return "expert biases"
        if moe.n_ff % 32:
            return f"expert width {moe.n_ff} is not a multiple of 32"
    return None


def q4_repacked(qtype: str, isa: str | None) -> bool:
    """Whether the native step repacks GGUF projections of ``qtype`` ("Q4_0", "Q4_1") into its own
    4-bit layout (:func:`q4_tiles`) on a build for ``isa``: always on the AVX2 build; on the AVX512
    build Q4_1 only, Q4_0 being multiplied where the file stores it (q4_core.h's ``q40_dot``, through
    ggml_cpu.cpp's Matrix: no copy; a Llama-1B Q4_0 file's process ~1,000 MiB resident instead of
    ~1,660), unless ``KVSERVE_Q4_REPACK`` is "1" (both repacked, the tiles: faster at 4-16 rows
    where compute, not memory, bounds the step) or "0" (neither)."""
    if isa != "avx512":
        return True
    env = os.environ.get("KVSERVE_Q4_REPACK", "")
    return env == "1" or (env != "0" and qtype == "Q4_1")


def q4_tiles(blocks, layout: str, isa: str | None = "avx2") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A projection of GGUF Q4_0/Q4_1 blocks (a ggml_kernel.BlockMatrix) in the step's own 4-bit
    layout (``layout`` "tile16" or "pair", as Linear.native_weights packs unpacked Q4 weights), or
    None for other types or shapes, and where :func:`q4_repacked` says the build for ``isa`` keeps
    the file's blocks (then the step multiplies them through ggml_cpu.cpp's Matrix and keeps no
    copy). The tiles are a copy of the file's bytes beside them (the eager path and prefill read the
    file's). Timings (2-core EPYC Zen 4, one thread): one row of the 1B file's projections 1.04x the
    tiles' time on the file's Q4_0 blocks (q40_dot), 4-16 rows 1.5-1.8x (compute-bound there)."""
    if not all(q4_repacked(t, isa) for t in blocks.types):
        return None
    from kvserve.loaders.gguf import _q4_blocks

    n, k = blocks.shape
    if any(t not in ("Q4_0", "Q4_1") for t in blocks.types) or k % 64 or (layout == "tile16" and n % 16):
        return None
    parts = [_q4_blocks(p, p.shape[0], k, t) for p, t in zip(blocks.parts, blocks.types)]
    q4 = parts[0].q4 if len(parts) == 1 else np.concatenate([w.q4 for w in parts])
    scale = np.concatenate([w.q4_scale for w in parts])
    zero = np.concatenate([w.q4_zero for w in parts])
    del parts
    if layout == "tile16":
        return q4_kernel.pack_tiles(q4, scale, zero)
    return q4_kernel.pack_torch(q4, scale, zero)


def native_projection(lin) -> bool:
    """True when the step can run ``lin`` (a Linear): Q4_0/Q4_1 weights kept in the step's layout
    (``has_native_weights``) or the GGUF file's blocks (``blocks``: the per-type block products)."""
    return lin.has_native_weights or getattr(lin, "blocks", None) is not None


class NativeDecode:
    """The native decode step for one model and its KV caches.

    Args:
        model: the LlamaModel (its projections keep the native kernel's weights, Linear.q4w).
        kv_caches: the runner's per-layer (k_cache, v_cache).
        max_batch: the most rows of a step it runs (Linear.small_max_rows: larger steps use the
            dense copy eagerly; 0 = any).

    :attr:`reason` says why it will not run (None when it may); :attr:`ready` turns True once the
    step is switched on by :meth:`activate` (the engine calls it before every step) or :meth:`wait`:
    with a cached build at the first step (which waits for the weights' packing), else at the
    first idle step after the background build loaded. :attr:`cached` says which.
    """

    def __init__(self, model, kv_caches, max_batch: int = 0):
        self.model = model
        self.max_batch = max_batch if max_batch > 0 else 1 << 30
        self.decoder = None
        self._staged = None  # the loaded decoder, not yet switched on
        self.cached = False  # the build was cached when the step started (see activate)
        self._done = threading.Event()
        self.native_head = False  # the output head in C++ too (else the model's Linear)
        self.isa: str | None = None  # the loaded build's instruction set ("avx512", "avx2")
        self.calls = 0
        #: the token embedding's rows in C++ (input_ids -> float32 [B, E]), or None: the model's embed
        self._embed = None
        #: LoRA adapter id -> registered with the decoder (True) or refused by it (False): lora_ready
        self._lora: dict[int, bool] = {}
        self.reason = unavailable_reason() or model_reason(model)
        if self.reason is None and any(not isinstance(t, torch.Tensor) or t.dtype not in
                                       (torch.float32, torch.float16, torch.bfloat16) for kv in kv_caches for t in kv):
            self.reason = "a quantized KV cache type"

    def start(self) -> None:
        """Load or build the extension (see :func:`ensure_started`); logs why when it cannot run."""
        if self.reason is not None:
            log.info("native decode step off: %s; decoding eagerly", self.reason)
            self._done.set()
            return
        self.cached = ensure_started(self._loaded)

    @property
    def pending(self) -> bool:
        """True while the step may still be switched on (not ready, not refused)."""
        return self.decoder is None and self.reason is None

    def activate(self, idle: bool) -> bool:
        """Switch the loaded step on, before an engine step; True when it is on.

        With a cached build this waits for the weights' packing (started with the engine, ~2 s
        for SmolLM2, so only a first step that comes early waits): every decode step of the
        process runs natively. After a background build the step goes on only when ``idle``
        (no request running, none preempted with tokens), so no request's tokens come from
        both paths; the switch is logged once (INFO)."""
        if self.decoder is not None:
            return True
        if self.reason is not None:
            return False
        if self.cached:
            self._done.wait()
        elif not idle or not self._done.is_set():
            return False
        if self._staged is not None:
            self.decoder, self._staged = self._staged, None
            if not self.cached:
                log.info("decode moved to the native step (built while serving; the engine was idle)")
        return self.decoder is not None

    def packed(self, timeout: float | None = None) -> bool:
        """Block until the step is loaded and its weights packed, or refused (at most ``timeout``
        s), without switching it on; True when that happened in time. Start-up work that would
        compete with the packing for the cores waits on this (the grammar warm-up)."""
        return self._done.wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the step is loaded or failed (at most ``timeout`` s) and switch it on (the
        caller knows no request runs: benchmarks, tests); True when ready."""
        if self._done.wait(timeout):
            self.activate(idle=True)
        return self.ready

    def _loaded(self, mod) -> None:
        if threading.current_thread().name == "kvserve-native-build":
            # after a late build the packing yields the CPU to serving; a cached build's packing
            # keeps its priority (the engine's first step waits for it: at nice 19 on a loaded
            # machine that wait was 30 s and more)
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except (OSError, AttributeError):
                pass
        try:
            self._load(mod)
        except Exception as e:  # noqa: BLE001 - a layout the extension refuses: eager
            self.reason = f"{type(e).__name__}: {e}"
            log.warning("native decode step not used: %s", self.reason)
        finally:
            self._done.set()

    def _load(self, mod) -> None:
        if mod is None:
            self.reason = _build_error or "build failed"
            return
        m, c = self.model, self.model.config
        layout = getattr(mod, "LAYOUT", "pair")  # "tile16" on the AVX512 build (decode_cpu.cpp)
        self.isa = getattr(mod, "ISA", None)
        empty = torch.empty(0)
        layers, mats = [], []
        for layer in m.layers:
            t = [layer.attn_norm.weight.contiguous(), layer.ffn_norm.weight.contiguous()]
            mt = []
            for lin in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down):
                if lin is None:  # a mixture-of-experts layer: no dense gate|up and down (set_moe below)
                    t.extend([empty, empty, empty])
                    mt.append(None)
                    continue
                tiles = lin.native_weights(layout) if lin.has_native_weights else q4_tiles(lin.blocks, layout, self.isa)
                # other GGUF blocks: the per-type block products on the file's bytes (no copy)
                t.extend([empty, empty, empty] if tiles is None else [x.contiguous() for x in tiles])
                mt.append(lin.blocks.matrix if tiles is None else None)
            t.append(layer.wqkv.bias.contiguous() if layer.wqkv.bias is not None else empty)
            layers.append(t)
            mats.append(mt)
        dec = mod.Decoder(layers, mats, c.n_head, c.n_head_kv, c.head_dim, float(c.rms_eps))
        for i, layer in enumerate(m.layers):
            if getattr(layer, "q_norm", None) is not None:  # qwen3's per-head q/k RMSNorm
                dec.set_qk_norm(i, layer.q_norm.weight.contiguous(), layer.k_norm.weight.contiguous())
            moe = getattr(layer, "moe", None)
            if moe is not None:  # the experts' matrices: the file's blocks, as the eager path multiplies them
                dec.set_moe(i, moe.router.contiguous(), [lin.blocks.matrix for lin in moe.gate_up],
                            [lin.blocks.matrix for lin in moe.down], moe.top_k, bool(moe.norm))
        head = m.output.weight
        blocks = getattr(m.output, "blocks", None)
        if head is None and blocks is not None and blocks.types == ["Q8_0"] and blocks.nbytes <= SMALL_HEAD_BYTES:
            # a small Q8_0 head kept as the file's blocks (SmolLM2's tied embedding): the step
            # requantizes it into its own tiles (the same values; the float copy is transient), faster
            # than the block product at this size; a larger head stays the file's blocks (no copy)
            head = blocks.dequantize()
        if head is None and blocks is not None:
            dec.set_head_matrix(m.output_norm.weight.contiguous(), blocks.matrix)
            self.native_head = True
        elif head is not None and head.shape[1] % 64 == 0:
            dec.set_head(m.output_norm.weight.contiguous(), *pack_q8(head, layout), head.shape[0])
            self.native_head = True
        self._embed = _native_embedding(mod, m)
        self._staged = dec
        log.info("native decode step loaded (%s head)", "native" if self.native_head else "torch")

    @property
    def ready(self) -> bool:
        """True when decode steps run natively. A cached build's step is switched on here as
        soon as it is packed (every step of the engine waits for it anyway), so callers that
        poll this see it; a late build's only by :meth:`activate` at an idle step or :meth:`wait`."""
        if self.decoder is None and self.cached and self._done.is_set():
            self.activate(idle=False)
        return self.decoder is not None

    # -- LoRA ---------------------------------------------------------------------------------------

    def lora_ready(self, lora, known) -> bool:
        """Whether the step can run ``lora`` (a kvserve.lora.apply.LoraBatch) natively: registers each
        of its adapters with the decoder on first use (:meth:`_register_lora`, from the model's
        LoraLinears), first dropping the decoder's copies of adapters no longer in ``known`` (the
        registry's ids; ids are never reused). False when an adapter cannot be registered (logged
        once; such steps run eagerly)."""
        dec = self.decoder
        if dec is None:
            return False
        missing = [aid for aid in lora.ids if aid not in self._lora]
        if missing:
            for aid in [a for a in self._lora if a not in known]:
                dec.remove_lora(aid)
                del self._lora[aid]
            for aid in missing:
                try:
                    self._register_lora(aid)
                    self._lora[aid] = True
                except Exception as e:  # noqa: BLE001 - a layout the step refuses: that adapter's steps run eagerly
                    dec.remove_lora(aid)
                    self._lora[aid] = False
                    log.warning("LoRA adapter %d runs on the eager path: %s: %s", aid, type(e).__name__, e)
        return all(self._lora[aid] for aid in lora.ids)

    _PROJ = ("wqkv", "wo", "w_gate_up", "w_down")  # decode_cpu.cpp's projection order

    def _register_lora(self, aid: int) -> None:
        """Give the decoder adapter ``aid``'s A and B (kvserve.lora.apply.install's fused per-Linear
        weights: a [R, in], each part's B [n_out, r] transposed to [r, n_out], in the adapter's dtype:
        float32, bfloat16 or float16, ``--lora-dtype``; the decoder reads them as they are)."""
        for li, layer in enumerate(self.model.layers):
            for pi, attr in enumerate(self._PROJ):
                lin = getattr(layer, attr, None)
                lo = getattr(lin, "lora", None) if lin is not None else None
                w = lo.weights.get(aid) if lo is not None else None
                if w is None:
                    continue
                a, parts = w
                dt = a.dtype if a.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
                bts = [b.detach().to(dt).t().contiguous() for *_, b in parts]
                spec = [int(v) for out0, n_out, r0, r1, _ in parts for v in (out0, n_out, r0, r1)]
                self.decoder.set_lora(aid, li, pi, a.detach().to(dt).contiguous(), bts, spec)

    @staticmethod
    def lora_rows(lora) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A LoraBatch as the step's per-row entries: row offsets [T + 1] long, adapter ids [nnz]
        long, scales [nnz] float32 (row b's entries at [off[b], off[b + 1]), in the groups' order)."""
        per_row: list[list[tuple[int, float]]] = [[] for _ in range(lora.n_rows)]
        for g in lora.groups:
            rows = range(lora.n_rows) if g.rows is None else g.rows.tolist()
            for r, s in zip(rows, g.scales[:, 0].tolist()):
                per_row[r].append((g.adapter_id, s))
        off = [0]
        ids: list[int] = []
        scales: list[float] = []
        for entries in per_row:
            for aid, s in entries:
                ids.append(aid)
                scales.append(s)
            off.append(len(ids))
        return (torch.tensor(off, dtype=torch.long), torch.tensor(ids, dtype=torch.long),
                torch.tensor(scales, dtype=torch.float32))

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_index: torch.Tensor, lens: torch.Tensor, kv_caches, lora=None) -> torch.Tensor:
        """One decode-only step: input_ids, positions, slot_mapping, lens [B] long, kv_index [B, L]
        long (each query's cache rows, valid up to lens[b]) -> float32 logits [B, n_vocab].

        ``lora``: the step's adapter rows (a kvserve.lora.apply.LoraBatch whose adapters
        :meth:`lora_ready` accepted), or None: each such row gets its adapters' deltas on every
        projection they target, in float32 on the projection's input (kvserve.lora.apply's math);
        the other rows are computed exactly as without it."""
        m = self.model
        x = m.embed(input_ids) if self._embed is None else self._embed(input_ids)  # [B, E] float32, contiguous
        cos = m.rope_cos.index_select(0, positions)
        sin = m.rope_sin.index_select(0, positions)
        ks = [k for k, _ in kv_caches]
        vs = [v for _, v in kv_caches]
        if lora is None:
            x = self.decoder.step(x, cos, sin, slot_mapping, kv_index.contiguous(), lens, ks, vs)
        else:
            x = self.decoder.step_lora(x, cos, sin, slot_mapping, kv_index.contiguous(), lens, ks, vs,
                                       *self.lora_rows(lora))
        self.calls += 1
        if self.native_head:
            return self.decoder.logits(x)
        return m.output.forward(m.output_norm.forward(x)).float()


#: GGUF types of a token embedding whose rows the extension dequantizes (``embed_rows``)
EMBED_TYPES = ("Q4_K", "Q6_K", "Q8_0")


def _native_embedding(mod, model):
    """``input_ids [B] long -> float32 [B, E]`` by the extension's ``embed_rows`` for a token
    embedding kept as GGUF blocks of :data:`EMBED_TYPES` (the values of the model's ``embed``, bit
    for bit: gguf's float32 arithmetic; ~1 us a row where gguf's numpy dequantization took 50-300 us
    of a one-row step), else None (the model's own lookup)."""
    raw = getattr(model, "tok_embd_raw", None)
    fn = getattr(mod, "embed_rows", None)
    if (fn is None or getattr(model, "tok_embd", None) is not None or raw is None or raw.raw is None
            or raw.source_type not in EMBED_TYPES or len(raw.shape) != 2):
        return None
    import warnings

    arr = np.asarray(raw.raw)
    if arr.ndim != 2 or arr.strides[1] != 1:
        return None
    with warnings.catch_warnings():  # a read-only mapping of the file: the extension only reads it
        warnings.simplefilter("ignore", UserWarning)
        table = torch.from_numpy(arr)
    qtype, k = raw.source_type, int(raw.shape[1])
    return lambda ids: fn(table, ids.contiguous(), qtype, k)


#: a Q8_0 head of GGUF blocks up to this size is requantized into the step's own tiles (SmolLM2's
#: 28 MB head: its tile kernel is faster); a larger one is multiplied as the file's blocks (no copy)
SMALL_HEAD_BYTES = 64 << 20

#: rows of the head quantized at a time by pack_q8 (a multiple of 16): its temporaries stay a few MB
#: instead of fresh 113 MB tensors per operation (SmolLM2's head: 1.2 s -> ~0.2 s, mostly page faults)
PACK_Q8_ROWS = 2048


def pack_q8(w: torch.Tensor, layout: str = "pair") -> tuple[torch.Tensor, torch.Tensor]:
    """The native head's weights from a dense [N, K] head (K a multiple of 64): int8 per block of
    32 with a float16 scale d = max|w| / 127 (GGUF Q8_0's rule, so a Q8_0 head is reproduced
    exactly), values plus 128 in the q4 kernel's pair order (``layout`` "pair": (uint8 [N, K],
    float16 [N, K/32])) or the AVX512 step's tile layout ("tile16", as q4_kernel.to_tiles lays
    out the pair order: the rows padded to a multiple of 16 with zero weights, [Np, K] and
    [Np, K/32]). Quantized :data:`PACK_Q8_ROWS` rows at a time."""
    n, k = w.shape
    g = k // 32
    tiles = layout == "tile16"
    n_out = (n + 15) // 16 * 16 if tiles else n
    q8 = torch.full((n_out, k), 128, dtype=torch.uint8)
    d = torch.zeros(n_out, g, dtype=torch.float16)
    p = torch.arange(64)
    lane = p // 4
    blk, idx = lane % 2, 4 * (lane // 2) + p % 4
    for r0 in range(0, n, PACK_Q8_ROWS):
        r1 = min(n, r0 + PACK_Q8_ROWS)
        wb = w[r0:r1].float().reshape(r1 - r0, g, 32)
        dc = (wb.abs().amax(-1) / 127.0).to(torch.float16)
        df = dc.float().unsqueeze(-1)
        q = torch.where(df > 0, torch.round(wb / df.clamp_min(1e-30)), 0.0).clamp_(-127, 127)
        u = (q + 128).to(torch.uint8)  # [rows, blocks, 32]
        d[r0:r1] = dc
        if tiles:  # rows r0.. of tiles r0 / 16..: [tile, block, step, row, byte]; a last partial tile keeps its padding
            t0, rows = r0 // 16, r1 - r0
            whole = rows // 16 * 16
            dst = q8.view(n_out // 16, g, 8, 16, 4)
            if whole:
                dst[t0: t0 + whole // 16] = u[:whole].view(whole // 16, 16, g, 8, 4).permute(0, 2, 3, 1, 4)
            if rows > whole:
                dst[t0 + whole // 16, :, :, : rows - whole] = u[whole:].view(rows - whole, g, 8, 4).permute(1, 2, 0, 3)
        else:
            q8[r0:r1] = u.view(r1 - r0, k // 64, 2, 32)[:, :, blk, idx].reshape(r1 - r0, k)
    if tiles:
        d = q4_kernel.scales_to_tiles(d)
    return q8, d


def main(argv: list[str]) -> int:
    if argv[:1] == ["--build"]:
        parent = os.environ.get("KVSERVE_BUILD_PARENT")
        if parent and parent.isdigit():
            _die_with_parent(int(parent))
        build_now()
        print(build_dir())
        return 0
    print("usage: python -m kvserve.models.decode_native --build", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
