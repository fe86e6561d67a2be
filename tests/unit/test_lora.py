"""LoRA adapters in the engine (kvserve.lora): PEFT and GGUF adapters of tiny random weights against
the base with the adapters merged by hand in float32; multi-adapter steps; the prefix cache's keying;
--max-loras; the native decode step; bad adapters and scales."""

import math

import numpy as np
import pytest
import torch

import tinylora
import tinymodel
from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.request import Request, SamplingParams
from kvserve.engine.slot_file import SlotFileError
from kvserve.errors import InvalidInputError, NotFoundError
from kvserve.lora import LoraRegistry, load_adapter
from kvserve.models.build import load_files

SEED = 3
PROMPT = [5, 17, 42, 9, 133, 260, 71, 8, 99, 14, 200, 31, 64, 120, 7, 250, 11, 45, 90, 180]


def make_core(path, **cfg) -> EngineCore:
    cfg.setdefault("n_ctx", 512)
    cfg.setdefault("dtype", "float32")
    return EngineCore(load_files(str(path)), EngineConfig(**cfg))


run_capture = tinylora.run_capture


_n = [0]


def req(lora=(), n=8, prompt=PROMPT, **kw) -> Request:
    _n[0] += 1
    return Request(f"r{_n[0]}", list(prompt), SamplingParams(n_predict=n, temperature=0.0), lora=tuple(lora), **kw)


def gen(core, lora=(), n=8, prompt=PROMPT):
    r = req(lora, n, prompt)
    toks, logits, _, _ = run_capture(core, [r])
    return toks[r.request_id], torch.stack(logits[r.request_id])


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-4):
    """max |got - want| <= rel x the logits' scale (max |want|)."""
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    assert diff <= rel * scale, f"max abs diff {diff:.3g} > {rel:g} x logit scale {scale:.3g}"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    f = {"base": tinymodel.write_tiny_gguf(d / "base.gguf", seed=SEED),
         "base_q8": tinymodel.write_tiny_gguf(d / "base_q8.gguf", seed=SEED, qtype="Q8_0"),
         "qwen2": tinymodel.write_tiny_gguf(d / "qwen2.gguf", arch="qwen2", seed=SEED),
         "other": tinymodel.write_tiny_gguf(d / "other.gguf", seed=SEED, n_embd=32, n_head=2, n_head_kv=1)}
    for s in (1, 2, 3):
        f[f"peft{s}"] = tinylora.write_peft_adapter(d / f"peft{s}", seed=s)
        f[f"gguf{s}"] = tinylora.write_gguf_adapter(d / f"a{s}.gguf", seed=s)
    f["gguf1_f16"] = tinylora.write_gguf_adapter(d / "a1_f16.gguf", seed=1, qtype="F16")
    f["qv"] = tinylora.write_peft_adapter(d / "qv", seed=4, rank=4, alpha=8, targets=("q_proj", "v_proj"))
    f["rs"] = tinylora.write_peft_adapter(d / "rs", seed=5, rank=8, alpha=4, use_rslora=True,
                                          rank_pattern={"down_proj": 4, "q_proj": 2},
                                          alpha_pattern={"k_proj": 32})
    f["qwen2_peft"] = tinylora.write_peft_adapter(d / "qwen2_peft", seed=6)
    f["qwen2_gguf"] = tinylora.write_gguf_adapter(d / "qwen2_a.gguf", arch="qwen2", seed=6)
    f["big"] = tinylora.write_peft_adapter(d / "big", seed=7, rank=32, alpha=32)
    f["other_peft"] = tinylora.write_peft_adapter(d / "other_peft", seed=1, n_embd=32, n_head=2, n_head_kv=1)
    f["merged1"] = tinylora.write_merged_hf_dir(d / "merged1", [(dict(seed=1), 1.0)], seed=SEED)
    f["merged1_half"] = tinylora.write_merged_hf_dir(d / "merged1_half", [(dict(seed=1), 0.5)], seed=SEED)
    f["merged12"] = tinylora.write_merged_hf_dir(d / "merged12", [(dict(seed=1), 1.0), (dict(seed=2), -0.7)],
                                                 seed=SEED)
    for s in (2, 3):
        f[f"merged{s}"] = tinylora.write_merged_hf_dir(d / f"merged{s}", [(dict(seed=s), 1.0)], seed=SEED)
    f["merged_qv"] = tinylora.write_merged_hf_dir(
        d / "merged_qv", [(dict(seed=4, rank=4, alpha=8, targets=("q_proj", "v_proj")), 1.0)], seed=SEED)
    f["merged_rs"] = tinylora.write_merged_hf_dir(
        d / "merged_rs", [(dict(seed=5, rank=8, alpha=4, use_rslora=True, rank_pattern={"down_proj": 4, "q_proj": 2},
                                alpha_pattern={"k_proj": 32}), 1.0)], seed=SEED)
    f["merged_qwen2"] = tinylora.write_merged_hf_dir(d / "merged_qwen2", [(dict(seed=6), 1.0)], seed=SEED,
                                                     arch="Qwen2ForCausalLM")
    f["merged1_q8"] = tinylora.write_merged_hf_dir(d / "merged1_q8", [(dict(seed=1), 1.0)], seed=SEED, qtype="Q8_0")
    return {k: str(v) for k, v in f.items()}


@pytest.fixture(scope="module")
def core(files):
    """The F32 base with adapters 0..2 = PEFT seeds 1..3, 3..5 = GGUF seeds 1..3."""
    c = make_core(files["base"])
    for s in (1, 2, 3):
        assert c.runner.lora.load(files[f"peft{s}"], name=f"p{s}") == s - 1
    for s in (1, 2, 3):
        assert c.runner.lora.load(files[f"gguf{s}"], name=f"g{s}") == s + 2
    return c


@pytest.fixture(scope="module")
def refs(files):
    """Greedy tokens and logits of the merged references (and the base)."""
    out = {}
    for k in ("base", "merged1", "merged2", "merged3", "merged1_half", "merged12"):
        out[k] = gen(make_core(files[k]))
    return out


# -- equivalence with the merged weights ------------------------------------------------------------

@pytest.mark.parametrize("aid", [0, 3], ids=["peft", "gguf"])
def test_adapter_equals_merged_weights(core, refs, aid):
    toks, logits = gen(core, [(aid, 1.0)])
    want_toks, want = refs["merged1"]
    assert toks == want_toks and len(toks) == 8
    assert toks != refs["base"][0]  # the adapter changes the greedy continuation
    assert_close(logits, want)


def test_base_rows_unchanged_with_adapters_loaded(core, refs):
    toks, logits = gen(core)
    assert toks == refs["base"][0]
    assert torch.equal(logits, refs["base"][1])


def test_user_scale_and_two_adapters_at_once(core, refs):
    toks, logits = gen(core, [(0, 0.5)])
    assert toks == refs["merged1_half"][0]
    assert_close(logits, refs["merged1_half"][1])
    toks, logits = gen(core, [(0, 1.0), (1, -0.7)])  # llama-server: several adapters on one request
    assert toks == refs["merged12"][0]
    assert_close(logits, refs["merged12"][1])


def test_gguf_f16_adapter_close_to_f32(core, files, refs):
    reg = core.runner.lora
    aid = reg.load(files["gguf1_f16"], name="g1_f16")
    try:
        toks, logits = gen(core, [(aid, 1.0)])
        assert toks == refs["merged1"][0]
        assert_close(logits, refs["merged1"][1], rel=2e-3)  # B and A rounded to float16
    finally:
        reg.remove(aid)


@pytest.mark.parametrize("which", ["qv", "rs"])
def test_partial_targets_rslora_and_patterns(files, which):
    c = make_core(files["base"])
    aid = c.runner.lora.load(files[which])
    ad = c.runner.lora.by_id(aid).adapter
    if which == "qv":
        assert ad.target_modules == ("attn_q", "attn_v") and ad.rank == 4 and ad.alpha == 8.0
        assert ad.modules["blk.0.attn_q"].scale == 2.0
    else:
        assert ad.use_rslora and ad.rank == 8
        assert ad.modules["blk.1.ffn_down"].rank == 4 and ad.modules["blk.1.ffn_down"].scale == 4 / 2.0
        assert ad.modules["blk.0.attn_q"].rank == 2 and ad.modules["blk.0.attn_k"].scale == 32 / math.sqrt(8)
    want_toks, want = gen(make_core(files[f"merged_{which}"]))
    toks, logits = gen(c, [(aid, 1.0)])
    assert toks == want_toks
    assert_close(logits, want)


@pytest.mark.parametrize("fmt", ["qwen2_peft", "qwen2_gguf"])
def test_neox_base_permutes_b_rows(files, fmt):
    """qwen2's GGUF keeps NEOX q/k rows (kvserve permutes them at load): B's rows follow, from both
    formats."""
    c = make_core(files["qwen2"])
    aid = c.runner.lora.load(files[fmt])
    want_toks, want = gen(make_core(files["merged_qwen2"]))
    toks, logits = gen(c, [(aid, 1.0)])
    assert toks == want_toks
    assert_close(logits, want)


def test_adapter_record(core, files):
    e = core.runner.lora.get("g1")
    ad = e.adapter
    assert (e.id, e.name, e.path, e.scale) == (3, "g1", files["gguf1"], 1.0)
    assert ad.format == "gguf" and ad.base_arch == "llama" and ad.rank == 8 and ad.alpha == 16.0
    assert ad.target_modules == ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    assert len(ad.modules) == 14
    # 2 layers x r 8 x (in + out): q 64+64, k 64+32, v 64+32, o 64+64, gate/up 64+128 each, down 128+64
    assert ad.nbytes == 2 * 8 * (128 + 96 + 96 + 128 + 192 + 192 + 192) * 4
    p = core.runner.lora.get("p1").adapter
    assert p.format == "peft" and p.base_model_name == "tiny"
    for k, m in p.modules.items():
        assert torch.equal(m.a, ad.modules[k].a) and torch.equal(m.b, ad.modules[k].b)


# -- several adapters in one step -------------------------------------------------------------------

def test_step_mixing_three_adapters_and_the_base(core, refs):
    loras = [[(0, 1.0)], [(1, 1.0)], [(2, 1.0)], []]
    reqs = [req(lo) for lo in loras]
    toks, logits, batches, _ = run_capture(core, reqs)
    mixed = [b for b in batches if b is not None and len(b.groups) == 3]
    assert len(mixed) == 8  # the prefill step and 7 decode steps held all four requests
    assert [b.n_rows for b in mixed[1:]] == [4] * 7
    for b in mixed[1:]:  # a decode step: one row per adapter, the base's row untouched
        assert len({int(g.rows) for g in b.groups}) == 3
    for r, key in zip(reqs, ["merged1", "merged2", "merged3", "base"]):
        assert toks[r.request_id] == refs[key][0]
        assert_close(torch.stack(logits[r.request_id]), refs[key][1])


def test_base_only_steps_skip_the_lora_path(core):
    before = core.runner.lora_steps
    _, _, batches, steps = run_capture(core, [req(), req()])
    assert batches == [None] * steps
    assert core.runner.lora_steps == before


# -- the prefix cache --------------------------------------------------------------------------------

def test_prefix_cache_keyed_by_adapter_and_scale(files):
    c = make_core(files["base"])
    a = c.runner.lora.load(files["peft1"])
    b = c.runner.lora.load(files["peft2"])
    prompt = list(range(10, 50))

    def cached(lora):
        r = req(lora, n=2, prompt=prompt)
        run_capture(c, [r])
        return r.num_cached_tokens

    assert cached([(a, 1.0)]) == 0
    assert cached([(a, 1.0)]) == len(prompt) - 1  # the full prefix (one token is always evaluated)
    assert cached([(b, 1.0)]) == 0  # another adapter: nothing shared
    assert cached([(a, 0.5)]) == 0  # another scale: other KV
    assert cached([]) == 0  # the base never reuses adapter KV ...
    assert cached([]) == len(prompt) - 1
    assert cached([(b, 1.0)]) == len(prompt) - 1  # ... nor an adapter the base's


# -- --max-loras ---------------------------------------------------------------------------------------

def test_max_loras_holds_back_rows_of_other_adapters(core, refs):
    reg = core.runner.lora
    reg.max_loras = 1
    try:
        reqs = [req([(0, 1.0)]), req([(1, 1.0)]), req(), req([(0, 1.0)])]
        toks, logits, batches, _ = run_capture(core, reqs)
        assert all(b is None or len(b.groups) == 1 for b in batches)
        assert {b.groups[0].adapter_id for b in batches if b is not None} == {0, 1}
        for r, key in zip(reqs, ["merged1", "merged2", "base", "merged1"]):
            assert toks[r.request_id] == refs[key][0]
        with pytest.raises(InvalidInputError, match="more than --max-loras 1"):
            reg.resolve([(0, 1.0), (1, 1.0)])
    finally:
        reg.max_loras = None


# -- packed quantized base, native decode step -------------------------------------------------------

WIDE = dict(n_embd=128, n_head=4, n_head_kv=2, n_ff=256)  # head_dim 32: the native decode step's


@pytest.fixture(scope="module")
def q8_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_q8")
    return {"base": str(tinymodel.write_tiny_gguf(d / "q8.gguf", seed=SEED, qtype="Q8_0", **WIDE)),
            "peft": str(tinylora.write_peft_adapter(d / "peft", seed=1, **WIDE)),
            "merged": str(tinylora.write_merged_hf_dir(d / "merged", [(dict(seed=1), 1.0)], seed=SEED, qtype="Q8_0",
                                                       **WIDE))}


def test_packed_q8_base_with_native_decode(q8_files):
    """A Q8_0 base on kvserve's defaults (weights packed, the native decode step where the CPU has
    it): base-only steps stay native, adapter decode steps too (the delta in float32 inside the step),
    the prefill eagerly on the packed weights plus the float delta, and agree with the dequantized base
    merged by hand (to the int8 activations' rounding)."""
    c = make_core(q8_files["base"], dtype="auto")
    assert all(lin.weight is None and lin.kernel == "gguf" for lin in c.model.projections())  # no dense copy
    nat = c.runner.native
    native = nat is not None and nat.reason is None and nat.wait(120)
    aid = c.runner.lora.load(q8_files["peft"])
    ref_toks, ref = gen(make_core(q8_files["merged"]))
    eager = c.runner.eager_decode_steps
    base_toks, _ = gen(c)
    assert c.runner.lora_steps == 0
    if native:  # every decode step of the base ran natively
        assert c.runner.eager_decode_steps == eager
    toks, logits = gen(c, [(aid, 1.0)])
    assert toks == ref_toks and toks != base_toks
    # with the native step: the prefill eagerly, the prompt's last token (a step of its own:
    # Scheduler.split_last_token) and 7 decode steps natively with the delta inside (test_lora_native.py);
    # without it: the prefill and 7 decode steps, eagerly
    assert c.runner.lora_steps == (1 if native else 8)
    assert c.runner.native_lora_steps == (8 if native else 0)
    assert_close(logits, ref, rel=3e-2)


# -- registry ----------------------------------------------------------------------------------------

def test_registry_ids_names_scales(files):
    c = make_core(files["base"])
    reg: LoraRegistry = c.runner.lora
    assert reg.load(files["peft1"], name="x") == 0
    assert reg.load(files["gguf2"], scale=0.0) == 1
    assert [(e.id, e.name, e.scale) for e in reg.entries()] == [(0, "x", 1.0), (1, "a2", 0.0)]
    assert reg.default_lora() == ((0, 1.0),)
    reg.set_scales({1: 0.25})  # llama-server: adapters not listed get 0
    assert reg.default_lora() == ((1, 0.25),)
    assert reg.resolve(None) == ((1, 0.25),)
    assert reg.resolve([(1, 0.5), (0, 0.0)]) == ((1, 0.5),)
    with pytest.raises(InvalidInputError, match="already loaded"):
        reg.load(files["peft1"], name="x")
    assert reg.remove("x").id == 0
    assert reg.load(files["peft1"], name="x") == 2  # ids are never reused
    with pytest.raises(NotFoundError):
        reg.remove(0)
    assert reg.nbytes == 2 * (reg.by_id(1).adapter.nbytes + reg.by_id(2).adapter.nbytes)


@pytest.mark.parametrize("scale", [float("nan"), 1e308, float("inf"), -1e4, "1", True, None])
def test_bad_scales_refused(core, scale):
    reg = core.runner.lora
    with pytest.raises(InvalidInputError, match="LoRA scale must be"):
        reg.resolve([(0, scale)])
    with pytest.raises(InvalidInputError, match="LoRA scale must be"):
        reg.set_scales({0: scale})
    assert reg.by_id(0).scale == 1.0  # nothing changed


def test_unknown_and_repeated_ids_refused(core):
    reg = core.runner.lora
    with pytest.raises(InvalidInputError, match="invalid adapter id 99"):
        reg.resolve([(99, 1.0)])
    with pytest.raises(InvalidInputError, match="listed twice"):
        reg.resolve([(0, 1.0), (0, 0.5)])
    with pytest.raises(InvalidInputError, match="invalid adapter id 7"):
        reg.set_scales({0: 0.5, 7: 1.0})
    assert reg.by_id(0).scale == 1.0


# -- bad adapters --------------------------------------------------------------------------------------

def test_rank_above_max_lora_rank(files):
    c = make_core(files["base"])
    c.runner.lora.max_lora_rank = 16
    with pytest.raises(InvalidInputError, match="rank 32 is greater than --max-lora-rank 16"):
        c.runner.lora.load(files["big"])
    assert len(c.runner.lora) == 0


def test_adapter_for_another_base(core, files):
    with pytest.raises(InvalidInputError,
                       match=r"other_peft: module model\.layers\.0\.mlp\.down_proj: blk\.0\.ffn_down "
                             r"has shape \[32, 128\] \(B rows x A columns\), the base model's is "
                             r"\[64, 128\]: another base model\?"):
        core.runner.lora.load(files["other_peft"])
    with pytest.raises(InvalidInputError, match="architecture 'qwen2' does not match the base model's 'llama'"):
        core.runner.lora.load(files["qwen2_gguf"])


def test_missing_and_non_adapter_files(core, files, tmp_path):
    with pytest.raises(InvalidInputError, match="LoRA adapter not found: /nonexistent/a.gguf"):
        load_adapter("/nonexistent/a.gguf", core.model)
    with pytest.raises(InvalidInputError,
                       match=r"base.gguf: general.type is '', expected 'adapter' \(is it a model\?\)"):
        load_adapter(files["base"], core.model)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(InvalidInputError, match="not a GGUF file or a PEFT directory"):
        load_adapter(str(tmp_path / "junk.gguf"), core.model)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidInputError, match="no adapter_config.json"):
        load_adapter(str(tmp_path / "empty"), core.model)


def test_unsupported_peft_features(core, files, tmp_path):
    import json
    import shutil

    for key, value, msg in [("use_dora", True, "DoRA"), ("modules_to_save", ["lm_head"], "modules_to_save"),
                            ("peft_type", "IA3", "peft_type IA3 is not LORA")]:
        d = tmp_path / key
        shutil.copytree(files["peft1"], d)
        cfg = json.loads((d / "adapter_config.json").read_text())
        cfg[key] = value
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        with pytest.raises(InvalidInputError, match=msg):
            load_adapter(str(d), core.model)
    # a tensor of a module kvserve does not apply LoRA to (the output head)
    from safetensors.numpy import save_file

    d = tmp_path / "head"
    d.mkdir()
    shutil.copy(f"{files['peft1']}/adapter_config.json", d)
    save_file({"base_model.model.lm_head.lora_A.weight": np.zeros((8, 64), np.float32),
               "base_model.model.lm_head.lora_B.weight": np.zeros((301, 8), np.float32)},
              str(d / "adapter_model.safetensors"))
    with pytest.raises(InvalidInputError, match="LoRA on output is not supported"):
        load_adapter(str(d), core.model)


def test_non_finite_adapter_refused(core, files, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    d = tmp_path / "nan"
    shutil.copytree(files["peft1"], d)
    t = load_file(str(d / "adapter_model.safetensors"))
    t["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"][3, 2] = np.nan
    save_file(t, str(d / "adapter_model.safetensors"))
    with pytest.raises(InvalidInputError, match=r"module model\.layers\.1\.mlp\.up_proj: non-finite"):
        load_adapter(str(d), core.model)


def test_removing_an_adapter_mid_request_keeps_it_until_the_request_ends(files, refs):
    """An adapter removed while a request uses it (``/v1/unload_lora_adapter``): the request keeps its
    delta to the end (vLLM keeps serving), the name is gone at once, the weights leave the model with
    the last request, a request checked before the removal is refused clearly, ids are never reused."""
    c = make_core(files["base"])
    reg = c.runner.lora
    a = reg.load(files["peft1"])
    b = reg.load(files["peft2"])
    ra, rb = req([(a, 1.0)], n=6), req([(b, 1.0)], n=6)
    c.add_request(ra)
    c.add_request(rb)
    assert (reg.users(a), reg.users(b)) == (1, 1)
    toks: dict[str, list[int]] = {ra.request_id: [], rb.request_id: []}
    done: set[str] = set()
    for step in range(50):
        if step == 2:
            reg.remove(a)
            assert [e.id for e in reg.entries()] == [b] and sorted(reg.known_ids()) == [a, b]
        for o in c.step():
            toks[o.request_id] += o.new_token_ids
            if o.finished:
                done.add(o.request_id)
        if len(done) == 2:
            break
    assert done == {ra.request_id, rb.request_id}
    assert toks[ra.request_id] == refs["merged1"][0][:6] and ra.stop_type == "limit"
    assert toks[rb.request_id] == refs["merged2"][0][:6]
    assert (reg.users(a), reg.users(b), sorted(reg.known_ids())) == (0, 0, [b])  # a's weights are gone
    late = req([(a, 1.0)], n=2)
    with pytest.raises(InvalidInputError, match=r"^LoRA adapter 0 was unloaded before the request started$"):
        c.add_request(late)
    assert late.request_id not in c.scheduler.requests and reg.users(a) == 0
    reg.remove(b)  # idle: out of the model at once
    assert list(reg.known_ids()) == [] and reg.load(files["peft1"]) == 2


# -- slot files keep the adapter (and cache_salt) of their KV ------------------------------------------

PRE = list(range(20, 48))  # 28 tokens
Q = PRE + [60, 61, 62, 63, 64, 65, 66, 67, 68, 69]


def _slot_run(c, lora=(), salt=None, slot=0, prompt=Q, n=3):
    """(cache_n, tokens) of a greedy request in ``slot``."""
    r = req(lora, n=n, prompt=prompt, priority_slot=slot, cache_salt=salt)
    toks, _, _, _ = run_capture(c, [r])
    return r.num_cached_tokens, toks[r.request_id]


def test_slot_file_keeps_the_adapter_and_salt_of_its_kv(files, tmp_path):
    """A slot saved from an adapter's (or a salted) request is restored under that adapter (found by its
    weights, whatever its id in the new engine) and salt: the base, another adapter or another salt
    reuse none of it; a server without the adapter refuses the file with a clear message."""
    c1 = make_core(files["base"], n_parallel=2, cache_ram=0)
    a = c1.runner.lora.load(files["peft1"])
    _slot_run(c1, [(a, 1.0)], prompt=PRE, n=0)
    c1.save_slot(0, str(tmp_path / "lora.bin"))
    _slot_run(c1, salt="tenant", slot=1, prompt=PRE, n=0)
    c1.save_slot(1, str(tmp_path / "salt.bin"))

    ref = make_core(files["base"], n_parallel=2, cache_ram=0)
    ref.runner.lora.load(files["peft1"])
    want = _slot_run(ref, [(0, 1.0)])
    assert want[0] == 0 and len(want[1]) == 3

    c2 = make_core(files["base"], n_parallel=2, cache_ram=0)
    assert c2.runner.lora.load(files["peft2"]) == 0
    assert c2.runner.lora.load(files["peft1"]) == 1  # the file's adapter has another id here
    for lora, cached in (([], 0), ([(0, 1.0)], 0), ([(1, 0.5)], 0), ([(1, 1.0)], 28)):
        assert c2.restore_slot(0, str(tmp_path / "lora.bin"))["n_restored"] == 28
        got = _slot_run(c2, lora)
        assert got[0] == cached, lora
    assert got == (28, want[1])  # the restored rows are the adapter's own: the same tokens
    for salt, cached in ((None, 0), ("other", 0), ("tenant", 28)):
        assert c2.restore_slot(1, str(tmp_path / "salt.bin"))["n_restored"] == 28
        assert _slot_run(c2, salt=salt, slot=1)[0] == cached, salt

    c3 = make_core(files["base"], n_parallel=2, cache_ram=0)
    c3.runner.lora.load(files["peft2"])
    with pytest.raises(SlotFileError, match=r"^slot file's KV was computed under LoRA adapter 'peft1', which is "
                                            r"not loaded here: load the same adapter to restore it$"):
        c3.restore_slot(0, str(tmp_path / "lora.bin"))
    assert c3.slot_tokens(0) == []


def test_no_cache_salt_names_an_adapters_kv(files):
    """A cache_salt spelled like an adapter's part of the prefix-cache key reuses none of its KV."""
    c = make_core(files["base"])
    a = c.runner.lora.load(files["peft1"])
    _slot_run(c, [(a, 1.0)], slot=-1, prompt=PRE, n=1)
    assert _slot_run(c, [(a, 1.0)], slot=-1, prompt=PRE, n=1)[0] == 27  # the adapter's own prefix
    for salt in (f"\x00lora:{a}@1.0", f"\x00lora:{a}@1.0\x00"):
        assert _slot_run(c, salt=salt, slot=-1, prompt=PRE, n=1)[0] == 0, repr(salt)


def test_slot_restore_does_not_rehash_every_adapter_each_time(files, tmp_path, monkeypatch):
    from kvserve.engine import core as core_mod

    c = make_core(files["base"], n_parallel=2, cache_ram=0)
    a = c.runner.lora.load(files["peft1"])
    c.runner.lora.load(files["peft2"])
    _slot_run(c, [(a, 1.0)], prompt=PRE, n=0)
    c.save_slot(0, str(tmp_path / "lora.bin"))
    calls = []
    real = core_mod.adapter_fingerprint
    monkeypatch.setattr(core_mod, "adapter_fingerprint", lambda ad: calls.append(ad.name) or real(ad))
    for _ in range(3):
        assert c.restore_slot(0, str(tmp_path / "lora.bin"))["n_restored"] == 28
    assert len(calls) <= 2, calls  # each loaded adapter hashed at most once
