"""Several models behind one server (issue #12): a store with the default GGUF and a copy of it
with other metadata, requests that alternate by ``model``, ``--max-loaded-models 1``,
``keep_alive: 0``, /v1/models, 404 for unknown names, and memory returned on unload."""

from __future__ import annotations

import io
import time
from pathlib import Path

import httpx
import pytest

from kvserve.serving.manager import ModelSpec
from kvserve.serving.chat_runner import estimate_runner_memory, pid_rss_bytes
from kvserve.store import Layer, Store, media_type

pytestmark = pytest.mark.slow

CHAT = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 6, "temperature": 0}


def _add(home: Path, name: str, data_path: Path | None = None, data: bytes | None = None) -> Path:
    """Put a GGUF into ``home``'s store (Ollama's layout) under ``name`` (hard link when possible)."""
    store = Store(home / "models")
    w = store.import_file(data_path) if data is None else store.write_blob(io.BytesIO(data))
    store.create(name, [Layer(media_type("model"), w.digest, w.size)])
    return store.blob_path(w.digest)


@pytest.fixture(scope="module")
def two_model_home(smollm2_path, tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("home")
    _add(home, "smollm2", Path(smollm2_path))
    data = bytearray(Path(smollm2_path).read_bytes())
    i = data.index(b"general.name")
    j = data.index(b"Smollm2", i)  # same length: the header stays valid, the digest changes
    data[j:j + 7] = b"Smollm9"
    _add(home, "smol-copy", data=bytes(data))
    return home


def _models(srv) -> dict[str, str]:
    d = httpx.get(srv.base_url + "/v1/models", timeout=30).json()
    return {m["id"]: m["status"]["value"] for m in d["data"]}


def _chat(srv, model: str, **extra) -> dict:
    r = httpx.post(srv.base_url + "/v1/chat/completions", json={**CHAT, "model": model, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_two_models_alternate_and_unload(start_server, two_model_home, smollm2_path):
    srv = start_server("--max-loaded-models", "1", "-c", "2048", "-np", "1", "--metrics", model="",
                       env={"KVSERVE_HOME": str(two_model_home)})
    assert _models(srv) == {"smol-copy:latest": "unloaded", "smollm2:latest": "loaded"}  # the default is preloaded
    d = httpx.get(srv.base_url + "/v1/models", timeout=30).json()
    entry = {m["id"]: m for m in d["data"]}["smol-copy:latest"]
    assert entry["max_model_len"] == 2048 and entry["root"] == "smol-copy:latest"  # no key: no store path (issue 31)
    assert entry["object"] == "model"

    a = _chat(srv, "smollm2")
    b = _chat(srv, "smol-copy")  # -> unload smollm2 (make room), load smol-copy
    assert _models(srv) == {"smol-copy:latest": "loaded", "smollm2:latest": "unloaded"}
    c = _chat(srv, "registry.ollama.ai/library/smollm2:latest")  # the same runner
    assert (a["model"], b["model"], c["model"]) == ("smollm2:latest", "smol-copy:latest", "smollm2:latest")
    # the copy has the same weights: greedy text is the same, token for token
    assert a["choices"][0]["message"] == b["choices"][0]["message"] == c["choices"][0]["message"]
    assert a["usage"] == b["usage"] == c["usage"]
    log = srv.log()
    assert log.count("model manager: unload 'smollm2:latest' (make room)") == 1
    assert log.count("model manager: unload 'smol-copy:latest' (make room)") == 1
    assert log.index("unload 'smollm2:latest' (make room)") < log.index("load 'smol-copy:latest'")

    # unknown names: 404 in each dialect's envelope
    r = httpx.post(srv.base_url + "/v1/chat/completions", json={**CHAT, "model": "nope"}, timeout=30)
    assert (r.status_code, r.json()) == (404, {"error": {"code": 404, "message": "model 'nope' not found",
                                                         "type": "not_found_error"}})
    r = httpx.post(srv.base_url + "/completion", json={"prompt": "x", "model": "nope:7b"}, timeout=30)
    assert (r.status_code, r.json()["error"]["message"]) == (404, "model 'nope:7b' not found")
    assert httpx.get(srv.base_url + "/v1/models/smol-copy", timeout=30).json()["id"] == "smol-copy:latest"
    assert httpx.get(srv.base_url + "/v1/models/nope", timeout=30).status_code == 404

    # keep_alive 0: unloaded as soon as the request ends, and the memory goes back. A constrained
    # request first builds the runner's grammar compiler (xgrammar's import and vocabulary table),
    # which the server otherwise builds at its first idle moment: it must not land between the two
    # measurements
    _chat(srv, "smollm2", response_format={"type": "json_object"}, max_tokens=4)
    time.sleep(0.5)
    loaded_rss = pid_rss_bytes(srv.proc.pid)
    _chat(srv, "smollm2", keep_alive=0)
    deadline = time.monotonic() + 20
    unloaded = {"smol-copy:latest": "unloaded", "smollm2:latest": "unloaded"}
    while time.monotonic() < deadline and _models(srv) != unloaded:
        time.sleep(0.1)
    assert _models(srv) == unloaded
    time.sleep(1.0)  # the engine thread stops and the heap is trimmed in a worker thread
    after_rss = pid_rss_bytes(srv.proc.pid)
    from kvserve.serving.args import parse_args

    weights = estimate_runner_memory(parse_args(["-c", "2048", "-np", "1"]),
                                     ModelSpec("smollm2", smollm2_path)).weights
    freed = loaded_rss - after_rss
    print(f"RSS loaded {loaded_rss >> 20} MiB, after unload {after_rss >> 20} MiB, freed {freed >> 20} MiB, "
          f"weights {weights >> 20} MiB")
    assert freed >= 0.8 * weights, (loaded_rss, after_rss, weights)
    assert "model manager: unload 'smollm2:latest' (keep_alive 0)" in srv.log()

    m = httpx.get(srv.base_url + "/metrics", timeout=30).text
    assert 'kvserve:model_unloads_total{reason="make room"} 2' in m
    assert 'kvserve:model_unloads_total{reason="keep_alive 0"} 1' in m
    assert "kvserve:models_loaded 0" in m and "kvserve:model_loads_total 3" in m
    # the next request loads it again; the event loop serves others meanwhile (the load runs in a
    # worker thread): /v1/models answers while the log says the load began and before it ended
    import threading

    done = {}
    t = threading.Thread(target=lambda: done.setdefault("r", _chat(srv, "smol-copy")))
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and srv.log().count("manager: load 'smol-copy:latest'") < 2:
        time.sleep(0.02)
    statuses = _models(srv)
    loaded_before = srv.log().count("'smol-copy:latest' loaded,")
    t.join(120)
    assert loaded_before == 1  # /v1/models answered while the second load of smol-copy ran (~4 s)
    assert statuses["smol-copy:latest"] == "loading"
    assert done["r"]["choices"][0]["message"] == a["choices"][0]["message"]
    m = httpx.get(srv.base_url + "/metrics", timeout=30).text
    assert 'llamacpp:requests_processing{model="smol-copy:latest"} 0' in m


def test_props_leaves_keep_alive_alone(start_server, two_model_home):
    """Review finding: GET /props?model= counted as a request with the default keep_alive and
    undid a client's keep_alive -1."""
    srv = start_server("--keep-alive", "2s", "--no-preload", "-c", "2048", "-np", "1", model="",
                       env={"KVSERVE_HOME": str(two_model_home)})
    assert _models(srv) == {"smol-copy:latest": "unloaded", "smollm2:latest": "unloaded"}
    _chat(srv, "smol-copy", keep_alive=-1)
    r = httpx.get(srv.base_url + "/props", params={"model": "smol-copy"}, timeout=30)
    assert r.status_code == 200 and r.json()["model_alias"] == "smol-copy:latest"
    time.sleep(3.5)  # past the server's 2 s default
    assert _models(srv)["smol-copy:latest"] == "loaded"
    _chat(srv, "smol-copy", keep_alive="1s")  # the latest request's keep_alive wins
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _models(srv)["smol-copy:latest"] != "unloaded":
        time.sleep(0.2)
    assert _models(srv)["smol-copy:latest"] == "unloaded"
