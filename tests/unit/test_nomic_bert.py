"""nomic-bert (nomic-embed-text) against transformers' NomicBertModel (float32, the reference forward:
rotary positions, post-norm LayerNorm, SwiGLU FFN), loaded from its HF directory (``save_pretrained``:
nomic's original names, fused ``Wqkv``) and from a GGUF as llama.cpp's converter writes nomic-bert
(gguf-py's own name map, ``nomic-bert.rope.freq_base``, mean pooling); vectors through the embedding engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency ([test] extra)")

from kvserve.config import EngineConfig  # noqa: E402
from kvserve.engine.embedder import EmbeddingEngine  # noqa: E402
from kvserve.loaders.weights import ModelLoadError  # noqa: E402
from kvserve.models.bert import BertConfig, BertModel  # noqa: E402
from kvserve.models.build import load_files, probe_task  # noqa: E402
from family_models import write_nomic_gguf, write_tiny_nomic  # noqa: E402

SENTENCES = ["search_query: the cat sat on the mat.", "what is the red sky?",
             "search_document: rain falls mainly in spain, on the plain! the dog runs and the cat jumps on the mat",
             "dog runs", "the blue sea and the green sun, the moon ... jumping cats"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("nomic")
    hf = write_tiny_nomic(d / "hf", seed=3)
    return {"hf": hf, "gguf": write_nomic_gguf(hf, d / "nomic.gguf")}


def reference(path: Path, ids: list[list[int]]) -> list[np.ndarray]:
    """transformers' last_hidden_state per input, one at a time (no padding involved)."""
    m = transformers.NomicBertModel.from_pretrained(str(path)).eval()
    with torch.no_grad():
        return [m(torch.tensor([x])).last_hidden_state[0].numpy() for x in ids]


def ours(model: BertModel, ids: list[list[int]]) -> list[np.ndarray]:
    """Our hidden states for one right-padded batch of ``ids``."""
    L = max(map(len, ids))
    x = torch.zeros(len(ids), L, dtype=torch.long)
    mask = torch.zeros(len(ids), L, dtype=torch.bool)
    for b, s in enumerate(ids):
        x[b, :len(s)] = torch.tensor(s)
        mask[b, :len(s)] = True
    h = model.forward(x, None, mask)
    return [h[b, :len(s)].numpy() for b, s in enumerate(ids)]


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_hidden_states_match_transformers_padded_batch(files, fmt):
    loaded = load_files(files[fmt])
    c = loaded.config
    assert isinstance(c, BertConfig) and loaded.info.arch == "nomic-bert"
    assert (c.n_layer, c.n_embd, c.n_head, c.n_ff, c.rope_base, c.gated_ffn) == (2, 32, 4, 64, 1000.0, True)
    assert "position_embd.weight" not in loaded.weights
    assert "blk.0.attn_qkv.weight" in loaded.weights and "blk.0.ffn_gate.weight" in loaded.weights
    assert probe_task(files[fmt]) == "embed"
    ids = [loaded.tokenizer.encode(s, add_special=True) for s in SENTENCES]
    assert ids == [load_files(files["hf"]).tokenizer.encode(s, add_special=True) for s in SENTENCES]
    assert max(map(len, ids)) == 28 and min(map(len, ids)) == 5  # padding within the batch
    ref = reference(files["hf"], ids)
    scale = max(np.abs(r).max() for r in ref)
    for a, b in zip(ours(BertModel(c, loaded.weights), ids), ref):
        assert np.abs(a - b).max() <= 1e-4 * scale


def test_rotary_positions_matter(files):
    """The same token at another position gets another vector (rotary applied; no position table)."""
    loaded = load_files(files["gguf"])
    (h,) = ours(BertModel(loaded.config, loaded.weights), [[2, 7, 7, 7, 3]])
    assert np.abs(h[1] - h[2]).max() > 1e-2
    ref = reference(files["hf"], [[2, 7, 7, 7, 3]])[0]
    assert np.abs(h - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_mean_pooled_vectors_through_the_engine(files, fmt):
    """EmbeddingEngine: mean pooling (GGUF pooling_type 1; the encoder default for HF), normalized."""
    e = EmbeddingEngine(load_files(files[fmt]), EngineConfig(threads=1))
    try:
        assert (e.task, e.pooling, e.normalize, e.dim, e.n_ctx) == ("embed", "mean", 2, 32, 128)
        ids = [e.tokenizer.encode(s, add_special=True) for s in SENTENCES]
        got = asyncio.run(e.embed(ids))
    finally:
        e.shutdown()
    for v, r in zip(got, reference(files["hf"], ids)):
        m = r.mean(0)
        np.testing.assert_allclose(v, m / np.linalg.norm(m), atol=1e-5)


def test_nomic_original_checkpoint_names_and_refused_options(files, tmp_path):
    """nomic's remote-code checkpoint names and GPT-2 style keys load; options kvserve does not
    compute are refused naming the key."""
    from kvserve.models.family import read_gguf_config, read_hf_config
    from kvserve.models.nomic_bert import hf_tensor_name

    assert hf_tensor_name("encoder.layers.3.attn.Wqkv.weight") == "blk.3.attn_qkv.weight"
    assert hf_tensor_name("encoder.layers.0.mlp.fc12.weight") == "blk.0.ffn_gate.weight"
    assert hf_tensor_name("emb_ln.bias") == "token_embd_norm.bias"
    assert hf_tensor_name("layers.1.post_mlp_layernorm.weight") == "blk.1.layer_output_norm.weight"
    assert hf_tensor_name("lm_head.weight") is None
    orig = {"architectures": ["NomicBertModel"], "model_type": "nomic_bert", "n_embd": 768, "n_head": 12,
            "n_layer": 12, "n_inner": 3072, "n_positions": 8192, "vocab_size": 30528, "rotary_emb_base": 1000,
            "rotary_emb_fraction": 1.0, "activation_function": "swiglu", "layer_norm_epsilon": 1e-12,
            "prenorm": False, "rotary_emb_interleaved": False, "rotary_scaling_factor": None}
    c = read_hf_config(orig, str(tmp_path))
    assert (c.arch, c.n_embd, c.n_ff, c.n_ctx_train, c.rope_base, c.activation) == \
        ("nomic-bert", 768, 3072, 8192, 1000.0, "silu")
    for key, value, msg in [
        ("rotary_emb_fraction", 0.5, "kvserve rotates whole heads (1.0)"),
        ("prenorm", True, "kvserve runs nomic-bert's post-norm block (false)"),
        ("rotary_scaling_factor", 2.0, "kvserve computes unscaled rotary (null)"),
        ("activation_function", "relu", "kvserve's gated FFN runs geglu, gelu, silu, swiglu, swish"),
    ]:
        with pytest.raises(ModelLoadError) as e:
            read_hf_config({**orig, key: value}, str(tmp_path))
        assert str(e.value) == f"{tmp_path}: config.json {key} is {value!r}: {msg}"
    md = {"general.architecture": "nomic-bert", "nomic-bert.block_count": 2, "nomic-bert.embedding_length": 32,
          "nomic-bert.attention.head_count": 4, "nomic-bert.feed_forward_length": 64}
    with pytest.raises(ModelLoadError, match="^n.gguf: missing GGUF key 'nomic-bert.context_length'$"):
        read_gguf_config(md, "n.gguf")
    with pytest.raises(ModelLoadError, match="^n.gguf: GGUF key 'nomic-bert.expert_count' is 8: kvserve runs"):
        read_gguf_config({**md, "nomic-bert.context_length": 2048, "nomic-bert.expert_count": 8}, "n.gguf")
    c = read_gguf_config({**md, "nomic-bert.context_length": 2048}, "n.gguf")
    assert (c.rope_base, c.gated_ffn, c.pooling) == (1000.0, True, None)
