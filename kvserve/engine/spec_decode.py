"""Speculative decoding by prompt lookup (vLLM's ``ngram`` method, llama-server's
``--spec-type ngram-simple``): propose the tokens that followed the most recent earlier
occurrence of the sequence's last n-gram, and let the target model verify them in one step.

Two pieces:

* :class:`NgramIndex` (per sequence): an index from each n-gram (n in ``[n_min, n_max]``)
  to the position right after its most recent occurrence, updated incrementally as tokens
  are appended (O(n_max - n_min + 1) dict updates per token; lookups do not scan the
  sequence, so a 64k-token context costs the same per step as a short one). Memory: one
  entry per distinct n-gram and n, at most ``len(tokens) * (n_max - n_min + 1)``.
* :class:`SpecDecoder` (per engine): the policy. Which requests may speculate (greedy ones
  whose next token is the plain argmax of the logits: no grammar, logprobs, penalties, DRY,
  logit_bias), how many tokens each may propose (``num_speculative_tokens``, per request
  ``speculative.n_max``/``n_min``), and the per-sequence indexes.

Verification (:mod:`kvserve.engine.core`): the proposal of K tokens runs as K+1 positions of
the sequence in one forward step; the longest prefix of the proposal agreeing with the
target's own greedy choice at each position is accepted, plus the target's next token (the
"bonus" token). Greedy output is therefore the same token sequence as without speculation.

The draft-length policy (batching and speculation together, issue #17 item 3)
----------------------------------------------------------------------------------

A draft token costs one more row of the step; it pays only when it is likely enough to be
accepted for what a row costs in that step. The policy decides per step and per sequence how
many of the proposed tokens to verify (the proposal is cut, never changed, so greedy output
stays token-identical whatever it decides):

* **Cost model**: a step of R rows costs ``base_rows + R`` row-units: a fixed part (reading
  the weights, the step's host work) worth ``base_rows`` rows, then one unit a row; a
  verification chunk costs ``chunk_rows`` more (its cached rows gathered, each position
  attended on its own). On the CPU :data:`STEP_BASE_ROWS_CPU` (8) and :data:`CHUNK_ROWS_CPU`
  (1), from the agent-edit workload on the 2-core machine (``benchmarks/agent_edit.py``, SmolLM2
  Q4_1): at one stream a verification step of ~15 rows took ~2.5 times a 1-row decode step
  (the int4 kernels read the weights once for all rows), and at 16 streams the chunk's own cost
  could not be told from the machine's noise (verifying every proposal: 0.91-1.14 times plain
  over 4 rounds). Once the native decode step (:mod:`kvserve.models.decode_native`) runs the
  engine's decode steps, verification chunks run in it as decode rows and the constants become
  :data:`STEP_BASE_ROWS_NATIVE` (5.0 on the AVX512 build, 2.0 on the AVX2 one) and
  :data:`CHUNK_ROWS_NATIVE` (0): its kernels' cost grows with every row (a 16-row step ~3.2 times a
  1-row one on the AVX512 build, ~7.5 on the Zen 3's AVX2 one), so drafts must be likelier to pay. On a GPU :data:`STEP_BASE_ROWS_GPU` (64) and :data:`CHUNK_ROWS_GPU` (8):
  guesses, not measured yet.
* **Hit estimate** per sequence: ``alpha = hits / (hits + misses)`` over its verifications (a
  hit accepted at least one draft token, a miss none), each older one weighted by
  :data:`HISTORY_DECAY` (0.5) per newer one, from a prior of :data:`PRIOR_HITS` hits and
  :data:`PRIOR_MISSES` miss (alpha 0.8). Prompt lookup's drafts are right or wrong as a copy:
  once the first token is accepted each next one is taken to be with the sequence's run estimate
  (:data:`RUN_CONTINUES`, 0.95, at first; then from its verifications, see :data:`RUN_PRIOR_CONT`),
  so draft token i is accepted with probability ``alpha * run ** (i - 1)``. (A
  geometric ``alpha ** i`` fitted to all tokens cut one-stream drafts to ~5 tokens and lost a
  fifth of the speed-up there: copies run long.)
* **Rule** (:func:`draft_length`): the scheduler offers each decode row its proposal in chunk
  order (``begin_step`` gives the step's rows before drafts, B). The policy keeps the step's
  expected tokens ``B + G`` and its row-units ``base_rows + B + D`` (G: expected accepted
  draft tokens so far, D: row-units of the drafts so far) and verifies the k tokens of the
  proposal (0..K) that maximize the step's expected tokens per row-unit; k = 0, a plain
  decode row, when no draft raises it. On the CPU, for alpha 0.8 (a fresh sequence): 15 tokens
  at one stream, 12 at 4, 8 at 8, 6 at 12 and none at 16; for alpha 0.4: 13 at one stream,
  none from 4 on. The fuller the batch (the more compute-bound the step), the more a draft
  must be worth. At 16 streams the CPU's row cap (``small_batch_rows``, 16, the rows the int4
  decode kernels take: the scheduler's ``spec_max_rows``) leaves no room anyway.
* **Misses and probes**: verifications that accept nothing bring alpha down (from the prior:
  0.57, 0.36, 0.21, 0.11, 0.06) until no draft pays, K = 0 (on the CPU at one stream below
  alpha ~0.14, four misses in a row from the prior; at 4 streams below ~0.45). After
  :data:`PROBE_TOKENS` (16) tokens without a verification the estimate goes back to the prior,
  so the sequence probes again in the next step that can afford it.
* Per-request limits (``speculative.n_max``/``n_min``) and the step's row room still cap the
  result; a cut draft shorter than ``n_min`` is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

#: kvserve's defaults when neither --speculative-config nor the llama-server flags set them
DEFAULT_NUM_SPECULATIVE_TOKENS = 16
DEFAULT_PROMPT_LOOKUP_MAX = 4
DEFAULT_PROMPT_LOOKUP_MIN = 2
#: longest n-gram looked up (``prompt_lookup_max``, ``--spec-ngram-size-n``; larger values are
#: refused at start-up). vLLM checks only ``>= 1``; kvserve bounds it because the index keeps
#: one dict per n in ``[min, max]`` and a tuple of n tokens per position and n: at 16 (min 1) a
#: token costs ~2 KB of index and 136 tuple elements of work (at 100000 an 800-token prompt
#: took 6.1 s and 550 MiB)
MAX_PROMPT_LOOKUP = 16
#: most draft tokens per step (``num_speculative_tokens``, ``--draft-max``; larger values are
#: refused). What a step verifies is capped lower anyway: by the step's rows
#: (``min(max_num_batched_tokens, spec_max_rows)`` minus its other rows: 15 draft tokens at one
#: stream on the CPU, whose ``small_batch_rows`` is 16)
MAX_NUM_SPECULATIVE_TOKENS = 1024
#: tokens indexed per sequence and step at most (a long prompt is indexed over several steps,
#: about 20 ms each on a 2-core machine, instead of stalling one step for the whole of it;
#: the sequence speculates once its index has caught up)
INDEX_TOKENS_PER_STEP = 8192

#: a step's fixed cost in rows (see the module docstring's cost model): CPU, GPU
STEP_BASE_ROWS_CPU = 8.0
STEP_BASE_ROWS_GPU = 64.0
#: a step's fixed cost in rows when the native decode step runs it (kvserve.models.decode_native),
#: by the build's instruction set: its kernels' cost grows with every row. SmolLM2 Q4_1, 2 threads,
#: 800 cached tokens, one step of B = 1, 2, 4, 6, 8, 12, 16 rows of one sequence (a verification
#: chunk): AVX512 group kernel on the 2-core Xeon, 5.8, 6.9, 9.3, 12.1, 14.7, 19.5, 25.3 ms, about
#: (3.5 + B) / 4.5 times the 1-row step; after the transposed keys and 16-row sums (2026-12-05,
#: ``benchmarks/step_cost.py``) 8.0, 8.8, 11.1, 14.9, 16.5, 23.4, 30.5 ms: a line through B <= 8
#: gives 5.1 (through 1-16 3.4, the cost growing faster past 8 rows), and a step's host work
#: (~1.5 ms) adds to its fixed part: 5.0 (agent_edit in process, median of six alternating
#: rounds: 2.67x plain against 2.54x at 3.5; the same tokens; the Zen 4's figures of 2026-12-02
#: fit ~2.5, not re-measured); after the tile layout (2026-12-05) 6.95, 7.73, 10.06, 11.78,
#: 12.87, 16.52, 20.14 ms, a line through B <= 8 (and 1-16) giving 6.9 (7.05); with the weights
#: prefetched 4 KiB ahead 6.03, 6.28, 8.04, 10.24, 11.87, 15.39, 19.39 ms: 5.1 (5.0), so 5.0 again
#: (agent_edit in alternating runs 3.02x and 2.85x at 5.0, 2.95x at 7.0: within noise); the AVX2 build on the same machine 6.0, 7.6, 11.0, 15.0,
#: 18.1, -, 33.2 ms (about 2.3); the AVX2 build on the 2-core Zen 3 before attention read a
#: chunk's keys once, 9.4, 12.8, 21.3, -, 36.5, 54.3, 70.8 ms (1.5). A verification chunk then
#: costs nothing beyond its rows (they are decode rows)
STEP_BASE_ROWS_NATIVE = {"avx512": 5.0, "avx2": 2.0}
CHUNK_ROWS_NATIVE = 0.0
#: what a verification chunk costs beyond its draft rows, in rows: CPU, GPU (the GPU's figures
#: are guesses: not measured yet)
CHUNK_ROWS_CPU = 1.0
CHUNK_ROWS_GPU = 8.0
#: prior of a sequence's hit estimate: verifications that accepted something, that accepted nothing
PRIOR_HITS = 4.0
PRIOR_MISSES = 1.0
#: weight of the estimate's history per newer verification
HISTORY_DECAY = 0.5
#: once a draft's first token is right, the chance that each next one is (a copy goes on)
RUN_CONTINUES = 0.95
#: the per-sequence estimate of that chance (_Seq.run): prior continuations and stops worth
#: RUN_CONTINUES, then each verification's continuations (tokens accepted after its first) and
#: stop (a rejection after at least one accepted token), the history (the prior included) weighted
#: by RUN_DECAY per newer verification, so the estimate follows the sequence (a copy whose drafts
#: stop after 2 tokens comes down to ~0.5, one whose whole drafts keep passing goes up to ~1)
RUN_PRIOR_CONT = 19.0
RUN_PRIOR_STOPS = 1.0
RUN_DECAY = 0.8
#: tokens without a verification after which a sequence's estimate goes back to the prior
PROBE_TOKENS = 16


class NgramIndex:
    """Most recent earlier occurrence of each n-gram of one growing token sequence.

    Args:
        n_min, n_max: n-gram lengths looked up, ``1 <= n_min <= n_max`` (tokens).

    ``extend(tokens)`` appends tokens; ``propose(k)`` returns up to ``k`` tokens that
    followed the most recent earlier occurrence of the sequence's last n-gram, trying
    n = n_max first, then shorter ones down to n_min; [] when none occurred before.

    The occurrence ending at the very end of the sequence is never its own match: an
    n-gram is entered into the index only once a token follows it.
    """

    __slots__ = ("_indexed", "_last", "n_max", "n_min", "tokens")

    def __init__(self, n_min: int, n_max: int):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got min {n_min}, max {n_max}")
        self.n_min = n_min
        self.n_max = n_max
        self.tokens: list[int] = []
        #: per n: n-gram -> position right after its most recent occurrence that has a successor
        self._last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self._indexed = 0  # n-grams ending before this position (exclusive end) are indexed

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` and index every n-gram that now has a following token."""
        toks = self.tokens
        toks.extend(tokens)
        end = len(toks) - 1  # n-grams ending at positions < end have a successor
        last = self._last
        for e in range(self._indexed, end):
            # the n-grams ending at position e (inclusive) are followed by position e + 1
            for n, table in last.items():
                if e + 1 >= n:
                    table[tuple(toks[e + 1 - n: e + 1])] = e + 1
        self._indexed = max(self._indexed, end)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens following the most recent earlier match of the last n-gram."""
        toks = self.tokens
        L = len(toks)
        if k <= 0:
            return []
        for n in range(self.n_max, self.n_min - 1, -1):
            if L < n:
                continue
            pos = self._last[n].get(tuple(toks[L - n:]))
            if pos is not None:
                return toks[pos: min(pos + k, L)]
        return []


@dataclass(slots=True)
class SpecConfig:
    """Speculative decoding settings of one engine.

    Attributes:
        method: "ngram" (prompt lookup), "draft_model" (a draft model: :mod:`kvserve.engine.draft`)
            or None (off).
        num_speculative_tokens: most tokens proposed per sequence and step (K; llama-server
            ``--draft-max``, vLLM ``num_speculative_tokens``).
        min_tokens: a proposal shorter than this is dropped (llama-server ``--draft-min``).
        prompt_lookup_max, prompt_lookup_min: n-gram lengths looked up (vLLM's names).
        draft_model: the draft model for method "draft_model": a GGUF path, an HF directory or
            a store name (as ``-m`` resolves it; llama-server ``-md``, vLLM ``"model"``).
        draft_p_min: a draft model stops drafting for a sequence when its top token's
            probability falls below this (llama-server ``--draft-p-min``; its default 0.0 in
            the llama.cpp this project compares with: never stop early).
        sampled: sampling requests speculate too, verified by the rejection rule
            (:func:`speculative_accept`); False: only greedy ones (as before it existed).
    """

    method: str | None = None
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    min_tokens: int = 0
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    draft_model: str | None = None
    draft_p_min: float = 0.0
    sampled: bool = True

    def __post_init__(self) -> None:
        if self.method not in (None, "ngram", "draft_model"):
            raise ValueError(f"unsupported speculative method {self.method!r} (kvserve has 'ngram': prompt "
                             "lookup, and 'draft_model')")
        if self.method == "draft_model" and not self.draft_model:
            raise ValueError("speculative method 'draft_model' needs a draft model (-md / \"model\")")
        if not 0.0 <= self.draft_p_min <= 1.0:
            raise ValueError(f"the draft's minimum probability must be in [0, 1], got {self.draft_p_min}")
        if not 0 <= self.num_speculative_tokens <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [0, {MAX_NUM_SPECULATIVE_TOKENS}], got "
                             f"{self.num_speculative_tokens}")
        if self.min_tokens < 0:
            raise ValueError("the minimum draft size must be >= 0")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) and prompt_lookup_max "
                             f"({self.prompt_lookup_max}) must satisfy 1 <= min <= max")
        if self.prompt_lookup_max > MAX_PROMPT_LOOKUP:
            raise ValueError(f"prompt_lookup_max must be at most {MAX_PROMPT_LOOKUP}, got {self.prompt_lookup_max}")

    @property
    def enabled(self) -> bool:
        return self.method is not None and self.num_speculative_tokens > 0


@dataclass(slots=True)
class _Seq:
    index: NgramIndex
    n_max: int
    n_min: int
    fed: int = 0  # tokens of the request already in the index
    hits: float = PRIOR_HITS  # decayed verifications that accepted at least one token
    misses: float = PRIOR_MISSES  # decayed verifications that accepted none
    verified_at: int = 0  # the sequence's length at its last verification (or probe reset)
    cont: float = RUN_PRIOR_CONT  # decayed tokens accepted after a verification's first (and the prior)
    stops: float = RUN_PRIOR_STOPS  # decayed verifications rejecting a token after accepting one

    @property
    def alpha(self) -> float:
        return self.hits / (self.hits + self.misses)

    @property
    def run(self) -> float:
        """The chance that a draft token is accepted once the one before it was."""
        total = self.cont + self.stops
        return self.cont / total if total > 1e-9 else RUN_CONTINUES

    def reset(self) -> None:
        """Back to the priors (a probe after PROBE_TOKENS tokens without a verification)."""
        self.hits, self.misses = PRIOR_HITS, PRIOR_MISSES
        self.cont, self.stops = RUN_PRIOR_CONT, RUN_PRIOR_STOPS


def draft_length(alpha: float, k_max: int, rows: int, base_rows: float, gain: float = 0.0,
                 drafted: float = 0.0, chunk_rows: float = 0.0, run: float = RUN_CONTINUES,
                 token_rows: float = 0.0) -> int:
    """How many draft tokens (at most ``k_max``) one sequence verifies: the k that maximizes the
    step's expected tokens per row-unit, 0 when no k raises it.

    Args:
        alpha: the sequence's hit estimate: the chance that a draft's first token is accepted.
        k_max: tokens proposed (after the per-request and row caps).
        rows: the step's rows before drafts (B).
        base_rows: the step's fixed cost in rows.
        gain, drafted: expected accepted tokens and row-units of the drafts already in the step.
        token_rows: what producing each draft token costs beyond its row (a draft model's step,
            in row-units; 0 for prompt lookup).
        chunk_rows: what turning a decode row into a verification chunk costs beyond its
            draft rows, in rows (see the module docstring).
        run: the chance that each further token is accepted once the previous one was; token i
            is accepted with probability ``alpha * run ** (i - 1)``.

    Returns:
        argmax over k in 0..k_max of ``(rows + gain + sum_{i<=k} alpha * run**(i-1)) /
        (base_rows + rows + drafted + k * (1 + token_rows) + (chunk_rows if k else 0))`` (the smallest such k on
        ties).
    """
    best_k = 0
    best = (rows + gain) / (base_rows + rows + drafted)
    g = rows + gain
    p = alpha
    for k in range(1, k_max + 1):
        g += p
        r = g / (base_rows + rows + drafted + k * (1.0 + token_rows) + chunk_rows)
        if r > best:
            best_k, best = k, r
        p *= run
    return best_k


@dataclass
class SpecDecoder:
    """The speculation policy of one engine (engine thread only).

    ``register`` a request when it is added (with whether its sampler picks the plain
    argmax), ``propose`` before each step, ``forget`` when it finishes. The indexes are
    built lazily from a request's first proposal on, at most ``INDEX_TOKENS_PER_STEP``
    tokens per step, and kept across preemption (the token sequence does not change).
    """

    config: SpecConfig
    #: a step's fixed cost in rows (STEP_BASE_ROWS_CPU / _GPU; EngineCore sets it per device)
    base_rows: float = STEP_BASE_ROWS_CPU
    #: a verification chunk's cost beyond its draft rows (CHUNK_ROWS_CPU / _GPU)
    chunk_rows: float = CHUNK_ROWS_CPU
    #: the draft-length policy on (False: every proposal verified whole, as before it existed)
    adaptive: bool = True
    #: draft model: one draft step's cost as a fraction of a one-row target step (the ratio of the
    #: weights a decode step reads, DraftModel.step_params; EngineCore sets it): each drafted token is charged ``draft_cost * (base_rows
    #: + 1)`` row-units more, so a draft as large as the target never pays (0: prompt lookup)
    draft_cost: float = 0.0
    _seqs: dict[str, _Seq] = field(default_factory=dict)
    # the step being scheduled: rows before drafts, expected accepted draft tokens, draft rows
    _rows: int = 1
    _gain: float = 0.0
    _drafted: float = 0.0

    def begin_step(self, rows: int) -> None:
        """A step's drafting starts: ``rows`` = its rows before drafts (the scheduler calls it
        before offering the step's decode rows their proposals)."""
        self._rows = max(int(rows), 1)
        self._gain = 0.0
        self._drafted = 0.0

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verification of ``proposed`` draft tokens accepted the first ``accepted``: update the
        sequence's hit estimate (a hit when ``accepted >= 1``, else a miss)."""
        s = self._seqs.get(request_id)
        if s is None or proposed <= 0:
            return
        s.hits = HISTORY_DECAY * s.hits + (1.0 if accepted > 0 else 0.0)
        s.misses = HISTORY_DECAY * s.misses + (0.0 if accepted > 0 else 1.0)
        if accepted > 0:
            s.cont = RUN_DECAY * s.cont + (accepted - 1)
            s.stops = RUN_DECAY * s.stops + (1.0 if accepted < proposed else 0.0)

    def alpha(self, request_id: str) -> float | None:
        """The sequence's hit estimate (None: it does not speculate)."""
        s = self._seqs.get(request_id)
        return None if s is None else s.alpha

    def register(self, request, plain_greedy: bool, sampled: bool = False) -> None:
        """Note a new request. ``plain_greedy``: its every next token is the argmax of the raw
        logits (see ``SequenceSampler.is_plain_greedy``); ``sampled``: it samples with a chain
        the rejection rule can verify (``SequenceSampler.speculates_sampled``; only with
        ``config.sampled``). Per-request ``spec_n_max`` (None: the engine's K; 0 disables)
        lowers K, never raises it; ``spec_n_min`` raises the minimum draft size. Requests
        with a grammar, logprobs or prompt logprobs never speculate."""
        c = self.config
        p = request.params
        n_max = c.num_speculative_tokens if p.spec_n_max is None else min(p.spec_n_max, c.num_speculative_tokens)
        n_min = max(c.min_tokens, p.spec_n_min)
        eligible = (c.enabled and (plain_greedy or (sampled and c.sampled)) and request.grammar is None
                    and n_max > 0 and p.n_probs == 0 and p.prompt_logprobs is None)
        if eligible:
            self._seqs[request.request_id] = _Seq(NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max), n_max,
                                                  n_min)

    @property
    def uses_draft_model(self) -> bool:
        """True for method "draft_model": :meth:`plan` gives draft lengths, the draft model
        (:class:`kvserve.engine.draft.DraftModel`) the tokens."""
        return self.config.method == "draft_model"

    def plan(self, request, max_tokens: int) -> int:
        """Draft model: how many tokens ``request`` drafts this step (0: none): ``min(K,
        max_tokens)`` cut by the draft-length policy as for prompt lookup (the whole K
        offered, alpha from the sequence's verifications), and dropped below ``n_min``."""
        s = self._seqs.get(request.request_id)
        if s is None:
            return 0
        k = min(s.n_max, max_tokens)
        if k <= 0 or k < s.n_min:
            return 0
        if self.adaptive:
            n = request.num_tokens
            if n - s.verified_at >= PROBE_TOKENS and s.alpha < PRIOR_HITS / (PRIOR_HITS + PRIOR_MISSES):
                s.reset()
                s.verified_at = n
            alpha = s.alpha
            tr = self.draft_cost * (self.base_rows + 1.0)  # a draft model step per drafted token
            run = s.run
            k = draft_length(alpha, k, self._rows, self.base_rows, self._gain, self._drafted, self.chunk_rows,
                             run=run, token_rows=tr)
            if k < max(s.n_min, 1):
                return 0
            p = alpha
            for _ in range(k):
                self._gain += p
                p *= run
            self._drafted += k * (1.0 + tr) + self.chunk_rows
            s.verified_at = n
        return k

    def forget(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)

    def propose(self, request, max_tokens: int) -> list[int]:
        """Draft tokens for ``request``'s next step: at most ``min(K, max_tokens)``; [] when it
        may not speculate or nothing matched (or the match is shorter than the minimum)."""
        s = self._seqs.get(request.request_id)
        if s is None:
            return []
        k = min(s.n_max, max_tokens)
        if k <= 0 or k < s.n_min:
            return []
        n = request.num_tokens
        if s.fed < n:
            upto = min(n, s.fed + INDEX_TOKENS_PER_STEP)
            s.index.extend([request.token_at(i) for i in range(s.fed, upto)])
            s.fed = upto
            if upto < n:
                return []
        draft = s.index.propose(k)
        if len(draft) < max(s.n_min, 1):
            return []
        if self.adaptive:
            if n - s.verified_at >= PROBE_TOKENS and s.alpha < PRIOR_HITS / (PRIOR_HITS + PRIOR_MISSES):
                s.reset()  # probe again
                s.verified_at = n
            alpha = s.alpha
            run = s.run
            k = draft_length(alpha, len(draft), self._rows, self.base_rows, self._gain, self._drafted,
                             self.chunk_rows, run=run)
            if k < max(s.n_min, 1):
                return []
            draft = draft[:k]
            p = alpha
            for _ in range(k):
                self._gain += p
                p *= run
            self._drafted += k + self.chunk_rows
            s.verified_at = n
        return draft


def accepted_prefix(draft: Sequence[int], target: Sequence[int]) -> int:
    """Length of the longest prefix of ``draft`` equal to ``target`` (the target model's greedy
    choice at each verified position; ``len(target) == len(draft) + 1``)."""
    a = 0
    for d, t in zip(draft, target):
        if d != t:
            break
        a += 1
    return a


def draw(probs, u: float) -> int:
    """Inverse-CDF draw from ``probs`` (float [V], not necessarily normalized, >= 0) with a
    uniform ``u`` in [0, 1): the first index whose running sum exceeds ``u * total``, never a
    zero-probability index."""
    cum = torch.cumsum(probs.to(torch.float64), dim=0)
    pos = int(torch.searchsorted(cum, cum[-1:] * u, right=True).clamp_(max=cum.shape[0] - 1).item())
    if float(probs[pos]) <= 0.0:  # u * total rounded up to the total: the last index with mass
        pos = int(torch.nonzero(probs > 0).flatten()[-1].item())
    return pos


def speculative_accept(p_rows, draft: Sequence[int], q_rows, rng) -> list[int]:
    """The standard rejection rule of speculative sampling (Leviathan et al. 2023, Chen et al.
    2023; vLLM's rejection sampler): the output tokens of one verification, whose
    distribution is exactly the target's sampling distribution at every position.

    Args:
        p_rows: float32 [k + 1, V], the target's distribution after the request's whole
            sampler chain at each verified position (``SequenceSampler.probs``).
        draft: the k draft tokens.
        q_rows: float32 [k, V], the draft model's distribution each draft token was drawn
            from; None for prompt lookup (a point mass on each draft token: q(x) = 1).
        rng: the request's torch.Generator (CPU); one uniform per accept test, one per draw,
            in order, so a fixed seed gives the same tokens.

    Returns:
        the accepted prefix of ``draft`` and one more token: on the first rejection (draft
        token x at position i accepted with probability min(1, p_i(x) / q_i(x))) a token
        drawn from norm(max(0, p_i - q_i)); after k acceptances the bonus token drawn from
        p_k. The last token never equals the rejected draft token, so the accepted count is
        ``accepted_prefix(draft, result)``.
    """
    out: list[int] = []
    for i, x in enumerate(draft):
        p = p_rows[i]
        px = float(p[x])
        qx = 1.0 if q_rows is None else float(q_rows[i][x])
        u = float(torch.rand((), generator=rng, dtype=torch.float64))
        if px > 0.0 and u * qx < px:
            out.append(int(x))
            continue
        if q_rows is None:
            res = p.clone()
            res[x] = 0.0
        else:
            res = (p - q_rows[i].to(p.dtype)).clamp_(min=0.0)
            res[x] = 0.0  # p(x) < q(x) here: exactly zero, never a rounding remainder
        if not bool((res > 0).any()):
            # p - q has no positive part left (p and q equal up to rounding): p without x,
            # or x itself when p has no other token
            res = p.clone()
            res[x] = 0.0
            if not bool((res > 0).any()):
                out.append(int(x))
                return out
        out.append(draw(res, float(torch.rand((), generator=rng, dtype=torch.float64))))
        return out
    out.append(draw(p_rows[len(draft)], float(torch.rand((), generator=rng, dtype=torch.float64))))
    return out
