"""Speculative decoding with a draft model (llama-server ``-md/--model-draft``, vLLM's
``--speculative-config '{"model": ..., "num_speculative_tokens": K}'``).

The draft runs beside the target on the same cache discipline: its own KV pool (a second
:class:`~kvserve.engine.model_runner.ModelRunner`) with the target's block count and block size,
addressed by the block ids of the engine's one :class:`~kvserve.engine.kv_cache.KVCacheManager`.
A block therefore holds the target's rows in the target's pool and the draft's rows for the
same tokens in the draft's pool, and everything the manager does to blocks holds for both:
prefix-cache hits, copy-on-write copies and ``--cache-reuse`` shifts (mirrored here with the
draft's own RoPE table), the host tier (the same block ids), parked slots.

Per engine step (:meth:`DraftModel.propose`, after scheduling, before the target's forward):

1. the step's KV shift and copy jobs run on the draft's pool too;
2. *catch-up*: one batched forward of the draft over the step's prompt chunks and the
   decode rows that draft (the same positions and cache rows as the target's), each starting
   where the draft's rows of that sequence stop being valid (``_valid``): decode rows that
   do not draft are skipped and caught up in one chunk when the sequence drafts again or
   finishes (:meth:`DraftModel.settle`), so a step whose drafts the policy declines costs no
   draft forward; logits only for the rows that draft;
3. *drafting*: for the decode rows the scheduler gave a draft length (``ScheduledChunk.draft_k``,
   from the draft-length policy of :mod:`kvserve.engine.spec_decode`), K batched
   one-row-per-sequence steps: each picks the next draft token (greedy requests: the argmax
   of the draft's logits; sampling requests: a draw from the draft's distribution after the
   request's own sampler chain, with a per-request RNG seeded from the request's seed) and
   feeds it back. A sequence stops at its length, or, as llama-server, when the top
   probability falls below ``--draft-p-min`` (that token is not drafted).

The target then verifies the chunk as for prompt lookup (greedy: longest agreeing prefix
plus the bonus token; sampling: the rejection rule with the draft's ``q``). After the
target's forward (:meth:`DraftModel.after_verify`), a sequence that accepted its whole draft
has its last draft token fed to the draft (its row was never computed), and a finishing
request's skipped rows are computed (:meth:`DraftModel.settle`), so that a block that is
parked, indexed or kept in the host tier is valid for both models. (A preempted sequence's
blocks may be indexed with draft rows missing: that lowers the draft's acceptance on a later
hit of them, never changes a token, since the target verifies every draft.)

Slot files hold the target's rows only; :meth:`DraftModel.fill` recomputes the draft's rows
of a restored slot (one prefill of the draft over the restored tokens).

Vocabulary: the draft must share the target's vocabulary (:func:`check_vocab`, llama.cpp's
``common_speculative_are_compatible``: vocab type, BOS/EOS ids and add flags, and the token
texts from id 5 on; kvserve also requires the same vocabulary size, since the target
verifies the draft's token ids and distributions directly), else the server does not start.
"""

from __future__ import annotations

import logging

import torch

from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.engine.spec_decode import accepted_prefix, draw
from kvserve.models.llama import AttentionBatch, PrefillGroup

log = logging.getLogger("kvserve.engine")

#: llama.cpp's SPEC_VOCAB_CHECK_START_TOKEN_ID: token texts are compared from this id on
VOCAB_CHECK_START_TOKEN_ID = 5
#: tokens per forward when a restored slot's draft rows are recomputed
FILL_CHUNK_TOKENS = 2048
#: mixed into a request's seed for the draft's own draws
DRAFT_SEED_SALT = 0x9E3779B9


class DraftVocabError(ValueError):
    """The draft model's vocabulary does not match the target's (a start-up error)."""


def check_vocab(target_tok, draft_tok, n_vocab_target: int, n_vocab_draft: int) -> None:
    """Raise :class:`DraftVocabError` unless the draft's vocabulary is the target's.

    The checks of llama.cpp's ``common_speculative_are_compatible`` (vocab type; add-BOS flag
    and, when set, BOS id; add-EOS flag and, when set, EOS id; token text of every id from
    :data:`VOCAB_CHECK_START_TOKEN_ID` on), the BOS and EOS ids even when not added (the
    older llama.cpp rule), and an exact size match instead of llama.cpp's 128-token tolerance. The message starts with llama-server's "the target and draft vocabs
    are not compatible" and names the first difference.
    """
    head = "the target and draft vocabs are not compatible: "
    tt, dt = getattr(target_tok, "vocab_type", None), getattr(draft_tok, "vocab_type", None)
    if tt != dt:
        raise DraftVocabError(head + f"draft model vocab type must match target model to use speculation but "
                              f"vocab_type_dft = {dt} while vocab_type_tgt = {tt}")
    for what, flag, tid in (("bos", "add_bos", "bos_token_id"), ("eos", "add_eos", "eos_token_id")):
        ft, fd = bool(getattr(target_tok, flag, False)), bool(getattr(draft_tok, flag, False))
        it, idd = getattr(target_tok, tid, None), getattr(draft_tok, tid, None)
        if ft != fd or (ft and it != idd):
            raise DraftVocabError(head + f"draft model {what} tokens must match target model to use speculation. "
                                  f"add: {int(ft)} - {int(fd)}, id: {it} - {idd}")
    ids_t = (getattr(target_tok, "bos_token_id", None), getattr(target_tok, "eos_token_id", None))
    ids_d = (getattr(draft_tok, "bos_token_id", None), getattr(draft_tok, "eos_token_id", None))
    if ids_t != ids_d:  # the older llama.cpp rule: the ids even when not added
        raise DraftVocabError(head + f"draft model special tokens must match target model to use speculation "
                              f"(bos, eos: target {ids_t[0]}, {ids_t[1]}; draft {ids_d[0]}, {ids_d[1]})")
    if n_vocab_target != n_vocab_draft:
        raise DraftVocabError(head + f"target vocab size {n_vocab_target} does not match draft vocab size "
                              f"{n_vocab_draft} (kvserve needs the same vocabulary)")
    for i in range(VOCAB_CHECK_START_TOKEN_ID, n_vocab_target):
        a, b = target_tok.token_text(i), draft_tok.token_text(i)
        if a != b:
            raise DraftVocabError(head + f"draft model vocab must match target model to use speculation but "
                                  f"token {i} content differs - target '{a}', draft '{b}'")


def _tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct tensors a module tree holds (parameters, buffers, plain attributes), and
    of the GGUF blocks its Linear layers multiply (Linear.blocks)."""
    seen: set[int] = set()
    total = 0
    for m in module.modules():
        vals = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        vals += [v for v in vars(m).values() if isinstance(v, torch.Tensor)]
        for v in vars(m).values():
            if isinstance(v, (list, tuple)):
                vals += [x for x in v if isinstance(x, torch.Tensor)]
        for t in vals:
            try:
                key = t.untyped_storage().data_ptr()
            except Exception:  # noqa: BLE001 - a tensor without storage (meta...): skip it
                continue
            if key in seen:
                continue
            seen.add(key)
            total += t.untyped_storage().nbytes()
        blocks = getattr(m, "blocks", None)  # a Linear's GGUF blocks (numpy views of the file's mapping)
        total += blocks.nbytes if blocks is not None and hasattr(blocks, "parts") else 0
        if getattr(m, "tok_embd_raw", None) is not None:  # an embedding table kept as GGUF blocks
            total += m.embedding_nbytes()
    return total


class DraftModel:
    """The draft model of one engine (engine thread only).

    Args:
        model: the draft's LlamaModel (built like the target, same EngineConfig numerics).
        num_blocks, block_size: the target's KV pool geometry (the same block ids).
        kv_dtype, kv_dtype_v: the KV cache types (the target's).
        p_min: llama-server ``--draft-p-min``: stop drafting a sequence when the draft's top
            probability is below it (0: never).

    Attributes:
        runner: the draft's ModelRunner (its KV pool: :attr:`kv_bytes`).
        weight_bytes: bytes of the draft's weights.
    """

    def __init__(self, model, num_blocks: int, block_size: int, kv_dtype: str = "f16",
                 kv_dtype_v: str | None = None, p_min: float = 0.0):
        self.model = model
        self.runner = ModelRunner(model, num_blocks, block_size, kv_dtype, model.device, kv_dtype_v=kv_dtype_v)
        self.device = self.runner.device
        self.block_size = block_size
        self.p_min = float(p_min)
        self.kv_bytes = self.runner.kv_bytes
        self.weight_bytes = _tensor_bytes(model)
        self._valid: dict[str, int] = {}  # request id -> positions [0, n) whose draft rows are valid
        self._rngs: dict[str, torch.Generator] = {}
        #: counters: draft forwards run, rows computed
        self.forwards = 0
        self.rows = 0

    @classmethod
    def load(cls, spec: str, target_loaded, config, num_blocks: int, block_size: int,
             max_positions: int) -> DraftModel:
        """Resolve ``spec`` (a GGUF path, an HF directory or a store name, as ``-m``), check its
        vocabulary against the target's (:class:`DraftVocabError`) and build it with the
        target's EngineConfig numerics; logs the draft's memory (weights and KV pool)."""
        from kvserve.models.build import build_model, load_files
        from kvserve.store import resolve_model

        path = resolve_model(spec, pull_missing=False)
        loaded = load_files(path)
        check_vocab(target_loaded.tokenizer, loaded.tokenizer, target_loaded.config.n_vocab, loaded.config.n_vocab)
        model = build_model(loaded, config, max_positions=max_positions)
        d = cls(model, num_blocks, block_size, config.kv_dtype, config.kv_dtype_v, config.spec.draft_p_min)
        #: one draft step's cost as a fraction of a one-row target step (weights read per step)
        d.cost_ratio = cls.step_params(loaded.config) / max(cls.step_params(target_loaded.config), 1)
        log.info("draft model %s: %s, %d layers; weights %.1f MiB, KV pool %.1f MiB (%d blocks of %d tokens, "
                 "the target's block ids); draft-max %d, draft-min %d, draft-p-min %.2f", spec,
                 loaded.info.name if hasattr(loaded.info, "name") else loaded.config.arch, loaded.config.n_layer,
                 d.weight_bytes / 2**20, d.kv_bytes / 2**20, num_blocks, block_size,
                 config.spec.num_speculative_tokens, config.spec.min_tokens, d.p_min, extra={"func": "load_model"})
        return d

    @staticmethod
    def step_params(config) -> int:
        """Weights one decode step reads (a ModelConfig): every layer's projections and the output
        head (the token embedding is only indexed). The draft-length policy's cost ratio."""
        e, hd = config.n_embd, config.head_dim
        layer = e * config.n_head * hd * 2 + 2 * e * config.n_head_kv * hd + 3 * e * config.n_ff
        return config.n_layer * layer + config.n_vocab * e

    # -- bookkeeping -------------------------------------------------------------------

    def forget(self, request_id: str) -> None:
        """A request left the engine."""
        self._valid.pop(request_id, None)
        self._rngs.pop(request_id, None)

    def _rng(self, request_id: str, sampler) -> torch.Generator:
        g = self._rngs.get(request_id)
        if g is None:
            g = self._rngs[request_id] = torch.Generator(device="cpu")
            g.manual_seed((int(sampler.seed) ^ DRAFT_SEED_SALT) & 0xFFFFFFFF)
        return g

    # -- forwards ------------------------------------------------------------------------

    def _forward(self, items: list[tuple[list[int], int, list[int], bool]]) -> dict[int, torch.Tensor]:
        """One batched forward of the draft: per item (block table, first position, tokens,
        wants logits); single tokens run as decode rows, longer runs as prefill groups (their
        cache rows before the run gathered). Returns item index -> float32 [n_vocab] logits
        of its last token, for the items that want them."""
        bs = self.block_size
        r = self.runner
        order = sorted(range(len(items)), key=lambda i: len(items[i][2]) != 1)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        prefills: list[PrefillGroup] = []
        last_row: dict[int, int] = {}
        n_decode = 0
        t = 0
        for i in order:
            table, s, toks, _ = items[i]
            n = len(toks)
            if n == 0:
                continue
            ids.extend(toks)
            pos.extend(range(s, s + n))
            if n == 1:
                slots.append(table[s // bs] * bs + s % bs)
                dec_tables.append(table)
                dec_lens.append(s + 1)
                n_decode += 1
            else:
                slots.extend(r._rows(table, s, s + n).tolist())
                kv_index = None if s == 0 else r._rows(table, 0, s + n).to(self.device)
                prefills.append(PrefillGroup(t, t + n, s, kv_index))
            last_row[i] = t + n - 1
            t += n
        if t == 0:
            return {}
        attn = AttentionBatch(positions=torch.tensor(pos, dtype=torch.long, device=self.device),
                              slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
                              n_decode=n_decode, prefills=prefills)
        if n_decode:
            attn.decode_kv_index, attn.decode_mask = r._decode_index(dec_tables, dec_lens)
        want = [i for i in range(len(items)) if items[i][3] and i in last_row]
        need_rows = [last_row[i] for i in want] or [t - 1]
        need = torch.tensor(need_rows, dtype=torch.long, device=self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        nat = r.native
        if nat is not None and nat.ready and n_decode == t and t <= nat.max_batch:
            # the drafting steps (one row per sequence) in the native decode step
            logits = nat(input_ids, attn.positions, attn.slot_mapping, attn.decode_kv_index,
                         torch.tensor(dec_lens, dtype=torch.long), r.kv_caches).index_select(0, need)
        else:
            logits = self.model(input_ids, attn, r.kv_caches, need)
        self.forwards += 1
        self.rows += t
        return {i: logits[j].to(torch.float32) for j, i in enumerate(want)}

    def propose(self, sched: SchedulerOutput, kv: KVCacheManager, samplers: dict) -> None:
        """Mirror the step's KV jobs, catch the draft up on every chunk of the step, and draft
        each decode row's ``draft_k`` tokens (see the module docstring): sets the chunk's
        ``spec_token_ids`` (and ``spec_probs`` for a sampling request) and extends its
        ``num_new_tokens``. A chunk whose draft stops at once (``--draft-p-min``) runs as a
        plain decode row."""
        self.runner.shift_rows(sched.kv_shifts)
        self.runner.copy_blocks(sched.kv_copies)
        items = []
        drafting = []  # (item index, chunk)
        for ch in sched.chunks:
            req = ch.request
            rid = req.request_id
            s = req.num_computed_tokens
            want = ch.draft_k > 0
            if not want and ch.num_new_tokens == 1 and req.output_token_ids:
                continue  # a decode row that does not draft: caught up when it drafts or finishes
            start = min(self._valid.get(rid, s), s)
            end = s + ch.num_new_tokens
            table = kv.block_table(rid)
            if want:
                drafting.append((len(items), ch))
            items.append((table, start, [req.token_at(p) for p in range(start, end)], want))
            self._valid[rid] = end
        logits = self._forward(items)
        if not drafting:
            return
        # K batched steps: seq state (chunk, table, next position, drafts, q rows, sampler or None)
        active = []
        for i, ch in drafting:
            req = ch.request
            smp = samplers.get(req.request_id)
            greedy = smp is None or smp.is_plain_greedy(len(req.output_token_ids))
            p_min = self.p_min if req.params.spec_p_min is None else req.params.spec_p_min
            active.append([ch, items[i][0], req.num_computed_tokens + 1, [], [], None if greedy else smp,
                           logits[i], p_min])
        done = []
        while active:
            feed = []
            for st in active:
                ch, table, p, toks, qs, smp, lg, p_min = st
                req = ch.request
                if smp is None:
                    x = int(lg.argmax())
                    top = float(torch.softmax(lg, dim=0)[x]) if p_min > 0.0 else 1.0
                    q = None
                else:
                    q = smp.probs(lg, len(req.output_token_ids) + len(toks))
                    x = draw(q, float(torch.rand((), generator=self._rng(req.request_id, smp), dtype=torch.float64)))
                    top = float(q.max())
                if top < p_min:
                    done.append(st)
                    continue
                toks.append(x)
                if q is not None:
                    qs.append(q)
                if len(toks) >= ch.draft_k:
                    done.append(st)
                    continue
                feed.append(st)
            if not feed:
                break
            out = self._forward([(st[1], st[2], [st[3][-1]], True) for st in feed])
            for j, st in enumerate(feed):
                self._valid[st[0].request.request_id] = st[2] + 1
                st[2] += 1
                st[6] = out[j]
            active = feed
        for ch, _, _, toks, qs, smp, _, _ in done:
            if not toks:
                continue
            ch.spec_token_ids = toks
            ch.num_new_tokens += len(toks)
            ch.spec_probs = torch.stack(qs) if smp is not None else None

    def after_verify(self, sched: SchedulerOutput, verified: list | None, kv: KVCacheManager) -> None:
        """After the target's forward: feed the last draft token of every sequence that accepted
        its whole draft (the token's row was never computed by the draft), so that the
        draft's rows cover every position the target's cache keeps."""
        if not verified:
            return
        items = []
        for ch, target in zip(sched.chunks, verified):
            if not ch.spec_token_ids or target is None:
                continue
            d = ch.spec_token_ids
            if accepted_prefix(d, target) < len(d):
                continue
            req = ch.request
            p = req.num_computed_tokens + len(d)  # position of the last draft token
            if self._valid.get(req.request_id, 0) > p:
                continue
            items.append((kv.block_table(req.request_id), p, [d[-1]], False))
            self._valid[req.request_id] = p + 1
        if items:
            self._forward(items)

    def settle(self, req, kv: KVCacheManager) -> None:
        """A request is finishing (its blocks about to be parked or freed, their tokens indexed):
        compute the draft's rows it skipped (decode rows that did not draft), in one chunk, so
        that a later prefix hit on its blocks finds valid draft rows."""
        rid = req.request_id
        n = req.num_computed_tokens
        start = self._valid.get(rid)
        if start is None or start >= n:
            return
        self._valid[rid] = n
        table = kv.block_table(rid)
        for a in range(start, n, FILL_CHUNK_TOKENS):
            b = min(a + FILL_CHUNK_TOKENS, n)
            self._forward([(table, a, [req.token_at(p) for p in range(a, b)], False)])

    def fill(self, tokens: list[int], table: list[int]) -> None:
        """Compute the draft's rows of ``tokens`` (positions 0..N-1) into the blocks of
        ``table`` (a restored slot: slot files hold the target's rows only)."""
        for a in range(0, len(tokens), FILL_CHUNK_TOKENS):
            self._forward([(table, a, list(tokens[a: a + FILL_CHUNK_TOKENS]), False)])
