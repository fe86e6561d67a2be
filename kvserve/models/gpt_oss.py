"""The gpt-oss family (OpenAI's gpt-oss-20b / -120b): a mixture-of-experts decoder over the paged KV cache.

What differs from the llama block (kvserve.models.llama, whose Linear, RMSNorm, RoPE tables and cache
reads it composes, as kvserve.models.gemma does):

* attention sinks: one learned logit per query head joins each softmax's denominator and is dropped
  from its numerator (transformers' ``GptOssAttention.sinks``, llama.cpp's ``attn_sinks``), so a head
  may attend to nothing: ``p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k))``;
* a sliding window (128 tokens in the released models) on alternate layers, the even ones: a query at
  position p sees keys at p - window < j <= p (transformers' ``layer_types``; GGUF
  ``attention.sliding_window`` with llama.cpp's pattern 2, or ``attention.sliding_window_pattern``);
* biases on the q/k/v and output projections, on the router and on every expert;
* YaRN RoPE in the NEOX (half-split) layout, permuted to kvserve's interleaved pairs at load. HF
  directories carry ``truncate: false`` (the correction range is not rounded), which the shared YaRN
  code follows; GGUF files are run as llama.cpp runs them (rounded range);
* a MoE FFN after ``post_attention_norm`` (no dense FFN): ``n_expert`` experts, the top-k (4) by router
  logit, their weights the softmax over those k logits (not over all experts), each expert a clamped
  SwiGLU: ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``, ``(u + 1) * g * sigmoid(alpha g)``
  (alpha 1.702, limit 7.0; HF ``swiglu_alpha`` / ``swiglu_limit``). A step's rows are grouped by
  expert and experts no row chose are not read (kvserve.models.moe.combine_experts, shared with
  qwen3moe).

Tensors, in kvserve's (llama.cpp's) names: ``blk.N.attn_{q,k,v,output}.{weight,bias}``,
``attn_sinks.weight`` [n_head], ``attn_norm`` / ``post_attention_norm``, ``ffn_gate_inp.{weight,bias}``
[E, n_embd] / [E], ``ffn_{gate,up}_exps.weight`` [E, n_ff, n_embd], ``ffn_down_exps.weight``
[E, n_embd, n_ff] with biases [E, n_ff] / [E, n_embd]. :func:`prepare` maps the other layouts to these:
an HF directory's fused, transposed ``mlp.experts.gate_up_proj`` [E, n_embd, 2 n_ff] (gate and up
interleaved by column), and Ollama's ``gptoss`` files (``attn_out``, ``ffn_norm``, ``attn_qkv``,
``ffn_gate_up_exps`` interleaved by row, MXFP4 blocks in OpenAI's nibble order as ggml type 4).

The KV spec per layer is a sliding window of ``window`` tokens or full attention; the sliding layers
keep a pool of their own holding only their window's blocks (``window_kv_views``, read as
kvserve.models.gemma does: kvserve.engine.kv_budget.window_groups; the cache reads are
kvserve.models.window_attention's, shared with gemma). The attention is SDPA's
with the sinks as one more key of zeros whose score the additive mask carries (:func:`attend`). kvserve's native decode
step and the compiled decode graph do not implement this block (the family record turns the native
step off; :meth:`GptOssModel.decode_step` refuses, so the engine stays eager).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.kv_quant import kv_write
from kvserve.loaders.weights import ModelConfig, ModelLoadError, Weight, interleave_qk
from kvserve.models.llama import AttentionBatch, Linear, RMSNorm, auto_head_kernel, rope_attention_factor, \
    rope_inv_freq
from kvserve.models.moe import MoeConfig, OneRowExperts, combine_experts, expert_linear, expert_rows
from kvserve.models.window_attention import (
    gguf_layer_windows,
    hf_layer_windows,
    layer_kv_spec,
    paged_attention,
    rope_cis,
    visible,
)

#: GGUF architecture names: llama.cpp's, and the one Ollama's converter wrote (its loader renames it)
GGUF_ARCHS = ("gpt-oss", "gptoss")


@dataclass(slots=True)
class GptOssConfig(MoeConfig):
    """A MoeConfig with gpt-oss's options.

    Attributes:
        layer_windows: per layer, the sliding window in tokens (0: full attention).
        swiglu_alpha: the sigmoid gain of the experts' SwiGLU.
        swiglu_limit: the clamp of gate (above) and up (both sides) before it.
    """

    layer_windows: tuple[int, ...] = ()
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


def _base_fields(base: ModelConfig) -> dict:
    return {f: getattr(base, f) for f in ModelConfig.__slots__}


# -- config readers ---------------------------------------------------------------------------------

def config_from_gguf(md: dict, path: str, shapes: dict | None = None) -> GptOssConfig:
    """A GptOssConfig from ``gpt-oss.*`` (llama.cpp) or ``gptoss.*`` (Ollama) GGUF metadata.

    Ollama's files name no ``rope.scaling.type``: gpt-oss always runs YaRN, so a ``rope.scaling.factor``
    above 1 means YaRN there (with ``rope.scaling.original_context_length``). The experts' width is
    ``expert_feed_forward_length`` (llama.cpp), else ``feed_forward_length`` (Ollama).

    Raises ModelLoadError naming a missing key or an option kvserve lacks."""
    from kvserve.models.family import gguf_yarn, llama_config_from_gguf

    arch = md.get("general.architecture")
    base = llama_config_from_gguf(md, path, shapes)
    kw = _base_fields(base)
    factor = float(md.get(f"{arch}.rope.scaling.factor") or 1.0)
    if kw["rope_scaling"] is None and factor > 1.0:
        def get(key, default=None, required=True):
            return md.get(f"{arch}.{key}", default)
        kw["rope_scaling"] = gguf_yarn(get, arch, path)
    if shapes is not None:  # biases: llama.cpp's names or Ollama's (fused q|k|v, attn_out)
        kw["qkv_bias"] = "blk.0.attn_q.bias" in shapes or "blk.0.attn_qkv.bias" in shapes
        kw["attn_bias"] = "blk.0.attn_output.bias" in shapes or "blk.0.attn_out.bias" in shapes

    def count(key: str, default=None) -> int:
        v = md.get(f"{arch}.{key}", default)
        if v is None:
            raise ModelLoadError(f"{path}: missing GGUF key '{arch}.{key}'")
        return int(v[0] if isinstance(v, list) else v)

    return GptOssConfig(**kw, n_expert=count("expert_count"), n_expert_used=count("expert_used_count"),
                        n_ff_expert=count("expert_feed_forward_length", base.n_ff),
                        layer_windows=gguf_layer_windows(md, arch, base.n_layer, path, 2))


def config_from_hf(cfg: dict, path: str) -> GptOssConfig:
    """A GptOssConfig from config.json (transformers' GptOssConfig: ``num_local_experts``,
    ``num_experts_per_tok``, ``intermediate_size`` (one expert's width), ``layer_types`` /
    ``sliding_window``, ``swiglu_alpha`` / ``swiglu_limit``, YaRN in ``rope_parameters``).

    Raises ModelLoadError: missing keys, a RoPE scaling kvserve lacks, layer types other than sliding
    and full attention."""
    from kvserve.models.family import llama_config_from_hf

    base = llama_config_from_hf(cfg, path, arch="gpt-oss")
    kw = _base_fields(base)
    kw["qkv_bias"] = kw["attn_bias"] = bool(cfg.get("attention_bias", True))
    kw["tie_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
    n_expert = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0)
    if not n_expert or not top_k:
        raise ModelLoadError(f"{path}: config.json lacks 'num_local_experts' / 'num_experts_per_tok'")
    types = dict(cfg)
    types.setdefault("sliding_window_pattern", 2)  # transformers' default: even layers slide
    return GptOssConfig(**kw, n_expert=n_expert, n_expert_used=top_k, n_ff_expert=base.n_ff,
                        expert_weights_norm=True, layer_windows=hf_layer_windows(types, base.n_layer, path),
                        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))


# -- tensors ----------------------------------------------------------------------------------------

#: HF per-layer names -> kvserve's (the experts' fused tensors are cut by :func:`prepare`)
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.sinks": "attn_sinks.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.experts.gate_up_proj": "hf_gate_up_exps", "mlp.experts.gate_up_proj_bias": "hf_gate_up_exps_bias",
    "mlp.experts.down_proj": "hf_down_exps", "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
    # the released checkpoints (quant_method mxfp4): uint8 blocks [E, out, in / 32, 16] and scales
    "mlp.experts.gate_up_proj_blocks": "hf_gate_up_blocks", "mlp.experts.gate_up_proj_scales": "hf_gate_up_scales",
    "mlp.experts.down_proj_blocks": "hf_down_blocks", "mlp.experts.down_proj_scales": "hf_down_scales",
}

#: per layer, the canonical tensors with the other names files use for them (HF's fused experts,
#: Ollama's ``gptoss`` names); the first name is the one :func:`prepare` leaves
LAYER_TENSORS = (
    ("attn_norm.weight",),
    ("attn_q.weight", "attn_qkv.weight"), ("attn_k.weight", "attn_qkv.weight"), ("attn_v.weight", "attn_qkv.weight"),
    ("attn_output.weight", "attn_out.weight"),
    ("attn_sinks.weight", "attn_sinks"),
    ("post_attention_norm.weight", "ffn_norm.weight"),
    ("ffn_gate_inp.weight",),
    ("ffn_gate_exps.weight", "ffn_gate_up_exps.weight", "hf_gate_up_exps", "hf_gate_up_blocks"),
    ("ffn_up_exps.weight", "ffn_gate_up_exps.weight", "hf_gate_up_exps", "hf_gate_up_scales"),
    ("ffn_down_exps.weight", "hf_down_exps", "hf_down_blocks"),
    ("ffn_gate_inp.bias",),
    ("ffn_gate_exps.bias", "ffn_gate_up_exps.bias", "hf_gate_up_exps_bias"),
    ("ffn_up_exps.bias", "ffn_gate_up_exps.bias", "hf_gate_up_exps_bias"),
    ("ffn_down_exps.bias",),
)


def hf_tensor_name(name: str, config=None) -> str | None:
    """kvserve's name of an HF gpt-oss tensor (the fused experts under names :func:`prepare` cuts);
    None for tensors not used."""
    from kvserve.models.family import llama_hf_tensor_name

    return llama_hf_tensor_name(name, config, HF_LAYER_NAMES)


def required_tensors(config: GptOssConfig, weights: dict) -> list[str]:
    """The tensors a gpt-oss model needs, in order, each under the name the file uses (the canonical
    one when none is there, so a missing tensor is named as llama.cpp names it)."""
    needed = ["token_embd.weight", "output_norm.weight"]
    for i in range(config.n_layer):
        p = f"blk.{i}."
        for names in LAYER_TENSORS:
            needed.append(next((p + n for n in names if p + n in weights), p + names[0]))
        if config.qkv_bias:
            for x in "qkv":
                needed.append(next((p + n for n in (f"attn_{x}.bias", "attn_qkv.bias") if p + n in weights),
                                   f"{p}attn_{x}.bias"))
        if config.attn_bias:
            needed.append(next((p + n for n in ("attn_output.bias", "attn_out.bias") if p + n in weights),
                               f"{p}attn_output.bias"))
    return list(dict.fromkeys(needed))


def _dense(arr: np.ndarray, like: Weight) -> Weight:
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    return Weight(arr.shape, dense=arr, source_type=like.source_type)


def _rename(weights: dict, old: str, new: str) -> None:
    if old in weights and new not in weights:
        weights[new] = weights.pop(old)


def _deinterleave(w: Weight, axis: int) -> tuple[Weight, Weight]:
    """(even, odd) slices of ``w`` along ``axis`` (gpt-oss fuses gate and up by alternating them);
    stacked experts kept as GGUF blocks ([E, rows, row bytes], ``axis`` 1) stay blocks (copies of
    every other row, the same bytes)."""
    if w.raw is not None and axis == 1 and len(w.shape) == 3:
        shape = (w.shape[0], w.shape[1] // 2, w.shape[2])
        return tuple(Weight(shape, raw=np.ascontiguousarray(w.raw[:, i::2]), source_type=w.source_type)
                     for i in (0, 1))
    arr = w.to_dense()
    idx = [slice(None)] * arr.ndim
    idx[axis] = slice(0, None, 2)
    even = arr[tuple(idx)]
    idx[axis] = slice(1, None, 2)
    return _dense(even, w), _dense(arr[tuple(idx)], w)


def hf_mxfp4(blocks: Weight, scales: Weight | None, name: str) -> Weight:
    """An HF checkpoint's MXFP4 experts (uint8 ``blocks`` [E, out, in / 32, 16] in the checkpoint's
    nibble order, e8m0 ``scales`` [E, out, in / 32]) as ggml MXFP4 rows [E, out, (in / 32) * 17] (what
    llama.cpp's converter writes: the scale byte, then the nibbles regrouped).

    Raises ModelLoadError: no scales, or shapes that do not pair up (``name`` is named)."""
    from kvserve.loaders.gguf import ollama_mxfp4_to_ggml

    if scales is None:
        raise ModelLoadError(f"missing tensor '{name}_scales' (the scales of '{name}_blocks')")
    b, sc = np.asarray(blocks.raw), np.asarray(scales.raw)
    if b.ndim != 4 or b.shape[-1] != 16 or sc.shape != b.shape[:-1]:
        raise ModelLoadError(f"tensors '{name}_blocks' {list(b.shape)} and '{name}_scales' {list(sc.shape)} are not "
                             "MXFP4 blocks [E, out, in / 32, 16] with scales [E, out, in / 32]")
    e, out, nb = sc.shape
    joined = np.concatenate([sc[..., None], b], axis=-1)  # [E, out, nb, 17]
    raw = ollama_mxfp4_to_ggml(joined.reshape(-1)).reshape(e, out, nb * 17)
    return Weight((e, out, nb * 32), raw=raw, source_type="MXFP4")


def prepare(config: GptOssConfig, weights: dict[str, Weight], fmt: str) -> None:
    """The file's layout to the module's (see the module docstring), then Q/K rows (and biases) from
    NEOX half-split to interleaved pairs (llama.cpp's converter leaves gpt-oss NEOX, HF always is)."""
    hd = config.head_dim
    for i in range(config.n_layer):
        p = f"blk.{i}."
        # HF MXFP4 (the released checkpoints): gate|up rows alternate, as Ollama's fused tensor below
        if p + "hf_gate_up_blocks" in weights:
            weights[p + "ffn_gate_up_exps.weight"] = hf_mxfp4(weights.pop(p + "hf_gate_up_blocks"),
                                                              weights.pop(p + "hf_gate_up_scales", None),
                                                              f"model.layers.{i}.mlp.experts.gate_up_proj")
        if p + "hf_down_blocks" in weights:
            weights[p + "ffn_down_exps.weight"] = hf_mxfp4(weights.pop(p + "hf_down_blocks"),
                                                           weights.pop(p + "hf_down_scales", None),
                                                           f"model.layers.{i}.mlp.experts.down_proj")
        # HF: gate_up [E, n_embd, 2 n_ff] (gate even columns, up odd), down [E, n_ff, n_embd]
        if p + "hf_gate_up_exps" in weights:
            g, u = _deinterleave(weights.pop(p + "hf_gate_up_exps"), 2)
            weights[p + "ffn_gate_exps.weight"] = _dense(g.dense.transpose(0, 2, 1), g)
            weights[p + "ffn_up_exps.weight"] = _dense(u.dense.transpose(0, 2, 1), u)
        if p + "hf_gate_up_exps_bias" in weights:
            weights[p + "ffn_gate_exps.bias"], weights[p + "ffn_up_exps.bias"] = \
                _deinterleave(weights.pop(p + "hf_gate_up_exps_bias"), 1)
        if p + "hf_down_exps" in weights:
            d = weights.pop(p + "hf_down_exps")
            weights[p + "ffn_down_exps.weight"] = _dense(d.to_dense().transpose(0, 2, 1), d)
        # Ollama's gptoss: gate and up alternate by row, under one name
        for suffix, axis in (("weight", 1), ("bias", 1)):
            fused = weights.pop(p + "ffn_gate_up_exps." + suffix, None)
            if fused is not None:
                weights[p + "ffn_gate_exps." + suffix], weights[p + "ffn_up_exps." + suffix] = \
                    _deinterleave(fused, axis)
        for suffix in ("weight", "bias"):
            qkv = weights.pop(p + "attn_qkv." + suffix, None)
            if qkv is not None:
                sizes = [config.n_head * hd, config.n_head_kv * hd, config.n_head_kv * hd]
                arr = qkv.to_dense()
                cuts = np.split(arr, np.cumsum(sizes)[:-1], axis=0)
                for x, part in zip("qkv", cuts):
                    weights[f"{p}attn_{x}.{suffix}"] = _dense(part, qkv)
        _rename(weights, p + "attn_out.weight", p + "attn_output.weight")
        _rename(weights, p + "attn_out.bias", p + "attn_output.bias")
        _rename(weights, p + "attn_sinks", p + "attn_sinks.weight")
        _rename(weights, p + "ffn_norm.weight", p + "post_attention_norm.weight")
    interleave_qk(config, weights)


#: per layer: a sliding window of the layer's tokens, or full attention
kv_spec = layer_kv_spec


# -- the module -------------------------------------------------------------------------------------

#: the additive mask of one attention call is built in query chunks of at most this many elements
#: (B * H * Lq * (Lk + 1) float values: 64 Mi = 256 MiB in float32)
SCORE_ELEMENTS_MAX = 1 << 26

#: the sink logit used where a layer has none: below every score a query can reach, so its weight is
#: exactly 0 next to any visible key, and a query that sees no key gets zeros (the sink's value)
NO_SINK = -1e30


def attend(q, k, v, q_pos, k_pos, valid, scale: float, window: int, sinks) -> torch.Tensor:
    """Attention with sinks and a window: q [B, Lq, H, D], k/v [B, Lk, Hkv, D] (H a multiple of Hkv),
    q_pos [B, Lq] and k_pos [B, Lk] long, valid [B, Lk] bool or None, sinks [H] float32 or None
    -> [B, Lq, H, D] in q's dtype.

    Key j is seen by query i when k_pos <= q_pos, within ``window`` tokens (q_pos - k_pos < window;
    0: no window) and valid; each head's softmax denominator adds ``exp(sinks[h])``
    (transformers' ``eager_attention_forward`` with ``s_aux``, llama.cpp's ``ggml_soft_max_add_sinks``).

    Computed by SDPA (2-3x the explicit float32 softmax on the CPU): the sink is one more key whose
    K and V are zero and whose score comes from the additive mask (``sinks[h]`` in that column, 0 where
    a key is seen, -inf where not), so ``softmax([s, sink]) @ [v, 0]`` is the sinks' attention exactly.
    A query that sees no key attends to the sink alone and gets zeros. The mask is built in query
    chunks of at most :data:`SCORE_ELEMENTS_MAX` elements."""
    B, Lq, H, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    zero = k.new_zeros(B, 1, Hkv, D)
    kt = torch.cat([k, zero], dim=1).transpose(1, 2)  # [B, Hkv, Lk + 1, D]: the sink's key is last
    vt = torch.cat([v, zero.to(v.dtype)], dim=1).transpose(1, 2)
    if sinks is None:
        sink = torch.full((1, H, 1, 1), NO_SINK, dtype=q.dtype, device=q.device)
    else:  # an -inf sink (none) still leaves a row that sees nothing one finite logit: zeros, not NaN
        sink = sinks.to(q.dtype).clamp_min(NO_SINK).view(1, H, 1, 1)
    qt = q.transpose(1, 2)  # [B, H, Lq, D]
    out = torch.empty(B, H, Lq, D, dtype=q.dtype, device=q.device)
    step = max(1, SCORE_ELEMENTS_MAX // max(1, B * H * (Lk + 1)))
    for a in range(0, Lq, step):
        b = min(Lq, a + step)
        seen = visible(q_pos[:, a:b], k_pos, window, valid)  # [B, lq, Lk]
        mask = q.new_empty(B, H, b - a, Lk + 1)
        mask[..., :Lk] = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~seen, float("-inf"))[:, None]
        mask[..., Lk:] = sink
        out[:, :, a:b] = F.scaled_dot_product_attention(qt[:, :, a:b], kt, vt, attn_mask=mask, scale=scale,
                                                        enable_gqa=Hkv != H)
    return out.transpose(1, 2)


class GptOssMoE(nn.Module):
    """x [T, n_embd] float32 -> [T, n_embd]: the top-k experts' clamped SwiGLUs, weighted by the
    softmax over the k router logits (see the module docstring).

    Args:
        weights: the model's weights; layer: the layer index; config: its GptOssConfig.
        lin: keyword arguments of :class:`kvserve.models.llama.Linear` (kernel, dtype, device...).
    Each expert is two Linears (gate|up fused, and down, with their biases) over its rows of the
    stacked [E, out, in] tensors (kvserve.models.moe.expert_rows / expert_linear: GGUF blocks
    multiplied where they lie, idle experts never read).
    """

    def __init__(self, weights: dict[str, Weight], layer: int, config: GptOssConfig, lin: dict):
        super().__init__()
        p = f"blk.{layer}."
        dev = lin["device"]
        router = weights[p + "ffn_gate_inp.weight"]
        self.router = torch.from_numpy(np.ascontiguousarray(router.to_dense(), dtype=np.float32)).to(dev)
        self.router_bias = torch.from_numpy(weights[p + "ffn_gate_inp.bias"].to_dense()).float().to(dev)
        self.top_k, self.alpha, self.limit = config.n_expert_used, config.swiglu_alpha, config.swiglu_limit
        self.n_ff = config.n_ff_expert
        gate, up, down = (expert_rows(weights[p + f"ffn_{x}_exps.weight"]) for x in ("gate", "up", "down"))
        gb, ub, db = (expert_rows(weights[p + f"ffn_{x}_exps.bias"]) for x in ("gate", "up", "down"))
        self.gate_up = nn.ModuleList(expert_linear([gate[e], up[e]], [gb[e], ub[e]], lin)
                                     for e in range(config.n_expert))
        self.down = nn.ModuleList(expert_linear([down[e]], [db[e]], lin) for e in range(config.n_expert))
        self.one_row = OneRowExperts.build(list(self.gate_up), list(self.down))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.addmm(self.router_bias, x, self.router.t())  # [T, E]
        top, idx = torch.topk(logits, self.top_k, dim=-1)
        w = torch.softmax(top, dim=-1)
        if x.shape[0] == 1 and self.one_row is not None:  # a one-row (decode) step
            return self.one_row(x, idx, w, self._act)
        return combine_experts(x, idx, w, len(self.gate_up), self._expert)

    def _act(self, gu: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU of gate|up rows gu [n, 2 n_ff] (worked on in place) -> [n, n_ff]."""
        gate = gu[:, :self.n_ff].clamp_(max=self.limit)
        up = gu[:, self.n_ff:].clamp_(min=-self.limit, max=self.limit).add_(1)
        return torch.sigmoid(gate * self.alpha).mul_(gate).mul_(up)

    def _expert(self, e: int, xs: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s clamped SwiGLU of its rows xs [n, n_embd] -> [n, n_embd]."""
        return self.down[e].forward(self._act(self.gate_up[e].forward(xs)))  # gate|up: a new tensor


class GptOssModel(nn.Module):
    """The gpt-oss decoder over a paged KV cache (see the module docstring).

    Args: those of :class:`kvserve.models.llama.LlamaModel` (the same numerics options; ``native_q4``
    does not apply).
    """

    native_decode = False
    #: sliding layers read and write their group's rows through ``AttentionBatch.windows`` (the engine
    #: gives them pools of their own that hold only their window's blocks:
    #: kvserve.engine.kv_budget.window_groups)
    window_kv_views = True

    def __init__(self, config: GptOssConfig, weights: dict[str, Weight], dtype=torch.float32, device="cpu",
                 kernel: str = "dense", small_max_rows: int = 0, max_positions: int = 8192,
                 large_dtype=torch.float32, native_q4: bool | str = False):
        super().__init__()
        c = self.config = config
        self.device = torch.device(device)
        self.compute_dtype = torch.float32
        emb = weights["token_embd.weight"]
        #: the embedding as GGUF blocks (rows dequantized by embed()) where the file keeps them raw
        self.tok_embd_raw = emb if emb.raw is not None and self.device.type == "cpu" else None
        self.tok_embd = None if self.tok_embd_raw is not None else \
            torch.from_numpy(emb.to_dense()).to(device=device, dtype=torch.float32)
        lin = dict(dtype=dtype, device=device, kernel=kernel, small_max_rows=small_max_rows, large_dtype=large_dtype)
        self.layers = nn.ModuleList()
        for i in range(c.n_layer):
            p = f"blk.{i}."
            layer = nn.Module()
            layer.attn_norm = RMSNorm(weights[p + "attn_norm.weight"], c.rms_eps, device)
            layer.wqkv = Linear([weights[p + f"attn_{x}.weight"] for x in "qkv"],
                                [weights[p + f"attn_{x}.bias"] for x in "qkv"] if c.qkv_bias else None, **lin)
            layer.wo = Linear([weights[p + "attn_output.weight"]],
                              [weights[p + "attn_output.bias"]] if c.attn_bias else None, **lin)
            layer.sinks = torch.from_numpy(weights[p + "attn_sinks.weight"].to_dense()).float().to(device)
            layer.post_attention_norm = RMSNorm(weights[p + "post_attention_norm.weight"], c.rms_eps, device)
            layer.moe = GptOssMoE(weights, i, c, lin)
            self.layers.append(layer)
        self.output_norm = RMSNorm(weights["output_norm.weight"], c.rms_eps, device)
        head = weights.get("output.weight", emb) if not c.tie_embeddings else emb
        self.output = Linear([head], None, dtype=dtype, device=device, tied=head is emb,
                             kernel=auto_head_kernel() if kernel == "auto" else kernel, small_max_rows=small_max_rows)
        self.rope_cis = rope_cis(rope_inv_freq(c, weights.get("rope_freqs.weight")), max_positions, device,
                                 rope_attention_factor(c))
        self.q_size = c.n_head * c.head_dim
        self.kv_size = c.n_head_kv * c.head_dim
        self.scale = 1.0 / math.sqrt(c.head_dim)

    def projections(self) -> list[Linear]:
        """Every layer's attention projections (qkv, output) and experts' Linears, in layer order."""
        out = []
        for layer in self.layers:
            out += [layer.wqkv, layer.wo, *layer.moe.gate_up, *layer.moe.down]
        return out

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the token embedding: input_ids [T] long -> [T, E] float32 (a new tensor); of a
        table kept as GGUF blocks only these rows are dequantized. IndexError for ids out of range."""
        if self.tok_embd is not None:
            return self.tok_embd.index_select(0, input_ids)
        ids = input_ids.cpu().numpy()
        n = self.tok_embd_raw.shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            raise IndexError(f"token id out of range [0, {n})")
        return torch.from_numpy(self.tok_embd_raw.dense_rows(ids))

    def decode_step(self, *args, **kwargs):
        """Not written for torch.compile yet: CompiledDecode logs this and the engine stays eager."""
        raise NotImplementedError("the compiled decode step does not implement the gpt-oss block")

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch, kv_caches, logits_indices,
                return_hidden: bool = False, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The flat batch -> float32 logits [len(logits_indices), n_vocab]; the contract of
        LlamaModel.forward (no pipeline stages: ``hidden`` is refused)."""
        if hidden is not None:
            raise NotImplementedError("pipeline stages do not implement the gpt-oss block")
        c = self.config
        T = input_ids.shape[0]
        x = self.embed(input_ids)
        nq, nkv, hd = c.n_head, c.n_head_kv, c.head_dim
        qs, qks = self.q_size, self.q_size + self.kv_size
        cis = self.rope_cis[batch.positions].unsqueeze(1)  # [T, 1, D/2]
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            qkv = layer.wqkv.forward(layer.attn_norm.forward(x))
            torch.view_as_complex(qkv[:, :qks].view(T, nq + nkv, hd // 2, 2)).mul_(cis)
            q, k, v = qkv[:, :qs].view(T, nq, hd), qkv[:, qs:qks].view(T, nkv, hd), qkv[:, qks:].view(T, nkv, hd)
            window = c.layer_windows[i]
            b = batch.windows.get(window, batch) if window else batch  # a sliding group's own rows
            kv_write(k_cache, b.slot_mapping, k)
            kv_write(v_cache, b.slot_mapping, v)
            o = self._attention(q, k, v, k_cache, v_cache, b, window, layer.sinks)
            x = x + layer.wo.forward(o)
            x = x + layer.moe.forward(layer.post_attention_norm.forward(x))
        if logits_indices is not None:
            x = x[logits_indices]
        x = self.output_norm.forward(x)
        if return_hidden:
            return x
        return self.output.forward(x).float()

    def _attention(self, q, k, v, k_cache, v_cache, batch: AttentionBatch, window: int, sinks) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] (already in the cache) -> [T, H * D]
        (kvserve.models.window_attention.paged_attention with :func:`attend`'s sinks: on a window
        layer only the cache rows some query's window reaches are read)."""
        return paged_attention(q, k, v, k_cache, v_cache, batch, window,
                               partial(attend, scale=self.scale, window=window, sinks=sinks))
