"""The qwen3 family: the llama block (kvserve.models.llama) with a per-head RMSNorm of q and k
before RoPE (HF ``self_attn.q_norm`` / ``k_norm``, GGUF ``attn_q_norm`` / ``attn_k_norm``, weights of
``head_dim``), NEOX RoPE in both formats (so Q/K rows and the q/k norm weights are permuted to
interleaved pairs at load), tied embeddings on small sizes, optional ``attention_bias``.

Sliding-window layers (``use_sliding_window``) are refused at load: no released Qwen3 uses them.
"""

from __future__ import annotations

from kvserve.loaders.weights import ModelConfig, ModelLoadError, Weight, interleave_qk
from kvserve.models.family import llama_config_from_gguf, llama_config_from_hf


def config_from_gguf(md: dict, path: str, shapes: dict | None = None) -> ModelConfig:
    """A qwen3 ModelConfig from ``qwen3.*`` GGUF metadata (llama.cpp's keys; ``qk_norm`` on)."""
    return llama_config_from_gguf(md, path, shapes, qk_norm=True)


def config_from_hf(cfg: dict, path: str) -> ModelConfig:
    """A qwen3 ModelConfig from config.json (transformers' Qwen3Config).

    Raises ModelLoadError: missing keys, a RoPE scaling kvserve lacks, sliding-window layers."""
    kinds = set(cfg.get("layer_types") or [])
    if cfg.get("use_sliding_window") or kinds - {"full_attention"}:
        raise ModelLoadError(f"{path}: config.json use_sliding_window / layer_types {sorted(kinds)}: sliding-window "
                             "layers of qwen3 are not supported")
    return llama_config_from_hf(cfg, path, arch="qwen3", qk_norm=True)


def prepare(config: ModelConfig, weights: dict[str, Weight], fmt: str) -> None:
    """Q/K rows (and the q/k norm weights) from NEOX half-split to interleaved pairs: llama.cpp's
    converter does not permute qwen3, and HF never does."""
    interleave_qk(config, weights)
