"""The store in Ollama's layout (kvserve.store): names, manifests, blobs, copy/delete, an existing
Ollama store read in place (OLLAMA_MODELS / --models-dir), and the move from the old layout."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import pytest

from kvserve.errors import InvalidInputError, NotFoundError
from kvserve.store import (
    DigestMismatchError,
    InvalidModelNameError,
    Layer,
    Manifest,
    ModelNotFoundError,
    Store,
    canonical_name,
    go_json,
    list_models,
    media_type,
    open_store,
    parse_name,
    remove,
    resolve_model,
)
from kvserve.store.manifest import human_number

H = {c: c * 64 for c in "0123456789abcdef"}  # full-length fake hex digests


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A fresh KVSERVE_HOME and no OLLAMA_MODELS."""
    home = tmp_path / "home"
    monkeypatch.setenv("KVSERVE_HOME", str(home))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    return home


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under root -> (inode, mtime_ns): what a read-in-place test must leave alone."""
    return {str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in root.rglob("*")
            if p.is_file()}


def _model(store: Store, gguf: str, name: str, **texts: str) -> Layer:
    """Store ``gguf`` (hard link) as ``name`` with extra text layers by kind; returns the model layer."""
    w = store.import_file(gguf)
    model = Layer(media_type("model"), w.digest, w.size)
    layers = [model] + [store.new_layer(v.encode(), kind) for kind, v in texts.items()]
    store.create(name, layers)
    return model


# -- names ----------------------------------------------------------------------------------

def test_seed_example3_name_table():
    """Seed 004, Example 3: the four names, their manifest paths and the manifest URL, exactly."""
    store = Store("~/.ollama/models")  # the seed prints the unexpanded path
    got = [f"{s} -> {store.manifests_dir.joinpath(*parse_name(s).parts)}"
           for s in ("qwen2.5-coder:7b", "llama3.2", "myteam/coder:q4", "hf.co/unsloth/Qwen3-8B-GGUF:Q4_K_M")]
    assert got == [
        "qwen2.5-coder:7b -> ~/.ollama/models/manifests/registry.ollama.ai/library/qwen2.5-coder/7b",
        "llama3.2 -> ~/.ollama/models/manifests/registry.ollama.ai/library/llama3.2/latest",
        "myteam/coder:q4 -> ~/.ollama/models/manifests/registry.ollama.ai/myteam/coder/q4",
        "hf.co/unsloth/Qwen3-8B-GGUF:Q4_K_M -> ~/.ollama/models/manifests/hf.co/unsloth/Qwen3-8B-GGUF/Q4_K_M",
    ]
    assert parse_name("qwen2.5-coder:7b").manifest_url() == \
        "https://registry.ollama.ai/v2/library/qwen2.5-coder/manifests/7b"
    assert parse_name("hf.co/unsloth/Qwen3-8B-GGUF:Q4_K_M").blob_url("sha256:" + H["a"]) == \
        f"https://hf.co/v2/unsloth/Qwen3-8B-GGUF/blobs/sha256:{H['a']}"


@pytest.mark.parametrize("name,display,full", [
    ("smollm2", "smollm2:latest", "registry.ollama.ai/library/smollm2:latest"),
    ("smollm2:latest", "smollm2:latest", "registry.ollama.ai/library/smollm2:latest"),
    ("registry.ollama.ai/library/smollm2:latest", "smollm2:latest", "registry.ollama.ai/library/smollm2:latest"),
    ("myteam/coder:q4", "myteam/coder:q4", "registry.ollama.ai/myteam/coder:q4"),
    ("hf.co/unsloth/Qwen3-8B-GGUF:Q4_K_M", "hf.co/unsloth/Qwen3-8B-GGUF:Q4_K_M",
     "hf.co/unsloth/Qwen3-8B-GGUF:Q4_K_M"),
    ("hf.co/bartowski/Llama", "hf.co/bartowski/Llama:latest", "hf.co/bartowski/Llama:latest"),
    ("localhost:5000/team/m:v1", "localhost:5000/team/m:v1", "localhost:5000/team/m:v1"),
    ("REGISTRY.OLLAMA.AI/Library/X:T", "X:T", "REGISTRY.OLLAMA.AI/Library/X:T"),  # defaults match any case
    ("host:https/namespace/model:tag", "host:https/namespace/model:tag", "host:https/namespace/model:tag"),
    ("_why/_the/_lucky:_stiff", "_why/_the/_lucky:_stiff", "_why/_the/_lucky:_stiff"),
])
def test_display_names(name, display, full):
    n = parse_name(name)
    assert (n.display, n.full, str(n)) == (display, full, display)


def test_scheme_and_port():
    n = parse_name("http://localhost:5000/ns/m:t")
    assert (n.scheme, n.host, n.display) == ("http", "localhost:5000", "localhost:5000/ns/m:t")
    assert n.manifest_url() == "http://localhost:5000/v2/ns/m/manifests/t"


@pytest.mark.parametrize("name", [
    "", "^", "mm:", "/nn/mm", "//", "//mm", "hh//", "n/m:", ":t", "@t", "m@d", "a b",
    "-hh/nn/mm:tt", "hh/-nn/mm:tt", "hh/nn/-mm:tt", "hh/nn/mm:-tt",
    "host/name:space/model:tag",  # a colon in a part other than the host
    "team.x/model",  # a dot in the namespace
    "a/b/c/d",  # three slashes: the host would hold a "/"
    "../m", "m/..", "x" * 81, "m:" + "t" * 81, "h" * 351 + "/n/m",
    "smöllm2",  # ASCII only
])
def test_invalid_names_refused(name):
    with pytest.raises(InvalidModelNameError) as e:
        parse_name(name)
    assert isinstance(e.value, InvalidInputError) and isinstance(e.value, ValueError)
    assert (str(e.value), e.value.message, e.value.name, e.value.kind) == \
        ("invalid model name", "invalid model name", name, "invalid_request")


def test_long_parts_valid():
    parse_name("h" * 350 + "/" + "n" * 80 + "/" + "m" * 80 + ":" + "t" * 80)


# -- manifests and blobs --------------------------------------------------------------------

def test_manifest_size_is_layers_plus_config():
    """The seed's manifest (digests made full length): 4,683,100,856 bytes, as ollama list says."""
    seed = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                       "digest": "sha256:" + H["d"], "size": 487},
            "layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:" + H["6"],
                        "size": 4683087332},
                       {"mediaType": "application/vnd.ollama.image.system", "digest": "sha256:" + H["6"][:63] + "1",
                        "size": 68},
                       {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + H["1"],
                        "size": 1626},
                       {"mediaType": "application/vnd.ollama.image.license", "digest": "sha256:" + H["8"],
                        "size": 11343}]}
    m = Manifest.from_bytes(json.dumps(seed).encode())
    assert m.size == 4683100856
    assert [layer.kind for layer in m.layers] == ["model", "system", "template", "license"]
    assert m.layer("template").size == 1626 and m.layer("adapter") is None
    assert m.to_dict() == seed
    assert m.to_bytes() == go_json(seed)


def test_manifest_refused():
    for bad in (b"nope", b"[]", b'{"schemaVersion": 1}',
                b'{"schemaVersion": 2, "layers": [{"mediaType": "x", "digest": "sha256:12", "size": 1}]}'):
        with pytest.raises(InvalidInputError):
            Manifest.from_bytes(bad)


def test_go_json_bytes():
    assert go_json({"stop": ["<|im_end|>"], "a&b": 0.2, "t": "\u2028é"}) == \
        b'{"stop":["\\u003c|im_end|\\u003e"],"a\\u0026b":0.2,"t":"\\u2028\xc3\xa9"}\n'
    assert [human_number(n) for n in (134515008, 7_000_000_000, 1_500_000_000, 12_345, 999, 3_000_000)] == \
        ["134.52M", "7B", "1.5B", "12K", "999", "3M"]


def test_gguf_model_config_as_ollama_writes_it(env, tiny_gguf):
    store = open_store()
    _model(store, tiny_gguf, "tiny")
    m = store.require("tiny")
    config = store.blob_path(m.manifest.config.digest).read_bytes()
    d = json.loads(config)
    assert list(d) == ["model_format", "model_family", "model_families", "model_type", "file_type",
                       "architecture", "os"]
    assert (d["model_format"], d["model_family"], d["model_families"], d["architecture"], d["os"]) == \
        ("gguf", "llama", ["llama"], "amd64", "linux")
    assert d["file_type"] == "unknown"  # an F32 file: general.file_type 0, which Ollama names unknown
    assert d["model_type"][-1] in "KMB"
    assert config.endswith(b"}\n") and b" " not in config
    raw = m.manifest_path.read_bytes()
    assert raw == m.manifest.to_bytes() and m.digest == hashlib.sha256(raw).hexdigest()
    assert m.size == os.path.getsize(tiny_gguf) + len(config)


def test_write_blob_verifies_and_is_atomic(env):
    store = open_store()
    data = b"hello blob"
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with pytest.raises(DigestMismatchError) as e:
        store.write_blob(io.BytesIO(data), "sha256:" + H["0"])
    assert str(e.value) == f'digest mismatch, expected "sha256:{H["0"]}", got "{digest}"'
    assert list(store.blobs_dir.iterdir()) == []  # the temp file is gone, nothing named by either digest
    w = store.write_blob(io.BytesIO(data), digest.replace(":", "-"))
    assert (w.digest, w.size, w.existed) == (digest, len(data), False)
    assert store.blob_path(digest).read_bytes() == data and store.has_blob(digest)
    assert oct(store.blob_path(digest).stat().st_mode & 0o777) == "0o644"

    class Unread(io.BytesIO):
        def read(self, *a):
            raise AssertionError("an existing blob is not read again")

    assert store.write_blob(Unread(), digest).existed
    assert store.write_blob_bytes(data).existed
    for bad in ("sha256:12", "md5:" + H["0"][:32], "sha256:" + "g" * 64, "../../etc/passwd"):
        with pytest.raises(InvalidInputError, match="^invalid digest format$"):
            store.blob_path(bad)
    with pytest.raises(InvalidInputError, match="size mismatch"):
        store.write_blob(io.BytesIO(b"other"), size=3)
    assert sorted(p.name for p in store.blobs_dir.iterdir()) == [f"sha256-{digest[7:]}"]


def test_partial_download_finished(env):
    store = open_store()
    data = b"x" * 1000
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    part = store.partial_path(digest)
    assert part.name == f"sha256-{digest[7:]}-partial"
    part.parent.mkdir(parents=True)
    part.write_bytes(data[:400])
    with open(part, "ab") as f:  # resumed where it stopped
        f.write(data[400:])
    assert store.finish_partial(digest).size == 1000 and not part.exists() and store.has_blob(digest)
    bad = store.partial_path("sha256:" + H["1"])
    bad.write_bytes(b"corrupt")
    with pytest.raises(DigestMismatchError):
        store.finish_partial("sha256:" + H["1"])
    assert not bad.exists() and not store.has_blob("sha256:" + H["1"])


def test_layers_by_kind(env, tiny_gguf):
    store = open_store()
    params = go_json({"stop": ["<|im_end|>"], "temperature": 0.2}).decode()
    messages = go_json([{"role": "user", "content": "hi"}]).decode()
    _model(store, tiny_gguf, "myteam/coder:q4", template="{{ .Prompt }}", system="Be brief.", license="MIT",
           params=params, messages=messages)
    assert store.layer_text("myteam/coder:q4", "template") == "{{ .Prompt }}"
    assert store.layer_text("myteam/coder:q4", "system") == "Be brief."
    assert store.layer_text("myteam/coder:q4", "license") == "MIT"
    assert store.params("myteam/coder:q4") == {"stop": ["<|im_end|>"], "temperature": 0.2}
    assert store.messages("myteam/coder:q4") == [{"role": "user", "content": "hi"}]
    manifest = store.read_manifest("registry.ollama.ai/myteam/coder:q4")
    assert store.layer_bytes(manifest, "adapter") is None
    assert [layer.kind for layer in manifest.layers] == ["model", "template", "system", "license", "params",
                                                         "messages"]
    assert store.model_path("myteam/coder:q4").parent == store.blobs_dir
    assert [m.display for m in store.list()] == ["myteam/coder:q4"]
    with pytest.raises(NotFoundError, match="^model 'coder:q4' not found$"):
        store.model_path("coder:q4")
    with pytest.raises(NotFoundError, match='blob "sha256:'):
        store.create("broken", [Layer(media_type("model"), "sha256:" + H["2"], 5)])


def test_find_is_case_insensitive(env, tiny_gguf):
    store = open_store()
    _model(store, tiny_gguf, "MyTeam/Coder:Q4")
    for spelling in ("myteam/coder:q4", "MYTEAM/CODER:Q4", "Registry.Ollama.AI/myteam/Coder:q4"):
        assert store.find(spelling).display == "MyTeam/Coder:Q4"
        assert canonical_name(spelling) == "MyTeam/Coder:Q4"
    _model(store, tiny_gguf, "myteam/coder:Q4", system="x")  # written under the stored spelling
    assert [m.display for m in store.list()] == ["MyTeam/Coder:Q4"]


def test_copy_shares_the_weights_blob(env, tiny_gguf):
    store = open_store()
    model = _model(store, tiny_gguf, "tiny", template="{{ .Prompt }}")
    copied = store.copy("tiny", "myteam/tiny-copy:v1")
    src = store.require("tiny")
    assert copied.manifest_path.read_bytes() == src.manifest_path.read_bytes() and copied.digest == src.digest
    assert store.model_path("myteam/tiny-copy:v1") == store.model_path("tiny") == store.blob_path(model.digest)
    assert len(list(store.blobs_dir.iterdir())) == 3  # weights, config, template: nothing copied
    assert store.copy("tiny", "TINY:latest").display == "tiny:latest"  # onto itself: nothing to do
    with pytest.raises(NotFoundError):
        store.copy("nope", "x")


def test_delete_keeps_blobs_another_model_uses(env, tiny_gguf):
    store = open_store()
    model = _model(store, tiny_gguf, "a", template="T", params='{"temperature":0.2}\n')
    store.copy("a", "b")
    _model(store, tiny_gguf, "c", system="derived")  # the same weights and config, its own system layer
    blobs = lambda: {p.name for p in store.blobs_dir.iterdir()}
    m_a, m_c = store.read_manifest("a"), store.read_manifest("c")
    assert m_a.config.digest == m_c.config.digest
    assert len(blobs()) == 5
    assert store.delete("a") == [] and len(blobs()) == 5  # b uses everything a used
    removed = store.delete("b")
    assert sorted(removed) == sorted([m_a.layer("template").digest, m_a.layer("params").digest])
    assert blobs() == {f"sha256-{d[7:]}" for d in m_c.digests()}
    assert store.model_path("c") == store.blob_path(model.digest)
    assert sorted(store.delete("c")) == sorted(m_c.digests())
    assert blobs() == set() and list(store.manifests_dir.iterdir()) == []
    assert os.path.exists(tiny_gguf)  # the file the weights were linked from is untouched
    with pytest.raises(NotFoundError, match="^model 'c' not found$"):
        store.delete("c")


# -- resolve, OLLAMA_MODELS, --models-dir --------------------------------------------------

def test_resolve_three_forms_to_one_name(env, tiny_gguf):
    store = open_store()
    _model(store, tiny_gguf, "smollm2")
    forms = ("smollm2", "smollm2:latest", "registry.ollama.ai/library/smollm2:latest")
    assert {canonical_name(f) for f in forms} == {"smollm2:latest"}
    assert {resolve_model(f) for f in forms} == {store.model_path("smollm2")}
    assert canonical_name("SmolLM2-135M-Instruct") == "smollm2:latest"  # a registry alias
    assert resolve_model("SmolLM2-135M-Instruct") == store.model_path("smollm2")
    assert canonical_name("not a name") == "not a name"
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("other:7b")
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, NotFoundError)
    with pytest.raises(ModelNotFoundError):
        resolve_model("a/b/c/d")


def _fake_ollama_store(root: Path, gguf: str) -> str:
    """What `ollama pull` leaves: a GGUF blob, a config, a template and params, a manifest."""
    blobs = root / "blobs"
    blobs.mkdir(parents=True)

    def blob(data: bytes, media: str) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / f"sha256-{digest}").write_bytes(data)
        return {"mediaType": media, "digest": f"sha256:{digest}", "size": len(data)}

    weights = Path(gguf).read_bytes()
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": blob(b'{"model_format":"gguf","model_family":"llama","model_families":["llama"],'
                               b'"model_type":"1M","file_type":"F32","architecture":"amd64","os":"linux"}',
                               "application/vnd.docker.container.image.v1+json"),
                "layers": [blob(weights, "application/vnd.ollama.image.model"),
                           blob(b"{{ .Prompt }}", "application/vnd.ollama.image.template"),
                           blob(b'{"stop":["</s>"]}', "application/vnd.ollama.image.params")]}
    path = root / "manifests" / "registry.ollama.ai" / "library" / "tinyllama" / "latest"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(manifest, indent=2))  # Ollama writes compact JSON; any JSON reads
    return manifest["layers"][0]["digest"]


def test_ollama_models_read_in_place(env, tiny_gguf, tmp_path, monkeypatch):
    ollama = tmp_path / "dot-ollama" / "models"
    digest = _fake_ollama_store(ollama, tiny_gguf)
    before = _files(ollama)
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama))
    path = resolve_model("tinyllama")
    assert path == ollama / "blobs" / f"sha256-{digest[7:]}"  # the user's blob itself: no copy
    [row] = list_models()
    assert (row["name"], row["path"]) == ("tinyllama:latest", str(path))
    assert row["size"] == sum(p.stat().st_size for p in (ollama / "blobs").iterdir())
    store = open_store()
    assert store.params("tinyllama") == {"stop": ["</s>"]}
    assert store.layer_text("tinyllama:latest", "template") == "{{ .Prompt }}"
    assert _files(ollama) == before  # nothing written, nothing touched
    assert not (env / "models").exists()
    # writes go to that store too, as Ollama's would
    store.copy("tinyllama", "mine")
    assert (ollama / "manifests" / "registry.ollama.ai" / "library" / "mine" / "latest").is_file()
    remove("mine")
    assert _files(ollama) == before


def test_models_dir_for_the_server(env, tiny_gguf, tmp_path):
    from kvserve.serving.args import parse_args
    from kvserve.serving.manager import ModelManager
    from kvserve.serving.state import ServerState

    ollama = tmp_path / "elsewhere"
    digest = _fake_ollama_store(ollama, tiny_gguf)
    before = _files(ollama)
    st = ServerState(parse_args(["--models-dir", str(ollama)]), ModelManager(lambda spec: None))
    for name in ("tinyllama", "tinyllama:latest", "registry.ollama.ai/library/tinyllama:latest", "TinyLlama"):
        spec = st.resolve(name)
        assert (spec.name, spec.path) == ("tinyllama:latest", str(ollama / "blobs" / f"sha256-{digest[7:]}"))
    assert [m.name for m in st.catalog()] == ["tinyllama:latest"]
    assert _files(ollama) == before
    with pytest.raises(NotFoundError):
        ServerState(parse_args([]), ModelManager(lambda spec: None)).resolve("tinyllama")


# -- the old layout -------------------------------------------------------------------------

def test_old_layout_moves_in_without_copy(env, tiny_gguf):
    old_blobs = env / "blobs"
    old_blobs.mkdir(parents=True)
    (env / "manifests").mkdir()
    data = Path(tiny_gguf).read_bytes()
    hexd = hashlib.sha256(data).hexdigest()
    (old_blobs / f"sha256-{hexd}").write_bytes(data)
    inode = (old_blobs / f"sha256-{hexd}").stat().st_ino
    for name in ("tiny-a", "tiny-b"):  # two names, one blob (as issue #12's tests wrote them)
        (env / "manifests" / f"{name}.json").write_text(json.dumps({
            "schema_version": 1, "name": name, "digest": f"sha256:{hexd}", "filename": "t.gguf",
            "size": len(data), "format": "gguf", "source": {}, "created": ""}))
    (env / "manifests" / "gone.json").write_text(json.dumps({"name": "gone", "digest": "sha256:" + H["9"],
                                                             "size": 1}))

    path = resolve_model("tiny-a")
    store = open_store()
    assert path == store.blob_path(hexd) and path.stat().st_ino == inode  # linked or renamed, not copied
    assert path.stat().st_nlink == 1  # the old name is gone
    assert [m["name"] for m in list_models()] == ["tiny-a:latest", "tiny-b:latest"]
    assert store.model_path("tiny-b") == path
    assert sorted(p.name for p in (env / "manifests").iterdir()) == ["gone.json"]  # its blob is missing: kept
    assert not old_blobs.exists()
    assert open_store().list() == store.list()  # a second open moves nothing
    store.delete("tiny-a")
    assert path.exists()
    store.delete("tiny-b")
    assert not path.exists()


def test_import_file_through_a_symlink_stores_the_content(tmp_path):
    """Review finding: a symlink given to import_file was hard-linked as the link itself (a
    relative link then dangles inside blobs/)."""
    import os

    from kvserve.store import open_store

    (tmp_path / "real.bin").write_bytes(b"weights" * 100)
    os.symlink("real.bin", tmp_path / "link.bin")
    st = open_store(tmp_path / "models")
    blob = st.blob_path(st.import_file(tmp_path / "link.bin").digest)
    assert not blob.is_symlink() and blob.read_bytes() == b"weights" * 100


def test_find_tries_every_case_insensitive_match(tmp_path, tiny_gguf):
    """Review finding: a copy onto REGISTRY.OLLAMA.AI/LIBRARY/newone:Latest made a second tree that
    list showed but show/delete could not find (the walk took the first matching folder only)."""
    from kvserve.store import open_store

    st = open_store(tmp_path / "models")
    w = st.import_file(tiny_gguf)
    st.create("base", [st.layer_for_blob(w.digest, "model")])
    st.copy("base", "REGISTRY.OLLAMA.AI/LIBRARY/newone:Latest")
    found = st.find("newone")
    assert found is not None and st.get("newone:latest") is not None
    st.delete("newone")
    assert st.find("newone") is None and st.get("base") is not None
