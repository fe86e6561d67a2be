"""kvserve.remote's parts without a kvserve server: the ``--remote`` value, the spec's checks and
repr, the start-up check against small real HTTP servers on loopback (200, 401, a redirect to
another host, nothing listening), the request bodies sent upstream and the parsing of the
upstream's streams into kvserve's pieces."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvserve.errors import InvalidInputError, NotSupportedError
from kvserve.remote import RemoteSpec, check_remote, estimate_tokens, parse_remote, redact_url
from kvserve.remote.check import models_of
from kvserve.remote.upstream import (
    MAX_ERROR_BYTES,
    OllamaStream,
    OpenAIStream,
    error_message,
    ollama_body,
    openai_body,
)
from kvserve.serving.chat_output import ReasoningPiece, TextPiece, ToolCallPiece
from kvserve.serving.chat_request import ChatRequest, ReasoningOptions, TemplateOptions
from kvserve.serving.args import parse_args
from kvserve.structured.spec import ConstraintSpec

# -- the flag and the spec ------------------------------------------------------------------


def test_parse_remote_fields():
    s = parse_remote("coder=http://gpu:8000/v1,key=VLLM_KEY,model=Qwen/Qwen3-8B")
    assert (s.name, s.base_url, s.dialect, s.upstream_model, s.key_env) == (
        "coder", "http://gpu:8000/v1", "openai", "Qwen/Qwen3-8B", "VLLM_KEY")
    o = parse_remote("ws=http://ws:11434/,dialect=ollama")
    assert (o.base_url, o.dialect, o.upstream_model, o.key_env) == ("http://ws:11434", "ollama", "ws", None)
    assert parse_remote("a=https://api.example.com").base_url == "https://api.example.com/v1"  # no path: /v1
    assert o.url("chat") == "http://ws:11434/api/chat" and s.url("models") == "http://gpu:8000/v1/models"


@pytest.mark.parametrize("value, text", [
    ("a=ftp://h/v1", "must start with http:// or https://"),
    ("a=http://", "must start with http:// or https://"),
    ("a=file:///etc/passwd", "must start with http:// or https://"),
    ("a=http://u:pw@h/v1", "must not carry user info"),
    ("a=http://h/v1?x=1", "must not have a query"),
    ("a=http://h:99999/v1", "not a valid URL"),
    ("a=http://h/v1,dialect=grpc", "unknown dialect 'grpc'"),
    ("a=http://h/v1,key=sk-abc-123", "takes the name of an environment variable"),
    ("a=http://h/v1,colour=red", "unknown or empty option 'colour'"),
    ("a=http://h/v1,model=x,model=y", "model= given twice"),
    ("http://h/v1", "--remote takes name=URL"),
    ("=http://h/v1", "remote model name"),
    ("nourl", "--remote takes name=URL"),
])
def test_parse_remote_refuses(value, text):
    with pytest.raises(InvalidInputError) as e:
        parse_remote(value)
    assert text in str(e.value)
    assert "sk-abc-123" not in str(e.value)


def test_flag_parses_and_refuses():
    a = parse_args(["--remote", "up=http://127.0.0.1:9/v1,key=K", "--remote", "o=http://h:11434,dialect=ollama"])
    assert [r.name for r in a.remote] == ["up", "o"]
    assert parse_args([]).remote == []
    for bad, text in ((["--remote", "x=ftp://q"], "invalid --remote: remote model 'x': base URL 'ftp://q'"),
                      (["--remote", "x=http://a", "--remote", "x=http://b"], "model 'x' is given twice")):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_key_never_in_repr_or_url(monkeypatch):
    monkeypatch.setenv("UPKEY", "sk-secret-42")
    s = parse_remote("up=http://h:1/v1,key=UPKEY")
    assert s.api_key() == "sk-secret-42"
    assert s.headers() == {"Authorization": "Bearer sk-secret-42"}
    assert "sk-secret-42" not in repr(s) + str(s) + s.shown_url
    monkeypatch.delenv("UPKEY")
    assert s.api_key() is None and s.headers() == {}


def test_redact_url():
    assert redact_url("https://user:pw@h.example:8443/v1?token=x") == "https://h.example:8443/v1"
    assert redact_url("http://[::1]:8/v1") == "http://[::1]:8/v1"


# -- the start-up check, against real servers on loopback -------------------------------------

class _Upstream(BaseHTTPRequestHandler):
    """200 with a model list for ``Bearer good``, 401 otherwise; /redirect/* -> another host."""

    def log_message(self, *a):
        pass

    def do_GET(self):
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.2:1/v1/models")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        ok = self.headers.get("Authorization") == "Bearer good"
        body = json.dumps({"object": "list", "data": [{"id": "coder"}]} if ok else {"error": "Unauthorized"}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def upstream():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_check_three_outcomes(upstream, monkeypatch):
    """Seed 004 Example 13: the right key, a wrong key, a server that has stopped."""
    monkeypatch.setenv("K", "good")
    ok = check_remote(parse_remote(f"m={upstream}/v1,key=K,model=coder"))
    assert (ok.outcome, ok.message, ok.models, ok.status) == ("ok", f"ok: {upstream}/v1 serves coder", ("coder",), 200)
    monkeypatch.setenv("K", "wrong")
    bad = check_remote(parse_remote(f"m={upstream}/v1,key=K"))
    assert (bad.outcome, bad.message, bad.status) == ("rejected", "rejected: check the API key ($K)", 401)
    none = check_remote(parse_remote(f"m={upstream}/v1"))
    assert none.message == "rejected: check the API key (none is configured: add key=ENV_VAR)"
    monkeypatch.setenv("K", "good")
    other = check_remote(parse_remote(f"m={upstream}/v1,key=K,model=other"))
    assert other.ok and other.message.endswith("(not 'other': requests may fail)")


def test_check_no_server_and_redirect(upstream):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gone = check_remote(parse_remote(f"m=http://127.0.0.1:{port}/v1"))
    assert gone.outcome == "no_server"
    assert gone.message.startswith(f"no server at the base URL http://127.0.0.1:{port}/v1 (")
    moved = check_remote(parse_remote(f"m={upstream}/redirect"))
    assert moved.outcome == "refused"
    assert moved.message == (f"refused: {upstream}/redirect redirects to another host (http://127.0.0.2); "
                             "kvserve does not follow it")


def test_models_of_both_dialects():
    assert models_of("openai", b'{"data": [{"id": "a"}, {"id": "b"}]}') == ("a", "b")
    assert models_of("ollama", b'{"models": [{"name": "qwen3:8b", "model": "qwen3:8b"}]}') == ("qwen3:8b",)
    assert models_of("openai", b"not json") == ()


# -- request bodies -----------------------------------------------------------------------------

def _req(**kw) -> ChatRequest:
    return ChatRequest([{"role": "user", "content": "hi"}], "chatcmpl-1", **kw)


def test_openai_body_forwards_only_what_the_request_set():
    req = _req(sampling={"temperature": 0.0, "n_predict": 16, "stop": ("END",), "seed": 7, "top_k": 5},
               tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}], tool_choice="required",
               parallel_tool_calls=False, response_format=ConstraintSpec("json_schema", '{"type":"object"}'),
               reasoning=ReasoningOptions(effort="low"), template=TemplateOptions(variables={"enable_thinking": False}))
    b = openai_body(req, "up-model", "front")
    assert b == {"model": "up-model", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                 "stream_options": {"include_usage": True}, "temperature": 0.0, "top_k": 5, "max_tokens": 16,
                 "seed": 7, "stop": ["END"], "tools": req.tools, "tool_choice": "required",
                 "parallel_tool_calls": False,
                 "response_format": {"type": "json_schema", "json_schema": {"name": "response",
                                                                            "schema": {"type": "object"}}},
                 "reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}}
    assert openai_body(_req(), "m", "f") == {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                            "stream": True, "stream_options": {"include_usage": True}}


def test_openai_body_tool_messages_from_ollama():
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
            {"role": "tool", "content": "r", "name": "f"}]
    b = openai_body(ChatRequest(msgs, "c"), "m", "f")
    assert b["messages"][1]["tool_calls"] == [{"function": {"name": "f", "arguments": '{"a": 1}'}, "id": "call_0",
                                               "type": "function"}]
    assert b["messages"][2]["tool_call_id"] == "call_0"


def test_ollama_body():
    req = _req(sampling={"temperature": 0.5, "n_predict": 30, "seed": 3, "repeat_penalty": 1.1},
               response_format=ConstraintSpec("json_object", ""))
    assert ollama_body(req, "echo", "f") == {
        "model": "echo", "messages": [{"role": "user", "content": "hi"}], "stream": True, "format": "json",
        "options": {"temperature": 0.5, "repeat_penalty": 1.1, "num_predict": 30, "seed": 3}}
    img = ChatRequest([{"role": "user", "content": [{"type": "text", "text": "see"}, {
        "type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}], "c")
    assert ollama_body(img, "m", "f")["messages"] == [{"role": "user", "content": "see", "images": ["AAAA"]}]
    with pytest.raises(NotSupportedError, match="a regex constraint cannot be forwarded to an Ollama upstream"):
        ollama_body(_req(response_format=ConstraintSpec("regex", "a+")), "m", "f")


@pytest.mark.parametrize("kw, text", [({"n": 2}, "n > 1"), ({"logprobs": 2}, "logprobs"),
                                      ({"sampling": {"logit_bias": {5: 1.0}}}, "logit_bias")])
def test_bodies_refuse_what_cannot_be_forwarded(kw, text):
    for make in (openai_body, ollama_body):
        with pytest.raises(NotSupportedError, match=text):
            make(_req(**kw), "m", "front")


# -- upstream streams -> pieces ------------------------------------------------------------------

def _sse(delta=None, finish=None, usage=None) -> str:
    d = {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]} if delta is not None or finish \
        else {"choices": []}
    if usage:
        d["usage"] = usage
    return json.dumps(d)


def test_openai_stream_text_reasoning_calls_usage():
    p = OpenAIStream()
    out = []
    out += p.feed(_sse({"role": "assistant", "reasoning_content": "think"}))
    out += p.feed(_sse({"content": "Hi"}))
    out += p.feed(_sse({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"a"'}}]}))
    out += p.feed(_sse({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}))
    out += p.feed(_sse({"tool_calls": [{"index": 1, "id": "c2", "function": {"name": "g", "arguments": "{}"}}]}))
    out += p.feed(_sse(finish="tool_calls"))
    out += p.feed(_sse(usage={"prompt_tokens": 10, "completion_tokens": 6,
                              "prompt_tokens_details": {"cached_tokens": 4}}))
    out += p.feed("[DONE]")
    out += p.finish()
    assert out == [ReasoningPiece("think"), TextPiece("Hi"), ToolCallPiece(0, "c1", "f", '{"a": 1}'),
                   ToolCallPiece(1, "c2", "g", "{}")]
    f = p.final
    assert (f.finish_reason, f.prompt_tokens, f.completion_tokens, f.cached_tokens) == ("tool_calls", 10, 6, 4)
    assert p.called_tools


def test_openai_stream_error_event_and_bad_json():
    p = OpenAIStream()
    assert p.feed(json.dumps({"error": {"message": "boom", "type": "server_error"}})) == []
    assert p.error == "boom"
    from kvserve.remote.upstream import UpstreamProtocolError

    with pytest.raises(UpstreamProtocolError):
        OpenAIStream().feed("{not json")


def test_ollama_stream():
    p = OllamaStream()
    lines = [{"message": {"role": "assistant", "content": "", "thinking": "hm"}, "done": False},
             {"message": {"role": "assistant", "content": "ok"}, "done": False},
             {"message": {"role": "assistant", "content": "", "tool_calls": [
                 {"function": {"name": "f", "arguments": {"path": "a"}}}]}, "done": False},
             {"message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "length",
              "prompt_eval_count": 12, "eval_count": 3}]
    out = [x for ln in lines for x in p.feed(json.dumps(ln))]
    assert out == [ReasoningPiece("hm"), TextPiece("ok"), ToolCallPiece(0, "call_0", "f", '{"path": "a"}')]
    assert (p.final.finish_reason, p.final.prompt_tokens, p.final.completion_tokens) == ("length", 12, 3)


def test_error_message_capped():
    assert error_message(401, b'{"error": "Unauthorized"}') == "Unauthorized"
    assert error_message(400, b'{"error": {"message": "bad  field", "type": "x"}}') == "bad field"
    huge = b'{"error": "' + b"x" * 100_000 + b'"}'
    msg = error_message(500, huge)
    assert len(msg) == 503 and msg.endswith("...")  # read from the first 4 KiB, shown up to 500 characters
    assert error_message(502, b"") == "status 502"
    assert MAX_ERROR_BYTES == 4096


def test_estimate_tokens():
    assert [estimate_tokens(t) for t in ("", "abc", "abcd", "abcde", "é" * 4)] == [0, 1, 1, 2, 2]


def test_runner_holds_like_a_model():
    from kvserve.remote import RemoteRunner

    closed = []
    r = RemoteRunner(parse_remote("up=http://127.0.0.1:9/v1"), parse_args([]), on_close=lambda: closed.append(1))
    assert (r.spec.name, r.spec.pinned, r.spec.remote, r.measured_bytes, r.device) == ("up", True, True, 0, "remote")
    assert r.ready and r.available and r.engine_counts() == (0, 0, 0.0) and not r.needs_reload(r.spec)
    plan = r.plan_chat(_req(sampling={"n_predict": 4, "temperature": 0.0}))
    assert plan.remote is not None and plan.model == "up" and len(plan.requests) == 1
    assert plan.requests[0].params.n_predict == 4 and plan.requests[0].prompt_token_ids == []
    with pytest.raises(NotSupportedError):
        r.plan_chat(_req(n=3))
    r.close()
    assert closed == [1] and not r.ready


# -- the Modelfile form and the store ------------------------------------------------------------

def test_modelfile_remote_command():
    from kvserve.ollama.modelfile import ModelfileError, parse_modelfile

    mf = parse_modelfile("FROM qwen3:8b\nREMOTE http://ws:11434 dialect=ollama key=WS_KEY\nSYSTEM be brief\n")
    assert mf.remote == "http://ws:11434 dialect=ollama key=WS_KEY"
    body = mf.create_request().to_json(model="ws")
    assert body == {"model": "ws", "from": "qwen3:8b", "system": "be brief", "remote_host": "http://ws:11434",
                    "remote_dialect": "ollama", "remote_key_env": "WS_KEY"}
    assert parse_modelfile("FROM m\nremote https://api.example.com/v1\n").create_request().to_json()["remote_dialect"] \
        == "openai"
    with pytest.raises(ModelfileError) as e:
        parse_modelfile("FROM m\nREMOTE http://h colour=red\n").create_request()
    assert str(e.value) == ("(line 2): REMOTE takes a base URL, then dialect=openai|ollama and key=ENV_VAR; "
                            "got 'colour=red'")
    with pytest.raises(ModelfileError, match="REMOTE needs FROM to name the upstream's model"):
        parse_modelfile("FROM ./w.gguf\nREMOTE http://h\n").create_request()
    assert parse_modelfile("FROM m\nREMOTE http://h\n").to_text() == "FROM m\nREMOTE http://h\n"


def test_create_remote_model(tmp_path):
    from kvserve.ollama.create import iter_create, iter_create_modelfile
    from kvserve.store import Store

    store = Store(tmp_path / "models")
    events = [e["status"] for e in iter_create_modelfile(store, "ws", "FROM qwen3:8b\nREMOTE http://ws:11434/ "
                                                         "dialect=ollama key=WS_KEY\n")]
    assert events[0] == "gathering model components" and events[-1] == "success"
    m = store.get("ws")
    assert m is not None and m.model_path is None
    cfg = json.loads(store.blob_path(m.manifest.config.digest).read_bytes())
    assert (cfg["remote_host"], cfg["remote_model"], cfg["remote_dialect"], cfg["remote_key_env"]) == (
        "http://ws:11434", "qwen3:8b", "ollama", "WS_KEY")
    with pytest.raises(InvalidInputError, match="must start with http:// or https://"):
        list(iter_create(store, {"model": "x", "from": "m", "remote_host": "ftp://h"}))
    with pytest.raises(InvalidInputError, match="a remote model needs 'from' to name the upstream's model"):
        list(iter_create(store, {"model": "x", "files": {"a.gguf": "sha256:" + "0" * 64}, "remote_host": "http://h"}))


def test_state_serves_a_store_remote_model(tmp_path, monkeypatch):
    from kvserve.ollama.create import iter_create
    from kvserve.serving.state import ServerState
    from kvserve.store import Store

    monkeypatch.setenv("OLLAMA_REMOTES", "ws")  # Ollama's allow-list for stored remote models

    list(iter_create(Store(tmp_path / "models"), {"model": "ws", "from": "qwen3:8b", "remote_host": "http://ws:11434"}))
    state = ServerState(parse_args(["--models-dir", str(tmp_path / "models"), "--no-preload"]))
    spec = state.resolve("ws")
    assert (spec.name, spec.remote, spec.pinned) == ("ws:latest", True, True)
    r = state.remote_of("ws:latest")  # made by Ollama's create form: its dialect is Ollama's
    assert (r.base_url, r.dialect, r.upstream_model, r.key_env) == ("http://ws:11434", "ollama", "qwen3:8b", None)
    assert [m.name for m in state.catalog() if m.remote is not None] == ["ws:latest"]


def test_state_refuses_a_store_remote_model_outside_ollama_remotes(tmp_path, monkeypatch, caplog):
    """Ollama's rule: a stored remote model whose host is not in OLLAMA_REMOTES (default
    ollama.com) is 400 ``this server cannot run this remote model`` and never listed as remote."""
    from kvserve.ollama.create import iter_create
    from kvserve.remote import remote_host_allowed
    from kvserve.serving.state import ServerState
    from kvserve.store import Store

    monkeypatch.delenv("OLLAMA_REMOTES", raising=False)
    assert [remote_host_allowed(u) for u in ("https://ollama.com", "https://OLLAMA.com:443/x", "http://ws:11434",
                                             "http://ollama.com.evil.org", "http://evil.org/?ollama.com")] == [
        True, True, False, False, False]
    list(iter_create(Store(tmp_path / "models"), {"model": "ws", "from": "qwen3:8b", "remote_host": "http://ws:11434",
                                                  "remote_key_env": "HOME"}))
    state = ServerState(parse_args(["--models-dir", str(tmp_path / "models"), "--no-preload"]))
    with pytest.raises(InvalidInputError) as e:
        state.resolve("ws")
    assert str(e.value) == "this server cannot run this remote model"
    assert state.store_remotes == {}
    assert sum("OLLAMA_REMOTES" in r.getMessage() for r in caplog.records) == 1
    caplog.clear()
    with caplog.at_level("WARNING"):
        for _ in range(3):
            state.catalog()
            with pytest.raises(InvalidInputError):
                state.resolve("ws")
    assert [r.getMessage() for r in caplog.records if "OLLAMA_REMOTES" in r.getMessage()] == []  # warned once
    monkeypatch.setenv("OLLAMA_REMOTES", " ollama.com , WS ")
    assert remote_host_allowed("http://ws:11434") and not remote_host_allowed("http://ws2:11434")
