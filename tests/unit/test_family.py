"""The family records (kvserve.models.family): every architecture table derives from them."""

from __future__ import annotations

import json

import pytest

import tinymodel
from kvserve.loaders.weights import ModelLoadError
from kvserve.models import family as fm
from kvserve.models.build import load_files, probe_task


def test_tables_derive_from_the_records():
    assert [f.name for f in fm.FAMILIES] == ["llama", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3", "mistral3", "gpt-oss", "bert", "nomic-bert"]
    assert {a: f.name for a, f in fm.GGUF_ARCHS.items()} == {
        "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3moe",
        "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "mistral3": "mistral3",
        "gpt-oss": "gpt-oss", "gptoss": "gpt-oss", "bert": "bert", "nomic-bert": "nomic-bert"}
    assert {a: f.name for a, f in fm.HF_ARCHS.items()} == {
        "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "llama",
        "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe", "Gemma2ForCausalLM": "gemma2",
        "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3", "Ministral3ForCausalLM": "mistral3",
        "GptOssForCausalLM": "gpt-oss", "BertModel": "bert", "BertForMaskedLM": "bert", "BertForPreTraining": "bert",
        "BertForSequenceClassification": "bert", "NomicBertModel": "nomic-bert"}
    assert fm.ARCH_TASKS["qwen2"] == "generate" and fm.ARCH_TASKS["BertForSequenceClassification"] == "score"
    assert fm.ENCODER_TASKS["bert"] == "embed" and fm.ENCODER_TASKS["nomic-bert"] == "embed"
    assert "llama" not in fm.ENCODER_TASKS
    from kvserve.serving.embed_runner import ENCODER_TASKS

    assert ENCODER_TASKS is fm.ENCODER_TASKS


def test_module_kv_spec_and_native_step_per_family(tmp_path):
    from kvserve.models.bert import BertModel
    from kvserve.models.llama import LlamaModel

    assert fm.LLAMA.module_class() is LlamaModel and fm.BERT.module_class() is BertModel
    assert fm.QWEN3.module_class() is LlamaModel  # the llama block with its q/k norm piece
    cfg = load_files(tinymodel.write_tiny_gguf(tmp_path / "t.gguf")).config
    assert fm.family_of(cfg.arch) is fm.LLAMA
    assert fm.LLAMA.kv_spec(cfg) == (fm.KVSpec("full"),) * cfg.n_layer
    assert fm.LLAMA.native_decode(cfg) is True and fm.BERT.native_decode(cfg) is False
    # the C++ step's layer runs qwen3's q/k norm (and qwen3moe's experts), not the llama family's own
    # q/k-normed configs, nor output or MLP biases
    import dataclasses

    qk = dataclasses.replace(cfg, qk_norm=True)
    assert fm.QWEN3.native_decode(qk) is True and fm.QWEN3MOE.native_decode(qk) is True
    assert fm.LLAMA.native_decode(qk) is False
    assert fm.QWEN3.native_decode(dataclasses.replace(qk, attn_bias=True)) is False
    assert fm.QWEN3.native_decode(dataclasses.replace(qk, mlp_bias=True)) is False
    assert fm.BERT.kv_spec(cfg) == (fm.KVSpec("none"),) * cfg.n_layer
    assert fm.KVSpec("sliding", 512).window == 512
    with pytest.raises(ValueError):
        fm.KVSpec("sliding")
    with pytest.raises(ValueError):
        fm.KVSpec("full", 4)


def test_unknown_architecture_names_the_families(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gptj")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError) as e:
        load_files(tmp_path / "x.gguf")
    assert str(e.value) == (f"{tmp_path / 'x.gguf'}: unknown model architecture 'gptj' (kvserve knows the "
                            "families llama (llama, mistral, qwen2), qwen3 (qwen3), qwen3moe (qwen3moe), "
                            "gemma2 (gemma2), gemma3 (gemma3), phi3 (phi3), mistral3 (mistral3), gpt-oss (gpt-oss, gptoss), bert (bert), nomic-bert (nomic-bert))")
    assert probe_task(tmp_path / "x.gguf") == "generate"  # left for the loader to report
    hf = tinymodel.write_tiny_hf_dir(tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as e:
        load_files(hf)
    assert str(e.value) == (
        f"{hf}: unknown model architecture ['GPTNeoXForCausalLM'] (kvserve knows the families llama "
        "(LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM), qwen3 (Qwen3ForCausalLM), qwen3moe "
        "(Qwen3MoeForCausalLM), gemma2 (Gemma2ForCausalLM), gemma3 (Gemma3ForCausalLM), phi3 (Phi3ForCausalLM), mistral3 (Ministral3ForCausalLM), "
        "gpt-oss (GptOssForCausalLM), bert (BertModel, "
        "BertForMaskedLM, BertForPreTraining, BertForSequenceClassification), nomic-bert (NomicBertModel))")
    with pytest.raises(ModelLoadError, match="unknown model architecture 'gptj'"):
        fm.family_of("gptj")


def test_readers_dispatch_by_family(tmp_path):
    hf = tinymodel.write_tiny_hf_dir(tmp_path / "hf", arch="Qwen2ForCausalLM")
    cfg = fm.read_hf_config(json.loads((hf / "config.json").read_text()), str(hf))
    assert cfg.arch == "qwen2" and cfg.qkv_bias
    assert fm.hf_task({"architectures": ["BertForSequenceClassification"]}, "x") == "score"
    assert fm.hf_task({"model_type": "bert"}, "x") == "embed"
    assert fm.gguf_task({"general.architecture": "bert"}, ["cls.output.weight"], "x") == "score"
    assert fm.gguf_task({"general.architecture": "bert"}, ["token_embd.weight"], "x") == "embed"
    assert fm.gguf_task({"general.architecture": "qwen2"}, [], "x") == "generate"
    md = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
          "llama.block_count": 2, "llama.feed_forward_length": 128}
    with pytest.raises(ModelLoadError, match="missing GGUF key 'llama.context_length'"):
        fm.read_gguf_config(md, "x.gguf")
