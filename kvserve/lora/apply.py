"""Multi-LoRA in the forward: each target Linear adds its adapters' deltas to its own output.

A model's fused projections (q|k|v, gate|up) keep one :class:`LoraLinear` each; per adapter it holds
``a`` [R, in] (the modules' A stacked) and ``b`` [out, R] (their B, module scales folded in, block
diagonal over the fused parts, zero rows where the adapter leaves a part alone). A step's
:class:`LoraBatch` groups the rows by adapter: per adapter, the rows' indices and their request
scales. For each group::

    y[rows] += ((x[rows] @ a^T) * scales) @ b^T          # x: [n, in], a^T: [in, R], b^T: [R, out]

(punica's "shrink" then "expand", as gathered small GEMMs per adapter: a row costs (in + out) * R
multiply-adds per adapter, against in * out for the base). Rows of no adapter are never touched. The
base weights stay as they are (packed, any kernel); the delta runs in float32 on the activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: a Linear attribute name -> the module names its output rows hold, in order
_PARTS = {"wqkv": ("attn_q", "attn_k", "attn_v"), "wo": ("attn_output",),
          "w_gate_up": ("ffn_gate", "ffn_up"), "w_down": ("ffn_down",)}


@dataclass(slots=True)
class LoraGroup:
    """The rows of one adapter in a step: ``adapter_id``, ``rows`` [n] long (None: every row of the
    step, in order), ``scales`` [n, 1] float32 (each row's request scale)."""

    adapter_id: int
    rows: torch.Tensor | None
    scales: torch.Tensor


@dataclass(slots=True)
class LoraBatch:
    """One step's adapter groups (what every LoraLinear reads while the step runs)."""

    groups: list[LoraGroup]
    n_rows: int

    @property
    def adapter_ids(self) -> frozenset[int]:
        return frozenset(g.adapter_id for g in self.groups)

    @classmethod
    def build(cls, row_lora, known, device) -> "LoraBatch | None":
        """From ``(first row, end row, ((id, scale), ...))`` ranges in batch order (rows absent or
        with an empty tuple: the base). Adapters not in ``known`` (removed meanwhile) are skipped.
        None when no row carries a known adapter."""
        rows: dict[int, list[int]] = {}
        scales: dict[int, list[float]] = {}
        n_rows = 0
        for a, b, lora in row_lora:
            n_rows = max(n_rows, b)
            for aid, s in lora:
                if aid not in known:
                    continue
                rows.setdefault(aid, []).extend(range(a, b))
                scales.setdefault(aid, []).extend([s] * (b - a))
        if not rows:
            return None
        groups = []
        for aid, r in rows.items():
            sc = torch.tensor(scales[aid], dtype=torch.float32, device=device).unsqueeze(1)
            idx = None if r == list(range(n_rows)) else torch.tensor(r, dtype=torch.long, device=device)
            groups.append(LoraGroup(aid, idx, sc))
        return cls(groups, n_rows)


class LoraLinear:
    """The adapters of one Linear (see the module docstring). ``registry.active`` is the step's
    LoraBatch (None: no adapter rows in this step)."""

    __slots__ = ("registry", "parts", "weights")

    def __init__(self, registry, parts: list[tuple[str, int, int]]):
        self.registry = registry
        #: (module suffix, first output row, rows) of each fused part
        self.parts = parts
        #: adapter id -> (a [R, in], b [out, R]) float32
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Add the step's deltas to ``y`` ([T, out] float32, the base output of ``x`` [T, in])."""
        batch = self.registry.active
        if batch is None or batch.n_rows != x.shape[0]:
            return y
        weights = self.weights
        for g in batch.groups:
            w = weights.get(g.adapter_id)
            if w is None:
                continue
            a, b = w
            if g.rows is None:
                h = torch.mm(x.float(), a.t()).mul_(g.scales)  # [T, R]
                y.add_(torch.mm(h, b.t()).to(y.dtype))
            else:
                h = torch.mm(x.index_select(0, g.rows).float(), a.t()).mul_(g.scales)  # [n, R]
                y.index_add_(0, g.rows, torch.mm(h, b.t()).to(y.dtype))
        return y


def _linears(model):
    """(layer index, attribute, Linear) of every projection a LoRA may target."""
    for i, layer in enumerate(model.layers):
        for attr in _PARTS:
            lin = getattr(layer, attr, None)
            if lin is not None and hasattr(lin, "out_features"):
                yield i, attr, lin


def _parts(model, attr: str, lin) -> list[tuple[str, int, int]]:
    c = model.config
    if attr == "wqkv":
        q = c.n_head * c.head_dim
        kv = (lin.out_features - q) // 2
        return [("attn_q", 0, q), ("attn_k", q, kv), ("attn_v", q + kv, kv)]
    if attr == "w_gate_up":
        h = lin.out_features // 2
        return [("ffn_gate", 0, h), ("ffn_up", h, h)]
    return [(_PARTS[attr][0], 0, lin.out_features)]


def install(registry, model, aid: int, adapter) -> None:
    """Give every Linear the adapter touches its fused (a, b) under id ``aid`` (a LoraLinear is
    attached on first use)."""
    for i, attr, lin in _linears(model):
        parts = _parts(model, attr, lin)
        mods = [(name, off, n, adapter.modules.get(f"blk.{i}.{name}")) for name, off, n in parts]
        if all(m is None for *_, m in mods):
            continue
        R = sum(m.rank for *_, m in mods if m is not None)
        a = torch.zeros(R, lin.in_features, dtype=torch.float32)
        b = torch.zeros(lin.out_features, R, dtype=torch.float32)
        r0 = 0
        for name, off, n, m in mods:
            if m is None:
                continue
            a[r0:r0 + m.rank] = m.a
            b[off:off + n, r0:r0 + m.rank] = m.b * m.scale
            r0 += m.rank
        dev = getattr(model, "device", torch.device("cpu"))
        if getattr(lin, "lora", None) is None:
            lin.lora = LoraLinear(registry, parts)
        lin.lora.weights[aid] = (a.to(dev), b.to(dev))


def uninstall(model, aid: int) -> None:
    """Drop adapter ``aid`` from every Linear."""
    for _, _, lin in _linears(model):
        lo = getattr(lin, "lora", None)
        if lo is not None:
            lo.weights.pop(aid, None)
