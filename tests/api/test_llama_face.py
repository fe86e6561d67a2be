"""The seed's curl examples (000_6dcbf6b03a8c9f77.txt Examples 2-8, 15, 17) against a real server.

Values that depend on the model (token counts) come from our own tokenizer, which
is pinned to llama.cpp's. Loops are bounded; servers are always terminated.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

TIMEOUT = httpx.Timeout(120.0)


def post(srv, path, body, **kw):
    return httpx.post(srv.url(path), json=body, timeout=TIMEOUT, **kw)


def get(srv, path, **kw):
    return httpx.get(srv.url(path), timeout=TIMEOUT, **kw)


def sse_events(resp) -> list[str]:
    """Raw SSE lines (data and comments) of a streamed response."""
    return [ln for ln in resp.iter_lines() if ln != ""]


def data_events(lines):
    out = []
    for ln in lines:
        if ln.startswith("data: "):
            payload = ln[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def poll(fn, timeout=30.0, interval=0.05):
    """Call ``fn`` until it returns a truthy value (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError("condition not met in time")


# -- Example 1 and 2: start-up, /health, API keys ---------------------------------------------------

def test_startup_health_and_api_keys(start_server, tmp_path):
    keyfile = tmp_path / "keys"
    keyfile.write_text("from-file\n\n")
    srv = start_server("--api-key", "secret-123,other", "--api-key-file", str(keyfile), "--no-slots",
                       "--sse-ping-interval", "0.02", "-np", "1", "-c", "2048", wait=False)
    # the listener opens before the model loads: the first answers are 503 Loading model
    def first_answer():
        try:
            return httpx.get(srv.url("/health"), timeout=2)
        except httpx.HTTPError:
            return None
    r = poll(first_answer, timeout=60, interval=0.02)
    assert r.status_code == 503, r.text
    assert r.text == '{"error":{"message":"Loading model","type":"unavailable_error","code":503}}'
    srv.wait_ready()
    r = get(srv, "/health")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    assert get(srv, "/v1/health").status_code == 200
    log = srv.log()
    order = ["load_model: loading model", "load_model: initializing, n_slots = 1, n_ctx_slot = 2048, "
             "kv_unified = 'false'", "llama_server: model loaded",
             f"llama_server: listening on http://127.0.0.1:{srv.port}"]
    pos = [log.index(s) for s in order]
    assert pos == sorted(pos), log
    assert "security: no API key" not in log
    assert re.search(r"^\d+\.\d\d\.\d{3}\.\d{3} I srv  llama_server: model loaded$", log, re.M), log

    for path in ("/v1/models", "/metrics", "/slots", "/props"):
        for headers in ({}, {"Authorization": "Bearer nope"}, {"X-Api-Key": "nope"}):
            r = get(srv, path, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.json() == {"error": {"message": "Invalid API Key", "type": "authentication_error",
                                          "code": 401}}
            assert r.text == '{"error":{"message":"Invalid API Key","type":"authentication_error","code":401}}'
    r = post(srv, "/tokenize", {"content": "hi"})
    assert r.status_code == 401
    assert get(srv, "/v1/models", headers={"Authorization": "Bearer secret-123"}).status_code == 200
    assert get(srv, "/v1/models", headers={"Authorization": "Bearer other"}).status_code == 200
    assert get(srv, "/v1/models", headers={"X-Api-Key": "from-file"}).status_code == 200
    auth = {"X-Api-Key": "secret-123"}
    # --no-slots and no --metrics: 501
    r = get(srv, "/slots", headers=auth)
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    assert get(srv, "/metrics", headers=auth).status_code == 501
    # CORS preflight needs no key
    r = httpx.options(srv.url("/v1/chat/completions"), headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] in ("*", "http://example.com")
    r = get(srv, "/v1/models", headers={**auth, "Origin": "http://example.com"})
    assert r.headers["access-control-allow-origin"] in ("*", "http://example.com")

    # SSE comment pings while nothing else is sent (--sse-ping-interval 0.02)
    with httpx.stream("POST", srv.url("/completion"), headers=auth, timeout=TIMEOUT,
                      json={"prompt": "word " * 600, "n_predict": 4, "temperature": 0, "stream": True}) as resp:
        assert resp.status_code == 200
        lines = sse_events(resp)
    assert ":" in lines, lines[:5]
    events = data_events(lines)
    assert events[-1]["stop"] is True and "[DONE]" not in events


def test_slot_save_path_must_exist(tmp_path):
    import subprocess
    import sys

    missing = tmp_path / "nope"
    r = subprocess.run([sys.executable, "-m", "kvserve", "serve", "--slot-save-path", str(missing)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert f'error while handling argument "--slot-save-path": not a directory: {missing}' in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvserve", "serve", "--no-such-flag"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--no-such-flag" in r.stderr


def test_security_warning_logged(smollm2_server):
    assert "W srv  llama_server: security: no API key is set and CORS allows all origins" in smollm2_server.log()


# -- Example 3: /v1/models and /props ----------------------------------------------------------------

def test_models(smollm2_server, smollm2_tokenizer):
    for path in ("/v1/models", "/models"):
        r = get(smollm2_server, path)
        assert r.status_code == 200
        d = r.json()
        assert d["object"] == "list"
        m = d["models"][0]
        assert m["name"] == m["model"] == "tiny-coder"
        assert m["details"]["format"] == "gguf" and m["capabilities"] == ["completion"]
        e = d["data"][0]
        assert e["id"] == "tiny-coder" and e["object"] == "model" and e["owned_by"] == "llamacpp"
        assert e["aliases"] == ["tiny-coder"] and isinstance(e["created"], int)
        meta = e["meta"]
        assert meta["n_ctx"] == 2048 and meta["n_vocab"] == smollm2_tokenizer.n_vocab
        assert meta["vocab_type"] == 2 and meta["n_ctx_train"] >= 2048
        assert meta["n_embd"] > 0 and meta["n_params"] > 0 and meta["size"] > 0 and meta["ftype"]


def test_props(smollm2_server, smollm2_tokenizer):
    d = get(smollm2_server, "/props").json()
    p = d["default_generation_settings"]["params"]
    assert (p["seed"], p["top_k"], p["n_predict"], p["repeat_penalty"]) == (4294967295, 40, -1, 1.0)
    assert p["temperature"] == pytest.approx(0.8) and p["top_p"] == pytest.approx(0.95)
    assert p["min_p"] == pytest.approx(0.05) and p["stream"] is False
    assert p["samplers"] == ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                             "temperature"]
    assert d["default_generation_settings"]["n_ctx"] == 2048
    assert d["total_slots"] == 2 and d["model_alias"] == "tiny-coder"
    assert d["modalities"] == {"vision": False, "video": False, "audio": False}
    assert (d["endpoint_slots"], d["endpoint_props"], d["endpoint_metrics"]) == (True, False, True)
    assert "<|im_start|>" in d["chat_template"]
    assert d["chat_template_caps"]["supports_system_role"] is True
    assert d["bos_token"] == smollm2_tokenizer.bos_token and d["eos_token"] == smollm2_tokenizer.eos_token
    assert re.fullmatch(r"b\d+-[0-9a-f]{7}|kvserve-.+", d["build_info"])
    assert d["is_sleeping"] is False and d["model_path"]


# -- Example 6: /completion ------------------------------------------------------------------------

PROMPT = "public static void main"


def test_completion_fields(smollm2_server, smollm2_tokenizer):
    r = post(smollm2_server, "/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0,
                                             "return_tokens": True})
    assert r.status_code == 200, r.text
    d = r.json()
    n_prompt = len(smollm2_tokenizer.encode(PROMPT, add_special=True))
    assert d["index"] == 0 and d["stop"] is True and d["model"] == "tiny-coder"
    assert d["id_slot"] in (0, 1)
    assert d["tokens_evaluated"] == n_prompt
    assert d["tokens_predicted"] == 4 and d["stop_type"] == "limit" and d["stopping_word"] == ""
    assert d["prompt"] == PROMPT and d["truncated"] is False
    assert d["tokens_cached"] == n_prompt + 4 - 1
    assert len(d["tokens"]) == 4 and smollm2_tokenizer.decode(d["tokens"]) == d["content"]
    assert d["has_new_line"] == ("\n" in d["content"])
    t = d["timings"]
    assert t["cache_n"] + t["prompt_n"] == d["tokens_evaluated"] and t["predicted_n"] == 4
    for k in ("prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_ms", "predicted_per_token_ms",
              "predicted_per_second"):
        assert isinstance(t[k], float)
    g = d["generation_settings"]
    assert g["temperature"] == 0.0 and g["n_predict"] == 4 and g["max_tokens"] == 4 and g["grammar"] == ""
    # the same prompt as token ids, and as a mixed list, evaluates the same tokens
    ids = smollm2_tokenizer.encode(PROMPT, add_special=True)
    d2 = post(smollm2_server, "/completion", {"prompt": ids, "n_predict": 4, "temperature": 0}).json()
    assert d2["tokens_evaluated"] == n_prompt and d2["content"] == d["content"]
    words = PROMPT.split(" ", 1)
    mixed = smollm2_tokenizer.encode(words[0], add_special=True) + [" " + words[1]]
    d3 = post(smollm2_server, "/completion", {"prompt": mixed, "n_predict": 1, "temperature": 0}).json()
    assert d3["tokens_evaluated"] == len(mixed) - 1 + len(smollm2_tokenizer.encode(" " + words[1]))


def test_completion_probs(smollm2_server):
    d = post(smollm2_server, "/completion", {"prompt": PROMPT, "n_predict": 2, "temperature": 0,
                                             "n_probs": 3}).json()
    probs = d["completion_probabilities"]
    assert len(probs) == 2
    p = probs[0]
    assert set(p) == {"id", "token", "bytes", "logprob", "top_logprobs"}
    assert len(p["top_logprobs"]) == 3 and set(p["top_logprobs"][0]) == {"id", "token", "bytes", "logprob"}
    assert p["logprob"] <= 0
    d = post(smollm2_server, "/completion", {"prompt": PROMPT, "n_predict": 1, "temperature": 0,
                                             "n_probs": 2, "post_sampling_probs": True}).json()
    p = d["completion_probabilities"][0]
    assert set(p) == {"id", "token", "bytes", "prob", "top_probs"} and 0 <= p["prob"] <= 1


def stream_completion(srv, body):
    with httpx.stream("POST", srv.url("/completion"), json={**body, "stream": True}, timeout=TIMEOUT) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        return data_events(sse_events(resp))


def test_completion_stream_equals_non_stream(smollm2_server):
    body = {"prompt": "The capital of France is", "n_predict": 6, "temperature": 0.7, "seed": 42}
    whole = post(smollm2_server, "/completion", body).json()
    events = stream_completion(smollm2_server, body)
    assert "[DONE]" not in events  # llama-server sends no [DONE] on /completion
    parts, final = events[:-1], events[-1]
    assert all(e["stop"] is False and e["stop_type"] == "none" for e in parts)
    assert final["stop"] is True and final["stop_type"] == whole["stop_type"] and "timings" in final
    assert "".join(e["content"] for e in parts) == whole["content"]
    assert final["tokens_predicted"] == whole["tokens_predicted"]


def test_utf8_never_half_a_character(smollm2_server, smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("😀")
    partial = next(i for i in ids if isinstance(tok.piece(i), list))  # bytes that are not UTF-8 alone
    body = {"prompt": "Smile:", "n_predict": 1, "temperature": 0, "logit_bias": [[partial, 100]],
            "return_tokens": True}
    d = post(smollm2_server, "/completion", body).json()
    assert d["tokens"] == [partial] and "\ufffd" not in d["content"]
    events = stream_completion(smollm2_server, body)
    assert all("\ufffd" not in e["content"] for e in events)


def test_stop_string_never_leaks(smollm2_server, smollm2_tokenizer):
    base = {"prompt": "Once upon a time", "n_predict": 8, "temperature": 0, "return_tokens": True}
    d = post(smollm2_server, "/completion", base).json()
    pieces = [smollm2_tokenizer.decode([t]) for t in d["tokens"]]
    k = next(i for i in range(1, len(pieces) - 1) if len(pieces[i].strip()) > 1)
    stop = (pieces[k] + pieces[k + 1])[1:]  # starts inside token k, ends in token k+1
    expected = d["content"][: d["content"].index(stop)]
    events = stream_completion(smollm2_server, {**base, "stop": [stop]})
    text = "".join(e["content"] for e in events[:-1])
    assert text == expected
    assert events[-1]["stop_type"] == "word" and events[-1]["stopping_word"] == stop
    d2 = post(smollm2_server, "/completion", {**base, "stop": stop}).json()
    assert d2["content"] == expected and d2["stop_type"] == "word"


# -- Example 7: /tokenize, /detokenize, /apply-template -----------------------------------------------

def test_tokenize_detokenize(smollm2_server, smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode(PROMPT)
    assert post(smollm2_server, "/tokenize", {"content": PROMPT}).json() == {"tokens": ids}
    d = post(smollm2_server, "/tokenize", {"content": PROMPT, "with_pieces": True}).json()
    assert [t["id"] for t in d["tokens"]] == ids and "".join(t["piece"] for t in d["tokens"]) == PROMPT
    im_start = tok.token_to_id("<|im_start|>")
    d = post(smollm2_server, "/tokenize", {"content": "<|im_start|>user", "with_pieces": True}).json()
    assert d["tokens"][0] == {"id": im_start, "piece": "<|im_start|>"} and len(d["tokens"]) == 2
    d = post(smollm2_server, "/tokenize", {"content": "<|im_start|>user", "with_pieces": True,
                                           "parse_special": False}).json()
    assert im_start not in [t["id"] for t in d["tokens"]] and len(d["tokens"]) > 2
    assert "".join(t["piece"] for t in d["tokens"]) == "<|im_start|>user"
    # llama-server's "content", and vLLM's "prompt" beside it
    assert post(smollm2_server, "/detokenize", {"tokens": ids}).json() == {"content": PROMPT, "prompt": PROMPT}


def test_apply_template(smollm2_server):
    d = post(smollm2_server, "/apply-template", {"messages": [
        {"role": "system", "content": "You are a coding assistant."},
        {"role": "user", "content": "Write hello world in Java."}]}).json()
    assert d == {"prompt": "<|im_start|>system\nYou are a coding assistant.<|im_end|>\n<|im_start|>user\n"
                           "Write hello world in Java.<|im_end|>\n<|im_start|>assistant\n"}
    d = post(smollm2_server, "/apply-template", {"messages": [{"role": "user", "content": "Say hi."}]}).json()
    assert d["prompt"].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert d["prompt"].endswith("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n")


# -- Example 8 and 15: slots, deferred requests, /metrics --------------------------------------------

def test_two_slots_at_once_third_waits(smollm2_server):
    srv = smollm2_server
    get(srv, "/metrics")  # start a new gauge window
    results: dict[str, httpx.Response] = {}

    def run(name, body):
        results[name] = post(srv, "/completion", body)

    # long enough that both stay busy while the test polls /slots and /metrics: at 24 tokens "a" could
    # finish before "b" started once decoding got faster (the native decode step)
    n = 200
    long = {"n_predict": n, "ignore_eos": True, "temperature": 0}
    threads = [threading.Thread(target=run, args=("a", {"prompt": "first request", "id_slot": 0, **long})),
               threading.Thread(target=run, args=("b", {"prompt": "second request here", **long}))]
    # "a" first: were "b" placed first, it could take slot 0 (the LRU one) and "a" would wait for it
    threads[0].start()
    poll(lambda: get(srv, "/slots").json()[0]["is_processing"], timeout=60)
    threads[1].start()

    def both_busy():
        s = get(srv, "/slots").json()
        return s if all(x["is_processing"] for x in s) else None
    slots = poll(both_busy, timeout=60)
    assert [s["id"] for s in slots] == [0, 1]
    for s in slots:
        assert s["n_ctx"] == 2048 and s["speculative"] is False and s["params"]["n_predict"] == n
        nt = s["next_token"][0]
        assert nt["has_next_token"] is True and nt["n_remain"] == n - nt["n_decoded"]
    r = get(srv, "/slots?fail_on_no_slot=1")
    assert r.status_code == 503
    assert r.json() == {"error": {"code": 503, "message": "no slot available", "type": "unavailable_error"}}
    third = threading.Thread(target=run, args=("c", {"prompt": "third", "n_predict": 2, "temperature": 0}))
    third.start()

    def deferred():
        m = get(srv, "/metrics").text
        return "llamacpp:requests_deferred 1" in m and "llamacpp:requests_processing 2" in m
    poll(deferred, timeout=30)
    for t in threads + [third]:
        t.join(timeout=120)
    assert {k: v.status_code for k, v in results.items()} == {"a": 200, "b": 200, "c": 200}
    assert results["a"].json()["id_slot"] == 0 and results["b"].json()["id_slot"] == 1
    assert results["a"].json()["tokens_predicted"] == n
    m = get(srv, "/metrics").text
    busy = float(re.search(r"^llamacpp:n_busy_slots_per_decode (\S+)$", m, re.M).group(1))
    assert busy > 1.0  # the two slots decoded together in one batch
    assert get(srv, "/slots?fail_on_no_slot=1").status_code == 200


METRIC_NAMES = ["prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total",
                "tokens_predicted_total", "tokens_predicted_seconds_total", "n_decode_total", "n_tokens_max",
                "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                "spec_decode_num_drafts_total", "prompt_tokens_seconds", "predicted_tokens_seconds",
                "requests_processing", "requests_deferred", "n_busy_slots_per_decode"]


def test_metrics(smollm2_server):
    post(smollm2_server, "/completion", {"prompt": PROMPT, "n_predict": 2})
    r = get(smollm2_server, "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    vals, types = {}, {}
    for ln in r.text.splitlines():
        if ln.startswith("# TYPE "):
            _, _, name, typ = ln.split(" ")
            types[name] = typ
        elif ln and not ln.startswith("#"):
            name, v = ln.rsplit(" ", 1)
            vals[name] = float(v)
    # llama-server's families first, in its order (vLLM's vllm: families follow on the same page)
    assert [k for k in vals if k.startswith("llamacpp:")] == [f"llamacpp:{n}" for n in METRIC_NAMES]
    assert next(iter(vals)) == "llamacpp:prompt_tokens_total" and "vllm:" in r.text
    assert all(f"# HELP llamacpp:{n} " in r.text for n in METRIC_NAMES)
    for n in METRIC_NAMES:
        want = "gauge" if n.endswith("_seconds") or n.startswith(("requests_", "n_busy")) else "counter"
        assert types[f"llamacpp:{n}"] == want, n
    assert vals["llamacpp:prompt_tokens_total"] > 0 and vals["llamacpp:tokens_predicted_total"] >= 2
    assert vals["llamacpp:prompt_tokens_seconds"] > 0
    # gauges cover the window since the previous scrape; counters do not reset
    again = get(smollm2_server, "/metrics").text
    assert "llamacpp:prompt_tokens_seconds 0\n" in again
    assert f"llamacpp:prompt_tokens_total {int(vals['llamacpp:prompt_tokens_total'])}\n" in again


def test_disconnect_frees_slot(smollm2_server):
    srv = smollm2_server
    with httpx.stream("POST", srv.url("/completion"), timeout=TIMEOUT,
                      json={"prompt": "Count to one thousand:", "n_predict": 1000, "ignore_eos": True,
                            "id_slot": 1, "stream": True}) as resp:
        lines = resp.iter_lines()  # keep a reference: a dropped iterator closes the connection
        while not next(lines).startswith("data: "):
            pass
        assert get(srv, "/slots").json()[1]["is_processing"] is True
    poll(lambda: get(srv, "/slots").json()[1]["is_processing"] is False, timeout=15)


# -- Example 17: errors -------------------------------------------------------------------------------

def test_errors(smollm2_server, smollm2_tokenizer):
    srv = smollm2_server
    big = "hello " * 2100
    n = len(smollm2_tokenizer.encode(big, add_special=True))
    r = post(srv, "/completion", {"prompt": big, "n_predict": 4})
    assert r.status_code == 400
    assert r.json() == {"error": {
        "code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": n, "n_ctx": 2048,
        "message": f"request ({n} tokens) exceeds the available context size (2048 tokens), try increasing it"}}
    # a stream that fails before its first token gets a plain HTTP error
    r = post(srv, "/completion", {"prompt": big, "n_predict": 4, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error"
    # malformed JSON: 400 invalid_request_error (llama-server answers 500 server_error)
    r = httpx.post(srv.url("/completion"), content=b'{"prompt": "hi"', timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = post(srv, "/completion", {"n_predict": 1})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = post(srv, "/completion", {"prompt": "hi", "temperature": "hot"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Field 'temperature': type must be number, but is string"
    r = get(srv, "/v1/nothing")
    assert r.status_code == 404
    assert r.text == '{"error":{"message":"File Not Found","type":"not_found_error","code":404}}'
    r = post(srv, "/props", {})
    assert r.status_code == 501 and r.json() == {"error": {
        "code": 501, "type": "not_supported_error",
        "message": "This server does not support changing global properties. Start it with `--props`"}}
    for path in ("/v1/embeddings", "/embeddings"):
        r = post(srv, path, {"input": "hi"})
        assert r.status_code == 501 and r.json() == {"error": {
            "code": 501, "type": "not_supported_error",
            "message": "This server does not support embeddings. Start it with `--embeddings`"}}


def test_chat_error_rows(smollm2_server, smollm2_tokenizer):
    """Example 17's rows as sent to /v1/chat/completions (the OpenAI face)."""
    srv = smollm2_server
    r = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 2100}],
                                           "max_tokens": 4})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == 2048 and err["n_prompt_tokens"] > 2048
    r = httpx.post(srv.url("/v1/chat/completions"), content=b'{"messages":[{"role":"user","content":"hi"}',
                   timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = post(srv, "/v1/chat/completions", {"prompt": "hi"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "'messages' is required"
    r = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("Field 'temperature': ")


def test_bad_input_is_4xx_and_server_survives(smollm2_server, smollm2_tokenizer):
    """Defects found by a break-it review: each must be a 4xx/501 envelope, never a 500."""
    srv = smollm2_server
    for bad in ([99999], [-1], [49152]):
        r = post(srv, "/completion", {"prompt": bad, "n_predict": 2})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == f"Field 'prompt': token id {bad[0]} out of range [0, 49152)"
    # issue #11: a lone surrogate is refused on every route (read_json), naming the field;
    # a valid pair written as escapes is one character
    r = httpx.post(srv.url("/tokenize"), content=b'{"content": "\\ud800 hi"}', timeout=TIMEOUT)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Field 'content': string is not valid Unicode (lone surrogate U+D800)"
    r = httpx.post(srv.url("/tokenize"), content=b'{"content": "\\ud83d\\ude42 hi"}', timeout=TIMEOUT)
    assert r.status_code == 200
    assert r.json()["tokens"] == smollm2_tokenizer.encode("\U0001f642 hi")
    r = httpx.post(srv.url("/v1/chat/completions"), timeout=TIMEOUT,
                   content=b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}')
    assert r.status_code == 400  # issue #11: a lone surrogate in a request field is refused, naming it
    assert r.json()["error"]["message"] == "Field 'messages[0].content': string is not valid Unicode (lone surrogate U+D800)"
    deep = "[" * 5000 + "]" * 5000
    r = httpx.post(srv.url("/v1/chat/completions"), content=('{"messages":' + deep + "}").encode(), timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["message"] == "invalid JSON: nesting too deep"
    # the prompt fits, prompt + n_predict does not: the message counts both
    n = len(smollm2_tokenizer.encode("hello " * 2000, add_special=True))
    r = post(srv, "/completion", {"prompt": "hello " * 2000, "n_predict": 100})
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "exceed_context_size_error"
    assert (err["n_prompt_tokens"], err["n_ctx"], err["n_predict"]) == (n, 2048, 100)
    assert err["message"].startswith(f"request ({n} prompt tokens + 100 requested tokens = {n + 100} tokens)")
    # constrained output: a grammar the backend cannot enforce is a 400, never unconstrained
    r = post(srv, "/completion", {"prompt": "yes or no:", "grammar": 'root ::= "yes" | "no"', "n_predict": 4})
    assert r.status_code == 200 and r.json()["content"] in ("yes", "no")
    r = post(srv, "/completion", {"prompt": "yes or no:", "grammar": 'root ::= yes'})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                           "response_format": {"type": "bogus"}})
    assert r.status_code == 400
    r = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                           "response_format": {"type": "text"}})
    assert r.status_code == 200
    assert get(srv, "/health/").status_code == 404  # no 307 slash redirect (llama-server: 404)
    assert get(srv, "/health").json() == {"status": "ok"}
    assert "Traceback" not in srv.log()
