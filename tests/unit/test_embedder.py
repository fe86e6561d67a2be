"""EmbeddingEngine: batching, pooling/normalization per call, errors, cross-encoder scores, decoders,
shutdown; and (slow) agreement of all-MiniLM-L6-v2 with sentence-transformers' encode."""

from __future__ import annotations

import asyncio
import gc
import weakref

import numpy as np
import pytest

from embed_conftest import cosine, minilm_dir, write_tiny_bert  # noqa: F401

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency ([test] extra)")

from kvserve.config import EngineConfig  # noqa: E402
from kvserve.engine.async_engine import EngineDeadError  # noqa: E402
from kvserve.engine.embedder import EmbeddingEngine  # noqa: E402
from kvserve.engine.request import ContextSizeExceededError  # noqa: E402
from kvserve.errors import InvalidInputError, NotSupportedError  # noqa: E402
from kvserve.models.build import load_files  # noqa: E402

SHORT = "the cat sat."
LONGER = ["the dog runs on the mat and the cat jumps , the sun is red and the sea is blue .",
          "where is the rain ? it falls mainly in spain on the plain !",
          "who sat on the mat", "a red sky", "the green moon , the blue sun , the red sea and a dog",
          "cat dog cat dog cat dog cat dog cat dog", "what ?"]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_bert(tmp_path_factory.mktemp("emb") / "tiny", seed=5)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    e = EmbeddingEngine(load_files(tiny_dir), EngineConfig(threads=1))
    yield e
    e.shutdown()


def test_facts(engine):
    assert (engine.task, engine.n_ctx, engine.dim) == ("embed", 64, 32)
    assert (engine.pooling, engine.normalize) == ("mean", 2)  # no modules.json: mean, llama-server's 2
    assert engine.model_info.arch == "bert" and engine.error is None


def test_mean_pooling_equals_transformers(engine, tiny_dir):
    ids = engine.tokenizer.encode(LONGER[0], add_special=True)
    m = transformers.BertModel.from_pretrained(str(tiny_dir)).eval()
    with torch.no_grad():
        ref = m(torch.tensor([ids])).last_hidden_state[0].numpy()
    (v,) = run(engine.embed([ids], normalize=-1))
    np.testing.assert_allclose(v, ref.mean(0), atol=2e-5)
    (u,) = run(engine.embed([ids]))
    np.testing.assert_allclose(u, ref.mean(0) / np.linalg.norm(ref.mean(0)), atol=2e-5)
    (tok,) = run(engine.embed([ids], pooling="none", normalize=2))  # per token: never normalized
    assert tok.shape == (len(ids), 32)
    np.testing.assert_allclose(tok, ref, atol=2e-5)
    (c,) = run(engine.embed([ids], pooling="cls", normalize=-1))
    np.testing.assert_allclose(c, ref[0], atol=2e-5)
    (last,) = run(engine.embed([ids], pooling="last", normalize=-1))
    np.testing.assert_allclose(last, ref[-1], atol=2e-5)


def test_batch_invariance(engine):
    """A sentence alone and inside a batch of 8 with longer ones: the same vector (1e-5)."""
    tok = engine.tokenizer
    alone = run(engine.embed([tok.encode(SHORT, add_special=True)]))[0]
    batch = [tok.encode(s, add_special=True) for s in LONGER[:3]] + [tok.encode(SHORT, add_special=True)] + \
            [tok.encode(s, add_special=True) for s in LONGER[3:]]
    assert len(batch) == 8
    vs = run(engine.embed(batch))
    np.testing.assert_allclose(vs[3], alone, atol=1e-5, rtol=0)
    for s, v in zip(LONGER[:3], vs[:3]):  # and each of the others as if alone
        np.testing.assert_allclose(v, run(engine.embed([tok.encode(s, add_special=True)]))[0], atol=1e-5)


def test_concurrent_calls_share_rounds_and_keep_order(tiny_dir):
    e = EmbeddingEngine(load_files(tiny_dir), EngineConfig(threads=1, max_num_batched_tokens=40))
    try:
        tok = e.tokenizer
        texts = LONGER * 3
        ids = [tok.encode(t, add_special=True) for t in texts]
        one_by_one = [run(e.embed([x]))[0] for x in ids]

        async def many():
            return await asyncio.gather(*(e.embed([x]) for x in ids), e.embed(ids))

        *each, together = run(many())
        for a, (b,), c in zip(one_by_one, each, together):
            np.testing.assert_allclose(a, b, atol=1e-5)
            np.testing.assert_allclose(a, c, atol=1e-5)
    finally:
        e.shutdown()


def test_errors(engine):
    with pytest.raises(InvalidInputError, match="Input content cannot be empty"):
        run(engine.embed([[2, 7, 3], []]))
    with pytest.raises(ContextSizeExceededError) as ei:
        run(engine.embed([[2] + [7] * 64]))
    assert (ei.value.n_prompt_tokens, ei.value.n_ctx) == (65, 64) and isinstance(ei.value, InvalidInputError)
    assert "65 tokens" in str(ei.value) and "64 tokens" in str(ei.value)
    assert len(run(engine.embed([[2] + [7] * 62 + [3]]))[0]) == 32  # exactly n_ctx runs
    with pytest.raises(InvalidInputError, match="token id 9999 out of range"):
        run(engine.embed([[2, 9999]]))
    with pytest.raises(InvalidInputError, match="unsupported pooling"):
        run(engine.embed([[2, 3]], pooling="max"))
    with pytest.raises(NotSupportedError):
        run(engine.score([([7], [8])]))
    assert run(engine.embed([])) == []


def test_cross_encoder_scores_equal_transformers(tmp_path):
    d = write_tiny_bert(tmp_path / "rr", classifier=True, seed=7)
    e = EmbeddingEngine(load_files(d), EngineConfig(threads=1))
    try:
        assert e.task == "score"
        m = transformers.BertForSequenceClassification.from_pretrained(str(d)).eval()
        from tokenizers import Tokenizer as HF

        hf = HF.from_file(str(d / "tokenizer.json"))
        pairs = [("what is the cat", "the cat sat on the mat ."), ("where is the rain", "rain falls in spain"),
                 ("who", "the blue sea and the green sun"), ("a dog", "a dog")]
        tok = e.tokenizer
        scores = run(e.score([(tok.encode(q), tok.encode(d_)) for q, d_ in pairs]))
        for (q, doc), s in zip(pairs, scores):
            enc = hf.encode(q, doc)
            assert e.encode_pair(q, doc) == enc.ids
            with torch.no_grad():
                ref = m(torch.tensor([enc.ids]), token_type_ids=torch.tensor([enc.type_ids])).logits[0, 0].item()
            assert abs(s - ref) < 1e-4, (q, doc, s, ref)
        assert len(set(round(s, 4) for s in scores)) == len(scores)  # not a constant
        with pytest.raises(ContextSizeExceededError):
            run(e.score([([7] * 40, [8] * 30)]))
    finally:
        e.shutdown()


def test_shutdown_drops_the_model(tiny_dir):
    e = EmbeddingEngine(load_files(tiny_dir), EngineConfig(threads=1))
    run(e.embed([[2, 7, 3]]))
    ref = weakref.ref(e._model)
    e.shutdown()
    e.shutdown()  # idempotent
    gc.collect()
    assert ref() is None
    assert not e._thread.is_alive()
    with pytest.raises(EngineDeadError):
        run(e.embed([[2, 7, 3]]))


def _gated(e, stop_at: int):
    """Make ``e``'s forward pass number ``stop_at`` (1-based) signal ``reached`` and wait for ``release``."""
    import threading

    reached, release, good, calls = threading.Event(), threading.Event(), e._forward, [0]

    def forward(*a, **k):
        calls[0] += 1
        if calls[0] == stop_at:
            reached.set()
            release.wait(30)
        return good(*a, **k)

    e._forward = forward
    return reached, release


def test_cancelled_call_stops_between_batches(tiny_dir):
    """A caller cancelled while its 3rd of 100 batches runs: that batch ends, the other 97 inputs
    never run, the call raises CancelledError, and the engine answers the next call."""
    e = EmbeddingEngine(load_files(tiny_dir), EngineConfig(threads=1, max_num_batched_tokens=6))
    try:
        ids = e.tokenizer.encode(SHORT, add_special=True)
        assert len(ids) == 6  # [CLS] the cat sat . [SEP]: 6 tokens, a budget of one input per batch
        reached, release = _gated(e, 3)

        async def scenario():
            task = asyncio.ensure_future(e.embed([ids] * 100))
            assert await asyncio.to_thread(reached.wait, 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            release.set()
            return await e.embed([ids])

        (v,) = run(scenario())
        assert v.shape == (32,)
        assert (e.n_forward, e.n_inputs_cancelled) == (4, 97)
    finally:
        e.shutdown()


def test_call_cancelled_while_waiting_never_runs(tiny_dir):
    """A call queued behind a running one and cancelled before its round starts runs no batch."""
    e = EmbeddingEngine(load_files(tiny_dir), EngineConfig(threads=1, max_num_batched_tokens=6))
    try:
        ids = e.tokenizer.encode(SHORT, add_special=True)
        reached, release = _gated(e, 1)

        async def scenario():
            first = asyncio.ensure_future(e.embed([ids] * 2))
            assert await asyncio.to_thread(reached.wait, 30)
            waiting = asyncio.ensure_future(e.embed([ids] * 40))
            await asyncio.sleep(0.05)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            release.set()
            return await first

        assert len(run(scenario())) == 2
        assert (e.n_forward, e.n_inputs_cancelled) == (2, 40)
    finally:
        e.shutdown()


def test_a_failing_batch_fails_its_call_only(tiny_dir):
    e = EmbeddingEngine(load_files(tiny_dir), EngineConfig(threads=1))
    try:
        good = e._forward

        def boom(*a, **k):
            raise RuntimeError("out of memory (simulated)")

        e._forward = boom
        with pytest.raises(RuntimeError, match="simulated"):
            run(e.embed([[2, 7, 3]]))
        e._forward = good
        assert len(run(e.embed([[2, 7, 3]]))[0]) == 32 and e.error is None
    finally:
        e.shutdown()


def test_decoder_embeddings_equal_transformers(tmp_path):
    """A llama-family model embeds over its final normalized hidden states (llama-server
    --embeddings --pooling last|mean): packed inputs, each causal over its own tokens."""
    import tinymodel

    d = tinymodel.write_tiny_hf_dir(tmp_path / "llama")
    e = EmbeddingEngine(load_files(d), EngineConfig(threads=1, dtype="float32"))
    try:
        assert (e.task, e.pooling, e.dim) == ("embed", "last", 64)
        seqs = [[1, 5, 9, 14, 3], [7, 8], [2, 30, 31, 32, 33, 34, 35]]
        m = transformers.AutoModel.from_pretrained(str(d), torch_dtype=torch.float32).eval()
        toks = run(e.embed(seqs, pooling="none"))
        means = run(e.embed(seqs, pooling="mean", normalize=-1))
        lasts = run(e.embed(seqs))
        for s, t, mean, last in zip(seqs, toks, means, lasts):
            with torch.no_grad():
                ref = m(torch.tensor([s])).last_hidden_state[0].numpy()
            np.testing.assert_allclose(t, ref, atol=1e-4)
            np.testing.assert_allclose(mean, ref.mean(0), atol=1e-4)
            np.testing.assert_allclose(last, ref[-1] / np.linalg.norm(ref[-1]), atol=1e-4)
    finally:
        e.shutdown()


# ------------------------------------------------------------------- the real model (slow)

SENTENCES_50 = [
    "A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
    "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.", "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.", "The cat sits outside.",
    "A man is playing guitar.", "The new movie is awesome.", "The new movie is so great.",
    "Do you like pizza?", "The dog plays in the garden.", "A woman watches TV.", "The new movie is so great!",
    "How do I install Python on Windows?", "What is the capital of France?", "Paris is the capital of France.",
    "The quick brown fox jumps over the lazy dog.", "Machine learning models need data.",
    "Embeddings turn text into vectors.", "Cosine similarity compares two vectors.",
    "The stock market fell sharply today.", "Heavy rain is expected tomorrow in the north.",
    "She sold seashells by the seashore.", "Transformers use self-attention.",
    "I forgot my umbrella at the office.", "The train to Berlin leaves at nine.",
    "Water boils at 100 degrees Celsius at sea level.", "He plays football every Sunday.",
    "Kvserve serves models over HTTP.", "Retrieval augmented generation needs good embeddings.",
    "A bicycle has two wheels.", "Tea or coffee?", "The museum opens at ten in the morning.",
    "Quantum computers use qubits.", "Ein Hund spielt im Garten.", "Le chat dort sur le canapé.",
    "naïve café résumé déjà vu", "The year 2024 had 366 days.", "E-mail me at someone@example.com!",
    "Rust and Go are compiled languages.", "Please reset my password.", "Where is the nearest pharmacy?",
    "The meeting was moved to Thursday afternoon.", "Bananas are rich in potassium.",
    "A very long sentence " + "that keeps going and going " * 12 + "until it ends.", "ok",
]


@pytest.fixture(scope="module")
def minilm(minilm_dir):  # noqa: F811
    e = EmbeddingEngine(load_files(minilm_dir), EngineConfig())
    yield e
    e.shutdown()


@pytest.mark.slow
def test_minilm_agrees_with_sentence_transformers(minilm, minilm_dir):  # noqa: F811
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is a test-only dependency")
    assert (minilm.task, minilm.dim, minilm.n_ctx, minilm.pooling, minilm.normalize) == ("embed", 384, 512, "mean", 2)
    ref = st.SentenceTransformer(minilm_dir, device="cpu").encode(SENTENCES_50, batch_size=32)
    tok = minilm.tokenizer
    ours = run(minilm.embed([tok.encode(s, add_special=True) for s in SENTENCES_50]))
    cos = [cosine(a, b) for a, b in zip(ours, ref)]
    assert min(cos) >= 0.9999, min(cos)
    assert all(abs(np.linalg.norm(v) - 1.0) < 1e-5 for v in ours)


@pytest.mark.slow
def test_minilm_known_pair_ordering(minilm):
    tok = minilm.tokenizer
    a, para, other = run(minilm.embed([tok.encode(s, add_special=True) for s in
                                       ("The new movie is awesome.", "The new movie is so great.",
                                        "The stock market fell sharply today.")]))
    assert cosine(a, para) > cosine(a, other) + 0.3
