"""The llama-server and Ollama faces' route tables (issue 33, Build 5: routes declared as a table):
the same paths, methods and order as before the table (Starlette's first match wins), and the
routes with path parameters still hand them to their handlers. The lists were read from the
routers as they were registered with decorators (commit 699f65b)."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from kvserve.app import build_app
from kvserve.faces import llama_api, ollama_api
from kvserve.serving.args import parse_args
from kvserve.serving.state import ServerState

LLAMA_ROUTES = [
    ("/v1/health", ["GET"]),
    ("/health", ["GET"]),
    ("/models", ["GET"]),
    ("/v1/models", ["GET"]),
    ("/v1/models/{model_id:path}", ["GET"]),
    ("/props", ["GET"]),
    ("/props", ["POST"]),
    ("/completion", ["POST"]),
    ("/completions", ["POST"]),
    ("/infill", ["POST"]),
    ("/version", ["GET"]),
    ("/ping", ["POST"]),
    ("/ping", ["GET"]),
    ("/tokenize", ["POST"]),
    ("/detokenize", ["POST"]),
    ("/apply-template", ["POST"]),
    ("/slots", ["GET"]),
    ("/slots/{id_slot}", ["POST"]),
    ("/metrics", ["GET"]),
    ("/lora-adapters", ["GET"]),
    ("/lora-adapters", ["POST"]),
]

OLLAMA_ROUTES = [
    ("/api/version", ["GET"]),
    ("/api/generate", ["POST"]),
    ("/api/chat", ["POST"]),
    ("/api/tags", ["GET"]),
    ("/api/ps", ["GET"]),
    ("/api/show", ["POST"]),
    ("/api/copy", ["POST"]),
    ("/api/delete", ["DELETE"]),
    ("/api/blobs/{digest}", ["GET"]),
    ("/api/blobs/{digest}", ["POST"]),
    ("/api/embed", ["POST"]),
    ("/api/embeddings", ["POST"]),
    ("/api/pull", ["POST"]),
    ("/api/push", ["POST"]),
    ("/api/create", ["POST"]),
]


@pytest.fixture
def state(tmp_path) -> ServerState:
    return ServerState(parse_args(["--no-preload", "--models-dir", str(tmp_path / "models")]))


@pytest.mark.parametrize("face, want", [(llama_api, LLAMA_ROUTES), (ollama_api, OLLAMA_ROUTES)],
                         ids=["llama", "ollama"])
def test_routes_keep_their_paths_methods_and_order(state, face, want):
    routes = face.build_router(state).routes
    assert [(r.path, sorted(r.methods)) for r in routes] == want
    # FastAPI reads nothing for the handlers: no query, body or dependency parameters
    assert [r.path for r in routes if r.dependant.query_params or r.dependant.body_params
            or r.dependant.dependencies] == []


#: (method, path, status, body) as the decorated routes answered them with no model and no flags
ANSWERS = [
    ("GET", "/v1/models/no/such", 404,
     b'{"error":{"code":404,"message":"model \'no/such\' not found","type":"not_found_error"}}'),
    ("POST", "/slots/0?action=save", 501,
     b'{"error":{"code":501,"message":"This server does not support slots action. Start it with '
     b'`--slot-save-path`","type":"not_supported_error"}}'),
    ("GET", "/api/blobs/sha256:12", 400, b'{"error":"invalid digest format"}'),
    ("POST", "/api/blobs/sha256:12", 400, b'{"error":"invalid digest format"}'),
    ("HEAD", "/api/blobs/sha256:" + "0" * 64, 404, b""),
    ("GET", "/v1/health", 200, b'{"status":"ok"}'),
    ("POST", "/ping", 200, b""),
    ("GET", "/api/version", 200, b'{"version":"0.35.1"}'),
    ("GET", "/api/tags", 200, b'{"models":[]}'),
    ("POST", "/api/show", 400, b'{"error":"missing request body"}'),
    ("PUT", "/api/show", 405, b'{"error":"405 method not allowed"}'),
]


def test_routes_answer_as_before(state):
    with TestClient(build_app(state), base_url="http://127.0.0.1") as client:
        got = [(m, p, (r := client.request(m, p)).status_code, r.content) for m, p, _, _ in ANSWERS]
    assert got == ANSWERS
