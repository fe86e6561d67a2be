"""KV cache storage types: llama-server's ``-ctk``/``-ctv`` names and vLLM's ``--kv-cache-dtype``.

Type names (kvserve's canonical spelling, llama-server's where it has one):

==========  ================================  ======================
name        stored per 32 values              bytes per value
==========  ================================  ======================
f32         32 float32                        4
f16         32 float16                        2
bf16        32 bfloat16                       2
q8_0        32 int8 + one f16 scale           34 / 32 (53% of f16)
q4_0        16 bytes of nibbles + f16 scale   18 / 32 (28% of f16)
fp8_e4m3    32 float8_e4m3fn (scale 1)        1 (50% of f16)
fp8_e5m2    32 float8_e5m2 (scale 1)          1 (50% of f16)
==========  ================================  ======================

q8_0 / q4_0 follow llama.cpp's block semantics (ggml ``block_q8_0`` /
``block_q4_0``); fp8 follows vLLM's ``--kv-cache-dtype fp8`` without
calibrated scales (scale 1.0; ``fp8`` means ``fp8_e4m3``).

Storage. The float types are plain tensors ``[rows, n_head_kv, head_dim]`` in
their dtype, exactly as before this module existed: the model's code takes the
same path for them (:func:`kv_write`, :func:`kv_gather`... are one ``isinstance``
away from the tensor ops). The other types are a :class:`QuantKV`: one uint8
tensor ``[rows, n_head_kv, row_bytes]`` holding each head's row in its stored form
(llama.cpp's block layout for q8_0/q4_0: per block of 32 values the f16 scale ``d``
little-endian, then the quants; the float8 bytes for fp8). Row copies (copy on
write, slot save/restore, moving V rows) copy those bytes; writing quantizes,
reading dequantizes to the compute dtype.

Numerics (llama.cpp's reference quantizers, ``quantize_row_q8_0_ref`` /
``quantize_row_q4_0_ref``, computed in float32):

- q8_0: ``d = amax / 127``, ``q = roundf(x * (1 / d))`` (half away from zero),
  stored d = f16(d); value = q * d.
- q4_0: ``m`` = the value of largest magnitude (the first one on ties), ``d = m / -8``,
  ``q = min(15, trunc(x * (1 / d) + 8.5))``; byte j of the 16 holds value j in its low
  nibble and value j + 16 in its high nibble; value = (q - 8) * d.
- fp8: the value clamped to the format's finite range (vLLM's saturating
  conversion) and rounded to nearest even; e4m3 is ``torch.float8_e4m3fn``.
  CPU torch has no ``index_copy_`` for float8, so the bytes are stored as uint8
  and reinterpreted on reading.
"""

from __future__ import annotations

import torch

#: bytes per stored value as (numerator, denominator): exact for the block types
_BYTES: dict[str, tuple[int, int]] = {
    "f32": (4, 1), "f16": (2, 1), "bf16": (2, 1),
    "q8_0": (34, 32), "q4_0": (18, 32),
    "fp8_e4m3": (1, 1), "fp8_e5m2": (1, 1),
}

#: every KV type the pool can store (canonical names)
KV_TYPES: tuple[str, ...] = tuple(_BYTES)

#: values per block of the block-quantized types (head_dim must be a multiple)
QK = 32

#: aliases accepted by :func:`canonical_kv_type` (vLLM spellings)
_ALIASES = {"fp8": "fp8_e4m3", "float16": "f16", "bfloat16": "bf16", "float32": "f32", "half": "f16"}


def canonical_kv_type(name: str) -> str:
    """The canonical KV type name of ``name`` ("fp8" -> "fp8_e4m3", "bfloat16" -> "bf16", ...).

    Raises:
        ValueError: not a KV type kvserve stores.
    """
    n = _ALIASES.get(name, name)
    if n not in _BYTES:
        raise ValueError(f"unsupported KV cache type '{name}' (use one of {', '.join(KV_TYPES)})")
    return n


def kv_row_bytes(n_values: int, kv_type: str) -> int:
    """Bytes that ``n_values`` values (one cache row of one layer: n_head_kv * head_dim) take in ``kv_type``.

    Exact: for q8_0 / q4_0, ``n_values`` must be a multiple of 32 (raises ValueError otherwise).
    """
    num, den = _BYTES[canonical_kv_type(kv_type)]
    if (n_values * num) % den:
        raise ValueError(f"{n_values} values are not a whole number of {kv_type} blocks of {QK}")
    return n_values * num // den


def kv_bytes_per_token(n_layer: int, n_head_kv: int, head_dim: int, type_k: str, type_v: str) -> int:
    """KV cache bytes one token takes in the pool: K rows in ``type_k`` plus V rows in ``type_v``, every layer.

    ``n_layer * n_head_kv * head_dim * (bytes(type_k) + bytes(type_v))`` with bytes per
    value f32 4, f16/bf16 2, q8_0 34/32, q4_0 18/32, fp8 (fp8_e4m3/fp8_e5m2) 1. Types are
    llama-server's ``-ctk``/``-ctv`` names or vLLM's (``fp8``, ``bfloat16``). This is what
    the pool allocates (ModelRunner's tensors' nbytes per cache row).

    Raises:
        ValueError: an unknown type, or head_dim not a multiple of 32 for q8_0/q4_0.
    """
    per_row = n_head_kv * head_dim
    for t in (type_k, type_v):
        err = head_dim_error(t, head_dim)
        if err:
            raise ValueError(err)
    return n_layer * (kv_row_bytes(per_row, type_k) + kv_row_bytes(per_row, type_v))


def head_dim_error(kv_type: str, head_dim: int) -> str | None:
    """The start-up error for a block type whose blocks do not tile a head (None when they do)."""
    if canonical_kv_type(kv_type) in ("q8_0", "q4_0") and head_dim % QK:
        return (f"KV cache type {kv_type} needs the model's head_dim to be a multiple of {QK} (blocks of {QK} "
                f"values); this model's head_dim is {head_dim}: use f16, bf16, f32 or fp8")
    return None


# -- quantizers (pure functions on [..., D] tensors) -------------------------------------------------

_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_FLOAT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> float32 [..., D/32, 32]."""
    return x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // QK, QK)


#: the float32 just below 0.5: trunc(x + copysign(_HALF_DOWN, x)) is roundf(x) for every float32
#: (with 0.5 itself, 0.49999997 + 0.5 would round up to 1.0)
_HALF_DOWN = 0.49999997


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: to nearest, halves away from zero (torch.round rounds halves to even)."""
    return torch.trunc(x + torch.copysign(torch.tensor(_HALF_DOWN, dtype=x.dtype, device=x.device), x))


def _scale_bytes(d: torch.Tensor) -> torch.Tensor:
    """float32 [..., nb, 1] -> the f16 scale's two little-endian bytes, uint8 [..., nb, 2]."""
    return d.to(torch.float16).view(torch.uint8)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """[..., D] floats (D a multiple of 32) -> uint8 [..., D / 32 * 34], llama.cpp's block_q8_0 layout."""
    b = _blocks(x)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1.0 / d, 0.0)
    q = _roundf(b * inv).to(torch.int8).view(torch.uint8)
    return torch.cat([_scale_bytes(d), q], -1).reshape(*x.shape[:-1], -1)


def dequantize_q8_0(b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., nb * 34] (block_q8_0) -> [..., nb * 32] in ``dtype`` (q * d in float32, then cast)."""
    blk = b.view(*b.shape[:-1], b.shape[-1] // 34, 34)
    d = blk[..., :2].view(torch.float16).to(torch.float32)  # [..., nb, 1]
    q = blk[..., 2:].view(torch.int8).to(torch.float32)  # [..., nb, 32]
    return (q * d).to(dtype).reshape(*b.shape[:-1], -1)


def quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    """[..., D] floats (D a multiple of 32) -> uint8 [..., D / 32 * 18], llama.cpp's block_q4_0 layout."""
    b = _blocks(x)
    m = b.gather(-1, b.abs().argmax(-1, keepdim=True))  # the first value of largest magnitude
    d = m / -8
    inv = torch.where(d != 0, 1.0 / d, 0.0)
    q = torch.trunc(b * inv + 8.5).clamp_(0, 15).to(torch.uint8)  # [..., nb, 32]
    packed = q[..., :16] | (q[..., 16:] << 4)
    return torch.cat([_scale_bytes(d), packed], -1).reshape(*x.shape[:-1], -1)


def dequantize_q4_0(b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., nb * 18] (block_q4_0) -> [..., nb * 32] in ``dtype`` ((q - 8) * d in float32, then cast)."""
    blk = b.view(*b.shape[:-1], b.shape[-1] // 18, 18)
    d = blk[..., :2].view(torch.float16).to(torch.float32)
    qs = blk[..., 2:].contiguous()  # [..., nb, 16]: the nibble ops run ~1.5x faster on contiguous bytes
    # low nibbles are values 0..15, high nibbles 16..31; q - 8 in int8 before the float cast
    q = torch.stack([qs & 0x0F, qs >> 4], -2).view(torch.int8).sub_(8).view(*qs.shape[:-1], QK)
    return (q.to(torch.float32) * d).to(dtype).reshape(*b.shape[:-1], -1)


def quantize_fp8(x: torch.Tensor, kv_type: str = "fp8_e4m3") -> torch.Tensor:
    """[..., D] floats -> uint8 [..., D], the float8 bytes (scale 1, saturated to the finite range)."""
    dt = _FP8[kv_type]
    lim = torch.finfo(dt).max
    return x.to(torch.float32).clamp(-lim, lim).to(dt).view(torch.uint8)


_E4M3_TABLE: dict[torch.device, torch.Tensor] = {}


def _e4m3_table(device: torch.device) -> torch.Tensor:
    """float32 [256]: the value of every float8_e4m3fn byte (NaN for 0x7F / 0xFF)."""
    t = _E4M3_TABLE.get(device)
    if t is None:
        t = _E4M3_TABLE[device] = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(
            torch.float32).to(device)
    return t


def dequantize_fp8(b: torch.Tensor, dtype: torch.dtype = torch.float32, kv_type: str = "fp8_e4m3") -> torch.Tensor:
    """uint8 [..., D] float8 bytes -> [..., D] in ``dtype`` (exact).

    On the CPU, torch's float8 -> float cast is scalar code (measured 18x an f16 gather of the
    same rows), so e5m2 bytes become float16 by a shift (e5m2 is float16's top byte) and e4m3
    bytes are looked up in a 256-entry table (4-5x faster than the cast)."""
    if b.device.type != "cpu":
        return b.view(_FP8[kv_type]).to(dtype)
    if kv_type == "fp8_e5m2":
        return (b.to(torch.int16) << 8).view(torch.float16).to(dtype)
    return _e4m3_table(b.device).index_select(0, b.reshape(-1).to(torch.int32)).view(b.shape).to(dtype)


def quantize(x: torch.Tensor, kv_type: str) -> torch.Tensor:
    """[..., D] floats -> uint8 [..., row bytes] in a stored (non-float) type."""
    if kv_type == "q8_0":
        return quantize_q8_0(x)
    if kv_type == "q4_0":
        return quantize_q4_0(x)
    return quantize_fp8(x, kv_type)


def dequantize(b: torch.Tensor, kv_type: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., row bytes] in a stored (non-float) type -> [..., D] in ``dtype``."""
    if kv_type == "q8_0":
        return dequantize_q8_0(b, dtype)
    if kv_type == "q4_0":
        return dequantize_q4_0(b, dtype)
    return dequantize_fp8(b, dtype, kv_type)


# -- one layer's K or V ----------------------------------------------------------------------------

class QuantKV:
    """One layer's K (or V) cache in a quantized type: ``[rows, n_head_kv, head_dim]`` logical values
    stored as uint8 :attr:`data` ``[rows, n_head_kv, kv_row_bytes(head_dim)]`` (see the module docstring).

    Args:
        kv_type: "q8_0" | "q4_0" | "fp8_e4m3" | "fp8_e5m2".
        rows, n_head_kv, head_dim: geometry (head_dim a multiple of 32 for q8_0/q4_0).
        device: torch device.

    Memory: ``data.nbytes`` = rows * n_head_kv * head_dim * (34/32 | 18/32 | 1) bytes.
    Not thread-safe (the engine thread owns it, as it owns the float caches).
    """

    __slots__ = ("kv_type", "data", "shape")

    def __init__(self, kv_type: str, rows: int, n_head_kv: int, head_dim: int, device: str | torch.device = "cpu"):
        kv_type = canonical_kv_type(kv_type)
        if kv_type in _FLOAT:
            raise ValueError(f"{kv_type} is stored as a plain tensor, not a QuantKV")
        err = head_dim_error(kv_type, head_dim)
        if err:
            raise ValueError(err)
        self.kv_type = kv_type
        self.shape = torch.Size((rows, n_head_kv, head_dim))
        # torch.empty as for the float caches: pages cost memory only once written
        self.data = torch.empty(rows, n_head_kv, kv_row_bytes(head_dim, kv_type), dtype=torch.uint8, device=device)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def write(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize ``x`` [N, n_head_kv, head_dim] into cache ``rows`` ([N] long)."""
        self.data.index_copy_(0, rows, quantize(x, self.kv_type))

    def gather(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``index`` ([N] long) dequantized: [N, n_head_kv, head_dim] in ``dtype`` (contiguous)."""
        return dequantize(self.data.index_select(0, index), self.kv_type, dtype)

    def round_trip(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x`` as the cache would return it after a write: dequantize(quantize(x)) in ``dtype``."""
        return dequantize(quantize(x, self.kv_type), self.kv_type, dtype)

    def empty_like(self, rows: int) -> QuantKV:
        """A zeroed cache of the same type and heads with ``rows`` rows (the compile warm-up's dummy)."""
        out = QuantKV(self.kv_type, rows, self.shape[1], self.shape[2], self.data.device)
        out.data.zero_()
        return out

    def __repr__(self) -> str:
        return f"QuantKV({self.kv_type}, rows={self.shape[0]}, n_head_kv={self.shape[1]}, head_dim={self.shape[2]})"


def new_kv_cache(kv_type: str, rows: int, n_head_kv: int, head_dim: int,
                 device: str | torch.device = "cpu") -> torch.Tensor | QuantKV:
    """One layer's K or V cache of ``rows`` rows: a float tensor [rows, n_head_kv, head_dim] for
    f32/f16/bf16 (uninitialized), a :class:`QuantKV` for the other types. Raises ValueError for an
    unknown type or a head_dim the type's blocks do not tile."""
    kv_type = canonical_kv_type(kv_type)
    if kv_type in _FLOAT:
        return torch.empty(rows, n_head_kv, head_dim, dtype=_FLOAT[kv_type], device=device)
    return QuantKV(kv_type, rows, n_head_kv, head_dim, device)


def kv_data(cache: torch.Tensor | QuantKV) -> torch.Tensor:
    """The tensor holding a cache's rows in their stored form (row copies, slot files): the float
    tensor itself, or a QuantKV's uint8 bytes [rows, n_head_kv, row bytes]."""
    return cache if isinstance(cache, torch.Tensor) else cache.data


def kv_write(cache: torch.Tensor | QuantKV, rows: torch.Tensor, x: torch.Tensor) -> None:
    """Store ``x`` [N, n_head_kv, head_dim] at cache ``rows`` ([N] long), rounding to the cache's type."""
    if isinstance(cache, torch.Tensor):
        cache.index_copy_(0, rows, x.to(cache.dtype))
    else:
        cache.write(rows, x)


def kv_gather(cache: torch.Tensor | QuantKV, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``index`` ([N] long) as [N, n_head_kv, head_dim] in ``dtype`` (a float cache:
    ``index_select`` then ``.to(dtype)``, as the model always did)."""
    if isinstance(cache, torch.Tensor):
        return cache.index_select(0, index).to(dtype)
    return cache.gather(index, dtype)


def kv_round(cache: torch.Tensor | QuantKV, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded as the cache stores it, in ``dtype`` (so a chunk attending to its own fresh K/V
    sees what a later read of the cache would give)."""
    if isinstance(cache, torch.Tensor):
        return x.to(cache.dtype).to(dtype)
    return cache.round_trip(x, dtype)


def stored_row_shape(kv_type: str, n_head_kv: int, head_dim: int) -> tuple[torch.dtype, tuple[int, int]]:
    """(dtype, (n_head_kv, last dim)) of one cache row in its stored form (:func:`kv_data`): a float
    type (dtype, (H, head_dim)), the others (uint8, (H, bytes per head row))."""
    kv_type = canonical_kv_type(kv_type)
    if kv_type in _FLOAT:
        return _FLOAT[kv_type], (n_head_kv, head_dim)
    return torch.uint8, (n_head_kv, kv_row_bytes(head_dim, kv_type))
