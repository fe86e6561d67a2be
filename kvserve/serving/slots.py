"""llama-server's slots: N places where a request runs, and the view ``GET /slots`` shows.

A slot is a view over the engine (DESIGN.md "Slots"): which request it runs now and
its progress. The KV blocks belong to the engine's KV cache manager, and so does the
answer to "which tokens does this idle slot hold": the engine publishes it
(``EngineCore.slot_cache``, read through ``engine.slot_cache``), so a slot whose parked
blocks the pool evicted, or whose request failed, claims nothing. While a request runs
the slot shows that request's tokens (prompt + generated so far, as llama-server's
growing cache list). Without an engine (``SlotManager(..., engine=None)``) a slot
remembers the last sequence's tokens itself.

Placement (llama-server ``get_available_slot``, seed Example 8): the slot named by
``id_slot``; else the idle slot whose remembered tokens share the longest common
prefix with the new prompt, if that prefix is more than ``--slot-prompt-similarity``
of the prompt; else the least recently used idle slot; else the request waits in
a FIFO queue (counted by ``n_deferred``, the ``requests_deferred`` gauge).

Thread-safety: every method runs on the server's asyncio loop (one thread); the
engine's ``slot_cache`` is an immutable snapshot the engine thread replaces, so reading
it needs no lock.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvserve.engine.request import RequestOutput


class SlotCacheSource(Protocol):
    """What a SlotManager reads the slots' cached tokens from (AsyncEngine, EngineCore)."""

    @property
    def slot_cache(self) -> Mapping[int, Sequence[int]]: ...


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


#: ``params`` fields llama-server leaves out of its metrics view (``task_params::to_json(true)``,
#: used by ``GET /props`` and ``GET /slots``): the request's text or tokens (stop strings, grammar,
#: DRY sequence breakers, logit bias, grammar triggers, preserved tokens)
TEXT_PARAMS = frozenset({"dry_sequence_breakers", "stop", "logit_bias", "grammar", "grammar_lazy",
                         "grammar_triggers", "preserved_tokens"})


def metrics_params(params: dict) -> dict:
    """``params`` without :data:`TEXT_PARAMS` (llama-server's ``only_metrics`` view), order kept."""
    return {k: v for k, v in params.items() if k not in TEXT_PARAMS}



@dataclass
class Slot:
    """One slot: its remembered tokens and the progress of the request it runs.

    Attributes:
        id: slot index (0-based).
        n_ctx: context of the slot in tokens (n_ctx_slot).
        tokens: tokens of the current (or, without an engine source, the last) sequence:
            prompt + generated. :meth:`cached_tokens` is what the slot holds.
        source: where an idle slot's cached tokens come from (the engine), or None.
        is_processing: a request runs in it now.
        id_task: id of the current (or last) task, -1 before the first.
        last_used: placement counter value of the last use (LRU order).
    """

    id: int
    n_ctx: int
    tokens: list[int] = field(default_factory=list)
    is_processing: bool = False
    id_task: int = -1
    last_used: int = 0
    n_prompt: int = 0
    n_prompt_cache: int = 0
    n_predict: int = -1
    n_decoded: int = 0
    has_new_line: bool = False
    has_next_token: bool = False
    params: dict = field(default_factory=dict)
    source: SlotCacheSource | None = field(default=None, repr=False, compare=False)
    speculative: bool = False  # the engine speculates (--spec-type ngram): llama-server's slot field

    def cached_tokens(self) -> Sequence[int]:
        """The tokens this slot holds: the running request's (prompt + generated so far) while
        processing; when idle, what the engine says the slot's parked KV holds (empty once
        evicted or erased), or the last sequence's tokens without an engine source."""
        if self.is_processing or self.source is None:
            return self.tokens
        return self.source.slot_cache.get(self.id, ())

    def begin(self, prompt_tokens: list[int], id_task: int, n_predict: int, params: dict) -> None:
        """Start a request in this slot."""
        self.is_processing = True
        self.id_task = id_task
        self.tokens = list(prompt_tokens)
        self.n_prompt = len(prompt_tokens)
        self.n_prompt_cache = 0
        self.n_predict = n_predict
        self.n_decoded = 0
        self.has_new_line = False
        self.has_next_token = True
        self.params = params

    def set_cached(self, tokens: list[int]) -> None:
        """The idle slot now holds ``tokens`` (after a slot file restore, or [] after erase; with
        an engine source the engine's ``slot_cache`` already says so)."""
        self.tokens = list(tokens)
        self.n_prompt = len(tokens)
        self.n_prompt_cache = len(tokens)
        self.n_decoded = 0
        self.has_new_line = False
        self.has_next_token = False

    def update(self, out: RequestOutput) -> None:
        """Apply one engine output event to the view."""
        self.tokens.extend(out.new_token_ids)
        self.n_prompt_cache = out.num_cached_tokens
        self.n_decoded = out.num_output_tokens
        if "\n" in out.text:
            self.has_new_line = True
        if out.finished:
            self.has_next_token = False

    def view(self, show_text: bool = False, detokenize=None) -> dict:
        """The ``GET /slots`` entry (llama-server's ``server_slot::to_json``: its fields, its order).

        A slot that never ran a task and holds no tokens has only ``id``, ``n_ctx``,
        ``speculative`` and ``is_processing``, as in llama-server (one restored from a slot file
        shows its tokens). ``params`` is llama-server's metrics view (no
        :data:`TEXT_PARAMS`, so one user cannot read another's stop strings or grammar) unless
        ``show_text`` (``--slots`` given explicitly, or ``LLAMA_SERVER_SLOTS_DEBUG``).
        ``detokenize`` (ids -> text; llama-server's ``LLAMA_SERVER_SLOTS_DEBUG``) adds ``prompt``
        and ``generated``, the last request's texts. An idle slot's ``next_token`` has ``n_remain``
        -1 and ``n_decoded`` 0 (llama-server: the finished task's budget does not stay on the slot;
        its tokens are still counted in ``n_prompt_tokens``)."""
        d = {"id": self.id, "n_ctx": self.n_ctx, "speculative": self.speculative, "is_processing": self.is_processing}
        if self.id_task < 0 and not self.cached_tokens():  # a restored slot file shows its tokens
            return d
        busy = self.is_processing
        n_remain = -1 if not busy or self.n_predict < 0 else max(self.n_predict - self.n_decoded, 0)
        d.update({
            "id_task": self.id_task,
            # llama-server fills this from the slot's cached token list: it grows while decoding
            "n_prompt_tokens": len(self.cached_tokens()),
            "n_prompt_tokens_processed": self.n_prompt - self.n_prompt_cache,
            "n_prompt_tokens_cache": self.n_prompt_cache,
            "params": self.params if show_text else metrics_params(self.params),
            "next_token": [{
                "has_next_token": self.has_next_token,
                "has_new_line": self.has_new_line,
                "n_remain": n_remain,
                "n_decoded": self.n_decoded if busy else 0,
            }],
        })
        if detokenize is not None:
            d["prompt"] = detokenize(list(self.tokens[:self.n_prompt]))
            d["generated"] = detokenize(list(self.tokens[self.n_prompt:]))
        return d


class SlotManager:
    """Owns the slots and the queue of requests waiting for one.

    Args:
        n_slots: number of slots (``-np``).
        n_ctx_slot: context of one slot in tokens.
        similarity: ``--slot-prompt-similarity`` (0 disables the prefix rule).
        engine: the engine whose ``slot_cache`` says which tokens each idle slot holds
            (AsyncEngine); None: each slot remembers its last sequence itself, which goes
            stale when the KV pool evicts the slot's blocks.
        speculative: the engine runs speculative decoding (``GET /slots`` ``speculative``).
    """

    def __init__(self, n_slots: int, n_ctx_slot: int, similarity: float = 0.10, *,
                 engine: SlotCacheSource | None = None, speculative: bool = False):
        self.slots = [Slot(i, n_ctx_slot, source=engine, speculative=speculative) for i in range(n_slots)]
        self.similarity = similarity
        self._waiters: deque[tuple[list[int], int, asyncio.Future]] = deque()
        self._clock = itertools.count(1)
        self._task_ids = itertools.count(0)

    # -- facts ---------------------------------------------------------------------------

    @property
    def n_busy(self) -> int:
        """Slots running a request now (``requests_processing``)."""
        return sum(s.is_processing for s in self.slots)

    @property
    def n_deferred(self) -> int:
        """Requests waiting for a slot now (``requests_deferred``)."""
        return len(self._waiters)

    def has_idle(self) -> bool:
        """True when at least one slot is idle."""
        return any(not s.is_processing for s in self.slots)

    def views(self, show_text: bool = False, detokenize=None) -> list[dict]:
        """``GET /slots`` body (``show_text``, ``detokenize``: see :meth:`Slot.view`)."""
        return [s.view(show_text, detokenize) for s in self.slots]

    def next_task_id(self) -> int:
        """A new task id (llama-server ``id_task``)."""
        return next(self._task_ids)

    # -- placement -----------------------------------------------------------------------

    def pick(self, prompt: list[int], id_slot: int = -1) -> Slot | None:
        """The slot a request would get now, or None when it has to wait."""
        if id_slot >= 0:
            s = self.slots[id_slot]
            return None if s.is_processing else s
        idle = [s for s in self.slots if not s.is_processing]
        if not idle:
            return None
        if self.similarity > 0 and prompt:
            best, best_len = None, 0
            for s in idle:
                n = common_prefix_len(s.cached_tokens(), prompt)
                if n > best_len:
                    best, best_len = s, n
            if best is not None and best_len / len(prompt) > self.similarity:
                return best
        return min(idle, key=lambda s: s.last_used)

    def _take(self, slot: Slot) -> Slot:
        slot.is_processing = True  # reserved; begin() fills the rest
        slot.last_used = next(self._clock)
        return slot

    async def acquire(self, prompt: list[int], id_slot: int = -1) -> Slot:
        """Reserve a slot for ``prompt``; waits (FIFO) while none fits.

        Raises:
            IndexError: ``id_slot`` is not a slot index.
        """
        if id_slot >= len(self.slots):
            raise IndexError(id_slot)
        if not self._waiters:
            slot = self.pick(prompt, id_slot)
            if slot is not None:
                return self._take(slot)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        entry = (prompt, id_slot, fut)
        self._waiters.append(entry)
        try:
            return await fut
        except asyncio.CancelledError:
            if entry in self._waiters:
                self._waiters.remove(entry)
            elif fut.done() and not fut.cancelled():
                self.release(fut.result())  # assigned while being cancelled: give it back
            raise

    def release(self, slot: Slot) -> None:
        """Mark ``slot`` idle (keeping its tokens) and hand free slots to waiters in order."""
        slot.is_processing = False
        slot.has_next_token = False
        self._wake()

    def _wake(self) -> None:
        for entry in list(self._waiters):
            prompt, id_slot, fut = entry
            if fut.done():
                self._waiters.remove(entry)
                continue
            slot = self.pick(prompt, id_slot)
            if slot is None:
                if not self.has_idle():
                    return
                continue  # waits for one particular slot; later waiters may still fit
            self._waiters.remove(entry)
            fut.set_result(self._take(slot))
