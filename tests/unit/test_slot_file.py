"""Slot files: save/erase/restore round trip on the tiny model, and every kind of bad file."""

import os
import struct

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.request import Request, SamplingParams
from kvserve.engine.slot_file import HEADER, SlotFileError
from kvserve.models.build import load_files


def core_for(path, **kw) -> EngineCore:
    kw.setdefault("n_ctx", 1024)
    kw.setdefault("n_parallel", 2)
    kw.setdefault("dtype", "float32")
    return EngineCore(load_files(path), EngineConfig(**kw))


def run(core, ids, slot=0, n_predict=4):
    r = Request(f"r-{torch.randint(0, 1 << 30, (1,)).item()}", list(ids),
                SamplingParams(temperature=0, n_predict=n_predict, ignore_eos=True), priority_slot=slot)
    core.add_request(r)
    outs = []
    while not outs or not outs[-1].finished:
        outs += [o for o in core.step() if o.request_id == r.request_id]
    t = outs[-1].timings
    return t.cache_n, t.prompt_n, [x for o in outs for x in o.new_token_ids]


PRE = list(range(20, 48))  # 28 tokens, as seed Example 11
Q = PRE + [60, 61, 62, 63, 64, 65, 66, 67, 68, 69]  # 38 tokens


@pytest.fixture
def saved(tiny_gguf, tmp_path):
    core = core_for(tiny_gguf)
    run(core, PRE, n_predict=0)
    path = str(tmp_path / "prefix.bin")
    res = core.save_slot(0, path)
    return core, path, res


def test_save_erase_restore_round_trip(tiny_gguf, saved):
    core, path, res = saved
    c = core.model_config
    assert res["n_saved"] == 28
    assert res["n_written"] == os.path.getsize(path) == 40 + 4 * 28 + 2 * c.n_layer * 28 * c.n_head_kv * c.head_dim * 2
    assert core.erase_slot(0) == {"n_erased": 28}
    # erase drops the slot's blocks from the host tier and the prefix index too (llama-server: nothing reused)
    assert run(core, Q)[:2] == (0, 38)
    fresh = core_for(tiny_gguf, cache_ram=0)
    ref = run(fresh, Q)
    assert fresh.erase_slot(0)["n_erased"] == 38 + 3  # prompt + generated tokens fed back (the last never is)
    r = fresh.restore_slot(0, path)
    assert (r["n_restored"], r["n_read"]) == (28, res["n_written"])
    assert fresh.slot_tokens(0) == PRE
    warm = run(fresh, Q)
    assert warm[:2] == (28, 10)
    assert warm[2] == ref[2]  # exact: float32 weights, the file holds the cache's own f16 rows


def test_restore_into_a_new_process_and_repeat_rule(tiny_gguf, saved):
    _, path, _ = saved
    other = core_for(tiny_gguf, cache_ram=0)
    other.restore_slot(1, path)
    # identical prompt: all but the last token are reused (Example 9's rule)
    assert run(other, PRE, slot=1)[:2] == (27, 1)


def test_busy_slot_is_refused(tiny_gguf, saved, tmp_path):
    core, path, _ = saved
    core.add_request(Request("busy", Q, SamplingParams(temperature=0, n_predict=4), priority_slot=0))
    with pytest.raises(SlotFileError, match="busy"):
        core.save_slot(0, str(tmp_path / "x.bin"))
    with pytest.raises(SlotFileError, match="busy"):
        core.erase_slot(0)


def _patched(path, tmp_path, name, fn) -> str:
    data = bytearray(open(path, "rb").read())
    data = fn(data)
    out = tmp_path / name
    out.write_bytes(bytes(data))
    return str(out)


@pytest.mark.parametrize("name,fn,msg", [
    ("truncated", lambda d: d[:-10], "corrupt"),
    ("extra", lambda d: d + b"\0", "corrupt"),
    ("magic", lambda d: b"XXSLOT" + d[6:], "bad magic"),
    ("version", lambda d: d[:6] + struct.pack("<H", 99) + d[8:], "version 99"),
    ("short", lambda d: d[:12], "shorter"),
    ("empty", lambda d: b"", "shorter"),
    ("dtype", lambda d: d[:28] + bytes([0]) + d[29:], "dtype"),
    ("fingerprint", lambda d: d[:8] + bytes(16) + d[24:], "different model"),
])
def test_bad_files_raise_slot_file_error(saved, tmp_path, name, fn, msg):
    core, path, _ = saved
    bad = _patched(path, tmp_path, name, fn)
    before = core.slot_tokens(0)
    with pytest.raises(SlotFileError, match=msg):
        core.restore_slot(0, bad)
    assert core.slot_tokens(0) == before  # nothing applied


def test_other_model_is_refused(tmp_path, saved):
    import tinymodel

    _, path, _ = saved
    other = tinymodel.write_tiny_gguf(tmp_path / "other.gguf", seed=7)  # same shape, other weights
    core = core_for(str(other))
    with pytest.raises(SlotFileError, match="different model"):
        core.restore_slot(0, path)


def test_missing_file(saved, tmp_path):
    core, _, _ = saved
    with pytest.raises(FileNotFoundError):
        core.restore_slot(0, str(tmp_path / "nope.bin"))


def test_header_is_40_bytes():
    assert HEADER.size == 40


def test_version_3_keeps_each_layers_last_rows(tmp_path):
    """Layers saved from their own first row (sliding windows): version 3, the first rows after
    the token ids, each layer's rows read back as written; all-zero firsts stay version 2; a first
    row past the tokens or a short file is refused."""
    from kvserve.engine.slot_file import SlotHeader, read_slot_file, write_slot_file

    g = torch.Generator().manual_seed(0)
    firsts = (16, 0, 19)
    layers = [(torch.randn(19 - f, 2, 8, generator=g), torch.randn(19 - f, 2, 8, generator=g)) for f in firsts]
    hdr = SlotHeader(b"x" * 16, 19, "f32", 3, 2, 8, layer_first=firsts)
    assert hdr.version == 3
    path = tmp_path / "v3.bin"
    n = write_slot_file(str(path), hdr, list(range(19)), layers)
    assert n == path.stat().st_size == 40 + 4 * 19 + 4 * 3 + (3 + 19 + 0) * 2 * 2 * 8 * 4
    spec = dict(fingerprint=b"x" * 16, kv_dtype="f32", n_layer=3, n_head_kv=2, head_dim=8)
    back, toks, got, size = read_slot_file(str(path), **spec)
    assert (back.version, back.layer_first, toks, size) == (3, firsts, list(range(19)), n)
    for (k, v), (k2, v2) in zip(layers, got):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    raw = bytearray(path.read_bytes())
    struct.pack_into("<I", raw, 40 + 4 * 19, 20)
    (tmp_path / "bad.bin").write_bytes(bytes(raw))
    with pytest.raises(SlotFileError, match="^slot file is corrupt: a layer's first row is past its 19 tokens$"):
        read_slot_file(str(tmp_path / "bad.bin"), **spec)
    (tmp_path / "short.bin").write_bytes(bytes(raw[:100]))
    with pytest.raises(SlotFileError, match=r"^slot file is corrupt: 100 bytes, expected at least 128 for 19 tokens$"):
        read_slot_file(str(tmp_path / "short.bin"), **spec)
    with pytest.raises(SlotFileError, match="^slot file: a layer's row count does not match the header$"):
        write_slot_file(str(tmp_path / "x.bin"), hdr, list(range(19)), layers[::-1])
    flat = SlotHeader(b"x" * 16, 19, "f32", 3, 2, 8, layer_first=(0, 0, 0))
    full = [(torch.zeros(19, 2, 8), torch.zeros(19, 2, 8))] * 3
    assert flat.version == 2
    assert write_slot_file(str(tmp_path / "v2.bin"), flat, list(range(19)), full) == 40 + 4 * 19 + 3 * 19 * 2 * 64


def test_version_3_size_is_checked_before_the_body_is_read(tmp_path, monkeypatch):
    """A version 3 file whose size is not the one its first rows promise is refused after reading
    the header, the token ids and the first rows only (128 bytes here), not its 1 MiB tail."""
    from kvserve.engine import slot_file
    from kvserve.engine.slot_file import SlotHeader, read_slot_file, write_slot_file

    firsts = (16, 0, 19)
    layers = [(torch.zeros(19 - f, 2, 8), torch.zeros(19 - f, 2, 8)) for f in firsts]
    hdr = SlotHeader(b"x" * 16, 19, "f32", 3, 2, 8, layer_first=firsts)
    path = tmp_path / "v3.bin"
    n = write_slot_file(str(path), hdr, list(range(19)), layers)
    with open(path, "ab") as f:
        f.write(b"\0" * (1 << 20))
    read_bytes = []
    real_fdopen = os.fdopen

    class Counting:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def fileno(self):
            return self.f.fileno()

        def read(self, k=-1):
            b = self.f.read(k)
            read_bytes.append(len(b))
            return b

        def readinto(self, buf):
            k = self.f.readinto(buf)
            read_bytes.append(k)
            return k

    monkeypatch.setattr(slot_file.os, "fdopen", lambda fd, mode: Counting(real_fdopen(fd, mode)))
    spec = dict(fingerprint=b"x" * 16, kv_dtype="f32", n_layer=3, n_head_kv=2, head_dim=8)
    with pytest.raises(SlotFileError, match=f"^slot file is corrupt: {n + (1 << 20)} bytes, expected {n} for 19 tokens$"):
        read_slot_file(str(path), **spec)
    assert read_bytes == [40, 4 * 19 + 4 * 3]


def _salted(tiny_gguf, tmp_path):
    core = core_for(tiny_gguf)
    r = Request("salted", list(PRE), SamplingParams(temperature=0, n_predict=0, ignore_eos=True), priority_slot=0,
                cache_salt="tenant-1")
    core.add_request(r)
    while not any(o.finished for o in core.step()):
        pass
    path = str(tmp_path / "salted.bin")
    return core, path, core.save_slot(0, path)


def test_version_4_keeps_the_cache_salt(tiny_gguf, tmp_path):
    """KV computed under a cache_salt is saved as version 4 (its metadata after the token ids and
    first rows, 4-byte aligned) and restored under the same salt only."""
    import json

    core, path, res = _salted(tiny_gguf, tmp_path)
    c = core.model_config
    data = open(path, "rb").read()
    meta = b'{"cache_salt":"tenant-1","lora":[]}'
    meta += b" " * (-len(meta) % 4)
    assert struct.unpack_from("<H", data, 6)[0] == 4 and struct.unpack_from("<I", data, 36)[0] == len(meta) == 36
    off = 40 + 4 * 28 + 4 * c.n_layer
    assert data[off:off + len(meta)] == meta and json.loads(meta) == {"cache_salt": "tenant-1", "lora": []}
    assert res["n_written"] == len(data) == off + len(meta) + 2 * c.n_layer * 28 * c.n_head_kv * c.head_dim * 2
    fresh = core_for(tiny_gguf)
    assert fresh.restore_slot(0, path)["n_restored"] == 28
    assert fresh.kv.parked_salt("slot:0") == "tenant-1"
    for name, fn, msg in (
            ("odd", lambda d: d[:36] + struct.pack("<I", 35) + d[40:], r"^slot file is corrupt: 35 bytes of metadata "
             r"\(a multiple of 4, at most 1048576\)$"),
            ("huge", lambda d: d[:36] + struct.pack("<I", 1 << 24) + d[40:], "corrupt: 16777216 bytes of metadata"),
            ("notjson", lambda d: d[:off] + b"[1, 2]" + b" " * 30 + d[off + 36:],
             r"^slot file is corrupt: its metadata is not a JSON object$")):
        with pytest.raises(SlotFileError, match=msg):
            fresh.restore_slot(1, _patched(path, tmp_path, name, fn))
    assert fresh.slot_tokens(1) == []


def _with_meta(path, tmp_path, name, meta: bytes) -> str:
    """``path`` (a version 4 file) with its metadata block replaced by ``meta`` (padded to 4 bytes),
    the header's length and so the file's size made consistent with it."""
    d = open(path, "rb").read()
    n, nl, old = struct.unpack_from("<I", d, 24)[0], struct.unpack_from("<H", d, 30)[0], struct.unpack_from("<I", d, 36)[0]
    off = 40 + 4 * n + 4 * nl
    meta += b" " * (-len(meta) % 4)
    out = tmp_path / name
    out.write_bytes(d[:36] + struct.pack("<I", len(meta)) + d[40:off] + meta + d[off + old:])
    return str(out)


def test_version_4_deeply_nested_metadata_is_a_clear_error(tiny_gguf, tmp_path):
    core, path, _ = _salted(tiny_gguf, tmp_path)
    bad = _with_meta(path, tmp_path, "deep.bin", b"[" * 200_000 + b"]" * 200_000)
    with pytest.raises(SlotFileError, match="^slot file is corrupt"):
        core_for(tiny_gguf).restore_slot(0, bad)


def test_version_4_huge_integer_lora_scale_is_a_clear_error(tiny_gguf, tmp_path):
    core, path, _ = _salted(tiny_gguf, tmp_path)
    meta = b'{"cache_salt":null,"lora":[{"name":"a","fingerprint":"f","scale":' + b"9" * 400 + b'}]}'
    fresh = core_for(tiny_gguf)
    with pytest.raises(SlotFileError, match="^slot file is corrupt: bad lora metadata$"):
        fresh.restore_slot(0, _with_meta(path, tmp_path, "huge_scale.bin", meta))
    assert fresh.slot_tokens(0) == []
