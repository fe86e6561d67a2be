"""Speculative decoding with a draft model (``-md``, kvserve.engine.draft): greedy output
token-identical to plain decoding with the target as its own draft (every draft accepted) and
with a different random draft (few accepted), at 1 and 4 streams, with prefix-cache hits,
stop strings, a grammar request beside, a slot saved and restored; the vocabulary check; the
counters; sampled speculation with a draft (the request's seed reproducible)."""

import pytest
import torch

import tinymodel
from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.draft import DraftVocabError, check_vocab
from kvserve.engine.request import Request, SamplingParams
from kvserve.engine.spec_decode import SpecConfig
from kvserve.models.build import load_files
from kvserve.structured.backend import ConstraintSpec, GrammarBackend

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def other_gguf(tmp_path_factory):
    """A different random model with the same vocabulary (seed 7, one layer)."""
    return str(tinymodel.write_tiny_gguf(tmp_path_factory.mktemp("draft") / "other.gguf", seed=7, n_layer=1))


def make_core(path, draft=None, k=6, adaptive=False, p_min=0.0, **cfg) -> EngineCore:
    cfg.setdefault("n_ctx", 1024)
    cfg.setdefault("dtype", "float32")
    cfg.setdefault("n_parallel", 4)
    cfg.setdefault("kv_unified", True)
    spec = SpecConfig(method="draft_model", draft_model=draft, num_speculative_tokens=k,
                      draft_p_min=p_min) if draft else SpecConfig()
    core = EngineCore(load_files(path), EngineConfig(spec=spec, **cfg))
    if core.spec is not None:
        core.spec.adaptive = adaptive
    return core


def run(core, reqs):
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


def prompt(seed, n=24):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def cores(tiny_gguf, other_gguf):
    return make_core(tiny_gguf), make_core(tiny_gguf, tiny_gguf), make_core(tiny_gguf, other_gguf)


def test_self_draft_one_stream_identical_and_all_accepted(cores):
    plain, selfd, _ = cores
    a = run(plain, [Request("a", prompt(0), SamplingParams(n_predict=60, **GREEDY))])["a"]
    b = run(selfd, [Request("b", prompt(0), SamplingParams(n_predict=60, **GREEDY))])["b"]
    assert a[:3] == b[:3] and len(b[0]) == 60
    t = b[3].timings
    # the target is its own draft: every draft token is the target's greedy token
    assert t.draft_n > 0 and t.draft_n_accepted == t.draft_n
    assert selfd.kv.num_free_blocks == plain.kv.num_free_blocks


def test_other_draft_identical_low_acceptance(cores):
    plain, _, other = cores
    a = run(plain, [Request("a2", prompt(1), SamplingParams(n_predict=50, **GREEDY))])["a2"]
    b = run(other, [Request("b2", prompt(1), SamplingParams(n_predict=50, **GREEDY))])["b2"]
    assert a[:3] == b[:3]
    t = b[3].timings
    assert t.draft_n > 0 and t.draft_n_accepted < t.draft_n


@pytest.mark.parametrize("which", [1, 2])
def test_four_streams_identical(cores, which):
    plain, spec = cores[0], cores[which]
    mk = lambda tag: [Request(f"{tag}{i}", prompt(10 + i, 10 + 3 * i), SamplingParams(n_predict=30 + 7 * i, **GREEDY))
                      for i in range(4)]
    a, b = run(plain, mk("p")), run(spec, mk("s"))
    for i in range(4):
        assert a[f"p{i}"][:3] == b[f"s{i}"][:3], i
    assert sum(b[f"s{i}"][3].timings.draft_n for i in range(4)) > 0


def test_prefix_cache_hit_identical(tiny_gguf, other_gguf):
    for draft in (tiny_gguf, other_gguf):
        plain, spec = make_core(tiny_gguf), make_core(tiny_gguf, draft)
        p = prompt(3, 40)
        for core in (plain, spec):
            run(core, [Request("warm", p, SamplingParams(n_predict=20, **GREEDY))])
        a = run(plain, [Request("hit", p + [7, 8], SamplingParams(n_predict=40, **GREEDY))])["hit"]
        b = run(spec, [Request("hit", p + [7, 8], SamplingParams(n_predict=40, **GREEDY))])["hit"]
        assert b[3].num_cached_tokens == a[3].num_cached_tokens >= 32
        assert a[:3] == b[:3] and b[3].timings.draft_n > 0
    # the self-draft's rows of the cached blocks are valid: everything it drafts is accepted
    spec_self = make_core(tiny_gguf, tiny_gguf)
    run(spec_self, [Request("w", p, SamplingParams(n_predict=20, **GREEDY))])
    c = run(spec_self, [Request("h", p + [9], SamplingParams(n_predict=30, **GREEDY))])["h"]
    assert c[3].num_cached_tokens >= 32 and c[3].timings.draft_n_accepted == c[3].timings.draft_n > 0


def test_stop_strings_and_n_predict_cut_as_plain(cores):
    plain, selfd, _ = cores
    p = prompt(4)
    ref = run(plain, [Request("ref", p, SamplingParams(n_predict=60, **GREEDY))])["ref"]
    text = ref[1]
    for k, cut in enumerate((len(text) // 3, 2 * len(text) // 3)):
        stop = text[cut: cut + 3]
        mk = lambda rid, stop=stop: [Request(rid, p, SamplingParams(n_predict=60, stop=(stop,), **GREEDY))]
        a, b = run(plain, mk(f"sa{k}"))[f"sa{k}"], run(selfd, mk(f"sb{k}"))[f"sb{k}"]
        assert a[:3] == b[:3] and b[2] == "word"
    for n in (1, 2, 7, 13):
        mk = lambda rid, n=n: [Request(rid, p, SamplingParams(n_predict=n, **GREEDY))]
        a, b = run(plain, mk(f"na{n}"))[f"na{n}"], run(selfd, mk(f"nb{n}"))[f"nb{n}"]
        assert a[:3] == b[:3] and len(b[0]) == n
    assert selfd.kv.num_free_blocks == plain.kv.num_free_blocks


def test_draft_n_accepted_counts_tokens_a_stop_string_cut(cores):
    """llama-server counts a verification's accepted draft tokens when it verifies
    (server-context.cpp: ``n_draft_accepted += ids.size() - 1``, before the tokens go through the
    stop checks), so tokens accepted and then cut by a stop string count: kvserve does the same
    (review item 3, docs/speculative-decoding.md)."""
    plain, selfd, _ = cores
    p = prompt(4)
    text = run(plain, [Request("ref3", p, SamplingParams(n_predict=60, **GREEDY))])["ref3"][1]
    stop = text[6: 9]  # early: inside the first verified draft
    b = run(selfd, [Request("cut3", p, SamplingParams(n_predict=60, stop=(stop,), **GREEDY))])["cut3"]
    t = b[3].timings
    # 9 tokens kept, 12 drafted and accepted by two verifications of 6: the stop string cut accepted ones
    assert b[2] == "word" and (len(b[0]), t.draft_n, t.draft_n_accepted) == (9, 12, 12)


def test_grammar_request_does_not_speculate_and_is_unchanged(cores):
    plain, selfd, _ = cores
    tok, nv = plain.tokenizer, plain.model_config.n_vocab
    g = ConstraintSpec("grammar", 'root ::= "ab" [0-9]{2} "."')

    def mk(tag):
        be = GrammarBackend(tok, nv)
        return [Request(f"{tag}g", tok.encode("the cat", add_special=True), SamplingParams(n_predict=30, **GREEDY),
                        grammar=be.constraint(g)),
                Request(f"{tag}f", prompt(6), SamplingParams(n_predict=30, **GREEDY))]
    a, b = run(plain, mk("p")), run(selfd, mk("s"))
    assert a["pg"][:3] == b["sg"][:3] and a["pf"][:3] == b["sf"][:3]
    assert a["pg"][2] == "eos"
    assert b["sg"][3].timings.draft_n == 0  # grammar rows never speculate
    assert b["sf"][3].timings.draft_n > 0


def test_p_min_stops_drafting(tiny_gguf):
    # a random tiny model is never sure: with p_min 0.99 nothing is drafted, output unchanged
    plain, spec = make_core(tiny_gguf), make_core(tiny_gguf, tiny_gguf, p_min=0.99)
    a = run(plain, [Request("a", prompt(8), SamplingParams(n_predict=20, **GREEDY))])["a"]
    b = run(spec, [Request("b", prompt(8), SamplingParams(n_predict=20, **GREEDY))])["b"]
    assert a[:3] == b[:3] and b[3].timings.draft_n == 0


def test_per_request_p_min_is_applied(cores):
    """llama-server's per-request ``speculative.p_min`` (review item 2: it was ignored): 0.99 on a
    server without a minimum drafts nothing, output unchanged; 0.0 on a 0.99 server drafts."""
    plain, selfd, _ = cores
    a = run(plain, [Request("pa", prompt(8), SamplingParams(n_predict=20, **GREEDY))])["pa"]
    b = run(selfd, [Request("pb", prompt(8), SamplingParams(n_predict=20, spec_p_min=0.99, **GREEDY))])["pb"]
    assert a[:3] == b[:3] and b[3].timings.draft_n == 0
    c = run(selfd, [Request("pc", prompt(8), SamplingParams(n_predict=20, **GREEDY))])["pc"]
    assert c[3].timings.draft_n > 0


def test_slot_save_restore_recomputes_the_draft_rows(tiny_gguf, tmp_path):
    spec = make_core(tiny_gguf, tiny_gguf, n_parallel=2)
    p = prompt(9, 40)
    run(spec, [Request("s0", p, SamplingParams(n_predict=10, **GREEDY), priority_slot=0)])
    f = str(tmp_path / "slot.bin")
    spec.save_slot(0, f)
    # a fresh engine: the slot's target rows come from the file, the draft's are recomputed
    spec2 = make_core(tiny_gguf, tiny_gguf, n_parallel=2)
    spec2.restore_slot(1, f)
    plain = make_core(tiny_gguf, n_parallel=2)
    cont = p + [11, 12]
    r2 = Request("s1", cont, SamplingParams(n_predict=30, **GREEDY), priority_slot=1)
    b = run(spec2, [r2])["s1"]
    a = run(plain, [Request("pl", cont, SamplingParams(n_predict=30, **GREEDY))])["pl"]
    assert b[3].num_cached_tokens >= 40 and a[:3] == b[:3]
    t = b[3].timings
    assert t.draft_n > 0 and t.draft_n_accepted == t.draft_n  # valid draft rows: all accepted


def test_counters_with_a_draft(tiny_gguf):
    spec = make_core(tiny_gguf, tiny_gguf)
    b = run(spec, [Request("c", prompt(12), SamplingParams(n_predict=40, **GREEDY))])["c"]
    st, t = spec.stats, b[3].timings
    assert st.spec_draft_tokens_total == t.draft_n and st.spec_accepted_tokens_total == t.draft_n_accepted
    assert st.spec_drafts_total >= 1 and sum(st.spec_accepted_per_pos) == st.spec_accepted_tokens_total
    assert t.to_dict()["draft_n"] == t.draft_n


def test_sampled_with_a_draft_is_reproducible_and_runs(cores):
    _, selfd, other = cores
    for core in (selfd, other):
        outs = []
        for rep in range(2):
            res = run(core, [Request(f"t{rep}", prompt(13), SamplingParams(n_predict=30, temperature=0.8, top_k=20,
                                                                          seed=42))])[f"t{rep}"]
            outs.append(res[0])
            assert len(res[0]) == 30 and res[3].timings.draft_n > 0
        assert outs[0] == outs[1]


def test_vocab_mismatch_is_a_startup_error(tiny_gguf, tmp_path):
    bigger = str(tinymodel.write_tiny_gguf(tmp_path / "big.gguf", extra_control_tokens=("<extra>",)))
    with pytest.raises(DraftVocabError, match="the target and draft vocabs are not compatible: target vocab size"):
        make_core(tiny_gguf, bigger)
    eos = str(tinymodel.write_tiny_gguf(tmp_path / "eos.gguf", bos_token_id=1, eos_token_id=2))
    with pytest.raises(DraftVocabError, match=r"special tokens must match target model to use speculation "
                                              r"\(bos, eos: target 0, 0; draft 1, 2\)"):
        make_core(tiny_gguf, eos)


def test_check_vocab_token_text_and_type():
    class T:
        def __init__(self, texts, vt="gpt2"):
            self.texts, self.vocab_type = texts, vt
            self.add_bos = self.add_eos = False
            self.bos_token_id = self.eos_token_id = 0

        def token_text(self, i):
            return self.texts[i]

    a = T([str(i) for i in range(10)])
    check_vocab(a, T([str(i) for i in range(10)]), 10, 10)
    check_vocab(a, T(["x"] * 5 + [str(i) for i in range(5, 10)]), 10, 10)  # ids < 5 are not compared
    with pytest.raises(DraftVocabError, match="token 7 content differs - target '7', draft 'y'"):
        check_vocab(a, T([str(i) for i in range(7)] + ["y", "8", "9"]), 10, 10)
    with pytest.raises(DraftVocabError, match="vocab_type_dft = spm while vocab_type_tgt = gpt2"):
        check_vocab(a, T([str(i) for i in range(10)], "spm"), 10, 10)


def test_cache_reuse_shifts_apply_to_the_draft_too(tiny_gguf):
    """--cache-reuse: the shifted chunk's rows move in the draft's pool as in the target's (its own
    RoPE), so the target as its own draft still accepts everything, and the tokens are plain's."""
    header, pre = [3, 4, 5, 6, 7], list(range(20, 53)) + [60, 61, 62, 63, 64]

    def go(core):
        out = []
        for rid, ids in (("a", header + pre), ("b", pre)):
            r = Request(rid, list(ids), SamplingParams(temperature=0, n_predict=24, n_cache_reuse=8),
                        priority_slot=0)
            out.append(run(core, [r])[rid])
        return out

    plain = make_core(tiny_gguf, n_parallel=1, cache_ram=0)
    spec = make_core(tiny_gguf, tiny_gguf, n_parallel=1, cache_ram=0)
    a, b = go(plain), go(spec)
    assert [x[0] for x in a] == [x[0] for x in b]
    assert b[1][3].num_cached_tokens == a[1][3].num_cached_tokens == 37  # the shifted chunk reused
    t = b[1][3].timings
    assert t.draft_n > 0 and t.draft_n_accepted == t.draft_n


def test_a_full_accept_at_the_end_leaves_valid_draft_rows_for_a_prefix_hit(tiny_gguf):
    """The last verification of a request cut by n_predict accepts its whole draft; the draft's row
    of that last draft token is computed after the target's step (after_verify), so a later request
    hitting the whole cached sequence finds valid draft rows: the self-draft accepts everything."""
    spec = make_core(tiny_gguf, tiny_gguf, k=4, n_parallel=1)
    assert spec.kv.block_size == 16
    # 38 + 11 tokens: 1 + 5 + 5 generated (two verifications of 4 accepted + the bonus), the last
    # draft token at position 47, the end of the third block (cached whole)
    p = prompt(21, 38)
    first = run(spec, [Request("f", p, SamplingParams(n_predict=11, **GREEDY))])["f"]
    assert len(first[0]) == 11 and first[3].timings.draft_n == first[3].timings.draft_n_accepted == 8
    seq = p + first[0]
    second = run(spec, [Request("g", seq + [5], SamplingParams(n_predict=30, **GREEDY))])["g"]
    assert second[3].num_cached_tokens == 48
    t = second[3].timings
    assert t.draft_n > 0 and t.draft_n_accepted == t.draft_n


def test_policy_charges_a_draft_step_per_drafted_token(tiny_gguf, other_gguf):
    from kvserve.engine.spec_decode import SpecDecoder, draft_length

    # one stream, alpha 0.8, base 2 rows: a draft 10x cheaper than the target
    # pays, one as large as the target does not
    assert draft_length(0.8, 8, 1, 2.0, token_rows=0.0) == 7
    assert draft_length(0.8, 8, 1, 2.0, token_rows=0.3) == 5
    assert draft_length(0.8, 8, 1, 2.0, token_rows=3.0) == 0
    selfd = make_core(tiny_gguf, tiny_gguf, adaptive=True)
    other = make_core(tiny_gguf, other_gguf, adaptive=True)
    assert selfd.spec.draft_cost == pytest.approx(1.0)
    assert other.spec.draft_cost == pytest.approx(56128 / 92992)  # one layer of two, the same head
    assert isinstance(selfd.spec, SpecDecoder)
    plain = make_core(tiny_gguf)
    a = run(plain, [Request("a", prompt(30), SamplingParams(n_predict=20, **GREEDY))])["a"]
    b = run(selfd, [Request("b", prompt(30), SamplingParams(n_predict=20, **GREEDY))])["b"]
    assert a[:3] == b[:3] and b[3].timings.draft_n == 0  # the self-draft never pays: plain decoding
    # and costs two draft forwards, not one a step: the prompt, then the skipped rows at the finish
    assert (selfd.draft.forwards, selfd.draft.rows) == (2, len(prompt(30)) + 19)
