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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

#: kvserve's defaults when neither --speculative-config nor the llama-server flags set them
DEFAULT_NUM_SPECULATIVE_TOKENS = 16
DEFAULT_PROMPT_LOOKUP_MAX = 4
DEFAULT_PROMPT_LOOKUP_MIN = 2
#: tokens indexed per sequence and step at most (a long prompt is indexed over several steps,
#: about 20 ms each on a 2-core machine, instead of stalling one step for the whole of it;
#: the sequence speculates once its index has caught up)
INDEX_TOKENS_PER_STEP = 8192


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
        method: "ngram" (prompt lookup) or None (off).
        num_speculative_tokens: most tokens proposed per sequence and step (K; llama-server
            ``--draft-max``, vLLM ``num_speculative_tokens``).
        min_tokens: a proposal shorter than this is dropped (llama-server ``--draft-min``).
        prompt_lookup_max, prompt_lookup_min: n-gram lengths looked up (vLLM's names).
    """

    method: str | None = None
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    min_tokens: int = 0
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN

    def __post_init__(self) -> None:
        if self.method not in (None, "ngram"):
            raise ValueError(f"unsupported speculative method {self.method!r} (only 'ngram': prompt lookup)")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        if self.min_tokens < 0:
            raise ValueError("the minimum draft size must be >= 0")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) and prompt_lookup_max "
                             f"({self.prompt_lookup_max}) must satisfy 1 <= min <= max")

    @property
    def enabled(self) -> bool:
        return self.method is not None and self.num_speculative_tokens > 0


@dataclass(slots=True)
class _Seq:
    index: NgramIndex
    n_max: int
    n_min: int
    fed: int = 0  # tokens of the request already in the index


@dataclass
class SpecDecoder:
    """The speculation policy of one engine (engine thread only).

    ``register`` a request when it is added (with whether its sampler picks the plain
    argmax), ``propose`` before each step, ``forget`` when it finishes. The indexes are
    built lazily from a request's first proposal on, at most ``INDEX_TOKENS_PER_STEP``
    tokens per step, and kept across preemption (the token sequence does not change).
    """

    config: SpecConfig
    _seqs: dict[str, _Seq] = field(default_factory=dict)

    def register(self, request, plain_greedy: bool) -> None:
        """Note a new request. ``plain_greedy``: its every next token is the argmax of the raw
        logits (see ``SequenceSampler.is_plain_greedy``). Per-request ``spec_n_max`` (None:
        the engine's K; 0 disables) lowers K, never raises it; ``spec_n_min`` raises the
        minimum draft size."""
        c = self.config
        p = request.params
        n_max = c.num_speculative_tokens if p.spec_n_max is None else min(p.spec_n_max, c.num_speculative_tokens)
        n_min = max(c.min_tokens, p.spec_n_min)
        eligible = (c.enabled and plain_greedy and request.grammar is None and n_max > 0
                    and p.n_probs == 0 and p.prompt_logprobs is None)
        if eligible:
            self._seqs[request.request_id] = _Seq(NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max), n_max,
                                                  n_min)

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
