"""Attention over the paged KV cache with a sliding window: the piece gemma2/gemma3
(kvserve.models.gemma) and gpt-oss (kvserve.models.gpt_oss) share, and phi3 (kvserve.models.phi3)
where its config has a window.

:func:`paged_attention` finds, for every query of a flat batch (kvserve.models.llama.AttentionBatch),
the keys it may see: the decode rows over their cached rows, each prompt chunk over its own K/V or
over its cached prefix. On a window layer only the cache rows some query's window still reaches are
read (rows before every window are never gathered). The batch is the whole step's (row j of an
index list is position j), or a sliding group's own view (``AttentionBatch.windows``: its rows start
at ``decode_kv_start`` / ``PrefillGroup.kv_start``, the window's first block; earlier blocks are given
back to the pool). The score arithmetic is the family's: an ``attend`` callable (soft-cap, sinks, or
plain SDPA) that receives the keys' positions and builds its mask with :func:`visible`.

Positions follow transformers' ``sliding_window_overlay``: a query at position p sees a key at j
when ``p - window < j <= p`` (``window`` tokens, itself included; 0: no window).

The per-layer windows of a file (:func:`gguf_layer_windows`, :func:`hf_layer_windows`) and the KV
spec they give (:func:`layer_kv_spec`) are read here too, for every family with window layers.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kvserve.engine.kv_quant import kv_gather, kv_round
from kvserve.loaders.weights import ModelLoadError

#: ``attend(q [B, Lq, H, D], k [B, Lk, Hkv, D], v, q_pos [B, Lq] long, k_pos [B, Lk] long,
#: valid [B, Lk] bool | None) -> [B, Lq, H, D]``
Attend = Callable[..., torch.Tensor]


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, valid: torch.Tensor | None) -> torch.Tensor:
    """q_pos [B, Lq], k_pos [B, Lk] long, valid [B, Lk] bool or None -> [B, Lq, Lk] bool: key j is
    seen by query i when k_pos <= q_pos, within ``window`` tokens (q_pos - k_pos < window; 0: no
    window) and valid."""
    seen = k_pos[:, None, :] <= q_pos[:, :, None]
    if window:
        seen &= k_pos[:, None, :] > q_pos[:, :, None] - window
    if valid is not None:
        seen &= valid[:, None, :]
    return seen


def sdpa_attend(q, k, v, q_pos, k_pos, valid, scale: float, window: int) -> torch.Tensor:
    """Plain attention (:data:`Attend` with ``scale`` and ``window`` bound): q [B, Lq, H, D], k/v
    [B, Lk, Hkv, D] (H a multiple of Hkv: query head h reads KV head h // (H / Hkv)) -> [B, Lq, H, D],
    through SDPA with the :func:`visible` mask (3-10x explicit einsums on the CPU)."""
    seen = visible(q_pos, k_pos, window, valid)  # [B, Lq, Lk]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=seen[:, None], scale=scale, enable_gqa=k.shape[2] != q.shape[2])
    return o.transpose(1, 2)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache, v_cache, batch, window: int,
                    attend: Attend) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, Hkv, D] (already written to the cache) -> [T, H * D] in q's dtype.

    ``batch``: a kvserve.models.llama.AttentionBatch (the step's, or a sliding group's view, see the
    module docstring); ``window``: the layer's window in tokens (0: full attention); ``attend``: the
    family's scores and softmax (:data:`Attend`). A chunk that starts the sequence attends to its own
    K/V, rounded as the cache stores them, so a result does not depend on whether a prefix came from
    the cache or from this chunk."""
    T, H, D = q.shape
    nd = batch.n_decode
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, batch, window, attend)
    for g in batch.prefills:
        lq = g.end - g.start
        q_pos = (g.n_past + torch.arange(lq, device=q.device)).unsqueeze(0)
        if g.kv_index is None:
            kp = kv_round(k_cache, k[g.start:g.end], q.dtype)
            vp = kv_round(v_cache, v[g.start:g.end], q.dtype)
            k_pos = q_pos
        else:  # over the cached prefix: of a window layer only the rows the chunk's window reaches
            lo = max(g.kv_start, g.n_past - window + 1) if window else g.kv_start
            rows = g.kv_index[lo - g.kv_start:]
            kp = kv_gather(k_cache, rows, q.dtype)
            vp = kv_gather(v_cache, rows, q.dtype)
            k_pos = torch.arange(lo, lo + kp.shape[0], device=q.device).unsqueeze(0)
        out[g.start:g.end] = attend(q[g.start:g.end].unsqueeze(0), kp.unsqueeze(0), vp.unsqueeze(0), q_pos, k_pos,
                                    None)[0]
    return out.reshape(T, -1)


def _decode(qd: torch.Tensor, k_cache, v_cache, batch, window: int, attend: Attend) -> torch.Tensor:
    """qd: [B, H, D], the single-token queries at the front of the batch -> [B, H, D] over each
    one's cached rows (``decode_kv_index`` [B, L], padded rows masked by ``decode_mask``)."""
    nd = qd.shape[0]
    idx = batch.decode_kv_index  # [B, L]: row j of query b is its position j (+ decode_kv_start)
    valid = batch.decode_mask.view(idx.shape) if batch.decode_mask is not None else None
    lo = 0
    if window and batch.decode_kv_start is None:  # the step's rows: only the positions some window reaches
        lo = max(0, int(batch.positions[:nd].min()) - window + 1)
        idx = idx[:, lo:]
        valid = valid[:, lo:] if valid is not None else None
    B, L = idx.shape
    kd = kv_gather(k_cache, idx.reshape(-1), qd.dtype).view(B, L, *k_cache.shape[1:])
    vd = kv_gather(v_cache, idx.reshape(-1), qd.dtype).view(B, L, *v_cache.shape[1:])
    k_pos = torch.arange(lo, lo + L, device=qd.device).expand(B, L)
    if batch.decode_kv_start is not None:  # a window's view: rows start at its first block
        k_pos = k_pos + batch.decode_kv_start[:, None]
    return attend(qd.unsqueeze(1), kd, vd, batch.positions[:nd].unsqueeze(1), k_pos, valid).squeeze(1)


def rope_cis(inv: torch.Tensor, max_positions: int, device, scale: float = 1.0) -> torch.Tensor:
    """[P, D/2] complex64 rotations ``scale * e^(i p inv)`` for positions 0..P-1 (computed in
    float64); ``inv`` [D/2] the inverse frequencies."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv.double())
    return torch.polar(torch.full_like(freqs, scale), freqs).to(torch.complex64).to(device)


# -- per-layer windows from the files --------------------------------------------------------------

def gguf_layer_windows(md: dict, arch: str, n_layer: int, path: str, pattern_default: int) -> tuple[int, ...]:
    """Per-layer windows (tokens; 0: full attention) from ``{arch}.attention.sliding_window`` and
    ``{arch}.attention.sliding_window_pattern``: an int n (llama.cpp's ``set_swa_pattern(n)``: layer
    il slides when il % n < n - 1; ``pattern_default`` when absent) or one bool per layer (Ollama's
    converter: True slides).

    Raises ModelLoadError: no window key, a list of the wrong length (the key is named)."""
    window = int(md.get(f"{arch}.attention.sliding_window") or 0)
    if not window:
        raise ModelLoadError(f"{path}: missing GGUF key '{arch}.attention.sliding_window'")
    pattern = md.get(f"{arch}.attention.sliding_window_pattern") or pattern_default
    if isinstance(pattern, list):
        if len(pattern) != n_layer:
            raise ModelLoadError(f"{path}: GGUF key '{arch}.attention.sliding_window_pattern' has {len(pattern)} "
                                 f"values for {n_layer} layers")
        return tuple(window if bool(x) else 0 for x in pattern)
    pattern = int(pattern)
    return tuple(window if il % pattern < pattern - 1 else 0 for il in range(n_layer))


def hf_layer_windows(cfg: dict, n_layer: int, path: str) -> tuple[int, ...]:
    """Per-layer windows (tokens; 0: full attention) from config.json's ``layer_types`` and
    ``sliding_window`` (transformers 4 without ``layer_types``: every ``sliding_window_pattern``-th
    layer full, default 6 for gemma3_text, else 2).

    Raises ModelLoadError: layer types other than sliding and full attention, or sliding layers
    without ``sliding_window``."""
    window = int(cfg.get("sliding_window") or 0)
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern") or (6 if cfg.get("model_type") == "gemma3_text" else 2))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layer)]
    if len(types) != n_layer or set(types) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"{path}: config.json layer_types {types!r}: kvserve runs sliding_attention and "
                             f"full_attention layers, one per layer")
    if "sliding_attention" in types and not window:
        raise ModelLoadError(f"{path}: config.json lacks 'sliding_window'")
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def layer_kv_spec(config):
    """Per layer of ``config.layer_windows``: a sliding window of the layer's tokens, or full
    attention (kvserve.models.family.KVSpec)."""
    from kvserve.models.family import FULL, KVSpec

    return tuple(KVSpec("sliding", w) if w else FULL for w in config.layer_windows)
