"""EngineCore: the synchronous engine. ``step()`` = schedule, execute, update.

Not thread-safe: one thread owns it (AsyncEngine's engine thread, or the
caller of ``kvserve.LLM``).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from kvserve.config import EngineConfig
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.kv_budget import kv_layout, plan_engine_pool
from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.kv_quant import kv_bytes_per_token
from kvserve.engine.request import (
    InvalidRequestError,
    PromptProgress,
    Request,
    RequestOutput,
    RequestStatus,
    Timings,
    TokenLogprob,
    TopLogprob,
    cache_key_of,
    check_prompt,
    split_cache_key,
)
from kvserve.engine.model_runner import ModelRunner, SampleFailure, StepResult
from kvserve.engine.sampler import BreakerCache, SampleResult, SequenceSampler
from kvserve.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from kvserve.engine.slot_file import (
    SlotFileError,
    SlotHeader,
    adapter_fingerprint,
    model_fingerprint,
    read_slot_file,
    write_slot_file,
)
from kvserve.engine.spec_decode import (
    CHUNK_ROWS_GPU,
    CHUNK_ROWS_NATIVE,
    STEP_BASE_ROWS_GPU,
    STEP_BASE_ROWS_NATIVE,
    SpecDecoder,
    accepted_prefix,
)
from kvserve.loaders.weights import LoadedModel
from kvserve.models.build import build_model

log = logging.getLogger("kvserve.engine")


@dataclass
class _SeqState:
    """Per-request objects that live beside the Request: sampler and detokenizer."""

    sampler: SequenceSampler
    detok: IncrementalDetokenizer
    prompt_logprobs: list = field(default_factory=list)
    sent_prompt_logprobs: bool = False


@dataclass
class EngineStats:
    """Counters since start (Prometheus counters) and current gauges."""

    prompt_tokens_total: int = 0  # processed (not cached) prompt tokens
    prompt_tokens_cached_total: int = 0
    tokens_predicted_total: int = 0
    prompt_seconds_total: float = 0.0
    tokens_predicted_seconds_total: float = 0.0
    n_decode_total: int = 0  # model steps
    n_busy_slots_total: int = 0  # sum over steps of sequences in the step
    n_tokens_max: int = 0
    requests_finished: int = 0
    num_preemptions: int = 0
    # speculative decoding (vLLM's spec_decode counters): verification chunks run, draft
    # tokens proposed, draft tokens accepted, accepted tokens by draft position (0-based)
    spec_drafts_total: int = 0
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)


class EngineCore:
    """Paged-KV continuous-batching engine for one model.

    Args:
        loaded: the LoadedModel (weights, tokenizer...).
        config: EngineConfig (n_ctx, slots, KV dtype, ...).
        make_runner: ``(num_blocks, block_size) -> runner`` in place of building the model
            and a :class:`ModelRunner` (the weights are then not read): a stand-in with
            ModelRunner's interface, e.g. :class:`kvserve.engine.fake.FakeRunner` for tests
            of scheduling without a model (``kvserve.engine.fake.fake_engine_core``).

    Attributes:
        n_ctx: total KV context (tokens); n_ctx_slot: one sequence's context.
        tokenizer, model_info, model_config.
        slot_cache: slot id -> the tokens whose KV the idle slot holds (its parked blocks),
            as of the end of the last step or slot operation; slots holding nothing are
            absent. The one source of a slot's cached tokens (the serving layer's
            SlotManager reads it): a read-only mapping of tuples that is replaced, never
            changed, so any thread may read it.
    """

    def __init__(self, loaded: LoadedModel, config: EngineConfig, *,
                 make_runner: Callable[[int, int], ModelRunner] | None = None):
        self.config = config
        self._lora_fingerprints: dict[int, tuple[object, str]] = {}  # adapter id -> (adapter, fingerprint)
        self.threads = config.apply_threads()
        self.tokenizer = loaded.tokenizer
        self.model_info = loaded.info
        self.model_config = loaded.config
        self.chat_template = loaded.chat_template
        self.n_ctx = config.resolve_n_ctx(loaded.config.n_ctx_train)
        self.n_ctx_slot = config.n_ctx_slot(loaded.config.n_ctx_train)
        self.n_slots = config.n_slots
        max_pos = max(self.n_ctx_slot, self.n_ctx) + config.block_size
        if make_runner is None and config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            from kvserve.engine.parallel import ParallelRunner  # tp/pp: the model is split over ranks

            make_runner = lambda nb, b: ParallelRunner(loaded, config, nb, b, max_pos)  # noqa: E731
        if make_runner is None:
            self.model = build_model(loaded, config, max_positions=max_pos)
        dev_type = self.model.device.type if make_runner is None else torch.device(config.resolve_device()).type
        num_blocks, group_blocks = self._plan_kv(loaded.config, dev_type, windows=make_runner is None)
        self._start_runner(make_runner, num_blocks, group_blocks)
        #: speculative decoding's draft model (method "draft_model"; kvserve.engine.draft), or None
        self.draft = None
        if config.spec.enabled and config.spec.method == "draft_model" and make_runner is None:
            self._load_draft(loaded, num_blocks, max_pos)
        if config.compile:
            self.runner.start_compile(self.n_slots * ModelRunner.DECODE_LIKE_MAX)
        self.scheduler = Scheduler(self.kv, self.n_slots, config.max_num_batched_tokens, self.n_ctx_slot)
        self.scheduler.detokenize = self._excerpt
        self.scheduler.lora = getattr(self.runner, "lora", None)
        self._setup_spec()
        self._init_state()

    def _plan_kv(self, c, dev_type: str, *, windows: bool) -> tuple[int, list[int]]:
        """Size the KV pool for model config ``c`` and build the KV cache manager (``self.kv``);
        logs llama-server's lines about it. Returns the pool's blocks and each sliding-window
        group's blocks.

        ``windows``: sliding-window layers get pools of their own (kv_cache's groups) when this
        process runs the model (a stand-in runner or a split model: one pool)."""
        config, bs = self.config, self.config.block_size
        self.block_bytes = bs * kv_bytes_per_token(c.n_layer, c.n_head_kv, c.head_dim, config.kv_dtype,
                                                   config.kv_dtype_v)
        #: which layers keep which KV
        self.kv_layout = kv_layout(c, block_size=bs, n_slots=self.n_slots,
                                   max_num_batched_tokens=config.max_num_batched_tokens, kv_dtype=config.kv_dtype,
                                   kv_dtype_v=config.kv_dtype_v, windows=windows, n_ctx_slot=self.n_ctx_slot)
        # the pool: blocks for running sequences (n_ctx tokens plus one partial block per
        # sequence, or a vLLM memory budget: see kv_budget), the host tier (--cache-ram), and
        # the null block
        self.pool = plan_engine_pool(config, c, n_ctx=self.n_ctx, n_ctx_slot=self.n_ctx_slot,
                                     n_slots=self.n_slots, block_bytes=self.kv_layout.block_bytes,
                                     device_type=dev_type, windows=self.kv_layout.costs(),
                                     note=lambda level, text: log.log(level, "%s", text, extra={"func": "load_model"}))
        for line in self.pool.lines(dev_type):
            log.info("%s", line, extra={"func": "load_model"})
        active = self.pool.active_blocks
        self.cache_ram_mib = config.cache_ram_mib()
        host = config.host_tier_blocks(self.block_bytes, active, self.cache_ram_mib)
        log.info("host KV tier (--cache-ram): %d MiB%s, %d blocks of %d KiB", self.cache_ram_mib,
                 " (flag not given: min(8192 MiB, MemAvailable / 4))" if config.cache_ram is None else "",
                 host, self.block_bytes >> 10, extra={"func": "load_model"})
        num_blocks = 1 + active + host
        lay = self.kv_layout
        # a sliding group's pool: its windows' blocks, and a host tier of as many blocks as the full
        # layers' (a later prompt's hit needs the blocks before its end in every group)
        group_blocks = [1 + n + host for n in lay.group_blocks(active, self.n_slots, self.pool.group_cap)]
        self.kv = KVCacheManager(num_blocks, bs, host_blocks=host,
                                 groups=[(w, nb, host) for (w, _), nb in zip(lay.windows, group_blocks)])
        for (w, layers), nb in zip(lay.windows, group_blocks):
            log.info("sliding-window layers (window %d tokens, %d layers): a pool of their own of %d blocks "
                     "(%d for running sequences: %d a sequence at most)", w, len(layers), nb, nb - 1 - host,
                     -(-w // bs) + 1, extra={"func": "load_model"})
        return num_blocks, group_blocks

    def _start_runner(self, make_runner: Callable[[int, int], ModelRunner] | None, num_blocks: int,
                      group_blocks: list[int]) -> None:
        """The model runner over ``num_blocks`` KV blocks (``self.runner``, ``self.device``): this
        process's ModelRunner around ``self.model``, or ``make_runner``'s (a stand-in, a split model)."""
        config, bs = self.config, self.config.block_size
        if make_runner is None:
            self.runner = ModelRunner(self.model, num_blocks, bs, config.kv_dtype, self.model.device,
                                      kv_dtype_v=config.kv_dtype_v,
                                      groups=[(w, layers, nb) for (w, layers), nb
                                              in zip(self.kv_layout.windows, group_blocks)])
        else:
            self.runner = make_runner(num_blocks, bs)
            self.model = self.runner.model
        self.device = self.runner.device

    def _load_draft(self, loaded: LoadedModel, num_blocks: int, max_pos: int) -> None:
        """Load speculative decoding's draft model (``self.draft``)."""
        from kvserve.engine.draft import DraftModel

        try:
            self.draft = DraftModel.load(self.config.spec.draft_model, loaded, self.config, num_blocks,
                                         self.config.block_size, max_pos)
        except BaseException:
            # the target's native step packs its weights in a daemon thread (torch ops): let it end
            # first, else a start-up error that exits the process aborts it in that thread (SIGABRT)
            nat = getattr(self.runner, "native", None)
            if nat is not None:
                nat.wait(timeout=120.0)
            raise
        self._draft_cost = self.draft.cost_ratio

    def _setup_spec(self) -> None:
        """The speculative decoding policy (``self.spec``, None when off) and the scheduler's view of it."""
        config = self.config
        #: speculative decoding policy (None: off)
        self.spec = SpecDecoder(config.spec) if config.spec.enabled else None
        #: the policy takes the native decode step's costs once it is loaded (see _step)
        self._spec_native_pending = self.spec is not None and getattr(self.runner, "native", None) is not None
        if self.spec is None:
            return
        self.scheduler.spec = self.spec
        if self.draft is not None:  # the policy charges each drafted token a draft step
            self.spec.draft_cost = self._draft_cost
        if self.device.type != "cpu":
            self.spec.base_rows, self.spec.chunk_rows = STEP_BASE_ROWS_GPU, CHUNK_ROWS_GPU
        if self.device.type == "cpu" and config.small_batch_rows > 0:
            # verification steps stay within the small-batch kernel's rows: the drafts'
            # logits then come from the kernels a plain decode step uses
            self.scheduler.spec_max_rows = config.small_batch_rows

    def _init_state(self) -> None:
        """The per-request state, counters and options of a fresh engine."""
        # DRY breaker sets shared by this engine's requests; bound to the tokenizer, not to
        # self, so that nothing outside this engine holds it (see BreakerCache)
        self.breakers = BreakerCache(functools.partial(_piece_text, self.tokenizer))
        self.stats = EngineStats()
        self._states: dict[str, _SeqState] = {}
        self._pending: list[RequestOutput] = []
        self.last_step_chunks: list[tuple[str, int, int]] = []  # (request_id, start, n) of the last step
        self.consecutive_failed_steps = 0  # steps failed as a whole since the last one that ran
        self.slot_cache: Mapping[int, tuple[int, ...]] = MappingProxyType({})
        #: structured output: compute the step's grammar masks in one batch before the forward
        #: (``grammar_batch``), in a worker thread beside it (``grammar_overlap``); off = each
        #: row's ``mask()`` after the forward, one by one (the way before; same tokens either way)
        self.grammar_batch = True
        self.grammar_overlap = True
        self._said_no_shift = False  # the --cache-reuse warning was logged (a model that cannot shift)
        self._slot_tables: dict[int, list[int]] = {}  # slot id -> parked block ids behind slot_cache
        self._slot_cache_version = self.kv.parked_version

    # -- requests ----------------------------------------------------------------

    def validate(self, request: Request) -> None:
        """Raise InvalidRequestError / ContextSizeExceededError for a request this engine cannot
        run (:func:`~kvserve.engine.request.check_prompt` against ``n_ctx_slot`` and the model's
        vocabulary). Read-only: a request comes admitted (and its default ``n_predict`` capped)
        by the serving layer (:func:`kvserve.serving.admission.admit`); the engine never changes
        its parameters."""
        check_prompt(request.prompt_token_ids, request.params.n_predict, self.n_ctx_slot,
                     self.model_config.n_vocab)

    def add_request(self, request: Request) -> None:
        """Check (:meth:`validate`) and queue an admitted request (raises InvalidRequestError
        subclasses; RuntimeError once the core is closed)."""
        if self.closed:
            raise RuntimeError("the engine is closed")
        self.validate(request)
        if request.request_id in self._states:
            raise InvalidRequestError(f"duplicate request id {request.request_id}")
        # the adapters stay in the model until the request leaves (Scheduler.finish/drop release them)
        lora = self.scheduler.lora if request.lora else None
        if lora is not None:
            lora.hold(request.lora)  # InvalidRequestError: one was unloaded since the request was checked
        try:
            self._add_request(request)
        except BaseException:
            if lora is not None:
                lora.release(request.lora)
            self._states.pop(request.request_id, None)
            raise

    def _add_request(self, request: Request) -> None:
        if request.params.n_cache_reuse > 0 and not self.kv.can_shift and not self._said_no_shift:
            self._said_no_shift = True  # llama-server's line where its cache cannot shift, and why
            log.warning("cache_reuse is not supported by this context, it will be disabled: this model's "
                        "sliding-window layers keep only their window's KV, so a shifted chunk cannot be exact "
                        "(prompts still reuse their cached prefix)")
        if not request.eog_token_ids:
            request.eog_token_ids = frozenset(self.tokenizer.eog_token_ids)
        sampler = SequenceSampler(request.params, self.model_config.n_vocab, request.eog_token_ids,
                                  self.breakers.token_texts, self.breakers)
        self._states[request.request_id] = _SeqState(sampler, IncrementalDetokenizer.for_params(self.tokenizer, request.params))
        if self.spec is not None:
            self.spec.register(request, sampler.is_plain_greedy(0), sampler.speculates_sampled)
        self.scheduler.add(request)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its blocks are freed at once and a final output is queued."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return
        try:
            req.stop_type = "abort"
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            out = self._output(req, [], "", None, finished=True)
        except Exception as e:  # noqa: BLE001 - fails this request only
            out = self.fail_request(req, e, "abort")
        self._pending.append(out)
        self._publish_slots()

    def fail_request(self, req: Request, exc: BaseException, where: str, *, quiet: bool = False) -> RequestOutput:
        """End ``req`` because the engine raised ``exc`` while working on it (``where``: "add",
        "schedule", "execute", "update", "abort"); the other requests go on.

        The request leaves the queues, its blocks are discarded (not parked or kept for
        reuse), the failure is logged once with its traceback (``quiet``: the caller
        logged it), and the returned final output carries ``error`` (the faces answer 500).
        Never raises for a request that already left the engine.
        """
        if not quiet:
            log.error("request %s failed in the engine (%s: %r); the other requests go on",
                      req.request_id, where, exc, exc_info=exc)
        self.scheduler.drop(req)
        self._states.pop(req.request_id, None)
        if self.spec is not None:
            self.spec.forget(req.request_id)
        if self.draft is not None:
            self.draft.forget(req.request_id)
        req.stop_type = "abort"
        req.finish_time = req.finish_time or time.monotonic()
        return RequestOutput(
            request_id=req.request_id, new_token_ids=[], text="", finished=True, stop_type="abort",
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=max(req.num_cached_tokens, 0),
            num_output_tokens=len(req.output_token_ids), arrival_time=req.arrival_time,
            error=f"the engine failed on this request ({type(exc).__name__}); other requests are not affected")

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self.runner is None

    def close(self) -> None:
        """Let go of the model: weights, KV tensors, compiled graphs, the tokenizer, queued
        requests (dropped without outputs). The core serves nothing afterwards
        (:meth:`add_request` raises RuntimeError, :meth:`has_work` is False); counters,
        ``model_info`` and context sizes stay readable. Idempotent.

        Run it on the thread that owns the core (AsyncEngine's engine thread does when it
        stops), never during a step.
        """
        sched = self.scheduler
        sched.waiting.clear()
        sched.running.clear()
        sched.requests.clear()
        sched.detokenize = None
        self._states.clear()
        self._pending.clear()
        if self.runner is not None:
            self.runner.compiled = None
            if hasattr(self.runner, "close"):  # a parallel runner stops its worker processes
                self.runner.close()
        self.runner = self.model = None
        self.breakers = None
        self.tokenizer = None
        self.slot_cache = MappingProxyType({})

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the step ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine iteration: schedule, execute, update. Returns the outputs it produced.

        Never raises for one request's sake: an exception while admitting or updating
        one request fails that request (:meth:`fail_request`); one in scheduling the
        running requests or in the model's forward (not attributable to a request)
        fails every request of the step and counts in ``consecutive_failed_steps``
        (reset by the next step that runs). ``slot_cache`` is up to date when it returns.
        """
        try:
            return self._step()
        finally:
            self._publish_slots()

    def _switch_native(self) -> None:
        """Switch the native decode step on where it is loaded (decode_native.NativeDecode.activate):
        a cached build at the first step, a late one only while no request runs."""
        nats = [getattr(r, "native", None) for r in (self.runner, getattr(self.draft, "runner", None))]
        if not any(n is not None and n.pending for n in nats):
            return
        sch = self.scheduler
        idle = not sch.running and not any(r.output_token_ids for r in sch.waiting)
        for n in nats:
            if n is not None and n.pending:
                n.activate(idle)

    def _step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        self._switch_native()
        if self._spec_native_pending:
            nat = getattr(self.runner, "native", None)
            if nat is None or nat.reason is not None:
                self._spec_native_pending = False
            elif nat.ready:  # verification runs in the native decode step from now on: its costs
                self.spec.base_rows = STEP_BASE_ROWS_NATIVE.get(nat.isa, STEP_BASE_ROWS_NATIVE["avx2"])
                self.spec.chunk_rows = CHUNK_ROWS_NATIVE
                self._spec_native_pending = False
        nat = getattr(self.runner, "native", None)
        # (a cached build's step is on from the first run, which waits for the weights' packing)
        self.scheduler.split_last_token = nat is not None and (nat.ready or (nat.cached and nat.pending))
        try:
            sched = self.scheduler.schedule()
        except Exception as e:  # noqa: BLE001 - see the docstring
            outputs += self._fail_step(list(self.scheduler.running), e, "schedule")
            return outputs
        outputs += [self.fail_request(r, e, "schedule") for r, e in sched.failed]
        self.stats.num_preemptions += len(sched.preempted)
        if not sched.chunks:
            return outputs
        now = time.monotonic()
        for ch in sched.chunks:
            if ch.request.first_scheduled_time is None:
                ch.request.first_scheduled_time = now
        self.last_step_chunks = [(c.request.request_id, c.request.num_computed_tokens, c.num_new_tokens)
                                 for c in sched.chunks]
        masks = self._prefetch_masks(sched) if self.grammar_batch else []
        try:
            samplers = {c.request.request_id: self._states[c.request.request_id].sampler for c in sched.chunks}
            if self.draft is not None:
                self.draft.propose(sched, self.kv, samplers)
            result = self.runner.execute(sched, self.kv, samplers)
            if self.draft is not None:
                self.draft.after_verify(sched, result.verified, self.kv)
        except Exception as e:  # noqa: BLE001 - see the docstring
            outputs += self._fail_step([c.request for c in sched.chunks], e, "execute")
            return outputs
        finally:
            for batch in masks:
                batch.release()
        self.consecutive_failed_steps = 0
        outputs.extend(self._update(sched, result))
        return outputs

    def _prefetch_masks(self, sched: SchedulerOutput) -> list:
        """Start the next-token masks of the step's constrained rows (the chunks that sample) in
        one batch per constraint type that offers ``prefetch_masks`` (``GrammarConstraint``:
        xgrammar's batch matcher, in a worker thread while the forward runs, see
        :mod:`kvserve.structured.batch`); other constraints compute theirs in ``mask()`` as
        before. The masks are the same bits, so no token changes. Returns the batches to
        release after the step; a failure here only means the rows compute their own masks."""
        groups: dict[type, list] = {}
        for ch in sched.chunks:
            g = ch.request.grammar
            if g is not None and ch.completes and not ch.spec_token_ids:
                groups.setdefault(type(g), []).append(g)
        batches = []
        for kind, gs in groups.items():
            hook = getattr(kind, "prefetch_masks", None)
            if hook is None:
                continue
            try:
                b = hook(gs, self.grammar_overlap)
            except Exception as e:  # noqa: BLE001 - mask() computes each row's own mask instead
                log.warning("batched grammar masks failed (%r); computing them one by one", e)
                continue
            if b is not None:
                batches.append(b)
        return batches

    def _fail_step(self, reqs: list[Request], exc: Exception, where: str) -> list[RequestOutput]:
        """A step failed as a whole: fail ``reqs`` (the step's requests), drop queued KV
        copy/shift jobs, log once with the traceback."""
        self.consecutive_failed_steps += 1
        log.error("engine step failed in %s (%r); failing its %d request(s), serving on",
                  where, exc, len(reqs), exc_info=exc)
        self.kv.take_copies()
        self.kv.take_shifts()
        self.kv.take_group_copies()
        return [self.fail_request(req, exc, where, quiet=True) for req in reqs]

    def _update(self, sched: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        now = time.monotonic()
        st = self.stats
        st.n_decode_total += 1
        st.n_busy_slots_total += len(sched.chunks)
        outs = []
        verified = result.verified or [None] * len(sched.chunks)
        for ch, sample, plp, target in zip(sched.chunks, result.samples, result.prompt_logprobs, verified):
            try:
                if ch.spec_token_ids:
                    out = self._update_spec(ch, target, now)
                else:
                    out = self._update_one(ch, sample, plp, now)
            except Exception as e:  # noqa: BLE001 - fails this request only
                out = self.fail_request(ch.request, e, "update")
            if out is not None:
                outs.append(out)
        return outs

    def _update_one(self, ch: ScheduledChunk, sample: SampleResult | None, plp, now: float) -> RequestOutput | None:
        """Apply one chunk's result to its request: record its tokens, count, accept the sample."""
        st = self.stats
        req = ch.request
        start = req.num_computed_tokens
        self.kv.record_tokens(req.request_id, start,
                              [req.token_at(p) for p in range(start, start + ch.num_new_tokens)], req.cache_key)
        req.num_computed_tokens += ch.num_new_tokens
        state = self._states[req.request_id]
        if plp is not None:
            state.prompt_logprobs.append(plp)
        if start < req.num_prompt_tokens and req.num_preemptions == 0:
            st.prompt_tokens_total += min(ch.num_new_tokens, req.num_prompt_tokens - start)
        if sample is None:
            if req.return_progress and req.num_preemptions == 0 and start < req.num_prompt_tokens:
                return self._progress_output(req, now)
            return None
        if isinstance(sample, SampleFailure):  # this row's sampler raised: fail this request only
            raise sample.error
        if req.first_token_time is None:
            req.first_token_time = now
            req.num_cached_tokens = max(req.num_cached_tokens, 0)
            st.prompt_tokens_cached_total += req.num_cached_tokens
            st.prompt_seconds_total += now - (req.first_scheduled_time or now)
        return self._accept(req, state, sample, now)

    @staticmethod
    def _progress_output(req: Request, now: float) -> RequestOutput:
        """A prompt chunk's output for a ``return_progress`` request: no tokens, its progress, and
        the timings so far (the prompt tokens computed and their ms)."""
        cached = max(req.num_cached_tokens, 0)
        elapsed_ms = (now - (req.first_scheduled_time or now)) * 1e3
        timings = Timings(cache_n=cached, prompt_n=max(req.num_computed_tokens - cached, 0), prompt_ms=elapsed_ms)
        return RequestOutput(request_id=req.request_id, new_token_ids=[], text="",
                             num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=cached,
                             arrival_time=req.arrival_time, timings=timings,
                             prompt_progress=PromptProgress(req.num_prompt_tokens, cached, req.num_computed_tokens,
                                                            int(elapsed_ms)))

    def _update_spec(self, ch: ScheduledChunk, target: list[int], now: float) -> RequestOutput:
        """Apply a verification chunk: accept the longest prefix of the draft that matches the
        target's greedy tokens, then the target's next token (the bonus), one token at a time
        through :meth:`_accept`, so that EOS, stop strings, n_predict and the context cut
        exactly where plain decoding cuts (tokens after the cut are dropped). Only the KV of
        kept positions is recorded (indexed); blocks holding only rejected positions are
        freed. One output carries every token of the step."""
        req = ch.request
        state = self._states[req.request_id]
        draft = ch.spec_token_ids
        a = accepted_prefix(draft, target)
        st = self.stats
        st.spec_drafts_total += 1
        st.spec_draft_tokens_total += len(draft)
        st.spec_accepted_tokens_total += a
        if len(st.spec_accepted_per_pos) < a:
            st.spec_accepted_per_pos.extend([0] * (a - len(st.spec_accepted_per_pos)))
        for i in range(a):
            st.spec_accepted_per_pos[i] += 1
        req.num_draft_tokens += len(draft)
        req.num_draft_accepted += a
        self.spec.observe(req.request_id, len(draft), a)
        start = req.num_computed_tokens
        toks: list[int] = []
        text = ""
        out = None
        for i, tok in enumerate(target[: a + 1]):
            pos = start + i
            # the KV at ``pos`` (the previous token) is now part of the sequence
            self.kv.record_tokens(req.request_id, pos, [req.token_at(pos)], req.cache_key)
            req.num_computed_tokens = pos + 1
            out = self._accept(req, state, SampleResult(tok, 0.0, None), now)
            toks += out.new_token_ids
            text += out.text
            if out.finished:
                break
        if not out.finished:
            self.kv.truncate(req.request_id, req.num_computed_tokens)
        out.new_token_ids = toks
        out.text = text
        return out

    def _accept(self, req: Request, state: _SeqState, sample: SampleResult, now: float) -> RequestOutput | None:
        """Apply one sampled token: stop checks, detokenize, build the output event."""
        p = req.params
        if p.n_predict == 0:
            req.stop_type = "limit"
            self._finish(req, RequestStatus.FINISHED_LENGTH)
            return self._output(req, [], state.detok.flush(), None, finished=True)
        tok = sample.token_id
        req.output_token_ids.append(tok)
        self.stats.tokens_predicted_total += 1
        logprobs = [self._token_logprob(sample)] if p.n_probs > 0 else None
        text = ""
        finished = False
        grammar = req.grammar
        if tok in req.eog_token_ids and (not p.ignore_eos or grammar is not None):
            # with a constraint, an EOG token is only sampled where the constrained text may end
            req.stop_type = "eos"
            finished = True
        elif grammar is not None and not self._grammar_accepts(req, grammar, tok):
            req.stop_type = "eos"
            finished = True
        else:
            text, stop = state.detok.add(tok)
            if stop is not None:
                req.stop_type, req.stopping_word = "word", stop
                finished = True
            elif (p.n_predict > 0 and len(req.output_token_ids) >= p.n_predict) or req.num_tokens >= self.n_ctx_slot:
                req.stop_type = "limit"
                finished = True
        if finished:
            if req.stop_type != "word":
                text += state.detok.flush()
            status = RequestStatus.FINISHED_LENGTH if req.stop_type == "limit" else RequestStatus.FINISHED_STOPPED
            self._finish(req, status)
        return self._output(req, [tok], text, logprobs, finished)

    @staticmethod
    def _grammar_accepts(req: Request, grammar, tok: int) -> bool:
        """Advance the request's constraint by ``tok``; False ends the request (stop_type "eos").

        A refused token cannot happen when the mask was applied (it is logged, and the
        token's text is not emitted); a terminated constraint ends generation normally.
        """
        if not grammar.accept_token(tok):
            log.warning("request %s: sampled token %d is not allowed by its output constraint; ending it",
                        req.request_id, tok)
            return False
        return not grammar.is_terminated()

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.finish_time = time.monotonic()
        if self.draft is not None:
            self.draft.settle(req, self.kv)
            self.draft.forget(req.request_id)
        if self.spec is not None:
            self.spec.forget(req.request_id)
            if req.num_draft_tokens or self.draft is not None:
                # blocks past the kept tokens hold only rejected draft positions
                self.kv.truncate(req.request_id, req.num_computed_tokens)
        st = self.stats
        st.n_tokens_max = max(st.n_tokens_max, req.num_tokens)
        st.requests_finished += 1
        if req.first_token_time is not None:
            st.tokens_predicted_seconds_total += req.finish_time - req.first_token_time
        self.scheduler.finish(req, status)

    # -- slots: files and erase -----------------------------------------------------

    def _check_slot(self, slot_id: int) -> str:
        """The parked key of an idle slot; SlotFileError for a bad id or a busy slot."""
        if not 0 <= slot_id < self.n_slots:
            raise SlotFileError(f"Invalid slot ID: {slot_id}")
        if any(r.priority_slot == slot_id for r in self.scheduler.requests.values()):
            raise SlotFileError(f"slot {slot_id} is busy")
        return f"slot:{slot_id}"

    @property
    def model_fingerprint(self) -> bytes:
        """16-byte identity of the loaded model, written into slot files (computed once)."""
        fp = getattr(self, "_fingerprint", None)
        if fp is None:
            step = max(self.model_config.n_vocab // 32, 1)
            rows = self.model.embed(torch.arange(0, self.model_config.n_vocab, step)[:32])
            sample = rows.to(torch.bfloat16).cpu().contiguous().view(torch.uint8).numpy().tobytes()
            fp = self._fingerprint = model_fingerprint(self.model_config, self.model_info, sample)
        return fp

    def slot_tokens(self, slot_id: int) -> list[int]:
        """Tokens whose KV the idle slot holds (empty when nothing is parked)."""
        return self.kv.parked_tokens(f"slot:{slot_id}")

    def slot_file_spec(self) -> dict:
        """What a slot file must match to be restored here: ``read_slot_file``'s keyword arguments."""
        c = self.model_config
        return {"fingerprint": self.model_fingerprint, "kv_dtype": self.config.kv_dtype, "n_layer": c.n_layer,
                "n_head_kv": c.n_head_kv, "head_dim": c.head_dim, "kv_dtype_v": self.config.kv_dtype_v}

    def snapshot_slot(self, slot_id: int) -> tuple[SlotHeader, list[int], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Copy the idle slot's parked tokens and KV rows out of the cache (no file I/O).

        Returns:
            (header, N token ids, per layer (K [rows, H, D], V [rows, H, D]) CPU tensors): the
            arguments of ``write_slot_file``, which the caller runs off the engine thread. A
            sliding-window layer's rows are those its group still holds (positions from the
            group's first held block to N - 1: ``header.layer_first``), every other layer's all N.

        Raises:
            SlotFileError: bad slot id, busy slot.
        """
        key = self._check_slot(slot_id)
        tokens = self.kv.parked_tokens(key)
        n = len(tokens)
        table = self.kv.parked_table(key)
        rows = torch.tensor([self.kv.row_of(table, p) for p in range(n)], dtype=torch.long)
        firsts, group_rows = [], []
        for g in self.kv.groups:  # a sliding group: from its first block still held (released: 0)
            gt = g.parked_table(key)
            first = min(n, next((i for i, b in enumerate(gt) if b), len(gt)) * g.block_size)
            firsts.append(first)
            group_rows.append(torch.tensor([g.row_of(gt, p) for p in range(first, n)], dtype=torch.long))
        layers = self.runner.read_rows(rows, group_rows) if group_rows else self.runner.read_rows(rows)
        c = self.model_config
        layer_group = getattr(self.runner, "layer_group", [-1] * c.n_layer)
        hdr = SlotHeader(self.model_fingerprint, n, self.config.kv_dtype, c.n_layer, c.n_head_kv,
                         c.head_dim, kv_dtype_v=self.config.kv_dtype_v,
                         layer_first=tuple(firsts[g] if g >= 0 else 0 for g in layer_group),
                         meta=self._slot_meta(self.kv.parked_salt(key)))
        return hdr, tokens, layers

    def _slot_meta(self, key: str | None) -> dict:
        """A slot file's metadata for KV parked under cache key ``key``: its ``cache_salt`` and the LoRA
        adapters it was computed under (name, path, scale, weights' fingerprint); {} for plain KV.

        Raises SlotFileError: an adapter of the KV has been unloaded since."""
        salt, lora = split_cache_key(key)
        if salt is None and not lora:
            return {}
        reg = getattr(self.runner, "lora", None)
        adapters = []
        for aid, scale in lora:
            e = reg.by_id(aid) if reg is not None else None
            if e is None:
                raise SlotFileError(f"the slot's KV was computed under LoRA adapter {aid}, which has been unloaded "
                                    "since: it cannot be saved")
            adapters.append({"name": e.name, "path": e.path, "scale": scale,
                             "fingerprint": self._adapter_fingerprint(e)})
        return {"cache_salt": salt, "lora": adapters}

    def _adapter_fingerprint(self, entry) -> str:
        """``adapter_fingerprint`` of a registry entry's adapter, computed once per loaded adapter object
        (its weights never change once loaded) and kept by entry id while that object is loaded, so a
        restore does not hash every loaded adapter again on the engine thread."""
        kept = self._lora_fingerprints.get(entry.id)
        if kept is not None and kept[0] is entry.adapter:
            return kept[1]
        reg = getattr(self.runner, "lora", None)
        live = {e.id for e in reg.entries()} if reg is not None else set()
        for i in [i for i in self._lora_fingerprints if i not in live]:  # unloaded adapters: forget them
            del self._lora_fingerprints[i]
        fp = adapter_fingerprint(entry.adapter)
        self._lora_fingerprints[entry.id] = (entry.adapter, fp)
        return fp

    def _restored_key(self, meta: dict | None) -> str | None:
        """The cache key restored KV is indexed and parked under: the file's ``cache_salt`` and its LoRA
        adapters, each found among this engine's adapters by its weights' fingerprint (its id here).

        Raises SlotFileError: malformed metadata, or an adapter that is not loaded here."""
        if not meta:
            return None
        salt, items = meta.get("cache_salt"), meta.get("lora") or []
        if not (salt is None or isinstance(salt, str)) or not isinstance(items, list) \
                or not all(isinstance(x, dict) for x in items):
            raise SlotFileError("slot file is corrupt: bad cache_salt or lora metadata")
        reg = getattr(self.runner, "lora", None)
        loaded = {self._adapter_fingerprint(e): e for e in reg.entries()} if reg is not None and items else {}
        pairs = []
        for x in items:
            scale, fp, name = x.get("scale"), x.get("fingerprint"), x.get("name")
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not _finite(scale) \
                    or not isinstance(fp, str) or not isinstance(name, str):
                raise SlotFileError("slot file is corrupt: bad lora metadata")
            e = loaded.get(fp)
            if e is None:
                raise SlotFileError(f"slot file's KV was computed under LoRA adapter '{name[:200]}', which is not "
                                    "loaded here: load the same adapter to restore it")
            pairs.append((e.id, float(scale)))
        return cache_key_of(salt, tuple(sorted(pairs)))

    def load_slot(self, slot_id: int, tokens: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]],
                  meta: dict | None = None) -> dict:
        """Make ``tokens`` and their KV rows (as ``read_slot_file`` returns them) the idle slot's
        parked, indexed KV (no file I/O).

        The next request on the slot (or any request, through the prefix index)
        reuses them; at least one prompt token is still evaluated. Restored blocks are indexed under
        the cache key they were computed under (``meta``, the file header's: its ``cache_salt`` and
        LoRA adapters, found here by their weights), so only requests of that salt and those
        adapters reuse them; none: no salt, the base model.

        Returns:
            {"n_restored": tokens, "tokens": the token ids}.

        A layer with fewer rows than tokens holds the last ones (a file saved from sliding-window
        layers, ``SlotHeader.layer_first``): sliding-window layers keep from it (block-aligned)
        what their window still needs; a full-attention layer must have every row.

        Raises:
            SlotFileError: bad slot id, busy slot, too many tokens for the slot's
                context, a token id out of range, no room in the KV pool, a full-attention
                layer without every token's row, a sliding group whose layers start apart, a LoRA
                adapter of the KV that is not loaded here.
        """
        key = self._check_slot(slot_id)
        salt = self._restored_key(meta)
        if len(tokens) >= self.n_ctx_slot:
            raise SlotFileError(f"slot file holds {len(tokens)} tokens, more than the slot's context "
                                f"({self.n_ctx_slot} tokens)")
        bad = next((t for t in tokens if not 0 <= t < self.model_config.n_vocab), None)
        if bad is not None:
            raise SlotFileError(f"slot file is corrupt: token id {bad} is out of range")
        firsts = self._restored_firsts(len(tokens), layers)
        self.kv.release_parked(key)
        rid = f"restore:{key}:{time.monotonic_ns()}"
        try:
            if tokens:
                if not self.kv.restore(rid, tokens, firsts, salt):
                    raise SlotFileError("not enough free KV cache blocks to restore the slot")
                table = self.kv.block_table(rid)
                rows = torch.tensor([self.kv.row_of(table, p) for p in range(len(tokens))], dtype=torch.long)
                if firsts:
                    self._write_group_rows(rid, rows, layers, firsts)
                else:
                    self.runner.write_rows(rows, layers)
                if self.draft is not None:  # slot files hold the target's rows: the draft's are recomputed
                    self.draft.fill(tokens, table)
            self.kv.park(rid, key, salt)
        finally:
            self._publish_slots()
        return {"n_restored": len(tokens), "tokens": tokens}

    def _restored_firsts(self, n: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
        """Per sliding group, the first position (a multiple of the block size) whose rows a
        restore keeps: past the file's first row of the group's layers, and no earlier than the
        blocks a query at n - 1 reads (what :meth:`KVCacheManager.slide` would keep).

        Raises SlotFileError: a full-attention layer without every row, a group's layers that
        start at different rows."""
        have = [n - k.shape[0] for k, _ in layers]
        layer_group = getattr(self.runner, "layer_group", [-1] * len(layers))
        if any(f and g < 0 for f, g in zip(have, layer_group)):
            raise SlotFileError("slot file holds only the last tokens' KV of a layer that attends to every token "
                                "here: restore it into a server with the same sliding-window layers")
        out = []
        for gi, g in enumerate(self.kv.groups):
            mine = {f for f, lg in zip(have, layer_group) if lg == gi}
            if len(mine) != 1:
                raise SlotFileError("slot file is corrupt: the layers of one sliding window start at different rows")
            bs = g.block_size
            out.append(min(max(-(-mine.pop() // bs), max(0, n - g.window) // bs) * bs, n))
        return out

    def _write_group_rows(self, rid: str, rows: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]],
                          firsts: list[int]) -> None:
        """Write a restored sequence's rows: every row of the full layers, a sliding group's from
        its ``firsts`` position on (the file's rows before it are skipped)."""
        n = rows.shape[0]
        group_rows = []
        for gi, (g, first) in enumerate(zip(self.kv.groups, firsts)):
            gt = self.kv.group_table(gi, rid)
            group_rows.append(torch.tensor([g.row_of(gt, p) for p in range(first, n)], dtype=torch.long))
        layer_group = self.runner.layer_group
        cut = [(k[k.shape[0] - (n - firsts[g]):], v[v.shape[0] - (n - firsts[g]):]) if g >= 0 else (k, v)
               for (k, v), g in zip(layers, layer_group)]
        self.runner.write_rows(rows, cut, group_rows)

    def save_slot(self, slot_id: int, path: str) -> dict:
        """Write the slot's parked tokens and KV rows to ``path`` (format: kvserve.engine.slot_file),
        all on the calling thread (the server runs :meth:`snapshot_slot` on the engine thread
        and the file write in a worker thread).

        Returns:
            {"n_saved": tokens, "n_written": bytes}.

        Raises:
            SlotFileError: bad slot id, busy slot, write failure, not a regular file.
        """
        hdr, tokens, layers = self.snapshot_slot(slot_id)
        return {"n_saved": len(tokens), "n_written": write_slot_file(path, hdr, tokens, layers)}

    def restore_slot(self, slot_id: int, path: str) -> dict:
        """Read a slot file and load it into the slot (:meth:`load_slot`), on the calling thread.

        Returns:
            {"n_restored": tokens, "n_read": bytes, "tokens": the token ids}.

        Raises:
            FileNotFoundError: no such file.
            SlotFileError: see :meth:`load_slot` and ``read_slot_file``.
        """
        self._check_slot(slot_id)
        hdr, tokens, layers, n_read = read_slot_file(path, **self.slot_file_spec())
        return {**self.load_slot(slot_id, tokens, layers, hdr.meta), "n_read": n_read}

    def erase_slot(self, slot_id: int) -> dict:
        """Drop the slot's parked KV, from the host tier and the prefix index too (llama-server's
        erase: the next request reuses none of it). Returns {"n_erased": tokens it held}.
        SlotFileError: busy/bad id."""
        key = self._check_slot(slot_id)
        n = len(self.kv.parked_tokens(key))
        self.kv.drop_parked(key)
        self._publish_slots()
        return {"n_erased": n}

    def _publish_slots(self) -> None:
        """Replace ``slot_cache`` when the parked tables changed (a sequence parked, a slot's
        blocks released, erased or evicted by the pool). A slot whose block ids did not
        change keeps its tuple (parked blocks never change their tokens), so the cost is
        the tokens of the slots that changed."""
        kv = self.kv
        if kv.parked_version == self._slot_cache_version:
            return
        tables: dict[int, list[int]] = {}
        cache: dict[int, tuple[int, ...]] = {}
        for key in kv.parked_keys():
            if not key.startswith("slot:"):
                continue
            sid = int(key[5:])
            table = kv.parked_table(key)
            if not table:
                continue
            prev = self.slot_cache.get(sid)
            toks = prev if prev is not None and self._slot_tables.get(sid) == table else tuple(kv.parked_tokens(key))
            if toks:
                tables[sid], cache[sid] = table, toks
        self._slot_tables = tables
        self.slot_cache = MappingProxyType(cache)
        self._slot_cache_version = kv.parked_version

    # -- outputs -----------------------------------------------------------------

    def _excerpt(self, ids: list[int]) -> str:
        """Text of a few token ids for cache_miss excerpts (invalid UTF-8 replaced)."""
        return b"".join(self.tokenizer.token_bytes(t) for t in ids).decode("utf-8", errors="replace")

    def _piece_text(self, tok: int) -> str:
        return _piece_text(self.tokenizer, tok)

    def _token_logprob(self, s: SampleResult) -> TokenLogprob:
        top = [TopLogprob(i, self._piece_text(i), list(self.tokenizer.token_bytes(i)), lp) for i, lp in (s.top or [])]
        return TokenLogprob(s.token_id, self._piece_text(s.token_id), list(self.tokenizer.token_bytes(s.token_id)),
                            s.logprob, top)

    def _timings(self, req: Request) -> Timings:
        cached = max(req.num_cached_tokens, 0)
        t = Timings(cache_n=cached, prompt_n=req.num_prompt_tokens - cached, predicted_n=len(req.output_token_ids),
                    cache_miss=req.cache_miss, draft_n=req.num_draft_tokens,
                    draft_n_accepted=req.num_draft_accepted)
        if req.first_scheduled_time is not None and req.first_token_time is not None:
            t.prompt_ms = (req.first_token_time - req.first_scheduled_time) * 1e3
            end = req.finish_time or time.monotonic()
            t.predicted_ms = (end - req.first_token_time) * 1e3
        return t

    def _output(self, req: Request, toks: list[int], text: str, logprobs, finished: bool) -> RequestOutput:
        state = self._states.get(req.request_id)
        plp = None
        if state is not None and req.params.prompt_logprobs is not None and not state.sent_prompt_logprobs \
                and (toks or finished):
            plp = self._prompt_logprobs(req, state)
            state.sent_prompt_logprobs = True
        out = RequestOutput(
            request_id=req.request_id,
            new_token_ids=toks,
            text=text,
            logprobs=logprobs,
            prompt_logprobs=plp,
            finished=finished,
            stop_type=req.stop_type if finished else "none",
            stopping_word=req.stopping_word if finished else "",
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_output_tokens=len(req.output_token_ids),
            timings=self._timings(req),
            truncated=finished and req.stop_type == "limit" and req.num_tokens >= self.n_ctx_slot,
            arrival_time=req.arrival_time,
        )
        if finished:
            self._states.pop(req.request_id, None)
        return out

    def _prompt_logprobs(self, req: Request, state: _SeqState) -> list[TokenLogprob | None]:
        """First prompt token has no logprob (None), then one entry per prompt token."""
        res: list[TokenLogprob | None] = [None]
        for lp, top_ids, top_lps in state.prompt_logprobs:
            base = len(res)
            for j in range(lp.shape[0]):
                tok = req.prompt_token_ids[base + j]
                top = [TopLogprob(int(i), self._piece_text(int(i)), list(self.tokenizer.token_bytes(int(i))), float(v))
                       for i, v in zip(top_ids[j].tolist(), top_lps[j].tolist())]
                res.append(TokenLogprob(tok, self._piece_text(tok), list(self.tokenizer.token_bytes(tok)),
                                        float(lp[j]), top))
        return res


def _piece_text(tokenizer, tok: int) -> str:
    """The text of one token's piece (invalid UTF-8 replaced)."""
    return tokenizer.token_bytes(tok).decode("utf-8", errors="replace")


def create_engine_core(model: str, config: EngineConfig | None = None) -> EngineCore:
    """Load ``model`` (a .gguf path, an HF directory or a cached name) and build an EngineCore."""
    from kvserve.models.build import load_files
    from kvserve.store import resolve_model

    path = resolve_model(model, pull_missing=True)
    return EngineCore(load_files(path), config or EngineConfig())


def _finite(x: int | float) -> bool:
    """True for a finite number a float can hold (an int past float's range is not: no OverflowError)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False
