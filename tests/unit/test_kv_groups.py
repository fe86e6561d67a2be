"""KV per layer group (issue #30 Build 3): sliding-window layers keep only the blocks their window
still sees, and prefix reuse still works for them (kvserve.engine.kv_cache's groups)."""

from __future__ import annotations

import pytest

from kvserve.engine.kv_budget import KVLayout, kv_layout, plan_pool
from kvserve.engine.kv_cache import KVCacheManager

BS = 16
W = 32  # a window of two blocks


def _run_seq(kv: KVCacheManager, rid: str, tokens: list[int], chunk: int = 1) -> int:
    """Compute ``tokens`` in chunks as the scheduler does (slide, allocate, record); returns the
    most live blocks the sliding group held at once."""
    most = 0
    pos = 0
    while pos < len(tokens):
        n = min(chunk, len(tokens) - pos)
        kv.slide(rid, pos)
        assert kv.allocate(rid, pos + n)
        most = max(most, sum(1 for b in kv.group_table(0, rid) if b))
        kv.record_tokens(rid, pos, tokens[pos:pos + n])
        pos += n
    return most


def _manager(host: int = 0, group_blocks: int = 64) -> KVCacheManager:
    return KVCacheManager(64, BS, host_blocks=host, groups=[(W, group_blocks, host)])


def test_sliding_group_holds_only_the_window():
    kv = _manager()
    toks = list(range(1, 201))
    most = _run_seq(kv, "a", toks)
    # decode one token at a time: the window's 32 tokens span at most 3 blocks
    assert most == 3
    table = kv.group_table(0, "a")
    assert len(table) == len(kv.block_table("a")) == 13
    # before position 200 - 32 + 1 = 169: blocks 0..9 (positions < 160) are released
    assert table[:10] == [0] * 10 and all(table[10:])
    assert kv.groups[0].num_free_blocks == 63 - 3
    assert kv.num_free_blocks == 63 - 13


def test_released_blocks_stay_in_the_host_tier():
    kv = _manager(host=64)
    _run_seq(kv, "a", list(range(1, 101)), chunk=10)
    g = kv.groups[0]
    # the last chunk (90..99) read from 90 - 31 = 59: blocks 0..2 (positions < 48) left, still indexed
    assert g.num_cached_blocks == 3
    kv.free("a")
    assert g.num_cached_blocks == 7 and kv.num_cached_blocks == 7


def test_hit_needs_the_window_before_the_prefix_end():
    kv = _manager()  # no host tier: released sliding blocks are gone
    toks = list(range(1, 101))
    _run_seq(kv, "a", toks, chunk=100)
    kv.slide("a", 100)
    kv.park("a", "slot:0")
    # group blocks 4, 5, 6 (positions 64..111) are parked; 0..3 were freed
    assert [b != 0 for b in kv.parked_table("slot:0")] == [True] * 7
    assert kv.groups[0].parked_table("slot:0")[:4] == [0] * 4
    same = toks + [500, 501]
    hit = kv.match_prefix(same, None, len(same) - 1)
    # full layers: 6 blocks + 4 tokens; the window needs positions 69..99: blocks 4, 5 and 4 rows of 6
    assert kv.hit_tokens(hit) == 100
    gh = hit.groups[0]
    assert gh.blocks[:4] == [0] * 4 and all(gh.blocks[4:]) and gh.cow_tokens == 4
    # a prompt that shares 50 tokens: the window before 50 (blocks 1, 2) is gone, and so is every
    # earlier block boundary's: nothing is reused
    other = toks[:50] + [900] * 30
    assert kv.hit_tokens(kv.match_prefix(other, None, len(other) - 1)) == 0


def test_hit_shrinks_to_a_block_boundary_the_window_covers():
    kv = _manager()
    toks = list(range(1, 101))
    _run_seq(kv, "a", toks, chunk=100)
    kv.slide("a", 100)
    kv.park("a", "slot:0")
    # shares 90 tokens: full layers hit 5 blocks + 10 tokens of block 5; the window before 90
    # (positions 59..89: blocks 3..5) lacks block 3; before 80 (blocks 3, 4) too; before 64
    # (positions 33..63: blocks 2, 3) too: nothing. Shares 99: window 68..98 = blocks 4..6, reused.
    p90 = toks[:90] + [900] * 20
    assert kv.hit_tokens(kv.match_prefix(p90, None, len(p90) - 1)) == 0
    p99 = toks[:99] + [900] * 20
    hit = kv.match_prefix(p99, None, len(p99) - 1)
    assert kv.hit_tokens(hit) == 99
    assert kv.allocate_prefix("b", hit)
    assert kv.take_copies() == [(kv.parked_table("slot:0")[6], kv.block_table("b")[6], 3)]
    g_src = kv.groups[0].parked_table("slot:0")[6]
    assert [(s, n) for s, _, n in kv.take_group_copies()[0]] == [(g_src, 3)]
    assert kv.group_table(0, "b")[:4] == [0] * 4


def test_a_whole_block_tail_past_the_indexed_keys_is_no_crash():
    """Two sequences computed the same blocks (two identical prompts admitted together, or one slot
    file restored into two slots): only the first's are indexed. Once it is dropped, the other's
    first block is found only as a child of the root, a whole block past the (empty) chain of
    indexed keys; the window check read past its list (IndexError in the scheduler: the request
    failed). Now the hit is what the indexed keys cover: nothing here, then 2 blocks again."""
    kv = _manager()
    toks = list(range(1, 49))
    _run_seq(kv, "a", toks, chunk=48)
    _run_seq(kv, "b", toks, chunk=48)
    kv.discard("a")
    hit = kv.match_prefix(toks + [99], None, 48)
    assert (kv.hit_tokens(hit), hit.blocks, hit.cow_src) == (0, [], None)
    _run_seq(kv, "c", toks[:32], chunk=32)  # indexes blocks 0 and 1 again
    hit = kv.match_prefix(toks + [99], None, 48)
    assert kv.hit_tokens(hit) == 32 and hit.blocks == kv.block_table("c")


def test_allocation_is_undone_when_a_group_runs_out():
    kv = KVCacheManager(64, BS, groups=[(W, 3, 0)])  # the group's pool: 2 usable blocks
    assert kv.allocate("a", 32)
    assert not kv.allocate("a", 48)  # the full layers had room, the window's pool did not
    assert len(kv.block_table("a")) == 2 and len(kv.group_table(0, "a")) == 2
    assert kv.num_free_blocks == 61
    kv.free("a")
    assert kv.num_free_blocks == 63 and kv.groups[0].num_free_blocks == 2


def test_parked_eviction_releases_every_group():
    kv = KVCacheManager(8, BS, groups=[(W, 8, 0)])
    _run_seq(kv, "a", list(range(1, 49)), chunk=48)
    kv.park("a", "slot:0")
    assert kv.allocate("b", 16 * 7)  # needs the parked blocks of the full layers
    assert kv.parked_keys() == [] and kv.groups[0].parked_keys() == []
    assert kv.groups[0].num_free_blocks == 0 and all(kv.group_table(0, "b"))


def test_no_shifting_with_groups():
    kv = _manager()
    _run_seq(kv, "a", list(range(1, 41)), chunk=40)
    kv.park("a", "slot:0")
    assert not kv.can_shift
    assert kv.reuse_shifted("b", [1, 2] + list(range(5, 41)), 2, "slot:0", 4, 39) == 2


def test_layout_and_budget_count_the_window():
    from kvserve.models.gemma import GemmaConfig

    cfg = GemmaConfig(arch="gemma3", n_vocab=300, n_embd=64, n_layer=12, n_head=4, n_head_kv=1, head_dim=64,
                      n_ff=128, n_ctx_train=32768, rms_eps=1e-6, rope_freq_base=1e6,
                      layer_windows=tuple(0 if i % 6 == 5 else 1024 for i in range(12)))
    lay = kv_layout(cfg, block_size=16, n_slots=1, max_num_batched_tokens=512, kv_dtype="f16")
    assert lay.windows == ((1024, (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)),)
    per_layer_block = 2 * 64 * 2 * 16  # K and V, 1 head of 64, f16, 16 tokens
    assert lay.block_bytes == 2 * per_layer_block and lay.all_block_bytes == 12 * per_layer_block
    assert lay.window_seq_blocks == (64 + 2 + 32,) and lay.window_pool_blocks == (2 * (64 + 2) + 32,)
    # one slot of 32k tokens: 2048 blocks in the 2 full layers, 164 in the 10 sliding ones (two
    # windows and a chunk): 0.233 of a full cache
    pool = lay.kv_bytes(2048, 1)
    assert pool == 2048 * 2 * per_layer_block + 164 * 10 * per_layer_block
    assert round(pool / (2048 * lay.all_block_bytes), 3) == 0.233
    # a budget: the sliding pool is paid first, the rest is full-layer blocks
    kw = dict(n_ctx=32768, n_ctx_slot=32768, n_slots=1, block_size=16, block_bytes=lay.block_bytes,
              source="--kv-cache-memory-bytes", windows=lay.costs())
    gbb = lay.window_block_bytes[0]
    plan = plan_pool(budget_bytes=4096 * lay.block_bytes + 164 * gbb, **kw)
    assert (plan.capped_from, plan.active_blocks) == (4096, 2048)  # one slot uses 2048 at most
    # one request needs its 2048 full-layer blocks and 98 sliding ones (a window and a chunk)
    assert plan_pool(budget_bytes=2048 * lay.block_bytes + 98 * gbb, **kw).active_blocks == 2048
    from kvserve.engine.kv_budget import KVCacheMemoryError

    with pytest.raises(KVCacheMemoryError, match="estimated maximum model length is 32752"):
        plan_pool(budget_bytes=2048 * lay.block_bytes + 98 * gbb - 1, **kw)
    assert isinstance(lay, KVLayout)


def test_gemma3_engine_with_window_pools_matches_transformers(tmp_path):
    """A gemma3 model whose sliding layers (window 32) keep their own pool: 16 greedy tokens equal
    transformers' after a 150-token prompt prefilled in chunks of 64, the sliding group holds only
    the window's blocks, and a resend of the prompt and its answer reuses all of it."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers", reason="transformers is a test-only dependency")
    import random

    import family_models as fmod
    from kvserve.config import EngineConfig
    from kvserve.engine.core import EngineCore
    from kvserve.engine.request import Request, SamplingParams
    from kvserve.models.build import load_files

    model = fmod.build("gemma3_text", seed=5, num_hidden_layers=7, sliding_window=W, query_pre_attn_scalar=16)
    loaded = load_files(str(fmod.save_hf(model, tmp_path / "hf")))
    eog = sorted(loaded.tokenizer.eog_token_ids)
    core = EngineCore(loaded, EngineConfig(n_ctx=512, dtype="float32", kv_dtype="f32", max_num_batched_tokens=64))
    # 4 slots of two windows (2 + 2 blocks each) and a 64-token chunk; 36 running blocks in the full layers
    assert core.pool.active_blocks == 512 // 16 + 4
    assert [(g.window, len(g.blocks)) for g in core.kv.groups] == [(W, 1 + 36 + core.kv.host_blocks)]
    assert core.runner.layer_group == [0, 0, 0, 0, 0, -1, 0]
    rng = random.Random(2)
    prompt = [rng.randrange(3, 300) for _ in range(150)]
    params = SamplingParams(n_predict=16, temperature=0.0, ignore_eos=True)

    def run(rid, ids):
        core.add_request(Request(rid, ids, params))
        toks, most, cached = [], 0, None
        while core.has_work():
            for out in core.step():
                toks += out.new_token_ids
                cached = out.num_cached_tokens
            if rid in core.scheduler.requests:
                most = max(most, sum(1 for b in core.kv.group_table(0, rid) if b))
        return toks, most, cached

    toks, most, cached = run("a", prompt)
    assert toks == fmod.reference_greedy(model, prompt, 16, eog)
    assert cached == 0
    assert most == 6  # a 64-token chunk and the 31 tokens before it: positions 33..127, blocks 2..7
    longer = prompt + toks
    toks2, most2, cached2 = run("b", longer)
    assert cached2 == len(longer) - 1  # everything but the last token, sliding layers included
    assert most2 == 3
    assert toks2 == fmod.reference_greedy(model, longer, 16, eog)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    """A tiny gemma3 HF directory: 7 layers (6 with a window of 32 tokens, layer 5 global), and
    its transformers model."""
    pytest.importorskip("transformers", reason="transformers is a test-only dependency")
    import family_models as fmod

    model = fmod.build("gemma3_text", seed=5, num_hidden_layers=7, sliding_window=W, query_pre_attn_scalar=16)
    return str(fmod.save_hf(model, tmp_path_factory.mktemp("g3") / "hf")), model


def test_memory_estimate_counts_the_windows(gemma3_dir):
    """The model manager's prediction counts the sliding layers at their windows: -c 4096 -np 2
    -b 256, f16: the global layer 4096 tokens; the 6 sliding layers two windows a slot (2 + 2
    blocks each) and one step's chunk (16 blocks): 0.25 of every layer at 4096 tokens."""
    from kvserve.serving.args import parse_args
    from kvserve.serving.manager import ModelSpec
    from kvserve.serving.chat_runner import estimate_runner_memory

    path, _ = gemma3_dir
    per_layer_token = 2 * 2 * 16 * 2  # K and V, 2 KV heads of 16, f16
    args = parse_args(["-m", path, "-c", "4096", "-np", "2", "-b", "256", "--cache-ram", "0"], environ={})
    kv = estimate_runner_memory(args, ModelSpec("m", path)).kv
    window_blocks = 2 * 2 * (2 + 2) + 256 // 16
    assert kv == 4096 * per_layer_token + window_blocks * 16 * 6 * per_layer_token
    full = 4096 * 7 * per_layer_token
    assert round(kv / full, 3) == 0.25


def _greedy_run(core, rid: str, prompt: list[int], n: int) -> tuple[list[int], int]:
    from kvserve.engine.request import Request, SamplingParams

    core.add_request(Request(rid, prompt, SamplingParams(n_predict=n, temperature=0.0, ignore_eos=True),
                             priority_slot=0))
    outs = []
    while core.has_work():
        outs += [o for o in core.step() if o.request_id == rid]
    return [t for o in outs for t in o.new_token_ids], outs[-1].num_cached_tokens


def test_slot_files_carry_each_group_and_cache_reuse_off_with_windows(gemma3_dir, tmp_path, caplog):
    """A slot saved from a gemma3 model (6 layers with a window of 32, one global) holds the global
    layer's every row and the sliding layers' last blocks only (version 3, per-layer first rows);
    restored into a fresh engine, the continuation equals the uninterrupted one token for token and
    reuses the same prefix; with the sliding rows zeroed it does not. --cache-reuse stays off."""
    import struct

    from kvserve.config import EngineConfig
    from kvserve.engine.core import EngineCore
    from kvserve.engine.request import Request, SamplingParams
    from kvserve.engine.slot_file import HEADER, read_slot_file
    from kvserve.models.build import load_files

    path, _ = gemma3_dir
    cfg = EngineConfig(n_ctx=512, n_parallel=1, dtype="float32", kv_dtype="f32")
    core = EngineCore(load_files(path), cfg)
    req = Request("a", list(range(3, 43)), SamplingParams(n_predict=2, temperature=0.0, ignore_eos=True,
                                                          n_cache_reuse=4), priority_slot=0)
    with caplog.at_level("WARNING", logger="kvserve.engine"):
        core.add_request(req)
    assert "cache_reuse is not supported by this context, it will be disabled" in caplog.text
    while core.has_work():
        core.step()
    prompt = [(7 * i) % 290 + 3 for i in range(100)]
    _greedy_run(core, "p", prompt, 8)
    parked = core.slot_tokens(0)
    assert len(parked) == 107
    f = tmp_path / "s.bin"
    assert core.save_slot(0, str(f)) == {"n_saved": 107, "n_written": f.stat().st_size}
    hdr, toks, layers, _ = read_slot_file(str(f), **core.slot_file_spec())
    # the query at 106 reads from 106 - 31 = 75: blocks from 64 on; layer 5 is global
    assert hdr.version == 3 and toks == parked
    assert hdr.layer_first == (64, 64, 64, 64, 64, 0, 64)
    assert [k.shape[0] for k, _ in layers] == [43] * 5 + [107, 43]
    row = 2 * 16 * 4  # 2 KV heads of 16, f32
    assert f.stat().st_size == HEADER.size + 4 * 107 + 4 * 7 + (6 * 43 + 107) * 2 * row
    nxt = parked + [77, 78, 79]
    ref, ref_cached = _greedy_run(core, "u", nxt, 12)  # the uninterrupted continuation
    assert ref_cached == 107
    fresh = EngineCore(load_files(path), cfg)
    assert fresh.restore_slot(0, str(f)) == {"n_restored": 107, "tokens": parked, "n_read": f.stat().st_size}
    assert [i for i, b in enumerate(fresh.kv.groups[0].parked_table("slot:0")) if b] == [4, 5, 6]
    got, cached = _greedy_run(fresh, "r", nxt, 12)
    assert (got, cached) == (ref, 107)
    # the sliding rows matter: zeroed, the continuation differs
    raw = bytearray(f.read_bytes())
    off = HEADER.size + 4 * 107 + 4 * 7
    raw[off: off + 43 * 2 * row] = bytes(43 * 2 * row)  # layer 0's K and V
    (tmp_path / "z.bin").write_bytes(bytes(raw))
    zeroed = EngineCore(load_files(path), cfg)
    zeroed.restore_slot(0, str(tmp_path / "z.bin"))
    assert _greedy_run(zeroed, "z", nxt, 12)[0] != ref
    assert struct.unpack_from("<H", raw, 6) == (3,)
    assert core.erase_slot(0)["n_erased"] > 0
    assert core.kv.groups[0].parked_keys() == []


def test_a_window_as_long_as_the_context_is_full_attention():
    from kvserve.engine.kv_budget import window_groups
    from kvserve.models.gemma import GemmaConfig

    cfg = GemmaConfig(arch="gemma2", n_vocab=300, n_embd=64, n_layer=4, n_head=4, n_head_kv=1, head_dim=16,
                      n_ff=128, n_ctx_train=8192, layer_windows=(4096, 0, 4096, 0))
    assert window_groups(cfg) == ((4096, (0, 2)),)
    assert window_groups(cfg, 4097) == ((4096, (0, 2)),)
    assert window_groups(cfg, 4096) == ()  # -c 4096: no query ever loses a key
    assert kv_layout(cfg, block_size=16, n_slots=1, max_num_batched_tokens=512, kv_dtype="f16",
                     n_ctx_slot=2048).windows == ()


def test_two_windows_each_keep_their_own_and_the_hit_agrees():
    kv = KVCacheManager(64, BS, groups=[(W, 64, 0), (64, 64, 0)])
    toks = list(range(1, 161))
    assert _run_seq(kv, "a", toks) == 3  # the 32-token window's group
    kv.slide("a", 160)
    # window 32 reads from 129 on: blocks 8, 9 held; window 64 from 97 on: blocks 6..9
    assert [[i for i, b in enumerate(kv.group_table(g, "a")) if b] for g in (0, 1)] == [[8, 9], [6, 7, 8, 9]]
    kv.park("a", "slot:0")
    # shares 150 tokens: window 32 needs 119..149 (block 7 is gone), and so does every earlier end
    p150 = toks[:150] + [999] * 5
    assert kv.hit_tokens(kv.match_prefix(p150, None, len(p150) - 1)) == 0
    # shares 159: window 32 needs 128..158 (block 8, 15 rows of 9), window 64 needs 96..158 (6..8, 15 of 9)
    p159 = toks[:159] + [999] * 5
    hit = kv.match_prefix(p159, None, len(p159) - 1)
    assert kv.hit_tokens(hit) == 159
    assert [[i for i, b in enumerate(g.blocks) if b] for g in hit.groups] == [[8], [6, 7, 8]]
    assert [g.cow_tokens for g in hit.groups] == [15, 15]


def test_only_a_module_that_reads_the_window_views_gets_groups(monkeypatch):
    from kvserve.engine.kv_budget import window_groups
    from kvserve.models.gemma import GemmaConfig, GemmaModel

    cfg = GemmaConfig(arch="gemma2", n_vocab=300, n_embd=64, n_layer=2, n_head=4, n_head_kv=1, head_dim=16,
                      n_ff=128, n_ctx_train=8192, layer_windows=(64, 0))
    assert window_groups(cfg) == ((64, (0,)),)
    monkeypatch.setattr(GemmaModel, "window_kv_views", False)  # a module that masks a full cache
    assert window_groups(cfg) == ()


def test_load_counts_the_sliding_layers_at_their_pool(gemma3_dir, monkeypatch):
    """load_runner's resident figure (``Runner.measured_bytes``: RSS growth plus the KV pool) counts
    each layer at its own pool: -c 512 -np 2 -b 64, f16: the global layer 34 blocks (512 / 16 and one
    partial block a slot), the 6 sliding layers 20 (two windows a slot, 2 * 2 * (2 + 2), and one
    step's chunk, 4), blocks of 16 tokens; not 34 blocks of all 7 layers as it counted before."""
    from kvserve.models.build import load_files
    from kvserve.serving import chat_runner
    from kvserve.serving.args import parse_args
    from kvserve.serving.manager import ModelSpec

    path, _ = gemma3_dir
    c = load_files(path).config
    per_layer_token = 2 * c.n_head_kv * c.head_dim * 2  # one layer's K and V of a token, f16
    monkeypatch.setattr(chat_runner, "rss_bytes", lambda: 0)  # the KV term alone
    args = parse_args(["-m", path, "--device", "cpu", "-c", "512", "-np", "2", "-b", "64", "--cache-ram", "0"],
                      environ={})
    runner = chat_runner.load_runner(args, ModelSpec("m", path), "test")
    try:
        core = runner.engine.core
        assert core.pool.active_blocks == 34 and core.kv_layout.windows == ((W, (0, 1, 2, 3, 4, 6)),)
        assert runner.measured_bytes == chat_runner.kv_pool_bytes(core) == (34 * 1 + 20 * 6) * 16 * per_layer_token
        assert core.pool.active_blocks * core.block_bytes == 34 * 7 * 16 * per_layer_token  # the former figure
    finally:
        runner.close()
