"""Small wire details of issue 32, each as the real tool answers it.

- ``GET`` / ``DELETE /v1/responses/input_tokens``: the count route is POST-only; the answer is
  the server's for a method a route does not take (llama-server's 404 ``File Not Found``), not a
  lookup of a response whose id is ``input_tokens``.
- An embedding model on Ollama's ``/api/generate`` and ``/api/chat``: 400 ``"x" does not support
  generate`` / ``chat`` before loading, as Ollama checks the model's capabilities (an empty request
  too; ``keep_alive: 0`` still unloads).
- A bad token id in Ollama's ``context``: 400 naming ``context`` (Ollama's own answer is its
  llama-server child's 500 from ``/detokenize``).
"""

from __future__ import annotations

import httpx
import pytest
from starlette.testclient import TestClient

from kvserve.app import build_app
from kvserve.serving.args import parse_args
from kvserve.serving.state import ServerState

FILE_NOT_FOUND = {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}


@pytest.fixture
def app_client(tmp_path):
    state = ServerState(parse_args(["--no-preload", "--models-dir", str(tmp_path / "models")]))
    with TestClient(build_app(state), base_url="http://127.0.0.1") as client:
        yield client


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/responses/input_tokens"), ("DELETE", "/v1/responses/input_tokens"),
    ("GET", "/responses/input_tokens"), ("GET", "/v1/responses"),
])
def test_count_route_is_post_only(app_client, method, path):
    r = app_client.request(method, path)
    assert (r.status_code, r.json()) == (404, FILE_NOT_FOUND)


def test_other_ids_are_still_looked_up(app_client):
    for method in ("GET", "DELETE"):
        r = app_client.request(method, "/v1/responses/resp_0123")
        assert (r.status_code, r.json()) == (404, {"error": {"code": 404, "type": "not_found_error",
                                                             "message": "Response with id 'resp_0123' not found."}})


# ------------------------------------------------------------------------ Ollama's request checks


@pytest.fixture(scope="module")
def bert_server(tmp_path_factory):
    """A tiny random BERT (an embedding model) served with -m."""
    pytest.importorskip("transformers", reason="transformers is a test-only dependency ([test] extra)")
    from embed_conftest import write_tiny_bert
    from servers import spawn

    d = tmp_path_factory.mktemp("bert")
    srv = spawn(str(write_tiny_bert(d / "tiny-bert", seed=5)), ("--models-dir", str(d / "models")), d)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.mark.parametrize(("path", "body", "verb"), [
    ("/api/generate", {}, "generate"),
    ("/api/generate", {"prompt": "hello"}, "generate"),
    ("/api/generate", {"prompt": "hello", "stream": False}, "generate"),
    ("/api/chat", {}, "chat"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hello"}]}, "chat"),
])
def test_embedding_model_does_not_generate(bert_server, path, body, verb):
    """Ollama checks the model's capabilities before loading (v0.35.1 server/routes.go:
    ``scheduleRunner`` -> ``errCapabilityCompletion``): 400, the name as given; an empty request
    included (it no longer answers ``done_reason: "load"``)."""
    r = httpx.post(bert_server.url(path), json={"model": "my-bert", **body}, timeout=60)
    assert (r.status_code, r.json()) == (400, {"error": f'"my-bert" does not support {verb}'})


def test_embedding_model_unload_request_still_unloads(bert_server):
    """Ollama answers an empty request with ``keep_alive: 0`` (unload) before its capability check."""
    r = httpx.post(bert_server.url("/api/generate"), json={"model": "my-bert", "keep_alive": 0}, timeout=60)
    assert r.status_code == 200
    assert (r.json()["done"], r.json()["done_reason"]) == (True, "unload")


@pytest.fixture(scope="module")
def tiny_server(start_server_module, tiny_gguf):
    return start_server_module("-np", "1", "-c", "512", model=tiny_gguf)


@pytest.mark.parametrize("bad", [99_999_999, -3])
def test_bad_context_id_names_context(tiny_server, tiny_gguf, bad):
    from kvserve.loaders.tokenizer import Tokenizer

    n_vocab = Tokenizer.from_gguf_file(tiny_gguf).n_vocab
    r = httpx.post(tiny_server.url("/api/generate"), json={"model": "tiny", "prompt": "hi", "stream": False,
                                                           "context": [1, 2, bad, n_vocab]}, timeout=60)
    assert (r.status_code, r.json()) == (400, {"error": f"Field 'context': token id {bad} out of range [0, {n_vocab})"})
    r = httpx.post(tiny_server.url("/api/generate"), json={"model": "tiny", "prompt": "hi", "stream": False,
                                                           "context": [1, 2, n_vocab - 1], "options": {"num_predict": 1}},
                   timeout=60)
    assert r.status_code == 200 and r.json()["eval_count"] == 1
