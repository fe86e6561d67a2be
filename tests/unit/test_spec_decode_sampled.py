"""Sampled speculation: the rejection rule (spec_decode.speculative_accept) keeps the target's
distribution at every position, for prompt lookup's point-mass drafts and a draft model's q,
measured over many draws with fixed seeds on toy distributions over 6 tokens; the sampler
chain's distribution (SequenceSampler.probs); seeds reproducible; greedy rows exact."""

import numpy as np
import pytest
import torch

from kvserve.engine.request import SamplingParams
from kvserve.engine.sampler import SequenceSampler
from kvserve.engine.spec_decode import accepted_prefix, draw, speculative_accept

V = 6
P = torch.tensor([[0.05, 0.30, 0.10, 0.25, 0.20, 0.10],
                  [0.40, 0.10, 0.00, 0.10, 0.30, 0.10],
                  [0.10, 0.10, 0.10, 0.10, 0.10, 0.50]])
Q = torch.tensor([[0.50, 0.10, 0.10, 0.10, 0.10, 0.10],
                  [0.05, 0.05, 0.60, 0.10, 0.10, 0.10]])
N = 20000
#: 4.5 standard deviations of a frequency near 0.5 over N draws
TOL = 4.5 * (0.25 / N) ** 0.5


def _freq(samples, n=V):
    return np.bincount(np.asarray(samples, dtype=np.int64), minlength=n) / max(len(samples), 1)


def test_draw_inverse_cdf_exact_points():
    p = torch.tensor([0.0, 0.25, 0.0, 0.75])
    assert [draw(p, u) for u in (0.0, 0.2499, 0.25, 0.99, 0.999999999)] == [1, 1, 3, 3, 3]
    assert draw(torch.tensor([0.0, 0.0, 2.0]), 0.5) == 2  # not normalized


@pytest.mark.parametrize("with_q", [False, True], ids=["point-mass", "draft-q"])
def test_rejection_rule_keeps_the_target_distribution(with_q):
    g = torch.Generator().manual_seed(1234)
    first, second, accepted = [], [], 0
    # drafts: prompt lookup proposes a fixed continuation [3, 2] (p[1][2] == 0: always rejected
    # there); a draft model draws each token from its q
    for _ in range(N):
        if with_q:
            d = [int(torch.multinomial(Q[0], 1, generator=g)), int(torch.multinomial(Q[1], 1, generator=g))]
        else:
            d = [3, 2]
        out = speculative_accept(P, d, Q if with_q else None, g)
        a = accepted_prefix(d, out)
        assert len(out) == a + 1 and out[:a] == d[:a] and (a == 2 or out[a] != d[a])
        first.append(out[0])
        if len(out) > 1:
            second.append(out[1])  # the toy's p_1 does not depend on the first token
        accepted += a
    f1 = _freq(first)
    assert np.abs(f1 - P[0].numpy()).max() < TOL, f1
    f2 = _freq(second)
    assert np.abs(f2 - P[1].numpy()).max() < 4.5 * (0.25 / len(second)) ** 0.5, f2
    assert f2[2] == 0.0  # a token of probability 0 is never output
    if not with_q:
        # point mass: the first draft token is accepted with probability p(3) = 0.25
        assert abs(accepted / N - 0.25) < TOL


def test_rejection_rule_exact_when_the_draft_is_the_target():
    # q == p: every draft token is accepted (min(1, p/q) = 1), the bonus token from the last row
    g = torch.Generator().manual_seed(5)
    for _ in range(200):
        d = [int(torch.multinomial(P[0], 1, generator=g)), int(torch.multinomial(P[1], 1, generator=g))]
        out = speculative_accept(P, d, P[:2], g)
        assert out[:2] == d and len(out) == 3


def test_the_same_seed_gives_the_same_tokens():
    runs = []
    for _ in range(2):
        g = torch.Generator().manual_seed(99)
        runs.append([tuple(speculative_accept(P, [1, 4], None, g)) for _ in range(50)])
    assert runs[0] == runs[1]


def test_chain_distribution_top_k_temperature_and_min_p():
    logits = torch.tensor([2.0, 1.0, 0.5, 3.0, -1.0, 0.0])
    s = SequenceSampler(SamplingParams(temperature=0.5, top_k=3, top_p=1.0, min_p=0.0), V, frozenset({0}))
    assert s.speculates_sampled
    p = s.probs(logits, 5)
    ref = torch.zeros(V)
    top = torch.tensor([3, 0, 1])
    ref[top] = torch.softmax(logits[top] / 0.5, dim=0)
    assert torch.allclose(p, ref, atol=1e-6)
    # min_tokens bans EOG (token 0) while fewer were generated
    s2 = SequenceSampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, min_tokens=3), V,
                         frozenset({0}))
    assert float(s2.probs(logits, 1)[0]) == 0.0 and float(s2.probs(logits, 3)[0]) > 0.0
    # the chain's distribution is what sample() draws from
    g_counts = np.zeros(V)
    s3 = SequenceSampler(SamplingParams(temperature=0.8, top_k=4, top_p=0.95, min_p=0.05, seed=3), V, frozenset())
    for _ in range(4000):
        g_counts[s3.sample(logits, [], 0).token_id] += 1
    assert np.abs(g_counts / 4000 - s3.probs(logits, 0).numpy()).max() < 4.5 * (0.25 / 4000) ** 0.5


def test_which_chains_speculate_sampled():
    mk = lambda **kw: SequenceSampler(SamplingParams(**kw), V, frozenset())
    assert not mk(temperature=0.0).speculates_sampled
    assert mk(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05).speculates_sampled
    assert not mk(temperature=0.7, repeat_penalty=1.2).speculates_sampled  # history-dependent
    assert not mk(temperature=0.7, xtc_probability=0.5, xtc_threshold=0.1).speculates_sampled  # its own RNG
    assert not mk(temperature=0.7, n_probs=3).speculates_sampled
