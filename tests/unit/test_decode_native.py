"""The native decode step (kvserve.models.decode_native): agreement with the eager model, batch
invariance, the default switch and the fallbacks. The tests that need the C++ build share one
build per session (tests/conftest.py's native_decode_build, into the user's cache: about 40 s of
one core when not cached yet)."""

import logging
import os
import subprocess
import sys

import pytest
import torch

import tinymodel
from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.request import Request, SamplingParams
from kvserve.models import decode_native
from kvserve.models.llama import AttentionBatch
from kvserve.models.build import build_model, load_files

NEEDS = decode_native.unavailable_reason()


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory):
    """Q4_1 projections, a Q8_0 head: head_dim 64, sizes multiples of 64 (the native step's shapes)."""
    return str(tinymodel.write_tiny_gguf(tmp_path_factory.mktemp("nat") / "q4.gguf", n_embd=256, n_ff=512, n_head=4,
                                         n_head_kv=2, qtype="Q4_1", embd_qtype="Q8_0", seed=13))


#: the native step's projections per case: the GGUF file's blocks of each type through the per-type
#: block products (Q4_1 with a Q8_0 head as SmolLM2's file; K-quants, Q8_0, Q5_0), and Q4_1 unpacked
#: into the step's own tiles (as HF int4 checkpoints are, or GGUF Q4 where the block kernels are off)
STEP_CASES = ["Q4_1", "Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q4_1-tiles"]


@pytest.fixture(scope="module", params=STEP_CASES)
def step_case(request, tmp_path_factory):
    """(path of a tiny GGUF for the case, whether its projections are unpacked into tiles)."""
    qtype = request.param.split("-")[0]
    path = tinymodel.write_tiny_gguf(tmp_path_factory.mktemp("nat") / f"{qtype}.gguf", n_embd=256, n_ff=512,
                                     n_head=4, n_head_kv=2, qtype=qtype, embd_qtype="Q8_0", seed=13)
    return str(path), request.param.endswith("-tiles")


@pytest.fixture
def step_model(step_case, monkeypatch):
    """The case's model (built with the block kernels off for the tile case) and its path."""
    path, tiles = step_case
    if tiles:
        monkeypatch.setenv("KVSERVE_GGML_KERNELS", "0")
    model = build_model(load_files(path), EngineConfig(n_ctx=1024), 1024)
    monkeypatch.delenv("KVSERVE_GGML_KERNELS", raising=False)
    lins = model.projections()
    assert all(lin.has_native_weights for lin in lins) if tiles else all(lin.blocks is not None for lin in lins)
    return model


@pytest.fixture(scope="module")
def built(native_decode_build):
    """The extension, built once per session by tests/conftest.py (into KVSERVE_EXTENSIONS_DIR), and loaded."""
    if NEEDS:
        pytest.skip(NEEDS)
    assert native_decode_build is not None
    assert decode_native.build_dir().is_relative_to(os.environ["KVSERVE_EXTENSIONS_DIR"])
    assert decode_native.load_cached() is not None
    return decode_native


def _core(path, **cfg) -> EngineCore:
    return EngineCore(load_files(path), EngineConfig(n_ctx=1024, n_parallel=8, kv_unified=True, **cfg))


def _prefill_caches(model, prompts, rows_per_seq=128):
    """Fresh f16 caches holding each prompt's K/V (eager prefill; sequence s at rows s*128..);
    returns (caches, the greedy next token of each prompt)."""
    c = model.config
    caches = [(torch.zeros(rows_per_seq * (len(prompts) + 1), c.n_head_kv, c.head_dim, dtype=torch.float16),
               torch.zeros(rows_per_seq * (len(prompts) + 1), c.n_head_kv, c.head_dim, dtype=torch.float16))
              for _ in range(c.n_layer)]
    nxt = []
    for s, p in enumerate(prompts):
        n = len(p)
        base = rows_per_seq * (s + 1)
        attn = AttentionBatch(positions=torch.arange(n), slot_mapping=torch.arange(n) + base)
        from kvserve.models.llama import PrefillGroup

        attn.prefills = [PrefillGroup(0, n, 0)]
        logits = model(torch.tensor(p), attn, caches, torch.tensor([n - 1]))
        nxt.append(int(logits.argmax(-1)))
    return caches, nxt


def _decode_batch(seqs, rows_per_seq=128):
    """seqs: (sequence index, token, position) -> (ids, positions, slots, kv_index [B, L], lens, mask)."""
    L = max(p for _, _, p in seqs) + 1
    ids = torch.tensor([t for _, t, _ in seqs])
    pos = torch.tensor([p for _, _, p in seqs])
    base = torch.tensor([rows_per_seq * (s + 1) for s, _, _ in seqs])
    lens = pos + 1
    idx = base[:, None] + torch.arange(L)[None]
    valid = torch.arange(L)[None] < lens[:, None]
    idx = torch.where(valid, idx, 0)
    return ids, pos, base + pos, idx, lens, valid.view(len(seqs), 1, 1, L)


def _clone(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


PROMPTS = [[5, 17, 200, 31, 8, 99, 4], [7, 7, 7], [100, 3, 40, 41, 42, 43, 44, 45, 46, 47, 48], [2, 250]]


@pytest.mark.slow
def test_native_step_agrees_with_eager(built, step_model):
    """8 decode steps, 4 sequences per step, both paths fed the eager path's greedy tokens: logits
    within 2% of their range (int8 activations per block of 32 vs bfloat16), and the same greedy
    token wherever the eager top two are further apart than the paths' difference could bridge
    (a near tie may flip either way; on the AVX2 build one row of SmolLM2's tiny stand-in has its
    top two 0.004 apart). Every case of STEP_CASES: the block products' cases run the same projections
    as the eager path, so there only attention and the norms differ."""
    model = step_model
    assert model.native_decode
    caches, nxt = _prefill_caches(model, PROMPTS)
    eager_caches = _clone(caches)
    nat = decode_native.NativeDecode(model, caches, 16)
    nat.start()
    assert nat.wait(120) and nat.native_head and nat.reason is None
    toks, pos = list(nxt), [len(p) for p in PROMPTS]
    worst, checked, agreed, same = 0.0, 0, 0, 0
    for _ in range(8):
        ids, p, slots, idx, lens, mask = _decode_batch([(s, toks[s], pos[s]) for s in range(4)])
        ln = nat(ids, p, slots, idx, lens, caches)
        attn = AttentionBatch(positions=p, slot_mapping=slots, n_decode=4, decode_kv_index=idx, decode_mask=mask)
        le = model(ids, attn, eager_caches, None)
        diff = (ln - le).abs().max(-1).values
        worst = max(worst, ((ln - le).abs().max() / (le.max() - le.min())).item())
        top = le.topk(2, -1).values
        for r in range(4):
            same += int(ln[r].argmax() == le[r].argmax())
            if top[r, 0] - top[r, 1] > 2 * diff[r]:  # no rounding of this size can swap them
                checked += 1
                agreed += int(ln[r].argmax() == le[r].argmax())
        toks = le.argmax(-1).tolist()
        pos = [q + 1 for q in pos]
    assert worst < 0.02
    assert checked >= 16 and agreed == checked  # 22 of 32 rows here
    if built.load_cached().ISA == "avx512":  # there the free-running chains matched: every row but one
        assert same >= 31  # Q4_1: the step's tiles against the eager block products, one near tie flipped
    assert nat.calls == 8


@pytest.mark.slow
def test_native_step_batch_invariant(built, step_model):
    """A row's logits alone and in a step of 5 rows (of other sequences) are identical (every case
    of STEP_CASES)."""
    model = step_model
    prompts = PROMPTS + [[9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13]]
    caches, nxt = _prefill_caches(model, prompts)
    nat = decode_native.NativeDecode(model, caches, 16)
    nat.start()
    assert nat.wait(120)
    together = _clone(caches)
    alone = nat(*_decode_batch([(2, nxt[2], len(prompts[2]))])[:5], caches)
    batch = nat(*_decode_batch([(s, nxt[s], len(prompts[s])) for s in range(5)])[:5], together)
    assert alone.shape == (1, model.config.n_vocab) and batch.shape == (5, model.config.n_vocab)
    assert torch.equal(alone[0], batch[2])
    # and the K/V each row left in the cache
    row = 128 * 3 + len(prompts[2])
    assert all(torch.equal(a[0][row], b[0][row]) and torch.equal(a[1][row], b[1][row]) for a, b in zip(caches, together))


@pytest.mark.slow
def test_engine_uses_native_step_by_default(built, q4_gguf):
    """An engine on a Q4 model decodes through the native step (loaded from the cache at start);
    a sequence's greedy tokens alone equal its tokens while 4 other sequences decode beside it
    (they are prefilled first: a prompt's own K/V depend on the size of its prefill step, as before)."""
    p = SamplingParams(temperature=0, n_predict=10, ignore_eos=True)

    def run(core, first, others):
        reqs = [Request(f"o{i}", q, SamplingParams(temperature=0, n_predict=40, ignore_eos=True))
                for i, q in enumerate(others)]
        for r in reqs:
            core.add_request(r)
        if reqs:
            core.step()
        target = Request("t", first, p)
        core.add_request(target)
        out = []
        while len(out) < 10:
            for o in core.step():
                if o.request_id == "t":
                    out.extend(o.new_token_ids)
        return out

    core = _core(q4_gguf)
    nat = core.runner.native
    assert nat is not None and nat.wait(120)  # cached: ready once the weights are packed
    alone = run(core, PROMPTS[0], [])
    assert nat.calls == 10  # the prompt's last token runs natively too (Scheduler.split_last_token)
    together = run(_core(q4_gguf), PROMPTS[0], PROMPTS[1:] + [[3, 1, 4, 1, 5]])
    assert together == alone


def test_default_switch(q4_gguf, monkeypatch, tmp_path):
    """On by default for Q4 weights with dtype auto; off with --dtype float32, --compile,
    KVSERVE_NATIVE_DECODE=0 and float weights."""
    loaded = load_files(q4_gguf)

    def on(**cfg):
        m = build_model(loaded, EngineConfig(n_ctx=1024, **cfg), 1024)
        return m.native_decode

    if not decode_native.cpu_supported():
        assert on() is False
        return
    assert on() is True
    assert on(dtype="float32") is False
    assert on(compile=True) is False
    monkeypatch.setenv("KVSERVE_NATIVE_DECODE", "0")
    assert on() is False
    fp32 = str(tinymodel.write_tiny_gguf(tmp_path / "f.gguf", n_embd=256, n_ff=512, n_head=4, n_head_kv=2))
    monkeypatch.delenv("KVSERVE_NATIVE_DECODE")
    assert build_model(load_files(fp32), EngineConfig(n_ctx=1024), 1024).native_decode is False  # float weights


def test_fallback_without_compiler(q4_gguf, monkeypatch, caplog):
    """No compiler (simulated): the reason is logged once, nothing is built, and decoding is eager:
    the same tokens as with the native step turned off."""
    monkeypatch.setattr(decode_native, "unavailable_reason", lambda: "no C++ compiler (g++)")
    monkeypatch.setattr(decode_native, "ensure_started", lambda cb: pytest.fail("no build without a compiler"))
    p = SamplingParams(temperature=0, n_predict=6, ignore_eos=True)
    from kvserve.llm import LLM

    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        core = _core(q4_gguf)
    nat = core.runner.native
    if nat is None:  # a CPU the step is not built for: the model never asked for it
        assert not decode_native.cpu_supported()
        return
    assert (nat.ready, nat.reason) == (False, "no C++ compiler (g++)")
    assert "native decode step off: no C++ compiler (g++); decoding eagerly" in caplog.text
    got = LLM(core).generate([PROMPTS[0], PROMPTS[2]], p)
    monkeypatch.setenv("KVSERVE_NATIVE_DECODE", "0")
    ref = LLM(_core(q4_gguf)).generate([PROMPTS[0], PROMPTS[2]], p)
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    assert nat.calls == 0


def test_failed_build_logs_and_stays_eager(monkeypatch, caplog):
    """A build that fails (simulated) calls back with None and logs why; later engines do not retry."""
    monkeypatch.setattr(decode_native, "_module", None)
    monkeypatch.setattr(decode_native, "_build_thread", None)
    monkeypatch.setattr(decode_native, "_build_error", None)
    monkeypatch.setattr(decode_native, "waiters", [])
    monkeypatch.setattr(decode_native, "load_cached", lambda: None)
    monkeypatch.setattr(decode_native, "build_in_child", lambda: "build exited 1: error: no such file")
    got = []
    with caplog.at_level(logging.WARNING, logger="kvserve.engine"):
        decode_native.ensure_started(got.append)
        assert decode_native.wait_build(30) is False
    assert got == [None]
    assert "native decode step not available, decoding eagerly: build exited 1: error: no such file" in caplog.text
    decode_native.ensure_started(got.append)  # no second build
    assert got == [None, None]


def test_pack_q8_reproduces_q8_0_blocks():
    """A Q8_0 head (w = d * q, d float16, max |q| = 127 per block) is packed exactly: unpacking the
    pair order and the +128 offset gives back q and d."""
    g = torch.Generator().manual_seed(0)
    n, k = 8, 128
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g)
    q[:, :, 5] = 127
    d = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).to(torch.float16)
    w = (d.float().unsqueeze(-1) * q.float()).reshape(n, k)
    wq, wd = decode_native.pack_q8(w)
    assert (wq.dtype, wq.shape, wd.dtype, wd.shape) == (torch.uint8, (n, k), torch.float16, (n, k // 32))
    assert torch.equal(wd, d)
    p = torch.arange(64)
    lane = p // 4
    blk, idx = lane % 2, 4 * (lane // 2) + p % 4
    back = torch.empty(n, k // 64, 2, 32, dtype=torch.long)
    back[:, :, blk, idx] = wq.view(n, k // 64, 64).long() - 128
    assert torch.equal(back.view(n, k // 32, 32), q)


def test_pack_torch_equals_pack():
    """The torch packing the native step uses (GIL released) gives q4_kernel.pack's tensors."""
    import numpy as np

    from kvserve.models import q4_kernel

    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (48, 128)).astype(np.uint8)
    s = rng.random((48, 4)).astype(np.float32)
    z = rng.random((48, 4)).astype(np.float32)
    for a, b in zip(q4_kernel.pack(q, s, z), q4_kernel.pack_torch(q, s, z)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _pad_rows(t: torch.Tensor, multiple: int, value: int = 0) -> torch.Tensor:
    """t [N, ...] with rows of ``value`` appended up to a multiple of ``multiple``."""
    extra = -t.shape[0] % multiple
    return torch.cat([t, t.new_full((extra, *t.shape[1:]), value)]) if extra else t


def test_tile_layout_puts_row_i_in_lane_i():
    """The AVX512 step's tile layout (q4_kernel.to_tiles): in tile T, block b, 4-bit vector t lane i
    holds values 4t..4t+3 of row 16T+i's block b in its low nibbles and 16+4t..16+4t+3 in its high
    ones; int8 vector t lane i holds values 4t..4t+3 (plus 128); the scales go [T][block][16];
    the head is padded to 16 rows with zero weights; inverse=True undoes each."""
    import numpy as np

    from kvserve.models import q4_kernel

    rng = np.random.default_rng(1)
    n, k = 32, 576  # two tiles; 18 blocks (not a multiple of 16 blocks)
    q = rng.integers(0, 16, (n, k)).astype(np.uint8)
    s = rng.random((n, k // 32)).astype(np.float32)
    wq, wd, _ = q4_kernel.pack(q, s, s)
    g = q4_kernel.to_tiles(wq, "q4")
    assert g.dtype == torch.uint8 and g.shape == wq.shape
    gb = g.numpy().reshape(-1)
    for tile in range(2):
        for b in (0, 1, 7, 17):
            for t in range(4):
                for i in (0, 5, 15):
                    off = tile * 16 * (k // 2) + 256 * b + 64 * t + 4 * i
                    word = gb[off: off + 4]
                    blk = q[16 * tile + i, 32 * b: 32 * b + 32]
                    assert list(word & 15) == list(blk[4 * t: 4 * t + 4])
                    assert list(word >> 4) == list(blk[16 + 4 * t: 20 + 4 * t])
    assert torch.equal(q4_kernel.to_tiles(g, "q4", inverse=True), wq)
    td = q4_kernel.scales_to_tiles(wd)
    assert td.view(-1)[(1 * (k // 32) + 3) * 16 + 7] == wd[16 + 7, 3]
    assert torch.equal(q4_kernel.scales_to_tiles(td, inverse=True), wd)
    with pytest.raises(ValueError, match="rows in 16s"):
        q4_kernel.to_tiles(wq[:8], "q4")
    nh = 21  # a vocabulary that is not a multiple of 16
    w = torch.from_numpy(rng.standard_normal((nh, k)).astype(np.float32))
    q8, d8 = decode_native.pack_q8(w)
    t8, td8 = decode_native.pack_q8(w, "tile16")
    assert t8.shape == (32, k) and td8.shape == (32, k // 32)
    back = q4_kernel.to_tiles(t8, "int8", inverse=True)
    assert torch.equal(back[:nh], q8) and bool((back[nh:] == 128).all())
    dback = q4_kernel.scales_to_tiles(td8, inverse=True)
    assert torch.equal(dback[:nh], d8) and bool((dback[nh:] == 0).all())
    # the pair order's values per block (as test_pack_q8_reproduces_q8_0_blocks unpacks them)
    p = torch.arange(64)
    lane = p // 4
    blk, idx = lane % 2, 4 * (lane // 2) + p % 4
    vals = torch.empty(nh, k // 64, 2, 32, dtype=torch.long)
    vals[:, :, blk, idx] = q8.view(nh, k // 64, 64).long()
    vals = vals.view(nh, k // 32, 32)
    flat = t8.view(-1)
    for row in (0, 9, 16, 20):
        tile, i = divmod(row, 16)
        for b in (0, 3, 17):
            for t in range(8):
                off = tile * 16 * k + 512 * b + 64 * t + 4 * i
                assert torch.equal(flat[off: off + 4].long(), vals[row, b, 4 * t: 4 * t + 4])


def test_direct_tile_packing_equals_the_pair_route(monkeypatch):
    """q4_kernel.pack_tiles (start-up's route) gives exactly to_tiles of pack_torch's pair order and
    scales_to_tiles of its scales; pack_q8 in tiles, quantizing a few rows at a time (chunks of 32
    here, 69 rows: two whole chunks and a partial tile), gives to_tiles of its pair order padded."""
    import numpy as np

    from kvserve.models import q4_kernel

    rng = np.random.default_rng(3)
    for n, k in ((48, 576), (16, 64), (32, 1536)):
        q = rng.integers(0, 16, (n, k)).astype(np.uint8)
        sc = rng.random((n, k // 32)).astype(np.float32)
        zr = rng.random((n, k // 32)).astype(np.float32)
        direct = q4_kernel.pack_tiles(q, sc, zr)
        wq, wd, wm = q4_kernel.pack_torch(q, sc, zr)
        assert torch.equal(direct[0], q4_kernel.to_tiles(wq, "q4"))
        assert torch.equal(direct[1], q4_kernel.scales_to_tiles(wd))
        assert torch.equal(direct[2], q4_kernel.scales_to_tiles(wm))
    with pytest.raises(ValueError, match="rows in 16s"):
        q4_kernel.pack_tiles(q[:8], sc[:8], zr[:8])
    monkeypatch.setattr(decode_native, "PACK_Q8_ROWS", 32)
    w = torch.from_numpy(rng.standard_normal((69, 128)).astype(np.float32))
    w[5, :32] = 0.0  # an all-zero block: d = 0, q = 0
    q8, d8 = decode_native.pack_q8(w)
    t8, td8 = decode_native.pack_q8(w, "tile16")
    assert torch.equal(t8, q4_kernel.to_tiles(_pad_rows(q8, 16, 128), "int8"))
    assert torch.equal(td8, q4_kernel.scales_to_tiles(_pad_rows(d8, 16)))
    monkeypatch.setattr(decode_native, "PACK_Q8_ROWS", 4096)
    assert all(torch.equal(a, b) for a, b in zip(decode_native.pack_q8(w), (q8, d8)))


def test_grammar_warmup_waits_for_a_cached_steps_packing():
    """Start-up: with a cached native step the structured-output warm-up (xgrammar's import and
    vocabulary table) starts only once the step's weights are packed (the engine's first step
    waits for that packing; both at once on 2 cores made the first request wait ~1.3-2 s), at
    most 30 s; without a cached step it starts at once."""
    from kvserve.serving.chat_runner import _warm_grammars

    order = []

    class Native:
        def __init__(self, cached):
            self.cached = cached

        def packed(self, timeout):
            order.append(("packed", timeout))
            return True

    class Grammars:
        def _get_compiler(self):
            order.append("compiler")

    class Slots:
        n_busy = n_deferred = 0

    class Runner:  # an idle runner (the warm-up then waits WARMUP_IDLE_S for quiet slots)
        grammars, slots, engine = Grammars(), Slots(), object()

    _warm_grammars(Runner(), Native(True), idle_s=0.01)
    assert order == [("packed", 30.0), "compiler"]
    order.clear()
    _warm_grammars(Runner(), Native(False), idle_s=0.01)
    _warm_grammars(Runner(), None, idle_s=0.01)
    assert order == ["compiler", "compiler"]


@pytest.mark.slow
def test_verification_rows_equal_rows_decoded_one_by_one(built, step_model):
    """Speculative decoding's verification chunk (5 positions of one sequence in one step, their cache
    rows shared: attention reads them once for all rows) gives each position the same logits, bit for
    bit, as decoding the positions one step at a time; at 300+ cached tokens, so a query's keys span
    two attention chunks (merged in order). Every case of STEP_CASES."""
    model = step_model
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 250, (300,), generator=g).tolist()
    other = [7, 8, 9, 10, 11]
    caches, nxt = _prefill_caches(model, [prompt, other], rows_per_seq=512)
    nat = decode_native.NativeDecode(model, caches, 16)
    nat.start()
    assert nat.wait(120)
    toks = [nxt[0], 17, 99, 4, 250]
    one_by_one, beside, eager = _clone(caches), _clone(caches), _clone(caches)
    rows = [(0, t, len(prompt) + i) for i, t in enumerate(toks)]
    chunk = nat(*_decode_batch(rows, rows_per_seq=512)[:5], caches)
    alone = torch.cat([nat(*_decode_batch([r], rows_per_seq=512)[:5], one_by_one) for r in rows])
    assert chunk.shape == alone.shape == (5, model.config.n_vocab)
    assert torch.equal(chunk, alone)
    # the chunk between another sequence's decode rows (groups of their own)
    mixed = nat(*_decode_batch([(1, nxt[1], 5)] + rows + [(1, nxt[1], 5)], rows_per_seq=512)[:5], beside)
    assert torch.equal(mixed[1:6], alone) and torch.equal(mixed[0], mixed[6])
    # the merged chunks agree with the eager path (as test_native_step_agrees_with_eager: 2% of the range)
    for i, r in enumerate(rows):
        ids, p, slots, idx, lens, mask = _decode_batch([r], rows_per_seq=512)
        le = model(ids, AttentionBatch(positions=p, slot_mapping=slots, n_decode=1, decode_kv_index=idx,
                                       decode_mask=mask), eager, None)
        assert ((alone[i] - le[0]).abs().max() / (le.max() - le.min())).item() < 0.02


def _greedy(core, rid, prompt, n=8):
    """Step ``core`` until request ``rid`` (greedy, ``n`` tokens) finished; its token ids."""
    core.add_request(Request(rid, prompt, SamplingParams(temperature=0, n_predict=n, ignore_eos=True)))
    out = []
    while len(out) < n:
        for o in core.step():
            if o.request_id == rid:
                out.extend(o.new_token_ids)
    return out


def test_cached_build_decodes_natively_from_the_first_step(built, q4_gguf):
    """With a cached build the engine's first step waits for the weights' packing: no decode step
    runs eagerly, even one taken at once after engine creation (a server's first request)."""
    core = _core(q4_gguf)
    nat, runner = core.runner.native, core.runner
    assert (nat.cached, nat.reason) == (True, None)
    toks = _greedy(core, "a", PROMPTS[0], 8)
    assert (runner.eager_decode_steps, nat.calls) == (0, 8)  # the prompt's last token and 7 decodes
    assert _greedy(_core(q4_gguf), "a", PROMPTS[0], 8) == toks  # the same answer from a new engine


def test_late_build_switches_only_when_idle(built, q4_gguf, monkeypatch, caplog):
    """A build that finishes while a request decodes (simulated: a monkeypatched loader) is
    switched on only at the next step with no request running, logged once; the request that was
    running keeps the eager path to its end (its tokens are eager decoding's), the next one runs
    natively from its first decode step (its tokens are a cached build's). A model of GGUF blocks
    builds the extension at load (its eager products need it); a late build concerns unpacked Q4
    weights (an HF int4 checkpoint, or GGUF Q4 with the block kernels off, as here)."""
    import threading

    monkeypatch.setenv("KVSERVE_GGML_KERNELS", "0")
    real = decode_native.load_cached()
    release = threading.Event()
    monkeypatch.setattr(decode_native, "_module", None)
    monkeypatch.setattr(decode_native, "_build_thread", None)
    monkeypatch.setattr(decode_native, "_build_error", None)
    monkeypatch.setattr(decode_native, "waiters", [])
    monkeypatch.setattr(decode_native, "load_cached", lambda: real if release.is_set() else None)
    monkeypatch.setattr(decode_native, "build_in_child", lambda **kw: None if release.wait(60) else "timeout")
    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        core = _core(q4_gguf)
        nat, runner = core.runner.native, core.runner
        assert (nat.cached, nat.ready) == (False, False)
        core.add_request(Request("a", PROMPTS[0], SamplingParams(temperature=0, n_predict=12, ignore_eos=True)))
        a = []
        for _ in range(4):
            a += [t for o in core.step() for t in o.new_token_ids]
        assert len(a) == 4 and runner.eager_decode_steps == 3
        release.set()
        assert nat._done.wait(30) and nat.reason is None  # loaded, not switched on
        while len(a) < 12:
            a += [t for o in core.step() for t in o.new_token_ids]
        assert (runner.eager_decode_steps, nat.calls, nat.ready) == (11, 0, False)  # "a" stayed eager
        b = _greedy(core, "b", PROMPTS[2], 8)  # its first step finds the engine idle
    assert (runner.eager_decode_steps, nat.calls, nat.ready) == (11, 8, True)  # b's last prompt token too
    assert caplog.text.count("decode moved to the native step") == 1
    monkeypatch.setenv("KVSERVE_NATIVE_DECODE", "0")
    assert a == _greedy(_core(q4_gguf), "a", PROMPTS[0], 12)
    monkeypatch.delenv("KVSERVE_NATIVE_DECODE")
    monkeypatch.setattr(decode_native, "load_cached", lambda: real)
    assert b == _greedy(_core(q4_gguf), "b", PROMPTS[2], 8)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)  # a zombie: dead
    except (FileNotFoundError, ProcessLookupError):  # gone, or gone between open and read (ESRCH)
        return True


def test_build_child_dies_with_its_parent(tmp_path):
    """A server killed (SIGKILL) while its build runs takes the build with it: the child and
    what it started (the compiler, which ninja starts in a process group of its own; here a sleep
    in a new session) are gone within seconds, no orphan compiles on."""
    import signal
    import subprocess
    import sys
    import time

    pids = tmp_path / "pids"
    child = ("import os, subprocess, sys; from kvserve.models import decode_native as d; "
             "d._die_with_parent(int(os.environ['KVSERVE_BUILD_PARENT'])); "
             "p = subprocess.Popen(['sleep', '120'], start_new_session=True); "
             f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{p.pid}}'); p.wait()")
    parent = ("import sys; from kvserve.models import decode_native as d; "
              f"d.build_in_child(cmd=[sys.executable, '-c', {child!r}])")
    srv = subprocess.Popen([sys.executable, "-c", parent])
    try:
        t0 = time.monotonic()
        while not (pids.exists() and len(pids.read_text().split()) == 2) and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        kids = [int(x) for x in pids.read_text().split()]
        assert not any(_gone(k) for k in kids)
    finally:
        srv.send_signal(signal.SIGKILL)
        srv.wait()
    t0 = time.monotonic()
    while not all(_gone(k) for k in kids) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert [_gone(k) for k in kids] == [True, True]


def test_builders_take_turns(monkeypatch, tmp_path):
    """build_now holds an exclusive flock on <build dir>.lock around torch's build (a second
    builder of the directory waits) and removes a stale torch lock file (a killed builder's)."""
    import fcntl

    import torch.utils.cpp_extension as cpp

    monkeypatch.setenv("KVSERVE_EXTENSIONS_DIR", str(tmp_path / "ext"))
    d = decode_native.build_dir()
    assert d.parent == tmp_path / "ext"
    d.mkdir(parents=True)
    (d / "lock").write_text("")  # left by a builder that was killed
    seen = []

    def fake_load(**kw):
        with open(str(d) + ".lock") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen.append("free")
            except BlockingIOError:
                seen.append("held")
        seen.append((d / "lock").exists())
        seen.append(kw["build_directory"])

    monkeypatch.setattr(cpp, "load", fake_load)
    decode_native.build_now()
    assert seen == ["held", False, str(d)]
    with open(str(d) + ".lock") as other:  # released after the build
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_prompt_last_token_runs_natively_cold_and_warm(built, q4_gguf):
    """While the native step runs, a prompt's last token gets a step of its own in that step,
    cold (the rest prefilled eagerly) and warm (all but the last token cached): the same first
    token and logprobs either way (llama-server's cache_prompt promise; found as stream !=
    non-stream at temperature 0.7 when only the warm one ran natively), and a warm prompt's time to
    first token is one native step, not an eager forward."""
    core = _core(q4_gguf)
    nat, runner = core.runner.native, core.runner
    p = SamplingParams(temperature=0, n_predict=8, ignore_eos=True, n_probs=3)
    from kvserve.llm import LLM

    llm = LLM(core)
    cold = llm.generate([PROMPTS[2]], p)[0]
    assert (runner.eager_decode_steps, nat.calls) == (0, 8)  # the prompt's last token and 7 decodes
    cached = core.stats.prompt_tokens_cached_total
    warm = llm.generate([PROMPTS[2]], p)[0]
    assert core.stats.prompt_tokens_cached_total - cached == len(PROMPTS[2]) - 1  # all but the last token
    assert warm.token_ids == cold.token_ids
    assert warm.logprobs == cold.logprobs
    assert (runner.eager_decode_steps, nat.calls) == (0, 16)


def test_quantize_vectorized_equals_scalar_and_reference(built):
    """The activations' int8 quantization (AVX2, run before every projection) gives the same bytes
    and scales as the scalar loop it replaced and as a torch reference of the rule: d = max|x| / 127
    per block of 32, q = round half to even of x * (1 / d), 32-bit words of the two blocks of a
    pair alternating; xsum = d * sum(q). Zero blocks, tiny values and exact halves included."""
    mod = built.load_cached()
    assert mod.ISA in ("avx2", "avx512")
    g = torch.Generator().manual_seed(5)
    for m, k in ((1, 64), (3, 576), (16, 1536), (2, 128)):
        x = torch.randn(m, k, generator=g) * 3
        x[0, :32] = 0.0  # an all-zero block: d = 0, q = 0
        x[-1, 32:64] *= 1e-30
        x[:, 64::7] = torch.round(x[:, 64::7]) + 0.5
        vec, ref = mod.quantize(x, False), mod.quantize(x, True)
        assert all(torch.equal(a, b) for a, b in zip(vec, ref))
        xb = x.view(m, k // 32, 32)
        d = xb.abs().amax(-1) / 127.0
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = torch.round(xb * inv.unsqueeze(-1)).to(torch.int8)  # [m, blocks, 32]
        words = q.view(m, k // 64, 2, 8, 4).transpose(2, 3).reshape(m, k)  # block 0 and 1 word by word
        assert torch.equal(vec[0], words)
        assert torch.equal(vec[1], d)
        assert torch.equal(vec[2], d * q.sum(-1).float())


def test_step_kernels_match_float64_references(built):
    """The step's 4-bit projection and int8 head kernels in the build's layout (tiles of 16 rows on
    AVX512, the pair order on AVX2) against float64 references of the same arithmetic (int8
    activations per block of 32, exact integer dot products): within float32 rounding for 1-17 rows,
    K 576 (18 blocks: not whole segments of 16) and 128, a head of 21 rows (padded to 32 in tiles,
    the padding never returned); and each row's outputs are the same bits whatever M is."""
    import numpy as np

    from kvserve.models import q4_kernel

    mod = built.load_cached()
    layout = mod.LAYOUT
    rng = np.random.default_rng(7)
    g = torch.Generator().manual_seed(7)
    for n, k in ((48, 576), (32, 128)):
        q = rng.integers(0, 16, (n, k)).astype(np.uint8)
        sc = (rng.random((n, k // 32)) * 0.02 + 1e-3).astype(np.float32)
        zr = (rng.random((n, k // 32)) * 0.1 - 0.05).astype(np.float32)
        wq, wd, wm = q4_kernel.pack(q, sc, zr)
        packed = (wq, wd, wm) if layout == "pair" else (q4_kernel.to_tiles(wq, "q4"), q4_kernel.scales_to_tiles(wd),
                                                        q4_kernel.scales_to_tiles(wm))
        x = torch.randn(17, k, generator=g) * 2
        full = mod.proj_mm(x, *packed)
        ref = q4_kernel.reference_q4_mm(x, wq, wd, wm)
        assert full.shape == (17, n)
        assert (full.double() - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()
        for m_rows in (1, 3, 8, 9):
            assert torch.equal(mod.proj_mm(x[:m_rows].contiguous(), *packed), full[:m_rows])
        assert torch.equal(mod.proj_mm(x[9:].contiguous(), *packed), full[9:])
    nh, k = 21, 576
    w = torch.randn(nh, k, generator=g) * 0.05
    q8, d8 = decode_native.pack_q8(w)  # pair order: the reference's values
    hq, hd = decode_native.pack_q8(w, layout)
    x = torch.randn(17, k, generator=g)
    got = mod.head_mm(x, hq, hd, nh)
    assert got.shape == (17, nh)
    p = torch.arange(64)
    lane = p // 4
    blk, idx = lane % 2, 4 * (lane // 2) + p % 4
    wv = torch.empty(nh, k // 64, 2, 32, dtype=torch.float64)
    wv[:, :, blk, idx] = q8.view(nh, k // 64, 64).double() - 128
    wv = wv.view(nh, k // 32, 32)
    xq, xs, _ = mod.quantize(x, True)
    xv = torch.empty(17, k // 64, 2, 32, dtype=torch.float64)
    xv[:, :, blk, idx] = xq.view(17, k // 64, 64).double()
    xv = xv.view(17, k // 32, 32)
    dots = torch.einsum("rgj,ngj->rng", xv, wv)  # exact integers
    ref = (dots * xs.double()[:, None, :] * d8.double()[None]).sum(-1)
    assert (got.double() - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()
    for m_rows in (1, 4, 9):
        assert torch.equal(mod.head_mm(x[:m_rows].contiguous(), hq, hd, nh), got[:m_rows])


def test_greedy_stats_match_torch(built):
    """The sampler's one-pass greedy statistics (decode_cpu.cpp greedy_stats): the first maximum's
    index as torch.argmax gives it (ties included), with banned ids excluded, the number of entries
    equal to the maximum, -1 for a row with a NaN, and logsumexp within float rounding."""
    mod = built.load_cached()
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, 49157, generator=g) * 4
    x[1, [7, 900, 40000]] = 50.0  # a three-way tie: the first index wins
    x[2, 3] = 60.0  # banned below: the pick is the best of the rest
    x[3, :] = -float("inf")
    x[3, 11] = 0.0
    x[4, 100] = float("nan")
    ban = torch.tensor([3, 5, 49156])
    tok, best, lse, ties = mod.greedy_stats(x, torch.empty(0, dtype=torch.long))
    assert tok.tolist()[:4] == x[:4].argmax(-1).tolist() and tok[5] == x[5].argmax()
    assert tok[1] == 7 and ties.tolist()[:4] == [1, 3, 1, 1] and ties[4] == -1 and ties[5] == 1
    assert torch.equal(best[[0, 1, 2, 3, 5]], x[[0, 1, 2, 3, 5]].amax(-1))
    ref = torch.logsumexp(x, -1)
    keep = [0, 1, 2, 3, 5]
    assert torch.allclose(lse[keep], ref[keep], rtol=1e-6, atol=1e-6)
    banned = x.clone()
    banned[:, ban] = -float("inf")
    tok_b, best_b, lse_b, ties_b = mod.greedy_stats(x, ban)
    assert tok_b[keep].tolist() == banned[keep].argmax(-1).tolist() and tok_b[2] != 3
    assert torch.equal(best_b[keep], banned[keep].amax(-1)) and torch.equal(lse_b[keep], lse[keep])
    assert lse[4].isnan() and lse_b[4].isnan()  # as torch's logsumexp of a row with a NaN
    with pytest.raises(RuntimeError, match="ban id out of range"):
        mod.greedy_stats(x, torch.tensor([49157]))
    # the ids in any order and repeated; a row whose unbanned entries are all -inf: every entry ties
    # (a banned one counts as -inf too), the first index wins, banned or not
    y = x[[0, 1, 2, 5]].clone()
    y[3] = -float("inf")
    tok_r, best_r, _, ties_r = mod.greedy_stats(y, torch.tensor([49156, 3, 5, 3]))
    want = y.clone()
    want[:, ban] = -float("inf")
    assert tok_r.tolist() == want.argmax(-1).tolist() == [int(want[0].argmax()), 7, int(want[2].argmax()), 0]
    assert ties_r.tolist() == [1, 3, 1, 49157] and torch.equal(best_r, want.amax(-1))
    # rows shorter than a vector, and ties across the vector tail
    z = torch.tensor([[1.0, 5.0, 5.0], [2.0, 1.0, 2.0]])
    tok_z, best_z, _, ties_z = mod.greedy_stats(z, torch.tensor([1]))
    assert tok_z.tolist() == [2, 0] and ties_z.tolist() == [1, 2] and best_z.tolist() == [5.0, 2.0]


def test_sample_batch_one_banned_pass_for_ignore_eos_rows(built, monkeypatch):
    """A batch whose every row is greedy under one EOG ban (ignore_eos streams) takes one native
    greedy_stats pass, with the ban: the same tokens and logprobs as each row sampled alone, a tie
    left for the chain; a batch with a plain greedy row keeps the unbanned pass first."""
    from kvserve.engine import sampler as smod
    from kvserve.engine.sampler import SequenceSampler, sample_batch

    built.load_cached()
    calls = []
    real = smod._native_stats

    def spy(logits):
        fast = real(logits)
        assert fast is not None

        def counted(x, ban):
            calls.append(ban.tolist())
            return fast(x, ban)
        return counted

    monkeypatch.setattr(smod, "_native_stats", spy)
    n_vocab = 3000
    logits = torch.randn(5, n_vocab, generator=torch.Generator().manual_seed(4)) * 3
    logits[1, 17] = logits[1].max() + 2.0  # the EOG id is row 1's maximum: the ban moves the pick
    logits[3, 40] = logits[3, 41] = logits[3].max() + 1.0  # a tie: the chain decides
    eog = frozenset({17})
    mk = [SequenceSampler(SamplingParams(temperature=0.0, ignore_eos=True), n_vocab, eog) for _ in range(5)]
    got = sample_batch(logits, mk, [[1, 2]] * 5, [3] * 5, None)
    assert calls == [[17]]
    for i in range(5):
        want = SequenceSampler(SamplingParams(temperature=0.0, ignore_eos=True), n_vocab, eog).sample(
            logits[i], [1, 2], 3)
        assert got[i].token_id == want.token_id
        assert got[i].logprob == pytest.approx(want.logprob, abs=1e-5)
    assert got[1].token_id != 17 and got[1].token_id == int(logits[1].index_fill(0, torch.tensor([17]), -1e30).argmax())
    assert got[3].token_id in (40, 41)
    calls.clear()
    mixed = [SequenceSampler(SamplingParams(temperature=0.0), n_vocab, eog), *mk[1:]]
    out = sample_batch(logits, mixed, [[1, 2]] * 5, [3] * 5, None)
    assert calls == [[], [17]] and out[0].token_id == int(logits[0].argmax())
    assert [r.token_id for r in out[1:]] == [r.token_id for r in got[1:]]


@pytest.mark.slow
def test_avx2_build_passes_these_tests_on_an_avx512_cpu(built):
    """Where CI runs on an AVX512 CPU, the AVX2 build (``KVSERVE_NATIVE_MARCH=haswell``: the code an
    AVX2-only CPU such as AMD Zen 1-3 runs: pair layout, vpmaddubsw, 8-lane attention) is built too
    and this file's other tests run on it in a child process, so both builds are tested here."""
    if built.load_cached().ISA != "avx512":
        pytest.skip("this CPU runs the AVX2 build itself")
    env = dict(os.environ, KVSERVE_NATIVE_MARCH="haswell")
    r = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "-x", __file__,
                        "-k", "not avx2_build"], env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " skipped" not in r.stdout, r.stdout[-2000:]
    isa = subprocess.run([sys.executable, "-c", "from kvserve.models import decode_native as d; "
                          "m = d.load_cached(); print(m.ISA, m.LAYOUT)"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert isa.stdout.split() == ["avx2", "pair"], isa.stdout + isa.stderr


@pytest.mark.slow
def test_native_step_from_two_threads_at_once(built, q4_gguf):
    """The step's own worker threads (thread_pool.h: one pool per calling thread, as two engines in one
    process have): two threads stepping at once, 20 steps each, get exactly the logits of the same
    steps run one after the other on the main thread."""
    import threading

    model = build_model(load_files(q4_gguf), EngineConfig(n_ctx=1024), 1024)
    caches, nxt = _prefill_caches(model, PROMPTS)
    nat = decode_native.NativeDecode(model, caches, 16)
    nat.start()
    assert nat.wait(120)

    def steps(cache, out):
        for i in range(20):
            out.append(nat(*_decode_batch([(s, (nxt[s] + i) % 200, len(PROMPTS[s]) + i) for s in range(4)])[:5], cache))

    ref = []
    steps(_clone(caches), ref)
    got = [[], []]
    threads = [threading.Thread(target=steps, args=(_clone(caches), got[i])) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(len(g) == 20 for g in got)
    assert all(torch.equal(a, b) for g in got for a, b in zip(g, ref))


@pytest.mark.parametrize("qtype,block_bytes,qk", [("Q4_K", 144, 256), ("Q6_K", 210, 256), ("Q8_0", 34, 32)])
def test_embed_rows_equal_gguf_dequantization(built, qtype, block_bytes, qk):
    """The native step's embedding lookup (decode_cpu.cpp embed_rows, wired by decode_native's
    _native_embedding) gives the model's rows bit for bit: gguf.quants' float32 arithmetic on random
    blocks (random bytes, finite float16 scales), every row and in any order; an id out of range is
    an IndexError, as the model's own lookup raises."""
    import numpy as np

    from kvserve.loaders.weights import Weight

    mod = built.load_cached()
    rng = np.random.default_rng(7)
    k, rows = 2 * 256, 300
    nb = k // qk
    raw = rng.integers(0, 256, (rows, nb * block_bytes), dtype=np.uint8)
    blocks = raw.reshape(rows, nb, block_bytes)
    scales = (rng.standard_normal((rows, nb, 2)) * 0.01).astype(np.float16).view(np.uint8)  # [rows, nb, 4]
    if qtype == "Q4_K":
        blocks[:, :, 0:4] = scales  # d, dmin
    elif qtype == "Q6_K":
        blocks[:, :, 208:210] = scales[:, :, :2]  # d (last)
    else:
        blocks[:, :, 0:2] = scales[:, :, :2]
    weight = Weight((rows, k), raw=raw, source_type=qtype)

    class Model:  # what _native_embedding reads of a LlamaModel
        tok_embd = None
        tok_embd_raw = weight

    embed = decode_native._native_embedding(mod, Model())
    assert embed is not None
    ids = np.array([5, 0, rows - 1, 5, 123, *range(rows)])
    got = embed(torch.from_numpy(ids))
    assert got.dtype == torch.float32 and got.shape == (len(ids), k)
    assert torch.equal(got, torch.from_numpy(weight.dense_rows(ids)))
    with pytest.raises(IndexError, match="token id out of range"):
        embed(torch.tensor([rows]))
    Model.tok_embd_raw = Weight((rows, k), raw=raw, source_type="Q5_K")  # a type it leaves to gguf
    assert decode_native._native_embedding(mod, Model()) is None
