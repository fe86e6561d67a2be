"""Vertex AI's custom-container protocol (``AIP_MODE=PREDICTION``), as llama-server serves it
(issue 32, Build 1: llama.cpp's ``unit/test_compat_gcp.py``): :mod:`kvserve.faces.gcp`."""

from __future__ import annotations

import pytest

from kvserve.faces.gcp import GcpSettings, PredictRouteConflict, gcp_format


@pytest.mark.parametrize("path,alias", [
    ("/v1/chat/completions", "chatCompletions"), ("/chat/completions", "chatCompletions"),
    ("/apply-template", "applyTemplate"), ("/completion", "completion"), ("/v1/completions", "completions"),
    ("/slots/{id_slot}", "slots"), ("/v1/messages/count_tokens", "messagesCountTokens"), ("/v1", "v1"),
    ("/api/chat", "apiChat"),
])
def test_gcp_format(path, alias):
    assert gcp_format(path) == alias


def test_settings_from_env():
    assert GcpSettings.from_env({}) == GcpSettings(False, "", "/predict", 8080)
    assert GcpSettings.from_env({"AIP_MODE": "prediction", "AIP_HTTP_PORT": "1"}).enabled is False
    on = GcpSettings.from_env({"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "9123", "AIP_PREDICT_ROUTE": "run",
                               "AIP_HEALTH_ROUTE": "/alive"})
    assert on == GcpSettings(True, "/alive", "/run", 9123)
    assert GcpSettings.from_env({"AIP_MODE": "PREDICTION", "AIP_PREDICT_ROUTE": ""}).predict_route == "/predict"
    with pytest.raises(ValueError, match="AIP_HTTP_PORT must be a port number"):
        GcpSettings.from_env({"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "x"})
    for bad in ("65536", "99999", "-1"):  # --port's range: bind() would raise OverflowError at start
        with pytest.raises(ValueError, match="AIP_HTTP_PORT must be a port number"):
            GcpSettings.from_env({"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": bad})
    assert GcpSettings.from_env({"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "65535"}).port == 65535


def _client(path, d, settings: GcpSettings, *flags):
    from starlette.testclient import TestClient

    from kvserve.app import build_app
    from kvserve.serving.args import parse_args
    from kvserve.serving.state import ServerState

    state = ServerState(parse_args(["-m", str(path), "-a", "tiny", "-c", "512", "-np", "2",
                                    "--models-dir", str(d / "models"), *flags]))
    c = TestClient(build_app(state, settings), base_url="http://127.0.0.1")
    c.__enter__()
    c.portal.call(state.preload)
    c.state = state
    return c


@pytest.fixture(scope="module")
def gcp(tiny_gguf, tmp_path_factory):
    d = tmp_path_factory.mktemp("gcp")
    c = _client(tiny_gguf, d, GcpSettings(True, "/alive", "/predict", 8080), "--api-key", "k1")
    c.headers["Authorization"] = "Bearer k1"
    yield c
    c.portal.call(c.state.manager.shutdown)
    c.__exit__(None, None, None)


def test_predict_runs_each_instance_as_its_route(gcp):
    chat = {"max_tokens": 3, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    cmpl = {"prompt": "the cat", "n_predict": 2, "temperature": 0}
    r = gcp.post("/predict", json={"instances": [
        {"@requestFormat": "chatCompletions", **chat},
        {"@requestFormat": "/completion", **cmpl, "stream": True},  # a path; stream is turned off
        {"@requestFormat": "tokenize", "content": "the cat"},
        {"@requestFormat": "nope"}, 3, {"@requestFormat": 1},
        {"@requestFormat": "completion"},  # the route's own 400, whatever its status
    ]})
    assert r.status_code == 200, r.text
    p = r.json()["predictions"]
    assert len(p) == 7
    direct = gcp.post("/v1/chat/completions", json=chat).json()
    assert p[0]["object"] == "chat.completion" and p[0]["choices"][0]["message"] == direct["choices"][0]["message"]
    assert p[0]["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"] == 3
    ran = gcp.post("/completion", json=cmpl).json()
    assert (p[1]["content"], p[1]["tokens_predicted"], p[1]["stop"]) == (ran["content"], 2, True)
    assert p[2] == gcp.post("/tokenize", json={"content": "the cat"}).json()
    assert p[3] == {"error": {"code": 400, "message": "no handler registered for @requestFormat: nope",
                              "type": "invalid_request_error"}}
    assert p[4]["error"]["message"] == "each instance must be a JSON object"
    assert p[5]["error"]["message"] == "each instance must include a string @requestFormat"
    assert p[6] == {"error": {"code": 400, "message": '"prompt" must be provided', "type": "invalid_request_error"}}


def test_predict_refuses_bad_bodies_and_streams(gcp):
    for body, msg in [({"x": 1}, "request body must include an array field named instances"),
                      ({"instances": {}}, "request body must include an array field named instances"),
                      ({"instances": [{}] * 129}, "instances array exceeds maximum size of 128")]:
        r = gcp.post("/predict", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"] == msg, r.text
    # Ollama's /api/generate streams unless told not to: an instance runs it with stream false (an
    # absent stream would always get "predict route does not support streaming responses")
    r = gcp.post("/predict", json={"instances": [{"@requestFormat": "apiGenerate", "model": "tiny",
                                                  "prompt": "hi", "options": {"num_predict": 1}}]})
    got = r.json()["predictions"][0]
    assert (got["done"], got["done_reason"], got["eval_count"]) == (True, "length", 1), got


def test_predict_needs_the_key_and_instances_carry_it(gcp):
    body = {"instances": [{"@requestFormat": "tokenize", "content": "a"}]}
    assert gcp.post("/predict", json=body, headers={"Authorization": "Bearer bad"}).status_code == 401
    assert gcp.get("/alive").json() == {"status": "ok"}


def test_predict_route_conflict_and_off(tiny_gguf, tmp_path):
    from kvserve.app import build_app
    from kvserve.serving.args import parse_args
    from kvserve.serving.state import ServerState

    state = ServerState(parse_args(["-m", str(tiny_gguf), "--models-dir", str(tmp_path / "models")]))
    with pytest.raises(PredictRouteConflict, match="AIP_PREDICT_ROUTE=/completion conflicts"):
        build_app(state, GcpSettings(True, "", "/completion", 8080))
    from kvserve.faces.gcp import _flat_routes

    paths = {getattr(r, "path", None) for r in _flat_routes(build_app(state, GcpSettings()).routes)}
    assert "/predict" not in paths and "/completion" in paths
