"""Tool calls and reasoning through /v1/chat/completions (issue #5), with SmolLM2 and the
template files in tests/templates (written for these tests, not copied).

Servers:
- ``hermes``: tests/templates/hermes_tools.jinja, llama-server rules (parser detected from the template);
- ``vllm``: the same template with ``--tool-call-parser hermes --reasoning-parser deepseek_r1``;
- ``think``: tests/templates/think.jinja, whose generation prompt ends with ``<think>\\n``;
- ``think_vllm``: the same with ``--reasoning-parser deepseek_r1``.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

TEMPLATES = Path(__file__).resolve().parents[1] / "templates"
HERMES = str(TEMPLATES / "hermes_tools.jinja")
THINK = str(TEMPLATES / "think.jinja")

READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file from the workspace",
    "parameters": {"type": "object",
                   "properties": {"path": {"type": "string", "enum": ["pom.xml", "src/Main.java"]}},
                   "required": ["path"]}}}
LIST_DIR = {"type": "function", "function": {"name": "list_dir", "description": "List the workspace root"}}

TWO_CALLS = ('<tool_call>\n{"name": "read_file", "arguments": {"path": "pom.xml"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "list_dir", "arguments": {}}\n</tool_call>')


def _gbnf_literal(text: str) -> str:
    return "root ::= " + json.dumps(text)


@pytest.fixture(scope="module")
def hermes(start_server_module):
    return start_server_module("--chat-template-file", HERMES, "-np", "2", "-c", "4096")


@pytest.fixture(scope="module")
def vllm(start_server_module):
    return start_server_module("--chat-template-file", HERMES, "-np", "2", "-c", "4096",
                               "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1")


@pytest.fixture(scope="module")
def think_vllm(start_server_module):
    return start_server_module("--chat-template-file", THINK, "-np", "2", "-c", "4096",
                               "--reasoning-parser", "deepseek_r1")


@pytest.fixture(scope="module")
def think(start_server_module):
    return start_server_module("--chat-template-file", THINK, "-np", "2", "-c", "4096")


def _post(srv, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(srv.url(path), json=body, timeout=120)


def _stream(srv, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", srv.url("/v1/chat/completions"), json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def _rebuild(chunks: list[dict]) -> dict:
    """Join streamed deltas the way a client does: content, reasoning fields, tool calls by index."""
    msg: dict = {"content": "", "tool_calls": {}}
    finish = None
    for c in chunks:
        for ch in c["choices"]:
            d = ch["delta"]
            finish = ch["finish_reason"] or finish
            for k in ("content", "reasoning_content", "reasoning"):
                if d.get(k):
                    msg[k] = msg.get(k, "") + d[k] if k != "content" else msg["content"] + d[k]
            for tc in d.get("tool_calls") or []:
                slot = msg["tool_calls"].setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
                if "id" in tc:
                    assert slot["id"] is None, "id sent twice for one call"
                    slot["id"], slot["name"] = tc["id"], tc["function"]["name"]
                    assert tc["type"] == "function"
                slot["arguments"] += tc["function"].get("arguments") or ""
    msg["finish_reason"] = finish
    return msg


SEED13 = {
    "model": "tiny-coder",
    "messages": [{"role": "user", "content": "Show me pom.xml"}, {"role": "assistant", "content": "<tool_call>\n"}],
    "tools": [READ_FILE], "tool_choice": "required", "parallel_tool_calls": False,
    "temperature": 0, "max_tokens": 200,
}


# ------------------------------------------------------------------------ tool calls


def test_props_report_tool_caps(hermes):
    caps = httpx.get(hermes.url("/props")).json()["chat_template_caps"]
    assert caps["supports_tools"] is True
    assert caps["supports_tool_calls"] is True
    assert caps["supports_parallel_tool_calls"] is True
    assert caps["supports_system_role"] is True


def test_seed13_required_call_non_streaming(hermes):
    r = _post(hermes, SEED13)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls"
    msg = ch["message"]
    assert msg["content"] == ""
    assert len(msg["tool_calls"]) == 1
    call = msg["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "read_file"
    assert isinstance(call["id"], str) and len(call["id"]) >= 8
    args = json.loads(call["function"]["arguments"])
    assert set(args) == {"path"} and args["path"] in ("pom.xml", "src/Main.java")


def test_seed13_required_call_streaming_matches(hermes):
    whole = _post(hermes, SEED13).json()["choices"][0]["message"]["tool_calls"][0]
    msg = _rebuild(_stream(hermes, SEED13))
    assert msg["finish_reason"] == "tool_calls"
    assert msg["content"] == ""
    assert list(msg["tool_calls"]) == [0]
    call = msg["tool_calls"][0]
    assert call["name"] == "read_file"
    assert json.loads(call["arguments"]) == json.loads(whole["function"]["arguments"])


def test_required_without_prefill_forces_a_call(hermes):
    body = {**SEED13, "messages": SEED13["messages"][:1], "tools": [READ_FILE, LIST_DIR]}
    msg = _post(hermes, body).json()["choices"][0]["message"]
    assert msg["tool_calls"], msg
    for call in msg["tool_calls"][:1]:
        assert call["function"]["name"] in ("read_file", "list_dir")
        json.loads(call["function"]["arguments"])


def test_named_function_is_the_one_called(hermes):
    body = {**SEED13, "messages": SEED13["messages"][:1], "tools": [READ_FILE, LIST_DIR],
            "tool_choice": {"type": "function", "function": {"name": "list_dir"}}}
    r = _post(hermes, body)
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["list_dir"]
    assert calls[0]["function"]["arguments"] == "{}"


AUTO_TWO = {"messages": [{"role": "user", "content": "Read pom.xml and list the root."}],
            "tools": [READ_FILE, LIST_DIR], "temperature": 0, "max_tokens": 120,
            "grammar": _gbnf_literal(TWO_CALLS)}


def test_two_parallel_calls_non_streaming(hermes):
    r = _post(hermes, AUTO_TWO)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls"
    calls = ch["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["read_file", "list_dir"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"path": "pom.xml"}
    assert calls[1]["function"]["arguments"] == "{}"
    assert calls[0]["id"] != calls[1]["id"]
    assert ch["message"]["content"] == ""


def test_two_parallel_calls_stream_as_index_0_and_1(hermes):
    chunks = _stream(hermes, AUTO_TWO)
    firsts = [tc for c in chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls") or [] if "id" in tc]
    assert [tc["index"] for tc in firsts] == [0, 1]
    msg = _rebuild(chunks)
    assert msg["finish_reason"] == "tool_calls"
    assert msg["tool_calls"][0]["name"] == "read_file"
    assert json.loads(msg["tool_calls"][0]["arguments"]) == {"path": "pom.xml"}
    assert msg["tool_calls"][1]["name"] == "list_dir"
    assert msg["tool_calls"][1]["arguments"] == "{}"


def test_parallel_false_keeps_the_first_call(hermes):
    r = _post(hermes, {**AUTO_TWO, "parallel_tool_calls": False})
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["read_file"]


def test_text_before_the_call_stays_content(hermes):
    text = 'Let me look.\n' + TWO_CALLS.split("\n<tool_call>")[0]
    r = _post(hermes, {**AUTO_TWO, "grammar": _gbnf_literal(text)})
    msg = r.json()["choices"][0]["message"]
    assert msg["content"].rstrip() == "Let me look."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["read_file"]


def test_malformed_call_is_plain_content(hermes):
    bad = '<tool_call>\n{"name": "read_file", "arguments": {"path": }\n</tool_call>'
    r = _post(hermes, {**AUTO_TWO, "grammar": _gbnf_literal(bad)})
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "stop"
    assert ch["message"]["content"] == bad
    assert "tool_calls" not in ch["message"] or not ch["message"]["tool_calls"]


def test_tool_choice_none_does_not_parse(hermes):
    r = _post(hermes, {**AUTO_TWO, "tool_choice": "none"})
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "stop"
    assert ch["message"]["content"] == TWO_CALLS


def test_tool_round_trip_renders_through_the_template(hermes):
    msgs = [{"role": "user", "content": "Show me pom.xml"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "read_file", "arguments": "{\"path\": \"pom.xml\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "<project>...</project>"}]
    prompt = _post(hermes, {"messages": msgs, "tools": [READ_FILE]}, "/apply-template").json()["prompt"]
    assert prompt.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "read_file", "arguments": '
                           '{"path": "pom.xml"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n'
                           '<project>...</project>\n</tool_response><|im_end|>\n<|im_start|>assistant\n')
    r = _post(hermes, {"messages": msgs, "tools": [READ_FILE], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text


def test_openai_client_parses_the_calls(hermes):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=hermes.url("/v1"), api_key="none")
    resp = client.chat.completions.create(model="x", messages=AUTO_TWO["messages"], tools=AUTO_TWO["tools"],
                                          temperature=0, max_tokens=120,
                                          extra_body={"grammar": AUTO_TWO["grammar"]})
    ch = resp.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert [c.function.name for c in ch.message.tool_calls] == ["read_file", "list_dir"]
    assert json.loads(ch.message.tool_calls[0].function.arguments) == {"path": "pom.xml"}
    stream = client.chat.completions.create(model="x", messages=AUTO_TWO["messages"], tools=AUTO_TWO["tools"],
                                            temperature=0, max_tokens=120, stream=True,
                                            extra_body={"grammar": AUTO_TWO["grammar"]})
    names, args = {}, {}
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            if tc.function and tc.function.name:
                names[tc.index] = tc.function.name
            args[tc.index] = args.get(tc.index, "") + ((tc.function.arguments or "") if tc.function else "")
    assert names == {0: "read_file", 1: "list_dir"}
    assert json.loads(args[0]) == {"path": "pom.xml"} and args[1] == "{}"


@pytest.mark.parametrize("body,msg", [
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in 'tools'"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": "read_file"}, "tools"),
])
def test_bad_tool_fields_are_400(hermes, body, msg):
    r = _post(hermes, {**AUTO_TWO, **body})
    assert r.status_code == 400, r.text
    assert msg in r.json()["error"]["message"]


# ------------------------------------------------------------------------ vLLM rules


def test_vllm_auto_needs_enable_auto_tool_choice(vllm):
    r = _post(vllm, {**AUTO_TWO, "tool_choice": "auto"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
    assert _post(vllm, {**AUTO_TWO, "tool_choice": "none"}).status_code == 200


def test_vllm_required_uses_the_parser(vllm):
    r = _post(vllm, SEED13)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"


def test_enable_auto_tool_choice_without_parser_exits(start_server):
    srv = start_server("--enable-auto-tool-choice", wait=False)
    assert srv.proc.wait(timeout=60) == 2
    assert "--enable-auto-tool-choice requires --tool-call-parser" in srv.log()


# ------------------------------------------------------------------------ reasoning (vLLM parser)

CASES = [  # 002 Example 12: both tags, none, end tag only
    ("<think>The loop runs n+1 times.</think>Change it.", "The loop runs n+1 times.", "Change it."),
    ("The loop condition is fine.", None, "The loop condition is fine."),
    ("The template opened it.</think>Use a StringBuilder.", "The template opened it.", "Use a StringBuilder."),
]


@pytest.mark.parametrize("text,reasoning,content", CASES)
def test_vllm_reasoning_split(vllm, text, reasoning, content):
    body = {"messages": [{"role": "user", "content": "Check the loop."}], "temperature": 0, "max_tokens": 60,
            "grammar": _gbnf_literal(text)}
    r = _post(vllm, body)
    assert r.status_code == 200, r.text
    data = r.json()
    msg = data["choices"][0]["message"]
    assert msg.get("reasoning") == reasoning
    assert msg["content"] == content
    assert "reasoning_content" not in msg
    details = data["usage"]["completion_tokens_details"]
    assert (details["reasoning_tokens"] > 0) == (reasoning is not None)
    streamed = _rebuild(_stream(vllm, body))
    assert streamed.get("reasoning") == reasoning
    assert streamed["content"] == content


def test_vllm_include_reasoning_false(vllm):
    body = {"messages": [{"role": "user", "content": "x"}], "temperature": 0, "max_tokens": 60,
            "grammar": _gbnf_literal(CASES[0][0]), "include_reasoning": False}
    msg = _post(vllm, body).json()["choices"][0]["message"]
    assert "reasoning" not in msg and msg["content"] == "Change it."


# ------------------------------------------------------------------------ reasoning (template opens <think>)

Q = {"messages": [{"role": "user", "content": "Is 7 prime?"}], "temperature": 0}


def test_think_template_prompt(think):
    prompt = _post(think, Q, "/apply-template").json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")


def test_unfinished_thinking_is_all_reasoning(think):
    body = {**Q, "max_tokens": 12}
    ch = _post(think, body).json()["choices"][0]
    raw = _post(think, {**body, "reasoning_format": "none"}).json()["choices"][0]["message"]["content"]
    assert raw.startswith("<think>\n") and "</think>" not in raw, raw
    assert ch["message"]["content"] == ""
    assert ch["message"]["reasoning_content"] == raw[len("<think>"):]  # the prompt's "\n" included (seed 000 Ex. 14)
    streamed = _rebuild(_stream(think, body))
    assert streamed["reasoning_content"] == ch["message"]["reasoning_content"]
    assert streamed["content"] == ""


def test_budget_forces_end_of_thinking_then_the_schema_applies(think):
    body = {**Q, "max_tokens": 40, "thinking_token_budget": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
                "type": "object", "properties": {"prime": {"type": "boolean"}}, "required": ["prime"],
                "additionalProperties": False}}}}
    r = _post(think, body)
    assert r.status_code == 200, r.text
    data = r.json()
    msg = data["choices"][0]["message"]
    assert data["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(msg["content"])["prime"], bool)
    assert msg["reasoning_content"]
    assert data["usage"]["completion_tokens_details"]["reasoning_tokens"] >= 3
    streamed = _rebuild(_stream(think, body))
    assert streamed["content"] == msg["content"]
    assert streamed["reasoning_content"] == msg["reasoning_content"]


def test_enable_thinking_false_reaches_the_template(think):
    body = {**Q, "max_tokens": 8, "chat_template_kwargs": {"enable_thinking": False},
            "structured_outputs": {"choice": ["yes", "no"]}}
    prompt = _post(think, body, "/apply-template").json()["prompt"]
    assert prompt.endswith("<think>\n\n</think>\n\n")
    msg = _post(think, body).json()["choices"][0]["message"]
    assert msg["content"] in ("yes", "no")
    assert "reasoning_content" not in msg


def _three_cases(srv):
    """002 Example 12's three outputs under a template that opens <think>: the model's own text is
    forced by grammars (after the forced end of thinking, or with thinking turned off)."""
    no_think = {"chat_template_kwargs": {"enable_thinking": False}}
    both = {**Q, **no_think, "max_tokens": 40, "grammar": _gbnf_literal(CASES[0][0])}
    none = {**Q, **no_think, "max_tokens": 40, "grammar": _gbnf_literal(CASES[1][0])}
    end_only = {**Q, "max_tokens": 40, "thinking_token_budget": 2,
                "structured_outputs": {"choice": ["Change it."]}}
    return both, none, end_only


def test_three_reasoning_cases_with_a_template_that_opens_think(think_vllm):
    both, none, end_only = _three_cases(think_vllm)
    for body, reasoning, content in ((both, CASES[0][1], CASES[0][2]), (none, None, CASES[1][2]),
                                     (end_only, "<2 tokens>", "Change it.")):
        r = _post(think_vllm, body)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert msg["content"] == content
        if reasoning == "<2 tokens>":  # the model's two thinking tokens, then the forced end tag
            assert msg["reasoning"] and "</think>" not in msg["reasoning"]
            assert r.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] >= 2
        else:
            assert msg.get("reasoning") == reasoning
        streamed = _rebuild(_stream(think_vllm, body))
        assert streamed["content"] == msg["content"]
        assert streamed.get("reasoning") == msg.get("reasoning")


def test_cut_off_last_call_is_dropped_streamed_or_not(hermes):
    cut = TWO_CALLS.split("\n<tool_call>")[0] + '\n<tool_call>\n{"name": "list_dir", "arguments": {'
    body = {**AUTO_TWO, "grammar": _gbnf_literal(cut)}
    msg = _post(hermes, body).json()["choices"][0]["message"]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["read_file"]
    streamed = _rebuild(_stream(hermes, body))
    assert list(streamed["tool_calls"]) == [0]
    assert json.loads(streamed["tool_calls"][0]["arguments"]) == {"path": "pom.xml"}
    assert streamed["content"] == msg["content"] == ""


def test_prefilled_partial_call_streams_with_its_header(hermes):
    prefill = '<tool_call>\n{"name": "read_file", "arguments": {"path": "pom'
    body = {"messages": [{"role": "user", "content": "Show me pom.xml"}, {"role": "assistant", "content": prefill}],
            "tools": [READ_FILE], "temperature": 0, "max_tokens": 30,
            "grammar": _gbnf_literal(prefill + '.xml"}}\n</tool_call>')}  # covers the continued text too
    msg = _post(hermes, body).json()["choices"][0]["message"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"path": "pom.xml"}
    streamed = _rebuild(_stream(hermes, body))
    assert streamed["tool_calls"][0]["name"] == "read_file"
    assert streamed["tool_calls"][0]["id"]
    assert json.loads(streamed["tool_calls"][0]["arguments"]) == {"path": "pom.xml"}
