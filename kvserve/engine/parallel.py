"""Tensor and pipeline parallelism on torch.distributed (vLLM's ``-tp`` / ``-pp``).

:class:`ParallelRunner` has :class:`~kvserve.engine.model_runner.ModelRunner`'s interface, so the
engine and the faces keep their shape (issue 18 item 4). Rank 0 is the server process: it
runs the scheduler and the samplers and holds shard (or stage) 0; ranks 1 .. N-1 run
:func:`worker_main`, a loop that receives each step's inputs and runs its part of the model.

* **Tensor parallel** (``tp`` ranks, Megatron-style, :func:`shard_weights`): q|k|v and gate|up
  are split by output rows (rank r: its query heads and their KV heads; with tp > KV heads each
  KV head is replicated on tp / kv_heads ranks, vLLM's ``max(1, kv_heads // tp)``), attn_output
  and ffn_down by input columns with an all-reduce after them (:class:`RowParallel`); the output
  head is split by vocabulary rows and the logits gathered to rank 0 (:class:`VocabParallelHead`).
  The embedding and the norms are replicated. Each rank's KV pool holds its heads, with the same
  block ids (one KVCacheManager, on rank 0).
* **Pipeline parallel** (``pp`` ranks): contiguous layer ranges (:func:`layer_ranges`, the
  first stage holds the embedding, the last the final norm and head); activations go from
  stage to stage with ``isend``/``irecv``, and a step's chunks are split into up to ``pp``
  micro-batches so that stage s works on micro-batch m while stage s-1 works on m+1.
* **Step messages**: each step rank 0 broadcasts one int64 tensor (token ids, positions,
  cache rows, decode index and lengths, prefill groups, logits rows, KV shift and copy jobs), no
  pickles: one broadcast of :data:`HEADER` values when it fits (a decode step of a few streams),
  else that header and then the payload.
* **Start**: on one machine rank 0 starts the N-1 workers itself (``python -m
  kvserve.engine.parallel``, MASTER_ADDR 127.0.0.1, a free MASTER_PORT; they check in to its
  TCPStore before the rendezvous); with RANK set (torchrun: RANK / WORLD_SIZE / MASTER_ADDR /
  MASTER_PORT) it joins that group instead (:func:`environment_error`: RANK 0, WORLD_SIZE = tp x pp).
  Rank 0 sends every worker the model path and the engine settings; each worker reads the
  model file itself and builds its shard.
* **Lifetime**: workers die with the server (PR_SET_PDEATHSIG, a parent-pid watch, a broken
  group); rank 0 polls its children (also during the start-up join: a worker that exits fails the
  load at once, and a server shutting down abandons it), and a lost worker makes the next step
  raise :class:`ParallelWorkerLost`, which the engine thread does not retry; the watch thread also
  tells :attr:`ParallelRunner.lost_listeners` at once (AsyncEngine.fail), so an idle server's
  engine is dead within ~0.2 s: every request gets the engine-dead error and ``/health`` answers 500.

Backends: gloo on the CPU, NCCL on CUDA. tp and pp together: rank = stage * tp + tensor rank,
a tensor-parallel group per stage, hidden states from (stage, t) to (stage + 1, t).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from kvserve.engine.kv_quant import kv_bytes_per_token, kv_data
from kvserve.engine.model_runner import ModelRunner, PreparedBatch, StepResult
from kvserve.loaders.weights import ModelConfig, Weight
from kvserve.models.llama import AttentionBatch, LlamaModel, PrefillGroup

log = logging.getLogger("kvserve.engine")

#: seconds a collective may wait (gloo/NCCL timeout at init_process_group); an idle server sends a
#: heartbeat every quarter of it so that waiting workers never time out
TIMEOUT_S = float(os.environ.get("KVSERVE_PARALLEL_TIMEOUT", "120"))

#: int64 values of the fixed first broadcast of every message: [op, payload length, payload if it fits]
HEADER = 512
# step-message op codes
_NOP, _STEP, _READ, _WRITE, _STOP = 0, 1, 2, 3, 4


class ParallelWorkerLost(BaseException):
    """A worker process of a tensor/pipeline-parallel group died or stopped answering.

    A BaseException on purpose: EngineCore retries a step that raised an Exception (and
    fails its requests); a broken group never recovers, so this one goes through the step
    to the engine thread, which marks the engine dead (every stream gets EngineDeadError,
    ``/health`` answers 500)."""


# -- the plan ---------------------------------------------------------------------------

def parallel_error(config: ModelConfig, tp: int, pp: int) -> str | None:
    """vLLM's start-up check of a parallel layout for ``config``, or None when it is valid.

    * attention heads not divisible by tp: vLLM's text (ModelConfig.verify_with_parallel_config),
      e.g. SmolLM2 tp=2: "Total number of attention heads (9) must be divisible by tensor parallel
      size (2).";
    * KV heads: tp must divide them or be a multiple of them (vLLM's QKVParallelLinear: a KV head
      is replicated on tp / kv_heads ranks);
    * pp above the layer count (a stage without layers);
    * a model with pieces the shards do not cut yet (q/k norm, output or MLP biases, windows,
      experts, phi3's RoPE, mistral3's query temperature).
    """
    if tp < 1 or pp < 1:
        return f"tensor and pipeline parallel sizes must be at least 1, got tp={tp} pp={pp}"
    extras = [n for n in ("qk_norm", "attn_bias", "mlp_bias", "layer_windows", "n_expert", "rope_dim",
                          "attn_temp_beta") if getattr(config, n, False)]
    if extras and tp * pp > 1:
        return (f"tensor and pipeline parallelism run the plain llama block only; this model has "
                f"{', '.join(extras)} ({config.arch})")
    if config.n_head % tp:
        return (f"Total number of attention heads ({config.n_head}) must be divisible by tensor parallel "
                f"size ({tp}).")
    kv = config.n_head_kv
    if (tp <= kv and kv % tp) or (tp > kv and tp % kv):
        return (f"Total number of KV heads ({kv}) must be divisible by tensor parallel size ({tp}), or the "
                f"tensor parallel size a multiple of it.")
    if pp > config.n_layer:
        return (f"Pipeline parallel size ({pp}) must not exceed the number of hidden layers "
                f"({config.n_layer}).")
    return None


def environment_error(tp: int, pp: int, environ=None) -> str | None:
    """Start-up check of a torch.distributed group in the environment against ``-tp`` x ``-pp``,
    or None when they agree.

    kvserve joins an existing group exactly when ``RANK`` is set (torchrun sets RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT; MASTER_* are read by env:// when it joins); without RANK it starts its
    own workers and ignores (overrides) WORLD_SIZE / MASTER_*. So with RANK set: it must be 0 (the
    server; other ranks run ``python -m kvserve.engine.parallel``) and WORLD_SIZE must equal
    tp x pp, also for tp x pp = 1 (a one-process server would leave the group's other ranks waiting
    out their timeout); ``RANK=0 WORLD_SIZE=1`` is one process."""
    env = os.environ if environ is None else environ
    if "RANK" not in env:
        return None
    world = tp * pp
    if env["RANK"] != "0":
        return (f"RANK={env['RANK']} in the environment: kvserve serve is rank 0 of a parallel group; other ranks run "
                f"python -m kvserve.engine.parallel")
    ws = env.get("WORLD_SIZE")
    if ws != str(world):
        return (f"RANK=0 WORLD_SIZE={ws} in the environment (a torch.distributed group to join) but tp x pp = "
                f"{world} (tp={tp} pp={pp}): give -tp/-pp for the group's size, or unset RANK to start "
                f"{'one process' if world == 1 else 'the workers here'}")
    return None


def layer_ranges(n_layer: int, pp: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges [a, b) per stage; the first ``n_layer % pp`` stages get one more
    layer (30 layers, pp=4: 8, 8, 7, 7)."""
    base, extra = divmod(n_layer, pp)
    out, a = [], 0
    for s in range(pp):
        b = a + base + (1 if s < extra else 0)
        out.append((a, b))
        a = b
    return out


@dataclass(frozen=True)
class RankPlan:
    """What one rank holds.

    Attributes:
        rank, tp, pp: this rank and the layout; tp_rank = rank % tp, stage = rank // tp.
        layers: [a, b) global layer range.
        q_heads: [a, b) query heads; kv_heads: [a, b) KV heads (one replicated head when tp > kv_heads).
        ff: [a, b) rows of gate/up (columns of down); vocab: [a, b) rows of the output head.
        first, last: holds the embedding / the final norm and head (pipeline stages).
    """

    rank: int
    tp: int
    pp: int
    layers: tuple[int, int]
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    ff: tuple[int, int]
    vocab: tuple[int, int]
    first: bool
    last: bool

    @property
    def n_kv(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def rank_plan(config: ModelConfig, tp: int, pp: int, rank: int) -> RankPlan:
    """The :class:`RankPlan` of ``rank`` (raises ValueError for a layout :func:`parallel_error` refuses)."""
    err = parallel_error(config, tp, pp)
    if err:
        raise ValueError(err)
    t, s = rank % tp, rank // tp
    nq, kv = config.n_head, config.n_head_kv
    per_q = nq // tp
    q = (t * per_q, (t + 1) * per_q)
    if tp <= kv:
        per_kv = kv // tp
        k = (t * per_kv, (t + 1) * per_kv)
    else:  # replicated: tp / kv ranks share one KV head, the one their query heads read
        h = q[0] // (nq // kv)
        k = (h, h + 1)
    ff = (config.n_ff * t // tp, config.n_ff * (t + 1) // tp)
    vpr = -(-config.n_vocab // tp)
    vocab = (min(t * vpr, config.n_vocab), min((t + 1) * vpr, config.n_vocab))
    return RankPlan(rank, tp, pp, layer_ranges(config.n_layer, pp)[s], q, k, ff, vocab, s == 0, s == pp - 1)


def layout_lines(config: ModelConfig, tp: int, pp: int, kv_type: str, kv_type_v: str,
                 weight_bytes: list[int]) -> list[str]:
    """Start-up log lines: the seed's per-GPU table (002 Example 5) for this model, one line per rank
    and a summary in the seed's form ("tp=2 pp=1  GPUs=2  weights/GPU=...  layers/GPU=...  KV heads/GPU=...
    KV/token/GPU=... KiB", ranks in place of GPUs, MiB for this size of model)."""
    lines = []
    for r in range(tp * pp):
        p = rank_plan(config, tp, pp, r)
        n_layers = p.layers[1] - p.layers[0]
        kvt = kv_bytes_per_token(n_layers, p.n_kv, config.head_dim, kv_type, kv_type_v)
        lines.append(f"rank {r}: weights {weight_bytes[r] / 2**20:.1f} MiB, layers {p.layers[0]}-{p.layers[1] - 1} "
                     f"({n_layers}), query heads {p.q_heads[0]}-{p.q_heads[1] - 1}, KV heads {p.kv_heads[0]}-"
                     f"{p.kv_heads[1] - 1} ({p.n_kv} of {config.n_head_kv}), KV/token {kvt / 1024:.2f} KiB")
    p0 = rank_plan(config, tp, pp, 0)
    kvt0 = kv_bytes_per_token(p0.layers[1] - p0.layers[0], p0.n_kv, config.head_dim, kv_type, kv_type_v)
    lines.append(f"tp={tp} pp={pp}  ranks={tp * pp}  weights/rank={max(weight_bytes) / 2**20:.1f} MiB  "
                 f"layers/rank={p0.layers[1] - p0.layers[0]}  KV heads/rank={p0.n_kv}  "
                 f"KV/token/rank={kvt0 / 1024:.2f} KiB")
    return lines


# -- sharding ---------------------------------------------------------------------------

def _slice_cols(w: Weight, a: int, b: int, notes: set[str], name: str) -> Weight:
    """Input features [a, b) of a matrix: packed 4-bit blocks stay packed when a and b are multiples
    of the 32-value block, else the slice is dequantized (noted in ``notes``)."""
    out = w.shape[0]
    if w.raw is not None:  # GGUF blocks other than Q4_0/Q4_1: cut from their float32 values
        w = Weight(w.shape, dense=w.to_dense(), source_type=w.source_type)
    if w.dense is not None:
        return Weight((out, b - a), dense=np.ascontiguousarray(w.dense[:, a:b]), source_type=w.source_type)
    if a % 32 == 0 and b % 32 == 0:
        return Weight((out, b - a), q4=np.ascontiguousarray(w.q4[:, a:b]),
                      q4_scale=np.ascontiguousarray(w.q4_scale[:, a // 32: b // 32]),
                      q4_zero=np.ascontiguousarray(w.q4_zero[:, a // 32: b // 32]), source_type=w.source_type)
    notes.add(f"{name}: columns {a}-{b} cut a 32-value block: dequantized to float32")
    return Weight((out, b - a), dense=np.ascontiguousarray(w.to_dense()[:, a:b]), source_type="F32")


def shard_weights(config: ModelConfig, weights: dict[str, Weight],
                  plan: RankPlan) -> tuple[ModelConfig, dict[str, Weight], list[str]]:
    """The config and weights of one rank's LlamaModel, and notes on how they were cut.

    The shard is an ordinary LlamaModel of ``n_head = heads / tp``, ``n_head_kv`` its KV heads,
    ``n_ff / tp`` and the stage's layers renumbered from 0 (so its forward runs unchanged); the
    embedding is the whole one (replicated), the head ``output.weight`` its vocabulary rows. A
    pipeline stage that is not the first gets a 1-row stand-in embedding, one that is not the last a
    16-row stand-in head (both unused: :func:`build_shard` drops the head and final norm).
    Column splits (q|k|v, gate|up, head) take whole rows: 4-bit blocks stay packed; row splits
    (attn_output, ffn_down) keep them packed at multiples of 32 columns, else dequantize.
    """
    c = config
    hd = c.head_dim
    notes: set[str] = set()
    (q0, q1), (k0, k1), (f0, f1), (v0, v1) = plan.q_heads, plan.kv_heads, plan.ff, plan.vocab
    a, b = plan.layers
    tp = plan.tp
    out: dict[str, Weight] = {}
    for j, i in enumerate(range(a, b)):
        src, dst = f"blk.{i}.", f"blk.{j}."
        for n in ("attn_norm.weight", "ffn_norm.weight"):
            out[dst + n] = weights[src + n]
        for x, (h0, h1) in (("q", (q0, q1)), ("k", (k0, k1)), ("v", (k0, k1))):
            for kind in ("weight", "bias"):
                w = weights.get(src + f"attn_{x}.{kind}")
                if w is not None:
                    out[dst + f"attn_{x}.{kind}"] = w if tp == 1 else w.rows(h0 * hd, h1 * hd)
        wo, down = weights[src + "attn_output.weight"], weights[src + "ffn_down.weight"]
        out[dst + "attn_output.weight"] = wo if tp == 1 else _slice_cols(wo, q0 * hd, q1 * hd, notes, "attn_output")
        out[dst + "ffn_down.weight"] = down if tp == 1 else _slice_cols(down, f0, f1, notes, "ffn_down")
        for n in ("ffn_gate.weight", "ffn_up.weight"):
            out[dst + n] = weights[src + n] if tp == 1 else weights[src + n].rows(f0, f1)
    emb = weights["token_embd.weight"]
    out["token_embd.weight"] = emb if plan.first else Weight((1, c.n_embd), dense=np.zeros((1, c.n_embd), np.float32))
    head = emb if c.tie_embeddings or "output.weight" not in weights else weights["output.weight"]
    if plan.last:
        out["output.weight"] = head if tp == 1 else head.rows(v0, v1)
        out["output_norm.weight"] = weights["output_norm.weight"]
    else:
        out["output.weight"] = Weight((16, c.n_embd), dense=np.zeros((16, c.n_embd), np.float32))
        out["output_norm.weight"] = weights["output_norm.weight"]
    shard = dataclasses.replace(c, n_layer=b - a, n_head=q1 - q0, n_head_kv=k1 - k0, n_ff=f1 - f0,
                                tie_embeddings=c.tie_embeddings and tp == 1 and plan.first and plan.last)
    if tp > 1:
        packed = any(w.q4 is not None for w in weights.values())
        notes.add("q|k|v, gate|up and the head split by whole rows" + (" (4-bit blocks kept packed)" if packed else ""))
        notes.add("embedding and norms replicated on every rank")
    return shard, out, sorted(notes)


class RowParallel(nn.Module):
    """A row-parallel linear: this rank's input columns, then a sum over the tensor-parallel ranks
    (``all_reduce``). [T, in / tp] float32 -> [T, out] float32. Counts calls and their seconds in
    ``stats``."""

    def __init__(self, inner: nn.Module, stats: CommStats, group=None):
        super().__init__()
        self.inner = inner
        self.stats = stats
        self.group = group  # the stage's tensor-parallel group (None: every rank)
        self.kernel, self.weight, self.small_max_rows, self.q4w = inner.kernel, inner.weight, inner.small_max_rows, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner.forward(x)
        t0 = time.perf_counter()
        dist.all_reduce(y, group=self.group)
        self.stats.allreduce_calls += 1
        self.stats.allreduce_s += time.perf_counter() - t0
        return y


class VocabParallelHead(nn.Module):
    """The output head split by vocabulary rows: this rank's logits, gathered to the first rank of its
    tensor-parallel group (global rank ``dst``: rank 0, or the last pipeline stage's first rank).

    [R, E] -> that rank: [R, n_vocab] float32 (the ranks' slices in order, padding dropped); the
    others: their own [R, ceil(n_vocab / tp)] slice."""

    def __init__(self, inner: nn.Module, n_vocab: int, tp: int, rank: int, stats: CommStats, dst: int = 0,
                 group=None):
        super().__init__()
        self.inner, self.n_vocab, self.tp, self.rank, self.stats = inner, n_vocab, tp, rank, stats
        self.dst, self.group = dst, group
        self.per = -(-n_vocab // tp)
        self.kernel, self.weight, self.small_max_rows, self.q4w = inner.kernel, inner.weight, inner.small_max_rows, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner.forward(x).float()
        if y.shape[1] < self.per:
            y = torch.nn.functional.pad(y, (0, self.per - y.shape[1]))
        y = y.contiguous()
        t0 = time.perf_counter()
        if self.rank == self.dst:
            parts = [torch.empty_like(y) for _ in range(self.tp)]
            dist.gather(y, parts, dst=self.dst, group=self.group)
            y = torch.cat(parts, dim=1)[:, : self.n_vocab]
        else:
            dist.gather(y, None, dst=self.dst, group=self.group)
        self.stats.gather_calls += 1
        self.stats.gather_s += time.perf_counter() - t0
        return y


def tp_groups(tp: int, pp: int) -> list:
    """The tensor-parallel group of each pipeline stage (ranks s*tp .. s*tp + tp - 1), created on every
    rank in the same order (torch.distributed.new_group's rule); [None] (the default group) without pp."""
    if tp == 1 or pp == 1:
        return [None] * pp
    return [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]


def build_shard(loaded_config: ModelConfig, weights: dict[str, Weight], plan: RankPlan, build, stats: CommStats,
                group=None) -> tuple[LlamaModel, list[str]]:
    """One rank's LlamaModel: ``build(config, weights)`` (kvserve.models.build's numerics) of
    :func:`shard_weights`, with RowParallel after attn_output / ffn_down and a VocabParallelHead
    under tp (over ``group``, the stage's tensor-parallel group), and no final norm / head on a
    pipeline stage that is not the last."""
    shard_cfg, shard_w, notes = shard_weights(loaded_config, weights, plan)
    model = build(shard_cfg, shard_w)
    if plan.tp > 1:
        for layer in model.layers:
            layer.wo = RowParallel(layer.wo, stats, group)
            layer.w_down = RowParallel(layer.w_down, stats, group)
        first = plan.rank - plan.rank % plan.tp
        model.output = VocabParallelHead(model.output, loaded_config.n_vocab, plan.tp, plan.rank, stats, first, group)
    if not plan.last:
        model.output = model.output_norm = None
    return model, notes


def model_bytes(model: LlamaModel) -> int:
    """Bytes of the tensors a model holds (weights, packed forms, dense copies; a tensor shared by
    two attributes counted once)."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.nbytes

    add(model.tok_embd)
    total += model.embedding_nbytes() if model.tok_embd is None else 0  # GGUF blocks of the table
    mods = [m for layer in model.layers for m in layer.modules()]
    mods += [m for m in (model.output, model.output_norm) if m is not None]
    for m in mods:
        for k in ("weight", "bias", "packed", "scales", "q8"):
            add(getattr(m, k, None))
        blocks = getattr(m, "blocks", None)  # GGUF blocks (numpy views of the file's mapping)
        total += blocks.nbytes if blocks is not None else 0
    return total


# -- step messages ----------------------------------------------------------------------

@dataclass
class CommStats:
    """Communication counters of one rank (seconds are wall time inside the calls).

    Attributes:
        steps: steps broadcast; bcast_s: time in the step broadcasts; bcast_bytes: their payload.
        allreduce_calls / allreduce_s: tensor-parallel all-reduces; gather_calls / gather_s: logits gathers.
        p2p_s: pipeline sends/receives waited for on rank 0 (the last stage's logits included).
        micro_batches: pipeline micro-batches run (more than ``steps`` when steps were split).
    """

    steps: int = 0
    bcast_s: float = 0.0
    bcast_bytes: int = 0
    allreduce_calls: int = 0
    allreduce_s: float = 0.0
    gather_calls: int = 0
    gather_s: float = 0.0
    p2p_s: float = 0.0
    micro_batches: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _encode_batch(parts: list, batch: PreparedBatch) -> None:
    """Append one prepared batch to ``parts`` (int64 numpy arrays): sizes, then the arrays."""
    attn = batch.attn
    nd = attn.n_decode
    idx = attn.decode_kv_index
    B, L = (idx.shape[0], idx.shape[1]) if nd else (0, 0)
    mask = attn.decode_mask
    need = batch.need
    parts.append(np.array([batch.n_rows, nd, B, L, 0 if mask is None else 1, len(attn.prefills),
                           -1 if need is None else need.shape[0]], dtype=np.int64))
    parts += [batch.input_ids.cpu().numpy(), attn.positions.cpu().numpy(), attn.slot_mapping.cpu().numpy()]
    if nd:
        parts.append(idx.reshape(-1).cpu().numpy())
        lens = np.full(B, L, np.int64) if mask is None else mask.view(B, L).sum(dim=1).cpu().numpy().astype(np.int64)
        parts.append(lens)
    for g in attn.prefills:
        n_kv = -1 if g.kv_index is None else g.kv_index.shape[0]
        parts.append(np.array([g.start, g.end, g.n_past, int(g.per_row), n_kv], dtype=np.int64))
        if g.kv_index is not None:
            parts.append(g.kv_index.cpu().numpy())
    if need is not None:
        parts.append(need.cpu().numpy())


class _Reader:
    """Cursor over a decoded int64 payload."""

    def __init__(self, data: np.ndarray):
        self.d, self.i = data, 0

    def take(self, n: int) -> np.ndarray:
        out = self.d[self.i: self.i + n]
        self.i += n
        return out

    def int(self) -> int:
        return int(self.take(1)[0])


def _decode_batch(r: _Reader, device) -> tuple[torch.Tensor, AttentionBatch, torch.Tensor | None, int]:
    """The inverse of :func:`_encode_batch`: (input_ids, attention batch, need or None, rows of logits)."""
    T, nd, B, L, has_mask, n_pre, n_need = (int(x) for x in r.take(7))

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    ids, pos, slots = t(r.take(T)), t(r.take(T)), t(r.take(T))
    attn = AttentionBatch(positions=pos, slot_mapping=slots, n_decode=nd)
    if nd:
        attn.decode_kv_index = t(r.take(B * L)).view(B, L)
        lens = torch.from_numpy(np.ascontiguousarray(r.take(B)))
        if has_mask:
            lens_d = lens.to(device)
            attn.decode_mask = (torch.arange(L, device=device)[None, :] < lens_d[:, None]).view(B, 1, 1, L)
        if hasattr(attn, "decode_lens"):  # the native decode step's form (kept as rank 0 builds it)
            attn.decode_lens = lens
    for _ in range(n_pre):
        s, e, n_past, per_row, n_kv = (int(x) for x in r.take(5))
        kv_index = t(r.take(n_kv)) if n_kv >= 0 else None
        attn.prefills.append(PrefillGroup(s, e, n_past, kv_index, per_row=bool(per_row)))
    need = t(r.take(n_need)) if n_need >= 0 else None
    return ids, attn, need, (T if need is None else n_need)


def _encode_step(shifts, copies, batches: list[PreparedBatch]) -> np.ndarray:
    parts: list = [np.array([len(shifts)], np.int64), np.asarray(shifts, np.int64).reshape(-1),
                   np.array([len(copies)], np.int64), np.asarray(copies, np.int64).reshape(-1),
                   np.array([len(batches)], np.int64)]
    for b in batches:
        _encode_batch(parts, b)
    return np.concatenate(parts)


def _decode_jobs(r: _Reader) -> list[tuple[int, int, int]]:
    n = r.int()
    return [tuple(int(v) for v in row) for row in r.take(3 * n).reshape(n, 3)] if n else []


def split_micro_batches(chunks: list, n: int) -> list[list[int]]:
    """Chunk indices in at most ``n`` groups of about equal token counts (largest chunks first onto
    the lightest group), each group in chunk order; empty groups are dropped."""
    groups: list[list[int]] = [[] for _ in range(max(1, min(n, len(chunks))))]
    load = [0] * len(groups)
    for ci in sorted(range(len(chunks)), key=lambda i: -chunks[i].num_new_tokens):
        g = load.index(min(load))
        groups[g].append(ci)
        load[g] += chunks[ci].num_new_tokens
    return [sorted(g) for g in groups if g]


# -- the group --------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _engine_config_dict(config) -> dict:
    """The EngineConfig fields a worker needs (no speculative decoding: drafts live on rank 0)."""
    d = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "spec"}
    return d


def _build_fn(config, max_positions: int):
    """``(shard config, weights) -> LlamaModel`` with registry.build_model's numerics."""
    from kvserve.loaders.weights import LoadedModel
    from kvserve.models.build import build_model

    cfg = dataclasses.replace(config, compile=False, native_kernels=False)

    def build(shard_cfg, shard_w):
        model = build_model(LoadedModel(shard_cfg, None, shard_w, None), cfg, max_positions=max_positions)
        if getattr(model, "native_decode", False):  # a whole-model native step would skip the collectives
            model.native_decode = False
        return model
    return build


class _Comm:
    """Rank 0's side of the group: the step channel (a lock serializes the engine thread and the
    heartbeat), the worker processes it started, and their watch."""

    def __init__(self, world: int, device: torch.device):
        self.world = world
        self.device = device
        self.lock = threading.Lock()
        self.procs: list[subprocess.Popen] = []
        self.lost: str | None = None
        self.closed = False
        self.last_send = time.monotonic()
        self.joiner: threading.Thread | None = None  # the start-up join (ParallelRunner.__init__)

    def check(self) -> None:
        """Raise ParallelWorkerLost when a worker is known to be gone."""
        if self.lost is None:
            for r, p in enumerate(self.procs, start=1):
                rc = p.poll()
                if rc is not None:
                    how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
                    self.lost = f"parallel worker rank {r} (pid {p.pid}) exited ({how})"
        if self.lost is not None:
            raise ParallelWorkerLost(self.lost)

    def send(self, op: int, payload: np.ndarray | None, stats: CommStats | None = None) -> None:
        """Broadcast the message from rank 0: one int64 tensor of HEADER values [op, n, payload...]
        when the payload fits (a decode step of a few streams), else the header and then the payload."""
        t0 = time.perf_counter()
        n = 0 if payload is None else payload.shape[0]
        head = np.zeros(HEADER, np.int64)
        head[0], head[1] = op, n
        if 0 < n <= HEADER - 2:
            head[2: 2 + n] = payload
        dist.broadcast(torch.from_numpy(head).to(self.device), src=0)
        if n > HEADER - 2:
            dist.broadcast(torch.from_numpy(payload).to(self.device), src=0)
        self.last_send = time.monotonic()
        if stats is not None:
            stats.steps += 1
            stats.bcast_s += time.perf_counter() - t0
            stats.bcast_bytes += 8 * HEADER + (8 * n if n > HEADER - 2 else 0)

    def fail(self, e: BaseException) -> ParallelWorkerLost:
        """The error to raise after a collective failed: a dead worker named when one is (waiting
        up to a second for the process to be reaped), else the collective's own error."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                self.check()
            except ParallelWorkerLost as lost:
                return lost
            time.sleep(0.05)
        self.lost = f"the parallel group broke: {type(e).__name__}: {e}"
        return ParallelWorkerLost(self.lost)

    def kill(self, grace: float = 3.0) -> None:
        """Terminate the workers this process started (SIGTERM, then SIGKILL after ``grace`` s)."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _watch(ref, interval: float) -> None:
    """Rank 0's watch thread: polls the workers (marks the group lost) and sends a heartbeat to an idle
    group every quarter of the timeout, so that waiting workers never time out."""
    while True:
        time.sleep(interval)
        runner = ref()
        if runner is None:
            return
        comm = runner._comm
        if comm.closed:
            return
        try:
            comm.check()
        except ParallelWorkerLost as lost:
            log.error("%s: the engine is dead", comm.lost)
            for fn in list(runner.lost_listeners):
                try:
                    fn(lost)
                except Exception:  # noqa: BLE001 - the next step still raises it
                    log.exception("parallel lost-worker listener %r failed", fn)
            return
        if time.monotonic() - comm.last_send > TIMEOUT_S / 4 and comm.lock.acquire(blocking=False):
            try:
                if not comm.closed and comm.lost is None:
                    comm.send(_NOP, None)
            except Exception as e:  # noqa: BLE001 - the next step reports it
                comm.fail(e)
            finally:
                comm.lock.release()
        del runner


#: a start-up join given up on (its rendezvous waits out TIMEOUT_S): torch.distributed cannot form
#: another group in this process until it ends
_abandoned_join: threading.Thread | None = None


def _refuse_while_abandoned() -> None:
    """ModelLoadError while an abandoned start-up join of this process still waits."""
    from kvserve.loaders.weights import ModelLoadError

    j = _abandoned_join
    if j is not None and j.is_alive():
        raise ModelLoadError(f"an earlier parallel start-up in this process is still waiting for its group "
                             f"(up to KVSERVE_PARALLEL_TIMEOUT={TIMEOUT_S:g} s): try again later")


def _await_check_in(store, comm: _Comm, interval: float = 0.05) -> None:
    """Wait until every spawned worker has set its ``kvserve/ready/<rank>`` key in rank 0's store
    (before any collective), watching the processes and the server as :func:`_await_join` does; a
    worker that never checks in fails at TIMEOUT_S (ModelLoadError)."""
    from kvserve.loaders.weights import ModelLoadError

    keys = [f"kvserve/ready/{r}" for r in range(1, comm.world)]
    deadline = time.monotonic() + TIMEOUT_S
    while not store.check(keys):
        _check_forming(comm)
        if time.monotonic() > deadline:
            comm.lost = f"parallel workers did not start within {TIMEOUT_S:g} s (KVSERVE_PARALLEL_TIMEOUT)"
            raise ModelLoadError(comm.lost)
        time.sleep(interval)


def _check_forming(comm: _Comm) -> None:
    """While the group forms: ModelLoadError when a spawned worker exited (naming it) or the server
    is shutting down (the main thread ended while another thread loads)."""
    from kvserve.loaders.weights import ModelLoadError

    try:
        comm.check()
    except ParallelWorkerLost as e:
        raise ModelLoadError(f"{e} while the parallel group formed") from None
    main = threading.main_thread()
    if threading.current_thread() is not main and not main.is_alive():
        comm.lost = "the server shut down while the parallel group formed"
        raise ModelLoadError(comm.lost)


def _await_join(joiner: threading.Thread, comm: _Comm, interval: float = 0.1) -> None:
    """Wait for the start-up join (``joiner``: rendezvous, settings broadcast, shard status gather)
    while watching what the collectives cannot: a spawned worker that exits (ModelLoadError naming
    it, at once, instead of gloo's wait for the whole timeout) and a server that is shutting down
    (the main thread ended, e.g. SIGTERM during start-up: ModelLoadError). Waiting in short slices
    also lets SIGINT / SIGTERM handlers run when this is the main thread. The caller then stops
    the workers (reaped) and leaves the group."""
    while True:
        joiner.join(interval)
        if not joiner.is_alive():
            return
        _check_forming(comm)


def _weight_memory_env() -> str:
    """KVSERVE_MMAP for spawned workers: the mode this process loads GGUF weights in now ("1" the
    file's mapping, "0" read into memory; kvserve.loaders.gguf._weight_memory), so a load that sets
    it for itself (Ollama's ``use_mmap``, kvserve.serving.chat_runner.weight_memory) holds every
    rank's shard the same way, not only rank 0's."""
    from kvserve.loaders import gguf

    return "1" if gguf._weight_memory() == "mmap" else "0"


class ParallelRunner(ModelRunner):
    """ModelRunner over a tensor- or pipeline-parallel group; this process is rank 0.

    Args:
        loaded: the LoadedModel (rank 0's shard is cut from its weights; ``loaded.info.path`` is
            the file every worker reads).
        config: EngineConfig with ``tensor_parallel_size`` / ``pipeline_parallel_size``.
        num_blocks, block_size: the KV pool geometry (the same block ids on every rank).
        max_positions: RoPE table size.

    Raises:
        ValueError: a layout :func:`parallel_error` refuses. ModelLoadError: a worker could not
        load its shard (its message). RuntimeError: the group could not be formed.

    Attributes:
        stats: :class:`CommStats` of rank 0. plans: every rank's :class:`RankPlan`.
        world, tp, pp: sizes. micro_batches: micro-batches per pipeline step (default pp).
        lost_listeners: callables ``(ParallelWorkerLost) -> None`` the watch thread calls once when a
            worker is lost (AsyncEngine registers its ``fail``: the engine dies without a step).
    """

    def __init__(self, loaded, config, num_blocks: int, block_size: int, max_positions: int):
        c = loaded.config
        self.tp, self.pp = config.tensor_parallel_size, config.pipeline_parallel_size
        err = parallel_error(c, self.tp, self.pp)
        if err:
            raise ValueError(err)
        _refuse_while_abandoned()
        self.world = self.tp * self.pp
        self.full_config = c
        self.plans = [rank_plan(c, self.tp, self.pp, r) for r in range(self.world)]
        self.micro_batches = self.pp
        self.stats = CommStats()
        device = torch.device(config.resolve_device())
        self._comm = _Comm(self.world, device)
        cores = os.cpu_count() or 1
        threads = config.threads if config.threads > 0 else max(1, cores // self.world)
        if self.world > cores:
            log.warning("%d ranks on %d CPU cores: less than one core per rank, the ranks share cores (each runs "
                        "%d thread%s)", self.world, cores, threads, "" if threads == 1 else "s",
                        extra={"func": "load_model"})
        torch.set_num_threads(threads)
        if config.compile:
            log.info("--compile with tensor/pipeline parallelism: the engine runs eagerly")
        spawned = "RANK" not in os.environ
        env_err = environment_error(self.tp, self.pp)
        if env_err:
            raise RuntimeError(env_err)
        if spawned:
            port = _free_port()
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(self.world),
                       KVSERVE_PARALLEL_BACKEND=_backend(device),
                       OMP_NUM_THREADS=str(threads), KVSERVE_PARALLEL_PARENT=str(os.getpid()),
                       KVSERVE_PARALLEL_CHECK_IN="1", KVSERVE_MMAP=_weight_memory_env())
            if threading.current_thread() is threading.main_thread():
                env["KVSERVE_PARALLEL_PDEATHSIG"] = "1"  # PDEATHSIG follows the spawning thread
            for r in range(1, self.world):
                self._comm.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "kvserve.engine.parallel"], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                    stdin=subprocess.DEVNULL))
            # our own store, not waiting for its clients: the workers check in (a key each) and the
            # rendezvous starts once all have, so a worker lost before that leaves no half-made group
            store = dist.TCPStore("127.0.0.1", port, self.world, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=TIMEOUT_S))
            init = None
        else:  # torchrun (its agent's store) or MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE by hand
            init, store = "env://", None
        self._finalizer = weakref.finalize(self, _shutdown, self._comm)
        status = [None] * self.world
        joined: dict = {}

        def join() -> None:  # the rendezvous and the first collectives: a thread, watched below
            try:
                dist.init_process_group(_backend(device), init_method=init, store=store, rank=0,
                                        world_size=self.world, timeout=timedelta(seconds=TIMEOUT_S))
                dist.broadcast_object_list([{
                    "model": str(loaded.info.path), "config": _engine_config_dict(config), "num_blocks": num_blocks,
                    "block_size": block_size, "max_positions": max_positions, "threads": threads}], src=0)
                groups = tp_groups(self.tp, self.pp)
                joined["model"], joined["notes"] = build_shard(c, loaded.weights, self.plans[0],
                                                               _build_fn(config, max_positions), self.stats, groups[0])
                dist.gather_object({"ok": True, "bytes": model_bytes(joined["model"]), "notes": joined["notes"],
                                    "pid": os.getpid()}, status, dst=0)
            except BaseException as e:  # noqa: BLE001 - raised again by the waiting thread
                joined["error"] = e

        joiner = threading.Thread(target=join, name="kvserve-parallel-join", daemon=True)
        try:
            if store is not None:
                _await_check_in(store, self._comm)
            joiner.start()
            self._comm.joiner = joiner
            _await_join(joiner, self._comm)
            if "error" in joined:
                raise joined["error"]
        except BaseException:
            self._finalizer()
            raise
        model, notes = joined.pop("model"), joined.pop("notes")
        bad = [s for s in status if not s.get("ok")]
        if bad:
            self._finalizer()
            from kvserve.loaders.weights import ModelLoadError

            raise ModelLoadError(f"parallel worker failed to load its shard: {bad[0]['error']}")
        self.worker_pids = [s["pid"] for s in status[1:]]
        self._jobs: tuple = ([], [])
        self._verify_samplers = len(inspect.signature(ModelRunner.verify).parameters) >= 4
        super().__init__(model, num_blocks, block_size, config.kv_dtype, device, kv_dtype_v=config.kv_dtype_v)
        for line in layout_lines(c, self.tp, self.pp, *self.kv_types, [s["bytes"] for s in status]):
            log.info("%s", line, extra={"func": "load_model"})
        for note in notes:
            log.info("tensor parallel: %s", note, extra={"func": "load_model"})
        self.lost_listeners: list = []  # callables(ParallelWorkerLost), from the watch thread (AsyncEngine.fail)
        self._watch = threading.Thread(target=_watch, args=(weakref.ref(self), 0.2), name="kvserve-parallel-watch",
                                       daemon=True)
        self._watch.start()

    # -- the interface --------------------------------------------------------------------

    def start_compile(self, max_rows: int):
        """No compiled graph with tp/pp > 1: the engine stays eager (logged at start-up)."""
        return

    def execute(self, sched, kv, samplers) -> StepResult:
        """One step over the group (see ModelRunner.execute); raises ParallelWorkerLost when the group
        broke. Tensor parallel: ModelRunner's step, its forward (:meth:`run`) broadcast first.
        Pipeline parallel: the chunks in micro-batches (:func:`split_micro_batches`) through the
        stages, sampled per micro-batch."""
        if self.pp == 1:
            self._jobs = (sched.kv_shifts, sched.kv_copies)
            return super().execute(sched, kv, samplers)
        chunks = sched.chunks
        groups = split_micro_batches(chunks, self.micro_batches)
        batches = [self.prepare([chunks[i] for i in g], kv) for g in groups]
        self.stats.micro_batches += len(batches)
        payload = _encode_step(sched.kv_shifts, sched.kv_copies, batches)
        with self._comm.lock:
            self._comm.check()
            try:
                self._comm.send(_STEP, payload, self.stats)
                self.shift_rows(sched.kv_shifts)
                self.copy_blocks(sched.kv_copies)
                logits_list = self._pipeline(batches)
            except ParallelWorkerLost:
                raise
            except Exception as e:
                raise self._comm.fail(e) from e
        n = len(chunks)
        samples, plps, verified = [None] * n, [None] * n, [None] * n
        for g, b, logits in zip(groups, batches, logits_list):
            ver = self.verify(b, logits, samplers) if self._verify_samplers else self.verify(b, logits)
            for i, s, p, v in zip(g, self.sample(b, logits, samplers), self.prompt_logprobs(b, logits), ver):
                samples[i], plps[i], verified[i] = s, p, v
        return StepResult(samples, plps, verified)

    def run(self, batch: PreparedBatch) -> torch.Tensor:
        """Tensor parallel: broadcast the step (the KV jobs of :meth:`execute` and this batch), then
        the forward, whose all-reduces and logits gather the workers join; rank 0 gets the logits.
        (ModelRunner.shift_rows / copy_blocks already ran on rank 0: the workers run them before
        their forward too.)"""
        payload = _encode_step(*self._jobs, [batch])
        comm = self._comm
        with comm.lock:
            comm.check()
            try:
                comm.send(_STEP, payload, self.stats)
                return self.model(batch.input_ids, batch.attn, self.kv_caches, batch.need)
            except ParallelWorkerLost:
                raise
            except Exception as e:
                raise comm.fail(e) from e

    def _pipeline(self, batches: list[PreparedBatch]) -> list[torch.Tensor]:
        """Stage 0's part of a pipelined step: each micro-batch's layers, sent on at once (isend),
        while the later stages work; then the logits of every micro-batch from the last stage."""
        last = (self.pp - 1) * self.tp  # the last stage's first rank holds the gathered logits
        V = self.full_config.n_vocab
        recvs = []
        for m, b in enumerate(batches):
            rows = b.n_rows if b.need is None else b.need.shape[0]
            buf = torch.empty(rows, V, dtype=torch.float32, device=self.device)
            recvs.append((buf, dist.irecv(buf, src=last, tag=1000 + m)))
        sends = []
        for m, b in enumerate(batches):
            h = self.model(b.input_ids, b.attn, self.kv_caches, None).contiguous()
            sends.append((h, dist.isend(h, dst=self.tp, tag=m)))  # the next stage's first rank
        t0 = time.perf_counter()
        for _, w in sends:
            w.wait()
        out = []
        for buf, w in recvs:
            w.wait()
            out.append(buf)
        self.stats.p2p_s += time.perf_counter() - t0
        return out

    def read_rows(self, rows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer of the whole model (K, V) of cache ``rows`` in their stored form, every rank's
        heads and layers put together (see ModelRunner.read_rows)."""
        rows = rows.to(torch.long).cpu()
        N = rows.shape[0]
        comm = self._comm
        c = self.full_config
        k0, v0 = kv_data(self.kv_caches[0][0]), kv_data(self.kv_caches[0][1])
        full = [(torch.empty(N, c.n_head_kv, *k0.shape[2:], dtype=k0.dtype),
                 torch.empty(N, c.n_head_kv, *v0.shape[2:], dtype=v0.dtype)) for _ in range(c.n_layer)]
        with comm.lock:
            comm.check()
            try:
                comm.send(_READ, np.concatenate([[N], rows.numpy()]).astype(np.int64))
                mine = super().read_rows(rows)
                for r, plan in enumerate(self.plans):
                    if r == 0:
                        parts = mine
                    else:
                        parts = self._recv_rows(r, plan, N, k0, v0)
                    for j, (ks, vs) in enumerate(parts):
                        l = plan.layers[0] + j
                        h0, h1 = plan.kv_heads
                        full[l][0][:, h0:h1] = ks
                        full[l][1][:, h0:h1] = vs
            except ParallelWorkerLost:
                raise
            except Exception as e:
                raise comm.fail(e) from e
        return full

    def _recv_rows(self, r: int, plan: RankPlan, N: int, k0, v0):
        n_layers = plan.layers[1] - plan.layers[0]
        kshape, vshape = (N, plan.n_kv, *k0.shape[2:]), (N, plan.n_kv, *v0.shape[2:])
        kb = int(np.prod(kshape)) * k0.element_size()
        vb = int(np.prod(vshape)) * v0.element_size()
        buf = torch.empty(n_layers * (kb + vb), dtype=torch.uint8, device=self.device)
        dist.recv(buf, src=r, tag=2000)
        buf = buf.cpu()
        out = []
        for j in range(n_layers):
            o = j * (kb + vb)
            out.append((buf[o: o + kb].view(k0.dtype).view(kshape), buf[o + kb: o + kb + vb].view(v0.dtype).view(vshape)))
        return out

    def write_rows(self, rows: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write per-layer (K, V) of the whole model into cache ``rows``: broadcast to every rank, each
        keeping its heads and layers (see ModelRunner.write_rows)."""
        rows = rows.to(torch.long).cpu()
        N = rows.shape[0]
        k0, v0 = kv_data(self.kv_caches[0][0]), kv_data(self.kv_caches[0][1])
        blob = torch.cat([t.to(dtype).contiguous().view(torch.uint8).reshape(-1)
                          for ks, vs in layers for t, dtype in ((ks, k0.dtype), (vs, v0.dtype))])
        comm = self._comm
        with comm.lock:
            comm.check()
            try:
                comm.send(_WRITE, np.concatenate([[N, blob.numel()], rows.numpy()]).astype(np.int64))
                dist.broadcast(blob.to(self.device), src=0)
            except Exception as e:
                raise comm.fail(e) from e
        super().write_rows(rows, _my_layers(self.plans[0], layers))

    def close(self) -> None:
        """Stop every worker (a stop message, then SIGTERM / SIGKILL for one that does not exit) and
        leave the group. Idempotent."""
        self._finalizer()


def _my_layers(plan: RankPlan, layers):
    h0, h1 = plan.kv_heads
    return [(k[:, h0:h1], v[:, h0:h1]) for k, v in layers[plan.layers[0]: plan.layers[1]]]


def _shutdown(comm: _Comm) -> None:
    """Stop message to the workers (when the group is whole), their processes reaped, group left."""
    if comm.closed:
        return
    comm.closed = True
    got = comm.lock.acquire(timeout=5.0)
    try:
        if comm.lost is None and dist.is_initialized():
            try:
                comm.send(_STOP, None)
            except Exception as e:  # noqa: BLE001 - the processes are killed below
                log.debug("parallel stop message not sent: %s", e)
    finally:
        if got:
            comm.lock.release()
    comm.kill()
    if comm.joiner is not None:  # an abandoned join ends once its peers are gone (or at its timeout)
        comm.joiner.join(2.0)
        if comm.joiner.is_alive():
            global _abandoned_join
            _abandoned_join = comm.joiner
            log.debug("parallel start-up join still waiting: the group is not left")
            return
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - leaving a broken group
            log.debug("destroy_process_group: %s", e)


# -- the worker -------------------------------------------------------------------------

def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG(SIGTERM) when the parent asked for it, and a thread that exits when the parent
    process is gone (the parent pid changes): no orphan workers."""
    parent = int(os.environ.get("KVSERVE_PARALLEL_PARENT", "0"))
    if os.environ.get("KVSERVE_PARALLEL_PDEATHSIG") == "1":
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass
    if parent:
        if os.getppid() != parent:
            os._exit(1)

        def watch():
            while True:
                time.sleep(0.5)
                if os.getppid() != parent:
                    os._exit(1)
        threading.Thread(target=watch, daemon=True, name="kvserve-parent-watch").start()


def worker_main(model_path: str | None = None) -> int:
    """A worker rank: join the group from the environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT), receive the model path and engine settings from rank 0, load the file
    (``model_path`` overrides rank 0's path: another machine's copy), build this rank's shard, then
    serve step messages until the stop message or a broken group. Returns the exit status."""
    _die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from kvserve.config import EngineConfig

    backend = os.environ.get("KVSERVE_PARALLEL_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    if os.environ.get("KVSERVE_PARALLEL_CHECK_IN") == "1":  # spawned by rank 0: its store, check in first
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                              timeout=timedelta(seconds=TIMEOUT_S))
        store.set(f"kvserve/ready/{rank}", "1")
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=TIMEOUT_S))
    else:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                timeout=timedelta(seconds=TIMEOUT_S))
    box = [None]
    dist.broadcast_object_list(box, src=0)
    msg = box[0]
    cfg = EngineConfig(**msg["config"])
    dev = torch.device(cfg.resolve_device())
    torch.set_num_threads(msg["threads"])
    stats = CommStats()
    try:
        from kvserve.models.build import load_files

        loaded = load_files(model_path or msg["model"])
        plan = rank_plan(loaded.config, cfg.tensor_parallel_size, cfg.pipeline_parallel_size, rank)
        groups = tp_groups(plan.tp, plan.pp)
        model, notes = build_shard(loaded.config, loaded.weights, plan, _build_fn(cfg, msg["max_positions"]), stats,
                                   groups[plan.rank // plan.tp])
        full_config = loaded.config
        del loaded
        runner = ModelRunner(model, msg["num_blocks"], msg["block_size"], cfg.kv_dtype, dev, kv_dtype_v=cfg.kv_dtype_v)
        status = {"ok": True, "bytes": model_bytes(model), "notes": notes, "pid": os.getpid()}
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
        status = {"ok": False, "error": f"rank {rank}: {type(e).__name__}: {e}", "pid": os.getpid()}
    dist.gather_object(status, None, dst=0)
    if not status["ok"]:
        return 1
    try:
        _serve(runner, plan, full_config, dev)
    except Exception as e:  # noqa: BLE001 - the group broke (rank 0 gone): exit
        print(f"kvserve parallel worker rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - leaving a broken group
            log.debug("destroy_process_group: %s", e)
    return 0


def _serve(runner: ModelRunner, plan: RankPlan, full_config: ModelConfig, dev) -> None:
    """The worker loop: one step message at a time (see ParallelRunner)."""
    model = runner.model
    hdr = torch.empty(HEADER, dtype=torch.long, device=dev)
    while True:
        dist.broadcast(hdr, src=0)
        head = hdr.cpu().numpy()
        op, n = int(head[0]), int(head[1])
        if op == _STOP:
            return
        data = None
        if 0 < n <= HEADER - 2:
            data = head[2: 2 + n].copy()
        elif n:
            buf = torch.empty(n, dtype=torch.long, device=dev)
            dist.broadcast(buf, src=0)
            data = buf.cpu().numpy()
        if op == _NOP:
            continue
        r = _Reader(data)
        if op == _STEP:
            shifts, copies = _decode_jobs(r), _decode_jobs(r)
            runner.shift_rows(shifts)
            runner.copy_blocks(copies)
            batches = [_decode_batch(r, dev) for _ in range(r.int())]
            if plan.pp == 1:
                ids, attn, need, _ = batches[0]
                model(ids, attn, runner.kv_caches, need)
                continue
            # stage s, tensor rank t: hidden states from (s-1, t), to (s+1, t); the last stage's first
            # rank sends the gathered logits to rank 0
            sends = []
            tp, t = plan.tp, plan.rank % plan.tp
            for m, (ids, attn, need, rows) in enumerate(batches):
                h = None
                if not plan.first:
                    h = torch.empty(ids.shape[0], full_config.n_embd, dtype=model.compute_dtype, device=dev)
                    dist.recv(h, src=plan.rank - tp, tag=m)
                if plan.last:
                    out = model(ids, attn, runner.kv_caches, need, hidden=h)
                    if t == 0:
                        out = out.contiguous()
                        sends.append((out, dist.isend(out, dst=0, tag=1000 + m)))
                else:
                    out = model(ids, attn, runner.kv_caches, None, hidden=h).contiguous()
                    sends.append((out, dist.isend(out, dst=plan.rank + tp, tag=m)))
            for _, w in sends:
                w.wait()
        elif op == _READ:
            N = r.int()
            rows = torch.from_numpy(np.ascontiguousarray(r.take(N)))
            layers = runner.read_rows(rows)
            blob = torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for kv in layers for t in kv])
            dist.send(blob.to(dev), dst=0, tag=2000)
        elif op == _WRITE:
            N, nbytes = r.int(), r.int()
            rows = torch.from_numpy(np.ascontiguousarray(r.take(N)))
            blob = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            dist.broadcast(blob, src=0)
            blob = blob.cpu()
            k0, v0 = kv_data(runner.kv_caches[0][0]), kv_data(runner.kv_caches[0][1])
            H = full_config.n_head_kv
            kshape, vshape = (N, H, *k0.shape[2:]), (N, H, *v0.shape[2:])
            kb, vb = int(np.prod(kshape)) * k0.element_size(), int(np.prod(vshape)) * v0.element_size()
            layers = []
            for j in range(full_config.n_layer):
                o = j * (kb + vb)
                layers.append((blob[o: o + kb].view(k0.dtype).view(kshape),
                               blob[o + kb: o + kb + vb].view(v0.dtype).view(vshape)))
            runner.write_rows(rows, _my_layers(plan, layers))


def main(argv: list[str] | None = None) -> int:
    """``python -m kvserve.engine.parallel [--model PATH]``: a worker rank (see :func:`worker_main`)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvserve.engine.parallel",
                                description="a kvserve tensor/pipeline-parallel worker rank (RANK >= 1); "
                                            "rank 0 is `kvserve serve -tp N` / `-pp N`")
    p.add_argument("--model", default=None, help="this machine's path of the model file (default: rank 0's path)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    return worker_main(a.model)


if __name__ == "__main__":
    sys.exit(main())
