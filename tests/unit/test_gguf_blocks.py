"""GGUF matrices kept as the file stores them (Weight.raw, a view of the mapping) and multiplied by
the block kernels (kvserve.models.ggml_kernel) in Linear, with no dense copy: agreement with the
dequantized float path, the fallbacks, and the loader's refusal of tensors that are not whole blocks."""

from pathlib import Path

import numpy as np
import pytest
import torch

import tinymodel
from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.request import SamplingParams
from kvserve.llm import LLM
from kvserve.loaders.gguf import TensorInfo, _tensor_to_weight, load_gguf
from kvserve.loaders.weights import ModelLoadError
from kvserve.models import ggml_kernel
from kvserve.models.llama import AttentionBatch, PrefillGroup
from kvserve.models.build import load_files


@pytest.fixture(scope="module")
def kernels():
    if ggml_kernel.ensure_built() is None:
        pytest.skip("the GGUF block kernels cannot be built here")


def _core(path, **cfg) -> EngineCore:
    return EngineCore(load_files(str(path)), EngineConfig(n_ctx=512, **cfg))


def _logits(core: EngineCore, ids: list[int]) -> torch.Tensor:
    c = core.model_config
    n = len(ids)
    kv = [(torch.zeros(n, c.n_head_kv, c.head_dim), torch.zeros(n, c.n_head_kv, c.head_dim)) for _ in range(c.n_layer)]
    b = AttentionBatch(positions=torch.arange(n), slot_mapping=torch.arange(n), prefills=[PrefillGroup(0, n, 0, None)])
    return core.model(torch.tensor(ids), b, kv, None)


def _mapped(a: np.ndarray) -> bool:
    """True when ``a`` is a view of the loader's one buffer of the file's bytes (not a copy of its own):
    the file's np.memmap (--mmap) or the anonymous mapping it was read into (--no-mmap, the default
    where the kernel grants huge pages: kvserve.loaders.gguf._weight_bytes)."""
    import mmap

    while a is not None:
        if isinstance(a, np.memmap) or isinstance(getattr(a.base, "obj", a.base), mmap.mmap):
            return True
        a = a.base if isinstance(a.base, np.ndarray) else None
    return False


PROMPT = [5, 17, 200, 31, 8, 99, 4, 250, 3, 77, 41, 120]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "F16", "BF16"])
def test_block_kernels_agree_with_the_dequantized_model(kernels, tmp_path, qtype):
    """Every projection and the head run on the file's blocks (kernel "gguf", no dense copy, the
    bytes a view of the file's mapping); prefill logits agree with the float32 model of the
    dequantized weights (see tol), and the same greedy choices where they are not near ties."""
    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf", n_embd=256, n_ff=512, n_head=4, n_head_kv=2, qtype=qtype,
                                     seed=21)
    packed, dense = _core(path), _core(path, dtype="float32")
    lins = [*packed.model.projections(), packed.model.output]
    assert all(lin.kernel == "gguf" and lin.weight is None for lin in lins)
    assert all(_mapped(p) for lin in lins for p in lin.blocks.parts)
    assert dense.model.layers[0].wqkv.kernel == "dense"
    a, b = _logits(packed, PROMPT), _logits(dense, PROMPT)
    # 8-bit activations (llama.cpp's rounding): ~2-3% of the logits' range at most on these random
    # models, as the int8 path's own (2.1% / 2.6% for Q8_0 / Q4_K); float activations for F16/BF16
    tol = 1e-5 if qtype in ("F16", "BF16") else 0.04
    assert (a - b).abs().max().item() < tol * b.abs().max().item()
    assert (a - b).abs().mean().item() < tol / 4 * b.abs().max().item()
    # the float model's 40 greedy tokens, teacher-forced through both: the same top-1 at >= 48 of the
    # 52 positions (free-running greedy text parts at the first near tie, on these random models as
    # with the int8 path before: measured for Q8_0 seeds 21-23, tokens 6/32/32 here, 10/32/17 there)
    p = SamplingParams(n_predict=40, ignore_eos=True, temperature=0.0)
    seq = PROMPT + LLM(dense).generate([PROMPT], p)[0].token_ids
    a, b = _logits(packed, seq), _logits(dense, seq)
    same = (a.argmax(-1) == b.argmax(-1)).sum().item()
    print(qtype, "top-1 agreement", same, "of", len(seq))
    assert same >= 48


def test_int8_prefill_path_needs_vnni_not_bf16(kernels, tmp_path, monkeypatch):
    """The int8 prefill path is chosen by what it needs: AVX512F/BW/VL + AVX512-VNNI (Cascade Lake, Ice
    Lake: no AVX512-BF16), not the bfloat16 path's AVX512-BF16. Capability flags forced: with VNNI and
    no native bfloat16, large_batch_dtype auto still hands a Q4_K model's block matrices
    small_batch_rows + 1 (the int8 path, no bfloat16 copy); without VNNI, or with F16 matrices (no
    int8 path for them: a bfloat16 copy would be made), it does not."""
    from kvserve.models import build, q4_kernel

    vnni = ["fpu", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"]
    no_vnni = vnni[:-1]
    assert ggml_kernel.prefill_paths(vnni) == ("int8",)
    assert ggml_kernel.prefill_paths(vnni + ["avx512_bf16"]) == ("int8", "bf16")
    assert ggml_kernel.prefill_paths(no_vnni + ["avx512_bf16"]) == ()
    assert ggml_kernel.prefill_paths(["avx2", "fma", "f16c", "avx_vnni"]) == ()
    q4k = tinymodel.write_tiny_gguf(tmp_path / "q4k.gguf", n_embd=256, n_ff=512, qtype="Q4_K", seed=3)
    f16 = tinymodel.write_tiny_gguf(tmp_path / "f16.gguf", n_embd=256, n_ff=512, qtype="F16", seed=3)
    assert build.int8_prefill_only(load_files(str(q4k)).weights, vnni)
    assert not build.int8_prefill_only(load_files(str(q4k)).weights, no_vnni)
    assert not build.int8_prefill_only(load_files(str(f16)).weights, vnni)
    monkeypatch.setattr(build, "cpu_native_bf16", lambda: False)
    monkeypatch.setattr(q4_kernel, "cpu_flags", lambda: vnni)
    lin = _core(q4k).model.layers[0].w_gate_up
    assert lin.kernel == "gguf" and lin.blocks.gemm_min_rows == 17 and lin.blocks.matrix.gemm8
    assert _core(q4k, large_batch_dtype="float32").model.layers[0].w_gate_up.blocks.gemm_min_rows == 0
    assert _core(f16).model.layers[0].w_gate_up.blocks.gemm_min_rows == 0
    monkeypatch.setattr(q4_kernel, "cpu_flags", lambda: no_vnni)
    assert _core(q4k).model.layers[0].w_gate_up.blocks.gemm_min_rows == 0


def test_steps_above_small_batch_rows_take_the_prefill_path(kernels, tmp_path):
    """With bfloat16 prefill (large_batch_dtype auto on a CPU with native bfloat16) Linear hands the
    block matrix small_batch_rows + 1 as gemm_min_rows: a 16-row step (decode of 16 streams) is the
    per-row kernels' product bit for bit, a 17-row one the prefill path's (the per-row kernels where
    the build has no such path); small_batch_rows 0 or float32 prefill keep the per-row kernels at
    every row count, and so does the head (float32 logits)."""
    from kvserve.models.build import cpu_native_bf16

    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf", n_embd=256, n_ff=512, qtype="Q4_K", seed=3)
    model = _core(path, large_batch_dtype="bfloat16").model
    lin = model.layers[0].w_gate_up
    assert lin.kernel == "gguf" and lin.blocks.gemm_min_rows == 17 and model.output.blocks.gemm_min_rows == 0
    auto = _core(path).model.layers[0].w_gate_up.blocks.gemm_min_rows
    assert auto == (17 if cpu_native_bf16() else 0)
    assert _core(path, large_batch_dtype="float32").model.layers[0].w_gate_up.blocks.gemm_min_rows == 0
    x = torch.randn(17, 256, generator=torch.Generator().manual_seed(0))
    m = lin.blocks._m
    assert torch.equal(lin.forward(x[:16]), m.mm(x[:16], 0))
    assert torch.equal(lin.forward(x), m.mm(x, 1))
    assert lin.blocks.has_gemm == (ggml_kernel.ensure_built().GEMM == "avx512bf16")
    if lin.blocks.has_gemm:
        # the int8 path's Q4_K products are the per-row kernels' bits (exact super-block sums, one float
        # chain: ggml_cpu.cpp's KChain); the bfloat16 path's are not
        assert torch.equal(lin.forward(x)[:16], m.mm(x[:16], 0)) == (m.gemm8 and lin.blocks.gemm_path != "bf16")
    assert _core(path, small_batch_rows=0, large_batch_dtype="bfloat16").model.layers[0].w_gate_up.blocks \
        .gemm_min_rows == 0


def test_turned_off_or_explicit_dense_dequantizes_as_before(kernels, tmp_path, monkeypatch):
    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf", n_embd=256, n_ff=512, qtype="Q8_0", seed=2)
    assert _core(path, dtype="float32").model.layers[0].wqkv.kernel == "dense"
    assert _core(path, cpu_kernel="int8").model.layers[0].wqkv.kernel == "int8"
    monkeypatch.setenv("KVSERVE_GGML_KERNELS", "0")
    assert _core(path).model.layers[0].wqkv.kernel == "int8"


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_0_and_q4_1_stay_blocks_and_decode_on_them(kernels, tmp_path, monkeypatch, qtype):
    """Q4_0/Q4_1 matrices keep the file's bytes like every other type (the eager path multiplies them
    with the block products: no unpacked nibbles, no int4 or dense copy); the native decode step
    repacks them into its own 4-bit layout (decode_native.q4_tiles), whose product equals the block
    product's within the two roundings of the activations, except on the AVX512 build for Q4_0 by
    default and for both with KVSERVE_Q4_REPACK=0 (it multiplies the file's blocks; =1 repacks both);
    with the block kernels off they are unpacked for torch's int4 kernel, as before."""
    from kvserve.models import decode_native

    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf", n_embd=256, n_ff=512, qtype=qtype, embd_qtype="Q8_0", seed=2)
    core = _core(path)
    lins = core.model.projections()
    assert all(lin.kernel == "gguf" and lin.weight is None and not lin.has_native_weights for lin in lins)
    assert all(set(lin.blocks.types) == {qtype} and all(_mapped(p) for p in lin.blocks.parts) for lin in lins)
    assert core.model.output.kernel == "gguf"
    mod = decode_native.load_cached()
    gate_up = core.model.layers[1].w_gate_up.blocks
    monkeypatch.setenv("KVSERVE_Q4_REPACK", "0")
    assert decode_native.q4_tiles(gate_up, "tile16", "avx512") is None
    assert decode_native.q4_tiles(gate_up, "pair", "avx2") is not None  # the AVX2 build always repacks
    monkeypatch.delenv("KVSERVE_Q4_REPACK")
    assert (decode_native.q4_tiles(gate_up, "tile16", "avx512") is None) == (qtype == "Q4_0")
    monkeypatch.setenv("KVSERVE_Q4_REPACK", "1")
    tiles = decode_native.q4_tiles(gate_up, mod.LAYOUT, mod.ISA)
    assert tiles[0].shape == (1024, 128)  # 4 bits a weight, as the file's nibbles
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    ref = gate_up.mm(x)
    got = mod.proj_mm(x, *tiles)
    assert (got - ref).abs().max().item() < 0.01 * ref.abs().max().item()  # a wrong packing: O(1)
    monkeypatch.setenv("KVSERVE_GGML_KERNELS", "0")
    core = _core(path)
    assert all(lin.kernel == "int4" and lin.has_native_weights for lin in core.model.projections())
    assert core.model.output.kernel == "w8a8"  # a Q4 head: unpacked nibbles, as before


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_prefill_runs_on_the_file_blocks(kernels, tmp_path, qtype):
    """By default Q4_0/Q4_1 projections are the file's blocks on the block kernels at every row count
    (kernel "gguf", the prefill path above small_batch_rows rows). Under ``--cpu-kernel int4`` they
    keep torch's int4 kernel up to small_batch_rows rows; larger steps run
    the file's blocks (Weight.q4_raw, a view of the mapping) on the block kernels' prefill path where
    the build has it, with no dense copy (a bfloat16 copy as before where it has not). Prefill logits
    agree with the float32 model of the dequantized weights as the other types' do."""
    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf", n_embd=256, n_ff=512, n_head=4, n_head_kv=2, qtype=qtype,
                                     embd_qtype="Q8_0", seed=21)
    gemm = ggml_kernel.ensure_built().GEMM == "avx512bf16"
    default = _core(path, large_batch_dtype="bfloat16").model.projections()
    assert all(lin.kernel == "gguf" and lin.weight is None and lin.blocks.gemm_min_rows == 17 for lin in default)
    packed = _core(path, large_batch_dtype="bfloat16", cpu_kernel="int4")
    dense = _core(path, dtype="float32")
    lins = packed.model.projections()
    assert all(lin.kernel == "int4" for lin in lins)
    if gemm:
        assert all(lin.weight is None and lin.large_blocks.types == [qtype] * len(lin.large_blocks.types)
                   and all(_mapped(p) for p in lin.large_blocks.parts) for lin in lins)
    else:
        assert all(lin.large_blocks is None and lin.weight.dtype == torch.bfloat16 for lin in lins)
    f32 = _core(path, large_batch_dtype="float32", cpu_kernel="int4").model.layers[0].wqkv
    assert f32.large_blocks is None and f32.weight.dtype == torch.float32
    lin = packed.model.layers[0].w_gate_up
    x = torch.randn(17, 256, generator=torch.Generator().manual_seed(1))
    if gemm:
        assert torch.equal(lin.forward(x), lin.large_blocks.mm(x))
        small = lin.forward(x[:16])
        lin.large_blocks, kept = None, lin.large_blocks
        assert torch.equal(small, lin.forward(x[:16]))  # 16 rows: the int4 kernel, as without the blocks
        lin.large_blocks = kept
    p = SamplingParams(n_predict=40, ignore_eos=True, temperature=0.0)
    seq = PROMPT + LLM(dense).generate([PROMPT], p)[0].token_ids  # 52 rows: the prefill path
    a, b = _logits(packed, seq), _logits(dense, seq)
    assert (a - b).abs().max().item() < 0.04 * b.abs().max().item()
    same = (a.argmax(-1) == b.argmax(-1)).sum().item()
    print(qtype, "top-1 agreement", same, "of", len(seq))
    assert same >= 48


def test_raw_weight_dequantizes_to_gguf_values(tmp_path):
    import gguf

    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf", n_embd=256, n_ff=512, qtype="Q4_K", embd_qtype="Q6_K", seed=4)
    loaded = load_gguf(path)
    for t in gguf.GGUFReader(path).tensors:
        w = loaded.weights[t.name]
        if t.tensor_type.name in ("Q4_K", "Q6_K"):
            assert w.raw is not None and w.dense is None and w.source_type == t.tensor_type.name
            assert np.array_equal(w.to_dense(), gguf.quants.dequantize(np.array(t.data), t.tensor_type)), t.name


def test_a_type_without_kernel_is_dequantized_at_load():
    """IQ2_XXS (no block kernel): float32 at load, as before."""
    import gguf

    qt = gguf.GGMLQuantizationType.IQ2_XXS
    data = np.random.default_rng(0).integers(0, 256, size=(4, 66), dtype=np.uint8)
    data[:, :2] = np.float16(0.01).reshape(1, 1).view(np.uint8)  # finite scales
    w = _tensor_to_weight(TensorInfo("blk.0.ffn_up.weight", (256, 4), int(qt), 0, data.size), data.reshape(-1))
    assert w.raw is None and w.dense.dtype == np.float32 and w.dense.shape == (4, 256)
    assert np.array_equal(w.dense, gguf.quants.dequantize(data, qt).reshape(4, 256))


def test_rows_that_are_not_whole_blocks_are_refused():
    data = np.zeros(4 * 144, np.uint8)
    with pytest.raises(ModelLoadError) as e:
        _tensor_to_weight(TensorInfo("blk.3.attn_q.weight", (300, 4), 12, 0, data.size), data)
    assert str(e.value) == ("tensor 'blk.3.attn_q.weight' of type Q4_K: shape [300, 4] is not whole 256-value "
                            "blocks of 144 bytes (576 bytes in the file)")


def test_nan_scale_in_raw_blocks_is_refused(tmp_path):
    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf", n_embd=256, n_ff=512, qtype="Q6_K", seed=4)
    import gguf

    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_down.weight")
    raw = bytearray(path.read_bytes())
    off = int(t.data_offset) + 208  # the first block's float16 d
    raw[off:off + 2] = np.array([np.nan], np.float16).view(np.uint8).tobytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ModelLoadError, match=r"tensor 'blk.1.ffn_down.weight' has 1 NaN/Inf values"):
        load_gguf(bad)


def test_memory_accounting_counts_the_blocks(kernels, tmp_path):
    """parallel.model_bytes (the plan's weights figure) and the draft's _tensor_bytes count the GGUF
    blocks the Linear layers multiply: every matrix's file bytes, plus the float32 embedding and norms."""
    from kvserve.engine.draft import _tensor_bytes
    from kvserve.engine.parallel import model_bytes
    from kvserve.loaders.gguf import read_gguf_header

    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf", n_embd=256, n_ff=512, qtype="Q8_0", seed=2)
    model = _core(path).model
    _, infos = read_gguf_header(str(path))
    matrices = sum(t.n_bytes for t in infos if len(t.shape) == 2 and t.name != "token_embd.weight")
    assert sum(lin.blocks.nbytes for lin in [*model.projections(), model.output]) == matrices
    norms = sum(t.n_bytes for t in infos if len(t.shape) == 1)
    embd = next(t.n_bytes for t in infos if t.name == "token_embd.weight")  # kept as the file's blocks
    assert model.tok_embd is None and model.embedding_nbytes() == embd
    assert model_bytes(model) == matrices + norms + embd
    assert _tensor_bytes(model) >= matrices + norms + embd


@pytest.mark.parametrize("qtype,tied", [("Q8_0", False), ("Q4_K", False), ("Q6_K", True), ("F16", True)])
def test_embedding_stays_packed_and_rows_are_dequantized_on_lookup(kernels, tmp_path, qtype, tied):
    """token_embd keeps the file's blocks (no float table); embed() returns exactly the dequantized
    table's rows (gguf's values), repeated ids included; tied, the head multiplies the same blocks
    and the embedding adds no bytes; an id out of range is an IndexError."""
    import gguf

    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf", n_embd=256, n_ff=512, qtype=qtype, seed=4,
                                     tie_embeddings=tied)
    model = _core(path).model
    assert model.tok_embd is None and _mapped(model.tok_embd_raw.raw)
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    table = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(model.tok_embd_raw.shape)
    ids = [0, 7, 7, 300, table.shape[0] - 1]
    rows = model.embed(torch.tensor(ids))
    assert rows.dtype == torch.float32 and rows.shape == (5, 256)
    assert torch.equal(rows, torch.from_numpy(table[ids].astype(np.float32)))
    assert model.embed(torch.tensor([], dtype=torch.long)).shape == (0, 256)
    assert model.embedding_nbytes() == (0 if tied else t.n_bytes)
    with pytest.raises(IndexError):
        model.embed(torch.tensor([table.shape[0]]))


_RSS_PROBE = """
import gc, sys
from pathlib import Path
import torch
from kvserve.config import EngineConfig
from kvserve.engine.core import create_engine_core
from kvserve.models import ggml_kernel
assert ggml_kernel.ensure_built() is not None
def rss():
    return next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines()
                if l.startswith("VmRSS:"))
warm = create_engine_core(sys.argv[2], EngineConfig(n_ctx=256, n_parallel=1))  # the imports a load makes
before = rss()
core = create_engine_core(sys.argv[1], EngineConfig(n_ctx=256, n_parallel=1, cache_ram=0))
gc.collect()
print(before, rss())
"""


def test_memory_estimate_counts_the_blocks_as_resident(kernels, tmp_path):
    """The model manager's estimate (seed 004 Example 5) counts what a Q8_0 model holds after load:
    the file's bytes for the matrices the block kernels multiply (no dense copy) and the embedding
    kept as blocks; within 10% of the VmRSS a load adds (measured in a child process)."""
    import subprocess
    import sys
    from pathlib import Path

    from kvserve.serving.args import parse_args
    from kvserve.serving.manager import ModelSpec
    from kvserve.serving.chat_runner import estimate_runner_memory, gguf_raw_bytes

    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf", n_layer=6, n_embd=1024, n_head=8, n_head_kv=2, n_ff=4096,
                                     qtype="Q8_0", seed=3)
    size = path.stat().st_size
    raw_bytes, raw_values = gguf_raw_bytes(str(path))
    assert raw_values == 6 * (1024 * 1536 + 1024 * 1024 + 3 * 1024 * 4096) + 2 * 1024 * len(tinymodel.tiny_vocab()[0])
    assert raw_bytes == raw_values // 32 * 34
    # no host tier (--cache-ram 0): the pool of a host tier is reserved, not resident, but the first
    # rows written to it fault in huge pages (~12 MiB here); the estimate counts its limit apart
    est = estimate_runner_memory(parse_args(["-c", "256", "-np", "1", "--cache-ram", "0"], environ={}),
                                 ModelSpec("m", str(path)))
    norms = 4 * 1024 * 13  # the F32 norms: the file's bytes and their float32 copy
    # where the native decode step runs, its int8 tiles of the small Q8_0 head (301 rows padded to 304)
    from kvserve.serving.chat_runner import _native_step_expected, model_shape, native_copy_bytes

    native = native_copy_bytes(str(path)) if _native_step_expected(
        parse_args(["-c", "256"], environ={}).engine_config(), model_shape(str(path))[0]) else 0
    assert native in (0, 304 * (1024 + 64))
    assert est.weights == size + norms + native
    small = tinymodel.write_tiny_gguf(tmp_path / "small.gguf", qtype="Q8_0")
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(path), str(small)], capture_output=True, text=True, timeout=300,
                         cwd=str(Path(__file__).resolve().parents[2]))
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(int, out.stdout.split()[-2:])
    added = after - before
    print(f"estimate weights {est.weights >> 20} + kv {est.kv >> 20} + compute {est.compute >> 20} MiB, "
          f"load added {added >> 20} MiB of RSS")
    # weights and the KV pool are resident after load (measured: 93 + 1.5 MiB estimated, 94-96 MiB
    # added; the previous formula, a float32 copy of every matrix, said 465 MiB); the compute term
    # (one batch's activations) bounds it from above
    assert abs(added - (est.weights + est.kv)) <= 0.1 * added
    assert added <= est.weights + est.kv + est.compute


@pytest.mark.parametrize("mode", ["read", "mmap"])
def test_weight_memory_modes_hold_the_files_bytes(tmp_path, monkeypatch, mode):
    """--no-mmap ("read"): the tensors' bytes are read into private anonymous memory, 2 MiB-aligned
    and advised MADV_HUGEPAGE, equal to the file's, the header's bytes never read; --mmap: views of
    the file's mapping. Both give the same weights; KVSERVE_MMAP=1 / 0 picks the default mode."""
    import mmap

    from kvserve.loaders import gguf as gl

    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf", n_embd=256, n_ff=512, qtype="Q4_K", embd_qtype="Q6_K", seed=4)
    monkeypatch.setattr(gl, "_WEIGHT_MEMORY", mode)
    loaded = load_gguf(path)
    data = Path(path).read_bytes()
    _, infos = gl.read_gguf_header(str(path))
    by_name = {t.name: t for t in infos}
    raws = {n: w.raw for n, w in loaded.weights.items() if w.raw is not None}
    assert set(raws) >= {"blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"}
    for name, raw in raws.items():
        t = by_name[name]
        assert raw.tobytes() == data[t.offset: t.offset + t.n_bytes], name
        assert not raw.flags.writeable and _mapped(raw)
        base = raw
        while isinstance(base.base, np.ndarray):
            base = base.base
        if mode == "read":
            assert isinstance(getattr(base.base, "obj", base.base), mmap.mmap) and not isinstance(base, np.memmap)
            assert (raw.ctypes.data - t.offset) % (2 << 20) == 0  # at its file offset in a 2 MiB-aligned buffer
        else:
            assert isinstance(base, np.memmap)
    # the environment picks the default mode
    monkeypatch.setattr(gl, "_WEIGHT_MEMORY", "auto")
    monkeypatch.setenv("KVSERVE_MMAP", "1")
    assert gl._weight_memory() == "mmap"
    monkeypatch.setenv("KVSERVE_MMAP", "0")
    assert gl._weight_memory() == "read"
    monkeypatch.delenv("KVSERVE_MMAP")
    from kvserve.loaders.weight_read import thp_available

    assert gl._weight_memory() == ("read" if thp_available() else "mmap")
    with pytest.raises(ValueError, match="auto, read or mmap"):
        gl.set_weight_memory("huge")


def test_read_mode_buffer_is_huge_page_aligned(tmp_path, monkeypatch):
    """The read buffer starts on a 2 MiB boundary (every whole 2 MiB of weights can be one huge page)
    and a file shorter than its tensor table still fails as truncated, naming the tensor."""
    from kvserve.loaders import gguf as gl

    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf", n_embd=256, n_ff=512, qtype="Q4_K", seed=4)
    _, infos = gl.read_gguf_header(str(path))
    monkeypatch.setattr(gl, "_WEIGHT_MEMORY", "read")
    buf = gl._weight_bytes(str(path), infos, True)
    assert buf.ctypes.data % (2 << 20) == 0 and len(buf) == Path(path).stat().st_size
    assert isinstance(gl._weight_bytes(str(path), infos, False), np.memmap)  # float32 families: mapped
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(Path(path).read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="truncated|not whole"):
        load_gguf(cut)
