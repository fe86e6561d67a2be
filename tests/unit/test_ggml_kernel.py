"""The GGUF block kernels (kvserve.models.ggml_kernel, ggml_cpu.cpp) against float64 references:
weights dequantized by ``gguf.quants.dequantize``, activations quantized as llama.cpp does (q8_0 per
block of 32, q8_K per block of 256) emulated in numpy. Random blocks of every type, batch
invariance, odd row counts, K not a multiple of 256; the AVX2 build runs this file in a child. The
prefill paths (AVX512-BF16 + VNNI builds, ``gemm_min_rows``): the int8 one against the same q8 references,
the bfloat16 one against float64 references of bfloat16 operands."""

import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

from kvserve.models import ggml_kernel

gguf = pytest.importorskip("gguf")
QT = gguf.GGMLQuantizationType

#: byte offsets of each type's float16 scales inside a block (set to sane values in random blocks)
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "IQ4_NL": (0,),
              "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}
Q8_K_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}


@pytest.fixture(scope="module")
def mod():
    m = ggml_kernel.ensure_built()
    if m is None:
        pytest.skip("the GGUF block kernels cannot be built here")
    return m


def random_rows(name: str, n: int, k: int, rng) -> np.ndarray:
    """uint8 [n, row bytes]: random blocks of type ``name`` with finite, moderate scales."""
    qt = QT[name]
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    if name in ("F16", "BF16"):
        w = rng.standard_normal((n, k)).astype(np.float32)
        if name == "F16":
            return w.astype(np.float16).view(np.uint8).reshape(n, 2 * k)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n, 2 * k)
    raw = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    if name == "MXFP4":
        raw[:, :, 0] = rng.integers(118, 126, size=(n, k // block))
    for off in F16_FIELDS.get(name, ()):
        scale = (rng.random((n, k // block)) * 0.02 + 0.001).astype(np.float16)
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def q8_0_emulated(x: np.ndarray):
    """llama.cpp's q8_0 activations (its AVX route): per block of 32, d = float16(max|x| / 127),
    q = round half to even (x * (127 / max|x|)); s = float16(max|x| / 127 * sum(q)) (its q8_1's s)."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // 32, 32)
    amax = np.abs(xb).max(-1)
    with np.errstate(divide="ignore"):
        idv = np.where(amax != 0, np.float32(127.0) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * idv[..., None]).astype(np.int8)
    d = (amax / np.float32(127.0)).astype(np.float16).astype(np.float32)
    s = ((amax / np.float32(127.0)) * q.astype(np.int32).sum(-1).astype(np.float32)).astype(np.float16).astype(np.float32)
    return q.reshape(m, k), d, s


def q8_K_emulated(x: np.ndarray):
    """llama.cpp's q8_K (quantize_row_q8_K_ref): per block of 256, ``max`` the first value of largest
    magnitude, q = min(127, round half to even (-127 / max * x)), d = 1 / (-127 / max); sums of 16."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // 256, 256)
    idx = np.abs(xb).argmax(-1)
    mx = np.take_along_axis(xb, idx[..., None], -1)[..., 0]
    with np.errstate(divide="ignore"):
        iscale = np.where(mx != 0, np.float32(-127.0) / mx, np.float32(0)).astype(np.float32)
    q = np.minimum(127, np.rint(xb * iscale[..., None])).astype(np.int8)
    with np.errstate(divide="ignore"):
        d = np.where(mx != 0, np.float32(1.0) / iscale, np.float32(0)).astype(np.float32)
    bs = q.reshape(m, k // 16, 16).astype(np.int32).sum(-1).astype(np.int16)
    return q.reshape(m, k), d, bs


def reference(x: np.ndarray, raw: np.ndarray, name: str):
    """(float64 product of the quantized activations and the dequantized weights, float64 bound
    sum |x_i w_i| for the tolerance)."""
    w = np.asarray(gguf.quants.dequantize(raw, QT[name]), dtype=np.float64).reshape(raw.shape[0], -1)
    if name in ("F16", "BF16"):
        xd = x.astype(np.float64)
    elif name in Q8_K_TYPES:
        q, d, _ = q8_K_emulated(x)
        xd = (q.reshape(x.shape[0], -1, 256).astype(np.float64) * d[..., None]).reshape(x.shape)
    else:
        q, d, s = q8_0_emulated(x)
        xd = (q.reshape(x.shape[0], -1, 32).astype(np.float64) * d[..., None]).reshape(x.shape)
        if name in ("Q4_1", "Q5_1"):
            # w = d u + m: the kernels multiply each block's m by llama.cpp's q8_1 s (a float16 of the
            # unrounded scale times sum(q)), not by the sum of the rounded activations
            m = raw.reshape(raw.shape[0], -1, raw.shape[1] * 32 // x.shape[1])[:, :, 2:4].copy().view(np.float16)
            sumq = q.reshape(x.shape[0], -1, 32).astype(np.float64).sum(-1)
            corr = (s.astype(np.float64) - d.astype(np.float64) * sumq) @ m[..., 0].astype(np.float64).T
            return xd @ w.T + corr, np.abs(xd) @ np.abs(w).T
    return xd @ w.T, np.abs(xd) @ np.abs(w).T


def product(mod, parts, k, x):
    return ggml_kernel.BlockMatrix(mod, parts, k).mm(torch.from_numpy(x)).numpy()


@pytest.mark.parametrize("name", ggml_kernel.TYPES)
def test_each_type_matches_the_float64_reference(mod, name):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    k = 512 if name in Q8_K_TYPES else 352  # 11 blocks of 32: not a multiple of 256
    n, m = 37, 5  # odd rows
    raw = random_rows(name, n, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = product(mod, [(raw, name)], k, x)
    ref, bound = reference(x, raw, name)
    assert y.shape == (m, n) and y.dtype == np.float32
    err = np.abs(y - ref)
    assert (err <= 2e-6 * bound + 1e-30).all(), (name, float((err / bound).max()))
    assert np.abs(ref).max() > 0


def test_activation_quantization_matches_llama_cpp_emulation(mod):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    x[1, :256] = 0.0  # an all-zero block: d = 0, q = 0
    x[2, 7] = 40.0  # a positive extreme: q8_K maps it to -127 with a negative scale
    q, d, s = mod.quantize(torch.from_numpy(x), "q8_0")
    eq, ed, es = q8_0_emulated(x)
    assert np.array_equal(q.numpy(), eq) and np.array_equal(d.numpy(), ed) and np.array_equal(s.numpy(), es)
    q, d, bs = mod.quantize(torch.from_numpy(x), "q8_K")
    eq, ed, ebs = q8_K_emulated(x)
    assert np.array_equal(q.numpy(), eq) and np.array_equal(d.numpy(), ed) and np.array_equal(bs.numpy(), ebs)
    assert d.numpy()[1, 0] == 0.0 and d.numpy()[2, 0] < 0 and q.numpy()[2, 7] == -127


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q2_K", "F16"])
def test_rows_do_not_depend_on_the_batch(mod, name):
    """Row i of an M-row product equals the one-row product bit for bit (M = 7, and 70: past the
    64-row activation chunks)."""
    rng = np.random.default_rng(11)
    k = 512
    raw = random_rows(name, 21, k, rng)
    mat = ggml_kernel.BlockMatrix(mod, [(raw, name)], k)
    for m in (7, 70):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        y = mat.mm(x)
        for i in (0, 3, m - 1):
            assert torch.equal(y[i], mat.mm(x[i:i + 1])[0]), (name, m, i)


@pytest.mark.parametrize("names", [("Q4_K",), ("Q5_K",), ("Q6_K",), ("Q4_K", "Q6_K"), ("Q8_0",), ("Q5_0",), ("IQ4_NL",),
                                   ("MXFP4",), ("Q8_0", "Q5_0"), ("Q8_0", "Q4_K"), ("Q4_0",), ("Q4_0", "Q8_0")])
def test_small_batch_kernel_rows_equal_one_row_products(mod, names):
    """The small-batch path (the batched decode step: 6 rows and more of Q4_K / Q5_K / Q6_K, 2 and more
    of Q8_0 / Q5_0 / IQ4_NL / MXFP4, ggml_gemm8.h's panel_exact, q80_rows and panel32; Q4_0's panels from 8 rows,
    q4_core.h) gives each row the one-row kernel's bits: M rows against M one-row calls, and against
    the per-row kernels' route ("rows"), torch.equal; 45 weight rows (a partial panel of 32 and an odd
    row: half a pair), K = 768 (24 blocks of 32: three chunks of panel32's 8; Q4_0: three whole groups
    of 7 and a partial one), M past 16 (panel32's passes of 16 rows) too."""
    rng = np.random.default_rng(zlib.crc32("|".join(names).encode()))
    k = 768
    parts = [(random_rows(name, 45 if i == 0 else 19, k, rng), name) for i, name in enumerate(names)]
    mat = ggml_kernel.BlockMatrix(mod, parts, k)
    for m in (2, 3, 4, 5, 6, 8, 9, 16, 17, 70):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        y = mat.mm(x)
        one = torch.cat([mat.mm(x[i:i + 1]) for i in range(m)])
        assert torch.equal(y, one), (names, m, float((y - one).abs().max()))
        assert torch.equal(y, mat.matrix.mm(x, 0, "rows")), (names, m)
    if mod.GEMM8 and names == ("Q4_K",):  # the int8 prefill path's Q4_K sums are the same (panel_exact, kernk)
        assert torch.equal(mat.matrix.mm(x, 1, "int8"), y)
    ref, bound = reference(x.numpy(), parts[0][0], names[0])
    err = np.abs(y[:, :45].numpy() - ref)
    assert (err <= 2e-6 * bound + 1e-30).all(), float((err / bound).max())


def test_q8_0_every_row_count_has_the_one_row_bits(mod):
    """Q8_0 (AVX512-VNNI: q80_x8 for one row, q80_rows for 2+, ggml_gemm8.h; AVX2: dot32) gives row i
    of an M-row product the one-row product's bits at every M from 1 to 70 (not only multiples of 8;
    past the 64-row activation chunks), through mm_raw's small-batch route and the per-row route
    ("rows") alike: weight row counts 1, 7, 13 and 45 (groups of 8 and 16 with rows left over), K = 352
    (11 blocks: an odd count, the last block alone) and 2048; within the float64 reference's bound."""
    rng = np.random.default_rng(8080)
    for k, n in ((352, 45), (352, 7), (2048, 13), (96, 1)):
        raw = random_rows("Q8_0", n, k, rng)
        mat = ggml_kernel.BlockMatrix(mod, [(raw, "Q8_0")], k)
        x = torch.from_numpy(rng.standard_normal((70, k)).astype(np.float32))
        one = torch.cat([mat.mm(x[i:i + 1]) for i in range(70)])
        for m in range(1, 71):
            y = mat.mm(x[:m])
            assert torch.equal(y, one[:m]), (k, n, m, float((y - one[:m]).abs().max()))
            if m in (2, 9, 16, 23, 70):
                assert torch.equal(mat.matrix.mm(x[:m], 0, "rows"), one[:m]), (k, n, m)
        ref, bound = reference(x.numpy(), raw, "Q8_0")
        err = np.abs(one.numpy() - ref)
        assert (err <= 2e-6 * bound + 1e-30).all(), (k, n, float((err / bound).max()))


def test_q8_0_fused_with_q4_k_keeps_each_parts_bits(mod):
    """A fused matrix of Q8_0 and Q4_K parts (as a Q4_K_M file's q|k|v may be): every row count 1..40
    gives each row the one-row bits, and each part's columns equal that part alone (the Q8_0 part's
    bits do not depend on the route its neighbour takes)."""
    rng = np.random.default_rng(8081)
    k = 768
    parts = [(random_rows("Q8_0", 21, k, rng), "Q8_0"), (random_rows("Q4_K", 11, k, rng), "Q4_K"),
             (random_rows("Q8_0", 5, k, rng), "Q8_0")]
    mat = ggml_kernel.BlockMatrix(mod, parts, k)
    alone = [ggml_kernel.BlockMatrix(mod, [p], k) for p in parts]
    x = torch.from_numpy(rng.standard_normal((40, k)).astype(np.float32))
    one = torch.cat([mat.mm(x[i:i + 1]) for i in range(40)])
    for m in range(1, 41):
        y = mat.mm(x[:m])
        assert torch.equal(y, one[:m]), m
        col = 0
        for (raw, name), am in zip(parts, alone):
            assert torch.equal(y[:, col:col + raw.shape[0]], am.mm(x[:m])), (m, name)
            col += raw.shape[0]


def test_q8_0_prefill_and_decode_give_the_same_bits(mod):
    """In the AVX512-VNNI build Q8_0's decode kernels (q80_x8, q80_rows) and the int8 prefill path
    (kern32) form each output alike: the block's exact integer sum S, one float32 chain over the blocks
    in order, fma(float(S), d_w d_x, y) from 0. So prefill and decode agree bit for bit: a prompt's
    logits do not depend on whether its rows ran as prefill or as decode steps. K = 352 (odd block
    count, not a multiple of 64), 2048; 70 weight rows (two panels of 32 and a partial one). (The AVX2
    build has no int8 prefill path: "int8" runs the per-row kernels there, the same bits trivially.)"""
    rng = np.random.default_rng(8082)
    for k in (352, 2048):
        raw = random_rows("Q8_0", 70, k, rng)
        mat = ggml_kernel.BlockMatrix(mod, [(raw, "Q8_0")], k)
        for m in (1, 5, 16, 40):
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
            pre = mat.matrix.mm(x, 1, "int8")
            assert torch.equal(pre, mat.mm(x)), (k, m, float((pre - mat.mm(x)).abs().max()))
            assert torch.equal(pre[m - 1], mat.mm(x[m - 1:])[0]), (k, m)


@pytest.mark.parametrize("layout", [(("Q4_0", 16),), (("Q4_0", 32), ("Q4_0", 45)), (("Q4_0", 48), ("Q8_0", 19)),
                                    (("Q4_K", 17), ("Q4_0", 32), ("Q4_0", 16))])
def test_repacked_q4_0_rows_equal_one_row_products(mod, layout):
    """Repacked Q4_0 (``repack=True``, q4_repack.h: AVX512-VNNI builds; the AVX2 build keeps the file's
    layout): parts of 16k rows are repacked, others (45 rows, Q8_0, Q4_K) keep their kernels. Every row
    of an M-row product (M = 1 .. 70: the per-row and batch routes, past the 64-row chunks) equals the
    one-row product bit for bit, prefill-sized calls give the same bits (no prefill path takes a matrix
    with repacked parts), each part agrees with the float64 reference, a part left in the file's layout
    keeps today's bits, and dequantize still gives the file's values. K = 1280: 40 blocks."""
    rng = np.random.default_rng(zlib.crc32(repr(layout).encode()))
    k = 1280
    parts = [(random_rows(name, n, k, rng), name) for name, n in layout]
    mat = ggml_kernel.BlockMatrix(mod, parts, k, repack=True)
    want = [name == "Q4_0" and n % 16 == 0 and mod.ISA == "avx512" for name, n in layout]
    assert mat.repacked == want
    if any(want):
        assert not mat.has_gemm and not mat.matrix.gemm8
    x = torch.from_numpy(rng.standard_normal((70, k)).astype(np.float32))
    one = torch.cat([mat.mm(x[i:i + 1]) for i in range(70)])
    for m in (1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 33, 64, 65, 70):
        y = mat.mm(x[:m])
        assert torch.equal(y, one[:m]), (layout, m, float((y - one[:m]).abs().max()))
    assert torch.equal(mat.matrix.mm(x, 0, "rows"), one)
    if any(want):
        for path in ("auto", "int8", "bf16"):
            assert torch.equal(mat.matrix.mm(x, 1, path), one), path
    col = 0
    for (raw, name), rp in zip(parts, want):
        ref, bound = reference(x.numpy(), raw, name)
        err = np.abs(one[:, col:col + raw.shape[0]].numpy() - ref)
        assert (err <= 2e-6 * bound + 1e-30).all(), (name, float((err / bound).max()))
        if not rp:  # a part left in the file's layout: today's kernel, the same bits
            alone = ggml_kernel.BlockMatrix(mod, [(raw, name)], k)
            assert torch.equal(one[:, col:col + raw.shape[0]], torch.cat([alone.mm(x[i:i + 1]) for i in range(70)]))
        col += raw.shape[0]
    dense = mat.dequantize().numpy()
    want_dense = np.concatenate([np.asarray(gguf.quants.dequantize(r, QT[n]), np.float32).reshape(r.shape[0], k)
                                 for r, n in parts])
    assert np.array_equal(dense, want_dense)


def _resident_kib(addr: int, n: int) -> int:
    """KiB of [addr, addr + n) resident in this process (/proc/self/pagemap: the present bit per page)."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(addr // 4096 * 8)
        words = np.frombuffer(f.read(((addr + n - 1) // 4096 - addr // 4096 + 1) * 8), dtype=np.uint64)
    return int(((words >> np.uint64(63)) & np.uint64(1)).sum()) * 4


@pytest.mark.parametrize("kind", ["read", "mmap"])
def test_repacked_parts_give_their_pages_back(mod, kind, tmp_path):
    """After the repack, a Q4_0 part's whole pages in the loader's file-indexed bytes (a weight_read
    buffer: the file mapped over them; the file's mapping: MADV_DONTNEED) are no longer resident and
    still read the file's bytes; the bytes around the part (another tensor's) are untouched; an array
    no loader registered gives nothing back. The AVX2 build keeps the file's layout: nothing repacked,
    nothing given back."""
    from kvserve.loaders import weight_read

    rng = np.random.default_rng(3)
    k, n = 2048, 64
    raw = random_rows("Q4_0", n, k, rng)
    path = tmp_path / "w.bin"
    head = rng.integers(0, 256, size=12345, dtype=np.uint8)  # an odd offset: the part's edges share pages
    path.write_bytes(head.tobytes() + raw.tobytes() + head.tobytes())
    if kind == "read":
        r = weight_read.WeightRead(str(path), 0)
        r.finish(1)
        buf = np.frombuffer(r.result(), dtype=np.uint8)
    else:
        buf = np.memmap(str(path), dtype=np.uint8, mode="r")
    weight_read.register_file_view(buf, str(path), kind)
    part = buf[head.size:head.size + raw.nbytes].reshape(n, -1)
    assert np.array_equal(part, raw)  # touched: resident
    addr = part.ctypes.data
    lo, hi = (addr + 4095) // 4096 * 4096, (addr + raw.nbytes) // 4096 * 4096
    assert hi - lo >= 60 * 1024 and _resident_kib(lo, hi - lo) == (hi - lo) // 1024
    mat = ggml_kernel.BlockMatrix(mod, [(part, "Q4_0")], k, repack=True)
    if mod.ISA != "avx512":
        assert mat.repacked == [False] and mat.given_back == 0
        assert _resident_kib(lo, hi - lo) == (hi - lo) // 1024
        return
    assert mat.repacked == [True] and mat.given_back == hi - lo
    assert _resident_kib(lo, hi - lo) == 0
    assert np.array_equal(part, raw) and np.array_equal(buf[:head.size], head)
    assert np.array_equal(buf[head.size + raw.nbytes:], head)
    x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32))
    assert torch.equal(mat.mm(x), ggml_kernel.BlockMatrix(mod, [(raw, "Q4_0")], k, repack=True).mm(x))
    assert ggml_kernel.BlockMatrix(mod, [(raw.copy(), "Q4_0")], k, repack=True).given_back == 0


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K", "Q8_0"])
def test_one_row_products_at_large_k_equal_the_per_row_kernels(mod, name):
    """At Llama-3.1-8B's K (4096; 14336: its down projection) one-row products take these types 8
    weight rows at a time (dot_q4k_x8 / dot_q6k_x8 / q80_x8, with the rows ahead prefetched into L2); each
    output equals, bit for bit, the per-row kernels' (row i of a 2-row product, which runs them) and
    stays within the float64 reference's bound. 19 weight rows: two groups of 8 and 3 left over."""
    rng = np.random.default_rng(zlib.crc32(name.encode()) + 29)
    for k in (4096, 14336):
        raw = random_rows(name, 19, k, rng)
        mat = ggml_kernel.BlockMatrix(mod, [(raw, name)], k)
        x = torch.from_numpy(rng.standard_normal((2, k)).astype(np.float32))
        two = mat.mm(x)
        for i in range(2):
            one = mat.mm(x[i:i + 1])[0]
            assert torch.equal(one, two[i]), (name, k, i, float((one - two[i]).abs().max()))
        ref, bound = reference(x.numpy(), raw, name)
        err = np.abs(two.numpy() - ref)
        assert (err <= 2e-6 * bound + 1e-30).all(), (name, k, float((err / bound).max()))


def _before_a_guard_page(raw: np.ndarray, keep: list) -> np.ndarray:
    """A copy of ``raw`` whose last byte is the last one before a PROT_NONE page (a read past it
    faults), as the last tensor of a mapped file that ends at the file's end."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    total = (raw.nbytes + page - 1) // page * page + page
    m = mmap.mmap(-1, total)
    whole = np.frombuffer(m, dtype=np.uint8)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(whole.ctypes.data + total - page, page, 0) == 0, ctypes.get_errno()
    view = whole[total - page - raw.nbytes: total - page].reshape(raw.shape)
    view[...] = raw
    keep.append((m, whole))
    return view


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K", "Q8_0"])
def test_one_row_products_of_rows_ending_at_a_guard_page(mod, name):
    """The x8 kernels prefetch the rows x8_ahead bytes on (past the tensor's end for its last
    groups) and gather the 8 rows' scales (Q8_0's q80_x8 two blocks' a step, q80_rows 16 rows' two
    blocks a tile): nothing may be read past the last row. Rows ending just
    before an unreadable page, 1-17 and 25 of them (8k + 1..7 left to the per-row kernels), at K = 256
    (x8 before too), 2560 and 14592 (x8 only since every K takes it), on 1 and 3 threads: no fault,
    and each one-row output equals the 2-row product's (the per-row kernels), bit for bit."""
    rng = np.random.default_rng(zlib.crc32(name.encode()) + 31)
    keep: list = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            for k in (256, 2560, 14592):
                for n in (*range(1, 18), 25):
                    raw = _before_a_guard_page(random_rows(name, n, k, rng), keep)
                    mat = ggml_kernel.BlockMatrix(mod, [(raw, name)], k)
                    x = torch.from_numpy(rng.standard_normal((2, k)).astype(np.float32))
                    two = mat.mm(x)
                    for i in range(2):
                        assert torch.equal(mat.mm(x[i:i + 1])[0], two[i]), (name, threads, k, n, i)
    finally:
        torch.set_num_threads(before)


def test_fused_parts_of_different_types(mod):
    """q|k|v as a Q4_K_M file holds them (two Q4_K parts, a Q6_K one): the parts' products side by side."""
    rng = np.random.default_rng(3)
    k = 256
    parts = [(random_rows("Q4_K", 16, k, rng), "Q4_K"), (random_rows("Q4_K", 8, k, rng), "Q4_K"),
             (random_rows("Q6_K", 8, k, rng), "Q6_K")]
    x = rng.standard_normal((3, k)).astype(np.float32)
    y = product(mod, parts, k, x)
    assert y.shape == (3, 32)
    col = 0
    for raw, name in parts:
        assert np.array_equal(y[:, col:col + raw.shape[0]], product(mod, [(raw, name)], k, x))
        col += raw.shape[0]


def test_bad_parts_are_refused(mod):
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="no GGUF block kernel for Q4_K rows of 352"):
        ggml_kernel.BlockMatrix(mod, [(random_rows("Q8_0", 2, 352, rng), "Q4_K")], 352)
    with pytest.raises(ValueError, match=r"Q8_0 rows of 64 values take 68 bytes"):
        ggml_kernel.BlockMatrix(mod, [(np.zeros((2, 70), np.uint8), "Q8_0")], 64)
    with pytest.raises(ValueError, match="no GGUF block kernel for IQ2_XXS"):
        ggml_kernel.BlockMatrix(mod, [(np.zeros((2, 66), np.uint8), "IQ2_XXS")], 256)


def bf16(a: np.ndarray) -> np.ndarray:
    """float64 copy of ``a`` rounded to bfloat16 (round to nearest even, as vcvtne2ps2bf16)."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.bfloat16).double().numpy()


def gemm_reference(x: np.ndarray, raw: np.ndarray, name: str):
    """The prefill path's float64 reference: activations and dequantized weights (gguf's values, in
    float32) each rounded to bfloat16, multiplied in float64; and the bound sum |x_i w_i|."""
    w = bf16(np.asarray(gguf.quants.dequantize(raw, QT[name]), dtype=np.float32).reshape(raw.shape[0], -1))
    xd = bf16(x)
    return xd @ w.T, np.abs(xd) @ np.abs(w).T



@pytest.mark.parametrize("name", ggml_kernel.TYPES)
def test_prefill_path_matches_the_bfloat16_reference(mod, name):
    """Products of at least gemm_min_rows rows: with AVX512-BF16, every type but F16 on the prefill
    path (bfloat16 operands, float32 sums) within 2e-6 of sum |x w| of the float64 reference (a wrong
    block, scale or row misses by orders of magnitude more); rows past a 32-row tile and weight rows
    past a 12-row panel; row i of a 70-row product equals its one-row product. Without the path (the
    AVX2 build, or F16) the per-row kernels run, bit for bit as with gemm_min_rows 0."""
    rng = np.random.default_rng(zlib.crc32(name.encode()) + 1)
    k = 512 if name in Q8_K_TYPES else 352
    n = 29
    raw = random_rows(name, n, k, rng)
    mat = ggml_kernel.BlockMatrix(mod, [(raw, name)], k)
    mat.gemm_min_rows = 1
    mat.gemm_path = "bf16"
    assert mat.has_gemm == (mod.GEMM == "avx512bf16" and name != "F16")
    for m in (1, 33, 70):
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = mat.mm(torch.from_numpy(x)).numpy()
        assert y.shape == (m, n) and y.dtype == np.float32
        if not mat.has_gemm:
            assert np.array_equal(y, ggml_kernel.BlockMatrix(mod, [(raw, name)], k).mm(torch.from_numpy(x)).numpy())
            continue
        ref, bound = gemm_reference(x, raw, name)
        err = np.abs(y - ref)
        assert (err <= 2e-6 * bound + 1e-30).all(), (name, m, float((err / bound).max()))
        assert np.abs(ref).max() > 0
    one = mat.mm(torch.from_numpy(x[-1:])).numpy()
    assert np.array_equal(one[0], y[-1])


#: the types the int8 prefill path takes (ggml_gemm8.h)
INT8_TYPES = [t for t in ggml_kernel.TYPES if t not in ("F16", "BF16")]


@pytest.mark.parametrize("name", INT8_TYPES)
def test_int8_prefill_path_matches_the_q8_reference(mod, name):
    """The default prefill path of these types (AVX512-BF16 + VNNI builds): llama.cpp's q8 activations
    and exact integer block sums, within 2e-6 of sum |x w| of the same float64 reference as the per-row
    kernels (test_each_type_matches_the_float64_reference); 33 weight rows (a panel of 32 and one row),
    row counts past the 4-row micro-kernel's multiples; row i equals its one-row product; mostly
    not bit-equal to the per-row kernels (another float order), but within a few float32 ulps. Builds
    without the path (AVX2) run the per-row kernels, bit for bit as with gemm_min_rows 0."""
    rng = np.random.default_rng(zlib.crc32(name.encode()) + 2)
    k = 512 if name in Q8_K_TYPES else 352
    n = 33
    raw = random_rows(name, n, k, rng)
    mat = ggml_kernel.BlockMatrix(mod, [(raw, name)], k)
    mat.gemm_min_rows = 1
    assert mat.matrix.gemm8 == (getattr(mod, "GEMM8", "") == "avx512vnni")
    rows = ggml_kernel.BlockMatrix(mod, [(raw, name)], k)
    for m in (1, 6, 37):
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = mat.mm(torch.from_numpy(x)).numpy()
        if not mat.matrix.gemm8:  # no prefill paths in this build (AVX2): the per-row kernels, bit for bit
            assert np.array_equal(y, rows.mm(torch.from_numpy(x)).numpy())
            continue
        assert np.array_equal(y, mat.matrix.mm(torch.from_numpy(x), 1, "int8").numpy())
        ref, bound = reference(x, raw, name)
        err = np.abs(y - ref)
        assert (err <= 2e-6 * bound + 1e-30).all(), (name, m, float((err / bound).max()))
        assert np.abs(ref).max() > 0
        y_rows = rows.mm(torch.from_numpy(x)).numpy()
        assert (np.abs(y - y_rows) <= 1e-6 * bound + 1e-30).all()
        for i in (0, m - 1):
            assert np.array_equal(mat.mm(torch.from_numpy(x[i:i + 1])).numpy()[0], y[i])


def test_prefill_path_odd_k_and_fused_types(mod):
    """BF16 rows of 98 values (49 pairs: the activation packing's tail), and a fused Q4_K|Q4_K|Q6_K
    matrix of 32 rows (the bfloat16 path's panels of 12 cross the parts), on both prefill paths: each
    part's columns equal its own product."""
    rng = np.random.default_rng(4)
    raw = random_rows("BF16", 13, 98, rng)
    mat = ggml_kernel.BlockMatrix(mod, [(raw, "BF16")], 98)
    mat.gemm_min_rows = 17
    x = rng.standard_normal((40, 98)).astype(np.float32)
    y = mat.mm(torch.from_numpy(x)).numpy()
    if mod.GEMM:
        ref, bound = gemm_reference(x, raw, "BF16")
        assert (np.abs(y - ref) <= 2e-6 * bound).all()
        # 16 rows (below gemm_min_rows): the per-row kernels (float32 activations)
        y16 = mat.mm(torch.from_numpy(x[:16])).numpy()
        ref32 = x[:16].astype(np.float64) @ bf16(gguf.quants.dequantize(raw, QT.BF16).reshape(13, 98)).T
        assert np.abs(y16 - ref32).max() < 1e-4 and not np.array_equal(y16, y[:16])
    k = 512
    parts = [(random_rows("Q4_K", 16, k, rng), "Q4_K"), (random_rows("Q4_K", 8, k, rng), "Q4_K"),
             (random_rows("Q6_K", 8, k, rng), "Q6_K")]
    x = torch.from_numpy(rng.standard_normal((35, k)).astype(np.float32))
    for path in ("bf16", "int8"):
        fused = ggml_kernel.BlockMatrix(mod, parts, k)
        fused.gemm_min_rows, fused.gemm_path = 1, path
        y = fused.mm(x)
        col = 0
        for raw, name in parts:
            alone = ggml_kernel.BlockMatrix(mod, [(raw, name)], k)
            alone.gemm_min_rows, alone.gemm_path = 1, path
            assert torch.equal(y[:, col:col + raw.shape[0]], alone.mm(x)), path
            col += raw.shape[0]


def test_avx2_build_passes_these_tests_on_an_avx512_cpu(mod):
    """On an AVX512 CPU the AVX2 build (``KVSERVE_NATIVE_MARCH=haswell``: vpmaddubsw instead of
    vpdpbusd) is built too and this file's other tests run on it in a child process."""
    if mod.ISA != "avx512":
        pytest.skip("this CPU runs the AVX2 build itself")
    env = dict(os.environ, KVSERVE_NATIVE_MARCH="haswell")
    r = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "-x", __file__,
                        "-k", "not avx2_build"], env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " skipped" not in r.stdout, r.stdout[-2000:]
    isa = subprocess.run([sys.executable, "-c", "from kvserve.models import ggml_kernel as g; print(g.ensure_built().ISA)"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert isa.stdout.split() == ["avx2"], isa.stdout + isa.stderr
