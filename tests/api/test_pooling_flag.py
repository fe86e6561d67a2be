"""``--pooling`` (llama-server's flag) on a real embedding model (all-MiniLM-L6-v2, whose own
pooling is mean): ``none`` gives a vector per token, ``cls`` / ``last`` / ``mean`` the first token's,
the last token's or the mean of them (normalized as llama-server's ``embd_normalize`` 2)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.api.test_embeddings import minilm_dir  # noqa: F401  (the fixture)

TEXT = "kvserve pools hidden states"


def _embedding(srv) -> np.ndarray:
    r = httpx.post(srv.url("/embedding"), json={"content": TEXT}, timeout=60)
    assert r.status_code == 200, r.text
    return np.array(r.json()[0]["embedding"], dtype=np.float64)


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


@pytest.mark.slow
def test_pooling_flag_modes(start_server, minilm_dir):  # noqa: F811
    none = start_server("--pooling", "none", model=minilm_dir)
    rows = _embedding(none)
    r = httpx.post(none.url("/v1/embeddings"), json={"input": TEXT}, timeout=60)
    assert r.status_code == 400
    assert "Pooling type 'none' is not OAI compatible" in r.text
    none.stop()
    assert rows.ndim == 2 and rows.shape[1] == 384
    for mode, want in (("cls", rows[0]), ("last", rows[-1]), ("mean", rows.mean(axis=0))):
        srv = start_server("--pooling", mode, model=minilm_dir)
        got = _embedding(srv)
        srv.stop()
        assert got.shape == (1, 384)  # llama-server's /embedding: one row for a pooled input
        np.testing.assert_allclose(got[0], _unit(want), atol=2e-5, err_msg=mode)
