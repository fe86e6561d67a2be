"""The mistral3 family (Ministral 3, Mistral Small 3.x text, Devstral): the llama block
(kvserve.models.llama) with YaRN RoPE (the shared code: kvserve.models.llama.rope_inv_freq /
rope_attention_factor) and Llama 4's attention temperature: after RoPE, queries at position ``p``
are scaled by ``1 + beta * ln(1 + floor(p / original_context))`` (transformers'
``get_llama_4_attn_scale``; beta is ``rope_parameters.llama_4_scaling_beta``, GGUF
``mistral3.attention.temperature_scale``).

Reads transformers' ``Ministral3ForCausalLM`` (model_type ``ministral3``) directories and GGUF files
of ``general.architecture = mistral3`` (q/k rows permuted to interleaved pairs, as llama.cpp's
converter does for llama-derived models). YaRN's ``mscale`` / ``mscale_all_dim`` (Ministral 3: both 1,
so cos/sin are not scaled) are read from ``rope_parameters``, and from GGUF
``rope.scaling.yarn_log_multiplier`` (the converter's ``mscale_all_dim``; kvserve.models.family.gguf_yarn).
Refused naming the key: a sliding window shorter than the context, RoPE types the llama block lacks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvserve.loaders.weights import ModelConfig, ModelLoadError
from kvserve.models.family import llama_config_from_gguf, llama_config_from_hf
from kvserve.models.llama import LlamaModel


@dataclass(slots=True)
class Mistral3Config(ModelConfig):
    """A ModelConfig with mistral3's attention temperature.

    Attributes:
        attn_temp_beta: beta of the query scale (0: none).
        attn_temp_len: the position period of its steps (tokens; the original context).
    """

    attn_temp_beta: float = 0.0
    attn_temp_len: int = 0


def _mistral3(base: ModelConfig, beta: float, length: int) -> Mistral3Config:
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
    return Mistral3Config(**fields, attn_temp_beta=beta, attn_temp_len=length)


def _check_window(window, n_ctx: int, key: str, path: str) -> None:
    if window and int(window) < n_ctx:
        raise ModelLoadError(f"{path}: {key} is {int(window)}, shorter than the context ({n_ctx}): sliding-window "
                             "mistral3 is not supported")


def config_from_hf(cfg: dict, path: str) -> Mistral3Config:
    """A Mistral3Config from a Ministral3 config.json (``rope_parameters`` with YaRN and
    ``llama_4_scaling_beta``; the temperature's period is the original context, as transformers'
    ``get_llama_4_attn_scale`` takes it). Mistral's own ``llama_4_scaling`` block (``beta``,
    ``original_max_position_embeddings``; params.json's, which vLLM reads) is read where a config.json
    carries it.

    Raises ModelLoadError: missing keys, a RoPE type kvserve lacks, a sliding window, a
    ``llama_4_scaling`` that contradicts ``rope_parameters``."""
    base = llama_config_from_hf(cfg, path, arch="mistral3")
    _check_window(cfg.get("sliding_window"), base.n_ctx_train, "config.json sliding_window", path)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    beta = float(rope.get("llama_4_scaling_beta") or 0.0)
    length = int(rope.get("original_max_position_embeddings") or base.n_ctx_train)
    l4 = cfg.get("llama_4_scaling") or {}
    for key, ours, cast in (("beta", beta, float), ("original_max_position_embeddings", length, int)):
        if l4.get(key) is not None and rope.get("llama_4_scaling_beta" if key == "beta" else key) is not None \
                and cast(l4[key]) != ours:
            raise ModelLoadError(f"{path}: config.json llama_4_scaling.{key} is {l4[key]!r}, rope_parameters "
                                 f"says {ours!r}: kvserve does not guess which applies")
    if l4:
        beta = float(l4.get("beta") if l4.get("beta") is not None else beta)
        length = int(l4.get("original_max_position_embeddings") or length)
    return _mistral3(base, beta, length)


def config_from_gguf(md: dict, path: str, shapes: dict | None = None) -> Mistral3Config:
    """A Mistral3Config from ``mistral3.*`` GGUF metadata (llama.cpp's keys). The temperature's period
    is ``rope.scaling.original_context_length`` (else the training context), as llama.cpp takes it
    (src/models/mistral3.cpp: ``n_attn_temp_floor_scale = n_ctx_orig_yarn``; it does not read
    ``attention.temperature_length``, which its converter for Mistral's own format writes with the
    same value). A file whose ``attention.temperature_length`` says otherwise is refused: llama.cpp
    would ignore it, Mistral's reference would not, and kvserve does not guess.

    Raises ModelLoadError: a missing key, a RoPE type kvserve lacks, a sliding window, a
    temperature length other than the original context."""
    base = llama_config_from_gguf(md, path, shapes)
    _check_window(md.get("mistral3.attention.sliding_window"), base.n_ctx_train,
                  "GGUF key 'mistral3.attention.sliding_window'", path)
    beta = float(md.get("mistral3.attention.temperature_scale") or 0.0)
    length = int(md.get("mistral3.rope.scaling.original_context_length") or base.n_ctx_train)
    temp_len = md.get("mistral3.attention.temperature_length")
    if beta and temp_len and int(temp_len) != length:
        raise ModelLoadError(f"{path}: GGUF key 'mistral3.attention.temperature_length' is {int(temp_len)}, not the "
                             f"original context ({length}, 'mistral3.rope.scaling.original_context_length'): "
                             "llama.cpp steps the attention temperature every original context and ignores the "
                             "key; kvserve does not guess which applies")
    return _mistral3(base, beta, length)


def query_scale(config: Mistral3Config, max_positions: int) -> torch.Tensor | None:
    """[max_positions] float32 query scale per position, or None when beta is 0."""
    if not config.attn_temp_beta:
        return None
    steps = torch.floor(torch.arange(max_positions, dtype=torch.float64) / config.attn_temp_len)
    return (1 + config.attn_temp_beta * torch.log1p(steps)).float()


class Mistral3Model(LlamaModel):
    """The llama block with mistral3's query temperature (:func:`query_scale`); arguments as
    LlamaModel's."""

    def __init__(self, config: Mistral3Config, weights, *args, max_positions: int = 8192, **kwargs):
        super().__init__(config, weights, *args, max_positions=max_positions, **kwargs)
        scale = query_scale(config, max_positions)
        self.q_scale = None if scale is None else scale.to(self.device)

