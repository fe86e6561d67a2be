"""Go text/template renderer (kvserve.chat.go_template): Ollama's chat templates and Go's rules.

The templates under "Ollama's library" are copied verbatim (as data) from Ollama's source tree:
template/*.gotmpl and the Mistral tools template of docs/template.mdx. Every expected string
was written by hand from Go's text/template rules (trim markers eat all adjacent blanks and
newlines; text between actions is kept byte for byte).
"""

from __future__ import annotations

import json

import pytest

from kvserve.chat.go_template import (GoStruct, GoTemplate, GoTemplateExecError, GoTemplateLimitError,
                                      GoTemplateSyntaxError, OllamaTemplate, RenderLimits, chat_values,
                                      collate, go_format_float, go_json, go_sprintf, merge_model_messages,
                                      template_messages, template_tools)
from kvserve.errors import InvalidInputError

# --------------------------------------------------------------------------------------------
# Conversations

SYSTEM = "You are a helpful assistant."
TWO_TURNS = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi. How can I help?"},
    {"role": "user", "content": "What is 2+2?"},
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather",
    "parameters": {"type": "object", "required": ["location"], "properties": {
        "location": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}]
# OpenAI-style: the call's arguments are a JSON string, the result names the call it answers
TOOL_CALL = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"location": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]

# --------------------------------------------------------------------------------------------
# Ollama's library (template/*.gotmpl, docs/template.mdx), verbatim

LLAMA3_INSTRUCT = """{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>

{{ .Content }}<|eot_id|>
{{- end }}<|start_header_id|>assistant<|end_header_id|>

"""

CHATML = """{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""

GEMMA3_INSTRUCT = """{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 }}
{{- if eq .Role "user" }}<start_of_turn>user
{{- if and (eq $i 1) $.System }}
{{ $.System }}
{{ end }}
{{ .Content }}<end_of_turn>
{{ else if eq .Role "assistant" }}<start_of_turn>model
{{ .Content }}<end_of_turn>
{{ end }}
{{- if $last }}<start_of_turn>model
{{ end }}
{{- end }}
"""

ALPACA = """{{- $system := "" }}
{{- range .Messages }}
{{- if eq .Role "system" }}
{{- if not $system }}{{ $system = .Content }}
{{- else }}{{ $system = printf "%s\\n\\n%s" $system .Content }}
{{- end }}
{{- else if eq .Role "user" }}
{{- if $system }}{{ $system }}

{{ $system = "" }}
{{- end }}### Instruction:
{{ .Content }}

{{ else if eq .Role "assistant" }}### Response:
{{ .Content }}

{{ end }}
{{- end }}### Response:
"""

MISTRAL_TOOLS = """{{- range $index, $_ := .Messages }}
{{- if eq .Role "user" }}
{{- if and (le (len (slice $.Messages $index)) 2) $.Tools }}[AVAILABLE_TOOLS] {{ json $.Tools }}[/AVAILABLE_TOOLS]
{{- end }}[INST] {{ if and (eq (len (slice $.Messages $index)) 1) $.System }}{{ $.System }}

{{ end }}{{ .Content }}[/INST]
{{- else if eq .Role "assistant" }}
{{- if .Content }} {{ .Content }}</s>
{{- else if .ToolCalls }}[TOOL_CALLS] [
{{- range .ToolCalls }}{"name": "{{ .Function.Name }}", "arguments": {{ json .Function.Arguments }}}
{{- end }}]</s>
{{- end }}
{{- else if eq .Role "tool" }}[TOOL_RESULTS] {"content": {{ .Content }}}[/TOOL_RESULTS]
{{- end }}
{{- end }}"""

_SAFETY = ("# Safety Preamble\nThe instructions in this section override those in the task description and style "
           "guide sections. Don't answer questions that are harmful or immoral.\n\n# System Preamble\n## Basic Rules\n"
           "You are a powerful conversational AI trained by Cohere to help people. You are augmented by a number of "
           "tools, and your job is to use and consume the output of these tools to best help the user. You will see a "
           "conversation history between yourself and a user, ending with an utterance from the user. You will then see "
           "a specific instruction instructing you what kind of response to generate. When you answer the user's "
           "requests, you cite your sources in your answers, according to those instructions.\n\n")
_ACTION = ("Write 'Action:' followed by a json-formatted list of actions that you want to perform in order to produce "
           "a good response to the user's last input. You can use any of the supplied tools any number of times, but "
           "you should aim to execute the minimum number of necessary actions for the input. You should use the "
           "`directly-answer` tool if calling the other tools is unnecessary. The list of actions you want to call "
           "should be formatted as a list of json objects, for example:\n```json\n[\n    {\n        \"tool_name\": "
           "title of the tool in the specification,\n        \"parameters\": a dict of parameters to input into the "
           "tool as they are defined in the specs, or {} if it takes no parameters\n    }\n]```")
COMMAND_R = ("""{{- if or .Tools .System }}<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>
{{- if .Tools }}""" + _SAFETY + """{{ if .System }}# User Preamble
{{ .System }}
{{- end }}

## Available Tools
Here is a list of tools that you have available to you:
{{- range .Tools }}

```python
def {{ .Function.Name }}(
{{- range $name, $property := .Function.Parameters.Properties }}{{ $name }}: {{ $property.Type }}, {{ end }}) -> List[Dict]:
    '''{{ .Function.Description }}

{{- if .Function.Parameters.Properties }}

    Args:
{{- range $name, $property := .Function.Parameters.Properties }}
        {{ $name }} ({{ $property.Type }}): {{ $property.Description }}
{{- end }}
{{- end }}
    '''
    pass
```
{{- end }}
{{- else if .System }}{{ .System }}
{{- end }}<|END_OF_TURN_TOKEN|>
{{- end }}
{{- range .Messages }}
{{- if eq .Role "system" }}
{{- continue }}
{{- end }}<|START_OF_TURN_TOKEN|>
{{- if eq .Role "user" }}<|USER_TOKEN|>{{ .Content }}
{{- if $.Tools }}<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>""" + _ACTION + """
{{- end }}
{{- else if eq .Role "assistant" }}<|CHATBOT_TOKEN|>
{{- if .Content }}{{ .Content }}
{{- else if .ToolCalls }}
Action: ```json
[
{{- range .ToolCalls }}
    {
        "tool_name": "{{ .Function.Name }}",
        "parameters": {{ .Function.Arguments }}
    }
{{- end }}
]```
{{- end }}
{{- else if eq .Role "tool" }}<|SYSTEM_TOKEN|><results>
console_output: {{ .Content }}
</results>
{{- end }}<|END_OF_TURN_TOKEN|>
{{- end }}<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>
""")

# An older template (no .Messages): Ollama runs it once per turn (template/template_test.go)
CHATML_LEGACY = """{{ if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}{{ if .Prompt }}<|im_start|>user
{{ .Prompt }}<|im_end|>
{{ end }}<|im_start|>assistant
{{ .Response }}<|im_end|>
"""


def render(text: str, messages: list[dict], tools: list[dict] | None = None, **kw) -> str:
    return OllamaTemplate(text).render(messages, tools, **kw)


# --------------------------------------------------------------------------------------------
# Library templates, a system message and two turns


def test_llama3_instruct_two_turns():
    assert render(LLAMA3_INSTRUCT, TWO_TURNS) == (
        "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHi. How can I help?<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_chatml_two_turns():
    assert render(CHATML, TWO_TURNS) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\nHi. How can I help?<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_gemma3_slice_len_and_dollar_access():
    # the system message renders nothing itself; $.System goes into the first user turn (index 1);
    # $last is true on the last message only; the file's final newline follows the range
    assert render(GEMMA3_INSTRUCT, TWO_TURNS) == (
        "<start_of_turn>user\nYou are a helpful assistant.\n\nHello!<end_of_turn>\n"
        "<start_of_turn>model\nHi. How can I help?<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n\n")


def test_alpaca_variables_assigned_across_iterations():
    # $system is declared outside the range, set by the system message, printed and reset by the
    # first user message: the second user message gets no system text
    assert render(ALPACA, TWO_TURNS) == (
        "You are a helpful assistant.\n\n"
        "### Instruction:\nHello!\n\n"
        "### Response:\nHi. How can I help?\n\n"
        "### Instruction:\nWhat is 2+2?\n\n"
        "### Response:\n")


def test_alpaca_joins_two_system_messages_with_printf():
    msgs = [{"role": "system", "content": "A"}, {"role": "user", "content": "x"},
            {"role": "system", "content": "B"}, {"role": "user", "content": "y"}]
    assert render(ALPACA, msgs) == "A\n\n### Instruction:\nx\n\nB\n\n### Instruction:\ny\n\n### Response:\n"


def test_command_r_without_tools_uses_system_and_continue():
    assert render(COMMAND_R, TWO_TURNS) == (
        "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a helpful assistant.<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hello!<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hi. How can I help?<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>What is 2+2?<|END_OF_TURN_TOKEN|>"
        "<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>\n")


def test_legacy_template_runs_per_turn_and_cuts_after_response():
    # each finished turn renders whole; the last renders up to {{ .Response }} (empty) and stops,
    # so the output equals the .Messages template's
    assert render(CHATML_LEGACY, TWO_TURNS) == render(CHATML, TWO_TURNS)


def test_legacy_template_with_assistant_prefill():
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    assert render(CHATML_LEGACY, msgs) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHel"


def test_prompt_only_template_gets_response_appended():
    t = OllamaTemplate("{{ .Prompt }}")
    assert t.vars == ["prompt"] and not t.uses_messages
    assert t.render([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                     {"role": "user", "content": "c"}]) == "abc"


def test_suffix_mode():
    t = OllamaTemplate("{{- if .Suffix }}<PRE> {{ .Prompt }} <SUF>{{ .Suffix }} <MID>\n{{- else }}{{ .Prompt }}\n{{- end }}")
    assert t.render(prompt="def add(", suffix="return x") == "<PRE> def add( <SUF>return x <MID>"
    assert t.render([{"role": "user", "content": "hello"}]) == "hello"


# --------------------------------------------------------------------------------------------
# Tool calls


def test_mistral_tool_call_and_result():
    # the assistant's call: arguments re-encoded by json (keys sorted, compact); the tool result
    # is pasted as is; the tools list shows only within the last two messages (not here)
    assert render(MISTRAL_TOOLS, TOOL_CALL, TOOLS) == (
        "[INST] Weather in Paris?[/INST]"
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"location":"Paris","unit":"celsius"}}]</s>'
        '[TOOL_RESULTS] {"content": {"temperature": 21}}[/TOOL_RESULTS]')


def test_mistral_first_turn_lists_tools_as_ollama_json():
    # json $.Tools: Ollama's field order (type, function{name, description, parameters{type,
    # required, properties}}), properties sorted, empty fields omitted
    tools_json = ('[{"type":"function","function":{"name":"get_weather","description":"Get the current weather",'
                  '"parameters":{"type":"object","required":["location"],"properties":{'
                  '"location":{"type":"string","description":"City name"},'
                  '"unit":{"type":"string","enum":["celsius","fahrenheit"]}}}}}]')
    assert render(MISTRAL_TOOLS, TOOL_CALL[:2], TOOLS) == (
        f"[AVAILABLE_TOOLS] {tools_json}[/AVAILABLE_TOOLS][INST] You are a helpful assistant.\n\nWeather in Paris?[/INST]")


def test_command_r_with_tools_and_a_tool_call():
    tools_block = (
        "\n\n```python\ndef get_weather(location: string, unit: string, ) -> List[Dict]:\n"
        "    '''Get the current weather\n\n    Args:\n"
        "        location (string): City name\n"
        "        unit (string): \n"          # no description: the space before it stays
        "    '''\n    pass\n```")
    assert render(COMMAND_R, TOOL_CALL, TOOLS) == (
        "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>" + _SAFETY
        + "# User Preamble\nYou are a helpful assistant.\n\n## Available Tools\n"
        + "Here is a list of tools that you have available to you:" + tools_block + "<|END_OF_TURN_TOKEN|>"
        + "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Weather in Paris?<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>" + _ACTION
        + "<|END_OF_TURN_TOKEN|>"
        + '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>\nAction: ```json\n[\n    {\n        "tool_name": "get_weather",\n'
        + '        "parameters": {"location":"Paris","unit":"celsius"}\n    }\n]```<|END_OF_TURN_TOKEN|>'
        + '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|><results>\nconsole_output: {"temperature": 21}\n</results>'
        + "<|END_OF_TURN_TOKEN|>"
        + "<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>\n")


def test_tool_call_fields_and_arguments_print_as_json():
    out = render('{{ range .Messages }}{{ range .ToolCalls }}{{ .ID }}|{{ .Function.Index }}|{{ .Function.Name }}|'
                 '{{ .Function.Arguments }}|{{ range $k, $v := .Function.Arguments }}{{ $k }}={{ $v }};{{ end }}'
                 '{{ end }}{{ if eq .Role "tool" }}{{ .ToolName }} {{ .ToolCallID }}{{ end }}{{ end }}',
                 TOOL_CALL, TOOLS)
    assert out == 'call_1|0|get_weather|{"location":"Paris","unit":"celsius"}|location=Paris;unit=celsius;get_weather call_1'


def test_tools_print_as_json_and_nil_tools_print_null():
    t = OllamaTemplate("{{ range .Messages }}{{ end }}{{ .Tools }}|{{ if .Tools }}yes{{ else }}no{{ end }}")
    assert t.render(TWO_TURNS) == "null|no"
    assert t.render(TWO_TURNS, []) == "[]|no"
    assert t.render(TWO_TURNS, TOOLS).startswith('[{"type":"function","function":{"name":"get_weather"')


# --------------------------------------------------------------------------------------------
# The data model (Ollama's Values)


def test_chat_values_from_openai_messages():
    v = chat_values(TOOL_CALL, TOOLS, think=True)
    assert v["System"] == SYSTEM and v["Response"] == ""
    assert (v["Think"], v["ThinkLevel"], v["IsThinkSet"]) == (True, "medium", True)
    roles = [m.fields["Role"] for m in v["Messages"]]
    assert roles == ["system", "user", "assistant", "tool"]  # system messages stay in the list
    call = v["Messages"][2].fields["ToolCalls"][0]
    assert call.fields["ID"] == "call_1"
    assert call.fields["Function"].fields["Arguments"] == {"location": "Paris", "unit": "celsius"}
    assert v["Messages"][3].fields["ToolName"] == "get_weather"  # found from tool_call_id
    assert chat_values(TWO_TURNS)["IsThinkSet"] is False
    assert chat_values(TWO_TURNS, think="high")["ThinkLevel"] == "high"


def test_collate_merges_consecutive_roles_but_not_tools():
    msgs = template_messages([{"role": "system", "content": "a"}, {"role": "system", "content": "b"},
                              {"role": "user", "content": "x"}, {"role": "User", "content": "y"},
                              {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}])
    system, out = collate(msgs)
    assert system == "a\n\nb"
    assert [(m["role"], m["content"]) for m in out] == [("system", "a\n\nb"), ("user", "x\n\ny"),
                                                      ("tool", "1"), ("tool", "2")]


def test_content_parts_and_numbers_like_go():
    msgs = template_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                              {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"n": 3}}}]}])
    assert [m["content"] for m in msgs] == ["a", "b", ""]
    n = msgs[2]["tool_calls"][0]["function"]["arguments"]["n"]
    assert n == 3.0 and type(n) is float  # Go decodes JSON numbers into float64
    assert render("{{ range .Messages }}{{ range .ToolCalls }}{{ .Function.Arguments.n }}{{ end }}{{ end }}",
                  msgs) == "3"


@pytest.mark.parametrize("msg, error", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}, "vision is not supported"),
    ({"role": "user", "content": "x", "images": ["aGk="]}, "vision is not supported"),
    ({"role": "assistant", "content": None}, "invalid message content type: <nil>"),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]},
     "invalid tool call arguments"),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f",
                                                                        "arguments": "[" * 5000 + "]" * 5000}}]},
     "invalid tool call arguments"),  # deeper than the stack: a 400, not a RecursionError (500)
])
def test_messages_refused(msg, error):
    with pytest.raises(InvalidInputError, match=error):
        template_messages([msg])


def test_merge_model_messages():
    model = [{"role": "user", "content": "m"}]
    assert merge_model_messages([{"role": "user", "content": "r"}], "S", model) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "m"}, {"role": "user", "content": "r"}]
    assert merge_model_messages([{"role": "system", "content": "own"}], "S") == [{"role": "system", "content": "own"}]


def test_tool_property_keeps_ollama_fields_only():
    tools = template_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": ["integer", "null"], "default": 3, "minimum": 1, "description": "count"}}}}}])
    prop = tools[0].fields["Function"].fields["Parameters"].fields["Properties"]["n"]
    assert go_json(prop) == '{"type":["integer","null"],"description":"count"}'
    assert GoTemplate("{{ .Type }}|{{ toTypeScriptType . }}").execute(prop) == "[integer null]|number | null"


# --------------------------------------------------------------------------------------------
# Go's rules


def ex(text: str, data=None) -> str:
    return GoTemplate(text).execute({} if data is None else data)


@pytest.mark.parametrize("value, truth", [
    ("", False), ("x", True), (0, False), (2, True), (0.0, False), ([], False), ([0], True), ({}, False),
    ({"a": 1}, True), (None, False), (False, False), (GoStruct("T", {}), True)])
def test_truthiness(value, truth):
    assert ex("{{ if .V }}T{{ else }}F{{ end }}", {"V": value}) == ("T" if truth else "F")


def test_missing_map_key_is_no_value_and_missing_struct_field_is_an_error():
    assert ex("{{ .Nope }}|{{ if .Nope }}x{{ end }}|{{ eq .Nope \"a\" }}") == "<no value>||false"
    with pytest.raises(GoTemplateExecError, match=r"can't evaluate field Nope in type T"):
        ex("{{ .S.Nope }}", {"S": GoStruct("T", {"A": 1})})
    with pytest.raises(GoTemplateExecError, match=r"nil pointer evaluating interface \{\}\.B"):
        ex("{{ .A.B }}")


def test_eq_several_arguments_and_kinds():
    assert ex('{{ eq 1 2 3 1 }} {{ eq "a" "b" "c" }} {{ ne 1 2 }} {{ lt 1 2 }} {{ le 2 2 }} {{ gt "b" "a" }} {{ ge 1 2 }}') \
        == "true false true true true true false"
    with pytest.raises(GoTemplateExecError, match="incompatible types for comparison"):
        ex("{{ eq 1 1.0 }}")
    with pytest.raises(GoTemplateExecError, match="invalid type for comparison"):
        ex("{{ lt true false }}")


def test_and_or_return_the_deciding_value_and_stop():
    assert ex('{{ and 1 0 2 }}|{{ or 0 "" "x" }}|{{ and 1 2 }}|{{ or 0 "" }}|{{ not 0 }}') == '0|x|2||true'
    # or stops at the first true argument: the failing call after it is never made
    assert ex('{{ or 1 (index .L 5) }}', {"L": []}) == "1"


def test_len_slice_index_count_bytes():
    assert ex('{{ len "héllo" }} {{ slice "héllo" 0 1 }} {{ index "abc" 1 }} {{ len .L }} {{ index .L 1 }} '
              '{{ slice .L 1 | len }} {{ index .M "k" }}', {"L": [1, 2, 3], "M": {"k": "v"}}) == "6 h 98 3 2 2 v"
    with pytest.raises(GoTemplateExecError, match="index out of range: 3"):
        ex("{{ index .L 3 }}", {"L": [1, 2, 3]})
    with pytest.raises(GoTemplateExecError, match="len of type int"):
        ex("{{ len 3 }}")


def test_range_forms():
    data = {"L": ["a", "b", "c"], "M": {"b": 2, "a": 1}}
    assert ex("{{ range .L }}{{ . }}{{ end }}|{{ range $i, $v := .L }}{{ $i }}{{ $v }}{{ end }}|"
              "{{ range $k, $v := .M }}{{ $k }}={{ $v }};{{ end }}|{{ range .None }}x{{ else }}empty{{ end }}|"
              "{{ range $i, $v := .L }}{{ if eq $i 1 }}{{ continue }}{{ end }}{{ if eq $i 2 }}{{ break }}{{ end }}{{ $v }}{{ end }}|"
              "{{ range 3 }}{{ . }}{{ end }}", data) == "abc|0a1b2c|a=1;b=2;|empty|a|012"


def test_variables_scope_and_assignment():
    assert ex("{{ $x := 1 }}{{ if true }}{{ $x = 2 }}{{ $y := 3 }}{{ end }}{{ $x }}") == "2"
    with pytest.raises(GoTemplateSyntaxError, match='undefined variable "\\$y"'):
        GoTemplate("{{ if true }}{{ $y := 3 }}{{ end }}{{ $y }}")
    assert ex("{{ range .L }}{{ $.Top }}{{ end }}", {"L": [1, 2], "Top": "t"}) == "tt"


def test_with_and_else_with():
    assert ex("{{ with .A }}[{{ . }}]{{ else with .B }}({{ . }}){{ else }}none{{ end }}", {"A": "", "B": "b"}) == "(b)"


def test_pipelines_and_parentheses():
    assert ex('{{ "a" | printf "%s-%s" "b" }}|{{ .L | len | printf "%03d" }}|{{ (index .L 0).X }}',
              {"L": [{"X": "x"}]}) == "b-a|001|x"


def test_whitespace_trimming_and_comments():
    assert ex("a  {{- \" b \" -}}  c\n{{- 3}}\n{{ 4 -}}\n\n d") == "a b c3\n4d"
    assert ex("x {{- /* gone */ -}} y{{/* also */}}z") == "xyz"
    assert ex("{{-3}} {{ -3 }}") == "-3 -3"  # "-" then a digit is a number, not a trim marker


def test_define_template_block():
    assert ex('{{ define "x" }}<{{ . }}>{{ end }}{{ template "x" .A }}{{ block "y" 5 }}b{{ . }}{{ end }}',
              {"A": "a"}) == "<a>b5"


def test_print_functions_and_number_formatting():
    assert ex('{{ print 1 2 "a" 3 "b" "c" }}|{{ println 1 "a" }}|{{ 1e6 }} {{ 100000.0 }} {{ 0.00001 }} {{ 0x10 }} {{ \'a\' }}') \
        == '1 2a3bc|1 a\n|1e+06 100000 1e-05 16 97'
    assert go_sprintf("%s|%d|%5.1f|%-4s|%q|%x|%v|%t|%%", "s", 42, 2.25, "ab", "a\nb", 255, [1, "x"], True) \
        == 's|42|  2.2|ab  |"a\\nb"|ff|[1 x]|true|%'
    assert [go_format_float(f) for f in (1048576.0, 0.1, 1e21, -2.5, 123456.0)] == \
        ["1.048576e+06", "0.1", "1e+21", "-2.5", "123456"]


def test_json_is_go_encoding():
    assert ex('{{ json .V }}', {"V": {"b": [1, 1.5, None, True], "a": "<&>\u2028\n\b"}}) == \
        '{"a":"\\u003c\\u0026\\u003e\\u2028\\n\\b","b":[1,1.5,null,true]}'
    assert ex("{{ json 1e21 }} {{ json 1e-7 }} {{ json 100000000.0 }} {{ json .Nope }}") == "1e+21 1e-7 100000000 null"


def test_html_js_urlquery():
    assert ex("{{ html \"<a href='x'>&\" }} {{ js \"a'b<\" }} {{ urlquery \"a b&c\" }}") == \
        "&lt;a href=&#39;x&#39;&gt;&amp; a\\'b\\u003C a+b%26c"


# --------------------------------------------------------------------------------------------
# Errors and limits


@pytest.mark.parametrize("text, message", [
    ("{{ .Prompt ", "1:12: unclosed action"),
    ("a\n{{ if .X }}", "2:12: unexpected EOF"),
    ("{{ end }}", "unexpected {{end}}"),
    ("{{ if }}{{ end }}", "missing value for if"),
    ("{{ undefinedfn 1 }}", '1:4: function "undefinedfn" not defined'),
    ("{{ call .F }}", 'function \'call\' is not supported'),
    ("{{ break }}", "{{break}} outside {{range}}"),
    ("{{ .X | 3 }}", "non executable command in pipeline stage 2"),
    ("{{ 1+2i }}", "complex numbers are not supported"),
    ("{{ /* spaced */ }}", 'unexpected "/" in command'),  # a comment must touch the delimiters
    ("{{/* x */ y }}", "comment ends before closing delimiter"),
    ("{{ range $a, $b, $c := .X }}{{ end }}", "too many declarations in range"),
    ("{{ if 1 }}" * 101 + "{{ end }}" * 101, "nesting deeper than 100 levels"),
])
def test_syntax_errors_name_position(text, message):
    with pytest.raises(GoTemplateSyntaxError) as e:
        GoTemplate(text)
    assert message in str(e.value)
    assert e.value.line >= 1 and e.value.col >= 1


def test_undefined_template_without_pipeline_is_refused_like_ollama():
    with pytest.raises(GoTemplateSyntaxError, match="undefined template specified"):
        OllamaTemplate('{{define "x"}}{{template "x"}}{{end}}{{template "x"}}')


def test_exec_errors_name_the_construct():
    with pytest.raises(GoTemplateExecError) as e:
        ex("ab\n  {{ len 3 }}")
    assert str(e.value).startswith('template: :2:6: executing "" at <len 3>: error calling len: len of type int')
    with pytest.raises(GoTemplateExecError, match="can't print a value of type T"):
        ex("{{ .S }}", {"S": GoStruct("T", {})})
    with pytest.raises(GoTemplateExecError, match="%s does not fit a value of type int"):
        ex('{{ printf "%s" 1 }}')


def test_limits():
    with pytest.raises(GoTemplateLimitError, match="exceeded maximum template depth"):
        ex('{{ define "r" }}{{ template "r" . }}{{ end }}{{ template "r" . }}')
    with pytest.raises(GoTemplateLimitError, match="output longer than 100 characters"):
        GoTemplate("{{ range .L }}0123456789{{ end }}").execute({"L": list(range(11))}, RenderLimits(max_output_chars=100))
    with pytest.raises(GoTemplateLimitError, match="evaluation steps"):
        GoTemplate("{{ range 100000 }}{{ end }}").execute({}, RenderLimits(max_steps=1000))


def test_no_python_attribute_access():
    class Secret:
        password = "hunter2"

    with pytest.raises(GoTemplateExecError):
        ex("{{ .S.password }}", {"S": Secret()})
    with pytest.raises(GoTemplateExecError):
        ex("{{ .S }}", {"S": Secret()})


def test_template_is_reusable_and_output_is_deterministic():
    t = OllamaTemplate(COMMAND_R)
    assert t.render(TOOL_CALL, TOOLS) == t.render(TOOL_CALL, TOOLS)
    assert json.loads(render("{{ json .Messages }}", TWO_TURNS))[1]["Content"] == "Hello!"


def _bounded(fn):
    """Run fn; assert it took under a second and allocated little (tracemalloc peak)."""
    import time
    import tracemalloc
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert time.monotonic() - t0 < 1.0
    assert peak < 64 << 20, peak


@pytest.mark.parametrize("template", [
    '{{printf "%09999999999d" 1}}',
    '{{printf "%.9999999999f" 1.5}}',
    '{{printf "%9999999999s" "a"}}',
    '{{printf "%.1000001e" 1.5}}',
])
def test_printf_huge_width_or_precision_fails_before_formatting(template):
    def go():
        with pytest.raises(GoTemplateExecError, match=r"^template: :1:3: executing .* error calling printf: "
                                                      r"printf: (width|precision) \d+ is larger than 1000000"):
            ex(template)
    _bounded(go)


def test_printf_star_width_is_refused():
    with pytest.raises(GoTemplateExecError, match=r"'\*' width or precision is not supported"):
        ex('{{printf "%*d" 999999999 1}}')
    with pytest.raises(GoTemplateExecError, match=r"'\*' width or precision is not supported"):
        ex('{{printf "%.*f" 999999999 1.5}}')


def test_printf_width_up_to_go_cap_still_works():
    assert ex('{{printf "%05d|%.3f|%-3s|" 7 1.5 "a"}}') == "00007|1.500|a  |"
    assert len(ex('{{printf "%01000000d" 1}}')) == 1_000_000


def test_printf_many_wide_verbs_stop_at_the_output_limit():
    tpl = "{{printf \"" + "%0999999d" * 1000 + "\"" + " 1" * 1000 + "}}"

    def go():
        with pytest.raises(GoTemplateLimitError, match="output longer than 1000 characters"):
            GoTemplate(tpl).execute({}, RenderLimits(max_output_chars=1000))
    _bounded(go)


@pytest.mark.parametrize("fn", ["printf \"%s%s%s%s\"", "print", "println", "html", "js", "urlquery"])
def test_variables_cannot_double_past_the_output_limit(fn):
    # each step quadruples the string held in a variable; nothing is written until the end
    step = "{{ $a = " + fn + " $a $a $a $a }}"
    tpl = '{{ $a := "0123456789" }}' + step * 30 + "{{ $a }}"

    def go():
        with pytest.raises(GoTemplateLimitError, match="output longer than 100000 characters"):
            GoTemplate(tpl).execute({}, RenderLimits(max_output_chars=100_000))
    _bounded(go)


def test_printf_c_of_an_invalid_rune_is_replacement_character():
    assert ex('{{printf "%c|%c|%c" 65 99999999999 55296}}') == "A|\ufffd|\ufffd"
