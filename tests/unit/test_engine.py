"""Engine tests on the tiny random model: loading, determinism, batching, chunked prefill, preemption, abort, errors."""

import asyncio
import gc
import logging
import shutil
import time
import weakref
from pathlib import Path

import pytest
import torch

import tinymodel
from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.request import ContextSizeExceededError, InvalidRequestError, Request, SamplingParams
from kvserve.engine.sampler import SequenceSampler
from kvserve.llm import LLM
from kvserve.loaders.weights import ModelLoadError
from kvserve.models.build import load_files

GREEDY = dict(temperature=0.0)


def make_core(path, **cfg) -> EngineCore:
    cfg.setdefault("n_ctx", 512)
    cfg.setdefault("dtype", "float32")
    return EngineCore(load_files(path), EngineConfig(**cfg))


def run_all(core: EngineCore, reqs: list[Request], max_steps: int = 10_000):
    """Step until every request finished; returns {request_id: [outputs]} and the number of steps."""
    outs: dict[str, list] = {r.request_id: [] for r in reqs}
    for r in reqs:
        core.add_request(r)
    steps = 0
    while any(not o or not o[-1].finished for o in outs.values()):
        for out in core.step():
            outs[out.request_id].append(out)
        steps += 1
        assert steps < max_steps
    return outs, steps


def tokens(outs):
    return [t for o in outs for t in o.new_token_ids]


def prompt_ids(i: int, n: int = 20) -> list[int]:
    g = torch.Generator().manual_seed(i)
    return torch.randint(3, 300, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("pair")
    return (str(tinymodel.write_tiny_gguf(d / "m.gguf", seed=3)), str(tinymodel.write_tiny_hf_dir(d / "hf", seed=3)))


def test_gguf_and_hf_dir_give_identical_greedy_tokens(tiny_pair):
    gg, hf = tiny_pair
    p = SamplingParams(n_predict=16, **GREEDY)
    a = LLM(make_core(gg)).generate([prompt_ids(0)], p)[0]
    b = LLM(make_core(hf)).generate([prompt_ids(0)], p)[0]
    assert len(a.token_ids) == 16
    assert a.token_ids == b.token_ids
    assert a.stop_type == "limit"


def test_qwen2_bias_variant_loads_both_formats(tmp_path):
    gg = tinymodel.write_tiny_gguf(tmp_path / "q.gguf", arch="qwen2", tie_embeddings=True, seed=5)
    hf = tinymodel.write_tiny_hf_dir(tmp_path / "qhf", arch="Qwen2ForCausalLM", tie_embeddings=True, seed=5)
    p = SamplingParams(n_predict=10, **GREEDY)
    a = LLM(make_core(str(gg))).generate([prompt_ids(1)], p)[0]
    b = LLM(make_core(str(hf))).generate([prompt_ids(1)], p)[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 10


def test_generation_is_deterministic_with_seed(tiny_gguf):
    core = make_core(tiny_gguf)
    llm = LLM(core)
    p = SamplingParams(n_predict=20, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    a = llm.generate([prompt_ids(2)], p)[0].token_ids
    b = llm.generate([prompt_ids(2)], p)[0].token_ids
    c = llm.generate([prompt_ids(2)], SamplingParams(n_predict=20, temperature=1.0, top_k=0, top_p=1.0,
                                                     min_p=0.0, seed=99))[0].token_ids
    assert a == b
    assert a != c


def _logits_of(core: EngineCore, ids: list[int]) -> torch.Tensor:
    from kvserve.models.llama import AttentionBatch, PrefillGroup

    c = core.model_config
    T = len(ids)
    kv = [(torch.zeros(T, c.n_head_kv, c.head_dim), torch.zeros(T, c.n_head_kv, c.head_dim)) for _ in range(c.n_layer)]
    b = AttentionBatch(positions=torch.arange(T), slot_mapping=torch.arange(T), prefills=[PrefillGroup(0, T, 0, None)])
    return core.model(torch.tensor(ids), b, kv, None)


@pytest.mark.parametrize("qtype,tol", [("F16", 1e-3), ("BF16", 1e-2), ("Q8_0", 1e-4), ("Q4_0", 1e-4), ("Q4_1", 1e-4),
                                       ("Q5_0", 1e-4), ("Q5_1", 1e-4), ("Q4_K", 1e-4), ("Q6_K", 1e-4)])
def test_quantized_gguf_matches_its_dequantized_hf_twin(tmp_path, qtype, tol):
    kw = dict(n_embd=256, n_ff=512, n_head=4, n_head_kv=2, seed=7, qtype=qtype)
    gg = tinymodel.write_tiny_gguf(tmp_path / "q.gguf", **kw)
    hf = tinymodel.write_tiny_hf_dir(tmp_path / "qhf", **kw)
    ids = prompt_ids(3, 12)
    a = _logits_of(make_core(str(gg)), ids)  # float32 dequantized weights
    b = _logits_of(make_core(str(hf)), ids)
    assert (a - b).abs().max().item() < tol


@pytest.mark.parametrize("kernel", ["int4", "int8"])
def test_small_batch_kernels_close_to_dense(tmp_path, kernel):
    gg = str(tinymodel.write_tiny_gguf(tmp_path / "q.gguf", n_embd=256, n_ff=512, qtype="Q4_1", seed=8))
    ids = prompt_ids(4, 12)
    dense = _logits_of(make_core(gg, dtype="float32"), ids)
    packed_core = make_core(gg, dtype="auto", cpu_kernel=kernel, small_batch_rows=0)
    assert packed_core.model.layers[0].wqkv.kernel == kernel
    assert packed_core.model.layers[0].wqkv.weight is None  # no dense copy when always small
    packed = _logits_of(packed_core, ids)
    # bfloat16 activations and scales in the int4 kernel: agreement to ~1e-2 relative
    assert torch.allclose(dense, packed, atol=0.05 * dense.abs().max().item())
    assert (dense.argmax(-1) == packed.argmax(-1)).float().mean().item() >= 0.9


def test_batch_invariance_alone_vs_among_15_others(tiny_gguf):
    """A sequence's greedy tokens are the same alone and in a batch of 16 (float32 weights)."""
    p = SamplingParams(n_predict=24, ignore_eos=True, **GREEDY)
    alone = LLM(make_core(tiny_gguf, n_parallel=16, n_ctx=2048)).generate([prompt_ids(10)], p)[0].token_ids
    prompts = [prompt_ids(10)] + [prompt_ids(100 + i, 5 + 3 * i) for i in range(15)]
    together = LLM(make_core(tiny_gguf, n_parallel=16, n_ctx=2048)).generate(prompts, p)
    assert together[0].token_ids == alone
    assert all(len(c.token_ids) == 24 for c in together)


def test_chunked_prefill_does_not_stall_running_decode(tiny_gguf):
    core = make_core(tiny_gguf, n_ctx=4096, n_parallel=2, kv_unified=True, max_num_batched_tokens=256)
    short = Request("short", prompt_ids(20, 8), SamplingParams(n_predict=40, ignore_eos=True, **GREEDY))
    core.add_request(short)
    produced = []
    for out in core.step():
        produced += out.new_token_ids
    assert len(produced) == 1  # prefilled and sampled its first token
    long = Request("long", prompt_ids(21, 1500), SamplingParams(n_predict=2, ignore_eos=True, **GREEDY))
    core.add_request(long)
    prefill_steps = 0
    while long.num_computed_tokens < long.num_prompt_tokens:
        before = len(short.output_token_ids)
        core.step()
        chunks = dict((rid, n) for rid, _, n in core.last_step_chunks)
        assert chunks["short"] == 1  # the decode ran in this step
        assert chunks["long"] <= 255  # the prompt got the rest of the budget
        assert len(short.output_token_ids) == before + 1
        prefill_steps += 1
    assert prefill_steps == -(-1500 // 255)


def test_preemption_recomputes_and_matches(tiny_gguf):
    """With too few KV blocks the newest sequence is preempted; outputs equal an unconstrained run."""
    p = SamplingParams(n_predict=60, ignore_eos=True, **GREEDY)
    prompts = [prompt_ids(30 + i, 40) for i in range(4)]
    ref = LLM(make_core(tiny_gguf, n_ctx=2048, n_parallel=4, kv_unified=True)).generate(prompts, p)
    # 16 + 4 blocks for 4 x 100 tokens, no host tier
    core = make_core(tiny_gguf, n_ctx=256, n_parallel=4, kv_unified=True, cache_ram=0)
    reqs = [Request(f"r{i}", pr, p) for i, pr in enumerate(prompts)]
    outs, _ = run_all(core, reqs)
    assert core.stats.num_preemptions > 0
    for i, r in enumerate(reqs):
        assert tokens(outs[r.request_id]) == ref[i].token_ids
    assert core.kv.num_free_blocks == core.kv.num_blocks - 1


def test_abort_frees_blocks_within_one_step(tiny_gguf):
    core = make_core(tiny_gguf)
    r = Request("a", prompt_ids(40, 50), SamplingParams(n_predict=100, ignore_eos=True, **GREEDY))
    core.add_request(r)
    core.step()
    core.step()
    assert core.kv.num_free_blocks < core.kv.num_blocks - 1
    core.abort_request("a")
    assert core.kv.num_free_blocks == core.kv.num_blocks - 1
    outs = core.step()
    assert [(o.request_id, o.finished, o.stop_type) for o in outs] == [("a", True, "abort")]


def test_context_too_long_fails_before_scheduling(tiny_gguf):
    core = make_core(tiny_gguf, n_ctx=512, n_parallel=2)  # explicit -np: 256 per slot
    assert core.n_ctx_slot == 256
    with pytest.raises(ContextSizeExceededError) as e:
        core.add_request(Request("x", prompt_ids(50, 300), SamplingParams()))
    assert (e.value.n_prompt_tokens, e.value.n_ctx) == (300, 256)
    assert "request (300 tokens) exceeds the available context size (256 tokens)" in str(e.value)
    with pytest.raises(ContextSizeExceededError):
        core.add_request(Request("y", prompt_ids(51, 200), SamplingParams(n_predict=100)))
    with pytest.raises(InvalidRequestError, match="empty"):
        core.add_request(Request("z", [], SamplingParams()))
    with pytest.raises(InvalidRequestError, match="out of range"):
        core.add_request(Request("w", [1, 99999], SamplingParams()))
    assert not core.has_work()


def test_n_predict_minus_one_runs_until_context_full(tiny_gguf):
    core = make_core(tiny_gguf, n_ctx=128, n_parallel=1)
    r = Request("full", prompt_ids(60, 100), SamplingParams(n_predict=-1, ignore_eos=True, **GREEDY))
    outs, _ = run_all(core, [r])
    assert len(tokens(outs["full"])) == 28
    assert outs["full"][-1].stop_type == "limit" and outs["full"][-1].truncated


def test_stop_string_and_eos(tiny_gguf):
    core = make_core(tiny_gguf)
    llm = LLM(core)
    base = llm.generate([prompt_ids(70)], SamplingParams(n_predict=30, ignore_eos=True, **GREEDY))[0]
    text = base.text
    stop = text[5:8]
    assert len(stop) == 3
    first = text.find(stop)
    c = llm.generate([prompt_ids(70)], SamplingParams(n_predict=30, ignore_eos=True, stop=(stop,), **GREEDY))[0]
    assert c.stop_type == "word" and c.stopping_word == stop
    assert c.text == text[:first]
    # min_tokens bans end-of-generation; logit_bias forces eos as the first token otherwise
    eos = sorted(core.tokenizer.eog_token_ids)[0]
    forced = llm.generate([prompt_ids(70)], SamplingParams(n_predict=5, logit_bias={eos: 100.0}, **GREEDY))[0]
    assert forced.stop_type == "eos" and forced.token_ids == [eos] and forced.text == ""
    delayed = llm.generate([prompt_ids(70)], SamplingParams(n_predict=5, min_tokens=3, logit_bias={eos: 100.0},
                                                            **GREEDY))[0]
    assert len(delayed.token_ids) == 4 and delayed.token_ids[-1] == eos and delayed.stop_type == "eos"


def test_async_engine_generate_and_cancel(tiny_gguf):
    from kvserve.engine.async_engine import AsyncEngine

    eng = AsyncEngine(make_core(tiny_gguf))

    async def main():
        got = []
        async for out in eng.generate(Request("g1", prompt_ids(80), SamplingParams(n_predict=6, **GREEDY,
                                                                                  ignore_eos=True))):
            got.append(out)
        assert got[-1].finished and sum(len(o.new_token_ids) for o in got) == 6
        t = got[-1].timings
        assert (t.prompt_n, t.cache_n, t.predicted_n) == (20, 0, 6)
        # cancel mid-stream: the request is aborted and its blocks freed
        agen = eng.generate(Request("g2", prompt_ids(81), SamplingParams(n_predict=400, ignore_eos=True, **GREEDY)))
        async for out in agen:
            break
        await agen.aclose()
        for _ in range(100):
            free = eng.call(lambda core: core.kv.num_free_blocks == core.kv.num_blocks - 1 and not core.has_work()).result()
            if free:
                break
            await asyncio.sleep(0.02)
        assert free
        with pytest.raises(ContextSizeExceededError):
            async for _ in eng.generate(Request("g3", prompt_ids(82, 600), SamplingParams())):
                pass

    try:
        asyncio.run(main())
    finally:
        eng.shutdown()


def _model_refs(core: EngineCore) -> list[weakref.ref]:
    """Weak references to what an unloaded model must not leave behind."""
    return [weakref.ref(x) for x in (core, core.model, core.runner, core.runner.kv_caches[0][0],
                                     core.model.tok_embd, core.tokenizer)]


DRY = dict(dry_multiplier=0.8, dry_sequence_breakers=("\n", ":", "zz"))


def test_breaker_cache_is_shared_while_the_engine_lives_and_dies_with_it(tiny_gguf):
    """DRY breaker sets are shared by one engine's requests (built once per breaker tuple)
    but not pinned by a module-level cache: the core, model, KV tensors and tokenizer are
    freed once the core is dropped (an lru_cache keyed by the core's token-text method
    held them all)."""
    core = make_core(tiny_gguf)
    outs, _ = run_all(core, [Request(f"d{i}", prompt_ids(90 + i), SamplingParams(n_predict=4, **GREEDY, **DRY))
                             for i in range(2)])
    assert all(o[-1].finished for o in outs.values())
    a = SequenceSampler(SamplingParams(**DRY), 10, frozenset(), breakers=core.breakers)
    b = SequenceSampler(SamplingParams(**DRY), 10, frozenset(), breakers=core.breakers)
    a._dry_penalties([1, 2, 1, 2]), b._dry_penalties([1, 2, 1, 2])
    assert a._dry_breakers is b._dry_breakers is core.breakers.get(DRY["dry_sequence_breakers"])
    refs = _model_refs(core)
    del core, outs, a, b
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


def test_async_engine_shutdown_lets_go_of_the_model(tiny_gguf):
    """After shutdown() (thread joined) and gc.collect(), nothing of the model is reachable from
    the AsyncEngine or any module: the weights, KV tensors and tokenizer are freed. Counts and
    sizes stay readable; later requests and calls fail with EngineDeadError."""
    from kvserve.engine.async_engine import AsyncEngine, EngineDeadError

    core = make_core(tiny_gguf)
    eng = AsyncEngine(core)
    refs = _model_refs(core)
    del core

    async def main():
        async for out in eng.generate(Request("s1", prompt_ids(85), SamplingParams(n_predict=5, **GREEDY, **DRY))):
            pass
        assert out.finished
        eng.step_listeners.append(lambda core, outs: None)
        assert eng.call(lambda core: core.num_running).result() == 0

    asyncio.run(main())
    assert eng.shutdown() is True
    assert not eng._thread.is_alive()
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
    assert eng.core is None and eng.tokenizer is None and not eng.alive
    assert (eng.n_ctx, eng.n_slots, eng.stats.requests_finished) == (512, 4, 1)
    with pytest.raises(EngineDeadError):
        eng.call(lambda core: 1).result()
    with pytest.raises(EngineDeadError):
        eng.validate(Request("s2", [1, 2], SamplingParams()))
    assert eng.shutdown() is True  # idempotent


def test_shutdown_of_a_dead_engine_drops_the_failures_frames(tiny_gguf, monkeypatch):
    """An engine that died from an exception keeps it in ``error``; its traceback's frames
    hold the core, so shutdown clears them."""
    from kvserve.engine.async_engine import AsyncEngine

    # pytest's log capture keeps the logged record, and with it the traceback's frames
    monkeypatch.setattr(logging.getLogger("kvserve.engine"), "propagate", False)
    core = make_core(tiny_gguf)
    eng = AsyncEngine(core)
    refs = _model_refs(core)

    def boom():
        raise RuntimeError("step failed")

    core.step = boom  # an exception outside the per-request recovery kills the engine thread
    del core
    eng.call(lambda c: c.scheduler.waiting.append(Request("x", [1], SamplingParams())))  # has_work: True
    for _ in range(200):
        if not eng.alive:
            break
        time.sleep(0.01)
    assert not eng.alive and eng.error.__traceback__ is not None
    assert eng.shutdown()
    gc.collect()
    assert eng.error.__traceback__ is None
    assert [r() for r in refs] == [None] * len(refs)


def test_prompt_logprobs_cover_every_prompt_token(tiny_gguf):
    llm = LLM(make_core(tiny_gguf, max_num_batched_tokens=7))  # chunks of 7 tokens
    c = llm.generate([prompt_ids(90)], SamplingParams(n_predict=1, prompt_logprobs=2, **GREEDY))[0]
    plp = c.prompt_logprobs
    assert len(plp) == 20 and plp[0] is None
    assert [x.id for x in plp[1:]] == prompt_ids(90)[1:]
    assert all(x.logprob <= 0 and len(x.top_logprobs) == 2 for x in plp[1:])


# --- bad input ---------------------------------------------------------------------


def test_unknown_architecture(tmp_path):
    hf = tinymodel.write_tiny_hf_dir(tmp_path / "hf")
    cfg = (hf / "config.json").read_text().replace("LlamaForCausalLM", "GPTNeoXForCausalLM")
    (hf / "config.json").write_text(cfg)
    with pytest.raises(ModelLoadError, match="unknown model architecture"):
        load_files(hf)
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gptj")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unknown model architecture 'gptj'"):
        load_files(tmp_path / "x.gguf")


def test_truncated_gguf(tiny_gguf, tmp_path):
    data = Path(tiny_gguf).read_bytes()
    for cut in (10, 2000, len(data) - 100):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated|not a GGUF"):
            load_files(p)


def test_missing_tensor(tmp_path):
    hf = tinymodel.write_tiny_hf_dir(tmp_path / "hf")
    from safetensors.numpy import load_file, save_file

    t = load_file(hf / "model.safetensors")
    del t["model.layers.1.mlp.up_proj.weight"]
    save_file(t, hf / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing tensor 'blk.1.ffn_up.weight'"):
        load_files(hf)


def test_hf_dir_without_config(tmp_path):
    hf = tinymodel.write_tiny_hf_dir(tmp_path / "hf")
    (hf / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_files(hf)
    with pytest.raises(FileNotFoundError):
        load_files(tmp_path / "nothing.gguf")
    shutil.rmtree(hf)
