"""llama-server's HTTP details its users rely on (issue #15 item 11): CORS answers
(``--cors-origins/--cors-methods/--cors-headers/--cors-credentials``, vLLM's ``--allowed-*``,
``--tools`` -> localhost), ``/props`` fields, ``--tags`` in ``/v1/models``, ``/slots`` keys and
``params``, ``/metrics`` names, types and headers, ``return_progress`` in ``/completion``
streams, several ``--host`` addresses and ``--verbose`` request logging.

Tiny random-weight models served in process (Starlette's TestClient); the ``--host`` test starts
a real server process on two loopback addresses."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import tinymodel  # tests/ is on sys.path (tests/conftest.py)
from prometheus_client.parser import text_string_to_metric_families
from servers import app_client

from kvserve.app import build_app
from kvserve.serving.args import parse_args
from kvserve.serving.state import ServerState

PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


def _bare_app(*argv):
    """The app with no model loaded (CORS answers need none)."""
    st = ServerState(parse_args(list(argv)))
    st.preloading = True
    return build_app(st)


def _call(app, method, path, headers=None):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8080") as c:
            return await c.request(method, path, headers=headers or {})

    return asyncio.run(go())


def _cors(r) -> dict:
    return {k: v for k, v in r.headers.items() if k.startswith("access-control-") or k == "vary"}


_client = app_client


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama_http")
    return tinymodel.write_tiny_gguf(d / "tiny.gguf"), d


@pytest.fixture(scope="module")
def tiny(tiny_path):
    path, d = tiny_path
    c = _client(path, d, "--metrics", "--tags", "coder,b-tag,coder", "-b", "16")
    yield c
    c.portal.call(c.state.manager.shutdown)
    c.__exit__(None, None, None)


# -- CORS -----------------------------------------------------------------------------------------

def test_default_cors_reflects_any_origin_with_credentials_as_llama_server():
    app = _bare_app()
    r = _call(app, "OPTIONS", "/v1/chat/completions", {"Origin": "http://page.example", **PREFLIGHT})
    assert (r.status_code, r.content, r.headers["content-type"]) == (200, b"", "text/html")
    assert _cors(r) == {"access-control-allow-origin": "http://page.example",
                        "access-control-allow-credentials": "true", "vary": "Origin",
                        "access-control-allow-methods": "GET, POST, DELETE, OPTIONS",
                        "access-control-allow-headers": "*"}
    # a preflight needs no API key (browsers send none)
    app = _bare_app("--api-key", "k1")
    r = _call(app, "OPTIONS", "/completion", {"Origin": "http://page.example", **PREFLIGHT})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://page.example"
    # an answer (here the 401) carries the origin and credentials too
    r = _call(app, "POST", "/completion", {"Origin": "http://page.example"})
    assert r.status_code == 401
    assert _cors(r) == {"access-control-allow-origin": "http://page.example",
                        "access-control-allow-credentials": "true", "vary": "Origin"}
    # no Origin: no CORS headers, but Vary: Origin (the answer depends on it; Fetch caching)
    assert _cors(_call(app, "OPTIONS", "/completion", PREFLIGHT)) == {"vary": "Origin"}


def test_cors_origin_list_methods_headers_and_no_credentials():
    app = _bare_app("--cors-origins", "http://a.example, https://b.example:8443", "--cors-methods", "GET, POST",
                    "--cors-headers", "Authorization, Content-Type", "--no-cors-credentials")
    r = _call(app, "OPTIONS", "/v1/completions", {"Origin": "https://b.example:8443", **PREFLIGHT})
    # the matching origin alone (llama-server writes the whole list, which browsers reject: #26988)
    assert _cors(r) == {"access-control-allow-origin": "https://b.example:8443", "vary": "Origin",
                        "access-control-allow-methods": "GET, POST",
                        "access-control-allow-headers": "Authorization, Content-Type"}
    for origin in ("http://evil.example", "http://a.example.evil", "http://localhost:3000"):
        r = _call(app, "OPTIONS", "/v1/completions", {"Origin": origin, **PREFLIGHT})
        assert (r.status_code, _cors(r)) == (200, {"vary": "Origin"}), origin
        assert _cors(_call(app, "GET", "/health", {"Origin": origin})) == {"vary": "Origin"}
    r = _call(app, "GET", "/health", {"Origin": "http://a.example"})
    assert _cors(r) == {"access-control-allow-origin": "http://a.example", "vary": "Origin"}
    # * without credentials: the literal *
    r = _call(_bare_app("--no-cors-credentials"), "GET", "/health", {"Origin": "http://x.example"})
    assert _cors(r) == {"access-control-allow-origin": "*"}


def test_cors_localhost_value_and_tools_default():
    for argv in (("--cors-origins", "localhost"), ("--tools", "all")):
        app = _bare_app(*argv)
        for origin in ("http://localhost", "http://localhost:5173", "https://127.0.0.1:8443", "http://[::1]:3000"):
            r = _call(app, "OPTIONS", "/v1/chat/completions", {"Origin": origin, **PREFLIGHT})
            assert r.headers.get("access-control-allow-origin") == origin, (argv, origin)
        for origin in ("http://localhost.evil.example", "http://127.0.0.2", "http://evil.example"):
            r = _call(app, "OPTIONS", "/v1/chat/completions", {"Origin": origin, **PREFLIGHT})
            assert _cors(r) == {"vary": "Origin"}, (argv, origin)
    args = parse_args(["--tools", "all"])
    assert args.cors_origins == ["localhost"]
    note = "server tools are enabled (--tools): CORS is limited to localhost origins; use --cors-origins to change it"
    assert (30, note) in args.flag_notes
    # an explicit list wins over the --tools default
    assert parse_args(["--tools", "all", "--cors-origins", "*"]).cors_origins == ["*"]


def test_vllm_cors_flags_map_onto_the_same_answers():
    a = parse_args(["--allowed-origins", '["http://v.example"]', "--allowed-methods", '["GET", "POST"]',
                    "--allowed-headers", "X-Api-Key,Content-Type", "--allow-credentials"])
    assert (a.cors_origins, a.cors_methods, a.cors_headers, a.cors_credentials) == \
        (["http://v.example"], "GET, POST", "X-Api-Key, Content-Type", True)
    r = _call(build_app(_state(a)), "OPTIONS", "/v1/models", {"Origin": "http://v.example", **PREFLIGHT})
    assert _cors(r) == {"access-control-allow-origin": "http://v.example", "access-control-allow-credentials": "true",
                        "vary": "Origin", "access-control-allow-methods": "GET, POST",
                        "access-control-allow-headers": "X-Api-Key, Content-Type"}
    # llama-server's flags win when both are given
    b = parse_args(["--allowed-origins", "http://v.example", "--cors-origins", "http://l.example",
                    "--allowed-methods", "GET", "--cors-methods", "POST"])
    assert (b.cors_origins, b.cors_methods) == (["http://l.example"], "POST")


def _state(args):
    st = ServerState(args)
    st.preloading = True
    return st


# -- /props, /v1/models tags, /slots ------------------------------------------------------------

PROPS_KEYS = ["default_generation_settings", "total_slots", "model_alias", "model_path", "modalities", "endpoint_slots",
              "endpoint_props", "endpoint_metrics", "ui", "ui_settings", "webui", "webui_settings", "chat_template",
              "chat_template_caps", "bos_token", "eos_token", "build_info", "is_sleeping", "cors_proxy_enabled"]
TEXT_KEYS = {"stop", "grammar", "grammar_lazy", "grammar_triggers", "preserved_tokens", "logit_bias",
             "dry_sequence_breakers"}


def test_props_fields_in_llama_server_order(tiny, tiny_path):
    d = tiny.get("/props").json()
    assert list(d) == PROPS_KEYS
    assert list(d["default_generation_settings"]) == ["params", "n_ctx"]
    params = d["default_generation_settings"]["params"]
    assert not TEXT_KEYS & set(params) and params["n_predict"] == -1 and params["seed"] == 4294967295
    assert (d["total_slots"], d["model_alias"], d["model_path"]) == (2, "tiny", str(tiny_path[0]))
    assert (d["endpoint_slots"], d["endpoint_props"], d["endpoint_metrics"]) == (True, False, True)
    assert (d["ui"], d["webui"], d["ui_settings"], d["webui_settings"]) == (True, True, {}, {})
    assert (d["is_sleeping"], d["cors_proxy_enabled"]) == (False, False)


def test_props_flags_no_webui_and_props(tiny_path):
    path, d = tiny_path
    c = _client(path, d, "--no-webui", "--props", "--no-slots")
    try:
        p = c.get("/props").json()
        assert (p["ui"], p["webui"], p["endpoint_props"], p["endpoint_slots"], p["endpoint_metrics"]) == \
            (False, False, True, False, False)
        assert c.post("/props", json={}).json() == {"success": True}
    finally:
        c.portal.call(c.state.manager.shutdown)
        c.__exit__(None, None, None)


def test_tags_in_v1_models(tiny):
    d = tiny.get("/v1/models").json()
    assert d["data"][0]["tags"] == ["b-tag", "coder"]  # llama-server's std::set: sorted, each once
    assert tiny.get("/v1/models/tiny").json()["tags"] == ["b-tag", "coder"]
    assert d["models"][0]["tags"] == [""]  # the Ollama-style list keeps llama-server's dummy


def test_slots_keys_as_llama_server(tiny_path, monkeypatch):
    path, d = tiny_path
    c = _client(path, d)
    try:
        fresh = c.get("/slots").json()
        assert fresh == [{"id": 0, "n_ctx": 256, "speculative": False, "is_processing": False},
                         {"id": 1, "n_ctx": 256, "speculative": False, "is_processing": False}]
        body = {"prompt": "hello world", "n_predict": 3, "temperature": 0, "stop": ["hunter2"], "id_slot": 0,
                "grammar": 'root ::= [a-z ]+'}
        r = c.post("/completion", json=body).json()
        s0, s1 = c.get("/slots").json()
        assert list(s0) == ["id", "n_ctx", "speculative", "is_processing", "id_task", "n_prompt_tokens",
                            "n_prompt_tokens_processed", "n_prompt_tokens_cache", "params", "next_token"]
        assert not TEXT_KEYS & set(s0["params"]) and s0["params"]["n_predict"] == 3
        assert "hunter2" not in json.dumps(s0)
        assert s0["n_prompt_tokens"] == r["tokens_evaluated"] + r["tokens_predicted"] - 1
        # idle: llama-server's n_remain -1 and n_decoded 0 (the finished task's budget does not stay)
        assert s0["next_token"] == [{"has_next_token": False, "has_new_line": "\n" in r["content"],
                                     "n_remain": -1, "n_decoded": 0}]
        assert list(s1) == ["id", "n_ctx", "speculative", "is_processing"]
        # llama-server's LLAMA_SERVER_SLOTS_DEBUG: full params, the prompt and the generated text
        monkeypatch.setenv("LLAMA_SERVER_SLOTS_DEBUG", "1")
        s0 = c.get("/slots").json()[0]
        assert s0["params"]["stop"] == ["hunter2"] and "[a-z ]" in s0["params"]["grammar"]
        assert (s0["prompt"], s0["generated"]) == (r["prompt"], r["content"])
    finally:
        c.portal.call(c.state.manager.shutdown)
        c.__exit__(None, None, None)


# -- /metrics -------------------------------------------------------------------------------------

LLAMACPP = [("prompt_tokens_total", "counter"), ("prompt_tokens_cached_total", "counter"),
            ("prompt_seconds_total", "counter"), ("tokens_predicted_total", "counter"),
            ("tokens_predicted_seconds_total", "counter"), ("n_decode_total", "counter"),
            ("n_tokens_max", "counter"), ("spec_decode_num_draft_tokens_total", "counter"),
            ("spec_decode_num_accepted_tokens_total", "counter"), ("spec_decode_num_drafts_total", "counter"),
            ("prompt_tokens_seconds", "gauge"), ("predicted_tokens_seconds", "gauge"),
            ("requests_processing", "gauge"), ("requests_deferred", "gauge"), ("n_busy_slots_per_decode", "gauge")]


def test_metrics_every_llamacpp_family_and_the_headers(tiny):
    from kvserve.serving.metrics import PROCESS_START_UNIX

    prompt_ids = tiny.post("/tokenize", json={"content": "one two three four five", "add_special": True}).json()["tokens"]
    r = tiny.post("/completion", json={"prompt": "one two three four five", "n_predict": 4, "temperature": 0,
                                       "ignore_eos": True})
    assert r.status_code == 200
    m = tiny.get("/metrics")
    assert m.status_code == 200
    assert m.headers["content-type"] == "text/plain; version=0.0.4"
    assert m.headers["process-start-time-unix"] == str(PROCESS_START_UNIX)
    text = m.text
    llama_lines = [ln for ln in text.splitlines() if "llamacpp:" in ln]
    # HELP, TYPE, value for each family in llama-server's order
    assert [ln.split()[2] for ln in llama_lines if ln.startswith("# TYPE")] == [f"llamacpp:{n}" for n, _ in LLAMACPP]
    # each value line carries llama-server's exact name
    assert [ln.split()[0] for ln in llama_lines if not ln.startswith("#")] == [f"llamacpp:{n}" for n, _ in LLAMACPP]
    # prometheus_client parses every family with its type (its parser files a counter under the name without
    # _total, and names n_tokens_max's sample n_tokens_max_total)
    fams = {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("llamacpp:")}
    for name, typ in LLAMACPP:
        base = f"llamacpp:{name}"
        fam = fams[base.removesuffix("_total") if typ == "counter" else base]
        assert fam.type == typ, name
        assert [s.name for s in fam.samples] == [base if typ == "gauge" or base.endswith("_total") else
                                                 base + "_total"]
    vals = {ln.split()[0]: float(ln.split()[1]) for ln in llama_lines if not ln.startswith("#")}
    assert vals["llamacpp:prompt_tokens_total"] == len(prompt_ids)
    assert vals["llamacpp:tokens_predicted_total"] == 4
    assert vals["llamacpp:n_decode_total"] == 4  # one prefill step (16 >= 7 tokens) + 3 decode steps
    assert vals["llamacpp:n_tokens_max"] == len(prompt_ids) + 4  # prompt + generated (seed: 2 + 1500 = 1502)
    assert vals["llamacpp:spec_decode_num_drafts_total"] == 0
    assert "spec_decode_num_accepted_tokens_per_pos" not in text  # omitted without speculation
    assert (vals["llamacpp:requests_processing"], vals["llamacpp:requests_deferred"]) == (0, 0)


# -- return_progress ------------------------------------------------------------------------------

def _sse(r) -> list[dict]:
    assert r.status_code == 200, r.text
    return [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: ") and ln != "data: [DONE]"]


def test_return_progress_objects_for_a_known_prompt(tiny):
    prompt = list(range(40, 80))  # 40 token ids; -b 16: the engine runs chunks of 16, 16 and 8 tokens
    body = {"prompt": prompt, "n_predict": 2, "temperature": 0, "stream": True, "return_progress": True,
            "ignore_eos": True, "cache_prompt": False}
    ev = _sse(tiny.post("/completion", json=body))
    prog = [e["prompt_progress"] for e in ev if "prompt_progress" in e]
    assert [(p["total"], p["cache"], p["processed"]) for p in prog] == [(40, 0, 0), (40, 0, 16), (40, 0, 32),
                                                                          (40, 0, 40)]
    assert prog[0]["time_ms"] == 0 and all(isinstance(p["time_ms"], int) and p["time_ms"] >= 0 for p in prog)
    assert [p["time_ms"] for p in prog] == sorted(p["time_ms"] for p in prog)
    first = next(e for e in ev if "prompt_progress" in e)
    assert list(first) == ["index", "content", "tokens", "stop", "id_slot", "stop_type", "tokens_predicted",
                           "tokens_evaluated", "prompt_progress"]
    assert (first["content"], first["tokens"], first["tokens_predicted"], first["tokens_evaluated"]) == ("", [], 0, 40)
    # every progress event comes before the first token's; the text is the same as without progress
    n_prog = len(prog)
    assert all("prompt_progress" in e for e in ev[:n_prog]) and all("prompt_progress" not in e for e in ev[n_prog:])
    plain = _sse(tiny.post("/completion", json={**body, "return_progress": False}))
    assert all("prompt_progress" not in e for e in plain)
    assert "".join(e["content"] for e in ev) == "".join(e["content"] for e in plain)
    # a cached prompt: 39 tokens reused, one evaluated
    ev = _sse(tiny.post("/completion", json={**body, "cache_prompt": True, "id_slot": 0}))
    ev = _sse(tiny.post("/completion", json={**body, "cache_prompt": True, "id_slot": 0}))
    prog = [e["prompt_progress"] for e in ev if "prompt_progress" in e]
    assert [(p["total"], p["cache"], p["processed"]) for p in prog] == [(40, 39, 39), (40, 39, 40)]
    # not streaming: no progress objects (llama-server sends them in streams only)
    r = tiny.post("/completion", json={**body, "stream": False}).json()
    assert "prompt_progress" not in r


def test_timings_per_token_on_progress_and_token_events(tiny):
    """llama-server's timings_per_token: every streamed event carries the timings so far; on the
    progress events, the prompt tokens computed (none on the 0% event) and no predicted tokens."""
    body = {"prompt": list(range(40, 80)), "n_predict": 3, "temperature": 0, "stream": True, "return_progress": True,
            "timings_per_token": True, "ignore_eos": True, "cache_prompt": False}
    ev = _sse(tiny.post("/completion", json=body))
    prog = [e for e in ev if "prompt_progress" in e]
    assert list(prog[0]) == ["index", "content", "tokens", "stop", "id_slot", "stop_type", "tokens_predicted",
                             "tokens_evaluated", "timings", "prompt_progress"]
    assert [(e["timings"]["cache_n"], e["timings"]["prompt_n"], e["timings"]["predicted_n"]) for e in prog] == \
        [(0, 0, 0), (0, 16, 0), (0, 32, 0), (0, 40, 0)]
    first = prog[0]["timings"]
    assert [first[k] for k in ("prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_ms",
                               "predicted_per_token_ms", "predicted_per_second")] == [0.0] * 6
    ms = [e["timings"]["prompt_ms"] for e in prog]
    assert ms == sorted(ms) and ms[-1] > 0
    tokens = [e for e in ev if "prompt_progress" not in e and not e["stop"]]
    assert tokens and all(e["timings"]["predicted_n"] == e["tokens_predicted"] >= 1 for e in tokens)
    assert all(e["timings"]["prompt_n"] == 40 for e in tokens)
    # without it, only the last event has timings
    plain = _sse(tiny.post("/completion", json={**body, "timings_per_token": False}))
    assert [("timings" in e) for e in plain] == [False] * (len(plain) - 1) + [True]


# -- --verbose request logging, several --host addresses ------------------------------------------

def test_verbose_logs_requests_bounded_without_keys(tiny_path, caplog):
    import logging

    path, d = tiny_path
    key = "sk-very-secret-123"
    c = _client(path, d, "-v", "--api-key", key)
    try:
        caplog.set_level(logging.DEBUG, logger="kvserve.server")
        auth = {"Authorization": f"Bearer {key}"}
        sent = {"prompt": "hi", "n_predict": 1, "temperature": 0, "note": key + " " + "x" * 5000}  # 5 kB body
        r = c.post("/completion", headers=auth, json=sent)
        assert r.status_code == 200
        c.get("/health", headers=auth)  # quiet paths are not logged, as llama-server
        lines = [rec.getMessage() for rec in caplog.records if rec.name == "kvserve.server"]
        done = [ln for ln in lines if ln.startswith("done request:")]
        assert done == ["done request: POST /completion testclient 200"]
        req = next(ln for ln in lines if ln.startswith("request:  "))
        body = json.dumps(sent, separators=(",", ":"))
        assert req.startswith("request:  " + body[:80].replace(key, "***"))
        assert req.endswith(f" ... ({len(body.encode()) - 2048} more bytes)")
        resp = next(ln for ln in lines if ln.startswith("response: "))
        assert resp.startswith('response: {"index":0,"content":')
        assert all(key not in ln for ln in lines)
        # without -v: no request lines
        caplog.clear()
        c2 = _client(path, d)
        try:
            c2.post("/completion", json={"prompt": "hi", "n_predict": 1})
            assert not [r for r in caplog.records if r.getMessage().startswith("done request:")]
        finally:
            c2.portal.call(c2.state.manager.shutdown)
            c2.__exit__(None, None, None)
    finally:
        c.portal.call(c.state.manager.shutdown)
        c.__exit__(None, None, None)


def test_several_host_addresses(tiny_path, tmp_path):
    from servers import spawn

    path, d = tiny_path
    srv = spawn(str(path), ("--host", "127.0.0.1", "--host", "127.0.0.2", "-c", "256", "--models-dir",
                            str(d / "models")), tmp_path)
    try:
        srv.wait_ready()
        for host in ("127.0.0.1", "127.0.0.2"):
            r = httpx.get(f"http://{host}:{srv.port}/health", timeout=10)
            assert (r.status_code, r.json()) == (200, {"status": "ok"}), host
        log = srv.log()
        assert f"listening on http://127.0.0.1:{srv.port}" in log and f"listening on http://127.0.0.2:{srv.port}" in log
    finally:
        srv.stop()


def test_props_while_sleeping_does_not_wake_the_model(tiny_path, tmp_path):
    """llama-server answers /props without waking a sleeping server, with is_sleeping true."""
    import time

    from servers import spawn

    path, d = tiny_path
    srv = spawn(str(path), ("-c", "256", "--sleep-idle-seconds", "1", "--models-dir", str(d / "models")), tmp_path)
    try:
        srv.wait_ready()
        awake = httpx.get(srv.url("/props"), timeout=30).json()
        assert awake["is_sleeping"] is False
        deadline = time.monotonic() + 30
        while httpx.get(srv.url("/api/ps"), timeout=10).json()["models"] != [] and time.monotonic() < deadline:
            time.sleep(0.2)  # /api/ps lists no model once it is unloaded (and does not wake it)
        assert httpx.get(srv.url("/api/ps"), timeout=10).json()["models"] == []
        asleep = httpx.get(srv.url("/props"), timeout=30).json()
        assert asleep == {**awake, "is_sleeping": True}
        assert httpx.get(srv.url("/api/ps"), timeout=10).json()["models"] == []  # still asleep: /props did not load it
        # /slots wakes it, as llama-server (every route but /health and /props): the slots, idle
        slots = httpx.get(srv.url("/slots"), timeout=60).json()
        assert [(s["id"], s["is_processing"]) for s in slots] == [(i, False) for i in range(len(slots))] and slots
        assert len(httpx.get(srv.url("/api/ps"), timeout=10).json()["models"]) == 1
        assert httpx.get(srv.url("/props"), timeout=30).json()["is_sleeping"] is False
        deadline = time.monotonic() + 30
        while httpx.get(srv.url("/api/ps"), timeout=10).json()["models"] != [] and time.monotonic() < deadline:
            time.sleep(0.2)
        # a generation wakes it; /props then answers from the loaded model again
        r = httpx.post(srv.url("/completion"), json={"prompt": "hi", "n_predict": 1}, timeout=60)
        assert r.status_code == 200
        assert httpx.get(srv.url("/props"), timeout=30).json()["is_sleeping"] is False
    finally:
        srv.stop()


def test_props_polled_lets_the_model_sleep_and_never_wakes_it(tiny_path, tmp_path):
    """llama.cpp's test_sleep.py: polling /props every 0.1 s (its wait_for_sleep) must not keep the
    model awake, and /props asked for the first time while asleep answers is_sleeping true from
    what the model said as it loaded, without loading it."""
    import time

    from servers import spawn

    path, d = tiny_path
    srv = spawn(str(path), ("-c", "256", "--sleep-idle-seconds", "1", "--models-dir", str(d / "models")), tmp_path)
    try:
        srv.wait_ready()
        time.sleep(2.5)  # asleep before any /props
        assert httpx.get(srv.url("/api/ps"), timeout=10).json()["models"] == []
        first = httpx.get(srv.url("/props"), timeout=30).json()
        assert first["is_sleeping"] is True and first["model_alias"] == str(path) and first["total_slots"] == 4
        assert httpx.get(srv.url("/api/ps"), timeout=10).json()["models"] == []
        assert httpx.post(srv.url("/tokenize"), json={"content": "hi"}, timeout=60).status_code == 200  # wakes it
        awake = httpx.get(srv.url("/props"), timeout=30).json()
        assert awake == {**first, "is_sleeping": False}
        polls, t0 = 0, time.monotonic()
        while httpx.get(srv.url("/props"), timeout=10).json()["is_sleeping"] is False:
            polls += 1
            assert time.monotonic() - t0 < 10, f"still awake after {polls} polls of /props"
            time.sleep(0.1)
        assert polls >= 1 and httpx.get(srv.url("/api/ps"), timeout=10).json()["models"] == []
    finally:
        srv.stop()


def test_return_progress_in_openai_streams(tiny):
    prompt = list(range(40, 80))
    ev = _sse(tiny.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True,
                                                 "return_progress": True, "cache_prompt": False}))
    prog = [e for e in ev if "prompt_progress" in e]
    assert [(e["prompt_progress"]["cache"], e["prompt_progress"]["processed"]) for e in prog] == \
        [(0, 0), (0, 16), (0, 32), (0, 40)]
    assert all(e["choices"] == [{"text": "", "index": 0, "logprobs": None, "finish_reason": None}] for e in prog)
    assert ev.index(prog[-1]) == len(prog) - 1  # before every text chunk
    # chat: the role once, in the first chunk; progress chunks carry an empty delta
    msgs = [{"role": "user", "content": "x" * 30}]
    ev = _sse(tiny.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "temperature": 0,
                                                      "stream": True, "return_progress": True,
                                                      "cache_prompt": False}))
    prog = [e for e in ev if "prompt_progress" in e]
    total = prog[0]["prompt_progress"]["total"]
    assert [e["prompt_progress"]["processed"] for e in prog] == [0] + list(range(16, total, 16)) + [total]
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": None} and "prompt_progress" not in ev[0]
    assert all(e["choices"][0]["delta"] == {} for e in prog)
    assert sum("role" in e["choices"][0]["delta"] for e in ev if e["choices"]) == 1
    without = _sse(tiny.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "stream": True}))
    assert all("prompt_progress" not in e for e in without)


def test_cors_keeps_the_apps_vary_header():
    from kvserve.faces.auth import CorsMiddleware, CorsPolicy

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"vary", b"Accept-Encoding"), (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    r = _call(CorsMiddleware(app, CorsPolicy(["*"])), "GET", "/x", {"Origin": "http://a.example"})
    assert r.headers["vary"] == "Accept-Encoding, Origin"
    r = _call(CorsMiddleware(app, CorsPolicy(["*"], credentials=False)), "GET", "/x", {"Origin": "http://a.example"})
    assert (r.headers["vary"], r.headers["access-control-allow-origin"]) == ("Accept-Encoding", "*")
    r = _call(CorsMiddleware(app, CorsPolicy(["http://b.example"])), "GET", "/x", {"Origin": "http://a.example"})
    assert r.headers["vary"] == "Accept-Encoding, Origin" and "access-control-allow-origin" not in r.headers


def test_response_fields_pick_nested_values(tiny):
    """llama-server's response_fields: the final result is only the paths asked for ("a/b" reads
    member b of a), in the order given, paths not found left out; streams' last event too."""
    body = {"prompt": list(range(40, 50)), "n_predict": 3, "temperature": 0, "ignore_eos": True,
            "response_fields": ["generation_settings/n_predict", "tokens_predicted", "timings/nope", "prompt"]}
    r = tiny.post("/completion", json=body)
    assert r.status_code == 200, r.text
    d = r.json()
    assert list(d) == ["generation_settings/n_predict", "tokens_predicted", "prompt"]
    assert (d["generation_settings/n_predict"], d["tokens_predicted"]) == (3, 3) and isinstance(d["prompt"], str)
    last = _sse(tiny.post("/completion", json={**body, "stream": True}))[-1]
    assert (list(last), last["tokens_predicted"]) == (["generation_settings/n_predict", "tokens_predicted", "prompt"], 3)
    whole = tiny.post("/completion", json={**body, "response_fields": []}).json()
    assert "generation_settings" in whole and "content" in whole
    bad = tiny.post("/completion", json={**body, "response_fields": "prompt"})
    assert (bad.status_code, bad.json()["error"]["message"]) == (400, "'response_fields' must be an array of strings")


def _metric(text: str, name: str) -> float:
    """The one sample ``name`` (with its labels, if any) of a /metrics page."""
    values = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    assert len(values) == 1, f"{name} not on the page"
    return float(values[0][len(name) + 1:])


def test_metrics_kept_through_sleep(tiny_path, tmp_path):
    """llama.cpp's test_sleep.py: /metrics on a sleeping model answers from the snapshot taken as
    it went to sleep (the page of the last scrape, byte for byte, without waking it); after the
    reload the totals continue from there instead of restarting at 0; the rate window goes on
    across the sleep (the first scrape after a generation reports it, the next one 0). Before the
    change the sleeping page was all zeros and the totals after the wake were the new runner's."""
    import time

    from servers import spawn

    path, d = tiny_path
    srv = spawn(str(path), ("-c", "256", "--metrics", "--sleep-idle-seconds", "1", "--models-dir",
                            str(d / "models")), tmp_path)

    def scrape() -> str:
        r = httpx.get(srv.url("/metrics"), timeout=30)
        assert r.status_code == 200
        return r.text

    def asleep() -> bool:
        return httpx.get(srv.url("/api/ps"), timeout=10).json()["models"] == []

    def wait_asleep() -> None:
        deadline = time.monotonic() + 30
        while not asleep() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert asleep()

    def complete(n: int) -> dict:
        r = httpx.post(srv.url("/completion"), json={"prompt": [40, 41, 42, 43, 44], "n_predict": n,
                                                       "ignore_eos": True, "cache_prompt": False}, timeout=60)
        assert r.status_code == 200
        return r.json()["timings"]

    try:
        srv.wait_ready()
        t1 = complete(4)
        assert _metric(scrape(), "llamacpp:predicted_tokens_seconds") > 0
        awake = scrape()  # an empty window: the same page the snapshot must give
        assert _metric(awake, "llamacpp:tokens_predicted_total") == 4 == t1["predicted_n"]
        assert _metric(awake, "llamacpp:prompt_tokens_total") == t1["prompt_n"] == 5
        assert _metric(awake, "llamacpp:predicted_tokens_seconds") == 0
        decodes = _metric(awake, "llamacpp:n_decode_total")
        assert decodes >= 4
        wait_asleep()
        assert scrape() == awake  # the snapshot (the vLLM gauges included)
        assert asleep()  # scraping did not wake it
        t2 = complete(3)  # wakes it
        wait_asleep()
        after = scrape()  # the window since the last scrape holds the second generation
        assert _metric(after, "llamacpp:tokens_predicted_total") == 7 == t1["predicted_n"] + t2["predicted_n"]
        assert _metric(after, "llamacpp:prompt_tokens_total") == 10
        assert _metric(after, "llamacpp:n_decode_total") >= decodes + 3
        assert _metric(after, "llamacpp:predicted_tokens_seconds") > 0
        assert _metric(after, 'vllm:generation_tokens_total{engine="0",model_name="%s"}' % path) == 7
        assert _metric(after, 'vllm:request_success_total{engine="0",finished_reason="length",model_name="%s"}'
                       % path) == 2
        again = scrape()
        assert _metric(again, "llamacpp:predicted_tokens_seconds") == 0
        assert _metric(again, "llamacpp:tokens_predicted_total") == 7 and asleep()
    finally:
        srv.stop()
