"""From a model path to a ready torch module: picks the loader and the architecture class."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvserve.config import EngineConfig
from kvserve.loaders.weights import LoadedModel, ModelLoadError
from kvserve.models.family import family_of, gguf_task
from kvserve.models.llama import LlamaModel

#: The architecture tables (which names load, as what module, for which task) live in
#: kvserve.models.family: one record per family.

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_files(path: str | os.PathLike) -> LoadedModel:
    """Read a .gguf file or an HF directory (config.json + safetensors).

    Raises FileNotFoundError / ModelLoadError with a message naming the problem; for a format
    kvserve does not run, UnsupportedFormatError (a ModelLoadError) with its one-line refusal.
    """
    from kvserve.loaders.detect import require_loadable

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model not found: {path}")
    found = require_loadable(p)  # a format kvserve does not run: its one line (kvserve.loaders.detect)
    if p.is_dir() and found.weights is None:
        from kvserve.loaders.safetensors import load_hf_dir

        return load_hf_dir(p)
    from kvserve.loaders.gguf import load_gguf

    return load_gguf(found.weights or p)  # a GGUF file, a folder holding one, or a file the loader refuses


def build_model(loaded: LoadedModel, config: EngineConfig, max_positions: int) -> LlamaModel:
    """Instantiate the torch module for ``loaded`` with the numerics of ``config``.

    dtype "auto": on CPU ``config.cpu_kernel`` for small batches and a dense
    copy in ``config.large_batch_dtype`` for large ones (and, with
    ``config.compile`` and ``config.native_kernels``, the 4-bit weights for
    kvserve's native 4-bit kernel on CPUs it supports; by default, on those CPUs, they are
    kept for the native decode step, ``model.native_decode``: see
    :mod:`kvserve.models.decode_native`); bfloat16 on CUDA.
    """
    family = family_of(loaded.config.arch)
    if family.task != "generate":
        raise ModelLoadError(f"model architecture '{loaded.config.arch}' is an encoder ({family.task}): "
                             "it has no generative module")
    cls = family.module_class()
    device = config.resolve_device()
    large = torch.float32
    native_q4 = native_decode = False
    if config.dtype == "auto":
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        kernel = config.cpu_kernel if device == "cpu" else "dense"
        if config.large_batch_dtype == "bfloat16" or config.large_batch_dtype == "auto" and (
                cpu_native_bf16() or int8_prefill_only(loaded.weights)):
            large = torch.bfloat16
        # the native decode step (kvserve.models.decode_native) is the default decode path on CPUs
        # with AVX512-VNNI or AVX2 + FMA + F16C: not with --compile (the compiled graph takes the
        # decode steps); with speculative decoding its verification rows run in it too
        # (ModelRunner._decode_rows); KVSERVE_NATIVE_DECODE=0 off
        native_decode = (device == "cpu" and not config.compile
                         and os.environ.get("KVSERVE_NATIVE_DECODE", "1") != "0")
        if (config.compile and config.native_kernels or native_decode) and device == "cpu":
            from kvserve.models import q4_kernel

            from kvserve.models import decode_native

            if config.compile and config.native_kernels:
                native_q4 = q4_kernel.cpu_supported()  # the q4_mm op: AVX512-VNNI only
            elif decode_native.cpu_supported():
                native_q4 = "decode"  # packed off the start-up path, for the native step only
    else:
        dtype = _DTYPES[config.dtype]
        kernel = "dense"
    model = cls(loaded.config, loaded.weights, dtype=dtype, device=device, kernel=kernel,
                small_max_rows=config.small_batch_rows, max_positions=max_positions, large_dtype=large,
                native_q4=native_q4)
    # ModelRunner starts it (see NativeDecode): Q4_0/Q4_1 projections kept for the native kernel, or
    # GGUF blocks of any type the block kernels multiply (decode_native.native_projection)
    from kvserve.models.decode_native import experts_reason, native_projection

    model.native_decode = (native_decode and native_q4 and family.native_decode(loaded.config)
                           and all(native_projection(lin) for lin in model.projections())
                           and experts_reason(model) is None)
    return model


def int8_prefill_only(weights: dict, flags=None) -> bool:
    """True where a CPU without native bfloat16 still prefills on the GGUF blocks: the build made here
    has the int8 prefill path (AVX512-VNNI: :func:`ggml_kernel.prefill_paths` of ``flags``, default
    this CPU's) and every layer matrix of ``weights`` (name -> Weight) is GGUF blocks of a type it
    takes, so "bfloat16 prefill" (large_batch_dtype auto) makes no bfloat16 copy: the steps above
    small_batch_rows run the int8 path, as on AVX512-BF16 CPUs."""
    from kvserve.models import ggml_kernel

    if "int8" not in ggml_kernel.prefill_paths(flags):
        return False
    mats = [w for name, w in weights.items() if name.startswith("blk.") and len(w.shape) == 2]
    return bool(mats) and all((w.raw is not None and w.source_type in ggml_kernel.INT8_TYPES)
                              or w.q4_raw is not None for w in mats)


def cpu_native_bf16() -> bool:
    """True when this CPU computes bfloat16 natively (AVX512-BF16 or AMX tiles)."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # older torch
        return False


def describe_dtypes(model: LlamaModel) -> str:
    """Short text of the weight formats in use, e.g. "int4(q4_1)+float32"."""
    lin = model.layers[0].wqkv
    if lin.kernel != "dense":
        if lin.weight is None:
            return lin.kernel
        return f"{lin.kernel}+{str(lin.weight.dtype).replace('torch.', '')}"
    return str(lin.weight.dtype).replace("torch.", "")


def model_task(loaded: LoadedModel) -> str:
    """"generate", "embed" or "score" for a loaded model (its family's, kvserve.models.family).

    A BERT with a classifier head (``BertForSequenceClassification``, GGUF ``cls.output``)
    scores; one without embeds.
    """
    task = getattr(loaded.config, "task", None)
    return task or family_of(loaded.config.arch).task


def probe_task(path: str | os.PathLike) -> str:
    """The task of the model at ``path`` from its header alone (config.json or GGUF metadata).

    Cheap (no tensor is read), for a model manager choosing the engine before loading.

    Raises:
        FileNotFoundError: no such file; ModelLoadError: unreadable header.
    """
    p = Path(path)
    if p.is_dir():
        from kvserve.loaders.safetensors import read_config
        from kvserve.models.family import hf_task

        return hf_task(read_config(p), str(p))
    if not p.exists():
        raise FileNotFoundError(f"model not found: {path}")
    from kvserve.loaders.gguf import read_gguf_header

    md, infos = read_gguf_header(str(p))
    return gguf_task(md, (t.name for t in infos), str(p))


def build_embedding_model(loaded: LoadedModel, config: EngineConfig, max_positions: int):
    """The module EmbeddingEngine runs: an encoder family's module (BertModel, float32), else the
    decoder's module (:func:`build_model`; its final hidden states are the embeddings)."""
    family = family_of(loaded.config.arch)
    if family.task != "generate":
        return family.module_class()(loaded.config, loaded.weights, device=config.resolve_device())
    return build_model(loaded, config, max_positions)
