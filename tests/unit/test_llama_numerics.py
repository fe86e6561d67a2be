"""Logits from packed GGUF weights agree with llama.cpp's on the same file, for every GGUF type.

Fixtures: tests/reference/llama_numerics/TYPE.json, llama-server's outputs on the small random llama
model of tests/numerics_model.py quantized by llama-quantize to TYPE (``regen.py`` there makes them
from the llama-cpp-python sdist; CI needs no llama.cpp). Files the ``gguf`` package writes byte for
byte as llama-quantize does are rebuilt here (and checked tensor by tensor against the digests the
fixture recorded); the others are stored beside the fixtures.

For each type, with kvserve's real loader and default kernels (the packed weights, activations
quantized as llama.cpp does), against two llama-server runs (regen.RUNS):

* "f32kv" (``-ctk f32 -ctv f32 -fa off``; kvserve ``-ctk f32``): attention in float32 on both sides,
  so only the matrix products on the packed weights differ. The issue's bar: teacher-forced over 4
  fixed sequences (400 positions) kvserve's top-1 equals llama.cpp's on >= 99%, through the prefill
  path (one forward per sequence) and the decode path (the prefix prefilled, one decode row per token,
  the native decode step where it applies); the first 32 greedy tokens equal on 5 of 6 prompts
  through the engine. Measured (prefill): mean |d logprob| of llama.cpp's top 5 0.00002 (Q5_K) to
  0.0025, Q2_K 0.0001; max 0.01-0.09.
* "default" (both servers' defaults: float16 KV; llama.cpp's flash attention keeps Q, K, V and its
  sums in float16): top-1 >= 97.5% (measured 394-400 of 400), mean |d| <= 0.035 (measured 0.014-0.022
  for the quantized types), greedy 32 tokens on 3 of 6 prompts (measured 3-6).

Why "default" is looser: every matrix product rounds its input to int8 (q8_0 / q8_K), a discontinuous
step, so a 0.001 difference in attention moves some inputs across a step and the next layers carry it:
a float64 simulation of llama.cpp's arithmetic with and without float16 K/V differs by as much
(0.05 mean |d| with unit-gain layers; tests/numerics_model.py halves them for that reason). Top-1 flips
only where llama.cpp's top two are that close.

Known differences (:data:`KNOWN`, :data:`MEAN_KNOWN`; strict xfails, so a fix shows): BF16 multiplies
float32 activations (llama.cpp: bfloat16; mean 0.0066); Q4_0's greedy chains on the native step's 4-bit
tiles (where the build repacks Q4_0: AVX2). The default prefill path (``large_batch_dtype`` auto) is checked on its own at the issue's bar:
on AVX512-BF16 + VNNI CPUs the int8 prefill path (ggml_gemm8.h, llama.cpp's q8 arithmetic; measured
top-1 399-400 of 400, mean |d| 0.00002-0.0033, as the per-row kernels), elsewhere the per-row kernels;
the bfloat16 prefill path (``gemm_path = "bf16"``; BF16 rows by default) with looser bounds
(:data:`BF16_BOUNDS`; measured top-1 391-400 of 400, mean |d| 0.018-0.027 for the quantized types).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.request import Request, SamplingParams
from kvserve.models import decode_native
from kvserve.models.llama import AttentionBatch, PrefillGroup
from kvserve.models.build import load_files

REFERENCE = Path(__file__).resolve().parents[1] / "reference" / "llama_numerics"
sys.path.insert(0, str(REFERENCE.parents[1]))  # tests/ (numerics_model)
import numerics_model  # noqa: E402

TYPES = ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
         "IQ4_NL", "IQ4_XS", "MXFP4", "Q4_K_M", "Q5_K_M")
#: kvserve's KV cache type for each llama-server run of the fixtures (regen.RUNS)
KV_DTYPE = {"f32kv": "f32", "default": "f16"}
#: (top-1 share, max |d logprob|, mean |d logprob|) each run must meet (see the module docstring);
#: "f32kv" is the issue's bar on the matrix products alone, "default" adds float16 attention. The f32kv
#: mean bound (measured up to 0.0037 on the decode path) leaves room for other CPUs' summation orders
#: (AVX2, AMX) and still fails on a 1% wrong scale in one matrix (mean 0.013; 0.2%: 0.0056)
BOUNDS = {"f32kv": (0.99, 0.15, 0.008), "default": (0.975, 0.3, 0.035)}
#: mean |d logprob| where kvserve's arithmetic knowingly differs from llama.cpp's, per type (f32kv):
#: BF16 rows multiply float32 activations (llama.cpp rounds them to bfloat16); Q4_0/Q4_1 run on torch's
#: int4 kernel with bfloat16 activations (and a w8a8 head) or the native decode step, not on q8_0
#: activations; Q5_1's q8_1 block sums stay float32 (llama.cpp rounds d * sum to float16)
MEAN_KNOWN = {"BF16": 0.01, "Q4_0": 0.035, "Q4_1": 0.035, "Q5_1": 0.025}
#: the issue's bar that these miss today, with why (strict: a fix makes the test fail until this goes)
Q4_PATH = ("kvserve's Q4_0/Q4_1 path (torch's int4 kernel with bfloat16 activations, the native decode "
           "step's 4-bit tiles) does not quantize activations to q8_0 as llama.cpp does")
Q5_1_SUMS = ("ggml_cpu.cpp keeps q8_1's s = d * sum(q) in float32; llama.cpp's quantize_row_q8_1 stores "
             "fp16(d_unrounded * sum)")
#: Q4_0's greedy chains miss only where the native step repacks Q4_0 into its tiles (the AVX2 build, or
#: KVSERVE_Q4_REPACK=1); on AVX512 it multiplies the file's blocks on q8_0 activations, as llama.cpp
KNOWN = {("greedy", "Q4_0"): Q4_PATH} if decode_native.q4_repacked("Q4_0", decode_native.cpu_isa()) else {}


def _known(kind: str, name: str, run: str | None = None):
    """pytest.param of ``name`` (and ``run``), marked xfail(strict) where :data:`KNOWN` says the f32kv
    bar is missed."""
    reason = KNOWN.get((kind, name)) if run in (None, "f32kv") else None
    values = (name,) if run is None else (name, run)
    return pytest.param(*values, marks=pytest.mark.xfail(strict=True, reason=reason) if reason else ())


def _fixture(name: str) -> dict:
    return json.loads((REFERENCE / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """TYPE -> the GGUF file llama-server ran on (stored, or rebuilt)."""
    out, tmp = {}, tmp_path_factory.mktemp("numerics")
    for name in TYPES:
        fx = _fixture(name)
        if fx["file"]:
            out[name] = str(REFERENCE / fx["file"])
        else:
            out[name] = str(numerics_model.write_gguf(tmp / f"{name}.gguf", name))
    return out


def _core(path: str, run: str = "f32kv", **kw) -> EngineCore:
    """An engine on ``path`` with the KV type of llama-server's ``run``. Prefill steps multiply on the
    per-row block kernels (``large_batch_dtype`` float32: activations quantized to q8_0 / q8_K as
    llama.cpp does) unless ``large_batch_dtype`` says otherwise: the default ("auto") prefill paths
    (ggml_gemm8.h's int8 one, ggml_gemm.h's bfloat16 one; AVX512-BF16 + VNNI CPUs) are checked on their
    own (test_teacher_forced_prefill_default_path, test_teacher_forced_prefill_bf16_path)."""
    kw.setdefault("n_ctx", 1024)
    kw.setdefault("large_batch_dtype", "float32")
    return EngineCore(load_files(path), EngineConfig(kv_dtype=KV_DTYPE[run], **kw))


def _caches(model, rows: int, dtype: torch.dtype):
    c = model.config
    return [(torch.zeros(rows, c.n_head_kv, c.head_dim, dtype=dtype),
             torch.zeros(rows, c.n_head_kv, c.head_dim, dtype=dtype)) for _ in range(c.n_layer)]


def _dtype(core: EngineCore) -> torch.dtype:
    return core.runner.kv_caches[0][0].dtype


def prefill_logprobs(core: EngineCore, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), n_vocab] log-probabilities of one forward over the whole sequence (the eager
    prefill path; the K/V rounded to the engine's cache type as a prefill rounds them)."""
    n = len(tokens)
    b = AttentionBatch(positions=torch.arange(n), slot_mapping=torch.arange(n), prefills=[PrefillGroup(0, n, 0)])
    with torch.no_grad():
        logits = core.model(torch.tensor(tokens), b, _caches(core.model, n, _dtype(core)), None)
    return torch.log_softmax(logits.float(), -1)


def _decode_batch(rows: list[tuple[int, int, int]]):
    """rows: (first cache row of the sequence, token, position) -> decode-step tensors (every query
    reads its own rows base .. base + position)."""
    L = max(p for _, _, p in rows) + 1
    ids = torch.tensor([t for _, t, _ in rows])
    pos = torch.tensor([p for _, _, p in rows])
    base = torch.tensor([b for b, _, _ in rows])
    valid = torch.arange(L)[None] <= pos[:, None]
    idx = torch.where(valid, base[:, None] + torch.arange(L)[None], 0)
    return ids, pos, base + pos, idx, pos + 1, valid.view(len(rows), 1, 1, L)


def decode_step(model, native, caches, rows) -> torch.Tensor:
    """One decode step of ``rows`` (see _decode_batch): float32 logits [len(rows), n_vocab], through the
    native decode step when ``native`` is given, else the eager model."""
    ids, pos, slots, idx, lens, mask = _decode_batch(rows)
    with torch.no_grad():
        if native is not None:
            return native(ids, pos, slots, idx, lens, caches)
        attn = AttentionBatch(positions=pos, slot_mapping=slots, n_decode=len(rows), decode_kv_index=idx,
                              decode_mask=mask, decode_lens=lens)
        return model(ids, attn, caches, None).float()


def _prefill_into(model, caches, tokens: list[int], base: int) -> None:
    n = len(tokens)
    b = AttentionBatch(positions=torch.arange(n), slot_mapping=torch.arange(n) + base,
                       prefills=[PrefillGroup(0, n, 0)])
    with torch.no_grad():
        model(torch.tensor(tokens), b, caches, torch.tensor([n - 1]))


def _native(core: EngineCore, caches):
    """kvserve's native decode step over ``caches`` where it applies to this model (else None)."""
    if not getattr(core.model, "native_decode", False) or decode_native.unavailable_reason():
        return None
    nat = decode_native.NativeDecode(core.model, caches, 16)
    nat.start()
    assert nat.wait(300) and nat.reason is None, nat.reason
    return nat


def decode_logprobs(core: EngineCore, tokens: list[int], start: int) -> torch.Tensor:
    """Log-probabilities after each prefix tokens[:n], n in [start, len): tokens[:start - 1] prefilled,
    then one decode row per token (llama-server's path with a cached prompt), through the native
    decode step where it applies."""
    caches = _caches(core.model, len(tokens), _dtype(core))
    _prefill_into(core.model, caches, tokens[:start - 1], 0)
    nat = _native(core, caches)
    rows = [decode_step(core.model, nat, caches, [(0, tokens[i], i)])[0] for i in range(start - 1, len(tokens) - 1)]
    return torch.log_softmax(torch.stack(rows), -1)


def compare(run: dict, logprobs_of) -> tuple[int, int, list[float]]:
    """(top-1 agreements, positions, |d logprob| of llama.cpp's top tokens) over one fixture run's
    sequences; ``logprobs_of(tokens, start)`` -> [positions, n_vocab], the predictions after
    tokens[:start], tokens[:start + 1], ..."""
    agree = total = 0
    diffs: list[float] = []
    for s in run["teacher_forced"]:
        lp = logprobs_of(s["tokens"], s["start"])
        for row, ids, lps in zip(lp, s["top_ids"], s["top_logprobs"]):
            total += 1
            agree += int(row.argmax()) == ids[0]
            diffs += [abs(row[i].item() - x) for i, x in zip(ids, lps)]
    return agree, total, diffs


def _check(name: str, run: str, agree: int, total: int, diffs: list[float]) -> None:
    share, max_diff, mean_diff = BOUNDS[run]
    if run == "f32kv":
        mean_diff = MEAN_KNOWN.get(name, mean_diff)
    assert total == 400
    assert agree >= share * total, f"{name} {run}: top-1 {agree}/{total}"
    assert max(diffs) <= max_diff, f"{name} {run}: max |d logprob| {max(diffs):.4f}"
    assert statistics.mean(diffs) <= mean_diff, f"{name} {run}: mean |d logprob| {statistics.mean(diffs):.5f}"


def test_fixture_files_are_llama_cpps(files):
    """Every tensor of every file is the one llama-server ran on (its digest in the fixture), in the
    fixture's type: rebuilt files too, so a change in the gguf package cannot pass silently."""
    for name in TYPES:
        assert numerics_model.tensor_digests(files[name]) == _fixture(name)["tensors"], name


def test_pure_files_hold_one_type_and_mixes_mix():
    for name in TYPES:
        kinds = {v.split()[0] for v in _fixture(name)["tensors"].values()}
        if name.endswith("_M"):
            assert kinds == {"F32", name[:4], "Q6_K"}, name  # llama-quantize's mix
        else:
            assert kinds == {"F32", name}, name


def test_kvserve_keeps_every_type_packed(files):
    """The comparisons run on the file's blocks: no float copy of any matrix."""
    for name in TYPES:
        core = _core(files[name])
        for lin in [core.model.output] + [m for layer in core.model.layers for m in (layer.wqkv, layer.wo)]:
            assert lin.kernel == "gguf" and lin.weight is None, (name, lin.kernel)


@pytest.mark.parametrize("name", [_known("prefill", t) for t in TYPES])
def test_teacher_forced_prefill_agrees_with_llama_cpp(files, name):
    """f32 KV on both sides: only the products on the packed weights differ."""
    core = _core(files[name], "f32kv")
    agree, total, diffs = compare(_fixture(name)["runs"]["f32kv"], lambda t, s: prefill_logprobs(core, t)[s - 1:-1])
    _check(name, "f32kv", agree, total, diffs)


#: the bfloat16 prefill path against llama.cpp (f32kv): its operands are rounded to bfloat16, not
#: quantized to q8 as llama.cpp's are, so it sits further from llama.cpp's arithmetic than the q8 paths
#: do (as far as llama.cpp's own float16-KV run does): top-1, max and mean |d logprob|
BF16_BOUNDS = (0.975, 0.3, 0.035)


def _block_matrices(model):
    """Every GGUF block matrix of ``model``'s projections (prefill's and the int4 kernel's large steps')."""
    return [m for lin in model.modules() for m in (getattr(lin, "blocks", None), getattr(lin, "large_blocks", None))
            if m is not None and hasattr(m, "gemm_path")]


@pytest.mark.parametrize("name", TYPES)
def test_teacher_forced_prefill_default_path(files, name):
    """kvserve's default prefill path (``large_batch_dtype`` auto) against llama.cpp's f32kv run, at the
    issue's bar: on AVX512-BF16 + VNNI builds the int8 prefill path (ggml_gemm8.h: llama.cpp's q8
    arithmetic) for every type but F16 (per-row kernels) and BF16 (the bfloat16 path: BF16_BOUNDS);
    elsewhere the per-row kernels; Q4_0 parts of 16k rows repacked (q4_repack.h) take their own kernel at
    every row count. Measured (int8 path): top-1 398-400 of 400 for the quantized types; repacked Q4_0
    400 of 400."""
    from kvserve.models import ggml_kernel

    core = _core(files[name], "f32kv", large_batch_dtype="auto")
    mats = [m for m in _block_matrices(core.model) if m.gemm_min_rows > 0]  # the head: per-row kernels
    on_gemm = bool(ggml_kernel.ensure_built().GEMM) and len(mats) > 0
    # repacked Q4_0 (AVX512-VNNI builds, ggml_kernel.repack_q4_0): its own kernel at every row count
    int8 = on_gemm and all(m.matrix.gemm8 or any(m.repacked) for m in mats)
    agree, total, diffs = compare(_fixture(name)["runs"]["f32kv"], lambda t, s: prefill_logprobs(core, t)[s - 1:-1])
    print(name, "default prefill", "int8" if int8 else "bf16" if on_gemm and name == "BF16" else "rows", agree, total,
          round(max(diffs), 4), round(statistics.mean(diffs), 5))
    if on_gemm and name == "BF16":
        share, max_diff, mean_diff = BF16_BOUNDS
        assert total == 400 and agree >= share * total, f"{name}: top-1 {agree}/{total}"
        assert max(diffs) <= max_diff and statistics.mean(diffs) <= mean_diff, (max(diffs), statistics.mean(diffs))
        return
    if on_gemm and name not in ("F16",):
        assert int8, name
    _check(name, "f32kv", agree, total, diffs)


@pytest.mark.parametrize("name", TYPES)
def test_teacher_forced_prefill_bf16_path(files, name):
    """The bfloat16 prefill path (weights dequantized a panel at a time to bfloat16; ggml_gemm.h; the
    default before the int8 path, now BF16 rows' and ``gemm_path = "bf16"``) against llama.cpp's f32kv
    run, with BF16_BOUNDS."""
    from kvserve.models import ggml_kernel

    if not ggml_kernel.ensure_built().GEMM:
        pytest.skip("this build has no bfloat16 prefill path (no AVX512-BF16)")
    core = _core(files[name], "f32kv", large_batch_dtype="bfloat16")
    assert core.model.layers[0].wqkv.blocks.gemm_min_rows > 0
    for m in _block_matrices(core.model):
        m.gemm_path = "bf16"
    agree, total, diffs = compare(_fixture(name)["runs"]["f32kv"], lambda t, s: prefill_logprobs(core, t)[s - 1:-1])
    share, max_diff, mean_diff = BF16_BOUNDS
    print(name, "bf16 prefill", agree, total, round(max(diffs), 4), round(statistics.mean(diffs), 5))
    assert total == 400 and agree >= share * total, f"{name}: top-1 {agree}/{total}"
    assert max(diffs) <= max_diff and statistics.mean(diffs) <= mean_diff, (max(diffs), statistics.mean(diffs))


@pytest.mark.parametrize("name", TYPES)
def test_teacher_forced_prefill_default_flags(files, name):
    """Both servers' defaults (float16 KV; llama.cpp's flash attention): looser bounds, see the module
    docstring."""
    run = "default"
    core = _core(files[name], run)
    agree, total, diffs = compare(_fixture(name)["runs"][run], lambda t, s: prefill_logprobs(core, t)[s - 1:-1])
    _check(name, run, agree, total, diffs)


@pytest.mark.parametrize("name", [_known("decode", t) for t in TYPES])
def test_teacher_forced_decode_agrees_with_llama_cpp(files, name):
    """400 decode steps per type, f32 KV (about 2 s a type on an idle 2-core machine)."""
    core = _core(files[name], "f32kv")
    agree, total, diffs = compare(_fixture(name)["runs"]["f32kv"], lambda t, s: decode_logprobs(core, t, s))
    _check(name, "f32kv", agree, total, diffs)


def _greedy(core: EngineCore, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens of every prompt, all decoded together by the engine (continuous batching)."""
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        core.add_request(Request(f"g{i}", p, SamplingParams(temperature=0, n_predict=n, ignore_eos=True)))
        out[f"g{i}"] = []
    while any(len(v) < n for v in out.values()):
        for o in core.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[f"g{i}"] for i in range(len(prompts))]


#: of the 6 prompts, how many must give llama.cpp's first 32 greedy tokens, per run: "most" with f32 KV
#: (the issue's bar); with float16 attention a near tie flips a chain now and then (measured 3-6 of 6)
GREEDY_MIN = {"f32kv": 5, "default": 3}


@pytest.mark.parametrize("name,run", [_known("greedy", t, r) for t in TYPES for r in ("f32kv", "default")])
def test_greedy_continuations_match_llama_cpp(files, name, run):
    """The engine's own path (prefill, then decode steps of all 6 prompts together; the native step
    where it applies)."""
    fx = _fixture(name)["runs"][run]["greedy"]
    ours = _greedy(_core(files[name], run, n_parallel=len(fx)), [g["prompt"] for g in fx], 40)
    assert all(len(g["tokens"]) == 40 for g in fx)
    same = sum(o[:32] == g["tokens"][:32] for o, g in zip(ours, fx))
    assert same >= GREEDY_MIN[run], f"{name} {run}: {same}/{len(fx)} prompts' first 32 greedy tokens equal"


@pytest.mark.parametrize("name", TYPES)
def test_decode_rows_are_batch_invariant(files, name):
    """A sequence's decode row alone and beside two other sequences' rows (float16 KV, the engine's
    default): identical logits through the native step (the engine's decode path, every type); the
    eager attention over a padded batch is not bit-exact (SDPA over more, masked, keys; the products'
    int8 activations absorb its rounding only most of the time): within 1e-5 of the logits' range
    there, the same top-1."""
    core = _core(files[name], "default")
    seqs = [s["tokens"][:40 + 7 * i] for i, s in enumerate(_fixture(name)["runs"]["default"]["teacher_forced"][:3])]
    caches = _caches(core.model, 3 * 128, torch.float16)
    for i, s in enumerate(seqs):
        _prefill_into(core.model, caches, s[:-1], 128 * i)
    rows = [(128 * i, s[-1], len(s) - 1) for i, s in enumerate(seqs)]
    for nat in [None, _native(core, caches)] if core.model.native_decode else [None]:
        alone = decode_step(core.model, nat, [(k.clone(), v.clone()) for k, v in caches], rows[1:2])[0]
        together = decode_step(core.model, nat, [(k.clone(), v.clone()) for k, v in caches], rows)[1]
        if nat is not None:
            assert torch.equal(alone, together), (name, "native")
        else:
            assert (alone - together).abs().max() <= 1e-5 * (alone.max() - alone.min())
            assert alone.argmax() == together.argmax()
