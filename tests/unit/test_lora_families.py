"""LoRA adapters on every family built on the llama block's Linear (llama, qwen3, qwen3moe's attention,
gemma2, gemma3, mistral3, phi3's fused qkv / gate_up), made by the real ``peft`` package.

For each family: a tiny transformers model (tests/family_oracle.py's cases) saved as a GGUF base, a
PEFT LoRA (``init_lora_weights=False``: A and B random, so the adapter changes the model) saved with
``save_pretrained`` and also written as llama.cpp's converter writes a LoRA GGUF; the reference is
PEFT's own ``merge_and_unload()`` saved as a GGUF. kvserve's base + adapter must give the merged
model's logits (max abs difference <= 1e-4 of the logit scale) and its greedy tokens.
"""

import numpy as np
import pytest
import torch

import family_models as fmod
import family_oracle
import tinymodel
from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.request import Request, SamplingParams
from kvserve.errors import InvalidInputError
from kvserve.models.build import load_files

peft = pytest.importorskip("peft")

#: case -> PEFT target_modules
CASES = {
    "llama3-rope": "all-linear",
    "qwen3": "all-linear",
    "qwen3moe": ["q_proj", "k_proj", "v_proj", "o_proj"],  # the experts are not Linears
    "gemma2": "all-linear",
    "gemma3": "all-linear",
    "mistral3": "all-linear",
    "phi3-longrope": "all-linear",  # qkv_proj and gate_up_proj: fused in the file, split by kvserve
}
PROMPT = [12, 7, 99, 150, 3, 42, 201, 77, 18, 260, 33, 5]


def write_lora_gguf(state: dict, path, arch: str, alpha: float, n_head: int, n_head_kv: int):
    """A PEFT state dict as llama.cpp's convert_lora_to_gguf.py writes it (llama / mistral: B's q/k rows
    permuted like the base's weights; fused names kept)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    for key, t in state.items():
        module, _, ab = key.rpartition(".lora_")
        hf = module.replace("base_model.model.", "", 1) + ".weight"
        g = fmod.gguf_name(hf, arch)
        data = t.detach().float().numpy().copy()
        if ab.startswith("B") and arch in ("llama", "mistral3") and g.endswith(("attn_q.weight", "attn_k.weight")):
            data = tinymodel.permute_qk(data, n_head if "attn_q" in g else n_head_kv)
        w.add_tensor(f"{g}.lora_{ab[0].lower()}", np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _core(path) -> EngineCore:
    return EngineCore(load_files(str(path)), EngineConfig(n_ctx=256, dtype="float32", kv_dtype="f32"))


def _gen(core, lora=(), n=6):
    r = Request(f"r{len(lora)}-{id(core)}-{n}", PROMPT, SamplingParams(n_predict=n, temperature=0.0), lora=tuple(lora))
    rows, run = [], core.runner.run

    def spy(batch):
        out = run(batch)
        rows.extend(out[k].float().clone() for k, _ in enumerate(batch.sample_ci))
        return out

    core.runner.run = spy
    toks = []
    try:
        core.add_request(r)
        done = False
        while not done:
            for o in core.step():
                toks.extend(o.new_token_ids)
                done = done or o.finished
    finally:
        core.runner.run = run
    return toks, torch.stack(rows)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    name = request.param
    d = tmp_path_factory.mktemp(f"lora-{name}")
    _, arch, _ = family_oracle.CASES[name]
    model = family_oracle.build_model(name)
    base = fmod.save_gguf(model, d / "base.gguf", arch)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=CASES[name], init_lora_weights=False, lora_dropout=0.0)
    torch.manual_seed(5)
    pm = peft.get_peft_model(model, cfg)
    with torch.no_grad():  # PEFT's random B is small next to these weights: make the change visible
        for n_, p in pm.named_parameters():
            if "lora_B" in n_:
                p.mul_(4.0)
    pm.save_pretrained(str(d / "peft"))
    from safetensors.torch import load_file

    state = load_file(str(d / "peft" / "adapter_model.safetensors"))
    c = model.config
    gg = write_lora_gguf(state, d / "lora.gguf", arch, 8.0, c.num_attention_heads, c.num_key_value_heads)
    merged = fmod.save_gguf(pm.merge_and_unload(), d / "merged.gguf", arch)
    return {"name": name, "base": base, "peft": d / "peft", "gguf": gg, "merged": merged}


@pytest.mark.parametrize("fmt", ["peft", "gguf"])
def test_family_adapter_equals_peft_merge(case, fmt):
    core = _core(case["base"])
    aid = core.runner.lora.load(str(case[fmt]))
    want_toks, want = _gen(_core(case["merged"]))
    base_toks, _ = _gen(core)
    toks, got = _gen(core, [(aid, 1.0)])
    assert toks == want_toks and len(toks) == 6
    assert toks != base_toks
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 1e-4 * scale


def test_moe_experts_refused(tmp_path):
    """LoRA on a qwen3moe router (PEFT's all-linear takes it): refused, naming the module."""
    model = family_oracle.build_model("qwen3moe")
    base = fmod.save_gguf(model, tmp_path / "base.gguf", "qwen3moe")
    pm = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=2, target_modules=["gate"],
                                                    init_lora_weights=False))
    pm.save_pretrained(str(tmp_path / "peft"))
    core = _core(base)
    with pytest.raises(InvalidInputError, match=r"module model\.layers\.0\.mlp\.gate: LoRA on blk\.0\.ffn_gate_inp "
                                                r"is not supported"):
        core.runner.lora.load(str(tmp_path / "peft"))
