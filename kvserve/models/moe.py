"""Mixture-of-experts FFN (a shared piece) and the qwen3moe family built on it.

:class:`MoE`: a softmax router over ``n_expert`` experts, the top ``n_expert_used`` per token,
their weights renormalised to sum to 1 (``norm_topk_prob``; llama.cpp always does for qwen3moe),
each expert a SiLU-gated MLP of width ``n_ff_expert``. A step's rows are grouped by expert and
experts no row chose are not read (vLLM's fused MoE, llama.cpp's ``mul_mat_id`` do the same).
Expert weights stay as the file stores them: a GGUF's stacked blocks are multiplied per expert by
the block kernels (kvserve.models.ggml_kernel) where they lie, so idle experts are never read; float
experts (HF, F32 GGUFs, types the kernels lack) are float32.

Decode steps run in kvserve's native step where every expert is GGUF blocks
(kvserve.models.decode_native: the same router, top-k, renormalisation and block products in C++,
``Decoder.set_moe``); this module is the eager path (prefill, and decode elsewhere).

qwen3moe = qwen3's attention (per-head q/k norm, NEOX RoPE) + this FFN, on layers the config
names (transformers' ``mlp_only_layers`` / ``decoder_sparse_step``; every layer in a GGUF).
Tensors: GGUF ``blk.N.ffn_gate_inp.weight`` [E, n_embd] (router), ``ffn_{gate,up}_exps.weight``
[E, n_ff_expert, n_embd], ``ffn_down_exps.weight`` [E, n_embd, n_ff_expert]; HF per-expert
``mlp.experts.J.{gate,up,down}_proj.weight`` and ``mlp.gate.weight`` (stacked at load).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvserve.loaders.weights import ModelConfig, ModelLoadError, Weight, interleave_qk


@dataclass(slots=True)
class MoeConfig(ModelConfig):
    """A ModelConfig whose FFN is a mixture of experts on some layers.

    Attributes:
        n_expert: experts per MoE layer; n_expert_used: experts each token runs (top-k).
        n_ff_expert: one expert's MLP width.
        expert_weights_norm: renormalise the top-k router weights to sum to 1.
        dense_layers: layers with a plain (dense) MLP of ``n_ff`` instead.
    """

    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_expert: int = 0
    expert_weights_norm: bool = True
    dense_layers: tuple[int, ...] = ()

    def is_moe(self, layer: int) -> bool:
        return self.n_expert > 0 and layer not in self.dense_layers


class MoE(nn.Module):
    """x [T, n_embd] float32 -> [T, n_embd]: the top-k experts' SiLU-gated MLPs, weighted.

    Args:
        router: [E, n_embd]; gate, up: [E, n_ff_expert, n_embd]; down: [E, n_embd, n_ff_expert]
            (Weight objects: GGUF blocks kept as the file stores them, or float32).
        top_k: experts per token; norm: renormalise their weights.
        lin: keyword arguments of :class:`kvserve.models.llama.Linear` (dtype, device, kernel...).
    Each expert is two Linears (gate|up fused, and down) over its rows of the stacked tensors
    (:func:`expert_rows`, :func:`expert_linear`): a file's blocks are multiplied where they lie, so
    an expert no row chose is never read.
    """

    def __init__(self, router: Weight, gate: Weight, up: Weight, down: Weight, top_k: int, norm: bool, lin: dict):
        super().__init__()
        self.router = torch.from_numpy(np.ascontiguousarray(router.to_dense(), dtype=np.float32)).to(lin["device"])
        self.top_k, self.norm = top_k, norm
        self.n_ff = gate.shape[1]
        g, u, d = expert_rows(gate), expert_rows(up), expert_rows(down)
        self.gate_up = nn.ModuleList(expert_linear([g[e], u[e]], None, lin) for e in range(len(g)))
        self.down = nn.ModuleList(expert_linear([d[e]], None, lin) for e in range(len(d)))
        self.one_row = OneRowExperts.build(list(self.gate_up), list(self.down))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)  # [T, E]
        w, idx = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm:
            w = w / w.sum(dim=-1, keepdim=True)
        if x.shape[0] == 1 and self.one_row is not None:  # a one-row (decode) step
            return self.one_row(x, idx, w, self._act)
        return combine_experts(x, idx, w, len(self.gate_up), self._expert)

    def _act(self, gu: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up of gate|up rows gu [n, 2 n_ff] (worked on in place) -> [n, n_ff]."""
        return F.silu(gu[:, :self.n_ff]).mul_(gu[:, self.n_ff:])

    def _expert(self, e: int, xs: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s SiLU-gated MLP of its rows xs [n, n_embd] -> [n, n_embd]."""
        return self.down[e].forward(self._act(self.gate_up[e].forward(xs)))


class OneRowExperts:
    """A layer's experts for a one-row step (a single sequence's decode) on the GGUF block kernels.

    The k chosen experts share the row, so their gate|up rows are multiplied in one block-kernel
    product (a matrix made per step of the chosen experts' row blocks, as the file stores them: no
    copy; one activation quantization and one pass of the thread pool instead of k), then each
    expert's down product on its own activated row; no sort, gather or scatter of rows. The values
    are those of :func:`combine_experts` bit for bit: each output row of a block-kernel product is
    computed alone (kvserve.models.ggml_kernel), the biases are added as Linear adds them, and the
    weighted outputs are summed one by one in expert-id order.

    Use :meth:`build` (None where an expert is not on the block kernels: float experts, the
    kernels off or unbuilt).
    """

    def __init__(self, mod, gate_up: list, down: list):
        import gguf

        self._mod = mod
        self._k = gate_up[0].in_features
        self._gu: list[tuple[list[int], list[int], list[int]]] = []  # per expert: part pointers, types, rows
        for lin in gate_up:
            b = lin.blocks
            self._gu.append(([p.ctypes.data for p in b.parts], [int(gguf.GGMLQuantizationType[t]) for t in b.types],
                             [p.shape[0] for p in b.parts]))
        self._gu_keep = [lin.blocks for lin in gate_up]  # the mapped views the pointers point into
        # experts whose Q4_0 blocks were repacked at load (BlockMatrix.repacked) are multiplied by their own
        # matrices, one product each: a matrix made per step over the file's bytes would take the file
        # layout's Q4_0 kernel (other float sums than the repacked copy every other route multiplies) and
        # fault the pages given back at load in again
        self._gu_mats = [lin.blocks.matrix for lin in gate_up] if any(
            any(lin.blocks.repacked) for lin in gate_up) else None
        self._gu_bias = torch.stack([lin.bias for lin in gate_up]) if gate_up[0].bias is not None else None
        self._down = [lin.blocks.matrix for lin in down]
        self._down_keep = [lin.blocks for lin in down]
        self._down_bias = [lin.bias for lin in down]

    @classmethod
    def build(cls, gate_up: list, down: list) -> "OneRowExperts | None":
        """From each expert's gate|up and down :class:`kvserve.models.llama.Linear` (index = expert
        id); None unless every one multiplies GGUF blocks with the block kernels."""
        from kvserve.models import ggml_kernel

        if not gate_up or any(lin.blocks is None for lin in (*gate_up, *down)):
            return None
        if any((lin.bias is None) != (gate_up[0].bias is None) for lin in gate_up):
            return None
        mod = ggml_kernel.load_cached()
        return None if mod is None else cls(mod, gate_up, down)

    def __call__(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                 act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """x [1, n_embd] float32, idx [1, k] long (the chosen experts), w [1, k] (their weights),
        ``act``: gate|up rows [k, 2 n_ff] -> activated rows [k, n_ff] -> [1, n_embd]."""
        # expert-id order, the weights as Python floats (float32 values exactly: y.mul_(float) scales
        # in float32 as a float32 tensor's element would), no small tensor ops per expert
        pairs = sorted(zip(idx[0].tolist(), w[0].to(x.dtype).tolist()))
        ids = [e for e, _ in pairs]
        if self._gu_mats is not None:
            gu = torch.cat([self._gu_mats[e].mm(x, 0, "auto") for e in ids])  # [k, 2 n_ff]
        else:
            ptrs, types, rows = [], [], []
            for e in ids:
                p, t, r = self._gu[e]
                ptrs += p
                types += t
                rows += r
            gu = self._mod.Matrix(ptrs, types, rows, self._k).mm(x, 0, "auto").view(len(ids), -1)  # [k, 2 n_ff]
        if self._gu_bias is not None:
            gu += self._gu_bias[ids]
        h = act(gu)  # [k, n_ff]
        out = None
        for j, (e, wj) in enumerate(pairs):
            y = self._down[e].mm(h[j:j + 1], 0, "auto")  # [1, n_embd]
            if self._down_bias[e] is not None:
                y += self._down_bias[e]
            y.mul_(wj)
            out = y if out is None else out.add_(y)
        return out


def combine_experts(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, n_expert: int,
                    expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The weighted sum of each row's chosen experts: x [T, n_embd], idx [T, k] long (expert ids),
    w [T, k] (their weights) -> [T, n_embd] in x's dtype, ``expert(e, rows [n, n_embd]) -> [n,
    n_embd]``. The rows are grouped by expert (one call per expert, its rows together) and an
    expert no row chose is not called, so its weights are never read. Each row's k weighted outputs
    are added one by one in expert-id order (the order that agrees with llama.cpp to 1e-5 in
    tests/unit/test_llama_families.py; the choice order gave 1.7e-3 there)."""
    T, k = idx.shape
    idx, pos = idx.sort(dim=1)  # each row's experts by id
    w = w.gather(1, pos)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the T*k (row, expert) pairs, grouped by expert
    xs = x.index_select(0, order // k)  # one gather: each expert's rows lie together
    ys = torch.empty_like(xs)
    counts = torch.bincount(flat, minlength=n_expert).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n:
            ys[start:start + n] = expert(e, xs[start:start + n])
            start += n
    # back to (row, expert) order by the inverse permutation (a gather: no index_add_, whose CPU kernel
    # costs milliseconds on a one-row step), weighted, and each row's k outputs summed one by one
    ys = ys.index_select(0, torch.argsort(order)).view(T, k, -1).mul_(w.to(x.dtype).unsqueeze(-1))
    out = ys[:, 0].clone()
    for j in range(1, k):
        out += ys[:, j]
    return out


def expert_rows(w: Weight) -> list[Weight]:
    """The experts of a stacked [E, ...] weight as E Weights of ``shape[1:]``: views of the file's
    blocks where ``w`` keeps them (``raw``: no copy, so an idle expert's pages are never read),
    else float32 slices."""
    if w.raw is not None:
        return [Weight(w.shape[1:], raw=w.raw[e], source_type=w.source_type) for e in range(w.shape[0])]
    arr = w.to_dense()
    return [Weight(w.shape[1:], dense=np.ascontiguousarray(arr[e], dtype=np.float32), source_type=w.source_type)
            for e in range(w.shape[0])]


def expert_linear(weights: list[Weight], bias: list[Weight] | None, lin: dict):
    """One expert's Linear over ``weights`` (row blocks, fused). Experts kept as GGUF blocks take
    ``lin``'s kernel (the block kernels under "auto"); float32 experts stay dense float32 (their
    values as the file gives them: no int8 requantization of a few rows)."""
    from kvserve.models.llama import Linear

    if any(w.raw is None for w in weights):
        lin = {**lin, "kernel": "dense", "small_max_rows": 0, "native_q4": False}
    return Linear(weights, bias, **lin)


# -- the qwen3moe family --------------------------------------------------------------------------------

def config_from_gguf(md: dict, path: str, shapes: dict | None = None) -> MoeConfig:
    """A MoeConfig from ``qwen3moe.*`` GGUF metadata (llama.cpp's keys: expert_count,
    expert_used_count, expert_feed_forward_length); every layer is a MoE layer."""
    from kvserve.models.family import llama_config_from_gguf

    arch = md.get("general.architecture")
    base = llama_config_from_gguf(md, path, shapes, qk_norm=True)

    def get(key):
        v = md.get(f"{arch}.{key}")
        if v is None:
            raise ModelLoadError(f"{path}: missing GGUF key '{arch}.{key}'")
        return int(v)

    kw = {f: getattr(base, f) for f in ModelConfig.__slots__}
    return MoeConfig(**kw, n_expert=get("expert_count"), n_expert_used=get("expert_used_count"),
                     n_ff_expert=get("expert_feed_forward_length"))


def config_from_hf(cfg: dict, path: str) -> MoeConfig:
    """A MoeConfig from config.json (transformers' Qwen3MoeConfig: ``num_experts`` or
    ``num_local_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``,
    ``mlp_only_layers``, ``decoder_sparse_step``)."""
    from kvserve.models.family import llama_config_from_hf

    base = llama_config_from_hf(cfg, path, arch="qwen3moe", qk_norm=True)
    n_expert = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    try:
        top_k, width = int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"])
    except KeyError as e:
        raise ModelLoadError(f"{path}: config.json lacks {e.args[0]!r}") from None
    if not n_expert:
        raise ModelLoadError(f"{path}: config.json lacks 'num_experts'")
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = set(cfg.get("mlp_only_layers") or [])
    dense = tuple(i for i in range(base.n_layer) if i in only or (i + 1) % step)
    kw = {f: getattr(base, f) for f in ModelConfig.__slots__}
    return MoeConfig(**kw, n_expert=n_expert, n_expert_used=top_k, n_ff_expert=width,
                     expert_weights_norm=bool(cfg.get("norm_topk_prob", True)), dense_layers=dense)


def hf_tensor_name(name: str, config=None) -> str | None:
    """kvserve's name of an HF qwen3moe tensor (per-expert ones as ``blk.N.ffn_X_exps.J.weight``,
    stacked by :func:`prepare`); None for tensors not used."""
    from kvserve.models.family import llama_hf_tensor_name

    if name.startswith("model.layers.") and ".mlp." in name:
        idx, _, sub = name[len("model.layers."):].partition(".")
        if sub == "mlp.gate.weight":
            return f"blk.{idx}.ffn_gate_inp.weight"
        if sub.startswith("mlp.experts."):
            j, _, rest = sub[len("mlp.experts."):].partition(".")
            kind = {"gate_proj.weight": "gate", "up_proj.weight": "up", "down_proj.weight": "down"}.get(rest)
            return f"blk.{idx}.ffn_{kind}_exps.{j}.weight" if kind and j.isdigit() else None
    return llama_hf_tensor_name(name, config)


def required_tensors(config: MoeConfig, weights: dict) -> list[str]:
    """Attention as qwen3's; per MoE layer the router and the experts (stacked, or per expert as an HF
    directory has them); a dense MLP on the others."""
    from kvserve.models.family import llama_required_tensors

    ffn = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
    needed = []
    for name in llama_required_tensors(config):
        i = int(name.split(".")[1]) if name.startswith("blk.") else -1
        if i >= 0 and config.is_moe(i) and name.split(".", 2)[2] in ffn:
            kind = name.split(".", 2)[2].split(".")[0]  # ffn_gate / ffn_up / ffn_down
            stacked = f"blk.{i}.{kind}_exps.weight"
            needed += [stacked] if stacked in weights else [f"blk.{i}.{kind}_exps.{j}.weight"
                                                            for j in range(config.n_expert)]
            if kind == "ffn_gate":
                needed.append(f"blk.{i}.ffn_gate_inp.weight")
            continue
        needed.append(name)
    return needed


def prepare(config: MoeConfig, weights: dict[str, Weight], fmt: str) -> None:
    """HF per-expert tensors stacked into [E, out, in]; Q/K rows and q/k norms to interleaved pairs."""
    for i in range(config.n_layer):
        for kind in ("gate", "up", "down"):
            parts = [weights.pop(f"blk.{i}.ffn_{kind}_exps.{j}.weight", None) for j in range(config.n_expert)]
            if parts[0] is not None:
                arr = np.stack([p.to_dense() for p in parts])
                weights[f"blk.{i}.ffn_{kind}_exps.weight"] = Weight(arr.shape, dense=arr,
                                                                    source_type=parts[0].source_type)
    interleave_qk(config, weights)


def build_moe(config: MoeConfig, weights: dict[str, Weight], layer: int, device, lin: dict | None = None) -> MoE:
    """Layer ``layer``'s MoE FFN; ``lin``: the Linear options of the model's projections (default:
    float32, dense, on ``device``)."""
    p = f"blk.{layer}."
    lin = lin or dict(dtype=torch.float32, device=device, kernel="dense")
    return MoE(weights[p + "ffn_gate_inp.weight"], weights[p + "ffn_gate_exps.weight"],
               weights[p + "ffn_up_exps.weight"], weights[p + "ffn_down_exps.weight"],
               config.n_expert_used, config.expert_weights_norm, lin)
