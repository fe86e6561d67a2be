"""HF model directories: config.json + *.safetensors + tokenizer.json.

Supported ``architectures``: LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM. Tensors are renamed to kvserve's (GGUF) names and Q/K rows
are permuted to the interleaved-pair RoPE layout the model uses.

BERT encoders (BertModel, BertForSequenceClassification and other ``model_type: bert``
directories, with or without the ``bert.`` tensor prefix, sentence-transformers folders
included): :func:`load_bert_dir`, tensors under llama.cpp's BERT names
(see kvserve.models.bert), pooling and normalization from sentence-transformers'
modules.json / 1_Pooling/config.json / Normalize.
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
    cfg = _read_config(d)
    if is_bert_config(cfg):
        return load_bert_dir(d, cfg)
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


# ---------------------------------------------------------------------------------- BERT

#: HF ``architectures`` of BERT encoders -> task
BERT_HF_ARCHS = {
    "BertModel": "embed",
    "BertForMaskedLM": "embed",
    "BertForPreTraining": "embed",
    "BertForSequenceClassification": "score",
}

_BERT_LAYER_NAMES = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}

_BERT_NAMES = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.position_embeddings": "position_embd",
    "embeddings.LayerNorm": "token_embd_norm",
    "pooler.dense": "cls",
    "classifier": "cls.output",
}

#: sentence-transformers 1_Pooling flags -> kvserve pooling
_ST_POOLING = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_max_tokens": None,
    "pooling_mode_mean_sqrt_len_tokens": None,
    "pooling_mode_weightedmean_tokens": None,
}


def _read_config(d: Path) -> dict:
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{d}: not a model directory (no config.json)")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_path}: invalid JSON: {e}") from e


def is_bert_config(cfg: dict) -> bool:
    """True for a config.json of a BERT encoder (by ``architectures``, else ``model_type``)."""
    archs = cfg.get("architectures") or []
    if archs:
        return any(a in BERT_HF_ARCHS for a in archs)
    return cfg.get("model_type") == "bert"


def hf_task(path: str | os.PathLike) -> str:
    """"generate", "embed" or "score" for an HF model directory, from config.json alone.

    Raises ModelLoadError: no/invalid config.json, an architecture kvserve does not run.
    """
    d = Path(path)
    cfg = _read_config(d)
    if is_bert_config(cfg):
        return "score" if "BertForSequenceClassification" in (cfg.get("architectures") or []) else "embed"
    config_from_hf(cfg, str(d))  # raises for an unknown architecture
    return "generate"


def bert_hf_name(name: str) -> str | None:
    """Map an HF BERT tensor name (``bert.`` prefix optional) to llama.cpp's; None when unused."""
    if name.startswith("bert."):
        name = name[5:]
    base, _, leaf = name.rpartition(".")
    leaf = {"gamma": "weight", "beta": "bias"}.get(leaf, leaf)
    if leaf not in ("weight", "bias"):
        return None
    if base in _BERT_NAMES:
        return f"{_BERT_NAMES[base]}.{leaf}"
    if base.startswith("encoder.layer."):
        idx, _, sub = base[len("encoder.layer."):].partition(".")
        if sub in _BERT_LAYER_NAMES and idx.isdigit():
            return f"blk.{idx}.{_BERT_LAYER_NAMES[sub]}.{leaf}"
    return None


def sentence_transformers_defaults(d: Path) -> tuple[str | None, int | None]:
    """(pooling, normalize) from a sentence-transformers folder's modules.json; (None, None) without one.

    The Pooling module's config (``pooling_mode_*`` flags or ``pooling_mode``) gives
    "mean", "cls" or "last"; a Normalize module gives normalize 2 (Euclidean), its absence -1.

    Raises:
        ModelLoadError: a module kvserve does not run (Dense, max or sqrt-length pooling,
            several pooling modes at once, ...): its vectors would differ from the model's.
    """
    mpath = d / "modules.json"
    if not mpath.is_file():
        return None, None
    try:
        modules = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{mpath}: invalid JSON: {e}") from e
    pooling, normalize = None, -1
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = 2
            continue
        if kind != "Pooling":
            raise ModelLoadError(f"{mpath}: sentence-transformers module {m.get('type')!r} is not supported "
                                 "(supported: Transformer, Pooling, Normalize)")
        pcfg_path = d / str(m.get("path", "")) / "config.json"
        pcfg = json.loads(pcfg_path.read_text()) if pcfg_path.is_file() else {}
        modes = [k for k, v in pcfg.items() if k.startswith("pooling_mode_") and v is True]
        if isinstance(pcfg.get("pooling_mode"), str):
            modes = ["pooling_mode_" + {"mean": "mean_tokens", "cls": "cls_token", "lasttoken": "lasttoken",
                                        "max": "max_tokens"}.get(pcfg["pooling_mode"], pcfg["pooling_mode"])]
        if len(modes) != 1 or _ST_POOLING.get(modes[0]) is None:
            raise ModelLoadError(f"{pcfg_path}: pooling {modes or 'none'} is not supported "
                                 "(one of pooling_mode_mean_tokens, pooling_mode_cls_token, pooling_mode_lasttoken)")
        pooling = _ST_POOLING[modes[0]]
    return pooling, normalize


def bert_config_from_hf(cfg: dict, d: Path):
    """A BertConfig from config.json (+ sentence-transformers modules.json); ModelLoadError on gaps."""
    from kvserve.models.bert import BertConfig

    kind = cfg.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ModelLoadError(f"{d}: position_embedding_type {kind!r} is not supported (absolute)")
    if cfg.get("is_decoder"):
        raise ModelLoadError(f"{d}: a BERT decoder (is_decoder) is not supported")
    archs = cfg.get("architectures") or []
    n_labels = 0
    if "BertForSequenceClassification" in archs:
        n_labels = int(cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2)
    pooling, normalize = sentence_transformers_defaults(d)
    try:
        return BertConfig(
            arch="bert",
            n_layer=int(cfg["num_hidden_layers"]),
            n_embd=int(cfg["hidden_size"]),
            n_head=int(cfg["num_attention_heads"]),
            n_ff=int(cfg["intermediate_size"]),
            n_vocab=int(cfg["vocab_size"]),
            n_ctx_train=int(cfg.get("max_position_embeddings", 512)),
            n_token_types=int(cfg.get("type_vocab_size", 2)),
            norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
            activation=str(cfg.get("hidden_act", "gelu")),
            n_labels=n_labels,
            pooling="rank" if n_labels else pooling,
            normalize=normalize,
            pad_token_id=int(cfg.get("pad_token_id") or 0),
        )
    except KeyError as e:
        raise ModelLoadError(f"{d}: config.json lacks {e.args[0]!r}") from None


def load_bert_dir(path: str | os.PathLike, cfg: dict | None = None) -> LoadedModel:
    """Load a BERT encoder directory: weights under llama.cpp's names, float32.

    Reads ``*.safetensors`` (or ``pytorch_model.bin`` when there are none), tokenizer.json,
    modules.json and 1_Pooling/config.json. ``info.ftype`` is from ``torch_dtype``.

    Raises:
        ModelLoadError: missing config keys or tensors, unsupported variants, tokenizer problems.
    """
    import torch

    from kvserve.loaders.tokenizer import Tokenizer
    from kvserve.models.bert import check_bert_tensors

    d = Path(path)
    cfg = cfg if cfg is not None else _read_config(d)
    config = bert_config_from_hf(cfg, d)
    files = sorted(d.glob("*.safetensors"))
    tensors: list[tuple[str, "torch.Tensor"]] = []
    if files:
        from safetensors import safe_open

        for f in files:
            with safe_open(str(f), framework="pt") as st:
                tensors += [(name, st.get_tensor(name)) for name in st.keys()]
    elif (d / "pytorch_model.bin").is_file():
        state = torch.load(str(d / "pytorch_model.bin"), map_location="cpu", weights_only=True)
        tensors = list(state.items())
    else:
        raise ModelLoadError(f"{d}: no *.safetensors files")
    weights: dict[str, Weight] = {}
    size = n_params = 0
    for name, t in tensors:
        if not name.endswith("position_ids"):  # a buffer, not a parameter
            size += t.numel() * t.element_size()
            n_params += t.numel()
        g = bert_hf_name(name)
        if g is None or g.startswith("cls") and not config.n_labels:
            continue  # unused; an embedding model's pooler: sentence-transformers never runs it
        arr = t.to(torch.float32).numpy()
        weights[g] = Weight(tuple(arr.shape), dense=np.ascontiguousarray(arr), source_type=str(t.dtype))
    if "token_types.weight" not in weights:
        config.n_token_types = 0
    if config.n_labels and "cls.output.weight" in weights:
        config.n_labels = weights["cls.output.weight"].shape[0]
    check_bert_tensors(config, weights, str(d))
    check_finite(weights, str(d))
    try:
        tokenizer = Tokenizer.from_hf_dir(d)
    except Exception as e:
        raise ModelLoadError(f"{d}: cannot build tokenizer: {e}") from e
    dtype = str(cfg.get("torch_dtype", "float32"))
    ftype = {"float32": "all F32", "float16": "F16", "bfloat16": "BF16"}.get(dtype, dtype)
    info = ModelInfo(
        path=str(d),
        name=cfg.get("_name_or_path") or d.name,
        format="safetensors",
        arch="bert",
        ftype=ftype,
        n_params=n_params,
        size=size,
        n_vocab=config.n_vocab,
        n_ctx_train=config.n_ctx_train,
        n_embd=config.n_embd,
        vocab_type=getattr(tokenizer, "vocab_type", 3),
        quantization_level=ftype.replace("all ", ""),
    )
    return LoadedModel(config, info, weights, tokenizer, None, {})
