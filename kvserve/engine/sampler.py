"""llama.cpp's sampler chain in torch: one :class:`SequenceSampler` per request.

The chain follows llama.cpp (``src/llama-sampling.cpp`` and
``common/sampling.cpp``) and llama-server's defaults:

1. grammar ``mask`` (bool [n_vocab], True = allowed): disallowed tokens get
   ``-inf`` before anything else (llama.cpp applies the grammar sampler first
   when it resamples; we always apply it first). When ``logit_bias`` or the EOG
   ban below would leave no token, a masked row falls back to the mask alone
   (the constraint wins); only a mask that allows nothing raises SamplingError;
2. ``logit_bias`` (llama.cpp's ``logit-bias`` sampler, added before the chain):
   ``logit += bias``; ``-inf`` bans a token, ``+inf`` forces it (only the
   ``+inf`` tokens stay candidates);
3. end-of-generation ban: with ``ignore_eos`` (llama-server adds a ``-inf``
   bias to every EOG token) or while ``num_generated < min_tokens`` (vLLM);
4. ``params.samplers`` in order: ``penalties``, ``dry``, ``top_n_sigma``,
   ``top_k``, ``typ_p``, ``top_p``, ``min_p``, ``xtc``, ``temperature``
   (llama.cpp names and aliases, see :func:`resolve_sampler_names`);
5. ``dist``: a draw from the softmax of what is left, with the request's RNG.

Greedy decoding follows llama.cpp exactly: there is no separate greedy
sampler; the ``temperature`` stage with ``temperature <= 0`` keeps only the
candidate with the highest logit (the first one on ties), at its place in the
chain. So penalties, DRY and every filter placed before it still apply (with
the default order greedy is the argmax of the penalised logits; a ``typ_p`` or
``xtc`` stage before it can remove the top token). If ``temperature`` is not
in ``samplers`` no temperature is applied at all, as in llama.cpp.

Candidate sets are kept as tensors on the logits' device: the full vocabulary
until a stage shrinks it (``top_k`` uses ``torch.topk``, so with top_k active
no full sort happens), then a small ``(values, ids)`` pair. Tokens removed by a
stage are dropped (llama.cpp sometimes keeps them with a ``-inf`` logit, which
has the same effect on the draw).

Not implemented (refused by name): ``infill``, ``adaptive_p`` and mirostat.
"""

from __future__ import annotations

import math
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvserve.engine.request import SEED_RANDOM, InvalidRequestError, SamplingParams

__all__ = [
    "BreakerCache",
    "SampleResult",
    "SamplingError",
    "SequenceSampler",
    "compute_logprobs",
    "resolve_sampler_names",
    "sampler_names_from_chars",
    "sample_batch",
]

NEG_INF = float("-inf")

#: canonical names (llama.cpp ``common_sampler_type_to_str``) we implement.
_CANONICAL = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")

#: llama.cpp's alternative names (``common_sampler_types_from_names``'s alt map).
_ALIASES = {
    "top-k": "top_k",
    "top-p": "top_p",
    "nucleus": "top_p",
    "top-n-sigma": "top_n_sigma",
    "typical-p": "typ_p",
    "typical": "typ_p",
    "typ-p": "typ_p",
    "typ": "typ_p",
    "min-p": "min_p",
    "temp": "temperature",
}

#: llama.cpp's one-letter codes (``common_sampler_type_to_chr``), for ``--sampling-seq``.
_CHARS = {
    "e": "penalties",
    "d": "dry",
    "s": "top_n_sigma",
    "k": "top_k",
    "y": "typ_p",
    "p": "top_p",
    "m": "min_p",
    "x": "xtc",
    "t": "temperature",
}

#: names llama.cpp knows but kvserve does not implement.
_UNSUPPORTED = {"infill", "adaptive_p", "adaptive-p", "i", "a"}


#: the largest finite float32: a bias beyond it is infinite once added to the logits
_F32_MAX = float(torch.finfo(torch.float32).max)


class SamplingError(RuntimeError):
    """No token can be sampled: the grammar mask and bans together removed every token.

    The engine should finish the request with an error (not crash the step).
    """


def resolve_sampler_names(names: Sequence[str]) -> tuple[str, ...]:
    """Map sampler names (canonical or llama.cpp aliases) to canonical names.

    Args:
        names: e.g. ``("top-k", "typical", "temp")``.

    Returns:
        Canonical names, e.g. ``("top_k", "typ_p", "temperature")``; duplicates are
        kept (llama.cpp would run such a sampler twice, and so do we).

    Raises:
        InvalidRequestError: an unknown name (llama.cpp only logs a warning and
            drops it; kvserve refuses the request) or one we do not implement
            (``infill``, ``adaptive_p``).
    """
    out: list[str] = []
    for name in names:
        if not isinstance(name, str):
            raise InvalidRequestError(f"sampler name must be a string, got {name!r}")
        canon = name if name in _CANONICAL else _ALIASES.get(name)
        if canon is None:
            if name in _UNSUPPORTED:
                raise InvalidRequestError(f"sampler '{name}' is not supported")
            raise InvalidRequestError(f"unknown sampler name '{name}'")
        out.append(canon)
    return tuple(out)


def sampler_names_from_chars(chars: str) -> tuple[str, ...]:
    """llama.cpp's one-letter sampler sequence (``--sampling-seq edskypmxt``) to names.

    Raises:
        InvalidRequestError: an unknown or unsupported letter.
    """
    out = []
    for c in chars:
        if c not in _CHARS:
            raise InvalidRequestError(f"unknown sampler char '{c}'")
        out.append(_CHARS[c])
    return tuple(out)


@dataclass(slots=True)
class SampleResult:
    """One sampled token.

    Attributes:
        token_id: the chosen token id.
        logprob: natural-log probability of ``token_id``: from the raw softmax of
            the model's logits (before mask, bias and the chain; llama-server's
            default), or, with ``post_sampling_probs``, from the distribution the
            token was drawn from (after the chain).
        top: when ``n_probs > 0``: up to ``n_probs`` ``(token_id, logprob)`` pairs,
            descending probability, from the same distribution as ``logprob``
            (post-sampling lists only the surviving candidates); else None.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None = None


class _BreakerTokens:
    """Which token ids contain a DRY sequence breaker: ``tid in breakers``, found on demand.

    This is llama.cpp's single-token case of ``get_overlapping_token_sequences``
    (breakers truncated to 40 characters). llama.cpp also recognises a breaker
    split over several tokens (a token ending with the breaker's head followed by
    the tokenization of its tail); kvserve does not, which only matters for
    breakers longer than one token.

    Cost: llama.cpp scans the whole vocabulary for every breaker when the sampler is
    built (vocabulary x breakers: kvserve's scan of that kind took 13.7 s for 10,000
    breakers on SmolLM2's 49,152 tokens, on the engine thread). Here a token's piece is
    matched once, when DRY
    first asks about it (one C regex search over the alternation of all breakers), and
    the answer is kept: a step only pays for the window tokens not seen before, and
    a :class:`BreakerCache` shares the answers between requests with the same breakers.
    """

    def __init__(self, token_texts: Callable[[int], str] | None, breakers: tuple[str, ...]):
        brks = sorted({b[:40] for b in breakers if b}, key=len, reverse=True)
        self._texts = token_texts
        self._pattern = re.compile("|".join(map(re.escape, brks))) if brks and token_texts is not None else None
        self._known: dict[int, bool] = {}

    def __bool__(self) -> bool:
        return self._pattern is not None

    def __contains__(self, tid: int) -> bool:
        if self._pattern is None:
            return False
        hit = self._known.get(tid)
        if hit is None:
            try:
                text = self._texts(tid)
            except Exception:  # noqa: BLE001 - ids without a piece are never breakers
                text = ""
            hit = self._known[tid] = bool(text) and self._pattern.search(text) is not None
        return hit


class BreakerCache:
    """The DRY breaker sets (:class:`_BreakerTokens`) of one vocabulary, shared between the
    requests that use the same breakers; the ``maxsize`` most recently used tuples are kept.

    Owned by whoever owns the vocabulary (``EngineCore.breakers``) and passed to each
    :class:`SequenceSampler`, so it lives exactly as long as its engine: an unloaded
    model's tokenizer is not kept alive by it (a module-level ``lru_cache`` keyed by
    the ``token_texts`` callable was, with its engine).

    Args:
        token_texts: token id -> piece text (None: DRY has no breakers).
        maxsize: breaker tuples kept (least recently used dropped first).

    Not thread-safe: the engine thread alone uses it (samplers are built and run there).
    """

    def __init__(self, token_texts: Callable[[int], str] | None, maxsize: int = 16):
        self.token_texts = token_texts
        self.maxsize = maxsize
        self._sets: OrderedDict[tuple[str, ...], _BreakerTokens] = OrderedDict()

    def get(self, breakers: tuple[str, ...]) -> _BreakerTokens:
        """The shared breaker set of ``breakers`` (built on first use)."""
        found = self._sets.get(breakers)
        if found is None:
            found = self._sets[breakers] = _BreakerTokens(self.token_texts, breakers)
            if len(self._sets) > self.maxsize:
                self._sets.popitem(last=False)
        else:
            self._sets.move_to_end(breakers)
        return found


def _suffix_match_lengths(window: Sequence[int]) -> list[int]:
    """For each position i, the length of the longest common suffix of window[:i+1] and window.

    The last position is the whole window (its value is not used). This is the
    Z-function of the reversed window (linear time), the quantity llama.cpp's DRY
    sampler calls ``dry_repeat_count``.
    """
    n = len(window)
    rev = window[::-1]
    z = [0] * n
    left = right = 0  # [left, right) is the rightmost Z-box
    for k in range(1, n):
        zk = 0
        if k < right:
            zk = min(right - k, z[k - left])
        while k + zk < n and rev[zk] == rev[k + zk]:
            zk += 1
        z[k] = zk
        if k + zk > right:
            left, right = k, k + zk
    # z[k] (reversed position k) is the match ending at forward index n - 1 - k.
    out = [0] * n
    for k in range(1, n):
        out[n - 1 - k] = z[k]
    out[n - 1] = n
    return out


class _Cand:
    """A candidate set: ``vals`` float32 [n] logits and ``ids`` int64 [n] token ids.

    ``ids is None`` means the full vocabulary in id order (``vals`` is [n_vocab]).
    ``sorted`` is True when ``vals`` is in descending order.
    """

    __slots__ = ("vals", "ids", "sorted")

    def __init__(self, vals: torch.Tensor, ids: torch.Tensor | None, sorted_: bool = False):
        self.vals = vals
        self.ids = ids
        self.sorted = sorted_

    def size(self) -> int:
        return self.vals.shape[0]

    def id_tensor(self) -> torch.Tensor:
        if self.ids is None:
            return torch.arange(self.vals.shape[0], device=self.vals.device)
        return self.ids

    def keep(self, index: torch.Tensor, sorted_: bool) -> None:
        """Keep the candidates at ``index`` (int64 positions or bool mask), in that order."""
        self.ids = self.id_tensor()[index]
        self.vals = self.vals[index]
        self.sorted = sorted_

    def sort_desc(self) -> None:
        if not self.sorted:
            self.vals, order = torch.sort(self.vals, descending=True)
            self.ids = self.id_tensor()[order]
            self.sorted = True

    def drop_removed(self) -> None:
        """Drop ``-inf`` candidates (tokens a stage removed)."""
        alive = self.vals > NEG_INF
        self.keep(alive, self.sorted)


class SequenceSampler:
    """Per-request sampling state: parameters, resolved chain and RNG.

    Args:
        params: the request's SamplingParams (read, never modified).
        n_vocab: vocabulary size (tokens); logits rows are [n_vocab].
        eog_token_ids: end-of-generation ids, banned with ``ignore_eos`` or before
            ``min_tokens`` tokens were generated.
        token_texts: token id -> piece text; only used to find DRY sequence
            breakers (without it DRY has no breakers).
        breakers: the engine's :class:`BreakerCache` (its ``token_texts`` is used then):
            requests with the same breakers share what was found. None: this sampler
            keeps its own.

    Attributes:
        seed: the seed actually used (random from ``os.urandom`` when
            ``params.seed`` is 4294967295, as llama.cpp's ``LLAMA_DEFAULT_SEED``).
        chain: the canonical sampler names in order.

    Raises:
        InvalidRequestError: unknown sampler name.

    The RNGs are CPU ``torch.Generator`` objects (one for ``dist``, one for
    ``xtc``, both seeded with ``seed``, as llama.cpp seeds each sampler's own
    mt19937), so the same seed and logits give the same tokens on any device.
    """

    def __init__(
        self,
        params: SamplingParams,
        n_vocab: int,
        eog_token_ids: frozenset[int],
        token_texts: Callable[[int], str] | None = None,
        breakers: BreakerCache | None = None,
    ):
        self.params = params
        self.n_vocab = int(n_vocab)
        self.eog_token_ids = frozenset(int(t) for t in eog_token_ids if 0 <= int(t) < n_vocab)
        self.token_texts = breakers.token_texts if breakers is not None else token_texts
        self._breaker_cache = breakers
        self.chain = resolve_sampler_names(params.samplers)
        self.seed = (
            int.from_bytes(os.urandom(4), "little") if params.seed == SEED_RANDOM else int(params.seed)
        )
        self._rng = torch.Generator(device="cpu")
        self._rng.manual_seed(self.seed)
        self._xtc_rng = torch.Generator(device="cpu")
        self._xtc_rng.manual_seed(self.seed)
        self._dry_breakers: _BreakerTokens | None = None
        self._bias_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

        p = params
        self._bias = {int(k): float(v) for k, v in p.logit_bias.items() if 0 <= int(k) < n_vocab and v != 0}
        # a bias is added to float32 logits: -1e39 is -inf there, a ban like -inf or false
        if sum(1 for v in self._bias.values() if v < -_F32_MAX) >= self.n_vocab:
            raise InvalidRequestError("Field 'logit_bias': every token of the vocabulary is banned, "
                                      "so none can be sampled")
        self._penalties_on = (
            p.repeat_last_n != 0
            and not (p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0)
        )
        self._dry_on = p.dry_multiplier != 0.0 and p.dry_base >= 1.0 and p.dry_penalty_last_n != 0
        active = {
            "penalties": self._penalties_on,
            "dry": self._dry_on,
            "top_n_sigma": p.top_n_sigma > 0.0,
            "top_k": p.top_k > 0,
            "typ_p": p.typical_p < 1.0,
            "top_p": p.top_p < 1.0,
            "min_p": p.min_p > 0.0,
            "xtc": p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5,
            "temperature": True,
        }
        #: the chain without stages that can never change anything.
        self._stages = tuple(s for s in self.chain if active[s])
        # Plain greedy: argmax of the raw logits gives exactly the chain's answer.
        # Stages that can move the argmax: penalties, dry, typ_p, xtc; a missing
        # temperature stage means no greedy at all.
        # Greedy chain: with no EOG ban either, plain greedy; with one (ignore_eos, min_tokens)
        # the token is the argmax of the logits with the EOG tokens removed.
        self._greedy_chain = (
            p.temperature <= 0.0
            and "temperature" in self.chain
            and not self._bias
            and p.n_probs == 0
            and not any(s in ("penalties", "dry", "typ_p", "xtc") for s in self._stages)
        )
        self._static_plain_greedy = self._greedy_chain and not p.ignore_eos
        self._eog_index: dict[torch.device, torch.Tensor] = {}
        # First active stage is top_k: the batch can run one topk for all such rows.
        # Leading full-vocabulary stages (penalties, dry) followed by top_k: the batch
        # applies those per row, then runs one topk for all such rows.
        lead = 0
        while lead < len(self._stages) and self._stages[lead] in ("penalties", "dry"):
            lead += 1
        self._lead = lead
        self.topk_after_lead = lead < len(self._stages) and self._stages[lead] == "top_k"

    # ------------------------------------------------------------------ helpers

    def is_plain_greedy(self, num_generated: int, mask: torch.Tensor | None = None) -> bool:
        """True when the token is the argmax of the raw logits (the batch fast path)."""
        return (
            self._static_plain_greedy
            and mask is None
            and not (self.eog_token_ids and num_generated < self.params.min_tokens)
        )

    def is_greedy_without_eog(self, num_generated: int, mask: torch.Tensor | None = None) -> bool:
        """True when the token is the argmax of the raw logits with the EOG tokens removed
        (greedy under ``ignore_eos`` or ``min_tokens``; a batch fast path)."""
        return self._greedy_chain and mask is None and self._bans_eog(num_generated)

    def eog_index(self, device: torch.device) -> torch.Tensor:
        """The EOG token ids as an int64 tensor on ``device`` (cached)."""
        t = self._eog_index.get(device)
        if t is None:
            t = self._eog_index[device] = torch.tensor(sorted(self.eog_token_ids), dtype=torch.long, device=device)
        return t

    def _bans_eog(self, num_generated: int) -> bool:
        return bool(self.eog_token_ids) and (self.params.ignore_eos or num_generated < self.params.min_tokens)

    def _bias_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._bias_cache.get(device)
        if t is None:
            ids = torch.tensor(list(self._bias.keys()), dtype=torch.long, device=device)
            vals = torch.tensor(list(self._bias.values()), dtype=torch.float32, device=device)
            t = self._bias_cache[device] = (ids, vals)
        return t

    def _prepare(
        self, logits: torch.Tensor, num_generated: int, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Mask, logit_bias and EOG ban on a copy of the logits (float32 [n_vocab])."""
        x = logits.to(torch.float32).clone()
        touched = False
        if mask is not None:
            x.masked_fill_(~mask.to(device=x.device, dtype=torch.bool), NEG_INF)
            touched = True
        if self._bias:
            ids, vals = self._bias_tensors(x.device)
            x.index_add_(0, ids, vals)  # -inf bias -> -inf logit (llama.cpp logit-bias)
            if any(v == math.inf for v in self._bias.values()):
                forced = x == math.inf
                x = torch.where(forced, torch.zeros_like(x), torch.full_like(x, NEG_INF))
            touched = True
        banned_eog = self._bans_eog(num_generated)
        if banned_eog:
            before = x.clone() if touched else None
            x[list(self.eog_token_ids)] = NEG_INF
            if not bool((x > NEG_INF).any()):
                # The grammar (or bias) allows only EOG tokens: let it finish.
                x = before if before is not None else x
            touched = True
        if touched and not bool((x > NEG_INF).any()):
            if mask is None:
                raise SamplingError("no token is allowed by logit_bias")
            x = self._mask_only(logits, mask)
        return x

    def _mask_only(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits with only the grammar mask applied: a constrained request whose bias or EOG
        ban leaves nothing still produces valid text (the grammar wins).

        Raises:
            SamplingError: the mask itself allows no token.
        """
        x = logits.to(torch.float32).clone()
        x.masked_fill_(~mask.to(device=x.device, dtype=torch.bool), NEG_INF)
        if not bool((x > NEG_INF).any()):
            raise SamplingError("no token is allowed by the grammar mask")
        return x

    # ------------------------------------------------------------------ stages

    def _penalty_counts(self, history: Sequence[int]) -> tuple[list[int], list[int]]:
        """Token ids and their counts in the penalty window (llama.cpp ``penalties`` sampler).

        llama-server feeds every prompt token and every generated token to the
        sampler (``common_sampler_accept``), so the window is the last
        ``repeat_last_n`` tokens of prompt + output (-1 = all of them, n_ctx).
        """
        n = self.params.repeat_last_n
        window = history if n < 0 else history[len(history) - n :] if len(history) > n else history
        counts: dict[int, int] = {}
        for t in window:
            counts[t] = counts.get(t, 0) + 1
        return list(counts.keys()), list(counts.values())

    @staticmethod
    def _lookup(cand: _Cand, tok_ids: list[int], values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions in ``cand`` of ``tok_ids`` and the matching ``values`` (tokens not present are skipped)."""
        dev = cand.vals.device
        tid = torch.tensor(tok_ids, dtype=torch.long, device=dev)
        if cand.ids is None:
            ok = (tid >= 0) & (tid < cand.vals.shape[0])
            return tid[ok], values[ok]
        match = cand.ids[:, None] == tid[None, :]  # [n, m], n is small here
        has = match.any(dim=1)
        pos = has.nonzero().squeeze(1)
        col = match[pos].to(torch.int8).argmax(dim=1)
        return pos, values[col]

    def _apply_penalties(self, cand: _Cand, history: Sequence[int]) -> None:
        """llama.cpp ``penalties``: for each token seen ``count > 0`` times in the window:
        ``logit <= 0 ? logit * repeat_penalty : logit / repeat_penalty``, then
        ``logit -= count * frequency_penalty + presence_penalty``.
        """
        p = self.params
        ids, counts = self._penalty_counts(history)
        if not ids:
            return
        dev = cand.vals.device
        cnt = torch.tensor(counts, dtype=torch.float32, device=dev)
        pos, c = self._lookup(cand, ids, cnt)
        if pos.numel() == 0:
            return
        v = cand.vals[pos]
        v = torch.where(v <= 0, v * p.repeat_penalty, v / p.repeat_penalty)
        v = v - (c * p.frequency_penalty + p.presence_penalty)
        cand.vals[pos] = v
        cand.sorted = False

    def _dry_penalties(self, history: Sequence[int]) -> dict[int, float]:
        """llama.cpp ``dry`` (DRY, from koboldcpp): token id -> amount to subtract.

        Window: the last ``dry_penalty_last_n`` tokens of prompt + output (-1 = all).
        ``rep_limit`` is the distance from the end of the window to the most recent
        sequence-breaker token (the whole window if none); nothing happens when the
        window has ``<= dry_allowed_length`` tokens or ``rep_limit < allowed_length``.
        For every earlier position whose preceding tokens repeat the window's last
        ``n`` tokens (``n`` capped at ``rep_limit``, ``n >= allowed_length``), the
        token that followed gets ``n``; each token keeps its largest ``n`` and,
        unless it is itself a breaker, is penalised by
        ``dry_multiplier * dry_base ** (n - dry_allowed_length)`` (exponent clamped
        so the power stays a finite float32).
        """
        p = self.params
        if self._dry_breakers is None:
            brk = tuple(p.dry_sequence_breakers)
            cache = self._breaker_cache
            self._dry_breakers = cache.get(brk) if cache is not None else _BreakerTokens(self.token_texts, brk)
        n = p.dry_penalty_last_n
        window = list(history if n < 0 or len(history) <= n else history[len(history) - n :])
        size = len(window)
        allowed = p.dry_allowed_length
        if size <= allowed:
            return {}
        rep_limit = size
        breakers = self._dry_breakers
        if breakers:
            for i in range(size):
                if window[size - 1 - i] in breakers:
                    rep_limit = i
                    break
        if rep_limit < allowed:
            return {}
        match = _suffix_match_lengths(window)
        best: dict[int, int] = {}
        for i in range(size - 1):
            m = min(match[i], rep_limit)
            if m >= allowed and m > 0:
                tok = window[i + 1]
                if best.get(tok, -1) < m:
                    best[tok] = m
        if not best:
            return {}
        max_exp = int(88.7228391 / math.log(p.dry_base)) if p.dry_base > 1.000001 else 0
        out = {}
        for tok, m in best.items():
            if tok in breakers:
                continue
            e = m - allowed
            if max_exp > 0 and e > max_exp:
                e = max_exp
            try:
                out[tok] = p.dry_multiplier * p.dry_base**e
            except OverflowError:  # C's pow gives inf here (a dry_base above e^88.7 is not clamped)
                out[tok] = math.copysign(math.inf, p.dry_multiplier)
        return out

    def _apply_dry(self, cand: _Cand, history: Sequence[int]) -> None:
        pen = self._dry_penalties(history)
        if not pen:
            return
        vals = torch.tensor(list(pen.values()), dtype=torch.float32, device=cand.vals.device)
        pos, amount = self._lookup(cand, list(pen.keys()), vals)
        if pos.numel():
            cand.vals[pos] = cand.vals[pos] - amount
            cand.sorted = False

    def _apply_top_n_sigma(self, cand: _Cand) -> None:
        """llama.cpp ``top-n-sigma``: keep logits >= max - n * std (mean/std over finite logits)."""
        if cand.size() <= 1:
            return
        v = cand.vals
        fin = v > NEG_INF
        cnt = fin.sum().clamp_min(1).to(torch.float32)
        z = torch.where(fin, v, torch.zeros_like(v))
        mean = z.sum() / cnt
        std = torch.sqrt((torch.where(fin, v - mean, torch.zeros_like(v)) ** 2).sum() / cnt)
        vmax = v.max()
        cand.vals = torch.where(v < vmax - self.params.top_n_sigma * std, torch.full_like(v, NEG_INF), v)

    def _apply_top_k(self, cand: _Cand) -> None:
        """llama.cpp ``top-k``: keep the k highest logits (k <= 0: no-op), sorted descending."""
        k = min(self.params.top_k, cand.size())
        if cand.sorted:
            cand.vals, cand.ids = cand.vals[:k], cand.id_tensor()[:k]
        else:
            vals, idx = torch.topk(cand.vals, k, sorted=True)
            cand.ids = idx if cand.ids is None else cand.ids[idx]
            cand.vals = vals
            cand.sorted = True
        cand.drop_removed()

    def _apply_typical(self, cand: _Cand) -> None:
        """llama.cpp ``typical``: order by |-log p - H|, keep until the cumulative prob > p.

        The kept tokens are in that order (not sorted by logit), as in llama.cpp.
        """
        cand.sort_desc()
        cand.drop_removed()
        if cand.size() <= 1:
            return
        logp = torch.log_softmax(cand.vals, dim=0)
        probs = logp.exp()
        entropy = -(probs * logp).sum()
        shifted = (-logp - entropy).abs()
        order = torch.sort(shifted, stable=True).indices
        cum = torch.cumsum(probs[order], dim=0)
        last = min(int((cum <= self.params.typical_p).sum().item()) + 1, cand.size())
        cand.keep(order[:last], sorted_=False)

    def _apply_top_p(self, cand: _Cand) -> None:
        """llama.cpp ``top-p``: sorted descending, keep up to and including the token where
        the cumulative probability first reaches p.

        Like llama.cpp, a large unsorted set first tries the top 256 (``torch.topk``)
        and sorts everything only when those do not reach p.
        """
        if not cand.sorted and cand.size() > 1024:
            probs = torch.softmax(cand.vals, dim=0)
            pv, pi = torch.topk(probs, 256, sorted=True)
            cum = torch.cumsum(pv, dim=0)
            if bool(cum[-1] >= self.params.top_p):
                last = min(int((cum < self.params.top_p).sum().item()) + 1, 256)
                cand.keep(pi[:last], sorted_=True)
                cand.drop_removed()
                return
        cand.sort_desc()
        cand.drop_removed()
        probs = torch.softmax(cand.vals, dim=0)
        cum = torch.cumsum(probs, dim=0)
        last = min(int((cum < self.params.top_p).sum().item()) + 1, cand.size())
        cand.vals, cand.ids = cand.vals[:last], cand.ids[:last]

    def _apply_min_p(self, cand: _Cand) -> None:
        """llama.cpp ``min-p``: keep logits >= max_logit + log(p) (i.e. prob >= p * max_prob)."""
        v = cand.vals
        thr = v.max() + math.log(self.params.min_p)
        cand.keep(v >= thr, cand.sorted)

    def _apply_xtc(self, cand: _Cand) -> None:
        """llama.cpp ``xtc``: with probability ``xtc_probability``, remove every token whose
        prob >= threshold except the least likely of them (needs >= 2 candidates)."""
        if cand.ids is not None or cand.sorted:
            cand.drop_removed()
        if cand.size() < 2:
            return
        chance = float(torch.rand((), generator=self._xtc_rng, dtype=torch.float64))
        if chance > self.params.xtc_probability:
            return
        cand.sort_desc()
        cand.drop_removed()
        probs = torch.softmax(cand.vals, dim=0)
        # probabilities are descending: the tokens at or above the threshold form a prefix
        n_above = int((probs >= self.params.xtc_threshold).sum().item())
        pos_last = n_above - 1
        if pos_last > 0:
            cand.vals, cand.ids = cand.vals[pos_last:], cand.ids[pos_last:]

    def _apply_temperature(self, cand: _Cand) -> None:
        """llama.cpp ``temp``: ``logit /= t``; t <= 0 keeps only the highest logit (greedy)."""
        t = self.params.temperature
        if t > 0.0:
            if t != 1.0:
                cand.vals = cand.vals / t
            return
        i = cand.vals.argmax().reshape(1)
        cand.keep(i, sorted_=True)

    # ------------------------------------------------------- speculative decoding

    @property
    def speculates_sampled(self) -> bool:
        """True when speculative decoding may verify this request's drafts by the rejection rule
        (:func:`kvserve.engine.spec_decode.speculative_accept`): it samples (temperature > 0) and
        its chain depends on neither the token history (penalties, DRY) nor an RNG of its own
        (xtc), so :meth:`probs` at a draft position is the distribution plain sampling would
        draw from there; no logprobs are asked for."""
        p = self.params
        return (p.temperature > 0.0 and "temperature" in self.chain and p.n_probs == 0
                and not any(s in ("penalties", "dry", "xtc") for s in self._stages))

    def probs(self, logits: torch.Tensor, num_generated: int) -> torch.Tensor:
        """The distribution this request's chain draws its next token from: float32 [n_vocab]
        on the logits' device, zero outside the candidates left by logit_bias, the EOG ban
        (``num_generated`` < min_tokens), and every stage (top_k, top_p, min_p, typ_p,
        top_n_sigma, temperature). No RNG is consumed. Only for :attr:`speculates_sampled`
        requests (no history-dependent or random stage).

        Raises:
            SamplingError: logit_bias leaves no token.
        """
        cand = _Cand(self._prepare(logits, num_generated, None), None, False)
        for name in self._stages:
            stage = _PLAIN_STAGES.get(name)
            if stage is None:
                raise ValueError(f"probs(): stage {name} depends on history or an RNG")
            stage(self, cand)
        pr = torch.softmax(cand.vals, dim=0)
        out = torch.zeros(self.n_vocab, dtype=torch.float32, device=logits.device)
        out.index_copy_(0, cand.id_tensor(), pr.to(torch.float32))
        return out

    @property
    def rng(self) -> torch.Generator:
        """The request's ``dist`` RNG (CPU torch.Generator seeded with :attr:`seed`)."""
        return self._rng

    # ------------------------------------------------------------------ public

    def sample(
        self,
        logits: torch.Tensor,
        history: Sequence[int],
        num_generated: int,
        mask: torch.Tensor | None = None,
    ) -> SampleResult:
        """Sample the next token of this sequence.

        Args:
            logits: float32 [n_vocab], the model's logits for the next position
                (any device; not modified).
            history: prompt + generated token ids so far (what llama-server feeds
                the penalty and DRY samplers).
            num_generated: tokens generated so far (for ``min_tokens``).
            mask: optional bool [n_vocab], True = allowed (grammar), any device.

        Returns:
            SampleResult (see there for which distribution ``logprob``/``top`` use).

        Raises:
            SamplingError: the mask and bans leave no token.
        """
        lse = torch.logsumexp(logits.to(torch.float32), dim=-1)
        return self._sample(logits, history, num_generated, mask, lse, None)

    def _sample(
        self,
        logits: torch.Tensor,
        history: Sequence[int],
        num_generated: int,
        mask: torch.Tensor | None,
        lse: torch.Tensor,
        pre_topk: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> SampleResult:
        p = self.params
        stages = self._stages
        if pre_topk is not None:
            # The batch already ran mask/bias/EOG ban, the leading penalties/dry and
            # a sorted topk (k_max >= our k) for this row.
            k = p.top_k
            cand = _Cand(pre_topk[0][:k], pre_topk[1][:k], True)
            cand.drop_removed()
            stages = stages[self._lead + 1 :]
        else:
            cand = _Cand(self._prepare(logits, num_generated, mask), None, False)
        for name in stages:
            if name == "penalties":
                self._apply_penalties(cand, history)
            elif name == "dry":
                self._apply_dry(cand, history)
            elif name == "xtc":
                self._apply_xtc(cand)
            else:  # the stages that read neither history nor the RNG (anything else: temperature)
                _PLAIN_STAGES.get(name, SequenceSampler._apply_temperature)(self, cand)
        return self._draw(cand, logits, lse)

    def _draw(self, cand: _Cand, raw: torch.Tensor, lse: torch.Tensor) -> SampleResult:
        """llama.cpp ``dist``: softmax over the candidates, u ~ U[0,1), first index whose
        running sum reaches u * total; then the logprob/top report."""
        p = self.params
        logp = torch.log_softmax(cand.vals, dim=0)
        probs = logp.exp()
        cum = torch.cumsum(probs, dim=0)
        u = float(torch.rand((), generator=self._rng, dtype=torch.float64))
        target = cum[-1:] * u
        pos = torch.searchsorted(cum, target).clamp_(max=cum.shape[0] - 1)
        # a zero-probability candidate can never be chosen (u may be exactly 0)
        pos = torch.where(probs[pos] > 0, pos, (probs > 0).to(torch.int8).argmax().reshape(1))
        ids = cand.id_tensor()
        tok_t = ids[pos]
        if p.post_sampling_probs:
            lp_t = logp[pos]
            top = None
            if p.n_probs > 0:
                n = min(p.n_probs, int((probs > 0).sum().item()))
                tv, ti = torch.topk(logp, n)
                top_ids = ids[ti].tolist()
                top = list(zip(top_ids, tv.tolist()))
            return SampleResult(int(tok_t.item()), float(lp_t.item()), top)
        raw32 = raw.to(torch.float32)
        lp_t = raw32[tok_t] - lse
        top = None
        if p.n_probs > 0:
            tv, ti = torch.topk(raw32, min(p.n_probs, raw32.shape[0]))
            top = list(zip(ti.tolist(), (tv - lse).tolist()))
        return SampleResult(int(tok_t.item()), float(lp_t.item()), top)


#: stages that read neither the sequence's history nor the RNG, by name (the sampler chain's
#: dispatch for them, shared by SequenceSampler.sample and .probs)
_PLAIN_STAGES = {
    "top_n_sigma": SequenceSampler._apply_top_n_sigma,
    "top_k": SequenceSampler._apply_top_k,
    "typ_p": SequenceSampler._apply_typical,
    "top_p": SequenceSampler._apply_top_p,
    "min_p": SequenceSampler._apply_min_p,
    "temperature": SequenceSampler._apply_temperature,
}


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]`` without a copy when ``rows`` is every row in order."""
    if len(rows) == logits.shape[0]:
        return logits
    return logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))


#: stages the batched small-candidate path implements (after a leading top_k).
_BATCHABLE = frozenset({"top_p", "min_p", "temperature"})


def _mask_beyond_k(samplers: list[SequenceSampler], vals: torch.Tensor) -> torch.Tensor:
    """A copy of ``vals`` (float32 [R, k_max]) with each row's entries past its own top_k at ``-inf``."""
    k_max = vals.shape[1]
    ks = [min(s.params.top_k, k_max) for s in samplers]
    if min(ks) < k_max:
        pos = torch.arange(k_max, device=vals.device)[None, :]
        kt = torch.tensor(ks, device=vals.device)[:, None]
        return vals.masked_fill(pos >= kt, NEG_INF)
    return vals.clone()


def _batched_top_p(samplers: list[SequenceSampler], vals: torch.Tensor) -> torch.Tensor:
    p = torch.tensor([s.params.top_p for s in samplers], dtype=torch.float32, device=vals.device)[:, None]
    cum = torch.cumsum(torch.softmax(vals, dim=-1), dim=-1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
    return vals.masked_fill(before >= p, NEG_INF)  # keep through the first cum >= p


def _batched_min_p(samplers: list[SequenceSampler], vals: torch.Tensor) -> torch.Tensor:
    lp = torch.tensor([math.log(s.params.min_p) for s in samplers], dtype=torch.float32, device=vals.device)
    thr = vals[:, :1] + lp[:, None]  # column 0 is the row max
    return vals.masked_fill(vals < thr, NEG_INF)


def _batched_temperature(samplers: list[SequenceSampler], vals: torch.Tensor) -> torch.Tensor:
    dev = vals.device
    temps = [s.params.temperature for s in samplers]
    if any(t <= 0.0 for t in temps):  # greedy rows keep their first (top) candidate
        greedy = torch.tensor([t <= 0.0 for t in temps], device=dev)[:, None]
        later = torch.arange(vals.shape[1], device=dev)[None, :] > 0
        vals = vals.masked_fill(greedy & later, NEG_INF)
    if any(t > 0.0 and t != 1.0 for t in temps):
        div = torch.tensor([t if t > 0.0 else 1.0 for t in temps], dtype=torch.float32, device=dev)
        vals = vals / div[:, None]
    return vals


#: the batched stages of :data:`_BATCHABLE`: (R samplers, float32 [R, k] sorted values) -> new values
_BATCHED_STAGES: dict[str, Callable[[list[SequenceSampler], torch.Tensor], torch.Tensor]] = {
    "top_p": _batched_top_p,
    "min_p": _batched_min_p,
    "temperature": _batched_temperature,
}


def _batched_after_top_k(
    samplers: list[SequenceSampler],
    vals: torch.Tensor,
    ids: torch.Tensor,
    raw: torch.Tensor,
    lse: torch.Tensor,
    stages: tuple[str, ...],
) -> list[SampleResult]:
    """Run ``stages`` (top_p / min_p / temperature) and ``dist`` for R rows at once.

    Args:
        samplers: the R rows' samplers (same ``stages`` after their top_k).
        vals: float32 [R, k_max] top logits, descending; ids: int64 [R, k_max].
        raw: float32 [R, n_vocab] raw logits; lse: float32 [R] their logsumexp.

    Removed candidates are ``-inf`` in place (the rows stay sorted), which is the
    same set, order and draw as the per-row path.
    """
    vals = _mask_beyond_k(samplers, vals)
    for name in stages:
        vals = _BATCHED_STAGES[name](samplers, vals)
    logp = torch.log_softmax(vals, dim=-1)  # [R, k_max]
    probs = logp.exp()
    cum = torch.cumsum(probs, dim=-1)
    u = torch.tensor(
        [float(torch.rand((), generator=s._rng, dtype=torch.float64)) for s in samplers],
        dtype=torch.float32,
        device=vals.device,
    )
    pos = torch.searchsorted(cum, cum[:, -1:] * u[:, None]).clamp_(max=vals.shape[1] - 1)
    tok = ids.gather(1, pos).squeeze(1)
    post_lp = logp.gather(1, pos).squeeze(1)
    raw_lp = raw.gather(1, tok[:, None]).squeeze(1) - lse
    return _batched_results(samplers, tok.tolist(), post_lp.tolist(), raw_lp.tolist(), logp, probs, ids, raw, lse)


def _batched_results(samplers: list[SequenceSampler], tok_l: list[int], post_l: list[float], raw_l: list[float],
                     logp: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor, raw: torch.Tensor,
                     lse: torch.Tensor) -> list[SampleResult]:
    """The R rows' SampleResults: the drawn token, its logprob (after the chain with
    ``post_sampling_probs``, else raw) and its ``n_probs`` top candidates (one topk of the raw
    logits for every row that reports raw probabilities)."""
    raw_n = [s.params.n_probs if not s.params.post_sampling_probs else 0 for s in samplers]
    raw_top_v = raw_top_i = None
    if max(raw_n) > 0:
        tv, ti = torch.topk(raw, min(max(raw_n), raw.shape[1]), dim=-1)
        raw_top_v, raw_top_i = (tv - lse[:, None]).tolist(), ti.tolist()
    out = []
    for j, s in enumerate(samplers):
        p = s.params
        top = None
        if p.post_sampling_probs:
            if p.n_probs > 0:
                n = min(p.n_probs, int((probs[j] > 0).sum().item()))
                tv, ti = torch.topk(logp[j], n)
                top = list(zip(ids[j][ti].tolist(), tv.tolist()))
            out.append(SampleResult(int(tok_l[j]), float(post_l[j]), top))
        else:
            if p.n_probs > 0:
                n = min(p.n_probs, raw.shape[1])
                top = list(zip(raw_top_i[j][:n], raw_top_v[j][:n]))
            out.append(SampleResult(int(tok_l[j]), float(raw_l[j]), top))
    return out


def _greedy_without_eog(
    logits: torch.Tensor,
    lse: torch.Tensor,
    rows: list[int],
    samplers: list[SequenceSampler],
    results: list[SampleResult | None],
) -> None:
    """Greedy rows with an EOG ban: argmax of the logits with the EOG tokens at ``-inf``
    (what the chain keeps: every stage before ``temperature`` keeps the top token),
    logprob from the raw softmax. Fills ``results[row]``; a row whose tokens are all
    EOG, or whose top logit is tied, is left for the full chain (its rules)."""
    sel = torch.tensor(rows, dtype=torch.long, device=logits.device)
    work = logits.index_select(0, sel)  # a copy: the EOG ban does not touch the raw logits
    eogs = {samplers[r].eog_token_ids for r in rows}
    if len(eogs) == 1:  # the usual case: one vocabulary, one EOG set
        work.index_fill_(1, samplers[rows[0]].eog_index(logits.device), NEG_INF)
    else:
        for j, r in enumerate(rows):
            work[j].index_fill_(0, samplers[r].eog_index(logits.device), NEG_INF)
    tok = work.argmax(dim=-1)
    best = work.gather(1, tok[:, None])
    # a tie for the top (frequent: logits of the bfloat16 kernels are bfloat16 values) goes
    # through the chain, whose tie order (top_k's, sort's) is not argmax's first index
    n_top = (work == best).sum(dim=-1)
    lp = logits[sel, tok] - lse.index_select(0, sel)
    for r, t, v, n, lpv in zip(rows, tok.tolist(), best.squeeze(1).tolist(), n_top.tolist(), lp.tolist()):
        if v > NEG_INF and n == 1:
            results[r] = SampleResult(int(t), float(lpv), None)


_NO_BAN = torch.empty(0, dtype=torch.long)


def _native_stats(logits: torch.Tensor):
    """The native decode step's ``greedy_stats`` (kvserve/models/decode_cpu.cpp) when its extension
    is loaded in this process and ``logits`` is a CPU float32 [B, V] tensor, else None.

    It returns, per row, the first maximum's index with banned ids excluded, that maximum, the
    number of entries equal to it (-1 for a row with a NaN) and log-sum-exp of the whole row, in one
    pass: at one stream of SmolLM2 (V = 49152) torch's logsumexp, argmax, gather and the EOG ban's
    copies took ~2 ms of a ~12 ms token on the 2-core Zen 3. The pick is argmax's (the first index
    of the maximum), so tokens are the same; logprobs differ from torch's logsumexp by float rounding
    (relative ~2e-7)."""
    if logits.device.type != "cpu" or logits.dim() != 2 or logits.dtype != torch.float32:
        return None
    from kvserve.models import decode_native

    mod = decode_native._module
    return getattr(mod, "greedy_stats", None) if mod is not None else None


@dataclass(slots=True)
class _Batch:
    """One :func:`sample_batch` call: its inputs, what the strategies share and their results.

    Attributes:
        logits: float32 [B, n_vocab]; lse: float32 [B] their logsumexp.
        fast: the native ``greedy_stats`` (:func:`_native_stats`) or None; stats: its pass over
            ``logits`` with nothing banned (index, max, ties, lse per row) or None; banned: its pass
            with the EOG ids banned when every row bans one EOG set (then ``stats`` is None).
        results: B entries, None until a strategy samples the row.
        pre: row -> its top-k candidates ``(vals, ids)``, for a row the top-k strategy leaves to
            the chain.
    """

    logits: torch.Tensor
    samplers: list[SequenceSampler]
    histories: list[Sequence[int]]
    num_generated: list[int]
    masks: list[torch.Tensor | None]
    lse: torch.Tensor
    fast: Callable | None
    stats: tuple | None
    results: list[SampleResult | None]
    pre: dict[int, tuple[torch.Tensor, torch.Tensor]]
    #: the native pass over every row with the EOG ids excluded (index, max, ties, lse per row), when
    #: every row is greedy under one EOG ban (``ignore_eos`` greedy streams): the only pass then
    banned: tuple | None = None


@dataclass(frozen=True, slots=True)
class _Strategy:
    """One way to sample rows of a batch: ``applies(batch, row)`` says which rows it takes (among
    those not sampled yet), ``sample(batch, rows)`` fills ``batch.results`` for them; a row it
    leaves None (a tie, a NaN) goes on to the next strategy."""

    name: str
    applies: Callable[[_Batch, int], bool]
    sample: Callable[[_Batch, list[int]], None]


def _plain_greedy(b: _Batch, i: int) -> bool:
    return b.samplers[i].is_plain_greedy(b.num_generated[i], b.masks[i])


def _sample_greedy(b: _Batch, rows: list[int]) -> None:
    """Plain greedy rows: the native pass's pick (a row with a NaN excepted), else one batched argmax."""
    results = b.results
    if b.stats is not None:
        toks, best, lses, ties = (t.tolist() for t in b.stats)
        for r in rows:
            if ties[r] >= 0:  # -1: a NaN in the row, torch's argmax below decides
                results[r] = SampleResult(int(toks[r]), float(best[r] - lses[r]), None)
        rows = [r for r in rows if results[r] is None]
    if rows:
        sub = _rows(b.logits, rows)
        tok = sub.argmax(dim=-1)
        lp = sub.gather(1, tok[:, None]).squeeze(1) - _rows(b.lse[:, None], rows).squeeze(1)
        for r, t, lpv in zip(rows, tok.tolist(), lp.tolist()):
            results[r] = SampleResult(int(t), float(lpv), None)


def _greedy_banning_eog(b: _Batch, i: int) -> bool:
    return b.samplers[i].is_greedy_without_eog(b.num_generated[i], b.masks[i])


def _sample_greedy_without_eog(b: _Batch, rows: list[int]) -> None:
    """Greedy rows under ignore_eos / min_tokens: the native pass with the EOG ids excluded (one
    EOG set), else :func:`_greedy_without_eog`; a tie is left for the chain."""
    logits, samplers, results = b.logits, b.samplers, b.results
    if b.fast is not None and len({samplers[r].eog_token_ids for r in rows}) == 1:
        if b.banned is not None and len(rows) == logits.shape[0]:  # the batch's one pass (sample_batch)
            toks, best, lses, ties = (t.tolist() for t in b.banned)
        else:
            sub = _rows(logits, rows).contiguous()
            toks, best, _, ties = (t.tolist() for t in b.fast(sub, samplers[rows[0]].eog_index(logits.device)))
            lse_all = b.lse.tolist()
            lses = [lse_all[r] for r in rows]
        for j, r in enumerate(rows):
            # a finite maximum is at an id not banned: best[j] is logits[r, toks[j]] itself
            if best[j] > NEG_INF and ties[j] == 1:  # as _greedy_without_eog: a tie goes through the chain
                results[r] = SampleResult(int(toks[j]), float(best[j] - lses[j]), None)
        rows = [r for r in rows if results[r] is None]
    if rows:
        _greedy_without_eog(logits, b.lse, rows, samplers, results)


def _top_k_first(b: _Batch, i: int) -> bool:
    return b.samplers[i].topk_after_lead


def _lead_applied(b: _Batch, rows: list[int]) -> torch.Tensor:
    """``b.logits``, or a copy with each row that needs it prepared (mask, bias, EOG ban) and run
    through its stages before top_k (penalties, dry)."""
    logits, work = b.logits, b.logits
    for i in rows:
        smp = b.samplers[i]
        if b.masks[i] is None and not smp._bias and not smp._bans_eog(b.num_generated[i]) and not smp._lead:
            continue
        if work is logits:
            work = logits.clone()
        cand = _Cand(smp._prepare(logits[i], b.num_generated[i], b.masks[i]), None, False)
        for name in smp._stages[: smp._lead]:
            if name == "penalties":
                smp._apply_penalties(cand, b.histories[i])
            else:
                smp._apply_dry(cand, b.histories[i])
        work[i] = cand.vals
    return work


def _sample_top_k(b: _Batch, rows: list[int]) -> None:
    """Rows whose first active stage is top_k: one batched ``torch.topk``; rows whose chain after it
    is only top_p / min_p / temperature (llama-server's defaults) finish batched on [R, k]
    (:func:`_batched_after_top_k`, grouped by that tail), the others keep their candidates
    (``b.pre``) for the chain."""
    samplers, logits = b.samplers, b.logits
    k_max = min(max(samplers[i].params.top_k for i in rows), logits.shape[1])
    sub = _rows(_lead_applied(b, rows), rows)
    raw_sub = _rows(logits, rows)
    vals, ids = torch.topk(sub, k_max, dim=-1, sorted=True)  # [R, k_max]
    groups: dict[tuple[str, ...], list[int]] = {}
    for j, r in enumerate(rows):
        tail = samplers[r]._stages[samplers[r]._lead + 1 :]
        if _BATCHABLE.issuperset(tail):
            groups.setdefault(tail, []).append(j)
        else:
            b.pre[r] = (vals[j], ids[j])
    sub_lse = _rows(b.lse[:, None], rows).squeeze(1)
    for tail, js in groups.items():
        sel = torch.tensor(js, dtype=torch.long, device=logits.device) if len(js) < len(rows) else None
        pick = (lambda t: t) if sel is None else (lambda t: t.index_select(0, sel))
        outs = _batched_after_top_k([samplers[rows[j]] for j in js], pick(vals), pick(ids), pick(raw_sub),
                                    pick(sub_lse), tail)
        for j, res in zip(js, outs):
            b.results[rows[j]] = res


def _any_row(b: _Batch, i: int) -> bool:
    return True


def _sample_chain(b: _Batch, rows: list[int]) -> None:
    """Every row left: :meth:`SequenceSampler._sample`, the full chain (with the top-k strategy's
    candidates where it left them)."""
    for i in rows:
        b.results[i] = b.samplers[i]._sample(b.logits[i], b.histories[i], b.num_generated[i], b.masks[i], b.lse[i],
                                             b.pre.get(i))


#: :func:`sample_batch`'s strategies, tried in this order on the rows not sampled yet; the last
#: takes every row, so each row gets a result.
STRATEGIES: tuple[_Strategy, ...] = (
    _Strategy("greedy", _plain_greedy, _sample_greedy),
    _Strategy("greedy_without_eog", _greedy_banning_eog, _sample_greedy_without_eog),
    _Strategy("top_k", _top_k_first, _sample_top_k),
    _Strategy("chain", _any_row, _sample_chain),
)


def _one_eog_ban(samplers: list[SequenceSampler], num_generated: list[int], masks: list,
                 device: torch.device) -> torch.Tensor | None:
    """The EOG ids (int64 tensor) when every row is taken by the ``greedy_without_eog`` strategy (not
    plain greedy, greedy with its EOG ids banned, no mask) and all rows ban the same ids, else None:
    then one native pass with that ban serves the whole batch (the greedy streams of ``ignore_eos``
    benchmarks and ``min_tokens`` requests)."""
    eog = None
    for smp, n, mask in zip(samplers, num_generated, masks):
        if mask is not None or smp.is_plain_greedy(n) or not smp.is_greedy_without_eog(n):
            return None
        if eog is None:
            eog = smp.eog_token_ids
        elif smp.eog_token_ids != eog:
            return None
    return None if eog is None else samplers[0].eog_index(device)


def sample_batch(
    logits: torch.Tensor,
    samplers: list[SequenceSampler],
    histories: list[Sequence[int]],
    num_generated: list[int],
    masks: list[torch.Tensor | None] | None = None,
) -> list[SampleResult]:
    """Sample one token for each row of a decode batch.

    Args:
        logits: float32 [B, n_vocab] (any device).
        samplers: B per-request samplers.
        histories: B token lists (prompt + generated so far).
        num_generated: B counts of generated tokens.
        masks: optional B entries of bool [n_vocab] or None.

    Returns:
        B SampleResults, in row order, the same as calling
        :meth:`SequenceSampler.sample` row by row (up to float rounding). The rows go
        through :data:`STRATEGIES` in order, each taking the rows it applies to:

        - ``greedy``: plain greedy rows (:meth:`SequenceSampler.is_plain_greedy`): the
          native pass's argmax, else one batched argmax;
        - ``greedy_without_eog``: greedy rows with an EOG ban and nothing else
          (:meth:`SequenceSampler.is_greedy_without_eog`): the same with the EOG ids excluded;
        - ``top_k``: rows whose first active stage is ``top_k``: one batched ``torch.topk``;
          when the rest of their chain is only top_p / min_p / temperature (llama-server's
          defaults) the whole chain and the draw run batched on [R, k] tensors;
        - ``chain``: every other row goes through the per-row chain.
    """
    bsz = logits.shape[0]
    if not (len(samplers) == len(histories) == len(num_generated) == bsz):
        raise ValueError("sample_batch: samplers, histories and num_generated must have B entries")
    logits = logits.to(torch.float32)
    fast = _native_stats(logits)
    masks = masks if masks is not None else [None] * bsz
    stats = banned = None
    if fast is not None:  # one native pass per row (see _native_stats)
        logits = logits.contiguous()
        ban = _one_eog_ban(samplers, num_generated, masks, logits.device)
        if ban is not None:  # every row greedy under one EOG ban: that pass alone (its lse bans nothing)
            banned = fast(logits, ban)
            lse = banned[2]
        else:
            stats = fast(logits, _NO_BAN)
            lse = stats[2]
    else:
        lse = torch.logsumexp(logits, dim=-1)  # [B]
    b = _Batch(logits, samplers, histories, num_generated, masks, lse, fast, stats, [None] * bsz, {}, banned)
    for strategy in STRATEGIES:
        rows = [i for i in range(bsz) if b.results[i] is None and strategy.applies(b, i)]
        if rows:
            strategy.sample(b, rows)
    return b.results  # type: ignore[return-value]


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, n_top: int, chunk_rows: int = 256
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-softmax logprobs of given tokens plus the top candidates (prompt logprobs).

    Args:
        logits: float [T, V], row t predicts ``token_ids[t]``.
        token_ids: int [T].
        n_top: number of top candidates per row (0 = none).
        chunk_rows: rows per log-softmax chunk (bounds temporary memory to
            chunk_rows * V float32).

    Returns:
        ``(logprobs float32 [T], top_ids int64 [T, n_top], top_logprobs float32
        [T, n_top])`` on the logits' device; top entries in descending order.
    """
    t, v = logits.shape
    n_top = max(0, min(int(n_top), v))
    dev = logits.device
    token_ids = token_ids.to(device=dev, dtype=torch.long)
    lps = torch.empty(t, dtype=torch.float32, device=dev)
    top_ids = torch.empty((t, n_top), dtype=torch.long, device=dev)
    top_lps = torch.empty((t, n_top), dtype=torch.float32, device=dev)
    for s in range(0, t, chunk_rows):
        e = min(t, s + chunk_rows)
        ls = torch.log_softmax(logits[s:e].to(torch.float32), dim=-1)
        lps[s:e] = ls.gather(1, token_ids[s:e, None]).squeeze(1)
        if n_top:
            tv, ti = torch.topk(ls, n_top, dim=-1)
            top_ids[s:e] = ti
            top_lps[s:e] = tv
    return lps, top_ids, top_lps
