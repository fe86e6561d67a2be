"""The gemma2 and gemma3 families (text): gemma's block over the paged KV cache.

What differs from the llama block (kvserve.models.llama, whose Linear, RMSNorm, RoPE tables and
cache reads it composes):

* embeddings times sqrt(n_embd) (the tied head reads them unscaled);
* four RMSNorms per layer (before and after attention, before and after the MLP), gemma's
  ``x * (1 + w)``: llama.cpp's converter stores ``1 + w`` in the GGUF, and the HF loader adds the 1;
* a GELU-tanh gated MLP;
* queries scaled by ``query_pre_attn_scalar ** -0.5`` (HF; GGUF: ``1/sqrt(head_dim)``, or
  ``1/sqrt(n_embd / n_head)`` for the 27B shapes, as llama.cpp);
* gemma2: attention logit soft-cap and final logit soft-cap (``cap * tanh(x / cap)``);
* gemma3: per-head q/k RMSNorm before RoPE, a separate RoPE base on sliding layers (10,000) and
  the file's linear scaling on global ones;
* sliding-window layers (gemma2: every other layer, gemma3: 5 of every 6): a query at position p
  sees keys at positions p - window < j <= p, masked exactly. When the engine's KV cache has
  sliding-window groups (kvserve.engine.kv_cache), such a layer reads and writes its group's own
  cache rows through ``AttentionBatch.windows[window]``, which lists only the blocks the window
  reaches; otherwise (a batch without that view) it reads the rows some query's window reaches and
  the mask does the rest (the cache reads: kvserve.models.window_attention, shared with gpt-oss).

Attention with a soft-cap (gemma2) is computed directly (scores, soft-cap, mask, softmax in
float32): SDPA has no soft-cap; without one (gemma3) it is SDPA with the window's mask.
kvserve's native decode step and the compiled decode graph do not implement this block: the family
record turns the native step off, and :meth:`GemmaModel.decode_step` refuses (the engine stays eager).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.kv_quant import kv_write
from kvserve.loaders.weights import ModelConfig, ModelLoadError, Weight, interleave_qk
from kvserve.models.llama import (
    AttentionBatch,
    Linear,
    RMSNorm,
    auto_head_kernel,
    rope_attention_factor,
    rope_inv_freq,
)
from kvserve.models.window_attention import (
    gguf_layer_windows,
    hf_layer_windows,
    layer_kv_spec,
    paged_attention,
    rope_cis,
    sdpa_attend,
    visible,
)


@dataclass(slots=True)
class GemmaConfig(ModelConfig):
    """A ModelConfig with gemma's options.

    Attributes:
        layer_windows: per layer, the sliding window in tokens (0: full attention).
        attn_softcap: attention logit soft-cap (0: none).
        final_softcap: final logit soft-cap (0: none).
        query_scale: the factor of q.k (replaces 1/sqrt(head_dim)).
        rope_local_base: RoPE theta of sliding-window layers (None: ``rope_freq_base``, and the
            file's scaling too; gemma3: 10,000 without scaling).
    """

    layer_windows: tuple[int, ...] = ()
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    query_scale: float = 0.0
    rope_local_base: float | None = None


# -- config readers ---------------------------------------------------------------------------------

def config_from_gguf(md: dict, path: str, shapes: dict | None = None) -> GemmaConfig:
    """A GemmaConfig from ``gemma2.*`` / ``gemma3.*`` GGUF metadata (llama.cpp's keys).

    Raises ModelLoadError naming a missing key or an option kvserve lacks."""
    from kvserve.models.family import llama_config_from_gguf

    arch = md.get("general.architecture")
    base = llama_config_from_gguf(md, path, shapes)
    if base.qkv_bias or base.attn_bias or base.mlp_bias:
        raise ModelLoadError(f"{path}: {arch} with projection biases is not supported")
    kw = {f: getattr(base, f) for f in ModelConfig.__slots__}
    kw["qk_norm"] = arch == "gemma3"
    # Ollama's converter names the two RoPE bases rope.global / rope.local.freq_base and a linear
    # scaling rope.freq_scale (1 / factor); llama.cpp's: rope.freq_base, 10,000 local, rope.scaling.*
    if md.get(f"{arch}.rope.global.freq_base"):
        kw["rope_freq_base"] = float(md[f"{arch}.rope.global.freq_base"])
    local = md.get(f"{arch}.rope.local.freq_base")
    scale = float(md.get(f"{arch}.rope.freq_scale") or 1.0)
    if scale != 1.0 and kw["rope_scaling"] is None:
        kw["rope_scaling"] = {"type": "linear", "factor": 1.0 / scale, "original_context_length": 0}
    big = (arch == "gemma2" and base.n_layer == 46) or (arch == "gemma3" and base.n_layer == 62)  # the 27Bs
    return GemmaConfig(
        **kw,
        layer_windows=gguf_layer_windows(md, arch, base.n_layer, path, 2 if arch == "gemma2" else 6),
        attn_softcap=float(md.get(f"{arch}.attn_logit_softcapping") or 0.0) if arch == "gemma2" else 0.0,
        final_softcap=float(md.get(f"{arch}.final_logit_softcapping") or 0.0),
        query_scale=1.0 / math.sqrt(base.n_embd / base.n_head if big else base.head_dim),
        rope_local_base=float(local) if local else 10000.0 if arch == "gemma3" else None,
    )


def config_from_hf(cfg: dict, path: str) -> GemmaConfig:
    """A GemmaConfig from config.json (transformers' Gemma2Config / Gemma3TextConfig).

    Raises ModelLoadError naming a missing key or an option kvserve lacks (a RoPE scaling other
    than linear on global layers, an activation other than GELU-tanh)."""
    from kvserve.models.family import hf_rope, llama_config_from_hf

    gemma3 = cfg.get("model_type") == "gemma3_text" or "Gemma3ForCausalLM" in (cfg.get("architectures") or [])
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast"):
        raise ModelLoadError(f"{path}: config.json hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    local_base = None
    flat = dict(cfg)
    if "full_attention" in rp:  # transformers 5: one RoPE per layer type
        flat["rope_parameters"] = rp["full_attention"]
        local = rp.get("sliding_attention") or {}
        theta, sc = hf_rope({"rope_parameters": local}, path)
        if sc is not None:
            raise ModelLoadError(f"{path}: config.json rope_parameters.sliding_attention.rope_type "
                                 f"{sc['type']!r} is not supported on sliding layers")
        local_base = theta
    elif gemma3:
        local_base = float(cfg.get("rope_local_base_freq") or 10000.0)
    base = llama_config_from_hf(flat, path, arch="gemma3" if gemma3 else "gemma2", qk_norm=gemma3)
    if base.qkv_bias or base.attn_bias or base.mlp_bias:
        raise ModelLoadError(f"{path}: config.json attention_bias: gemma with projection biases is not supported")
    kw = {f: getattr(base, f) for f in ModelConfig.__slots__}
    kw["tie_embeddings"] = bool(cfg.get("tie_word_embeddings", True))
    try:
        scalar = float(cfg["query_pre_attn_scalar"])
    except KeyError:
        raise ModelLoadError(f"{path}: config.json lacks 'query_pre_attn_scalar'") from None
    return GemmaConfig(
        **kw,
        layer_windows=hf_layer_windows(cfg, base.n_layer, path),
        attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        query_scale=scalar ** -0.5,
        rope_local_base=local_base,
    )


# -- tensors ----------------------------------------------------------------------------------------

#: HF per-layer names -> kvserve's (llama.cpp's gemma2/gemma3 names)
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}

LAYER_TENSORS = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                 "post_attention_norm.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                 "ffn_down.weight", "post_ffw_norm.weight")


def hf_tensor_name(name: str, config=None) -> str | None:
    """kvserve's name of an HF gemma tensor; None for tensors not used."""
    from kvserve.models.family import llama_hf_tensor_name

    return llama_hf_tensor_name(name, config, HF_LAYER_NAMES)


def required_tensors(config: GemmaConfig, weights: dict | None = None) -> list[str]:
    """The tensors a gemma model of ``config`` needs, in order (the q/k norms for gemma3)."""
    needed = ["token_embd.weight", "output_norm.weight"]
    for i in range(config.n_layer):
        needed += [f"blk.{i}.{n}" for n in LAYER_TENSORS]
        if config.qk_norm:
            needed += [f"blk.{i}.attn_q_norm.weight", f"blk.{i}.attn_k_norm.weight"]
    return needed


def prepare(config: GemmaConfig, weights: dict[str, Weight], fmt: str) -> None:
    """HF norm weights to ``1 + w`` (what llama.cpp's GGUF stores and RMSNorm multiplies by), then
    Q/K rows and q/k norm weights from NEOX half-split to interleaved pairs (both formats)."""
    if fmt == "hf":
        for name, w in list(weights.items()):
            if name.endswith("norm.weight"):
                weights[name] = Weight(w.shape, dense=w.to_dense() + 1.0, source_type=w.source_type)
    interleave_qk(config, weights)


#: per layer: a sliding window of the layer's tokens, or full attention
kv_spec = layer_kv_spec


# -- the module -------------------------------------------------------------------------------------

def attend(q, k, v, q_pos, k_pos, valid, scale: float, window: int, softcap: float) -> torch.Tensor:
    """q: [B, Lq, H, D], k/v: [B, Lk, Hkv, D], q_pos [B, Lq], k_pos [B, Lk] long, valid [B, Lk] bool
    or None -> [B, Lq, H, D]. Key j is seen by query i when k_pos <= q_pos, within ``window``
    tokens (q_pos - k_pos < window; 0: no window) and valid (:func:`~kvserve.models.window_attention.visible`);
    scores soft-capped by ``softcap``."""
    if not softcap:  # SDPA (3-10x the einsums on the CPU; within 1e-6 of them): gemma3
        return sdpa_attend(q, k, v, q_pos, k_pos, valid, scale, window)
    B, Lq, H, D = q.shape
    hkv = k.shape[2]
    seen = visible(q_pos, k_pos, window, valid)  # [B, Lq, Lk]
    qg = q.reshape(B, Lq, hkv, H // hkv, D)  # query head h reads KV head h // (H / Hkv), as HF's repeat_kv
    s = torch.einsum("bqkgd,blkd->bkgql", qg, k) * scale  # [B, Hkv, G, Lq, Lk]
    s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~seen[:, None, None], float("-inf"))
    return torch.einsum("bkgql,blkd->bqkgd", torch.softmax(s, dim=-1), v).reshape(B, Lq, H, D)


class GemmaModel(nn.Module):
    """gemma2 / gemma3 decoder over a paged KV cache (see the module docstring).

    Args: those of :class:`kvserve.models.llama.LlamaModel` (the same numerics options).
    """

    native_decode = False
    #: sliding layers read and write their group's rows through ``AttentionBatch.windows`` (the engine
    #: gives them pools of their own: kvserve.engine.kv_budget.window_groups)
    window_kv_views = True

    def __init__(self, config: GemmaConfig, weights: dict[str, Weight], dtype=torch.float32, device="cpu",
                 kernel: str = "dense", small_max_rows: int = 0, max_positions: int = 8192,
                 large_dtype=torch.float32, native_q4: bool | str = False):
        super().__init__()
        c = self.config = config
        self.device = torch.device(device)
        self.compute_dtype = torch.float32 if self.device.type == "cpu" else dtype
        emb = weights["token_embd.weight"]
        self.tok_embd = torch.from_numpy(emb.to_dense()).to(device=device, dtype=self.compute_dtype)
        self.embed_scale = torch.tensor(math.sqrt(c.n_embd), dtype=self.compute_dtype).item()
        lin = dict(dtype=dtype, device=device, kernel=kernel, small_max_rows=small_max_rows, large_dtype=large_dtype)
        self.layers = nn.ModuleList()
        for i in range(c.n_layer):
            p = f"blk.{i}."
            layer = nn.Module()
            for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
                setattr(layer, name, RMSNorm(weights[p + name + ".weight"], c.rms_eps, device))
            layer.q_norm = RMSNorm(weights[p + "attn_q_norm.weight"], c.rms_eps, device) if c.qk_norm else None
            layer.k_norm = RMSNorm(weights[p + "attn_k_norm.weight"], c.rms_eps, device) if c.qk_norm else None
            layer.wqkv = Linear([weights[p + f"attn_{x}.weight"] for x in "qkv"], None, **lin)
            layer.wo = Linear([weights[p + "attn_output.weight"]], None, **lin)
            layer.w_gate_up = Linear([weights[p + "ffn_gate.weight"], weights[p + "ffn_up.weight"]], None, **lin)
            layer.w_down = Linear([weights[p + "ffn_down.weight"]], None, **lin)
            self.layers.append(layer)
        self.output_norm = RMSNorm(weights["output_norm.weight"], c.rms_eps, device)
        head = weights.get("output.weight", emb)
        self.output = Linear([head], None, dtype=dtype, device=device, tied=head is emb,
                             kernel=auto_head_kernel() if kernel == "auto" else kernel, small_max_rows=small_max_rows)
        # YaRN's attention factor scales cos/sin (1.0 for every other RoPE)
        self.rope_cis = rope_cis(rope_inv_freq(c, weights.get("rope_freqs.weight")), max_positions, device) \
            * rope_attention_factor(c)
        local = self.rope_cis
        if c.rope_local_base is not None:
            d = c.head_dim
            inv = 1.0 / (c.rope_local_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
            local = rope_cis(inv.float(), max_positions, device)
        #: per layer, the RoPE table its keys were rotated with (ModelRunner.shift_rows reads it)
        self.layer_rope_cis = [local if w else self.rope_cis for w in c.layer_windows]
        self.q_size = c.n_head * c.head_dim
        self.kv_size = c.n_head_kv * c.head_dim

    def projections(self) -> list[Linear]:
        """Every layer's projections (qkv, output, gate|up, down), in layer order."""
        return [lin for layer in self.layers for lin in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the token embedding, unscaled: input_ids [T] long -> [T, E] in the compute dtype
        (a new tensor; the engine's model fingerprint samples them). IndexError for ids out of range."""
        return self.tok_embd.index_select(0, input_ids)

    def decode_step(self, *args, **kwargs):
        """Not written for torch.compile yet: CompiledDecode logs this and the engine stays eager."""
        raise NotImplementedError("the compiled decode step does not implement the gemma block")

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch, kv_caches, logits_indices,
                return_hidden: bool = False, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The flat batch -> float32 logits [len(logits_indices), n_vocab] (soft-capped); the same
        contract as LlamaModel.forward (no pipeline stages: ``hidden`` is refused)."""
        if hidden is not None:
            raise NotImplementedError("pipeline stages do not implement the gemma block")
        c = self.config
        T = input_ids.shape[0]
        x = self.embed(input_ids) * self.embed_scale  # [T, E]
        nq, nkv, hd = c.n_head, c.n_head_kv, c.head_dim
        qs, qks = self.q_size, self.q_size + self.kv_size
        cis_by_table = {}
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            table = self.layer_rope_cis[i]
            cis = cis_by_table.get(id(table))
            if cis is None:
                cis = cis_by_table[id(table)] = table[batch.positions].unsqueeze(1)  # [T, 1, D/2]
            qkv = layer.wqkv.forward(layer.attn_norm.forward(x))
            if layer.q_norm is not None:
                qkv[:, :qs] = layer.q_norm.forward(qkv[:, :qs].view(T, nq, hd)).view(T, qs)
                qkv[:, qs:qks] = layer.k_norm.forward(qkv[:, qs:qks].view(T, nkv, hd)).view(T, qks - qs)
            torch.view_as_complex(qkv[:, :qks].view(T, nq + nkv, hd // 2, 2)).mul_(cis)
            q, k, v = qkv[:, :qs].view(T, nq, hd), qkv[:, qs:qks].view(T, nkv, hd), qkv[:, qks:].view(T, nkv, hd)
            window = c.layer_windows[i]
            b = batch.windows.get(window, batch) if window else batch  # a sliding group's own rows
            kv_write(k_cache, b.slot_mapping, k)
            kv_write(v_cache, b.slot_mapping, v)
            o = self._attention(q, k, v, k_cache, v_cache, b, window)
            x = x + layer.post_attention_norm.forward(layer.wo.forward(o))
            gate, up = layer.w_gate_up.forward(layer.ffn_norm.forward(x)).chunk(2, dim=-1)
            x = x + layer.post_ffw_norm.forward(layer.w_down.forward(F.gelu(gate, approximate="tanh") * up))
        if logits_indices is not None:
            x = x[logits_indices]
        x = self.output_norm.forward(x)
        if return_hidden:
            return x
        logits = self.output.forward(x).float()
        if c.final_softcap:
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return logits

    def _attention(self, q, k, v, k_cache, v_cache, batch: AttentionBatch, window: int) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] (already in the cache) -> [T, H * D]
        (kvserve.models.window_attention.paged_attention with gemma's :func:`attend`)."""
        c = self.config
        return paged_attention(q, k, v, k_cache, v_cache, batch, window,
                               partial(attend, scale=c.query_scale, window=window, softcap=c.attn_softcap))
