"""ModelRunner: the only code that touches devices.

It owns the KV tensors, turns a :class:`SchedulerOutput` into one flat batch
(token ids, positions, cache rows, attention groups), runs the model and
samples the next token of every sequence whose known tokens are all cached
after this step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.kv_quant import canonical_kv_type, head_dim_error, kv_data, kv_gather, kv_write, new_kv_cache
from kvserve.engine.sampler import SampleResult, SequenceSampler, compute_logprobs, sample_batch
from kvserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from kvserve.engine.spec_decode import speculative_accept
from kvserve.lora.registry import LoraRegistry
from kvserve.models.decode_native import NativeDecode
from kvserve.models.llama import AttentionBatch, CompiledDecode, LlamaModel, PrefillGroup

log = logging.getLogger("kvserve.engine")

#: vLLM's start-up line for a float8 KV cache (CacheConfig._verify_cache_dtype), logged as vLLM logs it
FP8_KV_LOG = ("Using fp8 data type to store kv cache. It reduces the GPU memory footprint and boosts the "
              "performance. Meanwhile, it may cause accuracy drop without a proper scaling factor")

#: the float KV types, stored as plain tensors of these dtypes (the others: kvserve.engine.kv_quant)
KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@dataclass(slots=True)
class StepResult:
    """Per scheduled chunk (same order): the sampled token (None when the chunk
    did not complete the sequence) and, when asked for, prompt logprobs of the
    chunk's tokens as (logprob [n], top ids [n, k], top logprobs [n, k]) tensors
    for positions start+1 .. start+n (the logprob of token i+1 given tokens
    <= i)."""

    samples: list[SampleResult | SampleFailure | None]
    prompt_logprobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]
    #: per chunk: for a verification chunk (speculative decoding) the target's greedy token
    #: at each of its positions (1 + drafts: argmax of the raw logits, the token plain
    #: greedy sampling would pick there), else None
    verified: list[list[int] | None] | None = None


def _log_native_build() -> None:
    """Say that the native decode step is being compiled and how long that may take (the first
    start on a machine, or after a torch upgrade; measured: 25 s idle, 449 s on a busy 2-core one)."""
    from kvserve.models.decode_native import build_dir

    log.info("building the native decode step (C++, once per machine and torch version, cached in %s): "
             "about 25 s on an idle machine, several minutes on a busy one; decoding eagerly until it is ready",
             build_dir())


class ModelRunner:
    """Runs steps of the model over a paged KV cache.

    Args:
        model: LlamaModel.
        num_blocks, block_size: KV pool geometry (blocks, tokens per block).
        kv_dtype: K's cache type, llama-server's ``-ctk`` name: "f32" | "f16" | "bf16" |
            "q8_0" | "q4_0", or a float8 type ("fp8" = "fp8_e4m3", "fp8_e5m2"; vLLM's
            ``--kv-cache-dtype``); see :mod:`kvserve.engine.kv_quant`.
        device: torch device of the model.
        kv_dtype_v: V's cache type (``-ctv``); None = the same as K's.
        groups: sliding-window layer groups, as the KV cache manager's ``groups`` (same order):
            (window in tokens, layer indices, blocks of the group's own pool). Those layers'
            caches hold that many blocks and are addressed by the group's block tables (the
            batch carries a view per window: ``AttentionBatch.windows``); the other layers by
            the manager's own tables (``num_blocks``).

    Memory: ``num_blocks * block_size * kv_bytes_per_token(n_layer, n_head_kv, head_dim,
    kv_dtype, kv_dtype_v)`` bytes (:attr:`kv_bytes`, the tensors' own nbytes): f16 2
    bytes per value, q8_0 34/32, q4_0 18/32, fp8 1.

    Raises:
        ValueError: an unknown type, or q8_0/q4_0 with a head_dim that is not a multiple of 32.
    """

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, kv_dtype: str = "f16",
                 device: str | torch.device = "cpu", kv_dtype_v: str | None = None,
                 groups: list[tuple[int, tuple[int, ...], int]] | None = None):
        self.kv_types = (canonical_kv_type(kv_dtype), canonical_kv_type(kv_dtype_v or kv_dtype))
        c = model.config
        for t in self.kv_types:
            err = head_dim_error(t, c.head_dim)
            if err:
                raise ValueError(err)
        if any(t.startswith("fp8") for t in self.kv_types):
            log.info(FP8_KV_LOG)
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.groups = list(groups or [])
        #: per layer: the sliding group whose tables address its cache (-1: the manager's own)
        self.layer_group = [-1] * c.n_layer
        blocks_of = [num_blocks] * c.n_layer
        for gi, (_, layers, nb) in enumerate(self.groups):
            for i in layers:
                self.layer_group[i], blocks_of[i] = gi, nb
        tk, tv = self.kv_types
        # torch.empty: pages of the host tier cost memory only once written; block 0
        # (the null block, never allocated) is zeroed because padding reads it (all-zero
        # bytes are 0.0 in every stored type: a zero q8_0/q4_0 scale, fp8 +0)
        self.kv_caches = [
            (new_kv_cache(tk, nb * block_size, c.n_head_kv, c.head_dim, self.device),
             new_kv_cache(tv, nb * block_size, c.n_head_kv, c.head_dim, self.device))
            for nb in blocks_of
        ]
        for k, v in self.kv_caches:
            kv_data(k)[:block_size].zero_()
            kv_data(v)[:block_size].zero_()
        self.kv_bytes = sum(kv_data(k).nbytes + kv_data(v).nbytes for k, v in self.kv_caches)
        self.compiled: CompiledDecode | None = None  # set by EngineCore with config.compile
        #: the native decode step (kvserve.models.decode_native), when the model asked for it
        self.native: NativeDecode | None = None
        #: decode-only steps run by the eager model or the compiled graph (not the native step)
        self.eager_decode_steps = 0
        #: the model's LoRA adapters (kvserve.lora): steps with adapter rows run the native decode step
        #: (decode-only steps) or the eager model
        self.lora = LoraRegistry(model)
        #: steps run eagerly because they carried LoRA rows (prefill chunks; decode-only steps where the
        #: native step is off or refused an adapter; the compiled graph has no delta)
        self.lora_steps = 0
        #: decode-only steps with LoRA rows run by the native decode step (deltas added inside it)
        self.native_lora_steps = 0
        if getattr(model, "native_decode", False):
            self.native = NativeDecode(model, self.kv_caches, model.output.small_max_rows)
            self.native.start()
            if self.native.reason is None and not self.native.cached:
                _log_native_build()

    def start_compile(self, max_rows: int) -> CompiledDecode:
        """Compile the decode-only step in the background (see CompiledDecode); decode-only
        steps use it once it is ready, every other step stays eager."""
        self.compiled = CompiledDecode(self.model, self.kv_caches[0], max_rows)
        self.compiled.start()
        return self.compiled

    def copy_blocks(self, copies: list[tuple[int, int, int]], group: int = -1) -> None:
        """Copy the first ``rows`` KV rows of block ``src`` into block ``dst`` in every layer of
        ``group`` (-1: the layers the manager's own tables address, all of them without sliding
        groups; copy on write; quantized rows are copied in their stored form)."""
        bs = self.block_size
        caches = [kv for kv, g in zip(self.kv_caches, self.layer_group) if g == group]
        for src, dst, n in copies:
            for kc, vc in caches:
                k, v = kv_data(kc), kv_data(vc)
                k[dst * bs: dst * bs + n] = k[src * bs: src * bs + n]
                v[dst * bs: dst * bs + n] = v[src * bs: src * bs + n]

    def shift_rows(self, jobs: list[tuple[int, int, int]]) -> None:
        """KV shifting: copy cache row ``src`` to row ``dst`` in every layer, K rotated by ``delta`` positions.

        K is cached after RoPE (interleaved pairs (2i, 2i+1) as complex numbers times
        ``rope_cis[pos]``), so moving a key from position p to p + delta is one more
        multiply by e^(i delta theta): ``rope_cis[delta]``, or its conjugate for a
        negative delta. Rows are rotated in float32 and stored back in the cache
        type (a quantized K is dequantized, rotated and quantized again, as llama.cpp's
        K shift does); V rows are copied unchanged (quantized V: its stored bytes).
        All rows are read before any is written.

        Args:
            jobs: (src row, dst row, delta in positions); |delta| < the RoPE table size.
        """
        if not jobs:
            return
        t = torch.tensor(jobs, dtype=torch.long)
        src, dst, delta = t[:, 0].to(self.device), t[:, 1].to(self.device), t[:, 2]
        tables = getattr(self.model, "layer_rope_cis", None) or [self.model.rope_cis] * len(self.kv_caches)
        rotations = {}
        for (k, v), table in zip(self.kv_caches, tables):
            cis = rotations.get(id(table))
            if cis is None:  # a layer's own RoPE table (gemma3's sliding layers have another base)
                cis = table[delta.abs().to(table.device)]  # [J, D/2] complex64
                cis = rotations[id(table)] = torch.where((delta < 0).to(cis.device)[:, None], cis.conj(),
                                                         cis).to(self.device)
            J, H, D = len(jobs), k.shape[1], k.shape[2]
            if isinstance(k, torch.Tensor):
                ks = torch.view_as_complex(k[src].float().reshape(J, H, D // 2, 2).contiguous())
                k[dst] = torch.view_as_real(ks * cis[:, None, :]).reshape(J, H, D).to(k.dtype)
            else:
                ks = torch.view_as_complex(kv_gather(k, src, torch.float32).reshape(J, H, D // 2, 2))
                kv_write(k, dst, torch.view_as_real(ks * cis[:, None, :]).reshape(J, H, D))
            vd = kv_data(v)
            vd[dst] = vd[src]

    def _layer_rows(self, rows: torch.Tensor, group_rows: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Per layer, its cache rows on the device: ``rows``, or its sliding group's ``group_rows``."""
        idx = [r.to(self.device) for r in (rows, *(group_rows or ()))]
        return [idx[g + 1] if group_rows is not None and g >= 0 else idx[0] for g in self.layer_group]

    def read_rows(self, rows: torch.Tensor, group_rows: list[torch.Tensor] | None = None,
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V) of cache ``rows`` ([N] long) in their stored form: CPU tensors [N, n_head_kv,
        head_dim] of a float type, uint8 [N, n_head_kv, row bytes] of a quantized one (kv_quant.kv_data).
        ``group_rows``: per sliding group (:attr:`groups` order), the rows its layers read instead
        (addressed by the group's tables; any count)."""
        return [(kv_data(k)[idx].cpu(), kv_data(v)[idx].cpu())
                for (k, v), idx in zip(self.kv_caches, self._layer_rows(rows, group_rows))]

    def write_rows(self, rows: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]],
                   group_rows: list[torch.Tensor] | None = None) -> None:
        """Write per-layer (K, V) in their stored form (as :meth:`read_rows` returns them) into cache
        ``rows`` ([N] long), a sliding group's layers into its ``group_rows`` (as :meth:`read_rows`)."""
        for (kc, vc), (ks, vs), idx in zip(self.kv_caches, layers, self._layer_rows(rows, group_rows)):
            k, v = kv_data(kc), kv_data(vc)
            k[idx] = ks.to(device=self.device, dtype=k.dtype)
            v[idx] = vs.to(device=self.device, dtype=v.dtype)

    def _rows(self, table: list[int], start: int, end: int) -> torch.Tensor:
        """Cache rows of positions [start, end) for a block table: [end-start] long."""
        bs = self.block_size
        bt = torch.tensor(table[start // bs: (end - 1) // bs + 1], dtype=torch.long)
        rows = (bt[:, None] * bs + torch.arange(bs)).flatten()
        off = start - (start // bs) * bs
        return rows[off: off + end - start]

    def _decode_index(self, tables: list[list[int]], lens: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Cache rows read by B decode queries: ([B, L] long index, [B, 1, 1, L] bool mask or None).

        L = the longest sequence; shorter rows are padded with row 0 (the null
        block's zero rows, never uninitialized memory) and masked. The mask is
        None when no row is padded (every row has L tokens). Built with numpy:
        a handful of array operations per step instead of tensors per sequence.
        """
        bs = self.block_size
        B = len(tables)
        L = max(lens)
        nb = -(-L // bs)
        if B == 1:
            bt = np.asarray(tables[0][:nb], dtype=np.int64)[None, :]
        else:
            bt = np.zeros((B, nb), dtype=np.int64)
            for i, tb in enumerate(tables):
                m = min(len(tb), nb)
                bt[i, :m] = tb[:m]
        rows = (bt[:, :, None] * bs + np.arange(bs, dtype=np.int64)).reshape(B, -1)[:, :L]
        if min(lens) == L:
            return torch.from_numpy(np.ascontiguousarray(rows)).to(self.device), None
        valid = np.arange(L)[None, :] < np.asarray(lens)[:, None]
        idx = torch.from_numpy(np.where(valid, rows, 0)).to(self.device)
        return idx, torch.from_numpy(valid).view(B, 1, 1, L).to(self.device)

    #: prompt chunks of at most this many tokens after a cached prefix run as decode rows
    DECODE_LIKE_MAX = 4

    def _decode_like(self, ch) -> bool:
        """True for a single-token step, and for a chunk of at most DECODE_LIKE_MAX tokens
        after at least one cached token (no prompt logprobs). In a step of only such
        chunks that the compiled decode graph (``--compile``) takes, each token of a
        chunk runs as a decode query over the cache rows up to itself. Measured on
        SmolLM2, a warm prompt with 1,516 cached tokens and 2 new ones, in-engine time
        to first token in alternating runs: compiled 43-45 -> 35-37 ms and 30 -> 24-29
        ms; eager, within run-to-run noise (30-50 ms either way)."""
        n = ch.num_new_tokens
        if n == 1:
            return True
        if ch.spec_token_ids:  # verification: eager, each query as a decode (PrefillGroup.per_row)
            return False
        req = ch.request
        return (n <= self.DECODE_LIKE_MAX and req.num_computed_tokens > 0
                and req.params.prompt_logprobs is None)

    def execute(self, sched: SchedulerOutput, kv: KVCacheManager, samplers: dict[str, SequenceSampler]) -> StepResult:
        """Run one step; return the sampled tokens per chunk (see StepResult).

        Four steps: KV shift/copy jobs, :meth:`prepare` (the flat batch), :meth:`run`
        (the forward: compiled decode graph or eager model), :meth:`sample` and
        :meth:`prompt_logprobs`. ``samplers``: request id -> its SequenceSampler, for
        every chunk that completes its sequence.
        """
        self.shift_rows(sched.kv_shifts)
        self.copy_blocks(sched.kv_copies)
        for gi, copies in enumerate(sched.kv_group_copies):
            self.copy_blocks(copies, gi)
        batch = self.prepare(sched.chunks, kv)
        logits = self.run(batch)
        return StepResult(self.sample(batch, logits, samplers), self.prompt_logprobs(batch, logits),
                          self.verify(batch, logits, samplers))

    # -- prepare ---------------------------------------------------------------------

    def _decode_rows(self, chunks: list[ScheduledChunk]) -> list[bool]:
        """Per chunk: True when its tokens run as decode rows (queries over cache rows).

        Single-token steps always do, and so do verification chunks in a step the native
        decode step takes (only decode rows and verification chunks, at most its
        ``max_batch`` rows). In a step the compiled graph runs (every chunk
        :meth:`_decode_like`, at most ``max_batch`` rows), short chunks that continue a
        cached prefix (a warm prompt's last tokens, a resumed sequence) do too, each of
        their tokens a query over the rows before it, like a decode. Eagerly such a chunk
        is faster as a prefill group: its cache rows are gathered once for all its tokens
        (LlamaModel._grouped_attention).
        """
        nat = self.native
        if any(ch.request.lora for ch in chunks):  # single tokens only: the native step (deltas inside) or eager
            return [ch.num_new_tokens == 1 for ch in chunks]
        if (nat is not None and nat.ready and any(ch.spec_token_ids for ch in chunks)
                and all(ch.num_new_tokens == 1 or ch.spec_token_ids for ch in chunks)
                and sum(ch.num_new_tokens for ch in chunks) <= nat.max_batch):
            # speculative decoding: a step of decode rows and verification chunks runs as one
            # native decode step, each verified position a decode row over the cache rows up to
            # itself. The native step computes every row alone and writes all rows' K/V before
            # any row attends, so each position's logits are those of plain (native) decoding
            return [True] * len(chunks)
        as_decode = [self._decode_like(ch) for ch in chunks]
        comp = self.compiled
        if not (comp is not None and comp.ready and all(as_decode)
                and sum(ch.num_new_tokens for ch in chunks) <= comp.max_batch):
            as_decode = [d and ch.num_new_tokens == 1 for d, ch in zip(as_decode, chunks)]
        return as_decode

    def prepare(self, chunks: list[ScheduledChunk], kv: KVCacheManager) -> PreparedBatch:
        """Build the step's flat batch: decode rows first, then one prefill group per chunk.

        Also lists the rows whose logits are needed: the last row of each chunk that
        completes its sequence (in chunk order, these come first), then every row of
        the chunks that want prompt logprobs. No forward runs here.
        """
        bs = self.block_size
        as_decode = self._decode_rows(chunks)
        order = sorted(range(len(chunks)), key=lambda i: not as_decode[i])
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        n_decode = 0
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        prefills: list[PrefillGroup] = []
        row_of: dict[int, int] = {}  # chunk index -> last row in batch
        row_lora: list[tuple[int, int, tuple]] = []  # (first row, end row, the request's adapters)
        plp_rows: dict[int, tuple[int, int]] = {}  # chunk index -> its rows [a, b)
        t = 0
        for ci in order:
            ch = chunks[ci]
            req = ch.request
            s, n = req.num_computed_tokens, ch.num_new_tokens
            table = kv.block_table(req.request_id)
            if as_decode[ci]:
                # decode rows: plain ints, no tensor per sequence
                for p in range(s, s + n):
                    ids.append(ch.token_at(p))
                    pos.append(p)
                    slots.append(table[p // bs] * bs + p % bs)
                    dec_tables.append(table)
                    dec_lens.append(p + 1)
                n_decode += n
            else:
                ids.extend([ch.token_at(p) for p in range(s, s + n)])
                pos.extend(range(s, s + n))
                slots.extend(self._rows(table, s, s + n).tolist())
                kv_index = None if s == 0 else self._rows(table, 0, s + n).to(self.device)
                # a verification chunk: every query exactly as a decode step computes it
                prefills.append(PrefillGroup(t, t + n, s, kv_index, per_row=bool(ch.spec_token_ids)))
            row_of[ci] = t + n - 1
            if req.lora:
                row_lora.append((t, t + n, req.lora))
            if req.params.prompt_logprobs is not None and s < req.num_prompt_tokens:
                plp_rows[ci] = (t, t + n)
            t += n
        attn = AttentionBatch(
            positions=torch.tensor(pos, dtype=torch.long, device=self.device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            n_decode=n_decode,
            prefills=prefills,
        )
        if n_decode:
            attn.decode_kv_index, attn.decode_mask = self._decode_index(dec_tables, dec_lens)
            attn.decode_lens = torch.tensor(dec_lens, dtype=torch.long)
        for gi, (window, _, _) in enumerate(self.groups):
            attn.windows[window] = self._window_batch(gi, window, chunks, order, as_decode, kv, attn)
        # rows that need logits: last row of completing chunks, all rows for prompt logprobs,
        # every row of a verification chunk (speculative decoding)
        sample_ci = [ci for ci in range(len(chunks)) if chunks[ci].completes and not chunks[ci].spec_token_ids]
        need = [row_of[ci] for ci in sample_ci]
        plp_off: dict[int, int] = {}
        for ci, (a, b) in plp_rows.items():
            plp_off[ci] = len(need)
            need.extend(range(a, b))
        spec_off: dict[int, int] = {}
        for ci, ch in enumerate(chunks):
            if ch.spec_token_ids:
                spec_off[ci] = len(need)
                last = row_of[ci]
                need.extend(range(last + 1 - ch.num_new_tokens, last + 1))
        # every row, in order (a decode-only step): no gather of the hidden states
        need_t = None if need == list(range(t)) else torch.tensor(need, dtype=torch.long, device=self.device)
        lora = None
        if row_lora:
            row_lora.append((t, t, ()))  # the step's row count
            lora = self.lora.batch(row_lora, self.device)
        return PreparedBatch(chunks, torch.tensor(ids, dtype=torch.long, device=self.device), attn, t, need_t,
                             sample_ci, plp_off, spec_off, lora)

    def _window_batch(self, gi: int, window: int, chunks: list[ScheduledChunk], order: list[int],
                      as_decode: list[bool], kv: KVCacheManager, attn: AttentionBatch) -> AttentionBatch:
        """The step's batch as the layers of sliding group ``gi`` see it: the same rows, in the
        same order, addressed by the group's block tables, and each query reading only the
        blocks its window reaches (from the block of position ``p - window + 1``: rows before
        it are released; ``decode_kv_start`` / ``PrefillGroup.kv_start`` give the position of
        the first row read)."""
        bs = self.block_size
        slots: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        dec_start: list[int] = []
        prefills: list[PrefillGroup] = []
        t = 0
        for ci in order:
            ch = chunks[ci]
            s, n = ch.request.num_computed_tokens, ch.num_new_tokens
            table = kv.group_table(gi, ch.request.request_id)
            if as_decode[ci]:
                for p in range(s, s + n):
                    b0 = max(0, p - window + 1) // bs
                    slots.append(table[p // bs] * bs + p % bs)
                    dec_tables.append(table[b0:])
                    dec_lens.append(p + 1 - b0 * bs)
                    dec_start.append(b0 * bs)
            else:
                slots.extend(self._rows(table, s, s + n).tolist())
                k0 = (max(0, s - window + 1) // bs) * bs
                kv_index = None if s == 0 else self._rows(table, k0, s + n).to(self.device)
                prefills.append(PrefillGroup(t, t + n, s, kv_index, per_row=bool(ch.spec_token_ids), kv_start=k0))
            t += n
        view = AttentionBatch(positions=attn.positions,
                              slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
                              n_decode=attn.n_decode, prefills=prefills)
        if attn.n_decode:
            view.decode_kv_index, view.decode_mask = self._decode_index(dec_tables, dec_lens)
            view.decode_lens = torch.tensor(dec_lens, dtype=torch.long)
            view.decode_kv_start = torch.tensor(dec_start, dtype=torch.long, device=self.device)
        return view

    # -- run -------------------------------------------------------------------------

    def run(self, batch: PreparedBatch) -> torch.Tensor:
        """The forward of a prepared batch: logits [len(need) or T, n_vocab] float32, rows in
        ``batch.need`` order (every row when ``need`` is None).

        A decode-only step of at most ``native.max_batch`` rows runs through the native decode
        step once it is loaded (see kvserve.models.decode_native), else through the compiled
        graph when it is ready and accepts the step (see CompiledDecode); every other step,
        and one the graph refuses, runs the eager model."""
        comp = self.compiled
        attn = batch.attn
        n_decode = attn.n_decode
        nat = self.native
        if nat is not None and nat.cached and nat.pending:
            nat.activate(idle=False)  # a cached build: waits for the packing (see NativeDecode.activate)
        if (nat is not None and nat.ready and n_decode == batch.n_rows and n_decode <= nat.max_batch
                and (batch.lora is None or nat.lora_ready(batch.lora, self.lora.known_ids()))):
            # decode rows, a prompt's last token among them: while the native step runs, the
            # scheduler gives every prompt's last token a step of its own (Scheduler.split_last_token),
            # cold or warm, so a prompt's first token is computed here whether its prefix was
            # cached or not (the rest of a cold prompt is prefilled eagerly). LoRA rows get their
            # adapters' deltas inside the step (NativeDecode.lora_ready registers the adapters)
            logits = nat(batch.input_ids, attn.positions, attn.slot_mapping, attn.decode_kv_index, attn.decode_lens,
                         self.kv_caches, batch.lora)
            if batch.lora is not None:
                self.native_lora_steps += 1
            return logits if batch.need is None else logits.index_select(0, batch.need)
        if batch.lora is not None:
            return self._run_lora(batch)
        # L >= 2: a size of 1 would be a new (specialized) graph
        if (comp is not None and comp.ready and n_decode == batch.n_rows and n_decode <= comp.max_batch
                and attn.decode_kv_index.shape[1] >= 2):
            mask = attn.decode_mask
            if mask is None:
                mask = torch.ones(n_decode, 1, 1, attn.decode_kv_index.shape[1], dtype=torch.bool, device=self.device)
            # flat index: a [1, L] slice of a wider array has stride[0] != L, which the
            # compiled graph's guards would take for a new shape
            logits = comp(batch.input_ids, attn.positions, attn.slot_mapping, attn.decode_kv_index.reshape(-1), mask,
                          self.kv_caches)
            if logits is not None:
                if batch.need is not None:  # the graph computes every row's logits
                    logits = logits.index_select(0, batch.need)
                return logits
        if n_decode == batch.n_rows:
            self.eager_decode_steps += 1
        return self.model(batch.input_ids, attn, self.kv_caches, batch.need)

    def _run_lora(self, batch: PreparedBatch) -> torch.Tensor:
        """A step with LoRA rows the native decode step does not take: the eager model with the step's
        adapter groups active (the compiled graph adds no delta; steps without adapter rows keep it)."""
        self.lora_steps += 1
        self.lora.active = batch.lora
        try:
            return self.model(batch.input_ids, batch.attn, self.kv_caches, batch.need)
        finally:
            self.lora.active = None

    # -- sample ----------------------------------------------------------------------

    def sample(self, batch: PreparedBatch, logits: torch.Tensor,
               samplers: dict[str, SequenceSampler]) -> list[SampleResult | SampleFailure | None]:
        """Per chunk: the token sampled for each chunk that completes its sequence (logits
        rows 0 .. len(sample_ci) - 1, one batched call), None for the others. When the
        batched call raises, the rows are sampled one by one so that only the failing
        row's request gets a SampleFailure."""
        chunks = batch.chunks
        samples: list = [None] * len(chunks)
        if not batch.sample_ci:
            return samples
        reqs = [chunks[ci].request for ci in batch.sample_ci]
        args = ([samplers[r.request_id] for r in reqs], [_History(r) for r in reqs],
                [len(r.output_token_ids) for r in reqs],
                [r.grammar.mask() if r.grammar is not None else None for r in reqs])
        try:
            res = sample_batch(logits[: len(reqs)], *args)
        except Exception:  # noqa: BLE001 - one row's sampler failed: find it, the others sample
            res = [_sample_row(logits[i: i + 1], *(a[i: i + 1] for a in args)) for i in range(len(reqs))]
        for ci, r in zip(batch.sample_ci, res):
            samples[ci] = r
        return samples

    # -- verification (speculative decoding) ------------------------------------------

    def verify(self, batch: PreparedBatch, logits: torch.Tensor,
               samplers: dict[str, SequenceSampler] | None = None) -> list[list[int] | None]:
        """Per chunk: for a verification chunk of a greedy request, the target's greedy token at
        every position (one argmax over all such rows, the first index on ties as plain
        greedy sampling picks); of a sampling request (``samplers`` says which: not
        ``is_plain_greedy``), the tokens the rejection rule keeps (accepted drafts and one
        more: :func:`kvserve.engine.spec_decode.speculative_accept` on the chain's
        distributions, ``ch.spec_probs`` the draft's); None for the other chunks."""
        chunks = batch.chunks
        out: list = [None] * len(chunks)
        if not batch.spec_off:
            return out
        greedy, sampled = [], []
        for ci in batch.spec_off:
            smp = None if samplers is None else samplers.get(chunks[ci].request.request_id)
            req = chunks[ci].request
            if smp is None or smp.is_plain_greedy(len(req.output_token_ids)):
                greedy.append(ci)
            else:
                sampled.append((ci, smp))
        if greedy:
            rows = [r for ci in greedy for r in range(batch.spec_off[ci], batch.spec_off[ci] + chunks[ci].num_new_tokens)]
            if logits.device.type == "cpu" and logits.dtype == torch.float32:
                # numpy's argmax in this thread (the first index of the maximum, as torch's): torch's
                # parallel argmax woke its OpenMP team, ~2.6 ms a verification step in a server
                # (libgomp's throttled spin, see docs/performance.md) against ~0.2 ms here
                a = logits.numpy()
                sub = a[rows[0]: rows[-1] + 1] if rows[-1] - rows[0] + 1 == len(rows) else a[rows]
                tok = sub.argmax(axis=-1).tolist()
            else:
                sel = torch.tensor(rows, dtype=torch.long, device=logits.device)
                tok = logits.index_select(0, sel).to(torch.float32).argmax(dim=-1).tolist()
            i = 0
            for ci in greedy:
                n = chunks[ci].num_new_tokens
                out[ci] = tok[i: i + n]
                i += n
        for ci, smp in sampled:
            ch = chunks[ci]
            off, n = batch.spec_off[ci], ch.num_new_tokens
            n_gen = len(ch.request.output_token_ids)
            p_rows = torch.stack([smp.probs(logits[off + i], n_gen + i) for i in range(n)])
            out[ci] = speculative_accept(p_rows, ch.spec_token_ids, ch.spec_probs, smp.rng)
        return out

    # -- prompt logprobs -------------------------------------------------------------

    def prompt_logprobs(self, batch: PreparedBatch,
                        logits: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
        """Per chunk: prompt logprobs of its tokens (see StepResult), None when it asked for
        none or holds no prompt token with a successor inside the prompt."""
        chunks = batch.chunks
        plps: list = [None] * len(chunks)
        for ci, off in batch.plp_off.items():
            ch = chunks[ci]
            req = ch.request
            s, n = req.num_computed_tokens, ch.num_new_tokens
            # logits at position p predict token p+1; keep those inside the prompt
            m = min(n, req.num_prompt_tokens - 1 - s)
            if m <= 0:
                continue
            targets = torch.tensor([req.token_at(p + 1) for p in range(s, s + m)], dtype=torch.long)
            plps[ci] = compute_logprobs(logits[off: off + m].cpu(), targets, max(req.params.prompt_logprobs, 0))
        return plps


@dataclass(slots=True)
class PreparedBatch:
    """One step's flat batch, as :meth:`ModelRunner.prepare` builds it.

    Attributes:
        chunks: the step's chunks (SchedulerOutput order; results are per chunk in it).
        input_ids: [T] long token ids, decode rows first.
        attn: positions, cache rows and attention groups of the T rows.
        n_rows: T.
        need: [R] long, rows whose logits the forward computes, in this order; None = every row.
        sample_ci: indices of the chunks that sample; logits rows 0 .. len - 1 are theirs.
        plp_off: chunk index -> first logits row of its prompt-logprobs rows.
        spec_off: chunk index -> first logits row of a verification chunk's rows (all of them).
        lora: the step's LoRA row groups (kvserve.lora.apply.LoraBatch), None without adapter rows.
    """

    chunks: list[ScheduledChunk]
    input_ids: torch.Tensor
    attn: AttentionBatch
    n_rows: int
    need: torch.Tensor | None
    sample_ci: list[int]
    plp_off: dict[int, int]
    spec_off: dict[int, int] = field(default_factory=dict)
    lora: object | None = None


@dataclass(slots=True)
class SampleFailure:
    """A row whose sampler raised (e.g. SamplingError: a grammar mask and bans leave no
    token): the engine fails that request alone (EngineCore re-raises ``error`` for it)."""

    error: Exception


def _sample_row(logits: torch.Tensor, samplers, histories, num_generated, masks) -> SampleResult | SampleFailure:
    """One row through :func:`sample_batch`; its exception becomes a SampleFailure."""
    try:
        return sample_batch(logits, samplers, histories, num_generated, masks)[0]
    except Exception as e:  # noqa: BLE001 - handed to the engine as this row's failure
        return SampleFailure(e)


class _History:
    """Read-only sequence view of prompt + generated tokens (no list copy per step)."""

    __slots__ = ("req",)

    def __init__(self, req):
        self.req = req

    def __len__(self) -> int:
        return self.req.num_tokens

    def __getitem__(self, i):
        r = self.req
        if isinstance(i, slice):
            return r.all_token_ids[i]
        if i < 0:
            i += r.num_tokens
        return r.token_at(i)

    def __iter__(self):
        return iter(self.req.all_token_ids)
