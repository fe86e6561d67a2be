"""Prefix cache: hash chain, token-granular copy on write, host tier, salts, slots; and engine-level reuse."""

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.request import Request, SamplingParams
from kvserve.llm import LLM
from kvserve.models.build import load_files

BS = 4


def fill(kv: KVCacheManager, rid: str, tokens: list[int], salt=None) -> None:
    assert kv.allocate(rid, len(tokens))
    kv.record_tokens(rid, 0, tokens, salt)


def test_full_blocks_match_by_hash_chain_and_tail_token_by_token():
    kv = KVCacheManager(32, BS, host_blocks=-1)
    fill(kv, "a", list(range(10)))  # blocks [0-3] [4-7] [8,9]
    kv.free("a")
    hit = kv.match_prefix(list(range(10)) + [50, 51], None, max_tokens=11)
    assert len(hit.blocks) == 2 and (hit.cow_tokens, kv.hit_tokens(hit)) == (2, 10)
    # divergence inside the second block: one full block + 2 tokens of the next, copied on write
    hit = kv.match_prefix([0, 1, 2, 3, 4, 5, 99, 7, 8], None, max_tokens=8)
    assert len(hit.blocks) == 1 and hit.cow_tokens == 2
    assert kv.allocate_prefix("b", hit)
    src, dst, n = kv.take_copies()[0]
    assert (src, n) == (kv.blocks[src].block_id, 2) and dst != src
    assert kv.blocks[dst].token_ids == [4, 5]
    # different first token: nothing
    assert kv.hit_tokens(kv.match_prefix([7, 1, 2, 3, 4], None, max_tokens=4)) == 0


def test_at_least_one_prompt_token_is_evaluated():
    kv = KVCacheManager(32, BS, host_blocks=-1)
    fill(kv, "a", list(range(8)))
    kv.free("a")
    hit = kv.match_prefix(list(range(8)), None, max_tokens=7)  # the caller passes len - 1
    assert len(hit.blocks) == 1 and hit.cow_tokens == 3 and kv.hit_tokens(hit) == 7


def test_salts_never_share_blocks():
    kv = KVCacheManager(32, BS, host_blocks=-1)
    fill(kv, "a", list(range(12)), salt="alice")
    kv.free("a")
    assert kv.hit_tokens(kv.match_prefix(list(range(12)), "bob", 11)) == 0
    assert kv.hit_tokens(kv.match_prefix(list(range(12)), None, 11)) == 0
    assert kv.hit_tokens(kv.match_prefix(list(range(12)), "alice", 11)) == 11


def test_host_tier_budget_and_off():
    off = KVCacheManager(32, BS, host_blocks=0)
    fill(off, "a", list(range(8)))
    off.free("a")
    assert off.num_cached_blocks == 0
    assert off.hit_tokens(off.match_prefix(list(range(8)), None, 7)) == 0
    small = KVCacheManager(32, BS, host_blocks=2)
    fill(small, "a", list(range(16)))  # 4 blocks
    small.free("a")
    assert small.num_cached_blocks == 2
    # the tail is released first and evicted first (LRU): the two earliest blocks stay
    assert small.hit_tokens(small.match_prefix(list(range(16)), None, 15)) == 8


def test_eviction_never_returns_stale_kv():
    kv = KVCacheManager(6, BS, host_blocks=-1)  # 5 usable blocks
    fill(kv, "a", list(range(12)))
    kv.free("a")
    fill(kv, "b", list(range(100, 116)))  # needs 4 blocks: evicts cached ones
    assert kv.num_free_blocks == 1
    hit = kv.match_prefix(list(range(12)), None, 11)
    assert kv.hit_tokens(hit) < 11  # something was evicted
    # whatever still matches must hold exactly the requested tokens
    pos = 0
    for bid in hit.blocks:
        assert kv.blocks[bid].token_ids == list(range(pos, pos + BS))
        pos += BS
    if hit.cow_src is not None:
        assert kv.blocks[hit.cow_src].token_ids[: hit.cow_tokens] == list(range(pos, pos + hit.cow_tokens))


def test_parked_slot_keeps_blocks_with_host_tier_off():
    kv = KVCacheManager(32, BS, host_blocks=0)
    fill(kv, "a", list(range(10)))
    kv.park("a", "slot:0")
    assert kv.hit_tokens(kv.match_prefix(list(range(10)), None, 9)) == 9
    assert kv.parked_tokens("slot:0") == list(range(10))
    kv.release_parked("slot:0")
    assert kv.hit_tokens(kv.match_prefix(list(range(10)), None, 9)) == 0
    assert kv.num_free_blocks == 31


# --- engine level ------------------------------------------------------------------


def core_for(path, **kw) -> EngineCore:
    kw.setdefault("n_ctx", 2048)
    kw.setdefault("dtype", "float32")
    return EngineCore(load_files(path), EngineConfig(**kw))


def run(core, ids, slot=-1, salt=None, cache_prompt=True, n_predict=2):
    r = Request(f"r{id(ids)}-{torch.randint(0, 1 << 30, (1,)).item()}", list(ids),
                SamplingParams(temperature=0, n_predict=n_predict, ignore_eos=True, cache_prompt=cache_prompt),
                priority_slot=slot, cache_salt=salt)
    core.add_request(r)
    outs = []
    while not outs or not outs[-1].finished:
        outs += [o for o in core.step() if o.request_id == r.request_id]
    last = outs[-1]
    return last.timings.cache_n, last.timings.prompt_n, [t for o in outs for t in o.new_token_ids]


PRE = list(range(10, 40))  # 30 shared tokens


@pytest.mark.parametrize("cache_ram,expect_last", [(0, 0), (8192, 37)])
def test_seed_example_9_sequence_on_one_slot(tiny_gguf, cache_ram, expect_last):
    """Seed 000 Example 9 with synthetic ids: (cache_n, prompt_n) per request on slot 0.

    Request 5 repeats request 1. llama-server's RAM cache holds only request 3's
    state there (30 tokens shared); our host tier still indexes request 1's own
    blocks, so all but the last token are reused (37). With --cache-ram 0: 0.
    """
    core = core_for(tiny_gguf, cache_ram=cache_ram, n_parallel=1)
    q1, q2, pasta = PRE + [50, 51, 52, 53, 54, 55, 56, 57], PRE + [60, 61, 62, 63, 64, 65, 66, 67], list(range(70, 77))
    assert run(core, q1, slot=0)[:2] == (0, 38)
    assert run(core, q2, slot=0)[:2] == (30, 8)
    assert run(core, q2, slot=0, cache_prompt=False)[:2] == (0, 38)
    assert run(core, pasta, slot=0)[:2] == (0, 7)
    assert run(core, q1, slot=0)[:2] == (expect_last, 38 - expect_last)
    assert core.stats.prompt_tokens_cached_total == 30 + expect_last
    assert core.stats.prompt_tokens_total == 38 + 8 + 38 + 7 + 38 - expect_last


def test_repeat_reuses_all_but_last_token(tiny_gguf):
    core = core_for(tiny_gguf)
    ids = list(range(5, 26))  # 21 tokens, as seed Example 5
    assert run(core, ids, slot=0)[:2] == (0, 21)
    assert run(core, ids, slot=0)[:2] == (20, 1)


def test_cross_slot_reuse_of_long_prefix_gives_same_greedy_output(tiny_gguf):
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 300, (1000,), generator=g).tolist()
    a_ids, b_ids = prefix + [5, 6, 7], prefix + [8, 9]
    cold = core_for(tiny_gguf, cache_ram=0, n_parallel=2, n_ctx=4096)
    ref = run(cold, b_ids, n_predict=12)
    warm = core_for(tiny_gguf, n_parallel=2, n_ctx=4096)
    run(warm, a_ids, slot=0, n_predict=2)
    cache_n, prompt_n, toks = run(warm, b_ids, slot=1, n_predict=12)
    assert (cache_n, prompt_n) == (1000, 2)
    assert toks == ref[2]  # exact: float32 weights, K/V rounded alike on both paths


def test_salt_isolation_in_engine(tiny_gguf):
    core = core_for(tiny_gguf)
    ids = list(range(100, 140))
    run(core, ids, salt="u1")
    assert run(core, ids, salt="u2")[0] == 0
    assert run(core, ids, salt="u1")[0] == 39


def test_small_host_tier_stays_correct_under_eviction(tiny_gguf):
    """Fill and evict repeatedly; every output equals a no-cache run."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 300, (60,), generator=g).tolist() for _ in range(6)]
    prompts += [p[:40] + [7, 8, 9] for p in prompts[:3]]
    ref = LLM(core_for(tiny_gguf, cache_ram=0)).generate(prompts, SamplingParams(temperature=0, n_predict=6,
                                                                                 ignore_eos=True))
    core = core_for(tiny_gguf, n_ctx=128, n_parallel=1, cache_ram=1)
    core.kv.host_blocks = 6  # 1 MiB holds 256 of the tiny model's blocks; keep the tier tiny
    hits = 0
    for rep in range(2):
        for p, r in zip(prompts, ref):
            cache_n, _, toks = run(core, p, slot=0, n_predict=6)
            hits += cache_n > 0
            assert toks == r.token_ids
    assert hits > 0
