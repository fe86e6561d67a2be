"""Format detection (kvserve.loaders.detect): folders laid out as each engine's models are (a few
bytes per file) get their exact line on serve/run's resolution, load, create, /api/create and
show; a real GGUF and HF folder still load."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import tinymodel
from kvserve import cli
from kvserve.errors import InvalidInputError, NotSupportedError
from kvserve.loaders.detect import FORMATS, UnsupportedFormatError, detect, detect_files
from kvserve.loaders.weights import ModelLoadError
from kvserve.models.build import load_files
from kvserve.ollama.create import SAFETENSORS_UNSUPPORTED, iter_create, iter_create_modelfile
from kvserve.store import ModelNotFoundError, Store, resolve_model

COPY = "give kvserve a GGUF or HF safetensors copy"


def folder(root: Path, name: str, files: list[str], config: dict | None = None) -> Path:
    d = root / name
    d.mkdir(parents=True)
    for f in files:
        (d / f).write_bytes(b"abc")
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return d


#: name -> (files, config.json, the refusal after "PATH: ")
REFUSED = {
    "phi3-onnx": (["genai_config.json", "model.onnx", "model.onnx.data", "tokenizer.json", "tokenizer_config.json"],
                  None, "ONNX Runtime GenAI model folder (graph=yes, external weights=yes, tokenizer=yes): kvserve "
                        f"cannot run it; run it with onnxruntime-genai, or {COPY}"),
    "qwen-exl2": (["measurement.json", "output.safetensors", "tokenizer.json"],
                  {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64},
                  f"EXL2 model folder (measurement.json): kvserve cannot run it; run it with ExLlamaV2 (TabbyAPI), "
                  f"or {COPY}"),
    "qwen-exl3": (["model.safetensors"], {"architectures": ["Qwen2ForCausalLM"],
                                          "quantization_config": {"quant_method": "exl3", "bits": 4.0}},
                  f"EXL3 model folder (quant_method exl3): kvserve cannot run it; run it with ExLlamaV3 (TabbyAPI), "
                  f"or {COPY}"),
    "qwen3-4bit": (["model.safetensors", "tokenizer.json"],
                   {"model_type": "qwen3", "quantization": {"group_size": 64, "bits": 4}},
                   "MLX model folder (quantization bits 4, group_size 64): kvserve cannot run it; run it with "
                   f"mlx-lm (mlx_lm.server), LM Studio or Ollama on Apple Silicon, or {COPY}"),
    "llama-trt": (["rank0.engine", "rank1.engine"], {"pretrained_config": {"architecture": "LlamaForCausalLM"},
                                                     "build_config": {"max_batch_size": 8}},
                  "TensorRT-LLM engine folder (2 rank engine files, architecture LlamaForCausalLM): kvserve cannot "
                  "run it; run it with TensorRT-LLM (trtllm-serve) on the NVIDIA GPU it was built for, or give "
                  "kvserve the HF safetensors checkpoint it was built from, or a GGUF copy"),
    "plain-onnx": (["model.onnx", "tokenizer.json"], None,
                   "ONNX export without genai_config.json (1 .onnx file(s)): kvserve cannot run it; run it with "
                   f"ONNX Runtime (one forward pass at a time, no generation settings), or {COPY}"),
    "no-weights": (["tokenizer.json"], {"architectures": ["LlamaForCausalLM"]},
                   "HF folder without weights (config.json but no *.safetensors or pytorch_model*.bin): kvserve "
                   "cannot run it; give kvserve the folder with its weights files"),
    "empty": (["README.md"], None,
              "folder with no model kvserve recognizes (no config.json, .gguf or genai_config.json): kvserve "
              "cannot run it; give kvserve a .gguf file or an HF model folder (see the model card for its format)"),
}


@pytest.fixture
def refused(tmp_path) -> dict[str, Path]:
    return {name: folder(tmp_path / "m", name, files, cfg) for name, (files, cfg, _) in REFUSED.items()}


def test_each_format_gets_its_line_on_resolve_and_load(refused):
    for name, d in refused.items():
        line = f"{d}: {REFUSED[name][2]}"
        assert detect(d).refusal() == line
        if name not in ("no-weights", "empty"):  # not a model: resolve keeps its "not found" (below)
            with pytest.raises(UnsupportedFormatError) as e:
                resolve_model(str(d))  # serve, run and the draft model resolve here
            assert str(e.value) == line and e.value.message == line
            assert isinstance(e.value, NotSupportedError) and isinstance(e.value, ModelLoadError)
        with pytest.raises(UnsupportedFormatError) as e:
            load_files(d)  # every load (on-demand ones too) reads here
        assert str(e.value) == line
    assert resolve_model(str(refused["no-weights"])) == refused["no-weights"]  # the loader names what is missing
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(str(refused["empty"]))
    assert str(e.value) == (f"model directory {str(refused['empty'])!r} has no config.json (not an HF model "
                            "directory) and no .gguf file")


def test_mlx_community_naming_and_the_seed_order(tmp_path):
    d = folder(tmp_path / "mlx-community", "Qwen3-8B-bf16", ["model.safetensors"], {"architectures": ["Qwen3ForCausalLM"]})
    assert detect(d).format.key == "mlx" and detect(d).detail == "named 'mlx-community'"
    # the seed's rules on listings alone (004 Example 8): GGUF first, then genai_config, then EXL2
    assert detect_files(["qwen2.5-coder-7b-instruct-q4_k_m.gguf", "README.md"]).format.key == "gguf"
    assert detect_files(["config.json", "model-00001-of-00004.safetensors", "tokenizer.json"],
                        {"architectures": ["Qwen2ForCausalLM"]}).format.key == "safetensors"
    assert detect_files(["config.json", "measurement.json", "output.safetensors"], {}).format.key == "exl2"
    assert detect_files(["genai_config.json", "model.onnx", "model.onnx.data", "tokenizer.json"]).format.key \
        == "onnx-genai"
    assert detect_files(["config.json", "model.safetensors"], {"quantization_config": {"quant_method": "exl2"}}) \
        .format.key == "exl2"
    assert detect_files(["README.md"]).format is FORMATS["unknown"]


def test_hf_quantization_and_families(tmp_path):
    """002 Example 6: quantization_config's quant_method decides; kvserve's methods load, others
    are named (show), and the loader keeps its own message for them."""
    awq = folder(tmp_path, "awq", ["model.safetensors"], {"architectures": ["Qwen2ForCausalLM"],
                                                          "quantization_config": {"quant_method": "awq", "bits": 4,
                                                                                  "group_size": 128,
                                                                                  "version": "gemm"}})
    d = detect(awq)
    assert (d.format.key, d.detail, d.problem, d.loadable) == (
        "safetensors-quantized", "1 safetensors file, quant_method awq", "", True)
    bnb = folder(tmp_path, "bnb", ["model.safetensors"], {"architectures": ["LlamaForCausalLM"],
                                                          "quantization_config": {"quant_method": "bitsandbytes"}})
    d = detect(bnb)
    assert (d.format.key, d.problem, d.loadable) == (
        "safetensors-quantized", "quant_method 'bitsandbytes'; kvserve runs AWQ, GPTQ, FP8 and compressed-tensors",
        False)
    neox = folder(tmp_path, "neox", ["model.safetensors"], {"architectures": ["GPTNeoXForCausalLM"]})
    assert detect(neox).problem == "kvserve has no family for ['GPTNeoXForCausalLM']"
    assert resolve_model(str(neox)) == neox  # left for the loader, which names the families
    shards = folder(tmp_path, "bin", ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"],
                    {"architectures": ["LlamaForCausalLM"]})
    assert (detect(shards).format.key, detect(shards).detail, detect(shards).loadable) == (
        "pytorch-bin", "2 .bin files", True)


def test_a_real_gguf_and_hf_folder_still_load(tiny_gguf, tmp_path):
    g = detect(tiny_gguf)
    assert (g.format.key, g.detail, g.loadable, g.weights) == ("gguf", "architecture llama", True, tiny_gguf)
    assert load_files(tiny_gguf).config.n_layer == 2
    # a folder holding one model GGUF (and a projector) loads that file
    d = tmp_path / "gguf-folder"
    d.mkdir()
    os.link(tiny_gguf, d / "tiny-q8_0.gguf")
    (d / "mmproj-tiny-f16.gguf").write_bytes(b"GGUF")
    assert resolve_model(str(d)) == d / "tiny-q8_0.gguf"
    assert load_files(d).config.n_layer == 2
    os.link(tiny_gguf, d / "tiny-q4_0.gguf")  # two quantizations: which one?
    with pytest.raises(UnsupportedFormatError) as e:
        resolve_model(str(d))
    assert str(e.value) == (f"{d}: folder of GGUF files (mmproj-tiny-f16.gguf, tiny-q4_0.gguf, tiny-q8_0.gguf): "
                            "kvserve cannot run it (2 model GGUF files); give kvserve the path of the one to load")
    hf = tinymodel.write_tiny_hf_dir(tmp_path / "hf")
    h = detect(hf)
    assert (h.format.key, h.detail, h.problem) == ("safetensors", "1 safetensors file", "")
    assert resolve_model(str(hf)) == hf
    assert load_files(hf).config.n_layer == 2
    # the same weights as a PyTorch .bin folder load too (torch.load, weights only)
    import torch
    from safetensors.torch import load_file

    binned = tmp_path / "binned"
    binned.mkdir()
    for f in hf.iterdir():
        if f.suffix != ".safetensors":
            (binned / f.name).write_bytes(f.read_bytes())
    torch.save(load_file(str(hf / "model.safetensors")), binned / "pytorch_model.bin")
    assert detect(binned).format.key == "pytorch-bin"
    a, b = load_files(hf), load_files(binned)
    assert sorted(a.weights) == sorted(b.weights)
    name = sorted(a.weights)[0]
    assert (a.weights[name].to_dense() == b.weights[name].to_dense()).all()


def test_a_gguf_of_a_family_kvserve_lacks(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gptj")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    d = detect(tmp_path / "x.gguf")
    assert (d.format.key, d.problem, d.loadable) == ("gguf", "kvserve has no family for architecture 'gptj'", False)
    report = d.report()
    assert f"supervise    kvserve serve --engine 'NAME=llama-server -m {tmp_path / 'x.gguf'} --port {{port}}' " \
           "(when llama-server is installed)\n" in report
    # not a GGUF at all
    (tmp_path / "w.safetensors").write_bytes(b"abc")
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(str(tmp_path / "w.safetensors"))
    assert str(e.value) == (f"model file {str(tmp_path / 'w.safetensors')!r} is not a GGUF file (a safetensors "
                            "file: kvserve needs its HF folder (config.json, tokenizer))")
    with pytest.raises(ModelLoadError, match="not a GGUF file") as e:
        load_files(tmp_path / "w.safetensors")  # the GGUF loader names the magic
    assert not isinstance(e.value, UnsupportedFormatError)
    assert detect(tmp_path / "w.safetensors").refusal() == (
        f"{tmp_path / 'w.safetensors'}: file that is not GGUF (no GGUF magic) (a safetensors file: kvserve needs its "
        "HF folder (config.json, tokenizer)): kvserve cannot run it; give kvserve a .gguf file or an HF model folder")


# ------------------------------------------------------------------------------ create


def test_create_refuses_each_format_with_its_line(refused, tmp_path):
    store = Store(tmp_path / "store")
    for name in ("phi3-onnx", "qwen-exl2", "qwen-exl3", "qwen3-4bit", "llama-trt", "plain-onnx"):
        d = refused[name]
        with pytest.raises(UnsupportedFormatError) as e:
            list(iter_create_modelfile(store, "m", "FROM .\n", d))
        assert str(e.value) == f"{d}: {REFUSED[name][2]}"
    with pytest.raises(InvalidInputError, match="no GGUF files found in"):
        list(iter_create_modelfile(store, "m", "FROM .\n", refused["empty"]))
    assert store.get("m") is None


def test_api_create_files_listing_gets_the_line(tmp_path):
    """/api/create with files laid out as an ONNX Runtime GenAI folder (the blobs uploaded first)."""
    store = Store(tmp_path / "store")
    files = {n: store.write_blob_bytes(n.encode()).digest
             for n in ("genai_config.json", "model.onnx", "model.onnx.data", "tokenizer.json")}
    with pytest.raises(UnsupportedFormatError) as e:
        list(iter_create(store, {"model": "m", "files": files}))
    assert str(e.value) == ("ONNX Runtime GenAI model folder (graph=yes, external weights=yes, tokenizer=yes): "
                            f"kvserve cannot run it; run it with onnxruntime-genai, or {COPY}")
    cfg = store.write_blob_bytes(json.dumps({"model_type": "qwen3", "quantization": {"bits": 4, "group_size": 64}})
                                 .encode()).digest
    mlx = {"config.json": cfg, "model.safetensors": store.write_blob_bytes(b"st").digest}
    with pytest.raises(UnsupportedFormatError, match=r"^MLX model folder \(quantization bits 4, group_size 64\)"):
        list(iter_create(store, {"model": "m", "files": mlx}))
    hf = {"config.json": store.write_blob_bytes(b'{"architectures": ["LlamaForCausalLM"]}').digest,
          "model.safetensors": store.write_blob_bytes(b"st").digest}
    with pytest.raises(NotSupportedError) as e:
        list(iter_create(store, {"model": "m", "files": hf}))
    assert e.value.message == SAFETENSORS_UNSUPPORTED


# ------------------------------------------------------------------------------ CLI: show, run, create


@pytest.fixture
def no_server(monkeypatch, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("KVSERVE_HOST", f"127.0.0.1:{port}")
    monkeypatch.delenv("OLLAMA_HOST", raising=False)
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path / "home"))


def test_cli_show_run_and_create(refused, tiny_gguf, tmp_path, capsys, no_server):
    d = refused["phi3-onnx"]
    assert cli.main(["show", str(d)]) == 0
    out = capsys.readouterr().out
    assert out == (f"  path       {d}\n"
                   "  format     ONNX Runtime GenAI model folder [onnx-genai]\n"
                   "  detail     graph=yes, external weights=yes, tokenizer=yes\n"
                   "  engines    onnxruntime-genai\n"
                   f"  kvserve    refuses it: {COPY}\n")
    assert cli.main(["show", tiny_gguf]) == 0
    assert capsys.readouterr().out == (f"  path       {tiny_gguf}\n"
                                       "  format     GGUF file [gguf]\n"
                                       "  detail     architecture llama\n"
                                       "  engines    llama.cpp (llama-server), Ollama, LM Studio\n"
                                       f"  kvserve    loads it ({tiny_gguf})\n")
    e = refused["qwen-exl2"]
    assert cli.main(["run", str(e), "hi"]) == 1
    assert capsys.readouterr().err == f"Error: {e}: {REFUSED['qwen-exl2'][2]}\n"
    mf = tmp_path / "Modelfile"
    mf.write_text(f"FROM {refused['qwen3-4bit']}\n")
    assert cli.main(["create", "x", "-f", str(mf)]) == 1
    err = capsys.readouterr().err
    assert err.endswith(f"Error: {refused['qwen3-4bit']}: {REFUSED['qwen3-4bit'][2]}\n"), err


def test_on_demand_loads_by_path_get_the_line(refused, tmp_path):
    """A request naming a path (``--allow-model-paths``) resolves through ServerState: a format
    kvserve does not run gets its line (a NotSupportedError: 501 in every face), what is no model
    stays "not found"."""
    from kvserve.errors import NotFoundError
    from kvserve.serving.args import parse_args
    from kvserve.serving.state import ServerState

    state = ServerState(parse_args(["--allow-model-paths", "--no-preload", "--models-dir", str(tmp_path / "s")]))
    d = refused["qwen3-4bit"]
    with pytest.raises(UnsupportedFormatError) as e:
        state.resolve(str(d))
    assert e.value.message == f"{d}: {REFUSED['qwen3-4bit'][2]}" and e.value.kind == "not_supported"
    with pytest.raises(NotFoundError, match="not found"):
        state.resolve(str(refused["empty"]))
