"""The model manager's memory estimate (seed 004 Example 5, issue #29 Build 3): its formula on tiny GGUF files, byte
for byte, and the manager logging it (and, under -m, never refusing a load for it)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from kvserve.errors import UnavailableError
from kvserve.serving.args import parse_args
from kvserve.serving.manager import MIB, MemoryEstimate, ModelManager, ModelSpec
from kvserve.serving import chat_runner as runner_mod
from kvserve.serving.chat_runner import TOKENIZER_BYTES_PER_TOKEN, estimate_runner_memory, native_copy_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tinymodel  # noqa: E402

N_VOCAB = len(tinymodel.tiny_vocab()[0])  # 301


def _q4(tmp_path, **kw) -> Path:
    # 2 layers, n_embd 64, 2 heads of 32 (1 KV head: head_dim 32, as the native step needs), n_ff 128
    return tinymodel.write_tiny_gguf(tmp_path / "q4.gguf", n_layer=2, n_embd=64, n_head=2, n_head_kv=1, n_ff=128,
                                     qtype="Q4_0", **kw)


def test_native_copy_bytes_counts_the_q4_tiles_and_a_small_q8_head(tmp_path, monkeypatch):
    # per layer: q 64x64, k 32x64, v 32x64, o 64x64, gate 128x64, up 128x64, down 64x128 values at 5/8 byte
    per_layer = (64 * 64 + 32 * 64 + 32 * 64 + 64 * 64 + 128 * 64 + 128 * 64 + 64 * 128) * 5 // 8
    assert per_layer == 23040
    from kvserve.models import decode_native

    # the AVX512 build multiplies Q4_0 where the file stores it (no tiles) unless KVSERVE_Q4_REPACK=1
    default = 2 * per_layer if decode_native.q4_repacked("Q4_0", decode_native.cpu_isa()) else 0
    assert default == (0 if decode_native.cpu_isa() == "avx512" else 2 * per_layer)
    assert native_copy_bytes(str(_q4(tmp_path))) == default
    monkeypatch.setenv("KVSERVE_Q4_REPACK", "1")
    assert native_copy_bytes(str(_q4(tmp_path))) == 2 * per_layer  # the Q4_0 output head is not repacked
    tied = tinymodel.write_tiny_gguf(tmp_path / "tied.gguf", n_layer=2, n_embd=64, n_head=2, n_head_kv=1, n_ff=128,
                                     qtype="Q4_0", tie_embeddings=True, embd_qtype="Q8_0")
    # + the tied Q8_0 embedding as the head's int8 tiles: 301 rows padded to 304, 64 bytes + 2 scales of 2 bytes
    assert native_copy_bytes(str(tied)) == 2 * per_layer + 304 * (64 + 4)
    q8 = tinymodel.write_tiny_gguf(tmp_path / "q8.gguf", n_layer=2, qtype="Q8_0")
    assert native_copy_bytes(str(q8)) == 304 * (64 + 4)  # its small Q8_0 head only: projections stay blocks
    assert native_copy_bytes(str(tmp_path)) == 0  # an HF directory


def _args(*extra):
    return parse_args(["-c", "256", "-np", "1", "--cache-ram", "0", *extra], environ={})


def test_estimate_formula_q4_0(tmp_path, monkeypatch):
    """weights = the file + a float32 copy of the norms + the native step's tiles where it runs; never
    less than the file (the Q4_0 blocks were once subtracted twice: a negative estimate)."""
    path = _q4(tmp_path)
    size = path.stat().st_size
    norms = 4 * (2 * (64 + 64) + 64)  # attn_norm and ffn_norm per layer, output_norm: float32 copies
    monkeypatch.setenv("KVSERVE_NATIVE_DECODE", "0")
    est = estimate_runner_memory(_args(), ModelSpec("m", str(path)))
    assert est.weights == size + norms
    assert est.kv == 2 * 2 * 1 * 32 * 256 * 2  # K and V, 2 layers, 1 KV head of 32, 256 tokens, f16
    assert est.tokenizer == TOKENIZER_BYTES_PER_TOKEN * N_VOCAB == 512 * 301
    assert est.cache == 0
    assert est.resident == est.weights + est.kv + est.tokenizer
    assert est.total == est.resident + est.compute
    monkeypatch.delenv("KVSERVE_NATIVE_DECODE")
    from kvserve.models import decode_native

    tiles = decode_native.q4_repacked("Q4_0", decode_native.cpu_isa())  # not on AVX512: the file's blocks
    native = 46080 if tiles and runner_mod._native_step_expected(_args().engine_config(),
                                                                 runner_mod.model_shape(str(path))[0]) else 0
    assert estimate_runner_memory(_args(), ModelSpec("m", str(path))).weights == size + norms + native
    assert estimate_runner_memory(_args("--dtype", "float32"), ModelSpec("m", str(path))).weights == \
        4 * runner_mod.model_shape(str(path))[2]  # a dense float32 model: no file pages, no tiles


def test_native_step_expected_follows_the_flags(tmp_path):
    cfg_m = runner_mod.model_shape(str(_q4(tmp_path)))[0]
    from kvserve.models import decode_native

    here = decode_native.unavailable_reason() is None
    assert runner_mod._native_step_expected(_args().engine_config(), cfg_m) is here
    for flags in (["--dtype", "float32"], ["-ctk", "q8_0"], ["--compile"]):
        assert runner_mod._native_step_expected(_args(*flags).engine_config(), cfg_m) is False, flags
    head16 = tinymodel.write_tiny_gguf(tmp_path / "h16.gguf", n_embd=64, n_head=4, n_head_kv=2, qtype="Q4_0")
    assert runner_mod._native_step_expected(_args().engine_config(), runner_mod.model_shape(str(head16))[0]) is False


def test_summary_text():
    e = MemoryEstimate(weights=638 * MIB, kv=128 * MIB, compute=320 * MIB, cache=4562 * MIB, tokenizer=24 * MIB)
    assert e.summary() == ("estimate 790 MiB resident (weights 638, KV 128, tokenizer 24), compute 320 MiB, "
                           "host cache up to 4562 MiB")


class _Runner:
    measured_bytes = 0

    def close(self):
        pass


def _manager(estimate, enforce, events, loader=None):
    return ModelManager(loader or (lambda spec: _Runner()), estimate=estimate, enforce_memory=enforce,
                        mem_available=lambda: 100 * MIB,
                        on_event=lambda t, action, name, reason: events.append((action, name, reason)))


def test_manager_logs_the_estimate_and_under_pinned_mode_never_refuses():
    big = MemoryEstimate(weights=1000 * MIB, kv=24 * MIB, tokenizer=1 * MIB)

    async def main():
        events = []
        m = _manager(lambda spec: big, False, events)
        lease = await m.acquire(ModelSpec("big", pinned=True))
        lease.release()
        assert events[0] == ("load", "big", "estimate 1025 MiB resident (weights 1000, KV 24, tokenizer 1), "
                                            "compute 0 MiB, host cache up to 0 MiB")
        assert m.get("big").runner is not None
        events.clear()
        m2 = _manager(lambda spec: big, True, events)
        with pytest.raises(UnavailableError, match=r"requires more system memory \(1025 MiB\)"):
            await m2.acquire(ModelSpec("big"))
        # an estimate that fails: left to the loader under -m (its own error), a failed load otherwise
        def broken(spec):
            raise OSError("header unreadable")

        m3 = _manager(broken, False, events)
        lease = await m3.acquire(ModelSpec("x", pinned=True))
        lease.release()
        assert ("load", "x", "") in events

    asyncio.run(main())


def test_native_copy_bytes_equals_what_the_native_step_packs(tmp_path, monkeypatch):
    """The formula against the step's own packing functions (decode_native.q4_tiles, pack_q8) on the
    tiny model: if their layouts change, this fails and the estimate is updated with them."""
    from kvserve.models import decode_native, ggml_kernel
    from kvserve.models.build import build_model, load_files

    if ggml_kernel.ensure_built() is None:
        pytest.skip("the GGUF block kernels cannot be built here")
    monkeypatch.setenv("KVSERVE_Q4_REPACK", "1")  # the tiles on every build (AVX512 keeps Q4_0 blocks by default)
    path = tinymodel.write_tiny_gguf(tmp_path / "tied.gguf", n_layer=2, n_embd=64, n_head=2, n_head_kv=1, n_ff=128,
                                     qtype="Q4_0", tie_embeddings=True, embd_qtype="Q8_0")
    model = build_model(load_files(str(path)), _args().engine_config(), 256)
    packed = 0
    for lin in model.projections():
        tiles = decode_native.q4_tiles(lin.blocks, "tile16")
        packed += sum(t.nbytes for t in tiles)
    head = model.output.blocks
    assert head.types == ["Q8_0"] and head.nbytes <= decode_native.SMALL_HEAD_BYTES
    packed += sum(t.nbytes for t in decode_native.pack_q8(head.dequantize(), "tile16"))
    assert packed == native_copy_bytes(str(path)) == 2 * 23040 + 304 * 68
