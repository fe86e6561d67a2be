"""Tensor and pipeline parallelism (kvserve.engine.parallel) on the CPU with gloo.

Fast tests: the plan (heads, KV heads, layers per rank, the seed's table and texts), the weight
cuts, and tp=2 / pp=2 / tp=4 engines on the tiny model token-identical to one process under
float32 (chunked prefill, prefix-cache hits, prompt logprobs, slot rows, speculative decoding),
a killed worker and a closed engine. Slow: SmolLM2 (tp=3 and pp=2 identical, tp=2 the seed's
error).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import numpy as np
import pytest
import tinymodel
import torch

from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.parallel import (
    ParallelWorkerLost,
    layer_ranges,
    layout_lines,
    parallel_error,
    rank_plan,
    shard_weights,
    split_micro_batches,
)
from kvserve.engine.request import Request, SamplingParams
from kvserve.engine.spec_decode import SpecConfig
from kvserve.loaders.weights import ModelConfig, Weight
from kvserve.models.build import load_files

SMOL = ModelConfig(arch="llama", n_layer=30, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_vocab=49152,
                   head_dim=64, n_ctx_train=8192)
#: the seed's 70B shape (002 Example 5): 80 layers, 64 query heads, 8 KV heads, head_dim 128
SEED70B = ModelConfig(arch="llama", n_layer=80, n_embd=8192, n_head=64, n_head_kv=8, n_ff=28672,
                      n_vocab=128256, head_dim=128, n_ctx_train=8192)


# -- the plan ---------------------------------------------------------------------------

def test_head_checks_are_vllms_texts():
    assert parallel_error(SMOL, 2, 1) == "Total number of attention heads (9) must be divisible by tensor parallel size (2)."
    assert parallel_error(SEED70B, 3, 1) == ("Total number of attention heads (64) must be divisible by tensor "
                                             "parallel size (3).")
    assert parallel_error(SMOL, 3, 1) is None
    assert parallel_error(SMOL, 9, 1) is None  # 3 ranks per KV head
    assert parallel_error(SMOL, 1, 30) is None
    assert parallel_error(SMOL, 1, 31) == ("Pipeline parallel size (31) must not exceed the number of hidden "
                                           "layers (30).")
    six = ModelConfig(arch="llama", n_layer=2, n_embd=384, n_head=12, n_head_kv=4, n_ff=128, n_vocab=100,
                      head_dim=32, n_ctx_train=512)
    assert parallel_error(six, 6, 1) == ("Total number of KV heads (4) must be divisible by tensor parallel size "
                                         "(6), or the tensor parallel size a multiple of it.")
    assert parallel_error(SMOL, 3, 2) is None  # together: a tensor-parallel group per stage


def test_seed_table_kv_heads_and_kv_per_token():
    """The seed's per-GPU figures: KV heads per rank max(1, 8 // tp), 2 x layers x heads x 128 x 2 bytes."""
    want = {1: (8, "320.00"), 2: (4, "160.00"), 4: (2, "80.00"), 8: (1, "40.00"), 16: (1, "40.00")}
    for tp, (heads, kib) in want.items():
        lines = layout_lines(SEED70B, tp, 1, "f16", "f16", [0] * tp)
        assert lines[-1].endswith(f"layers/rank=80  KV heads/rank={heads}  KV/token/rank={kib} KiB"), lines[-1]
        assert len(lines) == tp + 1
    # tp=16: two ranks hold each of the 8 KV heads, their query heads' head
    assert [rank_plan(SEED70B, 16, 1, r).kv_heads for r in (0, 1, 2, 15)] == [(0, 1), (0, 1), (1, 2), (7, 8)]
    assert [rank_plan(SEED70B, 16, 1, r).q_heads for r in (0, 1, 15)] == [(0, 4), (4, 8), (60, 64)]


def test_smollm2_plans():
    p = [rank_plan(SMOL, 3, 1, r) for r in range(3)]
    assert [x.q_heads for x in p] == [(0, 3), (3, 6), (6, 9)]
    assert [x.kv_heads for x in p] == [(0, 1), (1, 2), (2, 3)]
    assert [x.ff for x in p] == [(0, 512), (512, 1024), (1024, 1536)]
    assert [x.vocab for x in p] == [(0, 16384), (16384, 32768), (32768, 49152)]
    assert layer_ranges(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    s = [rank_plan(SMOL, 1, 2, r) for r in range(2)]
    assert [(x.layers, x.first, x.last) for x in s] == [((0, 15), True, False), ((15, 30), False, True)]
    both = [rank_plan(SMOL, 3, 2, r) for r in range(6)]  # rank = stage * tp + tensor rank
    assert [(x.layers, x.kv_heads) for x in both] == [((0, 15), (0, 1)), ((0, 15), (1, 2)), ((0, 15), (2, 3)),
                                                       ((15, 30), (0, 1)), ((15, 30), (1, 2)), ((15, 30), (2, 3))]
    line = layout_lines(SMOL, 3, 1, "f16", "f16", [10 << 20] * 3)[-1]
    assert line == ("tp=3 pp=1  ranks=3  weights/rank=10.0 MiB  layers/rank=30  KV heads/rank=1  "
                    "KV/token/rank=7.50 KiB")


def test_split_micro_batches_balances_tokens():
    class C:
        def __init__(self, n):
            self.num_new_tokens = n
    chunks = [C(1), C(10), C(1), C(1), C(8)]
    assert split_micro_batches(chunks, 2) == [[1, 3], [0, 2, 4]]  # 11 and 10 tokens
    assert split_micro_batches(chunks[:1], 2) == [[0]]


def _q4(shape, seed=0):
    g = np.random.default_rng(seed)
    out, inp = shape
    return Weight(shape, q4=g.integers(0, 16, shape, dtype=np.uint8),
                  q4_scale=g.random((out, inp // 32), dtype=np.float32),
                  q4_zero=g.random((out, inp // 32), dtype=np.float32), source_type="Q4_1")


def test_shard_weights_keeps_4bit_blocks_packed_and_says_when_not():
    cfg = ModelConfig(arch="llama", n_layer=1, n_embd=64, n_head=4, n_head_kv=2, n_ff=96, n_vocab=50,
                      head_dim=16, n_ctx_train=512)
    w = {"token_embd.weight": Weight((50, 64), dense=np.ones((50, 64), np.float32)),
         "output_norm.weight": Weight((64,), dense=np.ones(64, np.float32)),
         "blk.0.attn_norm.weight": Weight((64,), dense=np.ones(64, np.float32)),
         "blk.0.ffn_norm.weight": Weight((64,), dense=np.ones(64, np.float32)),
         "blk.0.attn_q.weight": _q4((64, 64), 1), "blk.0.attn_k.weight": _q4((32, 64), 2),
         "blk.0.attn_v.weight": _q4((32, 64), 3), "blk.0.attn_output.weight": _q4((64, 64), 4),
         "blk.0.ffn_gate.weight": _q4((96, 64), 5), "blk.0.ffn_up.weight": _q4((96, 64), 6),
         "blk.0.ffn_down.weight": _q4((64, 96), 7)}
    shard, sw, notes = shard_weights(cfg, w, rank_plan(cfg, 2, 1, 1))
    assert (shard.n_head, shard.n_head_kv, shard.n_ff, shard.n_layer) == (2, 1, 48, 1)
    q, wo, down = sw["blk.0.attn_q.weight"], sw["blk.0.attn_output.weight"], sw["blk.0.ffn_down.weight"]
    assert q.q4 is not None and q.shape == (32, 64)
    np.testing.assert_array_equal(q.to_dense(), w["blk.0.attn_q.weight"].to_dense()[32:64])
    assert wo.q4 is not None and wo.shape == (64, 32)  # columns 32-64: whole blocks
    np.testing.assert_array_equal(wo.to_dense(), w["blk.0.attn_output.weight"].to_dense()[:, 32:64])
    assert down.q4 is None and down.shape == (64, 48)  # columns 48-96 cut a block: dense
    np.testing.assert_array_equal(down.to_dense(), w["blk.0.ffn_down.weight"].to_dense()[:, 48:96])
    assert "ffn_down: columns 48-96 cut a 32-value block: dequantized to float32" in notes
    assert sw["output.weight"].shape == (25, 64)  # the tied head's vocabulary rows 25-50
    assert sw["token_embd.weight"].shape == (50, 64)  # replicated


# -- engines on the tiny model ----------------------------------------------------------

def _prompts():
    out = []
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        out.append(torch.randint(3, 300, (20 + 9 * i,), generator=g).tolist())
    return out


def _run(core: EngineCore, prompts, n=10, plp=None, max_steps=2000):
    outs: dict[str, list[int]] = {}
    lps: dict[str, list] = {}
    for i, ids in enumerate(prompts):
        rid = f"r{i}-{time.monotonic_ns()}"
        core.add_request(Request(rid, ids, SamplingParams(temperature=0.0, n_predict=n, prompt_logprobs=plp)))
        outs[rid] = []
        lps[rid] = []
    steps = 0
    while core.has_work():
        for o in core.step():
            outs[o.request_id] += o.new_token_ids
            if o.prompt_logprobs:
                lps[o.request_id].append(o.prompt_logprobs)
        steps += 1
        assert steps < max_steps
    return list(outs.values()), list(lps.values())


def _core(path, tp=1, pp=1, **kw):
    kw.setdefault("n_ctx", 512)
    kw.setdefault("max_num_batched_tokens", 16)  # chunked prefill: prompts span several steps
    return EngineCore(load_files(path), EngineConfig(dtype="float32", tensor_parallel_size=tp,
                                                     pipeline_parallel_size=pp, **kw))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("par")
    return {"f32": str(tinymodel.write_tiny_gguf(d / "f32.gguf", seed=3)),
            "q4": str(tinymodel.write_tiny_gguf(d / "q4.gguf", seed=3, qtype="Q4_1"))}


@pytest.fixture(scope="module")
def reference(tiny):
    """One process: greedy tokens of the three prompts, then again (prefix-cache hits), prompt logprobs."""
    out = {}
    for name in ("f32", "q4"):
        core = _core(tiny[name])
        first, _ = _run(core, _prompts())
        again, _ = _run(core, [p + [7, 8] for p in _prompts()])
        _, lps = _run(core, [list(range(5, 34))], n=2, plp=2)
        out[name] = (first, again, lps)
        core.close()
    return out


@pytest.mark.parametrize("name,tp,pp", [("f32", 2, 1), ("f32", 1, 2), ("q4", 2, 1), ("f32", 4, 1), ("f32", 2, 2)])
def test_parallel_greedy_is_token_identical(tiny, reference, name, tp, pp):
    core = _core(tiny[name], tp, pp)
    try:
        pids = core.runner.worker_pids
        assert len(pids) == tp * pp - 1
        first, _ = _run(core, _prompts())
        again, _ = _run(core, [p + [7, 8] for p in _prompts()])
        _, lps = _run(core, [list(range(5, 34))], n=2, plp=2)
        want_first, want_again, want_lps = reference[name]
        assert first == want_first
        assert again == want_again
        got_lp = [(x.id, round(x.logprob, 4)) for req in lps for plp in req for x in plp if x]
        assert len(got_lp) == 28  # the 29-token prompt's logprobs after the first token
        assert got_lp == [(x.id, round(x.logprob, 4)) for req in want_lps for plp in req for x in plp if x]
        st = core.runner.stats
        assert st.steps > 0
        if tp > 1 and pp == 1:
            assert st.allreduce_calls == 2 * 2 * st.steps  # 2 layers x (attn_output, ffn_down) per step
            assert st.gather_calls == st.steps
    finally:
        core.close()
    time.sleep(0.2)
    assert [p for p in pids if _alive(p)] == []


def test_pipeline_micro_batches_overlap_several_streams(tiny, reference):
    """pp=2 with 3 streams: steps split into 2 micro-batches (the tokens stay those of one process)."""
    core = _core(tiny["f32"], 1, 2, max_num_batched_tokens=64)
    try:
        first, _ = _run(core, _prompts())
        assert first == reference["f32"][0]
        st = core.runner.stats
        assert st.micro_batches > st.steps  # decode steps of 3 streams ran as 2 micro-batches
    finally:
        core.close()


def test_slot_rows_round_trip_over_ranks(tiny):
    """read_rows puts every rank's heads (tp) or layers (pp) together; write_rows deals them out again."""
    ref = _core(tiny["f32"])
    _run(ref, _prompts()[:1])
    rows = torch.arange(16, 40)
    want = ref.runner.read_rows(rows)
    ref.close()
    for tp, pp in ((2, 1), (1, 2), (2, 2)):
        core = _core(tiny["f32"], tp, pp)
        try:
            _run(core, _prompts()[:1])
            got = core.runner.read_rows(rows)
            assert len(got) == len(want)
            for (k, v), (wk, wv) in zip(got, want):
                torch.testing.assert_close(k, wk, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(v, wv, rtol=1e-4, atol=1e-5)
            other = torch.arange(100, 124)
            core.runner.write_rows(other, want)
            back = core.runner.read_rows(other)
            for (k, v), (wk, wv) in zip(back, want):
                assert torch.equal(k, wk) and torch.equal(v, wv)
        finally:
            core.close()


def test_speculative_decoding_runs_on_rank_0(tiny, reference):
    """ngram drafts and their verification chunks go through tp=2 like any chunk: greedy tokens unchanged."""
    core = _core(tiny["f32"], 2, 1, spec=SpecConfig(method="ngram", num_speculative_tokens=3))
    try:
        first, _ = _run(core, _prompts())
        assert first == reference["f32"][0]
    finally:
        core.close()


def test_killed_worker_fails_the_next_step_at_once(tiny):
    core = _core(tiny["f32"], 2, 1)
    pid = core.runner.worker_pids[0]
    try:
        _run(core, _prompts()[:1], n=2)
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        core.add_request(Request("after", _prompts()[0], SamplingParams(temperature=0.0, n_predict=2)))
        t0 = time.monotonic()
        with pytest.raises(ParallelWorkerLost) as e:
            core.step()
        assert time.monotonic() - t0 < 5
        assert str(e.value) == f"parallel worker rank 1 (pid {pid}) exited (signal SIGKILL)"
    finally:
        core.close()


def test_compile_with_tp_stays_eager(tiny, caplog):
    with caplog.at_level("INFO", logger="kvserve.engine"):
        core = _core(tiny["f32"], 2, 1, compile=True)
    try:
        assert core.runner.compiled is None
        assert "--compile with tensor/pipeline parallelism: the engine runs eagerly" in caplog.text
        assert "tp=2 pp=1  ranks=2  weights/rank=" in caplog.text
        assert "KV heads/rank=1  KV/token/rank=0.12 KiB" in caplog.text
    finally:
        core.close()


# -- SmolLM2 ----------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_tp2_is_the_seeds_error(smollm2_gguf):
    from kvserve.serving.startup_checks import StartupCheckError, run_startup_checks

    cfg = EngineConfig(tensor_parallel_size=2)
    with pytest.raises(StartupCheckError) as e:
        run_startup_checks(object(), smollm2_gguf, cfg)
    assert str(e.value) == "Total number of attention heads (9) must be divisible by tensor parallel size (2)."
    assert run_startup_checks(object(), smollm2_gguf, EngineConfig(tensor_parallel_size=3)) is not None


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(3, 1), (1, 2)])
def test_smollm2_parallel_is_token_identical(smollm2_gguf, tp, pp):
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
                19712, 8182, 2, 198, 1, 4093, 198, 19556, 314, 253, 2365, 30, 2, 198, 1, 520, 9531, 198],
               [1, 4093, 198, 1780, 314, 216, 34, 1232, 216, 34, 47, 2, 198, 1, 520, 9531, 198]]
    outs = []
    for t, p in ((1, 1), (tp, pp)):
        core = _core(smollm2_gguf, t, p, n_ctx=1024, max_num_batched_tokens=32)
        try:
            outs.append(_run(core, prompts, n=16)[0])
        finally:
            core.close()
    assert outs[1] == outs[0]


def test_idle_group_outlives_the_collective_timeout(tiny, monkeypatch):
    """An idle engine's heartbeat keeps waiting workers from timing out (timeout 5 s, idle 7 s; the
    timeout also bounds the workers' start, torch's import included)."""
    import kvserve.engine.parallel as par

    monkeypatch.setattr(par, "TIMEOUT_S", 5.0)
    monkeypatch.setenv("KVSERVE_PARALLEL_TIMEOUT", "5")  # the workers' (read at their import)
    core = _core(tiny["f32"], 2, 1)
    try:
        _run(core, _prompts()[:1], n=3)
        time.sleep(7)
        assert core.runner.worker_pids and all(_alive(p) for p in core.runner.worker_pids)
        again, _ = _run(core, [list(range(40, 60))], n=3)
        assert len(again[0]) == 3
    finally:
        core.close()


def test_a_draft_model_with_tp_is_refused_at_start_up(tiny):
    from kvserve.serving.startup_checks import StartupCheckError, run_startup_checks

    cfg = EngineConfig(tensor_parallel_size=2, spec=SpecConfig(method="draft_model", draft_model=tiny["f32"]))
    with pytest.raises(StartupCheckError) as e:
        run_startup_checks(object(), tiny["f32"], cfg)
    assert str(e.value) == ("a draft model (-md, --speculative-config model) is not supported with tensor or "
                            "pipeline parallelism (tp=2 pp=1) yet; prompt lookup (--spec-type ngram) is")


def _worker_children() -> list[int]:
    """Pids of this process's ``python -m kvserve.engine.parallel`` children (from /proc)."""
    out = []
    for task in os.scandir(f"/proc/{os.getpid()}/task"):
        try:
            with open(f"{task.path}/children") as f:
                pids = [int(x) for x in f.read().split()]
        except OSError:
            continue
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"kvserve.engine.parallel" in f.read():
                        out.append(pid)
            except OSError:
                pass
    return out


def test_a_worker_lost_during_start_up_fails_at_once_and_is_reaped(tiny):
    """Issue 23 item 1: rank 0 used to wait in gloo's rendezvous for the whole timeout (121 s)."""
    from kvserve.loaders.weights import ModelLoadError

    killed = []

    def kill_first_worker():
        deadline = time.monotonic() + 60
        while not killed and time.monotonic() < deadline:
            for pid in _worker_children():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.02)

    t = threading.Thread(target=kill_first_worker, daemon=True)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError) as e:
        _core(tiny["f32"], 1, 2)
    assert time.monotonic() - t0 < 20
    t.join()
    (pid,) = killed
    assert str(e.value) == f"parallel worker rank 1 (pid {pid}) exited (signal SIGKILL) while the parallel group formed"
    assert not os.path.exists(f"/proc/{pid}")  # reaped, no zombie
    # lost before it checked in: no half-made group is left behind, the next one forms
    core = _core(tiny["f32"], 2, 1)
    try:
        assert len(core.runner.worker_pids) == 1
    finally:
        core.close()


def test_a_worker_lost_while_idle_kills_the_async_engine_at_once(tiny):
    """Issue 23 item 2: the watch thread marks the engine dead (no request, no step needed)."""
    from kvserve.engine.async_engine import AsyncEngine, EngineDeadError

    engine = AsyncEngine(_core(tiny["f32"], 2, 1))
    try:
        pid = engine.core.runner.worker_pids[0]
        steps = engine.stats.n_decode_total
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while engine.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert isinstance(engine.error, ParallelWorkerLost)
        assert str(engine.error) == f"parallel worker rank 1 (pid {pid}) exited (signal SIGKILL)"
        assert engine.stats.n_decode_total == steps  # no step ran
        async def late():
            async for _ in engine.generate(Request("late", _prompts()[0], SamplingParams(n_predict=2))):
                pass
        with pytest.raises(EngineDeadError) as e:
            asyncio.run(late())
        assert str(e.value) == f"engine failed: parallel worker rank 1 (pid {pid}) exited (signal SIGKILL)"
    finally:
        engine.shutdown()


def test_an_environment_group_must_match_tp_x_pp(tiny, monkeypatch):
    """Issue 23 item 3: RANK=0 WORLD_SIZE=2 without -tp/-pp used to start one process silently."""
    from kvserve.engine.parallel import environment_error
    from kvserve.serving.startup_checks import StartupCheckError, run_startup_checks

    assert environment_error(2, 1, {}) is None
    assert environment_error(1, 2, {"WORLD_SIZE": "2"}) is None  # no RANK: kvserve starts its own workers
    assert environment_error(1, 1, {"RANK": "0", "WORLD_SIZE": "1"}) is None
    assert environment_error(2, 1, {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}) is None
    assert environment_error(1, 1, {"RANK": "0", "WORLD_SIZE": "2"}) == (
        "RANK=0 WORLD_SIZE=2 in the environment (a torch.distributed group to join) but tp x pp = 1 (tp=1 pp=1): "
        "give -tp/-pp for the group's size, or unset RANK to start one process")
    assert environment_error(1, 2, {"RANK": "0"}) == (
        "RANK=0 WORLD_SIZE=None in the environment (a torch.distributed group to join) but tp x pp = 2 (tp=1 pp=2): "
        "give -tp/-pp for the group's size, or unset RANK to start the workers here")
    assert environment_error(2, 1, {"RANK": "1", "WORLD_SIZE": "2"}) == (
        "RANK=1 in the environment: kvserve serve is rank 0 of a parallel group; other ranks run "
        "python -m kvserve.engine.parallel")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(StartupCheckError) as e:
        run_startup_checks(object(), tiny["f32"], EngineConfig(dtype="float32"))
    assert str(e.value).startswith("RANK=0 WORLD_SIZE=2 in the environment")


def test_more_ranks_than_cores_is_a_warning(tiny, monkeypatch, caplog):
    """Issue 23 item 4: -tp larger than the CPU cores was accepted silently."""
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    with caplog.at_level("WARNING", logger="kvserve.engine"):
        core = _core(tiny["f32"], 2, 1)
    try:
        assert ("2 ranks on 1 CPU cores: less than one core per rank, the ranks share cores (each runs 1 thread)"
                in caplog.text)
    finally:
        core.close()


def test_spawned_workers_load_in_rank_0s_weight_memory_mode(tiny, monkeypatch):
    """Before: the workers read KVSERVE_MMAP from the server's environment, so a load in another mode
    (Ollama's use_mmap: kvserve.serving.chat_runner.weight_memory sets the process's mode) held rank
    0's shard as asked and every other rank's in the server's mode. Now each worker is told rank 0's
    mode; the group still forms and answers."""
    import subprocess

    from kvserve.engine import parallel
    from kvserve.loaders import gguf

    envs = []
    real = subprocess.Popen

    def recording(*a, **kw):
        envs.append(kw.get("env", {}).get("KVSERVE_MMAP"))
        return real(*a, **kw)

    monkeypatch.setattr(parallel.subprocess, "Popen", recording)
    monkeypatch.setenv("KVSERVE_MMAP", "1")
    for mode, want in (("read", "0"), ("mmap", "1")):
        monkeypatch.setattr(gguf, "_WEIGHT_MEMORY", mode)
        core = _core(tiny["q4"], 2, 1)
        try:
            assert len(core.runner.worker_pids) == 1
            first, _ = _run(core, _prompts()[:1])
            assert [len(t) for t in first] == [10]
        finally:
            core.close()
        assert envs.pop() == want and envs == []
