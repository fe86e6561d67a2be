"""Preserved control tokens and ``skip_special_tokens`` over HTTP.

The tiny random model's vocabulary has Kimi K2's markers as control tokens (ids 301..305); a
logit bias makes it write ``<|tool_call_begin|>`` (302) three times. With ``--tool-call-parser
kimi_k2`` and tools the marker is rendered (the parser reads it; unconsumed, it stays in the
content, as llama-server); without tools nothing parses it and it stays hidden;
``skip_special_tokens: false`` renders it anywhere (vLLM).
"""

from __future__ import annotations

import json

import httpx
import pytest

KIMI = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
        "<|tool_call_end|>", "<|tool_calls_section_end|>")
MARK = "<|tool_call_begin|>"
TOOL = {"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}
FORCE = {"temperature": 0, "max_tokens": 3, "logit_bias": {"302": 100}}


@pytest.fixture(scope="module")
def srv(start_server_module, tmp_path_factory):
    import tinymodel

    path = tinymodel.write_tiny_gguf(tmp_path_factory.mktemp("preserve") / "m.gguf", extra_control_tokens=KIMI)
    return start_server_module("-np", "1", "-c", "512", "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2",
                               model=str(path))


def _chat(srv, **body) -> dict:
    r = httpx.post(srv.url("/v1/chat/completions"),
                   json={"messages": [{"role": "user", "content": "hi"}], **FORCE, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _completion(srv, **body) -> dict:
    r = httpx.post(srv.url("/v1/completions"), json={"prompt": "hi", **FORCE, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_parser_markers_rendered_with_tools(srv):
    choice = _chat(srv, tools=[TOOL])
    assert choice["message"]["content"] == MARK * 3
    assert choice["finish_reason"] == "length"
    content = ""
    with httpx.stream("POST", srv.url("/v1/chat/completions"), timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], **FORCE, "tools": [TOOL],
                            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    content += ch["delta"].get("content") or ""
    assert content == MARK * 3


def test_hidden_without_a_parser(srv):
    assert _chat(srv)["message"]["content"] == ""
    assert _completion(srv)["text"] == ""


def test_skip_special_tokens_false_renders_them(srv):
    assert _chat(srv, skip_special_tokens=False)["message"]["content"] == MARK * 3
    assert _completion(srv, skip_special_tokens=False)["text"] == MARK * 3
    assert _completion(srv, skip_special_tokens=True, spaces_between_special_tokens=False)["text"] == ""


def test_bad_field_is_400(srv):
    r = httpx.post(srv.url("/v1/completions"), json={"prompt": "hi", "skip_special_tokens": "no"}, timeout=60)
    assert r.status_code == 400
    assert "skip_special_tokens" in r.json()["error"]["message"]
