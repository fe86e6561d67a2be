"""Ollama's ADAPTER (issue 34, item 4) on a real server, through the official ``ollama`` client
unchanged and ``kvserve create``/``kvserve show``: a LoRA GGUF (``create_blob`` + ``create(from_=...,
adapters=...)``) and a PEFT directory (its files uploaded; converted to one LoRA GGUF) are stored as
``application/vnd.ollama.image.adapter`` layers; the model answers as its base with the adapter merged
by hand in float32 (``tinylora.write_merged_hf_dir``) in every face; ``show`` lists ``ADAPTER``;
push and pull through a real OCI registry carry the layer; bad adapters are 400s with the reason
while other requests go on."""

from __future__ import annotations

import httpx
import pytest
import tinylora  # tests/ is on sys.path (tests/conftest.py)
from servers import app_client

ollama = pytest.importorskip("ollama")

from kvserve import cli
from kvserve.store import Store, media_type

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Name a color."}]
GREEDY = {"num_predict": 8, "temperature": 0}
ADAPTER = "application/vnd.ollama.image.adapter"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("ollama_adapter")
    return {"dir": d, "gguf": tinylora.write_gguf_adapter(d / "ad.gguf", seed=1),
            "peft": tinylora.write_peft_adapter(d / "peft", seed=2),
            "other": tinylora.write_gguf_adapter(d / "other.gguf", seed=3, n_ff=96),
            "m1": tinylora.write_merged_hf_dir(d / "m1", [(dict(seed=1), 1.0)]),
            "m2": tinylora.write_merged_hf_dir(d / "m2", [(dict(seed=2), 1.0)])}


@pytest.fixture(scope="module")
def reference(files):
    """Each merged model's greedy chat answer and completion token ids (in process)."""
    out = {}
    for key in ("m1", "m2"):
        (files["dir"] / f"ref_{key}").mkdir()
        c = app_client(files[key], files["dir"] / f"ref_{key}")
        try:
            chat = c.post("/api/chat", json={"model": "tiny", "messages": ASK, "stream": False, "options": GREEDY})
            done = c.post("/completion", json={"prompt": "hello world", "n_predict": 10, "temperature": 0,
                                               "return_tokens": True})
            out[key] = {"chat": chat.json()["message"]["content"], "ids": done.json()["tokens"]}
        finally:
            c.portal.call(c.state.manager.shutdown)
            c.__exit__(None, None, None)
    return out


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from test_ollama_client import Serve

    home = tmp_path_factory.mktemp("ahome")
    (home / "models").mkdir()
    s = Serve(home, "--no-preload", "-c", "1024", "-np", "1")
    s.home = home
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return ollama.Client(host=srv.base_url, timeout=120)


@pytest.fixture(scope="module")
def store(srv) -> Store:
    return Store(srv.home / "models")


@pytest.fixture(scope="module")
def tiny(client, tiny_gguf):
    assert client.create(model="tiny", files={"tiny.gguf": client.create_blob(tiny_gguf)}).status == "success"


@pytest.fixture(scope="module")
def tuned(client, tiny, files, store):
    """``tuned``: tiny + the GGUF adapter (create_blob + create(from_, adapters))."""
    digest = client.create_blob(files["gguf"])
    events = list(client.create(model="tuned", from_="tiny", adapters={"ad.gguf": digest}, stream=True))
    assert [e.status for e in events][-1] == "success"
    assert [(x.media_type, x.digest) for x in store.get("tuned").manifest.layers_of("adapter")] == [(ADAPTER, digest)]
    return digest


def _ids(srv, model: str) -> list[int]:
    r = httpx.post(srv.base_url + "/completion", json={"model": model, "prompt": "hello world", "n_predict": 10,
                                                      "temperature": 0, "return_tokens": True}, timeout=120)
    return r.json()["tokens"]


def test_gguf_adapter_answers_as_merged_in_every_face(srv, client, tuned, reference):
    want = reference["m1"]["chat"]
    assert client.chat(model="tuned", messages=ASK, options=GREEDY).message.content == want
    assert _ids(srv, "tuned") == reference["m1"]["ids"]
    assert _ids(srv, "tiny") != reference["m1"]["ids"]  # the base model alone answers otherwise
    o = httpx.post(srv.base_url + "/v1/chat/completions", json={"model": "tuned", "messages": ASK, "max_tokens": 8,
                                                                "temperature": 0}, timeout=120).json()
    assert (o["model"], o["choices"][0]["message"]["content"]) == ("tuned:latest", want)
    a = httpx.post(srv.base_url + "/v1/messages", json={"model": "tuned", "messages": ASK, "max_tokens": 8,
                                                        "temperature": 0}, timeout=120).json()
    assert a["content"][0]["text"] == want
    # llama-server's view of the runner: the adapter layer loaded at scale 1
    la = httpx.get(srv.base_url + "/lora-adapters", params={"model": "tuned"}, timeout=30).json()
    assert [(x["id"], x["scale"]) for x in la] == [(0, 1.0)]


def test_show_lists_the_adapter(client, tuned, store, capsys, monkeypatch, srv):
    text = client.show("tuned").modelfile
    blob = store.blob_path(tuned)
    assert f"\nADAPTER {blob}\n" in text and text.index("FROM ") < text.index("ADAPTER ")
    monkeypatch.setenv("KVSERVE_HOST", srv.base_url.removeprefix("http://"))
    monkeypatch.setenv("KVSERVE_HOME", str(srv.home))
    monkeypatch.delenv("OLLAMA_HOST", raising=False)
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    assert cli.main(["show", "tuned", "--modelfile"]) == 0
    assert f"\nADAPTER {blob}\n" in capsys.readouterr().out


def test_peft_dir_through_client_and_kvserve_create(srv, client, tiny, files, store, reference, capsys,
                                                    monkeypatch):
    peft = files["peft"]
    adapters = {n: client.create_blob(peft / n) for n in ("adapter_config.json", "adapter_model.safetensors")}
    events = [e.status for e in client.create(model="peft1", from_="tiny", adapters=adapters, stream=True)]
    assert "converting adapter" in events and events[-1] == "success"
    layer = store.get("peft1").manifest.layers_of("adapter")[0]
    assert layer.media_type == ADAPTER and store.blob_path(layer.digest).read_bytes()[:4] == b"GGUF"
    assert client.chat(model="peft1", messages=ASK, options=GREEDY).message.content == reference["m2"]["chat"]
    # kvserve create -f Modelfile with ADAPTER ./peft, against the server
    (files["dir"] / "Modelfile").write_text("FROM tiny\nADAPTER ./peft\n")
    monkeypatch.setenv("KVSERVE_HOST", srv.base_url.removeprefix("http://"))
    monkeypatch.setenv("KVSERVE_HOME", str(srv.home))
    monkeypatch.delenv("OLLAMA_HOST", raising=False)
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    assert cli.main(["create", "peft2", "-f", str(files["dir"] / "Modelfile")]) == 0
    err = capsys.readouterr().err
    assert "converting adapter" in err and err.rstrip().endswith("success")
    assert store.get("peft2").manifest.layers_of("adapter")[0].digest == layer.digest  # the same conversion
    assert _ids(srv, "peft2") == reference["m2"]["ids"]


def test_bad_adapters_are_400_and_others_go_on(srv, client, tiny, tuned, files, store, reference):
    other = client.create_blob(files["other"])
    with pytest.raises(ollama.ResponseError) as e:
        client.create(model="bad", from_="tiny", adapters={"other.gguf": other})
    assert e.value.status_code == 400 and "blk.0.ffn_gate" in e.value.error and "another base model" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.create(model="bad", from_="tiny", adapters={"a.gguf": tuned, "b.gguf": other})
    assert (e.value.status_code, e.value.error) == (400, "only one adapter is currently supported")
    base = store.get("tiny").manifest.layer("model").digest
    with pytest.raises(ollama.ResponseError) as e:
        client.create(model="bad", from_="tiny", adapters={"tiny.gguf": base})
    assert e.value.status_code == 400 and "is not a LoRA adapter" in e.value.error
    assert store.get("bad") is None
    assert client.chat(model="tuned", messages=ASK, options=GREEDY).message.content == reference["m1"]["chat"]


def test_push_pull_carries_the_adapter_layer(client, tuned, store, tmp_path, reference):
    ociregistry = pytest.importorskip("ociregistry")
    if ociregistry.registry_binary() is None:
        pytest.skip(ociregistry.MISSING)
    with ociregistry.running_registry(tmp_path / "registry") as reg:
        name = f"{reg.url.split('://')[-1]}/library/tuned:v1"
        client.copy("tuned", name)
        pushed = [p.status for p in client.push(name, insecure=True, stream=True)]
        assert pushed[-1] == "success" and any(p.startswith("pushing ") for p in pushed)
        # the registry holds the manifest with the adapter layer, and its blob
        m = httpx.get(f"{reg.url}/v2/library/tuned/manifests/v1",
                      headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"}, timeout=30).json()
        assert [x["digest"] for x in m["layers"] if x["mediaType"] == ADAPTER] == [tuned]
        assert httpx.head(f"{reg.url}/v2/library/tuned/blobs/{tuned}", timeout=30).status_code == 200
        client.delete(name)
        client.delete("tuned")
        assert not store.blob_path(tuned).exists()  # nothing else used it: the pull must bring it back
        pulled = [p.status for p in client.pull(name, insecure=True, stream=True)]
        assert pulled[-1] == "success"
        assert [x.digest for x in store.get(name).manifest.layers_of("adapter")] == [tuned]
        assert store.blob_path(tuned).is_file()
        assert client.chat(model=name, messages=ASK, options=GREEDY).message.content == reference["m1"]["chat"]
        assert media_type("adapter") == ADAPTER
