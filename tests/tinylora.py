"""Tiny random LoRA adapters for the tiny models of :mod:`tinymodel`, in both layouts, and their merge.

* :func:`lora_weights` draws one adapter's A/B in HF layout (PEFT's names and shapes: lora_A
  ``[r, in]``, lora_B ``[out, r]``; q/k rows in HF's NEOX order) from ``RandomState(seed)``. Unlike
  PEFT's init (B = 0) both are random, so the adapter changes the model.
* :func:`write_peft_adapter` writes them as a PEFT directory (``adapter_config.json`` with ``r``,
  ``lora_alpha``, ``target_modules``, ``use_rslora``, ``rank_pattern`` / ``alpha_pattern``;
  ``adapter_model.safetensors`` with ``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``).
* :func:`write_gguf_adapter` writes the same adapter as llama.cpp's ``convert_lora_to_gguf.py`` would:
  ``general.type`` "adapter", ``adapter.type`` "lora", ``adapter.lora.alpha``, tensors
  ``blk.N.attn_q.weight.lora_a`` / ``.lora_b``, with lora_b's q/k rows permuted for arch llama (the
  converter runs the base model's ``permute`` on B).
* :func:`write_merged_hf_dir` writes the base model with the adapters merged in float32
  (``W + scale * B @ A`` per module, scales as PEFT computes them): the reference the tests compare with.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

import tinymodel

#: PEFT module name -> (HF tensor path in a layer, GGUF name)
MODULES = {
    "q_proj": ("self_attn.q_proj", "attn_q"), "k_proj": ("self_attn.k_proj", "attn_k"),
    "v_proj": ("self_attn.v_proj", "attn_v"), "o_proj": ("self_attn.o_proj", "attn_output"),
    "gate_proj": ("mlp.gate_proj", "ffn_gate"), "up_proj": ("mlp.up_proj", "ffn_up"),
    "down_proj": ("mlp.down_proj", "ffn_down"),
}
ALL = tuple(MODULES)


def _shapes(n_embd: int, n_head: int, n_head_kv: int, n_ff: int) -> dict[str, tuple[int, int]]:
    hd = n_embd // n_head
    return {"q_proj": (n_head * hd, n_embd), "k_proj": (n_head_kv * hd, n_embd), "v_proj": (n_head_kv * hd, n_embd),
            "o_proj": (n_embd, n_head * hd), "gate_proj": (n_ff, n_embd), "up_proj": (n_ff, n_embd),
            "down_proj": (n_embd, n_ff)}


def lora_weights(*, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2, n_ff: int = 128,
                 rank: int = 8, targets=ALL, seed: int = 0, rank_pattern: dict | None = None,
                 std: float = 0.05) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """(layer, PEFT module name) -> (A [r, in], B [out, r]) float32, HF layout. ``rank_pattern``:
    PEFT module name -> its rank (else ``rank``)."""
    rng = np.random.RandomState(1000 + seed)
    shapes = _shapes(n_embd, n_head, n_head_kv, n_ff)
    out = {}
    for i in range(n_layer):
        for m in targets:
            r = (rank_pattern or {}).get(m, rank)
            o, n = shapes[m]
            a = (std * rng.standard_normal((r, n))).astype(np.float32)
            b = (std * rng.standard_normal((o, r))).astype(np.float32)
            out[(i, m)] = (a, b)
    return out


def peft_scale(m: str, rank: int, alpha: float, use_rslora: bool = False, rank_pattern: dict | None = None,
               alpha_pattern: dict | None = None) -> float:
    """PEFT's scaling of module ``m``: alpha / r, or alpha / sqrt(r) with rslora."""
    r = (rank_pattern or {}).get(m, rank)
    a = (alpha_pattern or {}).get(m, alpha)
    return a / math.sqrt(r) if use_rslora else a / r


def write_peft_adapter(path, *, rank: int = 8, alpha: float = 16.0, targets=ALL, seed: int = 0,
                       use_rslora: bool = False, rank_pattern: dict | None = None, alpha_pattern: dict | None = None,
                       base_model_name: str = "tiny", **shape) -> Path:
    """Write a PEFT LoRA directory; returns it. ``shape``: n_layer, n_embd, n_head, n_head_kv, n_ff."""
    from safetensors.numpy import save_file

    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    w = lora_weights(rank=rank, targets=targets, seed=seed, rank_pattern=rank_pattern, **shape)
    tensors = {}
    for (i, m), (a, b) in w.items():
        p = f"base_model.model.model.layers.{i}.{MODULES[m][0]}"
        tensors[p + ".lora_A.weight"] = a
        tensors[p + ".lora_B.weight"] = b
    save_file(tensors, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name, "r": rank,
           "lora_alpha": alpha, "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none",
           "use_rslora": use_rslora, "rank_pattern": rank_pattern or {}, "alpha_pattern": alpha_pattern or {},
           "fan_in_fan_out": False, "use_dora": False, "modules_to_save": None}
    (d / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return d


def write_gguf_adapter(path, *, arch: str = "llama", rank: int = 8, alpha: float = 16.0, targets=ALL, seed: int = 0,
                       n_head: int = 4, n_head_kv: int = 2, qtype: str = "F32", task_name: str | None = None,
                       prompt_prefix: str | None = None, **shape) -> Path:
    """Write a llama.cpp LoRA GGUF (as convert_lora_to_gguf.py does); returns its path. ``qtype``:
    "F32", "F16" (the converter's default outtype) or "Q8_0"."""
    import gguf

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    w = lora_weights(rank=rank, targets=targets, seed=seed, n_head=n_head, n_head_kv=n_head_kv, **shape)
    wr = gguf.GGUFWriter(p, arch)
    wr.add_type(gguf.GGUFType.ADAPTER)
    wr.add_string(gguf.Keys.Adapter.TYPE, "lora")
    wr.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    if task_name is not None:
        wr.add_string("adapter.lora.task_name", task_name)
    if prompt_prefix is not None:
        wr.add_string("adapter.lora.prompt_prefix", prompt_prefix)
    for (i, m), (a, b) in w.items():
        g = MODULES[m][1]
        if arch == "llama" and m in ("q_proj", "k_proj"):
            b = tinymodel.permute_qk(b, n_head if m == "q_proj" else n_head_kv)
        for suffix, t in (("lora_a", a), ("lora_b", b)):
            name = f"blk.{i}.{g}.weight.{suffix}"
            if qtype == "F32":
                wr.add_tensor(name, np.ascontiguousarray(t))
            elif qtype == "F16":
                wr.add_tensor(name, np.ascontiguousarray(t.astype(np.float16)))
            else:
                q = gguf.quants.quantize(np.ascontiguousarray(t), gguf.GGMLQuantizationType[qtype])
                wr.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType[qtype])
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return p


def write_merged_hf_dir(path, adapters: list[tuple[dict, float]], *, seed: int = 0, arch: str = "LlamaForCausalLM",
                        qtype: str = "F32", **shape) -> Path:
    """The tiny HF model of ``seed`` / ``shape`` (tinymodel.write_tiny_hf_dir) with each adapter merged:
    ``adapters`` holds (keyword arguments of :func:`lora_weights` plus ``alpha``, ``use_rslora``,
    ``alpha_pattern``; the user scale) pairs; every module gets ``W + user_scale * peft_scale * B @ A``
    in float64, stored float32. ``qtype``: the base's quantization (its dequantized values)."""
    from safetensors.numpy import load_file, save_file

    d = tinymodel.write_tiny_hf_dir(path, arch=arch, seed=seed, qtype=qtype, **shape)
    st = d / "model.safetensors"
    tensors = {k: v.astype(np.float64) for k, v in load_file(str(st)).items()}
    for kw, user_scale in adapters:
        kw = dict(kw)
        alpha = kw.pop("alpha", 16.0)
        rslora = kw.pop("use_rslora", False)
        apat = kw.pop("alpha_pattern", None)
        rank = kw.get("rank", 8)
        rpat = kw.get("rank_pattern")
        for (i, m), (a, b) in lora_weights(**shape, **kw).items():
            s = user_scale * peft_scale(m, rank, alpha, rslora, rpat, apat)
            tensors[f"model.layers.{i}.{MODULES[m][0]}.weight"] += s * (b.astype(np.float64) @ a.astype(np.float64))
    save_file({k: np.ascontiguousarray(v.astype(np.float32)) for k, v in tensors.items()}, str(st),
              metadata={"format": "pt"})
    return d

def run_capture(core, reqs):
    """Step an EngineCore until every request (kvserve.engine.request.Request) finished. Returns (tokens by request id, logits by request id: one
    float32 row per sampled token, the steps' LoRA batches (None for base-only steps), the number of
    steps)."""
    logits: dict[str, list] = {r.request_id: [] for r in reqs}
    toks: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    batches = []
    run = core.runner.run

    def spy(batch):
        out = run(batch)
        batches.append(batch.lora)
        for k, ci in enumerate(batch.sample_ci):
            logits[batch.chunks[ci].request.request_id].append(out[k].detach().float().clone())
        return out

    core.runner.run = spy
    try:
        for r in reqs:
            core.add_request(r)
        done: set[str] = set()
        steps = 0
        while len(done) < len(reqs):
            for o in core.step():
                toks[o.request_id].extend(o.new_token_ids)
                if o.finished:
                    done.add(o.request_id)
            steps += 1
            assert steps < 2000
    finally:
        core.runner.run = run
    return toks, logits, batches, steps
