"""One loaded model (a *runner*, in Ollama's terms) and the path every face uses to run a request.

A :class:`Runner` holds what the faces need for one model: its engine (with its own engine
thread), tokenizer, chat template, slots, grammar backend, metrics window and names. The model
manager (:mod:`kvserve.serving.manager`) decides when runners are built (:func:`load_runner`)
and closed (:meth:`Runner.close`); :func:`estimate_runner_memory` is its prediction of a
runner's size before it loads.

:func:`generate` places a request in one of the runner's slots, runs it on the engine and keeps
the slot's view current.

Thread-safety: a runner is built on a loader thread, then read and changed only on the
server's asyncio loop (its engine runs on its own thread behind ``AsyncEngine``).
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.engine.request import Request, RequestOutput
from kvserve.errors import ServerFaultError
from kvserve.serving.generation_config import model_defaults
from kvserve.serving.manager import MemoryEstimate, ModelSpec, estimate_memory
from kvserve.serving.metrics import Metrics
from kvserve.serving.slots import SlotManager
from kvserve.structured.backend import GrammarBackend

if TYPE_CHECKING:  # pragma: no cover
    from kvserve.chat.template import ChatTemplate
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.serving.args import ServerArgs

log = logging.getLogger("kvserve.server")

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

KV_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 1}


def _srv(level: int, func: str, msg: str, *a) -> None:
    log.log(level, msg, *a, extra={"func": func})


class Runner:
    """One loaded model: everything a face reads to serve a request for it.

    Attributes:
        spec: the :class:`ModelSpec` it was loaded for.
        args: the server's ServerArgs (engine options and defaults come from the flags).
        engine: the AsyncEngine (its own engine thread).
        tokenizer: the model's Tokenizer.
        template: the ChatTemplate (see :func:`make_template`: a store model's TEMPLATE layer, the
            flags', the model's, else ChatML).
        slots: the SlotManager for ``/slots`` and slot selection.
        grammars: the GrammarBackend (structured outputs); xgrammar loads on first use.
        metrics: this model's Metrics window (``/metrics``).
        model_alias: the name responses show (``spec.name``).
        served_names: every name the model answers to.
        model_path: the resolved file or directory.
        default_params: this model's SamplingParams defaults: the flags' (``--temp``, ``-n``...)
            with the model's own (generation_config.json, GGUF ``general.sampling.*``) merged by
            :func:`kvserve.serving.generation_config.model_defaults`.
        generation: that merge's :class:`~kvserve.serving.generation_config.ModelDefaults`
            (where each default came from; the Ollama face layers its file values).
        build_info: the server's build string.
        measured_bytes: the process's resident memory growth while it loaded (bytes), plus on
            the CPU the KV pool for running sequences (allocated, not yet written), or 0.
    """

    def __init__(self, args: "ServerArgs", spec: ModelSpec, engine: "AsyncEngine",
                 template: "ChatTemplate | None", build_info: str, measured_bytes: int = 0):
        self.spec = spec
        self.args = args
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.template = template
        self._device = str(engine.core.device)
        self.slots = SlotManager(engine.n_slots, engine.n_ctx_slot, args.slot_prompt_similarity, engine=engine,
                                 speculative=engine.core.config.spec.method is not None)
        self.grammars = GrammarBackend(engine.tokenizer, engine.core.model_config.n_vocab)
        self.metrics = Metrics(self)
        self.model_alias = spec.name
        self.served_names = spec.served_names()
        self.model_path = spec.path
        self.generation = model_defaults(args, spec.path, engine.core.model_info.metadata)
        self.default_params = self.generation.params
        self.build_info = build_info
        self.measured_bytes = measured_bytes
        _log_tool_support(args, template)

    task = "generate"  # the runner protocol's kinds (kvserve.serving.runner_protocol.ModelRunner)

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @property
    def device(self) -> str:
        """Where the engine runs (``cpu``, ``cuda:0``...)."""
        return self._device

    def require_generative(self) -> None:
        """A generative model: nothing to refuse."""

    def engine_counts(self) -> tuple[int, int, float]:
        """``(running, queued, kv usage 0..1)``: the engine's batch, its queue and the fraction of
        KV blocks held. Plain reads of the engine thread's containers: racy by a step, harmless.
        ``(0, 0, 0.0)`` once closed."""
        engine = self.engine
        core = engine.core if engine is not None else None
        if core is None:
            return 0, 0, 0.0
        sched = core.scheduler
        return len(sched.running), len(sched.waiting), float(core.kv.usage)

    def require_ready(self) -> None:
        """Raise ServerFaultError when this model's engine died (its requests then fail at once)."""
        engine = self.engine
        if engine is None:
            raise ServerFaultError(f"model '{self.model_alias}' was unloaded")
        err = engine.error
        if err is not None:
            raise ServerFaultError(f"the engine failed ({type(err).__name__}) and serves no more requests: "
                                   "restart the server")

    @property
    def lora(self):
        """The engine's LoRA adapters (kvserve.lora.LoraRegistry), or None (unloaded, or an engine
        without them: an embedding model, tensor/pipeline parallelism)."""
        core = getattr(self.engine, "core", None)
        return getattr(getattr(core, "runner", None), "lora", None)

    def needs_reload(self, spec: ModelSpec) -> bool:
        """A runner whose engine died is replaced by a fresh load once idle (not a pinned one:
        its requests keep saying what happened, as llama-server does)."""
        return self.engine is not None and self.engine.error is not None and not self.spec.pinned

    def close(self) -> None:
        """Stop the engine thread and drop every reference to the model, then hand the freed
        heap back to the OS (glibc keeps freed arenas otherwise: measured, ~630 MiB of SmolLM2's
        780 MiB stayed resident after ``gc.collect()`` alone)."""
        self.metrics.freeze()  # the counters outlive the runner (kvserve.serving.metrics)
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()
        self.tokenizer = self.template = self.slots = self.grammars = None
        del engine
        gc.collect()
        trim_heap()


def trim_heap() -> None:
    """``malloc_trim(0)`` where glibc has it: freed memory goes back to the OS now."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def rss_bytes() -> int:
    """This process's resident set size (VmRSS of /proc/self/status), 0 where unknown."""
    return pid_rss_bytes("self")


# -- loading ------------------------------------------------------------------------------

def make_template(args: "ServerArgs", core, spec: ModelSpec | None = None):
    """The runner's chat template.

    Which one (the first that applies):

    1. the store model's TEMPLATE layer (``spec.name`` in the store, its weights ``spec.path``):
       a Go template rendered as Ollama renders it
       (:class:`~kvserve.chat.go_chat_template.GoChatTemplate`); one that kvserve's Go renderer
       cannot parse is logged and skipped;
    2. ``--chat-template-file``, then ``--chat-template``: a file's path (vLLM), one of
       llama-server's built-in names (:mod:`kvserve.chat.builtin_templates`) or Jinja text;
    3. the model's own Jinja template (GGUF ``tokenizer.chat_template`` or the HF tokenizer's);
    4. ChatML.

    The model's SYSTEM layer, when it has one, is the default system message of every chat
    rendered with it (:func:`~kvserve.chat.go_chat_template.with_default_system`). A model
    outside the store (a path, a ``-m`` alias) gets 2-4 with no default system, as before.

    A Jinja template renders message content as ``--chat-template-content-format`` says
    (:func:`~kvserve.chat.builtin_templates.with_content_format`).

    Raises:
        OSError: ``--chat-template-file`` (or a ``--chat-template`` file) cannot be read.
            TemplateError: a Jinja template that does not compile. ChatTemplateChoiceError: a
            ``--chat-template`` value that is none of the three (parse_args refuses it first).
    """
    from kvserve.chat.builtin_templates import (
        resolve_chat_template,
        with_content_format,
    )
    from kvserve.chat.go_chat_template import (
        GoChatTemplate,
        SystemChatTemplate,
        store_layers,
    )
    from kvserve.chat.template import ChatTemplate, TemplateError

    tok = core.tokenizer
    go_text, system = None, ""
    if spec is not None and spec.name:
        go_text, system = store_layers(getattr(args, "models_dir", None), spec.name, spec.path)
    if go_text is not None:
        try:
            return GoChatTemplate(go_text, tok.bos_token, tok.eos_token, system=system)
        except TemplateError as e:
            _srv(logging.WARNING, "load_model", "model '%s': its TEMPLATE layer is not used (%s); rendering "
                 "with the chat template of the flags or the model file instead", spec.name, e)
    if args.chat_template_file:
        with open(args.chat_template_file, encoding="utf-8") as f:
            source = f.read()
    elif args.chat_template:
        source = resolve_chat_template(args.chat_template)[1]
    else:
        source = core.chat_template or getattr(tok, "chat_template", None) or CHATML
    content_format = getattr(args, "chat_template_content_format", "auto")
    if system:
        return with_content_format(SystemChatTemplate, content_format)(source, tok.bos_token, tok.eos_token,
                                                                       system=system)
    return with_content_format(ChatTemplate, content_format)(source, tok.bos_token, tok.eos_token)


def engine_config(args: "ServerArgs", spec: ModelSpec):
    """The EngineConfig of one runner: the server's flags, with the spec's context size."""
    cfg = args.engine_config()
    if spec.n_ctx is not None:
        cfg.n_ctx = spec.n_ctx
    share = getattr(args, "cache_ram_share", None)
    if cfg.cache_ram is None and share:  # several models: each gets its share of the host tier
        budget = cfg.cache_ram_mib() // share
        if args.max_memory:  # and at most a quarter of its share of --max-memory
            budget = min(budget, (args.max_memory >> 20) // (4 * share))
        cfg.cache_ram = max(0, budget)
    return cfg


def load_runner(args: "ServerArgs", spec: ModelSpec, build_info: str) -> Runner:
    """Load ``spec`` (the loader of :class:`~kvserve.serving.manager.ModelManager`).

    An encoder (the registry's task ``embed`` or ``score``), and every model with
    ``--embeddings``, loads as an :class:`~kvserve.serving.embed_runner.EmbeddingRunner`.

    Logs llama-server's lines (``loading model``, ``initializing, n_slots = ...``).

    Raises:
        ModelLoadError / FileNotFoundError / TemplateError: the file or template is bad;
        UnsupportedFormatError (a ModelLoadError): a format kvserve does not run
        (:mod:`kvserve.loaders.detect`).
    """
    if spec.path:  # a format kvserve does not run gets its one line before any check reads it
        from kvserve.loaders.detect import require_loadable

        require_loadable(spec.path)
    with weight_memory(spec.use_mmap):
        runner = _load_runner(args, spec, build_info)
        if getattr(runner, "weight_memory", None) is None:  # not a GGUF chat model: the mode asked for
            from kvserve.loaders import gguf

            runner.weight_memory = gguf._weight_memory()
    return runner


def weight_memory(use_mmap: bool | None):
    """A context in which GGUF weights load as ``use_mmap`` asks (Ollama's option, a
    :class:`~kvserve.serving.manager.ModelSpec` field): True the file's mapping ("mmap"), False
    read into memory ("read"; kvserve.loaders.gguf.set_weight_memory), logged; None the server's
    mode (``--mmap`` / ``--no-mmap`` / ``KVSERVE_MMAP``). The mode is the process's: this is safe
    because the model manager runs one load at a time."""
    import contextlib

    if use_mmap is None:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def held():
        from kvserve.loaders import gguf

        before = getattr(gguf, "_WEIGHT_MEMORY", "auto")  # "auto" unless a caller set it
        _srv(logging.INFO, "load_model", "use_mmap %s: %s", str(use_mmap).lower(),
             "the weights are served from the file's mapping" if use_mmap else "the weights are read into memory")
        gguf.set_weight_memory("mmap" if use_mmap else "read")
        try:
            yield
        finally:
            gguf.set_weight_memory(before)

    return held()


def _load_runner(args: "ServerArgs", spec: ModelSpec, build_info: str) -> Runner:
    """:func:`load_runner` after the format check, in the spec's weight memory mode."""
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine.core import EngineCore
    from kvserve.models.build import load_files
    from kvserve.serving.embed_runner import load_embedding_runner, model_task
    from kvserve.serving.startup_checks import run_startup_checks

    if args.embeddings or model_task(spec.path) != "generate":  # an encoder, or llama-server's --embeddings
        return load_embedding_runner(args, spec, build_info)
    before = rss_bytes()
    _srv(logging.INFO, "load_model", "loading model '%s'", spec.path)
    cfg = engine_config(args, spec)
    for level, text in run_startup_checks(args, spec.path, cfg):  # vLLM's checks, before reading the weights
        _srv(level, "load_model", "%s", text)
    loaded = load_files(spec.path)
    core = EngineCore(loaded, cfg)
    load_adapters(core, args, spec)  # before measuring: the adapters' memory is the runner's
    template = make_template(args, core, spec)
    _srv(logging.INFO, "load_model", "initializing, n_slots = %d, n_ctx_slot = %d, kv_unified = '%s'",
         core.n_slots, core.n_ctx_slot, "true" if cfg.unified else "false")
    if args.log_verbosity >= 4:
        _srv(logging.INFO, "load_model", "prompt cache is enabled, size limit: %d MiB", core.cache_ram_mib)
    from kvserve.engine import heap

    heap.trim()  # the load's temporaries (header strings, the tokenizer's build) back to the kernel first
    grown = max(rss_bytes() - before, 0)
    if core.device.type == "cpu":  # the KV pool is torch.empty host memory: resident only once written
        grown += kv_pool_bytes(core)
    runner = Runner(args, spec, AsyncEngine(core), template, build_info, grown)
    # the mode its GGUF weights were loaded in: "mmap" or "read" (a face compares use_mmap with it);
    # "mmap" also where "read" was asked and the private memory could not be had
    runner.weight_memory = getattr(loaded, "weight_memory", None)
    for level, text in runner.generation.notes:
        _srv(level, "load_model", "%s", text)
    if runner.generation.log_line():
        _srv(logging.WARNING, "load_model", "%s", runner.generation.log_line())
    # import xgrammar and build its vocabulary table off the request path (~0.3-0.5 s of a core since
    # xgrammar is imported without transformers, kvserve.structured.xgr; ~1.5-2 s, most of it holding
    # the GIL, before), so the first constrained request does not pay for it; at the first idle
    # moment, so the first requests do not share the cores with it either
    native = getattr(core.runner, "native", None)
    threading.Thread(target=_warm_grammars, args=(runner, native), name="grammar-warmup", daemon=True).start()
    return runner


def kv_pool_bytes(core) -> int:
    """The bytes of an engine's KV pool for its running sequences (``pool.active_blocks``; the null
    block and the ``--cache-ram`` host tier not counted), as its layout keeps them: the full-attention
    layers' blocks plus each sliding-window group's own pool (gemma's sliding layers, phi3's window:
    kvserve.engine.kv_budget.KVLayout.kv_bytes), not every layer's bytes for every block."""
    return core.kv_layout.kv_bytes(core.pool.active_blocks, core.n_slots, core.pool.group_cap)


def load_adapters(core, args: "ServerArgs", spec: ModelSpec) -> None:
    """Set the engine's LoRA limits (``--max-loras``, ``--max-lora-rank``) and load ``spec.adapters``
    (llama-server's ``--lora`` / ``--lora-scaled``), logging llama-server's lines.

    Raises ModelLoadError: an adapter that does not load (the message names the file and why)."""
    from kvserve.errors import KvserveError
    from kvserve.loaders.weights import ModelLoadError

    reg = getattr(core.runner, "lora", None)
    if reg is None:
        if spec.adapters:
            raise ModelLoadError(f"LoRA adapters are not supported with this engine ({spec.adapters[0][0]})")
        return
    reg.max_loras = getattr(args, "max_loras", None)
    reg.max_lora_rank = getattr(args, "max_lora_rank", None)
    reg.lora_dtype = getattr(args, "lora_dtype", "auto")  # vLLM's --lora-dtype
    for path, scale in spec.adapters:
        _srv(logging.INFO, "load_model", "loading LoRA adapter '%s'", path)
        try:
            reg.load(path, scale=scale)
        except KvserveError as e:
            raise ModelLoadError(f"failed to load LoRA adapter: {e.message}") from e


#: the grammar warm-up waits for this many seconds without a running or queued request
WARMUP_IDLE_S = 0.5
#: ... but not longer than this after the load (a server busy from its start warms up then)
WARMUP_WAIT_MAX_S = 30.0


def _warm_grammars(runner: Runner, native=None, idle_s: float | None = None,
                   wait_max_s: float | None = None) -> None:
    """Build the structured-output compiler of ``runner`` in the background.

    First, with a cached native decode step (``native``, a NativeDecode), it waits up to 30 s for
    the step's weights to be packed (the engine's first step waits for that packing) and trims the
    heap. Then it waits until the runner has had no request running or queued for
    :data:`WARMUP_IDLE_S` s (at most :data:`WARMUP_WAIT_MAX_S` s): on 2 cores the import beside
    the first requests after /health had slowed them (the warm-up beside the packing: ~1.3-2 s
    instead of ~0.2 s for the first request). A constrained request that comes earlier builds
    the compiler itself (GrammarBackend's lock: once). Nothing when the runner is closed meanwhile."""
    if native is not None and native.cached:
        native.packed(30.0)
        trim_heap()  # the packing's temporaries (~25 MiB for SmolLM2) go back to the OS
    _wait_idle(runner, WARMUP_IDLE_S if idle_s is None else idle_s,
               WARMUP_WAIT_MAX_S if wait_max_s is None else wait_max_s)
    grammars = runner.grammars
    if grammars is None or runner.engine is None:  # closed meanwhile
        return
    try:
        grammars._get_compiler()
    except Exception as e:  # noqa: BLE001 - a constrained request reports the real error later
        _srv(logging.WARNING, "load_model", "structured outputs backend failed to start: %s", e)


def _wait_idle(runner: Runner, idle_s: float, wait_max_s: float, poll_s: float = 0.05) -> bool:
    """Block until ``runner``'s slots have been idle with nobody queued for ``idle_s`` seconds (True),
    or ``wait_max_s`` seconds passed or the runner closed (False). Reads the slots' counts from this
    thread (plain integer reads; a stale one costs one more poll)."""
    start = quiet = time.monotonic()
    while runner.engine is not None:
        now = time.monotonic()
        slots = runner.slots
        if slots is None:
            return False
        if slots.n_busy or slots.n_deferred:
            quiet = now
        elif now - quiet >= idle_s:
            return True
        if now - start >= wait_max_s:
            return False
        time.sleep(poll_s)
    return False


_SHAPES: dict[tuple[str, int, int], tuple] = {}


def model_shape(path: str) -> tuple:
    """(config: ModelConfig, file bytes, parameter count) of a .gguf file or HF directory,
    from its header only (cached by path, size and mtime)."""
    p = Path(path)
    if p.is_dir():
        import json

        from kvserve.models.family import read_hf_config

        st = (p / "config.json").stat()
        key = (str(p), st.st_size, st.st_mtime_ns)
        if key not in _SHAPES:
            cfg = read_hf_config(json.loads((p / "config.json").read_text(encoding="utf-8")), str(p))
            files = sorted(p.glob("*.safetensors"))
            size = sum(f.stat().st_size for f in files)
            n_params = _hf_params(files)
            _SHAPES[key] = (cfg, size, n_params)
        return _SHAPES[key]
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns)
    if key not in _SHAPES:
        from kvserve.loaders.gguf import read_gguf_header
        from kvserve.models.family import read_gguf_config

        md, tensors = read_gguf_header(str(p))
        _SHAPES[key] = (read_gguf_config(md, str(p)), st.st_size, sum(t.n_elements for t in tensors))
    return _SHAPES[key]


def _type_name(gguf, ggml_type: int) -> str:
    """The ggml type's name ("MXFP4" for Ollama's gpt-oss type 4, see kvserve.loaders.gguf)."""
    from kvserve.loaders.gguf import OLLAMA_MXFP4

    return "MXFP4" if ggml_type == OLLAMA_MXFP4 else gguf.GGMLQuantizationType(ggml_type).name


def gguf_raw_bytes(path: str) -> tuple[int, int]:
    """(bytes, values) of a .gguf file's matrices and stacked experts that load as the file stores them (the types of
    :data:`kvserve.loaders.gguf.RAW_TYPES`, multiplied by the GGUF block kernels with no dense
    copy); (0, 0) for an HF directory. From the header only, cached by path, size and mtime."""
    p = Path(path)
    if p.is_dir():
        return 0, 0
    st = p.stat()
    key = ("raw", str(p), st.st_size, st.st_mtime_ns)
    if key not in _SHAPES:
        import gguf

        from kvserve.loaders.gguf import RAW_TYPES, read_gguf_header

        _, tensors = read_gguf_header(str(p))
        raw = [t for t in tensors if len(t.shape) in (2, 3) and _type_name(gguf, t.ggml_type) in RAW_TYPES]
        _SHAPES[key] = (sum(t.n_bytes for t in raw), sum(t.n_elements for t in raw))
    return _SHAPES[key]


def _hf_params(files) -> int:
    import json
    import struct

    n = 0
    for f in files:
        with open(f, "rb") as fh:
            (hlen,) = struct.unpack("<Q", fh.read(8))
            if hlen > 100 << 20:
                continue
            header = json.loads(fh.read(hlen))
        for k, v in header.items():
            if k != "__metadata__" and isinstance(v, dict):
                count = 1
                for d in v.get("shape", []):
                    count *= int(d)
                n += count
    return n


#: the projections the native decode step may hold in its own 4-bit tiles (decode_native.q4_tiles)
_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def native_copy_bytes(path: str) -> int:
    """Bytes the native decode step keeps beside a .gguf file's blocks (0 for an HF directory), from
    the header only (:mod:`kvserve.models.decode_native`, measured on its layouts):

    - Q4_0/Q4_1 projections repacked into its 4-bit tiles (:func:`~kvserve.models.decode_native.q4_tiles`:
      half a byte a value plus a float16 scale and offset a block of 32: 0.625 bytes a value, rows
      padded to 16) where :func:`~kvserve.models.decode_native.q4_repacked` says this CPU's build
      repacks them (AVX2; on AVX512 Q4_1 only: Q4_0 stays the file's blocks);
    - a Q8_0 head of at most ``SMALL_HEAD_BYTES`` (the output matrix, or the tied embedding)
      requantized into its int8 tiles (:func:`~kvserve.models.decode_native.pack_q8`: a byte a value
      plus a float16 scale a block of 32, rows padded to 16).

    The caller decides whether the step runs (:func:`_native_step_expected`)."""
    p = Path(path)
    if p.is_dir():
        return 0
    import gguf

    from kvserve.loaders.gguf import read_gguf_header
    from kvserve.models.decode_native import SMALL_HEAD_BYTES, cpu_isa, q4_repacked

    _, tensors = read_gguf_header(str(p))
    by_name = {t.name: t for t in tensors}
    total = 0
    isa = cpu_isa()
    for t in tensors:
        parts = t.name.split(".")
        if (len(t.shape) == 2 and len(parts) == 4 and parts[0] == "blk" and parts[2] in _PROJECTIONS
                and _type_name(gguf, t.ggml_type) in ("Q4_0", "Q4_1") and t.shape[0] % 64 == 0
                and q4_repacked(_type_name(gguf, t.ggml_type), isa)):
            k, n = t.shape
            total += -(-n // 16) * 16 * k * 5 // 8  # [N, K/2] nibbles + [N, K/32] float16 scales and offsets
    head = by_name.get("output.weight") or by_name.get("token_embd.weight")
    if (head is not None and len(head.shape) == 2 and _type_name(gguf, head.ggml_type) == "Q8_0"
            and head.n_bytes <= SMALL_HEAD_BYTES and head.shape[0] % 64 == 0):
        k, n = head.shape
        total += -(-n // 16) * 16 * (k + k // 32 * 2)  # [N, K] int8 + [N, K/32] float16 scales
    return total


def _native_step_expected(cfg, cfg_m) -> bool:
    """Whether the native decode step will run for this model (as kvserve.models.build and
    NativeDecode decide: CPU, dtype auto, no --compile, ``KVSERVE_NATIVE_DECODE`` not 0, the
    extension buildable here, a family with the native layer, head_dim a multiple of 32, a float
    KV cache)."""
    import os

    from kvserve.models import decode_native
    from kvserve.models.family import family_of

    if (cfg.resolve_device() != "cpu" or cfg.dtype != "auto" or cfg.compile
            or os.environ.get("KVSERVE_NATIVE_DECODE", "1") == "0" or decode_native.unavailable_reason() is not None):
        return False
    if {cfg.kv_dtype, cfg.kv_dtype_v or cfg.kv_dtype} - {"f32", "f16", "bf16"}:
        return False
    try:
        return bool(family_of(cfg_m.arch).native_decode(cfg_m)) and cfg_m.head_dim % 32 == 0
    except Exception:  # noqa: BLE001 - an unknown family: the load says why
        return False


def _block_kernels_enabled() -> bool:
    """Whether GGUF matrices stay as stored at load (kvserve.models.ggml_kernel.enabled)."""
    from kvserve.models import ggml_kernel

    return ggml_kernel.enabled()


def estimate_runner_memory(args: "ServerArgs", spec: ModelSpec) -> MemoryEstimate:
    """Predict one runner's memory before loading it (seed 004 Example 5's formula, for kvserve).

    - weights: the file's bytes (as Ollama counts them; mapped, and resident once read) plus the
      copies kvserve makes: of every tensor but the GGUF matrices the block kernels multiply as
      stored (:func:`gguf_raw_bytes`: their file bytes alone, Q4_0/Q4_1 and the embedding table
      included) a dense one (parameters x 4 bytes in float32, x 2 in bfloat16: the norms of a
      quantized file), and the native decode step's tiles where it runs
      (:func:`native_copy_bytes`); or the parameters in the chosen ``--dtype`` when that
      replaces the file's format;
    - kv: n_ctx x the pool's bytes per token for ``-ctk``/``-ctv``
      (:func:`~kvserve.engine.kv_quant.kv_bytes_per_token`: 2 bytes a value for f16, 34/32 for
      q8_0, 18/32 for q4_0, 1 for fp8); sliding-window layers (gemma2, gemma3) counted at their
      windows' blocks per slot and one step's chunk (:class:`~kvserve.engine.kv_budget.KVLayout`);
    - compute: one batch's activations plus one row of logits per slot, in float32;
    - cache: the host tier of the prompt cache at its limit (``--cache-ram``, or this model's
      share of the default);
    - tokenizer: :data:`TOKENIZER_BYTES_PER_TOKEN` a vocabulary entry.

    Measured against ``/proc`` (VmRSS growth after load, the native step's tiles packed, plus the
    KV pool as written; random Llama-3.2-1B-shaped files and SmolLM2, ``-c 4096 -np 1``), the
    resident part (:attr:`~kvserve.serving.manager.MemoryEstimate.resident`) is within 5%.

    An encoder (embedding or reranking model) has no KV cache:
    :func:`~kvserve.serving.embed_runner.estimate_encoder_memory`.

    Raises:
        ModelLoadError / OSError: the file's header cannot be read; UnsupportedFormatError (a
            ModelLoadError): a format kvserve does not run, its one line (kvserve.loaders.detect).
    """
    from kvserve.serving.embed_runner import estimate_encoder_memory, model_task

    if spec.path:
        from kvserve.loaders.detect import require_loadable

        require_loadable(spec.path)

    if model_task(spec.path) != "generate":
        return estimate_encoder_memory(args, spec)
    cfg_m, file_bytes, n_params = model_shape(spec.path)
    cfg = engine_config(args, spec)
    n_ctx = cfg.resolve_n_ctx(cfg_m.n_ctx_train)
    dense = {"float32": 4, "bfloat16": 2, "float16": 2}
    if cfg.dtype == "auto":
        large = 2 if cfg.large_batch_dtype in ("bfloat16",) else 4
        weights = file_bytes + n_params * large
        if cfg.resolve_device() == "cpu" and _block_kernels_enabled():
            weights -= gguf_raw_bytes(spec.path)[1] * large  # no dense copy of these (every row count)
        if _native_step_expected(cfg, cfg_m):
            weights += native_copy_bytes(spec.path)
    else:
        weights = n_params * dense.get(cfg.dtype, 4)
    tokenizer = TOKENIZER_BYTES_PER_TOKEN * cfg_m.n_vocab
    n_tok = min(max(cfg.max_num_batched_tokens, 1), n_ctx)
    compute = 4 * (n_tok * (8 * cfg_m.n_embd + 3 * cfg_m.n_ff) + cfg.n_slots * cfg_m.n_vocab)
    est = estimate_memory(weights, cfg_m.n_layer, cfg_m.n_head_kv, cfg_m.head_dim, n_ctx,
                          KV_BYTES.get(cfg.kv_dtype, 2), compute)
    from kvserve.serving.startup_checks import engine_kv_layout, known_kv_budget

    try:  # the pool's own bytes for the K and V types (q4_0: 18/32 bytes a value, fp8: 1)
        lay = engine_kv_layout(cfg, cfg_m)
        kv = lay.block_bytes * n_ctx // cfg.block_size  # the full-attention layers: every token
        if lay.windows:  # sliding-window layers: their windows' blocks (kvserve.engine.kv_budget)
            blocks = -(-n_ctx // cfg.block_size) + cfg.n_slots
            kv += lay.kv_bytes(blocks, cfg.n_slots) - blocks * lay.block_bytes
        est = dataclasses.replace(est, kv=kv)
    except ValueError:  # a type or head_dim the load refuses with its own message
        pass

    budget = known_kv_budget(cfg, cfg_m)  # a vLLM KV budget sizes the pool instead of n_ctx
    if budget is not None:
        est = dataclasses.replace(est, kv=budget)
    return dataclasses.replace(est, cache=max(cfg.cache_ram_mib(), 0) << 20, tokenizer=tokenizer)


#: resident bytes of a loaded tokenizer per vocabulary entry (the HF tokenizer's vocabulary and
#: merges, the token texts and piece bytes): 24 MiB measured for SmolLM2's 49,152 entries
TOKENIZER_BYTES_PER_TOKEN = 512


# -- running a request --------------------------------------------------------------------

def fair_share(runner: Runner) -> asyncio.Semaphore:
    """The gate one request's sequences (prompts x ``n``) pass to reach :func:`generate`:
    at most ``n_slots`` of them wait for or hold a slot at a time. Without it a request of
    2,000 prompts queued all of them ahead of every later request (a bystander waited 120 s);
    with it each of its next sequences queues behind the requests that arrived meanwhile."""
    return asyncio.Semaphore(max(1, runner.engine.n_slots if runner.engine is not None else 1))


async def generate(runner: Runner, request: Request, params_view: dict | None = None, *,
                   whole: bool = False) -> AsyncIterator[RequestOutput]:
    """Run ``request`` in one of ``runner``'s slots and yield its outputs.

    ``request`` comes admitted by its plan (:func:`kvserve.serving.admission.admit`: its prompt,
    limit and ``id_slot`` checked against this runner's model). ``request.priority_slot`` is the
    requested ``id_slot`` (-1 = any); it is set to the slot actually used. Waits (counted as
    deferred) while every slot is busy. A refusal by the engine (InvalidRequestError) is raised
    before the first output. Closing the iterator early (client disconnect) aborts the request in
    the engine and frees the slot.

    Args:
        params_view: what ``/slots`` shows as the slot's ``params`` (the face renders it).
        whole: the caller answers only once the request is complete (non-streamed): the engine
            merges its outputs after the first (:meth:`AsyncEngine.generate`), so the loop is not
            woken per token; merged outputs carry ``parts``, which the metrics count one by one.
    """
    runner.require_ready()
    engine, slots = runner.engine, runner.slots
    slot = await slots.acquire(request.prompt_token_ids, request.priority_slot)
    try:
        request.priority_slot = slot.id
        slot.begin(request.prompt_token_ids, slots.next_task_id(), request.params.n_predict, params_view or {})
        stream = engine.generate(request, whole=True) if whole else engine.generate(request)
        try:
            async for out in stream:
                slot.update(out)
                runner.metrics.on_output(out)
                yield out
        finally:
            await stream.aclose()
    finally:
        slots.release(slot)


def pid_rss_bytes(pid: int | str) -> int:
    """VmRSS of process ``pid`` (or ``"self"``) in bytes, 0 where unknown (tests measure a
    server's memory with it)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


__all__ = ["CHATML", "Runner", "estimate_runner_memory", "fair_share", "generate", "load_runner",
           "make_template", "model_shape", "pid_rss_bytes", "rss_bytes", "trim_heap"]


def _log_tool_support(args: "ServerArgs", template: "ChatTemplate | None") -> None:
    """Say at start when ``--tool-call-parser`` meets a chat template that renders no tools: the
    model then never sees the tool definitions (vLLM passes them to the template only). Without
    the flag a request's tools use the generic format (:mod:`kvserve.chat.tool_generic`)."""
    if not args.tool_call_parser or template is None:
        return
    try:
        renders = bool(template.caps.get("supports_tools"))
    except Exception:  # a probe that fails says nothing about tools
        return
    if not renders:
        log.warning("--tool-call-parser %s: the chat template renders no tools, so the model never sees the "
                    "request's tool definitions; use a template with tool support (--chat-template-file) or "
                    "leave out --tool-call-parser to get llama-server's generic tool format",
                    args.tool_call_parser)
