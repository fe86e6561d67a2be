"""vLLM's ``vllm:`` metrics beside llama-server's on ``/metrics`` (seed 002 Example 13) and the
periodic stats line: a tiny random-weight model served in process (Starlette's TestClient)."""

from __future__ import annotations

import logging
import re
import time
import types

import pytest
import tinymodel  # tests/ is on sys.path (tests/conftest.py)
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from kvserve.app import build_app
from kvserve.engine.request import RequestOutput, Timings
from kvserve.serving.args import parse_args
from kvserve.serving.metrics import VllmMetrics, build_1_2_5_buckets
from kvserve.serving.state import ServerState

LABELS = {"model_name": "tiny", "engine": "0"}
COUNTERS = ["vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens",
            "vllm:generation_tokens", "vllm:request_success"]
GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
HISTOGRAMS = ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens"]
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0, 160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
E2E = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
       960.0, 1920.0, 7680.0]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm_metrics")
    path = tinymodel.write_tiny_gguf(d / "tiny.gguf")
    state = ServerState(parse_args(["-m", str(path), "-a", "tiny", "--metrics", "-c", "512", "-np", "2",
                                    "--models-dir", str(d / "models")]))
    with TestClient(build_app(state), base_url="http://127.0.0.1") as c:
        c.portal.call(state.preload)
        yield c
        c.portal.call(state.manager.shutdown)


def scrape(client) -> dict:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(fams: dict, family: str, sample: str, **labels) -> float:
    want = {**LABELS, **labels}
    hits = [s.value for s in fams[family].samples if s.name == sample and s.labels == want]
    assert len(hits) == 1, (family, sample, labels, fams[family].samples)
    return hits[0]


def test_families_types_labels_and_buckets(client):
    fams = scrape(client)
    assert "llamacpp:prompt_tokens" in fams  # llama-server's families stay on the same page
    for name in GAUGES:
        assert fams[name].type == "gauge", name
        assert [s.labels for s in fams[name].samples] == [LABELS], name
    for name in COUNTERS:
        assert fams[name].type == "counter", name
    reasons = [s.labels["finished_reason"] for s in fams["vllm:request_success"].samples
               if s.name == "vllm:request_success_total"]
    assert reasons == ["stop", "length", "abort", "error", "repetition"]
    for name in HISTOGRAMS:
        assert fams[name].type == "histogram", name
        assert {s.name for s in fams[name].samples} == {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
    lens = [float(v) for v in build_1_2_5_buckets(256)]  # max_model_len: -c 512 over 2 slots
    assert lens == [1, 2, 5, 10, 20, 50, 100, 200]
    for name, want in (("vllm:time_to_first_token_seconds", TTFT), ("vllm:inter_token_latency_seconds", ITL),
                       ("vllm:e2e_request_latency_seconds", E2E), ("vllm:request_prompt_tokens", lens),
                       ("vllm:request_generation_tokens", lens)):
        les = [s.labels["le"] for s in fams[name].samples if s.name == f"{name}_bucket"]
        assert les == [str(float(x)) for x in want] + ["+Inf"], name
    assert value(fams, "vllm:num_requests_running", "vllm:num_requests_running") == 0


def test_two_requests_grow_every_family_by_their_exact_counts(client):
    before = scrape(client)
    a = client.post("/v1/completions", json={"model": "tiny", "prompt": "hello world, once more", "max_tokens": 5,
                                             "temperature": 0, "ignore_eos": True}).json()
    b = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 3, "temperature": 0, "ignore_eos": True}).json()
    after = scrape(client)
    p = a["usage"]["prompt_tokens"] + b["usage"]["prompt_tokens"]
    cached = a["usage"]["prompt_tokens_details"]["cached_tokens"] + b["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert (a["usage"]["completion_tokens"], b["usage"]["completion_tokens"]) == (5, 3)

    def grew(family, sample, **labels):
        return value(after, family, sample, **labels) - value(before, family, sample, **labels)

    assert grew("vllm:prompt_tokens", "vllm:prompt_tokens_total") == p
    assert grew("vllm:generation_tokens", "vllm:generation_tokens_total") == 8
    assert grew("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == p
    assert grew("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == cached
    assert grew("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 2
    assert grew("vllm:request_success", "vllm:request_success_total", finished_reason="stop") == 0
    assert grew("vllm:num_preemptions", "vllm:num_preemptions_total") == 0
    h = "vllm:request_prompt_tokens"
    assert (grew(h, h + "_count"), grew(h, h + "_sum")) == (2, p)
    h = "vllm:request_generation_tokens"
    assert (grew(h, h + "_count"), grew(h, h + "_sum")) == (2, 8)
    assert grew(h, h + "_bucket", le="2.0") == 0 and grew(h, h + "_bucket", le="5.0") == 2  # 5 and 3 tokens
    for h, n in (("vllm:time_to_first_token_seconds", 2), ("vllm:e2e_request_latency_seconds", 2),
                 ("vllm:inter_token_latency_seconds", (5 - 1) + (3 - 1))):  # one per output after the first
        assert grew(h, h + "_count") == n, h
        assert grew(h, h + "_sum") > 0, h
        assert grew(h, h + "_bucket", le="+Inf") == n, h
    # the end-to-end latency of a request covers its time to first token
    e2e = grew("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_sum")
    assert e2e > grew("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_sum")
    assert value(after, "vllm:num_requests_running", "vllm:num_requests_running") == 0
    assert value(after, "vllm:num_requests_waiting", "vllm:num_requests_waiting") == 0
    assert 0 < value(after, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") < 1  # idle slots keep KV


def test_a_repeated_prompt_counts_its_prefix_cache_hits(client):
    body = {"model": "tiny", "prompt": "the same prompt, token for token, twice " * 2, "max_tokens": 1,
            "temperature": 0, "id_slot": 0}
    client.post("/v1/completions", json=body)
    before = scrape(client)
    r = client.post("/v1/completions", json=body).json()
    after = scrape(client)
    cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert value(after, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") - \
        value(before, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == cached


# -- the stats line ---------------------------------------------------------------------------

LINE = re.compile(r"^Engine 000: Avg prompt throughput: \d+\.\d tokens/s, Avg generation throughput: \d+\.\d "
                  r"tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: \d+\.\d%, "
                  r"Prefix cache hit rate: \d+\.\d%$")


def _stub(disable: bool):
    engine = types.SimpleNamespace(n_ctx_slot=256, core=None, stats=None)
    return types.SimpleNamespace(engine=engine, model_alias="stub", slots=None,
                                 args=types.SimpleNamespace(disable_log_stats=disable))


def _feed(m: VllmMetrics) -> None:
    t0 = time.monotonic()
    m.on_output(RequestOutput("r", [5], "x", num_prompt_tokens=10, num_cached_tokens=4, num_output_tokens=1,
                              arrival_time=t0, timings=Timings(prompt_ms=1.0)))
    m.on_output(RequestOutput("r", [6], "y", num_prompt_tokens=10, num_cached_tokens=4, num_output_tokens=2,
                              arrival_time=t0, finished=True, stop_type="eos"))


def test_stats_line_names_where_the_kv_cache_is():
    stub = _stub(True)
    m = VllmMetrics(stub)
    assert ", KV cache usage: 0.0%, " in m.stats_line()[0]  # on a CPU: vLLM's words less "GPU"
    stub.engine.core = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"))
    assert ", GPU KV cache usage: 0.0%, " in m.stats_line()[0]  # vLLM's line, word for word


@pytest.mark.parametrize("disable", [False, True])
def test_stats_line_every_interval_while_busy_and_disable_log_stats(disable, caplog, monkeypatch):
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0.1")
    stub = _stub(disable)
    m = VllmMetrics(stub)
    with caplog.at_level(logging.DEBUG, logger="kvserve.server"):
        _feed(m)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(caplog.records) < 2 and not disable:
            time.sleep(0.05)
        if disable:
            time.sleep(0.5)
        stub.engine = None  # the model is unloaded: the logging thread ends
        time.sleep(0.2)
    lines = [r for r in caplog.records if r.getMessage().startswith("Engine 000:")]
    if disable:
        assert lines == []  # five intervals passed without a line
        return
    first = lines[0]
    assert first.levelno == logging.INFO and LINE.match(first.getMessage()), first.getMessage()
    assert "Running: 0 reqs, Waiting: 0 reqs" in first.getMessage()
    assert first.getMessage().endswith("Prefix cache hit rate: 40.0%")  # 4 of 10 prompt tokens
    # the next window saw no tokens but the previous one did: still INFO once, then DEBUG (idle)
    assert lines[1].levelno == logging.INFO and "Avg prompt throughput: 0.0 tokens/s" in lines[1].getMessage()
    assert all(r.levelno == logging.DEBUG for r in lines[2:])


@pytest.mark.parametrize("flags", [(), ("--disable-log-stats",)])
def test_a_server_logs_the_stats_line_unless_disable_log_stats(flags, tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0.1")
    path = tinymodel.write_tiny_gguf(tmp_path / "tiny.gguf")
    name = f"tiny-{len(flags)}"  # the logging thread is named after the model: other tests' lines are not ours

    def ours():
        return [r.getMessage() for r in caplog.records
                if r.getMessage().startswith("Engine 000:") and r.threadName == f"kvserve-stats-log:{name}"]

    state = ServerState(parse_args(["-m", str(path), "-a", name, "-c", "256", "-np", "1",
                                    "--models-dir", str(tmp_path / "models"), *flags]))
    with caplog.at_level(logging.INFO, logger="kvserve.server"), \
            TestClient(build_app(state), base_url="http://127.0.0.1") as c:
        c.portal.call(state.preload)
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}).status_code == 200
        deadline = time.monotonic() + (0.6 if flags else 5)
        while time.monotonic() < deadline and not ours():
            time.sleep(0.05)
        c.portal.call(state.manager.shutdown)  # the model unloads: its logging thread ends
    lines = ours()
    if flags:
        assert lines == []
    else:
        assert LINE.match(lines[0]) and "Avg generation throughput: 0.0 tokens/s" not in lines[0]


def test_a_client_that_leaves_counts_as_abort(start_server, tiny_gguf):
    """The aborted request's last output reaches no face: the engine's step listener counts it."""
    import httpx

    srv = start_server("-np", "1", "-c", "512", "--metrics", "-a", "tiny", model=tiny_gguf)

    def aborted() -> float:
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url("/metrics")).text)}
        return value(fams, "vllm:request_success", "vllm:request_success_total", finished_reason="abort")

    assert aborted() == 0
    with httpx.stream("POST", srv.url("/v1/completions"), timeout=60,
                      json={"prompt": "count", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()  # keep a reference: a dropped iterator closes the connection
        while not next(lines).startswith("data: "):
            pass
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and aborted() == 0:
        time.sleep(0.1)
    assert aborted() == 1
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url("/metrics")).text)}
    assert value(fams, "vllm:request_success", "vllm:request_success_total", finished_reason="length") == 0
    assert value(fams, "vllm:num_requests_running", "vllm:num_requests_running") == 0
