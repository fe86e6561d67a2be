"""Breaker findings on format detection (issue 35's ``kvserve show PATH``).

``kvserve show ADAPTER.gguf`` (a llama.cpp LoRA adapter, ``general.type`` "adapter") answered
``kvserve    loads it (ADAPTER.gguf)``, but ``kvserve serve ADAPTER.gguf`` then stopped with
``missing GGUF key 'llama.embedding_length'``: an adapter is no model.
"""

from __future__ import annotations

import tinylora

from kvserve.loaders.detect import detect


def test_lora_adapter_gguf_is_not_reported_loadable(tmp_path):
    path = tinylora.write_gguf_adapter(tmp_path / "a.gguf")
    d = detect(path)
    assert d.loadable is False
    assert d.problem == "a LoRA adapter, not a model: give it to --lora (or --lora-modules, a Modelfile's " \
                        "ADAPTER) with its base model"
    assert f"  kvserve      refuses it ({d.problem}): give kvserve a GGUF of a family it knows\n" in d.report()
