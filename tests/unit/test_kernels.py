"""CPU kernels of Linear: the w8a8 output head and the dense copy used by large steps."""

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
