"""Parser and template hardening (review findings): deeply nested JSON in model output takes the
parser's malformed path, streamed and whole results agree, streams stay linear."""

from __future__ import annotations

import itertools
import json
import logging

import pytest

from kvserve.chat.tool_parsers import get_tool_parser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "arr": {"type": "array"}}}}}]

DEEP = "[" * 5000 + "]" * 5000


def _ids():
    c = itertools.count()
    return lambda: f"call_{next(c)}"


def _extract(name: str, text: str):
    r = get_tool_parser(name, _ids(), TOOLS).extract(text)
    return r.content, [(c.name, c.arguments) for c in r.calls]


def _stream(name: str, text: str, chunk: int = 50):
    s = get_tool_parser(name, _ids(), TOOLS).stream()
    frags = [f for i in range(0, len(text), chunk) for f in s.feed(text[i:i + chunk])] + s.finish()
    content = "".join(f.get("content", "") for f in frags)
    calls: list[list[str]] = []
    for f in frags:
        for tc in f.get("tool_calls", []):
            if "id" in tc:
                calls.append([tc["function"]["name"], tc["function"]["arguments"]])
            else:
                calls[tc["index"]][1] += tc["function"]["arguments"]
    return content or None, [tuple(c) for c in calls]


@pytest.mark.parametrize("name,text", [
    ("hermes", '<tool_call>{"name":"get_weather","arguments":{"x":' + DEEP + '}}</tool_call>'),
    ("llama3_json", '{"name":"get_weather","parameters":{"x":' + DEEP + '}}'),
    ("granite", '<|tool_call|>[{"name":"get_weather","arguments":{"x":' + DEEP + '}}]'),
    ("hermes", '<tool_call>{"name":"get_weather","arguments":{"x":' + "1" * 5000 + '}}</tool_call>'),
])
def test_deeply_nested_json_call_is_content(name, text, caplog):
    # RecursionError (json.loads 5,000 levels deep: over any recursion limit in use; torch's
    # inductor raises it to 2,000, so a case of a few hundred levels would depend on the tests run
    # before) and a >4300-digit integer: vLLM's try/except around its json.loads makes it content
    with caplog.at_level(logging.WARNING):
        assert _extract(name, text) == (text, [])
    assert "Error in extracting tool call from response." in caplog.text


@pytest.mark.parametrize("name,text", [
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=arr>\n" + DEEP
     + "\n</parameter>\n</function>\n</tool_call>"),
    ("minimax_m2", '<minimax:tool_call><invoke name="get_weather"><parameter name="arr">' + DEEP
     + "</parameter></invoke></minimax:tool_call>"),
])
def test_deeply_nested_typed_parameter_stays_text(name, text):
    # vLLM: a value json.loads / literal_eval cannot take stays the parameter's text
    want = (None, [("get_weather", '{"arr": "' + DEEP + '"}')])
    assert _extract(name, text) == want
    assert _stream(name, text) == want


def test_deeply_nested_harmony_call_passes_as_text():
    # vLLM's openai parser: arguments that are not JSON are sent as the text ("Error decoding JSON")
    text = "<|channel|>commentary to=functions.get_weather<|message|>" + DEEP + "<|call|>"
    assert _extract("openai", text) == (None, [("get_weather", DEEP)])
    assert _stream("openai", text) == (None, [("get_weather", DEEP)])


@pytest.mark.parametrize("name", ["qwen3_coder", "qwen3_xml", "mimo"])
def test_literal_close_markers_in_a_value_stream_in_linear_time(name):
    # each 4-character delta used to rescan (and copy) the buffer after every literal </tool_call>:
    # 16 KB took 2.4 s, 64 KB minutes; now 64 KB is well under a second
    import time

    val = "lorem ipsum </tool_call> dolor " * (64_000 // 31)
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n" + val
            + "\n</parameter>\n</function>\n</tool_call>")
    t0 = time.monotonic()
    got = _stream(name, text, 4)
    assert time.monotonic() - t0 < 3
    assert got == _extract(name, text)
    assert got[1] == [("get_weather", json.dumps({"city": val}, ensure_ascii=False))] and got[0] is None


_FILLER = "abc def " * 50_000  # 400 KB


@pytest.mark.parametrize("name,text", [
    ("seed_oss", "<seed:tool_call>\n<function=get_weather>\n<parameter=city>\n" + _FILLER
     + "\n</parameter>\n</function>\n</seed:tool_call>"),
    ("minimax_m2", '<minimax:tool_call><invoke name="get_weather"><parameter name="city">' + _FILLER
     + "</parameter></invoke></minimax:tool_call>"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
     '{"city":"' + _FILLER + '"}<|tool_call_end|><|tool_calls_section_end|>'),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
     '{"city":"' + _FILLER + '"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
])
def test_block_parsers_stream_400kb_in_linear_time(name, text):
    # each delta used to search the whole call from its start (and copy the buffer): 400 KB ~30 s
    import time

    t0 = time.monotonic()
    got = _stream(name, text, 4)
    assert time.monotonic() - t0 < 3
    city = _FILLER.strip() if name == "minimax_m2" else _FILLER  # minimax_m2 strips values (vLLM)
    assert got == (None, [("get_weather", json.dumps({"city": city}))])


@pytest.mark.parametrize("style", ["deepseek_v3", "kimi_k2", "deepseek_r1"])
def test_held_reasoning_streams_400kb_in_linear_time(style):
    # deepseek_r1's split holds the text until </think>; each delta searched it all again
    import time

    from kvserve.chat.reasoning import ReasoningStreamer

    text = "<think>" + _FILLER + "</think>" + "xyz " * 1000
    s = ReasoningStreamer(style=style)
    t0 = time.monotonic()
    frags = [f for i in range(0, len(text), 4) for f in s.feed(text[i:i + 4])] + s.finish()
    assert time.monotonic() - t0 < 3
    assert "".join(f.get("reasoning", "") for f in frags) == _FILLER.strip()
    assert "".join(f.get("content", "") for f in frags) == ("xyz " * 1000).rstrip()


@pytest.mark.parametrize("name,deltas", [
    ("hermes", ['<tool_call>', '{"name":"get_weather","arguments":{"city":"a', '</tool_call>', 'b"}}', '</tool_call>']),
    ("hermes", ['<tool_call>', '{"name":"get_weather","arguments":{"x":', '1' * 5000, '}}', '</tool_call>']),
    ("granite4", ['<tool_call>', '{"name":"get_weather","arguments":{"city":"a', '</tool_call>', 'b"}}', '</tool_call>']),
])
def test_hermes_stream_agrees_with_the_whole_text(name, deltas, caplog):
    # a </tool_call> inside a JSON string (or a >4300-digit integer) makes the call malformed:
    # the stream used to have sent '{"city": "a' already; now both give all of it as content
    text = "".join(deltas)
    s = get_tool_parser(name, _ids(), TOOLS).stream()
    frags = [f for d in deltas for f in s.feed(d)] + s.finish()
    assert "".join(f["content"] for f in frags) == text and not s.saw_calls
    assert all(set(f) == {"content"} for f in frags)
    assert _extract(name, text) == (text, [])


def test_hermes_stream_sends_a_good_call_whole_at_its_close():
    deltas = ['<tool_call>', '{"name":"get_weather",', '"arguments":{"city":"a</tool_callb"}}', '</tool_call>']
    s = get_tool_parser("hermes", _ids(), TOOLS).stream()
    got = [s.feed(d) for d in deltas] + [s.finish()]
    assert got == [[], [], [], [{"tool_calls": [{"index": 0, "id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "a</tool_callb"}'}}]}], []]


@pytest.mark.parametrize("name,text", [
    ("pythonic", "[get_weather(city='a')] and then some"),
    ("llama4_pythonic", "[get_weather(city='a')]\nbye"),
    ("granite", '<|tool_call|>[{"name":"get_weather","arguments":{"city":"a"}}] bye'),
])
def test_text_after_the_call_list_is_content_in_a_stream_too(name, text):
    # vLLM's non-streaming parse of the whole output fails on the trailing text: all content;
    # the stream used to send the call at "]" and drop the rest
    assert _extract(name, text) == (text, [])
    for chunk in (1, 5, len(text)):
        assert _stream(name, text, chunk) == (text, [])


@pytest.mark.parametrize("name,text", [
    ("pythonic", "[get_weather(city='a'), get_weather(city='b')]\n"),
    ("granite", '<|tool_call|>[{"name":"get_weather","arguments":{"city":"a"}}]'),
])
def test_call_lists_are_sent_whole_at_the_end(name, text):
    s = get_tool_parser(name, _ids(), TOOLS).stream()
    assert [f for c in text for f in s.feed(c)] == []
    calls = [("get_weather", '{"city": "a"}')] + ([("get_weather", '{"city": "b"}')] if "'b'" in text else [])
    assert s.finish() == [{"tool_calls": [{"index": i, "id": f"call_{i}", "type": "function", "function": {
        "name": n, "arguments": a}}]} for i, (n, a) in enumerate(calls)]


@pytest.mark.parametrize("text,content", [
    ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Par',
     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Par'),
    ('<|channel|>commentary<|message|>preamble<|end|><|start|>assistant<|channel|>commentary '
     'to=functions.get_weather json<|message|>{"city":"Par',
     'preamble<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Par'),
])
def test_harmony_call_cut_by_max_tokens_is_content(text, content, caplog):
    # used to be content None and no calls: everything lost
    with caplog.at_level(logging.WARNING):
        assert _extract("openai", text) == (content, [])
    assert "Error in extracting tool call from response." in caplog.text
    for chunk in (1, 7):
        assert _stream("openai", text, chunk) == (content, [])
