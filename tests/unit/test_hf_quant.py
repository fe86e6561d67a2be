"""Quantized HF checkpoints (kvserve.loaders.hf_quant): AWQ, GPTQ, compressed-tensors, FP8.

Each test writes a tiny llama directory (tests/tinymodel.py), quantizes its seven projections
per group of inputs, stores them in the format's layout (AWQ's interleaved nibbles, GPTQ's
input-packed words with zero - 1, compressed-tensors' own ``pack_to_int32``), and writes a
second, float directory holding exactly what those integers dequantize to. The loader must give
the same float32 weights bit for bit, keep 4-bit groups packed (``Weight.q4``), and serve them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import tinymodel as tm
from kvserve.loaders.hf_quant import AWQ_ORDER, read_scheme
from kvserve.loaders.safetensors import load_hf_dir
from kvserve.loaders.weights import ModelLoadError

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")


def _quantize(w: np.ndarray, group: int, bits: int = 4, sym: bool = False, seed: int = 0):
    """(q uint [out, in], scale float16-exact float32 [out, groups], z int [out, groups])."""
    out, inp = w.shape
    g = group or inp
    top = (1 << bits) - 1
    wg = w.reshape(out, inp // g, g)
    if sym:
        scale = np.abs(wg).max(-1) / (top // 2)
        z = np.full(scale.shape, (top + 1) // 2, dtype=np.int64)
    else:
        lo, hi = wg.min(-1), wg.max(-1)
        scale = (hi - lo) / top
        z = np.clip(np.round(-lo / scale), 0, top).astype(np.int64)
    scale = scale.astype(np.float16).astype(np.float32)
    q = np.clip(np.round(wg / scale[..., None]) + z[..., None], 0, top).astype(np.int64)
    return q.reshape(out, inp), scale, z


def _dequant(q, scale, z, group):
    out, inp = q.shape
    g = group or inp
    w = (q.reshape(out, inp // g, g).astype(np.float32) - z[..., None].astype(np.float32)) * scale[..., None]
    return w.reshape(out, inp)


def _pack_along(values: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """uint values -> int32 words, 32 / bits per word along ``axis`` (value i at bits i * bits;
    ``order[i]``: which of the word's values goes to slot i)."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint64), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, per)
    if order is not None:
        v = v[..., list(order)]
    word = np.zeros(v.shape[:-1], dtype=np.uint64)
    for i in range(per):
        word |= v[..., i] << np.uint64(i * bits)
    return np.moveaxis(word.astype(np.uint32).view(np.int32), -1, axis)


def _awq_parts(w, group):
    q, s, z = _quantize(w, group)
    parts = {"qweight": _pack_along(q.T, 4, 1, AWQ_ORDER), "qzeros": _pack_along(z.T, 4, 1, AWQ_ORDER),
             "scales": s.T.astype(np.float16)}
    return parts, _dequant(q, s, z, group)


def _gptq_parts(w, group, v1=True, act_order=False, bits=4, seed=0):
    out, inp = w.shape
    g = group or inp
    if not act_order:
        q, s, z = _quantize(w, group, bits)
        g_idx = np.arange(inp) // g
        ref = _dequant(q, s, z, group)
    else:  # each input in a group of a random assignment (desc_act)
        rng = np.random.RandomState(seed)
        g_idx = rng.permutation(np.arange(inp) // g)
        order = np.argsort(g_idx, kind="stable")
        qs, s, z = _quantize(w[:, order], group, bits)
        q = np.empty_like(qs)
        q[:, order] = qs
        ref = (q.astype(np.float32) - z[:, g_idx]) * s[:, g_idx]
    parts = {"qweight": _pack_along(q.T, bits, 0), "qzeros": _pack_along(z.T - (1 if v1 else 0), bits, 1),
             "scales": s.T.astype(np.float16), "g_idx": g_idx.astype(np.int32)}
    return parts, ref.astype(np.float32)


def _ct_parts(w, group, sym):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q, s, z = _quantize(w, group, sym=sym)
    parts = {"weight_packed": pack_to_int32(torch.from_numpy((q - 8).astype(np.int8)), 4).numpy(),
             "weight_scale": s.astype(np.float16), "weight_shape": np.array(w.shape, dtype=np.int64)}
    if not sym:
        parts["weight_zero_point"] = pack_to_int32(torch.from_numpy((z - 8).astype(np.int8)), 4, packed_dim=0).numpy()
    return parts, _dequant(q, s, z, group)


def _fp8_parts(w, per_channel):
    scale = (np.abs(w).max(axis=1, keepdims=True) if per_channel else np.abs(w).max().reshape(1)) / 448.0
    q = torch.from_numpy(w / scale).to(torch.float8_e4m3fn)
    ref = q.to(torch.float32).numpy() * scale
    return {"weight": q, "weight_scale": torch.from_numpy(scale.astype(np.float32))}, ref.astype(np.float32)


QUANT_CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False},
    "gptq_v2": {"quant_method": "gptq", "bits": 4, "group_size": 64, "checkpoint_format": "gptq_v2"},
    "gptq_act_order": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True},
    "gptq_8bit": {"quant_method": "gptq", "bits": 8, "group_size": 32},
    "ct_int4_sym": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                           "group_size": 32}}}, "ignore": ["lm_head"]},
    "ct_int4_asym_channel": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": False,
                                                       "strategy": "channel"}}}},
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"},
}


def _parts(kind: str, w: np.ndarray):
    if kind == "awq":
        return _awq_parts(w, 32)
    if kind == "gptq":
        return _gptq_parts(w, 32)
    if kind == "gptq_v2":
        return _gptq_parts(w, 64, v1=False)
    if kind == "gptq_act_order":
        return _gptq_parts(w, 32, act_order=True)
    if kind == "gptq_8bit":
        return _gptq_parts(w, 32, bits=8)
    if kind == "ct_int4_sym":
        return _ct_parts(w, 32, sym=True)
    if kind == "ct_int4_asym_channel":
        return _ct_parts(w, 0, sym=False)
    return _fp8_parts(w, per_channel=True)


def write_quant_pair(root: Path, kind: str) -> tuple[Path, Path]:
    """(quantized dir, float dir of its dequantized values) of the same tiny llama."""
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    base = tm.write_tiny_hf_dir(root / "base", seed=3)
    tensors = load_file(str(base / "model.safetensors"))
    quant: dict[str, torch.Tensor] = {}
    ref: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        prefix = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and prefix.split("layers.")[-1].split(".", 1)[-1] in PROJ:
            parts, deq = _parts(kind, value)
            for leaf, v in parts.items():
                quant[f"{prefix}.{leaf}"] = v if isinstance(v, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(v))
            ref[name] = deq
        else:
            quant[name] = torch.from_numpy(value)
            ref[name] = value
    qdir, fdir = root / kind, root / f"{kind}-float"
    for d in (qdir, fdir):
        shutil.copytree(base, d)
        (d / "model.safetensors").unlink()
    save_file(quant, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    save_file({k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in ref.items()},
              str(fdir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"] = QUANT_CONFIGS[kind]
    (qdir / "config.json").write_text(json.dumps(cfg))
    return qdir, fdir


@pytest.mark.parametrize("kind", list(QUANT_CONFIGS))
def test_weights_are_the_checkpoints_values(tmp_path, kind):
    qdir, fdir = write_quant_pair(tmp_path, kind)
    got, want = load_hf_dir(qdir), load_hf_dir(fdir)
    assert sorted(got.weights) == sorted(want.weights)
    packed = 0
    for name, w in want.weights.items():
        np.testing.assert_array_equal(got.weights[name].to_dense(), w.to_dense(), err_msg=name)
        packed += got.weights[name].q4 is not None
    # 4-bit groups of whole 32-input blocks stay packed: 7 projections x 2 layers
    four_bit_blocks = kind in ("awq", "gptq", "gptq_v2", "ct_int4_sym", "ct_int4_asym_channel")
    assert packed == (14 if four_bit_blocks else 0)
    label = read_scheme(json.loads((qdir / "config.json").read_text()), str(qdir)).label
    assert got.info.ftype == label
    assert got.info.n_params == want.info.n_params


def test_a_packed_checkpoint_serves(tmp_path):
    """An AWQ directory through kvserve.LLM runs on the 4-bit kernel (no float weights kept for
    small batches) and, greedy, starts as its float twin does (the kernels round differently,
    so only the first tokens are compared)."""
    from kvserve import LLM, SamplingParams

    qdir, fdir = write_quant_pair(tmp_path, "awq")
    llm = LLM(str(qdir))
    lin = llm.core.runner.model.layers[0].wqkv
    assert lin.kernel == "int4" and lin.packed is not None
    greedy = SamplingParams(temperature=0, n_predict=12)
    out = llm.generate("the cat is on the", greedy)[0]
    assert len(out.token_ids) == 12
    ref = LLM(str(fdir)).generate("the cat is on the", greedy)[0]
    assert out.token_ids[:4] == ref.token_ids[:4]


def test_missing_part_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    qdir, _ = write_quant_pair(tmp_path, "awq")
    t = load_file(str(qdir / "model.safetensors"))
    del t["model.layers.1.mlp.up_proj.qzeros"]
    save_file(t, str(qdir / "model.safetensors"))
    with pytest.raises(ModelLoadError) as e:
        load_hf_dir(qdir)
    assert str(e.value) == (f"{qdir}: quantized layer 'model.layers.1.mlp.up_proj' lacks "
                            "'model.layers.1.mlp.up_proj.qzeros' (awq)")


def test_wrong_shapes_are_a_load_error(tmp_path):
    from safetensors.torch import load_file, save_file

    qdir, _ = write_quant_pair(tmp_path, "gptq")
    t = load_file(str(qdir / "model.safetensors"))
    t["model.layers.0.self_attn.o_proj.scales"] = t["model.layers.0.self_attn.o_proj.scales"][:1]
    save_file(t, str(qdir / "model.safetensors"))
    with pytest.raises(ModelLoadError) as e:
        load_hf_dir(qdir)
    assert "model.layers.0.self_attn.o_proj" in str(e.value)


@pytest.mark.parametrize(("quant", "text"), [
    ({"quant_method": "awq", "bits": 4, "version": "exllama"}, "AWQ checkpoint with version 'exllama' (gemm)"),
    ({"quant_method": "awq", "bits": 8}, "AWQ checkpoint with bits 8 (4)"),
    ({"quant_method": "gptq", "bits": 2}, "GPTQ checkpoint with bits 2 (4 or 8)"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "GPTQ checkpoint with checkpoint_format "
     "'marlin' (gptq, gptq_v2)"),
    ({"quant_method": "compressed-tensors", "format": "sparse-24-bitmask", "config_groups": {}},
     "compressed-tensors checkpoint with format 'sparse-24-bitmask'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 2, "type": "int"}}}}, "compressed-tensors checkpoint with int weights of 2 bits"),
    ({"quant_method": "hqq"}, "quant_method 'hqq'"),
])
def test_unsupported_variants_are_named(quant, text):
    with pytest.raises(ModelLoadError) as e:
        read_scheme({"quantization_config": quant}, "/m")
    assert text in str(e.value)


def test_no_quantization_config_is_none():
    assert read_scheme({"architectures": ["LlamaForCausalLM"]}, "/m") is None
