"""Tool-call parsers (kvserve.chat.tool_calls): extraction, streaming, malformed output."""

from __future__ import annotations

import itertools
import json
import logging
import random

import pytest

from kvserve.chat.tool_calls import ExtractedToolCalls, ToolCall, detect_tool_parser
from kvserve.chat.tool_parsers import TOOL_PARSERS, get_tool_parser

# seed 002 Example 11
SEED_OUTPUT = (
    "I will read the file first.\n"
    "<tool_call>\n"
    '{"name": "read_file", "arguments": {"path": "src/Main.java"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "list_dir", "arguments": {"path": "src"}}\n'
    "</tool_call>"
)


def counter_ids():
    c = itertools.count()
    return lambda: f"call_{next(c)}"


def chunkings(text: str):
    """Whole text, char by char, and random splits with fixed seeds."""
    yield [text]
    yield list(text)
    for seed in range(25):
        r = random.Random(seed)
        parts, i = [], 0
        while i < len(text):
            j = i + r.randint(1, 9)
            parts.append(text[i:j])
            i = j
        yield parts


def run_stream(parser, parts):
    """Feed parts to a parser's (incremental) streamer or to a given streamer."""
    s = parser.stream() if hasattr(parser, "stream") else parser
    frags = []
    for p in parts:
        frags += s.feed(p)
    frags += s.finish()
    return s, frags


def rebuild(frags):
    """(content or None, [(index, id, name, arguments)]) from delta fragments."""
    content, calls = [], {}
    for f in frags:
        assert set(f) in ({"content"}, {"tool_calls"}), f
        if "content" in f:
            content.append(f["content"])
            continue
        (tc,) = f["tool_calls"]
        k = tc["index"]
        if "id" in tc:
            assert k not in calls and k == len(calls), "calls are numbered 0, 1, 2 in order"
            assert tc["type"] == "function"
            calls[k] = [k, tc["id"], tc["function"]["name"], tc["function"]["arguments"]]
        else:
            assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            calls[k][3] += tc["function"]["arguments"]
    return ("".join(content) or None), [tuple(calls[k]) for k in sorted(calls)]


# ------------------------------------------------------------------------------------ hermes


def test_seed_example_11_hermes_extract():
    got = get_tool_parser("hermes", counter_ids()).extract(SEED_OUTPUT)
    assert got == ExtractedToolCalls(
        content="I will read the file first.",
        calls=[ToolCall(name="read_file", arguments='{"path": "src/Main.java"}', id="call_0"),
               ToolCall(name="list_dir", arguments='{"path": "src"}', id="call_1")],
    )
    assert json.loads(got.calls[0].arguments) == {"path": "src/Main.java"}
    assert got.calls[0].to_openai() == {"id": "call_0", "type": "function",
                                        "function": {"name": "read_file", "arguments": '{"path": "src/Main.java"}'}}


def test_default_ids_are_unique_random():
    got = get_tool_parser("hermes").extract(SEED_OUTPUT)
    ids = [c.id for c in got.calls]
    assert len(set(ids)) == 2
    for i in ids:
        assert i.startswith("call_") and len(i) == 29 and i[5:].isalnum()


def test_seed_example_11_streaming_many_chunkings():
    parser = get_tool_parser("hermes", counter_ids())
    for parts in chunkings(SEED_OUTPUT):
        s, frags = run_stream(parser, parts)
        content, calls = rebuild(frags)
        assert content == "I will read the file first."
        assert [(k, n, a) for k, _, n, a in calls] == [
            (0, "read_file", '{"path": "src/Main.java"}'), (1, "list_dir", '{"path": "src"}')]
        assert s.saw_calls and not s.malformed


def test_hermes_streams_each_call_whole_at_its_close():
    # a call is sent once its </tool_call> came and its JSON parsed (stream == non-stream)
    parser = get_tool_parser("hermes", counter_ids())
    _, frags = run_stream(parser, list(SEED_OUTPUT))
    calls = [f["tool_calls"][0] for f in frags if "tool_calls" in f]
    assert calls == [
        {"index": 0, "id": "call_0", "type": "function",
         "function": {"name": "read_file", "arguments": '{"path": "src/Main.java"}'}},
        {"index": 1, "id": "call_1", "type": "function", "function": {"name": "list_dir", "arguments": '{"path": "src"}'}},
    ]
    # content streams before the call, never after it
    first_call = next(i for i, f in enumerate(frags) if "tool_calls" in f)
    assert all("content" in f for f in frags[:first_call])
    assert all("tool_calls" in f for f in frags[first_call:])


def test_whole_text_stream_gives_one_fragment_per_call():
    _, frags = run_stream(get_tool_parser("hermes", counter_ids()), [SEED_OUTPUT])
    assert frags == [
        {"content": "I will read the file first."},
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                         "function": {"name": "read_file", "arguments": '{"path": "src/Main.java"}'}}]},
        {"tool_calls": [{"index": 1, "id": "call_1", "type": "function",
                         "function": {"name": "list_dir", "arguments": '{"path": "src"}'}}]},
    ]


@pytest.mark.parametrize("call", [
    '{"name": "now"}',
    '{"name": "now", "arguments": {}}',
    '{"name": "now", "arguments": null}',
    '{"name": "now", "arguments": ""}',
    '{"name": "now", "arguments": { }}',
])
def test_tool_without_parameters_gives_empty_object(call):
    text = f"<tool_call>\n{call}\n</tool_call>"
    parser = get_tool_parser("hermes", counter_ids())
    assert parser.extract(text) == ExtractedToolCalls(None, [ToolCall("now", "{}", "call_0")])
    for parts in chunkings(text):
        assert rebuild(run_stream(parser, parts)[1])[1][0][2:] == ("now", "{}")


def test_arguments_are_reserialized():
    # llama-server seed 000 Example 13 shape: whitespace-heavy JSON from a weak model
    raw = '{\n  \t\t\t  \t\t\t  \t\t\t  \t\t\t"path":"src/Main.java" }'
    text = f'<tool_call>\n{{"name": "read_file", "arguments": {raw}}}\n</tool_call>'
    parser = get_tool_parser("hermes")
    assert parser.extract(text).calls[0].arguments == '{"path": "src/Main.java"}'
    # escapes, non-ASCII, surrogate pairs, numbers, nesting: same as json.dumps(json.loads(...))
    raw = ('{"a": "\\u00e9\\ud83d\\ude00\\n\\"x\\"\\/", "b": [1.50, -0, 1E5, true, null, {}], '
           '"c": {"d": []}, "e": "caf\u00e9", "f": "\\ud800z", "g": 12345678901234567890}')
    text = f'<tool_call>{{"name": "f", "arguments": {raw}}}</tool_call>'
    expected = json.dumps(json.loads(raw), ensure_ascii=False)
    assert expected == ('{"a": "é😀\\n\\"x\\"/", "b": [1.5, 0, 100000.0, true, null, {}], "c": {"d": []}, '
                        '"e": "café", "f": "\ud800z", "g": 12345678901234567890}')
    assert parser.extract(text).calls[0].arguments == expected
    for parts in chunkings(text):
        assert rebuild(run_stream(parser, parts)[1])[1][0][3] == expected


def test_duplicate_keys_are_kept_in_order():
    text = '<tool_call>{"name": "f", "arguments": {"a": 1, "a": 2}}</tool_call>'
    assert get_tool_parser("hermes").extract(text).calls[0].arguments == '{"a": 1, "a": 2}'


def test_arguments_before_name_and_string_arguments():
    parser = get_tool_parser("hermes", counter_ids())
    text = '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>'
    assert parser.extract(text).calls[0].arguments == '{"x": 1}'
    text2 = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert parser.extract(text2).calls[0].arguments == '{"x": 1}'
    for t in (text, text2):
        for parts in chunkings(t):
            assert rebuild(run_stream(parser, parts)[1])[1][0][2:] == ("f", '{"x": 1}')


@pytest.mark.parametrize("text", [
    'Let me see.\n<tool_call>\n{"name": "read_file", "arguments": {"path": }}\n</tool_call>',  # bad JSON
    '<tool_call>\n{"arguments": {"path": "a"}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',  # name not a string
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "f", "arguments": "nope"}\n</tool_call>',  # string that is not JSON
    '<tool_call>\n{"name": "f"} trailing\n</tool_call>',  # text after the object
    "Sure <tool_call>\n",  # nothing inside
    '<tool_call>{"name": "f", "arguments": {"a": 1}',  # unterminated object
])
def test_malformed_call_is_content(text, caplog):
    parser = get_tool_parser("hermes")
    with caplog.at_level(logging.WARNING, logger="kvserve.chat.tool_calls"):
        got = parser.extract(text)
    assert got == ExtractedToolCalls(content=text, calls=[])
    assert "Error in extracting tool call from response." in caplog.messages
    for parts in chunkings(text):
        s, frags = run_stream(get_tool_parser("hermes").stream(incremental=False), parts)
        assert rebuild(frags) == (text, [])
        assert not s.saw_calls and s.malformed


def test_malformed_after_the_name_was_streamed():
    text = 'Let me see.\n<tool_call>\n{"name": "read_file", "arguments": {"path": }}\n</tool_call> bye'
    # nothing of a call is sent before its close: streamed char by char it is content too
    s, frags = run_stream(get_tool_parser("hermes", counter_ids()), list(text))
    assert rebuild(frags) == (text, []) and not s.saw_calls and s.malformed
    # found within one delta, before anything of the call was sent: all of it is content
    s, frags = run_stream(get_tool_parser("hermes"), [text])
    assert rebuild(frags) == (text, []) and not s.saw_calls and s.malformed
    # a failure found before anything of the call was sent still turns into content
    text = '<tool_call>\n{"arguments": {"path": "a"}}\n</tool_call>'
    for parts in chunkings(text):
        assert rebuild(run_stream(get_tool_parser("hermes"), parts)[1]) == (text, [])


def test_malformed_second_call_drops_everything_non_streaming():
    text = SEED_OUTPUT + '\n<tool_call>\n{"name": bad}\n</tool_call>'
    got = get_tool_parser("hermes").extract(text)
    assert got == ExtractedToolCalls(content=text, calls=[])
    # streaming that already sent two calls drops the rest
    s, frags = run_stream(get_tool_parser("hermes", counter_ids()), list(text))
    assert s.saw_calls and s.malformed
    content, calls = rebuild(frags)
    assert content == "I will read the file first."
    assert [c[2] for c in calls] == ["read_file", "list_dir"]
    # everything in one delta: nothing was sent before the failure, so it matches extract
    assert rebuild(run_stream(get_tool_parser("hermes"), [text])[1]) == (text, [])


def test_no_call_text_is_unchanged_content():
    text = "Plain answer with a < sign and <tool and trailing space \n"
    parser = get_tool_parser("hermes")
    assert parser.extract(text) == ExtractedToolCalls(content=text, calls=[])
    for parts in chunkings(text):
        s, frags = run_stream(parser, parts)
        assert rebuild(frags) == (text, []) and not s.saw_calls and not s.malformed


def test_content_streams_immediately_and_holds_only_a_marker_prefix():
    s = get_tool_parser("hermes").stream()
    assert s.feed("Hello") == [{"content": "Hello"}]
    assert s.feed(" world <tool") == [{"content": " world"}]
    assert s.feed("box>") == [{"content": " <toolbox>"}]
    assert s.feed("\n\n") == []  # trailing whitespace may precede a call
    assert s.feed("<tool_call>") == []
    assert s.finish() == [{"content": "\n\n<tool_call>"}]  # empty call: all of it is content


def test_unterminated_last_call_is_parsed():
    text = 'x\n<tool_call>\n{"name": "a", "arguments": {"n": 1}}\n'
    assert get_tool_parser("hermes", counter_ids()).extract(text) == ExtractedToolCalls(
        "x", [ToolCall("a", '{"n": 1}', "call_0")])
    for parts in chunkings(text):
        assert rebuild(run_stream(get_tool_parser("hermes", counter_ids()), parts)[1]) == (
            "x", [(0, "call_0", "a", '{"n": 1}')])


def test_text_between_and_after_calls_is_dropped():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call> and then '
            '<tool_call>{"name": "b", "arguments": {}}</tool_call> done')
    assert get_tool_parser("hermes", counter_ids()).extract(text) == ExtractedToolCalls(
        None, [ToolCall("a", "{}", "call_0"), ToolCall("b", "{}", "call_1")])
    for parts in chunkings(text):
        assert rebuild(run_stream(get_tool_parser("hermes", counter_ids()), parts)[1]) == (
            None, [(0, "call_0", "a", "{}"), (1, "call_1", "b", "{}")])


def _random_value(r: random.Random, depth: int = 0):
    pool = ["a", " ", '"', "\\", "\n", "\t", "é", "😀", "/", "}", "]", "<", "\x01"]
    k = r.randint(0, 6 if depth < 3 else 3)
    if k == 0:
        return "".join(r.choice(pool) for _ in range(r.randint(0, 6)))
    if k == 1:
        return r.choice([0, -7, 10**19, 1.5, -0.25, 1e300, 3.0])
    if k == 2:
        return r.choice([True, False, None])
    if k == 3:
        return r.randint(0, 99)
    if k in (4, 5):
        return {f"k{i}": _random_value(r, depth + 1) for i in range(r.randint(0, 3))}
    return [_random_value(r, depth + 1) for _ in range(r.randint(0, 3))]


def _random_json(v, r: random.Random) -> str:
    def ws():
        return r.choice(["", " ", "\n  ", "\t"])
    if isinstance(v, dict):
        items = (json.dumps(k) + ws() + ":" + ws() + _random_json(x, r) for k, x in v.items())
        return "{" + ws() + ("," + ws()).join(items) + ws() + "}"
    if isinstance(v, list):
        return "[" + ws() + ("," + ws()).join(_random_json(x, r) for x in v) + ws() + "]"
    return json.dumps(v, ensure_ascii=r.random() < 0.5)


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "mistral_args"])
def test_random_arguments_stream_equals_extract(fmt):
    parser = get_tool_parser("mistral" if fmt == "mistral_args" else fmt)
    for seed in range(150):
        r = random.Random(seed)
        calls = [(f"f{i}", _random_json({f"p{j}": _random_value(r) for j in range(r.randint(0, 3))}, r))
                 for i in range(r.randint(1, 3))]
        objs = [f'{{"name": "{n}", "{"parameters" if fmt == "llama3_json" else "arguments"}": {a}}}' for n, a in calls]
        if fmt == "hermes":
            text = "Intro.\n" + "".join(f"<tool_call>\n{o}\n</tool_call>\n" for o in objs)
        elif fmt == "llama3_json":
            text = " " + "; ".join(objs)
        elif fmt == "mistral":
            text = "Intro. [TOOL_CALLS][" + ", ".join(objs) + "]"
        else:
            text = "Intro. " + "".join(f"[TOOL_CALLS]{n}[ARGS]{a}" for n, a in calls)
        expected = [(n, json.dumps(json.loads(a), ensure_ascii=False)) for n, a in calls]
        got = parser.extract(text)
        assert [(c.name, c.arguments) for c in got.calls] == expected, text
        parts, i = [], 0
        while i < len(text):
            j = i + r.randint(1, 6)
            parts.append(text[i:j])
            i = j
        content, streamed = rebuild(run_stream(parser, parts)[1])
        assert content == got.content
        assert [(n, a) for _, _, n, a in streamed] == expected


# ------------------------------------------------------------------------------- llama3_json


def test_llama3_json():
    parser = get_tool_parser("llama3_json", counter_ids())
    text = '<|python_tag|>{"name": "read_file", "parameters": {"path": "a"}}; {"name": "now", "arguments": {}}'
    want = ExtractedToolCalls(None, [ToolCall("read_file", '{"path": "a"}', "call_0"),
                                     ToolCall("now", "{}", "call_1")])
    assert parser.extract(text) == want
    assert parser.extract('  {"name": "now"}\n') == ExtractedToolCalls(None, [ToolCall("now", "{}", "call_2")])
    text2 = 'I will call it. <|python_tag|>{"name": "now", "parameters": {}}'
    assert parser.extract(text2).content == "I will call it."
    for t in (text, text2):
        for parts in chunkings(t):
            content, calls = rebuild(run_stream(parser, parts)[1])
            ref = parser.extract(t)
            assert content == ref.content
            assert [(n, a) for _, _, n, a in calls] == [(c.name, c.arguments) for c in ref.calls]


@pytest.mark.parametrize("text", [
    'Here is JSON: {"name": "now", "parameters": {}}',  # "{" not at the start: plain content
    '{"answer": 42}',  # a JSON object that is not a call: malformed -> content
    "<|python_tag|>brave_search.call(query='x')",  # built-in tool syntax is not JSON
])
def test_llama3_json_non_calls_are_content(text):
    parser = get_tool_parser("llama3_json")
    assert parser.extract(text) == ExtractedToolCalls(text, [])
    for parts in chunkings(text):
        assert rebuild(run_stream(parser, parts)[1]) == (text, [])


def test_llama3_json_text_after_a_call():
    text = '{"name": "now", "parameters": {}} and more'
    parser = get_tool_parser("llama3_json", counter_ids())
    assert parser.extract(text) == ExtractedToolCalls(text, [])  # vLLM: not "; " -> content
    # a stream that already sent the call keeps it
    s, frags = run_stream(parser.stream(incremental=False), list(text))
    assert rebuild(frags) == (None, [(0, "call_0", "now", "{}")]) and s.malformed


# ----------------------------------------------------------------------------------- mistral


def test_mistral_forms():
    parser = get_tool_parser("mistral")
    arr = 'Checking. [TOOL_CALLS][{"name": "read_file", "arguments": {"path": "a"}}, {"name": "now", "arguments": {}}]'
    new = '[TOOL_CALLS]read_file[ARGS]{"path": "a"}[TOOL_CALLS]now[CALL_ID]a1B2c3D4e[ARGS]{}'
    for text, content in ((arr, "Checking."), (new, None)):
        got = parser.extract(text)
        assert got.content == content
        assert [(c.name, c.arguments) for c in got.calls] == [("read_file", '{"path": "a"}'), ("now", "{}")]
        assert all(len(c.id) == 9 and c.id.isalnum() for c in got.calls)
        for parts in chunkings(text):
            c2, calls = rebuild(run_stream(parser, parts)[1])
            assert c2 == content
            assert [(k, n, a) for k, _, n, a in calls] == [(0, "read_file", '{"path": "a"}'), (1, "now", "{}")]


@pytest.mark.parametrize("text", [
    "[TOOL_CALLS]",
    '[TOOL_CALLS][{"name": "f", "arguments": {}',
    "[TOOL_CALLS]bad name[ARGS]{}",
    '[TOOL_CALLS]f[ARGS]"x"',
])
def test_mistral_malformed(text):
    parser = get_tool_parser("mistral")
    assert parser.extract(text) == ExtractedToolCalls(text, [])
    for parts in chunkings(text):
        assert rebuild(run_stream(parser.stream(incremental=False), parts)[1]) == (text, [])


# ---------------------------------------------------------------------------------- pythonic


def test_pythonic():
    parser = get_tool_parser("pythonic", counter_ids())
    text = '[read_file(path="a"), list_dir(path=\'src\', deep=True, limit=None, tags=("x", 1))]'
    want = ExtractedToolCalls(None, [
        ToolCall("read_file", '{"path": "a"}', "call_0"),
        ToolCall("list_dir", '{"path": "src", "deep": true, "limit": null, "tags": ["x", 1]}', "call_1")])
    assert parser.extract(text) == want
    assert parser.extract("<|python_start|>[now()]<|python_end|>").calls[0].arguments == "{}"
    for parts in chunkings(text):
        _, calls = rebuild(run_stream(parser, parts)[1])
        assert [(k, n, a) for k, _, n, a in calls] == [(0, "read_file", '{"path": "a"}'),
                                                       (1, "list_dir", want.calls[1].arguments)]


@pytest.mark.parametrize("text", [
    "[1, 2, 3]", "[f(1)]", "[f(x=open('a'))]", "[f(x=true)]", "Call [f(x=1)]", "[f(x=1)",
])
def test_pythonic_non_calls_are_content(text):
    parser = get_tool_parser("pythonic")
    assert parser.extract(text) == ExtractedToolCalls(text, [])
    for parts in chunkings(text):
        assert rebuild(run_stream(parser, parts)[1]) == (text, [])


# ---------------------------------------------------------------------------------- registry


def test_registry_and_errors():
    assert sorted(TOOL_PARSERS) == ["deepseek_v3", "deepseek_v31", "glm45", "glm47", "granite", "granite4", "hermes",
                                    "kimi_k2", "llama3_json", "llama4_json", "llama4_pythonic", "longcat", "mimo",
                                    "minimax_m2", "mistral", "openai", "phi4_mini_json", "pythonic", "qwen3_coder",
                                    "qwen3_xml", "seed_oss"]
    with pytest.raises(ValueError) as e:
        get_tool_parser("jamba")
    assert str(e.value) == ("unknown tool call parser 'jamba'; valid names: deepseek_v3, deepseek_v31, glm45, glm47, "
                            "granite, granite4, hermes, kimi_k2, llama3_json, llama4_json, llama4_pythonic, longcat, "
                            "mimo, minimax_m2, mistral, openai, phi4_mini_json, pythonic, qwen3_coder, qwen3_xml, "
                            "seed_oss")


@pytest.mark.parametrize("source,expected", [
    ("{%- if tools %}<tools>{{ tool | tojson }}</tools> ... <tool_call>\\n{\"name\": ...", "hermes"),
    ("{{ '[AVAILABLE_TOOLS]' }}...{{ '[TOOL_CALLS]' }}", "mistral"),
    ("{%- if message.role == 'ipython' %}<|start_header_id|>ipython<|end_header_id|>", "llama3_json"),
    ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
    ("{{- '<|python_start|>' }}[func_name1(params_name1=params_value1)]", "pythonic"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    ("", None),
])
def test_detect_tool_parser(source, expected):
    assert detect_tool_parser(source) == expected


def test_non_incremental_stream_sends_whole_calls():
    for parts in chunkings(SEED_OUTPUT):
        s, frags = run_stream(get_tool_parser("hermes", counter_ids()).stream(incremental=False), parts)
        calls = [f for f in frags if "tool_calls" in f]
        assert calls == [
            {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                             "function": {"name": "read_file", "arguments": '{"path": "src/Main.java"}'}}]},
            {"tool_calls": [{"index": 1, "id": "call_1", "type": "function",
                             "function": {"name": "list_dir", "arguments": '{"path": "src"}'}}]},
        ]
        assert rebuild(frags)[0] == "I will read the file first." and s.saw_calls


def test_unfinished_last_call_is_dropped_when_earlier_calls_are_whole():
    p = get_tool_parser("hermes")
    text = ('Hi\n<tool_call>\n{"name": "read_file", "arguments": {"path": "/d"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "read_file", "arguments": {')  # cut off by max_tokens
    res = p.extract(text)
    assert res.content == "Hi"
    assert [(c.name, c.arguments) for c in res.calls] == [("read_file", '{"path": "/d"}')]
    only = '<tool_call>\n{"name": "read_file", "arguments": {'
    assert p.extract(only).calls == [] and p.extract(only).content == only
