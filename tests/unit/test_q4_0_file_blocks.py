"""GGUF Q4_0 rows multiplied where the file stores them (q4_core.h's q40_dot through ggml_cpu.cpp's
Matrix, the AVX512 build; the AVX2 build's per-block kernel elsewhere): the products against the
float64 reference at row lengths that end inside a 7-block window, weight-row counts that leave
1-3 rows past the 4-row groups and every activation row count's blocking; row i of an M-row
product equals the one-row product bit for bit; Q4_0 parts of a fused matrix beside other types."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.models import ggml_kernel

pytest.importorskip("gguf")
from test_ggml_kernel import random_rows, reference  # noqa: E402


@pytest.fixture(scope="module")
def mod():
    m = ggml_kernel.ensure_built()
    if m is None:
        pytest.skip("the GGUF block kernels cannot be built here")
    return m


@pytest.mark.parametrize("k", [32, 224, 256, 352, 2080])  # 1, 7, 8, 11 and 65 blocks a row
def test_q4_0_products_match_the_float64_reference(mod, k):
    rng = np.random.default_rng(k)
    for n in (1, 3, 4, 9):
        raw = random_rows("Q4_0", n, k, rng)
        mat = ggml_kernel.BlockMatrix(mod, [(raw, "Q4_0")], k)
        for m in (1, 2, 3, 5, 8):
            x = rng.standard_normal((m, k)).astype(np.float32)
            y = mat.mm(torch.from_numpy(x)).numpy()
            ref, bound = reference(x, raw, "Q4_0")
            assert y.shape == (m, n)
            err = np.abs(y - ref)
            assert (err <= 2e-6 * bound + 1e-30).all(), (k, n, m, float((err / bound).max()))


def test_q4_0_rows_do_not_depend_on_the_batch(mod):
    rng = np.random.default_rng(7)
    k = 352
    mat = ggml_kernel.BlockMatrix(mod, [(random_rows("Q4_0", 9, k, rng), "Q4_0")], k)
    for m in (2, 3, 4, 5, 6, 7, 8, 9, 70):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        y = mat.mm(x)
        for i in range(0, m, 1 if m < 10 else 23):
            assert torch.equal(y[i], mat.mm(x[i:i + 1])[0]), (m, i)


def test_q4_0_parts_beside_other_types(mod):
    """q|k|v with a Q8_0 part between two Q4_0 ones: each part's columns are its own product."""
    rng = np.random.default_rng(9)
    k = 256
    parts = [(random_rows("Q4_0", 5, k, rng), "Q4_0"), (random_rows("Q8_0", 3, k, rng), "Q8_0"),
             (random_rows("Q4_0", 6, k, rng), "Q4_0")]
    for m in (1, 6):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        y = ggml_kernel.BlockMatrix(mod, parts, k).mm(x)
        col = 0
        for raw, name in parts:
            assert torch.equal(y[:, col:col + raw.shape[0]], ggml_kernel.BlockMatrix(mod, [(raw, name)], k).mm(x))
            col += raw.shape[0]
