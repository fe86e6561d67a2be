"""Remote models (issue 35 item 2, seed 004 Example 13): a front ``kvserve serve`` with
``--remote`` models whose answers come from other servers on 127.0.0.1, reached through every
face with the official ``openai``, ``anthropic`` and ``ollama`` clients.

Upstreams (all real servers on loopback, free ports, stopped by pid at teardown):

- ``up``: a second ``kvserve serve`` on the tiny random GGUF (tests/tinymodel.py), the hermes
  tool template, ``--api-key``: the front's answers are compared with asking it directly (greedy,
  the same prompt cache state), texts and usage counts exactly;
- ``victim``: another kvserve, SIGKILLed in the middle of a stream;
- tests/remote_standin.py: a stand-in that speaks only Ollama's ``/api/chat`` (deterministic
  answers, and the misbehaving ``forever``/``huge``/``die`` models), one that answers 401 to
  everything, and one that redirects to another host;
- ``gone``: a free port nothing listens on.

The front also serves the tiny model itself (``-m``), to show it stays healthy.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
from servers import REPO, free_port, spawn

KEY_ENV = "KVSERVE_TEST_UPSTREAM_KEY"
KEY = "sk-upstream-secret-4f1c9e"  # the upstream's key: must never show at the front
UP_MODEL = "up-tiny"
HERMES = Path(__file__).resolve().parents[1] / "templates" / "hermes_tools.jinja"
MSGS = [{"role": "user", "content": "Hello you"}]
READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file from the workspace",
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "enum": ["pom.xml", "src/Main.java"]}},
                   "required": ["path"]}}}


def _standin(mode: str, logdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(logdir / f"standin-{mode}.log", "wb")
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "remote_standin.py"), mode, str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(base + "/api/tags", timeout=1)
            return proc, base
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    pytest.fail(f"stand-in {mode} did not start")


@pytest.fixture(scope="module")
def servers(tiny_gguf, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("remote")
    procs, kv = [], []
    try:
        up_args = ("-a", UP_MODEL, "-np", "1", "-c", "2048", "--chat-template-file", str(HERMES), "--api-key", KEY)
        up = spawn(tiny_gguf, up_args, logdir)
        kv.append(up)
        victim = spawn(tiny_gguf, ("-a", "victim-tiny", "-np", "1", "-c", "2048"), logdir)
        kv.append(victim)
        for mode in ("ollama", "reject", "redirect"):
            procs.append(_standin(mode, logdir))
        (_, oll), (_, rej), (_, moved) = procs
        up.wait_ready()
        victim.wait_ready()
        gone = f"http://127.0.0.1:{free_port()}/v1"
        remotes = [f"up={up.base_url}/v1,key={KEY_ENV},model={UP_MODEL}",
                   f"victim={victim.base_url},model=victim-tiny",
                   f"oll={oll},dialect=ollama,model=echo", f"nou={oll},dialect=ollama,model=nousage",
                   f"forever={oll},dialect=ollama,model=forever", f"huge={oll},dialect=ollama,model=huge",
                   f"die={oll},dialect=ollama,model=die",
                   f"rej={rej}/v1,key={KEY_ENV}", f"gone={gone}", f"moved={moved}/v1,key={KEY_ENV}"]
        args = ["-a", "local", "-np", "1", "-c", "1024", "--metrics"]
        for r in remotes:
            args += ["--remote", r]
        front = spawn(tiny_gguf, tuple(args), logdir, {KEY_ENV: KEY})
        kv.append(front)
        front.wait_ready()
        _wait_checks(front, 10)
        yield {"up": up, "victim": victim, "front": front, "oll": oll}
    finally:
        for s in kv:
            s.stop()
        for p, _ in procs:
            p.kill()
            p.wait(timeout=10)


def _wait_checks(front, n: int) -> None:
    """The start-up checks run in the background: wait until all ``n`` are logged."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if front.log().count("remote:") >= n:
            return
        time.sleep(0.1)
    pytest.fail(f"start-up checks not logged:\n{front.log()}")


@pytest.fixture(scope="module")
def front(servers):
    return servers["front"]


@pytest.fixture(scope="module")
def oai(front) -> openai.OpenAI:
    return openai.OpenAI(base_url=front.url("/v1"), api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def direct(servers) -> openai.OpenAI:
    """The upstream kvserve asked directly."""
    return openai.OpenAI(base_url=servers["up"].url("/v1"), api_key=KEY, max_retries=0, timeout=60)


def _direct_chat(direct, **kw):
    """The upstream's own answer (asked twice: the first fills its prompt cache, so the second is
    in the same state as the front's request, which follows it)."""
    kw = {"model": UP_MODEL, "messages": MSGS, "max_tokens": 8, "temperature": 0, **kw}
    direct.chat.completions.create(**kw)
    return direct.chat.completions.create(**kw)


# -- start-up checks, listing, show ------------------------------------------------------

def test_startup_checks_log_three_distinct_messages(front, servers):
    log = front.log()
    lines = [ln for ln in log.splitlines() if "remote:" in ln]
    by_name = {n: next(ln for ln in lines if f"remote model '{n}'" in ln) for n in ("up", "rej", "gone", "moved")}
    assert f"): ok: {servers['up'].base_url}/v1 serves" in by_name["up"]
    assert by_name["up"].endswith(f"serves {UP_MODEL}")
    assert by_name["rej"].endswith(f"rejected: check the API key (${KEY_ENV})")
    assert "no server at the base URL" in by_name["gone"]
    assert "refused:" in by_name["moved"] and "redirects to another host (http://127.0.0.2)" in by_name["moved"]
    assert "serves echo, nousage, forever, huge, die" in next(ln for ln in lines if "remote model 'oll'" in ln)
    assert KEY not in log


def test_models_list_status_and_no_key(front):
    body = httpx.get(front.url("/v1/models")).json()
    data = {m["id"]: m for m in body["data"]}
    assert data["up"]["status"] == {"value": "loaded"}
    assert data["up"]["owned_by"] == "remote"
    assert data["up"]["remote"]["model"] == UP_MODEL
    assert data["up"]["remote"]["dialect"] == "openai"
    assert data["up"]["remote"]["available"] is True
    for name in ("rej", "gone", "moved"):
        assert data[name]["status"] == {"value": "unavailable"}, name
        assert data[name]["remote"]["available"] is False
    assert data["local"]["status"] == {"value": "loaded"}
    tags = {m["name"]: m for m in httpx.get(front.url("/api/tags")).json()["models"]}
    assert tags["oll"]["remote_model"] == "echo"
    assert tags["oll"]["remote_host"].startswith("http://127.0.0.1:")
    ps = {m["name"]: m for m in httpx.get(front.url("/api/ps")).json()["models"]}
    assert ps["up"]["size"] == 0 and ps["up"]["context_length"] == 0
    text = json.dumps(body) + json.dumps(tags) + httpx.get(front.url("/props"), params={"model": "up"}).text
    assert KEY not in text


def test_show_runs_the_check(front):
    c = ollama.Client(host=front.base_url)
    up = c.show("up")
    assert up.modelfile.splitlines()[0] == f"FROM {UP_MODEL}"
    r = httpx.post(front.url("/api/show"), json={"model": "rej"}).json()
    assert r["remote_check"] == f"rejected: check the API key (${KEY_ENV})"
    r = httpx.post(front.url("/api/show"), json={"model": "gone"}).json()
    assert r["remote_check"].startswith("no server at the base URL http://127.0.0.1:")
    r = httpx.post(front.url("/api/show"), json={"model": "up"}).json()
    assert r["remote_check"].endswith(f"serves {UP_MODEL}")
    assert KEY not in json.dumps(r)
    # the CLI against the running server
    out = subprocess.run([sys.executable, "-m", "kvserve", "show", "rej"], capture_output=True, text=True, timeout=60,
                         cwd=REPO, env={"OLLAMA_HOST": front.base_url, "PATH": "/usr/bin:/bin"})
    assert "Remote check" in out.stdout and "rejected: check the API key" in out.stdout, out.stdout + out.stderr


# -- every face, against an OpenAI-dialect upstream (the second kvserve) --------------------

def test_openai_chat_matches_upstream(oai, direct):
    want = _direct_chat(direct)
    got = oai.chat.completions.create(model="up", messages=MSGS, max_tokens=8, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.choices[0].finish_reason == want.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.usage.prompt_tokens, 8)
    assert got.model == "up"
    assert "estimated" not in got.usage.model_extra


def test_openai_chat_stream_matches_upstream(oai, direct):
    want = _direct_chat(direct)
    chunks = list(oai.chat.completions.create(model="up", messages=MSGS, max_tokens=8, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == want.usage.prompt_tokens


def test_openai_tool_call_forwarded(oai, direct):
    want = _direct_chat(direct, tools=[READ_FILE], tool_choice="required", max_tokens=64)
    got = oai.chat.completions.create(model="up", messages=MSGS, tools=[READ_FILE], tool_choice="required",
                                      max_tokens=64, temperature=0)
    wc, gc = want.choices[0].message.tool_calls, got.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in gc] == [(c.function.name, c.function.arguments) for c in wc]
    assert gc[0].function.name == "read_file"
    assert json.loads(gc[0].function.arguments)["path"] in ("pom.xml", "src/Main.java")
    assert got.choices[0].finish_reason == "tool_calls"


def test_structured_output_forwarded(oai, direct):
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "enum": ["x", "y"]}}, "required": ["a"]}}}
    want = _direct_chat(direct, response_format=fmt, max_tokens=32)
    got = oai.chat.completions.create(model="up", messages=MSGS, response_format=fmt, max_tokens=32, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert json.loads(got.choices[0].message.content)["a"] in ("x", "y")


def test_anthropic_messages(front, direct):
    want = _direct_chat(direct)
    a = anthropic.Anthropic(base_url=front.base_url, api_key="unused", max_retries=0, timeout=60)
    m = a.messages.create(model="up", max_tokens=8, messages=MSGS, extra_body={"temperature": 0})
    assert m.content[0].text == want.choices[0].message.content
    assert m.stop_reason == "max_tokens"
    assert m.usage.output_tokens == 8
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == want.usage.prompt_tokens
    with a.messages.stream(model="up", max_tokens=8, messages=MSGS, extra_body={"temperature": 0}) as s:
        assert "".join(s.text_stream) == want.choices[0].message.content
    tool = {"name": "read_file", "description": "Read a file",
            "input_schema": READ_FILE["function"]["parameters"]}
    want_t = _direct_chat(direct, tools=[READ_FILE], tool_choice="required", max_tokens=64)
    t = a.messages.create(model="up", max_tokens=64, messages=MSGS, tools=[tool], tool_choice={"type": "any"},
                          extra_body={"temperature": 0})
    uses = [b for b in t.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [
        (c.function.name, json.loads(c.function.arguments)) for c in want_t.choices[0].message.tool_calls]
    assert t.stop_reason == "tool_use"


def test_responses(oai, direct):
    want = _direct_chat(direct)
    r = oai.responses.create(model="up", input="Hello you", max_output_tokens=8, temperature=0)
    assert r.output_text == want.choices[0].message.content
    assert r.status == "incomplete" and r.usage.output_tokens == 8
    events = list(oai.responses.create(model="up", input="Hello you", max_output_tokens=8, temperature=0, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == want.choices[0].message.content
    assert events[-1].type == "response.incomplete"


def test_ollama_chat_and_generate(front, direct):
    want = _direct_chat(direct)
    c = ollama.Client(host=front.base_url)
    r = c.chat(model="up", messages=MSGS, options={"num_predict": 8, "temperature": 0})
    assert r.message.content == want.choices[0].message.content
    assert (r.prompt_eval_count, r.eval_count, r.done_reason) == (want.usage.prompt_tokens, 8, "length")
    streamed = "".join(p.message.content for p in c.chat(model="up", messages=MSGS, stream=True,
                                                         options={"num_predict": 8, "temperature": 0}))
    assert streamed == want.choices[0].message.content
    g = c.generate(model="up", prompt="Hello you", options={"num_predict": 8, "temperature": 0})
    assert g.response == want.choices[0].message.content
    assert g.eval_count == 8
    with pytest.raises(ollama.ResponseError) as e:
        c.generate(model="up", prompt="Hello", raw=True)
    assert e.value.status_code == 400 and "remote model" in e.value.error


# -- an upstream that speaks only Ollama's /api/chat -----------------------------------------

def test_ollama_only_upstream_every_face(front, oai, servers):
    r = oai.chat.completions.create(model="oll", messages=MSGS, temperature=0.5, max_tokens=30, seed=3)
    assert r.choices[0].message.content == "echo: Hello you"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (2, 4)  # the stand-in's counts
    last = httpx.get(servers["oll"] + "/last").json()
    assert last == {"model": "echo", "messages": MSGS, "stream": True,
                    "options": {"temperature": 0.5, "num_predict": 30, "seed": 3}}
    chunks = [c.choices[0].delta.content for c in oai.chat.completions.create(model="oll", messages=MSGS, stream=True)
              if c.choices and c.choices[0].delta.content]
    assert chunks == ["echo", ": He", "llo ", "you"]  # as the upstream streamed them
    a = anthropic.Anthropic(base_url=front.base_url, api_key="unused", max_retries=0, timeout=60)
    assert a.messages.create(model="oll", max_tokens=50, messages=MSGS).content[0].text == "echo: Hello you"
    c = ollama.Client(host=front.base_url)
    assert c.chat(model="oll", messages=MSGS).message.content == "echo: Hello you"
    assert c.generate(model="oll", prompt="Hello you").response == "echo: Hello you"
    assert oai.responses.create(model="oll", input="Hello you").output_text == "echo: Hello you"


def test_ollama_only_upstream_tools_format_think(front, oai, servers):
    t = oai.chat.completions.create(model="oll", messages=MSGS, tools=[READ_FILE])
    calls = t.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("read_file", {"path": "pom.xml"})]
    assert t.choices[0].finish_reason == "tool_calls"
    assert httpx.get(servers["oll"] + "/last").json()["tools"] == [READ_FILE]
    c = ollama.Client(host=front.base_url)
    r = c.chat(model="oll", messages=MSGS, tools=[READ_FILE])
    assert [(x.function.name, dict(x.function.arguments)) for x in r.message.tool_calls] == [
        ("read_file", {"path": "pom.xml"})]
    j = oai.chat.completions.create(model="oll", messages=MSGS, response_format={"type": "json_object"})
    assert json.loads(j.choices[0].message.content) == {"echo": "Hello you"}
    assert httpx.get(servers["oll"] + "/last").json()["format"] == "json"
    th = c.chat(model="oll", messages=MSGS, think=True)
    assert (th.message.thinking, th.message.content) == ("hmm", "echo: Hello you")
    # a tool result goes back with the call it answers
    follow = [*MSGS, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "pom.xml"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "<project/>"}, {"role": "user", "content": "thanks"}]
    assert oai.chat.completions.create(model="oll", messages=follow).choices[0].message.content == "echo: thanks"
    sent = httpx.get(servers["oll"] + "/last").json()["messages"]
    assert sent[1]["tool_calls"] == [{"function": {"name": "read_file", "arguments": {"path": "pom.xml"}}}]
    assert sent[2] == {"role": "tool", "content": "<project/>", "tool_name": "read_file"}


def test_usage_estimated_when_upstream_gives_none(oai, front):
    r = oai.chat.completions.create(model="nou", messages=MSGS)
    assert r.choices[0].message.content == "echo: Hello you"
    # 4 bytes a token: "Hello you" is 9 bytes -> 3, "echo: Hello you" 15 bytes -> 4
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (math.ceil(9 / 4), math.ceil(15 / 4))
    assert r.usage.model_extra["estimated"] is True
    assert "the upstream gave no usage: counts estimated from the text" in front.log()


# -- errors and bad upstreams -----------------------------------------------------------------

def test_unreachable_and_rejected_in_each_envelope(front, oai):
    with pytest.raises(openai.APIStatusError) as e:
        oai.chat.completions.create(model="gone", messages=MSGS)
    assert e.value.status_code == 503
    assert e.value.body["message"].startswith("remote model 'gone': no server at the base URL http://127.0.0.1:")
    with pytest.raises(openai.APIStatusError) as e:
        oai.chat.completions.create(model="rej", messages=MSGS)
    assert e.value.status_code == 502
    assert e.value.body["message"] == ("remote model 'rej': the upstream rejected the key (401: Unauthorized): "
                                       "check the API key")
    a = anthropic.Anthropic(base_url=front.base_url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(anthropic.APIStatusError) as e:
        a.messages.create(model="rej", max_tokens=8, messages=MSGS)
    assert e.value.status_code == 502
    assert e.value.body["error"]["type"] == "api_error"
    assert "check the API key" in e.value.body["error"]["message"]
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=front.base_url).chat(model="gone", messages=MSGS)
    assert e.value.status_code == 503 and "no server at the base URL" in e.value.error
    with pytest.raises(openai.APIStatusError) as e:
        oai.chat.completions.create(model="moved", messages=MSGS)
    assert e.value.status_code == 502
    assert "redirects to another host (http://127.0.0.2); kvserve does not follow it" in e.value.body["message"]
    assert KEY not in front.log()


def test_forever_stream_bounded_by_max_tokens(oai):
    t0 = time.monotonic()
    r = oai.chat.completions.create(model="forever", messages=MSGS, max_tokens=5)
    assert r.choices[0].message.content == "xxxxx"
    assert r.choices[0].finish_reason == "length"
    assert time.monotonic() - t0 < 10


def test_client_disconnect_reaches_upstream(front, servers):
    before = httpx.get(servers["oll"] + "/stats").json()["disconnects"]
    with httpx.stream("POST", front.url("/v1/chat/completions"),
                      json={"model": "forever", "messages": MSGS, "stream": True}, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 4:
                break
    deadline = time.monotonic() + 10
    while httpx.get(servers["oll"] + "/stats").json()["disconnects"] == before:
        assert time.monotonic() < deadline, "the upstream never saw the client leave"
        time.sleep(0.05)
    # not streamed: a client that gives up waiting closes the upstream request too
    before += 1
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(front.url("/v1/chat/completions"), json={"model": "forever", "messages": MSGS}, timeout=1.5)
    deadline = time.monotonic() + 10
    while httpx.get(servers["oll"] + "/stats").json()["disconnects"] < before + 1:
        assert time.monotonic() < deadline, "the upstream never saw the non-streaming client leave"
        time.sleep(0.05)
    assert httpx.get(front.url("/health")).status_code == 200


def test_huge_json_is_capped(oai):
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        oai.chat.completions.create(model="huge", messages=MSGS)
    assert e.value.status_code == 502
    assert e.value.body["message"] == ("remote model 'huge': the upstream's answer broke off: the upstream sent an "
                                       "event over 1 MiB")
    assert time.monotonic() - t0 < 10


def test_upstream_dying_mid_stream_ends_with_error_event(oai, front):
    stream = oai.chat.completions.create(model="die", messages=MSGS, stream=True)
    got = []
    with pytest.raises(openai.APIError) as e:
        for c in stream:
            if c.choices and c.choices[0].delta.content:
                got.append(c.choices[0].delta.content)
    assert got == ["one ", "two "]
    assert "remote model 'die': the upstream's answer broke off" in str(e.value)
    assert httpx.get(front.url("/health")).status_code == 200


def test_killed_upstream_mid_stream(oai, front, servers):
    """SIGKILL of the real upstream kvserve in the middle of a stream: the client's stream ends
    with an error event, the front stays healthy and its local model answers, and the remote
    model then answers 503 (no server) and lists as unavailable."""
    victim = servers["victim"]
    stream = oai.chat.completions.create(model="victim", messages=MSGS, stream=True, max_tokens=1500, temperature=0,
                                         extra_body={"ignore_eos": True})
    n = 0
    with pytest.raises(openai.APIError) as e:
        for c in stream:
            if c.choices and c.choices[0].delta.content:
                n += 1
                if n == 1:
                    victim.proc.kill()
                    victim.proc.wait(timeout=10)
    assert n >= 1
    assert "remote model 'victim': the upstream's answer broke off" in str(e.value)
    assert httpx.get(front.url("/health")).status_code == 200
    local = oai.chat.completions.create(model="local", messages=MSGS, max_tokens=3, temperature=0)
    assert local.choices[0].finish_reason == "length" and local.usage.completion_tokens == 3
    with pytest.raises(openai.APIStatusError) as e2:
        oai.chat.completions.create(model="victim", messages=MSGS)
    assert e2.value.status_code == 503
    data = {m["id"]: m for m in httpx.get(front.url("/v1/models")).json()["data"]}
    assert data["victim"]["status"] == {"value": "unavailable"}


def test_metrics_count_remote_requests(front, oai):
    def successes() -> float:
        text = httpx.get(front.url("/metrics"), params={"model": "oll"}).text
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                   if ln.startswith("vllm:request_success_total{") and 'model_name="oll"' in ln)

    before = successes()
    oai.chat.completions.create(model="oll", messages=MSGS)
    assert successes() == before + 1


def test_modelfile_remote_model(servers, tmp_path):
    """``kvserve create`` from a Modelfile with REMOTE, then a server on that store: the model is
    checked at start, listed, shown and answers through the OpenAI and Ollama clients."""
    home = tmp_path / "home"
    mf = tmp_path / "Modelfile"
    mf.write_text(f"FROM echo\nREMOTE {servers['oll']} dialect=ollama\n")
    env = {"KVSERVE_HOME": str(home), "PATH": "/usr/bin:/bin", "OLLAMA_REMOTES": "127.0.0.1"}  # Ollama's allow-list
    out = subprocess.run([sys.executable, "-m", "kvserve", "create", "echo-remote", "-f", str(mf)], capture_output=True,
                         text=True, timeout=60, cwd=REPO, env=env)
    assert out.returncode == 0 and out.stderr.splitlines()[-1] == "success", out.stderr
    show = subprocess.run([sys.executable, "-m", "kvserve", "show", "--models-dir", str(home / "models"), "echo-remote"],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert "Remote check    ok: " in show.stdout, show.stdout + show.stderr
    srv = spawn("", ("--no-preload",), tmp_path, {"KVSERVE_HOME": str(home), "OLLAMA_REMOTES": "127.0.0.1"})
    try:
        srv.wait_ready()
        _wait_checks(srv, 1)
        assert f"remote model 'echo-remote:latest' (ollama, {servers['oll']}): ok: " in srv.log()
        c = openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="echo-remote", messages=MSGS)
        assert r.choices[0].message.content == "echo: Hello you"
        assert ollama.Client(host=srv.base_url).chat(model="echo-remote", messages=MSGS).message.content == \
            "echo: Hello you"
        data = {m["id"]: m for m in httpx.get(srv.url("/v1/models")).json()["data"]}
        assert data["echo-remote:latest"]["remote"]["model"] == "echo"
        tags = httpx.get(srv.url("/api/tags")).json()["models"]
        assert [(t["name"], t["remote_model"], t["remote_host"]) for t in tags] == [
            ("echo-remote:latest", "echo", servers["oll"])]
    finally:
        srv.stop()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
    ("/completion", {"prompt": "hi", "n_predict": 4}),
    ("/tokenize", {"content": "hi"}),
    ("/detokenize", {"tokens": [1, 2]}),
    ("/v1/chat/completions/input_tokens", {"messages": MSGS}),
])
def test_what_needs_a_tokenizer_is_501(front, path, body):
    r = httpx.post(front.url(path), json={"model": "oll", **body}, timeout=30)
    assert r.status_code == 501, r.text
    assert r.json()["error"]["message"].startswith("model 'oll' is a remote model: ")
    assert httpx.get(front.url("/slots"), params={"model": "oll"}).status_code == 501
    a = httpx.post(front.url("/v1/messages/count_tokens"), json={"model": "oll", "messages": MSGS})
    assert a.status_code == 400  # Anthropic has no 501
    assert a.json()["error"]["message"] == "model 'oll' is a remote model: its upstream counts its tokens"
