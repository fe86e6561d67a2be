"""KV shifting (--cache-reuse / n_cache_reuse) and cache_miss diagnostics on the tiny model."""

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.request import Request, SamplingParams
from kvserve.models.build import load_files

HEADER = [3, 4, 5, 6, 7]  # "File: Main.java\n": 5 tokens, as seed Example 10
PRE = list(range(20, 53)) + [60, 61, 62, 63, 64]  # 38 tokens
A = HEADER + PRE  # 43 tokens


def core_for(path, **kw) -> EngineCore:
    kw.setdefault("n_ctx", 1024)
    kw.setdefault("n_parallel", 1)
    kw.setdefault("dtype", "float32")
    kw.setdefault("cache_ram", 0)
    return EngineCore(load_files(path), EngineConfig(**kw))


def run(core, ids, slot=0, n_predict=4, reuse=0, cache_prompt=True, salt=None, owner=None):
    r = Request(f"r-{torch.randint(0, 1 << 30, (1,)).item()}", list(ids),
                SamplingParams(temperature=0, n_predict=n_predict, ignore_eos=True, n_cache_reuse=reuse,
                               cache_prompt=cache_prompt), priority_slot=slot, cache_salt=salt, owner=owner)
    core.add_request(r)
    outs = []
    while not outs or not outs[-1].finished:
        outs += [o for o in core.step() if o.request_id == r.request_id]
    return outs[-1].timings, [x for o in outs for x in o.new_token_ids]


# -- the manager's reuse loop ---------------------------------------------------------

def test_reuse_loop_skips_removed_text_and_leaves_one_token():
    kv = KVCacheManager(64, 4, host_blocks=0)
    assert kv.allocate("a", len(A))
    kv.record_tokens("a", 0, A)
    kv.park("a", "slot:0")
    assert kv.hit_tokens(kv.match_prefix(PRE, None, len(PRE) - 1)) == 0
    n = kv.reuse_shifted("b", PRE, 0, "slot:0", 8, len(PRE) - 1)
    assert n == 37
    jobs = kv.take_shifts()
    assert len(jobs) == 37 and {d for _, _, d in jobs} == {-5}
    src = kv.parked_table("slot:0")
    assert jobs[0][0] == kv.row_of(src, 5) and jobs[0][1] == kv.row_of(kv.block_table("b"), 0)
    # a run shorter than N is not reused; another salt is never reused
    assert kv.reuse_shifted("c", PRE, 0, "slot:0", 40, len(PRE) - 1) == 0
    assert kv.reuse_shifted("d", PRE, 0, "slot:0", 8, len(PRE) - 1, salt="x") == 0


def test_reuse_loop_handles_a_removed_middle_chunk():
    kv = KVCacheManager(64, 4, host_blocks=0)
    cached = list(range(100, 110)) + [7, 7, 7] + list(range(200, 212))
    assert kv.allocate("a", len(cached))
    kv.record_tokens("a", 0, cached)
    kv.park("a", "slot:0")
    prompt = list(range(100, 110)) + list(range(200, 212)) + [9]
    assert kv.reuse_shifted("b", prompt, 10, "slot:0", 4, len(prompt) - 1) == 22
    assert {d for _, _, d in kv.take_shifts()} == {-3}


# -- rotation --------------------------------------------------------------------------

def test_rotation_by_plus_then_minus_delta_is_identity(tiny_gguf):
    core = core_for(tiny_gguf, kv_dtype="f32")
    run(core, A, n_predict=1)
    k0 = core.runner.kv_caches[0][0]
    table = core.kv.parked_table("slot:0")
    src = core.kv.row_of(table, 10)
    spare = core.kv.row_of(table, 40)
    before = k0[src].clone()
    core.runner.shift_rows([(src, spare, 123)])
    assert not torch.allclose(k0[spare], before)
    core.runner.shift_rows([(spare, spare, -123)])
    torch.testing.assert_close(k0[spare], before, atol=1e-5, rtol=1e-5)


def test_shifted_layer0_keys_equal_fresh_keys_at_the_new_positions(tiny_gguf):
    """Layer 0's K and V depend only on the token and its position (no context yet), so a
    shifted row must equal the row a cold run computes at the new position (f32 cache)."""
    warm = core_for(tiny_gguf, kv_dtype="f32")
    run(warm, A, n_predict=1)
    t, _ = run(warm, PRE, n_predict=1, reuse=8)
    assert (t.cache_n, t.prompt_n) == (37, 1)
    cold = core_for(tiny_gguf, kv_dtype="f32")
    run(cold, PRE, n_predict=1)
    rows_w = torch.tensor([warm.kv.row_of(warm.kv.parked_table("slot:0"), p) for p in range(37)])
    rows_c = torch.tensor([cold.kv.row_of(cold.kv.parked_table("slot:0"), p) for p in range(37)])
    (kw, vw), (kc, vc) = warm.runner.kv_caches[0], cold.runner.kv_caches[0]
    torch.testing.assert_close(kw[rows_w], kc[rows_c], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(vw[rows_w], vc[rows_c])


# -- Example 10 at engine level ---------------------------------------------------------

@pytest.mark.parametrize("reuse,expect", [(0, (0, 38)), (8, (37, 1))])
def test_seed_example_10_shape(tiny_gguf, reuse, expect):
    core = core_for(tiny_gguf)  # -np 1 --cache-ram 0
    t, _ = run(core, A, n_predict=2, reuse=reuse)
    assert (t.cache_n, t.prompt_n) == (0, 43)
    t, toks = run(core, PRE, n_predict=6, reuse=reuse)
    assert (t.cache_n, t.prompt_n) == expect
    assert len(toks) == 6  # approximate KV (it saw the removed header): outputs, not equality
    assert core.stats.prompt_tokens_cached_total == expect[0]


def test_f16_cache_shift_runs_and_reuse_is_off_by_default(tiny_gguf):
    core = core_for(tiny_gguf, kv_dtype="f16")
    run(core, A)
    assert run(core, PRE)[0].cache_n == 0
    run(core, A)
    assert run(core, PRE, reuse=8)[0].cache_n == 37


# -- cache_miss ----------------------------------------------------------------------

Q1 = list(range(10, 40)) + [50, 51, 52, 53, 54, 55, 56, 57]
Q2 = list(range(10, 40)) + [60, 61, 62, 63, 64, 65, 66, 67]
PASTA = list(range(70, 77))


def test_cache_miss_reasons_follow_example_9(tiny_gguf):
    core = core_for(tiny_gguf, cache_ram=0)
    t, _ = run(core, Q1, owner="key-1")
    assert t.cache_miss is None  # nothing cached yet
    t, _ = run(core, Q2, owner="key-1")  # the same API key: its own earlier text is shown
    m = t.cache_miss
    assert (t.cache_n, m["reason"], m["first_diff_pos"], m["n_reused"], m["best_candidate_tokens"]) == \
        (30, "prefix differs", 30, 30, 30)
    assert m["prompt_excerpt"] == core.scheduler.detokenize(Q2[22:38])
    assert m["cached_excerpt"] == core.scheduler.detokenize(Q1[22:38]) != m["prompt_excerpt"]
    t, _ = run(core, Q2, cache_prompt=False)
    assert t.cache_miss["reason"] == "cache_prompt false" and t.cache_miss["best_candidate_tokens"] == 38
    t, _ = run(core, PASTA)
    assert t.cache_miss is None  # shares nothing
    t, _ = run(core, Q1)
    assert (t.cache_n, t.cache_miss["reason"], t.cache_miss["best_candidate_tokens"]) == (0, "evicted", 38)
    assert t.to_dict()["cache_miss"]["reason"] == "evicted"


def test_cache_miss_salt_and_full_hit(tiny_gguf):
    core = core_for(tiny_gguf, n_parallel=2, cache_ram=0)
    run(core, Q1, slot=0, salt="alice")
    t, _ = run(core, Q1, slot=1, salt="bob")
    # another salt's entry is never mentioned, not even its length (it would confirm alice's prefix)
    assert (t.cache_n, t.cache_miss) == (0, None)
    t, _ = run(core, Q1, slot=1, salt="alice")
    assert t.cache_n == 37 and t.cache_miss is None  # all but the last token: nothing missed
    assert "cache_miss" not in t.to_dict()
