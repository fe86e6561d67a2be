"""Breaker findings on LoRA adapter paths (issue 34's bad input).

``POST /v1/load_lora_adapter {"lora_name": "x", "lora_path": "/tmp/f.gguf"}`` with a FIFO at that
path hung the request (curl gave up after 25 s) and every later adapter load and every request for
an adapter that had to load (the loads are serialised) hung behind it; the base model kept
answering. The same for ``/dev/stdin`` and other character devices.
"""

from __future__ import annotations

import os
import threading

import pytest

from kvserve.errors import InvalidInputError
from kvserve.lora import load_adapter
from kvserve.lora.adapter import LoraBase


def _load_bounded(path: str, seconds: float = 5.0):
    """load_adapter(path) in a thread: ("raised", exc) / ("returned", ad) / ("hung", None)."""
    out: list = []

    def run():
        try:
            out.append(("returned", load_adapter(path, LoraBase("llama", None))))
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out.append(("raised", e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return out[0] if out else ("hung", None)


def test_fifo_adapter_path_is_refused_at_once(tmp_path):
    fifo = tmp_path / "a.gguf"
    os.mkfifo(fifo)
    try:
        kind, e = _load_bounded(str(fifo))
    finally:  # unblock a reader stuck in open() so the thread ends
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    assert kind == "raised" and isinstance(e, InvalidInputError), (kind, e)
    assert str(e) == f"LoRA adapter {fifo}: not a regular file or a directory"


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/null"])
def test_device_adapter_path_is_refused(path):
    kind, e = _load_bounded(path)
    assert kind == "raised" and isinstance(e, InvalidInputError), (kind, e)
    assert str(e) == f"LoRA adapter {path}: not a regular file or a directory"


def test_runtime_adapter_cannot_take_the_base_models_name(tmp_path, monkeypatch):
    """Found by hand: ``load_lora_adapter {"lora_name": "tiny", "lora_path": A}`` on a server of
    base ``tiny`` answered 200, ``/v1/models`` then listed ``tiny`` twice, and ``model: "tiny"``
    got the adapter's logprob (-3.2077) instead of the base's (-3.5826) for every client. Now a 400
    (LoraModules.load refuses a served model's name)."""
    import tinylora
    import tinymodel
    from servers import app_client

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    base = tinymodel.write_tiny_gguf(tmp_path / "base.gguf")
    ad = tinylora.write_gguf_adapter(tmp_path / "a.gguf", seed=2)
    c = app_client(base, tmp_path, "--enable-lora")
    try:
        def first_logprob():
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hello world", "max_tokens": 1,
                                                "temperature": 0, "logprobs": 1})
            return r.json()["choices"][0]["logprobs"]["token_logprobs"][0]

        before = first_logprob()
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "tiny", "lora_path": str(ad)})
        ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert first_logprob() == before
        assert ids.count("tiny") == 1
        assert r.status_code == 400, r.text
    finally:
        c.portal.call(c.state.manager.shutdown)
        c.__exit__(None, None, None)
