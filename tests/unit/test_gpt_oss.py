"""gpt-oss beyond the shared family cases of tests/unit/test_families.py: each feature (sinks, windows,
the clamp, YaRN without rounding) changes the logits, so the agreement there can fail; windows honoured
in chunked prefill, decode over many blocks and prefix hits, with the window layers in pools of their own
that hold only their window's blocks; MXFP4 experts; Ollama's ``gptoss`` files;
refusals naming the tensor or key."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers is a test-only dependency ([test] extra)")

import family_models as fmod  # noqa: E402
from kvserve.config import EngineConfig  # noqa: E402
from kvserve.engine.core import EngineCore  # noqa: E402
from kvserve.engine.request import Request, SamplingParams  # noqa: E402
from kvserve.loaders.weights import ModelLoadError  # noqa: E402
from kvserve.models.build import load_files  # noqa: E402

PROMPT = [5, 77, 120, 33, 250, 9, 18, 260, 41, 199, 7, 88, 150, 290, 61, 12, 3, 222, 140, 55]
#: 3 layers (0 and 2 slide over 4 tokens), 8 experts top-4, YaRN as the released config has it (no rounding)
CFG = dict(num_hidden_layers=3, sliding_window=4, num_local_experts=8, num_experts_per_tok=4,
           max_position_embeddings=512,
           rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                            "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The reference model, its HF directory, its GGUF with MXFP4 experts (the reference's experts
    rounded to MXFP4 first), and Ollama's ``gptoss`` form of the same weights."""
    model = fmod.build("gpt_oss", seed=5, **CFG)
    d = tmp_path_factory.mktemp("gpt-oss")
    hf = fmod.save_hf(model, d / "hf")
    # the GGUF runs YaRN as llama.cpp does (the correction range rounded): its reference does too
    rounded = fmod.build("gpt_oss", seed=5, **{**CFG, "rope_parameters": {**CFG["rope_parameters"], "truncate": True}})
    fmod.round_experts_mxfp4(rounded)
    eog = sorted(load_files(str(hf)).tokenizer.eog_token_ids)  # ignore_eos bans them, so the reference does too
    return dict(model=model, hf=str(hf), rounded=rounded, eog=eog,
                mxfp4=str(fmod.save_gguf(rounded, d / "mxfp4.gguf", "gpt-oss", expert_type="MXFP4")),
                ref=fmod.reference_logits(model, PROMPT))


def _core(path: str, **cfg) -> EngineCore:
    cfg.setdefault("n_ctx", 512)
    cfg.setdefault("dtype", "float32")
    cfg.setdefault("kv_dtype", "f32")
    return EngineCore(load_files(path), EngineConfig(**cfg))


def _logits(core: EngineCore, ids: list[int]) -> torch.Tensor:
    from kvserve.models.llama import AttentionBatch, PrefillGroup

    c = core.model_config
    T = len(ids)
    kv = [(torch.zeros(T, c.n_head_kv, c.head_dim), torch.zeros(T, c.n_head_kv, c.head_dim)) for _ in range(c.n_layer)]
    b = AttentionBatch(positions=torch.arange(T), slot_mapping=torch.arange(T), prefills=[PrefillGroup(0, T, 0, None)])
    return core.model(torch.tensor(ids), b, kv, None)


def _greedy(core: EngineCore, ids: list[int], n: int = 24) -> list[int]:
    core.add_request(Request("g", ids, SamplingParams(n_predict=n, temperature=0.0, ignore_eos=True)))
    out = []
    for _ in range(500):
        for o in core.step():
            out += o.new_token_ids
            if o.finished:
                return out
    raise AssertionError("did not finish")


def _close(got, ref) -> float:
    return (got - ref).abs().max().item() / ref.abs().max().item()


def test_hf_without_yarn_rounding_matches_transformers(tiny):
    """``truncate: false`` (the released config): the correction range is not rounded."""
    assert _close(_logits(_core(tiny["hf"]), PROMPT), tiny["ref"]) <= 1e-4


@pytest.mark.parametrize("change", ["sinks", "window", "clamp", "yarn-rounding", "router-bias"])
def test_each_feature_moves_the_logits(tiny, change):
    """Switching one feature off moves the logits far past the agreement tolerance (so the agreement
    tests can see each one)."""
    core = _core(tiny["hf"])
    m, c = core.model, core.model_config
    if change == "sinks":
        for layer in m.layers:
            layer.sinks.fill_(float("-inf"))
    elif change == "window":
        c.layer_windows = (0,) * c.n_layer
    elif change == "clamp":
        for layer in m.layers:
            layer.moe.limit = 1e9
    elif change == "yarn-rounding":
        from kvserve.models.llama import rope_attention_factor, rope_inv_freq
        from kvserve.models.window_attention import rope_cis

        c.rope_scaling = {**c.rope_scaling, "truncate": True}
        m.rope_cis = rope_cis(rope_inv_freq(c), 512, "cpu", rope_attention_factor(c))
    else:
        for layer in m.layers:
            layer.moe.router_bias.zero_()
    assert _close(_logits(core, PROMPT), tiny["ref"]) > 1e-3


def test_windows_hold_across_chunks_blocks_and_prefix_hits(tiny):
    """Prompt chunks of 3 tokens (each chunk over a cached prefix longer than the window), blocks of 4
    tokens, and a resend that reuses the cached prefix: the same greedy tokens as transformers."""
    model = tiny["model"]
    want = fmod.reference_greedy(model, PROMPT, 24, tiny["eog"])
    assert len(set(want)) >= 10
    core = _core(tiny["hf"], max_num_batched_tokens=3, block_size=4)
    assert _greedy(core, PROMPT) == want
    longer = PROMPT + want[:6]
    core.add_request(Request("h", longer, SamplingParams(n_predict=20, temperature=0.0, ignore_eos=True)))
    outs = []
    while not outs or not outs[-1].finished:
        outs += core.step()
    assert outs[-1].num_cached_tokens >= 20
    assert [t for o in outs for t in o.new_token_ids] == fmod.reference_greedy(model, longer, 20, tiny["eog"])


def test_mxfp4_experts_gguf_matches_transformers(tiny):
    """llama.cpp's names with the experts as MXFP4 blocks (3-D, ggml type 39): the reference runs the
    same MXFP4 values; logits within 1e-4 of their scale, 24 greedy tokens identical."""
    import gguf

    from kvserve.loaders.gguf import read_gguf_header

    _, infos = read_gguf_header(tiny["mxfp4"])
    types = {t.name: gguf.GGMLQuantizationType(t.ggml_type).name for t in infos}
    assert types["blk.0.ffn_gate_exps.weight"] == "MXFP4" and types["blk.2.ffn_down_exps.weight"] == "MXFP4"
    ref = fmod.reference_logits(tiny["rounded"], PROMPT)
    assert _close(_logits(_core(tiny["mxfp4"]), PROMPT), ref) <= 1e-4
    want = fmod.reference_greedy(tiny["rounded"], PROMPT, 24, tiny["eog"])
    assert _greedy(_core(tiny["mxfp4"]), PROMPT) == want


def test_missing_sinks_and_window_are_refused_naming_them(tiny):
    from kvserve.models.family import read_gguf_config

    md = {"general.architecture": "gpt-oss", "gpt-oss.embedding_length": 64, "gpt-oss.attention.head_count": 4,
          "gpt-oss.block_count": 2, "gpt-oss.feed_forward_length": 128, "gpt-oss.context_length": 512,
          "gpt-oss.expert_count": 8, "gpt-oss.expert_used_count": 4}
    with pytest.raises(ModelLoadError, match="^g.gguf: missing GGUF key 'gpt-oss.attention.sliding_window'$"):
        read_gguf_config(md, "g.gguf")
    loaded = load_files(tiny["hf"])
    from kvserve.models.family import family_of
    from kvserve.loaders.weights import check_tensors

    fam = family_of("gpt-oss")
    weights = dict(loaded.weights)
    del weights["blk.1.attn_sinks.weight"]
    with pytest.raises(ModelLoadError, match="blk.1.attn_sinks.weight"):
        check_tensors(fam.required_tensors(loaded.config, weights), weights, "m")


def test_ollama_gptoss_file_loads_as_gpt_oss(tiny, tmp_path):
    """Ollama's older form (architecture ``gptoss``, no rope.scaling.type, attn_out / attn_sinks / ffn_norm,
    gate and up fused by alternating rows, MXFP4 as ggml type 4 in the checkpoint's nibble order): the
    same logits and greedy tokens as the reference of the same MXFP4 values."""
    from kvserve.loaders.gguf import OLLAMA_MXFP4, read_gguf_header

    path = fmod.save_ollama_gptoss(tiny["rounded"], tmp_path / "ollama.gguf")
    md, infos = read_gguf_header(str(path))
    assert md["general.architecture"] == "gptoss" and "gptoss.rope.scaling.type" not in md
    types = {t.name: t.ggml_type for t in infos}
    assert types["blk.1.ffn_gate_up_exps.weight"] == OLLAMA_MXFP4 and "blk.1.attn_sinks" in types
    loaded = load_files(str(path))
    assert loaded.config.arch == "gptoss" and loaded.config.rope_scaling["type"] == "yarn"
    assert loaded.config.layer_windows == (4, 0, 4) and loaded.config.n_expert_used == 4
    ref = fmod.reference_logits(tiny["rounded"], PROMPT)
    assert _close(_logits(_core(str(path)), PROMPT), ref) <= 1e-4
    assert _greedy(_core(str(path)), PROMPT) == fmod.reference_greedy(tiny["rounded"], PROMPT, 24, tiny["eog"])


def test_ollama_mxfp4_nibble_order_round_trips():
    """ggml's MXFP4 order -> the checkpoint's (the test writer) -> ggml's (the loader): the same bytes,
    and the checkpoint's order puts elements 2k, 2k + 1 in byte k."""
    import gguf

    from kvserve.loaders.gguf import ollama_mxfp4_to_ggml

    vals = np.arange(-16, 16, dtype=np.float32).reshape(1, 32) / 4
    q = gguf.quants.quantize(vals, gguf.GGMLQuantizationType.MXFP4)
    raw = fmod.ggml_mxfp4_to_openai(q)
    assert np.array_equal(ollama_mxfp4_to_ggml(raw), q.reshape(-1))
    e = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.MXFP4)[0]
    lo = gguf.quants.dequantize(np.concatenate([q[:, :1], raw[:, 1:] & 0x0F, np.zeros((1, 8), np.uint8)], 1)[:, :17],
                                gguf.GGMLQuantizationType.MXFP4)
    assert lo[0, :8].tolist() == e[0:16:2].tolist()  # low nibbles of bytes 0..7: elements 0, 2, ..., 14


def _file_view(a: np.ndarray) -> bool:
    """True when ``a`` is a view of the loader's one buffer of the file's bytes, not a copy: the file's
    np.memmap (--mmap) or the anonymous memory it was read into (--no-mmap: kvserve.loaders.gguf)."""
    import mmap

    while isinstance(a.base, np.ndarray):
        a = a.base
    return isinstance(a, np.memmap) or isinstance(getattr(a.base, "obj", a.base), mmap.mmap)


class _CountedMatrix:
    """A block-kernel matrix whose products are counted (the one-row path's down matrices)."""

    def __init__(self, m, e: int, row: list[int]):
        self._m, self._e, self._row = m, e, row

    def mm(self, *args):
        self._row[self._e] += 1
        return self._m.mm(*args)


def _count_expert_calls(model) -> list[list[int]]:
    """Per MoE layer, per expert: runs of it from now on: calls of its gate|up Linear (steps of several
    rows) plus products of its down matrix on the one-row path (``moe.one_row``: the chosen experts'
    gate|up rows in one product, then one down product per expert), instance-level wrappers."""
    counts = []
    for layer in model.layers:
        row = [0] * len(layer.moe.gate_up)
        for e, lin in enumerate(layer.moe.gate_up):
            def wrapped(x, _f=lin.forward, _e=e, _row=row):
                _row[_e] += 1
                return _f(x)
            lin.forward = wrapped
        if layer.moe.one_row is not None:
            layer.moe.one_row._down = [_CountedMatrix(m, e, row) for e, m in enumerate(layer.moe.one_row._down)]
        counts.append(row)
    return counts


def _packed_case(path: str, ref: torch.Tensor, names: list[str]) -> list[list[int]]:
    from kvserve.models import ggml_kernel

    if ggml_kernel.ensure_built() is None:
        pytest.skip("the GGUF block kernels cannot be built here")
    loaded = load_files(path)
    for n in names:
        w = loaded.weights[n]
        assert w.raw is not None and w.raw.ndim == 3 and _file_view(w.raw), n
    core = EngineCore(loaded, EngineConfig(n_ctx=512, dtype="auto", kv_dtype="f32"))
    m = core.model
    assert all(lin.kernel == "gguf" and lin.weight is None for layer in m.layers for lin in layer.moe.gate_up)
    # each MoE layer against the same layer dequantized to float32 (the agreement tests' numerics):
    # the block kernels quantize activations to q8_0 as llama.cpp does (up to 1/254 of a 32-value
    # block's largest value each), twice per expert (gate|up, then down): close, not exact
    dense = _core(path).model
    x = torch.randn(6, loaded.config.n_embd, generator=torch.Generator().manual_seed(0))
    for packed_layer, dense_layer in zip(m.layers, dense.layers):
        assert _close(packed_layer.moe.forward(x), dense_layer.moe.forward(x)) <= 3e-2
    for layer in m.layers:  # one row (decode): the one-row path gives combine_experts' values bit for bit
        one_row = layer.moe.one_row
        assert one_row is not None
        fast = layer.moe.forward(x[:1])
        layer.moe.one_row = None
        assert torch.equal(fast, layer.moe.forward(x[:1]))
        layer.moe.one_row = one_row
    assert _close(_logits(_core(path), PROMPT), ref) <= 1e-4  # and the float32 path still agrees exactly
    counts = _count_expert_calls(m)
    _logits(core, PROMPT[:1])  # one token: only its top-k experts run
    return counts


def test_mxfp4_experts_stay_packed_and_idle_ones_are_not_run(tiny):
    """Under the default numerics the MXFP4 experts are views of the file's blocks (no dense copy),
    multiplied per expert by the block kernels; one token runs exactly its 4 experts per layer."""
    ref = fmod.reference_logits(tiny["rounded"], PROMPT)
    counts = _packed_case(tiny["mxfp4"], ref, [f"blk.{i}.ffn_{x}_exps.weight" for i in range(3) for x in
                                               ("gate", "up", "down")])
    assert [sum(c) for c in counts] == [4, 4, 4] and all(max(c) == 1 for c in counts)


def test_qwen3moe_f16_experts_stay_packed(tmp_path):
    """qwen3moe's stacked F16 experts are kept as the file's blocks too (top-2 of 8 per token)."""
    cfg = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
               decoder_sparse_step=1, mlp_only_layers=[])
    model = fmod.build("qwen3_moe", seed=11, **cfg)
    with torch.no_grad():  # the reference holds the F16 values the file holds
        for name, p in model.named_parameters():
            if ".mlp.experts." in name:
                p.copy_(p.half().float())
    path = fmod.save_gguf(model, tmp_path / "moe.gguf", "qwen3moe", expert_type="F16")
    counts = _packed_case(str(path), fmod.reference_logits(model, PROMPT),
                          [f"blk.{i}.ffn_{x}_exps.weight" for i in range(2) for x in ("gate", "up", "down")])
    assert [sum(c) for c in counts] == [2, 2] and all(max(c) == 1 for c in counts)


def test_llama_server_reads_the_same_gguf_as_kvserve(tiny, tmp_path):
    """llama.cpp is the GGUF oracle: llama-server (``$KVSERVE_LLAMA_SERVER``, a binary built from the
    llama-cpp-python sdist; opt-in) and kvserve give the same 24 greedy tokens from the MXFP4 file."""
    import os
    import subprocess
    import time

    import httpx
    from servers import free_port

    binary = os.environ.get("KVSERVE_LLAMA_SERVER")
    if not binary or not os.path.isfile(binary):
        pytest.skip("set KVSERVE_LLAMA_SERVER to a llama-server binary")
    port = free_port()
    log = open(tmp_path / "llama-server.log", "wb")
    proc = subprocess.Popen([binary, "-m", tiny["mxfp4"], "--host", "127.0.0.1", "--port", str(port), "-c", "512",
                             "-np", "1", "-t", "1"], stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "llama-server.log").read_text()
            time.sleep(0.2)
        body = {"prompt": PROMPT, "n_predict": 24, "temperature": 0, "cache_prompt": False, "return_tokens": True,
                "logit_bias": [[t, False] for t in tiny["eog"]]}
        theirs = httpx.post(url + "/completion", json=body, timeout=60).json()["tokens"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
    assert theirs == _greedy(_core(tiny["mxfp4"]), PROMPT)


def test_released_hf_layout_with_mxfp4_blocks(tiny, tmp_path):
    """An HF directory as OpenAI released gpt-oss (``quant_method: mxfp4``, uint8 ``*_blocks`` and
    ``*_scales`` experts): loaded as ggml MXFP4 blocks, not dequantized; logits within 1e-4 of the
    reference of the same values (its YaRN unrounded, as the config says), greedy tokens identical."""
    model = fmod.build("gpt_oss", seed=5, **CFG)
    fmod.round_experts_mxfp4(model)
    path = fmod.save_hf_mxfp4(model, tmp_path / "released")
    loaded = load_files(str(path))
    w = loaded.weights["blk.1.ffn_up_exps.weight"]
    assert (w.source_type, w.shape) == ("MXFP4", (8, 128, 64)) and w.raw is not None
    ref = fmod.reference_logits(model, PROMPT)
    assert _close(_logits(_core(str(path)), PROMPT), ref) <= 1e-4
    assert _greedy(_core(str(path)), PROMPT) == fmod.reference_greedy(model, PROMPT, 24, tiny["eog"])
    import json

    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="quant_method 'mxfp4'"):
        load_files(str(path))


def test_window_layers_never_read_rows_before_their_windows(tiny):
    """Rows of a window layer's cache before every query's window (here: NaN) change nothing, in a
    decode step and in a prompt chunk over a cached prefix: they are not read (what freeing those
    blocks needs)."""
    from kvserve.models.llama import AttentionBatch, PrefillGroup

    core = _core(tiny["hf"])
    m, c = core.model, core.model_config
    T = len(PROMPT)
    rows = T + 3

    def run(poison: bool) -> torch.Tensor:
        kv = [(torch.zeros(rows, c.n_head_kv, c.head_dim), torch.zeros(rows, c.n_head_kv, c.head_dim))
              for _ in range(c.n_layer)]
        m(torch.tensor(PROMPT), AttentionBatch(positions=torch.arange(T), slot_mapping=torch.arange(T),
                                               prefills=[PrefillGroup(0, T, 0, None)]), kv, None)
        if poison:
            for (k, v), w in zip(kv, c.layer_windows):
                if w:
                    k[:T - w + 1] = float("nan")  # the chunk below starts at position T: it sees T - w + 1 on
                    v[:T - w + 1] = float("nan")
        chunk = m(torch.tensor([7, 9]), AttentionBatch(positions=torch.tensor([T, T + 1]),
                                                      slot_mapping=torch.tensor([T, T + 1]),
                                                      prefills=[PrefillGroup(0, 2, T, torch.arange(T + 2))]), kv, None)
        step = m(torch.tensor([11]), AttentionBatch(positions=torch.tensor([T + 2]), slot_mapping=torch.tensor([T + 2]),
                                                   n_decode=1, decode_kv_index=torch.arange(T + 3).view(1, -1)), kv, None)
        return torch.cat([chunk, step])

    clean, poisoned = run(False), run(True)
    assert torch.isfinite(poisoned).all() and torch.equal(clean, poisoned)


def _run_tracked(core: EngineCore, requests: list[Request]) -> tuple[dict, dict, dict]:
    """Steps ``requests`` (added together) to the end: per request id its tokens, the most blocks
    its sliding group (group 0) held after a step, and its last ``num_cached_tokens``."""
    for r in requests:
        core.add_request(r)
    toks = {r.request_id: [] for r in requests}
    most = dict.fromkeys(toks, 0)
    cached = {}
    while core.has_work():
        for out in core.step():
            toks[out.request_id] += out.new_token_ids
            cached[out.request_id] = out.num_cached_tokens
        for rid in toks:
            if rid in core.scheduler.requests:
                most[rid] = max(most[rid], sum(1 for b in core.kv.group_table(0, rid) if b))
    return toks, most, cached


@pytest.mark.parametrize("tier", ["slot", "host"])
def test_window_pools_hold_only_the_window_and_agree_with_transformers(tiny, tier):
    """Layers 0 and 2 (window 4) get a pool of their own (blocks of 4 tokens): cold, 24 greedy tokens
    equal transformers' while that group holds at most the blocks one 8-token chunk and the 3 tokens
    before it span; a resend of the prompt and its answer reuses all but its last token (cache_n 43)
    and agrees again. ``slot``: one slot, no host tier: the hit comes from the window's blocks parked
    with the slot as the server parks a finished request's (the sliding pool is 9 blocks in all);
    ``host``: 4 unified slots, the released blocks wait in the host tier."""
    model = tiny["model"]
    cfg = dict(n_parallel=1, cache_ram=0) if tier == "slot" else {}
    core = _core(tiny["hf"], max_num_batched_tokens=8, block_size=4, **cfg)
    assert [g.window for g in core.kv.groups] == [4]
    assert core.runner.layer_group == [0, -1, 0]
    slots = 1 if tier == "slot" else 4
    # per slot two windows (1 + 2 blocks each), an 8-token chunk (2 blocks), the null block, the host tier
    assert len(core.kv.groups[0].blocks) == 1 + 2 * slots * (1 + 2) + 2 + core.kv.host_blocks
    assert (core.kv.host_blocks == 0) == (tier == "slot")
    params = SamplingParams(n_predict=24, temperature=0.0, ignore_eos=True)
    slot = 0 if tier == "slot" else -1  # the server's slot: its blocks are parked when it finishes
    toks, most, cached = _run_tracked(core, [Request("a", PROMPT, params, priority_slot=slot)])
    assert toks["a"] == fmod.reference_greedy(model, PROMPT, 24, tiny["eog"])
    assert cached["a"] == 0
    # the chunk at 8..15 reads from position 5: blocks 1..3; a decode step at p reads blocks (p-3)//4..p//4
    assert most["a"] == 3
    g = core.kv.groups[0]
    if tier == "slot":  # positions 0..42 computed: the window's blocks 9, 10 stay with the slot, 11 full-layer ones
        assert core.kv.parked_keys() == g.parked_keys() == ["slot:0"]
        assert [i for i, b in enumerate(g.parked_table("slot:0")) if b] == [9, 10]
        assert len(core.kv.parked_table("slot:0")) == 11 and g.num_cached_blocks == 0
    else:  # every block of both pools waits in the host tier, the window's released ones included
        assert core.kv.parked_keys() == [] and (g.num_cached_blocks, core.kv.num_cached_blocks) == (11, 11)
    longer = PROMPT + toks["a"]
    toks2, most2, cached2 = _run_tracked(core, [Request("b", longer, params, priority_slot=slot)])
    assert cached2["b"] == len(longer) - 1 == 43
    assert most2["b"] == 2
    assert toks2["b"] == fmod.reference_greedy(model, longer, 24, tiny["eog"])


def test_window_pools_in_a_batch_of_sequences_at_different_positions(tiny):
    """Two sequences decoded in one step, their windows starting at different blocks of the pool
    (``decode_kv_start`` per row, padded rows masked): each one's 16 greedy tokens equal transformers'."""
    model = tiny["model"]
    core = _core(tiny["hf"], max_num_batched_tokens=64, block_size=4)
    assert core.runner.layer_group == [0, -1, 0]
    params = SamplingParams(n_predict=16, temperature=0.0, ignore_eos=True)
    other = PROMPT[:7]
    toks, most, _ = _run_tracked(core, [Request("a", PROMPT, params), Request("b", other, params)])
    assert toks["a"] == fmod.reference_greedy(model, PROMPT, 16, tiny["eog"])
    assert toks["b"] == fmod.reference_greedy(model, other, 16, tiny["eog"])
    # the first step prefills each prompt whole: 5 blocks and 2; then at most two blocks each
    assert most == {"a": 5, "b": 2}
