"""Small wire details of issue 32, each as the real tool answers it.

- ``GET`` / ``DELETE /v1/responses/input_tokens``: the count route is POST-only; the answer is
  the server's for a method a route does not take (llama-server's 404 ``File Not Found``), not a
  lookup of a response whose id is ``input_tokens``.
"""

from __future__ import annotations

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
