"""Unit tests for kvserve.engine.sampler (llama.cpp sampler chain semantics).

Small hand-made logits; expected values computed by hand from llama.cpp's
formulas (src/llama-sampling.cpp).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.engine.request import InvalidRequestError, SamplingParams
from kvserve.engine.sampler import (
    SampleResult,
    SamplingError,
    SequenceSampler,
    compute_logprobs,
    resolve_sampler_names,
    sample_batch,
    sampler_names_from_chars,
)

V = 8
PROBS = [0.35, 0.25, 0.15, 0.1, 0.06, 0.04, 0.03, 0.02]  # sums to 1


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


def params(**kw) -> SamplingParams:
    """No filters, temperature 1, fixed seed, post-sampling probs of all candidates."""
    base = dict(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0, seed=1234, n_probs=V, post_sampling_probs=True)
    base.update(kw)
    return SamplingParams(**base)


def survivors(p: SamplingParams, logits: torch.Tensor, history=(), eog=frozenset(), **kw) -> list[int]:
    s = SequenceSampler(p, V, eog, **kw)
    r = s.sample(logits, list(history), 0)
    return [t for t, _ in r.top]


def post_logprobs(p: SamplingParams, logits: torch.Tensor, history=(), token_texts=None) -> dict[int, float]:
    s = SequenceSampler(p, V, frozenset(), token_texts)
    r = s.sample(logits, list(history), 0)
    return dict(r.top)


# ---------------------------------------------------------------- greedy / seeds


def test_greedy_picks_argmax_and_raw_logprob():
    x = torch.tensor([0.1, 2.0, 0.5, -1.0, 0.0, 1.9, 0.3, 0.2])
    s = SequenceSampler(SamplingParams(temperature=0.0), V, frozenset())
    r = s.sample(x, [], 0)
    assert isinstance(r, SampleResult)
    assert r.token_id == 1
    assert r.logprob == pytest.approx(torch.log_softmax(x, 0)[1].item(), abs=1e-6)
    assert r.top is None


def test_greedy_post_sampling_is_certain():
    x = torch.tensor([0.1, 2.0, 0.5, -1.0, 0.0, 1.9, 0.3, 0.2])
    r = SequenceSampler(SamplingParams(temperature=0.0, n_probs=3, post_sampling_probs=True), V, frozenset()).sample(
        x, [], 0
    )
    assert r.token_id == 1 and r.logprob == pytest.approx(0.0) and r.top == [(1, pytest.approx(0.0))]


def test_greedy_still_applies_penalties():
    # llama.cpp: temp <= 0 is the temperature stage keeping the max; penalties run before it.
    x = torch.tensor([0.0, 2.0, 1.9, 0.0, 0.0, 0.0, 0.0, 0.0])
    s = SequenceSampler(SamplingParams(temperature=0.0, repeat_penalty=1.1), V, frozenset())
    assert s.sample(x, [1], 0).token_id == 2  # 2.0 / 1.1 = 1.818 < 1.9


def test_same_seed_same_tokens_different_seeds_differ():
    torch.manual_seed(0)
    rows = [torch.randn(V) for _ in range(50)]
    p = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a = SequenceSampler(SamplingParams(seed=7, **p), V, frozenset())
    b = SequenceSampler(SamplingParams(seed=7, **p), V, frozenset())
    c = SequenceSampler(SamplingParams(seed=8, **p), V, frozenset())
    ta = [a.sample(x, [], 0).token_id for x in rows]
    tb = [b.sample(x, [], 0).token_id for x in rows]
    tc = [c.sample(x, [], 0).token_id for x in rows]
    assert ta == tb
    assert ta != tc
    assert a.seed == 7


def test_random_seed_is_chosen():
    a = SequenceSampler(SamplingParams(), V, frozenset())
    b = SequenceSampler(SamplingParams(), V, frozenset())
    assert 0 <= a.seed < 2**32 and a.seed != b.seed  # 1 in 2**32 chance of a false failure


def test_top_k_1_equals_greedy():
    torch.manual_seed(1)
    for _ in range(20):
        x = torch.randn(V)
        s = SequenceSampler(SamplingParams(top_k=1, temperature=1.5, seed=3), V, frozenset())
        assert s.sample(x, [], 0).token_id == int(x.argmax())


def test_sampling_follows_distribution():
    x = logits_of([0.7, 0.2, 0.1, 1e-9, 1e-9, 1e-9, 1e-9, 1e-9])
    s = SequenceSampler(params(n_probs=0, post_sampling_probs=False, seed=5), V, frozenset())
    counts = [0] * V
    for _ in range(2000):
        counts[s.sample(x, [], 0).token_id] += 1
    assert 0.64 < counts[0] / 2000 < 0.76
    assert 0.16 < counts[1] / 2000 < 0.24
    assert sum(counts[3:]) == 0


# ---------------------------------------------------------------- filters


def test_top_p_keeps_exact_prefix():
    # cumulative 0.35, 0.60, 0.75 >= 0.7 -> keep three, renormalised
    r = SequenceSampler(params(top_p=0.7), V, frozenset()).sample(logits_of(PROBS), [], 0)
    assert [t for t, _ in r.top] == [0, 1, 2]
    for t, lp in r.top:
        assert lp == pytest.approx(math.log(PROBS[t] / 0.75), abs=1e-5)
    assert r.logprob == pytest.approx(dict(r.top)[r.token_id])


def test_min_p_keeps_tokens_above_fraction_of_max():
    # keep p >= 0.2 * 0.35 = 0.07 -> 0.35, 0.25, 0.15, 0.10
    assert survivors(params(min_p=0.2), logits_of(PROBS)) == [0, 1, 2, 3]


def test_typical_p():
    # H = 1.7098; |-ln p - H| order: 2 (0.187), 1 (0.324), 3 (0.593), 0 (0.660) ...
    # cumulative 0.15, 0.40, 0.50 > 0.45 -> keep {2, 1, 3}
    assert sorted(survivors(params(typical_p=0.45), logits_of(PROBS))) == [1, 2, 3]


def test_top_n_sigma():
    # logits 5,4,3,0*5: mean 1.5, std 2 -> keep logit >= 5 - 1*2 = 3
    x = torch.tensor([5.0, 4.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert survivors(params(top_n_sigma=1.0), x) == [0, 1, 2]
    # n = 2: 5 - 4 = 1 still drops the zeros; n = 3: 5 - 6 = -1 keeps everything
    assert survivors(params(top_n_sigma=2.0), x) == [0, 1, 2]
    assert len(survivors(params(top_n_sigma=3.0), x)) == 8


def test_xtc_removes_top_choices_but_the_last_above_threshold():
    # probs >= 0.12: 0.35, 0.25, 0.15 -> remove the first two, keep 2..7
    p = params(xtc_probability=1.0, xtc_threshold=0.12)
    assert survivors(p, logits_of(PROBS)) == [2, 3, 4, 5, 6, 7]
    # threshold above 0.5 disables it (llama.cpp)
    assert len(survivors(params(xtc_probability=1.0, xtc_threshold=0.6), logits_of(PROBS))) == 8
    # only one token above the threshold: nothing removed
    assert len(survivors(params(xtc_probability=1.0, xtc_threshold=0.3), logits_of(PROBS))) == 8


def test_xtc_probability_uses_rng():
    p = params(xtc_probability=0.5, xtc_threshold=0.12, seed=11)
    s = SequenceSampler(p, V, frozenset())
    sizes = [len(s.sample(logits_of(PROBS), [], 0).top) for _ in range(200)]
    assert set(sizes) == {6, 8}
    assert 60 < sizes.count(6) < 140


def test_default_chain_top_k_top_p_min_p_temperature():
    # default order: top_k 40, top_p 0.95 (cum 0.95 at token 5), min_p 0.05 (>= 0.0175: drops 0.02)
    # then temperature 0.8 reshapes the survivors.
    p = SamplingParams(seed=1, n_probs=V, post_sampling_probs=True)
    r = SequenceSampler(p, V, frozenset()).sample(logits_of(PROBS), [], 0)
    ids = [t for t, _ in r.top]
    assert ids == [0, 1, 2, 3, 4, 5]
    w = [PROBS[i] ** (1 / 0.8) for i in ids]
    for (t, lp), wi in zip(r.top, w):
        assert lp == pytest.approx(math.log(wi / sum(w)), abs=1e-5)


def test_sampler_order_matters():
    # top_p then temperature(2): keeps 3; temperature(2) first flattens -> keeps 4
    x = logits_of(PROBS)
    a = survivors(params(top_p=0.7, temperature=2.0), x)
    b = survivors(params(top_p=0.7, temperature=2.0, samplers=("temperature", "top_p")), x)
    assert a == [0, 1, 2]
    assert b == [0, 1, 2, 3]


def test_sampler_aliases_and_unknown_names():
    assert resolve_sampler_names(["top-k", "typical", "typ-p", "nucleus", "temp", "min-p", "top-n-sigma"]) == (
        "top_k",
        "typ_p",
        "typ_p",
        "top_p",
        "temperature",
        "min_p",
        "top_n_sigma",
    )
    assert sampler_names_from_chars("edskypmxt") == (
        "penalties",
        "dry",
        "top_n_sigma",
        "top_k",
        "typ_p",
        "top_p",
        "min_p",
        "xtc",
        "temperature",
    )
    with pytest.raises(InvalidRequestError):
        SequenceSampler(SamplingParams(samplers=("top_k", "bogus")), V, frozenset())
    with pytest.raises(InvalidRequestError):
        SequenceSampler(SamplingParams(samplers=("infill",)), V, frozenset())
    s = SequenceSampler(SamplingParams(samplers=("top-k", "temp")), V, frozenset())
    assert s.chain == ("top_k", "temperature")


# ---------------------------------------------------------------- penalties


def test_repeat_presence_frequency_penalties():
    x = torch.tensor([2.0, -1.0, 0.5, 0.0, 0.3, 0.0, 0.0, 0.0])
    p = params(repeat_penalty=1.5, frequency_penalty=0.1, presence_penalty=0.2, repeat_last_n=64)
    lp = post_logprobs(p, x, history=[0, 0, 1, 3])
    # expected penalised logits (token 2 untouched, 0.5):
    #   0: count 2, 2.0 > 0 -> 2.0 / 1.5 - (2 * 0.1 + 0.2) = 0.933333
    #   1: count 1, -1.0 <= 0 -> -1.0 * 1.5 - (0.1 + 0.2) = -1.8
    #   3: count 1, 0.0 <= 0 -> 0.0 * 1.5 - 0.3 = -0.3
    assert lp[0] - lp[2] == pytest.approx(2.0 / 1.5 - 0.4 - 0.5, abs=1e-5)
    assert lp[1] - lp[2] == pytest.approx(-1.8 - 0.5, abs=1e-5)
    assert lp[3] - lp[2] == pytest.approx(-0.3 - 0.5, abs=1e-5)
    assert lp[4] - lp[2] == pytest.approx(0.3 - 0.5, abs=1e-5)


def test_penalty_window_is_last_repeat_last_n_of_history():
    x = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    p = params(repeat_penalty=2.0, repeat_last_n=2)
    lp = post_logprobs(p, x, history=[0, 1, 2])  # token 0 is outside the window
    assert lp[0] - lp[3] == pytest.approx(1.0, abs=1e-5)
    assert lp[1] - lp[3] == pytest.approx(0.5, abs=1e-5)
    assert lp[2] - lp[3] == pytest.approx(0.5, abs=1e-5)
    # repeat_last_n = 0 disables; -1 uses the whole history
    lp0 = post_logprobs(params(repeat_penalty=2.0, repeat_last_n=0), x, history=[0, 1, 2])
    assert lp0[0] - lp0[3] == pytest.approx(1.0, abs=1e-5)
    lpa = post_logprobs(params(repeat_penalty=2.0, repeat_last_n=-1), x, history=[0, 1, 2])
    assert lpa[0] - lpa[3] == pytest.approx(0.5, abs=1e-5)


def test_penalties_after_top_k_only_touch_candidates():
    x = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0])
    p = params(top_k=3, repeat_penalty=2.0, samplers=("top_k", "penalties", "temperature"))
    lp = post_logprobs(p, x, history=[0, 7])
    assert sorted(lp) == [0, 1, 2]
    assert lp[0] - lp[1] == pytest.approx(1.5 - 2.0, abs=1e-5)


# ---------------------------------------------------------------- DRY


def texts(tid: int) -> str:
    return {5: "\n"}.get(tid, f"t{tid}")


def test_dry_penalises_repeated_continuation():
    x = torch.zeros(V)
    p = params(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2)
    # ... 1 2 3 4 ... 1 2 3 -> continuing with 4 repeats "1 2 3" (n = 3): 0.8 * 1.75 ** (3 - 2) = 1.4
    lp = post_logprobs(p, x, history=[1, 2, 3, 4, 6, 1, 2, 3], token_texts=texts)
    assert lp[4] - lp[0] == pytest.approx(-1.4, abs=1e-5)
    for t in (0, 1, 2, 3, 6, 7):
        assert lp[t] == pytest.approx(lp[0], abs=1e-6)


def test_dry_longest_match_and_sequence_breaker():
    x = torch.zeros(V)
    hist = [1, 5, 2, 3, 4, 1, 5, 2, 3]
    p = params(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2)
    # no breakers: "1 5 2 3" repeats (n = 4): 0.8 * 1.75 ** 2 = 2.45
    lp = post_logprobs(p, x, history=hist, token_texts=None)
    assert lp[4] - lp[0] == pytest.approx(-2.45, abs=1e-5)
    # token 5 is "\n" (a default breaker): matches stop there, n = 2: 0.8 * 1.75 ** 0 = 0.8
    lp = post_logprobs(p, x, history=hist, token_texts=texts)
    assert lp[4] - lp[0] == pytest.approx(-0.8, abs=1e-5)


def test_dry_short_repeat_and_breaker_token_not_penalised():
    x = torch.zeros(V)
    p = params(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2)
    # "2 3" then 5 ("\n", a breaker) earlier; the repeat "2 3" would continue with 5: not penalised
    lp = post_logprobs(p, x, history=[1, 2, 3, 5, 7, 2, 3], token_texts=texts)
    assert lp[5] == pytest.approx(lp[0], abs=1e-6)
    # a repeat shorter than allowed_length is free
    lp = post_logprobs(p, x, history=[1, 2, 4, 7, 2], token_texts=texts)
    assert lp[4] == pytest.approx(lp[0], abs=1e-6)
    # dry_multiplier 0 (default) is off
    lp = post_logprobs(params(), x, history=[1, 2, 3, 4, 6, 1, 2, 3], token_texts=texts)
    assert lp[4] == pytest.approx(lp[0], abs=1e-6)


def test_dry_penalty_last_n_limits_window():
    x = torch.zeros(V)
    p = params(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2, dry_penalty_last_n=4)
    lp = post_logprobs(p, x, history=[1, 2, 3, 4, 6, 1, 2, 3], token_texts=texts)
    assert lp[4] == pytest.approx(lp[0], abs=1e-6)


# ---------------------------------------------------------------- bias, eog, mask


def test_logit_bias_ban_and_boost():
    x = torch.tensor([0.1, 2.0, 0.5, -1.0, 0.0, 1.9, 0.3, 0.2])
    s = SequenceSampler(SamplingParams(temperature=0.0, logit_bias={1: float("-inf")}), V, frozenset())
    assert s.sample(x, [], 0).token_id == 5
    s = SequenceSampler(SamplingParams(temperature=0.0, logit_bias={3: 3.5}), V, frozenset())
    assert s.sample(x, [], 0).token_id == 3
    # banned token never sampled at high temperature
    s = SequenceSampler(params(temperature=5.0, logit_bias={1: float("-inf")}, n_probs=0), V, frozenset())
    assert all(s.sample(x, [], 0).token_id != 1 for _ in range(200))


def test_ignore_eos_and_min_tokens_ban_eog():
    x = torch.tensor([0.1, 2.0, 0.5, -1.0, 0.0, 1.9, 0.3, 0.2])
    eog = frozenset({1})
    assert SequenceSampler(SamplingParams(temperature=0.0), V, eog).sample(x, [], 0).token_id == 1
    assert SequenceSampler(SamplingParams(temperature=0.0, ignore_eos=True), V, eog).sample(x, [], 5).token_id == 5
    s = SequenceSampler(SamplingParams(temperature=0.0, min_tokens=2), V, eog)
    assert s.sample(x, [], 1).token_id == 5
    assert s.sample(x, [], 2).token_id == 1


def test_mask_restricts_candidates():
    x = torch.tensor([0.1, 2.0, 0.5, -1.0, 0.0, 1.9, 0.3, 0.2])
    mask = torch.zeros(V, dtype=torch.bool)
    mask[[3, 6]] = True
    assert SequenceSampler(SamplingParams(temperature=0.0), V, frozenset()).sample(x, [], 0, mask).token_id == 6
    s = SequenceSampler(params(temperature=3.0), V, frozenset())
    for _ in range(50):
        r = s.sample(x, [], 0, mask)
        assert r.token_id in (3, 6) and sorted(t for t, _ in r.top) == [3, 6]
    # raw logprob is still from the unmasked softmax
    r = SequenceSampler(SamplingParams(temperature=0.0), V, frozenset()).sample(x, [], 0, mask)
    assert r.logprob == pytest.approx(torch.log_softmax(x, 0)[6].item(), abs=1e-6)


def test_mask_allowing_only_eog_lets_it_finish_and_empty_mask_raises():
    x = torch.zeros(V)
    mask = torch.zeros(V, dtype=torch.bool)
    mask[1] = True
    s = SequenceSampler(SamplingParams(temperature=0.0, ignore_eos=True), V, frozenset({1}))
    assert s.sample(x, [], 0, mask).token_id == 1
    with pytest.raises(SamplingError):
        s.sample(x, [], 0, torch.zeros(V, dtype=torch.bool))


def test_raw_top_probs_are_pre_sampling():
    x = logits_of(PROBS)
    r = SequenceSampler(SamplingParams(top_k=2, n_probs=4, seed=2), V, frozenset()).sample(x, [], 0)
    assert [t for t, _ in r.top] == [0, 1, 2, 3]
    for t, lp in r.top:
        assert lp == pytest.approx(math.log(PROBS[t]), abs=1e-5)
    assert r.logprob == pytest.approx(math.log(PROBS[r.token_id]), abs=1e-5)


# ---------------------------------------------------------------- batch / helpers


def test_sample_batch_matches_per_row_sample():
    torch.manual_seed(3)
    n_vocab = 1000
    mask = torch.ones(n_vocab, dtype=torch.bool)
    mask[:500] = False
    cfgs = [
        (dict(temperature=0.0), None),  # fast path
        (dict(temperature=0.0, repeat_penalty=1.3), None),  # greedy with penalties
        (dict(seed=10), None),  # defaults: batched top_k + batched chain
        (dict(seed=11, top_k=5, n_probs=3), None),  # raw probs
        (dict(seed=12, top_k=0, typical_p=0.9, post_sampling_probs=True, n_probs=2), None),  # per-row
        (dict(temperature=0.0), mask),  # greedy with a mask
        (dict(seed=13, repeat_penalty=1.5, frequency_penalty=0.5), None),  # penalties then batched
        (dict(seed=14, logit_bias={7: 5.0}, n_probs=2, post_sampling_probs=True), mask),  # bias + mask
        (dict(seed=15, ignore_eos=True, typical_p=0.8, top_k=20), None),  # eog ban, per-row tail
        (dict(seed=16, dry_multiplier=0.8, temperature=1.3, top_p=0.5, samplers=("dry", "top_k", "temperature", "top_p")), None),
        (dict(seed=17, temperature=0.0, n_probs=2), None),  # greedy but not plain
    ]
    b_rows = len(cfgs)
    logits = torch.randn(b_rows, n_vocab) * 3
    hists = [[(7 * i + j) % n_vocab for j in range(12)] + [1, 2, 3, 1, 2] for i in range(b_rows)]
    hists[1] = [int(logits[1].argmax())]
    eog = frozenset({int(logits[8].argmax())})
    masks = [m for _, m in cfgs]
    for _ in range(3):
        a = [SequenceSampler(SamplingParams(**c), n_vocab, eog) for c, _ in cfgs]
        b = [SequenceSampler(SamplingParams(**c), n_vocab, eog) for c, _ in cfgs]
        got = sample_batch(logits, a, hists, [0] * b_rows, masks)
        want = [b[i].sample(logits[i], hists[i], 0, masks[i]) for i in range(b_rows)]
        for g, w in zip(got, want):
            assert g.token_id == w.token_id
            assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
            assert (g.top is None) == (w.top is None)
            if g.top is not None:
                assert [t for t, _ in g.top] == [t for t, _ in w.top]
                assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=1e-5)
    assert got[0].token_id == int(logits[0].argmax())
    assert got[5].token_id == int((logits[5] + torch.where(mask, 0.0, float("-inf"))).argmax())
    assert got[8].token_id not in eog
    assert a[0].is_plain_greedy(0) and not a[1].is_plain_greedy(0) and not a[10].is_plain_greedy(0)


def test_sample_batch_distribution_matches_per_row():
    # many draws: the batched default chain and the per-row chain give the same tokens
    torch.manual_seed(5)
    logits = torch.randn(4, 50)
    a = [SequenceSampler(SamplingParams(seed=100 + i, temperature=1.5), 50, frozenset()) for i in range(4)]
    b = [SequenceSampler(SamplingParams(seed=100 + i, temperature=1.5), 50, frozenset()) for i in range(4)]
    for _ in range(100):
        got = [r.token_id for r in sample_batch(logits, a, [[]] * 4, [0] * 4)]
        want = [b[i].sample(logits[i], [], 0).token_id for i in range(4)]
        assert got == want


def test_compute_logprobs():
    torch.manual_seed(4)
    logits = torch.randn(5, 11)
    ids = torch.tensor([0, 3, 10, 2, 2])
    lp, ti, tl = compute_logprobs(logits, ids, 3, chunk_rows=2)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(lp, ref[torch.arange(5), ids], atol=1e-6)
    rv, ri = torch.topk(ref, 3, dim=-1)
    assert torch.equal(ti, ri) and torch.allclose(tl, rv, atol=1e-6)
    lp0, ti0, tl0 = compute_logprobs(logits, ids, 0)
    assert ti0.shape == (5, 0) and tl0.shape == (5, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    torch.manual_seed(6)
    n_vocab = 4096
    logits = torch.randn(4, n_vocab) * 3
    mask = torch.rand(n_vocab) > 0.5
    cfgs = [dict(seed=1), dict(seed=2, repeat_penalty=1.2, n_probs=3), dict(temperature=0.0), dict(seed=3, top_k=0)]
    masks = [None, mask, None, None]
    hists = [[1, 2, 3]] * 4
    for dev_masks, dev_logits in ((masks, logits), ([m.cuda() if m is not None else None for m in masks], logits.cuda())):
        ss = [SequenceSampler(SamplingParams(**c), n_vocab, frozenset({5})) for c in cfgs]
        res = [sample_batch(dev_logits, ss, hists, [0] * 4, dev_masks) for _ in range(5)]
        ss = [SequenceSampler(SamplingParams(**c), n_vocab, frozenset({5})) for c in cfgs]
        res_row = [[ss[i].sample(dev_logits[i], hists[i], 0, dev_masks[i]) for i in range(4)] for _ in range(5)]
        if dev_logits.is_cuda:
            cuda_tokens = [[r.token_id for r in step] for step in res]
            assert cuda_tokens == [[r.token_id for r in step] for step in res_row]
        else:
            cpu_tokens = [[r.token_id for r in step] for step in res]
    assert cuda_tokens == cpu_tokens
    lp, ti, tl = compute_logprobs(logits.cuda(), torch.tensor([0, 1, 2, 3]).cuda(), 2)
    assert lp.is_cuda and ti.shape == (4, 2)


@pytest.mark.parametrize("scale", [8.0, 0.5])  # peaky: top 256 reach p; flat: full sort
def test_top_p_large_vocab_matches_bruteforce(scale):
    torch.manual_seed(7)
    n_vocab = 3000
    x = torch.randn(n_vocab) * scale
    p = SamplingParams(top_k=0, top_p=0.9, min_p=0.0, temperature=1.0, seed=1, n_probs=n_vocab, post_sampling_probs=True)
    r = SequenceSampler(p, n_vocab, frozenset()).sample(x, [], 0)
    probs, order = torch.sort(torch.softmax(x, 0), descending=True)
    keep = int((torch.cumsum(probs, 0) < 0.9).sum()) + 1
    assert sorted(t for t, _ in r.top) == sorted(order[:keep].tolist())


def test_sample_batch_picks_each_strategy_where_expected(monkeypatch):
    """Each row of a batch goes to the first strategy of ``STRATEGIES`` that applies to it (issue
    #33: the fast paths as a list); a greedy row whose top is tied under an EOG ban falls through."""
    import dataclasses as dc

    from kvserve.engine import sampler as smod

    picked: dict[int, str] = {}

    def recording(st):
        def sample(b, rows):
            before = [b.results[r] for r in rows]
            st.sample(b, rows)
            for r, was in zip(rows, before):
                if was is None and b.results[r] is not None:
                    picked[r] = st.name
        return dc.replace(st, sample=sample)

    assert [s.name for s in smod.STRATEGIES] == ["greedy", "greedy_without_eog", "top_k", "chain"]
    monkeypatch.setattr(smod, "STRATEGIES", tuple(recording(s) for s in smod.STRATEGIES))
    n_vocab = 200
    logits = torch.randn(6, n_vocab, generator=torch.Generator().manual_seed(5))
    logits[4, 10] = logits[4, 11] = logits[4].max() + 1.0  # a tie for the top: left for the chain
    eog = frozenset({0})
    cfgs = [
        dict(temperature=0.0),  # greedy
        dict(temperature=0.0, ignore_eos=True),  # greedy_without_eog
        dict(seed=1),  # llama-server's defaults: top_k first, batched tail
        dict(seed=2, top_k=0, typical_p=0.9),  # no top_k: the chain
        dict(temperature=0.0, ignore_eos=True),  # tied: greedy_without_eog leaves it, top_k takes it
        dict(seed=3, top_k=8, typical_p=0.5),  # top_k first, a tail it cannot batch: candidates for the chain
    ]
    samplers = [SequenceSampler(SamplingParams(**c), n_vocab, eog) for c in cfgs]
    out = sample_batch(logits, samplers, [[1, 2, 3]] * 6, [0] * 6, None)
    assert picked == {0: "greedy", 1: "greedy_without_eog", 2: "top_k", 3: "chain", 4: "top_k", 5: "chain"}
    assert out[0].token_id == int(logits[0].argmax()) and out[4].token_id in (10, 11)
