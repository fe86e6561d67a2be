"""phi3 with a sliding window on every layer (Phi-3-mini-4k: 2047 tokens) keeps only the blocks its
window still reaches, as gemma's sliding layers do (tests/unit/test_kv_groups.py): every layer in one
sliding group, the full-attention pool holding block tables and the prefix index at 0 bytes a block.
Outputs equal transformers' and the one-pool masked path; resends reuse their prefix; slot files carry
the window's rows; ``--cache-reuse`` stays off; the budget and the memory estimate count the window."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers is a test-only dependency ([test] extra)")

import family_models as fmod  # noqa: E402
from kvserve.config import EngineConfig  # noqa: E402
from kvserve.engine.core import EngineCore  # noqa: E402
from kvserve.engine.kv_budget import kv_layout, plan_pool, window_groups  # noqa: E402
from kvserve.engine.request import Request, SamplingParams  # noqa: E402
from kvserve.models.build import load_files  # noqa: E402
from kvserve.models.phi3 import Phi3Config, Phi3Model  # noqa: E402

W = 32  # the window (tokens); blocks of 16


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """A tiny phi3 (2 layers, both sliding over 32 tokens) as an HF directory, its transformers model
    and the tokenizer's end-of-generation ids (banned by ignore_eos, so the reference bans them too)."""
    model = fmod.build("phi3", seed=7, sliding_window=W)
    path = str(fmod.save_hf(model, tmp_path_factory.mktemp("phi3w") / "hf"))
    return path, model, sorted(load_files(path).tokenizer.eog_token_ids)


def _core(path: str, **cfg) -> EngineCore:
    cfg = {"n_ctx": 512, "dtype": "float32", "kv_dtype": "f32", "max_num_batched_tokens": 64, **cfg}
    return EngineCore(load_files(path), EngineConfig(**cfg))


def _run(core: EngineCore, rid: str, ids: list[int], n: int = 16, slot: int = -1) -> tuple[list[int], int, int]:
    """Greedy ``n`` tokens of ``ids``: (tokens, the most blocks the sliding group held, cache_n)."""
    core.add_request(Request(rid, ids, SamplingParams(n_predict=n, temperature=0.0, ignore_eos=True),
                             priority_slot=slot))
    toks, most, cached = [], 0, None
    while core.has_work():
        for out in core.step():
            if out.request_id == rid:
                toks += out.new_token_ids
                cached = out.num_cached_tokens
        if rid in core.scheduler.requests:  # the sliding group's blocks, else the one pool's
            table = core.kv.group_table(0, rid) if core.kv.groups else core.kv.block_table(rid)
            most = max(most, sum(1 for b in table if b))
    return toks, most, cached


def _cfg(**kw) -> Phi3Config:
    base = dict(arch="phi3", n_vocab=32064, n_embd=3072, n_layer=32, n_head=32, n_head_kv=32, head_dim=96,
                n_ff=8192, n_ctx_train=4096, rms_eps=1e-5, rope_freq_base=10000.0, rope_dim=96, window=2047)
    return Phi3Config(**{**base, **kw})


def test_every_layer_in_one_group_and_the_budget_pays_for_the_window():
    """Phi-3-mini-4k's shape at -c 16384: one group of all 32 layers, 0 bytes a full-pool block; the
    group's pool two windows a slot and a chunk (292 blocks, 0.285 of the unwindowed 1025); a budget
    caps the group's pool at what it pays for, keeps every slot's whole context in the (free) full
    pool, and needs only one request's window (128 + 2 + 32 blocks) where one pool needed 1024."""
    from kvserve.engine.kv_budget import KVCacheMemoryError

    c = _cfg()
    assert window_groups(c) == ((2047, tuple(range(32))),)
    assert window_groups(c, 2047) == ()  # a window as long as the context: full attention, one pool
    assert window_groups(_cfg(window=0)) == ()
    lay = kv_layout(c, block_size=16, n_slots=1, max_num_batched_tokens=512, kv_dtype="f16", n_ctx_slot=16384)
    per_block = 32 * 2 * 32 * 96 * 2 * 16  # every layer's K and V, f16, 16 tokens
    assert (lay.block_bytes, lay.all_block_bytes, lay.window_block_bytes) == (0, per_block, (per_block,))
    assert lay.window_pool_blocks == (2 * (128 + 2) + 32,) and lay.window_seq_blocks == (128 + 2 + 32,)
    assert lay.group_blocks(1025, 1) == [292] and lay.kv_bytes(1025, 1) == 292 * per_block
    assert lay.group_blocks(100, 1) == [100] and lay.group_blocks(1025, 1, cap=200) == [200]
    kw = dict(n_ctx=16384, n_ctx_slot=16384, n_slots=1, block_size=16, block_bytes=lay.block_bytes,
              windows=lay.costs())
    plan = plan_pool(**kw)
    assert (plan.active_blocks, plan.group_cap, plan.source) == (1025, None, "-c/-np")
    kw["source"] = "--kv-cache-memory-bytes"
    for budget, cap in ((2000 * per_block, 2000), (200 * per_block + 7, 200), (162 * per_block, 162)):
        plan = plan_pool(budget_bytes=budget, **kw)
        assert (plan.active_blocks, plan.group_cap, plan.tokens) == (1024, cap, 16384)
        assert lay.kv_bytes(plan.active_blocks, 1, plan.group_cap) <= budget
    # one pool of every layer refuses what the window's blocks serve
    with pytest.raises(KVCacheMemoryError):
        plan_pool(budget_bytes=162 * per_block, **{**kw, "block_bytes": per_block, "windows": ()})
    with pytest.raises(KVCacheMemoryError, match="estimated maximum model length is 2576"):
        plan_pool(budget_bytes=162 * per_block - 1, **kw)
    plan = plan_pool(num_blocks_override=300, **{**kw, "source": None})
    assert (plan.group_cap, plan.source) == (300, "--num-gpu-blocks-override")


def test_long_sequence_holds_the_window_and_equals_the_masked_path(phi3, monkeypatch):
    """A 150-token prompt in 64-token chunks and 16 greedy tokens: equal transformers' and the one-pool
    masked path (``window_kv_views`` off) token for token, with the group holding at most 6 blocks
    (a chunk and the 31 tokens before it) against the masked path's 11 (every token). A resend of the
    prompt and its answer reuses all but its last token (cache_n 165) and agrees again."""
    path, model, eog = phi3
    core = _core(path)
    assert [g.window for g in core.kv.groups] == [W] and core.runner.layer_group == [0, 0]
    assert core.kv_layout.block_bytes == 0
    # 4 slots: the group's pool two windows a slot (2 + 2 blocks) and a 64-token chunk (4 blocks)
    assert len(core.kv.groups[0].blocks) == 1 + 4 * 2 * (2 + 2) + 4 + core.kv.host_blocks
    rng = random.Random(3)
    prompt = [rng.randrange(3, 300) for _ in range(150)]
    want = fmod.reference_greedy(model, prompt, 16, eog)
    assert len(set(want)) >= 8
    toks, most, cached = _run(core, "a", prompt)
    assert (toks, most, cached) == (want, 6, 0)
    longer = prompt + toks
    toks2, most2, cached2 = _run(core, "b", longer)
    assert cached2 == len(longer) - 1 == 165
    assert most2 == 3
    assert toks2 == fmod.reference_greedy(model, longer, 16, eog)

    monkeypatch.setattr(Phi3Model, "window_kv_views", False)  # one pool for every layer, masked
    masked = _core(path)
    assert masked.kv.groups == [] and masked.model.window == W
    assert _run(masked, "a", prompt) == (want, 11, 0)  # 166 tokens: every block kept
    assert _run(masked, "b", longer) == (toks2, 12, 165)


def test_slot_files_and_cache_reuse_with_every_layer_sliding(phi3, tmp_path, caplog):
    """A slot of 107 tokens is saved with every layer from block 4 (the query at 106 reads from 75
    on); restored into a fresh engine, the continuation equals the uninterrupted one and reuses the
    same prefix. ``--cache-reuse`` is refused with llama-server's line (a shift cannot be exact)."""
    from kvserve.engine.slot_file import HEADER, read_slot_file

    path, _, _ = phi3
    core = _core(path, n_parallel=1)
    with caplog.at_level("WARNING", logger="kvserve.engine"):
        core.add_request(Request("x", list(range(3, 43)), SamplingParams(n_predict=2, temperature=0.0,
                                                                        ignore_eos=True, n_cache_reuse=4)))
    assert "cache_reuse is not supported by this context, it will be disabled" in caplog.text
    assert not core.kv.can_shift
    while core.has_work():
        core.step()
    prompt = [(7 * i) % 290 + 3 for i in range(100)]
    _run(core, "p", prompt, 8, slot=0)
    parked = core.slot_tokens(0)
    assert len(parked) == 107
    f = tmp_path / "s.bin"
    assert core.save_slot(0, str(f)) == {"n_saved": 107, "n_written": f.stat().st_size}
    hdr, toks, layers, _ = read_slot_file(str(f), **core.slot_file_spec())
    assert hdr.version == 3 and toks == parked and hdr.layer_first == (64, 64)
    assert [k.shape[0] for k, _ in layers] == [43, 43]
    c = core.model_config
    row = c.n_head_kv * c.head_dim * 4
    assert f.stat().st_size == HEADER.size + 4 * 107 + 4 * 2 + 2 * 43 * 2 * row
    nxt = parked + [77, 78, 79]
    ref, _, ref_cached = _run(core, "u", nxt, 12, slot=0)
    assert ref_cached == 107
    fresh = _core(path, n_parallel=1)
    assert fresh.restore_slot(0, str(f)) == {"n_restored": 107, "tokens": parked, "n_read": f.stat().st_size}
    assert [i for i, b in enumerate(fresh.kv.groups[0].parked_table("slot:0")) if b] == [4, 5, 6]
    got, _, cached = _run(fresh, "r", nxt, 12, slot=0)
    assert (got, cached) == (ref, 107)


def test_memory_estimate_counts_the_window(phi3):
    """The model manager's prediction at -c 4096 -np 2 -b 256, f16: both layers at two windows a slot
    (2 + 2 blocks each) and one step's chunk (16 blocks): 32 blocks of 256 (0.125 of a full cache)."""
    from kvserve.serving.args import parse_args
    from kvserve.serving.chat_runner import estimate_runner_memory
    from kvserve.serving.manager import ModelSpec

    path, _, _ = phi3
    c = load_files(path).config
    per_token = c.n_layer * 2 * c.n_head_kv * c.head_dim * 2  # every layer's K and V, f16
    args = parse_args(["-m", path, "-c", "4096", "-np", "2", "-b", "256", "--cache-ram", "0"], environ={})
    kv = estimate_runner_memory(args, ModelSpec("m", path)).kv
    assert kv == (2 * 2 * (2 + 2) + 256 // 16) * 16 * per_token
    assert round(kv / (4096 * per_token), 3) == 0.125


def test_a_slot_file_of_the_one_pool_layout_restores_into_the_group(phi3, tmp_path, monkeypatch):
    """A slot saved while phi3 kept one pool for every layer (every row from position 0, as kvserve
    before the window groups wrote it) restores into the sliding group (its last window's blocks) and
    continues exactly as the engine that saved it."""
    from kvserve.engine.slot_file import read_slot_file

    path, _, _ = phi3
    monkeypatch.setattr(Phi3Model, "window_kv_views", False)
    old = _core(path, n_parallel=1)
    assert old.kv.groups == []
    prompt = [(5 * i) % 290 + 3 for i in range(100)]
    _run(old, "p", prompt, 8, slot=0)
    parked = old.slot_tokens(0)
    f = tmp_path / "one-pool.bin"
    old.save_slot(0, str(f))
    hdr, _, layers, _ = read_slot_file(str(f), **old.slot_file_spec())
    assert [k.shape[0] for k, _ in layers] == [107, 107]  # every row
    nxt = parked + [77, 78, 79]
    ref, _, ref_cached = _run(old, "u", nxt, 12, slot=0)
    monkeypatch.setattr(Phi3Model, "window_kv_views", True)
    new = _core(path, n_parallel=1)
    assert [g.window for g in new.kv.groups] == [W]
    assert new.restore_slot(0, str(f))["n_restored"] == 107
    assert [i for i, b in enumerate(new.kv.groups[0].parked_table("slot:0")) if b] == [4, 5, 6]
    assert _run(new, "r", nxt, 12, slot=0)[::2] == (ref, ref_cached) and ref_cached == 107


def test_engine_with_a_kv_budget(phi3):
    """``--kv-cache-memory-bytes`` of 20 blocks of every layer (f32), below one request of 512 tokens
    in one pool (32 blocks): the engine starts, its group's pool holds the 20 blocks the budget pays
    for (4 slots' windows would take 37), its caches stay within the budget, and a 150-token prompt
    runs to the same tokens as transformers'."""
    path, model, eog = phi3
    c = load_files(path).config
    block = 16 * c.n_layer * 2 * c.n_head_kv * c.head_dim * 4  # every layer's K and V, f32
    core = _core(path, kv_cache_memory_bytes=20 * block, cache_ram=0)
    assert (core.pool.active_blocks, core.pool.group_cap) == (4 * 32, 20)
    assert len(core.kv.groups[0].blocks) == 1 + 20
    assert core.runner.kv_bytes == 21 * block  # the null block and the 20
    rng = random.Random(4)
    prompt = [rng.randrange(3, 300) for _ in range(150)]
    toks, most, _ = _run(core, "a", prompt)
    assert toks == fmod.reference_greedy(model, prompt, 16, eog) and most == 6


def test_load_logs_the_window_pool_bytes_not_every_layers(phi3, monkeypatch):
    """The resident figure load_runner measures (``Runner.measured_bytes``: RSS growth plus the KV pool,
    torch.empty memory resident only once written) counts the sliding group's blocks, not every
    layer's bytes for each of the pool's blocks. At -c 512 -np 2 -b 64, f16: the pool plans 34 blocks
    for running sequences (512 / 16 and one partial block a slot) at 0 bytes (no full-attention
    layer); the group holds two windows a slot (2 * 2 * (2 + 2) blocks) and one step's chunk (4):
    20 blocks of 16 tokens of every layer's K and V (the former figure: 34 blocks)."""
    from kvserve.serving import chat_runner
    from kvserve.serving.args import parse_args
    from kvserve.serving.manager import ModelSpec

    path, _, _ = phi3
    c = load_files(path).config
    per_token = c.n_layer * 2 * c.n_head_kv * c.head_dim * 2
    monkeypatch.setattr(chat_runner, "rss_bytes", lambda: 0)  # the KV term alone
    args = parse_args(["-m", path, "--device", "cpu", "-c", "512", "-np", "2", "-b", "64", "--cache-ram", "0"],
                      environ={})
    runner = chat_runner.load_runner(args, ModelSpec("m", path), "test")
    try:
        core = runner.engine.core
        assert (core.pool.active_blocks, core.kv_layout.block_bytes) == (34, 0)
        assert chat_runner.kv_pool_bytes(core) == runner.measured_bytes == 20 * 16 * per_token
        assert core.pool.active_blocks * core.block_bytes == 34 * 16 * per_token  # what was counted
    finally:
        runner.close()
