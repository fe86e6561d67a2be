"""The /api face on the wire (issue #13 item 4): NDJSON framing and content types, Go's time
format, Ollama's error texts and status codes, options layering (request over the model's params
layer over api.DefaultOptions), num_ctx reloading the runner, think, blobs, version, ``GET /``,
and the routes that are not there yet. The first tests need no server."""

from __future__ import annotations

import hashlib
import json
import logging
import re

import httpx
import pytest

from kvserve.faces.ollama_api import DEFAULT_OPTIONS, capabilities, go_time, ollama_options

GO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,9})?Z$")


# ------------------------------------------------------------------------ no server


def test_go_time_trims_zeros_as_go_does():
    assert go_time(1_700_000_000_000_000_000) == "2023-11-14T22:13:20Z"
    assert go_time(1_700_000_000_500_000_000) == "2023-11-14T22:13:20.5Z"
    assert go_time(1_700_000_000_000_000_001) == "2023-11-14T22:13:20.000000001Z"
    assert GO_TIME.match(go_time())


def test_default_options_are_ollamas():
    o = ollama_options(None, None)
    assert o.num_ctx is None
    assert o.sampling == {"top_k": 40, "top_p": 0.9, "min_p": 0.0, "typical_p": 1.0, "repeat_last_n": 64,
                          "temperature": 0.8, "repeat_penalty": 1.0, "presence_penalty": 0.0,
                          "frequency_penalty": 0.0, "seed": -1, "stop": [], "n_predict": -1}
    assert DEFAULT_OPTIONS["num_keep"] == 4


def test_options_layering_and_types(caplog):
    params = {"temperature": 0.2, "num_ctx": 16384, "stop": ["<|end|>", "###"]}
    with caplog.at_level(logging.WARNING, logger="kvserve.server"):
        o = ollama_options(params, {"temperature": 0, "num_predict": 5, "seed": 42.0, "mirostat": 2,
                                    "num_thread": 8, "top_p": None})
    assert o.num_ctx == 16384
    assert (o.sampling["temperature"], o.sampling["n_predict"], o.sampling["seed"]) == (0.0, 5, 42)
    assert o.sampling["stop"] == ["<|end|>", "###"] and o.sampling["top_p"] == 0.9
    assert 'invalid option provided: option "mirostat" is ignored' in caplog.text
    assert "num_thread" not in caplog.text  # known to Ollama: accepted silently
    assert ollama_options(None, {"num_predict": -2}).sampling["n_predict"] == -1
    from kvserve.faces.api_error import ApiError

    for opts, msg in (({"top_k": "40"}, 'option "top_k" must be of type integer'),
                      ({"temperature": "hot"}, 'option "temperature" must be of type float32'),
                      ({"stop": "x"}, None), ({"stop": [1]}, 'option "stop" must be of an array of strings'),
                      ({"use_mmap": 1}, 'option "use_mmap" must be of type boolean')):
        if msg is None:
            assert ollama_options(None, opts).sampling["stop"] == ["x"]
            continue
        with pytest.raises(ApiError) as e:
            ollama_options(None, opts)
        assert (e.value.status, e.value.message) == (400, msg)


def test_capabilities_from_template():
    assert capabilities("") == ["completion"]
    assert capabilities("{{ tools }}<tool_call>\n{{ x }}</tool_call>") == ["completion", "tools"]
    assert capabilities("<|im_start|>assistant\n<think>\n") == ["completion", "thinking"]


# ------------------------------------------------------------------------ one server


@pytest.fixture(scope="module")
def srv(smollm2_path, tmp_path_factory):
    from test_ollama_client import Serve, make_home

    home = make_home(tmp_path_factory.mktemp("ahome"), smollm2_path, params={"num_predict": 3, "stop": ["zzz"]},
                     system="You are terse.")
    s = Serve(home, "-c", "2048", "-np", "1")
    yield s
    s.stop()


def _post(srv, path: str, body, **kw) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, timeout=120, **kw)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "Name a color."}],
        "options": {"temperature": 0}}


@pytest.mark.slow
def test_root_version_and_missing_routes(srv):
    r = httpx.get(srv.base_url + "/")
    assert (r.status_code, r.text, r.headers["content-type"]) == (200, "Ollama is running", "text/plain; charset=utf-8")
    assert httpx.head(srv.base_url + "/").status_code == 200
    v = httpx.get(srv.base_url + "/api/version").json()
    assert re.fullmatch(r"\d+\.\d+\.\d+", v["version"])
    r = _post(srv, "/api/create", {"model": "x"})  # create itself: tests/api/test_ollama_create.py
    assert (r.status_code, r.json()) == (400, {"error": "neither 'from' or 'files' was specified"})
    # pull and push go to the registry the name says: a closed loopback port fails at once (500)
    closed = f"127.0.0.1:{_closed_port()}/library/tiny:latest"
    r = _post(srv, "/api/pull", {"model": closed, "insecure": True})
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert r.status_code == 200 and lines[0] == {"status": "pulling manifest"}
    assert lines[-1]["error"].startswith("pull model manifest: ") and "Connection refused" in lines[-1]["error"]
    for path in ("/api/pull", "/api/push"):
        r = _post(srv, path, {"model": closed, "insecure": True, "stream": False})
        assert r.status_code == 500 and set(r.json()) == {"error"}, r.text
    r = _post(srv, "/api/pull", {"model": "bad name!"})
    assert (r.status_code, r.json()) == (400, {"error": "invalid model name"})
    for path in ("/api/embed", "/api/embeddings"):
        r = _post(srv, path, {"model": "smollm2", "input": "hi", "prompt": "hi"})
        assert r.json() == {"error": "this model does not support embeddings"} and r.status_code == 400
        assert _post(srv, path, {"model": "nope", "input": "x"}).status_code == 404


@pytest.mark.slow
def test_ndjson_stream_is_the_default(srv):
    with httpx.stream("POST", srv.base_url + "/api/chat", json=CHAT, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert all(not x["done"] for x in lines[:-1])
    final = lines[-1]
    assert list(final) == ["model", "created_at", "message", "done", "done_reason", "total_duration",
                           "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
                           "eval_duration"]
    assert final["model"] == "smollm2" and GO_TIME.match(final["created_at"])
    assert final["message"] == {"role": "assistant", "content": ""}
    # the params layer's num_predict 3 applies when the request is silent
    assert (final["done_reason"], final["eval_count"]) == ("length", 3)
    assert final["total_duration"] >= final["load_duration"] and final["eval_duration"] > 0
    whole = _post(srv, "/api/chat", {**CHAT, "stream": False})
    assert whole.headers["content-type"] == "application/json; charset=utf-8"
    assert whole.json()["message"]["content"] == "".join(x["message"]["content"] for x in lines)


@pytest.mark.slow
def test_prompt_cache_shows_in_prompt_eval_count(srv):
    body = {**CHAT, "stream": False, "messages": [{"role": "user", "content": "A long question " * 20}]}
    first = _post(srv, "/api/chat", body).json()
    again = _post(srv, "/api/chat", body).json()
    assert first["prompt_eval_count"] > 40
    assert 1 <= again["prompt_eval_count"] < first["prompt_eval_count"]  # only uncached tokens count


@pytest.mark.slow
def test_system_layer_and_request_system(srv):
    base = {"model": "smollm2", "prompt": "Say hi.", "stream": False, "options": {"temperature": 0, "num_predict": 3}}
    with_layer = _post(srv, "/api/generate", base).json()
    own = _post(srv, "/api/generate", {**base, "system": "You are terse."}).json()
    other = _post(srv, "/api/generate", {**base, "system": "You are a pirate."}).json()
    assert with_layer["response"] == own["response"]
    assert with_layer["context"][:20] == own["context"][:20] != other["context"][:20]
    show = _post(srv, "/api/show", {"model": "smollm2"}).json()
    assert show["system"] == "You are terse."
    assert show["parameters"] == 'num_predict                    3\nstop                           "zzz"'
    assert "PARAMETER num_predict 3\nPARAMETER stop zzz\n" in show["modelfile"]
    assert 'SYSTEM You are terse.' in show["modelfile"]


@pytest.mark.slow
def test_errors_are_ollamas(srv):
    cases = [
        ("/api/chat", None, 400, "missing request body"),
        ("/api/chat", {"messages": []}, 400, "model is required"),
        ("/api/chat", {**CHAT, "model": "nope:7b"}, 404, "model 'nope:7b' not found"),
        ("/api/chat", {**CHAT, "options": {"top_k": "x"}}, 400, 'option "top_k" must be of type integer'),
        ("/api/chat", {**CHAT, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, 400,
         "vision is not supported"),
        ("/api/generate", {"model": "smollm2", "prompt": "x", "images": ["aGk="]}, 400, "vision is not supported"),
        ("/api/chat", {**CHAT, "think": True}, 400, '"smollm2" does not support thinking'),
        ("/api/generate", {"model": "smollm2", "prompt": "x", "suffix": "y"}, 400, '"smollm2" does not support insert'),
        ("/api/generate", {"model": "smollm2", "prompt": "x", "raw": True, "system": "s"}, 400,
         "raw mode does not support template, system, or context"),
        ("/api/show", {}, 400, "model is required"),
        ("/api/show", {"model": "nope"}, 404, "model 'nope' not found"),
        ("/api/copy", {"source": "smollm2", "destination": "bad name!"}, 400, 'destination "bad name!" is invalid'),
    ]
    for path, body, status, msg in cases:
        r = httpx.post(srv.base_url + path, content=b"" if body is None else json.dumps(body), timeout=60)
        assert (r.status_code, r.json()) == (status, {"error": msg}), (path, body)
    r = httpx.request("DELETE", srv.base_url + "/api/delete", json={"model": "nope"})
    assert (r.status_code, r.json()) == (404, {"error": "model 'nope' not found"})
    r = _post(srv, "/api/chat", {**CHAT, "format": 42})
    assert r.status_code == 400 and "format" in r.json()["error"]


@pytest.mark.slow
def test_num_ctx_reloads_the_runner(srv):
    def ctx() -> int:
        return httpx.get(srv.base_url + "/api/ps").json()["models"][0]["context_length"]

    _post(srv, "/api/generate", {"model": "smollm2", "prompt": "hi", "stream": False, "options": {"num_predict": 1}})
    assert ctx() == 2048
    r = _post(srv, "/api/generate", {"model": "smollm2", "prompt": "hi", "stream": False,
                                     "options": {"num_predict": 1, "num_ctx": 1024}})
    assert r.status_code == 200 and ctx() == 1024
    _post(srv, "/api/generate", {"model": "smollm2", "prompt": "hi", "stream": False,
                                 "options": {"num_predict": 1, "num_ctx": 1024}})
    assert srv.log().count("unload 'smollm2:latest' (reload)") == 1  # the same num_ctx again: no reload
    _post(srv, "/api/generate", {"model": "smollm2", "prompt": "hi", "stream": False, "options": {"num_predict": 1}})
    # a request that names no num_ctx gets the server's context again, as Ollama reloads to its default
    # (review finding: one client's num_ctx stuck for every later client)
    assert ctx() == 2048
    assert srv.log().count("unload 'smollm2:latest' (reload)") == 2


@pytest.mark.slow
def test_blobs(srv):
    data = b"not really a model" * 1000
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    url = srv.base_url + "/api/blobs/" + digest
    assert httpx.head(url).status_code == 404
    assert httpx.post(url, content=data).status_code == 201
    assert httpx.head(url).status_code == 200
    assert httpx.post(url, content=data).status_code == 200  # already there
    other = "sha256:" + "0" * 64
    r = httpx.post(srv.base_url + "/api/blobs/" + other, content=data)
    assert r.status_code == 400 and r.json()["error"].startswith("digest mismatch")
    assert httpx.head(srv.base_url + "/api/blobs/" + other).status_code == 404
    assert httpx.head(srv.base_url + "/api/blobs/sha256:xyz").status_code == 400


@pytest.mark.slow
def test_think(start_server, smollm2_path, tmp_path):
    from test_ollama_client import REPO, make_home

    home = make_home(tmp_path / "thome", smollm2_path)
    srv = start_server("--chat-template-file", str(REPO / "tests" / "templates" / "think.jinja"), "-c", "2048",
                       "-np", "1", model="", env={"KVSERVE_HOME": str(home)})
    body = {**CHAT, "stream": False, "options": {"temperature": 0, "num_predict": 40}}
    # the two compared requests share one cache state: a warm prompt's tail after its last cached
    # block is recomputed as a short chunk, which rounds unlike the cold prefill (docs/performance.md),
    # so a cold and a warm greedy run may part after a few tokens
    httpx.post(srv.url("/api/chat"), json=body, timeout=120).raise_for_status()
    on = httpx.post(srv.url("/api/chat"), json=body, timeout=120).json()
    streamed = []
    with httpx.stream("POST", srv.url("/api/chat"), json={**body, "stream": True}, timeout=120) as r:
        streamed = [json.loads(line) for line in r.iter_lines() if line]
    thinking = "".join(x["message"].get("thinking", "") for x in streamed)
    content = "".join(x["message"]["content"] for x in streamed)
    assert (on["message"].get("thinking", ""), on["message"]["content"]) == (thinking, content)
    assert "<think>" not in content and "</think>" not in content
    off = httpx.post(srv.url("/api/chat"), json={**body, "think": False}, timeout=120).json()
    assert "thinking" not in off["message"]
    shown = httpx.post(srv.url("/api/show"), json={"model": "smollm2"}, timeout=60).json()
    assert shown["capabilities"] == ["completion", "thinking"]


@pytest.mark.slow
def test_generate_with_a_go_template(srv):
    base = {"model": "smollm2", "stream": False, "options": {"temperature": 0, "num_predict": 4}}
    tmpl = "{{ if .System }}{{ .System }}\n{{ end }}User: {{ .Prompt }}\nAssistant:"
    r = _post(srv, "/api/generate", {**base, "prompt": "Say hi.", "template": tmpl}).json()
    raw = _post(srv, "/api/generate", {**base, "prompt": "You are terse.\nUser: Say hi.\nAssistant:",
                                       "raw": True}).json()
    assert r["response"] == raw["response"] and r["done_reason"] == "length"
    fim = "<PRE> {{ .Prompt }} <SUF>{{ .Suffix }} <MID>"
    r = _post(srv, "/api/generate", {**base, "prompt": "def f(", "suffix": "return x", "template": fim})
    assert r.status_code == 200 and r.json()["done"], r.text
    r = _post(srv, "/api/generate", {**base, "prompt": "x", "template": "{{ .Nope"})
    assert r.status_code == 400 and set(r.json()) == {"error"}
