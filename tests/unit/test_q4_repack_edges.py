"""Edges of the repacked Q4_0 matrices (ggml_cpu.cpp's Matrix(repack=True), q4_repack.h, the file pages
given back by kvserve.loaders.weight_read.give_back) and of Q8_0's one-chain kernels (ggml_gemm8.h's
q80_x8 / q80_rows) that the kernel tests in test_ggml_kernel.py leave out: callers that build their own
Matrix over the same weights, rows ending at an unreadable page at every small K and row count, and
the loader's bookkeeping of the buffers it registers."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from kvserve.loaders.weights import Weight
from kvserve.models import ggml_kernel
from test_ggml_kernel import _before_a_guard_page, mod, random_rows, reference  # noqa: F401 - mod: a fixture

gguf = pytest.importorskip("gguf")


def _moe(rng, n_expert=4, n_embd=128, n_ff=64, top_k=2, qtype="Q4_0"):
    """A MoE layer (kvserve.models.moe.MoE) of random ``qtype`` experts stacked as a GGUF file stacks
    them (raw [E, rows, row bytes]), on the block kernels; its router float32."""
    from kvserve.models.moe import MoE

    def stacked(rows, k):
        raw = np.stack([random_rows(qtype, rows, k, rng) for _ in range(n_expert)])
        return Weight((n_expert, rows, k), raw=raw, source_type=qtype)

    router = Weight((n_expert, n_embd), dense=rng.standard_normal((n_expert, n_embd)).astype(np.float32))
    lin = dict(dtype=torch.float32, device="cpu", kernel="auto", small_max_rows=0, large_dtype=torch.float32,
               native_q4=False)
    return MoE(router, stacked(n_ff, n_embd), stacked(n_ff, n_embd), stacked(n_embd, n_ff), top_k, True, lin)


@pytest.mark.parametrize("repack", ["1", "0"])
def test_one_row_experts_have_the_batch_rows_bits(mod, repack, monkeypatch):
    """A MoE layer's one-row step (OneRowExperts: the chosen experts' gate|up in one Matrix made per
    step) gives the bits of the same row in a multi-row step (combine_experts: each expert's own
    Linear), as its docstring says, also where the experts' Q4_0 blocks were repacked at load
    (KVSERVE_Q4_0_REPACK, the default): the per-step matrix must not multiply the file's layout with
    the other kernel while every other route multiplies the repacked copy (nor fault the file pages given
    back at load in again). The router is left out (its F.linear is not batch invariant itself): both
    routes get the same experts and weights."""
    monkeypatch.setenv("KVSERVE_Q4_0_REPACK", repack)
    rng = np.random.default_rng(29)
    moe = _moe(rng)
    assert moe.one_row is not None
    want = repack == "1" and mod.ISA == "avx512"
    assert all(lin.blocks.repacked == [want, want] for lin in moe.gate_up)
    from kvserve.models.moe import combine_experts

    x = torch.from_numpy(rng.standard_normal((6, 128)).astype(np.float32))
    # the same experts and weights for both (the router's F.linear is not batch invariant itself)
    logits = torch.from_numpy(rng.standard_normal((6, 4)).astype(np.float32))
    w, idx = torch.topk(torch.softmax(logits, -1), 2, -1)
    many = combine_experts(x, idx, w, 4, moe._expert)
    for i in range(6):
        seen = []

        def act(gu):
            seen.append(gu.clone())
            return moe._act(gu)

        one = moe.one_row(x[i:i + 1], idx[i:i + 1], w[i:i + 1], act)
        assert torch.equal(one[0], many[i]), (i, float((one[0] - many[i]).abs().max()))
        # the gate|up rows themselves (the down product's q8_0 activations round most differences away)
        want = torch.cat([moe.gate_up[e](x[i:i + 1]) for e in sorted(idx[i].tolist())])
        assert torch.equal(seen[0], want), (i, float((seen[0] - want).abs().max()))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0"])
def test_rows_ending_at_a_guard_page_every_small_k_and_row_count(mod, name):
    """Q8_0's q80_x8 (one row) and q80_rows (2+ rows) and Q4_0's kernels (repacked or not) read no
    byte past the last weight row: rows ending just before an unreadable page, 1..17 of them, K = 32
    (one block), 64, 96 (odd block counts), 288 (9 blocks), on 1 and 3 threads, M = 1..5, 9, 17 and 70
    activation rows (past the 64-row chunks): no fault, and row i of each product equals the one-row
    product bit for bit."""
    rng = np.random.default_rng(zlib.crc32(name.encode()) + 77)
    keep: list = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            for k in (32, 64, 96, 288):
                for n in range(1, 18):
                    raw = _before_a_guard_page(random_rows(name, n, k, rng), keep)
                    mat = ggml_kernel.BlockMatrix(mod, [(raw, name)], k, repack=True)
                    x = torch.from_numpy(rng.standard_normal((70, k)).astype(np.float32))
                    one = torch.cat([mat.mm(x[i:i + 1]) for i in range(70)])
                    for m in (2, 3, 4, 5, 9, 17, 70):
                        assert torch.equal(mat.mm(x[:m]), one[:m]), (name, threads, k, n, m)
                    ref, bound = reference(x.numpy(), np.ascontiguousarray(raw), name)
                    err = np.abs(one.numpy() - ref)
                    assert (err <= 2e-6 * bound + 1e-30).all(), (name, k, n, float((err / bound).max()))
    finally:
        torch.set_num_threads(before)


def test_a_file_renamed_over_the_path_after_the_read_is_not_mapped_in(mod, tmp_path):
    """The loader's read buffer is registered for give_back with the identity of the file it read
    (WeightRead.ident), not of whatever the path names when it registers: a new file renamed over the
    path just after the read (after the loader's changed() check) must not be mapped over the bytes
    read. Here the rename lands between ``result()`` and the registration; give_back then gives
    nothing back and the part keeps the old file's bytes."""
    from types import SimpleNamespace

    from kvserve.loaders import gguf as gguf_loader
    from kvserve.loaders import weight_read

    rng = np.random.default_rng(5)
    k, n = 2048, 64
    old = random_rows("Q4_0", n, k, rng)
    new = random_rows("Q4_0", n, k, rng)
    path, other = tmp_path / "m.gguf", tmp_path / "new.gguf"
    pad = bytes(4096)
    path.write_bytes(pad + old.tobytes() + pad)
    other.write_bytes(pad + new.tobytes() + pad)
    r = weight_read.WeightRead(str(path), 0)
    result = r.result

    def result_then_replaced(start=None):
        view = result(start)
        other.replace(path)  # the race: after the read's checks, before the registration
        return view

    r.result = result_then_replaced
    buf = gguf_loader._finish_read(r, [SimpleNamespace(offset=4096)])
    part = buf[4096:4096 + old.nbytes].reshape(n, -1)
    assert np.array_equal(part, old)
    assert weight_read.give_back(part) == 0
    assert np.array_equal(part, old)


def test_a_tied_heads_repacked_bytes_stay_private(mod, tmp_path):
    """A part given back from the loader's read buffer reads the file's pages again (a file truncated
    under the server would make such a read die of SIGBUS, as with --mmap). The parts read after the
    load are a tied head's (the embedding lookup reads its rows every step): the families build that
    head with ``tied`` (BlockMatrix ``give_back=False``), so its bytes stay in the private buffer. Here
    in a child process: the tied part is repacked, nothing given back, the file truncated, its rows
    still read (and the untied part, given back, says so)."""
    import subprocess
    import sys
    import textwrap

    if mod.ISA != "avx512":
        pytest.skip("nothing is repacked (given back) in the AVX2 build")
    script = textwrap.dedent(f"""
        import os, sys, numpy as np
        from kvserve.loaders import weight_read
        from kvserve.models import ggml_kernel
        mod = ggml_kernel.ensure_built()
        rng = np.random.default_rng(1)
        n, k = 64, 2048
        raw = rng.integers(0, 256, size=(2 * n, k // 32 * 18), dtype=np.uint8)
        raw[:, ::18] = 0; raw[:, 1::18] = 0x20
        path = {str(tmp_path / "t.gguf")!r}
        open(path, "wb").write(bytes(4096) + raw.tobytes() + bytes(4096))
        r = weight_read.WeightRead(path, 0); r.finish(1)
        buf = np.frombuffer(r.result(), dtype=np.uint8)
        weight_read.register_file_view(buf, path, "read", r.ident)
        rows = buf[4096:4096 + raw.nbytes].reshape(2 * n, -1)
        tied, other = rows[:n], rows[n:]
        m = ggml_kernel.BlockMatrix(mod, [(tied, "Q4_0")], k, repack=True, give_back=False)
        assert m.repacked == [True] and m.given_back == 0
        o = ggml_kernel.BlockMatrix(mod, [(other, "Q4_0")], k, repack=True)
        assert o.repacked == [True] and o.given_back > 0
        os.truncate(path, 0)
        assert np.array_equal(tied, raw[:n])  # the embedding lookup's read: private memory, no SIGBUS
        print("ok")
    """)
    import os
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root}
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert (p.returncode, p.stdout.strip()) == (0, "ok"), p.stderr[-2000:]


def test_no_memory_for_the_repacked_copy_keeps_the_file_layout(mod, tmp_path):
    """Where the repacked copy's memory cannot be had (here: an address-space limit just above what the
    child process uses), Matrix(repack=True) keeps the part in the file's layout (repacked False, nothing
    given back) and its products are the file layout's, bit for bit; no crash, no exception."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent("""
        import resource, numpy as np, torch
        torch.set_num_threads(1)
        from kvserve.models import ggml_kernel
        mod = ggml_kernel.ensure_built()
        n, k = 65536, 2048  # 72 MiB of Q4_0
        raw = np.zeros((n, k // 32 * 18), np.uint8)
        raw[:, 1::18] = 0x20  # d = 2^-7
        raw[:, 2::18] = np.arange(n, dtype=np.uint8)[:, None]
        x = torch.ones((3, k))
        plain = ggml_kernel.BlockMatrix(mod, [(raw, "Q4_0")], k).mm(x)
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) for l in f if l.startswith("VmSize")) << 10
        resource.setrlimit(resource.RLIMIT_AS, (vm + (48 << 20), resource.RLIM_INFINITY))
        m = ggml_kernel.BlockMatrix(mod, [(raw, "Q4_0")], k, repack=True)
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        print(m.repacked, m.given_back, bool(torch.equal(m.mm(x), plain)))
    """)
    root = str(Path(__file__).resolve().parents[2])
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=root,
                       env={**os.environ, "PYTHONPATH": root})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["[False]", "0", "True"]


def test_repacked_matrices_cost_no_vmas_each(mod):
    """Each repacked matrix's copy is an anonymous mapping of its own: a small one (under 2 MiB: a MoE
    expert's) takes no madvise, so its mapping merges with its neighbours instead of adding VMAs (the
    posix_memalign + MADV_HUGEPAGE / MADV_NOHUGEPAGE copy cost two each; a Q4_0 MoE file's thousands of
    expert matrices, with give_back's file mappings, came near vm.max_map_count, past which every mmap
    in the process fails), and freeing the matrices unmaps them (RSS back, VMAs back)."""
    if mod.ISA != "avx512":
        pytest.skip("nothing is repacked in the AVX2 build")
    import gc

    def vmas():
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    rng = np.random.default_rng(11)
    raw = random_rows("Q4_0", 32, 2048, rng)
    gc.collect()
    before = vmas()
    mats = [ggml_kernel.BlockMatrix(mod, [(raw, "Q4_0")], 2048, repack=True) for _ in range(200)]
    assert all(m.repacked == [True] for m in mats)
    assert vmas() - before <= 20, vmas() - before
    x = torch.from_numpy(rng.standard_normal((2, 2048)).astype(np.float32))
    assert all(torch.equal(m.mm(x), mats[0].mm(x)) for m in mats[1:])
    del mats
    gc.collect()
    assert vmas() - before <= 5


def test_a_part_given_back_twice_and_repacked_again_reads_the_same(mod, tmp_path):
    """The same part given back twice (two models of one loaded file, a reload over the same read
    buffer): the second give_back maps the same file pages again (the same byte count), the bytes stay
    the file's, and a second repacked matrix made from the given-back pages multiplies the same bits."""
    from kvserve.loaders import weight_read

    if mod.ISA != "avx512":
        pytest.skip("nothing is repacked (given back) in the AVX2 build")
    rng = np.random.default_rng(17)
    k, n = 2048, 64
    raw = random_rows("Q4_0", n, k, rng)
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(1000) + raw.tobytes() + bytes(1000))
    r = weight_read.WeightRead(str(path), 0)
    r.finish(1)
    buf = np.frombuffer(r.result(), dtype=np.uint8)
    weight_read.register_file_view(buf, str(path), "read", r.ident)
    part = buf[1000:1000 + raw.nbytes].reshape(n, -1)
    a = ggml_kernel.BlockMatrix(mod, [(part, "Q4_0")], k, repack=True)
    b = ggml_kernel.BlockMatrix(mod, [(part, "Q4_0")], k, repack=True)
    assert a.given_back > 0 and b.given_back == a.given_back
    assert weight_read.give_back(part) == a.given_back
    assert np.array_equal(part, raw)
    x = torch.from_numpy(rng.standard_normal((5, k)).astype(np.float32))
    assert torch.equal(a.mm(x), b.mm(x))
    del a
    assert torch.equal(b.mm(x), ggml_kernel.BlockMatrix(mod, [(raw, "Q4_0")], k, repack=True).mm(x))
