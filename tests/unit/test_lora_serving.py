"""LoRA adapters chosen by model name (issue 34 items 3 and 4), without a server: vLLM's
``--lora-modules`` words, the per-runner adapter cache (``--max-cpu-loras`` LRU, waiting when every
adapter is in use, bytes counted), a PEFT directory converted to a LoRA GGUF (read back equal), and
Ollama's create with ``adapters`` / ``ADAPTER`` (layers, errors with Ollama's texts)."""

from __future__ import annotations

import asyncio
import math

import pytest
import tinylora  # tests/ is on sys.path (tests/conftest.py)
import tinymodel
import torch

from kvserve.errors import InvalidInputError, NotFoundError
from kvserve.serving import lora_modules as lm
from kvserve.serving.lora_modules import AdapterRef, LoraModulePath, parse_lora_module, parse_lora_modules


# -- --lora-modules ------------------------------------------------------------------------------

def test_lora_module_words():
    assert parse_lora_module("sql=/a/b=c") == LoraModulePath("sql", "/a/b=c")
    assert parse_lora_module('{"name": "x", "path": "/p", "base_model_name": "m"}') == LoraModulePath("x", "/p", "m")
    assert parse_lora_module('{"name": "x", "path": "/p"}') == LoraModulePath("x", "/p", None)
    with pytest.raises(ValueError, match=r"^Invalid JSON format for --lora-modules: x$"):
        parse_lora_module("x")
    with pytest.raises(ValueError, match=r"^Invalid fields for --lora-modules: \[1\] - expected a JSON object$"):
        parse_lora_module("[1]")
    with pytest.raises(ValueError, match="unexpected keyword argument 'rank'"):
        parse_lora_module('{"name": "x", "path": "/p", "rank": 8}')
    with pytest.raises(ValueError, match="'name' must be a non-empty string"):
        parse_lora_module('{"name": "", "path": "/p"}')
    assert [m.name for m in parse_lora_modules(["a=/x", "", "b=/y"])] == ["a", "b"]
    with pytest.raises(ValueError, match="the name 'a' is given twice"):
        parse_lora_modules(["a=/x", "a=/y"])


@pytest.mark.parametrize(("value", "want"), [("true", True), ("1", True), ("TRUE", True), ("0", False),
                                             ("false", False), ("yes", False), (None, False)])
def test_runtime_updates_env(value, want):
    env = {} if value is None else {lm.ALLOW_RUNTIME_ENV: value}
    assert lm.runtime_updates_allowed(env) is want


def test_adapter_spec_base_is_the_plain_spec():
    from kvserve.serving.manager import ModelSpec

    base = ModelSpec("tiny", "/m", pinned=True, names=("tiny", "t2"), adapters=(("/l.gguf", 0.5),))
    spec = lm._with_adapters(base, (AdapterRef("sql", "/a"),), "sql")
    assert (spec.name, spec.path, spec.alias, spec.selected[0].name) == ("tiny", "/m", "sql", "sql")
    assert type(spec.base()) is ModelSpec and spec.base() == base  # the base's own --lora adapters kept


# -- the per-runner adapter cache ----------------------------------------------------------------------

class _FakeAdapter:
    def __init__(self, name: str, rank: int):
        self.name, self.rank, self.nbytes = name, rank, 1000 * rank


class _FakeEntry:
    def __init__(self, aid, adapter):
        self.id, self.adapter = aid, adapter


class _FakeRegistry:
    """LoraRegistry's surface the cache uses (add/remove/by_id/base/installed_nbytes)."""

    base = None

    def __init__(self):
        self.entries: dict[int, _FakeEntry] = {}
        self.next = 0
        self.max_loras = None

    def add(self, adapter, scale=1.0):
        assert scale == 0.0  # served adapters never change the base's requests
        self.entries[self.next] = _FakeEntry(self.next, adapter)
        self.next += 1
        return self.next - 1

    def remove(self, aid):
        if aid not in self.entries:
            raise NotFoundError("gone")
        del self.entries[aid]

    def by_id(self, aid):
        return self.entries.get(aid)

    def installed_nbytes(self, adapter):  # LoraRegistry's at the default --lora-dtype (float32 copies)
        return 2 * adapter.nbytes


class _FakeRunner:
    model_alias = "tiny"

    def __init__(self):
        self.lora = _FakeRegistry()


@pytest.fixture
def fake_loads(monkeypatch, tmp_path):
    """load_adapter reads a rank from the file's text; returns the paths of adapters a..c."""
    import kvserve.lora

    def fake_load(path, base, name):
        return _FakeAdapter(name, int(open(path).read()))

    monkeypatch.setattr(kvserve.lora, "load_adapter", fake_load)
    paths = {}
    for name, rank in (("a", 8), ("b", 16), ("c", 32)):
        p = tmp_path / name
        p.write_text(str(rank))
        paths[name] = str(p)
    return paths


def test_cache_lru_waits_and_counts_bytes(fake_loads):
    async def scenario():
        counted = []
        runner = _FakeRunner()
        cache = lm._RunnerAdapters(runner, 2, counted.append)
        ref = {n: AdapterRef(n, p, 1.0, 16) for n, p in fake_loads.items()}
        ia = await cache.hold(ref["a"])
        ib = await cache.hold(ref["b"])
        assert (ia, ib, counted) == (0, 1, [16000, 32000])  # A, B and the engine's copies: 2 x nbytes
        cache.release(["a"])
        assert await cache.hold(ref["b"]) == 1  # in memory: no load
        cache.release(["b"])
        # a third adapter evicts the least recently used idle one (a)
        ic = asyncio.ensure_future(cache.hold(AdapterRef("c", fake_loads["c"], 1.0, 32)))
        assert await ic == 2
        assert sorted(cache.held) == ["b", "c"] and counted == [16000, 32000, -16000, 64000]
        # every adapter in use (b once, c once): a request for a waits until one is released
        waiting = asyncio.ensure_future(cache.hold(ref["a"]))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        cache.release(["b"])  # b's last hold ends: b is evicted for a
        assert await asyncio.wait_for(waiting, 5) == 3
        assert sorted(cache.held) == ["a", "c"] and sorted(runner.lora.entries) == [2, 3]
        # rank above the limit: vLLM's text; nothing kept
        with pytest.raises(InvalidInputError, match=r"^LoRA rank 32 is greater than max_lora_rank 16\.$"):
            cache.release(["c"])
            await cache.hold(AdapterRef("c2", fake_loads["c"], 1.0, 16))
        with pytest.raises(NotFoundError, match=r"^Loading lora x failed: No adapter found for /nope$"):
            await cache.hold(AdapterRef("x", "/nope"))
        # unloaded while in use: dropped at its last release
        cache.forget("a")
        assert "a" in cache.held
        cache.release(["a"])
        assert "a" not in cache.held and counted[-1] == -16000

    asyncio.run(scenario())


# -- PEFT -> LoRA GGUF ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(), dict(use_rslora=True), dict(rank_pattern={"q_proj": 4},
                                                                    alpha_pattern={"down_proj": 3.0})])
def test_peft_converts_to_an_equal_gguf(tmp_path, kw):
    from kvserve.lora import LoraBase, load_adapter
    from kvserve.models.family import read_gguf_config
    from kvserve.loaders.gguf import read_gguf_header
    from kvserve.ollama.adapter_convert import peft_to_gguf

    base = tinymodel.write_tiny_gguf(tmp_path / "base.gguf")
    config = read_gguf_config(read_gguf_header(str(base))[0], str(base))
    peft = tinylora.write_peft_adapter(tmp_path / "peft", seed=3, **kw)
    rank = peft_to_gguf(peft, config, tmp_path / "out.gguf")
    assert rank == 8
    b = LoraBase.of(config)
    want, got = load_adapter(str(peft), b), load_adapter(str(tmp_path / "out.gguf"), b)
    assert got.format == "gguf" and sorted(got.modules) == sorted(want.modules) and len(got.modules) == 14
    uniform = not kw
    assert got.alpha == (16.0 if uniform else 0.0)
    for mod, m in want.modules.items():
        g = got.modules[mod]
        assert torch.equal(g.a, m.a)
        assert torch.allclose(g.b * g.scale, m.b * m.scale, rtol=1e-6, atol=1e-9), mod
        if uniform:
            assert math.isclose(g.scale, m.scale) and torch.equal(g.b, m.b)


# -- Ollama's create with adapters -------------------------------------------------------------------

@pytest.fixture
def store(tmp_path):
    from kvserve.store import Store

    s = Store(tmp_path / "models")
    base = tinymodel.write_tiny_gguf(tmp_path / "base.gguf")
    s.import_file(base)
    return s


def _create(store, body):
    from kvserve.ollama.create import iter_create

    return [e["status"] for e in iter_create(store, body)]


def _put(store, path) -> str:
    return store.import_file(path).digest


def test_create_with_a_gguf_adapter_and_a_peft_dir(store, tmp_path):
    from kvserve.store import media_type

    base = _put(store, tmp_path / "base.gguf")
    assert _create(store, {"model": "tiny", "files": {"base.gguf": base}})[-1] == "success"
    ad = _put(store, tinylora.write_gguf_adapter(tmp_path / "ad.gguf", seed=1))
    st = _create(store, {"model": "tuned", "from": "tiny", "adapters": {"ad.gguf": ad}})
    assert st[0] == "parsing GGUF" and st[-1] == "success" and f"using existing layer {ad}" in st
    m = store.get("tuned").manifest
    assert [(x.media_type, x.digest) for x in m.layers_of("adapter")] == [(media_type("adapter"), ad)]
    assert media_type("adapter") == "application/vnd.ollama.image.adapter"
    peft = tinylora.write_peft_adapter(tmp_path / "peft", seed=2)
    files = {"adapter_config.json": _put(store, peft / "adapter_config.json"),
             "adapter_model.safetensors": _put(store, peft / "adapter_model.safetensors")}
    st = _create(store, {"model": "tuned2", "from": "tiny", "adapters": files})
    assert st[0] == "converting adapter" and st[-1] == "success"
    assert sum(x.startswith("creating new layer ") for x in st) == 1  # the converted GGUF
    layer = store.get("tuned2").manifest.layers_of("adapter")[0]
    from kvserve.loaders.gguf import read_gguf_header

    md, tensors = read_gguf_header(str(store.blob_path(layer.digest)))
    assert (md["general.type"], md["adapter.type"], md["general.architecture"]) == ("adapter", "lora", "llama")
    assert len(tensors) == 28  # 2 layers x 7 projections x (lora_a, lora_b)
    # the store model loads with its adapter layer at scale 1 (Ollama's llama-server --lora)
    from kvserve.serving.args import parse_args
    from kvserve.serving.state import ServerState

    state = ServerState(parse_args(["--no-preload", "--models-dir", str(store.root)]))
    spec = state.resolve("tuned2")
    assert (spec.name, spec.adapters) == ("tuned2:latest", ((str(store.blob_path(layer.digest)), 1.0),))
    assert state.resolve("tiny").adapters == ()


def test_create_adapter_errors(store, tmp_path):
    base = _put(store, tmp_path / "base.gguf")
    _create(store, {"model": "tiny", "files": {"base.gguf": base}})
    ad = _put(store, tinylora.write_gguf_adapter(tmp_path / "ad.gguf", seed=1))
    ad2 = _put(store, tinylora.write_gguf_adapter(tmp_path / "ad2.gguf", seed=2))
    other = _put(store, tinylora.write_gguf_adapter(tmp_path / "other.gguf", seed=1, n_ff=96))
    bad = [
        ({"adapters": {"a.gguf": ad, "b.gguf": ad2}}, "^only one adapter is currently supported$"),
        ({"adapters": {"base.gguf": base}}, r"is not a LoRA adapter \(its GGUF general.type is"),
        ({"adapters": {"other.gguf": other}}, r"other.gguf: module blk.0.ffn_gate: blk.0.ffn_gate has shape"),
        ({"adapters": {"../x.gguf": ad}}, "^file path must be relative$"),
        ({"adapters": {"x.gguf": "nope"}}, "^invalid digest format$"),
    ]
    for extra, pattern in bad:
        with pytest.raises(InvalidInputError, match=pattern):
            _create(store, {"model": "t", "from": "tiny", **extra})
    text = _put(store, tmp_path / "notes.txt") if (tmp_path / "notes.txt").write_text("hi") else None
    with pytest.raises(InvalidInputError, match="^unknown type$"):
        _create(store, {"model": "t", "from": "tiny", "adapters": {"notes.txt": text}})
    with pytest.raises(NotFoundError, match='^blob "sha256:0{64}" not found$'):
        _create(store, {"model": "t", "from": "tiny", "adapters": {"a.gguf": "sha256:" + "0" * 64}})
    with pytest.raises(InvalidInputError, match="a LoRA adapter GGUF was given as the model's weights"):
        _create(store, {"model": "t", "files": {"ad.gguf": ad}})
    assert store.get("t") is None


def test_modelfile_adapter_paths_and_digests(store, tmp_path):
    from kvserve.ollama.create import iter_create, iter_create_modelfile

    tinylora.write_peft_adapter(tmp_path / "peft", seed=2)
    ad = tinylora.write_gguf_adapter(tmp_path / "ad.gguf", seed=1)
    mf = "FROM ./base.gguf\nADAPTER ./peft\nSYSTEM be brief\n"
    st = [e["status"] for e in iter_create_modelfile(store, "m1", mf, tmp_path)]
    assert "converting adapter" in st and st[-1] == "success"
    st = [e["status"] for e in iter_create_modelfile(store, "m2", "FROM m1\nADAPTER ad.gguf\n", tmp_path)]
    assert st[-1] == "success" and len(store.get("m2").manifest.layers_of("adapter")) == 2  # the base's + its own
    digest = store.import_file(ad).digest
    st = [e["status"] for e in iter_create(store, {"model": "m3", "modelfile": f"FROM m1\nADAPTER {digest}\n"})]
    assert st[-1] == "success"
    with pytest.raises(InvalidInputError, match="a file path needs the current create request"):
        list(iter_create(store, {"model": "m4", "modelfile": "FROM m1\nADAPTER ./ad.gguf\n"}))
    with pytest.raises(NotFoundError, match=r"no such file or directory: \./missing"):
        list(iter_create_modelfile(store, "m5", "FROM m1\nADAPTER ./missing\n", tmp_path))
    from kvserve.ollama.local import LocalApi

    text = LocalApi(store).show("m2")["modelfile"]
    adapters = [x.digest for x in store.get("m2").manifest.layers_of("adapter")]
    assert [ln for ln in text.splitlines() if ln.startswith("ADAPTER ")] == \
        [f"ADAPTER {store.blob_path(d)}" for d in adapters]
