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
"""

from __future__ import annotations

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
        if canonical_kv_type(t) in ("q8_0", "q4_0") and head_dim % QK:
            raise ValueError(f"KV cache type {t} needs head_dim a multiple of {QK} (the model's is {head_dim})")
    return n_layer * (kv_row_bytes(per_row, type_k) + kv_row_bytes(per_row, type_v))
