"""Reading LoRA adapters (PEFT directories, llama.cpp LoRA GGUF) and checking them against a base.

Module names are kvserve's (GGUF) projection names without ``.weight``: ``blk.N.attn_q``,
``attn_k``, ``attn_v``, ``attn_output``, ``ffn_gate``, ``ffn_up``, ``ffn_down``. A's and B's rows are
in the base model's layout: where kvserve permutes a family's Q/K rows to interleaved pairs at
load (kvserve.loaders.weights.interleave_qk, phi3's rotary_order), B's rows of ``attn_q`` /
``attn_k`` are permuted the same way (W' = P W, so P (W + B A) = W' + (P B) A).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvserve.errors import InvalidInputError

#: the projections an adapter may target, in a layer's order
TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
#: fused tensors of some files (phi3): their B rows split into these modules, A shared
FUSED = {"attn_qkv": ("attn_q", "attn_k", "attn_v"), "ffn_gate_up": ("ffn_gate", "ffn_up")}

_LAYER = re.compile(r"blk\.(\d+)\.([a-z_0-9]+)$")


@dataclass(slots=True)
class LoraModule:
    """One target projection's low-rank update: delta W = scale * B @ A.

    Attributes:
        a: float32 [r, in_features].
        b: float32 [out_features, r] (rows in the base model's layout).
        scale: the module's own factor: alpha / r, alpha / sqrt(r) with rslora (PEFT), alpha / r or
            1 where alpha is 0 (llama.cpp GGUF).
    """

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(slots=True)
class LoraAdapter:
    """A loaded LoRA adapter, checked against its base model.

    Attributes:
        name: the name it is served under (default: the file or directory name without suffix).
        path: where it was read from (as given).
        format: "peft" or "gguf".
        rank: the largest rank of its modules (tokens of nothing: a count of columns of A's rows).
        alpha: ``lora_alpha`` (PEFT) / ``adapter.lora.alpha`` (GGUF).
        base_arch: the GGUF architecture of the base it was checked against ("llama", "qwen3", ...).
        target_modules: the projection kinds it touches (a sorted tuple of :data:`TARGETS` names).
        modules: module name ("blk.N.attn_q") -> LoraModule.
        use_rslora: PEFT's rank-stabilized scaling (alpha / sqrt(r)).
        task_name, prompt_prefix: llama.cpp's ``adapter.lora.task_name`` / ``prompt_prefix`` GGUF keys
            ("" when absent), shown by ``GET /lora-adapters``.
        base_model_name: PEFT's ``base_model_name_or_path`` ("" when absent): informational only.
    """

    name: str
    path: str
    format: str
    rank: int
    alpha: float
    base_arch: str
    target_modules: tuple[str, ...]
    modules: dict[str, LoraModule]
    use_rslora: bool = False
    task_name: str = ""
    prompt_prefix: str = ""
    base_model_name: str = ""

    @property
    def nbytes(self) -> int:
        """Bytes of its A and B tensors (float32)."""
        return sum(m.a.numel() * 4 + m.b.numel() * 4 for m in self.modules.values())


@dataclass(slots=True)
class LoraBase:
    """What an adapter is checked against: the base model's architecture and projection shapes.

    Attributes:
        arch: GGUF ``general.architecture`` of the base.
        config: its ModelConfig (n_layer, n_head, head_dim, ...).
        shapes: module name ("blk.N.attn_q") -> (out_features, in_features) of every projection a
            LoRA may target (MoE layers have no ffn_* entries).
    """

    arch: str
    config: Any
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, base) -> "LoraBase":
        """A LoraBase from a LoraBase, a model (LlamaModel or a family built on it), an object with
        ``.model`` (an EngineCore, a ModelRunner), or a bare ModelConfig (shapes from its sizes).

        Raises InvalidInputError when ``base`` is none of these."""
        if isinstance(base, LoraBase):
            return base
        model = getattr(base, "model", None)
        if model is not None and hasattr(model, "layers"):
            base = model
        if hasattr(base, "layers") and hasattr(base, "config"):
            return cls(base.config.arch, base.config, model_shapes(base))
        if hasattr(base, "arch") and hasattr(base, "n_layer"):
            return cls(base.arch, base, config_shapes(base))
        raise InvalidInputError(f"LoRA: cannot check an adapter against {type(base).__name__}")


def model_shapes(model) -> dict[str, tuple[int, int]]:
    """Module name -> (out, in) of every LoRA target of a built model (its fused Linears cut into
    q/k/v and gate/up)."""
    c = model.config
    q, kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    shapes: dict[str, tuple[int, int]] = {}
    for i, layer in enumerate(model.layers):
        p = f"blk.{i}."
        qkv = getattr(layer, "wqkv", None)
        if qkv is not None:
            kvs = (qkv.out_features - q) // 2
            for name, n in (("attn_q", q), ("attn_k", kvs), ("attn_v", kvs)):
                shapes[p + name] = (n, qkv.in_features)
        wo = getattr(layer, "wo", None)
        if wo is not None:
            shapes[p + "attn_output"] = (wo.out_features, wo.in_features)
        gu = getattr(layer, "w_gate_up", None)
        if gu is not None:
            shapes[p + "ffn_gate"] = shapes[p + "ffn_up"] = (gu.out_features // 2, gu.in_features)
        down = getattr(layer, "w_down", None)
        if down is not None:
            shapes[p + "ffn_down"] = (down.out_features, down.in_features)
    del kv
    return shapes


def config_shapes(c) -> dict[str, tuple[int, int]]:
    """Module name -> (out, in) from a ModelConfig's sizes (a dense llama block)."""
    q, kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    shapes = {}
    for i in range(c.n_layer):
        p = f"blk.{i}."
        shapes.update({p + "attn_q": (q, c.n_embd), p + "attn_k": (kv, c.n_embd), p + "attn_v": (kv, c.n_embd),
                       p + "attn_output": (c.n_embd, q), p + "ffn_gate": (c.n_ff, c.n_embd),
                       p + "ffn_up": (c.n_ff, c.n_embd), p + "ffn_down": (c.n_embd, c.n_ff)})
    return shapes


def load_adapter(path: str, base, name: str | None = None) -> LoraAdapter:
    """Read a LoRA adapter and check it against ``base``.

    Args:
        path: a PEFT directory (``adapter_config.json`` and ``adapter_model.safetensors`` or
            ``adapter_model.bin``) or a llama.cpp LoRA GGUF file.
        base: what :meth:`LoraBase.of` takes (a model, an EngineCore / ModelRunner, a ModelConfig).
        name: the adapter's name (default: the path's last component without ``.gguf``).

    Raises:
        InvalidInputError: a missing file, a FIFO or device, a file that is neither format, a GGUF that is not a LoRA
            adapter (``general.type`` / ``adapter.type``), another architecture than the base's, a
            module the base does not have, a shape that does not match (the message names the
            module), a target kvserve does not apply (embeddings, the output head, MoE experts,
            DoRA), non-finite weights.
    """
    b = LoraBase.of(base)
    p = Path(path)
    if not p.exists():
        raise InvalidInputError(f"LoRA adapter not found: {path}")
    if not p.is_dir() and not p.is_file():  # a FIFO would block the read forever; devices are no adapters
        raise InvalidInputError(f"LoRA adapter {path}: not a regular file or a directory")
    if name is None:
        name = p.name[:-5] if p.name.endswith(".gguf") else p.name
    try:
        if p.is_dir():
            ad = _load_peft(p, b, name)
        else:
            ad = _load_gguf(p, b, name)
    except InvalidInputError:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise InvalidInputError(f"LoRA adapter {path}: cannot read it: {e}") from e
    ad.path = str(path)
    return ad


# -- PEFT --------------------------------------------------------------------------------------------

def _pattern_value(pattern: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the module's HF name
    (a full match of ``(.*\\.)?key``), else ``default``."""
    for key, value in (pattern or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def _read_peft_tensors(d: Path) -> dict[str, torch.Tensor]:
    st = d / "adapter_model.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(str(st))
    bin_ = d / "adapter_model.bin"
    if bin_.is_file():
        return torch.load(str(bin_), map_location="cpu", weights_only=True)
    raise InvalidInputError(f"LoRA adapter {d}: no adapter_model.safetensors (or adapter_model.bin)")


def _load_peft(d: Path, base: LoraBase, name: str) -> LoraAdapter:
    from kvserve.models.family import family_of

    cfg_path = d / "adapter_config.json"
    if not cfg_path.is_file():
        raise InvalidInputError(f"LoRA adapter {d}: not a PEFT adapter directory (no adapter_config.json)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise InvalidInputError(f"LoRA adapter {cfg_path}: invalid JSON: {e}") from e
    ptype = str(cfg.get("peft_type", "LORA")).upper()
    if ptype != "LORA":
        raise InvalidInputError(f"LoRA adapter {d}: peft_type {ptype} is not LORA")
    if cfg.get("use_dora"):
        raise InvalidInputError(f"LoRA adapter {d}: DoRA adapters (use_dora) are not supported")
    if cfg.get("modules_to_save"):
        raise InvalidInputError(f"LoRA adapter {d}: modules_to_save {cfg['modules_to_save']} (full copies of "
                                "modules) is not supported")
    if cfg.get("fan_in_fan_out"):
        raise InvalidInputError(f"LoRA adapter {d}: fan_in_fan_out (Conv1D layouts) is not supported")
    try:
        r = int(cfg["r"])
        alpha = float(cfg.get("lora_alpha", r))
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidInputError(f"LoRA adapter {cfg_path}: r / lora_alpha missing or not numbers") from e
    rslora = bool(cfg.get("use_rslora", False))
    family = family_of(base.arch)
    raw = _read_peft_tensors(d)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        m = re.fullmatch(r"(.*)\.lora_(A|B)(\.[^.]+)?\.weight", key)
        if m is None:
            if "lora_embedding" in key:
                raise InvalidInputError(f"LoRA adapter {d}: tensor {key}: LoRA on embeddings is not supported")
            raise InvalidInputError(f"LoRA adapter {d}: tensor {key} is not a LoRA A/B weight")
        hf = m.group(1)
        for prefix in ("base_model.model.",):
            if hf.startswith(prefix):
                hf = hf[len(prefix):]
        pairs.setdefault(hf, {})[m.group(2)] = t
    modules: dict[str, LoraModule] = {}
    for hf, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise InvalidInputError(f"LoRA adapter {d}: module {hf} has lora_{'A' if 'A' in ab else 'B'} only")
        g = family.hf_tensor_name(hf + ".weight", base.config)
        if g is None or not g.endswith(".weight"):
            raise InvalidInputError(f"LoRA adapter {d}: module {hf} is not a projection of the "
                                    f"{base.arch} base model")
        mod_r = int(_pattern_value(cfg.get("rank_pattern"), hf, r))
        mod_alpha = float(_pattern_value(cfg.get("alpha_pattern"), hf, alpha))
        if ab["A"].ndim != 2 or ab["A"].shape[0] != mod_r:
            raise InvalidInputError(f"LoRA adapter {d}: module {hf}: lora_A has shape {list(ab['A'].shape)}, "
                                    f"expected rank {mod_r} rows")
        scale = mod_alpha / math.sqrt(mod_r) if rslora else mod_alpha / mod_r
        _add_module(modules, g[: -len(".weight")], ab["A"], ab["B"], scale, base, "hf", f"{d}: module {hf}")
    return _adapter(name, str(d), "peft", alpha, base, modules, use_rslora=rslora,
                    base_model_name=str(cfg.get("base_model_name_or_path") or ""))


# -- GGUF --------------------------------------------------------------------------------------------

def _load_gguf(p: Path, base: LoraBase, name: str) -> LoraAdapter:
    from kvserve.loaders.gguf import _tensor_to_weight, read_gguf_header
    from kvserve.loaders.weights import ModelLoadError

    try:
        md, infos = read_gguf_header(str(p))
    except ModelLoadError as e:
        raise InvalidInputError(f"LoRA adapter {p}: not a GGUF file or a PEFT directory: {e}") from e
    gtype = md.get("general.type", "")
    if gtype != "adapter":
        raise InvalidInputError(f"LoRA adapter {p}: general.type is {gtype!r}, expected 'adapter' (is it a model?)")
    atype = md.get("adapter.type", "")
    if atype != "lora":
        raise InvalidInputError(f"LoRA adapter {p}: adapter.type is {atype!r}, expected 'lora'")
    arch = md.get("general.architecture", "")
    if arch != base.arch:
        raise InvalidInputError(f"LoRA adapter {p}: architecture {arch!r} does not match the base model's "
                                f"{base.arch!r}")
    alpha = float(md.get("adapter.lora.alpha", 0.0) or 0.0)
    raw = np.memmap(str(p), dtype=np.uint8, mode="r")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for t in infos:
        m = re.fullmatch(r"(.*)\.weight\.lora_(a|b)", t.name)
        if m is None:
            raise InvalidInputError(f"LoRA adapter {p}: tensor {t.name} is not a LoRA a/b tensor")
        try:
            w = _tensor_to_weight(t, raw)
        except ModelLoadError as e:
            raise InvalidInputError(f"LoRA adapter {p}: {e}") from e
        pairs.setdefault(m.group(1), {})[m.group(2)] = torch.from_numpy(np.array(w.to_dense(), dtype=np.float32))
    modules: dict[str, LoraModule] = {}
    for mod, ab in pairs.items():
        if set(ab) != {"a", "b"}:
            raise InvalidInputError(f"LoRA adapter {p}: module {mod} has lora_{'a' if 'a' in ab else 'b'} only")
        a, b = ab["a"], ab["b"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise InvalidInputError(f"LoRA adapter {p}: module {mod}: lora_a {list(a.shape)} and lora_b "
                                    f"{list(b.shape)} do not chain (lora_a must be [r, in], lora_b [out, r])")
        rank = a.shape[0]
        scale = alpha / rank if alpha else 1.0  # llama.cpp: alpha 0 means no rescaling
        _add_module(modules, mod, a, b, scale, base, "gguf", f"{p}: module {mod}")
    return _adapter(name, str(p), "gguf", alpha, base, modules,
                    task_name=str(md.get("adapter.lora.task_name", "") or ""),
                    prompt_prefix=str(md.get("adapter.lora.prompt_prefix", "") or ""))


# -- shared ------------------------------------------------------------------------------------------

def _add_module(modules: dict, mod: str, a: torch.Tensor, b: torch.Tensor, scale: float, base: LoraBase,
                fmt: str, where: str) -> None:
    """Check one file module against the base, split fused ones, permute Q/K rows, store."""
    m = _LAYER.fullmatch(mod)
    if m is None:
        raise InvalidInputError(f"LoRA adapter {where}: LoRA on {mod} is not supported (only the attention and "
                                "MLP projections of each layer)")
    layer, kind = m.group(1), m.group(2)
    a = a.detach().to(torch.float32).contiguous()
    b = b.detach().to(torch.float32).contiguous()
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
        raise InvalidInputError(f"LoRA adapter {where}: A {list(a.shape)} and B {list(b.shape)} do not chain")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise InvalidInputError(f"LoRA adapter {where}: non-finite values (NaN or inf)")
    parts = [(kind, b)]
    if kind in FUSED or kind == "ffn_up" and f"blk.{layer}.ffn_gate" in base.shapes and \
            b.shape[0] == 2 * base.shapes[f"blk.{layer}.ffn_up"][0]:
        names = FUSED.get(kind, FUSED["ffn_gate_up"])
        sizes = [base.shapes.get(f"blk.{layer}.{n}", (0, 0))[0] for n in names]
        if sum(sizes) != b.shape[0] or 0 in sizes:
            raise InvalidInputError(f"LoRA adapter {where}: B has {b.shape[0]} rows, the base model's "
                                    f"{'|'.join(names)} {sizes}")
        parts = list(zip(names, torch.split(b, sizes, dim=0)))
    for kind_, b_ in parts:
        full = f"blk.{layer}.{kind_}"
        if kind_ not in TARGETS:
            raise InvalidInputError(f"LoRA adapter {where}: LoRA on {full} is not supported (only the attention "
                                    "and MLP projections)")
        shape = base.shapes.get(full)
        if shape is None:
            raise InvalidInputError(f"LoRA adapter {where}: the base model has no {full} (another base model, "
                                    "or an MoE layer's experts)")
        if (b_.shape[0], a.shape[1]) != shape:
            raise InvalidInputError(f"LoRA adapter {where}: {full} has shape [{b_.shape[0]}, {a.shape[1]}] "
                                    f"(B rows x A columns), the base model's is {list(shape)}: another base model?")
        if kind_ in ("attn_q", "attn_k"):
            order = qk_row_order(base.config, kind_, fmt)
            if order is not None:
                b_ = b_[torch.from_numpy(order)]
        if full in modules:
            raise InvalidInputError(f"LoRA adapter {where}: {full} appears twice")
        modules[full] = LoraModule(a, b_.contiguous(), float(scale))


def qk_row_order(config, kind: str, fmt: str) -> np.ndarray | None:
    """The row order kvserve's loader applies to this family's ``attn_q`` / ``attn_k`` weights from
    a file of format ``fmt`` ("hf" or "gguf"), or None where it keeps the file's rows (mirrors each
    family's ``prepare``)."""
    from kvserve.loaders.weights import interleave_order
    from kvserve.models.family import LLAMA_NEOX_GGUF, family_of, llama_prepare

    heads = config.n_head if kind == "attn_q" else config.n_head_kv
    n = heads * config.head_dim
    fam = family_of(config.arch)
    if fam.name == "phi3":
        from kvserve.models.phi3 import rotary_order

        return rotary_order(n, heads, config.rope_dim)
    if fam.prepare is llama_prepare:
        if fmt == "hf" or config.arch in LLAMA_NEOX_GGUF:
            return interleave_order(n, heads)
        return None
    return interleave_order(n, heads)  # qwen3, qwen3moe, gemma2/3, gpt-oss: NEOX rows in both formats


def _adapter(name: str, path: str, fmt: str, alpha: float, base: LoraBase, modules: dict, **kw) -> LoraAdapter:
    if not modules:
        raise InvalidInputError(f"LoRA adapter {path}: no LoRA tensors")
    kinds = tuple(sorted({k.split(".", 2)[2] for k in modules}, key=TARGETS.index))
    rank = max(m.rank for m in modules.values())
    return LoraAdapter(name=name, path=path, format=fmt, rank=rank, alpha=alpha, base_arch=base.arch,
                       target_modules=kinds, modules=modules, **kw)


def adapter_kind(path: str) -> str:
    """"peft" for a directory, "gguf" for a file (no check of the contents)."""
    return "peft" if os.path.isdir(path) else "gguf"
