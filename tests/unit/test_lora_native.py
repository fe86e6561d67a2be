"""LoRA rows in the native decode step (kvserve.models.decode_native, decode_cpu.cpp's ``step_lora``):
decode-only steps that carry adapter rows run natively, each row getting its adapters' deltas inside
the step, and agree with the eager LoRA path (kvserve.lora.apply) row by row; base rows of such a step
are bit-identical to base rows of a base-only step. Skipped where the native step cannot run here."""

import os
import subprocess
import sys

import pytest
import torch

import tinylora
import tinymodel
from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.request import Request, SamplingParams
from kvserve.models import decode_native
from kvserve.models.build import load_files

SEED = 3
WIDE = dict(n_embd=128, n_head=4, n_head_kv=2, n_ff=256)  # head_dim 32: the native decode step's
PROMPT = [5, 17, 42, 9, 133, 260, 71, 8, 99, 14, 200, 31, 64, 120, 7, 250, 11, 45, 90, 180]
N = 8
#: each request's adapters: three adapters alone, the base, and two adapters at once with user scales
LORAS = [((0, 1.0),), ((1, 1.0),), ((2, 1.0),), (), ((0, 0.5), (2, -0.7))]

pytestmark = pytest.mark.skipif(decode_native.unavailable_reason() is not None,
                                reason=f"native decode step: {decode_native.unavailable_reason()}")


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-4):
    """max |got - want| <= rel x the logits' scale (max |want|): test_lora.py's tolerance."""
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    assert diff <= rel * scale, f"max abs diff {diff:.3g} > {rel:g} x logit scale {scale:.3g}"


_n = [0]


def req(lora=(), prompt=PROMPT) -> Request:
    _n[0] += 1
    return Request(f"n{_n[0]}", list(prompt), SamplingParams(n_predict=N, temperature=0.0), lora=tuple(lora))


def run(core: EngineCore, reqs: list[Request]):
    """Step until every request finished: (tokens, logits [N, V] per request id, the steps' LoRA
    batches (None for base-only steps))."""
    toks, logits, batches, _ = tinylora.run_capture(core, reqs)
    return toks, {k: torch.stack(v) for k, v in logits.items()}, batches


def make_core(files, base: str, native: bool) -> EngineCore:
    """The model ``base`` ("llama-Q8_0", ...) on kvserve's defaults (``--dtype auto``), the native decode
    step on (waited for) or off (``KVSERVE_NATIVE_DECODE=0``), adapters 0, 1, 2 = PEFT seeds 1, 2 and
    the GGUF adapter of seed 3."""
    old = os.environ.get("KVSERVE_NATIVE_DECODE")
    os.environ["KVSERVE_NATIVE_DECODE"] = "1" if native else "0"
    try:
        c = EngineCore(load_files(files[base]), EngineConfig(n_ctx=512, dtype="auto", n_parallel=8))
    finally:
        if old is None:
            del os.environ["KVSERVE_NATIVE_DECODE"]
        else:
            os.environ["KVSERVE_NATIVE_DECODE"] = old
    nat = c.runner.native
    if native:
        assert nat is not None and nat.wait(300), getattr(nat, "reason", None)
    else:
        assert nat is None or not nat.ready
    arch = base.split("-")[0]
    for name in ("peft1", "peft2", f"gguf3-{arch}"):  # ids 0, 1, 2: PEFT and llama.cpp's GGUF (permuted q/k rows)
        c.runner.lora.load(files[name], name=name)
    return c


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_native")
    f = {"peft1": tinylora.write_peft_adapter(d / "peft1", seed=1, **WIDE),
         "peft2": tinylora.write_peft_adapter(d / "peft2", seed=2, **WIDE)}
    for arch in ("llama", "qwen2"):
        f[f"gguf3-{arch}"] = tinylora.write_gguf_adapter(d / f"a3-{arch}.gguf", arch=arch, seed=3, **WIDE)
    # Q8_0: the file's blocks (ggml_cpu.cpp's products); Q4_1: repacked into the step's 4-bit tiles;
    # qwen2: a q|k|v bias (the delta comes after it, as in Linear.forward)
    for arch, qtype in (("llama", "Q8_0"), ("llama", "Q4_1"), ("qwen2", "Q8_0")):
        f[f"{arch}-{qtype}"] = tinymodel.write_tiny_gguf(d / f"{arch}-{qtype}.gguf", arch=arch, seed=SEED, qtype=qtype,
                                                         **WIDE)
    return {k: str(v) for k, v in f.items()}


@pytest.mark.parametrize("base,n_cmp,tol", [("llama-Q8_0", N, None), ("qwen2-Q8_0", 1, None), ("llama-Q4_1", 1, 3e-2)])
def test_mixed_step_matches_each_row_alone_on_the_eager_path(files, base, n_cmp, tol):
    """Three adapters, the base and a row of two adapters in one native step: each row's greedy tokens
    equal what the eager LoRA path gives that request alone, and its logits are as close to the eager
    path's as the base row's are (the native step's own rounding, about 3e-4 of the logit scale on a
    Q8_0 base) plus test_lora.py's 1e-4 of the logit scale. The decode steps all ran natively:
    ``lora_steps``, the eager fallback, counts only the prefill step.

    ``n_cmp``: the tokens compared. Both paths quantize each projection's input to int8 (the Q8_0
    products); the delta's float32 sums, in another order than torch's, can move a value across a
    rounding boundary, one int8 step (~1% of its block's largest value) apart, and from there the
    sequences drift as any two kernels' do (qwen2's seed-3 adapter: 1e-2 of the logit scale from the
    second token on, a near tie at the sixth). There only the first token (the prompt's last, over the
    same prefilled KV) is compared, and on the Q4_1 base, whose eager kernel is not the native step's
    (about 1.5e-2 apart for the base itself), to ``tol`` (test_decode_native.py allows 2e-2 of the
    range)."""
    c = make_core(files, base, native=True)
    reqs = [req(lo) for lo in LORAS]
    steps0, native0, eager0 = c.runner.lora_steps, c.runner.native_lora_steps, c.runner.eager_decode_steps
    toks, logits, batches = run(c, reqs)
    mixed = [b for b in batches if b is not None and len(b.groups) == 3]
    # the prefill, the prompts' last tokens (a step of their own: Scheduler.split_last_token), N - 1 decodes
    assert len(mixed) == N + 1 and [b.n_rows for b in mixed[1:]] == [5] * N
    assert c.runner.lora_steps - steps0 == 1  # only the prefill ran eagerly
    assert c.runner.native_lora_steps - native0 == N
    assert c.runner.eager_decode_steps == eager0
    assert sorted(c.runner.native.decoder.lora_ids()) == [0, 1, 2]
    # the adapters change the tokens (the comparison is not of the base with itself)
    assert len({tuple(toks[r.request_id]) for r in reqs}) == len(reqs)

    ref = make_core(files, base, native=False)
    want = {}
    for r, lo in zip(reqs, LORAS):
        alone = req(lo)
        rt, rl, _ = run(ref, [alone])
        assert toks[r.request_id][:n_cmp] == rt[alone.request_id][:n_cmp], lo
        want[r.request_id] = rl[alone.request_id][:n_cmp]
    assert ref.runner.native_lora_steps == 0 and ref.runner.lora_steps == 4 * N  # per request: prefill, N - 1 decodes

    def dev(r):  # max |native - eager| / the eager logits' scale
        w = want[r.request_id]
        return ((logits[r.request_id][:n_cmp] - w).abs().max() / w.abs().max()).item()

    base_dev = dev(reqs[3])
    assert base_dev < (tol or 2e-3)
    for r, lo in zip(reqs, LORAS):
        assert dev(r) <= (tol or base_dev + 1e-4), (lo, dev(r), base_dev)


@pytest.mark.parametrize("base", ["llama-Q8_0", "llama-Q4_1"])
def test_base_rows_bit_identical_next_to_adapter_rows(files, base):
    """A base row computed in a native step beside adapter rows equals, bit for bit, the same request
    run alone in base-only steps (step, not step_lora); and each adapter row equals itself run alone
    natively (no row's arithmetic depends on the others')."""
    c = make_core(files, base, native=True)
    reqs = [req(lo) for lo in LORAS]
    _, logits, _ = run(c, reqs)
    for r, lo in zip(reqs, LORAS):
        alone = req(lo)
        _, al, batches = run(c, [alone])
        assert torch.equal(logits[r.request_id], al[alone.request_id]), lo
        if not lo:
            assert batches and all(b is None for b in batches)


def test_removed_adapter_is_dropped_and_a_refused_one_runs_eagerly(files, monkeypatch):
    """An adapter removed from the registry is dropped from the decoder when the next adapter is
    registered; one the decoder refuses runs on the eager path (its decode steps count in
    ``lora_steps``) with the eager path's tokens."""
    c = make_core(files, "llama-Q8_0", native=True)
    nat = c.runner.native
    run(c, [req(((0, 1.0),)), req(((1, 1.0),))])
    assert sorted(nat.decoder.lora_ids()) == [0, 1]
    c.runner.lora.remove(0)
    run(c, [req(((2, 1.0),))])
    assert sorted(nat.decoder.lora_ids()) == [1, 2]

    def refuse(aid):
        raise RuntimeError("refused for the test")

    aid = c.runner.lora.load(files["peft1"], name="again")
    monkeypatch.setattr(nat, "_register_lora", refuse)
    before = c.runner.lora_steps
    r = req(((aid, 1.0),))
    toks, logits, _ = run(c, [r])
    assert c.runner.lora_steps - before == N + 1  # the prefill and every decode step, eagerly
    assert nat.decoder.lora_ids() == [1, 2]
    monkeypatch.undo()
    r2 = req(((1, 1.0),))  # another adapter still runs natively
    native0 = c.runner.native_lora_steps
    run(c, [r2])
    assert c.runner.native_lora_steps - native0 == N
    # the refused adapter (peft1 again) gives what adapter 0 (peft1) gives on the eager path
    ref = make_core(files, "llama-Q8_0", native=False)
    r3 = req(((0, 1.0),))
    rt, rl, _ = run(ref, [r3])
    assert toks[r.request_id] == rt[r3.request_id]
    assert_close(logits[r.request_id], rl[r3.request_id])


def test_step_lora_checks_its_rows(files):
    """step_lora refuses an unregistered adapter id and row offsets that do not cover the rows."""
    c = make_core(files, "llama-Q8_0", native=True)
    dec = c.runner.native.decoder
    m = c.model
    ks = [k for k, _ in c.runner.kv_caches]
    vs = [v for _, v in c.runner.kv_caches]
    x = m.embed(torch.tensor([5]))
    cos, sin = m.rope_cos[:1].contiguous(), m.rope_sin[:1].contiguous()
    args = (torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1]), ks, vs)
    with pytest.raises(RuntimeError, match="LoRA adapter 7 is not registered"):
        dec.step_lora(x.clone(), cos, sin, *args, torch.tensor([0, 1]), torch.tensor([7]), torch.tensor([1.0]))
    with pytest.raises(RuntimeError, match="bad LoRA row"):
        dec.step_lora(x.clone(), cos, sin, *args, torch.tensor([0, 2]), torch.tensor([7]), torch.tensor([1.0]))


@pytest.mark.slow
def test_avx2_build_passes_these_tests_on_an_avx512_cpu():
    """On an AVX512 CPU, this file's other tests run again on the AVX2 build (``KVSERVE_NATIVE_MARCH=
    haswell``, as test_decode_native.py does) in a child process."""
    mod = decode_native.ensure_built()
    if mod is None or mod.ISA != "avx512":
        pytest.skip("this CPU runs the AVX2 build itself")
    env = dict(os.environ, KVSERVE_NATIVE_MARCH="haswell")
    r = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "-x", __file__,
                        "-k", "not avx2_build"], env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " skipped" not in r.stdout, r.stdout[-2000:]


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def test_native_copy_of_a_small_adapter_costs_about_its_size(files):
    c = make_core(files, "llama-Q8_0", native=True)
    run(c, [req(((0, 1.0),))])
    nbytes = c.runner.lora.by_id(0).adapter.nbytes
    before = _rss_anon_kib()
    n = 40
    for i in range(n):
        aid = c.runner.lora.load(files["peft1"], name=f"small{i}")
        run(c, [req(((aid, 1.0),), prompt=[5, 6])])
    per_adapter = (_rss_anon_kib() - before) * 1024 / n
    # the registry's A and B (float32, nbytes) plus the step's float32 copy of them: about 2 x nbytes
    assert len(c.runner.native.decoder.lora_ids()) == n + 1 and per_adapter < 4 * nbytes, (per_adapter, nbytes)


def _core_lora_dtype(files, native: bool, lora_dtype: str, round_to: torch.dtype | None = None) -> EngineCore:
    """llama-Q8_0 with adapter 0 = peft1 installed in ``lora_dtype`` (``--lora-dtype``); with ``round_to``
    the installed float32 weights are rounded to that dtype in place (before the native step copies them)."""
    old = os.environ.get("KVSERVE_NATIVE_DECODE")
    os.environ["KVSERVE_NATIVE_DECODE"] = "1" if native else "0"
    try:
        c = EngineCore(load_files(files["llama-Q8_0"]), EngineConfig(n_ctx=512, dtype="auto", n_parallel=8))
    finally:
        if old is None:
            del os.environ["KVSERVE_NATIVE_DECODE"]
        else:
            os.environ["KVSERVE_NATIVE_DECODE"] = old
    if native:
        assert c.runner.native is not None and c.runner.native.wait(300)
    c.runner.lora.lora_dtype = lora_dtype
    c.runner.lora.load(files["peft1"], name="peft1")
    if round_to is not None:
        for layer in c.runner.model.layers:
            for lin in (getattr(layer, attr, None) for attr in ("wqkv", "wo", "w_gate_up", "w_down")):
                lo = getattr(lin, "lora", None)
                if lo is not None and 0 in lo.weights:
                    a, parts = lo.weights[0]
                    a.copy_(a.to(round_to).float())
                    for *_, b in parts:
                        b.copy_(b.to(round_to).float())
    return c


@pytest.mark.parametrize("native,lora_dtype", [(True, "bfloat16"), (True, "float16"), (False, "bfloat16")])
def test_narrow_lora_dtype_is_the_float32_delta_of_the_rounded_weights(files, native, lora_dtype):
    """``--lora-dtype bfloat16/float16`` (vLLM's flag): the adapter's fused A and B are stored narrow (the
    native step's copy too: it reads them with vload<T>), half of float32's bytes, and the arithmetic stays
    float32, so the logits are bit-identical to a float32 adapter whose weights were rounded to that dtype;
    on the native path every decode step ran natively. Before, the flag did not exist and the adapter was
    float32 (not rounded): the logits differed."""
    dt = getattr(torch, lora_dtype)
    narrow = _core_lora_dtype(files, native, lora_dtype)
    wide = _core_lora_dtype(files, native, "auto", round_to=dt)
    lin = narrow.runner.model.layers[0].wqkv.lora.weights[0]
    assert (lin[0].dtype, lin[1][0][4].dtype, wide.runner.model.layers[0].wqkv.lora.weights[0][0].dtype) == (
        dt, dt, torch.float32)
    n = narrow.runner.lora.by_id(0).adapter.nbytes
    assert (narrow.runner.lora.nbytes, wide.runner.lora.nbytes) == (n + n // 2, 2 * n)
    native0 = narrow.runner.native_lora_steps
    toks_n, logits_n, _ = run(narrow, [req(((0, 1.0),))])
    toks_w, logits_w, _ = run(wide, [req(((0, 1.0),))])
    assert narrow.runner.native_lora_steps - native0 == (N if native else 0)  # the prompt's last token, N - 1 decodes
    (ln,), (lw,) = logits_n.values(), logits_w.values()
    assert list(toks_n.values()) == list(toks_w.values())
    assert torch.equal(ln, lw)
    # and the rounding matters: the unrounded float32 adapter's logits differ
    plain = _core_lora_dtype(files, native, "float32")
    _, logits_p, _ = run(plain, [req(((0, 1.0),))])
    assert not torch.equal(next(iter(logits_p.values())), lw)
