"""``--spec-type ngram`` through the faces: the same greedy content as a server without it,
llama-server's ``draft_n`` / ``draft_n_accepted`` in ``timings``, per-request
``speculative.n_max`` / ``n_min`` (parsed, echoed in generation_settings, 0 turns it off),
streaming with several tokens per step. A tiny random-weight model served in process."""

from __future__ import annotations

import json

import pytest
import tinymodel  # tests/ is on sys.path (tests/conftest.py)
import torch
from starlette.testclient import TestClient

from kvserve.app import build_app
from kvserve.serving.args import parse_args
from kvserve.serving.state import ServerState


def _client(d, path, *extra):
    state = ServerState(parse_args(["-m", str(path), "-a", "tiny", "-c", "1024", "-np", "2", "--models-dir",
                                    str(d / "models"), *extra]))
    return state, TestClient(build_app(state), base_url="http://127.0.0.1")


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec_api")
    path = tinymodel.write_tiny_gguf(d / "tiny.gguf", seed=3)
    s1, plain = _client(d, path)
    s2, spec = _client(d, path, "--spec-type", "ngram", "--draft-max", "8", "--spec-ngram-size-n", "2")
    with plain, spec:
        plain.portal.call(s1.preload)
        spec.portal.call(s2.preload)
        yield plain, spec
        plain.portal.call(s1.manager.shutdown)
        spec.portal.call(s2.manager.shutdown)


def _prompt(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (12,), generator=g).tolist() * 4


def _complete(c, **body):
    r = c.post("/completion", json={"prompt": _prompt(), "n_predict": 48, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_same_content_and_draft_counters(clients):
    plain, spec = clients
    a, b = _complete(plain, return_tokens=True), _complete(spec, return_tokens=True)
    assert b["content"] == a["content"] and b["tokens"] == a["tokens"] and len(b["tokens"]) == 48
    t = b["timings"]
    assert t["draft_n"] > 0 and 0 < t["draft_n_accepted"] <= t["draft_n"]
    keys = list(t)
    assert keys.index("draft_n") == keys.index("predicted_per_second") + 1
    assert keys[keys.index("draft_n") + 1] == "draft_n_accepted"
    assert "draft_n" not in a["timings"] and "draft_n_accepted" not in a["timings"]
    gs = b["generation_settings"]  # the server's settings in effect (--draft-max 8), not llama-server's 16
    assert (gs["speculative.n_max"], gs["speculative.n_min"], gs["speculative.p_min"]) == (8, 0, 0.0)
    ga = a["generation_settings"]
    assert (ga["speculative.n_max"], ga["speculative.n_min"], ga["speculative.p_min"]) == (16, 0, 0.0)


def test_generation_settings_echo_the_draft_settings_in_effect(tmp_path):
    """Review item 2: the server's -md/--draft-max/--draft-min/--draft-p-min are echoed (were 16 and
    0.75), a request's n_max is capped to the server's, its p_min is taken (range [0, 1])."""
    path = tinymodel.write_tiny_gguf(tmp_path / "tiny.gguf", seed=3, n_layer=2)
    state, c = _client(tmp_path, path, "-md", str(path), "--draft-max", "4", "--draft-min", "1",
                       "--draft-p-min", "0.25")
    with c:
        c.portal.call(state.preload)

        def spec_of(gs):
            return gs["speculative.n_max"], gs["speculative.n_min"], gs["speculative.p_min"]

        props = c.get("/props").json()["default_generation_settings"]["params"]
        assert spec_of(props) == (4, 1, 0.25)
        body = {"prompt": _prompt(), "n_predict": 4, "temperature": 0}
        assert spec_of(_complete(c, n_predict=4)["generation_settings"]) == (4, 1, 0.25)
        assert spec_of(_complete(c, n_predict=4, **{"speculative.n_max": 1})["generation_settings"]) == (1, 1, 0.25)
        assert spec_of(_complete(c, n_predict=4, **{"speculative.n_max": 1e9})["generation_settings"]) == (4, 1, 0.25)
        assert spec_of(_complete(c, n_predict=4, **{"speculative.p_min": 0.5})["generation_settings"]) == (4, 1, 0.5)
        for bad in (2.0, -1):
            r = c.post("/completion", json={**body, "speculative.p_min": bad})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"] == f"speculative.p_min must be in [0, 1], got {bad:g}"
        r = c.post("/completion", json={**body, "speculative.p_min": "x"})
        assert r.status_code == 400
        c.portal.call(state.manager.shutdown)


def test_per_request_n_max_zero_turns_it_off_and_is_echoed(clients):
    plain, spec = clients
    off = _complete(spec, **{"speculative.n_max": 0})
    assert "draft_n" not in off["timings"]
    assert off["content"] == _complete(plain)["content"]
    assert off["generation_settings"]["speculative.n_max"] == 0
    lim = _complete(spec, **{"speculative.n_max": 2, "speculative.n_min": 1})
    assert lim["generation_settings"]["speculative.n_max"] == 2
    assert lim["generation_settings"]["speculative.n_min"] == 1
    assert 0 < lim["timings"]["draft_n"]
    clamp = _complete(spec, **{"speculative.n_max": -5})  # llama-server clamps to 0
    assert clamp["generation_settings"]["speculative.n_max"] == 0 and "draft_n" not in clamp["timings"]
    bad = spec.post("/completion", json={"prompt": _prompt(), "speculative.n_max": "x"})
    assert bad.status_code == 400


def test_stream_emits_every_token(clients):
    plain, spec = clients
    ref = _complete(plain, return_tokens=True)
    with spec.stream("POST", "/completion", json={"prompt": _prompt(), "n_predict": 48, "temperature": 0,
                                                   "stream": True, "return_tokens": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    toks = [t for e in events for t in e.get("tokens", [])]
    assert toks == ref["tokens"]
    assert "".join(e["content"] for e in events) == ref["content"]
    assert max(len(e.get("tokens", [])) for e in events) > 1
    assert events[-1]["stop"] is True and events[-1]["timings"]["draft_n_accepted"] > 0


def test_openai_completions_same_text(clients):
    plain, spec = clients
    body = {"model": "tiny", "prompt": _prompt(), "max_tokens": 40, "temperature": 0}
    a = plain.post("/v1/completions", json=body).json()
    b = spec.post("/v1/completions", json=body).json()
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert b["usage"] == a["usage"]


def test_slots_say_speculative(clients):
    plain, spec = clients
    assert [s["speculative"] for s in plain.get("/slots").json()] == [False, False]
    assert [s["speculative"] for s in spec.get("/slots").json()] == [True, True]


def test_vllm_spec_decode_counters(tmp_path):
    """vLLM's spec_decode counters equal the request's draft_n / draft_n_accepted; a server
    without speculation has none of the families."""
    from prometheus_client.parser import text_string_to_metric_families

    path = tinymodel.write_tiny_gguf(tmp_path / "tiny.gguf", seed=3)
    state, c = _client(tmp_path, path, "--metrics", "--spec-type", "ngram", "--draft-max", "8",
                       "--spec-ngram-size-n", "2")
    with c:
        c.portal.call(state.preload)
        t = _complete(c)["timings"]
        fams = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}

        def total(name: str) -> float:
            return sum(s.value for s in fams[name].samples if s.name == name + "_total")

        assert total("vllm:spec_decode_num_draft_tokens") == t["draft_n"] > 0
        assert total("vllm:spec_decode_num_accepted_tokens") == t["draft_n_accepted"] > 0
        assert total("vllm:spec_decode_num_accepted_tokens_per_pos") == t["draft_n_accepted"]
        assert 0 < total("vllm:spec_decode_num_drafts") <= t["draft_n"]
        pos = sorted(int(s.labels["position"]) for s in fams["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
                     if s.name.endswith("_total"))
        assert pos == list(range(len(pos))) and all(
            s.labels["model_name"] == "tiny" for s in fams["vllm:spec_decode_num_drafts"].samples)
        c.portal.call(state.manager.shutdown)
    plain_state, plain = _client(tmp_path, path, "--metrics")
    with plain:
        plain.portal.call(plain_state.preload)
        _complete(plain)
        assert "vllm:spec_decode" not in plain.get("/metrics").text
        plain.portal.call(plain_state.manager.shutdown)


def test_draft_model_same_content_counters_and_metrics(tmp_path):
    """``-md`` through /completion and /metrics: an 8-layer target and a one-layer draft (cheap
    enough for the draft-length policy to draft); a sampled request speculates too."""
    from prometheus_client.parser import text_string_to_metric_families

    path = tinymodel.write_tiny_gguf(tmp_path / "tiny.gguf", seed=3, n_layer=8)
    draft = tinymodel.write_tiny_gguf(tmp_path / "draft.gguf", seed=3, n_layer=1)
    plain_state, plain = _client(tmp_path, path)
    with plain:
        plain.portal.call(plain_state.preload)
        ref = _complete(plain, return_tokens=True)
        plain.portal.call(plain_state.manager.shutdown)
    state, c = _client(tmp_path, path, "--metrics", "-md", str(draft), "--draft-max", "4")
    with c:
        c.portal.call(state.preload)
        b = _complete(c, return_tokens=True)
        assert b["tokens"] == ref["tokens"] and b["content"] == ref["content"]
        t = b["timings"]
        assert t["draft_n"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"]
        fams = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}

        def total(name: str) -> float:
            return sum(s.value for s in fams[name].samples if s.name == name + "_total")

        assert total("vllm:spec_decode_num_draft_tokens") == t["draft_n"]
        assert total("vllm:spec_decode_num_accepted_tokens") == t["draft_n_accepted"]
        s = _complete(c, temperature=0.8, top_k=20, seed=5)
        assert s["timings"]["draft_n"] > 0 and s["timings"]["predicted_n"] == 48
        assert _complete(c, temperature=0.8, top_k=20, seed=5)["content"] == s["content"]
        c.portal.call(state.manager.shutdown)


def test_draft_model_vocab_mismatch_is_a_startup_error(tmp_path):
    from kvserve.serving.manager import LoadFailedError

    path = tinymodel.write_tiny_gguf(tmp_path / "tiny.gguf", seed=3)
    other = tinymodel.write_tiny_gguf(tmp_path / "other.gguf", extra_control_tokens=("<x>",))
    state, c = _client(tmp_path, path, "-md", str(other))
    with c:
        with pytest.raises(LoadFailedError, match=r"model 'tiny' failed to load: the target and draft vocabs are not "
                                                  r"compatible: target vocab size 301 does not match draft vocab "
                                                  r"size 302 \(kvserve needs the same vocabulary\)"):
            c.portal.call(state.preload)


@pytest.mark.slow
def test_failed_draft_load_exits_1_not_sigabrt(smollm2_path, tmp_path):
    """Review item 4: a draft with another vocabulary stops ``kvserve serve`` with exit status 1
    (was SIGABRT, rc 134: the target's native step was packing weights in a daemon thread at exit)."""
    import subprocess
    import sys

    other = tinymodel.write_tiny_gguf(tmp_path / "other.gguf", extra_control_tokens=("<x>",))
    p = subprocess.run([sys.executable, "-m", "kvserve", "serve", smollm2_path, "-md", str(other), "--port", "0",
                        "--models-dir", str(tmp_path / "models")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "terminate called" not in p.stderr
    assert "the target and draft vocabs are not compatible: draft model special tokens must match target model" in \
        p.stderr
