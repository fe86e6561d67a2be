"""The file cache under $KVSERVE_HOME/cache (kvserve.loaders.file_cache) and the GGUF header kept in it:
a hit skips the parse, a changed file never reuses a stale entry, corrupt entries are rebuilt,
concurrent writers never leave half an entry."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from kvserve.loaders import file_cache
from kvserve.loaders import gguf as gguf_loader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tinymodel  # noqa: E402


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVSERVE_CACHE_DIR", raising=False)
    monkeypatch.delenv("KVSERVE_FILE_CACHE", raising=False)
    monkeypatch.setattr(gguf_loader, "_LAST_HEADER", None)  # as a fresh process
    monkeypatch.setattr(file_cache, "RACY_S", 0.0)  # the files here were written just now
    return tmp_path / "home" / "cache"


def _fresh_read(path):
    gguf_loader._LAST_HEADER = None
    return gguf_loader.read_gguf_header(str(path))


def _no_parse(monkeypatch):
    def fail(path):
        raise AssertionError(f"parsed {path} again")

    monkeypatch.setattr(gguf_loader, "_read_gguf_header", fail)


def test_header_is_kept_and_read_back_without_parsing(home, tmp_path, monkeypatch):
    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf", n_layer=2, qtype="Q8_0")
    parsed = gguf_loader._read_gguf_header(str(path))
    assert _fresh_read(path) == parsed
    entries = list(home.glob("gguf-header-*.json"))
    assert len(entries) == 1 and not list(home.glob(".*.tmp"))
    doc = json.loads(entries[0].read_text(encoding="utf-8"))
    assert doc["identity"] == file_cache.identity(path) and doc["format"] == file_cache.FORMAT
    _no_parse(monkeypatch)
    md, infos = _fresh_read(path)
    assert (md, infos) == parsed
    assert md["llama.block_count"] == 2 and isinstance(infos[0], gguf_loader.TensorInfo)
    assert infos[0].shape == parsed[1][0].shape and type(infos[0].shape) is tuple


def test_a_changed_file_does_not_reuse_the_entry(home, tmp_path):
    path = tmp_path / "m.gguf"
    tinymodel.write_tiny_gguf(path, n_layer=2, seed=1, metadata={"x.marker": 1})
    assert _fresh_read(path)[0]["x.marker"] == 1
    st = os.stat(path)
    time.sleep(0.05)  # past the file system clock's tick (see the racy test below)
    # rewritten in place with other weights, the same size, and the old modification time put back
    # (cp -p, tar): the change time still moves, so the identity differs
    other = tinymodel.write_tiny_gguf(tmp_path / "other.gguf", n_layer=2, seed=2, metadata={"x.marker": 7})
    data = other.read_bytes()
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    md, _ = _fresh_read(path)
    assert md["x.marker"] == 7
    # replaced by another file of another shape (rename over it: a new inode)
    tinymodel.write_tiny_gguf(tmp_path / "new.gguf", n_layer=3)
    os.replace(tmp_path / "new.gguf", path)
    assert _fresh_read(path)[0]["llama.block_count"] == 3


@pytest.mark.parametrize("garbage", [b"", b"{not json", b'{"format": 1}', b"\xff\xfe\x00",
                                     b'{"format":1,"kind":"gguf-header","identity":[],"value":{}}'])
def test_a_corrupt_entry_is_ignored_and_rebuilt(home, tmp_path, garbage):
    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf")
    want = _fresh_read(path)
    entry = file_cache.entry_path("gguf-header", file_cache.identity(path))
    entry.write_bytes(garbage)
    assert _fresh_read(path) == want
    assert json.loads(entry.read_text(encoding="utf-8"))["identity"] == file_cache.identity(path)


def test_a_matching_entry_with_a_malformed_value_is_parsed_again(home, tmp_path):
    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf")
    want = _fresh_read(path)
    ident = file_cache.identity(path)
    assert file_cache.store("gguf-header", ident, {"metadata": {}, "tensors": [["x", 1]]})
    assert _fresh_read(path) == want
    assert file_cache.load("gguf-header", ident)["tensors"][0][0] == want[1][0].name


def test_concurrent_writers_leave_one_whole_entry(home):
    ident = ["/x/model.gguf", 1, 2, 3, 4, 5]
    value = {"tokens": [f"tok{i}" for i in range(20000)]}
    errors = []

    def work():
        try:
            for _ in range(5):
                file_cache.store("k", ident, value)
                got = file_cache.load("k", ident)
                assert got is None or got == value  # never half an entry
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert file_cache.load("k", ident) == value
    assert [p.name for p in home.iterdir()] == [file_cache.entry_path("k", ident).name]  # no temp files left


def test_off_and_unwritable(home, tmp_path, monkeypatch):
    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf")
    monkeypatch.setenv("KVSERVE_FILE_CACHE", "0")
    want = _fresh_read(path)
    assert not home.exists()
    monkeypatch.delenv("KVSERVE_FILE_CACHE")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(blocker / "cache"))  # under a file: cannot be created
    assert _fresh_read(path) == want
    ident = ["/x/a.gguf", 1, 2, 3, 4, 5]
    assert file_cache.store("k", ident, 1) is False and file_cache.load("k", ident) is None


def test_old_entries_are_pruned(home, monkeypatch):
    monkeypatch.setattr(file_cache, "MAX_ENTRIES", 3)
    def ident(i):
        return [f"/x/{i}.gguf", 1, i, 3, 4, 5]

    for i in range(5):
        assert file_cache.store("k", ident(i), i)
        os.utime(file_cache.entry_path("k", ident(i)), ns=(i * 10**9, i * 10**9))
    file_cache.store("k", ident(5), 5)
    assert [file_cache.load("k", ident(i)) for i in range(6)] == [None, None, None, 3, 4, 5]


def test_a_file_changed_just_now_is_not_cached(home, tmp_path, monkeypatch):
    monkeypatch.setattr(file_cache, "RACY_S", 2.0)
    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf")
    want = _fresh_read(path)
    assert not list(home.glob("gguf-header-*.json")) if home.exists() else True
    old = time.time() - 10
    os.utime(path, (old, old))  # the change time stays recent: still not cached
    assert _fresh_read(path) == want and (not home.exists() or not list(home.glob("gguf-header-*.json")))
    monkeypatch.setattr(file_cache, "RACY_S", 0.0)
    _fresh_read(path)
    assert len(list(home.glob("gguf-header-*.json"))) == 1


# -- the finite check (loaders.weights.check_finite) kept per file --------------------------------

def _poison(src: Path, dst: Path, tensor: str = "blk.1.attn_norm.weight") -> Path:
    """A copy of the F32 GGUF ``src`` whose ``tensor`` starts with a NaN."""
    import numpy as np
    from gguf import GGUFReader

    t = next(t for t in GGUFReader(str(src)).tensors if t.name == tensor)
    raw = bytearray(src.read_bytes())
    raw[int(t.data_offset):int(t.data_offset) + 4] = np.array([np.nan], np.float32).tobytes()
    dst.write_bytes(bytes(raw))
    return dst


def _counting_check(monkeypatch) -> list:
    calls: list = []
    real = gguf_loader.check_finite

    def check(weights, source):
        calls.append(source)
        return real(weights, source)

    monkeypatch.setattr(gguf_loader, "check_finite", check)
    return calls


def test_a_finite_file_is_scanned_once(home, tmp_path, monkeypatch):
    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf", n_layer=2)
    calls = _counting_check(monkeypatch)
    gguf_loader.load_gguf(path)
    gguf_loader.load_gguf(path)
    assert calls == [str(path)]
    assert len(list(home.glob("gguf-finite-*.json"))) == 1


def test_a_file_with_nan_is_refused_every_time(home, tmp_path, monkeypatch):
    from kvserve.loaders.weights import ModelLoadError

    good = tinymodel.write_tiny_gguf(tmp_path / "m.gguf", n_layer=2)
    bad = _poison(good, tmp_path / "bad.gguf")
    calls = _counting_check(monkeypatch)
    for _ in range(2):
        with pytest.raises(ModelLoadError, match=r"tensor 'blk.1.attn_norm.weight' has 1 NaN/Inf values"):
            gguf_loader.load_gguf(bad)
    assert calls == [str(bad)] * 2 and not list(home.glob("gguf-finite-*.json"))


def test_a_file_changed_to_nan_is_scanned_again(home, tmp_path, monkeypatch):
    from kvserve.loaders.weights import ModelLoadError

    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf", n_layer=2)
    gguf_loader.load_gguf(path)  # passes: kept
    time.sleep(0.05)
    data = _poison(path, tmp_path / "bad.gguf").read_bytes()
    path.write_bytes(data)  # same path, same size, NaN inside: another identity (ctime, mtime)
    gguf_loader._LAST_HEADER = None
    with pytest.raises(ModelLoadError, match="NaN/Inf"):
        gguf_loader.load_gguf(path)


def test_a_corrupt_finite_entry_is_ignored(home, tmp_path, monkeypatch):
    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf", n_layer=2)
    gguf_loader.load_gguf(path)
    (entry,) = home.glob("gguf-finite-*.json")
    entry.write_bytes(b"{not json")
    calls = _counting_check(monkeypatch)
    gguf_loader.load_gguf(path)  # scanned again, not fatal, and the entry rewritten
    assert calls == [str(path)]
    assert json.loads(entry.read_text(encoding="utf-8"))["value"] is True


# -- the BPE tokenizer built from a GGUF vocabulary (loaders.tokenizer._cached_bpe) ---------------

def _tiny_tokenizer(tmp_path, monkeypatch=None):
    from kvserve.loaders.tokenizer import Tokenizer

    path = tinymodel.write_tiny_gguf(tmp_path / "m.gguf", n_layer=1)
    md, _ = _fresh_read(path)
    return md, Tokenizer.from_gguf


def test_the_bpe_tokenizer_is_kept_and_read_back_without_building(home, tmp_path, monkeypatch):
    from kvserve.loaders import tokenizer as tok_mod

    md, from_gguf = _tiny_tokenizer(tmp_path)
    text = "Hello world, héllo <|im_start|>user\n 123"
    built = from_gguf(md)
    assert md["tokenizer.ggml.model"] == "gpt2" and len(list(home.glob("bpe-tokenizer-*.json"))) == 1

    def fail(*a):
        raise AssertionError("built again")

    real = tok_mod._builder_digest(tok_mod._build_bpe)
    monkeypatch.setattr(tok_mod, "_builder_digest", lambda fn: real)  # the key as for the real builder
    monkeypatch.setattr(tok_mod, "_build_bpe", fail)
    kept = from_gguf(md)
    assert kept.encode(text) == built.encode(text) and len(built.encode(text)) > 5
    assert [kept.token_bytes(i) for i in range(kept.n_vocab)] == [built.token_bytes(i) for i in range(built.n_vocab)]
    assert kept.encode("<|im_start|>user", parse_special=False) == built.encode("<|im_start|>user", parse_special=False)
    md2 = dict(md, **{"tokenizer.ggml.merges": list(md["tokenizer.ggml.merges"])[:-1]})  # another input
    with pytest.raises(AssertionError, match="built again"):
        from_gguf(md2)


def test_a_corrupt_bpe_entry_is_ignored(home, tmp_path, monkeypatch):
    md, from_gguf = _tiny_tokenizer(tmp_path)
    text = "Hello world, héllo"
    built = from_gguf(md)
    (entry,) = home.glob("bpe-tokenizer-*.json")
    doc = json.loads(entry.read_text(encoding="utf-8"))
    doc["value"]["hf"] = "{not a tokenizer"
    entry.write_text(json.dumps(doc), encoding="utf-8")
    assert from_gguf(md).encode(text) == built.encode(text)  # rebuilt, not fatal
    assert json.loads(entry.read_text(encoding="utf-8"))["value"]["hf"].startswith("{")
    assert json.loads(entry.read_text(encoding="utf-8"))["value"]["hf"] != "{not a tokenizer"


def test_the_bpe_key_follows_the_builder_and_the_inputs():
    from kvserve.loaders import tokenizer as tok_mod

    args = (["a", "b", "ab"], [1, 1, 1], ["a b"], ("x",), False)
    key = tok_mod._bpe_key(*args)
    assert key == tok_mod._bpe_key(*args) and key[0].startswith("bpe:") and key[1:] == [0, 0, 0, 0, 0]
    assert tok_mod._bpe_key(["a", "b", "ab"], [1, 1, 3], ["a b"], ("x",), False) != key
    assert tok_mod._bpe_key(*args[:4], True) != key
    saved = tok_mod._build_bpe.__code__
    try:
        tok_mod._build_bpe.__code__ = tok_mod._build_wpm.__code__.replace(co_name="_build_bpe")
        assert tok_mod._bpe_key(*args) != key
    finally:
        tok_mod._build_bpe.__code__ = saved


def test_the_bpe_key_is_the_same_in_every_process():
    """The key must not depend on the process: a comprehension's code object inside the builder
    (its repr holds an address) or a frozenset constant (its order follows the string hash seed)
    made every start miss the entry its previous start wrote."""
    import subprocess

    from kvserve.loaders import tokenizer as tok_mod

    assert any(isinstance(c, type(tok_mod._build_bpe.__code__)) for c in tok_mod._build_bpe.__code__.co_consts)
    args = (["a", "b", "ab"], [1, 1, 1], ["a b"], ("x",), False)
    code = ("from kvserve.loaders import tokenizer as t; "
            f"print(t._bpe_key(*{args!r})[0], t._builder_digest(t._build_wpm).hex())")
    root = str(Path(__file__).resolve().parents[2])
    seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                           env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": root}).stdout
            for seed in ("1", "2")}
    assert seen == {f"{tok_mod._bpe_key(*args)[0]} {tok_mod._builder_digest(tok_mod._build_wpm).hex()}\n"}
