"""How many KV blocks the pool holds: llama-server's sizing (``-c`` x ``-np``) or a vLLM memory
budget (``--kv-cache-memory-bytes``, ``--gpu-memory-utilization`` on CUDA,
``VLLM_CPU_KVCACHE_SPACE`` on the CPU, ``--num-gpu-blocks-override``), with vLLM's start-up check
that one request of the longest allowed length fits, and vLLM's log lines.

vLLM's rules, as its ``vllm/v1/core/kv_cache_utils.py`` and ``gpu_worker.py`` apply them:

* with a budget of B bytes the pool holds ``B // block_bytes`` blocks (``block_bytes`` = all
  layers' K and V of one block of ``block_size`` tokens);
* one request of ``max_model_len`` tokens needs ``cdiv(max_model_len, block_size)`` blocks; a
  budget smaller than that refuses to start (:class:`KVCacheMemoryError`, vLLM's text), and the
  message names the longest length that fits: the largest L <= max_model_len with
  ``cdiv(L, block_size) * block_bytes <= B`` (vLLM finds it by binary search; it is a multiple
  of the block size), i.e. ``(B // block_bytes) * block_size``;
* ``--num-gpu-blocks-override N`` replaces the computed count (vLLM logs
  ``Overriding num_gpu_blocks=... with num_gpu_blocks_override=...``); kvserve also refuses an
  override too small for one request (vLLM does not check it and fails later);
* the log: ``Available KV cache memory: 5.26 GiB`` (with a budget) and ``GPU KV cache size:
  43,056 tokens, Maximum concurrency for 32,768 tokens per request: 1.31x`` where the tokens are
  ``num_blocks * block_size`` and the concurrency ``tokens / max_model_len`` (seed 002 Example
  3). kvserve says ``CPU KV cache size`` on the CPU (vLLM's CPU backend prints ``GPU`` there too).

kvserve's own limits on a budget (not vLLM's):

* the pool never holds more blocks than the server can use at once: ``n_slots`` (``-np`` /
  ``--max-num-seqs``) sequences of ``cdiv(max_model_len, block_size)`` blocks. A larger budget
  is capped to that (one log line says so and why; vLLM's lines then give the capped pool):
  every block costs bookkeeping (about 220 bytes of host memory each) and start-up time, so
  ``--kv-cache-memory-bytes 20G`` on a tiny model took 21 s and 1.48 GB before the cap;
* on the CPU a budget above the machine's ``MemAvailable`` is a start-up error
  (:class:`KVCacheMemoryError`): the pool is host memory there (vLLM refuses too little, kvserve
  also refuses too much on the CPU).

Without a budget kvserve sizes the pool as llama-server does: ``cdiv(n_ctx, block_size)`` blocks
plus one partial block per slot (``-c`` is the total context of all slots).

Sliding-window layers (:class:`KVLayout`; gemma2, gemma3): the block counts above are those of
the full-attention layers (``block_bytes`` counts only them); each sliding window's layers have a
pool of their own. A sequence holds there the window's blocks (``cdiv(window, block_size) + 1``),
one block more where a chunk starts mid-block, and the blocks of its step's chunk; the pool holds
that twice per slot (a slot's idle, parked window beside the sequence it admits) plus one step's
chunk (``cdiv(max_num_batched_tokens, block_size)``), never more than the full layers' blocks
plus one per slot. A budget pays for those pools first; one request needs its full-layer blocks
plus ``min(its blocks, the window's and a chunk's)`` in each sliding pool.

When every layer slides (phi3 with its window; a gemma3 of fewer than 6 layers) there is no
full-attention layer: the full pool keeps the block tables and the prefix index at 0 bytes a
block (every slot's whole context), and a budget caps each sliding pool instead
(:attr:`PoolPlan.group_cap`); one request then needs only its window's blocks.

Lower layer: no HTTP, no environment variables (the serving layer turns flags and ``VLLM_*``
variables into :class:`~kvserve.config.EngineConfig` fields); :func:`plan_engine_pool` reads the
host's ``MemAvailable`` (``/proc/meminfo``) on the CPU unless given a reader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.engine.kv_quant import kv_bytes_per_token
from kvserve.loaders.weights import ModelLoadError

GIB = 1 << 30

log = logging.getLogger("kvserve.engine")


class KVCacheMemoryError(ModelLoadError):
    """The KV budget cannot hold one request of the longest allowed length (vLLM's start-up
    ValueError; the message is vLLM's text)."""


def format_gib(n_bytes: int) -> str:
    """vLLM's ``format_gib``: ``str(round(n_bytes / 2**30, 2))`` (16.0, 5.26)."""
    return str(round(n_bytes / GIB, 2))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def estimate_max_model_len(available_bytes: int, max_model_len: int, block_size: int, block_bytes: int) -> int:
    """The longest request (tokens, <= ``max_model_len``) whose blocks fit in ``available_bytes``;
    0 when not even one token fits (vLLM's ``estimate_max_model_len``, in closed form)."""
    blocks = max(available_bytes, 0) // block_bytes
    return min(blocks * block_size, max_model_len)


def not_enough_memory_text(max_model_len: int, needed_bytes: int, available_bytes: int, estimated: int,
                           fix: str) -> str:
    """vLLM's message for a KV budget below one request of ``max_model_len`` tokens.

    ``fix`` names the settings to change (vLLM: "increasing `gpu_memory_utilization` or
    decreasing `max_model_len`")."""
    estimated_msg = ""
    if estimated > 0:
        estimated_msg = f"Based on the available memory, the estimated maximum model length is {estimated}. "
    return (f"To serve at least one request with the model's max seq len ({max_model_len}), "
            f"({format_gib(needed_bytes)} GiB KV cache is needed, which is larger than the available KV cache "
            f"memory ({format_gib(available_bytes)} GiB). {estimated_msg}Try {fix} when initializing the engine.")


NO_MEMORY_TEXT = ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                  "initializing the engine.")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Which layers keep which KV (sliding-window groups) and what a block costs in each.

    Attributes:
        windows: per sliding-window group, (window in tokens, layer indices); empty when every
            layer attends to every earlier token (then one pool serves all layers).
        block_bytes: K and V bytes of one block in the full-attention layers (all layers when
            ``windows`` is empty; 0 when every layer slides).
        all_block_bytes: K and V bytes of one block in every layer (the host tier's unit).
        window_block_bytes: per group, one block's bytes in its layers.
        window_seq_blocks: per group, the most blocks one sequence holds: ``cdiv(window,
            block_size) + 2`` plus one step's chunk.
        window_pool_blocks: per group, the blocks its pool holds for running sequences and idle
            slots: two windows a slot (``2 * n_slots * (cdiv(window, block_size) + 2)``) and one
            step's chunk.
    """

    windows: tuple[tuple[int, tuple[int, ...]], ...]
    block_bytes: int
    all_block_bytes: int
    window_block_bytes: tuple[int, ...] = ()
    window_seq_blocks: tuple[int, ...] = ()
    window_pool_blocks: tuple[int, ...] = ()

    def group_blocks(self, active_blocks: int, n_slots: int, cap: int | None = None) -> list[int]:
        """Blocks of each sliding group's pool for ``active_blocks`` full-layer blocks: its
        windows' need, never more than the full layers' blocks plus one per sequence. When every
        layer slides (phi3 with its window; ``block_bytes`` 0), never more than ``active_blocks``
        (what one pool of every layer would hold) nor ``cap`` (:attr:`PoolPlan.group_cap`, a
        budget's blocks)."""
        if not self.block_bytes and self.windows:
            most = active_blocks if cap is None else min(active_blocks, cap)
            return [min(p, most) for p in self.window_pool_blocks]
        return [min(p, active_blocks + max(n_slots, 1)) for p in self.window_pool_blocks]

    def kv_bytes(self, active_blocks: int, n_slots: int, cap: int | None = None) -> int:
        """The pool's bytes for ``active_blocks`` full-layer blocks, sliding groups included
        (``cap``: as :meth:`group_blocks`)."""
        return active_blocks * self.block_bytes + sum(
            n * b for n, b in zip(self.group_blocks(active_blocks, n_slots, cap), self.window_block_bytes))

    def costs(self) -> tuple[tuple[int, int, int], ...]:
        """(pool blocks, block bytes, one sequence's blocks) per group, for :func:`plan_pool`."""
        return tuple(zip(self.window_pool_blocks, self.window_block_bytes, self.window_seq_blocks))


def window_groups(model_config, n_ctx_slot: int | None = None) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The sliding-window layer groups of a model config, from its family's KV spec per layer
    (kvserve.models.family): (window, layer indices), windows ascending; empty when no layer
    slides, or for an architecture no family reads. A window of 1 gets no group (its layers are
    masked in the one pool). A window of at least ``n_ctx_slot`` tokens
    (one sequence's context) never leaves a token behind: its layers count as full attention.
    When every layer slides (phi3's window), the groups cover every layer: the full-attention
    pool keeps the block tables and the prefix index with no layer's rows (0 bytes a block).

    Only a module that reads its sliding layers' rows through ``AttentionBatch.windows`` (class
    attribute ``window_kv_views = True``, as kvserve.models.gemma's and kvserve.models.gpt_oss's) gets
    groups; any other keeps one pool for every layer and masks by the window."""
    from kvserve.models.family import family_of

    try:
        fam = family_of(model_config.arch)
        specs = fam.kv_spec(model_config)
        if not any(spec.kind == "sliding" for spec in specs) \
                or not getattr(fam.module_class(), "window_kv_views", False):
            return ()
    except (ModelLoadError, AttributeError):
        return ()
    by_window: dict[int, list[int]] = {}
    for i, spec in enumerate(specs):
        # a window of 1 (each query sees only its own key) keeps one pool, masked: a group's pool
        # needs 2 tokens at least (kvserve.engine.kv_cache)
        if spec.kind == "sliding" and spec.window >= 2 and (n_ctx_slot is None or spec.window < n_ctx_slot):
            by_window.setdefault(spec.window, []).append(i)
    if not by_window:
        return ()
    return tuple((w, tuple(by_window[w])) for w in sorted(by_window))


def kv_layout(model_config, *, block_size: int, n_slots: int, max_num_batched_tokens: int, kv_dtype: str,
              kv_dtype_v: str | None = None, windows: bool = True, n_ctx_slot: int | None = None) -> KVLayout:
    """The :class:`KVLayout` of a model config for an engine's settings (``windows`` False: one
    pool for every layer, as a tensor- or pipeline-parallel engine keeps; ``n_ctx_slot``: one
    sequence's context, windows at least that long are full attention)."""
    c = model_config
    tv = kv_dtype_v or kv_dtype
    per = lambda n: block_size * kv_bytes_per_token(n, c.n_head_kv, c.head_dim, kv_dtype, tv)  # noqa: E731
    groups = window_groups(c, n_ctx_slot) if windows else ()
    all_bb = per(c.n_layer)
    if not groups:
        return KVLayout((), all_bb, all_bb)
    n_sliding = sum(len(layers) for _, layers in groups)
    chunk = cdiv(max(max_num_batched_tokens, 1), block_size)
    seq = tuple(cdiv(w, block_size) + 2 + chunk for w, _ in groups)
    pool = tuple(2 * max(n_slots, 1) * (cdiv(w, block_size) + 2) + chunk for w, _ in groups)
    return KVLayout(groups, per(c.n_layer - n_sliding), all_bb, tuple(per(len(layers)) for _, layers in groups),
                    seq, pool)


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """The KV pool's size for running sequences (the null block and the host tier come on top).

    Attributes:
        active_blocks: blocks for running sequences.
        budget_bytes: the memory budget it came from (bytes), None when sized by ``-c``/``-np``.
        source: what set it: ``--kv-cache-memory-bytes``, ``--gpu-memory-utilization``,
            ``VLLM_CPU_KVCACHE_SPACE``, ``--num-gpu-blocks-override`` or ``-c/-np``.
        tokens: vLLM's "KV cache size" figure: ``active_blocks * block_size``.
        concurrency: ``tokens / max_model_len``: requests of ``max_model_len`` tokens that fit at once.
        max_model_len: the longest sequence (tokens) the figures are for.
        capped_from: the blocks the budget held before the cap to what ``n_slots`` sequences
            can use at once (see the module docstring), None when not capped.
        n_slots: sequences at once (the cap's figure).
        group_cap: when every layer slides (no full-attention layer: ``active_blocks`` are block
            tables at 0 bytes), the most blocks each sliding group's pool may hold under the
            budget (:meth:`KVLayout.group_blocks`); None without a budget.
    """

    active_blocks: int
    budget_bytes: int | None
    source: str
    tokens: int
    concurrency: float
    max_model_len: int
    capped_from: int | None = None
    n_slots: int = 1
    group_cap: int | None = None

    def lines(self, device_type: str) -> list[str]:
        """vLLM's start-up log lines for this pool (``GPU`` on CUDA, ``CPU`` on the CPU), after
        kvserve's line when the budget was capped."""
        out = []
        if self.capped_from is not None:
            out.append(f"{self.source}: the budget holds {self.capped_from:,} blocks; the KV cache is capped at "
                       f"{self.active_blocks:,} blocks ({self.n_slots} sequences of {self.max_model_len:,} tokens, "
                       f"the most the server runs at once; more blocks would cost memory and start-up time "
                       f"and never be used)")
        if self.budget_bytes is not None:
            out.append(f"Available KV cache memory: {format_gib(self.budget_bytes)} GiB")
        where = "CPU" if device_type == "cpu" else "GPU"
        out.append(f"{where} KV cache size: {self.tokens:,} tokens, Maximum concurrency for "
                   f"{self.max_model_len:,} tokens per request: {self.concurrency:.2f}x")
        return out


def budget_source(kv_cache_memory_bytes: int | None, gpu_memory_utilization: float | None,
                  cpu_kv_cache_memory_bytes: int | None, device_type: str) -> str | None:
    """Which budget applies on ``device_type`` ("cpu" | "cuda"): ``--kv-cache-memory-bytes``
    first (vLLM: it overrides the utilization), then ``--gpu-memory-utilization`` on CUDA, then
    ``VLLM_CPU_KVCACHE_SPACE`` on the CPU; None: llama-server's sizing."""
    if kv_cache_memory_bytes is not None:
        return "--kv-cache-memory-bytes"
    if gpu_memory_utilization is not None and device_type != "cpu":
        return "--gpu-memory-utilization"
    if cpu_kv_cache_memory_bytes is not None and device_type == "cpu":
        return "VLLM_CPU_KVCACHE_SPACE"
    return None


_FIX = {"--kv-cache-memory-bytes": "increasing `kv_cache_memory_bytes` or decreasing `max_model_len`",
        "--gpu-memory-utilization": "increasing `gpu_memory_utilization` or decreasing `max_model_len`",
        "VLLM_CPU_KVCACHE_SPACE": "increasing VLLM_CPU_KVCACHE_SPACE or decreasing `max_model_len`",
        "--num-gpu-blocks-override": "increasing `num_gpu_blocks_override` or decreasing `max_model_len`"}


def plan_pool(*, n_ctx: int, n_ctx_slot: int, n_slots: int, block_size: int, block_bytes: int,
              budget_bytes: int | None = None, source: str | None = None,
              num_blocks_override: int | None = None,
              note: Callable[[int, str], None] | None = None,
              mem_available: int | None = None, windows: tuple[tuple[int, int, int], ...] = ()) -> PoolPlan:
    """The pool for running sequences.

    Args:
        n_ctx: total context (tokens, ``-c`` or the model's); n_ctx_slot: one sequence's
            context (tokens; vLLM's max_model_len); n_slots: sequences at once.
        block_size: tokens per block; block_bytes: KV bytes of one block, all layers.
        budget_bytes / source: a memory budget (bytes) and what gave it (see
            :func:`budget_source`); None: llama-server's sizing.
        num_blocks_override: ``--num-gpu-blocks-override``.
        note: ``(logging level, text)`` sink for vLLM's override line.
        mem_available: the host's ``MemAvailable`` (bytes) where the pool is host memory (the
            CPU); a budget above it is refused. None: not checked.
        windows: sliding-window groups' costs, (pool blocks, block bytes, one sequence's
            blocks) each (:meth:`KVLayout.costs`): a budget pays for their pools first, and one
            request needs ``min(its blocks, one sequence's)`` of each besides its full-layer
            blocks (``block_bytes``: the full-attention layers' alone). With ``block_bytes`` 0
            (no full-attention layer: every layer slides) the full pool's blocks cost nothing:
            it holds every slot's whole context, and a budget caps the sliding pools instead
            (:attr:`PoolPlan.group_cap`; one request needs its window's blocks).

    Raises:
        KVCacheMemoryError: the budget (or the override) holds less than one request of
            ``n_ctx_slot`` tokens; or a budget of 0 bytes or less (vLLM's texts); a budget above
            ``mem_available`` (kvserve's).
    """
    if not block_bytes and windows:  # every layer slides
        return _plan_sliding_only(n_ctx=n_ctx, n_ctx_slot=n_ctx_slot, n_slots=n_slots, block_size=block_size,
                                  budget_bytes=budget_bytes, source=source, num_blocks_override=num_blocks_override,
                                  note=note, mem_available=mem_available, windows=windows)
    per_request = cdiv(n_ctx_slot, block_size)
    one_windows = sum(min(per_request, seq) * b for _, b, seq in windows)  # one request's sliding blocks
    pools = sum(n * b for n, b, _ in windows)
    capped_from = None
    if budget_bytes is not None:
        if budget_bytes <= 0:
            raise KVCacheMemoryError(NO_MEMORY_TEXT)
        _check_fits(budget_bytes, per_request * block_bytes, n_ctx_slot, block_size, block_bytes, source or "",
                    one_windows)
        if mem_available is not None and budget_bytes > mem_available:
            raise KVCacheMemoryError(
                f"{source}: the KV cache budget ({format_gib(budget_bytes)} GiB) is larger than the memory available "
                f"on this machine ({format_gib(mem_available)} GiB MemAvailable); on the CPU the KV cache is host "
                f"memory. Try decreasing it (one request of {n_ctx_slot} tokens needs "
                f"{per_request * block_bytes / (1 << 20):.2f} MiB).")
        active = (budget_bytes - pools) // block_bytes  # the sliding-window pools are paid first
        if active < per_request:  # room for about one request: its own sliding blocks instead
            active = (budget_bytes - one_windows) // block_bytes
        usable = max(n_slots, 1) * per_request
        if active > usable:
            capped_from, active = active, usable
    else:
        active = cdiv(n_ctx, block_size) + n_slots
        source = "-c/-np"
    if num_blocks_override is not None:
        if note is not None:
            note(logging.INFO, f"Overriding num_gpu_blocks={active} with num_gpu_blocks_override={num_blocks_override}")
        _check_fits(num_blocks_override * block_bytes + one_windows, per_request * block_bytes, n_ctx_slot,
                    block_size, block_bytes, "--num-gpu-blocks-override", one_windows)
        active, source = num_blocks_override, "--num-gpu-blocks-override"
    tokens = active * block_size
    return PoolPlan(active, budget_bytes, source or "", tokens, tokens / n_ctx_slot, n_ctx_slot, capped_from,
                    max(n_slots, 1))


def _plan_sliding_only(*, n_ctx: int, n_ctx_slot: int, n_slots: int, block_size: int, budget_bytes: int | None,
                       source: str | None, num_blocks_override: int | None, note, mem_available: int | None,
                       windows: tuple[tuple[int, int, int], ...]) -> PoolPlan:
    """:func:`plan_pool` when every layer slides (phi3's window): the full pool keeps block tables at
    0 bytes a block (``cdiv(n_ctx, block_size)`` plus one a slot, or every slot's whole context under
    a budget); a budget (or ``--num-gpu-blocks-override``: blocks of every layer) caps each sliding
    pool at what it pays for, and must hold one request's window blocks."""
    per_request = cdiv(n_ctx_slot, block_size)
    every = sum(b for _, b, _ in windows)  # one block of every group: every layer
    one = sum(min(per_request, seq) * b for _, b, seq in windows)  # one request's sliding blocks
    active = cdiv(n_ctx, block_size) + n_slots
    cap = None
    if budget_bytes is not None:
        if budget_bytes <= 0:
            raise KVCacheMemoryError(NO_MEMORY_TEXT)
        if mem_available is not None and budget_bytes > mem_available:
            raise KVCacheMemoryError(
                f"{source}: the KV cache budget ({format_gib(budget_bytes)} GiB) is larger than the memory available "
                f"on this machine ({format_gib(mem_available)} GiB MemAvailable); on the CPU the KV cache is host "
                f"memory. Try decreasing it (one request of {n_ctx_slot} tokens needs {one / (1 << 20):.2f} MiB).")
        cap = budget_bytes // every
        active = max(n_slots, 1) * per_request
    else:
        source = "-c/-np"
    if num_blocks_override is not None:
        if note is not None:
            note(logging.INFO, f"Overriding num_gpu_blocks={cap if cap is not None else active} with "
                               f"num_gpu_blocks_override={num_blocks_override}")
        cap, source = num_blocks_override, "--num-gpu-blocks-override"
        active = max(n_slots, 1) * per_request
    if cap is not None and cap * every < one:
        raise KVCacheMemoryError(not_enough_memory_text(
            n_ctx_slot, one, cap * every, estimate_max_model_len(cap * every, n_ctx_slot, block_size, every),
            _FIX.get(source or "", _FIX["--kv-cache-memory-bytes"])))
    tokens = active * block_size
    return PoolPlan(active, budget_bytes, source or "", tokens, tokens / n_ctx_slot, n_ctx_slot, None,
                    max(n_slots, 1), cap)


def _check_fits(available: int, needed: int, max_model_len: int, block_size: int, block_bytes: int,
                source: str, windows_bytes: int = 0) -> None:
    """``needed`` full-layer bytes plus ``windows_bytes`` (one request's sliding-window blocks)
    against ``available``; the estimated length counts the full layers' blocks in what is left."""
    if needed + windows_bytes > available:
        est = estimate_max_model_len(available - windows_bytes, max_model_len, block_size, block_bytes)
        raise KVCacheMemoryError(not_enough_memory_text(max_model_len, needed + windows_bytes, available, est,
                                                        _FIX.get(source, _FIX["--kv-cache-memory-bytes"])))


def cuda_budget_bytes(utilization: float, total_bytes: int, free_bytes: int, activation_bytes: int) -> int:
    """``--gpu-memory-utilization`` on CUDA, measured after the weights are on the device:
    ``total x utilization`` less everything on the device now (this process's weights and CUDA
    context, other processes) and the estimated activation peak of one step (bytes; may be
    negative, which :func:`plan_pool` refuses with vLLM's "No available memory" text).

    vLLM profiles a forward pass for the peak and counts only its own process; kvserve
    estimates the peak and counts other processes' memory against the share, which errs on the
    safe side on a shared GPU."""
    return int(total_bytes * utilization) - (total_bytes - free_bytes) - activation_bytes


def activation_bytes(max_num_batched_tokens: int, n_ctx_slot: int, n_slots: int, n_embd: int, n_ff: int,
                     n_vocab: int) -> int:
    """Estimated activation peak of one step (bytes, float32): one batch's hidden states and
    MLP intermediates plus a row of logits per sequence (the serving layer's memory estimate)."""
    n_tok = min(max(max_num_batched_tokens, 1), max(n_ctx_slot, 1))
    return 4 * (n_tok * (8 * n_embd + 3 * n_ff) + n_slots * n_vocab)


def plan_engine_pool(config, model_config, *, n_ctx: int, n_ctx_slot: int, n_slots: int, block_bytes: int,
                     device_type: str, mem_get_info: Callable[[], tuple[int, int]] | None = None,
                     note: Callable[[int, str], None] | None = None,
                     mem_available: Callable[[], int | None] | None = None,
                     windows: tuple[tuple[int, int, int], ...] = ()) -> PoolPlan:
    """:func:`plan_pool` for an engine: the budget from ``config``
    (:class:`~kvserve.config.EngineConfig`: ``kv_cache_memory_bytes``,
    ``gpu_memory_utilization`` on CUDA, ``cpu_kv_cache_memory_bytes`` on the CPU,
    ``num_gpu_blocks_override``); ``model_config`` gives the sizes of the activation estimate.
    Called once the weights are on the device, so that CUDA's free memory counts them.

    Args:
        mem_get_info: ``() -> (free, total)`` device bytes (default ``torch.cuda.mem_get_info``).
        note: ``(level, text)`` sink for log lines (the override line).
        mem_available: ``() -> bytes or None``, the host's MemAvailable (default: /proc/meminfo),
            read on the CPU with a budget.

    Raises:
        KVCacheMemoryError: see :func:`plan_pool`.
    """
    bs = config.block_size
    source = budget_source(config.kv_cache_memory_bytes, config.gpu_memory_utilization,
                           config.cpu_kv_cache_memory_bytes, device_type)
    budget = None
    if source == "--kv-cache-memory-bytes":
        budget = config.kv_cache_memory_bytes
    elif source == "VLLM_CPU_KVCACHE_SPACE":
        budget = config.cpu_kv_cache_memory_bytes
    elif source == "--gpu-memory-utilization":
        if mem_get_info is None:
            import torch

            device = torch.device(config.resolve_device())
            mem_get_info = lambda: torch.cuda.mem_get_info(device)
        free, total = mem_get_info()
        c = model_config
        budget = cuda_budget_bytes(config.gpu_memory_utilization, total, free,
                                   activation_bytes(config.max_num_batched_tokens, n_ctx_slot, n_slots, c.n_embd,
                                                    c.n_ff, c.n_vocab))
    host = None
    if device_type == "cpu" and budget is not None:
        if mem_available is None:
            from kvserve.config import mem_available_bytes as mem_available
        host = mem_available()
    return plan_pool(n_ctx=n_ctx, n_ctx_slot=n_ctx_slot, n_slots=n_slots, block_size=bs, block_bytes=block_bytes,
                     budget_bytes=budget, source=source, num_blocks_override=config.num_gpu_blocks_override,
                     note=note, mem_available=host, windows=windows)


__all__ = [
    "GIB",
    "NO_MEMORY_TEXT",
    "KVCacheMemoryError",
    "KVLayout",
    "PoolPlan",
    "activation_bytes",
    "budget_source",
    "cdiv",
    "cuda_budget_bytes",
    "estimate_max_model_len",
    "format_gib",
    "kv_layout",
    "kv_bytes_per_token",
    "not_enough_memory_text",
    "plan_engine_pool",
    "plan_pool",
    "window_groups",
]
