"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) against real
``kvserve serve`` processes, through the official ``anthropic`` client and raw HTTP.

The model is the tiny random-weight GGUF (tests/tinymodel.py): its text is noise, so the tests
compare it with what the OpenAI face answers for the same chat (same engine, greedy, no prefix
reuse), count prompt tokens by rendering the equivalent OpenAI messages with the same template,
and force tool calls with tool_choice (grammar-constrained: valid even from random weights).

Servers (one each for the module, one slot so that prefix reuse is exact):
- ``srv``: tests/templates/hermes_tools.jinja (tool calls) with ``--api-key``;
- ``think``: tests/templates/think.jinja (the generation prompt opens ``<think>``).
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import pytest

from kvserve.chat.prompt import render_chat
from kvserve.chat.template import ChatTemplate
from kvserve.loaders.tokenizer import Tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "templates"
HERMES = TEMPLATES / "hermes_tools.jinja"
THINK = TEMPLATES / "think.jinja"
KEY = "sk-anthropic-test"
MODEL = "tiny"
GREEDY = {"temperature": 0, "cache_prompt": False}  # outputs compared across requests: no prefix reuse

READ_FILE = {"name": "read_file", "description": "Read a file from the workspace",
             "input_schema": {"type": "object",
                              "properties": {"path": {"type": "string", "enum": ["pom.xml", "src/Main.java"]}},
                              "required": ["path"]}}
READ_FILE_OPENAI = {"type": "function", "function": {"name": "read_file", "description": READ_FILE["description"],
                                                     "parameters": READ_FILE["input_schema"]}}
MULTI = [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello."},
         {"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def srv(start_server_module, tiny_gguf):
    return start_server_module("--chat-template-file", str(HERMES), "-np", "1", "-c", "2048", "--api-key", KEY, "-a", MODEL,
                               model=tiny_gguf)


@pytest.fixture(scope="module")
def think(start_server_module, tiny_gguf):
    return start_server_module("--chat-template-file", str(THINK), "-np", "1", "-c", "1024", "-a", MODEL, model=tiny_gguf)


@pytest.fixture(scope="module")
def client(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base_url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(tiny_gguf) -> Tokenizer:
    return Tokenizer.from_gguf_file(tiny_gguf)


@pytest.fixture(scope="module")
def hermes(tok) -> ChatTemplate:
    return ChatTemplate(HERMES.read_text(), tok.bos_token, tok.eos_token)


def n_prompt(template, tok, messages, tools=None) -> int:
    """Tokens of the prompt the OpenAI face renders for ``messages``."""
    return len(render_chat(template, tok, messages, tools=tools)[1])


def create(client, **kw) -> anthropic.types.Message:
    kw.setdefault("model", MODEL)
    kw["extra_body"] = {**GREEDY, **kw.get("extra_body", {})}
    return client.messages.create(**kw)


def openai_text(srv, messages, max_tokens: int, **kw) -> str:
    r = httpx.post(srv.url("/v1/chat/completions"), headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": MODEL, "messages": messages, "max_tokens": max_tokens, **GREEDY, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def raw_events(srv, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """``(event name, data)`` of each SSE event of a streamed /v1/messages request."""
    out, name = [], None
    with httpx.stream("POST", srv.url("/v1/messages"), json={**body, "stream": True}, timeout=60,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01", **(headers or {})}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[6:])))
                name = None
    return out


def post(srv, body, key: str = KEY, path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(srv.url(path), json=body, headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
                      timeout=60)


# ------------------------------------------------------------------------ messages.create


def test_create_system_and_multi_turn_equal_the_openai_face(client, srv, tok, hermes):
    r = create(client, system="You are terse.", messages=MULTI, max_tokens=8)
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL
    assert r.id.startswith("msg_") and len(r.id) == 4 + 24
    (block,) = r.content
    assert block.type == "text"
    openai_msgs = [{"role": "system", "content": "You are terse."}, *MULTI]
    assert block.text == openai_text(srv, openai_msgs, 8)
    u = r.usage
    assert u.input_tokens == n_prompt(hermes, tok, openai_msgs) and u.cache_read_input_tokens == 0
    assert u.cache_creation_input_tokens == 0
    assert u.output_tokens == 8 and r.stop_reason == "max_tokens" and r.stop_sequence is None
    # system as text blocks renders the same prompt
    blocks = create(client, system=[{"type": "text", "text": "You are terse."}], messages=MULTI, max_tokens=8)
    assert blocks.content[0].text == block.text and blocks.usage.input_tokens == u.input_tokens


def test_user_content_blocks_and_prefill(client, srv):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Line one."}, {"type": "text", "text": "Two."}]}]
    r = create(client, messages=msgs, max_tokens=5)
    assert r.content[0].text == openai_text(srv, [{"role": "user", "content": "Line one.\nTwo."}], 5)
    # a final assistant turn is continued (Anthropic's prefill), as the OpenAI face continues it
    pre = [*msgs, {"role": "assistant", "content": "Sure:"}]
    r = create(client, messages=pre, max_tokens=5)
    assert r.content[0].text == openai_text(srv, [{"role": "user", "content": "Line one.\nTwo."},
                                                  {"role": "assistant", "content": "Sure:"}], 5)


def test_count_tokens_is_exact(client, tok, hermes):
    openai_msgs = [{"role": "system", "content": "You are terse."}, *MULTI]
    n = client.messages.count_tokens(model=MODEL, system="You are terse.", messages=MULTI)
    assert n.input_tokens == n_prompt(hermes, tok, openai_msgs)
    with_tools = client.messages.count_tokens(model=MODEL, messages=MULTI, tools=[READ_FILE])
    assert with_tools.input_tokens == n_prompt(hermes, tok, MULTI, tools=[READ_FILE_OPENAI])
    assert with_tools.input_tokens > n.input_tokens


def test_stop_sequences(client):
    free = create(client, messages=MULTI, max_tokens=16).content[0].text
    # a two-character ASCII piece of the free answer, not at its start
    i = next(k for k in range(1, len(free) - 1) if free[k:k + 2].isascii() and free[k:k + 2].isalnum())
    stop = free[i:i + 2]
    r = create(client, messages=MULTI, max_tokens=16, stop_sequences=["never-seen-in-noise", stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == free[:free.index(stop)]


def test_tool_use_and_tool_result_round_trip(client, srv, tok, hermes):
    ask = [{"role": "user", "content": "Show me pom.xml"}]
    r = create(client, messages=ask, max_tokens=120, tools=[READ_FILE],
               tool_choice={"type": "tool", "name": "read_file", "disable_parallel_tool_use": True})
    assert r.stop_reason == "tool_use" and r.stop_sequence is None
    (call,) = r.content
    assert call.type == "tool_use" and call.name == "read_file" and call.id.startswith("toolu_")
    assert set(call.input) == {"path"} and call.input["path"] in ("pom.xml", "src/Main.java")
    assert r.usage.input_tokens == n_prompt(hermes, tok, ask, tools=[READ_FILE_OPENAI])
    # any: a call is forced too
    r_any = create(client, messages=ask, max_tokens=120, tools=[READ_FILE],
                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert [b.type for b in r_any.content] == ["tool_use"] and r_any.stop_reason == "tool_use"

    turn = [*ask, r.to_param(),
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": [{"type": "text", "text": "<project/>"}]}]}]
    back = create(client, messages=turn, max_tokens=6, tools=[READ_FILE], tool_choice={"type": "none"})
    assert back.stop_reason == "max_tokens" and back.usage.output_tokens == 6
    assert [b.type for b in back.content] == ["text"]
    openai_turn = [*ask, {"role": "assistant", "content": "",
                          "tool_calls": [{"id": call.id, "type": "function",
                                          "function": {"name": "read_file", "arguments": json.dumps(call.input)}}]},
                   {"role": "tool", "tool_call_id": call.id, "content": "<project/>"}]
    expected = n_prompt(hermes, tok, openai_turn, tools=[READ_FILE_OPENAI])
    assert back.usage.input_tokens == expected
    assert client.messages.count_tokens(model=MODEL, messages=turn, tools=[READ_FILE]).input_tokens == expected
    assert back.content[0].text == openai_text(srv, openai_turn, 6, tools=[READ_FILE_OPENAI], tool_choice="none")


def test_streamed_tool_call_events(srv, client):
    body = {"model": MODEL, "max_tokens": 120, "messages": [{"role": "user", "content": "Show me pom.xml"}],
            "tools": [READ_FILE], "tool_choice": {"type": "tool", "name": "read_file",
                                                  "disable_parallel_tool_use": True}, **GREEDY}
    evs = raw_events(srv, body)
    assert [n for n, _ in evs] == ["message_start", "content_block_start", "ping", "content_block_delta",
                                   "content_block_stop", "message_delta", "message_stop"]
    assert all(n == d["type"] for n, d in evs)
    start, delta = evs[1][1], evs[3][1]
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["input"] == {}
    assert start["content_block"]["name"] == "read_file" and start["content_block"]["id"].startswith("toolu_")
    assert delta["delta"]["type"] == "input_json_delta"
    whole = client.messages.create(**{k: v for k, v in body.items() if k in ("model", "max_tokens", "messages",
                                                                               "tools", "tool_choice")},
                                   extra_body=GREEDY)
    assert json.loads(delta["delta"]["partial_json"]) == whole.content[0].input
    assert evs[5][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert evs[5][1]["usage"]["output_tokens"] == whole.usage.output_tokens


# ------------------------------------------------------------------------ streaming


def test_stream_exact_events_for_a_short_answer(srv, client):
    msgs = [{"role": "user", "content": "Answer yes."}]
    fmt = {"format": {"type": "json_schema", "schema": {"type": "string", "enum": ["yes"]}}}
    body = {"model": MODEL, "max_tokens": 20, "messages": msgs, "output_config": fmt, **GREEDY}
    evs = raw_events(srv, body)
    names = [n for n, _ in evs]
    n_delta = names.count("content_block_delta")
    assert names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * n_delta,
                     "content_block_stop", "message_delta", "message_stop"]
    assert [d["type"] for _, d in evs] == names
    start = evs[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["stop_sequence"] is None
    assert start["id"].startswith("msg_") and start["model"] == MODEL and start["role"] == "assistant"
    assert evs[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert evs[2][1] == {"type": "ping"}
    deltas = [d for n, d in evs if n == "content_block_delta"]
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in deltas)
    assert "".join(d["delta"]["text"] for d in deltas) == '"yes"'
    assert evs[-3][1] == {"type": "content_block_stop", "index": 0}
    end = evs[-2][1]
    assert end["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert end["usage"]["input_tokens"] == start["usage"]["input_tokens"] > 0
    assert end["usage"]["output_tokens"] == n_delta + 1  # one token per character piece, then the end token
    assert evs[-1][1] == {"type": "message_stop"}

    # the client's stream helper: the same text, the final message as messages.create answers
    with client.messages.stream(model=MODEL, max_tokens=20, messages=msgs, output_config=fmt,
                                extra_body=GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == '"yes"' and [b.text for b in final.content] == ['"yes"']
    whole = create(client, messages=msgs, max_tokens=20, output_config=fmt)
    assert whole.content[0].text == '"yes"' and whole.stop_reason == final.stop_reason == "end_turn"
    assert whole.usage.output_tokens == final.usage.output_tokens == n_delta + 1


def test_stream_text_equals_create(client):
    with client.messages.stream(model=MODEL, max_tokens=12, messages=MULTI, system="Be brief.",
                                extra_body=GREEDY) as s:
        kinds = [ev.type for ev in s]
        final = s.get_final_message()
    whole = create(client, messages=MULTI, system="Be brief.", max_tokens=12)
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens == 12
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == ["content_block_stop",
                                                                                   "message_delta", "message_stop"]


# ------------------------------------------------------------------------ prefix cache


def test_cache_read_input_tokens_on_a_resent_prefix(client, tok, hermes):
    system = "You review Java code. " + " ".join(f"Rule {k}: keep methods short and name things well." for k in
                                                  range(30))
    first = [{"role": "user", "content": "Review Main.java."}]
    a = client.messages.create(model=MODEL, system=system, messages=first, max_tokens=4, extra_body={"temperature": 0})
    total = client.messages.count_tokens(model=MODEL, system=system, messages=first).input_tokens
    assert total > 300 and a.usage.input_tokens + a.usage.cache_read_input_tokens == total
    b = client.messages.create(model=MODEL, system=system, messages=first, max_tokens=4, extra_body={"temperature": 0})
    # the whole prompt is in the slot; one token is always computed again
    assert (b.usage.cache_read_input_tokens, b.usage.input_tokens) == (total - 1, 1)
    assert b.usage.cache_creation_input_tokens == 0
    other = [{"role": "user", "content": "Review Util.java."}]
    c = client.messages.create(model=MODEL, system=system, messages=other, max_tokens=4, extra_body={"temperature": 0})
    p1 = render_chat(hermes, tok, [{"role": "system", "content": system}, *first])[1]
    p2 = render_chat(hermes, tok, [{"role": "system", "content": system}, *other])[1]
    common = next(k for k in range(min(len(p1), len(p2))) if p1[k] != p2[k])
    assert c.usage.cache_read_input_tokens == common and c.usage.input_tokens == len(p2) - common


# ------------------------------------------------------------------------ thinking


def test_thinking_budget_gives_a_thinking_block(think):
    c = anthropic.Anthropic(base_url=think.base_url, api_key="unused", max_retries=0, timeout=60)
    kw = {"model": MODEL, "max_tokens": 30, "messages": [{"role": "user", "content": "hi"}],
          "thinking": {"type": "enabled", "budget_tokens": 5}, "extra_body": GREEDY}
    r = c.messages.create(**kw)
    assert [b.type for b in r.content] == ["thinking", "text"] and r.content[0].signature == ""
    # the same split as the OpenAI face's reasoning_content with the same budget
    o = httpx.post(think.url("/v1/chat/completions"), timeout=60, json={
        "model": MODEL, "max_tokens": 30, "messages": [{"role": "user", "content": "hi"}],
        "thinking_token_budget": 5, "chat_template_kwargs": {"enable_thinking": True}, **GREEDY}).json()
    msg = o["choices"][0]["message"]
    assert (r.content[0].thinking, r.content[1].text) == (msg["reasoning_content"], msg["content"])
    assert r.usage.output_tokens == o["usage"]["completion_tokens"] == 30 and r.stop_reason == "max_tokens"
    with c.messages.stream(**kw) as s:
        kinds = [(ev.type, ev.delta.type if ev.type == "content_block_delta" else None) for ev in s]
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in r.content]
    n_think = kinds.count(("content_block_delta", "thinking_delta"))
    n_text = kinds.count(("content_block_delta", "text_delta"))
    assert kinds == [("message_start", None), ("content_block_start", None),
                     *[("content_block_delta", "thinking_delta"), ("thinking", None)] * n_think,
                     ("content_block_delta", "signature_delta"), ("signature", None),
                     ("content_block_stop", None), ("content_block_start", None),
                     *[("content_block_delta", "text_delta"), ("text", None)] * n_text,
                     ("content_block_stop", None), ("message_delta", None), ("message_stop", None)]
    assert n_think > 0 and n_text > 0
    # the budget is checked against max_tokens as Anthropic does
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(**{**kw, "thinking": {"type": "enabled", "budget_tokens": 30}})
    assert e.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "`max_tokens` must be greater than `thinking.budget_tokens`"}}


# ------------------------------------------------------------------------ errors


def test_wrong_key_is_an_authentication_error(srv):
    bad = anthropic.Anthropic(base_url=srv.base_url, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=4, messages=MULTI)
    assert e.value.status_code == 401
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error", "message": "Invalid API Key"}}
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.count_tokens(model=MODEL, messages=MULTI)
    # other routes keep their envelope
    r = httpx.post(srv.url("/v1/chat/completions"), json={"messages": MULTI}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json() == {"error": {"message": "Invalid API Key",
                                                           "type": "authentication_error", "code": 401}}


def test_missing_max_tokens_is_a_bad_request(client, srv):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", cast_to=anthropic.types.Message, body={"model": MODEL, "messages": MULTI})
    assert e.value.status_code == 400
    assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": "max_tokens: Field required"}}
    r = post(srv, {"model": MODEL, "messages": MULTI, "stream": True})  # a stream that never starts
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["message"] == "max_tokens: Field required"


@pytest.mark.parametrize(("body", "status", "etype", "message"), [
    (b"{not json", 400, "invalid_request_error", ("invalid JSON: parse error at line 1, column 2: "
                                                  "Expecting property name enclosed in double quotes")),
    ({"model": MODEL, "max_tokens": 0, "messages": MULTI}, 400, "invalid_request_error",
     "max_tokens: Input should be greater than or equal to 1"),
    ({"model": MODEL, "max_tokens": 4}, 400, "invalid_request_error", "messages: Field required"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400,
     "invalid_request_error", "messages.0.role: Input should be 'user' or 'assistant'"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "see"}, {"type": "document", "source": {"type": "text", "data": ""}}]}]}, 400,
     "invalid_request_error", ("messages.0.content.1: document blocks are not supported by this server "
                               "(text-only models)")),
    # an image on a text-only model: llama-server's 500 and words (tests/api/test_anthropic_requests.py)
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "see"}, {"type": "image", "source": {"type": "base64", "data": ""}}]}]}, 500,
     "api_error", ("image input is not supported - hint: if this is unexpected, you may need to provide the "
                   "mmproj")),
    ({"model": MODEL, "max_tokens": 4, "messages": MULTI, "tools": [{"type": "web_search_20250305",
                                                                     "name": "web_search"}]}, 400,
     "invalid_request_error", ("tools.0: tool type 'web_search_20250305' is not supported by this server "
                               "(only custom tools with an input_schema)")),
    ({"model": MODEL, "max_tokens": 4, "messages": MULTI, "tool_choice": {"type": "sometimes"}}, 400,
     "invalid_request_error", "tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'"),
    ({"model": MODEL, "max_tokens": 4, "messages": MULTI, "stop_sequences": "END"}, 400,
     "invalid_request_error", "stop_sequences: Input should be a valid list, got a string"),
])
def test_errors_in_anthropic_envelope(srv, body, status, etype, message):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(srv.url("/v1/messages"), headers={"x-api-key": KEY}, timeout=60, **kw)
    assert r.status_code == status
    assert r.json() == {"type": "error", "error": {"type": etype, "message": message}}


def test_unknown_routes_and_context_overflow(srv):
    r = httpx.get(srv.url("/v1/messages/batches"), headers={"x-api-key": KEY})
    assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    huge = [{"role": "user", "content": "word " * 3000}]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = post(srv, {"model": MODEL, "max_tokens": 4, "messages": huge}, path=path)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_stream_disconnect_frees_the_slot(srv):
    import time

    body = {"model": MODEL, "max_tokens": 1900, "messages": [{"role": "user", "content": "Go on."}],
            "stream": True, "temperature": 0}
    with httpx.stream("POST", srv.url("/v1/messages"), json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content_block_delta"' in line:
                break
    deadline = time.monotonic() + 10
    while True:
        (slot,) = httpx.get(srv.url("/slots"), headers={"x-api-key": KEY}, timeout=10).json()
        if not slot["is_processing"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not slot["is_processing"]
    # aborted, not run to max_tokens: the idle slot holds its prompt and the tokens generated (the
    # last one not yet in the KV); next_token says n_decoded 0 when idle, as llama-server does
    generated = slot["n_prompt_tokens"] - slot["n_prompt_tokens_processed"] - slot["n_prompt_tokens_cache"] + 1
    assert 0 < generated < 1900 and slot["next_token"][0]["n_decoded"] == 0


# ------------------------------------------------------------------------ max_tokens is a cap (review #16)

SMALL_CTX = 128


@pytest.fixture(scope="module")
def small(start_server_module, tiny_gguf):
    """A 128-token context: a generation runs into it quickly."""
    return start_server_module("--chat-template-file", str(HERMES), "-np", "1", "-c", str(SMALL_CTX), "-a", MODEL,
                               model=tiny_gguf)


def _small_post(small, body: dict, path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(small.url(path), json={"model": MODEL, **GREEDY, **body}, timeout=60)


def test_max_tokens_above_the_context_is_a_cap(small):
    """Claude-style agents send max_tokens 32000-64000 on every request: that was a 400
    (``request (N prompt tokens + 32000 requested tokens ...) exceeds the available context
    size``); now the generation stops when the context is full, with Anthropic's
    ``model_context_window_exceeded``, streamed or not. max_tokens exactly the room the prompt
    leaves ends with ``max_tokens`` (it said model_context_window_exceeded)."""
    msgs = [{"role": "user", "content": "Tell me a long story."}]
    n = _small_post(small, {"messages": msgs}, "/v1/messages/count_tokens").json()["input_tokens"]
    room = SMALL_CTX - n
    r = _small_post(small, {"max_tokens": 32000, "messages": msgs})
    assert r.status_code == 200, r.text
    m = r.json()
    assert (m["stop_reason"], m["usage"]["input_tokens"], m["usage"]["output_tokens"]) == \
        ("model_context_window_exceeded", n, room)
    evs = [ev for ev in _small_events(small, {"max_tokens": 64000, "messages": msgs}) if ev["type"] == "message_delta"]
    assert [(ev["delta"]["stop_reason"], ev["usage"]["output_tokens"]) for ev in evs] == \
        [("model_context_window_exceeded", room)]
    m = _small_post(small, {"max_tokens": room, "messages": msgs}).json()
    assert (m["stop_reason"], m["usage"]["output_tokens"]) == ("max_tokens", room)
    m = _small_post(small, {"max_tokens": room - 1, "messages": msgs}).json()
    assert (m["stop_reason"], m["usage"]["output_tokens"]) == ("max_tokens", room - 1)
    # the OpenAI face keeps llama-server's refusal of prompt + max_tokens over the context
    r = httpx.post(small.url("/v1/chat/completions"), json={"model": MODEL, "messages": msgs, "max_tokens": 32000},
                   timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        f"request ({n} prompt tokens + 32000 requested tokens = {n + 32000} tokens) exceeds the available context "
        f"size ({SMALL_CTX} tokens), try lowering n_predict/max_tokens or increasing the context")


def test_prompt_over_the_context_stays_a_400(small):
    msgs = [{"role": "user", "content": "word " * 200}]
    r = _small_post(small, {"max_tokens": 32000, "messages": msgs})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["message"].endswith(f"exceeds the available context size ({SMALL_CTX} tokens), try increasing it")


def _small_events(small, body: dict) -> list[dict]:
    out = []
    with httpx.stream("POST", small.url("/v1/messages"), json={"model": MODEL, **GREEDY, **body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
    return out
