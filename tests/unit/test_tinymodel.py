"""Tests for tests/tinymodel.py: the tiny GGUF and HF writers agree with each other and with gguf."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tinymodel as tm  # noqa: E402

gguf = pytest.importorskip("gguf")

SAMPLE = ("<|im_start|>user\nThe cat sat on the mat, and it is 2024!\tTabs  and  spaces"
          " héllo 世界 🤖 don't<|im_end|>\n<|im_start|>assistant\n")


def _field(reader, key):
    return reader.fields[key].contents()


def _tensors(reader) -> dict:
    return {t.name: t for t in reader.tensors}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return tm.write_tiny_gguf(tmp_path_factory.mktemp("g") / "tiny.gguf")


def test_vocab_and_merges_consistent() -> None:
    tokens, types, merges = tm.tiny_vocab()
    assert tokens[:3] == tm.SPECIAL_TOKENS
    assert len(tokens) == 3 + 256 + len(tm.MERGES) == len(set(tokens))
    assert types[:3] == [3, 3, 3] and set(types[3:]) == {1}
    assert len(merges) == len(tm.MERGES)
    assert tokens[3 + ord("a")] == "a" and tokens[3 + ord(" ")] == "Ġ" and tokens[3 + ord("\n")] == "Ċ"


def test_gguf_metadata_and_shapes(tiny_gguf: Path) -> None:
    r = gguf.GGUFReader(tiny_gguf)
    tokens, _, merges = tm.tiny_vocab()
    expect = {
        "general.architecture": "llama", "llama.block_count": 2, "llama.context_length": 512,
        "llama.embedding_length": 64, "llama.feed_forward_length": 128, "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2, "llama.rope.freq_base": 10000.0, "llama.rope.dimension_count": 16,
        "general.file_type": 0, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0, "tokenizer.ggml.eot_token_id": 2,
        "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": tm.CHATML_TEMPLATE,
    }
    for key, value in expect.items():
        assert _field(r, key) == value, key
    assert _field(r, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert _field(r, "tokenizer.ggml.tokens") == tokens
    assert _field(r, "tokenizer.ggml.merges") == merges
    t = _tensors(r)
    n_vocab = len(tokens)
    shapes = {"token_embd.weight": (n_vocab, 64), "output_norm.weight": (64,), "output.weight": (n_vocab, 64)}
    for i in range(2):
        shapes |= {f"blk.{i}.attn_norm.weight": (64,), f"blk.{i}.attn_q.weight": (64, 64),
                   f"blk.{i}.attn_k.weight": (32, 64), f"blk.{i}.attn_v.weight": (32, 64),
                   f"blk.{i}.attn_output.weight": (64, 64), f"blk.{i}.ffn_norm.weight": (64,),
                   f"blk.{i}.ffn_gate.weight": (128, 64), f"blk.{i}.ffn_up.weight": (128, 64),
                   f"blk.{i}.ffn_down.weight": (64, 128)}
    assert set(t) == set(shapes)
    for name, shape in shapes.items():
        assert tuple(t[name].data.shape) == shape, name  # torch layout [out, in]
        assert tuple(int(x) for x in t[name].shape) == shape[::-1], name  # GGUF ne order
        assert t[name].tensor_type.name == "F32"


def test_deterministic(tmp_path: Path) -> None:
    a = tm.write_tiny_gguf(tmp_path / "a.gguf", seed=3)
    b = tm.write_tiny_gguf(tmp_path / "b.gguf", seed=3)
    c = tm.write_tiny_gguf(tmp_path / "c.gguf", seed=4)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_qwen2_tied(tmp_path: Path) -> None:
    p = tm.write_tiny_gguf(tmp_path / "q.gguf", arch="qwen2", tie_embeddings=True, rope_freq_base=1e6)
    r = gguf.GGUFReader(p)
    assert _field(r, "general.architecture") == "qwen2"
    assert _field(r, "qwen2.rope.freq_base") == 1e6
    t = _tensors(r)
    assert "output.weight" not in t
    assert tuple(t["blk.0.attn_q.bias"].data.shape) == (64,)
    assert tuple(t["blk.1.attn_k.bias"].data.shape) == (32,)
    assert tuple(t["blk.1.attn_v.bias"].data.shape) == (32,)


_TOLERANCE = {"F32": 0.0, "F16": 1e-3, "BF16": 4e-3, "Q8_0": 4e-3, "Q4_0": 0.05, "Q4_1": 0.04,
              "Q5_0": 0.03, "Q5_1": 0.02, "Q4_K": 0.05, "Q6_K": 0.015}


@pytest.mark.parametrize("qtype", tm.QTYPES)
def test_qtype_round_trip(tmp_path: Path, qtype: str) -> None:
    k_quant = qtype.endswith("_K")
    shape = dict(n_embd=256, n_ff=256, n_head=4, n_head_kv=2, n_layer=1) if k_quant else {}
    p = tm.write_tiny_gguf(tmp_path / f"{qtype}.gguf", qtype=qtype, **shape)
    r = gguf.GGUFReader(p)
    t = _tensors(r)
    weights = tm.tiny_weights(**shape)
    checked = 0
    for hf_name, ref in weights.items():
        name = tm._gguf_name(hf_name)
        tensor = t[name]
        if ref.ndim == 1:
            assert tensor.tensor_type.name == "F32"
            continue
        assert tensor.tensor_type.name == qtype, name
        got = gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type).reshape(ref.shape)
        if name.endswith("attn_q.weight"):
            ref = tm.permute_qk(ref, 4)
        elif name.endswith("attn_k.weight"):
            ref = tm.permute_qk(ref, 2)
        err = np.abs(got - ref).max()
        assert err <= _TOLERANCE[qtype] * max(1.0, np.abs(ref).max() / 0.25), (name, err)
        checked += 1
    assert checked == len([w for w in weights.values() if w.ndim == 2])


def test_unsupported_qtype(tmp_path: Path) -> None:
    with pytest.raises(NotImplementedError, match="Q3_K"):
        tm.write_tiny_gguf(tmp_path / "x.gguf", qtype="Q3_K")
    with pytest.raises(ValueError, match="multiple of 256"):
        tm.write_tiny_gguf(tmp_path / "x.gguf", qtype="Q4_K")  # n_embd=64 rows


def test_hf_dir_loads(tmp_path: Path) -> None:
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    d = tm.write_tiny_hf_dir(tmp_path / "hf")
    config = json.loads((d / "config.json").read_text())
    n_vocab = len(tm.tiny_vocab()[0])
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == n_vocab
    assert config["num_key_value_heads"] == 2 and config["tie_word_embeddings"] is False
    tensors = load_file(d / "model.safetensors")
    assert tensors["model.embed_tokens.weight"].shape == (n_vocab, 64)
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)
    assert tensors["lm_head.weight"].shape == (n_vocab, 64)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.get_vocab_size() == n_vocab
    enc = tok.encode(SAMPLE)
    assert enc.ids[0] == 1 and tok.decode(enc.ids, skip_special_tokens=False) == SAMPLE
    assert tok.encode(" the").ids == [tm.tiny_vocab()[0].index("Ġthe")]
    assert tok.encode("2024").ids == [3 + ord(c) for c in "2024"]  # digits split one by one
    tc = json.loads((d / "tokenizer_config.json").read_text())
    assert tc["chat_template"] == tm.CHATML_TEMPLATE and tc["add_bos_token"] is False
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == [0, 2]


@pytest.mark.parametrize("arch,qtype,tie", [("llama", "F32", False), ("qwen2", "F32", True),
                                            ("llama", "Q4_1", False), ("qwen2", "Q8_0", False)])
def test_gguf_and_hf_hold_the_same_model(tmp_path: Path, arch: str, qtype: str, tie: bool) -> None:
    from safetensors.numpy import load_file

    kw = dict(arch=arch, qtype=qtype, tie_embeddings=tie, seed=7)
    r = gguf.GGUFReader(tm.write_tiny_gguf(tmp_path / "m.gguf", **kw))
    hf = load_file(tm.write_tiny_hf_dir(tmp_path / "hf", **kw) / "model.safetensors")
    t = _tensors(r)
    assert len(t) == len(hf)
    for hf_name, value in hf.items():
        tensor = t[tm._gguf_name(hf_name)]
        got = gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type).reshape(value.shape)
        if arch == "llama" and ".q_proj." in hf_name:
            value = tm.permute_qk(value, 4)
        elif arch == "llama" and ".k_proj." in hf_name:
            value = tm.permute_qk(value, 2)
        np.testing.assert_array_equal(got, value, err_msg=hf_name)


def _tokenizer_from_gguf(path: Path):
    """A `tokenizers` BPE built from the GGUF's tokenizer.ggml.* metadata (as a loader would)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    r = gguf.GGUFReader(path)
    tokens = _field(r, "tokenizer.ggml.tokens")
    types = _field(r, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(r, "tokenizer.ggml.merges")]
    assert _field(r, "tokenizer.ggml.pre") == "smollm"
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])
    return tok


def test_gguf_and_hf_tokenizers_agree(tiny_gguf: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(tm.write_tiny_hf_dir(tmp_path / "hf") / "tokenizer.json"))
    from_gguf = _tokenizer_from_gguf(tiny_gguf)
    for text in (SAMPLE, "the theory of everything", "  leading spaces\n\n\nnewlines", "1234567 x"):
        assert from_gguf.encode(text).ids == hf.encode(text).ids, text
    assert len(hf.encode(SAMPLE).ids) < len(SAMPLE.encode())  # merges were used


def test_kvserve_gguf_tokenizer_matches_hf(tiny_gguf: Path, tmp_path: Path) -> None:
    """kvserve's own GGUF tokenizer loader (kvserve/loaders/tokenizer.py), when present."""
    mod = pytest.importorskip("kvserve.loaders.tokenizer")
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(tm.write_tiny_hf_dir(tmp_path / "hf") / "tokenizer.json"))
    ours = mod.Tokenizer.from_gguf_file(tiny_gguf)
    for text in (SAMPLE, "the theory of everything", "1234567 x", "don't  stop\n\nnow"):
        assert list(ours.encode(text)) == hf.encode(text).ids, text


def test_header_cache_sees_a_replaced_file(tmp_path: Path) -> None:
    """read_gguf_header remembers the last file's header: a caller's changes to what it got do not
    reach the next caller, and a same-size file put in its place with the old modification time
    (cp -p, rsync -a) is read anew (the key holds the inode and change time)."""
    import os

    from kvserve.loaders.gguf import load_gguf, read_gguf_header

    p = tm.write_tiny_gguf(tmp_path / "m.gguf", ctx=512)
    md, infos = read_gguf_header(str(p))
    assert md["llama.context_length"] == 512
    md["llama.context_length"] = 7
    infos.clear()
    md2, infos2 = read_gguf_header(str(p))
    assert md2["llama.context_length"] == 512 and len(infos2) > 0
    st = os.stat(p)
    new = tm.write_tiny_gguf(tmp_path / "new.gguf", ctx=2048)
    assert os.path.getsize(new) == st.st_size
    os.replace(new, p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert read_gguf_header(str(p))[0]["llama.context_length"] == 2048
    assert load_gguf(p).config.n_ctx_train == 2048
