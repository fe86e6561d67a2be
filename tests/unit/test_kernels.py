"""CPU kernels: the w8a8 output head, the dense copy used by large steps, grouped-query attention."""

import torch

from kvserve.models.llama import _int8_rows, _w8a8_mm


def test_w8a8_matches_float_reference_of_its_int8_weights():
    """Two int8 limbs per activation row: the result equals x @ dequant(W).T to ~1e-4
    relative (1e-3 bound), where a bfloat16 output (the weight-only int8 kernel) is off by ~1e-2."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 576, generator=g)
    q8, scale = _int8_rows(w)
    ref_w = q8.float() * scale.float()[:, None]
    for m in (1, 3, 16):
        x = torch.randn(m, 576, generator=g) * 3
        x[:, 7] = 40.0  # an outlier dimension, as in real hidden states
        ref = x.double() @ ref_w.double().t()
        got = _w8a8_mm(x, q8.t(), scale.float())
        assert got.dtype == torch.float32 and got.shape == (m, 4096)
        rel = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-3, rel
        bf = torch._weight_int8pack_mm(x.to(torch.bfloat16), q8, scale).double()
        assert ((bf - ref).abs().max() / ref.abs().max()).item() > 10 * rel


def test_w8a8_zero_rows_and_zero_input():
    q8, scale = _int8_rows(torch.randn(64, 32))
    assert _w8a8_mm(torch.zeros(0, 32), q8.t(), scale.float()).shape == (0, 64)
    assert torch.equal(_w8a8_mm(torch.zeros(2, 32), q8.t(), scale.float()), torch.zeros(2, 64))


def test_grouped_attention_equals_gqa_sdpa():
    """LlamaModel._grouped_attention (query heads of a KV head as rows of one query) gives
    SDPA's enable_gqa result for a few causal queries over cached rows."""
    import math
    import types

    import torch.nn.functional as F

    from kvserve.models.llama import LlamaModel, PrefillGroup

    torch.manual_seed(0)
    h, hkv, d, n_past = 9, 3, 64, 37
    for r in (1, 3, 16):
        lk = n_past + r
        q = torch.randn(r, h, d)
        kp, vp = torch.randn(1, hkv, lk, d), torch.randn(1, hkv, lk, d)
        group = PrefillGroup(0, r, n_past, torch.arange(lk))
        mask = group.mask()
        host = types.SimpleNamespace(scale=1 / math.sqrt(d))
        got = LlamaModel._grouped_attention(host, q, kp, vp, group.grouped_mask(h // hkv, q.dtype))
        ref = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kp, vp, attn_mask=mask,
                                             scale=host.scale, enable_gqa=True).squeeze(0).transpose(0, 1)
        assert got.shape == (r, h, d)
        assert torch.allclose(got, ref, atol=1e-5)
        # the last query sees every row, the first only the prefix and itself
        assert mask[0].sum().item() == n_past + 1 and mask[-1].all()
