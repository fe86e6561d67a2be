"""The draft-length policy of speculative decoding (``kvserve.engine.spec_decode``, issue #17 item
3): the exact K chosen for given acceptance estimates, batch sizes and acceptance histories, the
probe after repeated misses, the step's accounting across sequences, and greedy output
token-identical at 16 streams with the policy active."""

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine import spec_decode
from kvserve.engine.core import EngineCore
from kvserve.engine.request import Request, SamplingParams
from kvserve.engine.spec_decode import SpecConfig, SpecDecoder, draft_length
from kvserve.models.build import load_files

CPU = spec_decode.STEP_BASE_ROWS_CPU
GPU = spec_decode.STEP_BASE_ROWS_GPU


def test_constants():
    assert (CPU, GPU) == (8.0, 64.0)
    assert (spec_decode.CHUNK_ROWS_CPU, spec_decode.CHUNK_ROWS_GPU) == (1.0, 8.0)
    assert (spec_decode.PRIOR_HITS, spec_decode.PRIOR_MISSES, spec_decode.HISTORY_DECAY,
            spec_decode.RUN_CONTINUES, spec_decode.PROBE_TOKENS) == (4.0, 1.0, 0.5, 0.95, 16)


@pytest.mark.parametrize("alpha, ks", [
    (0.99, [15, 14, 13, 11, 9, 8]),
    (0.9, [15, 14, 12, 10, 8, 6]),
    (0.8, [15, 14, 12, 8, 6, 0]),
    (0.6, [14, 12, 9, 0, 0, 0]),
    (0.4, [13, 10, 0, 0, 0, 0]),
    (0.2, [9, 0, 0, 0, 0, 0]),
    (0.1, [0, 0, 0, 0, 0, 0]),
])
def test_k_by_hit_rate_and_batch_rows_cpu(alpha, ks):
    """Rows 1, 2, 4, 8, 12, 16 before drafts, the CPU's costs: long drafts at a few streams,
    shorter ones or none as the batch fills (compute-bound)."""
    assert [draft_length(alpha, 16, rows, CPU, chunk_rows=1.0) for rows in (1, 2, 4, 8, 12, 16)] == ks


def test_k_on_a_gpu_and_caps():
    assert [draft_length(0.8, 16, rows, GPU, chunk_rows=8.0) for rows in (1, 16, 64)] == [16, 16, 0]
    assert [draft_length(0.4, 16, rows, GPU, chunk_rows=8.0) for rows in (1, 16, 64)] == [16, 0, 0]
    assert draft_length(0.99, 5, 1, CPU, chunk_rows=1.0) == 5  # never more than proposed
    assert draft_length(1.0, 16, 16, CPU, chunk_rows=1.0) == 8  # later tokens' 0.95 ** i
    assert draft_length(0.0, 16, 1, CPU, chunk_rows=1.0) == 0
    # drafts already in the step raise the bar for the next sequence
    assert draft_length(0.9, 16, 4, CPU, chunk_rows=1.0) == 12
    gain = sum(0.9 * 0.95 ** i for i in range(12))
    assert draft_length(0.9, 16, 4, CPU, gain=gain, drafted=13.0, chunk_rows=1.0) == 10
    # no chunk cost and no run discount: the marginal rule with a geometric alpha ** i
    assert [draft_length(0.8, 16, rows, 4.0, run=0.8) for rows in (1, 2, 4, 8, 12, 16)] == [4, 3, 2, 1, 1, 0]


class _Req:
    """What SpecDecoder reads of a request: a token sequence that always proposes 16 tokens."""

    def __init__(self, rid):
        self.request_id, self.grammar = rid, None
        self.params = SamplingParams(temperature=0.0)
        self.toks = list(range(10, 50)) * 2  # period 40: the last n-gram is followed by 40 tokens

    @property
    def num_tokens(self):
        return len(self.toks)

    def token_at(self, i):
        return self.toks[i]

    def grow(self, n):
        for _ in range(n):
            self.toks.append(self.toks[-40])


def _decoder():
    dec = SpecDecoder(SpecConfig(method="ngram", num_speculative_tokens=16, prompt_lookup_min=2, prompt_lookup_max=4))
    assert (dec.base_rows, dec.chunk_rows, dec.adaptive) == (CPU, spec_decode.CHUNK_ROWS_CPU, True)
    return dec


def test_k_follows_the_hit_history_down_to_zero_and_probes_again():
    dec = _decoder()
    r = _Req("a")
    dec.register(r, plain_greedy=True)
    ks, alphas, runs = [], [], []
    dec.begin_step(1)
    ks.append(len(dec.propose(r, 16)))  # the prior: 0.8
    for proposed, accepted in [(16, 16), (16, 3), (15, 0), (15, 0), (15, 0), (15, 0), (15, 0)]:
        dec.observe("a", proposed, accepted)  # a partial acceptance is a hit too
        alphas.append(round(dec.alpha("a"), 4))
        r.grow(1)
        dec.begin_step(1)
        ks.append(len(dec.propose(r, 16)))
        runs.append(round(dec._seqs["a"].run, 4))
    assert alphas == [0.8571, 0.9091, 0.5263, 0.2857, 0.1493, 0.0763, 0.0386]
    # the run estimate: 15 tokens after the first accepted raise it from 0.95, a stop after 3 lowers it;
    # verifications accepting nothing leave it
    assert runs == [0.9742, 0.941, 0.941, 0.941, 0.941, 0.941, 0.941]
    assert ks == [15, 16, 14, 12, 10, 0, 0, 0]
    # no verification for PROBE_TOKENS tokens: the estimate goes back to the prior and it probes
    r.grow(spec_decode.PROBE_TOKENS - 4)  # 15 tokens after its last verification (the 10-token draft)
    dec.begin_step(1)
    assert dec.propose(r, 16) == [] and dec.alpha("a") < 0.04
    r.grow(1)
    dec.begin_step(1)
    assert len(dec.propose(r, 16)) == 15 and dec.alpha("a") == 0.8 and dec._seqs["a"].run == 0.95  # both priors


def test_one_step_shares_its_rows():
    dec = _decoder()
    reqs = [_Req(c) for c in "abcd"]
    for r in reqs:
        dec.register(r, plain_greedy=True)
    for _ in range(3):
        dec.observe("a", 16, 16)  # "a" keeps hitting, whole drafts: alpha 0.9474, run 0.9891
    assert round(dec.alpha("a"), 4) == 0.9474 and round(dec._seqs["a"].run, 4) == 0.9891
    # "a"'s 16-token draft (about 14 tokens expected) leaves no room a fresh sequence's draft would pay
    # for: at 4 rows a 6-token draft of "b" would bring the step from 0.620 to 0.617 tokens a row-unit
    dec.begin_step(4)
    assert [len(dec.propose(r, 16)) for r in reqs] == [16, 0, 0, 0]
    dec.begin_step(12)
    assert [len(dec.propose(r, 16)) for r in reqs] == [16, 0, 0, 0]
    dec.begin_step(16)  # 16 rows: compute-bound; only the sequence that keeps hitting drafts
    assert [len(dec.propose(r, 16)) for r in reqs] == [16, 0, 0, 0]
    dec.adaptive = False  # the policy off: whole proposals
    dec.begin_step(16)
    assert [len(dec.propose(r, 16)) for r in reqs] == [16, 16, 16, 16]


def test_n_min_drops_a_cut_draft():
    dec = SpecDecoder(SpecConfig(method="ngram", num_speculative_tokens=16, min_tokens=9, prompt_lookup_min=2,
                                 prompt_lookup_max=4))
    r = _Req("a")
    dec.register(r, plain_greedy=True)
    dec.begin_step(8)
    assert dec.propose(r, 16) == []  # the policy's 8 < --draft-min 9
    dec.begin_step(4)
    assert len(dec.propose(r, 16)) == 12


# -- the engine ----------------------------------------------------------------------------------

SPEC = SpecConfig(method="ngram", num_speculative_tokens=8, prompt_lookup_min=1, prompt_lookup_max=3)


def _core(path, spec: bool, rows: int = 64) -> EngineCore:
    return EngineCore(load_files(path), EngineConfig(n_ctx=8192, dtype="float32", n_parallel=16, kv_unified=True,
                                                     small_batch_rows=rows, spec=SPEC if spec else SpecConfig()))


def _prompt(seed, n, times):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=g).tolist() * times


def _run(core, reqs):
    res = {r.request_id: [] for r in reqs}
    for r in reqs:
        core.add_request(r)
    while core.has_work():
        for o in core.step():
            res[o.request_id] += o.new_token_ids
    return res


@pytest.mark.parametrize("rows", [64, 16])
def test_sixteen_streams_identical_with_the_policy(tiny_gguf, rows):
    """16 greedy streams of repetitive and random prompts and different lengths, plain and with
    speculation: the same tokens. With 64 rows allowed the policy decides every draft's length;
    with the CPU's 16 the full batch leaves no room and the tail (streams that finished) drafts."""
    plain, spec = _core(tiny_gguf, False, rows), _core(tiny_gguf, True, rows)

    def mk(tag):
        return [Request(f"{tag}{i}", _prompt(i, 6 + i % 5, 4) if i % 3 else _prompt(50 + i, 30, 1),
                        SamplingParams(n_predict=30 + 4 * i, temperature=0.0)) for i in range(16)]

    drafts: list[int] = []
    real = spec.scheduler._add_drafts

    def spy(out):
        real(out)
        drafts.append(sum(len(c.spec_token_ids) for c in out.chunks))

    spec.scheduler._add_drafts = spy
    a, b = _run(plain, mk("p")), _run(spec, mk("s"))
    for i in range(16):
        assert a[f"p{i}"] == b[f"s{i}"], i
        assert len(a[f"p{i}"]) == 30 + 4 * i
    st = spec.stats
    assert st.spec_draft_tokens_total > 0 and st.spec_accepted_tokens_total > 0
    assert sum(drafts) == st.spec_draft_tokens_total
    if rows == 16:
        assert drafts[:25] == [0] * 25  # while all 16 decode, no step drafts
    assert spec.kv.num_free_blocks == plain.kv.num_free_blocks
