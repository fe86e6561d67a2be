"""Pooling of final hidden states into one vector per input, and llama-server's normalizations.

Pooling modes (llama-server ``--pooling``, sentence-transformers' 1_Pooling):

- ``none``: every token's vector, ``[n_tokens, E]``;
- ``mean``: the average over the input's tokens, special tokens included (as llama.cpp and
  sentence-transformers' ``pooling_mode_mean_tokens`` with the attention mask both do);
- ``cls``: the first token's vector;
- ``last``: the last token's vector (decoder embedding models).

Normalization is llama-server's ``--embd-normalize`` (``common_embd_normalize``):
-1 none; 0 "max-abs int16": scaled so the largest magnitude is 32760 (the values stay
floats); 1 taxicab (sum of magnitudes); 2 Euclidean; p > 2 the p-norm. A zero vector stays zero.
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.errors import InvalidInputError

#: the pooling modes :func:`pool` takes
POOLING = ("none", "mean", "cls", "last")


def check_pooling(mode: str) -> str:
    """``mode`` when it is one of :data:`POOLING`; else InvalidInputError naming the choices."""
    if mode not in POOLING:
        raise InvalidInputError(f"unsupported pooling '{mode}' (supported: {', '.join(POOLING)})")
    return mode


def check_normalize(norm: int) -> int:
    """``norm`` as an int when it is a valid ``--embd-normalize`` value (an integer >= -1)."""
    if isinstance(norm, bool) or not isinstance(norm, (int, np.integer)) or norm < -1:
        raise InvalidInputError(f"invalid embd_normalize {norm!r} (-1 none, 0 max-abs int16, 1 taxicab, "
                                "2 euclidean, >2 p-norm)")
    return int(norm)


def pool(hidden: torch.Tensor, lengths: list[int], mode: str) -> list[torch.Tensor]:
    """Pool a padded batch of hidden states.

    Args:
        hidden: [B, L, E] float, right-padded: input b's tokens are ``hidden[b, :lengths[b]]``.
        lengths: B token counts, each in ``1..L``.
        mode: one of :data:`POOLING`.

    Returns:
        B tensors: [E] each, or [lengths[b], E] for ``none``.
    """
    check_pooling(mode)
    B, L, _ = hidden.shape
    if mode == "none":
        return [hidden[b, :n] for b, n in enumerate(lengths)]
    if mode == "cls":
        return list(hidden[:, 0])
    if mode == "last":
        idx = torch.as_tensor([n - 1 for n in lengths], device=hidden.device)
        return list(hidden[torch.arange(B, device=hidden.device), idx])
    # mean: a masked sum in one pass, divided by each count
    n = torch.as_tensor(lengths, device=hidden.device, dtype=hidden.dtype)
    mask = torch.arange(L, device=hidden.device)[None, :] < n[:, None]  # [B, L]
    sums = (hidden * mask[:, :, None].to(hidden.dtype)).sum(1)  # [B, E]
    return list(sums / n[:, None])


def normalize(vec: np.ndarray, norm: int) -> np.ndarray:
    """Scale ``vec`` (any shape; the last axis is the vector) as ``--embd-normalize norm`` does.

    Returns a float32 array of the same shape. The scale is computed in float64 and applied
    as one float32 factor per vector, as llama.cpp does.
    """
    norm = check_normalize(norm)
    v = np.asarray(vec, dtype=np.float32)
    if norm == -1:
        return v.copy()
    a = np.abs(v.astype(np.float64))
    if norm == 0:
        s = a.max(axis=-1, keepdims=True, initial=0.0) / 32760.0
    elif norm == 2:
        s = np.sqrt((a * a).sum(axis=-1, keepdims=True))
    else:
        s = (a ** norm).sum(axis=-1, keepdims=True) ** (1.0 / norm)
    with np.errstate(divide="ignore"):
        factor = np.where(s > 0.0, 1.0 / np.where(s > 0.0, s, 1.0), 0.0).astype(np.float32)
    return v * factor
