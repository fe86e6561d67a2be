"""Which models a request may name (ServerState.resolve / catalog / acquire), without loading any."""

from __future__ import annotations

import asyncio
import os

import pytest

from kvserve.errors import InvalidInputError, NotFoundError, UnavailableError
from kvserve.serving.args import parse_args
from kvserve.serving.manager import ModelManager
from kvserve.serving.state import ServerState
from kvserve.store import Layer, Store, media_type


@pytest.fixture
def home(tmp_path, monkeypatch, tiny_gguf):
    """A KVSERVE_HOME whose store (Ollama's layout) has tiny-a:latest and tiny-b:latest, one blob."""
    h = tmp_path / "home"
    monkeypatch.setenv("KVSERVE_HOME", str(h))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    store = Store(h / "models")
    blob = store.import_file(tiny_gguf)
    for name in ("tiny-a", "tiny-b"):
        store.create(name, [Layer(media_type("model"), blob.digest, blob.size)])
    return h


class FakeRunner:
    def __init__(self, spec):
        self.spec = spec

    def require_ready(self):
        pass

    def close(self):
        pass


def _state(*argv, fake=True):
    args = parse_args(list(argv))
    return ServerState(args, ModelManager(FakeRunner) if fake else None)


def test_store_names_resolve_and_unknown_is_404(home):
    st = _state()
    spec = st.resolve("tiny-a")
    assert (spec.name, spec.pinned) == ("tiny-a:latest", False)
    assert spec.path == str(Store(home / "models").model_path("tiny-a"))
    for name in ("tiny-a:latest", "registry.ollama.ai/library/tiny-a:latest", "Tiny-A"):
        assert st.resolve(name).name == "tiny-a:latest"
    with pytest.raises(NotFoundError) as e:
        st.resolve("nope")
    assert str(e.value) == "model 'nope' not found"
    with pytest.raises(NotFoundError, match="model 'smollm2' not found"):  # no model named: the default
        st.resolve(None)
    with pytest.raises(InvalidInputError, match="longer than 1024"):
        st.resolve("x" * 1025)
    assert [m.name for m in st.catalog()] == ["tiny-a:latest", "tiny-b:latest"]


def test_paths_only_with_allow_model_paths(home, tiny_gguf, tmp_path):
    with pytest.raises(NotFoundError):
        _state().resolve(tiny_gguf)
    st = _state("--allow-model-paths")
    spec = st.resolve(tiny_gguf)
    assert spec.name == spec.path == os.path.realpath(tiny_gguf)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOPE" * 10)
    with pytest.raises(NotFoundError):
        st.resolve(str(junk))
    (tmp_path / "hf").mkdir()
    with pytest.raises(NotFoundError):  # a directory without config.json
        st.resolve(str(tmp_path / "hf"))


def test_pinned_model_answers_every_name(home, tiny_gguf):
    st = _state("-m", tiny_gguf, "-a", "coder,helper")
    with pytest.raises(UnavailableError, match="Loading model"):
        st.resolve("coder")
    st._pinned_spec = st.preload_blocking_part()
    for name in (None, "coder", "gpt-4o", "tiny-a"):
        spec = st.resolve(name)
        assert (spec.name, spec.pinned, spec.served_names()) == ("coder", True, ["coder", "helper"])
    assert [m.name for m in st.catalog()] == ["coder"]


def test_acquire_through_the_state(home):
    async def main():
        st = _state()
        lease = await st.acquire("tiny-b", 0)
        assert lease.runner.spec.name == "tiny-b:latest"
        assert [(m.name, m.runner is not None) for m in st.catalog()] == [("tiny-a:latest", False),
                                                                          ("tiny-b:latest", True)]
        lease.release()
        await st.manager._closed()
        assert st.manager.runners() == []

    asyncio.run(main())


def test_preload_failure_is_the_loaders_message(home, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 8)
    st = _state("-m", str(bad), fake=False)
    with pytest.raises(Exception) as e:
        asyncio.run(st.preload())
    assert "GGUF" in str(e.value.__cause__ or e.value)
    assert not st.preloading
