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
from dataclasses import dataclass, field

from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledChunk:
    """``num_new_tokens`` tokens of ``request`` starting at ``request.num_computed_tokens``."""

    request: Request
    num_new_tokens: int

    @property
    def completes(self) -> bool:
        """After this chunk every known token is in the cache: the step samples a token."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """The step's chunks, who was preempted, and KV rows to copy first (copy on write:
    (src block, dst block, rows))."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    kv_copies: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class Scheduler:
    """Owns the waiting and running queues. Engine thread only.

    Args:
        kv: the KV cache manager (asked for blocks, never modified directly).
        max_num_seqs: sequences per step (llama-server slots).
        max_num_batched_tokens: token budget per step.
    """

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

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
        self.requests.pop(request.request_id, None)
        if request.priority_slot >= 0:
            self.kv.park(request.request_id, f"slot:{request.priority_slot}")
        else:
            self.kv.free(request.request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step ----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
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
            budget -= n
            i += 1
        budget = self.max_num_batched_tokens - out.num_tokens
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            if not self._admit(req, budget):
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, n))
            budget -= n
        out.kv_copies = self.kv.take_copies()
        return out

    def _admit(self, req: Request, budget: int) -> bool:
        """Reuse the longest cached prefix, then allocate the first chunk. False: no room."""
        kv = self.kv
        hit_tokens = 0
        if req.params.cache_prompt:
            hit = kv.match_prefix(req.all_token_ids, req.cache_salt, req.num_tokens - 1)
            hit_tokens = kv.hit_tokens(hit)
            if hit_tokens and not kv.allocate_prefix(req.request_id, hit):
                return False
        n = min(req.num_tokens - hit_tokens, budget)
        if not kv.allocate(req.request_id, hit_tokens + n):
            kv.free(req.request_id)
            return False
        req.num_computed_tokens = hit_tokens
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = hit_tokens
        if req.priority_slot >= 0:
            kv.release_parked(f"slot:{req.priority_slot}")
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
