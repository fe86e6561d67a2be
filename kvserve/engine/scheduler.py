"""Continuous batching: which tokens of which sequences run in the next step.

There is no prefill or decode phase: each step moves every scheduled
request's ``num_computed_tokens`` toward ``num_tokens`` (vLLM v1's rule).
Running requests go first (a decode takes one token of the budget; an
unfinished prompt takes a chunk: chunked prefill), then waiting ones while the
token budget (``max_num_batched_tokens``) and the sequence cap
(``max_num_seqs``) allow. Out of KV blocks: the newest running request is
preempted (blocks freed, recomputed later from its tokens).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.spec_decode import SpecDecoder

#: finished sequences remembered for cache_miss diagnostics
RECENT_SEQUENCES = 8
#: tokens on each side of the first differing position in cache_miss excerpts
EXCERPT_TOKENS = 8


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int32 arrays (tokens)."""
    m = min(len(a), len(b))
    if m == 0:
        return 0
    ne = np.flatnonzero(a[:m] != b[:m])
    return int(ne[0]) if len(ne) else m


@dataclass(slots=True)
class ScheduledChunk:
    """``num_new_tokens`` tokens of ``request`` starting at ``request.num_computed_tokens``.

    A verification chunk (speculative decoding) is a decode whose last
    ``len(spec_token_ids)`` positions hold draft tokens, not yet the request's: its
    ``num_new_tokens`` is 1 + len(spec_token_ids), and every position gets logits.
    """

    request: Request
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)
    #: a draft model's distributions its draft tokens were drawn from (float32 [k, n_vocab]),
    #: for the rejection rule of a sampling request; None: prompt lookup, or greedy
    spec_probs: object = None
    #: draft model: the tokens the draft-length policy lets this decode row draft this step
    #: (the draft model fills ``spec_token_ids`` before the forward; 0: none)
    draft_k: int = 0

    @property
    def completes(self) -> bool:
        """After this chunk every known token is in the cache: the step samples a token."""
        return (self.request.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids)
                == self.request.num_tokens)

    def token_at(self, pos: int) -> int:
        """Token id at position ``pos`` of the chunk's sequence, draft tokens included."""
        n = self.request.num_tokens
        return self.request.token_at(pos) if pos < n else self.spec_token_ids[pos - n]


@dataclass(slots=True)
class SchedulerOutput:
    """The step's chunks, who was preempted, who failed, and KV rows to copy first (copy on
    write: (src block, dst block, rows)); KV shift jobs (src row, dst row, position delta)
    run before the copies."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    #: waiting requests whose admission raised (already out of the queues, blocks discarded)
    failed: list[tuple[Request, Exception]] = field(default_factory=list)
    kv_copies: list[tuple[int, int, int]] = field(default_factory=list)
    kv_shifts: list[tuple[int, int, int]] = field(default_factory=list)
    #: per sliding-window group (KVCacheManager.groups), its copy-on-write jobs in its own block ids
    kv_group_copies: list[list[tuple[int, int, int]]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class Scheduler:
    """Owns the waiting and running queues. Engine thread only.

    Args:
        kv: the KV cache manager (asked for blocks, never modified directly).
        max_num_seqs: sequences per step (llama-server slots).
        max_num_batched_tokens: token budget per step.
        n_ctx_slot: one sequence's context (tokens): draft tokens never reach past it.
    """

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, n_ctx_slot: int = 1 << 30):
        self.kv = kv
        self.n_ctx_slot = n_ctx_slot
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        #: recently finished sequences (token ids as int32 arrays, cache_salt, slot or -1, owner), for cache_miss
        self.recent: deque[tuple[np.ndarray, str | None, int, str | None]] = deque(maxlen=RECENT_SEQUENCES)
        #: token ids -> text, for cache_miss excerpts (set by EngineCore)
        self.detokenize: Callable[[list[int]], str] | None = None
        #: speculative decoding policy (set by EngineCore when --spec-type is on)
        self.spec: SpecDecoder | None = None
        #: most rows of a step that draft tokens may fill (the small-batch kernel's rows, so a
        #: verification step computes with the same kernels as a plain decode step)
        self.spec_max_rows = max_num_batched_tokens
        #: the last token of a chunk that would complete a sequence's known tokens (a prompt's last
        #: token, a resumed sequence's) goes to the next step on its own, as a decode row: set by
        #: EngineCore while the native decode step runs, so that a prompt's first token is computed
        #: the same way whether its prefix was cached (a one-token warm recompute) or not
        self.split_last_token = False
        #: the engine's LoRA registry (kvserve.lora.LoraRegistry; set by EngineCore), whose
        #: ``max_loras`` bounds the distinct adapters of one step (None = no limit): a request whose
        #: adapters would exceed it waits for a later step
        self.lora = None

    # -- queue changes -----------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished, remove from queues and release its blocks (same step).

        A request that ran in a slot (``priority_slot`` >= 0) leaves its blocks
        parked under that slot, as llama-server's idle slot keeps its KV."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        if self.requests.pop(request.request_id, None) is not None and request.lora and self.lora is not None:
            self.lora.release(request.lora)  # held by EngineCore.add_request
        n = request.num_computed_tokens
        if n > 0:
            self.recent.append((np.asarray(request.all_token_ids[:n], dtype=np.int32), request.cache_key,
                                request.priority_slot, request.owner))
        if request.priority_slot >= 0:
            self.kv.park(request.request_id, f"slot:{request.priority_slot}", request.cache_key, request.owner)
        else:
            self.kv.free(request.request_id)

    def drop(self, request: Request) -> None:
        """Remove a request the engine failed on (status FINISHED_ERROR): out of the queues, its
        blocks discarded (never parked, indexed or kept in the host tier: their rows may be
        incomplete). Safe to call for a request that already left."""
        request.status = RequestStatus.FINISHED_ERROR
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.requests.get(request.request_id) is request:
            del self.requests[request.request_id]
            if request.lora and self.lora is not None:
                self.lora.release(request.lora)  # held by EngineCore.add_request
        self.kv.discard(request.request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step ----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()
        loras: set[int] = set()  # the step's adapters
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if not self._lora_fits(req, loras):
                i += 1  # held back: another adapter set fills this step
                continue
            n = self._chunk_len(req, budget)
            self.kv.slide(req.request_id, req.num_computed_tokens)  # sliding groups: blocks out of every window
            while not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                out.chunks = [c for c in out.chunks if c.request is not victim]
                if victim is req:
                    n = 0
                    break
            if n == 0 and req.status == RequestStatus.PREEMPTED:
                break
            out.chunks.append(ScheduledChunk(req, n))
            scheduled.add(req.request_id)
            loras.update(req.lora_ids)
            budget -= n
            i += 1
        budget = self.max_num_batched_tokens - out.num_tokens
        held: list[Request] = []  # waiting requests whose adapters would exceed max_loras this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            if not self._lora_fits(req, loras):
                held.append(self.waiting.popleft())
                continue
            marks = self.kv.job_marks()
            try:
                admitted = self._admit(req, budget)
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
                self.kv.drop_jobs(marks)
                self.waiting.popleft()
                self.drop(req)
                out.failed.append((req, e))
                continue
            if not admitted:
                break
            n = self._chunk_len(req, budget)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, n))
            loras.update(req.lora_ids)
            budget -= n
        self.waiting.extendleft(reversed(held))  # back at the head, in their order
        if self.spec is not None and not out.preempted:
            self._add_drafts(out)
        out.kv_copies = self.kv.take_copies()
        out.kv_shifts = self.kv.take_shifts()
        if self.kv.groups:
            out.kv_group_copies = self.kv.take_group_copies()
        return out

    def _lora_fits(self, req: Request, loras: set[int]) -> bool:
        """Whether ``req``'s adapters join the step's ``loras`` within the registry's ``max_loras``."""
        limit = getattr(self.lora, "max_loras", None)
        if limit is None or not req.lora:
            return True
        return len(loras | req.lora_ids) <= limit

    def _chunk_len(self, req: Request, budget: int) -> int:
        """Tokens of ``req`` to compute this step: what is left, at most ``budget``; under
        :attr:`split_last_token` a chunk of several tokens that would reach the last known token
        stops one short of it (that token runs alone in the next step)."""
        left = req.num_tokens - req.num_computed_tokens
        n = min(left, budget)
        if self.split_last_token and n == left and n > 1:
            n -= 1
        return n

    def _add_drafts(self, out: SchedulerOutput) -> None:
        """Speculative decoding: extend decode chunks by draft tokens, in chunk order, with
        what is left of the step's token budget and of ``spec_max_rows``. Drafts never
        preempt: a chunk whose extra blocks are not free runs as a plain decode. A draft is
        cut so that the tokens it may add stay within the request's n_predict and context."""
        room = min(self.max_num_batched_tokens, self.spec_max_rows) - out.num_tokens
        self.spec.begin_step(out.num_tokens)  # the draft-length policy's step (spec_decode)
        for ch in out.chunks:
            if room <= 0:
                break
            req = ch.request
            if ch.num_new_tokens != 1 or not ch.completes or not req.output_token_ids:
                continue
            p = req.params
            limit = self.n_ctx_slot - req.num_tokens - 1  # accepted + bonus tokens stay in context
            if p.n_predict > 0:
                limit = min(limit, p.n_predict - len(req.output_token_ids) - 1)
            if getattr(self.spec, "uses_draft_model", False):
                # the draft model drafts after scheduling (kvserve.engine.draft): room for k now
                k = self.spec.plan(req, min(room, limit))
                if k and self.kv.allocate(req.request_id, req.num_computed_tokens + 1 + k, evict=False):
                    ch.draft_k = k
                    room -= k
                continue
            draft = self.spec.propose(req, min(room, limit))
            if not draft:
                continue
            if not self.kv.allocate(req.request_id, req.num_computed_tokens + 1 + len(draft), evict=False):
                continue
            ch.spec_token_ids = draft
            ch.num_new_tokens += len(draft)
            room -= len(draft)

    def _admit(self, req: Request, budget: int) -> bool:
        """Reuse the longest cached prefix (then, with ``n_cache_reuse``, shifted chunks
        of the slot's parked tokens), then allocate the first chunk. False: no room."""
        kv = self.kv
        hit_tokens = 0
        fresh = req.num_cached_tokens < 0 and not req.output_token_ids
        slot_key = f"slot:{req.priority_slot}" if req.priority_slot >= 0 else None
        marks = kv.job_marks()
        if req.params.cache_prompt:
            hit = kv.match_prefix(req.all_token_ids, req.cache_key, req.num_tokens - 1)
            hit_tokens = kv.hit_tokens(hit)
            if hit_tokens and not kv.allocate_prefix(req.request_id, hit):
                return False
            if fresh and slot_key is not None and req.params.n_cache_reuse > 0:
                hit_tokens = kv.reuse_shifted(req.request_id, req.prompt_token_ids, hit_tokens, slot_key,
                                              req.params.n_cache_reuse, req.num_prompt_tokens - 1, req.cache_key)
        n = min(req.num_tokens - hit_tokens, budget)
        if not kv.allocate(req.request_id, hit_tokens + n):
            kv.free(req.request_id)
            kv.drop_jobs(marks)  # this request's jobs: their rows belong to the blocks just freed
            return False
        req.num_computed_tokens = hit_tokens
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = hit_tokens
            if fresh:
                req.cache_miss = self._diagnose(req, hit_tokens)
        if slot_key is not None:
            kv.release_parked(slot_key)
        return True

    # -- cache_miss diagnostics -----------------------------------------------------

    def _diagnose(self, req: Request, n_reused: int) -> dict | None:
        """Why fewer prompt tokens were reused than a cached candidate offered (or None).

        Candidates: every slot's parked sequence (still cached) and the last
        ``RECENT_SEQUENCES`` finished sequences (maybe evicted since), but only
        those cached under the request's own ``cache_salt``: an entry of another
        salt is never mentioned, not even by its length (that would tell whether
        another user's prompt starts like this one). The best candidate shares
        the longest common prefix (LCP) with the prompt. A miss is reported when
        ``n_reused`` < min(LCP, prompt - 1) (the cache offered more), or when
        reuse stopped before the prompt's last token because the prompt differs
        from the candidate at position LCP (the candidate goes on with other
        tokens there; a candidate that simply ended is no miss).

        reason: "cache_prompt false" (the request turned reuse off), "evicted"
        (its KV is gone: host tier off/full, erased), "different slot" (it sits
        in another slot and could not be matched), "prefix differs" (the prompt
        changed at ``first_diff_pos``).

        The result holds counts, positions and ``prompt_excerpt`` (the request's
        own text); ``cached_excerpt`` (the candidate's text around the first
        difference) only when the candidate is this slot's history (the same slot
        and salt) and the caller's own: when either request carried an API key
        (:attr:`~kvserve.engine.request.Request.owner`), the same key, whatever
        the salt (two keys sending the same salt see no text of each other);
        without keys, a non-empty ``cache_salt``. With neither, counts and the
        reason only: an unsalted caller without a key never sees text that
        another request left in the slot. KV itself is shared by salt alone, as
        in vLLM (keys sending one salt share its cached prefixes).
        """
        n = req.num_prompt_tokens
        limit = n - 1
        if n_reused >= limit or n == 0:
            return None
        prompt = np.asarray(req.prompt_token_ids, dtype=np.int32)
        salt, slot = req.cache_key, req.priority_slot
        own = f"slot:{slot}" if slot >= 0 else None

        def callers(owner: str | None) -> bool:  # whether the candidate's text is the caller's own
            if req.owner is not None or owner is not None:  # keys: only the same key's text, salt or not
                return owner == req.owner
            return req.cache_salt is not None  # a salt the caller knows (not the LoRA part of the key)

        # (tokens, still cached, this slot's history, its text may be shown)
        cands: list[tuple[np.ndarray, bool, bool, bool]] = []
        for key in self.kv.parked_keys():
            toks = self.kv.parked_tokens(key)
            if toks and self.kv.parked_salt(key) == salt:
                mine = key == own
                cands.append((np.asarray(toks, dtype=np.int32), True, mine,
                              mine and callers(self.kv.parked_owner(key))))
        for toks, s, sl, owner in self.recent:
            if s == salt:
                mine = own is not None and sl == slot
                cands.append((toks, False, mine, mine and callers(owner)))
        best = None  # (rank, tokens, cached, mine, shown); at equal LCP prefer still cached, then this slot's
        for toks, cached, mine, shown in cands:
            lcp = _lcp(prompt, toks)
            if lcp and (best is None or (lcp, cached, mine) > best[0]):
                best = ((lcp, cached, mine), toks, cached, mine, shown)
        if best is None:
            return None
        (lcp, _, _), toks, cached, mine, shown = best
        if n_reused < min(lcp, limit):
            if not req.params.cache_prompt:
                reason = "cache_prompt false"
            elif not cached:
                reason = "evicted"
            elif not mine:
                reason = "different slot"
            else:
                reason = "prefix differs"
        elif lcp < len(toks) and n_reused <= lcp < limit:
            # reuse stopped where the prompt leaves the best candidate (a host-tier hit
            # may already reach further than any remembered candidate: then no miss)
            reason = "prefix differs"
        else:
            return None
        lo, hi = max(lcp - EXCERPT_TOKENS, 0), lcp + EXCERPT_TOKENS
        detok = self.detokenize or (lambda ids: " ".join(map(str, ids)))
        miss = {
            "n_reused": n_reused,
            "best_candidate_tokens": lcp,
            "first_diff_pos": lcp,
            "prompt_excerpt": detok([int(t) for t in prompt[lo:hi]]),
        }
        if shown:
            miss["cached_excerpt"] = detok([int(t) for t in toks[lo:hi]])
        miss["reason"] = reason
        return miss

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
