"""Ollama's environment on ``kvserve serve`` and the unlimited ``num_predict`` guard (issue 32, build 3)."""

from __future__ import annotations

import logging

import pytest
from servers import app_client

from kvserve.serving.args import parse_args

OLLAMA_ENV = {"OLLAMA_HOST": "0.0.0.0:11500", "OLLAMA_NUM_PARALLEL": "3", "OLLAMA_CONTEXT_LENGTH": "2048",
              "OLLAMA_KV_CACHE_TYPE": "q8_0", "OLLAMA_FLASH_ATTENTION": "1"}


def test_serve_reads_ollamas_environment():
    a = parse_args(["-m", "x.gguf"], environ=OLLAMA_ENV)
    assert (a.host, a.hosts, a.port) == ("0.0.0.0", ["0.0.0.0"], 11500)
    # Ollama's context length is per sequence: 3 slots of 2048 tokens (-c is the total they split)
    assert (a.parallel, a.ctx_size, a.cache_type_k, a.cache_type_v) == (3, 6144, "q8_0", "q8_0")
    assert a.engine_config().n_ctx_slot(8192) == 2048
    notes = [text for _, text in a.flag_notes]
    assert "listening address from OLLAMA_HOST=0.0.0.0:11500" in notes
    assert any(t.startswith("flag OLLAMA_FLASH_ATTENTION=1: no effect here: ") for t in notes), notes
    assert (logging.INFO, "listening address from OLLAMA_HOST=0.0.0.0:11500") in a.flag_notes


@pytest.mark.parametrize("value,host,port", [
    ("127.0.0.1", "127.0.0.1", 11434), (":9000", "0.0.0.0", 9000), ("http://[::1]:7000", "::1", 7000),
    ("example.internal:8081", "example.internal", 8081),
])
def test_ollama_host_forms(value, host, port):
    a = parse_args(["-m", "x.gguf"], environ={"OLLAMA_HOST": value})
    assert (a.host, a.port) == (host, port)


def test_precedence_flag_then_llama_arg_then_kvserve_then_ollama():
    env = {**OLLAMA_ENV, "LLAMA_ARG_N_PARALLEL": "2", "KVSERVE_HOST": "127.0.0.2"}
    a = parse_args(["-m", "x.gguf", "-c", "1024", "-ctk", "f16"], environ=env)
    assert (a.ctx_size, a.parallel, a.cache_type_k, a.cache_type_v) == (1024, 2, "f16", "q8_0")
    assert (a.host, a.port) == ("127.0.0.2", 8080)  # KVSERVE_HOST first; its port defaults to kvserve's
    b = parse_args(["-m", "x.gguf", "--port", "9001"], environ=OLLAMA_ENV)
    assert (b.host, b.port) == ("127.0.0.1", 9001)  # --host/--port given: the variables are not read
    c = parse_args(["-m", "x.gguf"], environ={**OLLAMA_ENV, "LLAMA_ARG_HOST": "127.0.0.3"})
    assert (c.host, c.port) == ("127.0.0.3", 8080)
    e = parse_args(["-m", "x.gguf"], environ={"OLLAMA_CONTEXT_LENGTH": "2048"})  # -np auto: one shared pool
    assert (e.ctx_size, e.parallel) == (2048, -1)
    f = parse_args(["-m", "x.gguf", "-np", "2", "-kvu"], environ={"OLLAMA_CONTEXT_LENGTH": "2048"})
    assert f.ctx_size == 2048  # unified: every sequence may use all of it
    d = parse_args(["-m", "x.gguf"], environ={})
    assert (d.host, d.port, d.ctx_size, d.parallel) == ("127.0.0.1", 8080, 0, -1)


def _generate(client, num_predict, **options) -> tuple[dict, int]:
    """The answer and the n_predict the engine ran it with (the slot's params: exact on any CPU,
    unlike where a random model stops)."""
    r = client.post("/api/generate", json={"model": "tiny", "prompt": "the cat", "stream": False,
                                           "options": {"num_predict": num_predict, "temperature": 0, **options}})
    assert r.status_code == 200, r.text
    (slot,) = [s for s in client.get("/slots").json() if "params" in s]
    return r.json(), slot["params"]["n_predict"]


def _stopped(d: dict, limit: int) -> bool:
    """Ended by the model, or cut exactly at ``limit`` tokens."""
    return (d["done_reason"], d["eval_count"]) == ("length", limit) or \
        (d["done_reason"] == "stop" and 0 < d["eval_count"] <= limit)


def test_unlimited_num_predict_stops(tiny_gguf, tmp_path, monkeypatch):
    from kvserve.faces import ollama_api as ollama

    monkeypatch.setattr(ollama, "UNLIMITED_N_PREDICT", 40)  # the tiny model's context is small
    given = app_client(tiny_gguf, tmp_path / "a", "-np", "1")  # -c 512: 512 tokens a sequence
    own = app_client(tiny_gguf, tmp_path / "b", "-np", "1")
    own.state.args.ctx_size = 0  # as when neither -c nor OLLAMA_CONTEXT_LENGTH is given
    try:
        for n in (-1, -2):
            full, n_predict = _generate(given, n)  # a context was given: stop when it is full, as Ollama does
            assert n_predict == -1 and _stopped(full, 512 - len(full["context"]) + full["eval_count"]), full
            capped, n_predict = _generate(own, n)  # the model's own context: Ollama's default context length
            assert n_predict == 40 and _stopped(capped, 40), capped
        assert _generate(own, 10)[1] == 10  # a limit the request gives is its own
        assert _generate(given, 10)[1] == 10
    finally:
        for c in (given, own):
            c.portal.call(c.state.manager.shutdown)
            c.__exit__(None, None, None)


# -- options.use_mmap ----------------------------------------------------------------------------

def _store_client(tiny_gguf: str, d, extra: tuple[str, ...] = ()):
    """An in-process server without -m whose store holds the tiny model as ``tiny:latest``."""
    from starlette.testclient import TestClient

    from kvserve.app import build_app
    from kvserve.serving.state import ServerState
    from kvserve.store import Layer, Store, media_type

    store = Store(d / "models")
    w = store.import_file(tiny_gguf)
    store.create("tiny", [Layer(media_type("model"), w.digest, w.size)])
    state = ServerState(parse_args(["-c", "512", "-np", "1", "--models-dir", str(d / "models"), *extra]))
    c = TestClient(build_app(state), base_url="http://127.0.0.1")
    c.__enter__()
    c.state = state
    return c


@pytest.fixture
def load_modes(monkeypatch):
    """The weight memory mode ("mmap" / "read") of each GGUF load, in order; the server's own
    mode is the file's mapping (KVSERVE_MMAP=1)."""
    from kvserve.loaders import gguf

    modes: list[str] = []
    real = gguf._load_weight_memory

    def recording(packed, infos):
        modes.append(gguf._weight_memory())
        return real(packed, infos)

    monkeypatch.setattr(gguf, "_load_weight_memory", recording)
    monkeypatch.setenv("KVSERVE_MMAP", "1")
    return modes


def test_use_mmap_picks_the_weight_memory_of_the_load(tiny_gguf, tmp_path, load_modes, caplog):
    """Before: ``use_mmap`` was accepted without effect (one load, the server's mode). As Ollama: a
    changed value reloads the runner; the value the runner was loaded in does not; a request
    without it goes back to the server's mode (Ollama reloads when the runner's options differ)."""
    import ollama

    from kvserve.loaders import gguf

    # the official client's field (its Options model), as it sends it
    assert ollama.Options(use_mmap=False, num_predict=2).model_dump(exclude_none=True) == \
        {"use_mmap": False, "num_predict": 2}
    c = _store_client(tiny_gguf, tmp_path)
    steps = []
    try:
        with caplog.at_level(logging.INFO, logger="kvserve"):
            for options in (None, {"use_mmap": True}, {"use_mmap": False}, {"use_mmap": False}, None):
                r = c.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False,
                                                  "options": {"num_predict": 2, **(options or {})}})
                steps.append((r.json()["eval_count"], list(load_modes)))
            r = c.post("/api/chat", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                          "stream": False, "options": {"num_predict": 2, "use_mmap": False}})
            steps.append((r.json()["eval_count"], list(load_modes)))
            r = c.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False,
                                              "options": {"num_predict": 2, "use_mmap": "false"}})
            assert (r.status_code, r.json()) == (400, {"error": 'option "use_mmap" must be of type boolean'})
        assert steps == [(2, ["mmap"]), (2, ["mmap"]), (2, ["mmap", "read"]), (2, ["mmap", "read"]),
                         (2, ["mmap", "read", "mmap"]), (2, ["mmap", "read", "mmap", "read"])]
        assert c.state.manager.get("tiny:latest").runner.weight_memory == "read"
        assert gguf._WEIGHT_MEMORY == "auto"  # the process's mode is back to the server's after each load
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("use_mmap")]
        assert lines == ["use_mmap false: the weights are read into memory"] * 2
    finally:
        c.portal.call(c.state.manager.shutdown)
        c.__exit__(None, None, None)


def test_a_read_that_could_not_be_had_is_said_as_the_mapping(tiny_gguf, tmp_path, load_modes, monkeypatch):
    """use_mmap false where the private memory cannot be had (``_start_read`` None: the loader maps the
    file): the runner says "mmap", what it holds, so a later use_mmap true finds it loaded as asked
    (before, it said "read" and that request reloaded it for nothing)."""
    from kvserve.loaders import gguf

    monkeypatch.setattr(gguf, "_start_read", lambda path, infos: None)
    c = _store_client(tiny_gguf, tmp_path)
    try:
        for use_mmap in (False, True):
            r = c.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False,
                                              "options": {"num_predict": 2, "use_mmap": use_mmap}})
            assert (r.status_code, r.json()["eval_count"]) == (200, 2)
            assert c.state.manager.get("tiny:latest").runner.weight_memory == "mmap"
        assert load_modes == ["read"], (load_modes, c.state.manager.stats)  # one load: the second request found the mapping
    finally:
        c.portal.call(c.state.manager.shutdown)
        c.__exit__(None, None, None)


def test_use_mmap_of_a_model_given_with_m_is_logged_and_ignored(tiny_gguf, tmp_path, load_modes, caplog):
    c = app_client(tiny_gguf, tmp_path)
    try:
        with caplog.at_level(logging.INFO, logger="kvserve"):
            r = c.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False,
                                              "options": {"num_predict": 2, "use_mmap": False}})
        assert (r.status_code, r.json()["eval_count"], load_modes) == (200, 2, ["mmap"])
        assert "use_mmap false ignored: the model was given with -m (--mmap / --no-mmap hold its weights)" in \
            [r.getMessage() for r in caplog.records]
    finally:
        c.portal.call(c.state.manager.shutdown)
        c.__exit__(None, None, None)


def test_use_mmap_layers_as_ollamas_options():
    """The request's value over the model's params layer (a Modelfile's PARAMETER use_mmap); null is skipped."""
    from kvserve.faces.ollama_api import ollama_options

    assert ollama_options(None, None).use_mmap is None
    assert ollama_options({"use_mmap": False}, None).use_mmap is False
    assert ollama_options({"use_mmap": False}, {"use_mmap": True}).use_mmap is True
    assert ollama_options({"use_mmap": True}, {"use_mmap": None}).use_mmap is True


def test_use_mmap_picks_the_weight_memory_of_an_embedding_load(tiny_gguf, tmp_path, load_modes):
    """Before: /api/embed and /api/embeddings type-checked ``options.use_mmap`` and dropped it (the
    load kept the server's mode). Ollama's EmbedHandler schedules its runner with the request's
    options: the value picks the load's mode, a changed one reloads, as on /api/chat."""
    c = _store_client(tiny_gguf, tmp_path, ("--embeddings",))
    try:
        got = []
        for options in (None, {"use_mmap": False}, {"use_mmap": False}):
            r = c.post("/api/embed", json={"model": "tiny", "input": "hi", **({"options": options} if options else {})})
            got.append((r.status_code, len(r.json()["embeddings"][0]), list(load_modes)))
        r = c.post("/api/embeddings", json={"model": "tiny", "prompt": "hi", "options": {"use_mmap": True}})
        got.append((r.status_code, len(r.json()["embedding"]), list(load_modes)))
        r = c.post("/api/embed", json={"model": "tiny", "input": "hi", "options": {"use_mmap": 0}})
        assert (r.status_code, r.json()) == (400, {"error": 'option "use_mmap" must be of type boolean'})
        assert got == [(200, 64, ["mmap"]), (200, 64, ["mmap", "read"]), (200, 64, ["mmap", "read"]),
                       (200, 64, ["mmap", "read", "mmap"])]
        assert c.state.manager.get("tiny:latest").runner.weight_memory == "mmap"
    finally:
        c.portal.call(c.state.manager.shutdown)
        c.__exit__(None, None, None)
