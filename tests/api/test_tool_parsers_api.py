"""vLLM's tool-call and reasoning parsers of other model families through /v1/chat/completions: SmolLM2 is
made to write each format's text with a literal grammar (llama-server's ``grammar`` field), and the answer
(whole and streamed) must carry the parsed calls and reasoning.

Servers (tests/templates/hermes_tools.jinja renders the tools):
- ``qwen3``: ``--enable-auto-tool-choice --tool-call-parser qwen3_coder``;
- ``gptoss``: ``--enable-auto-tool-choice --tool-call-parser openai --reasoning-parser openai_gptoss``.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

TEMPLATES = Path(__file__).resolve().parents[1] / "templates"
HERMES = str(TEMPLATES / "hermes_tools.jinja")

READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file from the workspace",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "enum": ["pom.xml", "src/Main.java"]}, "limit": {"type": "integer"}},
        "required": ["path"]}}}
LIST_DIR = {"type": "function", "function": {"name": "list_dir", "description": "List a directory",
                                             "parameters": {"type": "object",
                                                            "properties": {"path": {"type": "string"}}}}}


def _gbnf_literal(text: str) -> str:
    return "root ::= " + json.dumps(text)


@pytest.fixture(scope="module")
def qwen3(start_server_module):
    return start_server_module("--chat-template-file", HERMES, "-np", "2", "-c", "4096",
                               "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder")


@pytest.fixture(scope="module")
def gptoss(start_server_module):
    return start_server_module("--chat-template-file", HERMES, "-np", "2", "-c", "4096", "--enable-auto-tool-choice",
                               "--tool-call-parser", "openai", "--reasoning-parser", "openai_gptoss")


def _post(srv, body: dict) -> dict:
    r = httpx.post(srv.url("/v1/chat/completions"), json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(srv, body: dict) -> dict:
    """The streamed answer joined as a client joins it."""
    msg: dict = {"content": "", "reasoning": "", "tool_calls": {}, "finish_reason": None}
    with httpx.stream("POST", srv.url("/v1/chat/completions"), json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:])["choices"]:
                d = ch["delta"]
                msg["finish_reason"] = ch["finish_reason"] or msg["finish_reason"]
                msg["content"] += d.get("content") or ""
                msg["reasoning"] += d.get("reasoning") or ""
                for tc in d.get("tool_calls") or []:
                    slot = msg["tool_calls"].setdefault(tc["index"], {"name": None, "arguments": ""})
                    if "id" in tc:
                        slot["name"] = tc["function"]["name"]
                    slot["arguments"] += tc["function"].get("arguments") or ""
    return msg


def _calls(msg: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]


QWEN3_TEXT = ("Reading it.\n<tool_call>\n<function=read_file>\n<parameter=path>\npom.xml\n</parameter>\n"
              "<parameter=limit>\n40\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=list_dir>\n"
              "<parameter=path>\nsrc\n</parameter>\n</function>\n</tool_call>")


def test_qwen3_coder_calls_with_schema_types(qwen3):
    body = {"messages": [{"role": "user", "content": "Show me pom.xml"}], "tools": [READ_FILE, LIST_DIR],
            "temperature": 0, "max_tokens": 200, "grammar": _gbnf_literal(QWEN3_TEXT)}
    data = _post(qwen3, body)
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Reading it."
    want = [("read_file", '{"path": "pom.xml", "limit": 40}'), ("list_dir", '{"path": "src"}')]
    assert _calls(choice["message"]) == want
    assert all(c["type"] == "function" and c["id"] for c in choice["message"]["tool_calls"])
    streamed = _stream(qwen3, body)
    assert streamed["content"] == "Reading it."
    assert [(s["name"], s["arguments"]) for _, s in sorted(streamed["tool_calls"].items())] == want
    assert streamed["finish_reason"] == "tool_calls"


def test_qwen3_coder_required_is_forced_by_its_grammar(qwen3):
    body = {"messages": [{"role": "user", "content": "Show me pom.xml"}], "tools": [READ_FILE],
            "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0, "max_tokens": 120}
    choice = _post(qwen3, body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    ((name, args),) = _calls(choice["message"])
    assert name == "read_file"
    assert json.loads(args)["path"] in ("pom.xml", "src/Main.java")


def test_qwen3_coder_malformed_call_is_content(qwen3):
    text = "Try:\n<tool_call>\nnot a function\n</tool_call>"
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [READ_FILE], "temperature": 0,
            "max_tokens": 60, "grammar": _gbnf_literal(text)}
    choice = _post(qwen3, body)["choices"][0]
    assert (choice["message"]["content"], choice["message"].get("tool_calls"), choice["finish_reason"]) == \
        (text, None, "stop")
    streamed = _stream(qwen3, body)
    assert (streamed["content"], streamed["tool_calls"]) == (text, {})


HARMONY_CALL = ("<|channel|>analysis<|message|>I need the file.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.read_file <|constrain|>json<|message|>{"path":"pom.xml"}<|call|>')
HARMONY_FINAL = ("<|channel|>analysis<|message|>Easy sum.<|end|><|start|>assistant<|channel|>final<|message|>"
                 "It is 4.<|return|>")


def test_gpt_oss_call_and_reasoning(gptoss):
    body = {"messages": [{"role": "user", "content": "Show me pom.xml"}], "tools": [READ_FILE],
            "temperature": 0, "max_tokens": 200, "grammar": _gbnf_literal(HARMONY_CALL)}
    choice = _post(gptoss, body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning"] == "I need the file."
    assert not choice["message"]["content"]
    assert _calls(choice["message"]) == [("read_file", '{"path": "pom.xml"}')]
    streamed = _stream(gptoss, body)
    assert (streamed["reasoning"], streamed["content"]) == ("I need the file.", "")
    assert [(s["name"], s["arguments"]) for s in streamed["tool_calls"].values()] == [
        ("read_file", '{"path": "pom.xml"}')]


def test_gpt_oss_final_answer(gptoss):
    body = {"messages": [{"role": "user", "content": "2+2?"}], "tools": [READ_FILE], "temperature": 0,
            "max_tokens": 200, "grammar": _gbnf_literal(HARMONY_FINAL)}
    choice = _post(gptoss, body)["choices"][0]
    assert (choice["message"]["reasoning"], choice["message"]["content"], choice["finish_reason"]) == \
        ("Easy sum.", "It is 4.", "stop")
    assert not choice["message"].get("tool_calls")
    streamed = _stream(gptoss, body)
    assert (streamed["reasoning"], streamed["content"], streamed["tool_calls"]) == ("Easy sum.", "It is 4.", {})
