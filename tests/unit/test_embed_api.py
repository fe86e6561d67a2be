"""The embedding, rerank and score APIs (kvserve.faces.embeddings, the /api/embed handlers) and
EmbeddingRunner, on a fake encoder: no model, milliseconds per request.

A store in a temp directory holds ``enc`` (an embedding model), ``rr`` (a cross-encoder) and
``gen`` (a tiny generative GGUF); the model manager's loader builds an EmbeddingRunner around
:class:`FakeEncoder` for the first two. Requests go through the real app (routing, the model
manager, error envelopes) with Starlette's TestClient.
"""

from __future__ import annotations

import base64
import json
import math
import zlib

import numpy as np
import pytest
from starlette.testclient import TestClient

from kvserve.app import build_app
from kvserve.errors import InvalidInputError
from kvserve.serving.args import parse_args
from kvserve.serving.embed_runner import (
    EmbeddingRunner,
    InputTooLongError,
    cut_dimensions,
    model_task,
)
from kvserve.serving.manager import ModelManager
from kvserve.serving.state import ServerState

DIM = 8
N_CTX = 16
CLS, SEP = 1, 2


class FakeTokenizer:
    """Whitespace words -> ids 3..999 (crc32), ``[CLS] ... [SEP]`` with add_special."""

    n_vocab = 1000
    bos_token, eos_token = "[CLS]", "[SEP]"
    bos_token_id, eos_token_id = CLS, SEP
    eog_token_ids = frozenset({SEP})

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        ids = [3 + zlib.crc32(w.encode()) % 997 for w in text.split()]
        return [CLS, *ids, SEP] if add_special else ids

    def encode_batch(self, texts, add_special: bool = False, parse_special: bool = True):
        self.batches = getattr(self, "batches", 0) + 1
        return [self.encode(t, add_special) for t in texts]

    def decode(self, ids, skip_special: bool = False) -> str:
        return " ".join(f"w{i}" for i in ids)

    def check_fits(self, prompt, n_ctx: int) -> None:
        pass


def token_vector(t: int) -> np.ndarray:
    return np.random.default_rng(t).standard_normal(DIM).astype(np.float32)


def fake_vector(ids: list[int]) -> np.ndarray:
    """The fake's pooled vector: mean of per-token random vectors, L2-normalized."""
    v = np.mean([token_vector(t) for t in ids], axis=0)
    return (v / np.linalg.norm(v)).astype(np.float32)


class FakeEncoder:
    """The EmbeddingEngine interface (kvserve.engine.embedder) without a model."""

    def __init__(self, task: str = "embed", pooling: str = "mean"):
        from kvserve.loaders.weights import ModelInfo

        self.tokenizer = FakeTokenizer()
        self.model_info = ModelInfo(path="", name="fake", format="safetensors", arch="bert", ftype="F32",
                                    n_params=1234, size=4936, n_vocab=1000, n_ctx_train=N_CTX, n_embd=DIM)
        self.task, self.n_ctx, self.dim, self.pooling, self.normalize = task, N_CTX, DIM, pooling, 2
        self.error = None
        self.calls: list = []

    async def embed(self, inputs, *, pooling=None, normalize=None):
        self.calls.append(("embed", inputs, pooling, normalize))
        for ids in inputs:
            if not ids:
                raise InvalidInputError("Input content cannot be empty")
            assert len(ids) <= self.n_ctx
        if (pooling or self.pooling) == "none":
            return [np.stack([token_vector(t) for t in ids]) for ids in inputs]
        out = []
        for ids in inputs:
            v = fake_vector(ids)
            out.append(v * 3.0 if normalize == -1 else v)
        return out

    async def score(self, pairs):
        self.calls.append(("score", pairs))
        return [float(np.dot(fake_vector([CLS, *q]), fake_vector([CLS, *d]))) * 4.0 for q, d in pairs]

    def shutdown(self) -> None:
        self.error = None


def _config(arch: str) -> bytes:
    return json.dumps({"architectures": [arch], "model_type": "bert", "hidden_size": DIM,
                       "num_attention_heads": 2, "max_position_embeddings": N_CTX}).encode()


@pytest.fixture
def env(tmp_path, tiny_gguf):
    """(TestClient, state, store): ``enc`` and ``rr`` fake encoders, ``gen`` a generative GGUF."""
    from kvserve.store import open_store
    from kvserve.store.hf_dir import HF_FILE_MEDIA_TYPE
    from kvserve.store.manifest import Layer, media_type

    store = open_store(tmp_path / "models")
    for name, arch in (("enc", "BertModel"), ("rr", "BertForSequenceClassification")):
        w = store.write_blob_bytes(_config(arch))
        store.create(name, [Layer(HF_FILE_MEDIA_TYPE, w.digest, w.size, name="config.json")],
                     {"model_format": "safetensors", "model_family": "bert"})
    g = store.import_file(tiny_gguf)
    store.create("gen", [Layer(media_type("model"), g.digest, g.size)])
    args = parse_args(["--models-dir", str(store.root), "--no-preload", "--metrics", "--slots"])
    loaded = []

    def loader(spec):
        loaded.append(spec.name)
        task = "score" if spec.name.startswith("rr") else "embed"
        return EmbeddingRunner(args, spec, FakeEncoder(task), "b0")

    state = ServerState(args, manager=ModelManager(loader))
    state.loaded_names = loaded
    with TestClient(build_app(state), base_url="http://127.0.0.1") as client:  # /api answers loopback hosts
        yield client, state, store


def post(client, path, body):
    return client.post(path, json=body)


# -- /v1/embeddings ---------------------------------------------------------------------------

def test_v1_embeddings_input_forms(env):
    client, *_ = env
    r = post(client, "/v1/embeddings", {"model": "enc", "input": "hello world"})
    assert r.status_code == 200, r.text
    d = r.json()
    assert list(d) == ["model", "object", "usage", "data"]
    assert d["model"] == "enc" and d["object"] == "list" and d["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    assert list(d["data"][0]) == ["embedding", "index", "object"] and d["data"][0]["object"] == "embedding"
    want = fake_vector(FakeTokenizer().encode("hello world", True))
    assert np.allclose(d["data"][0]["embedding"], want, atol=1e-6)
    ids = FakeTokenizer().encode("a b c", True)
    for inp, n in ((["x", "y z"], 2), (ids, 1), ([ids, ids[:3]], 2), (["x", ids], 2), ("", 1), ([""], 1)):
        r = post(client, "/v1/embeddings", {"model": "enc", "input": inp})
        assert r.status_code == 200, (inp, r.text)
        assert [e["index"] for e in r.json()["data"]] == list(range(n))
    r = post(client, "/v1/embeddings", {"model": "enc", "input": ids})
    assert np.allclose(r.json()["data"][0]["embedding"], fake_vector(ids), atol=1e-6)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)  # token ids are taken as they are
    r = post(client, "/v1/embeddings", {"model": "enc", "input": ""})  # [CLS] [SEP]
    assert r.json()["usage"]["prompt_tokens"] == 2


def test_v1_embeddings_refusals(env):
    client, *_ = env
    cases = [
        ({"model": "enc", "input": []}, 400, "Field 'input': must not be an empty array"),
        ({"model": "enc"}, 400, '"input" must be provided'),
        ({"model": "enc", "input": [[]]}, 400, "input 0 is empty"),
        ({"model": "enc", "input": [1.5]}, 400, "Field 'input[0]'"),
        ({"model": "enc", "input": {"a": 1}}, 400, "Field 'input': type must be string or array"),
        ({"model": "enc", "input": "x", "encoding_format": "hex"}, 400, "Can be either float or base64"),
        ({"model": "enc", "input": [5000]}, 400, "token id 5000 is out of range"),
        ({"model": "enc", "input": "x", "dimensions": 4}, 400, "does not support matryoshka"),
        ({"model": "enc", "input": "x", "dimensions": 99}, 400, "larger than the model's embedding size"),
        ({"model": "enc", "input": "x", "truncate_prompt_tokens": 99}, 400, "is greater than the model's maximum"),
        ({"model": "nope", "input": "x"}, 404, "model 'nope' not found"),
    ]
    for body, status, text in cases:
        r = post(client, "/v1/embeddings", body)
        assert r.status_code == status and text in r.json()["error"]["message"], (body, r.text)
    assert post(client, "/v1/embeddings", {"model": "enc", "input": "x", "dimensions": DIM}).status_code == 200


def test_over_long_input_is_400_naming_the_limit_unless_truncated(env):
    client, *_ = env
    long = " ".join(f"w{i}" for i in range(30))  # 32 tokens with [CLS] [SEP], the model takes 16
    r = post(client, "/v1/embeddings", {"model": "enc", "input": ["ok", long]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "exceed_context_size_error"
    assert (err["n_prompt_tokens"], err["n_ctx"]) == (32, N_CTX) and "16 tokens" in err["message"]
    assert "input 1" in err["message"]
    for trunc, n in ((-1, N_CTX), (5, 5)):
        r = post(client, "/v1/embeddings", {"model": "enc", "input": long, "truncate_prompt_tokens": trunc})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == n
        ids = FakeTokenizer().encode(long, True)
        kept = ids[:n - 1] + [SEP]  # the special tokens at both ends are kept
        assert np.allclose(r.json()["data"][0]["embedding"], fake_vector(kept), atol=1e-6)


def test_base64_is_little_endian_float32(env):
    client, *_ = env
    f = post(client, "/v1/embeddings", {"model": "enc", "input": ["p q", "r"]}).json()
    b = post(client, "/v1/embeddings", {"model": "enc", "input": ["p q", "r"], "encoding_format": "base64"}).json()
    for ef, eb in zip(f["data"], b["data"]):
        assert eb["encoding_format"] == "base64"
        v = np.frombuffer(base64.b64decode(eb["embedding"]), dtype="<f4")
        assert np.array_equal(v, np.asarray(ef["embedding"], dtype=np.float32))


def test_texts_of_a_request_are_tokenized_in_one_batch_call(env):
    client, state, _ = env
    post(client, "/v1/embeddings", {"model": "enc", "input": ["a"]})
    runner = state.manager.get("enc:latest").runner
    before = runner.tokenizer.batches
    post(client, "/v1/embeddings", {"model": "enc", "input": [f"t{i}" for i in range(40)]})
    assert runner.tokenizer.batches == before + 1
    assert len(runner.embedder.calls[-1][1]) == 40  # and handed to the engine as one call


# -- llama-server's native routes -------------------------------------------------------------

def test_native_embedding_shape(env):
    client, *_ = env
    for path in ("/embedding", "/embeddings"):
        r = post(client, path, {"model": "enc", "content": ["a b", "c"]})
        assert r.status_code == 200, r.text
        d = r.json()
        assert [list(x) for x in d] == [["index", "embedding"]] * 2
        assert len(d[0]["embedding"]) == 1 and len(d[0]["embedding"][0]) == DIM
    r = post(client, "/v1/embeddings", {"model": "enc", "content": "a"})  # content: the native shape
    assert isinstance(r.json(), list)
    r = post(client, "/embedding", {"model": "enc", "input": "a b", "embd_normalize": -1})
    assert math.isclose(float(np.linalg.norm(r.json()[0]["embedding"][0])), 3.0, rel_tol=1e-5)
    assert post(client, "/embedding", {"model": "enc"}).json()["error"]["message"] == \
        '"input" or "content" must be provided'


def test_pooling_none_gives_one_vector_per_token(env):
    client, state, _ = env
    post(client, "/embedding", {"model": "enc", "content": "a"})
    runner = state.manager.get("enc:latest").runner
    runner.embedder.pooling = "none"
    r = post(client, "/embedding", {"model": "enc", "content": "a b c"})
    assert len(r.json()[0]["embedding"]) == 5  # [CLS] a b c [SEP]
    r = post(client, "/v1/embeddings", {"model": "enc", "input": "a"})
    assert r.status_code == 400 and "Pooling type 'none' is not OAI compatible" in r.json()["error"]["message"]


# -- generative models ------------------------------------------------------------------------

def test_a_generative_model_is_refused_before_it_loads(env):
    client, state, _ = env
    for path in ("/v1/embeddings", "/embedding", "/embeddings", "/v1/score"):
        r = post(client, path, {"model": "gen", "input": "x", "content": "x", "text_1": "a", "text_2": "b"})
        assert r.status_code == 501 and r.json() == {"error": {
            "code": 501, "message": "This server does not support embeddings. Start it with `--embeddings`",
            "type": "not_supported_error"}}, (path, r.text)
    r = post(client, "/rerank", {"model": "gen", "query": "q", "documents": ["d"]})
    assert r.status_code == 501 and "Start it with `--reranking`" in r.json()["error"]["message"]
    for path in ("/api/embed", "/api/embeddings"):
        r = post(client, path, {"model": "gen", "input": "x", "prompt": "x"})
        assert (r.status_code, r.json()) == (400, {"error": "this model does not support embeddings"})
    assert state.loaded_names == []


def test_an_embedding_model_refuses_generation(env):
    """(Chat is checked with the real model: rendering needs a real tokenizer.)"""
    client, *_ = env
    r = post(client, "/v1/completions", {"model": "enc", "prompt": "hi"})
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    assert r.json()["error"]["message"] == ("model 'enc:latest' is an embedding model: it does not generate "
                                            "text (use /v1/embeddings)")
    r = post(client, "/completion", {"model": "enc", "prompt": "hi"})
    assert r.status_code == 501, r.text
    r = post(client, "/v1/completions", {"model": "enc", "prompt": "hi", "response_format": {"type": "json_object"}})
    assert r.status_code == 501, r.text
    r = post(client, "/api/generate", {"model": "rr", "prompt": "hi", "raw": True, "stream": False})
    assert (r.status_code, r.json()) == (400, {"error": '"rr" does not support generate'})  # Ollama's check
    r = post(client, "/tokenize", {"model": "enc", "content": "a b"})
    assert r.status_code == 200 and len(r.json()["tokens"]) == 2


def test_models_props_ps_and_metrics_see_an_encoder(env):
    client, *_ = env
    post(client, "/v1/embeddings", {"model": "enc", "input": "a b"})
    m = client.get("/v1/models/enc").json()
    assert m["status"] == {"value": "loaded"} and m["meta"]["n_embd"] == DIM and m["max_model_len"] == N_CTX
    p = client.get("/props", params={"model": "enc"}).json()
    assert p["model_alias"] == "enc:latest" and p["total_slots"] == 1
    ps = client.get("/api/ps").json()["models"]
    assert [x["name"] for x in ps] == ["enc:latest"] and ps[0]["context_length"] == N_CTX
    text = client.get("/metrics", params={"model": "enc"}).text
    assert "llamacpp:prompt_tokens_total 4" in text
    assert client.get("/slots", params={"model": "enc"}).status_code == 200


# -- rerank and score -------------------------------------------------------------------------

def test_rerank_sorts_and_cuts(env):
    client, *_ = env
    docs = ["a b", "c", "a b c", "z"]
    r = post(client, "/rerank", {"model": "rr", "query": "a b", "documents": docs, "top_n": 3})
    assert r.status_code == 200, r.text
    d = r.json()
    assert list(d) == ["model", "object", "usage", "results"] and d["model"] == "rr"
    tok = FakeTokenizer()
    raw = [float(np.dot(fake_vector([CLS, *tok.encode("a b")]), fake_vector([CLS, *tok.encode(x)]))) * 4.0
           for x in docs]
    order = sorted(range(4), key=lambda i: -raw[i])[:3]
    assert [x["index"] for x in d["results"]] == order
    assert np.allclose([x["relevance_score"] for x in d["results"]], [raw[i] for i in order], atol=1e-5)
    assert d["usage"]["prompt_tokens"] == sum(2 + 3 + len(tok.encode(x)) for x in docs)  # [CLS] q [SEP] d [SEP]
    for path in ("/reranking", "/v1/rerank", "/v1/reranking"):
        assert post(client, path, {"model": "rr", "query": "q", "documents": ["x"]}).status_code == 200
    tei = post(client, "/rerank", {"model": "rr", "query": "a b", "texts": docs, "return_text": True}).json()
    assert isinstance(tei, list) and list(tei[0]) == ["index", "score", "text"] and len(tei) == 4
    assert tei[0]["text"] == docs[order[0]]


def test_rerank_refusals(env):
    client, *_ = env
    for body, text in (({"documents": ["x"]}, '"query" must be provided'),
                       ({"query": 1, "documents": ["x"]}, '"query" must be a string'),
                       ({"query": "q", "documents": []}, '"documents" must be a non-empty string array'),
                       ({"query": "q", "documents": [1]}, '"documents" must be a non-empty string array')):
        r = post(client, "/rerank", {"model": "rr", **body})
        assert r.status_code == 400 and r.json()["error"]["message"] == text


def test_an_embedding_model_ranks_by_cosine(env):
    client, *_ = env
    r = post(client, "/rerank", {"model": "enc", "query": "a b", "documents": ["a b", "z y x"]}).json()
    assert r["results"][0] == {"index": 0, "relevance_score": pytest.approx(1.0, abs=1e-5)}


def test_v1_score_pairs(env):
    client, *_ = env
    tok = FakeTokenizer()

    def cos(a, b):
        return float(np.dot(fake_vector(tok.encode(a, True)), fake_vector(tok.encode(b, True))))

    r = post(client, "/v1/score", {"model": "enc", "text_1": "a", "text_2": ["a", "b c"]})
    d = r.json()
    assert r.status_code == 200 and d["object"] == "list" and d["id"].startswith("score-")
    assert [x["object"] for x in d["data"]] == ["score", "score"]
    assert [x["score"] for x in d["data"]] == pytest.approx([cos("a", "a"), cos("a", "b c")], abs=1e-5)
    assert d["usage"] == {"prompt_tokens": 3 + 3 + 3 + 4, "total_tokens": 13, "completion_tokens": 0,
                          "prompt_tokens_details": None}
    r = post(client, "/score", {"model": "enc", "text_1": ["a", "b"], "text_2": ["a", "c"]}).json()
    assert [x["score"] for x in r["data"]] == pytest.approx([cos("a", "a"), cos("b", "c")], abs=1e-5)
    r = post(client, "/v1/score", {"model": "rr", "queries": "a b", "documents": "c"}).json()
    raw = float(np.dot(fake_vector([CLS, *tok.encode("a b")]), fake_vector([CLS, *tok.encode("c")]))) * 4.0
    assert r["data"][0]["score"] == pytest.approx(1 / (1 + math.exp(-raw)), abs=1e-6)  # vLLM: sigmoid
    for body in ({"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, {"text_1": "a"}, {"text_1": [], "text_2": "b"}):
        assert post(client, "/v1/score", {"model": "enc", **body}).status_code == 400


# -- Ollama -----------------------------------------------------------------------------------

def test_api_embed(env):
    client, *_ = env
    r = post(client, "/api/embed", {"model": "enc", "input": ["a b", "c"]})
    d = r.json()
    assert r.status_code == 200 and list(d) == ["model", "embeddings", "total_duration", "load_duration",
                                                "prompt_eval_count"]
    assert d["model"] == "enc" and d["prompt_eval_count"] == 7 and d["total_duration"] >= d["load_duration"] > 0
    assert np.allclose(d["embeddings"][0], fake_vector(FakeTokenizer().encode("a b", True)), atol=1e-6)
    for empty in ("", [], None):
        assert post(client, "/api/embed", {"model": "enc", "input": empty}).json() == {"model": "enc",
                                                                                      "embeddings": []}
    r = post(client, "/api/embed", {"model": "enc", "input": "a", "dimensions": 3}).json()
    assert len(r["embeddings"][0]) == 3 and math.isclose(float(np.linalg.norm(r["embeddings"][0])), 1, rel_tol=1e-5)
    long = " ".join(f"w{i}" for i in range(30))
    assert post(client, "/api/embed", {"model": "enc", "input": long}).json()["prompt_eval_count"] == N_CTX
    r = post(client, "/api/embed", {"model": "enc", "input": long, "options": {"num_ctx": 8}})
    assert r.json()["prompt_eval_count"] == 8
    r = post(client, "/api/embed", {"model": "enc", "input": long, "truncate": False})
    assert (r.status_code, r.json()) == (400, {"error": "the input length exceeds the context length"})
    assert post(client, "/api/embed", {"model": "enc", "input": [1]}).json() == {"error": "invalid input type"}
    assert post(client, "/api/embed", {"input": "x"}).json() == {"error": "model is required"}
    assert post(client, "/api/embed", {"model": "nope", "input": "x"}).status_code == 404


def test_api_embeddings(env):
    client, state, _ = env
    r = post(client, "/api/embeddings", {"model": "enc", "prompt": "a b"})
    assert r.status_code == 200 and list(r.json()) == ["embedding"]
    assert np.allclose(r.json()["embedding"], fake_vector(FakeTokenizer().encode("a b", True)), atol=1e-6)
    assert post(client, "/api/embeddings", {"model": "enc", "prompt": ""}).json() == {"embedding": []}
    r = post(client, "/api/embeddings", {"model": "enc", "prompt": "x " * 40})
    assert (r.status_code, r.json()) == (400, {"error": "the input length exceeds the context length"})
    post(client, "/api/embed", {"model": "enc", "input": "a", "keep_alive": 0})
    assert state.manager.get("enc:latest") is None  # keep_alive 0 unloads it after the request


# -- the runner -------------------------------------------------------------------------------

def test_cut_dimensions_renormalizes():
    v = np.array([3.0, 4.0, 12.0], dtype=np.float32)
    (w,) = cut_dimensions([v], 2)
    assert np.allclose(w, [0.6, 0.8])
    assert cut_dimensions([v], None)[0] is v


def test_model_task_from_headers(tmp_path, tiny_gguf):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_bytes(_config("BertForSequenceClassification"))
    assert model_task(str(d)) == "score"
    (d / "config.json").write_bytes(_config("BertModel"))
    assert model_task(str(d)) == "embed"
    assert model_task(tiny_gguf) == "generate"
    assert model_task("") == "generate"


def test_runner_truncation_rules():
    from kvserve.serving.manager import ModelSpec

    args = parse_args([])
    r = EmbeddingRunner(args, ModelSpec("m"), FakeEncoder(), "b0")
    ids = r.tokenize(["a b c d e f g h i j k l m n o p q r"], truncate=4)[0]
    assert ids[0] == CLS and ids[-1] == SEP and len(ids) == 4
    assert r.tokenize([list(range(3, 30))], truncate=4)[0] == [3, 4, 5, 6]  # ids: cut at the end only
    with pytest.raises(InputTooLongError):
        r.tokenize([list(range(3, 30))])
    for bad in (0, -2, N_CTX + 1):
        with pytest.raises(InvalidInputError):
            r.tokenize(["a"], truncate=bad)
    r.close()
    assert r.engine is None and r.embedder is None


def test_api_show_of_an_hf_directory_model(env):
    client, *_ = env
    r = client.post("/api/show", json={"model": "enc"})
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["capabilities"] == ["embedding"] and d["details"]["format"] == "safetensors"
    assert d["model_info"]["general.architecture"] == "bert" and d["model_info"]["bert.embedding_length"] == DIM
    assert client.post("/api/show", json={"model": "gen"}).json()["capabilities"] == ["completion"]


def test_v1_models_lists_an_unloaded_encoder_as_embedding(env):
    """Before any request loads them, /v1/models' Ollama-style list marks the store's encoders
    ``embedding`` (from their config.json) and the GGUF ``completion``: the web page's picker
    leaves encoders out (it offered all-minilm, and every question then failed)."""
    client, state, _ = env
    assert state.loaded_names == []
    caps = {m["name"]: m["capabilities"] for m in client.get("/v1/models").json()["models"]}
    assert caps == {"enc:latest": ["embedding"], "gen:latest": ["completion"], "rr:latest": ["embedding"]}
    assert state.loaded_names == []  # listing read headers, loaded nothing


# -- caps on lists and texts (issue 31: 10**6 rerank documents, 10**5 inputs, a 30 MB input) -----------

def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


CAP = "(--max-batch-inputs raises the cap)"


def test_batch_caps_on_every_embedding_route(env):
    client, state, _ = env
    many = ["w"] * 2049
    cases = (("/v1/embeddings", {"model": "enc", "input": many}, "input", "inputs"),
             ("/embedding", {"model": "enc", "content": many}, "content", "inputs"),
             ("/rerank", {"model": "rr", "query": "q", "documents": many}, "documents", "documents"),
             ("/rerank", {"model": "rr", "query": "q", "texts": many}, "texts", "documents"),
             ("/v1/score", {"model": "rr", "text_1": "q", "text_2": many}, "text_2", "pairs"))
    for path, body, field, what in cases:
        r = post(client, path, body)
        assert (r.status_code, r.json()["error"]["message"]) == (
            400, f"Field '{field}': at most 2048 {what} per request, got 2049 {CAP}"), path
    r = post(client, "/api/embed", {"model": "enc", "input": many})
    assert (r.status_code, r.json()) == (400, {"error": f"Field 'input': at most 2048 inputs per request, got 2049 "
                                                         f"{CAP}"})
    state.args.max_batch_inputs = 4096  # the flag raises it
    r = post(client, "/v1/embeddings", {"model": "enc", "input": many})
    assert r.status_code == 200 and len(r.json()["data"]) == 2049


def test_a_million_rerank_documents_are_refused_at_once(env):
    """The attack run's repro: 10**6 documents (a 6 MB body) ran for minutes at 5.6 GB RSS."""
    import time

    client, *_ = env
    t0 = time.monotonic()
    r = post(client, "/v1/rerank", {"model": "rr", "query": "q", "documents": ["doc"] * 10 ** 6})
    assert time.monotonic() - t0 < 5
    assert (r.status_code, r.json()["error"]["message"]) == (
        400, f"Field 'documents': at most 2048 documents per request, got 1000000 {CAP}")


def test_a_30_mb_text_is_refused_fast_and_small(env):
    import time

    client, state, _ = env
    text = "word " * (6 << 20)  # 30 MiB
    big = _peak_rss_mib()
    bodies = (("/v1/embeddings", {"model": "enc", "input": text}, "input"),
              ("/v1/embeddings", {"model": "enc", "input": ["x", text]}, "input"),
              ("/embedding", {"model": "enc", "content": text}, "content"),
              ("/rerank", {"model": "rr", "query": text, "documents": ["x"]}, "documents"),
              ("/v1/score", {"model": "rr", "text_1": "q", "text_2": text}, "text_1"))
    for path, body, field in bodies:
        t0 = time.monotonic()
        r = post(client, path, body)
        assert time.monotonic() - t0 < 2, path
        assert (r.status_code, r.json()["error"]["message"]) == (
            400, f"Field '{field}': the text is larger than {2 << 20} bytes (--max-input-bytes raises the cap)"), path
    for path, field in (("/api/embed", "input"), ("/api/embeddings", "prompt")):
        r = post(client, path, {"model": "enc", field: text})
        assert r.status_code == 400 and r.json() == {
            "error": f"Field '{field}': the text is larger than {2 << 20} bytes (--max-input-bytes raises the cap)"}
    assert _peak_rss_mib() - big < 500
    # multi-byte text counts bytes, not characters: 1 MiB of 3-byte characters is 3 MiB
    r = post(client, "/v1/embeddings", {"model": "enc", "input": "€" * (1 << 20)})
    assert r.status_code == 400 and "larger than" in r.json()["error"]["message"]
    assert post(client, "/v1/embeddings", {"model": "enc", "input": "€" * 1000}).status_code == 200


def test_store_paths_are_shown_only_to_key_holders(env, tmp_path):
    """Issue 31: /v1/models' root named the server's store (its home directory) to anyone; without
    --api-key a store model's root is its name, a model named by path keeps its path."""
    from kvserve.faces.models import shown_path

    client, state, store = env
    roots = {m["id"]: m["root"] for m in client.get("/v1/models").json()["data"]}
    assert roots == {"enc:latest": "enc:latest", "gen:latest": "gen:latest", "rr:latest": "rr:latest"}
    inside = str(store.blob_path("sha256:" + "a" * 64))
    outside = str(tmp_path / "elsewhere" / "m.gguf")
    assert shown_path(state.args, inside, "m:latest") == "m:latest"
    assert shown_path(state.args, outside, "m") == outside
    keyed = parse_args(["--models-dir", str(store.root), "--api-key", "k"])
    assert shown_path(keyed, inside, "m:latest") == inside
