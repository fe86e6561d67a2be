"""Speculative decoding by prompt lookup (``--spec-type ngram``): the n-gram proposer's exact
proposals, and greedy output token-identical with and without speculation on the tiny
random model (1 and 4 streams, prefix-cache hits, stop strings, n_predict, context limit,
EOS), a sampled and a grammar request in the same batch unchanged, and the prefix cache's
block hashes the same after a speculative run as after a plain one."""

import dataclasses
import random
import time

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.request import Request, SamplingParams
from kvserve.engine import spec_decode
from kvserve.engine.spec_decode import (
    NgramIndex,
    SpecConfig,
    SpecDecoder,
    accepted_prefix,
)
from kvserve.models.build import load_files
from kvserve.structured.backend import ConstraintSpec, GrammarBackend

# -- the proposer ------------------------------------------------------------------------------

def _index(tokens, n_min=1, n_max=3):
    ix = NgramIndex(n_min, n_max)
    ix.extend(tokens)
    return ix


def test_longest_ngram_first_and_continuation_capped_at_the_end():
    # last 3-gram (1, 2, 3) occurred at 0..2: the 4 tokens after it, up to the sequence's end
    assert _index([1, 2, 3, 4, 1, 2, 3]).propose(4) == [4, 1, 2, 3]
    assert _index([1, 2, 3, 4, 1, 2, 3]).propose(2) == [4, 1]
    assert _index([1, 2, 3, 4, 1, 2, 3]).propose(10) == [4, 1, 2, 3]


def test_most_recent_earlier_occurrence_wins():
    assert _index([1, 2, 9, 1, 2, 8, 1, 2], n_min=2, n_max=2).propose(3) == [8, 1, 2]


def test_falls_back_to_shorter_ngrams_down_to_min():
    # (1, 6, 7) never occurred before; (6, 7) did, at 1..2
    assert _index([5, 6, 7, 1, 6, 7], n_min=2, n_max=3).propose(3) == [1, 6, 7]
    # with n_min 3 nothing matches
    assert _index([5, 6, 7, 1, 6, 7], n_min=3, n_max=3).propose(3) == []
    # unigram fallback
    assert _index([4, 9, 5, 3, 4], n_min=1, n_max=3).propose(2) == [9, 5]


def test_no_match_short_sequence_and_zero_k():
    assert _index([1, 2, 3]).propose(4) == []
    assert _index([]).propose(4) == []
    assert _index([7]).propose(4) == []
    assert _index([1, 2, 1, 2]).propose(0) == []
    # a run of one token: the most recent earlier (1, 1, 1) ends one before the last
    assert _index([1, 1, 1, 1, 1]).propose(3) == [1]


def _reference(tokens, n_min, n_max, k):
    """Quadratic reference: scan backwards for the most recent earlier occurrence."""
    L = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        if L < n:
            continue
        suffix = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n: min(start + n + k, L)]
    return []


def test_incremental_index_matches_the_reference_on_random_sequences():
    rng = random.Random(5)
    for trial in range(30):
        n_min = rng.randint(1, 3)
        n_max = n_min + rng.randint(0, 3)
        ix = NgramIndex(n_min, n_max)
        seq: list[int] = []
        for _ in range(40):
            add = [rng.randint(0, 4) for _ in range(rng.randint(1, 5))]
            seq += add
            ix.extend(add)
            k = rng.randint(1, 8)
            assert ix.propose(k) == _reference(seq, n_min, n_max, k), (trial, seq, k)


def test_a_64k_token_context_costs_no_scan_per_step():
    rng = random.Random(1)
    toks = [rng.randint(0, 30000) for _ in range(65536)]
    ix = NgramIndex(2, 4)
    t0 = time.perf_counter()
    ix.extend(toks)
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(1000):
        ix.extend([toks[i]])
        ix.propose(16)
    per_step = (time.perf_counter() - t0) / 1000
    assert build < 5.0
    assert per_step < 1e-3, per_step  # a few dict operations, not a pass over 64k tokens


def test_spec_config_checks():
    with pytest.raises(ValueError, match="unsupported speculative method 'eagle' \\(kvserve has 'ngram': prompt "
                                         "lookup, and 'draft_model'\\)"):
        SpecConfig(method="eagle")
    with pytest.raises(ValueError, match="needs a draft model"):
        SpecConfig(method="draft_model")
    with pytest.raises(ValueError, match=r"minimum probability must be in \[0, 1\], got 1.5"):
        SpecConfig(method="draft_model", draft_model="x.gguf", draft_p_min=1.5)
    with pytest.raises(ValueError, match="1 <= min <= max"):
        SpecConfig(method="ngram", prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError):
        NgramIndex(0, 2)
    assert not SpecConfig().enabled and SpecConfig(method="ngram").enabled
    assert not SpecConfig(method="ngram", num_speculative_tokens=0).enabled
    p = SamplingParams(spec_n_max=-1, spec_n_min=-3)  # llama-server clamps
    assert (p.spec_n_max, p.spec_n_min) == (0, 0)


def test_accepted_prefix():
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_prefix([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted_prefix([5], [4, 1]) == 0


def test_policy_per_request_limits():
    class R:
        def __init__(self, rid, toks, **p):
            self.request_id, self.toks, self.grammar = rid, toks, None
            self.params = SamplingParams(temperature=0.0, **p)

        @property
        def num_tokens(self):
            return len(self.toks)

        def token_at(self, i):
            return self.toks[i]

    dec = SpecDecoder(SpecConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2))
    dec.adaptive = False  # the proposals whole (the draft-length policy: test_spec_policy.py)
    toks = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    for rid, kw in (("a", {}), ("b", {"spec_n_max": 2}), ("c", {"spec_n_max": 0}), ("d", {"spec_n_min": 9}),
                    ("e", {"spec_n_max": 99})):
        dec.register(R(rid, toks, **kw), plain_greedy=True)
    dec.register(R("f", toks), plain_greedy=False)
    got = {rid: dec.propose(R(rid, toks), 16) for rid in "abcdef"}
    assert got == {"a": [3, 4, 5, 6], "b": [3, 4], "c": [], "d": [], "e": [3, 4, 5, 6], "f": []}
    assert dec.propose(R("a", toks), 1) == [3]  # the scheduler's room caps it
    dec.forget("a")
    assert dec.propose(R("a", toks), 16) == []


def test_a_long_prompt_is_indexed_over_several_steps(monkeypatch):
    from kvserve.engine import spec_decode

    class R:
        def __init__(self, toks):
            self.request_id, self.toks, self.grammar = "long", toks, None
            self.params = SamplingParams(temperature=0.0)

        @property
        def num_tokens(self):
            return len(self.toks)

        def token_at(self, i):
            return self.toks[i]

    monkeypatch.setattr(spec_decode, "INDEX_TOKENS_PER_STEP", 10)
    dec = SpecDecoder(SpecConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=2))
    dec.adaptive = False
    toks = [7, 8, 9, 1, 2, 3, 4, 5, 6, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 7, 8]
    r = R(toks)
    dec.register(r, plain_greedy=True)
    assert [dec.propose(r, 16) for _ in range(3)] == [[], [], [9, 1, 2]]  # 10 + 10 + 6 tokens indexed
    r.toks = [*toks, 9, 1]
    assert dec.propose(r, 16) == [2, 3, 4]


# -- the engine ----------------------------------------------------------------------------------

SPEC = SpecConfig(method="ngram", num_speculative_tokens=8, prompt_lookup_min=1, prompt_lookup_max=3)


def make_core(path, spec: bool, adaptive: bool = False, **cfg) -> EngineCore:
    """An engine on the tiny model; with ``spec``, every proposal verified whole unless
    ``adaptive`` (the draft-length policy, which on these short random sequences often drafts
    nothing: its identity tests are in test_spec_policy.py)."""
    cfg.setdefault("n_ctx", 1024)
    cfg.setdefault("dtype", "float32")
    cfg.setdefault("n_parallel", 4)
    cfg.setdefault("kv_unified", True)
    core = EngineCore(load_files(path), EngineConfig(spec=SPEC if spec else SpecConfig(), **cfg))
    if core.spec is not None:
        core.spec.adaptive = adaptive
    return core


def run(core, reqs):
    """Step until every request finished: {request_id: (tokens, text, stop_type, last output)}."""
    res = {r.request_id: [[], "", None, None] for r in reqs}
    for r in reqs:
        core.add_request(r)
    steps = 0
    while core.has_work():
        for o in core.step():
            e = res[o.request_id]
            e[0] += o.new_token_ids
            e[1] += o.text
            if o.finished:
                e[2], e[3] = o.stop_type, o
        steps += 1
        assert steps < 5000
    return {k: tuple(v) for k, v in res.items()}


def repeated_prompt(seed=0, n=12, times=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=g).tolist() * times


def random_prompt(seed, n=30):
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randint(3, 300, (n,), generator=g).tolist()


GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def cores(tiny_gguf):
    return make_core(tiny_gguf, False), make_core(tiny_gguf, True)


def _same(a, b):
    for rid in a:
        assert a[rid][:3] == b[rid][:3], rid


def test_one_stream_identical_and_drafts_accepted(cores):
    plain, spec = cores
    mk = lambda rid: [Request(rid, repeated_prompt(0), SamplingParams(n_predict=80, **GREEDY))]
    a, b = run(plain, mk("one-a")), run(spec, mk("one-b"))
    assert a["one-a"][:3] == b["one-b"][:3]
    assert len(b["one-b"][0]) == 80 and b["one-b"][2] == "limit"
    t = b["one-b"][3].timings
    assert t.draft_n > 0 and 0 < t.draft_n_accepted <= t.draft_n
    d = t.to_dict()
    assert d["draft_n"] == t.draft_n and d["draft_n_accepted"] == t.draft_n_accepted
    assert "draft_n" not in a["one-a"][3].timings.to_dict()  # llama-server: only when drafted
    assert spec.stats.spec_accepted_tokens_total >= t.draft_n_accepted > 0
    assert spec.kv.num_free_blocks == plain.kv.num_free_blocks


@pytest.mark.parametrize("adaptive", [False, True])
def test_four_streams_identical(cores, tiny_gguf, adaptive):
    plain, spec = cores
    if adaptive:
        spec = make_core(tiny_gguf, True, adaptive=True)
    def mk(tag):
        return [Request(f"{tag}{i}", repeated_prompt(i, n=8 + i, times=3) if i % 2 == 0 else random_prompt(i),
                        SamplingParams(n_predict=50 + 5 * i, **GREEDY)) for i in range(4)]
    a, b = run(plain, mk("p")), run(spec, mk("s"))
    for i in range(4):
        assert a[f"p{i}"][:3] == b[f"s{i}"][:3], i
    if not adaptive:  # with the policy a fresh sequence's draft does not pay at 2-4 rows
        assert sum(b[f"s{i}"][3].timings.draft_n_accepted for i in range(4)) > 0


def test_prefix_cache_hit_identical(tiny_gguf):
    plain, spec = make_core(tiny_gguf, False), make_core(tiny_gguf, True)
    prompt = repeated_prompt(3, n=20, times=3)
    for core in (plain, spec):
        run(core, [Request("warm", prompt, SamplingParams(n_predict=5, **GREEDY))])
    a = run(plain, [Request("hit", prompt + [7, 8], SamplingParams(n_predict=60, **GREEDY))])["hit"]
    b = run(spec, [Request("hit", prompt + [7, 8], SamplingParams(n_predict=60, **GREEDY))])["hit"]
    assert b[3].num_cached_tokens == a[3].num_cached_tokens >= 48
    assert a[:3] == b[:3] and b[3].timings.draft_n_accepted > 0


def test_stop_string_and_n_predict_cut_where_plain_decoding_cuts(cores):
    plain, spec = cores
    prompt = repeated_prompt(0)
    ref = run(plain, [Request("ref", prompt, SamplingParams(n_predict=80, **GREEDY))])["ref"]
    text = ref[1]
    # stop strings that end inside what a verification step accepts (mid-text pieces)
    for k, cut in enumerate((len(text) // 3, len(text) // 2, 2 * len(text) // 3)):
        stop = text[cut: cut + 3]
        mk = lambda rid, stop=stop: [Request(rid, prompt, SamplingParams(n_predict=80, stop=(stop,), **GREEDY))]
        a, b = run(plain, mk(f"sa{k}"))[f"sa{k}"], run(spec, mk(f"sb{k}"))[f"sb{k}"]
        assert a[:3] == b[:3] and b[2] == "word"
        assert b[3].stopping_word == stop
    for n in (1, 2, 17, 33, 47):
        mk = lambda rid, n=n: [Request(rid, prompt, SamplingParams(n_predict=n, **GREEDY))]
        a, b = run(plain, mk(f"na{n}"))[f"na{n}"], run(spec, mk(f"nb{n}"))[f"nb{n}"]
        assert a[:3] == b[:3] and len(b[0]) == n and b[2] == "limit"
    assert spec.kv.num_free_blocks == plain.kv.num_free_blocks


def test_context_limit_and_eos_cut_exactly(tiny_gguf):
    plain, spec = make_core(tiny_gguf, False, n_ctx=128), make_core(tiny_gguf, True, n_ctx=128)
    prompt = repeated_prompt(0)
    mk = lambda: [Request("ctx", prompt, SamplingParams(n_predict=-1, **GREEDY))]
    a, b = run(plain, mk())["ctx"], run(spec, mk())["ctx"]
    assert a[:3] == b[:3] and b[2] == "limit" and len(prompt) + len(b[0]) == 128
    assert b[3].truncated and b[3].timings.draft_n_accepted > 0
    # EOS: make a token of the repeated run end-of-generation
    eog = frozenset({a[0][30]})
    mk = lambda: [Request("eos", prompt, SamplingParams(n_predict=70, **GREEDY), eog_token_ids=eog)]
    a, b = run(plain, mk())["eos"], run(spec, mk())["eos"]
    assert a[:3] == b[:3] and b[2] == "eos" and b[0][-1] in eog


def test_sampled_and_grammar_requests_in_the_same_batch_unchanged(tiny_gguf):
    plain, spec = make_core(tiny_gguf, False), make_core(tiny_gguf, True)
    tok = plain.tokenizer
    nv = plain.model_config.n_vocab
    g = ConstraintSpec("grammar", 'root ::= "ab" [0-9]{2} "."')

    def mk():
        be = GrammarBackend(tok, nv)
        return [
            Request("greedy", repeated_prompt(0), SamplingParams(n_predict=60, **GREEDY)),
            Request("sampled", repeated_prompt(1), SamplingParams(n_predict=40, temperature=1.0, top_k=0, top_p=1.0,
                                                                  min_p=0.0, seed=7)),
            Request("penalty", repeated_prompt(2), SamplingParams(n_predict=40, repeat_penalty=1.3, **GREEDY)),
            Request("grammar", tok.encode("the cat", add_special=True), SamplingParams(n_predict=30, **GREEDY),
                    grammar=be.constraint(g)),
        ]
    a, b = run(plain, mk()), run(spec, mk())
    for rid in ("greedy", "penalty", "grammar"):
        assert a[rid][:3] == b[rid][:3], rid
    assert b["greedy"][3].timings.draft_n_accepted > 0
    for rid in ("penalty", "grammar"):  # a history-dependent chain, a grammar: no speculation
        assert b[rid][3].timings.draft_n == 0, rid
    assert a["grammar"][2] == "eos"
    # a sampling request speculates (the rejection rule: same distribution, other draws than
    # plain sampling's), and its seed gives the same tokens again
    assert b["sampled"][3].timings.draft_n > 0 and len(b["sampled"][0]) == 40
    c = run(spec, mk())
    assert c["sampled"][:3] == b["sampled"][:3]
    # sampled speculation off (SpecConfig.sampled False): the sampled request is plain again
    off = make_core(tiny_gguf, False)
    off_spec = EngineCore(load_files(tiny_gguf), EngineConfig(spec=dataclasses.replace(SPEC, sampled=False),
                                                              n_ctx=1024, dtype="float32", n_parallel=4,
                                                              kv_unified=True))
    off_spec.spec.adaptive = False
    d, e = run(off, mk()), run(off_spec, mk())
    _same(d, e)
    assert e["sampled"][3].timings.draft_n == 0


def test_speculative_n_max_zero_disables_it_for_the_request(cores):
    _, spec = cores
    r = run(spec, [Request("off", repeated_prompt(0), SamplingParams(n_predict=30, spec_n_max=0, **GREEDY)),
                   Request("two", repeated_prompt(0), SamplingParams(n_predict=30, spec_n_max=2, **GREEDY))])
    assert r["off"][3].timings.draft_n == 0
    assert r["two"][0] == r["off"][0]
    steps = r["two"][3].timings.draft_n
    assert steps > 0 and r["two"][3].timings.draft_n_accepted <= steps


def _cache_state(core):
    kv = core.kv
    hashes = set(kv._by_hash)
    partial = sorted((b.parent, tuple(b.token_ids)) for b in kv.blocks if b.parent is not None and b.hash is None)
    return hashes, partial


@pytest.mark.parametrize("slot", [-1, 0])
def test_prefix_cache_holds_the_same_blocks_after_a_speculative_run(tiny_gguf, slot):
    plain = make_core(tiny_gguf, False, cache_ram=16)
    spec = make_core(tiny_gguf, True, cache_ram=16)
    prompt = repeated_prompt(0)
    for core in (plain, spec):
        run(core, [Request("r", prompt, SamplingParams(n_predict=70, stop=("zzzz",), **GREEDY), priority_slot=slot)])
    hp, pp = _cache_state(plain)
    hs, ps = _cache_state(spec)
    assert len(hp) == (len(prompt) + 69) // 16
    assert hs == hp and ps == pp
    assert spec.stats.spec_draft_tokens_total > spec.stats.spec_accepted_tokens_total  # something was rejected
    assert spec.kv.num_free_blocks == plain.kv.num_free_blocks
    assert spec.kv.num_cached_blocks == plain.kv.num_cached_blocks


def test_streamed_outputs_carry_every_token_once(cores):
    _, spec = cores
    r = Request("stream", repeated_prompt(0), SamplingParams(n_predict=40, **GREEDY))
    spec.add_request(r)
    outs = []
    while spec.has_work():
        outs += spec.step()
    toks = [t for o in outs for t in o.new_token_ids]
    assert len(toks) == 40 == outs[-1].num_output_tokens
    assert max(len(o.new_token_ids) for o in outs) > 1  # several tokens in one step
    assert [o.num_output_tokens for o in outs] == sorted({o.num_output_tokens for o in outs})


class _FixedProposer:
    """Stands in for the n-gram index: proposes from a given continuation (an oracle, whose
    drafts the target accepts) or a constant token (drafts the target rejects)."""

    def __init__(self, inner, oracle=None, junk=None, shift=0):
        self.inner, self.oracle, self.junk, self.shift = inner, oracle, junk, shift

    def begin_step(self, rows):
        pass

    def propose(self, req, max_tokens):
        k = min(8, max_tokens)
        if k <= 0 or not self.inner._seqs.get(req.request_id):
            return []
        if self.junk is not None:
            return [self.junk] * k
        g = len(req.output_token_ids)
        draft = self.oracle[g + self.shift: g + self.shift + k]
        return draft


@pytest.mark.parametrize("mode", ["junk", "oracle", "half"])
def test_rejected_drafts_leave_no_trace(tiny_gguf, mode):
    """Always-rejected drafts (crossing block boundaries), always-accepted ones, and drafts
    that go wrong half way: same tokens, same cache blocks, same free blocks."""
    plain = make_core(tiny_gguf, False, cache_ram=16)
    spec = make_core(tiny_gguf, True, cache_ram=16)
    prompt = random_prompt(9, n=21)
    ref = run(plain, [Request("r", prompt, SamplingParams(n_predict=75, **GREEDY))])["r"]
    oracle = list(ref[0])
    if mode == "half":
        oracle = [t if i % 6 != 4 else (t + 1) % 300 for i, t in enumerate(oracle)]
    spec.scheduler.spec = _FixedProposer(spec.spec, oracle=oracle, junk=299 if mode == "junk" else None)
    req = Request("r", prompt, SamplingParams(n_predict=75, **GREEDY))
    spec.add_request(req)
    toks = []
    while spec.has_work():
        for o in spec.step():
            toks += o.new_token_ids
        if not req.is_finished:  # blocks holding only rejected positions were freed at once
            assert len(spec.kv.block_table("r")) == spec.kv.blocks_needed(req.num_computed_tokens)
    assert toks == list(ref[0]) and req.stop_type == ref[2]
    st = spec.stats
    assert st.spec_draft_tokens_total > 0
    if mode == "junk":
        assert st.spec_accepted_tokens_total == 0 and st.spec_draft_tokens_total >= 8 * 60
    elif mode == "oracle":
        assert st.spec_accepted_tokens_total == st.spec_draft_tokens_total
    else:
        assert 0 < st.spec_accepted_tokens_total < st.spec_draft_tokens_total
    assert _cache_state(spec) == _cache_state(plain)
    assert spec.kv.num_free_blocks == plain.kv.num_free_blocks
    assert spec.kv.num_cached_blocks == plain.kv.num_cached_blocks


# -- flags -------------------------------------------------------------------------------------

def _spec_of(argv):
    from kvserve.serving.args import parse_args

    a = parse_args(argv, environ={})
    assert a.engine_config().spec == a.spec
    return a.spec, a.flag_notes


def test_flags_llama_server_and_vllm_spellings():
    assert _spec_of([])[0] == SpecConfig()
    assert _spec_of(["--spec-type", "ngram"])[0] == SpecConfig("ngram", 16, 0, 4, 2)
    assert _spec_of(["--spec-type", "ngram-simple", "--draft-max", "8", "--draft-min", "2",
                     "--spec-ngram-size-n", "3"])[0] == SpecConfig("ngram", 8, 2, 3, 3)
    assert _spec_of(["--spec-type", "ngram", "--spec-ngram-size-m", "6"])[0].num_speculative_tokens == 6
    assert _spec_of(["--spec-type", "none"])[0] == SpecConfig()
    cfg = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}'
    assert _spec_of(["--speculative-config", cfg])[0] == SpecConfig("ngram", 5, 0, 4, 4)  # vLLM: min = max
    cfg = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert _spec_of(["--speculative-config", cfg])[0] == SpecConfig("ngram", 3, 0, 5, 5)  # vLLM's 5 and 5
    spec, notes = _spec_of(["--draft-max", "3"])
    assert spec == SpecConfig() and notes == [
        (20, "flag --draft-max 3: no effect here: speculative decoding is off (--spec-type ngram or -md turns it on)")]
    # a draft model: llama-server's -md (K --draft-max, else 16; --draft-p-min) and vLLM's "model" form
    assert _spec_of(["-md", "d.gguf"])[0] == SpecConfig("draft_model", 16, 0, draft_model="d.gguf")
    assert _spec_of(["-md", "d.gguf", "--draft-max", "5", "--draft-min", "2", "--draft-p-min", "0.75"])[0] == \
        SpecConfig("draft_model", 5, 2, draft_model="d.gguf", draft_p_min=0.75)
    spec, notes = _spec_of(["-md", "d.gguf", "--spec-type", "ngram"])
    assert spec.method == "draft_model" and notes == [
        (20, "flag --spec-type ngram: the draft model (-md) is used for speculation")]
    for cfg in ('{"model": "d.gguf", "num_speculative_tokens": 4}',
                '{"method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 4}'):
        assert _spec_of(["--speculative-config", cfg])[0] == SpecConfig("draft_model", 4, 0, draft_model="d.gguf")


@pytest.mark.parametrize(("argv", "text"), [
    (["--spec-type", "ngram-mod"], ("--spec-type ngram-mod: not available; kvserve has ngram (prompt lookup, "
                                   "llama-server's ngram-simple) and none")),
    (["--speculative-config", '{"method": "eagle", "model": "x"}'],
     ("--speculative-config: method 'eagle' is not available; kvserve has methods ngram (prompt lookup) and "
      "draft_model")),
    (["--speculative-config", '{"method": "ngram", "model": "x", "num_speculative_tokens": 2}'],
     "--speculative-config: a draft model with method ngram is not available"),
    (["--speculative-config", '{"model": "x"}'], "num_speculative_tokens is required for a draft model"),
    (["--speculative-config", '{"model": "x", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}'],
     "--speculative-config: unsupported key(s) draft_tensor_parallel_size for a draft model"),
    (["--speculative-config", '{"method": "draft_model", "num_speculative_tokens": 2}'],
     "--speculative-config: a draft model needs \"model\""),
    (["-md", "d.gguf", "--draft-p-min", "1.5"], "--draft-p-min must be in [0, 1], got 1.5"),
    (["--speculative-config", '{"method": "ngram"}'], "num_speculative_tokens is required for method ngram"),
    (["--speculative-config", ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
                              '"prompt_lookup_max": 2}')], "prompt_lookup_min (4) must be <= prompt_lookup_max (2)"),
    (["--draft-max", "-1"], "--draft-max must be in [0, 1024], got -1"),
    # bounds (review item 1): an unbounded prompt_lookup_max cost 6.1 s and 550 MiB on an 800-token prompt
    (["--speculative-config", ('{"method": "ngram", "num_speculative_tokens": 100000000, '
                              '"prompt_lookup_max": 100000, "prompt_lookup_min": 1}')],
     ("error: --speculative-config: num_speculative_tokens must be at most 1024, got 100000000 (a step verifies "
      "fewer anyway: its rows cap the draft)\n")),
    (["--speculative-config", ('{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 100000, '
                              '"prompt_lookup_min": 1}')],
     ("error: --speculative-config: prompt_lookup_max must be at most 16 (tokens), got 100000 (the n-gram index "
      "holds a tuple of n tokens per position and n)\n")),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 17}'],
     "error: --speculative-config: prompt_lookup_min must be at most 16 (tokens), got 17"),
    (["--spec-type", "ngram", "--spec-ngram-size-n", "17"], "error: --spec-ngram-size-n must be at most 16, got 17\n"),
    (["--spec-type", "ngram", "--spec-ngram-size-m", "1025"],
     "error: --spec-ngram-size-m must be in [0, 1024], got 1025"),
    (["-md", "d.gguf", "--draft-max", "1025"], "error: --draft-max must be in [0, 1024], got 1025"),
    # review item 5: vLLM's text for a config with neither method nor model
    (["--speculative-config", '{"num_speculative_tokens": 3}'],
     ("error: --speculative-config: num_speculative_tokens was provided but without speculative model: give "
      "\"method\" (ngram: prompt lookup, or draft_model) or \"model\" (a draft model)\n")),
    (["--speculative-config", '{}'], "error: --speculative-config: no speculative method or model: give"),
])
def test_flags_refused_values(argv, text, capsys):
    from kvserve.serving.args import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv, environ={})
    assert e.value.code == 2
    assert text in capsys.readouterr().err


def test_flags_largest_bounds_are_taken():
    cfg = '{"method": "ngram", "num_speculative_tokens": 1024, "prompt_lookup_max": 16, "prompt_lookup_min": 1}'
    assert _spec_of(["--speculative-config", cfg])[0] == SpecConfig("ngram", 1024, 0, 16, 1)
    with pytest.raises(ValueError, match=r"^prompt_lookup_max must be at most 16, got 17$"):
        SpecConfig("ngram", 4, 0, 17, 1)
    with pytest.raises(ValueError, match=r"^num_speculative_tokens must be in \[0, 1024\], got 1025$"):
        SpecConfig("ngram", 1025)


def test_verification_attention_is_bit_identical_to_decode_attention(cores):
    """Each query of a verification chunk computes exactly what a one-sequence decode step
    computes over the same rows (not merely close: greedy ties must break the same way)."""
    from kvserve.models.llama import PrefillGroup

    model = cores[0].model
    torch.manual_seed(0)
    rows, hkv, d, h = 300, model.config.n_head_kv, model.config.head_dim, model.config.n_head
    k_cache = torch.randn(rows, hkv, d).half()
    v_cache = torch.randn(rows, hkv, d).half()
    index = torch.randperm(rows)[:120]
    n_past, r = 112, 8
    q = torch.randn(r, h, d)
    g = PrefillGroup(0, r, n_past, index, per_row=True)
    got = model._per_row_attention(q, k_cache, v_cache, g)
    for i in range(r):
        n = n_past + i + 1
        want = model._attend_rows(q[i: i + 1], k_cache, v_cache, index[:n], n, None)
        assert torch.equal(got[i: i + 1], want), i


@pytest.mark.slow
def test_verification_in_the_native_decode_step_is_token_identical(tmp_path_factory):
    """With the native decode step (Q4_1 weights, AVX512-VNNI), a step of decode rows and
    verification chunks runs in it, each verified position a decode row: greedy output equals plain
    (native) decoding token for token at 1 and 3 streams, and no verification step ran eagerly."""
    import tinymodel
    from kvserve.models import decode_native

    if decode_native.unavailable_reason():
        pytest.skip(decode_native.unavailable_reason())
    assert decode_native.load_cached() is not None or decode_native.build_in_child() is None
    path = str(tinymodel.write_tiny_gguf(tmp_path_factory.mktemp("natspec") / "q4.gguf", n_embd=256, n_ff=512,
                                         n_head=4, n_head_kv=2, qtype="Q4_1", embd_qtype="Q8_0", seed=13))
    cfg = {"n_ctx": 1024, "n_parallel": 4, "kv_unified": True}
    plain = EngineCore(load_files(path), EngineConfig(**cfg))
    spec = EngineCore(load_files(path), EngineConfig(spec=SPEC, **cfg))
    spec.spec.adaptive = False
    for core in (plain, spec):
        t0 = time.monotonic()
        while not core.runner.native.ready and time.monotonic() - t0 < 300:
            time.sleep(0.2)
        assert core.runner.native.ready
    eager = []
    fwd = spec.runner.model.forward
    spec.runner.model.forward = lambda *a, **k: eager.append((a[1].n_decode, [(g.start, g.end, g.n_past, g.per_row) for g in a[1].prefills])) or fwd(*a, **k)
    for n in (1, 3):
        mk = lambda tag: [Request(f"{tag}{i}", repeated_prompt(i, n=10 + i, times=3),
                                  SamplingParams(n_predict=40 + 5 * i, **GREEDY)) for i in range(n)]
        a, b = run(plain, mk("p")), run(spec, mk("s"))
        for i in range(n):
            assert a[f"p{i}"][:3] == b[f"s{i}"][:3], (n, i)
        assert sum(b[f"s{i}"][3].timings.draft_n_accepted for i in range(n)) > 0
    assert spec.stats.spec_drafts_total > 0 and spec.runner.native.calls > 0
    # eager forwards ran prompt chunks (and the decode rows of steps mixed with them), never a verification
    assert eager and not any(per_row for _, groups in eager for *_, per_row in groups), eager
    assert spec.spec.base_rows == spec_decode.STEP_BASE_ROWS_NATIVE[spec.runner.native.isa] and spec.spec.chunk_rows == 0.0  # the native step's costs
