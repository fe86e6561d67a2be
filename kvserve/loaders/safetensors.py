"""HF model directories: config.json + *.safetensors (or pytorch_model.bin) + tokenizer.json.

config.json's ``architectures`` (else ``model_type``) names the model's family
(kvserve.models.family): the family reads the config, renames the tensors to kvserve's (GGUF)
names, names the tensors it requires and turns the weights into its module's layout (llama: Q/K
rows permuted to interleaved-pair RoPE order; BERT: llama.cpp's BERT names, pooling and
normalization from sentence-transformers' modules.json / 1_Pooling/config.json / Normalize).
This module only reads the files.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np

from kvserve.loaders.weights import (
    LoadedModel,
    ModelInfo,
    ModelLoadError,
    Weight,
    check_finite,
    check_tensors,
)


def read_config(d: Path) -> dict:
    """config.json of the directory ``d``.

    Raises ModelLoadError: no config.json, or invalid JSON."""
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{d}: not a model directory (no config.json)")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_path}: invalid JSON: {e}") from e


def _read_tensors(d: Path):
    """(name, torch tensor) pairs of the directory's ``*.safetensors`` files, else of its
    ``pytorch_model.bin`` (or its shards ``pytorch_model-0000N-of-0000M.bin``). Raises
    ModelLoadError when it has neither, or a safetensors file cannot be opened (empty, corrupt header)."""
    import torch

    files = sorted(d.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        for f in files:
            try:
                st = safe_open(str(f), framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors' own error type: a corrupt or empty file
                raise ModelLoadError(f"{f}: not a readable safetensors file: {e}") from None
            with st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
    elif bins := sorted(p for p in d.glob("pytorch_model*.bin")
                        if re.fullmatch(r"pytorch_model(-\d+-of-\d+)?\.bin", p.name)):
        for f in bins:  # one file, or Transformers' shards (pytorch_model-00001-of-00002.bin)
            state = torch.load(str(f), map_location="cpu", weights_only=True)  # tensors only: no pickled code
            yield from state.items()
            del state
    else:
        raise ModelLoadError(f"{d}: no *.safetensors files")


def load_hf_dir(path: str | os.PathLike) -> LoadedModel:
    """Load an HF model directory of any family kvserve knows (kvserve.models.family).

    Reads ``*.safetensors`` (or ``pytorch_model.bin`` when there are none), tokenizer.json
    and generation_config.json; ``info.ftype`` is from ``torch_dtype``.

    Raises:
        ModelLoadError: no config.json, unknown architecture, no weights files, missing
            tensor or config key, unsupported variants, tokenizer problems.
    """
    import torch

    from kvserve.loaders.hf_quant import QuantAssembler, read_scheme
    from kvserve.loaders.tokenizer import Tokenizer
    from kvserve.models.family import hf_family

    d = Path(path)
    cfg = read_config(d)
    family = hf_family(cfg, str(d))
    config = family.config_from_hf(cfg, str(d))
    scheme = read_scheme(cfg, str(d))  # AWQ, GPTQ, compressed-tensors, FP8 (kvserve.loaders.hf_quant)
    quant = QuantAssembler(scheme, str(d)) if scheme is not None else None
    weights: dict[str, Weight] = {}
    size = n_params = 0
    for name, t in _read_tensors(d):
        if not name.endswith("position_ids"):  # a buffer, not a parameter
            size += t.numel() * t.element_size()
        if quant is not None and quant.take(name, t):
            continue  # counted in parameters once its layer is built
        if not name.endswith("position_ids"):
            n_params += t.numel()
        g = family.hf_tensor_name(name, config)
        if g is None:
            continue
        if t.dtype == torch.uint8:  # packed blocks (gpt-oss's MXFP4 experts): the family's prepare reads them
            weights[g] = Weight(tuple(t.shape), raw=t.numpy(), source_type="U8")
            continue
        arr = t.to(torch.float32).numpy()
        weights[g] = Weight(tuple(arr.shape), dense=np.ascontiguousarray(arr), source_type=str(t.dtype))
    for name, w in quant.finish() if quant is not None else ():
        n_params += math.prod(w.shape)
        g = family.hf_tensor_name(name, config)
        if g is not None:
            weights[g] = w if family.packed_weights else Weight(w.shape, dense=w.to_dense(), source_type=w.source_type)
    family.finish_hf(config, {k: w.shape for k, w in weights.items()})
    check_tensors(family.required_tensors(config, weights), weights, str(d))
    check_finite(weights, str(d))
    family.prepare(config, weights, "hf")
    try:
        tokenizer = Tokenizer.from_hf_dir(d)
    except Exception as e:
        raise ModelLoadError(f"{d}: cannot build tokenizer: {e}") from e
    generative = family.task == "generate"
    gen = {}
    if generative and (d / "generation_config.json").is_file():
        gen = json.loads((d / "generation_config.json").read_text())
    dtype = str(cfg.get("torch_dtype", "float32"))
    ftype = {"float32": "all F32", "float16": "F16", "bfloat16": "BF16"}.get(dtype, dtype)
    if scheme is not None:
        ftype = scheme.label
    info = ModelInfo(
        path=str(d),
        name=cfg.get("_name_or_path") or d.name,
        format="safetensors",
        arch=config.arch,
        ftype=ftype,
        n_params=n_params,
        size=size,
        n_vocab=config.n_vocab,
        n_ctx_train=config.n_ctx_train,
        n_embd=config.n_embd,
        vocab_type=getattr(tokenizer, "vocab_type", 2),
        quantization_level=ftype.replace("all ", ""),
    )
    template = getattr(tokenizer, "chat_template", None) if generative else None
    return LoadedModel(config, info, weights, tokenizer, template, gen)
