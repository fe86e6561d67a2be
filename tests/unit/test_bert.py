"""The BERT encoder family: HF directories (with/without the bert. prefix), GGUF files as llama.cpp's
converter writes them, the WordPiece tokenizer from tokenizer.json and from GGUF, the registry's tasks.

Reference numbers come from transformers (test-only dependency) on the same random weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from embed_conftest import TINY_WORDS, minilm_dir, write_tiny_bert  # noqa: F401

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency ([test] extra)")

from kvserve.loaders.weights import ModelLoadError  # noqa: E402
from kvserve.models.bert import BertConfig, BertModel  # noqa: E402
from kvserve.models.build import load_files, model_task, probe_task  # noqa: E402

SENTENCES = ["the cat sat on the mat.", "what is the red sky?", "rain falls mainly in spain, on the plain!",
             "dog runs", "the blue sea and the green sun, the moon ... jumping cats"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_bert(tmp_path_factory.mktemp("bert") / "tiny")


@pytest.fixture(scope="module")
def tiny_cls_dir(tmp_path_factory) -> Path:
    return write_tiny_bert(tmp_path_factory.mktemp("bertcls") / "tiny", classifier=True, seed=1)


def hf_hidden(path: Path, ids: list[list[int]], types: list[list[int]] | None = None) -> list[np.ndarray]:
    """transformers' last_hidden_state per input (run one at a time: no padding involved)."""
    m = transformers.BertModel.from_pretrained(str(path)).eval()
    out = []
    with torch.no_grad():
        for i, x in enumerate(ids):
            tt = torch.tensor([types[i]]) if types else None
            out.append(m(torch.tensor([x]), token_type_ids=tt).last_hidden_state[0].numpy())
    return out


def ours_hidden(model: BertModel, ids: list[list[int]]) -> list[np.ndarray]:
    """Our hidden states for a right-padded batch of ``ids`` (one forward pass)."""
    L = max(map(len, ids))
    x = torch.zeros(len(ids), L, dtype=torch.long)
    mask = torch.zeros(len(ids), L, dtype=torch.bool)
    for b, s in enumerate(ids):
        x[b, :len(s)] = torch.tensor(s)
        mask[b, :len(s)] = True
    h = model.forward(x, None, mask)
    return [h[b, :len(s)].numpy() for b, s in enumerate(ids)]


def test_hf_dir_matches_transformers_padded_batch(tiny_dir):
    loaded = load_files(tiny_dir)
    assert isinstance(loaded.config, BertConfig)
    assert (loaded.config.n_layer, loaded.config.n_embd, loaded.config.n_head, loaded.config.n_ctx_train) == (2, 32, 4, 64)
    assert loaded.info.arch == "bert" and loaded.info.format == "safetensors" and loaded.info.n_embd == 32
    tok = loaded.tokenizer
    ids = [tok.encode(s, add_special=True) for s in SENTENCES]
    assert all(x[0] == 2 and x[-1] == 3 for x in ids)  # [CLS] ... [SEP]
    ref = hf_hidden(tiny_dir, ids)
    ours = ours_hidden(BertModel(loaded.config, loaded.weights), ids)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)


def test_attention_groups_cut_by_length_ratio():
    from kvserve.models.bert import attention_groups

    # sorted by length; a group's longest is at most 1.25 x its shortest
    assert attention_groups([10, 3, 12, 4, 40, 13, 50, 5]) == [[1], [3, 7], [0, 2], [5], [4, 6]]
    assert attention_groups([7, 7, 8]) == [[0, 1, 2]]  # 8 <= 8.75: one group, no extra call
    assert attention_groups([1]) == [[0]]
    assert attention_groups([5, 1, 5], ratio=1.0) == [[1], [0, 2]]


def test_grouped_attention_batch_equals_each_input_alone(tiny_dir):
    """A padded batch of very different lengths (several attention groups, some with a key mask,
    unsorted rows) gives each input the vectors it gets alone, and transformers' (2e-5)."""
    loaded = load_files(tiny_dir)
    model = BertModel(loaded.config, loaded.weights)
    rng = np.random.default_rng(3)
    lens = [40, 3, 9, 10, 3, 25, 11, 60, 4]
    ids = [[2] + rng.integers(5, loaded.config.n_vocab, n - 2).tolist() + [3] for n in lens]
    batch = ours_hidden(model, ids)
    ref = hf_hidden(tiny_dir, ids)
    for x, b, r in zip(ids, batch, ref):
        alone = ours_hidden(model, [x])[0]
        assert b.shape == (len(x), 32)
        np.testing.assert_allclose(b, alone, atol=2e-6, rtol=0)
        np.testing.assert_allclose(b, r, atol=2e-5, rtol=0)


def test_bert_prefix_and_old_layernorm_names(tiny_dir, tmp_path):
    """Weights saved as 'bert.embeddings...' with LayerNorm gamma/beta load as the plain ones."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "prefixed"
    d.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (d / f).write_text((tiny_dir / f).read_text())
    state = load_file(str(tiny_dir / "model.safetensors"))
    renamed = {}
    for k, v in state.items():
        k = "bert." + k
        if k.endswith("LayerNorm.weight"):
            k = k[:-len("weight")] + "gamma"
        elif k.endswith("LayerNorm.bias"):
            k = k[:-len("bias")] + "beta"
        renamed[k] = v
    save_file(renamed, str(d / "model.safetensors"))
    a, b = load_files(tiny_dir), load_files(d)
    assert a.weights.keys() == b.weights.keys()
    for k in a.weights:
        np.testing.assert_array_equal(a.weights[k].dense, b.weights[k].dense)


def test_tanh_gelu_and_no_token_types(tmp_path):
    d = write_tiny_bert(tmp_path / "t", hidden_act="gelu_new", seed=3)
    cfg = json.loads((d / "config.json").read_text())
    loaded = load_files(d)
    assert loaded.config.activation == "gelu_new"
    ids = [loaded.tokenizer.encode(s, add_special=True) for s in SENTENCES[:2]]
    for a, b in zip(ours_hidden(BertModel(loaded.config, loaded.weights), ids), hf_hidden(d, ids)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)
    # a model without token type embeddings (type_vocab_size 0 in our config) runs too
    del loaded.weights["token_types.weight"]
    loaded.config.n_token_types = 0
    BertModel(loaded.config, loaded.weights).forward(torch.tensor([ids[0]]))
    assert cfg["hidden_act"] == "gelu_new"


def test_unsupported_variants_are_refused(tiny_dir, tmp_path):
    d = tmp_path / "rel"
    d.mkdir()
    for f in tiny_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tiny_dir / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "position_embedding_type": "relative_key"}))
    with pytest.raises(ModelLoadError, match="position_embedding_type 'relative_key'"):
        load_files(d)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    (d / "1_Pooling").mkdir()
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    with pytest.raises(ModelLoadError, match="Dense"):
        load_files(d)
    (d / "modules.json").write_text(json.dumps([
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ModelLoadError, match="pooling_mode_max_tokens"):
        load_files(d)
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    loaded = load_files(d)
    assert (loaded.config.pooling, loaded.config.normalize) == ("cls", -1)  # no Normalize module


def test_registry_tasks(tiny_dir, tiny_cls_dir, tiny_gguf):
    assert probe_task(tiny_dir) == "embed" and model_task(load_files(tiny_dir)) == "embed"
    assert probe_task(tiny_cls_dir) == "score"
    loaded = load_files(tiny_cls_dir)
    assert model_task(loaded) == "score" and loaded.config.n_labels == 1 and "cls.weight" in loaded.weights
    assert probe_task(tiny_gguf) == "generate"


# ------------------------------------------------------------------------------ GGUF


def write_bert_gguf(src: Path, out: Path, *, pooling: int = 1) -> Path:
    """The tiny HF BERT as llama.cpp's convert_hf_to_gguf.py writes it: names from gguf-py's own
    tensor map, the pooler dropped, ``classifier`` as ``cls.output``, the vocabulary with the
    U+2581 phantom space on word-initial pieces and '##' removed from continuations."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((src / "config.json").read_text())
    vocab = json.loads((src / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [3 if t.startswith("[") and t.endswith("]") else 1 for t in tokens]
    tokens = [t if t.startswith("[") and t.endswith("]") else t[2:] if t.startswith("##") else "\u2581" + t
              for t in tokens]
    w = gguf.GGUFWriter(str(out), "bert")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_eps(cfg["layer_norm_eps"])
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType(pooling))
    w.add_file_type(0)
    w.add_token_type_count(cfg["type_vocab_size"])
    w.add_tokenizer_model("bert")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_bos_token_id(vocab["[CLS]"])  # gguf.SpecialVocab writes cls as ... ; llama.cpp reads BOS = [CLS]
    w.add_sep_token_id(vocab["[SEP]"])
    w.add_pad_token_id(vocab["[PAD]"])
    w.add_unk_token_id(vocab["[UNK]"])
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, cfg["num_hidden_layers"])
    for name, t in load_file(str(src / "model.safetensors")).items():
        name = name[5:] if name.startswith("bert.") else name
        if name in ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"):
            continue
        if name.startswith("classifier."):
            name = "classifier.out_proj." + name.split(".")[-1]
        new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        w.add_tensor(new, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_gguf_bert_equals_hf_dir(tiny_dir, tmp_path):
    g = load_files(write_bert_gguf(tiny_dir, tmp_path / "tiny-bert.gguf"))
    h = load_files(tiny_dir)
    assert isinstance(g.config, BertConfig) and g.info.format == "gguf" and g.info.arch == "bert"
    assert g.config.pooling == "mean" and g.config.n_token_types == 2 and g.config.n_labels == 0
    assert probe_task(tmp_path / "tiny-bert.gguf") == "embed"
    for s in SENTENCES:  # the WordPiece vocabulary rebuilt from the phantom-space tokens
        assert g.tokenizer.encode(s, add_special=True) == h.tokenizer.encode(s, add_special=True)
    ids = [h.tokenizer.encode(s, add_special=True) for s in SENTENCES]
    for a, b in zip(ours_hidden(BertModel(g.config, g.weights), ids), ours_hidden(BertModel(h.config, h.weights), ids)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    assert g.tokenizer.decode(ids[0]) == "[CLS] the cat sat on the mat .[SEP]"


def test_gguf_reranker_without_pooler(tiny_cls_dir, tmp_path):
    """llama.cpp's converter drops the pooler: the GGUF reranker scores the classifier over the
    first token directly (llama.cpp's rank pooling without cls)."""
    g = load_files(write_bert_gguf(tiny_cls_dir, tmp_path / "rr.gguf", pooling=4))
    assert g.config.n_labels == 1 and g.config.pooling == "rank" and "cls.weight" not in g.weights
    assert probe_task(tmp_path / "rr.gguf") == "score"
    m = BertModel(g.config, g.weights)
    ids = g.tokenizer.encode("the cat", add_special=True)
    h = m.forward(torch.tensor([ids]))
    w, b = g.weights["cls.output.weight"].dense, g.weights["cls.output.bias"].dense
    np.testing.assert_allclose(m.classify(h[:, 0]).numpy(), h[:, 0].numpy() @ w.T + b, atol=1e-6)


def test_minilm_tokenizer_matches_hf(minilm_dir):  # noqa: F811
    from tokenizers import Tokenizer as HF

    from kvserve.loaders.tokenizer import VOCAB_TYPE_WPM, Tokenizer

    tok = Tokenizer.from_hf_dir(minilm_dir)
    hf = HF.from_file(str(Path(minilm_dir) / "tokenizer.json"))
    hf.no_padding()
    hf.no_truncation()
    assert tok.vocab_type == VOCAB_TYPE_WPM and (tok.bos_token_id, tok.eos_token_id) == (101, 102)
    for s in ["Hello, World!", "naïve café résumé", "unbelievably tokenized words", "日本語のテキスト", "a [SEP] b"]:
        assert tok.encode(s, add_special=True) == hf.encode(s).ids
    assert tok.decode(tok.encode("Tokenization works", add_special=True)) == "[CLS] tokenization works[SEP]"
    pair = hf.encode("what is it", "it is a cat")
    assert tok.encode("what is it", add_special=True) + tok.encode("it is a cat") + [102] == pair.ids
