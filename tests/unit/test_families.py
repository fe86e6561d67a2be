"""Each family against transformers' reference forward (float32), loaded from an HF directory
(``save_pretrained``) and from a GGUF with llama.cpp's names (tests/family_models.py): logits over a
prompt within 1e-4 of the logit scale, and 32 greedy tokens identical alone, batched with another
sequence, cold and with a prefix-cache hit."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers is a test-only dependency ([test] extra)")

import family_models as fmod  # noqa: E402
from kvserve.config import EngineConfig  # noqa: E402
from kvserve.engine.core import EngineCore  # noqa: E402
from kvserve.engine.request import Request, SamplingParams  # noqa: E402
from kvserve.loaders.weights import ModelLoadError  # noqa: E402
from kvserve.models.build import build_model, load_files  # noqa: E402

PROMPT = [5, 77, 120, 33, 250, 9, 18, 260, 41, 199, 7, 88, 150, 290, 61, 12, 3, 222, 140, 55]
OTHER = [100, 4, 37, 299, 11, 76, 180, 23, 9]
N_GREEDY = 32

#: family -> (model_type, GGUF arch, transformers config options with the family's features on)
CASES = {
    "qwen3": ("qwen3", "qwen3", dict(head_dim=32, rope_theta=1e6, tie_word_embeddings=True)),
    "qwen3-bias": ("qwen3", "qwen3", dict(attention_bias=True, tie_word_embeddings=False)),
    "llama3-rope": ("llama", "llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 16},
                                            rope_theta=10000.0, tie_word_embeddings=True)),
    "llama-bias": ("llama", "llama", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
    # 8 experts, 2 per token, renormalised (Qwen3-30B-A3B: 128 / 8); every layer a MoE layer
    "qwen3moe": ("qwen3_moe", "qwen3moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
    # windows of 8 tokens: PROMPT (20) and the 32 greedy tokens run far past them
    "gemma2": ("gemma2", "gemma2", dict(num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=16,
                                        attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("gemma3_text", "gemma3", dict(num_hidden_layers=7, sliding_window=8, query_pre_attn_scalar=16,
                                             rope_parameters={"full_attention": {"rope_type": "linear",
                                                                                 "factor": 4.0, "rope_theta": 1e6},
                                                              "sliding_attention": {"rope_type": "default",
                                                                                    "rope_theta": 10000.0}})),
    # YaRN (shared RoPE code): the ramp over dims 2..6 of 8 (original context 4096, betas 16 / 2),
    # cos/sin times 0.1 ln 4 + 1; llama.cpp's converter writes mistral as "llama" (q/k permuted)
    "mistral-yarn": ("mistral", "llama", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                              "rope_theta": 10000.0,
                                                              "original_max_position_embeddings": 4096,
                                                              "beta_fast": 16.0, "beta_slow": 2.0},
                                              max_position_embeddings=16384, sliding_window=None)),
    # YaRN and the query temperature: 1 + 0.5 ln(1 + floor(p / 8)) grows over the 20-60 positions;
    # Ministral 3's mscale = mscale_all_dim = 1: cos/sin not scaled (the GGUF's yarn_log_multiplier 1)
    "mistral3": ("ministral3", "mistral3", dict(rope_parameters={"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6,
                                                                 "original_max_position_embeddings": 8,
                                                                 "mscale": 1.0, "mscale_all_dim": 1.0,
                                                                 "llama_4_scaling_beta": 0.5},
                                                max_position_embeddings=512)),
    # fused q|k|v and gate|up, half the head rotated, LongRoPE: the original context (8) is below
    # every sequence (OTHER: 9) and the engine's (512): the long factors, attention factor sqrt(3)
    # (512 / 8 = 64); transformers would take the short ones for a sequence of 8 or fewer
    "phi3-longrope": ("phi3", "phi3", dict(max_position_embeddings=512, original_max_position_embeddings=8,
                                           rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                            "partial_rotary_factor": 0.5,
                                                            "original_max_position_embeddings": 8,
                                                            "short_factor": [1.0, 1.5, 2.0, 3.0],
                                                            "long_factor": [1.0, 4.0, 9.0, 20.0]})),
    # the original context (1024) above the engine's (512): the short factors, attention factor
    # sqrt(1 + ln 2 / ln 1024); the whole head rotated
    "phi3-short": ("phi3", "phi3", dict(max_position_embeddings=2048, original_max_position_embeddings=1024,
                                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                         "original_max_position_embeddings": 1024,
                                                         "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0],
                                                         "long_factor": [9.0] * 8})),
    # every layer's window 8 (Phi-3-mini-4k: 2047 of 4096), plain RoPE: PROMPT and the greedy tokens
    # run past it
    "phi3-window": ("phi3", "phi3", dict(sliding_window=8)),
    # sinks, windows of 4 on layers 0 and 2, biases everywhere, 8 experts top-4 with the clamped
    # SwiGLU (about a tenth of gate/up values past 7), YaRN (NEOX in both formats)
    "gpt-oss": ("gpt_oss", "gpt-oss", dict(num_hidden_layers=3, sliding_window=4, num_local_experts=8,
                                           num_experts_per_tok=4, max_position_embeddings=512,
                                           rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                            "original_max_position_embeddings": 128,
                                                            "beta_fast": 32.0, "beta_slow": 1.0})),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """The case's transformers model, its HF directory and GGUF, the reference logits over PROMPT,
    and the reference greedy tokens of PROMPT and OTHER (end-of-generation ids banned)."""
    model_type, arch, cfg = CASES[request.param]
    model = fmod.build(model_type, seed=11, **cfg)
    d = tmp_path_factory.mktemp(request.param)
    hf = fmod.save_hf(model, d / "hf")
    gg = fmod.save_gguf(model, d / "m.gguf", arch)
    eog = sorted(load_files(str(gg)).tokenizer.eog_token_ids)
    assert eog == sorted(load_files(str(hf)).tokenizer.eog_token_ids)
    return dict(name=request.param, model=model, paths={"hf": str(hf), "gguf": str(gg)}, eog=eog,
                ref=fmod.reference_logits(model, PROMPT),
                greedy=fmod.reference_greedy(model, PROMPT, N_GREEDY, eog),
                greedy_other=fmod.reference_greedy(model, OTHER, N_GREEDY, eog))


def _core(path: str, **cfg) -> EngineCore:
    cfg.setdefault("n_ctx", 512)
    cfg.setdefault("dtype", "float32")
    cfg.setdefault("kv_dtype", "f32")  # the comparison is in float32 end to end (f16 KV moves near-ties)
    return EngineCore(load_files(path), EngineConfig(**cfg))


def _logits(core: EngineCore, ids: list[int]) -> torch.Tensor:
    from kvserve.models.llama import AttentionBatch, PrefillGroup

    c = core.model_config
    T = len(ids)
    kv = [(torch.zeros(T, c.n_head_kv, c.head_dim), torch.zeros(T, c.n_head_kv, c.head_dim)) for _ in range(c.n_layer)]
    b = AttentionBatch(positions=torch.arange(T), slot_mapping=torch.arange(T), prefills=[PrefillGroup(0, T, 0, None)])
    return core.model(torch.tensor(ids), b, kv, None)


def _run(core: EngineCore, reqs: list[Request]) -> dict[str, list]:
    outs: dict[str, list] = {r.request_id: [] for r in reqs}
    for r in reqs:
        core.add_request(r)
    steps = 0
    while any(not o or not o[-1].finished for o in outs.values()):
        for out in core.step():
            outs[out.request_id].append(out)
        steps += 1
        assert steps < 1000
    return outs


def _greedy() -> SamplingParams:
    return SamplingParams(n_predict=N_GREEDY, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_logits_match_transformers(case, fmt):
    ref = case["ref"]
    got = _logits(_core(case["paths"][fmt]), PROMPT)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item(), case["name"]


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_greedy_alone_batched_and_with_a_prefix_hit(case, fmt):
    core = _core(case["paths"][fmt])
    alone = _run(core, [Request("a", PROMPT, _greedy())])["a"]
    assert [t for o in alone for t in o.new_token_ids] == case["greedy"], case["name"]
    assert alone[-1].num_cached_tokens == 0
    # batched with another sequence; PROMPT's blocks are cached from the first run (a hit)
    longer = PROMPT + case["greedy"][:8]
    outs = _run(core, [Request("b", longer, _greedy()), Request("c", OTHER, _greedy())])
    assert outs["b"][-1].num_cached_tokens >= 16 and outs["c"][-1].num_cached_tokens == 0
    ref_b = fmod.reference_greedy(case["model"], longer, N_GREEDY, case["eog"])
    assert [t for o in outs["b"] for t in o.new_token_ids] == ref_b, case["name"]
    assert [t for o in outs["c"] for t in o.new_token_ids] == case["greedy_other"], case["name"]


def test_native_step_and_parallel_only_where_they_apply(case):
    name, paths = case["name"], case["paths"]
    from kvserve.engine.parallel import parallel_error
    from kvserve.models.family import family_of

    loaded = load_files(paths["gguf"])
    fam = family_of(loaded.config.arch)
    model = build_model(loaded, EngineConfig(dtype="auto", n_ctx=512), 512)
    if name == "llama3-rope":  # the plain llama block: RoPE tables come from Python, the C++ step applies
        assert "rope_freqs.weight" in loaded.weights and fam.native_decode(loaded.config) is True
        assert parallel_error(loaded.config, 2, 1) is None
        return
    # the C++ step's layer with qwen3's q/k norm and qwen3moe's experts applies to these families (on the
    # file's blocks: tests/unit/test_decode_native_qwen3.py), not to these F32 files (no GGUF blocks)
    if name in ("qwen3", "qwen3moe"):
        assert fam.native_decode(loaded.config) is True
        assert model.native_decode is False
    else:  # biases, gemma, phi3's and YaRN's RoPE, gpt-oss: not in the C++ step
        assert fam.native_decode(loaded.config) is False
        assert model.native_decode is False
    from kvserve.models.family import FULL, KVSpec

    swa = KVSpec("sliding", 8)
    assert fam.kv_spec(loaded.config) == {"gemma2": (swa, FULL, swa),
                                          "gemma3": (swa,) * 5 + (FULL, swa),
                                          "gpt-oss": (KVSpec("sliding", 4), FULL, KVSpec("sliding", 4)),
                                          "phi3-window": (swa, swa)}.get(
        name, (FULL,) * loaded.config.n_layer)
    if name == "mistral-yarn":  # the llama block; shards build the same (YaRN) RoPE tables from the config
        assert parallel_error(loaded.config, 2, 1) is None
        return
    assert parallel_error(loaded.config, 2, 1).startswith("tensor and pipeline parallelism run the plain llama")


def test_rope_factors_change_the_logits(case):
    """The llama3 case is sensitive to its per-dimension factors: without them the logits differ."""
    name, paths, ref = case["name"], case["paths"], case["ref"]
    if name != "llama3-rope":
        pytest.skip("the llama3 RoPE case only")
    loaded = load_files(paths["gguf"])
    del loaded.weights["rope_freqs.weight"]
    core = EngineCore(loaded, EngineConfig(n_ctx=512, dtype="float32"))
    assert (_logits(core, PROMPT) - ref).abs().max().item() > 1e-2 * ref.abs().max().item()


def test_phi3_window_changes_the_logits(case):
    """The phi3 window case is sensitive to its window: attending to the whole prompt differs."""
    name, paths, ref = case["name"], case["paths"], case["ref"]
    if name != "phi3-window":
        pytest.skip("the phi3 window case only")
    for fmt in ("hf", "gguf"):
        core = _core(paths[fmt])
        assert core.model.window == 8
        core.model.window = 0
        assert (_logits(core, PROMPT) - ref).abs().max().item() > 1e-2 * ref.abs().max().item()


def test_unknown_rope_scaling_is_refused_naming_the_key(tmp_path):
    model = fmod.build("llama", seed=1)
    hf = fmod.save_hf(model, tmp_path / "hf")
    import json

    cfg = json.loads((hf / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as e:
        load_files(hf)
    assert str(e.value) == (f"{hf}: config.json rope_parameters.rope_type is 'dynamic': kvserve computes linear, "
                            "llama3, yarn (or default)")


def test_missing_qk_norm_is_refused_naming_the_tensor(tmp_path):
    import gguf
    import numpy as np

    model = fmod.build("qwen3", seed=2)
    src = fmod.save_gguf(model, tmp_path / "m.gguf", "qwen3")
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(tmp_path / "cut.gguf"), "qwen3")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY
                        else None)
    for t in r.tensors:
        if t.name != "blk.1.attn_k_norm.weight":
            w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError) as e:
        load_files(tmp_path / "cut.gguf")
    assert str(e.value) == f"{tmp_path / 'cut.gguf'}: missing tensor 'blk.1.attn_k_norm.weight'"


def test_compiled_decode_graph_matches_forward(case):
    """LlamaModel.decode_step (the graph --compile traces; run eagerly here) computes the same
    q/k norms, biases and RoPE factors as forward: one decode after PROMPT."""
    core = _core(case["paths"]["gguf"])
    m, c = core.model, core.model_config
    if case["name"].startswith(("gemma", "gpt-oss", "phi3-window")):  # not written for the compiled graph:
        # CompiledDecode stays eager
        block = {"gpt-oss": "the gpt-oss block", "phi3-window": "phi3's sliding window"}.get(case["name"],
                                                                                         "the gemma block")
        with pytest.raises(NotImplementedError, match=f"does not implement {block}"):
            m.decode_step()
        return
    T = len(PROMPT)
    nxt = case["greedy"][0]
    full = _logits(core, PROMPT + [nxt])[-1]
    kv = [(torch.zeros(T + 1, c.n_head_kv, c.head_dim), torch.zeros(T + 1, c.n_head_kv, c.head_dim))
          for _ in range(c.n_layer)]
    from kvserve.models.llama import AttentionBatch, PrefillGroup

    b = AttentionBatch(positions=torch.arange(T), slot_mapping=torch.arange(T), prefills=[PrefillGroup(0, T, 0, None)])
    m(torch.tensor(PROMPT), b, kv, None)
    with torch.inference_mode():
        got = m.decode_step(torch.tensor([nxt]), torch.tensor([T]), torch.tensor([T]), torch.arange(T + 1),
                            torch.ones(1, 1, 1, T + 1, dtype=torch.bool), kv)[0]
    assert (got - full).abs().max().item() <= 1e-4 * full.abs().max().item(), case["name"]


def test_qwen3moe_dense_layers_and_router_from_hf(tmp_path):
    """mlp_only_layers: layer 1 keeps a dense MLP (HF only: llama.cpp's qwen3moe has none); the router
    picks 2 of 8 experts per token and rows are grouped by expert."""
    model = fmod.build("qwen3_moe", seed=5, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       norm_topk_prob=True, mlp_only_layers=[1])
    hf = fmod.save_hf(model, tmp_path / "hf")
    loaded = load_files(str(hf))
    assert (loaded.config.n_expert, loaded.config.n_expert_used, loaded.config.dense_layers) == (8, 2, (1,))
    assert loaded.weights["blk.0.ffn_gate_exps.weight"].shape == (8, 32, 64)
    ref = fmod.reference_logits(model, PROMPT)
    got = _logits(EngineCore(loaded, EngineConfig(n_ctx=512, dtype="float32", kv_dtype="f32")), PROMPT)
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_gguf_options_kvserve_lacks_are_refused_naming_the_key(tmp_path):
    import tinymodel
    from kvserve.models.family import read_gguf_config

    p = tinymodel.write_tiny_gguf(tmp_path / "y.gguf", metadata={"llama.rope.scaling.type": "longrope"})
    with pytest.raises(ModelLoadError) as e:
        load_files(p)
    assert str(e.value) == (f"{p}: GGUF key 'llama.rope.scaling.type' is 'longrope': kvserve computes linear, llama3, "
                            "yarn (or none)")
    llama = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
             "llama.block_count": 2, "llama.feed_forward_length": 128, "llama.context_length": 512}
    with pytest.raises(ModelLoadError, match=r"^l.gguf: tensor 'rope_freqs.weight' has shape \[16\], expected \[8\]"):
        read_gguf_config(llama, "l.gguf", {"rope_freqs.weight": (16,)})
    md = {"general.architecture": "gemma3", "gemma3.embedding_length": 64, "gemma3.attention.head_count": 4,
          "gemma3.block_count": 2, "gemma3.feed_forward_length": 128, "gemma3.context_length": 512}
    with pytest.raises(ModelLoadError, match="^g.gguf: missing GGUF key 'gemma3.attention.sliding_window'$"):
        read_gguf_config(md, "g.gguf")
    cfg = read_gguf_config({**md, "gemma3.attention.sliding_window": 512}, "g.gguf")
    assert cfg.layer_windows == (512, 512) and cfg.rope_local_base == 10000.0 and cfg.qk_norm
    assert cfg.rope_freq_base == 10000.0 and cfg.rope_scaling is None
    # Ollama's converter: two named bases, a linear scale, a per-layer bool pattern
    cfg = read_gguf_config({**md, "gemma3.attention.sliding_window": 512, "gemma3.rope.global.freq_base": 1e6,
                            "gemma3.rope.local.freq_base": 5e3, "gemma3.rope.freq_scale": 0.125,
                            "gemma3.attention.sliding_window_pattern": [False, True]}, "g.gguf")
    assert cfg.layer_windows == (0, 512) and (cfg.rope_freq_base, cfg.rope_local_base) == (1e6, 5e3)
    assert cfg.rope_scaling["type"] == "linear" and cfg.rope_scaling["factor"] == 8.0
    md = {**{k.replace("gemma3", "qwen3moe"): v for k, v in md.items()}, "general.architecture": "qwen3moe"}
    with pytest.raises(ModelLoadError, match="^q.gguf: missing GGUF key 'qwen3moe.expert_count'$"):
        read_gguf_config(md, "q.gguf")


def test_phi3_rope_tables_fused_tensors_and_refusals(tmp_path):
    """phi3: the long factors above the original context and the short ones at or below it (magnitude
    the attention factor, pairs past rope_dim not rotated); fused tensors cut at load; the sliding
    window read from both formats; another RoPE type and factors of the wrong length refused naming
    the key / tensor."""
    import json
    import math

    from kvserve.models.family import read_gguf_config
    from kvserve.models.phi3 import rope_tables

    _, _, opts = CASES["phi3-longrope"]
    model = fmod.build("phi3", seed=3, **opts)
    hf = fmod.save_hf(model, tmp_path / "hf")
    loaded = load_files(str(hf))
    c = loaded.config
    assert (c.rope_dim, c.n_ctx_orig, c.rope_long) == (8, 8, (1.0, 4.0, 9.0, 20.0))
    assert c.rope_attn_factor == pytest.approx(math.sqrt(3.0))
    assert "blk.0.attn_qkv.weight" not in loaded.weights and loaded.weights["blk.0.attn_k.weight"].shape == (32, 64)
    assert loaded.weights["blk.0.ffn_gate.weight"].shape == loaded.weights["blk.0.ffn_up.weight"].shape == (128, 64)
    for n, factors in ((9, c.rope_long), (8, c.rope_short)):
        t = rope_tables(c, n)
        inv = [1.0 / (f * 10000.0 ** (2 * i / 8)) for i, f in enumerate(factors)]
        assert torch.allclose(t[3, :4].angle().double(), torch.tensor([3 * x for x in inv], dtype=torch.float64),
                              atol=1e-6)
        assert torch.allclose(t[3, :4].abs(), torch.full((4,), math.sqrt(3.0)), atol=1e-6)
        assert torch.equal(t[3, 4:], torch.ones(4, dtype=torch.complex64))
    assert c.window == 0
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "sliding_window": 256}))
    assert load_files(str(hf)).config.window == 256
    (hf / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}))
    with pytest.raises(ModelLoadError) as e:
        load_files(str(hf))
    assert str(e.value) == (f"{hf}: config.json rope_parameters.rope_type is 'yarn': kvserve computes longrope "
                            "(or default) for phi3")
    md = {"general.architecture": "phi3", "phi3.embedding_length": 64, "phi3.attention.head_count": 4,
          "phi3.block_count": 2, "phi3.feed_forward_length": 128, "phi3.context_length": 4096,
          "phi3.rope.dimension_count": 12}
    with pytest.raises(ModelLoadError, match=r"^p.gguf: tensor 'rope_factors_long.weight' has shape \[8\], "
                                             r"expected \[6\] \(phi3.rope.dimension_count / 2\)$"):
        read_gguf_config(md, "p.gguf", {"rope_factors_long.weight": (8,)})
    assert read_gguf_config({**md, "phi3.attention.sliding_window": 2047}, "p.gguf").window == 2047
    assert read_gguf_config({**md, "phi3.attention.sliding_window": 0}, "p.gguf").window == 0
    assert read_gguf_config({**md, "phi3.attention.sliding_window": 262144}, "p.gguf").rope_dim == 12


@pytest.mark.parametrize("rope", [
    {"factor": 8.0, "original_max_position_embeddings": 4096},
    {"factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 64, "beta_slow": 2, "truncate": False},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707},
    {"factor": 2.0, "original_max_position_embeddings": 2048, "attention_factor": 1.25},
])
def test_yarn_frequencies_and_attention_factor_equal_transformers(rope):
    """The shared YaRN code (kvserve.models.llama.rope_inv_freq / rope_attention_factor) against
    transformers' _compute_yarn_parameters: frequencies and attention factor, every option."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvserve.models.family import read_hf_config
    from kvserve.models.llama import rope_attention_factor, rope_inv_freq

    params = {"rope_type": "yarn", "rope_theta": 500000.0, **rope}
    hf = AutoConfig.for_model("llama", hidden_size=1024, num_attention_heads=8, head_dim=128, num_hidden_layers=1,
                              intermediate_size=64, vocab_size=300, max_position_embeddings=131072,
                              rope_parameters=dict(params))
    ref_inv, ref_attn = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "num_attention_heads": 8, "head_dim": 128,
           "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 300, "max_position_embeddings": 131072,
           "rope_parameters": params}
    c = read_hf_config(cfg, "m")
    assert torch.allclose(rope_inv_freq(c).double(), ref_inv.double(), rtol=1e-6, atol=0)
    assert rope_attention_factor(c) == pytest.approx(ref_attn, rel=1e-12)


def test_yarn_gguf_keys():
    """llama.cpp's YaRN keys: betas, attn_factor times YaRN's mscale, yarn_log_multiplier as
    transformers' mscale_all_dim (with mscale 1); a missing original context refused naming the key."""
    import math

    from kvserve.models.family import read_gguf_config
    from kvserve.models.llama import rope_attention_factor

    md = {"general.architecture": "qwen3", "qwen3.embedding_length": 64, "qwen3.attention.head_count": 4,
          "qwen3.block_count": 2, "qwen3.feed_forward_length": 128, "qwen3.context_length": 131072,
          "qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0}
    with pytest.raises(ModelLoadError, match=r"^q.gguf: missing GGUF key 'qwen3.rope.scaling.original_context_length' "
                                             r"\(YaRN\)$"):
        read_gguf_config(md, "q.gguf")
    md["qwen3.rope.scaling.original_context_length"] = 32768
    c = read_gguf_config(md, "q.gguf")
    assert c.rope_scaling == {"type": "yarn", "factor": 4.0, "original_context_length": 32768, "beta_fast": 32.0,
                              "beta_slow": 1.0}
    assert rope_attention_factor(c) == pytest.approx(0.1 * math.log(4.0) + 1.0)
    c = read_gguf_config({**md, "qwen3.rope.scaling.attn_factor": 0.5, "qwen3.rope.scaling.yarn_beta_fast": 16.0},
                         "q.gguf")
    assert c.rope_scaling["beta_fast"] == 16.0
    assert rope_attention_factor(c) == pytest.approx(0.5 * (0.1 * math.log(4.0) + 1.0))
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for log_mul, attn in ((0.0707, 1.0), (1.0, 1.0), (0.5, 0.5)):
        c = read_gguf_config({**md, "qwen3.rope.scaling.yarn_log_multiplier": log_mul,
                              "qwen3.rope.scaling.attn_factor": attn}, "q.gguf")
        hf = AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                                  intermediate_size=64, vocab_size=300, max_position_embeddings=131072,
                                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                   "original_max_position_embeddings": 32768, "mscale": 1.0,
                                                   "mscale_all_dim": log_mul})
        assert rope_attention_factor(c) == pytest.approx(attn * ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")[1], rel=1e-12)
    assert rope_attention_factor(c) == pytest.approx(0.5 * (0.1 * math.log(4.0) + 1.0) / (0.05 * math.log(4.0) + 1.0))


def test_mistral3_query_temperature_and_refusals(tmp_path):
    """mistral3: the query temperature changes the logits (the case above is sensitive to it), and
    so does YaRN's mscale ratio (the GGUF's yarn_log_multiplier); its GGUF and HF keys read; a
    sliding window refused naming the key."""
    import json

    from kvserve.models.family import read_gguf_config, read_hf_config
    from kvserve.models.llama import rope_attention_factor

    _, _, opts = CASES["mistral3"]
    model = fmod.build("ministral3", seed=4, **opts)
    gg = fmod.save_gguf(model, tmp_path / "m.gguf", "mistral3")
    core = _core(str(gg))
    c = core.model_config
    assert (c.attn_temp_beta, c.attn_temp_len) == (0.5, 8)
    assert (c.rope_scaling["type"], c.rope_scaling["factor"]) == ("yarn", 8.0)
    assert core.model.q_scale[[0, 7, 8, 16, 24]].tolist() == pytest.approx(
        [1.0, 1.0, 1 + 0.5 * math.log(2), 1 + 0.5 * math.log(3), 1 + 0.5 * math.log(4)])
    ref = fmod.reference_logits(model, PROMPT)
    assert (_logits(core, PROMPT) - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    assert rope_attention_factor(c) == 1.0 and rope_attention_factor(read_hf_config(
        json.loads((fmod.save_hf(model, tmp_path / "hf") / "config.json").read_text()), "d")) == 1.0
    q_scale, core.model.q_scale = core.model.q_scale, None
    assert (_logits(core, PROMPT) - ref).abs().max().item() > 1e-2 * ref.abs().max().item()
    core.model.q_scale = q_scale  # without the log multiplier: cos/sin times 0.1 ln 8 + 1
    core.model.rope_cis = core.model.rope_cis * (0.1 * math.log(8.0) + 1.0)
    assert (_logits(core, PROMPT) - ref).abs().max().item() > 1e-2 * ref.abs().max().item()
    md = {"general.architecture": "mistral3", "mistral3.embedding_length": 64, "mistral3.attention.head_count": 4,
          "mistral3.block_count": 2, "mistral3.feed_forward_length": 128, "mistral3.context_length": 4096}
    with pytest.raises(ModelLoadError, match=r"^m.gguf: GGUF key 'mistral3.attention.sliding_window' is 1024, "):
        read_gguf_config({**md, "mistral3.attention.sliding_window": 1024}, "m.gguf")
    c = read_gguf_config({**md, "mistral3.rope.scaling.type": "yarn", "mistral3.rope.scaling.factor": 16.0,
                          "mistral3.rope.scaling.original_context_length": 256,
                          "mistral3.rope.scaling.yarn_log_multiplier": 1.0}, "m.gguf")
    assert rope_attention_factor(c) == 1.0
    # attention.temperature_length: llama.cpp's period is the original context whatever the key says
    yarn = {**md, "mistral3.rope.scaling.type": "yarn", "mistral3.rope.scaling.factor": 16.0,
            "mistral3.rope.scaling.original_context_length": 256, "mistral3.attention.temperature_scale": 0.1}
    c = read_gguf_config({**yarn, "mistral3.attention.temperature_length": 256}, "m.gguf")
    assert (c.attn_temp_beta, c.attn_temp_len) == (pytest.approx(0.1), 256)
    assert read_gguf_config(yarn, "m.gguf").attn_temp_len == 256
    with pytest.raises(ModelLoadError) as e:
        read_gguf_config({**yarn, "mistral3.attention.temperature_length": 8192}, "m.gguf")
    assert str(e.value) == ("m.gguf: GGUF key 'mistral3.attention.temperature_length' is 8192, not the original "
                            "context (256, 'mistral3.rope.scaling.original_context_length'): llama.cpp steps the "
                            "attention temperature every original context and ignores the key; kvserve does not "
                            "guess which applies")
    no_temp = {k: v for k, v in yarn.items() if k != "mistral3.attention.temperature_scale"}
    assert read_gguf_config({**no_temp, "mistral3.attention.temperature_length": 8192}, "m.gguf").attn_temp_beta == 0
    cfg = {"architectures": ["Ministral3ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
           "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 301, "max_position_embeddings": 4096}
    assert read_hf_config(cfg, "d").attn_temp_beta == 0.0
    # Mistral's own llama_4_scaling block (params.json's names) where a config.json carries it
    l4 = read_hf_config({**cfg, "llama_4_scaling": {"beta": 0.1, "original_max_position_embeddings": 16384}}, "d")
    assert (l4.attn_temp_beta, l4.attn_temp_len) == (0.1, 16384)
    rope = {"rope_type": "yarn", "factor": 16.0, "rope_theta": 1e6, "original_max_position_embeddings": 16384,
            "llama_4_scaling_beta": 0.1}
    same = read_hf_config({**cfg, "rope_parameters": rope, "llama_4_scaling": {"beta": 0.1}}, "d")
    assert (same.attn_temp_beta, same.attn_temp_len) == (0.1, 16384)
    with pytest.raises(ModelLoadError) as e:
        read_hf_config({**cfg, "rope_parameters": rope,
                        "llama_4_scaling": {"beta": 0.1, "original_max_position_embeddings": 8192}}, "d")
    assert str(e.value) == ("d: config.json llama_4_scaling.original_max_position_embeddings is 8192, rope_parameters "
                            "says 16384: kvserve does not guess which applies")
    with pytest.raises(ModelLoadError, match=r"^d: config.json sliding_window is 1024, shorter than the context"):
        read_hf_config({**cfg, "sliding_window": 1024}, "d")


def test_phi3_cuts_gguf_blocks_as_row_views():
    """A fused phi3 tensor kept as the file's GGUF blocks (Weight.raw, a Q4_K_M file's attn_qkv) is
    cut into row views of the same bytes, with the values of the whole tensor's rows."""
    import gguf
    import numpy as np

    from kvserve.loaders.weights import Weight

    dense = np.random.RandomState(0).standard_normal((48, 64)).astype(np.float32)
    raw = gguf.quants.quantize(dense, gguf.GGMLQuantizationType.Q8_0)  # [48, 68] bytes
    w = Weight((48, 64), raw=raw, source_type="Q8_0")
    part = w.rows(16, 40)
    assert part.shape == (24, 64) and part.raw is not None and np.shares_memory(part.raw, raw)
    np.testing.assert_array_equal(part.to_dense(), w.to_dense()[16:40])
