"""BERT-family encoders (bidirectional, absolute positions, post-norm): embeddings and cross-encoder scores.

One module covers what differs only in config: with or without token type embeddings, GELU
(exact or tanh), ReLU or SiLU in the FFN, any hidden size and head count, an optional classifier
head (``BertForSequenceClassification``: the pooler's dense + tanh, then the classifier). Weights
arrive under llama.cpp's GGUF names, whichever loader read them:

=====================================  ====================================================
``token_embd.weight`` [V, E]            ``embeddings.word_embeddings``
``token_types.weight`` [n_types, E]     ``embeddings.token_type_embeddings`` (optional)
``position_embd.weight`` [P, E]         ``embeddings.position_embeddings``
``token_embd_norm.{weight,bias}``       ``embeddings.LayerNorm``
``blk.N.attn_{q,k,v}.{weight,bias}``    ``encoder.layer.N.attention.self.{query,key,value}``
``blk.N.attn_qkv.{weight,bias}``        the three fused (some GGUF files)
``blk.N.attn_output.{weight,bias}``     ``...attention.output.dense``
``blk.N.attn_output_norm.*``            ``...attention.output.LayerNorm``
``blk.N.ffn_up.*`` / ``ffn_down.*``     ``...intermediate.dense`` / ``...output.dense``
``blk.N.layer_output_norm.*``           ``...output.LayerNorm``
``cls.{weight,bias}``                   ``pooler.dense`` (applied with tanh; optional)
``cls.output.{weight,bias}``            ``classifier`` (``[n_labels, E]``; optional)
=====================================  ====================================================

nomic-bert (kvserve.models.nomic_bert) runs here too: no ``position_embd`` but rotary positions
on q and k (NEOX half-split, ``BertConfig.rope_base``), a gated FFN (``ffn_gate``: ``down(silu(gate(x))
* up(x))``, ``BertConfig.gated_ffn``) and no projection biases (every bias is optional).

The score head follows llama.cpp's rank pooling: the first token's hidden state, through
``tanh(cls)`` when present, then ``cls.output``. llama.cpp's converter drops the pooler, so a
GGUF reranker converted by it has ``cls.output`` only; an HF directory keeps the pooler and
scores as transformers does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvserve.loaders.weights import Weight
from kvserve.models.bert_config import (  # noqa: F401 - BertConfig, the module reads; the rest re-exported
    LAYER_TENSORS,
    POOLING_MODES,
    BertConfig,
)

#: activations of the FFN by HF ``hidden_act`` name
ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_python": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def _t(w: Weight | None, device) -> torch.Tensor | None:
    return None if w is None else torch.from_numpy(np.ascontiguousarray(w.to_dense(), dtype=np.float32)).to(device)


class BertModel(nn.Module):
    """A BERT encoder in float32.

    Args:
        config: BertConfig.
        weights: Weight by GGUF tensor name (see the module docstring).
        device: torch device.

    Attention is bidirectional over each input's own tokens: a padded batch carries a key mask,
    so an input's vectors do not depend on what else is in the batch (beyond float rounding of
    different matrix shapes).
    """

    def __init__(self, config: BertConfig, weights: dict[str, Weight], device="cpu"):
        super().__init__()
        self.config = config
        self.device = torch.device(device)
        c = config
        dev = self.device
        self.tok_embd = _t(weights["token_embd.weight"], dev)  # [V, E]
        # [P, E] learned positions; None with rotary ones (nomic-bert)
        self.pos_embd = None if c.rope_base else _t(weights["position_embd.weight"], dev)
        self.type_embd = _t(weights.get("token_types.weight"), dev) if c.n_token_types else None  # [n_types, E]
        self.embd_norm = (_t(weights["token_embd_norm.weight"], dev), _t(weights["token_embd_norm.bias"], dev))
        self.layers = [self._layer(weights, f"blk.{i}.", dev) for i in range(c.n_layer)]
        self.inv_freq = None  # [D/2] rotary frequencies (nomic-bert)
        if c.rope_base:
            self.inv_freq = 1.0 / (c.rope_base ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64, device=dev)
                                                   / c.head_dim))
        self.cls = (_t(weights["cls.weight"], dev), _t(weights.get("cls.bias"), dev)) if "cls.weight" in weights else None
        self.cls_out = ((_t(weights["cls.output.weight"], dev), _t(weights.get("cls.output.bias"), dev))
                        if "cls.output.weight" in weights else None)
        self.act = ACTIVATIONS[c.activation]
        self.scale = 1.0 / math.sqrt(c.head_dim)

    def _layer(self, weights: dict[str, Weight], p: str, dev) -> tuple:
        """One layer's tensors: (wqkv, bqkv, wo, bo, norm1 w/b, up w/b, down w/b, norm2 w/b, gate w/b);
        biases a file lacks are None (nomic-bert has none), the gate None without a gated FFN."""
        def get(name):
            return _t(weights.get(p + name), dev)

        if p + "attn_qkv.weight" in weights:
            wqkv, bqkv = get("attn_qkv.weight"), get("attn_qkv.bias")
        else:
            wqkv = torch.cat([get(f"attn_{x}.weight") for x in "qkv"])  # [3E, E]
            biases = [get(f"attn_{x}.bias") for x in "qkv"]
            bqkv = None if any(b is None for b in biases) else torch.cat(biases)
        return (wqkv, bqkv, *(get(f"{n}.{w}") for n in ("attn_output", "attn_output_norm", "ffn_up", "ffn_down",
                                                        "layer_output_norm", "ffn_gate") for w in ("weight", "bias")))

    @property
    def n_params(self) -> int:
        """Parameters held (counts)."""
        ts = [self.tok_embd, self.pos_embd, self.type_embd, *self.embd_norm]
        ts += [t for layer in self.layers for t in layer]
        for head in (self.cls, self.cls_out):
            if head:
                ts += list(head)
        return sum(t.numel() for t in ts if t is not None)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, token_types: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of a padded batch.

        Args:
            input_ids: [B, L] long (padding: any valid id, e.g. ``pad_token_id``).
            token_types: [B, L] long segment ids, or None (all 0).
            mask: [B, L] bool, True for real tokens, each row's real tokens first (right
                padding); None when nothing is padded.

        Returns:
            [B, L, E] float32; rows of padding positions are 0.

        Only the real tokens go through the projections, norms and FFN (packed as [T, E]:
        the work follows the tokens, not B * L). Attention runs per group of inputs of similar
        length (:func:`attention_groups`), each padded only to its own longest input, with a key
        mask where lengths differ.
        """
        c = self.config
        B, L = input_ids.shape
        if L > c.n_ctx_train:
            raise ValueError(f"input of {L} tokens exceeds the {c.n_ctx_train} positions of the model")
        dev = input_ids.device
        if mask is None or bool(mask.all()):
            rows, groups = None, None
            pos = torch.arange(L, device=dev).repeat(B)
        else:
            rows = mask.reshape(-1).nonzero().squeeze(1)  # [T] flat positions of the real tokens
            pos = rows % L
            groups = _packed_groups(mask.sum(1).tolist(), dev)
        ids = input_ids.reshape(-1) if rows is None else input_ids.reshape(-1)[rows]  # [T]
        x = self.tok_embd[ids]  # [T, E]
        if self.pos_embd is not None:
            x = x + self.pos_embd[pos]
        if self.type_embd is not None:
            if token_types is None:
                x = x + self.type_embd[0]
            else:
                tt = token_types.reshape(-1)
                x = x + self.type_embd[tt if rows is None else tt[rows]]
        E, H, D = c.n_embd, c.n_head, c.head_dim
        x = F.layer_norm(x, (E,), *self.embd_norm, eps=c.norm_eps)
        rot = None if self.inv_freq is None else _rotary(pos, self.inv_freq)
        for wqkv, bqkv, wo, bo, n1w, n1b, wup, bup, wdown, bdown, n2w, n2b, wgate, bgate in self.layers:
            qkv = F.linear(x, wqkv, bqkv)  # [T, 3E]
            if rot is not None:
                qkv = _rotate_qk(qkv.view(-1, 3, H, D), *rot).view(-1, 3 * E)
            if groups is None:
                o = self._attend(qkv.view(B, L, 3, H, D), None).reshape(B * L, E)
            else:
                o = x.new_empty(x.shape[0], E)
                for g in groups:  # each group padded to its own longest input only
                    og = self._attend(qkv.index_select(0, g.gather).view(g.n, g.length, 3, H, D), g.mask)
                    og = og.reshape(g.n * g.length, E)
                    o.index_copy_(0, g.dst, og if g.src is None else og.index_select(0, g.src))
            x = F.layer_norm(x + F.linear(o, wo, bo), (E,), n1w, n1b, eps=c.norm_eps)  # post-norm
            if wgate is None:
                h = F.linear(self.act(F.linear(x, wup, bup)), wdown, bdown)
            else:  # nomic-bert's SwiGLU
                h = F.linear(self.act(F.linear(x, wgate, bgate)) * F.linear(x, wup, bup), wdown, bdown)
            x = F.layer_norm(x + h, (E,), n2w, n2b, eps=c.norm_eps)
        if rows is None:
            return x.view(B, L, E)
        return x.new_zeros(B * L, E).index_copy_(0, rows, x).view(B, L, E)

    def _attend(self, qkv: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """[n, l, 3, H, D] projections -> [n, l, H, D] attention outputs (``mask``: [n, 1, 1, l] keys)."""
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # 3 x [n, H, l, D]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale).transpose(1, 2)

    @torch.inference_mode()
    def classify(self, first: torch.Tensor) -> torch.Tensor:
        """Score head: [B, E] first-token hidden states -> [B, n_labels] float32 logits.

        ``tanh(cls)`` (the HF pooler) when the model has it, then ``cls.output`` (the classifier).

        Raises:
            ValueError: the model has no classifier (an embedding model).
        """
        if self.cls_out is None:
            raise ValueError("the model has no classifier head")
        x = first
        if self.cls is not None:
            x = torch.tanh(F.linear(x, *self.cls))
        return F.linear(x, *self.cls_out)


def _rotary(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, 1, D] float32 of the NEOX half-split rotary at positions ``pos`` [T]."""
    ang = pos.to(torch.float64)[:, None] * inv_freq[None, :]  # [T, D/2]
    ang = torch.cat([ang, ang], dim=-1)[:, None, :]
    return ang.cos().float(), ang.sin().float()


def _rotate_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[T, 3, H, D] projections with q and k rotated (half-split pairs ``i``, ``i + D/2``)."""
    q, k, v = qkv.unbind(1)
    half = q.shape[-1] // 2

    def rot(x):
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    return torch.stack([rot(q), rot(k), v], dim=1)


#: an attention group may pad its inputs up to this factor of its shortest one's length
GROUP_PAD_RATIO = 1.25


def attention_groups(lengths: list[int], ratio: float = GROUP_PAD_RATIO) -> list[list[int]]:
    """Inputs of a batch cut into runs of similar length for attention.

    Args:
        lengths: token counts of the B inputs (each >= 1), in batch order.
        ratio: the longest input of a group is at most ``ratio`` x its shortest (and every
            group has at least one input).

    Returns:
        Groups of batch indices, each in ascending length, covering every input once. One
        group with all inputs when the whole batch pads by no more than ``ratio``.

    Attention costs each group ``n x longest^2``: padding 60-token inputs with 8-token ones,
    as one padded batch of random lengths does, spends most of it on masked keys.
    """
    order = sorted(range(len(lengths)), key=lambda b: lengths[b])
    groups: list[list[int]] = []
    for b in order:
        if groups and lengths[b] <= ratio * lengths[groups[-1][0]]:
            groups[-1].append(b)
        else:
            groups.append([b])
    return groups


@dataclass(slots=True)
class _Group:
    """One attention group over the packed [T, ...] rows of a batch.

    ``gather``: [n * length] packed row of each padded position (a padding position repeats a
    real row of its input: its key is masked and its output dropped); ``mask``: [n, 1, 1,
    length] bool, None when every input of the group has ``length`` tokens; ``src``: padded
    positions of the real tokens (None: all); ``dst``: their packed rows.
    """

    n: int
    length: int
    gather: torch.Tensor
    mask: torch.Tensor | None
    src: torch.Tensor | None
    dst: torch.Tensor


def _packed_groups(lengths: list[int], device) -> list[_Group]:
    """The :class:`_Group` index tensors of a right-padded batch packed row-major (input b's
    tokens at packed rows ``offset[b] .. offset[b] + lengths[b] - 1``)."""
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    out = []
    for g in attention_groups(lengths):
        n, length = len(g), max(lengths[b] for b in g)
        lens = np.asarray([lengths[b] for b in g], dtype=np.int64)
        j = np.arange(length, dtype=np.int64)[None, :]
        real = j < lens[:, None]  # [n, length]
        gather = offsets[g][:, None] + np.minimum(j, lens[:, None] - 1)
        uniform = bool(real.all())
        dst = gather[real]
        out.append(_Group(
            n=n, length=length, gather=torch.from_numpy(gather.reshape(-1)).to(device),
            mask=None if uniform else torch.from_numpy(real[:, None, None, :]).to(device),
            src=None if uniform else torch.from_numpy(np.flatnonzero(real.reshape(-1))).to(device),
            dst=torch.from_numpy(dst).to(device)))
    return out
