"""Quantized HF checkpoints, the formats vLLM users ship: AWQ, GPTQ, compressed-tensors and FP8.

config.json's ``quantization_config`` (or compressed-tensors' ``compression_config``) names the
method; vLLM reads it and picks its kernels without a flag (seed 002, Example 6), and so does
kvserve. :func:`read_scheme` turns that object into a :class:`QuantScheme` (or refuses a variant
kvserve cannot run, naming it); :class:`QuantAssembler` takes the directory's tensors one by one,
keeps the parts of each quantized linear layer (``qweight``/``qzeros``/``scales``/``g_idx``,
``weight_packed``/``weight_scale``/``weight_zero_point``/``weight_shape``, an 8-bit ``weight``
with its ``weight_scale``) and, at the end, gives one :class:`~kvserve.loaders.weights.Weight` per
layer under the layer's ``.weight`` name.

What each becomes:

* **4-bit integer groups** (AWQ GEMM, GPTQ 4-bit, compressed-tensors ``pack-quantized`` int4,
  symmetric or with zero points) stay 4-bit: the nibbles become kvserve's packed 4-bit form
  (``Weight.q4`` with one scale and zero per 32 inputs, ``w = (q - 8) * scale + zero``), the form
  GGUF Q4_0/Q4_1 files take, so they run on the same kernels (torch's int4 kernel, the native
  decode step). A group of G inputs (G a multiple of 32, or one group per output row) repeats its
  scale over G / 32 blocks, and ``zero = (8 - z) * s`` holds exactly in float32 (a 4-bit integer
  times a 16-bit scale). Not dequantized: the values are the checkpoint's, bit for bit.
* GPTQ with ``desc_act`` (an input order other than the groups', ``g_idx``), groups that are not
  a multiple of 32 inputs, and **8-bit** integer weights (GPTQ 8-bit, compressed-tensors
  ``int-quantized``) and **FP8** (``fp8``, compressed-tensors ``float-quantized``; per tensor, per
  channel or in 128 x 128 blocks) are dequantized to float32 at load: correct, not yet small
  (kvserve has no 8-bit kernel for safetensors weights yet).

Layouts (each checked against its format's reference packing in the tests):

* AWQ GEMM: ``qweight`` int32 [in, out / 8], eight outputs per word in the order
  0, 2, 4, 6, 1, 3, 5, 7 (nibble i holds output ``AWQ_ORDER[i]``); ``qzeros`` int32
  [in / G, out / 8] packed the same way; ``scales`` [in / G, out]; ``w = (q - z) * s``.
* GPTQ: ``qweight`` int32 [in * bits / 32, out], inputs packed along the rows, lowest bits
  first; ``qzeros`` int32 [in / G, out * bits / 32] packed along the outputs; ``scales``
  [in / G, out]; ``g_idx`` [in] (the group of each input). The classic (v1) checkpoint format
  stores each zero minus one (AutoGPTQ's convention); ``checkpoint_format: gptq_v2`` does not.
* compressed-tensors ``pack-quantized``: ``weight_packed`` int32 [out, in * bits / 32] packed
  along the inputs, each value stored plus 2^(bits-1); ``weight_scale`` [out, in / G] (or
  [out, 1]); optional ``weight_zero_point`` int32 [out * bits / 32, in / G] packed along the
  outputs, stored the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kvserve.loaders.weights import ModelLoadError, Weight

#: methods kvserve loads (config.json ``quant_method``)
SUPPORTED_METHODS = ("awq", "gptq", "compressed-tensors", "fp8")

#: AWQ's packing order: nibble i of a word holds output AWQ_ORDER[i] of its eight
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

#: the parts of a quantized layer, by method (the layer's other tensors, a bias, pass through)
_PARTS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
                           "input_scale", "input_zero_point", "weight_global_scale"),
    "fp8": ("weight_scale", "weight_scale_inv", "input_scale"),
}


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """One checkpoint's quantization, read from config.json.

    Attributes:
        method: "awq" | "gptq" | "compressed-tensors" | "fp8".
        bits: bits per weight (4 or 8).
        kind: "int" or "float" (FP8 E4M3).
        group_size: inputs per scale; 0 for one scale per output row (channel) or per tensor.
        symmetric: no zero points (compressed-tensors; GPTQ stores them either way).
        zero_offset: added to each stored zero (GPTQ v1 checkpoints store zero - 1).
        block: FP8 block scales' (rows, inputs) per block, or None.
        fmt: compressed-tensors' ``format`` ("pack-quantized", "int-quantized",
            "float-quantized", "naive-quantized"); "" for the other methods.
    """

    method: str
    bits: int
    kind: str = "int"
    group_size: int = 0
    symmetric: bool = True
    zero_offset: int = 0
    block: tuple[int, int] | None = None
    fmt: str = ""
    parts: tuple[str, ...] = field(default=())

    @property
    def label(self) -> str:
        """What ``/props`` and ``/api/show`` report as the file type, e.g. ``"AWQ-INT4"``."""
        return f"{self.method.upper()}-{self.kind.upper()}{self.bits}"


def quantization_config(cfg: dict) -> dict | None:
    """config.json's quantization object (``quantization_config``, compressed-tensors'
    ``compression_config``, or a multimodal ``text_config``'s), None when unquantized."""
    qc = cfg.get("quantization_config")
    if qc is None:
        qc = cfg.get("compression_config")
    if qc is None and isinstance(cfg.get("text_config"), dict):
        qc = cfg["text_config"].get("quantization_config")
    return qc


def read_scheme(cfg: dict, path: str) -> QuantScheme | None:
    """The checkpoint's :class:`QuantScheme`, None when config.json has no quantization.

    Raises:
        ModelLoadError: a method or variant kvserve cannot run, named (for example
            ``quant_method 'bitsandbytes'``, AWQ ``version 'gemv'``, GPTQ ``bits 3``).
    """
    qc = quantization_config(cfg)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError(f"{path}: config.json's quantization_config is not an object")
    method = str(qc.get("quant_method", "")).lower().replace("compressed_tensors", "compressed-tensors")
    if method == "mxfp4" and "GptOssForCausalLM" in (cfg.get("architectures") or []):
        return None  # gpt-oss's released experts: read as blocks by its family (kvserve.models.gpt_oss)
    reader = {"awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed_tensors, "fp8": _fp8}.get(method)
    if reader is None:
        named = f"quant_method '{method}'" if method else "no quant_method"
        raise ModelLoadError(
            f"{path}: the model's config.json has a quantization_config ({named}), which kvserve cannot run "
            f"(it runs {', '.join(SUPPORTED_METHODS)} checkpoints and GGUF files)")
    return reader(qc, path)


def _refuse(path: str, method: str, what: str) -> ModelLoadError:
    return ModelLoadError(f"{path}: {method} checkpoint with {what} is not supported")


def _group(value, path: str, method: str) -> int:
    g = int(value if value is not None else 128)
    if g == -1:
        return 0
    if g <= 0:
        raise _refuse(path, method, f"group_size {g}")
    return g


def _awq(qc: dict, path: str) -> QuantScheme:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4:
        raise _refuse(path, "AWQ", f"bits {bits} (4)")
    if version != "gemm":
        raise _refuse(path, "AWQ", f"version '{version}' (gemm)")
    return QuantScheme("awq", 4, group_size=_group(qc.get("group_size", qc.get("q_group_size")), path, "AWQ"),
                       symmetric=not bool(qc.get("zero_point", True)), parts=_PARTS["awq"])


def _gptq(qc: dict, path: str) -> QuantScheme:
    bits = int(qc.get("bits", 4))
    if bits not in (4, 8):
        raise _refuse(path, "GPTQ", f"bits {bits} (4 or 8)")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(path, "GPTQ", f"checkpoint_format '{fmt}' (gptq, gptq_v2)")
    return QuantScheme("gptq", bits, group_size=_group(qc.get("group_size"), path, "GPTQ"),
                       symmetric=bool(qc.get("sym", True)), zero_offset=1 if fmt == "gptq" else 0,
                       parts=_PARTS["gptq"])


def _compressed_tensors(qc: dict, path: str) -> QuantScheme:
    fmt = str(qc.get("format", "")).lower()
    if fmt not in ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized"):
        raise _refuse(path, "compressed-tensors", f"format '{fmt}' (pack-quantized, int-quantized, "
                      "float-quantized, naive-quantized)")
    schemes = []
    for name, grp in (qc.get("config_groups") or {}).items():
        w = (grp or {}).get("weights") or {}
        schemes.append((int(w.get("num_bits", 8)), str(w.get("type", "int")), str(w.get("strategy", "tensor")),
                        w.get("group_size"), bool(w.get("symmetric", True)), tuple(w.get("block_structure") or ())))
    if not schemes:
        raise _refuse(path, "compressed-tensors", "no config_groups")
    if len(set(schemes)) > 1:
        raise _refuse(path, "compressed-tensors", "config_groups of different weight schemes")
    bits, kind, strategy, group, sym, block = schemes[0]
    if (kind, bits) not in (("int", 4), ("int", 8), ("float", 8)):
        raise _refuse(path, "compressed-tensors", f"{kind} weights of {bits} bits (int4, int8, float8)")
    if strategy not in ("group", "channel", "tensor", "block"):
        raise _refuse(path, "compressed-tensors", f"strategy '{strategy}'")
    if strategy == "block" and len(block) != 2:
        raise _refuse(path, "compressed-tensors", f"block_structure {list(block)}")
    return QuantScheme("compressed-tensors", bits, kind=kind,
                       group_size=_group(group, path, "compressed-tensors") if strategy == "group" else 0,
                       symmetric=sym, block=(int(block[0]), int(block[1])) if strategy == "block" else None,
                       fmt=fmt, parts=_PARTS["compressed-tensors"])


def _fp8(qc: dict, path: str) -> QuantScheme:
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise _refuse(path, "FP8", f"fmt '{fmt}' (e4m3)")
    block = qc.get("weight_block_size")
    if block is not None and len(block) != 2:
        raise _refuse(path, "FP8", f"weight_block_size {block}")
    return QuantScheme("fp8", 8, kind="float", block=(int(block[0]), int(block[1])) if block else None,
                       parts=_PARTS["fp8"])


# -- assembling a checkpoint's layers ------------------------------------------------------------

class QuantAssembler:
    """Collects the parts of each quantized layer while a loader reads the tensors, then builds
    one Weight per layer (:meth:`finish`).

    Args:
        scheme: the checkpoint's scheme.
        path: the directory, for error messages.
    """

    def __init__(self, scheme: QuantScheme, path: str):
        self.scheme = scheme
        self.path = path
        self._layers: dict[str, dict] = {}

    def take(self, name: str, tensor) -> bool:
        """Keep ``tensor`` if it is part of a quantized layer (True); False for a tensor the
        loader handles itself (a float weight, a bias, a norm, an unquantized head)."""
        prefix, _, leaf = name.rpartition(".")
        if leaf in self.scheme.parts or leaf == "weight" and _is_8bit(tensor):
            self._layers.setdefault(prefix, {})[leaf] = tensor
            return True
        return False

    def finish(self):
        """Yield ``(name + ".weight", Weight)`` for every quantized layer seen.

        Raises:
            ModelLoadError: a layer lacks a part (named) or its parts disagree in shape.
        """
        for prefix, parts in self._layers.items():
            if set(parts) <= {"input_scale", "input_zero_point"}:
                continue  # an activation scale of a layer stored unquantized (ignored)
            try:
                yield prefix + ".weight", self._build(prefix, parts)
            except (ValueError, RuntimeError, IndexError, KeyError) as e:
                if isinstance(e, ModelLoadError):
                    raise
                raise ModelLoadError(f"{self.path}: quantized layer '{prefix}' is malformed ({self.scheme.method}): "
                                     f"{e}") from None

    def _need(self, prefix: str, parts: dict, *names: str):
        missing = [n for n in names if n not in parts]
        if missing:
            raise ModelLoadError(f"{self.path}: quantized layer '{prefix}' lacks '{prefix}.{missing[0]}' "
                                 f"({self.scheme.method})")
        return [parts[n] for n in names]

    def _build(self, prefix: str, parts: dict) -> Weight:
        s = self.scheme
        if s.method == "awq":
            qw, qz, sc = self._need(prefix, parts, "qweight", "qzeros", "scales")
            q = _unpack_awq(qw).T  # [in, out] -> [out, in]
            z = _unpack_awq(qz).T  # [out, groups]
            return _int_weight(q, _np(sc).T, z, 8 if s.symmetric else None, 4, s.label)
        if s.method == "gptq":
            qw, qz, sc = self._need(prefix, parts, "qweight", "qzeros", "scales")
            q = _unpack(qw, s.bits, axis=0).T  # [out, in]
            z = _unpack(qz, s.bits, axis=1).T.astype(np.int32) + s.zero_offset  # [out, groups]
            scale = _np(sc).T
            g_idx = parts.get("g_idx")
            if g_idx is not None and not _natural_groups(_np(g_idx), q.shape[1], scale.shape[1]):
                return _dense_groups(q, scale, z, _np(g_idx).astype(np.int64), s.bits, s.label)
            return _int_weight(q, scale, z, None, s.bits, s.label)
        if s.method == "compressed-tensors" and "weight_packed" in parts:
            packed, sc = self._need(prefix, parts, "weight_packed", "weight_scale")
            q = _unpack(packed, s.bits, axis=1)  # [out, in'] stored + 2^(bits-1)
            shape = parts.get("weight_shape")
            if shape is not None:
                out, inp = (int(x) for x in _np(shape).reshape(-1)[:2])
                q = q[:out, :inp]
            sc = _np(sc)
            if sc.size == 1:  # one scale for the tensor
                sc = np.full((q.shape[0], 1), sc.reshape(-1)[0], dtype=np.float32)
            zp = parts.get("weight_zero_point")
            z = None
            if zp is not None and not s.symmetric:
                z = _unpack(zp, s.bits, axis=0)[:q.shape[0]]  # [out, groups], stored + 2^(bits-1)
            return _int_weight(q, sc, z, 1 << (s.bits - 1) if z is None else None, s.bits, s.label)
        (w,) = self._need(prefix, parts, "weight")
        scale = parts.get("weight_scale_inv", parts.get("weight_scale"))
        if scale is None:
            raise ModelLoadError(f"{self.path}: quantized layer '{prefix}' lacks '{prefix}.weight_scale' "
                                 f"({s.method})")
        return _scaled_dense(w, scale, s, parts.get("weight_zero_point"))


def _is_8bit(tensor) -> bool:
    import torch

    return tensor.dtype in (torch.int8, torch.float8_e4m3fn)


def _np(t) -> np.ndarray:
    """A torch tensor (any dtype) as a numpy array (16-bit floats widened to float32)."""
    import torch

    if t.dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        t = t.to(torch.float32)
    return t.numpy()


def _unpack(packed, bits: int, axis: int) -> np.ndarray:
    """int32 words -> uint8 values, ``32 / bits`` per word along ``axis``, lowest bits first."""
    w = _np(packed).astype(np.int64) & 0xFFFFFFFF
    per = 32 // bits
    shifts = np.arange(per, dtype=np.int64) * bits
    vals = ((np.expand_dims(w, -1) >> shifts) & ((1 << bits) - 1)).astype(np.uint8)  # [..., per]
    if axis == 1:
        return vals.reshape(w.shape[0], w.shape[1] * per)
    return vals.transpose(0, 2, 1).reshape(w.shape[0] * per, w.shape[1])


def _unpack_awq(packed) -> np.ndarray:
    """AWQ's int32 words [R, C / 8] -> uint8 [R, C] in output order (see AWQ_ORDER)."""
    vals = _unpack(packed, 4, axis=1).reshape(packed.shape[0], -1, 8)
    out = np.empty_like(vals)
    out[:, :, list(AWQ_ORDER)] = vals
    return out.reshape(packed.shape[0], -1)


def _natural_groups(g_idx: np.ndarray, n_in: int, n_groups: int) -> bool:
    """True when input i is in group i // (n_in / n_groups) (no act-order permutation)."""
    if g_idx.shape != (n_in,) or n_in % n_groups:
        return False
    return bool(np.array_equal(g_idx, np.arange(n_in) // (n_in // n_groups)))


def _int_weight(q: np.ndarray, scale: np.ndarray, z: np.ndarray | None, z_const: int | None, bits: int,
                label: str) -> Weight:
    """Weight from integer values ``q`` [out, in] (unsigned), ``scale`` [out, groups] and zero
    points ``z`` [out, groups] (or one constant): ``w = (q - z) * scale`` per group of inputs.

    4-bit values whose groups are whole 32-input blocks stay packed (see the module docstring);
    anything else is dequantized to float32."""
    out, inp = q.shape
    scale = np.ascontiguousarray(scale, dtype=np.float32)
    groups = scale.shape[1]
    if scale.shape[0] != out or inp % groups:
        raise ValueError(f"scales of shape {list(scale.shape)} for a [{out}, {inp}] weight")
    if z is None:
        z = np.full((out, groups), z_const, dtype=np.int32)
    z = z[:, :groups].astype(np.float32)
    if z.shape != (out, groups):
        raise ValueError(f"zero points of shape {list(z.shape)} for {groups} groups of {out} rows")
    g = inp // groups
    if bits == 4 and g % 32 == 0 and inp % 32 == 0:
        rep = g // 32
        blk_scale = np.repeat(scale, rep, axis=1)
        blk_zero = np.repeat((8.0 - z) * scale, rep, axis=1)
        return Weight((out, inp), q4=np.ascontiguousarray(q, dtype=np.uint8), q4_scale=blk_scale,
                      q4_zero=np.ascontiguousarray(blk_zero, dtype=np.float32), source_type=label)
    w = (q.astype(np.float32).reshape(out, groups, g) - z[:, :, None]) * scale[:, :, None]
    return Weight((out, inp), dense=np.ascontiguousarray(w.reshape(out, inp)), source_type=label)


def _dense_groups(q: np.ndarray, scale: np.ndarray, z: np.ndarray, g_idx: np.ndarray, bits: int,
                  label: str) -> Weight:
    """GPTQ with act-order: input i uses group g_idx[i]; dequantized to float32 [out, in]."""
    out, inp = q.shape
    if g_idx.shape != (inp,) or g_idx.min() < 0 or g_idx.max() >= scale.shape[1]:
        raise ValueError(f"g_idx of shape {list(g_idx.shape)} for {scale.shape[1]} groups of {inp} inputs")
    w = (q.astype(np.float32) - z[:, g_idx].astype(np.float32)) * scale[:, g_idx].astype(np.float32)
    return Weight((out, inp), dense=np.ascontiguousarray(w, dtype=np.float32), source_type=label)


def _scaled_dense(w, scale, s: QuantScheme, zero_point=None) -> Weight:
    """8-bit weights (int8 or FP8 E4M3) times their scales -> float32 [out, in].

    Scales: one per tensor, one per output row ([out] or [out, 1]), per group of inputs
    ([out, in / G]) or per block ([out / B0, in / B1], FP8 ``weight_block_size``)."""
    wf = _np(w).astype(np.float32)
    out, inp = wf.shape
    sc = _np(scale).astype(np.float32)
    if zero_point is not None and not s.symmetric:
        wf = wf - _expand(_np(zero_point).astype(np.float32), out, inp, s)
    wf *= _expand(sc, out, inp, s)
    return Weight((out, inp), dense=np.ascontiguousarray(wf), source_type=s.label)


def _expand(sc: np.ndarray, out: int, inp: int, s: QuantScheme) -> np.ndarray:
    """A scale tensor broadcast to [out, in] (see _scaled_dense)."""
    if sc.size == 1:
        return sc.reshape(1, 1)
    if s.block is not None or sc.ndim == 2 and sc.shape[0] != out:
        b0, b1 = s.block or (math.ceil(out / sc.shape[0]), math.ceil(inp / sc.shape[1]))
        return np.repeat(np.repeat(sc, b0, axis=0)[:out], b1, axis=1)[:, :inp]
    sc = sc.reshape(out, -1)
    if sc.shape[1] == 1:
        return sc
    if inp % sc.shape[1]:
        raise ValueError(f"scales of shape {list(sc.shape)} for a [{out}, {inp}] weight")
    return np.repeat(sc, inp // sc.shape[1], axis=1)
