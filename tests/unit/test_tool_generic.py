"""The generic tool-call format (llama-server's for templates without a tool format of their own):
schema, system text, parsing whole and streamed, output cut by max_tokens."""

from __future__ import annotations

import itertools
import json

import pytest

from kvserve.chat.tool_generic import GenericToolParser, generic_schema, generic_system_text
from kvserve.chat.tool_parsers import TOOL_PARSERS, get_tool_parser
from kvserve.faces.chat_features import with_system_text

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _parser() -> GenericToolParser:
    ids = itertools.count()
    return GenericToolParser(make_id=lambda: f"call_{next(ids)}")


def test_schema_required_one_call_and_named():
    one = generic_schema([WEATHER, TIME], "required", parallel=False)
    assert one["required"] == ["tool_call"]
    assert [s["properties"]["name"]["const"] for s in one["properties"]["tool_call"]["anyOf"]] == [
        "get_weather", "get_time"]
    named = generic_schema([WEATHER, TIME], {"name": "get_time"}, parallel=False)
    assert named["properties"]["tool_call"] == {
        "type": "object", "properties": {"name": {"const": "get_time"},
                                         "arguments": {"type": "object", "properties": {}}},
        "required": ["name", "arguments"]}


def test_schema_auto_parallel_with_response_schema():
    s = generic_schema([WEATHER], "auto", parallel=True, response_schema={"type": "integer"})
    calls, resp = s["anyOf"]
    assert calls["properties"]["tool_calls"]["minItems"] == 1
    assert calls["properties"]["tool_calls"]["items"]["properties"]["name"] == {"const": "get_weather"}
    assert resp == {"type": "object", "properties": {"response": {"type": "integer"}}, "required": ["response"]}


def test_system_text_lists_tools_unless_rendered():
    text = generic_system_text([WEATHER], "auto", parallel=False)
    assert text.startswith("You can call any of the following tools to satisfy the user's requests: [")
    assert '"name": "get_weather"' in text
    assert text.endswith("either with `tool_call` (a request to call tools) or with `response` reply to the "
                         "user's request")
    assert generic_system_text(None, "required", parallel=True) == (
        "Respond in JSON format with `tool_calls` (a list of requests to call tools)")


def test_with_system_text_appends_or_prepends():
    msgs = [{"role": "user", "content": "hi"}]
    assert with_system_text(msgs, "T") == [{"role": "system", "content": "T"}, {"role": "user", "content": "hi"}]
    sys_msgs = [{"role": "system", "content": "Be brief."}, *msgs]
    assert with_system_text(sys_msgs, "T")[0] == {"role": "system", "content": "Be brief.\nT"}
    assert sys_msgs[0]["content"] == "Be brief."  # input not changed


def test_extract_calls_and_response():
    p = _parser()
    r = p.extract('{"tool_call": {"name": "get_weather", "arguments": {"city":"Paris"}}}')
    assert r.content is None
    assert [(c.name, c.arguments, c.id) for c in r.calls] == [("get_weather", '{"city": "Paris"}', "call_0")]
    r = p.extract('{"tool_calls": [{"name": "get_time", "arguments": {}}, {"name": "get_weather", '
                  '"arguments": {"city": "Oslo"}}]}')
    assert [(c.name, c.arguments) for c in r.calls] == [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')]
    r = p.extract('{"response": "Hello \\"you\\" \\u00e9"}')
    assert (r.content, r.calls) == ('Hello "you" \u00e9', [])
    assert p.extract('{"response": {"a": 1}}').content == '{"a": 1}'


@pytest.mark.parametrize(("text", "content"), [
    ('{"tool_call": {"name": "get_weather", "argu', None),  # a cut call is dropped, no markup
    ('{"tool_calls": [{"name": "get_time", "arguments": {}}, {"na', None),
    ('{"response": "Hello wor', "Hello wor"),
    ('{"response": "a\\u00', "a"),  # a cut escape is left out
    ('{"resp', None),
])
def test_extract_cut_by_max_tokens(text, content):
    r = _parser().extract(text)
    assert (r.content, r.calls) == (content, [])


def test_stream_response_pieces_then_calls_whole():
    s = _parser().stream()
    text = '{"response": "Hi \\"there\\""}'
    out = [d for i in range(0, len(text), 3) for d in s.feed(text[i:i + 3])] + s.finish()
    assert "".join(d["content"] for d in out) == 'Hi "there"'
    assert len(out) > 2  # streamed as it came, not at the end
    s = _parser().stream()
    text = '{"tool_call": {"name": "get_time", "arguments": {}}}'
    assert [d for ch in text for d in s.feed(ch)] == []
    assert s.finish() == [{"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                                           "function": {"name": "get_time", "arguments": "{}"}}]}]
    assert s.saw_calls


def test_generic_is_not_a_tool_call_parser_flag():
    assert "generic" not in TOOL_PARSERS
    assert isinstance(get_tool_parser("generic"), GenericToolParser)
    assert json.loads(json.dumps(generic_schema([WEATHER], "auto", False)))  # plain JSON


@pytest.mark.parametrize(("text", "content"), [
    ('{"response": "x\\ud83d', "x"), ('{"response": "x\\ud83d\\ude0', "x"),
    ('{"response": "x\\ud83d\\ude00', "x\U0001F600"), ('{"response": "x\\uZZZZ', "x"),
])
def test_partial_escapes(text, content):
    assert _parser().extract(text).content == content
