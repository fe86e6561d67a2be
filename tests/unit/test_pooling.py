"""Pooling modes and llama-server's --embd-normalize, with numbers worked by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.engine.pooling import normalize, pool
from kvserve.errors import InvalidInputError

# two inputs, right-padded to 3 tokens, E = 2; the padding row holds junk that must not count
H = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]],
                  [[-1.0, 0.0], [7.0, 8.0], [99.0, 99.0]]])


def test_mean_cls_last_none():
    assert [v.tolist() for v in pool(H, [3, 2], "mean")] == [[3.0, 4.0], [3.0, 4.0]]
    assert [v.tolist() for v in pool(H, [3, 2], "cls")] == [[1.0, 2.0], [-1.0, 0.0]]
    assert [v.tolist() for v in pool(H, [3, 2], "last")] == [[5.0, 6.0], [7.0, 8.0]]
    none = pool(H, [3, 2], "none")
    assert [v.tolist() for v in none] == [[[1, 2], [3, 4], [5, 6]], [[-1, 0], [7, 8]]]


def test_unknown_pooling():
    with pytest.raises(InvalidInputError, match="unsupported pooling 'max'"):
        pool(H, [3, 2], "max")


def test_normalize_values():
    v = np.array([3.0, -4.0], dtype=np.float32)
    assert normalize(v, -1).tolist() == [3.0, -4.0]
    assert normalize(v, 2).tolist() == [0.6000000238418579, -0.800000011920929]  # / 5
    assert normalize(v, 1).tolist() == pytest.approx([3 / 7, -4 / 7], abs=1e-7)  # taxicab: / 7
    assert normalize(v, 0).tolist() == [24570.0, -32760.0]  # max-abs: largest magnitude 32760
    p3 = (27 + 64) ** (1 / 3)  # 4.4979...
    assert normalize(v, 3).tolist() == pytest.approx([3 / p3, -4 / p3], abs=1e-6)
    assert normalize(np.zeros(3, np.float32), 2).tolist() == [0.0, 0.0, 0.0]  # a zero vector stays zero
    rows = normalize(np.array([[3.0, 4.0], [0.0, 2.0]], np.float32), 2)  # per row
    assert rows.tolist() == [[0.6000000238418579, 0.800000011920929], [0.0, 1.0]]
    assert normalize(v, 2).dtype == np.float32


@pytest.mark.parametrize("bad", [-2, 1.5, True, "2"])
def test_normalize_refuses(bad):
    with pytest.raises(InvalidInputError, match="embd_normalize"):
        normalize(np.ones(2, np.float32), bad)
