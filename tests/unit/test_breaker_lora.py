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
