"""Each model family against llama.cpp on the same GGUF: the file llama.cpp's own converter wrote from a
tiny random transformers model, run by llama-server (fixtures: tests/reference/llama_families/CASE.json;
``regen.py`` there makes them; CI needs no llama.cpp: tests/family_oracle.py rebuilds the exact file from
the fixture's metadata and tests/family_models.py's tensors, checked against the fixture's digests).

Both sides in float32 (F32 weights; llama-server ``-ctk f32 -ctv f32 -fa off``, kvserve ``kv_dtype``
f32, ``dtype`` float32; gpt-oss: see :data:`OPTIONS`). For the causal families, over 4 fixed sequences
(272 teacher-forced positions: the prediction after each prefix of 4..71 tokens): kvserve's top-1 equals
llama.cpp's at every position and its log-probabilities of llama.cpp's top 5 are within :data:`MAX_DIFF`
(measured: 2.1e-5 at most, phi3; 1e-6 to 1e-5 elsewhere: float32 summation order; gemma: see
:data:`GELU_FP16`); the engine's 32 greedy tokens of all 6 prompts, decoded together, equal llama.cpp's.
nomic-bert: ``/tokenize``'s ids and ``/embedding``'s normalized mean-pooled vectors (within 1e-5;
measured 3.4e-7).

The causal cases are also checked as ``llama-quantize --pure`` Q8_0 copies, rebuilt here by the
``gguf`` package (the same bytes), on kvserve's block kernels: :data:`Q8_BOUNDS` (gpt-oss: llama-quantize
refuses to requantize its MXFP4 experts, so its copy is of the same model converted with F32 experts,
family_oracle.F32_EXPERTS); and the causal cases but gpt-oss as Q4_K_M copies of the same families at K-quant widths
(family_oracle.WIDE: llama-quantize's types per tensor, Q4_K / Q6_K / Q5_0, blocks by tests/tinymodel.py
since the ``gguf`` package cannot write K-quants; llama-server ran on those very bytes):
:data:`Q4_K_M_BOUNDS`.

By design: llama.cpp disables phi3's sliding window ("Phi SWA is currently disabled"; the fixture keeps
its warning) and kvserve honours it, so the phi3-window case agrees only while a sequence fits in the
window, and agrees everywhere once the file's window is set to 0.
"""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers is a test-only dependency ([test] extra)")

import family_oracle  # noqa: E402
from kvserve.config import EngineConfig  # noqa: E402
from kvserve.engine.core import EngineCore  # noqa: E402
from kvserve.engine.request import Request, SamplingParams  # noqa: E402
from kvserve.models.build import load_files  # noqa: E402

REFERENCE = Path(__file__).resolve().parents[1] / "reference" / "llama_families"
CAUSAL = [c for c in family_oracle.CASES if c not in family_oracle.EMBED]
#: max |d logprob| over llama.cpp's top 5 (see the module docstring for the measured figure)
MAX_DIFF = 2e-4
WINDOW = 8  # phi3-window's sliding window (tests/family_oracle.py)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """case -> the rebuilt GGUF llama-server ran on (every tensor checked against the fixture)."""
    tmp = tmp_path_factory.mktemp("llama-families")
    return {c: str(family_oracle.rebuild(family_oracle.load_fixture(REFERENCE, c), tmp / f"{c}.gguf"))
            for c in family_oracle.CASES}


#: the kvserve options per case: float32 throughout (F32 weights multiply in float32, as llama.cpp's do);
#: gpt-oss on kvserve's defaults, so its MXFP4 experts multiply on their blocks with activations
#: quantized to q8_0 as llama.cpp does (``dtype`` float32 multiplies the dequantized experts in float32,
#: as transformers does: mean |d logprob| 0.077 against llama.cpp, 260 of 272 top-1). Not the defaults
#: elsewhere: ``cpu_kernel`` auto turns an F32 output head into int8 ("w8a8") for decode steps on
#: VNNI/AMX CPUs, where llama.cpp multiplies it in float32 (qwen3: 5 of 6 greedy chains equal)
OPTIONS = {"gpt-oss": dict(large_batch_dtype="float32")}


def _core(path: str, case: str = "", **kw) -> EngineCore:
    """An engine on ``path`` with the case's :data:`OPTIONS` and an f32 KV cache (llama-server's
    ``-ctk f32 -ctv f32``)."""
    kw.setdefault("n_ctx", 512)
    return EngineCore(load_files(path), EngineConfig(kv_dtype="f32", **{**OPTIONS.get(case, {"dtype": "float32"}),
                                                                        **kw}))


def prefill_logprobs(core: EngineCore, ids: list[int]) -> torch.Tensor:
    """[len(ids), n_vocab] log-probabilities of one forward over the whole sequence."""
    from kvserve.models.llama import AttentionBatch, PrefillGroup

    c = core.model_config
    T = len(ids)
    kv = [(torch.zeros(T, c.n_head_kv, c.head_dim), torch.zeros(T, c.n_head_kv, c.head_dim)) for _ in range(c.n_layer)]
    b = AttentionBatch(positions=torch.arange(T), slot_mapping=torch.arange(T), prefills=[PrefillGroup(0, T, 0, None)])
    with torch.no_grad():
        return torch.log_softmax(core.model(torch.tensor(ids), b, kv, None).float(), -1)


def compare(core: EngineCore, fixture: dict) -> list[tuple[int, bool, float]]:
    """(prefix length, top-1 equal, max |d logprob| of llama.cpp's top 5) per teacher-forced position."""
    out = []
    for s in fixture["teacher_forced"]:
        lp = prefill_logprobs(core, s["tokens"])
        for n, ids, lps in zip(range(s["start"], len(s["tokens"])), s["top_ids"], s["top_logprobs"]):
            row = lp[n - 1]
            out.append((n, int(row.argmax()) == ids[0], max(abs(row[i].item() - x) for i, x in zip(ids, lps))))
    return out


def greedy(core: EngineCore, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens of every prompt, all decoded together by the engine (``ignore_eos``)."""
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        core.add_request(Request(f"g{i}", p, SamplingParams(temperature=0, n_predict=n, ignore_eos=True)))
        out[f"g{i}"] = []
    while any(len(v) < n for v in out.values()):
        for o in core.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[f"g{i}"] for i in range(len(prompts))]


def test_fixtures_are_llama_cpps_converter_and_server():
    for c in family_oracle.CASES:
        fx = family_oracle.load_fixture(REFERENCE, c)
        assert fx["case"] == c and fx["arch"] == family_oracle.CASES[c][1]
        assert fx["llama_server"].startswith("version: ") and "-ctk" in fx["flags"]
        keys = {k for k, *_ in fx["metadata"]}
        assert {"general.file_type", "tokenizer.ggml.model"} <= keys
        assert {v.split()[0] for v in fx["tensors"].values()} <= {"F32", "MXFP4"}
        if c in family_oracle.EMBED:
            assert len(fx["embeddings"]) == 5
        else:
            assert len(fx["teacher_forced"]) == 4 and len(fx["greedy"]) == 6
    assert family_oracle.load_fixture(REFERENCE, "phi3-window")["server_warnings"][0].startswith(
        "load_arch_hparams: Phi SWA is currently disabled")
    assert {v.split()[0] for v in family_oracle.load_fixture(REFERENCE, "gpt-oss")["tensors"].values()} == \
        {"F32", "MXFP4"}


def _check(case: str, got, max_diff: float = MAX_DIFF, min_same: int = 4 * 68) -> None:
    diffs = [d for _, _, d in got]
    print(case, "top-1", sum(s for _, s, _ in got), "of", len(got), "max |d logprob|", f"{max(diffs):.2e}", "mean",
          f"{statistics.mean(diffs):.2e}")
    assert len(got) == 4 * 68
    assert sum(s for _, s, _ in got) >= min_same, [n for n, same, _ in got if not same]
    assert max(diffs) <= max_diff


#: gemma's GELU: llama.cpp's CPU GELU rounds its input to float16 and reads the result from a float16
#: table (ggml-cpu vec.h, GGML_GELU_FP16); kvserve computes it in float32 as transformers does. Measured
#: max |d logprob| 6.9e-4 / 7.8e-4 (gemma2 / gemma3; mean 2.1e-4 / 2.6e-4), top-1 one near tie apart
#: (gemma3, 271 of 272: llama.cpp's top-2 gap there is 1.4e-5); with llama.cpp's GELU in kvserve
#: (test_gemma_with_llama_cpps_gelu_agrees_tightly)
#: every top-1 equal, max 1.6e-4 / 3.3e-4, mean 1.6e-5 / 4.9e-5
GELU_FP16 = ("gemma2", "gemma3")


@pytest.mark.parametrize("case", [c for c in CAUSAL if c != "phi3-window"])
def test_teacher_forced_agrees_with_llama_cpp(files, case, monkeypatch):
    core = _core(files[case], case)
    ties = _record_moe_ties(core, monkeypatch) if case in MOE_TIES else None
    got = compare(core, family_oracle.load_fixture(REFERENCE, case))
    if case in GELU_FP16:  # the two near ties (llama.cpp's top-2 gaps 1.4e-5 gemma3, 9.8e-5 gemma2) may flip
        _check(case, got, max_diff=2e-3, min_same=4 * 68 - 2)
    elif ties is not None:
        _check_moe(case, core, got, ties)
    else:
        _check(case, got)


#: MoE near ties. A MoE layer makes two discrete choices per row that a float32 rounding difference
#: can flip: the router's top k (a near tie between the k-th and (k+1)-th), and, where the experts
#: multiply on GGUF blocks (gpt-oss's MXFP4 experts), the q8_0 rounding of each input element
#: (llama.cpp's quantize_row_q8_0: round(x / d), d = amax / 127 per 32 values). A flip moves that row's
#: expert output by a whole expert or a whole int8 step, far past MAX_DIFF, and which side llama.cpp
#: falls on is its own summation order's chance. Measured (fam2, gpt-oss): SDPA's sinks attention
#: differs from the former explicit softmax by <= 3e-6 per call, which moved one expert input element
#: (sequence 0, layer 1, row 59) across a q8_0 rounding boundary it lay 2.9e-6 quanta from; layer 2's
#: 4-token window carried it to rows 59-62: |d logprob| 1.4e-2, 1.1e-2, 3.0e-4, 9.3e-3 (every other
#: position 1.3e-5 at most, as on main; no router choice changed: gpt-oss's smallest top-4 logit
#: margin is 5.3e-4). So, per case: (router margin bound, q8_0 boundary bound in quanta or None,
#: positions allowed past MAX_DIFF). The q8_0 bound 3e-4 quanta is above the largest move the two
#: attention orders made on any expert input element (2.2e-4 quanta; median 8e-6): a row with an
#: element nearer a boundary may round either way. The router bound 1e-4 is 10x the float32 order
#: differences of an O(1) router output. Positions within reach of such a row (the row itself, then
#: as far as the later layers' windows carry it; a later full-attention layer: the rest of the
#: sequence) may differ by up to MOE_TIE_DIFF (one flip, measured 1.4e-2); every other position keeps
#: MAX_DIFF, every top-1 must still be equal, and at most the stated count of positions may pass
#: MAX_DIFF (gpt-oss: the 4 of one flip under a window of 4; qwen3moe: none measured, its one near
#: tie, router probability margin 2.5e-6 at sequence 1, layer 1, row 21, falls the same way).
MOE_TIES = {"gpt-oss": (1e-4, 3e-4, 4), "qwen3moe": (1e-4, None, 1)}
#: the most a position within reach of a near tie may differ (one flipped choice)
MOE_TIE_DIFF = 0.05
#: the most near-tie rows (sequence, layer, row) the 4 sequences may hold: the q8_0 bound's share of
#: uniformly placed values is 2 * 3e-4 per element, 64 elements x 3 layers x 288 rows: 33 expected,
#: 39 measured (gpt-oss; their reach covers 207 of the 288 rows, a layer-0 tie reaching the end of
#: its sequence through layer 1's full attention, so the count past MAX_DIFF is what holds the line);
#: qwen3moe 1 (router)
MOE_TIE_ROWS = {"gpt-oss": 50, "qwen3moe": 4}


def _q8_0_boundary_distance(x: torch.Tensor) -> torch.Tensor:
    """x [T, n] float32 (n a multiple of 32) -> [T]: per row, the least distance in quanta of any
    ``x / d`` from a rounding boundary (n + 0.5) under llama.cpp's q8_0 (d = amax / 127 per 32 values)."""
    xb = x.reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    v = xb * torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (v - v.floor() - 0.5).abs().amin(dim=(1, 2))


def _record_moe_ties(core: EngineCore, monkeypatch) -> list[tuple[int, torch.Tensor, torch.Tensor | None]]:
    """Wrap the model's MoE layers' forward: each call appends (layer, router margin [T], q8_0 boundary
    distance [T] or None) of kvserve's own numbers (the k-th minus the (k+1)-th of what the layer ranks:
    gpt-oss's router logits, qwen3moe's router probabilities)."""
    from kvserve.models import gpt_oss, moe

    out = []
    layer_of = {id(m): int(name.split(".")[1]) for name, m in core.model.named_modules()
                if isinstance(m, (moe.MoE, gpt_oss.GptOssMoE)) and name.startswith("layers.")}
    assert layer_of, "no MoE layer found"

    def wrap(cls, ranked, q8):
        forward = cls.forward

        def recording(self, x):
            r = ranked(self, x).sort(dim=-1, descending=True).values
            out.append((layer_of[id(self)], r[:, self.top_k - 1] - r[:, self.top_k],
                        _q8_0_boundary_distance(x.float()) if q8 else None))
            return forward(self, x)
        monkeypatch.setattr(cls, "forward", recording)

    wrap(gpt_oss.GptOssMoE, lambda m, x: torch.addmm(m.router_bias, x, m.router.t()), q8=True)
    wrap(moe.MoE, lambda m, x: torch.softmax(torch.nn.functional.linear(x, m.router).float(), -1), q8=False)
    return out


def _check_moe(case: str, core: EngineCore, got, ties) -> None:
    """:func:`_check` with :data:`MOE_TIES`'s allowance (see there)."""
    router_bound, q8_bound, n_past = MOE_TIES[case]
    c = core.model_config
    windows = list(getattr(c, "layer_windows", None) or [0] * c.n_layer)
    fx = family_oracle.load_fixture(REFERENCE, case)
    n_moe = len({layer for layer, _, _ in ties})
    assert len(ties) == n_moe * len(fx["teacher_forced"])
    tie_rows, near = [], set()  # near: (sequence, row) within reach of a near tie
    for i, (layer, margin, dist) in enumerate(ties):
        seq = i // n_moe
        tied = margin < router_bound
        if dist is not None:
            tied = tied | (dist < q8_bound)
        later = windows[layer + 1:]
        reach = None if any(w == 0 for w in later) else 1 + sum(w - 1 for w in later)
        for p in tied.nonzero().flatten().tolist():
            tie_rows.append((seq, layer, p, f"{margin[p].item():.1e}", None if dist is None else f"{dist[p].item():.1e}"))
            near.update((seq, r) for r in range(p, margin.shape[0] if reach is None else p + reach))
    rows = [(seq, n - 1) for seq, s in enumerate(fx["teacher_forced"]) for n in range(s["start"], len(s["tokens"]))]
    assert len(rows) == len(got)
    diffs = [d for _, _, d in got]
    past = [(r, f"{d:.1e}") for r, (_, _, d) in zip(rows, got) if d > MAX_DIFF]
    print(case, "top-1", sum(s for _, s, _ in got), "of", len(got), "max |d logprob|", f"{max(diffs):.2e}", "mean",
          f"{statistics.mean(diffs):.2e}", "near-tie rows (seq, layer, row, router margin, q8_0 quanta):",
          len(tie_rows), tie_rows, "positions within reach", len(near), "past MAX_DIFF", past)
    assert len(got) == 4 * 68
    assert all(same for _, same, _ in got), [r for r, (_, same, _) in zip(rows, got) if not same]
    assert len(tie_rows) <= MOE_TIE_ROWS[case]
    assert len(past) <= n_past
    for r, (_, _, d) in zip(rows, got):
        assert d <= (MOE_TIE_DIFF if r in near else MAX_DIFF), (r, d)


def _llama_cpp_gelu(x, approximate="none"):
    """ggml's CPU GELU: tanh GELU of the float16-rounded input, rounded to float16 (its table);
    0 below -10, x above 10."""
    y = torch.nn.functional.gelu(x.half().float(), approximate="tanh").half().float()
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))


@pytest.mark.parametrize("case", GELU_FP16)
def test_gemma_with_llama_cpps_gelu_agrees_tightly(files, case, monkeypatch):
    """The gemma difference is mostly llama.cpp's float16 GELU: with it in kvserve every top-1 is equal
    (measured) and the mean difference 5x smaller (max 1.6e-4 / 3.3e-4, mean 1.6e-5 / 4.9e-5; the
    rest, still above the other families' 1e-5, is not traced further)."""
    import types

    from kvserve.models import gemma

    F = types.SimpleNamespace(**{k: getattr(torch.nn.functional, k) for k in dir(torch.nn.functional)
                                 if not k.startswith("__")})
    F.gelu = _llama_cpp_gelu
    monkeypatch.setattr(gemma, "F", F)
    got = compare(_core(files[case], case), family_oracle.load_fixture(REFERENCE, case))
    _check(case, got, max_diff=5e-4, min_same=4 * 68 - 1)  # measured 272: see GELU_FP16's near ties
    assert statistics.mean(d for _, _, d in got) <= 1e-4


@pytest.mark.parametrize("case", CAUSAL)
def test_greedy_tokens_equal_llama_cpps(files, case):
    fx = family_oracle.load_fixture(REFERENCE, case)["greedy"]
    ours = greedy(_core(files[case], case, n_parallel=len(fx)), [g["prompt"] for g in fx], 32)
    if case == "phi3-window":  # llama.cpp attends past the window: the chains part (see test_phi3_window_*)
        assert sum(o == g["tokens"] for o, g in zip(ours, fx)) == 0
        return
    assert ours == [g["tokens"] for g in fx]


#: Q8_0 copies (llama-quantize --pure) on kvserve's defaults (the file's blocks, activations quantized
#: to q8_0 as llama.cpp does; prefill steps on the per-row kernels, ``large_batch_dtype`` float32, as
#: tests/unit/test_llama_numerics.py runs them): (top-1 share, max, mean |d logprob|) and 5 of 6 greedy
#: chains (gemma: 3). Measured: mistral3 and phi3 within 5e-5 everywhere (the same q8 arithmetic); elsewhere exact
#: up to a prefix of 35-39 tokens in one sequence, apart after it (not traced further; likely an
#: activation on the other side of an int8 rounding step, llama.cpp's longer prompts multiplying on
#: other kernels), the difference carried on: top-1 271-272 of 272, max 0.018-0.057, mean
#: 0.0008-0.0086 (qwen3moe);
#: gemma adds its float16 GELU (GELU_FP16): top-1 264 / 267, max 0.022 / 0.059, mean 0.009 / 0.013, and
#: its greedy chains part sooner (gemma3: 3 of 6 equal for 32 tokens); gpt-oss (every tensor but the
#: norms, biases and sinks Q8_0, experts included): top-1 272 of 272, max 0.029, mean 0.0005, 6 of 6.
#: Those figures are dot32's (llama.cpp's own order of the float sums: 8 lanes per output, then a
#: horizontal sum). The AVX512-VNNI build's Q8_0 kernels now sum each block's exact integer into one
#: float chain per output (ggml_gemm8.h's q80_x8 / q80_rows: 1.5x faster at 16 rows, and prefill =
#: decode bit for bit), a few float32 ulps from llama.cpp's order: mistral3 max 0.007 (mean 3e-5), phi3
#: still 0; qwen3moe top-1 272, max 0.052, mean 0.0035; gemma2 / gemma3 top-1 264 / 266, max 0.022 /
#: 0.059, mean 0.009 / 0.013 (as before), greedy 5 / 2 of 6 (gemma3's chains part at another token:
#: one fewer whole chain); gpt-oss 272, 0.028, 0.0006, 5 of 6.
Q8_BOUNDS = {"default": (0.99, 0.15, 0.015, 5), "gemma": (0.96, 0.15, 0.025, 2)}


@pytest.fixture(scope="module")
def q8_files(files, tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("llama-families-q8")
    return {c: str(family_oracle.rebuild_q8_0(family_oracle.load_fixture(REFERENCE, c)["q8_0"],
                                              family_oracle.q8_0_source(c, Path(files[c]), tmp),
                                              tmp / f"{c}.q8_0.gguf")) for c in family_oracle.Q8_0_CASES}


def _q8_core(path: str, **kw) -> EngineCore:
    return EngineCore(load_files(path), EngineConfig(n_ctx=512, kv_dtype="f32", large_batch_dtype="float32", **kw))


@pytest.mark.parametrize("case", family_oracle.Q8_0_CASES)
def test_q8_0_copies_agree_with_llama_cpp(q8_files, case):
    run = family_oracle.load_fixture(REFERENCE, case)["q8_0"]
    assert {v.split()[0] for v in run["tensors"].values()} == {"F32", "Q8_0"}
    core = _q8_core(q8_files[case])
    assert {m.kernel for m in core.model.modules() if hasattr(m, "kernel")} == {"gguf"}  # no float copy
    got = compare(core, run)
    share, max_diff, mean_diff, n_greedy = Q8_BOUNDS["gemma" if case in GELU_FP16 else "default"]
    diffs = [d for _, _, d in got]
    print(case, "Q8_0 top-1", sum(s for _, s, _ in got), "max", f"{max(diffs):.4f}", "mean",
          f"{statistics.mean(diffs):.5f}")
    assert sum(s for _, s, _ in got) >= share * len(got)
    assert max(diffs) <= max_diff and statistics.mean(diffs) <= mean_diff
    ours = greedy(_q8_core(q8_files[case], n_parallel=6), [g["prompt"] for g in run["greedy"]], 32)
    same = sum(o == g["tokens"] for o, g in zip(ours, run["greedy"]))
    print(case, "Q8_0 greedy", same, "of 6")
    assert same >= n_greedy


#: Q4_K_M copies of the wide cases (family_oracle.WIDE; llama-quantize's types per tensor: Q4_K, Q6_K
#: and Q5_0 for attn_output's 128/64-value rows, blocks by tests/tinymodel.py) on kvserve's block
#: kernels, set as the Q8_0 copies are: (top-1 share, max, mean |d logprob|, greedy chains of 6).
#: Measured (AVX512-VNNI): top-1 267-272 of 272; max 0.03-0.11, mean 0.002-0.003 for llama3, qwen3,
#: mistral3; qwen3moe max 0.34 (a router's top-k flips at one position), mean 0.013; phi3 max 0.23,
#: mean 0.017; gemma2 / gemma3 (float16 GELU, see GELU_FP16) max 0.057 / 0.066, mean 0.018 / 0.032;
#: greedy chains 4-6 of 6
Q4_K_M_BOUNDS = {"default": (0.98, 0.45, 0.025, 4), "gemma": (0.975, 0.1, 0.045, 4)}


@pytest.fixture(scope="module")
def q4_k_m_files(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("llama-families-q4km")
    return {c: str(family_oracle.rebuild_q4_k_m(family_oracle.load_fixture(REFERENCE, c)["q4_k_m"], tmp / c))
            for c in family_oracle.QUANTIZED}


@pytest.mark.parametrize("case", family_oracle.QUANTIZED)
def test_q4_k_m_copies_agree_with_llama_cpp(q4_k_m_files, case):
    run = family_oracle.load_fixture(REFERENCE, case)["q4_k_m"]
    assert {"Q4_K", "Q6_K"} <= {v.split()[0] for v in run["tensors"].values()}
    core = _q8_core(q4_k_m_files[case])
    assert {m.kernel for m in core.model.modules() if hasattr(m, "kernel")} == {"gguf"}  # no float copy
    got = compare(core, run)
    share, max_diff, mean_diff, n_greedy = Q4_K_M_BOUNDS["gemma" if case in GELU_FP16 else "default"]
    diffs = [d for _, _, d in got]
    print(case, "Q4_K_M top-1", sum(s for _, s, _ in got), "of", len(got), "max", f"{max(diffs):.4f}", "mean",
          f"{statistics.mean(diffs):.5f}")
    ours = greedy(_q8_core(q4_k_m_files[case], n_parallel=6), [g["prompt"] for g in run["greedy"]], 32)
    same = sum(o == g["tokens"] for o, g in zip(ours, run["greedy"]))
    print(case, "Q4_K_M greedy", same, "of 6")
    assert sum(s for _, s, _ in got) >= share * len(got)
    assert max(diffs) <= max_diff and statistics.mean(diffs) <= mean_diff
    assert same >= n_greedy


def test_phi3_window_agrees_within_the_window_and_without_it(files, tmp_path):
    """kvserve honours phi3's window, llama.cpp disables it: equal while the sequence fits in the
    window (prefixes of <= 8 tokens), apart after it; the same file with its window set to 0 agrees
    everywhere, so the window is the whole difference."""
    fx = family_oracle.load_fixture(REFERENCE, "phi3-window")
    got = compare(_core(files["phi3-window"]), fx)
    inside = [(same, d) for n, same, d in got if n <= WINDOW]
    outside = [d for n, _, d in got if n > WINDOW]
    assert len(inside) == 4 * (WINDOW - 3) and all(s and d <= MAX_DIFF for s, d in inside)
    assert statistics.median(outside) > 100 * MAX_DIFF
    no_window = {**fx, "metadata": [[k, t, s, 0 if k == "phi3.attention.sliding_window" else v]
                                    for k, t, s, v in fx["metadata"]]}
    path = family_oracle.rebuild(no_window, tmp_path / "phi3-no-window.gguf")
    got = compare(_core(str(path)), fx)
    assert all(same and d <= MAX_DIFF for _, same, d in got)
    assert greedy(_core(str(path), n_parallel=6), [g["prompt"] for g in fx["greedy"]], 32) == \
        [g["tokens"] for g in fx["greedy"]]


def test_nomic_bert_tokens_and_vectors_equal_llama_cpps(files):
    from kvserve.engine.embedder import EmbeddingEngine

    fx = family_oracle.load_fixture(REFERENCE, "nomic-bert")["embeddings"]
    e = EmbeddingEngine(load_files(files["nomic-bert"]), EngineConfig(threads=1))
    try:
        assert (e.pooling, e.normalize) == ("mean", 2)
        ids = [e.tokenizer.encode(x["text"], add_special=True) for x in fx]
        assert ids == [x["tokens"] for x in fx]
        got = asyncio.run(e.embed(ids))
    finally:
        e.shutdown()
    diff = max(float(np.abs(np.asarray(v) - np.asarray(x["embedding"])).max()) for v, x in zip(got, fx))
    print("nomic-bert max |d|", f"{diff:.2e}")
    assert diff <= 1e-5
