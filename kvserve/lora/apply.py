"""Multi-LoRA in the forward: each target Linear adds its adapters' deltas to its own output.

A model's fused projections (q|k|v, gate|up) keep one :class:`LoraLinear` each; per adapter it holds
``a`` [R, in] (the A of the parts it targets, stacked) and per part a ``b`` [rows, r] (its B, module
scale folded in). A step's :class:`LoraBatch` groups the rows by adapter: per adapter, the rows'
indices and their request scales. For each group and part::

    h = (x[rows] @ a^T) * scales                   # x: [n, in], a^T: [in, R] -> h: [n, R]
    y[rows, part] += h[:, part's ranks] @ b^T       # b^T: [r, rows of the part]

(punica's "shrink" then "expand": a row costs about (in + out) * r multiply-adds per adapter and
module, against in * out for the base). A step of one adapter runs plain matmuls; a step of several
runs them as batched matmuls over the groups padded to the largest (``torch.bmm`` of the adapters'
stacked weights, cached per Linear for the step's adapter set), so the Python cost per projection
does not grow with the number of adapters. Rows of no adapter are never touched. The base weights
stay as they are (packed, any kernel); the delta runs in float32 on the activations. The adapters are
stored in ``LoraRegistry.dtype`` (vLLM's ``--lora-dtype``: float32, the default on the CPU, or
bfloat16/float16, half the memory and reads) and read as float32: a narrow adapter's delta is exactly
the float32 delta of its rounded weights (vLLM computes in the narrow type instead).

Decode-only steps run in the native decode step instead (kvserve.models.decode_native): it is given
these same per-Linear weights once per adapter (``NativeDecode.lora_ready``) and adds the same deltas
per row inside its C++ step (decode_cpu.cpp's ``step_lora``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
    """One step's adapter groups (what every LoraLinear reads while the step runs).

    Attributes:
        groups: one LoraGroup per adapter (ids in first-seen order).
        n_rows: the step's rows T.
        ids: the groups' adapter ids, in order (the key of each LoraLinear's stacked weights).
        index: [G * maxn] long, each group's rows padded to ``maxn`` (with row 0).
        scales: [G, maxn, 1] float32, each row's scale (0 on padding, so it adds nothing).
    """

    groups: list[LoraGroup]
    n_rows: int
    ids: tuple[int, ...] = ()
    index: torch.Tensor | None = None
    scales: torch.Tensor | None = None

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
        batch = cls(groups, n_rows, tuple(rows))
        if len(groups) > 1:  # the padded layout of the batched (bmm) path
            maxn = max(len(r) for r in rows.values())
            index = torch.zeros(len(rows), maxn, dtype=torch.long)
            sc = torch.zeros(len(rows), maxn, 1, dtype=torch.float32)
            for g, aid in enumerate(rows):
                n = len(rows[aid])
                index[g, :n] = torch.tensor(rows[aid], dtype=torch.long)
                sc[g, :n, 0] = torch.tensor(scales[aid], dtype=torch.float32)
            batch.index, batch.scales = index.view(-1).to(device), sc.to(device)
        return batch


class LoraLinear:
    """The adapters of one Linear (see the module docstring). ``registry.active`` is the step's
    LoraBatch (None: no adapter rows in this step).

    Per adapter it keeps ``a`` [R, in] (the A of every fused part it targets, stacked) and, per part,
    ``(first output row, rows, first rank, end rank, b)`` with ``b`` [rows, rank] (the part's B times
    its module scale): each part's output multiplies only its own rank slice of ``x @ a^T``."""

    __slots__ = ("registry", "parts", "weights", "_stack_key", "_stack")

    def __init__(self, registry, parts: list[tuple[str, int, int]]):
        self.registry = registry
        #: (module suffix, first output row, rows) of each fused part
        self.parts = parts
        #: adapter id -> (a [R, in], [(out0, n_out, r0, r1, b [n_out, r1 - r0]), ...]) float32
        self.weights: dict[int, tuple[torch.Tensor, list]] = {}
        self._stack_key: tuple | None = None
        #: the last step's adapters stacked: (a [G, W, in], [(out0, n_out, c0, c1, b [G, n_out, c1 - c0])]),
        #: each part's ranks in its own zero-padded column range [c0, c1)
        self._stack: tuple | None = None

    def _stacked(self, ids: tuple[int, ...]):
        """The adapters ``ids`` stacked (an adapter this Linear lacks: zeros), cached per id tuple."""
        key = (ids, tuple(id(self.weights.get(i)) for i in ids))
        if self._stack_key == key:
            return self._stack
        ws = [self.weights.get(i) for i in ids]
        some = next(w for w in ws if w is not None)
        # every part's widest rank among these adapters, in part order
        widths: dict[int, int] = {}
        for w in ws:
            for out0, n_out, r0, r1, _ in (w[1] if w is not None else ()):
                widths[out0] = max(widths.get(out0, 0), r1 - r0)
        cols, c = {}, 0
        for out0 in sorted(widths):
            cols[out0] = (c, c + widths[out0])
            c += widths[out0]
        f32 = dict(dtype=torch.float32)  # the stack is float32 whatever the adapters' dtype (narrow ones widened)
        a = some[0].new_zeros(len(ids), c, some[0].shape[1], **f32)
        sizes = {out0: n_out for w in ws if w is not None for out0, n_out, *_ in w[1]}
        bs = {out0: some[0].new_zeros(len(ids), sizes[out0], c1 - c0, **f32) for out0, (c0, c1) in cols.items()}
        for g, w in enumerate(ws):
            if w is None:
                continue
            for out0, n_out, r0, r1, b in w[1]:
                c0 = cols[out0][0]
                a[g, c0:c0 + r1 - r0] = w[0][r0:r1]
                bs[out0][g, :, :r1 - r0] = b
        parts = [(out0, sizes[out0], c0, c1, bs[out0]) for out0, (c0, c1) in cols.items()]
        self._stack_key, self._stack = key, (a, parts)
        return self._stack

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Add the step's deltas to ``y`` ([T, out] float32, the base output of ``x`` [T, in])."""
        batch = self.registry.active
        if batch is None or batch.n_rows != x.shape[0]:
            return y
        if batch.index is not None:  # several adapters: batched matmuls over the padded groups
            if not any(i in self.weights for i in batch.ids):
                return y
            a, parts = self._stacked(batch.ids)
            G = len(batch.ids)
            xg = x.index_select(0, batch.index).view(G, -1, x.shape[1]).float()  # [G, n, in]
            h = torch.bmm(xg, a.transpose(1, 2)).mul_(batch.scales)  # [G, n, W]
            for out0, n_out, c0, c1, b in parts:
                d = torch.bmm(h[:, :, c0:c1], b.transpose(1, 2))  # [G, n, n_out]
                y[:, out0:out0 + n_out].index_add_(0, batch.index, d.view(-1, n_out).to(y.dtype))
            return y
        g = batch.groups[0]
        w = self.weights.get(g.adapter_id)
        if w is None:
            return y
        a, parts = w
        # F.linear (x @ W^T on the [out, in] weights as stored): torch's mm of a transposed view takes a
        # slower path in some builds
        xs = x.float() if g.rows is None else x.index_select(0, g.rows).float()
        h = F.linear(xs, a.float()).mul_(g.scales)  # [n, R] (a narrow adapter's A read as float32)
        for out0, n_out, r0, r1, b in parts:
            d = F.linear(h[:, r0:r1], b.float()).to(y.dtype)  # [n, n_out]
            if g.rows is None:
                y[:, out0:out0 + n_out].add_(d)
            else:
                y[:, out0:out0 + n_out].index_add_(0, g.rows, d)
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


def install(registry, model, aid: int, adapter, dtype: torch.dtype = torch.float32) -> None:
    """Give every Linear the adapter touches its (a, parts) under id ``aid`` (a LoraLinear is
    attached on first use), stored in ``dtype`` (vLLM's ``--lora-dtype``; the module scale folded into
    B in float32 before the cast)."""
    dev = getattr(model, "device", torch.device("cpu"))
    for i, attr, lin in _linears(model):
        parts = _parts(model, attr, lin)
        mods = [(off, n, adapter.modules.get(f"blk.{i}.{name}")) for name, off, n in parts]
        if all(m is None for *_, m in mods):
            continue
        a = torch.cat([m.a for *_, m in mods if m is not None]).to(torch.float32)
        out, r0 = [], 0
        for off, n, m in mods:
            if m is None:
                continue
            out.append((off, n, r0, r0 + m.rank, (m.b * m.scale).to(device=dev, dtype=dtype).contiguous()))
            r0 += m.rank
        if getattr(lin, "lora", None) is None:
            lin.lora = LoraLinear(registry, parts)
        lin.lora.weights[aid] = (a.to(device=dev, dtype=dtype).contiguous(), out)


def uninstall(model, aid: int) -> None:
    """Drop adapter ``aid`` from every Linear."""
    for _, _, lin in _linears(model):
        lo = getattr(lin, "lora", None)
        if lo is not None:
            lo.weights.pop(aid, None)
