"""HF model directories: config.json + *.safetensors + tokenizer.json.

Supported ``architectures``: LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM. Tensors are renamed to kvserve's (GGUF) names and Q/K rows
are permuted to the interleaved-pair RoPE layout the model uses.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from kvserve.loaders.weights import (
    LoadedModel,
    ModelConfig,
    ModelInfo,
    ModelLoadError,
    Weight,
    check_finite,
    check_tensors,
    interleave_qk,
)

HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def hf_to_gguf_name(name: str) -> str | None:
    """Map an HF tensor name to kvserve's (GGUF) name; None for tensors we do not use."""
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    if name.startswith("model.layers."):
        rest = name[len("model.layers."):]
        idx, _, sub = rest.partition(".")
        if sub in _LAYER_NAMES:
            return f"blk.{idx}.{_LAYER_NAMES[sub]}"
    return None


def config_from_hf(cfg: dict, path: str) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = next((HF_ARCHS[a] for a in archs if a in HF_ARCHS), None)
    if arch is None:
        raise ModelLoadError(
            f"{path}: unknown model architecture {archs or cfg.get('model_type')!r} "
            f"(supported: {', '.join(HF_ARCHS)})"
        )
    try:
        n_embd = int(cfg["hidden_size"])
        n_head = int(cfg["num_attention_heads"])
        scaling = cfg.get("rope_scaling")
        if scaling:
            scaling = dict(scaling)
            scaling["type"] = scaling.get("rope_type", scaling.get("type"))
            if "original_max_position_embeddings" in scaling:
                scaling["original_context_length"] = scaling["original_max_position_embeddings"]
        return ModelConfig(
            arch=arch,
            n_layer=int(cfg["num_hidden_layers"]),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=int(cfg.get("num_key_value_heads", n_head)),
            n_ff=int(cfg["intermediate_size"]),
            n_vocab=int(cfg["vocab_size"]),
            head_dim=int(cfg.get("head_dim") or n_embd // n_head),
            n_ctx_train=int(cfg.get("max_position_embeddings", 2048)),
            rope_freq_base=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qkv_bias=arch == "qwen2",
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
    except KeyError as e:
        raise ModelLoadError(f"{path}: config.json lacks {e.args[0]!r}") from None


def load_hf_dir(path: str | os.PathLike) -> LoadedModel:
    """Load an HF model directory.

    Raises:
        ModelLoadError: no config.json, unknown architecture, no safetensors
            files, missing tensor, tokenizer problems.
    """
    from safetensors import safe_open

    from kvserve.loaders.tokenizer import Tokenizer

    d = Path(path)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{d}: not a model directory (no config.json)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_path}: invalid JSON: {e}") from e
    config = config_from_hf(cfg, str(d))
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{d}: no *.safetensors files")
    weights: dict[str, Weight] = {}
    size = n_params = 0
    import torch

    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                size += t.numel() * t.element_size()
                n_params += t.numel()
                g = hf_to_gguf_name(name)
                if g is None:
                    continue
                arr = t.to(torch.float32).numpy()
                weights[g] = Weight(tuple(arr.shape), dense=np.ascontiguousarray(arr), source_type=str(t.dtype))
    if "output.weight" not in weights:
        config.tie_embeddings = True
    check_tensors(config, weights, str(d))
    check_finite(weights, str(d))
    interleave_qk(config, weights)
    try:
        tokenizer = Tokenizer.from_hf_dir(d)
    except Exception as e:
        raise ModelLoadError(f"{d}: cannot build tokenizer: {e}") from e
    gen = {}
    if (d / "generation_config.json").is_file():
        gen = json.loads((d / "generation_config.json").read_text())
    dtype = str(cfg.get("torch_dtype", "float32"))
    ftype = {"float32": "all F32", "float16": "F16", "bfloat16": "BF16"}.get(dtype, dtype)
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
    return LoadedModel(config, info, weights, tokenizer, getattr(tokenizer, "chat_template", None), gen)
