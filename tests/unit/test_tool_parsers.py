"""The tool-call formats of kvserve.chat.tool_formats (vLLM's parser names), as seed 002 Example 11
tests hermes: fixed model text -> the OpenAI-shaped message (content, tool_calls with id, type,
function name and arguments as JSON text), the same result streamed at every split point, malformed
output as plain content, and the start-up errors for --tool-call-parser / --reasoning-parser."""

from __future__ import annotations

import itertools
import json

import pytest

from kvserve.chat.harmony import HarmonyParser, parse_header
from kvserve.chat.tool_calls import detect_tool_parser
from kvserve.chat.tool_formats import convert_param_value
from kvserve.chat.tool_parsers import TOOL_PARSERS, VLLM_TOOL_PARSERS, get_tool_parser
from kvserve.serving.chat_output import Answer, ChoiceOutput, OutputMode, ReasoningPiece, TextPiece, ToolCallPiece
from kvserve.serving.args import parse_args

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "limit": {"type": "integer"}, "flags": {"type": "array"},
        "ratio": {"type": "number"}, "force": {"type": "boolean"}, "note": {"type": ["string", "null"]},
        "mode": {"type": "string", "enum": ["a", "b"]}}}}},
    {"type": "function", "function": {"name": "list_dir", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}}}}},
]


def counter_ids():
    c = itertools.count()
    return lambda: f"call_{next(c)}"


def message(name: str, text: str) -> dict:
    """The OpenAI-shaped assistant message of a finished output."""
    r = get_tool_parser(name, counter_ids(), TOOLS).extract(text)
    return {"role": "assistant", "content": r.content, "tool_calls": [c.to_openai() for c in r.calls]}


def streamed(name: str, parts: list[str], incremental: bool = False) -> dict:
    """The same message rebuilt from a stream's delta fragments."""
    s = get_tool_parser(name, counter_ids(), TOOLS).stream(incremental)
    frags = [f for p in parts for f in s.feed(p)] + s.finish()
    content = "".join(f.get("content", "") for f in frags)
    calls: list[dict] = []
    for f in frags:
        if "tool_calls" in f:
            (tc,) = f["tool_calls"]
            if "id" in tc:
                assert tc["index"] == len(calls) and tc["type"] == "function"
                calls.append({"id": tc["id"], "type": "function", "function": dict(tc["function"])})
            else:
                calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    return {"role": "assistant", "content": content or None, "tool_calls": calls}


def call(i: int, name: str, args: str, call_id: str | None = None) -> dict:
    return {"id": call_id or f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}


def assert_all_splits(name: str, text: str, want: dict) -> None:
    """Every two-piece split, and char by char, streamed both ways, give ``want``."""
    for inc in (False, True):
        assert streamed(name, list(text), inc) == want
        for k in range(len(text) + 1):
            assert streamed(name, [text[:k], text[k:]], inc) == want, (inc, k)


# ------------------------------------------------------------------------------------------ formats

QWEN3_CODER = (
    "I will read the file first.\n"
    "<tool_call>\n<function=read_file>\n"
    "<parameter=path>\nsrc/Main.java\n</parameter>\n"
    "<parameter=limit>\n40\n</parameter>\n"
    "<parameter=flags>\n[\"a\", 1]\n</parameter>\n"
    "<parameter=ratio>\n2.5\n</parameter>\n"
    "<parameter=force>\nTrue\n</parameter>\n"
    "<parameter=note>\nNone\n</parameter>\n"
    "</function>\n</tool_call>\n"
    "<tool_call>\n<function=list_dir>\n<parameter=path>\nsrc\n</parameter>\n</function>\n</tool_call>"
)

GLM45 = (
    "Let me look.\n"
    "<tool_call>read_file\n<arg_key>path</arg_key>\n<arg_value>src/Main.java</arg_value>\n"
    "<arg_key>limit</arg_key>\n<arg_value>40</arg_value>\n</tool_call>\n"
    "<tool_call>list_dir\n<arg_key>path</arg_key>\n<arg_value>123</arg_value>\n</tool_call>"
)

KIMI_K2 = (
    "Reading both.<|tool_calls_section_begin|>"
    "<|tool_call_begin|>functions.read_file:0<|tool_call_argument_begin|>{\"path\": \"src/Main.java\"}"
    "<|tool_call_end|>"
    "<|tool_call_begin|>functions.list_dir:1<|tool_call_argument_begin|>{\"path\":\"src\"}<|tool_call_end|>"
    "<|tool_calls_section_end|>"
)

DEEPSEEK_V3 = (
    "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>read_file\n```json\n"
    "{\"path\": \"src/Main.java\"}\n```<｜tool▁call▁end｜>\n"
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>list_dir\n```json\n{\"path\":\"src\"}\n```<｜tool▁call▁end｜>"
    "<｜tool▁calls▁end｜>"
)

DEEPSEEK_V31 = (
    "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>read_file<｜tool▁sep｜>{\"path\": \"src/Main.java\"}"
    "<｜tool▁call▁end｜><｜tool▁call▁begin｜>list_dir<｜tool▁sep｜>{\"path\":\"src\"}<｜tool▁call▁end｜>"
    "<｜tool▁calls▁end｜>"
)

GRANITE = (
    "<|tool_call|>[{\"name\": \"read_file\", \"arguments\": {\"path\": \"src/Main.java\"}}, "
    "{\"name\": \"list_dir\", \"arguments\": {\"path\": \"src\"}}]"
)

LLAMA4_PYTHONIC = "<|python_start|>[read_file(path=\"src/Main.java\", limit=40), list_dir(path='src')]<|python_end|>"

HARMONY_CALLS = (
    "<|channel|>analysis<|message|>I need the file and the listing.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Reading both.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.read_file <|constrain|>json<|message|>"
    "{\"path\":\"src/Main.java\"}<|call|>"
    "<|start|>assistant to=functions.list_dir<|channel|>commentary json<|message|>{\"path\": \"src\"}"
)

SEED_OSS = QWEN3_CODER.replace("<tool_call>", "<seed:tool_call>").replace("</tool_call>", "</seed:tool_call>")

MINIMAX_M2 = (
    "Reading.\n<minimax:tool_call>\n<invoke name=\"read_file\">\n"
    "<parameter name=\"path\">src/Main.java</parameter>\n<parameter name=\"limit\">40</parameter>\n"
    "<parameter name=\"force\">yes</parameter>\n<parameter name=\"note\">nil</parameter>\n</invoke>\n"
    "<invoke name='list_dir'>\n<parameter name='path'>\nsrc\n</parameter>\n</invoke>\n</minimax:tool_call>"
)

LONGCAT = ("Sure.\n<longcat_tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"src/Main.java\"}}\n"
           "</longcat_tool_call>\n<longcat_tool_call>{\"name\": \"list_dir\", \"arguments\": {\"path\": \"src\"}}"
           "</longcat_tool_call>")

MAIN = '{"path": "src/Main.java"}'
SRC = '{"path": "src"}'


@pytest.mark.parametrize("name,text,content,calls", [
    ("qwen3_coder", QWEN3_CODER, "I will read the file first.", [
        call(0, "read_file", '{"path": "src/Main.java", "limit": 40, "flags": ["a", 1], "ratio": 2.5, '
                             '"force": true, "note": null}'),
        call(1, "list_dir", SRC)]),
    ("qwen3_xml", QWEN3_CODER, "I will read the file first.", [
        call(0, "read_file", '{"path": "src/Main.java", "limit": 40, "flags": ["a", 1], "ratio": 2.5, '
                             '"force": true, "note": null}'),
        call(1, "list_dir", SRC)]),
    ("seed_oss", SEED_OSS, "I will read the file first.", [
        call(0, "read_file", '{"path": "src/Main.java", "limit": 40, "flags": ["a", 1], "ratio": 2.5, '
                             '"force": true, "note": null}'),
        call(1, "list_dir", SRC)]),
    ("minimax_m2", MINIMAX_M2, "Reading.", [
        call(0, "read_file", '{"path": "src/Main.java", "limit": 40, "force": true, "note": null}'),
        call(1, "list_dir", SRC)]),
    ("longcat", LONGCAT, "Sure.", [call(0, "read_file", MAIN), call(1, "list_dir", SRC)]),
    ("mimo", QWEN3_CODER.split("<tool_call>", 2)[0] + "<tool_call>" + QWEN3_CODER.split("<tool_call>", 2)[2],
     "I will read the file first.", [call(0, "list_dir", SRC)]),
    ("granite4", "Reading.\n<tool_call>\n" + '{"name": "read_file", "arguments": {"path": "src/Main.java"}}'
     "\n</tool_call>\n<tool_call>" + '{"name": "list_dir", "arguments": {"path": "src"}}' + "</tool_call>\nDone.",
     "Reading.\nDone.", [call(0, "read_file", MAIN), call(1, "list_dir", SRC)]),
    ("phi4_mini_json", ('functools[{"name": "read_file", "arguments": {"path": "src/Main.java"}}, '
     '{"name": "list_dir", "parameters": {"path": "src"}}]'), None,
     [call(0, "read_file", MAIN), call(1, "list_dir", SRC)]),
    # list_dir's path is a string in its schema: "123" stays text
    ("glm45", GLM45, "Let me look.", [call(0, "read_file", '{"path": "src/Main.java", "limit": 40}'),
                                      call(1, "list_dir", '{"path": "123"}')]),
    ("glm47", GLM45.replace("read_file\n", "read_file"), "Let me look.", [
        call(0, "read_file", '{"path": "src/Main.java", "limit": 40}'), call(1, "list_dir", '{"path": "123"}')]),
    ("kimi_k2", KIMI_K2, "Reading both.", [call(0, "read_file", MAIN, "functions.read_file:0"),
                                           call(1, "list_dir", SRC, "functions.list_dir:1")]),
    ("deepseek_v3", DEEPSEEK_V3, "Sure.", [call(0, "read_file", MAIN), call(1, "list_dir", SRC)]),
    ("deepseek_v31", DEEPSEEK_V31, "Sure.", [call(0, "read_file", MAIN), call(1, "list_dir", SRC)]),
    ("granite", GRANITE, None, [call(0, "read_file", MAIN), call(1, "list_dir", SRC)]),
    ("granite", "  <tool_call>" + GRANITE[len("<|tool_call|>"):], None,
     [call(0, "read_file", MAIN), call(1, "list_dir", SRC)]),
    ("llama4_pythonic", LLAMA4_PYTHONIC, None, [call(0, "read_file", '{"path": "src/Main.java", "limit": 40}'),
                                                call(1, "list_dir", SRC)]),
    ("llama4_json", 'Sure. <|python_tag|>{"name": "list_dir", "parameters": {"path": "src"}}', "Sure.",
     [call(0, "list_dir", SRC)]),
    # the preamble is content, analysis is not; the second call is cut off before <|call|> (a stop token)
    ("openai", HARMONY_CALLS, "Reading both.", [call(0, "read_file", MAIN), call(1, "list_dir", SRC)]),
])
def test_format_gives_the_openai_message(name, text, content, calls):
    want = {"role": "assistant", "content": content, "tool_calls": calls}
    assert message(name, text) == want
    assert_all_splits(name, text, want)


def test_harmony_final_answer_without_calls():
    text = ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
            "The answer is 4.<|return|>")
    want = {"role": "assistant", "content": "The answer is 4.", "tool_calls": []}
    assert message("openai", text) == want
    assert_all_splits("openai", text, want)


def test_harmony_after_the_reasoning_split():
    """What --reasoning-parser openai_gptoss leaves: the final text, or a call's harmony text."""
    text = "Reading.<|channel|>commentary to=functions.list_dir <|constrain|>json<|message|>{\"path\":\"src\"}<|call|>"
    assert message("openai", text) == {"role": "assistant", "content": "Reading.",
                                       "tool_calls": [call(0, "list_dir", SRC)]}
    assert message("openai", "Four.") == {"role": "assistant", "content": "Four.", "tool_calls": []}


def test_harmony_non_json_arguments_pass_as_text():
    text = "<|channel|>commentary to=functions.list_dir <|constrain|>json<|message|>{bad}<|call|>"
    assert message("openai", text)["tool_calls"] == [call(0, "list_dir", "{bad}")]


def test_harmony_headers():
    h = parse_header("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json")
    assert (h.role, h.channel, h.recipient, h.content_type) == ("assistant", "commentary", "functions.get_weather",
                                                                "json")
    h = parse_header("<|start|>assistant to=functions.f<|channel|>commentary json")
    assert (h.role, h.channel, h.recipient, h.content_type) == ("assistant", "commentary", "functions.f", "json")
    p = HarmonyParser()
    kinds = [(e.kind, e.text) for e in p.feed("<|channel|>final<|message|>Hi<|end|>") + p.finish()]
    assert kinds == [("begin", ""), ("text", "Hi"), ("end", "")]
    assert [(m.channel, m.content, m.terminator) for m in p.messages] == [("final", "Hi", "<|end|>")]


def test_qwen3_coder_values_with_tags_and_missing_close():
    """A ``</parameter>`` inside a value is text; a missing one ends at the next parameter."""
    text = ("<tool_call>\n<function=read_file>\n<parameter=path>\na</parameter>b\n</parameter>\n"
            "<parameter=limit>\n7\n<parameter=ratio>\nx\n</parameter>\n</function>\n</tool_call>")
    want = {"role": "assistant", "content": None,
            "tool_calls": [call(0, "read_file", '{"path": "a</parameter>b", "limit": 7, "ratio": "x"}')]}
    assert message("qwen3_coder", text) == want
    assert_all_splits("qwen3_coder", text, want)


def test_qwen3_coder_text_after_the_calls_is_dropped():
    text = "<tool_call>\n<function=list_dir>\n<parameter=path>\nsrc\n</parameter>\n</function>\n</tool_call>\nDone."
    want = {"role": "assistant", "content": None, "tool_calls": [call(0, "list_dir", SRC)]}
    assert message("qwen3_coder", text) == want
    assert_all_splits("qwen3_coder", text, want)


@pytest.mark.parametrize("value,name,expected", [
    ("40", "limit", 40), ("4x", "limit", "4x"), ("2.0", "ratio", 2), ("2.5", "ratio", 2.5), ("nope", "ratio", "nope"),
    ("TRUE", "force", True), ("yes", "force", False), ('["a"]', "flags", ["a"]), ("['a']", "flags", ["a"]),
    ("null", "limit", None), ("None", "note", None), ("null", "path", "null"), ("40", "path", "40"),
    ("40", "unknown", "40"), (" a ", "mode", "a"), (" x ", "mode", " x "), (" a ", "path", " a "),
])
def test_qwen3_coder_schema_conversion(value, name, expected):
    props = TOOLS[0]["function"]["parameters"]["properties"]
    assert convert_param_value(value, name, props) == expected


# ------------------------------------------------------------------------------------------ malformed

@pytest.mark.parametrize("name,text", [
    ("qwen3_coder", "Try:\n<tool_call>\n<function={{ tc.name }}>\n</function>\n</tool_call>"),
    ("qwen3_coder", "Try:\n<tool_call>\nnot a function\n</tool_call>"),
    ("glm45", "Try:\n<tool_call>two words\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"),
    ("kimi_k2", ("x<|tool_calls_section_begin|><|tool_call_begin|>functions.read_file:0"
                "<|tool_call_argument_begin|>{bad<|tool_call_end|><|tool_calls_section_end|>")),
    ("kimi_k2", ("x<|tool_calls_section_begin|><|tool_call_begin|>read_file<|tool_call_argument_begin|>{}"
                "<|tool_call_end|>")),
    ("deepseek_v3", "x<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>read_file\n{}<｜tool▁call▁end｜>"),
    ("deepseek_v31", "x<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>read_file<｜tool▁sep｜>[1]<｜tool▁call▁end｜>"),
    ("granite", "[1] is the first reference."),
    ("granite", '[{"name": "list_dir", "arguments": {"path": "src"}}] and more text'),
    ("llama4_pythonic", "[not a call]"),
    ("minimax_m2", "x<minimax:tool_call><invoke name=\"a b\"></invoke></minimax:tool_call>"),
    ("minimax_m2", "x<minimax:tool_call>nothing here</minimax:tool_call>"),
    ("seed_oss", "x<seed:tool_call>\nno function\n</seed:tool_call>"),
    ("longcat", "x<longcat_tool_call>{\"name\": }</longcat_tool_call>"),
    ("granite4", "x<tool_call>{bad}</tool_call> y"),
    ("phi4_mini_json", "functools[{bad}]"),
])
def test_malformed_output_is_content(name, text, caplog):
    want = {"role": "assistant", "content": text, "tool_calls": []}
    assert message(name, text) == want
    assert "Error in extracting tool call from response." in caplog.text
    # not incremental (what the OpenAI face streams): malformed first calls stream as content
    if name != "granite" or "more text" not in text:
        for k in range(len(text) + 1):
            assert streamed(name, [text[:k], text[k:]]) == want, k


def test_plain_text_is_content_for_every_parser():
    for name in TOOL_PARSERS:
        text = "The loop runs n+1 times."
        want = {"role": "assistant", "content": text, "tool_calls": []}
        assert message(name, text) == want, name
        assert streamed(name, list(text)) == want, name


# ------------------------------------------------------------------------------------------ face

def test_choice_output_gpt_oss_both_parsers():
    """--reasoning-parser openai_gptoss --tool-call-parser openai, whole and streamed."""
    mode = OutputMode(tool_parser="openai", reasoning_style="openai_gptoss")
    ans = ChoiceOutput(mode).answer(HARMONY_CALLS)
    assert ans.reasoning == "I need the file and the listing."
    assert ans.text == "Reading both."
    assert [(c.index, c.name, c.arguments) for c in ans.tool_calls] == [(0, "read_file", MAIN), (1, "list_dir", SRC)]
    for k in range(len(HARMONY_CALLS) + 1):
        out = ChoiceOutput(mode)
        pieces = out.feed(HARMONY_CALLS[:k]) + out.feed(HARMONY_CALLS[k:]) + out.finish()
        assert "".join(p.text for p in pieces if isinstance(p, ReasoningPiece)) == "I need the file and the listing."
        assert "".join(p.text for p in pieces if isinstance(p, TextPiece)) == "Reading both."
        got = [(p.index, p.name, p.arguments) for p in pieces if isinstance(p, ToolCallPiece)]
        assert got == [(0, "read_file", MAIN), (1, "list_dir", SRC)], k
        assert out.has_tool_calls


def test_choice_output_harmony_without_a_reasoning_parser():
    """--tool-call-parser openai alone: analysis is left out of the content, whole and streamed."""
    text = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Four."
    mode = OutputMode(tool_parser="openai")
    assert ChoiceOutput(mode).answer(text) == Answer("Four.", None, [])
    out = ChoiceOutput(mode)
    pieces = [p for ch in text for p in out.feed(ch)] + out.finish()
    assert all(isinstance(p, TextPiece) for p in pieces) and "".join(p.text for p in pieces) == "Four."


def test_choice_output_passes_the_tools_to_qwen3_coder():
    mode = OutputMode(tool_parser="qwen3_coder", tools=TOOLS)
    text = "<tool_call>\n<function=read_file>\n<parameter=limit>\n40\n</parameter>\n</function>\n</tool_call>"
    assert json.loads(ChoiceOutput(mode).answer(text).tool_calls[0].arguments) == {"limit": 40}
    out = ChoiceOutput(mode)
    pieces = [p for ch in text for p in out.feed(ch)] + out.finish()
    assert [p.arguments for p in pieces if isinstance(p, ToolCallPiece)] == ['{"limit": 40}']


@pytest.mark.parametrize("source,expected", [
    ("{{- '<|start|>assistant<|channel|>final<|message|>' }}", "openai"),
    ("{{ '<|tool_calls_section_begin|>' }}", "kimi_k2"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n```json\\n'}}",
     "deepseek_v3"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + args}}", "deepseek_v31"),
    ("<tool_call>{{ name }}\n<arg_key>{{ k }}</arg_key>", "glm45"),
    ("<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>", "qwen3_coder"),
    ("<|tool_call|>", "granite"),
])
def test_detect_new_formats(source, expected):
    assert detect_tool_parser(source) == expected


# ------------------------------------------------------------------------------------------ start-up

IMPLEMENTED_TOOLS = ("deepseek_v3, deepseek_v31, glm45, glm47, granite, granite4, hermes, kimi_k2, llama3_json, "
                     "llama4_json, llama4_pythonic, longcat, mimo, minimax_m2, mistral, openai, phi4_mini_json, "
                     "pythonic, qwen3_coder, qwen3_xml, seed_oss")
IMPLEMENTED_REASONING = ("deepseek_r1, deepseek_v3, glm45, granite, kimi_k2, minimax_m2, minimax_m2_append_think, "
                         "mistral, openai_gptoss, qwen3, seed_oss, step3")


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_implemented_tool_parsers_start(name):
    assert parse_args(["m.gguf", "--enable-auto-tool-choice", "--tool-call-parser", name]).tool_call_parser == name


@pytest.mark.parametrize("name", ["deepseek_r1", "deepseek_v3", "glm45", "granite", "kimi_k2", "minimax_m2",
                                  "minimax_m2_append_think", "mistral", "openai_gptoss", "qwen3", "seed_oss", "step3"])
def test_implemented_reasoning_parsers_start(name):
    assert parse_args(["m.gguf", "--reasoning-parser", name]).reasoning_parser == name


def test_every_implemented_tool_parser_is_a_vllm_name():
    assert set(TOOL_PARSERS) <= set(VLLM_TOOL_PARSERS)


def test_flag_help_names_the_implemented_parsers():
    from kvserve.chat.reasoning import REASONING_PARSERS
    from kvserve.serving.flags import help_text

    text = " ".join(help_text().split())
    assert f"a vLLM name: {', '.join(TOOL_PARSERS)} (other vLLM names: start-up error)" in text
    assert f"a vLLM name: {', '.join(REASONING_PARSERS)} (other vLLM names: start-up error)" in text


@pytest.mark.parametrize("flag,name,message", [
    ("--tool-call-parser", "jamba",
     f"--tool-call-parser 'jamba' is a vLLM parser that kvserve does not implement; implemented: {IMPLEMENTED_TOOLS}"),
    ("--tool-call-parser", "xlam",
     ("--tool-call-parser 'xlam' is a vLLM parser that kvserve does not implement; implemented: "
     f"{IMPLEMENTED_TOOLS}")),
    ("--tool-call-parser", "qwen9", f"invalid --tool-call-parser 'qwen9': choose from {IMPLEMENTED_TOOLS}"),
    ("--reasoning-parser", "olmo3",
     ("--reasoning-parser 'olmo3' is a vLLM parser that kvserve does not implement; implemented: "
     f"{IMPLEMENTED_REASONING}")),
    ("--reasoning-parser", "gpt_oss", f"invalid --reasoning-parser 'gpt_oss': choose from {IMPLEMENTED_REASONING}"),
])
def test_parser_names_kvserve_lacks_are_start_up_errors(flag, name, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["m.gguf", flag, name])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
