"""The phi3 family (Phi-3, Phi-3.5, Phi-4, Phi-4-mini): the llama block (kvserve.models.llama) with
fused tensors, LongRoPE and partial rotary.

- Fused projections: HF ``self_attn.qkv_proj`` / GGUF ``attn_qkv`` ([q | k | v] rows) and HF
  ``mlp.gate_up_proj`` / GGUF ``ffn_up`` ([gate | up], 2 x ``n_ff`` rows, llama.cpp's converter keeps
  them fused) are cut into the llama block's ``attn_q/k/v`` and ``ffn_gate`` / ``ffn_up`` at load
  (a row slice: packed 4-bit rows stay packed). GGUF files with separate q/k/v load too.
- Partial rotary (Phi-4-mini: ``partial_rotary_factor`` 0.75; GGUF ``phi3.rope.dimension_count``):
  the first ``rope_dim`` dims of each head rotate (NEOX half-split within them), the rest pass.
- LongRoPE (``rope_type`` "longrope" / "su"; GGUF ``rope_factors_long.weight`` /
  ``rope_factors_short.weight`` [rope_dim/2] and ``phi3.rope.scaling.attn_factor``): frequencies
  divided by the short or the long factors, cos/sin times the attention factor
  (sqrt(1 + ln(factor) / ln(original context)) unless the config gives ``attention_factor``).
  transformers picks the long factors for a forward whose length exceeds
  ``original_max_position_embeddings`` and drops its cache when a sequence crosses it; a KV cache
  shared across requests cannot, so the choice is made once per engine from the context it
  serves (the module's ``max_positions``: n_ctx + one block), as llama.cpp does from its
  ``n_ctx``: equal to transformers for every sequence when the context is on one side of the
  original length.

- Sliding window (Phi-3-mini-4k / Phi-3-small: ``sliding_window`` 2047; GGUF
  ``phi3.attention.sliding_window``, 0 for none as llama.cpp's converter writes for Phi-4): every
  layer's query at position p sees keys at p - window < j <= p, as transformers' ``Phi3Model``
  masks them (``create_sliding_window_causal_mask``). Computed only where the window is shorter
  than the engine's context (kvserve.models.window_attention); a longer window (Phi-3-mini-128k's
  262,144) changes nothing. Every layer slides, so a sequence keeps only the blocks its window
  still reaches, as gemma's sliding layers do: the engine gives the layers one sliding group
  (kvserve.engine.kv_budget.window_groups, ``window_kv_views``) whose pool holds about
  window / block_size blocks a sequence, and the full-attention pool keeps only the block tables
  and the prefix index (0 bytes a block). Prefix hits need the window's blocks before the hit's end
  (kvserve.engine.kv_cache); ``--cache-reuse`` shifts are refused as for gemma (not exact). llama.cpp turns phi3's window off ("Phi SWA is currently disabled", full
  attention on every layer): past the window kvserve follows transformers, not llama-server.

Refused at load, naming the key: RoPE scaling types other than LongRoPE, factors of the wrong
length.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from kvserve.loaders.weights import ModelConfig, ModelLoadError, Weight
from kvserve.models.family import (
    LLAMA_HF_LAYER_NAMES,
    llama_config_from_gguf,
    llama_config_from_hf,
    llama_hf_tensor_name,
)
from kvserve.models.llama import AttentionBatch, LlamaModel
from kvserve.models.window_attention import paged_attention, sdpa_attend


@dataclass(slots=True)
class Phi3Config(ModelConfig):
    """A ModelConfig with phi3's RoPE.

    Attributes:
        rope_dim: rotated dims per head (<= head_dim; partial rotary below it).
        rope_short, rope_long: LongRoPE factors [rope_dim/2] (empty: plain RoPE).
        rope_attn_factor: LongRoPE's cos/sin scale.
        n_ctx_orig: original training context (tokens): a context above it takes the long factors.
        window: every layer's sliding window (tokens, the query included; 0: none).
    """

    rope_dim: int = 0
    rope_short: tuple[float, ...] = ()
    rope_long: tuple[float, ...] = ()
    rope_attn_factor: float = 1.0
    n_ctx_orig: int = 0
    window: int = 0


def _phi3(base: ModelConfig, **extra) -> Phi3Config:
    return Phi3Config(**{f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}, **extra)


def config_from_hf(cfg: dict, path: str) -> Phi3Config:
    """A Phi3Config from config.json (transformers' Phi3Config: ``rope_parameters`` or the older
    ``rope_scaling`` with ``type`` "longrope"/"su", ``partial_rotary_factor``).

    Raises:
        ModelLoadError: a missing key, a RoPE type other than LongRoPE, factors of the wrong
            length (each names its key).
    """
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = dict(cfg.get(key) or {})
    rtype = rope.get("rope_type", rope.get("type")) or "default"
    if rtype not in ("default", "longrope", "su"):
        raise ModelLoadError(f"{path}: config.json {key}.rope_type is {rtype!r}: kvserve computes longrope "
                             "(or default) for phi3")
    theta = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    base = llama_config_from_hf({**cfg, "rope_scaling": None, "rope_parameters": {"rope_theta": theta}}, path,
                                arch="phi3")
    rotary = float(rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
    rope_dim = int(base.head_dim * rotary)
    extra = dict(rope_dim=rope_dim, window=int(cfg.get("sliding_window") or 0))
    if rtype != "default":
        orig = int(rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or base.n_ctx_train)
        factor = float(rope.get("factor") or base.n_ctx_train / orig)
        attn = rope.get("attention_factor")
        if attn is None:
            attn = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1.0 else 1.0
        for name in ("short_factor", "long_factor"):
            if len(rope.get(name) or ()) != rope_dim // 2:
                raise ModelLoadError(f"{path}: config.json {key}.{name} has {len(rope.get(name) or ())} values, "
                                     f"expected {rope_dim // 2} (rotary dims / 2)")
        extra.update(rope_short=tuple(map(float, rope["short_factor"])),
                     rope_long=tuple(map(float, rope["long_factor"])), rope_attn_factor=float(attn), n_ctx_orig=orig)
    return _phi3(base, **extra)


def config_from_gguf(md: dict, path: str, shapes: dict | None = None) -> Phi3Config:
    """A Phi3Config from ``phi3.*`` GGUF metadata (llama.cpp's keys: ``rope.dimension_count``,
    ``rope.scaling.attn_factor``, ``rope.scaling.original_context_length``,
    ``attention.sliding_window``, 0: none); the LongRoPE factors are tensors, read by :func:`prepare`.

    Raises:
        ModelLoadError: a missing key, factor tensors of the wrong shape.
    """
    base = llama_config_from_gguf(md, path, shapes)
    rope_dim = int(md.get("phi3.rope.dimension_count") or base.head_dim)
    for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        shape = (shapes or {}).get(name)
        if shape is not None and tuple(shape) != (rope_dim // 2,):
            raise ModelLoadError(f"{path}: tensor '{name}' has shape {list(shape)}, expected [{rope_dim // 2}] "
                                 "(phi3.rope.dimension_count / 2)")
    return _phi3(base, rope_dim=rope_dim, rope_attn_factor=float(md.get("phi3.rope.scaling.attn_factor") or 1.0),
                 n_ctx_orig=int(md.get("phi3.rope.scaling.original_context_length") or base.n_ctx_train),
                 window=int(md.get("phi3.attention.sliding_window") or 0))


def kv_spec(config: Phi3Config):
    """Per layer: the sliding window of every layer, or full attention (no window)."""
    from kvserve.models.family import FULL, KVSpec

    return (KVSpec("sliding", config.window) if config.window else FULL,) * config.n_layer


#: HF per-layer names of phi3 (fused q|k|v and gate|up; the rest as llama's) -> kvserve's
PHI3_HF_LAYER_NAMES = {**LLAMA_HF_LAYER_NAMES, "self_attn.qkv_proj.weight": "attn_qkv.weight",
                       "mlp.gate_up_proj.weight": "ffn_up.weight"}


def hf_tensor_name(name: str, config=None) -> str | None:
    """An HF phi3 tensor name -> kvserve's (GGUF) name; None for tensors not used."""
    return llama_hf_tensor_name(name, config, PHI3_HF_LAYER_NAMES)


def required_tensors(config: Phi3Config, weights: dict) -> list[str]:
    """The tensors a phi3 model needs, in order (fused ``attn_qkv`` or separate q/k/v as the file
    has them; ``output.weight`` optional: tied embeddings)."""
    needed = ["token_embd.weight", "output_norm.weight"]
    for i in range(config.n_layer):
        p = f"blk.{i}."
        qkv = [p + "attn_qkv.weight"] if p + "attn_qkv.weight" in weights else [p + f"attn_{x}.weight" for x in "qkv"]
        needed += [p + "attn_norm.weight", *qkv, p + "attn_output.weight", p + "ffn_norm.weight", p + "ffn_up.weight",
                   p + "ffn_down.weight"]
    return needed


def rotary_order(n_rows: int, n_head: int, rope_dim: int) -> np.ndarray:
    """Row order turning each head's first ``rope_dim`` rows from half-split (NEOX) to interleaved
    pairs (the llama block's RoPE layout), the remaining rows (not rotated) kept after them."""
    hd = n_rows // n_head
    head = np.concatenate([np.arange(rope_dim).reshape(2, rope_dim // 2).T.reshape(-1), np.arange(rope_dim, hd)])
    return (np.arange(n_head)[:, None] * hd + head[None, :]).reshape(-1)


def prepare(config: Phi3Config, weights: dict[str, Weight], fmt: str) -> None:
    """Cut the fused tensors into the llama block's, put Q/K rows in its RoPE layout (both formats
    keep phi3's NEOX rows), and move GGUF's LongRoPE factor tensors into the config."""
    c = config
    qs, kvs = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    for i in range(c.n_layer):
        p = f"blk.{i}."
        qkv = weights.pop(p + "attn_qkv.weight", None)
        if qkv is not None:
            weights[p + "attn_q.weight"] = qkv.rows(0, qs)
            weights[p + "attn_k.weight"] = qkv.rows(qs, qs + kvs)
            weights[p + "attn_v.weight"] = qkv.rows(qs + kvs, qs + 2 * kvs)
        up = weights[p + "ffn_up.weight"]
        if up.shape[0] == 2 * c.n_ff:  # [gate | up]
            weights[p + "ffn_gate.weight"] = up.rows(0, c.n_ff)
            weights[p + "ffn_up.weight"] = up.rows(c.n_ff, 2 * c.n_ff)
        elif p + "ffn_gate.weight" not in weights:
            raise ModelLoadError(f"tensor '{p}ffn_up.weight' has {up.shape[0]} rows: expected 2 x {c.n_ff} "
                                 "(gate | up) or a separate ffn_gate.weight")
        for name, heads in (("attn_q", c.n_head), ("attn_k", c.n_head_kv)):
            weights[p + name + ".weight"] = weights[p + name + ".weight"].permute_rows(
                rotary_order(heads * c.head_dim, heads, c.rope_dim))
    long, short = weights.pop("rope_factors_long.weight", None), weights.pop("rope_factors_short.weight", None)
    if long is not None and short is not None:
        c.rope_long = tuple(float(x) for x in long.to_dense().reshape(-1))
        c.rope_short = tuple(float(x) for x in short.to_dense().reshape(-1))


def rope_tables(config: Phi3Config, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim/2] complex64 rotations in the llama block's pair layout: the first
    rope_dim/2 pairs rotate (LongRoPE's long factors when ``max_positions`` exceeds the original
    context, else the short ones; magnitude the attention factor), the rest are 1 (not rotated)."""
    c = config
    r = c.rope_dim
    inv = 1.0 / (c.rope_freq_base ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r)).double()
    mag = 1.0
    if c.rope_long:
        factors = c.rope_long if max_positions > c.n_ctx_orig else c.rope_short
        inv = inv / torch.tensor(factors, dtype=torch.float64)
        mag = c.rope_attn_factor
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv)  # [P, r/2]
    cis = torch.ones(max_positions, c.head_dim // 2, dtype=torch.complex128)
    cis[:, : r // 2] = torch.polar(torch.full_like(freqs, mag), freqs)
    return cis.to(torch.complex64)


class Phi3Model(LlamaModel):
    """The llama block with phi3's RoPE tables (:func:`rope_tables`) and, where the config's window
    is shorter than ``max_positions``, its sliding window on every layer; arguments as LlamaModel's."""

    def __init__(self, config: Phi3Config, weights: dict[str, Weight], *args, max_positions: int = 8192, **kwargs):
        super().__init__(config, weights, *args, max_positions=max_positions, **kwargs)
        self.rope_cis = rope_tables(config, max_positions).to(self.device)
        self.rope_cos = self.rope_cis.real.contiguous()
        self.rope_sin = self.rope_cis.imag.contiguous()
        #: the window every layer attends within (tokens); 0 when it reaches past every position
        self.window = config.window if 0 < config.window < max_positions else 0

    #: with a window, every layer reads and writes the sliding group's rows through
    #: ``AttentionBatch.windows`` when the engine gives it one (kvserve.engine.kv_budget.window_groups:
    #: a window shorter than one sequence's context); else the whole sequence's rows, masked
    window_kv_views = True

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch, kv_caches, logits_indices,
                return_hidden: bool = False, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """LlamaModel.forward over the sliding group's view of the batch where the engine keeps one
        (``batch.windows[window]``: every layer's cache is that group's), else over ``batch``."""
        if self.window and batch.windows:
            batch = batch.windows.get(self.window, batch)
        return super().forward(input_ids, batch, kv_caches, logits_indices, return_hidden, hidden)

    def _attention(self, q, k, v, k_cache, v_cache, batch: AttentionBatch) -> torch.Tensor:
        """LlamaModel's attention, or with a window the masked one over the rows it reaches
        (kvserve.models.window_attention.paged_attention): q [T, H, D], k/v [T, Hkv, D] -> [T, H * D]."""
        if not self.window:
            return super()._attention(q, k, v, k_cache, v_cache, batch)
        return paged_attention(q, k, v, k_cache, v_cache, batch, self.window,
                               partial(sdpa_attend, scale=self.scale, window=self.window))

    def decode_step(self, *args, **kwargs):
        """LlamaModel's compiled decode step; refused with a window (CompiledDecode logs it and the
        engine stays eager)."""
        if self.window:
            raise NotImplementedError("the compiled decode step does not implement phi3's sliding window")
        return super().decode_step(*args, **kwargs)
