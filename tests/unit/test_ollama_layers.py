"""The Ollama face's model layers (kvserve/faces/ollama_api.py ``_layers``): a store model's params,
SYSTEM, MESSAGE and TEMPLATE layers, read once per manifest and read again when it changes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvserve import cli
from kvserve.faces import ollama_api as ollama
from kvserve.serving.manager import ModelSpec
from kvserve.store import Store


@pytest.fixture
def store(tmp_path, monkeypatch) -> Store:
    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    monkeypatch.setattr(ollama, "_LAYERS", {})
    return Store(tmp_path / "home" / "models")


def _create(store: Store, tmp_path, name: str, modelfile: str) -> None:
    mf = tmp_path / "Modelfile"
    mf.write_text(modelfile)
    assert cli.main(["create", name, "-f", str(mf), "--models-dir", str(store.root)]) == 0


def test_layers_are_read_once_per_manifest(store, tiny_gguf, tmp_path, monkeypatch):
    state = SimpleNamespace(args=SimpleNamespace(models_dir=str(store.root)))
    _create(store, tmp_path, "layered", f'FROM {tiny_gguf}\nSYSTEM "Be terse."\nPARAMETER top_k 7\n'
                                        "MESSAGE user hi\nMESSAGE assistant yo\n")
    path = str(store.require("layered").model_path)
    reads: list[str] = []
    real = Store.layer_bytes

    def counted(self, name, kind):
        reads.append(kind)
        return real(self, name, kind)

    monkeypatch.setattr(Store, "layer_bytes", counted)
    first = ollama._layers(state, ModelSpec("layered", path))
    assert (first.params, first.system, first.messages, first.template) == (
        {"top_k": 7}, "Be terse.", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], None)
    assert first.stored.display == "layered:latest"
    assert sorted(reads) == ["messages", "params", "system", "template"]
    again = ollama._layers(state, ModelSpec("layered", path))
    assert (again.params, again.system, again.messages) == (first.params, first.system, first.messages)
    assert len(reads) == 4  # the same manifest: no blob read again
    _create(store, tmp_path, "layered", f'FROM {tiny_gguf}\nSYSTEM "Be kind."\nPARAMETER top_k 3\n')
    changed = ollama._layers(state, ModelSpec("layered", path))
    assert (changed.params, changed.system, changed.messages) == ({"top_k": 3}, "Be kind.", [])
    assert len(reads) == 8
