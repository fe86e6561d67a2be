"""CPU kernels: the w8a8 output head, the dense copy used by large steps, grouped-query attention."""

import os
import shutil

import pytest
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



def _q4_weights(n, k, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (n, k)).astype(np.uint8)
    d = (rng.random((n, k // 32)) * 0.01).astype(np.float16).astype(np.float32)
    m = (-rng.random((n, k // 32)) * 0.08).astype(np.float16).astype(np.float32)
    zero = m + 8 * d  # the loader's form: w = (q - 8) * d + zero
    dense = (q.astype(np.float64) - 8) * np.repeat(d, 32, 1) + np.repeat(zero, 32, 1)
    return q, d, zero, torch.from_numpy(dense)


def test_q4_pack_layout_against_dense_weights():
    """pack + the kernel's arithmetic (reference_q4_mm, no compiler needed): a one-hot row is
    quantized exactly (127 * 1/127), so x = I gives every dense weight back; a random x
    agrees with x @ W.T within the int8-activation error."""
    from kvserve.models import q4_kernel

    q, d, zero, dense = _q4_weights(48, 128)
    wq, wd, wm = q4_kernel.pack(q, d, zero)
    assert wq.shape == (48, 64) and wd.dtype == torch.float16 and wm.shape == (48, 4)
    assert torch.equal(wd.float(), torch.from_numpy(d))  # the GGUF's float16 values, unrounded
    got = q4_kernel.reference_q4_mm(torch.eye(128), wq, wd, wm)
    assert torch.allclose(got, dense.t(), rtol=1e-6, atol=1e-7)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    ref = x.double() @ dense.t()
    err = ((q4_kernel.reference_q4_mm(x, wq, wd, wm) - ref).abs().max() / ref.abs().max()).item()
    assert 0 < err < 2e-2


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                    reason="the native q4 kernel is built with a C++ compiler")
def test_native_q4_kernel_matches_its_reference():
    """kvserve::q4_mm (AVX512-VNNI) equals its float64 reference to float32 rounding, for
    1 and 5 rows, SmolLM2's input widths, zero rows and a zero input; each row is
    bit-identical to that row computed alone."""
    from kvserve.models import q4_kernel

    if not q4_kernel.cpu_supported():
        pytest.skip("this CPU has no AVX512-VNNI")
    q4_kernel.build()
    for n, k in ((96, 576), (64, 1536)):
        q, d, zero, dense = _q4_weights(n, k, seed=k)
        w = q4_kernel.pack(q, d, zero)
        for rows in (1, 5):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            got = q4_kernel.q4_mm(x, *w)
            ref = q4_kernel.reference_q4_mm(x, *w)
            assert got.shape == (rows, n) and got.dtype == torch.float32
            assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
        assert torch.allclose(q4_kernel.q4_mm(torch.eye(k)[:7].contiguous(), *w).double(), dense.t()[:7], atol=1e-6)
    # a row's result does not depend on the other rows (groups of 4, then 3, 2, 1)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(7))
    full = q4_kernel.q4_mm(x, *w)
    for i in range(7):
        assert torch.equal(q4_kernel.q4_mm(x[i:i + 1].contiguous(), *w)[0], full[i])
    assert q4_kernel.q4_mm(torch.zeros(0, k), *w).shape == (0, n)
    assert torch.equal(q4_kernel.q4_mm(torch.zeros(2, k), *w), torch.zeros(2, n))


def test_w8a8_head_only_where_int8_gemm_is_fast(tmp_path):
    """torch's _int_mm has a fast CPU path only with VNNI/AMX: on an AVX2-only CPU one head row
    took 180 ms (decode 6 tok/s), so "auto" keeps the head float32 there."""
    from kvserve.models.llama import auto_head_kernel, int8_gemm_is_fast

    def cpuinfo(flags: str) -> str:
        p = tmp_path / f"cpuinfo-{len(flags)}"
        p.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {flags}\n\n")
        return str(p)

    assert int8_gemm_is_fast(cpuinfo("fpu sse2 avx2 fma avx512f avx512bw avx512_vnni")) is True
    assert int8_gemm_is_fast(cpuinfo("fpu sse2 avx2 fma avx_vnni")) is True
    assert int8_gemm_is_fast(cpuinfo("fpu sse2 avx2 fma amx_int8 amx_tile")) is True
    assert int8_gemm_is_fast(cpuinfo("fpu sse2 avx2 fma avx512f avx512bw")) is False
    assert int8_gemm_is_fast(str(tmp_path / "missing")) is False
    assert auto_head_kernel() == ("w8a8" if int8_gemm_is_fast() else "dense")


def test_q4_dense_copy_equals_to_dense_bit_for_bit():
    """The large-batch dense copy (_q4_dense, chunked torch ops) holds the same values as
    Weight.to_dense (numpy), in float32 and after rounding to bfloat16; odd row counts cross
    the chunk boundary."""
    import numpy as np

    from kvserve.loaders.weights import Weight
    from kvserve.models.llama import _int4_pack, _q4_dense

    rng = np.random.default_rng(7)
    for rows, cols in ((5, 64), (1000, 576), (4099, 96), (1536, 576)):
        q = rng.integers(0, 16, size=(rows, cols), dtype=np.uint8)
        d = rng.standard_normal((rows, cols // 32)).astype(np.float16).astype(np.float32) / 50
        m = rng.standard_normal((rows, cols // 32)).astype(np.float16).astype(np.float32) / 10
        w = Weight((rows, cols), q4=q, q4_scale=d, q4_zero=m + 8 * d, source_type="Q4_1")
        ref = torch.from_numpy(w.to_dense())
        got = _q4_dense(w, torch.float32)
        assert got.shape == (rows, cols) and torch.equal(got.view(torch.int32), ref.view(torch.int32))
        got16 = _q4_dense(w, torch.bfloat16)
        assert torch.equal(got16.view(torch.int16), ref.to(torch.bfloat16).view(torch.int16))
        if rows % 16 == 0:  # _int4_pack converts 256 rows at a time: the whole matrix's bytes
            whole = torch._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype("int32")), 1)
            assert torch.equal(_int4_pack(w, "cpu")[0], whole)


def test_q8_0_loader_equals_gguf_dequantize(tmp_path):
    """GGUF Q8_0 tensors load through kvserve's one-buffer routine with gguf's values bit for
    bit (the tiny model's Q8_0 file; the embedding and every projection)."""
    import gguf
    import numpy as np
    import tinymodel as tm  # tests/ is on sys.path (conftest.py)

    from kvserve.loaders.gguf import load_gguf

    p = tm.write_tiny_gguf(tmp_path / "q8.gguf", qtype="Q8_0")
    loaded = load_gguf(p)
    checked = 0
    for t in gguf.GGUFReader(p).tensors:
        if t.tensor_type.name != "Q8_0":
            continue
        ref = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
        got = loaded.weights[t.name].to_dense()  # matrices keep the file's blocks (Weight.raw): dequantized here
        assert got.dtype == np.float32 and got.shape == tuple(int(x) for x in reversed(t.shape))
        assert np.array_equal(got.reshape(-1).view(np.uint32), ref.reshape(-1).view(np.uint32)), t.name
        checked += 1
    assert checked >= 8
