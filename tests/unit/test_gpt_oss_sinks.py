"""gpt-oss's attention with sinks through SDPA (kvserve.models.gpt_oss.attend: the sink as one more
key of zeros whose score the additive mask carries) against two oracles: the explicit float32 softmax
it replaced (copied here as :func:`explicit_attend`) and transformers' ``GptOssAttention`` forward.
The whole-model agreement (logits, 32 greedy tokens alone, batched and with a prefix hit) is
tests/unit/test_families.py's gpt-oss case."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvserve.models import gpt_oss  # noqa: E402
from kvserve.models.gpt_oss import attend  # noqa: E402
from kvserve.models.window_attention import visible  # noqa: E402


def explicit_attend(q, k, v, q_pos, k_pos, valid, scale, window, sinks):
    """The former kvserve.models.gpt_oss.attend (scores, mask, sinks and softmax by hand in float32),
    kept as an oracle: q [B, Lq, H, D], k/v [B, Lk, Hkv, D] -> [B, Lq, H, D]."""
    B, Lq, H, D = q.shape
    g = H // k.shape[2]
    k = k.repeat_interleave(g, dim=2)
    v = v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k).mul_(scale)
    s.masked_fill_(~visible(q_pos, k_pos, window, valid)[:, None], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    if sinks is not None:
        m = torch.maximum(m, sinks.view(1, H, 1, 1))
    m = torch.nan_to_num(m, neginf=0.0)
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sinks.view(1, H, 1, 1) - m)
    p = p / denom.clamp_min(torch.finfo(p.dtype).tiny)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _inputs(B, Lq, Lk, H, Hkv, D, seed=0, n_past=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Lq, H, D, generator=g)
    k = torch.randn(B, Lk, Hkv, D, generator=g)
    v = torch.randn(B, Lk, Hkv, D, generator=g)
    sinks = 2.0 * torch.randn(H, generator=g)
    q_pos = (n_past + torch.arange(Lq)).expand(B, Lq)
    k_pos = torch.arange(Lk).expand(B, Lk)
    return q, k, v, q_pos, k_pos, sinks


@pytest.mark.parametrize("B,Lq,Lk,H,Hkv,D,window,n_past", [
    (1, 7, 7, 4, 2, 16, 4, 0),     # a prompt chunk over its own K/V, window 4, GQA 2
    (2, 33, 33, 4, 1, 8, 0, 0),    # full attention, GQA 4, two sequences
    (1, 5, 40, 8, 8, 16, 6, 35),   # a chunk over a cached prefix longer than the window
    (3, 1, 50, 4, 2, 16, 16, 49),  # decode rows
])
def test_sdpa_sinks_equal_the_explicit_softmax(B, Lq, Lk, H, Hkv, D, window, n_past):
    q, k, v, q_pos, k_pos, sinks = _inputs(B, Lq, Lk, H, Hkv, D, n_past=n_past)
    for s in (sinks, None):
        want = explicit_attend(q, k, v, q_pos, k_pos, None, 0.25, window, s)
        got = attend(q, k, v, q_pos, k_pos, None, 0.25, window, s)
        assert got.shape == (B, Lq, H, D) and got.dtype == torch.float32
        assert (got - want).abs().max().item() <= 2e-6
    # the sinks matter: without them the result is far off
    plain = attend(q, k, v, q_pos, k_pos, None, 0.25, window, None)
    assert (plain - attend(q, k, v, q_pos, k_pos, None, 0.25, window, sinks)).abs().max().item() > 1e-2


def test_a_query_that_sees_no_key_gets_zeros_and_validity_masks():
    """Padding (``valid`` False) hides keys; a decode row whose keys are all invalid, or a query whose
    window holds no valid key, attends to the sink alone: exact zeros, never NaN."""
    q, k, v, q_pos, k_pos, sinks = _inputs(2, 1, 12, 4, 2, 8, n_past=11)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[0] = False           # sequence 0: nothing visible
    valid[1, 8:] = False       # sequence 1: padding past its 8 rows
    for s in (sinks, None, torch.full((4,), float("-inf"))):
        got = attend(q, k, v, q_pos, k_pos, valid, 0.3, 0, s)
        assert torch.equal(got[0], torch.zeros_like(got[0]))
        want = explicit_attend(q, k, v, q_pos, k_pos, valid, 0.3, 0, s)
        assert not got.isnan().any() and (got - want).abs().max().item() <= 2e-6
    # the window (3 tokens at position 11: keys 9..11) holds only invalid keys in sequence 1: zeros
    got = attend(q, k, v, q_pos, k_pos, valid, 0.3, 3, sinks)
    assert torch.equal(got, torch.zeros_like(got))
    # a window of 5 reaches keys 7..11, two of them valid: the same as the explicit softmax, not zeros
    got = attend(q, k, v, q_pos, k_pos, valid, 0.3, 5, sinks)
    assert got[1].abs().max().item() > 1e-3
    assert (got - explicit_attend(q, k, v, q_pos, k_pos, valid, 0.3, 5, sinks)).abs().max().item() <= 2e-6


def test_query_chunks_give_the_same_result(monkeypatch):
    """A mask bound smaller than one call (many query chunks, down to one row each) changes nothing
    beyond float32 rounding (SDPA's kernel blocks queries by their count)."""
    q, k, v, q_pos, k_pos, sinks = _inputs(1, 37, 37, 4, 2, 8)
    whole = attend(q, k, v, q_pos, k_pos, None, 0.3, 8, sinks)
    monkeypatch.setattr(gpt_oss, "SCORE_ELEMENTS_MAX", 4 * 38 * 5)  # 5 queries per chunk
    assert (attend(q, k, v, q_pos, k_pos, None, 0.3, 8, sinks) - whole).abs().max().item() <= 1e-6
    monkeypatch.setattr(gpt_oss, "SCORE_ELEMENTS_MAX", 1)  # one query per chunk
    assert (attend(q, k, v, q_pos, k_pos, None, 0.3, 8, sinks) - whole).abs().max().item() <= 1e-6


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_equals_transformers_gpt_oss_attention(layer_type):
    """transformers' ``GptOssAttention`` forward (eager: explicit sinks) on random weights and sinks,
    a window of 5 on sliding layers, against its projections and RoPE feeding :func:`attend`."""
    pytest.importorskip("transformers")
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import (
        GptOssAttention,
        GptOssRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    cfg = GptOssConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                       num_hidden_layers=2, sliding_window=5, layer_types=[layer_type, "full_attention"],
                       attention_bias=True)
    cfg._attn_implementation = "eager"
    torch.manual_seed(3)
    att = GptOssAttention(cfg, 0).eval()
    with torch.no_grad():
        for p in att.parameters():
            p.copy_(0.3 * torch.randn(p.shape))
    L = 23
    h = torch.randn(1, L, 64)
    pos = torch.arange(L)[None]
    cos, sin = GptOssRotaryEmbedding(cfg)(h, pos)
    window = 5 if layer_type == "sliding_attention" else 0
    seen = visible(pos, pos, window, None)[:, None]  # [1, 1, L, L]
    mask = torch.zeros(seen.shape).masked_fill(~seen, float("-inf"))
    with torch.no_grad():
        want, _ = att(h, (cos, sin), mask)
        q = att.q_proj(h).view(1, L, 8, 16).transpose(1, 2)
        k = att.k_proj(h).view(1, L, 2, 16).transpose(1, 2)
        v = att.v_proj(h).view(1, L, 2, 16)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        o = attend(q.transpose(1, 2), k.transpose(1, 2), v, pos, pos, None, att.scaling, window, att.sinks.float())
        got = att.o_proj(o.reshape(1, L, -1))
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    # the window matters on the sliding layer: full attention is far off there
    if window:
        with torch.no_grad():
            full = att.o_proj(attend(q.transpose(1, 2), k.transpose(1, 2), v, pos, pos, None, att.scaling, 0,
                                     att.sinks.float()).reshape(1, L, -1))
        assert (full - want).abs().max().item() > 1e-2


def test_the_model_attends_through_sdpa(monkeypatch):
    """One SDPA call per attention call (a prompt chunk, a decode batch) with the sink column in its
    mask: the path that is 2-3x the explicit softmax on the CPU (the figures are in the commit)."""
    import torch.nn.functional as F

    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((tuple(q.shape), tuple(k.shape), tuple(attn_mask.shape), attn_mask[..., -1].unique().tolist()))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(gpt_oss.F, "scaled_dot_product_attention", spy)
    q, k, v, q_pos, k_pos, sinks = _inputs(1, 6, 6, 4, 2, 8)
    attend(q, k, v, q_pos, k_pos, None, 0.3, 3, torch.tensor([0.5, -1.0, 2.0, 0.0]))
    assert calls == [((1, 4, 6, 8), (1, 2, 7, 8), (1, 4, 6, 7), [-1.0, 0.0, 0.5, 2.0])]
