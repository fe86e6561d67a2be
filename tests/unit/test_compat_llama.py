"""llama-server compatibility details found by running llama.cpp's own server tests (issue 32, build 1)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from servers import app_client

from kvserve.faces.head_case import HeadCaseTransport, title_case_head, title_case_name


def _raw(port: int, request: bytes) -> bytes:
    """One HTTP/1.1 exchange on a fresh connection (the server closes it: Connection: close)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(request)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    return data


# -- header names as llama-server writes them -------------------------------------------------

@pytest.mark.parametrize("name,want", [
    (b"content-type", b"Content-Type"), (b"access-control-allow-origin", b"Access-Control-Allow-Origin"),
    (b"vary", b"Vary"), (b"process-start-time-unix", b"Process-Start-Time-Unix"),
    (b"x-request-id", b"X-Request-Id"), (b"www-authenticate", b"WWW-Authenticate"), (b"etag", b"ETag"),
    (b"Content-Length", b"Content-Length"),
])
def test_title_case_name(name, want):
    assert title_case_name(name) == want


def test_title_case_head_touches_names_only():
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; charset=utf-8\r\nvary: origin\r\n\r\nbody: x\r\n"
    assert title_case_head(head) == \
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\nVary: origin\r\n\r\nbody: x\r\n"


class _Sink:
    def __init__(self):
        self.out: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def is_closing(self) -> bool:
        return self.closing


def test_transport_recases_the_response_head_only():
    sink = _Sink()
    t = HeadCaseTransport(sink)
    t.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 27\r\n\r\n")
    t.write(b"HTTP/1.1 200 OK\r\nx-body: 1\r\n")  # a body that looks like a head is left alone
    assert sink.out == [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 27\r\n\r\n",
                        b"HTTP/1.1 200 OK\r\nx-body: 1\r\n"]
    assert t.is_closing() is False  # everything else is the wrapped transport's


def test_live_server_writes_llama_server_header_names():
    from test_hardening_http import _Live, _state

    from kvserve.app import build_app

    with _Live(build_app(_state())) as live:
        # a loopback Host: a browser request (one with an Origin) naming another host is refused on a
        # loopback listener without a key (the DNS-rebinding guard)
        data = _raw(live.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://localhost:8080\r\n"
                               b"Connection: close\r\n\r\n")
        pre = _raw(live.port, b"OPTIONS /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://localhost:8080\r\n"
                              b"Access-Control-Request-Method: POST\r\nConnection: close\r\n\r\n")
    head = data.partition(b"\r\n\r\n")[0].split(b"\r\n")
    names = [ln.partition(b":")[0] for ln in head[1:]]
    assert head[0] == b"HTTP/1.1 503 Service Unavailable"  # the model never loads in this state
    assert {b"Content-Type", b"Content-Length", b"Access-Control-Allow-Origin", b"Vary"} <= set(names), names
    assert all(n == title_case_name(n) for n in names), names
    pre_names = [ln.partition(b":")[0] for ln in pre.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]]
    assert {b"Access-Control-Allow-Origin", b"Access-Control-Allow-Methods", b"Access-Control-Allow-Headers",
            b"Vary"} <= set(pre_names), pre_names


# -- the template context llama-server gives (enable_thinking, Llama 3.x, firefunction) -------

VENDOR = Path(__file__).resolve().parents[1] / "templates" / "vendor"
SHOW_THINKING = ("{%- for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor -%}"
                 "{%- if add_generation_prompt %}[assistant]{% endif -%}"
                 "|enable_thinking={{ enable_thinking if enable_thinking is defined else 'undefined' }}")
ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture
def served(tiny_gguf, tmp_path):
    """``served(template_text, *flags)``: an in-process server of the tiny model with that template."""
    clients = []

    def start(template: str, *flags: str):
        path = tmp_path / f"t{len(clients)}.jinja"
        path.write_text(template)
        c = app_client(tiny_gguf, tmp_path, "--chat-template-file", str(path), *flags)
        clients.append(c)
        return c

    yield start
    for c in clients:
        c.portal.call(c.state.manager.shutdown)
        c.__exit__(None, None, None)


def _prompt(client, **body) -> str:
    r = client.post("/apply-template", json={"messages": ASK, **body})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_reasoning_auto_passes_enable_thinking_true(served):
    auto = served(SHOW_THINKING)
    assert _prompt(auto) == "[user]hi[assistant]|enable_thinking=True"
    assert _prompt(auto, chat_template_kwargs={"enable_thinking": False}).endswith("|enable_thinking=False")
    assert _prompt(served(SHOW_THINKING, "--reasoning", "off")).endswith("|enable_thinking=False")
    assert _prompt(served(SHOW_THINKING, "--reasoning-budget", "0")).endswith("|enable_thinking=False")


def test_apply_template_honours_add_generation_prompt_false(served):
    c = served(SHOW_THINKING)
    assert _prompt(c, add_generation_prompt=False) == "[user]hi|enable_thinking=True"
    assert _prompt(c, add_generation_prompt=True) == "[user]hi[assistant]|enable_thinking=True"


def test_llama3_date_string_is_today(served):
    from datetime import datetime

    c = served((VENDOR / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text())
    before = datetime.now().strftime("%d %b %Y")
    prompt = _prompt(c)
    after = datetime.now().strftime("%d %b %Y")
    assert f"Today Date: {before}\n" in prompt or f"Today Date: {after}\n" in prompt, prompt
    assert "26 Jul 2024" not in prompt
    fixed = _prompt(c, chat_template_kwargs={"date_string": "1 Jan 2026"})  # the request still wins
    assert "Today Date: 1 Jan 2026\n" in fixed


def test_firefunction_gets_functions_and_datetime(served):
    from kvserve.chat.llama_context import family_context

    c = served((VENDOR / "fireworks-ai-llama-3-firefunction-v2.jinja").read_text())
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                                "parameters": {"type": "object",
                                                               "properties": {"path": {"type": "string"}}}}}]
    prompt = _prompt(c, tools=tools)
    assert json.dumps(tools, indent=2) in prompt and "Today is " in prompt and " GMT." in prompt
    assert "Available functions as JSON spec:\n\nToday is " in _prompt(c)  # no tools: functions is ""
    from datetime import datetime

    ctx = family_context(" functools[", None, now=datetime(2026, 1, 2, 3, 4, 5))
    assert ctx == {"functions": "", "datetime": "Jan 02 2026 03:04:05 GMT"}
    assert family_context("plain", None) == {}


# -- routes and shapes llama-server accepts ---------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_gguf, tmp_path_factory):
    """One in-process server of the tiny model (ChatML template), shared by the tests below."""
    d = tmp_path_factory.mktemp("compat")
    tmpl = Path(__file__).resolve().parents[1] / "templates" / "hermes_tools.jinja"
    c = app_client(tiny_gguf, d, "--chat-template-file", str(tmpl))
    yield c
    c.portal.call(c.state.manager.shutdown)
    c.__exit__(None, None, None)


def _completion(c, **body):
    r = c.post("/completion", json={"n_predict": 3, "temperature": 0, "return_tokens": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_prompt_objects_on_completion(tiny):
    plain = _completion(tiny, prompt="the cat sat")
    obj = _completion(tiny, prompt={"prompt_string": "the cat sat"})
    assert (obj["content"], obj["tokens"], obj["tokens_evaluated"]) == \
        (plain["content"], plain["tokens"], plain["tokens_evaluated"])
    several = _completion(tiny, prompt=[{"prompt_string": "the cat sat"}, "a dog", {"prompt_string": "a dog"}])
    assert [r["index"] for r in several] == [0, 1, 2]
    assert several[0]["tokens"] == plain["tokens"] and several[1]["tokens"] == several[2]["tokens"]
    for bad, msg in [({"prompt_string": 3}, 'a prompt object needs a "prompt_string" string'),
                     ({"multimodal_data": ["aGk="]}, 'a prompt object needs a "prompt_string" string'),
                     ({"prompt_string": "x", "multimodal_data": ["aGk="]}, "image input is not supported")]:
        r = tiny.post("/completion", json={"prompt": bad, "n_predict": 1})
        assert r.status_code == 400 and msg in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path", ["/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"])
def test_chat_input_tokens(tiny, path):
    msgs = [{"role": "user", "content": "How many tokens is this?"}]
    r = tiny.post(path, json={"messages": msgs})
    assert r.status_code == 200, r.text
    ran = tiny.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}).json()
    assert r.json() == {"input_tokens": ran["usage"]["prompt_tokens"]}
    prompt = tiny.post("/apply-template", json={"messages": msgs}).json()["prompt"]
    ids = tiny.post("/tokenize", json={"content": prompt, "add_special": False, "parse_special": True}).json()
    assert r.json()["input_tokens"] == len(ids["tokens"])
    bad = tiny.post(path, json={"messages": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error", bad.text


def test_responses_without_v1(tiny):
    body = {"input": "hi", "max_output_tokens": 2, "temperature": 0, "store": False, "cache_prompt": False}
    r, v1 = tiny.post("/responses", json=body), tiny.post("/v1/responses", json=body)
    assert r.status_code == v1.status_code == 200, r.text
    d, e = r.json(), v1.json()

    def content(x):
        return [c for item in x["output"] for c in item.get("content", [])]

    assert d["object"] == "response" and d["id"] != e["id"]
    assert content(d) == content(e) and d["status"] == e["status"]
    counts = ("input_tokens", "output_tokens")  # cached_tokens differ: the second found the first's prefix
    assert [d["usage"][k] for k in counts] == [e["usage"][k] for k in counts]
    assert d["usage"]["output_tokens"] <= 2


def test_idle_slot_next_token(tiny):
    done = _completion(tiny, prompt="the cat", id_slot=1)
    slot = tiny.get("/slots").json()[1]
    assert slot["is_processing"] is False and slot["id_task"] >= 0
    assert slot["next_token"] == [{"has_next_token": False, "has_new_line": "\n" in done["content"],
                                   "n_remain": -1, "n_decoded": 0}]
    # the tokens of the finished task are still counted: prompt + generated (the last not in the KV)
    assert slot["n_prompt_tokens"] == done["tokens_evaluated"] + done["tokens_predicted"] - 1


def test_flag_names_with_underscores():
    from kvserve.serving.args import parse_args
    from kvserve.serving.flags import dashed_names

    dashed = parse_args(["-m", "x.gguf", "--ctx-size", "256", "--reasoning-budget=0", "--no-cors-credentials",
                         "--max-num-seqs", "3"], environ={})
    under = parse_args(["-m", "x.gguf", "--ctx_size", "256", "--reasoning_budget=0", "--no_cors_credentials",
                        "--max_num_seqs", "3"], environ={})
    assert (under.ctx_size, under.reasoning_budget, under.max_num_seqs, under.cors_credentials) == (256, 0, 3, False)
    assert under == dashed
    # only known flags are respelled; values and words after "--" stay as given
    assert dashed_names(["--alias", "--my_alias", "--chat_template_kwargs={\"a_b\": 1}", "--", "--ctx_size"]) == \
        ["--alias", "--my_alias", "--chat-template-kwargs={\"a_b\": 1}", "--", "--ctx_size"]


# -- start-up says what is going on -----------------------------------------------------------

def test_start_here_lines():
    from kvserve.app import start_here_lines
    from kvserve.serving.args import parse_args

    body = "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}'"
    assert start_here_lines(parse_args(["-m", "x.gguf", "--port", "8081"], environ={})) == [
        "chat page: http://127.0.0.1:8081/",
        f'try: curl http://127.0.0.1:8081/v1/chat/completions -H "Content-Type: application/json" {body}']
    keyed = start_here_lines(parse_args(["-m", "x.gguf", "--host", "0.0.0.0", "--api-key", "s3cret", "--no-webui"],
                                        environ={}))
    assert keyed == [f'try: curl http://127.0.0.1:8080/v1/chat/completions -H "Content-Type: application/json" '
                     f'-H "Authorization: Bearer $API_KEY" {body}']


def test_native_build_is_announced(caplog, monkeypatch):
    import logging

    from kvserve.engine import model_runner as runner

    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        runner._log_native_build()
    (msg,) = [r.getMessage() for r in caplog.records]
    assert msg.startswith("building the native decode step (C++, once per machine and torch version, cached in ")
    assert msg.endswith("about 25 s on an idle machine, several minutes on a busy one; decoding eagerly until "
                        "it is ready")
