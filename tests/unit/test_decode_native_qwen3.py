"""The native decode step (kvserve.models.decode_native) on qwen3 and qwen3moe: the per-head q/k RMSNorm
and the mixture of experts (router softmax, top-k, renormalised weights, the chosen experts' gate|up and
down on the file's blocks: Decoder.set_qk_norm / set_moe, ggml_cpu.cpp's Matrix.mm_jobs) against the
eager path (kvserve.models.moe.MoE / OneRowExperts) on tiny random models written as quantized GGUFs
(tests/family_models.py's transformers models, their matrices as Q4_K / Q6_K / Q8_0 blocks made by
tests/tinymodel.py), with the tolerances of tests/unit/test_decode_native.py; batch invariance; and an
engine's greedy tokens with the step on and off."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is a test-only dependency ([test] extra)")

import family_models as fmod  # noqa: E402
import family_oracle  # noqa: E402
from kvserve.config import EngineConfig  # noqa: E402
from kvserve.engine.core import EngineCore  # noqa: E402
from kvserve.engine.request import Request, SamplingParams  # noqa: E402
from kvserve.llm import LLM  # noqa: E402
from kvserve.models import decode_native  # noqa: E402
from kvserve.models.build import build_model, load_files  # noqa: E402
from kvserve.models.llama import AttentionBatch  # noqa: E402
from test_decode_native import PROMPTS, _clone, _decode_batch, _prefill_caches  # noqa: E402

NEEDS = decode_native.unavailable_reason()

#: case -> (transformers model_type, GGUF architecture, config): head_dim 32 and K-quant widths (rows
#: of 256 values), so every matrix is a block type the step multiplies; qwen3moe with 8 experts, 3 per
#: token (a row's experts share one quantized activation row; a batch's rows are grouped per expert)
CASES = {
    "qwen3": ("qwen3", "qwen3", dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                                     num_key_value_heads=2, head_dim=32, rope_theta=1e6, tie_word_embeddings=False)),
    "qwen3moe": ("qwen3_moe", "qwen3moe", dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                                              num_key_value_heads=2, head_dim=32, num_experts=8,
                                              num_experts_per_tok=3, moe_intermediate_size=256, norm_topk_prob=True,
                                              decoder_sparse_step=1, mlp_only_layers=[],
                                              tie_word_embeddings=False)),
}


def qtype_of(name: str) -> str:
    """The block type of a tensor in the quantized copies: norms and the router stay F32; the head
    and layer 1's down products Q6_K (as Q4_K_M gives some down tensors), the attention output Q8_0,
    every other matrix Q4_K."""
    if name.endswith("norm.weight") or "ffn_gate_inp" in name:
        return "F32"
    if name == "output.weight" or (name.startswith("blk.1.") and "ffn_down" in name):
        return "Q6_K"
    if "attn_output" in name:
        return "Q8_0"
    return "Q4_K"


def write_case(case: str, tmp) -> str:
    """The case's model as a quantized GGUF (see :func:`qtype_of`) under ``tmp``; its path."""
    import gguf

    model_type, arch, cfg = CASES[case]
    model = fmod.build(model_type, seed=7, **cfg)
    f32 = fmod.save_gguf(model, tmp / f"{case}.f32.gguf", arch)
    names = [t.name for t in gguf.GGUFReader(str(f32)).tensors]
    run = {"arch": arch, "metadata": family_oracle.metadata(f32), "tensors": {n: qtype_of(n) for n in names}}
    return str(family_oracle.rebuild_quantized(run, f32, tmp / f"{case}.q.gguf", check=False))


@pytest.fixture(scope="module", params=list(CASES))
def case_path(request, tmp_path_factory):
    return request.param, write_case(request.param, tmp_path_factory.mktemp("q3nat"))


@pytest.fixture(scope="module")
def built(native_decode_build):
    if NEEDS:
        pytest.skip(NEEDS)
    assert native_decode_build is not None and decode_native.load_cached() is not None
    return decode_native


def _model(path):
    model = build_model(load_files(path), EngineConfig(n_ctx=1024), 1024)
    assert model.native_decode, "the step applies to this model"
    return model


def test_the_step_applies_to_quantized_qwen3_and_qwen3moe(built, case_path):
    """The families' native_decode holds and the model's projections (and experts) are GGUF blocks."""
    name, path = case_path
    model = _model(path)
    assert decode_native.model_reason(model) is None
    moe = [layer.moe for layer in model.layers if layer.moe is not None]
    assert len(moe) == (2 if name == "qwen3moe" else 0)
    assert all(lin.blocks is not None for m in moe for lin in (*m.gate_up, *m.down))


def test_native_step_agrees_with_eager(built, case_path):
    """8 decode steps of 4 sequences, both paths fed the eager path's greedy tokens: logits within 2% of
    their range (test_decode_native's bound; the same block products run on both paths, so only the
    norms, attention, the router's float sums and the SiLU differ: measured below 1e-4 of the range),
    and the same greedy token wherever the eager top two are further apart than the paths' difference."""
    name, path = case_path
    model = _model(path)
    caches, nxt = _prefill_caches(model, PROMPTS)
    eager_caches = _clone(caches)
    nat = decode_native.NativeDecode(model, caches, 16)
    nat.start()
    assert nat.wait(120) and nat.reason is None and nat.native_head
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
            if top[r, 0] - top[r, 1] > 2 * diff[r]:
                checked += 1
                agreed += int(ln[r].argmax() == le[r].argmax())
        toks = le.argmax(-1).tolist()
        pos = [q + 1 for q in pos]
    print(name, "worst", worst, "checked", checked, "same", same)
    assert worst < 1e-3
    assert checked >= 28 and agreed == checked and same == 32
    assert nat.calls == 8


def test_native_step_batch_invariant(built, case_path):
    """A row's logits (and the K/V it leaves) alone and in a step of 5 rows of other sequences are
    identical: the experts' rows grouped per expert in the batch give each row the one-row bits (qwen3moe:
    5 rows of 3 experts among 8, so some expert's product has 2 rows or more)."""
    name, path = case_path
    model = _model(path)
    prompts = PROMPTS + [[9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13]]
    caches, nxt = _prefill_caches(model, prompts)
    nat = decode_native.NativeDecode(model, caches, 16)
    nat.start()
    assert nat.wait(120)
    together = _clone(caches)
    alone = nat(*_decode_batch([(2, nxt[2], len(prompts[2]))])[:5], caches)
    batch = nat(*_decode_batch([(s, nxt[s], len(prompts[s])) for s in range(5)])[:5], together)
    assert torch.equal(alone[0], batch[2])
    row = 128 * 3 + len(prompts[2])
    assert all(torch.equal(a[0][row], b[0][row]) and torch.equal(a[1][row], b[1][row]) for a, b in zip(caches, together))


def test_engine_greedy_tokens_equal_with_the_step_on_and_off(built, case_path, monkeypatch):
    """An engine decodes 24 greedy tokens of 3 prompts together through the native step (the prompt's
    last token included) and the same tokens with KVSERVE_NATIVE_DECODE=0 (the eager path)."""
    name, path = case_path
    p = SamplingParams(temperature=0, n_predict=24, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[2], [40, 41, 42]]
    core = EngineCore(load_files(path), EngineConfig(n_ctx=1024, n_parallel=4))
    nat = core.runner.native
    assert nat is not None and nat.wait(120)
    got = [c.token_ids for c in LLM(core).generate(prompts, p)]
    assert nat.calls >= 23
    monkeypatch.setenv("KVSERVE_NATIVE_DECODE", "0")
    core0 = EngineCore(load_files(path), EngineConfig(n_ctx=1024, n_parallel=4))
    assert core0.runner.native is None
    ref = [c.token_ids for c in LLM(core0).generate(prompts, p)]
    assert got == ref
    assert len({t for g in got for t in g}) > 10  # varied tokens, not a constant chain


def test_float_experts_stay_eager(tmp_path):
    """Experts that are not GGUF blocks (an F32 file's): the step does not apply (experts_reason)."""
    model_type, arch, cfg = CASES["qwen3moe"]
    path = fmod.save_gguf(fmod.build(model_type, seed=7, **cfg), tmp_path / "f.gguf", arch)
    model = build_model(load_files(str(path)), EngineConfig(n_ctx=512), 512)
    assert model.native_decode is False
    assert decode_native.experts_reason(model) == "experts that are not GGUF blocks"
