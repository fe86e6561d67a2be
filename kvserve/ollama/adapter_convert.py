"""A PEFT LoRA directory as a llama.cpp LoRA GGUF: what ``ollama create`` stores for an ``ADAPTER``
that names a safetensors adapter (Ollama's ``convert.ConvertAdapter``: ``converting adapter``).

The store keeps one file per layer, and a GGUF adapter is what Ollama's registry carries and what
llama-server's ``--lora`` reads, so a PEFT directory is converted once, at create, against the base
model it is created on (its modules and shapes checked, :func:`kvserve.lora.load_adapter`), the way
llama.cpp's ``convert_lora_to_gguf.py`` writes it: ``general.type`` ``adapter``, ``adapter.type``
``lora``, ``adapter.lora.alpha``, float32 tensors ``blk.N.<proj>.weight.lora_a`` ``[r, in]`` and
``.lora_b`` ``[out, r]`` with lora_b's Q/K rows in the GGUF base's order. Where PEFT's scale differs
by module (``alpha_pattern``, rslora's ``alpha / sqrt(r)``), which one GGUF alpha cannot say, the
alpha written is 0 (llama.cpp: no rescaling) and each module's scale is folded into its lora_b.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

__all__ = ["peft_to_gguf"]


def peft_to_gguf(peft_dir: str | os.PathLike, base_config, out_path: str | os.PathLike) -> int:
    """Write the PEFT adapter ``peft_dir`` as a LoRA GGUF at ``out_path``; its rank.

    Args:
        base_config: the base model's ModelConfig (``kvserve.models.family.read_gguf_config``):
            the adapter is checked against its architecture and projection shapes.

    Raises:
        InvalidInputError: what :func:`kvserve.lora.load_adapter` refuses (naming the module).
    """
    import gguf

    from kvserve.lora import LoraBase, load_adapter
    from kvserve.lora.adapter import qk_row_order

    ad = load_adapter(str(peft_dir), LoraBase.of(base_config))
    uniform = not ad.use_rslora and all(math.isclose(m.scale, ad.alpha / m.rank, rel_tol=1e-12)
                                        for m in ad.modules.values())
    w = gguf.GGUFWriter(str(out_path), base_config.arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(ad.alpha) if uniform else 0.0)
    for mod in sorted(ad.modules, key=_module_order):
        m = ad.modules[mod]
        kind = mod.split(".", 2)[2]
        b = m.b.numpy()
        if kind in ("attn_q", "attn_k"):
            order = qk_row_order(base_config, kind, "gguf")
            if order is not None:  # kvserve's rows -> the GGUF file's rows
                b = b[np.argsort(order)]
        if not uniform:
            b = b * np.float32(m.scale)
        w.add_tensor(f"{mod}.weight.lora_a", np.ascontiguousarray(m.a.numpy(), dtype=np.float32))
        w.add_tensor(f"{mod}.weight.lora_b", np.ascontiguousarray(b, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ad.rank


def _module_order(mod: str) -> tuple[int, str]:
    layer, kind = mod.split(".")[1:3]
    return int(layer), kind


def is_peft_dir(path: str | os.PathLike) -> bool:
    """A directory holding ``adapter_config.json``."""
    return (Path(path) / "adapter_config.json").is_file()
