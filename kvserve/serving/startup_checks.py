"""vLLM's start-up checks and messages for ``kvserve serve`` (002 Examples 2, 3, 4 and 6).

Run before a generative model's weights are read (:func:`run_startup_checks`, from
``load_runner``), on the model's header: ``config.json`` (+ ``tokenizer_config.json``) of an HF
directory, or the GGUF metadata. A failed check raises :class:`StartupCheckError` (a
:class:`~kvserve.loaders.weights.ModelLoadError`): the preloaded model's server logs the text and
exits 1 without a traceback (vLLM raises a ValueError and also exits 1); a model loaded on demand
answers its request with the text.

* **max_model_len** (vLLM's ``_get_and_verify_max_len``): ``--max-model-len`` above the model's
  derived maximum (the smallest of ``max_position_embeddings``, ``n_positions``, ... in
  config.json, the tokenizer's ``model_max_length``, times a RoPE scaling factor other than
  llama3/longrope; a GGUF's ``<arch>.context_length``) is vLLM's error, unless
  ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``: then vLLM's warning and the server starts with that
  length. llama-server's ``-c`` keeps llama-server's rule: a context above ``n_ctx_train`` starts
  with llama.cpp's "possible training context overflow" warning.
* **KV budget** (:mod:`kvserve.engine.kv_budget`): with ``--kv-cache-memory-bytes``,
  ``VLLM_CPU_KVCACHE_SPACE`` (CPU) or ``--num-gpu-blocks-override`` the check that one request of
  max_model_len fits runs here, before loading; ``--gpu-memory-utilization`` (CUDA) is checked by
  the engine once the weights are on the device. kvserve's own limits (the module docstring of
  ``kv_budget``): a budget is capped to what the slots use at once, and on the CPU a budget above
  ``MemAvailable`` is refused, here, before loading.
* **Batch limits** (vLLM's SchedulerConfig, when ``--max-num-seqs`` or
  ``--max-num-batched-tokens`` is given; the sequence count is the ``--max-num-seqs`` typed, even
  when ``-np`` sets the slots): a token budget below the sequence count is an error at
  parse time (:func:`batch_error`, exit 2); one above ``max_num_seqs * max_model_len`` a warning
  here (:func:`batch_warning`).
* **Quantization and dtype** (vLLM's ``_verify_quantization`` and ``--dtype auto``): see
  :func:`check_quantization` and :func:`resolve_dtype`.
* **Parallel layout** (002 Example 5, vLLM's ``ModelConfig.verify_with_parallel_config``):
  ``-tp`` must divide the attention heads ("Total number of attention heads (9) must be divisible
  by tensor parallel size (2)." for SmolLM2), divide the KV heads or be a multiple of them, and
  ``-pp`` must not exceed the layers (:func:`kvserve.engine.parallel.parallel_error`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.loaders.weights import ModelConfig, ModelLoadError

#: vLLM's ``QuantizationMethods`` in the pinned source (``-q/--quantization`` values)
VLLM_QUANT_METHODS = (
    "awq", "auto_awq", "fp8", "fbgemm_fp8", "fp_quant", "modelopt", "modelopt_fp4", "modelopt_mxfp8",
    "modelopt_mixed", "auto_gptq", "gptq", "gptq_marlin", "awq_marlin", "humming", "compressed-tensors",
    "experts_int8", "quark", "moe_wna16", "torchao", "inc", "mxfp4", "gpt_oss_mxfp4", "deepseek_v4_fp8", "online",
    "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "int8_per_channel_weight_only", "nvfp4_per_token", "mxfp8")
#: names of older vLLM releases that copied command lines still carry (``gguf``: kvserve's GGUF files)
OLDER_QUANT_METHODS = ("gguf", "bitsandbytes", "marlin", "gptq_marlin_24", "gptq_bitblas", "bitblas", "aqlm",
                       "deepspeedfp", "tpu_int8", "ptpc_fp8", "deepgemm_fp8", "qqq", "hqq", "neuron_quant", "ipex",
                       "auto-round", "cpu_gptq", "cpu_awq", "petit_nvfp4")
QUANT_METHODS = VLLM_QUANT_METHODS + OLDER_QUANT_METHODS
#: methods vLLM applies while loading unquantized weights (online quantization)
ONLINE_QUANT_METHODS = frozenset({
    "fp8", "ptpc_fp8", "experts_int8", "bitsandbytes", "torchao", "deepspeedfp", "online", "fp8_per_tensor",
    "fp8_per_block", "fp8_per_channel", "int8_per_channel_weight_only", "nvfp4_per_token", "mxfp8"})
#: kernel variants vLLM accepts for a checkpoint of the base method (its override methods)
_QUANT_BASE = {"awq_marlin": "awq", "cpu_awq": "awq", "gptq_marlin": "gptq", "gptq_marlin_24": "gptq",
               "gptq_bitblas": "gptq", "cpu_gptq": "gptq", "marlin": "gptq"}

#: config.json keys vLLM reads for a model's maximum length, in its order
MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")

LONG_MAX_MODEL_LEN_WARNING = (
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution. If the model uses relative position "
    "encoding (RoPE), positions exceeding derived_max_model_len lead to nan. If the model uses absolute position "
    "encoding, positions exceeding derived_max_model_len will cause a CUDA array out-of-bounds error.")

_TORCH_NAMES = {"float32": "torch.float32", "float16": "torch.float16", "bfloat16": "torch.bfloat16"}


class StartupCheckError(ModelLoadError):
    """A start-up check failed; the message is vLLM's text where vLLM has one."""


@dataclass
class ModelHeader:
    """What the checks read of a model without its weights.

    Attributes:
        path: the .gguf file or HF directory.
        format: "gguf" | "hf".
        config: kvserve's :class:`~kvserve.loaders.weights.ModelConfig` (sizes, n_ctx_train).
        hf: config.json (HF only; else empty).
        tokenizer_config: tokenizer_config.json (HF only, when present; else empty).
        arch: the GGUF ``general.architecture`` (GGUF only).
    """

    path: str
    format: str
    config: ModelConfig
    hf: dict = field(default_factory=dict)
    tokenizer_config: dict = field(default_factory=dict)
    arch: str = ""

    @property
    def quant_method(self) -> str | None:
        """The checkpoint's quantization: ``gguf`` for a GGUF file; an HF directory's
        ``quantization_config.quant_method`` (or compressed-tensors' ``compression_config``),
        lower-cased, ``""`` when the object has none; None when unquantized."""
        if self.format == "gguf":
            return "gguf"
        from kvserve.loaders.hf_quant import quantization_config

        qc = quantization_config(self.hf)
        if qc is None:
            return None
        method = str(qc.get("quant_method", "") if isinstance(qc, dict) else "").lower()
        return method.replace("compressed_tensors", "compressed-tensors")

    @property
    def torch_dtype(self) -> str | None:
        """config.json's ``torch_dtype`` (or transformers 5's ``dtype``); None for GGUF or absent."""
        value = self.hf.get("torch_dtype", self.hf.get("dtype"))
        return str(value).replace("torch.", "") if value else None


def read_header(path: str) -> ModelHeader:
    """The header of the model at ``path`` (no tensor data is read).

    Raises:
        ModelLoadError / OSError: the file or config.json cannot be read.
    """
    p = Path(path)
    if p.is_dir():
        from kvserve.models.family import read_hf_config

        try:
            hf = json.loads((p / "config.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ModelLoadError(f"{p}: no config.json") from None
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{p}/config.json: {e}") from None
        tok: dict = {}
        if (p / "tokenizer_config.json").is_file():
            try:
                tok = json.loads((p / "tokenizer_config.json").read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                tok = {}
        return ModelHeader(str(p), "hf", read_hf_config(hf, str(p)), hf, tok if isinstance(tok, dict) else {})
    from kvserve.loaders.gguf import read_gguf_header
    from kvserve.models.family import read_gguf_config

    md, _ = read_gguf_header(str(p))
    return ModelHeader(str(p), "gguf", read_gguf_config(md, str(p)), arch=str(md.get("general.architecture")))


# -- max_model_len ------------------------------------------------------------------------

def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def derived_max_model_len(h: ModelHeader) -> tuple[float, str, Any]:
    """vLLM's derived maximum length of the model: ``(length, key it came from, config.json's
    model_max_length or None)``.

    HF: the smallest of :data:`MAX_LEN_KEYS` present (config.json's ``model_max_length`` wins
    when set), capped by the tokenizer's ``model_max_length``, times the RoPE scaling factor
    unless its type is llama3/su/longrope (yarn starts from original_max_position_embeddings);
    2048 when no key is present (vLLM's default). GGUF: ``<arch>.context_length``.
    """
    if h.format == "gguf":
        return float(h.config.n_ctx_train), f"{h.arch}.context_length", None
    hf = h.hf
    derived, key = math.inf, None
    for k in MAX_LEN_KEYS:
        v = hf.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if v < derived:
                key = k
            derived = min(derived, v)
    if hf.get("model_max_length"):
        key, derived = "model_max_length", hf["model_max_length"]
    tml = h.tokenizer_config.get("model_max_length")
    if isinstance(tml, (int, float)) and not isinstance(tml, bool):
        derived = min(derived, tml)
    if derived == math.inf:
        derived = 2048
    rope = hf.get("rope_scaling") or hf.get("rope_parameters")
    if isinstance(rope, dict) and "gemma3" not in str(hf.get("model_type", "")):
        rope_type = rope.get("rope_type", rope.get("type"))
        if rope_type not in ("su", "longrope", "llama3"):
            factor = rope.get("factor", 1.0)
            if rope_type == "yarn" and "original_max_position_embeddings" in rope:
                derived = rope["original_max_position_embeddings"]
            derived = derived * factor
    return float(derived), key or "max_position_embeddings", hf.get("model_max_length")


def check_max_model_len(requested: int, h: ModelHeader, allow_long: bool) -> list[tuple[int, str]]:
    """vLLM's check of ``--max-model-len`` against the model (0: not given, nothing to check).

    Returns the log lines ((level, text)): vLLM's warning when allowed.

    Raises:
        StartupCheckError: above the derived maximum without ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``.
    """
    if requested <= 0:
        return []
    derived, key, model_max_length = derived_max_model_len(h)
    if requested <= derived:
        return []
    if model_max_length is not None and requested <= model_max_length:
        return []
    if h.format == "gguf":
        msg = (f"User-specified max_model_len ({requested}) is greater than the derived max_model_len "
               f"({key}={_number(derived)} in the model's GGUF metadata).")
    else:
        msg = (f"User-specified max_model_len ({requested}) is greater than the derived max_model_len "
               f"({key}={_number(derived)} or model_max_length={model_max_length} in model's config.json).")
    if allow_long:
        return [(logging.WARNING, f"{msg} {LONG_MAX_MODEL_LEN_WARNING}")]
    raise StartupCheckError(f"{msg} To allow overriding this maximum, set the env var "
                            f"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. {LONG_MAX_MODEL_LEN_WARNING}")


# -- batch limits ---------------------------------------------------------------------------

def batch_error(max_num_batched_tokens: int, max_num_seqs: int) -> str | None:
    """vLLM's SchedulerConfig error: a step's token budget below the sequence count."""
    if max_num_batched_tokens < max_num_seqs:
        return (f"max_num_batched_tokens ({max_num_batched_tokens}) must be greater than or equal to max_num_seqs "
                f"({max_num_seqs}).")
    return None


def batch_warning(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> str | None:
    """vLLM's SchedulerConfig warning: a budget no step can use (above seqs x max_model_len)."""
    if max_num_batched_tokens > max_num_seqs * max_model_len:
        return (f"max_num_batched_tokens ({max_num_batched_tokens}) exceeds max_num_seqs * max_model_len "
                f"({max_num_seqs * max_model_len}). This may lead to unexpected behavior.")
    return None


# -- quantization and dtype -------------------------------------------------------------------

def quantization_name_error(name: str) -> str | None:
    """``-q NAME`` that neither vLLM nor kvserve knows (the flag's value check)."""
    if name in QUANT_METHODS:
        return None
    return f"Unknown quantization method: {name}. Must be one of {list(VLLM_QUANT_METHODS + ('gguf',))}."


def check_quantization(flag: str | None, h: ModelHeader, how: str = "-q") -> list[tuple[int, str]]:
    """vLLM's agreement rule between the checkpoint and ``-q/--quantization``, and what kvserve
    can run.

    * a quantized checkpoint (config.json's ``quantization_config``, or a GGUF file, whose
      method is ``gguf``) and a ``-q`` naming another method: vLLM's mismatch error (kernel
      variants such as ``awq_marlin`` match their base method);
    * an HF checkpoint with a ``quantization_config``: loaded as kvserve.loaders.hf_quant reads
      it (AWQ, GPTQ, compressed-tensors, FP8; an INFO line); a method or variant it cannot run:
      an error naming it;
    * an unquantized checkpoint and an online method (``fp8``, ``fp8_per_tensor``,
      ``bitsandbytes``, ...): a warning; the weights are served as stored (kvserve does not
      quantize while loading); any other method (``awq``, ``gptq``, ``gguf``...): an error, the
      weights are not in that format.

    Returns the log lines ((level, text)).

    Raises:
        StartupCheckError: as above.
    """
    model_method = h.quant_method
    if model_method is not None and flag is not None and _QUANT_BASE.get(flag, flag) != model_method:
        raise StartupCheckError(
            f"Quantization method specified in the model config ({model_method}) does not match the quantization "
            f"method specified in the `quantization` argument ({flag}).")
    if h.format == "hf" and model_method is not None:
        from kvserve.loaders.hf_quant import read_scheme

        try:
            scheme = read_scheme(h.hf, h.path)  # the loader's judgement: a variant it cannot run is named
        except ModelLoadError as e:
            raise StartupCheckError(str(e)) from None
        return [(logging.INFO, f"quantization: {model_method} (from config.json), weights {scheme.label}")]
    if flag is None or model_method == "gguf":
        return []
    if flag in ONLINE_QUANT_METHODS:
        return [(logging.WARNING, (f"flag {how} {flag}: ignored, not available in kvserve: weights are not quantized "
                 f"while loading; they are served as stored ({h.torch_dtype or 'float32'} safetensors)"))]
    raise StartupCheckError(
        f"{how} {flag}: the model's config.json has no quantization_config: its weights are not {flag}-quantized "
        f"(online quantization methods: {', '.join(sorted(ONLINE_QUANT_METHODS))})")


def resolve_dtype(dtype: str, h: ModelHeader, device_type: str) -> tuple[str, list[tuple[int, str]]]:
    """The EngineConfig dtype for ``--dtype`` on ``device_type``, and vLLM's casting log line.

    ``auto`` on CUDA follows vLLM's documented rule for an HF checkpoint: float16 for float32 and
    float16 checkpoints, bfloat16 for bfloat16 (a GGUF file keeps kvserve's bfloat16). On the CPU
    ``auto`` stays kvserve's: float32 activations (and a bfloat16 copy for large batches where
    the CPU has native bfloat16), not vLLM's 16-bit compute, which is slower on most CPUs; vLLM's
    line ``Upcasting torch.bfloat16 to torch.float32.`` says so. An explicit dtype different from
    the checkpoint's gets vLLM's Upcasting / Downcasting / Casting line.
    """
    ckpt = h.torch_dtype if h.format == "hf" else None
    if ckpt not in _TORCH_NAMES:
        ckpt = "float32" if h.format == "hf" else None
    if dtype == "auto":
        if device_type == "cpu":
            target = "float32"
        elif ckpt is not None:
            target = "bfloat16" if ckpt == "bfloat16" else "float16"
        else:
            return dtype, []
        out = target if device_type != "cpu" else "auto"
    else:
        target = out = dtype
    if ckpt is None or target == ckpt:
        return out, []
    src, dst = _TORCH_NAMES[ckpt], _TORCH_NAMES[target]
    if target == "float32":
        return out, [(logging.INFO, f"Upcasting {src} to {dst}.")]
    if ckpt == "float32":
        return out, [(logging.INFO, f"Downcasting {src} to {dst}.")]
    return out, [(logging.WARNING, f"Casting {src} to {dst}.")]


def known_kv_budget(cfg, model_config: ModelConfig) -> int | None:
    """The KV pool's bytes for running sequences that ``cfg`` fixes before loading (for the model
    manager's memory estimate): ``num_gpu_blocks_override`` blocks, ``kv_cache_memory_bytes``,
    or on the CPU ``cpu_kv_cache_memory_bytes``; None when the pool follows ``n_ctx`` or is
    measured on CUDA (``gpu_memory_utilization``). A budget is capped as the pool is: to what
    ``n_slots`` sequences of ``n_ctx_slot`` tokens use at once (:mod:`kvserve.engine.kv_budget`)."""
    import torch

    from kvserve.engine.kv_budget import cdiv

    c = model_config
    lay = engine_kv_layout(cfg, c)
    block_bytes = lay.block_bytes  # the full-attention layers' (sliding-window pools on top)
    if cfg.num_gpu_blocks_override is not None:
        return lay.kv_bytes(cfg.num_gpu_blocks_override, cfg.n_slots)
    budget = None
    if cfg.kv_cache_memory_bytes is not None:
        budget = cfg.kv_cache_memory_bytes
    elif cfg.cpu_kv_cache_memory_bytes is not None and torch.device(cfg.resolve_device()).type == "cpu":
        budget = cfg.cpu_kv_cache_memory_bytes
    if budget is None:
        return None
    usable = max(cfg.n_slots, 1) * cdiv(cfg.n_ctx_slot(c.n_ctx_train), cfg.block_size)
    if lay.windows:
        return min(budget, lay.kv_bytes(usable, cfg.n_slots))
    return min(budget // block_bytes, usable) * block_bytes


def engine_kv_layout(cfg, model_config):
    """The engine's :class:`~kvserve.engine.kv_budget.KVLayout` for EngineConfig ``cfg``: sliding-window
    layers in pools of their own, except in a tensor- or pipeline-parallel engine (one pool)."""
    from kvserve.engine.kv_budget import kv_layout

    return kv_layout(model_config, block_size=cfg.block_size, n_slots=cfg.n_slots,
                     max_num_batched_tokens=cfg.max_num_batched_tokens, kv_dtype=cfg.kv_dtype,
                     kv_dtype_v=getattr(cfg, "kv_dtype_v", None),
                     windows=getattr(cfg, "tensor_parallel_size", 1) * getattr(cfg, "pipeline_parallel_size", 1) == 1,
                     n_ctx_slot=cfg.n_ctx_slot(model_config.n_ctx_train))


# -- the environment ----------------------------------------------------------------------------

#: ``KVSERVE_MMAP``'s values (any case, spaces around ignored), as kvserve.loaders.gguf reads them:
#: the file's mapping (``--mmap``), a private copy (``--no-mmap``), the default (unset, empty or auto)
MMAP_ON = ("1", "true", "on", "yes")
MMAP_OFF = ("0", "false", "off", "no")
MMAP_DEFAULT = ("", "auto")


def mmap_env_error(environ) -> str | None:
    """The start-up error for a ``KVSERVE_MMAP`` value that is none of :data:`MMAP_ON`,
    :data:`MMAP_OFF`, :data:`MMAP_DEFAULT` (case-insensitive), else None. ``kvserve serve`` logs it
    and exits 1 when neither ``--mmap`` / ``--no-mmap`` nor ``-lm`` picks the mode (a flag wins over
    the variable, as a flag wins over llama-server's ``LLAMA_ARG_*`` variables). Before, the loader
    took any other value, a typo included, as the default without a word. A value longer than 64
    characters is shown cut, with its length; control characters are escaped (``repr``).

    Args:
        environ: the environment (a mapping of str to str).
    """
    text = environ.get("KVSERVE_MMAP")
    if text is None or text.strip().lower() in MMAP_ON + MMAP_OFF + MMAP_DEFAULT:
        return None
    shown = repr(text) if len(text) <= 64 else repr(text[:64]) + f"... ({len(text)} characters)"
    return (f"error while handling environment variable \"KVSERVE_MMAP\": invalid value {shown} "
            f"(accepted: {', '.join(MMAP_ON)} = --mmap; {', '.join(MMAP_OFF)} = --no-mmap; "
            "auto or empty = the default)")


# -- all of them ------------------------------------------------------------------------------

def run_startup_checks(args, path: str, cfg) -> list[tuple[int, str]]:
    """Every check for one generative model at ``path`` with the server's ``args``
    (:class:`~kvserve.serving.args.ServerArgs`) and its EngineConfig ``cfg``, which it adjusts:
    ``dtype`` (see :func:`resolve_dtype`), and ``n_ctx`` grown to an allowed ``--max-model-len``
    above the model's context when ``-c`` was not given.

    Returns the log lines ((level, text)) in order.

    Raises:
        StartupCheckError: a check failed (vLLM's text); ModelLoadError / OSError: no header.
    """
    import torch

    from kvserve.engine.kv_budget import plan_engine_pool

    h = read_header(path)
    notes: list[tuple[int, str]] = []
    tp, pp = getattr(cfg, "tensor_parallel_size", 1), getattr(cfg, "pipeline_parallel_size", 1)
    from kvserve.engine.parallel import environment_error

    env_err = environment_error(tp, pp)  # RANK / WORLD_SIZE of a group to join, also with tp x pp = 1
    if env_err:
        raise StartupCheckError(env_err)
    if tp * pp > 1:
        from kvserve.engine.parallel import parallel_error

        err = parallel_error(h.config, tp, pp)
        if err:
            raise StartupCheckError(err)
        if getattr(getattr(cfg, "spec", None), "method", None) == "draft_model":
            raise StartupCheckError(f"a draft model (-md, --speculative-config model) is not supported with tensor or "
                                    f"pipeline parallelism (tp={tp} pp={pp}) yet; prompt lookup (--spec-type ngram) is")
    notes += check_quantization(getattr(args, "quantization", None), h,
                                getattr(args, "flags_given", {}).get("quantization", "-q"))
    device_type = torch.device(cfg.resolve_device()).type
    cfg.dtype, dtype_notes = resolve_dtype(cfg.dtype, h, device_type)
    notes += dtype_notes
    n_ctx_train = h.config.n_ctx_train
    notes += check_max_model_len(cfg.max_model_len, h, getattr(args, "allow_long_max_model_len", False))
    if cfg.max_model_len > n_ctx_train and cfg.n_ctx == 0:
        cfg.n_ctx = cfg.max_model_len  # an allowed long max_model_len: the context grows to it
    elif cfg.n_ctx > n_ctx_train:  # llama-server's -c above the training context: its warning
        n_ctx_seq = cfg.n_ctx_slot(n_ctx_train)
        if n_ctx_seq > n_ctx_train:
            notes.append((logging.WARNING, (f"n_ctx_seq ({n_ctx_seq}) > n_ctx_train ({n_ctx_train}) -- possible "
                          "training context overflow")))
    n_ctx_slot = cfg.n_ctx_slot(n_ctx_train)
    if getattr(args, "vllm_batch_limits", False):
        seqs = getattr(args, "max_num_seqs", None) or cfg.n_slots  # the value the user typed, when typed
        warning = batch_warning(cfg.max_num_batched_tokens, seqs, n_ctx_slot)
        if warning:
            notes.append((logging.WARNING, warning))
    if device_type == "cpu" and getattr(args, "gpu_memory_utilization", None) is not None \
            and cfg.kv_cache_memory_bytes is None:
        notes.append((logging.INFO, ("flag --gpu-memory-utilization: no effect on the CPU: the KV budget there is "
                      "--kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE (GiB)")))
    pre = (cfg.kv_cache_memory_bytes is not None or cfg.num_gpu_blocks_override is not None
           or (device_type == "cpu" and cfg.cpu_kv_cache_memory_bytes is not None))
    if pre:  # a budget known before loading: refuse now, not after reading the weights
        c = h.config
        lay = engine_kv_layout(cfg, c)
        block_bytes = lay.block_bytes
        known = dataclasses.replace(cfg, gpu_memory_utilization=None)  # measured by the engine, after loading
        plan_engine_pool(known, c, n_ctx=cfg.resolve_n_ctx(n_ctx_train), n_ctx_slot=n_ctx_slot,
                         n_slots=cfg.n_slots, block_bytes=block_bytes, device_type=device_type,
                         windows=lay.costs())
    return notes


__all__ = [
    "LONG_MAX_MODEL_LEN_WARNING",
    "MAX_LEN_KEYS",
    "MMAP_DEFAULT",
    "MMAP_OFF",
    "MMAP_ON",
    "ONLINE_QUANT_METHODS",
    "QUANT_METHODS",
    "VLLM_QUANT_METHODS",
    "ModelHeader",
    "StartupCheckError",
    "batch_error",
    "batch_warning",
    "check_max_model_len",
    "check_quantization",
    "derived_max_model_len",
    "known_kv_budget",
    "mmap_env_error",
    "quantization_name_error",
    "read_header",
    "resolve_dtype",
    "run_startup_checks",
]
