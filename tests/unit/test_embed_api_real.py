"""The embedding routes on real (tiny, random) models through the real loader: a cross-encoder
(BertForSequenceClassification written here) scored by /rerank and /v1/score equal to
transformers' logits, and a generative GGUF embedding with ``--embeddings`` (llama-server's
mode), refusing to chat."""

from __future__ import annotations

import math

import numpy as np
import pytest
from embed_conftest import write_tiny_bert
from starlette.testclient import TestClient

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency ([test] extra)")

from kvserve.app import build_app
from kvserve.serving.args import parse_args
from kvserve.serving.state import ServerState

PAIRS_QUERY = "where is the cat"
DOCS = ["the cat sat on the mat .", "rain falls in spain", "the blue sea and the green sun", "a dog", "the cat"]


def client_for(*flags: str) -> TestClient:
    return TestClient(build_app(ServerState(parse_args(["--no-preload", "--allow-model-paths", *flags]))),
                      base_url="http://127.0.0.1")  # /api answers loopback Host names only


def test_rerank_scores_equal_transformers(tmp_path):
    d = write_tiny_bert(tmp_path / "rr", classifier=True, seed=7)
    m = transformers.BertForSequenceClassification.from_pretrained(str(d)).eval()
    from tokenizers import Tokenizer as HF

    hf = HF.from_file(str(d / "tokenizer.json"))
    ref = []
    for doc in DOCS:
        enc = hf.encode(PAIRS_QUERY, doc)
        with torch.no_grad():
            ref.append(m(torch.tensor([enc.ids]), token_type_ids=torch.tensor([enc.type_ids])).logits[0, 0].item())
    with client_for("--models-dir", str(tmp_path / "models")) as client:
        r = client.post("/rerank", json={"model": str(d), "query": PAIRS_QUERY, "documents": DOCS, "top_n": 3})
        assert r.status_code == 200, r.text
        res = r.json()["results"]
        order = sorted(range(len(DOCS)), key=lambda i: -ref[i])[:3]
        assert [x["index"] for x in res] == order
        assert all(abs(x["relevance_score"] - ref[x["index"]]) < 1e-4 for x in res)
        assert r.json()["usage"]["prompt_tokens"] == sum(len(hf.encode(PAIRS_QUERY, doc).ids) for doc in DOCS)
        s = client.post("/v1/score", json={"model": str(d), "text_1": PAIRS_QUERY, "text_2": DOCS}).json()
        assert [x["score"] for x in s["data"]] == pytest.approx([1 / (1 + math.exp(-v)) for v in ref], abs=1e-4)
        r = client.post("/v1/embeddings", json={"model": str(d), "input": "the cat"})
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) > 0  # a cross-encoder still embeds


def test_a_generative_model_embeds_with_the_embeddings_flag(tiny_gguf, tmp_path):
    with client_for("--models-dir", str(tmp_path / "models")) as client:
        r = client.post("/v1/embeddings", json={"model": tiny_gguf, "input": "hi"})
        assert r.status_code == 501 and "Start it with `--embeddings`" in r.json()["error"]["message"]
    with client_for("--models-dir", str(tmp_path / "models"), "--embeddings") as client:
        r = client.post("/v1/embeddings", json={"model": tiny_gguf, "input": ["public class Main", "fn main()"]})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert len(data) == 2 and all(abs(float(np.linalg.norm(x["embedding"])) - 1) < 1e-5 for x in data)
        r = client.post("/v1/chat/completions", json={"model": tiny_gguf, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 501 and "is an embedding model" in r.json()["error"]["message"]
        r = client.post("/api/embed", json={"model": tiny_gguf, "input": "hi"})
        assert r.status_code == 200 and len(r.json()["embeddings"]) == 1
